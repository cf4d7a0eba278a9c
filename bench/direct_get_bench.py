"""Micro-benchmark: a KV read by key (a JetStream direct get) through ``JsClient.kv_get`` (hedged:
``reach_mesh/_jspub.py``) side by side with the raw exchange (nats-py ``nc.request`` on the same
direct-get subject) in the same run, on an embedded nats-server.

Run: ``.venv/bin/python bench/direct_get_bench.py [--reads N]``. Prints one JSON object: wall
and process CPU µs per sequential read for each, and their ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import nats

from reach_mesh._jspub import JsClient
from reach_mesh._kv import kv_subject
from reach_mesh._nats import ensure_kv
from reach_mesh.server import EmbeddedNats


async def _per_read(read: Callable[[], Awaitable[Any]], reads: int) -> tuple[float, float]:
    """(wall µs, CPU µs) per read, after a warm-up."""
    for _ in range(reads // 10):
        await read()
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(reads):
        await read()
    return (
        (time.perf_counter() - wall) / reads * 1e6,
        (time.process_time() - cpu) / reads * 1e6,
    )


async def main(reads: int) -> dict[str, Any]:
    async with EmbeddedNats() as server:
        nc = await nats.connect(server.url)
        try:
            await (await ensure_kv(nc.jetstream(), "bench_reads")).put("k", b"x" * 200)
            jsc = JsClient(nc)
            await jsc.start()
            subject = f"$JS.API.DIRECT.GET.KV_bench_reads.{kv_subject('bench_reads', 'k')}"
            rounds: dict[str, list[tuple[float, float]]] = {"raw": [], "kv_get": []}
            for _ in range(3):  # interleaved: both see the same machine
                rounds["raw"].append(await _per_read(lambda: nc.request(subject, b""), reads))
                rounds["kv_get"].append(
                    await _per_read(lambda: jsc.kv_get("bench_reads", "k"), reads)
                )
            await jsc.stop()
        finally:
            await nc.close()
    best = {name: min(r, key=lambda x: x[1]) for name, r in rounds.items()}
    return {
        "reads": reads,
        "raw_us": {"wall": round(best["raw"][0], 1), "cpu": round(best["raw"][1], 1)},
        "kv_get_us": {"wall": round(best["kv_get"][0], 1), "cpu": round(best["kv_get"][1], 1)},
        "ratio_wall": round(best["kv_get"][0] / best["raw"][0], 2),
        "ratio_cpu": round(best["kv_get"][1] / best["raw"][1], 2),
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--reads", type=int, default=3000)
    args = parser.parse_args()
    print(json.dumps(asyncio.run(main(args.reads))))
