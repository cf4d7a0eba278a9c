"""Stopping the steps of a workflow the hub owns that are no longer needed (a fanout's branches
its policy decided without, a cancelled workflow's steps): each fenced from its record as the
stream's leader has it, its agents told to drop or stop its attempts, and an outcome an attempt
stored before the stop kept (``settle``).

The base of :class:`~reach_mesh.hub._shapes.WorkflowShapes`; on
:class:`~reach_mesh.hub._steps.StepRunner`.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Final, Literal

from nats.js.errors import KeyWrongLastSequenceError

from reach_mesh import protocol
from reach_mesh._retry import RetriesExhausted
from reach_mesh.errors import (
    MeshUnavailableError,
)
from reach_mesh.hub import _durable
from reach_mesh.hub._step_state import new_record, note, settles
from reach_mesh.hub._steps import NotOwnerError, StepRunner, Workflow
from reach_mesh.models import TaskState
from reach_mesh.workflow import (
    TaskRecord,
    TaskStatusEvent,
    WorkflowRecord,
    step_task_id,
    stored_record,
)

__all__ = ["LEADER_HEARD", "StepStopping"]

log = logging.getLogger("reach_mesh.hub.workflows")

#: How a stopped step's record write went (``StepStopping._write_stopped``).
Stopped = Literal["written", "moved", "not ours"]
#: How long (s) a stop whose record moved asks the leader again for the move
#: (``StepStopping._stop_again``).
_MOVED_WAIT: Final = 3.0
#: How long (s) the stop of a step whose record this run did not write asks again for the
#: workflow record when no leader that heard from a quorum answers (``_still_ours``): an
#: election after a partition heals takes a moment, and a guess of whose the step is fenced
#: the step that had decided the workflow for its new owner.
_OWNER_WAIT: Final = 3.0
#: The workflow record's leader is believed (``_still_ours``) if it heard from a quorum of its
#: replicas within this long (s): one cut off from them keeps leading, and answering from what
#: it had, for some ten seconds.
LEADER_HEARD: Final = 2.0
#: How long (s) a taken-over fanout's run reads and rewrites the record of a step its current
#: attempt decided that a stale stop fenced (``StepStopping._record_kept``): best effort, the
#: result is not held up longer.
_KEPT_WAIT: Final = 2.0


class StepStopping(StepRunner):
    """Stopping steps no longer needed (see the module's docstring)."""

    hub_id: str

    async def _record_now(
        self, ns: str, workflow_id: str, end: float | None = None, *, quorate: bool = False
    ) -> tuple[bytes, int] | None:
        """The workflow record (value, revision) at its stream's leader (``WorkflowShapes``)."""
        raise NotImplementedError

    async def _cancel_step(self, wf: Workflow, index: int, *, settle: bool = False) -> None:
        """Mark a branch the policy no longer needs: agents drop its undelivered attempts.

        ``settle`` (a cancel of the workflow): a step whose outcome an attempt stored in
        ``REACH_STATUS`` but the hub has not applied (it finished while being cancelled, or
        before a takeover: a step decided by its current attempt has no final record) keeps
        that outcome instead of being marked cancelled."""
        assert self._tasks_kv is not None
        kv = self._tasks_kv
        step = wf.spec.steps[index]
        task_id = step_task_id(wf.id, index, step)
        key = protocol.task_key(wf.ns, task_id)
        # A direct get is answered by any replica, and one behind the step's last write gives
        # an older attempt (its agents told to stop, the current one left running, unfenced)
        # or "no such key" (a step whose attempt no workflow record holds taken for never
        # started). An unneeded branch is fenced once, from the leader's record; a cancel's
        # compare-and-set finds a stale read out, and a missing record is asked of the leader.
        read = _durable.get if settle else _durable.get_at_leader
        try:
            got = await self._io(f"read {key}", lambda: read(kv, key), None)
        except RetriesExhausted:
            if settle:
                raise
            # The leader unreachable past the retries (an election: a killed server led the
            # records): an unneeded branch is stopped best effort, from any replica's record
            # (a stale one fails the compare-and-set: read again, ``_stop_again``). Raised,
            # it handed the whole workflow back — chaos secure seed 154, ``node_kill``: ten
            # workflows so, two never delivered again. But a replica with no record of the
            # step may be behind its create: "never started" is not concluded from it (the
            # same seed's ``partition``: two branches so taken for unstarted ran after the
            # result), and the workflow goes back as before.
            got = await self._io(f"read {key}", lambda: _durable.get(kv, key), None)
            if got is None:
                raise
        if got is None and settle:
            got = await self._io(f"read {key}", lambda: _durable.get_at_leader(kv, key), None)
        own = wf.written.pop(index, None)
        if own is not None and own[1] > (0 if got is None else got[1]):
            # Behind this hub's own last write of the record (a replica read while no leader
            # answered: chaos secure seed 171, ``node_stop``, a server SIGSTOPped through two
            # writes): the attempts it names are not all that were sent, and stopped from it,
            # the step's current attempt ran on, unfenced, reported never sent. Stopped from
            # the record as this hub wrote it instead.
            got = (protocol.encode(own[0]), own[1])
        # The record as this hub last wrote it (or, revision 0, the attempt 1 its workflow
        # record names): the normal end of a branch, stopped with no read of the owner.
        mine = own is not None and own[1] == (0 if got is None else got[1])
        await self._stop_step(wf, index, task_id, got, settle=settle, mine=mine)

    async def _stop_step(
        self,
        wf: Workflow,
        index: int,
        task_id: str,
        got: tuple[bytes, int] | None,
        *,
        settle: bool,
        carried: TaskStatusEvent | None = None,
        again: bool = True,
        mine: bool = False,
    ) -> None:
        """``_cancel_step`` from the step's record as read (``got``: value and revision);
        ``mine``: the record is as this hub last wrote it (``_write_stopped``).

        An unneeded branch whose record moved after it was read at the leader (a write in
        flight when it became unneeded: its runner's next attempt, a hub still running the
        workflow behind a partition, that sent the attempt it recorded) is stopped from the
        record read at the leader once more (``again``), with the outcome the first pass took
        from ``Workflow.unapplied`` (``carried``): the attempt the read missed would
        otherwise be left unfenced and running. Then best effort, as the first pass."""
        key = protocol.task_key(wf.ns, task_id)
        if got is not None:
            rec = TaskRecord.model_validate_json(got[0])
            if not rec.is_step(wf.id, index):
                # Its task id is another workflow's: never sent for this one, nothing to stop
                # (and theirs is not ours to touch). Only ``_step`` reports the conflict, when
                # the step is reached.
                return
        else:
            # No record: its attempt 1, if sent, is the one the workflow record names.
            named = self._named_attempt(wf, index, task_id)
            if named is None:
                await self._fence_unstarted(wf, index, task_id, key, settle=settle)
                return
            rec = named
        last = 0 if got is None else got[1]
        if not rec.state.final and not rec.cancelled:
            # An outcome the step had in hand and had not applied when it was stopped first:
            # it may be stored nowhere else yet. Then, settling, what the status stream holds.
            event = carried if carried is not None else self._unapplied(wf, index, rec)
            if event is None and settle:
                event, _ = await self._stored_outcome(wf, index, rec)
            elif event is None and (wf.taken_over or not mine):
                event = await self._unheard_outcome(wf, index, rec)
            if event is not None:  # as ``_finish`` applies an outcome
                note(rec, event)
                self._take_outcome(rec, event)
                rec.decided_by = event.attempt
                rec.updated_at = self._server_clock.now()
                # Recorded: a record read from a replica behind its last write (a TIMEOUT,
                # a next attempt) is not overruled unseen, and an outcome only in hand (or
                # in its agent's memory) is kept — a restart that lost it, redelivered the
                # same attempt, must find the step final (dropped), not run it again.
                wrote = await self._write_stopped(wf, key, rec, last, settle=settle, mine=mine)
                if (
                    wrote == "moved"
                    and again
                    and await self._stop_again(wf, index, task_id, event, last)
                ):
                    return
                if wrote == "not ours":
                    wf.records[index] = rec  # (its outcome, though the new owner's to store)
                    return
                self._stop_others(rec, event.attempt)  # none other is needed any more
        if rec.state.final:
            wf.records[index] = rec
            # Cancelled right after its record was written (by the deadline, by an earlier
            # attempt), its markers may be missing: store them (deduplicated).
            await self._remark(wf, rec)
            return
        if not rec.cancelled:
            rec.cancelled = True
            # A step fenced before (a cancel finished again after a takeover) keeps the time
            # it was fenced: when the cancel decided it, which the writes again do not change.
            rec.updated_at = self._server_clock.now()
        wf.records[index] = rec
        wrote = await self._write_stopped(wf, key, rec, last, settle=settle, mine=mine)  # fence
        if wrote == "moved" and again and await self._stop_again(wf, index, task_id, None, last):
            return
        if wrote == "not ours":
            return
        # Every attempt it sent, not only the current one: the branch may have been cancelled
        # between a fence-first record and its marker. A failure here is the workflow's
        # (``_fanout`` raises it): the result must not be stored before the markers are.
        await self._remark(wf, rec)
        self._stop_others(rec, None)

    async def _record_kept(self, wf: Workflow) -> None:
        """Before a fanout run that took its workflow over stores the result: the record of
        each step its current attempt decided (which writes nothing on the normal path: the
        record stays as the attempt was sent), read at the leader, written with that outcome
        when it was fenced ``cancelled`` since — a compare-and-set on the revision read.

        The fence is a stop by a hub that had lost the workflow without noticing, written
        after this run adopted the step's attempt (``_fence_taken``) and before that attempt
        decided it: a read of the workflow record that did not answer is taken for "still
        ours" (``_still_ours``), and a read-then-write is no lock. The success ended before
        the stop and is kept (no valid result is thrown away), but the record — the task view,
        the API, the agents' fence reads — said the step was stopped, against the stored
        result (chaos secure seed 209, ``node_stop``, chaos-209-00780). Only a run that took
        the workflow over can find such a fence (no other hub ran it before this one), so the
        normal path reads nothing; a read or write that fails within ``_KEPT_WAIT`` s leaves
        the record as it is (the result is right either way)."""
        if not wf.taken_over:
            return
        kept = [
            (index, rec)
            for index, rec in sorted(wf.records.items())
            if rec.state.final and not rec.cancelled and rec.decided_by == rec.attempt > 0
        ]
        if kept:
            await asyncio.gather(*(self._record_kept_step(wf, i, rec) for i, rec in kept))

    async def _record_kept_step(self, wf: Workflow, index: int, rec: TaskRecord) -> None:
        """``_record_kept`` for step ``index``, decided by its current attempt (``rec``)."""
        assert self._tasks_kv is not None
        kv = self._tasks_kv
        key = protocol.task_key(wf.ns, rec.task_id)
        until = self._loop.time() + _KEPT_WAIT
        try:
            got = await _durable.retrying(
                f"read {key}",
                lambda: _durable.get_at_leader(kv, key),
                until,
                on_retry=self._infra_retry,
            )
            if got is None:
                return
            stored = TaskRecord.model_validate_json(got[0])
            if (
                not stored.is_step(wf.id, index)
                or stored.state.final
                or not stored.cancelled
                or stored.attempt != rec.attempt
            ):
                return  # as this run left it (or final, or another attempt's: not ours)
            await _durable.cas(
                kv, key, protocol.encode(rec), got[1], until, on_retry=self._infra_retry
            )
        except Exception:
            log.info("%s: its record, fenced after its success, not rewritten", key, exc_info=True)
            return
        log.info(
            "%s: its record was fenced cancelled after attempt %d decided it; written %s",
            key,
            rec.attempt,
            rec.state.value,
        )

    async def _stop_again(
        self, wf: Workflow, index: int, task_id: str, carried: TaskStatusEvent | None, last: int
    ) -> bool:
        """``_stop_step`` of an unneeded branch whose fence found its record moved since it
        was read (at revision ``last``, 0: not found): from the record read at the leader
        again, once (``carried``: the outcome the first pass applied). The read must show the
        move: a server the stream's leader was, stopped (SIGSTOP, a stalled VM) and running
        again, answers as the leader for a moment from what it had before — chaos seed 152,
        ``node_stop``: the first read found no record of a step whose attempt 2 ran, and the
        second read would have found the same. Asked again for up to ``_MOVED_WAIT`` s
        meanwhile. False when no read shows it: the caller stops the step from the record it
        had, best effort, as before."""
        assert self._tasks_kv is not None
        kv = self._tasks_kv
        key = protocol.task_key(wf.ns, task_id)
        loop = asyncio.get_running_loop()
        until = loop.time() + _MOVED_WAIT
        pause = 0.05
        while True:
            try:
                got = await self._io(f"read {key}", lambda: _durable.get_at_leader(kv, key), None)
            except Exception:
                log.debug("reading %s again to stop it failed", key, exc_info=True)
                return False
            if got is not None and got[1] > last:
                break
            if loop.time() + pause > until:
                log.info("%s: its record's move not seen at the leader; stopped as read", key)
                return False
            await asyncio.sleep(pause)
            pause = min(pause * 2, 0.5)
        await self._stop_step(wf, index, task_id, got, settle=False, carried=carried, again=False)
        return True

    async def _write_stopped(
        self, wf: Workflow, key: str, rec: TaskRecord, last: int, *, settle: bool, mine: bool
    ) -> Stopped:
        """Write a stopped step's record, a CAS on the revision read (``last``). Settling (a
        cancel of the workflow) it must land: a record read from a replica behind its last
        write is not overruled by this one; a lost race or outlived retries send the workflow
        back to JetStream (``NotOwnerError``, ...), and the cancel is finished from fresh
        reads. For a branch the policy no longer needs it is best effort.

        "moved" when the record moved since it was read and the workflow is still this hub's
        (``_stop_again``). "not ours" when the step is not this hub's to stop: the record
        moved and the workflow record names another owner now (this hub lost the workflow
        without noticing). The new owner adopted the step's attempts; telling their agents to
        stop would stop a handler it is waiting on and make it run the step again. A move this
        hub cannot explain (the workflow record unreadable: most likely an election, and
        the workflow still its own) is "moved": the step is stopped, with its fence markers
        — a branch left running unfenced could still run its queued attempt later.

        A record this hub did not write last (not ``mine``: another hub's, or none) is
        written only while the workflow record at the leader is this run's (``_still_ours``:
        naming this hub, at the run's revision; "not ours" otherwise, nothing written). A
        compare-and-set on such a record's revision lands whoever owns the workflow: a hub
        that lost it without noticing and whose policy decided on its own branch's outcome
        fenced, as unneeded, the step that had decided
        the workflow for the new owner — by its current attempt, so the record unmoved
        since that owner made it — and the step's record read ``cancelled`` against the
        stored result (chaos secure seed 177, ``node_stop``, chaos-177-00596). That read is
        believed only from a leader that heard from a quorum lately, and asked again for a
        while when none answers (``patient``): chaos secure seed 203, ``partition``,
        chaos-203-00822. The owner's own branches (the normal path) are stopped with no read
        of the workflow record."""
        if settle:
            await self._cas(key, rec, last, wf.deadline)
            return "written"
        assert self._tasks_kv is not None
        if not mine and not await self._still_ours(wf, patient=True):
            return "not ours"
        try:
            await _durable.cas(self._tasks_kv, key, protocol.encode(rec), last, self._io_deadline())
        except KeyWrongLastSequenceError:
            # Another hub's write, or a write of this hub's that landed after the read (its
            # runner's, in flight when the branch became unneeded).
            return "moved" if await self._still_ours(wf) else "not ours"
        except Exception:
            pass  # best effort: the attempts are stopped all the same
        return "written"

    async def _still_ours(self, wf: Workflow, *, patient: bool = False) -> bool:
        """Whether the workflow record at the leader is still this run's: naming this hub at
        the revision the run last wrote (``wf.rev``: every write of it while the run lives is
        the run's own, awaited, none in flight during a stop), or naming none; True when it
        cannot be read (an election: most likely still its own) — ``patient``: asked again
        for up to ``_OWNER_WAIT`` s first.

        Read only from a leader that heard from a quorum of its replicas within
        ``LEADER_HEARD`` s (its ``STREAM.INFO``), and ``patient`` with a read that fails:
        chaos secure seed 203, ``partition``, chaos-203-00822. ``n1``, leading the workflow
        records, was cut off for 6.4 s with the ``quorum(2)`` fanout's first owner; the others
        elected ``n2``, and a second hub took the fanout over there and made its steps'
        records. Healed, the first owner heard step 1's success, its policy decided, and it
        stopped step 2 as unneeded: a record it had not written, so it asked whose the
        workflow was — and ``n1`` answered, within 0.15 s of the routes coming back: still
        leading (a cut-off leader steps down after some ten seconds, or on hearing of a higher
        term: 0.06 s before the fence), with the record as it was, or with no metadata leader
        yet (until 37 ms after the fence: every leader read it takes is answered "JetStream
        system temporarily unavailable" at once), taken for "still ours". Either way the fence
        landed, 0.24 s before step 2's success, stored late, decided the workflow for the new
        owner, and its record read ``cancelled`` against the stored result.

        The hub's id alone does not tell: a second run of the workflow on this same hub (its
        hand-back adopted here, then the submission delivered here again) takes it over by a
        compare-and-set that leaves the owner as it was, and the first run, decided by
        another branch, fenced the step that decided it for the second — chaos secure seed
        182, ``partition``: four fanouts so, each step record ``cancelled`` against the
        stored result."""
        loop = asyncio.get_running_loop()
        give_up = loop.time() + (_OWNER_WAIT if patient else 0.0)
        pause = 0.05
        while True:
            try:
                got = await self._record_now(wf.ns, wf.id, loop.time() + 2.0, quorate=True)
                break
            except MeshUnavailableError as err:
                if loop.time() + pause > give_up:
                    if patient:
                        log.info(
                            "workflow %s: its record not read at a leader for %g s (%s); "
                            "taken for still this hub's",
                            wf.id,
                            _OWNER_WAIT,
                            err,
                        )
                    return True
                await asyncio.sleep(pause)
                pause = min(pause * 2, 0.5)
        record = stored_record(WorkflowRecord, got)
        if got is None or record is None or record.owner is None:
            return True
        return record.owner == self.hub_id and got[1] == wf.rev

    async def _unheard_outcome(
        self, wf: Workflow, index: int, rec: TaskRecord
    ) -> TaskStatusEvent | None:
        """For an unneeded branch of a run that may not have heard all its attempts said (it
        took the workflow over or resumed it, or the record is not as this run wrote it): the
        outcome an attempt stored in ``REACH_STATUS`` that decides the step
        (``_stored_outcome``, without asking its agent), or None — also when the stream does
        not answer: the branch is fenced then, best effort, as before.

        An outcome stored while no hub listened (its owner gone, cut off) is heard by the run
        that takes the workflow over only when its runner reads it back (``catch_up``), after
        its record's read and write: a policy that run decides first, on a record already
        final, stopped the branch as unneeded, and its stored outcome — one that met or
        decided the policy, in the order the outcomes were stored — was reported PENDING,
        stopped (chaos secure seed 184, ``partition``: chaos-184-00574's TIMEOUT stored 3.6 s
        before the last takeover, chaos-184-00828's first success). Kept, it decides the step
        as a branch that ran on to its outcome does (``_fanout``'s ``ran_on``). The owner's
        own branches (``mine``, no takeover) heard every outcome its subscription delivered
        (those not applied are ``Workflow.unapplied``): stopped with no read.

        The reads are one per attempt's agent: one that fails leaves out that agent's outcome
        only, not one another agent's read found (which decides the step as well; a branch
        stopped for a read of a third agent it did not need lost it)."""
        unread: list[Exception] = []
        event, _ = await self._stored_outcome(
            wf, index, rec, patient=False, held=False, unread=unread
        )
        if unread:
            log.debug(
                "%s: the stored status of %d of its attempts' agents could not be read to stop "
                "it%s",
                rec.task_id,
                len(unread),
                "" if event is None else " (stopped with another's)",
                exc_info=unread[0],
            )
        return event

    def _unapplied(self, wf: Workflow, index: int, rec: TaskRecord) -> TaskStatusEvent | None:
        """The outcome that decides step ``index`` among those it had in hand and had not
        applied when it was stopped (``Workflow.unapplied``, in the order the step would have
        taken them): a success, or a failure it would not have retried; None if none would
        have decided it (the step is cancelled then)."""
        events = wf.unapplied.pop(index, None)
        if not events:
            return None
        retries = self._policy(wf.spec.steps[index]).retries
        failures = rec.handler_failures
        for event in events:
            settled, failures = settles(event, failures, retries)
            if settled:
                return event
        return None

    async def _fence_unstarted(
        self, wf: Workflow, index: int, task_id: str, key: str, *, settle: bool
    ) -> None:
        """A step that no attempt was sent for (no record at the leader, none named in the
        workflow record): its record is created, cancelled, before the result is stored. A
        hub that lost the workflow and still runs it (a takeover it has not noticed) then
        finds the step cancelled when it gets there — its own create of the record fails —
        instead of starting it after the result: "never started" is true when it is read,
        and such a create may still be in flight (chaos secure seed 177, ``node_stop``: the
        previous owner's creates, retried through the elections, landed after the new
        owner's result, and three unneeded branches reported never sent ran to their end).

        Settling (a cancel of the workflow) it must land; a record made meanwhile (that hub
        started the step first) is fenced as any other. For an unneeded branch it is best
        effort, as its other fences: a record made meanwhile is stopped from the leader's
        read (``_stop_again``)."""
        rec = new_record(wf, index, task_id, self._server_clock.now())
        rec.cancelled = True
        if not settle:
            wrote = await self._write_stopped(wf, key, rec, 0, settle=False, mine=False)
            if wrote == "written":
                wf.records[index] = rec
            elif wrote == "moved":
                await self._stop_again(wf, index, task_id, None, 0)
            return
        try:
            await self._cas(key, rec, 0, wf.deadline)
        except NotOwnerError:
            kv = self._tasks_kv
            assert kv is not None
            got = await self._io(f"read {key}", lambda: _durable.get(kv, key), None)
            if got is None:
                # Read from a replica behind the write that beat ours: the workflow goes back
                # to JetStream, and the recorded cancel is finished from fresh reads.
                raise
            # It exists now: fenced from what was read (never read again here, so a replica
            # that lost it once more cannot bring the step back to this create).
            await self._stop_step(wf, index, task_id, got, settle=True)
            return
        wf.records[index] = rec

    async def _stored_outcome(
        self,
        wf: Workflow,
        index: int,
        rec: TaskRecord,
        *,
        patient: bool = True,
        held: bool = True,
        unread: list[Exception] | None = None,
    ) -> tuple[TaskStatusEvent | None, bool]:
        """The final status an attempt of ``rec`` stored in ``REACH_STATUS`` (the current
        attempt's first, else the earliest attempt's) or, none being stored, the outcome its
        current attempt's agent holds (``StatusTracker.held_outcome``; then True: held, not
        stored; not asked unless ``held``), or None. Only an outcome that decides the step, as
        ``_step`` would have taken it (``settles``): a success, a failure not to be retried,
        or one past the step's retries (a TIMEOUT with ``retries=0``). Raises when the stream
        does not answer (read ``patient``-ly): the workflow goes back to JetStream rather
        than a result be thrown away — unless ``unread`` is given: then an agent's read that
        fails is added to it and skipped, and what the others' reads found is answered (best
        effort: a success the failed read would have found is not preferred to it)."""
        # Attempts whose outcome the hub has not handled: one it had handled (a failure it
        # retried) is in the history with its final state, and decided nothing.
        open_ = {
            (h.attempt, h.agent_id)
            for h in rec.history
            if h.agent_id is not None and not h.state.final
        }
        if rec.agent_id is not None and rec.attempt > 0:
            open_.add((rec.attempt, rec.agent_id))
        agents = list(dict.fromkeys(a for _, a in sorted(open_, reverse=True) if a is not None))
        retries = self._policy(wf.spec.steps[index]).retries

        def decides(event: TaskStatusEvent) -> bool:
            # A success, or a failure not retried (a retryable one within the step's retries
            # would have been followed by another attempt: not finished).
            return event.state.final and settles(event, rec.handler_failures, retries)[0]

        found: list[TaskStatusEvent] = []
        # One read per agent, all at once: read one after another, a stream without a leader
        # held the stop a read's timeout per agent (up to ``_SETTLE_AGENTS`` of them).
        reads = await asyncio.gather(
            *(
                self._tracker.last_status(wf.ns, rec.task_id, agent_id, patient=patient)
                for agent_id in agents[:_SETTLE_AGENTS]
            ),
            return_exceptions=True,
        )
        for last in reads:
            if isinstance(last, BaseException):
                if unread is None or not isinstance(last, Exception):
                    raise last
                unread.append(last)
                continue
            if last is None or (last.attempt, last.agent_id) not in open_:
                continue
            if last.workflow_id is not None and last.workflow_id != wf.id:
                continue  # the same task id in another workflow (its record expired since)
            if decides(last):
                found.append(last)
        if not found and held and rec.agent_id is not None and rec.attempt > 0:
            # Nothing stored (yet): the current attempt's agent may hold its outcome.
            kept = await self._tracker.held_outcome(rec.task_id, wf.id, rec.agent_id, rec.attempt)
            if kept is not None and decides(kept):
                return kept, True
        # A success first (no valid result is thrown away), then the earliest attempt's.
        event = min(
            found,
            key=lambda e: (e.state is not TaskState.SUCCEEDED, e.attempt),
            default=None,
        )
        return event, False


#: Agents whose stored status a cancel reads for one step (its newest attempts').
_SETTLE_AGENTS = 4
