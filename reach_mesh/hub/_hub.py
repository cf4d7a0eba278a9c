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
import time
import uuid
from collections.abc import Awaitable, Callable
from types import TracebackType
from typing import Any, Final

import nats.errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js import JetStreamContext

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
    RouteReply,
    RouteRequest,
    TaskEnvelope,
    TaskReply,
    TaskState,
    UnregisterRequest,
)
from reach_mesh.tracing import (
    SPAN_DELIVER,
    SPAN_ROUTE,
    SpanKind,
    inject,
    span,
    trace_id_from_headers,
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
        self._inflight_bg: set[asyncio.Future[None]] = set()
        self._sem = asyncio.Semaphore(self.settings.hub_concurrency)
        s = self.settings
        self._route_throttle = Throttle(s.route_rate, s.route_burst)
        self._register_throttle = Throttle(s.register_rate, s.register_burst)
        self.metrics = HubMetrics()
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
            self._nc = await connect(
                self.nats_url, name=self.hub_id, timeout=self.settings.connect_timeout
            )
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
            protocol.validate_namespace(ns)
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

    async def _on_route(self, msg: Msg, ns: str) -> bytes:
        t0 = time.perf_counter()
        req = protocol.decode(
            msg.data, RouteRequest, max_size=self.settings.max_payload + _ENVELOPE_SLACK
        )
        retry = self._route_throttle.check(ns)
        if retry > 0:
            self.metrics.throttled_total.labels(ns).inc()
            self.metrics.task_total.labels(ns, req.mode, "THROTTLED").inc()
            raise ThrottledError(
                f"namespace {ns!r} is over its route rate", retry_after_ms=int(retry * 1000) + 1
            )
        if req.agent_id is not None and protocol.namespace_of(req.agent_id) != ns:
            raise BadRequestError(
                f"agent {req.agent_id!r} is not in namespace {ns!r}: route on "
                f"reach.hub.{protocol.namespace_of(req.agent_id)}.route",
                field="agent_id",
            )
        request_id = uuid.uuid4().hex[:16]
        headers = dict(msg.headers or {})
        trace_id = trace_id_from_headers(headers)
        with span(
            SPAN_ROUTE, kind=SpanKind.SERVER, parent_headers=headers, destination=msg.subject
        ) as sp:
            try:
                reply = await self._route(req, ns, request_id)
            except ReachError as err:
                self.metrics.task_total.labels(ns, req.mode, err.code.removeprefix("REACH_")).inc()
                await self.audit.record(
                    ns,
                    "route",
                    request_id=request_id,
                    trace_id=trace_id,
                    task_id=req.task_id,
                    target=req.agent_id or req.capability or req.selector,
                    error=err.code,
                    reason=err.message,
                )
                raise
            if sp.is_recording():
                sp.set_attribute("reach.request_id", request_id)
                sp.set_attribute("reach.agent_id", reply.agent_id or "")
                sp.set_attribute("reach.attempts", reply.attempts)
        task = reply.task
        state = task.state.value if task is not None else "ROUTED"
        self.metrics.task_total.labels(ns, req.mode, state).inc()
        await self.audit.record(
            ns,
            "route",
            request_id=request_id,
            trace_id=trace_id,
            task_id=task.task_id if task else req.task_id,
            agent_id=reply.agent_id,
            target=req.agent_id or req.capability or req.selector,
            state=state,
            attempts=reply.attempts,
        )
        elapsed = time.perf_counter() - t0
        if elapsed > _SLOW_ROUTE:
            log_event(
                log,
                ROUTE_LATENCY,
                "slow route",
                request_id=request_id,
                agent_id=reply.agent_id,
                elapsed_ms=round(elapsed * 1000, 2),
            )
        return protocol.encode(reply)

    async def _route(self, req: RouteRequest, ns: str, request_id: str) -> RouteReply:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + req.timeout
        task_id = req.task_id or uuid.uuid4().hex
        exclude: set[str] = set()
        attempt = 0
        last_error: ReachError | None = None
        sticky = await self.sessions.get(ns, req.session_id) if req.session_id is not None else None
        while True:
            attempt += 1
            if req.agent_id is not None and req.agent_id not in self.registry.agents:
                # Registered a moment ago through another hub; our watch may lag by a message.
                await self.registry.fetch(req.agent_id)
            try:
                choice = self.router.decide(
                    req, ns, request_id, exclude=frozenset(exclude), sticky_agent=sticky
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
            assert view is not None
            self.metrics.route_duration_seconds.observe(choice.decision.elapsed_us / 1e6)
            decision = choice.decision if (req.explain or req.dry_run) else None
            if req.dry_run:
                return RouteReply(
                    request_id=request_id,
                    agent_id=view.agent_id,
                    subject=view.record.task_subject,
                    decision=decision,
                )
            if req.mode == "direct":
                view.assigned(self.registry.now)
                return RouteReply(
                    request_id=request_id,
                    agent_id=view.agent_id,
                    subject=view.record.task_subject,
                    decision=decision,
                    attempts=attempt,
                )
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise MeshTimeoutError(
                    f"task {task_id} not delivered within {req.timeout:g}s", task_id=task_id
                )
            envelope = TaskEnvelope(
                task_id=task_id,
                attempt=attempt,
                capability=choice.capability,
                payload=req.payload,
                namespace=ns,
                timeout=remaining,
            )
            try:
                task = await self._deliver(view, envelope, remaining)
            except (AgentBusyError, NoHandlerError, UnknownAgentError) as err:
                # Refused before ACCEPTED: safe to try another agent.
                last_error = err
                exclude.add(view.agent_id)
                if attempt >= self.settings.route_attempts or req.agent_id is not None:
                    raise
                self.metrics.retry_total.inc()
                continue
            if task.state is TaskState.SUCCEEDED and req.session_id is not None:
                await self.sessions.put(ns, req.session_id, view.agent_id)
            return RouteReply(
                request_id=request_id,
                agent_id=view.agent_id,
                task=task,
                decision=decision,
                attempts=attempt,
            )

    async def _deliver(self, view: AgentView, envelope: TaskEnvelope, timeout: float) -> TaskReply:
        """Send one attempt to ``view`` and wait for its reply (proxy mode)."""
        subject = view.record.task_subject
        view.outstanding += 1
        try:
            with span(SPAN_DELIVER, kind=SpanKind.CLIENT, destination=subject):
                headers = inject({})
                try:
                    msg = await self.nc.request(
                        subject, protocol.encode(envelope), timeout=timeout, headers=headers
                    )
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
        finally:
            view.outstanding -= 1
        try:
            reply = protocol.parse_reply(msg.data, TaskReply)
        except AgentBusyError:
            view.health.overloaded()
            raise
        except ReachError:
            raise
        except Exception as err:
            self._failed(view, delivery=True)
            raise InternalError(f"agent {view.agent_id} sent a malformed reply: {err}") from err
        m = self.metrics
        m.delivered_to_accepted_seconds.observe(reply.queued_ms / 1000)
        m.task_duration_seconds.labels(envelope.capability or "-").observe(reply.duration_ms / 1000)
        if reply.cached:
            m.duplicate_delivery_total.inc()
        if reply.state is TaskState.SUCCEEDED:
            view.health.success()
            view.breaker.record(True)
        elif reply.state is TaskState.FAILED:
            view.breaker.record(False)
        self.registry.regrade(view)
        return reply

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
            task = asyncio.ensure_future(
                self.audit.record(ns, "state", agent_id=view.agent_id, old=old.value, new=new.value)
            )
            self._inflight_bg.add(task)
            task.add_done_callback(self._inflight_bg.discard)

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


def _error_body(err: ReachError) -> ErrorBody:
    return ErrorBody(code=err.code, message=err.message, details=err.details)
