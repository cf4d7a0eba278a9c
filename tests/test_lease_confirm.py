"""Before a hub declares an agent LOST it reads the agent's heartbeat back from JetStream: a
beat its watch missed (a watch that lagged or was being restarted) renews the lease. That read
must come from the stream's leader, and only "no message" may count as "no beat": a replica
that is behind, or a stream being recovered, knows nothing.

The hub's heartbeat watch is stopped in these tests, and the beats are written to the bucket
as another hub writes them: what a hub whose watch lags sees of an agent that beats through
the other hubs. Against a real nats-server."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import Any

import nats

from reach_mesh import MeshSettings, protocol
from reach_mesh.hub import Hub
from reach_mesh.models import AgentCard, AgentState, HeartbeatRecord, RegisterRequest
from reach_mesh.server import EmbeddedNats

from .helpers import eventually

_HB_STREAM = f"KV_{protocol.KV_HEARTBEATS}"


async def _register(nc: Any, agent_id: str, session: str) -> None:
    req = RegisterRequest(
        card=AgentCard(agent_id=agent_id, capabilities=["lease:confirm:v1"]),
        session=session,
        heartbeat_interval=0.2,
        lease_timeout=0.6,
    )
    reply = await nc.request(
        protocol.hub_agent_subject(agent_id, "register"), protocol.encode(req), timeout=5
    )
    protocol.raise_for_error(reply.data)


def _stop_heartbeat_watch(hub: Hub) -> None:
    (watch,) = [t for t in hub.registry._tasks if t.get_name() == "reach-watch-heartbeats"]
    watch.cancel()


def _states(hub: Hub, agent_id: str) -> list[AgentState]:
    seen: list[AgentState] = []
    hub.registry.on_state_change(
        lambda view, old, new: view.agent_id == agent_id and seen.append(new)
    )
    return seen


async def test_a_missed_beat_is_read_from_the_stream_leader(
    hub: Hub, settings: MeshSettings
) -> None:
    """Beats the hub's watch never delivers keep the agent out of LOST, each confirmed by a
    leader read (``STREAM.MSG.GET``), never by a direct get; once they stop, it is LOST."""
    agent_id = f"{settings.namespace}.confirm.a1"
    session = uuid.uuid4().hex
    nc = await nats.connect(settings.nats_url)
    try:
        reads: list[tuple[str, bytes]] = []

        async def read(msg: Any) -> None:
            reads.append((msg.subject, msg.data))

        await nc.subscribe(f"$JS.API.STREAM.MSG.GET.{_HB_STREAM}", cb=read)
        await nc.subscribe(f"$JS.API.DIRECT.GET.{_HB_STREAM}.>", cb=read)
        await nc.flush()
        await _register(nc, agent_id, session)
        _stop_heartbeat_watch(hub)
        seen = _states(hub, agent_id)
        kv = await nc.jetstream().key_value(protocol.KV_HEARTBEATS)
        beat = protocol.encode(HeartbeatRecord(session=session))
        # Lease 0.6 s + grace 0.6 s: a confirmation every 1.2 s or so; 3.5 s of beats is two
        # at least, with room for a loaded machine.
        end = time.monotonic() + 3.5
        while time.monotonic() < end:
            await kv.put(agent_id, beat)
            await asyncio.sleep(0.15)
        assert AgentState.LOST not in seen, seen
        assert hub.registry.agents[agent_id].state is not AgentState.LOST
        subject = f"$KV.{protocol.KV_HEARTBEATS}.{agent_id}"
        leader = [
            s for s, d in reads if ".MSG.GET." in s and json.loads(d)["last_by_subj"] == subject
        ]
        direct = [s for s, _ in reads if ".DIRECT.GET." in s and s.endswith(agent_id)]
        assert len(leader) >= 2, reads
        assert direct == []
        # No more beats: the last one counted from when it was read, then the lease runs out.
        await eventually(lambda: AgentState.LOST in seen, timeout=5)
    finally:
        await nc.close()


async def test_no_heartbeat_stream_is_not_a_missing_beat(settings: MeshSettings) -> None:
    """A leader read that finds no stream (10059: being recovered, or gone) leaves the hub
    blind, and the overdue agent SUSPECT, not LOST: only 10037 (no message) means that no
    beat is stored. (A direct get found no responders there; a leader read answers 404.)"""
    async with EmbeddedNats() as server:
        s = settings.model_copy(update={"nats_url": server.url})
        async with Hub(settings=s) as hub:
            agent_id = f"{s.namespace}.confirm.a2"
            nc = await nats.connect(server.url)
            try:
                await _register(nc, agent_id, uuid.uuid4().hex)
                _stop_heartbeat_watch(hub)
                seen = _states(hub, agent_id)
                await nc.jetstream().delete_stream(_HB_STREAM)
                # Well past lease + grace (1.2 s), confirmed every liveness pass (50 ms).
                await eventually(lambda: AgentState.SUSPECT in seen, timeout=5)
                await asyncio.sleep(2.0)
                assert AgentState.LOST not in seen, seen
                assert hub.registry.agents[agent_id].state is AgentState.SUSPECT
            finally:
                await nc.close()
