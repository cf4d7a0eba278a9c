"""Which attempt of which step is where: the workflow engine's view of status events.

One :class:`StepTrack` per step this hub runs, from its first dispatch to its outcome. It knows
every attempt that was sent (attempt number → agent) because any of them may still deliver: the
first outcome of any attempt decides the step (docs/workflows.md, "First outcome wins"). Status
events are accepted only from the agent recorded for their attempt; anything else final is
counted as stale and never applied.

After a step is decided it is remembered (bounded) with its deciding attempt, so a later final
status of the same step — a duplicate run somebody could not prevent — is recognised, counted
and logged, never applied.

Reading back the statuses this hub missed, and asking agents about their attempts (probes,
rechecks), is :class:`~reach_mesh.hub._status_reads.StatusReads`, the base of
:class:`StatusTracker`.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import Callable
from typing import Final

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from opentelemetry.trace import Span

from reach_mesh import protocol
from reach_mesh._guard import refuse
from reach_mesh._jspub import JsClient
from reach_mesh.hub._status_reads import StatusReads, Verdict, read_contexts
from reach_mesh.hub._step_track import (
    ATTEMPTS_KEPT,
    StepTrack,
    new_machine,
    parse_task_state,
)
from reach_mesh.hub.breaker import BreakerState, attempt_verdict
from reach_mesh.hub.registry import AgentView, Registry
from reach_mesh.logs import LineBudget
from reach_mesh.models import TaskState
from reach_mesh.workflow import TaskRecord, TaskStatusEvent

__all__ = ["ATTEMPTS_KEPT", "StatusTracker", "StepTrack", "Verdict", "parse_task_state"]


log = logging.getLogger("reach_mesh.hub.workflows")

_RECENT: Final = 50_000
#: Refused statuses (forged, stale) are logged at most once per this many seconds, each kind.
_SAY_EVERY: Final = 10.0
#: States that say an attempt's handler runs (its step's ``timeout`` counts from then).
_STARTED: Final = frozenset({TaskState.ACCEPTED, TaskState.RUNNING})


class StatusTracker(StatusReads):
    """The steps running on this hub and the recently decided ones; owns the status
    subscription's callback. Everything here runs on the event loop without locks."""

    def __init__(
        self,
        nc: NATS,
        jsc: JsClient,
        registry: Registry,
        *,
        on_stale: Callable[[], None] | None = None,
        max_payload: int | None = None,
    ) -> None:
        self._nc = nc
        #: The mesh's ``max_payload`` (the settings'), which bounds what an agent sends
        #: (``max_status``); None: the server's only.
        self._max_payload = max_payload
        #: Asks agents (ctl ``task_state``) with unguessable reply subjects: an agent may
        #: publish on hubs' reply subjects, and a forged answer could decide a step.
        self._jsc = jsc
        self._on_stale = on_stale
        self._js, self._js_patient = read_contexts(nc)
        self._registry = registry
        self._tracks: dict[str, StepTrack] = {}
        #: Decided steps -> their deciding attempt, for duplicate detection.
        self._decided: OrderedDict[str, int] = OrderedDict()
        #: Final statuses that could not be applied: from an agent or attempt the step never
        #: sent to, or arriving after the step was decided (a duplicate run).
        self.stale_total = 0
        #: Status events whose body spoke for another agent than their subject named.
        self.forged_total = 0
        #: Lines about refused statuses, one per kind per ``_SAY_EVERY`` s: an agent may send
        #: as many as it likes (its own tasks' ids).
        self._said = LineBudget(_SAY_EVERY)
        #: Test seam (fault injection): return False to drop a status event as if lost.
        self.status_filter: Callable[[TaskStatusEvent], bool] | None = None
        #: Steps whose last ``task_state`` question found nobody on its agent's ctl subject,
        #: by task key: (agent, attempt, when — the registry's clock, at the answer — and
        #: whether the agent was taken for deaf since). Dropped when the step is closed, hears
        #: from its attempt, or is asked again (``_no_responders`` puts it back).
        self._unanswered: dict[str, tuple[str, int, float, bool]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        #: Set while :meth:`after_gap` runs: a reconnection meanwhile has it read once more.
        self._gap_running = False
        self._gap_again = False

    def _now(self) -> float:
        """The event loop's time, the loop asked once (``WorkflowEvents._loop`` says why)."""
        loop = self._loop
        if loop is None:
            loop = self._loop = asyncio.get_running_loop()
        return loop.time()

    # ------------------------------------------------------------------ tracks

    def open(self, rec: TaskRecord, key: str, sp: Span) -> StepTrack:
        """Start tracking a step from its record (a fresh one, or one taken over)."""

        now = self._now()
        track = StepTrack(
            key=key,
            task_id=rec.task_id,
            namespace=rec.namespace,
            workflow_id=rec.workflow_id,
            attempt=rec.attempt,
            agent_id=rec.agent_id,
            machine=new_machine(sp, rec.attempt),
            span=sp,
            sent={h.attempt: h.agent_id for h in rec.history if h.agent_id is not None},
            # Outcomes the record already accounts for are not acted on twice (a takeover
            # re-reads them from the status stream).
            finished={h.attempt for h in rec.history if h.state.final},
            dispatched_at=now,
            last_event=now,
        )
        if rec.agent_id is not None and rec.attempt > 0:
            track.sent[rec.attempt] = rec.agent_id
        self._tracks[key] = track
        return track

    def track(self, key: str) -> StepTrack | None:
        """The step this hub runs under task key ``key``, if it runs one."""
        return self._tracks.get(key)

    def dispatch(self, track: StepTrack, attempt: int, view: AgentView) -> None:
        """``attempt`` (already recorded) goes to ``view``'s agent now."""
        now = self._now()
        track.release_view()
        track.attempt = attempt
        track.agent_id = view.agent_id
        track.sent[attempt] = view.agent_id
        if len(track.sent) > ATTEMPTS_KEPT:
            del track.sent[min(track.sent)]
        track.machine = new_machine(track.span, attempt)
        track.dispatched_at = track.last_event = now
        track.started_at = None
        track.lost = False
        track.view = view

    def readopt(self, track: StepTrack) -> None:
        """Watch the revived attempt again (see ``StepTrack.revived``); the record keeps the
        next attempt number, which the step uses if this one fails it after all."""
        assert track.revived is not None
        attempt, agent_id = track.revived
        track.revived = None
        track.attempt = attempt
        track.agent_id = agent_id
        track.machine = new_machine(track.span, attempt)
        track.machine.catch_up(TaskState.DELIVERED)
        track.dispatched_at = track.last_event = self._now()
        track.started_at = None
        track.lost = False

    def fence(self, track: StepTrack, attempt: int) -> None:
        """``attempt`` is recorded with no agent yet: earlier attempts can no longer start."""
        track.release_view()
        track.attempt = attempt
        track.agent_id = None
        track.started_at = None
        track.lost = False
        track.revived = None

    def close(self, track: StepTrack, decided_by: int | None) -> list[TaskStatusEvent]:
        """Stop tracking; ``decided_by`` is the attempt whose outcome (or deadline) decided the
        step, None when the step stops undecided (cancelled, hub stopping).

        Returns, for a step stopped undecided, the outcomes it had in hand and had not applied
        (the one it was deciding by, then the queued ones): a cancel settles the step from
        them (``WorkflowShapes._cancel_step``) — such an outcome may be stored nowhere else
        yet (its agent still retrying its store, an earlier attempt's agent gone). After a
        decision the queued ones are duplicates, counted stale."""
        track.release_view()
        left: list[TaskStatusEvent] = []
        if decided_by is None:
            if track.deciding is not None:
                left.append(track.deciding)
            left.extend(track.outcomes)
        else:
            for event in track.outcomes:  # outcomes the step did not need: duplicates
                self._stale(event, "after its step was decided")
        track.deciding = None
        track.outcomes.clear()
        if self._tracks.get(track.key) is track:
            del self._tracks[track.key]
            self._unanswered.pop(track.key, None)
        if decided_by is not None:
            self._decided[track.key] = decided_by
            self._decided.move_to_end(track.key)
            while len(self._decided) > _RECENT:
                self._decided.popitem(last=False)
        return left

    def mark_lost(self, agent_id: str) -> None:
        """The registry declared ``agent_id`` LOST: its current attempts will not deliver."""
        for track in self._tracks.values():
            if track.agent_id == agent_id and track.final is None:
                track.lost = True
                track.changed.set()

    # ------------------------------------------------------------------ status events

    @property
    def max_status(self) -> int:
        """The largest status event taken live: what an agent sends at most
        (``protocol.status_max``; the server's ``max_payload`` when the mesh's is not known)."""
        server = int(self._nc.max_payload)
        mesh = server if self._max_payload is None else self._max_payload
        return protocol.status_max(mesh, server)

    def on_status(self, msg: Msg) -> None:
        """The status subscription's callback: a parse and dictionary lookups, no I/O."""
        if len(msg.data) > self.max_status:
            # Larger than any agent sends (a result or progress is cut at max_payload): a
            # flood of them costs this length check, not a parse each. Counted and logged as
            # refused (on the connection it came on); a step still waiting learns its outcome
            # from REACH_STATUS when its silence has it ask (``last_status``), as after a loss.
            refuse(msg, f"a status event of {len(msg.data)} bytes, over {self.max_status}")
            return
        # The subject names the agent that sent the event (NATS permissions bind it to it).
        ident = protocol.status_identity(msg.subject)
        if ident is None:
            return
        sender, task_id = ident
        key = protocol.task_key(protocol.namespace_of(sender), task_id)
        track = self._tracks.get(key)
        if track is None:
            decided = self._decided.get(key)
            if decided is None:
                return  # not ours (another hub's workflow, or a request-reply task)
            event = self._authentic(sender, msg.data, msg.subject)
            if event is not None and event.state.final and event.attempt != decided:
                self._stale(event, "after its step was decided")
            return
        event = self._authentic(sender, msg.data, msg.subject)
        if event is None or event.task_id != track.task_id:
            return
        if self.status_filter is not None and not self.status_filter(event):
            return
        self.offer(track, event)

    def offer(self, track: StepTrack, event: TaskStatusEvent) -> None:
        """Take ``event`` if it comes from an attempt the step sent, from that attempt's agent.

        The current attempt's events drive its ACK machine. The final status of any sent
        attempt is queued as an outcome for the step to act on (first outcome wins: an earlier
        attempt's success decides the step even while a later attempt runs)."""
        agent = track.sent.get(event.attempt)
        if agent is None or agent != event.agent_id:
            if event.state.final:
                track.stale += 1
                self._stale(event, "from an attempt this step did not send to that agent")
            return
        if event.workflow_id is not None and event.workflow_id != track.workflow_id:
            # The same task id in another workflow (a caller-chosen id reused after its
            # record expired, or one that is another workflow's default id): not this step's.
            if event.state.final:
                track.stale += 1
                self._stale(event, "from another workflow's step of the same task id")
            return
        if event.attempt == track.attempt:
            if not track.machine.catch_up(event.state):
                return  # a repeat or an out-of-order older state
            now = track.last_event = track.heard_at = self._now()
            if track.started_at is None and track.machine.state in _STARTED:
                track.started_at = now
            # Heard from: an earlier "no responders" says nothing about its next silence.
            self._unanswered.pop(track.key, None)
        elif (
            track.agent_id is None
            and not event.state.final
            and event.attempt < track.attempt
            and event.attempt not in track.finished
        ):
            # We gave this attempt up, but its agent has it after all (it passed its fence
            # check just before we recorded the next attempt): watch it rather than send anew.
            track.revived = (event.attempt, event.agent_id)
        if event.state.final and event.attempt not in track.finished:
            track.finished.add(event.attempt)
            track.outcomes.append(event)
            if event.attempt == track.probe:
                self._probe_verdict(event)
        track.changed.set()

    def _probe_verdict(self, event: TaskStatusEvent) -> None:
        """The final status of an attempt this hub sent as its agent's half-open probe
        (``StepTrack.probe``): while the breaker is still half-open, the verdict of the probe,
        classified as a routed task's reply is
        (``RouteEndMixin``): SUCCEEDED closes the breaker, TIMEOUT or the agent's own failure
        opens it again. The router hands the single probe to whatever it places next, a
        workflow step included — for an agent quarantined as deaf (by a step) the probe is
        nearly always a step. Unreported, the probe stays "in flight" until ``probe_timeout``
        (30 s), and the agent gets one step per hub per that, however well it answers. The
        final status of any other attempt is no verdict: one sent before the breaker opened
        (a late or caught-up success of a step the agent held while it was quarantined), or
        one another hub sent (each hub's breaker hands out its own probe). A closed breaker
        counts no workflow outcome (as before)."""
        view = self._registry.agents.get(event.agent_id)
        if view is None or view.breaker.state is not BreakerState.HALF_OPEN:
            return
        code = event.error.code if event.error is not None else None
        verdict = attempt_verdict(event.state, code)
        if verdict is not None:
            view.breaker.record(verdict)
            self._registry.regrade(view)

    def _authentic(self, sender: str, data: bytes, subject: str) -> TaskStatusEvent | None:
        """The event in ``data`` (which came on ``subject``) if it is one and speaks for the
        agent its subject names, else None."""
        event = self._parse_status(data, subject)
        if event is None or event.agent_id == sender:
            return self._kept(event, len(data))
        self.forged_total += 1
        if self._said.take("forged") is not None:
            log.warning(
                "status for %s from %s claiming to be %s refused (identity mismatch; %d so far)",
                event.task_id,
                sender,
                event.agent_id,
                self.forged_total,
            )
        return None

    def _stale(self, event: TaskStatusEvent, why: str) -> None:
        self.stale_total += 1
        if self._on_stale is not None:
            self._on_stale()
        if self._said.take("stale") is not None:
            log.warning(
                "%s from %s for %s attempt %d not applied: %s (%d so far)",
                event.state.value,
                event.agent_id,
                event.task_id,
                event.attempt,
                why,
                self.stale_total,
            )
