"""Scale-out on NATS's own clustering: a 3-node JetStream cluster with R3 buckets, two hubs on
different nodes; a node is SIGKILLed and the mesh keeps routing and registering."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import nats
import pytest

from reach_mesh import Client, MeshSettings, MeshTimeoutError
from reach_mesh.agent import Agent, Task
from reach_mesh.hub import Hub
from reach_mesh.server import EmbeddedNats

from .helpers import cluster_nodes, eventually


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[EmbeddedNats]]:
    base: Path = tmp_path_factory.mktemp("cluster")
    nodes = cluster_nodes(base)
    for node in nodes:
        node.start()
    try:
        yield nodes
    finally:
        for node in nodes:
            node.stop()


async def _js_ready(url: str, timeout: float = 20.0) -> None:
    """Wait until the cluster has a JetStream meta leader (R3 streams can be created)."""
    nc = await nats.connect(url)
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                await nc.jetstream().account_info()
                return
            except Exception:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.2)
    finally:
        await nc.close()


async def test_node_loss_keeps_the_mesh_working(cluster: list[EmbeddedNats]) -> None:
    urls = [n.url for n in cluster]
    await _js_ready(urls[0])
    base = dict(
        kv_replicas=3,
        heartbeat_interval=0.5,
        lease_timeout=3.0,
        suspect_timeout=3.0,
        request_timeout=15.0,
        audit_enabled=False,
    )
    # Hub A talks to node 0 only; hub B and everything else to nodes 1 and 2 (node 0 dies).
    s_a = MeshSettings(nats_url=urls[0], namespace="ha", **base)
    s_b = MeshSettings(nats_url=f"{urls[1]},{urls[2]}", namespace="ha", **base)

    def make(agent_id: str) -> Agent:
        agent = Agent(agent_id, settings=s_b)

        @agent.handler("ha:echo:v1")
        async def echo(task: Task[Any]) -> Any:
            return task.payload

        return agent

    hub_a = Hub(settings=s_a, hub_id="hub-a")
    await hub_a.start()
    try:
        async with Hub(settings=s_b, hub_id="hub-b") as hub_b, make("ha.echo.a1") as a1:
            await eventually(lambda: "ha.echo.a1" in hub_a.registry.agents, timeout=10)
            async with Client(settings=s_b) as c:
                assert (await c.request(capability="ha:echo:v1", payload=1)).result == 1
                cluster[0].kill()  # SIGKILL one node (possibly the raft leader) and hub A's link
                # Routing is core NATS on the surviving nodes: it keeps working through the
                # election; hub B answers alone.
                # Proxy routing is at-most-once: a request (or its answer) in flight through
                # hub A while its node dies is lost with it, and the caller retries. Hub A
                # itself reconnects to a surviving node (servers discovered from the cluster).
                lost = 0
                for i in range(5):
                    try:
                        res = await c.request(capability="ha:echo:v1", payload=i, timeout=5)
                    except MeshTimeoutError:
                        lost += 1
                        res = await c.request(capability="ha:echo:v1", payload=i, timeout=10)
                    assert res.result == i
                assert lost <= 1
                # Registry writes (KV R3) resume once a new leader is elected: a new agent
                # registers (the SDK retries) and becomes routable.
                async with make("ha.echo.a2") as a2:
                    res = await c.request(agent_id=a2.agent_id, payload="new", timeout=10)
                    assert res.result == "new"
                # The first agent's heartbeats kept its lease through the election.
                assert hub_b.registry.agents[a1.agent_id].state.value == "ONLINE"
    finally:
        await hub_a.close()
