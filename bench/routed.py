"""Routed request-reply against its floor and its peers, tracing overhead, and the hub profile.

Systems (all answer the same JSON payload, all driven from this process):

* ``raw``: nats-py request to a queue-group responder that echoes the bytes — the floor;
* ``proxy``: ``Client.request(mode="proxy")`` — caller → hub → agent → hub → caller;
* ``direct``: ``Client.request(mode="direct")`` — caller → hub (decision), caller → agent;
* ``http``: the hub's REST gateway, ``POST /api/route`` over keep-alive HTTP/1.1 — caller → hub
  (HTTP) → agent → hub → caller;
* ``micro``: a hand-written ``nats.micro`` service with a queue group (what a user builds without
  reach-mesh);
* ``agentbus``: the agentbus JetStream task bus (task published to its stream, pulled by its worker,
  result published back to the caller's result subject).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import signal
import statistics
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import nats
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from bench import _procs
from bench._load import closed_loop, open_loop
from bench._system import ChildProcess, cpu_sample, cpu_share, python, rss_mb
from reach_mesh.client import Client
from reach_mesh.config import MeshSettings

__all__ = ["GATEWAY_SYSTEMS", "PAYLOAD", "Plan", "run_profile", "run_routed", "run_tracing"]

#: The task payload every system carries (a small JSON object, ~150 bytes encoded).
PAYLOAD: dict[str, Any] = {"text": "the quick brown fox jumps over the lazy dog " * 2, "n": 42}
SYSTEMS = ("raw", "proxy", "direct", "http", "micro", "agentbus")
#: ``python -m bench --gateway``: the HTTP gateway next to the NATS client (and the floor).
GATEWAY_SYSTEMS = ("raw", "proxy", "http")


class Plan:
    """Durations, loads and repeats for one run (``--quick`` or full)."""

    def __init__(self, quick: bool) -> None:
        self.quick = quick
        self.loads = (300, 1000, 3000)
        self.point_s = 1.0 if quick else 3.0
        self.warmup_s = 0.3 if quick else 1.5
        self.repeats = 1 if quick else 3
        self.concurrency = 200
        self.tracing_repeats = 1 if quick else 2

    def as_dict(self) -> dict[str, Any]:
        """The plan as the results record it."""
        return {
            "loads_rps": list(self.loads),
            "seconds_per_point": self.point_s,
            "warmup_s": self.warmup_s,
            "repeats": self.repeats,
            "peak_concurrency": self.concurrency,
        }


Caller = Callable[[], Awaitable[Any]]


@contextlib.asynccontextmanager
async def processes(
    url: str, *, trace: bool = False, metrics: bool = False, profile_dir: Path | None = None
) -> AsyncIterator[tuple[ChildProcess, ChildProcess, dict[str, Any], dict[str, Any]]]:
    """Start the hub and the responders as child processes; stop both (by pid) on exit."""
    base = [python(), "-m", "bench._procs"]
    flags = ["--nats", url] + (["--trace"] if trace else [])
    hub_argv = [*base, "hub", *flags] + (["--metrics"] if metrics else [])
    if profile_dir is not None:
        hub_argv += ["--profile-dir", str(profile_dir)]
    hub = ChildProcess(hub_argv, name="hub")
    resp = ChildProcess([*base, "responders", *flags], name="responders")
    try:
        hub_ready = json.loads((await hub.start("READY ")).split(" ", 1)[1])
        resp_ready = json.loads((await resp.start("READY ", timeout=45)).split(" ", 1)[1])
        yield hub, resp, hub_ready, resp_ready
    finally:
        await resp.stop()
        await hub.stop()


class Callers:
    """One connection per system in this process; a zero-argument coroutine per system."""

    def __init__(self, url: str, http_url: str | None = None) -> None:
        self.url = url
        self.http_url = http_url
        self._http: Any = None
        self._route_body = json.dumps(
            {"capability": _procs.ECHO_CAPABILITY, "payload": PAYLOAD}, separators=(",", ":")
        ).encode()
        self.body = json.dumps(PAYLOAD, separators=(",", ":")).encode()
        self._raw: NATS | None = None
        self._micro: NATS | None = None
        self._ab: NATS | None = None
        self._client: Client | None = None
        self._pending: dict[str, asyncio.Future[bytes]] = {}

    async def __aenter__(self) -> Callers:
        self._raw = await nats.connect(self.url, name="bench-load-raw", max_reconnect_attempts=3)
        self._micro = await nats.connect(
            self.url, name="bench-load-micro", max_reconnect_attempts=3
        )
        self._ab = await nats.connect(
            self.url, name="bench-load-agentbus", max_reconnect_attempts=3
        )
        try:
            from agentbus.publish import build_result_subject  # type: ignore[import-untyped]
        except ImportError:  # the responders report agentbus as unavailable
            build_result_subject = "agentbus.{}.results".format
        await self._ab.subscribe(
            build_result_subject(_procs.AGENTBUS_CALLER),
            cb=self._on_ab_result,
            pending_msgs_limit=-1,
        )
        await self._ab.flush()
        settings = MeshSettings(nats_url=self.url, request_timeout=10.0)
        self._client = await Client(settings=settings, namespace="bench").connect()
        if self.http_url is not None:
            self._http = _KeepAlivePool(self.http_url, size=256)
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._http is not None:
            self._http.close()
        if self._client is not None:
            await self._client.close()
        for nc in (self._raw, self._micro, self._ab):
            if nc is not None:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(nc.drain(), 5)

    def get(self, system: str) -> Caller:
        return {
            "raw": self.raw,
            "proxy": self.proxy,
            "direct": self.direct,
            "http": self.http,
            "micro": self.micro,
            "agentbus": self.agentbus,
        }[system]

    async def raw(self) -> Any:
        assert self._raw is not None
        msg = await self._raw.request(_procs.RAW_SUBJECT, self.body, timeout=10.0)
        return json.loads(msg.data)

    async def micro(self) -> Any:
        assert self._micro is not None
        msg = await self._micro.request(_procs.MICRO_SUBJECT, self.body, timeout=10.0)
        return json.loads(msg.data)

    async def proxy(self) -> Any:
        assert self._client is not None
        res = await self._client.request(capability=_procs.ECHO_CAPABILITY, payload=PAYLOAD)
        if not res.ok:
            raise RuntimeError(f"task {res.state}")
        return res.result

    async def direct(self) -> Any:
        assert self._client is not None
        res = await self._client.request(
            capability=_procs.ECHO_CAPABILITY, payload=PAYLOAD, mode="direct"
        )
        if not res.ok:
            raise RuntimeError(f"task {res.state}")
        return res.result

    async def http(self) -> Any:
        """The hub's HTTP gateway: ``POST /api/route`` (proxy mode) over keep-alive HTTP/1.1."""
        if self._http is None:
            raise RuntimeError("the hub has no HTTP port")
        status, data = await self._http.post("/api/route?namespace=bench", self._route_body)
        if status != 200:
            raise RuntimeError(f"HTTP {status}: {data[:200]!r}")
        reply = json.loads(data)
        if reply["task"]["state"] != "SUCCEEDED":
            raise RuntimeError(f"task {reply['task']['state']}")
        return reply["task"]["result"]

    async def agentbus(self) -> Any:
        from agentbus.publish import publish_task

        assert self._ab is not None
        nc = self._ab

        async def publisher(server_url: str, subject: str, payload: bytes) -> None:
            # agentbus's default publisher opens a connection per task; a user would reuse one.
            await nc.publish(subject, payload)

        fut: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
        task_id: str | None = None
        try:
            message = await publish_task(
                server_url=self.url,
                target_agent=_procs.AGENTBUS_WORKER,
                task_type="echo",
                content=self.body.decode(),
                from_agent=_procs.AGENTBUS_CALLER,
                publisher=_Registering(publisher, self._pending, fut),
            )
            task_id = message["id"]
            data = await asyncio.wait_for(fut, 10.0)
        finally:
            if task_id is not None:
                self._pending.pop(task_id, None)
        return json.loads(data)["task"]["payload"]

    async def _on_ab_result(self, msg: Msg) -> None:
        try:
            task_id = json.loads(msg.data)["task"]["id"]
        except (ValueError, KeyError, TypeError):
            return
        fut = self._pending.pop(task_id, None)
        if fut is not None and not fut.done():
            fut.set_result(msg.data)


class _Registering:
    """A publisher that registers the task's future before the task leaves (no lost replies)."""

    def __init__(
        self,
        publish: Callable[[str, str, bytes], Awaitable[None]],
        pending: dict[str, asyncio.Future[bytes]],
        fut: asyncio.Future[bytes],
    ) -> None:
        self._publish = publish
        self._pending = pending
        self._fut = fut

    async def __call__(self, server_url: str, subject: str, payload: bytes) -> None:
        self._pending[json.loads(payload)["id"]] = self._fut
        await self._publish(server_url, subject, payload)


class _KeepAlivePool:
    """Keep-alive HTTP/1.1 connections to the hub, reused like a browser's or a client pool's.

    Deliberately minimal so the load generator measures the gateway: httpx's pool costs more
    CPU per request than the hub's side at these rates (it scans every connection per request).
    """

    def __init__(self, base_url: str, size: int) -> None:
        host_port = base_url.removeprefix("http://")
        host, _, port = host_port.rpartition(":")
        self.host, self.port, self.size = host.strip("[]"), int(port), size
        self._header = f"Host: {host_port}\r\nContent-Type: application/json\r\n"
        self._idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
        self._open = 0
        self._freed = asyncio.Condition()

    async def _get(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        async with self._freed:
            while not self._idle and self._open >= self.size:
                await self._freed.wait()
            while self._idle:
                reader, writer = conn = self._idle.pop()
                if not reader.at_eof():
                    return conn
                # The server closed it while idle (uvicorn's keep-alive timeout, 5 s): as
                # client pools do, drop it rather than send a request into a closed socket.
                writer.close()
                self._open -= 1
            self._open += 1
        return await asyncio.open_connection(self.host, self.port)

    async def _put(self, conn: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None) -> None:
        async with self._freed:
            if conn is None:
                self._open -= 1
            else:
                self._idle.append(conn)
            self._freed.notify()

    async def post(self, path: str, body: bytes) -> tuple[int, bytes]:
        conn = await self._get()
        try:
            reader, writer = conn
            head = f"POST {path} HTTP/1.1\r\n{self._header}Content-Length: {len(body)}\r\n\r\n"
            writer.write(head.encode() + body)
            answer = await reader.readuntil(b"\r\n\r\n")
            length = 0
            for line in answer.split(b"\r\n")[1:]:
                name, _, value = line.partition(b":")
                if name.strip().lower() == b"content-length":
                    length = int(value)
            data = await reader.readexactly(length)
        except BaseException:
            conn[1].close()
            await self._put(None)
            raise
        await self._put(conn)
        return int(answer.split(b" ", 2)[1]), data

    def close(self) -> None:
        for _, writer in self._idle:
            writer.close()
        self._idle.clear()


def _median_spread(values: list[float]) -> dict[str, float]:
    vals = [v for v in values if v == v]  # drop NaN
    if not vals:
        return {"median": float("nan"), "min": float("nan"), "max": float("nan")}
    return {
        "median": round(statistics.median(vals), 3),
        "min": round(min(vals), 3),
        "max": round(max(vals), 3),
    }


class _CpuWatch:
    """CPU seconds per request of the hub, responders and nats-server during one measurement."""

    def __init__(self, pids: dict[str, int]) -> None:
        self.pids = pids
        self.before = {k: cpu_sample(p) for k, p in pids.items()}

    def done(self, requests: int) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for k, pid in self.pids.items():
            after = cpu_sample(pid)
            share = cpu_share(self.before[k], after)
            before = self.before[k]
            per_req = None
            if before is not None and after is not None and requests:
                per_req = round((after.cpu_s - before.cpu_s) / requests * 1e6, 1)
            out[k] = {"cpu_share": share, "cpu_us_per_req": per_req}
        return out


async def _measure_system(
    callers: Callers, system: str, plan: Plan, pids: dict[str, int]
) -> dict[str, Any]:
    call = callers.get(system)
    await closed_loop(call, 16, plan.warmup_s)  # warm-up: connections, caches, JIT-free paths
    out: dict[str, Any] = {"open_loop": {}}
    for rate in plan.loads:
        # The load generator's own full garbage collections (10-15 ms, every few seconds of
        # this much traffic) would land in whichever point runs then: collect between points.
        gc.collect()
        watch = _CpuWatch(pids)
        res = await open_loop(call, rate, plan.point_s)
        res["cpu"] = watch.done(res["ok"])
        out["open_loop"][str(rate)] = res
    gc.collect()
    watch = _CpuWatch(pids)
    peak = await closed_loop(call, plan.concurrency, plan.point_s)
    peak["cpu"] = watch.done(peak["ok"])
    out["peak"] = peak
    return out


def _aggregate(
    repeats: list[dict[str, dict[str, Any]]], systems: list[str], plan: Plan
) -> dict[str, Any]:
    """Medians (and min/max) over repeats, and ratios of medians to ``raw``."""
    agg: dict[str, Any] = {}
    for system in systems:
        rows = [r[system] for r in repeats if system in r]
        if not rows:
            continue
        sys_out: dict[str, Any] = {"open_loop": {}, "peak": {}}
        for rate in plan.loads:
            pts = [row["open_loop"][str(rate)] for row in rows]
            sys_out["open_loop"][str(rate)] = {
                "p50_ms": _median_spread([p["p50_ms"] for p in pts]),
                "p99_ms": _median_spread([p["p99_ms"] for p in pts]),
                "achieved_rps": _median_spread([p["achieved_rps"] for p in pts]),
                "errors": sum(sum(p["errors"].values()) + p["unfinished"] for p in pts),
                "send_lag_p99_ms": _median_spread([p["send_lag_p99_ms"] for p in pts]),
                "hub_cpu_us_per_req": _median_spread(
                    [_num(p["cpu"]["hub"]["cpu_us_per_req"]) for p in pts]
                ),
            }
        peaks = [row["peak"] for row in rows]
        sys_out["peak"] = {
            "throughput_rps": _median_spread([p["throughput_rps"] for p in peaks]),
            "p50_ms": _median_spread([p["p50_ms"] for p in peaks]),
            "p99_ms": _median_spread([p["p99_ms"] for p in peaks]),
            "errors": sum(sum(p["errors"].values()) for p in peaks),
            "cpu_us_per_req": {
                proc: _median_spread([_num(p["cpu"][proc]["cpu_us_per_req"]) for p in peaks])
                for proc in ("hub", "responders", "nats_server", "load_generator")
            },
            "cpu_share": {
                proc: _median_spread([_num(p["cpu"][proc]["cpu_share"]) for p in peaks])
                for proc in ("hub", "responders", "nats_server", "load_generator")
            },
        }
        agg[system] = sys_out
    for base, key in (("raw", "ratio_to_raw"), ("proxy", "ratio_to_proxy")):
        if base in agg:
            for sys_out in agg.values():
                sys_out[key] = _ratios(sys_out, agg[base], plan)
    return agg


def _ratios(s: dict[str, Any], base: dict[str, Any], plan: Plan) -> dict[str, Any]:
    """``s`` over ``base`` (medians of the same run): latency factors and the peak fraction."""
    ratios: dict[str, Any] = {}
    for rate in plan.loads:
        r, b = s["open_loop"][str(rate)], base["open_loop"][str(rate)]
        ratios[str(rate)] = {
            "p50_x": _ratio(r["p50_ms"]["median"], b["p50_ms"]["median"]),
            "p99_x": _ratio(r["p99_ms"]["median"], b["p99_ms"]["median"]),
        }
    ratios["peak_fraction"] = _ratio(
        s["peak"]["throughput_rps"]["median"], base["peak"]["throughput_rps"]["median"]
    )
    ratios["peak_p50_x"] = _ratio(s["peak"]["p50_ms"]["median"], base["peak"]["p50_ms"]["median"])
    ratios["peak_p99_x"] = _ratio(s["peak"]["p99_ms"]["median"], base["peak"]["p99_ms"]["median"])
    ratios["hub_cpu_x"] = _ratio(
        s["peak"]["cpu_us_per_req"]["hub"]["median"],
        base["peak"]["cpu_us_per_req"]["hub"]["median"],
    )
    return ratios


def _num(x: float | None) -> float:
    return float("nan") if x is None else x


def _ratio(a: float, b: float) -> float | None:
    if not b or a != a or b != b:
        return None
    return round(a / b, 3)


async def run_routed(
    url: str,
    server_pid: int,
    plan: Plan,
    log: Callable[[str], None],
    systems: Sequence[str] = SYSTEMS,
) -> dict[str, Any]:
    """Every system (of ``systems``) at every load, ``plan.repeats`` times, interleaved (drift
    hits all alike)."""
    import os

    repeats: list[dict[str, dict[str, Any]]] = []
    unavailable: dict[str, str] = {}
    async with (
        processes(url, metrics=True) as (hub, resp, hub_ready, resp_ready),
        Callers(url, hub_ready.get("http_url")) as callers,
    ):
        if "agentbus" in systems and resp_ready.get("agentbus") != "ok":
            unavailable["agentbus"] = str(resp_ready.get("agentbus"))
        running = [s for s in systems if s not in unavailable]
        pids = {
            "hub": hub.pid,
            "responders": resp.pid,
            "nats_server": server_pid,
            "load_generator": os.getpid(),
        }
        for i in range(plan.repeats):
            rep: dict[str, dict[str, Any]] = {}
            for system in list(running):
                t0 = time.perf_counter()
                try:
                    rep[system] = await _measure_system(callers, system, plan, pids)
                except Exception as err:  # a peer that breaks must not sink the run
                    unavailable[system] = f"failed during the run: {err!r}"
                    running.remove(system)
                    continue
                peak = rep[system]["peak"]["throughput_rps"]
                p50 = rep[system]["open_loop"]["1000"]["p50_ms"]
                log(
                    f"  repeat {i + 1}/{plan.repeats} {system:9s} p50@1k {p50:7.3f} ms "
                    f"peak {peak:8.0f}/s ({time.perf_counter() - t0:.1f}s)"
                )
            repeats.append(rep)
        hub_rss = rss_mb(hub.pid)
        resp_rss = rss_mb(resp.pid)
    return {
        "systems": _aggregate(repeats, [s for s in systems if s not in unavailable], plan),
        "unavailable": unavailable,
        "repeats": repeats,
        "rss_mb": {"hub": hub_rss, "responders": resp_rss},
    }


async def run_tracing(
    url: str, server_pid: int, plan: Plan, log: Callable[[str], None]
) -> dict[str, Any]:
    """Proxy-mode routing with tracing off, on (hub + agent, 100 % sampled), metrics only."""
    import os

    modes: dict[str, dict[str, Any]] = {
        "off": {},
        "tracing": {"trace": True},
        "metrics": {"metrics": True},
    }
    results: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
    notes: dict[str, str] = {}
    for i in range(plan.tracing_repeats):
        for mode, flags in modes.items():
            if mode in notes:
                continue
            async with processes(url, **flags) as (hub, resp, hub_ready, _), Callers(url) as c:
                if mode == "metrics" and not hub_ready.get("metrics_integrated"):
                    notes[mode] = (
                        "not measured: the Hub does not update HubMetrics or serve /metrics yet "
                        "(reach_mesh/tracing/metrics.py exists, reach_mesh/hub/_hub.py never "
                        "creates it; settings.http_port is ignored)"
                    )
                    continue
                pids = {
                    "hub": hub.pid,
                    "responders": resp.pid,
                    "nats_server": server_pid,
                    "load_generator": os.getpid(),
                }
                await closed_loop(c.proxy, 16, plan.warmup_s)
                watch = _CpuWatch(pids)
                at_1k = await open_loop(c.proxy, 1000, plan.point_s)
                at_1k["cpu"] = watch.done(at_1k["ok"])
                watch = _CpuWatch(pids)
                peak = await closed_loop(c.proxy, plan.concurrency, plan.point_s)
                peak["cpu"] = watch.done(peak["ok"])
                results[mode].append({"at_1000": at_1k, "peak": peak})
                log(
                    f"  repeat {i + 1} tracing={mode:8s} p50@1k {at_1k['p50_ms']:.3f} ms "
                    f"peak {peak['throughput_rps']:.0f}/s"
                )
    out: dict[str, Any] = {"modes": {}, "notes": notes}
    for mode, rows in results.items():
        if not rows:
            continue
        out["modes"][mode] = {
            "p50_ms_at_1000": _median_spread([r["at_1000"]["p50_ms"] for r in rows]),
            "p99_ms_at_1000": _median_spread([r["at_1000"]["p99_ms"] for r in rows]),
            "peak_rps": _median_spread([r["peak"]["throughput_rps"] for r in rows]),
            "hub_cpu_us_per_req": _median_spread(
                [_num(r["peak"]["cpu"]["hub"]["cpu_us_per_req"]) for r in rows]
            ),
            "agent_cpu_us_per_req": _median_spread(
                [_num(r["peak"]["cpu"]["responders"]["cpu_us_per_req"]) for r in rows]
            ),
        }
    off = out["modes"].get("off")
    if off is not None:
        for vals in out["modes"].values():
            vals["ratio_to_off"] = {
                "p50_x": _ratio(vals["p50_ms_at_1000"]["median"], off["p50_ms_at_1000"]["median"]),
                "peak_fraction": _ratio(vals["peak_rps"]["median"], off["peak_rps"]["median"]),
                "hub_cpu_x": _ratio(
                    vals["hub_cpu_us_per_req"]["median"], off["hub_cpu_us_per_req"]["median"]
                ),
            }
    return out


async def run_profile(
    url: str, plan: Plan, out_dir: Path, log: Callable[[str], None]
) -> dict[str, Any]:
    """pyinstrument on the hub process while proxy-mode requests run closed-loop at peak."""
    async with processes(url, profile_dir=out_dir) as (hub, _, _, _), Callers(url) as c:
        await closed_loop(c.proxy, 16, plan.warmup_s)
        hub.signal(signal.SIGUSR1)
        await hub.wait_line("PROFILING", 10)
        peak = await closed_loop(c.proxy, plan.concurrency, max(plan.point_s, 3.0))
        hub.signal(signal.SIGUSR2)
        await hub.wait_line("PROFILED", 60)
    top = json.loads((out_dir / "hub_profile_top.json").read_text())
    log(
        f"  profiled {peak['ok']} proxy requests "
        f"({peak['throughput_rps']:.0f}/s under pyinstrument)"
    )
    return {
        "tool": "pyinstrument (wall-clock sampling, 0.5 ms), hub process only",
        "workload": f"proxy mode, closed loop, {plan.concurrency} in flight",
        "throughput_rps_while_profiled": peak["throughput_rps"],
        "files": ["bench/results/hub_profile.txt", "bench/results/hub_profile.html"],
        **top,
    }
