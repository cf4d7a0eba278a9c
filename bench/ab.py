"""``python -m bench.ab BASE [HEAD]`` — the workflow engine of two commits, alternated.

A full ``make bench`` compares reach-mesh with raw NATS and a peer in one run, but two runs of it
an hour apart differ by more than most changes do: this machine's speed drifts (the raw floor
moved by a third between two full runs). To tell a change from the machine, this runs
``bench/workflow_bench.py --quick --split`` (hub, agents and caller in their own processes, the
bare exchanges beside them) from a git worktree of each commit, alternating ``BASE, HEAD, BASE,
HEAD, …`` for ``--rounds`` rounds, and prints every run and the median of each side:

    make bench-ab BASE=57206b6            # HEAD against 57206b6, 3 rounds (~4 minutes)
    python -m bench.ab 57206b6 HEAD --rounds 5

Each side runs its own code (``PYTHONPATH`` is its worktree) with this checkout's virtualenv;
the worktrees are removed afterwards. Nothing is written to ``bench/results``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

__all__ = ["ROW", "median_row", "row_of", "table"]

ROOT = Path(__file__).resolve().parent.parent

#: What one run is reduced to (per second, ms, µs of CPU per workflow by process).
ROW = (
    "fanout_per_s",
    "chain_per_s",
    "bare_fanout_per_s",
    "fanout_p50_ms",
    "hub_us_per_fanout",
    "agents_us_per_fanout",
    "caller_us_per_fanout",
    "hub_us_per_chain",
    "agents_us_per_chain",
    "caller_us_per_chain",
    # Open loop (issue 15): p50 at 100 workflows/s, p50 and p99 at half the sustained rate.
    "fanout_100_p50_ms",
    "fanout_half_p50_ms",
    "fanout_half_p99_ms",
    "chain_100_p50_ms",
    "chain_half_p99_ms",
    # JetStream messages stored per workflow at full load (the server's own counts; issue 15).
    "fanout_js_stored",
    "chain_js_stored",
    # nats-server's CPU, and every process's summed: on two cores shared by all four, the sum
    # per workflow is what bounds the sustained rate (issue 15).
    "nats_us_per_fanout",
    "all_us_per_fanout",
    "nats_us_per_chain",
    "all_us_per_chain",
    # The machine's 1-minute load average as the run began (other sessions' work included).
    "load1",
)


def _open_loop(row: dict[str, Any], point: str, key: str) -> float | None:
    """``row``'s open-loop ``point`` (``"100"``, ``"half_sustained"``) value ``key``."""
    value = row.get("open_loop", {}).get(point, {}).get(key)
    return None if value is None else float(value)


def row_of(result: dict[str, Any]) -> dict[str, float | None]:
    """One run of ``workflow_bench.py --quick --split`` (its JSON) as a :data:`ROW`."""
    fan, chain, bare = result["fanout3"], result["chain3"], result.get("bare") or {}
    cpu = fan.get("cost", {}).get("cpu_us", {})
    chain_cpu = chain.get("cost", {}).get("cpu_us", {})
    bare_fan = bare.get("fanout3", {}).get("sustained", {}) if bare.get("available") else {}
    return {
        "fanout_per_s": fan["sustained"]["per_s"],
        "chain_per_s": chain["sustained"]["per_s"],
        "bare_fanout_per_s": bare_fan.get("per_s"),
        "fanout_p50_ms": fan["p50_ms"],
        "hub_us_per_fanout": cpu.get("hub"),
        "agents_us_per_fanout": cpu.get("agents"),
        "caller_us_per_fanout": cpu.get("caller"),
        "hub_us_per_chain": chain_cpu.get("hub"),
        "agents_us_per_chain": chain_cpu.get("agents"),
        "caller_us_per_chain": chain_cpu.get("caller"),
        "fanout_100_p50_ms": _open_loop(fan, "100", "p50_ms"),
        "fanout_half_p50_ms": _open_loop(fan, "half_sustained", "p50_ms"),
        "fanout_half_p99_ms": _open_loop(fan, "half_sustained", "p99_ms"),
        "chain_100_p50_ms": _open_loop(chain, "100", "p50_ms"),
        "chain_half_p99_ms": _open_loop(chain, "half_sustained", "p99_ms"),
        "fanout_js_stored": fan.get("cost", {}).get("js_stored"),
        "chain_js_stored": chain.get("cost", {}).get("js_stored"),
        "nats_us_per_fanout": cpu.get("nats_server"),
        "all_us_per_fanout": _summed(cpu),
        "nats_us_per_chain": chain_cpu.get("nats_server"),
        "all_us_per_chain": _summed(chain_cpu),
        "load1": result.get("load1"),
    }


def _summed(cpu: dict[str, float]) -> float | None:
    """The CPU µs of every process measured (None when none was)."""
    return round(sum(cpu.values()), 1) if cpu else None


def median_row(rows: list[dict[str, float | None]]) -> dict[str, float | None]:
    """The median of each column over the runs that have it."""
    out: dict[str, float | None] = {}
    for key in ROW:
        values = [v for r in rows if (v := r.get(key)) is not None]
        out[key] = round(statistics.median(values), 2) if values else None
    return out


def table(runs: list[tuple[str, dict[str, float | None]]]) -> str:
    """Every run, then the median of each side and HEAD over BASE (markdown)."""
    lines = ["| run | " + " | ".join(ROW) + " |", "|---" * (len(ROW) + 1) + "|"]

    def cells(row: dict[str, float | None]) -> str:
        return " | ".join("-" if row.get(k) is None else f"{row[k]:g}" for k in ROW)

    for name, row in runs:
        lines.append(f"| {name} | {cells(row)} |")
    sides = list(dict.fromkeys(name.split("#")[0] for name, _ in runs))
    medians = {s: median_row([r for n, r in runs if n.split("#")[0] == s]) for s in sides}
    for side, row in medians.items():
        lines.append(f"| **median {side}** | {cells(row)} |")
    if len(sides) == 2:
        base, head = (medians[s] for s in sides)
        ratio = {
            k: (round(h / b, 3) if b and h is not None else None)
            for k in ROW
            for b, h in [(base.get(k), head.get(k))]
        }
        lines.append(f"| **{sides[1]} / {sides[0]}** | {cells(ratio)} |")
    return "\n".join(lines)


def _worktree(rev: str, where: Path) -> Path:
    subprocess.run(
        ["git", "-C", str(ROOT), "worktree", "add", "-q", "--detach", str(where), rev], check=True
    )
    return where


def _clean_env() -> dict[str, str]:
    """This environment without the mesh's own settings (``REACH_*``, ``OTEL_*``)."""
    return {k: v for k, v in os.environ.items() if not k.startswith(("REACH_", "OTEL_"))}


def _run(tree: Path) -> dict[str, Any]:
    load1 = os.getloadavg()[0]
    out = subprocess.run(
        [sys.executable, "bench/workflow_bench.py", "--quick", "--split"],
        cwd=tree,
        env={**_clean_env(), "PYTHONPATH": str(tree)},
        stdout=subprocess.PIPE,  # stderr passes through: a failed run says why
        text=True,
        timeout=600,
        check=True,
    )
    result: dict[str, Any] = json.loads(out.stdout)
    result["load1"] = round(load1, 2)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("base", help="the commit to compare against")
    parser.add_argument("head", nargs="?", default="HEAD", help="the commit measured (HEAD)")
    parser.add_argument("--rounds", type=int, default=3, help="runs of each, alternated (3)")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    if args.base == args.head:
        parser.error(f"BASE and HEAD are both {args.base!r}: name two commits")
    # Worktrees of runs that were killed (they are removed when a run ends).
    subprocess.run(["git", "-C", str(ROOT), "worktree", "prune"], check=False)
    runs: list[tuple[str, dict[str, float | None]]] = []
    with tempfile.TemporaryDirectory(prefix="reach-ab-") as tmp:
        trees = {}
        try:
            for rev in (args.base, args.head):
                trees[rev] = _worktree(rev, Path(tmp) / rev.replace("/", "_"))
            for i in range(1, args.rounds + 1):
                for rev, tree in trees.items():
                    runs.append((f"{rev}#{i}", row_of(_run(tree))))
                    print(f"{rev} round {i}: {runs[-1][1]}", file=sys.stderr, flush=True)
        finally:
            for tree in trees.values():
                subprocess.run(
                    ["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)],
                    check=False,
                )
            if runs:  # what finished, also when a later run failed
                print(table(runs))


if __name__ == "__main__":
    main()
