"""Durable workflow benchmark: fanout(3) and chain(3) end to end, with the JetStream floor.

Runs an embedded nats-server (or uses ``--nats URL``), one hub and three agents in this process,
and measures, in the same run:

* fanout of 3 and chain of 3: sequential end-to-end latency (p50/p99) as a caller sees it
  (submit → result), and sustained workflows/s with many in flight;
* the floor: JetStream publish with a synchronous ack (p50/p99, msg/s) and pull-consume of the
  same number of messages (msg/s) — every workflow needs several such round trips;
* with ``split``, the bare exchanges (``bench/workflow_floor.py``): a fanout(3)'s and a
  chain(3)'s NATS messages between the same processes with no engine in between, at full load
  and at the engine's own open-loop rates — what the engine costs above them;
* what one workflow costs, over the sustained phase (``cost``): JetStream operations counted
  from the server's own statistics (``$JS.API`` requests from the account info, messages stored
  per stream), JetStream bytes kept (for ``workflow_retention``), and CPU µs per process
  (``bench/_jsstats.py``), with each process's system calls, bytes and context switches
  (``proc_counts``: ``bench._system.PROC_COUNTS``).

``python bench/workflow_bench.py --quick`` prints one JSON object. The bench harness imports
:func:`run_workflow_bench`. With ``--split`` and ``BENCH_PROFILE_HUB=DIR`` in the environment,
the hub process runs under pyinstrument and writes its profile to DIR (``hub_profile.txt``,
``.html``, and the hot spots of its busy samples in ``hub_profile_top.json``);
``BENCH_PROFILE_AGENTS=DIR`` does the same for the agents' process (``agents_profile*``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import logging
import os
import sys
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import nats

from bench._jsstats import COUNTER_NAME, ClientMessages, CpuCounter, JsCounter, free_port, per_unit
from bench._load import open_loop
from bench._procs import _Profiling, stdin_closed
from bench.workflow_floor import run_floor
from reach_mesh import Client, MeshSettings, Step, _runner
from reach_mesh.agent import Agent, Task
from reach_mesh.hub import Hub
from reach_mesh.server import EmbeddedNats

__all__ = [
    "at_rates",
    "child_processes",
    "engine_rates",
    "measure_cost",
    "run_workflow_bench",
]

#: The low fixed load of the open-loop points (issue 15: p50 at 100 workflows/s).
LOW_RATE = 100.0


def _pct(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    s = sorted(values)
    return s[min(len(s) - 1, int(q * (len(s) - 1) + 0.5))]


def _lat(values_s: list[float]) -> dict[str, float]:
    ms = [v * 1000 for v in values_s]
    return {
        "n": len(ms),
        "p50_ms": round(_pct(ms, 0.50), 3),
        "p99_ms": round(_pct(ms, 0.99), 3),
        "mean_ms": round(sum(ms) / len(ms), 3) if ms else 0.0,
    }


async def _sequential(call: Any, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        await call()
        out.append(time.perf_counter() - t0)
    return out


async def _sustained(call: Any, concurrency: int, duration: float) -> dict[str, float]:
    done = 0
    errors = 0
    stop = time.perf_counter() + duration

    async def worker() -> None:
        nonlocal done, errors
        while time.perf_counter() < stop:
            try:
                await call()
                done += 1
            except Exception:
                errors += 1

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    elapsed = time.perf_counter() - t0
    return {
        "concurrency": concurrency,
        "seconds": round(elapsed, 3),
        "completed": done,
        "errors": errors,
        "per_s": round(done / elapsed, 1),
    }


#: :func:`measure_cost` with its server and processes bound: ``await cost(run)``.
Costing = Callable[
    [Callable[[], Awaitable[dict[str, Any]]]], Awaitable[tuple[dict[str, Any], dict[str, Any]]]
]


#: What an open-loop point keeps (and ``cpu_us``: CPU µs per workflow, all processes, summed).
_POINT = ("offered_rps", "ok", "errors", "unfinished", "achieved_rps", "p50_ms", "p99_ms")


def engine_rates(sustained_per_s: float) -> dict[str, float]:
    """The open-loop points of a system that sustained ``sustained_per_s``: :data:`LOW_RATE`
    and half that rate."""
    return {"100": LOW_RATE, "half_sustained": max(1.0, round(sustained_per_s / 2, 1))}


async def at_rates(
    call: Any, rates: dict[str, float], seconds: float, cost: Costing | None = None
) -> dict[str, Any]:
    """Latency at fixed offered loads (``rates``: name → workflows/s, e.g.
    :func:`engine_rates`), open loop (each workflow timed from its due time, so a stall counts
    against every workflow due meanwhile). With ``cost`` (:func:`measure_cost` bound to the
    processes), each point has the CPU µs one workflow took there, all processes summed: at a
    moderate rate each message is more of a wake-up of its own than at full load."""
    out: dict[str, Any] = {}
    for key, rate in rates.items():

        async def point(rate: float = rate) -> dict[str, Any]:
            pt = await open_loop(call, rate, seconds)
            return {**{k: pt[k] for k in _POINT}, "completed": pt["ok"]}

        if cost is None:
            pt = await point()
        else:
            pt, used = await cost(point)
            pt["cpu_us"] = round(sum(used["cpu_us"].values()))
        pt.pop("completed")
        out[key] = pt
    return out


async def measure_cost(
    nats_url: str, pids: dict[str, int | None], run: Any, monitor_url: str | None = None
) -> tuple[dict[str, Any], dict[str, Any]]:
    """``await run()`` (a phase returning a dict with ``completed``) with its cost per completed
    unit: JetStream operations and bytes from the server's statistics, CPU µs per process, and
    (with the server's ``monitor_url``) the messages clients sent to the server."""
    nc = await nats.connect(nats_url, name=COUNTER_NAME, max_reconnect_attempts=3)
    msgs = ClientMessages(monitor_url) if monitor_url else None
    try:
        js_count = JsCounter(nc.jetstream(timeout=10.0))
        cpu = CpuCounter(pids)
        await js_count.start()
        if msgs is not None:
            await msgs.start()
        cpu.start()
        out: dict[str, Any] = await run()
        js = await js_count.stop()
        # After the settle pause, as the JetStream figures are: trailing work counts.
        cpu_s = cpu.stop()
        sent = await msgs.stop() if msgs is not None else None
    finally:
        await nc.close()
    return out, per_unit(js, cpu_s, int(out["completed"]), sent, cpu.counts)


async def _floor(nats_url: str, n: int) -> dict[str, Any]:
    """JetStream publish-with-ack and pull-consume of ``n`` messages (R1, file storage)."""
    nc = await nats.connect(nats_url)
    js = nc.jetstream()
    stream = f"BENCH_FLOOR_{uuid.uuid4().hex[:8]}"
    subject = f"bench.floor.{stream.lower()}"
    await js.add_stream(name=stream, subjects=[subject])
    try:
        body = b'{"payload": 1}'
        lat = []
        t0 = time.perf_counter()
        for _ in range(n):
            t = time.perf_counter()
            await js.publish(subject, body)
            lat.append(time.perf_counter() - t)
        pub_s = time.perf_counter() - t0
        sub = await js.pull_subscribe(subject, durable="floor", stream=stream)
        got = 0
        t0 = time.perf_counter()
        while got < n:
            msgs = await sub.fetch(min(256, n - got), timeout=5)
            for m in msgs:
                await m.ack()
            got += len(msgs)
        pull_s = time.perf_counter() - t0
        return {
            "js_publish_ack": {**_lat(lat), "per_s": round(n / pub_s, 1)},
            "js_pull_consume": {"n": n, "per_s": round(n / pull_s, 1)},
        }
    finally:
        await js.delete_stream(stream)
        await nc.close()


def _agents(settings: MeshSettings) -> list[Agent]:
    agents = []
    for i in range(3):
        agent = Agent(f"{settings.namespace}.echo.a{i}", settings=settings, max_concurrency=256)

        @agent.handler("bench:echo:v1")
        async def echo(task: Task[Any]) -> Any:
            return task.payload

        agents.append(agent)
    return agents


@contextlib.contextmanager
def _profiled(role: str) -> Iterator[None]:
    """``BENCH_PROFILE_HUB=DIR`` (``BENCH_PROFILE_AGENTS=DIR``): the hub (the agents' process)
    under pyinstrument meanwhile (the hot spots of its busy samples in
    DIR/<role>_profile_top.json, as ``make bench PROFILE=1``)."""
    out = os.environ.get(f"BENCH_PROFILE_{role.upper()}")
    profiling = None if out is None else _Profiling(Path(out), role)
    if profiling is not None:
        profiling.start()
    try:
        yield
    finally:
        if profiling is not None:
            profiling.stop()


async def _child(role: str, nats_url: str, ns: str) -> None:
    """``--role hub|agents``: serve until stdin closes (the parent exits or kills us)."""
    settings = MeshSettings(nats_url=nats_url, namespace=ns)
    stop = stdin_closed()
    if role == "hub":
        async with Hub(settings=settings):
            print("READY", flush=True)
            _runner.settle()
            with _profiled("hub"):
                await stop
    else:
        agents = _agents(settings)
        for agent in agents:
            await agent.start()
        print("READY", flush=True)
        _runner.settle()
        with _profiled("agents"):
            await stop
        for agent in agents:
            await agent.close()


@contextlib.asynccontextmanager
async def child_processes(
    script: str, nats_url: str, args: list[str]
) -> AsyncIterator[dict[str, int]]:
    """``script --role hub`` and ``script --role agents`` (with ``--nats nats_url`` and
    ``args``) in their own processes, each ready once it prints READY; yields their pids.
    Closing their stdin stops them."""
    procs: list[asyncio.subprocess.Process] = []
    try:
        for role in ("hub", "agents"):
            proc = await asyncio.create_subprocess_exec(
                sys.executable,
                script,
                "--role",
                role,
                "--nats",
                nats_url,
                *args,
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
            )
            procs.append(proc)
            assert proc.stdout is not None
            line = await asyncio.wait_for(proc.stdout.readline(), 30)
            if not line.startswith(b"READY"):
                raise RuntimeError(f"{script} {role} process did not start")
        yield {"hub": procs[0].pid, "agents": procs[1].pid}
    finally:
        for proc in reversed(procs):
            if proc.stdin is not None:
                proc.stdin.close()
            try:
                await asyncio.wait_for(proc.wait(), 10)
            except TimeoutError:
                proc.kill()


async def run_workflow_bench(
    nats_url: str,
    quick: bool,
    *,
    split: bool = False,
    server_pid: int | None = None,
    monitor_url: str | None = None,
) -> dict[str, Any]:
    """Fanout(3)/chain(3) latency and throughput plus the JetStream floor, as one dict.

    ``split``: the hub and the agents run in their own processes (the caller stays here; the
    hub's CPU per workflow is then its own); otherwise all three share this process and its
    event loop. ``server_pid``: nats-server's, for its CPU per workflow; ``monitor_url``: its
    monitoring endpoint, for the messages clients send it per workflow.
    """
    ns = f"wfb{uuid.uuid4().hex[:6]}"
    settings = MeshSettings(nats_url=nats_url, namespace=ns)
    n_seq = 200 if quick else 1000
    duration = 3.0 if quick else 10.0
    rate_s = 2.0 if quick else 5.0  # per open-loop point
    concurrency = 64
    agents: list[Agent] = []
    pids: dict[str, int | None] = {"nats_server": server_pid}
    async with contextlib.AsyncExitStack() as stack:
        if split:
            procs = child_processes(__file__, nats_url, ["--ns", ns])
            pids.update(await stack.enter_async_context(procs))
            pids["caller"] = os.getpid()
        else:
            pids["hub_agents_caller"] = os.getpid()
            await stack.enter_async_context(Hub(settings=settings))
            agents = _agents(settings)
            for agent in agents:
                await agent.start()
        try:
            async with Client(settings=settings) as mesh:
                fan = [Step(capability="bench:echo:v1", payload={"i": i}) for i in range(3)]
                chain = [Step(capability="bench:echo:v1", payload={"i": 0}), *fan[1:]]

                async def one_fanout() -> None:
                    res = await mesh.fanout(fan, timeout=30)
                    if not res.ok:
                        raise RuntimeError(res.state)

                async def one_chain() -> None:
                    res = await mesh.chain(chain, timeout=30)
                    if not res.ok:
                        raise RuntimeError(res.state)

                await _sequential(one_fanout, 20)  # warm-up
                await _sequential(one_chain, 20)
                fan_lat = await _sequential(one_fanout, n_seq)
                chain_lat = await _sequential(one_chain, n_seq)
                cost = functools.partial(measure_cost, nats_url, pids, monitor_url=monitor_url)
                fan_tp, fan_cost = await cost(lambda: _sustained(one_fanout, concurrency, duration))
                chain_tp, chain_cost = await cost(
                    lambda: _sustained(one_chain, concurrency, duration)
                )
                fan_rates = await at_rates(one_fanout, engine_rates(fan_tp["per_s"]), rate_s, cost)
                chain_rates = await at_rates(
                    one_chain, engine_rates(chain_tp["per_s"]), rate_s, cost
                )
        finally:
            for agent in agents:
                await agent.close()
    floor = await _floor(nats_url, n_seq)
    bare: dict[str, Any] = {"available": False, "reason": "hub and agents not in processes"}
    if split:
        try:
            # At the engine's own half rates too: what the messages alone cost at that load.
            halves = {
                "fanout3": fan_rates["half_sustained"]["offered_rps"],
                "chain3": chain_rates["half_sustained"]["offered_rps"],
            }
            out = await run_floor(
                nats_url, quick, server_pid=server_pid, monitor_url=monitor_url, rates=halves
            )
            bare = {"available": True, **out}
        except Exception as err:
            bare = {"available": False, "reason": f"{type(err).__name__}: {err}"}
    pub_p50 = floor["js_publish_ack"]["p50_ms"] or 1e-9
    fan_row: dict[str, Any] = {
        **_lat(fan_lat),
        "sustained": fan_tp,
        "cost": fan_cost,
        "open_loop": fan_rates,
    }
    chn_row: dict[str, Any] = {
        **_lat(chain_lat),
        "sustained": chain_tp,
        "cost": chain_cost,
        "open_loop": chain_rates,
    }
    return {
        "quick": quick,
        "fanout3": fan_row,
        "chain3": chn_row,
        "floor": floor,
        "bare": bare,
        "ratios": {
            "fanout3_p50_over_js_publish_p50": round(fan_row["p50_ms"] / pub_p50, 2),
            "chain3_p50_over_js_publish_p50": round(chn_row["p50_ms"] / pub_p50, 2),
            "fanout3_per_s_over_js_publish_per_s": round(
                fan_tp["per_s"] / floor["js_publish_ack"]["per_s"], 4
            ),
        },
        "targets": {
            "fanout3_p50_le_10ms": fan_row["p50_ms"] <= 10.0,
            "fanout3_ge_500_per_s": fan_tp["per_s"] >= 500,
        },
        "retention_s": settings.workflow_retention,
        "setup": (
            "nats-server; hub, 3 agents (one process) and caller each in their own process "
            "(hub and agents on the entry points' event loop)"
            if split
            else "nats-server; hub, 3 agents and the caller in one process (one event loop)"
        ),
    }


async def _main(args: argparse.Namespace) -> dict[str, Any]:
    if args.nats:
        return await run_workflow_bench(args.nats, args.quick, split=args.split)
    port = free_port()
    async with EmbeddedNats(http_port=port) as server:
        pid = server.proc.pid if server.proc is not None else None
        return await run_workflow_bench(
            server.url,
            args.quick,
            split=args.split,
            server_pid=pid,
            monitor_url=f"http://127.0.0.1:{port}",
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a short run (~15 s)")
    parser.add_argument("--nats", default=None, help="use this NATS URL instead of embedding")
    parser.add_argument(
        "--split", action="store_true", help="hub and agents in their own processes"
    )
    parser.add_argument("--role", choices=["hub", "agents"], help=argparse.SUPPRESS)
    parser.add_argument("--ns", help=argparse.SUPPRESS)
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR)
    if args.role:
        # As `reach-mesh hub` and `reach_mesh.agent.run` do (uvloop when installed).
        _runner.run(_child(args.role, args.nats, args.ns))
        return
    print(json.dumps(asyncio.run(_main(args)), indent=2))


if __name__ == "__main__":
    main()
