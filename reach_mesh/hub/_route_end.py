"""The end of a route, the second half of the hub's hot path (``_routing.py`` has the first):
:class:`RouteEndMixin` (a base of :class:`~reach_mesh.hub._routing.RoutingMixin`) takes an
agent's reply — alone or in a batch — or an attempt's deadline, and finishes the flight:
counted, audited, traced, answered.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import logging
import math
import random
import time
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from opentelemetry.trace import Span, Status, StatusCode
from pydantic import BaseModel, ConfigDict

from reach_mesh import protocol
from reach_mesh._batch import BATCH_ITEMS, AnswerBatcher
from reach_mesh.config import MeshSettings
from reach_mesh.errors import (
    NOBODY_TAKES_ITS_TASKS,
    AgentBusyError,
    IdentityMismatchError,
    InternalError,
    MeshTimeoutError,
    NoHandlerError,
    ReachError,
    UnknownAgentError,
)
from reach_mesh.hub._dashboard import Dashboard
from reach_mesh.hub._lateness import LatenessMixin
from reach_mesh.hub._reply_boxes import ReplyBox
from reach_mesh.hub._wire import (
    _batch_subject,
    _reply_bytes,
)
from reach_mesh.hub.audit import AuditLog
from reach_mesh.hub.breaker import attempt_verdict
from reach_mesh.hub.registry import AgentView, Registry
from reach_mesh.hub.sessions import SessionStore
from reach_mesh.hub.shares import Shares
from reach_mesh.logs import (
    AGENT_TIMEOUT,
    AGENT_UNREACHABLE,
    ROUTE_LATENCY,
    LineBudget,
    log_event,
)
from reach_mesh.models import AgentState, ErrorBody, RouteDecision, RouteRequest, TaskState
from reach_mesh.tracing.metrics import HubMetrics, LoopHistogram

__all__ = ["OTHER_CAPABILITY", "RouteEndMixin"]

log = logging.getLogger("reach_mesh.hub")

#: A route that took longer than this (seconds) is logged (``REACH-ROUTE-LATENCY``).
_SLOW_ROUTE: Final = 0.25
#: How often unanswered proxy attempts are checked against their deadline (seconds).
_SWEEP_INTERVAL: Final = 0.005
#: Where capabilities past ``MeshSettings.metrics_capability_series`` are counted in
#: ``reach_task_duration_seconds``.
OTHER_CAPABILITY: Final = "other"
#: Reply "subjects" of routes asked in this process (``Hub.route``), followed by a number. A space
#: never occurs in a NATS subject, so no message's reply subject can name one of these callers.
_LOCAL_REPLY: Final = "local "
#: The longest time an agent's reply may report (ms: a day, a route's longest ``timeout``).
_MS_MAX: Final = 86_400_000.0
#: A route waiting for an agent that may be reconnecting (``_hold``) tries again after 20 ms,
#: doubling up to 0.5 s (each wait spread by ±50 %), and tries last this long before its
#: deadline (seconds).
_HOLD_FIRST: Final = 0.02
_HOLD_MAX: Final = 0.5
_HOLD_SLACK: Final = 0.02


class _ReplyHead(BaseModel):
    """The parts of an agent's ``TaskReply`` the hub acts on (metrics, breaker). Parsing
    skips building ``result``; the reply bytes themselves are passed on to the caller as they
    came (spliced into the ``RouteReply``), never re-encoded."""

    model_config = ConfigDict(extra="ignore")

    task_id: str
    attempt: int
    agent_id: str
    state: TaskState
    error: ErrorBody | None = None
    duration_ms: float = 0.0
    queued_ms: float = 0.0
    cached: bool = False


@dataclass(slots=True, eq=False)
class _Flight:
    """One route from its request to its answer: what the callbacks that continue it need.

    Times are ``time.perf_counter()`` on this hub (never the caller's clock)."""

    req: RouteRequest
    ns: str
    request_id: str
    reply_to: str
    t0: float
    deadline: float
    task_id: str
    trace_id: str | None = None
    #: The trace headers sent to the agent (tracing off: the caller's, as received).
    headers: dict[str, str] | None = None
    sticky: str | None = None
    attempt: int = 0
    exclude: set[str] = field(default_factory=set)
    #: ``attempt`` when the current round of tries began (``route_attempts`` per round).
    round_start: int = 0
    last_error: ReachError | None = None
    #: Agents this route found nobody listening for (``_unreachable``): since when, on the
    #: registry's clock, or ``inf`` for one found deaf.
    unreached: dict[str, float] | None = None
    #: The next wait of a route held for an agent that may be reconnecting (``_hold``).
    hold_delay: float = _HOLD_FIRST
    #: The agent that may have this task in hand already: an earlier try of its task id went
    #: to it (the pins), or this attempt was sent to it again after a reconnection. Until it
    #: is declared gone (LOST) the route goes to it alone (``_may_hold_task``): nobody
    #: listening on its subject now (its connection dropped) says nothing of what it runs,
    #: and another agent would run the task a second time.
    in_hand: str | None = None
    #: The caller marked it sent again (``Reach-Resend``): with no pin, the hub asks who
    #: holds the task before it decides (``hub/_holders.py``).
    resend: bool = False
    #: The agent its task id was pinned to before the attempt in flight pinned it to another
    #: (``RoutingMixin._decide_and_send``): the pin goes back to it if that attempt is refused
    #: before ACCEPTED (``_refused``: it never reached the other agent).
    pinned_over: str | None = None
    view: AgentView | None = None
    capability: str | None = None
    decision: RouteDecision | None = None
    #: The reply-subject token of the attempt in flight, and the reply subjects (of its
    #: agent's namespace) it is under.
    token: str = ""
    replies: ReplyBox | None = None
    #: Where the answer goes with others, if the request came in a batch.
    batch_reply: str | None = None
    span: Span | None = None
    deliver_span: Span | None = None
    #: Set by ``_finish``: a flight ends (and gives its slot back) once.
    finished: bool = False


class RouteEndMixin(LatenessMixin):
    """The methods of ``Hub`` that end a route (which sets every attribute below in its
    ``__init__`` and ``start``): the agent's reply, the deadline sweep, the answer (an
    expiry is charged to the agent once ordered against a marker: its base
    ``LatenessMixin``)."""

    settings: MeshSettings
    registry: Registry
    sessions: SessionStore
    audit: AuditLog
    metrics: HubMetrics
    dashboard: Dashboard | None
    _flights: dict[str, _Flight]
    _deadlines: list[tuple[float, str]]
    #: Set when an attempt joins an empty ``_deadlines`` (``_sweep_deadlines`` waits for it).
    _sweep_wake: asyncio.Event
    #: Route flights per namespace, against ``hub_concurrency`` (fairness).
    _ns_flights: Shares
    #: Routes waiting for an agent that may be reconnecting, by request id (``_hold``).
    _held: dict[str, tuple[_Flight, asyncio.TimerHandle]]
    #: ``REACH-AGENT-TIMEOUT`` lines, one per agent per 10 s.
    _timeout_lines: LineBudget
    #: ``REACH-AGENT-UNREACHABLE`` lines, one per agent (and verdict: deaf or not) per 10 s.
    _unreached_lines: LineBudget
    #: ``REACH-ROUTE-LATENCY`` lines, one per agent per 10 s (an overloaded hub makes every
    #: route slow: a line each would add to the load).
    _slow_lines: LineBudget
    _outage_lines: LineBudget
    _answers: AnswerBatcher
    _task_counters: dict[tuple[str, str, str], Any]
    _duration_children: dict[str, Any]
    _capability_series: int
    #: The capabilities each namespace made a series of, oldest first (``_duration_child``).
    _series_made: dict[str, list[str]]
    _accepted_seconds: LoopHistogram
    #: Routes asked in this process (``_route_local``) awaiting their answer, by reply token.
    _local: dict[str, asyncio.Future[bytes]]

    if TYPE_CHECKING:

        @property
        def nc(self) -> NATS: ...

        def known_namespace(self, ns: str) -> bool: ...

        def _spawn(self, coro: Coroutine[Any, Any, None]) -> None: ...

        async def answer(self, subject: str, reply: str, body: bytes) -> None: ...

        def _rejected(self, verb: str, sender: str | None, claimed: str, **fields: Any) -> None: ...

        async def _attempt(self, flight: _Flight) -> None: ...

        def _unpin(self, flight: _Flight, agent_id: str) -> None: ...

    # ------------------------------------------------------------------ ending a route
    #
    # The agent's reply arrives in the reply subscription's callback (``_on_agent_reply``),
    # which finishes the flight or, refused before ACCEPTED, tries the next agent; the
    # deadline sweep finishes the flights nobody answered. Every ending goes through
    # ``_finish``: counted, audited, its span closed, its caller answered, once.

    def _count(self, ns: str, mode: str, state: str) -> None:
        key = (ns, mode, state)
        child = self._task_counters.get(key)
        if child is None:
            child = self._task_counters[key] = self.metrics.task_total.labels(ns, mode, state)
        child.inc()

    async def _on_agent_reply(self, replies: ReplyBox, msg: Msg) -> None:
        """Answers on the reply subjects of a namespace (``replies``): an attempt's reply, a
        batch of replies, an answer to a ctl ask, or NATS saying nobody listens on an agent's
        subject (status 503, no data)."""
        token = msg.subject[replies.prefix_len :]
        data = msg.data
        headers = msg.headers
        no_responders = not data and headers is not None and headers.get("Status") == "503"
        # (Read one at a time, in the server's order — nats-py awaits this callback before it
        # takes the next message —, which the expiry markers rely on: ``hub/_lateness.py``.)
        if "." in token:  # one attempt's own reply subject
            flight = self._flights.pop(token, None)
            if flight is None:  # that attempt timed out already
                self._late_reply(token, data, no_responders)
            elif no_responders:
                await self._unreachable(flight)
            else:
                await self._answered(flight, data)
            return
        if replies.asks:  # a ctl ask's answer (``ReplyBoxes.ask``)?
            asked = replies.asks.pop(token, None)
            if asked is not None:
                if not asked.done():
                    asked.set_result(msg)
                return
        if no_responders:  # a whole batch found nobody
            for i in range(BATCH_ITEMS):
                attempt_token = f"{token}.{i}"
                flight = self._flights.pop(attempt_token, None)
                if flight is not None:
                    await self._unreachable(flight)
                elif attempt_token in self._late:
                    self._late_reply(attempt_token, data, True)
            return
        if not data and self._marker_back(token):  # this hub's own expiry marker
            return
        # A batch of replies: one line each, "<reply subject> <TaskReply JSON>".
        for attempt_token, body in protocol.split_answers(data, replies.prefix_b):
            flight = self._flights.pop(attempt_token, None)
            if flight is None:
                self._late_reply(attempt_token, body, False)
            else:
                await self._answered(flight, body)
        await asyncio.sleep(0)  # these answers leave before the next batch of replies is read

    async def _unreachable(self, flight: _Flight) -> None:
        """NATS answered that nobody listens on the agent's task subject: refused before
        ACCEPTED (nothing ran), so the route goes on (``_refused``).

        While its lease holds the agent may be reconnecting (its connection dropped, a NATS
        server restarted or failed over): that costs it nothing, but until it is heard from
        again routes go to it only when nobody else can take them (``unreached_at``), and a
        route that finds no other agent waits for it (``_hold``). A reconnecting agent's
        subscriptions are back before its first heartbeat after the reconnect, so one heard
        from after this route first found it unreachable, and unreachable still, is deaf
        (connected, its subscriptions gone): a delivery failure on its health and breaker,
        and never waited for again by this route."""
        view = flight.view
        assert view is not None
        view.outstanding -= 1
        unreached = flight.unreached
        if unreached is None:
            unreached = flight.unreached = {}
        now = self.registry.now
        since = unreached.setdefault(view.agent_id, now)
        view.unreached_at = now
        deaf = view.spoke_at > since
        if deaf:
            unreached[view.agent_id] = math.inf
            self._failed(view, delivery=True)
        why = (
            "heard from since, yet listening to nothing: its subscriptions are gone — restart it"
            if deaf
            else NOBODY_TAKES_ITS_TASKS
        )
        err = UnknownAgentError(
            f"agent {view.agent_id} has no subscriber on {view.record.task_subject} "
            f"(registered, {view.state.value}; {why})",
            agent_id=view.agent_id,
        )
        held = self._unreached_lines.take((view.agent_id, deaf))
        if held is not None:
            log_event(
                log,
                AGENT_UNREACHABLE,
                err.message + ("" if deaf else ": routes wait for it within their timeouts"),
                agent_id=view.agent_id,
                task_id=flight.task_id,
                trace_id=flight.trace_id,
                deaf=deaf,
                suppressed=held,
            )
        if flight.in_hand == view.agent_id and self._may_hold_task(view.agent_id, since):
            # It may have the task: wait for it alone (``RoutingMixin._decide_and_send``
            # sends the task to it again: its idempotency table answers from the run in hand).
            self._end_deliver(flight, err)
            flight.last_error = err
            if not self._hold(flight):
                await self._finish(flight, error=err)
            return
        await self._refused(flight, err)

    async def _refused(
        self, flight: _Flight, err: AgentBusyError | NoHandlerError | UnknownAgentError
    ) -> None:
        """Refused before ACCEPTED: safe to try another agent (and the task id's pin goes back
        to the agent it named before this attempt: ``_unpin``)."""
        view = flight.view
        assert view is not None
        self._unpin(flight, view.agent_id)
        self._end_deliver(flight, err)
        flight.last_error = err
        flight.exclude.add(view.agent_id)
        if (
            flight.attempt - flight.round_start >= self.settings.route_attempts
            or flight.req.agent_id is not None
        ):
            if not self._hold(flight):
                await self._finish(flight, error=err)
        else:
            self.metrics.retry_total.inc()
            await self._attempt(flight)

    def _hold(self, flight: _Flight) -> bool:
        """Every candidate refused the route, and one of them only because nobody listened
        on its subject while its lease holds (``_unreachable``): wait a little and try again
        from the start (the deaf excepted), until the route's deadline or the lease's end;
        ``False`` (answer now) when there is no such agent or no time left. Rare, so a timer
        per route."""
        unreached = flight.unreached
        if not unreached or not any(
            self._may_return(a, s) or (a == flight.in_hand and self._may_hold_task(a, s))
            for a, s in unreached.items()
        ):
            return False
        left = flight.deadline - time.perf_counter() - _HOLD_SLACK
        if left <= 0:
            return False
        wait = min(flight.hold_delay * random.uniform(0.5, 1.5), left)
        flight.hold_delay = min(flight.hold_delay * 2, _HOLD_MAX)
        flight.exclude = {a for a, since in unreached.items() if since == math.inf}
        flight.round_start = flight.attempt
        self.metrics.retry_total.inc()
        timer = asyncio.get_running_loop().call_later(wait, self._unhold, flight)
        self._held[flight.request_id] = (flight, timer)
        return True

    def _may_return(self, agent_id: str, since: float) -> bool:
        """Whether an agent a route found nobody listening for may be reconnecting: not deaf,
        and its lease has not lapsed (not SUSPECT: silent for a whole lease is no blip)."""
        view = self.registry.agents.get(agent_id)
        return (
            since != math.inf
            and view is not None
            and view.state not in (AgentState.SUSPECT, AgentState.LOST)
        )

    def _may_hold_task(self, agent_id: str, since: float) -> bool:
        """Whether a route waits for the agent that may have its task in hand
        (``_Flight.in_hand``): not deaf, and not declared gone (LOST) — a lapsed lease
        (SUSPECT) is not enough: its NATS server frozen for seconds, say, it comes back with
        the task run, and another agent would run it again."""
        view = self.registry.agents.get(agent_id)
        return since != math.inf and view is not None and view.state is not AgentState.LOST

    def _unhold(self, flight: _Flight) -> None:
        if self._held.pop(flight.request_id, None) is not None:  # (not ended by ``close``)
            self._spawn(self._attempt(flight))

    async def _answered(self, flight: _Flight, data: bytes) -> None:
        view = flight.view
        assert view is not None
        view.outstanding -= 1
        try:
            head = self._read_reply(view, flight, data)
        except (AgentBusyError, NoHandlerError, UnknownAgentError) as err:
            await self._refused(flight, err)
            return
        except ReachError as err:
            self._end_deliver(flight, err)
            await self._finish(flight, error=err)
            return
        self._end_deliver(flight, None)
        if head.state is TaskState.SUCCEEDED and flight.req.session_id is not None:
            self._spawn(self._remember_session(flight, view.agent_id, data, head))
        else:
            await self._finish(flight, task=data, head=head)

    async def _remember_session(
        self, flight: _Flight, agent_id: str, data: bytes, head: _ReplyHead
    ) -> None:
        """Map the session to the agent that served it, then answer: the caller's next request,
        through any hub, finds the mapping in KV."""
        assert flight.req.session_id is not None
        try:
            await self.sessions.put(flight.ns, flight.req.session_id, agent_id)
        except Exception as err:
            # (Every sticky route meets it while KV is down.)
            self._outage_lines.warn(
                log, "session KV put", "session %s: KV put failed: %r", flight.req.session_id, err
            )
        await self._finish(flight, task=data, head=head)

    def _duration_child(self, capability: str, namespace: str) -> Any:
        """``capability``'s series of ``reach_task_duration_seconds``, made for it while fewer
        than ``_capability_series`` are: agents name capabilities and callers route them, and
        a tenant minting new ones must not grow /metrics (and its render on this loop) without
        bound; past it, ``other``'s. The bound is shared: a namespace that made fewer series
        than the one that made the most (by two) takes that one's oldest, whose observations
        go to ``other`` — first come, one tenant's 64 capabilities once left every other
        tenant's under ``other`` for the hub's life."""
        made = self._series_made
        children = self._duration_children
        histogram = self.metrics.task_duration_seconds
        if len(children) - (OTHER_CAPABILITY in children) >= self._capability_series:
            mine = len(made.get(namespace, ()))
            most = max(made, key=lambda ns: len(made[ns]), default=None)
            if most is None or len(made[most]) <= mine + 1:
                other = children.get(OTHER_CAPABILITY)
                if other is None:
                    other = children[OTHER_CAPABILITY] = histogram.labels(OTHER_CAPABILITY)
                return other
            given = made[most].pop(0)
            if not made[most]:
                del made[most]
            del children[given]
            children[OTHER_CAPABILITY] = histogram.merge((given,), (OTHER_CAPABILITY,))
        child = children[capability] = histogram.labels(capability)
        made.setdefault(namespace, []).append(capability)
        return child

    def _read_reply(self, view: AgentView, flight: _Flight, data: bytes) -> _ReplyHead:
        """Parse an agent's reply for what the hub acts on, and feed its health, breaker and
        metrics; raise the typed error an error body carries."""
        capability = flight.capability
        try:
            protocol.raise_for_error(data)
            head = protocol.validate_json(_ReplyHead.model_validate_json, data)
            if head.agent_id != view.agent_id or head.task_id != flight.task_id:
                # Not the answer of the agent this attempt went to: nothing of it is used.
                self._rejected("reply", None, head.agent_id, expected=view.agent_id)
                raise IdentityMismatchError(
                    f"the reply to task {flight.task_id} sent to {view.agent_id} speaks for "
                    f"{head.agent_id!r}, task {head.task_id!r}",
                    agent_id=view.agent_id,
                )
        except AgentBusyError:
            # A cordoned agent refusing a task id it never had is no overload: penalised,
            # routes naming it with ``after_attempt`` (a caller's, each refused) left it
            # unhealthy here for minutes after the uncordon (+1 a heartbeat).
            if not self.registry.cordoned(view.agent_id, view.record):
                view.health.overloaded()
            raise
        except ReachError:
            raise
        except Exception as err:
            self._failed(view, delivery=True)
            raise InternalError(f"agent {view.agent_id} sent a malformed reply: {err}") from err
        # The agent's own figures: only sane ones join histograms every tenant shares (JSON
        # may say NaN, a negative or a huge number).
        if head.cached:
            # A duplicate delivery: its figures are the run it answers from, which that run's
            # reply brought already (observed again, one run would count twice).
            self.metrics.duplicate_delivery_total.inc()
        else:
            if 0.0 <= head.queued_ms <= _MS_MAX:
                self._accepted_seconds.observe(head.queued_ms / 1000)
            cap = capability or "-"
            child = self._duration_children.get(cap)
            if child is None:
                child = self._duration_child(cap, flight.ns)
            if 0.0 <= head.duration_ms <= _MS_MAX:
                child.observe(head.duration_ms / 1000)
        # The handler's own fault counts; a caller's bad payload (REACH_BAD_REQUEST) does not,
        # nor an answer from the agent's idempotency cache: no new run, and its run was counted
        # (a caller asking again for a failed task id quarantined a healthy agent).
        verdict = (
            None
            if head.cached
            else attempt_verdict(head.state, head.error.code if head.error is not None else None)
        )
        if verdict is not None:
            if verdict:
                view.health.success()
            view.breaker.record(verdict)
        self.registry.regrade(view)
        return head

    async def _sweep_deadlines(self) -> None:
        """Finish the attempts whose deadline passed without an answer (every few ms while
        any is in the heap; with none, it waits for the next one: ``_sweep_wake``)."""
        heap = self._deadlines
        while True:
            if not heap:
                # Nothing to expire (a hub that runs only workflows never has any): no wake-up
                # every 5 ms (200 a second, ~1 % of a core) until an attempt is sent.
                wake = self._sweep_wake
                wake.clear()
                await wake.wait()
                heap = self._deadlines
            await asyncio.sleep(_SWEEP_INTERVAL)
            now = time.perf_counter()
            while heap and heap[0][0] <= now:
                _, token = heapq.heappop(heap)
                flight = self._flights.pop(token, None)
                if flight is not None:
                    try:
                        await self._expired(flight)
                    except Exception as err:  # one flight's trouble must not stop the sweep
                        log.exception("expiring route %s failed", flight.request_id)
                        with contextlib.suppress(Exception):  # its slot back, its caller told
                            await self._finish(
                                flight, error=InternalError(f"internal error: {err!r}"[:200])
                            )
            if self._late_swept:  # a marker for the attempts this pass expired, per namespace
                await self._send_markers()
            # Answered attempts leave their entry behind; drop them once they outnumber the
            # live ones, so the heap stays the size of what is in flight.
            if len(heap) > 2 * len(self._flights) + 1024:
                live = self._flights
                self._deadlines = heap = [e for e in heap if e[1] in live]
                heapq.heapify(heap)

    async def _expired(self, flight: _Flight) -> None:
        view = flight.view
        assert view is not None
        view.outstanding -= 1
        # Charged once this hub's own marker shows no answer was waiting unread here (behind
        # a flood of this hub's reply subjects) when the pass ended (``hub/_lateness.py``).
        self._check_expiry(flight)
        err = MeshTimeoutError(
            f"agent {view.agent_id} did not answer task {flight.task_id} "
            f"attempt {flight.attempt} within {flight.req.timeout:.3g}s",
            agent_id=view.agent_id,
            task_id=flight.task_id,
            attempt=flight.attempt,
        )
        held = self._timeout_lines.take(view.agent_id)
        if held is not None:  # an agent that stopped answering, said at WARNING level
            log_event(
                log,
                AGENT_TIMEOUT,
                err.message,
                agent_id=view.agent_id,
                task_id=flight.task_id,
                attempt=flight.attempt,
                trace_id=flight.trace_id,
                timeout_s=flight.req.timeout,
                suppressed=held,
            )
        self._end_deliver(flight, err)
        await self._finish(flight, error=err)

    def _end_deliver(self, flight: _Flight, error: ReachError | None) -> None:
        sp, flight.deliver_span = flight.deliver_span, None
        if sp is not None:
            if error is not None:
                sp.set_status(Status(StatusCode.ERROR, error.code))
            sp.end()

    async def _finish(
        self,
        flight: _Flight,
        *,
        task: bytes | None = None,
        head: _ReplyHead | None = None,
        subject: str | None = None,
        alternates: list[AgentView] | None = None,
        error: ReachError | None = None,
        holder: str | None = None,
    ) -> None:
        """The one way a route ends: count it, audit it, close its span, answer the caller.
        Once per flight, and its slot is given back whatever happens on the way. ``holder``:
        the agent whose stored reply ``task`` is when no attempt was sent (a resend's holder
        declared LOST, ``hub/_holders.py``)."""
        if flight.finished:
            return
        flight.finished = True
        try:
            body = self._conclude(flight, task, head, subject, alternates, error, holder)
        except Exception:  # a bug, not the request: the caller still gets a typed answer
            log.exception("finishing route %s failed", flight.request_id)
            body = protocol.encode_error(InternalError("internal error finishing the route"))
        finally:
            self._ns_flights.give(flight.ns)
        await self._answer(flight.reply_to, body, flight.batch_reply)

    def _conclude(
        self,
        flight: _Flight,
        task: bytes | None,
        head: _ReplyHead | None,
        subject: str | None,
        alternates: list[AgentView] | None,
        error: ReachError | None,
        holder: str | None = None,
    ) -> bytes:
        """Count, audit and close the span of an ending route; its answer's bytes."""
        req, ns = flight.req, flight.ns
        view = flight.view
        # The agent the answer is from: the one the attempt went to, or the holder whose
        # stored reply it is.
        agent_id = view.agent_id if view is not None else holder
        target = req.agent_id or req.capability or req.selector
        # An agent id in a namespace that does not exist (checked in the registry's KV first):
        # answered, but neither counted nor audited.
        known = self.known_namespace(ns)
        if error is not None:
            if known:
                self._count(ns, req.mode, error.code.removeprefix("REACH_"))
            event: dict[str, Any] = {
                "request_id": flight.request_id,
                "trace_id": flight.trace_id,
                "task_id": req.task_id,
                "target": _clip(target),
                "error": error.code,
                "reason": _clip(error.message),
            }
            if view is not None:  # it reached an agent: the last one is what it is about
                event["agent_id"] = view.agent_id
                event["attempts"] = flight.attempt
            body = protocol.encode_error(error)
        else:
            assert agent_id is not None
            if head is not None:
                state = head.state.value
            else:
                state = "EXPLAINED" if req.dry_run else "ROUTED"
            if known and not req.dry_run:  # an explanation is not a task
                counted = state
                code = head.error.code if head is not None and head.error is not None else None
                if code is not None and code.startswith("REACH_BAD_"):
                    # The agent refused the caller's payload (its handler's model): the
                    # caller's fault (as for the breaker), not the agents failing (the
                    # success-rate alert would page for a caller's bug). One label: the
                    # agent chooses the code, and must not mint series.
                    counted = "BAD_REQUEST"
                self._count(ns, req.mode, counted)
            event = {
                "request_id": flight.request_id,
                "trace_id": flight.trace_id,
                "task_id": head.task_id if head is not None else req.task_id,
                "agent_id": agent_id,
                "target": _clip(target),
                "state": state,
                "attempts": flight.attempt,
            }
            if head is not None and head.error is not None:  # the handler's FAILED, TIMEOUT
                event["error"] = head.error.code
                event["reason"] = _clip(head.error.message)
            body = _reply_bytes(
                flight.request_id,
                agent_id,
                subject=subject,
                batch_subject=_batch_subject(view) if subject is not None and view else None,
                task=task,
                decision=flight.decision,
                alternates=alternates,
                attempts=flight.attempt,
            )
        if flight.exclude:  # agents that refused it before (busy, no handler, gone)
            event["refused_by"] = sorted(flight.exclude)
        if known:
            self.audit.add(ns, "route", event)
            if self.dashboard is not None:
                self.dashboard.record_route(
                    event, flight.decision, error, req.strategy, flight.exclude
                )
        elapsed = time.perf_counter() - flight.t0
        if elapsed > _SLOW_ROUTE:
            held = self._slow_lines.take(agent_id)
            if held is not None:
                log_event(
                    log,
                    ROUTE_LATENCY,
                    "slow route",
                    request_id=flight.request_id,
                    trace_id=flight.trace_id,
                    agent_id=agent_id,
                    elapsed_ms=round(elapsed * 1000, 2),
                    suppressed=held,
                )
        sp = flight.span
        if sp is not None:
            if agent_id is not None:
                sp.set_attribute("reach.agent_id", agent_id)
            sp.set_attribute("reach.attempts", flight.attempt)
            if head is not None:  # the agent's final state: FAILED is the handler's, not ours
                sp.set_attribute("reach.state", head.state.value)
            if error is not None:
                sp.set_status(Status(StatusCode.ERROR, error.code))
            sp.end()
        return body

    async def _answer(self, reply: str, body: bytes, batch_reply: str | None = None) -> None:
        """Send a route's answer: now, or — for a request that came in a batch — with the other
        answers to that batch's reply subject that are ready in this pass of the event loop."""
        if not reply:
            return
        if reply.startswith(_LOCAL_REPLY):  # asked in this process (``_route_local``)
            answer = self._local.pop(reply, None)
            if answer is not None and not answer.done():
                answer.set_result(body)
            return
        if batch_reply and self._answers.add(batch_reply, reply, body):
            return
        # (one too large to send is answered REACH_PAYLOAD_TOO_LARGE; a publish NATS refuses
        # is logged: ``Hub.answer``)
        await self.answer("route", reply, body)

    def _failed(self, view: AgentView, *, delivery: bool) -> None:
        if delivery:
            view.health.delivery_failure()
        view.breaker.record(False)
        self.registry.regrade(view)


#: The longest selector or reason an audit event keeps: the shared audit stream ages out by
#: size, and a caller's long selectors must not push every tenant's history out of it.
_AUDIT_TEXT_MAX: Final = 512


def _clip(text: str | None) -> str | None:
    if text is None or len(text) <= _AUDIT_TEXT_MAX:
        return text
    return text[: _AUDIT_TEXT_MAX - 1] + "…"
