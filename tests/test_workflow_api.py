"""Durable workflows on a real nats-server: the client API (submit, result, events, resubmit),
agent restarts, malformed specs and submissions, the six status states, what a waiting step says.

Every interval is shrunk (ack waits ~1 s, backoff tens of ms) so failures play out in seconds.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from dataclasses import replace
from typing import Any

import pytest
from nats.js.errors import NotFoundError

from reach_mesh import (
    Client,
    InvalidCapabilityError,
    MeshSettings,
    MeshUnavailableError,
    RetryPolicy,
    SelectorError,
    Step,
    TaskState,
    WorkflowSpecError,
    protocol,
)
from reach_mesh.agent import Agent, Task, TaskFailed
from reach_mesh.agent._work import WorkConsumer
from reach_mesh.errors import UnknownWorkflowError
from reach_mesh.hub import Hub
from reach_mesh.hub.throttle import Pacer
from reach_mesh.models import RouteRequest, TaskEnvelope
from reach_mesh.tracing import trace_id_from_headers
from reach_mesh.workflow import TaskStatusEvent, WorkflowEvent, WorkflowSpec, validate_spec

from .helpers import Fleet, echo_agent, eventually, held_handler, status_events

pytestmark = pytest.mark.timeout(60)


async def test_submit_then_result_events_and_resubmit(
    wf_hub: Hub, fleet: Fleet, wf_settings: MeshSettings
) -> None:
    agent = echo_agent(fleet, "sub.a1", "wf:sub:v1")
    await agent.start()
    async with Client(settings=wf_settings) as mesh:
        steps = [Step(capability="wf:sub:v1", payload=i) for i in range(2)]
        wf_id = await mesh.submit_fanout(steps, workflow_id="my-wf-1")
        assert wf_id == "my-wf-1"
        res = await mesh.workflow(wf_id, timeout=10)
        assert res.state is TaskState.SUCCEEDED
        events = [ev async for ev in mesh.workflow_events(wf_id, timeout=5)]
        # Events still held when the result was stored are dropped (.done says it all): a
        # fast workflow may show .done alone. Any start names where both first attempts went;
        # any step event is an outcome; done has every step.
        assert events[-1].kind == "done" and events[-1].result is not None
        assert [
            (st.index, st.state, st.agent_id, st.decided_by) for st in events[-1].result.steps
        ] == [(i, TaskState.SUCCEEDED, agent.agent_id, 1) for i in range(2)]
        if len(events) > 1:
            assert events[0].kind == "start"
            assert events[0].first_agents == [agent.agent_id, agent.agent_id]
        steps_seen = [(e.kind, e.step, e.state, e.attempt) for e in events[1:-1]]
        assert steps_seen == [("step", s, TaskState.SUCCEEDED, 1) for _, s, _, _ in steps_seen]
        assert len({s for _, s, _, _ in steps_seen}) == len(steps_seen) <= 2
        # Same id again: a no-op, the stored answer comes back, nothing runs again.
        again = await mesh.fanout(steps, workflow_id="my-wf-1", timeout=5)
        assert again.state is TaskState.SUCCEEDED
        assert sum(fleet.runs.values()) == 2
        # And after the fact, by id.
        assert (await mesh.workflow(wf_id, timeout=1)).workflow_id == wf_id
        # Waits answered from the stored record leave no .done wait behind.
        assert not mesh._done_waits


async def test_closing_the_client_ends_its_waits_and_the_workflow_goes_on(
    wf_hub: Hub, fleet: Fleet, wf_settings: MeshSettings
) -> None:
    """A caller closing its client while it waits for results: the waits end at once with a
    typed error, not at their timeout; the workflow runs on and another client gets it."""
    steps = [Step(capability="wf:closing:v1", payload={"n": 1})]
    mesh = await Client(settings=wf_settings).connect()
    running = asyncio.create_task(mesh.fanout(steps, workflow_id="closing-1", timeout=30))
    wf_id = await mesh.submit_chain(steps, timeout=30)
    waiting = asyncio.create_task(mesh.workflow(wf_id, timeout=30))
    await asyncio.sleep(0.3)  # both wait: no agent has the capability yet
    assert not running.done() and not waiting.done()
    await mesh.close()
    for task in (running, waiting):
        with pytest.raises(MeshUnavailableError, match="client was closed"):
            await asyncio.wait_for(task, 2)
    await echo_agent(fleet, "closing.a1", "wf:closing:v1").start()
    async with Client(settings=wf_settings) as other:
        for workflow_id in ("closing-1", wf_id):
            res = await other.workflow(workflow_id, timeout=20)
            assert res.state is TaskState.SUCCEEDED, res


async def test_step_events_held_then_sent_or_dropped_for_the_result(
    fleet: Fleet, wf_settings: MeshSettings
) -> None:
    """An event waits ``workflow_event_hold``: sent when the workflow is still running then,
    dropped when the workflow's result (which says every step's outcome) is stored first. A
    released event carries the workflow's trace, as when it happened."""
    settings = wf_settings.model_copy(update={"workflow_event_hold": 0.4})
    agent = fleet.agent("hold.a1")

    @agent.handler("wf:hold:v1")
    async def hold(task: Task[Any]) -> Any:
        await asyncio.sleep(task.payload)
        return task.payload

    async with Hub(settings=settings), Client(settings=settings) as mesh:
        await agent.start()
        wf_id = "held-events-1"
        sent = await mesh.nc.subscribe(protocol.wf_event(settings.namespace, wf_id))
        # Branch 0 ends at once, branch 1 after 1.2 s: start and branch 0's event go out at
        # 0.4 s; branch 1's is still held when the result is stored, and dropped.
        await mesh.submit_fanout(
            [Step(capability="wf:hold:v1", payload=p) for p in (0, 1.2)],
            timeout=20,
            workflow_id=wf_id,
        )
        res = await mesh.workflow(wf_id, timeout=10)
        assert res.state is TaskState.SUCCEEDED and res.result == [0, 1.2]
        events = [ev async for ev in mesh.workflow_events(wf_id, timeout=5)]
        released = [await sent.next_msg(timeout=2) for _ in range(2)]
    assert res.trace_id is not None
    assert [trace_id_from_headers(m.headers) for m in released] == [res.trace_id] * 2
    assert [(e.kind, e.step, e.state) for e in events] == [
        ("start", None, TaskState.RUNNING),
        ("step", 0, TaskState.SUCCEEDED),
        ("done", None, TaskState.SUCCEEDED),
    ]
    assert events[-1].result is not None
    assert [st.state for st in events[-1].result.steps] == [TaskState.SUCCEEDED] * 2


async def test_no_event_hold_stores_every_event(fleet: Fleet, wf_settings: MeshSettings) -> None:
    """``workflow_event_hold: 0``: a fast workflow still stores start, each step, done."""
    settings = wf_settings.model_copy(update={"workflow_event_hold": 0.0})
    async with Hub(settings=settings), Client(settings=settings) as mesh:
        agent = echo_agent(fleet, "nohold.a1", "wf:nohold:v1")
        await agent.start()
        wf_id = await mesh.submit_fanout(
            [Step(capability="wf:nohold:v1", payload=i) for i in range(2)], timeout=20
        )
        assert (await mesh.workflow(wf_id, timeout=10)).state is TaskState.SUCCEEDED
        events = [ev async for ev in mesh.workflow_events(wf_id, timeout=5)]
    assert events[0].kind == "start" and events[-1].kind == "done"
    assert sorted((e.step, e.state) for e in events[1:-1]) == [
        (0, TaskState.SUCCEEDED),
        (1, TaskState.SUCCEEDED),
    ]


async def _following(mesh: Client, wf_id: str) -> tuple[asyncio.Task[None], list[WorkflowEvent]]:
    """A watch of ``wf_id``'s events in a task of its own (``workflow_events``, 15 s), and
    the events it has yielded so far, once the first (``start``) has come."""
    seen: list[WorkflowEvent] = []

    async def follow() -> None:
        async for ev in mesh.workflow_events(wf_id, timeout=15):
            seen.append(ev)

    following = asyncio.create_task(follow())
    await eventually(lambda: any(e.kind == "start" for e in seen))
    return following, seen


async def test_the_result_is_announced_not_stored_twice_and_events_follow_live(
    fleet: Fleet, wf_settings: MeshSettings
) -> None:
    """``.done`` goes out on core NATS once the record holds the result: the event stream
    keeps only events (the record is the result's one stored copy). ``workflow_events`` of a
    running workflow yields its events as they come and ends with the result all the same."""
    settings = wf_settings.model_copy(update={"workflow_event_hold": 0.0})
    agent = fleet.agent("live.a1")
    release = asyncio.Event()

    @agent.handler("wf:live:v1")
    async def wait(task: Task[Any]) -> Any:
        await release.wait()
        return task.payload

    async with Hub(settings=settings), Client(settings=settings) as mesh:
        await agent.start()
        wf_id = await mesh.submit_chain(
            [Step(capability="wf:live:v1", payload=i) for i in range(2)], timeout=20
        )
        following, seen = await _following(mesh, wf_id)
        assert not following.done()  # the workflow waits on its handler
        release.set()
        await asyncio.wait_for(following, 15)
        # Finished: its announcement is gone, its record answers (no timeout given, none hit).
        t0 = time.monotonic()
        again = await asyncio.wait_for(_events(mesh, wf_id), 10)
        assert time.monotonic() - t0 < 2.0
        assert [e.kind for e in again] == [e.kind for e in seen]
        assert again[-1].result == seen[-1].result
        js = mesh.nc.jetstream()
        info = await js.stream_info(
            protocol.STREAM_WF_EVENTS, subjects_filter=protocol.wf_all(settings.namespace, wf_id)
        )
    assert info.config.subjects == [protocol.wf_event("*", "*")]
    assert set(info.state.subjects or {}) == {protocol.wf_event(settings.namespace, wf_id)}
    assert seen[0].kind == "start" and seen[-1].kind == "done"
    assert seen[-1].result is not None and seen[-1].result.result == 1
    # Each step's outcome came as an event before the result (the second may be read from
    # the stream after the result: drained before ``done``).
    assert [(e.step, e.state) for e in seen if e.kind == "step" and e.state.final] == [
        (0, TaskState.SUCCEEDED),
        (1, TaskState.SUCCEEDED),
    ]


async def _events(mesh: Client, wf_id: str) -> list[WorkflowEvent]:
    return [ev async for ev in mesh.workflow_events(wf_id)]


async def _send_step(mesh: Client, agent: Agent, env: TaskEnvelope) -> TaskStatusEvent:
    """Publish one work message straight to ``agent``; its final status event."""
    sub = await mesh.nc.subscribe(protocol.task_status(agent.agent_id, env.task_id))
    try:
        await mesh.nc.jetstream().publish(
            protocol.work_subject(env.namespace, agent.agent_id), protocol.encode(env)
        )
        while True:
            ev = TaskStatusEvent.model_validate_json((await sub.next_msg(timeout=5)).data)
            if ev.state.final and ev.attempt == env.attempt:
                return ev
    finally:
        await sub.unsubscribe()


async def _last_status(mesh: Client, agent_id: str, task_id: str) -> TaskStatusEvent:
    raw = await mesh.nc.jetstream().get_last_msg(
        protocol.STREAM_STATUS, protocol.task_status(agent_id, task_id)
    )
    assert raw.data is not None
    return TaskStatusEvent.model_validate_json(raw.data)


async def test_agent_restart_keeps_results(
    wf_hub: Hub, fleet: Fleet, wf_settings: MeshSettings
) -> None:
    """A restarted agent rebuilds its idempotency table from its own final statuses in
    ``REACH_STATUS``: the same attempt again is answered from it, and so is a later attempt
    of a task that succeeded — the handler does not run again."""
    ns = wf_settings.namespace
    first = echo_agent(fleet, "keep.a1", "wf:keep:v1")
    await first.start()
    async with Client(settings=wf_settings) as mesh:
        res = await mesh.fanout([Step(capability="wf:keep:v1", payload=1)], timeout=10)
        task_id = res.steps[0].task_id
        stored = await _last_status(mesh, first.agent_id, task_id)
        assert stored.state is TaskState.SUCCEEDED
        await first.close()
        second = echo_agent(fleet, "keep.a1", "wf:keep:v1")
        await second.start()
        # The same attempt redelivered (a lost ack): repeated from the table, not run.
        env = TaskEnvelope(
            task_id=task_id, attempt=stored.attempt, payload=1, namespace=ns, track=True
        )
        final = await _send_step(mesh, second, env)
        assert final.state is TaskState.SUCCEEDED and final.cached
        assert final.result == {"by": first.agent_id, "in": 1}
        # Nothing is stored after the final status: a later restart still finds it.
        assert (await _last_status(mesh, first.agent_id, task_id)).state is TaskState.SUCCEEDED
        # A later attempt of the task that already succeeded: the stored result, not a run.
        env = env.model_copy(update={"attempt": 5})
        final = await _send_step(mesh, second, env)
        assert final.state is TaskState.SUCCEEDED and final.cached and final.attempt == 5
        assert final.result == {"by": first.agent_id, "in": 1}
        assert fleet.runs[task_id] == 1
        assert second.work is not None and second.work.duplicates == 1
        assert second.work.cached == 1


async def test_final_status_ids_share_no_nonce_and_a_repeat_is_stored_once(
    wf_hub: Hub, fleet: Fleet, wf_settings: MeshSettings
) -> None:
    """Each final status's ``Nats-Msg-Id`` ends with a nonce of its own: whoever reads one
    cannot derive another of the same agent's (and store it first to have that status
    dropped). The same status repeated (the same attempt redelivered) carries the same id and
    is stored once."""
    ns = wf_settings.namespace
    agent = echo_agent(fleet, "nonce.a1", "wf:nonce:v1")
    await agent.start()
    async with Client(settings=wf_settings) as mesh:
        js = mesh.nc.jetstream()
        res = await mesh.fanout(
            [
                Step(agent_id=agent.agent_id, payload=1, task_id="nonce-a"),
                Step(agent_id=agent.agent_id, payload=2, task_id="nonce-b"),
            ],
            timeout=10,
        )
        assert res.ok
        stored = {
            t: await js.get_last_msg(
                protocol.STREAM_STATUS, protocol.task_status(agent.agent_id, t)
            )
            for t in ("nonce-a", "nonce-b")
        }
        nonces = {}
        for t, raw in stored.items():
            msg_id = (raw.headers or {})[protocol.HDR_MSG_ID]
            prefix = f"{ns}.{t}#1.final."
            assert msg_id.startswith(prefix)
            nonces[t] = msg_id.removeprefix(prefix)
            assert len(nonces[t]) == 32 and int(nonces[t], 16) >= 0
        assert nonces["nonce-a"] != nonces["nonce-b"]
        # Nor from the attempt alone: another process of the same agent keys its own.
        env = TaskEnvelope(task_id="nonce-a", attempt=1, payload=1, namespace=ns, track=True)
        mine = agent.work._final_msg_id(env) if agent.work is not None else ""
        assert mine == (stored["nonce-a"].headers or {})[protocol.HDR_MSG_ID]
        twin = Agent(agent.agent_id, settings=wf_settings)
        assert WorkConsumer(twin)._final_msg_id(env) != mine
        # The same attempt again: answered from the table, its status id the same, not stored.
        final = await _send_step(mesh, agent, env)
        assert final.state is TaskState.SUCCEEDED and final.cached
        again = await js.get_last_msg(
            protocol.STREAM_STATUS, protocol.task_status(agent.agent_id, "nonce-a")
        )
        assert again.seq == stored["nonce-a"].seq
        assert fleet.runs["nonce-a"] == 1


async def test_final_status_is_the_last_event_of_its_task(
    wf_hub: Hub, fleet: Fleet, wf_settings: MeshSettings
) -> None:
    """A status said just before the final one (progress as the handler returns) is stored
    before it: the last event of the task's subject is what a restart reads back."""
    agent = fleet.agent("last.a1")

    @agent.handler("wf:last:v1")
    async def last(task: Task[Any]) -> Any:
        await task.progress({"almost": True})
        return {"done": True}

    await agent.start()
    async with Client(settings=wf_settings) as mesh:
        for i in range(5):
            env = TaskEnvelope(task_id=f"last-{i}", namespace=wf_settings.namespace, track=True)
            assert (await _send_step(mesh, agent, env)).state is TaskState.SUCCEEDED

            async def final_is_last(task_id: str = env.task_id) -> bool:
                # Subscribers see the final status as the server takes it; the stream stores
                # it a moment later (under load, after the first look: nothing stored yet). A
                # RUNNING stored after it would never turn final.
                try:
                    return (await _last_status(mesh, agent.agent_id, task_id)).state.final
                except NotFoundError:
                    return False

            await eventually(final_is_last, timeout=2)


async def test_agent_restart_keeps_failures(
    wf_hub: Hub, fleet: Fleet, wf_settings: MeshSettings
) -> None:
    """A FAILED final status read back after a restart: the same attempt is repeated from it,
    a later attempt runs again (a retry)."""
    ns = wf_settings.namespace
    runs: list[int] = []

    def failing_agent() -> Agent:
        agent = fleet.agent("fails.a1")

        @agent.handler("wf:fails:v1")
        async def fails(task: Task[Any]) -> Any:
            runs.append(task.attempt)
            if task.attempt == 1:
                raise TaskFailed("not yet")
            return {"attempt": task.attempt}

        return agent

    first = failing_agent()
    await first.start()
    async with Client(settings=wf_settings) as mesh:
        env = TaskEnvelope(task_id="keep-failed-1", payload=0, namespace=ns, track=True)
        assert (await _send_step(mesh, first, env)).state is TaskState.FAILED
        await first.close()
        second = failing_agent()
        await second.start()
        again = await _send_step(mesh, second, env)
        assert again.state is TaskState.FAILED and again.cached
        assert again.error is not None and again.error.message == "not yet"
        retry = await _send_step(mesh, second, env.model_copy(update={"attempt": 2}))
        assert retry.state is TaskState.SUCCEEDED and not retry.cached
        assert runs == [1, 2]


async def test_malformed_specs_raise_typed_errors(
    wf_hub: Hub, fleet: Fleet, wf_settings: MeshSettings
) -> None:
    async with Client(settings=wf_settings) as mesh:
        with pytest.raises(WorkflowSpecError):
            await mesh.fanout([])
        with pytest.raises(WorkflowSpecError):
            await mesh.fanout([Step(capability="a:b:v1")], policy="most")
        with pytest.raises(WorkflowSpecError):
            await mesh.fanout([Step(capability="a:b:v1")] * 3, policy="quorum(4)")
        with pytest.raises(SelectorError) as sel:
            await mesh.fanout([Step(selector="cap=a:b:v1 AND AND")])
        assert sel.value.details.get("step") == 0
        with pytest.raises(InvalidCapabilityError):
            await mesh.chain([Step(capability="not a capability")])
        with pytest.raises(WorkflowSpecError):
            await mesh.chain([Step(capability="a:b:v1", selector="cap=a:b:v1")])
        with pytest.raises(WorkflowSpecError):
            await mesh.chain([Step()])
        with pytest.raises(WorkflowSpecError):
            await mesh.chain([Step(capability="a:b:v1", timeout=-1)])
        with pytest.raises(WorkflowSpecError):
            await mesh.fanout([Step(capability="a:b:v1")] * 300)


async def test_hub_survives_malformed_submissions(
    wf_hub: Hub, fleet: Fleet, wf_settings: MeshSettings
) -> None:
    ns = wf_settings.namespace
    agent = echo_agent(fleet, "ok.a1", "wf:ok:v1")
    await agent.start()
    async with Client(settings=wf_settings) as mesh:
        js = mesh.nc.jetstream()
        subject = protocol.wf_submit(ns)
        await js.publish(subject, b"not json", headers={"Nats-Msg-Id": "garbage-1"})
        bad = {"workflow_id": "empty-1", "kind": "fanout", "steps": [], "namespace": ns}
        await js.publish(subject, json.dumps(bad).encode(), headers={"Nats-Msg-Id": "empty-1"})
        r1 = await mesh.workflow("garbage-1", timeout=5)
        assert r1.state is TaskState.FAILED and r1.error is not None
        assert r1.error.code == "REACH_BAD_REQUEST"
        r2 = await mesh.workflow("empty-1", timeout=5)
        assert r2.error is not None and r2.error.code == "REACH_BAD_WORKFLOW"
        # int() refuses over 4,300 digits with a plain ValueError: once, this submission was
        # never acked nor termed and came back forever, holding one of the hubs' ack slots.
        huge = {
            "workflow_id": "huge-1",
            "kind": "fanout",
            "steps": [{"capability": "wf:ok:v1"}],
            "policy": "quorum(" + "9" * 5000 + ")",
            "namespace": ns,
        }
        await js.publish(subject, json.dumps(huge).encode(), headers={"Nats-Msg-Id": "huge-1"})
        r3 = await mesh.workflow("huge-1", timeout=5)  # refused and termed, not redelivered
        assert r3.error is not None and r3.error.code == "REACH_BAD_WORKFLOW"
        # Ids ending in a newline passed the checks (Python's $ matches before one): the key
        # they made was refused by nats-py, taken for an infrastructure error, and the
        # submission came back every second until it expired, holding an ack slot.
        for n, body in enumerate(
            [
                {"workflow_id": "nl-1\n", "kind": "fanout", "steps": [{"capability": "wf:ok:v1"}]},
                {
                    "workflow_id": "nl-2",
                    "kind": "fanout",
                    "steps": [{"capability": "wf:ok:v1", "task_id": "t\n"}],
                },
            ],
            start=1,
        ):
            await js.publish(
                subject,
                json.dumps({**body, "namespace": ns}).encode(),
                headers={"Nats-Msg-Id": f"nl-{n}"},
            )
            got = await mesh.workflow(f"nl-{n}", timeout=5)
            assert got.state is TaskState.FAILED and got.error is not None, got
        ok = await mesh.fanout([Step(capability="wf:ok:v1")], timeout=10)
        assert ok.state is TaskState.SUCCEEDED


async def test_a_submission_whose_header_names_another_workflow_is_refused(
    wf_hub: Hub, fleet: Fleet, wf_settings: MeshSettings
) -> None:
    """A client (one written in another language) whose ``Nats-Msg-Id`` names another id
    than its body: the workflow ran under the body's id while its caller waited on the
    header's, until its timeout. It is refused under the header's id now, and nothing runs."""
    ns = wf_settings.namespace
    runs: list[int] = []
    agent = fleet.agent("hdr.a1")

    @agent.handler("wf:hdr:v1")
    async def count(task: Task[Any]) -> int:
        runs.append(1)
        return 1

    await agent.start()
    async with Client(settings=wf_settings) as mesh:
        steps = [{"capability": "wf:hdr:v1"}]
        body = {"workflow_id": "body-id", "kind": "fanout", "steps": steps, "namespace": ns}
        await mesh.nc.jetstream().publish(
            protocol.wf_submit(ns),
            json.dumps(body).encode(),
            headers={
                protocol.HDR_MSG_ID: protocol.submit_msg_id(ns, "header-id", "n0nce"),
                "traceparent": f"00-{'ab' * 16}-{'cd' * 8}-01",
            },
        )
        got = await mesh.workflow("header-id", timeout=5)
        assert got.trace_id == "ab" * 16  # the caller's trace, as a run's result has it
        assert got.state is TaskState.FAILED and got.error is not None
        assert got.error.code == "REACH_BAD_WORKFLOW", got.error
        assert got.error.details["field"] == "workflow_id"
        assert "body-id" in got.error.message
        with pytest.raises(UnknownWorkflowError):
            await mesh.inspect_workflow("body-id")
        assert runs == []
        # A header that names no valid id could hold no answer: the body's id runs.
        await mesh.nc.jetstream().publish(
            protocol.wf_submit(ns),
            json.dumps(body).encode(),
            headers={protocol.HDR_MSG_ID: f"{ns}.no such id!.n0nce"},
        )
        ran = await mesh.workflow("body-id", timeout=5)
        assert ran.state is TaskState.SUCCEEDED and runs == [1]


async def _submit_raw(mesh: Client, ns: str, wf_id: str, kind: str, steps: list[Any]) -> None:
    body = {"workflow_id": wf_id, "kind": kind, "steps": steps, "namespace": ns, "timeout": 30}
    await mesh.nc.jetstream().publish(
        protocol.wf_submit(ns), json.dumps(body).encode(), headers={"Nats-Msg-Id": wf_id}
    )


@pytest.mark.parametrize("kind", ["fanout", "chain"])
async def test_an_unknown_strategy_fails_the_workflow_at_once(
    wf_hub: Hub, fleet: Fleet, wf_settings: MeshSettings, kind: str
) -> None:
    """A step naming a strategy the router does not know was admitted, then the router's
    refusal was taken for an infrastructure error: the submission was handed back forever and
    its caller never answered. It is refused on admission now, like any malformed spec."""
    ns = wf_settings.namespace
    await echo_agent(fleet, "strat.a1", "wf:ok:v1").start()
    steps = [{"capability": "wf:ok:v1"}, {"capability": "wf:ok:v1", "strategy": "bogus"}]
    async with Client(settings=wf_settings) as mesh:
        with pytest.raises(WorkflowSpecError, match="unknown strategy 'bogus'"):
            validate_spec(
                WorkflowSpec.model_validate({"workflow_id": "w", "kind": kind, "steps": steps})
            )
        await _submit_raw(mesh, ns, f"strat-{kind}", kind, steps)
        started = time.monotonic()
        got = await mesh.workflow(f"strat-{kind}", timeout=5)
        assert time.monotonic() - started < 5
        assert got.state is TaskState.FAILED and got.error is not None
        assert got.error.code == "REACH_BAD_WORKFLOW"
        assert got.error.details["field"] == "steps.1.strategy"


@pytest.mark.parametrize("kind", ["fanout", "chain"])
async def test_a_route_the_router_refuses_fails_its_step_not_the_hub(
    wf_hub: Hub, fleet: Fleet, wf_settings: MeshSettings, kind: str, monkeypatch: Any
) -> None:
    """The second line: a step the router refuses as the caller's mistake (here a strategy
    the admission check is made to let through, as a hub of another version might) ends
    FAILED with the router's error, instead of handing the workflow back forever."""
    monkeypatch.setattr(protocol, "STRATEGY_NAMES", protocol.STRATEGY_NAMES | {"bogus"})
    ns = wf_settings.namespace
    await echo_agent(fleet, "strat.a1", "wf:ok:v1").start()
    steps = [{"capability": "wf:ok:v1"}, {"capability": "wf:ok:v1", "strategy": "bogus"}]
    async with Client(settings=wf_settings) as mesh:
        await _submit_raw(mesh, ns, f"route-{kind}", kind, steps)
        got = await mesh.workflow(f"route-{kind}", timeout=10)
    assert got.state is TaskState.FAILED and got.error is not None
    assert got.error.code == "REACH_BAD_REQUEST"
    assert "unknown strategy 'bogus'" in got.error.message
    if kind == "chain":
        assert got.steps[0].state is TaskState.SUCCEEDED
    assert got.steps[1].state is TaskState.FAILED and got.steps[1].attempts == 0


async def test_work_consumer_is_durable(fleet: Fleet, wf_settings: MeshSettings) -> None:
    """A step submitted while no agent is up waits (PENDING) and runs when one arrives."""
    async with Hub(settings=wf_settings) as _hub, Client(settings=wf_settings) as mesh:
        wf_id = await mesh.submit_fanout([Step(capability="wf:later:v1", payload=3)], timeout=20)
        await asyncio.sleep(0.3)
        agent = echo_agent(fleet, "later.a1", "wf:later:v1")
        await agent.start()
        res = await mesh.workflow(wf_id, timeout=10)
        assert res.state is TaskState.SUCCEEDED
        assert res.steps[0].result == {"by": agent.agent_id, "in": 3}


async def test_status_events_follow_the_six_states(
    wf_hub: Hub, fleet: Fleet, wf_settings: MeshSettings
) -> None:
    ns = wf_settings.namespace
    agent = fleet.agent("prog.a1")

    @agent.handler("wf:prog:v1")
    async def slow(task: Task[Any]) -> str:
        await asyncio.sleep(0.15)  # still running after 50 ms: ACCEPTED is said
        await task.progress({"pct": 50})
        await asyncio.sleep(0.5)  # > step_running_interval: RUNNING keep-alives
        return "done"

    await agent.start()
    async with Client(settings=wf_settings) as mesh:
        res = await mesh.fanout([Step(capability="wf:prog:v1")], timeout=10)
        assert res.state is TaskState.SUCCEEDED
        events = await status_events(mesh, ns, res.steps[0].task_id)
    states = [e.state for e in events]
    # A free slot: the handler starts at once, and ACCEPTED implies DELIVERED.
    assert states[:2] == [TaskState.ACCEPTED, TaskState.RUNNING]
    assert states[-1] is TaskState.SUCCEEDED and states.count(TaskState.SUCCEEDED) == 1
    assert states.count(TaskState.RUNNING) >= 2  # progress + at least one keep-alive
    assert events[1].progress == {"pct": 50}
    assert all(e.attempt == 1 and e.agent_id == agent.agent_id for e in events)


async def test_delivered_is_said_while_a_step_waits_for_a_slot(
    wf_hub: Hub, fleet: Fleet, wf_settings: MeshSettings
) -> None:
    ns = wf_settings.namespace
    release = asyncio.Event()
    agent = fleet.agent("slot.a1", max_concurrency=1)

    @agent.handler("wf:slot:v1")
    async def one_at_a_time(task: Task[Any]) -> str:
        await release.wait()
        return "done"

    await agent.start()
    async with Client(settings=wf_settings) as mesh:
        first = await mesh.submit_fanout([Step(capability="wf:slot:v1")], timeout=10)
        await eventually(lambda: agent._running == 1, timeout=5)
        second = await mesh.submit_fanout(
            [Step(capability="wf:slot:v1", task_id="slot-second")], timeout=10
        )
        await eventually(lambda: agent._waiting == 1, timeout=5)
        release.set()
        for wf_id in (first, second):
            assert (await mesh.workflow(wf_id, timeout=10)).state is TaskState.SUCCEEDED
        events = await status_events(mesh, ns, "slot-second")
    # It waited for a slot: DELIVERED; then it ran in no time: its final status implies
    # ACCEPTED, which is not said on its own.
    assert [e.state for e in events] == [TaskState.DELIVERED, TaskState.SUCCEEDED]


async def test_any_policy_stops_the_branches_it_no_longer_needs(
    hub: Hub, settings: MeshSettings, namespace: str
) -> None:
    """fanout(any): once one branch succeeds, a branch still running is cancelled on its agent
    (its handler sees CancelledError) instead of running on for nothing."""
    stopped = asyncio.Event()
    fast = Agent(f"{namespace}.any.fast", settings=settings)
    slow = Agent(f"{namespace}.any.slow", settings=settings)

    @fast.handler("any:fast:v1")
    async def quick(task: Task[Any]) -> str:
        return "fast"

    @slow.handler("any:slow:v1")
    async def crawl(task: Task[Any]) -> str:
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            stopped.set()
            raise
        return "slow"

    async with fast, slow, Client(settings=settings) as c:
        res = await c.fanout(
            [Step(capability="any:slow:v1"), Step(capability="any:fast:v1")],
            policy="any",
            timeout=20,
        )
        assert res.ok and res.steps[1].result == "fast"
        assert res.steps[0].cancelled
        await asyncio.wait_for(stopped.wait(), timeout=5)
        assert slow.inflight == 0


async def test_a_step_that_cannot_be_placed_says_why_while_it_waits(
    wf_hub: Hub, wf_settings: MeshSettings
) -> None:
    async with Client(settings=wf_settings) as mesh:
        wf_id = await mesh.submit_chain(
            [Step(capability="wf:nobody:v1", payload=1, retry=RetryPolicy(ttl=30))], timeout=30
        )
        waiting = None
        async for ev in mesh.workflow_events(wf_id, timeout=10):
            if ev.kind == "step" and ev.state is TaskState.PENDING and ev.error is not None:
                waiting = ev
                break
        # Ended, not left waiting for its 30 s (handed back by the closing hub) for the next
        # tests' hubs, which serve every namespace, to take over.
        assert (await mesh.cancel_workflow(wf_id)).final
    assert waiting is not None and waiting.step == 0
    assert waiting.error is not None and waiting.error.code == "REACH_NO_MATCH"
    assert "no routable agent for wf:nobody:v1" in waiting.error.message


async def test_waiting_for_results_leaves_no_interest_behind() -> None:
    """Each wait subscribes to its workflow's ``.done`` for one message; the server must drop
    that interest once the message is delivered (nats-py's ``max_msgs`` alone does not tell
    it), or a long-lived caller's connection collects one subscription per workflow."""
    import urllib.request

    from reach_mesh.server import EmbeddedNats

    from .helpers import free_port

    port = free_port()
    async with EmbeddedNats(http_port=port) as server:
        settings = MeshSettings(nats_url=server.url, namespace="subs")
        agent = Agent("subs.echo.a1", settings=settings)

        @agent.handler("wf:echo:v1")
        async def echo(task: Task[Any]) -> Any:
            return task.payload

        async with Hub(settings=settings), agent, Client(settings=settings) as mesh:
            for i in range(30):
                res = await mesh.fanout([Step(capability="wf:echo:v1", payload=i)], timeout=10)
                assert res.ok
            await mesh.nc.flush()
            url = f"http://127.0.0.1:{port}/connz?subs=1"
            connz = await asyncio.to_thread(lambda: json.load(urllib.request.urlopen(url)))
    (conn,) = [c for c in connz["connections"] if c.get("name") == "reach-client"]
    done = [s for s in conn.get("subscriptions_list", []) if s.endswith(".done")]
    assert done == [], done


async def test_retry_intervals_under_their_floors_run_at_the_floors(
    wf_hub: Hub, fleet: Fleet, wf_settings: MeshSettings
) -> None:
    """A spec's retry intervals pace what the hub does for the step (writes, work messages,
    re-checks): under their floors they are run at the floors — a caller cannot set the hub
    spinning — and the spec is kept as sent (a workflow an earlier hub accepted still runs)."""
    engine = wf_hub.workflows
    assert engine is not None
    spin = RetryPolicy(
        backoff_base=1e-9,
        backoff_cap=1e-9,
        pending_interval=0.001,
        deliver_timeout=0.05,
        silence_timeout=1e-6,
    )
    policy = engine._policy(Step(capability="wf:ok:v1", retry=spin).spec())
    assert (policy.base, policy.cap) == (0.01, 0.01)
    assert (policy.pending_interval, policy.deliver_timeout, policy.silence_timeout) == (
        0.1,
        0.1,
        0.1,
    )
    kept = engine._policy(
        Step(capability="wf:ok:v1", retry=RetryPolicy(pending_interval=2.0)).spec()
    )
    assert kept.pending_interval == 2.0 and kept.base == wf_settings.retry_base
    agent = echo_agent(fleet, "floor.a1", "wf:floor:v1")
    await agent.start()
    async with Client(settings=wf_settings) as mesh:
        res = await mesh.fanout([Step(capability="wf:floor:v1", retry=spin)], timeout=10)
    assert res.state is TaskState.SUCCEEDED


async def test_a_namespaces_steps_are_placed_again_at_a_bounded_pace(
    wf_hub: Hub, fleet: Fleet, wf_settings: MeshSettings
) -> None:
    """An audit's caller submitted 20 fanouts of 256 steps to a capability nobody serves,
    ``pending_interval`` at its 0.1 s floor: the hub placed each step again ten times a
    second, and another namespace's fanout(3) took 5 s instead of 6 ms. A namespace's steps
    are now placed again in turns (``REPLACE_RATE`` a second, here 20 after a burst of 10),
    while another namespace's workflow runs at once. (The rate is set low here so that a
    few steps show it.)"""
    engine = wf_hub.workflows
    assert engine is not None
    engine._replacing = Pacer(20.0, 10.0)
    tries: Counter[str] = Counter()
    choose = engine._choose

    async def counted(route: RouteRequest, ns: str, exclude: set[str]) -> Any:
        tries[ns] += 1
        return await choose(route, ns, exclude)

    engine._choose = counted  # type: ignore[method-assign]
    other = wf_settings.model_copy(update={"namespace": f"{wf_settings.namespace}x"})
    agent = echo_agent(Fleet(other), "pace.a1", "wf:pace:v1")
    await agent.start()
    spin = RetryPolicy(fast_attempts=0, pending_interval=0.1)
    try:
        async with Client(settings=wf_settings) as mesh, Client(settings=other) as theirs:
            steps = [Step(capability="wf:nobody:v1", retry=spin) for _ in range(40)]
            wf_id = await mesh.submit_fanout(steps, timeout=30)
            # All placed once and waiting (waited for, not slept: a loaded hub placing them
            # after a fixed 0.5 s counted up to 40 first placements as placed again).
            await eventually(lambda: tries[wf_settings.namespace] >= len(steps), timeout=10)
            placed = tries[wf_settings.namespace]
            t0 = time.monotonic()
            res = await theirs.fanout([Step(capability="wf:pace:v1") for _ in range(3)])
            assert res.state is TaskState.SUCCEEDED
            await asyncio.sleep(max(0.0, 2.0 - (time.monotonic() - t0)))
            again = tries[wf_settings.namespace] - placed
            await mesh.cancel_workflow(wf_id)
    finally:
        await agent.close()
    # 40 steps every 0.1 s would be about 800 in two seconds; in turns, about 40.
    assert 10 <= again <= 70, again


async def test_events_from_another_subject_are_not_the_watched_workflows(
    wf_settings: MeshSettings, fleet: Fleet
) -> None:
    """A caller's events consumer has a random name, but anyone allowed to create consumers
    on ``REACH_WF_EVENTS`` who learns it may re-create it with another filter: it then
    delivers events stored on another subject — bodies that may claim the watched workflow.
    ``workflow_events`` yields only what came on the watched workflow's own subject."""
    settings = wf_settings.model_copy(update={"workflow_event_hold": 0.0})
    ns = settings.namespace
    agent = fleet.agent("repoint.a1")
    held = held_handler(agent, "wf:repoint:v1", "done")

    async with Hub(settings=settings), Client(settings=settings) as mesh:
        await agent.start()
        wf_id = await mesh.submit_chain([Step(capability="wf:repoint:v1", payload=1)], timeout=20)
        following, seen = await _following(mesh, wf_id)
        js = mesh.nc.jetstream()
        watched = protocol.wf_event(ns, wf_id)
        (info,) = [
            c
            for c in await js.consumers_info(protocol.STREAM_WF_EVENTS)
            if c.config.filter_subject == watched
        ]
        other = protocol.wf_event(ns, "elsewhere")
        await js.add_consumer(
            protocol.STREAM_WF_EVENTS, config=replace(info.config, filter_subject=other)
        )
        forged = WorkflowEvent(
            workflow_id=wf_id, kind="step", state=TaskState.FAILED, step=0, agent_id="forged.x.y"
        )
        await js.publish(other, protocol.encode(forged))
        await asyncio.sleep(0.5)  # delivered by now, had the consumer passed it on
        held.release.set()
        await asyncio.wait_for(following, 15)
    assert [e for e in seen if e.agent_id == "forged.x.y"] == []
    assert seen[-1].kind == "done" and seen[-1].result is not None


async def test_a_workflow_whose_time_ran_out_before_a_step_was_sent_runs_nothing(
    wf_hub: Hub, fleet: Fleet, wf_settings: MeshSettings
) -> None:
    """A workflow ``timeout`` of 1e-9 s (valid: greater than 0) ended TIMEOUT, but only after
    its steps were sent: each ran on its agent, and each result was thrown away ("not
    applied: after its step was decided"). Now nothing is sent once the deadline passed."""
    agent = echo_agent(fleet, "late.a1", "wf:late:v1")
    await agent.start()
    async with Client(settings=wf_settings) as mesh:
        wf_id = await mesh.submit_fanout(
            [Step(capability="wf:late:v1", payload=i) for i in range(3)], timeout=1e-9
        )
        res = await mesh.workflow(wf_id, timeout=10)
        chain = await mesh.chain([Step(capability="wf:late:v1", payload=0)], timeout=1e-9)
    assert res.state is TaskState.TIMEOUT and chain.state is TaskState.TIMEOUT
    assert all(s.state is TaskState.TIMEOUT for s in res.steps + chain.steps)
    await asyncio.sleep(0.3)  # (a step sent would have run by now)
    assert sum(fleet.runs.values()) == 0, fleet.runs
