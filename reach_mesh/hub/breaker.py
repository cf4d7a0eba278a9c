"""Per-agent failure accounting: a circuit breaker and a health score.

Pure (no I/O); the clock is injected so tests never sleep. The health module of the hub maps
an open breaker to the ``QUARANTINED`` state and a health score below the threshold to
"not routable", recording the reason (``REACH-QUARANTINE``).

Only the agent's own faults feed the breaker (:func:`is_agent_fault`): timeouts, crashes,
transport failures, the handler's infrastructure errors. A caller's bad payload, an envelope
naming a capability the agent lacks, or a refusal because the agent is busy never do — else one
caller could quarantine an agent for every caller. Outcomes a hub saw itself go to
:meth:`CircuitBreaker.record`; outcomes callers *report* (direct mode) go to
:meth:`CircuitBreaker.report`, bounded per reporter, and can never open the breaker on their
own: opening needs at least one failure the hub witnessed in the window.
"""

from __future__ import annotations

import enum
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Final

from reach_mesh.errors import (
    AgentBusyError,
    BadRequestError,
    ForbiddenHostError,
    ForbiddenOriginError,
    MeshTimeoutError,
    NoHandlerError,
    NoMatchError,
    StaleAttemptError,
    ThrottledError,
    UnauthorizedError,
    UnknownAgentError,
)
from reach_mesh.models import TaskState

if TYPE_CHECKING:
    from reach_mesh.models import FailureReport

__all__ = [
    "CAUSE_MAX",
    "DEAF",
    "HEALTH_THRESHOLD",
    "NOT_AGENT_FAULTS",
    "PROBE_FAILED",
    "BreakerState",
    "CircuitBreaker",
    "HealthScore",
    "attempt_verdict",
    "caller_report",
    "is_agent_fault",
]

#: Why a deaf agent is quarantined (its breaker's ``why``: the REACH-QUARANTINE line, inspect).
DEAF: Final = "deaf: heard, but nobody listens on its ctl subject (its subscriptions are gone)"
#: Why a breaker opened again: its half-open probe failed. Its ``why`` says so, with why it
#: opened in the first place (``CAUSE_MAX`` characters of it at most): "its half-open probe
#: failed" alone once hid, from the first failed probe on, what took the agent out.
PROBE_FAILED: Final = "its half-open probe failed"
CAUSE_MAX: Final = 160
#: Below this health score an agent is not routable.
HEALTH_THRESHOLD: Final = 60.0
#: Reporters one breaker tells apart per window; reports from more share one budget.
MAX_REPORTERS: Final = 1024
_OVERFLOW: Final = "\x00overflow"


def _codes(cls: type[BadRequestError]) -> set[str]:
    return {cls.code}.union(*(_codes(sub) for sub in cls.__subclasses__()))


#: Failure codes that are not the agent's fault: the caller's request was wrong (bad payload,
#: a capability the agent does not serve, a stale or cancelled attempt, no permission) or the
#: agent was merely busy (overload lowers the health score instead).
NOT_AGENT_FAULTS: Final = frozenset(
    _codes(BadRequestError)
    | {
        c.code
        for c in (
            AgentBusyError,
            NoHandlerError,
            NoMatchError,
            StaleAttemptError,
            ThrottledError,
            UnauthorizedError,
            ForbiddenHostError,
            ForbiddenOriginError,
        )
    }
    | {"REACH_CANCELLED", "REACH_UNKNOWN_NAMESPACE"}
)


def is_agent_fault(code: str | None) -> bool:
    """Whether a failure with wire ``code`` counts against the agent's breaker.

    Unknown codes (a handler's own error types) and a missing code count: the handler failed for
    reasons of its own. ``REACH_BAD_*`` codes are the caller's, including subclasses defined
    after this module was imported."""
    if code is None:
        return True
    return code not in NOT_AGENT_FAULTS and not code.startswith("REACH_BAD_")


def attempt_verdict(state: TaskState, code: str | None) -> bool | None:
    """What an attempt's final ``state`` (and error ``code``) tells the agent's breaker: True
    (it succeeded), False (it timed out, or failed by its own fault), None (nothing: a
    caller's bad payload, a cancel, not final)."""
    if state is TaskState.SUCCEEDED:
        return True
    if state is TaskState.TIMEOUT or (state is TaskState.FAILED and is_agent_fault(code)):
        return False
    return None


def _probe_failed(cause: str) -> str:
    """A failed probe's ``why``: ``PROBE_FAILED (opened: <cause>)``, ``cause`` cut to
    ``CAUSE_MAX`` characters (it is one of this module's reasons, or an operator's words)."""
    if not cause:
        return PROBE_FAILED
    if len(cause) > CAUSE_MAX:
        cause = cause[: CAUSE_MAX - 1] + "…"
    return f"{PROBE_FAILED} (opened: {cause})"


class BreakerState(enum.Enum):
    """``CLOSED``: traffic flows. ``OPEN``: quarantined. ``HALF_OPEN``: one probe may pass."""

    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


class CircuitBreaker:
    """Opens when failures are at least ``failure_ratio`` of the outcomes in the last ``window``
    seconds, provided there were at least ``min_requests`` of them.

    Outcomes are counted in one-second buckets (``bucket`` seconds), so memory is bounded by
    ``window / bucket`` whatever the request rate. After ``open_timeout`` seconds ``OPEN`` turns
    into ``HALF_OPEN`` (on the next read of :attr:`state` or :meth:`allow`), where
    :meth:`allow` hands out exactly one probe; its outcome closes the breaker (with a fresh
    window) or opens it again. A probe that never reports is re-issued after ``probe_timeout``
    so that a lost probe cannot wedge the agent in ``HALF_OPEN``.
    """

    def __init__(
        self,
        *,
        window: float = 60.0,
        bucket: float = 1.0,
        failure_ratio: float = 0.5,
        min_requests: int = 5,
        open_timeout: float = 30.0,
        probe_timeout: float = 30.0,
        report_budget: int = 3,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if window <= 0.0 or bucket <= 0.0 or bucket > window:
            raise ValueError("need 0 < bucket <= window")
        self.window = window
        self.bucket = bucket
        self.failure_ratio = failure_ratio
        self.min_requests = min_requests
        self.open_timeout = open_timeout
        self.probe_timeout = probe_timeout
        self.report_budget = report_budget
        #: Why it last opened, in words (for the ``REACH-QUARANTINE`` line): a failed probe's
        #: names what opened it first (``cause``).
        self.why = ""
        #: Why it opened from closed (or was tripped): what a failed probe's ``why`` keeps.
        self.cause = ""
        #: Times it opened from closed or half-open: one quarantine each. A trip while it is
        #: open (the hub that took an operator's quarantine also gets its own broadcast)
        #: restarts the open time within the same opening.
        self.openings = 0
        self._clock = clock
        self._nbuckets = max(1, round(window / bucket))
        # [bucket index, successes, failures, witnessed failures, unanswered failures], oldest
        # first; totals kept alongside so a record is O(1) amortised instead of summing the
        # window.
        self._buckets: deque[list[int]] = deque()
        self._successes = 0
        self._failures = 0
        self._witnessed = 0
        self._unanswered = 0
        # Reports counted per reporter in the current tumbling window (epoch).
        self._report_epoch = -1
        self._reporters: dict[str, int] = {}
        self._state = BreakerState.CLOSED
        self._opened_at = 0.0
        self._probe_at: float | None = None

    @property
    def state(self) -> BreakerState:
        """The current state; ``OPEN`` becomes ``HALF_OPEN`` once ``open_timeout`` has passed."""
        if (
            self._state is BreakerState.OPEN
            and self._clock() - self._opened_at >= self.open_timeout
        ):
            self._state = BreakerState.HALF_OPEN
            self._probe_at = None
        return self._state

    @property
    def reason(self) -> str | None:
        """Why it is not closed (open, or half-open: why it last opened); None when closed."""
        return None if self.state is BreakerState.CLOSED else self.why or None

    @property
    def probe_available(self) -> bool:
        """Whether :meth:`allow` would return ``True`` now, without handing anything out."""
        state = self.state
        if state is not BreakerState.HALF_OPEN:
            return state is BreakerState.CLOSED
        return self._probe_at is None or self._clock() - self._probe_at >= self.probe_timeout

    def allow(self) -> bool:
        """Whether a request may go to the agent now. In ``HALF_OPEN`` this hands out the
        single probe: the first call returns ``True``, later ones ``False`` until it reports."""
        state = self.state
        if state is BreakerState.CLOSED:
            return True
        if state is BreakerState.OPEN:
            return False
        now = self._clock()
        if self._probe_at is None or now - self._probe_at >= self.probe_timeout:
            self._probe_at = now
            return True
        return False

    def record(self, success: bool, *, unanswered: bool = False) -> None:
        """Record an outcome the hub witnessed. In ``HALF_OPEN`` any outcome counts as the
        probe's verdict; in ``OPEN`` outcomes (late replies from before it opened) are
        ignored. ``unanswered``: a failure that is a route the agent did not answer within its
        timeout (an expiry charged, ``hub/_lateness.py``), which the reason it opens for
        counts apart: the agent's own metrics and logs show nothing of those."""
        self._outcome(success, witnessed=True, unanswered=unanswered and not success)

    def report(self, success: bool | None, reporter: str) -> bool:
        """Record an outcome a caller reported; ``False`` when ``reporter`` has used up its
        budget for this window (the report is then ignored). ``None``: a report that is no
        breaker matter (a busy refusal, a caller error) but still spends the budget."""
        epoch = int(self._clock() // self.window)
        if epoch != self._report_epoch:
            self._report_epoch = epoch
            self._reporters.clear()
        if reporter not in self._reporters and len(self._reporters) >= MAX_REPORTERS:
            reporter = _OVERFLOW
        used = self._reporters.get(reporter, 0)
        if used >= self.report_budget:
            return False
        self._reporters[reporter] = used + 1
        if success is not None:
            self._outcome(success, witnessed=False)
        return True

    def _outcome(self, success: bool, *, witnessed: bool, unanswered: bool = False) -> None:
        state = self.state
        now = self._clock()
        if state is BreakerState.OPEN:
            return
        if state is BreakerState.HALF_OPEN:
            if success:
                self._state = BreakerState.CLOSED
                self.why = self.cause = ""  # (a deaf verdict too: its probe reached it)
                self._reset_window()
            elif witnessed:
                self.why = _probe_failed(self.cause)
                self._open(now)
            return
        self._add(now, success, witnessed, unanswered)
        total = self._successes + self._failures
        if (
            self._witnessed
            and total >= self.min_requests
            and self._failures >= self.failure_ratio * total
        ):
            why = f"{self._failures} of its last {total} requests failed"
            if self._unanswered:
                why += f" ({self._unanswered} not answered within their timeout)"
            self.why = self.cause = why
            self._open(now)

    def counts(self) -> tuple[int, int]:
        """``(successes, failures)`` within the current window."""
        self._expire(int(self._clock() // self.bucket))
        return self._successes, self._failures

    @property
    def witnessed(self) -> bool:
        """Whether the hub saw a failure of the agent itself within the current window."""
        self._expire(int(self._clock() // self.bucket))
        return self._witnessed > 0

    def trip(self, why: str = "operator quarantine") -> None:
        """Open the breaker now, for ``why`` (an operator quarantine, or an agent found deaf);
        it half-opens after ``open_timeout``."""
        self.why = self.cause = why
        self._open(self._clock())

    def reset(self) -> None:
        """Close the breaker and forget the window (operator action)."""
        self._state = BreakerState.CLOSED
        self.why = self.cause = ""
        self._probe_at = None
        self._reset_window()

    def _open(self, now: float) -> None:
        if self.state is not BreakerState.OPEN:
            self.openings += 1
        self._state = BreakerState.OPEN
        self._opened_at = now
        self._probe_at = None
        self._reset_window()

    def _reset_window(self) -> None:
        self._buckets.clear()
        self._successes = self._failures = self._witnessed = self._unanswered = 0

    def _expire(self, index: int) -> None:
        buckets = self._buckets
        oldest = index - self._nbuckets
        while buckets and buckets[0][0] <= oldest:
            _, ok, failed, witnessed, unanswered = buckets.popleft()
            self._successes -= ok
            self._failures -= failed
            self._witnessed -= witnessed
            self._unanswered -= unanswered

    def _add(self, now: float, success: bool, witnessed: bool, unanswered: bool) -> None:
        index = int(now // self.bucket)
        self._expire(index)
        buckets = self._buckets
        if not buckets or buckets[-1][0] < index:
            buckets.append([index, 0, 0, 0, 0])
        # A clock that steps back lands in the newest bucket rather than reordering the deque.
        if success:
            buckets[-1][1] += 1
            self._successes += 1
        else:
            buckets[-1][2] += 1
            self._failures += 1
            if witnessed:
                buckets[-1][3] += 1
                self._witnessed += 1
            if unanswered:
                buckets[-1][4] += 1
                self._unanswered += 1


class HealthScore:
    """A 0..``maximum`` score per agent: failures cost points, successes earn one back.

    Defaults: start at 100; delivery failure -10, accept timeout -5, overloaded -20, success +1
    (capped at 100); floor 0; :attr:`healthy` while the score is at least ``threshold`` (60).
    """

    __slots__ = (
        "_value",
        "accept_timeout_penalty",
        "delivery_failure_penalty",
        "maximum",
        "overloaded_penalty",
        "success_bonus",
        "threshold",
    )

    def __init__(
        self,
        *,
        initial: float = 100.0,
        maximum: float = 100.0,
        threshold: float = HEALTH_THRESHOLD,
        delivery_failure_penalty: float = 10.0,
        accept_timeout_penalty: float = 5.0,
        overloaded_penalty: float = 20.0,
        success_bonus: float = 1.0,
    ) -> None:
        self.maximum = maximum
        self.threshold = threshold
        self.delivery_failure_penalty = delivery_failure_penalty
        self.accept_timeout_penalty = accept_timeout_penalty
        self.overloaded_penalty = overloaded_penalty
        self.success_bonus = success_bonus
        self._value = min(max(initial, 0.0), maximum)

    @property
    def value(self) -> float:
        """The current score, between 0 and ``maximum``."""
        return self._value

    @property
    def healthy(self) -> bool:
        """Whether the score is at least ``threshold``."""
        return self._value >= self.threshold

    def _add(self, delta: float, floor: float = 0.0) -> None:
        # ``floor``: a penalty stops there (or where the score already is, if lower).
        self._value = min(max(self._value + delta, min(floor, self._value)), self.maximum)

    def success(self) -> None:
        """A task was accepted and finished: earn ``success_bonus`` back."""
        self._add(self.success_bonus)

    def delivery_failure(self, floor: float = 0.0) -> None:
        """A delivery failed (no responder, transport error). ``floor``: the score it may
        fall to (a caller's report alone: ``threshold``)."""
        self._add(-self.delivery_failure_penalty, floor)

    def accept_timeout(self, floor: float = 0.0) -> None:
        """The agent did not accept a delivered task in time."""
        self._add(-self.accept_timeout_penalty, floor)

    def overloaded(self, floor: float = 0.0) -> None:
        """The agent refused work as busy."""
        self._add(-self.overloaded_penalty, floor)


def caller_report(breaker: CircuitBreaker, health: HealthScore, report: FailureReport) -> bool:
    """Apply a caller's :class:`~reach_mesh.models.FailureReport` to an agent's breaker and
    health score; ``False`` when the reporter's budget for the window is spent (nothing changed).

    A success counts for both; a busy refusal lowers the health score only (overload, as in
    proxy mode); a caller's own error (:func:`is_agent_fault` false) changes nothing but still
    spends the budget; an agent fault counts as a reported — not witnessed — breaker failure.

    Reports alone never make an agent unhealthy (a score under ``threshold``, which routes
    around it), as they never open its breaker: their penalties stop at the threshold unless
    the hub saw a failure of the agent itself in the breaker's window. Callers of a namespace
    share one identity and name their ``reporter`` themselves, so one of them could otherwise
    keep a healthy agent out of rotation with reports under made-up names.
    """
    # No responders (``REACH_UNKNOWN_AGENT``) is no fault: the agent may be reconnecting, and
    # the hub routes around it until it is heard again (``AgentView.unreached_at``).
    fault = report.success or (
        is_agent_fault(report.code) and report.code != UnknownAgentError.code
    )
    if not breaker.report(report.success if fault else None, report.reporter or ""):
        return False
    if report.success:
        health.success()
        return True
    floor = 0.0 if breaker.witnessed else health.threshold
    if report.code == AgentBusyError.code:
        health.overloaded(floor)
    elif report.code == MeshTimeoutError.code:
        health.accept_timeout(floor)
    elif fault:
        health.delivery_failure(floor)
    return True
