"""Prometheus metrics for hubs and agents.

Each :class:`HubMetrics` / :class:`AgentMetrics` owns its own ``CollectorRegistry`` instead of
using prometheus-client's global one: several hubs and agents live in one test process (and one
``reach-mesh demo``), and the global registry refuses a second metric of the same name.

The hub updates metrics by plain attribute access, e.g.
``metrics.task_total.labels(ns, mode, state).inc()``; ``render()`` produces the ``/metrics`` body.
Every metric is documented in ``docs/operations.md``.
"""

from __future__ import annotations

import asyncio
import contextlib
from bisect import bisect_left
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Final

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from reach_mesh._asgi import AsgiServer

__all__ = [
    "CONTENT_TYPE",
    "DECISION_BUCKETS",
    "DURATION_BUCKETS",
    "LAG_BUCKETS",
    "LATENCY_BUCKETS",
    "AgentMetrics",
    "HistogramChild",
    "HubMetrics",
    "LoopHistogram",
    "connection_metrics",
    "serve_metrics",
    "together_metrics",
    "watch_event_loop",
]

#: How prometheus-client writes a bucket bound (``le``); the library leaves it untyped.
_go_float: Callable[[float], str] = floatToGoString

CONTENT_TYPE: Final = "text/plain; version=0.0.4; charset=utf-8"
"""Content type of :meth:`HubMetrics.render` output (Prometheus text format 0.0.4)."""

#: The ``namespace`` label of a workflow in a namespace that does not exist for the hub (no
#: registered agent, not configured): one series for all of them, never one per made-up name.
UNKNOWN_NAMESPACE: Final = "(unknown)"


def _buckets(first: float, last: float) -> tuple[float, ...]:
    """Bounds 1, 1.5, 2.5, 4, 6 per decade from ``first`` to ``last``: neighbours at most 1.67x
    apart, so a quantile interpolated inside one bucket is off by at most about a third."""
    out: list[float] = []
    decade = first
    while decade <= last:
        out.extend(b for m in (1.0, 1.5, 2.5, 4.0, 6.0) if (b := round(decade * m, 12)) <= last)
        decade *= 10
    return tuple(out)


LATENCY_BUCKETS: Final[tuple[float, ...]] = _buckets(0.0001, 60.0)
"""Hand-over and handler latencies: 100 µs to 60 s, five bounds per decade (30 in all): a routed
request takes about a millisecond, an LLM call seconds. (Route decisions:
:data:`DECISION_BUCKETS`.)"""

DECISION_BUCKETS: Final[tuple[float, ...]] = _buckets(0.000001, 1.0)
"""A route decision: 1 µs to 1 s, five bounds per decade. A decision takes about ten µs; from
100 µs up (:data:`LATENCY_BUCKETS`) nearly all of them fell in the first bucket, and the
dashboard's p50 and p99 read that bucket's bounds whatever the router did."""

LAG_BUCKETS: Final[tuple[float, ...]] = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
)  # fmt: skip
"""How late the event loop ran a timer (``reach_event_loop_lag_seconds``): a loop keeping up
wakes within a millisecond or two; from 1 s on, renewals and heartbeat answers come late."""

#: Seconds between two samples of the event loop's lag (:func:`watch_event_loop`).
LAG_EVERY: Final = 0.25

_LAG_HELP: Final = (
    "How late this process's event loop ran a timer due every 0.25 s: CPU starvation, a "
    "blocking call, a long GC pause or a paused process (from 1 s on, renewals, heartbeats "
    "and their answers come late)."
)


async def watch_event_loop(lag: LoopHistogram, every: float = LAG_EVERY) -> None:
    """Observe into ``lag``, every ``every`` seconds until cancelled, how late the running
    event loop woke this task (one timer: the cost of the sample is the sample). A stall of
    N seconds is one observation of about N."""
    loop = asyncio.get_running_loop()
    while True:
        due = loop.time() + every
        await asyncio.sleep(every)
        lag.observe(max(0.0, loop.time() - due))


DURATION_BUCKETS: Final[tuple[float, ...]] = (
    *LATENCY_BUCKETS,
    120.0,
    300.0,
    600.0,
    1800.0,
    3600.0,
    7200.0,
)
"""Task and workflow run times: :data:`LATENCY_BUCKETS`, then coarser up to the default task TTL
of 2 h (long steps)."""


class HistogramChild:
    """One label set of a :class:`LoopHistogram`: a count per bucket and a sum."""

    __slots__ = ("_bounds", "counts", "total")

    def __init__(self, bounds: list[float]) -> None:
        self._bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last one is +Inf
        self.total = 0.0

    def observe(self, value: float) -> None:
        # bisect_left: a value equal to a bound falls in that bound's bucket (le = "<=").
        self.counts[bisect_left(self._bounds, value)] += 1
        self.total += value


class LoopHistogram(Collector):
    """A Prometheus histogram for code that runs on one event loop, registered in a
    prometheus-client registry and rendered by it in the usual text format.

    ``observe()`` is a bisect and two additions. prometheus-client's own ``Histogram`` is
    thread-safe — a lock for the sum and one for the bucket on every observation, four times
    the cost —, which the hub and the agent, whose metrics are only touched on their event
    loop, pay per request for nothing. Counters and gauges stay prometheus-client's.
    """

    def __init__(
        self,
        name: str,
        documentation: str,
        labelnames: Sequence[str] = (),
        *,
        buckets: Sequence[float],
        registry: CollectorRegistry,
    ) -> None:
        self._name = name
        self._documentation = documentation
        self._labelnames = tuple(labelnames)
        self._bounds = sorted(float(b) for b in buckets if b != float("inf"))
        self._le = [_go_float(b) for b in self._bounds] + ["+Inf"]
        self._children: dict[tuple[str, ...], HistogramChild] = {}
        if not self._labelnames:
            self._children[()] = HistogramChild(self._bounds)
        registry.register(self)

    def labels(self, *values: str) -> HistogramChild:
        """The histogram for these label values (created on first use)."""
        if len(values) != len(self._labelnames):
            raise ValueError(f"{self._name} takes labels {self._labelnames}, got {values!r}")
        key = tuple(str(v) for v in values)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = HistogramChild(self._bounds)
        return child

    def observe(self, value: float) -> None:
        """Observe ``value`` (a histogram without labels)."""
        self._children[()].observe(value)

    def merge(self, values: Sequence[str], into: Sequence[str]) -> HistogramChild:
        """Drop the series of label ``values``, its observations added to ``into``'s (made if
        need be): the histogram's sum over its series is unchanged. ``into``'s child."""
        target = self.labels(*into)
        gone = self._children.pop(tuple(str(v) for v in values), None)
        if gone is not None and gone is not target:
            target.counts = [a + b for a, b in zip(target.counts, gone.counts, strict=True)]
            target.total += gone.total
        return target

    def collect(self) -> Iterator[Metric]:
        family = HistogramMetricFamily(
            self._name, self._documentation, labels=list(self._labelnames)
        )
        for key, child in self._children.items():
            running = 0
            buckets = []
            for le, count in zip(self._le, child.counts, strict=True):
                running += count
                buckets.append((le, float(running)))
            family.add_metric(list(key), buckets, child.total)
        yield family


#: What a hub's seek for the holder of a resent route found (``reach_resend_seek_total``).
RESEND_FOUND: Final = ("hub", "agent", "pin", "nobody", "lost", "lost_copy", "skipped")
#: What became of a proxy attempt's expiry once ordered against the hub's marker
#: (``reach_expiry_checks_total``, ``hub/_lateness.py``).
EXPIRY_OUTCOMES: Final = ("charged", "answered", "behind", "skipped")


class HubMetrics:
    """The metrics one hub exports on ``/metrics``; see ``docs/operations.md``."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.task_total = Counter(
            "reach_task",
            "Route requests this hub answered, once each, by namespace, delivery mode and outcome "
            "(the agent's final state, ROUTED in direct mode, or the error code without REACH_).",
            ["namespace", "mode", "state"],
            registry=r,
        )
        self.route_duration_seconds = LoopHistogram(
            "reach_route_duration_seconds",
            "Time for the hub to decide a route (request received to decision).",
            buckets=DECISION_BUCKETS,
            registry=r,
        )
        self.delivered_to_accepted_seconds = LoopHistogram(
            "reach_delivered_to_accepted_seconds",
            "Time from DELIVERED to ACCEPTED: how long an agent takes to start a handler.",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.task_duration_seconds = LoopHistogram(
            "reach_task_duration_seconds",
            "Time from ACCEPTED to a final state, by capability.",
            ["capability"],
            buckets=DURATION_BUCKETS,
            registry=r,
        )
        self.pending_tasks = Gauge(
            "reach_pending_tasks",
            "Workflow steps this hub holds waiting to be (re-)sent (PENDING).",
            registry=r,
        )
        self.agents = Gauge(
            "reach_agents",
            "Registered agents by namespace and liveness state.",
            ["namespace", "state"],
            registry=r,
        )
        self.agents_attention = Gauge(
            "reach_agents_attention",
            "Registered agents that need an operator's look, by namespace and reason (suspect, "
            "breaker_open, breaker_half_open, unhealthy, unavailable, saturated, unreached); an "
            "agent with several reasons counts under each.",
            ["namespace", "reason"],
            registry=r,
        )
        self.preonline_agents = Gauge(
            "reach_preonline_agents",
            "Agents held in PRE_ONLINE (returned after LOST, stale attempts not yet fenced).",
            registry=r,
        )
        #: The attribute's name before the metric became ``reach_preonline_agents`` (the HTTP
        #: server sets it at scrape time); the same gauge.
        self.preonline_count = self.preonline_agents
        self.registry_blind = Gauge(
            "reach_registry_blind",
            "1 while this hub cannot trust that it saw every heartbeat — within lease_timeout "
            "of its last failure to read or write the registry in JetStream, or of being cut "
            "off from NATS (it declares no agent LOST meanwhile) — else 0.",
            registry=r,
        )
        self.clock_skew = Gauge(
            "reach_clock_skew_seconds",
            "This hub's wall clock minus the NATS server's, as estimated from the timestamps of "
            "the JetStream messages it receives (deadlines use the server's; logs, audit and "
            "metrics timestamps use this host's).",
            registry=r,
        )
        self.throttled_total = Counter(
            "reach_throttled",
            "Requests refused with REACH_THROTTLED, by namespace.",
            ["namespace"],
            registry=r,
        )
        self.identity_rejected_total = Counter(
            "reach_identity_rejected",
            "Messages refused because their body spoke for another identity than their subject "
            "names (or used a hub-only code), by verb.",
            ["verb"],
            registry=r,
        )
        self.quarantine_total = Counter(
            "reach_quarantine",
            "Times an agent's breaker opened (agent QUARANTINED), a failed half-open probe "
            "included.",
            registry=r,
        )
        self.lease_expired_total = Counter(
            "reach_lease_expired",
            "Agents whose lease ran out (ONLINE -> SUSPECT): hung, crashed, partitioned, or "
            "flapping. Every hub counts the same agents.",
            ["namespace"],
            registry=r,
        )
        self.duplicate_delivery_total = Counter(
            "reach_duplicate_delivery",
            "Deliveries an agent reported as duplicates of an attempt it already had.",
            registry=r,
        )
        self.retry_total = Counter(
            "reach_retry",
            "Task attempts after the first (retries and re-queues).",
            registry=r,
        )
        self.overdue_total = Counter(
            "reach_step_overdue",
            "Step attempts still reported running past their step's timeout and "
            "step_overdue_grace: taken as TIMEOUT by the hub and told to stop (their agent "
            "does not end its handlers).",
            registry=r,
        )
        self.infra_retry_total = Counter(
            "reach_infra_retry",
            "JetStream operations of the workflow engine repeated after an infrastructure "
            "error (no leader, timeout, reconnect); never a step outcome.",
            registry=r,
        )
        self.recreated_total = Counter(
            "reach_jetstream_recreated",
            "Streams, buckets and consumers of the mesh (workflows, registry, sessions) found "
            "deleted and created again by this hub: what they held is lost.",
            registry=r,
        )
        self.stale_result_total = Counter(
            "reach_stale_result",
            "Final step statuses not applied: from an attempt or agent the step did not send "
            "to, or after the step was decided (a duplicate run).",
            registry=r,
        )
        self.resend_seek_total = _counter_by(
            r,
            "reach_resend_seek",
            "Resent route requests (Reach-Resend) this hub had no pin to a registered agent "
            "for: by who named the agent holding the task (hub, agent, pin), nobody (routed "
            "as new), lost (held by an agent declared LOST that did not register again in "
            "time: routed as new), lost_copy (finished by an agent declared LOST: answered "
            "with its stored reply), or skipped (too many asks at once: routed as if "
            "unmarked).",
            "found",
            RESEND_FOUND,
        )
        self.expiry_checks_total = _counter_by(
            r,
            "reach_expiry_checks",
            "Proxy attempts that timed out unanswered, by what a marker this hub sent itself "
            "on its own reply subject after the expiry made of it: charged (the marker came "
            "back, no reply of the attempt before it: an accept timeout and a breaker "
            "failure), answered (its reply read before the marker: counted as if read in "
            "time), behind (that reply read and the marker sent over 50 ms past the "
            "deadline, or the marker not back within 2 s, or a reconnection or a "
            "slow-consumer drop of the reply subscription since the route began: not "
            "charged), skipped (too many pending: not charged).",
            "outcome",
            EXPIRY_OUTCOMES,
        )
        self.late_reply_total = Counter(
            "reach_late_reply",
            "Agent replies to a proxy attempt that had already timed out (answer dropped).",
            registry=r,
        )
        self.heartbeat_total = Counter(
            "reach_heartbeat",
            "Heartbeats received.",
            registry=r,
        )
        self.record_reads_total = Counter(
            "reach_record_reads",
            "Task records read at their stream's leader for wary agents (verb record), by "
            "outcome: found, absent, unavailable (JetStream did not answer, or its leader had "
            "no quorum lately), refused (bad input, or this hub busy).",
            ["outcome"],
            registry=r,
        )
        for outcome in ("found", "absent", "unavailable", "refused"):
            self.record_reads_total.labels(outcome)
        self.http_refused_total = Counter(
            "reach_http_refused",
            "HTTP requests refused before their handler ran, by error code "
            "(REACH_FORBIDDEN_HOST, REACH_FORBIDDEN_ORIGIN, REACH_UNSUPPORTED_MEDIA_TYPE, "
            "REACH_UNAUTHORIZED).",
            ["code"],
            registry=r,
        )
        self.workflow_total = Counter(
            "reach_workflow",
            "Workflows that reached a final state, by namespace, kind (fanout, chain) and state. "
            "A namespace with no registered agent and not configured is (unknown).",
            ["namespace", "kind", "state"],
            registry=r,
        )
        self.workflow_takeover_total = Counter(
            "reach_workflow_takeover",
            "Workflows this hub took over from another owner's record (a hub died, stopped or "
            "was cut off), resuming them from the records.",
            registry=r,
        )
        self.work_messages_total = Counter(
            "reach_work_messages",
            "Work messages this hub stored for workflow steps, by kind: single (one step) or "
            "batch (the steps it decided for one agent in one pass of its loop).",
            ["kind"],
            registry=r,
        )
        self.work_batched_steps_total = Counter(
            "reach_work_batched_steps",
            "Steps this hub stored inside work batches (reach_work_messages_total{kind=batch} "
            "messages): their ratio is the mean batch size.",
            registry=r,
        )
        self.workflow_cancelled_total = Counter(
            "reach_workflow_cancelled",
            "Workflows this hub stopped on a cancel request (also counted in reach_workflow_total "
            "as FAILED), by namespace, as reach_workflow_total.",
            ["namespace"],
            registry=r,
        )
        self.workflow_interrupted_total = Counter(
            "reach_workflow_interrupted",
            "Workflows this hub handed back to the stream before storing their result, by "
            "cause: infrastructure (JetStream unavailable past the retries: another hub "
            "resumes them) or error (anything else: it comes back and fails again until fixed).",
            ["cause"],
            registry=r,
        )
        self.workflow_deferred_total = Counter(
            "reach_workflow_deferred",
            "Workflow submissions handed back to the stream for later: the hub runs "
            "workflow_concurrency workflows and their namespace its fair share of them.",
            registry=r,
        )
        self.workflow_orphans_total = Counter(
            "reach_workflow_orphans",
            "Stored workflow submissions the hubs' consumer had forgotten (its ack floor passed "
            "them across a JetStream election) that this hub's sweep found: adopted (run from "
            "the stored message) or deleted (their workflow had ended).",
            ["action"],
            registry=r,
        )
        # Exported at 0 from the start, as the interrupted causes: an alert on increase()
        # sees the first one (a series that appears at 1 has no increase to Prometheus).
        for action in ("adopted", "deleted"):
            self.workflow_orphans_total.labels(action)
        for cause in ("infrastructure", "error"):
            self.workflow_interrupted_total.labels(cause)
        self.workflows_running = Gauge(
            "reach_workflows_running",
            "Workflows this hub runs now (it holds their submission until their result is stored).",
            registry=r,
        )
        self.workflow_submissions = Gauge(
            "reach_workflow_submissions",
            "Workflow submissions not done with, from the hubs' shared consumer (read every "
            "5 s): waiting (no hub has been handed them yet) and taken (a hub has them: "
            "running, or handed back for later). Every hub reports the same: take max.",
            ["stage"],
            registry=r,
        )
        self.workflow_duration_seconds = Histogram(
            "reach_workflow_duration_seconds",
            "Time from workflow submission to its final state, by kind.",
            ["kind"],
            buckets=DURATION_BUCKETS,
            registry=r,
        )
        self.event_loop_lag_seconds = LoopHistogram(
            "reach_event_loop_lag_seconds", _LAG_HELP, buckets=LAG_BUCKETS, registry=r
        )
        #: ``workflow_done``'s series by (namespace, kind, state): a ``labels`` lookup each
        #: cost ~2 % of a hub's CPU per fanout(3). Forgotten with a namespace's series.
        self._workflow_done: dict[tuple[str, str, str], tuple[Any, Any]] = {}

    def workflow_done(self, namespace: str, kind: str, state: str, seconds: float) -> None:
        """A workflow finished: ``workflow_total`` counts it, ``workflow_duration_seconds``
        observes how long it took."""
        key = (namespace, kind, state)
        series = self._workflow_done.get(key)
        if series is None:
            series = self._workflow_done[key] = (
                self.workflow_total.labels(namespace, kind, state),
                self.workflow_duration_seconds.labels(kind),
            )
        series[0].inc()
        series[1].observe(seconds)

    def _namespaced(self) -> tuple[tuple[Any, tuple[str, ...]], ...]:
        """The series labelled by namespace (besides ``reach_agents``, rewritten at every
        scrape), with their label names in order."""
        return (
            (self.task_total, ("namespace", "mode", "state")),
            (self.throttled_total, ("namespace",)),
            (self.lease_expired_total, ("namespace",)),
            (self.workflow_total, ("namespace", "kind", "state")),
            (self.workflow_cancelled_total, ("namespace",)),
        )

    def namespaces(self) -> set[str]:
        """Every namespace some series is labelled with."""
        return {
            sample.labels["namespace"]
            for metric, _ in self._namespaced()
            for family in metric.collect()
            for sample in family.samples
            if "namespace" in sample.labels
        }

    def forget_namespace(self, namespace: str) -> None:
        """Remove every series labelled ``namespace`` (a namespace long gone from the hub:
        the series of every namespace that ever had an agent would otherwise stay)."""
        self._workflow_done.clear()  # (a kept series would count on, unexported)
        for metric, names in self._namespaced():
            gone = {
                tuple(sample.labels[n] for n in names)
                for family in metric.collect()
                for sample in family.samples
                if sample.labels.get("namespace") == namespace
            }
            for values in gone:
                with contextlib.suppress(KeyError):
                    metric.remove(*values)

    def render(self) -> bytes:
        """The registry in Prometheus text format (``CONTENT_TYPE``)."""
        return bytes(generate_latest(self.registry))


class AgentMetrics:
    """The metrics one agent process can export (the SDK updates them; serving is optional)."""

    def __init__(self, agent_id: str | None = None, namespace: str | None = None) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        if agent_id is not None:
            from reach_mesh import __version__  # (set at the end of the package's import)

            # Which agent a scrape target is: every other series here is the process's alone
            # and names no agent, so an alert on them would say only host:port. The alert
            # rules join this on ``instance`` to label theirs with the agent and namespace.
            info = Gauge(
                "reach_agent_info",
                "Always 1: the agent this /metrics belongs to (agent_id, namespace) and its "
                "SDK version.",
                ["agent_id", "namespace", "version"],
                registry=r,
            )
            info.labels(agent_id, namespace or "", __version__).set(1)
        self.inflight = Gauge(
            "reach_agent_inflight",
            "Tasks the agent's handlers are running now.",
            registry=r,
        )
        self.handled_total = Counter(
            "reach_agent_handled",
            "Task attempts that reached a final state on this agent, by capability and state.",
            ["capability", "state"],
            registry=r,
        )
        self.failures_total = Counter(
            "reach_agent_failures",
            "Handler failures by capability and error code (REACH_HANDLER_FAILED, ...).",
            ["capability", "code"],
            registry=r,
        )
        self.handler_duration_seconds = LoopHistogram(
            "reach_agent_handler_duration_seconds",
            "Handler run time by capability.",
            ["capability"],
            buckets=DURATION_BUCKETS,
            registry=r,
        )
        self.handlers_abandoned_total = Counter(
            "reach_agent_handlers_abandoned",
            "Handlers that did not stop when their attempt was cancelled (its timeout, or a "
            "hub's cancel of a step) and were abandoned handler_abandon_grace later, by kind "
            "(step: a durable workflow step, request: request-reply): the attempt answered "
            "TIMEOUT (or dropped, when cancelled), the handler still holding its slot.",
            ["kind"],
            registry=r,
        )
        for kind in ("step", "request"):
            self.handlers_abandoned_total.labels(kind)  # both series exist from the start
        self.event_loop_lag_seconds = LoopHistogram(
            "reach_event_loop_lag_seconds", _LAG_HELP, buckets=LAG_BUCKETS, registry=r
        )

    def step_counts(self, read: Callable[[], dict[str, int]]) -> None:
        """Export the durable-step counters ``read`` returns (names below), read when
        scraped: the work consumer keeps them as plain integers on its hot path."""
        self.registry.register(_StepCounts(read))

    def render(self) -> bytes:
        """The registry in Prometheus text format (``CONTENT_TYPE``)."""
        return bytes(generate_latest(self.registry))


#: What ``connection_metrics`` reads when scraped: the messages dropped unread (all connections),
#: and per connection (``main``, a hub's ``routes``, ``statuses`` and ``agents``) its
#: reconnections so far, whether it is up, and the client URLs its server last listed (None:
#: not known).
ConnectionCounts = tuple[int, Mapping[str, tuple[int, bool, int | None]]]


def _counter_by(
    registry: CollectorRegistry, name: str, doc: str, label: str, values: Sequence[str]
) -> Counter:
    """A counter with one label whose every value (``values``, a closed set) has its series
    from the start: a rate over it reads 0, not "no data", before the first increment."""
    counter = Counter(name, doc, [label], registry=registry)
    for value in values:
        counter.labels(value)
    return counter


def connection_metrics(registry: CollectorRegistry, read: Callable[[], ConnectionCounts]) -> None:
    """Export ``reach_messages_refused_total``, ``reach_nats_reconnects_total`` and
    ``reach_nats_connected`` (both by ``connection``) into ``registry``, from what ``read``
    returns when scraped (the counts live with the connections)."""
    registry.register(_Connection(read))


class _Connection(Collector):
    def __init__(self, read: Callable[[], ConnectionCounts]) -> None:
        self._read = read

    def collect(self) -> Iterator[Metric]:
        refused, named = self._read()
        yield CounterMetricFamily(
            "reach_messages_refused",
            "Messages this hub (or agent) dropped unread: a reply subject outside _INBOX., a "
            "message not of the subscription it came on (a JetStream push delivery), a "
            "pull-inbox message that is no JetStream delivery, a malformed message (a subject, "
            "reply subject or header block nats-py cannot read).",
            value=refused,
        )
        reconnects = CounterMetricFamily(
            "reach_nats_reconnects",
            "Times this hub's NATS connection (main; routes, statuses and agents: callers' "
            "requests, status events and agents' other messages come on ones of their own) or "
            "this agent's came back after it was "
            "lost (a network cut, a NATS server restarted or failed over, a slow consumer cut "
            "off): each loses the answers sent meanwhile, which are asked again.",
            labels=["connection"],
        )
        connected = GaugeMetricFamily(
            "reach_nats_connected",
            "1 while this NATS connection of the hub's (or the agent's) is up, 0 while it "
            "reconnects.",
            labels=["connection"],
        )
        cluster = GaugeMetricFamily(
            "reach_nats_cluster_urls",
            "Client URLs the NATS server this connection is on listed in its last INFO: its "
            "own and those of the servers it has a route to (one each, unless a server "
            "advertises several). One fewer when a node of the cluster is lost or cut off "
            "(alert ReachNatsNodeLost); not exported while unknown (a server alone).",
            labels=["connection"],
        )
        for name, (count, up, listed) in named.items():
            reconnects.add_metric([name], count)
            connected.add_metric([name], 1 if up else 0)
            if listed is not None:
                cluster.add_metric([name], listed)
        yield reconnects
        yield connected
        yield cluster


#: What ``together_metrics`` reads when scraped: the server each of a hub's connections is on
#: (None while it reconnects), whether those up are on more than one, and the moves made per
#: connection to join the main one's server.
TogetherCounts = tuple[Mapping[str, str | None], bool, Mapping[str, int]]


def together_metrics(registry: CollectorRegistry, read: Callable[[], TogetherCounts]) -> None:
    """Export ``reach_nats_server`` (by ``connection`` and ``server``), ``reach_nats_split``
    and ``reach_nats_moves_total`` (by ``connection``) into ``registry``, from what ``read``
    returns when scraped (``_nats_together.Together``)."""
    registry.register(_Together(read))


class _Together(Collector):
    def __init__(self, read: Callable[[], TogetherCounts]) -> None:
        self._read = read

    def collect(self) -> Iterator[Metric]:
        servers, split, moves = self._read()
        on = GaugeMetricFamily(
            "reach_nats_server",
            "1 for the NATS server each of this hub's connections is on (server_name), none "
            "while it reconnects: the three belong on one (a partition between servers would "
            "otherwise lose route answers).",
            labels=["connection", "server"],
        )
        for name, server in servers.items():
            if server is not None:
                on.add_metric([name, server], 1)
        yield on
        yield GaugeMetricFamily(
            "reach_nats_split",
            "1 while this hub's NATS connections that are up are on more than one server of "
            "the cluster (one could not reach the main one's server; a move is tried again "
            "every 30 s).",
            value=1 if split else 0,
        )
        moved = CounterMetricFamily(
            "reach_nats_moves",
            "Times this hub moved a NATS connection (routes, statuses, agents) to the main one's "
            "server after it came back on another (each also counts as a reconnection).",
            labels=["connection"],
        )
        for name, count in moves.items():
            moved.add_metric([name], count)
        yield moved


class _StepCounts(Collector):
    """``reach_agent_steps_dropped_total`` (by reason), ``reach_agent_fence_reads_total``,
    ``reach_agent_fence_markers_total``, ``reach_agent_leader_reads_total`` (by outcome) and
    ``reach_agent_work_batches_put_back_total``."""

    def __init__(self, read: Callable[[], dict[str, int]]) -> None:
        self._read = read

    def collect(self) -> Iterator[Metric]:
        counts = self._read()
        dropped = CounterMetricFamily(
            "reach_agent_steps_dropped",
            "Workflow step messages not run: fenced (the hub moved on), duplicate (an attempt "
            "already in hand or finished), cached (answered from a stored result), foreign (its "
            "envelope names another namespace: refused), malformed_line (a work-batch line "
            "that could not be read: refused).",
            labels=["reason"],
        )
        for reason in ("fenced", "duplicate", "cached", "foreign", "malformed_line"):
            dropped.add_metric([reason], counts.get(reason, 0))
        yield dropped
        yield CounterMetricFamily(
            "reach_agent_fence_reads",
            "Task records read before running a step: only where the stream cannot tell (a "
            "redelivery, messages queued behind it that did not all arrive in time, an agent "
            "out of touch with the hubs or whose event loop stalled).",
            value=counts.get("fence_reads", 0),
        )
        yield CounterMetricFamily(
            "reach_agent_fence_markers",
            "Fence markers received: a hub gave up an attempt it had sent this agent.",
            value=counts.get("markers", 0),
        )
        leader = CounterMetricFamily(
            "reach_agent_leader_reads",
            "Wary fence reads whose replica check failed, asked of a hub to read the task "
            "record at its stream's leader (verb record), by outcome: answered (the step went "
            "on from the hub's read), unanswered (no hub answered or none was asked, it "
            "answered an error, or the step is of another namespace: the step waits).",
            labels=["outcome"],
        )
        for outcome in ("answered", "unanswered"):
            leader.add_metric([outcome], counts.get(f"leader_reads_{outcome}", 0))
        yield leader
        yield CounterMetricFamily(
            "reach_agent_work_batches_put_back",
            "Work batches given back unrun (nak'd) because their steps would have taken the "
            "agent past max_concurrency + max_queue: redelivered once a held step ends.",
            value=counts.get("batches_put_back", 0),
        )


async def serve_metrics(
    render: Callable[[], bytes],
    host: str = "127.0.0.1",
    port: int = 0,
    health: Callable[[], tuple[bool, dict[str, Any]]] | None = None,
) -> AsgiServer:
    """Serve ``GET /metrics`` from ``render`` (e.g. ``AgentMetrics().render``) on ``host:port``,
    and with ``health`` ``GET /healthz``: its body as JSON, 200 when it says ready, else 503.

    For processes with nothing else to serve (an agent); the hub has ``/metrics`` on its own
    HTTP app. A Starlette app on uvicorn, on the caller's event loop. Returns the started
    server: ``.port`` tells the port, ``await .close()`` stops it.
    """
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response
    from starlette.routing import Route

    async def metrics(request: Request) -> Response:
        return Response(render(), media_type=CONTENT_TYPE)

    routes = [Route("/metrics", metrics, methods=["GET"])]
    if health is not None:
        said = health

        async def healthz(request: Request) -> Response:
            ready, body = said()
            return JSONResponse(body, 200 if ready else 503)

        routes.append(Route("/healthz", healthz, methods=["GET"]))
    server = AsgiServer(Starlette(routes=routes))
    await server.start(host, port)
    return server
