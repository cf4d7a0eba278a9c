"""JetStream writes that survive the infrastructure: retried with backoff, never an outcome.

A NATS node dying, a raft election, a slow KV write — for a few seconds JetStream answers
``NoStreamResponseError``, 503 or nothing at all. None of that says anything about a task, so
the workflow engine retries such operations (:func:`transient` tells which errors qualify)
until the deadline it is given; only then does the error escape, and the caller hands the
whole workflow back to JetStream (``nak``) instead of recording an outcome.

Retrying a write is only safe when a repeat is harmless:

- stream publishes carry a ``Nats-Msg-Id``, so JetStream drops the repeat;
- a KV compare-and-set (:func:`cas`, :func:`create`) may have been applied although its answer
  was lost: when the repeat is refused for a wrong revision, the key is read back, and if it
  holds exactly the bytes we wrote, the first write succeeded.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Final, TypeVar

import nats.errors
import nats.js.errors
from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError
from nats.js.kv import KeyValue

__all__ = ["RetriesExhausted", "cas", "create", "get", "retrying", "transient"]

log = logging.getLogger("reach_mesh.hub.workflows")

T = TypeVar("T")

_FIRST_DELAY: Final = 0.05
_MAX_DELAY: Final = 2.0
#: JetStream API error codes that mean "the cluster cannot answer right now".
_UNAVAILABLE_CODES: Final = frozenset({408, 500, 503})

_TRANSIENT: Final = (
    nats.errors.TimeoutError,  # also FlushTimeoutError, nats.js FetchTimeoutError
    asyncio.TimeoutError,
    nats.errors.NoRespondersError,
    nats.errors.ConnectionClosedError,
    nats.errors.ConnectionReconnectingError,
    nats.errors.StaleConnectionError,
    nats.errors.OutboundBufferLimitError,
    nats.js.errors.NoStreamResponseError,
    nats.js.errors.ServiceUnavailableError,
    nats.js.errors.ServerError,
    ConnectionError,
)


class RetriesExhausted(Exception):
    """An infrastructure error outlived the deadline of the operation; ``__cause__`` is it."""


def transient(err: BaseException) -> bool:
    """True for errors of the infrastructure (retry), False for answers (act on them)."""
    if isinstance(err, KeyWrongLastSequenceError | KeyNotFoundError):
        return False
    if isinstance(err, _TRANSIENT):
        return True
    return isinstance(err, nats.js.errors.APIError) and err.code in _UNAVAILABLE_CODES


async def retrying(
    what: str,
    op: Callable[[], Awaitable[T]],
    deadline: float,
    *,
    on_retry: Callable[[], None] | None = None,
) -> T:
    """``await op()``, again after each transient error (backoff 50 ms doubling to 2 s) until
    ``deadline`` (event-loop time); then :class:`RetriesExhausted`. Other errors propagate."""
    loop = asyncio.get_running_loop()
    delay = _FIRST_DELAY
    while True:
        try:
            return await op()
        except Exception as err:
            if not transient(err):
                raise
            left = deadline - loop.time()
            if left <= 0:
                raise RetriesExhausted(f"{what}: {err!r}") from err
            log.info("%s: %r; retrying", what, err)
            if on_retry is not None:
                on_retry()
            await asyncio.sleep(min(delay, left))
            delay = min(delay * 2, _MAX_DELAY)


async def get(kv: KeyValue, key: str) -> tuple[bytes, int] | None:
    """The value and revision of ``key``; None when it does not exist or was deleted."""
    try:
        entry = await kv.get(key)
    except KeyNotFoundError:
        return None
    if not entry.value:
        return None
    return entry.value, int(entry.revision or 0)


class _Write:
    """One compare-and-set, retried: tells a lost answer from a lost race."""

    def __init__(self, kv: KeyValue, key: str, data: bytes, last: int) -> None:
        self.kv, self.key, self.data, self.last = kv, key, data, last
        self.tried = False

    async def __call__(self) -> int:
        first = not self.tried
        self.tried = True
        try:
            if self.last == 0:
                return int(await self.kv.create(self.key, self.data))
            return int(await self.kv.update(self.key, self.data, last=self.last))
        except KeyWrongLastSequenceError:
            if not first:
                # Our earlier try may have landed before its answer was lost.
                got = await get(self.kv, self.key)
                if got is not None and got[0] == self.data:
                    return got[1]
            raise


async def cas(
    kv: KeyValue,
    key: str,
    data: bytes,
    last: int,
    deadline: float,
    *,
    on_retry: Callable[[], None] | None = None,
) -> int:
    """Write ``data`` if ``key`` is still at revision ``last``; the new revision. Raises
    ``KeyWrongLastSequenceError`` when somebody else wrote the key in between."""
    return await retrying(f"write {key}", _Write(kv, key, data, last), deadline, on_retry=on_retry)


async def create(
    kv: KeyValue,
    key: str,
    data: bytes,
    deadline: float,
    *,
    on_retry: Callable[[], None] | None = None,
) -> int:
    """Create ``key``; its revision. ``KeyWrongLastSequenceError`` when it exists."""
    return await cas(kv, key, data, 0, deadline, on_retry=on_retry)
