"""Direct mode from the caller's side: :class:`DirectRoutes`, a base of
:class:`~reach_mesh.client.Client` that has a hub decide (or reuses a cached decision) and
calls the agent itself — one agent round trip per request on a steady stream."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import random
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError

from reach_mesh import protocol
from reach_mesh._batch import Batcher, NoRespondersOnResend
from reach_mesh._client_base import HubAsks
from reach_mesh._client_fields import _TASK_REPLY, _envelope, _parse, _RouteFields, _TaskReply
from reach_mesh.config import MeshSettings
from reach_mesh.errors import (
    NOBODY_TAKES_ITS_TASKS,
    AgentBusyError,
    InternalError,
    MeshTimeoutError,
    NoHandlerError,
    ReachError,
    UnknownAgentError,
)
from reach_mesh.models import RouteDecision, RouteReply, TaskState

__all__ = ["DirectRoutes"]

#: After reporting an agent failing, also report its successes for this long (direct mode), so
#: that the hubs' breakers see the half-open probe succeed.
_REPORT_SUCCESS_FOR = 60.0
#: Routing keys whose direct-mode decisions a client caches at most.
_ROUTE_CACHE = 1024

#: (namespace, agent_id, capability, selector, strategy, region, zone)
_CacheKey = tuple[str, str | None, str | None, str | None, str | None, str | None, str | None]


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


class DirectRoutes(HubAsks):
    """The direct-mode requests of ``Client`` (which sets every attribute below)."""

    settings: MeshSettings
    _batcher: Batcher | None
    #: Cached decisions per routing key (the newest ``_ROUTE_CACHE``).
    _routes: collections.OrderedDict[_CacheKey, _Route]
    #: This client's requests in flight per agent (to spread over a cached decision).
    _outstanding: dict[str, int]
    #: When this client last reported each agent failing.
    _failed_at: dict[str, float]

    if TYPE_CHECKING:
        #: ``Client``'s: raises once closed or from another event loop.
        _check_usable: Callable[[], None]
        #: ``Client``'s: a wire model's fields encoded, within the size limit.
        _encode: Callable[[Mapping[str, Any]], bytes]
        #: ``Client``'s: its batcher, started at the first call.
        _start_batcher: Callable[[], Awaitable[Batcher]]
        #: ``FleetMixin.report``: feeds the hubs' circuit breakers.
        report: Callable[..., Awaitable[None]]

    async def _direct(
        self,
        fields: _RouteFields,
        ns: str,
        headers: dict[str, str],
        deadline: float,
        after: int = 0,
        *,
        resend: bool = False,
    ) -> tuple[_TaskReply, str | None, RouteDecision | None]:
        """Direct mode: a hub decides (or a cached decision does); call the agent ourselves.

        Decisions are cached per routing key for ``direct_cache_ttl`` together with the hub's
        alternates, and requests spread over them by this client's own outstanding count, so a
        steady stream of requests costs one agent round trip each, not two. A session id or
        hash key asks for per-request routing: never cached. An agent that refuses
        (``REACH_AGENT_BUSY``, ``REACH_NO_HANDLER``) or is gone (no responders) is dropped from
        the cache and reported; the next cached agent is tried at once, and when none is left a
        hub is asked again after a backoff with jitter, until the deadline.

        ``resend``: the caller asked this task id before (``Client._route``): each request to
        a hub is marked ``Reach-Resend`` (not the envelopes: agents ignore it), and no cached
        decision is used or stored — only a hub knows who holds the task (its pins, or the
        seek a marked request makes: a holder declared LOST is waited for).
        """
        # Checked here and in ``_call_hub``: once per request either way (a proxy request
        # reaches only the latter; a direct one the latter only when its decision is not cached).
        self._check_usable()
        task_id = fields["task_id"]
        key = None if resend else self._cache_key(fields, ns)
        hub_headers = {**headers, protocol.HDR_RESEND: "1"} if resend else headers
        tried: set[str] = set()
        attempt = after
        delay = 0.02
        body: bytes | None = None
        request_id: str | None = None
        decision: RouteDecision | None = None
        last: ReachError | None = None
        #: The agent that may have the task in hand: asked again after this client's
        #: reconnection, nobody listened on its subject (its connection dropped too, say), which
        #: says nothing of the first send. Tried alone until the deadline, as a hub does.
        held: _Cached | None = None
        while True:
            target = held or (self._cached(key, tried) if key is not None else None)
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
                    # ``after_attempt`` tells the hub this retries a task that timed out on the
                    # agent it names: admitted whatever that hub's breaker says of it (the
                    # envelopes are numbered here all the same).
                    body = self._encode(fields if not after else {**fields, "after_attempt": after})
                left = deadline - time.monotonic()
                data = await self._call_hub(ns, "route", body, hub_headers, deadline, left + 5.0)
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
            left = deadline - time.monotonic()
            if left <= 0:
                # The decision came after the deadline (a slow hub, a stall of this loop): a
                # task sent now would have no time to run, and its agent would keep that
                # TIMEOUT as the task id's answer. Nothing was sent: the id is still fresh.
                raise MeshTimeoutError(
                    f"task {task_id} not delivered within its timeout: the route's decision "
                    "came after it; nothing was sent to an agent",
                    task_id=task_id,
                )
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
                if isinstance(err, NoRespondersError) and (
                    held is not None or isinstance(err, NoRespondersOnResend)
                ):
                    held = target
                    wait = delay * random.uniform(0.5, 1.5)
                    delay = min(delay * 2, 1.0)
                    if time.monotonic() + wait >= deadline:
                        raise MeshTimeoutError(
                            f"agent {agent} did not answer task {task_id}: asked again after "
                            "a reconnection, nobody listened on its subject (it may have the "
                            "task: retry with the same task_id)",
                            task_id=task_id,
                            agent_id=agent,
                            attempt=attempt,
                        ) from err
                    await asyncio.sleep(wait)
                    continue
                held = None  # (it answers: not ours to wait for any more)
                if (
                    isinstance(err, AgentBusyError)
                    and "agent_id" in fields
                    and err.details.get("cordoned")
                ):
                    raise  # the agent asked for refuses until uncordoned: no other may
                if isinstance(err, ReachError):
                    last, code = err, err.code
                else:
                    # What the caller knows (it has no registry view, only the hub's
                    # decision): a hub routed to the agent, so it is registered — not "no
                    # such agent" —, and the reasons nobody may be there, as a hub says them
                    # in proxy mode (``hub/_route_end.py``); its state now is the hubs'.
                    last = UnknownAgentError(
                        f"agent {agent} has no subscriber on {target.subject} (registered: a "
                        f"hub routed this call to it; {NOBODY_TAKES_ITS_TASKS}, or deaf — "
                        "heard from, yet listening to nothing: restart it; "
                        f"`reach-mesh inspect {agent}` shows its state)",
                        agent_id=agent,
                    )
                    last.__cause__ = err
                    code = last.code  # reported as no fault: it may be reconnecting
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
                    attempt=attempt,
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
