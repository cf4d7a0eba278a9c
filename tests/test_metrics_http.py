"""Prometheus metrics and the agent's /metrics endpoint."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from reach_mesh.tracing.metrics import AgentMetrics, HubMetrics, serve_metrics

from .helpers import fetch


def _samples(text: bytes) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text.decode())
        for sample in family.samples
    }


# -- metrics -------------------------------------------------------------------------------


def test_hub_metrics_render_and_count() -> None:
    metrics = HubMetrics()
    for _ in range(3):
        metrics.task_total.labels("finance", "proxy", "SUCCEEDED").inc()
    metrics.task_total.labels("finance", "direct", "FAILED").inc()
    metrics.route_duration_seconds.observe(0.0004)
    metrics.delivered_to_accepted_seconds.observe(0.02)
    metrics.task_duration_seconds.labels("email:send:v1").observe(1.5)
    metrics.pending_tasks.set(7)
    metrics.agents.labels("finance", "ONLINE").set(4)
    metrics.agents.labels("finance", "SUSPECT").set(1)
    metrics.preonline_agents.set(2)
    metrics.throttled_total.labels("finance").inc(5)
    metrics.quarantine_total.inc()
    metrics.duplicate_delivery_total.inc()
    metrics.retry_total.inc(2)
    metrics.heartbeat_total.inc(10)
    metrics.workflow_total.labels("finance", "fanout", "SUCCEEDED").inc()
    metrics.workflow_cancelled_total.labels("finance").inc()
    metrics.workflow_duration_seconds.labels("chain").observe(12.0)

    samples = _samples(metrics.render())
    labels = (("mode", "proxy"), ("namespace", "finance"), ("state", "SUCCEEDED"))
    assert samples[("reach_task_total", labels)] == 3
    failed = (("mode", "direct"), ("namespace", "finance"), ("state", "FAILED"))
    assert samples[("reach_task_total", failed)] == 1
    assert samples[("reach_route_duration_seconds_count", ())] == 1
    assert samples[("reach_route_duration_seconds_bucket", (("le", "0.0004"),))] == 1
    assert samples[("reach_route_duration_seconds_bucket", (("le", "0.00025"),))] == 0
    assert samples[("reach_delivered_to_accepted_seconds_sum", ())] == pytest.approx(0.02)
    cap = (("capability", "email:send:v1"),)
    assert samples[("reach_task_duration_seconds_count", cap)] == 1
    assert samples[("reach_pending_tasks", ())] == 7
    assert samples[("reach_agents", (("namespace", "finance"), ("state", "ONLINE")))] == 4
    assert samples[("reach_preonline_agents", ())] == 2
    assert samples[("reach_throttled_total", (("namespace", "finance"),))] == 5
    assert samples[("reach_quarantine_total", ())] == 1
    assert samples[("reach_duplicate_delivery_total", ())] == 1
    assert samples[("reach_retry_total", ())] == 2
    assert samples[("reach_heartbeat_total", ())] == 10
    done = (("kind", "fanout"), ("namespace", "finance"), ("state", "SUCCEEDED"))
    assert samples[("reach_workflow_total", done)] == 1
    assert samples[("reach_workflow_cancelled_total", (("namespace", "finance"),))] == 1
    assert samples[("reach_workflow_duration_seconds_count", (("kind", "chain"),))] == 1


def test_workflow_done_counts_across_a_forgotten_namespace() -> None:
    """``workflow_done`` keeps its series; forgetting a namespace drops them with it, and the
    next workflow of that namespace counts from 1 again (exported, not on a stale series)."""
    metrics = HubMetrics()
    for _ in range(2):
        metrics.workflow_done("finance", "fanout", "SUCCEEDED", 0.5)
    metrics.workflow_done("ops", "chain", "FAILED", 2.0)
    done = (("kind", "fanout"), ("namespace", "finance"), ("state", "SUCCEEDED"))
    samples = _samples(metrics.render())
    assert samples[("reach_workflow_total", done)] == 2
    assert samples[("reach_workflow_duration_seconds_count", (("kind", "fanout"),))] == 2
    assert samples[("reach_workflow_duration_seconds_sum", (("kind", "chain"),))] == 2.0
    metrics.forget_namespace("finance")
    assert ("reach_workflow_total", done) not in _samples(metrics.render())
    metrics.workflow_done("finance", "fanout", "SUCCEEDED", 0.5)
    samples = _samples(metrics.render())
    assert samples[("reach_workflow_total", done)] == 1
    assert samples[("reach_workflow_duration_seconds_count", (("kind", "fanout"),))] == 3
    failed = (("kind", "chain"), ("namespace", "ops"), ("state", "FAILED"))
    assert samples[("reach_workflow_total", failed)] == 1


def test_hubs_in_one_process_do_not_share_metrics() -> None:
    first, second = HubMetrics(), HubMetrics()
    first.retry_total.inc()
    assert _samples(first.render())[("reach_retry_total", ())] == 1
    assert _samples(second.render())[("reach_retry_total", ())] == 0


def test_agent_metrics_render() -> None:
    metrics = AgentMetrics()
    metrics.inflight.inc()
    metrics.handled_total.labels("data:query:v1", "SUCCEEDED").inc()
    metrics.failures_total.labels("data:query:v1", "REACH_HANDLER_FAILED").inc()
    metrics.handler_duration_seconds.labels("data:query:v1").observe(0.3)
    samples = _samples(metrics.render())
    assert samples[("reach_agent_inflight", ())] == 1
    handled = (("capability", "data:query:v1"), ("state", "SUCCEEDED"))
    assert samples[("reach_agent_handled_total", handled)] == 1
    cap = (("capability", "data:query:v1"),)
    assert samples[("reach_agent_handler_duration_seconds_count", cap)] == 1


# -- the agent's /metrics endpoint ---------------------------------------------------------


async def test_serve_metrics() -> None:
    """An agent's /metrics: Starlette on uvicorn, on this event loop; close() is idempotent."""
    metrics = AgentMetrics()
    metrics.inflight.set(3)
    http = await serve_metrics(metrics.render, "127.0.0.1", 0)
    try:
        status, body = await fetch(f"http://127.0.0.1:{http.port}/metrics")
        assert status == 200
        assert b"reach_agent_inflight 3.0" in body
        assert _samples(body)[("reach_agent_inflight", ())] == 3.0
        status, _ = await fetch(f"http://127.0.0.1:{http.port}/other")
        assert status == 404
    finally:
        await http.close()
    await http.close()
    with pytest.raises(OSError):
        await fetch(f"http://127.0.0.1:{http.port}/metrics")


def test_loop_histogram_renders_as_prometheus_client_histogram() -> None:
    from prometheus_client import CollectorRegistry, Histogram, generate_latest

    from reach_mesh.tracing.metrics import LATENCY_BUCKETS, LoopHistogram

    ours, theirs = CollectorRegistry(), CollectorRegistry()
    mine = LoopHistogram("x_seconds", "doc", ["cap"], buckets=LATENCY_BUCKETS, registry=ours)
    ref = Histogram("x_seconds", "doc", ["cap"], buckets=LATENCY_BUCKETS, registry=theirs)
    # On a bound, between bounds, below the first, past the last (+Inf), and 0.
    for value in (0.0005, 0.0004, 0.00001, 7.0, 0.0, 2.5, 0.3):
        for cap in ("a", "b:c"):
            mine.labels(cap).observe(value)
            ref.labels(cap).observe(value)

    def lines(registry: CollectorRegistry) -> list[str]:
        text = generate_latest(registry).decode()
        return sorted(line for line in text.splitlines() if "_created" not in line)

    assert lines(ours) == lines(theirs)


async def test_keep_alive_answers_without_delayed_ack_stalls() -> None:
    """Answers on a kept-alive connection go out at once (TCP_NODELAY on the accepted socket):
    without it each response's second write waits ~40 ms for the client's delayed ACK."""
    import asyncio
    import time

    http = await serve_metrics(AgentMetrics().render, "127.0.0.1", 0)
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", http.port)
        started = time.perf_counter()
        for _ in range(20):
            writer.write(b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            await writer.drain()
            head = await reader.readuntil(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 200")
            length = next(
                int(line.split(b":")[1])
                for line in head.split(b"\r\n")
                if line.lower().startswith(b"content-length")
            )
            await reader.readexactly(length)
        elapsed = time.perf_counter() - started
        writer.close()
        assert elapsed < 0.4, f"20 keep-alive requests took {elapsed:.3f}s"
    finally:
        await http.close()
