"""Trace context over NATS headers, span helpers and tracing setup."""

from __future__ import annotations

import importlib
import inspect
import re
from collections.abc import Iterator
from typing import Any

import pytest
from opentelemetry import propagate, trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode
from opentelemetry.util._once import Once

import reach_mesh.tracing as tracing
from reach_mesh.tracing import (
    SPAN_DELIVER,
    SPAN_HANDLE,
    SPAN_ROUTE,
    SpanKind,
    configure_tracing,
    current_trace_id,
    extract,
    inject,
    memory_exporter,
    span,
    trace_id_from_headers,
    tracing_enabled,
)

TRACEPARENT_RE = re.compile(r"00-([0-9a-f]{32})-([0-9a-f]{16})-01")
_OTEL_ENV = (
    "OTEL_TRACES_EXPORTER",
    "OTEL_SERVICE_NAME",
    "OTEL_SDK_DISABLED",
    "OTEL_EXPORTER_OTLP_PROTOCOL",
    "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
    "OTEL_PYTHON_TRACER_PROVIDER",
)


@pytest.fixture(autouse=True)
def unset_global_provider(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Give each test a process with no global tracer provider, then put the old one back.

    OpenTelemetry lets the global provider be set once per process; resetting its private
    set-once guard is what OpenTelemetry's own test utilities (``reset_trace_globals``) do.
    """
    for name in _OTEL_ENV:
        monkeypatch.delenv(name, raising=False)
    saved = (trace._TRACER_PROVIDER, trace._TRACER_PROVIDER_SET_ONCE)
    trace._TRACER_PROVIDER = None
    trace._TRACER_PROVIDER_SET_ONCE = Once()
    try:
        yield
    finally:
        trace._TRACER_PROVIDER, trace._TRACER_PROVIDER_SET_ONCE = saved


@pytest.fixture
def exporter() -> Iterator[InMemorySpanExporter]:
    """An SDK provider installed globally, exporting synchronously to memory."""
    span_exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(span_exporter))
    trace.set_tracer_provider(provider)
    yield span_exporter
    provider.shutdown()


def _by_name(spans: tuple[ReadableSpan, ...], name: str) -> ReadableSpan:
    (found,) = [s for s in spans if s.name == name]
    return found


def _parent_span_id(s: ReadableSpan) -> int:
    assert s.parent is not None
    return s.parent.span_id


# -- package surface -------------------------------------------------------------------------


def test_all_matches_public_names() -> None:
    public = {
        name
        for name, value in vars(tracing).items()
        if not name.startswith("_") and not inspect.ismodule(value) and name != "annotations"
    }
    assert set(tracing.__all__) == public


# -- headers, tracing off --------------------------------------------------------------------


def test_inject_without_context_starts_a_trace() -> None:
    assert not tracing_enabled()
    first, second = inject(), inject()
    match = TRACEPARENT_RE.fullmatch(first["traceparent"])
    assert match is not None
    assert trace_id_from_headers(first) == match.group(1)
    # Outside any span each call starts its own trace.
    assert trace_id_from_headers(first) != trace_id_from_headers(second)
    assert current_trace_id() is None


def test_inject_updates_and_returns_the_given_dict() -> None:
    headers = {"Nats-Msg-Id": "x", "tracestate": "stale=1"}
    assert inject(headers) is headers
    assert headers["Nats-Msg-Id"] == "x"
    assert "tracestate" not in headers  # belonged to no trace we carry on


def test_inject_keeps_a_valid_traceparent_when_there_is_no_span() -> None:
    received = {"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}
    forwarded = inject(dict(received))
    assert forwarded == received
    broken = inject({"traceparent": "00-zz-yy-01"})
    assert TRACEPARENT_RE.fullmatch(broken["traceparent"])
    padded = inject({"traceparent": f" {received['traceparent']}\t"})
    assert padded == received  # kept, without what was around it


_TID = "0af7651916cd43dd8448eb211c80319c"
_SID = "b7ad6b7169203331"


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (f"00-{_TID}-{_SID}-01", _TID),
        (f" 00-{_TID}-{_SID}-00 ", _TID),
        (f"01-{_TID}-{_SID}-01-future", _TID),  # a later version may add fields
        # ... but no whitespace in them, nor around the value but spaces and tabs: a kept
        # traceparent goes on a batch line, whose fields are separated by spaces and newlines.
        (f"01-{_TID}-{_SID}-01-x y", None),
        (f"01-{_TID}-{_SID}-01-x\ty", None),
        (f"00-{_TID}-{_SID}-01\n", None),
        (f"01-{_TID}-{_SID}-01-\u00e9", None),
        (f"00-{_TID}-{_SID}-01-extra", None),
        (f"ff-{_TID}-{_SID}-01", None),
        (f"00-{'0' * 32}-{_SID}-01", None),
        (f"00-{_TID}-{'0' * 16}-01", None),
        (f"00-{_TID.upper()}-{_SID}-01", None),
        (f"00-{_TID[:-2]}-{_SID}-01", None),
        ("", None),
    ],
)
def test_trace_id_from_headers(value: str, expected: str | None) -> None:
    assert trace_id_from_headers({"traceparent": value}) == expected


def test_trace_id_from_missing_headers() -> None:
    assert trace_id_from_headers(None) is None
    assert trace_id_from_headers({}) is None
    assert trace_id_from_headers({"other": "x"}) is None


def test_extract_round_trip() -> None:
    headers = inject()
    context = extract(headers)
    span_context = trace.get_current_span(context).get_span_context()
    assert span_context.is_valid and span_context.is_remote
    assert f"{span_context.trace_id:032x}" == trace_id_from_headers(headers)
    assert not trace.get_current_span(extract(None)).get_span_context().is_valid


def test_three_hops_carry_one_trace_id_with_tracing_off() -> None:
    # Caller: opens a span with no parent; both of its messages carry the same new trace.
    with span(SPAN_ROUTE, kind=SpanKind.CLIENT) as caller_span:
        assert not caller_span.is_recording()
        to_hub = inject()
        also_to_hub = inject()
        trace_id = current_trace_id()
    assert trace_id is not None
    assert trace_id_from_headers(to_hub) == trace_id_from_headers(also_to_hub) == trace_id
    assert current_trace_id() is None  # the caller's context is gone again

    # Hub: continues the caller's trace; a nested span does not start another one.
    with span(SPAN_ROUTE, kind=SpanKind.SERVER, parent_headers=to_hub):
        assert current_trace_id() == trace_id
        with span(SPAN_DELIVER, kind=SpanKind.PRODUCER):
            to_agent = inject({"Nats-Msg-Id": "t1#1"})

    # Agent: the third hop still sees the one trace id.
    with span(SPAN_HANDLE, kind=SpanKind.CONSUMER, parent_headers=to_agent) as handle:
        handle.add_event("ACCEPTED")  # a no-op, must not fail
        assert current_trace_id() == trace_id
        status_headers = inject()
    assert trace_id_from_headers(status_headers) == trace_id


def test_tracestate_flows_with_tracing_off() -> None:
    received = {
        "traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
        "tracestate": "vendor=abc",
    }
    with span(SPAN_HANDLE, kind=SpanKind.CONSUMER, parent_headers=received):
        sent = inject()
    assert sent == received


def test_tracing_off_context_is_usable_by_opentelemetry_itself() -> None:
    received = {"traceparent": f"00-{_TID}-{_SID}-01", "tracestate": "vendor=abc"}
    with span(SPAN_HANDLE, kind=SpanKind.CONSUMER, parent_headers=received) as current:
        span_context = current.get_span_context()
        assert (span_context.trace_id, span_context.span_id) == (int(_TID, 16), int(_SID, 16))
        assert span_context.is_remote and span_context.trace_flags.sampled
        assert span_context.trace_state.get("vendor") == "abc"
        carrier: dict[str, str] = {}
        propagate.inject(carrier)  # the plain OpenTelemetry propagator agrees with inject()
        assert carrier == inject()


def test_span_without_valid_parent_headers_uses_the_current_trace() -> None:
    with span(SPAN_ROUTE, kind=SpanKind.SERVER):
        outer = current_trace_id()
        with span(SPAN_DELIVER, kind=SpanKind.PRODUCER, parent_headers={"traceparent": "bad"}):
            assert current_trace_id() == outer


# -- spans, tracing on -----------------------------------------------------------------------


def test_spans_across_hops_share_one_trace_and_parent_correctly(
    exporter: InMemorySpanExporter,
) -> None:
    assert tracing_enabled()
    with span(SPAN_ROUTE, kind=SpanKind.CLIENT, destination="reach.hub.ns.route"):
        to_hub = inject()
    with (
        span(
            SPAN_ROUTE,
            kind=SpanKind.SERVER,
            parent_headers=to_hub,
            destination="reach.hub.ns.route",
            attributes={"reach.namespace": "ns"},
        ),
        span(SPAN_DELIVER, kind=SpanKind.PRODUCER, destination="reach.agent.ns.a.b.task"),
    ):
        to_agent = inject()
    with span(SPAN_HANDLE, kind=SpanKind.CONSUMER, parent_headers=to_agent) as handle:
        assert handle.is_recording()
        handle.add_event("ACCEPTED")

    spans = exporter.get_finished_spans()
    assert len(spans) == 4
    assert len({s.context.trace_id for s in spans}) == 1
    assert f"{spans[0].context.trace_id:032x}" == trace_id_from_headers(to_hub)

    caller, hub = sorted(
        (s for s in spans if s.name == SPAN_ROUTE), key=lambda s: s.kind != SpanKind.CLIENT
    )
    deliver, handled = _by_name(spans, SPAN_DELIVER), _by_name(spans, SPAN_HANDLE)
    assert caller.parent is None
    assert _parent_span_id(hub) == caller.context.span_id
    assert hub.parent is not None and hub.parent.is_remote
    assert _parent_span_id(deliver) == hub.context.span_id
    assert _parent_span_id(handled) == deliver.context.span_id
    assert trace_id_from_headers(to_agent) == f"{deliver.context.trace_id:032x}"

    assert dict(hub.attributes or {}) == {
        "messaging.system": "nats",
        "messaging.destination.name": "reach.hub.ns.route",
        "messaging.operation.type": "process",
        "reach.namespace": "ns",
    }
    assert (deliver.attributes or {})["messaging.operation.type"] == "send"
    assert "messaging.system" not in (handled.attributes or {})
    assert [e.name for e in handled.events] == ["ACCEPTED"]


def test_a_traceparent_is_followed_when_the_applications_propagators_are_not_w3c(
    exporter: InMemorySpanExporter,
) -> None:
    """Every hop carries a ``traceparent``; a process whose propagators are B3 only (here:
    none at all) used to start a new trace for a message from a process with tracing off, and
    its trace ids matched no caller's."""
    from opentelemetry.propagators.composite import CompositePropagator

    carried = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    saved = propagate.get_global_textmap()
    propagate.set_global_textmap(CompositePropagator([]))
    try:
        with span(SPAN_HANDLE, kind=SpanKind.CONSUMER, parent_headers={"traceparent": carried}):
            pass
        assert tracing.extract({"traceparent": carried}) is not None
        remote = trace.get_current_span(tracing.extract({"traceparent": carried}))
    finally:
        propagate.set_global_textmap(saved)
    (handled,) = exporter.get_finished_spans()
    assert f"{handled.context.trace_id:032x}" == "0af7651916cd43dd8448eb211c80319c"
    assert _parent_span_id(handled) == 0xB7AD6B7169203331
    assert remote.get_span_context().span_id == 0xB7AD6B7169203331


def test_span_records_an_exception(exporter: InMemorySpanExporter) -> None:
    with pytest.raises(RuntimeError), span(SPAN_HANDLE, kind=SpanKind.CONSUMER):
        raise RuntimeError("boom")
    (failed,) = exporter.get_finished_spans()
    assert failed.status.status_code is StatusCode.ERROR
    assert [e.name for e in failed.events] == ["exception"]


def test_inject_outside_a_span_still_starts_a_trace_with_tracing_on(
    exporter: InMemorySpanExporter,
) -> None:
    headers = inject()
    assert TRACEPARENT_RE.fullmatch(headers["traceparent"])
    with span(SPAN_ROUTE, kind=SpanKind.SERVER, parent_headers=headers):
        pass
    (hub,) = exporter.get_finished_spans()
    assert f"{hub.context.trace_id:032x}" == trace_id_from_headers(headers)


# -- configure_tracing -----------------------------------------------------------------------


def test_tracing_stays_off_unless_asked() -> None:
    assert configure_tracing("svc") is None
    assert configure_tracing("svc", "none") is None
    assert not tracing_enabled()
    assert isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider)


def test_configure_memory_exporter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_SERVICE_NAME", "from-env")
    provider = configure_tracing("svc", "memory")
    assert provider is not None
    try:
        assert trace.get_tracer_provider() is provider
        assert tracing_enabled()
        assert provider.resource.attributes["service.name"] == "from-env"
        with span(SPAN_ROUTE, kind=SpanKind.SERVER):
            pass
        collected = memory_exporter()
        assert collected is not None
        assert [s.name for s in collected.get_finished_spans()] == [SPAN_ROUTE]
        # A second call finds a provider in place and installs nothing.
        assert configure_tracing("svc", "memory") is None
    finally:
        provider.shutdown()


def test_configure_respects_the_applications_provider(exporter: InMemorySpanExporter) -> None:
    theirs = trace.get_tracer_provider()
    assert configure_tracing("svc", "console") is None
    assert trace.get_tracer_provider() is theirs
    with span(SPAN_ROUTE, kind=SpanKind.SERVER):
        pass
    assert len(exporter.get_finished_spans()) == 1


def test_configure_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "none")
    assert configure_tracing("svc") is None
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "jaeger")
    with pytest.raises(ValueError, match="jaeger"):
        configure_tracing("svc")
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "console")
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    assert configure_tracing("svc") is None
    monkeypatch.delenv("OTEL_SDK_DISABLED")
    provider = configure_tracing("svc")
    assert provider is not None
    assert provider.resource.attributes["service.name"] == "svc"
    provider.shutdown()


def test_configure_otlp(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("opentelemetry.exporter.otlp.proto.http.trace_exporter")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:9")
    provider = configure_tracing("svc", "otlp")
    assert provider is not None
    provider.shutdown()  # no spans were made, so nothing is sent


def test_configure_otlp_missing_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    real_import = importlib.import_module

    def no_exporters(name: str, package: str | None = None) -> Any:
        if name.startswith("opentelemetry.exporter.otlp"):
            raise ModuleNotFoundError(name)
        return real_import(name, package)

    monkeypatch.setattr(importlib, "import_module", no_exporters)
    with pytest.raises(ImportError, match=r"reach-mesh\[otlp\]"):
        configure_tracing("svc", "otlp")
    assert not tracing_enabled()
