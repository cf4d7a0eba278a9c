"""The workflow engine: durable fanout and chain over JetStream, run by whichever hub owns them.

Ownership: every hub pulls submissions (``reach.wf.<ns>.submit``) from one shared durable
consumer and keeps the message in progress (``+WPI``) while the workflow runs; it acks after the
result is stored. A hub that dies stops sending ``+WPI``; after ``workflow_ack_wait`` JetStream
redelivers the submission to another hub, which resumes from the task records in KV: finished
steps are not run again, an attempt still in flight is adopted (its status events, the last one
read back from the ``REACH_STATUS`` stream), and only unfinished work is dispatched.

One source of truth: the workflow record in ``reach_workflows``. Its final write is a CAS on
the owner's revision, and the ``.done`` announcement (core NATS) is published only after it,
carrying the same result. A submission whose id is taken by another spec is refused (terminated).

A workflow's record and shape (fanout, chain) are run by the base class,
:class:`~reach_mesh.hub._shapes.WorkflowShapes`, and each step by its base,
:class:`~reach_mesh.hub._steps.StepRunner`: each attempt is
recorded in ``reach_tasks`` (the fence) before it is sent, the first outcome of any attempt
decides the step, and infrastructure errors are retried, never an outcome. See
``docs/workflows.md``.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import Callable
from typing import Any, Final

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js import JetStreamContext
from nats.js.errors import KeyWrongLastSequenceError

from reach_mesh import protocol
from reach_mesh._consume import (
    RETENTION_STREAMS,
    PullConsumer,
    ensure_workflow_resources,
    stream_seq,
)
from reach_mesh._guard import guarded_inline
from reach_mesh._inline import subscribe_inline
from reach_mesh._jspub import JsClient
from reach_mesh._nats import flushed
from reach_mesh._nats_asking import Reconnected, or_reconnected, reconnects_of
from reach_mesh._retry import describe
from reach_mesh.config import MeshSettings
from reach_mesh.errors import (
    MeshUnavailableError,
    ReachError,
    WorkflowSpecError,
)
from reach_mesh.hub import _durable
from reach_mesh.hub._resources import Resources
from reach_mesh.hub._shapes import Resubmitted, SpecConflictError, final_result
from reach_mesh.hub._step_state import TooLarge, fit_result, record_bytes
from reach_mesh.hub._steps import REPLACE_BURST, REPLACE_RATE, NotOwnerError, Workflow
from reach_mesh.hub._tracking import StatusTracker
from reach_mesh.hub._wf_keepalive import SubmissionKeepalive
from reach_mesh.hub._wf_reject import WorkflowRefusals
from reach_mesh.hub._work_out import WorkOut
from reach_mesh.hub.registry import AgentView, Registry
from reach_mesh.hub.router import Router
from reach_mesh.hub.shares import Shares
from reach_mesh.hub.throttle import Pacer
from reach_mesh.logs import WORKFLOW_INTERRUPTED, LineBudget, log_event
from reach_mesh.models import AgentState
from reach_mesh.tracing import inject, started_trace
from reach_mesh.tracing.metrics import UNKNOWN_NAMESPACE
from reach_mesh.workflow import (
    TaskStatusEvent,
    WorkflowRecord,
    WorkflowResult,
    WorkflowSpec,
    check_payload_sizes,
    spec_digest,
    stored_record,
    validate_spec,
)

__all__ = ["WorkflowEngine"]

log = logging.getLogger("reach_mesh.hub.workflows")

_TRACE_HEADERS: Final = frozenset({"traceparent", "tracestate", "baggage"})
#: Bytes of submissions a hub runs before it admits more only below a namespace's fair share
#: of them, as ``workflow_concurrency`` counts workflows (``Shares``; at most ``CEILING``
#: times this in all). A running workflow holds its spec, payloads included: a caller's 120
#: specs of 7 MB once held a hub at 1.3 GB, and 1,024 of them would have held 10 GB.
HELD_BYTES: Final = 128 << 20


class WorkflowEngine(WorkflowRefusals, SubmissionKeepalive):
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
        known_namespace: Callable[[str], bool] | None = None,
        resources: Resources | None = None,
        status_nc: NATS | None = None,
    ) -> None:
        self._nc = nc
        #: Where status events come in (the hub's ``<hub_id>-statuses``; ``nc`` when None).
        self._status_nc = status_nc or nc
        #: The registry's: it learns the server's clock from the heartbeats it watches.
        self._server_clock = registry.server_clock
        self._js = js
        self._registry = registry
        self._router = router
        self._settings = settings
        #: Whether a namespace exists (``Hub.known_namespace``): only those name metric series.
        self._known_namespace = known_namespace or registry.has_namespace
        self.hub_id = hub_id
        self._metrics = metrics
        self._wf_kv: _durable.Bucket | None = None
        self._tasks_kv: _durable.Bucket | None = None
        #: Acked JetStream writes of the engine (KV compare-and-sets, work), and the core
        #: publishes that ride along with them (events, acks, ``.done``).
        self._jsc = JsClient(nc)
        self._resources = resources or Resources(js)
        self._pull: PullConsumer | None = None
        self._status_sub: Subscription | None = None
        self._tracker = StatusTracker(
            nc,
            self._jsc,
            registry,
            on_stale=None if metrics is None else metrics.stale_result_total.inc,
            max_payload=settings.max_payload,
        )
        #: The submission each run holds (its latest delivery: ``_renew``), and the run of each
        #: submission by its stream sequence.
        self._running: dict[asyncio.Task[None], Msg] = {}
        self._runs_by_seq: dict[int, asyncio.Task[None]] = {}
        #: The workflows this hub runs, by (namespace, id), from when their record names it
        #: (``_now_owner``): a cancel stops them, a view asks whether one runs here.
        self._owning: dict[tuple[str, str], tuple[Workflow, asyncio.Task[Any]]] = {}
        #: Workflows run per namespace, against ``workflow_concurrency`` (fairness).
        self._shares = Shares(settings.workflow_concurrency)
        #: The bytes of the submissions it runs, shared the same way (``HELD_BYTES``).
        self._held_bytes = Shares(HELD_BYTES)
        #: Submissions handed back because their namespace held its share (``_defer``), and
        #: the warning telling it, once per 30 s.
        self.deferred_total = 0
        self.takeover_total = 0
        #: Takeovers not yet told, an example of them, and the timer that tells them.
        self._takeovers_untold = 0
        self._takeover_example: tuple[str, str | None] = ("", None)
        self._takeover_timer: asyncio.TimerHandle | None = None
        #: Submissions delivered again to this hub while it ran them (``_renew``).
        self.renewed_total = 0
        self._renew_lines = LineBudget(30.0)
        self._defer_lines = LineBudget(30.0)
        #: Workflows handed back by an error that is not the infrastructure's, per kind.
        self._error_lines = LineBudget(60.0)
        self._ticker: asyncio.Task[None] | None = None
        self._counting: asyncio.Task[None] | None = None
        self._sweeping: asyncio.Task[None] | None = None
        self._adopting: dict[int, asyncio.Task[None]] = {}
        self._sweep_from = 1
        self._handed_back: dict[int, float] = {}
        self._silent: dict[str, tuple[float, float, str]] = {}
        self._init_hand_backs()
        self.orphans_adopted = 0
        self.orphans_deleted = 0
        self._bg: set[asyncio.Future[Any]] = set()
        #: The steps' work messages, batched per agent per pass (``hub/_work_out.py``).
        self._work_out = WorkOut(
            self._jsc.publish,
            lambda what, op, until: _durable.retrying(what, op, until, on_retry=self._infra_retry),
            self._background,
            metrics,
        )
        self._pending = 0
        self._waiting_steps = {}
        self._replacing = Pacer(REPLACE_RATE, REPLACE_BURST)
        self._stopping = False
        #: Final answers that came from an agent's idempotency cache (a duplicate delivery).
        self.duplicate_total = 0
        #: Attempts after the first.
        self.retry_total = 0
        self._policies = {}
        #: Attempts still reported running past their step's timeout and grace: taken as
        #: TIMEOUT by this hub (``StepRunner._overdue``).
        self.overdue_total = 0
        #: JetStream operations repeated after an infrastructure error (never an outcome).
        self.infra_retry_total = 0
        #: Submissions refused because their workflow id was taken by another spec.
        self.conflict_total = 0
        self.workflows_done = 0
        #: Workflows this hub stopped on a cancel request.
        self.cancelled_total = 0
        #: Agents registered with ``durable_work=False`` (no work consumer): never offered a
        #: step. Kept from state changes so choosing a step does not scan the registry.
        self._no_work: set[str] = set()

    @property
    def stale_total(self) -> int:
        """Final statuses not applied: from an attempt or agent the step did not send to, or
        arriving after the step was decided (a duplicate run)."""
        return self._tracker.stale_total

    @property
    def max_status(self) -> int:
        """The largest status event taken (``StatusTracker.max_status``)."""
        return self._tracker.max_status

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
        self._loop = asyncio.get_running_loop()
        s = self._settings
        ensure = functools.partial(ensure_workflow_resources, self._js, s)
        await ensure()
        self._resources.add(RETENTION_STREAMS, ensure, consumer=protocol.CONSUMER_HUBS)
        await self._jsc.start()
        self._tasks_kv = _durable.Bucket(protocol.KV_TASKS, self._jsc)
        self._wf_kv = _durable.Bucket(protocol.KV_WORKFLOWS, self._jsc)
        statuses = protocol.task_status("*.*.*", "*")
        # Each status is taken as nats-py reads it (``reach_mesh/_inline.py``): a step's
        # outcome a pass of the loop sooner, on the critical path of every fanout and chain.
        self._status_sub = await subscribe_inline(
            self._status_nc, statuses, guarded_inline(statuses, self._on_status, answers=False)
        )
        # The server has it before the first step is sent (pulled below): on another
        # connection, the SUB is not ordered before this one's publishes.
        await flushed(self._status_nc)
        # Statuses sent while that connection was away are lost to it: read them back then.
        reconnects = reconnects_of(self._status_nc)
        if reconnects is not None:
            reconnects.listeners.append(self._statuses_back)
        self._registry.on_state_change(self._on_agent_state)
        self._no_work.update(v.agent_id for v in self._registry if not v.record.card.durable_work)
        self._pull = PullConsumer(
            self._nc,
            protocol.STREAM_WF,
            protocol.CONSUMER_HUBS,
            self._on_submit,
            # Up to the shares' ceiling: past the capacity, fair shares still start
            # workflows, and submissions over a share are handed back (``_defer``).
            self._shares.ceiling,
            expires=min(5.0, max(0.5, s.workflow_ack_wait)),
            on_gone=self._resources.check,
        )
        await self._pull.start()
        self._ticker = asyncio.create_task(self._keepalive(), name="reach-workflow-keepalive")
        if self._metrics is not None:
            self._metrics.workflows_running.set_function(lambda: len(self._running))
        self._counting = asyncio.create_task(
            self._watch_submissions(self._metrics), name="reach-workflow-submissions"
        )

    async def stop(self) -> None:
        """Stop pulling; hand every running workflow back (nak) so another hub resumes it."""
        self._stopping = True
        if self._pull is not None:
            await self._pull.stop()
        if self._ticker is not None:
            self._ticker.cancel()
        if self._counting is not None:
            self._counting.cancel()
        if self._sweeping is not None:
            self._sweeping.cancel()
        if self._takeover_timer is not None:
            self._takeover_timer.cancel()
            self._tell_takeovers()
        # (Adopted submissions are among them: their "nak" leaves them stored, for another
        # hub's sweep.)
        running = dict(self._running)
        for task in running:
            task.cancel()
        for task, msg in running.items():
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
            with contextlib.suppress(Exception):
                await msg.nak()
        if running:
            # The hub that resumes them logs a takeover, as for a hub that died: say here
            # that this one was planned.
            log.info(
                "hub %s stopping: handed %d running workflow(s) back for another hub to resume",
                self.hub_id,
                len(running),
            )
        for bg in list(self._bg):
            bg.cancel()
        reconnects = reconnects_of(self._status_nc)
        if reconnects is not None and self._statuses_back in reconnects.listeners:
            reconnects.listeners.remove(self._statuses_back)
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
        """(namespace, workflow id) of the workflows this hub runs right now (whose record
        names it)."""
        return list(self._owning)

    def _now_owner(self, wf: Workflow) -> None:
        """The workflow record names this hub (created, or taken over): cancels and views go
        to this run of it from now on, in place of any other run of it here (which lost it;
        a cancel that one took is carried over).

        That other run is stopped here, as ``_stop_lost_runs`` stops a run another hub took
        over: this run's compare-and-set moved the record past the revision it holds, and
        nothing else would tell it — it ran on, deciding the steps this run decides, sending
        stops and cancels for this run's attempts, trying a second final write (chaos
        seed 182, ``partition``: hub-cc7687ff adopted a workflow it had handed back, then the
        submission was delivered to it again, and both runs went on). Nothing of its
        submission is answered: this run holds it, as a run that lost to another hub leaves
        it to that hub."""
        key = (wf.ns, wf.id)
        task = asyncio.current_task(self._loop)
        assert task is not None
        old = self._owning.get(key)
        self._owning[key] = (wf, task)
        stop = None if old is None or old[0] is wf else old[0].stop
        if stop is not None and stop.done():
            wf.cancel(stop.result())
        if old is not None and old[1] is not task and not old[1].done():
            log.info(
                "workflow %s: taken over by another run of it on this hub; the first stops", wf.id
            )
            old[1].cancel()

    async def ask(self, subject: str, body: bytes, *, timeout: float) -> bytes:
        """A request to another hub (a view, a cancel: each safe to ask twice) through the
        engine's JetStream client, with its random reply tokens (an identity that may publish
        on reply subjects cannot guess them); raises on no answer. Asked again at once when
        this hub's connection comes back before the answer, which may be lost with it."""
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout
        while True:
            try:
                msg = await or_reconnected(self._nc, self._jsc.ask(subject, body, timeout=timeout))
            except Reconnected:
                timeout = end - loop.time()
                if timeout <= 0:
                    raise TimeoutError(f"no answer on {subject} in time") from None
                continue
            data: bytes = msg.data
            return data

    @property
    def waiting_steps(self) -> list[dict[str, Any]]:
        """The steps counted in :attr:`pending`, oldest first: workflow, step, task, attempts
        recorded, why it waits and since when, and when it tries again."""
        return sorted(self._waiting_steps.values(), key=lambda w: w["since"])

    @property
    def pending(self) -> int:
        """Steps of this hub's workflows waiting for an agent (PENDING) right now."""
        return self._pending

    # ------------------------------------------------------------------ submissions

    def _on_submit(self, msg: Msg) -> None:
        seq = stream_seq(msg)
        if seq is not None and seq in self._runs_by_seq and self._renew(msg, seq):
            return
        ns = protocol.submit_namespace(msg.subject)
        if not (self._shares.admits(ns) and self._held_bytes.admits(ns)):
            self._defer(msg, ns)
            return
        self._shares.take(ns)
        self._held_bytes.take(ns, len(msg.data))
        task = self._loop.create_task(self._own(msg), name="reach-workflow")
        self._running[task] = msg
        if seq is not None:
            self._runs_by_seq[seq] = task
        task.add_done_callback(self._owned_done)

    def _renew(self, msg: Msg, seq: int) -> bool:
        """A submission this hub runs came back to it: its ``+WPI`` were late (its event loop
        stalled, or it was cut off from NATS, past ``workflow_ack_wait``) and nats-server
        delivered it again — here. The run goes on and holds the new delivery (its ``+WPI``
        and its final ack go there) instead of a second run taking the workflow over from
        the first: a compare-and-set, a rewritten record, and the first run stopped at its
        next write, its steps adopted.

        Only when no other hub had the submission in between (this delivery is the next
        after the one the run holds): one that had it may have taken the workflow over, and
        this delivery then resumes it as any other (a takeover, decided by its CAS)."""
        task = self._runs_by_seq[seq]
        held = self._running.get(task)
        if held is None or task.done() or task.cancelling():
            return False
        try:
            if msg.metadata.num_delivered != held.metadata.num_delivered + 1:
                return False
        except Exception:
            return False
        self._running[task] = msg
        self.renewed_total += 1
        if self._pull is not None:
            self._pull.release()  # one message, held once (by the run)
        suppressed = self._renew_lines.take()
        if suppressed is not None:
            wf_id = next((k[1] for k, (_, t) in self._owning.items() if t is task), "?")
            log.warning(
                "the submission of workflow %s, which this hub runs, was delivered to it again "
                "(stream sequence %d, delivery %d): its renewals came later than "
                "workflow_ack_wait (%.3gs; an event loop stall, or a cut from NATS); the run "
                "goes on (%d such lines held back)",
                wf_id,
                seq,
                msg.metadata.num_delivered,
                self._settings.workflow_ack_wait,
                suppressed,
            )
        return True

    def _owned_done(self, task: asyncio.Task[None]) -> None:
        msg = self._running.pop(task, None)
        if msg is not None:
            ns = protocol.submit_namespace(msg.subject)
            self._shares.give(ns)
            self._held_bytes.give(ns, len(msg.data))
            seq = stream_seq(msg)
            if seq is not None and self._runs_by_seq.get(seq) is task:
                del self._runs_by_seq[seq]
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
        me = asyncio.current_task(self._loop)
        assert me is not None
        try:
            result, stored = await self._run(wf)
            encoded = None
            if not stored:
                result, encoded = await self._store(wf, result)
            await self._publish_done(wf.ns, result, wf.headers, encoded)
        except NotOwnerError:
            if await self._still_owner(wf):
                # A task record moved under us while the workflow record is still ours: a hub
                # that lost the workflow wrote it (it woke up, or outlived its consumer through
                # an election). Nobody would resume the workflow before the ack wait: hand it
                # back now, and whoever takes it resumes from the records.
                log.warning("workflow %s: a step's record moved under its owner; resuming", wf.id)
                self._remember_hand_back(wf)
                with contextlib.suppress(Exception):
                    # A moment's delay: a replica behind on that record would only bring the
                    # same conflict straight back.
                    await self._delivery(me, msg).nak(delay=0.1)
                return
            if await self._lost_start(self._delivery(me, msg), wf):
                return
            log.warning("workflow %s was taken over by another hub", wf.id)
            return  # neither ack nor nak: the other hub owns the message now
        except TooLarge as big:
            # Its record could never be written (``_run`` checks it before the first write).
            await self._reject(self._delivery(me, msg), headers, big.error)
            return
        except Resubmitted:
            # Its caller waits on .done like the first one's: the owner announces it.
            log.info("workflow %s: submitted again while another hub runs it; dropped", wf.id)
            self._jsc.ack_later(self._delivery(me, msg))
            return
        except SpecConflictError as taken:
            await self._refuse_taken(self._delivery(me, msg), wf, taken.result)
            return
        except asyncio.CancelledError:
            raise
        except Exception as err:
            # The infrastructure outlived our retries (NATS down, ...): give the workflow back;
            # whoever takes it resumes from the records. Never an outcome.
            msg = self._delivery(me, msg)
            self._interrupted(wf, msg, err)
            self._remember_hand_back(wf)  # (looked at again if not delivered again: HandBacks)
            with contextlib.suppress(Exception):
                await msg.nak(delay=1.0)
            return
        finally:
            if self._owning.get((wf.ns, wf.id), (None, None))[1] is me:
                del self._owning[(wf.ns, wf.id)]
        # The result is stored and announced: nothing waits on this ack, so it rides along
        # with the next JetStream write (a lost one only brings the submission back to a hub
        # that finds the result stored and announces it again).
        self._jsc.ack_later(self._delivery(me, msg))
        if not stored:
            self._count_done(wf.ns, wf.spec.kind, result)
            if wf.cancel_won and result.hub_id == self.hub_id:  # (not another hub's result)
                self.cancelled_total += 1
                if self._metrics is not None:
                    self._metrics.workflow_cancelled_total.labels(self._ns_label(wf.ns)).inc()

    def _delivery(self, run: asyncio.Task[Any], msg: Msg) -> Msg:
        """The latest delivery of the submission ``run`` holds (``msg``, or one it was
        renewed with since: ``_renew``): what its ack, nak or term answers."""
        return self._running.get(run, msg)

    def _interrupted(self, wf: Workflow, msg: Msg, err: Exception) -> None:
        """Say why a workflow goes back to the stream unfinished: JetStream unavailable past
        the retries (expected in an outage: another hub resumes it), or anything else — a bug,
        a message the server refuses — which fails again each time the workflow comes back,
        so it is an ERROR with its traceback (at most once a minute per kind) and a metric
        an alert watches (``reach_workflow_interrupted_total{cause="error"}``)."""
        infra = _durable.infrastructure(err)
        cause = "infrastructure" if infra else "error"
        if self._metrics is not None:
            self._metrics.workflow_interrupted_total.labels(cause).inc()
        try:
            deliveries = msg.metadata.num_delivered
        except Exception:
            deliveries = None
        fields: dict[str, Any] = {
            "workflow_id": wf.id,
            "namespace": wf.ns,
            "cause": cause,
            "deliveries": deliveries,
        }
        if infra:
            text = (
                f"workflow {wf.id} interrupted: {describe(err)}; handed back, resumed from its "
                "records"
            )
            log_event(log, WORKFLOW_INTERRUPTED, text, level=logging.WARNING, **fields)
            return
        held = self._error_lines.take(type(err).__name__)
        if held is None:
            return
        log_event(
            log,
            WORKFLOW_INTERRUPTED,
            f"workflow {wf.id} failed in the hub: {err!r}; handed back, it fails again each "
            f"time it comes back until the cause is fixed ({held} such lines held back)",
            level=logging.ERROR,
            exc_info=err,
            **fields,
        )

    async def _still_owner(self, wf: Workflow) -> bool:
        """Whether the workflow record is still at the revision this hub last wrote, naming
        this hub (no other hub took the workflow over since). Read from the stream's leader,
        not a replica that may lag. False when it cannot be read."""
        if wf.rev == 0:
            return False  # it lost the takeover itself
        try:
            got = await self._record_now(wf.ns, wf.id)
        except MeshUnavailableError:
            return False
        record = stored_record(WorkflowRecord, got)
        if got is None or record is None:
            return False
        return got[1] == wf.rev and record.owner == self.hub_id

    def _admit(self, msg: Msg, headers: dict[str, str]) -> Workflow:
        spec = protocol.decode(msg.data, WorkflowSpec, max_size=self._settings.max_payload * 8)
        ns = msg.subject.split(".")[2]
        if spec.namespace != ns:
            raise WorkflowSpecError(
                f"workflow namespace {spec.namespace!r} does not match subject {msg.subject!r}",
                field="namespace",
            )
        named = protocol.named_workflow_id(msg.headers)
        if named and named != spec.workflow_id:
            # Its caller waits on one of the two ids: refused under the header's (as a
            # submission that is no spec is), it is told, not left waiting for a workflow
            # that runs under the other. (A header naming no valid id could hold no answer:
            # the body's runs, as before.)
            raise WorkflowSpecError(
                f"workflow id {spec.workflow_id!r} does not match the Nats-Msg-Id's {named!r}",
                field="workflow_id",
            )
        need = validate_spec(spec)
        check_payload_sizes(spec, len(msg.data), self._input_limit())
        try:
            meta = msg.metadata
            submitted = meta.timestamp.timestamp()  # JetStream server time
            seq: int | None = meta.sequence.stream
        except Exception:
            submitted, seq = self._server_clock.now(), None
        timeout = spec.timeout if spec.timeout is not None else self._settings.task_ttl
        longest = self._settings.longest_workflow
        if timeout > longest:
            raise WorkflowSpecError(
                f"workflow timeout {timeout:g}s is longer than the hubs keep a running "
                f"workflow's records ({longest:g}s: workflow_retention "
                f"{self._settings.workflow_retention:g}s less the time to write its result); "
                "submit a shorter timeout, or raise the hubs' workflow_retention",
                field="timeout",
            )
        # The server's clock has passed the time it stored the submission at, whatever our
        # estimate of it says: an estimate behind by its sample's delay (a loaded hub: a few
        # ms) gave a workflow that much longer than its timeout — a 1e-9 s one had its steps
        # sent and run, and ended SUCCEEDED.
        remaining = submitted + timeout - max(self._server_clock.now(), submitted)
        # With no (valid) trace context the mesh starts the workflow's trace, as every hub that
        # runs this submission starts it (one that takes it over goes on in the same trace).
        trace_id = started_trace(headers, f"{ns}/{spec.workflow_id}/{seq}".encode())
        return Workflow(
            spec=spec,
            need=need,
            deadline=self._loop.time() + max(0.0, remaining),
            submitted_at=submitted,
            headers=headers,
            trace_id=trace_id,
            digest=spec_digest(spec),
            seq=seq,
        )

    async def _store(
        self, wf: Workflow, result: WorkflowResult
    ) -> tuple[WorkflowResult, bytes | None]:
        """Make ``result`` the workflow's one final state: a CAS on our record. Returns the
        result that is final — ours, with its JSON as the record holds it (encoded once, for
        ``.done`` too), or one another hub stored first (None: not encoded here).

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
            cancel=result.error if wf.cancel_won else None,
            result=result,
        )
        result_json = protocol.encode(result)
        data = record_bytes(record, result_json)
        limit = self._nc.max_payload - protocol.MESSAGE_ROOM
        if len(data) > limit:
            # Results too large for one record: stored without (some of) them, one final
            # answer either way — never a write that fails every time it is tried.
            whole = result
            other = len(data) - len(result_json)
            for last_resort in (False, True):
                result = fit_result(whole, limit, other, steps=last_resort)
                record.result, record.state = result, result.state
                result_json = protocol.encode(result)
                data = record_bytes(record, result_json)
                if len(data) <= limit:
                    break
        try:
            await self._owner_write(wf, record, data)
        except KeyWrongLastSequenceError as err:
            kv = self._wf_kv
            got = await self._io(f"read {key}", lambda: _durable.get(kv, key), wf.deadline)
            stored = final_result(got)
            if stored is None:
                raise NotOwnerError(key) from err
            return stored, None
        return result, result_json

    async def _publish_done(
        self,
        ns: str,
        result: WorkflowResult,
        headers: dict[str, str],
        encoded: bytes | None = None,
    ) -> None:
        """Announce the stored final result on ``.done``: core NATS, not stored — the record
        written before it is the durable copy, which a caller that missed the announcement
        reads (``Client.workflow``). Sent before the submission's ack, on the same
        connection: a hub that dies before sending it never acks, and whoever takes the
        submission finds the result stored and announces it again. ``encoded``: the result's
        JSON (``protocol.encode``) if the caller has it."""
        body = protocol.encode(result) if encoded is None else encoded
        await self._jsc.send(protocol.wf_done(ns, result.workflow_id), body, inject(dict(headers)))

    def _count_done(self, ns: str, kind: str, result: WorkflowResult) -> None:
        self.workflows_done += 1
        if self._metrics is not None:
            self._metrics.workflow_done(
                self._ns_label(ns), kind, result.state.value, result.duration_ms / 1000
            )

    def _ns_label(self, ns: str) -> str:
        """``ns`` as a metric label: itself if it exists (configured, or holding a registered
        agent, as for the hub's other series), else :data:`UNKNOWN_NAMESPACE` — a namespace
        anyone on an open bus can make up must not make series."""
        return ns if self._known_namespace(ns) else UNKNOWN_NAMESPACE

    # ------------------------------------------------------------------ subscriptions

    def _statuses_back(self) -> None:
        """The statuses connection reconnected: the running steps read what they missed."""
        if not self._stopping:
            self._background(self._tracker.after_gap())

    def _on_status(self, msg: Msg) -> None:
        # In nats-py's reader: no awaits, no I/O — dictionary lookups and a parse.
        self._tracker.on_status(msg)

    def _on_agent_state(self, view: AgentView, old: AgentState, new: AgentState) -> None:
        if new is AgentState.LOST or view.record.card.durable_work:
            self._no_work.discard(view.agent_id)
        else:
            self._no_work.add(view.agent_id)
        if new is AgentState.LOST:
            self._tracker.mark_lost(view.agent_id)
