"""A process's NATS connections kept on one server of a cluster, after reconnections too.

A hub holds eight connections (main; routes; statuses; agents; four for its agents' replies:
``hub/_hub.py``). Spread over a cluster's servers, a partition between those servers lost every
proxy route's answer (the request taken on one side, the task and the answer sent on the
other). At connect the others list main's server first (``_nats_urls.beside``); after that,
each connection reconnects on its own. :class:`Together` keeps them together from then on, with
one rule — *a connection goes where the others are*:

* When a connection reconnects (its server lost, a slow-consumer cut, a lame-duck notice), it
  tries the server its siblings are on first: the main one's for the others; for the
  main one, the server of a sibling that is up. Once per reconnection: if that server does
  not take it, it picks as nats-py would (the server tried least lately, the one it lost
  last, 0.25 s between two tries of one server) — no loop on a server that some connections
  reach and others do not — in an order of servers drawn at random per process and shared by
  its connections: lost at once (their server killed), they all land on the same one.
* When a connection is up on another server than the main one (one could not reach main's,
  or landed where main could not follow), it is *moved* there: its subscriptions
  are taken off its server first (UNSUB, then a round trip: what that server sent before is
  read, nothing after is sent), then it reconnects (nats-py subscribes them again on the new
  server; a route request meanwhile goes to another hub of the queue group, or is answered
  no-responders and asked again by the SDK; a status event is read back from REACH_STATUS
  once the statuses connection is back, as after any gap). At most one move per connection
  per main (re)connection, and one more per ``REJOIN_INTERVAL`` while it stays apart.
* When their server is cut off from most of its cluster (a partition between servers: its
  INFO lists fewer than half the client URLs it did, ``_nats._Connection``), they all leave it
  together (``connect``'s ``leave_cut_off``): the first connection told takes the others on
  that server along, and none is sent back there by the first rule while they reconnect (the
  server is left out of :meth:`Together.target`, and picked last, until they are together
  on another — another ``server_id``: all up on it again under its other name is not that;
  one that lands on it anyway under another name — a host name and an address — leaves it
  again, the siblings it took along too: ``_nats._Connection.back_where_left``). Staying, the
  hub was blind (no quorum on its side: nobody declared LOST, no write stored), its proposals
  went to stale leaders, and callers and agents, which leave such a server too, were on the
  other side; leaving is a reconnection, as when its server dies.

Nothing here runs per message: only on reconnections, and a check every ``REJOIN_INTERVAL``.
A single server (nothing discovered either) makes all of it a no-op: every pick is that one.
What each connection is on, and whether they are apart (:meth:`Together.servers`,
:meth:`Together.apart`), the hub says in ``/healthz`` and its ``reach_nats_server`` /
``reach_nats_split`` metrics; its moves are ``reach_nats_moves_total``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import random
import time
from collections.abc import Callable
from typing import Any, Final

import nats.errors
from nats.aio.client import Client as NATS
from nats.aio.client import Server
from nats.protocol import command as prot_command

from reach_mesh._nats import _Connection, flushed
from reach_mesh._nats_asking import reconnects_of
from reach_mesh.logs import LineBudget

__all__ = ["REJOIN_INTERVAL", "Together", "server_id", "server_name"]

log = logging.getLogger("reach_mesh.nats")

#: While a connection stays on another server than the main one (it could not reach main's),
#: a move there is tried again at most this often (and a line logged).
REJOIN_INTERVAL: Final = 30.0
#: How long a move waits for the server to confirm its UNSUBs before it reconnects anyway.
_UNSUB_WAIT: Final = 2.0
#: nats-py's wait between two tries of one server (``connect``'s ``reconnect_time_wait``).
_RETRY_WAIT: Final = 0.25


def server_id(nc: NATS | None) -> str | None:
    """The id of the server ``nc`` is connected to (None while it is not)."""
    if nc is None or not nc.is_connected:
        return None
    info = getattr(nc, "_server_info", None) or {}  # nats-py keeps the server's INFO there
    got = info.get("server_id")
    return got if isinstance(got, str) else None


def server_name(nc: NATS | None) -> str | None:
    """The server ``nc`` is connected to, as an operator knows it: its ``server_name`` (else
    host:port); None while it is not connected."""
    if nc is None or not nc.is_connected:
        return None
    info = getattr(nc, "_server_info", None) or {}
    name = info.get("server_name")
    if isinstance(name, str) and name and name != info.get("server_id"):
        return name
    url = nc.connected_url
    return None if url is None else f"{url.hostname}:{url.port}"


class _Pick:
    """The server one connection reconnects to (nats-py's ``reconnect_to_server_handler``,
    called before each try): where its siblings are, once per reconnection, else the one
    tried least lately, the one it lost last (unless it is moving: then back there first),
    then in the process's own random order (``Together.rank``)."""

    def __init__(self, together: Together, name: str) -> None:
        self._together = together
        self._name = name
        #: This reconnection's tries: server (netloc) → when.
        self._tried: dict[str, float] = {}
        #: Siblings' servers tried in this reconnection (not tried again as such).
        self.missed: set[str] = set()
        self._lost: str | None = None
        #: This reconnection is a move (``Together._move``).
        self.moving = False

    def reset(self, *, moving: bool = False) -> None:
        """A new reconnection begins (``moving``: a move, not a loss) or one ended."""
        self._tried.clear()
        self.missed.clear()
        self._lost = None
        self.moving = moving

    def __call__(self, servers: list[Server], info: dict[str, Any]) -> tuple[Server | None, float]:
        if not servers:
            return None, 0.0
        now = time.monotonic()
        if not self._tried:
            nc = self._together.connection(self._name)
            current = getattr(nc, "_current_server", None)
            self._lost = None if current is None else current.uri.netloc
        chosen: Server | None = None
        target = self._together.target(self._name)
        if target is not None and target not in self.missed:
            chosen = next((s for s in servers if s.uri.netloc == target), None)
            if chosen is not None:
                self.missed.add(target)  # (once: a success resets it)
        if chosen is None:
            chosen = min(servers, key=self._order)
        netloc = chosen.uri.netloc
        tried = self._tried.get(netloc)
        delay = 0.0 if tried is None else max(0.0, tried + _RETRY_WAIT - now)
        self._tried[netloc] = now + delay
        return chosen, delay

    def _order(self, s: Server) -> tuple[float, bool, bool, float]:
        netloc = s.uri.netloc
        lost_last = (netloc == self._lost) != self.moving
        shunned = self._together.shunned(netloc)
        return (self._tried.get(netloc, -math.inf), shunned, lost_last, self._together.rank(netloc))


class Together:
    """Keeps a process's named connections on the server of the first one added (the main
    one): see the module's docstring. ``options(name)`` goes into that connection's
    ``connect``, ``add(name, nc)`` once it is made, :meth:`start` once all are (and
    subscribed); :meth:`stop` before they are closed."""

    def __init__(self, owner: str) -> None:
        self.owner = owner
        self._conns: dict[str, NATS] = {}
        self._picks: dict[str, _Pick] = {}
        #: Moves made, per connection.
        self.moves: dict[str, int] = {}
        #: Per connection: the main connection's (server, reconnections) it last failed to
        #: join (moved, or by itself), and when — no move towards those again, but one per
        #: ``REJOIN_INTERVAL``.
        self._tried_for: dict[str, tuple[tuple[str, int], float]] = {}
        self._moving: set[str] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._ticker: asyncio.Task[None] | None = None
        self._stopped = False
        self._apart_lines = LineBudget(REJOIN_INTERVAL)
        self._ranks: dict[str, float] = {}
        #: Per connection: how it leaves a server cut off (``_nats._Watch.cut_off``: true
        #: when it leaves, false when it knows no other server and stays).
        self._leaves: dict[str, Callable[[], bool]] = {}
        #: Servers (netlocs) left as cut off, no target until the connections are together.
        self._shunned: set[str] = set()
        #: Those servers' ``server_id``: the same server under a name not left yet is no
        #: target either, and being together on it is not being together again elsewhere.
        self._left_ids: set[str] = set()
        #: Connections leaving a cut-off server (until they are back).
        self._leaving: set[str] = set()

    def options(self, name: str) -> dict[str, Any]:
        """``connect`` options of the connection ``name``."""
        pick = self._picks.setdefault(name, _Pick(self, name))
        return {"reconnect_to_server_handler": pick, "leave_cut_off": True}

    def add(self, name: str, nc: NATS) -> None:
        """``nc``, made with :meth:`options` of ``name``, is connected (the first added is the
        main one, which the others follow)."""
        self._conns[name] = nc
        self.moves.setdefault(name, 0)
        reconnects = reconnects_of(nc)
        if reconnects is not None:
            reconnects.listeners.append(lambda: self._back(name))
        leave = getattr(nc, "on_cut_off", None)
        if leave is not None:
            self._leaves[name] = leave
            nc.on_cut_off = lambda: self._cut_off(name)  # type: ignore[attr-defined]

    def _cut_off(self, name: str) -> bool:
        """Connection ``name``'s server lost its routes to most of its cluster: it and every
        connection on that server leave it (those that know another server), and it is no
        target while they reconnect. True when ``name`` leaves. Called on nats-py's reader:
        nothing here awaits."""
        nc = self._conns.get(name)
        here = server_id(nc)
        if self._stopped or nc is None or here is None:
            return False
        for other, conn in self._conns.items():
            url = conn.connected_url
            leave = self._leaves.get(other)
            if url is None or server_id(conn) != here or leave is None:
                continue
            if other not in self._leaving and leave():
                if isinstance(conn, _Connection):
                    conn.leaving_cut_off()  # (told by a sibling: it may not have read its INFO)
                self._leaving.add(other)
                self._shunned.add(url.netloc)
                self._left_ids.add(here)
        return name in self._leaving

    def start(self) -> None:
        """Its connections made and subscribed: one that is not on the main one's server
        (which ``beside`` did not know) is moved there now, and the rejoins begin."""
        if self._ticker is None and not self._stopped:
            self._ticker = asyncio.get_running_loop().create_task(
                self._tick(), name=f"reach-nats-together-{self.owner}"
            )
            self._check()

    def stop(self) -> None:
        """No more moves (the connections are about to be closed)."""
        self._stopped = True
        for task in [*self._tasks, self._ticker]:
            if task is not None:
                task.cancel()

    def rank(self, netloc: str) -> float:
        """A server's place among those none of the connections is on: drawn at random
        once per process (hubs spread over the cluster), the same for its connections — lost
        at once (their server killed), they all pick the same one first, and nothing moves."""
        got = self._ranks.get(netloc)
        if got is None:
            got = self._ranks[netloc] = random.random()
        return got

    def _staying(self, nc: NATS) -> bool:
        """Whether ``nc``, up on a server the connections left as cut off, stays there: it is
        on it under a name it left it under (nothing else took it), or it forgot that server
        already (``_nats._Connection.back_where_left``)."""
        url = nc.connected_url
        if url is None:
            return False
        if isinstance(nc, _Connection):
            return nc._left_id != server_id(nc) or url.netloc in nc._left_at
        return url.netloc in self._shunned

    def shunned(self, netloc: str) -> bool:
        """Whether ``netloc`` names a server the connections left as cut off (under any of
        its names they were on: a host name, an address), not yet together elsewhere."""
        return netloc in self._shunned

    def connection(self, name: str) -> NATS | None:
        return self._conns.get(name)

    @property
    def _main(self) -> tuple[str, NATS] | None:
        return next(iter(self._conns.items()), None)

    def target(self, name: str) -> str | None:
        """The server (netloc) connection ``name`` should reconnect to: the main one's; for
        the main one, that of the first sibling that is up. None: none is up."""
        main = self._main
        if main is None:
            return None
        others = (
            [main[1]] if name != main[0] else [nc for n, nc in self._conns.items() if n != name]
        )
        for nc in others:
            url = nc.connected_url
            if (
                url is not None
                and url.netloc not in self._shunned
                and server_id(nc) not in self._left_ids
            ):
                return url.netloc
        return None

    def servers(self) -> dict[str, str | None]:
        """The server each connection is on (None: it is reconnecting)."""
        return {name: server_name(nc) for name, nc in self._conns.items()}

    def apart(self) -> bool:
        """Whether the connections that are up are on more than one server."""
        ids = {server_id(nc) for nc in self._conns.values()}
        ids.discard(None)
        return len(ids) > 1

    def _back(self, name: str) -> None:
        """Connection ``name`` reconnected (its subscriptions are in place again)."""
        pick = self._picks.get(name)
        moved = pick is not None and pick.moving  # (this reconnection was a move's)
        main = self._main
        if pick is not None and main is not None and name != main[0]:
            url, count = main[1].connected_url, _count(main[1])
            here = server_id(main[1])
            tried = url is not None and (moved or url.netloc in pick.missed)
            if tried and here is not None and server_id(self._conns[name]) != here:
                # Moved, or it tried main's server in this reconnection, and is elsewhere: not
                # moved there again for this (re)connection of main's (until the next rejoin).
                self._tried_for[name] = ((here, count), time.monotonic())
        if pick is not None:
            pick.reset()
        self._leaving.discard(name)
        ids = {server_id(nc) for nc in self._conns.values()}
        if (
            len(ids) == 1
            and None not in ids
            and (
                not ids & self._left_ids
                or (not self._leaving and all(map(self._staying, self._conns.values())))
            )
        ):
            # Together again, elsewhere. (Not on the server left under another name, a host
            # name and an address: forgetting it there sent them back under the first name,
            # where they stayed through the cut.) Or all back (none leaving still) on the
            # server left, under a name each left it under: no other server took them, and
            # they stay (``_nats._Connection.back_where_left``) — kept shunned, a sibling
            # reconnecting alone later had no target and every rejoin sent it elsewhere:
            # apart for good.
            self._shunned.clear()
            self._left_ids.clear()
        if moved:
            # (Not before: a move decided while this reconnection ended has yet to happen.)
            self._moving.discard(name)
        self._check()

    def _check(self, *, again: bool = False) -> None:
        """Move each connection up on another server than the main one there (once per main
        (re)connection; ``again``: once more per ``REJOIN_INTERVAL``)."""
        main = self._main
        if self._stopped or main is None:
            return
        main_name, main_nc = main
        here = server_id(main_nc)
        if here is None:
            return  # main is reconnecting: it follows the others, or they it once it is back
        key = (here, _count(main_nc))
        now = time.monotonic()
        for name, nc in self._conns.items():
            if name == main_name or name in self._moving:
                continue
            there = server_id(nc)
            if there is None or there == here:
                continue
            last = self._tried_for.get(name)
            if (
                last is not None
                and last[0] == key
                and not (again and now - last[1] >= REJOIN_INTERVAL)
            ):
                self._apart_lines.warn(
                    log,
                    name,
                    "%s: NATS connection %s is on server %s, %s on %s (it could not reach that "
                    "one): a partition between those servers would lose route answers; a "
                    "move is tried again every %g s",
                    self.owner,
                    name,
                    server_name(nc),
                    main_name,
                    server_name(main_nc),
                    REJOIN_INTERVAL,
                )
                continue
            if last is not None and last[0] == key:
                self._tried_for[name] = (key, now)  # (the next rejoin: an interval from now)
            self._moving.add(name)
            task = asyncio.get_running_loop().create_task(self._move(name, nc, main_name, main_nc))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _move(self, name: str, nc: NATS, main_name: str, main_nc: NATS) -> None:
        """Reconnect ``nc`` to ``main_nc``'s server, its subscriptions taken off its server
        first (nats-py keeps them, and subscribes them again where it reconnects). Until that
        reconnection ends (``_back``), no other move of ``nc`` is decided."""
        pick = self._picks.get(name)
        forced = False
        try:
            here = server_id(main_nc)
            if nc.is_draining or nc.is_closed or here is None:
                return
            if not nc.is_connected or server_id(nc) == here:
                return  # reconnecting (it goes where main is), or there already
            log.info(
                "%s: NATS connection %s moving to server %s, where %s is (from %s)",
                self.owner,
                name,
                server_name(main_nc),
                main_name,
                server_name(nc),
            )
            self.moves[name] = self.moves.get(name, 0) + 1
            nc.moving = True  # type: ignore[attr-defined]  # (_nats._Connection: logged as a move)
            with contextlib.suppress(nats.errors.Error, OSError, TimeoutError):
                for sid in list(nc._subs):
                    await nc._send_command(prot_command.unsub_cmd(sid, 0))
                async with asyncio.timeout(_UNSUB_WAIT):
                    await flushed(nc)
            if pick is not None and (nc.is_connected or nc.is_reconnecting):
                # (Reconnecting already, lost meanwhile: that reconnection is the move.)
                pick.reset(moving=True)
                forced = True
                if nc.is_connected and not nc.is_draining:
                    await nc.force_reconnect()
            # (Else closing: nats-py subscribes again on a reconnection anyway.)
        except Exception:
            log.exception("%s: moving NATS connection %s failed", self.owner, name)
        finally:
            if not forced:
                self._moving.discard(name)
                nc.moving = False  # type: ignore[attr-defined]

    async def _tick(self) -> None:
        while not self._stopped:
            await asyncio.sleep(REJOIN_INTERVAL)
            self._check(again=True)


def _count(nc: NATS) -> int:
    reconnects = reconnects_of(nc)
    return 0 if reconnects is None else reconnects.count
