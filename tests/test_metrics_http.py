"""Prometheus metrics and the small asyncio HTTP server."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import pytest
from prometheus_client.parser import text_string_to_metric_families

from reach_mesh._http import HttpError, HttpRequest, HttpResponse, HttpServer
from reach_mesh.tracing.metrics import (
    CONTENT_TYPE,
    AgentMetrics,
    HubMetrics,
    metrics_handler,
    serve_metrics,
)


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
    metrics.workflow_total.labels("fanout", "SUCCEEDED").inc()
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
    assert samples[("reach_workflow_total", (("kind", "fanout"), ("state", "SUCCEEDED")))] == 1
    assert samples[("reach_workflow_duration_seconds_count", (("kind", "chain"),))] == 1


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


# -- http server ---------------------------------------------------------------------------


async def _exchange(port: int, data: bytes, *, close_write: bool = True) -> bytes:
    """Send raw bytes, then read the whole response (the server closes the connection)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(data)
        await writer.drain()
        if close_write:
            writer.write_eof()
        return await asyncio.wait_for(reader.read(), timeout=5)
    finally:
        writer.close()


def _status(response: bytes) -> int:
    return int(response.split(b" ", 2)[1])


def _body(response: bytes) -> bytes:
    return response.partition(b"\r\n\r\n")[2]


async def _echo(request: HttpRequest) -> HttpResponse:
    return HttpResponse.json(
        {
            "method": request.method,
            "path": request.path,
            "params": dict(request.path_params),
            "q": request.query_value("q"),
            "all": request.query.get("tag", []),
            "body": request.json() if request.body else None,
        }
    )


async def _boom(request: HttpRequest) -> HttpResponse:
    raise RuntimeError("handler bug")


async def _conflict(request: HttpRequest) -> HttpResponse:
    raise HttpError(409, "already cordoned")


async def _bad_header(request: HttpRequest) -> HttpResponse:
    return HttpResponse.text("x", headers={"X-Evil": "a\r\nSet-Cookie: b"})


@pytest.fixture
async def server() -> AsyncIterator[HttpServer]:
    metrics = HubMetrics()
    metrics.task_total.labels("ns", "proxy", "SUCCEEDED").inc()
    http = HttpServer(max_body_size=1024, max_header_size=2048, read_timeout=0.5)
    http.route("GET", "/metrics", metrics_handler(metrics.render))
    http.route("POST", "/v1/agents/{agent_id}/cordon", _echo)
    http.route("GET", "/v1/agents/{agent_id}", _echo)
    http.route("GET", "/boom", _boom)
    http.route("GET", "/conflict", _conflict)
    http.route("GET", "/bad-header", _bad_header)
    await http.start("127.0.0.1", 0)
    yield http
    await http.close()


async def test_get_metrics(server: HttpServer) -> None:
    response = await _exchange(server.port, b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
    assert _status(response) == 200
    assert f"Content-Type: {CONTENT_TYPE}".encode() in response
    assert b"Connection: close" in response
    assert any(name == "reach_task_total" for name, _ in _samples(_body(response)))


async def test_unknown_path_and_wrong_method(server: HttpServer) -> None:
    assert _status(await _exchange(server.port, b"GET /nope HTTP/1.1\r\n\r\n")) == 404
    response = await _exchange(server.port, b"DELETE /metrics HTTP/1.1\r\n\r\n")
    assert _status(response) == 405
    assert b"Allow: GET" in response


async def test_head_has_no_body(server: HttpServer) -> None:
    response = await _exchange(server.port, b"HEAD /metrics HTTP/1.1\r\n\r\n")
    assert _status(response) == 200
    assert _body(response) == b""


async def test_path_params_query_and_json(server: HttpServer) -> None:
    payload = json.dumps({"reason": "maintenance"}).encode()
    request = (
        b"POST /v1/agents/fin.q%2Fx.a1/cordon?q=1&tag=a&tag=b&empty= HTTP/1.1\r\n"
        b"Content-Type: application/json\r\n"
        b"Content-Length: " + str(len(payload)).encode() + b"\r\n\r\n" + payload
    )
    response = await _exchange(server.port, request)
    assert _status(response) == 200
    assert json.loads(_body(response)) == {
        "method": "POST",
        "path": "/v1/agents/fin.q/x.a1/cordon",
        "params": {"agent_id": "fin.q/x.a1"},
        "q": "1",
        "all": ["a", "b"],
        "body": {"reason": "maintenance"},
    }


async def test_malformed_json_body_is_400(server: HttpServer) -> None:
    request = b"POST /v1/agents/a/cordon HTTP/1.1\r\nContent-Length: 3\r\n\r\n{x]"
    assert _status(await _exchange(server.port, request)) == 400


@pytest.mark.parametrize(
    "raw",
    [
        b"NONSENSE\r\n\r\n",
        b"GET /metrics\r\n\r\n",
        b"GET metrics HTTP/1.1\r\n\r\n",
        b"GET /metrics HTTP/x\r\n\r\n",
        b"GET /metrics HTTP/1.1\r\nno colon here\r\n\r\n",
        b"GET /metrics HTTP/1.1\r\nBad Name: x\r\n\r\n",
        b"GET /metrics HTTP/1.1\r\nContent-Length: -1\r\n\r\n",
        b"GET /metrics HTTP/1.1\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n",
        b"GET /%ff HTTP/1.1\r\n\r\n",
        b"\x00\xff\xfe garbage \x80\r\n\r\n",
        b"GET /metrics HTTP/1.1\r\nHost: x\r\n",  # head never finished
    ],
)
async def test_malformed_requests_get_400_and_the_server_keeps_serving(
    server: HttpServer, raw: bytes
) -> None:
    assert _status(await _exchange(server.port, raw)) == 400
    assert _status(await _exchange(server.port, b"GET /metrics HTTP/1.1\r\n\r\n")) == 200


async def test_other_protocol_errors(server: HttpServer) -> None:
    assert _status(await _exchange(server.port, b"GET /metrics HTTP/2.0\r\n\r\n")) == 505
    chunked = b"POST /v1/agents/a/cordon HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n"
    assert _status(await _exchange(server.port, chunked)) == 501
    huge_head = b"GET /metrics HTTP/1.1\r\nX-Pad: " + b"a" * 4096 + b"\r\n\r\n"
    assert _status(await _exchange(server.port, huge_head)) == 431


async def test_oversized_body_is_413(server: HttpServer) -> None:
    request = b"POST /v1/agents/a/cordon HTTP/1.1\r\nContent-Length: 5000\r\n\r\n" + b"x" * 5000
    response = await _exchange(server.port, request)
    assert _status(response) == 413
    assert _status(await _exchange(server.port, b"GET /metrics HTTP/1.1\r\n\r\n")) == 200


async def test_slow_client_gets_408(server: HttpServer) -> None:
    response = await _exchange(server.port, b"GET /metrics HTTP/1.1\r\n", close_write=False)
    assert _status(response) == 408


async def test_handler_errors(server: HttpServer) -> None:
    assert _status(await _exchange(server.port, b"GET /boom HTTP/1.1\r\n\r\n")) == 500
    response = await _exchange(server.port, b"GET /conflict HTTP/1.1\r\n\r\n")
    assert _status(response) == 409
    assert b"already cordoned" in _body(response)
    response = await _exchange(server.port, b"GET /bad-header HTTP/1.1\r\n\r\n")
    assert _status(response) == 500
    assert b"Set-Cookie" not in response


async def test_empty_connection_is_ignored(server: HttpServer) -> None:
    assert await _exchange(server.port, b"") == b""
    assert _status(await _exchange(server.port, b"GET /metrics HTTP/1.1\r\n\r\n")) == 200


async def test_close_cuts_idle_connections_and_is_idempotent() -> None:
    http = HttpServer(read_timeout=30)
    await http.start()
    reader, writer = await asyncio.open_connection("127.0.0.1", http.port)
    writer.write(b"GET /metrics HTTP/1.1\r\n")  # never finishes the request
    await writer.drain()
    await asyncio.sleep(0.01)
    await asyncio.wait_for(http.close(), timeout=2)
    await http.close()
    assert await asyncio.wait_for(reader.read(), timeout=2) == b""
    writer.close()


def test_route_validation() -> None:
    http = HttpServer()
    http.route("GET", "/a/{x}", _echo)
    with pytest.raises(ValueError, match="already registered"):
        http.route("get", "/a/{x}", _echo)
    with pytest.raises(ValueError, match="must start"):
        http.route("GET", "a", _echo)


async def test_serve_metrics() -> None:
    metrics = AgentMetrics()
    metrics.inflight.set(3)
    http = await serve_metrics(metrics.render, "127.0.0.1", 0)
    try:
        response = await _exchange(http.port, b"GET /metrics HTTP/1.0\r\n\r\n")
        assert _status(response) == 200
        assert b"reach_agent_inflight 3.0" in _body(response)
    finally:
        await http.close()


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
