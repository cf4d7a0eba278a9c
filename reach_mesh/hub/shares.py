"""Fairness between namespaces: who may take more of a hub once it is full.

A hub's room is shared by every tenant — ``hub_concurrency`` route flights, and
``workflow_concurrency`` owned workflows — and tenants whose agents hang, or that submit floods of
long workflows, would otherwise fill it and leave the others waiting behind them. A
:class:`Shares` counts what each namespace holds and decides, work-conserving: while the hub
has room anyone may take it (one tenant alone may use all of it); once it is full, a namespace
may take more only while it holds less than its fair share — the capacity divided among the
namespaces holding anything, itself counted. So a newcomer is served at once, beyond the
capacity, while those that filled the hub wait (routes: ``REACH_THROTTLED``; workflow
submissions go back to the stream for later, :func:`defer_delay`). What is held is never taken
back, so fair shares add up past the capacity — with k namespaces arriving one after another,
to about ln(k) + 0.6 times it — and nobody takes more at :data:`CEILING` times the capacity
(some 30 namespaces filling a hub one after another).

Pure (no I/O), touched only on the event loop.
"""

from __future__ import annotations

from typing import Final

__all__ = ["CEILING", "Shares", "defer_delay"]

#: Past this many times its capacity a hub takes nothing more, fair share or not.
CEILING: Final = 4
#: A deferred submission's delay at its second delivery, doubled with each one after, up to
#: :data:`DEFER_MAX`; the first goes back at once, for a hub with room to take.
DEFER_BASE: Final = 0.5
#: The longest a deferred submission waits before it is offered again: bounds both how late
#: a namespace's backlog starts once it is under its share and how often a hub sees it again.
DEFER_MAX: Final = 30.0


class Shares:
    """What each namespace holds of a hub's ``capacity``. Only namespaces that hold something
    have an entry, so the size is bounded by what is in progress."""

    __slots__ = ("_held", "capacity", "total")

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be at least 1, got {capacity}")
        self.capacity = capacity
        #: Everything held, by every namespace (may pass ``capacity``: fair shares).
        self.total = 0
        self._held: dict[str, int] = {}

    def held(self, ns: str) -> int:
        return self._held.get(ns, 0)

    def share(self, ns: str) -> int:
        """``ns``'s fair share of the capacity: divided among the namespaces holding anything,
        ``ns`` counted."""
        holders = len(self._held) + (0 if ns in self._held else 1)
        return max(1, self.capacity // holders)

    @property
    def ceiling(self) -> int:
        """What all namespaces together may hold: :data:`CEILING` times the capacity."""
        return CEILING * self.capacity

    def admits(self, ns: str) -> bool:
        """Whether ``ns`` may take one more: always while the hub has room, and once it is full
        only below its fair share (and below the ceiling)."""
        total = self.total
        if total < self.capacity:
            return True
        return total < self.ceiling and self._held.get(ns, 0) < self.share(ns)

    def take(self, ns: str, n: int = 1) -> None:
        """``ns`` takes ``n`` (one workflow, or its bytes)."""
        self._held[ns] = self._held.get(ns, 0) + n
        self.total += n

    def give(self, ns: str, n: int = 1) -> None:
        """``ns`` gives back ``n`` of what it took."""
        held = self._held.pop(ns, 0)
        if held == 0:
            return  # never taken: nothing to give back
        n = min(n, held)
        self.total -= n
        if held > n:
            self._held[ns] = held - n

    def __len__(self) -> int:
        """Namespaces holding anything."""
        return len(self._held)

    def __repr__(self) -> str:
        return f"Shares(capacity={self.capacity}, total={self.total}, held={self._held!r})"


def defer_delay(deliveries: int) -> float:
    """How long a submission deferred at its ``deliveries``-th delivery waits before it is
    offered again: at once the first time (another hub may have room), then 0.5 s, doubling,
    at most 30 s."""
    if deliveries <= 1:
        return 0.0
    return min(DEFER_MAX, DEFER_BASE * 2.0 ** min(deliveries - 2, 16))
