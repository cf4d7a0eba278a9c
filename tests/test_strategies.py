"""Routing strategies and the load score (pure, seeded randomness, no NATS)."""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from reach_mesh import protocol
from reach_mesh.errors import BadRequestError
from reach_mesh.hub.strategies import (
    DEFAULT_STRATEGY,
    STRATEGIES,
    Candidate,
    ConsistentHash,
    LeastLoaded,
    LoadWeights,
    PowerOfTwo,
    RoundRobin,
    Strategy,
    WeightedRandom,
    get_strategy,
    load_score,
    prefer_region,
)

W = LoadWeights()


def _idle(n: int) -> list[Candidate]:
    return [Candidate(f"ns.svc.a{i}", inflight=0, max_concurrency=10) for i in range(n)]


# -- load score --------------------------------------------------------------------------------


def test_load_score_formula() -> None:
    c = Candidate("a", inflight=4, max_concurrency=10, queue_depth=2, pressure=0.4)
    assert load_score(c, W) == pytest.approx(0.4 + 0.5 * 0.2 + 0.5 * 0.4)
    weights = LoadWeights(inflight=2.0, queue=0.0, pressure=0.0)
    assert load_score(c, weights) == pytest.approx(0.8)


def test_load_score_penalises_before_saturation() -> None:
    at_80 = load_score(Candidate("a", 8, 10), W)
    at_85 = load_score(Candidate("a", 85, 100), W)
    at_90 = load_score(Candidate("a", 9, 10), W)
    assert at_80 == pytest.approx(0.8)
    assert at_85 == pytest.approx(0.85)  # the penalty starts above the saturation point
    # Busy but unsaturated (80 % plus full pressure and a queue) still beats 90 % utilisation.
    busy = load_score(Candidate("b", 8, 10, queue_depth=10, pressure=1.0), W)
    assert at_90 > busy
    assert load_score(Candidate("a", 10, 10), W) > at_90 > at_85


def test_load_score_edge_values() -> None:
    assert load_score(Candidate("a", 0, 0), W) == 0.0  # no division by zero
    assert load_score(Candidate("a", 0, 10, pressure=7.0), W) == pytest.approx(0.5)  # clamped
    assert load_score(Candidate("a", 0, 10, pressure=-1.0), W) == 0.0


# -- strategies --------------------------------------------------------------------------------


def test_registry_and_lookup() -> None:
    assert set(STRATEGIES) == {
        "least_loaded",
        "round_robin",
        "weighted_random",
        "consistent_hash",
        "power_of_two",
    }
    assert DEFAULT_STRATEGY in STRATEGIES
    for name in STRATEGIES:
        strategy: Strategy = get_strategy(name)
        assert strategy.name == name
    assert get_strategy("round_robin") is not get_strategy("round_robin")
    with pytest.raises(BadRequestError) as info:
        get_strategy("fastest")
    assert info.value.details["strategy"] == "fastest"
    assert "least_loaded" in info.value.details["expected"]


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_empty_candidates_is_an_error(name: str) -> None:
    with pytest.raises(ValueError):
        get_strategy(name).choose([], "k", W, random.Random(0))


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_single_candidate(name: str) -> None:
    only = Candidate("ns.svc.only", inflight=3, max_concurrency=4)
    chosen, scores = get_strategy(name).choose([only], "k", W, random.Random(0))
    assert chosen is only
    assert set(scores) == {"ns.svc.only"}


def test_least_loaded_picks_lowest() -> None:
    cands = [
        Candidate("a", 5, 10),
        Candidate("b", 1, 10),
        Candidate("c", 1, 10, pressure=0.9),
        Candidate("d", 9, 10),
    ]
    chosen, scores = LeastLoaded().choose(cands, None, W, random.Random(1))
    assert chosen.agent_id == "b"
    assert scores["b"] == min(scores.values())
    assert set(scores) == {"a", "b", "c", "d"}


def test_least_loaded_spreads_across_equal_agents() -> None:
    cands = _idle(4)
    rng = random.Random(7)
    counts = Counter(LeastLoaded().choose(cands, None, W, rng)[0].agent_id for _ in range(4000))
    assert set(counts) == {c.agent_id for c in cands}
    assert all(800 < n < 1200 for n in counts.values()), counts


def test_round_robin_cycles_in_id_order() -> None:
    cands = [Candidate(i, 0, 1) for i in ("c", "a", "b")]
    rr = RoundRobin()
    rng = random.Random(0)
    picks = [rr.choose(cands, None, W, rng)[0].agent_id for _ in range(7)]
    assert picks == ["a", "b", "c", "a", "b", "c", "a"]
    # Candidate order does not matter; scores count the steps until each one's turn.
    chosen, scores = rr.choose(list(reversed(cands)), None, W, rng)
    assert chosen.agent_id == "b"
    assert scores == {"b": 0.0, "c": 1.0, "a": 2.0}


def test_weighted_random_proportions() -> None:
    cands = [
        Candidate("a", 0, 10, weight=1.0),
        Candidate("b", 0, 10, weight=2.0),
        Candidate("c", 0, 10, weight=5.0),
        Candidate("z", 0, 10, weight=0.0),
    ]
    rng = random.Random(42)
    n = 16_000
    strategy = WeightedRandom()
    counts = Counter(strategy.choose(cands, None, W, rng)[0].agent_id for _ in range(n))
    assert counts["z"] == 0
    for agent_id, share in (("a", 1 / 8), ("b", 2 / 8), ("c", 5 / 8)):
        assert abs(counts[agent_id] / n - share) < 0.02, counts
    _, scores = strategy.choose(cands, None, W, rng)
    assert scores == pytest.approx({"a": 1 / 8, "b": 2 / 8, "c": 5 / 8, "z": 0.0})


def test_weighted_random_discounts_load_and_handles_zero_weights() -> None:
    cands = [Candidate("idle", 0, 10), Candidate("busy", 9, 10)]
    _, scores = WeightedRandom().choose(cands, None, W, random.Random(0))
    assert scores["idle"] > 5 * scores["busy"]
    zero = [Candidate("a", 0, 1, weight=0.0), Candidate("b", 0, 1, weight=0.0)]
    rng = random.Random(3)
    counts = Counter(WeightedRandom().choose(zero, None, W, rng)[0].agent_id for _ in range(200))
    assert set(counts) == {"a", "b"}


def test_consistent_hash_is_stable_and_order_free() -> None:
    cands = _idle(8)
    ch = ConsistentHash()
    rng = random.Random(0)
    for key in ("session-1", "session-2", "user:42", ""):
        first = ch.choose(cands, key, W, rng)[0].agent_id
        shuffled = list(cands)
        random.Random(key).shuffle(shuffled)
        assert ch.choose(shuffled, key, W, rng)[0].agent_id == first
        # Load does not move a key: stickiness is the point.
        loaded = [Candidate(c.agent_id, 9, 10) for c in cands]
        assert ConsistentHash().choose(loaded, key, W, rng)[0].agent_id == first


def test_consistent_hash_known_values() -> None:
    # Pinned: blake2b is the same in every process and Python version, unlike hash(); a change
    # here would re-shuffle every sticky key in a running mesh during a rolling upgrade.
    cands = _idle(3)
    picks = [
        ConsistentHash().choose(cands, key, W, random.Random(seed))[0].agent_id
        for seed, key in enumerate(["order-123", "order-124", "order-125", "x"])
    ]
    assert picks == ["ns.svc.a1", "ns.svc.a1", "ns.svc.a2", "ns.svc.a0"]
    chosen, scores = ConsistentHash().choose(cands, "order-123", W, random.Random(0))
    assert chosen.agent_id == max(scores, key=scores.__getitem__)


def test_consistent_hash_minimal_disruption() -> None:
    cands = _idle(10)
    ch = ConsistentHash()
    rng = random.Random(0)
    keys = [f"key-{i}" for i in range(2000)]
    before = {k: ch.choose(cands, k, W, rng)[0].agent_id for k in keys}
    assert len(set(before.values())) == 10  # every agent gets keys
    removed = "ns.svc.a3"
    after = {
        k: ch.choose([c for c in cands if c.agent_id != removed], k, W, rng)[0].agent_id
        for k in keys
    }
    moved = {k for k in keys if before[k] != after[k]}
    assert moved == {k for k in keys if before[k] == removed}
    assert 100 < len(moved) < 300  # about a tenth of the keys


def test_consistent_hash_respects_weights() -> None:
    cands = [Candidate("light", 0, 10, weight=1.0), Candidate("heavy", 0, 10, weight=3.0)]
    rng = random.Random(0)
    counts = Counter(
        ConsistentHash().choose(cands, f"k{i}", W, rng)[0].agent_id for i in range(4000)
    )
    assert abs(counts["heavy"] / 4000 - 0.75) < 0.03, counts


def test_consistent_hash_without_key_falls_back_to_least_loaded() -> None:
    cands = [Candidate("a", 5, 10), Candidate("b", 0, 10)]
    chosen, scores = ConsistentHash().choose(cands, None, W, random.Random(0))
    assert chosen.agent_id == "b"
    assert scores == {"a": load_score(cands[0], W), "b": 0.0}


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.integers(0, 12), min_size=2, max_size=8),
    st.integers(0, 2**32),
)
def test_power_of_two_never_picks_the_worse_of_its_pair(loads: list[int], seed: int) -> None:
    cands = [Candidate(f"a{i}", load, 10) for i, load in enumerate(loads)]
    chosen, scores = PowerOfTwo().choose(cands, None, W, random.Random(seed))
    assert len(scores) == 2
    assert chosen.agent_id in scores
    assert scores[chosen.agent_id] == min(scores.values())
    if len(set(loads)) == len(loads):
        assert chosen is not max(cands, key=lambda c: c.inflight)


def test_power_of_two_prefers_light_agents_overall() -> None:
    cands = [Candidate("light", 0, 10), Candidate("mid", 5, 10), Candidate("heavy", 9, 10)]
    rng = random.Random(5)
    counts = Counter(PowerOfTwo().choose(cands, None, W, rng)[0].agent_id for _ in range(3000))
    assert counts["heavy"] == 0
    assert counts["light"] > counts["mid"]


# -- locality ----------------------------------------------------------------------------------


def test_prefer_region() -> None:
    cands = [
        Candidate("a", 0, 1, region="cn-east", zone="a"),
        Candidate("b", 0, 1, region="cn-east", zone="b"),
        Candidate("c", 0, 1, region="us-west", zone="a"),
        Candidate("d", 0, 1),
    ]

    def ids(cs: Sequence[Candidate]) -> list[str]:
        return [c.agent_id for c in cs]

    assert ids(prefer_region(cands, "cn-east", "b")) == ["b"]
    assert ids(prefer_region(cands, "cn-east", "a")) == ["a"]  # zone a of cn-east only
    assert ids(prefer_region(cands, None, "a")) == ["a", "c"]
    assert ids(prefer_region(cands, "cn-east", "z")) == ["a", "b"]  # no such zone: region
    assert ids(prefer_region(cands, "eu", "a")) == ["a", "b", "c", "d"]  # nothing local: all
    assert prefer_region(cands, None, None) is cands


def test_the_wire_names_every_strategy_the_router_has() -> None:
    """``protocol.STRATEGY_NAMES`` is what a workflow spec is checked against (without the
    hub's code): a strategy missing there would be refused, one only there never placed."""
    assert set(STRATEGIES) == protocol.STRATEGY_NAMES
