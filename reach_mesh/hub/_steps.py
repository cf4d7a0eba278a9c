"""One workflow step, run to its outcome: the half of the workflow engine that talks to agents.

:class:`StepRunner` is the base of :class:`~reach_mesh.hub.workflows.WorkflowEngine`: the
engine owns workflows (submissions, fanout/chain, results); the runner runs their steps —
choosing an agent (:class:`~reach_mesh.hub._placing.StepPlacing`, its base), recording each
attempt in the task record (the fence) before sending it, watching its status events through
the :class:`~reach_mesh.hub._tracking.StatusTracker`, retrying, and recording the outcome.
Infrastructure errors are retried (:class:`~reach_mesh.hub._step_io.StepIO`, its base, on
:mod:`reach_mesh.hub._durable`) and never become an outcome.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Final, Literal

from nats.js.errors import KeyWrongLastSequenceError

from reach_mesh import protocol
from reach_mesh.errors import MeshTimeoutError, ReachError
from reach_mesh.hub import _durable
from reach_mesh.hub._step_io import StepIO
from reach_mesh.hub._step_state import (
    NotOwnerError,
    Policy,
    TaskIdTaken,
    Unroutable,
    Workflow,
    backoff,
    id_conflict,
    new_record,
    note,
    refused,
    sent,
    settles,
    step_route,
)
from reach_mesh.hub._step_track import ATTEMPTS_KEPT, StepTrack
from reach_mesh.hub._wire import _step_envelope_bytes
from reach_mesh.hub.breaker import BreakerState
from reach_mesh.hub.registry import AgentView
from reach_mesh.models import ErrorBody, RouteRequest, TaskState
from reach_mesh.tracing import SPAN_STEP, SpanKind, span
from reach_mesh.workflow import (
    BACKOFF_MIN,
    INTERVAL_MIN,
    AttemptRecord,
    StepSpec,
    TaskRecord,
    TaskStatusEvent,
    input_too_large,
    step_task_id,
)

__all__ = ["NotOwnerError", "Outcome", "StepRunner", "Workflow"]


def _floor(value: float | None, floor: float) -> float | None:
    """``value`` raised to ``floor``; None stays None (the hub's setting applies)."""
    return None if value is None else max(value, floor)


def _halt(wf: Workflow) -> None:
    """End a step that was stopped but runs on (``Workflow.halted``: an await in it swallowed
    the cancellation) as cancelled, before it records or sends anything new: its shape stops
    it as it stops any other (a fanout's branch that went on recording and sending attempts
    for 23 s held the fanout's result and its other stops up — chaos secure seed 184,
    ``node_stop``, chaos-184-00972)."""
    if wf.halted():
        raise asyncio.CancelledError(f"workflow {wf.id}: the step was stopped")


def _same_write(stored: TaskRecord, written: TaskRecord) -> bool:
    """Whether ``stored`` is the record this hub wrote as ``written`` (its wall-clock
    ``created_at`` to the microsecond, attempt and agent): a create that landed although its
    answer was lost."""
    return (stored.created_at, stored.attempt, stored.agent_id) == (
        written.created_at,
        written.attempt,
        written.agent_id,
    )


#: Steps of one namespace a hub places again per second (after a try that found no agent or
#: failed), after a first ``REPLACE_BURST``: past it they wait for their turn, so a tenant's
#: thousands of steps waiting for an agent nobody serves (``pending_interval`` at its 0.1 s
#: floor once took a hub from every other tenant) cost the hub a bounded share.
REPLACE_RATE: Final = 500.0
REPLACE_BURST: Final = 1000.0
#: Distinct step retry policies a hub keeps made (``StepRunner._policy``; past it, forgotten).
POLICIES_KEPT: Final = 256

Outcome = Literal["final", "overdue", "undelivered", "lost", "nomatch", "deadline"]
#: Why a step waits between attempts, by the outcome of the last one (no agent: the router's
#: sentence instead).
_WAITING_WHY: Final = {
    "final": "retrying after a handler failure",
    "overdue": "its handler ran past its timeout; retrying",
    "undelivered": "its agent did not take it; retrying",
    "lost": "its agent was lost; retrying",
}


class StepRunner(StepIO):
    """Runs steps of the workflows a hub owns (the base of ``WorkflowEngine``, which sets
    every attribute of its bases)."""

    #: Final answers that came from an agent's idempotency cache (a duplicate delivery).
    duplicate_total: int
    #: Attempts after the first.
    retry_total: int
    #: Attempts taken as TIMEOUT by the hub (``_overdue``).
    overdue_total: int
    #: Retry policies made, by the spec values they were made of (``_policy``).
    _policies: dict[tuple[float | None, ...], Policy]

    # ------------------------------------------------------------------ one step

    def _policy(self, step: StepSpec) -> Policy:
        """The step's retry policy: the spec's values, at least their floors (a spec must not
        set the hub spinning for a step; ``RetryPolicy``), else the hub's settings.

        Made once per distinct spec values (``_policies``, a few hundred kept): building it
        took ~5 µs a step, 3 % of a hub's CPU per fanout(3)."""
        r = step.retry
        key = (
            r.retries,
            r.fast_attempts,
            r.backoff_base,
            r.backoff_cap,
            r.pending_interval,
            r.ttl,
            r.deliver_timeout,
            r.silence_timeout,
            step.timeout,
        )
        pol = self._policies.get(key)
        if pol is None:
            pol = self._make_policy(step)
            if len(self._policies) >= POLICIES_KEPT:
                self._policies.clear()
            self._policies[key] = pol
        return pol

    def _make_policy(self, step: StepSpec) -> Policy:
        s, r = self._settings, step.retry
        return Policy(
            retries=s.step_retries if r.retries is None else r.retries,
            fast_attempts=s.step_fast_attempts if r.fast_attempts is None else r.fast_attempts,
            base=_floor(r.backoff_base, BACKOFF_MIN) or s.retry_base,
            cap=_floor(r.backoff_cap, BACKOFF_MIN) or s.retry_cap,
            pending_interval=_floor(r.pending_interval, INTERVAL_MIN) or s.pending_interval,
            ttl=r.ttl or s.task_ttl,
            deliver_timeout=_floor(r.deliver_timeout, INTERVAL_MIN) or s.step_deliver_timeout,
            silence_timeout=_floor(r.silence_timeout, INTERVAL_MIN) or s.step_silence_timeout,
            attempt_timeout=step.timeout,
            overdue_grace=s.step_overdue_grace,
        )

    async def _step(self, wf: Workflow, index: int, step: StepSpec, payload: Any) -> TaskRecord:
        """Run one step to its outcome and record it; returns the final (or cancelled) record.

        The task record is the fence. Each attempt is recorded before it is sent; when the
        step must try again, the next attempt number is recorded at once (with no agent yet),
        so an earlier attempt still queued somewhere is dropped unrun by its agent. Any attempt
        that was sent may still deliver its outcome until the step is decided: the first one
        wins (``StatusTracker.offer``), later ones are counted as stale.
        """
        loop = self._loop
        ns = wf.ns
        task_id = step_task_id(wf.id, index, step)
        key = protocol.task_key(ns, task_id)
        pol = self._policy(step)
        route = step_route(step)
        if payload is not step.payload:
            # A chain step's input, made of the previous output (the spec's own payloads were
            # checked when the workflow was admitted): one an agent would refuse is not sent.
            too_large = input_too_large(index, payload, self._input_limit())
            if too_large is not None:
                return self._refuse(wf, index, refused(wf, index, task_id, too_large))
        try:
            rec, rev, fresh, view, capability = await self._begin(wf, index, route, task_id, key)
        except TaskIdTaken as taken:
            # Another workflow's step holds the id: not run, not written (the record is
            # theirs); the same outcome on every owner that gets here while it is kept.
            return self._refuse(wf, index, id_conflict(wf, index, task_id, taken.workflow_id))
        except Unroutable as bad:
            # Nothing sent or written: the same refusal on every owner (it follows from the spec).
            return self._refuse(wf, index, refused(wf, index, task_id, bad.error))
        # Why the step waits when matching agents exist but take no steps (in the TIMEOUT).
        no_work = self._no_work_reason(route, ns) if view is None else None
        if not fresh:
            await self._remark(wf, rec)
        if rec.state.final or rec.cancelled:
            return rec  # finished before a takeover: never run again
        ttl_left = rec.created_at + pol.ttl - self._server_clock.now()
        deadline = min(wf.deadline, loop.time() + max(0.0, ttl_left))
        exclude: set[str] = set()
        said: str | None = None  # the waiting reason last published for this step
        with span(
            SPAN_STEP,
            kind=SpanKind.INTERNAL,
            attributes={"reach.task_id": task_id, "reach.step": index},
        ) as sp:
            track = self._tracker.open(rec, key, sp)
            track.halted = wf.halted
            decided: int | None = None
            try:
                outcome: tuple[Outcome, TaskStatusEvent | None] | None = None
                if fresh and view is not None and loop.time() >= deadline:
                    # Its time ran out before it went out (a deadline past on admission, or
                    # spent before it): nothing is sent — a run could only be thrown away —
                    # and the deadline decides it below.
                    view.outstanding = max(0, view.outstanding - 1)
                    rec.attempt, rec.agent_id, rec.history = 0, None, []
                elif fresh and view is not None:
                    track.view = view
                    _halt(wf)
                    outcome = await self._attempt(
                        wf, index, step, rec, capability, payload, track, pol, deadline
                    )
                elif fresh:
                    outcome = ("nomatch", None)
                else:
                    # Taken over: what did the attempts sent so far say while we were not
                    # listening? An outcome among them decides the step (loop top).
                    await self._tracker.catch_up(track)
                    if track.final is None and rec.agent_id is not None and rec.attempt > 0:
                        # Mid-attempt: adopt it instead of sending it again.
                        outcome = await self._watch(track, pol, deadline)
                    # else: taken over between recording an attempt and sending it: send it
                    # now, unless an earlier attempt's outcome arrived (loop top). Attempts
                    # given up on before (and one sent under the record's attempt) are read
                    # again before that (``given_up_read``): one whose stored status could
                    # not be read here is not sent anew on that.
                while True:
                    if outcome is None and track.final is not None:
                        outcome = ("final", track.final)  # an earlier attempt delivered
                    if outcome is None and track.revived is not None and track.agent_id is None:
                        # An attempt we gave up on turned out to be in hand: wait for it.
                        self._tracker.readopt(track)
                        outcome = await self._watch(track, pol, deadline)
                    if outcome is None:
                        _halt(wf)  # (an outcome in hand still decides it, above)
                        if loop.time() >= deadline and track.sent:
                            # An attempt given up on (lost, undelivered) may have ended
                            # meanwhile, unheard, its SUCCEEDED stored: it decides, not the
                            # deadline. Reads unanswered (no leader) are held for a bounded
                            # while, as at the deadline in ``_watch``.
                            await self._tracker.given_up_final(track)
                            if track.final is not None:
                                continue
                        if loop.time() >= deadline:
                            why = self._unplaced(rec, route, ns, no_work)
                            rec, decided = await self._finish(
                                wf, key, rec, rev, track, None, reason=why
                            )
                            return rec
                        if track.sent:
                            # Attempts given up on (lost, undelivered) may have stored their
                            # outcome since, or before a takeover: read first (once each).
                            # Within the step's deadline: unanswered reads, one agent after
                            # another and each patiently (11 s), held a step with three such
                            # agents 33 s past it (tests/test_given_up_deadline.py).
                            try:
                                async with asyncio.timeout(max(0.0, deadline - loop.time())):
                                    read = await self._tracker.given_up_read(track)
                            except TimeoutError:
                                read = False  # (the deadline decides it, loop top)
                            if track.final is not None:
                                continue  # (decided by it, loop top)
                            if not read:
                                # What one stored could not be read (no leader for the status
                                # stream): not sent anew on that; read again after a while.
                                await track.wait_outcome(
                                    min(pol.deliver_timeout, max(0.0, deadline - loop.time()))
                                )
                                continue
                        try:
                            view, capability = await self._choose(route, ns, exclude)
                        except Unroutable as bad:
                            rec, decided = await self._finish(
                                wf, key, rec, rev, track, None, refusal=bad.error
                            )
                            return rec
                        no_work = self._no_work_reason(route, ns) if view is None else None
                        if view is None:
                            outcome = ("nomatch", None)
                        else:
                            if wf.halted():  # (stopped while its agent was chosen)
                                view.outstanding = max(0, view.outstanding - 1)
                                _halt(wf)
                            rec.attempt = max(rec.attempt, 1)
                            rec.agent_id = view.agent_id
                            rec.state = TaskState.PENDING
                            rec.history = [
                                *rec.history[-ATTEMPTS_KEPT + 1 :],
                                AttemptRecord(attempt=rec.attempt, agent_id=view.agent_id),
                            ]
                            rec.updated_at = self._server_clock.now()
                            try:
                                rev = await self._cas(key, rec, rev, wf.deadline)
                            except BaseException:
                                view.outstanding = max(0, view.outstanding - 1)
                                raise
                            self._tracker.dispatch(track, rec.attempt, view)
                            _halt(wf)  # (stopped while its record was written: not sent)
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
                    if kind == "overdue":
                        event = self._overdue(rec, track, pol)
                    elif kind == "final" and event is not None:
                        track.take()
                    if event is not None:  # an outcome: the agent's, or the hub's (overdue)
                        note(rec, event)
                        settled, rec.handler_failures = settles(
                            event, rec.handler_failures, pol.retries
                        )
                        if settled:
                            track.deciding = event
                            rec, decided = await self._finish(
                                wf, key, rec, rev, track, event, store=kind == "overdue"
                            )
                            return rec
                        if step.agent_id is None:
                            exclude.add(event.agent_id)
                        if event.attempt != track.attempt and track.agent_id is not None:
                            # An earlier attempt failed while the current one is out there:
                            # a handler failure counted, and the current attempt goes on.
                            outcome = await self._watch(track, pol, deadline)
                            continue
                        delay = backoff(rec.handler_failures, pol.base, pol.cap)
                    elif kind == "deadline":
                        why = self._unplaced(rec, route, ns, no_work)
                        rec, decided = await self._finish(
                            wf, key, rec, rev, track, None, reason=why
                        )
                        return rec
                    else:
                        # Not delivered / agent lost / no agent: safe to send elsewhere.
                        rec.delivery_failures += 1
                        if kind != "nomatch" and rec.history:
                            rec.history[-1].code = kind
                        if kind == "nomatch":
                            waiting = self._waiting_reason(route, ns, no_work)
                            if waiting != said:
                                said = waiting  # why the step waits, once per new reason
                                self._waiting_event(wf, index, rec, waiting)
                        if rec.agent_id is not None and step.agent_id is None:
                            exclude.add(rec.agent_id)
                        if rec.delivery_failures <= pol.fast_attempts:
                            delay = backoff(rec.delivery_failures, pol.base, pol.cap)
                        else:
                            delay = pol.pending_interval
                            exclude.clear()  # slow phase: any suitable agent again
                    _halt(wf)
                    if rec.agent_id is not None or track.agent_id is not None:
                        # Fence first: record the next attempt (no agent yet) before waiting,
                        # so the attempt we gave up on is dropped unrun if it turns up. Also
                        # an attempt watched again (``readopt``; its record names the next
                        # attempt with no agent already): its agent keeps it for that record
                        # (``Fences.revived``), so only a new one fences it.
                        gave_up = (track.attempt, track.agent_id)
                        rec.attempt += 1
                        rec.agent_id = None
                        rec.state = TaskState.PENDING
                        rec.updated_at = self._server_clock.now()
                        rev = await self._cas(key, rec, rev, wf.deadline)
                        self._tracker.fence(track, rec.attempt)
                        if kind not in ("final", "overdue") and gave_up[1] is not None:
                            # Its work message may still wait in the stream: a marker behind
                            # it. Its agent may have taken it just before the fence: ask again
                            # (one declared LOST too: back from a partition, it may have read
                            # the record before this write and started the attempt).
                            await self._mark(wf, gave_up[1], rec.task_id, gave_up[0])
                            await self._tracker.recheck(track, gave_up[0], gave_up[1], rec.attempt)
                    remaining = deadline - loop.time()
                    if remaining > 0:
                        # A namespace's steps are placed again at a pace of their own on this
                        # hub (``REPLACE_RATE``): thousands waiting for an agent nobody serves
                        # must not keep the hub from every other tenant's work.
                        delay = max(delay, self._replacing.turn(ns))
                        self._pending_delta(1)
                        self._waiting_steps[(wf.ns, wf.id, index)] = {
                            "workflow_id": wf.id,
                            "namespace": wf.ns,
                            "index": index,
                            "task_id": rec.task_id,
                            "state": TaskState.PENDING.value,
                            "agent_id": None,
                            "attempts": rec.attempt,
                            "why": said if kind == "nomatch" else _WAITING_WHY.get(kind, kind),
                            "since": time.time(),  # (this hub's: read by its own views)
                            "retry_in_s": round(min(delay, remaining), 3),
                        }
                        try:
                            await track.wait_outcome(min(delay, remaining))
                        finally:
                            self._pending_delta(-1)
                            self._waiting_steps.pop((wf.ns, wf.id, index), None)
            finally:
                left = self._tracker.close(track, decided)
                if left:
                    wf.unapplied[index] = left
                if not rec.state.final:  # (stopped undecided: ``Workflow.written``)
                    wf.written[index] = (rec, rev)

    def _refuse(self, wf: Workflow, index: int, rec: TaskRecord) -> TaskRecord:
        """A step refused before anything was sent or written (``refused``): its event."""
        self._step_event(wf, index, rec, rec.state, attempt=None, agent_id=None, error=rec.error)
        return rec

    async def _begin(
        self, wf: Workflow, index: int, route: RouteRequest, task_id: str, key: str
    ) -> tuple[TaskRecord, int, bool, AgentView | None, str | None]:
        """Where the step starts: ``(record, revision, fresh, agent, capability)``.

        Fresh (this hub starts the step): an attempt 1 chosen when the workflow started is in
        the workflow record already (``first_agents``) and is sent without a task record (rev
        0: none yet); otherwise an agent is chosen now and the record created with attempt 1
        (or 0 when none matches). Not fresh (taken over from another hub): the step's record,
        or — without one — its attempt 1 from the workflow record, to adopt; an unfinished
        one is written again first (``_fence_taken``), which fences the previous owner.

        ``TaskIdTaken`` when the record under the step's task id is another workflow's (a
        caller-chosen task id: such a step is never sent before its record is created,
        ``_first_choices``, so the create is the claim)."""
        assert self._tasks_kv is not None
        kv = self._tasks_kv
        if wf.taken_over:
            got = await self._io(f"read {key}", lambda: _durable.get(kv, key), wf.deadline)
            adopted, rev = (self._ours(wf, index, got), got[1]) if got else (None, 0)
            if adopted is None:
                adopted = self._named_attempt(wf, index, task_id)
            if adopted is not None:
                if not (adopted.state.final or adopted.cancelled):
                    rev = await self._fence_taken(wf, key, adopted, rev)
                return adopted, rev, False, None, None
        rec = new_record(wf, index, task_id, self._server_clock.now())
        first = wf.first[index] if index < len(wf.first) else None
        if first is not None:
            wf.first[index] = None  # the step owns the agent's load count now
            sent(rec, first[0].agent_id)
            return rec, 0, True, first[0], first[1]
        view, capability = await self._choose(route, wf.ns, set())
        if view is not None:
            sent(rec, view.agent_id)

        def release() -> None:  # the load counted on ``view``: the step does not send to it
            if view is not None:
                view.outstanding = max(0, view.outstanding - 1)

        try:
            rev = await _durable.create(
                kv,
                key,
                protocol.encode(rec),
                self._io_deadline(wf.deadline),
                on_retry=self._infra_retry,
            )
            return rec, rev, True, view, capability
        except KeyWrongLastSequenceError as err:
            conflict = err
        except BaseException:
            release()
            raise
        try:
            got = await self._io(f"read {key}", lambda: _durable.get(kv, key), wf.deadline)
            made = None if got is None else self._ours(wf, index, got)
        except BaseException:
            release()
            raise
        if got is not None and made is not None and _same_write(made, rec):
            # Our own create: it landed, its answer was lost (an election) and the retry found
            # the key taken. Nothing was sent yet: on as if it had answered.
            return rec, got[1], True, view, capability
        release()
        if got is None or made is None:
            raise NotOwnerError(key) from conflict
        if made.state.final or made.cancelled:
            return made, got[1], False, None, None
        if not wf.taken_over:
            # Another hub made it while this one ran the workflow from a record it created:
            # the workflow was taken over from this hub, which must not run the step on with
            # the new owner's revision (its next write would land).
            raise NotOwnerError(key) from conflict
        # The previous owner made it after this hub's read (it runs on, behind a partition):
        # fenced like any record this hub adopts.
        rev = await self._fence_taken(wf, key, made, got[1])
        return made, rev, False, None, None

    async def _fence_taken(self, wf: Workflow, key: str, rec: TaskRecord, rev: int) -> int:
        """Write an adopted step's record again, as it stands (created, for an attempt the
        workflow record names): its new revision.

        The previous owner may be alive behind a partition, with a write of this record in
        flight (the next attempt, a cancel, a TIMEOUT). Its writes are CAS on the revision it
        last saw, or creates: after this write every one of them fails, and that hub stops
        (its workflow record is no longer its own). Without it, such a write could land
        after this hub decided the step by its current attempt (which writes nothing), and
        send a step that finished to run again. If the old owner's write lands first, this
        one fails: ``NotOwnerError``, and the workflow is resumed from the records again."""
        rec.updated_at = self._server_clock.now()
        return await self._cas(key, rec, rev, wf.deadline)

    @staticmethod
    def _ours(wf: Workflow, index: int, got: tuple[bytes, int]) -> TaskRecord:
        """The step's record as read; ``TaskIdTaken`` when it is another workflow's."""
        rec = TaskRecord.model_validate_json(got[0])
        if not rec.is_step(wf.id, index):
            raise TaskIdTaken(rec.workflow_id)
        return rec

    def _named_attempt(self, wf: Workflow, index: int, task_id: str) -> TaskRecord | None:
        """For a step without a task record: its attempt 1 as the workflow record names it
        (``first_agents``), sent when the workflow started; None when none is named."""
        agent_id = wf.first_agent(index)
        if agent_id is None:
            return None
        rec = new_record(wf, index, task_id, wf.submitted_at)
        sent(rec, agent_id)
        return rec

    async def _attempt(
        self,
        wf: Workflow,
        index: int,
        step: StepSpec,
        rec: TaskRecord,
        capability: str | None,
        payload: Any,
        track: StepTrack,
        pol: Policy,
        deadline: float,
    ) -> tuple[Outcome, TaskStatusEvent | None]:
        """Send the current attempt (its record is written) and watch the step to an outcome.

        A ``step`` PENDING event says the attempt went out, unless the workflow's ``start``
        event named it already (attempt 1 to ``first_agents[index]``)."""
        view = track.view
        if view is not None and view.breaker.state is BreakerState.HALF_OPEN:
            track.probe = rec.attempt  # the breaker's single probe went to this attempt
        await self._send(wf, index, step, rec, capability, payload)
        if track.machine.state is TaskState.PENDING:
            # Its delivery timeout counts from when the work message was stored: a send that
            # took long (retried through a JetStream election) is no silence of the agent's.
            track.dispatched_at = self._loop.time()
        if rec.attempt != 1 or rec.agent_id != wf.first_agent(index):
            self._step_event(
                wf, index, rec, TaskState.PENDING, attempt=rec.attempt, agent_id=rec.agent_id
            )
        return await self._watch(track, pol, deadline)

    async def _send(
        self,
        wf: Workflow,
        index: int,
        step: StepSpec,
        rec: TaskRecord,
        capability: str | None,
        payload: Any,
    ) -> None:
        assert rec.agent_id is not None
        body = _step_envelope_bytes(
            rec.task_id, rec.attempt, capability, payload, wf.ns, step.timeout, wf.id, index
        )
        await self._publish_work(wf, rec.agent_id, rec.task_id, rec.attempt, body)

    async def _finish(
        self,
        wf: Workflow,
        key: str,
        rec: TaskRecord,
        rev: int,
        track: StepTrack,
        event: TaskStatusEvent | None,
        *,
        reason: str | None = None,
        refusal: ReachError | None = None,
        store: bool = False,
    ) -> tuple[TaskRecord, int]:
        """Record the step's outcome (``event``; when None, FAILED with ``refusal`` if given,
        else TIMEOUT); returns the record and the attempt that decided it (0: none did).

        The record is written only when the fence must change (see ``TaskRecord``): not when
        the current attempt decided the step — its agent has the outcome, and every other
        attempt is fenced by the attempt number already — or when ``store``: an outcome the
        hub decided for the current attempt (``_overdue``), which its agent does not have."""
        fence = (rec.attempt, rec.agent_id)
        if event is None and refusal is not None:
            decided = 0  # no attempt decided it: the route was refused
            rec.state = TaskState.FAILED
            rec.error = ErrorBody(
                code=refusal.code, message=refusal.message, details=refusal.details
            )
        elif event is None:
            decided = rec.attempt
            rec.state = TaskState.TIMEOUT
            last = track.machine.state.value if track.agent_id is not None else "PENDING"
            err = MeshTimeoutError(
                f"step {rec.step} ({rec.task_id}) did not finish in time "
                f"(last state {last}, attempt {rec.attempt})" + (f"; {reason}" if reason else ""),
                task_id=rec.task_id,
                attempt=rec.attempt,
            )
            rec.error = ErrorBody(code=err.code, message=err.message, details=err.details)
            if rec.history and rec.history[-1].attempt == rec.attempt:
                rec.history[-1].state = TaskState.TIMEOUT
        else:
            decided = event.attempt
            self._take_outcome(rec, event)
        rec.stale += track.stale
        rec.decided_by = decided or None
        rec.updated_at = self._server_clock.now()
        if event is None or store or (event.attempt, event.agent_id) != fence:
            await self._cas(key, rec, rev, wf.deadline)
        # The deadline, or one attempt, decided the step: no other attempt is needed.
        self._stop_others(rec, None if event is None else event.attempt)
        current = track.agent_id
        if current is not None and (event is None or event.attempt != track.attempt):
            # The attempt out there is not needed any more (decided by the deadline or by an
            # earlier attempt): a marker behind its work message, if that still waits.
            await self._mark(wf, current, rec.task_id, track.attempt)
        self._step_event(
            wf, rec.step, rec, rec.state, attempt=decided, agent_id=rec.agent_id, error=rec.error
        )
        return rec, decided

    def _overdue(self, rec: TaskRecord, track: StepTrack, pol: Policy) -> TaskStatusEvent:
        """The current attempt ran past its step's ``timeout`` and ``step_overdue_grace``,
        by this hub's clock, and its agent still reports it running (a handler that ignores
        cancellation, an agent that does not enforce timeouts): a TIMEOUT of that attempt,
        decided here. Its handler is told to stop; an outcome it sends later is not acted on
        (the attempt is finished for the step)."""
        assert track.agent_id is not None and track.started_at is not None
        ran = self._loop.time() - track.started_at
        err = MeshTimeoutError(
            f"attempt {track.attempt} of step {rec.step} ({rec.task_id}) on {track.agent_id} "
            f"still running {ran:.3g}s after its handler started, past its "
            f"{pol.attempt_timeout:.3g}s timeout: its agent did not end it",
            task_id=rec.task_id,
            attempt=track.attempt,
            agent_id=track.agent_id,
            overdue=True,
        )
        track.finished.add(track.attempt)
        self._cancel_attempt(track.agent_id, rec, track.attempt)
        self.overdue_total += 1
        if self._metrics is not None:
            self._metrics.overdue_total.inc()
        return TaskStatusEvent(
            task_id=rec.task_id,
            attempt=track.attempt,
            agent_id=track.agent_id,
            state=TaskState.TIMEOUT,
            workflow_id=rec.workflow_id,
            step=rec.step,
            error=ErrorBody(code=err.code, message=err.message, details=err.details),
        )

    def _take_outcome(self, rec: TaskRecord, event: TaskStatusEvent) -> None:
        """Write an attempt's final status into the step's record (its state, agent, result,
        error), counting a duplicate delivery."""
        rec.state = event.state
        rec.agent_id = event.agent_id
        rec.result = event.result
        rec.error = event.error
        rec.cached = event.cached
        rec.duration_ms = event.duration_ms
        if event.cached:
            self.duplicate_total += 1
            if self._metrics is not None:
                self._metrics.duplicate_delivery_total.inc()

    # ------------------------------------------------------------------ watching an attempt

    async def _watch(
        self, track: StepTrack, pol: Policy, deadline: float
    ) -> tuple[Outcome, TaskStatusEvent | None]:
        """Wait for the current attempt's outcome (or any earlier attempt's, first wins).

        Before the hub decides the attempt TIMEOUT itself (overdue, or at the deadline) it
        looks for a final status it missed (``StatusTracker.missed_final``). Overdue with the
        status stream unanswered even to a patient read (an election) and no outcome from the
        agent (cut off, or running it still), the attempt is not timed out on that — a
        SUCCEEDED stored there (this attempt's, or an earlier one's) would decide the step,
        and a retry would run it again: it is watched on and asked about again after
        ``silence_timeout`` (a silent agent's probe first), the deadline deciding at the
        latest. At the deadline the hub reads on for ``_STATUS_READ_PATIENT`` (10 s) past it,
        then the deadline decides on what was found: a bounded hold covers an election (seed
        173: 9.3 s without leader), while the caller's deadline must not wait on a stream
        that may stay without leader for minutes (quorum lost); and a TIMEOUT there sends no
        attempt again — the risk left is a stored result not seen (logged), no second run."""
        loop = self._loop
        # Overdue, with what is stored unread: not asked about again before then.
        read_again = 0.0
        while True:
            if track.final is not None:
                return "final", track.final
            if track.halted is not None and track.halted():
                # Stopped while it runs on (``_halt``): not watched on to an outcome.
                raise asyncio.CancelledError(f"{track.task_id}: the step was stopped")
            lost = track.lost
            if not lost:
                now = loop.time()
                if now >= deadline:
                    # An outcome sent before it that this hub missed (its statuses connection
                    # cut, the silence timeout not yet run out) decides, not the deadline.
                    await self._tracker.missed_final(track, hold=True)
                    if track.final is not None:
                        continue
                    return "deadline", None
                if track.machine.state is TaskState.PENDING:
                    wait_until = track.dispatched_at + pol.deliver_timeout
                else:
                    wait_until = track.last_event + pol.silence_timeout
                if track.started_at is not None:
                    # The hub's own clock bounds a handler's run: an agent's keep-alives
                    # would otherwise hold the step to the workflow's deadline. Only while
                    # the agent is heard: a silent one (paused, cut off) is asked first, as
                    # any silent attempt is, and answers for itself when it wakes.
                    overdue_at = track.started_at + pol.attempt_timeout + pol.overdue_grace
                    if now < overdue_at:
                        wait_until = min(wait_until, overdue_at)
                    elif now - track.heard_at < pol.silence_timeout:
                        # Heard within its silence timeout, but not necessarily since its
                        # handler ended: a final status missed (the statuses connection cut)
                        # leaves the attempt "running" here. What is stored, or what its agent
                        # holds, decides before the hub's own TIMEOUT does.
                        if now < read_again:
                            wait_until = min(wait_until, read_again)
                        else:
                            read = await self._tracker.missed_final(track)
                            if track.final is not None:
                                continue
                            if read:
                                return "overdue", None
                            # The status stream did not answer, even patiently (no leader),
                            # nor did the agent: not timed out on that (what it stored may
                            # decide the step); asked again after its silence timeout.
                            read_again = loop.time() + pol.silence_timeout
                            continue
                timeout = min(wait_until, deadline) - now
                if timeout > 0:
                    await track.changed.wait(timeout)
                    continue
            # Silent past its timeout, or its agent declared LOST (its heartbeats stopped
            # reaching the hubs): ask the agent before giving the attempt up — a starved or
            # cut-off agent can be live and running it.
            verdict = await self._tracker.probe(track)
            if track.final is not None:
                continue
            if verdict == "unread":
                # Its agent is gone, but what it stored could not be read (no leader for the
                # status stream): not given up on that; asked about again after its timeout
                # (the deadline decides at the latest, ``missed_final`` first).
                track.lost = False
                track.last_event = track.dispatched_at = loop.time()
                continue
            if verdict == "alive":
                # The agent has it (we missed DELIVERED, or it is queued for a slot).
                track.lost = False
                track.machine.catch_up(TaskState.DELIVERED)
                track.last_event = track.dispatched_at = loop.time()
                continue
            if lost or track.machine.state is not TaskState.PENDING:
                return "lost", None
            return "undelivered", None
