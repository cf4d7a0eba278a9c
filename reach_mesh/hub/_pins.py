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

#: Task ids whose agent a hub remembers, at most, of its own routes and again of its peers'.
PINS_KEPT: Final = 100_000
#: Pairs in one ``reach.hubs.<ns>.pins`` message, at most (well under NATS' 1 MB payload).
PINS_PER_MESSAGE: Final = 2_048
#: The header naming the hub that sent a pins message.
HUB_HEADER: Final = "Reach-Hub"
#: A hub's newest pins it sends again when another hub starts (``pins_ask``), at most: the
#: retries that matter come within a request's timeout of their first try.
PINS_REPLAY: Final = 8 * PINS_PER_MESSAGE


class _Generations:
    """Two generations of plain dicts, each up to half of ``PINS_KEPT``: an insert and at most
    two lookups (an LRU's bookkeeping cost several times that on the hot path); an entry lives
    between half and all of ``PINS_KEPT`` inserts."""

    __slots__ = ("_new", "_old")

    def __init__(self) -> None:
        self._new: dict[tuple[str, str], str] = {}
        self._old: dict[tuple[str, str], str] = {}

    def get(self, key: tuple[str, str]) -> str | None:
        agent = self._new.get(key)
        return self._old.get(key) if agent is None else agent

    def put(self, key: tuple[str, str], agent_id: str) -> None:
        new = self._new
        new[key] = agent_id
        if len(new) >= PINS_KEPT // 2:
            self._old, self._new = new, {}

    def newest(self, most: int) -> Iterator[tuple[tuple[str, str], str]]:
        """The ``most`` newest entries, newest first."""
        return itertools.islice(
            itertools.chain(reversed(self._new.items()), reversed(self._old.items())), most
        )


class TaskPins:
    """This hub's pins and those its peers told it, kept apart so that a busy peer does not
    push this hub's own pins out; and the pins made since they were last taken to be sent."""

    __slots__ = ("_out", "_own", "_peers")

    def __init__(self) -> None:
        self._own = _Generations()
        self._peers = _Generations()
        self._out: dict[str, list[tuple[str, str]]] = {}

    def get(self, namespace: str, task_id: str) -> str | None:
        """The agent ``task_id`` of ``namespace`` was last routed to, as far as this hub knows."""
        key = (namespace, task_id)
        agent = self._own.get(key)
        return self._peers.get(key) if agent is None else agent

    def pin(self, namespace: str, task_id: str, agent_id: str) -> bool:
        """This hub routed ``task_id`` to ``agent_id``. True when it is the first pin to send
        since they were last taken (:meth:`outgoing`): the caller schedules the sending (until
        it takes them, later pins go with this one)."""
        self._own.put((namespace, task_id), agent_id)
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
            for (namespace, task_id), agent_id in kept.newest(most):
                out.setdefault(namespace, []).append((task_id, agent_id))
        return out

    def learn(self, namespace: str, pairs: list[tuple[str, str]]) -> None:
        """Pins a peer made (:func:`decode_pins`)."""
        peers = self._peers
        for task_id, agent_id in pairs:
            peers.put((namespace, task_id), agent_id)


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
