"""Policy fanouts (``any``, ``quorum(k)``) whose workflow changed hands — taken over from a
hub that stopped branches, or lost by a hub that still decides — on a real nats-server: a
branch stopped by an earlier owner is no failure, an outcome stored that the new run never heard
is kept, and a hub that lost the workflow writes nothing over the new owner's steps. Split from
``test_policy_faults.py``."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
from nats.js.api import ClusterInfo, PeerInfo, RawStreamMsg, StreamInfo
from nats.js.errors import ServiceUnavailableError

from reach_mesh import Client, MeshSettings, MeshUnavailableError, Step, WorkflowResult, protocol
from reach_mesh.agent import Task
from reach_mesh.hub import Hub
from reach_mesh.hub._step_state import Workflow
from reach_mesh.hub._step_track import StepTrack
from reach_mesh.models import ErrorBody, TaskState
from reach_mesh.workflow import (
    AttemptRecord,
    StepResult,
    StepSpec,
    TaskRecord,
    TaskStatusEvent,
    WorkflowRecord,
    WorkflowSpec,
    spec_digest,
)

from .helpers import Fleet, cancelled_step, echo_agent, eventually, task_record
from .test_policy_faults import (
    _hang_create,
    _slow_while_fast,
)

pytestmark = pytest.mark.timeout(60)


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
        js = await _owned_by_a_gone_hub(mesh, ns, wf_id, steps, "quorum(2)", agent.agent_id)
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
        js = await _owned_by_a_gone_hub(mesh, ns, wf_id, steps, policy, agent.agent_id)
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


async def test_an_unheard_outcome_is_kept_when_another_agents_status_read_fails(
    wf_hub: Hub, fleet: Fleet, wf_settings: MeshSettings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As above (``succeeded``), but the unneeded branch had two open attempts on two agents:
    attempt 1 on a live agent, which stored its success while no hub owned the workflow, and
    attempt 2 on an agent whose ``REACH_STATUS`` read fails (the stream not answering in
    time for that subject). The reads are one per agent, newest attempt first: the failed
    one threw away the success read after it, and the branch was fenced as stopped
    (PENDING) — a valid result thrown away for a read the step did not need."""
    ns = wf_settings.namespace
    engine = wf_hub.workflows
    assert engine is not None
    wf_id = "unheard-unread"
    branch = f"{wf_id}-1"
    tracker = engine._tracker
    catch_up, last_status = tracker.catch_up, tracker.last_status
    gone = f"{ns}.unread.gone"
    failed: list[str] = []

    async def slow_catch_up(track: StepTrack, *args: Any, **kwargs: Any) -> list[str]:
        if track.task_id == branch:
            await asyncio.sleep(1.0)  # (never heard by the run: see above)
        return await catch_up(track, *args, **kwargs)

    async def unreadable(
        ns_: str, task_id: str, agent_id: str | None = None, *, patient: bool = False
    ) -> TaskStatusEvent | None:
        if task_id == branch and agent_id == gone:
            failed.append(agent_id)
            raise MeshUnavailableError("REACH_STATUS did not answer")
        return await last_status(ns_, task_id, agent_id, patient=patient)

    monkeypatch.setattr(tracker, "catch_up", slow_catch_up)
    monkeypatch.setattr(tracker, "last_status", unreadable)
    agent = echo_agent(fleet, "unread.a1", "wf:unread:v1")
    await agent.start()
    steps = [Step(capability="wf:unread:v1", payload=i, timeout=10, retries=1) for i in range(2)]
    async with Client(settings=wf_settings) as mesh:
        js = await _owned_by_a_gone_hub(mesh, ns, wf_id, steps, "any", agent.agent_id)
        tasks = await js.key_value(protocol.KV_TASKS)
        done = TaskRecord(
            task_id=f"{wf_id}-0",
            workflow_id=wf_id,
            step=0,
            namespace=ns,
            state=TaskState.SUCCEEDED,
            attempt=1,
            agent_id=agent.agent_id,
            decided_by=1,
            result="v0",
            history=[AttemptRecord(attempt=1, agent_id=agent.agent_id, state=TaskState.SUCCEEDED)],
        )
        await tasks.put(protocol.task_key(ns, done.task_id), protocol.encode(done))
        # The branch's attempt 2 went to another agent (attempt 1's unheard, as after a
        # takeover); attempt 1 stored its success meanwhile.
        two = TaskRecord(
            task_id=branch,
            workflow_id=wf_id,
            step=1,
            namespace=ns,
            attempt=2,
            agent_id=gone,
            history=[
                AttemptRecord(attempt=1, agent_id=agent.agent_id, state=TaskState.RUNNING),
                AttemptRecord(attempt=2, agent_id=gone),
            ],
        )
        await tasks.put(protocol.task_key(ns, branch), protocol.encode(two))
        status = TaskStatusEvent(
            task_id=branch,
            attempt=1,
            agent_id=agent.agent_id,
            state=TaskState.SUCCEEDED,
            workflow_id=wf_id,
            step=1,
            result="v1",
        )
        await js.publish(protocol.task_status(agent.agent_id, branch), protocol.encode(status))
        await mesh.submit_fanout(steps, policy="any", workflow_id=wf_id, timeout=30)
        res = await mesh.workflow(wf_id, timeout=15)
    assert failed, "the branch's stop never read the failing agent's status"
    assert res.state is TaskState.SUCCEEDED, res
    got = res.steps[1]
    assert got.state is TaskState.SUCCEEDED and not got.cancelled, res.steps
    assert got.decided_by == 1 and got.result == "v1", got
    rec = await task_record(wf_hub.nc, ns, branch)
    assert rec is not None and rec.state is TaskState.SUCCEEDED and not rec.cancelled, rec
    assert rec.decided_by == 1 and rec.result == "v1", rec


@pytest.mark.parametrize("leader", ["leader", "deposed-leader", "no-meta-leader"])
@pytest.mark.parametrize("same_hub", [False, True], ids=["another-hub", "this-hub"])
async def test_a_hub_that_lost_the_workflow_leaves_the_new_owners_decided_step_as_it_was(
    wf_hub: Hub,
    fleet: Fleet,
    wf_settings: MeshSettings,
    monkeypatch: pytest.MonkeyPatch,
    same_hub: bool,
    leader: str,
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
    seed 182, ``partition``: four fanouts so).

    ``deposed-leader``: for a moment after the takeover the workflow record is read "at the
    leader" from a server that led its stream, was cut off with the old owner, and still
    leads, answering the record as it was (this hub, the run's revision) while its
    ``STREAM.INFO`` shows it heard from no replica for seconds. ``no-meta-leader``: every
    such read is answered "JetStream system temporarily unavailable", as a server back from
    a cut with no metadata leader yet answers. Neither says whose the workflow is: the old
    owner asks again, and writes nothing over the new owner's step (chaos secure seed 203,
    ``partition``, chaos-203-00822: it fenced it, from a deposed leader's answer)."""
    ns = wf_settings.namespace
    engine = wf_hub.workflows
    assert engine is not None
    stale = _workflow_reads_stale(monkeypatch, engine._jsc._js, leader)
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
        stale.entry = entry  # (the record as the old owner's run wrote it)
        stale.opened = True
        ready.set()  # the old owner's fast step succeeds: its policy decides
        res = await mesh.workflow(wf_id, timeout=10)
        assert res.hub_id == new_owner and res.steps[0].ok, res  # the stored result
        # The old owner has run its fanout to its end (it found the result stored).
        await eventually(lambda: not engine._owning, timeout=5)
        got = await tasks.get(key)
    assert got.revision == made_at, TaskRecord.model_validate_json(got.value or b"")
    assert (leader == "leader") == (not stale.hits), stale.hits


class _StaleReads:
    """Once ``opened``, until ``STALE_FOR`` s after the first such read, ``_workflow_reads_stale``
    answers the leader reads of the workflow records' stream as a server that cannot say who
    owns the workflow does."""

    STALE_FOR = 0.6

    def __init__(self) -> None:
        self.opened = False
        self.until: float | None = None
        self.entry: Any = None
        self.hits = 0


def _workflow_reads_stale(monkeypatch: pytest.MonkeyPatch, js: Any, leader: str) -> _StaleReads:
    """Reads of ``KV_reach_workflows`` at its leader (``STREAM.INFO``, ``STREAM.MSG.GET``) on
    the JetStream context ``js``, while ``_StaleReads`` says so: ``deposed-leader`` answers
    ``entry`` (a ``KV.get`` answer) and a cluster whose leader heard from no replica for 7 s;
    ``no-meta-leader`` raises a 503 ("JetStream system temporarily unavailable"). ``leader``:
    as they are."""
    stale = _StaleReads()
    if leader == "leader":
        return stale
    stream = f"KV_{protocol.KV_WORKFLOWS}"
    real_info, real_get = js.stream_info, js.get_last_msg
    loop = asyncio.get_running_loop()

    def now_stale(name: str) -> bool:
        if name != stream or not stale.opened:
            return False
        if stale.until is None:
            stale.until = loop.time() + stale.STALE_FOR
        elif loop.time() >= stale.until:
            return False
        stale.hits += 1
        if leader == "no-meta-leader":
            raise ServiceUnavailableError(
                code=503, err_code=10008, description="JetStream system temporarily unavailable"
            )
        return True

    async def info(name: str, subjects_filter: str | None = None) -> StreamInfo:
        got: StreamInfo = await real_info(name, subjects_filter)
        if now_stale(name):
            unheard = [
                PeerInfo(name=n, current=False, offline=False, active=7_000_000_000, lag=40)
                for n in ("n0", "n2")
            ]
            got.cluster = ClusterInfo(leader="n1", name="chaos", replicas=unheard)
        return got

    async def last(name: str, subject: str, direct: bool | None = False) -> RawStreamMsg:
        if now_stale(name):
            e = stale.entry
            return RawStreamMsg(subject=subject, seq=e.revision, data=e.value, stream=name)
        got: RawStreamMsg = await real_get(name, subject, direct)
        return got

    monkeypatch.setattr(js, "stream_info", info)
    monkeypatch.setattr(js, "get_last_msg", last)
    return stale


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
        ns: str, workflow_id: str, end: float | None = None, *, quorate: bool = False
    ) -> tuple[bytes, int] | None:
        reads.append(workflow_id)
        return await record_now(ns, workflow_id, end, quorate=quorate)

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


async def _owned_by_a_gone_hub(
    mesh: Client,
    ns: str,
    wf_id: str,
    steps: list[Step],
    policy: str,
    agent_id: str,
    *,
    timeout: float = 30,
) -> Any:
    """Write the record of a fanout ``wf_id`` as a hub that is gone left it (owner
    ``hub-gone``, every step's attempt 1 on ``agent_id``, the workflow's ``timeout``); the
    caller's JetStream context."""
    spec = mesh._workflow_spec("fanout", steps, policy, timeout, wf_id)
    js = mesh.nc.jetstream()
    record = WorkflowRecord(
        spec=spec,
        spec_digest=spec_digest(spec),
        owner="hub-gone",
        submitted_at=time.time(),
        first_agents=[agent_id] * len(steps),
    )
    wfs = await js.key_value(protocol.KV_WORKFLOWS)
    await wfs.put(protocol.workflow_key(ns, wf_id), protocol.encode(record))
    return js


async def test_an_unneeded_branchs_status_reads_are_made_at_once(
    wf_hub: Hub, wf_settings: MeshSettings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A branch with three open attempts on three agents, stopped while ``REACH_STATUS``
    answers none of them in time (each read fails after its timeout): the reads run at once,
    so the stop waits one read's timeout, not one per agent; what one read finds is kept.
    (They were one after another: a stream without a leader held each stop up to four.)"""
    ns = wf_settings.namespace
    engine = wf_hub.workflows
    assert engine is not None
    tracker = engine._tracker
    agents = [f"{ns}.reads.a{n}" for n in range(3)]
    success = TaskStatusEvent(
        task_id="reads-1",
        attempt=1,
        agent_id=agents[0],
        state=TaskState.SUCCEEDED,
        workflow_id="reads",
        step=1,
        result="kept",
    )
    answering: set[str] = set()

    async def slow_reads(
        ns_: str, task_id: str, agent_id: str | None = None, *, patient: bool = False
    ) -> TaskStatusEvent | None:
        await asyncio.sleep(0.5)  # (the status read's timeout, shortened)
        if agent_id in answering:
            return success
        raise MeshUnavailableError("REACH_STATUS did not answer")

    monkeypatch.setattr(tracker, "last_status", slow_reads)
    spec = WorkflowSpec(
        workflow_id="reads",
        kind="fanout",
        steps=[StepSpec(capability="wf:reads:v1") for _ in range(2)],
        policy="any",
        namespace=ns,
    )
    wf = Workflow(
        spec=spec, need=1, deadline=0.0, submitted_at=0.0, headers={}, trace_id=None, digest=""
    )
    rec = TaskRecord(
        task_id="reads-1",
        workflow_id="reads",
        step=1,
        namespace=ns,
        attempt=3,
        agent_id=agents[2],
        history=[
            AttemptRecord(attempt=1, agent_id=agents[0], state=TaskState.RUNNING),
            AttemptRecord(attempt=2, agent_id=agents[1], state=TaskState.RUNNING),
            AttemptRecord(attempt=3, agent_id=agents[2]),
        ],
    )
    loop = asyncio.get_running_loop()
    t = loop.time()
    assert await engine._unheard_outcome(wf, 1, rec) is None
    took = loop.time() - t
    assert took < 0.9, f"the three reads took {took:.2f} s: one after another"

    answering.add(agents[0])  # attempt 1's agent stored its success; the other two fail
    unread: list[Exception] = []
    event, held = await engine._stored_outcome(wf, 1, rec, patient=False, held=False, unread=unread)
    assert event == success and not held and len(unread) == 2


async def test_a_step_decided_for_the_new_owner_and_fenced_since_by_the_old_records_its_outcome(
    wf_hub: Hub, fleet: Fleet, wf_settings: MeshSettings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An ``any`` fanout taken over from a hub that lost it without noticing. The new owner
    adopted step 1's attempt (its record written again, ``_fence_taken``); right after, the old
    owner — its policy decided on its own, its read of the workflow record unanswered and
    taken for "still ours" — fenced step 1 ``cancelled`` as unneeded, a compare-and-set on the
    revision the new owner had just written. Step 1's attempt had ended ``ok`` before that
    stop: its stored success decides the step for the new owner, by its current attempt (no
    record write), and the result keeps it — while the record said PENDING, ``cancelled``
    (the task view showed the step stopped: chaos secure seed 209, ``node_stop``,
    chaos-209-00780). A run that took the workflow over writes such a step's record with the
    outcome it keeps before it stores the result."""
    ns = wf_settings.namespace
    engine = wf_hub.workflows
    assert engine is not None
    wf_id = "kept-fenced"
    agent = echo_agent(fleet, "keptfence.a1", "wf:keptfence:v1")
    await agent.start()
    # Step 0 has no agent (its adopted attempt 1 is on one that is gone): only step 1 decides.
    steps = [
        Step(capability="wf:keptfence-none:v1", payload=0, timeout=10),
        Step(capability="wf:keptfence:v1", payload=1, timeout=10),
    ]
    branch = f"{wf_id}-1"
    key = protocol.task_key(ns, branch)
    fenced: list[int] = []
    fence_taken = engine._fence_taken

    async def stale_stop_after(wf: Workflow, k: str, rec: TaskRecord, rev: int) -> int:
        new = await fence_taken(wf, k, rec, rev)
        if k == key:  # the old owner's stop lands on the revision the new owner wrote
            stopped = rec.model_copy(deep=True)
            stopped.cancelled = True
            fenced.append(await tasks.update(k, protocol.encode(stopped), last=new))
        return new

    monkeypatch.setattr(engine, "_fence_taken", stale_stop_after)
    async with Client(settings=wf_settings) as mesh:
        spec = mesh._workflow_spec("fanout", steps, "any", 30, wf_id)
        js = mesh.nc.jetstream()
        record = WorkflowRecord(
            spec=spec,
            spec_digest=spec_digest(spec),
            owner="hub-lost",
            submitted_at=time.time(),
            first_agents=["keptfence.gone", agent.agent_id],
        )
        wfs = await js.key_value(protocol.KV_WORKFLOWS)
        await wfs.put(protocol.workflow_key(ns, wf_id), protocol.encode(record))
        tasks = await js.key_value(protocol.KV_TASKS)
        # Step 1's attempt 1 ended ok before the stop: its status is stored.
        status = TaskStatusEvent(
            task_id=branch,
            attempt=1,
            agent_id=agent.agent_id,
            state=TaskState.SUCCEEDED,
            workflow_id=wf_id,
            step=1,
            result="v1",
        )
        await js.publish(protocol.task_status(agent.agent_id, branch), protocol.encode(status))
        # The submission comes back to a hub (JetStream redelivers it).
        await mesh.submit_fanout(steps, policy="any", workflow_id=wf_id, timeout=30)
        res = await mesh.workflow(wf_id, timeout=15)
    assert fenced, "the stale stop did not land"
    assert res.state is TaskState.SUCCEEDED, res
    got = res.steps[1]
    assert got.ok and not got.cancelled and got.decided_by == 1, res.steps
    assert res.steps[0].cancelled, res.steps
    rec = await task_record(wf_hub.nc, ns, branch)
    assert rec is not None and rec.state is TaskState.SUCCEEDED and not rec.cancelled, rec
    assert rec.decided_by == 1 and rec.result == "v1", rec
