"""A continuous pull consumer for JetStream: messages are handed over the moment they arrive.

nats-py 2.16's ``fetch(batch>1)`` returns early only when the whole batch is there, so a
half-full batch waits for the full timeout — fatal for latency. This keeps pull requests
outstanding on the consumer's ``MSG.NEXT`` API (the "consume" pattern of the newer clients):
each message goes to ``on_msg`` immediately, and more are requested as capacity frees up.

Bounded: at most ``capacity`` messages are held (handed over and not yet released) plus
outstanding requests, and each request brings at most ``max_bytes`` (the server's
``max_payload`` and room for a message's subject: the largest message a stream holds), so
deliveries in flight to this connection stay a few such messages, however large each is — a
hub once pulled 60 submissions of 4 MiB at once and nats-server cut its connection, and every
tenant's heartbeats with it, as a slow consumer (64 MiB pending). A watchdog re-pulls when a
request was lost (reconnect, server restart).
When nobody serves the consumer (a pull answered 503: its leader being elected, or the consumer
gone — deleted by hand, with its stream, or idle past its ``inactive_threshold``) it pulls again
on the watchdog's tick only, not at once, and after a few such answers asks its owner to check
(``on_gone``): a consumer that is gone must be created again, or nothing more arrives.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Final

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js import JetStreamContext
from nats.js.api import (
    AckPolicy,
    ConsumerConfig,
    DeliverPolicy,
    RetentionPolicy,
    StorageType,
    StreamConfig,
)
from nats.js.errors import BadRequestError, NotFoundError
from nats.js.kv import KeyValue

from reach_mesh import protocol
from reach_mesh._batch import private_inbox
from reach_mesh._guard import matches, refuse
from reach_mesh._inline import subscribe_inline
from reach_mesh._nats import ensure_kv
from reach_mesh._nats_intake import on_unreadable
from reach_mesh._retry import describe
from reach_mesh._starting import not_made, set_up
from reach_mesh.config import MeshSettings

__all__ = [
    "PULL_ROOM",
    "RETENTION_STREAMS",
    "PullConsumer",
    "apply_replicas",
    "apply_workflow_retention",
    "ensure_stream",
    "ensure_workflow_resources",
    "last_per_subject",
    "status_stream_config",
    "stream_seq",
    "work_stream_config",
]

log = logging.getLogger("reach_mesh.consume")


def stream_seq(msg: Msg) -> int | None:
    """The stream sequence of a JetStream delivery, None for anything else (nats-py parses
    the metadata once and keeps it on the message)."""
    try:
        seq: int = msg.metadata.sequence.stream
    except Exception:
        return None
    return seq


#: What every JetStream delivery's reply subject (its ack subject) starts with.
_ACK_PREFIX: Final = "$JS.ACK."

#: ``last_per_subject`` lets the event loop run other tasks after this many messages.
_YIELD_EVERY: Final = 256

_STATUS: Final = "Status"
_PENDING: Final = "Nats-Pending-Messages"
_PENDING_BYTES: Final = "Nats-Pending-Bytes"
#: Bytes of a pull's ``max_bytes`` beside the server's ``max_payload`` (which bounds a message's
#: headers and body): its subject, counted too by nats-server. A message over a pull's
#: ``max_bytes`` is never delivered by it (nats-server 2.15 ends the pull at once, 409
#: "Message Size Exceeds MaxBytes"), so the bound must hold the largest message there is.
PULL_ROOM: Final = protocol.MESSAGE_ROOM
#: Pulls answered 503 in a row (about half a second apart) before the owner is asked to check.
_GONE_AFTER: Final = 3
#: Longest wait between two checks while the 503s go on (doubling from 1 s).
_GONE_CHECK_MAX: Final = 30.0
#: After a message is put back for want of room (``PullConsumer.put_back``), nothing is pulled
#: until a held message is released — or for this long (s) at most.
_FULL_FOR: Final = 1.0


class PullConsumer:
    """Keeps pulls outstanding on ``durable`` of ``stream``; ``on_msg`` must not block and must
    lead to exactly one :meth:`release` per message. It is called in nats-py's reader, as the
    delivery is read."""

    def __init__(
        self,
        nc: NATS,
        stream: str,
        durable: str,
        on_msg: Callable[[Msg], None],
        capacity: int,
        *,
        expires: float = 5.0,
        on_gone: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        self._nc = nc
        self._on_gone = on_gone
        #: Pulls answered 503 in a row, the check of the consumer under way, and the earliest
        #: time (monotonic) of the next one and its wait after that.
        self._refused = 0
        self._checking: asyncio.Task[None] | None = None
        self._next_check = 0.0
        self._check_wait = 1.0
        self._api = f"$JS.API.CONSUMER.MSG.NEXT.{stream}.{durable}"
        self._on_msg = on_msg
        self.capacity = max(1, capacity)
        self._expires = expires
        self._held = 0
        self._outstanding = 0
        #: The ``max_bytes`` of the last pull request.
        self._max_bytes = 0
        self._last_seen = time.monotonic()
        self._sub: Subscription | None = None
        self._inbox = ""
        self._watchdog: asyncio.Task[None] | None = None
        self._bg: set[asyncio.Task[None]] = set()
        self._stopped = False
        #: When a message was last put back for want of room (None: none since the last
        #: release): no pull until one is released, or for ``_FULL_FOR`` at most (the
        #: watchdog's tick pulls then, should a held message never be released).
        self._full: float | None = None

    @property
    def held(self) -> int:
        return self._held

    @property
    def open(self) -> int:
        """Messages the open pulls may still bring (a message stored now arrives at once
        while this is positive)."""
        return self._outstanding

    async def start(self) -> None:
        # Unguessable: other identities may publish into this connection's inbox space (agents
        # answer hubs there), and deliveries must come from JetStream only.
        self._inbox = private_inbox(self._nc)
        # Each delivery is handed over as nats-py reads it (``reach_mesh/_inline.py``), not a
        # pass of the loop later: ``on_msg`` must not block anyway.
        self._sub = await subscribe_inline(self._nc, self._inbox, self._cb)
        on_unreadable(self._nc, self._sub._id, self._term_unreadable)
        self._watchdog = asyncio.create_task(self._watch(), name="reach-pull-watchdog")
        self._maybe_pull()

    async def stop(self) -> None:
        """Stop pulling. Messages already handed over are still released by their owners."""
        self._stopped = True
        if self._checking is not None:
            self._checking.cancel()
        if self._watchdog is not None:
            self._watchdog.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._watchdog
        if self._sub is not None:
            on_unreadable(self._nc, self._sub._id, None)
            with contextlib.suppress(Exception):
                await self._sub.unsubscribe()
            self._sub = None

    def hold(self, more: int) -> None:
        """The message just handed over counts as ``1 + more`` (a work batch of that many
        steps, each released on its own): fewer are pulled meanwhile."""
        self._held += max(0, more)

    def release(self) -> None:
        """One handed-over message is done (acked, nak'd or termed)."""
        self._held = max(0, self._held - 1)
        self._full = None
        self._maybe_pull()

    def put_back(self) -> None:
        """The message just handed over is given back unrun, for want of room (a work batch
        larger than what is left of the capacity): released, and nothing more is pulled until
        another message is (:meth:`release`; one is held, or there would have been room) —
        the next message would most likely be put back too."""
        self._held = max(0, self._held - 1)
        self._full = time.monotonic()

    def _cb(self, msg: Msg) -> None:
        self._last_seen = time.monotonic()
        headers = msg.headers
        if headers and not msg.data and _STATUS in headers:
            status = headers.get(_STATUS, "")
            if status == "100":
                return  # idle heartbeat
            if status == "503":
                # Nobody serves the consumer: pull again on the watchdog's tick, not at once
                # (each answer is immediate: at once would be thousands a second).
                self._outstanding = 0
                self._refused += 1
                self._maybe_check()
                return
            if self._refused:  # served again (a check's backoff starts over)
                self._refused, self._check_wait = 0, 1.0
            # 404/408/409: this pull request is over; its unfilled part is no longer owed (409
            # "Message Size Exceeds MaxBytes": the next message did not fit in what was left of
            # its max_bytes — pulled again at once, with a whole max_bytes).
            pending = headers.get(_PENDING)
            if pending is not None and pending.isdigit():
                self._outstanding = max(0, self._outstanding - int(pending))
            else:
                self._outstanding = 0
            if status not in ("404", "408"):
                log.debug("pull on %s ended: %s %s", self._api, status, headers)
            if status == "409" and headers.get(_PENDING_BYTES) == str(self._max_bytes):
                # Nothing fit at all (a message over max_bytes: the server's max_payload is
                # smaller than when it was stored): on the watchdog's tick, not thousands a
                # second.
                return
            self._maybe_pull()
            return
        if not msg.reply.startswith(_ACK_PREFIX):
            # Not from JetStream (its deliveries carry their ack subject): never acked.
            refuse(msg, "not a JetStream delivery (no $JS.ACK reply subject)")
            return
        self._outstanding = max(0, self._outstanding - 1)
        self._held += 1
        if self._refused:  # served again
            self._refused, self._check_wait = 0, 1.0
        try:
            self._on_msg(msg)
        except Exception:
            log.exception("pull consumer handler failed")
            self.release()

    def _term_unreadable(self, ack: str) -> None:
        """A delivery nats-py could not read (its subject or headers; dropped, counted): ended
        on the stream (``+TERM``), so that it does not come back after every ack wait."""
        self._outstanding = max(0, self._outstanding - 1)
        task = asyncio.create_task(self._term(ack))
        self._bg.add(task)
        task.add_done_callback(self._bg.discard)
        self._maybe_pull()

    async def _term(self, ack: str) -> None:
        with contextlib.suppress(Exception):  # (unanswered: it comes back, and is termed then)
            await self._nc.publish(ack, b"+TERM")

    def _maybe_check(self) -> None:
        """Ask the owner to check the consumer (``on_gone``) after ``_GONE_AFTER`` 503s in a
        row, one check at a time, then at most every 1, 2, 4 … 30 s while they go on."""
        if self._on_gone is None or self._refused < _GONE_AFTER or self._stopped:
            return
        now = time.monotonic()
        if (self._checking is not None and not self._checking.done()) or now < self._next_check:
            return
        self._next_check = now + self._check_wait
        self._check_wait = min(self._check_wait * 2, _GONE_CHECK_MAX)
        self._checking = asyncio.create_task(self._check(self._on_gone()))

    async def _check(self, check: Awaitable[None]) -> None:
        try:
            await check
        except Exception:
            log.exception("checking the consumer behind %s failed", self._api)

    def _maybe_pull(self) -> None:
        if self._stopped or self._sub is None:
            return
        if self._full is not None:
            if time.monotonic() - self._full < _FULL_FOR:
                return
            self._full = None
        want = self.capacity - self._held - self._outstanding
        # Top up in chunks: one request per message would double the protocol traffic.
        if want <= 0 or (self._outstanding > 0 and want < max(1, self.capacity // 2)):
            return
        self._outstanding += want
        self._max_bytes = int(self._nc.max_payload) + PULL_ROOM  # (the server's, this connection's)
        ask = {"batch": want, "max_bytes": self._max_bytes, "expires": int(self._expires * 1e9)}
        body = json.dumps(ask).encode()
        task = asyncio.create_task(self._publish(body))
        self._bg.add(task)
        task.add_done_callback(self._bg.discard)

    async def _publish(self, body: bytes) -> None:
        try:
            await self._nc.publish(self._api, body, reply=self._inbox)
        except Exception:
            self._outstanding = 0  # the watchdog will try again

    async def _watch(self) -> None:
        # Pull requests live on the server: a reconnect (server restart, failover to another
        # node) loses them. Re-pull at once when the connection's reconnect count moves, and
        # as a backstop when nothing at all (not even the 408 that normally ends a request
        # after ``expires``) arrived for two periods.
        reconnects = self._nc.stats.get("reconnects", 0)
        tick = min(self._expires, 0.5)
        while True:
            await asyncio.sleep(tick)
            now_reconnects = self._nc.stats.get("reconnects", 0)
            lost = now_reconnects != reconnects and self._nc.is_connected
            if lost or time.monotonic() - self._last_seen > 2 * self._expires + 1:
                reconnects = now_reconnects
                self._outstanding = 0
                self._last_seen = time.monotonic()
            self._maybe_pull()


async def last_per_subject(
    js: JetStreamContext,
    stream: str,
    filter_subject: str,
    *,
    timeout: float = 5.0,
    keep: int | None = None,
    name: str | None = None,
) -> list[Msg]:
    """The last message of each subject of ``stream`` matching ``filter_subject`` (empty ones
    left out), oldest first — the newest ``keep`` of them when given (all are read: memory
    stays bounded, the time does not; the event loop gets a turn every ``_YIELD_EVERY``).

    Read with a *named* ordered consumer: its filter then travels in the API subject
    (``$JS.API.CONSUMER.CREATE.<stream>.<name>.<filter>``), where NATS permissions can hold an
    identity to its own subjects (docs/security.md) — an unnamed consumer's would not.
    ``name``: the one this identity's permissions allow (else a random one). A consumer of
    that name left by an earlier read (a restart within its inactivity threshold) is deleted
    first: created again as it was, the server would hand back the old one, which has
    delivered everything already. It is deleted when the read is done."""
    fixed = name is not None
    name = name or f"reach-{uuid.uuid4().hex}"
    if fixed:
        with contextlib.suppress(NotFoundError):
            await js.delete_consumer(stream, name)
    sub = await js.subscribe(
        filter_subject,
        stream=stream,
        ordered_consumer=True,
        deliver_policy=DeliverPolicy.LAST_PER_SUBJECT,
        inactive_threshold=60.0,
        config=ConsumerConfig(name=name),
    )
    out: collections.deque[Msg] = collections.deque(maxlen=keep)
    tokens = filter_subject.split(".")
    try:
        info = await sub.consumer_info()
        if info.num_pending == 0 and not (info.delivered and info.delivered.consumer_seq):
            return []
        read = 0
        while True:
            msg = await sub.next_msg(timeout=timeout)
            if msg.data and not matches(tokens, msg.subject):
                # The consumer's filter was changed by another identity allowed to create
                # consumers on the stream (under this consumer's name): not ours to read.
                refuse(msg, f"outside the filter {filter_subject} it was read with")
            elif msg.data:
                out.append(msg)
            if msg.metadata.num_pending == 0:
                return list(out)
            read += 1
            if read % _YIELD_EVERY == 0:
                # Messages already queued come without a suspension: heartbeats must not wait.
                await asyncio.sleep(0)
    finally:
        with contextlib.suppress(Exception):
            await sub.unsubscribe()
        if fixed:
            with contextlib.suppress(Exception):
                await js.delete_consumer(stream, name)


async def ensure_stream(js: JetStreamContext, config: StreamConfig) -> None:
    """Create the stream unless it exists (idempotent across hubs and agents). While a
    process starts, asked again through an election or an outage (``_starting``)."""
    name = config.name
    assert name is not None

    async def create_unless_there() -> None:
        try:
            await js.stream_info(name)
            return
        except NotFoundError:
            pass
        try:
            await js.add_stream(config)
        except BadRequestError as err:
            # Created meanwhile by another process (same name): use it as it is.
            try:
                await js.stream_info(name)
            except NotFoundError:
                # Not there, and not made: the refusal says why (too few peers up to hold
                # it: an outage; a stream that takes its subjects: not).
                raise await not_made(js, err, (config.subjects or [name])[0]) from None

    await set_up(f"stream {name}", create_unless_there)


async def ensure_task_resources(js: JetStreamContext, settings: MeshSettings) -> KeyValue:
    """What both sides of a durable step need: the work and status streams and the task-record
    bucket (whose current attempt is the fence). Returns the ``reach_tasks`` bucket."""
    s = settings
    await ensure_stream(js, work_stream_config(s.workflow_retention, s.dedup_window, s.kv_replicas))
    await ensure_stream(js, status_stream_config(s.workflow_retention, s.kv_replicas))
    return await ensure_kv(
        js,
        protocol.KV_TASKS,
        replicas=s.kv_replicas,
        ttl=s.workflow_retention,
        description="reach-mesh workflow task records (current attempt = fence)",
    )


async def ensure_workflow_resources(js: JetStreamContext, settings: MeshSettings) -> None:
    """What a hub's workflow engine needs: the submissions and events streams, the task
    resources, the record bucket and the hubs' shared submissions consumer (idempotent)."""
    s = settings
    await ensure_stream(
        js,
        StreamConfig(
            name=protocol.STREAM_WF,
            subjects=[protocol.wf_submit("*")],
            retention=RetentionPolicy.WORK_QUEUE,
            storage=StorageType.FILE,
            max_age=s.workflow_retention,
            duplicate_window=min(s.dedup_window, s.workflow_retention),
            num_replicas=s.kv_replicas,
            description="reach-mesh workflow submissions (dedup on <ns>.<workflow_id>.<nonce>)",
        ),
    )
    await ensure_stream(
        js,
        StreamConfig(
            name=protocol.STREAM_WF_EVENTS,
            # ``.done`` is announced on core NATS, not stored: its result is the record's.
            subjects=[protocol.wf_event("*", "*")],
            retention=RetentionPolicy.LIMITS,
            storage=StorageType.FILE,
            max_age=s.workflow_retention,
            num_replicas=s.kv_replicas,
            description="reach-mesh workflow step events",
        ),
    )
    await ensure_task_resources(js, s)
    await ensure_kv(
        js,
        protocol.KV_WORKFLOWS,
        replicas=s.kv_replicas,
        ttl=s.workflow_retention,
        description="reach-mesh workflow records",
    )
    hubs = ConsumerConfig(
        durable_name=protocol.CONSUMER_HUBS,
        ack_policy=AckPolicy.EXPLICIT,
        deliver_policy=DeliverPolicy.ALL,
        ack_wait=s.workflow_ack_wait,
        max_deliver=-1,
        # Submissions deferred for fairness wait here (a nak's delay keeps them pending),
        # so that other namespaces' are still delivered behind a flood.
        max_ack_pending=max(s.workflow_concurrency * 64, 65_536),
    )
    # (Created again with the same settings: the one that exists, unchanged.)
    await set_up(
        f"consumer {protocol.CONSUMER_HUBS} of {protocol.STREAM_WF}",
        lambda: js.add_consumer(protocol.STREAM_WF, hubs),
    )


#: What ``workflow_retention`` ages, and ``ensure_workflow_resources`` creates: the workflow
#: streams and the streams of the KV buckets.
RETENTION_STREAMS: Final = (
    protocol.STREAM_WF,
    protocol.STREAM_WF_EVENTS,
    protocol.STREAM_WORK,
    protocol.STREAM_STATUS,
    f"KV_{protocol.KV_WORKFLOWS}",
    f"KV_{protocol.KV_TASKS}",
)


async def apply_workflow_retention(js: JetStreamContext, settings: MeshSettings) -> list[str]:
    """Give every existing stream of :data:`RETENTION_STREAMS` the max age
    ``workflow_retention`` (a KV bucket's TTL is its stream's max age), keeping duplicate
    windows within it; returns the names changed. Hubs call it at start: the streams were
    created with the retention of whoever came first (a hub or an agent), and a changed setting
    takes effect on the next hub start. Shortening it drops older records at once."""
    retention = settings.workflow_retention
    changed = []
    for name in RETENTION_STREAMS:
        try:
            cfg = (await js.stream_info(name)).config
        except NotFoundError:
            continue
        window = cfg.duplicate_window
        if name in (protocol.STREAM_WF, protocol.STREAM_WORK):
            window = min(settings.dedup_window, retention)
        elif window is not None and window > retention:
            window = retention
        same_age = cfg.max_age is not None and abs(cfg.max_age - retention) < 1e-3
        if same_age and (window is None or abs((cfg.duplicate_window or 0) - window) < 1e-3):
            continue
        log.warning(
            "stream %s: max age %ss -> %ss (workflow_retention)", name, cfg.max_age, retention
        )
        cfg.max_age = retention
        cfg.duplicate_window = window
        await js.update_stream(cfg)
        changed.append(name)
    return changed


async def apply_replicas(js: JetStreamContext, settings: MeshSettings) -> list[str]:
    """Give every existing stream of the mesh (``protocol.MESH_STREAMS``) at least
    ``kv_replicas`` replicas; returns the names changed. Hubs call it at start: a mesh begun
    on one server (R1) and moved to a cluster with ``kv_replicas: 3`` kept its streams at R1,
    each lost with its server, and only ``reach-mesh doctor`` said so. Never fewer: a hub left
    at the default (1) must not take a cluster's streams down to one replica — that is an
    operator's decision (``nats stream edit``). A change the cluster cannot make (fewer
    servers than replicas) is a WARNING, and the streams stay as they are."""
    want = settings.kv_replicas
    changed = []
    for name in protocol.MESH_STREAMS:
        try:
            cfg = (await js.stream_info(name)).config
        except NotFoundError:
            continue
        have = cfg.num_replicas or 1
        if have >= want:
            continue
        cfg.num_replicas = want
        try:
            await js.update_stream(cfg)
        except Exception as err:
            log.warning(
                "stream %s: R%d -> R%d (kv_replicas) refused: %s", name, have, want, describe(err)
            )
            continue
        log.warning("stream %s: R%d -> R%d (kv_replicas)", name, have, want)
        changed.append(name)
    return changed


def work_stream_config(retention: float, dedup_window: float, replicas: int) -> StreamConfig:
    """``REACH_WORK``: a work queue (a message is gone once acked), deduplicated on
    ``task_id#n``; messages nobody took age out after the retention period."""
    return StreamConfig(
        name=protocol.STREAM_WORK,
        subjects=[protocol.work_subject("*", ">")],
        retention=RetentionPolicy.WORK_QUEUE,
        storage=StorageType.FILE,
        max_age=retention,
        duplicate_window=min(dedup_window, retention),
        num_replicas=replicas,
        description="reach-mesh durable workflow steps, one subject per agent",
    )


def status_stream_config(retention: float, replicas: int) -> StreamConfig:
    """``REACH_STATUS``: every status event of every tracked task, so a hub can rebuild state
    and an agent its idempotency table (from the last event of each of its tasks)."""
    return StreamConfig(
        name=protocol.STREAM_STATUS,
        subjects=[protocol.task_status("*.*.*", "*")],
        retention=RetentionPolicy.LIMITS,
        storage=StorageType.FILE,
        max_age=retention,
        num_replicas=replicas,
        description="reach-mesh six-state status events",
    )
