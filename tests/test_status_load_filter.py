"""An agent's start-up load of its final statuses (``_consume.last_per_subject``).

It reads under the one consumer name its permissions allow (``protocol.status_consumer``), so
no other agent can re-create that consumer with other subjects as the filter (before, the
name was random and any agent that learned it could; ``tests/test_security_nats.py`` checks
the permission). Whoever could — a hub-level identity — the load must never take another's
status events for its own: a result it would remember and answer a repeat with.

The first test runs the reader on an event loop of its own, in a thread: stalled there while
most of its messages are still at the server, a forged message is stored on another subject
and the consumer is re-pointed there; then it reads on. What holds it on nats-server 2.15.1:
the next message the server sends after the re-point says nothing is pending (``num_pending``
0, though the forged message is stored beyond it; why was not looked into), and the load ends
there, short and without the forged message. The subject check in ``last_per_subject``
(``refuse``) is what holds it on a server that would deliver on; this test does not reach it
(it passes without it), and asserts the property.

The second: a load under a fixed name reads everything each time (the old consumer of that
name is deleted first: re-created as it was, the server would hand it back, with nothing left
to deliver)."""

from __future__ import annotations

import asyncio
import threading
import uuid
from dataclasses import replace
from typing import Any

import nats
import pytest
from nats.aio.msg import Msg

from reach_mesh._consume import last_per_subject

from .helpers import LoopThread, eventually

pytestmark = pytest.mark.timeout(60)

#: Messages on the reader's own subjects: more than the server pushes to a stalled client.
_OWN = 20_000


async def test_a_status_load_keeps_only_its_own_subjects(nats_url: str) -> None:
    nc = await nats.connect(nats_url)
    js = nc.jetstream()
    stream = f"LPS_{uuid.uuid4().hex[:8]}"
    prefix = stream.lower()
    await js.add_stream(name=stream, subjects=[f"{prefix}.>"])
    side = LoopThread()
    try:
        body = b"x" * 1024
        for i in range(_OWN):
            await nc.publish(f"{prefix}.own.t{i}", body)
        await nc.flush()
        await eventually(lambda: _stored(js, stream, _OWN))
        own, forged = f"{prefix}.own.*", f"{prefix}.other.forged"

        async def load() -> list[Msg]:
            reader = await nats.connect(nats_url)
            try:
                return await last_per_subject(reader.jetstream(), stream, own, timeout=10)
            finally:
                await reader.close()

        loading = asyncio.ensure_future(side.run(load()))
        found: list[Any] = []
        await eventually(lambda: _consumers(js, stream, found), interval=0.001)
        (info,) = found
        release = threading.Event()
        begun = side.stall(release, at_least=0.0, limit=10.0)
        await asyncio.to_thread(begun.wait, 5)
        await js.publish(forged, b'{"forged": true}')
        await js.add_consumer(
            stream, config=replace(info.config, filter_subject=f"{prefix}.other.*")
        )
        release.set()
        got = await asyncio.wait_for(loading, 30)
    finally:
        side.close()
        await js.delete_stream(stream)
        await nc.close()
    subjects = {m.subject for m in got}
    assert forged not in subjects
    assert all(s.startswith(f"{prefix}.own.") for s in subjects)
    assert got  # (on nats-server 2.15.1 here: 1,827 of the 20,000, the load ended short)


async def _stored(js: nats.js.JetStreamContext, stream: str, n: int) -> bool:
    return (await js.stream_info(stream)).state.messages >= n


async def _consumers(js: nats.js.JetStreamContext, stream: str, found: list[Any]) -> bool:
    found[:] = await js.consumers_info(stream)
    return bool(found)


async def test_a_load_under_a_fixed_name_reads_everything_each_time(nats_url: str) -> None:
    """An agent reads its final statuses back under the one consumer name its permissions
    allow. Created again as it was (a restart within its inactivity threshold), the server
    would hand back the old consumer, which has delivered everything: the load deletes it
    first, and when it is done."""
    nc = await nats.connect(nats_url)
    js = nc.jetstream()
    stream = f"LPS_{uuid.uuid4().hex[:8]}"
    prefix = stream.lower()
    await js.add_stream(name=stream, subjects=[f"{prefix}.>"])
    try:
        for i in range(5):
            await js.publish(f"{prefix}.own.t{i}", b"x")
        for _ in range(3):
            got = await last_per_subject(js, stream, f"{prefix}.own.*", timeout=3, name="fixed")
            assert [m.subject for m in got] == [f"{prefix}.own.t{i}" for i in range(5)]
            assert await js.consumers_info(stream) == []  # deleted when done
    finally:
        await js.delete_stream(stream)
        await nc.close()
