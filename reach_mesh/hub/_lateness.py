"""Whose lateness an expired proxy attempt is: its agent is asked before it is charged
(:class:`LatenessMixin`, a base of :class:`~reach_mesh.hub._route_end.RouteEndMixin`).

A proxy attempt whose deadline passes unanswered ends at once for its caller
(``REACH_TIMEOUT``); what it costs its agent — an accept timeout on its health, a failure on
its breaker — waits for the agent's own word. The hub reads the answers to its attempts, in
the order they come, on reply subjects every agent may publish on (it answers there): an
identity flooding them holds every tenant's answers unread in the hub's queue (or socket)
past their deadlines, and an answer may also be lost with the connection. Charged at once,
each such expiry was the flood's doing charged to a healthy agent: another namespace's agent
was QUARANTINED for most of a 10 s flood of 100-byte messages (docs/security.md). So the hub
asks the agent — ctl ``task_state`` with ``route: true``, as for a resent route
(``hub/_holders.py``), on the asks' own subscription and unguessable reply subjects
(``Registry.asks``) — and charges by its answer:

- it finished the attempt (its stored reply, of that attempt or a later one) within the
  route's timeout, by the reply's own ``queued_ms`` and ``duration_ms``: it answered, and the
  hub read that late or lost it. The reply counts as if read in time (``_read_reply``: a
  success, or a timeout or failure of its own on the breaker, a caller's bad payload
  nothing);
- it finished it, but later than that (a handler that held the agent's event loop past the
  deadline, the ask answered only after it returned): it did not answer in time;
- it holds the attempt unfinished, never had it (``PENDING``), answers an error or something
  malformed or oversized: it did not answer in time — an accept timeout and a breaker failure,
  as before;
- nobody listens on its ctl subject (NATS' "no responders"): the same;
- no answer within ``EXPIRY_ASK_TIMEOUT``: the same only if this hub shows it reads the asks'
  answers in time — a message it sends itself comes back through their subscription within
  ``_CAUGHT_UP_WAIT`` (behind whatever the server had for it: ``JsClient.caught_up``), the
  ask still unanswered then, and no reconnection since it was sent; else not charged (the
  flood may be on the asks' reply subjects too).

Only the agent's own identity may subscribe to its ctl subject (secure mode), so the answer is
the agent's; it may lie about its own tasks, as it may in its replies — and then only its own
namespace's routes, which alone go to it, are misled.

Bounded: ``EXPIRY_ASKS_PER_NAMESPACE`` asks at once per namespace and ``EXPIRY_ASKS_MOST`` per
hub — a caller whose routes time out on purpose, or agents that never answer ctl, cannot
make them an amplifier nor take every tenant's. An expiry past them is not charged (counted
``skipped``): an expiry nobody checked proves nothing, and the checked ones of an agent that
stopped answering still open its breaker, whose failure ratio an uncounted one leaves as it
is. A route answered in time costs nothing of this.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
from typing import TYPE_CHECKING, Final

import nats.errors

from reach_mesh import protocol
from reach_mesh.config import MeshSettings
from reach_mesh.errors import ReachError
from reach_mesh.hub.breaker import attempt_verdict
from reach_mesh.hub.registry import AgentView, Registry
from reach_mesh.models import TaskState
from reach_mesh.tracing.metrics import HubMetrics

if TYPE_CHECKING:
    from reach_mesh.hub._route_end import _Flight

__all__ = [
    "EXPIRY_ASKS_MOST",
    "EXPIRY_ASKS_PER_NAMESPACE",
    "EXPIRY_ASK_TIMEOUT",
    "LatenessMixin",
]

#: Expiries a hub asks agents about at once, at most, and of those for one namespace.
EXPIRY_ASKS_MOST: Final = 128
EXPIRY_ASKS_PER_NAMESPACE: Final = 16
#: How long an agent's ``task_state`` answer is waited for (seconds) before the hub checks
#: whether the silence is its own (``JsClient.caught_up``).
EXPIRY_ASK_TIMEOUT: Final = 1.0
#: How long that check may take (seconds): slower, this hub is behind its reading.
_CAUGHT_UP_WAIT: Final = 0.5
#: What an answer may take beyond ``max_payload`` (the stored reply's fields around its result).
_ANSWER_SLACK: Final = 16 * 1024


class _Word(enum.Enum):
    """What an agent's ``task_state`` answer says of an attempt that expired unanswered."""

    #: It did not answer in time (in hand unfinished, never had it, an error answer).
    LATE = "late"
    #: It answered SUCCEEDED.
    SUCCEEDED = "succeeded"
    #: It answered a timeout or a failure of its own.
    FAILED = "failed"
    #: It answered something that is no breaker matter (a caller's bad payload).
    NEUTRAL = "neutral"


def agent_word(
    data: bytes,
    agent_id: str,
    task_id: str,
    attempt: int,
    max_size: int,
    timeout: float | None = None,
) -> _Word:
    """What ``agent_id``'s answer ``data`` to ctl ``task_state`` (``route: true``) says of
    attempt ``attempt`` of ``task_id``, which expired unanswered on this hub: its final reply,
    for itself and that task, of that attempt or a later one, says it answered (and how: the
    reply's own verdict, ``attempt_verdict``); anything else — in hand unfinished, ``PENDING``,
    the final reply of an earlier attempt, an error answer, one malformed, over ``max_size``
    bytes or speaking for another agent or task — that it did not answer in time. So does a
    final reply whose own ``queued_ms`` and ``duration_ms`` add up to more than ``timeout``
    (the route's, seconds): the agent took the attempt after the route began, so it made
    that reply past the route's deadline, by its own clock."""
    if len(data) > max_size:
        return _Word.LATE
    try:
        body = protocol.loads_object(data)
        state = TaskState(str(body.get("state")))
    except (ReachError, ValueError):
        return _Word.LATE
    answered = body.get("attempt")
    if (
        not state.final
        or body.get("agent_id") != agent_id
        or body.get("task_id") != task_id
        or isinstance(answered, bool)
        or not isinstance(answered, int)
        or answered < attempt
    ):
        return _Word.LATE
    if timeout is not None and _took_ms(body) > timeout * 1000:
        return _Word.LATE
    error = body.get("error")
    code = error.get("code") if isinstance(error, dict) else None
    verdict = attempt_verdict(state, code if isinstance(code, str) else None)
    if verdict is None:
        return _Word.NEUTRAL
    return _Word.SUCCEEDED if verdict else _Word.FAILED


def _took_ms(body: dict[str, object]) -> float:
    """How long (ms) a reply says its attempt took on its agent, from arrival to reply (what
    it does not say, or not as a number, counts as nothing)."""
    took = 0.0
    for key in ("queued_ms", "duration_ms"):
        value = body.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
            took += value
    return took


class LatenessMixin:
    """The methods of ``Hub`` that charge an expired proxy attempt to its agent once asked
    (``Hub`` sets every attribute below)."""

    settings: MeshSettings
    registry: Registry
    metrics: HubMetrics
    #: Expiry asks in progress (``EXPIRY_ASKS_MOST``), per namespace
    #: (``EXPIRY_ASKS_PER_NAMESPACE``; none kept at 0), and their tasks (cancelled at close).
    _expiry_asks: int
    _expiry_asks_by_ns: dict[str, int]
    _expiry_checks: set[asyncio.Task[None]]

    def _check_expiry(self, flight: _Flight) -> None:
        """``flight``'s attempt expired unanswered: ask its agent before charging it (module
        docstring), within the asks' bounds; past them, nothing is charged."""
        view, ns = flight.view, flight.ns
        assert view is not None
        by_ns = self._expiry_asks_by_ns
        held = by_ns.get(ns, 0)
        if self._expiry_asks >= EXPIRY_ASKS_MOST or held >= EXPIRY_ASKS_PER_NAMESPACE:
            self.metrics.expiry_checks_total.labels("skipped").inc()
            return
        self._expiry_asks += 1
        by_ns[ns] = held + 1
        task = asyncio.get_running_loop().create_task(
            self._ask_then_charge(view, ns, flight.task_id, flight.attempt, flight.req.timeout)
        )
        self._expiry_checks.add(task)
        task.add_done_callback(self._expiry_checks.discard)

    async def _ask_then_charge(
        self, view: AgentView, ns: str, task_id: str, attempt: int, timeout: float
    ) -> None:
        try:
            outcome = await self._ask_expired(view, task_id, attempt, timeout)
        except Exception:  # a bug, not the agent: nothing charged
            outcome = "behind"
        finally:
            self._expiry_asks -= 1
            by_ns = self._expiry_asks_by_ns
            by_ns[ns] -= 1
            if not by_ns[ns]:
                del by_ns[ns]
        self.metrics.expiry_checks_total.labels(outcome).inc()

    async def _ask_expired(
        self, view: AgentView, task_id: str, attempt: int, timeout: float
    ) -> str:
        """Ask ``view``'s agent about the attempt that expired (of a route of ``timeout``
        seconds), charge it by the answer, and say how it ended (an ``EXPIRY_OUTCOMES``
        label)."""
        asks = self.registry.asks
        body = protocol.dumps({"op": "task_state", "task_id": task_id, "route": True})
        reconnections = asks.reconnections
        # Kept waiting through the check of this hub's own reading below: an answer it finds
        # unread is still taken.
        ask = asyncio.ensure_future(
            asks.ask(
                protocol.agent_ctl(view.agent_id),
                body,
                timeout=EXPIRY_ASK_TIMEOUT + 2 * _CAUGHT_UP_WAIT,
            )
        )
        try:
            done, _ = await asyncio.wait({ask}, timeout=EXPIRY_ASK_TIMEOUT)
            if not done:
                # Silent so far: the agent's doing, or this hub's reading?
                caught_up = await asks.caught_up(_CAUGHT_UP_WAIT)
                if not ask.done():
                    if caught_up and asks.reconnections == reconnections:
                        self._charge(view, _Word.LATE)
                        return "charged"
                    return "behind"  # its answer may be waiting unread, or lost
            try:
                data = ask.result().data
            except nats.errors.NoRespondersError:  # nobody listens on its ctl subject
                self._charge(view, _Word.LATE)
                return "charged"
            except Exception:
                # Timed out while this hub's loop was too slow to look, or a connection
                # closing: this hub's trouble, not the agent's.
                return "behind"
            word = agent_word(
                data,
                view.agent_id,
                task_id,
                attempt,
                self.settings.max_payload + _ANSWER_SLACK,
                timeout,
            )
            if self.registry.agents.get(view.agent_id) is view:
                self.registry.answered_on_ctl(view)  # (any answer: not deaf)
            self._charge(view, word)
            return "charged" if word is _Word.LATE else "answered"
        finally:
            if not ask.done():
                ask.cancel()
            with contextlib.suppress(BaseException):
                await ask

    def _charge(self, view: AgentView, word: _Word) -> None:
        """Charge ``view`` as ``word`` says — if it is still the agent's registration here
        (one that left meanwhile keeps what it had)."""
        if self.registry.agents.get(view.agent_id) is not view or word is _Word.NEUTRAL:
            return
        if word is _Word.SUCCEEDED:
            view.health.success()
            view.breaker.record(True)
        elif word is _Word.FAILED:
            view.breaker.record(False)
        else:
            view.health.accept_timeout()
            view.breaker.record(False)
        self.registry.regrade(view)
