"""Connecting to NATS and creating JetStream resources, with nats errors translated at the edge."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import ssl
import time
from collections.abc import Callable, Coroutine, Mapping
from typing import Any, Final, TypeVar

import nats
from nats.aio.client import DEFAULT_BUFFER_SIZE, DEFAULT_FLUSH_TIMEOUT
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import KeyValueConfig, StorageType
from nats.js.errors import BadBucketError, BucketNotFoundError
from nats.js.kv import KeyValue

from reach_mesh._cancels import uncancelled
from reach_mesh._nats_asking import Reconnects, reconnects_of
from reach_mesh._nats_intake import MessageGuard
from reach_mesh._nats_refusals import (
    Refusals,
    not_permitted,
    refusals_of,
    refused_first,
    refused_since,
    refused_subject,
)
from reach_mesh._nats_urls import (
    answering,
    beside,
    check_url,
    diagnose,
    has_credentials,
    has_identity,
    hosts,
    shown,
)
from reach_mesh._nats_urls import (
    servers as _servers,
)
from reach_mesh._starting import not_made, set_up
from reach_mesh.config import MeshSettings
from reach_mesh.errors import BadRequestError, MeshUnavailableError, NotPermittedError
from reach_mesh.logs import LineBudget

__all__ = [
    "Refusals",
    "beside",
    "connect",
    "connection_counts",
    "ensure_kv",
    "flushed",
    "has_credentials",
    "has_identity",
    "hosts",
    "not_permitted",
    "refusals_of",
    "refused_first",
    "refused_messages",
    "refused_since",
    "shown",
    "slow_drops",
    "slow_drops_forget",
]

T = TypeVar("T")

log = logging.getLogger("reach_mesh.nats")

#: While NATS is gone, one log line per this many seconds (nats-py retries every 0.25 s).
_GONE_LOG_INTERVAL: Final = 30.0
#: Slow-consumer drops (nats-py discarding messages a subscription did not read in time): the
#: first is logged at once, later ones counted and logged every this many seconds.
_SLOW_LOG_INTERVAL: Final = 10.0
#: A connection told that its server enters lame-duck mode leaves it within this many seconds
#: (a random time in it: a node's clients do not all arrive on the others at once).
_LAME_DUCK_SPREAD: Final = 1.0
#: What a broken, refused or closing connection raises (also inside our callbacks).
_TRANSPORT_ERRORS: Final = (nats.errors.Error, OSError, EOFError, TimeoutError)
#: How nats-py says the connection is lost (the socket closed, PINGs unanswered), just before
#: its disconnected callback: that one's line says it (``_Watch.disconnected``).
_LOSS_ERRORS: Final = (nats.errors.StaleConnectionError, ConnectionResetError, EOFError)
#: Where nats-py runs a subscription's callback: an error it catches there (and hands to
#: ``error_cb``) has this frame first in its traceback.
_CALLBACK_RUNNER: Final = "_wait_for_msgs"
#: PINGs a connection may have unanswered; one more and its server is taken for dead. Three:
#: a PONG queued behind a backlog the server is still sending is late, not missing.
_MAX_PINGS_OUT: Final = 3
#: How long the close of a connection may take before its socket is cut: after the server was
#: taken for dead (a reconnect), and when the connection is closed on purpose.
_CLOSE_DEAD: Final = 1.0
_CLOSE_OWN: Final = 5.0
#: Round trips :func:`flushed` makes at most.
_FLUSH_ROUNDS: Final = 4


async def connect(
    url: str | None,
    *,
    name: str,
    settings: MeshSettings | None = None,
    timeout: float | None = None,
    patience: float = 0.0,
    on_reconnect: Callable[[], None] | None = None,
    leave_cut_off: bool = False,
    **options: Any,
) -> NATS:
    """Connect to ``url`` (comma-separated list allowed) or raise ``MeshUnavailableError``.

    A dead URL makes nats-py retry for minutes; the connect is bounded by ``timeout``
    (default ``settings.connect_timeout``) and reconnection after a successful connect is
    unlimited (a hub or agent outlives a server restart or a cluster failover). Credentials
    and TLS come from ``settings`` (``nats_creds``, ``nats_token``, ``nats_nkey_seed`` with
    ``nats_inbox_prefix``, ``nats_tls_*``); a user and password may also be given in the URL.

    ``patience``: how long to keep at it past ``timeout`` while the server's port answers but
    the connection is not made (a busy server: a fleet's processes all starting at once, on
    a loaded node) — not when nothing listens, nor for refused credentials.

    A failed first connect says why: a URL that is not ``nats://``/``tls://``/``ws(s)://`` at
    once, else after ``timeout`` the host that does not resolve, the port that refuses, or
    what the server answered (TLS, authorization). Once connected, losing the server is logged
    once, then every 30 s while it lasts, and the reconnection once. A permissions violation
    (secure mode, docs/security.md) is logged: it would otherwise only show as a timeout.
    ``on_reconnect`` is called after each reconnection (subscriptions are in place again);
    more listeners may join later (:func:`reconnects_of`). ``leave_cut_off``: leave a server
    that lost its routes to most of its cluster for another one (``_Watch.cut_off``).
    """
    if not url:
        raise BadRequestError(
            "no NATS URL: pass --nats URL (CLI) or Client(url) / MeshSettings(nats_url=...) "
            "(Python), or set REACH_NATS_URL to the one `reach-mesh up` prints"
        )
    if timeout is None:
        timeout = settings.connect_timeout if settings is not None else 2.0
    servers = _servers(url)
    for server in servers:
        check_url(server)
    opts: dict[str, Any] = {
        "name": name,
        "servers": servers,
        # Per server: a silent one (no RST) must leave time to try the others.
        "connect_timeout": max(0.5, min(timeout, 2.0) / len(servers)),
        "max_reconnect_attempts": -1,
        "reconnect_time_wait": 0.25,
        "allow_reconnect": True,
        "pending_size": 64 * 1024 * 1024,
    }
    # A server that stops answering without closing the socket (frozen, cut off) is only
    # noticed by its missing PONGs: left after ``nats_ping_interval`` x 4 at most.
    opts["ping_interval"] = (
        settings.nats_ping_interval
        if settings is not None
        else MeshSettings.model_fields["nats_ping_interval"].default
    )
    opts["max_outstanding_pings"] = _MAX_PINGS_OUT
    if settings is not None:
        opts.update(_auth_options(settings))
    opts.update(options)
    watch = _Watch(name, shown(url))
    opts.setdefault("error_cb", watch.error)
    opts.setdefault("disconnected_cb", watch.disconnected)
    opts.setdefault("reconnected_cb", watch.reconnected)
    opts.setdefault("lame_duck_mode_cb", watch.lame_duck)
    nc = watch.nc = _Connection()
    nc.refusals = Refusals()
    nc.reconnects = Reconnects()
    nc.slow_drops = {}
    if leave_cut_off:
        nc.on_cut_off = watch.cut_off
    if on_reconnect is not None:
        nc.reconnects.listeners.append(on_reconnect)
    try:
        await _first_connect(nc, opts, watch, timeout, patience)
    except (TimeoutError, OSError, nats.errors.Error) as err:
        with contextlib.suppress(Exception):
            await nc.close()
        cause = await diagnose(servers, watch.refusal or watch.last_error or err)
        if watch.refusal is not None:
            # Credentials the server does not know (or none where it wants some): trying
            # again cannot help, pointing at the settings file does.
            hint = (
                "give the ones it expects — in secure mode each process's own identity, "
                "REACH_CONFIG=<auth dir>/<role>.<name>.yaml (`reach-mesh auth init` / "
                "`auth add-*` issue them, docs/security.md); a token: REACH_NATS_TOKEN"
            )
            if settings is not None and settings.nats_nkey_seed:
                # An identity was given: the server does not know it (yet).
                hint = (
                    "the server does not know this identity — issued after it last loaded "
                    "auth.conf (reload it: kill -HUP <nats-server pid>, or nats-server "
                    "--signal reload=<pid>), or of another auth directory than the server's "
                    "(docs/security.md)"
                )
            raise NotPermittedError(
                f"NATS at {shown(url)} refused this connection's credentials ({cause}): {hint}",
                url=shown(url),
            ) from err
        raise MeshUnavailableError(f"cannot connect to NATS at {shown(url)}: {cause}") from err
    watch.connected = True
    return nc


def slow_drops(nc: NATS | None, sid: int) -> int:
    """Messages nats-py dropped so far for subscription ``sid`` of ``nc`` as a slow consumer
    (its pending limit reached; 0 for a connection not made by :func:`connect`). Counted in
    the read loop as each is dropped, before it reads on: a message the subscription reads
    after a drop is counted with it already."""
    return nc.slow_drops.get(sid, 0) if isinstance(nc, _Connection) else 0


def slow_drops_forget(nc: NATS | None, sid: int) -> None:
    """Forget the drops of subscription ``sid`` of ``nc``, unsubscribed (none come after)."""
    if isinstance(nc, _Connection):
        nc.slow_drops.pop(sid, None)


def refused_messages(nc: NATS | None) -> int:
    """Messages dropped unread on ``nc`` so far (0: not connected, or not made by
    :func:`connect`)."""
    return nc.messages_refused if isinstance(nc, _Connection) else 0


def connection_counts(
    named: Mapping[str, NATS | None],
) -> tuple[int, dict[str, tuple[int, bool, int | None]]]:
    """What ``tracing.metrics.connection_metrics`` exports of the ``named`` connections (a
    hub's three, an agent's one): the messages dropped unread on all of them, and per name the
    reconnections (none counted for a connection not made by :func:`connect`) and whether it
    is up (not when None: not made yet), and how many client URLs its server's last INFO
    listed (None: not known — not connected yet, a server alone, or not made by
    :func:`connect`)."""
    refused = 0
    each: dict[str, tuple[int, bool, int | None]] = {}
    for name, nc in named.items():
        if nc is None:
            each[name] = (0, False, None)
            continue
        reconnects = reconnects_of(nc)
        refused += refused_messages(nc)
        listed = nc.listed_now if isinstance(nc, _Connection) else None
        each[name] = (0 if reconnects is None else reconnects.count, nc.is_connected, listed)
    return refused, each


async def flushed(nc: NATS) -> None:
    """Return once the server has processed every command ``nc`` sent before the call — its
    SUBs and UNSUBs included, which ``nc.flush()`` alone does not promise: a subscription is
    the server's (and a refusal of it has come back), an unsubscribe has taken this
    connection out of a queue group, before a message from elsewhere needs it.

    nats-py's ``subscribe``, ``unsubscribe`` and ``publish`` queue their command for its
    flusher task and return; ``flush()`` writes its PING straight to the socket, ahead of what
    is still queued, so its PONG can come back before the server has seen those commands. A
    PING written while nothing is queued is behind all of them: flushed until one was (its
    count, ``pending_data_size``, holds a PING's bytes too until the flusher runs — one round
    trip more at worst). A connection other tasks publish on meanwhile may never find its
    queue empty: after ``_FLUSH_ROUNDS`` round trips it settles for the last PING — the
    flusher, kicked before the first, has written that queue by then (unless the socket has
    been backed up all along)."""
    for _ in range(_FLUSH_ROUNDS):
        queued = nc.pending_data_size > 0
        await nc.flush()  # (nothing awaited between the test and the PING's write)
        if not queued:
            return


class _Connection(MessageGuard):
    """nats-py's client, whose close of a connection is bounded.

    nats-py waits for a closed connection's socket to close before it reconnects (or
    returns from ``close``), without a bound: over TLS for the server's goodbye, behind a full
    send buffer until the operating system gives the connection up — minutes, for a server
    that froze (nats.py issue 671). Here the socket is cut (aborted) when that takes longer
    than ``_CLOSE_DEAD`` after the server was taken for dead, ``_CLOSE_OWN`` on a close."""

    #: Subjects the server refused this connection (``connect`` sets it).
    refusals: Refusals
    #: Its reconnections (``connect`` sets it).
    reconnects: Reconnects
    #: Messages dropped as a slow consumer, by subscription id (``connect`` sets it;
    #: ``slow_drops``).
    slow_drops: dict[int, int]
    #: And on all of them.
    slow_drops_total: int = 0
    #: Leaving its server on purpose, to join its siblings' (``_nats_together``): not a loss.
    moving: bool = False
    #: Called when its server tells it has lost its routes to most of its cluster
    #: (``connect``'s ``leave_cut_off``; true when it leaves); nothing is called when None.
    on_cut_off: Callable[[], bool] | None = None
    #: The most client URLs its server's INFO listed (its own included) since it connected.
    _listed: int = 0
    #: How many its server's last INFO listed (None until one listed any): the cluster's
    #: nodes it has a route to, itself included — one fewer when a node is lost or cut off
    #: (``reach_nats_cluster_urls``, alert ``ReachNatsNodeLost``).
    listed_now: int | None = None
    #: The server (netlocs) it is leaving because that one was cut off: tried last.
    _left: frozenset[str] = frozenset()
    #: That server's ``server_id``, and the netlocs it was left under, until this connection
    #: is up on another (``back_where_left``).
    _left_id: str | None = None
    _left_at: frozenset[str] = frozenset()
    #: The reconnection :meth:`_socket_gone` started, while it runs.
    _gone: asyncio.Task[None] | None = None

    async def _read_loop(self) -> None:
        """nats-py's read loop, which lets the event loop run between two full reads of a
        connection that is dropping what it reads.

        nats-py's parses whatever its socket's buffer holds before it awaits anything: a
        connection flooded faster than this process reads it (an agent's own reply subjects,
        ``hub/_reply_boxes.py``) held the loop for up to a quarter of a megabyte at a time,
        and every other connection's messages, and every task, waited behind it. A read that
        fills ``DEFAULT_BUFFER_SIZE`` (more is likely waiting) and had a message dropped as a
        slow consumer (``slow_drops``: this process is not keeping up with the connection) is
        followed by one turn of the event loop. Any other read goes on as nats-py's: under a
        load it keeps up with, a connection's messages are taken in as large a pass as before
        (a turn after every full read measured 72-80 us of the hub's CPU a routed request at
        the routed benchmark's peak, against 62-68 without: likely its smaller passes, and so
        smaller batches of attempts and answers)."""
        while True:
            try:
                if self.is_closed or self.is_reconnecting or self._transport is None:
                    break
                if self._transport.at_eof():
                    err = nats.errors.UnexpectedEOF()
                    await self._error_cb(err)
                    await self._process_op_err(err)
                    break
                b = await self._transport.read(DEFAULT_BUFFER_SIZE)
                drops = self.slow_drops_total
                await self._ps.parse(b)
                if len(b) == DEFAULT_BUFFER_SIZE and self.slow_drops_total != drops:
                    await asyncio.sleep(0)
            except nats.errors.ProtocolError:
                await self._process_op_err(nats.errors.ProtocolError())
                break
            except OSError as e:
                await self._process_op_err(e)
                break
            except asyncio.CancelledError:
                break
            except Exception as ex:
                log.error("nats: encountered error", exc_info=ex)
                break

    async def _process_info(self, info: dict[str, Any], initial_connection: bool = False) -> None:
        await super()._process_info(info, initial_connection)
        urls = info.get("connect_urls")
        if not isinstance(urls, list) or not urls:
            return  # a server alone by design, or one that advertises no URLs
        self.listed_now = len(urls)
        if initial_connection or 2 * len(urls) >= self._listed:
            self._listed = len(urls) if initial_connection else max(self._listed, len(urls))
            return
        # A server lists its own client URL(s) and those of the servers it has a route to: one
        # that lists fewer than half the URLs it listed was cut off from most of its cluster
        # (its routes lost, the others up: a partition, on the minority's side). Counted in
        # URLs, not servers (a server may advertise several: the same share of each), and a
        # majority lost, not any route: one peer of two restarting, or lame duck's INFO (which
        # leaves its own URL out), is not a cut. It still takes this connection's
        # requests and publishes: the streams it led go on taking proposals they never
        # commit (5 s timeouts, then "duplicate message id is in process"), those it did not
        # lead answer 503, while the other side elects leaders and takes them. Chaos seed 202
        # (``partition``): a caller on a cut-off REACH_WF leader got nothing stored for the
        # whole 9 s cut, and that replica never caught up after it ("Expected first catchup
        # entry to be a snapshot and peerstate", nats-server 2.15.1): cut off in turn, the
        # next node took the stream's quorum (16 s without submissions). Reproduced with 20
        # submissions/s: it caught up at once when the caller left at once, and not when it
        # stayed (2 runs of 2) or left within a 0-1 s spread. Not seen: connected while one
        # server of three was down (2 URLs), the other two splitting (2 -> 1). The pool's size
        # is no better reference: it mixes host names given and addresses advertised, and a
        # server may advertise several — one peer restarting would look like a cut.
        if self.on_cut_off is not None:
            self._listed = len(urls)
            self.leaving_cut_off()
            self.on_cut_off()

    def leaving_cut_off(self) -> None:
        """It leaves its server as cut off (its own INFO said so, or a sibling's did:
        ``_nats_together``): that server (its ``server_id``, the name it is on) is tried last,
        and left again if the reconnection lands on it under another name
        (:meth:`back_where_left`). Left again (under another name), both names go last."""
        current = self._current_server
        here = frozenset() if current is None else frozenset({current.uri.netloc})
        info_id = (self._server_info or {}).get("server_id")
        left_id = info_id if isinstance(info_id, str) else None
        if left_id is None or left_id != self._left_id:
            self._left_at = frozenset()
        self._left = self._left_at = self._left_at | here
        self._left_id = left_id

    def back_where_left(self) -> bool:
        """Reconnected: whether on the server it left as cut off, under a name it was not left
        under — a server given under a host name is also in the pool under the address its
        INFO advertises, and that one was tried first after the leave. Then that name goes
        last too, and True: it leaves again. Under a name it was left under (nothing else took
        the connection), or on another server, it stays and forgets the one it left."""
        left = self._left_id
        current = self._current_server
        if left is None or current is None:
            return False
        if (self._server_info or {}).get("server_id") == left:
            netloc = current.uri.netloc
            if netloc not in self._left_at:
                self._left = self._left_at = self._left_at | {netloc}
                return True
        self._left_id, self._left, self._left_at = None, frozenset(), frozenset()
        return False

    async def _attempt_reconnect(self) -> None:
        _cut_if_open(self._transport, _CLOSE_DEAD)
        await super()._attempt_reconnect()

    async def _select_next_server(self) -> None:
        # nats-py's round robin over a shuffled pool, with a server left because it was cut
        # off put last: it takes connections, and would take this one back at once.
        left, self._left = self._left, frozenset()
        if left:
            self._server_pool.sort(key=lambda s: s.uri.netloc in left)
        await super()._select_next_server()

    # nats-py's awaits that swallow a cancellation (``reach_mesh._cancels``) raise it: its
    # requests and flush wait in Python 3.11's ``asyncio.wait_for``, which returns the answer
    # when the cancel lands as it comes in (a hub's branch cancelled as its status read was
    # answered ran on for 23 s through five new attempts: chaos secure seed 184,
    # ``node_stop``), and ``_flush_pending`` ends in ``except CancelledError: pass``. Every
    # JetStream context and KV call of nats-py requests through ``request``; ``JsClient``'s
    # own exchanges publish through ``_flush_pending`` and await plain futures.

    async def request(
        self,
        subject: str,
        payload: bytes = b"",
        timeout: float = 0.5,
        old_style: bool = False,
        headers: dict[str, Any] | None = None,
    ) -> Msg:
        # (Also when it raises: a 503 answer, ``NoRespondersError``, came with the cancel.)
        return await uncancelled(super().request(subject, payload, timeout, old_style, headers))

    async def flush(self, timeout: int = DEFAULT_FLUSH_TIMEOUT) -> None:
        await uncancelled(super().flush(timeout))

    async def _process_pong(self) -> None:
        """nats-py's, but a PONG whose PING's future is done already — a ``flush`` that timed
        out or was cancelled — is taken without setting it: nats-py's ``set_result`` on it
        raised ``InvalidStateError`` in the read loop, which ended there, and the connection
        read nothing more while it still said connected (``tests/test_nats_flush.py``)."""
        if self._pongs:
            future = self._pongs.pop(0)
            if not future.done():
                future.set_result(True)
            self._pongs_received += 1
            self._pings_outstanding = 0

    def _flush_pending(self, force_flush: bool = False) -> Coroutine[Any, Any, Any]:
        flusher = self._flusher_task
        queue = self._flush_queue
        if (flusher is None or flusher.done()) and self.is_connected and _closed(self._transport):
            return self._socket_gone()
        flush = NATS._flush_pending(self, force_flush)
        if force_flush or flusher is None or flusher.done() or queue is None or queue.full():
            return uncancelled(flush)  # it may wait: a forced flush, a full queue, a drain
        # Else (most publishes) it queues its future and returns without waiting: nothing to
        # swallow, and no coroutine more (one cost a publish ~0.6 µs).
        return flush

    async def _socket_gone(self) -> asyncio.Future[None]:
        """The socket closed under a connection nats-py still calls connected: its flusher,
        writing into it, ended on uvloop's ``RuntimeError`` without a word, and its read loop
        has not yet taken the close for a loss (it awaits the error callback first). nats-py
        would write into the closed socket at each publish and raise that ``RuntimeError`` to
        the publisher — a hub's step took it for a crash and failed its workflow (chaos secure
        seed 216, ``partition``). The data stays pending, as while reconnecting (nats-py sends
        it once reconnected), and the reconnection starts now."""
        if self._gone is None or self._gone.done():
            lost = ConnectionResetError("the socket closed under nats-py's flusher")
            self._gone = asyncio.get_running_loop().create_task(self._process_op_err(lost))
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        done.set_result(None)
        return done

    async def _close(self, status: int, do_cbs: bool = True) -> None:
        _cut_if_open(self._transport, _CLOSE_OWN)
        await super()._close(status, do_cbs)


def _closed(transport: object) -> bool:
    """Whether the socket under nats-py's ``transport`` is closed or closing (TCP and TLS;
    False for anything else)."""
    writer = getattr(transport, "_io_writer", None)
    return isinstance(writer, asyncio.StreamWriter) and writer.transport.is_closing()


def _cut_if_open(transport: object, delay: float) -> None:
    """Abort the socket under nats-py's ``transport`` if it is still open ``delay`` s from
    now (aborting one that closed meanwhile does nothing). Only for TCP and TLS."""
    writer = getattr(transport, "_io_writer", None)
    if not isinstance(writer, asyncio.StreamWriter):
        return  # not connected yet, or a websocket (aiohttp closes it on its own timeout)
    socket_transport = writer.transport
    asyncio.get_running_loop().call_later(delay, socket_transport.abort)


def _said(err: BaseException) -> str:
    """``str(err)``, or its repr when that raises: this runs in nats-py's read loop, which
    an exception ends (nats-py's ``ConsumerSequenceMismatchError`` for an idle heartbeat with
    no ``Nats-Last-Consumer`` — anyone's, forged on a push subscription — cannot be str'd)."""
    try:
        return str(err)
    except Exception:
        return repr(err)


def _from_callback(err: BaseException) -> bool:
    """Whether a subscription's message callback raised ``err`` (not the connection)."""
    tb = err.__traceback__
    return tb is not None and tb.tb_frame.f_code.co_name == _CALLBACK_RUNNER


class _Watch:
    """Logs what happens to a connection in plain words, at a sane rate: once when NATS is
    gone, every ``_GONE_LOG_INTERVAL`` seconds while it stays gone, once when it is back."""

    def __init__(self, name: str, url: str) -> None:
        self.name = name
        self.url = url
        self.connected = False
        self.last_error: BaseException | None = None
        self.nc: NATS | None = None
        #: Set when the server refuses our credentials during the first connect.
        self.refused = asyncio.Event()
        self.refusal: BaseException | None = None
        self._down_since: float | None = None
        self._logged_at = 0.0
        self._failures = 0
        #: Slow-consumer drops counted since the last report, the last subject, the report timer.
        self._slow = 0
        self._slow_subject = ""
        self._slow_timer: asyncio.TimerHandle | None = None
        #: When an error while connected was last logged (rate-limited like the gone ones).
        self._noted_at = -_GONE_LOG_INTERVAL
        #: When it last said that the server refuses its credentials while reconnecting.
        self._denied_at = -_GONE_LOG_INTERVAL
        #: Permissions violations: one line per refused subject per 30 s (a misconfigured
        #: agent is refused on every heartbeat, every publish).
        self._refused_lines = LineBudget(_GONE_LOG_INTERVAL)
        #: Leaving a server in lame-duck mode on purpose (``lame_duck``): not a loss to warn of.
        self._leaving = False

    async def error(self, err: Exception) -> None:
        self.last_error = err
        if not isinstance(err, _TRANSPORT_ERRORS) and _from_callback(err):
            # One of our message callbacks raised, and nats-py handed it over: a bug, not the
            # network. That message is lost; the subscription goes on.
            log.error("%s: a NATS message callback failed", self.name, exc_info=err)
            return
        if isinstance(err, nats.errors.SlowConsumerError):
            # (nats-py awaits this callback in its read loop as it drops the message: counted
            # before the next message of the connection is read — ``slow_drops``.)
            nc = self.nc
            if isinstance(nc, _Connection):
                nc.slow_drops[err.sid] = nc.slow_drops.get(err.sid, 0) + 1
                nc.slow_drops_total += 1
            self._slow_consumer(err.subject)
            return
        said = _said(err)
        refused = "permissions violation" in said.lower()
        if refused:
            # The server refusing this identity a subject (secure mode, docs/security.md).
            subject = refused_subject(said)
            refusals = self.nc.refusals if isinstance(self.nc, _Connection) else None
            if refusals is None or not refusals.expects(subject):
                self._refused_lines.warn(log, subject, "NATS refused %s: %s", self.name, err)
            if subject is not None and refusals is not None:
                refusals.note(subject)
        denied = (
            isinstance(err, nats.errors.AuthorizationError)
            # The handshake raises a plain nats Error with the server's -ERR text.
            or "authorization violation" in said.lower()
        )
        if not self.connected and denied:
            self.refusal = err
            self.refused.set()
        if not self.connected:
            return
        now = time.monotonic()
        if self._down_since is None:
            if isinstance(err, _LOSS_ERRORS):
                return  # the connection is lost: ``disconnected`` says so, once
            # Connected: a callback's own transport error, a server -ERR, a websocket or creds
            # error on the way to a reconnect. Worth a line, not a flood.
            if not refused and now - self._noted_at >= _GONE_LOG_INTERVAL:
                self._noted_at = now
                log.warning("%s: NATS error: %r", self.name, err)
            return
        self._failures += 1
        if denied:
            # Not unreachable: the server answers, and refuses who this is — its identity
            # revoked (`reach-mesh auth revoke`) and the server reloaded, or an auth.conf
            # without it. Said at once, not after 30 s of "unreachable".
            if now - self._denied_at >= _GONE_LOG_INTERVAL:
                self._denied_at = now
                log.error(
                    "%s: NATS at %s refuses this connection's credentials (%s; cut off %.0f s "
                    "ago, %d attempts): its identity was revoked, or the server's auth.conf "
                    "no longer holds it. Retrying every 0.25 s: stop this process if it was "
                    "revoked on purpose; else give it its identity again (reach-mesh auth "
                    "add-*, then reload the servers; docs/operations.md, 'Secure mode')",
                    self.name,
                    self.url,
                    said or type(err).__name__,
                    now - self._down_since,
                    self._failures,
                )
            return
        if now - self._logged_at >= _GONE_LOG_INTERVAL:
            self._logged_at = now
            log.warning(
                "%s: NATS at %s still unreachable after %.0f s (%d attempts; retrying every "
                "0.25 s): %s",
                self.name,
                self.url,
                now - self._down_since,
                self._failures,
                err or type(err).__name__,
            )

    def _slow_consumer(self, subject: str) -> None:
        if self._slow_timer is None:
            log.warning(
                "%s: slow consumer: a message on %s dropped (a subscription fell behind; more "
                "drops are counted and reported every %g s)",
                self.name,
                subject,
                _SLOW_LOG_INTERVAL,
            )
            loop = asyncio.get_running_loop()
            self._slow_timer = loop.call_later(_SLOW_LOG_INTERVAL, self._slow_report)
            return
        self._slow += 1
        self._slow_subject = subject

    def _slow_report(self) -> None:
        if not self._slow:
            self._slow_timer = None
            return
        log.warning(
            "%s: slow consumer: %d more message(s) dropped in %g s (the last on %s)",
            self.name,
            self._slow,
            _SLOW_LOG_INTERVAL,
            self._slow_subject,
        )
        self._slow = 0
        self._slow_timer = asyncio.get_running_loop().call_later(
            _SLOW_LOG_INTERVAL, self._slow_report
        )

    async def lame_duck(self) -> None:
        """The server announced lame-duck mode (nats-server's gentle shutdown, SIGUSR2 or
        ``--signal ldm``): it stops JetStream at once but closes its clients only after its
        grace period (10 s), during which work pulls, KV writes and heartbeats stored through
        it stalled — steps were sent again, leases expired. So leave it now, within
        ``_LAME_DUCK_SPREAD`` s, for another server of the pool (it takes no new connections:
        nats-py reconnects elsewhere). With no other server known, stay.

        Called on nats-py's reader: nothing here awaits."""
        self._leave(
            logging.INFO,
            "is shutting down (lame duck mode)",
            "staying until it closes this connection",
            _LAME_DUCK_SPREAD,
        )

    def cut_off(self) -> bool:
        """The server lost its routes to most of its cluster (``_Connection``): leave it
        for another server of the pool, one on the side that elects leaders (nats-py tries the
        others first; a server that is down refuses, and one cut off too says so again). At
        once, not spread as from a lame duck: what it takes meanwhile, the streams it leads
        propose and never commit. With no other server known, stay. True when it leaves.
        Called on nats-py's reader: nothing here awaits."""
        return self._leave(
            logging.WARNING,
            "lost its routes to most of its cluster (cut off: it lists fewer than half the "
            "servers it did)",
            "staying",
            0.0,
        )

    def _leave(self, level: int, why: str, staying: str, spread: float) -> bool:
        nc = self.nc
        if nc is None or not nc.is_connected:
            return False
        here = nc.connected_url
        others = [u for u in nc.servers if here is None or u.netloc != here.netloc]
        if not others:
            log.warning(
                "%s: NATS server %s %s and no other server is known: %s",
                self.name,
                _server_of(nc),
                why,
                staying,
            )
            return False
        log.log(
            level,
            "%s: NATS server %s %s: moving to another of %d",
            self.name,
            _server_of(nc),
            why,
            len(others),
        )
        self._leaving = True
        _cut_if_open(getattr(nc, "_transport", None), random.uniform(0, spread))
        return True

    async def disconnected(self) -> None:
        if not self.connected or self._down_since is not None:
            return
        if self.nc is not None and self.nc.is_closed:
            return  # closed on purpose
        self._down_since = self._logged_at = time.monotonic()
        self._failures = 0
        self._leaving = self._leaving or getattr(self.nc, "moving", False)
        log.log(
            logging.INFO if self._leaving else logging.WARNING,
            "%s: %s NATS at %s; reconnecting until it is back",
            self.name,
            "left" if self._leaving else "lost",
            _server_of(self.nc),
        )

    async def reconnected(self) -> None:
        leaving, self._leaving = self._leaving, False
        if isinstance(self.nc, _Connection):
            self.nc.moving = False
            self.nc.reconnects.note()
            if self.nc.back_where_left() and self.nc.on_cut_off is not None:
                self.nc.on_cut_off()  # (the server it left, under another name: again)
        if self._down_since is None:
            return
        down = time.monotonic() - self._down_since
        self._down_since = None
        log.log(
            logging.INFO if leaving else logging.WARNING,
            "%s: reconnected to NATS after %.1f s, at %s",
            self.name,
            down,
            _server_of(self.nc),
        )


def _server_of(nc: NATS | None) -> str:
    """The server a connection is on, or was on when it dropped (not the configured list: of
    a cluster's URLs, which one went away), credentials left out."""
    srv = getattr(nc, "_current_server", None)  # nats-py keeps no public name for a lost one
    uri = getattr(srv, "uri", None)
    if uri is None or not uri.hostname:
        return "?"
    return (
        f"{uri.scheme}://{uri.hostname}:{uri.port}"
        if uri.port
        else f"{uri.scheme}://{uri.hostname}"
    )


def _auth_options(settings: MeshSettings) -> dict[str, Any]:
    opts: dict[str, Any] = {}
    if settings.nats_creds:
        opts["user_credentials"] = settings.nats_creds
    if settings.nats_token:
        opts["token"] = settings.nats_token
    if settings.nats_nkey_seed:
        opts["nkeys_seed"] = settings.nats_nkey_seed
    if settings.nats_inbox_prefix:
        opts["inbox_prefix"] = settings.nats_inbox_prefix
    if settings.nats_tls_ca or settings.nats_tls_cert:
        ctx = ssl.create_default_context(cafile=settings.nats_tls_ca)
        if settings.nats_tls_cert:
            ctx.load_cert_chain(settings.nats_tls_cert, settings.nats_tls_key)
        opts["tls"] = ctx
    return opts


async def _first_connect(
    nc: NATS, opts: dict[str, Any], watch: _Watch, timeout: float, patience: float = 0.0
) -> None:
    """``nc.connect`` within ``timeout`` — or ``patience``, while a server's port answers;
    a refused authorization ends it at once.

    During the first connect nats-py only retries when reconnects are allowed; they stay on,
    and this bounds the time. Retrying a wrong credential cannot help, so it is not waited on.
    """
    loop = asyncio.get_running_loop()
    end = loop.time() + max(timeout, patience)
    connecting = asyncio.ensure_future(nc.connect(**opts))
    refused = asyncio.ensure_future(watch.refused.wait())
    try:
        wait = timeout
        while True:
            done, _ = await asyncio.wait(
                {connecting, refused}, timeout=wait, return_when=asyncio.FIRST_COMPLETED
            )
            if done or loop.time() >= end or not await answering(opts["servers"]):
                break
            if wait == timeout:
                log.warning(
                    "NATS at %s answers but has not taken the connection of %s in %gs (a busy "
                    "server, or not a NATS server at that port): still trying (up to %gs)",
                    watch.url,
                    watch.name,
                    timeout,
                    patience,
                )
            wait = min(1.0, end - loop.time())
    finally:
        for task in (connecting, refused):
            task.cancel()
        await asyncio.gather(connecting, refused, return_exceptions=True)
    if connecting in done:
        connecting.result()
        return
    if refused in done and watch.refusal is not None:
        raise watch.refusal
    raise TimeoutError(f"no connection within {timeout:g}s")


async def ensure_kv(
    js: JetStreamContext,
    bucket: str,
    *,
    replicas: int = 1,
    history: int = 1,
    ttl: float | None = None,
    description: str = "",
) -> KeyValue:
    """Bind to ``bucket``, creating it if it does not exist yet (idempotent across hubs).
    While a process starts, asked again through an election or an outage (``_starting``)."""
    cfg = KeyValueConfig(
        bucket=bucket,
        description=description,
        history=history,
        ttl=ttl,
        replicas=replicas,
        storage=StorageType.FILE,
        # Reads by key then name the key in the API subject ($JS.API.DIRECT.GET.<stream>.<key>),
        # where NATS permissions can limit an identity to its own keys (docs/security.md).
        direct=True,
    )

    async def bind() -> KeyValue:
        try:
            return await _with_direct_gets(js, await js.key_value(bucket))
        except BadBucketError as err:  # (says nothing of its own)
            raise BadBucketError(
                description=f"stream KV_{bucket} is not a key-value bucket"
            ) from err

    async def bind_or_create() -> KeyValue:
        try:
            return await bind()
        except BucketNotFoundError:
            pass
        try:
            return await js.create_key_value(cfg)
        except nats.js.errors.BadRequestError as err:
            # Another hub created it first with the same config (or a compatible one).
            try:
                return await bind()
            except BucketNotFoundError:
                # Not there, and not made: the refusal says why (too few peers up to hold
                # it, ci180: an outage; a stream in the way: not).
                raise await not_made(js, err, f"$KV.{bucket}.>") from None

    return await set_up(f"bucket {bucket}", bind_or_create)


async def _with_direct_gets(js: JetStreamContext, kv: KeyValue) -> KeyValue:
    """``kv`` with direct gets allowed on its stream: every read of reach-mesh's buckets is one
    (``$JS.API.DIRECT.GET``), and on a bucket made without them (by hand, by another tool, with
    nats-py's defaults) each is answered "no responders" — every workflow view and caller
    wait failed ``REACH_UNAVAILABLE`` (ci177: a test had made the record bucket so). Turned
    on where this identity may update the stream (a hub); else said, and ``kv`` kept."""
    if kv._direct:
        return kv
    stream = f"KV_{kv._name}"
    try:
        config = (await js.stream_info(stream)).config
        config.allow_direct = True
        await js.update_stream(config)
        fixed = await js.key_value(kv._name)
    except (TimeoutError, nats.errors.Error) as err:
        log.error(
            "bucket %s has direct gets off: every read of it will find no responders; "
            "turn them on (nats stream edit %s --allow-direct) or delete it for a hub to "
            "make it again (%r)",
            kv._name,
            stream,
            err,
        )
        return kv
    log.warning(
        "bucket %s had direct gets off (made by hand or by another tool): turned on, as "
        "every read of it needs them",
        kv._name,
    )
    return fixed
