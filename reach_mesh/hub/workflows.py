"""The workflow engine: durable fanout and chain over JetStream, run by whichever hub owns them.

Ownership: every hub pulls submissions (``reach.wf.<ns>.submit``) from one shared durable
consumer and keeps the message in progress (``+WPI``) while the workflow runs; it acks after the
result is stored. A hub that dies stops sending ``+WPI``; after ``workflow_ack_wait`` JetStream
redelivers the submission to another hub, which resumes from the task records in KV: finished
steps are not run again, an attempt still in flight is adopted (its status events, the last one
read back from the ``REACH_STATUS`` stream), and only unfinished work is dispatched.

Steps: each attempt of each step is one JetStream message on ``reach.work.<ns>.<agent_id>``
(``Nats-Msg-Id = task_id#n``). The task record in ``reach_tasks`` names the current attempt and
is written (CAS) *before* the message is published: it is the fence. Status events from any
other attempt are stale — counted, never the answer. See ``docs/workflows.md``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Final, Literal

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js import JetStreamContext
from nats.js.api import (
    AckPolicy,
    ConsumerConfig,
    DeliverPolicy,
    RetentionPolicy,
    StorageType,
    StreamConfig,
)
from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError, NotFoundError
from nats.js.kv import KeyValue
from opentelemetry.trace import Span
from pydantic import ValidationError

from reach_mesh import protocol
from reach_mesh._consume import PullConsumer, ensure_stream, ensure_task_resources
from reach_mesh._nats import ensure_kv
from reach_mesh.config import MeshSettings
from reach_mesh.errors import (
    InternalError,
    MeshTimeoutError,
    NoMatchError,
    ReachError,
    WorkflowSpecError,
)
from reach_mesh.hub.acks import AckMachine
from reach_mesh.hub.registry import AgentView, Registry
from reach_mesh.hub.router import Router
from reach_mesh.models import AgentState, ErrorBody, RouteRequest, TaskEnvelope, TaskState
from reach_mesh.selector import Selector
from reach_mesh.tracing import SPAN_STEP, SPAN_WORKFLOW, SpanKind, inject, span
from reach_mesh.workflow import (
    AttemptRecord,
    StepResult,
    StepSpec,
    TaskRecord,
    TaskStatusEvent,
    WorkflowEvent,
    WorkflowRecord,
    WorkflowResult,
    WorkflowSpec,
    merge_payload,
    step_task_id,
    validate_spec,
)

__all__ = ["WorkflowEngine"]

log = logging.getLogger("reach_mesh.hub.workflows")

_RECENT: Final = 50_000
_CTL_TIMEOUT: Final = 1.0
_HISTORY: Final = 32
_TRACE_HEADERS: Final = frozenset({"traceparent", "tracestate", "baggage"})

Outcome = Literal["final", "undelivered", "lost", "nomatch", "deadline"]


class _NotOwnerError(Exception):
    """Another hub wrote this workflow's records: it owns the workflow now."""


@dataclass(frozen=True, slots=True)
class _Policy:
    retries: int
    fast_attempts: int
    base: float
    cap: float
    pending_interval: float
    ttl: float
    deliver_timeout: float
    silence_timeout: float


@dataclass(slots=True, eq=False)
class _Track:
    """The current attempt of one step, fed by the status subscription."""

    key: str
    task_id: str
    namespace: str
    attempt: int
    agent_id: str
    machine: AckMachine
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    final: TaskStatusEvent | None = None
    dispatched_at: float = 0.0
    last_event: float = 0.0
    lost: bool = False
    stale: int = 0
    view: AgentView | None = None


@dataclass(slots=True, eq=False)
class _Workflow:
    spec: WorkflowSpec
    need: int
    deadline: float  # loop time
    submitted_at: float  # server wall time
    headers: dict[str, str]
    trace_id: str | None
    records: dict[int, TaskRecord] = field(default_factory=dict)

    @property
    def ns(self) -> str:
        return self.spec.namespace

    @property
    def id(self) -> str:
        return self.spec.workflow_id


class WorkflowEngine:
    """Runs the workflows this hub owns. Started and stopped by :class:`~reach_mesh.hub.Hub`.

    ``metrics`` (a :class:`~reach_mesh.tracing.metrics.HubMetrics`) is optional; when given,
    ``workflow_total``, ``workflow_duration_seconds``, ``retry_total``,
    ``duplicate_delivery_total`` and ``pending_count`` are kept.
    """

    def __init__(
        self,
        nc: NATS,
        js: JetStreamContext,
        registry: Registry,
        router: Router,
        settings: MeshSettings,
        hub_id: str,
        *,
        metrics: Any = None,
    ) -> None:
        self._nc = nc
        self._js = js
        self._registry = registry
        self._router = router
        self._settings = settings
        self.hub_id = hub_id
        self._metrics = metrics
        self._wf_kv: KeyValue | None = None
        self._tasks_kv: KeyValue | None = None
        self._pull: PullConsumer | None = None
        self._status_sub: Subscription | None = None
        self._tracks: dict[str, _Track] = {}
        #: Finished (or superseded) tasks -> their deciding attempt, for stale detection.
        self._recent: OrderedDict[str, int] = OrderedDict()
        self._running: dict[asyncio.Task[None], Msg] = {}
        self._bg: set[asyncio.Task[Any]] = set()
        self._pending = 0
        self._stopping = False
        #: Results rejected because their attempt was no longer current (fenced).
        self.stale_total = 0
        #: Final answers that came from an agent's idempotency cache (a duplicate delivery).
        self.duplicate_total = 0
        #: Attempts after the first.
        self.retry_total = 0
        self.workflows_done = 0
        #: Test seam (fault injection): return False to drop a status event as if lost.
        self.status_filter: Any = None
        #: Agents registered with ``durable_work=False`` (no work consumer): never offered a
        #: step. Kept from state changes so choosing a step does not scan the registry.
        self._no_work: set[str] = set()

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        s = self._settings
        js = self._js
        await ensure_stream(
            js,
            StreamConfig(
                name=protocol.STREAM_WF,
                subjects=[protocol.wf_submit("*")],
                retention=RetentionPolicy.WORK_QUEUE,
                storage=StorageType.FILE,
                max_age=s.workflow_retention,
                duplicate_window=min(s.dedup_window, s.workflow_retention),
                num_replicas=s.kv_replicas,
                description="reach-mesh workflow submissions (dedup on workflow_id)",
            ),
        )
        await ensure_stream(
            js,
            StreamConfig(
                name=protocol.STREAM_WF_EVENTS,
                subjects=[protocol.wf_event("*", "*"), protocol.wf_done("*", "*")],
                retention=RetentionPolicy.LIMITS,
                storage=StorageType.FILE,
                max_age=s.workflow_retention,
                num_replicas=s.kv_replicas,
                description="reach-mesh workflow step events and results",
            ),
        )
        self._tasks_kv = await ensure_task_resources(js, s)
        self._wf_kv = await ensure_kv(
            js,
            protocol.KV_WORKFLOWS,
            replicas=s.kv_replicas,
            ttl=s.workflow_retention,
            description="reach-mesh workflow records",
        )
        await js.add_consumer(
            protocol.STREAM_WF,
            ConsumerConfig(
                durable_name=protocol.CONSUMER_HUBS,
                ack_policy=AckPolicy.EXPLICIT,
                deliver_policy=DeliverPolicy.ALL,
                ack_wait=s.workflow_ack_wait,
                max_deliver=-1,
                max_ack_pending=max(s.workflow_concurrency * 16, 10_000),
            ),
        )
        self._status_sub = await self._nc.subscribe(
            protocol.task_status("*", "*"), cb=self._on_status, pending_msgs_limit=-1
        )
        self._registry.on_state_change(self._on_agent_state)
        self._no_work.update(v.agent_id for v in self._registry if not v.record.card.durable_work)
        self._pull = PullConsumer(
            self._nc,
            protocol.STREAM_WF,
            protocol.CONSUMER_HUBS,
            self._on_submit,
            s.workflow_concurrency,
            expires=min(5.0, max(0.5, s.workflow_ack_wait)),
        )
        await self._pull.start()

    async def stop(self) -> None:
        """Stop pulling; hand every running workflow back (nak) so another hub resumes it."""
        self._stopping = True
        if self._pull is not None:
            await self._pull.stop()
        running = dict(self._running)
        for task in running:
            task.cancel()
        for task, msg in running.items():
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
            with contextlib.suppress(Exception):
                await msg.nak()
        for bg in list(self._bg):
            bg.cancel()
        if self._status_sub is not None:
            with contextlib.suppress(Exception):
                await self._status_sub.unsubscribe()

    @property
    def running(self) -> int:
        """Workflows this hub owns right now."""
        return len(self._running)

    # ------------------------------------------------------------------ submissions

    def _on_submit(self, msg: Msg) -> None:
        task = asyncio.create_task(self._own(msg), name="reach-workflow")
        self._running[task] = msg
        task.add_done_callback(self._owned_done)

    def _owned_done(self, task: asyncio.Task[None]) -> None:
        self._running.pop(task, None)
        if self._pull is not None:
            self._pull.release()
        if not task.cancelled() and task.exception() is not None:
            log.error("workflow task failed", exc_info=task.exception())

    async def _own(self, msg: Msg) -> None:
        raw = dict(msg.headers or {})
        # Trace context only: the submit's JetStream headers must not leak into our publishes.
        headers = {k: v for k, v in raw.items() if k in _TRACE_HEADERS}
        try:
            wf = self._admit(msg, headers)
        except ReachError as err:
            await self._reject(msg, headers, err)
            return
        keepalive = asyncio.create_task(self._keepalive(msg))
        try:
            result = await self._run(wf)
        except _NotOwnerError:
            log.warning("workflow %s was taken over by another hub", wf.id)
            return  # neither ack nor nak: the other hub owns the message now
        except asyncio.CancelledError:
            raise
        except Exception as err:
            # Transient trouble (NATS down, ...): give the workflow back for a retry.
            log.warning("workflow %s interrupted: %r", wf.id, err)
            with contextlib.suppress(Exception):
                await msg.nak(delay=1.0)
            return
        finally:
            keepalive.cancel()
        await self._complete(wf, result, msg)

    def _admit(self, msg: Msg, headers: dict[str, str]) -> _Workflow:
        spec = protocol.decode(msg.data, WorkflowSpec, max_size=self._settings.max_payload * 8)
        ns = msg.subject.split(".")[2]
        if spec.namespace != ns:
            raise WorkflowSpecError(
                f"workflow namespace {spec.namespace!r} does not match subject {msg.subject!r}",
                field="namespace",
            )
        need = validate_spec(spec)
        try:
            submitted = msg.metadata.timestamp.timestamp()  # JetStream server time
        except Exception:
            submitted = time.time()
        timeout = spec.timeout if spec.timeout is not None else self._settings.task_ttl
        remaining = submitted + timeout - time.time()
        loop = asyncio.get_running_loop()
        from reach_mesh.tracing import trace_id_from_headers

        return _Workflow(
            spec=spec,
            need=need,
            deadline=loop.time() + max(0.0, remaining),
            submitted_at=submitted,
            headers=headers,
            trace_id=trace_id_from_headers(headers),
        )

    async def _reject(self, msg: Msg, headers: dict[str, str], err: ReachError) -> None:
        """A malformed submission: term it (never redelivered) and publish a failed result."""
        log.info("rejecting workflow submission on %s: %s", msg.subject, err.message)
        parts = msg.subject.split(".")
        wf_id = (msg.headers or {}).get(protocol.HDR_MSG_ID, "")
        ns = parts[2] if len(parts) > 2 else ""
        kind: Literal["fanout", "chain"] = "fanout"
        with contextlib.suppress(Exception):
            if json.loads(msg.data).get("kind") == "chain":
                kind = "chain"
        with contextlib.suppress(Exception):
            await msg.term()
        try:
            protocol.validate_workflow_id(wf_id)
            protocol.validate_namespace(ns)
        except ReachError:
            return  # nobody can be waiting for a result without a valid id
        result = WorkflowResult(
            workflow_id=wf_id,
            kind=kind,
            state=TaskState.FAILED,
            error=ErrorBody(code=err.code, message=err.message, details=err.details),
            hub_id=self.hub_id,
            finished_at=time.time(),
        )
        with contextlib.suppress(Exception):
            await self._store_result(ns, result, headers)
        if self._metrics is not None:
            self._metrics.workflow_total.labels(kind, TaskState.FAILED.value).inc()

    async def _keepalive(self, msg: Msg) -> None:
        interval = self._settings.workflow_ack_wait / 3
        while True:
            await asyncio.sleep(interval)
            with contextlib.suppress(Exception):
                await msg.in_progress()

    async def _complete(self, wf: _Workflow, result: WorkflowResult, msg: Msg) -> None:
        try:
            await self._store_result(wf.ns, result, wf.headers)
        except Exception as err:
            log.warning("cannot store result of workflow %s: %r", wf.id, err)
            with contextlib.suppress(Exception):
                await msg.nak(delay=1.0)
            return
        with contextlib.suppress(Exception):
            await msg.ack()
        self.workflows_done += 1
        if self._metrics is not None:
            self._metrics.workflow_total.labels(wf.spec.kind, result.state.value).inc()
            self._metrics.workflow_duration_seconds.labels(wf.spec.kind).observe(
                result.duration_ms / 1000
            )

    async def _store_result(self, ns: str, result: WorkflowResult, headers: dict[str, str]) -> None:
        assert self._wf_kv is not None
        record = WorkflowRecord(
            state=result.state,
            owner=self.hub_id,
            trace_id=result.trace_id,
            submitted_at=result.submitted_at,
            result=result,
        )
        body = protocol.encode(result)
        await asyncio.gather(
            self._wf_kv.put(protocol.workflow_key(ns, result.workflow_id), protocol.encode(record)),
            self._js.publish(
                protocol.wf_done(ns, result.workflow_id),
                body,
                headers=inject(dict(headers)),
                stream=protocol.STREAM_WF_EVENTS,
            ),
        )

    # ------------------------------------------------------------------ running

    async def _run(self, wf: _Workflow) -> WorkflowResult:
        assert self._wf_kv is not None
        key = protocol.workflow_key(wf.ns, wf.id)
        start = protocol.encode(
            WorkflowRecord(
                spec=wf.spec, owner=self.hub_id, trace_id=wf.trace_id, submitted_at=wf.submitted_at
            )
        )
        # One write for a new workflow; only an existing record (a takeover, or a re-submit
        # after the dedup window) costs a read.
        try:
            await self._wf_kv.create(key, start)
        except KeyWrongLastSequenceError:
            existing = await _get(self._wf_kv, key)
            rec: WorkflowRecord | None = None
            if existing is not None:
                with contextlib.suppress(ValidationError):
                    rec = WorkflowRecord.model_validate_json(existing[0])
            if rec is not None and rec.result is not None and rec.state.final:
                return rec.result  # finished before: never run again
            await self._wf_kv.put(key, start)  # take the workflow over
        t0 = time.time()
        with span(
            SPAN_WORKFLOW,
            kind=SpanKind.INTERNAL,
            parent_headers=wf.headers,
            attributes={
                "reach.workflow_id": wf.id,
                "reach.workflow.kind": wf.spec.kind,
                "reach.workflow.steps": len(wf.spec.steps),
            },
        ) as sp:
            self._event(wf, WorkflowEvent(workflow_id=wf.id, kind="start", state=TaskState.RUNNING))
            if wf.spec.kind == "fanout":
                result = await self._fanout(wf)
            else:
                result = await self._chain(wf)
            if sp.is_recording():
                sp.set_attribute("reach.workflow.state", result.state.value)
        result.trace_id = wf.trace_id
        result.hub_id = self.hub_id
        result.submitted_at = wf.submitted_at
        result.finished_at = time.time()
        result.duration_ms = round((result.finished_at - min(t0, wf.submitted_at)) * 1000, 3)
        return result

    async def _fanout(self, wf: _Workflow) -> WorkflowResult:
        spec = wf.spec
        tasks = {
            asyncio.create_task(self._step(wf, i, s, s.payload)): i
            for i, s in enumerate(spec.steps)
        }
        pending = set(tasks)
        succeeded = failed = 0
        first_error: TaskRecord | None = None
        n = len(spec.steps)
        try:
            while pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for t in done:
                    rec = self._record_of(wf, tasks[t], t)
                    if rec.state is TaskState.SUCCEEDED:
                        succeeded += 1
                    else:
                        failed += 1
                        first_error = first_error or rec
                if spec.policy != "all" and (succeeded >= wf.need or n - failed < wf.need):
                    break
        finally:
            for t in pending:
                t.cancel()
            if pending:
                await asyncio.gather(*pending, return_exceptions=True)
        if pending:
            await asyncio.gather(
                *(self._cancel_step(wf, tasks[t]) for t in pending), return_exceptions=True
            )
        if succeeded >= wf.need:
            state = TaskState.SUCCEEDED
        elif first_error is not None and all(
            r.state is TaskState.TIMEOUT
            for r in wf.records.values()
            if r.state.final and r.state is not TaskState.SUCCEEDED
        ):
            state = TaskState.TIMEOUT
        else:
            state = TaskState.FAILED
        steps = self._step_results(wf)
        return WorkflowResult(
            workflow_id=wf.id,
            kind="fanout",
            policy=spec.policy,
            state=state,
            steps=steps,
            result=[s.result if s.ok else None for s in steps],
            error=None
            if state is TaskState.SUCCEEDED or first_error is None
            else _step_error(first_error),
        )

    async def _chain(self, wf: _Workflow) -> WorkflowResult:
        spec = wf.spec
        previous: Any = None
        state = TaskState.SUCCEEDED
        error: ErrorBody | None = None
        for i, step in enumerate(spec.steps):
            payload = step.payload if i == 0 else merge_payload(previous, step.payload)
            rec = await self._step(wf, i, step, payload)
            wf.records[i] = rec
            if rec.state is not TaskState.SUCCEEDED:
                state = rec.state if rec.state.final else TaskState.FAILED
                error = _step_error(rec)
                break
            previous = rec.result
        steps = self._step_results(wf)
        return WorkflowResult(
            workflow_id=wf.id,
            kind="chain",
            state=state,
            steps=steps,
            result=previous if state is TaskState.SUCCEEDED else None,
            error=error,
        )

    def _record_of(self, wf: _Workflow, index: int, task: asyncio.Task[TaskRecord]) -> TaskRecord:
        exc = task.exception()
        if isinstance(exc, _NotOwnerError):
            raise exc
        if exc is not None:
            log.error("step %d of workflow %s crashed", index, wf.id, exc_info=exc)
            err = InternalError(f"step crashed: {type(exc).__name__}: {exc}")
            rec = TaskRecord(
                task_id=step_task_id(wf.id, index, wf.spec.steps[index]),
                workflow_id=wf.id,
                step=index,
                namespace=wf.ns,
                state=TaskState.FAILED,
                error=ErrorBody(code=err.code, message=err.message),
            )
        else:
            rec = task.result()
        wf.records[index] = rec
        return rec

    def _step_results(self, wf: _Workflow) -> list[StepResult]:
        out: list[StepResult] = []
        for i, step in enumerate(wf.spec.steps):
            rec = wf.records.get(i)
            if rec is None:
                out.append(
                    StepResult(
                        index=i,
                        task_id=step_task_id(wf.id, i, step),
                        state=TaskState.PENDING,
                        cancelled=True,
                    )
                )
                continue
            out.append(
                StepResult(
                    index=i,
                    task_id=rec.task_id,
                    state=rec.state,
                    agent_id=rec.agent_id,
                    attempts=rec.attempt,
                    result=rec.result,
                    error=rec.error,
                    cancelled=rec.cancelled,
                    cached=rec.cached,
                    stale=rec.stale,
                    duration_ms=rec.duration_ms,
                    started_at=rec.created_at or None,
                    finished_at=rec.updated_at if rec.state.final else None,
                )
            )
        return out

    async def _cancel_step(self, wf: _Workflow, index: int) -> None:
        """Mark a branch the policy no longer needs: agents drop its undelivered attempts."""
        assert self._tasks_kv is not None
        step = wf.spec.steps[index]
        key = protocol.task_key(wf.ns, step_task_id(wf.id, index, step))
        got = await _get(self._tasks_kv, key)
        if got is None:
            return
        rec = TaskRecord.model_validate_json(got[0])
        if rec.state.final:
            wf.records[index] = rec
            return
        rec.cancelled = True
        rec.updated_at = time.time()
        wf.records[index] = rec
        with contextlib.suppress(Exception):
            await self._tasks_kv.update(key, protocol.encode(rec), last=got[1])
        self._forget(key, rec.attempt)
        if rec.agent_id is not None and rec.attempt > 0:
            # Stop a handler that is already running (best effort: the fence above already
            # makes its result irrelevant; this frees the agent's slot sooner).
            body = protocol.dumps({"op": "cancel", "task_id": rec.task_id, "attempt": rec.attempt})
            with contextlib.suppress(Exception):
                await self._nc.request(protocol.agent_ctl(rec.agent_id), body, timeout=1.0)

    # ------------------------------------------------------------------ one step

    def _policy(self, step: StepSpec) -> _Policy:
        s, r = self._settings, step.retry
        return _Policy(
            retries=s.step_retries if r.retries is None else r.retries,
            fast_attempts=s.step_fast_attempts if r.fast_attempts is None else r.fast_attempts,
            base=r.backoff_base or s.retry_base,
            cap=r.backoff_cap or s.retry_cap,
            pending_interval=r.pending_interval or s.pending_interval,
            ttl=r.ttl or s.task_ttl,
            deliver_timeout=r.deliver_timeout or s.step_deliver_timeout,
            silence_timeout=r.silence_timeout or s.step_silence_timeout,
        )

    async def _step(self, wf: _Workflow, index: int, step: StepSpec, payload: Any) -> TaskRecord:
        assert self._tasks_kv is not None
        loop = asyncio.get_running_loop()
        ns = wf.ns
        task_id = step_task_id(wf.id, index, step)
        key = protocol.task_key(ns, task_id)
        pol = self._policy(step)
        route = RouteRequest(
            agent_id=step.agent_id,
            capability=step.capability,
            selector=step.selector,
            strategy=step.strategy,
        )
        # Fast path: choose an agent and create the record with attempt 1 in one write. A
        # record that exists already (a hub taking the workflow over) is read instead.
        view, capability = await self._choose(route, ns, set())
        # Why the step waits when matching agents exist but take no steps (in the TIMEOUT).
        no_work = self._no_work_reason(route, ns) if view is None else None
        now = time.time()
        rec = TaskRecord(
            task_id=task_id,
            workflow_id=wf.id,
            step=index,
            namespace=ns,
            created_at=now,
            updated_at=now,
        )
        if view is not None:
            rec.attempt = 1
            rec.agent_id = view.agent_id
            rec.history = [AttemptRecord(attempt=1, agent_id=view.agent_id)]
        fresh = True
        try:
            rev = await self._tasks_kv.create(key, protocol.encode(rec))
        except BaseException as err:
            if view is not None:
                view.outstanding = max(0, view.outstanding - 1)
                view = None
            if not isinstance(err, KeyWrongLastSequenceError):
                raise
            fresh = False
            got = await _get(self._tasks_kv, key)
            if got is None:
                raise _NotOwnerError(key) from err
            rec = TaskRecord.model_validate_json(got[0])
            rev = got[1]
        if rec.state.final or rec.cancelled:
            return rec  # finished before a takeover: never run again
        ttl_left = rec.created_at + pol.ttl - time.time()
        deadline = min(wf.deadline, loop.time() + max(0.0, ttl_left))
        exclude: set[str] = set()
        track: _Track | None = None
        with span(
            SPAN_STEP,
            kind=SpanKind.INTERNAL,
            attributes={"reach.task_id": task_id, "reach.step": index},
        ) as sp:
            try:
                outcome: tuple[Outcome, TaskStatusEvent | None] | None = None
                if fresh and view is not None:
                    track = self._new_track(key, rec, sp, view)
                    outcome = await self._attempt(
                        wf, index, step, rec, capability, payload, track, pol, deadline
                    )
                elif fresh:
                    outcome = ("nomatch", None)
                elif rec.attempt > 0 and rec.agent_id is not None:
                    # Taken over mid-attempt: adopt it instead of sending it again.
                    track = self._new_track(key, rec, sp)
                    last = await self._last_status(ns, task_id)
                    if last is not None and last.attempt == rec.attempt:
                        self._apply(track, last)
                    outcome = await self._watch(track, pol, deadline)
                while True:
                    if outcome is None:
                        if loop.time() >= deadline:
                            return await self._finish(
                                key, rec, rev, track, None, pol, reason=no_work
                            )
                        view, capability = await self._choose(route, ns, exclude)
                        no_work = self._no_work_reason(route, ns) if view is None else None
                        if view is None:
                            outcome = ("nomatch", None)
                        else:
                            rec.attempt += 1
                            rec.agent_id = view.agent_id
                            rec.state = TaskState.PENDING
                            rec.history = [
                                *rec.history[-_HISTORY + 1 :],
                                AttemptRecord(attempt=rec.attempt, agent_id=view.agent_id),
                            ]
                            rec.updated_at = time.time()
                            if track is not None:
                                self._retire(track)
                            try:
                                rev = await self._cas(key, rec, rev)
                            except BaseException:
                                view.outstanding = max(0, view.outstanding - 1)
                                raise
                            track = self._new_track(key, rec, sp, view)
                            if rec.attempt > 1:
                                self.retry_total += 1
                                if self._metrics is not None:
                                    self._metrics.retry_total.inc()
                            outcome = await self._attempt(
                                wf, index, step, rec, capability, payload, track, pol, deadline
                            )
                    assert outcome is not None
                    kind, event = outcome
                    outcome = None
                    if kind == "final" and event is not None:
                        if rec.history:
                            rec.history[-1].state = event.state
                            rec.history[-1].code = event.error.code if event.error else None
                        if event.state is TaskState.SUCCEEDED or not _retryable(event):
                            return await self._finish(key, rec, rev, track, event, pol, wf=wf)
                        rec.handler_failures += 1
                        if rec.handler_failures > pol.retries:
                            return await self._finish(key, rec, rev, track, event, pol, wf=wf)
                        if rec.agent_id is not None and step.agent_id is None:
                            exclude.add(rec.agent_id)
                        delay = _backoff(rec.handler_failures, pol.base, pol.cap)
                    elif kind == "deadline":
                        return await self._finish(
                            key, rec, rev, track, None, pol, wf=wf, reason=no_work
                        )
                    else:
                        # Not delivered / agent lost / no agent: safe to send elsewhere.
                        rec.delivery_failures += 1
                        if kind != "nomatch" and rec.history:
                            rec.history[-1].code = kind
                        if rec.agent_id is not None and step.agent_id is None:
                            exclude.add(rec.agent_id)
                        if rec.delivery_failures <= pol.fast_attempts:
                            delay = _backoff(rec.delivery_failures, pol.base, pol.cap)
                        else:
                            delay = pol.pending_interval
                            exclude.clear()  # slow phase: any suitable agent again
                    if track is not None:
                        self._retire(track)
                        track = None
                    remaining = deadline - loop.time()
                    if remaining > 0:
                        self._pending_delta(1)
                        try:
                            await asyncio.sleep(min(delay, remaining))
                        finally:
                            self._pending_delta(-1)
            finally:
                if track is not None:
                    self._retire(track)

    async def _attempt(
        self,
        wf: _Workflow,
        index: int,
        step: StepSpec,
        rec: TaskRecord,
        capability: str | None,
        payload: Any,
        track: _Track,
        pol: _Policy,
        deadline: float,
    ) -> tuple[Outcome, TaskStatusEvent | None]:
        """Send the current attempt (its record is written) and watch it to an outcome."""
        await self._send(wf, index, step, rec, capability, payload)
        self._event(
            wf,
            WorkflowEvent(
                workflow_id=wf.id,
                kind="step",
                state=TaskState.PENDING,
                step=index,
                task_id=rec.task_id,
                attempt=rec.attempt,
                agent_id=rec.agent_id,
            ),
        )
        return await self._watch(track, pol, deadline)

    async def _choose(
        self, route: RouteRequest, ns: str, exclude: set[str]
    ) -> tuple[AgentView | None, str | None]:
        if route.agent_id is not None and route.agent_id not in self._registry.agents:
            await self._registry.fetch(route.agent_id)
        for tried in (exclude, set()):
            skip = frozenset(tried | self._no_work)
            while True:
                try:
                    choice = self._router.decide(route, ns, "wf", exclude=skip)
                except NoMatchError:
                    break  # retry without ``tried``: better an agent that failed before
                view = choice.view
                if not view.record.card.durable_work:
                    # Not known yet (registered before this engine listened): skip it.
                    self._no_work.add(view.agent_id)
                    skip = skip | {view.agent_id}
                    continue
                # Count it now, before any await: concurrent branches see the load at once.
                view.outstanding += 1
                return view, choice.capability
            if not tried:
                break
        return None, None

    def _no_work_reason(self, route: RouteRequest, ns: str) -> str | None:
        """Which agents matching ``route`` were passed over for having no durable work
        consumer, as a sentence for the step's error; None when that is not why."""
        if not self._no_work:
            return None
        if route.agent_id is not None:
            ids: set[str] | frozenset[str] = {route.agent_id}
        elif route.capability is not None:
            ids = self._registry.index.by_capability(route.capability)
        elif route.selector is not None:
            try:
                ids = self._registry.index.candidates(Selector.parse(route.selector))
            except ReachError:
                return None
        else:
            return None
        skipped = sorted(
            a
            for a in ids & self._no_work
            if (v := self._registry.agents.get(a)) is not None and v.record.card.namespace == ns
        )
        if not skipped:
            return None
        more = f" and {len(skipped) - 5} more" if len(skipped) > 5 else ""
        return f"not offered to {', '.join(skipped[:5])}{more}: registered with durable_work=false"

    async def _send(
        self,
        wf: _Workflow,
        index: int,
        step: StepSpec,
        rec: TaskRecord,
        capability: str | None,
        payload: Any,
    ) -> None:
        assert rec.agent_id is not None
        env = TaskEnvelope(
            task_id=rec.task_id,
            attempt=rec.attempt,
            capability=capability,
            payload=payload,
            namespace=wf.ns,
            timeout=step.timeout,
            workflow_id=wf.id,
            step=index,
            track=True,
        )
        headers = inject({})
        headers[protocol.HDR_MSG_ID] = protocol.attempt_msg_id(rec.task_id, rec.attempt)
        await self._js.publish(
            protocol.work_subject(wf.ns, rec.agent_id),
            protocol.encode(env),
            headers=headers,
            stream=protocol.STREAM_WORK,
        )

    async def _finish(
        self,
        key: str,
        rec: TaskRecord,
        rev: int,
        track: _Track | None,
        event: TaskStatusEvent | None,
        pol: _Policy,
        *,
        wf: _Workflow | None = None,
        reason: str | None = None,
    ) -> TaskRecord:
        if event is None:
            rec.state = TaskState.TIMEOUT
            last = track.machine.state.value if track is not None else TaskState.PENDING.value
            err = MeshTimeoutError(
                f"step {rec.step} ({rec.task_id}) did not finish in time "
                f"(last state {last}, attempt {rec.attempt})" + (f"; {reason}" if reason else ""),
                task_id=rec.task_id,
                attempt=rec.attempt,
            )
            rec.error = ErrorBody(code=err.code, message=err.message, details=err.details)
            if rec.history:
                rec.history[-1].state = TaskState.TIMEOUT
        else:
            rec.state = event.state
            rec.result = event.result
            rec.error = event.error
            rec.cached = event.cached
            rec.duration_ms = event.duration_ms
            if event.cached:
                self.duplicate_total += 1
                if self._metrics is not None:
                    self._metrics.duplicate_delivery_total.inc()
        if track is not None:
            rec.stale += track.stale
            self._retire(track, superseded=False)  # the deciding attempt, not a stale one
        rec.updated_at = time.time()
        await self._cas(key, rec, rev)
        self._forget(key, rec.attempt)
        if wf is not None:
            self._event(
                wf,
                WorkflowEvent(
                    workflow_id=wf.id,
                    kind="step",
                    state=rec.state,
                    step=rec.step,
                    task_id=rec.task_id,
                    attempt=rec.attempt,
                    agent_id=rec.agent_id,
                    error=rec.error,
                ),
            )
        return rec

    async def _cas(self, key: str, rec: TaskRecord, rev: int) -> int:
        assert self._tasks_kv is not None
        try:
            return int(await self._tasks_kv.update(key, protocol.encode(rec), last=rev))
        except KeyWrongLastSequenceError as err:
            raise _NotOwnerError(key) from err

    # ------------------------------------------------------------------ watching an attempt

    def _new_track(
        self, key: str, rec: TaskRecord, sp: Span, view: AgentView | None = None
    ) -> _Track:
        assert rec.agent_id is not None
        loop_now = asyncio.get_running_loop().time()

        def on_transition(old: TaskState, new: TaskState) -> None:
            if sp.is_recording():
                sp.add_event(new.value, {"reach.attempt": rec.attempt, "reach.from": old.value})

        track = _Track(
            key=key,
            task_id=rec.task_id,
            namespace=rec.namespace,
            attempt=rec.attempt,
            agent_id=rec.agent_id,
            machine=AckMachine(on_transition=on_transition),
            dispatched_at=loop_now,
            last_event=loop_now,
            view=view,
        )
        self._tracks[key] = track
        return track

    def _retire(self, track: _Track, *, superseded: bool = True) -> None:
        """Stop tracking an attempt; a superseded one is remembered so its late result is
        recognised as stale."""
        if self._tracks.get(track.key) is track:
            del self._tracks[track.key]
            if superseded:
                self._remember(track.key, track.attempt, final=False)
        if track.view is not None:
            track.view.outstanding = max(0, track.view.outstanding - 1)
            track.view = None

    def _forget(self, key: str, attempt: int) -> None:
        self._remember(key, attempt, final=True)

    def _remember(self, key: str, attempt: int, *, final: bool) -> None:
        # A superseded attempt is remembered as "current = attempt + 1" so that its late
        # result is recognised as stale even after the step finished.
        self._recent[key] = attempt if final else attempt + 1
        self._recent.move_to_end(key)
        while len(self._recent) > _RECENT:
            self._recent.popitem(last=False)

    async def _watch(
        self, track: _Track, pol: _Policy, deadline: float
    ) -> tuple[Outcome, TaskStatusEvent | None]:
        loop = asyncio.get_running_loop()
        while True:
            if track.final is not None:
                return "final", track.final
            if track.lost:
                return "lost", None
            now = loop.time()
            if now >= deadline:
                return "deadline", None
            if track.machine.state is TaskState.PENDING:
                wait_until = track.dispatched_at + pol.deliver_timeout
            else:
                wait_until = track.last_event + pol.silence_timeout
            timeout = min(wait_until, deadline) - now
            if timeout <= 0:
                verdict = await self._probe(track)
                if track.final is not None:
                    continue
                if verdict == "alive":
                    # The agent has it (we missed DELIVERED, or it is queued for a slot).
                    track.machine.catch_up(TaskState.DELIVERED)
                    track.last_event = track.dispatched_at = loop.time()
                    continue
                if verdict == "lost" or track.machine.state is TaskState.PENDING:
                    return (
                        "undelivered" if track.machine.state is TaskState.PENDING else "lost"
                    ), None
                track.last_event = loop.time()
                continue
            track.changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(track.changed.wait(), timeout)

    async def _probe(self, track: _Track) -> str:
        """Silence: read the status stream, then ask the agent. ``alive``/``lost``/``done``."""
        last = await self._last_status(track.namespace, track.task_id)
        if last is not None and last.attempt == track.attempt:
            self._apply(track, last)
            if track.final is not None:
                return "done"
        try:
            msg = await self._nc.request(
                protocol.agent_ctl(track.agent_id),
                protocol.dumps({"op": "task_state", "task_id": track.task_id}),
                timeout=_CTL_TIMEOUT,
            )
        except NoRespondersError:
            return "lost"
        except (NatsTimeoutError, TimeoutError):
            # A busy agent may answer late: its lease decides (LOST re-routes at once).
            view = self._registry.agents.get(track.agent_id)
            return "alive" if view is not None and view.state is not AgentState.LOST else "lost"
        try:
            body = json.loads(msg.data)
        except ValueError:
            return "lost"
        if not isinstance(body, dict) or "error" in body:
            return "lost"
        state = body.get("state")
        attempt = body.get("attempt")
        if state in (TaskState.SUCCEEDED, TaskState.FAILED, TaskState.TIMEOUT):
            if attempt == track.attempt:
                with contextlib.suppress(ValidationError):
                    event = TaskStatusEvent.model_validate(
                        {**body, "agent_id": track.agent_id, "task_id": track.task_id}
                    )
                    self._apply(track, event)
                    return "done"
            return "lost"
        running = (TaskState.DELIVERED, TaskState.ACCEPTED, TaskState.RUNNING)
        if state in running and (attempt is None or attempt >= track.attempt):
            return "alive"
        return "lost"

    async def _last_status(self, ns: str, task_id: str) -> TaskStatusEvent | None:
        try:
            raw = await self._js.get_last_msg(
                protocol.STREAM_STATUS, protocol.task_status(ns, task_id)
            )
        except NotFoundError:
            return None
        except Exception:
            log.debug("cannot read the last status of %s", task_id, exc_info=True)
            return None
        if not raw.data:
            return None
        try:
            return TaskStatusEvent.model_validate_json(raw.data)
        except ValidationError:
            return None

    def _apply(self, track: _Track, event: TaskStatusEvent) -> None:
        if track.final is not None:
            return
        if not track.machine.catch_up(event.state):
            return  # a repeat or an out-of-order older state
        track.last_event = asyncio.get_running_loop().time()
        if event.state.final:
            track.final = event
        track.changed.set()

    # ------------------------------------------------------------------ subscriptions

    async def _on_status(self, msg: Msg) -> None:
        # On the subscription's reader: no awaits, no I/O — dictionary lookups and a parse.
        parts = msg.subject.split(".")
        if len(parts) != 5:
            return
        key = protocol.task_key(parts[2], parts[3])
        track = self._tracks.get(key)
        if track is None:
            current = self._recent.get(key)
            if current is None:
                return  # not ours (another hub's workflow, or a request-reply task)
            event = _parse_status(msg.data)
            if event is not None and event.state.final and event.attempt != current:
                self._stale(key, event)
            return
        event = _parse_status(msg.data)
        if event is None:
            return
        if self.status_filter is not None and not self.status_filter(event):
            return
        if event.attempt != track.attempt or event.agent_id != track.agent_id:
            if event.state.final:
                track.stale += 1
                self._stale(key, event)
            return
        self._apply(track, event)

    def _stale(self, key: str, event: TaskStatusEvent) -> None:
        self.stale_total += 1
        log.warning(
            "stale %s from %s for %s attempt %d rejected (fenced)",
            event.state.value,
            event.agent_id,
            event.task_id,
            event.attempt,
        )

    def _on_agent_state(self, view: AgentView, old: AgentState, new: AgentState) -> None:
        if new is AgentState.LOST or view.record.card.durable_work:
            self._no_work.discard(view.agent_id)
        else:
            self._no_work.add(view.agent_id)
        if new is not AgentState.LOST:
            return
        for track in self._tracks.values():
            if track.agent_id == view.agent_id and track.final is None:
                track.lost = True
                track.changed.set()

    # ------------------------------------------------------------------ events

    def _event(self, wf: _Workflow, event: WorkflowEvent) -> None:
        task = asyncio.ensure_future(
            self._nc.publish(
                protocol.wf_event(wf.ns, wf.id),
                protocol.encode(event),
                headers=inject(dict(wf.headers)),
            )
        )
        self._bg.add(task)
        task.add_done_callback(self._bg_done)

    def _bg_done(self, task: asyncio.Task[Any]) -> None:
        self._bg.discard(task)
        if not task.cancelled():
            task.exception()

    def _pending_delta(self, delta: int) -> None:
        self._pending += delta
        if self._metrics is not None:
            self._metrics.pending_count.set(self._pending)


# --------------------------------------------------------------------------- helpers


async def _get(kv: KeyValue, key: str) -> tuple[bytes, int] | None:
    try:
        entry = await kv.get(key)
    except KeyNotFoundError:
        return None
    if not entry.value:
        return None
    return entry.value, int(entry.revision or 0)


def _parse_status(data: bytes) -> TaskStatusEvent | None:
    try:
        return TaskStatusEvent.model_validate_json(data)
    except ValidationError:
        return None


def _retryable(event: TaskStatusEvent) -> bool:
    if event.state is TaskState.TIMEOUT:
        return True
    err = event.error
    if err is None:
        return True
    return err.details.get("retryable", True) is not False


def _backoff(n: int, base: float, cap: float) -> float:
    """base * 2**(n-1), capped, with equal jitter (half fixed, half random)."""
    d = float(min(cap, base * float(2 ** max(0, n - 1))))
    return d / 2 + random.uniform(0, d / 2)


def _step_error(rec: TaskRecord) -> ErrorBody:
    if rec.error is not None:
        return rec.error
    return ErrorBody(code=ReachError.code, message=f"step {rec.step} ended {rec.state.value}")
