"""What the operators' dashboard shows, as JSON-able dicts: the fleet, the traffic, this hub's
recent route decisions, workflows and pending work (``GET /api/dashboard/...``).

The data comes from what the hub keeps anyway — the registry, its Prometheus counters and
histograms, the workflow engine — plus three bounded pieces kept by :class:`Dashboard`:

- a ring of metric snapshots, sampled every :data:`SAMPLE_INTERVAL` seconds by a background task
  (:data:`SAMPLES` of them: the last six minutes), from which rates, success rates and latency
  quantiles are differences of cumulative counters, as Prometheus' ``rate()`` computes them;
- a ring of this hub's last :data:`DECISIONS` route outcomes with the router's explanation (the
  audit event the hub writes anyway, plus the :class:`~reach_mesh.models.RouteDecision`);
- the last :data:`WORKFLOWS` workflows seen on ``reach.status.>`` (the six-state events agents
  publish for durable work, whichever hub owns the workflow) or run by this hub, completed from
  their ``reach_workflows`` record (kind, step count, trace id, owner, outcome) and, for steps no
  event told of, their ``reach_tasks`` records; unfinished ones are re-read each sample.

Nothing here runs per request except one ``deque.append`` in :meth:`Dashboard.record_route`.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections import OrderedDict, deque
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final

from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from reach_mesh import protocol
from reach_mesh._guard import guarded
from reach_mesh._jspub import JsClient
from reach_mesh.errors import BadRequestError, InternalError, ReachError
from reach_mesh.hub._fleet import FleetAsk, fleet_page
from reach_mesh.models import AgentState, RouteDecision, TaskState
from reach_mesh.workflow import TaskRecord, WorkflowRecord, WorkflowSpec, step_task_id

if TYPE_CHECKING:
    from prometheus_client.registry import Collector

    from reach_mesh.hub._hub import Hub

__all__ = [
    "DECISIONS",
    "FLEET_LOST_SHOWN",
    "FLEET_PAGE",
    "FLEET_PAGE_MAX",
    "SAMPLES",
    "SAMPLE_INTERVAL",
    "UNCONFIRMED",
    "WORKFLOWS",
    "Dashboard",
    "fleet",
    "pending",
    "recent_decisions",
    "settings",
    "traffic",
    "workflows",
]

log = logging.getLogger("reach_mesh.hub.dashboard")

#: Seconds between two metric snapshots.
SAMPLE_INTERVAL: Final = 5.0
#: Snapshots kept (72 of 5 s = the last six minutes).
SAMPLES: Final = 72
#: Route outcomes kept for "recent decisions".
DECISIONS: Final = 200
#: Workflows kept (oldest forgotten first).
WORKFLOWS: Final = 50
#: Workflows known only from status events (no record read yet) kept besides those.
UNCONFIRMED: Final = 16
#: Task records read per unfinished workflow and pass (steps no status event told of).
_STEP_READS: Final = 16
#: Agents one fleet view lists when the page does not say (``limit``), and at most: the page is
#: refreshed every 2 s per open tab, so it asks for a page, never the whole fleet.
FLEET_PAGE: Final = 200
FLEET_PAGE_MAX: Final = 1000
#: Agents declared LOST lately that the fleet view lists (the newest; all are counted).
FLEET_LOST_SHOWN: Final = 50
#: The window of the "now" figures (rate, success rate, p50/p99).
WINDOW: Final = 60.0

#: Task outcomes that are the caller's success (ROUTED: a direct-mode or dry-run decision).
_OK_STATES: Final = frozenset({"SUCCEEDED", "ROUTED", "ACCEPTED", "DELIVERED", "RUNNING"})
#: The outcomes a success rate is taken among, as ``ReachSuccessRateLow`` takes it: tasks that
#: ran and ended. No match, busy, throttled and refused payloads are not the agents' failures
#: (and busy and throttled tries are repeated by the SDK): they are the window's ``errors``.
_RATED_STATES: Final = _OK_STATES | {"FAILED", "TIMEOUT"}
_STATES: Final = frozenset(s.value for s in TaskState)
#: Operator actions that apply to an agent, by what it is now (the page offers only these).
_ACTIONS: Final[dict[AgentState, tuple[str, ...]]] = {
    AgentState.ONLINE: ("cordon", "quarantine", "simulate-lost", "remove"),
    AgentState.SUSPECT: ("cordon", "quarantine", "remove"),
    AgentState.PRE_ONLINE: ("cordon", "quarantine", "remove"),
    AgentState.DRAINING: ("quarantine", "remove"),
    AgentState.CORDONED: ("uncordon", "quarantine", "remove"),
    AgentState.QUARANTINED: ("release", "remove"),
    AgentState.LOST: ("remove",),
}


# --------------------------------------------------------------------------- snapshots


@dataclass(slots=True)
class _Histogram:
    """Cumulative bucket counts of one histogram, summed over its label sets."""

    bounds: list[float] = field(default_factory=list)
    counts: list[float] = field(default_factory=list)  # cumulative, the last is +Inf

    def minus(self, older: _Histogram) -> _Histogram:
        if older.bounds != self.bounds:
            return self
        return _Histogram(
            self.bounds, [a - b for a, b in zip(self.counts, older.counts, strict=True)]
        )

    def quantile(self, q: float) -> float | None:
        """``histogram_quantile``: linear inside the bucket; the top bound past the last one."""
        if not self.counts or self.counts[-1] <= 0:
            return None
        rank = q * self.counts[-1]
        below, lower = 0.0, 0.0
        for bound, count in zip(self.bounds, self.counts, strict=False):  # +Inf last
            if count >= rank:
                inside = count - below
                return lower + (bound - lower) * ((rank - below) / inside if inside else 1.0)
            below, lower = count, bound
        return self.bounds[-1] if self.bounds else None


@dataclass(slots=True)
class _Sample:
    t: float  # wall time
    outcomes: dict[str, float]  # task state or error code -> cumulative count
    task: _Histogram  # handler time of routed tasks (ACCEPTED -> final)
    route: _Histogram  # the hub's route decision time

    def total(self) -> float:
        return sum(self.outcomes.values())


def _histogram(collector: Collector) -> _Histogram:
    sums: dict[float, float] = {}
    for family in collector.collect():
        for s in family.samples:
            if s.name.endswith("_bucket"):
                le = float(s.labels["le"])
                sums[le] = sums.get(le, 0.0) + s.value
    ordered = sorted(sums.items())
    return _Histogram([b for b, _ in ordered if b != float("inf")], [c for _, c in ordered])


def _sample(hub: Hub) -> _Sample:
    outcomes: dict[str, float] = {}
    for family in hub.metrics.task_total.collect():
        for s in family.samples:
            if s.name.endswith("_total"):
                state = s.labels["state"]
                outcomes[state] = outcomes.get(state, 0.0) + s.value
    return _Sample(
        time.time(),
        outcomes,
        _histogram(hub.metrics.task_duration_seconds),
        _histogram(hub.metrics.route_duration_seconds),
    )


def _between(new: _Sample, old: _Sample) -> dict[str, Any]:
    """Rate, success rate, errors and latency quantiles from ``old`` to ``new``."""
    span = max(new.t - old.t, 1e-9)
    delta = {k: v - old.outcomes.get(k, 0.0) for k, v in new.outcomes.items()}
    total = sum(delta.values())
    ok = sum(v for k, v in delta.items() if k in _OK_STATES)
    rated = sum(v for k, v in delta.items() if k in _RATED_STATES)
    task, route = new.task.minus(old.task), new.route.minus(old.route)

    def ms(h: _Histogram, q: float, scale: float) -> float | None:
        value = h.quantile(q)
        return None if value is None else round(value * scale, 3)

    return {
        "t": round(new.t, 3),
        "seconds": round(span, 3),
        "requests": int(total),
        "rate": round(total / span, 3),
        "success_rate": None if rated <= 0 else round(ok / rated, 4),
        "errors": {k: int(v) for k, v in sorted(delta.items()) if k not in _OK_STATES and v > 0},
        "p50_ms": ms(task, 0.5, 1e3),
        "p99_ms": ms(task, 0.99, 1e3),
        "route_p50_us": ms(route, 0.5, 1e6),
        "route_p99_us": ms(route, 0.99, 1e6),
    }


# --------------------------------------------------------------------------- workflows


@dataclass(slots=True)
class _Step:
    index: int
    task_id: str | None = None
    state: str = TaskState.PENDING.value
    attempt: int = 0
    agent_id: str | None = None
    error: str | None = None
    updated_at: float = 0.0

    def json(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "task_id": self.task_id,
            "state": self.state,
            "attempts": self.attempt,
            "agent_id": self.agent_id,
            "error": self.error,
        }


@dataclass(slots=True)
class _Workflow:
    workflow_id: str
    namespace: str
    seen_at: float
    steps: dict[int, _Step] = field(default_factory=dict)
    kind: str | None = None
    step_count: int | None = None
    state: str = TaskState.RUNNING.value
    trace_id: str | None = None
    owner: str | None = None
    submitted_at: float | None = None
    finished_at: float | None = None
    read: bool = False  # the reach_workflows record has been read once
    #: Its record exists (read, or this hub runs it): unlike a workflow known only from
    #: status events — which any agent may make up — it is never pushed out by those.
    known: bool = False
    #: Its final record was read: its steps are the record's, and status events change
    #: nothing any more (an agent may publish any event on its own subject).
    settled: bool = False

    def json(self) -> dict[str, Any]:
        count = max([self.step_count or 0, *(i + 1 for i in self.steps)])
        steps = [self.steps.get(i) or _Step(i) for i in range(count)]
        return {
            "workflow_id": self.workflow_id,
            "namespace": self.namespace,
            "kind": self.kind,
            "state": self.state,
            "trace_id": self.trace_id,
            "owner": self.owner,
            "submitted_at": self.submitted_at,
            "finished_at": self.finished_at,
            "steps": [s.json() for s in steps],
        }


# --------------------------------------------------------------------------- the keeper

#: A route outcome: audit event, explained decision, error, strategy asked, agents that refused.
_Decision = tuple[
    dict[str, Any], RouteDecision | None, ReachError | None, str | None, tuple[str, ...]
]


class Dashboard:
    """The bounded state behind the dashboard of one hub: metric snapshots, recent route
    decisions, recent workflows. ``start()`` after the hub's connection and engine are up."""

    def __init__(self, hub: Hub, *, interval: float = SAMPLE_INTERVAL) -> None:
        self.hub = hub
        self.interval = interval
        self.samples: deque[_Sample] = deque(maxlen=SAMPLES)
        self.decisions: deque[_Decision] = deque(maxlen=DECISIONS)
        #: By (namespace, workflow id): ids are chosen by callers, unique per namespace only.
        self.workflows: OrderedDict[tuple[str, str], _Workflow] = OrderedDict()
        self._sampler: asyncio.Task[None] | None = None
        self._sub: Subscription | None = None
        #: Reads of workflow and task records, once both buckets exist: direct gets asked
        #: again when a replica does not answer soon (a frozen node's).
        self._jsc: JsClient | None = None
        self._reads: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        self.samples.append(_sample(self.hub))
        self._sampler = asyncio.create_task(self._sample_forever(), name="reach-dashboard")
        js = self.hub.nc.jetstream()
        with contextlib.suppress(Exception):  # no workflows bucket: the panel stays empty
            await js.key_value(protocol.KV_WORKFLOWS)
            await js.key_value(protocol.KV_TASKS)
            self._jsc = JsClient(self.hub.nc)
            await self._jsc.start()
        statuses = protocol.task_status("*.*.*", "*")
        # On the hub's statuses connection, as the engine's: a flood cuts that one only.
        self._sub = await self.hub.status_nc.subscribe(
            statuses, cb=guarded(statuses, self._on_status, answers=False), pending_msgs_limit=-1
        )

    async def close(self) -> None:
        if self._sub is not None:
            with contextlib.suppress(Exception):
                await self._sub.unsubscribe()
            self._sub = None
        for task in [self._sampler, *self._reads]:
            if task is not None:
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task
        self._sampler = None

    async def _sample_forever(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            try:
                self.samples.append(_sample(self.hub))
                self.refresh_workflows()
            except Exception:  # a bug here must not stop the sampling for good
                log.exception("dashboard sample failed")

    def refresh_workflows(self) -> None:
        """Adopt the workflows this hub runs (some have no step at an agent yet, so no status
        event told of them) and re-read the unfinished ones (a step may end without one)."""
        self.adopt()
        for wf in list(self.workflows.values()):
            if not TaskState(wf.state).final:
                self._read_later(wf)

    def adopt(self) -> None:
        """Track the workflows this hub runs that no status event told of yet."""
        engine = self.hub.workflows
        for ns, wf_id in [] if engine is None else engine.owned:
            if (ns, wf_id) not in self.workflows:
                wf = _Workflow(wf_id, ns, time.time(), known=True)
                self._remember(wf)
                wf.read = True
                self._read_later(wf)

    def _remember(self, wf: _Workflow) -> _Workflow:
        """Keep ``wf``: the newest :data:`WORKFLOWS` of those with a record, and the newest
        :data:`UNCONFIRMED` of those known only from status events until their record is read
        (an agent making up events for 60 workflow ids once emptied the panel)."""
        self.workflows[(wf.namespace, wf.workflow_id)] = wf
        self._trim()
        return wf

    def _trim(self) -> None:
        unknown = [k for k, w in self.workflows.items() if not w.known]
        for key in unknown[: max(0, len(unknown) - UNCONFIRMED)]:
            del self.workflows[key]
        known = len(self.workflows) - min(len(unknown), UNCONFIRMED)
        for key in [k for k, w in self.workflows.items() if w.known][: max(0, known - WORKFLOWS)]:
            del self.workflows[key]

    def record_route(
        self,
        event: dict[str, Any],
        decision: RouteDecision | None,
        error: ReachError | None,
        strategy: str | None,
        refused: Collection[str],
    ) -> None:
        """Keep one route outcome — the audit event the hub built anyway — and what explains it:
        the router's decision when the request asked for one (``explain``, a dry run), the
        decision a ``REACH_NO_MATCH`` carries, else the strategy and the agents that refused."""
        if "ts" not in event:  # the audit log stamps it, unless it is off
            event["ts"] = round(time.time(), 6)
        self.decisions.append((event, decision, error, strategy, tuple(refused)))

    # ------------------------------------------------------------------ workflows

    async def _on_status(self, msg: Msg) -> None:
        # On the subscription's reader: a parse and dictionary updates, no awaits.
        engine = self.hub.workflows
        if engine is not None and len(msg.data) > engine.max_status:
            return  # larger than any agent sends: the engine counts it refused, unparsed
        try:
            ev = protocol.loads(msg.data)
            wf_id, step, state = ev.get("workflow_id"), ev.get("step"), ev.get("state")
            attempt = ev.get("attempt")
            if (
                not isinstance(wf_id, str)
                or not protocol.WORKFLOW_ID_RE.fullmatch(wf_id)
                or not isinstance(ev.get("task_id"), str)
                or not isinstance(step, int)
                or state not in _STATES
                or not isinstance(attempt, int)
                or isinstance(attempt, bool)
                or attempt < 1
            ):
                return
            # Only the agent its subject names may publish it (NATS permissions): a body
            # speaking for another is no row of the dashboard's (the engine counts it forged).
            agent_id = ".".join(msg.subject.split(".")[2:5])
            if ev.get("agent_id") != agent_id:
                return
            ns = protocol.namespace_of(agent_id)
        except Exception:
            return  # not ours to judge: the engine reads the same events
        wf = self.workflows.get((ns, wf_id))
        if wf is None:
            wf = self._remember(_Workflow(wf_id, ns, time.time()))
        elif wf.settled:
            return
        s = wf.steps.get(step)
        if s is None:
            if step < 0 or step >= 256:
                return
            s = wf.steps[step] = _Step(step)
        if attempt < s.attempt or (attempt == s.attempt and TaskState(s.state).final):
            return  # an older attempt, or a late event after this attempt's outcome
        s.task_id, s.attempt, s.state = ev.get("task_id"), attempt, state
        s.agent_id = ev.get("agent_id")
        err = ev.get("error")
        s.error = f"{err.get('code')}: {err.get('message')}" if isinstance(err, dict) else None
        s.updated_at = time.time()
        if not wf.read or (TaskState(state).final and self._all_final(wf)):
            wf.read = True
            self._read_later(wf)

    @staticmethod
    def _all_final(wf: _Workflow) -> bool:
        return len(wf.steps) >= (wf.step_count or 0) and all(
            TaskState(s.state).final for s in wf.steps.values()
        )

    def _read_later(self, wf: _Workflow) -> None:
        if self._jsc is None or len(self._reads) > WORKFLOWS:
            return
        task = asyncio.create_task(self._read(wf))
        self._reads.add(task)
        task.add_done_callback(self._reads.discard)

    async def _read(self, wf: _Workflow) -> None:
        """Complete ``wf`` from its ``reach_workflows`` record (kind, steps, trace, outcome)."""
        assert self._jsc is not None
        await asyncio.sleep(0.05)  # the owner writes its final record right after the event
        try:
            got = await self._jsc.kv_get(
                protocol.KV_WORKFLOWS, protocol.workflow_key(wf.namespace, wf.workflow_id)
            )
            if got is None:
                # No workflow: its events were made up (an agent may publish any on its own
                # subject), or its record expired. Not listed (a real one's next event, after
                # a read from a replica behind, lists it again).
                if self.workflows.get((wf.namespace, wf.workflow_id)) is wf:
                    del self.workflows[(wf.namespace, wf.workflow_id)]
                return
            record = WorkflowRecord.model_validate_json(got[0])
        except Exception:
            return
        if not wf.known and self.workflows.get((wf.namespace, wf.workflow_id)) is wf:
            wf.known = True
            self._trim()  # one more with a record: the oldest of those may go
        wf.owner, wf.trace_id = record.owner, record.trace_id
        wf.submitted_at = record.submitted_at
        if record.spec is not None:
            wf.kind, wf.step_count = record.spec.kind, len(record.spec.steps)
        result = record.result
        if result is not None:
            wf.kind, wf.step_count = result.kind, len(result.steps)
            wf.state, wf.finished_at = result.state.value, result.finished_at
            wf.trace_id = wf.trace_id or result.trace_id
            # The record says how each step ended, whatever events said before.
            wf.settled = True
            for r in result.steps:
                prev = wf.steps.get(r.index)
                s = wf.steps[r.index] = _Step(r.index)
                s.task_id, s.attempt, s.state = r.task_id, r.attempts, r.state.value
                s.agent_id = r.agent_id
                s.updated_at = time.time() if prev is None else prev.updated_at
                if r.error is not None:
                    s.error = f"{r.error.code}: {r.error.message}"
            for extra in [i for i in wf.steps if i >= len(result.steps)]:
                del wf.steps[extra]
        else:
            wf.state = record.state.value
            # The attempts sent when it started (a fanout's steps, a chain's first) have no
            # task record: the workflow record names their agents. Without them a step sent
            # to an agent that never took it (hung, paused) read PENDING, attempt 0, no agent
            # — while ``reach-mesh workflow`` named the agent.
            for i, agent in enumerate(record.first_agents):
                step = wf.steps.get(i)
                if agent is not None and record.spec is not None and i < len(record.spec.steps):
                    if step is None:
                        step = wf.steps[i] = _Step(i)
                    if step.attempt == 0:
                        step.task_id = step_task_id(wf.workflow_id, i, record.spec.steps[i])
                        step.attempt, step.agent_id = 1, agent
            if record.spec is not None:
                await self._read_steps(wf, record.spec)

    async def _read_steps(self, wf: _Workflow, spec: WorkflowSpec) -> None:
        """Steps of a running workflow no status event told of (still PENDING here, e.g. one
        adopted from the engine): from their ``reach_tasks`` records, a few per pass."""
        assert self._jsc is not None
        unseen = [
            i
            for i in range(len(spec.steps))
            if i not in wf.steps or wf.steps[i].state == TaskState.PENDING.value
        ]
        for i in unseen[:_STEP_READS]:
            task_id = step_task_id(wf.workflow_id, i, spec.steps[i])
            try:
                got = await self._jsc.kv_get(
                    protocol.KV_TASKS, protocol.task_key(wf.namespace, task_id)
                )
                if got is None:
                    continue
                rec = TaskRecord.model_validate_json(got[0])
            except Exception:
                continue
            if not rec.is_step(wf.workflow_id, i):
                continue  # a caller-chosen task id another workflow holds
            step = wf.steps.setdefault(i, _Step(i))
            if rec.attempt >= step.attempt:
                step.task_id, step.attempt, step.state = task_id, rec.attempt, rec.state.value
                step.agent_id = rec.agent_id
                if rec.error is not None:
                    step.error = f"{rec.error.code}: {rec.error.message}"


# --------------------------------------------------------------------------- the endpoints


def _keeper(hub: Hub) -> Dashboard:
    if hub.dashboard is None:
        raise InternalError("this hub keeps no dashboard state (its HTTP server is off)")
    return hub.dashboard


def settings(hub: Hub) -> dict[str, Any]:
    """What the page needs to know once: this hub, its sampling, the trace viewer link."""
    return {
        "hub_id": hub.hub_id,
        "interval": _keeper(hub).interval,
        "window": WINDOW,
        "trace_url_template": hub.settings.trace_url_template,
    }


def fleet(hub: Hub, ask: FleetAsk | None = None, namespace: str | None = None) -> dict[str, Any]:
    """One page of the fleet (``namespace``'s; None: every namespace's), picked as the fleet
    query picks it (``hub/_fleet.py``: ``ask``'s states, capability, offset and limit;
    :data:`FLEET_PAGE` agents when there is no ``ask``), with the counts of all of it:
    ``total``, ``by_state`` (``LOST``: declared in the last 15 minutes), ``attention_total``
    (agents that need an operator's look, each with its ``attention`` codes), ``matched``,
    ``truncated``, ``next_offset``. Each agent with what runs (``inflight`` of
    ``max_concurrency``) and what waits (``queued``) apart, health, breaker and the operator
    actions that apply."""
    ask = ask or FleetAsk(limit=FLEET_PAGE)
    if ask.limit is None or ask.limit > FLEET_PAGE_MAX:
        raise BadRequestError(f"limit must be an integer from 0 to {FLEET_PAGE_MAX}", field="limit")
    picked = fleet_page(hub.registry, namespace, ask)
    now = hub.registry.now
    by_state = {state.value: 0 for state in AgentState} | picked.by_state
    agents = []
    for view in picked.views:
        card = view.record.card
        busy, cap = view.busy, card.max_concurrency
        agents.append(
            {
                "agent_id": view.agent_id,
                "namespace": card.namespace,
                "state": view.state.value,
                "inflight": min(busy, cap),
                "max_concurrency": cap,
                # Reported queue plus anything known busy past the agent's slots.
                "queued": view.queue_depth + max(0, busy - cap),
                "load": round(min(1.0, busy / cap), 4),
                "lease_left": round(view.lease_left(now), 3),
                "health": round(view.health.value, 3),
                "breaker": view.breaker.state.value,
                "breaker_reason": view.breaker.reason,
                "cordoned": hub.registry.cordoned(view.agent_id, view.record),
                "capabilities": card.capabilities,
                "labels": card.all_labels(),
                "unavailable": sorted(view.unavailable),
                "attention": view.concerns(),
                "actions": list(_ACTIONS.get(view.state, ("remove",))),
            }
        )
    # LOST agents leave the registry: count the ones lost in the last 15 minutes, list the
    # newest (a zone lost at once is thousands of them).
    lost = hub.registry.recently_lost(namespace)
    by_state[AgentState.LOST.value] = len(lost)
    end = picked.start + len(agents)
    return {
        "hub_id": hub.hub_id,
        "namespace": namespace,
        # This hub cannot read or write the registry in JetStream, or reach NATS, lately
        # (``reach_registry_blind``): what it shows may be stale, and it declares nobody LOST.
        "blind": hub.registry.blind(),
        "blind_reason": hub.registry.blind_reason(),
        "total": picked.total,
        "by_state": by_state,
        "attention_total": picked.attention,
        "attention": ask.attention,
        "matched": picked.matched,
        "offset": ask.offset,
        "limit": ask.limit,
        "truncated": end < picked.matched,
        "next_offset": end if end < picked.matched else None,
        "agents": agents,
        "recently_lost": lost[:FLEET_LOST_SHOWN],
        "recently_lost_total": len(lost),
    }


def traffic(hub: Hub) -> dict[str, Any]:
    """Routed requests over the last minute (``now``) and per sampling interval (``series``)."""
    dashboard = _keeper(hub)
    current = _sample(hub)
    samples = [*dashboard.samples, current]
    base = next((s for s in samples if current.t - s.t <= WINDOW), samples[0])
    series = [_between(new, old) for old, new in itertools.pairwise(samples) if new.t > old.t]
    return {
        "hub_id": hub.hub_id,
        "interval": dashboard.interval,
        "window": WINDOW,
        "totals": {k: int(v) for k, v in sorted(current.outcomes.items())},
        "now": _between(current, base),
        "series": series,
    }


def recent_decisions(hub: Hub, n: int = 50) -> dict[str, Any]:
    """This hub's last ``n`` route outcomes, newest first, each with its explanation."""
    dashboard = _keeper(hub)
    default = hub.settings.default_strategy
    out = []
    for event, decision, error, strategy, refused in list(dashboard.decisions)[::-1][: max(0, n)]:
        item = {k: v for k, v in event.items() if v is not None and k != "hub_id"}
        explained = error.details.get("decision") if error is not None else None
        if decision is not None:
            item["decision"] = decision.model_dump(mode="json")
        elif isinstance(explained, dict):
            item["decision"] = explained
        else:
            # Routed without ``explain``: the router skipped scoring (the fast path), so say
            # what is known rather than re-deciding now.
            item["decision"] = {
                "strategy": strategy or default,
                "chosen": event.get("agent_id"),
                "refused": list(refused),
                "explained": False,
            }
        out.append(item)
    return {"hub_id": hub.hub_id, "decisions": out}


def workflows(hub: Hub) -> dict[str, Any]:
    """Recent workflows, newest first, each step with its six-state progress and attempts."""
    dashboard = _keeper(hub)
    dashboard.adopt()
    items = sorted(dashboard.workflows.values(), key=lambda w: w.seen_at, reverse=True)
    return {"hub_id": hub.hub_id, "workflows": [w.json() for w in items]}


def pending(hub: Hub) -> dict[str, Any]:
    """Work waiting: routes in flight on this hub, workflows it runs, and the steps of those
    waiting here before their next attempt (no agent, a retry's backoff), each with why."""
    _keeper(hub).adopt()  # the workflows view follows what this hub runs, waiting or not
    engine = hub.workflows
    waiting = [] if engine is None else engine.waiting_steps
    return {
        "hub_id": hub.hub_id,
        "routes_in_flight": max(0, hub.routing),
        "workflows_running": 0 if engine is None else engine.running,
        "steps_pending": len(waiting),
        "pending_steps": waiting,
    }
