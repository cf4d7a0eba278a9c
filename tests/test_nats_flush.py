"""nats-py 2.16's ``flush(timeout)`` that times out (or is cancelled) leaves its cancelled
future among the PINGs awaiting their PONG; the PONG, when it comes, has ``set_result`` raise
``InvalidStateError`` in the connection's read loop, which ends: the connection still says
connected and reads nothing more — a deaf hub or agent. reach-mesh's connection
(``_nats.connect``) takes such a PONG without touching the future. Against a real nats-server:
a PONG held behind a backlog the loop has not read yet."""

from __future__ import annotations

import asyncio
import contextlib
import threading

import nats
import nats.errors
import pytest
from nats.aio.msg import Msg

from reach_mesh._nats import connect

pytestmark = pytest.mark.timeout(60)

_BACKLOG = 60_000


def _flood(url: str, subject: str) -> None:
    """Publish a backlog for ``subject`` from another thread's loop (this one is blocked)."""

    async def run() -> None:
        nc = await nats.connect(url)
        try:
            for _ in range(_BACKLOG):
                await nc.publish(subject, b"x" * 100)
            await nc.flush()
        finally:
            await nc.close()

    asyncio.run(run())


async def test_a_flush_that_timed_out_leaves_the_connection_reading(nats_url: str) -> None:
    nc = await connect(nats_url, name="flush-timeout")
    try:
        got: list[str] = []

        async def on_msg(msg: Msg) -> None:
            got.append(msg.subject)

        await nc.subscribe("flush.junk", cb=on_msg)
        await nc.subscribe("flush.after", cb=on_msg)
        await nc.flush()
        flood = threading.Thread(target=_flood, args=(nats_url, "flush.junk"))
        flood.start()
        flood.join()  # (this loop blocked meanwhile: the backlog waits in the socket)
        with pytest.raises(nats.errors.TimeoutError):
            await nc.flush(timeout=0.001)  # type: ignore[arg-type]
        # The backlog is read, the late PONG with it; then a message sent after.
        sender = await nats.connect(nats_url)
        try:
            for _ in range(200):
                if got.count("flush.junk") == _BACKLOG:
                    break
                await asyncio.sleep(0.05)
            await sender.publish("flush.after", b"1")
            await sender.flush()
        finally:
            await sender.close()
        for _ in range(100):
            if "flush.after" in got:
                break
            await asyncio.sleep(0.05)
        assert "flush.after" in got, f"read {got.count('flush.junk')} of the backlog, then none"
        await nc.flush(timeout=5)  # and the PINGs after it are answered
    finally:
        await nc.close()


async def test_a_publish_into_a_socket_closed_under_nats_py_goes_out_after_reconnecting(
    nats_url: str,
) -> None:
    """The socket closes under a connection nats-py still calls connected: its flusher, writing
    into it, ended on uvloop's ``RuntimeError`` (it breaks on that without a word), and its read
    loop has not taken the close for a loss yet. nats-py then writes each publish into the
    closed socket itself and raises that ``RuntimeError`` to the publisher — a hub's step took
    it for a crash and failed its workflow (chaos secure seed 216, ``partition``). reach-mesh's
    connection keeps the publish pending, reconnects, and sends it."""
    nc = await connect(nats_url, name="socket-gone")
    watcher = await nats.connect(nats_url)
    try:
        sub = await watcher.subscribe("gone.after")
        await watcher.flush()
        flusher = nc._flusher_task
        assert flusher is not None
        flusher.cancel()  # (as nats-py's flusher ends on the RuntimeError: the task done)
        with contextlib.suppress(asyncio.CancelledError):
            await flusher
        assert nc.is_connected
        nc._transport._io_writer.transport.abort()  # type: ignore[union-attr]
        # No await between the close and the publish: the read loop has not seen it.
        await nc.publish("gone.after", b"kept")
        msg = await sub.next_msg(timeout=10)
        assert msg.data == b"kept"
        assert nc.is_connected and nc.stats["reconnects"] >= 1
    finally:
        await watcher.close()
        await nc.close()
