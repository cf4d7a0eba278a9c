"""The subjects NATS refused a connection (permissions, secure mode), told at once to whoever
waits on one instead of its request's timeout, and the typed error for them."""

from __future__ import annotations

import asyncio
import re
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from typing import Any, Final, TypeVar

from nats.aio.client import Client as NATS

from reach_mesh.errors import NotPermittedError

__all__ = [
    "Refusals",
    "not_permitted",
    "refusals_of",
    "refused_first",
    "refused_since",
    "refused_subject",
    "unless",
]

T = TypeVar("T")

#: The server's words for a subject this identity may not use (``-ERR``, handed to error_cb).
_REFUSED_RE: Final = re.compile(
    r'permissions violation for (publish|subscription) to "([^"]+)"', re.IGNORECASE
)
#: Refused subjects remembered per connection (the newest).
_REFUSALS_KEPT: Final = 256
#: What to do about a refusal, in a message meant for whoever runs a command.
_REFUSED_HINT: Final = (
    "operator commands (cordon, remove, agents of every namespace, audit, ...) need the "
    "operator identity (REACH_CONFIG=<auth dir>/operator.admin.yaml); a caller identity acts "
    "in its own namespace only: name it (reach-mesh agents --namespace <ns>; docs/security.md)"
)

#: A caller's own subjects of a namespace (routes, workflow submissions): refused, the
#: identity is another namespace's caller, or no caller at all.
_CALLER_SUBJECT_RE: Final = re.compile(
    r"^reach\.(?:hub\.([a-z0-9_-]+)\.route(?:_batch)?|wf\.([a-z0-9_-]+)\.submit)$"
)


def _refused_hint(subject: str) -> str:
    """What to do about a refused ``subject``: routes and submissions need a caller identity
    of their namespace; anything else is most often an operator command."""
    m = _CALLER_SUBJECT_RE.match(subject.lower())
    if m is None:
        return _REFUSED_HINT
    ns = m.group(1) or m.group(2)
    return (
        f"a caller identity routes and submits workflows in its own namespace only: for "
        f"namespace {ns!r}, run as its caller (REACH_CONFIG=<auth dir>/caller.{ns}.yaml; "
        f"`reach-mesh auth add-caller {ns}` issues one; docs/security.md)"
    )


class Refusals:
    """The subjects the server refused this connection (NATS permissions, secure mode): a
    refused publish is only an ``-ERR`` handed to the error callback, so a request on it would
    otherwise end as a timeout. Told at once to whoever waits on the subject
    (:func:`refused_first`), and kept (the newest ``_REFUSALS_KEPT``) for :meth:`since`."""

    def __init__(self) -> None:
        self._kept: OrderedDict[str, float] = OrderedDict()
        self._waiting: dict[str, list[asyncio.Future[None]]] = {}
        #: Subjects whose refusal someone waits for as an answer, not a fault (a check of
        #: what this identity may do: ``refused_first(expected=True)``): not logged.
        self._expected: dict[str, int] = {}
        #: Called with each refused subject (lower-cased, as the server names it).
        self.listeners: list[Callable[[str], None]] = []

    def note(self, subject: str) -> None:
        """The server refused this connection ``subject`` (``refused_subject``)."""
        self._kept[subject] = time.monotonic()
        self._kept.move_to_end(subject)
        while len(self._kept) > _REFUSALS_KEPT:
            self._kept.popitem(last=False)
        for fut in self._waiting.pop(subject, []):
            if not fut.done():
                fut.set_result(None)
        for listener in self.listeners:
            listener(subject)

    def since(self, t0: float, prefix: str) -> str | None:
        """A subject starting with ``prefix`` refused at monotonic time ``t0`` or later (as the
        server names it: lower-cased)."""
        prefix = prefix.lower()
        for subject, at in reversed(self._kept.items()):
            if at >= t0 and subject.startswith(prefix):
                return subject
        return None

    def wait(self, subject: str, *, expected: bool = False) -> asyncio.Future[None]:
        """A future done when ``subject`` is refused (pass it to :meth:`forget` after);
        ``expected``: its refusal is an answer, not logged meanwhile."""
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        key = subject.lower()
        self._waiting.setdefault(key, []).append(fut)
        if expected:
            self._expected[key] = self._expected.get(key, 0) + 1
        return fut

    def expects(self, subject: str | None) -> bool:
        """Whether a refusal of ``subject`` (as the server names it) is waited for as an
        answer."""
        return subject is not None and subject in self._expected

    def forget(self, subject: str, fut: asyncio.Future[None], *, expected: bool = False) -> None:
        key = subject.lower()
        waiting = self._waiting.get(key)
        if waiting is not None and fut in waiting:
            waiting.remove(fut)
            if not waiting:
                del self._waiting[key]
        if expected:
            left = self._expected.get(key, 0) - 1
            if left > 0:
                self._expected[key] = left
            else:
                self._expected.pop(key, None)


async def unless(aw: Awaitable[T], signal: asyncio.Future[Any]) -> asyncio.Future[T] | None:
    """Await ``aw`` or ``signal``, whichever is done first: ``aw`` (as a future: its result
    or error to take) when it is, None when ``signal`` came first (``aw`` is cancelled)."""
    task = asyncio.ensure_future(aw)
    either: set[asyncio.Future[Any]] = {task, signal}
    try:
        await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    if task.done():
        return task
    task.cancel()
    return None


def refused_subject(text: str) -> str | None:
    """The subject a permissions violation of the server names (its text, as nats-py hands it
    over), lower-cased as the server writes it; None when it names none."""
    m = _REFUSED_RE.search(text)
    return None if m is None else m.group(2).lower()


def refusals_of(nc: NATS) -> Refusals | None:
    """The refusals a connection made by :func:`connect` keeps (None for another one)."""
    got = getattr(nc, "refusals", None)
    return got if isinstance(got, Refusals) else None


def refused_since(nc: NATS, t0: float, prefix: str) -> str | None:
    """A subject starting with ``prefix`` that NATS refused ``nc`` since ``t0`` (monotonic):
    what a request that timed out may have been refused (None: nothing, or not known)."""
    refusals = refusals_of(nc)
    return None if refusals is None else refusals.since(t0, prefix)


def not_permitted(subject: str) -> NotPermittedError:
    """The error for a subject the server refused this identity."""
    return NotPermittedError(
        f"NATS refused this identity the subject {subject!r} (permissions violation): "
        f"{_refused_hint(subject)}",
        subject=subject,
    )


async def refused_first(nc: NATS, subject: str, aw: Awaitable[T], *, expected: bool = False) -> T:
    """Await ``aw`` (a request published on ``subject``), or raise :class:`NotPermittedError`
    as soon as the server refuses this connection ``subject`` — instead of the request's
    timeout, long after. ``expected``: the refusal is an answer (a check of what this
    identity may do), not a fault to log. Not for hot paths: a future and a task per call."""
    refusals = refusals_of(nc)
    if refusals is None:
        return await aw
    refused = refusals.wait(subject, expected=expected)
    try:
        done = await unless(aw, refused)
    finally:
        refusals.forget(subject, refused, expected=expected)
    if done is None:
        raise not_permitted(subject)
    return done.result()
