"""When an agent reads a step's task record (its fence) before running it, on a real nats-server.

A hub that gives up an attempt it sent writes the record, then stores a fence marker behind
the attempt's work message on the same subject. An agent in touch with the hubs runs a first
delivery with nothing queued behind it (``num_pending`` 0) without reading the record; any
other message reads it. These tests pin both halves:

- the fast path: an agent in touch reads no record for fresh steps;
- a step with a marker (or anything) behind it reads the record and is dropped, also when it
  waited in the stream while its agent was cut off;
- an agent out of touch with the hubs (no heartbeat answered for two intervals: a pause, a
  partition) reads the record;
- the hub stores the marker when a step is decided by its deadline, asks the agent before it
  gives an attempt up on LOST, and a ``cancel`` before arrival is a promise.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from nats.aio.msg import Msg

from reach_mesh import Client, MeshSettings, RetryPolicy, Step, protocol
from reach_mesh._guard import guarded
from reach_mesh.agent import Agent, Task
from reach_mesh.agent._fences import delivery_of
from reach_mesh.hub import Hub
from reach_mesh.models import TaskEnvelope, TaskState
from reach_mesh.workflow import TaskRecord

from .helpers import Fleet, echo_agent, eventually, heal, partition, relayed


async def _stale_step(
    nc: Any,
    ns: str,
    agent_id: str,
    task_id: str,
    capability: str = "wf:fence:v1",
    *,
    marker: bool = True,
    cancelled: bool = True,
    copy: str = "",
) -> None:
    """Store a work message for attempt 1 of ``task_id`` that a hub has cancelled: its record
    says so (unless not ``cancelled``), and (``marker``) a fence marker is stored behind the
    message. ``copy``: a suffix to its message id (the same attempt stored again)."""
    js = nc.jetstream()
    kv = await js.key_value(protocol.KV_TASKS)
    record = TaskRecord(
        task_id=task_id,
        workflow_id="fence-wf",
        step=0,
        namespace=ns,
        attempt=1,
        agent_id=agent_id,
        cancelled=cancelled,
    )
    env = TaskEnvelope(
        task_id=task_id,
        capability=capability,
        payload=None,
        namespace=ns,
        workflow_id="fence-wf",
        step=0,
    )
    subject = protocol.work_subject(ns, agent_id)
    # The record first: a test cannot hold the message back from an agent that pulls.
    await kv.put(protocol.task_key(ns, task_id), protocol.encode(record))
    await js.publish(
        subject,
        protocol.encode(env),
        headers={protocol.HDR_MSG_ID: protocol.attempt_msg_id(ns, task_id, 1) + copy},
    )
    if marker:
        await js.publish(
            subject,
            protocol.dumps({"task_id": task_id, "attempt": 1}),
            headers={
                protocol.HDR_MSG_ID: protocol.fence_msg_id(ns, task_id, 1),
                protocol.HDR_FENCE: "1",
            },
        )


def _fence_agent(agent_id: str, settings: MeshSettings, runs: list[str]) -> Agent:
    agent = Agent(agent_id, settings=settings)

    @agent.handler("wf:fence:v1")
    async def run(task: Task[Any]) -> str:
        runs.append(task.task_id)
        return "ran"

    return agent


@pytest.mark.parametrize(
    "reply",
    [
        "$JS.ACK.REACH_WORK.work-a-1f.1.12345.120.1733000000000000000.0",
        "$JS.ACK._.ACCHASH.REACH_WORK.work-a-1f.3.77.12.1733000000000000000.5.tok",
        "$JS.ACK.hub.ACCHASH.REACH_WORK.work-a-1f.2.78.13.1733000000000000000.0",
    ],
)
def test_delivery_reads_the_ack_subject_as_nats_py_does(reply: str) -> None:
    meta = Msg(_client=None, subject="reach.work.x", reply=reply).metadata  # type: ignore[arg-type]
    assert delivery_of(reply) == (
        meta.num_delivered,
        meta.sequence.stream,
        meta.sequence.consumer,
        meta.num_pending,
    )


@pytest.mark.parametrize(
    "reply", [None, "", "_INBOX.abc.1", "$JS.ACK.a.b.c", "$JS.ACK.S.C.x.1.2.3.4"]
)
def test_delivery_of_a_non_jetstream_subject_is_none(reply: str | None) -> None:
    assert delivery_of(reply) is None


async def test_an_agent_in_touch_reads_no_fence_for_fresh_steps(
    wf_hub: Hub, fleet: Fleet, wf_settings: MeshSettings
) -> None:
    # A heartbeat interval long enough that a slow test machine keeps it in touch throughout.
    slow_beats = {"heartbeat_interval": 2.0, "lease_timeout": 6.0}
    a = Agent(f"{wf_settings.namespace}.fast.a", settings=wf_settings.model_copy(update=slow_beats))
    fleet.agents.append(a)

    @a.handler("wf:echo:v1")
    async def echo(task: Task[Any]) -> Any:
        fleet.runs[task.task_id] += 1
        return task.payload

    await a.start()
    assert a.work is not None
    async with Client(settings=wf_settings) as mesh:
        for i in range(5):
            res = await mesh.fanout([Step(capability="wf:echo:v1", payload=i)], timeout=10)
            assert res.state is TaskState.SUCCEEDED
            res = await mesh.chain(
                [Step(capability="wf:echo:v1", payload={"i": i}) for _ in range(2)], timeout=10
            )
            assert res.state is TaskState.SUCCEEDED
    assert a.work.fence_reads == 0
    assert sum(fleet.runs.values()) == 15


async def test_a_step_given_up_while_its_agent_was_cut_off_is_dropped_on_return(
    wf_hub: Hub, nats_url: str, wf_settings: MeshSettings
) -> None:
    """Stored, then given up (record and marker) while the agent's connection was down — for
    well under two heartbeat intervals, so by its heartbeats it is still in touch: the marker
    queued behind the message drops it."""
    ns = wf_settings.namespace
    relay, settings = await relayed(
        nats_url, wf_settings, heartbeat_interval=5.0, lease_timeout=15.0
    )
    runs: list[str] = []
    a = _fence_agent(f"{ns}.cut.a", settings, runs)
    await a.start()
    try:
        assert a.work is not None
        async with Client(settings=wf_settings) as mesh:
            await relay.cut()
            await eventually(lambda: not a.nc.is_connected)
            await _stale_step(mesh.nc, ns, a.agent_id, "cut-step")
            await relay.start()
            await eventually(lambda: a.work is not None and a.work.fences.markers >= 1, timeout=10)
        assert a.in_touch()
        assert runs == []
        # Dropped by the marker that came right behind it: no record read needed.
        assert a.work.fenced == 1 and a.work.fence_reads == 0
    finally:
        await a.close()


async def test_a_step_waiting_for_its_slot_does_not_start_while_its_agent_is_cut_off(
    wf_hub: Hub, nats_url: str, wf_settings: MeshSettings
) -> None:
    """A step past its fence waits for a slot; the agent's connection goes down, and meanwhile
    the hubs give its attempt up (the record moves on). The slot frees during the cut: the
    step's second read (its first is old) cannot be made — which used to mean "run it, it
    passed", and it ran while its attempt ran elsewhere. It waits for a hub's answer instead,
    and back, it reads the record and is dropped."""
    ns = wf_settings.namespace
    relay, settings = await relayed(nats_url, wf_settings)
    release = asyncio.Event()
    runs: list[str] = []
    a = Agent(f"{ns}.slot.a", settings=settings, max_concurrency=1, max_queue=1)

    @a.handler("wf:fence:v1")
    async def step(task: Task[Any]) -> str:
        runs.append(task.task_id)
        return "ran"

    @a.handler("wf:block:v1")
    async def block(task: Task[Any]) -> str:
        await release.wait()
        return "unblocked"

    await a.start()
    try:
        assert a.work is not None
        async with Client(settings=wf_settings) as mesh:
            await _stale_step(
                mesh.nc, ns, a.agent_id, "slot-block", "wf:block:v1", marker=False, cancelled=False
            )
            await eventually(lambda: a._running == 1)
            await _stale_step(mesh.nc, ns, a.agent_id, "slot-step", marker=False, cancelled=False)
            await eventually(lambda: a._waiting == 1)  # past its fence, waiting for the slot
            await relay.cut()
            await eventually(lambda: not a.nc.is_connected)
            kv = await mesh.nc.jetstream().key_value(protocol.KV_TASKS)
            moved = TaskRecord(
                task_id="slot-step", workflow_id="fence-wf", step=0, namespace=ns, attempt=2
            )
            await kv.put(protocol.task_key(ns, "slot-step"), protocol.encode(moved))
            await asyncio.sleep(0.5)  # its fence read is old now: read again before it starts
            release.set()  # the slot frees while the agent is cut off
            # Longer than a fence read's own timeout (3 s): it would have failed by now.
            await asyncio.sleep(4.0)
            assert runs == []
            await relay.start()
            await eventually(lambda: a.work is not None and a.work.fenced >= 1, timeout=15)
        assert runs == []
    finally:
        await a.close()


async def _silent(fleet: Fleet, name: str, runs: list[str]) -> Agent:
    """A started fence agent whose heartbeats then stop: silent, still connected and
    listening."""
    a = _fence_agent(f"{fleet.settings.namespace}.{name}", fleet.settings, runs)
    fleet.agents.append(a)
    await a.start()
    assert a._hb_task is not None
    a._hb_task.cancel()
    return a


async def test_an_agent_out_of_touch_reads_the_fence(
    wf_hub: Hub, fleet: Fleet, wf_settings: MeshSettings
) -> None:
    """No heartbeat answered for two intervals (a paused process, a partition): the hubs may
    have declared it LOST and moved on without reaching it."""
    ns = wf_settings.namespace
    runs: list[str] = []
    a = await _silent(fleet, "away.a", runs)
    assert a.work is not None
    await eventually(lambda: not a.in_touch(), timeout=2)
    async with Client(settings=wf_settings) as mesh:
        # No marker behind it: only being out of touch makes the agent read the record.
        await _stale_step(mesh.nc, ns, a.agent_id, "away-step", marker=False)
        await eventually(lambda: a.work is not None and a.work.fenced >= 1, timeout=5)
    assert runs == []
    assert a.work.fence_reads == 1


async def test_an_agent_out_of_touch_waits_for_a_hubs_answer_before_its_fence(
    wf_hub: Hub, fleet: Fleet, wf_settings: MeshSettings
) -> None:
    """Out of touch, an agent heartbeats once before it reads a step's record: right after a
    partition heals, the replica of the records on its side is behind the fences the hubs
    wrote meanwhile (chaos seed 153, ``partition``: 14 steps ran again 0.26 s after the heal).
    While no hub answers the step waits, unread and unrun; once one does, it runs."""
    ns = wf_settings.namespace
    runs: list[str] = []
    a = await _silent(fleet, "touch.a", runs)
    assert a.work is not None
    beats = protocol.hub_agent_subject("*.*.*", "heartbeat")
    (sub,) = [s for s in wf_hub._subs if s.subject == beats]
    await sub.unsubscribe()  # nobody answers heartbeats
    wf_hub._subs.remove(sub)
    await wf_hub.nc.flush()
    await eventually(lambda: not a.in_touch(), timeout=3)
    async with Client(settings=wf_settings) as mesh:
        # A step its record says is current (no marker, not cancelled).
        await _stale_step(mesh.nc, ns, a.agent_id, "touch-step", marker=False, cancelled=False)
        await asyncio.sleep(1.5)
        assert runs == [] and a.work.fence_reads == 0
        cb = guarded(beats, wf_hub._dispatcher(wf_hub._on_heartbeat))
        wf_hub._subs.append(await wf_hub.nc.subscribe(beats, queue=protocol.HUB_QUEUE, cb=cb))
        await wf_hub.nc.flush()
        # (Its lease lapsed meanwhile: declared LOST, it registers again, as after a heal.)
        a._hb_task = asyncio.create_task(a._heartbeat_loop())
        await eventually(lambda: runs == ["touch-step"], timeout=10)
    assert a.in_touch()
    assert a.work.fence_reads >= 1


async def test_an_agent_whose_loop_stalled_reads_the_fence(
    wf_hub: Hub, fleet: Fleet, wf_settings: MeshSettings
) -> None:
    """A handler that blocks the event loop (a sync call) stalls everything the agent does: a
    step delivered meanwhile waits unread, long enough to be given up. For a second after a
    stall the agent reads every record — here a cancelled one, with no marker behind it."""
    ns = wf_settings.namespace
    runs: list[str] = []
    slow_beats = {"heartbeat_interval": 2.0, "lease_timeout": 6.0}
    a = _fence_agent(f"{ns}.stall.a", wf_settings.model_copy(update=slow_beats), runs)
    fleet.agents.append(a)
    blocked: list[bool] = []

    @a.handler("wf:stall:v1")
    async def stall(task: Task[Any]) -> str:
        blocked.append(True)
        time.sleep(0.3)  # noqa: ASYNC251 - the point: a blocked event loop
        return "done"

    await a.start()
    assert a.work is not None
    async with Client(settings=wf_settings) as mesh:
        await mesh.submit_fanout([Step(capability="wf:stall:v1")], timeout=10)
        await eventually(lambda: bool(blocked))  # resumes only after the block
        await _stale_step(mesh.nc, ns, a.agent_id, "stall-step", marker=False)
        await eventually(lambda: a.work is not None and a.work.fenced >= 1, timeout=5)
    assert a.in_touch()
    assert runs == []
    assert a.work.fence_reads == 1


async def _busy(
    fleet: Fleet,
    name: str,
    release: asyncio.Event,
    runs: list[str],
    settings: MeshSettings | None = None,
    finish: asyncio.Event | None = None,
) -> Agent:
    """An agent with one slot, taken by a blocking step: its next step waits in the stream
    (and, ``finish``, runs until it is set)."""
    if settings is None:
        a = fleet.agent(name, max_concurrency=1, max_queue=0)
    else:
        a = Agent(f"{settings.namespace}.{name}", settings=settings, max_concurrency=1, max_queue=0)
        fleet.agents.append(a)

    @a.handler("wf:block:v1")
    async def block(task: Task[Any]) -> str:
        await release.wait()
        return "unblocked"

    @a.handler("wf:queued:v1")
    async def queued(task: Task[Any]) -> str:
        runs.append(task.task_id)
        if finish is not None:
            await asyncio.wait_for(finish.wait(), 20)
        return "ran"

    await a.start()
    return a


async def _block(mesh: Client, a: Agent) -> str:
    """Take ``a``'s one slot with a blocking step; returns its workflow id."""
    blocker = await mesh.submit_fanout([Step(capability="wf:block:v1")], timeout=30)
    await eventually(lambda: a._running == 1, timeout=5)
    return blocker


def _queued(task_id: str, **retry: float) -> Step:
    """A step for the busy agent that waits in the stream: not given up for being
    undelivered (``deliver_timeout``) while the test looks."""
    return Step(
        capability="wf:queued:v1",
        task_id=task_id,
        retry=RetryPolicy(deliver_timeout=30, **retry),
    )


async def test_a_step_that_waited_in_the_stream_is_dropped_by_its_marker(
    wf_hub: Hub, fleet: Fleet, wf_settings: MeshSettings
) -> None:
    """Its one slot taken, the agent pulls nothing: a step waits in the stream and is given
    up meanwhile. The agent stays in touch throughout; the marker pending behind the step
    when it is finally delivered makes it read the record and drop it."""
    ns = wf_settings.namespace
    release = asyncio.Event()
    runs: list[str] = []
    slow_beats = {"heartbeat_interval": 2.0, "lease_timeout": 6.0}
    a = await _busy(fleet, "dry.a", release, runs, wf_settings.model_copy(update=slow_beats))
    assert a.work is not None
    async with Client(settings=wf_settings) as mesh:
        blocker = await _block(mesh, a)
        await _stale_step(mesh.nc, ns, a.agent_id, "dry-step", "wf:queued:v1")
        release.set()
        assert (await mesh.workflow(blocker, timeout=10)).state is TaskState.SUCCEEDED
        await eventually(lambda: a.work is not None and a.work.fences.markers >= 1, timeout=5)
    assert a.in_touch()
    assert runs == []
    assert a.work.fenced == 1 and a.work.fence_reads >= 1


async def test_a_step_decided_by_its_deadline_is_marked_and_dropped(
    wf_hub: Hub, fleet: Fleet, wf_settings: MeshSettings
) -> None:
    release = asyncio.Event()
    runs: list[str] = []
    a = await _busy(fleet, "late.a", release, runs)
    assert a.work is not None
    async with Client(settings=wf_settings) as mesh:
        blocker = await _block(mesh, a)
        res = await mesh.fanout([_queued("late-step")], timeout=1.0)
        assert res.state is TaskState.TIMEOUT
        release.set()
        assert (await mesh.workflow(blocker, timeout=10)).state is TaskState.SUCCEEDED
        await eventually(lambda: a.work is not None and a.work.fences.markers >= 1, timeout=5)
    assert runs == []
    assert a.work.fenced == 1
    assert a.work.fences.promised("late-step") == 1


async def test_an_agent_declared_lost_is_asked_before_its_attempt_is_given_up(
    wf_hub: Hub, fleet: Fleet, wf_settings: MeshSettings
) -> None:
    """Its agent declared LOST, a step still asks it (the probe, with ``fence``) before it
    gives the attempt up: an agent alive after all (its heartbeats lost, its ctl subject
    still heard) promises never to start it, and the attempt that goes elsewhere is the only
    one that runs."""
    release = asyncio.Event()
    runs: list[str] = []
    a = await _busy(fleet, "lost.a", release, runs)
    assert a.work is not None and a._hb_task is not None
    async with Client(settings=wf_settings) as mesh:
        await _block(mesh, a)
        # No give-up by silence first: only LOST moves the step on.
        wf_id = await mesh.submit_fanout([_queued("lost-step", silence_timeout=30)], timeout=30)
        await asyncio.sleep(0.3)  # attempt 1 stored for A, waiting behind the blocker
        a._hb_task.cancel()
        work = a.work
        assert work is not None
        await eventually(lambda: work.fences.promised("lost-step") >= 0, 10)
        assert a.work.fences.promised("lost-step") == 1
        # Its step has nowhere else to go: ended here, not left running (its submission
        # handed back by the closing hub) for the next tests' hubs, which serve every
        # namespace, to take over until its deadline.
        assert (await mesh.cancel_workflow(wf_id)).final
    release.set()
    assert runs == []


async def test_an_attempt_started_just_before_its_lost_fence_is_watched_again(
    wf_hub: Hub, fleet: Fleet, wf_settings: MeshSettings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An agent cut off with a step queued for it is declared LOST; the hub finds nobody on
    its ctl subject and gives the attempt up. Back (registered again) before the hub's
    fence write lands (a JetStream election after the heal holds it up), the agent reads the
    old record and starts the attempt. The hub asks again after its write (``next``: the
    attempt recorded): told it is in hand, it watches that attempt instead of sending the
    next one elsewhere. The step runs once.

    Chaos seed 151, ``partition``: without the second ask the step ran on another agent
    0.4 s later (21 such steps in one run)."""
    release, finish = asyncio.Event(), asyncio.Event()
    runs: list[str] = []
    a = await _busy(fleet, "revive.a", release, runs, finish=finish)
    b = fleet.agent("revive.b")
    b_runs: list[str] = []

    @b.handler("wf:queued:v1")
    async def elsewhere(task: Task[Any]) -> str:
        b_runs.append(task.task_id)
        return "ran on b"

    assert a.work is not None
    # The heal comes while the fence waits: A answers on ctl again and heartbeats (told it
    # is unknown, it registers again), its slot frees, it pulls attempt 1 and, back in
    # touch, starts it (it reads the old record).
    fenced = _hold_fence(
        monkeypatch,
        wf_hub,
        "revive-step",
        a,
        release,
        lambda: eventually(lambda: runs == ["revive-step"], 10),
    )
    async with Client(settings=wf_settings) as mesh:
        await _block(mesh, a)
        wf_id = await mesh.submit_fanout([_queued("revive-step", silence_timeout=30)], timeout=30)
        await asyncio.sleep(0.3)  # attempt 1 stored for A, waiting behind the blocker
        await b.start()  # where attempt 2 would go
        await partition(a)
        await asyncio.wait_for(fenced.wait(), 20)
        await asyncio.sleep(0.5)  # time for attempt 2 to reach B, were it sent
        await eventually(lambda: a.agent_id in wf_hub.registry.agents, 10)  # registered again
        finish.set()
        res = await mesh.workflow(wf_id, timeout=15)
    assert res.state is TaskState.SUCCEEDED and res.result == ["ran"]
    assert runs == ["revive-step"] and b_runs == []
    assert a.work.fenced == 0


async def test_a_cancelled_attempt_delivered_again_is_not_run_again(
    wf_hub: Hub, fleet: Fleet, wf_settings: MeshSettings
) -> None:
    """A hub cancels a running attempt (ctl ``cancel``: a branch its policy no longer needs);
    the agent stops the handler and acks the message. The ack is lost (JetStream electing a
    leader) and the message comes again, with a record read that says the attempt is current
    (a replica behind the cancel). The agent promised, when it stopped the handler, never to
    start the attempt again, and drops it. Chaos secure seed 152, ``partition``: a step
    cancelled as unneeded ran again, in full, on the same agent 5 s later."""
    ns = wf_settings.namespace
    started = asyncio.Event()
    runs: list[str] = []
    a = fleet.agent("again.a")

    @a.handler("wf:fence:v1")
    async def run(task: Task[Any]) -> str:
        runs.append(task.task_id)
        started.set()
        await asyncio.sleep(30)
        return "ran"

    await a.start()
    work = a.work
    assert work is not None
    async with Client(settings=wf_settings) as mesh:
        await _stale_step(mesh.nc, ns, a.agent_id, "again-step", marker=False, cancelled=False)
        await asyncio.wait_for(started.wait(), 5)
        body = {"op": "cancel", "task_id": "again-step", "attempt": 1, "workflow_id": "fence-wf"}
        answer = await mesh.nc.request(
            protocol.agent_ctl(a.agent_id), protocol.dumps(body), timeout=5
        )
        assert json.loads(answer.data)["cancelled"] is True
        await eventually(lambda: work.fenced == 1 and not work._held)
        # The same attempt delivered again; its record still says it is current.
        await _stale_step(
            mesh.nc, ns, a.agent_id, "again-step", marker=False, cancelled=False, copy="-again"
        )
        await eventually(lambda: work.fenced == 2, 5)
    assert runs == ["again-step"]
    assert work.fences.promised("again-step", "fence-wf") == 1


async def test_a_cancel_before_arrival_is_a_promise(
    wf_hub: Hub, fleet: Fleet, wf_settings: MeshSettings
) -> None:
    """An ``any`` fanout decided by another branch cancels the branch still queued for A: A
    drops it on arrival, unrun."""
    release = asyncio.Event()
    runs: list[str] = []
    a = await _busy(fleet, "any.a", release, runs)
    b = echo_agent(fleet, "any.b", "wf:other:v1")
    await b.start()
    assert a.work is not None
    async with Client(settings=wf_settings) as mesh:
        blocker = await _block(mesh, a)
        res = await mesh.fanout(
            [_queued("any-queued"), Step(capability="wf:other:v1", task_id="any-fast")],
            policy="any",
            timeout=10,
        )
        assert res.state is TaskState.SUCCEEDED
        await eventually(lambda: a.work is not None and a.work.fences.promised("any-queued") == 1)
        release.set()
        assert (await mesh.workflow(blocker, timeout=10)).state is TaskState.SUCCEEDED
        await eventually(lambda: a.work is not None and a.work.fenced >= 1, timeout=5)
    assert runs == []


async def test_a_promise_is_the_promise_of_one_workflows_step(
    wf_hub: Hub, fleet: Fleet, wf_settings: MeshSettings
) -> None:
    """Markers, ctl ``cancel`` and ctl ``task_state`` name the workflow whose step they give
    up: the promise they leave covers that step only, not a step of another workflow naming
    the same task id later (the id free again once its record expired) — nor does a
    remembered run of the id in one workflow answer a ``task_state`` asked for another."""
    ns = wf_settings.namespace
    a = echo_agent(fleet, "scoped.a", "wf:scoped:v1")
    await a.start()
    work = a.work
    assert work is not None
    async with Client(settings=wf_settings) as mesh:
        await mesh.nc.jetstream().publish(
            protocol.work_subject(ns, a.agent_id),
            protocol.dumps({"task_id": "scoped-m", "attempt": 2, "workflow_id": "wf-a"}),
            headers={protocol.HDR_MSG_ID: f"{ns}.scoped-m#2.fence", protocol.HDR_FENCE: "2"},
        )
        await eventually(lambda: work.fences.promised("scoped-m", "wf-a") == 2)
        assert work.fences.promised("scoped-m", "wf-b") == -1
        # Two workflows at once with one id (a default id named by another workflow): each
        # keeps its own promise; a marker that names no workflow (an earlier hub's) covers any.
        await mesh.nc.jetstream().publish(
            protocol.work_subject(ns, a.agent_id),
            protocol.dumps({"task_id": "scoped-m", "attempt": 1, "workflow_id": "wf-b"}),
            headers={protocol.HDR_MSG_ID: f"{ns}.scoped-m#1.fence", protocol.HDR_FENCE: "1"},
        )
        await mesh.nc.jetstream().publish(
            protocol.work_subject(ns, a.agent_id),
            protocol.dumps({"task_id": "scoped-n", "attempt": 1}),
            headers={protocol.HDR_MSG_ID: f"{ns}.scoped-n#1.fence", protocol.HDR_FENCE: "1"},
        )
        await eventually(lambda: work.fences.promised("scoped-n", "wf-c") == 1)
        assert work.fences.promised("scoped-m", "wf-b") == 1
        assert work.fences.promised("scoped-m", "wf-a") == 2
        ctl = protocol.agent_ctl(a.agent_id)

        async def ask(op: dict[str, Any]) -> dict[str, Any]:
            reply = await mesh.nc.request(ctl, protocol.dumps(op), timeout=5)
            answer: dict[str, Any] = json.loads(reply.data)
            return answer

        cancel = {"op": "cancel", "task_id": "scoped-c", "attempt": 1, "workflow_id": "wf-a"}
        assert (await ask(cancel))["cancelled"] is False
        asked = {"op": "task_state", "task_id": "scoped-t", "fence": 3, "workflow_id": "wf-a"}
        assert (await ask(asked)).get("fenced") is True
        for task_id, n in (("scoped-c", 1), ("scoped-t", 3)):
            assert work.fences.promised(task_id, "wf-a") == n
            assert work.fences.promised(task_id, "wf-b") == -1
        # A step of another workflow that names an id this agent ran: a task_state asked for
        # it is not answered with that run's outcome.
        res = await mesh.fanout(
            [Step(capability="wf:scoped:v1", payload=1, task_id="scoped-r")], timeout=10
        )
        assert res.state is TaskState.SUCCEEDED
        mine = await ask(
            {"op": "task_state", "task_id": "scoped-r", "workflow_id": res.workflow_id}
        )
        assert mine["state"] == "SUCCEEDED"
        other = await ask({"op": "task_state", "task_id": "scoped-r", "workflow_id": "wf-b"})
        assert other["state"] == "PENDING" and "result" not in other


async def test_malformed_fence_markers_and_ctl_fences_are_refused_and_lose_nothing(
    wf_hub: Hub, fleet: Fleet, wf_settings: MeshSettings
) -> None:
    """Markers whose attempt is not an attempt (< 1, not an integer) or whose body is not one
    are termed unread; a ctl ``task_state`` fence or ``cancel`` attempt below 1, or a ``next``
    not above its ``fence``, is answered ``REACH_BAD_REQUEST``. Nothing is promised, and the
    agent's next step runs as usual."""
    ns = wf_settings.namespace
    a = echo_agent(fleet, "bad.marks", "wf:marks:v1")
    await a.start()
    assert a.work is not None
    async with Client(settings=wf_settings) as mesh:
        js = mesh.nc.jetstream()
        bodies: list[bytes] = [
            protocol.dumps({"task_id": "m-neg", "attempt": -1}),
            protocol.dumps({"task_id": "m-zero", "attempt": 0}),
            protocol.dumps({"task_id": "m-str", "attempt": "2"}),
            protocol.dumps({"task_id": "m-bool", "attempt": True}),
            protocol.dumps({"attempt": 1}),
            b"not json",
        ]
        for i, body in enumerate(bodies):
            await js.publish(
                protocol.work_subject(ns, a.agent_id),
                body,
                headers={protocol.HDR_MSG_ID: f"{ns}.bad-{i}", protocol.HDR_FENCE: "1"},
            )
        await eventually(lambda: a.work is not None and a.work.fences.markers == len(bodies))
        for task_id in ("m-neg", "m-zero", "m-str", "m-bool"):
            assert a.work.fences.promised(task_id) == -1
        ctl = protocol.agent_ctl(a.agent_id)
        for op in (
            {"op": "task_state", "task_id": "c-neg", "fence": -1},
            {"op": "task_state", "task_id": "c-zero", "fence": 0},
            {"op": "task_state", "task_id": "c-next", "fence": 2, "next": 2},
            {"op": "task_state", "task_id": "c-next", "fence": 1, "next": "2"},
            {"op": "task_state", "task_id": "c-next", "next": 2},
            {"op": "cancel", "task_id": "c-neg", "attempt": -1},
            {"op": "cancel", "task_id": "c-bool", "attempt": True},
        ):
            answer = json.loads((await mesh.nc.request(ctl, protocol.dumps(op), timeout=5)).data)
            assert answer["error"]["code"] == "REACH_BAD_REQUEST", (op, answer)
        assert a.work.fences.promised("c-neg") == -1 and a.work.fences.promised("c-next") == -1
        res = await mesh.fanout([Step(agent_id=a.agent_id, payload=1)], timeout=10)
        assert res.state is TaskState.SUCCEEDED
        durable = protocol.work_consumer(a.agent_id)
        consumer = await js.consumer_info(protocol.STREAM_WORK, durable)
        assert consumer.num_redelivered == 0


def _hold_fence(
    monkeypatch: pytest.MonkeyPatch,
    hub: Hub,
    step: str,
    a: Agent,
    release: asyncio.Event,
    meanwhile: Callable[[], Awaitable[object]],
) -> asyncio.Event:
    """Hold ``hub``'s write of ``step``'s first fence (attempt 2, no agent) while ``a`` comes
    back (healed: it heartbeats and registers again), its slots free (``release``) and
    ``meanwhile`` is done: an agent back before a fence held up by JetStream. Returns the event
    set once the write went through."""
    engine = hub.workflows
    assert engine is not None
    cas = engine._cas
    fenced = asyncio.Event()

    async def held(key: str, rec: TaskRecord, rev: int, deadline: float) -> int:
        if rec.task_id == step and rec.attempt == 2 and rec.agent_id is None:
            await heal(a)
            release.set()
            await meanwhile()
            try:
                return await cas(key, rec, rev, deadline)
            finally:
                fenced.set()
        return await cas(key, rec, rev, deadline)

    monkeypatch.setattr(engine, "_cas", held)
    return fenced


async def _two_slots(
    fleet: Fleet,
    service: str,
    release: asyncio.Event,
    runs: list[str],
    b_runs: list[str],
    *,
    slots: int = 2,
    queue: int = 0,
) -> tuple[Agent, Agent]:
    """Agent A of ``service`` with ``slots`` slots (two: its pulls bring a fence marker in
    while a step's fence is being read), started, and agent B, where an attempt given up on
    would go."""
    a = fleet.agent(f"{service}.a", max_concurrency=slots, max_queue=queue)

    @a.handler("wf:block:v1")
    async def block(task: Task[Any]) -> str:
        await release.wait()
        return "unblocked"

    @a.handler("wf:queued:v1")
    async def queued(task: Task[Any]) -> str:
        runs.append(task.task_id)
        return "ran"

    b = fleet.agent(f"{service}.b")

    @b.handler("wf:queued:v1")
    async def elsewhere(task: Task[Any]) -> str:
        b_runs.append(task.task_id)
        return "ran on b"

    await a.start()
    return a, b


@pytest.mark.parametrize("read", ["old", "unreadable"])
async def test_a_revived_attempt_is_kept_whatever_its_fence_read_found_first(
    wf_hub: Hub,
    fleet: Fleet,
    wf_settings: MeshSettings,
    monkeypatch: pytest.MonkeyPatch,
    read: str,
) -> None:
    """Back from a partition, the agent reads the step's record (out of touch) just before
    the hub's LOST fence lands: the read finds the old record (``old``) or fails
    (``unreadable``: the message is sent again). Meanwhile the hub's marker arrives and the
    hub, asking after its fence, is told the attempt is in hand (the read is going on) and
    watches it again. The agent must not drop it for that marker — neither with the old
    record in hand, nor when the message comes again — or the step waits for an attempt
    nobody runs (here its 30 s silence timeout)."""
    step = f"revive-read-{read}"
    release = asyncio.Event()
    runs: list[str] = []
    b_runs: list[str] = []
    a, b = await _two_slots(fleet, f"rread-{read}", release, runs, b_runs)
    work = a.work
    assert work is not None
    record = work._record
    was_read = asyncio.Event()
    reads: list[TaskEnvelope] = []

    async def slow_record(env: TaskEnvelope) -> TaskRecord | None:
        if env.task_id != step or reads:
            return await record(env)
        reads.append(env)
        got = await record(env)  # before the hub's fence write
        was_read.set()
        # The answer comes late: the marker and the hub's ask after its fence come first.
        await eventually(
            lambda: work.fences.promised(step) >= 1 and step in work.fences._revived, 10
        )
        if read == "unreadable":
            raise RuntimeError("no JetStream answer")
        return got

    monkeypatch.setattr(work, "_record", slow_record)
    # (Healed, it registers again and, back in touch, reads records; its slots free: it
    # pulls attempt 1 and reads its record.)
    fenced = _hold_fence(
        monkeypatch, wf_hub, step, a, release, lambda: asyncio.wait_for(was_read.wait(), 10)
    )
    async with Client(settings=wf_settings) as mesh:
        for _ in range(2):
            await mesh.submit_fanout([Step(capability="wf:block:v1")], timeout=30)
        await eventually(lambda: a._running == 2, timeout=5)
        wf_id = await mesh.submit_fanout([_queued(step, silence_timeout=30)], timeout=30)
        await asyncio.sleep(0.3)  # attempt 1 stored for A, waiting behind the blockers
        await b.start()
        await partition(a)
        await asyncio.wait_for(fenced.wait(), 20)
        await eventually(lambda: runs == [step], 5)
        res = await mesh.workflow(wf_id, timeout=10)
    assert res.state is TaskState.SUCCEEDED and res.result == ["ran"]
    assert runs == [step] and b_runs == []


async def test_a_revived_attempt_given_up_again_is_fenced_again(
    wf_hub: Hub, fleet: Fleet, wf_settings: MeshSettings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A step queued on A (waiting for its slot) is given up when A is declared LOST, and
    watched again: A, back before the hub's fence landed, said after it that the attempt is
    in hand. A is cut off again, and the hub gives the revived attempt up a second time. That
    must fence it again (a record write, a marker, the ask): the record still naming the
    attempt of the first fence, with no agent, is what A keeps the revived attempt for — A,
    back once more before attempt 2 is recorded for B, would start it while B runs attempt 2."""
    step = "revive-again"
    release = asyncio.Event()
    runs: list[str] = []
    b_runs: list[str] = []
    a, b = await _two_slots(fleet, "again", release, runs, b_runs, slots=1, queue=1)
    work = a.work
    assert work is not None
    engine = wf_hub.workflows
    assert engine is not None
    cas = engine._cas
    writes: list[TaskRecord] = []
    second = asyncio.Event()

    async def held(key: str, rec: TaskRecord, rev: int, deadline: float) -> int:
        if rec.task_id != step or rec.attempt < 2 or len(writes) >= 2:
            return await cas(key, rec, rev, deadline)
        writes.append(rec.model_copy())
        # A answers on ctl again while the hub's write waits (a JetStream election).
        await heal(a, beat=False)
        if len(writes) == 1:
            return await cas(key, rec, rev, deadline)
        # Its slot frees: the attempt it holds starts, reading the record first.
        release.set()
        await eventually(lambda: runs == [step], 10)
        try:
            return await cas(key, rec, rev, deadline)
        finally:
            second.set()

    monkeypatch.setattr(engine, "_cas", held)
    async with Client(settings=wf_settings) as mesh:
        await mesh.submit_fanout([Step(capability="wf:block:v1")], timeout=30)
        await eventually(lambda: a._running == 1, timeout=5)
        wf_id = await mesh.submit_fanout([_queued(step, silence_timeout=2)], timeout=30)
        await eventually(lambda: step in work._held, 5)  # queued on A for its slot
        await b.start()
        await partition(a)
        # Given up (LOST), asked after the fence: in hand, so watched again.
        await eventually(lambda: work.fences._revived.get(step, (None, 0))[1] == 2, 20)
        await asyncio.sleep(0.3)
        await partition(a)  # silent again: the hub gives the revived attempt up
        res = await mesh.workflow(wf_id, timeout=20)
        await asyncio.wait_for(second.wait(), 10)
        await asyncio.sleep(1.0)  # time for attempt 2 to run on B, were it sent
    assert res.state is TaskState.SUCCEEDED and res.result == ["ran"]
    assert runs == [step] and b_runs == []
    # The second give-up recorded attempt 3, no agent: the first one's record fenced no more.
    assert [(w.attempt, w.agent_id) for w in writes] == [(2, None), (3, None)]


async def test_a_revive_is_of_one_workflows_step(
    wf_hub: Hub, fleet: Fleet, wf_settings: MeshSettings
) -> None:
    """A hub asked after its fence and was told a step of one workflow is in hand: what the
    agent keeps that attempt for (``Fences.revive``) says nothing of a step of another
    workflow naming the same task id later (the id free again once its record expired) —
    a promise made for that one drops its attempt as usual."""
    ns = wf_settings.namespace
    go = asyncio.Event()
    runs: list[Any] = []
    a = fleet.agent("revscope.a")

    @a.handler("wf:revscope:v1")
    async def run(task: Task[Any]) -> str:
        runs.append(task.payload)
        await asyncio.wait_for(go.wait(), 10)
        return "ran"

    await a.start()
    work = a.work
    assert work is not None
    async with Client(settings=wf_settings) as mesh:
        wf_id = await mesh.submit_fanout(
            [Step(capability="wf:revscope:v1", payload="first", task_id="revscope-t")],
            timeout=10,
        )
        await eventually(lambda: runs == ["first"])
        asked = {
            "op": "task_state",
            "task_id": "revscope-t",
            "workflow_id": wf_id,
            "fence": 1,
            "next": 2,
        }
        reply = await mesh.nc.request(protocol.agent_ctl(a.agent_id), protocol.dumps(asked), 5)
        assert json.loads(reply.data)["state"] in ("ACCEPTED", "RUNNING")
        go.set()
        assert (await mesh.workflow(wf_id, timeout=10)).state is TaskState.SUCCEEDED
        # Another workflow's step of the same id, given up (promised) before it arrives.
        js = mesh.nc.jetstream()
        subject = protocol.work_subject(ns, a.agent_id)
        await js.publish(
            subject,
            protocol.dumps({"task_id": "revscope-t", "attempt": 1, "workflow_id": "wf-two"}),
            headers={protocol.HDR_MSG_ID: f"{ns}.revscope-t#1.fence", protocol.HDR_FENCE: "1"},
        )
        await eventually(lambda: work.fences.promised("revscope-t", "wf-two") == 1)
        env = TaskEnvelope(
            task_id="revscope-t",
            capability="wf:revscope:v1",
            payload="second",
            namespace=ns,
            workflow_id="wf-two",
            step=0,
        )
        fenced = work.fenced
        await js.publish(
            subject,
            protocol.encode(env),
            headers={protocol.HDR_MSG_ID: protocol.attempt_msg_id(ns, "revscope-t", 1) + "x"},
        )
        await eventually(lambda: work.fenced > fenced or len(runs) > 1)
    assert runs == ["first"]
