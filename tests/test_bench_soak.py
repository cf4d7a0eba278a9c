"""The soak driver (``python -m bench.soak``): a few seconds of it start nats-server, a hub and
the agents' process, drive routes and both workflow kinds, and write RSS samples and slopes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from bench.soak import _slope

ROOT = Path(__file__).resolve().parent.parent


def test_the_slope_is_least_squares() -> None:
    assert _slope([(0, 1.0), (1, 3.0), (2, 5.0)]) == 2.0
    assert _slope([(0, 1.0), (10, 1.0), (20, 1.0), (30, 1.0)]) == 0.0
    assert _slope([(0, 1.0), (1, 2.0)]) is None  # too few points to judge
    assert _slope([(5, 1.0), (5, 2.0), (5, 3.0)]) is None


def test_a_short_soak_samples_every_process(tmp_path: Path) -> None:
    out = tmp_path / "soak.json"
    argv = [sys.executable, "-m", "bench.soak", "--minutes", "0.06", "--route-rate", "50"]
    argv += ["--workflow-rate", "10", "--sample", "1", "--judge-after", "0", "--out", str(out)]
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=90)
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads(out.read_text())
    last = result["samples"][-1]
    assert last["route_done"] >= 150 and last["fanout_done"] >= 10 and last["chain_done"] >= 10
    assert last["tasks_done"] == last["route_done"] + 3 * (last["fanout_done"] + last["chain_done"])
    assert result["not_ok"] == {}
    for role in ("hub", "agents", "nats_server", "caller"):
        assert all(s[f"{role}_rss_mb"] > 0 for s in result["samples"])
        assert isinstance(result["slope_kb_per_10k_tasks"][role], float)
