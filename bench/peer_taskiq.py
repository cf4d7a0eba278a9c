"""The workflow peer: taskiq with taskiq-nats on the same nats-server, fanout(3) and chain(3).

What a user of taskiq writes for the same two jobs, with taskiq's own primitives:

* fanout(3): three ``echo.kiq(...)`` gathered, then their three results gathered;
* chain(3): ``kiq`` → ``wait_result`` → ``kiq`` with the previous result → ... (sequential
  awaits; taskiq-pipelines would add a middleware and a dependency for the same round trips).

Broker: ``taskiq_nats.PullBasedJetStreamBroker`` (tasks in a JetStream stream, file storage,
R1, a durable pull consumer; the worker fetches up to :data:`PULL_BATCH` at a time).
Results: a JetStream KV bucket (``bench/_taskiq_kv.py``: file storage, R1, history 1, results
kept, no age limit). The result backend taskiq-nats ships, ``NATSObjectStoreResultBackend``,
creates a JetStream consumer per read and fails under this load (see that module). A caller
learns that a result is ready by polling it (taskiq's ``wait_result``, every
:data:`CHECK_INTERVAL` s; its default is 0.2 s). The worker acks
a task when its result is saved (taskiq's default ``when_saved``). The worker runs in its own
process (``python -m bench.peer_taskiq worker --nats URL``, uvloop when installed) with taskiq's
``run_receiver_task``, as ``taskiq worker`` would, at most :data:`MAX_ASYNC_TASKS` at once.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import logging
import os
import signal
import sys
from collections.abc import Awaitable, Callable
from importlib import metadata
from typing import Any

from bench._system import ChildProcess, python
from bench.workflow_bench import (
    _lat,
    _sequential,
    _sustained,
    at_rates,
    engine_rates,
    measure_cost,
)
from reach_mesh import _runner

__all__ = ["CHECK_INTERVAL", "run_taskiq_peer"]

STREAM = "BENCH_TASKIQ"
SUBJECT = "bench.taskiq.tasks"
DURABLE = "bench_taskiq"
RESULTS_BUCKET = "bench_taskiq_results"
#: Poll interval of ``wait_result`` (taskiq's default is 0.2 s).
CHECK_INTERVAL = 0.005
PULL_BATCH = 32
MAX_ASYNC_TASKS = 256


def _broker(url: str) -> tuple[Any, Any]:
    """The broker (with its result backend) and the echo task, as caller and worker share them."""
    from nats.js.api import StorageType, StreamConfig
    from taskiq_nats import PullBasedJetStreamBroker

    from bench._taskiq_kv import KvResultBackend

    broker = PullBasedJetStreamBroker(
        url,
        subject=SUBJECT,
        stream_name=STREAM,
        durable=DURABLE,
        stream_config=StreamConfig(name=STREAM, subjects=[SUBJECT], storage=StorageType.FILE),
        pull_consume_batch=PULL_BATCH,
        pull_consume_timeout=1.0,
    ).with_result_backend(KvResultBackend(url, RESULTS_BUCKET))

    @broker.task(task_name="bench_echo")
    async def echo(payload: dict[str, Any]) -> dict[str, Any]:
        return payload

    return broker, echo


async def _worker(url: str) -> None:
    from taskiq.api import run_receiver_task

    broker, _ = _broker(url)
    broker.is_worker_process = True
    await broker.startup()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    receiver = asyncio.create_task(
        run_receiver_task(broker, max_async_tasks=MAX_ASYNC_TASKS, run_startup=False)
    )
    print("READY " + json.dumps({"taskiq": metadata.version("taskiq")}), flush=True)
    _runner.settle()
    await stop.wait()
    receiver.cancel()
    with contextlib.suppress(BaseException):
        await receiver
    await broker.shutdown()


def _versions() -> dict[str, str]:
    return {d: metadata.version(d) for d in ("taskiq", "taskiq-nats")}


async def run_taskiq_peer(
    nats_url: str,
    quick: bool,
    *,
    server_pid: int | None = None,
    monitor_url: str | None = None,
    n_seq: int | None = None,
    duration: float | None = None,
) -> dict[str, Any]:
    """fanout(3) and chain(3) through taskiq: sequential p50/p99, sustained throughput, cost.

    ``n_seq`` sequential workflows of each kind (default 100 quick, 1000 full) and ``duration``
    seconds with 64 in flight (3 quick, 10 full)."""
    try:
        versions = _versions()
        broker, echo = _broker(nats_url)
    except (ImportError, metadata.PackageNotFoundError) as err:
        return {
            "available": False,
            "reason": f"taskiq/taskiq-nats not installed ({err}): pip install 'reach-mesh[bench]'",
        }
    n_seq = n_seq or (100 if quick else 1000)
    duration = duration or (3.0 if quick else 10.0)
    warmup = min(20, n_seq)
    rate_s = min(duration, 2.0 if quick else 5.0)  # per open-loop point
    concurrency = 64
    worker = ChildProcess(
        [python(), "-m", "bench.peer_taskiq", "worker", "--nats", nats_url], name="taskiq worker"
    )
    await worker.start("READY ", timeout=45)
    await broker.startup()
    try:
        pids = {"nats_server": server_pid, "worker": worker.pid, "caller": os.getpid()}

        async def result(task: Any) -> Any:
            res = await task.wait_result(check_interval=CHECK_INTERVAL, timeout=30)
            if res.is_err:
                raise RuntimeError(f"taskiq task failed: {res.error!r}")
            return res.return_value

        async def one_fanout() -> None:
            tasks = await asyncio.gather(*(echo.kiq({"i": i}) for i in range(3)))
            await asyncio.gather(*(result(t) for t in tasks))

        async def one_chain() -> None:
            value: Any = {"i": 0}
            for _ in range(3):
                value = await result(await echo.kiq(value))

        calls: dict[str, Callable[[], Awaitable[None]]] = {
            "fanout3": one_fanout,
            "chain3": one_chain,
        }
        out: dict[str, Any] = {}
        for name, call in calls.items():
            await _sequential(call, warmup)
            lat = await _sequential(call, n_seq)
            costing = functools.partial(measure_cost, nats_url, pids, monitor_url=monitor_url)
            tp, cost = await costing(lambda c=call: _sustained(c, concurrency, duration))
            rates = await at_rates(call, engine_rates(tp["per_s"]), rate_s, costing)
            out[name] = {**_lat(lat), "sustained": tp, "cost": cost, "open_loop": rates}
    finally:
        await broker.shutdown()
        await worker.stop()
    return {
        "available": True,
        "versions": versions,
        **out,
        "setup": (
            f"taskiq {versions['taskiq']} + taskiq-nats {versions['taskiq-nats']}: "
            f"PullBasedJetStreamBroker (stream {STREAM}, file, R1, durable pull consumer, "
            f"fetch batch {PULL_BATCH}); results in a JetStream KV bucket (file, R1, history 1, "
            "kept without age limit; taskiq-nats's NATSObjectStoreResultBackend creates a "
            "consumer per read and hits the server's consumer limit at this load); ack when the "
            "result is saved; worker in its own "
            f"process (run_receiver_task, {MAX_ASYNC_TASKS} tasks at once); the caller polls "
            f"results every {CHECK_INTERVAL * 1000:g} ms (wait_result); fanout = gather of 3 "
            "kiq + gather of 3 results, chain = 3 sequential kiq + wait_result"
        ),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.peer_taskiq")
    parser.add_argument("role", choices=["worker", "run"])
    parser.add_argument("--nats", required=True)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, stream=sys.stdout)
    if args.role == "worker":
        _runner.run(_worker(args.nats))
    else:
        print(json.dumps(_runner.run(run_taskiq_peer(args.nats, args.quick)), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
