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
import logging
import time
import uuid
from typing import Any

import nats
import pytest

from reach_mesh import Client, MeshSettings, protocol
from reach_mesh.hub import Hub
from reach_mesh.models import (
    AgentCard,
    AgentState,
    HeartbeatRecord,
    UnregisterRequest,
)
from reach_mesh.server import EmbeddedNats

from .helpers import eventually, register_by_hand, states_of

_HB_STREAM = f"KV_{protocol.KV_HEARTBEATS}"


async def _register(nc: Any, agent_id: str, session: str) -> None:
    card = AgentCard(agent_id=agent_id, capabilities=["lease:confirm:v1"])
    await register_by_hand(nc, card, session=session, heartbeat_interval=0.2, lease_timeout=0.6)


def _looks(caplog: pytest.LogCaptureFixture) -> int:
    """The hub's looks at an overdue agent that declared nobody LOST (its log says so)."""
    return sum("not declaring" in r.getMessage() for r in caplog.records)


def _stop_heartbeat_watch(hub: Hub) -> None:
    (watch,) = [t for t in hub.registry._tasks if t.get_name() == "reach-watch-heartbeats"]
    watch.cancel()


async def test_a_missed_beat_is_read_from_the_stream_leader(
    hub: Hub, settings: MeshSettings
) -> None:
    """Beats the hub's watch never delivers keep the agent out of LOST, each confirmed by a
    leader read (``STREAM.MSG.GET``), never by a direct get; once they stop, it is LOST."""
    agent_id = f"{settings.namespace}.confirm.a1"
    session = uuid.uuid4().hex
    assert settings.nats_url is not None
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
        seen = states_of(hub, agent_id)
        kv = await nc.jetstream().key_value(protocol.KV_HEARTBEATS)
        beat = protocol.encode(HeartbeatRecord(session=session))
        subject = f"$KV.{protocol.KV_HEARTBEATS}.{agent_id}"

        def leader() -> list[str]:
            return [
                s for s, d in reads if ".MSG.GET." in s and json.loads(d)["last_by_subj"] == subject
            ]

        # Lease 0.6 s + grace 0.6 s: a read every 1.2 s or so, each made when the hub's clock
        # had the agent overdue — LOST at that pass, unless the read renewed its lease. Beats
        # until a third read, so that the passes of two have ended (one pass at a time), not
        # for a fixed time: a loaded box's hub grades less often.
        deadline = time.monotonic() + 20
        while len(leader()) < 3 and AgentState.LOST not in seen and time.monotonic() < deadline:
            await kv.put(agent_id, beat)
            await asyncio.sleep(0.15)
        assert AgentState.LOST not in seen, seen
        assert len(leader()) >= 3, reads
        assert hub.registry.agents[agent_id].state is not AgentState.LOST
        direct = [s for s, _ in reads if ".DIRECT.GET." in s and s.endswith(agent_id)]
        assert direct == []
        # No more beats: the last one counted from when it was read, then the lease runs out.
        await eventually(lambda: AgentState.LOST in seen, timeout=5)
    finally:
        await nc.close()


async def test_no_heartbeat_stream_is_not_a_missing_beat(
    settings: MeshSettings, caplog: pytest.LogCaptureFixture
) -> None:
    """A leader read that finds no stream (10059: being recovered, or gone) leaves the hub
    blind, and the overdue agent SUSPECT, not LOST: only 10037 (no message) means that no
    beat is stored. (A direct get found no responders there; a leader read answers 404.)"""
    async with EmbeddedNats() as server:
        s = settings.model_copy(update={"nats_url": server.url})
        caplog.set_level(logging.INFO, logger="reach_mesh.hub.registry")
        async with Hub(settings=s) as hub:
            agent_id = f"{s.namespace}.confirm.a2"
            nc = await nats.connect(server.url)
            try:
                await _register(nc, agent_id, uuid.uuid4().hex)
                _stop_heartbeat_watch(hub)
                seen = states_of(hub, agent_id)
                await nc.jetstream().delete_stream(_HB_STREAM)
                await eventually(lambda: AgentState.SUSPECT in seen, timeout=5)
                # Each pass that has the agent past lease + grace (1.2 s) on the hub's clock,
                # not blind, looks at the stream, finds none, and says it declares nobody LOST
                # (blind a lease then). Three such looks, not a fixed time (a loaded box's hub
                # grades less often): the passes of two have ended, one pass at a time.
                await eventually(lambda: _looks(caplog) >= 3 or AgentState.LOST in seen, 20)
                assert AgentState.LOST not in seen, seen
                assert hub.registry.agents[agent_id].state is AgentState.SUSPECT
            finally:
                await nc.close()


async def test_an_agent_dead_before_its_first_beat_is_never_online_again(
    hub: Hub, settings: MeshSettings
) -> None:
    """An agent registers and dies before its first heartbeat (a crash loop). The only beat in
    the bucket is the one its registration wrote; read back before it is declared LOST, it
    used to renew the lease: ONLINE again while dead, LOST a whole lease later, the lease
    expiry said twice. It goes SUSPECT, then LOST, once."""
    agent_id = f"{settings.namespace}.confirm.a3"
    seen = states_of(hub, agent_id)
    assert settings.nats_url is not None
    nc = await nats.connect(settings.nats_url)
    try:
        await _register(nc, agent_id, uuid.uuid4().hex)  # and never a beat
    finally:
        await nc.close()
    await eventually(lambda: AgentState.LOST in seen, timeout=10)
    assert seen == [AgentState.ONLINE, AgentState.SUSPECT, AgentState.LOST]
    assert agent_id in {a["agent_id"] for a in hub.registry.recently_lost(settings.namespace)}


async def test_a_hub_told_of_a_loss_by_another_lists_it_as_recently_lost(
    hub: Hub, settings: MeshSettings
) -> None:
    """With two hubs, the one whose liveness pass comes second learns of the loss from the
    first one's delete of the record: it lists the agent as recently LOST too (``agents``,
    ``inspect`` answer from whichever hub). An agent that says goodbye is not LOST."""
    async with Hub(settings=settings) as other:
        agent_id = f"{settings.namespace}.confirm.a4"
        assert settings.nats_url is not None
        nc = await nats.connect(settings.nats_url)
        try:
            await _register(nc, agent_id, uuid.uuid4().hex)
            await eventually(lambda: agent_id in other.registry.agents)
            # Only the first hub grades leases; the other learns from its delete.
            (grading,) = [t for t in other.registry._tasks if t.get_name() == "reach-liveness"]
            grading.cancel()
            await eventually(lambda: agent_id not in other.registry.agents, timeout=10)
            lost = other.registry.recently_lost(settings.namespace)
            assert agent_id in {a["agent_id"] for a in lost}
            bye_id = f"{settings.namespace}.confirm.a5"
            session = uuid.uuid4().hex
            await _register(nc, bye_id, session)
            await eventually(lambda: bye_id in other.registry.agents)
            bye = protocol.encode(UnregisterRequest(agent_id=bye_id, session=session))
            await nc.request(protocol.hub_agent_subject(bye_id, "unregister"), bye, timeout=5)
            await eventually(lambda: bye_id not in other.registry.agents)
            lost = other.registry.recently_lost(settings.namespace)
            assert bye_id not in {a["agent_id"] for a in lost}
            # The audit says the same: a LOST from each hub for the loss, none for the goodbye
            # (its ``unregister`` event tells it; each hub said ``ONLINE -> LOST`` before).
            # State events are added soon, not at once, and published without an ack: read
            # until both hubs' are stored (a loaded box stores them later than a first look).
            audit: list[dict[str, Any]] = []
            said_lost: set[tuple[str, Any]] = set()

            async def both_said_lost() -> bool:
                nonlocal audit, said_lost
                await hub.audit.flush()
                await other.audit.flush()
                async with Client(settings=settings) as c:
                    audit = await c.audit(namespace=settings.namespace, since=60)
                said_lost = {
                    (e["agent_id"], e.get("hub_id"))
                    for e in audit
                    if e["kind"] == "state" and e.get("new") == "LOST"
                }
                return said_lost == {(agent_id, hub.hub_id), (agent_id, other.hub_id)}

            try:
                await eventually(both_said_lost, timeout=10, interval=0.2)
            except AssertionError:
                raise AssertionError(f"the audit says {said_lost}") from None
            byes = [e for e in audit if e["kind"] == "unregister" and e["agent_id"] == bye_id]
            assert len(byes) == 1
        finally:
            await nc.close()


async def test_a_starting_hub_audits_no_state_change_of_healthy_agents(
    hub: Hub, settings: MeshSettings
) -> None:
    """A hub that starts loads each agent's record before its heartbeat (SUSPECT a moment,
    then ONLINE): catching up, not a change the agent went through — its audit said
    ``SUSPECT -> ONLINE`` for every healthy agent, the runbook's sign of a flapping one."""
    agent_id = f"{settings.namespace}.confirm.a6"
    session = uuid.uuid4().hex
    assert settings.nats_url is not None
    nc = await nats.connect(settings.nats_url)
    try:
        await _register(nc, agent_id, session)
        kv = await nc.jetstream().key_value(protocol.KV_HEARTBEATS)
        beating = True

        async def beat() -> None:
            while beating:
                await kv.put(agent_id, protocol.encode(HeartbeatRecord(session=session)))
                await asyncio.sleep(0.15)

        beats = asyncio.create_task(beat())
        try:
            await asyncio.sleep(1.0)  # the record is older than its lease (0.6 s)
            patient = settings.model_copy(update={"suspect_timeout": 30.0})
            said: list[dict[str, Any]] = []
            async with Hub(settings=patient) as late:
                view = late.registry.agents[agent_id]
                assert view.state is AgentState.ONLINE
                # The beats stop: the hub sees the lease lapse (ONLINE -> SUSPECT; LOST only
                # 30 s later). Its state events are published in order, one connection, so once
                # that one is stored any said at its start is stored before it: read until it
                # is, not for a fixed time (a loaded box stores events later than a first look).
                beating = False
                await beats

                async def lapse_stored() -> bool:
                    nonlocal said
                    await late.audit.flush()
                    async with Client(settings=settings) as c:
                        audit = await c.audit(namespace=settings.namespace, since=60)
                    said = [
                        e for e in audit if e["kind"] == "state" and e.get("hub_id") == late.hub_id
                    ]
                    return any(
                        e["agent_id"] == agent_id and e.get("new") == AgentState.SUSPECT.value
                        for e in said
                    )

                await eventually(lapse_stored, timeout=10, interval=0.2)
            # The catch-up was a first change from SUSPECT. A beat late by more than the lease
            # (this process's loop stalled on a loaded machine) is a lapse the hub saw, told
            # from ONLINE: ci183 had ONLINE -> SUSPECT -> ONLINE within 1 ms.
            state = AgentState.ONLINE.value
            for event in said:
                assert event["old"] == state, said
                state = event["new"]
        finally:
            beating = False
            await beats
    finally:
        await nc.close()


async def test_a_restarted_agent_dead_before_its_first_beat_is_not_revived(
    hub: Hub, settings: MeshSettings
) -> None:
    """The agent restarts (a new session) through another hub while this one still knows its
    previous incarnation: the new registration's beat reaches this hub before the new record,
    as another session's. It is remembered all the same: read back before LOST it renews
    nothing (the crash loop of an agent that dies before its first beat)."""
    agent_id = f"{settings.namespace}.confirm.a7"
    assert settings.nats_url is not None
    nc = await nats.connect(settings.nats_url)
    try:
        await _register(nc, agent_id, uuid.uuid4().hex)
        seen = states_of(hub, agent_id)
        js = nc.jetstream()
        records = await js.key_value(protocol.KV_AGENTS)
        beats = await js.key_value(protocol.KV_HEARTBEATS)
        record = json.loads((await records.get(agent_id)).value or b"{}")
        record["session"] = session = uuid.uuid4().hex
        # As another hub's register() writes it: the heartbeat first, then the record.
        await beats.put(agent_id, protocol.encode(HeartbeatRecord(session=session)))
        await asyncio.sleep(0.1)
        await records.put(agent_id, json.dumps(record).encode())
        await eventually(lambda: AgentState.LOST in seen, timeout=10)
    finally:
        await nc.close()
    assert AgentState.ONLINE not in seen[seen.index(AgentState.SUSPECT) :], seen
