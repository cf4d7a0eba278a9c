"""Which duplicate runs and lost first results the history checker explains, and by what fault.

The rules of :func:`~tests.chaos.history.check` that look at the injected faults: a second run
of a task (a step's or a route's) is explained by an agent fault of the earlier run's agent, a
pause of its own agent, a partition that cut an earlier run's agent off (and the narrower
partition windows: ``_cut_off_again``, ``_unregistered_when_asked``, ``_unstored_until_cut``),
a frozen NATS server (routes), or a hub fault; a first result not kept, by its agent's death,
pause or cut. Each rule and its window is described where it is defined; docs/reliability.md
says which chaos run each came from.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from reach_mesh.hub._holders import HOLDER_WAIT

if TYPE_CHECKING:
    from .history import Fault, Run

#: The final states of a step or workflow.
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
#: in that cut (or in one of its caller), while a later partition begun before its caller
#: asked again cut that agent off again (``_cut_off_again``); and a first result of such an
#: agent not kept.
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
#: How long (s) after its wait for a route's answer ran out a chaos caller asks again: the
#: ``Client`` waits for the hub's answer 5 % of the timeout longer (``_reply_slack``: 0.5 s of
#: ``ROUTE_TIMEOUT``), and workload.py's ``route`` pauses 0.25 s before it asks again.
RETRY_LAG = 0.75
#: When (s after a route's first run) its caller's retry ends its wait for that run's agent, the
#: holder, to register again (``_unregistered_at_retry``): the retry, marked as a resend, comes
#: ``ROUTE_TIMEOUT + RETRY_LAG`` s after the first send; its hub, finding the agent declared
#: LOST but back on NATS and holding the task (its ctl answer), waits for its registration half
#: the retry's time left at most (``ROUTE_TIMEOUT / 2``; reach_mesh/hub/_holders.py,
#: ``HOLDER_BACK_WAIT``), then routes it as new.
HOLDER_WAITED = ROUTE_TIMEOUT + RETRY_LAG + ROUTE_TIMEOUT / 2
#: The connection name of the chaos callers (``Client``'s default): a partition whose
#: ``cut_off`` has it cut a caller off too.
CALLER = "reach-client"
#: The connection name of a secure chaos run's observer (harness.py: the hub identity's
#: connection that injects the faults and reads the streams and records): its own, so that a
#: partition's ``cut_off`` names ``CALLER`` only when it cut the caller off. Secure runs before
#: it gave the observer the caller's name (``Client``'s default): their ``cut_off`` naming
#: ``CALLER`` may mean the observer alone (``caller_side``).
OBSERVER = "reach-observer"
#: Route runs begun inside a partition, on agents it left out and none on an agent it cut off,
#: that put the caller on the other side (``caller_side``).
SIDE_RUNS = 10
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


def caller_side(faults: list[Fault], runs: Iterable[Run]) -> list[Fault]:
    """``faults`` of a secure run whose observer had the caller's connection name (``CALLER``;
    ``OBSERVER`` since), each partition's ``cut_off`` naming ``CALLER`` only if the caller was
    with the node it cut off: one whose inside (from ``SLACK`` s after it began to its heal) saw
    ``SIDE_RUNS`` or more route runs begin on agents it left out, and none on an agent it cut
    off, loses that name — the observer was the one cut off. A caller's requests reach only the
    hubs of its side, and those only the agents of its side: a caller cut off with the node
    has its routes run there (or nowhere, no hub there: secure seed 168, 0 runs anywhere in
    three cuts), while a hub of the other side may still send a few routes held since before
    the cut to its own agents (secure seed 165: 2 beside 38 on the cut-off agents). Secure seed
    176, ``partition``: the observer on ``n0``, the caller on ``n1``; both cuts of ``n0`` named
    ``CALLER``, and 30 and 76 route runs began inside them, every one on an agent of ``n1`` or
    ``n2`` — read as cuts of the caller, they kept ``_cut_off_again`` from a route's re-run
    (``chaos-176-r00270``) while its holder, the caller away, was out of reach."""
    routes = [r for r in runs if r.workflow_id is None]
    out = []
    for f in faults:
        if f.kind in CUT_OFF_FAULTS and CALLER in f.cut_off and f.until is not None:
            inside = [r.agent_id in f.cut_off for r in routes if f.at + SLACK <= r.start <= f.until]
            if len(inside) >= SIDE_RUNS and not any(inside):
                f = dataclasses.replace(f, cut_off=tuple(c for c in f.cut_off if c != CALLER))
        out.append(f)
    return out


def _explained(
    dup: Run,
    earlier: list[Run],
    faults: list[Fault],
    unstored: Mapping[tuple[str, str], list[float]] | None = None,
    unregistered: Mapping[str, list[float]] | None = None,
) -> str | None:
    """Why a handler ran again for a step that already ran: an agent fault of an earlier run's
    agent from ``PRIOR`` s before that run's start to this one's (``agent``); or this run's
    own agent paused since before an earlier run started, this run's first line within
    ``WOKE`` s of its waking (``agent``: decided before the pause, see ``WOKE``); or a
    partition that cut an earlier run's agent off (a route's run within ``HEAL`` s of its
    end; ``agent``, see ``CUT_OFF_FAULTS``), or a route's run while a later one cut it off
    again before its caller could ask (``agent``, ``_cut_off_again``), or while it had yet to
    register again when its caller asked (``agent``, ``_unregistered_when_asked``), or whose
    registration again was refused from the heal of the cut that lost its answer to its
    caller's retry, or to the end of that retry's wait for it (``agent``,
    ``_unregistered_at_retry``), or a
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
            _cut_off_again(prev, dup, faults)
            or _unregistered_when_asked(prev, dup, faults)
            or _unregistered_at_retry(prev, dup, faults, unregistered or {})
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


def _answer_lost(prev: Run, faults: list[Fault]) -> bool:
    """Whether a route run's answer was lost in a partition that cut its agent or its caller
    off as it ended (from ``SLACK`` s before its end to as long after the heal)."""
    end = prev.end or prev.start
    return any(
        f.kind in CUT_OFF_FAULTS
        and (prev.agent_id in f.cut_off or CALLER in f.cut_off)
        and f.at - SLACK <= end
        and prev.start <= (f.until or f.at) + SLACK
        for f in faults
    )


def _cut_off_again(prev: Run, dup: Run, faults: list[Fault]) -> bool:
    """Whether a route's second run came while the agent of its first run was out of its
    caller's reach for the whole time the caller could ask again: that run's answer lost in
    a partition that cut its agent or its caller off as it ran (from ``SLACK`` s before its
    end to as long after the heal), and its agent cut off again, away from the callers, by a
    partition begun before the caller's wait for that answer ran out (``ROUTE_TIMEOUT`` s
    after the run started, ``SLACK``), the second run from that cut to ``HEAL`` s after its
    heal: every retry found the holder out of reach — declared LOST by the hubs of the
    caller's side, not answering the seek across the cut (docs/reliability.md: the
    at-least-once window of a holder out of reach; secure seed 158, the agent cut off as it
    ran; secure seed 165, the caller and the hub that routed it cut off 7 ms after the run
    began). The reach the heal between gave back was spent while the caller still waited for
    the lost answer."""
    return _answer_lost(prev, faults) and any(
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
    answer_lost = _answer_lost(prev, faults)
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


def _unregistered_at_retry(
    prev: Run, dup: Run, faults: list[Fault], unregistered: Mapping[str, list[float]]
) -> bool:
    """Whether a route's second run was its caller's retry after its wait for the first run's
    answer ran out (from ``SLACK`` s before ``ROUTE_TIMEOUT`` s after the first run started to
    ``SLACK`` s after, plus ``HOLDER_WAIT``: its hub, the retry marked as a resend, waits that
    long to hear from a holder before it routes it as new), the agent of that run cut off as
    the run ended, its answer lost, by a
    partition long enough to have it declared LOST (``HEAL`` s or more), healed before the
    retry and at most ``ELECTIONS`` s before it, and that agent's try to register again
    refused between the heal and the retry (its log says so: ``unregistered``, from
    ``read_unregistered``). The retry named it (the ``Client``'s pin after ``REACH_TIMEOUT``),
    no hub had it registered ("no routable agent"), and it was routed as new; a marked resend
    waits for a LOST holder's registration half the time left at most
    (docs/protocol.md, "Resends"). The at-least-once window of a holder out of reach, its
    registration refused past ``HEAL`` (secure seed 168, ``partition``, route r00049: its
    agent cut off 70 ms into the run for 7.3 s with ``n0``, leader of ``KV_reach_tasks``, its
    registration refused 2.1 s after the heal and not taken for 11 s more; the retry 10.8 s
    after the run began, 3.4 s after the heal. Secure seed 207, ``partition``, route r00049
    again: ``a5`` cut off 46 ms into the run for 8.0 s with ``n0``, declared LOST, its
    registration refused 1.2 s after the heal; a route to it by agent id (the retry, by its
    time) found "no routable agent" 10.25 s after the run began; routed as new on ``a3``
    11.10 s after it, past the ``HOLDER_WAIT`` of a resend nobody claimed).

    Or the second run came when the retry's wait for that agent ran out (``SLACK`` s either
    side of ``HOLDER_WAITED`` s after the first run started), the retry asked (and the cut
    healed) ``ROUTE_TIMEOUT / 2`` s before it: back on NATS, the agent answered the hub's ask
    that it held the task, and the hub waited for its registration, refused all along, half the
    retry's time (secure seed 171, ``partition``, route r00282: ``a0`` cut off 0.1 s into the
    run for 9.9 s with the caller, declared LOST; its registration refused 1.0 s after the heal,
    ``KV_reach_agents`` without a leader from 0.6 s to 7.0 s after it and taking the
    registration at 9.2 s; the second run 15.74 s after the first began, 5.74 s after the
    heal)."""
    since = dup.start - prev.start
    if ROUTE_TIMEOUT - SLACK <= since <= ROUTE_TIMEOUT + HOLDER_WAIT + SLACK:
        asked = dup.start  # routed as new at once: registered at no hub (seeds 168, 207)
    elif abs(since - HOLDER_WAITED) <= SLACK:
        asked = dup.start - ROUTE_TIMEOUT / 2  # after the wait for the holder (seed 171)
    else:
        return False
    end = prev.end or prev.start
    refused = unregistered.get(prev.agent_id, ())
    return any(
        f.kind in CUT_OFF_FAULTS
        and prev.agent_id in f.cut_off
        and f.until is not None
        and f.until - f.at >= HEAL
        and f.at - SLACK <= end <= f.until
        and f.until <= asked <= f.until + ELECTIONS
        and any(f.until <= t <= dup.start for t in refused)
        for f in faults
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
