"""Micro-benchmark: selector evaluation over a 10,000-agent inverted index.

Run: ``.venv/bin/python bench/selector_bench.py [--agents N] [--iterations N]``. Prints one JSON
object with p50/p99 (µs) of ``AgentIndex.candidates`` for a selective and a broad 4-term
selector, of what the router does with a broad one (``AgentIndex.select``: count the matches and
sample 64 of them, no set of ids built), of parsing (cached and uncached), and of the brute-force
reference for comparison.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from reach_mesh.hub.index import AgentIndex
from reach_mesh.selector import Selector

SELECTOR = "cap=email:send:v1 AND region=cn-east AND mem_gte=8GiB AND gpu exists"
# Worst case for the index: no rare term to start from, so every set is large.
BROAD = "mem_gte=8GiB AND cpu_gte=2 AND tier!=free AND zone exists"
REGIONS = ["cn-east", "cn-north", "us-west", "us-east", "eu-central", "eu-west", "ap-south", "sa"]
DOMAINS = ["email", "data", "img", "doc", "web", "code", "audio", "crm", "erp", "chat"]
ACTIONS = ["send", "read", "query", "gen", "summarise"]


def build(n: int, rng: random.Random) -> list[tuple[str, list[str], dict[str, str]]]:
    """A fleet with realistic skew: ~50 capabilities, 3 per agent, 8 regions, 30 % GPUs."""
    caps = [f"{d}:{a}:v{v}" for d in DOMAINS for a in ACTIONS for v in (1,)]
    agents = []
    for i in range(n):
        labels = {
            "region": rng.choice(REGIONS),
            "zone": rng.choice("abc"),
            "mem_gb": str(rng.choice([2, 4, 8, 16, 32, 64])),
            "cpu": str(rng.choice([1, 2, 4, 8, 16])),
            "tier": rng.choice(["free", "pro", "enterprise"]),
            "model": rng.choice(["gpt-4o", "claude", "llama-3", "qwen"]),
        }
        if rng.random() < 0.3:
            labels["gpu"] = "true"
        agents.append((f"ns{i % 20}.svc{i % 97}.a{i}", rng.sample(caps, 3), labels))
    return agents


def percentiles(fn: Callable[[], object], iterations: int) -> dict[str, float]:
    samples = []
    for _ in range(iterations):
        t0 = time.perf_counter_ns()
        fn()
        samples.append((time.perf_counter_ns() - t0) / 1000.0)
    samples.sort()
    return {
        "p50_us": round(statistics.median(samples), 2),
        "p99_us": round(samples[min(len(samples) - 1, int(len(samples) * 0.99))], 2),
        "max_us": round(samples[-1], 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--agents", type=int, default=10_000)
    parser.add_argument("--iterations", type=int, default=5_000)
    args = parser.parse_args()

    rng = random.Random(1)
    agents = build(args.agents, rng)
    index = AgentIndex()
    t0 = time.perf_counter()
    for agent_id, caps, labels in agents:
        index.upsert(agent_id, caps, labels)
    build_ms = (time.perf_counter() - t0) * 1000

    selector = Selector.parse(SELECTOR)
    broad = Selector.parse(BROAD)
    matches = index.candidates(selector)
    brute = {a for a, c, labels in agents if selector.matches(c, labels)}
    assert matches == brute, "index disagrees with brute force"
    assert index.candidates(broad) == {a for a, c, labels in agents if broad.matches(c, labels)}
    assert set(index.select(broad)) == index.candidates(broad)
    sample_rng = random.Random(2)

    def route_broad() -> None:
        # The router's use: how many match, and a random sample of 64 to pick from.
        matches = index.select(broad)
        if len(matches) > 64:
            matches.sample(sample_rng, 64)

    # Upsert with a changed label: the hot path of a registration update.
    def update() -> None:
        agent_id, caps, labels = agents[rng.randrange(len(agents))]
        index.upsert(agent_id, caps, {**labels, "mem_gb": str(rng.choice([8, 16]))})

    result = {
        "agents": args.agents,
        "selector": SELECTOR,
        "matches": len(matches),
        "build_ms": round(build_ms, 1),
        "candidates": percentiles(lambda: index.candidates(selector), args.iterations),
        "broad_selector": BROAD,
        "broad_matches": len(index.candidates(broad)),
        "candidates_broad": percentiles(lambda: index.candidates(broad), args.iterations // 5),
        "select_broad_sample64": percentiles(route_broad, args.iterations // 5),
        "parse_cached": percentiles(lambda: Selector.parse(SELECTOR), args.iterations),
        "parse_uncached": percentiles(
            lambda: Selector.parse(f"{SELECTOR} AND n!={rng.random()}"), args.iterations
        ),
        "upsert_changed": percentiles(update, args.iterations),
        "nearest_no_match": percentiles(
            lambda: index.nearest(Selector.parse(f"{SELECTOR} AND region=cn_east")), 200
        ),
        "brute_force": percentiles(
            lambda: [a for a, c, labels in agents if selector.matches(c, labels)], 20
        ),
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
