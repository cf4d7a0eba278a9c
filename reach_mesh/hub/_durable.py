"""JetStream writes that survive the infrastructure: retried with backoff, never an outcome.

A NATS node dying, a raft election, a slow KV write say nothing about a task, so the workflow
engine retries such operations (``reach_mesh._retry``) until the deadline it is given; only then
does the error escape, and the caller hands the whole workflow back to JetStream (``nak``)
instead of recording an outcome.

Retrying a write is only safe when a repeat is harmless:

- stream publishes carry a ``Nats-Msg-Id``, so JetStream drops the repeat;
- a KV compare-and-set (:func:`cas`, :func:`create`) may have been applied although its answer
  was lost: when the repeat is refused for a wrong revision, the key is read back, and if it
  holds exactly the bytes we wrote, the first write succeeded.
"""

from __future__ import annotations

from collections.abc import Callable

from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError
from nats.js.kv import KeyValue

from reach_mesh._retry import RetriesExhausted, retrying, transient

__all__ = ["RetriesExhausted", "cas", "create", "get", "retrying", "transient"]


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
