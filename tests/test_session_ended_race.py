"""A registration whose session check passed before its agent unregistered — the hub paused,
or its JetStream writes slow, between the check and the record's write — is refused: the
record is written only over the entry the check read (compare-and-set), so it never lands on
the unregister's delete marker and brings the gone agent back until its lease runs out."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import pytest
from nats.js.errors import KeyDeletedError, KeyNotFoundError

from reach_mesh import MeshSettings, protocol
from reach_mesh.errors import SessionEndedError
from reach_mesh.hub import Hub
from reach_mesh.models import AgentCard, RegisterRequest

from .helpers import eventually


async def test_an_unregister_between_the_check_and_the_write_is_not_undone(
    settings: MeshSettings, namespace: str, nc: Any
) -> None:
    agent_id = f"{namespace}.race.a1"
    card = AgentCard(agent_id=agent_id, capabilities=["race:echo:v1"])
    req = RegisterRequest(
        card=card, session=uuid.uuid4().hex, heartbeat_interval=20, lease_timeout=60
    )
    subject = protocol.agent_task(agent_id)
    async with Hub(settings=settings) as late, Hub(settings=settings) as other:
        checked, go = asyncio.Event(), asyncio.Event()
        assert late.registry._hb_kv is not None
        put = late.registry._hb_kv.put

        async def slow_put(key: str, value: bytes, *args: Any, **kw: Any) -> int:
            # The session check is done; the hub pauses (or JetStream is slow) here.
            checked.set()
            await go.wait()
            return await put(key, value, *args, **kw)

        late.registry._hb_kv.put = slow_put  # type: ignore[method-assign]
        held = asyncio.create_task(late.registry.register(req, subject))
        await asyncio.wait_for(checked.wait(), 5)
        # Meanwhile the agent, answered by the other hub, unregisters and leaves.
        await other.registry.register(req, subject)
        await eventually(lambda: agent_id in other.registry.agents)
        assert await other.registry.unregister(agent_id, req.session)
        go.set()
        with pytest.raises(SessionEndedError):
            await asyncio.wait_for(held, 10)
        kv = await nc.jetstream().key_value(protocol.KV_AGENTS)
        with pytest.raises((KeyDeletedError, KeyNotFoundError)):
            await kv.get(agent_id)
        await asyncio.sleep(0.3)
        assert agent_id not in other.registry.agents
