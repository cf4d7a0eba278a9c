"""A step remembers only its newest ``ATTEMPTS_KEPT`` (32) sent attempts, on a real nats-server:
in its task record's ``history`` (``reach_tasks``, and the workflow view read from it) and in
the owning hub's ``StepTrack.sent``. Before the bound, a step re-sent without end (a silent
agent under a long ``ttl``) grew both without end.

Two ways a step is sent again and again: a handler that fails each attempt (retried up to
``retries``), and an agent that never takes the step (its one slot held: each attempt is
given up as undelivered after ``deliver_timeout`` and sent again until the step's ``ttl``).
Both pass 32 attempts; the step goes on past the bound and ends as it would have.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from reach_mesh import Client, MeshSettings, RetryPolicy, Step, TaskState, protocol
from reach_mesh.agent import Task, TaskFailed
from reach_mesh.hub import Hub
from reach_mesh.hub._step_track import ATTEMPTS_KEPT, StepTrack
from reach_mesh.hub.workflows import WorkflowEngine
from reach_mesh.workflow import TaskRecord, step_task_id

from .helpers import Fleet, eventually, held_handler, task_record

pytestmark = pytest.mark.timeout(60)

#: The fastest re-sends a step may ask for (the floors: ``BACKOFF_MIN``, ``INTERVAL_MIN``).
FAST = RetryPolicy(backoff_base=0.01, backoff_cap=0.01, fast_attempts=100)


def _engine(hub: Hub) -> WorkflowEngine:
    engine = hub.workflows
    assert engine is not None
    return engine


def _track(hub: Hub, ns: str, task_id: str) -> StepTrack:
    track = _engine(hub)._tracker.track(protocol.task_key(ns, task_id))
    assert track is not None, "the hub runs no such step"
    return track


async def _record(mesh: Client, ns: str, task_id: str) -> TaskRecord:
    rec = await task_record(mesh.nc, ns, task_id)
    assert rec is not None, "the step has no task record"
    return rec


def test_the_bound_is_32() -> None:
    """The tests below count on it: 32 attempts kept, more than 32 sent."""
    assert ATTEMPTS_KEPT == 32


async def test_a_step_failed_past_32_attempts_keeps_its_newest_32(
    wf_hub: Hub, fleet: Fleet, wf_settings: MeshSettings
) -> None:
    """A handler that fails every attempt, retried 44 times: attempt 40 is held while the
    test looks — the record, the view and the hub's track hold attempts 9..40 — then the
    step goes on to its 45th attempt and fails as retries allow, its record holding 14..45."""
    ns = wf_settings.namespace
    hold_at, retries = 40, 44
    ran: list[int] = []
    held = asyncio.Event()
    release = asyncio.Event()
    agent = fleet.agent("kept.fail")

    @agent.handler("wf:kept-fail:v1")
    async def fail(task: Task[Any]) -> None:
        ran.append(task.attempt)
        if task.attempt == hold_at:
            held.set()
            await release.wait()
        raise TaskFailed(f"attempt {task.attempt} failed")

    await agent.start()
    step = Step(capability="wf:kept-fail:v1", retries=retries, retry=FAST)
    async with Client(settings=wf_settings) as mesh:
        wf = await mesh.submit_fanout([step], timeout=40)
        await asyncio.wait_for(held.wait(), timeout=30)
        task_id = (await mesh.inspect_workflow(wf)).steps[0].task_id
        newest = list(range(hold_at - ATTEMPTS_KEPT + 1, hold_at + 1))  # 9..40

        rec = await _record(mesh, ns, task_id)
        assert rec.attempt == hold_at and rec.agent_id == agent.agent_id
        assert [h.attempt for h in rec.history] == newest
        assert {h.agent_id for h in rec.history} == {agent.agent_id}
        # The attempts before the current one failed, and the record says so.
        assert [h.state for h in rec.history[:-1]] == [TaskState.FAILED] * (ATTEMPTS_KEPT - 1)
        assert rec.handler_failures == hold_at - 1

        view = await mesh.inspect_workflow(wf)
        assert view.state is TaskState.RUNNING and view.live
        assert view.steps[0].attempt == hold_at
        assert [h.attempt for h in view.steps[0].history] == newest

        track = _track(wf_hub, ns, task_id)
        assert track.attempt == hold_at
        assert sorted(track.sent) == newest
        assert set(track.sent.values()) == {agent.agent_id}

        release.set()
        res = await mesh.workflow(wf, timeout=30)
    assert res.state is TaskState.FAILED, res
    (only,) = res.steps
    assert (only.attempts, only.decided_by) == (retries + 1, retries + 1)
    assert only.error is not None and only.error.code == "REACH_HANDLER_FAILED"
    assert "attempt 45 failed" in only.error.message
    assert ran == list(range(1, retries + 2))  # every attempt ran once, none was lost
    async with Client(settings=wf_settings) as mesh:
        last = list(range(retries + 2 - ATTEMPTS_KEPT, retries + 2))  # 14..45
        rec = await _record(mesh, ns, task_id)
        assert [h.attempt for h in rec.history] == last
        view = await mesh.inspect_workflow(wf)
        assert view.state is TaskState.FAILED
        assert [h.attempt for h in view.steps[0].history] == last
        assert [h.state for h in view.steps[0].history] == [TaskState.FAILED] * ATTEMPTS_KEPT
    assert _engine(wf_hub)._tracker.track(protocol.task_key(ns, task_id)) is None


async def test_a_step_its_agent_never_takes_keeps_its_newest_32_attempts(
    wf_hub: Hub, fleet: Fleet, wf_settings: MeshSettings
) -> None:
    """The one agent with the capability has its one slot held by another workflow's step:
    it takes nothing, and answers (when asked) that it does not have the step. Each attempt
    is given up as undelivered after ``deliver_timeout`` and sent again, to the same agent,
    until the step's long ``ttl``. Past 32 attempts the record and the track hold the newest
    32 only; once the slot is free the step is taken and succeeds."""
    ns = wf_settings.namespace
    runs: list[tuple[str, int]] = []
    agent = fleet.agent("kept.busy", max_concurrency=1, max_queue=0)
    blocking = held_handler(agent, "wf:kept-block:v1", "unblocked")

    @agent.handler("wf:kept-late:v1")
    async def late(task: Task[Any]) -> str:
        runs.append((task.task_id, task.attempt))
        return f"ran attempt {task.attempt}"

    await agent.start()
    async with Client(settings=wf_settings) as mesh:
        blocker = await mesh.submit_fanout([Step(capability="wf:kept-block:v1")], timeout=60)
        await eventually(lambda: agent._running == 1, timeout=10)
        policy = FAST.model_copy(update={"deliver_timeout": 0.1, "ttl": 3600.0})
        late_step = Step(capability="wf:kept-late:v1", retry=policy)
        wf = await mesh.submit_fanout([late_step])
        task_id = step_task_id(wf, 0, late_step.spec())  # no hub may have taken it yet
        past = ATTEMPTS_KEPT + 4

        async def sent_past_the_bound() -> bool:
            rec = await task_record(mesh.nc, ns, task_id)
            return rec is not None and rec.attempt > past and rec.agent_id is not None

        await eventually(sent_past_the_bound, timeout=40, interval=0.05)
        track = _track(wf_hub, ns, task_id)
        rec = await _record(mesh, ns, task_id)
        # The newest attempt sent is the current one, or the one before when the record
        # was read between giving it up and sending the next (the fence: no agent yet).
        newest = rec.history[-1].attempt
        assert newest == rec.attempt if rec.agent_id is not None else newest == rec.attempt - 1
        assert [h.attempt for h in rec.history] == list(
            range(newest - ATTEMPTS_KEPT + 1, newest + 1)
        )
        assert {h.agent_id for h in rec.history} == {agent.agent_id}
        # Each attempt before the newest was given up: not taken (or its agent thought lost
        # for a moment, on a loaded machine).
        assert {h.code for h in rec.history[:-1]} <= {"undelivered", "lost"}
        # The hub's track: the newest 32 attempts (it may be a send ahead of the record read).
        sent = sorted(track.sent)
        assert len(sent) == ATTEMPTS_KEPT
        assert sent == list(range(sent[-1] - ATTEMPTS_KEPT + 1, sent[-1] + 1))
        assert sent[-1] >= newest
        assert set(track.sent.values()) == {agent.agent_id}
        view = await mesh.inspect_workflow(wf)
        assert view.state is TaskState.RUNNING and len(view.steps[0].history) == ATTEMPTS_KEPT
        assert runs == []

        blocking.release.set()
        assert (await mesh.workflow(blocker, timeout=20)).ok
        res = await mesh.workflow(wf, timeout=30)
        assert res.state is TaskState.SUCCEEDED, res
        (only,) = res.steps
        assert only.decided_by is not None and only.decided_by > past
        assert only.result == f"ran attempt {only.decided_by}"
        assert (task_id, only.decided_by) in runs
        rec = await _record(mesh, ns, task_id)
        assert len(rec.history) <= ATTEMPTS_KEPT
        assert only.decided_by in [h.attempt for h in rec.history]
    assert _engine(wf_hub)._tracker.track(protocol.task_key(ns, task_id)) is None
