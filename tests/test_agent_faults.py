"""An agent keeps its promises when its handlers, their models or its callers misbehave: every
attempt ends with an answer, a running attempt is never forgotten, a retry runs once, a slot
is never lost, and steps keep their ack deadline through a drain — on a real mesh."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import nats
import pytest
from nats.aio.client import Client as NATS
from pydantic import BaseModel, field_validator

from reach_mesh import (
    Client,
    MeshSettings,
    Step,
    TaskState,
    protocol,
)
from reach_mesh.agent import Agent, Task
from reach_mesh.agent._serving import AgentStatus
from reach_mesh.agent._table import RESULT_CACHE, _Entry
from reach_mesh.hub import Hub
from reach_mesh.models import TaskReply

from .helpers import eventually

pytestmark = pytest.mark.timeout(60)


class Picky(BaseModel):
    n: int

    @field_validator("n", mode="before")
    @classmethod
    def _n(cls, v: Any) -> Any:
        if v == "explode":
            raise TypeError("cannot take that")  # pydantic lets a TypeError through
        return v


class Unprintable(Exception):
    def __str__(self) -> str:
        raise RuntimeError("no words")


async def send(nc: NATS, agent: Agent, task_id: str, payload: Any, **kw: Any) -> dict[str, Any]:
    env = {"task_id": task_id, "payload": payload, "namespace": agent.namespace, **kw}
    msg = await nc.request(protocol.agent_task(agent.agent_id), json.dumps(env).encode(), 5)
    out: dict[str, Any] = json.loads(msg.data)
    return out


async def test_a_payload_validator_that_raises_fails_the_task_and_its_id_stays_usable(
    hub: Hub, settings: MeshSettings, namespace: str, nc: NATS
) -> None:
    """A validator raising anything but ``ValidationError`` left the attempt without an answer
    and its task id DELIVERED for good: every copy of it waited forever."""
    agent = Agent(f"{namespace}.picky.a1", settings=settings)
    ran: list[int] = []

    @agent.handler("calc:picky:v1")
    async def picky(task: Task[Picky]) -> int:
        ran.append(task.payload.n)
        return task.payload.n

    async with agent:
        out = await send(nc, agent, "t-bad", {"n": "explode"})
        assert out["state"] == TaskState.FAILED.value, out
        assert out["error"]["code"] == "REACH_BAD_REQUEST"
        assert "TypeError: cannot take that" in out["error"]["message"]
        # The same id again: its stored outcome at once, not a wait on a run that never ends.
        again = await send(nc, agent, "t-bad", {"n": "explode"})
        assert again["state"] == TaskState.FAILED.value and again["cached"] is True
        assert (await send(nc, agent, "t-good", {"n": 3}))["result"] == 3
        assert ran == [3]


async def test_a_handlers_own_timeout_error_is_a_failure_and_the_deadline_a_timeout(
    hub: Hub, settings: MeshSettings, namespace: str, nc: NATS
) -> None:
    """A dependency's ``TimeoutError`` inside the handler is the handler failing, not the
    attempt's deadline (``TIMEOUT`` says the handler overran ``timeout``)."""
    agent = Agent(f"{namespace}.slow.a1", settings=settings)

    @agent.handler("calc:slow:v1")
    async def slow(task: Task[dict[str, Any]]) -> str:
        if task.payload["how"] == "own":
            raise TimeoutError("the database did not answer")
        if task.payload["how"] == "unprintable":
            raise Unprintable()
        await asyncio.sleep(5)
        return "late"

    async with agent:
        own = await send(nc, agent, "t-own", {"how": "own"}, timeout=5)
        assert own["state"] == TaskState.FAILED.value, own
        assert own["error"]["code"] == "REACH_HANDLER_FAILED"
        assert "the database did not answer" in own["error"]["message"]
        overran = await send(nc, agent, "t-overran", {"how": "sleep"}, timeout=0.2)
        assert overran["state"] == TaskState.TIMEOUT.value, overran
        assert overran["error"]["code"] == "REACH_TIMEOUT"
        odd = await send(nc, agent, "t-odd", {"how": "unprintable"})
        assert odd["state"] == TaskState.FAILED.value, odd
        assert odd["error"]["message"] == "Unprintable: <unprintable exception>"


async def test_a_running_attempt_is_never_pushed_out_of_the_idempotency_cache(
    hub: Hub, settings: MeshSettings, namespace: str, nc: NATS
) -> None:
    """10,000 newer tasks pushed a running one out of the cache: a copy of it then ran again,
    and a hub's probe heard PENDING and gave it up while it ran."""
    agent = Agent(f"{namespace}.long.a1", settings=settings)
    release = asyncio.Event()
    runs = 0

    @agent.handler("calc:long:v1")
    async def long(task: Task[Any]) -> str:
        nonlocal runs
        runs += 1
        await release.wait()
        return "done"

    async with agent:
        first = asyncio.ensure_future(send(nc, agent, "t-long", 1))
        await eventually(lambda: "t-long" in agent._results)
        for i in range(RESULT_CACHE + 10):  # finished tasks, newer than the running one
            reply = TaskReply(
                task_id=f"x{i}", attempt=1, agent_id=agent.agent_id, state=TaskState.SUCCEEDED
            )
            agent._remember(f"x{i}", _Entry(1, TaskState.SUCCEEDED, reply=reply))
        assert len(agent._results) == RESULT_CACHE
        assert "t-long" in agent._results
        state = json.loads(
            (
                await nc.request(
                    protocol.agent_ctl(agent.agent_id),
                    json.dumps({"op": "task_state", "task_id": "t-long"}).encode(),
                    5,
                )
            ).data
        )
        assert state["state"] == TaskState.DELIVERED.value, state
        copy = asyncio.ensure_future(send(nc, agent, "t-long", 1))
        await asyncio.sleep(0.2)
        release.set()
        assert (await first)["result"] == "done"
        assert (await copy)["result"] == "done"
        assert runs == 1


async def test_two_copies_of_a_retry_run_it_once(
    hub: Hub, settings: MeshSettings, namespace: str, nc: NATS
) -> None:
    """A later attempt of a failed task runs again — once, however many copies of it arrive
    together (the decision was made in a task of its own per copy: both ran)."""
    agent = Agent(f"{namespace}.flaky.a1", settings=settings)
    runs = 0

    @agent.handler("calc:flaky:v1")
    async def flaky(task: Task[Any]) -> int:
        nonlocal runs
        runs += 1
        if task.attempt == 1:
            raise RuntimeError("first time unlucky")
        await asyncio.sleep(0.1)
        return task.attempt

    async with agent:
        failed = await send(nc, agent, "t-retry", None)
        assert failed["state"] == TaskState.FAILED.value
        a, b = await asyncio.gather(
            send(nc, agent, "t-retry", None, attempt=2),
            send(nc, agent, "t-retry", None, attempt=2),
        )
        assert a["result"] == 2 and b["result"] == 2, (a, b)
        assert sorted([a.get("cached", False), b.get("cached", False)]) == [False, True]
        assert runs == 2


async def test_a_step_cancelled_while_its_fence_is_read_again_gives_its_slot_back(
    wf_hub: Hub, wf_settings: MeshSettings, namespace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A step that waited for a slot reads its fence again before it runs; cancelled during
    that read (a hub's cancel, a workflow cancel, the agent declared LOST), it kept its slot
    for good and the agent, healthy to its hubs, started nothing more."""
    agent = Agent(f"{namespace}.one.a1", settings=wf_settings, max_concurrency=1)
    reading = asyncio.Event()

    @agent.handler("wf:one:v1")
    async def one(task: Task[Any]) -> Any:
        return task.payload

    async with agent, Client(settings=wf_settings) as client:
        assert agent.work is not None
        work = agent.work

        async def stuck(held: Any) -> bool:
            reading.set()
            await asyncio.sleep(30)  # a JetStream read that does not come back in time
            return False

        monkeypatch.setattr(work, "_fenced_since", stuck)
        run = asyncio.ensure_future(client.fanout([Step(capability="wf:one:v1", payload=1)]))
        await asyncio.wait_for(reading.wait(), 10)
        assert agent._running == 1
        (held,) = work._held.values()
        assert held.task is not None
        held.task.cancel()
        await eventually(lambda: agent._running == 0)
        monkeypatch.undo()
        # The step comes back (its message was not acked) and runs in the slot given back.
        result = await asyncio.wait_for(run, 30)
        assert result.ok, result


async def test_a_step_running_through_the_drain_keeps_its_ack_deadline(
    wf_hub: Hub, wf_settings: MeshSettings, namespace: str
) -> None:
    """``close()`` stopped the ``+WPI`` keep-alives with the pulls, before waiting for the
    steps in flight: one running past ``work_ack_wait`` during the drain was redelivered."""
    settings = wf_settings.model_copy(update={"drain_timeout": 10.0})
    agent = Agent(f"{namespace}.drain.a1", settings=settings)
    started = asyncio.Event()
    runs = 0

    @agent.handler("wf:drain:v1")
    async def drain(task: Task[Any]) -> Any:
        nonlocal runs
        runs += 1
        started.set()
        await asyncio.sleep(3 * settings.work_ack_wait)
        return task.payload

    await agent.start()
    async with Client(settings=wf_settings) as client:
        run = asyncio.ensure_future(
            client.fanout([Step(capability="wf:drain:v1", payload="x")], timeout=30)
        )
        await asyncio.wait_for(started.wait(), 10)
        closing = asyncio.ensure_future(agent.close())
        await eventually(lambda: agent.status is AgentStatus.DRAINING)
        assert agent.work is not None
        await asyncio.sleep(settings.work_ack_wait)
        ticker = agent.work._ticker
        assert ticker is not None and not ticker.done(), "keep-alives stopped during the drain"
        await asyncio.wait_for(closing, 20)
        assert agent.work._ticker is None
        result = await asyncio.wait_for(run, 30)
        assert result.ok, result
        assert runs == 1
    assert wf_settings.nats_url is not None
    nc = await nats.connect(wf_settings.nats_url)
    try:
        info = await nc.jetstream().consumer_info(
            protocol.STREAM_WORK, protocol.work_consumer(agent.agent_id)
        )
    finally:
        await nc.close()
    assert info.num_redelivered == 0, info


async def test_a_restart_warms_the_table_with_the_newest_outcomes_only(
    wf_hub: Hub, wf_settings: MeshSettings, namespace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """At start an agent reads back the last status of every task it ran within
    ``workflow_retention``: all of them were held in memory (results included) inside the
    consumer setup's 5 s budget — past some volume the setup timed out on every try and the
    agent never took a step. The newest the table keeps are kept, the rest only read."""
    import reach_mesh.agent._work as work_module

    monkeypatch.setattr(work_module, "RESULT_CACHE", 5)
    agent_id = f"{namespace}.warm.a1"
    assert wf_settings.nats_url is not None
    nc = await nats.connect(wf_settings.nats_url)
    try:
        js = nc.jetstream()
        for i in range(12):
            event = {
                "task_id": f"w{i}",
                "attempt": 1,
                "agent_id": agent_id,
                "state": "SUCCEEDED",
                "result": i,
            }
            await js.publish(
                protocol.task_status(agent_id, f"w{i}"),
                json.dumps(event).encode(),
                stream=protocol.STREAM_STATUS,
            )
    finally:
        await nc.close()
    agent = Agent(agent_id, settings=wf_settings)

    @agent.handler("wf:warm:v1")
    async def warm(task: Task[Any]) -> Any:
        return task.payload

    async with agent:
        assert agent.work is not None and agent.work._pull is not None
        kept = [tid for tid in agent._results if tid.startswith("w")]
        assert kept == [f"w{i}" for i in range(7, 12)], kept
        reply = agent._results["w11"].reply
        assert reply is not None and reply.result == 11


async def test_the_table_holds_results_to_a_byte_budget(
    hub: Hub, settings: MeshSettings, namespace: str, nc: NATS
) -> None:
    """10,000 results of up to ``max_payload`` each could hold gigabytes: past the byte budget
    the oldest finished results go (a running attempt stays, whatever its size)."""
    agent = Agent(f"{namespace}.big.a1", settings=settings)
    release = asyncio.Event()

    @agent.handler("calc:big:v1")
    async def big(task: Task[dict[str, Any]]) -> str:
        if task.payload.get("hold"):
            await release.wait()
        return "x" * int(task.payload["size"])

    async with agent:
        table = agent._results
        table.max_bytes = 350_000  # three results of 100 KB and their replies
        held = asyncio.ensure_future(send(nc, agent, "t-held", {"hold": True, "size": 10}))
        await eventually(lambda: "t-held" in table)
        for i in range(8):
            out = await send(nc, agent, f"t{i}", {"size": 100_000})
            assert out["state"] == TaskState.SUCCEEDED.value
        assert table.bytes <= table.max_bytes
        assert [t for t in table if t != "t-held"] == ["t5", "t6", "t7"]
        assert "t-held" in table  # running: never pushed out
        # A forgotten one runs again; a kept one answers from the table.
        assert (await send(nc, agent, "t7", {"size": 100_000})).get("cached") is True
        assert (await send(nc, agent, "t0", {"size": 100_000})).get("cached", False) is False
        release.set()
        assert (await held)["result"] == "x" * 10
        sizes = sum(table[t].size for t in table)
        assert sizes == table.bytes


async def test_copies_of_a_running_task_wait_only_as_many_as_the_agent_takes(
    hub: Hub, settings: MeshSettings, namespace: str, nc: NATS
) -> None:
    """Each copy of a running task waits for its run's reply; they were not bounded (a caller
    repeating one task id could pile up coroutines without end). Past the agent's capacity a
    copy is refused busy, at once."""
    agent = Agent(f"{namespace}.copies.a1", settings=settings, max_concurrency=1, max_queue=1)
    release = asyncio.Event()

    @agent.handler("calc:copies:v1")
    async def copies(task: Task[Any]) -> str:
        await release.wait()
        return "once"

    async with agent:
        first = asyncio.ensure_future(send(nc, agent, "t-copied", 1))
        await eventually(lambda: "t-copied" in agent._results)
        waiting = [asyncio.ensure_future(send(nc, agent, "t-copied", 1)) for _ in range(2)]
        await eventually(lambda: agent._copies == 2)
        busy = await asyncio.gather(*(send(nc, agent, "t-copied", 1) for _ in range(3)))
        assert {b["error"]["code"] for b in busy} == {"REACH_AGENT_BUSY"}, busy
        release.set()
        assert (await first)["result"] == "once"
        for w in waiting:
            out = await w
            assert out["result"] == "once" and out["cached"] is True
        assert agent._copies == 0
