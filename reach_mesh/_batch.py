"""Requests sent in batches: what a ``Client`` with many requests outstanding does.

The requests a client makes to one destination in one pass of its event loop (say, two hundred
coroutines each awaiting ``request()``) leave together when the pass ends: one message on the
destination's batch subject with one line per request, ``<reply subject> <traceparent> <body>``
— route requests to ``reach.hub.<ns>.route_batch``, task envelopes (direct mode) to
``reach.agent.<id>.batch`` for agents that take batches (docs/protocol.md). A request alone in
its pass goes as a plain request. Nothing waits for a batch to fill.

Replies come to this client's own subjects, ``<inbox>.<batch token>.<index>`` per request (or
several at once, one line each, to ``<inbox>.<batch token>``), and resolve one future each.
NATS' "no responders" on a batch fails its requests with ``NoRespondersError``, as a plain
request would; a responder that does not take batches looks the same, so after one such answer
the client sends plain requests to that destination for a minute. Answers sent while the
connection was down are lost: after a reconnection the requests sent before it and still
unanswered are asked again, alone (``resend``).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Final

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError

from reach_mesh import protocol
from reach_mesh._nats import not_permitted, refusals_of
from reach_mesh.tracing import TRACEPARENT

__all__ = [
    "BATCH_BYTES",
    "BATCH_ITEMS",
    "AnswerBatcher",
    "Batcher",
    "NoRespondersOnResend",
    "inbox_prefix",
    "reply_token",
]


class NoRespondersOnResend(NoRespondersError):
    """Nobody listens on the subject of a request asked again after a reconnection
    (:meth:`Batcher.resend`): unlike a first send's, this says nothing of whether the first
    one was delivered — a task envelope may be in its agent's hands."""


#: Most requests in one batch message, and most bytes of bodies in it (hubs, agents, clients).
BATCH_ITEMS: Final = 64
BATCH_BYTES: Final = 256 * 1024
#: How long a client sends plain requests to a destination after a batch there found nobody.
_PLAIN_FOR: Final = 60.0

log = logging.getLogger("reach_mesh.batch")


def private_inbox(nc: NATS) -> str:
    """A subject of ``nc``'s inbox space for replies to it: its inbox prefix and 64 random
    bits. Not nats-py's ``new_inbox()``: its NUIDs come from one generator, so an identity that
    sees one of them (agents see where they answer) could follow it to the reply subjects of
    nats-py's own requests, whose answers it may publish to (docs/security.md)."""
    return f"{inbox_prefix(nc)}.{reply_token()}"


def inbox_prefix(nc: NATS) -> str:
    """``nc``'s inbox prefix (``_INBOX``, or the identity's own in secure mode), no dot."""
    return nc.new_inbox().rpartition(".")[0]


def reply_token() -> str:
    """64 random bits from the OS for a reply subject: an agent sees the reply subjects of the
    requests it serves and may publish on reply subjects, so the next one must not be guessable
    from those (a Mersenne Twister's would be, given enough of them; docs/security.md)."""
    return os.urandom(8).hex()


@dataclass(slots=True, eq=False)
class _Batch:
    token: str
    subject: str
    batch_subject: str
    #: (request token, body, traceparent)
    items: list[tuple[str, bytes, str]] = field(default_factory=list)
    size: int = 0


class Batcher:
    """Sends requests for one connection, batched per destination and pass of the loop."""

    def __init__(self, nc: NATS) -> None:
        self._nc = nc
        self._prefix = private_inbox(nc) + "."
        self._prefix_b = self._prefix.encode()
        self._futures: dict[str, asyncio.Future[bytes]] = {}
        self._open: dict[str, _Batch] = {}
        self._full: list[_Batch] = []
        self._sender: asyncio.Task[None] | None = None
        #: Batch subjects that found no responder lately, with when to try batches again.
        self._plain_until: dict[str, float] = {}
        #: The subject each batch token's message went to, until its first answer: a subject
        #: the server refuses this identity fails that message's requests at once
        #: (``refused``), and a batch subject NATS answers 503 for is not batched to a while.
        self._sent_on: dict[str, str] = {}
        #: Requests sent on a live connection and not answered yet, by token: (subject, body,
        #: headers — or, for one sent in a batch, its traceparent), to ask again after a
        #: reconnection (``resend``; no headers dict is made per batched request until then).
        self._unanswered: dict[str, tuple[str, bytes, dict[str, str] | str]] = {}
        #: Tokens of the requests asked again after a reconnection, until answered.
        self._resent: set[str] = set()
        self._sub: Subscription | None = None

    async def start(self) -> None:
        self._sub = await self._nc.subscribe(
            self._prefix + ">", cb=self._on_reply, pending_msgs_limit=-1
        )
        refusals = refusals_of(self._nc)
        if refusals is not None:
            refusals.listeners.append(self.refused)

    def refused(self, subject: str) -> None:
        """The server refused this identity ``subject`` (lower-cased): the requests whose
        message went there fail now with ``REACH_NOT_PERMITTED``, not at their timeout."""
        for token, sent_on in list(self._sent_on.items()):
            if sent_on.lower() != subject:
                continue
            del self._sent_on[token]
            for i in range(BATCH_ITEMS):
                future = self._futures.get(f"{token}.{i}")
                if future is not None and not future.done():
                    future.set_exception(not_permitted(sent_on))

    def _note_sent(self, token: str, subject: str) -> None:
        if len(self._sent_on) > 4096:  # answered without a reply to this token: forget
            self._sent_on.clear()
        self._sent_on[token] = subject

    async def stop(self, error: Callable[[], BaseException] | None = None) -> None:
        """Stop hearing answers; the requests still waiting for one fail now, each with an
        ``error()`` of its own (without ``error``, each waits out its timeout)."""
        refusals = refusals_of(self._nc)
        if refusals is not None and self.refused in refusals.listeners:
            refusals.listeners.remove(self.refused)
        if error is not None:
            for future in self._futures.values():
                if not future.done():
                    future.set_exception(error())
        if self._sub is not None:
            sub, self._sub = self._sub, None
            await sub.unsubscribe()

    async def request(
        self,
        subject: str,
        batch_subject: str | None,
        body: bytes,
        headers: dict[str, str],
        timeout: float,
    ) -> bytes:
        """One request to ``subject``, or in a batch to ``batch_subject`` (``None``: the
        destination takes no batches); its reply's bytes. Raises nats-py's
        ``NoRespondersError`` and ``TimeoutError`` as ``nc.request`` would."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[bytes] = loop.create_future()
        traceparent = headers.get(TRACEPARENT)
        if (
            batch_subject is None
            or traceparent is None
            or len(headers) != 1
            or len(body) >= BATCH_BYTES
            or (batch_subject in self._plain_until and self._plain(batch_subject))
        ):
            # A plain request: no batch subject, trace context that a batch line cannot
            # carry, a large body, or a destination that did not take batches lately.
            batch_token = reply_token()
            token = f"{batch_token}.0"
            self._futures[token] = future
            self._note_sent(batch_token, subject)
            if self._nc.is_connected:
                self._unanswered[token] = (subject, body, headers)
            await self._nc.publish(subject, body, reply=self._prefix + token, headers=headers)
        else:
            batch = self._open.get(batch_subject)
            if batch is not None and (
                len(batch.items) >= BATCH_ITEMS or batch.size + len(body) > BATCH_BYTES
            ):
                self._full.append(batch)
                batch = None
            if batch is None:
                batch = self._open[batch_subject] = _Batch(reply_token(), subject, batch_subject)
                if self._sender is None:
                    self._sender = loop.create_task(self._send_pass())
            token = f"{batch.token}.{len(batch.items)}"
            self._futures[token] = future
            batch.items.append((token, body, traceparent))
            batch.size += len(body)
        try:
            async with asyncio.timeout(timeout):
                return await future
        except TimeoutError as err:
            raise NatsTimeoutError from err
        finally:
            self._futures.pop(token, None)
            self._unanswered.pop(token, None)
            self._resent.discard(token)

    async def resend(self) -> int:
        """Ask again, after a reconnection, the requests sent before it and not answered:
        answers sent while this client was away are lost (NATS keeps none). Each goes alone, to
        its reply subject as before, so whichever answer comes first resolves it. Requests
        published while the connection was down are not: nats-py held them and sent them on
        reconnecting. Asking again is safe for what this batcher sends — route requests and
        task envelopes, which carry a task id: a retry of a task id goes to the agent that has
        it, whose idempotency table joins the run in hand (docs/protocol.md; each is marked
        ``Reach-Resend: 1``, so that a hub with no pin for it asks who has it first). The
        number asked."""
        asked = 0
        for token, (subject, body, sent) in list(self._unanswered.items()):
            future = self._futures.get(token)
            if future is None or future.done():
                continue
            # Marked (``Reach-Resend``): a hub with no pin for its task id asks who has it
            # before choosing an agent (agents ignore the header).
            headers = {**sent} if isinstance(sent, dict) else {TRACEPARENT: sent}
            headers[protocol.HDR_RESEND] = "1"
            try:
                await self._nc.publish(subject, body, reply=self._prefix + token, headers=headers)
            except Exception as err:  # down again: the next reconnection asks again
                log.debug("asking again after a reconnection stopped: %r", err)
                break
            self._resent.add(token)
            asked += 1
        return asked

    def _plain(self, batch_subject: str) -> bool:
        if time.monotonic() < self._plain_until[batch_subject]:
            return True
        del self._plain_until[batch_subject]
        return False

    async def _send_pass(self) -> None:
        self._sender = None
        batches = self._full
        batches.extend(self._open.values())
        self._full = []
        self._open = {}
        for batch in batches:
            try:
                await self._send(batch)
            except Exception as err:  # the connection is closing or gone
                for token, _, _ in batch.items:
                    future = self._futures.get(token)
                    if future is not None and not future.done():
                        future.set_exception(err)

    async def _send(self, batch: _Batch) -> None:
        prefix = self._prefix
        items = [item for item in batch.items if item[0] in self._futures]  # not timed out
        if self._nc.is_connected:
            unanswered = self._unanswered
            for token, body, traceparent in items:
                unanswered[token] = (batch.subject, body, traceparent)
        if len(items) == 1:
            token, body, traceparent = items[0]
            self._note_sent(batch.token, batch.subject)
            await self._nc.publish(
                batch.subject, body, reply=prefix + token, headers={TRACEPARENT: traceparent}
            )
        elif items:
            lines = [
                protocol.batch_line(prefix + token, traceparent, body)
                for token, body, traceparent in items
            ]
            self._note_sent(batch.token, batch.batch_subject)
            await self._nc.publish(
                batch.batch_subject, b"\n".join(lines), reply=prefix + batch.token
            )

    async def _on_reply(self, msg: Msg) -> None:
        token = msg.subject[len(self._prefix) :]
        data = msg.data
        headers = msg.headers
        no_responders = not data and headers is not None and headers.get("Status") == "503"
        futures = self._futures
        if "." in token:  # one request's own reply subject
            self._sent_on.pop(token.partition(".")[0], None)
            future = futures.get(token)
            if no_responders and token in self._resent and future is not None:
                if not future.done():
                    future.set_exception(NoRespondersOnResend())
                return
            self._resolve(future, data, no_responders)
            return
        batch_subject = self._sent_on.pop(token, None)
        if no_responders:  # a batch found nobody (or only responders that take no batches)
            if batch_subject is not None:
                if len(self._plain_until) > 1024:
                    self._plain_until.clear()
                self._plain_until[batch_subject] = time.monotonic() + _PLAIN_FOR
            for i in range(BATCH_ITEMS):
                self._resolve(futures.get(f"{token}.{i}"), b"", True)
            return
        for request_token, body in protocol.split_answers(data, self._prefix_b):
            self._resolve(futures.get(request_token), body, False)
        # The callers woken here send their next requests before the next batch is read.
        await asyncio.sleep(0)

    @staticmethod
    def _resolve(future: asyncio.Future[bytes] | None, data: bytes, no_responders: bool) -> None:
        if future is None or future.done():
            return  # timed out already
        if no_responders:
            future.set_exception(NoRespondersError())
        else:
            future.set_result(data)


@dataclass(slots=True, eq=False)
class _Answers:
    subject: str
    #: (reply subject, answer)
    lines: list[tuple[str, bytes]] = field(default_factory=list)
    size: int = 0


class AnswerBatcher:
    """Answers to requests that came in batches, for a hub or an agent: those ready in one pass
    of the event loop go back together, one message per batch reply subject of
    ``<reply subject> <answer>`` lines (docs/protocol.md); one answer alone goes to its own
    reply subject. Nothing waits for more answers."""

    def __init__(self, nc: NATS) -> None:
        self._nc = nc
        self._open: dict[str, _Answers] = {}
        self._full: list[_Answers] = []
        self._sender: asyncio.Task[None] | None = None

    def add(self, batch_reply: str, reply: str, body: bytes) -> bool:
        """Queue ``body`` for ``reply``; ``False`` if it is too large to share a message (then
        the caller sends it on its own)."""
        if len(body) >= BATCH_BYTES:
            return False
        group = self._open.get(batch_reply)
        if group is not None and group.size + len(body) > BATCH_BYTES:
            self._full.append(group)
            group = None
        if group is None:
            group = self._open[batch_reply] = _Answers(batch_reply)
            if self._sender is None:
                self._sender = asyncio.get_running_loop().create_task(self._send_pass())
        group.lines.append((reply, body))
        group.size += len(body)
        return True

    async def flush(self) -> None:
        """Send what is queued now (before the connection drains)."""
        await self._send_pass()

    async def _send_pass(self) -> None:
        self._sender = None
        groups = self._full
        groups.extend(self._open.values())
        self._full = []
        self._open = {}
        for group in groups:
            lines = group.lines
            try:
                if len(lines) == 1:
                    await self._nc.publish(*lines[0])
                else:
                    await self._nc.publish(group.subject, protocol.join_answers(lines))
            except Exception as err:  # the connection is closing or gone: nobody to tell
                log.debug("answers to %s not sent: %r", group.subject, err)
