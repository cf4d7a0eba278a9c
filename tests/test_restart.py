"""A nats-server restart (same port, same JetStream store): hubs and agents reconnect, the
registry is intact, new registrations are seen, and durable workflows run again at once."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

from reach_mesh import Client, MeshSettings, Step
from reach_mesh.agent import Agent, Task
from reach_mesh.hub import Hub
from reach_mesh.models import AgentState
from reach_mesh.server import EmbeddedNats

from .helpers import eventually, free_port, payload_echo, relayed


async def test_server_restart(tmp_path: Path) -> None:
    port = free_port()
    server = EmbeddedNats(tmp_path, port=port)
    await server.astart()
    s = MeshSettings(
        nats_url=server.url,
        namespace="rs",
        heartbeat_interval=0.5,
        lease_timeout=3.0,
        suspect_timeout=3.0,
        audit_enabled=False,
    )
    try:
        async with (
            Hub(settings=s) as hub,
            payload_echo("rs.echo.a1", "rs:echo:v1", s),
            Client(settings=s) as c,
        ):
            assert (await c.request(capability="rs:echo:v1", payload=1)).result == 1
            server.kill()
            server = EmbeddedNats(tmp_path, port=port)
            await server.astart()
            # The killed server's log is kept beside the new one's (what it said last is what
            # an operator looks for), the new one starts empty.
            before = (tmp_path / "nats.log.1").read_text()
            now = (tmp_path / "nats.log").read_text()
            assert before.count("Server is ready") == 1 and now.count("Server is ready") == 1
            # Routing: the client retries while the hub reconnects, and the hub waits for the
            # agent to be back on the new server (nobody on its subject until then).
            res = await c.request(capability="rs:echo:v1", payload=2, timeout=10)
            assert res.result == 2
            # The registry watch still delivers: a new agent becomes routable.
            async with payload_echo("rs.echo.b1", "rs:other:v1", s):
                await eventually(lambda: "rs.echo.b1" in hub.registry.agents)
                res = await c.request(capability="rs:other:v1", payload=3, timeout=10)
                assert res.result == 3
            # Durable workflows: pull requests lost with the old server are renewed.
            wf = await c.chain([Step(capability="rs:echo:v1", payload={"x": 1})], timeout=8)
            assert wf.ok and wf.result == {"x": 1}
            assert hub.registry.agents["rs.echo.a1"].state is AgentState.ONLINE
    finally:
        server.stop()


async def test_outage_longer_than_the_lease_declares_nobody_lost(tmp_path: Path) -> None:
    """NATS is gone for longer than lease + suspect grace: the hub saw no heartbeat, but it
    also could not see any, so it declares nobody LOST; the agent is ONLINE again after."""
    port = free_port()
    server = EmbeddedNats(tmp_path, port=port)
    await server.astart()
    s = MeshSettings(
        nats_url=server.url,
        namespace="blind",
        heartbeat_interval=0.3,
        lease_timeout=1.0,
        suspect_timeout=0.5,
        liveness_interval=0.05,
        audit_enabled=False,
    )
    transitions: list[AgentState] = []
    try:
        async with Hub(settings=s) as hub, payload_echo("blind.echo.a1", "blind:echo:v1", s):
            hub.registry.on_state_change(lambda view, old, new: transitions.append(new))
            await eventually(lambda: "blind.echo.a1" in hub.registry.agents, timeout=5)
            server.kill()
            await asyncio.sleep(3.0)  # 2x lease + grace without a single heartbeat
            server = EmbeddedNats(tmp_path, port=port)
            await server.astart()
            await eventually(
                lambda: hub.registry.agents["blind.echo.a1"].state is AgentState.ONLINE,
                timeout=10,
            )
            during = list(transitions)  # (the agent's own exit adds DRAINING, LOST)
    finally:
        server.stop()
    assert AgentState.SUSPECT in during and AgentState.LOST not in during


async def test_a_caller_cut_off_while_its_workflow_finished_gets_it_when_back(
    nats_url: str, namespace: str
) -> None:
    """A workflow finishes while its caller's connection is down: the .done published then
    never reaches it. Back on NATS, the caller reads the stored result at once instead of
    waiting out its timeout."""
    settings = MeshSettings(nats_url=nats_url, namespace=namespace)
    started, release = asyncio.Event(), asyncio.Event()
    agent = Agent(f"{namespace}.slow.a1", settings=settings)

    @agent.handler("wf:slow:v1")
    async def slow(task: Task[Any]) -> Any:
        started.set()
        await release.wait()
        return {"done": True}

    relay, away = await relayed(nats_url, settings)
    async with Hub(settings=settings), Client(settings=settings) as direct:
        await agent.start()
        try:
            async with Client(settings=away) as mesh:
                waiting = asyncio.create_task(
                    mesh.fanout([Step(capability="wf:slow:v1")], workflow_id="cut-1", timeout=60)
                )
                await asyncio.wait_for(started.wait(), 10)
                await relay.cut()
                release.set()
                stored = await direct.workflow("cut-1", timeout=10)  # final while mesh is away
                assert stored.ok
                await asyncio.sleep(0.5)
                assert not waiting.done()
                t0 = time.monotonic()
                await relay.start()
                result = await asyncio.wait_for(waiting, 10)
                assert result.ok and result.workflow_id == "cut-1"
                assert time.monotonic() - t0 < 5.0, "read at the reconnect, not at the timeout"
        finally:
            await agent.close()
