"""An agent this hub declared LOST whose record's delete did not land (JetStream could not
write then: secure chaos seed 158, ``partition``) is not brought back to life by that record.

A route naming the agent used to read the record back (``Registry.fetch``, for a registration
the watch has not shown yet) and install it as heard "now": ONLINE, out of ``recently_lost``;
and the leader read before LOST took the agent's last beat, from before the verdict, for a new
one (the new view's ``hb_revision`` was 0): routable for another lease and grace while it was
cut off. Only a sign of life stored after the verdict — a beat of its session, or its
registration written again — brings it back, and then at once.

The agent here is registered and beats by hand (its beats written to the bucket, as a hub
writes them); the hub's delete of the record fails, as it does without a quorum. Against a
real nats-server."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

import nats
import pytest

from reach_mesh import Client, MeshSettings, protocol
from reach_mesh.errors import NoMatchError
from reach_mesh.hub import Hub
from reach_mesh.models import AgentCard, AgentState, HeartbeatRecord

from .helpers import a_server_of_its_own, eventually, register_by_hand, states_of


@pytest.fixture(scope="module")
def nats_url() -> Iterator[str]:
    yield from a_server_of_its_own()


@pytest.fixture
async def nc(settings: MeshSettings) -> AsyncIterator[Any]:
    conn = await nats.connect(settings.nats_url or "")
    yield conn
    await conn.close()


async def _register(nc: Any, agent_id: str, session: str) -> None:
    card = AgentCard(agent_id=agent_id, capabilities=["lost:verdict:v1"])
    await register_by_hand(nc, card, session=session, heartbeat_interval=0.2, lease_timeout=0.6)


def _hold_deletes(hub: Hub, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The hub's deletes of agent records fail (no quorum): the records stay in KV."""
    held: list[str] = []

    async def delete(key: str, *args: Any, **kwargs: Any) -> bool:
        held.append(key)
        raise nats.errors.TimeoutError

    monkeypatch.setattr(hub.registry._agents_kv, "delete", delete)
    return held


async def _lost_undeleted(
    hub: Hub, nc: Any, agent_id: str, monkeypatch: pytest.MonkeyPatch
) -> tuple[str, list[AgentState]]:
    """Register the agent, beat a while, stop: declared LOST, its record still in KV. Its
    session, and the states it is graded into from then on."""
    session = uuid.uuid4().hex
    held = _hold_deletes(hub, monkeypatch)
    await _register(nc, agent_id, session)
    seen = states_of(hub, agent_id)
    beats = await nc.jetstream().key_value(protocol.KV_HEARTBEATS)
    for _ in range(4):
        await beats.put(agent_id, protocol.encode(HeartbeatRecord(session=session)))
        await asyncio.sleep(0.15)
    await eventually(lambda: AgentState.LOST in seen and agent_id in held, timeout=10)
    records = await nc.jetstream().key_value(protocol.KV_AGENTS)
    assert (await records.get(agent_id)).value  # the delete did not land
    assert agent_id not in hub.registry.agents
    return session, states_of(hub, agent_id)


def _recently_lost(hub: Hub, ns: str) -> set[str]:
    return {a["agent_id"] for a in hub.registry.recently_lost(ns)}


async def test_a_route_naming_a_lost_agent_does_not_bring_its_undeleted_record_back(
    hub: Hub, settings: MeshSettings, nc: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Routes naming the agent read its record back: it is not registered (LOST, said so),
    and stays so — no ONLINE, no SUSPECT — for well over a lease and grace, until it beats."""
    agent_id = f"{settings.namespace}.verdict.a1"
    _, seen = await _lost_undeleted(hub, nc, agent_id, monkeypatch)
    async with Client(settings=settings) as client:
        # Lease 0.6 s + grace 0.6 s: the re-installed view went ONLINE, then (its last beat
        # read back as new) SUSPECT and LOST again within 2.5 s.
        end = time.monotonic() + 2.5
        while time.monotonic() < end:
            with pytest.raises(NoMatchError, match="declared LOST"):
                await client.route(agent_id=agent_id)
            assert await hub.registry.fetch(agent_id) is None
            await asyncio.sleep(0.1)
    assert seen == [], seen
    assert agent_id not in hub.registry.agents
    assert agent_id in _recently_lost(hub, settings.namespace)


async def test_a_lost_agent_that_beats_again_is_back_at_once_and_its_old_beats_stay_old(
    hub: Hub, settings: MeshSettings, nc: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A beat of its session stored after the verdict (through another hub) is a sign of
    life: ONLINE at once, out of ``recently_lost``. Once the beats stop, the leader read
    before LOST renews nothing: SUSPECT, LOST, once."""
    agent_id = f"{settings.namespace}.verdict.a2"
    session, seen = await _lost_undeleted(hub, nc, agent_id, monkeypatch)
    beats = await nc.jetstream().key_value(protocol.KV_HEARTBEATS)
    revision = await beats.put(agent_id, protocol.encode(HeartbeatRecord(session=session)))
    await eventually(lambda: agent_id in hub.registry.agents, timeout=2)
    view = hub.registry.agents[agent_id]
    assert view.state is AgentState.ONLINE
    assert view.hb_revision == revision
    assert agent_id not in _recently_lost(hub, settings.namespace)
    await eventually(lambda: AgentState.LOST in seen, timeout=10)
    assert seen == [AgentState.ONLINE, AgentState.SUSPECT, AgentState.LOST], seen


async def test_a_lost_agent_that_registers_again_is_back_at_once(
    hub: Hub, settings: MeshSettings, nc: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Registered again (its session or a new one: a new revision of its record), the agent
    is ONLINE at once, and a route naming it finds it."""
    async with Client(settings=settings) as client:
        for n, same in enumerate((True, False)):
            agent_id = f"{settings.namespace}.verdict.b{n}"
            session, _ = await _lost_undeleted(hub, nc, agent_id, monkeypatch)
            await _register(nc, agent_id, session if same else uuid.uuid4().hex)
            assert hub.registry.agents[agent_id].state is AgentState.ONLINE
            decision = await client.route(agent_id=agent_id)
            assert decision.chosen == agent_id
            assert agent_id not in _recently_lost(hub, settings.namespace)


async def test_a_lost_agent_installed_again_keeps_its_heartbeat_revision(
    hub: Hub, settings: MeshSettings, nc: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its record written again after the verdict (by another hub, as a cordon does) is
    installed, but the view keeps the heartbeat revision the LOST one had: the leader read
    before LOST finds the agent's last beat, from before the verdict, and renews nothing
    (read as new, it made the agent ONLINE again for another lease and grace)."""
    agent_id = f"{settings.namespace}.verdict.a3"
    _, seen = await _lost_undeleted(hub, nc, agent_id, monkeypatch)
    records = await nc.jetstream().key_value(protocol.KV_AGENTS)
    await records.put(agent_id, (await records.get(agent_id)).value or b"")
    await eventually(lambda: AgentState.LOST in seen, timeout=10)
    assert seen == [AgentState.ONLINE, AgentState.SUSPECT, AgentState.LOST], seen
