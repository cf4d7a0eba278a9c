"""Complete traces: caller → hub → agent (→ the next step of a chain), no missing parent.

Two tests on a real nats-server. In one process with the SDK's in-memory exporter: parents,
span kinds, the ACK states as events, ERROR on a failing handler. Across processes — a hub, two
agents and a caller, each exporting OTLP/HTTP to a receiver in this test that decodes the
protobuf — the same trace with a distinct ``service.name`` per process, set up by the SDK
objects from the OpenTelemetry environment alone.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, cast

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode
from opentelemetry.util._once import Once

import reach_mesh.tracing._setup as tracing_setup
from reach_mesh import Client, MeshSettings, Step
from reach_mesh.agent import Agent
from reach_mesh.hub import Hub
from reach_mesh.models import TaskState
from reach_mesh.server import EmbeddedNats
from reach_mesh.tracing import memory_exporter, tracing_from_env

from .trace_processes import alpha, beta

ROOT = Path(__file__).resolve().parent.parent
ACK_EVENTS = ["DELIVERED", "ACCEPTED", "RUNNING"]


@pytest.fixture
def no_provider(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """No global tracer provider for the test (OpenTelemetry's own test utilities reset the
    set-once guard the same way), and the old one back afterwards."""
    for name in ("OTEL_TRACES_EXPORTER", "OTEL_SERVICE_NAME", "OTEL_SDK_DISABLED"):
        monkeypatch.delenv(name, raising=False)
    saved = (trace._TRACER_PROVIDER, trace._TRACER_PROVIDER_SET_ONCE)
    trace._TRACER_PROVIDER = None
    trace._TRACER_PROVIDER_SET_ONCE = Once()
    monkeypatch.setattr(tracing_setup, "_from_env", None)
    monkeypatch.setattr(tracing_setup, "_env_refused", None)
    try:
        yield
    finally:
        provider = trace._TRACER_PROVIDER
        if isinstance(provider, TracerProvider):
            provider.shutdown()
        trace._TRACER_PROVIDER, trace._TRACER_PROVIDER_SET_ONCE = saved


@pytest.fixture
def exporter(no_provider: None) -> InMemorySpanExporter:
    span_exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(span_exporter))
    trace.set_tracer_provider(provider)
    return span_exporter


def two_agents(settings: MeshSettings, namespace: str) -> tuple[Agent, Agent]:
    return alpha(namespace, settings), beta(namespace, settings)


def _one(spans: list[ReadableSpan], name: str, kind: SpanKind) -> ReadableSpan:
    (found,) = [s for s in spans if s.name == name and s.kind is kind]
    return found


def _parent_of(s: ReadableSpan, spans: list[ReadableSpan]) -> ReadableSpan:
    assert s.parent is not None, f"{s.name} has no parent"
    (found,) = [p for p in spans if p.context.span_id == s.parent.span_id]
    return found


async def test_in_process_trace_parents_events_and_status(
    exporter: InMemorySpanExporter, hub: Hub, settings: MeshSettings, namespace: str
) -> None:
    alpha, beta = two_agents(settings, namespace)
    async with alpha, beta, Client(settings=settings) as mesh:
        routed = await mesh.request(capability="trace:first:v1", payload={"n": 1})
        chain = await mesh.chain(
            [
                Step(capability="trace:first:v1", payload={"n": 2}),
                Step(capability="trace:second:v1"),
            ],
            timeout=20,
        )
        failed = await mesh.request(capability="trace:fail:v1", payload={"n": 3})
        invalid = await mesh.request(capability="trace:fail:v1", payload={"n": "three"})
    assert routed.ok and chain.ok
    assert failed.state is TaskState.FAILED and invalid.state is TaskState.FAILED
    finished = list(exporter.get_finished_spans())

    def of(trace_id: str | None) -> list[ReadableSpan]:
        return [s for s in finished if f"{s.context.trace_id:032x}" == trace_id]

    # A routed request: caller (root) → hub route → hub deliver → agent handle.
    spans = of(routed.trace_id)
    caller = _one(spans, "reach.route", SpanKind.CLIENT)
    assert caller.parent is None  # the caller's span is the root: nothing is missing above it
    server = _one(spans, "reach.route", SpanKind.SERVER)
    deliver = _one(spans, "reach.deliver", SpanKind.CLIENT)
    handle = _one(spans, "reach.handle", SpanKind.CONSUMER)
    assert _parent_of(server, spans) is caller
    assert _parent_of(deliver, spans) is server
    assert _parent_of(handle, spans) is deliver
    assert [e.name for e in handle.events] == [*ACK_EVENTS, "SUCCEEDED"]
    assert handle.status.status_code is StatusCode.UNSET
    assert (caller.attributes or {})["reach.agent_id"] == alpha.agent_id
    assert (caller.attributes or {})["reach.state"] == "SUCCEEDED"

    # A chain: caller workflow (root) → hub workflow → step → agent, and the second step, on
    # the other agent, in the same trace under the same hub workflow span.
    spans = of(chain.trace_id)
    submit = _one(spans, "reach.workflow", SpanKind.CLIENT)
    assert submit.parent is None
    owner = _one(spans, "reach.workflow", SpanKind.INTERNAL)
    assert _parent_of(owner, spans) is submit
    handles = sorted(
        (s for s in spans if s.name == "reach.handle"), key=lambda s: s.start_time or 0
    )
    assert len(handles) == 2
    for handled in handles:
        step = _parent_of(handled, spans)
        assert step.name == "reach.step" and _parent_of(step, spans) is owner
        assert [e.name for e in handled.events] == [*ACK_EVENTS, "SUCCEEDED"]
    steps = [_parent_of(h, spans) for h in handles]
    assert [(s.attributes or {})["reach.step"] for s in steps] == [0, 1]
    for step in steps:  # the hub's ACK machine of the attempt, as events of the step's span
        moves = [(e.name, dict(e.attributes or {})) for e in step.events]
        assert moves[0] == ("DELIVERED", {"reach.attempt": 1, "reach.from": "PENDING"}), moves
        assert moves[-1][0] == "SUCCEEDED" and moves[-1][1]["reach.attempt"] == 1, moves
    for s in spans:  # no span of the trace points at a parent that was not recorded
        if s is not submit:
            _parent_of(s, spans)

    # A handler that raised TaskFailed, and a payload that failed validation: ERROR, with an
    # exception event and the final state as the last event; the caller's span says so too.
    for result, exception in ((failed, "TaskFailed"), (invalid, "ValidationError")):
        spans = of(result.trace_id)
        handle = _one(spans, "reach.handle", SpanKind.CONSUMER)
        assert handle.status.status_code is StatusCode.ERROR
        assert handle.status.description is not None
        assert handle.status.description.startswith(result.error.code if result.error else "?")
        names = [e.name for e in handle.events]
        assert names[0] == "DELIVERED" and names[-1] == "FAILED" and "exception" in names
        (exc,) = [e for e in handle.events if e.name == "exception"]
        # OpenTelemetry's record_exception writes the exception's type name: a str.
        assert cast(str, (exc.attributes or {})["exception.type"]).endswith(exception)
        caller = _one(spans, "reach.route", SpanKind.CLIENT)
        assert caller.parent is None and caller.status.status_code is StatusCode.ERROR
        server = _one(spans, "reach.route", SpanKind.SERVER)
        assert (server.attributes or {})["reach.state"] == "FAILED"


async def test_sdk_objects_honour_the_environment_without_clobbering(
    no_provider: None, monkeypatch: pytest.MonkeyPatch, settings: MeshSettings, namespace: str
) -> None:
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "memory")
    alpha, _ = two_agents(settings, namespace)
    async with Hub(settings=settings), alpha, Client(settings=settings) as mesh:
        installed = trace.get_tracer_provider()
        assert isinstance(installed, TracerProvider)
        # The first object to start named the service: the hub.
        assert installed.resource.attributes["service.name"] == "reach-mesh-hub"
        await mesh.request(capability="trace:first:v1", payload={})
        tracing_from_env("other")  # idempotent: the provider in place stays
        assert trace.get_tracer_provider() is installed
    spans = memory_exporter()
    assert spans is not None
    assert {s.name for s in spans.get_finished_spans()} >= {"reach.route", "reach.handle"}


async def test_an_application_provider_is_never_replaced(
    exporter: InMemorySpanExporter, monkeypatch: pytest.MonkeyPatch, settings: MeshSettings
) -> None:
    theirs = trace.get_tracer_provider()
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "console")
    async with Client(settings=settings):
        assert trace.get_tracer_provider() is theirs


def test_a_bad_exporter_setting_is_logged_not_raised(
    no_provider: None, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "jaeger")
    tracing_from_env("svc")
    tracing_from_env("svc")
    assert [r.message for r in caplog.records].count(
        "tracing stays off: unknown trace exporter 'jaeger'; expected one of "
        "['console', 'memory', 'none', 'otlp']"
    ) == 1
    assert isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider)


# -- across processes, over OTLP/HTTP --------------------------------------------------------


class _Receiver(ThreadingHTTPServer):
    """An OTLP/HTTP trace receiver: decodes each export with opentelemetry-proto."""

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.spans: list[tuple[str, Any]] = []  # (service.name, Span protobuf)
        self.lock = threading.Lock()


class _Handler(BaseHTTPRequestHandler):
    server: _Receiver

    def do_POST(self) -> None:
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
            ExportTraceServiceRequest,
            ExportTraceServiceResponse,
        )

        body = self.rfile.read(int(self.headers["Content-Length"]))
        assert self.path == "/v1/traces"
        request = ExportTraceServiceRequest.FromString(body)
        with self.server.lock:
            for resource_spans in request.resource_spans:
                attrs = {a.key: a.value.string_value for a in resource_spans.resource.attributes}
                for scope_spans in resource_spans.scope_spans:
                    for s in scope_spans.spans:
                        self.server.spans.append((attrs["service.name"], s))
        out = ExportTraceServiceResponse().SerializeToString()
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    def log_message(self, format: str, *args: Any) -> None:
        pass


async def test_one_trace_across_processes_with_their_own_service_names() -> None:
    pytest.importorskip("opentelemetry.proto.collector.trace.v1.trace_service_pb2")
    pytest.importorskip("opentelemetry.exporter.otlp.proto.http.trace_exporter")
    receiver = _Receiver()
    threading.Thread(target=receiver.serve_forever, daemon=True).start()
    procs: list[subprocess.Popen[str]] = []
    with EmbeddedNats() as server:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "REACH_"))} | {
            "REACH_NATS_URL": server.url,
            "OTEL_TRACES_EXPORTER": "otlp",
            "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{receiver.server_port}",
            "OTEL_BSP_SCHEDULE_DELAY": "100",
        }

        def start(*args: str) -> subprocess.Popen[str]:
            proc = subprocess.Popen(
                [sys.executable, *args], cwd=ROOT, env=env, text=True, stdout=subprocess.PIPE
            )
            procs.append(proc)
            return proc

        try:
            start("-m", "reach_mesh.cli", "hub")
            start("-m", "tests.trace_processes", "alpha")
            start("-m", "tests.trace_processes", "beta")
            caller = start("-m", "tests.trace_processes", "caller")
            out, _ = await asyncio.to_thread(caller.communicate, timeout=60)
            assert caller.returncode == 0, out
            ids = json.loads(out.strip().splitlines()[-1])
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.terminate()  # SIGTERM: each drains and flushes its spans
            for proc in procs:
                try:
                    await asyncio.to_thread(proc.wait, timeout=20)
                except subprocess.TimeoutExpired:
                    proc.kill()
    receiver.shutdown()
    assert [p.returncode for p in procs] == [0, 0, 0, 0]

    def of(trace_id: str) -> list[tuple[str, Any]]:
        return [(svc, s) for svc, s in receiver.spans if s.trace_id.hex() == trace_id]

    def check(trace_id: str, root_name: str) -> dict[str, list[Any]]:
        spans = of(trace_id)
        by_id = {s.span_id: (svc, s) for svc, s in spans}
        roots = [s for _, s in spans if not s.parent_span_id]
        assert [(r.name, r.kind) for r in roots] == [(root_name, 3)]  # 3: SPAN_KIND_CLIENT
        for _, s in spans:  # every parent was exported by some process
            assert not s.parent_span_id or s.parent_span_id in by_id, s.name
        services: dict[str, list[Any]] = {}
        for svc, s in spans:
            services.setdefault(svc, []).append(s)
        return services

    # caller → hub → agent
    routed_id, state = ids["routed"]
    assert state == "SUCCEEDED"
    services = check(routed_id, "reach.route")
    assert set(services) == {"trace-caller", "reach-mesh-hub", "alpha"}
    (handle,) = services["alpha"]
    deliver = next(s for s in services["reach-mesh-hub"] if s.span_id == handle.parent_span_id)
    assert deliver.name == "reach.deliver"

    # caller → hub workflow → step 1 on alpha, step 2 on beta
    chain_id, state = ids["chain"]
    assert state == "SUCCEEDED"
    services = check(chain_id, "reach.workflow")
    assert set(services) == {"trace-caller", "reach-mesh-hub", "alpha", "beta"}
    hub_spans = {s.span_id: s for s in services["reach-mesh-hub"]}
    for agent in ("alpha", "beta"):
        (handle,) = services[agent]
        assert hub_spans[handle.parent_span_id].name == "reach.step"

    # The failing handler's span is ERROR (2: STATUS_CODE_ERROR) with an exception event.
    failed_id, state = ids["failed"]
    assert state == "FAILED"
    services = check(failed_id, "reach.route")
    (handle,) = services["beta"]
    assert handle.status.code == 2
    assert "exception" in [e.name for e in handle.events]
