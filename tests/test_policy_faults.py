"""Fanouts whose policy decides before every step ended (``any``, ``quorum(k)``) under the
faults the chaos suite found (tests/chaos/policies.py), on a real nats-server: the steps the
policy no longer needs are stopped — fenced and their handlers told to stop — whatever a read
of their records says."""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

import pytest
from nats.js.errors import KeyWrongLastSequenceError

from reach_mesh import Client, MeshSettings, Step, WorkflowResult, protocol
from reach_mesh.agent import Agent, Task, TaskFailed
from reach_mesh.hub import Hub, _durable
from reach_mesh.hub._step_track import StepTrack
from reach_mesh.models import ErrorBody, TaskEnvelope, TaskState
from reach_mesh.workflow import (
    AttemptRecord,
    StepResult,
    TaskRecord,
    TaskStatusEvent,
    WorkflowRecord,
    spec_digest,
)

from .helpers import Fleet, cancelled_step, echo_agent, eventually, task_record

pytestmark = pytest.mark.timeout(60)


async def _until_stopped(ended: list[str]) -> str:
    """A slow step's handler: 8 s, noting in ``ended`` whether it was cancelled (stopped as
    unneeded) or ran to its end."""
    try:
        await asyncio.sleep(8)
    except asyncio.CancelledError:
        ended.append("cancelled")
        raise
    ended.append("ran to its end")
    return "late"


async def _slow_or_fast(mesh: Client, name: str) -> WorkflowResult:
    """An ``any`` fanout of a slow step (task id ``{name}-slow``, capability
    ``wf:{name}-slow:v1``) and a fast one (``{name}-f0``, ``wf:{name}-fast:v1``), to its result."""
    return await mesh.fanout(
        [
            Step(capability=f"wf:{name}-slow:v1", task_id=f"{name}-slow", timeout=10),
            Step(capability=f"wf:{name}-fast:v1", payload=0, task_id=f"{name}-f0"),
        ],
        policy="any",
        timeout=15,
    )


async def _slow_while_fast(
    fleet: Fleet, name: str, started: asyncio.Event, ended: list[str]
) -> Agent:
    """Start agents ``{name}.slow`` (``wf:{name}-slow:v1``: sets ``started``, then runs until
    stopped, ``ended`` saying how) and ``{name}.fast`` (``wf:{name}-fast:v1``: its payload,
    once the slow step started: decided while the slow step runs); the slow one."""
    slow = fleet.agent(f"{name}.slow")
    fast = fleet.agent(f"{name}.fast")

    @slow.handler(f"wf:{name}-slow:v1")
    async def wait(task: Task[Any]) -> str:
        started.set()
        return await _until_stopped(ended)

    @fast.handler(f"wf:{name}-fast:v1")
    async def quick(task: Task[Any]) -> Any:
        await started.wait()
        return task.payload

    await slow.start()
    await fast.start()
    return slow


async def _retried_while_fast(
    fleet: Fleet, name: str, snapped: asyncio.Event, second: asyncio.Event, ended: list[str]
) -> Agent:
    """As :func:`_slow_while_fast`, but the slow step's attempt 1 fails (retryable) once
    ``snapped`` is set, and its attempt 2 (setting ``second``) is the one that runs until
    stopped: the fast step decides while attempt 2 runs."""
    slow = fleet.agent(f"{name}.slow")
    fast = fleet.agent(f"{name}.fast")

    @slow.handler(f"wf:{name}-slow:v1")
    async def wait(task: Task[Any]) -> str:
        if task.attempt == 1:
            await snapped.wait()  # (the test has the record at attempt 1)
            raise TaskFailed("once", retryable=True)
        second.set()
        return await _until_stopped(ended)

    @fast.handler(f"wf:{name}-fast:v1")
    async def quick(task: Task[Any]) -> Any:
        await second.wait()
        return task.payload

    await slow.start()
    await fast.start()
    return slow


def _hang_create(monkeypatch: pytest.MonkeyPatch, key: str, stalled: asyncio.Event) -> None:
    """The hub's create of the task record ``key`` is never answered (its runner waits until
    it is cancelled): ``stalled`` is set when it is sent."""
    real_create = _durable.create

    async def no_answer(
        bucket: _durable.Bucket, k: str, data: bytes, deadline: float, **kw: Any
    ) -> int:
        if k == key:
            stalled.set()
            await asyncio.Event().wait()
        return await real_create(bucket, k, data, deadline, **kw)

    monkeypatch.setattr(_durable, "create", no_answer)


@pytest.mark.parametrize("policy", ["any", "quorum(2)"])
async def test_an_unneeded_step_read_from_a_replica_behind_is_stopped_all_the_same(
    wf_hub: Hub,
    fleet: Fleet,
    wf_settings: MeshSettings,
    monkeypatch: pytest.MonkeyPatch,
    policy: str,
) -> None:
    """A fanout whose steps name their task ids (claimed: a task record each before it is
    sent) is decided by its fast steps while the slow one runs. The hub reads the slow step's
    record to fence it, and the read — a direct get, answered by any replica — comes from a
    replica behind the record's create: "no such key". A named step has no attempt in the
    workflow record, so the hub took it for never started and stopped nothing: no fence, no
    cancel to its agent; the handler ran to its end after the result was stored, and the
    result said the step had no attempt (chaos ``partition``, seed 301: an unneeded step's
    handler started 5 s after the result, its record never marked cancelled)."""
    ns = wf_settings.namespace
    engine = wf_hub.workflows
    assert engine is not None
    started = asyncio.Event()
    ended: list[str] = []
    tag = policy[0]  # (task ids of their own per case)
    slow = await _slow_while_fast(fleet, "behind", started, ended)
    behind = protocol.task_key(ns, f"behind-{tag}-slow")
    real_get = engine._jsc.kv_get

    async def replica_behind(bucket: str, key: str) -> tuple[bytes, int] | None:
        if bucket == protocol.KV_TASKS and key == behind and started.is_set():
            return None  # a replica that has not got the step's create yet
        return await real_get(bucket, key)

    monkeypatch.setattr(engine._jsc, "kv_get", replica_behind)
    fasts = 1 if policy == "any" else 2
    async with Client(settings=wf_settings) as mesh:
        res = await mesh.fanout(
            [Step(capability="wf:behind-slow:v1", task_id=f"behind-{tag}-slow", timeout=10)]
            + [
                Step(capability="wf:behind-fast:v1", payload=i, task_id=f"behind-{tag}-f{i}")
                for i in range(fasts)
            ],
            policy=policy,
            timeout=20,
        )
    assert res.state is TaskState.SUCCEEDED, res
    assert res.steps[0].cancelled and all(s.ok for s in res.steps[1:]), res.steps
    # The result tells what was sent: attempt 1, to the slow agent.
    assert res.steps[0].attempts == 1 and res.steps[0].agent_id == slow.agent_id, res.steps[0]
    # Fenced, and its handler stopped at once (not left to run its 8 s).
    await eventually(lambda: bool(ended), timeout=3)
    assert ended == ["cancelled"]
    rec = await task_record(wf_hub.nc, ns, f"behind-{tag}-slow")
    assert rec is not None and rec.cancelled, rec


async def test_an_unneeded_step_read_at_an_older_attempt_is_stopped_at_its_current_one(
    wf_hub: Hub, fleet: Fleet, wf_settings: MeshSettings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A ``quorum(2)`` fanout's slow step failed once, retryably: its record moved on to
    attempt 2, which runs when the two fast steps meet the quorum. The hub's read of the slow
    step's record, to fence it, comes from a replica behind that write: attempt 1. The fence
    (a compare-and-set on that revision) failed, and the hub, the workflow still its own,
    stopped what the old record named — attempt 1, long over — and left attempt 2 running,
    unfenced, to its end (chaos ``partition``, seed 301: a step reported stopped after 3
    attempts, its attempt 4 run to the end after the result)."""
    ns = wf_settings.namespace
    engine = wf_hub.workflows
    assert engine is not None
    second, snapped = asyncio.Event(), asyncio.Event()
    ended: list[str] = []
    await _retried_while_fast(fleet, "older", snapped, second, ended)
    key = protocol.task_key(ns, "older-slow")
    first: list[tuple[bytes, int]] = []  # the record at attempt 1, as a replica behind has it
    real_get = engine._jsc.kv_get

    async def replica_behind(bucket: str, k: str) -> tuple[bytes, int] | None:
        if bucket == protocol.KV_TASKS and k == key and second.is_set() and first:
            return first[0]
        return await real_get(bucket, k)

    monkeypatch.setattr(engine._jsc, "kv_get", replica_behind)
    async with Client(settings=wf_settings) as mesh:
        tasks = await mesh.nc.jetstream().key_value(protocol.KV_TASKS)
        wf_id = await mesh.submit_fanout(
            [Step(capability="wf:older-slow:v1", task_id="older-slow", retries=1, timeout=10)]
            + [
                Step(capability="wf:older-fast:v1", payload=i, task_id=f"older-f{i}")
                for i in range(2)
            ],
            policy="quorum(2)",
            timeout=20,
        )

        async def at_attempt_1() -> bool:
            try:
                entry = await tasks.get(key)
            except Exception:
                return False
            if entry.value is None or TaskRecord.model_validate_json(entry.value).attempt != 1:
                return False
            first.append((entry.value, int(entry.revision or 0)))
            return True

        await eventually(at_attempt_1, timeout=5)
        snapped.set()
        res = await mesh.workflow(wf_id, timeout=15)
    assert res.state is TaskState.SUCCEEDED, res
    assert res.steps[0].cancelled and res.steps[0].attempts == 2, res.steps[0]
    await eventually(lambda: bool(ended), timeout=3)
    assert ended == ["cancelled"]
    rec = await task_record(wf_hub.nc, ns, "older-slow")
    assert rec is not None and rec.cancelled and rec.attempt == 2, rec


async def test_an_unneeded_step_read_behind_the_hubs_own_write_is_stopped_at_its_attempt(
    wf_hub: Hub, fleet: Fleet, wf_settings: MeshSettings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A ``quorum(2)`` fanout's slow step failed once, retryably: this hub recorded attempt 2
    and sent it. While it runs the two fast steps meet the quorum, and the stop of the slow
    step meets a stream with no leader (a server stopped, SIGSTOP, and running again: an
    election). Its read at the leader fails past the retries; the replica read instead is the
    server that was stopped, behind this hub's own writes: attempt 1. The fence, a
    compare-and-set on that revision, fails too (no leader): no "moved" to read again. The
    hub stopped what that record named — attempt 1, long over —, reported the step stopped
    after 1 attempt, and left attempt 2 running to its end (chaos secure seed 171,
    ``node_stop``: "step 0 stopped as unneeded after 2 attempts, but attempt 3 ran"). The hub
    wrote attempt 2 itself: a read behind its own write is not the step's record."""
    ns = wf_settings.namespace
    engine = wf_hub.workflows
    assert engine is not None
    second, snapped = asyncio.Event(), asyncio.Event()
    ended: list[str] = []
    await _retried_while_fast(fleet, "own", snapped, second, ended)
    key = protocol.task_key(ns, "own-slow")
    first: list[tuple[bytes, int]] = []  # the record at attempt 1, as the replica behind has it
    real_get = engine._jsc.kv_get
    real_read = _durable.get_at_leader
    real_cas = _durable.cas
    asked: list[str] = []

    async def replica_behind(bucket: str, k: str) -> tuple[bytes, int] | None:
        if bucket == protocol.KV_TASKS and k == key and second.is_set() and first:
            return first[0]
        return await real_get(bucket, k)

    async def no_leader(bucket: _durable.Bucket, k: str) -> tuple[bytes, int] | None:
        if k == key and second.is_set():
            asked.append(k)
            raise TimeoutError("no leader answers")
        return await real_read(bucket, k)

    async def no_leader_write(
        bucket: _durable.Bucket, k: str, data: bytes, last: int, deadline: float, **kw: Any
    ) -> int:
        if k == key and TaskRecord.model_validate_json(data).cancelled:
            raise TimeoutError("no leader answers")
        return await real_cas(bucket, k, data, last, deadline, **kw)

    monkeypatch.setattr(engine._jsc, "kv_get", replica_behind)
    monkeypatch.setattr(_durable, "get_at_leader", no_leader)
    monkeypatch.setattr(_durable, "cas", no_leader_write)
    async with Client(settings=wf_settings) as mesh:
        tasks = await mesh.nc.jetstream().key_value(protocol.KV_TASKS)
        wf_id = await mesh.submit_fanout(
            [Step(capability="wf:own-slow:v1", task_id="own-slow", retries=1, timeout=10)]
            + [Step(capability="wf:own-fast:v1", payload=i, task_id=f"own-f{i}") for i in range(2)],
            policy="quorum(2)",
            timeout=20,
        )

        async def at_attempt_1() -> bool:
            try:
                entry = await tasks.get(key)
            except Exception:
                return False
            if entry.value is None or TaskRecord.model_validate_json(entry.value).attempt != 1:
                return False
            first.append((entry.value, int(entry.revision or 0)))
            return True

        await eventually(at_attempt_1, timeout=5)
        snapped.set()
        res = await mesh.workflow(wf_id, timeout=15)
    assert res.state is TaskState.SUCCEEDED, res
    assert asked, "the stop never read the slow step's record at the leader"
    # The result tells what was sent: attempt 2, and it was told to stop at once.
    assert res.steps[0].cancelled and res.steps[0].attempts == 2, res.steps[0]
    with contextlib.suppress(AssertionError):
        await eventually(lambda: bool(ended), timeout=3)
    assert ended == ["cancelled"], ended


async def test_an_unneeded_step_with_no_record_yet_is_fenced_against_a_late_create(
    wf_hub: Hub, fleet: Fleet, wf_settings: MeshSettings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An ``any`` fanout's slow step has no record yet when the fast step decides it: its
    create does not land (the stream does not answer it), and no agent was chosen for it when
    the workflow started. The stop read no record at the leader and concluded "never started"
    — true then — and wrote nothing. But a create of that record still in flight, the
    previous owner's (a hub that lost the workflow without noticing, its create retried
    through the elections), then landed after the result and that hub sent its attempt 1,
    which ran to its end (chaos secure seed 177, ``node_stop``: "step 1 stopped as unneeded
    after 0 attempts, but attempt 1 ran", chaos-177-00324, -00420, -00596). The stop creates
    the step's record, cancelled, as a cancel's does: that late create fails, and its hub
    finds the step stopped instead of sending it."""
    ns = wf_settings.namespace
    engine = wf_hub.workflows
    assert engine is not None
    stalled = asyncio.Event()
    fast = fleet.agent("unmade.fast")

    @fast.handler("wf:unmade-fast:v1")
    async def quick(task: Task[Any]) -> Any:
        await stalled.wait()  # decided while the slow step's create hangs
        return task.payload

    await fast.start()
    key = protocol.task_key(ns, "unmade-slow")
    real_create = _durable.create
    _hang_create(monkeypatch, key, stalled)
    async with Client(settings=wf_settings) as mesh:
        # No agent serves the slow step: none is chosen when the workflow starts (no
        # ``first_agents`` attempt to fence it by).
        res = await _slow_or_fast(mesh, "unmade")
    assert res.state is TaskState.SUCCEEDED, res
    assert res.steps[0].cancelled and res.steps[0].attempts == 0, res.steps[0]
    # The previous owner's create lands now, naming the attempt 1 it would send next.
    late = TaskRecord(
        task_id="unmade-slow",
        workflow_id=res.workflow_id,
        step=0,
        namespace=ns,
        attempt=1,
        agent_id="unmade.slow",
        history=[AttemptRecord(attempt=1, agent_id="unmade.slow", state=TaskState.PENDING)],
    )
    assert engine._tasks_kv is not None
    with pytest.raises(KeyWrongLastSequenceError):
        await real_create(
            engine._tasks_kv, key, protocol.encode(late), asyncio.get_running_loop().time() + 5
        )
    rec = await task_record(wf_hub.nc, ns, "unmade-slow")
    assert rec is not None and rec.cancelled and rec.attempt == 0, rec


@pytest.mark.parametrize("stale", [0, 2], ids=["leader", "old-leader-awake"])
async def test_an_unneeded_step_whose_record_moved_after_its_read_is_stopped_at_the_new_attempt(
    wf_hub: Hub,
    fleet: Fleet,
    wf_settings: MeshSettings,
    monkeypatch: pytest.MonkeyPatch,
    stale: int,
) -> None:
    """An ``any`` fanout is decided by its fast step while the slow step's attempt 1 runs.
    The hub reads the slow step's record at the stream's leader to fence it — and a write of
    that record lands right after the read: attempt 2, sent to another agent (a write in
    flight when the branch became unneeded; here the write of a hub that still runs the
    workflow, behind a partition, and sends the attempt it recorded). The fence, a
    compare-and-set on the revision read, fails; the workflow is still this hub's. Stopped
    from the record it had read, the hub told attempt 1's agent to stop and left attempt 2
    running, unfenced, to its end after the result (the chaos checker's "unneeded step
    started late"). It reads the record at the leader once more and stops the step from
    that: attempt 2 fenced and told to stop too. ``stale``: the next reads still answer the
    record as it was — a stream leader stopped (SIGSTOP) and running again answers as the
    leader for a moment from what it had (chaos seed 152, ``node_stop``) — and the hub asks
    again until a read shows the move."""
    ns = wf_settings.namespace
    engine = wf_hub.workflows
    assert engine is not None
    started, ready, second = asyncio.Event(), asyncio.Event(), asyncio.Event()
    ended: dict[int, list[str]] = {1: [], 2: []}
    slow = fleet.agent("moved.slow")
    other = fleet.agent("moved.other")
    fast = fleet.agent("moved.fast")
    capability = "wf:moved-slow:v1"

    @slow.handler(capability)
    async def first(task: Task[Any]) -> str:
        started.set()
        return await _until_stopped(ended[1])

    @other.handler(capability)
    async def later(task: Task[Any]) -> str:
        second.set()
        return await _until_stopped(ended[2])

    @fast.handler("wf:moved-fast:v1")
    async def quick(task: Task[Any]) -> Any:
        await ready.wait()  # decided while attempt 1 of the slow step runs
        return task.payload

    await slow.start()
    await fast.start()
    key = protocol.task_key(ns, "moved-slow")
    real_read = _durable.get_at_leader
    js = wf_hub.nc.jetstream()
    tasks = await js.key_value(protocol.KV_TASKS)
    moved: list[int] = []
    before: list[tuple[bytes, int]] = []
    stale_left = [stale]

    async def read_then_moved(bucket: _durable.Bucket, k: str) -> tuple[bytes, int] | None:
        got = await real_read(bucket, k)
        if k != key or got is None:
            return got
        if moved:
            if stale_left[0] > 0:
                stale_left[0] -= 1
                return before[0]  # (the old leader, awake again, answers what it had)
            return got
        before.append(got)
        # Right after the read: the record moves to attempt 2, which is sent to ``other``.
        rec = TaskRecord.model_validate_json(got[0])
        assert rec.attempt == 1 and rec.agent_id == slow.agent_id, rec
        rec.attempt, rec.agent_id, rec.state = 2, other.agent_id, TaskState.PENDING
        rec.history = [*rec.history, AttemptRecord(attempt=2, agent_id=other.agent_id)]
        moved.append(await tasks.update(k, protocol.encode(rec), last=got[1]))
        env = TaskEnvelope(
            task_id=rec.task_id,
            attempt=2,
            capability=capability,
            payload=None,
            namespace=ns,
            timeout=10,
            workflow_id=rec.workflow_id,
            step=0,
            track=True,
        )
        headers = {
            protocol.HDR_MSG_ID: protocol.attempt_msg_id(ns, rec.task_id, 2),
            protocol.HDR_EXPECTED_STREAM: protocol.STREAM_WORK,
        }
        subject = protocol.work_subject(ns, other.agent_id)
        await js.publish(subject, protocol.encode(env), headers=headers)
        await asyncio.wait_for(second.wait(), 5)  # attempt 2 runs
        return got  # the stop goes on from the revision it read

    monkeypatch.setattr(_durable, "get_at_leader", read_then_moved)
    async with Client(settings=wf_settings) as mesh:
        wf_id = await mesh.submit_fanout(
            [
                Step(capability=capability, task_id="moved-slow", timeout=10),
                Step(capability="wf:moved-fast:v1", payload=0, task_id="moved-f0"),
            ],
            policy="any",
            timeout=20,
        )
        await asyncio.wait_for(started.wait(), 5)
        await other.start()  # (after attempt 1 went to ``slow``)
        ready.set()
        res = await mesh.workflow(wf_id, timeout=15)
    assert res.state is TaskState.SUCCEEDED, res
    assert moved, "the stop never read the slow step's record at the leader"
    assert res.steps[0].cancelled and res.steps[1].ok, res.steps
    # Both attempts stopped at once (not left to run their 8 s), the record fenced at 2.
    with contextlib.suppress(AssertionError):
        await eventually(lambda: bool(ended[1] and ended[2]), timeout=3)
    assert ended == {1: ["cancelled"], 2: ["cancelled"]}, ended
    rec = await task_record(wf_hub.nc, ns, "moved-slow")
    assert rec is not None and rec.cancelled and rec.attempt == 2, rec
    assert stale_left == [0]  # (every stale read was made)


async def test_a_branch_its_owner_stopped_is_no_failure_for_the_hub_that_takes_it_over(
    wf_hub: Hub, fleet: Fleet, wf_settings: MeshSettings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A ``quorum(2)`` fanout whose owner saw two steps fail (the quorum out of reach), fenced
    the third as unneeded and died before it stored the result. The hub that takes it over
    finds the stopped branch's record ``cancelled`` at once — before it has read the failures
    back from the status stream (steps decided by their first attempt have no final record)
    — and counted it as the fanout's first failure: the result's error was the stopped
    step's ("step 2 ended PENDING"), not a failure's. (The status stream's reads take 0.3 s
    here, as after an election: the stopped branch comes first every time.)"""
    ns = wf_settings.namespace
    engine = wf_hub.workflows
    assert engine is not None
    tracker = engine._tracker
    catch_up = tracker.catch_up

    async def slow_catch_up(track: Any) -> None:
        await asyncio.sleep(0.3)
        await catch_up(track)

    monkeypatch.setattr(tracker, "catch_up", slow_catch_up)
    agent = echo_agent(fleet, "taken.a1", "wf:taken:v1")
    await agent.start()
    wf_id = "policy-taken-over"
    steps = [Step(capability="wf:taken:v1", payload=i, timeout=10) for i in range(3)]
    failure = ErrorBody(
        code="REACH_HANDLER_FAILED", message="planned", details={"retryable": False}
    )
    async with Client(settings=wf_settings) as mesh:
        spec = mesh._workflow_spec("fanout", steps, "quorum(2)", 30, wf_id)
        js = mesh.nc.jetstream()
        record = WorkflowRecord(
            spec=spec,
            spec_digest=spec_digest(spec),
            owner="hub-gone",
            submitted_at=time.time(),
            first_agents=[agent.agent_id] * 3,
        )
        wfs = await js.key_value(protocol.KV_WORKFLOWS)
        await wfs.put(protocol.workflow_key(ns, wf_id), protocol.encode(record))
        for i in range(2):  # failed for good on the agent: only their statuses say so
            status = TaskStatusEvent(
                task_id=f"{wf_id}-{i}",
                attempt=1,
                agent_id=agent.agent_id,
                state=TaskState.FAILED,
                workflow_id=wf_id,
                step=i,
                error=failure,
            )
            await js.publish(
                protocol.task_status(agent.agent_id, status.task_id), protocol.encode(status)
            )
        stopped = cancelled_step(ns, wf_id, 2, agent.agent_id)
        tasks = await js.key_value(protocol.KV_TASKS)
        await tasks.put(protocol.task_key(ns, stopped.task_id), protocol.encode(stopped))
        # The submission comes back to a hub (JetStream redelivers it: the owner died).
        await mesh.submit_fanout(steps, policy="quorum(2)", workflow_id=wf_id, timeout=30)
        res = await mesh.workflow(wf_id, timeout=15)
    assert res.state is TaskState.FAILED, res
    # A failure puts the quorum out of reach (step 2 can no longer succeed): step 1
    # (the other) may be stopped as unneeded then. Stopped steps are reported so, never as failures.
    assert any(s.state is TaskState.FAILED and not s.cancelled for s in res.steps), res.steps
    for s in res.steps:
        assert s.state is TaskState.FAILED or (s.cancelled and not s.state.final), s
    assert res.steps[2].cancelled, res.steps[2]
    assert res.error is not None and res.error.code == failure.code, res.error


@pytest.mark.parametrize("stored", ["succeeded", "timeout", "failed"])
async def test_an_unneeded_branch_whose_stored_outcome_the_run_never_heard_keeps_it(
    wf_hub: Hub,
    fleet: Fleet,
    wf_settings: MeshSettings,
    monkeypatch: pytest.MonkeyPatch,
    stored: str,
) -> None:
    """A policy fanout taken over from a hub that died: its other steps' records are final
    already (written by a run before), and the last step's attempt 1 stored its outcome in
    ``REACH_STATUS`` while no hub owned the workflow. The run that takes it over decides its
    policy at once, on the final records, before the last step's runner has read back what
    its attempt stored (``catch_up``: slowed here, as after an election) — and stopped that
    step as unneeded without a look at the status stream: its stored outcome, which met or
    decided the policy as much as the others, was reported "stopped as unneeded (PENDING)"
    and its record written ``cancelled`` (chaos secure seed 184, ``partition``:
    chaos-184-00574, quorum(2), step 2's TIMEOUT stored 3.6 s before the last takeover;
    chaos-184-00828, ``any``, the first success). A branch of a run that took the workflow
    over keeps the outcome its current attempt stored, as one that ran on to it does.

    ``succeeded``: an ``any`` fanout decided by step 0's final record, step 1 SUCCEEDED with
    its value; ``timeout``/``failed``: ``quorum(2)`` of three, steps 0 and 1 final
    TIMEOUT/FAILED (the quorum out of reach), step 2's stored TIMEOUT (``retries=0``: it
    decides the step) or FAILED for good."""
    ns = wf_settings.namespace
    engine = wf_hub.workflows
    assert engine is not None
    wf_id = f"unheard-{stored}"
    last = 1 if stored == "succeeded" else 2
    branch = f"{wf_id}-{last}"
    tracker = engine._tracker
    catch_up = tracker.catch_up

    async def slow_catch_up(track: StepTrack, *args: Any, **kwargs: Any) -> list[str]:
        if track.task_id == branch:
            # (Cancelled here by the policy's decision, if not before: in its record's read
            # or write. Never heard by the run, either way.)
            await asyncio.sleep(1.0)
        return await catch_up(track, *args, **kwargs)

    monkeypatch.setattr(tracker, "catch_up", slow_catch_up)
    agent = echo_agent(fleet, "unheard.a1", "wf:unheard:v1")
    await agent.start()
    policy = "any" if stored == "succeeded" else "quorum(2)"
    steps = [
        Step(capability="wf:unheard:v1", payload=i, timeout=10, retries=0) for i in range(last + 1)
    ]
    state = {
        "succeeded": TaskState.SUCCEEDED,
        "timeout": TaskState.TIMEOUT,
        "failed": TaskState.FAILED,
    }[stored]
    error = (
        None
        if state is TaskState.SUCCEEDED
        else ErrorBody(
            code="REACH_TIMEOUT" if state is TaskState.TIMEOUT else "REACH_HANDLER_FAILED",
            message="planned",
            details={"retryable": False} if state is TaskState.FAILED else {},
        )
    )
    async with Client(settings=wf_settings) as mesh:
        spec = mesh._workflow_spec("fanout", steps, policy, 30, wf_id)
        js = mesh.nc.jetstream()
        record = WorkflowRecord(
            spec=spec,
            spec_digest=spec_digest(spec),
            owner="hub-gone",
            submitted_at=time.time(),
            first_agents=[agent.agent_id] * len(steps),
        )
        wfs = await js.key_value(protocol.KV_WORKFLOWS)
        await wfs.put(protocol.workflow_key(ns, wf_id), protocol.encode(record))
        tasks = await js.key_value(protocol.KV_TASKS)
        for i in range(last):  # final records (a run before wrote them): the policy decides
            done = TaskRecord(
                task_id=f"{wf_id}-{i}",
                workflow_id=wf_id,
                step=i,
                namespace=ns,
                state=state,
                attempt=1,
                agent_id=agent.agent_id,
                decided_by=1,
                result=f"v{i}" if error is None else None,
                error=error,
                history=[AttemptRecord(attempt=1, agent_id=agent.agent_id, state=state)],
            )
            await tasks.put(protocol.task_key(ns, done.task_id), protocol.encode(done))
        # The last step's attempt 1 (named in the workflow record, no task record) stored
        # its outcome while no hub owned the workflow.
        status = TaskStatusEvent(
            task_id=branch,
            attempt=1,
            agent_id=agent.agent_id,
            state=state,
            workflow_id=wf_id,
            step=last,
            result=f"v{last}" if error is None else None,
            error=error,
        )
        await js.publish(protocol.task_status(agent.agent_id, branch), protocol.encode(status))
        # The submission comes back to a hub (JetStream redelivers it: the owner died).
        await mesh.submit_fanout(steps, policy=policy, workflow_id=wf_id, timeout=30)
        res = await mesh.workflow(wf_id, timeout=15)
    assert res.state is state, res
    got = res.steps[last]
    assert got.state is state and not got.cancelled, res.steps
    assert got.decided_by == 1 and got.attempts == 1, got
    if error is None:
        assert got.result == f"v{last}", got
        assert res.result == ["v0", "v1"], res.result
    else:
        assert got.error is not None and got.error.code == error.code, got
        assert res.result == [None] * len(steps), res.result
    rec = await task_record(wf_hub.nc, ns, branch)
    assert rec is None or (rec.state is state and not rec.cancelled), rec


async def test_an_unneeded_step_whose_leader_cannot_be_read_is_stopped_all_the_same(
    wf_hub: Hub, fleet: Fleet, wf_settings: MeshSettings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The stop of an unneeded branch reads its record at the stream's leader; while no
    leader answers (an election after a server was killed), past the retries, it is read from
    a replica instead and the branch stopped best effort. Before, the error handed the whole
    workflow back, each time it came back (chaos secure seed 154, ``node_kill``: ten
    workflows handed back so, two of them never delivered again)."""
    ns = wf_settings.namespace
    ended: list[str] = []
    slow = fleet.agent("noleader.slow")
    fast = fleet.agent("noleader.fast")

    @slow.handler("wf:nl-slow:v1")
    async def late(task: Task[Any]) -> str:
        return await _until_stopped(ended)

    @fast.handler("wf:nl-fast:v1")
    async def quick(task: Task[Any]) -> Any:
        return task.payload

    await slow.start()
    await fast.start()
    key = protocol.task_key(ns, "nl-slow")
    real_read = _durable.get_at_leader
    asked: list[str] = []

    async def no_leader(bucket: _durable.Bucket, k: str) -> tuple[bytes, int] | None:
        if k == key:
            asked.append(k)
            raise TimeoutError("no leader answers")
        return await real_read(bucket, k)

    monkeypatch.setattr(_durable, "get_at_leader", no_leader)
    async with Client(settings=wf_settings) as mesh:
        res = await _slow_or_fast(mesh, "nl")
    assert res.state is TaskState.SUCCEEDED, res
    assert asked, "the stop never read the slow step's record at the leader"
    assert res.steps[0].cancelled and res.steps[1].ok, res.steps
    with contextlib.suppress(AssertionError):
        await eventually(lambda: bool(ended), timeout=3)
    assert ended == ["cancelled"]
    rec = await task_record(wf_hub.nc, ns, "nl-slow")
    assert rec is not None and rec.cancelled, rec


@pytest.mark.parametrize("same_hub", [False, True], ids=["another-hub", "this-hub"])
async def test_a_hub_that_lost_the_workflow_leaves_the_new_owners_decided_step_as_it_was(
    wf_hub: Hub,
    fleet: Fleet,
    wf_settings: MeshSettings,
    monkeypatch: pytest.MonkeyPatch,
    same_hub: bool,
) -> None:
    """An ``any`` fanout's owner lost it without noticing (another hub took it over by a
    compare-and-set on its workflow record), its create of the slow step's record hung
    through the elections. The new owner made that record, sent its attempt 1, was decided by
    it — which writes nothing more: the record stays PENDING at attempt 1 — and stored the
    result. Then the old owner's fast step succeeded, its policy decided, and it fenced the
    slow step as unneeded: from the record at the leader, a compare-and-set on a revision
    nobody had moved since, which landed. The step that decided the workflow read
    ``cancelled`` ever after (in the views, the API, and for its agents' fence reads),
    against the stored result (chaos secure seed 177, ``node_stop``, chaos-177-00596). A
    stop of a step whose record this hub did not write last is written only while the
    workflow record at the leader still names this hub: here it names the new owner, and the
    record is left as that owner made it.

    ``this-hub``: the new owner is a second run of the workflow on the same hub (its
    hand-back adopted there, then the submission delivered there again), whose takeover
    leaves the record naming that hub — the first run is no owner all the same (chaos secure
    seed 182, ``partition``: four fanouts so)."""
    ns = wf_settings.namespace
    engine = wf_hub.workflows
    assert engine is not None
    stalled, ready = asyncio.Event(), asyncio.Event()
    fast = fleet.agent("lost.fast")

    @fast.handler("wf:lost-fast:v1")
    async def quick(task: Task[Any]) -> Any:
        await ready.wait()  # decided after the takeover
        return task.payload

    await fast.start()
    key = protocol.task_key(ns, "lost-slow")
    _hang_create(monkeypatch, key, stalled)
    new_owner = engine.hub_id if same_hub else "hub-new-owner"
    agent_id = "lost.other"
    async with Client(settings=wf_settings) as mesh:
        # No agent serves the slow step: none is chosen at the start (no ``first_agents``).
        wf_id = await mesh.submit_fanout(
            [
                Step(capability="wf:lost-slow:v1", task_id="lost-slow", timeout=10),
                Step(capability="wf:lost-fast:v1", payload=0, task_id="lost-f0"),
            ],
            policy="any",
            timeout=15,
        )
        await asyncio.wait_for(stalled.wait(), 5)
        js = mesh.nc.jetstream()
        wfs = await js.key_value(protocol.KV_WORKFLOWS)
        wf_key = protocol.workflow_key(ns, wf_id)
        entry = await wfs.get(wf_key)
        assert entry.value is not None
        record = WorkflowRecord.model_validate_json(entry.value)
        # The new owner: its takeover, the slow step's record (attempt 1 decided it), its result.
        record.owner = new_owner
        revision = await wfs.update(wf_key, protocol.encode(record), last=entry.revision)
        made = TaskRecord(
            task_id="lost-slow",
            workflow_id=wf_id,
            step=0,
            namespace=ns,
            attempt=1,
            agent_id=agent_id,
            history=[AttemptRecord(attempt=1, agent_id=agent_id, state=TaskState.PENDING)],
        )
        tasks = await js.key_value(protocol.KV_TASKS)
        made_at = await tasks.create(key, protocol.encode(made))
        record.state = TaskState.SUCCEEDED
        record.result = WorkflowResult(
            workflow_id=wf_id,
            kind="fanout",
            policy="any",
            state=TaskState.SUCCEEDED,
            steps=[
                StepResult(
                    index=0,
                    task_id="lost-slow",
                    state=TaskState.SUCCEEDED,
                    agent_id=agent_id,
                    attempts=1,
                    decided_by=1,
                    result="slow",
                ),
                StepResult(index=1, task_id="lost-f0", state=TaskState.PENDING, cancelled=True),
            ],
            result=["slow", None],
            hub_id=new_owner,
        )
        await wfs.update(wf_key, protocol.encode(record), last=revision)
        ready.set()  # the old owner's fast step succeeds: its policy decides
        res = await mesh.workflow(wf_id, timeout=10)
        assert res.hub_id == new_owner and res.steps[0].ok, res  # the stored result
        # The old owner has run its fanout to its end (it found the result stored).
        await eventually(lambda: not engine._owning, timeout=5)
        got = await tasks.get(key)
    assert got.revision == made_at, TaskRecord.model_validate_json(got.value or b"")


@pytest.mark.parametrize("named", [False, True], ids=["first-agents", "task-ids"])
async def test_the_owners_unneeded_branch_is_stopped_with_no_read_of_the_workflow_record(
    wf_hub: Hub,
    fleet: Fleet,
    wf_settings: MeshSettings,
    monkeypatch: pytest.MonkeyPatch,
    named: bool,
) -> None:
    """The normal end of an ``any`` fanout: its owner stops the branch it no longer needs
    from the record it wrote itself (or, with no task record, the attempt 1 its workflow
    record names), without asking who owns the workflow — that read is only for a record
    another hub wrote (see the test above)."""
    engine = wf_hub.workflows
    assert engine is not None
    started = asyncio.Event()
    ended: list[str] = []
    tag = "n" if named else "f"
    await _slow_while_fast(fleet, "own", started, ended)
    reads: list[str] = []
    record_now = engine._record_now

    async def counted(
        ns: str, workflow_id: str, end: float | None = None
    ) -> tuple[bytes, int] | None:
        reads.append(workflow_id)
        return await record_now(ns, workflow_id, end)

    monkeypatch.setattr(engine, "_record_now", counted)
    async with Client(settings=wf_settings) as mesh:
        res = await mesh.fanout(
            [
                Step(
                    capability="wf:own-slow:v1",
                    task_id=f"own-{tag}-slow" if named else None,
                    timeout=10,
                ),
                Step(
                    capability="wf:own-fast:v1",
                    payload=0,
                    task_id=f"own-{tag}-f0" if named else None,
                ),
            ],
            policy="any",
            timeout=15,
        )
    assert res.state is TaskState.SUCCEEDED, res
    assert res.steps[0].cancelled and res.steps[1].ok, res.steps
    await eventually(lambda: bool(ended), timeout=3)
    assert ended == ["cancelled"]
    assert reads == []


async def test_a_step_that_ran_on_to_its_outcome_through_its_stop_keeps_it(
    wf_hub: Hub, fleet: Fleet, wf_settings: MeshSettings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A ``quorum(2)`` fanout's step 0 has its SUCCEEDED in hand but is held in an await (a
    read of the status stream, a question to its agent) when its two siblings meet the
    quorum. The fanout cancels it, and the await swallows the cancellation — Python 3.11's
    ``asyncio.wait_for``, under nats-py's requests, returns its future's result when that
    completed with the cancel — so the step runs on and decides by its SUCCEEDED (its event
    says so). The fanout took it for still running all the same: fenced as unneeded, its
    record read PENDING (its current attempt decided it: nothing written), its result thrown
    away and the step reported stopped (chaos secure seed 179, ``partition``,
    chaos-179-00590: a5's SUCCEEDED, stored 1 s before the deciding one, reported PENDING,
    stopped as unneeded)."""
    ns = wf_settings.namespace
    engine = wf_hub.workflows
    assert engine is not None
    in_hand = asyncio.Event()
    swallowed: list[bool] = []
    agent = fleet.agent("ranon.a")

    @agent.handler("wf:ranon:v1")
    async def work(task: Task[Any]) -> Any:
        if task.payload != 0:
            await in_hand.wait()  # the siblings succeed once step 0's outcome is in hand
        return task.payload

    await agent.start()
    real_watch = engine._watch

    async def held(track: StepTrack, pol: Any, deadline: float) -> Any:
        if track.task_id == "ranon-0":
            await eventually(lambda: track.final is not None, timeout=5)
            in_hand.set()
            try:
                await asyncio.Event().wait()  # a read the fanout's decision cancels
            except asyncio.CancelledError:
                swallowed.append(True)  # (as ``wait_for`` does when its read just answered)
        return await real_watch(track, pol, deadline)

    monkeypatch.setattr(engine, "_watch", held)
    async with Client(settings=wf_settings) as mesh:
        res = await mesh.fanout(
            [Step(capability="wf:ranon:v1", payload=i, task_id=f"ranon-{i}") for i in range(3)],
            policy="quorum(2)",
            timeout=15,
        )
    assert swallowed, "the fanout never cancelled step 0"
    assert res.state is TaskState.SUCCEEDED, res
    assert res.steps[0].state is TaskState.SUCCEEDED and not res.steps[0].cancelled, res.steps
    assert res.result == [0, 1, 2], res.result
    rec = await task_record(wf_hub.nc, ns, "ranon-0")
    assert rec is not None and not rec.cancelled, rec


@pytest.mark.parametrize("how", ["retried", "watched", "deaf"])
async def test_a_branch_that_ran_on_through_its_stop_without_an_outcome_holds_nothing_up(
    wf_hub: Hub,
    fleet: Fleet,
    wf_settings: MeshSettings,
    monkeypatch: pytest.MonkeyPatch,
    how: str,
) -> None:
    """An ``any`` fanout of three steps is decided by step 0 while steps 1 and 2 run. Step 2's
    runner is held in an await (a read of the status stream, a question to its agent) that
    swallows the fanout's cancellation, with no outcome in hand — then, ``retried``: its
    attempt 1 fails (retryable) and the step would send attempt 2; ``watched``: it watches
    its attempt 1 on, running; ``deaf``: the await swallows every cancel for 4 s.

    The fanout waited for the branch to end: the result stored, and step 1 fenced, only when
    it did, and meanwhile it recorded and sent new attempts (chaos secure seed 184,
    ``node_stop``, chaos-184-00972: an ``any`` fanout decided at 20.04 whose step 2 ran on
    for 23 s through five new attempts; the result stored at 43.02 and step 1's fence,
    stopping the unneeded branch, slipped to 43.001, so a3 ran step 1's attempt 16 at 42.04).
    Now the result and the fences come at once, and the branch starts nothing more."""
    ns = wf_settings.namespace
    engine = wf_hub.workflows
    assert engine is not None
    loop = asyncio.get_running_loop()
    started = {1: asyncio.Event(), 2: asyncio.Event()}
    swallowed = asyncio.Event()
    cancelled_at: list[float] = []  # when the fanout's (first) cancel reached step 2's await
    held_ended = asyncio.Event()
    runs: list[tuple[int, int]] = []  # (step, attempt) as handlers started
    stopped: dict[int, float] = {}  # step -> when its handler was cancelled

    async def work(task: Task[Any]) -> Any:
        step = task.payload
        if step == 0:
            await started[1].wait()
            await started[2].wait()  # decided while steps 1 and 2 run
            return 0
        runs.append((step, task.attempt))
        started[step].set()
        if how == "retried" and step == 2 and task.attempt == 1:
            await swallowed.wait()
            raise TaskFailed("once", retryable=True)
        try:
            await asyncio.sleep(8)
        except asyncio.CancelledError:
            stopped.setdefault(step, loop.time())
            raise
        return step

    for name in ("swal.a", "swal.b"):  # two: a retry of step 2 has another agent to go to
        fleet.agent(name).handler("wf:swal:v1")(work)
    for agent in fleet.agents:
        await agent.start()
    real_watch = engine._watch
    held_once: list[bool] = []

    async def held(track: StepTrack, pol: Any, deadline: float) -> Any:
        if track.task_id != f"swal-{how}-2" or held_once:
            return await real_watch(track, pol, deadline)
        held_once.append(True)
        try:
            try:
                await asyncio.Event().wait()  # a read the fanout's decision cancels
            except asyncio.CancelledError:
                cancelled_at.append(loop.time())  # swallowed, no outcome in hand
                swallowed.set()
            until = loop.time() + 4
            while how == "deaf" and loop.time() < until:
                with contextlib.suppress(asyncio.CancelledError):
                    await asyncio.sleep(until - loop.time())
            return await real_watch(track, pol, deadline)
        finally:
            held_ended.set()

    monkeypatch.setattr(engine, "_watch", held)
    async with Client(settings=wf_settings) as mesh:
        res = await mesh.fanout(
            [
                Step(capability="wf:swal:v1", payload=i, task_id=f"swal-{how}-{i}", timeout=10)
                for i in range(3)
            ],
            policy="any",
            timeout=20,
        )
        done_at = loop.time()
    assert cancelled_at, "the fanout never cancelled step 2"
    decided_at = cancelled_at[0]
    # Stored at once: not when the branch that ignored its cancel ends (8 s, or 4 s deaf).
    assert done_at - decided_at < 2.0, f"result stored {done_at - decided_at:.2f}s after"
    assert res.state is TaskState.SUCCEEDED and res.result == [0, None, None], res
    assert res.steps[0].ok and res.steps[1].cancelled and res.steps[2].cancelled, res.steps
    # The other unneeded branch fenced and its handler stopped at once too.
    await eventually(lambda: 1 in stopped, timeout=3)
    assert stopped[1] - decided_at < 2.0, f"step 1 stopped {stopped[1] - decided_at:.2f}s after"
    if how != "retried":  # (its attempt 1 failed by itself)
        await eventually(lambda: 2 in stopped, timeout=3)
        assert stopped[2] - decided_at < 2.0, stopped
    # Once the branch has ended (the deaf await too): it started no attempt after the decision.
    await asyncio.wait_for(held_ended.wait(), timeout=10)
    await asyncio.sleep(0.5)  # (a retry's backoff is 0.02-0.1 s)
    assert [a for s, a in runs if s == 2] == [1], runs
    rec = await task_record(wf_hub.nc, ns, f"swal-{how}-2")
    assert rec is not None and rec.cancelled, rec
    assert all(h.attempt == 1 for h in rec.history if h.agent_id is not None), rec.history
