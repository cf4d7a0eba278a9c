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
from collections.abc import Awaitable, Callable
from typing import Any, Literal

import nats
import pytest
from nats.aio.msg import Msg

from reach_mesh import Client, MeshSettings, Step, TaskState
from reach_mesh._nats import connect
from reach_mesh.agent import Agent, Task, TaskFailed
from reach_mesh.errors import MeshTimeoutError
from reach_mesh.hub import Hub
from reach_mesh.hub._wf_view import VIEW_DEADLINE

from .helpers import (
    away_for_a_second,
    eventually,
    held_handler,
    partition,
    recording_agent,
    relayed,
)

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


@pytest.mark.parametrize("made_by", ["reach_mesh", "nats_py"])
async def test_a_client_on_a_connection_of_its_callers_asks_again(
    nats_url: str, namespace: str, made_by: str
) -> None:
    """A ``Client`` given a connection of the caller's own (``nc=``) sees it reconnect too,
    and asks its routes and its queries again once it is back, not at their timeouts: one
    made by ``reach_mesh``'s ``connect`` tells it, one made by nats-py's own ``connect``
    (whose one reconnect callback is the caller's) is watched."""
    s = MeshSettings(nats_url=nats_url, namespace=namespace, audit_enabled=False)
    relay, through = await relayed(nats_url, s)
    agent, runs = recording_agent(f"{namespace}.slow.a1", s, CAP, delay=0.5)
    url = str(through.nats_url)
    if made_by == "reach_mesh":
        nc = await connect(url, name="caller", settings=through)
    else:
        nc = await nats.connect(url, reconnect_time_wait=0.1, max_reconnect_attempts=-1)
    try:
        async with Hub(settings=s), agent, Client(settings=through, nc=nc) as c:
            calls = [
                asyncio.create_task(c.request(capability=CAP, payload=i, timeout=10))
                for i in range(3)
            ]
            await eventually(lambda: len(runs) == 3, timeout=5)
            t0 = await away_for_a_second(relay, lambda: nc.is_connected)
            results = await asyncio.gather(*calls)
            assert sorted(r.result for r in results) == [0, 1, 2]
            assert time.monotonic() - t0 < 3  # not the requests' 10 s
            assert sorted(runs) == [0, 1, 2]
            # A query whose answer is lost with the connection.
            relay.hold()
            query = asyncio.ensure_future(c.agents())
            await asyncio.sleep(0.3)
            t0 = await away_for_a_second(relay, lambda: nc.is_connected)
            assert [a.agent_id for a in await query] == [agent.agent_id]
            assert time.monotonic() - t0 < 2.0  # not its 5 s timeout
    finally:
        await nc.close()


async def test_a_hub_asks_the_owner_again_when_its_answer_was_lost(
    nats_url: str, namespace: str
) -> None:
    """A hub asked about a workflow another hub runs asks that owner (a view, a cancel); when
    the owner's answer is lost with the asking hub's connection, it asks again once it is
    back, within the question's time (else a view comes from the records alone)."""
    s = MeshSettings(nats_url=nats_url, namespace=namespace, audit_enabled=False)
    relay, through = await relayed(nats_url, s)
    agent = Agent(f"{namespace}.slow.a1", settings=s)
    held = held_handler(agent, CAP)  # the workflow runs until the test ends
    async with Hub(settings=s) as owner, agent, Client(settings=s) as c:
        wf_id = await c.submit_fanout([Step(capability=CAP, payload=0)])
        await asyncio.wait_for(held.started.wait(), timeout=5)
        try:
            async with Hub(settings=through) as other:  # after the owner took the workflow
                # As long as a view's question may wait for an owner (2.5 s).
                end = asyncio.get_running_loop().time() + VIEW_DEADLINE
                relay.hold()  # the owner's answer is held back, then lost with the connection
                asked = asyncio.ensure_future(other._ask_owner(namespace, wf_id, owner.hub_id, end))
                await asyncio.sleep(0.1)
                await relay.cut()  # for a moment: the question has 2.5 s in all
                await eventually(lambda: not other.nc.is_connected, timeout=1)
                await asyncio.sleep(0.3)
                await relay.start()
                view = await asked  # None: not answered in time (from the records then)
                assert view is not None and view.live and view.owner == owner.hub_id
        finally:
            held.release.set()


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


@pytest.mark.parametrize("mode", ["direct", "proxy"])
async def test_a_failure_whose_answer_was_lost_is_not_run_again(
    nats_url: str, namespace: str, mode: Literal["direct", "proxy"]
) -> None:
    """A handler fails for good (``TaskFailed(retryable=False)``) and its answer never reaches
    the one waiting for it, which stays connected (a partition between NATS servers, not a cut
    it would notice): in direct mode the caller, in proxy mode the hub. That wait times out
    naming the agent and the attempt, so the caller's retry of the task id goes to that agent
    as its next attempt (a handler that ran out of time runs again) — and the agent ran the
    failed task again: twice under the chaos ``partition`` fault (seed 144), a non-retryable
    failure run a second time. The failure is the task's outcome: the retry gets it."""
    s = MeshSettings(nats_url=nats_url, namespace=namespace, audit_enabled=False)
    # No PINGs while the answer is held: the party behind the relay notices nothing.
    relay, through = await relayed(nats_url, s, nats_ping_interval=60.0)
    agent = Agent(f"{namespace}.fails.a1", settings=s)
    runs: list[int] = []
    go = asyncio.Event()

    @agent.handler(CAP)
    async def fails(task: Task[Any]) -> Any:
        runs.append(task.attempt)
        await go.wait()
        raise TaskFailed("no such thing", retryable=False)

    caller, hub_s = (through, s) if mode == "direct" else (s, through)
    async with Hub(settings=hub_s) as hub, agent, Client(settings=caller) as c:
        await eventually(lambda: agent.agent_id in hub.registry.agents)
        first = asyncio.ensure_future(
            c.request(capability=CAP, payload=0, task_id="t-lost", timeout=2, mode=mode)
        )
        await eventually(lambda: len(runs) == 1, timeout=5)
        relay.hold()  # the failure's answer is held back
        go.set()
        with pytest.raises(MeshTimeoutError) as timed_out:
            await first
        assert timed_out.value.details.get("agent_id") == agent.agent_id
        relay.release()  # (late: nobody waits for it any more)
        again = await c.request(capability=CAP, payload=0, task_id="t-lost", timeout=5, mode=mode)
        assert again.state is TaskState.FAILED, again
        assert again.error is not None and "no such thing" in again.error.message
        assert runs == [1]  # once
        await relay.cut()


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


_QUERIES = ["agents", "workflow", "workflows", "cordon", "cancel"]


@pytest.mark.parametrize("ask", _QUERIES)
async def test_a_query_whose_answer_was_lost_is_asked_again(
    nats_url: str, namespace: str, ask: str
) -> None:
    """Fleet and workflow queries, an operator's cordon and a cancel whose answer is lost with
    the caller's connection are asked again once it is back (each is safe to repeat), and
    answered within moments, not at their 5 s timeout (a cancel: its 4 s ask)."""
    s = MeshSettings(nats_url=nats_url, namespace=namespace, audit_enabled=False)
    relay, through = await relayed(nats_url, s)
    agent = Agent(f"{namespace}.slow.a1", settings=s)
    held = held_handler(agent, CAP)  # the workflow runs until the test ends
    async with Hub(settings=s), agent, Client(settings=through) as c:
        wf_id = await c.submit_fanout([Step(capability=CAP, payload=0)])
        await asyncio.wait_for(held.started.wait(), timeout=5)
        asked: Callable[[], Awaitable[Any]] = {
            "agents": lambda: c.agents(),
            "workflow": lambda: c.inspect_workflow(wf_id),
            "workflows": lambda: c.list_workflows(),
            "cordon": lambda: c.admin("cordon", agent.agent_id),
            "cancel": lambda: c.cancel_workflow(wf_id, timeout=10),
        }[ask]
        relay.hold()  # the answer is held back, then lost with the connection
        call = asyncio.ensure_future(asked())
        await asyncio.sleep(0.3)
        t0 = await away_for_a_second(relay, lambda: c.nc.is_connected)
        try:
            got: Any = await call
        finally:
            held.release.set()
        assert time.monotonic() - t0 < 2.0
        if ask == "agents":
            assert [a.agent_id for a in got] == [agent.agent_id]
        elif ask == "workflow":
            assert got.workflow_id == wf_id and got.state is TaskState.RUNNING
        elif ask == "workflows":
            assert [w.workflow_id for w in got.workflows] == [wf_id]
        elif ask == "cordon":
            assert got["op"] == "cordon" and got["agent_id"] == agent.agent_id
        else:
            assert got.final and got.cancelled


async def test_a_remove_whose_answer_was_lost_is_not_asked_again(
    nats_url: str, namespace: str
) -> None:
    """An operator's ``remove`` is not repeated (asked twice, it would answer "unknown agent"
    for the agent it removed): its timeout says that NATS reconnected meanwhile, so it may
    have been done."""
    s = MeshSettings(nats_url=nats_url, namespace=namespace, audit_enabled=False)
    relay, through = await relayed(nats_url, s)
    agent, _ = recording_agent(f"{namespace}.slow.a1", s, CAP)
    async with Hub(settings=s) as hub, agent, Client(settings=through) as c:
        await eventually(lambda: agent.agent_id in hub.registry.agents)
        await partition(agent)  # (else it registers again once removed)
        relay.hold()
        call = asyncio.create_task(c.admin("remove", agent.agent_id))
        await asyncio.sleep(0.3)
        await away_for_a_second(relay, lambda: c.nc.is_connected)
        with pytest.raises(MeshTimeoutError, match="NATS reconnected meanwhile"):
            await call
        assert agent.agent_id not in hub.registry.agents  # it was done


async def test_a_submission_whose_ack_was_lost_is_sent_again_at_once(
    nats_url: str, namespace: str
) -> None:
    """JetStream's ack of a workflow submission is lost with the caller's connection: once
    back, the submission is sent again at once (not after its 3 s ack timeout), the server
    drops the repeat as a duplicate (``Nats-Msg-Id``), and the workflow runs once."""
    s = MeshSettings(nats_url=nats_url, namespace=namespace, audit_enabled=False)
    relay, through = await relayed(nats_url, s)
    agent, runs = recording_agent(f"{namespace}.slow.a1", s, CAP)
    async with Hub(settings=s), agent, Client(settings=through) as c:
        await c.fanout([Step(capability=CAP, payload=0)], timeout=10)  # the client is warm
        relay.hold()  # the ack is held back, then lost with the connection
        call = asyncio.ensure_future(c.submit_fanout([Step(capability=CAP, payload=1)]))
        await asyncio.sleep(0.3)
        t0 = await away_for_a_second(relay, lambda: c.nc.is_connected)
        wf_id = await call
        # Not at the ack's 3 s timeout: a second to spare either way (the reconnection itself,
        # up to nats-py's 0.25 s wait and a handshake, takes longer on a loaded box).
        assert time.monotonic() - t0 < 2.0
        result = await c.workflow(wf_id, timeout=10)
        assert result.state is TaskState.SUCCEEDED and result.result == [1]
        assert runs == [0, 1]  # each ran once


async def test_workflow_events_followed_across_a_cut_miss_none(
    nats_url: str, namespace: str
) -> None:
    """A caller follows a chain's events (``workflow_events``) and is cut off while its second
    step ends: the events it yields are every event the stream holds, in order, as a reader
    that was never cut reads them afterwards."""
    s = MeshSettings(
        nats_url=nats_url, namespace=namespace, audit_enabled=False, workflow_event_hold=0.0
    )
    relay, through = await relayed(nats_url, s)
    agent, runs = recording_agent(f"{namespace}.slow.a1", s, CAP, delay=0.6)
    async with Hub(settings=s), agent, Client(settings=through) as c, Client(settings=s) as d:
        wf_id = await c.submit_chain([Step(capability=CAP, payload=i) for i in range(3)])
        seen: list[Any] = []

        async def follow() -> None:
            async for ev in c.workflow_events(wf_id, timeout=20):
                seen.append(ev)

        following = asyncio.create_task(follow())
        await eventually(lambda: len(runs) == 2, timeout=5)  # the second step runs
        await away_for_a_second(relay, lambda: c.nc.is_connected)
        await asyncio.wait_for(following, 15)
        replayed = [ev async for ev in d.workflow_events(wf_id, timeout=5)]

        def shown(events: list[Any]) -> list[tuple[Any, ...]]:
            return [(e.kind, e.step, e.state, e.attempt) for e in events]

        assert shown(seen) == shown(replayed)
        assert [e.kind for e in seen].count("step") >= 3
        assert seen[-1].kind == "done" and seen[-1].state is TaskState.SUCCEEDED
