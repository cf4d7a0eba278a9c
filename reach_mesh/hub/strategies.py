"""Routing strategies: pick one agent among the routable candidates, and say why.

Pure (no I/O). Every strategy returns its choice together with a score per candidate it looked
at, which the router records in the explained decision. Score conventions:

==================  ============================================================  ============
strategy            score                                                         chosen is
==================  ============================================================  ============
``least_loaded``    :func:`load_score`                                            lowest
``round_robin``     steps until the candidate's turn (``0`` = now)                ``0``
``weighted_random`` selection probability (weight discounted by load)             drawn
``consistent_hash`` weighted rendezvous (HRW) score of ``key`` and the agent id    highest
``power_of_two``    :func:`load_score` of the two sampled candidates only         lowest
==================  ============================================================  ============
"""

from __future__ import annotations

import hashlib
import math
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Final, Protocol, TypeVar

from reach_mesh.errors import BadRequestError

__all__ = [
    "DEFAULT_STRATEGY",
    "SATURATION_PENALTY",
    "STRATEGIES",
    "Candidate",
    "ConsistentHash",
    "LeastLoaded",
    "LoadWeights",
    "PowerOfTwo",
    "RoundRobin",
    "Strategy",
    "WeightedRandom",
    "get_strategy",
    "least_of",
    "load_score",
    "prefer_region",
    "raw_load_score",
]

DEFAULT_STRATEGY: Final = "least_loaded"
#: Score added at 100 % utilisation on top of the linear load (scaled from 0 at the saturation
#: point). It dwarfs every unsaturated score (at most about 2 with default weights), so a nearly
#: full agent only wins when every candidate is nearly full.
SATURATION_PENALTY: Final = 10.0
# Scores closer than this are ties; float noise must not break the "identical agents share load"
# promise of least_loaded.
_TIE_EPSILON: Final = 1e-9
_T = TypeVar("_T")
_TWO_POW_64: Final = float(2**64)


@dataclass(slots=True)
class Candidate:
    """A routable agent as a strategy sees it (the router fills this from the registry)."""

    agent_id: str
    inflight: int
    max_concurrency: int
    queue_depth: int = 0
    #: 0..1 resource pressure reported by the agent (CPU, memory, rate limits upstream, …).
    pressure: float = 0.0
    weight: float = 1.0
    region: str | None = None
    zone: str | None = None


@dataclass(frozen=True)
class LoadWeights:
    """Coefficients of :func:`load_score`; ``saturation`` is the utilisation where the steep
    penalty starts (0.85 = 85 % of ``max_concurrency``)."""

    inflight: float = 1.0
    queue: float = 0.5
    pressure: float = 0.5
    saturation: float = 0.85


def load_score(c: Candidate, w: LoadWeights) -> float:
    """How loaded a candidate is; lower is better.

    ``u = inflight / max_concurrency`` and::

        score = w.inflight * u
              + w.queue * queue_depth / max_concurrency
              + w.pressure * clamp(pressure, 0, 1)
              + SATURATION_PENALTY * (u - w.saturation) / (1 - w.saturation)   if u > w.saturation

    The penalty de-weights an agent *before* it is full, so traffic moves elsewhere while it
    still has headroom for in-flight bursts.
    """
    return raw_load_score(c.inflight, c.max_concurrency, c.queue_depth, c.pressure, w)


def raw_load_score(
    inflight: int, max_concurrency: int, queue_depth: int, pressure: float, w: LoadWeights
) -> float:
    """:func:`load_score` of the fields themselves (the router's least-loaded path scores
    agents with it without building a :class:`Candidate` each: the same arithmetic)."""
    capacity = max_concurrency if max_concurrency > 0 else 1
    utilisation = inflight / capacity
    pressure = 0.0 if pressure < 0.0 else 1.0 if pressure > 1.0 else pressure
    score = w.inflight * utilisation + w.queue * queue_depth / capacity + w.pressure * pressure
    if utilisation > w.saturation:
        score += SATURATION_PENALTY * (utilisation - w.saturation) / max(1.0 - w.saturation, 1e-9)
    return score


class Strategy(Protocol):
    """Picks one of the candidates; returns it with the per-candidate scores it used."""

    name: str

    def choose(
        self,
        candidates: Sequence[Candidate],
        key: str | None,
        weights: LoadWeights,
        rng: random.Random,
    ) -> tuple[Candidate, dict[str, float]]:
        """Choose a candidate. ``candidates`` must not be empty (``ValueError``)."""
        ...


def _require(candidates: Sequence[Candidate]) -> None:
    if not candidates:
        raise ValueError("no candidates to choose from")


class LeastLoaded:
    """Lowest :func:`load_score`; ties are broken at random so identical agents share load."""

    name = "least_loaded"

    def choose(
        self,
        candidates: Sequence[Candidate],
        key: str | None,
        weights: LoadWeights,
        rng: random.Random,
    ) -> tuple[Candidate, dict[str, float]]:
        _require(candidates)
        scores = {c.agent_id: load_score(c, weights) for c in candidates}
        return least_of(candidates, list(scores.values()), rng), scores


def least_of(items: Sequence[_T], scores: Sequence[float], rng: random.Random) -> _T:
    """The item of ``items`` with the lowest of ``scores`` (one each, in order); scores within
    ``_TIE_EPSILON`` of it are ties, one drawn from ``rng`` (none drawn without a tie): the
    choice of :class:`LeastLoaded`, and of the router's path that scores agents directly."""
    best = min(scores)
    tied = [x for x, score in zip(items, scores, strict=True) if score - best <= _TIE_EPSILON]
    return tied[0] if len(tied) == 1 else rng.choice(tied)


class RoundRobin:
    """Cycles through the candidates in agent-id order; the counter lives in the instance.

    Sorting by id keeps the rotation fair when the router hands candidates over in a different
    order each time; when the candidate set changes, the rotation continues modulo its new size.
    """

    name = "round_robin"

    def __init__(self) -> None:
        self._counter = 0

    def choose(
        self,
        candidates: Sequence[Candidate],
        key: str | None,
        weights: LoadWeights,
        rng: random.Random,
    ) -> tuple[Candidate, dict[str, float]]:
        _require(candidates)
        ordered = sorted(candidates, key=lambda c: c.agent_id)
        n = len(ordered)
        start = self._counter % n
        self._counter += 1
        scores = {c.agent_id: float((i - start) % n) for i, c in enumerate(ordered)}
        return ordered[start], scores


class WeightedRandom:
    """Random choice with probability proportional to ``weight / (1 + load_score)``.

    Idle agents are drawn exactly in proportion to their weights; loaded ones less often. If no
    candidate has a positive weight the draw is uniform.
    """

    name = "weighted_random"

    def choose(
        self,
        candidates: Sequence[Candidate],
        key: str | None,
        weights: LoadWeights,
        rng: random.Random,
    ) -> tuple[Candidate, dict[str, float]]:
        _require(candidates)
        effective = [max(c.weight, 0.0) / (1.0 + load_score(c, weights)) for c in candidates]
        total = sum(effective)
        if total <= 0.0:
            effective = [1.0] * len(candidates)
            total = float(len(candidates))
        chosen = rng.choices(candidates, weights=effective, k=1)[0]
        scores = {c.agent_id: e / total for c, e in zip(candidates, effective, strict=True)}
        return chosen, scores


class ConsistentHash:
    """Weighted rendezvous (highest-random-weight) hashing of ``key`` over the candidates.

    The same key goes to the same agent for as long as that agent is a candidate, whatever the
    order of candidates and in every hub process (blake2b, not Python's salted ``hash()``). When
    a candidate leaves, only the keys that were on it move. Score is
    ``weight / -ln(u)`` with ``u`` the 64-bit blake2b of ``key \\0 agent_id`` mapped into (0, 1).

    ``key=None`` (no session or routing key on the request) falls back to :class:`LeastLoaded`,
    because there is nothing to be consistent about.
    """

    name = "consistent_hash"

    def __init__(self) -> None:
        self._fallback = LeastLoaded()

    def choose(
        self,
        candidates: Sequence[Candidate],
        key: str | None,
        weights: LoadWeights,
        rng: random.Random,
    ) -> tuple[Candidate, dict[str, float]]:
        _require(candidates)
        if key is None:
            return self._fallback.choose(candidates, key, weights, rng)
        base = hashlib.blake2b(key.encode() + b"\0", digest_size=8)
        scores: dict[str, float] = {}
        chosen = candidates[0]
        best = -1.0
        for c in candidates:
            h = base.copy()
            h.update(c.agent_id.encode())
            unit = (int.from_bytes(h.digest(), "big") + 0.5) / _TWO_POW_64
            score = max(c.weight, 0.0) / -math.log(unit)
            scores[c.agent_id] = score
            # Ties (practically only zero weights) go to the smaller id, to stay order-free.
            if score > best or (score == best and c.agent_id < chosen.agent_id):
                best, chosen = score, c
        return chosen, scores


class PowerOfTwo:
    """Samples two distinct candidates at random and takes the one with the lower load score.

    Nearly as good as least-loaded at spreading load, but it never herds every hub onto the same
    momentarily-idle agent.
    """

    name = "power_of_two"

    def choose(
        self,
        candidates: Sequence[Candidate],
        key: str | None,
        weights: LoadWeights,
        rng: random.Random,
    ) -> tuple[Candidate, dict[str, float]]:
        _require(candidates)
        if len(candidates) == 1:
            only = candidates[0]
            return only, {only.agent_id: load_score(only, weights)}
        i, j = rng.sample(range(len(candidates)), 2)
        a, b = candidates[i], candidates[j]
        score_a, score_b = load_score(a, weights), load_score(b, weights)
        chosen = a if score_a <= score_b else b
        return chosen, {a.agent_id: score_a, b.agent_id: score_b}


#: Strategy name → factory. Factories, not instances: round-robin keeps state per router.
STRATEGIES: Final[Mapping[str, Callable[[], Strategy]]] = MappingProxyType(
    {
        LeastLoaded.name: LeastLoaded,
        RoundRobin.name: RoundRobin,
        WeightedRandom.name: WeightedRandom,
        ConsistentHash.name: ConsistentHash,
        PowerOfTwo.name: PowerOfTwo,
    }
)


def get_strategy(name: str) -> Strategy:
    """A new instance of the named strategy; unknown names raise ``BadRequestError``."""
    factory = STRATEGIES.get(name)
    if factory is None:
        raise BadRequestError(
            f"unknown strategy {name!r}; expected one of {', '.join(sorted(STRATEGIES))}",
            strategy=name,
            expected=sorted(STRATEGIES),
        )
    return factory()


def prefer_region(
    candidates: Sequence[Candidate], region: str | None, zone: str | None
) -> Sequence[Candidate]:
    """Narrow to the same zone if any candidate is there, else the same region, else all.

    A zone only counts within the requested region (zone names like ``a`` repeat across
    regions) when a region is given.
    """
    if zone is not None:
        same_zone = [
            c for c in candidates if c.zone == zone and (region is None or c.region == region)
        ]
        if same_zone:
            return same_zone
    if region is not None:
        same_region = [c for c in candidates if c.region == region]
        if same_region:
            return same_region
    return candidates
