"""Cost per call of trace propagation and span helpers, tracing off vs on.

Run: ``.venv/bin/python bench/tracing_overhead.py [--number N] [--repeat R]``. Prints JSON with
nanoseconds per call (best of R runs of N calls). "on" uses an SDK provider with a synchronous
in-memory exporter — the span bookkeeping cost without any I/O.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import timeit
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import (
    InMemorySpanExporter,
)

from reach_mesh.tracing import (
    SPAN_HANDLE,
    SpanKind,
    inject,
    span,
    trace_id_from_headers,
    tracing_enabled,
)

PARENT = {"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}


def _inject_fresh() -> None:
    inject()


def _span_plus_inject() -> None:
    with span(SPAN_HANDLE, kind=SpanKind.CONSUMER, parent_headers=PARENT, destination="s.t"):
        inject()


def _span_event_inject() -> None:
    with span(SPAN_HANDLE, kind=SpanKind.CONSUMER, parent_headers=PARENT) as current:
        current.add_event("ACCEPTED")
        inject()


def _trace_id() -> None:
    trace_id_from_headers(PARENT)


CASES: dict[str, Callable[[], None]] = {
    "inject_no_span": _inject_fresh,
    "span_with_parent_plus_inject": _span_plus_inject,
    "span_event_inject": _span_event_inject,
    "trace_id_from_headers": _trace_id,
}


def _measure(
    func: Callable[[], None], number: int, repeat: int, reset: Callable[[], None]
) -> float:
    best = float("inf")
    for _ in range(repeat):
        reset()
        best = min(best, timeit.timeit(func, number=number) / number)
    return round(best * 1e9, 1)


def main() -> None:
    """Measure every case with tracing off, then with an SDK provider installed."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--number", type=int, default=20_000)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()

    def no_reset() -> None:
        return None

    assert not tracing_enabled()
    off = {name: _measure(f, args.number, args.repeat, no_reset) for name, f in CASES.items()}

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    assert tracing_enabled()
    on = {name: _measure(f, args.number, args.repeat, exporter.clear) for name, f in CASES.items()}
    provider.shutdown()

    print(
        json.dumps(
            {
                "unit": "ns per call (best of repeat)",
                "number": args.number,
                "repeat": args.repeat,
                "python": platform.python_version(),
                "tracing_off": off,
                "tracing_on_memory_exporter": on,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
