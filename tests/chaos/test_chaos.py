"""Fault injection against a real 3-node cluster with hubs and agents as processes.

The short runs are part of the default suite; ``make chaos`` runs every fault type with
``CHAOS_WORKFLOWS`` (default 1000) workflows each (marker ``chaos``, deselected by default).
Each run prints the checker's table; see docs/reliability.md.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from .harness import FAULTS, ChaosConfig, ChaosRun, run_chaos


def _assert_invariants(run: ChaosRun) -> None:
    print("\n" + run.table())
    # Every hub of the config was serving when the faults began (one that exited at start or
    # did not serve within ``HUB_START_WAIT`` makes a run of fewer hubs than it says).
    assert not run.hubs_not_up, run.table()
    assert run.faults > 0 or run.cfg.fault in ("none", "slow"), "no fault was injected"
    assert run.report.workflows > 0
    # Cancels were sent and some took effect: the cancel checks did not pass for want of any.
    assert run.report.cancels > 0 or run.cfg.cancel_share == 0, run.table()
    # Policy fanouts ran, and their policies decided before every step ended (the checks of
    # tests/chaos/policies.py had something to check).
    if run.cfg.workflows >= 8:
        assert run.report.policy_fanouts > 0 and run.report.stopped_unneeded > 0, run.table()
    if run.cfg.fault == "deaf":
        # The fault did what it says: agents went deaf, and hubs found them so.
        assert run.deafened == run.faults and run.deaf_quarantines > 0, run.table()
    assert run.report.ok, run.table()


@pytest.mark.timeout(150)
@pytest.mark.xdist_group("clusters")  # one cluster at a time (tests/test_cluster.py)
@pytest.mark.parametrize(
    ("fault", "secure"),
    [
        ("agent_kill", False),
        ("hub_kill", False),
        ("hub_stop", False),
        ("blip", False),
        ("partition", False),
        ("hub_kill", True),
    ],
)
async def test_short_chaos(fault: str, secure: bool, tmp_path: Path) -> None:
    """~60 workflows at 10/s with a fault every 2 s: nothing lost, stuck, wrong, answered
    twice or re-run without a crash to explain it (one run in secure mode: every process with
    its own identity, as docs/security.md has them). A quarter of them are fanouts with
    policy ``any`` or ``quorum(2)`` (the workload's plan): their unneeded steps stopped under
    the fault too."""
    cfg = ChaosConfig(
        fault=fault,
        workflows=60,
        rate=10,
        hubs=2,
        agents=4,
        fault_every=2.0,
        drain=40,
        secure=secure,
    )
    _assert_invariants(await run_chaos(cfg, tmp_path))


@pytest.mark.chaos
@pytest.mark.timeout(0)
@pytest.mark.parametrize(
    "fault", [f for f in os.environ.get("CHAOS_FAULTS", "").split(",") if f] or FAULTS
)
async def test_long_chaos(fault: str, tmp_path: Path) -> None:
    cfg = ChaosConfig(
        fault=fault,
        workflows=int(os.environ.get("CHAOS_WORKFLOWS", "1000")),
        rate=float(os.environ.get("CHAOS_RATE", "20")),
        fault_every=float(os.environ.get("CHAOS_FAULT_EVERY", "5")),
        seed=int(os.environ.get("CHAOS_SEED", "1")),
        drain=90,
        overrides=json.loads(os.environ.get("CHAOS_SETTINGS") or "{}"),
        secure=os.environ.get("CHAOS_SECURE", "") not in ("", "0"),
    )
    out = os.environ.get("CHAOS_OUT")
    workdir = Path(out) / fault if out else tmp_path
    _assert_invariants(await run_chaos(cfg, workdir))
