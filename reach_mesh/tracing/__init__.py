"""Tracing and metrics for reach-mesh: W3C trace context over NATS headers, span helpers,
OpenTelemetry setup. Prometheus metrics live in :mod:`reach_mesh.tracing.metrics`.

Every message carries a ``traceparent`` even with tracing off, so one trace_id follows a task
across every hop and every log line; spans are recorded only when a tracer provider is set up
(:func:`configure_tracing`, ``OTEL_TRACES_EXPORTER``, or the application's own).
"""

from __future__ import annotations

from opentelemetry.trace import SpanKind

from ._propagation import (
    TRACEPARENT,
    TRACESTATE,
    carried_span,
    current_context,
    current_trace_id,
    extract,
    inject,
    started_trace,
    trace_id_from_headers,
)
from ._setup import (
    ExporterName,
    configure_tracing,
    flush_tracing,
    memory_exporter,
    tracing_enabled,
    tracing_from_env,
)
from ._spans import (
    SPAN_DELIVER,
    SPAN_HANDLE,
    SPAN_ROUTE,
    SPAN_STEP,
    SPAN_WORKFLOW,
    inject_span,
    open_span,
    span,
)

__all__ = [
    "SPAN_DELIVER",
    "SPAN_HANDLE",
    "SPAN_ROUTE",
    "SPAN_STEP",
    "SPAN_WORKFLOW",
    "TRACEPARENT",
    "TRACESTATE",
    "ExporterName",
    "SpanKind",
    "carried_span",
    "configure_tracing",
    "current_context",
    "current_trace_id",
    "extract",
    "flush_tracing",
    "inject",
    "inject_span",
    "memory_exporter",
    "open_span",
    "span",
    "started_trace",
    "trace_id_from_headers",
    "tracing_enabled",
    "tracing_from_env",
]
