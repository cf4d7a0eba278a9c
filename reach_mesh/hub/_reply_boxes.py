"""Where agents answer a hub: reply subjects of their own namespace, read on a subscription of
that namespace's own (:class:`ReplyBoxes`).

Everything a hub sends agents of namespace ``ns`` that they answer — proxy attempts, alone or
in batches, the hub's own expiry markers (``hub/_lateness.py``), and its ctl asks
(``task_state``, pings: :meth:`ReplyBoxes.ask`) — carries a reply subject under

    <inbox>.r.<ns>.<nonce>.<token>

``<inbox>`` is the hub's connection's inbox prefix (``_INBOX.hub.<hub name>`` in secure mode,
``_INBOX`` in open mode; the fixed token ``r`` is never nats-py's 22-character NUID), ``<nonce>``
64 random bits drawn once per namespace and process, ``<token>`` the request's own. In secure
mode an agent may publish under ``_INBOX.hub.*.r.<its namespace>.>`` only (``_auth.py``): an
agent of one namespace flooding the reply subjects it learned floods its own namespace's
subscription, and every other namespace's answers are read on theirs, in time.

Each namespace's subscription is made (before the first request of that namespace is
published: the server sees the SUB first) when the hub first sends it something, on one of the
hub's :data:`REPLY_CONNECTIONS` reply connections (``<hub_id>-replies-<i>``): the one holding
the fewest namespaces' subscriptions of their own then. The namespace's requests leave on that
connection too (nats-server says "no responders" only to the connection that holds the reply
subscription). It is kept while the namespace has a registered agent or anything in flight
(``in_use``): a namespace gone gives it back, and its slot, once a new namespace wants one
(:meth:`ReplyBoxes._let_go`; its next request subscribes again, with a new nonce, on the
connection with the fewest then). A flood faster than the hub reads its connection waits in
that connection's socket and in nats-server's buffer for it, ahead of everything else the
connection carries, until the server cuts it (a slow consumer, ``max_pending``): the other
connections' namespaces are read in time meanwhile (a connection dropping what it reads is
read a buffer at a time between turns of the event loop: ``_nats._Connection._read_loop``),
and the agents' own verbs (heartbeats) come on the hub's agents connection, none of these. A
namespace that shares the flooded connection (one in :data:`REPLY_CONNECTIONS`) waits behind
it, as every namespace did when they shared one. Its queue is bounded
(:data:`REPLY_PENDING_MOST` messages): a flood past it is dropped as a slow consumer on that
subscription only (``_nats.slow_drops``, counted per subscription: the lateness markers of that
namespace alone count it as a possible loss).

Bounded: past :data:`REPLY_NAMESPACES_MOST` namespaces, the next ones share one overflow
subscription (``<inbox>.r.*.<overflow nonce>.>``; the subjects still name the namespace, so an
agent may publish into its own namespace's only) — they are isolated from each other no more
than all namespaces were before, and still from the first ones.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import Awaitable, Callable, Collection, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Final

import nats.errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from reach_mesh import protocol
from reach_mesh._batch import inbox_prefix, reply_token
from reach_mesh._nats import slow_drops, slow_drops_forget

__all__ = [
    "REPLY_CONNECTIONS",
    "REPLY_NAMESPACES_MOST",
    "REPLY_PENDING_MOST",
    "ReplyBox",
    "ReplyBoxes",
]

#: Connections a hub reads its agents' replies on; a new namespace takes the one with the
#: fewest namespaces' subscriptions of their own.
REPLY_CONNECTIONS: Final = 4
#: Namespaces with a reply subscription of their own per hub; the next ones share one.
REPLY_NAMESPACES_MOST: Final = 256
#: Messages one reply subscription holds unread before it drops the next (slow consumer).
REPLY_PENDING_MOST: Final = 65_536


@dataclass(slots=True, eq=False)
class ReplyBox:
    """One namespace's reply subjects on this hub, and what its lateness markers keep."""

    ns: str
    #: The connection its subscription is on, and its requests leave on (NATS' "no
    #: responders" goes to the publishing connection's own subscription only).
    nc: NATS
    #: ``<inbox>.r.<ns>.<nonce>.``, as text and bytes, and its length.
    prefix: str
    prefix_b: bytes
    prefix_len: int
    #: Its subscription once made (shared by the overflow's namespaces: ``shared``), and the
    #: task making it.
    shared: bool = False
    sub: Subscription | None = None
    ready: asyncio.Future[Subscription] | None = None
    #: Ctl asks awaiting their answer, by reply token.
    asks: dict[str, asyncio.Future[Msg]] = field(default_factory=dict)
    #: Tokens of the attempts the sweep's current pass expired (one marker for them).
    swept: list[str] = field(default_factory=list)
    #: Its subscription's losses as the sweep last saw them (from when the subscription was
    #: made: ``ReplyBoxes.ready``), and when (perf_counter) it last saw them grow.
    losses_seen: int = 0
    lost_at: float = -math.inf


#: What reads a namespace's replies (the hub's ``_on_agent_reply``).
OnReply = Callable[[ReplyBox, Msg], Awaitable[None]]
#: The namespaces whose reply subjects the hub still needs: those with a registered agent, or
#: with an attempt, a marker or an expired attempt awaiting its marker on them.
InUse = Callable[[], Collection[str]]


class ReplyBoxes:
    """The reply subjects of each namespace a hub sends requests to, each namespace's on one
    of ``ncs``."""

    def __init__(self, ncs: Sequence[NATS], on_reply: OnReply, in_use: InUse) -> None:
        assert ncs
        self._ncs = tuple(ncs)
        self._on_reply = on_reply
        self._in_use = in_use
        #: Unsubscribing the subscriptions of namespaces let go.
        self._leaving: set[asyncio.Task[None]] = set()
        #: ``<inbox>.r.``: what every namespace's prefix starts with (the same on every
        #: connection: made with one ``inbox_prefix``).
        self._base = inbox_prefix(ncs[0]) + ".r."
        self._boxes: dict[str, ReplyBox] = {}
        #: Namespaces with a subscription of their own on each of ``ncs`` (their sum: in all).
        self._held = [0] * len(self._ncs)
        self._overflow_nonce = reply_token()
        self._overflow: asyncio.Future[Subscription] | None = None

    def of(self, ns: str) -> ReplyBox:
        """``ns``'s reply subjects; its subscription is being made if it was not (await
        :meth:`ready` before publishing a request that names them)."""
        box = self._boxes.get(ns)
        if box is None:
            box = self._boxes[ns] = self._make(ns)
        return box

    def boxes(self) -> list[ReplyBox]:
        return list(self._boxes.values())

    async def ready(self, box: ReplyBox) -> None:
        """Wait for ``box``'s subscription (nothing to wait for once made). Raises what
        subscribing raised (the connection closed); the next :meth:`of` tries again."""
        if box.sub is not None:
            return
        assert box.ready is not None
        try:
            sub = await asyncio.shield(box.ready)
        except Exception:
            if self._boxes.get(box.ns) is box:
                del self._boxes[box.ns]
                self._release(box)
            raise
        if box.sub is None:
            box.sub = sub
            # Its losses count from here: one before (a reconnection) took no reply of it.
            box.losses_seen = self.losses(box)

    def losses(self, box: ReplyBox) -> int:
        """Reconnections of ``box``'s connection and messages of its subscription dropped as a
        slow consumer, so far: a reply on ``box`` may be lost with either."""
        nc, sub = box.nc, box.sub
        drops = 0 if sub is None else slow_drops(nc, sub._id)
        return int(nc.stats["reconnects"]) + drops

    def _make(self, ns: str) -> ReplyBox:
        loop = asyncio.get_running_loop()
        if sum(self._held) >= REPLY_NAMESPACES_MOST:
            self._let_go()
        if sum(self._held) < REPLY_NAMESPACES_MOST:
            # The connection with the fewest (namespaces spread evenly, after some let go too).
            i = min(range(len(self._ncs)), key=self._held.__getitem__)
            nc = self._ncs[i]
            self._held[i] += 1
            prefix = f"{self._base}{ns}.{reply_token()}."
            box = ReplyBox(ns, nc, prefix, prefix.encode(), len(prefix))
            read = partial(self._on_reply, box)
            box.ready = loop.create_task(self._subscribe(nc, prefix + ">", read))
        else:
            nc = self._ncs[0]
            prefix = f"{self._base}{ns}.{self._overflow_nonce}."
            box = ReplyBox(ns, nc, prefix, prefix.encode(), len(prefix), shared=True)
            overflow = self._overflow
            if overflow is None or (
                overflow.done() and (overflow.cancelled() or overflow.exception() is not None)
            ):
                subject = f"{self._base}*.{self._overflow_nonce}.>"
                overflow = loop.create_task(self._subscribe(nc, subject, self._on_overflow))
                self._overflow = overflow
            box.ready = overflow
        box.ready.add_done_callback(_retrieved)
        return box

    def _let_go(self) -> None:
        """Forget the namespaces the hub no longer needs (``in_use``; nor a ctl ask waiting,
        nor a subscription being made): their subscriptions of their own unsubscribed, their
        slots free. Called when a new namespace would go to the overflow: at most once per
        new namespace past the bound, over the hub's agents and what it has in flight."""
        keep = self._in_use()
        for ns, box in list(self._boxes.items()):
            if ns in keep or box.asks or box.sub is None:
                continue
            del self._boxes[ns]
            if box.shared:
                continue
            self._release(box)
            task = asyncio.get_running_loop().create_task(_unsubscribe(box.nc, box.sub))
            self._leaving.add(task)
            task.add_done_callback(self._leaving.discard)

    def _release(self, box: ReplyBox) -> None:
        """``box``'s slot, and its place on its connection, free (its subscription gone, or
        never made)."""
        if not box.shared:
            self._held[self._ncs.index(box.nc)] -= 1

    @staticmethod
    async def _subscribe(
        nc: NATS, subject: str, cb: Callable[[Msg], Awaitable[None]]
    ) -> Subscription:
        # Unguessable (64 random bits), and NATS' "no responders" status messages for an
        # attempt or an ask arrive here: not guarded like the request subjects.
        return await nc.subscribe(subject, cb=cb, pending_msgs_limit=REPLY_PENDING_MOST)

    async def _on_overflow(self, msg: Msg) -> None:
        """A reply on the overflow subscription: the namespace named in its subject."""
        subject, base = msg.subject, len(self._base)
        box = self._boxes.get(subject[base : subject.find(".", base)])
        if box is not None and subject.startswith(box.prefix):
            await self._on_reply(box, msg)

    async def ask(self, agent_id: str, body: bytes, *, timeout: float) -> Msg:
        """Ask ``agent_id`` on its ctl subject, answered on its namespace's reply subjects
        with a fresh 64-bit token (an agent sees the reply subjects of what it is asked, and
        must not guess the next one). ``NoRespondersError`` when nobody listens there,
        ``nats.errors.TimeoutError`` without an answer in ``timeout`` seconds."""
        box = self.of(protocol.namespace_of(agent_id))
        await self.ready(box)
        token = reply_token()
        future: asyncio.Future[Msg] = asyncio.get_running_loop().create_future()
        box.asks[token] = future
        try:
            await box.nc.publish(protocol.agent_ctl(agent_id), body, reply=box.prefix + token)
            try:
                async with asyncio.timeout(timeout):
                    msg = await future
            except TimeoutError:
                raise nats.errors.TimeoutError from None
        finally:
            box.asks.pop(token, None)
        if not msg.data and (msg.headers or {}).get("Status") == "503":
            raise nats.errors.NoRespondersError
        return msg


async def _unsubscribe(nc: NATS, sub: Subscription) -> None:
    with contextlib.suppress(Exception):  # (its connection closing: gone with it)
        await sub.unsubscribe()
    slow_drops_forget(nc, sub._id)  # (what it dropped counted no more: no box reads it)


def _retrieved(future: asyncio.Future[Subscription]) -> None:
    if not future.cancelled():
        future.exception()  # (raised again to whoever awaits it: not logged as lost)
