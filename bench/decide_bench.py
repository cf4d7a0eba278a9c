"""Micro-benchmark: one routing decision as the workflow engine asks for it.

Run: ``.venv/bin/python bench/decide_bench.py [--agents 3 30] [--decisions N] [--repeats N]``
(wrap timing runs in ``flock /tmp/bench.lock``). A registry fed in memory (no NATS) holds N
agents of one capability with random load (in flight, queue depth, pressure, recent
assignments); ``Router.decide`` is called the way ``StepPlacing._choose`` calls it (by
capability, the default ``least_loaded`` strategy, an exclusion set, no explanation), the
chosen agent's ``outstanding`` counted and given back as a step's would be. Prints one JSON
object: µs per decision for each fleet size, the best of ``--repeats`` runs of ``--decisions``
decisions (the best run is the one the machine's other work disturbed least), and the same
with ``explain`` (what ``reach --dry-run`` builds) for reference; and µs to choose a
fanout(3)'s three first agents, by three decisions each counted before the next, or by one
``Router.decide_many`` (what ``StepPlacing._first_choices`` calls).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from reach_mesh.config import MeshSettings
from reach_mesh.hub.registry import Registry
from reach_mesh.hub.router import Router
from reach_mesh.models import AgentCard, AgentRecord, RouteRequest

CAP = "work:echo:v1"


def fleet(n: int, rng: random.Random) -> tuple[Registry, Router]:
    settings = MeshSettings(namespace="ns")
    registry = Registry(None, None, settings)  # type: ignore[arg-type]  # no KV: fed in memory
    for i in range(n):
        agent_id = f"ns.w.a{i:05d}"
        record = AgentRecord(
            card=AgentCard(agent_id=agent_id, capabilities=[CAP], max_concurrency=16),
            session="s",
            heartbeat_interval=5.0,
            lease_timeout=15.0,
            task_subject=f"reach.agent.{agent_id}.task",
            registered_at=0.0,
        )
        registry.apply_record(record, 1, seen_at=registry.now)
        view = registry.agents[agent_id]
        view.inflight = rng.randrange(8)
        view.queue_depth = rng.randrange(3)
        view.pressure = rng.random() / 2
        view.recent = rng.random()
        view.recent_at = registry.now
    return registry, Router(registry, settings, "hub-bench", rng=random.Random(7))


def per_decision_us(n: int, decisions: int, repeats: int, *, explain: bool) -> float:
    _, router = fleet(n, random.Random(n))
    req = RouteRequest(capability=CAP, explain=explain)
    skip = frozenset({"ns.w.gone"})
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(decisions):
            view = router.decide(req, "ns", "wf", exclude=skip).view
            view.outstanding += 1  # counted as a step's, then the step ends
            view.outstanding -= 1
        best = min(best, (time.perf_counter() - t0) / decisions * 1e6)
    return round(best, 2)


def per_fanout_us(n: int, fanouts: int, repeats: int, *, one_call: bool) -> float:
    """µs to choose the agents of a fanout(3)'s first attempts (one route): three
    ``decide`` calls, or one ``decide_many`` (what ``StepPlacing._first_choices`` makes)."""
    _, router = fleet(n, random.Random(n))
    req = RouteRequest(capability=CAP)
    skip = frozenset({"ns.w.gone"})
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(fanouts):
            if one_call:
                views = router.decide_many(req, "ns", 3, exclude=skip)[0]
            else:
                views = []
                for _ in range(3):
                    view = router.decide(req, "ns", "wf", exclude=skip).view
                    view.outstanding += 1  # counted before the next, as a step's
                    views.append(view)
            for view in views:  # the steps end
                view.outstanding -= 1
        best = min(best, (time.perf_counter() - t0) / fanouts * 1e6)
    return round(best, 2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--agents", type=int, nargs="+", default=[3, 30])
    parser.add_argument("--decisions", type=int, default=5_000)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    result: dict[str, object] = {"decisions": args.decisions, "repeats": args.repeats}
    for n in args.agents:
        result[f"agents_{n}"] = {
            "us_per_decision": per_decision_us(n, args.decisions, args.repeats, explain=False),
            "us_per_explained": per_decision_us(n, 1_000, args.repeats, explain=True),
            "us_per_fanout3_decide_x3": per_fanout_us(
                n, args.decisions // 3, args.repeats, one_call=False
            ),
            "us_per_fanout3_decide_many": per_fanout_us(
                n, args.decisions // 3, args.repeats, one_call=True
            ),
        }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
