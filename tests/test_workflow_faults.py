"""Workflows keep their promise under faults (regressions of issue 10), on real nats-servers.

- NATS unavailable while steps run: retried, never a step's FAILED; each handler runs once.
- The ``.done`` announcement follows the stored record and says the same thing.
- An attempt given up on (not delivered in time) is fenced before the backoff: when it turns up
  later its agent drops it unrun, so the step runs once.
- The task-state probe reads the documented answer: ``"error": null`` is no error, and a
  FAILED read from the agent is an outcome, not a lost attempt.
- A workflow id submitted again with another spec is a conflict; with the same spec a no-op.
- An attempt the hub gave up on (``task_state`` with ``fence``) is never started by the agent
  that promised, even when the task record it reads still names that attempt (a JetStream
  replica that has not applied the hub's fence yet).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from pathlib import Path
from typing import Any

import pytest
from nats.aio.msg import Msg
from nats.js.errors import NotFoundError
from opentelemetry.trace import INVALID_SPAN

from reach_mesh import (
    Client,
    MeshSettings,
    RetryPolicy,
    Step,
    TaskState,
    WorkflowConflictError,
    protocol,
)
from reach_mesh._nats import flushed
from reach_mesh.agent import Task, TaskFailed
from reach_mesh.hub import Hub
from reach_mesh.hub._tracking import StatusTracker, parse_task_state
from reach_mesh.models import TaskEnvelope
from reach_mesh.server import EmbeddedNats
from reach_mesh.workflow import (
    TaskRecord,
    TaskStatusEvent,
    WorkflowRecord,
    WorkflowResult,
    spec_digest,
)

from .helpers import Fleet, echo_agent, eventually, free_port, task_record

pytestmark = pytest.mark.timeout(90)


# --------------------------------------------------------------------------- NATS outage


async def test_nats_outage_is_never_a_step_outcome(tmp_path: Path) -> None:
    """The server dies while workflows are submitted and steps run, and comes back 6 s later
    (same port, same store): every workflow succeeds, no step is FAILED for it, and no handler
    ran twice."""
    port = free_port()
    server = EmbeddedNats(tmp_path, port=port)
    await server.astart()
    s = MeshSettings(
        nats_url=server.url,
        namespace="outage",
        heartbeat_interval=0.5,
        lease_timeout=6.0,
        suspect_timeout=6.0,
        audit_enabled=False,
        workflow_ack_wait=5.0,
        work_ack_wait=3.0,
        step_deliver_timeout=4.0,
        step_silence_timeout=6.0,
        step_running_interval=0.5,
        retry_base=0.05,
        retry_cap=0.2,
        pending_interval=0.3,
    )
    fleet = Fleet(s)
    started = asyncio.Event()
    for i in range(2):
        agent = fleet.agent(f"slow.a{i}")

        @agent.handler("outage:slow:v1")
        async def slow(task: Task[Any]) -> Any:
            fleet.runs[task.task_id] += 1
            started.set()
            await asyncio.sleep(0.3)
            return task.payload

    try:
        async with Hub(settings=s), Client(settings=s) as mesh:
            for agent in fleet.agents:
                await agent.start()
            ids: list[str] = []

            async def submit(n: int) -> None:
                for i in range(n):
                    steps = [Step(capability="outage:slow:v1", payload=[i, k]) for k in range(3)]
                    if i % 2:
                        ids.append(await mesh.submit_chain(steps[:2], timeout=60))
                    else:
                        ids.append(await mesh.submit_fanout(steps, timeout=60))
                    await asyncio.sleep(0.02)

            # Workflows keep coming while the server dies: the hub is creating records and
            # sending steps when its writes start to fail.
            feeder = asyncio.create_task(submit(40))
            await asyncio.wait_for(started.wait(), 10)
            server.kill()
            # Longer than nats-py's JetStream request timeout (5 s): writes fail, not just wait.
            await asyncio.sleep(6.0)
            server = EmbeddedNats(tmp_path, port=port)
            await server.astart()
            await feeder  # submissions during the outage were retried, not refused
            results = [await mesh.workflow(wf_id, timeout=60) for wf_id in ids]
    finally:
        await fleet.close()
        server.stop()
    for res in results:
        assert res.state is TaskState.SUCCEEDED, res.error
        assert all(step.state is TaskState.SUCCEEDED for step in res.steps)
    assert fleet.runs and max(fleet.runs.values()) == 1, fleet.runs


# --------------------------------------------------------------------------- one final result


async def test_done_announcement_follows_the_stored_record(
    wf_hub: Hub, fleet: Fleet, wf_settings: MeshSettings
) -> None:
    ns = wf_settings.namespace
    echo_agent(fleet, "done.a1")
    failing = fleet.agent("done.f1")

    @failing.handler("wf:fail:v1")
    async def fail(task: Task[Any]) -> None:
        raise TaskFailed("no", retryable=False)

    for agent in fleet.agents:
        await agent.start()
    seen: list[tuple[WorkflowResult, WorkflowRecord | None]] = []
    async with Client(settings=wf_settings) as mesh:
        kv = await mesh.nc.jetstream().key_value(protocol.KV_WORKFLOWS)

        async def on_done(msg: Msg) -> None:
            result = WorkflowResult.model_validate_json(msg.data)
            entry = await kv.get(protocol.workflow_key(ns, result.workflow_id))
            record = WorkflowRecord.model_validate_json(entry.value) if entry.value else None
            seen.append((result, record))

        sub = await mesh.nc.subscribe(protocol.wf_done(ns, "*"), cb=on_done)
        ids = []
        for i in range(10):
            cap = "wf:fail:v1" if i % 3 == 0 else "wf:echo:v1"
            ids.append(await mesh.submit_fanout([Step(capability=cap, payload=i)], timeout=10))
        results = {wf_id: await mesh.workflow(wf_id, timeout=10) for wf_id in ids}
        await eventually(lambda: len(seen) == len(ids), timeout=5)
        await sub.unsubscribe()
    for announced, record in seen:
        assert record is not None and record.state.final
        assert record.result is not None
        assert record.result.model_dump() == announced.model_dump()
        assert results[announced.workflow_id].model_dump() == announced.model_dump()
    assert {r.state for r in results.values()} == {TaskState.SUCCEEDED, TaskState.FAILED}


# --------------------------------------------------------------------------- backoff window


async def test_attempt_given_up_on_is_fenced_before_the_backoff(
    wf_hub: Hub, fleet: Fleet, wf_settings: MeshSettings
) -> None:
    """A's only slot is busy, so the step's attempt 1 waits undelivered; the engine gives up on
    it and retries after a long backoff. A frees up during the backoff and receives attempt 1:
    the record already names attempt 2, so A drops it unrun, and B runs the step once."""
    ns = wf_settings.namespace
    release = asyncio.Event()
    a = fleet.agent("window.a", max_concurrency=1, max_queue=0)

    @a.handler("wf:block:v1")
    async def block(task: Task[Any]) -> str:
        await release.wait()
        return "unblocked"

    @a.handler("wf:step:v1")
    async def step_a(task: Task[Any]) -> str:
        fleet.runs[task.task_id] += 1
        return "by A"

    b = fleet.agent("window.b")

    @b.handler("wf:step:v1")
    async def step_b(task: Task[Any]) -> str:
        fleet.runs[task.task_id] += 1
        return "by B"

    await a.start()
    slow = RetryPolicy(backoff_base=2.5, backoff_cap=2.5)
    async with Client(settings=wf_settings) as mesh:
        blocker = await mesh.submit_fanout([Step(capability="wf:block:v1")], timeout=30)
        await eventually(lambda: a._running == 1, timeout=5)
        wf_id = await mesh.submit_fanout(
            [Step(capability="wf:step:v1", task_id="window-step", retry=slow)], timeout=30
        )

        # The deliver timeout (1 s) passes, the engine gives up on attempt 1, records attempt
        # 2 with no agent yet (the fence), and backs off.
        for _ in range(200):
            rec = await task_record(mesh.nc, ns, "window-step")
            if rec is not None and rec.attempt == 2:
                break
            await asyncio.sleep(0.05)
        assert rec is not None and rec.attempt == 2 and rec.agent_id is None  # fenced
        release.set()  # A takes attempt 1 now, inside the backoff
        await b.start()
        res = await mesh.workflow(wf_id, timeout=20)
        assert (await mesh.workflow(blocker, timeout=10)).state is TaskState.SUCCEEDED
    assert res.state is TaskState.SUCCEEDED
    assert res.result == ["by B"]
    assert fleet.runs["window-step"] == 1
    assert a.work is not None
    await eventually(lambda: a.work is not None and a.work.fenced >= 1, timeout=5)


# --------------------------------------------------------------------------- the probe


def test_task_state_answers_parse_by_the_protocol() -> None:
    reply = {"task_id": "t", "attempt": 2, "agent_id": "n.s.i", "state": "SUCCEEDED"}
    assert parse_task_state(json.dumps({**reply, "error": None}).encode()) == (
        TaskState.SUCCEEDED,
        2,
        {**reply, "error": None},
    )
    running = parse_task_state(b'{"task_id": "t", "attempt": 1, "state": "RUNNING"}')
    assert running is not None and running[:2] == (TaskState.RUNNING, 1)
    unknown = parse_task_state(b'{"task_id": "t", "state": "PENDING"}')
    assert unknown is not None and unknown[:2] == (TaskState.PENDING, None)
    # An error *answer* (the ctl request failed) has no state.
    assert parse_task_state(b'{"error": {"code": "REACH_BAD_REQUEST", "message": "x"}}') is None
    assert parse_task_state(b"not json") is None
    assert parse_task_state(b'{"state": 3}') is None
    # A lone surrogate (escaped, or as its bytes) is no answer: Python's json took it, and the
    # hub that kept it from an agent failed each time it stored the workflow record.
    for text in (b'"caf\\udce9"', b'"caf\xed\xb3\xa9"'):
        body = b'{"task_id": "t", "attempt": 1, "state": "SUCCEEDED", "result": %b}' % text
        assert parse_task_state(body) is None, body
    paired = b'{"task_id": "t", "attempt": 1, "state": "SUCCEEDED", "result": "\\ud83d\\ude00"}'
    answer = parse_task_state(paired)
    assert answer is not None and answer[2]["result"] == "\U0001f600"  # (a pair: one character)


@pytest.mark.parametrize(
    ("answer", "state", "decided"),
    [
        # The protocol doc's own TaskReply shape, with a present-but-null error.
        ({"state": "SUCCEEDED", "result": 42, "error": None}, TaskState.SUCCEEDED, True),
        (
            {
                "state": "FAILED",
                "error": {"code": "REACH_HANDLER_FAILED", "message": "bad", "details": {}},
            },
            TaskState.FAILED,
            True,
        ),
        ({"state": "RUNNING"}, None, False),
    ],
)
async def test_probe_reads_a_raw_agents_answer(
    settings: MeshSettings, answer: dict[str, Any], state: TaskState | None, decided: bool
) -> None:
    """The hub's probe against an agent written from docs/protocol.md (raw NATS)."""
    agent_id = f"{settings.namespace}.raw.a1"
    async with Hub(settings=settings) as hub, Client(settings=settings) as mesh:

        async def ctl(msg: Msg) -> None:
            body = json.loads(msg.data)
            assert body == {
                "op": "task_state",
                "task_id": "raw-task",
                "fence": 1,
                "workflow_id": "raw",
            }
            out = {"task_id": "raw-task", "attempt": 1, "agent_id": agent_id, **answer}
            await msg.respond(json.dumps(out).encode())

        sub = await mesh.nc.subscribe(protocol.agent_ctl(agent_id), cb=ctl)
        await flushed(mesh.nc)  # the server has the subscription before the hub's probe
        assert hub.workflows is not None
        tracker = StatusTracker(hub.nc, hub.workflows._jsc, hub.registry)
        rec = TaskRecord(
            task_id="raw-task",
            workflow_id="raw",
            step=0,
            namespace=settings.namespace,
            attempt=1,
            agent_id=agent_id,
        )
        track = tracker.open(rec, protocol.task_key(settings.namespace, "raw-task"), INVALID_SPAN)
        verdict = await tracker.probe(track)
        await sub.unsubscribe()
    if decided:
        assert verdict == "done"
        assert track.final is not None and track.final.state is state
        if state is TaskState.SUCCEEDED:
            assert track.final.result == 42
    else:
        assert verdict == "alive" and track.final is None


# --------------------------------------------------------------------------- fence promise


async def test_promised_attempt_never_starts_even_on_a_stale_record(
    wf_hub: Hub, fleet: Fleet, wf_settings: MeshSettings
) -> None:
    """The agent is asked about attempt 1 before it has it, with ``fence: 1``: it promises.
    Attempt 1 then arrives while the task record it reads still names attempt 1 on this agent
    (what a lagging replica serves) — it is dropped unrun. Attempt 2 runs once."""
    ns = wf_settings.namespace
    a = fleet.agent("promise.a")

    @a.handler("wf:step:v1")
    async def step(task: Task[Any]) -> str:
        fleet.runs[task.task_id] += 1
        return f"attempt {task.attempt}"

    await a.start()
    assert a.work is not None
    async with Client(settings=wf_settings) as mesh:
        js = mesh.nc.jetstream()
        kv = await js.key_value(protocol.KV_TASKS)
        key = protocol.task_key(ns, "promise-step")

        async def current(attempt: int) -> None:
            rec = TaskRecord(
                task_id="promise-step",
                workflow_id="promise-wf",
                step=0,
                namespace=ns,
                attempt=attempt,
                agent_id=a.agent_id,
                state=TaskState.DELIVERED,
            )
            await kv.put(key, protocol.encode(rec))

        async def send(attempt: int) -> None:
            env = TaskEnvelope(
                task_id="promise-step",
                attempt=attempt,
                capability="wf:step:v1",
                namespace=ns,
                workflow_id="promise-wf",
                step=0,
                track=True,
            )
            await js.publish(
                protocol.work_subject(ns, a.agent_id),
                protocol.encode(env),
                headers={protocol.HDR_MSG_ID: protocol.attempt_msg_id(ns, "promise-step", attempt)},
                stream=protocol.STREAM_WORK,
            )

        async def ask(fence: int) -> dict[str, Any]:
            body = {"op": "task_state", "task_id": "promise-step", "fence": fence}
            msg = await mesh.nc.request(protocol.agent_ctl(a.agent_id), json.dumps(body).encode())
            answer: dict[str, Any] = json.loads(msg.data)
            return answer

        await current(1)
        assert await ask(1) == {"task_id": "promise-step", "state": "PENDING", "fenced": True}
        await send(1)
        await eventually(lambda: a.work is not None and a.work.fenced >= 1, timeout=5)
        assert fleet.runs["promise-step"] == 0

        # The next attempt is not covered by the promise: it runs, once.
        await current(2)
        await send(2)
        await eventually(lambda: fleet.runs["promise-step"] == 1, timeout=5)
        # Asked about it now, the agent has it: a final answer, no promise.
        answer = await ask(2)
        assert answer["state"] == "SUCCEEDED" and answer["attempt"] == 2
        assert "fenced" not in answer
    await asyncio.sleep(0.3)
    assert fleet.runs["promise-step"] == 1


# --------------------------------------------------------------------------- re-submission


async def test_resubmit_with_another_spec_is_a_conflict(
    wf_hub: Hub, fleet: Fleet, wf_settings: MeshSettings
) -> None:
    ns = wf_settings.namespace
    hold = asyncio.Event()
    agent = fleet.agent("resub.a1")

    @agent.handler("wf:hold:v1")
    async def held(task: Task[Any]) -> Any:
        await hold.wait()
        return task.payload

    await agent.start()
    engine = wf_hub.workflows
    assert engine is not None
    first = [Step(capability="wf:hold:v1", payload="first")]
    second = [Step(capability="wf:hold:v1", payload="second")]
    async with Client(settings=wf_settings) as mesh:
        wf_id = await mesh.submit_fanout(first, timeout=20)
        # The same spec again: a no-op.
        assert await mesh.submit_fanout(first, timeout=20, workflow_id=wf_id) == wf_id
        # Another spec under the same id: refused with a typed error. Its submission is
        # stored (every submission has a Nats-Msg-Id of its own), and the hub refuses it too.
        conflicts = engine.conflict_total
        with pytest.raises(WorkflowConflictError) as info:
            await mesh.submit_fanout(second, timeout=20, workflow_id=wf_id)
        assert info.value.code == "REACH_WORKFLOW_CONFLICT"
        # A raw publish of the other spec, which no client checked: the hub refuses it and
        # leaves the running workflow alone.
        spec = mesh._workflow_spec("fanout", second, "all", 20, wf_id)
        await mesh.nc.jetstream().publish(
            protocol.wf_submit(ns),
            protocol.encode(spec),
            headers={protocol.HDR_MSG_ID: protocol.submit_msg_id(ns, wf_id, "other")},
        )
        await eventually(lambda: engine.conflict_total == conflicts + 2, timeout=5)
        hold.set()
        res = await mesh.workflow(wf_id, timeout=10)
        assert res.state is TaskState.SUCCEEDED
        assert res.result == ["first"]
        # Once it has finished, such a submission has its caller told at once: the finished
        # workflow's result is announced again, with its spec's digest, not the caller's.
        done = await mesh.nc.subscribe(protocol.wf_done(ns, wf_id))
        await mesh.nc.jetstream().publish(
            protocol.wf_submit(ns),
            protocol.encode(spec),
            headers={protocol.HDR_MSG_ID: protocol.submit_msg_id(ns, wf_id, "late")},
        )
        told = WorkflowResult.model_validate_json((await done.next_msg(timeout=5)).data)
        assert told.spec_digest == res.spec_digest != spec_digest(spec)
        assert told.result == ["first"]
        await eventually(lambda: engine.conflict_total == conflicts + 3, timeout=5)


async def test_a_workflow_id_stored_first_by_another_namespace_does_not_drop_a_submission(
    wf_hub: Hub, fleet: Fleet, wf_settings: MeshSettings
) -> None:
    """JetStream drops a repeat of a ``Nats-Msg-Id`` across the whole stream, and a caller
    chooses its submissions' headers. A caller of another namespace that stores the id a
    tenant's submission of ``order-1`` would have had without a nonce (``<ns>.order-1``, or the
    bare id of earlier clients) must not have that submission dropped as a repeat: its
    ``Nats-Msg-Id`` ends with a random nonce."""
    other = wf_settings.model_copy(update={"namespace": f"{wf_settings.namespace}x"})
    echo_agent(fleet, "forge.a1")
    await fleet.agents[0].start()
    steps = [Step(capability="wf:echo:v1", payload=1)]
    async with Client(settings=other) as hostile, Client(settings=wf_settings) as mesh:
        spec = hostile._workflow_spec("fanout", steps, "all", 10, "order-1")
        js = hostile.nc.jetstream()
        for forged in (f"{wf_settings.namespace}.order-1", "order-1"):
            ack = await js.publish(
                protocol.wf_submit(other.namespace),
                protocol.encode(spec),
                headers={protocol.HDR_MSG_ID: forged},
            )
            assert not ack.duplicate
        res = await mesh.fanout(steps, workflow_id="order-1", timeout=10)
        # The forged one has no agent in its namespace: ended, not left waiting for its
        # 10 s (handed back by the closing hub) for the next tests' hubs to take over.
        assert (await hostile.cancel_workflow("order-1")).final
    assert res.ok and res.result == [{"by": f"{wf_settings.namespace}.forge.a1", "in": 1}]


async def test_a_final_status_id_stored_first_by_another_agent_does_not_drop_the_real_one(
    wf_hub: Hub, fleet: Fleet, wf_settings: MeshSettings
) -> None:
    """An agent chooses the ``Nats-Msg-Id`` of the statuses it stores, on its own subject. One
    that stores the id another agent's final status of a step would have without a nonce
    (``<ns>.<task_id>#1.final``) must not have that status dropped as a repeat: it is what a
    hub taking the step over, and the agent after a restart, read back."""
    ns = wf_settings.namespace
    agent = echo_agent(fleet, "final.a1")
    await agent.start()
    js = wf_hub.nc.jetstream()
    forged = TaskStatusEvent(
        task_id="final-step", attempt=1, agent_id=f"{ns}.hostile.h1", state=TaskState.FAILED
    )
    ack = await js.publish(
        protocol.task_status(f"{ns}.hostile.h1", "final-step"),
        protocol.encode(forged),
        headers={protocol.HDR_MSG_ID: f"{ns}.final-step#1.final"},
    )
    assert not ack.duplicate
    async with Client(settings=wf_settings) as mesh:
        res = await mesh.fanout(
            [Step(agent_id=agent.agent_id, payload=1, task_id="final-step")], timeout=10
        )
    assert res.ok
    stored = await js.get_last_msg(
        protocol.STREAM_STATUS, protocol.task_status(agent.agent_id, "final-step")
    )
    event = TaskStatusEvent.model_validate_json(stored.data or b"")
    assert event.state is TaskState.SUCCEEDED and event.attempt == 1


async def test_a_spec_compares_as_the_hubs_read_it(
    wf_hub: Hub, fleet: Fleet, wf_settings: MeshSettings
) -> None:
    """A payload's NaN or infinity is sent as null, and the hubs digest what they read: the
    client compares that, not its own objects, or its own workflow, run under an id it chose,
    would come back as another spec's (``WorkflowConflictError``)."""
    echo_agent(fleet, "nan.a1", "wf:nan:v1")
    await fleet.agents[0].start()
    async with Client(settings=wf_settings) as mesh:
        steps = [Step(capability="wf:nan:v1", payload=float("nan"))]
        res = await mesh.fanout(steps, timeout=10, workflow_id="nan-own")
        assert res.ok and res.result == [{"by": fleet.agents[0].agent_id, "in": None}]
        # Submitted again, it is the same workflow: its stored result, no conflict.
        assert await mesh.fanout(steps, timeout=10, workflow_id="nan-own") == res


async def test_a_refused_spec_under_an_id_is_a_conflict_for_another_spec(
    wf_hub: Hub, wf_settings: MeshSettings
) -> None:
    """A submission the hubs refuse for what it asks (here a step naming an agent and a
    capability) is stored FAILED under its id with its spec's digest: another spec submitted
    under that id is told a conflict, not handed the refusal; the refused spec again gets it."""
    ns = wf_settings.namespace
    async with Client(settings=wf_settings) as mesh:
        bad = {
            "workflow_id": "refused-id",
            "kind": "fanout",
            "namespace": ns,
            "steps": [{"agent_id": f"{ns}.a.a1", "capability": "wf:x:v1"}],
        }
        await mesh.nc.jetstream().publish(
            protocol.wf_submit(ns),
            json.dumps(bad).encode(),
            headers={protocol.HDR_MSG_ID: f"{ns}.refused-id.n1"},
        )
        refused = await mesh.workflow("refused-id", timeout=10)
        assert refused.state is TaskState.FAILED and refused.spec_digest is not None
        assert refused.error is not None and refused.error.code == "REACH_BAD_WORKFLOW"
        with pytest.raises(WorkflowConflictError):
            await mesh.fanout(
                [Step(capability="wf:x:v1", payload=1)], workflow_id="refused-id", timeout=10
            )


async def test_two_specs_racing_for_one_id_one_runs_and_the_other_caller_is_told(
    fleet: Fleet, wf_settings: MeshSettings
) -> None:
    """Two callers submit different specs under the same chosen id while no hub takes
    submissions (a backlog, a restart): neither finds a record to compare with at submission.
    The hubs run one and refuse the other; the other's caller, waiting on the same id, gets a
    ``WorkflowConflictError`` — not the result of a workflow it did not submit."""
    agent = fleet.agent("race.a1")
    ran: list[Any] = []

    @agent.handler("wf:race:v1")
    async def race(task: Task[Any]) -> Any:
        ran.append(task.payload)
        return task.payload

    async with Hub(settings=wf_settings):  # the streams and buckets, the agent registered
        await agent.start()
    async with Client(settings=wf_settings) as a, Client(settings=wf_settings) as b:
        calls = [
            asyncio.ensure_future(
                mesh.fanout(
                    [Step(capability="wf:race:v1", payload=which)], workflow_id="race", timeout=10
                )
            )
            for mesh, which in ((a, "a"), (b, "b"))
        ]
        await asyncio.sleep(0.5)  # both stored; no record yet
        assert not any(c.done() for c in calls)
        async with Hub(settings=wf_settings):
            got = await asyncio.gather(*calls, return_exceptions=True)
    results = [g for g in got if isinstance(g, WorkflowResult)]
    conflicts = [g for g in got if isinstance(g, WorkflowConflictError)]
    assert len(results) == 1 and len(conflicts) == 1, got
    assert results[0].ok and ran == results[0].result  # the winner's step ran, once


async def test_a_result_read_after_a_reconnect_then_announced_keeps_the_client_reading(
    wf_hub: Hub, wf_settings: MeshSettings
) -> None:
    """After a reconnect the client reads the record of every workflow it waits on; a final
    one resolves the wait. Its ``.done`` arriving afterwards must not reach the resolved
    future: nats-py would resolve it again, which raises in its reader and stops it (the
    client would hear nothing more until the connection went stale)."""
    ns = wf_settings.namespace
    wf_id = "read-then-announced"
    result = WorkflowResult(workflow_id=wf_id, kind="chain", state=TaskState.SUCCEEDED)
    async with Client(settings=wf_settings) as mesh:
        kv = await mesh.nc.jetstream().key_value(protocol.KV_WORKFLOWS)
        record = WorkflowRecord(state=TaskState.SUCCEEDED, result=result)
        await kv.put(protocol.workflow_key(ns, wf_id), protocol.encode(record))
        sub, done = await mesh._done_subscription(wf_id)
        mesh._recheck_done_waits()  # what the reconnect callback does
        assert await asyncio.wait_for(done, 5) == result
        await mesh.nc.publish(protocol.wf_done(ns, wf_id), protocol.encode(result))
        await mesh.nc.flush(timeout=2)  # a PING answered: the reader still reads
        assert (await mesh.agents()) == []  # and a request gets its answer
        mesh._drop_done(done)
        with contextlib.suppress(Exception):
            await sub.unsubscribe()


async def test_the_same_workflow_id_in_two_namespaces_runs_in_both(
    wf_hub: Hub, fleet: Fleet, wf_settings: MeshSettings
) -> None:
    """Workflow ids (and so task ids) are unique within a namespace only: one chosen in two
    namespaces is two workflows. JetStream deduplicates by ``Nats-Msg-Id`` across a whole
    stream, so the ids it sees carry the namespace — else the second tenant's submission (and
    its work and statuses) would be dropped as a repeat of the first's."""
    other = wf_settings.model_copy(update={"namespace": f"{wf_settings.namespace}x"})
    echo_agent(fleet, "same.a1")
    there = Fleet(other)
    echo_agent(there, "same.a1")
    try:
        for agent in [*fleet.agents, *there.agents]:
            await agent.start()
        steps = [Step(capability="wf:echo:v1", payload=1)]
        async with Client(settings=wf_settings) as a, Client(settings=other) as b:
            first = await a.fanout(steps, workflow_id="same-id", timeout=10)
            second = await b.fanout(steps, workflow_id="same-id", timeout=10)
        assert first.ok and first.result == [{"by": f"{wf_settings.namespace}.same.a1", "in": 1}]
        assert second.ok and second.result == [{"by": f"{other.namespace}.same.a1", "in": 1}]
        assert fleet.runs == {"same-id-0": 1} and there.runs == {"same-id-0": 1}
    finally:
        await there.close()


async def test_a_step_record_moved_under_its_owner_is_resumed_at_once(
    fleet: Fleet, wf_settings: MeshSettings
) -> None:
    """A hub that lost a workflow (it woke up, or outlived its consumer through an election)
    writes a step's record; the owner's next compare-and-set on it fails. The workflow record
    is still the owner's, so nobody else would resume the workflow before the ack wait (8 s
    here): the owner hands the submission back at once, and it is resumed from the records."""
    s = wf_settings.model_copy(update={"workflow_ack_wait": 8.0})
    ns = s.namespace
    failing, tampered = asyncio.Event(), asyncio.Event()
    agent = fleet.agent("nown.a1")
    runs: list[int] = []

    @agent.handler("wf:nown:v1")
    async def flaky(task: Task[Any]) -> Any:
        runs.append(task.attempt)
        if task.attempt == 1:
            failing.set()
            await tampered.wait()
            raise TaskFailed("first attempt fails", retryable=True)
        return {"attempt": task.attempt}

    async with Hub(settings=s) as hub, Client(settings=s) as mesh:
        await agent.start()
        await eventually(lambda: agent.agent_id in hub.registry.agents)
        wf_id = await mesh.submit_fanout(
            [Step(agent_id=agent.agent_id, task_id="nown-step", retries=1)], timeout=30
        )
        await asyncio.wait_for(failing.wait(), 10)
        # What a stale hub would write: the step's record, before the owner records attempt 2.
        kv = await mesh.nc.jetstream().key_value(protocol.KV_TASKS)
        stale = TaskRecord(
            task_id="nown-step",
            workflow_id=wf_id,
            step=0,
            namespace=ns,
            attempt=1,
            agent_id=agent.agent_id,
            created_at=time.time(),
            updated_at=time.time(),
        )
        await kv.put(protocol.task_key(ns, "nown-step"), protocol.encode(stale))
        t0 = asyncio.get_running_loop().time()
        tampered.set()
        result = await mesh.workflow(wf_id, timeout=20)
        took = asyncio.get_running_loop().time() - t0
    assert result.state is TaskState.SUCCEEDED, result.model_dump_json()
    assert result.steps[0].result == {"attempt": 2}
    assert took < 5.0, f"resumed after {took:.1f} s: it waited for the ack wait"


async def test_no_stored_status_is_told_from_no_status_stream(wf_settings: MeshSettings) -> None:
    """A stored-status read that finds no message (10037) means none is stored; one that finds
    no stream (10059: a stream being recovered, or gone) knows nothing, and raises — a cancel
    deciding a step from it would otherwise drop an outcome stored in that stream."""
    async with EmbeddedNats() as server:
        settings = wf_settings.model_copy(update={"nats_url": server.url})
        async with Hub(settings=settings) as hub:
            engine = hub.workflows
            assert engine is not None
            tracker = engine._tracker
            ns, agent_id = settings.namespace, f"{settings.namespace}.none.a1"
            assert await tracker.last_status(ns, "no-such-task", agent_id) is None
            await hub.nc.jetstream().delete_stream(protocol.STREAM_STATUS)
            with pytest.raises(NotFoundError) as gone:
                await tracker.last_status(ns, "no-such-task", agent_id)
            assert gone.value.err_code == 10059
