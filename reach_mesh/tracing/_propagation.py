"""W3C trace context in NATS headers.

Every message the mesh sends carries a ``traceparent``, tracing on or off, so that one trace_id
follows a task across every hop and shows up in every log line. With tracing off this costs a
random number and a string format — no OpenTelemetry SDK objects.

Sampled flag of a trace the mesh starts itself (no caller span): always ``01``. The caller made
no sampling decision, so the mesh asks every downstream process that does have tracing on to
record its part; with ``00`` a hub with tracing on would drop every span of every caller that does
not trace, which is most of them. Operators who want fewer traces set
``OTEL_TRACES_SAMPLER=traceidratio`` on the recording processes: the ratio sampler decides from
the trace id alone, so all hops of one trace agree.
"""

from __future__ import annotations

import hashlib
import os
import random
import re
from collections.abc import Mapping
from typing import Final

from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.context import Context
from opentelemetry.trace import (
    INVALID_SPAN_CONTEXT,
    NonRecordingSpan,
    SpanContext,
    TraceFlags,
    TraceState,
)
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from ._setup import tracing_enabled

__all__ = [
    "TRACEPARENT",
    "TRACESTATE",
    "carried_span",
    "current_trace_id",
    "extract",
    "extract_onto",
    "inject",
    "started_trace",
    "trace_id_from_headers",
]

TRACEPARENT: Final = "traceparent"
TRACESTATE: Final = "tracestate"

_ZERO_TRACE: Final = "0" * 32
_ZERO_SPAN: Final = "0" * 16
# The W3C grammar; lower-case hex only. A later version's added fields are visible ASCII: not
# OpenTelemetry's ``(-.*)?``, which takes a space too — and a value the hub keeps goes on a
# task batch line, whose fields are separated by spaces (``protocol.batch_line``): one such
# header failed every request of its batch.
_TRACEPARENT_RE: Final = re.compile(
    r"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-[!-~]*)?"
)

# A private generator, not the `random` module's: an application that seeds the global one
# (common in tests) must not make trace ids repeat across processes. Reseeded in a forked child
# so parent and child never mint the same ids. Trace ids need uniqueness, not secrecy.
_rng = random.Random()
os.register_at_fork(after_in_child=_rng.seed)


def inject(
    headers: dict[str, str] | None = None, *, within: Context | None = None
) -> dict[str, str]:
    """Write the current trace context (or ``within``: one captured earlier with
    :func:`current_context`) into NATS headers and return them.

    ``headers`` is updated in place (a new dict when ``None``). With a valid current span its
    context is written (``traceparent``, ``tracestate``; with tracing on, whatever the global
    propagator writes, e.g. ``baggage``). With no current span the mesh starts a trace: an
    already valid ``traceparent`` in ``headers`` is kept (forwarding a received message continues
    its trace), otherwise a fresh random one is written, sampled flag ``01``.
    """
    if headers is None:
        headers = {}
    current = trace.get_current_span(within)
    if type(current) is _CarriedSpan and not tracing_enabled():
        # Tracing off inside span(): copy the strings it was made from, no formatting.
        headers[TRACEPARENT] = current.traceparent
        if current.tracestate:
            headers[TRACESTATE] = current.tracestate
        else:
            headers.pop(TRACESTATE, None)
        return headers
    span_context = current.get_span_context()
    if tracing_enabled():
        # The global propagator may be configured by the application (B3, baggage, ...).
        propagate.inject(headers, context=within)
        if span_context.is_valid:
            # Every hop must carry a traceparent, even if the application's propagators are
            # not W3C ones.
            headers.setdefault(TRACEPARENT, _format(span_context))
            return headers
    elif span_context.is_valid:
        headers[TRACEPARENT] = _format(span_context)
        if span_context.trace_state:
            headers[TRACESTATE] = span_context.trace_state.to_header()
        else:
            headers.pop(TRACESTATE, None)
        return headers
    kept = headers.get(TRACEPARENT)
    if kept is None or _parse(kept) is None:
        headers[TRACEPARENT] = _fresh_traceparent()
        headers.pop(TRACESTATE, None)
    elif kept != kept.strip(" \t"):
        headers[TRACEPARENT] = kept.strip(" \t")  # spaces around it: not the header's own
    return headers


def current_context() -> Context:
    """The current OpenTelemetry context, to :func:`inject` later (``within=``)."""
    return otel_context.get_current()


def extract(headers: Mapping[str, str] | None) -> Context:
    """The OpenTelemetry context carried by ``headers`` (an empty context when there is none)."""
    return extract_onto(headers or {}, None)


_W3C: Final = TraceContextTextMapPropagator()


def extract_onto(headers: Mapping[str, str], context: Context | None) -> Context:
    """``headers``' trace context on top of ``context``, by the application's propagators —
    or by their ``traceparent`` when those found none there: every hop carries one
    (:func:`inject`), but a process whose propagators are B3 only would otherwise start a new
    trace for a message from a process with tracing off."""
    base = Context() if context is None else context
    got = propagate.extract(headers, context=base)
    if TRACEPARENT in headers and trace.get_current_span(got) is trace.get_current_span(base):
        got = _W3C.extract(headers, context=got)
    return got


def trace_id_from_headers(headers: Mapping[str, str] | None) -> str | None:
    """The 32-hex trace id in ``headers``' ``traceparent``, or ``None`` if absent or invalid."""
    if not headers:
        return None
    parsed = _parse(headers.get(TRACEPARENT))
    return parsed[0] if parsed is not None else None


def started_trace(headers: dict[str, str], seed: bytes) -> str:
    """The trace id of ``headers``' ``traceparent``; without a valid one, start a trace in
    ``headers`` (sampled, as :func:`inject` does) whose id is made from ``seed``: processes
    that start the trace of one message from the same seed start the same trace."""
    parsed = _parse(headers.get(TRACEPARENT))
    if parsed is not None:
        return parsed[0]
    trace_id = hashlib.blake2b(seed, digest_size=16).hexdigest()
    headers[TRACEPARENT] = f"00-{trace_id}-{os.urandom(8).hex()}-01"
    headers.pop(TRACESTATE, None)
    return trace_id


def current_trace_id() -> str | None:
    """The 32-hex trace id of the current span, or ``None`` outside any trace."""
    current = trace.get_current_span()
    if type(current) is _CarriedSpan:
        return current.trace_id
    span_context = current.get_span_context()
    return format(span_context.trace_id, "032x") if span_context.is_valid else None


class _CarriedSpan(NonRecordingSpan):
    """The non-recording span that ``span()`` makes current when tracing is off.

    It keeps the W3C strings it was made from, so that ``inject()`` and ``current_trace_id()``
    copy them instead of formatting integers, and builds its ``SpanContext`` only if some
    OpenTelemetry code asks for it (about half the cost of the tracing-off path otherwise).
    """

    def __init__(
        self,
        trace_id: str,
        span_id: str,
        flags: str,
        tracestate: str | None,
        *,
        is_remote: bool,
    ) -> None:
        super().__init__(INVALID_SPAN_CONTEXT)
        self.trace_id = trace_id
        self.traceparent = f"00-{trace_id}-{span_id}-{flags}"
        self.tracestate = tracestate
        self._span_id = span_id
        self._flags = flags
        self._is_remote = is_remote
        self._built = False

    def get_span_context(self) -> SpanContext:
        """The span context, built on first use."""
        if not self._built:
            self._context = SpanContext(
                int(self.trace_id, 16),
                int(self._span_id, 16),
                is_remote=self._is_remote,
                trace_flags=TraceFlags(int(self._flags, 16)),
                trace_state=TraceState.from_header([self.tracestate]) if self.tracestate else None,
            )
            self._built = True
        return self._context


def carried_span(headers: Mapping[str, str]) -> _CarriedSpan | None:
    """A remote, non-recording span for the headers' trace context, or ``None`` without a valid
    ``traceparent``. With tracing off, making it current (``trace.set_span_in_context``) is what
    ``span()`` does — the handler's logs and its own mesh calls then carry the caller's trace —
    without parsing the header twice. Its ``trace_id`` attribute is the 32-hex id."""
    parsed = _parse(headers.get(TRACEPARENT))
    if parsed is None:
        return None
    trace_id, span_id, flags = parsed
    return _CarriedSpan(trace_id, span_id, flags, headers.get(TRACESTATE), is_remote=True)


def _fresh_span() -> _CarriedSpan:
    """A non-recording span starting a new trace (the tracing-off path), sampled flag 01."""
    trace_id, span_id = _fresh_ids()
    return _CarriedSpan(trace_id, span_id, "01", None, is_remote=False)


def _parse(value: str | None) -> tuple[str, str, str] | None:
    """(trace_id, span_id, flags) as hex strings from a ``traceparent`` value, or ``None``."""
    if value is None:
        return None
    # Whitespace around it is tolerated (an HTTP header's, copied), none within.
    match = _TRACEPARENT_RE.fullmatch(value.strip(" \t"))
    if match is None:
        return None
    version, trace_id, span_id, flags, rest = match.groups()
    # Version ff is forbidden; version 00 has exactly four fields; a later version may add more.
    if version == "ff" or (version == "00" and rest) or trace_id == _ZERO_TRACE:
        return None
    if span_id == _ZERO_SPAN:
        return None
    return trace_id, span_id, flags


def _format(span_context: SpanContext) -> str:
    return (
        f"00-{span_context.trace_id:032x}-{span_context.span_id:016x}"
        f"-{span_context.trace_flags:02x}"
    )


def _fresh_ids() -> tuple[str, str]:
    while True:
        digits = _rng.randbytes(24).hex()  # the cheapest of the ways tried (bench/)
        trace_id, span_id = digits[:32], digits[32:]
        # All-zero ids are invalid; 2**-64 odds, but a retry is cheaper than an invalid trace.
        if trace_id != _ZERO_TRACE and span_id != _ZERO_SPAN:
            return trace_id, span_id


def _fresh_traceparent() -> str:
    trace_id, span_id = _fresh_ids()
    return f"00-{trace_id}-{span_id}-01"
