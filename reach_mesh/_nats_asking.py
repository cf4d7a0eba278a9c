"""Asking over a NATS connection that may reconnect, or whose answerer may be paused.

A connection's reconnections are kept (:class:`Reconnects`; :class:`ReconnectWatch` for a
connection made elsewhere): answers sent while it was away are lost, and a request waiting
on one is given up at the reconnection (:func:`or_reconnected`) to be asked again. A request
any member of a queue group may answer is sent again to another within a short wait
(:func:`hedged_request`), rather than waited on while a paused member holds it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

import nats
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from reach_mesh._nats_refusals import unless

__all__ = [
    "ReconnectWatch",
    "Reconnected",
    "Reconnects",
    "hedged_request",
    "or_reconnected",
    "reconnects_of",
]

log = logging.getLogger("reach_mesh.nats")

T = TypeVar("T")


class Reconnects:
    """A connection's reconnections: answers sent to it while it was away are lost, so whoever
    waits for one may need to ask again. Listeners are called after each reconnection
    (subscriptions are in place again); :meth:`next` is a future for whoever waits for one."""

    def __init__(self) -> None:
        #: Reconnections so far.
        self.count = 0
        #: Called after each reconnection, in the order they joined.
        self.listeners: list[Callable[[], None]] = []
        self._next: asyncio.Future[None] | None = None

    def next(self) -> asyncio.Future[None]:
        """A future done at the next reconnection (shared: do not cancel it)."""
        if self._next is None:
            self._next = asyncio.get_running_loop().create_future()
        return self._next

    def note(self) -> None:
        """The connection is back."""
        self.count += 1
        fut, self._next = self._next, None
        if fut is not None and not fut.done():
            fut.set_result(None)
        for listener in list(self.listeners):
            try:
                listener()
            except Exception:  # one listener's bug must not keep the others from their turn
                log.exception("a reconnection listener failed")


class ReconnectWatch:
    """The reconnections of a connection made elsewhere (by nats-py's own ``connect``, whose
    one reconnect callback is its maker's): seen by reading nats-py's ``stats["reconnects"]``
    every ``interval`` seconds, once the connection is up again (its subscriptions are in
    place again by then). :meth:`stop` ends the watch."""

    def __init__(self, nc: NATS, interval: float = 0.1) -> None:
        self.reconnects = Reconnects()
        self._task = asyncio.get_running_loop().create_task(self._watch(nc, interval))

    async def _watch(self, nc: NATS, interval: float) -> None:
        seen = nc.stats["reconnects"]
        while not nc.is_closed:
            await asyncio.sleep(interval)
            now = nc.stats["reconnects"]
            if now != seen and nc.is_connected:
                seen = now
                self.reconnects.note()

    def stop(self) -> None:
        self._task.cancel()


class Reconnected(Exception):
    """The connection came back while a request waited for its answer (:func:`or_reconnected`):
    an answer sent meanwhile is lost."""


def reconnects_of(nc: NATS) -> Reconnects | None:
    """The reconnections a connection made by :func:`connect` keeps (None for another one)."""
    got = getattr(nc, "reconnects", None)
    return got if isinstance(got, Reconnects) else None


async def or_reconnected(nc: NATS, aw: Awaitable[T], *, reconnects: Reconnects | None = None) -> T:
    """Await ``aw`` (a request on ``nc``), or raise :class:`Reconnected` as soon as ``nc``
    reconnects first: for a request that is safe to ask again, whose answer may have been
    lost meanwhile. ``reconnects``: ``nc``'s, when it keeps none itself (:class:`ReconnectWatch`).
    Not for hot paths: a task per call."""
    if reconnects is None:
        reconnects = reconnects_of(nc)
    if reconnects is None:
        return await aw
    done = await unless(aw, reconnects.next())
    if done is None:
        raise Reconnected
    return done.result()


async def hedged_request(
    nc: NATS,
    subject: str,
    payload: bytes,
    *,
    timeout: float,
    every: float,
    final: Callable[[Msg], bool] | None = None,
    most: int | None = None,
) -> Msg:
    """``nc.request``, sent again after each ``every`` seconds without an answer while the
    earlier tries may still answer; the first answer. For a request any member of a queue
    group may answer and that is safe to repeat (an agent's registration): one sent to a
    member that does not answer (paused, wedged) is asked of another within ``every``,
    rather than waited on for ``timeout``.

    ``final``: whether an answer ends the wait. One that does not (a refusal that says
    "later": throttled, JetStream unavailable) is kept while the tries still out may give
    a final one, for ``every`` at most, and is the answer if none does; nothing more is sent
    once any answer came. ``most``: at most this many tries (a member slow because JetStream
    is, in an election, is not sent more writes than that). No responders, or any error but a
    timeout, is raised at once;
    ``nats.errors.TimeoutError`` when no try is answered within ``timeout``. Not for hot
    paths: a task per try."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    tries: set[asyncio.Task[Msg]] = set()
    next_send = loop.time()
    sent = 0
    kept: Msg | None = None  # an answer not ``final``, and until when it waits for one
    kept_until = 0.0
    try:
        while True:
            now = loop.time()
            if kept is not None and (not tries or now >= kept_until):
                return kept
            if now >= deadline:
                raise nats.errors.TimeoutError
            if kept is None and now >= next_send:
                tries.add(loop.create_task(nc.request(subject, payload, timeout=deadline - now)))
                sent += 1
                next_send = now + every if most is None or sent < most else deadline
            wake = min(deadline, next_send if kept is None else kept_until) - loop.time()
            if not tries:
                await asyncio.sleep(max(wake, 0.0))
                continue
            done, _ = await asyncio.wait(
                tries, timeout=max(wake, 0.0), return_when=asyncio.FIRST_COMPLETED
            )
            # Answers first: an error of a try that ended with them does not hide them.
            for task in sorted(done, key=lambda t: t.cancelled() or t.exception() is not None):
                tries.discard(task)
                if task.cancelled():
                    continue
                err = task.exception()
                if err is None:
                    msg = task.result()
                    if final is None or final(msg):
                        return msg
                    if kept is None:
                        kept, kept_until = msg, loop.time() + every
                elif not isinstance(err, (nats.errors.TimeoutError, asyncio.TimeoutError)):
                    raise err
    finally:
        for task in tries:
            if not task.done():
                task.cancel()
                task.add_done_callback(_retrieved)
            elif not task.cancelled():
                task.exception()  # (retrieved: a try answered late is not logged)


def _retrieved(task: asyncio.Task[Msg]) -> None:
    if not task.cancelled():
        task.exception()
