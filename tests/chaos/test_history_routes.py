"""The history checker on routes and partitions: a route's second run needs a fault that
explains it (a frozen node, a cut of its holder or its caller, a holder out of the registry),
and what each partition rule reads from the run's logs. Split from ``test_history.py``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from .explained import (
    CALLER,
    OBSERVER,
    SIDE_RUNS,
    _cut_off_again,
    _unregistered_at_retry,
    _unregistered_when_asked,
    caller_side,
)
from .history import (
    ExpectedRoute,
    Fault,
    History,
    Run,
    check,
    load,
    read_faults,
    read_unregistered,
    read_unstored,
)
from .test_history import WF, clean, rerun_decides, run, task


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


@pytest.mark.parametrize(
    ("fields", "observer"),
    [
        ({}, None),  # an open run: the caller's connection observes
        ({"config": {"secure": True}}, CALLER),  # before the observer had a name of its own
        ({"config": {"secure": True}, "observer": OBSERVER}, OBSERVER),
        ({"config": {"secure": False}, "observer": None}, None),
    ],
)
def test_a_runs_observer_is_read_back(
    tmp_path: Path, fields: dict[str, Any], observer: str | None
) -> None:
    h = with_route()
    data = {"expected": {}, "records": {}, "tasks": {}, "done": {}, "callers": {}, **fields}
    (tmp_path / "history.json").write_text(json.dumps({**data, "routes": h.routes}))
    assert load(tmp_path).observer == observer


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


def test_a_cut_naming_the_callers_name_of_an_observer_is_read_from_the_routes_run_in_it() -> None:
    """Secure seed 176's ``partition`` (``chaos-176-r00270``; seconds past 1796548390, the
    times here in brackets): ``a1`` ran the route 4.746-4.937 (2.0-2.1), and ``n1`` was cut off
    at 4.924 (2.05) with the caller and the hub that had routed it: the answer lost. ``n0`` was
    cut off at 13.587 (11.8) with ``a1`` and the observer — a secure run's hub-identity
    connection, named as the caller then — not the caller: 76 route runs began in that cut, every
    one on the other side's agents. Every retry found ``a1`` out of reach until it was declared
    LOST, and the route ran on ``a4`` at 16.715 (15.0): ``_cut_off_again``, once the cut is read
    as one of the observer. Not in a run whose observer has a name of its own (or is the
    caller's connection), nor with fewer than ``SIDE_RUNS`` such route runs, nor with one of
    them on an agent the cut took, nor counting runs of the cut's first ``SLACK`` s or of
    workflow steps."""
    callers = Fault("partition", "n1", 2.05, 6.8, cut_off=("hub-1", CALLER))
    observers = Fault("partition", "n0", 11.8, 19.5, cut_off=("ns.a.a1", CALLER))
    dup = Run("rr2", None, None, "r1", 1, "ns.a.a4", 1, 15.0, 15.2, "ok")

    def routes(*agents: str, at: float = 13.0) -> list[Run]:
        """Other routes' runs on ``agents``, from ``at``, 0.1 s apart."""
        return [
            Run(f"o{i}", None, None, f"o{i}", 1, agent, 1, at + i / 10, at + i / 10 + 0.1, "ok")
            for i, agent in enumerate(agents)
        ]

    def seen(runs: list[Run], observer: str | None = CALLER) -> History:
        h = rerouted(dup, callers, observers)
        h.runs.extend(runs)
        h.observer = observer
        return h

    others = ["ns.a.a3", "ns.a.a4"] * (SIDE_RUNS // 2)
    rep = check(seen(routes(*others)))
    assert rep.ok and rep.dup_agent_crash == 1 and rep.dup_unexplained == 0, rep.table()
    assert check(seen(routes(*others), observer=None)).dup_unexplained == 1
    assert check(seen(routes(*others), observer=OBSERVER)).dup_unexplained == 1
    few = others[: SIDE_RUNS - 2]  # with the re-run itself (on a4, in the cut): one short
    assert check(seen(routes(*few))).dup_unexplained == 1
    assert check(seen(routes(*others, "ns.a.a1"))).dup_unexplained == 1  # routes ran there
    assert check(seen(routes(*others, at=11.8))).dup_unexplained == 1  # some in its first 1 s
    steps = [
        Run(f"s{i}", f"w{i}", 0, f"w{i}-0", 1, agent, 1, 13.0 + i / 10, 13.1 + i / 10, "ok")
        for i, agent in enumerate(others)
    ]
    assert check(seen(steps)).dup_unexplained == 1  # (workflow steps are no caller's routes)
    # The caller's own cut keeps its name: no route ran in it (nor could, the answers lost).
    (kept, read) = caller_side([callers, observers], routes(*others))
    assert kept == callers and read.cut_off == ("ns.a.a1",)


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
    final status: only for JetStream's errors (no answer, no stream, unavailable, a try
    proposed on a leader cut off from its quorum: "in process")."""
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
        {
            "ts": "2026-12-06T01:37:41.000Z",
            "msg": "final status of t-4 not stored: APIError() duplicate message id is in process",
        },
        {
            "ts": "2026-12-06T01:37:42.000Z",
            "msg": "final status of t-5 not stored: APIError() insufficient resources",
        },
    ]
    text = "\n".join(json.dumps(x) for x in lines) + "\n{torn"
    (tmp_path / "ns.a.a1.log").write_text(text)
    got = read_unstored([tmp_path / "ns.a.a1.log", tmp_path / "ns.a.a2.log"])
    assert got == {("ns.a.a1", "t-2"): [1796521058.232], ("ns.a.a1", "t-4"): [1796521061.0]}


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
    # Secure seed 207 (``chaos-207-r00049``): the retry routed as new 11.1 s after the run
    # began, past the ``HOLDER_WAIT`` of a resend nobody claimed.
    resent = Run("rr2", None, None, "r1", 1, "ns.a.a2", 1, 13.1, 13.2, "ok")
    assert check(routed(cut, second=resent)).dup_unexplained == 0
    answered = Fault("partition", "n0", 3.2, 9.33, cut_off=("ns.a.a1",))
    assert check(routed(answered)).dup_unexplained == 1
    short = Fault("partition", "n0", 2.07, 4.5, cut_off=("ns.a.a1",))
    assert check(routed(short, refused=(4.6,))).dup_unexplained == 1


def test_a_routes_retry_whose_wait_for_its_holders_registration_ran_out_is_explained() -> None:
    """Secure seed 171's ``partition`` (``chaos-171-r00282``): the route ran on ``a1`` (2.0-2.1
    here), ``a1`` and the caller were cut off 0.1 s into the run for 9.9 s (``a1`` declared
    LOST), the answer lost; back, ``a1``'s registration was refused (its log, 1.0 s after the
    heal; ``KV_reach_agents`` without a leader from 0.6 s to 7.0 s after it). The caller's retry
    (~12.75, marked) found ``a1`` holding the task, and its hub waited for the registration half
    the retry's time, then routed it as new: ``a2`` ran it 15.74 s after the first run began
    (17.74), 5.74 s after the heal. Not without the refusal between the heal and that run, nor
    for a run between the retry's window and the wait's end or after that end, nor when the cut
    healed after the retry's ask (the hub could not have found ``a1``: no wait), nor when the
    answer was out before the cut, nor after a cut too short to have ``a1`` declared LOST."""
    cut = Fault("partition", "n1", 2.1, 12.0, cut_off=("ns.a.a1", "reach-client"))
    dup = Run("rr2", None, None, "r1", 1, "ns.a.a2", 1, 17.74, 17.9, "ok")

    def routed(*faults: Fault, second: Run = dup, refused: tuple[float, ...] = (13.02,)) -> History:
        h = rerouted(second, *faults)
        h.unregistered = {"ns.a.a1": list(refused)} if refused else {}
        return h

    rep = check(routed(cut))
    assert rep.ok and rep.dup_agent_crash == 1 and rep.dup_unexplained == 0, rep.table()
    first = Run("rr1", None, None, "r1", 1, "ns.a.a1", 1, 2.0, 2.1, "ok")  # (with_route's)
    assert _unregistered_at_retry(first, dup, [cut], {"ns.a.a1": [13.02]})
    assert check(routed(cut, refused=())).dup_unexplained == 1
    assert check(routed(cut, refused=(11.0,))).dup_unexplained == 1  # while it was cut off
    assert check(routed(cut, refused=(18.0,))).dup_unexplained == 1  # after the run
    for at in (15.3, 19.5):  # neither the retry nor the wait's end: past the retry, past the wait
        other = Run("rr2", None, None, "r1", 1, "ns.a.a2", 1, at, at + 0.1, "ok")
        assert check(routed(cut, second=other)).dup_unexplained == 1
    late = Fault("partition", "n1", 2.1, 14.0, cut_off=("ns.a.a1", "reach-client"))
    assert check(routed(late, refused=(14.5,))).dup_unexplained == 1  # healed after the ask
    answered = Fault("partition", "n1", 3.2, 12.0, cut_off=("ns.a.a1", "reach-client"))
    assert check(routed(answered)).dup_unexplained == 1
    short = Fault("partition", "n1", 2.1, 4.5, cut_off=("ns.a.a1", "reach-client"))
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
