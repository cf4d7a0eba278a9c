"""Which messages a subscriber acts on: the two checks NATS permissions cannot make.

- **The reply subject.** A requester names its own reply subject, and nats-server checks it
  against nothing. A hub may publish where answers must never go (``$KV.>``, ``$JS.API.>``,
  ``reach.>``): a request asking to be answered on ``$KV.reach_agents.<id>`` would have the hub
  overwrite that agent's record with its answer. Answers go only to subjects under
  ``_INBOX.``, where every identity's replies live (``nats_inbox_prefix``); a request naming
  any other reply subject is dropped unread.
- **The subject.** A JetStream push consumer delivers stored messages to its
  ``deliver_subject``, which nats-server does not check against its creator's publish
  permissions: an agent could have its own status messages delivered to another agent's
  ``.task`` or ``.ctl`` subject. Such a message keeps the subject it was stored under, so a
  subscriber that checks the subject against its own subscription drops it.

A dropped message is counted — on the connection it came on, which its hub or agent exports as
``reach_messages_refused_total`` — and logged (``REACH-MESSAGE-REFUSED``, at most one line per
``_LOG_INTERVAL`` seconds per process); nothing answers it.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Final

from nats.aio.msg import Msg

from reach_mesh import protocol
from reach_mesh._nats import _Connection
from reach_mesh.logs import MESSAGE_REFUSED, LineBudget, get_logger, log_event

__all__ = ["guarded", "guarded_inline", "matches", "refuse", "refuse_body", "refused_total"]

log = get_logger(__name__)

_LOG_INTERVAL: Final = 30.0
_STATUS: Final = "Status"

Callback = Callable[[Msg], Awaitable[None]]


class _Refusals:
    """Messages dropped by :func:`guarded` in this process, and their log lines."""

    def __init__(self) -> None:
        self.total = 0
        self._lines = LineBudget(_LOG_INTERVAL)

    def note(self, nc: object, subject: str, reply: str, why: str) -> None:
        self.total += 1
        # And on the connection it came on: each hub and agent exports its own count.
        if isinstance(nc, _Connection):
            nc.messages_refused += 1
        held = self._lines.take()
        if held is None:
            return
        log_event(
            log,
            MESSAGE_REFUSED,
            f"message on {subject} dropped unread: {why} "
            f"({held + 1} dropped since the last such line)",
            subject=subject,
            reply=reply,
            why=why,
            count=held + 1,
        )


_refusals = _Refusals()


def refuse(msg: Msg, why: str) -> None:
    """Count and log (rate-limited) ``msg`` as dropped unread, for ``why``."""
    _refusals.note(msg._client, msg.subject, msg.reply, why)


def refuse_body(nc: object, subject: str, why: str) -> None:
    """Count (on ``nc``, the connection it came on) and log a message that came on
    ``subject`` — live, or read back from a stream — as dropped: its body is not the
    protocol's message for that subject (``why`` says what is wrong first)."""
    _refusals.note(nc, subject, "", why)


def refused_total() -> int:
    """Messages dropped in this process so far (:func:`guarded` callbacks and
    :func:`refuse` callers: pull consumers, ``.done`` waits)."""
    return _refusals.total


def matches(tokens: list[str], subject: str) -> bool:
    """Whether ``subject`` matches a subscription's subject, given as its ``.``-split tokens
    (``*`` one token, ``>`` one or more at the end)."""
    parts = subject.split(".")
    for i, token in enumerate(tokens):
        if token == ">":
            return len(parts) > i
        if i >= len(parts) or (token != "*" and token != parts[i]):
            return False
    return len(parts) == len(tokens)


def _matcher(subscription: str) -> Callable[[str], bool]:
    """A test of subjects against ``subscription``, as cheap as its shape allows (this runs on
    every message of the route and status paths)."""
    tokens = subscription.split(".")
    wild = [i for i, t in enumerate(tokens) if t in ("*", ">")]
    if not wild:
        return subscription.__eq__
    if wild == [len(tokens) - 1] and tokens[-1] == ">":
        prefix = subscription[:-1]  # "a.b." for "a.b.>": at least one more token
        return lambda subject: subject.startswith(prefix) and len(subject) > len(prefix)
    if len(wild) == 1 and tokens[wild[0]] == "*":
        star = wild[0]
        pre = ".".join([*tokens[:star], ""])  # "a.b." (or "" when * comes first)
        post = ".".join(["", *tokens[star + 1 :]])  # ".c" (or "" when * comes last)
        dots = subscription.count(".")

        def one_star(subject: str) -> bool:
            return (
                subject.startswith(pre)
                and subject.endswith(post)
                and subject.count(".") == dots
                and len(subject) > len(pre) + len(post)
            )

        return one_star
    return lambda subject: matches(tokens, subject)


def guarded(subscription: str, cb: Callback, *, answers: bool = True) -> Callback:
    """``cb`` for the messages of ``subscription`` whose subject matches it and — when ``cb``
    may answer (``answers``) — whose reply subject, if any, is an inbox. Others are dropped,
    and so are the empty status messages (idle heartbeats, flow control) that a push consumer
    aimed at the subject would send."""
    admits = _admission(subscription, answers=answers)

    async def on_msg(msg: Msg) -> None:
        if admits(msg):
            await cb(msg)

    return on_msg


def guarded_inline(
    subscription: str, take: Callable[[Msg], None], *, answers: bool = True
) -> Callable[[Msg], None]:
    """:func:`guarded` for a handler that does not wait: one for ``subscribe_inline``
    (``reach_mesh/_inline.py``), called as nats-py reads the message."""
    admits = _admission(subscription, answers=answers)

    def on_msg(msg: Msg) -> None:
        if admits(msg):
            take(msg)

    return on_msg


def _admission(subscription: str, *, answers: bool) -> Callable[[Msg], bool]:
    """Whether a message may reach the handler of ``subscription`` (:func:`guarded`); the
    others are refused here."""
    match = _matcher(subscription)

    def admits(msg: Msg) -> bool:
        if not match(msg.subject):
            refuse(msg, f"not a message of {subscription} (a JetStream push delivery)")
            return False
        if answers and msg.reply and not protocol.is_inbox(msg.reply):
            refuse(msg, f"reply subject {msg.reply[:80]!r} is not under _INBOX.")
            return False
        if not msg.data and msg.headers and _STATUS in msg.headers:
            refuse(msg, "a status message (a JetStream push consumer's)")
            return False
        return True

    return admits
