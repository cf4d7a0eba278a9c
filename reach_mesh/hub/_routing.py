"""Routing, the hub's hot path: :class:`RoutingMixin` (a base of
:class:`~reach_mesh.hub.Hub`) takes route requests, alone or batched, and carries each as a
flight from its decision to the attempts sent to agents (batched per agent); its base
:class:`~reach_mesh.hub._route_end.RouteEndMixin` ends it with the agent's reply or the
deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Final

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from reach_mesh import protocol
from reach_mesh._batch import BATCH_BYTES, BATCH_ITEMS, reply_token
from reach_mesh.errors import (
    BadRequestError,
    InternalError,
    MeshTimeoutError,
    MeshUnavailableError,
    NoMatchError,
    ReachError,
    ThrottledError,
)
from reach_mesh.hub._holders import (
    HOLDER_ASK_MOST,
    HOLDER_SEEKS_MOST,
    HOLDER_SEEKS_PER_NAMESPACE,
    RESEND_HEADER,
    HoldersMixin,
    resend_marked,
)
from reach_mesh.hub._pins import (
    HUB_HEADER,
    PINS_REPLAY,
    TaskPins,
    decode_pins,
    encode_pins,
)
from reach_mesh.hub._reply_boxes import ReplyBox, ReplyBoxes
from reach_mesh.hub._route_end import _LOCAL_REPLY, RouteEndMixin, _clip, _Flight, _ReplyHead
from reach_mesh.hub._wire import (
    _envelope_bytes,
    _forward_trace,
    _new_id,
)
from reach_mesh.hub.breaker import DEAF
from reach_mesh.hub.registry import AgentView
from reach_mesh.hub.router import Choice, Router
from reach_mesh.hub.throttle import Throttle
from reach_mesh.logs import SELECT_EMPTY, THROTTLED, LineBudget, log_event
from reach_mesh.models import RouteRequest, TaskReply
from reach_mesh.tracing import (
    SPAN_DELIVER,
    SPAN_ROUTE,
    TRACEPARENT,
    SpanKind,
    inject_span,
    open_span,
    tracing_enabled,
)
from reach_mesh.tracing.metrics import UNKNOWN_NAMESPACE, LoopHistogram

__all__ = ["RoutingMixin"]

log = logging.getLogger("reach_mesh.hub")

#: Bytes allowed on top of ``max_payload`` for the request's own fields.
_ENVELOPE_SLACK: Final = 16 * 1024
#: Other routable agents a direct-mode reply lists for the caller to cache and spread over.
DIRECT_ALTERNATES: Final = 3
#: The one throttle bucket shared by route requests to namespaces that do not exist (an agent
#: id in one may name an agent registered through another hub a moment ago).
_UNKNOWN_NS: Final = "*"
#: ``REACH-THROTTLED`` lines' key in the hub's line budget, beside the no-match lines'.
_THROTTLED_KEY: Final = "throttled"
#: Retry hint of a namespace over its fair share of a full hub: when one of its flights ends
#: is unknown, so a short one (the SDK adds its own growing backoff).
_FAIR_SHARE_RETRY_MS: Final = 100
#: A hub sends its pins again for hubs that started (``pins_ask``) once a second at most.
_PINS_REPLAY_EVERY: Final = 1.0
#: What a holder found deaf is asked on its ctl subject before its route is decided
#: (``RoutingMixin._ask_deaf_holder``), and how long it may take to answer (seconds).
_PING: Final = b'{"op":"ping"}'
_DEAF_ASK_TIMEOUT: Final = 1.0


@dataclass(slots=True, eq=False)
class _Outbox:
    """Attempts for one agent decided in this pass of the event loop: (token, body, headers)."""

    view: AgentView
    token: str
    #: The reply subjects of the agent's namespace (``hub/_reply_boxes.py``).
    replies: ReplyBox
    items: list[tuple[str, bytes, dict[str, str]]] = field(default_factory=list)
    size: int = 0


class RoutingMixin(HoldersMixin, RouteEndMixin):
    """The routing methods of ``Hub`` (which sets every attribute below, and its base's, in
    its ``__init__`` and ``start``)."""

    router: Router
    #: ``REACH-SELECT-EMPTY`` lines, one per (namespace, target) per 10 s.
    _no_match_lines: LineBudget
    _outage_lines: LineBudget
    _malformed_lines: LineBudget
    _replies: ReplyBoxes
    _outboxes: dict[str, _Outbox]
    _full: list[_Outbox]
    _sender: asyncio.Task[None] | None
    _route_throttle: Throttle
    _route_seconds: LoopHistogram
    _pins: TaskPins
    #: When this hub last sent its pins again (``_on_pins_ask``), monotonic.
    _pins_replayed_at: float
    hub_id: str
    _local_ids: itertools.count[int]

    if TYPE_CHECKING:

        def _namespace(self, subject: str) -> str: ...

    # ------------------------------------------------------------------ routing
    #
    # A route is a flight: the request's callback decides and publishes the task to the agent
    # with a reply subject of this hub's own (``<inbox>.<token>``), and returns; the agent's
    # reply arrives in another callback, which finishes the flight (or tries the next agent),
    # and a deadline sweep finishes the flights nobody answered (both in ``_route_end.py``).
    # No task, future or timer per request: the hot path is two message callbacks and two
    # publishes. Only a route that needs the KV first (a sticky session, an agent registered
    # through another hub a moment ago) runs that lookup in a task before its first attempt.

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
        if malformed:  # no reply subject to answer on: only the log can be told (at a rate)
            self._malformed_lines.warn(
                log,
                msg.subject,
                "route batch on %s: %d malformed line(s) dropped",
                msg.subject,
                malformed,
            )
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
                raise self._over_share(ns, reply)
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
        if req.task_id is not None and req.agent_id is None:
            # A retry of a task a hub routed: to the agent that has it, if still routable.
            flight.sticky = flight.in_hand = self._pins.get(flight.ns, req.task_id)
            if flight.resend and (
                flight.in_hand is None or flight.in_hand not in self.registry.agents
            ):
                seeking = self._seeking_by_ns
                held = seeking.get(flight.ns, 0)
                if self._seeking < HOLDER_SEEKS_MOST and held < HOLDER_SEEKS_PER_NAMESPACE:
                    # Sent again, and no pin here (or one naming an agent no longer registered:
                    # declared LOST, say): ask who holds it first (``hub/_holders.py``).
                    self._seeking += 1
                    seeking[flight.ns] = held + 1
                    self._spawn(self._seek_then_attempt(flight))
                    return
                self.metrics.resend_seek_total.labels("skipped").inc()
        if (req.session_id is not None and flight.sticky is None) or (
            req.agent_id is not None and req.agent_id not in self.registry.agents
        ):
            self._spawn(self._lookup_then_attempt(flight))
        else:
            await self._attempt(flight)

    def _over_share(self, ns: str, reply: str) -> ThrottledError:
        """Fairness: the hub is full and ``ns`` holds its fair share of it, so the request is
        refused before anything is decoded (its retries cost little) while the other
        namespaces' requests are still read and served. Counted in ``reach_throttled_total``
        only: the SDK retries it, and its outcome is counted then."""
        flights = self._ns_flights
        if self.known_namespace(ns):
            self.metrics.throttled_total.labels(ns).inc()
            self._say_throttled(ns, reply, "fair_share")
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
            # Answered at once: no flight, no audit subject for it, and no series of its own —
            # counted (and logged, at a rate) under one name: a misspelled namespace fails
            # every request it makes, and an operator must be able to see that.
            err = self.router.unknown_namespace(req, ns)
            self._count(UNKNOWN_NAMESPACE, req.mode, "UNKNOWN_NAMESPACE")
            self._say_unknown_namespace(ns, req)
            raise err
        retry = self._route_throttle.check(ns if known else _UNKNOWN_NS)
        if retry > 0:
            if known:
                self.metrics.throttled_total.labels(ns).inc()
                self._count(ns, req.mode, "THROTTLED")
                self._say_throttled(ns, reply, "route_rate")
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
            attempt=req.after_attempt or 0,
            round_start=req.after_attempt or 0,
            resend=headers is not None and RESEND_HEADER in headers and resend_marked(headers),
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

    async def _seek_then_attempt(self, flight: _Flight) -> None:
        """A resent task this hub has no pin for: to the agent the other hubs or the agents
        say holds it, if any (``hub/_holders.py``); then routed as any other."""
        req = flight.req
        assert req.task_id is not None
        copy: TaskReply | None = None
        try:
            lost = self.router.matching_lost(req, flight.ns, HOLDER_ASK_MOST)
            # Half its time left at most: the route must still be decided and run.
            holder, copy = await self._seek_holder(
                flight.ns,
                req.task_id,
                self.router.matching(req, flight.ns),
                (flight.deadline - time.perf_counter()) / 2,
                lost,
                flight.attempt + 1,
            )
            if copy is not None and (req.mode != "proxy" or req.dry_run):
                copy = None  # a decision is asked for, not the task's outcome
            if holder is not None and holder in lost:
                if copy is not None:
                    # A holder declared LOST that finished the task: its stored reply is the
                    # answer (it may not register again in time; nothing runs again).
                    self._found("lost_copy", holder)
                # Else still running or queued there: routed to it once it has registered
                # again, waiting half the time left at most — the other half is for the
                # attempt (joining its run), or for a new run if it does not come.
                elif not await self._holder_back(
                    holder, (flight.deadline - time.perf_counter()) / 2
                ):
                    holder = None
        except Exception:  # a bug, not the input: routed as if unmarked
            log.exception("route %s: seeking its task's holder failed", flight.request_id)
            holder = copy = None
        finally:
            self._seeking -= 1
            seeking = self._seeking_by_ns
            seeking[flight.ns] -= 1
            if not seeking[flight.ns]:
                del seeking[flight.ns]
        if holder is not None and copy is not None:
            await self._answer_copy(flight, holder, copy)
            return
        if holder is not None:
            flight.sticky = flight.in_hand = holder
        await self._lookup_then_attempt(flight)

    def _deaf_holder(self, agent_id: str | None) -> AgentView | None:
        """``agent_id``'s view if this hub found it deaf (its breaker's ``why``), else None: a
        dict lookup, on every route decision, before anything is awaited for it."""
        view = self.registry.agents.get(agent_id) if agent_id is not None else None
        return view if view is not None and view.breaker.why == DEAF else None

    async def _ask_deaf_holder(self, view: AgentView) -> None:
        """The agent that may hold the route's task (``_Flight.in_hand``, or the agent a retry
        names with ``after_attempt``), if this hub found it deaf (its breaker open for that:
        ``Router.decide`` keeps a deaf holder out), is asked on its ctl subject first: an
        answer disproves the verdict (``Registry.answered_on_ctl``), and the route goes to it,
        whose idempotency table answers from the run it holds. Taken for deaf while it was cut
        off (a beat stored before the cut and delivered late), a holder that had run a route
        was turned away from the caller's retry, and the task ran again on another agent
        (chaos secure seed 198, ``partition``). Nobody there, or no answer within
        ``_DEAF_ASK_TIMEOUT``: still deaf, kept out."""
        with contextlib.suppress(Exception):  # nobody there, no answer: deaf still
            await self.registry.ask_agent(view.agent_id, _PING, timeout=_DEAF_ASK_TIMEOUT)
            if self.registry.agents.get(view.agent_id) is view:
                self.registry.answered_on_ctl(view)

    async def _answer_copy(self, flight: _Flight, holder: str, copy: TaskReply) -> None:
        """Answer a resent route with the reply its holder ``holder`` — declared LOST, not
        registered — stored for its task (``cached``: an answer from its idempotency table,
        as a copy sent to it would get; ``hub/_holders.py``). No attempt is sent: its
        figures, health and breaker are not touched (the run was counted when it ran)."""
        try:
            task = protocol.encode(copy)
            head = _ReplyHead.model_validate(copy.model_dump(exclude={"result"}))
        except Exception:  # a bug, not the input (the copy was validated): routed as new
            log.exception("route %s: answering its holder's copy failed", flight.request_id)
            await self._lookup_then_attempt(flight)
            return
        self.metrics.duplicate_delivery_total.inc()
        await self._finish(flight, task=task, head=head, holder=holder)

    async def _lookup_then_attempt(self, flight: _Flight) -> None:
        """The KV reads a route needs before it can decide: its session's agent, or an agent
        registered through another hub that this hub's watch has not shown yet."""
        req = flight.req
        try:
            if req.session_id is not None and flight.sticky is None:
                flight.sticky = await self.sessions.get(flight.ns, req.session_id)
            if req.agent_id is not None and req.agent_id not in self.registry.agents:
                await self.registry.fetch(req.agent_id)
        except Exception as err:
            # (Every route meets it while KV is down.)
            self._outage_lines.warn(
                log, "route KV lookup", "route %s: KV lookup failed: %r", flight.request_id, err
            )
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
        # Alternates let a direct-mode caller cache the decision; a session or hash key asks
        # for per-request routing, so those get none.
        alternates = (
            DIRECT_ALTERNATES
            if req.mode == "direct" and req.session_id is None and req.hash_key is None
            else 0
        )
        exclude = frozenset(flight.exclude)

        def decide(only: str | None = None) -> Choice:
            return self.router.decide(
                req,
                flight.ns,
                flight.request_id,
                exclude=exclude,
                sticky_agent=flight.sticky,
                alternates=alternates,
                only=only,
            )

        # The agent that may have the task in hand, alone until it is declared gone (LOST) or
        # found deaf (``_Flight.in_hand``, ``_may_hold_task``); then, or when it is not
        # routable for another reason, the route goes on as any other: the at-least-once
        # window of an agent lost with the task (docs/reliability.md).
        choice: Choice | None = None
        holder = flight.in_hand
        deaf = self._deaf_holder(
            holder or (req.agent_id if req.after_attempt and req.task_id is not None else None)
        )
        if deaf is not None:  # (no coroutine on the usual route: only for a holder found deaf)
            await self._ask_deaf_holder(deaf)
        if holder is not None and self._may_hold_task(
            holder, (flight.unreached or {}).get(holder, 0.0)
        ):
            with contextlib.suppress(NoMatchError):
                choice = decide(holder)
        try:
            if choice is None:
                choice = decide()
        except NoMatchError as err:
            # A candidate refused it before (``_refused``): every one has, or the one it
            # waited for (``_hold``) was dropped since. The answer is that refusal (the agent
            # missing, busy, ...), not "nobody was ever there".
            if flight.last_error is not None:
                if not self._hold(flight):
                    await self._finish(flight, error=flight.last_error)
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
        if req.task_id is not None and req.agent_id is None:
            before = self._pins.get(flight.ns, req.task_id)
            flight.pinned_over = None if before == view.agent_id else before
            if self._pins.pin(flight.ns, req.task_id, view.agent_id):
                # The first pin to send: sent after this pass's attempts (they are for retries).
                asyncio.get_running_loop().call_soon(self._start_pins)
        if req.mode == "direct":
            view.assigned(self.registry.now)
            await self._finish(
                flight, subject=view.record.task_subject, alternates=choice.alternates
            )
            return
        remaining = flight.deadline - time.perf_counter()
        if remaining <= 0:
            # A try made after the deadline: a held route (``_hold``) woken late by a loaded
            # loop. Its answer is what the tries before it met (the agent nobody listened for),
            # as when the hold ends on time; a route never tried is not delivered.
            late = flight.last_error or MeshTimeoutError(
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
            replies = self._replies.of(protocol.namespace_of(view.agent_id))
            box = self._outboxes[view.agent_id] = _Outbox(view, reply_token(), replies)
            if self._sender is None:
                self._sender = asyncio.get_running_loop().create_task(self._send_outboxes())
        # An attempt's reply subject is <prefix><batch token>.<index> (the prefix its agent's
        # namespace's): NATS' "no responders" for a whole batch (sent with reply subject
        # <prefix><batch token>) finds its attempts.
        token = f"{box.token}.{len(box.items)}"
        box.items.append((token, body, headers))
        box.size += len(body)
        flight.token = token
        flight.replies = box.replies
        self._flights[token] = flight
        heapq.heappush(self._deadlines, (flight.deadline, token))
        if len(self._deadlines) == 1:
            self._sweep_wake.set()  # (the sweep waits while the heap is empty)
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
        replies = box.replies
        prefix = replies.prefix
        flights = self._flights
        # An attempt whose deadline passed before the pass ended has been answered already.
        items = [item for item in box.items if item[0] in flights]
        try:
            if replies.sub is None:  # the namespace's first: its subscription before these
                await self._replies.ready(replies)
            if len(items) > 1 and view.record.card.batch:
                # A batch line carries one traceparent; richer trace context goes on its own.
                lines = [
                    protocol.batch_line(prefix + token, headers[TRACEPARENT], body)
                    for token, body, headers in items
                    if len(headers) == 1
                ]
                if len(lines) > 1:
                    items = [item for item in items if len(item[2]) != 1]
                    await replies.nc.publish(
                        protocol.agent_batch(view.agent_id),
                        b"\n".join(lines),
                        reply=prefix + box.token,
                    )
            subject = view.record.task_subject
            for token, body, headers in items:
                await replies.nc.publish(subject, body, reply=prefix + token, headers=headers)
        except Exception as err:  # the connection is closing or gone
            unavailable = MeshUnavailableError(f"cannot reach NATS: {type(err).__name__}")
            for token, _, _ in box.items:
                flight = flights.pop(token, None)
                if flight is not None:
                    view.outstanding -= 1
                    self._end_deliver(flight, unavailable)
                    await self._finish(flight, error=unavailable)

    async def _ask_agents_again(self, nc: NATS | None = None) -> None:
        """Back on NATS after losing it: the agents' answers sent while this hub was away are
        lost (NATS keeps none), so every attempt still waiting for one is sent again, alone, to
        its own reply subject. Same task id and attempt: the agent's idempotency table answers
        from the run in hand or its result, and the first answer ends the flight.

        With ``nc`` (a reply connection back: ``hub/_reply_boxes.py``), only the attempts
        sent on it; all when the main connection is back.

        Their pins go to the other hubs again first: one made just before the connection was
        lost may not have reached them, and their callers, back too, ask again through any hub."""
        pending = list(self._flights.items())
        repinned = False
        for _, flight in pending:
            req, view = flight.req, flight.view
            if req.task_id is not None and req.agent_id is None and view is not None:
                repinned = self._pins.pin(flight.ns, req.task_id, view.agent_id) or repinned
        if repinned:
            await self._send_pins()
        now = time.perf_counter()
        asked = 0
        for token, flight in pending:
            view, remaining, replies = flight.view, flight.deadline - now, flight.replies
            if view is None or replies is None or flight.finished or remaining <= 0:
                continue
            if nc is not None and replies.nc is not nc:  # (not sent on the one back)
                continue
            flight.in_hand = view.agent_id  # it may have had this attempt before the drop
            body = _envelope_bytes(
                flight.task_id,
                flight.attempt,
                flight.capability,
                flight.req.payload,
                flight.ns,
                remaining,
            )
            span = flight.deliver_span
            headers = inject_span(span) if span is not None else (flight.headers or {})
            try:
                await replies.nc.publish(
                    view.record.task_subject, body, reply=replies.prefix + token, headers=headers
                )
            except Exception as err:  # down again: the next reconnection asks again
                log.debug("asking agents again after a reconnection stopped: %r", err)
                break
            asked += 1
        if asked:
            log.info("reconnected to NATS: sent %d attempt(s) again to their agents", asked)

    def _unpin(self, flight: _Flight, agent_id: str) -> None:
        """The attempt in flight was refused before ACCEPTED by ``agent_id`` (nobody listening
        on its subject, busy, no handler): it never had the task, so its task id's pin goes
        back to the agent it named before that attempt (``_Flight.pinned_over``), here and,
        by a pins message, at the other hubs — that agent may hold the task (it ran it, its
        answer lost). Left naming ``agent_id``, the pin sent the caller's next try there, a
        second run, without asking the holder: a pin to a registered agent is taken as is
        (``hub/_holders.py``; the secure chaos run's ``partition``, seed 155: the holder cut
        off and declared LOST, not registered again yet once back, the resend routed as new
        to agents cut off in turn, and the next resend ran on one of them, back)."""
        before, flight.pinned_over = flight.pinned_over, None
        task_id = flight.req.task_id
        if before is None or task_id is None or self._pins.get(flight.ns, task_id) != agent_id:
            return  # no pin before, or another attempt of it pinned it since
        if self._pins.pin(flight.ns, task_id, before):
            asyncio.get_running_loop().call_soon(self._start_pins)

    def _start_pins(self) -> None:
        self._spawn(self._send_pins())

    async def _send_pins(self) -> None:
        """Tell the other hubs the pins this pass of the event loop made (``hub/_pins.py``)."""
        await self._publish_pins(self._pins.outgoing())

    async def _publish_pins(self, pins: dict[str, list[tuple[str, str]]]) -> None:
        """``pins`` (pairs by namespace) on ``reach.hubs.<ns>.pins``, to every other hub."""
        headers = {HUB_HEADER: self.hub_id}
        try:
            for ns, pairs in pins.items():
                for body in encode_pins(pairs):
                    await self.nc.publish(protocol.hub_broadcast(ns, "pins"), body, headers=headers)
        except Exception as err:  # the connection is closing or gone: the pins stay ours
            log.debug("pins not sent to the other hubs: %s", type(err).__name__)

    async def _ask_pins(self) -> None:
        """Just started (listening for pins), or back on NATS: ask the other hubs for the pins
        they made before, which this hub never heard (``hub/_pins.py``)."""
        try:
            await self.nc.publish(
                protocol.hub_broadcast(self.settings.namespace, "pins_ask"),
                b"",
                headers={HUB_HEADER: self.hub_id},
            )
        except Exception as err:  # not connected: the pins it hears from now on still count
            log.debug("pins not asked of the other hubs: %s", type(err).__name__)

    async def _on_pins_ask(self, msg: Msg) -> None:
        """Another hub started: send it (every hub hears it) this hub's newest pins again, at
        most once a second whoever asks."""
        headers = msg.headers
        if headers is None or headers.get(HUB_HEADER) == self.hub_id:
            return
        now = time.monotonic()
        if now - self._pins_replayed_at < _PINS_REPLAY_EVERY:
            return
        self._pins_replayed_at = now
        await self._publish_pins(self._pins.recent(PINS_REPLAY))

    async def _on_pins(self, msg: Msg) -> None:
        """Pins another hub made: a retry of one of those tasks that reaches this hub goes to
        the agent that has it."""
        headers = msg.headers
        if headers is None or headers.get(HUB_HEADER) == self.hub_id:
            return  # our own (every hub hears its own broadcasts)
        ns, pairs = msg.subject.split(".", 3)[2], decode_pins(msg.data)
        self._pins.learn(ns, pairs)
        if self._pin_waits:  # a resend waits for its holder (``hub/_holders.py``)
            self._pins_learned(ns, pairs)

    def _say_unknown_namespace(self, ns: str, req: RouteRequest) -> None:
        """``REACH-SELECT-EMPTY`` for a route to a namespace this hub does not know, once
        every 10 s for all such namespaces together (anyone may make names up): the one seen
        last, and how many more routes went to unknown namespaces meanwhile."""
        held = self._no_match_lines.take(_UNKNOWN_NS)
        if held is None:
            return
        log_event(
            log,
            SELECT_EMPTY,
            "route to a namespace with no registered agent, not configured on this hub",
            namespace=ns,
            target=req.capability or req.selector,
            unknown_namespace=True,
            suppressed=held,
        )

    def _say_throttled(self, ns: str, reply: str, why: str) -> None:
        """``REACH-THROTTLED``, once per namespace every 10 s: the refusals themselves are
        counted (``reach_throttled_total``), and the line says who asked — the caller of the
        request refused now (``_caller``), which in a flood is most likely the flooder (in
        secure mode after its identity's own prefix) — and how many were held back."""
        held = self._no_match_lines.take((_THROTTLED_KEY, ns))
        if held is None:
            return
        limit = (
            f"over its route_rate ({self.settings.route_rate:g}/s, burst "
            f"{self.settings.route_burst:g}) on this hub"
            if why == "route_rate"
            else "holding its fair share of this full hub (hub_concurrency)"
        )
        log_event(
            log,
            THROTTLED,
            f"namespace {ns} is {limit}: route requests refused REACH_THROTTLED "
            "(the SDK retries them until their timeout)",
            namespace=ns,
            reason=why,
            caller="this hub's HTTP API" if reply.startswith(_LOCAL_REPLY) else _caller(reply),
            suppressed=held,
        )

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


def _caller(reply: str) -> str | None:
    """The part of a route request's reply subject that stays the same for one caller: the
    SDK's are ``<inbox prefix>.<its Client's 64 random bits>.<batch>.<n>``, nats-py's own
    requests' ``<inbox prefix>.<its connection's NUID>.<token>`` — the inbox prefix being
    ``_INBOX``, or a secure-mode identity's ``_INBOX.<role>.<name>``."""
    tokens = reply.split(".")
    keep = len(tokens) - (2 if len(tokens) >= 4 else 1)
    return _clip(".".join(tokens[: max(keep, 1)]))
