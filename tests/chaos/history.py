"""The history checker of the fault-injection suite: pure Python, no I/O beyond reading files.

It takes everything a chaos run leaves behind and checks the workflow invariants
(docs/reliability.md):

- what each workflow was expected to end as (the workload knows: every step's behaviour is
  in its payload);
- every handler execution the agents logged (one ``start`` and, unless the process died, one
  ``end`` JSON line per run);
- the stored records (``reach_workflows``, ``reach_tasks``);
- every ``.done`` announcement (the run captures them in a stream of its own);
- what each caller's ``Client.workflow()`` returned, and what each cancel
  (``Client.cancel_workflow()``) answered and when;
- the faults the harness injected (kind, target, time);
- the routed requests (``Client.request`` with a ``task_id``, asked again with it after an
  error, as a caller would): what each was expected to answer and what its caller got.

and returns a :class:`Report` whose :meth:`Report.table` is the table each run prints.
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from .explained import (
    AGENT_FAULTS,
    CALLER,
    FINAL,
    SLACK,
    UNSTORED_ERRORS,
    WOKE,
    _around_frozen,
    _cut_off_until,
    _explained,
    _first_result_lost,
    _status_delayed,
    caller_side,
)
from .policies import check_policy, result_matches

#: The error code of a workflow stopped by a cancel.
CANCELLED = "REACH_WORKFLOW_CANCELLED"
#: Slack (s) for the cancel checks: every process runs on this host's clock.
CANCEL_SLACK = 0.3


@dataclass(frozen=True)
class Expected:
    kind: str
    state: str
    #: Compared only when ``state`` is SUCCEEDED.
    result: Any = None
    #: A caller cancels it while it runs: FAILED with ``REACH_WORKFLOW_CANCELLED`` is right
    #: too (the cancel came first), and so is ``state`` (the workflow ended first).
    cancellable: bool = False
    #: The fanout's completion policy; other than ``all`` (tests/chaos/policies.py), the
    #: result is checked step by step: ``values`` holds each step's value, were it needed.
    policy: str = "all"
    values: tuple[Any, ...] = ()


@dataclass(frozen=True)
class ExpectedRoute:
    """A routed request: the state (and, SUCCEEDED, the result) its answer must have."""

    state: str
    result: Any = None
    mode: str = "proxy"  # proxy or direct


@dataclass
class Run:
    """One handler execution as an agent logged it."""

    run_id: str
    workflow_id: str | None  # None: a routed request's
    step: int | None
    task_id: str
    attempt: int
    agent_id: str
    pid: int
    start: float
    end: float | None = None
    outcome: str | None = None


@dataclass(frozen=True)
class Fault:
    kind: str  # agent_kill, agent_stop, hub_kill, node_kill, deaf, ...
    target: str  # agent id, hub name or node name
    at: float  # wall time the fault started
    until: float | None = None  # when it ended (SIGCONT, restart), if known
    #: A partition's: the client connections of the node it cut off (agent ids among them).
    cut_off: tuple[str, ...] = ()


@dataclass(frozen=True)
class Outcome:
    """A final answer as one reader saw it (``None`` state: the reader got nothing)."""

    state: str
    result: Any = None
    steps: tuple[str, ...] = ()
    #: The result's error code, if any.
    error: str | None = None

    def key(self) -> str:
        return json.dumps([self.state, self.result, list(self.steps), self.error], sort_keys=True)

    @classmethod
    def of(cls, result: Mapping[str, Any]) -> Outcome:
        """From a ``WorkflowResult`` in its JSON form."""
        steps = tuple(str(s.get("state")) for s in result.get("steps") or ())
        error = result.get("error")
        code = error.get("code") if isinstance(error, dict) else None
        return cls(str(result.get("state")), result.get("result"), steps, code)


@dataclass
class History:
    expected: dict[str, Expected] = field(default_factory=dict)
    runs: list[Run] = field(default_factory=list)
    #: workflow id -> the stored ``WorkflowRecord`` (JSON form); absent: no record.
    records: dict[str, dict[str, Any]] = field(default_factory=dict)
    #: task id -> the stored ``TaskRecord`` (JSON form).
    tasks: dict[str, dict[str, Any]] = field(default_factory=dict)
    #: workflow id -> every ``.done`` message body (JSON form), in stream order.
    done: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    #: workflow id -> what ``Client.workflow()`` returned (JSON form), or an error string.
    callers: dict[str, dict[str, Any] | str] = field(default_factory=dict)
    #: workflow id -> the last answer of the cancel a caller sent (``CancelResult`` JSON form,
    #: plus ``"t"``: the wall time it came, and ``"asked"``: when the first was sent), or an
    #: error string.
    cancels: dict[str, dict[str, Any] | str] = field(default_factory=dict)
    faults: list[Fault] = field(default_factory=list)
    #: task id -> what its routed request must answer.
    route_expected: dict[str, ExpectedRoute] = field(default_factory=dict)
    #: task id -> its caller's last answer (``TaskResult`` fields: ``state``, ``result``,
    #: ``error`` code, ``agent_id``, ``attempt``), or the last error string when none came.
    routes: dict[str, dict[str, Any] | str] = field(default_factory=dict)
    #: (agent id, task id) -> when that agent gave up storing the task's final status, each
    #: time (its log's "final status of <task> not stored" line, a JetStream error in it:
    #: ``read_unstored``).
    unstored: dict[tuple[str, str], list[float]] = field(default_factory=dict)
    #: agent id -> when that agent's try to register again was refused, each time (its log's
    #: "no hub answered the registration of <id>" or "<id> did not register" line:
    #: ``read_unregistered``).
    unregistered: dict[str, list[float]] = field(default_factory=dict)
    #: The connection name of the run's observer (a secure run's hub-identity connection:
    #: ``OBSERVER``), or None (the caller's connection observes). ``CALLER`` in secure runs
    #: from before ``OBSERVER``: a partition's ``cut_off`` naming ``CALLER`` may mean the
    #: observer alone, and the routes tell (``caller_side``).
    observer: str | None = None


@dataclass
class Violation:
    kind: str
    workflow_id: str
    detail: str


@dataclass
class Report:
    workflows: int = 0
    finished: int = 0
    lost: int = 0
    stuck: int = 0
    wrong_outcome: int = 0
    two_results: int = 0
    step_record_mismatch: int = 0
    runs: int = 0
    dup_agent_crash: int = 0
    dup_hub_crash: int = 0
    #: A route's task id ran again on another agent around a frozen NATS server (its pins
    #: window): counted apart, allowed (``FROZEN_NODE_FAULTS``).
    dup_route_frozen: int = 0
    dup_unexplained: int = 0
    first_result_lost: int = 0
    #: A cancel whose final answer is not the stored outcome (it said cancelled and the
    #: workflow was not, or the other way round, or another result).
    cancel_untrue: int = 0
    #: A handler of a cancelled workflow started after the cancel's final answer.
    ran_after_cancel: int = 0
    #: A step whose handler had ended with a result before its cancel was sent, cancelled by
    #: a decision taken while a partition still cut its agent off (``_cut_off_until``):
    #: nobody that could decide had that result (informative).
    cancelled_cut_off: int = 0
    cancels: int = 0
    #: Fanouts with a policy that decides early (``any``, ``quorum(k)``), and their steps
    #: stopped as unneeded (informative).
    policy_fanouts: int = 0
    stopped_unneeded: int = 0
    #: A step stopped as unneeded reported as a failure (or its error the workflow's), or a
    #: step of a decided result neither ended nor stopped.
    unneeded_as_failure: int = 0
    #: A step that ended with a result before the policy decided, stopped as unneeded.
    needed_not_kept: int = 0
    #: Steps stopped as unneeded that had ended with a result before the policy decided,
    #: their status held up by a fault (informative: ``STATUS_FAULTS``).
    stopped_delayed: int = 0
    #: Handlers of steps stopped as unneeded started after the result was stored
    #: (informative: that fence is best effort).
    unneeded_late_starts: int = 0
    caller_errors: int = 0
    routes: int = 0
    #: A routed request its caller never had an answer for (asked again until the drain).
    route_lost: int = 0
    #: An answer that is not the handler's (another state or result).
    route_wrong: int = 0
    violations: list[Violation] = field(default_factory=list)

    @property
    def dup_explained(self) -> int:
        return self.dup_agent_crash + self.dup_hub_crash

    @property
    def ok(self) -> bool:
        """The issue's targets: nothing lost, stuck, wrong, doubly answered or re-run
        without a crash to explain it."""
        return not (
            self.lost
            or self.stuck
            or self.wrong_outcome
            or self.first_result_lost
            or self.unneeded_as_failure
            or self.needed_not_kept
            or self.two_results
            or self.dup_unexplained
            or self.cancel_untrue
            or self.ran_after_cancel
            or self.route_lost
            or self.route_wrong
        )

    def add(self, kind: str, wf: str, detail: str) -> None:
        self.violations.append(Violation(kind, wf, detail))

    def row(self) -> dict[str, int]:
        return {
            "workflows": self.workflows,
            "lost": self.lost,
            "stuck": self.stuck,
            "wrong outcome": self.wrong_outcome,
            "two final results": self.two_results,
            "dup runs explained (agent crash)": self.dup_agent_crash,
            "dup runs explained (hub crash)": self.dup_hub_crash,
            "route dup runs around a frozen node": self.dup_route_frozen,
            "dup runs NOT explained": self.dup_unexplained,
            "first result not kept": self.first_result_lost,
            "cancelled (answered final)": self.cancels,
            "cancel answer untrue": self.cancel_untrue,
            "ran after its cancel": self.ran_after_cancel,
            "finished step cancelled while cut off": self.cancelled_cut_off,
            "step record != result": self.step_record_mismatch,
            "policy fanouts (any, quorum)": self.policy_fanouts,
            "steps stopped as unneeded": self.stopped_unneeded,
            "unneeded step as failure": self.unneeded_as_failure,
            "needed result not kept": self.needed_not_kept,
            "ended before a fault-held decision": self.stopped_delayed,
            "unneeded step started late": self.unneeded_late_starts,
            "handler runs": self.runs,
            "caller errors": self.caller_errors,
            "routes": self.routes,
            "routes lost": self.route_lost,
            "routes wrong outcome": self.route_wrong,
        }

    def table(self, title: str = "chaos run", examples: int = 5) -> str:
        row = self.row()
        width = max(len(k) for k in row)
        lines = [f"== {title} ==" + ("" if self.ok else "  (INVARIANTS VIOLATED)")]
        lines += [f"  {k:<{width}}  {v:>7}" for k, v in row.items()]
        by_kind: dict[str, list[Violation]] = defaultdict(list)
        for v in self.violations:
            by_kind[v.kind].append(v)
        for kind, vs in sorted(by_kind.items()):
            lines.append(f"  {kind}: {len(vs)}, e.g.")
            lines += [f"    {v.workflow_id}: {v.detail}" for v in vs[:examples]]
        return "\n".join(lines)


def _caller_outcome(value: dict[str, Any] | str | None) -> Outcome | None:
    return Outcome.of(value) if isinstance(value, dict) else None


def _record_outcome(record: Mapping[str, Any] | None) -> Outcome | None:
    if record is None or record.get("state") not in FINAL:
        return None
    result = record.get("result")
    if not isinstance(result, dict):
        return Outcome(str(record["state"]))  # final without a result: a reader sees this
    out = Outcome.of(result)
    if out.state != record["state"]:
        return Outcome(f"{record['state']}/{out.state}", out.result, out.steps)
    return out


def _matches(expected: Expected, got: Outcome) -> bool:
    if got.error == CANCELLED:
        return expected.cancellable and got.state == "FAILED"
    if expected.policy != "all":
        return result_matches(expected, got.state, got.result, got.steps)
    if got.state != expected.state:
        return False
    return expected.state != "SUCCEEDED" or got.result == expected.result


def check(h: History) -> Report:
    rep = Report(workflows=len(h.expected), runs=len(h.runs))
    faults = h.faults if h.observer != CALLER else caller_side(h.faults, h.runs)
    runs_by_task: dict[str, list[Run]] = defaultdict(list)
    #: task id -> its StepResult in the stored workflow result (the one source of truth).
    steps: dict[str, Mapping[str, Any]] = {}
    runs_by_wf: dict[str, list[Run]] = defaultdict(list)
    for run in h.runs:
        runs_by_task[run.task_id].append(run)
        if run.workflow_id is not None:
            runs_by_wf[run.workflow_id].append(run)

    for wf, exp in sorted(h.expected.items()):
        record = h.records.get(wf)
        stored = _record_outcome(record)
        dones = [Outcome.of(d) for d in h.done.get(wf, ())]
        caller_raw = h.callers.get(wf)
        caller = _caller_outcome(caller_raw)
        if isinstance(caller_raw, str):
            rep.caller_errors += 1
        readers: dict[str, Outcome] = {}
        if stored is not None:
            readers["record"] = stored
        for i, d in enumerate(dones):
            readers[f"done#{i}"] = d
        if caller is not None:
            readers["caller"] = caller

        if record is None and not dones:
            rep.lost += 1
            rep.add("lost", wf, f"no record, no .done; caller: {caller_raw!r:.120}")
            continue
        final = stored or (dones[0] if dones else None)
        if final is None:
            rep.stuck += 1
            state = None if record is None else record.get("state")
            rep.add("stuck", wf, f"stored state {state}, no .done; caller: {caller_raw!r:.120}")
            continue
        rep.finished += 1
        has_cancel = (record or {}).get("cancel") is not None
        if stored is not None and has_cancel != (stored.error == CANCELLED):
            rep.cancel_untrue += 1
            rep.add(
                "cancel answer untrue",
                wf,
                f"the final record's cancel is {(record or {}).get('cancel')}, "
                f"its result's error {stored.error}",
            )
        if stored is None:
            readers["record"] = Outcome(str((record or {}).get("state")))
        distinct = {o.key(): name for name, o in readers.items()}
        if len(distinct) > 1:
            rep.two_results += 1
            rep.add(
                "two final results",
                wf,
                "; ".join(f"{name}={readers[name].state}" for name in distinct.values()),
            )
        if not _matches(exp, final):
            rep.wrong_outcome += 1
            rep.add(
                "wrong outcome",
                wf,
                f"expected {exp.state} {json.dumps(exp.result)[:80]}, "
                f"got {final.state} {json.dumps(final.result)[:80]}",
            )
        result = (record or {}).get("result") or {}
        if exp.policy != "all":
            _check_policy(rep, wf, result, runs_by_wf.get(wf, []), faults)
        for step in result.get("steps") or ():
            steps[str(step.get("task_id"))] = step
            task = h.tasks.get(str(step.get("task_id")))
            if task is None or step.get("cancelled"):
                continue
            # A step decided by its current attempt keeps its record as it was (the hub writes
            # a task record only when the fence must change): then the record's attempt must
            # be the deciding one, and unfenced — a record fenced since (``cancelled``) says
            # the step was stopped, not decided (chaos secure seed 177, ``node_stop``,
            # chaos-177-00596: a hub that had lost the workflow stopped the step that decided
            # it). Otherwise the record holds the outcome.
            kept = (
                task.get("state") not in FINAL
                and task.get("attempt") == step.get("decided_by")
                and not task.get("cancelled")
            )
            if not kept and task.get("state") != step.get("state"):
                rep.step_record_mismatch += 1
                fenced = ", cancelled" if task.get("cancelled") else ""
                rep.add(
                    "step record != result",
                    wf,
                    f"step {step.get('index')}: result says {step.get('state')}, "
                    f"task record {task.get('state')} (attempt {task.get('attempt')}{fenced})",
                )

    for wf, answer in sorted(h.cancels.items()):
        _check_cancel(rep, wf, answer, h, runs_by_wf.get(wf, []))

    _check_routes(rep, h)

    for task_id, runs in runs_by_task.items():
        task = h.tasks.get(task_id)
        step = steps.get(task_id)
        lost = (
            None if step is None else _first_result_lost(step, task or {}, runs, faults, h.unstored)
        )
        if lost is not None:
            rep.first_result_lost += 1
            rep.add("first result not kept", runs[0].workflow_id or task_id, lost)
        runs.sort(key=lambda r: r.start)
        flakes = [r for r in runs if r.outcome == "flaky"]  # each planned one more run
        for i, dup in enumerate(runs[1:], start=1):
            planned = next((f for f in flakes if f.attempt < dup.attempt), None)
            if planned is not None:
                flakes.remove(planned)
                continue
            if dup.workflow_id is None and any(
                r.outcome == "cancelled" and r.agent_id == dup.agent_id and r.attempt < dup.attempt
                for r in runs[:i]
            ):
                # A route that timed out on its agent (its handler cancelled at the deadline:
                # a decision that came late left it little time), asked again by its caller
                # as the next attempt there: run again by design (docs/reliability.md).
                continue
            why = _explained(dup, runs[:i], faults, h.unstored, h.unregistered)
            if why == "agent":
                rep.dup_agent_crash += 1
            elif why == "hub":
                rep.dup_hub_crash += 1
            elif dup.workflow_id is None and _around_frozen(runs[i - 1], dup, faults):
                rep.dup_route_frozen += 1
            else:
                rep.dup_unexplained += 1
                prev = runs[i - 1]
                codes = {a.get("attempt"): a.get("code") for a in (task or {}).get("history", ())}
                rep.add(
                    "dup run not explained",
                    dup.workflow_id or task_id,  # (a route's: none)
                    f"{task_id} ran on {prev.agent_id}#{prev.attempt} at {prev.start:.3f} "
                    f"({prev.outcome}) and again on {dup.agent_id}#{dup.attempt} "
                    f"at {dup.start:.3f} ({dup.outcome}); record code of "
                    f"#{prev.attempt}: {codes.get(prev.attempt)}",
                )
    return rep


def _check_policy(
    rep: Report, wf: str, result: Mapping[str, Any], runs: list[Run], faults: list[Fault]
) -> None:
    """A fanout whose policy decides early (tests/chaos/policies.py)."""
    rep.policy_fanouts += 1
    got = check_policy(result, runs, lambda run, until: _status_delayed(run, until, faults))
    rep.stopped_unneeded += got.stopped
    rep.stopped_delayed += got.delayed
    rep.unneeded_late_starts += got.late_starts
    for column, detail in got.problems:
        if column == "needed":
            rep.needed_not_kept += 1
            rep.add("needed result not kept", wf, detail)
        else:
            rep.unneeded_as_failure += 1
            rep.add("unneeded step as failure", wf, detail)


def _check_routes(rep: Report, h: History) -> None:
    """Every routed request was answered (its caller asks again with its task id after an
    error), with what the handler returns. A second handler run of a route's task id is checked
    with the steps' (``check``): only a fault explains it (docs/reliability.md: a retry goes
    to the agent the first try went to, whose idempotency table answers)."""
    for task_id, exp in sorted(h.route_expected.items()):
        rep.routes += 1
        got = h.routes.get(task_id)
        if not isinstance(got, dict):
            rep.route_lost += 1
            rep.add("route lost", task_id, f"{exp.mode}: no answer; last error {got!r:.120}")
            continue
        if got.get("state") != exp.state or (
            exp.state == "SUCCEEDED" and got.get("result") != exp.result
        ):
            rep.route_wrong += 1
            rep.add(
                "route wrong outcome",
                task_id,
                f"{exp.mode}: expected {exp.state} {json.dumps(exp.result)[:60]}, got "
                f"{got.get('state')} {json.dumps(got.get('result'))[:60]} ({got.get('error')})",
            )


def _check_cancel(
    rep: Report, wf: str, answer: dict[str, Any] | str, h: History, runs: list[Run]
) -> None:
    """A cancel's final answer must be the stored outcome; no handler of a step the cancel
    stopped may start after that answer (the fence), except on an agent that had passed the
    fence before it was paused (``WOKE``); and a step whose handler had ended with a result
    before the cancel was even sent must keep it (no valid result thrown away) — unless its
    agent was killed or paused right then, or a partition cut it off from the run's end until
    the step was decided (``_cut_off_until``: counted apart)."""
    if isinstance(answer, str) or not answer.get("final"):
        return  # never answered final: nothing was promised
    stored = _record_outcome(h.records.get(wf))
    said = answer.get("result")
    if stored is None or not isinstance(said, dict):
        rep.cancel_untrue += 1
        rep.add("cancel answer untrue", wf, f"answered final, stored {stored}")
        return
    cancelled = stored.error == CANCELLED
    if bool(answer.get("cancelled")) != cancelled or Outcome.of(said).key() != stored.key():
        rep.cancel_untrue += 1
        rep.add(
            "cancel answer untrue",
            wf,
            f"answered cancelled={answer.get('cancelled')} {Outcome.of(said).state}, "
            f"stored {stored.state} ({stored.error})",
        )
        return
    if not cancelled:
        return
    rep.cancels += 1
    at = float(answer.get("t") or 0.0)
    asked = float(answer.get("asked") or at)
    result = (h.records.get(wf) or {}).get("result") or {}
    stopped = {str(s.get("task_id")) for s in result.get("steps") or () if s.get("cancelled")}
    finished_at = result.get("finished_at")
    for run in runs:
        if run.task_id not in stopped:
            continue
        if run.start > at + CANCEL_SLACK and not any(
            f.kind == "agent_stop"
            and f.target == run.agent_id
            and f.until is not None
            and f.until <= run.start <= f.until + WOKE
            for f in h.faults
        ):
            rep.ran_after_cancel += 1
            rep.add(
                "ran after its cancel",
                wf,
                f"{run.task_id} started on {run.agent_id}#{run.attempt} at {run.start:.3f}, "
                f"the cancel answered final at {at:.3f}",
            )
        ended = run.end or run.start
        if (
            run.outcome in ("ok", "failed")
            and ended < asked - CANCEL_SLACK
            and not any(
                f.kind in AGENT_FAULTS
                and f.target == run.agent_id
                and run.start - SLACK <= f.at <= ended + SLACK
                for f in h.faults
            )
        ):
            # When the step was decided at the latest: its record's last write (its fence, or
            # a later one's), and the final record's (written after every fence).
            decided = [
                float(t)
                for t in (finished_at, (h.tasks.get(run.task_id) or {}).get("updated_at"))
                if isinstance(t, (int, float))
            ]
            if decided and _cut_off_until(run, min(decided), h.faults):
                rep.cancelled_cut_off += 1
                continue
            rep.first_result_lost += 1
            rep.add(
                "finished step cancelled",
                wf,
                f"{run.task_id} ended {run.outcome} on {run.agent_id}#{run.attempt} at "
                f"{ended:.3f}, the cancel was sent at {asked:.3f}, the step says cancelled",
            )


# --------------------------------------------------------------------------- reading files


def read_runs(paths: Iterable[Path]) -> list[Run]:
    """Agent logs: a ``start`` line per handler execution and an ``end`` line when it ended
    (missing when the process died). A torn last line (SIGKILL mid-write) is skipped."""
    runs: dict[str, Run] = {}
    for path in paths:
        for line in path.read_text().splitlines():
            try:
                ev = json.loads(line)
            except ValueError:
                continue
            if ev.get("ev") == "start":
                runs[ev["run"]] = Run(
                    run_id=ev["run"],
                    workflow_id=ev["wf"],
                    step=ev["step"],
                    task_id=ev["task"],
                    attempt=ev["attempt"],
                    agent_id=ev["agent"],
                    pid=ev["pid"],
                    start=ev["t"],
                )
            elif ev.get("ev") == "end" and ev.get("run") in runs:
                run = runs[ev["run"]]
                run.end, run.outcome = ev["t"], ev["outcome"]
    return list(runs.values())


#: An agent's line when it gave up storing a step's final status (reach_mesh/agent/_held.py):
#: the error's class, then what the server said.
_UNSTORED = re.compile(r"final status of (\S+) not stored: (\w+)\((.*)")
#: JetStream's 10158 (nats-py raises a bare ``APIError``): a try with the same ``Nats-Msg-Id``
#: was proposed and not committed — on a leader cut off from its quorum, not stored.
_IN_PROCESS = "duplicate message id is in process"


def read_unstored(paths: Iterable[Path]) -> dict[tuple[str, str], list[float]]:
    """Agents' process logs (``<agent id>.log``, JSON lines): when each gave up storing a
    task's final status for a JetStream error (``UNSTORED_ERRORS``), by (agent id, task id)."""
    out: dict[tuple[str, str], list[float]] = defaultdict(list)
    for agent_id, msg, t in _log_lines(paths):
        m = _UNSTORED.match(msg)
        if m is not None and (m.group(2) in UNSTORED_ERRORS or _IN_PROCESS in m.group(3)):
            out[(agent_id, m.group(1))].append(t)
    return dict(out)


_UNREGISTERED = re.compile(r"no hub answered the registration of (\S+) |(\S+) did not register:")


def read_unregistered(paths: Iterable[Path]) -> dict[str, list[float]]:
    """Agents' process logs (``<agent id>.log``): when each logged a refused try to register
    (again), by agent id."""
    out: dict[str, list[float]] = defaultdict(list)
    for agent_id, msg, t in _log_lines(paths):
        m = _UNREGISTERED.match(msg)
        if m is not None and (m.group(1) or m.group(2)) == agent_id:
            out[agent_id].append(t)
    return dict(out)


def _log_lines(paths: Iterable[Path]) -> Iterator[tuple[str, str, float]]:
    """Agents' process logs (``<agent id>.log``, JSON lines): (agent id, message, time) of
    every line with a timestamp; missing files and torn lines skipped."""
    for path in paths:
        if not path.exists():
            continue
        agent_id = path.name.removesuffix(".log")
        for line in path.read_text().splitlines():
            try:
                ev = json.loads(line)
            except ValueError:
                continue
            if ev.get("ts"):
                t = datetime.fromisoformat(str(ev["ts"]).replace("Z", "+00:00")).timestamp()
                yield agent_id, str(ev.get("msg", "")), t


def read_faults(path: Path) -> list[Fault]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        ev = json.loads(line)
        cut_off = tuple(ev.get("cut_off") or ())
        out.append(Fault(ev["kind"], ev["target"], ev["at"], ev.get("until"), cut_off))
    return out


def load(run_dir: Path) -> History:
    """The history a chaos run left in its directory (``history.json``, the agent logs,
    ``faults.jsonl``), to check it again: ``python -m tests.chaos.history chaos-out/node_kill``."""
    data = json.loads((run_dir / "history.json").read_text())
    agent_logs = [p for p in run_dir.glob("*.jsonl") if p.name != "faults.jsonl"]
    return History(
        expected={
            k: Expected(**{**v, "values": tuple(v.get("values") or ())})
            for k, v in data["expected"].items()
        },
        runs=read_runs(agent_logs),
        records=data["records"],
        tasks=data["tasks"],
        done=data["done"],
        callers=data["callers"],
        cancels=data.get("cancels", {}),
        faults=read_faults(run_dir / "faults.jsonl"),
        route_expected={k: ExpectedRoute(**v) for k, v in data.get("route_expected", {}).items()},
        routes=data.get("routes", {}),
        unstored=read_unstored(p.with_suffix(".log") for p in agent_logs),
        unregistered=read_unregistered(p.with_suffix(".log") for p in agent_logs),
        # Secure runs from before the observer had a name of its own gave it the caller's.
        observer=data.get("observer", CALLER if data.get("config", {}).get("secure") else None),
    )


if __name__ == "__main__":
    import sys

    for arg in sys.argv[1:]:
        print(check(load(Path(arg))).table(arg, examples=10))
