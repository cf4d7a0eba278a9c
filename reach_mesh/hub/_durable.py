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

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

import nats.errors
from nats.errors import BadSubjectError, MaxPayloadError
from nats.js.errors import KeyWrongLastSequenceError

from reach_mesh._jspub import JsClient
from reach_mesh._retry import RetriesExhausted, retrying, transient

__all__ = [
    "Bucket",
    "RetriesExhausted",
    "cas",
    "create",
    "get",
    "infrastructure",
    "retrying",
    "transient",
]

#: Pauses before each read that checks whether a write whose answer was lost landed (s).
_READ_BACK: Final = (0.0, 0.1, 0.3)


def infrastructure(err: BaseException) -> bool:
    """Whether ``err`` says nothing about a workflow or its steps: the infrastructure's error
    (retried past its deadline, or not retried), or any other answer of NATS's own — a replica
    behind its leader, a write still in process during an election — which passes when the
    workflow comes back. Not a message that is always refused (``MaxPayloadError``: the size
    checks exist for it; ``BadSubjectError``: the id checks do), which would come back every
    time. Such an error hands the workflow back; it is never an outcome."""
    return (
        isinstance(err, RetriesExhausted)
        or transient(err)
        or (
            isinstance(err, nats.errors.Error)
            and not isinstance(err, (MaxPayloadError, BadSubjectError))
        )
    )


@dataclass(frozen=True, slots=True)
class Bucket:
    """A KV bucket the engine uses: reads and compare-and-sets go through the connection's
    :class:`~reach_mesh._jspub.JsClient` (hedged reads, pipelined writes)."""

    name: str
    jsc: JsClient


async def get(bucket: Bucket, key: str) -> tuple[bytes, int] | None:
    """The value and revision of ``key``; None when it does not exist or was deleted."""
    return await bucket.jsc.kv_get(bucket.name, key)


async def get_at_leader(bucket: Bucket, key: str) -> tuple[bytes, int] | None:
    """What :func:`get` reads, as the stream's leader has it (not a replica that may lag
    behind a write); None when it does not exist or was deleted."""
    entry = await bucket.jsc.kv_entry_at_leader(bucket.name, key)
    if entry is None or entry[2]:
        return None
    return entry[0], entry[1]


class _Write:
    """One compare-and-set, retried: tells a lost answer from a lost race."""

    def __init__(self, bucket: Bucket, key: str, data: bytes, last: int) -> None:
        self.bucket, self.key, self.data, self.last = bucket, key, data, last
        self.tried = False

    async def __call__(self) -> int:
        first = not self.tried
        self.tried = True
        b = self.bucket
        try:
            try:
                return await b.jsc.kv_write(b.name, self.key, self.data, self.last)
            except KeyWrongLastSequenceError:
                if self.last != 0:
                    raise
                # A key deleted by hand keeps a delete marker: a create writes over it, at
                # the marker's revision as the stream's leader has it (the CAS is decided
                # there; a replica behind the delete would name the value before it, and the
                # create would fail as if the key existed). Refused when the key really
                # exists — perhaps our own earlier try, whose answer was lost.
                entry = await b.jsc.kv_entry_at_leader(b.name, self.key)
                if entry is None or not entry[2]:
                    raise
                return await b.jsc.kv_write(b.name, self.key, self.data, entry[1])
        except KeyWrongLastSequenceError:
            if not first:
                # Our earlier try may have landed before its answer was lost. The read may
                # reach a replica that has not applied it yet: look again a moment later.
                for pause in _READ_BACK:
                    await asyncio.sleep(pause)
                    got = await get(b, self.key)
                    if got is not None and got[0] == self.data:
                        return got[1]
            raise


async def cas(
    bucket: Bucket,
    key: str,
    data: bytes,
    last: int,
    deadline: float,
    *,
    on_retry: Callable[[BaseException], None] | None = None,
) -> int:
    """Write ``data`` if ``key`` is still at revision ``last``; the new revision. Raises
    ``KeyWrongLastSequenceError`` when somebody else wrote the key in between."""
    return await retrying(
        f"write {key}", _Write(bucket, key, data, last), deadline, on_retry=on_retry
    )


async def create(
    bucket: Bucket,
    key: str,
    data: bytes,
    deadline: float,
    *,
    on_retry: Callable[[BaseException], None] | None = None,
) -> int:
    """Create ``key``; its revision. ``KeyWrongLastSequenceError`` when it exists."""
    return await cas(bucket, key, data, 0, deadline, on_retry=on_retry)
