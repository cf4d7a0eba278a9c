"""The hub's in-memory inverted index: which agents a selector admits, fast.

Pure data structure (no I/O): the registry feeds it from the KV watch and the router asks it for
candidates on every request. :meth:`AgentIndex.candidates` must return exactly the agents for
which :meth:`Selector.matches <reach_mesh.selector.Selector.matches>` is true; the test suite
checks that against the brute-force semantics with hypothesis.

Layout: capability → ids, key → value → ids (for ``=``/``!=``), key → ids (for ``exists``), as
sets of ids (``by_capability``, listings, suggestions) and as **bitmaps**, and per numeric key
bitmaps by each agent's largest quantity (answers ``>=``/``>``) and smallest (``<=``/``<``).

Selectors are answered on the bitmaps: each agent holds a small integer slot (freed slots are
reused, so bitmaps stay as long as the fleet is large), and a bitmap is a Python ``int`` with
the agents' slot bits set. A selector is then a handful of
big-integer ``&`` / ``& ~`` operations (C loops over 64-bit words: ~160 words for 10k agents)
instead of building and intersecting Python sets of thousands of ids; ids are materialised only
for the final result (:meth:`AgentIndex.candidates`), or not at all for callers that count or
sample (:meth:`AgentIndex.select`, which the router uses). Numeric comparisons use, per key, the
agents' slots by largest and by smallest quantity, OR-ed into suffix/prefix bitmaps over the
sorted distinct quantities when first asked after a change (cheap for the usual handful of
distinct values per key; O(distinct values) big-int ORs for a key that is unique per agent).
"""

from __future__ import annotations

import difflib
import heapq
import random
import re
from bisect import bisect_left, bisect_right
from collections.abc import Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import compress
from typing import Final

from reach_mesh.selector import CAPABILITY_KEY, CAPABILITY_RE, Selector, Term, label_quantities

__all__ = ["AgentIndex", "Matches", "NearMiss"]

_EMPTY: Final[frozenset[str]] = frozenset()
# difflib's default; low enough for ``cn_east``/``cn-east``, high enough to skip noise.
_SIMILARITY_CUTOFF: Final = 0.6
# format(bits, "b") is ASCII 0/1, most significant first; as 0/1 bytes it drives compress().
_BIT_FLAGS: Final = bytes.maketrans(b"01", b"\x00\x01")
_NONZERO_BYTE: Final = re.compile(rb"[^\x00]")
_BYTE_BITS: Final = tuple(tuple(i for i in range(8) if byte >> i & 1) for byte in range(256))
# Up to this many matches the byte scan beats writing out the whole bitmap (measured, 10k slots).
_SPARSE_MAX: Final = 400
# Lists of ids Matches.ids keeps by bitmap (AgentIndex._ids_cache) before it starts afresh:
# a few targets routed over and over; a large fleet's lists are ~8 bytes an id each.
_IDS_CACHED: Final = 64
# Registration changes a numeric key's range bitmaps absorb per query before they are rebuilt.
_DELTA_MAX: Final = 64


@dataclass
class NearMiss:
    """What nearly matched a selector, for ``REACH_NO_MATCH`` replies.

    ``partial``: ``(agent_id, failing_term)`` for agents that satisfy every term but one
    (only for selectors of two or more terms). ``similar_capabilities``: known capabilities
    close to requested ones that no agent has. ``similar_values``: for ``key=value`` terms that
    no agent satisfies, close values that do exist for that key (``cn_east`` → ``cn-east``).
    ``similar_keys``: for positive label terms whose key no agent has at all, close keys that
    agents do have (``regin=eu-west`` → ``region``; ``capability=…`` → ``cap``).
    """

    partial: list[tuple[str, str]] = field(default_factory=list)
    similar_capabilities: list[str] = field(default_factory=list)
    similar_values: dict[str, list[str]] = field(default_factory=dict)
    similar_keys: dict[str, list[str]] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(
            self.partial or self.similar_capabilities or self.similar_values or self.similar_keys
        )


@dataclass(frozen=True, slots=True)
class _Entry:
    """What an agent contributed to the index, kept so that an update removes exactly that."""

    capabilities: frozenset[str]
    labels: dict[str, str]
    keys: frozenset[str]
    # key -> (smallest, largest) quantity of that key on this agent
    bounds: dict[str, tuple[float, float]]
    slot: int


class _SortedQuantities:
    """Per numeric key: agents' slots by their smallest and by their largest quantity.

    An agent matches ``key >= x`` iff its largest quantity does, and ``key <= x`` iff its
    smallest does, so a range is the OR of the bitmaps of the distinct quantities in it: one
    suffix (or prefix) bitmap, looked up by bisecting the sorted distinct quantities.

    Those prefix/suffix bitmaps cost O(distinct quantities) big-int ORs to build, which is a
    lot for a key that is unique per agent (10k ORs) if every registration change threw them
    away. So a change is only noted (``_delta``: slot → its quantities now, or None when gone)
    and applied to the looked-up bitmap per query; past :data:`_DELTA_MAX` noted changes they
    are dropped and rebuilt when next asked.
    """

    __slots__ = (
        "_agents",
        "_delta",
        "_highs",
        "_lows",
        "_prefix",
        "_suffix",
        "bits_high",
        "bits_low",
    )

    def __init__(self, agents: list[str]) -> None:
        self._agents = agents  # the index's slot -> id list (shared, for the views below)
        # Slot bitmaps of the agents by smallest / largest quantity (disjoint per value).
        self.bits_low: dict[float, int] = {}
        self.bits_high: dict[float, int] = {}
        # Built on demand (None: not built): sorted distinct quantities; _prefix[i] is the OR
        # of bits_low over _lows[:i], _suffix[i] the OR of bits_high over _highs[i:].
        self._lows: list[float] = []
        self._highs: list[float] = []
        self._prefix: list[int] | None = None
        self._suffix: list[int] | None = None
        self._delta: dict[int, tuple[float, float] | None] = {}  # slot -> quantities now

    def add(self, slot: int, low: float, high: float) -> None:
        bit = 1 << slot
        self.bits_low[low] = self.bits_low.get(low, 0) | bit
        self.bits_high[high] = self.bits_high.get(high, 0) | bit
        self._note(slot, (low, high))

    def discard(self, slot: int, low: float, high: float) -> None:
        keep = ~(1 << slot)
        for bits, q in ((self.bits_low, low), (self.bits_high, high)):
            rest = bits.get(q, 0) & keep
            if rest:
                bits[q] = rest
            else:
                bits.pop(q, None)
        self._note(slot, None)

    def _note(self, slot: int, now: tuple[float, float] | None) -> None:
        if self._prefix is None:
            return  # nothing built: the next query builds from the bitmaps as they are
        if len(self._delta) >= _DELTA_MAX:
            self._prefix = self._suffix = None  # too many changes: rebuild when next asked
            self._delta.clear()
        else:
            self._delta[slot] = now

    def __len__(self) -> int:
        return len(self.bits_low)

    def bits(self, op: str, bound: float) -> int:
        """Slot bitmap of the agents that satisfy ``key <op> bound``."""
        if self._prefix is None or self._suffix is None:
            self._rebuild()
            assert self._prefix is not None and self._suffix is not None
        if op == ">=":
            result = self._suffix[bisect_left(self._highs, bound)]
        elif op == ">":
            result = self._suffix[bisect_right(self._highs, bound)]
        elif op == "<=":
            result = self._prefix[bisect_right(self._lows, bound)]
        else:
            result = self._prefix[bisect_left(self._lows, bound)]
        # Slots changed since the build: each one's state now decides (slots are independent).
        for slot, now in self._delta.items():
            if now is not None and _satisfies(op, now, bound):
                result |= 1 << slot
            else:
                result &= ~(1 << slot)
        return result

    def _rebuild(self) -> None:
        self._highs = sorted(self.bits_high)
        suffix = [0] * (len(self._highs) + 1)
        acc = 0
        for i in range(len(self._highs) - 1, -1, -1):
            acc |= self.bits_high[self._highs[i]]
            suffix[i] = acc
        self._lows = sorted(self.bits_low)
        prefix = [0]
        acc = 0
        for q in self._lows:
            acc |= self.bits_low[q]
            prefix.append(acc)
        self._prefix, self._suffix = prefix, suffix
        self._delta.clear()

    # Views by agent id, derived from the bitmaps (introspection; queries never use them).

    @property
    def by_min(self) -> list[tuple[float, str]]:
        """``(smallest quantity, agent_id)`` of every agent, sorted."""
        return sorted((q, a) for q, bits in self.bits_low.items() for a in self._ids(bits))

    @property
    def by_max(self) -> list[tuple[float, str]]:
        """``(largest quantity, agent_id)`` of every agent, sorted."""
        return sorted((q, a) for q, bits in self.bits_high.items() for a in self._ids(bits))

    @property
    def low(self) -> dict[str, float]:
        """agent_id -> its smallest quantity of the key."""
        return {a: q for q, bits in self.bits_low.items() for a in self._ids(bits)}

    @property
    def high(self) -> dict[str, float]:
        """agent_id -> its largest quantity of the key."""
        return {a: q for q, bits in self.bits_high.items() for a in self._ids(bits)}

    def _ids(self, bits: int) -> list[str]:
        return _ids_of(self._agents, bits)


class Matches(Collection[str]):
    """The agents a selector admits, as a slot bitmap of an :class:`AgentIndex`.

    ``len()`` is a popcount; ids are materialised (once, in slot order) only when iterated or
    sampled. A snapshot of the index as it was: use it before the index changes again (the
    router does, within one synchronous decision), since freed slots are reused.
    """

    __slots__ = ("_agents", "_bits", "_cache", "_ids", "_len", "_slots")

    def __init__(self, index: AgentIndex, bits: int) -> None:
        self._bits = bits
        self._agents = index._agents
        self._cache = index._ids_cache
        self._slots = index._slots
        self._len = bits.bit_count()
        self._ids: list[str] | None = None

    def __len__(self) -> int:
        return self._len

    def __contains__(self, agent_id: object) -> bool:
        slot = self._slots.get(agent_id) if isinstance(agent_id, str) else None
        return slot is not None and (self._bits >> slot) & 1 == 1

    def __iter__(self) -> Iterator[str]:
        return iter(self.ids())

    def ids(self) -> list[str]:
        """The matching ids, in slot order (a list shared by later calls: do not mutate)."""
        if self._ids is None:
            # The index's lists of ids by bitmap (valid while no slot changes hands): a route
            # by capability asks for the same bitmap decision after decision.
            ids = self._cache.get(self._bits)
            if ids is None:
                if len(self._cache) >= _IDS_CACHED:
                    self._cache.clear()
                ids = self._cache[self._bits] = _ids_of(self._agents, self._bits)
            self._ids = ids
        return self._ids

    def sample(self, rng: random.Random, k: int) -> list[str]:
        """``k`` distinct matching ids, a uniform random sample (like ``rng.sample``)."""
        bits = self._bits
        width = bits.bit_length()
        if self._ids is not None or self._len <= _SPARSE_MAX or 8 * self._len < width:
            return rng.sample(self.ids(), k)
        if k > self._len // 2:
            return rng.sample(self.ids(), k)
        # A dense set: draw random slots and keep those in the set (rejection sampling, exactly
        # uniform) instead of materialising every id; at >= 1/8 density, ~k/density draws.
        # flags[j] is slot width-1-j (binary text is most significant first).
        flags = format(bits, "b").encode().translate(_BIT_FLAGS)
        agents = self._agents
        draw = rng.getrandbits
        draw_width = width.bit_length()
        seen: set[int] = set()
        out: list[str] = []
        while len(out) < k:
            j = draw(draw_width)
            if j < width and flags[j] and j not in seen:
                seen.add(j)
                out.append(agents[width - 1 - j])
        return out


def _ids_of(agents: list[str], bits: int) -> list[str]:
    """The ids whose slot bits are set in ``bits``, in slot order.

    Dense results: the bitmap is written out as ASCII binary (C), turned into 0/1 bytes and
    reversed so that byte ``i`` is slot ``i``, and ``itertools.compress`` picks the ids (C), with
    no Python-level loop over bits (~60 µs for 10k slots whatever the count). Sparse results:
    a regex finds the non-zero bytes (C) and a table gives each one's bits (a few µs for a few
    ids). ``agents`` has a placeholder at free slots, whose bits are never set.
    """
    if not bits:
        return []
    if bits.bit_count() > _SPARSE_MAX:
        flags = format(bits, "b").encode().translate(_BIT_FLAGS)[::-1]
        return list(compress(agents, flags))
    raw = bits.to_bytes((bits.bit_length() + 7) // 8, "little")
    out: list[str] = []
    for match in _NONZERO_BYTE.finditer(raw):
        i = match.start()
        base = i << 3
        out.extend([agents[base + b] for b in _BYTE_BITS[raw[i]]])
    return out


class AgentIndex:
    """Inverted index over agents' capabilities and labels, answering selectors by set algebra
    on slot bitmaps (see the module docstring).

    Not thread-safe; the hub uses it from one event loop.
    """

    def __init__(self) -> None:
        self._entries: dict[str, _Entry] = {}
        self._by_cap: dict[str, set[str]] = {}
        self._by_value: dict[str, dict[str, set[str]]] = {}
        self._by_key: dict[str, set[str]] = {}
        self._quantities: dict[str, _SortedQuantities] = {}
        # Slots: agent -> slot, slot -> agent ("" when free), free slots (a min-heap: the lowest
        # is reused first, which keeps bitmaps short), and the bitmap of every indexed agent.
        self._slots: dict[str, int] = {}
        self._agents: list[str] = []
        self._free: list[int] = []
        self._all = 0
        # Matches.ids's lists by bitmap; emptied whenever a slot is taken or freed (the
        # slot -> agent mapping they were read from changes then, and only then).
        self._ids_cache: dict[int, list[str]] = {}
        # Every indexed agent of a namespace (the first token of its id): a route is answered
        # within its own namespace, never by scanning the others' agents.
        self._ns_bits: dict[str, int] = {}
        # The bitmap twins of _by_cap, _by_value and _by_key.
        self._cap_bits: dict[str, int] = {}
        self._value_bits: dict[str, dict[str, int]] = {}
        self._key_bits: dict[str, int] = {}

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
            slot = old.slot  # keeps its slot: the other bitmaps need no change
        else:
            slot = self._take_slot(agent_id)
        bit = 1 << slot
        bounds: dict[str, tuple[float, float]] = {}
        for key, value in labels.items():
            for qkey, q in label_quantities(key, value):
                low, high = bounds.get(qkey, (q, q))
                bounds[qkey] = (min(low, q), max(high, q))
        entry = _Entry(caps, labels, frozenset(labels) | frozenset(bounds), bounds, slot)
        self._entries[agent_id] = entry
        cap_bits = self._cap_bits
        for cap in caps:
            self._by_cap.setdefault(cap, set()).add(agent_id)
            cap_bits[cap] = cap_bits.get(cap, 0) | bit
        for key, value in labels.items():
            self._by_value.setdefault(key, {}).setdefault(value, set()).add(agent_id)
            values = self._value_bits.setdefault(key, {})
            values[value] = values.get(value, 0) | bit
        key_bits = self._key_bits
        for key in entry.keys:
            self._by_key.setdefault(key, set()).add(agent_id)
            key_bits[key] = key_bits.get(key, 0) | bit
        for key, (low, high) in bounds.items():
            sq = self._quantities.get(key)
            if sq is None:
                sq = self._quantities[key] = _SortedQuantities(self._agents)
            sq.add(slot, low, high)

    def remove(self, agent_id: str) -> None:
        """Forget an agent; unknown ids are ignored (removal is idempotent)."""
        entry = self._entries.pop(agent_id, None)
        if entry is not None:
            self._unindex(agent_id, entry)
            self._release_slot(agent_id, entry.slot)

    def _take_slot(self, agent_id: str) -> int:
        if self._free:
            slot = heapq.heappop(self._free)
            self._agents[slot] = agent_id
        else:
            slot = len(self._agents)
            self._agents.append(agent_id)
        self._slots[agent_id] = slot
        self._ids_cache.clear()
        self._all |= 1 << slot
        ns = agent_id.partition(".")[0]
        self._ns_bits[ns] = self._ns_bits.get(ns, 0) | 1 << slot
        return slot

    def _release_slot(self, agent_id: str, slot: int) -> None:
        del self._slots[agent_id]
        self._ids_cache.clear()
        self._all &= ~(1 << slot)
        _clear_bit(self._ns_bits, agent_id.partition(".")[0], ~(1 << slot))
        self._agents[slot] = ""
        if slot == len(self._agents) - 1:
            # Trim the tail (and free slots now at the end) so the slot list shrinks back.
            agents = self._agents
            agents.pop()
            while agents and not agents[-1]:
                agents.pop()
            self._free = [s for s in self._free if s < len(agents)]
            heapq.heapify(self._free)
        else:
            heapq.heappush(self._free, slot)

    def _unindex(self, agent_id: str, entry: _Entry) -> None:
        # Empty buckets are deleted so that key/value listings (and suggestions) stay truthful.
        keep = ~(1 << entry.slot)
        for cap in entry.capabilities:
            _discard(self._by_cap, cap, agent_id)
            _clear_bit(self._cap_bits, cap, keep)
        for key, value in entry.labels.items():
            values = self._by_value[key]
            _discard(values, value, agent_id)
            if not values:
                del self._by_value[key]
            value_bits = self._value_bits[key]
            _clear_bit(value_bits, value, keep)
            if not value_bits:
                del self._value_bits[key]
        for key in entry.keys:
            _discard(self._by_key, key, agent_id)
            _clear_bit(self._key_bits, key, keep)
        for key, (low, high) in entry.bounds.items():
            sq = self._quantities[key]
            sq.discard(entry.slot, low, high)
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
        """The ids of agents matching every term of ``selector`` (a new set)."""
        return set(_ids_of(self._agents, self._bits(selector)))

    def select(self, selector: Selector, namespace: str | None = None) -> Matches:
        """The agents (of ``namespace``, when given) matching every term of ``selector``, as
        :class:`Matches`: counted and sampled without building a set of ids (what the router
        needs for large sets)."""
        return Matches(self, self._bits(selector, self._within(namespace)))

    def capable(self, capability: str, namespace: str) -> Matches:
        """The agents of ``namespace`` that serve ``capability``."""
        return Matches(self, self._cap_bits.get(capability, 0) & self._within(namespace))

    def members(self, namespace: str) -> Matches:
        """Every indexed agent of ``namespace``."""
        return Matches(self, self._within(namespace))

    def _within(self, namespace: str | None) -> int:
        return self._all if namespace is None else self._ns_bits.get(namespace, 0)

    def _bits(self, selector: Selector, within: int | None = None) -> int:
        """Slot bitmap of the agents (among ``within``: all by default) matching every term:
        positive terms AND-ed (stopping at the first empty result), negative terms (``!=``,
        ``!exists``) AND-NOT-ed."""
        result = self._all if within is None else within
        if not result:
            return 0
        negative = 0
        for term in selector.terms:
            op = term.op
            key = term.key
            if op == "!=" or op == "!exists":
                if key == CAPABILITY_KEY:
                    negative |= self._cap_bits.get(term.value or "", 0)
                elif op == "!=":
                    negative |= self._value_bits.get(key, {}).get(term.value or "", 0)
                else:
                    negative |= self._key_bits.get(key, 0)
                continue
            if key == CAPABILITY_KEY:
                bits = self._cap_bits.get(term.value or "", 0)
            elif term.number is not None:
                sq = self._quantities.get(key)
                bits = sq.bits(op, term.number) if sq is not None else 0
            elif op == "=":
                bits = self._value_bits.get(key, {}).get(term.value or "", 0)
            else:  # exists
                bits = self._key_bits.get(key, 0)
            result &= bits
            if not result:
                return 0
        return result & ~negative if negative else result

    def nearest(self, selector: Selector, limit: int = 5, namespace: str | None = None) -> NearMiss:
        """Suggestions for a selector that matched nothing (or too little), from the agents of
        ``namespace`` when given (else of all).

        Cost is two bitmap evaluations per term plus difflib over known capabilities and the
        values of the unmatched keys; it runs on the (rare) no-match path only.
        """
        near = NearMiss()
        terms = selector.terms
        within = self._within(namespace)
        if len(terms) > 1:
            seen: set[str] = set()
            for i, term in enumerate(terms):
                rest = Selector(terms[:i] + terms[i + 1 :])
                # On bitmaps: only the (few) near misses are turned into ids.
                misses = self._bits(rest, within) & ~self._bits(Selector((term,)))
                for agent_id in sorted(set(_ids_of(self._agents, misses)) - seen):
                    if len(near.partial) >= limit:
                        break
                    seen.add(agent_id)
                    near.partial.append((agent_id, str(term)))
        known_caps: list[str] | None = None
        for term in terms:
            if term.op != "=" or term.value is None:
                continue
            if term.key == CAPABILITY_KEY:
                if self._cap_bits.get(term.value, 0) & within:
                    continue
                if known_caps is None:
                    known_caps = sorted(
                        cap for cap, bits in self._cap_bits.items() if bits & within
                    )
                for cap in difflib.get_close_matches(
                    term.value, known_caps, n=limit, cutoff=_SIMILARITY_CUTOFF
                ):
                    if cap not in near.similar_capabilities:
                        near.similar_capabilities.append(cap)
            else:
                values = self._value_bits.get(term.key, {})
                if values.get(term.value, 0) & within:
                    continue
                close = difflib.get_close_matches(
                    term.value,
                    sorted(v for v, bits in values.items() if bits & within),
                    n=limit,
                    cutoff=_SIMILARITY_CUTOFF,
                )
                if close:
                    near.similar_values[term.key] = close
        self._similar_keys(terms, within, limit, near)
        return near

    def _similar_keys(self, terms: Sequence[Term], within: int, limit: int, near: NearMiss) -> None:
        """``near.similar_keys``: a positive label term (``=``, ``exists``, a comparison) whose
        key no agent of ``within`` has is most likely a misspelled key, not a missing agent."""
        known: list[str] | None = None
        for term in terms:
            key = term.key
            if key == CAPABILITY_KEY or term.op in ("!=", "!exists") or key in near.similar_keys:
                continue
            if self._key_bits.get(key, 0) & within:
                continue
            if term.op == "=" and CAPABILITY_RE.fullmatch(term.value or "") is not None:
                near.similar_keys[key] = [CAPABILITY_KEY]  # capability=a:b:v1 means cap=a:b:v1
                continue
            if known is None:
                known = sorted(k for k, bits in self._key_bits.items() if bits & within)
            pool = known if term.number is None else [k for k in known if k in self._quantities]
            close = difflib.get_close_matches(key, pool, n=limit, cutoff=_SIMILARITY_CUTOFF)
            if close:
                near.similar_keys[key] = close


def _discard(mapping: dict[str, set[str]], key: str, agent_id: str) -> None:
    ids = mapping.get(key)
    if ids is not None:
        ids.discard(agent_id)
        if not ids:
            del mapping[key]


def _clear_bit(mapping: dict[str, int], key: str, keep: int) -> None:
    bits = mapping.get(key, 0) & keep
    if bits:
        mapping[key] = bits
    else:
        mapping.pop(key, None)


def _satisfies(op: str, quantities: tuple[float, float], bound: float) -> bool:
    """Whether an agent with (smallest, largest) ``quantities`` of a key satisfies the term."""
    low, high = quantities
    if op == ">=":
        return high >= bound
    if op == ">":
        return high > bound
    if op == "<=":
        return low <= bound
    return low < bound
