"""Registry scale: 1k / 10k simulated agents heartbeating against one hub process.

The hub runs as ``python -m reach_mesh.cli hub`` (a separate process, default settings); its CPU
and RSS are read from /proc. Simulated agents live in this process and share a few NATS
connections: they send the wire protocol by hand (``RegisterRequest`` on
``reach.hub.<ns>.register``, ``Heartbeat`` on ``reach.hub.<ns>.heartbeat``) and serve no tasks.
Heartbeats go out on an open-loop timetable (each agent every ``heartbeat_interval``, phases
spread evenly) and their latency is measured from the due time.

While the fleet heartbeats:

* selector routes over the fleet: ``Client.route`` (decide only) for a selective and a broad
  4-term selector, end to end through the hub;
* graceful unregister → unroutable: a real ``Agent`` with its own capability is closed; the time
  until a route for that capability answers ``REACH_NO_MATCH``;
* killed agent → SUSPECT: a simulated agent with a short lease stops heartbeating; the time from
  its last acknowledged heartbeat until the hub reports it ``SUSPECT``.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import nats
from nats.aio.client import Client as NATS

from bench import selector_bench
from bench._load import percentile, summarize
from bench._system import ChildProcess, cpu_sample, cpu_share, python, rss_mb
from reach_mesh import protocol
from reach_mesh.agent import Agent, Task
from reach_mesh.client import Client
from reach_mesh.config import MeshSettings
from reach_mesh.errors import NoMatchError, ThrottledError
from reach_mesh.models import AgentCard, AgentState, Heartbeat, RegisterRequest, RouteRequest

__all__ = ["run_registry_scale", "run_selector_micro"]

NAMESPACE = "scale"
CONNECTIONS = 4
HEARTBEAT_INTERVAL = 5.0
LEASE = 15.0
#: The short-lease agent of the SUSPECT measurement.
SHORT_HEARTBEAT = 0.2
SHORT_LEASE = 0.6


async def _echo(task: Task[Any]) -> Any:
    return task.payload


def _fleet(n: int) -> list[tuple[str, bytes, bytes]]:
    """(agent_id, register body, heartbeat body) for ``n`` agents with realistic labels."""
    rng = random.Random(7)
    out = []
    for i, (_, caps, labels) in enumerate(selector_bench.build(n, rng)):
        agent_id = f"{NAMESPACE}.svc{i % 97}.a{i}"
        session = f"s{i}"
        card = AgentCard(agent_id=agent_id, capabilities=caps, labels=labels, max_concurrency=16)
        reg = RegisterRequest(
            card=card, session=session, heartbeat_interval=HEARTBEAT_INTERVAL, lease_timeout=LEASE
        )
        hb = Heartbeat(agent_id=agent_id, session=session, inflight=rng.randrange(4))
        out.append((agent_id, protocol.encode(reg), protocol.encode(hb)))
    return out


async def _register_all(
    conns: list[NATS], fleet: list[tuple[str, bytes, bytes]], deadline: float
) -> dict[str, Any]:
    """Register every agent (at most 256 at a time), honouring REACH_THROTTLED."""
    sem = asyncio.Semaphore(256)
    throttled = 0
    failed: Counter[str] = Counter()

    async def one(i: int, agent_id: str, body: bytes) -> None:
        nonlocal throttled
        subject = protocol.hub_agent_subject(agent_id, "register")
        async with sem:
            while time.monotonic() < deadline:
                try:
                    msg = await conns[i % len(conns)].request(subject, body, timeout=10)
                    protocol.raise_for_error(msg.data)
                    return
                except ThrottledError as err:
                    throttled += 1
                    await asyncio.sleep(err.retry_after * random.uniform(0.5, 1.5))
                except Exception as err:
                    failed[type(err).__name__] += 1
                    await asyncio.sleep(0.05)

    t0 = time.perf_counter()
    await asyncio.gather(*(one(i, aid, body) for i, (aid, body, _) in enumerate(fleet)))
    return {
        "agents": len(fleet),
        "seconds": round(time.perf_counter() - t0, 3),
        "throttled_replies": throttled,
        "errors": dict(failed),
    }


class _Heartbeats:
    """Open-loop heartbeats: agent ``i`` is due at ``start + (i / n + k) * interval``."""

    def __init__(self, conns: list[NATS], fleet: list[tuple[str, bytes, bytes]]) -> None:
        self.conns = conns
        self.fleet = fleet
        self.latencies: list[float] = []
        self.errors: Counter[str] = Counter()
        self.states: dict[int, str] = {}
        self._task: asyncio.Task[None] | None = None
        self._inflight: set[asyncio.Task[None]] = set()

    def start(self, until: float) -> None:
        self._task = asyncio.create_task(self._run(until))

    def reset(self) -> None:
        self.latencies = []
        self.errors = Counter()

    async def _run(self, until: float) -> None:
        n = len(self.fleet)
        step = HEARTBEAT_INTERVAL / n
        slots = asyncio.Semaphore(4096)
        loop = asyncio.get_running_loop()
        start = time.perf_counter() + 0.01
        k = 0
        while True:
            due = start + k * step
            if time.monotonic() > until:
                break
            ahead = due - time.perf_counter()
            if ahead > 0.001:
                await asyncio.sleep(ahead)
            await slots.acquire()
            i = k % n
            subject = protocol.hub_agent_subject(self.fleet[i][0], "heartbeat")
            task = loop.create_task(self._beat(i, subject, max(due, time.perf_counter()), slots))
            self._inflight.add(task)
            task.add_done_callback(self._inflight.discard)
            k += 1

    async def _beat(self, i: int, subject: str, due: float, slots: asyncio.Semaphore) -> None:
        try:
            msg = await self.conns[i % len(self.conns)].request(
                subject, self.fleet[i][2], timeout=HEARTBEAT_INTERVAL
            )
            protocol.raise_for_error(msg.data)
            self.latencies.append(time.perf_counter() - due)
            self.states[i] = msg.data.split(b'"state":"', 1)[1].split(b'"', 1)[0].decode()
        except Exception as err:
            self.errors[type(err).__name__] += 1
        finally:
            slots.release()

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(BaseException):
                await self._task
        if self._inflight:
            await asyncio.wait(set(self._inflight), timeout=HEARTBEAT_INTERVAL + 1)


async def _route_latency(nc: NATS, selector: str, count: int) -> dict[str, Any]:
    """Direct-mode route requests: the hub decides (index + filters + strategy), delivers
    nothing, explains nothing — the routing cost a request pays, end to end."""
    body = protocol.encode(RouteRequest(selector=selector, mode="direct"))
    subject = protocol.hub_subject(NAMESPACE, "route")
    lat: list[float] = []
    nomatch = 0
    for _ in range(count):
        t0 = time.perf_counter()
        msg = await nc.request(subject, body, timeout=10)
        lat.append(time.perf_counter() - t0)
        try:
            protocol.raise_for_error(msg.data)
        except NoMatchError:
            nomatch += 1
    return {"selector": selector, "requests": count, "no_match": nomatch, **summarize(lat)}


async def _unregister_time(url: str, client: Client, k: int) -> dict[str, float]:
    """Close a real agent; how long until its capability is unroutable."""
    cap = f"unreg{k}:echo:v1"
    settings = MeshSettings(nats_url=url, namespace=NAMESPACE)
    agent = Agent(f"{NAMESPACE}.real.u{k}", settings=settings)
    agent.handler(cap)(_echo)
    await agent.start()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            await client.route(capability=cap)
            break
        except NoMatchError:
            await asyncio.sleep(0.01)
    t0 = time.perf_counter()
    closing = asyncio.create_task(agent.close())
    unroutable = float("nan")
    while time.monotonic() < deadline + 10:
        try:
            await client.route(capability=cap)
        except NoMatchError:
            unroutable = time.perf_counter() - t0
            break
        await asyncio.sleep(0.002)
    await closing
    return {
        "unroutable_ms": round(unroutable * 1000, 2),
        "close_ms": round((time.perf_counter() - t0) * 1000, 2),
    }


async def _suspect_time(nc: NATS, client: Client, k: int) -> dict[str, float]:
    """A simulated agent with a short lease stops heartbeating; time until SUSPECT."""
    agent_id = f"{NAMESPACE}.short.k{k}"
    session = f"short{k}"
    card = AgentCard(agent_id=agent_id, capabilities=[f"short{k}:ping:v1"])
    reg = RegisterRequest(
        card=card,
        session=session,
        heartbeat_interval=SHORT_HEARTBEAT,
        lease_timeout=SHORT_LEASE,
    )
    register = protocol.hub_agent_subject(agent_id, "register")
    msg = await nc.request(register, protocol.encode(reg), 5)
    protocol.raise_for_error(msg.data)
    hb = protocol.encode(Heartbeat(agent_id=agent_id, session=session))
    last_ack = time.perf_counter()
    for _ in range(5):
        await asyncio.sleep(SHORT_HEARTBEAT)
        msg = await nc.request(protocol.hub_agent_subject(agent_id, "heartbeat"), hb, 5)
        protocol.raise_for_error(msg.data)
        last_ack = time.perf_counter()
    # "Killed": no more heartbeats. Poll the hub's view of the agent.
    suspect_at = float("nan")
    deadline = time.monotonic() + SHORT_LEASE + 10
    while time.monotonic() < deadline:
        info = await client.inspect(agent_id)
        if info.state is AgentState.SUSPECT:
            suspect_at = time.perf_counter() - last_ack
            break
        await asyncio.sleep(0.01)
    with contextlib.suppress(Exception):
        await client.admin("remove", agent_id)
    return {
        "suspect_after_ms": round(suspect_at * 1000, 1),
        "beyond_lease_ms": round((suspect_at - SHORT_LEASE) * 1000, 1),
    }


async def _one_size(
    url: str, server_pid: int, n: int, window: float, trials: int, log: Callable[[str], None]
) -> dict[str, Any]:
    hub = ChildProcess(
        [python(), "-m", "reach_mesh.cli", "--log-level", "WARNING", "hub", "--nats", url],
        name="cli hub",
    )
    await hub.start("hub ")
    conns: list[NATS] = []
    beats: _Heartbeats | None = None
    try:
        rss_idle = rss_mb(hub.pid)
        fleet = _fleet(n)
        conns = [
            await nats.connect(url, name=f"bench-sim-{i}", max_reconnect_attempts=3)
            for i in range(CONNECTIONS)
        ]
        hub_cpu0 = cpu_sample(hub.pid)
        registration = await _register_all(conns, fleet, time.monotonic() + 120)
        hub_cpu1 = cpu_sample(hub.pid)
        if hub_cpu0 is not None and hub_cpu1 is not None:
            registration["hub_cpu_s"] = round(hub_cpu1.cpu_s - hub_cpu0.cpu_s, 3)
        log(f"  {n} agents registered in {registration['seconds']}s")
        beats = _Heartbeats(conns, fleet)
        beats.start(until=time.monotonic() + window + 120)
        # Settle one full interval (every agent has beaten once since registering); the quick
        # mode settles less and says so in its window.
        await asyncio.sleep(HEARTBEAT_INTERVAL if trials > 1 else 2.0)
        beats.reset()
        hub0, srv0 = cpu_sample(hub.pid), cpu_sample(server_pid)
        await asyncio.sleep(window)
        hub1, srv1 = cpu_sample(hub.pid), cpu_sample(server_pid)
        lat = list(beats.latencies)
        errors = dict(beats.errors)
        rss_loaded = rss_mb(hub.pid)
        states = Counter(beats.states.values())
        settings = MeshSettings(nats_url=url, request_timeout=10.0)
        async with Client(settings=settings, namespace=NAMESPACE) as client:
            routes = [
                await _route_latency(conns[0], selector_bench.SELECTOR, 50 if trials < 3 else 300),
                await _route_latency(conns[0], selector_bench.BROAD, 20 if trials < 3 else 100),
            ]
            unreg = [await _unregister_time(url, client, k) for k in range(trials)]
            suspect = [await _suspect_time(conns[0], client, k) for k in range(trials)]
        out: dict[str, Any] = {
            "agents": n,
            "connections": CONNECTIONS,
            "heartbeat_interval_s": HEARTBEAT_INTERVAL,
            "lease_s": LEASE,
            "registration": registration,
            "window_s": window,
            "heartbeats": len(lat),
            "heartbeat_rps": round(len(lat) / window, 1),
            "heartbeat_errors": errors,
            "heartbeat_latency": summarize(lat),
            "states_last_reply": dict(states),
            "agents_online": states.get("ONLINE", 0),
            "hub_cpu_share": cpu_share(hub0, hub1),
            "nats_server_cpu_share": cpu_share(srv0, srv1),
            "hub_rss_mb_idle": rss_idle,
            "hub_rss_mb": rss_loaded,
            "route_decide_only": routes,
            "unregister_to_unroutable": {
                "trials": unreg,
                "median_ms": _median([u["unroutable_ms"] for u in unreg]),
            },
            "killed_to_suspect": {
                "heartbeat_interval_s": SHORT_HEARTBEAT,
                "lease_s": SHORT_LEASE,
                "hub_liveness_interval_s": MeshSettings().liveness_interval,
                "trials": suspect,
                "median_ms": _median([s["suspect_after_ms"] for s in suspect]),
            },
        }
        log(
            f"  {n} agents: hub CPU {out['hub_cpu_share']} core, RSS {rss_loaded} MB, "
            f"hb p99 {out['heartbeat_latency']['p99_ms']} ms, online {out['agents_online']}"
        )
        return out
    finally:
        if beats is not None:
            await beats.stop()
        await _unregister_fleet(conns, n)
        for nc in conns:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(nc.drain(), 5)
        await hub.stop()


async def _unregister_fleet(conns: list[NATS], n: int) -> None:
    """Leave the registry empty for the next scenario."""
    if not conns:
        return
    sem = asyncio.Semaphore(256)

    async def one(i: int) -> None:
        agent_id = f"{NAMESPACE}.svc{i % 97}.a{i}"
        subject = protocol.hub_agent_subject(agent_id, "unregister")
        async with sem:
            with contextlib.suppress(Exception):
                await conns[i % len(conns)].request(
                    subject, protocol.dumps({"agent_id": agent_id}), timeout=5
                )

    await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(n))), 120)


def _median(xs: list[float]) -> float:
    vals = sorted(x for x in xs if x == x)
    return round(percentile(vals, 50), 2) if vals else float("nan")


async def run_registry_scale(
    url: str, server_pid: int, quick: bool, log: Callable[[str], None]
) -> dict[str, Any]:
    sizes = (1000,) if quick else (1000, 10_000)
    window = 3.0 if quick else 15.0
    trials = 1 if quick else 3
    out: dict[str, Any] = {}
    for n in sizes:
        out[str(n)] = await _one_size(url, server_pid, n, window, trials, log)
    return out


def run_selector_micro(quick: bool) -> dict[str, Any]:
    """AgentIndex + Selector over a 10k fleet, in this process (bench/selector_bench.py)."""
    from reach_mesh.hub.index import AgentIndex
    from reach_mesh.selector import Selector

    iterations = 1000 if quick else 5000
    rng = random.Random(1)
    agents = selector_bench.build(10_000, rng)
    index = AgentIndex()
    t0 = time.perf_counter()
    for agent_id, caps, labels in agents:
        index.upsert(agent_id, caps, labels)
    build_ms = (time.perf_counter() - t0) * 1000
    selective = Selector.parse(selector_bench.SELECTOR)
    broad = Selector.parse(selector_bench.BROAD)
    return {
        "agents": len(agents),
        "index_build_ms": round(build_ms, 1),
        "selective": {
            "selector": selector_bench.SELECTOR,
            "matches": len(index.candidates(selective)),
            **selector_bench.percentiles(lambda: index.candidates(selective), iterations),
        },
        "broad": {
            "selector": selector_bench.BROAD,
            "matches": len(index.candidates(broad)),
            **selector_bench.percentiles(lambda: index.candidates(broad), iterations // 5),
        },
        "parse_uncached": selector_bench.percentiles(
            lambda: Selector.parse(f"{selector_bench.SELECTOR} AND n!={rng.random()}"), iterations
        ),
    }
