"""The history checker on hand-made histories: a clean one passes, each violation is found."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from .history import (
    Expected,
    Fault,
    History,
    Run,
    check,
    load,
    read_runs,
)

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


def test_a_step_record_kept_as_sent_must_not_be_fenced_since() -> None:
    """A step decided by its current attempt whose record, kept as sent, was fenced since
    (``cancelled``: a hub that had lost the workflow stopped it as unneeded, chaos secure
    seed 177, ``node_stop``, chaos-177-00596) says the step was stopped, against the result:
    a mismatch. Not a record that holds the outcome (fenced or not), nor a step the result
    says was stopped."""
    h = clean()
    h.tasks[f"{WF}-1"] = {**task(1, "PENDING"), "attempt": 1, "cancelled": True}
    rep = check(h)
    assert rep.step_record_mismatch == 1 and rep.ok, rep.violations
    assert "cancelled" in rep.violations[0].detail
    h.tasks[f"{WF}-1"] = {**task(1, "SUCCEEDED"), "cancelled": True}
    assert check(h).step_record_mismatch == 0
    h = clean()
    h.records[WF]["result"]["steps"][1].update(state="PENDING", cancelled=True)
    h.tasks[f"{WF}-1"] = {**task(1, "PENDING"), "attempt": 1, "cancelled": True}
    assert check(h).step_record_mismatch == 0


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
