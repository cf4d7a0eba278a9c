"""An agent heard but deaf, told apart from one reconnecting, on a real nats-server.

- An agent whose heartbeats go on while nothing reaches it (its task, batch and ctl
  subscriptions gone, its work consumer stopped: a client whose subscription loop died) is
  given up on at its second probe, not at the workflow's deadline: the step is sent to another
  agent and the workflow succeeds; the deaf agent is quarantined, and gets no further step.
- Restarted (a new process: a new session, subscribed before it registered), it is
  routable at once: "deaf" was said of the process, not the agent id.
- An agent cut off from NATS for several probes (no heartbeats, nobody on its ctl subject)
  while its lease holds keeps its attempt: it may be reconnecting, and it is.
"""

from __future__ import annotations

import asyncio
import re
import time
import uuid
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from opentelemetry.trace import INVALID_SPAN_CONTEXT, NonRecordingSpan

from reach_mesh import Client, MeshSettings, Step, TaskState, protocol
from reach_mesh.agent import Agent
from reach_mesh.hub import Hub
from reach_mesh.hub._liveness import heartbeat_entry
from reach_mesh.hub.breaker import DEAF, BreakerState
from reach_mesh.hub.registry import Registry
from reach_mesh.models import (
    AgentCard,
    AgentRecord,
    AgentState,
    CordonRecord,
    UnregisterRequest,
)
from reach_mesh.workflow import TaskRecord

from .helpers import (
    Fleet,
    HeldHandler,
    Relay,
    deafen,
    echo_agent,
    eventually,
    held_handler,
    partition,
    register_by_hand,
    relayed,
)

pytestmark = pytest.mark.timeout(90)


def _sent_to(hub: Hub, wf_id: str, agent_id: str) -> bool:
    """Whether ``hub`` runs a step of ``wf_id`` whose current attempt went to ``agent_id``."""
    assert hub.workflows is not None
    tracks = hub.workflows._tracker._tracks.values()
    return any(t.workflow_id == wf_id and t.agent_id == agent_id for t in tracks)


def _heard_since(hub: Hub, agent_id: str) -> Callable[[], bool]:
    """Whether ``hub`` has heard ``agent_id`` since this was called."""
    seen = hub.registry.agents[agent_id].last_seen
    return lambda: hub.registry.agents[agent_id].last_seen > seen


def _nobody_found(monkeypatch: pytest.MonkeyPatch, *hubs: Hub) -> Counter[str]:
    """Per agent, the probes of ``hubs``' steps that have found nobody on its ctl subject from
    now on (each one's deaf rule applied): what a wait for "probes meanwhile" waits for, not a
    fixed time — a loaded box's hub probes less often."""
    found: Counter[str] = Counter()
    for hub in hubs:
        assert hub.workflows is not None
        tracker = hub.workflows._tracker
        real = tracker._no_responders

        def counted(track: Any, agent_id: str, attempt: int, before: Any, real: Any = real) -> Any:
            found[agent_id] += 1
            return real(track, agent_id, attempt, before)

        monkeypatch.setattr(tracker, "_no_responders", counted)
    return found


async def _found_more(nobody: Counter[str], agent_id: str, more: int) -> None:
    """Wait until ``more`` probes more have found nobody on ``agent_id``'s ctl subject."""
    until = nobody[agent_id] + more
    await eventually(lambda: nobody[agent_id] >= until, timeout=20)


async def _relayed_pair(
    fleet: Fleet, nats_url: str, wf_settings: MeshSettings, name: str, cap: str
) -> tuple[Relay, Agent, HeldHandler, Agent, HeldHandler]:
    """Agent A (started) behind a relay the test cuts, with a lease of 10 s that outlasts the
    cuts, and agent B (not started yet), both serving ``cap`` with held handlers."""
    relay, settings = await relayed(
        nats_url, wf_settings, heartbeat_interval=1.0, lease_timeout=10.0
    )
    a = Agent(f"{wf_settings.namespace}.{name}.a", settings=settings)
    fleet.agents.append(a)
    on_a = held_handler(a, cap, "answer of A")
    b = fleet.agent(f"{name}.b")
    on_b = held_handler(b, cap, "answer of B")
    await a.start()
    return relay, a, on_a, b, on_b


async def _decided_by_a(
    relay: Relay, a: Agent, on_a: HeldHandler, on_b: HeldHandler, mesh: Client, wf_id: str
) -> None:
    """A back on NATS (``relay`` restored) finishes the step: its result decides it, with one
    attempt, and B never ran it."""
    await relay.start()
    await eventually(lambda: a.nc.is_connected, timeout=10)
    on_a.release.set()
    res = await mesh.workflow(wf_id, timeout=10)
    assert res.state is TaskState.SUCCEEDED, res.error
    assert res.result == ["answer of A"] and res.steps[0].attempts == 1
    assert not on_b.started.is_set()


@pytest.mark.parametrize("kind", ["fanout", "chain"])
async def test_a_step_sent_to_a_deaf_agent_is_sent_elsewhere(
    wf_hub: Hub, fleet: Fleet, wf_settings: MeshSettings, kind: str
) -> None:
    """The deaf agent D is the only one when the workflow starts, so its first step goes to D;
    H starts then. D's lease holds (it beats every 0.2 s), so "no responders" alone would keep
    the attempt until the deadline (30 s): D is heard after its ctl subject first had nobody,
    and has nobody still at the next probe — deaf. The step goes to H and the workflow
    succeeds in a few seconds."""
    cap = f"wf:deaf{kind}:v1"
    deaf = echo_agent(fleet, f"deaf{kind}.d", cap)
    healthy = echo_agent(fleet, f"deaf{kind}.h", cap)
    await deaf.start()
    await deafen(deaf)
    loop = asyncio.get_running_loop()
    async with Client(settings=wf_settings) as mesh:
        steps = [Step(capability=cap, payload=i) for i in range(2 if kind == "chain" else 1)]
        submit = mesh.submit_fanout if kind == "fanout" else mesh.submit_chain
        t0 = loop.time()
        wf_id = await submit(steps, timeout=30)
        await eventually(lambda: _sent_to(wf_hub, wf_id, deaf.agent_id), timeout=5)
        await healthy.start()
        res = await mesh.workflow(wf_id, timeout=30)
        took = loop.time() - t0
        view = await mesh.inspect_workflow(wf_id)
        # Quarantined at once (not after a breaker's worth of wasted steps): the next
        # workflow's steps go to H only, their first attempts included.
        view_d = wf_hub.registry.agents[deaf.agent_id]
        assert view_d.state is AgentState.QUARANTINED
        info = await mesh.inspect(deaf.agent_id)  # what an operator reads: why, too
        assert info.state is AgentState.QUARANTINED and info.breaker_reason == DEAF
        again = await mesh.workflow(await submit(steps, timeout=30), timeout=10)
        assert again.state is TaskState.SUCCEEDED, again.error
        assert all(s.agent_id == healthy.agent_id and s.attempts == 1 for s in again.steps)
    assert res.state is TaskState.SUCCEEDED, res.error
    assert took < 10.0, took  # two probes and a retry, not the 30 s deadline
    assert [s.agent_id for s in res.steps] == [healthy.agent_id] * len(steps)
    first = view.steps[0].history[0]
    assert (first.attempt, first.agent_id, first.code) == (1, deaf.agent_id, "lost"), first
    assert sum(fleet.runs.values()) == 2 * len(steps)  # each step ran once, on H


@pytest.mark.parametrize("how", ["goodbye", "killed"])
async def test_a_deaf_agent_restarted_under_a_new_session_is_routable_at_once(
    fleet: Fleet, wf_settings: MeshSettings, how: str
) -> None:
    """Found deaf, then restarted as an operator would (a fresh process, same agent id):
    after its goodbye, or killed (no goodbye: the hub still has its view, its lease holding).
    "Deaf" was said of the process — its subscriptions gone —, and the new one subscribed to
    its ctl subject before it registered: its registration, under a new session, closes the
    breaker that verdict opened. It is routable at once, not after ``breaker_open_timeout``
    (60 s here) and a half-open probe; and it is the only one left, so every step goes to it.
    (An operator's quarantine outlives a new session: test_abuse.)"""
    settings = wf_settings.model_copy(update={"breaker_open_timeout": 60.0})
    cap = f"wf:deafback{how}:v1"
    async with Hub(settings=settings) as hub, Client(settings=settings) as mesh:
        deaf = echo_agent(fleet, f"deafback{how}.d", cap)
        healthy = echo_agent(fleet, f"deafback{how}.h", cap)
        await deaf.start()
        await deafen(deaf)
        wf_id = await mesh.submit_fanout([Step(capability=cap)], timeout=30)
        await eventually(lambda: _sent_to(hub, wf_id, deaf.agent_id), timeout=5)
        await healthy.start()
        res = await mesh.workflow(wf_id, timeout=30)
        assert res.state is TaskState.SUCCEEDED, res.error
        view = hub.registry.agents[deaf.agent_id]
        assert view.breaker.why == DEAF and view.state is AgentState.QUARANTINED
        if how == "goodbye":
            await deaf.close()
        else:
            await partition(deaf)  # silent, and no goodbye: its view stays
        await healthy.close()
        back = echo_agent(fleet, f"deafback{how}.d", cap)
        await back.start()
        view = hub.registry.agents[back.agent_id]
        assert view.record.session == back.session != deaf.session
        assert view.breaker.state is BreakerState.CLOSED and not view.breaker.why
        assert view.state is AgentState.ONLINE
        for _ in range(3):
            wf_id = await mesh.submit_fanout([Step(capability=cap)], timeout=30)
            res = await mesh.workflow(wf_id, timeout=10)
            assert res.state is TaskState.SUCCEEDED, res.error
            assert res.steps[0].agent_id == back.agent_id


async def test_only_a_registration_under_another_session_clears_deaf(
    hub: Hub, settings: MeshSettings, nc: NATS
) -> None:
    """What a registration does to the id's breaker (registered by hand): one of the session
    found deaf — registering again, before or after a goodbye, is the same process — keeps
    the verdict; one under another session clears it; an operator's quarantine outlives
    every new session."""
    agent_id = f"{settings.namespace}.deafsession.a"
    card = AgentCard(agent_id=agent_id, capabilities=["test:deafsession:v1"])
    registry = hub.registry

    async def goodbye() -> None:
        bye = protocol.encode(UnregisterRequest(agent_id=agent_id))
        await nc.request(protocol.hub_agent_subject(agent_id, "unregister"), bye, timeout=5)
        assert agent_id not in registry.agents

    async def registered(session: str) -> tuple[AgentState, str]:
        await register_by_hand(nc, card, session=session)
        view = registry.agents[agent_id]
        assert view.record.session == session
        return view.state, view.breaker.why

    await register_by_hand(nc, card, session="s1")
    registry.agents[agent_id].breaker.trip(DEAF)
    registry.regrade(registry.agents[agent_id])
    assert await registered("s1") == (AgentState.QUARANTINED, DEAF)
    await goodbye()
    assert await registered("s1") == (AgentState.QUARANTINED, DEAF)
    assert await registered("s2") == (AgentState.ONLINE, "")
    registry.agents[agent_id].breaker.trip(DEAF)
    await goodbye()
    assert await registered("s3") == (AgentState.ONLINE, "")
    registry.agents[agent_id].breaker.trip()  # an operator's quarantine
    for session in ("s4", "s5"):
        assert await registered(session) == (AgentState.QUARANTINED, "operator quarantine")
    await goodbye()


async def test_a_step_sent_before_the_breaker_opened_is_no_probe_verdict(
    fleet: Fleet, wf_settings: MeshSettings
) -> None:
    """A step the agent held while an operator quarantined it ends after the breaker
    half-opened: its success is old evidence, not the half-open probe's verdict, and the
    breaker stays half-open. The probe is the next step sent there, whose success closes it."""
    settings = wf_settings.model_copy(update={"breaker_open_timeout": 1.0})
    cap = "wf:oldwin:v1"
    agent = fleet.agent("oldwin.a")
    on_a = held_handler(agent, cap)
    async with Hub(settings=settings) as hub, Client(settings=settings) as mesh:
        await agent.start()
        held = await mesh.submit_fanout([Step(capability=cap, timeout=20)], timeout=30)
        await asyncio.wait_for(on_a.started.wait(), 5)
        await mesh.admin("quarantine", agent.agent_id)
        view = hub.registry.agents[agent.agent_id]
        await eventually(lambda: view.breaker.state is BreakerState.HALF_OPEN, timeout=5)
        on_a.release.set()
        res = await mesh.workflow(held, timeout=10)
        assert res.state is TaskState.SUCCEEDED, res.error
        assert view.breaker.state is BreakerState.HALF_OPEN  # not the probe's verdict
        probe = await mesh.submit_fanout([Step(capability=cap)], timeout=30)
        res = await mesh.workflow(probe, timeout=10)
        assert res.state is TaskState.SUCCEEDED and res.steps[0].agent_id == agent.agent_id
        assert hub.registry.agents[agent.agent_id].breaker.state is BreakerState.CLOSED


async def test_an_agent_cut_off_for_several_probes_keeps_its_attempt(
    wf_hub: Hub,
    fleet: Fleet,
    nats_url: str,
    wf_settings: MeshSettings,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A reconnecting agent is not deaf: cut off (its connection gone, so no heartbeats and
    nobody on its ctl subject) for several silence timeouts while its lease (10 s) holds, then
    back — and then cut off once more, after its heartbeats and RUNNING statuses were heard
    again (heard from its attempt, the first cut's "no responders" no longer counts). It is
    never heard while its ctl subject has nobody, so the step keeps its attempt: B never runs
    it, and A's result decides it with one attempt."""
    cap = "wf:cutoff:v1"
    relay, a, on_a, b, on_b = await _relayed_pair(fleet, nats_url, wf_settings, "cutoff", cap)
    assert wf_hub.workflows is not None
    tracker = wf_hub.workflows._tracker
    nobody = _nobody_found(monkeypatch, wf_hub)
    async with Client(settings=wf_settings) as mesh:
        wf_id = await mesh.submit_fanout([Step(capability=cap)], timeout=30)
        await asyncio.wait_for(on_a.started.wait(), 5)
        await b.start()
        for probes in (3, 2):
            await relay.cut()
            await eventually(lambda: not a.nc.is_connected, timeout=5)
            # Silence timeout 0.8 s: every probe meanwhile finds nobody on A's ctl subject.
            await _found_more(nobody, a.agent_id, probes)
            assert tracker.lease_fresh(a.agent_id)  # only heartbeats can tell it from deaf
            await relay.start()
            await eventually(lambda: a.nc.is_connected, timeout=10)
            # Heard again (a heartbeat; its attempt's RUNNING keep-alives come more often).
            await eventually(_heard_since(wf_hub, a.agent_id), timeout=5)
            await asyncio.sleep(0.5)
        on_a.release.set()
        res = await mesh.workflow(wf_id, timeout=10)
    assert res.state is TaskState.SUCCEEDED, res.error
    assert res.result == ["answer of A"]
    assert res.steps[0].attempts == 1
    assert not on_b.started.is_set()


@pytest.mark.parametrize("path", ["watch", "leader_read"])
async def test_a_beat_stored_before_a_cut_and_delivered_late_is_not_the_agent_heard(
    wf_hub: Hub,
    fleet: Fleet,
    nats_url: str,
    wf_settings: MeshSettings,
    path: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Chaos secure seed 198 (``partition``): a hub cut off with a NATS node missed the last
    beats the agents of another node stored; it got them only seconds later — after those
    agents were cut off in turn, and its probes had found nobody on their ctl subjects — once
    the heartbeat stream had a leader again (its watch catching up, or the read from the
    leader before a LOST verdict). Applied as heard *now*, each beat made its agent "heard
    after nobody answered", and the hub quarantined all four cut-off agents as deaf within
    0.4 s; a route one of them had run then ran again elsewhere. A beat is heard when the
    server stored it: here before the ctl subject had nobody, so the agent may be
    reconnecting — it keeps its attempt, and is not quarantined."""
    cap = f"wf:latebeat{path}:v1"
    relay, a, on_a, b, on_b = await _relayed_pair(
        fleet, nats_url, wf_settings, f"latebeat{path}", cap
    )
    registry = wf_hub.registry
    nobody = _nobody_found(monkeypatch, wf_hub)
    async with Client(settings=wf_settings) as mesh:
        wf_id = await mesh.submit_fanout([Step(capability=cap)], timeout=30)
        await asyncio.wait_for(on_a.started.wait(), 5)
        await b.start()
        await eventually(lambda: _sent_to(wf_hub, wf_id, a.agent_id))
        await relay.cut()
        await eventually(lambda: not a.nc.is_connected, timeout=5)
        # Its last beat, stored before the cut, as the leader has it.
        stream, subject = (
            f"KV_{protocol.KV_HEARTBEATS}",
            f"$KV.{protocol.KV_HEARTBEATS}.{a.agent_id}",
        )
        raw = await registry._js.get_msg(stream, subject=subject)
        assert raw.time is not None
        # Probes (silence timeout 0.8 s) find nobody on A's ctl subject: two, not a fixed time.
        await _found_more(nobody, a.agent_id, 2)
        view = registry.agents[a.agent_id]
        # This hub never applied it (as a hub cut off when it was stored): delivered now.
        view.hb_revision = view.hb_own_revision = 0
        spoke = view.spoke_at
        if path == "watch":
            registry._apply_heartbeat(heartbeat_entry(a.agent_id, raw), initial=False)
        else:
            await registry._confirm_overdue(view)
        assert view.hb_revision == raw.seq  # applied
        # More probes, each finding nobody: deaf at the next, were the beat heard now.
        await _found_more(nobody, a.agent_id, 2)
        assert view.breaker.why != DEAF and view.breaker.state is BreakerState.CLOSED
        assert view.spoke_at <= spoke + 0.5  # (stored before the cut: the agent spoke then)
        await _decided_by_a(relay, a, on_a, on_b, mesh, wf_id)


async def test_a_record_written_by_another_hub_is_not_the_agent_speaking(
    wf_hub: Hub,
    fleet: Fleet,
    nats_url: str,
    wf_settings: MeshSettings,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An agent cut off while another hub rewrites its record (an operator's cordon) is not
    taken for deaf: the record moves the owner's ``last_seen``, but only the agent's own
    heartbeats and registrations say it spoke. Its attempt stays, and decides the step."""
    cap = "wf:cordoned:v1"
    relay, a, on_a, b, on_b = await _relayed_pair(fleet, nats_url, wf_settings, "cordoned", cap)
    async with Hub(settings=wf_settings) as other, Client(settings=wf_settings) as mesh:
        nobody = _nobody_found(monkeypatch, wf_hub, other)
        wf_id = await mesh.submit_fanout([Step(capability=cap)], timeout=30)
        await asyncio.wait_for(on_a.started.wait(), 5)
        await eventually(
            lambda: _sent_to(wf_hub, wf_id, a.agent_id) or _sent_to(other, wf_id, a.agent_id)
        )
        owner = wf_hub if _sent_to(wf_hub, wf_id, a.agent_id) else other
        writer = other if owner is wf_hub else wf_hub
        await b.start()
        await relay.cut()
        await eventually(lambda: not a.nc.is_connected, timeout=5)
        await _found_more(nobody, a.agent_id, 1)  # a probe found nobody on A's ctl subject
        heard = _heard_since(owner, a.agent_id)
        await writer.registry.set_cordon(
            a.agent_id, CordonRecord(reason="test", requester="test", cordoned_at=time.time())
        )
        await eventually(heard, timeout=5)  # the owner saw the record: last_seen moved
        # More probes, each finding nobody: deaf at the next, were the record the agent heard.
        await _found_more(nobody, a.agent_id, 2)
        await _decided_by_a(relay, a, on_a, on_b, mesh, wf_id)


async def test_a_record_read_for_a_route_was_spoken_when_the_server_stored_it(
    settings: MeshSettings, nc: NATS, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A route naming an agent whose registration this hub's watch has not shown yet reads
    its record from KV (``Registry.fetch``). Its lease starts then; but the agent spoke when
    the server stored the record (the direct get's ``Nats-Time-Stamp``), as for a record or
    beat the watch delivers: one stored before the agent was cut off and read seconds later
    is not the agent heard after its ctl subject had nobody (the deaf rule, ``spoke_at``)."""
    # This hub's watch of the records shows it nothing: every record is one not shown yet.
    monkeypatch.setattr(Registry, "_apply_agent", lambda self, entry, *, initial: None)
    agent_id = f"{settings.namespace}.fetched.a"
    record = AgentRecord(
        card=AgentCard(agent_id=agent_id, capabilities=["test:fetched:v1"]),
        session=uuid.uuid4().hex,
        heartbeat_interval=20.0,
        lease_timeout=60.0,
        task_subject=protocol.agent_task(agent_id),
        registered_at=time.time(),
    )
    async with Hub(settings=settings) as hub:
        records = await nc.jetstream().key_value(protocol.KV_AGENTS)
        await records.put(agent_id, protocol.encode(record))
        stored = hub.registry.now
        await asyncio.sleep(1.5)
        assert agent_id not in hub.registry.agents
        try:
            view = await hub.registry.fetch(agent_id)
            assert view is not None and view.record.session == record.session
            assert view.last_seen >= stored + 1.5  # the lease: from the read
            assert abs(view.spoke_at - stored) < 0.5, view.spoke_at - stored
        finally:
            await records.delete(agent_id)  # (later tests' hubs load the records)


async def test_the_deaf_check_asks_with_a_reply_subject_nobody_can_guess(
    hub: Hub, settings: MeshSettings, nc: NATS
) -> None:
    """Whether anybody listens on an agent's ctl subject is asked with 64 random bits in the
    reply subject (``Registry.asks``), not nats-py's sequential ids: every agent may publish
    on hubs' reply subjects, and one that could guess the next could answer for a deaf agent
    and keep work going to it. An answer, as from the agent, means somebody listens.

    The agent is registered by hand and answered for by the test: an ``Agent`` process asks
    on its own ctl subject too (``confirm_identity``, once no beat of its was answered for
    ``lease_timeout + suspect_timeout`` — 1.2 s here, a loaded box's pause), and that ask,
    with a nats-py inbox, would be read as the hub's."""
    agent_id = f"{settings.namespace}.deafcheck.a"
    card = AgentCard(agent_id=agent_id, capabilities=["test:deafcheck:v1"])
    replies: list[str] = []

    async def answer(msg: Msg) -> None:
        replies.append(msg.reply)
        await msg.respond(b'{"ok":true}')

    await nc.subscribe(protocol.agent_ctl(agent_id), cb=answer)
    await nc.flush()
    await register_by_hand(nc, card)
    view = hub.registry.agents[agent_id]
    assert not await hub._nobody_on(view)  # somebody answered its ping
    await eventually(lambda: len(replies) >= 1)
    assert len(replies) == 1, replies  # the hub asked once; nobody else asks here
    # Under its namespace's reply subjects (hub/_reply_boxes.py): r.<ns>.<nonce>.<token>.
    ns = re.escape(settings.namespace)
    assert re.fullmatch(rf"_INBOX\.r\.{ns}\.[0-9a-f]{{16}}\.[0-9a-f]{{16}}", replies[0]), replies


async def test_a_deaf_verdict_does_not_replace_an_operators_quarantine(
    wf_hub: Hub, fleet: Fleet, wf_settings: MeshSettings
) -> None:
    """An agent an operator quarantined (its breaker tripped) and then found deaf by a probe
    of an attempt it had before: the breaker keeps the operator's reason, so an answer on its
    ctl subject — which clears a deaf verdict (``Registry.answered_on_ctl``) — does not lift
    the operator's quarantine."""
    agent = echo_agent(fleet, "deafop.a", "wf:deafop:v1")
    await agent.start()
    engine = wf_hub.workflows
    assert engine is not None
    tracker = engine._tracker
    view = wf_hub.registry.agents[agent.agent_id]
    view.breaker.trip()  # as the operator's quarantine does (``_control``)
    rec = TaskRecord(
        task_id="deafop-0",
        workflow_id="deafop",
        step=0,
        namespace=wf_settings.namespace,
        attempt=1,
        agent_id=agent.agent_id,
    )
    key = protocol.task_key(rec.namespace, rec.task_id)
    track = tracker.open(rec, key, NonRecordingSpan(INVALID_SPAN_CONTEXT))
    try:
        since = view.spoke_at - 1.0  # nobody answered, and the agent was heard after that
        verdict = tracker._no_responders(
            track, agent.agent_id, 1, (agent.agent_id, 1, since, False)
        )
        assert verdict == "gone"
        assert view.breaker.why == "operator quarantine", view.breaker.why
        wf_hub.registry.answered_on_ctl(view)
        assert view.breaker.state is BreakerState.OPEN
    finally:
        tracker.close(track, None)
