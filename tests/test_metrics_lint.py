"""/metrics of a real hub and a real agent pass ``promtool check metrics``; the histogram
buckets resolve the latencies the mesh sees (100 µs to 60 s)."""

from __future__ import annotations

import itertools
from typing import Any

import pytest

from reach_mesh import Client, MeshSettings, NoMatchError, Step
from reach_mesh.agent import Agent, Task
from reach_mesh.hub import Hub
from reach_mesh.tracing.metrics import (
    DECISION_BUCKETS,
    DURATION_BUCKETS,
    LATENCY_BUCKETS,
    HubMetrics,
)

from .helpers import fetch
from .test_deploy import needs_promtool, promtool


def test_buckets_resolve_100_microseconds_to_60_seconds() -> None:
    for buckets in (LATENCY_BUCKETS, DURATION_BUCKETS):
        assert buckets[0] == pytest.approx(0.0001)
        assert 60.0 in buckets
        assert list(buckets) == sorted(set(buckets))
        upto_60 = [b for b in buckets if b <= 60.0]
        # Neighbouring bounds at most 1.67x apart: a quantile interpolated in a bucket is off
        # by a third at most (the seed's 0.25/0.5 bounds made a 0.3 s handler's p50 0.375 s).
        worst = max(b / a for a, b in itertools.pairwise(upto_60))
        assert worst <= 1.67
    assert DURATION_BUCKETS[-1] == 7200.0  # the default task TTL


def test_route_decisions_are_resolved_from_a_microsecond() -> None:
    """A decision takes about ten µs: its buckets start at 1 µs, five per decade."""
    assert DECISION_BUCKETS[0] == pytest.approx(0.000001)
    assert DECISION_BUCKETS[-1] == 1.0
    assert sum(1 for b in DECISION_BUCKETS if 0.00001 <= b < 0.0001) == 5
    family = next(
        f for f in HubMetrics().registry.collect() if f.name == "reach_route_duration_seconds"
    )
    bounds = {s.labels["le"] for s in family.samples if s.name.endswith("_bucket")}
    assert "1e-06" in bounds or "1.0e-06" in bounds, bounds


def test_no_gauge_is_named_like_a_counter_or_histogram_series() -> None:
    for family in HubMetrics().registry.collect():
        if family.type == "gauge":
            assert not family.name.endswith(("_count", "_total", "_sum", "_bucket")), family.name


async def _scrape_after_traffic(settings: MeshSettings, namespace: str) -> tuple[bytes, bytes]:
    agent = Agent(f"{namespace}.lint.a1", settings=settings, metrics_port=0)

    @agent.handler("lint:ok:v1")
    async def ok(task: Task[dict[str, Any]]) -> dict[str, Any]:
        return {"ok": True}

    @agent.handler("lint:fail:v1")
    async def fail(task: Task[dict[str, Any]]) -> None:
        raise RuntimeError("boom")

    hub_settings = settings.model_copy(update={"http_port": 0})
    async with Hub(settings=hub_settings) as hub, agent, Client(settings=settings) as mesh:
        await mesh.request(capability="lint:ok:v1", payload={})
        await mesh.request(capability="lint:fail:v1", payload={})
        with pytest.raises(NoMatchError):
            await mesh.request(capability="lint:none:v1", payload={})
        await mesh.chain([Step(capability="lint:ok:v1"), Step(capability="lint:ok:v1")])
        assert hub.http_url is not None and agent.metrics_url is not None
        status, hub_text = await fetch(f"{hub.http_url}/metrics")
        assert status == 200
        status, agent_text = await fetch(agent.metrics_url)
        assert status == 200
    return hub_text, agent_text


@needs_promtool
async def test_promtool_check_metrics_on_hub_and_agent(
    wf_settings: MeshSettings, namespace: str
) -> None:
    hub_text, agent_text = await _scrape_after_traffic(wf_settings, namespace)
    # Every kind of series is there: counters, gauges, histograms with labels.
    assert b"reach_task_total{" in hub_text and b"reach_pending_tasks " in hub_text
    assert b"reach_preonline_agents " in hub_text
    assert b"reach_agent_handler_duration_seconds_bucket{" in agent_text
    for text in (hub_text, agent_text):
        out = promtool("check", "metrics", stdin=text)
        assert out.returncode == 0, out.stdout + out.stderr


def test_counters_alerts_watch_with_increase_are_exported_at_zero() -> None:
    """A labelled series Prometheus first sees at 1 has no increase: the counters an alert
    watches with ``increase`` or ``rate`` on one label (ReachWorkflowSubmissionsForgotten,
    ReachWorkflowErrors) are exported at 0 by a hub that never counted one."""
    text = HubMetrics().render().decode()
    for series in (
        'reach_workflow_orphans_total{action="adopted"} 0.0',
        'reach_workflow_orphans_total{action="deleted"} 0.0',
        'reach_workflow_interrupted_total{cause="error"} 0.0',
        'reach_workflow_interrupted_total{cause="infrastructure"} 0.0',
    ):
        assert series in text
