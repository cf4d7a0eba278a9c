"""A flood on any subject another identity may publish to cuts, at worst, a connection of the
hub's that carries that identity's kind of traffic — never the main one, which carries the
registry's and the workflows' JetStream (KV watches, pulls, acked writes) and every hub-to-hub
subject (docs/security.md, "Shared JetStream and bus").

The route and status floods are in ``test_abuse.py``; here every other subject a caller, an
operator or an agent may send to a hub: the caller and operator requests, the agents' own
verbs, and the hub's reply subjects an agent learns from the requests it serves (the proxied
tasks' and the asks': its namespace's)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from reach_mesh import protocol
from reach_mesh._nats_asking import reconnects_of
from reach_mesh.agent import Agent
from reach_mesh.hub import Hub
from reach_mesh.models import AgentState

from .helpers import eventually
from .test_abuse import _flood_from_a_thread, _tight_mesh

Target = Callable[[Hub, Agent], str]

#: Where each identity may flood a hub: its subject, given the hub and an agent of the mesh.
TARGETS: dict[str, Target] = {
    "agent heartbeat": lambda hub, a: protocol.hub_agent_subject(a.agent_id, "heartbeat"),
    "agent register": lambda hub, a: protocol.hub_agent_subject(a.agent_id, "register"),
    "agent record": lambda hub, a: protocol.hub_agent_subject(a.agent_id, "record"),
    "caller agents": lambda hub, a: protocol.hub_subject(a.namespace, "agents"),
    "caller report": lambda hub, a: protocol.hub_subject(a.namespace, "report"),
    "caller workflow": lambda hub, a: protocol.hub_subject(a.namespace, "workflow"),
    "operator admin": lambda hub, a: protocol.hub_subject(a.namespace, "admin"),
    "operator micro discovery": lambda hub, a: "$SRV.PING",
    "operator micro agents": lambda hub, a: protocol.micro_subject(hub.hub_id, "agents"),
    # An agent sees these in the reply subjects of the tasks and asks it is sent, and may
    # publish on its own namespace's in every hub's inbox (it answers there).
    "agent replies": lambda hub, a: hub._replies.of(a.namespace).prefix + "junk",
}


@pytest.mark.parametrize("target", list(TARGETS))
async def test_a_flood_on_a_subject_others_may_publish_leaves_the_hubs_main_connection(
    tmp_path: Path, target: str
) -> None:
    """80 messages of 512 KiB (40 MiB, ten times what the server holds for a connection here)
    while the hub's loop is stalled, as a flood it cannot keep up with stalls it: with the
    subject read on the main connection nats-server cut that one (a slow consumer), and
    with it the KV watches and pulls of every tenant; now another is cut, and the agent
    stays ONLINE."""
    async with _tight_mesh(tmp_path, "vflood") as (server, hub, agent, mesh):
        main = reconnects_of(hub.nc)
        assert main is not None
        subject = TARGETS[target](hub, agent)
        body = b"x" * (512 << 10)
        flooding = _flood_from_a_thread(server.url, subject, body, 80)
        time.sleep(3.0)  # noqa: ASYNC251 - the hub's loop stalled on purpose: it reads nothing
        await asyncio.to_thread(flooding.join, 60)
        others = [nc for name, nc in hub._connections.items() if name != "main" and nc]
        cuts = [r for r in map(reconnects_of, others) if r is not None]
        await eventually(lambda: main.count + sum(r.count for r in cuts) >= 1, timeout=30)
        assert main.count == 0, f"a flood on {subject} cut the hub's main connection"
        await eventually(lambda: hub.nats_connected, timeout=30)
        view = hub.registry.agents[agent.agent_id]
        await eventually(lambda: view.state is AgentState.ONLINE, timeout=10)
        assert (await mesh.request(capability="work:echo:v1", payload=2, timeout=10)).result == 2
