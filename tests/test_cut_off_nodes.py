"""Hubs and agents on a NATS server cut off from the rest of its cluster, on a real 3-node
cluster: they leave it for a server of the majority's side, as a caller does
(``tests/test_submit_election.py``), and go on serving and being served there.

A partition between servers leaves the cut-off node's clients connected to it (it answers
their PINGs); it tells them of the cut in its INFO (it lists only the servers it still has a
route to: ``_nats._Connection``)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from pathlib import Path
from typing import Any

import pytest

from reach_mesh import Client, MeshSettings, Step, protocol
from reach_mesh.agent import Agent, Task
from reach_mesh.hub import Hub
from reach_mesh.models import AgentState, TaskState
from reach_mesh.server import EmbeddedNats

from .helpers import WF_FAST, Relay, cluster_nodes, eventually, payload_echo
from .test_cluster import _js_ready

pytestmark = pytest.mark.xdist_group("clusters")

#: Fast leases: lease + grace 1.2 s, a cut of 4 s is past it three times over.
_FAST: dict[str, Any] = dict(
    kv_replicas=3,
    heartbeat_interval=0.2,
    lease_timeout=0.6,
    suspect_timeout=0.6,
    liveness_interval=0.05,
    audit_enabled=False,
)
#: How long the cut lasts.
_CUT = 4.0


async def _cluster(tmp_path: Path, name: str) -> tuple[list[EmbeddedNats], dict[Any, Relay]]:
    relays: dict[tuple[int, int], Relay] = {}
    nodes = cluster_nodes(tmp_path, name=name, route_relays=relays)
    for relay in relays.values():
        await relay.start()
    for node in nodes:
        node.start()
    await _js_ready(nodes[0].url)
    return nodes, relays


async def _led_by_n0(hub: Hub, *streams: str) -> None:
    """Every one of ``streams`` led from n0 (not the node to be cut off), its replicas
    current: the majority's side keeps their leaders through the cut."""
    js = hub.nc.jetstream(timeout=5.0)
    preferred = json.dumps({"placement": {"preferred": "n0"}}).encode()

    async def led() -> bool:
        for stream in streams:
            with contextlib.suppress(Exception):
                info = await js.stream_info(stream)
                cluster = info.cluster
                if cluster is not None and cluster.leader == "n0":
                    replicas = cluster.replicas or []
                    if len(replicas) == 2 and all(r.current for r in replicas):
                        continue
                    return False
                await hub.nc.request(f"$JS.API.STREAM.LEADER.STEPDOWN.{stream}", preferred)
            return False
        return True

    await eventually(led, timeout=30, interval=0.5)


async def _online(hub: Hub, agent: Agent) -> None:
    """Until ``hub`` sees ``agent`` ONLINE (10 s)."""
    await eventually(
        lambda: (
            agent.agent_id in hub.registry.agents
            and hub.registry.agents[agent.agent_id].state is AgentState.ONLINE
        ),
        timeout=10,
    )


async def _requests_until(
    client: Client, capability: str, end: float
) -> tuple[list[Any], list[str]]:
    """Requests of ``capability``, one every 0.2 s until ``end`` (``time.monotonic``): what
    each served one answered, and what each failed one raised."""
    served: list[Any] = []
    failed: list[str] = []
    i = 0
    while time.monotonic() < end:
        i += 1
        try:
            reply = await client.request(capability=capability, payload=i, timeout=2.0)
            served.append(reply.result)
        except Exception as err:
            failed.append(f"{i}: {err!r}")
        await asyncio.sleep(0.2)
    return served, failed


async def _cut(relays: dict[Any, Relay], node: int) -> None:
    for (i, j), relay in relays.items():
        if node in (i, j):
            await relay.cut()


async def _heal(relays: dict[Any, Relay], node: int) -> None:
    for (i, j), relay in relays.items():
        if node in (i, j):
            with contextlib.suppress(Exception):
                await relay.start()


@pytest.mark.timeout(120)
async def test_an_agent_on_a_server_cut_off_from_its_cluster_moves_and_stays_online(
    tmp_path: Path,
) -> None:
    """The agent's server (n1) loses its routes to the other two, where the hub is. Before,
    the agent stayed on it: its heartbeats found no hub (no route to the other side), the hub
    declared it SUSPECT then LOST within lease + grace and routed nothing to it for the whole
    cut, though two healthy servers were up. Now it leaves n1 for one of them at once (its
    INFO lists one URL of three), and stays ONLINE and served: a reconnection, as when its
    server dies, within its lease."""
    nodes, relays = await _cluster(tmp_path, "cutagent")
    try:
        hub_side = MeshSettings(nats_url=nodes[0].url, namespace="ca", **_FAST)
        # Given the server to be cut off alone: the others are those its INFO told of.
        agent_side = MeshSettings(nats_url=nodes[1].url, namespace="ca", **_FAST)
        agent = payload_echo("ca.echo.a1", "ca:echo:v1", agent_side)

        async with Hub(settings=hub_side, hub_id="hub-a") as hub, agent:
            await _led_by_n0(hub, f"KV_{protocol.KV_HEARTBEATS}")
            await _online(hub, agent)
            cut = nodes[1].url.split("//")[1]
            assert agent.nc.connected_url is not None
            assert agent.nc.connected_url.netloc == cut
            seen: list[AgentState] = []
            hub.registry.on_state_change(
                lambda view, old, new: seen.append(new) if view.agent_id == agent.agent_id else None
            )
            async with Client(settings=hub_side) as client:
                assert (await client.request(capability="ca:echo:v1", payload=0)).result == 0
                await _cut(relays, 1)
                try:
                    t0 = time.monotonic()
                    moves: list[float] = []

                    def moved() -> bool:
                        url = agent.nc.connected_url
                        if url is None or url.netloc == cut:
                            return False
                        moves.append(time.monotonic() - t0)
                        return True

                    # (A task sent as the routes drop may be lost in the cut itself: the
                    # requests begin once the agent is seen moved, or 2 s on without it.)
                    with contextlib.suppress(AssertionError):
                        await eventually(moved, 2.0, interval=0.005)
                    await asyncio.sleep(0.1)
                    served, failed = await _requests_until(client, "ca:echo:v1", t0 + _CUT)
                    url = agent.nc.connected_url
                    moved_to = None if url is None else url.netloc
                    view = hub.registry.agents.get(agent.agent_id)
                    state = None if view is None else view.state
                    during = list(seen)
                finally:
                    await _heal(relays, 1)
        assert AgentState.LOST not in during, during
        assert state is AgentState.ONLINE, state
        # Every request of the cut served (the first may wait for the move: a few ms).
        assert not failed, failed
        assert len(served) >= 5, served
        assert moved_to is not None and moved_to != cut, moved_to
        (moved_in,) = moves
        assert moved_in < 1.0, moved_in  # (measured: 6-23 ms)
    finally:
        for node in nodes:
            node.stop()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", ["plain", "slow_sibling", "two_names"])
async def test_a_hub_on_a_server_cut_off_from_its_cluster_moves_with_its_connections(
    tmp_path: Path, case: str
) -> None:
    """The hub's server (n1) loses its routes to the other two, where the agent and the caller
    are. Before, the hub stayed on it with its three connections: blind there (no quorum on
    its side), its writes proposals to stale leaders, and no hub at all on the majority's
    side, where every request of the cut found nobody to route it. Now all three leave n1
    together for one server of the other side (none sent back to n1 by the rule that a
    connection goes where the others are), and the hub routes the caller's requests to the
    agent there, which it keeps ONLINE.

    ``slow_sibling``: the statuses connection leaves 50 ms after the others (as one still
    reading what its server sent before the cut would): the main one, leaving first, takes the
    server it is still on for its siblings' and is not sent back there (nor, then, the others
    after it).

    ``two_names``: the hub is given n1 as ``localhost``, and n1 advertises itself as
    ``127.0.0.1``: that other name of the server left is made the first pick (its rank), as
    it is by chance in a third of the hubs. It took the main connection back, and the others
    after it; now landing there it leaves again, both names last."""
    nodes, relays = await _cluster(tmp_path, f"cuthub{case[0]}")
    try:
        # Given the server to be cut off alone: the others are those its INFO told of.
        given = nodes[1].url if case != "two_names" else f"nats://localhost:{nodes[1].port}"
        hub_side = MeshSettings(nats_url=given, namespace="ch", **_FAST)
        other_side = MeshSettings(nats_url=nodes[0].url, namespace="ch", **_FAST)
        agent = payload_echo("ch.echo.a1", "ch:echo:v1", other_side)

        async with Hub(settings=hub_side, hub_id="hub-b") as hub, agent:
            await _led_by_n0(hub, f"KV_{protocol.KV_HEARTBEATS}")
            await _online(hub, agent)
            cut = "n1"

            def servers() -> set[str | None]:
                return set(hub.together.servers().values())  # (server names)

            assert servers() == {cut}
            if case == "two_names":
                hub.together._ranks[f"127.0.0.1:{nodes[1].port}"] = -1.0
            if case == "slow_sibling":
                leave = hub.together._leaves["statuses"]

                def later() -> bool:
                    asyncio.get_running_loop().call_later(0.05, leave)
                    return True

                hub.together._leaves["statuses"] = later
            seen: list[AgentState] = []
            hub.registry.on_state_change(
                lambda view, old, new: seen.append(new) if view.agent_id == agent.agent_id else None
            )
            async with Client(settings=other_side) as client:
                assert (await client.request(capability="ch:echo:v1", payload=0)).result == 0
                await _cut(relays, 1)
                try:
                    t0 = time.monotonic()
                    moves: list[float] = []

                    def moved() -> bool:
                        at = servers()
                        if None in at or cut in at:
                            return False
                        moves.append(time.monotonic() - t0)
                        return True

                    # (A request sent as the routes drop may be lost in the cut itself: the
                    # requests begin once the hub is seen moved, or 2 s on without it.)
                    with contextlib.suppress(AssertionError):
                        await eventually(moved, 2.0, interval=0.005)
                    await asyncio.sleep(0.1)
                    served, failed = await _requests_until(client, "ch:echo:v1", t0 + _CUT)
                    during = list(seen)
                    at = servers()
                    apart = hub.together.apart()
                    view = hub.registry.agents.get(agent.agent_id)
                    state = None if view is None else view.state
                finally:
                    await _heal(relays, 1)
        assert not failed, failed
        assert len(served) >= 5, served
        assert AgentState.LOST not in during, during
        assert state is AgentState.ONLINE, state
        # All four together, on the other side.
        assert len(at) == 1 and cut not in at and not apart, at
        (moved_in,) = moves
        assert moved_in < 1.0, moved_in  # (measured: 6-12 ms; 17-18 with a slow sibling)
    finally:
        for node in nodes:
            node.stop()


@pytest.mark.timeout(60)
async def test_a_cut_off_server_known_under_two_names_is_not_taken_back_under_the_other(
    tmp_path: Path,
) -> None:
    """A server given under a host name is also in the pool under the address its INFO
    advertises (nats-py keeps both). Left because it was cut off, it was put last under the
    name it was left under only: tried first under the other, it took the connection back,
    whose next INFO lists its one URL — the new reference — and the connection stayed there for
    the whole cut. Now a reconnection that lands on the server it left (the same
    ``server_id``) under a name not yet tried leaves it again, both names last."""
    from reach_mesh._nats import connect

    nodes, relays = await _cluster(tmp_path, "alias")
    cut = nodes[1]
    other_name = f"127.0.0.1:{cut.port}"  # what the server advertises
    nc = await connect(
        f"nats://localhost:{cut.port}", name="alias", leave_cut_off=True, dont_randomize=True
    )
    try:
        left_id = nc._server_info["server_id"]
        await eventually(lambda: other_name in {s.uri.netloc for s in nc._server_pool})
        # The worst order: the cut-off server's other name first (nothing shuffles it).
        nc._server_pool.sort(key=lambda s: s.uri.netloc != other_name)

        def elsewhere() -> bool:
            return nc.is_connected and nc._server_info.get("server_id") != left_id

        await _cut(relays, 1)
        try:
            await eventually(elsewhere, timeout=3.0)
        finally:
            await _heal(relays, 1)
    finally:
        await nc.close()
        for node in nodes:
            node.stop()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("on_n1", ["agent", "hub"])
async def test_durable_steps_in_hand_when_a_server_is_cut_off_end_once(
    tmp_path: Path, on_n1: str
) -> None:
    """Workflow steps (JetStream work) running on the agent when n1 is cut off, with the agent
    (``agent``) or the hub that owns the workflow (``hub``) on n1, everything else on n0. The
    one on n1 leaves it with the steps in hand — the agent its statuses and acks, the hub its
    records and decisions going through the other side — and every step ends SUCCEEDED from
    its one run: the reconnection a work consumer, held steps, hedged status publishes and a
    hub's workflows already ride out when a server dies. Staying, the workflow had no result
    for the whole cut (the agent's final statuses, or the hub's writes, proposals to stale
    leaders)."""
    nodes, relays = await _cluster(tmp_path, f"cutwork{on_n1[0]}")
    try:
        fast = {**_FAST, **WF_FAST}
        n0 = MeshSettings(nats_url=nodes[0].url, namespace="cw", **fast)
        n1 = MeshSettings(nats_url=nodes[1].url, namespace="cw", **fast)
        hub_side, agent_side = (n0, n1) if on_n1 == "agent" else (n1, n0)
        agent = Agent("cw.slow.a1", settings=agent_side, max_concurrency=8)
        runs: dict[str, int] = {}
        started = asyncio.Event()

        @agent.handler("cw:slow:v1")
        async def slow(task: Task[Any]) -> Any:
            runs[task.task_id] = runs.get(task.task_id, 0) + 1
            started.set()
            await asyncio.sleep(1.0)
            return task.payload

        async with Hub(settings=hub_side, hub_id="hub-w") as hub, agent:
            streams = [
                f"KV_{protocol.KV_HEARTBEATS}",
                f"KV_{protocol.KV_TASKS}",
                f"KV_{protocol.KV_WORKFLOWS}",
                protocol.STREAM_WF,
                protocol.STREAM_WORK,
                protocol.STREAM_STATUS,
            ]
            await _led_by_n0(hub, *streams)
            await _online(hub, agent)
            seen: list[AgentState] = []
            hub.registry.on_state_change(
                lambda view, old, new: seen.append(new) if view.agent_id == agent.agent_id else None
            )
            async with Client(settings=n0) as client:
                steps = [Step(capability="cw:slow:v1", payload=k) for k in range(4)]
                wf_id = await client.submit_fanout(steps, timeout=30)
                await asyncio.wait_for(started.wait(), 10)
                await _cut(relays, 1)
                try:
                    result = await client.workflow(wf_id, timeout=_CUT)
                    during = list(seen)
                finally:
                    await _heal(relays, 1)
        assert result.state is TaskState.SUCCEEDED, result.error
        assert result.result == [0, 1, 2, 3], result.result
        assert AgentState.LOST not in during, during
        assert sorted(runs.values()) == [1, 1, 1, 1], runs
    finally:
        for node in nodes:
            node.stop()
