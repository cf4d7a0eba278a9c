"""Fanouts whose completion policy decides before every step finished (``any``,
``quorum(k)``) in the chaos suite: what the workload plans for them (:func:`expected_state`)
and what the checker holds them to (:func:`result_matches`, :func:`check_policy`;
docs/reliability.md).

The hub stops the steps such a fanout no longer needs once its policy is met or out of reach
(``_fanout`` in ``reach_mesh/hub/_shapes.py``): their records are marked ``cancelled`` and
their running handlers are told to stop. The promises checked here:

- the outcome follows the policy from the steps' real outcomes: SUCCEEDED iff ``k`` steps
  succeeded (their results in the result list, ``None`` for every other step); otherwise
  TIMEOUT iff every step that failed timed out, else FAILED;
- a step stopped as unneeded is reported so (``cancelled``, not FAILED/TIMEOUT, with every
  attempt that was sent: a run of a later attempt than it reports was never fenced) and never
  counted as a failure: the workflow's error is a real failure's;
- no needed result is thrown away: a step that succeeded (or failed for good) before the
  policy decided is not stopped as unneeded;
- a step stopped as unneeded starts no handler after the result was stored (informative: the
  fence of an unneeded branch is best effort, docs/workflows.md).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from reach_mesh.errors import WorkflowSpecError
from reach_mesh.workflow import parse_policy

if TYPE_CHECKING:
    from .history import Expected, Run

#: The policies the workload gives a share of its fanouts (beside the default ``all``).
POLICIES = ("any", "quorum(2)")
#: Planned step modes that end SUCCEEDED (``flaky`` after its one planned retry).
SUCCESS_MODES = frozenset({"ok", "flaky"})
#: Modes that end TIMEOUT (slower than the step's timeout).
TIMEOUT_MODES = frozenset({"slow", "stubborn"})
#: A step that ended with a result this long (s) before the policy decided was needed: it
#: must not be stopped as unneeded (its status had reached the hub long before).
DECIDE_SLACK = 0.3
#: Slack (s) after the result was stored before an unneeded step's start counts as late.
LATE_SLACK = 0.3

FINAL = frozenset({"SUCCEEDED", "FAILED", "TIMEOUT"})


def need(policy: str, branches: int) -> int:
    """How many successes complete a fanout of ``branches`` steps under ``policy``."""
    return parse_policy(policy, branches)


def expected_state(policy: str, modes: Sequence[str]) -> str:
    """The outcome a fanout of steps planned as ``modes`` must end with under ``policy``:
    SUCCEEDED when enough of them succeed, else TIMEOUT when every step that does not succeed
    times out, else FAILED. (The workload plans the failures of a fanout that cannot succeed
    all of one kind, so which failure the policy meets first does not matter.)"""
    succeeding = sum(m in SUCCESS_MODES for m in modes)
    if succeeding >= need(policy, len(modes)):
        return "SUCCEEDED"
    failing = [m for m in modes if m not in SUCCESS_MODES]
    return "TIMEOUT" if all(m in TIMEOUT_MODES for m in failing) else "FAILED"


def result_matches(exp: Expected, state: str, result: Any, steps: Sequence[str]) -> bool:
    """A policy fanout's final state and result (not a cancel's): the planned state; when
    SUCCEEDED, at least ``k`` steps SUCCEEDED, each with its planned value in the result list
    and ``None`` for every other step."""
    if state != exp.state:
        return False
    if state != "SUCCEEDED":
        return True
    values = list(exp.values)
    if not isinstance(result, list) or len(result) != len(values) or len(steps) != len(values):
        return False
    if sum(s == "SUCCEEDED" for s in steps) < need(exp.policy, len(values)):
        return False
    return all(
        got == (values[i] if steps[i] == "SUCCEEDED" else None) for i, got in enumerate(result)
    )


@dataclass
class PolicyCheck:
    """What :func:`check_policy` found in one policy fanout."""

    #: Steps stopped as unneeded (``cancelled`` in a result the policy decided).
    stopped: int = 0
    #: Handlers of such steps started after the result was stored (informative).
    late_starts: int = 0
    #: Steps stopped as unneeded whose handler had ended with a result before the policy
    #: decided, a fault explaining why the hub had not heard it yet (informative).
    delayed: int = 0
    #: (column, detail) per violation: ``unneeded`` (a step stopped as unneeded counted as
    #: a failure or reported with fewer attempts than ran, or a step left neither finished
    #: nor stopped) or ``needed`` (a needed result thrown away).
    problems: list[tuple[str, str]] = field(default_factory=list)


def check_policy(
    result: Mapping[str, Any],
    runs: Sequence[Run],
    explained: Callable[[Run, float], bool],
) -> PolicyCheck:
    """The stored result of one policy fanout against its handlers' runs (``runs``: every run
    of its steps). ``explained(run, decided_at)``: a fault may have kept that run's outcome
    from the hub until the policy had decided (its agent killed, paused or cut off around it;
    a NATS server, a hub or a connection lost meanwhile: its status published again, or read
    back, after others' — which successes a policy keeps is then the order they reached the
    hub in). A fanout stopped by its caller's cancel is left to the cancel checks (only its
    steps' states are checked here)."""
    out = PolicyCheck()
    steps = list(result.get("steps") or ())
    by_step: dict[int, list[Run]] = {}
    for run in runs:
        if run.step is not None:
            by_step.setdefault(run.step, []).append(run)
    error = result.get("error")
    cancelled_by_caller = isinstance(error, dict) and error.get("code") == _CANCELLED
    for s in steps:
        if s.get("cancelled") and s.get("state") in ("FAILED", "TIMEOUT"):
            out.problems.append(
                ("unneeded", f"step {s.get('index')} stopped as unneeded says {s.get('state')}")
            )
        elif s.get("cancelled") and any(
            r.attempt > int(s.get("attempts") or 0) for r in by_step.get(int(s["index"]), ())
        ):
            # Reported stopped before any attempt was sent (or fewer than ran): an attempt out
            # that nobody fenced — the step's record read as missing (a replica behind).
            ran = max(r.attempt for r in by_step[int(s["index"])])
            out.problems.append(
                (
                    "unneeded",
                    f"step {s['index']} stopped as unneeded after {s.get('attempts') or 0} "
                    f"attempts, but attempt {ran} ran",
                )
            )
        elif not s.get("cancelled") and s.get("state") not in FINAL:
            out.problems.append(
                ("unneeded", f"step {s.get('index')} {s.get('state')}: neither ended nor stopped")
            )
    if cancelled_by_caller:
        return out
    decided = [s for s in steps if not s.get("cancelled") and s.get("state") in FINAL]
    if result.get("state") != "SUCCEEDED":
        # The error is one of a step that really failed, never of a stopped one.
        real = [s.get("error") for s in decided if s.get("state") != "SUCCEEDED"]
        if error not in real:
            out.problems.append(
                ("unneeded", f"{result.get('state')} with error {error!r:.100}, not a step's")
            )
    # When the policy decided: the outcome that met it (the ``k``-th success of a SUCCEEDED
    # result) or put it out of reach (the failure that left fewer than ``k`` steps able to
    # succeed), as the hub applied it (the step's ``finished_at``), else its handler's end (a
    # ``late`` handler — one that ignored its cancellation — ends long after its TIMEOUT
    # decided). Not the last of every decided step: a branch that ran on to its outcome
    # through its stop (a swallowed cancellation) is kept, and may end long after the
    # decision (chaos secure seed 184, ``node_stop``, chaos-184-00972: an ``any`` fanout met
    # by step 0 at 620.04; step 2 ran on to 643.0, and step 1's failure at 642.1 was taken
    # for one ended before the decision).
    ends: list[tuple[float, bool]] = []  # (end, succeeded)
    for s in decided:
        ok = s.get("state") == "SUCCEEDED"
        # The earlier of the two: a run that took the workflow over applies an outcome
        # stored long before (``finished_at`` is when it did), and another run may have
        # decided on it then (chaos secure seed 184, ``partition``: chaos-184-00716's kept
        # success ended at 077.88, applied by the last owner at 079.84). A ``late`` handler's
        # end is after its TIMEOUT, as ``finished_at`` is: the earlier is the closer. (A
        # handler's end precedes its outcome's store: an outcome stored late, after another
        # step's that ended later, is not told apart here.)
        deciding = [
            r.end
            for r in by_step.get(int(s.get("index", -1)), ())
            if r.attempt == s.get("decided_by")
            and r.end is not None
            and r.outcome in ("ok", "failed", "cancelled", "late")
        ]
        applied = [float(s["finished_at"])] if s.get("finished_at") is not None else []
        if deciding or applied:
            ends.append((min(applied + deciding), ok))
    decided_at = _decided_at(result, len(steps), ends)
    finished_at = result.get("finished_at")
    for s in steps:
        if not s.get("cancelled"):
            continue
        out.stopped += 1
        mine = sorted(by_step.get(int(s.get("index", -1)), ()), key=lambda r: r.start)
        if finished_at is not None:
            out.late_starts += sum(r.start > float(finished_at) + LATE_SLACK for r in mine)
        if decided_at is None:
            continue
        for r in mine:
            if (
                r.outcome in ("ok", "failed")
                and r.end is not None
                and r.end < decided_at - DECIDE_SLACK
            ):
                if explained(r, decided_at):
                    out.delayed += 1
                    break
                out.problems.append(
                    (
                        "needed",
                        f"{r.task_id}: {r.agent_id}#{r.attempt} ended {r.outcome} at "
                        f"{r.end:.3f}, the policy decided at {decided_at:.3f} and the step "
                        f"says stopped as unneeded ({s.get('state')})",
                    )
                )
                break
    return out


def _decided_at(
    result: Mapping[str, Any], branches: int, ends: Sequence[tuple[float, bool]]
) -> float | None:
    """When a policy fanout's policy was met or put out of reach, from its decided steps'
    ``(end, succeeded)``: the ``k``-th success of a SUCCEEDED result, else the failure that
    left fewer than ``k`` steps able to succeed; the last end when they do not say (steps
    stopped by an earlier owner count as failures there, and are not among ``ends``)."""
    try:
        k = need(str(result.get("policy")), branches)
    except WorkflowSpecError:
        k = None
    wins = sorted(end for end, ok in ends if ok)
    losses = sorted(end for end, ok in ends if not ok)
    if k is not None and result.get("state") == "SUCCEEDED" and len(wins) >= k >= 1:
        return wins[k - 1]
    if k is not None and result.get("state") != "SUCCEEDED" and len(losses) > branches - k >= 0:
        return losses[branches - k]
    return max((end for end, _ in ends), default=None)


_CANCELLED = "REACH_WORKFLOW_CANCELLED"
