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
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from .policies import check_policy, result_matches

FINAL = frozenset({"SUCCEEDED", "FAILED", "TIMEOUT"})
#: Fault kinds that may explain a second run of a step: the agent that ran it died or was
#: paused past its lease (then the mesh may re-dispatch, by design: the at-least-once window).
#: Not ``deaf``: a deaf agent never takes the attempts sent to it (they are given up and run
#: elsewhere, once), the handlers it had started finish and their statuses get through (they
#: are publishes), and its restart (SIGTERM) waits for them — so it explains nothing.
#: (A blip's target is a hub, an agent or the caller: as an agent fault it explains only the
#: runs of the agent it cut off, which the hubs may have taken for gone and run elsewhere.)
AGENT_FAULTS = frozenset({"agent_kill", "agent_stop", "blip"})
HUB_FAULTS = frozenset({"hub_kill"})
#: A NATS server frozen (SIGSTOP) holds, then loses or delivers late, what it was sent: a
#: route's retry may then reach a hub that never had the pins message of its first try (it
#: was held by, or sent to a hub connected to, the frozen server), and is routed as new — the
#: documented window of the pins (docs/reliability.md). Explains a route's second run only
#: (a workflow step's attempt is fenced by its record, not by pins).
FROZEN_NODE_FAULTS = frozenset({"node_stop"})
#: A NATS server cut off from the others (``partition``: its routes cut, it and its clients up)
#: cuts its agents off from the hubs of the other side: they may be declared LOST meanwhile and
#: their work run elsewhere — as for an agent paused past its lease. It explains a second run
#: of a task whose earlier run was on an agent it cut off (``Fault.cut_off``), that run begun
#: from ``PRIOR`` s before the cut to its end: a step's whenever it comes (its attempt was given
#: up for good while the agent was cut off; the owner sends the next once it can, after
#: elections and takeovers), a route's only until ``HEAL`` s after the heal (a retry later than
#: that should reach the agent that has the task again: the hubs' pins) — or, its answer lost
#: in that cut, while a later partition begun before its caller asked again cut that agent off
#: again (``_cut_off_again``); and a first result of such an agent not kept.
CUT_OFF_FAULTS = frozenset({"partition"})
#: Faults that may hold a final status up on its way to the hub (published again after an
#: election or a reconnection, read back after a gap or a takeover): the order outcomes reach
#: the hub in may then differ from the order the handlers ended in — which successes an
#: ``any``/``quorum`` fanout keeps (tests/chaos/policies.py).
STATUS_FAULTS = frozenset({"node_kill", "node_stop", "partition", "blip", "hub_kill", "hub_stop"})
#: How long (s) after such a fault ends its elections may still hold writes up (a restarted
#: or healed server catching up; docs/reliability.md: 4-10 s of ``NoStreamResponseError``).
ELECTIONS = 10.0
#: How long (s) after a partition heals an agent it cut off may still be unroutable: declared
#: LOST during the cut, it is routable again once it has registered again (about a heartbeat
#: and a KV write after the heal; its lease + suspect grace at most, 2.5 s in the chaos runs).
HEAL = 3.0
#: How long (s) after a partition's relays are back (``Fault.until``) its routes may still be
#: down: a nats-server dials a lost route again once a second (its route reconnect interval),
#: so the two sides hear each other again within a second of the heal — secure seed 156:
#: 0.75 s and 0.80 s (the servers' "Route connection created").
REJOIN = 1.0
#: Slack (s) around a fault when deciding whether it explains a duplicate run.
SLACK = 1.0
#: How long (s) a chaos caller waits for a route's answer before it asks again with the same
#: task id (workload.py's ``route``; less only near the end of the run).
ROUTE_TIMEOUT = 10.0
#: The connection name of the chaos callers (``Client``'s default): a partition whose
#: ``cut_off`` has it cut a caller off too.
CALLER = "reach-client"
#: How long (s) before an earlier run an agent fault still explains a re-run: an attempt sent
#: to an agent that was killed is redelivered to its restarted process (after the kill, the
#: restart and the work ack wait) while the hub, having lost the old process, sends the next.
PRIOR = 5.0
#: A run whose handler's first line came this soon (s) after its own agent woke from a pause
#: was decided before the pause: the SDK had passed the fence and was starting the handler
#: when SIGSTOP landed (nothing can notice a pause in between). It is the at-least-once
#: window of an agent paused after its handler started, seen from the handler's first line.
WOKE = 0.05
#: How long (s) after its handler ended an agent may still be trying to store a step's final
#: status before it logs "final status of <task> not stored" and leaves the work message to be
#: delivered again (``_FINAL_RETRY``, 10 s, in reach_mesh/agent/_held.py, and its last try's
#: request timeout, ``REQUEST_TIMEOUT``, 3 s).
STORE_RETRY = 13.0
#: The errors of a final status's store that say JetStream did not take it (an election, a
#: stream without a leader, a connection lost): not an agent's refusal or a bad message.
UNSTORED_ERRORS = frozenset(
    {
        "TimeoutError",
        "NoStreamResponseError",
        "ServiceUnavailableError",
        "ServerError",
        "NoRespondersError",
        "ConnectionClosedError",
        "ConnectionReconnectingError",
        "StaleConnectionError",
    }
)
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


def _explained(
    dup: Run,
    earlier: list[Run],
    faults: list[Fault],
    unstored: Mapping[tuple[str, str], list[float]] | None = None,
) -> str | None:
    """Why a handler ran again for a step that already ran: an agent fault of an earlier run's
    agent from ``PRIOR`` s before that run's start to this one's (``agent``); or this run's
    own agent paused since before an earlier run started, this run's first line within
    ``WOKE`` s of its waking (``agent``: decided before the pause, see ``WOKE``); or a
    partition that cut an earlier run's agent off (a route's run within ``HEAL`` s of its
    end; ``agent``, see ``CUT_OFF_FAULTS``), or a route's run while a later one cut it off
    again before its caller could ask (``agent``, ``_cut_off_again``), or while it had yet to
    register again when its caller asked (``agent``, ``_unregistered_when_asked``), or a
    step's run whose final status JetStream had not taken when a partition cut its agent
    off, this run from that cut on (``agent``, ``_unstored_until_cut``); else a hub
    fault from
    ``SLACK`` s before (``hub``); else ``None``."""
    for f in faults:
        if (
            f.kind == "agent_stop"
            and f.target == dup.agent_id
            and f.until is not None
            and f.until <= dup.start <= f.until + WOKE
            and any(prev.attempt > dup.attempt and f.at <= prev.start for prev in earlier)
        ):
            return "agent"
    for prev in earlier:
        for f in faults:
            if (
                f.kind in CUT_OFF_FAULTS
                and prev.agent_id in f.cut_off
                and f.at - PRIOR <= prev.start <= (f.until or f.at) + SLACK
                and f.at <= dup.start
                and (dup.workflow_id is not None or dup.start <= (f.until or f.at) + HEAL)
            ):
                return "agent"
        if dup.workflow_id is None and (
            _cut_off_again(prev, dup, faults) or _unregistered_when_asked(prev, dup, faults)
        ):
            return "agent"
        if dup.workflow_id is not None:
            cut = _unstored_until_cut(prev, faults, unstored or {})
            if cut is not None and cut <= dup.start:
                return "agent"
    for kinds, tag, before in ((AGENT_FAULTS, "agent", PRIOR), (HUB_FAULTS, "hub", SLACK)):
        for prev in earlier:
            for f in faults:
                if f.kind not in kinds or (tag == "agent" and f.target != prev.agent_id):
                    continue
                if prev.start - before <= f.at <= dup.start + SLACK:
                    return tag
    return None


def _cut_off_again(prev: Run, dup: Run, faults: list[Fault]) -> bool:
    """Whether a route's second run came while the agent of its first run was out of its
    caller's reach for the whole time the caller could ask again: that run's answer lost in
    a partition that cut its agent off as it ran (from ``SLACK`` s before its end to as long
    after the heal), and its agent cut off again, away from the callers, by a partition
    begun before the caller's wait for that answer ran out (``ROUTE_TIMEOUT`` s after the run
    started, ``SLACK``), the second run from that cut to ``HEAL`` s after its heal: every
    retry found the holder out of reach — declared LOST by the hubs of the caller's side, not
    answering the seek across the cut (docs/reliability.md: the at-least-once window of a
    holder out of reach; secure seed 158). The reach the heal between gave back was spent
    while the caller still waited for the lost answer."""
    end = prev.end or prev.start
    answer_lost = any(
        f.kind in CUT_OFF_FAULTS
        and prev.agent_id in f.cut_off
        and f.at - SLACK <= end
        and prev.start <= (f.until or f.at) + SLACK
        for f in faults
    )
    return answer_lost and any(
        f.kind in CUT_OFF_FAULTS
        and prev.agent_id in f.cut_off
        and CALLER not in f.cut_off
        and prev.start < f.at <= prev.start + ROUTE_TIMEOUT + SLACK
        and f.at <= dup.start <= (f.until or f.at) + HEAL
        for f in faults
    )


def _unregistered_when_asked(prev: Run, dup: Run, faults: list[Fault]) -> bool:
    """Whether a route's second run was its caller's retry after its wait for the first run's
    answer ran out, while the agent of that run had yet to register again and was then cut
    off again: that answer lost in a partition that cut its caller or its agent off as the run
    ended (from ``SLACK`` s before its end to as long after the heal); that agent cut off,
    before the run, by a partition of at least ``HEAL`` s (long enough to be declared LOST)
    healed at most ``ELECTIONS`` s before the run started (its registration again a JetStream
    write, which the elections after the cuts may refuse for that long and more); the second
    run from ``SLACK`` s before the wait's end (``ROUTE_TIMEOUT`` s after the first run
    started) to ``SLACK`` s after it; and that agent cut off again, away from the callers, by a
    partition begun within half a ``ROUTE_TIMEOUT`` after the retry — a resend's longest wait
    for a LOST holder's registration (docs/protocol.md, "Resends"). The holder the retry
    named was registered at no hub (the ``Client`` sends it there by ``agent_id``: "no
    routable agent"; then by capability, as new), nor could it have registered in time to be
    waited for: the at-least-once window of a holder out of reach, its registration refused
    (open seed 160 ``partition``; docs/reliability.md)."""
    end = prev.end or prev.start
    answer_lost = any(
        f.kind in CUT_OFF_FAULTS
        and (prev.agent_id in f.cut_off or CALLER in f.cut_off)
        and f.at - SLACK <= end
        and prev.start <= (f.until or f.at) + SLACK
        for f in faults
    )
    was_lost = any(
        f.kind in CUT_OFF_FAULTS
        and prev.agent_id in f.cut_off
        and f.until is not None
        and f.until - f.at >= HEAL
        and prev.start - ELECTIONS <= f.until <= prev.start
        for f in faults
    )
    retried = abs(dup.start - (prev.start + ROUTE_TIMEOUT)) <= SLACK
    return (
        answer_lost
        and was_lost
        and retried
        and any(
            f.kind in CUT_OFF_FAULTS
            and prev.agent_id in f.cut_off
            and CALLER not in f.cut_off
            and dup.start <= f.at <= dup.start + ROUTE_TIMEOUT / 2
            for f in faults
        )
    )


def _unstored_until_cut(
    run: Run, faults: list[Fault], unstored: Mapping[tuple[str, str], list[float]]
) -> float | None:
    """When a partition cut ``run``'s agent off while that agent still tried to store the
    run's final status, which JetStream never took (None: no such cut). The agent said so:
    its "final status of <task> not stored" line, with a JetStream error (``UNSTORED_ERRORS``),
    within ``STORE_RETRY`` s of the run's end (its stores retried that long, through elections);
    and the cut (its agent among the node's clients) began between the run's start and that
    line. The result was then in the agent's hands alone, on the cut-off side (and in those
    of hubs that heard it live, over core NATS: the owner, were it cut off too): the hubs of
    the other side, finding nothing stored, gave the attempt up for its agent LOST and ran
    the step again — the at-least-once window of an agent cut off past its lease, the
    result not yet durable. Secure seed 161, ``partition``: the rejoin of a node cut off 7 s
    unseated the leaders of ``REACH_STATUS``, ``KV_reach_tasks`` and ``REACH_WORK`` 0.09 s
    after the heal (its raft terms higher: "Detected another leader with higher term"), and
    none was elected before the next cut, 5 s later, took the agents that had run steps in
    between (and their workflows' owner); ``REACH_STATUS`` stored nothing for 9.2 s
    (docs/reliability.md)."""
    end = run.end
    if end is None:
        return None
    for said in unstored.get((run.agent_id, run.task_id), ()):
        if not end <= said <= end + STORE_RETRY + SLACK:
            continue
        for f in faults:
            if f.kind in CUT_OFF_FAULTS and run.agent_id in f.cut_off and run.start <= f.at <= said:
                return f.at
    return None


def _around_frozen(prev: Run, dup: Run, faults: list[Fault]) -> bool:
    """Whether a NATS server was frozen between a route's run and its second run (from
    ``SLACK`` s before the first started to the second's start)."""
    return any(
        f.kind in FROZEN_NODE_FAULTS
        and f.at <= dup.start
        and (f.until if f.until is not None else f.at) >= prev.start - SLACK
        for f in faults
    )


def _held_up(run: Run, faults: list[Fault]) -> bool:
    """Whether a fault may have kept ``run``'s outcome from the hubs: its agent died or was
    paused right then, or a partition held its result up on the far side (stored after
    another's)."""
    end = run.end or run.start
    return any(
        (
            f.kind in AGENT_FAULTS
            and f.target == run.agent_id
            and run.start - SLACK <= f.at <= end + SLACK
        )
        or (
            f.kind in CUT_OFF_FAULTS
            and run.agent_id in f.cut_off
            and f.at - SLACK <= end
            and run.start <= (f.until or f.at) + SLACK
        )
        for f in faults
    )


def _status_delayed(run: Run, until: float, faults: list[Fault]) -> bool:
    """Whether a fault may have held ``run``'s outcome up on its way to the hub until
    ``until``: ``_held_up``, or a NATS server, a hub or a connection lost between its end
    (less ``ELECTIONS``) and then (``STATUS_FAULTS``)."""
    end = run.end or run.start
    return _held_up(run, faults) or any(
        f.kind in STATUS_FAULTS
        and f.at <= until + SLACK
        and (f.until if f.until is not None else f.at) + ELECTIONS >= end
        for f in faults
    )


def _cut_off_until(run: Run, decided: float, faults: list[Fault]) -> bool:
    """Whether a partition cut ``run``'s agent off from the hub that decided its step, by
    ``decided`` at the latest: the agent among the node's clients (``Fault.cut_off``), the cut
    begun by the time the run ended and its routes not back yet when the step was decided
    (``REJOIN`` s after the relays). Its final status then had been stored nowhere (JetStream
    finds no quorum on the cut-off side, and the agent publishes it again only once its server
    hears the others), and neither could the agent be asked across the cut: nothing the
    deciding hub could read or ask had the result — secure seed 156, two cancels so."""
    end = run.end or run.start
    return any(
        f.kind in CUT_OFF_FAULTS
        and run.agent_id in f.cut_off
        and f.until is not None
        and f.at <= end
        and decided <= f.until + REJOIN
        for f in faults
    )


def _first_result_lost(
    step: Mapping[str, Any],
    task: Mapping[str, Any],
    runs: list[Run],
    faults: list[Fault],
    unstored: Mapping[tuple[str, str], list[float]] | None = None,
) -> str | None:
    """Invariant 3 on one step: the first handler run that produced a result (ok or a
    non-retryable failure) must be the attempt the stored workflow result says decided the
    step (``decided_by``), unless its agent died or was paused right then (its result may never
    have been stored), or was cut off before JetStream took its status
    (``_unstored_until_cut``)."""
    if step.get("state") not in FINAL or step.get("cancelled"):
        return None
    done = sorted(
        (r for r in runs if r.outcome in ("ok", "failed") and r.end), key=lambda r: r.end or 0
    )
    if not done:
        return None
    first = done[0]
    decided = {step.get("decided_by")}
    if first.attempt in decided or _held_up(first, faults):
        return None
    if _unstored_until_cut(first, faults, unstored or {}) is not None:
        return None
    end = first.end or first.start
    return (
        f"{first.task_id}: {first.agent_id}#{first.attempt} ended {first.outcome} at {end:.3f}, "
        f"the result says attempt {step.get('decided_by')} decided ({step['state']}); history "
        + ", ".join(
            f"#{a.get('attempt')} {a.get('state')} {a.get('code') or ''}".strip()
            for a in task.get("history") or ()
        )
    )


def check(h: History) -> Report:
    rep = Report(workflows=len(h.expected), runs=len(h.runs))
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
            _check_policy(rep, wf, result, runs_by_wf.get(wf, []), h.faults)
        for step in result.get("steps") or ():
            steps[str(step.get("task_id"))] = step
            task = h.tasks.get(str(step.get("task_id")))
            if task is None or step.get("cancelled"):
                continue
            # A step decided by its current attempt keeps its record as it was (the hub writes
            # a task record only when the fence must change): then the record's attempt must
            # be the deciding one. Otherwise the record holds the outcome.
            kept = task.get("state") not in FINAL and task.get("attempt") == step.get("decided_by")
            if not kept and task.get("state") != step.get("state"):
                rep.step_record_mismatch += 1
                rep.add(
                    "step record != result",
                    wf,
                    f"step {step.get('index')}: result says {step.get('state')}, "
                    f"task record {task.get('state')} (attempt {task.get('attempt')})",
                )

    for wf, answer in sorted(h.cancels.items()):
        _check_cancel(rep, wf, answer, h, runs_by_wf.get(wf, []))

    _check_routes(rep, h)

    for task_id, runs in runs_by_task.items():
        task = h.tasks.get(task_id)
        step = steps.get(task_id)
        lost = (
            None
            if step is None
            else _first_result_lost(step, task or {}, runs, h.faults, h.unstored)
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
            why = _explained(dup, runs[:i], h.faults, h.unstored)
            if why == "agent":
                rep.dup_agent_crash += 1
            elif why == "hub":
                rep.dup_hub_crash += 1
            elif dup.workflow_id is None and _around_frozen(runs[i - 1], dup, h.faults):
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


#: An agent's line when it gave up storing a step's final status (reach_mesh/agent/_held.py).
_UNSTORED = re.compile(r"final status of (\S+) not stored: (\w+)\(")


def read_unstored(paths: Iterable[Path]) -> dict[tuple[str, str], list[float]]:
    """Agents' process logs (``<agent id>.log``, JSON lines): when each gave up storing a
    task's final status for a JetStream error (``UNSTORED_ERRORS``), by (agent id, task id)."""
    out: dict[tuple[str, str], list[float]] = defaultdict(list)
    for path in paths:
        if not path.exists():
            continue
        agent_id = path.name.removesuffix(".log")
        for line in path.read_text().splitlines():
            try:
                ev = json.loads(line)
            except ValueError:
                continue
            m = _UNSTORED.match(str(ev.get("msg", "")))
            if m is None or m.group(2) not in UNSTORED_ERRORS or not ev.get("ts"):
                continue
            t = datetime.fromisoformat(str(ev["ts"]).replace("Z", "+00:00")).timestamp()
            out[(agent_id, m.group(1))].append(t)
    return dict(out)


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
    )


if __name__ == "__main__":
    import sys

    for arg in sys.argv[1:]:
        print(check(load(Path(arg))).table(arg, examples=10))
