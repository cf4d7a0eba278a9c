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
real nats-server. And that delete is retried until it lands: three nodes, two killed at the
verdict and started again."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import nats
import pytest
from nats.js.errors import KeyNotFoundError

from reach_mesh import Client, MeshSettings, protocol
from reach_mesh.errors import NoMatchError
from reach_mesh.hub import Hub
from reach_mesh.models import AgentCard, AgentRecord, AgentState, HeartbeatRecord
from reach_mesh.server import EmbeddedNats

from .helpers import (
    FAST,
    a_server_of_its_own,
    cluster_nodes,
    eventually,
    register_by_hand,
    states_of,
)


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


async def _register_beating_together(nc: Any, sessions: dict[str, str]) -> Any:
    """Register the agents (id: session) and beat them together a while, then stop: declared
    LOST in one grading pass. The heartbeat bucket."""
    for agent_id, session in sessions.items():
        await _register(nc, agent_id, session)
    beats = await nc.jetstream().key_value(protocol.KV_HEARTBEATS)
    for _ in range(3):
        for agent_id, session in sessions.items():
            await beats.put(agent_id, protocol.encode(HeartbeatRecord(session=session)))
        await asyncio.sleep(0.15)
    return beats


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
    # Its delete tried and failed, or put off (another's failed lately: retried with it).
    undeleted = hub.registry._undeleted.views
    await eventually(
        lambda: AgentState.LOST in seen and (agent_id in held or agent_id in undeleted),
        timeout=10,
    )
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


async def _leader_not_on(nc: Any, stream: str, server: str) -> None:
    """Have ``stream``'s leader be another server than ``server`` (stepped down if it is)."""
    js = nc.jetstream()

    async def elsewhere() -> bool:
        try:
            info = await js.stream_info(stream)
        except Exception:
            return False
        leader = info.cluster.leader if info.cluster is not None else None
        if leader == server:
            await nc.request(f"$JS.API.STREAM.LEADER.STEPDOWN.{stream}", b"", timeout=2)
            return False
        return leader is not None

    await eventually(elsewhere, timeout=15, interval=0.2)


async def _writable(nc: Any) -> None:
    """Wait until the cluster has a JetStream meta leader (R3 buckets can be made)."""

    async def ready() -> bool:
        try:
            await nc.jetstream().account_info()
        except Exception:
            return False
        return True

    await eventually(ready, timeout=20, interval=0.2)


@pytest.mark.xdist_group("clusters")
async def test_a_lost_agents_record_whose_delete_failed_is_deleted_once_it_can_be(
    tmp_path: Path,
) -> None:
    """Three nodes, R3 buckets, the hub on node 0. When the hub declares two agents LOST, the
    other two nodes die — the agents' stream's leader with them: no quorum, the deletes fail.
    Once the nodes are back, the hub deletes the record it graded (a fresh client reads it
    gone); the other agent, registered again meanwhile, keeps its new record."""
    nodes = cluster_nodes(tmp_path)
    for node in nodes:
        node.start()
    ns = f"ld{uuid.uuid4().hex[:6]}"
    gone_id, back_id = f"{ns}.verdict.gone", f"{ns}.verdict.back"
    # Passes 0.5 s apart: the two agents, beating together, are declared LOST in one pass.
    fast = {**FAST, "suspect_timeout": 1.5, "liveness_interval": 0.5}
    settings = MeshSettings(nats_url=nodes[0].url, namespace=ns, kv_replicas=3, **fast)
    killed: list[EmbeddedNats] = []

    def kill_the_others(view: Any, old: AgentState, new: AgentState) -> None:
        if new is AgentState.LOST and view.agent_id in (gone_id, back_id) and not killed:
            killed.extend(nodes[1:])
            for node in killed:
                node.kill()  # (in the grading pass, before the verdict's deletes)

    nc = await nats.connect(nodes[0].url)
    try:
        await _writable(nc)
        async with Hub(settings=settings) as hub:
            await _leader_not_on(nc, f"KV_{protocol.KV_AGENTS}", "n0")
            sessions = {gone_id: uuid.uuid4().hex, back_id: uuid.uuid4().hex}
            await _register_beating_together(nc, sessions)
            hub.registry.on_state_change(kill_the_others)
            await eventually(lambda: bool(killed), timeout=10)
            await asyncio.sleep(1.5)  # (the hub's retries fail meanwhile)
            for node in killed:
                await asyncio.to_thread(node.start)

            card = AgentCard(agent_id=back_id, capabilities=["lost:verdict:v1"])
            new_session = uuid.uuid4().hex

            async def registered_again() -> bool:
                try:  # (a long lease: it is not LOST again)
                    await register_by_hand(nc, card, session=new_session)
                except Exception:
                    return False  # (no quorum yet)
                return True

            await eventually(registered_again, timeout=20, interval=0.5)
            fresh = await nats.connect(nodes[1].url)
            try:
                records = await fresh.jetstream().key_value(protocol.KV_AGENTS)

                async def deleted() -> bool:
                    try:
                        await records.get(gone_id)
                    except KeyNotFoundError:
                        return True
                    return False

                await eventually(deleted, timeout=20, interval=0.2)
                await eventually(lambda: back_id in hub.registry.agents, timeout=5)
                await asyncio.sleep(1.0)  # (a retry of its old verdict would have run)
                record = AgentRecord.model_validate_json((await records.get(back_id)).value or b"")
                assert record.session == new_session
                assert hub.registry.agents[back_id].state is AgentState.ONLINE
                assert gone_id not in hub.registry.agents
            finally:
                await fresh.close()
    finally:
        await nc.close()
        for node in nodes:
            node.stop()


async def test_an_agent_that_beats_while_its_pass_expires_another_is_not_expired(
    settings: MeshSettings, nc: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two agents declared LOST in one grading pass; while the first one's record is deleted
    (a slow delete: up to ``_DELETE_TIMEOUT``, the bucket without a quorum), the second one's
    beat is stored (through another hub) and applied: ONLINE again. The pass then expired it
    all the same, from the list it made before its awaits: dropped from the registry, its
    record — still the revision graded — deleted, although it beats."""
    ns = settings.namespace
    ids = [f"{ns}.verdict.p0", f"{ns}.verdict.p1"]
    sessions = {agent_id: uuid.uuid4().hex for agent_id in ids}
    # Passes 0.5 s apart: the two agents, beating together, are declared LOST in one pass.
    async with Hub(settings=settings.model_copy(update={"liveness_interval": 0.5})) as hub:
        beats = await _register_beating_together(nc, sessions)
        registry = hub.registry
        assert registry._agents_kv is not None
        real = registry._agents_kv.delete
        back: list[str] = []

        async def delete(key: str, *args: Any, **kwargs: Any) -> bool:
            if not back and key in ids:
                other = ids[1 - ids.index(key)]
                back.append(other)
                await beats.put(other, protocol.encode(HeartbeatRecord(session=sessions[other])))
                view = registry.agents.get(other)
                assert view is not None, "not graded in the same pass"
                await eventually(lambda: view.state is AgentState.ONLINE, timeout=2)
            return await real(key, *args, **kwargs)

        monkeypatch.setattr(registry._agents_kv, "delete", delete)
        # Passes ended (each ends with its retries' check, ``_retry_soon``), counted from when
        # the beat is applied: the pass that would expire it has ended once one more has.
        ended: list[bool] = []
        retry_soon = registry._retry_soon

        def counted() -> None:
            ended.append(bool(back))
            retry_soon()

        monkeypatch.setattr(registry, "_retry_soon", counted)
        await eventually(lambda: bool(back), timeout=10)
        other = back[0]
        await eventually(lambda: True in ended, timeout=10)  # not a fixed 0.2 s
        assert other in registry.agents, "expired although it beat"
        assert registry.agents[other].state is AgentState.ONLINE
        records = await nc.jetstream().key_value(protocol.KV_AGENTS)
        assert (await records.get(other)).value  # its record stays
