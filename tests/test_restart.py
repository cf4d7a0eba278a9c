"""A nats-server restart (same port, same JetStream store): hubs and agents reconnect, the
registry is intact, new registrations are seen, and durable workflows run again at once."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from reach_mesh import Client, MeshSettings, Step
from reach_mesh.agent import Agent, Task
from reach_mesh.hub import Hub
from reach_mesh.models import AgentState
from reach_mesh.server import EmbeddedNats

from .helpers import eventually, free_port


def _agent(agent_id: str, cap: str, settings: MeshSettings) -> Agent:
    agent = Agent(agent_id, settings=settings)

    @agent.handler(cap)
    async def echo(task: Task[Any]) -> Any:
        return task.payload

    return agent


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
            _agent("rs.echo.a1", "rs:echo:v1", s),
            Client(settings=s) as c,
        ):
            assert (await c.request(capability="rs:echo:v1", payload=1)).result == 1
            server.kill()
            server = EmbeddedNats(tmp_path, port=port)
            await server.astart()
            # Routing: the client retries while the hub reconnects.
            res = await c.request(capability="rs:echo:v1", payload=2, timeout=10)
            assert res.result == 2
            # The registry watch still delivers: a new agent becomes routable.
            async with _agent("rs.echo.b1", "rs:other:v1", s):
                await eventually(lambda: "rs.echo.b1" in hub.registry.agents)
                res = await c.request(capability="rs:other:v1", payload=3, timeout=10)
                assert res.result == 3
            # Durable workflows: pull requests lost with the old server are renewed.
            wf = await c.chain([Step(capability="rs:echo:v1", payload={"x": 1})], timeout=8)
            assert wf.ok and wf.result == {"x": 1}
            assert hub.registry.agents["rs.echo.a1"].state is AgentState.ONLINE
    finally:
        server.stop()
