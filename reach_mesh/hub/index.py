"""The hub's in-memory inverted index: which agents a selector admits, fast.

Pure data structure (no I/O): the registry feeds it from the KV watch and the router asks it for
candidates on every request. :meth:`AgentIndex.candidates` must return exactly the agents for
which :meth:`Selector.matches <reach_mesh.selector.Selector.matches>` is true; the test suite
checks that against the brute-force semantics with hypothesis.

Layout: capability → ids, key → value → ids (for ``=``/``!=``), key → ids (for ``exists``), and
per numeric key two lists of ``(quantity, agent_id)`` sorted with :mod:`bisect` — one of each
agent's largest quantity (answers ``>=``/``>``) and one of its smallest (answers ``<=``/``<``),
plus the same extremes by agent id for filtering a working set that is already small.
"""

from __future__ import annotations

import difflib
from bisect import bisect_left, bisect_right, insort
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from operator import itemgetter
from typing import Final

from reach_mesh.selector import CAPABILITY_KEY, Selector, Term, label_quantities

__all__ = ["AgentIndex", "NearMiss"]

_EMPTY: Final[frozenset[str]] = frozenset()
_FIRST: Final = itemgetter(0)
_NEG_INF: Final = float("-inf")
_POS_INF: Final = float("inf")
# difflib's default; low enough for ``cn_east``/``cn-east``, high enough to skip noise.
_SIMILARITY_CUTOFF: Final = 0.6


@dataclass
class NearMiss:
    """What nearly matched a selector, for ``REACH_NO_MATCH`` replies.

    ``partial``: ``(agent_id, failing_term)`` for agents that satisfy every term but one
    (only for selectors of two or more terms). ``similar_capabilities``: known capabilities
    close to requested ones that no agent has. ``similar_values``: for ``key=value`` terms that
    no agent satisfies, close values that do exist for that key (``cn_east`` → ``cn-east``).
    """

    partial: list[tuple[str, str]] = field(default_factory=list)
    similar_capabilities: list[str] = field(default_factory=list)
    similar_values: dict[str, list[str]] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.partial or self.similar_capabilities or self.similar_values)


@dataclass(frozen=True, slots=True)
class _Entry:
    """What an agent contributed to the index, kept so that an update removes exactly that."""

    capabilities: frozenset[str]
    labels: dict[str, str]
    keys: frozenset[str]
    # key -> (smallest, largest) quantity of that key on this agent
    bounds: dict[str, tuple[float, float]]


class _SortedQuantities:
    """Per numeric key: agents sorted by their smallest and by their largest quantity.

    An agent matches ``key >= x`` iff its largest quantity does, and ``key <= x`` iff its
    smallest does, so each agent is one entry per list and ranges are exact bisect slices.
    """

    __slots__ = ("by_max", "by_min", "high", "low")

    def __init__(self) -> None:
        self.by_min: list[tuple[float, str]] = []
        self.by_max: list[tuple[float, str]] = []
        # The same extremes by agent, for filtering an already small working set.
        self.low: dict[str, float] = {}
        self.high: dict[str, float] = {}

    def add(self, agent_id: str, low: float, high: float) -> None:
        insort(self.by_min, (low, agent_id))
        insort(self.by_max, (high, agent_id))
        self.low[agent_id] = low
        self.high[agent_id] = high

    def discard(self, agent_id: str, low: float, high: float) -> None:
        self.low.pop(agent_id, None)
        self.high.pop(agent_id, None)
        # Exact (quantity, id) lookup: O(log n) even when thousands of agents share a value.
        for seq, item in ((self.by_min, (low, agent_id)), (self.by_max, (high, agent_id))):
            i = bisect_left(seq, item)
            if i < len(seq) and seq[i] == item:
                del seq[i]

    def __len__(self) -> int:
        return len(self.by_min)

    def span(self, op: str, bound: float) -> tuple[list[tuple[float, str]], int, int]:
        """The list and the ``[lo, hi)`` slice of it holding the agents that satisfy the term."""
        if op == ">=":
            return self.by_max, bisect_left(self.by_max, bound, key=_FIRST), len(self.by_max)
        if op == ">":
            return self.by_max, bisect_right(self.by_max, bound, key=_FIRST), len(self.by_max)
        if op == "<=":
            return self.by_min, 0, bisect_right(self.by_min, bound, key=_FIRST)
        return self.by_min, 0, bisect_left(self.by_min, bound, key=_FIRST)


class AgentIndex:
    """Inverted index over agents' capabilities and labels, answering selectors by set algebra.

    Not thread-safe; the hub uses it from one event loop.
    """

    def __init__(self) -> None:
        self._entries: dict[str, _Entry] = {}
        self._by_cap: dict[str, set[str]] = {}
        self._by_value: dict[str, dict[str, set[str]]] = {}
        self._by_key: dict[str, set[str]] = {}
        self._quantities: dict[str, _SortedQuantities] = {}

    # -- maintenance -------------------------------------------------------------------------

    def upsert(self, agent_id: str, capabilities: Iterable[str], labels: Mapping[str, str]) -> None:
        """Add an agent, or replace everything previously indexed for it."""
        caps = frozenset(capabilities)
        labels = dict(labels)
        old = self._entries.get(agent_id)
        if old is not None:
            # Heartbeats re-send unchanged registrations; skip the remove/re-add churn.
            if old.capabilities == caps and old.labels == labels:
                return
            self._unindex(agent_id, old)
        bounds: dict[str, tuple[float, float]] = {}
        for key, value in labels.items():
            for qkey, q in label_quantities(key, value):
                low, high = bounds.get(qkey, (q, q))
                bounds[qkey] = (min(low, q), max(high, q))
        entry = _Entry(caps, labels, frozenset(labels) | frozenset(bounds), bounds)
        self._entries[agent_id] = entry
        for cap in caps:
            self._by_cap.setdefault(cap, set()).add(agent_id)
        for key, value in labels.items():
            self._by_value.setdefault(key, {}).setdefault(value, set()).add(agent_id)
        for key in entry.keys:
            self._by_key.setdefault(key, set()).add(agent_id)
        for key, (low, high) in bounds.items():
            sq = self._quantities.get(key)
            if sq is None:
                sq = self._quantities[key] = _SortedQuantities()
            sq.add(agent_id, low, high)

    def remove(self, agent_id: str) -> None:
        """Forget an agent; unknown ids are ignored (removal is idempotent)."""
        entry = self._entries.pop(agent_id, None)
        if entry is not None:
            self._unindex(agent_id, entry)

    def _unindex(self, agent_id: str, entry: _Entry) -> None:
        # Empty buckets are deleted so that key/value listings (and suggestions) stay truthful.
        for cap in entry.capabilities:
            _discard(self._by_cap, cap, agent_id)
        for key, value in entry.labels.items():
            values = self._by_value[key]
            _discard(values, value, agent_id)
            if not values:
                del self._by_value[key]
        for key in entry.keys:
            _discard(self._by_key, key, agent_id)
        for key, (low, high) in entry.bounds.items():
            sq = self._quantities[key]
            sq.discard(agent_id, low, high)
            if not sq:
                del self._quantities[key]

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, agent_id: object) -> bool:
        return agent_id in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    # -- queries -----------------------------------------------------------------------------

    def by_capability(self, capability: str) -> frozenset[str]:
        """The ids of agents that declare ``capability`` (a snapshot)."""
        ids = self._by_cap.get(capability)
        return frozenset(ids) if ids else _EMPTY

    def capability_names(self) -> set[str]:
        """Every capability at least one indexed agent declares."""
        return set(self._by_cap)

    def label_values(self, key: str) -> set[str]:
        """Every value the label ``key`` has on some agent."""
        return set(self._by_value.get(key, ()))

    def candidates(self, selector: Selector) -> set[str]:
        """The ids of agents matching every term of ``selector`` (a new set).

        Positive terms are ordered by their exact result size and evaluated smallest first, so
        the working set only shrinks; a numeric term that is not the smallest filters the working
        set by each agent's (min, max) instead of materialising its range. Negative terms
        (``!=``, ``!exists``) are subtracted at the end.
        """
        positive: list[tuple[int, Term]] = []
        negative: list[Term] = []
        for term in selector.terms:
            size = self._size(term)
            if size is None:
                negative.append(term)
            elif size == 0:
                return set()
            else:
                positive.append((size, term))

        if positive:
            positive.sort(key=_FIRST)
            result = self._materialise(positive[0][1])
            for _, term in positive[1:]:
                if term.number is not None:
                    result = self._filter_numeric(result, term)
                else:
                    result &= self._ids(term)
                if not result:
                    return result
        else:
            result = set(self._entries)
        for term in negative:
            if term.key == CAPABILITY_KEY:
                result -= self._by_cap.get(term.value or "", _EMPTY)
            elif term.op == "!=":
                result -= self._by_value.get(term.key, {}).get(term.value or "", _EMPTY)
            else:  # !exists
                result -= self._by_key.get(term.key, _EMPTY)
        return result

    def _size(self, term: Term) -> int | None:
        """Exact number of agents a positive term admits; ``None`` for negative terms."""
        op = term.op
        if op == "!=" or op == "!exists":
            return None
        if term.number is not None:
            sq = self._quantities.get(term.key)
            if sq is None:
                return 0
            _, lo, hi = sq.span(op, term.number)
            return hi - lo
        return len(self._ids(term))

    def _ids(self, term: Term) -> set[str] | frozenset[str]:
        """The (internal, do-not-mutate) id set of a positive set-backed term."""
        if term.key == CAPABILITY_KEY:
            return self._by_cap.get(term.value or "", _EMPTY)
        if term.op == "=":
            return self._by_value.get(term.key, {}).get(term.value or "", _EMPTY)
        return self._by_key.get(term.key, _EMPTY)  # exists

    def _materialise(self, term: Term) -> set[str]:
        if term.number is None:
            return set(self._ids(term))
        seq, lo, hi = self._quantities[term.key].span(term.op, term.number)
        return {agent_id for _, agent_id in seq[lo:hi]}

    def _filter_numeric(self, ids: set[str], term: Term) -> set[str]:
        sq = self._quantities.get(term.key)
        bound = term.number
        if sq is None or bound is None:
            return set()
        op = term.op
        # One comprehension per operator over a flat agent -> extreme dict: one dict lookup and
        # one comparison per agent, no per-agent calls. Agents without the key get the infinity
        # that fails every finite bound.
        if op == ">=":
            high = sq.high
            return {a for a in ids if high.get(a, _NEG_INF) >= bound}
        if op == ">":
            high = sq.high
            return {a for a in ids if high.get(a, _NEG_INF) > bound}
        low = sq.low
        if op == "<=":
            return {a for a in ids if low.get(a, _POS_INF) <= bound}
        return {a for a in ids if low.get(a, _POS_INF) < bound}

    def nearest(self, selector: Selector, limit: int = 5) -> NearMiss:
        """Suggestions for a selector that matched nothing (or too little).

        Cost is one :meth:`candidates` call per term plus difflib over known capabilities and
        the values of the unmatched keys; it runs on the (rare) no-match path only.
        """
        near = NearMiss()
        terms = selector.terms
        if len(terms) > 1:
            seen: set[str] = set()
            for i, term in enumerate(terms):
                rest = Selector(terms[:i] + terms[i + 1 :])
                misses = self.candidates(rest) - self.candidates(Selector((term,)))
                for agent_id in sorted(misses - seen):
                    if len(near.partial) >= limit:
                        break
                    seen.add(agent_id)
                    near.partial.append((agent_id, str(term)))
        known_caps: list[str] | None = None
        for term in terms:
            if term.op != "=" or term.value is None:
                continue
            if term.key == CAPABILITY_KEY:
                if term.value in self._by_cap:
                    continue
                if known_caps is None:
                    known_caps = sorted(self._by_cap)
                for cap in difflib.get_close_matches(
                    term.value, known_caps, n=limit, cutoff=_SIMILARITY_CUTOFF
                ):
                    if cap not in near.similar_capabilities:
                        near.similar_capabilities.append(cap)
            else:
                values = self._by_value.get(term.key, {})
                if term.value in values:
                    continue
                close = difflib.get_close_matches(
                    term.value, sorted(values), n=limit, cutoff=_SIMILARITY_CUTOFF
                )
                if close:
                    near.similar_values[term.key] = close
        return near


def _discard(mapping: dict[str, set[str]], key: str, agent_id: str) -> None:
    ids = mapping.get(key)
    if ids is not None:
        ids.discard(agent_id)
        if not ids:
            del mapping[key]
