"""Reading back what a hub missed, and asking agents: :class:`StatusReads`, the base of
:class:`~reach_mesh.hub._tracking.StatusTracker` (which sets every attribute below).

A step's stored statuses are read from ``REACH_STATUS`` (``last_status``, ``catch_up``) when
its silence, a takeover, a reconnection of the statuses connection (``after_gap``), a deadline
(``missed_final``, ``given_up_final``) or a new attempt (``given_up_read``) calls for it — and
read again, patiently, when the stream did not answer (``_read_on``). An agent is asked about
its attempt over its ctl subject (``task_state``: ``probe``, ``recheck``, ``held_outcome``);
its answer, its silence or its lease says whether the attempt is done, alive or gone.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any, Final, Literal

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js import JetStreamContext
from nats.js.errors import NotFoundError
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from reach_mesh import protocol
from reach_mesh._guard import refuse_body
from reach_mesh._jspub import JsClient
from reach_mesh._retry import no_message
from reach_mesh.hub._step_state import kept_outcome
from reach_mesh.hub._step_track import StepTrack, parse_task_state
from reach_mesh.hub.breaker import DEAF, BreakerState
from reach_mesh.hub.registry import Registry
from reach_mesh.logs import LineBudget
from reach_mesh.models import AgentState, ErrorBody, TaskState
from reach_mesh.workflow import TaskStatusEvent

__all__ = ["StatusReads", "Verdict", "read_contexts"]


log = logging.getLogger("reach_mesh.hub.workflows")

_CTL_TIMEOUT: Final = 1.0
#: How long reading a step's last status from ``REACH_STATUS`` may take. Only the stream's
#: leader answers it, so through an election it gets no answer at all; the probe then asks the
#: agent instead (the read is an optimisation: a status this hub missed). Was the connection's
#: 10 s, which stalled every silent step that long while a NATS node was down.
_STATUS_READ_TIMEOUT: Final = 1.0
#: ... except before giving up an attempt whose agent is gone: then an unanswered read is
#: made again with this patience (a slow leader may hold the outcome that decides the step).
_STATUS_READ_PATIENT: Final = 10.0
#: How often an unanswered read is made again while a step at its deadline waits for the
#: status stream (``missed_final``, ``hold``).
_REREAD_PAUSE: Final = 0.5
#: At most this many agents' last statuses are read when catching up on a step.
_CATCH_UP_AGENTS: Final = 8
#: Steps whose statuses are read at once after the statuses connection comes back.
_GAP_READS: Final = 16

#: What asking an agent about the current attempt told us.
#: ``done``: its outcome is now known; ``alive``: the agent has it (or an older attempt of the
#: step) in hand — or gave no usable answer while its lease holds (silence is not "I do not
#: have it"); ``gone``: the agent does not have it, or is not there and its lease lapsed, or
#: it is there but deaf (heard after its ctl subject had no responders, which it still has);
#: ``unread`` (``probe`` only): the agent is gone, but the status stream, which may hold its
#: outcome, did not answer even a patient read — the attempt is kept and asked about again.
Verdict = Literal["done", "alive", "gone", "unread"]


def read_contexts(nc: NATS) -> tuple[JetStreamContext, JetStreamContext]:
    """The JetStream contexts ``REACH_STATUS`` is read through: (quick, patient) — timeouts
    ``_STATUS_READ_TIMEOUT`` and ``_STATUS_READ_PATIENT``."""
    return nc.jetstream(timeout=_STATUS_READ_TIMEOUT), nc.jetstream(timeout=_STATUS_READ_PATIENT)


class StatusReads:
    """The stored statuses of the steps a hub runs, read back, and their agents asked (the
    base of ``StatusTracker``). Everything here runs on the event loop without locks."""

    _nc: NATS
    #: Asks agents (ctl ``task_state``) with unguessable reply subjects.
    _jsc: JsClient
    #: ``REACH_STATUS`` read quickly, and patiently (``read_contexts``).
    _js: JetStreamContext
    _js_patient: JetStreamContext
    _registry: Registry
    _tracks: dict[str, StepTrack]
    #: Log lines, rationed per kind (``StatusTracker._said``): deaf agents, deadlines unread.
    _said: LineBudget
    #: Steps whose last ``task_state`` question found nobody on its agent's ctl subject
    #: (``StatusTracker._unanswered`` says what each holds).
    _unanswered: dict[str, tuple[str, int, float, bool]]
    #: Set while :meth:`after_gap` runs: a reconnection meanwhile has it read once more.
    _gap_running: bool
    _gap_again: bool

    if TYPE_CHECKING:

        def _now(self) -> float: ...

        def offer(self, track: StepTrack, event: TaskStatusEvent) -> None: ...

        def _authentic(self, sender: str, data: bytes, subject: str) -> TaskStatusEvent | None: ...

    # ------------------------------------------------------------------ asking

    async def last_status(
        self, ns: str, task_id: str, agent_id: str | None = None, *, patient: bool = False
    ) -> TaskStatusEvent | None:
        """The newest status event of a task in ``REACH_STATUS``: from ``agent_id``, or from
        any agent of ``ns`` when None. Raises when the stream did not answer (in
        ``_STATUS_READ_TIMEOUT``, or ``_STATUS_READ_PATIENT`` when ``patient``)."""
        stored = await self._last_stored(ns, task_id, agent_id, patient=patient)
        return None if stored is None else self._authentic(*stored)

    async def last_state(
        self, ns: str, task_id: str, agent_id: str
    ) -> tuple[int, TaskState, ErrorBody | None] | None:
        """(attempt, state, error) of the newest status of a task from ``agent_id``, read
        without its result or progress (a view of the step, not its outcome); None when there
        is none or it speaks for another agent. Raises as :meth:`last_status` does."""
        stored = await self._last_stored(ns, task_id, agent_id)
        if stored is None:
            return None
        if len(stored[1]) > self._limit:
            # Read whole, as the step's owner reads it: it may hold what no record can.
            event = self._kept(self._parse_status(stored[1], stored[2]), len(stored[1]))
            if event is None or event.agent_id != stored[0]:
                return None
            return event.attempt, event.state, event.error
        try:
            head = protocol.validate_json(_StatusHead.model_validate_json, stored[1])
        except ValidationError:
            return None
        return None if head.agent_id != stored[0] else (head.attempt, head.state, head.error)

    async def _last_stored(
        self, ns: str, task_id: str, agent_id: str | None, *, patient: bool = False
    ) -> tuple[str, bytes, str] | None:
        """(the agent its subject names, its body, its subject) of the newest stored status of
        a task."""
        sender = agent_id if agent_id is not None else f"{ns}.*.*"
        js = self._js_patient if patient else self._js
        try:
            raw = await js.get_last_msg(
                protocol.STREAM_STATUS, protocol.task_status(sender, task_id)
            )
        except NotFoundError as err:
            if not no_message(err):
                raise  # the stream itself is not there (recovering): nothing is known
            return None
        ident = protocol.status_identity(raw.subject or "")
        if ident is None or not raw.data:
            return None
        return ident[0], raw.data, raw.subject or ""

    async def catch_up(
        self,
        track: StepTrack,
        agents: list[str] | None = None,
        *,
        patient: bool = False,
        finals: bool = False,
    ) -> list[str]:
        """Apply the newest stored status from each agent the step was sent to (newest attempt
        first; or from ``agents``): statuses this hub missed — sent while another hub owned the
        workflow, or while the subscription was cut off — are outcomes like any other. Returns
        the agents whose read went unanswered (a JetStream election): a status of theirs may be
        stored that this hub did not see. ``finals``: only final statuses are applied (a
        stored keep-alive, however old, would count as hearing from the attempt now).

        The agents are read at once, and what they stored is offered after every read is
        done, in their order (as one read after another offered it): a stream that does not
        answer holds the step one read's timeout — up to ``_STATUS_READ_PATIENT`` when
        ``patient`` — not one per agent (up to ``_CATCH_UP_AGENTS``)."""
        if agents is None:
            newest = sorted(track.sent.items(), reverse=True)
            agents = list(dict.fromkeys(a for _, a in newest))[:_CATCH_UP_AGENTS]

        async def read(agent_id: str) -> TaskStatusEvent | Exception | None:
            try:
                return await self.last_status(
                    track.namespace, track.task_id, agent_id, patient=patient
                )
            except Exception as err:  # (each agent's own: the others' reads are kept)
                return err

        if len(agents) == 1:  # (the usual step: read in its own task, no task made for it)
            got = [await read(agents[0])]
        else:
            got = await asyncio.gather(*(read(a) for a in agents))
        unread = []
        for agent_id, last in zip(agents, got, strict=True):
            if isinstance(last, Exception):
                log.debug("cannot read the last status of %s: %r", track.task_id, last)
                unread.append(agent_id)
            elif last is not None and (last.state.final or not finals):
                self.offer(track, last)
        return unread

    async def _read_on(
        self,
        track: StepTrack,
        unread: list[str],
        *,
        finals: bool = False,
        until: float | None = None,
    ) -> list[str]:
        """Read the stored statuses of ``unread`` (agents whose quick read went unanswered)
        again, patiently; returns the agents still unread (none once an outcome is found).

        ``until`` (a step at its deadline, which cannot wait for ever): the reads still
        unanswered are made again every ``_REREAD_PAUSE`` until then (the loop's time) — an
        election takes seconds (seed 173: 9.3 s), and a stream without leader may refuse a
        read at once (503), which a patient read alone then waits nothing out; an outcome
        heard live meanwhile ends the wait at once. Agents still unread then are logged (an
        outcome stored there may go unseen: the deadline decides). ``finals`` as for
        :meth:`catch_up`."""
        if unread and track.final is None:
            unread = await self.catch_up(track, unread, patient=True, finals=finals)
        while until is not None and unread and track.final is None and self._now() < until:
            pause = min(self._now() + _REREAD_PAUSE, until)
            while track.final is None and (left := pause - self._now()) > 0:
                await track.changed.wait(left)  # (an outcome heard live decides at once)
            if track.final is None:
                unread = await self.catch_up(track, unread, finals=finals)
        if track.final is not None:
            return []
        if unread and until is not None and self._said.take("deadline_unread") is not None:
            log.warning(
                "%s reached its deadline with the stored statuses of %s unread (the status "
                "stream did not answer within %.3gs): an outcome stored there was not seen",
                track.task_id,
                ", ".join(unread),
                _STATUS_READ_PATIENT,
            )
        return unread

    async def probe(self, track: StepTrack) -> Verdict:
        """Silence on the current attempt: read the status stream, then ask its agent. Before
        the attempt is given up for an agent gone, an unanswered read is made again, patiently:
        the outcome it may hold decides the step, and a step must not run again for it. Still
        unanswered: ``unread`` — not given up on what could not be read (chaos secure seed 173,
        ``partition``: a node's rejoin left ``REACH_STATUS`` without a leader for 9.3 s, its
        agent cut off and declared LOST meanwhile; the attempt's SUCCEEDED, stored before,
        was thrown away and the step run again)."""
        unread = await self.catch_up(track)
        if track.final is not None:
            return "done"
        verdict: Verdict = "gone"
        if track.agent_id is not None:
            verdict = await self._ask(track, track.agent_id, fence=track.attempt)
        if verdict == "gone" and unread and await self._read_on(track, unread):
            return "unread"
        return "done" if track.final is not None else verdict

    async def given_up_read(self, track: StepTrack) -> bool:
        """Before a new attempt of the step is sent: read the stored statuses of the agents of
        its attempts given up on (``lost``, ``undelivered``: sent, with no outcome) that were
        not read since — not one its agent promised never to start (``promised``), which
        stored nothing and whose unanswered read would hold the next attempt back for
        nothing. Such an attempt may have ended after it was given up (its agent cut off, not
        gone) — or before a takeover, while no hub listened — and a success it stored decides
        the step: the step must not run again for it (chaos secure seed 193,
        ``partition``: five steps taken over with attempt 1 given up as ``lost`` and its
        SUCCEEDED stored; the new owner's read found no leader for ``REACH_STATUS``, and it
        sent attempt 2). An unanswered read is made again, patiently (as ``probe`` does).
        Returns False when a read still went unanswered: a new attempt is not sent on that
        (the step waits and asks again; its deadline decides at the latest). Only final
        statuses are applied (a stored keep-alive is no news of the attempt now). Nothing
        is read for a step with no attempt given up (a first attempt, a retry after a
        handler failure or a TIMEOUT, which its outcome accounts for)."""
        track.checked &= track.sent.keys()
        given_up = {
            n: a
            for n, a in track.sent.items()
            if n not in track.finished
            and n not in track.checked
            and (n != track.attempt or track.agent_id is None)  # (not one out there now)
            and n != track.promised  # (its agent promised never to start it: nothing stored)
        }
        if not given_up:
            return True
        # Every one (read once each): ``catch_up``'s newest ``_CATCH_UP_AGENTS`` left an
        # older attempt's stored success unread, and the step ran again.
        newest = sorted(given_up.items(), reverse=True)
        agents = list(dict.fromkeys(a for _, a in newest))
        unread = await self.catch_up(track, agents, finals=True)
        unread = await self._read_on(track, unread, finals=True)
        if track.final is not None:
            return True
        track.checked.update(n for n, a in given_up.items() if a not in unread)
        return not unread

    async def after_gap(self) -> None:
        """The statuses connection is back after a cut (a slow consumer's, a network's): every
        status event sent while it was away is lost to it, the final ones too. Each step this
        hub runs reads what its attempts stored meanwhile (``catch_up``) now, not when its
        silence timeout (15 s) or the deliver timeout has it ask: a step that ended in the
        gap is decided at once, and its workflow's deadline does not run out meanwhile. A
        reconnection during a pass has it run once more (one pass at a time). Only final
        statuses, and only of steps with an attempt out: a stored keep-alive is no news of
        the attempt now, and one of an attempt given up on must not revive it."""
        if self._gap_running:
            self._gap_again = True
            return
        self._gap_running = True
        turns = asyncio.Semaphore(_GAP_READS)

        async def read(track: StepTrack) -> None:
            async with turns:
                if self._tracks.get(track.key) is track and track.final is None:
                    await self.catch_up(track, finals=True)

        try:
            while True:
                self._gap_again = False
                tracks = [
                    t for t in self._tracks.values() if t.final is None and t.agent_id is not None
                ]
                await asyncio.gather(*(read(t) for t in tracks))
                if not self._gap_again:
                    return
        finally:
            self._gap_running = False

    async def missed_final(self, track: StepTrack, *, hold: bool = False) -> bool:
        """Before the hub decides a step's attempt TIMEOUT itself — overdue, or at the step's
        deadline (``StepRunner._watch``): a final status this hub missed — its statuses
        connection cut while the silence timeout that would have it read the status stream
        had not run out — is read from ``REACH_STATUS``, else asked of the attempt's agent
        (ctl ``task_state``, no fence), and offered as any other outcome. The agent reported
        the attempt's end: a TIMEOUT of the hub's own would throw its outcome away (and,
        overdue, run the step again).

        A read the stream did not answer (an election: no leader) is made again patiently, as
        ``probe`` does, when the agent gave no outcome either (cut off). Returns False when one
        is still unanswered and no outcome was found: what is stored may decide the step, and
        the hub's TIMEOUT must wait (overdue: the attempt is watched on and asked about again;
        ``_watch``). ``hold`` (at the deadline, which cannot wait for ever): unanswered reads
        are made again every ``_REREAD_PAUSE`` for ``_STATUS_READ_PATIENT`` in all: an
        election takes seconds (seed 173: 9.3 s), and a stream without leader may refuse a
        read at once (503) — a patient read alone then waits nothing out. Then False, and the
        deadline decides on what was found (logged: a stored outcome may have gone unseen).
        The reads again are ``_read_on``'s, as ``probe``'s, ``given_up_read``'s and those of a
        deadline reached between attempts (``given_up_final``)."""
        until = self._now() + _STATUS_READ_PATIENT
        unread = await self.catch_up(track)
        if track.final is not None:
            return True
        if track.agent_id is not None:
            event = await self.held_outcome(
                track.task_id, track.workflow_id, track.agent_id, track.attempt
            )
            if event is not None:
                self.offer(track, event)
                if track.final is not None:
                    return True
        unread = await self._read_on(track, unread, until=until if hold else None)
        return track.final is not None or not unread

    async def given_up_final(self, track: StepTrack) -> bool:
        """At the step's deadline between attempts (none out: the last one given up on, or
        failed, and the next not sent — ``StepRunner._step``): read the stored statuses of
        the attempts given up on (sent, with no outcome: ``lost``, ``undelivered``) before the
        deadline decides the step. Such an attempt may have ended since — its agent cut off,
        not gone — and a SUCCEEDED it stored decides the step; the deadline's TIMEOUT would
        throw it away. Only final statuses are applied (as ``given_up_read``: a stored
        keep-alive is no news of the attempt now, and must not revive it). Reads unanswered
        (an election) are held for as ``missed_final`` at the deadline does (``_read_on``:
        every ``_REREAD_PAUSE`` for ``_STATUS_READ_PATIENT`` in all), then the deadline
        decides on what was found. Returns False when a read stayed unanswered."""
        until = self._now() + _STATUS_READ_PATIENT
        open_ = sorted(
            (
                (n, a)
                for n, a in track.sent.items()
                # (not one its agent promised never to start: it stored nothing)
                if n not in track.finished and n != track.promised
            ),
            reverse=True,
        )
        # Every one, as ``given_up_read`` reads them: the newest ``_CATCH_UP_AGENTS`` left an
        # older attempt's success, stored after ``given_up_read`` had checked it, unread.
        agents = list(dict.fromkeys(a for _, a in open_))
        if not agents:
            return True
        unread = await self.catch_up(track, agents, finals=True)
        unread = await self._read_on(track, unread, finals=True, until=until)
        return track.final is not None or not unread

    async def recheck(self, track: StepTrack, attempt: int, agent_id: str, recorded: int) -> None:
        """Ask again about an attempt just given up on, *after* the next one (``recorded``) is
        written to the step's record.

        The agent reads the record before it runs an attempt, and marks the attempt as in hand
        before that read; so once the fence is written, an agent that does not have the
        attempt in hand will drop it, and one that has it may have passed the old record —
        then the step watches that attempt again (``revived``) instead of sending a new one.
        The ask says which attempt the record names now (``next``): an agent back after
        ``LOST`` keeps the attempt it answered for while the record still names that one
        (its fence on return would cancel it otherwise, and the step waits for it).
        Asked of agents declared LOST too: back from a partition, such an agent read the
        record before the fence landed and started its queued attempt (chaos seed 151,
        ``partition``: the step ran again elsewhere 0.4 s later).
        """
        if track.promised >= attempt:
            return  # the agent promised, when it was asked, never to start it
        verdict = await self._ask(track, agent_id, fence=attempt, recorded=recorded)
        if verdict == "alive" and track.final is None:
            track.revived = (attempt, agent_id)
            track.changed.set()

    async def _ask(
        self, track: StepTrack, agent_id: str, *, fence: int, recorded: int | None = None
    ) -> Verdict:
        """Ask ``agent_id`` for the step's task state (ctl ``task_state``), telling it that
        attempt ``fence`` is about to be given up (or, ``recorded``, was, with that attempt
        recorded): an agent without it in hand promises never to start it (``"fenced": true``)."""
        try:
            try:
                msg = await self._task_state(
                    agent_id, track.task_id, track.workflow_id, fence, recorded
                )
            finally:
                # What the last question found counts only if this one finds nobody too
                # (taken after it: a status heard from the attempt meanwhile dropped it).
                unanswered = self._unanswered.pop(track.key, None)
        except NoRespondersError:
            if not self.lease_fresh(agent_id) and not await self._lapse_seen(agent_id):
                return "alive"  # (asked again at the step's next probe)
            return self._no_responders(track, agent_id, fence, unanswered)
        except (NatsTimeoutError, TimeoutError):
            return self._by_lease(agent_id)
        except Exception:
            log.debug("task_state of %s failed", track.task_id, exc_info=True)
            return self._by_lease(agent_id)
        answer = parse_task_state(msg.data)
        if answer is None:
            return self._by_lease(agent_id)
        state, attempt, body = answer
        if body.get("fenced") is True:
            track.promised = max(track.promised, fence)
        if state.final:
            if attempt is not None and track.sent.get(attempt) == agent_id:
                ctl = protocol.agent_ctl(agent_id)
                event = self._kept(
                    self._held_event(body, agent_id, track.task_id, ctl), len(msg.data)
                )
                if event is None:
                    return self._by_lease(agent_id)
                self.offer(track, event)
                if track.final is not None:
                    return "done"
            # An older attempt's retryable failure: the agent does not have this one.
            return "gone"
        if state in (TaskState.DELIVERED, TaskState.ACCEPTED, TaskState.RUNNING):
            # This attempt or an earlier one of the same step: either may deliver.
            return "alive"
        return "gone"  # PENDING: the agent never saw it

    def _no_responders(
        self,
        track: StepTrack,
        agent_id: str,
        attempt: int,
        before: tuple[str, int, float, bool] | None,
    ) -> Verdict:
        """Nobody on the agent's ctl subject: dead, cut off and reconnecting (a NATS node
        lost), or connected but deaf (its subscriptions gone while its heartbeats go on — a
        client whose subscription loop died). A lapsed lease says dead. While it holds, a
        reconnecting agent may still take the attempt; but a reconnecting agent sends no
        heartbeats, and its subscriptions are back before its first beat after the reconnect.
        So one heard by this hub strictly after the ctl subject first had no responders (the
        registry's ``spoke_at``, on its own clock), with nobody there when asked again, is
        deaf: gone, counted as a delivery failure on its health, and quarantined (its breaker
        opens: no further step or task goes to it until its half-open probe, after
        ``breaker_open_timeout``, reaches it). Once only per attempt: the recheck after the
        fence finds it deaf still."""
        if not self.lease_fresh(agent_id):
            return "gone"
        view = self._registry.agents.get(agent_id)
        if before is None or before[:2] != (agent_id, attempt) or view is None:
            self._unanswered[track.key] = (agent_id, attempt, self._registry.now, False)
            return "alive"
        since, deaf = before[2], before[3]
        if not deaf and view.spoke_at <= since:
            self._unanswered[track.key] = before
            return "alive"  # not heard since: it may be reconnecting
        self._unanswered[track.key] = (agent_id, attempt, since, True)
        if not deaf:
            # Certain, unlike one route that found no responders (``RouteEndMixin._failed``,
            # which only counts): every attempt sent to it would wait out two probes. Its
            # breaker's half-open probe finds out whether it listens again.
            view.health.delivery_failure()
            breaker = view.breaker
            if breaker.state is BreakerState.CLOSED or breaker.why == DEAF:
                # (Not over an operator's quarantine, or a breaker opened for failures: its
                # reason stands, and a ctl answer — which clears a deaf verdict — must not
                # lift it.)
                breaker.trip(DEAF)
            self._registry.regrade(view)
            if self._said.take(("deaf", agent_id)) is not None:
                log.warning(
                    "%s is heard but nobody answers on its ctl subject (its subscriptions are "
                    "gone): attempt %d of %s given up",
                    agent_id,
                    attempt,
                    track.task_id,
                )
        return "gone"

    async def held_outcome(
        self, task_id: str, workflow_id: str, agent_id: str, attempt: int
    ) -> TaskStatusEvent | None:
        """The final outcome ``agent_id`` holds for ``attempt`` of a step (ctl ``task_state``,
        no fence: nothing is promised), or None — no answer, not final, another attempt's.

        For a cancel: an outcome the agent has but that ``REACH_STATUS`` does not show yet
        (its final publish held up by a reconnect, a replica read behind its leader) then
        decides the step instead of the cancel. An agent taken for gone (LOST, or no longer
        registered) is not asked; one whose lease lapsed (SUSPECT) is: a JetStream outage
        lapses every lease (their renewals are KV writes), and it is then that the status
        stream holds nothing yet — chaos seed 76 (node_kill) lost a step's result so."""
        view = self._registry.agents.get(agent_id)
        if view is None or view.state is AgentState.LOST:
            return None
        try:
            msg = await self._task_state(agent_id, task_id, workflow_id, None)
        except Exception:
            return None  # unreachable or busy: what is stored decides, as before
        answer = parse_task_state(msg.data)
        if answer is None:
            return None
        state, held, body = answer
        if not state.final or held != attempt:
            return None
        ctl = protocol.agent_ctl(agent_id)
        event = self._held_event({**body, "workflow_id": workflow_id}, agent_id, task_id, ctl)
        return self._kept(event, len(msg.data))

    @property
    def _limit(self) -> int:
        """The record limit: the server's ``max_payload`` less ``MESSAGE_ROOM``."""
        return int(self._nc.max_payload) - protocol.MESSAGE_ROOM

    def _kept(self, event: TaskStatusEvent | None, size: int) -> TaskStatusEvent | None:
        """``event`` (a message of ``size`` bytes) as the step's records can hold it."""
        limit = self._limit
        if event is None or size <= limit:
            return event
        return kept_outcome(event, limit)

    def _parse_status(self, data: bytes, subject: str) -> TaskStatusEvent | None:
        """The status event in ``data``; None, counted and logged as a refused message
        (``REACH-MESSAGE-REFUSED``), when it does not validate — an agent's bug that would
        otherwise leave its step waiting for a status that never counts."""
        try:
            return protocol.validate_json(TaskStatusEvent.model_validate_json, data)
        except ValidationError as err:
            refuse_body(self._nc, subject, _invalid(err))
            return None

    def _held_event(
        self, body: dict[str, Any], agent_id: str, task_id: str, subject: str
    ) -> TaskStatusEvent | None:
        """A final ``task_state`` answer (the agent's reply, to ``subject``) as the status
        event it stands for; None, counted and logged as :meth:`_parse_status` does."""
        try:
            return protocol.validate_object(
                TaskStatusEvent.model_validate, {**body, "agent_id": agent_id, "task_id": task_id}
            )
        except ValidationError as err:
            refuse_body(self._nc, subject, "task_state answer: " + _invalid(err))
            return None

    async def _task_state(
        self,
        agent_id: str,
        task_id: str,
        workflow_id: str,
        fence: int | None,
        recorded: int | None = None,
    ) -> Msg:
        """Ask ``agent_id`` ctl ``task_state`` about the step's task (with ``fence``: attempt
        ``fence`` is about to be given up; with ``recorded`` too: it was, and the record names
        attempt ``recorded`` now). Raises what the request raises. Answered, the agent
        listens on its ctl subject: not deaf (``Registry.answered_on_ctl``)."""
        body: dict[str, Any] = {"op": "task_state", "task_id": task_id, "workflow_id": workflow_id}
        if fence is not None:
            body["fence"] = fence
            if recorded is not None:
                body["next"] = recorded
        msg = await self._registry.ask_agent(agent_id, protocol.dumps(body), timeout=_CTL_TIMEOUT)
        view = self._registry.agents.get(agent_id)
        if view is not None:
            self._registry.answered_on_ctl(view)
        return msg

    def _by_lease(self, agent_id: str) -> Verdict:
        """No usable answer (a busy agent answers late): its lease decides."""
        view = self._registry.agents.get(agent_id)
        return "alive" if view is not None and view.state is not AgentState.LOST else "gone"

    async def _lapse_seen(self, agent_id: str) -> bool:
        """Whether a lapsed lease says the agent went silent: LOST (the grading loop confirmed
        it at the heartbeat stream's leader), or SUSPECT with the stream's leader heard from a
        quorum since (``Registry.lapse_seen``). Nobody on its ctl subject says no more while
        this hub may be the one cut off."""
        view = self._registry.agents.get(agent_id)
        if view is None or view.state is AgentState.LOST:
            return True
        return await self._registry.lapse_seen(view)

    def lease_fresh(self, agent_id: str) -> bool:
        """Its lease has not lapsed (not SUSPECT or LOST): silence may be a reconnect. Nor can
        it be said to have lapsed while this hub is blind (``Registry.blind``: it could not
        have seen the beats — a partition between NATS servers, between it and the agent: a
        hub that took such a lapse as the agent gone gave its running attempts up and ran
        their steps again, the chaos ``partition`` fault)."""
        view = self._registry.agents.get(agent_id)
        if view is None or view.state is AgentState.LOST:
            return False
        return view.state is not AgentState.SUSPECT or self._registry.blind()


class _StatusHead(BaseModel):
    """A status event without its result and progress (pydantic skips what it does not name)."""

    model_config = ConfigDict(extra="ignore")
    attempt: int = Field(ge=1)
    agent_id: str
    state: TaskState
    error: ErrorBody | None = None


def _invalid(err: ValidationError) -> str:
    """What is wrong first in a status event that does not validate, for the log line."""
    first = err.errors(include_url=False)[0]
    where = ".".join(str(p) for p in first["loc"]) or "event"
    more = err.error_count() - 1
    return f"not a valid TaskStatusEvent: {where}: {first['msg']}" + (
        f" (and {more} more)" if more else ""
    )
