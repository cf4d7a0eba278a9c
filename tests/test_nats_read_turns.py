"""reach-mesh's connection (``_nats._Connection._read_loop``) lets the event loop run between
two full reads of its socket while it is dropping what it reads (a slow consumer): nats-py's
parses all its socket's buffer holds before it awaits anything, and a connection flooded
faster than the process reads it held every other connection and task of the process behind
it (the hub's reply connections: ``hub/_reply_boxes.py``). A connection that keeps up reads
as nats-py does. Against a real nats-server: a backlog held in the socket, then read."""

from __future__ import annotations

import asyncio
import itertools

import nats
import pytest
from nats.aio.client import DEFAULT_BUFFER_SIZE

from reach_mesh._nats import connect, slow_drops

pytestmark = pytest.mark.timeout(60)

_BODY = b"x" * 1000
_BACKLOG = 2_000  # 2 MB: several of the event loop's reads of a socket (256 KiB each)
#: What one full read holds (a message on the wire: its body and a MSG line of some 30 bytes).
_ONE_READ = DEFAULT_BUFFER_SIZE // len(_BODY) + 1


@pytest.mark.parametrize("dropping", [True, False], ids=["dropping", "keeping-up"])
async def test_a_backlog_dropped_is_read_one_buffer_per_turn_of_the_event_loop(
    nats_url: str, dropping: bool
) -> None:
    """2 MB of 1,000-byte messages wait in the socket; once it is read again, a task that runs
    once per turn of the event loop counts the messages read between two of its turns. For a
    subscription that holds 10 and drops the rest: at most one read's worth (32 KiB, 33
    messages) — nats-py's read loop parsed up to 256 KiB, the event loop's read of a socket,
    at a time: 250 messages. For one that keeps them all, more than that at least once: read
    as nats-py reads."""
    nc = await connect(nats_url, name="read-turns")
    sender = await nats.connect(nats_url)
    try:
        limit = 10 if dropping else -1
        sub = await nc.subscribe("turns.backlog", pending_msgs_limit=limit)
        await nc.flush()
        socket = nc._transport._io_writer.transport  # type: ignore[union-attr]
        socket.pause_reading()
        for _ in range(_BACKLOG):
            await sender.publish("turns.backlog", _BODY)
        await sender.flush()
        await asyncio.sleep(0.3)  # (in the reader's socket, and the server's buffer for it)
        read0 = int(nc.stats["in_msgs"])
        socket.resume_reading()
        seen = [0]
        for _ in range(100_000):
            if seen[-1] >= _BACKLOG:
                break
            await asyncio.sleep(0)
            seen.append(int(nc.stats["in_msgs"]) - read0)
        assert seen[-1] == _BACKLOG
        assert (slow_drops(nc, sub._id) > 0) is dropping
        per_turn = max(b - a for a, b in itertools.pairwise(seen))
        if dropping:
            assert per_turn <= _ONE_READ, per_turn
        else:
            assert per_turn > _ONE_READ, per_turn
    finally:
        await sender.close()
        await nc.close()
