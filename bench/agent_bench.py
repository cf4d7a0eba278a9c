"""The agent SDK's request path alone: agent-process CPU per request and throughput.

``python bench/agent_bench.py [--inflight 200] [--seconds 4] [--repeats 3] [--trace]``

One nats-server, one hub (``python -m bench._procs hub``: the agent must register before it
serves), and one reach-mesh agent (``bench.echo.a1``, handler returns ``task.payload``,
``max_concurrency=256``) in its own process on uvloop, as ``bench._procs`` runs it. This process
is a raw nats-py caller that sends ``TaskEnvelope`` JSON straight to the agent's task subject with
a ``traceparent`` header (what a direct-mode ``Client`` sends), ``--inflight`` requests in
flight, and decodes each reply. The hub is off the data path. The agent process's CPU is read
from ``/proc/<pid>/stat`` over each measured window; ``--raw`` also measures a raw nats-py echo
responder in the same kind of process (the floor, ``msg.respond(msg.data)``).

Prints one JSON object: per system, the median (and min/max) over repeats of req/s and agent
CPU µs per request.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import statistics
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make ``bench`` and ``reach_mesh`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import nats
from nats.aio.client import Client as NATS

from bench._system import ChildProcess, cpu_sample, python
from reach_mesh import _runner
from reach_mesh.agent import Agent, Task
from reach_mesh.config import load_settings
from reach_mesh.server import EmbeddedNats
from reach_mesh.tracing import inject

AGENT_ID = "bench.echo.a1"
CAPABILITY = "bench:echo:v1"
RAW_SUBJECT = "bench.agentbench.raw"
PAYLOAD: dict[str, Any] = {"text": "the quick brown fox jumps over the lazy dog " * 2, "n": 42}


# ---------------------------------------------------------------------------- child process


async def _echo_task(task: Task[Any]) -> Any:
    return task.payload


async def _serve(url: str, system: str, trace: bool, profile: str | None) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    if trace:
        from reach_mesh.tracing import configure_tracing, memory_exporter

        configure_tracing("bench-agent", exporter="memory")
    if system == "raw":
        nc = await nats.connect(url, name="bench-raw", max_reconnect_attempts=3)

        async def echo(msg: Any) -> None:
            await msg.respond(msg.data)

        await nc.subscribe(RAW_SUBJECT, queue="raw", cb=echo, pending_msgs_limit=-1)
        await nc.flush()
        print("READY {}", flush=True)
        await stop.wait()
        await nc.close()
        return
    agent = Agent(
        AGENT_ID,
        settings=load_settings(nats_url=url),
        max_concurrency=256,
        durable_work=False,
    )

    agent.handler(CAPABILITY)(_echo_task)
    profiler = None
    if profile:
        import cProfile

        profiler = cProfile.Profile()
    async with agent:
        print("READY {}", flush=True)
        if profiler is not None:
            profiler.enable()
        while not stop.is_set():
            # Spans pile up in the memory exporter with tracing on: drop them now and then.
            await asyncio.sleep(0.5)
            if trace and (exporter := memory_exporter()) is not None:
                exporter.clear()
        if profiler is not None:
            profiler.disable()
            profiler.dump_stats(profile)


# ---------------------------------------------------------------------------- load


def _envelope(i: int) -> bytes:
    body = {
        "task_id": f"t{i:x}",
        "attempt": 1,
        "capability": CAPABILITY,
        "payload": PAYLOAD,
        "namespace": "bench",
        "timeout": 30.0,
    }
    return json.dumps(body, separators=(",", ":")).encode()


async def _drive(nc: NATS, subject: str, inflight: int, seconds: float, start: int) -> int:
    """``inflight`` closed-loop workers for ``seconds``; returns the number of good replies."""
    counter = [start, 0]
    deadline = time.perf_counter() + seconds

    async def worker() -> None:
        while time.perf_counter() < deadline:
            counter[0] += 1
            msg = await nc.request(subject, _envelope(counter[0]), timeout=10, headers=inject({}))
            reply = json.loads(msg.data)
            if subject == RAW_SUBJECT or reply.get("state") == "SUCCEEDED":
                counter[1] += 1
            else:
                raise RuntimeError(f"unexpected reply: {msg.data[:300]!r}")

    await asyncio.gather(*(worker() for _ in range(inflight)))
    return counter[1]


def _spread(xs: list[float]) -> dict[str, float]:
    return {
        "median": round(statistics.median(xs), 1),
        "min": round(min(xs), 1),
        "max": round(max(xs), 1),
    }


_SCRIPT = str(Path(__file__).resolve())


async def _measure(url: str, system: str, args: argparse.Namespace) -> dict[str, Any]:
    argv = [python(), _SCRIPT, "--serve", url, "--system", system]
    if args.trace:
        argv.append("--trace")
    if args.profile and system == "agent":
        argv += ["--profile", args.profile]
    child = ChildProcess(argv, name=f"{system}-responder")
    await child.start("READY ", timeout=45)
    subject = RAW_SUBJECT if system == "raw" else f"reach.agent.{AGENT_ID}.task"
    nc = await nats.connect(url, name="agent-bench-caller", max_reconnect_attempts=3)
    rps: list[float] = []
    cpu_us: list[float] = []
    try:
        await _drive(nc, subject, 16, args.warmup, 0)
        for rep in range(args.repeats):
            before = cpu_sample(child.pid)
            done = await _drive(nc, subject, args.inflight, args.seconds, (rep + 1) << 32)
            after = cpu_sample(child.pid)
            assert before is not None and after is not None
            rps.append(done / (after.wall - before.wall))
            cpu_us.append((after.cpu_s - before.cpu_s) / max(done, 1) * 1e6)
    finally:
        await nc.close()
        await child.stop()
    return {"req_per_s": _spread(rps), "cpu_us_per_req": _spread(cpu_us)}


async def _main(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {
        "inflight": args.inflight,
        "seconds": args.seconds,
        "repeats": args.repeats,
        "tracing": args.trace,
    }
    async with EmbeddedNats() as server:
        hub = ChildProcess(
            [python(), "-m", "bench._procs", "hub", "--nats", server.url], name="hub"
        )
        await hub.start("READY ")
        try:
            for system in ["agent", *(["raw"] if args.raw else [])]:
                out[system] = await _measure(server.url, system, args)
        finally:
            await hub.stop()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--inflight", type=int, default=200)
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--warmup", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--trace", action="store_true", help="tracing on in the agent")
    parser.add_argument("--raw", action="store_true", help="also measure a raw nats-py echo")
    parser.add_argument(
        "--profile", metavar="FILE", help="cProfile the agent process into FILE (pstats)"
    )
    parser.add_argument("--serve", metavar="URL", help=argparse.SUPPRESS)
    parser.add_argument("--system", default="agent", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve:
        _runner.run(_serve(args.serve, args.system, args.trace, args.profile))
        return 0
    print(json.dumps(_runner.run(_main(args)), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
