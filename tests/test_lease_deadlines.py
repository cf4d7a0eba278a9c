"""Lease boundaries as the grading loop finds them from its heap of deadlines: an agent that
stops beating is SUSPECT once its lease has run out (not before) and LOST once its grace has
too; one that beats is never SUSPECT, however many of its deadlines come up; one that comes
back from SUSPECT is tracked again. The loop looks only at agents whose deadline passed and at
those not steadily ONLINE. Against a real nats-server, agents speaking the wire protocol."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import nats

from reach_mesh import MeshSettings, protocol
from reach_mesh.hub import Hub
from reach_mesh.hub.registry import AgentView, stored_beat
from reach_mesh.models import AgentCard, AgentState, Heartbeat, HeartbeatRecord, RegisterRequest

from .helpers import eventually


class _Agent:
    """An agent by hand: register, beat, stop beating."""

    def __init__(self, nc: Any, agent_id: str, settings: MeshSettings) -> None:
        self.nc = nc
        self.agent_id = agent_id
        self.session = uuid.uuid4().hex
        self.settings = settings

    async def register(self) -> None:
        req = RegisterRequest(
            card=AgentCard(agent_id=self.agent_id, capabilities=["lease:deadline:v1"]),
            session=self.session,
            heartbeat_interval=self.settings.heartbeat_interval,
            lease_timeout=self.settings.lease_timeout,
        )
        subject = protocol.hub_agent_subject(self.agent_id, "register")
        reply = await self.nc.request(subject, protocol.encode(req), timeout=5)
        protocol.raise_for_error(reply.data)

    async def beat(self) -> str:
        hb = Heartbeat(agent_id=self.agent_id, session=self.session)
        subject = protocol.hub_agent_subject(self.agent_id, "heartbeat")
        reply = await self.nc.request(subject, protocol.encode(hb), timeout=5)
        protocol.raise_for_error(reply.data)
        return str(protocol.loads(reply.data)["state"])

    async def beat_for(self, seconds: float) -> None:
        loop = asyncio.get_running_loop()
        end = loop.time() + seconds
        while loop.time() < end:
            await self.beat()
            await asyncio.sleep(self.settings.heartbeat_interval)


def _transitions(hub: Hub, agent_id: str) -> list[tuple[float, AgentState, float]]:
    """(hub clock, new state, the view's last_seen) of every state change of ``agent_id``."""
    seen: list[tuple[float, AgentState, float]] = []

    def record(view: AgentView, old: AgentState, new: AgentState) -> None:
        if view.agent_id == agent_id:
            seen.append((hub.registry.now, new, view.last_seen))

    hub.registry.on_state_change(record)
    return seen


async def test_silent_agent_is_suspect_after_its_lease_and_lost_after_its_grace(
    hub: Hub, settings: MeshSettings
) -> None:
    assert settings.nats_url is not None
    nc = await nats.connect(settings.nats_url)
    try:
        agent = _Agent(nc, f"{settings.namespace}.deadline.a1", settings)
        await agent.register()
        seen = _transitions(hub, agent.agent_id)  # (after its registration's ONLINE)
        await agent.beat_for(1.5)  # past two of its deadlines: each pushed again, not graded
        assert seen == []
        assert agent.agent_id not in hub.registry._unsteady
        last = hub.registry.agents[agent.agent_id].last_seen
        await eventually(lambda: any(s is AgentState.LOST for _, s, _ in seen), timeout=10)
        lease, grace = settings.lease_timeout, settings.suspect_timeout
        suspect = [(t, ls) for t, s, ls in seen if s is AgentState.SUSPECT]
        lost = [(t, ls) for t, s, ls in seen if s is AgentState.LOST]
        assert [s for _, s, _ in seen] == [AgentState.SUSPECT, AgentState.LOST]
        # Graded on the hub's clock from the last beat it saw: not a moment early, and found
        # within a few passes of the loop (a loaded test machine may delay one).
        assert suspect[0][1] == last and lost[0][1] == last
        assert lease < suspect[0][0] - last < lease + 0.5
        assert lease + grace < lost[0][0] - last < lease + grace + 1.0
        assert agent.agent_id not in hub.registry.agents
        assert agent.agent_id not in hub.registry._unsteady
    finally:
        await nc.close()


async def test_agent_back_from_suspect_is_tracked_again(hub: Hub, settings: MeshSettings) -> None:
    assert settings.nats_url is not None
    nc = await nats.connect(settings.nats_url)
    try:
        agent = _Agent(nc, f"{settings.namespace}.deadline.a2", settings)
        await agent.register()
        seen = _transitions(hub, agent.agent_id)  # (after its registration's ONLINE)
        await agent.beat_for(0.5)
        await eventually(lambda: any(s is AgentState.SUSPECT for _, s, _ in seen), timeout=5)
        assert await agent.beat() == "ONLINE"  # back within its grace
        # Steady again: off the every-pass list, its next deadline on the heap.
        await eventually(lambda: agent.agent_id not in hub.registry._unsteady, timeout=5)
        await agent.beat_for(1.5)
        assert [s for _, s, _ in seen] == [AgentState.SUSPECT, AgentState.ONLINE]
        last = hub.registry.agents[agent.agent_id].last_seen
        await eventually(lambda: seen[-1][1] is AgentState.LOST, timeout=10)
        assert [s for _, s, _ in seen][2:] == [AgentState.SUSPECT, AgentState.LOST]
        assert settings.lease_timeout < seen[2][0] - last < settings.lease_timeout + 0.5
    finally:
        await nc.close()


async def test_a_fleet_of_steady_agents_is_not_graded_every_pass(
    hub: Hub, settings: MeshSettings
) -> None:
    """Many agents beating: none is SUSPECT, none on the every-pass list; the one that stops
    is found at its deadline among them."""
    assert settings.nats_url is not None
    nc = await nats.connect(settings.nats_url)
    try:
        agents = [_Agent(nc, f"{settings.namespace}.deadline.f{i}", settings) for i in range(40)]
        states: list[AgentState] = []
        hub.registry.on_state_change(lambda view, old, new: states.append(new))
        await asyncio.gather(*(a.register() for a in agents))
        states.clear()
        quiet = agents[0]
        quiet_seen = _transitions(hub, quiet.agent_id)
        await asyncio.gather(*(a.beat_for(2.0) for a in agents[1:]), quiet.beat_for(0.6))
        assert all(hub.registry.agents[a.agent_id].state is AgentState.ONLINE for a in agents[1:])
        assert not any(a.agent_id in hub.registry._unsteady for a in agents[1:])
        assert [s for _, s, _ in quiet_seen][:1] == [AgentState.SUSPECT]
        assert states.count(AgentState.SUSPECT) == 1  # the quiet one only
    finally:
        await nc.close()


async def test_a_drill_that_moves_last_seen_back_is_graded(
    hub: Hub, settings: MeshSettings
) -> None:
    """``simulate-lost`` moves ``last_seen`` back and regrades: the agent is SUSPECT at once
    and LOST after its grace, though its deadline on the heap is still ahead."""
    assert settings.nats_url is not None
    nc = await nats.connect(settings.nats_url)
    try:
        agent = _Agent(nc, f"{settings.namespace}.deadline.a3", settings)
        await agent.register()
        seen = _transitions(hub, agent.agent_id)  # (after its registration's ONLINE)
        await agent.beat()
        view = hub.registry.agents[agent.agent_id]
        view.last_seen = hub.registry.now - settings.lease_timeout - 1e-3
        hub.registry.regrade(view)
        assert view.state is AgentState.SUSPECT
        await eventually(lambda: seen[-1][1] is AgentState.LOST, timeout=5)
    finally:
        await nc.close()


def test_a_beat_is_stored_as_its_heartbeat_record() -> None:
    """What a hub writes for a beat (its fields but the agent id) reads back as the
    ``HeartbeatRecord`` the beat's fields make, whatever the beat says."""
    beats = [
        Heartbeat(agent_id="ns.svc.a1", session="s1"),
        Heartbeat(
            agent_id="ns.svc.a1",
            session="s" * 64,
            inflight=3,
            queue_depth=7,
            pressure=0.25,
            unavailable=["x:y:v1", "é:ü:v2"],
            draining=True,
        ),
    ]
    for hb in beats:
        stored = HeartbeatRecord.model_validate_json(stored_beat(hb))
        fields = hb.model_dump(exclude={"agent_id"})
        assert stored == HeartbeatRecord(**fields)
        assert "agent_id" not in protocol.loads(stored_beat(hb))
