"""Time is the server's: a hub whose wall clock is off the NATS server's keeps workflows'
deadlines by the server's clock.

A workflow's deadline is its submission's stored time (the server's clock) plus its timeout.
Read against the hub's own clock, a hub two minutes ahead timed every shorter workflow out at
once, dropping the results its agents sent; one behind let them run two minutes past their
deadline. The hub now reads "now" from ``ServerClock``, which learns the skew from the
timestamps of the JetStream messages it receives live.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import pytest

from reach_mesh import Client, MeshSettings, Step
from reach_mesh._cli_doctor import diagnose
from reach_mesh.agent import Agent, Task
from reach_mesh.hub import Hub
from reach_mesh.hub._server_clock import WINDOW, ServerClock
from reach_mesh.models import AgentState, TaskState

from .helpers import WF_FAST


def test_the_skew_is_the_least_delay_seen_lately() -> None:
    wall, mono = [1000.0], [0.0]
    clock = ServerClock(wall=lambda: wall[0], monotonic=lambda: mono[0])
    assert clock.skew == 0.0 and clock.now() == 1000.0  # nothing seen: the local clock
    clock.sample(1000.0 - 120.5)  # this host is 120 s ahead; that message took 0.5 s
    clock.sample(1000.0 - 120.001)
    clock.sample(1000.0 - 300.0)  # an old message read late: no information
    assert clock.skew == pytest.approx(120.001)
    assert clock.now() == pytest.approx(1000.0 - 120.001)
    # NTP steps this host back by 120 s: followed at once (a smaller skew is seen).
    wall[0] -= 120.0
    clock.sample(wall[0] - 0.002)
    assert clock.skew == pytest.approx(0.002)
    # Stepped ahead by 30 s: the least of the last two windows still holds it back...
    wall[0] += 30.0
    mono[0] += WINDOW
    clock.sample(wall[0] - 30.002)
    assert clock.skew == pytest.approx(0.002)
    # ...until a whole window without the old skew.
    mono[0] += WINDOW
    clock.sample(wall[0] - 30.003)
    assert clock.skew == pytest.approx(30.002)
    # No messages for a long while: the last skew known holds.
    mono[0] += 10 * WINDOW
    assert clock.skew == pytest.approx(30.002)


def _skewed(monkeypatch: pytest.MonkeyPatch, seconds: float) -> None:
    """This process's wall clock ``seconds`` off the NATS server's (another host's)."""
    real: Callable[[], float] = time.time
    monkeypatch.setattr(time, "time", lambda: real() + seconds)


def _settings(nats_url: str, namespace: str) -> MeshSettings:
    return MeshSettings(nats_url=nats_url, namespace=namespace, **WF_FAST)


@pytest.mark.parametrize("skew", [120.0, -120.0])
async def test_deadlines_hold_by_the_servers_clock_on_a_skewed_host(
    monkeypatch: pytest.MonkeyPatch, nats_url: str, namespace: str, skew: float
) -> None:
    """A 30 s workflow whose step takes 0.3 s succeeds (ahead, it was TIMEOUT at once, the
    result dropped); a 2 s workflow whose step takes 6 s is TIMEOUT at about 2 s (behind, it
    ran on and SUCCEEDED past its deadline). Its times are the server's."""
    _skewed(monkeypatch, skew)
    settings = _settings(nats_url, namespace)
    agent = Agent(f"{namespace}.clock.a1", settings=settings)

    @agent.handler("test:sleep:v1")
    async def sleep(task: Task[Any]) -> Any:
        await asyncio.sleep(task.payload)
        return task.payload

    async with Hub(settings=settings), agent, Client(settings=settings) as mesh:
        ok = await mesh.fanout([Step(capability="test:sleep:v1", payload=0.3)], timeout=30)
        assert ok.state is TaskState.SUCCEEDED, ok
        assert ok.submitted_at is not None and ok.finished_at is not None
        assert abs(ok.finished_at - (time.time() - skew)) < 5  # the server's clock, not ours
        assert ok.duration_ms is not None and 0 < ok.duration_ms < 5000, ok.duration_ms
        t0 = time.monotonic()
        late = await mesh.fanout([Step(capability="test:sleep:v1", payload=6.0)], timeout=2)
        assert late.state is TaskState.TIMEOUT, late
        assert time.monotonic() - t0 < 5, time.monotonic() - t0
        # The operator is told: the doctor names the hub and its skew.
        hubs = {f.check: f for f in await diagnose(settings)}["hubs"]
        assert hubs.status == "warn" and "clock off the NATS server's" in hubs.detail, hubs
        assert f"{skew:+.0f}." in hubs.detail, hubs


async def test_a_hub_knows_the_servers_clock_from_its_start(
    monkeypatch: pytest.MonkeyPatch, nats_url: str, namespace: str
) -> None:
    """A hub 120 s ahead that starts among running agents: before any heartbeat reached it,
    it aged their stored heartbeats by its own clock, 120 s, and took them for LOST. It asks the
    server's time (a stream's info) before it loads the registry."""
    settings = _settings(nats_url, namespace)
    agent = Agent(f"{namespace}.clock.a1", settings=settings)

    @agent.handler("test:sleep:v1")
    async def sleep(task: Task[Any]) -> Any:
        return task.payload

    async with Hub(settings=settings), agent:
        _skewed(monkeypatch, 120.0)
        late = Hub(settings=settings)
        await late.start()
        try:
            assert late.registry.server_clock.skew == pytest.approx(120.0, abs=1.0)
            view = late.registry.agents[agent.agent_id]
            assert view.state is AgentState.ONLINE, view.state
            assert time.monotonic() - view.last_seen < settings.heartbeat_interval + 1
        finally:
            await late.close()


async def test_a_tiny_timeout_runs_nothing_while_the_hubs_estimate_lags(
    monkeypatch: pytest.MonkeyPatch, nats_url: str, namespace: str
) -> None:
    """The hub's estimate of the server's clock is behind it by the least delay among its
    samples: a few ms on a loaded machine. A deadline counted from that estimate gave a
    workflow those ms: with a 1e-9 s timeout its step was sent, ran, and the chain ended
    SUCCEEDED (``make test`` under load, once). The server's clock is past the submission's
    stored time whatever the estimate says: nothing is sent."""
    settings = _settings(nats_url, namespace)
    ran: list[Any] = []
    agent = Agent(f"{namespace}.clock.a1", settings=settings)

    @agent.handler("test:tiny:v1")
    async def tiny(task: Task[Any]) -> Any:
        ran.append(task.payload)
        return task.payload

    async with Hub(settings=settings) as hub, agent, Client(settings=settings) as mesh:
        clock = hub.registry.server_clock
        monkeypatch.setattr(clock, "now", lambda: time.time() - clock.skew - 0.05)
        chain = await mesh.chain([Step(capability="test:tiny:v1", payload=0)], timeout=1e-9)
        assert chain.state is TaskState.TIMEOUT, chain
        await asyncio.sleep(0.3)  # (a step sent would have run by now)
    assert ran == []


async def test_a_host_clock_stepped_ahead_costs_no_agent_its_lease(
    monkeypatch: pytest.MonkeyPatch, settings: MeshSettings, namespace: str
) -> None:
    """The hubs' host clock steps 5 s ahead (NTP) while their agents beat (to either hub, as
    the queue group picks): the estimate of the server's clock keeps the old skew for one to
    two minutes (``ServerClock``: the least over two windows), so it runs 5 s ahead, and every
    stored entry looks 5 s older than it is — longer than a lease and its grace here (0.6 s
    each). A lease counts from a beat's arrival, not from its stored time mapped onto the
    hub's clock: counted from the stored time (never later than arrival), a beat another hub
    wrote renewed nothing, and live agents went SUSPECT, then LOST — deleted for every hub
    (scratch run: 12 SUSPECT and 2 LOST verdicts on one hub in 8 s, six agents)."""
    agents = []
    for n in range(4):
        agent = Agent(f"{namespace}.step.a{n}", settings=settings)

        @agent.handler("test:step:v1")
        async def echo(task: Task[Any]) -> Any:
            return task.payload

        agents.append(agent)
    async with Hub(settings=settings) as one, Hub(settings=settings) as two:
        try:
            for agent in agents:
                await agent.start()
            await asyncio.sleep(1.0)
            went: list[tuple[str, AgentState]] = []
            for hub in (one, two):
                hub.registry.on_state_change(lambda v, old, new: went.append((v.agent_id, new)))
            server_now = one.registry.server_clock.now()
            _skewed(monkeypatch, 5.0)
            assert one.registry.server_clock.now() - server_now == pytest.approx(5.0, abs=0.5)
            await asyncio.sleep(3.0)
            assert went == [], went
            for hub in (one, two):
                states = {hub.registry.agents[a.agent_id].state for a in agents}
                assert states == {AgentState.ONLINE}, states
        finally:
            for agent in agents:
                await agent.close()
