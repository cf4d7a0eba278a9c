"""The caller SDK: send a task to the right live agent and get an honest answer back."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import enum
import os
import random
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Final, Literal

import pydantic_core
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.errors import MaxPayloadError, NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError

from reach_mesh import protocol
from reach_mesh._batch import Batcher
from reach_mesh._cancels import uncancelled
from reach_mesh._client_direct import DirectRoutes, _CacheKey, _Route
from reach_mesh._client_fields import (
    _PROXY_REPLY,
    _end_span,
    _parse,
    _reply_slack,
    _route_fields,
    _RouteFields,
    _TaskReply,
)
from reach_mesh._client_fleet import FleetMixin
from reach_mesh._client_results import _Done
from reach_mesh._client_workflows import WorkflowsMixin
from reach_mesh._jspub import JsClient
from reach_mesh._nats import connect, not_permitted, refused_first, refused_since, shown
from reach_mesh._nats_asking import (
    Reconnected,
    Reconnects,
    ReconnectWatch,
    or_reconnected,
    reconnects_of,
)
from reach_mesh.config import MeshSettings, load_settings
from reach_mesh.errors import (
    AgentBusyError,
    BadRequestError,
    MeshTimeoutError,
    MeshUnavailableError,
    NoMatchError,
    PayloadTooLargeError,
    ReachError,
    ThrottledError,
    UnknownAgentError,
    error_from_wire,
)
from reach_mesh.logs import LineBudget, get_logger
from reach_mesh.models import (
    RouteDecision,
    RouteReply,
    RouteRequest,
    TaskState,
)
from reach_mesh.tracing import (
    SPAN_ROUTE,
    SpanKind,
    flush_tracing,
    inject,
    span,
    trace_id_from_headers,
    tracing_enabled,
    tracing_from_env,
)

__all__ = ["Client", "TaskResult"]


log = get_logger(__name__)

#: How often a client says that no hub answers, at most (seconds).
_NO_HUB_LOG_INTERVAL: Final = 30.0
#: Task ids whose agent a client remembers after a ``REACH_TIMEOUT`` (``Client._request``).
_PINS_KEPT: Final = 10_000


@dataclass(slots=True)
class TaskResult:
    """The final answer for one task."""

    state: TaskState
    task_id: str
    agent_id: str | None
    attempt: int
    result: Any = None
    error: ReachError | None = None
    #: Caller-side seconds from request to answer.
    duration: float = 0.0
    trace_id: str | None = None
    #: The hub's routing decision id (direct mode with a cached decision: the cached one's).
    request_id: str | None = None
    decision: RouteDecision | None = None
    cached: bool = False
    handler_ms: float = field(default=0.0)

    @property
    def ok(self) -> bool:
        return self.state is TaskState.SUCCEEDED

    def raise_for_error(self) -> TaskResult:
        if self.error is not None:
            raise self.error
        return self


class _State(enum.Enum):
    NEW = "new"
    OPEN = "open"
    CLOSED = "closed"


def _closed_while_waiting() -> MeshUnavailableError:
    return MeshUnavailableError(
        "the client was closed while waiting for this answer (the task may still run: ask "
        "again with its task_id from another client)"
    )


class Client(WorkflowsMixin, FleetMixin, DirectRoutes):
    """``async with Client(url) as mesh: await mesh.request(capability=..., payload=...)``.

    Back on NATS after losing it, the client asks again what waits for an answer, which may
    have been lost meanwhile (``_on_reconnect``, ``_call_hub``). Given a connection of the
    caller's own (``nc``), it does so too: one made by :func:`reach_mesh._nats.connect` tells
    it of its reconnections, another one (nats-py's ``connect``) is watched for them
    (``_nats_asking.ReconnectWatch``, within 0.1 s)."""

    def __init__(
        self,
        nats_url: str | None = None,
        *,
        namespace: str | None = None,
        settings: MeshSettings | None = None,
        name: str = "reach-client",
        nc: NATS | None = None,
    ) -> None:
        self.settings = settings or load_settings(nats_url=nats_url)
        self.nats_url = nats_url or self.settings.nats_url
        self.namespace = protocol.validate_namespace(namespace or self.settings.namespace)
        self._name = name
        self._nc = nc
        self._own_nc = nc is None
        self._batcher: Batcher | None = None
        #: Asking again after a reconnection (``_on_reconnect``), kept until done.
        self._resending: set[asyncio.Task[None]] = set()
        self._reconnects: Reconnects | None = None
        self._watch: ReconnectWatch | None = None
        self._state = _State.NEW
        #: The event loop it was connected on: its connection and waits belong to it.
        self._loop: asyncio.AbstractEventLoop | None = None
        # Direct mode: cached decisions per routing key, this client's requests in flight per
        # agent (to spread over a cached decision), and when we last reported an agent failing.
        self._routes: collections.OrderedDict[_CacheKey, _Route] = collections.OrderedDict()
        self._outstanding: dict[str, int] = {}
        self._failed_at: dict[str, float] = {}
        #: (namespace, task id) -> the agent a request of it timed out on, and the attempt (the
        #: newest ``_PINS_KEPT``): asked again, it goes there, in direct mode as its next
        #: attempt (``_request``).
        self._timed_out: collections.OrderedDict[tuple[str, str], tuple[str, int]] = (
            collections.OrderedDict()
        )
        #: (namespace, task id) -> how often :meth:`request` was asked it, for the task ids
        #: the caller chose (the newest ``_PINS_KEPT``): one asked again is sent marked
        #: ``Reach-Resend`` (``_route``), so that a hub that never heard the pin of its first
        #: send (lost in a partition) asks who has it before choosing.
        self._asked: collections.OrderedDict[tuple[str, str], int] = collections.OrderedDict()
        self._jsc: JsClient | None = None
        self._wf_stream_seen = False
        self._done_waits: dict[_Done, tuple[str, asyncio.Future[Msg]]] = {}
        self._rechecks: set[asyncio.Task[None]] = set()
        # Names this client in its failure reports: each reporter's reports count a bounded
        # number of times per agent and breaker window (the hub's rule, docs/security.md).
        self._reporter = os.urandom(8).hex()
        #: "No hub answered" lines: at most one per ``_NO_HUB_LOG_INTERVAL``.
        self._no_hub_lines = LineBudget(_NO_HUB_LOG_INTERVAL)

    @property
    def nc(self) -> NATS:
        """The client's NATS connection (see :meth:`_check_usable`)."""
        self._check_usable()
        if self._nc is None:
            raise RuntimeError("client is not connected: use `async with Client(...)`")
        return self._nc

    def _check_usable(self) -> None:
        """``MeshUnavailableError`` once the client is closed; ``RuntimeError`` when called
        from another event loop than the one it was connected on (a thread's
        ``asyncio.run``): nats-py's connection and the client's waits belong to that loop, and
        a call from another one waited out its timeout and left the client unable to hear
        any answer after it."""
        if self._state is _State.CLOSED:
            raise MeshUnavailableError(
                "this client is closed: its requests and waits ended with it (connect a new one)"
            )
        if self._loop is None:
            return
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            return  # not from a coroutine: nothing of the loop's is touched
        if running is not self._loop:
            raise RuntimeError(
                "this Client was connected on another event loop: use it from that loop only "
                "(asyncio.run_coroutine_threadsafe from other threads), or one Client per loop"
            )

    async def connect(self) -> Client:
        if self._state is not _State.NEW:
            raise RuntimeError("client already connected or closed")
        # OTEL_TRACES_EXPORTER honoured here too; service.name: OTEL_SERVICE_NAME, else ``name``.
        tracing_from_env(self._name)
        if self._nc is None:
            self._nc = await connect(
                self.nats_url, name=self._name, settings=self.settings, leave_cut_off=True
            )
        reconnects = reconnects_of(self._nc)
        if reconnects is None:  # a connection of the caller's own, not made by ``connect``
            self._watch = ReconnectWatch(self._nc)
            reconnects = self._watch.reconnects
        reconnects.listeners.append(self._on_reconnect)
        self._reconnects = reconnects
        self._loop = asyncio.get_running_loop()
        self._state = _State.OPEN
        return self

    def _on_reconnect(self) -> None:
        """Back on NATS after losing it: answers sent meanwhile are lost, so the requests that
        wait for one are asked again (``Batcher.resend``), and workflow waits check again."""
        self._recheck_done_waits()
        if self._batcher is not None:
            task = asyncio.get_running_loop().create_task(self._resend(self._batcher))
            self._resending.add(task)
            task.add_done_callback(self._resending.discard)

    @staticmethod
    async def _resend(batcher: Batcher) -> None:
        asked = await batcher.resend()
        if asked:
            log.info("reconnected to NATS: asked %d request(s) again, with their task ids", asked)

    async def _start_batcher(self) -> Batcher:
        if self._batcher is None:
            batcher = Batcher(self.nc)
            await batcher.start()
            if self._batcher is None:
                self._batcher = batcher
            else:  # another request started one meanwhile
                await batcher.stop()
        return self._batcher

    async def close(self) -> None:
        if self._state is _State.CLOSED:
            return
        self._state = _State.CLOSED
        reconnects = self._reconnects
        if reconnects is not None and self._on_reconnect in reconnects.listeners:
            reconnects.listeners.remove(self._on_reconnect)
        if self._watch is not None:
            self._watch.stop()
        self._end_done_waits()
        if self._batcher is not None:
            with contextlib.suppress(Exception):
                await self._batcher.stop(_closed_while_waiting)
        if self._jsc is not None:
            with contextlib.suppress(Exception):
                await self._jsc.stop()
        if self._nc is not None and self._own_nc:
            with contextlib.suppress(Exception):
                async with asyncio.timeout(5):
                    # nats-py's drain swallows a cancel (``except CancelledError: pass``),
                    # in this task now (``wait_for`` ran it in a task of its own): raised.
                    await uncancelled(self._nc.drain())
            with contextlib.suppress(Exception):
                await self._nc.close()
        with contextlib.suppress(Exception):
            await flush_tracing()

    async def __aenter__(self) -> Client:
        return await self.connect()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    # ------------------------------------------------------------------ requests

    async def request(
        self,
        *,
        agent_id: str | None = None,
        capability: str | None = None,
        selector: str | None = None,
        payload: Any = None,
        timeout: float | None = None,
        task_id: str | None = None,
        session_id: str | None = None,
        strategy: str | None = None,
        hash_key: str | None = None,
        region: str | None = None,
        zone: str | None = None,
        mode: Literal["proxy", "direct"] = "proxy",
        explain: bool = False,
        resend: bool = False,
    ) -> TaskResult:
        """Route one task and wait for its final state.

        Raises ``NoMatchError`` when no live agent can take it, ``MeshTimeoutError`` when no
        answer arrives in ``timeout``; retryable refusals (``ThrottledError``,
        ``AgentBusyError``, ``MeshUnavailableError``) are retried with backoff and jitter and
        raised only when the deadline leaves no room for another try; typed
        ``BadRequestError``\\ s for bad input. A handler failure is *returned*:
        ``TaskResult(state=FAILED, error=...)``.

        ``resend``: this ``task_id`` was asked before, by an earlier process of the caller
        say (one that restarted after a ``MeshTimeoutError``): the request to the hub is
        marked ``Reach-Resend`` (in direct mode too, and never answered from a cached
        decision), so a hub that never heard where the first send went asks who holds the
        task before it chooses (docs/protocol.md, "Resends"). This ``Client`` marks its own
        repeats of a task id without it.
        """
        if resend and not task_id:
            raise BadRequestError("resend needs the task_id asked before", field="resend")
        fields = _route_fields(
            agent_id=agent_id,
            capability=capability,
            selector=selector,
            payload=payload,
            task_id=task_id,
            timeout=self.settings.request_timeout if timeout is None else timeout,
            mode=mode,
            strategy=strategy,
            session_id=session_id,
            hash_key=hash_key,
            region=region,
            zone=zone,
            explain=explain,
        )
        ns = protocol.namespace_of(agent_id) if agent_id else self.namespace
        if task_id:
            self._count_asked((ns, task_id), 2 if resend else 1)
        if not tracing_enabled():
            return await self._request(fields, ns)
        # The caller's span: the root of the trace (or a child of the application's span),
        # parent of the hub's reach.route and, through it, of the agent's reach.handle.
        with span(
            SPAN_ROUTE,
            kind=SpanKind.CLIENT,
            destination=protocol.hub_subject(ns, "route"),
            attributes={"reach.namespace": ns, "reach.mode": mode},
        ) as sp:
            result = await self._request(fields, ns)
            _end_span(sp, result.state, result.error.code if result.error else None)
            sp.set_attribute("reach.task_id", result.task_id)
            sp.set_attribute("reach.agent_id", result.agent_id)
            if result.request_id is not None:
                sp.set_attribute("reach.request_id", result.request_id)
            return result

    def _count_asked(self, key: tuple[str, str], times: int = 1) -> None:
        """``times`` more :meth:`request`\\ s of a task id the caller chose (``_asked``)."""
        asked = self._asked
        asked[key] = asked.get(key, 0) + times
        asked.move_to_end(key)
        if len(asked) > _PINS_KEPT:
            asked.popitem(last=False)

    async def _request(self, fields: _RouteFields, ns: str) -> TaskResult:
        """:meth:`request` after its arguments are checked (inside its span, if traced).

        A task that timed out on an agent (``REACH_TIMEOUT`` naming it) and is asked again
        with the same ``task_id`` by capability goes to that agent, whose idempotency cache
        answers from the run it has: another agent would run it again. Whichever hub routes
        it (the hubs pin the ids they route too, and tell each other). When that agent is no longer
        routable, the task is routed as asked (it may then run twice). Either way, and asked
        by selector, it goes as the attempt after the one that timed out (``after_attempt``):
        a handler that ran out of time runs again."""
        key = (ns, fields["task_id"])
        pinned = self._timed_out.get(key) if self._timed_out else None
        after = 0  # the attempt this one comes after, on the agent it goes to
        if pinned is not None:
            agent, attempt = pinned
            if "selector" in fields:
                # A selector names no agent to pin (nor may it be given with one): the next
                # attempt, wherever the selector takes it — on the agent that timed out, its
                # stored TIMEOUT would answer attempt 1 again for as long as it kept it.
                after = attempt
            elif "agent_id" not in fields:
                try:
                    return await self._remembering(key, {**fields, "agent_id": agent}, ns, attempt)
                except (NoMatchError, UnknownAgentError):
                    self._timed_out.pop(key, None)
                except AgentBusyError as err:
                    # Cordoned, and without the task (restarted since, say): it refuses it
                    # as new for as long as the cordon holds. Routed as asked.
                    if not err.details.get("cordoned"):
                        raise
                    self._timed_out.pop(key, None)
            elif fields["agent_id"] == agent:
                after = attempt
        return await self._remembering(key, fields, ns, after)

    async def _remembering(
        self, key: tuple[str, str], fields: _RouteFields, ns: str, after: int
    ) -> TaskResult:
        """:meth:`_route`, remembering the agent and attempt a ``REACH_TIMEOUT`` names (a retry
        of a retry counts on from the newest)."""
        try:
            return await self._route(fields, ns, after=after)
        except MeshTimeoutError as err:
            named = err.details.get("agent_id")
            tried = err.details.get("attempt")
            if isinstance(named, str):
                self._timed_out[key] = (named, tried if isinstance(tried, int) else after + 1)
                self._timed_out.move_to_end(key)
                if len(self._timed_out) > _PINS_KEPT:
                    self._timed_out.popitem(last=False)
            raise

    async def _route(self, fields: _RouteFields, ns: str, *, after: int = 0) -> TaskResult:
        """One request as asked: through a hub (proxy), or decided by one (direct). Its first
        attempt is ``after + 1``, the next of a task that timed out on that agent (a later
        attempt of a timed-out task runs again, a copy of attempt 1 would get its TIMEOUT):
        numbered here in direct mode, by the hub (``after_attempt``) in proxy mode."""
        timeout = fields["timeout"]
        mode = fields["mode"]
        headers = inject({})
        trace_id = trace_id_from_headers(headers)
        t0 = time.perf_counter()
        deadline = time.monotonic() + timeout
        # Asked again by the caller (its answer lost, say): a hub without the pin of the first
        # send asks who has the task before choosing (docs/protocol.md, "Resends") — in direct
        # mode too, where only the hub's request carries the mark.
        resend = bool(self._asked) and self._asked.get((ns, fields["task_id"]), 0) > 1
        if mode == "direct":
            task, request_id, decision = await self._direct(
                fields, ns, headers, deadline, after, resend=resend
            )
            return self._result(task, request_id, decision, trace_id, t0)
        body = self._encode(fields if not after else {**fields, "after_attempt": after})
        if resend:
            headers[protocol.HDR_RESEND] = "1"
        reply = await self._call_hub(
            ns,
            "route",
            body,
            headers,
            deadline,
            timeout + _reply_slack(timeout),
            named="agent_id" in fields,
        )
        route = _parse(_PROXY_REPLY, reply, "RouteReply")
        return self._result(route["task"], route["request_id"], route.get("decision"), trace_id, t0)

    def _encode(self, fields: Mapping[str, Any]) -> bytes:
        """A wire model's fields as ``protocol.encode`` writes the model (NaN and infinities as
        ``null``); ``PayloadTooLargeError`` past the size limit, before anything is sent."""
        try:
            body = pydantic_core.to_json(fields, inf_nan_mode="null")
        except pydantic_core.PydanticSerializationError as err:
            raise BadRequestError(
                f"invalid payload: it cannot be written as JSON: {err}", field="payload"
            ) from err
        if len(body) > self.settings.max_payload + 16 * 1024:
            raise PayloadTooLargeError(
                f"request of {len(body)} bytes exceeds the maximum payload of "
                f"{self.settings.max_payload} bytes (max_payload, set alike on every hub and "
                "agent: pass large data by reference, a URL or an object-store key)",
                size=len(body),
                max_size=self.settings.max_payload,
            )
        return body

    def _result(
        self,
        task: _TaskReply,
        request_id: str | None,
        decision: RouteDecision | None,
        trace_id: str | None,
        t0: float,
    ) -> TaskResult:
        body = task.get("error")
        error = error_from_wire(body.model_dump()) if body is not None else None
        state = task["state"]
        if state is TaskState.TIMEOUT and error is not None:
            raise MeshTimeoutError(
                error.message,
                task_id=task["task_id"],
                agent_id=task["agent_id"],
                attempt=task["attempt"],
            )
        return TaskResult(
            state=state,
            task_id=task["task_id"],
            agent_id=task["agent_id"],
            attempt=task["attempt"],
            result=task.get("result"),
            error=error,
            duration=time.perf_counter() - t0,
            trace_id=trace_id,
            request_id=request_id,
            decision=decision,
            cached=task.get("cached", False),
            handler_ms=task.get("duration_ms", 0.0),
        )

    async def route(
        self,
        *,
        agent_id: str | None = None,
        capability: str | None = None,
        selector: str | None = None,
        strategy: str | None = None,
        session_id: str | None = None,
        hash_key: str | None = None,
        region: str | None = None,
        zone: str | None = None,
    ) -> RouteDecision:
        """Ask a hub which agent it would pick, and why, without sending anything."""
        req = RouteRequest(
            agent_id=agent_id,
            capability=capability,
            selector=selector,
            strategy=strategy,
            session_id=session_id,
            hash_key=hash_key,
            region=region,
            zone=zone,
            dry_run=True,
            explain=True,
        )
        ns = protocol.namespace_of(agent_id) if agent_id else self.namespace
        deadline = time.monotonic() + 10.0
        data = await self._call_hub(ns, "route", protocol.encode(req), inject({}), deadline, 5.0)
        route = protocol.validate_json(RouteReply.model_validate_json, data)
        assert route.decision is not None
        return route.decision

    def _say_no_hub(self, subject: str, deadline: float) -> None:
        """Say at once that no hub answers (the request goes on retrying until its deadline:
        a hub may be restarting), rather than only when the deadline is over."""
        if self._no_hub_lines.take() is None:
            return
        log.warning(
            "no hub answered on %s: is `reach-mesh hub` (or `reach-mesh up`) running on %s? "
            "Retrying for up to %.0f s",
            subject,
            shown(self.nats_url),
            max(0.0, deadline - time.monotonic()),
        )

    async def _call_hub(
        self,
        ns: str,
        verb: str,
        body: bytes,
        headers: dict[str, str],
        deadline: float,
        timeout: float,
        *,
        repeatable: bool = True,
        named: bool = False,
    ) -> bytes:
        """Request a hub; retry what is retryable until the deadline, then raise the last.

        Retryable: no hub answered (no responders), ``REACH_THROTTLED`` (after at least
        ``retry_after``), ``REACH_AGENT_BUSY`` (every candidate refused before accepting) and
        ``REACH_UNAVAILABLE`` (JetStream briefly down). Each wait is ``retry_after`` (throttled)
        or half the backoff (the rest), plus a random spread of up to the backoff, so that many
        callers retrying together do not stampede; the backoff doubles from 20 ms to 1 s. Past
        the deadline the last error is raised.

        Back on NATS while it waits, a request is asked again at once (its answer may have
        been sent while this client was away, and lost), unless it is not ``repeatable`` (an
        operator's ``remove``). Routes are asked again by the batcher (``Batcher.resend``).
        ``named``: a route naming its agent, whose refusal for a cordon is raised at once (it
        holds until an operator lifts it, and no other agent may take the route).
        """
        self._check_usable()
        subject = protocol.hub_subject(ns, verb)
        reconnects = self._reconnects
        delay = 0.02
        while True:
            asked_at = time.monotonic()
            back_at = reconnects.count if reconnects is not None else 0
            left = deadline - asked_at
            wait_s = min(timeout, max(left, 0.0) + _reply_slack(timeout))
            try:
                if verb == "route":
                    # Routes made in one pass of the event loop leave in one message.
                    batcher = self._batcher or await self._start_batcher()
                    data = await batcher.request(
                        subject, protocol.hub_subject(ns, "route_batch"), body, headers, wait_s
                    )
                else:
                    # A subject this identity may not publish fails at once, not at the timeout.
                    asked = self.nc.request(subject, body, timeout=wait_s, headers=headers)
                    if repeatable:
                        asked = or_reconnected(self.nc, asked, reconnects=reconnects)
                    data = (await refused_first(self.nc, subject, asked)).data
            except Reconnected as err:
                if time.monotonic() >= deadline:
                    raise MeshTimeoutError(f"no answer on {subject} in time") from err
                continue  # its answer may be lost: ask again at once, with the time left
            except NoRespondersError as err:
                last: ReachError = MeshUnavailableError(
                    f"no hub answered on {subject}: is `reach-mesh hub` running?"
                )
                last.__cause__ = err
                wait = delay / 2
                self._say_no_hub(subject, deadline)
            except MaxPayloadError as err:
                raise PayloadTooLargeError(
                    f"request exceeds the server's max payload: {err}"
                ) from err
            except (NatsTimeoutError, TimeoutError) as err:
                refused = refused_since(self.nc, asked_at, protocol.hub_subject(ns, ""))
                if refused is not None:
                    raise not_permitted(refused) from err
                if not repeatable and reconnects is not None and reconnects.count != back_at:
                    raise MeshTimeoutError(
                        f"no answer on {subject} within {timeout:g}s: NATS reconnected "
                        "meanwhile, so a hub may have done it and its answer been lost "
                        "(not asked again: it is not safe to repeat); check before asking again"
                    ) from err
                raise MeshTimeoutError(f"no answer on {subject} within {timeout:g}s") from err
            else:
                try:
                    protocol.raise_for_error(data)
                except ThrottledError as err:
                    last, wait = err, err.retry_after
                except MeshUnavailableError as err:
                    last, wait = err, delay / 2
                    if verb == "route" and protocol.HDR_RESEND not in headers:
                        # A hub that stopped ends the routes it holds so: their tasks may be
                        # in an agent's hands, and the next hub must look for it first.
                        headers = {**headers, protocol.HDR_RESEND: "1"}
                except AgentBusyError as err:
                    if named and err.details.get("cordoned"):
                        raise
                    last, wait = err, delay / 2
                else:
                    return data
            # At least ``wait``, plus a random spread of up to ``delay``.
            left = deadline - time.monotonic()
            if wait >= left:
                raise last
            await asyncio.sleep(min(wait + delay * random.random(), left))
            if time.monotonic() >= deadline:
                raise last  # no time left for one more: the caller has given up
            delay = min(delay * 2, 1.0)
