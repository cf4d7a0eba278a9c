"""The agent each task id was routed to, shared by the hubs (``TaskPins``).

A request-reply task whose answer the caller never got (its agent finished after the hub's
timeout, the answer was lost with the caller's connection, the hub died before answering) is
asked again with the same ``task_id``. The agent that has it answers the repeat from its
idempotency cache; any other agent would run the task a second time. So the retry goes to the
agent the task was routed to, while that agent is routable — whichever hub the retry reaches:
the hubs are one queue group, and a retry rarely reaches the hub that routed the first try.
An attempt the agent refused before ``ACCEPTED`` (nobody listening on its subject, busy, no
handler) puts the pin back on the agent it named before (``RoutingMixin._unpin``): that agent
never had the task, the one before may.

Every hub tells the others the pins it makes: at the end of each pass of its event loop that
made some, one message per namespace (``PINS_PER_MESSAGE`` pairs at most each) on
``reach.hubs.<ns>.pins`` (only hubs publish and subscribe there), a JSON array of
``[task_id, agent_id]`` pairs with the sender's hub id in the ``Reach-Hub`` header, so a hub
drops its own message unread. A retry comes after the caller's
timeout, long after the message; a retry that comes sooner is routed as if it were new —
unless the caller marks it as sent again (``Reach-Resend``): then a hub with no pin for it
asks the other hubs and the agents who holds it first (``hub/_holders.py``).

A hub that starts has heard none of the pins made before it (a restarted one has lost its
own), nor has one back on NATS those made while it was away: it asks on
``reach.hubs.<ns>.pins_ask`` once it listens for pins, and again whenever its connection comes
back, and every other hub
sends the newest ``PINS_REPLAY`` of its own and of its peers' again as usual (once a second at
most). Without it, a retry
that reached a hub restarted since its first try ran on another agent (the chaos suite's
routes under ``hub_kill``).
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator
from typing import Final

from reach_mesh.errors import ReachError
from reach_mesh.protocol import AGENT_ID_RE, TASK_ID_RE, loads

__all__ = [
    "HUB_HEADER",
    "PINS_KEPT",
    "PINS_PER_MESSAGE",
    "PINS_REPLAY",
    "TaskPins",
    "decode_pins",
    "encode_pins",
]

#: Task ids whose agent a hub remembers, at most, of its own routes and again of its peers'
#: (every namespace's together: past it, the namespace holding the most drops its oldest).
PINS_KEPT: Final = 100_000
#: Pairs in one ``reach.hubs.<ns>.pins`` message, at most (well under NATS' 1 MB payload).
PINS_PER_MESSAGE: Final = 2_048
#: The header naming the hub that sent a pins message.
HUB_HEADER: Final = "Reach-Hub"
#: A hub's newest pins it sends again when another hub starts (``pins_ask``), at most: the
#: retries that matter come within a request's timeout of their first try.
PINS_REPLAY: Final = 8 * PINS_PER_MESSAGE


class _Generations:
    """One namespace's pins: two generations of plain dicts, each up to half of ``PINS_KEPT``
    (an insert and at most two lookups: an LRU's bookkeeping cost several times that on the
    hot path); alone, an entry lives between half and all of ``PINS_KEPT`` inserts."""

    __slots__ = ("_new", "_old")

    def __init__(self) -> None:
        self._new: dict[str, str] = {}
        self._old: dict[str, str] = {}

    def __len__(self) -> int:
        return len(self._new) + len(self._old)

    def get(self, task_id: str) -> str | None:
        agent = self._new.get(task_id)
        return self._old.get(task_id) if agent is None else agent

    def put(self, task_id: str, agent_id: str) -> int:
        """Pin ``task_id``; the change in the entries held (+1, 0, or less when the older
        generation was dropped)."""
        new = self._new
        before = len(new)
        new[task_id] = agent_id
        grown = len(new) - before
        if len(new) >= PINS_KEPT // 2:
            grown -= len(self._old)
            self._old, self._new = new, {}
        return grown

    def shed(self) -> int:
        """Drop the older half of the pins (the older generation, or the older half of the
        only one, one pin at least); the entries dropped."""
        if self._old:
            dropped = len(self._old)
            self._old, self._new = self._new, {}
            return dropped
        new = self._new
        keep = dict(itertools.islice(new.items(), max(1, len(new) // 2), None))
        self._new = keep
        return len(new) - len(keep)

    def newest(self, most: int) -> list[tuple[str, str]]:
        """The ``most`` newest entries, newest first."""
        return list(
            itertools.islice(
                itertools.chain(reversed(self._new.items()), reversed(self._old.items())), most
            )
        )


class _Pinned:
    """Pins of every namespace, ``PINS_KEPT`` at most in all: past it, the namespace holding
    the most drops its older half — so one namespace's routes push out its own pins, never
    another's. (One pool for all once let a tenant's stream of routes, direct-mode decisions
    at that, which cost the hub no agent's answer, push every other tenant's pins out of
    every hub within seconds: their retries then ran again on another agent.)"""

    __slots__ = ("_by_ns", "_size")

    def __init__(self) -> None:
        self._by_ns: dict[str, _Generations] = {}
        self._size = 0

    def __len__(self) -> int:
        return self._size

    def get(self, namespace: str, task_id: str) -> str | None:
        kept = self._by_ns.get(namespace)
        return None if kept is None else kept.get(task_id)

    def put(self, namespace: str, task_id: str, agent_id: str) -> None:
        kept = self._by_ns.get(namespace)
        if kept is None:
            kept = self._by_ns[namespace] = _Generations()
        self._size += kept.put(task_id, agent_id)
        if self._size > PINS_KEPT:
            self._trim()

    def _trim(self) -> None:
        while self._size > PINS_KEPT:
            namespace, most = max(self._by_ns.items(), key=lambda item: len(item[1]))
            self._size -= most.shed()
            if not most:
                del self._by_ns[namespace]

    def newest(self, most: int) -> Iterator[tuple[str, list[tuple[str, str]]]]:
        """The newest pins, ``most`` at most, by namespace: each namespace its share, and
        what one holding fewer leaves goes to the others (a busy namespace's pins do not
        crowd out the others' here either)."""
        held = sorted(self._by_ns.items(), key=lambda item: len(item[1]))
        left = most
        for i, (namespace, kept) in enumerate(held):
            share = min(len(kept), left // (len(held) - i))
            if share > 0:
                left -= share
                yield namespace, kept.newest(share)


class TaskPins:
    """This hub's pins and those its peers told it, kept apart so that a busy peer does not
    push this hub's own pins out; and the pins made since they were last taken to be sent."""

    __slots__ = ("_out", "_own", "_peers")

    def __init__(self) -> None:
        self._own = _Pinned()
        self._peers = _Pinned()
        self._out: dict[str, list[tuple[str, str]]] = {}

    def get(self, namespace: str, task_id: str) -> str | None:
        """The agent ``task_id`` of ``namespace`` was last routed to, as far as this hub knows."""
        agent = self._own.get(namespace, task_id)
        return self._peers.get(namespace, task_id) if agent is None else agent

    def pin(self, namespace: str, task_id: str, agent_id: str) -> bool:
        """This hub routed ``task_id`` to ``agent_id``. True when it is the first pin to send
        since they were last taken (:meth:`outgoing`): the caller schedules the sending (until
        it takes them, later pins go with this one)."""
        self._own.put(namespace, task_id, agent_id)
        first = not self._out
        self._out.setdefault(namespace, []).append((task_id, agent_id))
        return first

    def outgoing(self) -> dict[str, list[tuple[str, str]]]:
        """The pins made since the last call, by namespace (and forget them)."""
        out, self._out = self._out, {}
        return out

    def recent(self, most: int) -> dict[str, list[tuple[str, str]]]:
        """The newest pins this hub knows, ``most`` at most of its own and as many of its
        peers', by namespace: what a hub that started since they were made has not heard
        (``pins_ask``) — a restarted hub lost its own, which its peers kept."""
        out: dict[str, list[tuple[str, str]]] = {}
        for kept in (self._own, self._peers):
            for namespace, pairs in kept.newest(most):
                out.setdefault(namespace, []).extend(pairs)
        return out

    def learn(self, namespace: str, pairs: list[tuple[str, str]]) -> None:
        """Pins a peer made (:func:`decode_pins`)."""
        peers = self._peers
        for task_id, agent_id in pairs:
            peers.put(namespace, task_id, agent_id)


def encode_pins(pairs: list[tuple[str, str]]) -> list[bytes]:
    """The bodies of ``reach.hubs.<ns>.pins`` messages carrying ``pairs`` (ids the hub
    validated already), ``PINS_PER_MESSAGE`` at most each."""
    return [
        json.dumps(pairs[i : i + PINS_PER_MESSAGE], separators=(",", ":")).encode()
        for i in range(0, len(pairs), PINS_PER_MESSAGE)
    ]


def decode_pins(data: bytes) -> list[tuple[str, str]]:
    """The pairs of a pins message; what is not a ``[task_id, agent_id]`` pair of valid ids
    is skipped (only hubs publish there: a malformed pair is a bug, not an attack to answer,
    but it must not grow the hub's memory)."""
    try:
        items = loads(data)
    except ReachError:
        return []
    if not isinstance(items, list):
        return []
    return [
        (item[0], item[1])
        for item in items[:PINS_PER_MESSAGE]
        if isinstance(item, list)
        and len(item) == 2
        and isinstance(item[0], str)
        and isinstance(item[1], str)
        and TASK_ID_RE.fullmatch(item[0])
        and AGENT_ID_RE.fullmatch(item[1])
    ]
