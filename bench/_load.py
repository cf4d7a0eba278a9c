"""Load generators and percentiles.

Open loop (latency at a fixed offered load): request ``i`` is *due* at ``t0 + i / rate`` and its
latency is measured from that due time, not from when the generator got round to sending it. A
stalled system therefore shows its stall in every request that should have been sent meanwhile
(no coordinated omission). The generator's own lateness (timer resolution, a busy loop) is
reported separately as ``send_lag`` so it can be told apart from the system's.

Closed loop (peak throughput): ``concurrency`` workers each send the next request as soon as the
previous one is answered, for a fixed time.

Every loop is bounded in count and in time.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

__all__ = ["Call", "closed_loop", "open_loop", "percentile", "summarize"]

Call = Callable[[], Awaitable[Any]]

#: Most requests an open-loop run keeps outstanding; past it, sends wait (and are counted late).
_MAX_OUTSTANDING = 4096


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile of an ascending sequence (``q`` in 0..100)."""
    if not sorted_values:
        return float("nan")
    rank = max(1, round(q / 100.0 * len(sorted_values) + 0.4999999))
    return sorted_values[min(rank, len(sorted_values)) - 1]


def summarize(latencies_s: list[float]) -> dict[str, float]:
    """p50/p90/p99/p99.9/max in milliseconds."""
    xs = sorted(latencies_s)
    out = {f"p{k:g}_ms": round(percentile(xs, k) * 1000, 3) for k in (50, 90, 99, 99.9)}
    out["max_ms"] = round(xs[-1] * 1000, 3) if xs else float("nan")
    return out


async def open_loop(
    call: Call, rate: float, duration: float, *, drain_timeout: float = 10.0
) -> dict[str, Any]:
    """Send ``rate * duration`` requests on a fixed timetable; latency from the due time."""
    loop = asyncio.get_running_loop()
    count = max(1, int(rate * duration))
    latencies: list[float] = []
    lags: list[float] = []
    errors: Counter[str] = Counter()
    slots = asyncio.Semaphore(_MAX_OUTSTANDING)
    tasks: set[asyncio.Task[None]] = set()

    async def one(due: float) -> None:
        try:
            await call()
        except Exception as err:
            errors[type(err).__name__] += 1
        else:
            latencies.append(time.perf_counter() - due)
        finally:
            slots.release()

    start = time.perf_counter() + 0.005
    for i in range(count):
        due = start + i / rate
        ahead = due - time.perf_counter()
        if ahead > 0.0005:
            await asyncio.sleep(ahead)
        await slots.acquire()
        now = time.perf_counter()
        lags.append(now - due)
        # The clock starts at the due time, or at the send if that came early (a request
        # sent ahead of its slot is not credited with negative waiting).
        task = loop.create_task(one(max(due, now)))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
    send_end = time.perf_counter()
    unfinished = 0
    if tasks:
        _, pending = await asyncio.wait(set(tasks), timeout=drain_timeout)
        unfinished = len(pending)
        for task in pending:
            task.cancel()
        for task in pending:
            with contextlib.suppress(BaseException):
                await task
    elapsed = time.perf_counter() - start
    lag_ms = sorted(x * 1000 for x in lags)
    return {
        "offered_rps": rate,
        "sent": count,
        "ok": len(latencies),
        "errors": dict(errors),
        "unfinished": unfinished,
        "send_window_s": round(send_end - start, 3),
        "achieved_rps": round(len(latencies) / max(elapsed, 1e-9), 1),
        **summarize(latencies),
        "send_lag_p50_ms": round(percentile(lag_ms, 50), 3),
        "send_lag_p99_ms": round(percentile(lag_ms, 99), 3),
    }


async def closed_loop(call: Call, concurrency: int, duration: float) -> dict[str, Any]:
    """``concurrency`` requests in flight for ``duration`` seconds: throughput and latency."""
    latencies: list[float] = []
    errors: Counter[str] = Counter()
    deadline = time.perf_counter() + duration

    async def worker() -> None:
        while time.perf_counter() < deadline:
            t0 = time.perf_counter()
            try:
                await call()
            except Exception as err:
                errors[type(err).__name__] += 1
                await asyncio.sleep(0.001)  # never spin on a failing target
            else:
                latencies.append(time.perf_counter() - t0)

    t0 = time.perf_counter()
    workers = [asyncio.create_task(worker()) for _ in range(concurrency)]
    _, pending = await asyncio.wait(workers, timeout=duration + 15.0)
    for task in pending:
        task.cancel()
    elapsed = time.perf_counter() - t0
    return {
        "concurrency": concurrency,
        "ok": len(latencies),
        "errors": dict(errors),
        "elapsed_s": round(elapsed, 3),
        "throughput_rps": round(len(latencies) / max(elapsed, 1e-9), 1),
        **summarize(latencies),
    }
