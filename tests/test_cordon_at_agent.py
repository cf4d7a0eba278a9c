"""An operator's cordon is kept by the agent itself (docs/security.md): a caller of its
namespace may send it a task past the hubs' routing — straight to its task subject (direct
mode), or as a route naming it with ``after_attempt`` (admitted whatever its cordon says: it
may hold that task). The hubs' heartbeat replies tell the agent it is cordoned; it refuses a
new task id then (``REACH_AGENT_BUSY``, ``details.cordoned``), and answers one it ran from its
idempotency table as before. Against a real nats-server."""

from __future__ import annotations

import json
import time
from typing import Any

import nats
import pytest

from reach_mesh import Client, MeshSettings, protocol
from reach_mesh.agent import Agent
from reach_mesh.errors import MeshTimeoutError
from reach_mesh.hub import Hub
from reach_mesh.models import Mode, TaskEnvelope

from .helpers import eventually, recording_agent

CAP = "held:echo:v1"


async def _send(nc: Any, agent_id: str, task_id: str, payload: Any) -> dict[str, Any]:
    """A task published straight to the agent's task subject, as any caller of its namespace
    may (no hub asked): the agent's answer."""
    env = TaskEnvelope(task_id=task_id, capability=CAP, payload=payload)
    msg = await nc.request(protocol.agent_task(agent_id), protocol.encode(env), timeout=5)
    out: dict[str, Any] = json.loads(msg.data)
    return out


async def _route(nc: Any, ns: str, body: dict[str, Any]) -> dict[str, Any]:
    """A proxied route as a caller of ``ns`` may send it to the hubs itself."""
    subject = protocol.hub_subject(ns, "route")
    msg = await nc.request(subject, json.dumps(body).encode(), timeout=5)
    out: dict[str, Any] = json.loads(msg.data)
    return out


def _refused_for_cordon(out: dict[str, Any]) -> bool:
    error = out.get("error") or {}
    return error.get("code") == "REACH_AGENT_BUSY" and error.get("details", {}).get("cordoned")


async def _cordoned(c: Client, agent: Agent) -> None:
    assert (await c.admin("cordon", agent.agent_id))["state"] == "CORDONED"
    # Within one heartbeat_interval (0.2 s here), give or take a beat's round trip.
    await eventually(lambda: agent.cordoned, timeout=5)


async def test_a_cordoned_agent_refuses_a_new_task_sent_straight_to_it(
    hub: Hub, settings: MeshSettings, nats_url: str, namespace: str
) -> None:
    """Cordoned: a new task id published straight to the agent's task subject (direct mode,
    in every caller of its namespace's permissions) is refused before anything runs; a task id
    it ran before the cordon gets its stored result (no second run). Uncordoned: the next
    heartbeat lifts it, and a new task id runs again. Before, the agent did not know of its
    cordon and ran the new task (measured on 2e1642b)."""
    agent, ran = recording_agent(f"{namespace}.held.a1", settings, CAP)
    nc = await nats.connect(nats_url)
    try:
        async with agent, Client(settings=settings) as c:
            await eventually(lambda: agent.agent_id in hub.registry.agents)
            before = await _send(nc, agent.agent_id, "before-1", "kept")
            assert before["state"] == "SUCCEEDED" and ran == ["kept"], before
            await _cordoned(c, agent)

            direct = await _send(nc, agent.agent_id, "new-direct", "direct")
            assert _refused_for_cordon(direct), direct
            again = await _send(nc, agent.agent_id, "before-1", "kept")
            assert again["state"] == "SUCCEEDED" and again["cached"] is True, again
            assert again["result"] == "kept"
            assert ran == ["kept"]

            await c.admin("uncordon", agent.agent_id)
            await eventually(lambda: not agent.cordoned, timeout=5)
            after = await _send(nc, agent.agent_id, "new-after", "after")
            assert after["state"] == "SUCCEEDED", after
            assert ran == ["kept", "after"]
    finally:
        await nc.close()


async def test_a_route_naming_a_cordoned_agent_after_an_attempt_runs_no_new_task_there(
    hub: Hub, settings: MeshSettings, nats_url: str, namespace: str
) -> None:
    """A proxied route naming the cordoned agent with ``after_attempt: 1`` is admitted by the
    hub (it may hold the task): with a task id it never had, the agent refuses it and nothing
    runs — the caller gets ``REACH_AGENT_BUSY`` (``details.cordoned``); with one it ran before
    the cordon, its stored result. Before, the new task id ran on the cordoned agent
    (measured on 2e1642b)."""
    agent, ran = recording_agent(f"{namespace}.held.a1", settings, CAP)
    nc = await nats.connect(nats_url)

    def retry(task_id: str, payload: str) -> dict[str, Any]:
        return {
            "agent_id": agent.agent_id,
            "task_id": task_id,
            "after_attempt": 1,
            "payload": payload,
            "timeout": 2,
        }

    try:
        async with agent, Client(settings=settings) as c:
            await eventually(lambda: agent.agent_id in hub.registry.agents)
            first = await _route(nc, namespace, {**retry("before-1", "kept"), "after_attempt": 0})
            assert first["task"]["state"] == "SUCCEEDED", first
            await _cordoned(c, agent)

            for n in range(4):
                routed = await _route(nc, namespace, retry(f"new-routed-{n}", "routed"))
                assert _refused_for_cordon(routed), routed
            # A cordon's refusal is no overload: the agent stays healthy on the hub, and is
            # routed to as before once uncordoned (each refusal cost 20 of its 100 points, a
            # heartbeat gives one back).
            assert hub.registry.agents[agent.agent_id].health.healthy
            held = await _route(nc, namespace, retry("before-1", "kept"))
            task = held["task"]
            assert task["state"] == "SUCCEEDED" and task["result"] == "kept", held
            assert task["cached"] is True
            assert ran == ["kept"]
    finally:
        await nc.close()


@pytest.mark.parametrize("mode", ["direct", "proxy"])
async def test_a_clients_retry_pinned_to_a_cordoned_agent_that_lost_its_task_goes_elsewhere(
    hub: Hub, settings: MeshSettings, namespace: str, mode: Mode
) -> None:
    """A task timed out on an agent (the ``Client`` pins its retry there, ``after_attempt``);
    the operator cordons the agent and restarts it, so the new process has no record of the
    task and refuses it as new. The retry goes to another agent at once — not refused
    ``REACH_AGENT_BUSY`` over and over until its timeout (and every retry after it, the pin
    kept) for as long as the cordon holds."""
    a1, ran1 = recording_agent(f"{namespace}.w.a1", settings, CAP, delay=0.4)
    a2, ran2 = recording_agent(f"{namespace}.w.a2", settings, CAP)
    async with a2, Client(settings=settings) as c:
        async with a1:
            await eventually(lambda: len(hub.registry.agents) >= 2)
            with pytest.raises(MeshTimeoutError):
                await c.request(agent_id=a1.agent_id, payload=1, task_id="slow-c", timeout=0.2)
            await c.admin("cordon", a1.agent_id)
        again, ran_again = recording_agent(a1.agent_id, settings, CAP)
        async with again:
            await eventually(lambda: again.cordoned, timeout=5)
            t0 = time.monotonic()
            res = await c.request(capability=CAP, payload=1, task_id="slow-c", timeout=5, mode=mode)
            assert res.agent_id == a2.agent_id and res.state == "SUCCEEDED", res
            assert time.monotonic() - t0 < 2.5
            assert ran1 == [1] and ran_again == [] and ran2 == [1]
