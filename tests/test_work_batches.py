"""Work batches: several steps for one agent in one message of its work subject, on a real
nats-server (``reach_mesh/_work_batch.py``, ``hub/_work_out.py``, ``agent/_work_batches.py``).

The agent side is driven with batches published by the test, as a hub would store them; the hub
side with workflows started together."""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext
from nats.js.api import ConsumerInfo
from prometheus_client.parser import text_string_to_metric_families

from reach_mesh import Client, MeshSettings, Step, TaskState, _work_batch, protocol
from reach_mesh.agent import Agent, Task
from reach_mesh.agent._work_batches import BatchPart, WorkBatch
from reach_mesh.errors import BadRequestError
from reach_mesh.hub import Hub
from reach_mesh.hub._work_out import WorkOut
from reach_mesh.models import AgentCard, TaskEnvelope
from reach_mesh.server import EmbeddedNats
from reach_mesh.workflow import TaskRecord

from .helpers import WF_FAST, Fleet, eventually, status_events

pytestmark = pytest.mark.timeout(60)

_TRACEPARENT = "00-" + "ab" * 16 + "-" + "cd" * 8 + "-01"


def _envelope(ns: str, task_id: str, workflow_id: str, step: int, cap: str = "wb:run:v1") -> bytes:
    env = TaskEnvelope(
        task_id=task_id,
        capability=cap,
        payload={"i": step},
        namespace=ns,
        timeout=10.0,
        workflow_id=workflow_id,
        step=step,
        track=True,
    )
    return protocol.encode(env)


async def _publish_batch(
    nc: NATS, ns: str, agent_id: str, lines: list[bytes], count: int | None = None
) -> None:
    """Store ``lines`` as one work batch on ``agent_id``'s work subject, as a hub does."""
    js = nc.jetstream()
    headers = {
        protocol.HDR_MSG_ID: f"{ns}.{uuid.uuid4().hex}+{len(lines)}",
        protocol.HDR_EXPECTED_STREAM: protocol.STREAM_WORK,
        protocol.HDR_WORK_BATCH: str(len(lines) if count is None else count),
    }
    await js.publish(protocol.work_subject(ns, agent_id), _work_batch.join(lines), headers=headers)


def _steps(ns: str, n: int) -> tuple[str, list[str], list[bytes]]:
    wf = "wb" + uuid.uuid4().hex[:12]
    ids = [f"{wf}-{i}" for i in range(n)]
    lines = [_work_batch.line(_TRACEPARENT, _envelope(ns, t, wf, i)) for i, t in enumerate(ids)]
    return wf, ids, lines


async def _final_states(nc: NATS, ns: str, task_id: str) -> list[TaskState]:
    client = type("C", (), {"nc": nc})()
    return [e.state for e in await status_events(client, ns, task_id) if e.state.final]


async def _unacked(nc: NATS, agent_id: str) -> int:
    info: ConsumerInfo = await nc.jetstream().consumer_info(
        protocol.STREAM_WORK, protocol.work_consumer(agent_id)
    )
    return int(info.num_ack_pending or 0) + int(info.num_pending or 0)


async def _all_acked(nc: NATS, agent_id: str) -> None:
    """Wait until the agent's work consumer has nothing pending or unacked."""

    async def acked() -> bool:
        return await _unacked(nc, agent_id) == 0

    await eventually(acked, timeout=10)


async def _all_ran(runs: Counter[str], ids: list[str], times: int = 1) -> None:
    await eventually(lambda: all(runs[t] == times for t in ids), timeout=10)


async def _all_final(nc: NATS, ns: str, ids: list[str]) -> None:
    async def final() -> bool:
        return all([await _final_states(nc, ns, t) for t in ids])

    await eventually(final, timeout=10)


def _counting_agent(fleet: Fleet, name: str, runs: Counter[str], **kw: Any) -> Agent:
    agent = fleet.agent(name, **kw)

    @agent.handler("wb:run:v1")
    async def run(task: Task[dict[str, Any]]) -> dict[str, int]:
        runs[task.task_id] += 1
        return {"step": task.payload["i"]}

    return agent


async def _running_agent(fleet: Fleet, name: str) -> tuple[Agent, Counter[str]]:
    """A started :func:`_counting_agent`, and its runs by task id."""
    runs: Counter[str] = Counter()
    agent = _counting_agent(fleet, name, runs)
    await agent.start()
    return agent, runs


# --------------------------------------------------------------------------- the wire


def test_split_takes_lines_and_refuses_what_is_no_batch() -> None:
    body = _work_batch.join([_work_batch.line(_TRACEPARENT, b'{"a":1}'), b"nonsense", b""])
    parts = _work_batch.split(body, "3")
    assert parts[0] == (_TRACEPARENT, b'{"a":1}')
    assert isinstance(parts[1], BadRequestError) and parts[1].details == {"line": 1}
    assert isinstance(parts[2], BadRequestError) and parts[2].code == "REACH_BAD_REQUEST"
    for count in (None, "", "0", "65", "x", "2"):
        with pytest.raises(BadRequestError):
            _work_batch.split(body, count)
    steps = [("t-1", 2), ("t-2", 1)]
    msg_id = _work_batch.batch_msg_id("ns", steps)
    assert msg_id.startswith("ns.t-1#2+2.") and msg_id == _work_batch.batch_msg_id("ns", steps)
    # Another batch that starts with the same attempt, as long: another message.
    assert _work_batch.batch_msg_id("ns", [("t-1", 2), ("t-3", 1)]) != msg_id


@contextlib.asynccontextmanager
async def _a_stream(nc: NATS) -> AsyncIterator[tuple[JetStreamContext, str, Any]]:
    """A stream of its own holding one message ``batch``, and a pull subscription on it."""
    js = nc.jetstream()
    name = "WBT" + uuid.uuid4().hex[:8]
    await js.add_stream(name=name, subjects=[f"wbt.{name}"])
    try:
        await js.publish(f"wbt.{name}", b"batch")
        yield js, name, await js.pull_subscribe(f"wbt.{name}", durable="c", stream=name)
    finally:
        await js.delete_stream(name)


async def test_a_batch_message_is_settled_by_its_parts(nc: NATS) -> None:
    """A part nak'd while others are held comes back alone (``retry``), not with the whole
    message; once every part is acked the message is; a nak of the last part naks it (it is
    delivered again)."""
    async with _a_stream(nc) as (js, name, sub):
        tasks: set[asyncio.Future[None]] = set()

        def spawn(coro: Any) -> None:
            tasks.add(asyncio.ensure_future(coro))

        async def delivered() -> tuple[WorkBatch, list[BatchPart]]:
            (msg,) = await sub.fetch(1, timeout=5)
            batch = WorkBatch(msg, 3, None, spawn)
            return batch, [BatchPart(batch, _TRACEPARENT, b"{}") for _ in range(3)]

        batch, parts = await delivered()
        again: list[tuple[BatchPart, float]] = []
        batch.retry = lambda part, delay: again.append((part, delay))
        await parts[0].nak(delay=0.5)  # the two others are held
        assert [d for _, d in again] == [0.5] and batch.unsettled == 3
        await parts[1].ack()
        await again[0][0].ack()  # taken again, and done
        assert not batch.settled
        await parts[2].term()
        assert batch.settled
        await asyncio.gather(*tasks)

        async def acked() -> bool:
            return (await sub.consumer_info()).num_ack_pending == 0

        await eventually(acked)

        await js.publish(f"wbt.{name}", b"batch 2")
        batch, parts = await delivered()
        batch.retry = lambda part, delay: again.append((part, delay))
        await parts[0].ack()
        await parts[1].ack()
        await parts[2].nak(delay=0.1)  # the last one: the message is nak'd
        await asyncio.gather(*tasks)
        (back,) = await sub.fetch(1, timeout=5)
        assert back.data == b"batch 2" and back.metadata.num_delivered == 2
        await back.ack()


async def test_a_batch_whose_parts_all_nak_is_nakd_not_held_by_them(nc: NATS) -> None:
    """Parts waiting to be taken again are not held: when every part of a batch naks (fences
    unreadable, out of touch), the message is nak'd — JetStream brings it again after the
    delay — rather than kept unsettled by parts that each wait for the others, until
    ``ack_wait`` redelivers it (no part held, no ``+WPI``) and starts them all again beside
    the ones still waiting."""
    async with _a_stream(nc) as (_, _, sub):
        tasks: set[asyncio.Future[None]] = set()
        (msg,) = await sub.fetch(1, timeout=5)
        batch = WorkBatch(msg, 3, None, lambda coro: tasks.add(asyncio.ensure_future(coro)))
        parts = [BatchPart(batch, _TRACEPARENT, b"{}") for _ in range(3)]
        again: list[BatchPart] = []
        batch.retry = lambda part, delay: again.append(part)
        await parts[0].nak(delay=0.2)  # two others held: taken again here
        await parts[1].nak(delay=0.2)  # one other held: taken again here
        assert len(again) == 2 and batch.unsettled == 3
        await parts[2].nak(delay=0.2)  # the others wait to be taken again: none is held
        assert len(again) == 2 and batch.unsettled == 2
        for part in again:
            part.taken()  # taken again (``BatchIntake._again``) ...
            await part.nak(delay=0.2)  # ... and nak'd again: nothing else held
        assert len(again) == 2 and batch.settled
        await asyncio.gather(*tasks)
        (back,) = await sub.fetch(1, timeout=5)
        assert back.data == b"batch" and back.metadata.num_delivered == 2
        await back.ack()


# --------------------------------------------------------------------------- the agent side


async def test_a_batch_runs_every_step_once_and_is_acked(
    wf_hub: Hub, fleet: Fleet, wf_settings: MeshSettings, nc: NATS
) -> None:
    ns = wf_settings.namespace
    agent, runs = await _running_agent(fleet, "wb.a1")
    assert agent.card().work_batch
    _, ids, lines = _steps(ns, 5)
    await _publish_batch(nc, ns, agent.agent_id, lines)
    await _all_ran(runs, ids)
    for task_id in ids:
        assert await _final_states(nc, ns, task_id) == [TaskState.SUCCEEDED]

    await _all_acked(nc, agent.agent_id)
    await asyncio.sleep(1.5)  # past work_ack_wait: nothing comes back
    assert all(runs[t] == 1 for t in ids)


async def test_a_batch_redelivered_after_its_agent_died_runs_nothing_finished_twice(
    wf_hub: Hub, fleet: Fleet, wf_settings: MeshSettings, nc: NATS
) -> None:
    """Two steps of four finish, then the agent dies with the other two running: the batch is
    not acked, and comes back to the agent started again with the same id. The two finished
    steps are answered from its idempotency table (rebuilt from its final statuses), the other
    two run; every step ends SUCCEEDED, its final status stored once per run."""
    ns = wf_settings.namespace
    _, ids, lines = _steps(ns, 4)
    held = set(ids[2:])
    runs: Counter[str] = Counter()
    release = asyncio.Event()

    def make(name: str) -> Agent:
        agent = fleet.agent(name, drain_timeout=0.2)

        @agent.handler("wb:run:v1")
        async def run(task: Task[dict[str, int]]) -> dict[str, int]:
            runs[task.task_id] += 1
            if task.task_id in held and not release.is_set():
                await asyncio.Event().wait()  # until the agent stops
            return {"step": task.payload["i"]}

        return agent

    first = make("wb.a2")
    await first.start()
    await _publish_batch(nc, ns, first.agent_id, lines)
    await _all_ran(runs, ids)
    await _all_final(nc, ns, ids[:2])
    await first.nc.close()  # abrupt: no final status of the two held, the batch not acked
    release.set()
    second = make("wb.a2")
    await second.start()
    await _all_ran(runs, ids[2:], 2)
    await _all_final(nc, ns, ids)
    assert runs[ids[0]] == runs[ids[1]] == 1  # finished before: not run again
    for task_id in ids[2:]:
        assert await _final_states(nc, ns, task_id) == [TaskState.SUCCEEDED]

    await _all_acked(nc, second.agent_id)


async def test_a_fenced_step_inside_a_batch_is_dropped_and_the_others_run(
    wf_hub: Hub, fleet: Fleet, wf_settings: MeshSettings, nc: NATS
) -> None:
    """A hub gave up step 1's attempt after sending it: its fence marker is stored behind the
    batch. The agent drops that step unrun (no status), runs the others, acks the batch."""
    ns = wf_settings.namespace
    runs: Counter[str] = Counter()
    agent = _counting_agent(fleet, "wb.a3", runs)
    wf, ids, lines = _steps(ns, 3)
    await _publish_batch(nc, ns, agent.agent_id, lines)
    await nc.jetstream().publish(
        protocol.work_subject(ns, agent.agent_id),
        protocol.dumps({"task_id": ids[1], "attempt": 1, "workflow_id": wf}),
        headers={
            protocol.HDR_MSG_ID: protocol.fence_msg_id(ns, ids[1], 1),
            protocol.HDR_FENCE: "1",
        },
    )
    await agent.start()
    await _all_final(nc, ns, [ids[0], ids[2]])

    await _all_acked(nc, agent.agent_id)
    assert runs[ids[1]] == 0
    assert await _final_states(nc, ns, ids[1]) == []
    work = agent.work
    # (Once, or again if the batch came back: a line nak'd while the agent was not in touch
    # with a hub yet, just started, brings the whole batch again.)
    assert work is not None and work.fenced >= 1


async def test_malformed_lines_are_refused_and_the_rest_runs(
    wf_hub: Hub, fleet: Fleet, wf_settings: MeshSettings, nc: NATS
) -> None:
    ns = wf_settings.namespace
    agent, runs = await _running_agent(fleet, "wb.a4")
    _, ids, lines = _steps(ns, 2)
    await _publish_batch(nc, ns, agent.agent_id, [lines[0], b"no traceparent here", lines[1]])
    # Not a batch at all (its count is not its number of lines): termed, nothing runs.
    _, bad_ids, bad_lines = _steps(ns, 2)
    await _publish_batch(nc, ns, agent.agent_id, bad_lines, count=3)
    await _all_ran(runs, ids)

    await _all_acked(nc, agent.agent_id)
    work = agent.work
    assert work is not None and work.malformed_lines == 1
    assert not any(runs[t] for t in bad_ids)
    assert _dropped(agent, "malformed_line") == 1  # what an SRE sees of it


def _metric(agent: Agent, name: str, **labels: str) -> float | None:
    """The value of ``agent``'s exported sample ``name`` with ``labels`` (None: absent)."""
    for family in text_string_to_metric_families(agent.metrics.render().decode()):
        for sample in family.samples:
            if sample.name == name and sample.labels == labels:
                return sample.value
    return None


def _dropped(agent: Agent, reason: str) -> float | None:
    return _metric(agent, "reach_agent_steps_dropped_total", reason=reason)


def _line_of(line: bytes, **change: Any) -> bytes:
    """``line`` (of :func:`_steps`) with fields of its envelope changed."""
    traceparent, envelope = line.split(b" ", 1)
    body = json.loads(envelope) | change
    return _work_batch.line(traceparent.decode(), json.dumps(body, separators=(",", ":")).encode())


async def test_hostile_lines_run_nothing_twice_and_lose_no_other_line(
    wf_hub: Hub, fleet: Fleet, wf_settings: MeshSettings, nc: NATS
) -> None:
    """One batch holding a step twice, the same step's next attempt, a step of another
    namespace (it ran, fenced by nothing: a fresh delivery reads no record), JSON nested 5000
    deep and an envelope of the
    wrong types: the good steps run once each, the step of another namespace is refused
    unrun (no status), and the batch is acked."""
    ns = wf_settings.namespace
    agent, runs = await _running_agent(fleet, "wb.hostile")
    work = agent.work
    assert work is not None
    wf, ids, lines = _steps(ns, 3)
    foreign = _line_of(lines[2], namespace="elsewhere", task_id=f"{wf}-x")
    nested = b'{"task_id":"' + wf.encode() + b'-n","payload":' + b"[" * 5000 + b"]" * 5000 + b"}"
    batch = [
        lines[0],
        lines[0],
        lines[1],
        _line_of(lines[1], attempt=2),
        foreign,
        _work_batch.line(_TRACEPARENT, nested),
        _work_batch.line(_TRACEPARENT, b'{"task_id":5,"attempt":"x"}'),
        lines[2],
    ]
    await _publish_batch(nc, ns, agent.agent_id, batch)
    await _all_ran(runs, ids)
    await _all_final(nc, ns, ids)

    await _all_acked(nc, agent.agent_id)
    assert all(runs[t] == 1 for t in ids)
    assert runs[f"{wf}-x"] == 0 and work.foreign == 1
    assert _dropped(agent, "foreign") == 1
    assert await _final_states(nc, ns, f"{wf}-x") == []
    assert await _final_states(nc, ns, ids[1]) == [TaskState.SUCCEEDED] * 2  # each attempt's


@pytest.mark.parametrize("resent", ["batch", "single"])
async def test_a_takeover_hubs_attempts_fence_the_old_owners_batches(
    wf_hub: Hub, fleet: Fleet, wf_settings: MeshSettings, nc: NATS, resent: str
) -> None:
    """While the agent is away its old owner hub stores a batch of three steps; a takeover
    hub gives attempt 1 of two of them up (their records say attempt 2, a fence marker each)
    and sends attempt 2 — in a batch, or each alone — and the old owner, not yet aware,
    stores attempt 1 of one of them again with the third step. The agent runs each step
    once: the two at attempt 2 (no status of attempt 1: never applied), the third once (its
    second copy a duplicate); every message is acked."""
    ns = wf_settings.namespace
    runs: Counter[str] = Counter()
    agent = _counting_agent(fleet, "wb.takeover", runs)
    wf, ids, lines = _steps(ns, 3)
    js = nc.jetstream()
    subject = protocol.work_subject(ns, agent.agent_id)
    tasks = await js.key_value(protocol.KV_TASKS)
    await _publish_batch(nc, ns, agent.agent_id, lines)  # the old owner's
    for i, task_id in enumerate(ids[:2]):
        record = TaskRecord(
            task_id=task_id,
            workflow_id=wf,
            step=i,
            namespace=ns,
            attempt=2,
            agent_id=agent.agent_id,
        )
        await tasks.put(protocol.task_key(ns, task_id), protocol.encode(record))
        await js.publish(
            subject,
            protocol.dumps({"task_id": task_id, "attempt": 1, "workflow_id": wf}),
            headers={
                protocol.HDR_MSG_ID: protocol.fence_msg_id(ns, task_id, 1),
                protocol.HDR_FENCE: "1",
            },
        )
    again = [_line_of(line, attempt=2) for line in lines[:2]]
    if resent == "batch":
        await _publish_batch(nc, ns, agent.agent_id, again)
    else:
        for task_id, line in zip(ids[:2], again, strict=True):
            await js.publish(
                subject,
                line.split(b" ", 1)[1],
                headers={protocol.HDR_MSG_ID: protocol.attempt_msg_id(ns, task_id, 2)},
            )
    await _publish_batch(nc, ns, agent.agent_id, [lines[0], lines[2]])  # the old owner again
    await agent.start()
    await _all_final(nc, ns, ids)

    await _all_acked(nc, agent.agent_id)
    assert [runs[t] for t in ids] == [1, 1, 1]
    client = type("C", (), {"nc": nc})()
    for task_id in ids[:2]:
        events = await status_events(client, ns, task_id)
        assert {e.attempt for e in events} == {2}
        assert [e.state for e in events if e.state.final] == [TaskState.SUCCEEDED]
    assert await _final_states(nc, ns, ids[2]) == [TaskState.SUCCEEDED]


async def test_batches_never_hold_an_agent_past_its_capacity_in_steps(
    wf_hub: Hub, fleet: Fleet, wf_settings: MeshSettings, nc: NATS
) -> None:
    """The pulls count messages, and each may be a batch: an agent with
    ``max_concurrency + max_queue`` = 3 that pulled three batches of two would hold six steps,
    three waiting for a slot where it promised at most one. A batch without room for all its
    steps is nak'd unrun (it waits in the stream, where a hub sees it undelivered) and taken
    once steps end; every step runs once."""
    ns = wf_settings.namespace
    release = asyncio.Event()
    runs: Counter[str] = Counter()
    agent = fleet.agent("wb.cap", max_concurrency=2, max_queue=1)

    @agent.handler("wb:run:v1")
    async def run(task: Task[dict[str, Any]]) -> dict[str, int]:
        runs[task.task_id] += 1
        await release.wait()
        return {"step": task.payload["i"]}

    await agent.start()
    work = agent.work
    assert work is not None
    ids: list[str] = []
    for _ in range(4):
        _, batch_ids, lines = _steps(ns, 2)
        ids += batch_ids
        await _publish_batch(nc, ns, agent.agent_id, lines)
    await eventually(lambda: agent._running == 2, timeout=10)
    most = 0
    for _ in range(50):  # (what it holds: its steps running or waiting for a slot)
        most = max(most, len(work._held))
        await asyncio.sleep(0.02)
    assert most <= 3
    assert work.batches_put_back >= 1
    put_back = _metric(agent, "reach_agent_work_batches_put_back_total")
    assert put_back == work.batches_put_back
    release.set()
    await _all_ran(runs, ids)
    await _all_final(nc, ns, ids)
    await _all_acked(nc, agent.agent_id)


# --------------------------------------------------------------------------- the hub side


class _OldAgent(Agent):
    """An agent of an SDK that takes no work batches (its card does not say it does)."""

    def card(self) -> AgentCard:
        return super().card().model_copy(update={"work_batch": False})


async def _started_together(
    settings: MeshSettings, agent_id: str, n: int, pad: int = 0
) -> tuple[list[Any], Hub]:
    """``n`` fanouts of one step for ``agent_id`` (``pad`` bytes more in each step's input),
    submitted while no hub runs, then a hub started (the agents stay registered meanwhile:
    their leases hold): it takes them in together (one read of its pull) and decides their
    steps in few passes of its loop. Their results, and the hub (running)."""
    async with Client(settings=settings) as mesh:
        ids = [
            await mesh.submit_fanout(
                [Step(agent_id=agent_id, payload={"i": i, "pad": "x" * pad} if pad else {"i": i})],
                timeout=30,
            )
            for i in range(n)
        ]
        hub = Hub(settings=settings)
        await hub.start()
        results = [await mesh.workflow(wf_id, timeout=30) for wf_id in ids]
    return results, hub


def _work_sent(hub: Hub) -> tuple[WorkOut, float, float, float]:
    """``hub``'s work messages: its ``WorkOut``, and what /metrics says was stored — batches,
    single steps, steps in batches."""
    assert hub.workflows is not None
    sample = hub.metrics.registry.get_sample_value
    return (
        hub.workflows._work_out,
        sample("reach_work_messages_total", {"kind": "batch"}) or 0.0,
        sample("reach_work_messages_total", {"kind": "single"}) or 0.0,
        sample("reach_work_batched_steps_total") or 0.0,
    )


async def test_steps_decided_together_go_in_batches_only_to_agents_that_take_them(
    wf_settings: MeshSettings, fleet: Fleet
) -> None:
    ns = wf_settings.namespace
    runs: Counter[str] = Counter()
    new = _counting_agent(fleet, "wb.new", runs)
    old = _OldAgent(f"{ns}.wb.old", settings=wf_settings)
    fleet.agents.append(old)

    @old.handler("wb:run:v1")
    async def run(task: Task[dict[str, int]]) -> dict[str, int]:
        runs[task.task_id] += 1
        return {"step": task.payload["i"]}

    assert new.card().work_batch and not old.card().work_batch
    async with Hub(settings=wf_settings):  # the streams, buckets, and the agents' registration
        for agent in (new, old):
            await agent.start()
    for agent, batched in ((new, True), (old, False)):
        results, hub = await _started_together(wf_settings, agent.agent_id, 40)
        try:
            assert [r.state for r in results] == [TaskState.SUCCEEDED] * 40
            out, batches, singles, in_batches = _work_sent(hub)
            if batched:
                assert out.batches_total >= 1, "no two steps were decided in one pass"
                assert out.sent_total < 40
                # /metrics tells an operator the same: every step stored once, in a batch or not
                assert batches == out.batches_total and singles + in_batches == 40
            else:
                assert out.batches_total == 0 and out.sent_total == 40
                assert batches == 0 and in_batches == 0 and singles == 40
        finally:
            await hub.close()
    assert len(runs) == 80 and set(runs.values()) == {1}


async def test_a_batch_holds_no_more_than_the_nats_server_takes(
    tmp_path: Path, namespace: str
) -> None:
    """A NATS server whose ``max_payload`` (64 KiB here) is under ``BATCH_BYTES``: the batches
    are cut to what it takes. (Before, sixteen steps of 6 KB went as one message of ~100 KB:
    refused, every step in it failed — their workflows handed back, run again later.)"""
    async with EmbeddedNats(str(tmp_path), max_payload=64 << 10) as server:
        settings = MeshSettings(nats_url=server.url, namespace=namespace, **WF_FAST)
        fleet = Fleet(settings)
        try:
            runs: Counter[str] = Counter()
            agent = _counting_agent(fleet, "wb.small", runs)
            async with Hub(settings=settings):  # the streams, buckets, its registration
                await agent.start()
            results, hub = await _started_together(settings, agent.agent_id, 24, pad=6_000)
            try:
                assert [r.state for r in results] == [TaskState.SUCCEEDED] * 24
                out, batches, singles, in_batches = _work_sent(hub)
                assert out.batches_total >= 1, "no two steps were decided in one pass"
                # Every work message sent was stored: each step once, none sent again.
                assert batches == out.batches_total and singles + in_batches == 24
            finally:
                await hub.close()
            assert len(runs) == 24 and set(runs.values()) == {1}
        finally:
            await fleet.close()


async def test_workflows_whose_steps_came_in_batches_all_end_when_their_agent_dies(
    wf_settings: MeshSettings, fleet: Fleet
) -> None:
    """Twelve fanouts started together: their steps reach the one agent in batches. It
    finishes the even ones and dies holding the odd ones (its batches never acked). Every
    workflow ends SUCCEEDED: the odd steps on the agent started after it, the even ones from
    their first run — none of them runs twice, none has two successes stored."""
    ns = wf_settings.namespace
    runs: Counter[str] = Counter()
    held: list[str] = []

    doomed = fleet.agent("wb.doomed", drain_timeout=0.2)

    @doomed.handler("wb:die:v1")
    async def half(task: Task[dict[str, int]]) -> dict[str, int]:
        runs[task.task_id] += 1
        if task.payload["i"] % 2:
            held.append(task.task_id)
            await asyncio.Event().wait()  # until the process would have died
        return {"step": task.payload["i"]}

    async with Hub(settings=wf_settings):  # the streams, buckets, and the registration
        await doomed.start()
    async with Client(settings=wf_settings) as mesh:
        ids = [
            await mesh.submit_fanout([Step(capability="wb:die:v1", payload={"i": i})], timeout=40)
            for i in range(12)
        ]
        async with Hub(settings=wf_settings) as hub:
            await eventually(lambda: len(held) == 6 and sum(runs.values()) == 12, timeout=15)
            assert hub.workflows is not None and hub.workflows._work_out.batches_total >= 1
            await doomed.nc.close()  # abrupt: no final status for the six held
            survivor = fleet.agent("wb.survivor")

            @survivor.handler("wb:die:v1")
            async def run(task: Task[dict[str, int]]) -> dict[str, int]:
                runs[task.task_id] += 1
                return {"step": task.payload["i"]}

            await survivor.start()
            results = [await mesh.workflow(wf_id, timeout=40) for wf_id in ids]
        assert [r.state for r in results] == [TaskState.SUCCEEDED] * 12, results
        for i, res in enumerate(results):
            (step,) = res.steps
            assert runs[step.task_id] == (2 if i % 2 else 1), (i, runs)
            events = await status_events(mesh, ns, step.task_id)
            assert [e.state for e in events].count(TaskState.SUCCEEDED) == 1
