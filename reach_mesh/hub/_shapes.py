"""Running one workflow the hub owns, to its result: the workflow record first (a new one, or a
takeover of another hub's by CAS), then its shape — a fanout's branches side by side under its
policy, a chain's steps one after another, each fed the previous result.

The base of :class:`~reach_mesh.hub.workflows.WorkflowEngine` (ownership of submissions,
results); each step is run by :class:`~reach_mesh.hub._steps.StepRunner`, below this.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from typing import Any, Final

from nats.js.errors import KeyWrongLastSequenceError

from reach_mesh import protocol
from reach_mesh.errors import (
    InternalError,
    MeshUnavailableError,
    PayloadTooLargeError,
    ReachError,
)
from reach_mesh.hub import _durable
from reach_mesh.hub._step_state import TooLarge
from reach_mesh.hub._step_stop import LEADER_HEARD, StepStopping
from reach_mesh.hub._steps import NotOwnerError, Workflow
from reach_mesh.hub._wf_view import within_time
from reach_mesh.models import ErrorBody, TaskState
from reach_mesh.tracing import SPAN_WORKFLOW, SpanKind, span
from reach_mesh.workflow import (
    StepResult,
    StepSpec,
    TaskRecord,
    WorkflowEvent,
    WorkflowRecord,
    WorkflowResult,
    merge_payload,
    step_task_id,
    stored_record,
)

__all__ = ["Resubmitted", "SpecConflictError", "WorkflowShapes", "final_result"]

log = logging.getLogger("reach_mesh.hub.workflows")

#: Takeovers are told in one line per this many seconds from the first (``_took_over``).
TAKEOVERS_TOLD_AFTER: Final = 5.0
#: How long (s) a fanout waits for the branches it cancelled to end (``_end_branches``), and
#: how often it cancels those still running again meanwhile.
BRANCH_STOP_WAIT: Final = 1.0
BRANCH_RECANCEL: Final = 0.05


class _Unwritable(Exception):
    """A workflow's first record would not fit in a NATS message (``WorkflowShapes._run``)."""


class SpecConflictError(Exception):
    """The workflow id is taken by a submission with another spec: ``result`` is that
    workflow's, when it has finished."""

    def __init__(self, key: str, result: WorkflowResult | None) -> None:
        super().__init__(key)
        self.result = result


class Resubmitted(Exception):
    """Another message of a workflow another hub runs from its own submission (see
    ``WorkflowRecord.submission_seq``): nothing to do with this one but let it go."""


class WorkflowShapes(StepStopping):
    """Runs an owned workflow's record and shape (the base of ``WorkflowEngine``, which sets
    every attribute below; ``hub_id`` is declared on ``StepStopping``)."""

    _wf_kv: _durable.Bucket | None
    #: Workflows this hub took over from a record another owner (or itself, earlier) wrote.
    takeover_total: int
    #: Takeovers not yet told (``_tell_takeovers``), one of them, and the timer that tells.
    _takeovers_untold: int
    _takeover_example: tuple[str, str | None]
    _takeover_timer: asyncio.TimerHandle | None

    def _took_over(self, wf: Workflow, previous: str | None) -> None:
        """Count a takeover; tell it in the log with those of the next ``TAKEOVERS_TOLD_AFTER``
        seconds, in one line (a dead hub hands over all its workflows at once: the first of
        them alone in a line, the rest held for a next one that may never come, told a
        mass takeover as one workflow)."""
        self.takeover_total += 1
        if self._metrics is not None:
            self._metrics.workflow_takeover_total.inc()
        self._takeovers_untold += 1
        if self._takeover_timer is None:
            self._takeover_example = (wf.id, previous)
            self._takeover_timer = asyncio.get_running_loop().call_later(
                TAKEOVERS_TOLD_AFTER, self._tell_takeovers
            )

    def _tell_takeovers(self) -> None:
        self._takeover_timer = None
        told, self._takeovers_untold = self._takeovers_untold, 0
        if not told:
            return
        wf_id, previous = self._takeover_example
        log.warning(
            "took over %d workflow(s) within %g s, e.g. %s from hub %s: their owner stopped "
            "renewing them (died, stopped or cut off); resuming from the records",
            told,
            TAKEOVERS_TOLD_AFTER,
            wf_id,
            previous,
        )

    async def _workflow_at_leader(
        self, ns: str, workflow_id: str, *, quorate: bool = False
    ) -> tuple[bytes, int] | None:
        """The workflow record (value, revision) as its stream's leader has it; None when
        there is none or it was deleted. NATS's own errors propagate (``_io`` retries the
        transient ones), and so does a "not found" of the stream itself
        (``JsClient.kv_entry_at_leader``). ``quorate``: only from a leader that heard from a
        quorum of its replicas within ``LEADER_HEARD`` s (``MeshUnavailableError`` else)."""
        key = protocol.workflow_key(ns, workflow_id)
        if quorate:
            entry = await self._jsc.kv_entry_at_quorate_leader(
                protocol.KV_WORKFLOWS, key, heard_within=LEADER_HEARD
            )
        else:
            entry = await self._jsc.kv_entry_at_leader(protocol.KV_WORKFLOWS, key)
        if entry is None or entry[2]:
            return None
        return entry[0], entry[1]

    async def _record_now(
        self, ns: str, workflow_id: str, end: float | None = None, *, quorate: bool = False
    ) -> tuple[bytes, int] | None:
        """The workflow record (value, revision) as its stream's leader has it — not a replica
        that may lag behind a takeover or a final write — by loop time ``end`` if given; None
        when there is none; ``MeshUnavailableError`` when it cannot be read (``quorate``:
        also when the leader did not hear from a quorum lately, ``_workflow_at_leader``)."""
        read = self._workflow_at_leader(ns, workflow_id, quorate=quorate)
        try:
            return await (read if end is None else within_time(read, end))
        except Exception as err:
            self._resources.check_soon(err)  # the bucket may have been deleted
            raise MeshUnavailableError(
                f"the record of workflow {workflow_id!r} could not be read "
                f"({type(err).__name__}): ask again (a cancel is idempotent)"
            ) from err

    async def _owner_now(self, ns: str, workflow_id: str) -> str | None:
        """The hub the workflow record names (read from the leader within 2 s); None when
        there is no record or it names none. ``MeshUnavailableError`` when it cannot be read."""
        end = asyncio.get_running_loop().time() + 2.0
        record = stored_record(WorkflowRecord, await self._record_now(ns, workflow_id, end))
        return None if record is None else record.owner

    def _now_owner(self, wf: Workflow) -> None:
        """Hook: the workflow record names this hub now (created, or taken over)."""

    async def _run(self, wf: Workflow) -> tuple[WorkflowResult, bool]:
        """Run the workflow to its result; ``(result, True)`` when it was final already."""
        assert self._wf_kv is not None
        kv = self._wf_kv
        key = protocol.workflow_key(wf.ns, wf.id)
        # The agents of the attempts sent at once are chosen first: the workflow record names
        # them, so those steps need no task record of their own (see ``TaskRecord``).
        await self._first_choices(wf)
        wf.first_agents = [None if c is None else c[0].agent_id for c in wf.first]
        record = self._running_record(wf)
        start = protocol.encode(record)
        limit = self._nc.max_payload - protocol.MESSAGE_ROOM
        unstarted = False  # its record held only a cancel (made before any hub took it)
        # One write for a new workflow; only an existing record (a takeover, or a re-submit)
        # costs a read.
        try:
            if len(start) > limit:
                # Never writable as it is: whatever is stored decides (below).
                raise _Unwritable
            wf.rev = await _durable.create(
                kv, key, start, self._io_deadline(wf.deadline), on_retry=self._infra_retry
            )
        except BaseException as err:
            self._release_first(wf)
            if not isinstance(err, KeyWrongLastSequenceError | _Unwritable):
                raise
            # Read from the stream's leader, which the CAS below is decided by: a replica
            # behind a write the record already has would fail the CAS for a revision no
            # other hub holds, and the workflow would wait out its ack wait unowned.
            got = await self._io(
                f"read {key}", lambda: self._workflow_at_leader(wf.ns, wf.id), wf.deadline
            )
            rec = stored_record(WorkflowRecord, got)
            if len(start) > limit and (rec is None or rec.cancelled_before_start):
                # Not started by any hub: refused (another hub's record, which fit, is
                # resumed or announced below as usual).
                raise TooLarge(
                    PayloadTooLargeError(
                        f"workflow {wf.id}: its record would take {len(start)} bytes, over "
                        f"the {limit} a record may hold (the NATS server's max_payload less "
                        f"{protocol.MESSAGE_ROOM})",
                        size=len(start),
                        max_size=limit,
                    )
                ) from None
            if rec is not None and rec.spec_digest not in (None, wf.digest):
                raise SpecConflictError(key, final_result(got)) from None
            stored = final_result(got)
            if stored is not None:
                return stored, True  # finished before: never run again
            if (
                rec is not None
                and rec.owner is not None
                and rec.submission_seq is not None
                and wf.seq is not None
                and rec.submission_seq != wf.seq
            ):
                # Another message of a workflow that runs from its own (a re-submission: each
                # is stored): that one stays in the stream until the result is stored,
                # and comes back to a hub if its owner is gone. Taking it over from this one
                # would take it from a live owner, and restart its deadline.
                raise Resubmitted(key) from None
            if rec is not None and rec.submitted_at is not None:
                # Its deadline runs from its first submission (server time), not this one's.
                late = wf.submitted_at - rec.submitted_at
                if late > 0:
                    wf.submitted_at = rec.submitted_at
                    wf.deadline -= late
                    record.submitted_at = rec.submitted_at
            # Take the workflow over: a CAS, so of two hubs resuming it one wins. Attempts the
            # previous owner sent at the start stay named: their steps adopt them.
            wf.taken_over = True
            wf.first_agents = [] if rec is None else rec.first_agents
            record.first_agents = wf.first_agents
            if rec is not None and rec.cancel is not None:
                # Its owner took a cancel (and may have stopped steps for it): finish it.
                record.cancel = rec.cancel
                wf.cancel_recorded = True
                wf.cancel(rec.cancel)
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
            unstarted = rec is not None and rec.cancelled_before_start
            if unstarted:
                # Cancelled before any hub started it (``WorkflowEngine._cancel_unstarted``):
                # not a takeover; it ends cancelled below, no step started.
                log.info("workflow %s of %r was cancelled before it started", wf.id, wf.ns)
            else:
                self._took_over(wf, None if rec is None else rec.owner)
        self._now_owner(wf)
        t0 = self._server_clock.now()
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
            if not unstarted:  # a workflow cancelled before it started never starts
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
        result.spec_digest = wf.digest
        result.submitted_at = wf.submitted_at
        result.finished_at = self._server_clock.now()
        result.duration_ms = round((result.finished_at - min(t0, wf.submitted_at)) * 1000, 3)
        return result, False

    async def _fanout(self, wf: Workflow) -> WorkflowResult:
        spec = wf.spec
        stop = wf.stopper()  # a cancel (``Workflow.cancel``)
        # Cancelled before it started here (a takeover of a recorded cancel): no step starts.
        tasks = {
            self._loop.create_task(self._step(wf, i, s, s.payload)): i
            for i, s in enumerate(spec.steps)
            if not stop.done()
        }
        pending = set(tasks)
        # The steps to stop below: those still running, or every one if none started.
        to_stop = list(range(len(spec.steps))) if stop.done() else []
        succeeded = failed = unneeded = 0
        first_error: TaskRecord | None = None
        decided = False  # by the policy, before every step finished
        n = len(spec.steps)
        try:
            while pending:
                waiting: set[asyncio.Future[Any]] = {*pending, stop}
                done, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
                for t in pending & done:  # (the stop aside)
                    pending.discard(t)
                    rec = self._record_of(wf, tasks[t], t)
                    if rec.state is TaskState.SUCCEEDED:
                        succeeded += 1
                    elif rec.cancelled and not rec.state.final:
                        # Stopped as unneeded by the hub this one took it over from: it can
                        # no longer succeed, but it is no failure (nor the fanout's error).
                        unneeded += 1
                    else:
                        failed += 1
                        first_error = first_error or rec
                out = failed + unneeded
                if spec.policy != "all" and (succeeded >= wf.need or n - out < wf.need):
                    decided = True
                    break
                if pending and stop.done():
                    break  # the rest are cancelled below, as unneeded
        finally:
            if pending:
                await self._end_branches(wf, tasks, pending)
            for t in tasks:  # a branch's error is reported once, by the branch we acted on
                if t.done() and not t.cancelled():
                    t.exception()
        if decided:
            # A branch that ran on to its outcome through the cancel (an await in it swallowed
            # the cancellation: Python 3.11's ``wait_for``, under nats-py's requests, returns
            # a result that came with it — raised again now, ``_nats._Connection``; or one
            # that came as the branch ended) decided its step: that outcome is kept, not fenced
            # as unneeded. Its record was read PENDING by the stop (an outcome of the current
            # attempt writes nothing) and the result thrown away — chaos secure seed 179,
            # ``partition``, chaos-179-00590: a SUCCEEDED stored 1 s before the deciding one,
            # its step event sent, reported stopped as unneeded.
            ran_on = {
                t for t in pending if t.done() and not t.cancelled() and t.exception() is None
            }
            for t in ran_on:
                self._record_of(wf, tasks[t], t)
            pending -= ran_on
        to_stop += sorted(tasks[t] for t in pending)
        if to_stop:
            if not decided:
                await self._record_cancel(wf)  # before any step is stopped for it
            cancelled = await asyncio.gather(
                *(self._cancel_step(wf, i, settle=not decided) for i in to_stop),
                return_exceptions=True,
            )
            for err in cancelled:
                if isinstance(err, Exception):
                    raise err  # not an outcome: the workflow goes back to JetStream
            if not decided:  # the steps settled above count as the loop's would have
                done_recs = [wf.records[i] for i in sorted(wf.records)]
                succeeded = sum(r.state is TaskState.SUCCEEDED for r in done_recs)
                failed = max(
                    failed,
                    sum(r.state.final and r.state is not TaskState.SUCCEEDED for r in done_recs),
                )
                first_error = first_error or next(
                    (r for r in done_recs if r.state.final and r.state is not TaskState.SUCCEEDED),
                    None,
                )
                # Settled steps may meet the policy (or put it out of reach): its outcome then.
                out = failed + unneeded
                decided = spec.policy != "all" and (succeeded >= wf.need or n - out < wf.need)
        # Cancelled: unless the policy had decided, or every step had finished anyway (the
        # outcome stands then: no valid result is thrown away for a cancel that came late).
        stopped = None if decided else self._stopped(wf)
        wf.cancel_won = stopped is not None
        if stopped is not None:
            state = TaskState.FAILED
        elif succeeded >= wf.need:
            state = TaskState.SUCCEEDED
        elif first_error is not None and all(
            r.state is TaskState.TIMEOUT
            for r in wf.records.values()
            if r.state.final and r.state is not TaskState.SUCCEEDED
        ):
            state = TaskState.TIMEOUT
        else:
            state = TaskState.FAILED
        # A step kept as its current attempt decided it whose record a stale stop fenced
        # since: the record says so too (a taken-over run only).
        await self._record_kept(wf)
        steps = self._step_results(wf)
        return WorkflowResult(
            workflow_id=wf.id,
            kind="fanout",
            policy=spec.policy,
            state=state,
            steps=steps,
            result=[s.result if s.ok else None for s in steps],
            error=stopped
            or (
                None
                if state is TaskState.SUCCEEDED or first_error is None
                else _step_error(first_error)
            ),
        )

    async def _end_branches(
        self,
        wf: Workflow,
        tasks: dict[asyncio.Task[TaskRecord], int],
        pending: set[asyncio.Task[TaskRecord]],
    ) -> None:
        """Cancel the fanout's branches still running (``pending``), and wait for them to end:
        cancelled again every ``BRANCH_RECANCEL`` s, for up to ``BRANCH_STOP_WAIT`` s. An await
        swallowed a cancellation — Python 3.11's ``wait_for`` under nats-py's requests (the
        branch's status stream read), when the answer came with the cancel: waited for once,
        such a branch held the result and the stop of every other unneeded branch up while it
        ran on, recording and sending new attempts — chaos secure seed 184, ``node_stop``,
        chaos-184-00972: an ``any`` fanout decided at 20.04 stored its result at 43.02, and an
        unneeded step, fenced only then, ran its attempt 16 at 42.04. nats-py's swallowing
        awaits raise it now (``_nats._Connection``, ``reach_mesh._cancels``); these cancels
        again, and ``Workflow.branches_stopped`` (a branch that runs on starts nothing new),
        are the backstop for any other await that would. One still running past the wait is
        left to end by itself (its step is fenced below all the same)."""
        wf.branches_stopped = True
        loop = self._loop
        until = loop.time() + BRANCH_STOP_WAIT
        left = set(pending)
        try:
            while left:
                for t in left:
                    t.cancel()
                wait = min(BRANCH_RECANCEL, until - loop.time())
                if wait <= 0:
                    break
                _, left = await asyncio.wait(left, timeout=wait)
            for t in left:
                log.warning(
                    "workflow %s: step %d ran on through %g s of cancellations; not waited for",
                    wf.id,
                    tasks[t],
                    BRANCH_STOP_WAIT,
                )
                self._in_hand(wf, tasks[t])
        finally:
            for t in left:  # (also when this wait is cancelled: the hub stopping)
                self._background(t)  # its end, whatever it is, is nobody's outcome

    def _in_hand(self, wf: Workflow, index: int) -> None:
        """The outcomes step ``index``, still running, has in hand and has not applied (the one
        it is deciding by, then those queued), as its end would leave them in
        ``Workflow.unapplied``: its stop settles it from them. It may be stuck writing a
        success whose agent is still retrying its store, stored nowhere else yet; fenced from
        its record, that result would be thrown away (chaos secure seed 179's class)."""
        step = wf.spec.steps[index]
        track = self._tracker.track(protocol.task_key(wf.ns, step_task_id(wf.id, index, step)))
        if track is None:
            return
        held = ([track.deciding] if track.deciding is not None else []) + list(track.outcomes)
        if held:
            wf.unapplied[index] = held

    async def _chain(self, wf: Workflow) -> WorkflowResult:
        spec = wf.spec
        previous: Any = None
        state = TaskState.SUCCEEDED
        error: ErrorBody | None = None
        stop = wf.stopper()
        swept = False
        ended = len(spec.steps)  # the step the chain ended at, when before its last
        for i, step in enumerate(spec.steps):
            rec: TaskRecord | None
            if stop.done():
                if (wf.cancel_recorded or wf.taken_over) and not swept:
                    # Taken over (with a cancel its owner took, or one taken since): steps of
                    # the previous owner may be out there. Stop what was not stopped yet;
                    # steps that had finished keep their outcomes.
                    swept = True
                    await self._record_cancel(wf)
                    for j in range(i, len(spec.steps)):
                        await self._cancel_step(wf, j, settle=True)
                rec = wf.records.get(i) if swept else None
                if rec is None or not rec.state.final:
                    state, error = TaskState.FAILED, stop.result()  # the rest never start
                    wf.cancel_won = True
                    break
            else:
                payload = step.payload if i == 0 else merge_payload(previous, step.payload)
                rec = await self._chain_step(wf, i, step, payload)
                if rec is None:
                    state, error = TaskState.FAILED, stop.result()
                    wf.cancel_won = True
                    ended = i
                    break
            wf.records[i] = rec
            if rec.state is not TaskState.SUCCEEDED:
                state = rec.state if rec.state.final else TaskState.FAILED
                error = _step_error(rec)
                ended = i
                break
            previous = rec.result
        if wf.taken_over and not swept:
            # The hub this one took the chain from may still be running it (it has not
            # noticed yet, and may have seen another outcome first): the steps after the one
            # the chain ended at are fenced before the result is stored, so that it cannot
            # start them (its create of a step's record fails; it finds the step cancelled).
            for j in range(ended + 1, len(spec.steps)):
                await self._cancel_step(wf, j, settle=True)
        steps = self._step_results(wf)
        return WorkflowResult(
            workflow_id=wf.id,
            kind="chain",
            state=state,
            steps=steps,
            result=previous if state is TaskState.SUCCEEDED else None,
            error=error,
        )

    async def _chain_step(
        self, wf: Workflow, index: int, step: StepSpec, payload: Any
    ) -> TaskRecord | None:
        """Run a chain's step (inline: a task of its own per step cost 8 % of a chain's
        throughput); a cancel interrupts it (``Workflow.cancel``). None when a cancel stopped
        it before it finished (a step that had finished keeps its outcome)."""
        wf.step_task = asyncio.current_task(self._loop)
        try:
            rec = await self._step(wf, index, step, payload)
        except asyncio.CancelledError:
            if not wf.take_back():
                raise  # the workflow itself is cancelled (the hub stops)
            rec = None
        finally:
            wf.step_task = None
        if rec is not None:
            wf.take_back()  # interrupted as it ended: the loop top stops the chain
            return rec
        await self._record_cancel(wf)  # before the step is stopped for it
        await self._cancel_step(wf, index, settle=True)  # fenced like an unneeded branch
        got = wf.records.get(index)
        return got if got is not None and got.state.final else None

    def _record_of(self, wf: Workflow, index: int, task: asyncio.Task[TaskRecord]) -> TaskRecord:
        exc = task.exception()
        if isinstance(exc, NotOwnerError) or (exc is not None and _durable.infrastructure(exc)):
            # Not an outcome: the workflow goes back to JetStream and resumes from the records
            # (an answer of NATS's own during an election included: two such, taken for the
            # step's failure, ended fanouts FAILED under chaos node_stop).
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

    def _stopped(self, wf: Workflow) -> ErrorBody | None:
        """The cancel's error if a cancel stopped ``wf`` before all its steps finished."""
        stop = wf.stop
        if stop is None or not stop.done():
            return None
        n = len(wf.spec.steps)
        if all((r := wf.records.get(i)) is not None and r.state.final for i in range(n)):
            return None
        return stop.result()

    async def _record_cancel(self, wf: Workflow) -> None:
        """Write the cancel into the workflow record (a CAS on this hub's revision) before
        any step is stopped for it: a hub that takes the workflow over then finishes the
        cancel instead of finding steps stopped for no reason. ``NotOwnerError`` when
        another hub took the workflow over: this one stops nothing then."""
        if wf.cancel_recorded or wf.stop is None or not wf.stop.done():
            return
        record = self._running_record(wf)
        record.cancel = wf.stop.result()
        try:
            await self._owner_write(wf, record)
        except KeyWrongLastSequenceError as err:
            raise NotOwnerError(protocol.workflow_key(wf.ns, wf.id)) from err
        wf.cancel_recorded = True

    def _running_record(self, wf: Workflow) -> WorkflowRecord:
        """The workflow record of ``wf`` while this hub runs it (not final)."""
        return WorkflowRecord(
            spec=wf.spec,
            spec_digest=wf.digest,
            owner=self.hub_id,
            trace_id=wf.trace_id,
            submitted_at=wf.submitted_at,
            first_agents=wf.first_agents,
            submission_seq=wf.seq,
        )

    async def _owner_write(
        self, wf: Workflow, record: WorkflowRecord, data: bytes | None = None
    ) -> None:
        """Write the workflow record (``data``: encoded already) with a CAS on this hub's own
        revision (``wf.rev``, then the new one). ``KeyWrongLastSequenceError`` when another
        hub wrote it since.

        A record that is not there at all was not taken over (a takeover writes one naming
        its hub): it is gone — its bucket deleted — and is written again, as a create (of
        this hub and one taking the workflow over meanwhile, one wins)."""
        kv = self._wf_kv
        assert kv is not None
        key = protocol.workflow_key(wf.ns, wf.id)
        body = protocol.encode(record) if data is None else data
        deadline = self._io_deadline(wf.deadline)
        try:
            wf.rev = await _durable.cas(kv, key, body, wf.rev, deadline, on_retry=self._infra_retry)
        except KeyWrongLastSequenceError:
            if wf.rev == 0:
                raise  # a create: the record exists
            if await self._io(f"read {key}", lambda: _durable.get(kv, key), None) is not None:
                raise
            log.warning("workflow %s: its record was gone; written again", wf.id)
            wf.rev = await _durable.create(kv, key, body, deadline, on_retry=self._infra_retry)


# --------------------------------------------------------------------------- helpers


def final_result(got: tuple[bytes, int] | None) -> WorkflowResult | None:
    """The stored final result of a workflow record, if it has one."""
    rec = stored_record(WorkflowRecord, got)
    if rec is not None and rec.result is not None and rec.state.final:
        return rec.result
    return None


def _step_error(rec: TaskRecord) -> ErrorBody:
    if rec.error is not None:
        return rec.error
    return ErrorBody(code=ReachError.code, message=f"step {rec.step} ended {rec.state.value}")
