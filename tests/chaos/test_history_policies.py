"""The history checker on policy fanouts (``any``, ``quorum``): steps stopped as unneeded are no
failures, needed results are kept, late starts are counted. Split from ``test_history.py``."""

from __future__ import annotations

from typing import Any

import pytest

from .history import Expected, Fault, History, check
from .policies import expected_state
from .test_history import WF, run

VALUES = ({"x": 1}, {"x": 2}, {"x": 3})


def policy_history(
    policy: str = "any",
    states: tuple[str, ...] = ("SUCCEEDED", "PENDING", "PENDING"),
    expected: str = "SUCCEEDED",
) -> History:
    """A policy fanout of 3 steps: step 0 ended first (at 1.1), the others stopped as
    unneeded unless ``states`` says they ended."""
    steps = []
    for i, state in enumerate(states):
        stopped = state not in ("SUCCEEDED", "FAILED", "TIMEOUT")
        steps.append(
            {
                "index": i,
                "task_id": f"{WF}-{i}",
                "state": state,
                "cancelled": stopped,
                "attempts": 1,
                "decided_by": None if stopped else 1,
                "result": VALUES[i] if state == "SUCCEEDED" else None,
                "finished_at": None if stopped else 1.15 + i,
            }
        )
        if state in ("FAILED", "TIMEOUT"):
            steps[-1]["error"] = {"code": f"REACH_{state}", "message": "m"}
    res: dict[str, Any] = {
        "workflow_id": WF,
        "kind": "fanout",
        "policy": policy,
        "state": expected,
        "result": [s["result"] for s in steps],
        "steps": steps,
        "finished_at": 1.2,
    }
    if expected != "SUCCEEDED":
        res["error"] = next(s["error"] for s in steps if "error" in s)
    return History(
        expected={WF: Expected("fanout", expected, policy=policy, values=VALUES)},
        runs=[run(0, "ns.a.a1", 1.0)],
        records={WF: {"state": expected, "result": res}},
        tasks={},
        done={WF: [res]},
        callers={WF: res},
    )


def test_a_policy_fanout_decided_early_passes() -> None:
    rep = check(policy_history())
    assert rep.ok and rep.policy_fanouts == 1 and rep.stopped_unneeded == 2, rep.table()


def test_a_policy_fanout_result_must_follow_the_steps() -> None:
    h = policy_history()
    h.records[WF]["result"]["result"][1] = {"x": 2}  # a stopped step's value in the result
    assert check(h).wrong_outcome == 1
    h = policy_history(policy="quorum(2)")  # one success is not a quorum of 2
    h.expected[WF] = Expected("fanout", "SUCCEEDED", policy="quorum(2)", values=VALUES)
    assert check(h).wrong_outcome == 1
    h = policy_history()  # planned to succeed, ended FAILED
    h.expected[WF] = Expected("fanout", "FAILED", policy="any", values=VALUES)
    assert check(h).wrong_outcome == 1


def test_a_step_stopped_as_unneeded_is_no_failure() -> None:
    h = policy_history(
        policy="quorum(2)", states=("FAILED", "FAILED", "PENDING"), expected="FAILED"
    )
    h.runs.append(run(1, "ns.a.a2", 1.5, outcome="failed"))
    assert check(h).ok
    # The stopped step reported as a failure, and the workflow's error its.
    step = h.records[WF]["result"]["steps"][2]
    step["state"] = "FAILED"
    h.records[WF]["result"]["error"] = step["error"] = {"code": "REACH_STOPPED", "message": "x"}
    rep = check(h)
    assert rep.unneeded_as_failure == 2 and not rep.ok, rep.table()


def test_a_needed_result_is_not_stopped_as_unneeded() -> None:
    """Step 1 had succeeded long before step 2 completed the quorum, and is reported
    stopped: a valid, needed result thrown away."""
    h = policy_history(policy="quorum(2)", states=("SUCCEEDED", "PENDING", "SUCCEEDED"))
    h.runs += [run(1, "ns.a.a2", 1.1), run(2, "ns.a.a3", 3.0)]
    rep = check(h)
    assert rep.needed_not_kept == 1 and not rep.ok, rep.table()
    assert "ns.a.a2#1 ended ok" in rep.violations[-1].detail
    # Unless its agent died right then (its status may never have left it).
    h.faults.append(Fault("agent_kill", "ns.a.a2", 1.25))
    assert check(h).needed_not_kept == 0


def test_an_unneeded_step_starting_after_the_result_is_counted() -> None:
    h = policy_history()
    h.runs.append(run(2, "ns.a.a2", 5.0))
    rep = check(h)
    assert rep.unneeded_late_starts == 1 and rep.ok


@pytest.mark.parametrize(
    ("policy", "modes", "state"),
    [
        ("any", ("fail", "slow", "ok"), "SUCCEEDED"),
        ("any", ("fail", "fail", "fail"), "FAILED"),
        ("any", ("slow", "stubborn", "slow"), "TIMEOUT"),
        ("quorum(2)", ("flaky", "fail", "ok"), "SUCCEEDED"),
        ("quorum(2)", ("fail", "fail", "ok"), "FAILED"),
        ("quorum(2)", ("stubborn", "ok", "stubborn"), "TIMEOUT"),
    ],
)
def test_the_outcome_a_policy_gives_planned_steps(
    policy: str, modes: tuple[str, ...], state: str
) -> None:
    assert expected_state(policy, modes) == state


def test_a_step_stopped_as_unneeded_reports_every_attempt_that_ran() -> None:
    """Reported stopped with no attempt, yet its attempt 1 ran (after the result): the hub
    took the step for never started and fenced nothing (chaos partition, seed 301)."""
    h = policy_history()
    h.records[WF]["result"]["steps"][2]["attempts"] = 0
    h.runs.append(run(2, "ns.a.a2", 5.0))
    rep = check(h)
    assert rep.unneeded_as_failure == 1 and not rep.ok, rep.table()
    assert "attempt 1 ran" in rep.violations[0].detail


def test_a_branch_that_ran_on_past_the_decision_does_not_move_it() -> None:
    """An ``any`` fanout met by step 0 (at 1.15); step 2's branch ran on through its stop (a
    swallowed cancellation) to a SUCCEEDED kept at 9.0, and step 1's handler failed at 8.0,
    long after the decision: not a needed result thrown away (chaos secure seed 184,
    ``node_stop``, chaos-184-00972: decided at 620.04, step 2 ran on to 643.0, step 1's
    failure at 642.1 was counted as needed)."""
    h = policy_history(states=("SUCCEEDED", "PENDING", "SUCCEEDED"))
    h.records[WF]["result"]["steps"][2]["finished_at"] = 9.0
    h.runs += [run(1, "ns.a.a2", 7.9, outcome="failed"), run(2, "ns.a.a3", 8.5)]
    h.runs[-2].end = 8.0
    h.runs[-1].end = 9.0
    rep = check(h)
    assert rep.needed_not_kept == 0 and rep.ok, rep.table()
    # A failure that had ended before the success that met the policy was needed (its step
    # must say FAILED, not stopped).
    h.runs[-2].start, h.runs[-2].end = 0.5, 0.6
    rep = check(h)
    assert rep.needed_not_kept == 1 and not rep.ok, rep.table()


def test_a_quorum_is_decided_by_its_kth_success() -> None:
    """quorum(2): steps 0 and 2 succeeded (1.15, 3.15), step 1 stopped; step 1's success at
    2.0 came before the quorum was met at 3.15: needed, thrown away."""
    h = policy_history(policy="quorum(2)", states=("SUCCEEDED", "PENDING", "SUCCEEDED"))
    h.expected[WF] = Expected("fanout", "SUCCEEDED", policy="quorum(2)", values=VALUES)
    h.runs += [run(1, "ns.a.a2", 1.9), run(2, "ns.a.a3", 3.0)]
    h.runs[-2].end = 2.0
    assert check(h).needed_not_kept == 1


def test_an_outcome_applied_late_by_a_takeover_decided_when_it_ended() -> None:
    """An ``any`` fanout whose kept success (step 0, its run ended at 1.1) was applied at 4.0
    by the run that took the workflow over last (its ``finished_at``); step 1's success at
    1.6 came after the one that met the policy: not needed (chaos secure seed 184,
    ``partition``, chaos-184-00716: the kept success ended at 077.88, applied at 079.84, and
    the stopped one ended at 078.21)."""
    h = policy_history()
    h.records[WF]["result"]["steps"][0]["finished_at"] = 4.0
    h.runs.append(run(1, "ns.a.a2", 1.5))
    rep = check(h)
    assert rep.needed_not_kept == 0 and rep.ok, rep.table()
    # Ended before the kept one did, it was the first success: needed.
    h.runs[-1].start, h.runs[-1].end = 0.5, 0.6
    assert check(h).needed_not_kept == 1
