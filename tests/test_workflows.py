"""Durable fanout and chain workflows on a real nats-server, with fault injection.

Every interval is shrunk (ack waits ~1 s, backoff tens of ms) so failures play out in seconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, cast

import pytest
from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError

from reach_mesh import (
    Client,
    MeshSettings,
    RetryPolicy,
    Step,
    TaskState,
    protocol,
)
from reach_mesh._jspub import JsClient
from reach_mesh._nats import flushed
from reach_mesh.agent import Agent, Task, TaskFailed
from reach_mesh.agent._work import WorkConsumer
from reach_mesh.hub import Hub, _shapes, workflows
from reach_mesh.models import AgentState, TaskEnvelope
from reach_mesh.workflow import TaskRecord, merge_payload

from .helpers import (
    Fleet,
    HeldHandler,
    LoseFirstFinal,
    echo_agent,
    eventually,
    heal,
    held_handler,
    partition,
    status_events,
    task_record,
)

pytestmark = pytest.mark.timeout(60)


async def stored_task_record(hub: Hub, ns: str, task_id: str) -> TaskRecord:
    """The step's record in ``reach_tasks``, as the hub stored it (it must have one)."""
    rec = await task_record(hub.nc, ns, task_id)
    assert rec is not None
    return rec


# --------------------------------------------------------------------------- happy paths


async def test_fanout_all(wf_hub: Hub, fleet: Fleet, wf_settings: MeshSettings) -> None:
    ns = wf_settings.namespace
    a = fleet.agent("intent.a1")
    b = fleet.agent("slots.a1")

    @a.handler("nlp:intent:v1")
    async def intent(task: Task[dict[str, str]]) -> str:
        return "refund:" + task.payload["text"]

    traces: set[str | None] = set()

    @b.handler("nlp:slots:v1")
    async def slots(task: Task[dict[str, str]]) -> dict[str, int]:
        traces.add(task.trace_id)
        return {"n": len(task.payload["text"])}

    c = echo_agent(fleet, "policy.p1")
    for agent in (a, b, c):
        await agent.start()
    p = {"text": "hello"}
    async with Client(settings=wf_settings) as mesh:
        res = await mesh.fanout(
            [
                Step(selector="cap=nlp:intent:v1", payload=p),
                Step(capability="nlp:slots:v1", payload=p),
                Step(agent_id=f"{ns}.policy.p1", payload=p),
            ],
            policy="all",
            timeout=10,
        )
    assert res.state is TaskState.SUCCEEDED, res
    assert res.ok and res.error is None
    assert [s.state for s in res.steps] == [TaskState.SUCCEEDED] * 3
    assert res.result == ["refund:hello", {"n": 5}, {"by": f"{ns}.policy.p1", "in": p}]
    assert [s.agent_id for s in res.steps] == [a.agent_id, b.agent_id, c.agent_id]
    assert all(s.attempts == 1 for s in res.steps)
    assert res.trace_id is not None and len(res.trace_id) == 32
    assert traces == {res.trace_id}  # one trace from the caller through hub to the handler
    await eventually(
        lambda: (
            f'reach_workflow_total{{kind="fanout",namespace="{ns}",state="SUCCEEDED"}}'.encode()
            in wf_hub.metrics.render()
        )
    )
    assert res.workflow_id and res.kind == "fanout"


async def test_a_workflows_messages_are_taken_as_nats_py_reads_them(
    wf_hub: Hub, fleet: Fleet, wf_settings: MeshSettings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a workflow's critical path every message is handled in nats-py's reader as it is
    read, not by a subscription task a pass of the loop later (``reach_mesh/_inline.py``): the
    work an agent pulls, the acks of its statuses, and the statuses the hub takes."""
    where: dict[str, set[str]] = {"work": set(), "ack": set(), "status": set()}

    def reader() -> str:
        task = asyncio.current_task()
        return "?" if task is None else str(getattr(task.get_coro(), "__qualname__", "?"))

    def noted(kind: str, fn: Any) -> Any:
        def run(*args: Any) -> Any:
            where[kind].add(reader())
            return fn(*args)

        return run

    monkeypatch.setattr(WorkConsumer, "_on_msg", noted("work", WorkConsumer._on_msg))
    monkeypatch.setattr(JsClient, "_on_ack", noted("ack", JsClient._on_ack))
    assert wf_hub.workflows is not None
    tracker = wf_hub.workflows._tracker
    monkeypatch.setattr(tracker, "on_status", noted("status", tracker.on_status))
    agents = [echo_agent(fleet, f"inline.a{i}") for i in range(3)]
    for agent in agents:
        await agent.start()
    async with Client(settings=wf_settings) as mesh:
        res = await mesh.fanout(
            [Step(agent_id=a.agent_id, payload={"i": i}) for i, a in enumerate(agents)],
            timeout=10,
        )
    assert res.state is TaskState.SUCCEEDED, res
    # nats-py's read loop, or reach-mesh's copy of it on the connections ``_nats.connect``
    # makes (``_Connection._read_loop``: a turn of the loop after a full read that dropped).
    readers = {"Client._read_loop", "_Connection._read_loop"}
    assert all(seen and seen <= readers for seen in where.values()), where


async def test_a_workflow_in_a_namespace_that_does_not_exist_is_counted_as_unknown(
    wf_hub: Hub, wf_settings: MeshSettings
) -> None:
    """``reach_workflow_total`` is by namespace for the namespaces the hub knows (configured,
    or with a registered agent); a workflow in any other one — a name anyone on an open bus
    can make up — is counted under ``(unknown)``, and leaves no series named after it."""
    ghost = "ghost" + uuid.uuid4().hex[:8]
    async with Client(settings=wf_settings.model_copy(update={"namespace": ghost})) as mesh:
        # Nobody serves the step: it waits for an agent until the workflow's timeout.
        res = await mesh.fanout([Step(capability="nlp:none:v1", payload=1)], timeout=1.5)
    assert res.state is TaskState.TIMEOUT, res
    body = wf_hub.metrics.render()
    assert b'reach_workflow_total{kind="fanout",namespace="(unknown)",state="TIMEOUT"} 1.0' in body
    assert ghost.encode() not in body


async def test_fanout_any_cancels_the_rest(
    wf_hub: Hub, fleet: Fleet, wf_settings: MeshSettings
) -> None:
    release = asyncio.Event()
    fast = echo_agent(fleet, "fast.a1", "wf:fast:v1")
    slow = fleet.agent("slow.a1")

    @slow.handler("wf:slow:v1")
    async def wait(task: Task[Any]) -> str:
        await release.wait()
        return "late"

    await fast.start()
    await slow.start()
    try:
        async with Client(settings=wf_settings) as mesh:
            res = await mesh.fanout(
                [
                    Step(capability="wf:slow:v1"),
                    Step(capability="wf:fast:v1", payload=1),
                    Step(capability="wf:slow:v1"),
                ],
                policy="any",
                timeout=10,
            )
        assert res.state is TaskState.SUCCEEDED
        assert res.steps[1].ok
        assert res.steps[0].cancelled and res.steps[2].cancelled
        assert not res.steps[0].state.final
    finally:
        release.set()


async def test_fanout_quorum(wf_hub: Hub, fleet: Fleet, wf_settings: MeshSettings) -> None:
    good = echo_agent(fleet, "good.a1", "wf:good:v1")
    bad = fleet.agent("bad.a1")

    @bad.handler("wf:bad:v1")
    async def fail(task: Task[Any]) -> None:
        raise TaskFailed("no", retryable=False)

    await good.start()
    await bad.start()
    async with Client(settings=wf_settings) as mesh:
        ok = await mesh.fanout(
            [
                Step(capability="wf:good:v1"),
                Step(capability="wf:bad:v1"),
                Step(capability="wf:good:v1"),
            ],
            policy="quorum(2)",
            timeout=10,
        )
        assert ok.state is TaskState.SUCCEEDED
        assert sum(s.ok for s in ok.steps) == 2
        no = await mesh.fanout(
            [
                Step(capability="wf:bad:v1"),
                Step(capability="wf:bad:v1"),
                Step(capability="wf:good:v1"),
            ],
            policy="quorum(2)",
            timeout=10,
        )
        assert no.state is TaskState.FAILED
        assert no.error is not None and no.error.code == "REACH_HANDLER_FAILED"
        # all: the first failure is reported as such
        allp = await mesh.fanout(
            [Step(capability="wf:good:v1"), Step(capability="wf:bad:v1")], timeout=10
        )
        assert allp.state is TaskState.FAILED
        assert allp.steps[0].ok and allp.steps[1].state is TaskState.FAILED
        assert allp.steps[1].attempts == 1  # non-retryable: failed at once


async def test_chain_passes_outputs(wf_hub: Hub, fleet: Fleet, wf_settings: MeshSettings) -> None:
    agent = fleet.agent("doc.a1")

    @agent.handler("doc:fetch:v1")
    async def fetch(task: Task[dict[str, str]]) -> dict[str, str]:
        return {"text": f"content of {task.payload['url']}"}

    @agent.handler("doc:summarize:v1")
    async def summarize(task: Task[dict[str, str]]) -> dict[str, str]:
        return {"summary": task.payload["text"][:10]}

    @agent.handler("doc:translate:v1")
    async def translate(task: Task[dict[str, str]]) -> str:
        return f"[{task.payload['lang']}] {task.payload['summary']}"

    await agent.start()
    async with Client(settings=wf_settings) as mesh:
        out = await mesh.chain(
            [
                Step(capability="doc:fetch:v1", payload={"url": "u"}),
                Step(capability="doc:summarize:v1"),
                Step(capability="doc:translate:v1", payload={"lang": "en"}),
            ],
            timeout=10,
        )
    assert out.state is TaskState.SUCCEEDED, out
    assert out.result == "[en] content of"
    assert [s.state for s in out.steps] == [TaskState.SUCCEEDED] * 3


def test_merge_payload_rules() -> None:
    assert merge_payload({"a": 1}, None) == {"a": 1}
    assert merge_payload({"a": 1, "b": 2}, {"b": 3}) == {"a": 1, "b": 3}
    assert merge_payload("x", {"k": 1}) == {"input": "x", "k": 1}
    assert merge_payload({"a": 1}, 5) == 5


async def test_chain_stops_at_failure(wf_hub: Hub, fleet: Fleet, wf_settings: MeshSettings) -> None:
    agent = fleet.agent("c.a1")

    @agent.handler("c:boom:v1")
    async def boom(task: Task[Any]) -> None:
        raise TaskFailed("bad input", retryable=False)

    @agent.handler("c:ok:v1")
    async def ok(task: Task[Any]) -> int:
        return 1

    await agent.start()
    async with Client(settings=wf_settings) as mesh:
        out = await mesh.chain(
            [Step(capability="c:ok:v1"), Step(capability="c:boom:v1"), Step(capability="c:ok:v1")],
            timeout=10,
        )
    assert out.state is TaskState.FAILED
    assert out.steps[1].state is TaskState.FAILED and out.steps[2].cancelled
    assert out.error is not None and "bad input" in out.error.message


# --------------------------------------------------------------------------- fairness


def _hung_and_quick(
    fleet: Fleet, s: MeshSettings, cap: str
) -> tuple[Agent, asyncio.Event, Agent, MeshSettings]:
    """Two tenants: an agent of ``s``'s namespace whose ``cap`` hangs until the event is set,
    and an echo agent (``wf:echo:v1``) of another namespace, with that namespace's settings."""
    release = asyncio.Event()
    slow = fleet.agent("slow.s1", max_concurrency=16)

    @slow.handler(cap)
    async def hang(task: Task[Any]) -> str:
        await release.wait()
        return "done"

    other_settings = s.model_copy(update={"namespace": f"{s.namespace}x"})
    other = echo_agent(Fleet(other_settings), "quick.q1")
    fleet.agents.append(other)
    return slow, release, other, other_settings


async def test_tenants_whose_workflows_hang_cannot_take_a_hub(
    fleet: Fleet, wf_settings: MeshSettings, caplog: pytest.LogCaptureFixture
) -> None:
    """A tenant whose workflows hang fills a hub (``workflow_concurrency`` 4); its further
    submissions go back to the stream (deferred, not failed), and another tenant's workflow,
    stored behind them, is taken as its fair share and runs at once. Once the first tenant's
    agent answers, every one of its workflows finishes, the deferred ones too. (Before fair
    shares the full hub stopped pulling, and the other tenant's workflow waited.)"""
    s = wf_settings.model_copy(update={"workflow_concurrency": 4})
    ns = s.namespace
    slow, release, other, other_settings = _hung_and_quick(fleet, s, "wf:slow:v1")
    async with Hub(settings=s) as hub:
        await slow.start()
        await other.start()
        engine = hub.workflows
        assert engine is not None
        async with Client(settings=s) as mesh, Client(settings=other_settings) as theirs:
            ids = [
                await mesh.submit_fanout([Step(capability="wf:slow:v1", payload=i)], timeout=30)
                for i in range(6)
            ]
            await eventually(lambda: engine.deferred_total >= 2 and slow.inflight >= 2)
            res = await asyncio.wait_for(
                theirs.fanout([Step(capability="wf:echo:v1", payload="b")], timeout=10), 5
            )
            assert res.state is TaskState.SUCCEEDED
            assert engine._shares.held(ns) <= 4 and slow.inflight <= 4
            assert hub.metrics.workflow_deferred_total._value.get() == engine.deferred_total
            (line,) = [
                r for r in caplog.records if getattr(r, "event", None) == "REACH-NAMESPACE-SHARE"
            ]  # one line per 30 s, however many were deferred
            assert getattr(line, "namespace", None) == ns
            release.set()
            results = [await mesh.workflow(wf_id, timeout=20) for wf_id in ids]
            assert [r.state for r in results] == [TaskState.SUCCEEDED] * 6
            assert [r.result for r in results] == [["done"]] * 6
        assert engine._shares.held(ns) == 0


async def test_a_tenants_big_submissions_cannot_take_a_hubs_memory(
    fleet: Fleet, wf_settings: MeshSettings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A running workflow holds its spec, payloads included: a caller's 120 specs of 7 MB
    once held a hub at 1.3 GB (``workflow_concurrency``, 1,024, counts workflows, not bytes).
    The bytes of the submissions a hub runs are shared between namespaces as the count is
    (``HELD_BYTES``, here 100 KB): past it a tenant's further big submissions wait in the
    stream, another tenant's workflow runs at once, and all finish once the first's agent
    answers."""
    monkeypatch.setattr(workflows, "HELD_BYTES", 100_000)
    ns = wf_settings.namespace
    slow, release, other, other_settings = _hung_and_quick(fleet, wf_settings, "wf:big:v1")
    async with Hub(settings=wf_settings) as hub:
        await slow.start()
        await other.start()
        engine = hub.workflows
        assert engine is not None
        async with Client(settings=wf_settings) as mesh, Client(settings=other_settings) as theirs:
            ids = [
                await mesh.submit_fanout(
                    [Step(capability="wf:big:v1", payload="x" * 40_000)], timeout=30
                )
                for _ in range(5)
            ]
            await eventually(lambda: engine.deferred_total >= 1 and slow.inflight >= 3)
            res = await asyncio.wait_for(
                theirs.fanout([Step(capability="wf:echo:v1", payload="b")], timeout=10), 5
            )
            assert res.state is TaskState.SUCCEEDED
            assert slow.inflight == 3 and engine._shares.held(ns) == 3
            release.set()
            results = [await mesh.workflow(wf_id, timeout=20) for wf_id in ids]
            assert [r.state for r in results] == [TaskState.SUCCEEDED] * 5
        assert engine._held_bytes.held(ns) == 0 and engine._held_bytes.total == 0


# --------------------------------------------------------------------------- retries


async def test_handler_fails_then_succeeds(
    wf_hub: Hub, fleet: Fleet, wf_settings: MeshSettings
) -> None:
    calls: Counter[str] = Counter()
    agent = fleet.agent("flaky.a1")

    @agent.handler("wf:flaky:v1")
    async def flaky(task: Task[Any]) -> str:
        calls[task.task_id] += 1
        if task.attempt == 1:
            raise RuntimeError("transient")
        return f"ok on attempt {task.attempt}"

    await agent.start()
    async with Client(settings=wf_settings) as mesh:
        res = await mesh.fanout([Step(capability="wf:flaky:v1", retries=2)], timeout=10)
    assert res.state is TaskState.SUCCEEDED, res
    assert res.steps[0].attempts == 2 and res.steps[0].decided_by == 2
    assert res.steps[0].result == "ok on attempt 2"
    assert wf_hub.workflows is not None and wf_hub.workflows.retry_total >= 1
    # Decided by its current attempt: the task record stays as that attempt was sent (no
    # write needed to fence anything; attempt 1 is fenced by the number).
    rec = await stored_task_record(wf_hub, wf_settings.namespace, res.steps[0].task_id)
    assert (rec.attempt, rec.agent_id, rec.state) == (2, agent.agent_id, TaskState.PENDING)


async def test_retries_exhausted_fail(wf_hub: Hub, fleet: Fleet, wf_settings: MeshSettings) -> None:
    agent = fleet.agent("broken.a1")

    @agent.handler("wf:broken:v1")
    async def broken(task: Task[Any]) -> None:
        raise RuntimeError("always")

    await agent.start()
    async with Client(settings=wf_settings) as mesh:
        res = await mesh.fanout([Step(capability="wf:broken:v1", retries=1)], timeout=10)
    assert res.state is TaskState.FAILED
    assert res.steps[0].attempts == 2


async def test_a_handler_raising_cancelled_error_fails_once_per_attempt(
    wf_hub: Hub, fleet: Fleet, wf_settings: MeshSettings
) -> None:
    """A handler whose awaited inner task was cancelled raises ``CancelledError`` while no
    one cancels the attempt: that is its failure (``REACH_HANDLER_FAILED``), as any exception
    — not an agent shutting down, which leaves the step unanswered for redelivery (it ran 14
    times for one step with one retry). A request gets the same answer."""
    runs = 0
    agent = fleet.agent("cancelled.a1")

    @agent.handler("wf:cancelled:v1")
    async def cancelled(task: Task[Any]) -> None:
        nonlocal runs
        runs += 1
        inner = asyncio.ensure_future(asyncio.sleep(10))
        inner.cancel()
        await inner  # raises CancelledError here: the inner task's, not this attempt's

    await agent.start()
    async with Client(settings=wf_settings) as mesh:
        res = await mesh.fanout([Step(capability="wf:cancelled:v1", retries=1)], timeout=10)
        assert res.state is TaskState.FAILED, res
        assert res.steps[0].attempts == 2 and runs == 2
        assert res.steps[0].error is not None
        assert res.steps[0].error.code == "REACH_HANDLER_FAILED"
        reply = await mesh.request(capability="wf:cancelled:v1", payload={}, timeout=5)
        assert reply.state is TaskState.FAILED and reply.error is not None
        assert reply.error.code == "REACH_HANDLER_FAILED" and runs == 3
    await asyncio.sleep(1.5)  # a redelivery would come within the work ack wait (1 s)
    assert runs == 3


class _OwnBaseError(BaseException):
    """A handler's own exception not derived from ``Exception``."""


@pytest.mark.parametrize("raised", [_OwnBaseError, GeneratorExit, SystemExit, KeyboardInterrupt])
async def test_a_handler_raising_what_is_not_an_exception_fails_as_any_handler(
    wf_hub: Hub, fleet: Fleet, wf_settings: MeshSettings, raised: type[BaseException]
) -> None:
    """A handler that raises a ``BaseException`` that is no ``Exception``: its failure, as any
    (the careless-agent audit: the task stayed DELIVERED for good, every retry of its id
    waited for it; a step was reported RUNNING until the hub gave up on it; ``SystemExit`` took
    the agent down without a drain). The agent keeps serving."""
    runs = 0
    agent = fleet.agent(f"base.{raised.__name__.lower().strip('_')}")

    @agent.handler("wf:base:v1")
    async def base(task: Task[Any]) -> None:
        nonlocal runs
        runs += 1
        raise raised("from the handler")

    @agent.handler("wf:fine:v1")
    async def fine(task: Task[Any]) -> str:
        return "fine"

    await agent.start()
    async with Client(settings=wf_settings) as mesh:
        res = await mesh.fanout([Step(capability="wf:base:v1", retries=1)], timeout=10)
        assert res.state is TaskState.FAILED and runs == 2, res
        error = res.steps[0].error
        assert error is not None and error.code == "REACH_HANDLER_FAILED", error
        assert error.details["type"] == raised.__name__
        for _ in range(2):  # the second: the stored failure, at once
            reply = await mesh.request(
                agent_id=agent.agent_id, capability="wf:base:v1", task_id="base-1", timeout=5
            )
            assert reply.state is TaskState.FAILED and reply.error is not None, reply
            assert reply.error.code == "REACH_HANDLER_FAILED" and runs == 3
        ok = await mesh.request(agent_id=agent.agent_id, capability="wf:fine:v1", timeout=5)
        assert ok.result == "fine"


async def test_a_result_nested_too_deep_to_parse_fails_at_once(
    wf_hub: Hub, fleet: Fleet, wf_settings: MeshSettings
) -> None:
    """A result nested deeper than the mesh's JSON parsers read (about 200 levels) passed
    every check, then no message carrying it could be read: the step's final status was never
    written and the step redelivered to its deadline (TIMEOUT, late), a request's answer was
    "malformed reply". It fails at once, not retried; one 180 levels deep is carried."""
    runs = 0
    agent = fleet.agent("deep.a1")

    def nested(depth: int) -> Any:
        value: Any = 1
        for _ in range(depth):
            value = [value]
        return value

    @agent.handler("wf:deep:v1")
    async def deep(task: Task[Any]) -> Any:
        nonlocal runs
        runs += 1
        return nested(task.payload["depth"])

    await agent.start()
    async with Client(settings=wf_settings) as mesh:
        step = Step(capability="wf:deep:v1", payload={"depth": 300}, retries=2)
        res = await mesh.fanout([step], timeout=10)
        assert res.state is TaskState.FAILED and runs == 1, res
        assert res.steps[0].error is not None and "nests too deeply" in res.steps[0].error.message
        reply = await mesh.request(capability="wf:deep:v1", payload={"depth": 300}, timeout=5)
        assert reply.state is TaskState.FAILED and reply.error is not None
        assert reply.error.code == "REACH_HANDLER_FAILED" and runs == 2
        ok = await mesh.fanout([Step(capability="wf:deep:v1", payload={"depth": 180})], timeout=10)
        assert ok.state is TaskState.SUCCEEDED and ok.steps[0].result == nested(180)
        reply = await mesh.request(capability="wf:deep:v1", payload={"depth": 180}, timeout=5)
        assert reply.state is TaskState.SUCCEEDED and reply.result == nested(180)


async def test_a_result_or_error_that_is_not_valid_unicode_fails_at_once(
    wf_hub: Hub, fleet: Fleet, wf_settings: MeshSettings
) -> None:
    """A lone surrogate (a file name decoded with ``surrogateescape``) in a handler's result
    cannot be written as JSON: the agent failed the attempt itself, over and over (a step
    redelivered to its deadline, the workflow uncancellable meanwhile; a request answered
    "malformed reply"). The step fails at once, saying why; in an error message it is
    written as its escape, and the handler's own code and message are kept."""
    runs = 0
    agent = fleet.agent("surr.a1")
    name = b"caf\xe9.txt".decode("utf-8", "surrogateescape")

    @agent.handler("wf:surr:v1")
    async def surr(task: Task[Any]) -> Any:
        nonlocal runs
        runs += 1
        if task.payload["fail"]:
            raise TaskFailed(f"no file {name}", code="APP_NO_FILE", retryable=False)
        return {"files": [name]}

    await agent.start()
    async with Client(settings=wf_settings) as mesh:
        step = Step(capability="wf:surr:v1", payload={"fail": False}, retries=2)
        res = await mesh.fanout([step], timeout=20)
        assert res.state is TaskState.FAILED and runs == 1, res
        error = res.steps[0].error
        assert error is not None and "not valid Unicode" in error.message, error
        assert res.duration_ms < 5000, res
        for mode in ("proxy", "direct"):
            reply = await mesh.request(
                capability="wf:surr:v1", payload={"fail": False}, timeout=5, mode=mode
            )
            assert reply.state is TaskState.FAILED and reply.error is not None, reply
            assert "not valid Unicode" in reply.error.message, reply.error
        failed = await mesh.fanout(
            [Step(capability="wf:surr:v1", payload={"fail": True})], timeout=20
        )
        error = failed.steps[0].error
        assert error is not None and error.details["code"] == "APP_NO_FILE", failed
        assert error.message == "no file caf\\udce9.txt", error


async def test_graceful_agent_close_finishes_its_running_step(
    wf_hub: Hub, fleet: Fleet, wf_settings: MeshSettings
) -> None:
    """An agent closed while a step runs drains it: the final status still goes out after the
    work consumer stopped, the step succeeds with its first attempt, and runs once."""
    started, release = asyncio.Event(), asyncio.Event()
    runs = 0
    agent = fleet.agent("drain.a1", drain_timeout=10.0)

    @agent.handler("wf:drain:v1")
    async def slow(task: Task[Any]) -> str:
        nonlocal runs
        runs += 1
        started.set()
        await release.wait()
        return "finished while closing"

    await agent.start()
    async with Client(settings=wf_settings) as mesh:
        wf_id = await mesh.submit_fanout([Step(capability="wf:drain:v1")], timeout=20)
        await asyncio.wait_for(started.wait(), 5)
        closing = asyncio.create_task(agent.close())
        await asyncio.sleep(0.3)  # the work consumer has stopped; the handler still runs
        release.set()
        # At once: not after the final status's in-place retries (10 s), then a probe.
        await asyncio.wait_for(closing, 5)
        res = await mesh.workflow(wf_id, timeout=3)
    assert res.state is TaskState.SUCCEEDED, res
    assert res.result == ["finished while closing"]
    assert (res.steps[0].attempts, res.steps[0].decided_by, runs) == (1, 1, 1)


# --------------------------------------------------------------------------- faults


async def test_agent_killed_mid_step(wf_hub: Hub, fleet: Fleet, wf_settings: MeshSettings) -> None:
    ns = wf_settings.namespace
    started = asyncio.Event()
    hold = asyncio.Event()
    doomed = fleet.agent("work.doomed", drain_timeout=0.2)

    @doomed.handler("wf:work:v1")
    async def stuck(task: Task[Any]) -> str:
        started.set()
        await hold.wait()
        return "from the dead"

    await doomed.start()
    async with Client(settings=wf_settings) as mesh:
        wf_id = await mesh.submit_fanout([Step(capability="wf:work:v1", payload=7)], timeout=20)
        await asyncio.wait_for(started.wait(), 5)
        survivor = echo_agent(fleet, "work.survivor", "wf:work:v1")
        await survivor.start()
        await doomed.nc.close()  # abrupt: no unregister, no final status
        res = await mesh.workflow(wf_id, timeout=15)
        assert res.state is TaskState.SUCCEEDED, res
        assert res.steps[0].agent_id == survivor.agent_id
        assert res.steps[0].attempts == 2
        events = await status_events(mesh, ns, res.steps[0].task_id)
        assert [e.state for e in events].count(TaskState.SUCCEEDED) == 1
    hold.set()


async def test_lost_status_and_duplicate_delivery_run_once(
    wf_hub: Hub, fleet: Fleet, wf_settings: MeshSettings
) -> None:
    ns = wf_settings.namespace
    agent = echo_agent(fleet, "dup.a1", "wf:dup:v1")
    await agent.start()
    engine = wf_hub.workflows
    assert engine is not None
    lose = LoseFirstFinal()
    dropped = lose.dropped
    engine.status_filter = lose  # the final status never reaches the hub
    try:
        async with Client(settings=wf_settings) as mesh:
            res = await mesh.fanout([Step(capability="wf:dup:v1", payload="x")], timeout=10)
            assert res.state is TaskState.SUCCEEDED, res
            assert dropped, "the fault was not injected"
            task_id = res.steps[0].task_id
            assert fleet.runs[task_id] == 1
            assert res.steps[0].attempts == 1  # recovered from the status stream, not re-sent
            stale_before = engine.stale_total
            # Duplicate delivery of the same attempt (a lost ack): answered, not run again.
            env = TaskEnvelope(
                task_id=task_id,
                attempt=1,
                capability="wf:dup:v1",
                payload="x",
                namespace=ns,
                workflow_id=res.workflow_id,
                step=0,
                track=True,
            )
            await mesh.nc.jetstream().publish(
                protocol.work_subject(ns, agent.agent_id),
                protocol.encode(env),
                headers={"Nats-Msg-Id": f"{task_id}#1-again"},
            )
            assert agent.work is not None
            await eventually(lambda: agent.work is not None and agent.work.duplicates == 1)
            assert fleet.runs[task_id] == 1
            await asyncio.sleep(0.2)
            assert engine.stale_total == stale_before  # a repeat of the answer is not stale
    finally:
        engine.status_filter = None


class _Handover:
    """Hub A runs the workflows; ``kill_a()`` kills it (no ack, no nak, no more +WPI) and
    starts hub B, which takes them over."""

    def __init__(self, settings: MeshSettings) -> None:
        self.settings = settings
        self.hub_a = Hub(settings=settings, hub_id="hub-a")
        self.hub_b: Hub | None = None

    async def kill_a(self) -> None:
        await self.hub_a.nc.close()
        self.hub_b = Hub(settings=self.settings, hub_id="hub-b")
        await self.hub_b.start()


@contextlib.asynccontextmanager
async def _handover(settings: MeshSettings, release: asyncio.Event) -> AsyncIterator[_Handover]:
    """A started hub A (see ``_Handover``); on exit ``release`` is set, then both hubs close."""
    pair = _Handover(settings)
    await pair.hub_a.start()
    try:
        yield pair
    finally:
        release.set()
        await pair.hub_a.close()
        if pair.hub_b is not None:
            await pair.hub_b.close()


async def test_hub_killed_mid_workflow(
    fleet: Fleet,
    wf_settings: MeshSettings,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_shapes, "TAKEOVERS_TOLD_AFTER", 0.2)
    started = asyncio.Event()
    hold = asyncio.Event()
    agent = fleet.agent("chain.a1")
    runs: Counter[int] = Counter()

    @agent.handler("wf:first:v1")
    async def first(task: Task[Any]) -> dict[str, int]:
        runs[0] += 1
        return {"x": 1}

    @agent.handler("wf:second:v1")
    async def second(task: Task[dict[str, int]]) -> int:
        runs[1] += 1
        started.set()
        await hold.wait()
        return task.payload["x"] + 1

    async with _handover(wf_settings, hold) as hubs:
        await agent.start()
        async with Client(settings=wf_settings) as mesh:
            wf_id = await mesh.submit_chain(
                [Step(capability="wf:first:v1"), Step(capability="wf:second:v1")], timeout=20
            )
            await asyncio.wait_for(started.wait(), 5)
            kv = await hubs.hub_a.nc.jetstream().key_value(protocol.KV_TASKS)
            key = protocol.task_key(wf_settings.namespace, f"{wf_id}-1")
            created = await kv.get(key)  # hub A created it when it sent step 1
            await hubs.kill_a()
            assert hubs.hub_b is not None
            # Hub B writes the adopted record again: a CAS hub A still had in flight on the
            # revision it knew (a retry, a TIMEOUT) fails instead of landing after B decides.
            kv = await hubs.hub_b.nc.jetstream().key_value(protocol.KV_TASKS)

            async def fenced() -> bool:
                return (await kv.get(key)).revision != created.revision

            await eventually(fenced, timeout=10)
            assert created.value is not None
            with pytest.raises(KeyWrongLastSequenceError):
                await kv.update(key, created.value, last=created.revision)
            hold.set()
            res = await mesh.workflow(wf_id, timeout=15)
            # The surviving hub tells the takeover (an operator's sign that a hub failed).
            assert hubs.hub_b is not None and hubs.hub_b.workflows is not None
            # (At least: earlier tests' unfinished workflows come to hub-b as well.)
            taken = hubs.hub_b.workflows.takeover_total
            assert taken >= 1
            assert hubs.hub_b.metrics.workflow_takeover_total._value.get() == taken
        assert res.state is TaskState.SUCCEEDED, res
        assert res.result == 2
        assert res.hub_id == "hub-b"
        assert runs == Counter({0: 1, 1: 1})  # no step ran twice
        # One line for the takeovers of a few seconds: it may name an earlier test's leftover
        # instead of this workflow.
        await eventually(
            lambda: any(
                r.getMessage().startswith("took over ")
                for r in caplog.records
                if r.name == "reach_mesh.hub.workflows"
            )
        )


async def test_a_mass_takeover_is_told_in_one_line_with_its_count(
    wf_hub: Hub, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A dead hub's workflows come to another together: one line tells how many (the SRE
    audit: 12 taken over, told as 'took over 1 workflow(s)', the rest held for a next line
    that never came)."""
    monkeypatch.setattr(_shapes, "TAKEOVERS_TOLD_AFTER", 0.2)
    engine = wf_hub.workflows
    assert engine is not None
    before = engine.takeover_total
    for i in range(12):
        engine._took_over(cast(Any, SimpleNamespace(id=f"wf-mass-{i}")), "hub-dead")

    def told() -> list[str]:
        return [r.getMessage() for r in caplog.records if "wf-mass-" in r.getMessage()]

    await eventually(lambda: bool(told()))
    assert told() == [
        "took over 12 workflow(s) within 0.2 s, e.g. wf-mass-0 from hub hub-dead: their owner "
        "stopped renewing them (died, stopped or cut off); resuming from the records"
    ]
    assert engine.takeover_total == before + 12


async def test_hub_killed_mid_fanout_adopts_the_attempts_named_at_start(
    fleet: Fleet, wf_settings: MeshSettings
) -> None:
    """The steps of a fanout are sent at its start without task records of their own (the
    workflow record names their agents). Hub A dies while they run; hub B takes over, adopts
    each from the workflow record, and every handler runs once."""
    started, hold = asyncio.Event(), asyncio.Event()
    agent = fleet.agent("adopt.a1")
    runs: Counter[int] = Counter()

    @agent.handler("wf:adopt:v1")
    async def slow(task: Task[int]) -> int:
        runs[task.payload] += 1
        if len(runs) == 2:
            started.set()
        await hold.wait()
        return task.payload * 10

    async with _handover(wf_settings, hold) as hubs:
        await agent.start()
        async with Client(settings=wf_settings) as mesh:
            steps = [Step(capability="wf:adopt:v1", payload=i) for i in (1, 2)]
            wf_id = await mesh.submit_fanout(steps, timeout=20)
            await asyncio.wait_for(started.wait(), 5)
            rec = await task_record(hubs.hub_a.nc, wf_settings.namespace, f"{wf_id}-0")
            assert rec is None  # sent at the start: named by the workflow record only
            await hubs.kill_a()
            assert hubs.hub_b is not None
            # Hub B writes each adopted step's record before it watches it: a write hub A
            # still had in flight (alive behind a partition: its attempt 2 of the step)
            # fails then, instead of sending the step again after B decided it.
            kv = await hubs.hub_b.nc.jetstream().key_value(protocol.KV_TASKS)
            key = protocol.task_key(wf_settings.namespace, f"{wf_id}-0")

            async def adopted_record() -> bool:
                assert hubs.hub_b is not None
                got = await task_record(hubs.hub_b.nc, wf_settings.namespace, f"{wf_id}-0")
                return got is not None

            await eventually(adopted_record, timeout=10)
            adopted = await task_record(hubs.hub_b.nc, wf_settings.namespace, f"{wf_id}-0")
            assert adopted is not None
            assert (adopted.attempt, adopted.agent_id) == (1, agent.agent_id)
            late = adopted.model_copy(update={"attempt": 2, "agent_id": None})
            with pytest.raises(KeyWrongLastSequenceError):
                await kv.create(key, protocol.encode(late))
            hold.set()
            res = await mesh.workflow(wf_id, timeout=15)
        assert res.state is TaskState.SUCCEEDED, res
        assert res.result == [10, 20] and res.hub_id == "hub-b"
        assert [(s.attempts, s.decided_by) for s in res.steps] == [(1, 1), (1, 1)]
        assert runs == Counter({1: 1, 2: 1})  # adopted, not sent again


@dataclass
class _Pair:
    """What :func:`_partitioned_pair` set up: the workflow, agent A, and both handlers."""

    wf_id: str
    a: Agent
    on_a: HeldHandler
    on_b: HeldHandler


async def _partitioned_pair(fleet: Fleet, mesh: Client, name: str) -> _Pair:
    """A step starts on agent A, A goes silent (LOST) but keeps running its handler, and the
    step is re-routed to B (attempt 2)."""
    cap = f"wf:{name}:v1"
    a = fleet.agent(f"{name}.a")
    b = fleet.agent(f"{name}.b")
    on_a = held_handler(a, cap, "answer of A")
    on_b = held_handler(b, cap, "answer of B")
    await a.start()
    wf_id = await mesh.submit_fanout([Step(capability=cap)], timeout=20)
    await asyncio.wait_for(on_a.started.wait(), 5)
    await b.start()
    await partition(a)  # A is cut off but keeps running the handler
    await asyncio.wait_for(on_b.started.wait(), 10)  # LOST -> re-routed to B (attempt 2)
    return _Pair(wf_id, a, on_a, on_b)


async def test_lost_agent_that_still_has_the_attempt_keeps_it(
    wf_hub: Hub, fleet: Fleet, wf_settings: MeshSettings
) -> None:
    """A's heartbeats stop reaching the hubs (a starved process, a slow hub) but A answers:
    declared LOST, it is asked before its attempt is given up, says it runs it, and keeps it.
    B never runs the step; A's result decides it with one attempt."""
    a_started, a_release = asyncio.Event(), asyncio.Event()
    b_runs = 0
    a = fleet.agent("starved.a")
    b = fleet.agent("starved.b")

    @a.handler("wf:starved:v1")
    async def on_a(task: Task[Any]) -> str:
        a_started.set()
        await a_release.wait()
        return "answer of A"

    @b.handler("wf:starved:v1")
    async def on_b(task: Task[Any]) -> str:
        nonlocal b_runs
        b_runs += 1
        return "answer of B"

    await a.start()
    async with Client(settings=wf_settings) as mesh:
        wf_id = await mesh.submit_fanout([Step(capability="wf:starved:v1")], timeout=20)
        await asyncio.wait_for(a_started.wait(), 5)
        await b.start()
        assert a._hb_task is not None
        a._hb_task.cancel()  # no heartbeats; ctl still answers
        await eventually(
            lambda: (
                a.agent_id not in wf_hub.registry.agents
                or wf_hub.registry.agents[a.agent_id].state is AgentState.LOST
            ),
            timeout=10,
        )
        await asyncio.sleep(1.0)  # past the silence timeout: the hub asked, A has it
        a_release.set()
        res = await mesh.workflow(wf_id, timeout=10)
    assert res.state is TaskState.SUCCEEDED
    assert res.result == ["answer of A"]
    assert res.steps[0].attempts == 1
    assert b_runs == 0


async def test_first_outcome_wins_even_from_a_superseded_attempt(
    wf_hub: Hub, fleet: Fleet, wf_settings: MeshSettings
) -> None:
    """A valid result is never thrown away: A's attempt 1 finishes first and decides the step,
    although attempt 2 is running on B; B's now useless handler is cancelled."""
    async with Client(settings=wf_settings) as mesh:
        pair = await _partitioned_pair(fleet, mesh, "win")
        wf_id = pair.wf_id
        pair.on_a.release.set()
        res = await mesh.workflow(wf_id, timeout=10)
        await asyncio.wait_for(pair.on_b.cancelled.wait(), 5)
        view = await mesh.inspect_workflow(wf_id)
    assert res.state is TaskState.SUCCEEDED
    assert res.result == ["answer of A"]
    assert res.steps[0].agent_id == f"{wf_settings.namespace}.win.a"
    assert res.steps[0].attempts == 2 and res.steps[0].decided_by == 1
    # Decided by an earlier attempt: the record is written final, fencing attempt 2.
    rec = await stored_task_record(wf_hub, wf_settings.namespace, res.steps[0].task_id)
    assert (rec.state, rec.decided_by, rec.attempt) == (TaskState.SUCCEEDED, 1, 2)
    # What an operator sees: decided by attempt 1 on A; attempt 2 went to B.
    step = view.steps[0]
    assert (step.decided_by, step.agent_id) == (1, f"{wf_settings.namespace}.win.a"), step
    history = {h.attempt: (h.agent_id, h.state) for h in step.history}
    assert history[1] == (f"{wf_settings.namespace}.win.a", TaskState.SUCCEEDED), step
    assert history[2][0] == f"{wf_settings.namespace}.win.b", step


async def test_outcome_after_the_decision_is_counted_never_applied(
    wf_hub: Hub, fleet: Fleet, wf_settings: MeshSettings
) -> None:
    engine = wf_hub.workflows
    assert engine is not None
    async with Client(settings=wf_settings) as mesh:
        pair = await _partitioned_pair(fleet, mesh, "late")
        wf_id = pair.wf_id
        pair.on_b.release.set()  # B decides the step
        res = await mesh.workflow(wf_id, timeout=10)
        before = engine.stale_total
        pair.on_a.release.set()  # A's attempt-1 result arrives after the decision
        await eventually(lambda: engine.stale_total == before + 1, timeout=5)
        again = await mesh.workflow(wf_id, timeout=5)
    assert res.state is TaskState.SUCCEEDED
    assert res.result == ["answer of B"] == again.result
    assert res.steps[0].agent_id == f"{wf_settings.namespace}.late.b"
    assert res.steps[0].attempts == 2


async def test_a_decided_step_stops_its_earlier_attempt_still_running(
    wf_hub: Hub, fleet: Fleet, wf_settings: MeshSettings
) -> None:
    """A's attempt 1 was given up (A silent) but runs on; A answers again, still without
    heartbeats (so it does not fence itself). B's attempt 2 decides the step: A is told to
    stop attempt 1, whose result nobody needs any more."""
    async with Client(settings=wf_settings) as mesh:
        pair = await _partitioned_pair(fleet, mesh, "stop1")
        await heal(pair.a, beat=False)
        pair.on_b.release.set()
        res = await mesh.workflow(pair.wf_id, timeout=10)
        await asyncio.wait_for(pair.on_a.cancelled.wait(), 5)
    assert res.state is TaskState.SUCCEEDED
    assert res.result == ["answer of B"]
    assert (res.steps[0].attempts, res.steps[0].decided_by) == (2, 2)


async def test_a_cancel_stops_every_attempt_still_running(
    wf_hub: Hub, fleet: Fleet, wf_settings: MeshSettings
) -> None:
    """A cancelled workflow's step had two attempts running, A's given up and B's current:
    both agents are told to stop, not only the current attempt's."""
    async with Client(settings=wf_settings) as mesh:
        pair = await _partitioned_pair(fleet, mesh, "stopall")
        await heal(pair.a, beat=False)
        answer = await mesh.cancel_workflow(pair.wf_id, reason="test")
        await asyncio.wait_for(pair.on_b.cancelled.wait(), 5)
        await asyncio.wait_for(pair.on_a.cancelled.wait(), 5)
        res = await mesh.workflow(pair.wf_id, timeout=10)
    assert answer.cancelled is not False, answer
    assert res.state is TaskState.FAILED
    assert res.error is not None and res.error.code == "REACH_WORKFLOW_CANCELLED"


@pytest.mark.parametrize("kind", ["fanout", "chain"])
async def test_a_cancel_keeps_an_outcome_the_step_had_in_hand(
    wf_hub: Hub,
    fleet: Fleet,
    wf_settings: MeshSettings,
    monkeypatch: pytest.MonkeyPatch,
    kind: str,
) -> None:
    """Attempt 1 (on A, cut off and given up) succeeds while attempt 2 runs on B: the first
    outcome wins, and the hub writes the step's final record — slowly (an election). A cancel
    then stops the step. A's status is not in REACH_STATUS yet (its agent still retrying the
    store): the success the hub held must still be the step's outcome, not thrown away as
    stale with the step reported cancelled."""
    engine = wf_hub.workflows
    assert engine is not None
    name = f"inhand{kind}"
    cap = f"wf:{name}:v1"
    a, b = fleet.agent(f"{name}.a"), fleet.agent(f"{name}.b")
    on_a, on_b = held_handler(a, cap, "answer of A"), held_handler(b, cap, "answer of B")
    stuck = asyncio.Event()
    cas, last_status = engine._cas, engine._tracker.last_status

    async def slow_final_write(key: str, rec: TaskRecord, rev: int, deadline: float) -> int:
        if rec.state.final and not stuck.is_set():
            stuck.set()
            await asyncio.Event().wait()  # until the cancel stops the step
        return await cas(key, rec, rev, deadline)

    async def not_stored_for_a(ns: str, task_id: str, agent_id: str, **kw: Any) -> Any:
        return None if agent_id == a.agent_id else await last_status(ns, task_id, agent_id, **kw)

    monkeypatch.setattr(engine, "_cas", slow_final_write)
    monkeypatch.setattr(engine._tracker, "last_status", not_stored_for_a)
    await a.start()
    async with Client(settings=wf_settings) as mesh:
        submit = mesh.submit_fanout if kind == "fanout" else mesh.submit_chain
        wf_id = await submit([Step(capability=cap)], timeout=30)
        await asyncio.wait_for(on_a.started.wait(), 5)
        await b.start()
        await partition(a)  # A keeps running its handler
        await asyncio.wait_for(on_b.started.wait(), 10)  # attempt 2, on B
        stale = engine.stale_total
        on_a.release.set()
        await asyncio.wait_for(stuck.wait(), 5)
        answer = await mesh.cancel_workflow(wf_id, reason="test", timeout=10)
        res = await mesh.workflow(wf_id, timeout=10)
    assert [(s.state, s.result, s.decided_by, s.cancelled) for s in res.steps] == [
        (TaskState.SUCCEEDED, "answer of A", 1, False)
    ]
    assert res.state is TaskState.SUCCEEDED and answer.cancelled is False
    assert engine.stale_total == stale
    rec = await task_record(wf_hub.nc, wf_settings.namespace, res.steps[0].task_id)
    assert rec is not None and rec.state is TaskState.SUCCEEDED and rec.decided_by == 1


async def test_a_taken_over_chain_fences_a_step_the_old_owner_starts_meanwhile(
    fleet: Fleet, wf_settings: MeshSettings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Hub A is alive but stops renewing its workflow (a partition): hub B takes the chain over
    during step 0. B finds no record of step 1 when it reads, A creates it (A runs on), and
    B's own create fails: B adopts A's record — and writes it again, so a write A still has
    in flight on the revision it made fails, and A does not run the step on with it."""
    ns = wf_settings.namespace
    x, y = fleet.agent("fence.x"), fleet.agent("fence.y")
    first, second = (
        held_handler(x, "wf:fence0:v1", {"v": 1}),
        held_handler(y, "wf:fence1:v1", "done"),
    )
    hub_a, hub_b = (
        Hub(settings=wf_settings, hub_id="hub-a"),
        Hub(settings=wf_settings, hub_id="hub-b"),
    )
    await hub_a.start()
    try:
        await x.start()
        await y.start()
        engine_a = hub_a.workflows
        assert engine_a is not None and engine_a._pull is not None and engine_a._ticker is not None
        async with Client(settings=wf_settings) as mesh:
            steps = [Step(capability="wf:fence0:v1"), Step(capability="wf:fence1:v1")]
            wf_id = await mesh.submit_chain(steps, timeout=30)
            await asyncio.wait_for(first.started.wait(), 5)
            # Hub A goes quiet: no more +WPI, no more pulls; the submission goes to B.
            await engine_a._pull.stop()
            engine_a._ticker.cancel()
            await hub_b.start()
            engine_b = hub_b.workflows
            assert engine_b is not None
            await eventually(lambda: (ns, wf_id) in engine_b.owned, timeout=10)
            kv = await mesh.nc.jetstream().key_value(protocol.KV_TASKS)
            key = protocol.task_key(ns, f"{wf_id}-1")
            made: list[int] = []  # the revision A's create made
            choose_a, choose_b = engine_a._choose, engine_b._choose

            b_read = asyncio.Event()  # B read step 1's record (none) and chooses its agent

            async def a_later(route: Any, ns_: str, exclude: Any) -> Any:
                if route.capability == "wf:fence1:v1":
                    await asyncio.wait_for(b_read.wait(), 5)
                return await choose_a(route, ns_, exclude)

            async def b_after_a(route: Any, ns_: str, exclude: Any) -> Any:
                if route.capability == "wf:fence1:v1":
                    b_read.set()

                    async def created() -> bool:
                        try:
                            made.append(int((await kv.get(key)).revision or 0))
                            return True
                        except KeyNotFoundError:
                            return False

                    await eventually(created, timeout=5)
                return await choose_b(route, ns_, exclude)

            monkeypatch.setattr(engine_a, "_choose", a_later)
            monkeypatch.setattr(engine_b, "_choose", b_after_a)
            first.release.set()
            await asyncio.wait_for(second.started.wait(), 5)
            await eventually(lambda: bool(made), timeout=5)

            async def fenced() -> bool:
                return (await kv.get(key)).revision != made[0]

            await eventually(fenced, timeout=5)
            entry = await kv.get(key)
            assert entry.value is not None
            with pytest.raises(KeyWrongLastSequenceError):
                await kv.update(key, entry.value, last=made[0])  # A's in-flight write
            second.release.set()
            res = await mesh.workflow(wf_id, timeout=10)
        assert res.state is TaskState.SUCCEEDED and res.hub_id == "hub-b", res
        assert res.result == "done"
    finally:
        await hub_a.close()
        await hub_b.close()


async def test_returning_agent_fences_its_stale_attempts(
    wf_hub: Hub, fleet: Fleet, wf_settings: MeshSettings
) -> None:
    a = fleet.agent("back.a")
    on_a = held_handler(a, "wf:back:v1")  # never released
    b = echo_agent(fleet, "back.b", "wf:back:v1")
    await a.start()
    async with Client(settings=wf_settings) as mesh:
        wf_id = await mesh.submit_fanout([Step(capability="wf:back:v1")], timeout=20)
        await asyncio.wait_for(on_a.started.wait(), 5)
        await b.start()
        await partition(a)
        res = await mesh.workflow(wf_id, timeout=10)
        assert res.steps[0].agent_id == b.agent_id
        # A comes back: told it is unknown, it stays PRE_ONLINE and fences attempt 1 first.
        await heal(a)
        await asyncio.wait_for(on_a.cancelled.wait(), 5)
        assert a.work is not None and a.work.fenced >= 1
        await eventually(lambda: a.agent_id in wf_hub.registry.agents, timeout=5)


async def test_a_step_past_the_deadline_is_stopped_on_its_agent(
    wf_hub: Hub, fleet: Fleet, wf_settings: MeshSettings
) -> None:
    """A step still running when its workflow's deadline passes ends TIMEOUT, and its agent is
    told to stop the handler (the step has no timeout of its own that would end it sooner)."""
    agent = fleet.agent("deadline.a1")
    hang = held_handler(agent, "wf:deadline:v1")  # never released
    await agent.start()
    async with Client(settings=wf_settings) as mesh:
        res = await mesh.fanout([Step(capability="wf:deadline:v1")], timeout=1.0)
        assert hang.started.is_set()
        assert res.state is TaskState.TIMEOUT and res.steps[0].state is TaskState.TIMEOUT
        await asyncio.wait_for(hang.cancelled.wait(), 5)


async def test_ttl_expiry_is_timeout(wf_hub: Hub, fleet: Fleet, wf_settings: MeshSettings) -> None:
    hold = asyncio.Event()
    agent = fleet.agent("ttl.a1")

    @agent.handler("wf:hang:v1")
    async def hang(task: Task[Any]) -> None:
        await hold.wait()

    await agent.start()
    try:
        async with Client(settings=wf_settings) as mesh:
            # Nobody offers the capability: pending re-delivery until the step's TTL.
            res = await mesh.fanout(
                [Step(capability="wf:nobody:v1", retry=RetryPolicy(ttl=0.6))], timeout=10
            )
            assert res.state is TaskState.TIMEOUT
            assert res.steps[0].state is TaskState.TIMEOUT
            assert res.error is not None and res.error.code == "REACH_TIMEOUT"
            # A running step past the workflow's deadline: TIMEOUT, fenced.
            res = await mesh.fanout([Step(capability="wf:hang:v1")], timeout=0.8)
            assert res.state is TaskState.TIMEOUT
            assert res.steps[0].state is TaskState.TIMEOUT
    finally:
        hold.set()


async def test_a_step_record_create_whose_answer_was_lost_is_the_owners_own(
    wf_hub: Hub,
    fleet: Fleet,
    wf_settings: MeshSettings,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A chain step's record create lands but its answer is lost (an election), and the
    retry finds the key taken: the record is the hub's own write, adopted — not taken for
    another hub's, which would hand the workflow back and take it over from itself."""
    from reach_mesh.hub import _durable

    create = _durable.create
    lost: list[str] = []

    async def answer_lost(bucket: Any, key: str, data: bytes, deadline: float, **kw: Any) -> int:
        revision = await create(bucket, key, data, deadline, **kw)
        if key.endswith("-1") and not lost:
            lost.append(key)
            raise KeyWrongLastSequenceError(description="wrong last sequence")
        return revision

    monkeypatch.setattr(_durable, "create", answer_lost)
    engine = wf_hub.workflows
    assert engine is not None
    taken = engine.takeover_total
    agent = echo_agent(fleet, "lostack.a1", "wf:lostack:v1")
    await agent.start()
    async with Client(settings=wf_settings) as mesh:
        steps = [Step(capability="wf:lostack:v1", payload={"a": 1}) for _ in range(2)]
        res = await mesh.chain(steps, timeout=20)
    assert lost and res.state is TaskState.SUCCEEDED, res
    assert [s.attempts for s in res.steps] == [1, 1]
    assert engine.takeover_total == taken
    assert not [r for r in caplog.records if "moved under its owner" in r.getMessage()]


async def test_a_hub_that_lost_a_workflow_while_paused_stops_keeping_its_submission(
    fleet: Fleet, wf_settings: MeshSettings
) -> None:
    """Hub A stops renewing a running chain (paused, cut off) and hub B takes it over. A,
    back, would go on renewing its own older delivery of the submission — which nats-server
    takes for the message's, so when B dies the submission never comes back to any hub.
    A's first keepalive pass finds the record names B and stops its run without renewing it
    once; B dies; hub C resumes the workflow."""
    ns = wf_settings.namespace
    agent = fleet.agent("paused.x")
    step = held_handler(agent, "wf:paused:v1", "done")
    hub_a, hub_b = (
        Hub(settings=wf_settings, hub_id="hub-a"),
        Hub(settings=wf_settings, hub_id="hub-b"),
    )
    hub_c = Hub(settings=wf_settings, hub_id="hub-c")
    await hub_a.start()
    try:
        await agent.start()
        engine_a = hub_a.workflows
        assert engine_a is not None and engine_a._pull is not None and engine_a._ticker is not None
        async with Client(settings=wf_settings) as mesh:
            wf_id = await mesh.submit_chain([Step(capability="wf:paused:v1")], timeout=60)
            await asyncio.wait_for(step.started.wait(), 5)
            await engine_a._pull.stop()  # A pauses: no pulls, no +WPI
            engine_a._ticker.cancel()
            (delivery,) = [  # (other tests' submissions left behind may run here too)
                m.reply
                for m in engine_a._running.values()
                if protocol.workflow_id_of((m.headers or {}).get(protocol.HDR_MSG_ID, "")) == wf_id
            ]
            renewals = await mesh.nc.subscribe(delivery)
            await hub_b.start()
            engine_b = hub_b.workflows
            assert engine_b is not None
            await eventually(lambda: (ns, wf_id) in engine_b.owned, timeout=10)
            # A is back, late: it asks the records of what it runs, and stops what it lost,
            # before it renews anything: not one +WPI on its older delivery.
            assert await engine_a._keep(check=True)
            await eventually(lambda: (ns, wf_id) not in engine_a.owned, timeout=5)
            await flushed(hub_a.nc)  # anything A sent is at the server, and then here
            await flushed(mesh.nc)
            assert renewals.pending_msgs == 0
            await renewals.unsubscribe()
            engine_a._ticker = asyncio.create_task(engine_a._keepalive())
            await hub_b.nc.close()  # the new owner dies: no ack, no nak, no more +WPI
            await hub_c.start()
            engine_c = hub_c.workflows
            assert engine_c is not None
            await eventually(lambda: (ns, wf_id) in engine_c.owned, timeout=10)
            step.release.set()
            res = await mesh.workflow(wf_id, timeout=15)
        assert res.state is TaskState.SUCCEEDED and res.hub_id == "hub-c", res
    finally:
        step.release.set()
        await hub_a.close()
        await hub_b.close()
        await hub_c.close()
