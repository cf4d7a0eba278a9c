"""Who has a resent task, asked before a hub routes it (``HoldersMixin``, a base of
:class:`~reach_mesh.hub.Hub`).

A caller that sends a route request again with the same ``task_id`` — after its own NATS
reconnection, its answer lost; after a hub that held its route stopped — marks it with the
``Reach-Resend: 1`` header (docs/protocol.md): its first send may have reached an agent, which
runs it. The hubs' pins (``hub/_pins.py``) usually send it there. But a hub may hold no pin for
it: its connection came back a moment ago and its pins ask is not answered yet (the secure
chaos run's ``node_kill``: three routes of 500 ran twice in 3 of 11 runs), it started since,
or the hub that routed the first send died before its pins message left. Or its pin names an
agent no longer registered: the chaos run's ``partition``, an agent running the task cut off
long enough to be declared LOST, back on NATS but not registered yet (its registration is a
KV write, and JetStream comes back seconds after the network) — not routable, not asked
before, so the retry ran on another agent too. Such a hub does not choose at once: it asks,
at the same moment and for ``HOLDER_WAIT`` at most (half the route's time left, if less),

- the other hubs, on ``reach.hubs.<ns>.pin_of`` (body: the task id; a hub that has a pin
  answers the agent id, the others stay silent),
- the registered agents that could serve the request (``HOLDER_ASK_MOST`` at most), and
- the agents this hub declared LOST lately (its ``recently_lost``: 15 minutes, and not
  registered again), newest first, whose registration the request matched (capability or
  selector, ``Router.matching_lost``; ``HOLDER_ASK_MOST`` at most) — an agent back on NATS
  answers its ctl subject while unregistered;

the agents by ctl ``task_state`` with ``route: true`` (a request-reply task of that id, not
a workflow's step; no fence: asking changes nothing on the agent).

The first hub to name an agent, or agent to hold the task id (any state but ``PENDING``
without an attempt: running, queued, or finished — its idempotency table answers), or a pins
message that names one meanwhile, is where the route goes, as for a pin
(``_Flight.in_hand``) — except that a hub or pins message naming one of the recently LOST
asked is not taken for an answer (pins outlive registrations): that agent's own answer is.
One of those that holds the task is not routable yet. If it FINISHED the task — its answer is
the final ``TaskReply`` it stored, for that agent and task id, and the attempt the route would
send it would be answered with it rather than run again (SUCCEEDED; of that attempt or a later
one; FAILED with ``retryable: false``: the agent's own rule, ``_runs_again``;
``_stored_copy``) — a proxy-mode route is answered at once with that reply, ``cached: true``,
its ``agent_id`` the holder's (counted ``found="lost_copy"``; no attempt is sent, nothing runs,
no pin or session is written, no health or breaker figure moves): exactly what its idempotency
table would answer a copy, without waiting for a registration that JetStream may refuse for
longer than the wait (the chaos ``partition`` runs, seeds 165, 168 and 171: such a route ran
again on another agent). Still running or queued there (no reply yet: joining that run needs
the agent routable), or its stored reply one that a copy would not get (an earlier attempt
that failed or timed out: a later one runs again), or a direct-mode or dry-run route (they ask
for a decision, not the outcome): the route waits for it to register again — this hub's
registry shows it (its watch, or a registration through this hub: the registry's state
listener, ``_holder_back``) — for half the route's time left at most, and ``HOLDER_BACK_WAIT``
(10 s: its next heartbeat, 5 s apart by default, registers it once JetStream takes writes
again), keeping the other half for the attempt (joining the run in hand, or a new run). Back,
the route goes to it as for a pin; not back in time, it is routed as new (counted
``found="lost"``: the task runs twice).

The stored reply is a result handed to a caller, so it must come from the holder. Only the
holder's identity may subscribe to its ctl subject (secure mode, ``_auth.py``), so only it
receives the ask; but every agent of its namespace may publish on that namespace's reply
subjects of every hub (it answers hubs there), so each ask's reply subject carries 64 random
bits from the OS (``Registry.ask_agent``, ``hub/_reply_boxes.py``), not nats-py's NUIDs — a
registered agent asked in the same seek sees its own ask's reply subject and could follow the
NUIDs to the LOST holder's, and answer it with a made-up result. An answer that speaks for
another agent or task id, is not a final reply, is malformed or larger than ``max_payload`` +
16 KiB (dropped unread) is no copy. The holder may lie about its own result, as it may when a
route is sent to it: it is asked only as an agent of the request's namespace whose registration
the request matched.

Nobody claiming it, the hub waits the whole ``HOLDER_WAIT`` even when every agent said no, then
routes it as new (or to a pin it made itself meanwhile): another copy of the same request may
be on its way to an agent through another hub at that moment — nats-py sends on reconnecting
what it had buffered while its connection was already dead, and the ``Client`` asks again too
(the secure chaos run, seeds 202 and 203: a marked copy whose agents all said no, routed at
once, ran beside the unmarked copy another hub had just routed); that hub's pins message comes
within the wait.

An unmarked request costs nothing of this, nor does a marked one whose pin names an agent
registered here. The mark lets a caller do nothing it could not do unmarked: the route is
decided among the agents its request matches, in its own namespace, as any other (a LOST holder
is routed to only once registered again, and only if it still matches); and sending the same
task id again unmarked would reach the agent that holds it through the pins anyway. It costs
the hub at most ``2 * HOLDER_ASK_MOST + 1`` small requests (an agent lost for good answers "no
responders" at once) and ``HOLDER_WAIT`` of the route's time — plus the wait for a LOST holder
that said it has the task, which only the agent of that id can cause — within the namespace's
route rate, and no more than ``HOLDER_SEEKS_MOST`` seeks (and waits) at once, of which
``HOLDER_SEEKS_PER_NAMESPACE`` for one namespace (beyond, a resend is routed unmarked: a
caller marking every route once left every other tenant's resends unasked).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections.abc import Collection
from typing import TYPE_CHECKING, Any, Final, TypeVar

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from reach_mesh import protocol
from reach_mesh.config import MeshSettings
from reach_mesh.errors import BadRequestError, ReachError
from reach_mesh.hub._pins import HUB_HEADER, TaskPins
from reach_mesh.hub.registry import AgentView, Registry
from reach_mesh.models import AgentState, TaskReply, TaskState
from reach_mesh.tracing.metrics import HubMetrics

__all__ = [
    "HOLDER_ASK_MOST",
    "HOLDER_BACK_WAIT",
    "HOLDER_SEEKS_MOST",
    "HOLDER_SEEKS_PER_NAMESPACE",
    "HOLDER_WAIT",
    "RESEND_HEADER",
    "HoldersMixin",
    "resend_marked",
]

log = logging.getLogger("reach_mesh.hub")

K = TypeVar("K")
V = TypeVar("V")

#: The header a caller puts on a route request it sends again (value ``1``).
RESEND_HEADER: Final = protocol.HDR_RESEND
#: How long a hub asks, at most, who holds a resent task it has no pin for (seconds).
HOLDER_WAIT: Final = 0.5
#: Agents a hub asks at most whether they hold a resent task.
HOLDER_ASK_MOST: Final = 32
#: How long a route waits, at most, for the holder of its task that the hub declared LOST,
#: back on NATS (it answered), to register again (seconds; half the route's time left, if
#: less). Its registration comes with its next heartbeat (every 5 s by default), once
#: JetStream takes writes again — seconds after a partition heals.
HOLDER_BACK_WAIT: Final = 10.0
#: Resent tasks a hub seeks the holder of at once, at most; beyond, routed as if unmarked.
HOLDER_SEEKS_MOST: Final = 256
#: Of those, what one namespace's resends may hold: a caller marking every route it sends
#: (each seek waits ``HOLDER_WAIT`` when nobody claims the task) must not leave the other
#: tenants' resends unasked — routed as new, run twice.
HOLDER_SEEKS_PER_NAMESPACE: Final = 64
#: What a holder's ``task_state`` answer may take beyond ``max_payload`` (its reply's fields
#: around the result) before it is dropped unread.
_COPY_SLACK: Final = 16 * 1024


def resend_marked(headers: dict[str, str] | None) -> bool:
    """Whether a route request's headers mark it as sent again (``Reach-Resend: 1``);
    ``BadRequestError`` for any other value of the header."""
    if not headers:
        return False
    value = headers.get(RESEND_HEADER)
    if value is None:
        return False
    if value.strip() != "1":
        raise BadRequestError(
            f"invalid {RESEND_HEADER} header {value[:40]!r}: expected 1 (the request is sent "
            "again with the same task_id), or no header",
            field=RESEND_HEADER,
            value=value[:100],
        )
    return True


def _unwait(waits: dict[K, list[asyncio.Future[V]]], key: K, fut: asyncio.Future[V]) -> None:
    """Take ``fut`` off the futures waiting under ``key`` (the key goes with its last one)."""
    under = waits.get(key)
    if under is not None:
        under.remove(fut)
        if not under:
            del waits[key]


def _holds(data: bytes) -> bool:
    """Whether an agent's answer to ctl ``task_state`` says it holds the task id."""
    try:
        body = protocol.loads_object(data)
    except ReachError:
        return False
    if "error" in body:
        return False
    return "attempt" in body or body.get("state") not in (None, TaskState.PENDING.value)


def _stored_copy(
    data: bytes, agent_id: str, task_id: str, attempt: int, max_size: int
) -> TaskReply | None:
    """The copy of ``task_id``'s stored reply that answers a route whose holder ``agent_id``,
    declared LOST, answered ctl ``task_state`` with ``data``, or None: the answer is its final
    ``TaskReply`` for this very agent and task id, and the attempt the route would send it
    (``attempt``) would be answered with it, not run again (``agent/_serving.py``,
    ``_runs_again``): it SUCCEEDED, or it is of ``attempt`` or a later one, or it FAILED for
    good (``details.retryable`` false). Anything else — running or queued (no reply yet), an
    earlier attempt that failed or timed out (a later one runs again), an error answer, a
    malformed or oversized one (over ``max_size`` bytes: dropped unread), one speaking for
    another agent or task — is no copy. The copy says ``cached: true``."""
    try:
        reply = protocol.decode(data, TaskReply, max_size=max_size)
    except ReachError:
        return None
    if reply.agent_id != agent_id or reply.task_id != task_id or not reply.state.final:
        return None
    err = reply.error
    if not (
        reply.state is TaskState.SUCCEEDED
        or reply.attempt >= attempt
        or (
            reply.state is TaskState.FAILED
            and err is not None
            and err.details.get("retryable", True) is False
        )
    ):
        return None
    return reply.model_copy(update={"cached": True})


class HoldersMixin:
    """The methods of ``Hub`` that find the holder of a resent task (``Hub`` sets every
    attribute below)."""

    hub_id: str
    settings: MeshSettings
    metrics: HubMetrics
    _pins: TaskPins
    #: Holder seeks in progress (``HOLDER_SEEKS_MOST``; counted by ``RoutingMixin``), and
    #: per namespace (``HOLDER_SEEKS_PER_NAMESPACE``; none kept at 0).
    _seeking: int
    _seeking_by_ns: dict[str, int]
    #: What the seeks in progress wait for from the other hubs' pins messages, by
    #: (namespace, task id).
    _pin_waits: dict[tuple[str, str], list[asyncio.Future[str]]]
    #: Routes waiting for the holder of their task, declared LOST, to register again, by
    #: agent id (:meth:`_holder_back`).
    _back_waits: dict[str, list[asyncio.Future[None]]]
    registry: Registry

    if TYPE_CHECKING:

        @property
        def nc(self) -> NATS: ...

    async def _seek_holder(
        self,
        ns: str,
        task_id: str,
        candidates: Collection[str],
        wait: float = HOLDER_WAIT,
        lost: Collection[str] = (),
        attempt: int = 1,
    ) -> tuple[str | None, TaskReply | None]:
        """The agent the other hubs or the ``candidates`` (registered) or ``lost`` (declared
        LOST lately, not registered again) say holds ``task_id``, or that a pin made meanwhile
        names, or None (module docstring); and, for an agent of ``lost`` that finished the
        task, the copy of its stored reply that answers the route's attempt ``attempt``
        (:func:`_stored_copy`), else None. Takes ``wait`` seconds (``HOLDER_WAIT`` at most)
        unless someone names the holder sooner; never raises. A hub or pin naming one of
        ``lost`` is not taken for an answer (its pin outlived its registration): that agent's
        own answer is. An agent of ``lost`` that holds it is returned uncounted: the caller
        counts the seek once it knows whether it answers with the copy (``lost_copy``) or
        that agent registered again (:meth:`_holder_back`).

        Every ask's reply subject carries 64 random bits (``Registry.asks``): agents may
        publish on this hub's reply subjects, and a registered agent asked here sees its own
        ask's — with nats-py's NUIDs it could follow them to the ask of a LOST holder and
        answer it with a made-up result."""
        asks = self.registry.asks
        max_size = self.settings.max_payload + _COPY_SLACK
        loop = asyncio.get_running_loop()
        deadline = loop.time() + max(0.001, min(wait, HOLDER_WAIT))
        left = deadline - loop.time()
        key = (ns, task_id)
        learned: asyncio.Future[str] = loop.create_future()
        self._pin_waits.setdefault(key, []).append(learned)
        body = protocol.dumps({"op": "task_state", "task_id": task_id, "route": True})
        hub_ask: asyncio.Future[Msg] = asyncio.ensure_future(
            asks.request(
                protocol.hub_broadcast(ns, "pin_of"),
                task_id.encode(),
                {HUB_HEADER: self.hub_id},
                timeout=left,
            )
        )
        agent_asks: dict[asyncio.Future[Msg], str] = {
            asyncio.ensure_future(self.registry.ask_agent(agent_id, body, timeout=left)): agent_id
            for agent_id in itertools.chain(
                itertools.islice(candidates, HOLDER_ASK_MOST),
                itertools.islice(lost, HOLDER_ASK_MOST),
            )
        }
        pending: set[asyncio.Future[Any]] = {learned, hub_ask, *agent_asks}
        try:
            while (left := deadline - loop.time()) > 0:
                done, pending = await asyncio.wait(
                    pending, timeout=left, return_when=asyncio.FIRST_COMPLETED
                )
                if not done:
                    break  # time is up
                for ask in done:
                    if ask.cancelled() or ask.exception() is not None:
                        continue
                    if ask is learned:
                        if learned.result() not in lost:
                            return self._found("pin", learned.result()), None
                        continue
                    reply: Msg = ask.result()
                    data = reply.data
                    if ask in agent_asks:
                        self._ctl_answered(agent_asks[ask])
                    if ask is hub_ask:
                        agent_id = data.decode(errors="replace")
                        if (
                            protocol.AGENT_ID_RE.fullmatch(agent_id)
                            and agent_id.startswith(ns + ".")
                            and agent_id not in lost
                        ):
                            return self._found("hub", agent_id), None
                    elif _holds(data):
                        agent_id = agent_asks[ask]
                        if agent_id not in lost:
                            return self._found("agent", agent_id), None
                        # Finished: its stored reply answers the route (it may not register
                        # again in time); running or queued: the route waits for it.
                        return agent_id, _stored_copy(data, agent_id, task_id, attempt, max_size)
            # Nobody claimed it: a pin this hub made meanwhile (another copy of the request,
            # routed here as new), if any.
            made = self._pins.get(ns, task_id)
            return self._found("nobody" if made is None else "pin", made), None
        finally:
            _unwait(self._pin_waits, key, learned)
            for ask in pending:
                ask.cancel()
            for ask in pending:
                with contextlib.suppress(BaseException):
                    await ask

    def _ctl_answered(self, agent_id: str) -> None:
        """``agent_id`` answered on its ctl subject: not deaf (``Registry.answered_on_ctl``),
        so a holder this hub found deaf may be routed to again."""
        view = self.registry.agents.get(agent_id)
        if view is not None:
            self.registry.answered_on_ctl(view)

    async def _holder_back(self, agent_id: str, wait: float) -> bool:
        """Whether ``agent_id`` — declared LOST, and found holding a resent task — is
        registered again, waiting ``wait`` seconds (``HOLDER_BACK_WAIT`` at most) for this
        hub's registry to show it (its watch, or a registration through this hub). Counts
        the seek: ``agent`` if it is back, else ``lost`` (routed as new: it runs twice)."""
        if agent_id not in self.registry.agents and wait > 0:
            back: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._back_waits.setdefault(agent_id, []).append(back)
            try:
                await asyncio.wait({back}, timeout=min(wait, HOLDER_BACK_WAIT))
            finally:
                _unwait(self._back_waits, agent_id, back)
                back.cancel()
        came = agent_id in self.registry.agents
        self._found("agent" if came else "lost", agent_id)
        return came

    def _holder_state(self, view: AgentView, old: AgentState, new: AgentState) -> None:
        """The registry's state listener: an agent registered again (LOST before) wakes the
        routes waiting for it (:meth:`_holder_back`)."""
        if old is AgentState.LOST and new is not AgentState.LOST and self._back_waits:
            for back in self._back_waits.get(view.agent_id, ()):
                if not back.done():
                    back.set_result(None)

    def _found(self, found: str, agent_id: str | None) -> str | None:
        """Count what a seek found (``reach_resend_seek_total``); returns ``agent_id``."""
        self.metrics.resend_seek_total.labels(found).inc()
        return agent_id

    def _pins_learned(self, ns: str, pairs: list[tuple[str, str]]) -> None:
        """Pins a peer made (its pins message): a seek waiting for one of them has its holder
        (another copy of the same request, routed by that hub as new a moment ago)."""
        waits = self._pin_waits
        for task_id, agent_id in pairs:
            for learned in waits.get((ns, task_id), ()):
                if not learned.done():
                    learned.set_result(agent_id)

    async def _on_pin_of(self, msg: Msg) -> None:
        """``reach.hubs.<ns>.pin_of``: another hub asks which agent a resent task went to;
        answered only when this hub has a pin for it."""
        headers = msg.headers
        if not msg.reply or headers is None or headers.get(HUB_HEADER) == self.hub_id:
            return
        task_id = msg.data.decode(errors="replace")
        if not protocol.TASK_ID_RE.fullmatch(task_id):
            return
        agent_id = self._pins.get(msg.subject.split(".", 3)[2], task_id)
        if agent_id is None:
            return
        try:
            await self.nc.publish(msg.reply, agent_id.encode())
        except Exception as err:  # the connection is closing or gone
            log.debug("pin_of not answered: %s", type(err).__name__)
