"""The history checker on hand-made histories: a clean one passes, each violation is found."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from .explained import _cut_off_again, _unregistered_when_asked
from .history import (
    Expected,
    ExpectedRoute,
    Fault,
    History,
    Run,
    check,
    load,
    read_faults,
    read_runs,
    read_unregistered,
    read_unstored,
)
from .policies import expected_state

WF = "wf1"


def result(state: str = "SUCCEEDED", value: Any = ("a", "b"), steps: int = 2) -> dict[str, Any]:
    return {
        "workflow_id": WF,
        "kind": "fanout",
        "state": state,
        "result": list(value) if state == "SUCCEEDED" else None,
        "steps": [
            {
                "index": i,
                "task_id": f"{WF}-{i}",
                "state": state if i == 0 else "SUCCEEDED",
                "decided_by": 1,
            }
            for i in range(steps)
        ],
    }


def task(i: int, state: str = "SUCCEEDED", history: list[Any] | None = None) -> dict[str, Any]:
    hist = history or [{"attempt": 1, "state": state}]
    return {"task_id": f"{WF}-{i}", "state": state, "attempt": len(hist), "history": hist}


def run(i: int, agent: str, start: float, attempt: int = 1, outcome: str = "ok") -> Run:
    return Run(
        f"r{agent}{start}", WF, i, f"{WF}-{i}", attempt, agent, 1, start, start + 0.1, outcome
    )


def rerun_decides(h: History, at: float, code: str) -> History:
    """``h`` with step 1 run again on ``ns.a.a3`` at ``at`` as attempt 2, which decided it:
    attempt 1 given up with ``code``."""
    h.runs.append(run(1, "ns.a.a3", at, attempt=2))
    h.records[WF]["result"]["steps"][1]["decided_by"] = 2
    h.tasks[f"{WF}-1"] = task(
        1,
        history=[
            {"attempt": 1, "state": "PENDING", "code": code},
            {"attempt": 2, "state": "SUCCEEDED"},
        ],
    )
    return h


def clean() -> History:
    res = result()
    return History(
        expected={WF: Expected("fanout", "SUCCEEDED", ["a", "b"])},
        runs=[run(0, "ns.a.a1", 1.0), run(1, "ns.a.a2", 1.0)],
        records={WF: {"state": "SUCCEEDED", "result": res}},
        tasks={f"{WF}-0": task(0), f"{WF}-1": task(1)},
        done={WF: [res]},
        callers={WF: res},
    )


def test_a_clean_history_passes() -> None:
    rep = check(clean())
    assert rep.ok and rep.finished == 1 and rep.runs == 2
    assert sum(rep.row().values()) == 1 + 2  # workflows + handler runs, nothing else
    assert "VIOLATED" not in rep.table()


def test_lost_workflow() -> None:
    h = clean()
    h.records.clear()
    h.done.clear()
    h.callers[WF] = "MeshTimeoutError: no result"
    rep = check(h)
    assert rep.lost == 1 and rep.caller_errors == 1 and not rep.ok
    assert "lost: 1" in rep.table()


def test_stuck_workflow() -> None:
    h = clean()
    h.records[WF] = {"state": "RUNNING", "result": None}
    h.done.clear()
    rep = check(h)
    assert rep.stuck == 1 and rep.lost == 0 and not rep.ok


def test_wrong_outcome_state_and_value() -> None:
    h = clean()
    h.expected[WF] = Expected("fanout", "FAILED")
    assert check(h).wrong_outcome == 1
    h = clean()
    h.expected[WF] = Expected("fanout", "SUCCEEDED", ["a", "X"])
    rep = check(h)
    assert rep.wrong_outcome == 1 and not rep.ok
    h = clean()  # a non-SUCCEEDED outcome is compared by state only
    h.expected[WF] = Expected("fanout", "SUCCEEDED", ["a", "b"])
    assert check(h).ok


def test_done_and_record_disagree() -> None:
    """The issue's race: `.done` said FAILED, the stored record says SUCCEEDED."""
    h = clean()
    failed = result("FAILED")
    h.done[WF] = [failed]
    h.callers[WF] = failed
    rep = check(h)
    assert rep.two_results == 1 and not rep.ok
    assert "record=SUCCEEDED" in rep.violations[0].detail


def test_two_done_messages_disagree() -> None:
    h = clean()
    h.done[WF] = [result(), result("FAILED")]
    assert check(h).two_results == 1


def test_done_without_final_record() -> None:
    h = clean()
    h.records[WF] = {"state": "RUNNING"}
    rep = check(h)
    assert rep.two_results == 1 and rep.stuck == 0 and rep.finished == 1


def test_caller_disagrees() -> None:
    h = clean()
    h.callers[WF] = result("TIMEOUT")
    assert check(h).two_results == 1


def test_step_record_mismatch() -> None:
    h = clean()
    h.tasks[f"{WF}-1"] = task(1, "FAILED")
    rep = check(h)
    assert rep.step_record_mismatch == 1
    assert rep.ok  # reported, but not one of the targets


def test_duplicate_run_unexplained() -> None:
    h = clean()
    h.runs.append(run(1, "ns.a.a3", 5.0, attempt=2))
    rep = check(h)
    assert rep.dup_unexplained == 1 and not rep.ok
    assert "ns.a.a2#1" in rep.violations[0].detail


def test_duplicate_run_explained_by_its_agent_dying() -> None:
    h = clean()
    h.runs[1].end = h.runs[1].outcome = None  # killed mid-handler
    h.runs.append(run(1, "ns.a.a3", 5.0, attempt=2))
    h.records[WF]["result"]["steps"][1]["decided_by"] = 2
    h.tasks[f"{WF}-1"] = task(
        1, history=[{"attempt": 1, "state": "PENDING"}, {"attempt": 2, "state": "SUCCEEDED"}]
    )
    h.faults.append(Fault("agent_kill", "ns.a.a2", 1.05))
    rep = check(h)
    assert rep.dup_agent_crash == 1 and rep.dup_unexplained == 0 and rep.ok


def test_a_fault_of_another_agent_or_too_late_or_too_early_explains_nothing() -> None:
    h = clean()
    h.runs.append(run(1, "ns.a.a3", 7.0, attempt=2))
    h.faults += [Fault("agent_kill", "ns.a.a1", 1.05), Fault("agent_kill", "ns.a.a2", 9.0)]
    h.faults.append(Fault("agent_kill", "ns.a.a2", 1.0 - 5.5))
    assert check(h).dup_unexplained == 1


def test_an_attempt_redelivered_to_the_restarted_agent_is_explained() -> None:
    """The agent was killed holding attempt 1; its restarted process ran it 2 s later while
    the hub sent attempt 2 elsewhere."""
    h = clean()
    h.runs.append(run(1, "ns.a.a3", 1.3, attempt=2))
    h.faults.append(Fault("agent_kill", "ns.a.a2", 1.0 - 2.2))
    rep = check(h)
    assert rep.dup_agent_crash == 1 and rep.dup_unexplained == 0


def test_a_stale_attempt_started_as_its_agent_woke_is_explained() -> None:
    """Seed 24, agent_stop: the agent passed attempt 1's fence and was starting its handler
    when SIGSTOP landed; the hub gave the attempt up and attempt 2 ran elsewhere; the handler's
    first line ran 0.3 ms after SIGCONT."""
    h = clean()
    h.runs[1] = run(1, "ns.a.a2", 10.0, attempt=2)
    h.runs.append(run(1, "ns.a.a3", 14.5003, attempt=1, outcome="cancelled"))
    h.faults.append(Fault("agent_stop", "ns.a.a3", 6.0, until=14.5))
    rep = check(h)
    assert rep.dup_agent_crash == 1 and rep.dup_unexplained == 0


@pytest.mark.parametrize(
    ("start", "attempt", "paused_at"),
    [
        (14.6, 1, 6.0),  # 100 ms after waking: decided after the pause
        (14.5003, 3, 6.0),  # a later attempt than the run before: not a stale one
        (14.5003, 1, 10.5),  # paused after the other run started: it knew nothing then
    ],
)
def test_a_run_after_its_agent_woke_is_not_explained_otherwise(
    start: float, attempt: int, paused_at: float
) -> None:
    h = clean()
    h.runs[1] = run(1, "ns.a.a2", 10.0, attempt=2)
    h.runs.append(run(1, "ns.a.a3", start, attempt=attempt))
    h.faults.append(Fault("agent_stop", "ns.a.a3", paused_at, until=14.5))
    assert check(h).dup_unexplained == 1


def test_duplicate_run_around_a_hub_crash_is_counted_apart() -> None:
    h = clean()
    h.runs.append(run(1, "ns.a.a3", 5.0, attempt=2))
    h.faults.append(Fault("hub_kill", "hub1", 3.0))
    rep = check(h)
    assert rep.dup_hub_crash == 1 and rep.dup_unexplained == 0


def test_a_node_kill_explains_no_duplicate() -> None:
    h = clean()
    h.runs.append(run(1, "ns.a.a3", 5.0, attempt=2))
    h.faults.append(Fault("node_kill", "n0", 3.0))
    assert check(h).dup_unexplained == 1


def test_a_deaf_agent_explains_no_duplicate_and_no_lost_result() -> None:
    """A deaf agent never starts what is sent to it and finishes what it had started: a
    second run, or a first result not kept, around its deafness is a violation still."""
    h = clean()
    h.runs.append(run(1, "ns.a.a3", 5.0, attempt=2))
    h.faults.append(Fault("deaf", "ns.a.a2", 0.9, until=9.0))
    assert check(h).dup_unexplained == 1
    h.records[WF]["result"]["steps"][1]["decided_by"] = 2
    h.tasks[f"{WF}-1"] = task(
        1, history=[{"attempt": 1, "state": "PENDING"}, {"attempt": 2, "state": "SUCCEEDED"}]
    )
    rep = check(h)
    assert rep.first_result_lost == 1 and rep.dup_unexplained == 1 and not rep.ok


def test_read_runs_pairs_start_and_end_and_skips_torn_lines(tmp_path: Path) -> None:
    log = tmp_path / "a.jsonl"
    start = {"ev": "start", "run": "r1", "wf": WF, "step": 0, "task": f"{WF}-0", "attempt": 1}
    start |= {"agent": "ns.a.a1", "pid": 7, "t": 1.0}
    lines = [
        json.dumps(start),
        json.dumps({**start, "run": "r2", "t": 2.0}),
        json.dumps({"ev": "end", "run": "r1", "t": 1.5, "outcome": "ok"}),
        '{"ev": "start", "run": "r3", "wf"',  # SIGKILL mid-write
    ]
    log.write_text("\n".join(lines))
    runs = sorted(read_runs([log]), key=lambda r: r.run_id)
    assert [(r.run_id, r.end, r.outcome) for r in runs] == [("r1", 1.5, "ok"), ("r2", None, None)]


def test_first_result_thrown_away() -> None:
    """Attempt 1 succeeded first, yet the record was decided by attempt 2 (the issue's
    'valid results are thrown away')."""
    h = rerun_decides(clean(), 5.0, "undelivered")
    rep = check(h)
    assert rep.first_result_lost == 1 and not rep.ok
    assert "#1 PENDING undelivered" in rep.violations[0].detail


def test_first_result_lost_with_its_agent_is_explained() -> None:
    h = clean()
    h.runs.append(run(1, "ns.a.a3", 5.0, attempt=2))
    h.records[WF]["result"]["steps"][1]["decided_by"] = 2
    h.tasks[f"{WF}-1"] = task(
        1, history=[{"attempt": 1, "state": "PENDING"}, {"attempt": 2, "state": "SUCCEEDED"}]
    )
    h.faults.append(Fault("agent_kill", "ns.a.a2", 1.2))  # right after its handler ended
    rep = check(h)
    assert rep.first_result_lost == 0 and rep.dup_agent_crash == 1 and rep.ok


def test_a_run_directory_is_checked_again_offline(tmp_path: Path) -> None:
    h = clean()
    data = {"records": h.records, "tasks": h.tasks, "done": h.done, "callers": h.callers}
    data["expected"] = {WF: {"kind": "fanout", "state": "SUCCEEDED", "result": ["a", "b"]}}
    (tmp_path / "history.json").write_text(json.dumps(data))
    start = {"ev": "start", "wf": WF, "step": 1, "task": f"{WF}-1", "attempt": 1, "pid": 7}
    lines = [{**start, "run": "r1", "agent": "ns.a.a1", "t": 1.0}]
    lines.append({**start, "run": "r2", "agent": "ns.a.a2", "attempt": 2, "t": 3.0})
    (tmp_path / "ns.a.a1.jsonl").write_text("\n".join(json.dumps(x) for x in lines))
    (tmp_path / "faults.jsonl").write_text(
        json.dumps({"kind": "agent_kill", "target": "ns.a.a1", "at": 2.0}) + "\n"
    )
    rep = check(load(tmp_path))
    assert rep.workflows == 1 and rep.runs == 2 and rep.dup_agent_crash == 1 and rep.ok


def test_a_step_record_kept_as_sent_must_name_the_deciding_attempt() -> None:
    """A step decided by its current attempt keeps its task record as it was sent (PENDING):
    fine when the record's attempt is the one the result says decided; a mismatch otherwise."""
    h = clean()
    h.tasks[f"{WF}-1"] = {**task(1, "PENDING"), "attempt": 1}
    assert check(h).ok
    h.tasks[f"{WF}-1"] = {**task(1, "PENDING"), "attempt": 2}
    assert check(h).step_record_mismatch == 1


def cancelled_result() -> dict[str, Any]:
    res = result("FAILED")
    res["error"] = {"code": "REACH_WORKFLOW_CANCELLED", "message": "cancelled on request: chaos"}
    res["steps"][0]["cancelled"] = True
    return res


def cancelled(answer_at: float = 2.0) -> History:
    """The clean history's workflow, cancelled while step 0 ran (its answer came at 2.0)."""
    h = clean()
    res = cancelled_result()
    h.expected[WF] = Expected("fanout", "SUCCEEDED", ["a", "b"], cancellable=True)
    h.records[WF] = {"state": "FAILED", "result": res, "cancel": res["error"]}
    h.done[WF] = [res]
    h.callers[WF] = res
    h.tasks[f"{WF}-0"] = {**task(0, "PENDING"), "cancelled": True}
    h.runs[0] = run(0, "ns.a.a1", 1.0, outcome="cancelled")  # its handler was stopped
    h.cancels[WF] = {
        "final": True,
        "cancelled": True,
        "result": res,
        "t": answer_at,
        "asked": answer_at - 0.5,
    }
    return h


def test_a_cancelled_workflow_is_right_only_when_a_cancel_was_planned() -> None:
    rep = check(cancelled())
    assert rep.ok and rep.cancels == 1 and rep.wrong_outcome == 0, rep.table()
    h = cancelled()
    h.expected[WF] = Expected("fanout", "SUCCEEDED", ["a", "b"])  # nobody asked for it
    assert check(h).wrong_outcome == 1
    h = cancelled()
    h.expected[WF] = Expected("fanout", "FAILED")  # a planned failure is not a cancel either
    assert check(h).wrong_outcome == 1
    h = clean()  # a cancel that came too late: the natural outcome, and the answer says so
    h.expected[WF] = Expected("fanout", "SUCCEEDED", ["a", "b"], cancellable=True)
    h.cancels[WF] = {"final": True, "cancelled": False, "result": result(), "t": 2.0}
    rep = check(h)
    assert rep.ok and rep.cancels == 0


def test_a_cancel_answer_must_be_the_stored_outcome() -> None:
    h = cancelled()
    h.cancels[WF] = {"final": True, "cancelled": False, "result": cancelled_result(), "t": 2.0}
    rep = check(h)
    assert rep.cancel_untrue == 1 and not rep.ok
    h = clean()  # said "cancelled", but the workflow went on to succeed
    h.expected[WF] = Expected("fanout", "SUCCEEDED", ["a", "b"], cancellable=True)
    h.cancels[WF] = {"final": True, "cancelled": True, "result": cancelled_result(), "t": 2.0}
    rep = check(h)
    assert rep.cancel_untrue == 1 and "cancel answer untrue" in rep.table()
    h = cancelled()  # not final, or an error: nothing was promised
    h.cancels[WF] = {"final": False, "cancelled": True, "result": None, "t": 2.0}
    assert check(h).ok
    h.cancels[WF] = "MeshUnavailableError: nothing was cancelled"
    assert check(h).ok


def test_nothing_of_a_cancelled_workflow_starts_after_the_answer() -> None:
    h = cancelled(answer_at=2.0)
    h.runs.append(run(0, "ns.a.a3", 4.0, attempt=2))
    rep = check(h)
    assert rep.ran_after_cancel == 1 and not rep.ok
    assert "ran after its cancel" in rep.table()
    # Unless its agent had passed the fence and was paused right then (woke and started).
    h.faults.append(Fault("agent_stop", "ns.a.a3", 1.0, until=3.99))
    assert check(h).ran_after_cancel == 0
    # A step the cancel did not stop may run again (an agent crash): not this check's.
    h = cancelled(answer_at=2.0)
    h.runs.append(run(1, "ns.a.a3", 4.0, attempt=1))
    assert check(h).ran_after_cancel == 0


def test_a_step_that_had_finished_is_not_cancelled() -> None:
    """Its handler ended with a result before the cancel was sent: it must keep it."""
    h = cancelled()
    h.runs[0] = run(0, "ns.a.a1", 1.0)  # ended ok at 1.1, the cancel was sent at 1.5
    rep = check(h)
    assert rep.first_result_lost == 1 and not rep.ok
    assert "finished step cancelled" in rep.table()
    h.faults.append(Fault("agent_kill", "ns.a.a1", 1.2))  # its status may never have been stored
    assert check(h).first_result_lost == 0


def test_a_finished_step_cancelled_while_a_partition_cut_its_agent_off_is_explained() -> None:
    """Secure seed 156: the step's agent, cut off with its node, ended ok just after the cut
    (its final status stored nowhere: no quorum on its side), the cancel came on the other
    side and the step was decided there before the routes were back (a second after the
    relays at most): no hub that could decide had the result. Counted apart."""
    h = cancelled(answer_at=8.0)  # the cancel sent at 7.5, the result stored at 7.9
    h.runs[0] = run(0, "ns.a.a1", 1.0)  # ended ok at 1.1
    h.records[WF]["result"]["finished_at"] = 7.9
    h.tasks[f"{WF}-0"]["updated_at"] = 7.8  # its fence
    assert check(h).first_result_lost == 1
    cut = Fault("partition", "n2", 1.05, 7.2, cut_off=("ns.a.a1",))  # routes back by 8.2
    h.faults.append(cut)
    rep = check(h)
    assert rep.first_result_lost == 0 and rep.cancelled_cut_off == 1 and rep.ok, rep.table()
    assert "finished step cancelled while cut off" in rep.table()
    # Decided once the routes were back (the fence, the final record: the earlier bounds
    # it), its status could have been read or its agent asked: a result thrown away.
    h.tasks[f"{WF}-0"]["updated_at"] = h.records[WF]["result"]["finished_at"] = 8.3
    assert check(h).first_result_lost == 1
    h.tasks[f"{WF}-0"]["updated_at"] = 8.1  # a later rewrite of the final record: its fence
    assert check(h).first_result_lost == 0
    del h.tasks[f"{WF}-0"]["updated_at"], h.records[WF]["result"]["finished_at"]
    assert check(h).first_result_lost == 1  # not known when it was decided: nothing explained
    h.tasks[f"{WF}-0"]["updated_at"] = 7.8
    # Ended before the cut (its status stored then), another agent cut off, or the cut's end
    # not known: nothing explained.
    for fault in (
        Fault("partition", "n2", 1.2, 7.2, cut_off=("ns.a.a1",)),
        Fault("partition", "n2", 1.05, 7.2, cut_off=("ns.a.a2",)),
        Fault("partition", "n2", 1.05, None, cut_off=("ns.a.a1",)),
        Fault("node_kill", "n2", 1.05, 7.2),
    ):
        h.faults = [fault]
        assert check(h).first_result_lost == 1, fault


def test_the_final_record_keeps_its_cancel_exactly_when_the_result_is_the_cancels() -> None:
    h = cancelled()
    del h.records[WF]["cancel"]
    rep = check(h)
    assert rep.cancel_untrue == 1 and not rep.ok
    h = clean()
    h.records[WF]["cancel"] = {"code": "REACH_WORKFLOW_CANCELLED", "message": "x"}
    assert check(h).cancel_untrue == 1


def test_the_planned_retry_of_a_flaky_step_is_no_duplicate() -> None:
    h = clean()
    h.runs[0] = run(0, "ns.a.a1", 1.0, outcome="flaky")
    h.runs.append(run(0, "ns.a.a2", 1.5, attempt=2))
    h.records[WF]["result"]["steps"][0]["decided_by"] = 2  # (shared with .done, the caller)
    history = [{"attempt": 1, "state": "FAILED"}, {"attempt": 2, "state": "SUCCEEDED"}]
    h.tasks[f"{WF}-0"] = task(0, history=history)
    rep = check(h)
    assert rep.ok and rep.dup_unexplained == 0, rep.table()
    h.runs.append(run(0, "ns.a.a2", 2.5, attempt=3))  # one more than planned
    assert check(h).dup_unexplained == 1


def with_route(state: str = "SUCCEEDED", value: Any = None) -> History:
    """``clean()`` and one routed request, answered as planned unless told otherwise."""
    h = clean()
    h.route_expected["r1"] = ExpectedRoute("SUCCEEDED", {"x": 2}, "direct")
    h.routes["r1"] = {"state": state, "result": {"x": 2} if value is None else value}
    h.runs.append(Run("rr1", None, None, "r1", 1, "ns.a.a1", 1, 2.0, 2.1, "ok"))
    return h


def rerouted(second: Run, *faults: Fault) -> History:
    """``with_route()``, its route run again as ``second``, and ``faults``."""
    h = with_route()
    h.runs.append(second)
    h.faults.extend(faults)
    return h


def test_a_route_answered_as_planned_passes() -> None:
    rep = check(with_route())
    assert rep.ok and rep.routes == 1 and rep.runs == 3
    assert rep.route_lost == rep.route_wrong == 0


@pytest.mark.parametrize(
    ("state", "value"), [("FAILED", None), ("TIMEOUT", None), ("SUCCEEDED", {"x": 3})]
)
def test_a_route_answered_otherwise_is_wrong(state: str, value: Any) -> None:
    rep = check(with_route(state, value))
    assert rep.route_wrong == 1 and not rep.ok
    assert "route wrong outcome: 1" in rep.table()


def test_a_route_never_answered_is_lost() -> None:
    h = with_route()
    h.routes["r1"] = "MeshTimeoutError: no answer"
    rep = check(h)
    assert rep.route_lost == 1 and not rep.ok and "route lost: 1" in rep.table()


def test_a_second_run_of_a_routes_task_id_needs_a_fault() -> None:
    h = with_route()
    h.runs.append(Run("rr2", None, None, "r1", 1, "ns.a.a2", 1, 3.0, 3.1, "ok"))
    rep = check(h)
    assert rep.dup_unexplained == 1 and not rep.ok
    assert "r1 ran on ns.a.a1#1" in rep.table()
    h.faults.append(Fault("agent_kill", "ns.a.a1", 2.05, 3.0))
    assert check(h).ok and check(h).dup_agent_crash == 1


def test_routes_are_checked_again_offline(tmp_path: Path) -> None:
    h = with_route(value={"x": 5})
    (tmp_path / "history.json").write_text(
        json.dumps(
            {
                "expected": {WF: {"kind": "fanout", "state": "SUCCEEDED", "result": ["a", "b"]}},
                "records": h.records,
                "tasks": h.tasks,
                "done": h.done,
                "callers": h.callers,
                "route_expected": {"r1": {"state": "SUCCEEDED", "result": {"x": 2}}},
                "routes": h.routes,
            }
        )
    )
    rep = check(load(tmp_path))
    assert rep.routes == 1 and rep.route_wrong == 1


def test_a_routes_second_run_around_a_frozen_node_is_counted_apart() -> None:
    """The pins' documented window: a frozen NATS server held or lost the message that would
    have sent the retry to the first agent. Only for routes, and only in that window."""
    h = with_route()
    h.runs.append(Run("rr2", None, None, "r1", 1, "ns.a.a2", 1, 9.0, 9.1, "ok"))
    h.faults.append(Fault("node_stop", "n0", 1.5, 9.5))
    rep = check(h)
    assert rep.ok and rep.dup_route_frozen == 1 and rep.dup_unexplained == 0
    assert check(with_frozen(h, at=9.2)).dup_unexplained == 1  # frozen after the second run
    assert check(with_frozen(h, at=0.1, until=0.5)).dup_unexplained == 1  # over before


def with_frozen(h: History, at: float, until: float | None = None) -> History:
    return History(
        **{
            **h.__dict__,
            "faults": [Fault("node_stop", "n0", at, at + 8 if until is None else until)],
        }
    )


def test_a_frozen_node_explains_no_step_run_twice() -> None:
    h = clean()
    h.runs.append(run(0, "ns.a.a2", 3.0, attempt=2))
    h.faults.append(Fault("node_stop", "n0", 1.5, 9.5))
    rep = check(h)
    assert rep.dup_unexplained == 1 and rep.dup_route_frozen == 0 and not rep.ok


def test_a_partition_explains_the_runs_of_the_agents_it_cut_off_until_soon_after_it() -> None:
    """An agent on the node a partition cut off may be declared LOST by the hubs of the other
    side and its step run elsewhere (a route's retry too): explained, during the cut and until
    ``HEAL`` s after it for a route, whenever for a step (its attempt was given up for good).
    Not an agent it did not cut off, nor a route's retry long after the heal (seed 144:
    retries 15 s after the heal ran elsewhere, their pins lost in the cut)."""
    h = clean()
    h.runs.append(run(1, "ns.a.a3", 5.0, attempt=2))
    h.faults.append(Fault("partition", "n2", 1.5, 4.0, cut_off=("ns.a.a2", "hub-1")))
    rep = check(h)
    assert rep.dup_agent_crash == 1 and rep.dup_unexplained == 0 and rep.ok
    later = History(**{**h.__dict__, "runs": [*h.runs[:2], run(1, "ns.a.a3", 30.0, attempt=2)]})
    assert check(later).dup_agent_crash == 1  # a step's attempt given up for good in the cut
    other = History(
        **{**h.__dict__, "faults": [Fault("partition", "n1", 1.5, 4.0, cut_off=("ns.a.a1",))]}
    )
    assert check(other).dup_unexplained == 1
    route = with_route()
    route.runs.append(Run("rr2", None, None, "r1", 1, "ns.a.a2", 1, 3.0, 3.1, "ok"))
    route.faults.append(Fault("partition", "n0", 1.9, 2.5, cut_off=("ns.a.a1",)))
    assert check(route).ok and check(route).dup_agent_crash == 1
    late = History(
        **{
            **route.__dict__,
            "runs": [
                *route.runs[:-1],
                Run("rr2", None, None, "r1", 1, "ns.a.a2", 1, 9.0, 9.1, "ok"),
            ],
        }
    )
    assert check(late).dup_unexplained == 1  # a route's retry long after the heal


def test_a_routes_run_while_its_holder_is_cut_off_again_before_its_caller_asks_is_explained() -> (
    None
):
    """Secure seed 158's ``partition``: the route ran on ``a1`` (2.0-2.1 here), whose node was
    cut off 0.05 s after the run began: its answer lost. The heal (5.0) gave ``a1`` back while
    its caller still waited for that answer (``ROUTE_TIMEOUT``, to 12.0), and the next cut of
    that node (11.4) took it again before the caller asked again: every retry found the holder
    cut off and LOST, and one ran on ``a2`` (19.2) — the at-least-once window of a holder out
    of reach. Not if the holder was within reach when the caller could ask (the second cut
    begun after the wait ran out), nor if that cut cut the caller off too (it could ask the
    holder there), nor if the first run's answer was not lost in a cut, nor long after the
    second heal."""
    first = Fault("partition", "n0", 2.05, 5.0, cut_off=("ns.a.a1", "hub-0"))
    again = Fault("partition", "n0", 11.4, 20.5, cut_off=("ns.a.a1", "hub-0"))
    dup = Run("rr2", None, None, "r1", 1, "ns.a.a2", 1, 19.2, 19.4, "ok")

    def routed(*faults: Fault, second: Run = dup) -> History:
        return rerouted(second, *faults)

    assert check(routed(first)).dup_unexplained == 1  # (11 s after the first heal: not HEAL)
    rep = check(routed(first, again))
    assert rep.ok and rep.dup_agent_crash == 1 and rep.dup_unexplained == 0, rep.table()
    later = Fault("partition", "n0", 13.2, 20.5, cut_off=("ns.a.a1",))  # after the wait
    assert check(routed(first, later)).dup_unexplained == 1
    with_caller = Fault("partition", "n0", 11.4, 20.5, cut_off=("ns.a.a1", "reach-client"))
    assert check(routed(first, with_caller)).dup_unexplained == 1
    not_lost = Fault("partition", "n0", 3.2, 5.0, cut_off=("ns.a.a1",))  # the answer was out
    assert check(routed(not_lost, again)).dup_unexplained == 1
    assert check(routed(again)).dup_unexplained == 1  # the first run not cut off at all
    late = Run("rr2", None, None, "r1", 1, "ns.a.a2", 1, 24.0, 24.2, "ok")
    assert check(routed(first, again, second=late)).dup_unexplained == 1


def test_a_routes_run_while_its_holder_is_cut_off_after_its_caller_was_is_explained() -> None:
    """Secure seed 165's ``partition`` (``chaos-165-r00304``): the route ran on ``a1`` (2.0-2.1
    here), and its caller's node was cut off 7 ms after the run began, with the caller and the
    hub that had routed it: the answer lost. The heal (6.8) gave the caller back while it still
    waited for that answer (to 12.0), and a cut of ``a1``'s node (11.8), away from the caller,
    took ``a1`` before the caller asked again: every retry found it out of reach until it was
    declared LOST, and the route ran on ``a2`` (18.0) — as ``_cut_off_again`` for a first cut
    of the agent. Not if the first cut took neither the caller nor ``a1`` (a hub alone), nor if
    it began after the answer was out, nor if ``a1`` was within reach when the caller could
    ask (its cut begun after the wait), nor if that cut took the caller too, nor long after
    its heal."""
    callers = Fault("partition", "n1", 2.05, 6.8, cut_off=("hub-1", "reach-client"))
    again = Fault("partition", "n2", 11.8, 19.5, cut_off=("ns.a.a1", "hub-2"))
    dup = Run("rr2", None, None, "r1", 1, "ns.a.a2", 1, 18.0, 18.2, "ok")

    assert check(rerouted(dup, callers)).dup_unexplained == 1
    assert check(rerouted(dup, again)).dup_unexplained == 1  # the first answer not lost in a cut
    rep = check(rerouted(dup, callers, again))
    assert rep.ok and rep.dup_agent_crash == 1 and rep.dup_unexplained == 0, rep.table()
    hub_alone = Fault("partition", "n1", 2.05, 6.8, cut_off=("hub-1",))
    assert check(rerouted(dup, hub_alone, again)).dup_unexplained == 1
    answered = Fault("partition", "n1", 3.2, 6.8, cut_off=("hub-1", "reach-client"))
    assert check(rerouted(dup, answered, again)).dup_unexplained == 1
    after_wait = Fault("partition", "n2", 13.2, 19.5, cut_off=("ns.a.a1",))
    assert check(rerouted(dup, callers, after_wait)).dup_unexplained == 1
    with_caller = Fault("partition", "n2", 11.8, 19.5, cut_off=("ns.a.a1", "reach-client"))
    assert check(rerouted(dup, callers, with_caller)).dup_unexplained == 1
    late = Run("rr2", None, None, "r1", 1, "ns.a.a2", 1, 23.0, 23.2, "ok")
    assert check(rerouted(late, callers, again)).dup_unexplained == 1


def test_a_first_result_held_up_by_a_partition_is_explained() -> None:
    """The first run's result, on the far side of a partition, was stored after another
    attempt's: not a valid result thrown away by the hub."""
    h = clean()
    h.runs.append(run(1, "ns.a.a3", 3.0, attempt=2))
    h.records[WF]["result"]["steps"][1]["decided_by"] = 2
    h.tasks[f"{WF}-1"] = task(
        1, history=[{"attempt": 1, "state": "PENDING"}, {"attempt": 2, "state": "SUCCEEDED"}]
    )
    assert check(h).first_result_lost == 1
    h.faults.append(Fault("partition", "n2", 0.5, 4.0, cut_off=("ns.a.a2",)))
    rep = check(h)
    assert rep.first_result_lost == 0 and rep.dup_agent_crash == 1 and rep.ok


def test_a_result_not_stored_when_its_agent_was_cut_off_explains_the_next_run() -> None:
    """Secure seed 161's ``partition`` (seconds of the run; here): the heal of a cut (45.8;
    9.6) unseated the leaders of ``REACH_STATUS`` and the task records, none elected before
    the next cut (50.85; 14.85) took the agent that had run the step (45.7-46.1; 9.7-9.8) and
    its workflow's owner. The agent's stores of the final status went unanswered until it
    gave up (its "not stored" line, 58.2; 22.1); the hubs of the other side, nothing stored,
    gave the attempt up for the agent LOST and ran the step again (56.8; 20.0): the first
    result not kept and the re-run, explained. Not without the agent's line (its status may
    have been stored: a hub lost it), nor the line of another agent or task, nor one from
    before the cut (the agent in reach then) or long after the run, nor a re-run before the
    cut (``read_unstored`` leaves out lines of other errors)."""
    h = clean()
    h.runs[1] = run(1, "ns.a.a2", 9.7)
    h = rerun_decides(h, 20.0, "lost")
    h.faults.extend(
        [
            Fault("partition", "n2", 2.0, 9.6, cut_off=("hub-1",)),
            Fault("partition", "n0", 14.85, 24.7, cut_off=("ns.a.a2", "hub-0")),
        ]
    )
    rep = check(h)
    # (begun 5.15 s before the cut: not the runs a partition explains, ``PRIOR``)
    assert rep.first_result_lost == 1 and rep.dup_unexplained == 1
    h.unstored = {("ns.a.a2", f"{WF}-1"): [22.1]}
    rep = check(h)
    assert rep.ok and rep.first_result_lost == 0 and rep.dup_agent_crash == 1, rep.table()
    for unstored in (
        {("ns.a.a1", f"{WF}-1"): [22.1]},  # another agent's line
        {("ns.a.a2", f"{WF}-0"): [22.1]},  # another task's
        {("ns.a.a2", f"{WF}-1"): [14.0]},  # given up before the cut: it was in reach then
        {("ns.a.a2", f"{WF}-1"): [40.0]},  # long after its run: another store
    ):
        other = History(**{**h.__dict__, "unstored": unstored})
        assert check(other).first_result_lost == 1, unstored
    early = History(**{**h.__dict__, "runs": [*h.runs[:2], run(1, "ns.a.a3", 14.0, attempt=2)]})
    assert check(early).dup_unexplained == 1  # run again before the cut: not for it


def test_an_agents_unstored_final_statuses_are_read_from_its_log(tmp_path: Path) -> None:
    """The agent's process log (``<agent id>.log``, JSON lines) says when it gave up storing a
    final status: only for JetStream's errors (no answer, no stream, unavailable)."""
    lines = [
        {
            "ts": "2026-12-06T01:37:38.232Z",
            "msg": "final status of t-2 not stored: TimeoutError() ",
        },
        {
            "ts": "2026-12-06T01:37:39.000Z",
            "msg": "final status of t-3 not stored: ValueError('x')",
        },
        {"ts": "2026-12-06T01:37:40.000Z", "msg": "heartbeat of a failed: TimeoutError()"},
    ]
    text = "\n".join(json.dumps(x) for x in lines) + "\n{torn"
    (tmp_path / "ns.a.a1.log").write_text(text)
    got = read_unstored([tmp_path / "ns.a.a1.log", tmp_path / "ns.a.a2.log"])
    assert got == {("ns.a.a1", "t-2"): [1796521058.232]}


def test_a_partitions_cut_off_clients_are_read_back(tmp_path: Path) -> None:
    line = {"kind": "partition", "target": "n1", "at": 1.0, "until": 5.0, "cut_off": ["a", "b"]}
    (tmp_path / "faults.jsonl").write_text(json.dumps(line) + "\n")
    assert read_faults(tmp_path / "faults.jsonl") == [
        Fault("partition", "n1", 1.0, 5.0, cut_off=("a", "b"))
    ]


def test_a_route_that_timed_out_on_its_agent_runs_there_again_as_its_next_attempt() -> None:
    """Its caller asks again after ``REACH_TIMEOUT``: the next attempt, on the same agent,
    runs (seed 147: a direct-mode decision that came after a partition left 0.5 s). Not on
    another agent, nor after a run that did not time out."""
    h = with_route()
    h.runs[-1] = Run("rr1", None, None, "r1", 1, "ns.a.a1", 1, 2.0, 2.5, "cancelled")
    h.runs.append(Run("rr2", None, None, "r1", 2, "ns.a.a1", 1, 3.0, 3.1, "ok"))
    assert check(h).ok and check(h).dup_unexplained == 0
    elsewhere = History(
        **{
            **h.__dict__,
            "runs": [*h.runs[:-1], Run("rr2", None, None, "r1", 2, "ns.a.a2", 1, 3.0, 3.1, "ok")],
        }
    )
    assert check(elsewhere).dup_unexplained == 1


# --------------------------------------------------------------------------- policy fanouts

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


def test_a_routes_retry_while_its_holder_had_yet_to_register_again_is_explained() -> None:
    """Open seed 160's ``partition``: ``a1`` was cut off (1.0-5.6) and declared LOST; back, it
    could not register again (JetStream refused the write for 35 s). The route ran on it
    (10.6-10.8), and a cut that took its caller (10.615) lost the answer. The caller's retry
    after its 10 s wait (20.86) named ``a1``, registered at no hub: "no routable agent", then
    routed by capability as new, to ``a2``; ``a1`` was cut off again 0.52 s later (21.38), so
    no wait for its registration could have ended in time. Not without the earlier cut (the
    holder registered), nor if the answer was not lost, nor a run long before or after the
    wait's end, nor without the next cut (the holder might have registered), nor if that cut
    came with the callers."""
    before = Fault("partition", "n0", 1.0, 5.6, cut_off=("ns.a.a1",))
    caller = Fault("partition", "n1", 10.615, 16.4, cut_off=("ns.a.a0", "reach-client"))
    again = Fault("partition", "n0", 21.38, 30.8, cut_off=("ns.a.a1",))
    first = Run("rr1", None, None, "r1", 1, "ns.a.a1", 1, 10.6, 10.8, "ok")
    dup = Run("rr2", None, None, "r1", 1, "ns.a.a2", 1, 20.86, 21.0, "ok")

    def routed(*faults: Fault, second: Run = dup) -> History:
        h = with_route()
        h.runs[-1] = first  # (with_route's run of r1)
        h.runs.append(second)
        h.faults.extend(faults)
        return h

    rep = check(routed(before, caller, again))
    assert rep.ok and rep.dup_agent_crash == 1 and rep.dup_unexplained == 0, rep.table()
    assert check(routed(caller, again)).dup_unexplained == 1  # never cut off before
    short = Fault("partition", "n0", 4.0, 5.6, cut_off=("ns.a.a1",))  # too short for LOST
    assert check(routed(short, caller, again)).dup_unexplained == 1
    assert check(routed(before, again)).dup_unexplained == 1  # the answer not lost
    for at in (14.0, 34.0):
        other = Run("rr2", None, None, "r1", 1, "ns.a.a2", 1, at, at + 0.1, "ok")
        assert check(routed(before, caller, again, second=other)).dup_unexplained == 1
    # 2.1 s after the wait's end: not a retry that found the holder unregistered, but within
    # the next cut of ``a1``, begun within ``SLACK`` of the wait's end: ``_cut_off_again``'s
    # window, the answer lost in the caller's cut (seed 165).
    other = Run("rr2", None, None, "r1", 1, "ns.a.a2", 1, 23.0, 23.1, "ok")
    assert not _unregistered_when_asked(first, other, [before, caller, again])
    assert _cut_off_again(first, other, [before, caller, again])
    assert check(routed(before, caller)).dup_unexplained == 1  # no cut after the retry
    late = Fault("partition", "n0", 26.5, 30.8, cut_off=("ns.a.a1",))  # past a resend's wait
    assert check(routed(before, caller, late)).dup_unexplained == 1
    with_caller = Fault("partition", "n0", 21.38, 30.8, cut_off=("ns.a.a1", "reach-client"))
    assert check(routed(before, caller, with_caller)).dup_unexplained == 1


def test_a_routes_retry_while_its_holders_registration_was_refused_is_explained() -> None:
    """Secure seed 168's ``partition`` (``chaos-168-r00049``): the route ran on ``a1`` (2.0-2.1
    here), ``a1`` was cut off 70 ms into the run for 7.26 s (long enough to be declared LOST),
    its answer lost; back, its registration again was refused (its log, 2.1 s after the heal:
    JetStream not taking writes yet), and the caller's retry, when its wait ran out (12.0, and
    0.76 s to decide), found it registered nowhere — 3.4 s after the heal, past ``HEAL`` — and
    ran on ``a2``. Not without the refusal in its log between the heal and the retry, nor for a
    run that is not the caller's retry, nor when the cut began after the answer was out or was
    too short to have ``a1`` declared LOST."""
    cut = Fault("partition", "n0", 2.07, 9.33, cut_off=("ns.a.a1",))
    dup = Run("rr2", None, None, "r1", 1, "ns.a.a2", 1, 12.76, 12.9, "ok")

    def routed(*faults: Fault, second: Run = dup, refused: tuple[float, ...] = (11.46,)) -> History:
        h = rerouted(second, *faults)
        h.unregistered = {"ns.a.a1": list(refused)} if refused else {}
        return h

    rep = check(routed(cut))
    assert rep.ok and rep.dup_agent_crash == 1 and rep.dup_unexplained == 0, rep.table()
    assert check(routed(cut, refused=())).dup_unexplained == 1
    assert check(routed(cut, refused=(5.0,))).dup_unexplained == 1  # while it was cut off
    assert check(routed(cut, refused=(13.0,))).dup_unexplained == 1  # after the retry
    other = Run("rr2", None, None, "r1", 1, "ns.a.a2", 1, 14.0, 14.1, "ok")
    assert check(routed(cut, second=other)).dup_unexplained == 1  # not the caller's retry
    answered = Fault("partition", "n0", 3.2, 9.33, cut_off=("ns.a.a1",))
    assert check(routed(answered)).dup_unexplained == 1
    short = Fault("partition", "n0", 2.07, 4.5, cut_off=("ns.a.a1",))
    assert check(routed(short, refused=(4.6,))).dup_unexplained == 1


def test_an_agents_refused_registrations_are_read_from_its_log(tmp_path: Path) -> None:
    lines = [
        {
            "ts": "2026-12-06T04:35:55.989Z",
            "msg": "no hub answered the registration of "
            "ns.a.a1 (MeshUnavailableError): is a hub running on nats://x? Retrying for up to 30 s",
        },
        {"ts": "2026-12-06T04:35:56.5Z", "msg": "ns.a.a1 did not register: nobody answered"},
        {"ts": "2026-12-06T04:35:57Z", "msg": "hub does not know ns.a.a1: registering again"},
        {"ts": "2026-12-06T04:35:58Z", "msg": "no hub answered the registration of ns.a.a9 (x)"},
    ]
    (tmp_path / "ns.a.a1.log").write_text("\n".join(json.dumps(x) for x in lines) + "\nnot json\n")
    got = read_unregistered([tmp_path / "ns.a.a1.log", tmp_path / "ns.a.a2.log"])
    assert got == {"ns.a.a1": [1796531755.989, 1796531756.5]}
