"""Micro-benchmark: an acked JetStream publish with a ``Nats-Msg-Id`` through
``JsClient.publish_hedged`` (an agent's final status: sent again while unanswered,
``reach_mesh/_jspub.py``) side by side with ``JsClient.publish`` (one try) in the same run, on an
embedded nats-server: sequential and 64 at a time, alternated over rounds.

Run: ``.venv/bin/python bench/publish_bench.py [--publishes N] [--rounds R]``. Prints one JSON
object: per mode and concurrency, the median over rounds of wall and process CPU µs per
publish, and hedged / plain ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import nats
from nats.js.api import StorageType, StreamConfig

from reach_mesh._jspub import JsClient
from reach_mesh.server import EmbeddedNats

_BODY = b"x" * 400  # about a final status with a small result


async def _round(jsc: JsClient, hedged: bool, n: int, at_once: int) -> tuple[float, float]:
    """(wall µs, CPU µs) per publish."""
    slots = asyncio.Semaphore(at_once)

    async def one() -> None:
        async with slots:
            headers = {"Nats-Msg-Id": uuid.uuid4().hex}
            if hedged:
                await jsc.publish_hedged("bench.pub", _BODY, headers)
            else:
                await jsc.publish("bench.pub", _BODY, headers)

    wall, cpu = time.perf_counter(), time.process_time()
    await asyncio.gather(*(one() for _ in range(n)))
    return (
        (time.perf_counter() - wall) / n * 1e6,
        (time.process_time() - cpu) / n * 1e6,
    )


async def _main(url: str, n: int, rounds: int) -> dict[str, Any]:
    nc = await nats.connect(url)
    try:
        js = nc.jetstream()
        await js.add_stream(
            StreamConfig(name="BENCH_PUB", subjects=["bench.pub"], storage=StorageType.MEMORY)
        )
        jsc = JsClient(nc)
        await jsc.start()
        out: dict[str, Any] = {}
        for at_once in (1, 64):
            got: dict[str, list[tuple[float, float]]] = {"plain": [], "hedged": []}
            await _round(jsc, False, n // 10, at_once)  # (warm-up)
            for _ in range(rounds):
                for mode in ("plain", "hedged"):
                    got[mode].append(await _round(jsc, mode == "hedged", n, at_once))
            row = {
                mode: {
                    "wall_us": round(statistics.median(w for w, _ in runs), 1),
                    "cpu_us": round(statistics.median(c for _, c in runs), 1),
                }
                for mode, runs in got.items()
            }
            row["cpu_hedged_over_plain"] = round(
                row["hedged"]["cpu_us"] / row["plain"]["cpu_us"], 3
            )
            row["wall_hedged_over_plain"] = round(
                row["hedged"]["wall_us"] / row["plain"]["wall_us"], 3
            )
            out[f"{at_once}_at_once"] = row
        await jsc.stop()
        return out
    finally:
        await nc.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--publishes", type=int, default=5000, help="per round and mode")
    parser.add_argument("--rounds", type=int, default=4, help="alternated rounds (4)")
    args = parser.parse_args()
    with EmbeddedNats() as server:
        print(json.dumps(asyncio.run(_main(server.url, args.publishes, args.rounds)), indent=2))


if __name__ == "__main__":
    main()
