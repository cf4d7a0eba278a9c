"""Cancels across hubs, on a real nats-server: a hub that lost a fanout (or read its record late)
still stops the branches nobody needs, a takeover reads the workflow record from the leader, a
workflow cancelled before it started ends at once for every submission of it, and a cancel the
hub answers too late is asked again."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import nats
import pytest

from reach_mesh import Client, MeshSettings, Step, TaskState, protocol
from reach_mesh.hub import Hub
from reach_mesh.hub.workflows import WorkflowEngine
from reach_mesh.models import ErrorBody
from reach_mesh.workflow import WorkflowRecord, WorkflowResult

from .helpers import Fleet, Held, echo_agent, eventually, running, seed_owner

pytestmark = pytest.mark.timeout(60)

CANCELLED = "REACH_WORKFLOW_CANCELLED"


async def _slow_and_ok(hub: Hub, fleet: Fleet) -> tuple[Held, WorkflowEngine]:
    """A held ``wf:slow:v1`` agent and an echoing ``wf:ok:v1`` one, started; the hub's engine."""
    held = await Held(fleet).start()
    await echo_agent(fleet, "ok.a1", "wf:ok:v1").start()
    assert hub.workflows is not None
    return held, hub.workflows


async def test_a_hub_that_lost_a_fanout_leaves_its_unneeded_branch_to_the_new_owner(
    wf_hub: Hub, fleet: Fleet, wf_settings: MeshSettings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fanout with policy ``any``: one branch succeeds, and its owner stops the other as
    unneeded. Meanwhile another hub took the workflow over without this one noticing, and
    adopted that branch's attempt (its record written from ``first_agents``). The stale hub's
    write of the branch's record fails, and it does not tell the agent to stop: the handler
    the new owner waits on keeps running, instead of being stopped and run again."""
    ns = wf_settings.namespace
    held, engine = await _slow_and_ok(wf_hub, fleet)
    stop_step = engine._stop_step
    taken: list[int] = []  # the branch another hub took over

    async def taken_over_first(
        wf: Any, index: int, task_id: str, got: Any, *, settle: bool, **kw: Any
    ) -> None:
        if not settle and not taken:
            taken.append(index)
            js = wf_hub.nc.jetstream()
            # Another hub takes the workflow over (a CAS on this hub's revision) ...
            workflows = await js.key_value(protocol.KV_WORKFLOWS)
            key = protocol.workflow_key(ns, wf.id)
            entry = await workflows.get(key)
            assert entry.value is not None
            record = WorkflowRecord.model_validate_json(entry.value)
            record.owner = "hub-new"
            await workflows.update(key, protocol.encode(record), last=entry.revision)
            # ... and writes the record of the step it adopts from ``first_agents``.
            named = engine._named_attempt(wf, index, task_id)
            assert named is not None
            tasks = await js.key_value(protocol.KV_TASKS)
            await tasks.create(protocol.task_key(ns, task_id), protocol.encode(named))
        await stop_step(wf, index, task_id, got, settle=settle, **kw)

    monkeypatch.setattr(engine, "_stop_step", taken_over_first)
    async with Client(settings=wf_settings) as mesh:
        steps = [Step(capability="wf:slow:v1"), Step(capability="wf:ok:v1")]
        wf_id = await mesh.submit_fanout(steps, policy="any", timeout=30)
        await eventually(lambda: held.started == 1, timeout=10)
        await eventually(lambda: bool(taken), timeout=10)
        assert taken == [0]
        # This hub's run ends without a result: the workflow is the new owner's.
        await eventually(lambda: (ns, wf_id) not in engine.owned, timeout=10)
        await asyncio.sleep(0.5)  # a stop, had one been sent, reaches the agent by now
        assert not held.cancelled.is_set()
        workflows = await mesh.nc.jetstream().key_value(protocol.KV_WORKFLOWS)
        entry = await workflows.get(protocol.workflow_key(ns, wf_id))
        assert entry.value is not None
        record = WorkflowRecord.model_validate_json(entry.value)
        assert record.owner == "hub-new" and record.state is not TaskState.SUCCEEDED
        # "hub-new" renews nothing: the submission comes back to this hub, which takes the
        # workflow over and ends it, instead of leaving it running past this test for the
        # next tests' hubs, which serve every namespace.
        held.release.set()
        res = await mesh.workflow(wf_id, timeout=15)
        assert res.state is TaskState.SUCCEEDED, res


@pytest.mark.parametrize("leader_answers", [True, False])
async def test_an_owner_whose_read_lagged_still_stops_its_unneeded_branch(
    wf_hub: Hub,
    fleet: Fleet,
    wf_settings: MeshSettings,
    monkeypatch: pytest.MonkeyPatch,
    leader_answers: bool,
) -> None:
    """The other side of the test above: the owner's write of its unneeded branch's record
    fails because its own read came from a replica behind its own earlier write. The
    workflow record, read from the leader, still names this hub — or cannot be read (an
    election): either way the branch's agent is told to stop, as before."""
    ns = wf_settings.namespace
    held, engine = await _slow_and_ok(wf_hub, fleet)
    stop_step, at_leader = engine._stop_step, engine._workflow_at_leader
    lagged: list[int] = []
    leader_reads = 0

    async def lagging_read(
        wf: Any, index: int, task_id: str, got: Any, *, settle: bool, **kw: Any
    ) -> None:
        if not settle and not lagged:
            lagged.append(index)
            # This hub's own earlier write of the record, which the read did not see.
            named = engine._named_attempt(wf, index, task_id)
            assert named is not None
            tasks = await wf_hub.nc.jetstream().key_value(protocol.KV_TASKS)
            await tasks.create(protocol.task_key(ns, task_id), protocol.encode(named))
            got = None
        await stop_step(wf, index, task_id, got, settle=settle, **kw)

    async def leader(ns_: str, workflow_id: str, *, quorate: bool = False) -> Any:
        nonlocal leader_reads
        leader_reads += 1
        if not leader_answers:
            raise nats.errors.TimeoutError
        return await at_leader(ns_, workflow_id, quorate=quorate)

    monkeypatch.setattr(engine, "_stop_step", lagging_read)
    monkeypatch.setattr(engine, "_workflow_at_leader", leader)
    async with Client(settings=wf_settings) as mesh:
        steps = [Step(capability="wf:slow:v1"), Step(capability="wf:ok:v1")]
        wf_id = await mesh.submit_fanout(steps, policy="any", timeout=30)
        res = await mesh.workflow(wf_id, timeout=10)
        assert res.state is TaskState.SUCCEEDED and res.hub_id == wf_hub.hub_id
        assert lagged == [0] and leader_reads >= 1
        await asyncio.wait_for(held.cancelled.wait(), 5)
    assert held.finished == 0


_STEPS = [Step(capability="wf:ok:v1", payload={"i": 1})]


async def _left_by_a_gone_owner(mesh: Client, wf_id: str) -> tuple[Any, Any]:
    """A fanout's record as an owner that died left it, and the workflows bucket."""
    await seed_owner(mesh, "fanout", _STEPS, wf_id, "hub-gone", [None])
    workflows = await mesh.nc.jetstream().key_value(protocol.KV_WORKFLOWS)
    entry = await workflows.get(protocol.workflow_key(mesh.namespace, wf_id))
    assert entry.value is not None and entry.revision is not None
    return workflows, entry


async def _resubmitted_with(
    engine: WorkflowEngine, read: str, replica: Any, mesh: Client, wf_id: str, wait: float
) -> WorkflowResult:
    """The workflow submitted again while the hub's ``JsClient.<read>`` answers as a lagging
    ``replica``; its result within ``wait`` (less than its ack wait: taken at once)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(engine._jsc, read, replica)
        await mesh.submit_fanout(_STEPS, workflow_id=wf_id, timeout=30)
        return await mesh.workflow(wf_id, timeout=wait)


async def test_a_takeover_reads_the_workflow_record_from_the_leader(
    wf_hub: Hub, fleet: Fleet, wf_settings: MeshSettings, caplog: pytest.LogCaptureFixture
) -> None:
    """A hub takes over a workflow whose owner died; a replica behind the record's last write
    would answer a hedged read with an older revision, and a takeover CAS on it fails as if
    another hub had won (the workflow then waited out its ack wait, unowned). The takeover
    reads the leader: it takes the workflow at once, and the step runs."""
    caplog.set_level(logging.WARNING, logger="reach_mesh.hub.workflows")
    held, engine = await _slow_and_ok(wf_hub, fleet)
    wf_id = "taken-lagging"
    wf_key = protocol.workflow_key(wf_settings.namespace, wf_id)
    async with Client(settings=wf_settings) as mesh:
        workflows, first = await _left_by_a_gone_owner(mesh, wf_id)
        await workflows.put(wf_key, first.value)  # the owner's last write: a newer revision
        kv_get = engine._jsc.kv_get
        written_before = first.value, first.revision

        async def lagging_replica(bucket: str, key: str) -> tuple[bytes, int] | None:
            if key == wf_key:
                return written_before  # the write before the last
            return await kv_get(bucket, key)

        wait = wf_settings.workflow_ack_wait * 0.8
        res = await _resubmitted_with(engine, "kv_get", lagging_replica, mesh, wf_id, wait)
    assert res.state is TaskState.SUCCEEDED and res.hub_id == wf_hub.hub_id, res
    assert engine.takeover_total >= 1
    assert "was taken over by another hub" not in caplog.text
    assert held.started == 0


async def test_a_record_deleted_by_hand_is_written_over_at_the_leaders_revision(
    wf_hub: Hub, fleet: Fleet, wf_settings: MeshSettings, caplog: pytest.LogCaptureFixture
) -> None:
    """A running workflow's record deleted by hand leaves a delete marker, and the hub that
    takes the submission writes over it at the marker's revision. A replica behind the delete
    still holds the record: read there, the create failed as if another hub owned it, and the
    workflow waited out its ack wait unowned. The revision is read from the stream's leader,
    which decides the compare-and-set: the hub takes the workflow at once, and it runs."""
    caplog.set_level(logging.WARNING, logger="reach_mesh.hub.workflows")
    held, engine = await _slow_and_ok(wf_hub, fleet)
    wf_id = "deleted-lagging"
    wf_key = protocol.workflow_key(wf_settings.namespace, wf_id)
    async with Client(settings=wf_settings) as mesh:
        workflows, before = await _left_by_a_gone_owner(mesh, wf_id)
        await workflows.delete(wf_key)
        kv_entry = engine._jsc.kv_entry
        lagged: list[str] = []
        record = before.value, before.revision

        async def behind_the_delete(bucket: str, key: str) -> tuple[bytes, int, bool] | None:
            if key == wf_key:
                lagged.append(key)
                return *record, False  # the record, not its marker
            return await kv_entry(bucket, key)

        wait = wf_settings.workflow_ack_wait * 0.8
        res = await _resubmitted_with(engine, "kv_entry", behind_the_delete, mesh, wf_id, wait)
    assert res.state is TaskState.SUCCEEDED and res.hub_id == wf_hub.hub_id, res
    assert lagged == []  # the marker's revision came from the leader, not a replica
    assert "was taken over by another hub" not in caplog.text
    assert held.started == 0


@pytest.mark.parametrize("read", ["at once", "after the result"])
async def test_two_submissions_of_a_workflow_cancelled_before_it_started_both_end_at_once(
    wf_settings: MeshSettings, monkeypatch: pytest.MonkeyPatch, read: str
) -> None:
    """Each submission is stored (its ``Nats-Msg-Id`` has a nonce of its own), so a workflow
    cancelled before any hub took it may have two messages: both runs write over the record
    that holds only the cancel, and one wins. The other ends at once, not left to come back
    after its ack wait (5 s here) to learn what it could read now — also when the winner has
    stored its result by the time the loser reads the record (``after the result``)."""
    ns = wf_settings.namespace
    s = wf_settings.model_copy(update={"workflow_ack_wait": 5.0})
    if read == "after the result":
        won_by_another = WorkflowEngine._won_by_another

        async def late(self: WorkflowEngine, wf: Any) -> Any:
            await asyncio.sleep(0.5)  # the winner, with no step to run, ends meanwhile
            return await won_by_another(self, wf)

        monkeypatch.setattr(WorkflowEngine, "_won_by_another", late)
    async with Hub(settings=s):
        pass  # the streams and buckets
    async with Client(settings=s) as mesh:
        steps = [Step(capability="wf:none:v1", payload=1)]
        for _ in range(2):
            await mesh.submit_fanout(steps, workflow_id="twice-unstarted", timeout=20)
        js = mesh.nc.jetstream()

        async def stored() -> int:
            """This namespace's submissions in the stream (other tests' may be there too)."""
            subject = protocol.wf_submit(ns)
            info = await js.stream_info(protocol.STREAM_WF, subjects_filter=subject)
            return (info.state.subjects or {}).get(subject, 0)

        assert await stored() == 2
        # What a cancel made before any hub started it leaves (``before_start``).
        kv = await js.key_value(protocol.KV_WORKFLOWS)
        unstarted = WorkflowRecord(
            state=TaskState.PENDING, cancel=ErrorBody(code=CANCELLED, message="before start")
        )
        await kv.create(protocol.workflow_key(ns, "twice-unstarted"), protocol.encode(unstarted))
        async with Hub(settings=s):
            res = await mesh.workflow("twice-unstarted", timeout=10)
            assert res.error is not None and res.error.code == CANCELLED

            async def both_gone() -> bool:
                return await stored() == 0

            await eventually(both_gone, timeout=3.0, interval=0.05)


async def test_a_cancel_the_hub_answers_too_late_is_asked_again(
    wf_hub: Hub, fleet: Fleet, wf_settings: MeshSettings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A hub that answers a cancel after the client stopped waiting (overloaded: a CI box's
    two cores) is asked again — a cancel is idempotent and its asks share one cancel_id —
    instead of the caller getting MeshTimeoutError for a cancel that went through."""
    held = await Held(fleet).start()
    engine = wf_hub.workflows
    assert engine is not None
    cancel = engine.cancel
    asks = 0

    async def slow_first(*args: Any, **kwargs: Any) -> Any:
        nonlocal asks
        asks += 1
        answer = await cancel(*args, **kwargs)
        if asks == 1:
            await asyncio.sleep(kwargs["within"] + 1.5)  # past the client's wait for it
        return answer

    monkeypatch.setattr(engine, "cancel", slow_first)
    async with Client(settings=wf_settings) as mesh:
        wf_id = await mesh.submit_fanout([Step(capability="wf:slow:v1")], timeout=30)
        await running(mesh, wf_id)
        answer = await mesh.cancel_workflow(wf_id, reason="late answer", timeout=15)
    assert asks >= 2 and answer.final and answer.cancelled, answer
    assert held.cancelled.is_set()
