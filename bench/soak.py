"""Soak: does a long-running hub or agent process keep growing? ``python -m bench.soak --minutes N``

Starts an embedded nats-server (JetStream), one hub process (as ``reach-mesh hub`` does: the
entry points' runner, ``_runner.settle()`` once started; HTTP on, so metrics and the dashboard's
sampling run too) and one process with three agents (``max_concurrency=256``, echo handlers),
then drives a steady mixed load from this process at fixed rates (open loop, on a 10 ms tick):

* request-reply routes by capability (``--route-rate`` per second, proxy mode), each with its own
  ``task_id``;
* fanout(3) and chain(3) workflows, alternating (``--workflow-rate`` per second together), each
  with its own ``workflow_id``.

Every ``--sample`` seconds it reads VmRSS of the hub, the agents' process, nats-server and this
caller from ``/proc/<pid>/status``, with the counts done so far, prints a row and at the end
writes every sample, the growth per 10,000 tasks over the last part of the run (least-squares
slope over the samples after ``--judge-after`` of the run) and the run's settings to
``bench/results/soak.json`` (``--out``).

Caches fill up to their bounds first (a hub's pins: 50,000 to 100,000 of its own; an agent's
idempotency table: 10,000 results), so a run must be long enough to pass them; judge the slope
of the last part only.

``--faults`` mixes in the paths that keep state longer: 3 % of routes fail in the handler, 2 %
outlive their caller's timeout, 10 % go in direct mode, 10 % carry a session of their own; of
every 20 workflows, one has a step that fails (retried once) and three a step that outlives its
timeout.

Diagnosis (``--dump-every S``): every S seconds the hub and agents processes are sent SIGUSR1
and each, and this caller, writes ``<role>_<n>.json`` into ``--dump-dir``: live objects by type
(``gc.get_objects()``, what the collector tracks) and, when started with ``--tracemalloc``, the
top allocation sites (``tracemalloc``, 1 frame; the snapshot itself in ``<role>_<n>.tmsnap``,
for ``tracemalloc.Snapshot.load(...).compare_to(...)``) — compare two dumps to see what grows.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import gc
import json
import logging
import os
import signal
import sys
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._procs import stdin_closed
from bench._system import rss_mb
from bench.workflow_bench import child_processes
from reach_mesh import Client, MeshSettings, Step, _runner
from reach_mesh.agent import Agent, Task, TaskFailed
from reach_mesh.hub import Hub
from reach_mesh.server import EmbeddedNats

__all__ = ["main"]

CAPABILITY = "soak:echo:v1"
ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results" / "soak.json"

# ---------------------------------------------------------------------------- children


def _dumper(role: str, out_dir: str | None) -> Any:
    """SIGUSR1 handler: write live objects by type (and tracemalloc's top sites if tracing)."""
    count = 0

    def dump() -> None:
        nonlocal count
        if out_dir is None:
            return
        count += 1
        gc.collect()
        types = collections.Counter(type(o).__qualname__ for o in gc.get_objects())
        out: dict[str, Any] = {
            "role": role,
            "n": count,
            "time": time.time(),
            "rss_mb": rss_mb(os.getpid()),
            "gc_objects": sum(types.values()),
            "types": dict(types.most_common(80)),
        }
        import tracemalloc

        Path(out_dir).mkdir(parents=True, exist_ok=True)
        if tracemalloc.is_tracing():
            snap = tracemalloc.take_snapshot()
            stats = snap.statistics("lineno")
            out["traced_kb"] = round(sum(s.size for s in stats) / 1024, 1)
            out["tracemalloc"] = [
                {"site": str(s.traceback[0]), "kb": round(s.size / 1024, 1), "count": s.count}
                for s in stats[:60]
            ]
            snap.dump(str(Path(out_dir) / f"{role}_{count}.tmsnap"))
        (Path(out_dir) / f"{role}_{count}.json").write_text(json.dumps(out, indent=1))

    return dump


def _agents(settings: MeshSettings) -> list[Agent]:
    agents = []
    for i in range(3):
        agent = Agent(f"{settings.namespace}.echo.a{i}", settings=settings, max_concurrency=256)

        @agent.handler(CAPABILITY)
        async def echo(task: Task[Any]) -> Any:
            body = task.payload
            if isinstance(body, dict):
                if body.get("fail"):
                    raise TaskFailed("soak: failed on purpose", retryable=body["fail"] == "retry")
                if body.get("sleep"):
                    await asyncio.sleep(float(body["sleep"]))
            return body

        agents.append(agent)
    return agents


async def _child(args: argparse.Namespace) -> None:
    """``--role hub|agents``: serve until stdin closes (``child_processes``)."""
    settings = MeshSettings(nats_url=args.nats, namespace=args.ns)
    stop = stdin_closed()
    asyncio.get_running_loop().add_signal_handler(signal.SIGUSR1, _dumper(args.role, args.dump_dir))
    async with contextlib.AsyncExitStack() as stack:
        if args.role == "hub":
            hub = Hub(settings=settings.model_copy(update={"http_port": 0}))
            await stack.enter_async_context(hub)
        else:
            for agent in _agents(settings):
                await agent.start()
                stack.push_async_callback(agent.close)
        print("READY", flush=True)
        _runner.settle()  # as the entry points do once started
        await stop


# ---------------------------------------------------------------------------- caller


class _Load:
    """Fixed-rate open-loop load: routes and workflows, counted."""

    def __init__(
        self, mesh: Client, route_rate: float, wf_rate: float, run_id: str, faults: bool
    ) -> None:
        self.mesh = mesh
        self.faults = faults
        self.route_rate = route_rate
        self.wf_rate = wf_rate
        self.run_id = run_id
        self.done: collections.Counter[str] = collections.Counter()
        #: Answers that were not a success (expected with ``faults``), by kind and state.
        self.outcomes: collections.Counter[str] = collections.Counter()
        self.sent = collections.Counter[str]()
        self.slots = asyncio.Semaphore(4096)
        self.tasks: set[asyncio.Task[None]] = set()
        self.fan = [Step(capability=CAPABILITY, payload={"i": i}) for i in range(3)]

    @property
    def tasks_done(self) -> int:
        """Agent tasks completed: one per route, three per workflow."""
        return self.done["route"] + 3 * (self.done["fanout"] + self.done["chain"])

    def _route_args(self, i: int) -> dict[str, Any]:
        """A route's arguments; with ``faults``, some fail, time out, go direct or carry a
        session (each its own) — the paths a hub and an agent keep state for."""
        args: dict[str, Any] = {"payload": {"i": i, "pad": "x" * 100}, "timeout": 30}
        if not self.faults:
            return args
        r = i % 100
        if r < 3:
            args["payload"] = {"i": i, "fail": "no"}  # FAILED reply
        elif r < 5:
            args["payload"] = {"i": i, "sleep": 0.6}  # the caller's timeout passes first
            args["timeout"] = 0.3
        elif r < 15:
            args["mode"] = "direct"
        elif r < 25:
            args["session_id"] = f"{self.run_id}-s{i}"
        return args

    def _steps(self, i: int) -> list[Step]:
        if not self.faults or i % 10 >= 2:
            return self.fan
        if i % 20 == 0:  # one step fails (retryable: tried again, fails again)
            bad = Step(capability=CAPABILITY, payload={"fail": "retry"}, retries=1)
        else:  # one step outlives its timeout
            bad = Step(capability=CAPABILITY, payload={"sleep": 0.6}, timeout=0.3, retries=0)
        return [self.fan[0], bad, self.fan[2]]

    async def _one(self, kind: str, i: int) -> None:
        res: Any
        try:
            if kind == "route":
                res = await self.mesh.request(
                    capability=CAPABILITY, task_id=f"{self.run_id}-t{i}", **self._route_args(i)
                )
            elif kind == "fanout":
                res = await self.mesh.fanout(
                    self._steps(i), timeout=30, workflow_id=f"{self.run_id}-f{i}"
                )
            else:
                res = await self.mesh.chain(
                    self._steps(i), timeout=30, workflow_id=f"{self.run_id}-c{i}"
                )
            state = getattr(res, "state", None)
            self.done[kind] += 1
            if getattr(res, "ok", True) is False:
                self.outcomes[f"{kind}:{getattr(state, 'value', state)}"] += 1
        except Exception as err:
            self.done[kind] += 1
            self.outcomes[f"{kind}:{type(err).__name__}"] += 1
        finally:
            self.slots.release()

    async def _launch(self, kind: str) -> None:
        await self.slots.acquire()
        i = self.sent[kind]
        self.sent[kind] += 1
        task = asyncio.get_running_loop().create_task(self._one(kind, i))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def run(self, seconds: float, stop: asyncio.Event) -> None:
        t0 = time.perf_counter()
        routes = wfs = 0
        while (elapsed := time.perf_counter() - t0) < seconds and not stop.is_set():
            while routes < int(elapsed * self.route_rate):
                await self._launch("route")
                routes += 1
            while wfs < int(elapsed * self.wf_rate):
                await self._launch("fanout" if wfs % 2 == 0 else "chain")
                wfs += 1
            await asyncio.sleep(0.01)
        if self.tasks:
            await asyncio.wait(set(self.tasks), timeout=35)


def _slope(points: list[tuple[float, float]]) -> float | None:
    """Least-squares slope of y over x."""
    if len(points) < 3:
        return None
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    if sxx == 0:
        return None
    return sum((x - mx) * (y - my) for x, y in points) / sxx


async def _soak(args: argparse.Namespace) -> dict[str, Any]:
    ns = f"soak{uuid.uuid4().hex[:6]}"
    run_id = uuid.uuid4().hex[:8]
    seconds = args.minutes * 60.0
    samples: list[dict[str, Any]] = []
    dump_caller = _dumper("caller", args.dump_dir)
    if args.tracemalloc:
        import tracemalloc

        tracemalloc.start()
        # The children trace their allocations too (the variable is inherited).
        os.environ["PYTHONTRACEMALLOC"] = "1"
    extra = ["--ns", ns, *(["--dump-dir", args.dump_dir] if args.dump_dir else [])]
    async with EmbeddedNats() as server:
        assert server.proc is not None
        pids: dict[str, int] = {"nats_server": server.proc.pid, "caller": os.getpid()}
        async with child_processes(__file__, server.url, extra) as children:
            pids.update(children)
            settings = MeshSettings(nats_url=server.url, namespace=ns)
            async with Client(settings=settings) as mesh:
                load = _Load(mesh, args.route_rate, args.workflow_rate, run_id, args.faults)
                t0 = time.perf_counter()
                dumps = 0

                def sample() -> dict[str, Any]:
                    row: dict[str, Any] = {
                        "t_s": round(time.perf_counter() - t0, 1),
                        "tasks_done": load.tasks_done,
                        **{f"{k}_done": load.done[k] for k in ("route", "fanout", "chain")},
                        "not_ok": sum(load.outcomes.values()),
                        "in_flight": len(load.tasks),
                    }
                    for role in ("hub", "agents", "nats_server", "caller"):
                        row[f"{role}_rss_mb"] = rss_mb(pids[role])
                    return row

                def show(row: dict[str, Any]) -> None:
                    rss = {
                        k: row[f"{k}_rss_mb"] for k in ("hub", "agents", "nats_server", "caller")
                    }
                    print(
                        f"{row['t_s']:7.0f}s {row['tasks_done']:>9,} tasks "
                        f"{row['not_ok']:>6} not ok {row['in_flight']:>5} in flight | RSS MB "
                        f"hub {rss['hub']:7.1f}  agents {rss['agents']:7.1f}  "
                        f"nats {rss['nats_server']:7.1f}  caller {rss['caller']:7.1f}",
                        flush=True,
                    )

                samples.append(sample())
                show(samples[-1])
                stop = asyncio.Event()  # SIGINT / SIGTERM: stop the load, then as at the end
                for sig in (signal.SIGINT, signal.SIGTERM):
                    asyncio.get_running_loop().add_signal_handler(sig, stop.set)
                runner = asyncio.create_task(load.run(seconds, stop))
                next_dump = args.dump_every
                while not runner.done():
                    await asyncio.wait({runner}, timeout=args.sample)
                    samples.append(sample())
                    show(samples[-1])
                    if args.dump_every and samples[-1]["t_s"] >= next_dump:
                        next_dump += args.dump_every
                        dumps += 1
                        for role in ("hub", "agents"):
                            os.kill(pids[role], signal.SIGUSR1)
                        dump_caller()
                await runner
                await asyncio.sleep(2)
                samples.append(sample())
                show(samples[-1])
                outcomes = dict(load.outcomes)
    judged = [s for s in samples if s["t_s"] >= args.judge_after * seconds]
    slopes: dict[str, Any] = {}
    for role in ("hub", "agents", "nats_server", "caller"):
        pts = [(s["tasks_done"], s[f"{role}_rss_mb"]) for s in judged if s[f"{role}_rss_mb"]]
        k = _slope(pts)
        slopes[role] = None if k is None else round(k * 1024 * 10_000, 1)
    return {
        "command": "python -m bench.soak " + " ".join(sys.argv[1:]),
        "minutes": args.minutes,
        "route_rate": args.route_rate,
        "workflow_rate": args.workflow_rate,
        "namespace": ns,
        "pids": pids,
        "faults": args.faults,
        "not_ok": outcomes,
        "judge_after_fraction": args.judge_after,
        "slope_kb_per_10k_tasks": slopes,
        "samples": samples,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__)
    # The defaults are the run docs/operations.md reports.
    parser.add_argument("--minutes", type=float, default=20.0)
    parser.add_argument("--route-rate", type=float, default=400.0, help="routes per second")
    parser.add_argument(
        "--workflow-rate", type=float, default=100.0, help="fanout(3) + chain(3) per second"
    )
    parser.add_argument("--sample", type=float, default=15.0, help="seconds between samples")
    parser.add_argument(
        "--judge-after", type=float, default=0.6, help="slope over the run after this fraction"
    )
    parser.add_argument("--out", default=str(RESULTS))
    parser.add_argument("--dump-dir", default=None, help="dumps go here (see above)")
    parser.add_argument("--dump-every", type=float, default=0.0, help="seconds between dumps")
    parser.add_argument("--tracemalloc", action="store_true", help="trace allocations")
    parser.add_argument(
        "--faults",
        action="store_true",
        help="mix in failing and timing-out tasks and steps, direct mode and sessions",
    )
    parser.add_argument("--role", choices=["hub", "agents"], help=argparse.SUPPRESS)
    parser.add_argument("--nats", help=argparse.SUPPRESS)
    parser.add_argument("--ns", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.ERROR)
    if args.role:
        _runner.run(_child(args))
        return 0
    result = _runner.run(_soak(args))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k != "samples"}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
