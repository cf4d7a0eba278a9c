"""The hub process: registry requests, routing, proxy delivery, admin queries.

Every hub instance joins one queue group on ``reach.hub.*.<verb>``, so any number of hubs share the
load and any of them can answer any request (they converge through the KV registry).
Message callbacks never block the subscription: each request runs in its own task, bounded by one
semaphore per hub (when it is full the subscription stops reading and NATS buffers).
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import json
import logging
import os
import random
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Final

import nats.errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js import JetStreamContext
from pydantic import BaseModel, ConfigDict
from pydantic_core import to_json

from reach_mesh import protocol
from reach_mesh._nats import connect
from reach_mesh.config import MeshSettings, load_settings
from reach_mesh.errors import (
    AgentBusyError,
    BadRequestError,
    InternalError,
    MeshTimeoutError,
    MeshUnavailableError,
    NoHandlerError,
    NoMatchError,
    ReachError,
    ThrottledError,
    UnknownAgentError,
)
from reach_mesh.hub.audit import AuditLog
from reach_mesh.hub.registry import AgentView, Registry
from reach_mesh.hub.router import Router
from reach_mesh.hub.sessions import SessionStore
from reach_mesh.hub.throttle import Throttle
from reach_mesh.hub.workflows import WorkflowEngine
from reach_mesh.logs import QUARANTINE, ROUTE_LATENCY, SELECT_EMPTY, log_event
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
    TaskEnvelope,
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
    span,
    trace_id_from_headers,
    tracing_enabled,
)
from reach_mesh.tracing.metrics import HubMetrics

__all__ = ["Hub", "HubState"]

log = logging.getLogger("reach_mesh.hub")

#: Bytes allowed on top of ``max_payload`` for the request's own fields.
_ENVELOPE_SLACK: Final = 16 * 1024
_SLOW_ROUTE: Final = 0.25
ADMIN_OPS: Final = ("cordon", "uncordon", "quarantine", "release", "remove")
#: Report codes for operator quarantine / release, broadcast so every hub's breaker follows.
QUARANTINE_CODE: Final = "REACH_OPERATOR_QUARANTINE"
RELEASE_CODE: Final = "REACH_OPERATOR_RELEASE"
#: Other routable agents a direct-mode reply lists for the caller to cache and spread over.
DIRECT_ALTERNATES: Final = 3
_BUSY_CODE: Final = AgentBusyError.code
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


@dataclass(slots=True)
class _Routed:
    """What ``_route`` found: encoded into a ``RouteReply`` by ``_reply_bytes``."""

    agent_id: str
    subject: str | None = None
    task: bytes | None = None
    head: _ReplyHead | None = None
    decision: RouteDecision | None = None
    attempts: int = 1
    alternates: list[AgentView] = field(default_factory=list)


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
        s = self.settings
        self._route_throttle = Throttle(s.route_rate, s.route_burst)
        self._register_throttle = Throttle(s.register_rate, s.register_burst)
        self.metrics = HubMetrics()
        # Labelled metric children by label values: Counter.labels() costs a lock and a dict
        # build per call, on every request.
        self._task_counters: dict[tuple[str, str, str], Any] = {}
        self._duration_children: dict[str, Any] = {}
        # Namespaces already validated (bounded: cleared when it grows past any real fleet).
        self._namespaces: set[str] = set()
        self.registry: Registry
        self.router: Router
        self.sessions: SessionStore
        self.audit: AuditLog
        self.http: Any = None  # reach_mesh.hub.http.HubHttp when settings.http_port is set
        self.workflows: WorkflowEngine | None = None

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
                from reach_mesh.hub.http import HubHttp

                self.http = HubHttp(self)
                await self.http.start(s.http_host, s.http_port)
        except BaseException:
            await self.close()
            raise
        log.info("hub %s serving on %s", self.hub_id, self.nats_url)

    async def _subscribe(self) -> None:
        q = protocol.HUB_QUEUE
        table: list[tuple[str, Handler, str | None]] = [
            ("register", self._on_register, q),
            ("heartbeat", self._on_heartbeat, q),
            ("unregister", self._on_unregister, q),
            ("route", self._on_route, q),
            ("agents", self._on_agents, q),
            ("admin", self._on_admin, q),
        ]
        for verb, handler, queue in table:
            subject = protocol.hub_subject("*", verb)
            sub = await self.nc.subscribe(
                subject, queue=queue or "", cb=self._dispatcher(handler), pending_msgs_limit=-1
            )
            self._subs.append(sub)
        # Failure reports go to every hub (no queue group): each keeps its own breakers.
        self._subs.append(
            await self.nc.subscribe(protocol.hub_subject("*", "report"), cb=self._on_report)
        )
        await self.nc.flush()

    @property
    def http_url(self) -> str | None:
        """Base URL of this hub's HTTP endpoints (metrics, REST, dashboard), if enabled."""
        return None if self.http is None else str(self.http.url)

    async def close(self) -> None:
        """Stop taking requests, finish in-flight ones, drain the connection. Idempotent."""
        if self.state in (HubState.CLOSING, HubState.CLOSED):
            return
        self.state = HubState.CLOSING
        for sub in self._subs:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        self._subs = []
        if self.http is not None:
            with contextlib.suppress(Exception):
                await self.http.close()
        if self.workflows is not None:
            # Hand running workflows back (nak) so another hub resumes them at once.
            with contextlib.suppress(Exception):
                await self.workflows.stop()
        if self._inflight:
            await asyncio.wait(self._inflight, timeout=5)
        for task in list(self._inflight):
            task.cancel()
        if hasattr(self, "registry"):
            await self.registry.stop()
        if hasattr(self, "audit"):
            with contextlib.suppress(Exception):
                await self.audit.close()  # buffered events go out before the drain
        if self._nc is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._nc.drain(), timeout=5)
            with contextlib.suppress(Exception):
                await self._nc.close()
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

    async def _serve(self, msg: Msg, handler: Handler) -> None:
        try:
            ns = msg.subject.split(".", 3)[2]
            if ns not in self._namespaces:
                protocol.validate_namespace(ns)
                if len(self._namespaces) > 10_000:
                    self._namespaces.clear()
                self._namespaces.add(ns)
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
            self.metrics.throttled_total.labels(ns).inc()
            raise ThrottledError(
                f"namespace {ns!r} is registering too fast", retry_after_ms=int(retry * 1000) + 1
            )
        req = protocol.decode(msg.data, RegisterRequest, max_size=256 * 1024)
        if req.card.namespace != ns:
            raise BadRequestError(
                f"agent {req.card.agent_id!r} belongs to namespace {req.card.namespace!r}, "
                f"not {ns!r}",
                field="card.agent_id",
            )
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
        if protocol.namespace_of(hb.agent_id) != ns:
            raise BadRequestError(f"agent {hb.agent_id!r} is not in namespace {ns!r}")
        view = await self.registry.heartbeat(hb)
        self.metrics.heartbeat_total.inc()
        return protocol.encode(
            HeartbeatReply(state=view.state, lease_timeout=view.record.lease_timeout)
        )

    async def _on_unregister(self, msg: Msg, ns: str) -> bytes:
        req = protocol.decode(msg.data, UnregisterRequest, max_size=64 * 1024)
        removed = await self.registry.unregister(req.agent_id, req.session)
        if removed:
            await self.audit.record(ns, "unregister", agent_id=req.agent_id, reason="graceful")
        return protocol.dumps({"agent_id": req.agent_id, "removed": removed})

    # ------------------------------------------------------------------ routing

    def _count(self, ns: str, mode: str, state: str) -> None:
        key = (ns, mode, state)
        child = self._task_counters.get(key)
        if child is None:
            child = self._task_counters[key] = self.metrics.task_total.labels(ns, mode, state)
        child.inc()

    async def _on_route(self, msg: Msg, ns: str) -> bytes:
        t0 = time.perf_counter()
        req = protocol.decode(
            msg.data, RouteRequest, max_size=self.settings.max_payload + _ENVELOPE_SLACK
        )
        retry = self._route_throttle.check(ns)
        if retry > 0:
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
        request_id = _new_id()
        if tracing_enabled():
            headers = dict(msg.headers or {})
            trace_id = trace_id_from_headers(headers)
            with span(
                SPAN_ROUTE, kind=SpanKind.SERVER, parent_headers=headers, destination=msg.subject
            ) as sp:
                # headers=None: _deliver injects the context of its own span.
                out = await self._route_counted(req, ns, request_id, trace_id, None)
                if sp.is_recording():
                    sp.set_attribute("reach.request_id", request_id)
                    sp.set_attribute("reach.agent_id", out.agent_id)
                    sp.set_attribute("reach.attempts", out.attempts)
        else:
            # Tracing off: nothing is recorded, so no span and no OTel context; the caller's
            # trace context is forwarded to the agent as the strings it came as.
            fwd, trace_id = _forward_trace(msg.headers)
            out = await self._route_counted(req, ns, request_id, trace_id, fwd)
        head = out.head
        state = head.state.value if head is not None else "ROUTED"
        self._count(ns, req.mode, state)
        self.audit.add(
            ns,
            "route",
            {
                "request_id": request_id,
                "trace_id": trace_id,
                "task_id": head.task_id if head is not None else req.task_id,
                "agent_id": out.agent_id,
                "target": req.agent_id or req.capability or req.selector,
                "state": state,
                "attempts": out.attempts,
            },
        )
        elapsed = time.perf_counter() - t0
        if elapsed > _SLOW_ROUTE:
            log_event(
                log,
                ROUTE_LATENCY,
                "slow route",
                request_id=request_id,
                agent_id=out.agent_id,
                elapsed_ms=round(elapsed * 1000, 2),
            )
        return _reply_bytes(request_id, out)

    async def _route_counted(
        self,
        req: RouteRequest,
        ns: str,
        request_id: str,
        trace_id: str | None,
        headers: dict[str, str] | None,
    ) -> _Routed:
        """``_route``, with a failure counted and audited."""
        try:
            return await self._route(req, ns, request_id, headers)
        except ReachError as err:
            self._count(ns, req.mode, err.code.removeprefix("REACH_"))
            self.audit.add(
                ns,
                "route",
                {
                    "request_id": request_id,
                    "trace_id": trace_id,
                    "task_id": req.task_id,
                    "target": req.agent_id or req.capability or req.selector,
                    "error": err.code,
                    "reason": err.message,
                },
            )
            raise

    async def _route(
        self, req: RouteRequest, ns: str, request_id: str, headers: dict[str, str] | None
    ) -> _Routed:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + req.timeout
        task_id = req.task_id or _new_id() + _new_id()
        exclude: set[str] = set()
        attempt = 0
        last_error: ReachError | None = None
        sticky = await self.sessions.get(ns, req.session_id) if req.session_id is not None else None
        # Alternates let a direct-mode caller cache the decision; a session or hash key asks
        # for per-request routing, so those get none.
        want_alternates = (
            DIRECT_ALTERNATES
            if req.mode == "direct" and req.session_id is None and req.hash_key is None
            else 0
        )
        while True:
            attempt += 1
            if req.agent_id is not None and req.agent_id not in self.registry.agents:
                # Registered a moment ago through another hub; our watch may lag by a message.
                await self.registry.fetch(req.agent_id)
            try:
                choice = self.router.decide(
                    req,
                    ns,
                    request_id,
                    exclude=frozenset(exclude),
                    sticky_agent=sticky,
                    alternates=want_alternates,
                )
            except NoMatchError as err:
                if last_error is not None and exclude:
                    raise last_error from err  # every candidate refused: say why
                log_event(
                    log,
                    SELECT_EMPTY,
                    "no routable agent",
                    request_id=request_id,
                    target=req.agent_id or req.capability or req.selector,
                )
                raise
            view = choice.view
            self.metrics.route_duration_seconds.observe(choice.elapsed_us / 1e6)
            decision = choice.decision
            if req.dry_run:
                return _Routed(view.agent_id, subject=view.record.task_subject, decision=decision)
            if req.mode == "direct":
                view.assigned(self.registry.now)
                return _Routed(
                    view.agent_id,
                    subject=view.record.task_subject,
                    decision=decision,
                    attempts=attempt,
                    alternates=choice.alternates,
                )
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise MeshTimeoutError(
                    f"task {task_id} not delivered within {req.timeout:g}s", task_id=task_id
                )
            # Built from values validated already (the RouteRequest, the router's choice):
            # no second validation on the hot path.
            envelope = TaskEnvelope.model_construct(
                task_id=task_id,
                attempt=attempt,
                capability=choice.capability,
                payload=req.payload,
                namespace=ns,
                timeout=remaining,
            )
            try:
                data, head = await self._deliver(view, envelope, remaining, headers)
            except (AgentBusyError, NoHandlerError, UnknownAgentError) as err:
                # Refused before ACCEPTED: safe to try another agent.
                last_error = err
                exclude.add(view.agent_id)
                if attempt >= self.settings.route_attempts or req.agent_id is not None:
                    raise
                self.metrics.retry_total.inc()
                continue
            if head.state is TaskState.SUCCEEDED and req.session_id is not None:
                await self.sessions.put(ns, req.session_id, view.agent_id)
            return _Routed(view.agent_id, task=data, head=head, decision=decision, attempts=attempt)

    async def _deliver(
        self,
        view: AgentView,
        envelope: TaskEnvelope,
        timeout: float,
        headers: dict[str, str] | None,
    ) -> tuple[bytes, _ReplyHead]:
        """Send one attempt to ``view`` and wait for its reply (proxy mode).

        ``headers``: the trace context to send; ``None`` (tracing on) opens a deliver span and
        sends its context. Returns the reply's bytes as the agent sent them and its parsed head.
        """
        subject = view.record.task_subject
        body = _envelope_bytes(envelope)
        view.outstanding += 1
        try:
            if headers is None:
                with span(SPAN_DELIVER, kind=SpanKind.CLIENT, destination=subject):
                    msg = await self._request(view, envelope, subject, body, timeout, inject({}))
            else:
                msg = await self._request(view, envelope, subject, body, timeout, headers)
        finally:
            view.outstanding -= 1
        data: bytes = msg.data
        try:
            protocol.raise_for_error(data)
            head = _ReplyHead.model_validate_json(data)
        except AgentBusyError:
            view.health.overloaded()
            raise
        except ReachError:
            raise
        except Exception as err:
            self._failed(view, delivery=True)
            raise InternalError(f"agent {view.agent_id} sent a malformed reply: {err}") from err
        m = self.metrics
        m.delivered_to_accepted_seconds.observe(head.queued_ms / 1000)
        cap = envelope.capability or "-"
        child = self._duration_children.get(cap)
        if child is None:
            child = self._duration_children[cap] = m.task_duration_seconds.labels(cap)
        child.observe(head.duration_ms / 1000)
        if head.cached:
            m.duplicate_delivery_total.inc()
        if head.state is TaskState.SUCCEEDED:
            view.health.success()
            view.breaker.record(True)
        elif head.state is TaskState.FAILED:
            view.breaker.record(False)
        self.registry.regrade(view)
        return data, head

    async def _request(
        self,
        view: AgentView,
        envelope: TaskEnvelope,
        subject: str,
        body: bytes,
        timeout: float,
        headers: dict[str, str],
    ) -> Msg:
        try:
            return await self.nc.request(subject, body, timeout=timeout, headers=headers)
        except NoRespondersError as err:
            self._failed(view, delivery=True)
            raise UnknownAgentError(
                f"agent {view.agent_id} has no subscriber on {subject}",
                agent_id=view.agent_id,
            ) from err
        except (TimeoutError, NatsTimeoutError) as err:
            view.health.accept_timeout()
            view.breaker.record(False)
            self.registry.regrade(view)
            raise MeshTimeoutError(
                f"agent {view.agent_id} did not answer task {envelope.task_id} "
                f"attempt {envelope.attempt} within {timeout:.3g}s",
                agent_id=view.agent_id,
                task_id=envelope.task_id,
                attempt=envelope.attempt,
            ) from err

    def _failed(self, view: AgentView, *, delivery: bool) -> None:
        if delivery:
            view.health.delivery_failure()
        view.breaker.record(False)
        self.registry.regrade(view)

    async def _on_report(self, msg: Msg) -> None:
        """A caller's (or another component's) word on an agent: feeds this hub's breaker."""
        try:
            report = protocol.decode(msg.data, FailureReport, max_size=64 * 1024)
        except ReachError:
            return  # publish-only subject: nobody to answer; never crash on it
        view = self.registry.agents.get(report.agent_id)
        if view is None:
            return
        if report.code == QUARANTINE_CODE:
            view.breaker.trip()
        elif report.code == RELEASE_CODE:
            view.breaker.reset()
        elif report.success:
            view.breaker.record(True)
            view.health.success()
        elif report.code == _BUSY_CODE:
            # Refused before accepting: overload, not a fault (as in proxy mode, no breaker).
            view.health.overloaded()
        else:
            view.breaker.record(False)
            if report.code in ("REACH_TIMEOUT",):
                view.health.accept_timeout()
            else:
                view.health.delivery_failure()
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
            view = self.registry.require(protocol.validate_agent_id(str(agent_id)))
            return protocol.encode(view.info(self.registry.now))
        namespace = None if body.get("all_namespaces") else ns
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
        agent_id = protocol.validate_agent_id(str(body.get("agent_id", "")))
        if op in ("cordon", "uncordon"):
            view = await self.registry.set_cordon(agent_id, op == "cordon")
        elif op in ("quarantine", "release"):
            view = self.registry.require(agent_id)
            code = QUARANTINE_CODE if op == "quarantine" else RELEASE_CODE
            report = FailureReport(agent_id=agent_id, code=code)
            await self.nc.publish(protocol.hub_subject(ns, "report"), protocol.encode(report))
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


def _envelope_bytes(env: TaskEnvelope) -> bytes:
    """A proxy-mode ``TaskEnvelope`` as JSON, written directly (pydantic's ``model_construct``
    plus ``model_dump_json`` cost several times more on every request). Ids, capability and
    namespace are validated protocol tokens: quoted without escaping; the payload goes through
    pydantic's JSON serialiser, as ``protocol.encode`` would."""
    parts = [b'{"task_id":"', env.task_id.encode(), b'","attempt":', str(env.attempt).encode()]
    if env.capability is not None:
        parts += (b',"capability":"', env.capability.encode(), b'"')
    if env.payload is not None:
        parts += (b',"payload":', to_json(env.payload))
    parts += (
        b',"namespace":"',
        env.namespace.encode(),
        b'","timeout":',
        repr(env.timeout).encode(),
    )
    parts.append(b"}")
    return b"".join(parts)


def _reply_bytes(request_id: str, out: _Routed) -> bytes:
    """The ``RouteReply`` JSON, with the agent's ``TaskReply`` bytes spliced in unchanged.

    Ids and subjects are validated protocol tokens (``[a-z0-9_-]`` and dots), so they are
    written between quotes without escaping.
    """
    parts = [b'{"request_id":"', request_id.encode(), b'","agent_id":"', out.agent_id.encode()]
    if out.subject is not None:
        parts += (b'","subject":"', out.subject.encode())
    parts.append(b'"')
    if out.task is not None:
        parts += (b',"task":', out.task)
    if out.decision is not None:
        parts += (b',"decision":', out.decision.model_dump_json(exclude_none=True).encode())
    if out.alternates:
        refs = [{"agent_id": v.agent_id, "subject": v.record.task_subject} for v in out.alternates]
        parts += (b',"alternates":', protocol.dumps(refs))
    parts += (b',"attempts":', str(out.attempts).encode(), b"}")
    return b"".join(parts)


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
