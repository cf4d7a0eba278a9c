"""The workflow engine: durable fanout and chain over JetStream, run by whichever hub owns them.

Ownership: every hub pulls submissions (``reach.wf.<ns>.submit``) from one shared durable
consumer and keeps the message in progress (``+WPI``) while the workflow runs; it acks after the
result is stored. A hub that dies stops sending ``+WPI``; after ``workflow_ack_wait`` JetStream
redelivers the submission to another hub, which resumes from the task records in KV: finished
steps are not run again, an attempt still in flight is adopted (its status events, the last one
read back from the ``REACH_STATUS`` stream), and only unfinished work is dispatched.

One source of truth: the workflow record in ``reach_workflows``. Its final write is a CAS on
the owner's revision, and the ``.done`` announcement is published only after it, carrying the
same result. A submission whose id is taken by another spec is refused (terminated).

Steps are run by the base class, :class:`~reach_mesh.hub._steps.StepRunner`: each attempt is
recorded in ``reach_tasks`` (the fence) before it is sent, the first outcome of any attempt
decides the step, and infrastructure errors are retried, never an outcome. See
``docs/workflows.md``.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import time
from collections.abc import Callable
from typing import Any, Final, Literal

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js import JetStreamContext
from nats.js.api import (
    AckPolicy,
    ConsumerConfig,
    DeliverPolicy,
    RetentionPolicy,
    StorageType,
    StreamConfig,
)
from nats.js.errors import KeyWrongLastSequenceError

from reach_mesh import protocol
from reach_mesh._consume import PullConsumer, ensure_stream, ensure_task_resources
from reach_mesh._guard import guarded
from reach_mesh._jspub import JsClient, kv_subject
from reach_mesh._nats import ensure_kv
from reach_mesh.config import MeshSettings
from reach_mesh.errors import (
    InternalError,
    ReachError,
    WorkflowSpecError,
)
from reach_mesh.hub import _durable
from reach_mesh.hub._steps import NotOwnerError, StepRunner, Workflow
from reach_mesh.hub._tracking import StatusTracker
from reach_mesh.hub.registry import AgentView, Registry
from reach_mesh.hub.router import Router
from reach_mesh.models import AgentState, ErrorBody, TaskState
from reach_mesh.tracing import SPAN_WORKFLOW, SpanKind, inject, span, trace_id_from_headers
from reach_mesh.workflow import (
    StepResult,
    TaskRecord,
    TaskStatusEvent,
    WorkflowEvent,
    WorkflowRecord,
    WorkflowResult,
    WorkflowSpec,
    merge_payload,
    spec_digest,
    step_task_id,
    stored_record,
    validate_spec,
)

__all__ = ["WorkflowEngine"]

log = logging.getLogger("reach_mesh.hub.workflows")

_TRACE_HEADERS: Final = frozenset({"traceparent", "tracestate", "baggage"})


class _ConflictError(Exception):
    """The workflow id is taken by a submission with another spec."""


class WorkflowEngine(StepRunner):
    """Runs the workflows this hub owns. Started and stopped by :class:`~reach_mesh.hub.Hub`.

    ``metrics`` (a :class:`~reach_mesh.tracing.metrics.HubMetrics`) is optional; when given,
    ``workflow_total``, ``workflow_duration_seconds``, ``retry_total``,
    ``duplicate_delivery_total``, ``infra_retry_total``, ``stale_result_total`` and
    ``pending_tasks`` are kept.
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
        self._wf_kv: _durable.Bucket | None = None
        self._tasks_kv: _durable.Bucket | None = None
        #: Acked JetStream writes of the engine (KV compare-and-sets, work, ``.done``).
        self._jsc = JsClient(nc)
        self._pull: PullConsumer | None = None
        self._status_sub: Subscription | None = None
        self._tracker = StatusTracker(
            nc,
            self._jsc,
            registry,
            on_stale=None if metrics is None else metrics.stale_result_total.inc,
        )
        self._running: dict[asyncio.Task[None], Msg] = {}
        self._ticker: asyncio.Task[None] | None = None
        self._bg: set[asyncio.Future[Any]] = set()
        self._pending = 0
        self._stopping = False
        #: Final answers that came from an agent's idempotency cache (a duplicate delivery).
        self.duplicate_total = 0
        #: Attempts after the first.
        self.retry_total = 0
        #: JetStream operations repeated after an infrastructure error (never an outcome).
        self.infra_retry_total = 0
        #: Submissions refused because their workflow id was taken by another spec.
        self.conflict_total = 0
        self.workflows_done = 0
        #: Agents registered with ``durable_work=False`` (no work consumer): never offered a
        #: step. Kept from state changes so choosing a step does not scan the registry.
        self._no_work: set[str] = set()

    @property
    def stale_total(self) -> int:
        """Final statuses not applied: from an attempt or agent the step did not send to, or
        arriving after the step was decided (a duplicate run)."""
        return self._tracker.stale_total

    @property
    def forged_total(self) -> int:
        """Status events refused because their body spoke for another agent than the one
        their subject names (docs/security.md)."""
        return self._tracker.forged_total

    @property
    def status_filter(self) -> Callable[[TaskStatusEvent], bool] | None:
        """Test seam (fault injection): return False to drop a status event as if lost."""
        return self._tracker.status_filter

    @status_filter.setter
    def status_filter(self, value: Callable[[TaskStatusEvent], bool] | None) -> None:
        self._tracker.status_filter = value

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
                description="reach-mesh workflow submissions (dedup on <ns>.<workflow_id>)",
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
        await self._jsc.start()
        tasks = await ensure_task_resources(js, s)
        self._tasks_kv = _durable.Bucket(protocol.KV_TASKS, tasks, self._jsc)
        records = await ensure_kv(
            js,
            protocol.KV_WORKFLOWS,
            replicas=s.kv_replicas,
            ttl=s.workflow_retention,
            description="reach-mesh workflow records",
        )
        self._wf_kv = _durable.Bucket(protocol.KV_WORKFLOWS, records, self._jsc)
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
        statuses = protocol.task_status("*.*.*", "*")
        self._status_sub = await self._nc.subscribe(
            statuses, cb=guarded(statuses, self._on_status, answers=False), pending_msgs_limit=-1
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
        self._ticker = asyncio.create_task(self._keepalive(), name="reach-workflow-keepalive")

    async def stop(self) -> None:
        """Stop pulling; hand every running workflow back (nak) so another hub resumes it."""
        self._stopping = True
        if self._pull is not None:
            await self._pull.stop()
        if self._ticker is not None:
            self._ticker.cancel()
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
        with contextlib.suppress(Exception):
            await self._jsc.stop()

    @property
    def running(self) -> int:
        """Workflows this hub owns right now."""
        return len(self._running)

    @property
    def owned(self) -> list[tuple[str, str]]:
        """(namespace, workflow id) of the workflows this hub runs right now."""
        out = []
        for msg in self._running.values():
            msg_id = (msg.headers or {}).get(protocol.HDR_MSG_ID)
            if msg_id:
                out.append((msg.subject.split(".")[2], protocol.workflow_id_of(msg_id)))
        return out

    @property
    def pending(self) -> int:
        """Steps of this hub's workflows waiting for an agent (PENDING) right now."""
        return self._pending

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
        except Exception as err:
            # A check that raised instead of refusing: still this submission's fault, and it
            # must end here (termed), not come back forever holding an ack slot.
            log.warning("workflow submission on %s not admitted: %r", msg.subject, err)
            bad = WorkflowSpecError(f"invalid workflow: {type(err).__name__}: {str(err)[:200]}")
            await self._reject(msg, headers, bad)
            return
        try:
            result, stored = await self._run(wf)
            if not stored:
                result = await self._store(wf, result)
            await self._publish_done(wf, result)
        except NotOwnerError:
            if await self._still_owner(wf):
                # A task record moved under us while the workflow record is still ours: a hub
                # that lost the workflow wrote it (it woke up, or outlived its consumer through
                # an election). Nobody would resume the workflow before the ack wait: hand it
                # back now, and whoever takes it resumes from the records.
                log.warning("workflow %s: a step's record moved under its owner; resuming", wf.id)
                with contextlib.suppress(Exception):
                    # A moment's delay: a replica behind on that record would only bring the
                    # same conflict straight back.
                    await msg.nak(delay=0.1)
                return
            log.warning("workflow %s was taken over by another hub", wf.id)
            return  # neither ack nor nak: the other hub owns the message now
        except _ConflictError:
            self.conflict_total += 1
            log.warning("workflow %s: submission refused, the id is taken by another spec", wf.id)
            with contextlib.suppress(Exception):
                await msg.term()
            return
        except asyncio.CancelledError:
            raise
        except Exception as err:
            # The infrastructure outlived our retries (NATS down, ...): give the workflow back;
            # whoever takes it resumes from the records. Never an outcome.
            log.warning("workflow %s interrupted: %r", wf.id, err)
            with contextlib.suppress(Exception):
                await msg.nak(delay=1.0)
            return
        # The result is stored and announced: nothing waits on this ack, so it rides along
        # with the next JetStream write (a lost one only brings the submission back to a hub
        # that finds the result stored and announces it again).
        self._jsc.ack_later(msg)
        if not stored:
            self._count_done(wf.spec.kind, result)

    async def _still_owner(self, wf: Workflow) -> bool:
        """Whether the workflow record is still at the revision this hub last wrote, naming
        this hub (no other hub took the workflow over since). Read from the stream's leader,
        not a replica that may lag. False when it cannot be read."""
        if wf.rev == 0:
            return False  # it lost the takeover itself
        subject = kv_subject(protocol.KV_WORKFLOWS, protocol.workflow_key(wf.ns, wf.id))
        try:
            raw = await self._js.get_last_msg(f"KV_{protocol.KV_WORKFLOWS}", subject)
            record = WorkflowRecord.model_validate_json(raw.data or b"")
        except Exception:
            return False
        return raw.seq == wf.rev and record.owner == self.hub_id

    def _admit(self, msg: Msg, headers: dict[str, str]) -> Workflow:
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
        return Workflow(
            spec=spec,
            need=need,
            deadline=loop.time() + max(0.0, remaining),
            submitted_at=submitted,
            headers=headers,
            trace_id=trace_id_from_headers(headers),
            digest=spec_digest(spec),
        )

    async def _reject(self, msg: Msg, headers: dict[str, str], err: ReachError) -> None:
        """A malformed submission: term it (never redelivered) and, unless the id belongs to a
        workflow already, store and publish a failed result."""
        log.info("rejecting workflow submission on %s: %s", msg.subject, err.message)
        parts = msg.subject.split(".")
        wf_id = protocol.workflow_id_of((msg.headers or {}).get(protocol.HDR_MSG_ID, ""))
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
        assert self._wf_kv is not None
        record = WorkflowRecord(state=result.state, owner=self.hub_id, result=result)
        try:
            await _durable.create(
                self._wf_kv,
                protocol.workflow_key(ns, wf_id),
                protocol.encode(record),
                self._io_deadline(),
                on_retry=self._infra_retry,
            )
            await self._publish_done_raw(ns, result, headers)
        except KeyWrongLastSequenceError:
            # The id is a workflow's already: its own record and result stand.
            self.conflict_total += 1
            return
        except Exception as e:
            log.warning("cannot store the rejection of workflow %s: %r", wf_id, e)
            return
        self._count_done(kind, result)

    async def _keepalive(self) -> None:
        """``+WPI`` for every submission this hub runs, every ``workflow_ack_wait / 3``: one
        loop for all of them."""
        interval = self._settings.workflow_ack_wait / 3
        while True:
            await asyncio.sleep(interval)
            for msg in list(self._running.values()):
                with contextlib.suppress(Exception):
                    await msg.in_progress()

    async def _store(self, wf: Workflow, result: WorkflowResult) -> WorkflowResult:
        """Make ``result`` the workflow's one final state: a CAS on our record. Returns the
        result that is final — ours, or one another hub stored first.

        Events of this workflow still held are dropped first (``_event``): ``result`` (and
        the ``.done`` made of it) says every step's outcome."""
        assert self._wf_kv is not None
        self._take_held(wf)  # dropped: the result says what they would
        key = protocol.workflow_key(wf.ns, wf.id)
        record = WorkflowRecord(
            spec_digest=wf.digest,
            state=result.state,
            owner=self.hub_id,
            trace_id=result.trace_id,
            submitted_at=result.submitted_at,
            result=result,
        )
        try:
            wf.rev = await _durable.cas(
                self._wf_kv,
                key,
                protocol.encode(record),
                wf.rev,
                self._io_deadline(wf.deadline),
                on_retry=self._infra_retry,
            )
        except KeyWrongLastSequenceError as err:
            kv = self._wf_kv
            got = await self._io(f"read {key}", lambda: _durable.get(kv, key), wf.deadline)
            stored = _final_result(got)
            if stored is None:
                raise NotOwnerError(key) from err
            return stored
        return result

    async def _publish_done(self, wf: Workflow, result: WorkflowResult) -> None:
        await self._publish_done_raw(wf.ns, result, wf.headers, deadline=wf.deadline)

    async def _publish_done_raw(
        self,
        ns: str,
        result: WorkflowResult,
        headers: dict[str, str],
        *,
        deadline: float | None = None,
    ) -> None:
        """Announce the stored final result on ``.done``: derived from the record, written
        after it, deduplicated by JetStream (``Nats-Msg-Id = <ns>.<workflow_id>.done``)."""
        out = inject(dict(headers))
        out[protocol.HDR_MSG_ID] = protocol.done_msg_id(ns, result.workflow_id)
        out[protocol.HDR_EXPECTED_STREAM] = protocol.STREAM_WF_EVENTS
        body = protocol.encode(result)
        subject = protocol.wf_done(ns, result.workflow_id)
        await self._io(
            f"publish {subject}",
            lambda: self._jsc.publish(subject, body, out),
            deadline,
        )

    def _count_done(self, kind: str, result: WorkflowResult) -> None:
        self.workflows_done += 1
        if self._metrics is not None:
            self._metrics.workflow_total.labels(kind, result.state.value).inc()
            self._metrics.workflow_duration_seconds.labels(kind).observe(result.duration_ms / 1000)

    # ------------------------------------------------------------------ running

    async def _run(self, wf: Workflow) -> tuple[WorkflowResult, bool]:
        """Run the workflow to its result; ``(result, True)`` when it was final already."""
        assert self._wf_kv is not None
        kv = self._wf_kv
        key = protocol.workflow_key(wf.ns, wf.id)
        # The agents of the attempts sent at once are chosen first: the workflow record names
        # them, so those steps need no task record of their own (see ``TaskRecord``).
        await self._first_choices(wf)
        record = WorkflowRecord(
            spec=wf.spec,
            spec_digest=wf.digest,
            owner=self.hub_id,
            trace_id=wf.trace_id,
            submitted_at=wf.submitted_at,
            first_agents=[None if c is None else c[0].agent_id for c in wf.first],
        )
        wf.first_agents = record.first_agents
        start = protocol.encode(record)
        # One write for a new workflow; only an existing record (a takeover, or a re-submit
        # after the dedup window) costs a read.
        try:
            wf.rev = await _durable.create(
                kv, key, start, self._io_deadline(wf.deadline), on_retry=self._infra_retry
            )
        except BaseException as err:
            self._release_first(wf)
            if not isinstance(err, KeyWrongLastSequenceError):
                raise
            got = await self._io(f"read {key}", lambda: _durable.get(kv, key), wf.deadline)
            rec = stored_record(WorkflowRecord, got)
            if rec is not None and rec.spec_digest not in (None, wf.digest):
                raise _ConflictError(key) from None
            stored = _final_result(got)
            if stored is not None:
                return stored, True  # finished before: never run again
            # Take the workflow over: a CAS, so of two hubs resuming it one wins. Attempts the
            # previous owner sent at the start stay named: their steps adopt them.
            wf.taken_over = True
            wf.first_agents = [] if rec is None else rec.first_agents
            record.first_agents = wf.first_agents
            start = protocol.encode(record)
            try:
                wf.rev = await _durable.cas(
                    kv,
                    key,
                    start,
                    got[1] if got is not None else 0,
                    self._io_deadline(wf.deadline),
                    on_retry=self._infra_retry,
                )
            except KeyWrongLastSequenceError as err:
                raise NotOwnerError(key) from err
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
            self._event(
                wf,
                functools.partial(
                    WorkflowEvent,
                    workflow_id=wf.id,
                    kind="start",
                    state=TaskState.RUNNING,
                    first_agents=wf.first_agents,
                ),
            )
            try:
                if wf.spec.kind == "fanout":
                    result = await self._fanout(wf)
                else:
                    result = await self._chain(wf)
            finally:
                self._release_first(wf)  # choices of steps that never started
            if sp.is_recording():
                sp.set_attribute("reach.workflow.state", result.state.value)
        result.trace_id = wf.trace_id
        result.hub_id = self.hub_id
        result.submitted_at = wf.submitted_at
        result.finished_at = time.time()
        result.duration_ms = round((result.finished_at - min(t0, wf.submitted_at)) * 1000, 3)
        return result, False

    async def _fanout(self, wf: Workflow) -> WorkflowResult:
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
            for t in tasks:  # a branch's error is reported once, by the branch we acted on
                if t.done() and not t.cancelled():
                    t.exception()
        if pending:
            cancelled = await asyncio.gather(
                *(self._cancel_step(wf, tasks[t]) for t in pending), return_exceptions=True
            )
            for err in cancelled:
                if isinstance(err, Exception):
                    raise err  # not an outcome: the workflow goes back to JetStream
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

    async def _chain(self, wf: Workflow) -> WorkflowResult:
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

    def _record_of(self, wf: Workflow, index: int, task: asyncio.Task[TaskRecord]) -> TaskRecord:
        exc = task.exception()
        if isinstance(exc, NotOwnerError | _durable.RetriesExhausted) or (
            exc is not None and _durable.transient(exc)
        ):
            # Not an outcome: the workflow goes back to JetStream and resumes from the records.
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

    def _step_results(self, wf: Workflow) -> list[StepResult]:
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
                    decided_by=rec.decided_by if rec.state.final else None,
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

    async def _cancel_step(self, wf: Workflow, index: int) -> None:
        """Mark a branch the policy no longer needs: agents drop its undelivered attempts."""
        assert self._tasks_kv is not None
        kv = self._tasks_kv
        step = wf.spec.steps[index]
        task_id = step_task_id(wf.id, index, step)
        key = protocol.task_key(wf.ns, task_id)
        got = await self._io(f"read {key}", lambda: _durable.get(kv, key), None)
        if got is not None:
            rec = TaskRecord.model_validate_json(got[0])
        else:
            # No record: its attempt 1, if sent, is the one the workflow record names.
            named = self._named_attempt(wf, index, task_id)
            if named is None:
                return
            rec = named
        if rec.state.final:
            wf.records[index] = rec
            # Cancelled right after its record was written (by the deadline, by an earlier
            # attempt), its markers may be missing: store them (deduplicated).
            await self._remark(wf, rec)
            return
        rec.cancelled = True
        rec.updated_at = time.time()
        wf.records[index] = rec
        with contextlib.suppress(Exception):
            last = 0 if got is None else got[1]
            await _durable.cas(kv, key, protocol.encode(rec), last, self._io_deadline())
        # Every attempt it sent, not only the current one: the branch may have been cancelled
        # between a fence-first record and its marker. A failure here is the workflow's
        # (``_fanout`` raises it): the result must not be stored before the markers are.
        await self._remark(wf, rec)
        if rec.agent_id is not None and rec.attempt > 0:
            self._cancel_attempt(rec.agent_id, rec.task_id, rec.attempt)

    # ------------------------------------------------------------------ subscriptions

    async def _on_status(self, msg: Msg) -> None:
        # On the subscription's reader: no awaits, no I/O — dictionary lookups and a parse.
        self._tracker.on_status(msg)

    def _on_agent_state(self, view: AgentView, old: AgentState, new: AgentState) -> None:
        if new is AgentState.LOST or view.record.card.durable_work:
            self._no_work.discard(view.agent_id)
        else:
            self._no_work.add(view.agent_id)
        if new is AgentState.LOST:
            self._tracker.mark_lost(view.agent_id)


# --------------------------------------------------------------------------- helpers


def _final_result(got: tuple[bytes, int] | None) -> WorkflowResult | None:
    """The stored final result of a workflow record, if it has one."""
    rec = stored_record(WorkflowRecord, got)
    if rec is not None and rec.result is not None and rec.state.final:
        return rec.result
    return None


def _step_error(rec: TaskRecord) -> ErrorBody:
    if rec.error is not None:
        return rec.error
    return ErrorBody(code=ReachError.code, message=f"step {rec.step} ended {rec.state.value}")
