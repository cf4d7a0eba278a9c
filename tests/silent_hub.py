"""A silent hub: what a paused or wedged hub looks like from the bus."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import nats

from reach_mesh import MeshSettings, protocol
from reach_mesh._nats import flushed


@asynccontextmanager
async def silent_hub(settings: MeshSettings, verb: str = "heartbeat") -> AsyncIterator[list[str]]:
    """A member of the hubs' queue group that takes every heartbeat (or other agent ``verb``)
    it is given and never answers; yields the subjects of the requests it took."""
    assert settings.nats_url is not None
    nc = await nats.connect(settings.nats_url)
    taken: list[str] = []

    async def swallow(msg: Any) -> None:
        taken.append(msg.subject)

    sub = await nc.subscribe(
        protocol.hub_agent_subject("*.*.*", verb), queue=protocol.HUB_QUEUE, cb=swallow
    )
    await flushed(nc)  # in the queue group before the caller's agents beat
    try:
        yield taken
    finally:
        await sub.unsubscribe()
        await nc.close()
