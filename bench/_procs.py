"""Child-process entry points of the benchmark: ``python -m bench._procs hub|responders``.

``hub`` runs one reach-mesh hub the way ``reach-mesh hub`` does (``reach_mesh._runner.run``:
uvloop when installed, as the CLI and ``reach_mesh.agent.run`` do; default settings), optionally
with tracing on (OpenTelemetry SDK, 100 % sampling, in-memory exporter emptied every half second)
and optionally profiled with pyinstrument between SIGUSR1 (start) and SIGUSR2 (stop and write the
profile).

``responders`` hosts everything that answers the benchmark's requests, each on its own NATS
connection, in one process on one event loop, chosen the way ``reach_mesh.agent.run`` chooses it:

* the reach-mesh agent ``bench.echo.a1`` (capability ``bench:echo:v1``, echoes its payload);
* a raw nats-py queue-group responder on ``bench.raw.echo`` (``msg.respond(msg.data)``): the floor;
* a hand-written ``nats.micro`` service with a queue group on ``bench.micro.echo`` (decodes and
  re-encodes the JSON, as a user's service would);
* an ``agentbus`` worker (``AgentBusWorker`` with an in-process runner instead of a subprocess).

Each prints one ``READY {json}`` line when it serves and exits cleanly on SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import signal
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from reach_mesh import _runner
from reach_mesh.agent import Agent, Task
from reach_mesh.config import load_settings

__all__ = [
    "AGENTBUS_CALLER",
    "AGENTBUS_WORKER",
    "MICRO_SUBJECT",
    "RAW_SUBJECT",
    "main",
    "stdin_closed",
]

RAW_SUBJECT = "bench.raw.echo"
MICRO_SUBJECT = "bench.micro.echo"
AGENTBUS_WORKER = "benchworker"
AGENTBUS_CALLER = "benchcaller"
ECHO_AGENT = "bench.echo.a1"
ECHO_CAPABILITY = "bench:echo:v1"


def stdin_closed() -> asyncio.Future[None]:
    """Done once this process's stdin closes: how a child started by
    ``bench.workflow_bench.child_processes`` learns that its parent is done with it (or
    gone)."""
    loop = asyncio.get_running_loop()
    stop: asyncio.Future[None] = loop.create_future()

    def closed() -> None:
        if not stop.done():
            stop.set_result(None)

    loop.add_reader(sys.stdin.fileno(), closed)
    return stop


def _stop_event() -> asyncio.Event:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    return stop


async def _clear_spans_forever() -> None:
    from reach_mesh.tracing import memory_exporter

    while True:
        await asyncio.sleep(0.5)
        exporter = memory_exporter()
        if exporter is not None:
            exporter.clear()


def _tracing(on: bool, service: str) -> asyncio.Task[None] | None:
    if not on:
        return None
    from reach_mesh.tracing import configure_tracing, tracing_enabled

    configure_tracing(service, exporter="memory")
    assert tracing_enabled(), "tracing did not turn on"
    return asyncio.create_task(_clear_spans_forever())


# ---------------------------------------------------------------------------- hub


class _Profiling:
    """pyinstrument between SIGUSR1 and SIGUSR2; writes text, HTML and a JSON of hot spots."""

    def __init__(self, out_dir: Path, name: str = "hub") -> None:
        self.out_dir = out_dir
        self.name = name
        self.profiler: Any = None

    def start(self) -> None:
        from pyinstrument import Profiler

        self.profiler = Profiler(interval=0.0005, async_mode="disabled")
        self.profiler.start()
        print("PROFILING", flush=True)

    def stop(self) -> None:
        if self.profiler is None:
            return
        profiler, self.profiler = self.profiler, None
        session = profiler.stop()
        self.out_dir.mkdir(parents=True, exist_ok=True)
        (self.out_dir / f"{self.name}_profile.txt").write_text(
            profiler.output_text(unicode=False, color=False, show_all=False)
        )
        (self.out_dir / f"{self.name}_profile.html").write_text(profiler.output_html())
        top = _hot_spots(session)
        (self.out_dir / f"{self.name}_profile_top.json").write_text(json.dumps(top, indent=2))
        print("PROFILED " + json.dumps({"samples_s": top["busy_s"]}), flush=True)


def _hot_spots(session: Any) -> dict[str, Any]:
    """Self time by function (top 20) and inclusive time of reach_mesh functions (top 20),
    over the samples where the hub was not idle in the event loop's selector."""
    root = session.root_frame()
    self_time: dict[str, float] = {}
    incl: dict[str, float] = {}
    idle = 0.0

    def key(frame: Any) -> str:
        path = str(frame.file_path_short or frame.file_path or "")
        return f"{frame.function} ({path}:{frame.line_no})"

    def walk(frame: Any, stack: frozenset[str], parent: str) -> None:
        nonlocal idle
        synthetic = str(frame.function).startswith("[")  # [self], [await], [sleep]
        k = parent if synthetic else key(frame)
        is_mesh = "reach_mesh" in str(frame.file_path or "")
        if is_mesh and not synthetic and k not in stack:
            incl[k] = incl.get(k, 0.0) + frame.time
            stack = stack | {k}
        own = frame.time - sum(child.time for child in frame.children)
        if own > 0:
            if k.startswith(("select (", "poll (")) or "epoll" in k:  # idle in the selector
                idle += own
            else:
                self_time[k] = self_time.get(k, 0.0) + own
        for child in frame.children:
            walk(child, stack, k)

    if root is not None:
        walk(root, frozenset(), "<root>")
    total = sum(self_time.values())
    busy = max(total, 1e-9)

    def top(d: dict[str, float]) -> list[dict[str, Any]]:
        rows = sorted(d.items(), key=lambda kv: kv[1], reverse=True)[:20]
        return [
            {"function": k, "s": round(v, 3), "pct_busy": round(100 * v / busy, 1)} for k, v in rows
        ]

    return {
        "duration_s": round(session.duration, 3),
        "busy_s": round(total, 3),
        "idle_s": round(idle, 3),
        "self": top(self_time),
        "reach_mesh_inclusive": top(incl),
    }


async def _run_hub(args: argparse.Namespace) -> None:
    from reach_mesh.hub import Hub

    spans = _tracing(args.trace, "bench-hub")
    profiling = _Profiling(Path(args.profile_dir)) if args.profile_dir else None
    extra: dict[str, Any] = {"nats_url": args.nats}
    if args.metrics:
        extra["http_port"] = 0
    settings = load_settings(**extra)
    stop = _stop_event()
    loop = asyncio.get_running_loop()
    if profiling is not None:
        loop.add_signal_handler(signal.SIGUSR1, profiling.start)
        loop.add_signal_handler(signal.SIGUSR2, profiling.stop)
    async with Hub(settings=settings) as hub:
        metrics = getattr(hub, "metrics", None)
        ready = {
            "hub_id": hub.hub_id,
            "tracing": bool(args.trace),
            "metrics_integrated": metrics is not None,
            "http_url": getattr(hub, "http_url", None),
        }
        print("READY " + json.dumps(ready), flush=True)
        _runner.settle()  # as the entry points do once started
        await stop.wait()
        if profiling is not None:
            profiling.stop()
    if spans is not None:
        spans.cancel()


# ---------------------------------------------------------------------------- responders


async def _raw_responder(url: str) -> Callable[[], Awaitable[None]]:
    import nats
    from nats.aio.msg import Msg

    nc = await nats.connect(url, name="bench-raw", max_reconnect_attempts=3)

    async def echo(msg: Msg) -> None:
        await msg.respond(msg.data)

    await nc.subscribe(RAW_SUBJECT, queue="bench-raw", cb=echo, pending_msgs_limit=-1)
    await nc.flush()
    return nc.drain


async def _micro_service(url: str) -> Callable[[], Awaitable[None]]:
    import nats
    from nats.micro import add_service
    from nats.micro.request import Request

    nc = await nats.connect(url, name="bench-micro", max_reconnect_attempts=3)
    service = await add_service(
        nc, name="bench-echo", version="1.0.0", description="echo", queue_group="bench-micro"
    )

    async def echo(req: Request) -> None:
        body = json.loads(req.data)
        await req.respond(json.dumps(body, separators=(",", ":")).encode())

    await service.add_endpoint(name="echo", subject=MICRO_SUBJECT, handler=echo)
    await nc.flush()

    async def close() -> None:
        await service.stop()
        await nc.drain()

    return close


async def _agentbus_worker(url: str) -> tuple[Callable[[], Awaitable[None]], str | None]:
    """An agentbus worker with an in-process runner; returns (close, reason-if-unavailable)."""
    try:
        import nats
        from agentbus.config import WorkerConfig  # type: ignore[import-untyped]
        from agentbus.result import RESULT_STREAM  # type: ignore[import-untyped]
        from agentbus.worker import TASK_STREAM, AgentBusWorker, ProcessResult  # type: ignore[import-untyped]
    except ImportError as err:

        async def nothing() -> None:
            return None

        return nothing, f"agentbus is not installed ({err}): pip install 'reach-mesh[bench]'"

    # agentbus expects its two streams to exist (its docs leave creating them to the operator).
    nc = await nats.connect(url, name="bench-agentbus-admin", max_reconnect_attempts=3)
    js = nc.jetstream()
    for name, subjects in (
        (TASK_STREAM, ["agentbus.*.tasks"]),
        (RESULT_STREAM, ["agentbus.*.results"]),
    ):
        with contextlib.suppress(Exception):
            await js.add_stream(name=name, subjects=subjects)
    await nc.drain()

    async def runner(prompt: str, config: WorkerConfig) -> ProcessResult:
        # In place of spawning the configured agent CLI: answer at once, like the echo agents.
        return ProcessResult(returncode=0, stdout="ok", stderr="")

    config = WorkerConfig(agent_id=AGENTBUS_WORKER, server_url=url, agent_chat_cmd=["{input}"])
    worker = AgentBusWorker(config, runner=runner)
    await worker.connect()
    task = asyncio.create_task(worker.run_forever())
    await asyncio.sleep(0.3)  # let it create its durable pull consumer
    if task.done():
        return worker.close, f"agentbus worker stopped at start: {task.exception()!r}"

    async def close() -> None:
        task.cancel()
        with contextlib.suppress(BaseException):
            await task

    return close, None


async def _echo(task: Task[Any]) -> Any:
    return task.payload


async def _run_responders(args: argparse.Namespace) -> None:
    spans = _tracing(args.trace, "bench-agent")
    settings = load_settings(nats_url=args.nats)
    agent = Agent(ECHO_AGENT, settings=settings, max_concurrency=256)

    agent.handler(ECHO_CAPABILITY)(_echo)
    stop = _stop_event()
    closers: list[Callable[[], Awaitable[None]]] = []
    closers.append(await _raw_responder(args.nats))
    closers.append(await _micro_service(args.nats))
    agentbus_close, agentbus_reason = await _agentbus_worker(args.nats)
    closers.append(agentbus_close)
    async with agent:
        ready = {"agent": ECHO_AGENT, "agentbus": agentbus_reason or "ok"}
        print("READY " + json.dumps(ready), flush=True)
        _runner.settle()  # as the entry points do once started
        await stop.wait()
    for close in closers:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(close(), 5)
    if spans is not None:
        spans.cancel()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench._procs")
    parser.add_argument("role", choices=["hub", "responders"])
    parser.add_argument("--nats", required=True)
    parser.add_argument("--trace", action="store_true", help="OTel SDK, 100 %% sampling")
    parser.add_argument("--metrics", action="store_true", help="hub: serve /metrics")
    parser.add_argument("--profile-dir", default=None, help="hub: pyinstrument on SIGUSR1/2")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, stream=sys.stdout)
    run = _run_hub if args.role == "hub" else _run_responders
    # The entry points' loop choice (uvloop when installed), so the bench measures what users run.
    _runner.run(run(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
