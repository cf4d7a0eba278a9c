"""The audit log: routing decisions, registrations, state changes and operator actions, appended
to a JetStream stream with bounded retention.

Events are buffered per subject (``reach.audit.<ns>.<kind>``) and published in batches: one
message of newline-delimited JSON objects per subject every :data:`FLUSH_INTERVAL` (or as soon as
a subject holds :data:`FLUSH_EVENTS` events), and on close. One JetStream message per routed
request would cost the hub a JSON dump and a publish per request and the server a stored message
per request; a batch costs one of each per subject per interval. Publishing is core NATS publish
(no ack round trip); the stream stores what it captures. An event can therefore be up to one
interval late, and a hub that dies without closing loses at most the last interval's events.
``reach-mesh audit`` (``Client.audit``) splits the batches back into events and filters them by
request id, agent id, task id or trace id.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Hashable
from typing import Any, Final

from nats.aio.client import Client as NATS
from nats.js import JetStreamContext
from nats.js.api import DiscardPolicy, RetentionPolicy, StorageType, StreamConfig
from pydantic_core import to_json

from reach_mesh import protocol
from reach_mesh._retry import describe, storage_full, transient
from reach_mesh._starting import set_up

__all__ = ["FLUSH_EVENTS", "FLUSH_INTERVAL", "REPEAT_WINDOW", "AuditLog", "Repeats"]

log = logging.getLogger("reach_mesh.hub.audit")

#: When ``audit_max_bytes`` does not fit in JetStream's storage, this fraction of it is tried
#: (64 MiB of the default), if at least ``_AUDIT_MIN_BYTES``.
_AUDIT_FALLBACK: Final = 16
_AUDIT_MIN_BYTES: Final = 1 << 20
#: Longest an event waits in the buffer before it is published.
FLUSH_INTERVAL: Final = 0.075
#: A subject's buffer is published at once when it holds this many events (keeps one message
#: far below the server's max payload: an event is a few hundred bytes).
FLUSH_EVENTS: Final = 512
#: How long :class:`Repeats` remembers what it let through for a key (s): longer than a client
#: asks again about one request (``Client.cancel_workflow``: its timeout, 10 s by default).
REPEAT_WINDOW: Final = 120.0
#: Keys :class:`Repeats` remembers at most (the oldest forgotten first).
REPEATS_KEPT: Final = 4096


class AuditLog:
    def __init__(
        self,
        nc: NATS,
        js: JetStreamContext,
        hub_id: str,
        *,
        max_age: float,
        max_bytes: int,
        replicas: int = 1,
        enabled: bool = True,
        flush_interval: float = FLUSH_INTERVAL,
    ) -> None:
        self._nc = nc
        self._js = js
        self._hub_id = hub_id
        self._max_age = max_age
        self._max_bytes = max_bytes
        self._replicas = replicas
        self._flush_interval = flush_interval
        self.enabled = enabled
        self._buffers: dict[str, list[dict[str, Any]]] = {}
        self._timer: asyncio.TimerHandle | None = None
        self._flushing: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        """Create (or update) the audit stream. Its ``max_bytes`` is reserved in JetStream's
        storage: where ``audit_max_bytes`` does not fit (a server with a small
        ``max_file_store``, a small volume: the default is 1 GiB), a sixteenth of it is
        tried, with a WARNING (not more: the audit must leave room for the work); where that
        does not fit either, an ERROR, and the hub runs without its audit history. Never
        raised: the audit must not stop a hub."""
        if not self.enabled:
            return
        err: Exception | None = None
        fallback = self._max_bytes // _AUDIT_FALLBACK
        for size in (self._max_bytes, *([fallback] if fallback >= _AUDIT_MIN_BYTES else [])):
            try:
                # Asked again through an election while the hub starts (``_starting``).
                err = await set_up(f"stream {protocol.STREAM_AUDIT}", self._create_or_raise(size))
            except Exception as gave_up:  # (still never raised)
                err = gave_up
            if err is None:
                if size < self._max_bytes:
                    log.warning(
                        "%s stream created with max_bytes %d: audit_max_bytes (%d) does not "
                        "fit in the server's JetStream storage (raise max_file_store, or set "
                        "a smaller audit_max_bytes)",
                        protocol.STREAM_AUDIT,
                        size,
                        self._max_bytes,
                    )
                return
            if not storage_full(err):
                break
        assert err is not None
        log.error(
            "no %s stream, audit events are not kept: %s%s",
            protocol.STREAM_AUDIT,
            describe(err),
            f" (audit_max_bytes, {self._max_bytes} bytes, does not fit in the server's "
            "JetStream storage, nor a sixteenth of it: raise max_file_store, or lower "
            "audit_max_bytes)"
            if storage_full(err)
            else "",
        )

    def _create_or_raise(self, max_bytes: int) -> Callable[[], Awaitable[Exception | None]]:
        """:meth:`_create`, raising the errors of an outage (to be asked again) but for a full
        store, which ``start`` answers with a smaller stream."""

        async def create() -> Exception | None:
            err = await self._create(max_bytes)
            if err is not None and transient(err) and not storage_full(err):
                raise err
            return err

        return create

    async def _create(self, max_bytes: int) -> Exception | None:
        """Create the stream with ``max_bytes``, or update it when it exists; the error."""
        config = StreamConfig(
            name=protocol.STREAM_AUDIT,
            description="reach-mesh audit log",
            subjects=[protocol.audit_subject("*", "*")],
            retention=RetentionPolicy.LIMITS,
            discard=DiscardPolicy.OLD,
            max_age=self._max_age,
            max_bytes=max_bytes,
            storage=StorageType.FILE,
            num_replicas=self._replicas,
        )
        try:
            await self._js.add_stream(config)
            return None
        except Exception as err:
            if storage_full(err):
                return err  # not there, and no room for it
        try:
            # It exists: the settings may have changed. Never fewer replicas than it has: a
            # hub left at the default kv_replicas must not scale a cluster's stream down.
            have = (await self._js.stream_info(protocol.STREAM_AUDIT)).config.num_replicas or 1
            config.num_replicas = max(self._replicas, have)
            await self._js.update_stream(config)
            return None
        except Exception as again:
            return again

    def add(self, namespace: str, kind: str, fields: dict[str, Any]) -> None:
        """Buffer one event (no I/O here; an audit failure never fails a request).

        ``fields`` is taken over (not copied); ``None`` values are left out of the event."""
        if not self.enabled:
            return
        fields["ts"] = round(time.time(), 6)
        fields["kind"] = kind
        fields["hub_id"] = self._hub_id
        subject = protocol.audit_subject(namespace, kind)
        buf = self._buffers.get(subject)
        if buf is None:
            buf = self._buffers[subject] = []
        buf.append(fields)
        if len(buf) >= FLUSH_EVENTS:
            self._spawn_flush()
        elif self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(
                self._flush_interval, self._spawn_flush
            )

    async def record(self, namespace: str, kind: str, **fields: Any) -> None:
        """Buffer one event (kept as a coroutine for callers that await it)."""
        self.add(namespace, kind, fields)

    def _spawn_flush(self) -> None:
        task = asyncio.ensure_future(self.flush())
        self._flushing.add(task)
        task.add_done_callback(self._flushing.discard)

    async def flush(self) -> None:
        """Publish everything buffered now, one message per subject."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        buffers, self._buffers = self._buffers, {}
        for subject, events in buffers.items():
            body = b"\n".join(
                to_json({k: v for k, v in ev.items() if v is not None}, fallback=str)
                for ev in events
            )
            try:
                await self._nc.publish(subject, body)
            except Exception as err:  # connection gone: nothing to do but say so
                log.warning("audit publish of %d events failed: %s", len(events), describe(err))

    async def close(self) -> None:
        """Flush what is buffered and wait for flushes under way (call before draining)."""
        if self._flushing:
            await asyncio.gather(*self._flushing, return_exceptions=True)
        await self.flush()


class Repeats:
    """Which events are repeats of the one audited last for the same key: a client asking the
    same question again (``Client.cancel_workflow`` asks until it has a final answer, and for
    a while about a workflow no hub knows yet, each ask with the same ``cancel_id``) is
    audited once per distinct answer, not once per ask. An event that differs in any field
    from the last one let through for its key is audited, so nothing an ask did is lost;
    a key is forgotten ``window`` seconds after the event last let through for it."""

    def __init__(self, window: float = REPEAT_WINDOW, kept: int = REPEATS_KEPT) -> None:
        self._window = window
        self._kept = kept
        self._last: OrderedDict[Hashable, tuple[float, tuple[tuple[str, Any], ...]]] = OrderedDict()

    def first(self, key: Hashable, fields: dict[str, Any]) -> bool:
        """Whether ``fields`` are worth an event for ``key`` (not what the last event let
        through for it said, within the window); remembered if so."""
        now = time.monotonic()
        said = tuple(sorted((k, repr(v)) for k, v in fields.items()))
        last = self._last.get(key)
        if last is not None and now - last[0] < self._window and last[1] == said:
            return False
        self._last[key] = (now, said)
        self._last.move_to_end(key)
        while len(self._last) > self._kept:
            self._last.popitem(last=False)
        return True
