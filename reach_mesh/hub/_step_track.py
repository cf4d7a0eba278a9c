"""One step while it runs on the hub that owns its workflow: :class:`StepTrack` (its attempts
sent, the outcomes queued, when it was last heard from), the :class:`Signal` that wakes the
step's own coroutine, and :func:`parse_task_state`, an agent's answer about an attempt.
:class:`~reach_mesh.hub._tracking.StatusTracker` feeds them."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Final

from opentelemetry.trace import Span

from reach_mesh import protocol
from reach_mesh.errors import ReachError
from reach_mesh.hub.acks import AckMachine
from reach_mesh.hub.registry import AgentView
from reach_mesh.models import TaskState
from reach_mesh.workflow import TaskStatusEvent

__all__ = ["ATTEMPTS_KEPT", "Signal", "StepTrack", "new_machine", "parse_task_state"]

#: Attempts of a step remembered: in its record's history and in ``StepTrack.sent``. A step
#: re-sent more often (a silent agent until a long ``ttl``) forgets its oldest; their late
#: outcomes are stale then, as they would be after a takeover that reads the record.
ATTEMPTS_KEPT: Final = 32


class Signal:
    """Wakes the one coroutine that waits on a step (its own): :meth:`set` wakes it at once,
    :meth:`wait` returns on that or after ``timeout``. Cheaper than ``asyncio.Event`` under
    ``wait_for``, which makes a task per wait; a ``set`` with nobody waiting is forgotten, as
    the Event was cleared before every wait."""

    __slots__ = ("_waiter",)

    def __init__(self) -> None:
        self._waiter: asyncio.Future[None] | None = None

    def set(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def wait(self, timeout: float) -> None:
        loop = asyncio.get_running_loop()
        waiter = self._waiter = loop.create_future()
        timer = loop.call_later(timeout, _wake, waiter)
        try:
            await waiter
        finally:
            timer.cancel()
            self._waiter = None


def _wake(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)


class _SpanEvents:
    """An attempt's ACK transitions as events on its step's span.

    Holds the span and the attempt number, never the :class:`StepTrack`: a closure over the
    track, kept by the track and its machine, made every step a reference cycle (the track with
    its machine, signal and queues) that only the cyclic collector freed: thousands of objects
    per young collection of a loaded hub."""

    __slots__ = ("_attempt", "_span")

    def __init__(self, span: Span, attempt: int) -> None:
        self._span = span
        self._attempt = attempt

    def __call__(self, old: TaskState, new: TaskState) -> None:
        if self._span.is_recording():
            self._span.add_event(
                new.value, {"reach.attempt": self._attempt, "reach.from": old.value}
            )


def new_machine(span: Span, attempt: int) -> AckMachine:
    """A fresh ACK machine for ``attempt`` (made whenever the track's attempt changes to one
    that is sent; the machine is only advanced by that attempt's events). A span that does not
    record now never will (tracing off, or ended): no recorder then."""
    return AckMachine(on_transition=_SpanEvents(span, attempt) if span.is_recording() else None)


@dataclass(slots=True, eq=False)
class StepTrack:
    """One step while it runs on this hub, fed by the status subscription."""

    key: str
    task_id: str
    namespace: str
    workflow_id: str
    #: The current attempt; ``agent_id`` is None while it is recorded but not yet sent.
    attempt: int
    agent_id: str | None
    machine: AckMachine
    #: The step's span: each attempt's ACK machine records its transitions on it.
    span: Span
    #: The attempts sent for this step -> their agents (any of them may still deliver): the
    #: newest ``ATTEMPTS_KEPT``, as the record's history keeps.
    sent: dict[int, str] = field(default_factory=dict)
    changed: Signal = field(default_factory=Signal)
    #: Final statuses of sent attempts not yet acted on, oldest first (one per attempt).
    outcomes: deque[TaskStatusEvent] = field(default_factory=deque)
    #: The outcome taken off ``outcomes`` that decides the step, while its record is written
    #: (``StepRunner._finish``): not applied until then.
    deciding: TaskStatusEvent | None = None
    #: Attempts whose final status was queued in ``outcomes`` (a repeat is not queued again).
    finished: set[int] = field(default_factory=set)
    #: An attempt given up on that showed life after the next one was recorded (before it was
    #: sent): (attempt, agent). The step watches it again instead of sending a new one.
    revived: tuple[int, str] | None = None
    #: Attempts given up on (``lost``, ``undelivered``) whose agents' stored statuses were
    #: read before a later attempt was sent (``StatusTracker.given_up_read``): not read again.
    checked: set[int] = field(default_factory=set)
    #: The highest attempt its agent promised never to start (ctl ``task_state`` with
    #: ``fence``): given up on safely, no need to ask again after the record is fenced.
    promised: int = -1
    dispatched_at: float = 0.0
    last_event: float = 0.0
    #: When (loop time) this hub first heard the current attempt's handler run (ACCEPTED or
    #: RUNNING): its step's ``timeout`` counts from here (``StepRunner._watch``).
    started_at: float | None = None
    #: When (loop time) the current attempt's agent last sent a status event for it.
    heard_at: float = 0.0
    lost: bool = False
    stale: int = 0
    view: AgentView | None = None
    #: The attempt this hub sent as its agent's half-open probe (0: none): only its final
    #: status is the probe's verdict (``StatusTracker._probe_verdict``).
    probe: int = 0
    #: Whether the step was stopped while it runs on (``Workflow.halted``): its watch ends.
    halted: Callable[[], bool] | None = None

    @property
    def final(self) -> TaskStatusEvent | None:
        """The next outcome to act on, if any."""
        return self.outcomes[0] if self.outcomes else None

    def take(self) -> TaskStatusEvent:
        """Act on the next outcome (remove it from the queue)."""
        return self.outcomes.popleft()

    def release_view(self) -> None:
        """Give back the load this hub counted on the current attempt's agent."""
        if self.view is not None:
            self.view.outstanding = max(0, self.view.outstanding - 1)
            self.view = None

    async def wait_outcome(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds, less if an outcome arrives."""
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout
        while self.final is None and self.revived is None:
            left = end - loop.time()
            if left <= 0:
                return
            await self.changed.wait(left)


def parse_task_state(data: bytes) -> tuple[TaskState, int | None, dict[str, Any]] | None:
    """An agent's answer to ``{"op": "task_state"}`` (docs/protocol.md): ``(state, attempt,
    body)``; None when it is not such an answer (an error body, or not JSON).

    The answer is a ``TaskReply`` when the agent finished the task and ``{"task_id",
    "attempt", "state"}`` otherwise; ``error`` belongs to the TaskReply and may be absent,
    null or an ``ErrorBody`` — it never makes the answer an error. An error *answer* (the ctl
    request itself failed) has no ``state``.
    """
    try:
        body = protocol.loads(data)  # (a lone surrogate is no answer: nothing could store it)
    except ReachError:
        return None
    if not isinstance(body, dict):
        return None
    try:
        state = TaskState(str(body.get("state")))
    except ValueError:
        return None
    attempt = body.get("attempt")
    if isinstance(attempt, bool) or not isinstance(attempt, int):
        attempt = None
    return state, attempt, body
