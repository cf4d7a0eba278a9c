"""The JetStream streams, buckets and consumers a hub uses: created at start by the parts that
use them, and created again when found gone.

A stream or a consumer deleted under a running mesh (by hand, ``nats stream rm``; a bucket
removed with its stream) left every hub retrying in silence: steps published into a work
stream that was not there any more were handed back again and again, a hub whose submissions
consumer was gone took no new workflow, and one whose registry bucket was gone stayed blind.
The hub now checks when JetStream gives a sign of it — a pull answered 503 for a while
(``PullConsumer``'s ``on_gone``), a write retried after "no stream answered", a watch that
failed — and every 30 s, and each part creates again what it needs, as at start. What a
deleted stream held is gone with it (docs/operations.md, "A stream of the mesh was deleted").
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Final

import nats.js.errors
from nats.js import JetStreamContext
from nats.js.errors import NotFoundError

from reach_mesh._retry import describe

__all__ = ["Resources"]

log = logging.getLogger("reach_mesh.hub.resources")

#: Least time between two checks prompted by failures (a flood of retries is one check).
CHECK_EVERY: Final = 5.0
#: Time between two checks that nothing prompted: what no write of the hub would notice (the
#: event and status streams, which agents and hubs fill by core publishes).
CHECK_IDLE: Final = 30.0


@dataclass(frozen=True, slots=True)
class _Part:
    """What one part of the hub needs (``streams``, a bucket's as ``KV_<bucket>``; and
    ``consumer`` of the first stream), and how it creates them (idempotent)."""

    streams: Sequence[str]
    ensure: Callable[[], Awaitable[object]]
    consumer: str | None = None


class Resources:
    """The hub's JetStream resources, by part (:meth:`add`); :meth:`check` creates again the
    ones found gone."""

    def __init__(
        self, js: JetStreamContext, *, counted: Callable[[int], None] | None = None
    ) -> None:
        self._js = js
        #: Told how many were created again (``reach_jetstream_recreated_total``).
        self._counted = counted
        self._parts: list[_Part] = []
        self._checking: asyncio.Task[None] | None = None
        self._last_check = -CHECK_EVERY
        self._idle: asyncio.Task[None] | None = None
        #: Streams and consumers found gone and created again, over the hub's life.
        self.recreated_total = 0

    def add(
        self,
        streams: Sequence[str],
        ensure: Callable[[], Awaitable[object]],
        *,
        consumer: str | None = None,
    ) -> None:
        """Watch ``streams`` (and ``consumer`` of the first); ``ensure`` creates them."""
        self._parts.append(_Part(tuple(streams), ensure, consumer))

    def start(self) -> None:
        """Check every ``CHECK_IDLE`` seconds from now on."""
        self._idle = asyncio.create_task(self._check_idle(), name="reach-resources-idle")

    def stop(self) -> None:
        for task in (self._idle, self._checking):
            if task is not None:
                task.cancel()

    async def _check_idle(self) -> None:
        while True:
            await asyncio.sleep(CHECK_IDLE)
            if time.monotonic() - self._last_check >= CHECK_IDLE:
                await self.check()

    def check_soon(self, err: BaseException) -> None:
        """After a JetStream operation failed with ``err``: check, when no stream answered or
        one was not found (one may be gone), at most every ``CHECK_EVERY`` seconds."""
        if not _no_stream(err) or time.monotonic() - self._last_check < CHECK_EVERY:
            return
        if self._checking is None or self._checking.done():
            self._checking = asyncio.create_task(self._check(), name="reach-resources")

    async def check(self) -> None:
        """Create again the streams and consumers that are gone, saying which (an ERROR: what
        they held is lost). Nothing when all are there, or when JetStream does not answer (an
        election: "not found" is the only proof of absence). One check at a time: a caller
        during one waits for it."""
        if self._checking is None or self._checking.done():
            self._checking = asyncio.create_task(self._check(), name="reach-resources")
        await asyncio.shield(self._checking)

    async def _check(self) -> None:
        self._last_check = time.monotonic()
        for part in self._parts:
            gone = [name for name in part.streams if await _gone(self._js.stream_info(name))]
            first = part.streams[0]
            if (
                part.consumer is not None
                and first not in gone
                and await _gone(self._js.consumer_info(first, part.consumer, timeout=5.0))
            ):
                gone.append(f"consumer {part.consumer} of {first}")
            if not gone:
                continue
            try:
                await part.ensure()
            except Exception as err:
                log.error("%s gone, and not created again yet: %s", ", ".join(gone), describe(err))
                continue
            self.recreated_total += len(gone)
            if self._counted is not None:
                self._counted(len(gone))
            log.error(
                "%s gone (deleted?): created again; what it held is lost (docs/operations.md, "
                "A stream of the mesh was deleted)",
                ", ".join(gone),
            )


async def _gone(read: Awaitable[object]) -> bool:
    """Whether JetStream says what ``read`` reads does not exist (any other failure: no)."""
    try:
        await read
    except NotFoundError:
        return True
    except Exception:
        return False
    return False


def _no_stream(err: BaseException | None) -> bool:
    """Whether ``err``, or what caused it, is JetStream's "no stream answered" or a "stream
    not found" (10059)."""
    while err is not None:
        if isinstance(err, nats.js.errors.NoStreamResponseError):
            return True
        if isinstance(err, NotFoundError) and getattr(err, "err_code", None) == 10059:
            return True
        err = err.__cause__
    return False
