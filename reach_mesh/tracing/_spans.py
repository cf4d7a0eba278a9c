"""Spans at the project's own seams: route, deliver, handle, workflow, step.

``span()`` is the one way the project opens a span. With tracing on it is an ordinary
OpenTelemetry span carrying the messaging semantic-convention attributes. With tracing off it
records nothing but still makes the trace context current — the one from ``parent_headers``, else
the current one, else a new trace — so that ``inject()`` inside it propagates one trace id.
"""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import AbstractContextManager
from contextvars import Token
from types import TracebackType
from typing import Final

from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.context import Context
from opentelemetry.trace import SpanKind
from opentelemetry.util.types import AttributeValue

from ._propagation import (
    TRACEPARENT,
    _CarriedSpan,
    _format,
    _fresh_span,
    carried_span,
    extract_onto,
)
from ._setup import _tracer, tracing_enabled

__all__ = [
    "SPAN_DELIVER",
    "SPAN_HANDLE",
    "SPAN_ROUTE",
    "SPAN_STEP",
    "SPAN_WORKFLOW",
    "open_span",
    "span",
]

SPAN_ROUTE: Final = "reach.route"
"""A hub choosing an agent for a task (``SpanKind.SERVER`` on the hub)."""
SPAN_DELIVER: Final = "reach.deliver"
"""Sending a task to an agent (``SpanKind.PRODUCER``/``CLIENT`` on the sender)."""
SPAN_HANDLE: Final = "reach.handle"
"""An agent running a handler (``SpanKind.CONSUMER`` on the agent)."""
SPAN_WORKFLOW: Final = "reach.workflow"
"""A whole fanout or chain (``SpanKind.INTERNAL`` on the owning hub)."""
SPAN_STEP: Final = "reach.step"
"""One branch or step of a workflow (``SpanKind.INTERNAL`` on the owning hub)."""

# messaging.operation.type by span kind (OpenTelemetry messaging semantic conventions).
_OPERATION_BY_KIND: Final[Mapping[SpanKind, str]] = {
    SpanKind.PRODUCER: "send",
    SpanKind.CLIENT: "send",
    SpanKind.CONSUMER: "process",
    SpanKind.SERVER: "process",
}


def span(
    name: str,
    *,
    kind: SpanKind,
    parent_headers: Mapping[str, str] | None = None,
    attributes: Mapping[str, AttributeValue] | None = None,
    destination: str | None = None,
    operation: str | None = None,
) -> _SpanScope:
    """A context manager that opens a span and makes it current; yields the span.

    Args:
        name: one of the ``SPAN_*`` names.
        kind: the OpenTelemetry span kind.
        parent_headers: NATS headers of the message being handled; their ``traceparent`` is
            the parent. Without a valid one the current context is the parent.
        attributes: extra span attributes (ignored when tracing is off).
        destination: the NATS subject; when given, the span gets ``messaging.system=nats``,
            ``messaging.destination.name`` and ``messaging.operation.type``.
        operation: ``messaging.operation.type``; defaults from ``kind`` (send / process).

    With tracing off the yielded span is non-recording: ``add_event``/``set_attribute`` are
    no-ops and the only cost is making the trace context current.
    """
    return _SpanScope(name, kind, parent_headers, attributes, destination, operation)


def open_span(
    name: str,
    *,
    kind: SpanKind,
    parent_headers: Mapping[str, str] | None = None,
    parent: trace.Span | None = None,
    attributes: Mapping[str, AttributeValue] | None = None,
    destination: str | None = None,
) -> trace.Span:
    """Start a recording span that is *not* made current; the caller ends it (``span.end()``).

    For work that outlives one callback: the hub's proxy route opens ``reach.route`` when the
    request arrives and ends it in the callback that gets the agent's reply. The parent is
    ``parent`` if given, else the ``traceparent`` in ``parent_headers``, else the current
    context. Call it only with tracing on (:func:`tracing_enabled`); :func:`inject_span` writes
    its context into headers.
    """
    if parent is not None:
        context: Context | None = trace.set_span_in_context(parent)
    elif parent_headers:
        context = extract_onto(parent_headers, otel_context.get_current())
    else:
        context = None
    return _tracer().start_span(
        name, context=context, kind=kind, attributes=_attributes(kind, attributes, destination)
    )


def inject_span(span: trace.Span) -> dict[str, str]:
    """NATS headers carrying ``span``'s context (what :func:`inject` writes inside it)."""
    headers: dict[str, str] = {}
    propagate.inject(headers, context=trace.set_span_in_context(span))
    headers.setdefault(TRACEPARENT, _format(span.get_span_context()))
    return headers


def _attributes(
    kind: SpanKind,
    extra: Mapping[str, AttributeValue] | None,
    destination: str | None,
    operation: str | None = None,
) -> dict[str, AttributeValue]:
    attributes: dict[str, AttributeValue] = {}
    if destination is not None:
        attributes["messaging.system"] = "nats"
        attributes["messaging.destination.name"] = destination
        operation = operation or _OPERATION_BY_KIND.get(kind)
        if operation is not None:
            attributes["messaging.operation.type"] = operation
    if extra:
        attributes.update(extra)
    return attributes


class _SpanScope:
    """The context manager behind :func:`span`; a class because it is on every message."""

    __slots__ = (
        "_attributes",
        "_destination",
        "_kind",
        "_manager",
        "_name",
        "_operation",
        "_parent_headers",
        "_token",
    )

    def __init__(
        self,
        name: str,
        kind: SpanKind,
        parent_headers: Mapping[str, str] | None,
        attributes: Mapping[str, AttributeValue] | None,
        destination: str | None,
        operation: str | None,
    ) -> None:
        self._name = name
        self._kind = kind
        self._parent_headers = parent_headers
        self._attributes = attributes
        self._destination = destination
        self._operation = operation
        self._manager: AbstractContextManager[trace.Span] | None = None
        self._token: Token[Context] | None = None

    def __enter__(self) -> trace.Span:
        if tracing_enabled():
            return self._enter_recording()
        parent = self._parent_headers
        current = carried_span(parent) if parent else None
        if current is None:
            active = trace.get_current_span()
            if type(active) is _CarriedSpan or active.get_span_context().is_valid:
                return active  # already inside a trace: nothing to attach
            current = _fresh_span()
        self._token = otel_context.attach(trace.set_span_in_context(current))
        return current

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._manager is not None:
            self._manager.__exit__(exc_type, exc, tb)
        elif self._token is not None:
            otel_context.detach(self._token)

    def _enter_recording(self) -> trace.Span:
        parent_context = None
        if self._parent_headers:
            # Extract on top of the current context: headers without a valid traceparent leave
            # the current span as parent, and current baggage survives.
            parent_context = extract_onto(self._parent_headers, otel_context.get_current())
        attributes = _attributes(self._kind, self._attributes, self._destination, self._operation)
        manager = _tracer().start_as_current_span(
            self._name, context=parent_context, kind=self._kind, attributes=attributes
        )
        opened = manager.__enter__()
        self._manager = manager
        return opened
