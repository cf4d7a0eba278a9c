"""End to end on a real nats-server: register → route → reply, leases, two hubs, re-registration."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from pydantic import BaseModel

from reach_mesh import Client, MeshSettings, NoMatchError, TaskState
from reach_mesh.agent import Agent, Task
from reach_mesh.hub import Hub
from reach_mesh.models import AgentState

from .helpers import eventually


class Sum(BaseModel):
    a: int
    b: int


def make_agent(agent_id: str, settings: MeshSettings, **kw: Any) -> Agent:
    agent = Agent(agent_id, settings=settings, **kw)

    @agent.handler("math:add:v1")
    async def add(task: Task[Sum]) -> dict[str, int]:
        return {"sum": task.payload.a + task.payload.b}

    return agent


async def test_register_route_reply(hub: Hub, settings: MeshSettings, namespace: str) -> None:
    async with make_agent(f"{namespace}.math.a1", settings), Client(settings=settings) as c:
        res = await c.request(capability="math:add:v1", payload={"a": 2, "b": 3})
        assert res.state is TaskState.SUCCEEDED
        assert res.result == {"sum": 5}
        assert res.agent_id == f"{namespace}.math.a1"
        assert res.attempt == 1
        assert res.trace_id is not None and len(res.trace_id) == 32
        by_id = await c.request(agent_id=f"{namespace}.math.a1", payload={"a": 1, "b": 1})
        assert by_id.result == {"sum": 2}


async def test_least_loaded_spreads_work(hub: Hub, settings: MeshSettings, namespace: str) -> None:
    seen: dict[str, int] = {}
    release = asyncio.Event()
    agents = []
    for i in range(3):
        agent = Agent(f"{namespace}.slow.a{i}", settings=settings, max_concurrency=4)

        @agent.handler("work:slow:v1")
        async def slow(task: Task[Any]) -> str:
            seen[task.agent_id] = seen.get(task.agent_id, 0) + 1
            await release.wait()
            return task.agent_id

        agents.append(agent)
    for agent in agents:
        await agent.start()
    try:
        async with Client(settings=settings) as c:
            calls = [
                asyncio.create_task(c.request(capability="work:slow:v1", payload=i))
                for i in range(6)
            ]
            await eventually(lambda: sum(seen.values()) == 6)
            release.set()
            results = await asyncio.gather(*calls)
        assert all(r.ok for r in results)
        # 6 concurrent tasks over 3 idle agents: least-loaded gives each exactly two.
        assert sorted(seen.values()) == [2, 2, 2]
    finally:
        for agent in agents:
            await agent.close()


async def test_handler_failure_is_a_failed_result(
    hub: Hub, settings: MeshSettings, namespace: str
) -> None:
    agent = Agent(f"{namespace}.bad.a1", settings=settings)

    @agent.handler("work:boom:v1")
    async def boom(task: Task[Any]) -> None:
        raise RuntimeError("kaput")

    async with agent, Client(settings=settings) as c:
        res = await c.request(capability="work:boom:v1", payload={})
        assert res.state is TaskState.FAILED
        assert res.error is not None and res.error.code == "REACH_HANDLER_FAILED"
        assert "kaput" in res.error.message


async def test_bounded_concurrency(hub: Hub, settings: MeshSettings, namespace: str) -> None:
    running = 0
    peak = 0
    agent = Agent(f"{namespace}.cc.a1", settings=settings, max_concurrency=2, max_queue=20)

    @agent.handler("work:cc:v1")
    async def work(task: Task[Any]) -> None:
        nonlocal running, peak
        running += 1
        peak = max(peak, running)
        await asyncio.sleep(0.05)
        running -= 1

    async with agent, Client(settings=settings) as c:
        results = await asyncio.gather(
            *(c.request(agent_id=agent.agent_id, payload=i) for i in range(8))
        )
    assert all(r.ok for r in results)
    assert peak == 2


async def test_two_hubs_share_one_registry(settings: MeshSettings, namespace: str) -> None:
    async with Hub(settings=settings, hub_id="hub-a") as hub_a:
        hub_b = Hub(settings=settings, hub_id="hub-b")
        await hub_b.start()
        try:
            async with make_agent(f"{namespace}.math.a1", settings) as agent:
                await eventually(lambda: agent.agent_id in hub_b.registry.agents)
                await eventually(lambda: agent.agent_id in hub_a.registry.agents)
                async with Client(settings=settings) as c:
                    await hub_a.close()  # one hub goes away; the other still routes
                    res = await c.request(capability="math:add:v1", payload={"a": 1, "b": 2})
                    assert res.result == {"sum": 3}
        finally:
            await hub_b.close()


async def test_lease_expiry_then_lost(hub: Hub, settings: MeshSettings, namespace: str) -> None:
    agent = make_agent(f"{namespace}.math.a1", settings)
    await agent.start()
    try:
        assert hub.registry.agents[agent.agent_id].state is AgentState.ONLINE
        # Silence the heartbeats (a hung agent): the lease lapses on the hub's clock.
        assert agent._hb_task is not None
        agent._hb_task.cancel()
        await eventually(
            lambda: hub.registry.agents[agent.agent_id].state is AgentState.SUSPECT, timeout=3
        )
        await eventually(lambda: agent.agent_id not in hub.registry.agents, timeout=3)
        async with Client(settings=settings) as c:
            with pytest.raises(NoMatchError):
                await c.request(capability="math:add:v1", payload={"a": 1, "b": 2})
    finally:
        await agent.close()


async def test_suspect_used_only_as_fallback(
    hub: Hub, settings: MeshSettings, namespace: str
) -> None:
    quiet = make_agent(f"{namespace}.math.quiet", settings)
    live = make_agent(f"{namespace}.math.live", settings)
    await quiet.start()
    await live.start()
    try:
        assert quiet._hb_task is not None
        quiet._hb_task.cancel()
        await eventually(
            lambda: hub.registry.agents[quiet.agent_id].state is AgentState.SUSPECT, timeout=3
        )
        async with Client(settings=settings) as c:
            for _ in range(5):
                res = await c.request(capability="math:add:v1", payload={"a": 1, "b": 1})
                assert res.agent_id == live.agent_id
            await live.close()
            await eventually(lambda: live.agent_id not in hub.registry.agents)
            res = await c.request(capability="math:add:v1", payload={"a": 1, "b": 1}, explain=True)
            assert res.agent_id == quiet.agent_id
            assert res.decision is not None and res.decision.fallback == "suspect"
    finally:
        await quiet.close()
        await live.close()


async def test_graceful_unregister_is_prompt(
    hub: Hub, settings: MeshSettings, namespace: str
) -> None:
    agent = make_agent(f"{namespace}.math.a1", settings)
    await agent.start()
    assert agent.agent_id in hub.registry.agents
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    await agent.close()
    await eventually(lambda: agent.agent_id not in hub.registry.agents, timeout=1.0)
    assert loop.time() - t0 < 1.0


async def test_reregistration_replaces_capabilities(
    hub: Hub, settings: MeshSettings, namespace: str
) -> None:
    agent_id = f"{namespace}.multi.a1"
    first = make_agent(agent_id, settings)
    await first.start()
    await first.close()
    second = Agent(agent_id, settings=settings)

    @second.handler("text:upper:v1")
    async def upper(task: Task[str]) -> str:
        return task.payload.upper()

    async with second, Client(settings=settings) as c:
        view = hub.registry.agents[agent_id]
        assert view.record.card.capabilities == ["text:upper:v1"]
        assert hub.registry.index.by_capability("math:add:v1") == frozenset()
        with pytest.raises(NoMatchError):
            await c.request(capability="math:add:v1", payload={"a": 1, "b": 1})
        res = await c.request(capability="text:upper:v1", payload="hi")
        assert res.result == "HI"


async def test_restart_without_unregister_replaces_old_session(
    hub: Hub, settings: MeshSettings, namespace: str
) -> None:
    """A crashed agent that comes back under the same id: no ghost, new session wins."""
    agent_id = f"{namespace}.math.a1"
    crashed = make_agent(agent_id, settings)
    await crashed.start()
    old_session = crashed.session
    assert crashed._hb_task is not None
    # Crashed: its heartbeats stop and its connection goes (with its subscriptions), and it
    # never unregisters. (A live process of the id would hold the replacement back.)
    crashed._hb_task.cancel()
    await crashed.nc.close()
    replacement = make_agent(agent_id, settings)
    async with replacement:
        assert hub.registry.agents[agent_id].record.session == replacement.session
        assert replacement.session != old_session
        # One agent of the id (records of other tests' namespaces may outlive them).
        assert [v.agent_id for v in hub.registry.views(namespace)] == [agent_id]
    await crashed.close()


async def test_heartbeat_from_unknown_agent_reregisters(
    hub: Hub, settings: MeshSettings, namespace: str
) -> None:
    agent = make_agent(f"{namespace}.math.a1", settings)
    async with agent:
        # The hub forgets the agent (e.g. an operator removed it): the next heartbeat is
        # answered REACH_UNKNOWN_AGENT and the SDK registers again by itself.
        await hub.registry.unregister(agent.agent_id, None)
        assert agent.agent_id not in hub.registry.agents
        await eventually(lambda: agent.agent_id in hub.registry.agents, timeout=3)
