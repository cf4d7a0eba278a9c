"""The caller SDK: send a task to the right live agent and get an honest answer back."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import datetime
import enum
import json
import os
import random
import time
import uuid
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Final, Literal, NotRequired, TypeVar

import nats.js.errors
import pydantic_core
from nats.aio.client import Client as NATS
from nats.errors import MaxPayloadError, NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js.api import ConsumerConfig, DeliverPolicy
from opentelemetry.trace import Span, Status, StatusCode
from pydantic import TypeAdapter, ValidationError
from typing_extensions import TypedDict  # pydantic validates only this one on 3.11

from reach_mesh import protocol
from reach_mesh._batch import Batcher
from reach_mesh._nats import connect
from reach_mesh._retry import RetriesExhausted, retrying
from reach_mesh.config import MeshSettings, load_settings
from reach_mesh.errors import (
    AgentBusyError,
    BadRequestError,
    InternalError,
    MeshTimeoutError,
    MeshUnavailableError,
    NoHandlerError,
    PayloadTooLargeError,
    ReachError,
    ThrottledError,
    UnknownAgentError,
    WorkflowConflictError,
    WorkflowSpecError,
    error_from_wire,
)
from reach_mesh.models import (
    AgentInfo,
    ErrorBody,
    FailureReport,
    RouteDecision,
    RouteReply,
    RouteRequest,
    TaskState,
)
from reach_mesh.selector import Selector
from reach_mesh.tracing import (
    SPAN_ROUTE,
    SPAN_WORKFLOW,
    SpanKind,
    flush_tracing,
    inject,
    span,
    trace_id_from_headers,
    tracing_enabled,
    tracing_from_env,
)
from reach_mesh.workflow import (
    Step,
    WorkflowEvent,
    WorkflowRecord,
    WorkflowResult,
    WorkflowSpec,
    new_workflow_id,
    spec_digest,
    validate_spec,
)

__all__ = ["Client", "TaskResult"]


def _reply_slack(timeout: float) -> float:
    """Extra time the caller waits beyond the task timeout for the hub's own reply (the hub
    answers a timed-out attempt with a typed error at the timeout): 5 % of it, 0.2-2 s. A
    caller whose hub died gets its error soon after its own timeout."""
    return min(2.0, max(0.2, 0.05 * timeout))


#: How long a workflow submission rides out JetStream being unavailable (a leader election
#: takes 4-9 s) before it raises ``MeshUnavailableError``; a repeat is deduplicated.
_SUBMIT_RETRY: Final = 15.0
#: How long a duplicate submission waits for the first one's record, to compare the specs.
_CONFLICT_WAIT: Final = 2.0
#: After reporting an agent failing, also report its successes for this long (direct mode), so
#: that the hubs' breakers see the half-open probe succeed.
_REPORT_SUCCESS_FOR = 60.0
#: Routing keys whose direct-mode decisions a client caches at most.
_ROUTE_CACHE = 1024

#: (namespace, agent_id, capability, selector, strategy, region, zone)
_CacheKey = tuple[str, str | None, str | None, str | None, str | None, str | None, str | None]

_MODES: Final = ("proxy", "direct")


class _RouteFields(TypedDict):
    """A ``RouteRequest`` as the dict it is sent as: fields that are ``None`` are left out.

    ``request()`` checks its arguments itself (:func:`_route_fields`) and writes this dict
    straight to JSON: building and dumping the pydantic model for every request cost more than
    twice as much. ``tests/test_client_fastpath.py`` holds the two ways to the same JSON and
    the same errors.
    """

    agent_id: NotRequired[str]
    capability: NotRequired[str]
    selector: NotRequired[str]
    payload: NotRequired[Any]
    task_id: str
    timeout: float
    mode: Literal["proxy", "direct"]
    strategy: NotRequired[str]
    session_id: NotRequired[str]
    hash_key: NotRequired[str]
    region: NotRequired[str]
    zone: NotRequired[str]
    explain: bool
    dry_run: bool


class _TaskReply(TypedDict):
    """The fields of a ``TaskReply`` that make a ``TaskResult``.

    Replies are validated into these dicts rather than into the models: the same checks,
    without building two model instances per reply (a third of the parsing cost).
    """

    task_id: str
    attempt: int
    agent_id: str
    state: TaskState
    result: NotRequired[Any]
    error: NotRequired[ErrorBody | None]
    duration_ms: NotRequired[float]
    cached: NotRequired[bool]


class _ProxyReply(TypedDict):
    """The fields of a proxy-mode ``RouteReply`` the caller uses."""

    request_id: str
    task: _TaskReply
    decision: NotRequired[RouteDecision | None]


_T = TypeVar("_T")
_TASK_REPLY: Final = TypeAdapter(_TaskReply)
_PROXY_REPLY: Final = TypeAdapter(_ProxyReply)


@dataclass(slots=True)
class _Cached:
    """One agent of a cached direct-mode decision."""

    agent_id: str
    subject: str
    #: The hub decision it came from.
    request_id: str
    #: The agent's batch subject, if it takes task batches.
    batch_subject: str | None = None


@dataclass(slots=True)
class _Route:
    agents: list[_Cached]
    expires: float


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


class Client:
    """``async with Client(url) as mesh: await mesh.request(capability=..., payload=...)``."""

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
        self._state = _State.NEW
        # Direct mode: cached decisions per routing key, this client's requests in flight per
        # agent (to spread over a cached decision), and when we last reported an agent failing.
        self._routes: collections.OrderedDict[_CacheKey, _Route] = collections.OrderedDict()
        self._outstanding: dict[str, int] = {}
        self._failed_at: dict[str, float] = {}
        self._wf_kv: Any = None
        # Names this client in its failure reports: each reporter's reports count a bounded
        # number of times per agent and breaker window (the hub's rule, docs/security.md).
        self._reporter = os.urandom(8).hex()

    @property
    def nc(self) -> NATS:
        if self._nc is None:
            raise RuntimeError("client is not connected: use `async with Client(...)`")
        return self._nc

    async def connect(self) -> Client:
        if self._state is not _State.NEW:
            raise RuntimeError("client already connected or closed")
        # OTEL_TRACES_EXPORTER honoured here too; service.name: OTEL_SERVICE_NAME, else ``name``.
        tracing_from_env(self._name)
        if self._nc is None:
            self._nc = await connect(self.nats_url, name=self._name, settings=self.settings)
        self._state = _State.OPEN
        return self

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
        if self._batcher is not None:
            with contextlib.suppress(Exception):
                await self._batcher.stop()
        if self._nc is not None and self._own_nc:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._nc.drain(), timeout=5)
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
    ) -> TaskResult:
        """Route one task and wait for its final state.

        Raises ``NoMatchError`` when no live agent can take it, ``MeshTimeoutError`` when no
        answer arrives in ``timeout``; retryable refusals (``ThrottledError``,
        ``AgentBusyError``, ``MeshUnavailableError``) are retried with backoff and jitter and
        raised only when the deadline leaves no room for another try; typed
        ``BadRequestError``\\ s for bad input. A handler failure is *returned*:
        ``TaskResult(state=FAILED, error=...)``.
        """
        fields = _route_fields(
            agent_id=agent_id,
            capability=capability,
            selector=selector,
            payload=payload,
            task_id=task_id,
            timeout=timeout or self.settings.request_timeout,
            mode=mode,
            strategy=strategy,
            session_id=session_id,
            hash_key=hash_key,
            region=region,
            zone=zone,
            explain=explain,
        )
        ns = protocol.namespace_of(agent_id) if agent_id else self.namespace
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

    async def _request(self, fields: _RouteFields, ns: str) -> TaskResult:
        """:meth:`request` after its arguments are checked (inside its span, if traced)."""
        timeout = fields["timeout"]
        mode = fields["mode"]
        headers = inject({})
        trace_id = trace_id_from_headers(headers)
        t0 = time.perf_counter()
        deadline = time.monotonic() + timeout
        if mode == "direct":
            task, request_id, decision = await self._direct(fields, ns, headers, deadline)
            return self._result(task, request_id, decision, trace_id, t0)
        body = self._encode(fields)
        reply = await self._call_hub(
            ns, "route", body, headers, deadline, timeout + _reply_slack(timeout)
        )
        route = _parse(_PROXY_REPLY, reply, "RouteReply")
        return self._result(route["task"], route["request_id"], route.get("decision"), trace_id, t0)

    def _encode(self, fields: Mapping[str, Any]) -> bytes:
        """A wire model's fields as ``protocol.encode`` writes the model (NaN and infinities as
        ``null``); ``PayloadTooLargeError`` past the size limit, before anything is sent."""
        body = pydantic_core.to_json(fields, inf_nan_mode="null")
        if len(body) > self.settings.max_payload + 16 * 1024:
            raise PayloadTooLargeError(
                f"request of {len(body)} bytes exceeds the maximum payload of "
                f"{self.settings.max_payload} bytes",
                size=len(body),
                max_size=self.settings.max_payload,
            )
        return body

    async def _direct(
        self, fields: _RouteFields, ns: str, headers: dict[str, str], deadline: float
    ) -> tuple[_TaskReply, str | None, RouteDecision | None]:
        """Direct mode: a hub decides (or a cached decision does); call the agent ourselves.

        Decisions are cached per routing key for ``direct_cache_ttl`` together with the hub's
        alternates, and requests spread over them by this client's own outstanding count, so a
        steady stream of requests costs one agent round trip each, not two. A session id or
        hash key asks for per-request routing: never cached. An agent that refuses
        (``REACH_AGENT_BUSY``, ``REACH_NO_HANDLER``) or is gone (no responders) is dropped from
        the cache and reported; the next cached agent is tried at once, and when none is left a
        hub is asked again after a backoff with jitter, until the deadline.
        """
        task_id = fields["task_id"]
        key = self._cache_key(fields, ns)
        tried: set[str] = set()
        attempt = 0
        delay = 0.02
        body: bytes | None = None
        request_id: str | None = None
        decision: RouteDecision | None = None
        last: ReachError | None = None
        while True:
            target = self._cached(key, tried) if key is not None else None
            if target is None:
                if last is not None:
                    # Every agent we knew of refused: back off before asking a hub again.
                    wait = delay * random.uniform(0.5, 1.5)
                    if time.monotonic() + wait >= deadline:
                        raise last
                    await asyncio.sleep(wait)
                    delay = min(delay * 2, 1.0)
                    tried.clear()
                if body is None:
                    body = self._encode(fields)
                left = deadline - time.monotonic()
                data = await self._call_hub(ns, "route", body, headers, deadline, left + 5.0)
                route = protocol.decode(data, RouteReply)
                if route.agent_id is None or route.subject is None:
                    raise InternalError(f"hub reply to task {task_id} names no agent to call")
                decision = route.decision
                target = _Cached(
                    route.agent_id, route.subject, route.request_id, route.batch_subject
                )
                if key is not None and self.settings.direct_cache_ttl > 0:
                    self._store(key, route)
            request_id = target.request_id
            attempt += 1
            agent = target.agent_id
            left = max(deadline - time.monotonic(), 0.001)
            envelope = self._encode(_envelope(fields, attempt, ns, left))
            outstanding = self._outstanding
            outstanding[agent] = outstanding.get(agent, 0) + 1
            try:
                # Calls to one agent made in one pass of the event loop leave in one message.
                batcher = self._batcher or await self._start_batcher()
                data = await batcher.request(
                    target.subject, target.batch_subject, envelope, headers, left
                )
                protocol.raise_for_error(data)
                reply = _parse(_TASK_REPLY, data, "TaskReply")
            except (AgentBusyError, NoHandlerError, NoRespondersError) as err:
                if isinstance(err, ReachError):
                    last, code = err, err.code
                else:
                    last = UnknownAgentError(f"{agent} has no subscriber on {target.subject}")
                    last.__cause__ = err
                    code = MeshUnavailableError.code
                tried.add(agent)
                if key is not None:
                    self._drop(key, agent)
                await self._report_failure(agent, code, task_id)
                if time.monotonic() >= deadline:
                    raise last from err
                continue
            except (NatsTimeoutError, TimeoutError) as err:
                await self._report_failure(agent, MeshTimeoutError.code, task_id)
                raise MeshTimeoutError(
                    f"agent {agent} did not answer task {task_id}",
                    task_id=task_id,
                    agent_id=agent,
                ) from err
            finally:
                n = outstanding[agent] - 1
                if n:
                    outstanding[agent] = n
                else:
                    del outstanding[agent]
            # The hub did not see this call. Failures feed its breaker; a success is news only
            # for an agent we reported failing lately (it may be the breaker's half-open probe).
            if reply["state"] is TaskState.FAILED:
                error = reply.get("error")
                await self._report_failure(agent, error.code if error else None, task_id)
            elif self._failed_at:
                failed = self._failed_at.get(agent)
                if failed is not None and time.monotonic() - failed < _REPORT_SUCCESS_FOR:
                    await self.report(agent, success=True, task_id=task_id)
            return reply, request_id, decision

    def _cache_key(self, fields: _RouteFields, ns: str) -> _CacheKey | None:
        if (
            "session_id" in fields
            or "hash_key" in fields
            or fields["explain"]
            or self.settings.direct_cache_ttl <= 0
        ):
            return None
        return (
            ns,
            fields.get("agent_id"),
            fields.get("capability"),
            fields.get("selector"),
            fields.get("strategy"),
            fields.get("region"),
            fields.get("zone"),
        )

    def _cached(self, key: _CacheKey, tried: set[str]) -> _Cached | None:
        """The cached agent for ``key`` with the fewest of our requests outstanding."""
        entry = self._routes.get(key)
        if entry is None:
            return None
        if entry.expires <= time.monotonic():
            del self._routes[key]
            return None
        best: _Cached | None = None
        best_n = 0
        outstanding = self._outstanding
        for cand in entry.agents:  # best first: ties go to the hub's preference
            if cand.agent_id in tried:
                continue
            n = outstanding.get(cand.agent_id, 0)
            if best is None or n < best_n:
                best, best_n = cand, n
                if n == 0:
                    break
        return best

    def _store(self, key: _CacheKey, route: RouteReply) -> None:
        assert route.agent_id is not None and route.subject is not None
        agents = [_Cached(route.agent_id, route.subject, route.request_id, route.batch_subject)]
        agents += (
            _Cached(a.agent_id, a.subject, route.request_id, a.batch_subject)
            for a in route.alternates
        )
        self._routes[key] = _Route(agents, time.monotonic() + self.settings.direct_cache_ttl)
        self._routes.move_to_end(key)
        if len(self._routes) > _ROUTE_CACHE:
            self._routes.popitem(last=False)

    def _drop(self, key: _CacheKey, agent_id: str) -> None:
        entry = self._routes.get(key)
        if entry is not None:
            entry.agents = [a for a in entry.agents if a.agent_id != agent_id]
            if not entry.agents:
                del self._routes[key]

    async def _report_failure(self, agent_id: str, code: str | None, task_id: str) -> None:
        now = time.monotonic()
        self._failed_at[agent_id] = now
        if len(self._failed_at) > _ROUTE_CACHE:  # forget the stale ones
            self._failed_at = {
                a: t for a, t in self._failed_at.items() if now - t < _REPORT_SUCCESS_FOR
            }
        with contextlib.suppress(Exception):  # a report must never fail the call
            await self.report(agent_id, success=False, code=code, task_id=task_id)

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
                error.message, task_id=task["task_id"], agent_id=task["agent_id"]
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
        route = RouteReply.model_validate_json(data)
        assert route.decision is not None
        return route.decision

    async def _call_hub(
        self,
        ns: str,
        verb: str,
        body: bytes,
        headers: dict[str, str],
        deadline: float,
        timeout: float,
    ) -> bytes:
        """Request a hub; retry what is retryable until the deadline, then raise the last.

        Retryable: no hub answered (no responders), ``REACH_THROTTLED`` (after at least
        ``retry_after``), ``REACH_AGENT_BUSY`` (every candidate refused before accepting) and
        ``REACH_UNAVAILABLE`` (JetStream briefly down). Backoff doubles from 20 ms to 1 s, with
        jitter so that many callers retrying together do not stampede.
        """
        subject = protocol.hub_subject(ns, verb)
        delay = 0.02
        while True:
            left = deadline - time.monotonic()
            wait_s = min(timeout, max(left, 0.0) + _reply_slack(timeout))
            try:
                if verb == "route":
                    # Routes made in one pass of the event loop leave in one message.
                    batcher = self._batcher or await self._start_batcher()
                    data = await batcher.request(
                        subject, protocol.hub_subject(ns, "route_batch"), body, headers, wait_s
                    )
                else:
                    data = (
                        await self.nc.request(subject, body, timeout=wait_s, headers=headers)
                    ).data
            except NoRespondersError as err:
                last: ReachError = MeshUnavailableError(
                    f"no hub answered on {subject}: is `reach-mesh hub` running?"
                )
                last.__cause__ = err
                wait = delay
            except MaxPayloadError as err:
                raise PayloadTooLargeError(
                    f"request exceeds the server's max payload: {err}"
                ) from err
            except (NatsTimeoutError, TimeoutError) as err:
                raise MeshTimeoutError(f"no answer on {subject} within {timeout:g}s") from err
            else:
                try:
                    protocol.raise_for_error(data)
                except ThrottledError as err:
                    last, wait = err, err.retry_after
                except (AgentBusyError, MeshUnavailableError) as err:
                    last, wait = err, delay
                else:
                    return data
            if time.monotonic() + wait >= deadline:
                raise last
            await asyncio.sleep(wait * random.uniform(0.5, 1.5))
            delay = min(delay * 2, 1.0)

    # ------------------------------------------------------------------ workflows

    async def fanout(
        self,
        steps: Sequence[Step],
        *,
        policy: str = "all",
        timeout: float = 30.0,
        workflow_id: str | None = None,
    ) -> WorkflowResult:
        """Run ``steps`` in parallel, durably, and wait for the aggregated result.

        ``policy``: ``all`` (every branch; the first failure is reported as ``error``), ``any``
        (first success wins, the rest are cancelled) or ``quorum(k)``. Branches still
        unfinished at ``timeout`` end TIMEOUT. Malformed specs raise typed errors
        (``WorkflowSpecError``, ``SelectorError``, ...) before anything is sent; a workflow
        that fails is *returned* (``result.state``), not raised.
        """
        spec = self._workflow_spec("fanout", steps, policy, timeout, workflow_id)
        return await self._run_workflow(spec, timeout)

    async def chain(
        self, steps: Sequence[Step], *, timeout: float = 30.0, workflow_id: str | None = None
    ) -> WorkflowResult:
        """Run ``steps`` in order; each step's input is the previous output merged with its own
        payload (see :func:`reach_mesh.workflow.merge_payload`). ``result.result`` is the last
        step's output."""
        spec = self._workflow_spec("chain", steps, "all", timeout, workflow_id)
        return await self._run_workflow(spec, timeout)

    async def submit_fanout(
        self,
        steps: Sequence[Step],
        *,
        policy: str = "all",
        timeout: float | None = None,
        workflow_id: str | None = None,
    ) -> str:
        """Submit a fanout without waiting; returns the workflow id (re-submitting the same id
        is a no-op). ``timeout=None``: the steps' TTL (``task_ttl``) bounds it."""
        spec = self._workflow_spec("fanout", steps, policy, timeout, workflow_id)
        with self._workflow_span(spec):
            await self._submit(spec, inject({}))
        return spec.workflow_id

    async def submit_chain(
        self,
        steps: Sequence[Step],
        *,
        timeout: float | None = None,
        workflow_id: str | None = None,
    ) -> str:
        """Submit a chain without waiting; returns the workflow id."""
        spec = self._workflow_spec("chain", steps, "all", timeout, workflow_id)
        with self._workflow_span(spec):
            await self._submit(spec, inject({}))
        return spec.workflow_id

    async def workflow(self, workflow_id: str, *, timeout: float = 30.0) -> WorkflowResult:
        """Wait for (or fetch, if already finished) the result of a submitted workflow."""
        protocol.validate_workflow_id(workflow_id)
        sub = await self.nc.subscribe(protocol.wf_done(self.namespace, workflow_id), max_msgs=1)
        try:
            found = await self._stored_result(workflow_id)
            if found is not None:
                return found
            return await self._await_done(sub, workflow_id, timeout)
        finally:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()

    async def workflow_events(
        self, workflow_id: str, *, timeout: float | None = None
    ) -> AsyncIterator[WorkflowEvent]:
        """Every event of a workflow from its start (replayed from JetStream), ending with a
        ``kind="done"`` event that carries the ``WorkflowResult``."""
        protocol.validate_workflow_id(workflow_id)
        js = self.nc.jetstream()
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            sub = await js.subscribe(
                protocol.wf_all(self.namespace, workflow_id),
                ordered_consumer=True,
                deliver_policy=DeliverPolicy.ALL,
                stream=protocol.STREAM_WF_EVENTS,
                # Named: the filter then travels in the API subject, where NATS permissions
                # can hold a caller to its own namespace (docs/security.md).
                config=ConsumerConfig(name=_consumer_name()),
            )
        except nats.js.errors.Error as err:
            raise MeshUnavailableError(f"cannot read workflow events: {err}") from err
        try:
            while True:
                left = 3600.0 if deadline is None else deadline - time.monotonic()
                if left <= 0:
                    raise MeshTimeoutError(f"workflow {workflow_id} did not finish in time")
                try:
                    msg = await sub.next_msg(timeout=left)
                except (NatsTimeoutError, TimeoutError) as err:
                    if deadline is None:
                        continue
                    raise MeshTimeoutError(
                        f"workflow {workflow_id} did not finish in time"
                    ) from err
                if msg.subject.endswith(".done"):
                    result = WorkflowResult.model_validate_json(msg.data)
                    yield WorkflowEvent(
                        workflow_id=workflow_id, kind="done", state=result.state, result=result
                    )
                    return
                with contextlib.suppress(ValueError):
                    yield WorkflowEvent.model_validate_json(msg.data)
        finally:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()

    def _workflow_spec(
        self,
        kind: Literal["fanout", "chain"],
        steps: Sequence[Step],
        policy: str,
        timeout: float | None,
        workflow_id: str | None,
    ) -> WorkflowSpec:
        try:
            spec = WorkflowSpec(
                workflow_id=workflow_id or new_workflow_id(),
                kind=kind,
                steps=[s.spec() if isinstance(s, Step) else _bad_step(s) for s in steps],
                policy=policy,
                timeout=timeout,
                namespace=self.namespace,
            )
        except ValidationError as err:
            first = err.errors(include_url=False)[0]
            where = ".".join(str(p) for p in first["loc"]) or "workflow"
            raise WorkflowSpecError(
                f"invalid workflow: {where}: {first['msg']}", field=where
            ) from err
        validate_spec(spec)  # typed errors here, before anything is sent
        return spec

    def _workflow_span(self, spec: WorkflowSpec) -> AbstractContextManager[Span]:
        """The caller's ``reach.workflow`` span (CLIENT) around a submission (and its wait):
        parent of the owning hub's ``reach.workflow``. With tracing off it records nothing but
        still gives the workflow a trace of its own."""
        return span(
            SPAN_WORKFLOW,
            kind=SpanKind.CLIENT,
            destination=protocol.wf_submit(spec.namespace),
            attributes={
                "reach.namespace": spec.namespace,
                "reach.workflow_id": spec.workflow_id,
                "reach.workflow.kind": spec.kind,
                "reach.workflow.steps": len(spec.steps),
            },
        )

    async def _run_workflow(self, spec: WorkflowSpec, timeout: float) -> WorkflowResult:
        with self._workflow_span(spec) as sp:
            headers = inject({})
            # Subscribe to the result before submitting: no window in which it could be missed.
            sub = await self.nc.subscribe(
                protocol.wf_done(spec.namespace, spec.workflow_id), max_msgs=1
            )
            try:
                duplicate = await self._submit(spec, headers)
                result = None
                if duplicate:
                    result = await self._stored_result(spec.workflow_id)
                if result is None:
                    result = await self._await_done(
                        sub, spec.workflow_id, timeout + _reply_slack(timeout)
                    )
            finally:
                with contextlib.suppress(Exception):
                    await sub.unsubscribe()
            _end_span(sp, result.state, result.error.code if result.error else None)
            return result

    async def _submit(self, spec: WorkflowSpec, headers: dict[str, str]) -> bool:
        """Publish to ``reach.wf.<ns>.submit``; True when JetStream saw the id before.

        Infrastructure errors (no stream leader during an election, a reconnect) are retried
        for up to ``_SUBMIT_RETRY`` seconds: the ``Nats-Msg-Id`` makes a repeat a no-op. The same
        id with another spec raises ``WorkflowConflictError``."""
        body = protocol.encode(spec)
        headers[protocol.HDR_MSG_ID] = spec.workflow_id
        js = self.nc.jetstream()
        subject = protocol.wf_submit(spec.namespace)

        async def publish() -> Any:
            try:
                return await js.publish(subject, body, headers=headers, stream=protocol.STREAM_WF)
            except nats.js.errors.NoStreamResponseError:
                # No stream answered: none exists (no hub ever ran), or it has no leader now.
                if not await _stream_may_exist(js, protocol.STREAM_WF):
                    raise MeshUnavailableError(
                        "no workflow stream: is a hub (`reach-mesh hub`) running?"
                    ) from None
                raise

        budget = _SUBMIT_RETRY if spec.timeout is None else min(_SUBMIT_RETRY, spec.timeout)
        try:
            ack = await retrying(
                f"submit {spec.workflow_id}", publish, asyncio.get_running_loop().time() + budget
            )
        except RetriesExhausted as err:
            raise MeshUnavailableError(
                f"JetStream did not take workflow {spec.workflow_id} within {budget:g}s "
                f"({err.__cause__!r}): the cluster may be electing a leader or unreachable; "
                "submitting the same workflow id again is safe",
                workflow_id=spec.workflow_id,
            ) from err
        except MaxPayloadError as err:
            raise PayloadTooLargeError(f"workflow exceeds the max payload: {err}") from err
        await self._check_conflict(spec, duplicate=bool(ack.duplicate))
        return bool(ack.duplicate)

    async def _check_conflict(self, spec: WorkflowSpec, *, duplicate: bool) -> None:
        """Refuse a workflow id that a submission with another spec took first."""
        record = await self._workflow_record(spec.workflow_id)
        if record is None and duplicate:
            # Deduplicated by JetStream, not yet taken by a hub: wait a moment for its record.
            deadline = time.monotonic() + _CONFLICT_WAIT
            while record is None and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
                record = await self._workflow_record(spec.workflow_id)
        if record is None or record.spec_digest is None:
            return
        if record.spec_digest != spec_digest(spec):
            raise WorkflowConflictError(
                f"workflow id {spec.workflow_id!r} was submitted before with another spec; "
                "the first spec stands (submit the same spec again, or use a new id)",
                workflow_id=spec.workflow_id,
            )

    async def _workflow_record(self, workflow_id: str) -> WorkflowRecord | None:
        """The stored record of a workflow of this namespace; None when there is none (or it
        cannot be read right now)."""
        try:
            if self._wf_kv is None:
                self._wf_kv = await self.nc.jetstream().key_value(protocol.KV_WORKFLOWS)
            entry = await self._wf_kv.get(protocol.workflow_key(self.namespace, workflow_id))
        except (nats.js.errors.BucketNotFoundError, nats.js.errors.KeyNotFoundError):
            return None
        except (nats.errors.Error, TimeoutError):
            return None
        if not entry.value:
            return None
        try:
            return WorkflowRecord.model_validate_json(entry.value)
        except ValidationError:
            return None

    async def _stored_result(self, workflow_id: str) -> WorkflowResult | None:
        record = await self._workflow_record(workflow_id)
        if record is None or not record.state.final:
            return None
        return record.result

    async def _await_done(self, sub: Any, workflow_id: str, timeout: float) -> WorkflowResult:
        try:
            msg = await sub.next_msg(timeout=timeout)
        except (NatsTimeoutError, TimeoutError) as err:
            # The record is the source of truth: the result may be stored while its .done
            # announcement is still on the way (a hub died between the two).
            found = await self._stored_result(workflow_id)
            if found is not None:
                return found
            raise MeshTimeoutError(
                f"no result for workflow {workflow_id} within {timeout:g}s "
                "(it keeps running; `await mesh.workflow(id)` later)",
                workflow_id=workflow_id,
            ) from err
        return WorkflowResult.model_validate_json(msg.data)

    # ------------------------------------------------------------------ fleet queries

    async def agents(self, *, all_namespaces: bool = False) -> list[AgentInfo]:
        if all_namespaces:  # an operator query (docs/security.md)
            data = await self._query("admin", {"op": "agents"})
        else:
            data = await self._query("agents", {})
        return [AgentInfo.model_validate(a) for a in json.loads(data)["agents"]]

    async def inspect(self, agent_id: str) -> AgentInfo:
        protocol.validate_agent_id(agent_id)
        data = await self._query(
            "agents", {"agent_id": agent_id}, ns=protocol.namespace_of(agent_id)
        )
        return AgentInfo.model_validate_json(data)

    async def admin(self, op: str, agent_id: str) -> dict[str, Any]:
        protocol.validate_agent_id(agent_id)
        data = await self._query(
            "admin", {"op": op, "agent_id": agent_id}, ns=protocol.namespace_of(agent_id)
        )
        out: dict[str, Any] = json.loads(data)
        return out

    async def report(
        self,
        agent_id: str,
        *,
        success: bool,
        code: str | None = None,
        task_id: str | None = None,
    ) -> None:
        """Tell every hub how a call to ``agent_id`` went (feeds its circuit breaker).

        The SDK does this itself in direct mode; use it for calls made outside the mesh."""
        report = FailureReport(
            agent_id=agent_id,
            success=success,
            code=code,
            task_id=task_id,
            reporter=self._reporter,
        )
        await self.nc.publish(
            protocol.hub_subject(protocol.namespace_of(agent_id), "report"),
            protocol.encode(report),
        )

    async def audit(
        self,
        *,
        request_id: str | None = None,
        agent_id: str | None = None,
        trace_id: str | None = None,
        task_id: str | None = None,
        namespace: str | None = None,
        since: float = 3600.0,
        limit: int = 1000,
    ) -> list[dict[str, Any]]:
        """Audit events of the last ``since`` seconds matching every given filter, oldest
        first (at most ``limit``, the newest ones)."""
        js = self.nc.jetstream()
        start = datetime.datetime.now(datetime.UTC) - datetime.timedelta(seconds=since)
        subject = protocol.audit_subject(namespace or "*", "*")
        config = ConsumerConfig(
            name=_consumer_name(),
            deliver_policy=DeliverPolicy.BY_START_TIME,
            opt_start_time=start,
        )
        try:
            info = await js.stream_info(protocol.STREAM_AUDIT)
        except nats.js.errors.NotFoundError:
            return []
        if info.state.messages == 0:
            return []
        sub = await js.subscribe(
            subject, ordered_consumer=True, config=config, stream=protocol.STREAM_AUDIT
        )
        wanted = {
            "request_id": request_id,
            "agent_id": agent_id,
            "trace_id": trace_id,
            "task_id": task_id,
        }
        wanted = {k: v for k, v in wanted.items() if v is not None}
        events: collections.deque[dict[str, Any]] = collections.deque(maxlen=limit)
        try:
            while True:
                try:
                    msg = await sub.next_msg(timeout=1.0)
                except (NatsTimeoutError, TimeoutError):
                    break
                # A message holds a batch of events, one JSON object per line.
                for line in msg.data.splitlines():
                    try:
                        event = json.loads(line)
                    except ValueError:
                        continue
                    if not isinstance(event, dict):
                        continue
                    if all(event.get(k) == v for k, v in wanted.items()):
                        event["seq"] = msg.metadata.sequence.stream
                        events.append(event)
                if msg.metadata.num_pending == 0:
                    break
        finally:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        # Hubs publish events in batches per subject, so stream order is not event order:
        # order by the hub's timestamp (stable, so one batch keeps its own order).
        return sorted(events, key=lambda e: e.get("ts", 0.0))

    async def _query(self, verb: str, body: dict[str, Any], ns: str | None = None) -> bytes:
        deadline = time.monotonic() + 10.0
        return await self._call_hub(
            ns or self.namespace, verb, protocol.dumps(body), inject({}), deadline, 5.0
        )


def _consumer_name() -> str:
    """A name for an ordered consumer (ephemeral: the server removes it when unused)."""
    return f"reach-{uuid.uuid4().hex}"


def _end_span(sp: Span, state: TaskState, code: str | None) -> None:
    """Record a caller span's outcome: the final state, and ERROR unless it SUCCEEDED."""
    if not sp.is_recording():
        return
    sp.set_attribute("reach.state", state.value)
    if state is not TaskState.SUCCEEDED:
        sp.set_status(Status(StatusCode.ERROR, code or state.value))


def _bad_step(step: object) -> Any:
    raise WorkflowSpecError(f"expected reach_mesh.Step, got {type(step).__name__}")


def _route_fields(
    *,
    agent_id: str | None,
    capability: str | None,
    selector: str | None,
    payload: Any,
    task_id: str | None,
    timeout: float,
    mode: Literal["proxy", "direct"],
    strategy: str | None,
    session_id: str | None,
    hash_key: str | None,
    region: str | None,
    zone: str | None,
    explain: bool,
) -> _RouteFields:
    """Check a request's arguments as ``RouteRequest`` would and return its fields.

    Raises what the model's validators raise (``InvalidAgentIdError``,
    ``InvalidCapabilityError``, ``BadRequestError`` for a task id) and ``BadRequestError``
    naming the field for its other constraints, before anything is sent.
    """
    if agent_id is not None:
        protocol.validate_agent_id(agent_id)
    if capability is not None:
        protocol.validate_capability(capability)
    if selector is not None:
        _check_text("selector", selector, 0, 4096)
    if task_id:
        protocol.validate_task_id(task_id)
    else:
        task_id = os.urandom(16).hex()  # what uuid4().hex is, at a quarter of the cost
    if not isinstance(timeout, int | float) or not 0 < timeout <= 86400:  # NaN fails too
        raise BadRequestError(
            f"invalid timeout {timeout!r}: expected seconds in (0, 86400]",
            field="timeout",
            value=repr(timeout)[:100],
        )
    if mode not in _MODES:
        raise BadRequestError(
            f"invalid mode {mode!r}: expected 'proxy' or 'direct'",
            field="mode",
            value=repr(mode)[:100],
        )
    fields: _RouteFields = {
        "task_id": task_id,
        "timeout": float(timeout),
        "mode": mode,
        "explain": bool(explain),
        "dry_run": False,
    }
    if agent_id is not None:
        fields["agent_id"] = agent_id
    if capability is not None:
        fields["capability"] = capability
    if selector is not None:
        fields["selector"] = selector
    if payload is not None:
        fields["payload"] = payload
    if strategy is not None:
        fields["strategy"] = _check_text("strategy", strategy, 0, 32)
    if session_id is not None:
        fields["session_id"] = _check_text("session_id", session_id, 1, 256)
    if hash_key is not None:
        fields["hash_key"] = _check_text("hash_key", hash_key, 0, 1024)
    if region is not None:
        fields["region"] = _check_text("region", region, 0, 64)
    if zone is not None:
        fields["zone"] = _check_text("zone", zone, 0, 64)
    # agent_id may name the handler with capability; otherwise exactly one target.
    if (selector and (agent_id or capability)) or not (agent_id or capability or selector):
        given = [n for n in ("agent_id", "capability", "selector") if fields.get(n)]
        raise BadRequestError(
            "exactly one of agent_id, capability, selector is required"
            + (f" (got {', '.join(given)})" if given else ""),
            field="target",
        )
    return fields


def _check_text(name: str, value: object, min_len: int, max_len: int) -> str:
    if not isinstance(value, str) or not min_len <= len(value) <= max_len:
        raise BadRequestError(
            f"invalid {name} {repr(value)[:100]}: expected a string of "
            f"{min_len}-{max_len} characters",
            field=name,
            value=repr(value)[:100],
        )
    return value


def _envelope(fields: _RouteFields, attempt: int, ns: str, timeout: float) -> dict[str, Any]:
    """The ``TaskEnvelope`` of one attempt, as the dict it is sent as (``None`` left out).

    Its ``capability`` is the one a hub would send in proxy mode: the request's own, or the
    selector's :attr:`~reach_mesh.selector.Selector.task_capability` (its first ``cap=``), so a
    multi-handler agent picks the same handler in both modes."""
    envelope: dict[str, Any] = {"task_id": fields["task_id"], "attempt": attempt}
    capability = fields.get("capability")
    if capability is None and "selector" in fields:
        capability = Selector.parse(fields["selector"]).task_capability  # parses are cached
    if capability is not None:
        envelope["capability"] = capability
    if "payload" in fields:
        envelope["payload"] = fields["payload"]
    envelope["namespace"] = ns
    envelope["timeout"] = timeout
    envelope["track"] = False
    return envelope


def _parse(adapter: TypeAdapter[_T], data: bytes, what: str) -> _T:
    """Validate a reply that is not an error body; a malformed one raises ``BadRequestError``
    naming the field, as ``protocol.decode`` does."""
    try:
        return adapter.validate_json(data)
    except ValidationError as err:
        first = err.errors(include_url=False)[0]
        where = ".".join(str(p) for p in first["loc"]) or what
        raise BadRequestError(
            f"malformed {what}: {where}: {first['msg']}", field=where, type=first["type"]
        ) from err


async def _stream_may_exist(js: Any, stream: str) -> bool:
    """False only when JetStream says ``stream`` does not exist."""
    try:
        await js.stream_info(stream)
    except nats.js.errors.NotFoundError:
        return False
    except Exception:
        return True  # cannot tell now (no leader, timeout): treat as there
    return True
