"""Sizes on a real nats-server: a result, a step's input or a workflow's results too large
for a message end in ``REACH_PAYLOAD_TOO_LARGE`` at once, and nothing hangs or runs again.

Before, on a server with the default 1 MiB ``max_payload``: a handler's result over it was
published by the agent in vain (the workflow step timed out after re-running; a request-reply
answer cost the agent its connection, and the caller a timeout); a step input over
``max_payload`` was dropped by its agent as malformed (the step timed out); and a fanout whose
results together outgrew one KV value could never store its result — its hub gave it back,
took it over again and again, and the caller never got an answer.
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from collections.abc import AsyncIterator
from typing import Any
from unittest.mock import ANY

import pytest
from nats.js.errors import KeyNotFoundError

from reach_mesh import Client, MeshSettings, PayloadTooLargeError, Step, TaskState, protocol
from reach_mesh.agent import Agent, Task, TaskFailed
from reach_mesh.hub import Hub
from reach_mesh.hub._step_state import fit_result
from reach_mesh.logs import WORKFLOW_INTERRUPTED
from reach_mesh.models import ErrorBody
from reach_mesh.server import EmbeddedNats
from reach_mesh.workflow import StepResult, WorkflowRecord, WorkflowResult

from .helpers import Fleet, echo_agent, eventually, heal, partition, task_record

pytestmark = pytest.mark.timeout(90)

MIB = 1 << 20


@pytest.fixture
async def small_server() -> AsyncIterator[EmbeddedNats]:
    """A nats-server with its default ``max_payload`` (1 MiB), as most deployments run."""
    async with EmbeddedNats(max_payload=MIB) as server:
        yield server


def blob_agent(settings: MeshSettings, runs: Counter[str]) -> Agent:
    """``size:blob:v1`` returns ``{"blob": "x" * payload["n"]}``: a result of ~n bytes (with
    ``progress``: first reports progress of that many bytes, and says if it was refused)."""
    agent = Agent(f"{settings.namespace}.blob.a1", settings=settings)

    @agent.handler("size:blob:v1")
    async def blob(task: Task[Any]) -> Any:
        runs[task.task_id] += 1
        if "progress" in task.payload:
            if not task.payload.get("catch", True):
                await task.progress("p" * task.payload["progress"])
            try:
                await task.progress("p" * task.payload["progress"])
            except PayloadTooLargeError as err:
                return {"refused": err.details}
        return {"blob": "x" * task.payload["n"]}

    return agent


async def test_too_large_for_a_message_fails_at_once_and_runs_once(
    small_server: EmbeddedNats, wf_settings: MeshSettings
) -> None:
    settings = wf_settings.model_copy(update={"nats_url": small_server.url})
    runs: Counter[str] = Counter()
    agent = blob_agent(settings, runs)
    async with Hub(settings=settings), Client(settings=settings) as mesh:
        await agent.start()
        try:
            assert mesh.nc.max_payload == MIB
            # Three results of 400 kB: each fits in a message, together not in the record.
            # The first is kept; the others are left out, and the workflow says so.
            many = await mesh.fanout(
                [Step(capability="size:blob:v1", payload={"n": 400_000}) for _ in range(3)],
                workflow_id="size-many",
                timeout=20,
            )
            assert many.state is TaskState.FAILED
            assert many.error is not None and many.error.code == "REACH_PAYLOAD_TOO_LARGE"
            assert many.error.details["results_left_out"] == [1, 2]
            assert many.error.details["record_max_size"] == MIB - 16 * 1024
            assert [s.state for s in many.steps] == [TaskState.SUCCEEDED] * 3
            assert many.steps[0].result == {"blob": "x" * 400_000}
            assert many.steps[1].result is None and many.steps[2].result is None
            assert many.result == [many.steps[0].result, None, None]
            assert isinstance(many.exception, PayloadTooLargeError)
            # It is the stored answer: read back and resubmitted, the same, nothing re-run.
            assert await mesh.workflow("size-many", timeout=5) == many
            again = await mesh.fanout(
                [Step(capability="size:blob:v1", payload={"n": 400_000}) for _ in range(3)],
                workflow_id="size-many",
                timeout=20,
            )
            assert again == many
            assert sorted(runs.values()) == [1, 1, 1]

            # A result over what an answer carries: FAILED by its agent, not retried.
            runs.clear()
            over = await mesh.fanout(
                [Step(capability="size:blob:v1", payload={"n": MIB + 10}, retries=3)],
                timeout=20,
            )
            assert over.state is TaskState.FAILED
            step = over.steps[0]
            assert step.error is not None and step.error.code == "REACH_PAYLOAD_TOO_LARGE"
            limit = MIB - 16 * 1024  # the server's max_payload less an answer's room
            assert step.error.details == {
                "retryable": False,
                "size": MIB + 10 + len('{"blob":""}'),
                "max_size": limit,
            }
            assert list(runs.values()) == [1]
            # Progress too large for a status: the handler hears it (nothing is sent).
            told = await mesh.fanout(
                [Step(capability="size:blob:v1", payload={"n": 1, "progress": MIB})], timeout=20
            )
            refusal = {"size": MIB + 2, "max_size": limit, "retryable": False}
            assert told.steps[0].result == {"refused": refusal}
            # ... and when it does not catch it, its step fails with it, not retried.
            runs.clear()
            uncaught = await mesh.fanout(
                [
                    Step(
                        capability="size:blob:v1",
                        payload={"n": 1, "progress": MIB, "catch": False},
                        retries=3,
                    )
                ],
                timeout=20,
            )
            error = uncaught.steps[0].error
            assert error is not None and error.code == "REACH_PAYLOAD_TOO_LARGE"
            assert error.details == refusal
            assert list(runs.values()) == [1]

            # The same over request-reply: an answer, and the agent keeps its connection.
            answer = await mesh.request(
                capability="size:blob:v1", payload={"n": MIB + 10}, timeout=10
            )
            assert answer.state is TaskState.FAILED
            assert answer.error is not None and answer.error.code == "REACH_PAYLOAD_TOO_LARGE"
            small = await mesh.request(capability="size:blob:v1", payload={"n": 3}, timeout=10)
            assert small.state is TaskState.SUCCEEDED and small.result == {"blob": "xxx"}

            # A chain step whose input (the previous output and its own payload) is over
            # max_payload: refused by the hub, never sent; the step before it ran once.
            runs.clear()
            chain = await mesh.chain(
                [
                    Step(capability="size:blob:v1", payload={"n": 1_000_000}),
                    Step(capability="size:blob:v1", payload={"n": 5, "pad": "y" * 60_000}),
                    Step(capability="size:blob:v1", payload={"n": 5}),
                ],
                timeout=20,
            )
            assert chain.state is TaskState.FAILED
            assert chain.error is not None and chain.error.code == "REACH_PAYLOAD_TOO_LARGE"
            refused = chain.steps[1]
            assert refused.error is not None and refused.error.details["step"] == 1
            assert refused.error.details["max_size"] == limit
            assert refused.agent_id is None  # never sent, and no record written for it
            assert await task_record(mesh.nc, settings.namespace, refused.task_id) is None
            assert chain.steps[2].cancelled
            assert list(runs.values()) == [1]

            # A step payload over max_payload: refused by the client before it is sent.
            with pytest.raises(PayloadTooLargeError, match="step 0"):
                await mesh.fanout(
                    [Step(capability="size:blob:v1", payload={"pad": "y" * (MIB + 1)})],
                    timeout=5,
                )

            # From a client that does not check: a submission the server takes whose record
            # (the spec and a little more) it could not — rejected by the hub, nothing run.
            runs.clear()
            steps = [{"capability": "size:blob:v1", "payload": {"n": 1, "pad": "z" * 5150}}]
            spec = {
                "workflow_id": "size-record",
                "kind": "fanout",
                "namespace": settings.namespace,
                "steps": steps * 200,
            }
            body = json.dumps(spec, separators=(",", ":")).encode()
            assert limit < len(body) < MIB
            await mesh.nc.jetstream().publish(
                protocol.wf_submit(settings.namespace),
                body,
                headers={
                    "Nats-Msg-Id": protocol.submit_msg_id(settings.namespace, "size-record", "n")
                },
            )
            res = await mesh.workflow("size-record", timeout=10)
            assert res.state is TaskState.FAILED and res.steps == []
            assert res.error is not None and res.error.code == "REACH_PAYLOAD_TOO_LARGE"
            assert res.error.details["max_size"] == limit
            assert not runs
        finally:
            await agent.close()


async def test_hub_refuses_a_submission_whose_step_an_agent_would_refuse(
    wf_hub: Hub, fleet: Fleet, wf_settings: MeshSettings
) -> None:
    """From a client that does not check (another language, an older SDK): the hub does."""
    ns = wf_settings.namespace
    agent = echo_agent(fleet, "size.a1", "size:echo:v1")
    await agent.start()
    async with Client(settings=wf_settings) as mesh:
        spec = {
            "workflow_id": "size-raw",
            "kind": "fanout",
            "namespace": ns,
            "steps": [
                {"capability": "size:echo:v1", "payload": "small"},
                {"capability": "size:echo:v1", "payload": "y" * (wf_settings.max_payload + 1)},
            ],
        }
        await mesh.nc.jetstream().publish(
            protocol.wf_submit(ns),
            json.dumps(spec).encode(),
            headers={"Nats-Msg-Id": protocol.submit_msg_id(ns, "size-raw", "n")},
        )
        # ... and without a Nats-Msg-Id: the rejection is stored under the body's id.
        spec["workflow_id"] = "size-raw-bare"
        await mesh.nc.jetstream().publish(protocol.wf_submit(ns), json.dumps(spec).encode())
        for wf_id in ("size-raw", "size-raw-bare"):
            res = await mesh.workflow(wf_id, timeout=10)
            assert res.state is TaskState.FAILED
            assert res.error is not None and res.error.code == "REACH_PAYLOAD_TOO_LARGE"
            assert res.error.details["step"] == 1
            assert res.steps == []  # refused whole: no step started
        await asyncio.sleep(0.2)
    assert fleet.runs == Counter()


def test_an_error_code_is_cut_to_64_characters() -> None:
    """From an agent that does not check: a step's record keeps a code per attempt (up to 32
    attempts), so a code is cut to 64 characters where it is read; nothing is refused."""
    body = {"code": "C" * 100_000, "message": "m"}
    assert ErrorBody.model_validate(body).code == "C" * 64
    assert ErrorBody.model_validate_json(json.dumps(body)).code == "C" * 64
    assert ErrorBody(code="REACH_HANDLER_FAILED", message="m").code == "REACH_HANDLER_FAILED"


async def test_a_handlers_error_is_cut_to_fit(
    wf_hub: Hub, fleet: Fleet, wf_settings: MeshSettings
) -> None:
    agent = fleet.agent("size.err")

    @agent.handler("size:fail:v1")
    async def fail(task: Task[Any]) -> Any:
        raise TaskFailed("m" * 5000, retryable=False, blob="x" * 10_000)

    await agent.start()
    async with Client(settings=wf_settings) as mesh:
        res = await mesh.fanout([Step(capability="size:fail:v1")], timeout=10)
        error = res.steps[0].error
        assert error is not None and error.code == "REACH_HANDLER_FAILED"
        assert error.message == "m" * 2000
        assert error.details == {"retryable": False, "details_left_out": 10_029}
        answer = await mesh.request(capability="size:fail:v1", timeout=10)
        assert answer.error is not None and answer.error.message == "m" * 2000


def _result(kind: str, outcomes: list[tuple[TaskState, Any]], **kw: Any) -> WorkflowResult:
    steps = [
        StepResult(
            index=i,
            task_id=f"w-{i}",
            state=state,
            result=value if state is TaskState.SUCCEEDED else None,
            error=None
            if state is TaskState.SUCCEEDED
            else ErrorBody(code="REACH_TIMEOUT", message="t" * 5000, details={"retryable": True}),
        )
        for i, (state, value) in enumerate(outcomes)
    ]
    ok = [s.result if s.ok else None for s in steps]
    return WorkflowResult(
        workflow_id="w",
        kind=kind,
        state=kw.pop("state", TaskState.SUCCEEDED),
        steps=steps,
        result=ok if kind == "fanout" else steps[-1].result,
        **kw,
    )


def _size(result: WorkflowResult) -> int:
    return len(protocol.encode(WorkflowRecord(result=result)))


def _fit(result: WorkflowResult, limit: int, *, steps: bool = False) -> WorkflowResult:
    """``fit_result`` as ``_store`` calls it: the record's other fields measured."""
    other = _size(result) - len(protocol.encode(result))
    return fit_result(result, limit, other, steps=steps)


def test_fit_result_keeps_the_results_that_fit_in_step_order() -> None:
    big, small = "b" * 6000, "s" * 500
    done = TaskState.SUCCEEDED
    fan = _result("fanout", [(done, small), (done, big), (done, small)])
    assert _fit(fan, 1 << 20) == fan  # room for all: nothing changes
    limit = _size(fan) - 4000  # step 1 (twice 6 kB) cannot stay; the later, smaller one can
    fitted = _fit(fan, limit)
    assert _size(fitted) <= limit
    assert [s.result for s in fitted.steps] == [small, None, small]
    assert fitted.result == [small, None, small]
    assert [s.state for s in fitted.steps] == [done] * 3  # the steps did succeed
    assert fitted.state is TaskState.FAILED and fitted.error is not None
    assert fitted.error.code == "REACH_PAYLOAD_TOO_LARGE"
    assert fitted.error.details == {"results_left_out": [1], "record_max_size": limit}
    # A chain keeps its last output twice (steps and result): both are counted and dropped.
    chain = _result("chain", [(done, small), (done, big)])
    assert chain.result == big
    cut = _fit(chain, _size(chain) - 1000)
    assert [s.result for s in cut.steps] == [small, None] and cut.result is None
    assert _size(cut) <= _size(chain) - 1000


def test_fit_result_keeps_a_failed_workflows_own_state_and_error() -> None:
    done, late = TaskState.SUCCEEDED, TaskState.TIMEOUT
    timed_out = _result(
        "fanout",
        [(done, "r" * 8000), (late, None)],
        state=late,
        error=ErrorBody(
            code="REACH_TIMEOUT", message="step 1 did not finish in time", details={"step": 1}
        ),
    )
    fitted = _fit(timed_out, _size(timed_out) - 6000)  # more than its errors give back
    assert fitted.state is late and fitted.error is not None
    assert fitted.error.code == "REACH_TIMEOUT"
    assert fitted.error.details == {"step": 1, "results_left_out": [0], "record_max_size": ANY}
    assert fitted.steps[0].result is None and fitted.steps[0].state is done


def test_fit_result_cuts_errors_before_it_leaves_out_results() -> None:
    """Many failed branches with long errors (a quorum fanout): cutting the errors is enough,
    so every result stays, even where leaving the result out alone would also have fit."""
    done, failed = TaskState.SUCCEEDED, TaskState.FAILED
    quorum = _result("fanout", [(done, "r" * 3000)] + [(failed, None)] * 6, policy="quorum(1)")
    limit = _size(quorum) - 8000  # without the result (twice 3 kB) it would fit too
    fitted = _fit(quorum, limit)
    assert _size(fitted) <= limit
    assert fitted.state is TaskState.SUCCEEDED and fitted.error is None
    assert fitted.steps[0].result == "r" * 3000 and fitted.result[0] == "r" * 3000
    error = fitted.steps[1].error
    assert error is not None and error.code == "REACH_TIMEOUT"
    assert len(error.message) == 200 and error.details == {"retryable": True}
    # The last resort keeps no steps, and says so.
    bare = _fit(quorum, 100, steps=True)
    assert bare.steps == [] and bare.state is TaskState.FAILED and bare.error is not None
    assert bare.error.details["results_left_out"] == [0]
    assert bare.error.details["steps_left_out"] is True


async def test_a_workflow_the_hub_cannot_finish_is_kept_and_shown(
    wf_hub: Hub, fleet: Fleet, wf_settings: MeshSettings, caplog: pytest.LogCaptureFixture
) -> None:
    """What no check here foresaw (a hub bug, stood in for by a fanout that raises): the
    workflow is handed back, not lost; each time it fails again the hub counts it as an
    error, not an outage, and says so at ERROR once a minute; once the cause is gone it
    finishes from its records."""
    engine = wf_hub.workflows
    assert engine is not None
    agent = echo_agent(fleet, "bug.a1", "size:bug:v1")
    await agent.start()
    real = engine._fanout

    async def broken(wf: Any) -> Any:
        raise RuntimeError("a bug in the hub")

    async def replica_behind(wf: Any) -> Any:
        raise KeyNotFoundError()

    engine._fanout = broken  # type: ignore[method-assign]
    errors = wf_hub.metrics.workflow_interrupted_total.labels("error")
    async with Client(settings=wf_settings) as mesh:
        wf_id = await mesh.submit_fanout([Step(capability="size:bug:v1", payload=1)], timeout=30)
        await eventually(lambda: errors._value.get() >= 2, timeout=10)
        lines = [r for r in caplog.records if getattr(r, "event", None) == WORKFLOW_INTERRUPTED]
        assert len(lines) == 1  # the second failure was held back (once a minute)
        assert lines[0].levelname == "ERROR" and lines[0].exc_info is not None
        assert lines[0].__dict__["cause"] == "error" and lines[0].__dict__["workflow_id"] == wf_id
        outage = wf_hub.metrics.workflow_interrupted_total.labels("infrastructure")
        assert outage._value.get() == 0
        # NATS's own answers (a replica behind its leader in an election) are no such error.
        engine._fanout = replica_behind  # type: ignore[method-assign]
        await eventually(lambda: outage._value.get() >= 1, timeout=10)
        engine._fanout = real  # type: ignore[method-assign]
        res = await mesh.workflow(wf_id, timeout=10)
        assert res.state is TaskState.SUCCEEDED
        assert res.steps[0].result == {"by": agent.agent_id, "in": 1}


async def test_an_uncapped_result_fails_its_step_and_nothing_crashes(
    small_server: EmbeddedNats, wf_settings: MeshSettings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """From an agent that does not cap its result (another language, an older SDK): a status
    the server carries whose result leaves no room for the step's record (the server's
    max_payload less 16 KiB) is that attempt's REACH_PAYLOAD_TOO_LARGE, not retried — what
    the SDK's agent answers itself. Before, an earlier attempt deciding the step with such a
    result (its task record written with it) crashed the step: ``REACH_INTERNAL``,
    ``MaxPayloadError``, after half a minute."""
    settings = wf_settings.model_copy(update={"nats_url": small_server.url})
    # The status message (result, its own fields and headers: the final status's id with its
    # nonce) fits under 1 MiB; the task record (the result, two attempts' history, the
    # workflow's id) does not.
    blob = {"blob": "x" * (MIB - 500)}
    size, limit = len(json.dumps(blob, separators=(",", ":"))), MIB - 16 * 1024
    monkeypatch.setattr(Agent, "_max_result", property(lambda self: 10 * MIB))
    cap = "size:late:v1"
    a = Agent(f"{settings.namespace}.late.a", settings=settings)
    b = Agent(f"{settings.namespace}.late.b", settings=settings)
    started_a, release_a, started_b = asyncio.Event(), asyncio.Event(), asyncio.Event()
    runs: Counter[str] = Counter()

    @a.handler(cap)
    async def on_a(task: Task[Any]) -> Any:
        runs[task.agent_id] += 1
        started_a.set()
        await release_a.wait()
        return blob

    @b.handler(cap)
    async def on_b(task: Task[Any]) -> Any:
        runs[task.agent_id] += 1
        started_b.set()
        await asyncio.Event().wait()  # runs until told to stop

    async with Hub(settings=settings), Client(settings=settings) as mesh:
        await a.start()
        try:
            # Decided by the current attempt: its record is not written, only the workflow's.
            release_a.set()
            now = await mesh.fanout([Step(capability=cap)], timeout=20)
            assert now.state is TaskState.FAILED
            step = now.steps[0]
            assert step.state is TaskState.FAILED and step.decided_by == 1
            assert step.error is not None and step.error.code == "REACH_PAYLOAD_TOO_LARGE"
            assert step.error.details == {"retryable": False, "size": size, "max_size": limit}
            assert runs == {a.agent_id: 1}

            # Decided by an earlier attempt, A's, once B runs attempt 2: A's result goes into
            # the task record, which must fence B.
            runs.clear()
            release_a.clear()
            started_a.clear()
            wf_id = await mesh.submit_fanout([Step(capability=cap, retries=3)], timeout=20)
            await asyncio.wait_for(started_a.wait(), 5)
            await b.start()
            await partition(a)
            await asyncio.wait_for(started_b.wait(), 10)
            await heal(a, beat=False)
            release_a.set()
            t0 = asyncio.get_running_loop().time()
            late = await mesh.workflow(wf_id, timeout=15)
            assert asyncio.get_running_loop().time() - t0 < 5
            assert late.state is TaskState.FAILED
            step = late.steps[0]
            assert (step.state, step.attempts, step.decided_by) == (TaskState.FAILED, 2, 1)
            assert step.error is not None and step.error.code == "REACH_PAYLOAD_TOO_LARGE"
            assert step.error.details == {"retryable": False, "size": size, "max_size": limit}
            rec = await task_record(mesh.nc, settings.namespace, step.task_id)
            assert rec is not None and (rec.state, rec.decided_by) == (TaskState.FAILED, 1)
            assert rec.result is None
            assert runs == {a.agent_id: 1, b.agent_id: 1}
        finally:
            release_a.set()
            await a.close()
            await b.close()
