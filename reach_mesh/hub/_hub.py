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
    NoHandlerError,
    NoMatchError,
    ReachError,
    ThrottledError,
    UnknownAgentError,
)
from reach_mesh.hub.registry import AgentView, Registry
from reach_mesh.hub.router import Router
from reach_mesh.hub.throttle import Throttle
from reach_mesh.logs import ROUTE_LATENCY, SELECT_EMPTY, log_event
from reach_mesh.models import (
    AgentState,
    ErrorBody,
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
from reach_mesh.tracing import SPAN_DELIVER, SPAN_ROUTE, SpanKind, inject, span

__all__ = ["Hub", "HubState"]

log = logging.getLogger("reach_mesh.hub")

#: Bytes allowed on top of ``max_payload`` for the request's own fields.
_ENVELOPE_SLACK: Final = 16 * 1024
_SLOW_ROUTE: Final = 0.25


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
        self.registry: Registry
        self.router: Router

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
            self.registry = Registry(self._js, self.settings)
            await self.registry.start()
            self.router = Router(self.registry, self.settings, self.hub_id)
            await self._subscribe()
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
        await self.nc.flush()

    async def close(self) -> None:
        """Stop taking requests, finish in-flight ones, drain the connection. Idempotent."""
        if self.state in (HubState.CLOSING, HubState.CLOSED):
            return
        self.state = HubState.CLOSING
        for sub in self._subs:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        self._subs = []
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
        except Exception as err:  # the hub never crashes on input
            log.exception("internal error on %s", msg.subject)
            body = protocol.encode_error(InternalError(f"internal error: {type(err).__name__}"))
        if body is not None and msg.reply:
            with contextlib.suppress(Exception):
                await self.nc.publish(msg.reply, body)

    def _check_size(self, msg: Msg) -> int:
        limit = self.settings.max_payload + _ENVELOPE_SLACK
        return limit

    # ------------------------------------------------------------------ registry verbs

    async def _on_register(self, msg: Msg, ns: str) -> bytes:
        retry = self._register_throttle.check(ns)
        if retry > 0:
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
        return protocol.encode(
            HeartbeatReply(state=view.state, lease_timeout=view.record.lease_timeout)
        )

    async def _on_unregister(self, msg: Msg, ns: str) -> bytes:
        req = protocol.decode(msg.data, UnregisterRequest, max_size=64 * 1024)
        removed = await self.registry.unregister(req.agent_id, req.session)
        return protocol.dumps({"agent_id": req.agent_id, "removed": removed})

    # ------------------------------------------------------------------ routing

    async def _on_route(self, msg: Msg, ns: str) -> bytes:
        t0 = time.perf_counter()
        req = protocol.decode(
            msg.data, RouteRequest, max_size=self.settings.max_payload + _ENVELOPE_SLACK
        )
        retry = self._route_throttle.check(ns)
        if retry > 0:
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
        with span(
            SPAN_ROUTE, kind=SpanKind.SERVER, parent_headers=headers, destination=msg.subject
        ) as sp:
            reply = await self._route(req, ns, request_id, t0)
            if sp.is_recording():
                sp.set_attribute("reach.request_id", request_id)
                sp.set_attribute("reach.agent_id", reply.agent_id or "")
                sp.set_attribute("reach.attempts", reply.attempts)
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

    async def _route(self, req: RouteRequest, ns: str, request_id: str, t0: float) -> RouteReply:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + req.timeout
        task_id = req.task_id or uuid.uuid4().hex
        exclude: set[str] = set()
        attempt = 0
        last_error: ReachError | None = None
        while True:
            attempt += 1
            if req.agent_id is not None and req.agent_id not in self.registry.agents:
                # Registered a moment ago through another hub; our watch may lag by a message.
                await self.registry.fetch(req.agent_id)
            try:
                choice = self.router.decide(req, ns, request_id, exclude=frozenset(exclude))
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
                continue
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
        elif op == "remove":
            self.registry.require(agent_id)
            await self.registry.unregister(agent_id, None)
            return protocol.dumps({"agent_id": agent_id, "op": op, "state": AgentState.LOST})
        else:
            raise BadRequestError(
                f"unknown admin op {op!r}: expected cordon, uncordon or remove", field="op"
            )
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
