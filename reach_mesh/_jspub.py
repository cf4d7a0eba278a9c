"""JetStream on the hot paths: acked publishes and direct gets without nats-py's per-request
machinery.

``js.publish`` goes through ``nc.request``: a NUID token, a future with a done-callback, an
``asyncio.wait_for`` around it, and a ``PubAck`` dataclass built by introspection. On the
workflow engine's hot path (several acked writes per workflow) that machinery cost as much as
the rest of the write; a KV read (``kv.get``) adds a header parser, a raw-message object and an
exception for a missing key. :class:`JsClient` does the same exchanges with one wildcard reply
subscription, a future per request and one timer for all of them (their deadlines, in order:
:meth:`JsClient._expect`), pydantic's parser on an ack, and ``None`` for a missing key.

It raises what nats-py raises, so :mod:`reach_mesh._retry` classifies the errors the same way:
``NoStreamResponseError`` (no stream took it: 503), ``nats.errors.TimeoutError``,
``KeyWrongLastSequenceError`` for a KV compare-and-set that lost (JetStream error codes 10071,
10164), and ``APIError.from_error`` for any other error answer.

Messages nobody waits on (workflow events, acks of work already answered) can go
:meth:`JsClient.later`: they leave with the client's next request, or ``linger`` seconds later
at the latest. Under load every write to the socket wakes the server, and at a moderate rate
most writes carry one message; riding along costs such a message no write of its own.

Reply tokens are random (``_batch.reply_token``): the reply subject travels with the message,
and parties allowed to answer into a hub's inbox must not guess the next one.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Final

import nats.errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js.errors import (
    APIError,
    KeyWrongLastSequenceError,
    NoStreamResponseError,
)
from pydantic_core import from_json

from reach_mesh._batch import private_inbox, reply_token
from reach_mesh._inline import subscribe_inline
from reach_mesh._kv import (
    entry_at_leader,
    entry_at_quorate_leader,
    kv_marker,
    kv_stream,
    kv_subject,
    not_caught_up,
)
from reach_mesh._nats_asking import Reconnects, reconnects_of
from reach_mesh.errors import MeshUnavailableError

__all__ = [
    "Ack",
    "JsClient",
    "first_done",
]

log = logging.getLogger("reach_mesh.jspub")

#: How long a message given to :meth:`JsClient.later` waits for a request to ride along with.
LINGER: Final = 0.005

#: How long one request waits for its answer by default. Every caller retries a timeout (a
#: publish carries a ``Nats-Msg-Id``, a KV write is a compare-and-set that tells a lost answer
#: from a lost race: ``hub/_durable.py``), and an answer lost with a NATS node that died is
#: waited for this long before the retry: 3 s is many times what a loaded server takes.
REQUEST_TIMEOUT: Final = 3.0

#: A direct get is answered by any replica of the stream, picked by the server, and a replica
#: on a node that froze (a stalled VM, SIGSTOP, a partition without a reset) may still take
#: some until the cluster drops its routes to it, seconds later. A direct get not answered
#: within this long is asked again, and again after each such wait, while the earlier tries
#: may still answer (an answer takes well under a millisecond). The server hands each try to a
#: replica at random, so a read is lost only if every try goes to the frozen one: with one of
#: three frozen, about (1/3)**12 for a read of 3 s. (A wait doubling after each try gave four
#: tries in 3 s, and a CI run lost a read whose four all went to the frozen replica.)
HEDGE_AFTER: Final = 0.25
#: At most this many of one client's direct gets are being asked again at a time, each a try
#: every ``HEDGE_AFTER`` (so at most 64 tries a second more, per client): a server or an event
#: loop too busy to answer within ``HEDGE_AFTER`` is not sent much more work. A read holds one
#: of them, however many tries it sends, so that one read nobody answers does not take all.
HEDGES_MAX: Final = 16

#: A publish given to :meth:`JsClient.publish_hedged` not answered within this long is sent
#: again (and again after each such wait): a stream without a leader drops a publish, and a
#: leader is mostly back within a second or two of losing one. An ack takes a millisecond or
#: so; a repeat is stored once (``Nats-Msg-Id``).
PUBLISH_HEDGE_AFTER: Final = 0.5
#: At most this many of one client's hedged publishes send again at a time (each a try every
#: ``PUBLISH_HEDGE_AFTER``): a leader too loaded to ack within that is not sent many more.
#: A publish past them waits for the tries it sent, and sends again once one is free.
PUBLISH_HEDGES_MAX: Final = 16
#: JetStream's "duplicate message id is in process": a publish with the same ``Nats-Msg-Id``
#: is being stored (proposed, not yet committed).
_IN_PROCESS: Final = 10158

#: JetStream's "wrong last sequence" error codes (a KV compare-and-set that lost).
_WRONG_LAST: Final = frozenset({10071, 10164})
#: The header of a KV compare-and-set: the revision the key must still be at (0: absent).
EXPECTED_LAST_SUBJECT_SEQUENCE: Final = "Nats-Expected-Last-Subject-Sequence"


@dataclass(frozen=True, slots=True)
class Ack:
    """JetStream's answer to a stored publish."""

    stream: str
    seq: int
    duplicate: bool


class JsClient:
    """Acked JetStream publishes for one connection (started and stopped with its owner)."""

    #: The event loop it was started on, asked once: on Python 3.11 every
    #: ``asyncio.get_running_loop()`` is a ``getpid`` system call.
    _loop: asyncio.AbstractEventLoop

    def __init__(
        self,
        nc: NATS,
        *,
        timeout: float = REQUEST_TIMEOUT,
        linger: float = LINGER,
        reconnects: Reconnects | None = None,
    ) -> None:
        """``reconnects``: ``nc``'s, when it keeps none itself (``_nats_asking.ReconnectWatch``)."""
        self._nc = nc
        self._reconnects = reconnects if reconnects is not None else reconnects_of(nc)
        self._js = nc.jetstream(timeout=timeout)
        self._timeout = timeout
        self._linger = linger
        self._prefix = private_inbox(nc) + "."
        self._futures: dict[str, asyncio.Future[Msg]] = {}
        self._sub: Subscription | None = None
        #: Messages given to ``later`` not sent yet, and the timer that sends them.
        self._later: list[tuple[str, bytes, dict[str, str] | None]] = []
        self._later_timer: asyncio.TimerHandle | None = None
        self._later_task: asyncio.Task[None] | None = None
        #: Direct gets being asked again, not answered yet (``_direct_get``).
        self._hedging = 0
        #: Publishes being sent again, not answered yet (``publish_hedged``).
        self._publish_hedging = 0
        #: Acked publishes waiting for their acks: ended by a reconnection (``_on_reconnect``).
        self._publishing: dict[str, asyncio.Future[Msg]] = {}
        #: When requests time out, oldest first (deadline, reply token), and the one timer
        #: that expires them (``_expect``).
        self._deadlines: deque[tuple[float, str]] = deque()
        self._deadline_timer: asyncio.TimerHandle | None = None
        #: When hedged publishes not answered by then send again (time, reply token of their
        #: first try), oldest first, and the one timer that wakes them (``_hedge_due``).
        self._hedges: deque[tuple[float, str]] = deque()
        self._hedge_timer: asyncio.TimerHandle | None = None

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        # Answers are taken as they are read (``reach_mesh/_inline.py``): one pass of the loop
        # less between an ack and the code that waits on it, which is on a workflow's critical
        # path (a record's write before its steps go out, a chain's task record before its
        # next step).
        self._sub = await subscribe_inline(self._nc, self._prefix + "*", self._on_ack)
        reconnects = self._reconnects
        if reconnects is not None:
            reconnects.listeners.append(self._on_reconnect)

    async def stop(self) -> None:
        await self.flush_later()
        reconnects = self._reconnects
        if reconnects is not None and self._on_reconnect in reconnects.listeners:
            reconnects.listeners.remove(self._on_reconnect)
        if self._sub is not None:
            sub, self._sub = self._sub, None
            await sub.unsubscribe()

    def _on_reconnect(self) -> None:
        """Back on NATS: an ack sent while the connection was down is lost, and its publish
        would wait out its timeout before its caller sent it again. Every caller of
        :meth:`publish` sends a timed-out one again (``Nats-Msg-Id`` deduplicates a stream
        message, a KV compare-and-set tells a lost answer from a lost race): time them out now.
        (Direct gets are asked again every ``HEDGE_AFTER`` anyway.)"""
        waiting = [f for f in self._publishing.values() if not f.done()]
        for future in waiting:
            future.set_exception(nats.errors.TimeoutError())
        if waiting:
            log.info("reconnected to NATS: %d JetStream publish(es) sent again", len(waiting))

    def later(self, subject: str, body: bytes, headers: dict[str, str] | None = None) -> None:
        """Publish ``body`` to ``subject`` (core NATS, no answer) with the next request, or
        within ``linger`` seconds. Messages given here leave in the order given, and before
        any request made after them."""
        self._later.append((subject, body, headers))
        if self._later_timer is None:
            self._later_timer = self._loop.call_later(self._linger, self._linger_over)

    async def send(self, subject: str, body: bytes, headers: dict[str, str] | None = None) -> None:
        """Publish ``body`` to ``subject`` (core NATS, no answer) now, after everything
        :meth:`later` holds (so that it leaves behind them, in order). Raises what nats-py
        raises when the connection cannot take it (closed, draining, its buffer full while
        reconnecting): unlike :meth:`later`'s, somebody depends on this one.

        Returns once it is written to the socket, not merely queued: nats-py's flusher, woken
        by the publish, writes in a later pass of the loop, and the caller's code after this
        (a workflow's own end, the submission's ack) would otherwise run first, on the
        critical path of whoever waits for the message. One pass is all it takes (the
        flusher's wake-up is queued ahead of ours), unless the socket pushes back."""
        self.later(subject, body, headers)
        await self._flush(strict=True)
        if self._nc.pending_data_size:
            await asyncio.sleep(0)

    def ack_later(self, msg: Msg) -> None:
        """Ack a JetStream message (an empty publish on its reply subject, as ``msg.ack()``
        sends) through :meth:`later`: for acks nothing waits on. The message counts as acked
        from now on (``is_acked``), as after ``msg.ack()``: nats-py refuses to ack or nak it
        again."""
        if msg.is_acked:
            return
        if msg.reply:
            self.later(msg.reply, b"")
        msg._ackd = True

    async def flush_later(self) -> None:
        """Send what :meth:`later` holds now. A failure is logged: nobody waits on these."""
        await self._flush(strict=False)

    async def _flush(self, *, strict: bool) -> None:
        if self._later_timer is not None:
            self._later_timer.cancel()
            self._later_timer = None
        out, self._later = self._later, []
        try:
            for subject, body, headers in out:
                await self._nc.publish(subject, body, headers=headers)
        except Exception as err:  # a closed connection; nats-py buffers through reconnects
            log.warning("%d queued message(s) not sent: %r", len(out), err)
            if strict:
                raise

    def _linger_over(self) -> None:
        self._later_timer = None
        if not self._later:
            return
        if self._later_task is not None and not self._later_task.done():
            # Still sending the previous lot: these go next.
            self._later_timer = self._loop.call_later(self._linger, self._linger_over)
            return
        self._later_task = asyncio.ensure_future(self.flush_later())

    async def request(
        self,
        subject: str,
        body: bytes,
        headers: dict[str, str] | None = None,
        *,
        timeout: float | None = None,
    ) -> Msg:
        """Send ``body`` to ``subject``; the answer. ``nats.errors.TimeoutError`` without one."""
        return await self._request(subject, body, headers, timeout, publish=False)

    async def _request(
        self,
        subject: str,
        body: bytes,
        headers: dict[str, str] | None,
        timeout: float | None,
        *,
        publish: bool,
    ) -> Msg:
        if self._sub is None or self._later:  # (no coroutine made for the common case)
            await self._before_request()
        token, future, timer = self._expect(self._timeout if timeout is None else timeout)
        if publish:
            self._publishing[token] = future
        try:
            await self._nc.publish(subject, body, reply=self._prefix + token, headers=headers)
            return await future
        finally:
            self._forget(token, timer)
            if publish:
                del self._publishing[token]

    async def _before_request(self) -> None:
        if self._sub is None:
            raise nats.errors.ConnectionClosedError
        if self._later:
            await self.flush_later()  # they ride along: one write to the socket for all

    def _expect(
        self, timeout: float
    ) -> tuple[str, asyncio.Future[Msg], asyncio.TimerHandle | None]:
        """A reply token, the future its answer resolves, and the timer that expires it —
        None when the client's one timer does (``_expire_due``).

        Requests mostly time out in the order they are made (most wait the client's
        ``timeout``): a deadline not before the last one queued joins ``_deadlines``, which
        one timer serves, set for the oldest request still waiting. A timer of its own per
        request (``call_later``, then ``cancel`` once answered: ~4 µs) cost several per
        workflow on the hub; the answered ones leave the queue when the timer comes."""
        loop = self._loop
        token = reply_token()
        future: asyncio.Future[Msg] = loop.create_future()
        self._futures[token] = future
        at = loop.time() + timeout
        queue = self._deadlines
        if queue and at < queue[-1][0]:
            return token, future, loop.call_at(at, _expire, future)
        queue.append((at, token))
        if self._deadline_timer is None:
            self._deadline_timer = loop.call_at(queue[0][0], self._expire_due)
        return token, future, None

    def _expire_due(self) -> None:
        """Time out the queued requests whose deadline passed; drop the answered ones; set
        the timer again for the oldest one still waiting."""
        self._deadline_timer = None
        queue, futures = self._deadlines, self._futures
        now = self._loop.time()
        while queue:
            at, token = queue[0]
            future = futures.get(token)
            if future is not None and not future.done():
                if at > now:
                    self._deadline_timer = self._loop.call_at(at, self._expire_due)
                    return
                _expire(future)
            queue.popleft()

    def _forget(self, token: str, timer: asyncio.TimerHandle | None) -> None:
        if timer is not None:
            timer.cancel()
        del self._futures[token]

    async def ask(self, subject: str, body: bytes, *, timeout: float) -> Msg:
        """A plain request with this client's random reply token (an identity that sees a
        reply subject and may publish on reply subjects cannot guess the next one, as it could
        nats-py's); ``NoRespondersError`` when nobody listens on ``subject``."""
        msg = await self.request(subject, body, timeout=timeout)
        if not msg.data and (msg.headers or {}).get("Status") == "503":
            raise nats.errors.NoRespondersError
        return msg

    @property
    def reconnections(self) -> int:
        """Reconnections of its connection so far (an answer sent meanwhile is lost), as
        nats-py counts them: once made, before the connection's callbacks run."""
        return int(self._nc.stats["reconnects"])

    async def publish(
        self,
        subject: str,
        body: bytes,
        headers: dict[str, str] | None = None,
        *,
        timeout: float | None = None,
    ) -> Ack:
        """Publish ``body`` to ``subject`` and wait for the stream's ack: its caller sends it
        again on ``nats.errors.TimeoutError``, which also ends the wait at a reconnection."""
        return _ack(await self._request(subject, body, headers, timeout, publish=True))

    async def publish_hedged(
        self,
        subject: str,
        body: bytes,
        headers: dict[str, str],
        *,
        every: float = PUBLISH_HEDGE_AFTER,
        timeout: float | None = None,
    ) -> Ack:
        """:meth:`publish` of a message with a ``Nats-Msg-Id`` (a repeat is stored once), sent
        again after each ``every`` seconds without an answer while the earlier tries may still
        answer; the first ack. A stream without a leader drops a publish rather than answer
        it: a try sent once a leader is back is stored at once, where a single try would wait
        out its timeout and may miss a short span with a leader. An answer "duplicate message
        id is in process" (an earlier try is being stored) waits for the others, as does a try
        that timed out or was answered "no responders" (503: in an election, no server had
        interest in the subject yet); the last such error is raised when none is left and time
        is up. Other errors are the stream's answer: raised at once. At most
        ``PUBLISH_HEDGES_MAX`` of this client's publishes send again at a time; one past them
        waits for its tries.

        The first try is awaited as :meth:`publish`'s is, with no timer of its own: the
        client's one hedge timer (``_hedge_due``) wakes it if it is not answered within
        ``every`` (most are answered in a millisecond), and only then does it wait on several."""
        await self._before_request()
        loop = self._loop
        now = loop.time()
        deadline = now + (self._timeout if timeout is None else timeout)
        tries: dict[asyncio.Future[Msg], tuple[str, asyncio.TimerHandle | None]] = {}
        token, future, timer = self._expect(deadline - now)
        self._publishing[token] = future
        next_try = now + every
        try:
            self._hedge_at(next_try, token)
            await self._nc.publish(subject, body, reply=self._prefix + token, headers=headers)
            return _ack(await future)
        except _HedgeDue:
            # Not answered within ``every``: ``_futures[token]`` is a new future its answer
            # still resolves (maybe already has); wait on it with the tries sent from now on.
            fresh = self._futures[token]
            if timer is not None:
                timer.cancel()
                timer = loop.call_at(deadline, _expire, fresh)
            tries[fresh] = (token, timer)
        except APIError as err:
            if getattr(err, "err_code", None) != _IN_PROCESS:
                raise
            tries[future] = (token, timer)  # (its error kept; the next try at ``next_try``)
        except (nats.errors.TimeoutError, NoStreamResponseError):
            tries[future] = (token, timer)
        finally:
            if not tries:
                self._forget(token, timer)
                del self._publishing[token]
                if future.done() and not future.cancelled():
                    future.exception()  # (a ``_HedgeDue`` nobody awaited: not logged)
        return await self._hedge_on(subject, body, headers, tries, every, next_try, deadline)

    def _hedge_at(self, at: float, token: str) -> None:
        """Wake the hedged publish whose first try is ``token`` at ``at`` if it is not
        answered by then (``_hedge_due``)."""
        queue = self._hedges
        if queue and at < queue[-1][0]:  # (an ``every`` shorter than the last one's)
            self._loop.call_at(at, self._hedge_one, token)
            return
        queue.append((at, token))
        if self._hedge_timer is None:
            self._hedge_timer = self._loop.call_at(queue[0][0], self._hedge_due)

    def _hedge_due(self) -> None:
        """Wake the hedged publishes due to send again; drop the answered ones; set the timer
        again for the oldest one still waiting."""
        self._hedge_timer = None
        queue = self._hedges
        now = self._loop.time()
        while queue:
            at, token = queue[0]
            if at > now:
                future = self._futures.get(token)
                if future is not None and not future.done():
                    self._hedge_timer = self._loop.call_at(at, self._hedge_due)
                    return
            else:
                self._hedge_one(token)
            queue.popleft()

    def _hedge_one(self, token: str) -> None:
        """Wake the hedged publish waiting on ``token``'s answer, if it still waits: its
        future ends with ``_HedgeDue``, and a new one takes its place under the same token
        (the answer still resolves it; the deadline queue and a reconnection end it)."""
        future = self._futures.get(token)
        if future is None or future.done():
            return
        fresh: asyncio.Future[Msg] = self._loop.create_future()
        self._futures[token] = fresh
        if token in self._publishing:
            self._publishing[token] = fresh
        future.set_exception(_HedgeDue())

    async def _hedge_on(
        self,
        subject: str,
        body: bytes,
        headers: dict[str, str],
        tries: dict[asyncio.Future[Msg], tuple[str, asyncio.TimerHandle | None]],
        every: float,
        next_try: float,
        deadline: float,
    ) -> Ack:
        """:meth:`publish_hedged` past its first try: a try sent again at ``next_try`` and
        after each ``every`` without an answer, all awaited, the first ack returned. An answer
        already in hand is taken before anything is sent."""
        loop = self._loop
        failed: BaseException | None = None
        hedging = False  # this publish holds one of the ``PUBLISH_HEDGES_MAX``
        try:
            while True:
                for future in [f for f in tries if f.done()]:
                    token, timer = tries.pop(future)
                    self._forget(token, timer)
                    self._publishing.pop(token, None)
                    try:
                        return _ack(future.result())
                    except APIError as err:
                        if getattr(err, "err_code", None) != _IN_PROCESS:
                            raise
                        failed = err
                    except (nats.errors.TimeoutError, NoStreamResponseError) as err:
                        failed = err
                now = loop.time()
                if not tries and max(now, next_try) >= deadline:
                    raise failed if failed is not None else nats.errors.TimeoutError()
                if tries and not hedging and now >= next_try:
                    if self._publish_hedging < PUBLISH_HEDGES_MAX:
                        hedging = True
                        self._publish_hedging += 1
                    else:
                        next_try = now + every  # (asked again for a free one then)
                if now < deadline and now >= next_try and (hedging or not tries):
                    token, future, timer = self._expect(deadline - now)
                    tries[future] = (token, timer)
                    self._publishing[token] = future
                    await self._nc.publish(
                        subject, body, reply=self._prefix + token, headers=headers
                    )
                    next_try = now + every
                waiting = [f for f in tries if not f.done()]
                if waiting or next_try < deadline:
                    pause = next_try - loop.time() if next_try < deadline else None
                    await first_done(loop, waiting, pause)
        finally:
            if hedging:
                self._publish_hedging -= 1
            for future, (token, timer) in tries.items():
                self._forget(token, timer)
                self._publishing.pop(token, None)
                future.cancel()

    async def kv_get(self, bucket: str, key: str) -> tuple[bytes, int] | None:
        """The value and revision of ``key`` (a direct get, answered by any replica; asked
        again when one does not answer soon: ``HEDGE_AFTER``); None when it does not exist,
        was deleted, or is empty."""
        got = await self.kv_entry(bucket, key)
        if got is None or got[2]:
            return None
        return got[0], got[1]

    async def kv_entry(self, bucket: str, key: str) -> tuple[bytes, int, bool] | None:
        """What :meth:`kv_get` reads, delete and purge markers included: the value, the
        revision and whether it is such a marker; None when there is no message or it is
        empty."""
        got = await self._kv_message(bucket, key)
        return None if got is None else (got[0].data, _revision(got[0]), got[1])

    async def kv_get_stored(self, bucket: str, key: str) -> tuple[bytes, int, float | None] | None:
        """What :meth:`kv_get` reads, with when the server stored it (its clock, epoch
        seconds: the answer's ``Nats-Time-Stamp``; None if it does not say)."""
        got = await self._kv_message(bucket, key)
        if got is None or got[1]:
            return None
        msg = got[0]
        return msg.data, _revision(msg), _stored_time(msg)

    async def _kv_message(self, bucket: str, key: str) -> tuple[Msg, bool] | None:
        """A direct get's answer for ``key`` and whether it is a delete or purge marker; None
        when there is no message or it is empty."""
        msg = await self._direct_get(
            f"$JS.API.DIRECT.GET.{kv_stream(bucket)}.{kv_subject(bucket, key)}"
        )
        headers = msg.headers or {}
        marker = kv_marker(headers)
        if not msg.data and not marker:
            status = headers.get("Status")
            if status == "404" or not status:
                return None
            if status == "503":
                raise NoStreamResponseError
            APIError.from_msg(msg)  # raises
        return msg, marker

    async def kv_entry_at_leader(self, bucket: str, key: str) -> tuple[bytes, int, bool] | None:
        """What :meth:`kv_entry` reads, as the stream's leader has it: not a replica that may
        lag behind a write, so what a compare-and-set on ``key`` is decided by. None when there
        is no message. A "not found" of the stream itself (being recovered: it knows nothing,
        and "no such key" would be a wrong answer) propagates."""
        return await entry_at_leader(self._js, bucket, key)

    async def kv_entry_at_quorate_leader(
        self, bucket: str, key: str, *, heard_within: float
    ) -> tuple[bytes, int, bool] | None:
        """:meth:`kv_entry_at_leader`, once the stream's leader (its ``STREAM.INFO``) says it
        heard from a quorum of its replicas within ``heard_within`` s: not a leader cut off
        from them, which keeps leading and answering from what it had, for some ten seconds,
        while the others elect another and write past it. ``MeshUnavailableError`` (or what
        JetStream raised) otherwise."""
        return await entry_at_quorate_leader(self._js, bucket, key, heard_within=heard_within)

    async def replicas_caught_up(self, bucket: str, *, heard_within: float) -> None:
        """Return once the stream's leader says every replica that may answer a direct get
        has what the leader has: its ``STREAM.INFO`` (which the leader answers) shows a leader
        that heard from a quorum of its replicas within ``heard_within`` s — not one cut off
        from them, which keeps leading, and answering, for some ten seconds — and every
        replica not offline current (its log holds every entry the leader had applied). A
        direct get made after it reads what the leader had applied then (give or take a
        follower applying the last entries it stored). Raises ``MeshUnavailableError`` (or
        what ``STREAM.INFO`` raises: no leader) otherwise.

        Not the leader's ``STREAM.MSG.GET`` (:meth:`kv_entry_at_leader`): its subject does not
        name the key, and an agent may read its own namespace's keys only (``_auth.py``). Nor
        a direct get's ``min_last_seq`` (the read-after-write ADR): nats-server 2.15 ignores
        it."""
        stream = kv_stream(bucket)
        info = await self._js.stream_info(stream)
        cluster = info.cluster
        behind = not_caught_up(cluster, heard_within) if cluster is not None else None
        if behind is not None:
            raise MeshUnavailableError(f"{stream}: {behind}")

    async def _direct_get(self, subject: str) -> Msg:
        """The first answer to a direct get on ``subject``, asked again after
        ``HEDGE_AFTER`` (and again after each such wait) without one, until this client's timeout
        (if fewer than ``HEDGES_MAX`` other reads are being asked again). Of answers that came
        together, the newest revision. (Futures, not a task per try: this is on the readers'
        hot paths.)"""
        await self._before_request()
        loop = self._loop
        deadline = loop.time() + self._timeout
        tries: dict[asyncio.Future[Msg], tuple[str, asyncio.TimerHandle | None]] = {}
        hedging = False  # this read holds one of the ``HEDGES_MAX``
        try:
            while True:
                left = deadline - loop.time()
                if tries and left > 0 and not hedging and self._hedging < HEDGES_MAX:
                    hedging = True
                    self._hedging += 1
                if not tries or (left > 0 and hedging):
                    token, future, timer = self._expect(left)
                    tries[future] = (token, timer)
                    await self._nc.publish(subject, b"", reply=self._prefix + token)
                # Every try ends by the deadline: past the last hedge, wait for the first.
                await first_done(loop, tries, HEDGE_AFTER if left > HEDGE_AFTER else None)
                done = [f for f in tries if f.done()]
                if done:
                    answered = [f.result() for f in done if f.exception() is None]
                    if not answered:
                        return done[0].result()  # raises (every try ends alike)
                    return answered[0] if len(answered) == 1 else max(answered, key=_revision)
        finally:
            if hedging:
                self._hedging -= 1
            for future, (token, timer) in tries.items():
                self._forget(token, timer)
                future.cancel()

    async def kv_write(self, bucket: str, key: str, value: bytes, last: int) -> int:
        """Write ``key`` if it is still at revision ``last`` (0: if it does not exist); the new
        revision. ``KeyWrongLastSequenceError`` when it is not."""
        ack = await self.publish(
            kv_subject(bucket, key), value, {EXPECTED_LAST_SUBJECT_SEQUENCE: str(last)}
        )
        return ack.seq

    def _on_ack(self, msg: Msg) -> None:
        future = self._futures.get(msg.subject[len(self._prefix) :])
        if future is not None and not future.done():
            future.set_result(msg)


async def first_done(
    loop: asyncio.AbstractEventLoop, futures: Iterable[asyncio.Future[Any]], timeout: float | None
) -> None:
    """Return when one of ``futures`` is done, or after ``timeout``: a lighter
    ``asyncio.wait`` (no sets built per call) for a read whose first try mostly ends at once."""
    waiter: asyncio.Future[None] = loop.create_future()

    def wake(_: object = None) -> None:
        if not waiter.done():
            waiter.set_result(None)

    if any(future.done() for future in futures):
        return
    for future in futures:
        future.add_done_callback(wake)
    timer = None if timeout is None else loop.call_later(timeout, wake)
    try:
        await waiter
    finally:
        if timer is not None:
            timer.cancel()
        for future in futures:
            future.remove_done_callback(wake)


def _revision(msg: Msg) -> int:
    """The stream sequence of a direct get's answer (0: a status, no message)."""
    return int((msg.headers or {}).get("Nats-Sequence") or 0)


def _stored_time(msg: Msg) -> float | None:
    """When the server stored the message a direct get answered with (its clock, epoch
    seconds: ``Nats-Time-Stamp``, RFC 3339); None when the header is missing or unreadable."""
    stamp = (msg.headers or {}).get("Nats-Time-Stamp")
    if not stamp:
        return None
    try:
        return datetime.fromisoformat(stamp).timestamp()
    except ValueError:
        return None


class _HedgeDue(Exception):
    """A hedged publish's first try was not answered within its ``every``
    (``JsClient._hedge_one``): it sends again."""


def _expire(future: asyncio.Future[Msg]) -> None:
    if not future.done():
        future.set_exception(nats.errors.TimeoutError())


def _ack(msg: Msg) -> Ack:
    if not msg.data:
        headers = msg.headers or {}
        if headers.get("Status") == "503":
            raise NoStreamResponseError
        raise APIError(code=int(headers.get("Status") or 0) or None, description="empty answer")
    try:
        body = from_json(msg.data)  # (a fifth of json.loads' time on bytes: one per ack)
    except ValueError as err:
        raise APIError(description=f"unreadable JetStream ack: {msg.data[:80]!r}") from err
    error = body.get("error")
    if error is not None:
        if error.get("err_code") in _WRONG_LAST:
            raise KeyWrongLastSequenceError(description=error.get("description"))
        APIError.from_error(error)  # raises the matching APIError subclass
    return Ack(str(body.get("stream", "")), int(body.get("seq", 0)), bool(body.get("duplicate")))
