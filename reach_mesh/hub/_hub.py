"""The hub process: registry requests, routing, proxy delivery, admin queries.

Every hub instance joins one queue group on ``reach.hub.*.<verb>``, so any number of hubs share the
load and any of them can answer any request (they converge through the KV registry).
Message callbacks never block the subscription. A route is a *flight* finished by the callback that
gets the agent's reply (see the routing section); every other request runs in its own task. Both
are bounded per hub (``hub_concurrency``): when full, the subscription stops reading and NATS
buffers.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import heapq
import json
import logging
import os
import random
import time
import uuid
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Final

import nats.errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js import JetStreamContext
from opentelemetry.trace import Span, Status, StatusCode
from pydantic import BaseModel, ConfigDict
from pydantic_core import to_json

from reach_mesh import protocol
from reach_mesh._batch import BATCH_BYTES, BATCH_ITEMS, AnswerBatcher, reply_token
from reach_mesh._nats import connect
from reach_mesh._shutdown import within
from reach_mesh.config import MeshSettings, load_settings
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
from reach_mesh.hub.audit import AuditLog
from reach_mesh.hub.breaker import caller_report, is_agent_fault
from reach_mesh.hub.registry import AgentView, Registry
from reach_mesh.hub.router import Router
from reach_mesh.hub.sessions import SessionStore
from reach_mesh.hub.throttle import Throttle
from reach_mesh.hub.workflows import WorkflowEngine
from reach_mesh.logs import IDENTITY_REJECTED, QUARANTINE, ROUTE_LATENCY, SELECT_EMPTY, log_event
from reach_mesh.models import (
    AgentState,
    ErrorBody,
    FailureReport,
    Heartbeat,
    HeartbeatReply,
    RegisterReply,
    RegisterRequest,
    RouteDecision,
    RouteRequest,
    TaskState,
    UnregisterRequest,
)
from reach_mesh.tracing import (
    SPAN_DELIVER,
    SPAN_ROUTE,
    TRACEPARENT,
    TRACESTATE,
    SpanKind,
    inject,
    inject_span,
    open_span,
    trace_id_from_headers,
    tracing_enabled,
    tracing_from_env,
)
from reach_mesh.tracing.metrics import HubMetrics

__all__ = ["Hub", "HubState"]

log = logging.getLogger("reach_mesh.hub")

#: Bytes allowed on top of ``max_payload`` for the request's own fields.
_ENVELOPE_SLACK: Final = 16 * 1024
#: ``service.name`` of a hub's spans unless ``OTEL_SERVICE_NAME`` says otherwise (the CLI's
#: ``reach-mesh hub`` uses the same).
HUB_SERVICE_NAME: Final = "reach-mesh-hub"
_SLOW_ROUTE: Final = 0.25
#: How often unanswered proxy attempts are checked against their deadline (seconds).
_SWEEP_INTERVAL: Final = 0.005
ADMIN_OPS: Final = ("cordon", "uncordon", "quarantine", "release", "remove", "agents")
#: Report codes for operator quarantine / release, broadcast so every hub's breaker follows.
QUARANTINE_CODE: Final = "REACH_OPERATOR_QUARANTINE"
RELEASE_CODE: Final = "REACH_OPERATOR_RELEASE"
#: Other routable agents a direct-mode reply lists for the caller to cache and spread over.
DIRECT_ALTERNATES: Final = 3
#: The one throttle bucket shared by route requests to namespaces that do not exist (an agent
#: id in one may name an agent registered through another hub a moment ago).
_UNKNOWN_NS: Final = "*"
# Request ids only need to be unique, not secret: 64 random bits from a private generator
# (a uuid4 per request showed up in the hub profile). Reseeded in a forked child so that two
# hub processes forked from one parent never mint the same ids.
_ids = random.Random()
os.register_at_fork(after_in_child=_ids.seed)


def _new_id() -> str:
    return f"{_ids.getrandbits(64):016x}"


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


@dataclass(slots=True, eq=False)
class _Outbox:
    """Attempts for one agent decided in this pass of the event loop: (token, body, headers)."""

    view: AgentView
    token: str
    items: list[tuple[str, bytes, dict[str, str]]] = field(default_factory=list)
    size: int = 0


class HubState(enum.Enum):
    NEW = "new"
    RUNNING = "running"
    CLOSING = "closing"
    CLOSED = "closed"


Handler = Callable[[Msg, str], Awaitable[bytes | None]]


class Hub:
    """One hub instance. ``async with Hub(url) as hub:`` serves until the block exits."""

    def __init__(
        self,
        nats_url: str | None = None,
        *,
        settings: MeshSettings | None = None,
        hub_id: str | None = None,
    ) -> None:
        self.settings = settings or load_settings(nats_url=nats_url)
        self.nats_url = nats_url or self.settings.nats_url
        self.hub_id = hub_id or f"hub-{uuid.uuid4().hex[:8]}"
        self.state = HubState.NEW
        self._nc: NATS | None = None
        self._js: JetStreamContext | None = None
        self._subs: list[Subscription] = []
        self._inflight: set[asyncio.Task[None]] = set()
        self._sem = asyncio.Semaphore(self.settings.hub_concurrency)
        # Proxy attempts awaiting their agent's reply, by reply token; their deadlines in a
        # heap (entries of answered attempts are dropped lazily); routes not yet answered.
        self._flights: dict[str, _Flight] = {}
        self._deadlines: list[tuple[float, str]] = []
        self._routing = 0
        self._room = asyncio.Event()
        self._reply_prefix = ""
        self._reply_prefix_b = b""
        self._reply_prefix_len = 0
        # Attempts decided in this pass of the event loop, per agent, and batches already full;
        # one task sends them all when the pass ends.
        self._outboxes: dict[str, _Outbox] = {}
        self._full: list[_Outbox] = []
        # Answers to route requests that came in batches (made once connected).
        self._answers: AnswerBatcher
        self._sender: asyncio.Task[None] | None = None
        self._sweeper: asyncio.Task[None] | None = None
        s = self.settings
        self._route_throttle = Throttle(s.route_rate, s.route_burst)
        self._register_throttle = Throttle(s.register_rate, s.register_burst)
        self.metrics = HubMetrics()
        # Labelled metric children by label values: Counter.labels() costs a lock and a dict
        # build per call, on every request.
        self._task_counters: dict[tuple[str, str, str], Any] = {}
        self._duration_children: dict[str, Any] = {}
        self._route_seconds = self.metrics.route_duration_seconds
        self._accepted_seconds = self.metrics.delivered_to_accepted_seconds
        # Namespaces already validated (bounded: cleared when it grows past any real fleet).
        self._namespaces: set[str] = set()
        # Namespaces that exist without an agent: metrics and audit are kept only for these and
        # the registry's (bounded cardinality: what exists, not what callers type).
        self._configured = frozenset((s.namespace, *s.namespaces))
        self.registry: Registry
        self.router: Router
        self.sessions: SessionStore
        self.audit: AuditLog
        self.http: Any = None  # reach_mesh.hub.http.HubHttp when settings.http_port is set
        self.micro: Any = None  # the nats.micro Service ($SRV.PING/INFO/STATS), once started
        self.workflows: WorkflowEngine | None = None
        #: The dashboard's bounded state (samples, recent decisions, workflows): with HTTP only.
        self.dashboard: Dashboard | None = None

    # ------------------------------------------------------------------ lifecycle

    @property
    def nc(self) -> NATS:
        if self._nc is None:
            raise RuntimeError("hub is not started")
        return self._nc

    async def start(self) -> None:
        if self.state is not HubState.NEW:
            raise RuntimeError(f"hub cannot start from state {self.state.value}")
        self.state = HubState.RUNNING
        tracing_from_env(HUB_SERVICE_NAME)  # OTEL_TRACES_EXPORTER, if the process set none up
        try:
            self._nc = await connect(self.nats_url, name=self.hub_id, settings=self.settings)
            self._js = self._nc.jetstream(timeout=10.0)
            s = self.settings
            self.audit = AuditLog(
                self._nc,
                self._js,
                self.hub_id,
                max_age=s.audit_max_age,
                max_bytes=s.audit_max_bytes,
                replicas=s.kv_replicas,
                enabled=s.audit_enabled,
            )
            await self.audit.start()
            self.registry = Registry(self._js, self.settings)
            self.registry.on_state_change(self._on_state_change)
            await self.registry.start()
            self.sessions = SessionStore(self._js, ttl=s.sticky_ttl, replicas=s.kv_replicas)
            await self.sessions.start()
            self.router = Router(self.registry, self.settings, self.hub_id)
            await self._subscribe()
            # Durable workflows: after the registry and router, which the engine routes with.
            self.workflows = WorkflowEngine(
                self._nc, self._js, self.registry, self.router, s, self.hub_id, metrics=self.metrics
            )
            await self.workflows.start()
            if s.http_port is not None:
                self.dashboard = Dashboard(self)
                await self.dashboard.start()
                from reach_mesh.hub.http import HubHttp

                self.http = HubHttp(self)
                await self.http.start(s.http_host, s.http_port)
            from reach_mesh.hub._micro import start_micro

            self.micro = await start_micro(self)
        except BaseException:
            await self.close()
            raise
        log.info("hub %s serving on %s", self.hub_id, self.nats_url)

    async def _subscribe(self) -> None:
        q = protocol.HUB_QUEUE
        table: list[tuple[str, Handler]] = [
            # An agent's own verbs, on subjects naming it (NATS permissions bind them to it).
            (protocol.hub_agent_subject("*.*.*", "register"), self._on_register),
            (protocol.hub_agent_subject("*.*.*", "heartbeat"), self._on_heartbeat),
            (protocol.hub_agent_subject("*.*.*", "unregister"), self._on_unregister),
            (protocol.hub_subject("*", "agents"), self._on_agents),
            (protocol.hub_subject("*", "admin"), self._on_admin),
        ]
        for subject, handler in table:
            sub = await self.nc.subscribe(
                subject, queue=q, cb=self._dispatcher(handler), pending_msgs_limit=-1
            )
            self._subs.append(sub)
        self._answers = AnswerBatcher(self.nc)
        # Agents answer proxy attempts on this hub's own reply subjects.
        self._reply_prefix = self.nc.new_inbox() + "."
        self._reply_prefix_b = self._reply_prefix.encode()
        self._reply_prefix_len = len(self._reply_prefix)
        self._reply_sub = await self.nc.subscribe(
            self._reply_prefix + ">", cb=self._on_agent_reply, pending_msgs_limit=-1
        )
        self._sweeper = asyncio.create_task(self._sweep_deadlines())
        for verb, cb in (("route", self._on_route_msg), ("route_batch", self._on_route_batch)):
            self._subs.append(
                await self.nc.subscribe(
                    protocol.hub_subject("*", verb), queue=q, cb=cb, pending_msgs_limit=-1
                )
            )
        # Failure reports go to every hub (no queue group): each keeps its own breakers. An
        # operator's quarantine / release comes from a hub, on a subject only hubs publish to.
        self._subs.append(
            await self.nc.subscribe(protocol.hub_subject("*", "report"), cb=self._on_report)
        )
        self._subs.append(
            await self.nc.subscribe(protocol.hub_broadcast("*", "breaker"), cb=self._on_breaker)
        )
        await self.nc.flush()

    @property
    def routing(self) -> int:
        """Route requests taken and not answered yet."""
        return self._routing

    @property
    def http_url(self) -> str | None:
        """Base URL of this hub's HTTP endpoints (metrics, REST, dashboard), if enabled."""
        return None if self.http is None else str(self.http.url)

    async def close(self) -> None:
        """Stop taking requests, finish in-flight ones, drain the connection. Idempotent."""
        if self.state in (HubState.CLOSING, HubState.CLOSED):
            return
        self.state = HubState.CLOSING
        if self.micro is not None:
            await within("micro service stop", self.micro.stop(), 2.0, log)
        for sub in self._subs:
            await within("unsubscribe", sub.unsubscribe(), 2.0, log)
        self._subs = []
        if self.http is not None:
            await within("HTTP server close", self.http.close(), 5.0, log)
        if self.dashboard is not None:
            await within("dashboard close", self.dashboard.close(), 2.0, log)
        if self.workflows is not None:
            # Hand running workflows back (nak) so another hub resumes them at once.
            await within("workflow engine stop", self.workflows.stop(), 10.0, log)
        # Routes in flight get their answers (or their deadline) for up to 5 s.
        for _ in range(500):
            if not self._inflight and self._routing <= 0:
                break
            await asyncio.sleep(0.01)
        for task in list(self._inflight):
            task.cancel()
        if self._sweeper is not None:
            self._sweeper.cancel()
            await within("route sweeper", self._sweeper, 2.0, log)
        if hasattr(self, "registry"):
            await within("registry stop", self.registry.stop(), 5.0, log)
        if hasattr(self, "audit"):
            # Buffered events go out before the drain.
            await within("audit flush", self.audit.close(), 5.0, log)
        if hasattr(self, "_answers"):
            await within("answer flush", self._answers.flush(), 5.0, log)
        if self._nc is not None:
            await within("NATS drain", self._nc.drain(), 5.0, log)
            await within("NATS close", self._nc.close(), 5.0, log)
        self.state = HubState.CLOSED

    async def __aenter__(self) -> Hub:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    # ------------------------------------------------------------------ dispatch

    def _dispatcher(self, handler: Handler) -> Callable[[Msg], Awaitable[None]]:
        async def on_msg(msg: Msg) -> None:
            await self._sem.acquire()  # full: stop reading, NATS buffers the rest
            task = asyncio.create_task(self._serve(msg, handler))
            self._inflight.add(task)
            task.add_done_callback(self._done)

        return on_msg

    def _done(self, task: asyncio.Task[None]) -> None:
        self._inflight.discard(task)
        self._sem.release()

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        """Run ``coro`` as a task the hub waits for when it closes."""
        task = asyncio.create_task(coro)
        self._inflight.add(task)
        task.add_done_callback(self._inflight.discard)

    def _namespace(self, subject: str) -> str:
        """The namespace token of ``reach.hub.<ns>.<verb>``, validated (and remembered, if it
        exists: callers' made-up namespaces must not grow this hub's memory)."""
        ns = subject.split(".", 3)[2]
        if ns not in self._namespaces:
            protocol.validate_namespace(ns)
            if self.known_namespace(ns):
                if len(self._namespaces) > 10_000:
                    self._namespaces.clear()
                self._namespaces.add(ns)
        return ns

    def known_namespace(self, ns: str) -> bool:
        """Whether ``ns`` exists: configured (``namespace``, ``namespaces``) or holding a
        registered agent. Only these get metric series and audit subjects."""
        return ns in self._configured or self.registry.has_namespace(ns)

    async def _serve(self, msg: Msg, handler: Handler) -> None:
        try:
            ns = self._namespace(msg.subject)
            body = await handler(msg, ns)
        except ReachError as err:
            body = protocol.encode_error(err)
        except nats.errors.Error as err:
            # JetStream briefly unavailable (e.g. a raft election after a node loss): retryable.
            log.warning("NATS/JetStream error on %s: %r", msg.subject, err)
            body = protocol.encode_error(
                MeshUnavailableError(f"JetStream unavailable, retry: {type(err).__name__}")
            )
        except Exception as err:  # the hub never crashes on input
            log.exception("internal error on %s", msg.subject)
            body = protocol.encode_error(InternalError(f"internal error: {type(err).__name__}"))
        if body is not None and msg.reply:
            with contextlib.suppress(Exception):
                await self.nc.publish(msg.reply, body)

    # ------------------------------------------------------------------ registry verbs

    async def _on_register(self, msg: Msg, ns: str) -> bytes:
        retry = self._register_throttle.check(ns)
        if retry > 0:
            if self.known_namespace(ns):
                self.metrics.throttled_total.labels(ns).inc()
            raise ThrottledError(
                f"namespace {ns!r} is registering too fast", retry_after_ms=int(retry * 1000) + 1
            )
        req = protocol.decode(msg.data, RegisterRequest, max_size=256 * 1024)
        self._check_identity(msg.subject, "register", req.card.agent_id)
        view = await self.registry.register(req, protocol.agent_task(req.card.agent_id))
        await self.audit.record(
            ns,
            "register",
            agent_id=view.agent_id,
            session=req.session,
            capabilities=req.card.capabilities,
            state=view.state.value,
        )
        return protocol.encode(
            RegisterReply(
                agent_id=view.agent_id,
                session=view.record.session,
                state=view.state,
                heartbeat_interval=view.record.heartbeat_interval,
                lease_timeout=view.record.lease_timeout,
                hub_id=self.hub_id,
            )
        )

    async def _on_heartbeat(self, msg: Msg, ns: str) -> bytes:
        hb = protocol.decode(msg.data, Heartbeat, max_size=64 * 1024)
        self._check_identity(msg.subject, "heartbeat", hb.agent_id)
        view = await self.registry.heartbeat(hb)
        self.metrics.heartbeat_total.inc()
        return protocol.encode(
            HeartbeatReply(state=view.state, lease_timeout=view.record.lease_timeout)
        )

    async def _on_unregister(self, msg: Msg, ns: str) -> bytes:
        req = protocol.decode(msg.data, UnregisterRequest, max_size=64 * 1024)
        self._check_identity(msg.subject, "unregister", req.agent_id)
        removed = await self.registry.unregister(req.agent_id, req.session)
        if removed:
            await self.audit.record(ns, "unregister", agent_id=req.agent_id, reason="graceful")
        return protocol.dumps({"agent_id": req.agent_id, "removed": removed})

    def _check_identity(self, subject: str, verb: str, claimed: str) -> None:
        """Refuse a message whose body speaks for another agent than its subject names: the
        subject is what NATS permissions bind to the sender (docs/security.md)."""
        sender = protocol.identity_of(subject)
        if sender == claimed:
            return
        self._rejected(verb, sender, claimed)
        raise IdentityMismatchError(
            f"{verb} on {subject} speaks for {claimed!r}: an agent may only {verb} itself "
            f"({sender!r})",
            subject_agent=sender,
            body_agent=claimed,
        )

    def _rejected(self, verb: str, sender: str | None, claimed: str, **fields: Any) -> None:
        self.metrics.identity_rejected_total.labels(verb).inc()
        log_event(
            log,
            IDENTITY_REJECTED,
            f"{verb} refused: sender and claimed identity differ",
            verb=verb,
            sender=sender,
            claimed=claimed,
            **fields,
        )

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
        while self._routing >= self.settings.hub_concurrency:
            # Full: stop reading this subscription (NATS buffers) until a flight ends.
            self._room.clear()
            await self._room.wait()
        try:
            ns = self._namespace(subject)
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
        self._routing += 1
        req = flight.req
        if req.session_id is not None or (
            req.agent_id is not None and req.agent_id not in self.registry.agents
        ):
            self._spawn(self._lookup_then_attempt(flight))
        else:
            await self._attempt(flight)

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
            log_event(
                log,
                SELECT_EMPTY,
                "no routable agent",
                request_id=flight.request_id,
                trace_id=flight.trace_id,
                target=req.agent_id or req.capability or req.selector,
            )
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
            child = self._duration_children[cap] = self.metrics.task_duration_seconds.labels(cap)
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
                    await self._expired(flight)
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
        """The one way a route ends: count it, audit it, close its span, answer the caller."""
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
                "target": target,
                "error": error.code,
                "reason": error.message,
            }
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
                "target": target,
                "state": state,
                "attempts": flight.attempt,
            }
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
        self._routing -= 1
        if self._routing < self.settings.hub_concurrency:
            self._room.set()
        await self._answer(flight.reply_to, body, flight.batch_reply)

    async def _answer(self, reply: str, body: bytes, batch_reply: str | None = None) -> None:
        """Send a route's answer: now, or — for a request that came in a batch — with the other
        answers to that batch's reply subject that are ready in this pass of the event loop."""
        if not reply:
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

    async def _on_report(self, msg: Msg) -> None:
        """A caller's (or another component's) word on an agent: feeds this hub's breaker,
        bounded per reporter; a caller's own errors are not the agent's fault."""
        try:
            report = protocol.decode(msg.data, FailureReport, max_size=64 * 1024)
        except ReachError:
            return  # publish-only subject: nobody to answer; never crash on it
        if report.code in (QUARANTINE_CODE, RELEASE_CODE):
            # Operator actions reach the breakers through hubs only (``_on_breaker``).
            self._rejected("report", None, report.agent_id, code=report.code)
            return
        view = self.registry.agents.get(report.agent_id)
        if view is None:
            return
        if not caller_report(view.breaker, view.health, report):
            return  # the reporter's budget is spent: nothing changed
        self.registry.regrade(view)

    async def _on_breaker(self, msg: Msg) -> None:
        """An operator's quarantine / release, broadcast by the hub that took the request."""
        try:
            report = protocol.decode(msg.data, FailureReport, max_size=64 * 1024)
        except ReachError:
            return
        view = self.registry.agents.get(report.agent_id)
        if view is None:
            return
        if report.code == QUARANTINE_CODE:
            view.breaker.trip()
        elif report.code == RELEASE_CODE:
            view.breaker.reset()
        else:
            return
        self.registry.regrade(view)

    def _on_state_change(self, view: AgentView, old: AgentState, new: AgentState) -> None:
        ns = view.record.card.namespace
        if new is AgentState.QUARANTINED:
            self.metrics.quarantine_total.inc()
            log_event(
                log,
                QUARANTINE,
                "circuit breaker open: agent quarantined",
                agent_id=view.agent_id,
                open_for_s=view.breaker.open_timeout,
            )
        if old is AgentState.LOST:
            # An agent appearing (registered here or through another hub) is told by its
            # ``register`` event; a LOST -> ONLINE state event would say it was lost before.
            return
        if self._nc is not None and not self._nc.is_closed:
            # Soon, not now: the change is a consequence of the action being handled (e.g. a
            # registration), whose own event should come first in the story.
            asyncio.get_running_loop().call_soon(
                self.audit.add,
                ns,
                "state",
                {"agent_id": view.agent_id, "old": old.value, "new": new.value},
            )

    # ------------------------------------------------------------------ queries & admin

    async def _on_agents(self, msg: Msg, ns: str) -> bytes:
        body = _json_object(msg.data)
        agent_id = body.get("agent_id")
        if agent_id is not None:
            agent_id = protocol.validate_agent_id(str(agent_id))
            if protocol.namespace_of(agent_id) != ns:
                raise BadRequestError(
                    f"agent {agent_id!r} is not in namespace {ns!r}: ask on "
                    f"{protocol.hub_subject(protocol.namespace_of(agent_id), 'agents')}",
                    field="agent_id",
                )
            view = self.registry.require(agent_id)
            return protocol.encode(view.info(self.registry.now))
        if body.get("all_namespaces"):
            raise BadRequestError(
                "the fleet of every namespace is an operator query: send "
                '{"op": "agents"} on reach.hub.<ns>.admin',
                field="all_namespaces",
            )
        return self._fleet(ns)

    def _fleet(self, namespace: str | None) -> bytes:
        infos = self.registry.infos(namespace)
        return protocol.dumps(
            {
                "hub_id": self.hub_id,
                "agents": [i.model_dump(mode="json", exclude_none=True) for i in infos],
            }
        )

    async def _on_admin(self, msg: Msg, ns: str) -> bytes:
        body = _json_object(msg.data)
        op = body.get("op")
        if op == "agents":
            return self._fleet(None)
        agent_id = protocol.validate_agent_id(str(body.get("agent_id", "")))
        if op in ("cordon", "uncordon"):
            view = await self.registry.set_cordon(agent_id, op == "cordon")
        elif op in ("quarantine", "release"):
            view = self.registry.require(agent_id)
            code = QUARANTINE_CODE if op == "quarantine" else RELEASE_CODE
            report = FailureReport(agent_id=agent_id, code=code)
            await self.nc.publish(protocol.hub_broadcast(ns, "breaker"), protocol.encode(report))
            await self.nc.flush()
            (view.breaker.trip if op == "quarantine" else view.breaker.reset)()
            self.registry.regrade(view)
        elif op == "remove":
            self.registry.require(agent_id)
            await self.registry.unregister(agent_id, None)
            await self.audit.record(ns, "admin", agent_id=agent_id, op=op)
            return protocol.dumps({"agent_id": agent_id, "op": op, "state": AgentState.LOST})
        else:
            raise BadRequestError(
                f"unknown admin op {op!r}: expected one of {', '.join(ADMIN_OPS)}", field="op"
            )
        await self.audit.record(ns, "admin", agent_id=agent_id, op=op)
        return protocol.dumps({"agent_id": agent_id, "op": op, "state": view.state})


def _forward_trace(headers: dict[str, str] | None) -> tuple[dict[str, str], str]:
    """The trace headers to send on (tracing off) and the trace id: the caller's
    ``traceparent``/``tracestate`` as received, or a new trace when it sent none valid."""
    if headers:
        trace_id = trace_id_from_headers(headers)
        if trace_id is not None:
            out = {TRACEPARENT: headers[TRACEPARENT]}
            state = headers.get(TRACESTATE)
            if state:
                out[TRACESTATE] = state
            return out, trace_id
    out = inject({})
    return out, out[TRACEPARENT][3:35]


def _envelope_bytes(
    task_id: str,
    attempt: int,
    capability: str | None,
    payload: Any,
    namespace: str,
    timeout: float,
) -> bytes:
    """A proxy-mode ``TaskEnvelope`` as JSON, written directly (pydantic's ``model_construct``
    plus ``model_dump_json`` cost several times more on every request). Ids, capability and
    namespace are validated protocol tokens: quoted without escaping; the payload goes through
    pydantic's JSON serialiser, as ``protocol.encode`` would."""
    parts = [b'{"task_id":"', task_id.encode(), b'","attempt":', str(attempt).encode()]
    if capability is not None:
        parts += (b',"capability":"', capability.encode(), b'"')
    if payload is not None:
        parts += (b',"payload":', to_json(payload))
    parts += (b',"namespace":"', namespace.encode(), b'","timeout":', repr(timeout).encode(), b"}")
    return b"".join(parts)


def _reply_bytes(
    request_id: str,
    agent_id: str,
    *,
    subject: str | None,
    batch_subject: str | None,
    task: bytes | None,
    decision: RouteDecision | None,
    alternates: list[AgentView] | None,
    attempts: int,
) -> bytes:
    """The ``RouteReply`` JSON, with the agent's ``TaskReply`` bytes spliced in unchanged.

    Ids and subjects are validated protocol tokens (``[a-z0-9_-]`` and dots), so they are
    written between quotes without escaping.
    """
    parts = [b'{"request_id":"', request_id.encode(), b'","agent_id":"', agent_id.encode()]
    if subject is not None:
        parts += (b'","subject":"', subject.encode())
    if batch_subject is not None:
        parts += (b'","batch_subject":"', batch_subject.encode())
    parts.append(b'"')
    if task is not None:
        parts += (b',"task":', task)
    if decision is not None:
        parts += (b',"decision":', decision.model_dump_json(exclude_none=True).encode())
    if alternates:
        refs = [_agent_ref(v) for v in alternates]
        parts += (b',"alternates":', protocol.dumps(refs))
    parts += (b',"attempts":', str(attempts).encode(), b"}")
    return b"".join(parts)


def _batch_subject(view: AgentView) -> str | None:
    return protocol.agent_batch(view.agent_id) if view.record.card.batch else None


def _agent_ref(view: AgentView) -> dict[str, str]:
    """An ``AgentRef`` for a direct-mode caller: where to send it tasks, alone or batched."""
    ref = {"agent_id": view.agent_id, "subject": view.record.task_subject}
    batch = _batch_subject(view)
    if batch is not None:
        ref["batch_subject"] = batch
    return ref


def _json_object(data: bytes) -> dict[str, Any]:
    if not data.strip():
        return {}
    try:
        body = json.loads(data)
    except ValueError as err:
        raise BadRequestError(f"malformed JSON: {err}") from err
    if not isinstance(body, dict):
        raise BadRequestError("expected a JSON object")
    return body
