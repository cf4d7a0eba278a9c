"""Turning tracing on (or leaving it off) for one process.

Tracing is off unless someone asks for it. Three ways to ask, in order of precedence:

1. the application already set a global OpenTelemetry ``TracerProvider`` — it is used as is;
2. ``configure_tracing(..., exporter="console" | "otlp" | "memory")`` (the CLI's ``--trace``);
3. the standard ``OTEL_TRACES_EXPORTER`` environment variable (``otlp``, ``console``, ``none``,
   comma-separated for several), read by ``configure_tracing`` and — through
   :func:`tracing_from_env` — by ``Agent``, ``Client`` and ``Hub`` when they start, so an SDK
   object honours the OpenTelemetry environment without any entry point's help.

``OTEL_SDK_DISABLED=true`` keeps tracing off whatever else is set.
"""

from __future__ import annotations

import asyncio
import importlib
import logging
import os
import threading
from typing import Any, Final, Literal, get_args

from opentelemetry import trace
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    ConsoleSpanExporter,
    SimpleSpanProcessor,
    SpanExporter,
)
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

__all__ = [
    "ExporterName",
    "configure_tracing",
    "flush_tracing",
    "memory_exporter",
    "tracing_enabled",
    "tracing_from_env",
]

ExporterName = Literal["none", "console", "otlp", "memory"]
"""Exporters :func:`configure_tracing` knows by name."""

_EXPORTER_NAMES: Final[frozenset[str]] = frozenset(get_args(ExporterName))
_INSTRUMENTATION_NAME: Final = "reach_mesh"
_OTLP_HTTP: Final = "opentelemetry.exporter.otlp.proto.http.trace_exporter"
_OTLP_GRPC: Final = "opentelemetry.exporter.otlp.proto.grpc.trace_exporter"

# (provider, enabled, tracer) for the provider seen last. Keyed on the provider's identity so the
# answer stays right if the global provider changes (tests reset it); one tuple so that a reader
# on another thread never sees a provider paired with another provider's tracer.
_cache: tuple[object, bool, trace.Tracer | None] = (object(), False, None)
_memory_exporter: InMemorySpanExporter | None = None
_configure_lock = threading.Lock()
_NO_SLOT: Final = object()
#: The provider :func:`tracing_from_env` installed (None: it installed none, or not yet).
_from_env: TracerProvider | None = None
#: An ``OTEL_TRACES_EXPORTER`` value :func:`tracing_from_env` could not act on (warned once).
_env_refused: str | None = None
_FLUSH_TIMEOUT_MS: Final = 5000
log = logging.getLogger("reach_mesh.tracing")

if "OTEL_PYTHON_TRACER_PROVIDER" in os.environ:
    # A provider named by entry point is loaded lazily by the API on first use; load it now so
    # that tracing_enabled(), which reads the global slot, sees it from the first message on.
    trace.get_tracer_provider()


def tracing_enabled() -> bool:
    """Whether a real (non no-op) tracer provider is installed globally.

    Cheap enough for every message: a global read and an identity check (~0.1 µs).
    """
    # The API's global slot is read directly: trace.get_tracer_provider() looks an environment
    # variable up on every call while no provider is set (~0.5 µs), too much for every message.
    # Should a future API drop the slot, the public function takes over.
    slot: Any = getattr(trace, "_TRACER_PROVIDER", _NO_SLOT)
    if slot is None:
        return False
    provider: trace.TracerProvider = trace.get_tracer_provider() if slot is _NO_SLOT else slot
    cached = _cache
    if provider is cached[0]:
        return cached[1]
    return _refresh(provider)[1]


def _tracer() -> trace.Tracer:
    """The project's tracer from the current global provider (no-op tracer when off)."""
    provider = trace.get_tracer_provider()
    cached = _cache
    if provider is not cached[0] or cached[2] is None:
        cached = _refresh(provider)
    assert cached[2] is not None
    return cached[2]


def _refresh(provider: trace.TracerProvider) -> tuple[object, bool, trace.Tracer | None]:
    global _cache
    enabled = not isinstance(provider, trace.ProxyTracerProvider | trace.NoOpTracerProvider)
    _cache = (provider, enabled, provider.get_tracer(_INSTRUMENTATION_NAME))
    return _cache


def memory_exporter() -> InMemorySpanExporter | None:
    """The in-memory exporter installed by ``configure_tracing(exporter="memory")``, if any."""
    return _memory_exporter


def configure_tracing(
    service_name: str, exporter: ExporterName | None = None
) -> TracerProvider | None:
    """Install an SDK tracer provider when tracing is asked for; otherwise change nothing.

    Args:
        service_name: ``service.name`` of the resource, unless ``OTEL_SERVICE_NAME`` is set
            (the environment wins, as everywhere in OpenTelemetry).
        exporter: an explicit exporter (the CLI's ``--trace``); ``None`` defers to
            ``OTEL_TRACES_EXPORTER``; ``"none"`` keeps tracing off.

    Returns:
        The provider this call installed — the caller owns it and should ``shutdown()`` it on
        exit to flush batched spans — or ``None`` when nothing was installed: tracing stays off,
        or the application had already installed its own provider (which it keeps owning).

    Raises:
        ValueError: an exporter name that is not known.
        ImportError: ``otlp`` was asked for but the ``reach-mesh[otlp]`` extra is not installed.

    The OTLP exporter reads ``OTEL_EXPORTER_OTLP_ENDPOINT``, ``OTEL_EXPORTER_OTLP_HEADERS`` and
    friends itself; the sampler comes from ``OTEL_TRACES_SAMPLER`` via the SDK.
    """
    global _memory_exporter
    names = [exporter] if exporter is not None else _exporters_from_env()
    for name in names:
        if name not in _EXPORTER_NAMES:
            raise ValueError(
                f"unknown trace exporter {name!r}; expected one of {sorted(_EXPORTER_NAMES)}"
            )
    names = [name for name in names if name != "none"]
    if not names or os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return None
    with _configure_lock:
        # Anything but the unset proxy means someone chose a provider (possibly an explicit
        # no-op): theirs to own, ours to use.
        if not isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider):
            return None
        resource = Resource.create(
            {SERVICE_NAME: os.environ.get("OTEL_SERVICE_NAME") or service_name}
        )
        provider = TracerProvider(resource=resource)
        memory: InMemorySpanExporter | None = None
        for name in dict.fromkeys(names):  # de-duplicated, order kept
            processor, span_exporter = _processor(name)
            provider.add_span_processor(processor)
            if isinstance(span_exporter, InMemorySpanExporter):
                memory = span_exporter
        trace.set_tracer_provider(provider)
        if trace.get_tracer_provider() is not provider:
            # Set-once lost to another thread or an OTEL_PYTHON_TRACER_PROVIDER entry point.
            provider.shutdown()
            return None
        if memory is not None:
            _memory_exporter = memory
        return provider


def _exporters_from_env() -> list[str]:
    raw = os.environ.get("OTEL_TRACES_EXPORTER", "")
    return [part.strip().lower() for part in raw.split(",") if part.strip()]


def _processor(name: str) -> tuple[SpanProcessor, SpanExporter]:
    span_exporter: SpanExporter
    if name == "memory":
        # Synchronous, so a test sees its spans the moment they end; appending to a list never
        # blocks the event loop.
        span_exporter = InMemorySpanExporter()
        return SimpleSpanProcessor(span_exporter), span_exporter
    # Batch even for the console: writing to stdout from inside span.end() would put a
    # blocking write on the event loop; the batch processor does it on its own thread.
    span_exporter = ConsoleSpanExporter() if name == "console" else _otlp_exporter()
    return BatchSpanProcessor(span_exporter), span_exporter


def _otlp_exporter() -> SpanExporter:
    protocol = (
        os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
        or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
        or "http/protobuf"
    ).strip()
    if protocol == "grpc":
        module_name, hint = (
            _OTLP_GRPC,
            (
                "OTLP over gRPC needs the 'opentelemetry-exporter-otlp-proto-grpc' package "
                "(or set OTEL_EXPORTER_OTLP_PROTOCOL=http/protobuf and install 'reach-mesh[otlp]')"
            ),
        )
    else:
        module_name, hint = (
            _OTLP_HTTP,
            (
                "the OTLP trace exporter is not installed: pip install 'reach-mesh[otlp]' "
                "(package 'opentelemetry-exporter-otlp-proto-http')"
            ),
        )
    # Imported by name, at call time: the exporters are optional extras (they pull in protobuf
    # and an HTTP or gRPC client), and type checking must not depend on them being installed.
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ImportError(hint) from err
    span_exporter: SpanExporter = module.OTLPSpanExporter()
    return span_exporter


def tracing_from_env(service_name: str) -> None:
    """Turn tracing on from the standard OpenTelemetry environment, once per process.

    What ``Agent``, ``Client`` and ``Hub`` call when they start: with ``OTEL_TRACES_EXPORTER``
    set (and no provider installed yet) it installs one as :func:`configure_tracing` does, with
    ``service_name`` unless ``OTEL_SERVICE_NAME`` names the service. Anything already installed
    — the application's own provider, the CLI's, an earlier call's — is left alone, so the first
    object to start names the process's service. Never raises: a bad setting (an unknown
    exporter, the OTLP extra missing) is logged once and tracing stays off.

    The provider lives until the process exits (the SDK shuts it down then, flushing the last
    spans); :func:`flush_tracing` exports what is batched before that.
    """
    global _from_env, _env_refused
    asked = os.environ.get("OTEL_TRACES_EXPORTER")
    if not asked or asked == _env_refused or tracing_enabled():
        return  # the cheap common cases: nothing asked for, or tracing already on
    try:
        provider = configure_tracing(service_name)
    except (ValueError, ImportError) as err:
        _env_refused = asked  # said once, not for every object that starts
        log.warning("tracing stays off: %s", err)
        return
    if provider is not None:
        _from_env = provider


async def flush_tracing() -> None:
    """Export the spans batched so far by the provider :func:`tracing_from_env` installed
    (a no-op otherwise). Runs the flush on a thread: exporting must not block the event loop."""
    provider = _from_env
    if provider is not None and trace.get_tracer_provider() is provider:
        await asyncio.to_thread(provider.force_flush, _FLUSH_TIMEOUT_MS)
