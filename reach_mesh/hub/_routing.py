"""Routing, the hub's hot path: :class:`RoutingMixin` (a base of
:class:`~reach_mesh.hub.Hub`) takes route requests, alone or batched, and carries each as a
flight from its decision through the attempts sent to agents (batched per agent) to the answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import logging
import time
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from opentelemetry.trace import Span, Status, StatusCode
from pydantic import BaseModel, ConfigDict

from reach_mesh import protocol
from reach_mesh._batch import BATCH_BYTES, BATCH_ITEMS, AnswerBatcher, reply_token
from reach_mesh.config import MeshSettings
from reach_mesh.errors import (
    AgentBusyError,
    BadRequestError,
    IdentityMismatchError,
    InternalError,
    MeshTimeoutError,
    MeshUnavailableError,
    NoHandlerError,
    NoMatchError,
    ReachError,
    ThrottledError,
    UnknownAgentError,
)
from reach_mesh.hub._dashboard import Dashboard
from reach_mesh.hub._wire import (
    _batch_subject,
    _envelope_bytes,
    _forward_trace,
    _new_id,
    _reply_bytes,
)
from reach_mesh.hub.audit import AuditLog
from reach_mesh.hub.breaker import is_agent_fault
from reach_mesh.hub.registry import AgentView, Registry
from reach_mesh.hub.router import Router
from reach_mesh.hub.sessions import SessionStore
from reach_mesh.hub.shares import Shares
from reach_mesh.hub.throttle import Throttle
from reach_mesh.logs import AGENT_TIMEOUT, ROUTE_LATENCY, SELECT_EMPTY, LineBudget, log_event
from reach_mesh.models import ErrorBody, RouteDecision, RouteRequest, TaskState
from reach_mesh.tracing import (
    SPAN_DELIVER,
    SPAN_ROUTE,
    TRACEPARENT,
    SpanKind,
    inject_span,
    open_span,
    tracing_enabled,
)
from reach_mesh.tracing.metrics import HubMetrics, LoopHistogram

__all__ = ["RoutingMixin"]

log = logging.getLogger("reach_mesh.hub")

#: Bytes allowed on top of ``max_payload`` for the request's own fields.
_ENVELOPE_SLACK: Final = 16 * 1024
_SLOW_ROUTE: Final = 0.25
#: How often unanswered proxy attempts are checked against their deadline (seconds).
_SWEEP_INTERVAL: Final = 0.005
#: Other routable agents a direct-mode reply lists for the caller to cache and spread over.
DIRECT_ALTERNATES: Final = 3
#: The one throttle bucket shared by route requests to namespaces that do not exist (an agent
#: id in one may name an agent registered through another hub a moment ago).
_UNKNOWN_NS: Final = "*"
#: Capabilities that get a series of their own in ``reach_task_duration_seconds``; the ones
#: seen after them share ``capability="other"``.
CAPABILITY_SERIES: Final = 512
OTHER_CAPABILITY: Final = "other"
#: Retry hint of a namespace over its fair share of a full hub: when one of its flights ends
#: is unknown, so a short one (the SDK adds its own growing backoff).
_FAIR_SHARE_RETRY_MS: Final = 100
#: Reply "subjects" of routes asked in this process (``Hub.route``), followed by a number. A space
#: never occurs in a NATS subject, so no message's reply subject can name one of these callers.
_LOCAL_REPLY: Final = "local "


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
    last_error: ReachError | None = None
    view: AgentView | None = None
    capability: str | None = None
    decision: RouteDecision | None = None
    #: The reply-subject token of the attempt in flight.
    token: str = ""
    #: Where the answer goes with others, if the request came in a batch.
    batch_reply: str | None = None
    span: Span | None = None
    deliver_span: Span | None = None
    #: Set by ``_finish``: a flight ends (and gives its slot back) once.
    finished: bool = False


@dataclass(slots=True, eq=False)
class _Outbox:
    """Attempts for one agent decided in this pass of the event loop: (token, body, headers)."""

    view: AgentView
    token: str
    items: list[tuple[str, bytes, dict[str, str]]] = field(default_factory=list)
    size: int = 0


class RoutingMixin:
    """The routing methods of ``Hub`` (which sets every attribute below in its ``__init__``
    and ``start``)."""

    settings: MeshSettings
    registry: Registry
    router: Router
    sessions: SessionStore
    audit: AuditLog
    metrics: HubMetrics
    dashboard: Dashboard | None
    _flights: dict[str, _Flight]
    _deadlines: list[tuple[float, str]]
    #: Route flights per namespace, against ``hub_concurrency`` (fairness).
    _ns_flights: Shares
    #: ``REACH-SELECT-EMPTY`` lines, one per (namespace, target) per 10 s.
    _no_match_lines: LineBudget
    #: ``REACH-AGENT-TIMEOUT`` lines, one per agent per 10 s.
    _timeout_lines: LineBudget
    _reply_prefix: str
    _reply_prefix_b: bytes
    _reply_prefix_len: int
    _outboxes: dict[str, _Outbox]
    _full: list[_Outbox]
    _answers: AnswerBatcher
    _sender: asyncio.Task[None] | None
    _route_throttle: Throttle
    _task_counters: dict[tuple[str, str, str], Any]
    _duration_children: dict[str, Any]
    _route_seconds: LoopHistogram
    _accepted_seconds: LoopHistogram
    #: Routes asked in this process (``_route_local``) awaiting their answer, by reply token.
    _local: dict[str, asyncio.Future[bytes]]
    _local_ids: itertools.count[int]

    if TYPE_CHECKING:

        @property
        def nc(self) -> NATS: ...

        def _namespace(self, subject: str) -> str: ...

        def known_namespace(self, ns: str) -> bool: ...

        def _spawn(self, coro: Coroutine[Any, Any, None]) -> None: ...

        def _rejected(self, verb: str, sender: str | None, claimed: str, **fields: Any) -> None: ...

    # ------------------------------------------------------------------ routing
    #
    # A route is a flight: the request's callback decides and publishes the task to the agent
    # with a reply subject of this hub's own (``<inbox>.<token>``), and returns; the agent's
    # reply arrives in another callback, which finishes the flight (or tries the next agent),
    # and a deadline sweep finishes the flights nobody answered. No task, future or timer per
    # request: the hot path is two message callbacks and two publishes. Only a route that needs
    # the KV first (a sticky session, an agent registered through another hub a moment ago)
    # runs that lookup in a task before its first attempt.

    def _count(self, ns: str, mode: str, state: str) -> None:
        key = (ns, mode, state)
        child = self._task_counters.get(key)
        if child is None:
            child = self._task_counters[key] = self.metrics.task_total.labels(ns, mode, state)
        child.inc()

    async def _route_local(
        self, data: bytes, namespace: str, headers: dict[str, str] | None
    ) -> bytes:
        """Route one request that came in this process (``Hub.route``) as one that came on
        ``reach.hub.<namespace>.route``, with a reply token ``_answer`` resolves here."""
        subject = protocol.hub_subject(protocol.validate_namespace(namespace), "route")
        reply = f"{_LOCAL_REPLY}{next(self._local_ids)}"
        answer: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
        self._local[reply] = answer
        try:
            await self._route_one(subject, data, reply, headers, None)
            return await answer
        finally:
            self._local.pop(reply, None)

    async def _on_route_msg(self, msg: Msg) -> None:
        """The route subscription's callback: admit the request, start its first attempt."""
        await self._route_one(msg.subject, msg.data, msg.reply, msg.headers, None)

    async def _on_route_batch(self, msg: Msg) -> None:
        """``reach.hub.<ns>.route_batch``: several route requests in one message, one line each,
        ``<reply subject> <traceparent> <RouteRequest JSON>``. Each is routed as if it had come
        alone; their answers go back batched to the message's reply subject."""
        requests, malformed = protocol.split_batch(msg.data)
        for reply, traceparent, body in requests:
            await self._route_one(msg.subject, body, reply, {TRACEPARENT: traceparent}, msg.reply)
        if malformed:  # no reply subject to answer on: only the log can be told
            log.warning("route batch on %s: %d malformed line(s) dropped", msg.subject, malformed)
        # Let this batch's attempts leave before the next batch is read: the agent starts on
        # them while this hub decides the next ones.
        await asyncio.sleep(0)

    async def _route_one(
        self,
        subject: str,
        data: bytes,
        reply: str,
        headers: dict[str, str] | None,
        batch_reply: str | None,
    ) -> None:
        flights = self._ns_flights
        try:
            ns = self._namespace(subject)
            if not flights.admits(ns):
                raise self._over_share(ns)
            flight = self._admit(data, reply, headers, subject, ns)
        except ReachError as err:
            await self._answer(reply, protocol.encode_error(err), batch_reply)
            return
        except Exception as err:  # the hub never crashes on input
            log.exception("internal error on %s", subject)
            await self._answer(
                reply,
                protocol.encode_error(InternalError(f"internal error: {type(err).__name__}")),
                batch_reply,
            )
            return
        flight.batch_reply = batch_reply
        flights.take(flight.ns)
        req = flight.req
        if req.session_id is not None or (
            req.agent_id is not None and req.agent_id not in self.registry.agents
        ):
            self._spawn(self._lookup_then_attempt(flight))
        else:
            await self._attempt(flight)

    def _over_share(self, ns: str) -> ThrottledError:
        """Fairness: the hub is full and ``ns`` holds its fair share of it, so the request is
        refused before anything is decoded (its retries cost little) while the other
        namespaces' requests are still read and served. Counted in ``reach_throttled_total``
        only: the SDK retries it, and its outcome is counted then."""
        flights = self._ns_flights
        if self.known_namespace(ns):
            self.metrics.throttled_total.labels(ns).inc()
        return ThrottledError(
            f"this hub is full and namespace {ns!r} holds its fair share of it "
            f"({flights.held(ns)} route requests in flight)",
            retry_after_ms=_FAIR_SHARE_RETRY_MS,
        )

    def _admit(
        self, data: bytes, reply: str, headers: dict[str, str] | None, subject: str, ns: str
    ) -> _Flight:
        """Decode and check a route request; raise the typed error that answers it."""
        req = protocol.decode(
            data, RouteRequest, max_size=self.settings.max_payload + _ENVELOPE_SLACK
        )
        known = self.known_namespace(ns)
        if not known and req.agent_id is None:
            # Answered at once: no flight, no metric series, no audit subject for it.
            raise self.router.unknown_namespace(req, ns)
        retry = self._route_throttle.check(ns if known else _UNKNOWN_NS)
        if retry > 0:
            if known:
                self.metrics.throttled_total.labels(ns).inc()
                self._count(ns, req.mode, "THROTTLED")
            raise ThrottledError(
                f"namespace {ns!r} is over its route rate", retry_after_ms=int(retry * 1000) + 1
            )
        if req.agent_id is not None and protocol.namespace_of(req.agent_id) != ns:
            raise BadRequestError(
                f"agent {req.agent_id!r} is not in namespace {ns!r}: route on "
                f"reach.hub.{protocol.namespace_of(req.agent_id)}.route",
                field="agent_id",
            )
        now = time.perf_counter()
        flight = _Flight(
            req=req,
            ns=ns,
            request_id=_new_id(),
            reply_to=reply,
            t0=now,
            deadline=now + req.timeout,
            task_id=req.task_id or _new_id() + _new_id(),
        )
        if tracing_enabled():
            sp = open_span(
                SPAN_ROUTE,
                kind=SpanKind.SERVER,
                parent_headers=headers,
                destination=subject,
                attributes={"reach.request_id": flight.request_id},
            )
            flight.span = sp
            flight.trace_id = f"{sp.get_span_context().trace_id:032x}"
        else:
            # Nothing is recorded: the caller's trace context goes on to the agent as the
            # strings it came as (or a new trace starts here).
            flight.headers, flight.trace_id = _forward_trace(headers)
        return flight

    async def _lookup_then_attempt(self, flight: _Flight) -> None:
        """The KV reads a route needs before it can decide: its session's agent, or an agent
        registered through another hub that this hub's watch has not shown yet."""
        req = flight.req
        try:
            if req.session_id is not None:
                flight.sticky = await self.sessions.get(flight.ns, req.session_id)
            if req.agent_id is not None and req.agent_id not in self.registry.agents:
                await self.registry.fetch(req.agent_id)
        except Exception as err:
            log.warning("route %s: KV lookup failed: %r", flight.request_id, err)
        await self._attempt(flight)

    async def _attempt(self, flight: _Flight) -> None:
        """Decide, then answer (direct mode, dry run, no match) or send the task (proxy)."""
        try:
            await self._decide_and_send(flight)
        except Exception as err:  # a bug, not the input: the route still gets its answer
            log.exception("route %s failed", flight.request_id)
            if flight.token not in self._flights:  # not handed to an agent yet
                await self._finish(
                    flight, error=InternalError(f"internal error: {type(err).__name__}")
                )

    async def _decide_and_send(self, flight: _Flight) -> None:
        req = flight.req
        flight.attempt += 1
        try:
            choice = self.router.decide(
                req,
                flight.ns,
                flight.request_id,
                exclude=frozenset(flight.exclude),
                sticky_agent=flight.sticky,
                # Alternates let a direct-mode caller cache the decision; a session or hash key
                # asks for per-request routing, so those get none.
                alternates=DIRECT_ALTERNATES
                if req.mode == "direct" and req.session_id is None and req.hash_key is None
                else 0,
            )
        except NoMatchError as err:
            if flight.last_error is not None and flight.exclude:
                await self._finish(flight, error=flight.last_error)  # every candidate refused
                return
            self._say_no_match(flight, _clip(req.agent_id or req.capability or req.selector))
            await self._finish(flight, error=err)
            return
        except ReachError as err:
            await self._finish(flight, error=err)
            return
        view = choice.view
        self._route_seconds.observe(choice.elapsed_us / 1e6)
        flight.view = view
        flight.decision = choice.decision
        if req.dry_run:
            await self._finish(flight, subject=view.record.task_subject)
            return
        if req.mode == "direct":
            view.assigned(self.registry.now)
            await self._finish(
                flight, subject=view.record.task_subject, alternates=choice.alternates
            )
            return
        remaining = flight.deadline - time.perf_counter()
        if remaining <= 0:
            late = MeshTimeoutError(
                f"task {flight.task_id} not delivered within {req.timeout:g}s",
                task_id=flight.task_id,
            )
            await self._finish(flight, error=late)
            return
        flight.capability = choice.capability
        subject = view.record.task_subject
        # Written from values validated already (the RouteRequest, the router's choice).
        body = _envelope_bytes(
            flight.task_id, flight.attempt, choice.capability, req.payload, flight.ns, remaining
        )
        if flight.span is not None:
            flight.deliver_span = open_span(
                SPAN_DELIVER, kind=SpanKind.CLIENT, parent=flight.span, destination=subject
            )
            headers = inject_span(flight.deliver_span)
        else:
            assert flight.headers is not None
            headers = flight.headers
        self._enqueue(flight, view, body, headers)

    # Attempts leave in batches: those decided for one agent in one pass of the event loop
    # (a burst of route messages read together) go out together when the pass ends — one NATS
    # message on reach.agent.<id>.batch if the agent takes batches and there are several, else
    # one message each. Nothing waits for a batch to fill: at low load every batch is one
    # attempt, sent at the end of the pass that decided it.

    def _enqueue(
        self, flight: _Flight, view: AgentView, body: bytes, headers: dict[str, str]
    ) -> None:
        box = self._outboxes.get(view.agent_id)
        if box is not None and (
            len(box.items) >= BATCH_ITEMS or box.size + len(body) > BATCH_BYTES
        ):
            self._full.append(box)
            box = None
        if box is None:
            box = self._outboxes[view.agent_id] = _Outbox(view, reply_token())
            if self._sender is None:
                self._sender = asyncio.get_running_loop().create_task(self._send_outboxes())
        # An attempt's reply subject is <inbox>.<batch token>.<index>: NATS' "no responders"
        # for a whole batch (sent with reply subject <inbox>.<batch token>) finds its attempts.
        token = f"{box.token}.{len(box.items)}"
        box.items.append((token, body, headers))
        box.size += len(body)
        flight.token = token
        self._flights[token] = flight
        heapq.heappush(self._deadlines, (flight.deadline, token))
        view.outstanding += 1

    async def _send_outboxes(self) -> None:
        """Send the attempts this pass of the event loop decided."""
        self._sender = None
        boxes = self._full
        boxes.extend(self._outboxes.values())
        self._full = []
        self._outboxes = {}
        for box in boxes:
            await self._send(box)

    async def _send(self, box: _Outbox) -> None:
        view = box.view
        prefix = self._reply_prefix
        flights = self._flights
        # An attempt whose deadline passed before the pass ended has been answered already.
        items = [item for item in box.items if item[0] in flights]
        try:
            if len(items) > 1 and view.record.card.batch:
                # A batch line carries one traceparent; richer trace context goes on its own.
                lines = [
                    protocol.batch_line(prefix + token, headers[TRACEPARENT], body)
                    for token, body, headers in items
                    if len(headers) == 1
                ]
                if len(lines) > 1:
                    items = [item for item in items if len(item[2]) != 1]
                    await self.nc.publish(
                        protocol.agent_batch(view.agent_id),
                        b"\n".join(lines),
                        reply=prefix + box.token,
                    )
            subject = view.record.task_subject
            for token, body, headers in items:
                await self.nc.publish(subject, body, reply=prefix + token, headers=headers)
        except Exception as err:  # the connection is closing or gone
            unavailable = MeshUnavailableError(f"cannot reach NATS: {type(err).__name__}")
            for token, _, _ in box.items:
                flight = flights.pop(token, None)
                if flight is not None:
                    view.outstanding -= 1
                    self._end_deliver(flight, unavailable)
                    await self._finish(flight, error=unavailable)

    async def _on_agent_reply(self, msg: Msg) -> None:
        """Answers on this hub's reply subjects: an attempt's reply, a batch of replies, or
        NATS saying nobody listens on an agent's subject (status 503, no data)."""
        token = msg.subject[self._reply_prefix_len :]
        data = msg.data
        headers = msg.headers
        no_responders = not data and headers is not None and headers.get("Status") == "503"
        if "." in token:  # one attempt's own reply subject
            flight = self._flights.pop(token, None)
            if flight is None:
                self.metrics.late_reply_total.inc()  # that attempt timed out already
            elif no_responders:
                await self._unreachable(flight)
            else:
                await self._answered(flight, data)
            return
        if no_responders:  # a whole batch found nobody
            for i in range(BATCH_ITEMS):
                flight = self._flights.pop(f"{token}.{i}", None)
                if flight is not None:
                    await self._unreachable(flight)
            return
        # A batch of replies: one line each, "<reply subject> <TaskReply JSON>".
        for attempt_token, body in protocol.split_answers(data, self._reply_prefix_b):
            flight = self._flights.pop(attempt_token, None)
            if flight is None:
                self.metrics.late_reply_total.inc()
            else:
                await self._answered(flight, body)
        await asyncio.sleep(0)  # these answers leave before the next batch of replies is read

    async def _unreachable(self, flight: _Flight) -> None:
        view = flight.view
        assert view is not None
        view.outstanding -= 1
        self._failed(view, delivery=True)
        err = UnknownAgentError(
            f"agent {view.agent_id} has no subscriber on {view.record.task_subject}",
            agent_id=view.agent_id,
        )
        await self._refused(flight, err)

    async def _refused(
        self, flight: _Flight, err: AgentBusyError | NoHandlerError | UnknownAgentError
    ) -> None:
        """Refused before ACCEPTED: safe to try another agent."""
        view = flight.view
        assert view is not None
        self._end_deliver(flight, err)
        flight.last_error = err
        flight.exclude.add(view.agent_id)
        if flight.attempt >= self.settings.route_attempts or flight.req.agent_id is not None:
            await self._finish(flight, error=err)
        else:
            self.metrics.retry_total.inc()
            await self._attempt(flight)

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
            log.warning("session %s: KV put failed: %r", flight.req.session_id, err)
        await self._finish(flight, task=data, head=head)

    def _read_reply(self, view: AgentView, flight: _Flight, data: bytes) -> _ReplyHead:
        """Parse an agent's reply for what the hub acts on, and feed its health, breaker and
        metrics; raise the typed error an error body carries."""
        capability = flight.capability
        try:
            protocol.raise_for_error(data)
            head = _ReplyHead.model_validate_json(data)
            if head.agent_id != view.agent_id or head.task_id != flight.task_id:
                # Not the answer of the agent this attempt went to: nothing of it is used.
                self._rejected("reply", None, head.agent_id, expected=view.agent_id)
                raise IdentityMismatchError(
                    f"the reply to task {flight.task_id} sent to {view.agent_id} speaks for "
                    f"{head.agent_id!r}, task {head.task_id!r}",
                    agent_id=view.agent_id,
                )
        except AgentBusyError:
            view.health.overloaded()
            raise
        except ReachError:
            raise
        except Exception as err:
            self._failed(view, delivery=True)
            raise InternalError(f"agent {view.agent_id} sent a malformed reply: {err}") from err
        self._accepted_seconds.observe(head.queued_ms / 1000)
        cap = capability or "-"
        child = self._duration_children.get(cap)
        if child is None:
            if len(self._duration_children) >= CAPABILITY_SERIES:
                # Agents name capabilities and callers route them: a tenant minting new ones
                # must not grow /metrics (and its render on this loop) without bound.
                cap = OTHER_CAPABILITY
                child = self._duration_children.get(cap)
            if child is None:
                child = self.metrics.task_duration_seconds.labels(cap)
                self._duration_children[cap] = child
        child.observe(head.duration_ms / 1000)
        if head.cached:
            self.metrics.duplicate_delivery_total.inc()
        if head.state is TaskState.SUCCEEDED:
            view.health.success()
            view.breaker.record(True)
        elif head.state is TaskState.TIMEOUT or (
            head.state is TaskState.FAILED
            and is_agent_fault(head.error.code if head.error is not None else None)
        ):
            # The handler's own fault; a caller's bad payload (REACH_BAD_REQUEST) is not.
            view.breaker.record(False)
        self.registry.regrade(view)
        return head

    def _say_no_match(self, flight: _Flight, target: str | None) -> None:
        """``REACH-SELECT-EMPTY``, once per namespace and target every 10 s: a caller that
        keeps asking for what nobody serves must not fill the log (the audit has each one)."""
        held = self._no_match_lines.take((flight.ns, target))
        if held is None:
            return
        log_event(
            log,
            SELECT_EMPTY,
            "no routable agent",
            request_id=flight.request_id,
            trace_id=flight.trace_id,
            namespace=flight.ns,
            target=target,
            suppressed=held,
        )

    async def _sweep_deadlines(self) -> None:
        """Finish the attempts whose deadline passed without an answer (every few ms)."""
        heap = self._deadlines
        while True:
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
        view.health.accept_timeout()
        view.breaker.record(False)
        self.registry.regrade(view)
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
    ) -> None:
        """The one way a route ends: count it, audit it, close its span, answer the caller.
        Once per flight, and its slot is given back whatever happens on the way."""
        if flight.finished:
            return
        flight.finished = True
        try:
            body = self._conclude(flight, task, head, subject, alternates, error)
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
    ) -> bytes:
        """Count, audit and close the span of an ending route; its answer's bytes."""
        req, ns = flight.req, flight.ns
        view = flight.view
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
            assert view is not None
            if head is not None:
                state = head.state.value
            else:
                state = "EXPLAINED" if req.dry_run else "ROUTED"
            if known and not req.dry_run:  # an explanation is not a task
                self._count(ns, req.mode, state)
            event = {
                "request_id": flight.request_id,
                "trace_id": flight.trace_id,
                "task_id": head.task_id if head is not None else req.task_id,
                "agent_id": view.agent_id,
                "target": _clip(target),
                "state": state,
                "attempts": flight.attempt,
            }
            if head is not None and head.error is not None:  # the handler's FAILED, TIMEOUT
                event["error"] = head.error.code
                event["reason"] = _clip(head.error.message)
            body = _reply_bytes(
                flight.request_id,
                view.agent_id,
                subject=subject,
                batch_subject=_batch_subject(view) if subject is not None else None,
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
            log_event(
                log,
                ROUTE_LATENCY,
                "slow route",
                request_id=flight.request_id,
                trace_id=flight.trace_id,
                agent_id=view.agent_id if view is not None else None,
                elapsed_ms=round(elapsed * 1000, 2),
            )
        sp = flight.span
        if sp is not None:
            if view is not None:
                sp.set_attribute("reach.agent_id", view.agent_id)
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
        with contextlib.suppress(Exception):
            await self.nc.publish(reply, body)

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
