"""A caller, or a hub, whose connection to NATS drops while its requests are out (its host's
network, a NATS server restarted or failed over) gets their answers once it is back: the
answers sent while it was away are lost, so its requests are asked again, with the same task
ids, and each task runs once (the hubs' pins and the agent's idempotency table join the run in
hand)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from typing import Literal

import nats
import pytest
from nats.aio.msg import Msg

from reach_mesh import Client, MeshSettings, Step, TaskState
from reach_mesh.hub import Hub

from .helpers import away_for_a_second, eventually, recording_agent, relayed

CAP = "cr:slow:v1"


@pytest.mark.parametrize(
    ("mode", "hubs"), [("proxy", 1), ("direct", 1), ("proxy", 2)], ids=["proxy", "direct", "2hubs"]
)
async def test_answers_lost_while_the_caller_was_away_are_asked_again(
    nats_url: str, namespace: str, mode: Literal["proxy", "direct"], hubs: int
) -> None:
    """With two hubs a request asked again may reach the other one: the first hub told it the
    task's agent (``reach.hubs.<ns>.pins``), so the task still runs once."""
    s = MeshSettings(nats_url=nats_url, namespace=namespace, audit_enabled=False)
    relay, through = await relayed(nats_url, s)
    agent, runs = recording_agent(f"{namespace}.slow.a1", s, CAP, delay=0.5)
    async with contextlib.AsyncExitStack() as stack:
        for _ in range(hubs):
            await stack.enter_async_context(Hub(settings=s))
        await stack.enter_async_context(agent)
        c = await stack.enter_async_context(Client(settings=through))
        assert (await c.request(capability=CAP, payload=0, mode=mode)).result == 0
        calls = [
            asyncio.create_task(c.request(capability=CAP, payload=i, timeout=10, mode=mode))
            for i in range(1, 6)
        ]
        await eventually(lambda: len(runs) == 6, timeout=5)
        # The answers come while the caller is away.
        t0 = await away_for_a_second(relay, lambda: c.nc.is_connected)
        results = await asyncio.gather(*calls)
        assert [r.state for r in results] == [TaskState.SUCCEEDED] * 5
        assert sorted(r.result for r in results) == [1, 2, 3, 4, 5]
        assert time.monotonic() - t0 < 3  # not the requests' 10 s
        assert sorted(runs) == [0, 1, 2, 3, 4, 5]  # each ran once


async def test_answers_lost_while_the_hub_was_away_are_asked_again(
    nats_url: str, namespace: str
) -> None:
    """The agents answer while the hub that sent their tasks is cut off: once back, it sends
    each attempt still waiting again, and the agent answers from the run in hand. It tells the
    other hubs those tasks' agents again first (a pins message sent just before the cut may
    have been lost with it)."""
    s = MeshSettings(nats_url=nats_url, namespace=namespace, audit_enabled=False)
    relay, through = await relayed(nats_url, s)
    agent, runs = recording_agent(f"{namespace}.slow.a1", s, CAP, delay=0.5)
    pins: list[bytes] = []
    peer = await nats.connect(nats_url)  # where the other hubs hear pins

    async def heard(msg: Msg) -> None:
        pins.append(msg.data)

    await peer.subscribe(f"reach.hubs.{namespace}.pins", cb=heard)
    async with Hub(settings=through) as hub, agent, Client(settings=s) as c:
        await eventually(lambda: agent.agent_id in hub.registry.agents)
        calls = [
            asyncio.create_task(c.request(capability=CAP, payload=i, timeout=10)) for i in range(5)
        ]
        await eventually(lambda: len(runs) == 5, timeout=5)
        await eventually(lambda: len(_pinned(pins)) == 5)
        before = len(pins)
        # The agent answers while the hub is away.
        t0 = await away_for_a_second(relay, lambda: hub.nc.is_connected)
        results = await asyncio.gather(*calls)
        assert sorted(r.result for r in results) == [0, 1, 2, 3, 4]
        assert time.monotonic() - t0 < 3  # not the requests' 10 s
        assert sorted(runs) == [0, 1, 2, 3, 4]  # each ran once
        assert all(r.cached for r in results)  # answered from the agent's idempotency table
        again = _pinned(pins[before:])
        assert again == {r.task_id: agent.agent_id for r in results}, again
    await peer.close()


def _pinned(messages: list[bytes]) -> dict[str, str]:
    return {task_id: agent_id for m in messages for task_id, agent_id in json.loads(m)}


async def test_a_workflow_result_stored_while_the_caller_was_away_is_read(
    nats_url: str, namespace: str
) -> None:
    """A caller waiting for workflows whose results are stored while it is cut off: the
    announcements it missed are lost, so once back it reads the records of the workflows it
    waits for, and each wait ends within moments of the reconnection, not at its timeout."""
    s = MeshSettings(nats_url=nats_url, namespace=namespace, audit_enabled=False)
    relay, through = await relayed(nats_url, s)
    agent, runs = recording_agent(f"{namespace}.slow.a1", s, CAP, delay=0.5)
    async with Hub(settings=s), agent, Client(settings=through) as c:
        ids = [await c.submit_fanout([Step(capability=CAP, payload=i)]) for i in range(3)]
        waits = [asyncio.create_task(c.workflow(wf_id, timeout=15)) for wf_id in ids]
        await eventually(lambda: len(runs) == 3, timeout=5)
        # The results are stored while the caller is away.
        t0 = await away_for_a_second(relay, lambda: c.nc.is_connected)
        results = await asyncio.gather(*waits)
        assert [r.state for r in results] == [TaskState.SUCCEEDED] * 3
        assert [r.result for r in results] == [[0], [1], [2]]  # a fanout: its steps' results
        assert time.monotonic() - t0 < 3  # not the waits' 15 s
        assert sorted(runs) == [0, 1, 2]
