"""``reach.hub.<ns>.cancel``: a caller or operator stops a running workflow
(``Client.cancel_workflow``, ``reach-mesh cancel <id>``, ``POST /api/workflows/{id}/cancel``),
on a real nats-server."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import subprocess
import sys
import time
from collections.abc import Awaitable
from typing import Any

import nats
import pytest
from nats.aio.msg import Msg
from nats.js.errors import KeyNotFoundError

from reach_mesh import (
    BadRequestError,
    CancelResult,
    Client,
    MeshSettings,
    MeshUnavailableError,
    RetryPolicy,
    Step,
    TaskState,
    UnknownWorkflowError,
    protocol,
)
from reach_mesh._nats import flushed
from reach_mesh.agent import Task, TaskFailed
from reach_mesh.hub import Hub
from reach_mesh.models import AgentState, ErrorBody, TaskEnvelope
from reach_mesh.workflow import (
    TaskRecord,
    TaskStatusEvent,
    WorkflowRecord,
    WorkflowResult,
)

from .helpers import (
    Fleet,
    Held,
    cancelled_step,
    echo_agent,
    eventually,
    fetch,
    running,
    seed_owner,
    task_record,
)

pytestmark = pytest.mark.timeout(60)

CANCELLED = "REACH_WORKFLOW_CANCELLED"


async def test_a_running_fanout_stops_and_keeps_what_finished(
    wf_hub: Hub, fleet: Fleet, wf_settings: MeshSettings
) -> None:
    """The unfinished branch is cancelled (its handler is stopped), the finished one keeps its
    result, and the one final result — the cancel's answer, ``.done`` and the record — is
    FAILED with REACH_CANCELLED and the reason. Asking again changes nothing."""
    held = await Held(fleet).start()
    ok = echo_agent(fleet, "ok.a1", "wf:ok:v1")
    await ok.start()
    async with Client(settings=wf_settings) as mesh:
        steps = [Step(capability="wf:slow:v1"), Step(capability="wf:ok:v1", payload={"n": 1})]
        wf_id = await mesh.submit_fanout(steps, timeout=30)
        await running(mesh, wf_id)
        await running(mesh, wf_id, step=1, state=TaskState.SUCCEEDED)
        await eventually(lambda: held.started == 1, timeout=5)
        answer = await mesh.cancel_workflow(wf_id, reason="operator drill")
        assert answer.final and answer.cancelled, answer
        assert answer.state is TaskState.FAILED and answer.owner == wf_hub.hub_id
        result = answer.result
        assert result is not None and result.error is not None
        assert result.error.code == CANCELLED and "operator drill" in result.error.message
        slow, fast = result.steps
        assert slow.cancelled and slow.state is not TaskState.SUCCEEDED, slow
        echoed = {"by": ok.agent_id, "in": {"n": 1}}
        assert fast.state is TaskState.SUCCEEDED and fast.result == echoed, fast
        assert result.result == [None, echoed]
        # The agent was told: its handler stopped without finishing.
        await asyncio.wait_for(held.cancelled.wait(), 5)
        assert held.finished == 0
        # One final result, wherever it is read.
        assert await mesh.workflow(wf_id, timeout=5) == result
        view = await mesh.inspect_workflow(wf_id)
        assert view.state is TaskState.FAILED and view.error == result.error
        assert view.steps[0].cancelled
        # Idempotent: a second cancel says the same, and nothing runs again.
        again = await mesh.cancel_workflow(wf_id)
        assert again.final and again.cancelled and again.result == result
        held.release.set()
        await asyncio.sleep(0.3)
        assert held.started == 1 and held.finished == 0
        assert wf_hub.workflows is not None
        assert (wf_settings.namespace, wf_id) not in wf_hub.workflows.owned  # it has ended
        assert wf_hub.workflows.cancelled_total == 1
        cancelled = wf_hub.metrics.workflow_cancelled_total.labels(wf_settings.namespace)
        assert cancelled._value.get() == 1
        # The operator's action is in the audit (both asks).
        await wf_hub.audit.flush()

        async def audited() -> bool:
            events = await mesh.audit(namespace=wf_settings.namespace, since=60)
            cancels = [e for e in events if e.get("kind") == "cancel"]
            return [(e["workflow_id"], e.get("reason"), e["cancelled"]) for e in cancels] == [
                (wf_id, "operator drill", True),
                (wf_id, None, True),
            ]

        await eventually(audited, timeout=5)


async def test_a_chain_stops_at_its_running_step(
    wf_hub: Hub, fleet: Fleet, wf_settings: MeshSettings
) -> None:
    """The step running is cancelled, the steps after it never start."""
    held = await Held(fleet).start()
    ok = echo_agent(fleet, "ok.a1", "wf:ok:v1")
    await ok.start()
    async with Client(settings=wf_settings) as mesh:
        steps = [
            Step(capability="wf:ok:v1", payload={"a": 1}),
            Step(capability="wf:slow:v1"),
            Step(capability="wf:ok:v1"),
        ]
        wf_id = await mesh.submit_chain(steps, timeout=30)
        await running(mesh, wf_id, step=1)
        await eventually(lambda: held.started == 1, timeout=5)
        answer = await mesh.cancel_workflow(wf_id)
        assert answer.final and answer.cancelled and answer.state is TaskState.FAILED, answer
        result = answer.result
        assert result is not None and result.error is not None
        assert result.error.code == CANCELLED and result.result is None
        first, second, third = result.steps
        assert first.state is TaskState.SUCCEEDED and first.result["in"] == {"a": 1}
        assert second.cancelled and second.agent_id == held.agent.agent_id, second
        assert third.cancelled and third.state is TaskState.PENDING and third.attempts == 0
        await asyncio.wait_for(held.cancelled.wait(), 5)
        assert await mesh.workflow(wf_id, timeout=5) == result


async def test_a_workflow_cancelled_as_soon_as_it_is_submitted(
    wf_hub: Hub, fleet: Fleet, wf_settings: MeshSettings
) -> None:
    """Cancelled before its hub has sent anything, or while it does: nothing runs to the end,
    and there is one final result."""
    held = await Held(fleet).start()
    async with Client(settings=wf_settings) as mesh:
        ids = [
            await mesh.submit_fanout([Step(capability="wf:slow:v1")] * 2, timeout=30)
            for _ in range(3)
        ]
        answers = await asyncio.gather(*(mesh.cancel_workflow(i) for i in ids))
        for wf_id, answer in zip(ids, answers, strict=True):
            assert answer.final and answer.cancelled, answer
            assert answer.result is not None
            assert all(s.cancelled for s in answer.result.steps), answer.result.steps
            assert await mesh.workflow(wf_id, timeout=5) == answer.result
        held.release.set()
        await asyncio.sleep(0.3)
    assert held.finished == 0


async def assert_fenced(tasks: Any, ns: str, wf_id: str, indexes: tuple[int, ...]) -> None:
    """Steps ``indexes`` of ``wf_id`` have cancelled task records, and what a stale hub does
    to start one — create its record — fails."""
    for index in indexes:
        key = protocol.task_key(ns, f"{wf_id}-{index}")
        entry = await tasks.get(key)
        assert entry.value is not None
        assert json.loads(entry.value)["cancelled"] is True, entry.value
        with pytest.raises(nats.js.errors.KeyWrongLastSequenceError):
            await tasks.create(key, b"{}")


@pytest.mark.parametrize("kind", ["fanout", "chain"])
async def test_a_hub_taking_over_finishes_the_cancel_its_owner_took(
    kind: str, wf_hub: Hub, fleet: Fleet, wf_settings: MeshSettings
) -> None:
    """The owner writes a cancel into the workflow record before it stops any step; a hub
    that takes the workflow over (the owner died between) finishes the cancel. The step that
    had finished keeps its result — though, decided by its first attempt, it has no final
    task record: only its agent's final status in the stream says so — nothing else runs,
    and the result is the cancel's."""
    held = await Held(fleet).start()
    agent_id = held.agent.agent_id
    wf_id = f"taken-{kind}"
    steps = [Step(capability="wf:slow:v1", payload={"i": i}) for i in range(2)]
    async with Client(settings=wf_settings) as mesh:
        cancel = ErrorBody(code=CANCELLED, message="cancelled on request: before the crash")
        # Step 0's attempt 1 went out at the start.
        await seed_owner(mesh, kind, steps, wf_id, "hub-gone", [agent_id, None], cancel)
        js = mesh.nc.jetstream()
        # Step 0 finished on its agent: its final status is stored, no task record written.
        status = TaskStatusEvent(
            task_id=f"{wf_id}-0",
            attempt=1,
            agent_id=agent_id,
            state=TaskState.SUCCEEDED,
            workflow_id=wf_id,
            step=0,
            result={"kept": 1},
        )
        await js.publish(protocol.task_status(agent_id, status.task_id), protocol.encode(status))
        # The submission comes back to a hub (as JetStream redelivers it after the owner died).
        submit = mesh.submit_fanout if kind == "fanout" else mesh.submit_chain
        await submit(steps, workflow_id=wf_id, timeout=30)
        res = await mesh.workflow(wf_id, timeout=10)
        assert res.state is TaskState.FAILED and res.error == cancel, res
        first, second = res.steps
        assert first.state is TaskState.SUCCEEDED and first.result == {"kept": 1}, first
        assert not first.cancelled and first.decided_by == 1, first
        assert second.cancelled and not second.state.final, second
        answer = await mesh.cancel_workflow(wf_id)
        assert answer.final and answer.cancelled and answer.result == res
    await asyncio.sleep(0.2)
    assert held.started == 0


async def test_a_step_fenced_before_a_takeover_keeps_the_time_it_was_fenced(
    wf_hub: Hub, wf_settings: MeshSettings
) -> None:
    """A hub finishing a cancel its owner took writes the fence of a step the owner had
    cancelled again, as it was: the record's ``updated_at`` stays the time the step was
    cancelled (when the cancel decided it), not that of the rewrite. The chaos checker
    reads it so: secure seed 156 cancelled a step while a partition still cut its agent off,
    and the hubs that finished the cancel after two more takeovers wrote that time over."""
    wf_id = "fenced-before"
    steps = [Step(capability="wf:slow:v1", payload={"i": i}) for i in range(2)]
    async with Client(settings=wf_settings) as mesh:
        ns, agent_id = mesh.namespace, f"{mesh.namespace}.gone.a1"
        cancel = ErrorBody(code=CANCELLED, message="cancelled on request: before the crash")
        await seed_owner(mesh, "fanout", steps, wf_id, "hub-gone", [agent_id, None], cancel)
        fenced_at = time.time() - 5.0
        fenced = cancelled_step(
            ns, wf_id, 0, agent_id, created_at=fenced_at - 1.0, updated_at=fenced_at
        )
        tasks = await mesh.nc.jetstream().key_value(protocol.KV_TASKS)
        await tasks.create(protocol.task_key(ns, fenced.task_id), protocol.encode(fenced))
        await mesh.submit_fanout(steps, workflow_id=wf_id, timeout=30)
        res = await mesh.workflow(wf_id, timeout=10)
        assert res.state is TaskState.FAILED and res.error == cancel, res
        assert all(step.cancelled for step in res.steps), res.steps
        first = await task_record(mesh.nc, ns, fenced.task_id)
        assert first is not None and first.cancelled and first.updated_at == fenced_at, first
        second = await task_record(mesh.nc, ns, f"{wf_id}-1")  # fenced by this hub: now
        assert second is not None and second.cancelled and second.updated_at > fenced_at + 4


async def test_a_chain_taken_over_and_cancelled_fences_the_steps_it_never_started(
    wf_hub: Hub, fleet: Fleet, wf_settings: MeshSettings
) -> None:
    """A hub that took a chain over and is cancelled at a step fences the steps after it too
    (cancelled task records) before it stores the result: the hub it took the chain from may
    still be running it, unaware, and would otherwise start the next step after the cancel's
    answer (its create of that step's record now fails; it finds the step cancelled). Seen in
    ``make chaos`` (node kills) before the fix."""
    ns = wf_settings.namespace
    held = await Held(fleet).start()
    agent_id = held.agent.agent_id
    wf_id = "taken-chain-stale"
    steps = [Step(capability="wf:slow:v1", payload={"i": i}) for i in range(3)]
    async with Client(settings=wf_settings) as mesh:
        # Alive, and about to lose the chain without noticing; step 0's attempt 1 sent.
        await seed_owner(mesh, "chain", steps, wf_id, "hub-stale", [agent_id, None, None])
        tasks = await mesh.nc.jetstream().key_value(protocol.KV_TASKS)
        await mesh.submit_chain(steps, workflow_id=wf_id, timeout=30)  # this hub takes it
        engine = wf_hub.workflows
        assert engine is not None
        await eventually(lambda: engine.takeover_total >= 1, timeout=10)
        answer = await mesh.cancel_workflow(wf_id)
        assert answer.final and answer.cancelled and answer.result is not None, answer
        assert [s.cancelled for s in answer.result.steps] == [True, True, True]
        await assert_fenced(tasks, ns, wf_id, (1, 2))
    assert held.finished == 0


async def test_a_chain_taken_over_that_fails_at_a_step_fences_the_steps_after_it(
    wf_hub: Hub, fleet: Fleet, wf_settings: MeshSettings
) -> None:
    """The same fence when a taken-over chain ends at a failed step: the hub it was taken from
    may have seen another outcome of that step first (an attempt it gave up on, still
    running) and would go on to the next step after this result is stored."""
    ns = wf_settings.namespace
    held = await Held(fleet).start()
    agent_id = held.agent.agent_id
    wf_id = "taken-chain-failed"
    steps = [Step(capability="wf:slow:v1", payload={"i": i}) for i in range(3)]
    async with Client(settings=wf_settings) as mesh:
        await seed_owner(mesh, "chain", steps, wf_id, "hub-stale", [agent_id, None, None])
        js = mesh.nc.jetstream()
        tasks = await js.key_value(protocol.KV_TASKS)
        # Step 0 failed on its agent, not to be retried: its final status is stored.
        failed = TaskStatusEvent(
            task_id=f"{wf_id}-0",
            attempt=1,
            agent_id=agent_id,
            state=TaskState.FAILED,
            workflow_id=wf_id,
            step=0,
            error=ErrorBody(
                code="REACH_HANDLER_FAILED", message="no", details={"retryable": False}
            ),
        )
        await js.publish(protocol.task_status(agent_id, failed.task_id), protocol.encode(failed))
        await mesh.submit_chain(steps, workflow_id=wf_id, timeout=30)
        res = await mesh.workflow(wf_id, timeout=10)
        assert res.state is TaskState.FAILED and res.error is not None, res
        assert res.error.code == "REACH_HANDLER_FAILED" and res.steps[0].state is TaskState.FAILED
        await assert_fenced(tasks, ns, wf_id, (1, 2))
    assert held.started == 0


async def test_a_workflow_an_agent_shutdown_ended_was_not_cancelled(
    wf_hub: Hub, wf_settings: MeshSettings
) -> None:
    """REACH_CANCELLED (an agent shut down mid-task) is not a cancel's code."""
    ns = wf_settings.namespace
    result = WorkflowResult(
        workflow_id="shut",
        kind="fanout",
        state=TaskState.FAILED,
        error=ErrorBody(code="REACH_CANCELLED", message="agent shut down"),
    )
    record = WorkflowRecord(state=TaskState.FAILED, owner="hub-x", result=result)
    async with Client(settings=wf_settings) as mesh:
        kv = await mesh.nc.jetstream().key_value(protocol.KV_WORKFLOWS)
        await kv.put(protocol.workflow_key(ns, "shut"), protocol.encode(record))
        answer = await mesh.cancel_workflow("shut")
    assert answer.final and answer.cancelled is False and answer.state is TaskState.FAILED


@pytest.mark.parametrize("kind", ["fanout", "chain"])
async def test_a_failure_the_hub_retried_does_not_become_the_outcome(
    kind: str, wf_hub: Hub, fleet: Fleet, wf_settings: MeshSettings
) -> None:
    """Attempt 1 failed (retryably) and attempt 2 runs when the cancel comes: the stored
    failure of attempt 1 decided nothing, so the step is cancelled, not FAILED."""
    release = asyncio.Event()
    # Two agents: the retry goes to the other one, so the first one's newest stored status
    # is attempt 1's FAILED.
    for name in ("flaky.a1", "flaky.a2"):
        flaky = fleet.agent(name)

        @flaky.handler("wf:flaky:v1")
        async def once(task: Task[Any]) -> str:
            if task.attempt == 1:
                raise TaskFailed("flake", retryable=True)
            await release.wait()
            return "late"

        await flaky.start()
    async with Client(settings=wf_settings) as mesh:
        steps = [Step(capability="wf:flaky:v1", retry=RetryPolicy(retries=2))]
        submit = mesh.submit_fanout if kind == "fanout" else mesh.submit_chain
        wf_id = await submit(steps, timeout=30)

        async def second_attempt_runs() -> bool:
            try:
                view = await mesh.inspect_workflow(wf_id)
            except UnknownWorkflowError:
                return False  # not taken yet
            return view.steps[0].attempt == 2 and view.steps[0].state is TaskState.RUNNING

        await eventually(second_attempt_runs, timeout=10)
        answer = await mesh.cancel_workflow(wf_id)
        release.set()
    assert answer.final and answer.cancelled, answer
    assert answer.result is not None and answer.result.error is not None
    assert answer.result.error.code == CANCELLED
    assert answer.result.steps[0].cancelled, answer.result.steps


async def test_a_finished_workflow_is_not_cancelled(
    wf_hub: Hub, fleet: Fleet, wf_settings: MeshSettings
) -> None:
    ok = echo_agent(fleet, "ok.a1", "wf:ok:v1")
    await ok.start()
    async with Client(settings=wf_settings) as mesh:
        res = await mesh.fanout([Step(capability="wf:ok:v1", payload=1)], timeout=10)
        assert res.ok
        answer = await mesh.cancel_workflow(res.workflow_id)
    assert answer.final and not answer.cancelled, answer
    assert answer.state is TaskState.SUCCEEDED and answer.result == res


async def test_a_cancel_asked_of_another_hub_goes_to_the_owner(
    wf_hub: Hub, fleet: Fleet, wf_settings: MeshSettings
) -> None:
    """Any hub takes a cancel: the owner is asked on its own subject. An owner that does not
    answer cancels nothing, and the caller is told so (MeshUnavailableError), not fooled."""
    held = await Held(fleet).start()
    other = Hub(settings=wf_settings)
    async with Client(settings=wf_settings) as mesh:
        first = await mesh.submit_fanout([Step(capability="wf:slow:v1")], timeout=30)
        second = await mesh.submit_fanout([Step(capability="wf:slow:v1")], timeout=30)
        await running(mesh, first)
        await running(mesh, second)
        await other.start()  # after them: both run on wf_hub
        try:
            assert (await mesh.inspect_workflow(second)).owner == wf_hub.hub_id
            # Cancels go to the other hub only: the owner leaves the queue group.
            verb = protocol.hub_subject("*", "cancel")
            (sub,) = [sub for sub in wf_hub._subs if sub.subject == verb]
            await sub.unsubscribe()
            # The server has the unsubscribe: no cancel goes to the owner after (nc.flush()
            # alone sends its PING ahead of the UNSUB; a cancel the server still gave the
            # owner's subscription would be dropped there unanswered, the client's first ask
            # waited out).
            await flushed(wf_hub.nc)
            answer = await mesh.cancel_workflow(first, reason="via another hub")
            assert answer.final and answer.cancelled and answer.owner == wf_hub.hub_id, answer
            assert answer.result is not None and answer.result.hub_id == wf_hub.hub_id
            assert answer.result.error is not None
            assert "via another hub" in answer.result.error.message
            # The owner stops answering its peers: nothing is cancelled, and the caller knows.
            peer = protocol.hub_peer("*", "cancel", wf_hub.hub_id)
            (sub,) = [sub for sub in wf_hub._subs if sub.subject == peer]
            await sub.unsubscribe()
            await flushed(wf_hub.nc)
            with pytest.raises(MeshUnavailableError, match="nothing was cancelled"):
                await mesh.cancel_workflow(second, timeout=1.0)
            assert (await mesh.inspect_workflow(second)).state is TaskState.RUNNING
            held.release.set()
            assert (await mesh.workflow(second, timeout=10)).ok
        finally:
            await other.close()
    assert held.started == 2


async def test_a_workflow_cancelled_before_a_hub_takes_it_never_runs(
    fleet: Fleet, wf_settings: MeshSettings, caplog: pytest.LogCaptureFixture
) -> None:
    """Its submission waits in the stream (the hub runs its one workflow; fair shares defer
    the rest) when the caller cancels it: a plain cancel finds no record (as before:
    REACH_UNKNOWN_WORKFLOW); with ``before_start`` the cancel is recorded at once (not final,
    PENDING, no owner), and the hub that takes the submission ends it cancelled, no step
    started, no start event."""
    s = wf_settings.model_copy(update={"workflow_concurrency": 1})
    caplog.set_level(logging.INFO, logger="reach_mesh.hub.workflows")
    async with Hub(settings=s) as hub:
        held = await Held(fleet).start()
        engine = hub.workflows
        assert engine is not None
        async with Client(settings=s) as mesh:
            first = await mesh.submit_fanout([Step(capability="wf:slow:v1")], timeout=30)
            await eventually(lambda: held.started == 1)
            queued = await mesh.submit_chain(
                [Step(capability="wf:slow:v1"), Step(capability="wf:slow:v1")], timeout=30
            )
            await eventually(lambda: engine.deferred_total >= 1)
            with pytest.raises(UnknownWorkflowError, match="before_start"):
                await mesh.cancel_workflow(queued, timeout=3)
            answer = await mesh.cancel_workflow(queued, reason="not needed", before_start=True)
            assert (answer.final, answer.state, answer.owner) == (False, TaskState.PENDING, None)
            view = await mesh.inspect_workflow(queued)
            assert view.state is TaskState.PENDING and view.error is not None
            assert view.error.code == CANCELLED
            held.release.set()
            res = await mesh.workflow(queued, timeout=20)
            assert res.state is TaskState.FAILED and res.error is not None
            assert res.error.code == CANCELLED and "not needed" in res.error.message
            assert [(st.cancelled, st.agent_id) for st in res.steps] == [(True, None)] * 2
            again = await mesh.cancel_workflow(queued)
            assert again.final and again.cancelled and again.result == res
            events = [e async for e in mesh.workflow_events(queued, timeout=5)]
            assert [e.kind for e in events] == ["done"]  # it never started
            assert (await mesh.workflow(first, timeout=10)).ok
    # Told as what it is, not as a takeover of the workflow (from no hub).
    said = [r.getMessage() for r in caplog.records if r.name == "reach_mesh.hub.workflows"]
    assert any(f"workflow {queued} " in m and "cancelled before it started" in m for m in said)
    assert not any(queued in m and "took over" in m for m in said)
    assert held.started == 1


async def test_a_cancel_of_an_unknown_id_is_audited_once(
    wf_hub: Hub, wf_settings: MeshSettings
) -> None:
    """The client asks again about an id no hub knows for 2 s (one just submitted may not be
    taken yet): ten asks, one cancel, one audit event for its answer. Another cancel of the
    same id is audited again, and so is every ask of one cancel whose answer changed."""
    ns = wf_settings.namespace
    async with Client(settings=wf_settings) as mesh:

        async def cancels(wf_id: str) -> list[dict[str, Any]]:
            await wf_hub.audit.flush()
            events = await mesh.audit(namespace=ns, since=60)
            return [e for e in events if e.get("kind") == "cancel" and e["workflow_id"] == wf_id]

        t0 = time.monotonic()
        with pytest.raises(UnknownWorkflowError):
            await mesh.cancel_workflow("nobody-knows", reason="typo hunt")
        assert time.monotonic() - t0 > 1.5  # it did ask again during the grace period
        await eventually(lambda: _at_least(cancels("nobody-knows"), 1), timeout=5)
        await asyncio.sleep(0.3)  # (nothing more comes: one flush interval is 75 ms)
        (event,) = await cancels("nobody-knows")
        assert event["error"] == "REACH_UNKNOWN_WORKFLOW" and event["reason"] == "typo hunt"
        assert event["cancel_id"]
        # A second cancel is a cancel of its own, audited as such.
        with pytest.raises(UnknownWorkflowError):
            await mesh.cancel_workflow("nobody-knows", timeout=1)
        await eventually(lambda: _at_least(cancels("nobody-knows"), 2), timeout=5)
        await asyncio.sleep(0.3)
        assert len({e["cancel_id"] for e in await cancels("nobody-knows")}) == 2
        # The asks of one cancel: audited again when the answer changes (here: recorded
        # before it started), once per answer.
        subject = protocol.hub_subject(ns, "cancel")
        for before_start in (False, False, True, True):
            body = {"workflow_id": "one-cancel", "cancel_id": "c1", "before_start": before_start}
            await mesh.nc.request(subject, json.dumps(body).encode(), timeout=5)
        await eventually(lambda: _at_least(cancels("one-cancel"), 2), timeout=5)
        await asyncio.sleep(0.3)
        asked = await cancels("one-cancel")
        assert [(e.get("error"), e.get("state")) for e in asked] == [
            ("REACH_UNKNOWN_WORKFLOW", None),
            (None, "PENDING"),
        ]


async def _at_least(events: Awaitable[list[dict[str, Any]]], n: int) -> bool:
    return len(await events) >= n


async def test_bad_cancels_get_typed_errors(wf_hub: Hub, wf_settings: MeshSettings) -> None:
    ns = wf_settings.namespace
    async with Client(settings=wf_settings) as mesh:
        with pytest.raises(UnknownWorkflowError):
            await mesh.cancel_workflow("never-submitted", timeout=3)
        # Before it starts: an id nobody submitted yet — the cancel is recorded, and a later
        # submission of it ends cancelled without running; a malformed one ends rejected.
        early = await mesh.cancel_workflow("never-submitted", before_start=True)
        assert (early.final, early.state, early.owner) == (False, TaskState.PENDING, None)
        await mesh.cancel_workflow("bad-later", before_start=True)
        await mesh.nc.jetstream().publish(
            protocol.wf_submit(ns), b"not json", headers={"Nats-Msg-Id": f"{ns}.bad-later"}
        )
        rejected = await mesh.workflow("bad-later", timeout=5)
        assert rejected.error is not None and rejected.error.code == "REACH_BAD_REQUEST"
        late = await mesh.fanout(
            [Step(capability="wf:nobody:v1")], workflow_id="never-submitted", timeout=10
        )
        assert late.state is TaskState.FAILED and late.error is not None
        assert late.error.code == CANCELLED and late.steps[0].cancelled
        # ... but not in a namespace no hub knows: nothing is left behind there.
        with pytest.raises(UnknownWorkflowError):
            await mesh.cancel_workflow(
                "never-submitted", namespace="nowhere-known", timeout=3, before_start=True
            )
        kv = await mesh.nc.jetstream().key_value(protocol.KV_WORKFLOWS)
        with pytest.raises(KeyNotFoundError):
            await kv.get(protocol.workflow_key("nowhere-known", "never-submitted"))
        with pytest.raises(BadRequestError):
            await mesh.cancel_workflow("../etc")
        with pytest.raises(BadRequestError):
            await mesh.cancel_workflow("x", reason="r" * 201)
    assert wf_settings.nats_url is not None
    nc = await nats.connect(wf_settings.nats_url)
    try:
        subject = protocol.hub_subject(ns, "cancel")
        for body in (
            b"not json",
            b"[]",
            b'{"workflow_id": 5}',
            b'{"workflow_id": "a b"}',
            b"{}",
            b'{"workflow_id": "w1", "reason": 7}',
            b'{"workflow_id": "w1", "before_start": "yes"}',
            json.dumps({"workflow_id": "w1", "reason": "r" * 201}).encode(),
        ):
            reply = await nc.request(subject, body, timeout=5)
            err = json.loads(reply.data)["error"]
            assert err["code"] == "REACH_BAD_REQUEST", (body, err)
        # Only hubs may pass a cancel on (NATS permissions in a secure mesh); a hub checks
        # what it is given all the same.
        peer = protocol.hub_peer(ns, "cancel", wf_hub.hub_id)
        for body in (b'{"workflow_id": "w1"}', b'{"workflow_id": "w1", "within_s": 60}'):
            reply = await nc.request(peer, body, timeout=5)
            assert json.loads(reply.data)["error"]["code"] == "REACH_BAD_REQUEST"
    finally:
        await nc.close()


async def test_the_cli_and_the_rest_api_cancel(fleet: Fleet, wf_settings: MeshSettings) -> None:
    ns = wf_settings.namespace
    async with (
        Hub(settings=wf_settings.model_copy(update={"http_port": 0})) as hub,
        Client(settings=wf_settings) as mesh,
    ):
        held = await Held(fleet).start()
        by_cli = await mesh.submit_fanout([Step(capability="wf:slow:v1")], timeout=30)
        by_rest = await mesh.submit_fanout([Step(capability="wf:slow:v1")], timeout=30)
        await running(mesh, by_cli)
        await running(mesh, by_rest)

        env = {k: v for k, v in os.environ.items() if not k.startswith(("REACH_", "OTEL_"))}
        assert wf_settings.nats_url is not None
        argv = [sys.executable, "-m", "reach_mesh.cli", "--nats", wf_settings.nats_url]
        argv += ["cancel", by_cli, "--namespace", ns, "--reason", "from the cli"]
        done = await asyncio.to_thread(
            subprocess.run, argv, env=env, capture_output=True, text=True
        )
        assert done.returncode == 0, done.stderr
        assert done.stdout.startswith(f"workflow {by_cli} ({ns}): cancelled, FAILED"), done.stdout
        # Its record says PENDING (no running state): the view says the attempt was sent.
        assert "step 0: cancelled after attempt 1 was sent" in done.stdout, done.stdout
        again = await asyncio.to_thread(
            subprocess.run, [*argv, "--json"], env=env, capture_output=True, text=True
        )
        assert again.returncode == 0, again.stderr
        parsed = CancelResult.model_validate_json(again.stdout)
        assert parsed.cancelled and parsed.result is not None
        assert parsed.result.error is not None and "from the cli" in parsed.result.error.message
        argv[-5] = "not-submitted-yet"
        missing = await asyncio.to_thread(
            subprocess.run, argv, env=env, capture_output=True, text=True
        )
        assert missing.returncode == 4 and "REACH_UNKNOWN_WORKFLOW" in missing.stderr, missing
        early = await asyncio.to_thread(
            subprocess.run, [*argv, "--before-start"], env=env, capture_output=True, text=True
        )
        assert early.returncode == 0 and "cancelled before it started" in early.stdout, early

        base = f"{hub.http_url}/api/workflows"

        async def post(path: str, body: bytes = b"{}") -> tuple[int, Any]:
            status, raw = await fetch(f"{base}/{path}", method="POST", body=body)
            return status, json.loads(raw)

        status, body = await post(f"{by_rest}/cancel?namespace={ns}", b'{"reason": "rest"}')
        assert status == 200, body
        answer = CancelResult.model_validate(body)
        if not answer.final:  # the owner was still storing it: ask again, as documented
            status, body = await post(f"{by_rest}/cancel?namespace={ns}")
            answer = CancelResult.model_validate(body)
        assert answer.final and answer.cancelled, answer
        status, body = await post(f"nothing-here/cancel?namespace={ns}")
        assert status == 404 and body["error"]["code"] == "REACH_UNKNOWN_WORKFLOW"
        before_start = b'{"before_start": true}'
        status, body = await post(f"nothing-here/cancel?namespace={ns}", before_start)
        assert status == 200 and (body["final"], body["state"], body.get("owner")) == (
            False,
            "PENDING",
            None,
        )
        status, body = await post("nothing-here/cancel?namespace=nowhere-known", before_start)
        assert status == 404 and body["error"]["code"] == "REACH_UNKNOWN_WORKFLOW"
        assert "nothing was recorded" in body["error"]["message"]
        status, body = await post(f"x/cancel?namespace={ns}", b'{"before_start": "yes"}')
        assert status == 400 and body["error"]["code"].startswith("REACH_BAD"), body
        status, body = await post(f"ok/cancel?namespace={ns}", b'{"reason": 5}')
        assert status == 400 and body["error"]["code"].startswith("REACH_BAD"), body
        status, raw = await fetch(f"{hub.http_url}/openapi.json")
        assert "/api/workflows/{workflow_id}/cancel" in json.loads(raw)["paths"]
        # Unregistered while its hub is there: no stale record for the next test's hubs.
        await held.agent.close()
    assert held.finished == 0


@pytest.mark.parametrize("lease", ["fresh", "lapsed"])
async def test_a_step_finished_before_the_cancel_keeps_its_result_not_yet_stored(
    wf_hub: Hub, fleet: Fleet, wf_settings: MeshSettings, lease: str
) -> None:
    """A step whose handler finished before the cancel, but whose final status is not in
    REACH_STATUS yet (its publish held up by a reconnect, as chaos seed 48 found under a NATS
    node kill): the hub asks its agent, and the step keeps its outcome instead of being
    marked cancelled. The held-up publish stands in for the reconnect. ``lapsed``: the
    agent's lease lapsed too (SUSPECT) — a JetStream outage lapses every lease, as chaos seed
    76 found — and it is asked all the same."""
    agent = echo_agent(fleet, "held.a1", "wf:held:v1")
    slow = fleet.agent("held.a2")

    @slow.handler("wf:held-slow:v1")
    async def never(task: Task[Any]) -> Any:
        await asyncio.sleep(60)

    await agent.start()
    await slow.start()
    assert agent.work is not None
    release = asyncio.Event()
    final = agent.work._store_final

    async def held_up(
        env: TaskEnvelope, headers: dict[str, str], body: bytes, msgs: list[Msg]
    ) -> None:
        await release.wait()
        await final(env, headers, body, msgs)

    agent.work._store_final = held_up  # type: ignore[method-assign]
    try:
        async with Client(settings=wf_settings) as mesh:
            wf_id = await mesh.submit_fanout(
                [
                    Step(capability="wf:held:v1", payload="done"),
                    Step(capability="wf:held-slow:v1", payload="never", timeout=30),
                ],
                timeout=30,
            )
            # The other branch runs until it is cancelled.
            await eventually(lambda: f"{wf_id}-0" in fleet.runs, timeout=5)
            if lease == "lapsed":
                assert agent._hb_task is not None
                agent._hb_task.cancel()
                await eventually(
                    lambda: wf_hub.registry.agents[agent.agent_id].state is AgentState.SUSPECT,
                    timeout=5,
                    interval=0.01,
                )
            answer = await mesh.cancel_workflow(wf_id, timeout=10)
            assert answer.final
            res = await mesh.workflow(wf_id, timeout=10)
            step = res.steps[0]
            assert step.state is TaskState.SUCCEEDED and not step.cancelled
            assert step.result == {"by": agent.agent_id, "in": "done"}
            assert res.error is not None and res.error.code == "REACH_WORKFLOW_CANCELLED"
            assert res.steps[1].cancelled
            # Only in its agent's memory when the cancel took it: recorded, so a restart that
            # lost it, redelivered the same attempt, finds the step final and drops it.
            rec = await task_record(mesh.nc, wf_settings.namespace, step.task_id)
            assert rec is not None and rec.state is TaskState.SUCCEEDED
            assert rec.result == step.result and rec.decided_by == 1
    finally:
        release.set()


async def test_a_step_a_stale_hub_starts_while_the_cancel_fences_it_is_fenced_once(
    wf_hub: Hub, fleet: Fleet, wf_settings: MeshSettings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A hub took a chain over at step 0 and is cancelled: it fences step 1, which never
    started, by creating its record cancelled. The hub it took the chain from, still running
    it unaware, creates that record first (it starts step 1): the cancel's create fails, and
    the step is fenced from the record that create found — one CAS on its revision, never a
    create again — keeping the stale hub's attempt in the record, cancelled."""
    ns = wf_settings.namespace
    held = await Held(fleet).start()
    agent_id = held.agent.agent_id
    wf_id = "taken-chain-raced"
    key = protocol.task_key(ns, f"{wf_id}-1")
    engine = wf_hub.workflows
    assert engine is not None
    cas = engine._cas
    writes: list[tuple[int, bool]] = []  # step 1's record writes: (revision read, cancelled)

    async def stale_hub_first(k: str, rec: TaskRecord, rev: int, deadline: float) -> int:
        if k == key:
            if not writes:  # the stale hub creates the record just before the cancel does
                started = rec.model_copy(
                    update={
                        "attempt": 1,
                        "agent_id": "stale.agent",
                        "state": TaskState.RUNNING,
                        "cancelled": False,
                    }
                )
                tasks = await wf_hub.nc.jetstream().key_value(protocol.KV_TASKS)
                await tasks.create(k, protocol.encode(started))
            writes.append((rev, rec.cancelled))
        return await cas(k, rec, rev, deadline)

    monkeypatch.setattr(engine, "_cas", stale_hub_first)
    steps = [Step(capability="wf:slow:v1", payload={"i": i}) for i in range(2)]
    async with Client(settings=wf_settings) as mesh:
        await seed_owner(mesh, "chain", steps, wf_id, "hub-stale", [agent_id, None])
        await mesh.submit_chain(steps, workflow_id=wf_id, timeout=30)  # this hub takes it
        await eventually(lambda: engine.takeover_total >= 1, timeout=10)
        answer = await mesh.cancel_workflow(wf_id)
        assert answer.final and answer.cancelled and answer.result is not None, answer
        assert [s.cancelled for s in answer.result.steps] == [True, True]
        # The failed create, then the fence on the revision it found: no second create.
        assert [(rev == 0, cancelled) for rev, cancelled in writes] == [
            (True, True),
            (False, True),
        ]
        tasks = await mesh.nc.jetstream().key_value(protocol.KV_TASKS)
        await assert_fenced(tasks, ns, wf_id, (1,))
        entry = await tasks.get(key)
        assert entry.value is not None
        fenced = TaskRecord.model_validate_json(entry.value)
        assert (fenced.attempt, fenced.agent_id) == (1, "stale.agent")  # the stale hub's, kept
    assert held.finished == 0


async def test_a_chain_step_that_ran_on_through_its_cancel_is_stopped_all_the_same(
    fleet: Fleet, wf_settings: MeshSettings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A chain's running step is interrupted by a cancel in an await that swallows it (Python
    3.11's ``wait_for`` under nats-py's requests, with no outcome in hand): it does not watch
    its attempt on to its end (8 s) nor send another — it stops there, as a fanout's branch
    does (``Workflow.halted``; chaos secure seed 184's fanout, ``node_stop``). It ran on
    until its workflow's submission, no longer kept in progress for a task cancelling, was
    delivered again (``workflow_ack_wait``: 5 s here) and the cancel finished from there."""
    loop = asyncio.get_running_loop()
    started = asyncio.Event()
    stopped: list[float] = []
    swallowed: list[float] = []
    agent = fleet.agent("ranon.a1")

    @agent.handler("wf:ranon:v1")
    async def work(task: Task[Any]) -> str:
        started.set()
        try:
            await asyncio.sleep(8)
        except asyncio.CancelledError:
            stopped.append(loop.time())
            raise
        return "late"

    slow_ack = wf_settings.model_copy(update={"workflow_ack_wait": 5.0})
    async with Hub(settings=slow_ack) as hub, Client(settings=wf_settings) as mesh:
        await agent.start()
        engine = hub.workflows
        assert engine is not None
        real_watch = engine._watch

        async def held(track: Any, pol: Any, deadline: float) -> Any:
            if not swallowed:
                try:
                    await asyncio.Event().wait()  # a read the cancel interrupts
                except asyncio.CancelledError:
                    swallowed.append(loop.time())  # swallowed, no outcome in hand
            return await real_watch(track, pol, deadline)

        monkeypatch.setattr(engine, "_watch", held)
        wf_id = await mesh.submit_chain(
            [Step(capability="wf:ranon:v1", task_id="ranon-chain-0", timeout=10)], timeout=30
        )
        await asyncio.wait_for(started.wait(), 5)
        answer = await mesh.cancel_workflow(wf_id, timeout=10)
        answered_at = loop.time()
        assert swallowed, "the cancel never reached the step"
        assert answered_at - swallowed[0] < 2.0, f"answered {answered_at - swallowed[0]:.2f}s"
        assert answer.final and answer.cancelled and answer.state is TaskState.FAILED, answer
        assert answer.result is not None and answer.result.steps[0].cancelled, answer.result
        await eventually(lambda: bool(stopped), timeout=3)
        rec = await task_record(hub.nc, wf_settings.namespace, "ranon-chain-0")
        assert rec is not None and rec.cancelled and rec.attempt == 1, rec
