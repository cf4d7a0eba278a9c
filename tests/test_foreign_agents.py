"""What an agent written in another language may get wrong or do differently, on a real
nats-server: found by writing one from docs/protocol.md alone.

- A ``null`` where the field's type has none (``"duration_ms": null``) is read as the field's
  absence, as protobuf's JSON mapping reads it: the agent's result counts, in a route reply
  and in a workflow step's status event alike.
- A status event that does not validate (a wrong type) is refused loudly — counted in
  ``reach_messages_refused_total`` and logged (``REACH-MESSAGE-REFUSED``, naming the field) —
  instead of leaving its step waiting for a status that never counts, with nothing in any log.
- A reply whose serialiser put ``error`` first is still a reply (the error-body rule: an error
  body is an object whose *only* member is ``error``).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import nats
import pytest
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from reach_mesh import Client, MeshSettings, Step, TaskState, _guard, protocol
from reach_mesh._nats import refused_messages
from reach_mesh.errors import BadRequestError, HandlerError
from reach_mesh.hub import Hub
from reach_mesh.logs import MESSAGE_REFUSED, LineBudget
from reach_mesh.models import AgentCard, RegisterReply, TaskEnvelope, UnregisterRequest
from reach_mesh.workflow import TaskStatusEvent, WorkflowSpec

from .helpers import Fleet, HeldHandler, eventually, held_handler, register_by_hand

pytestmark = pytest.mark.timeout(60)


async def test_a_status_event_that_does_not_validate_is_refused_loudly(
    wf_hub: Hub,
    fleet: Fleet,
    wf_settings: MeshSettings,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A RUNNING event with ``"duration_ms": "slow"`` (the field is a number) for a step the
    hub runs is dropped, counted on the hub's connection and logged with the field
    at fault; the step's real statuses go on counting and the workflow succeeds."""
    monkeypatch.setattr(_guard._refusals, "_lines", LineBudget(30.0))  # a line is due
    async with _held_step(fleet, wf_settings, "foreign.a", {"ok": True}) as step:
        before = refused_messages(wf_hub.nc)
        with caplog.at_level(logging.WARNING, logger="reach_mesh"):
            await step.status({"state": "RUNNING", "duration_ms": "slow"})
            await eventually(lambda: refused_messages(wf_hub.nc) > before, timeout=5)
        lines = [r.getMessage() for r in caplog.records if MESSAGE_REFUSED in str(r.__dict__)]
        assert any("TaskStatusEvent" in line and "duration_ms" in line for line in lines), lines
        step.held.release.set()
        res = await step.mesh.workflow(step.workflow_id, timeout=10)
        assert res.state is TaskState.SUCCEEDED, res.error
        assert res.steps[0].result == {"ok": True}


async def test_a_status_event_with_nulls_for_absent_fields_counts(
    wf_hub: Hub, fleet: Fleet, wf_settings: MeshSettings
) -> None:
    """A final status event that writes ``null`` into fields that are not nullable
    (``duration_ms``, ``queued_ms``, ``cached``, ``error`` of a success) is the step's result
    all the same: the workflow ends SUCCEEDED with it, and nothing is refused."""
    async with _held_step(fleet, wf_settings, "nulls.a", {"from": "the handler"}) as step:
        before = refused_messages(wf_hub.nc)
        await step.status(
            {
                "state": "SUCCEEDED",
                "step": 0,
                "result": {"from": "the event", "kept": None},
                "error": None,
                "progress": None,
                "cached": None,
                "duration_ms": None,
                "queued_ms": None,
            }
        )
        res = await step.mesh.workflow(step.workflow_id, timeout=10)
        assert res.state is TaskState.SUCCEEDED, res.error
        assert res.steps[0].result == {"from": "the event", "kept": None}
        assert refused_messages(wf_hub.nc) == before
        step.held.release.set()


@dataclass
class _HeldStep:
    """A one-step workflow whose step the agent holds, and a plain connection to speak for
    the agent on, as one written in another language would."""

    mesh: Client
    nc: NATS
    agent_id: str
    workflow_id: str
    held: HeldHandler

    async def status(self, fields: dict[str, Any]) -> None:
        """Publish a status event of the held step's first attempt, with ``fields``."""
        task_id = f"{self.workflow_id}-0"
        event = {"task_id": task_id, "attempt": 1, "agent_id": self.agent_id}
        event |= {"workflow_id": self.workflow_id, **fields}
        await self.nc.publish(
            protocol.task_status(self.agent_id, task_id), json.dumps(event).encode()
        )
        await self.nc.flush()


@asynccontextmanager
async def _held_step(
    fleet: Fleet, settings: MeshSettings, name: str, result: dict[str, Any]
) -> AsyncIterator[_HeldStep]:
    cap = f"wf:{name.split('.')[0]}:v1"
    agent = fleet.agent(name)
    held = held_handler(agent, cap, result)
    await agent.start()
    assert settings.nats_url is not None
    nc = await nats.connect(settings.nats_url)
    try:
        async with Client(settings=settings) as mesh:
            wf_id = await mesh.submit_fanout([Step(capability=cap, timeout=20)], timeout=30)
            await asyncio.wait_for(held.started.wait(), 5)
            yield _HeldStep(mesh, nc, agent.agent_id, wf_id, held)
    finally:
        await nc.close()


async def test_a_reply_with_nulls_for_absent_fields_is_its_result(
    hub: Hub, settings: MeshSettings, namespace: str
) -> None:
    """A ``TaskReply`` with ``null`` in fields that are not nullable reaches the caller as the
    handler's result — not ``REACH_INTERNAL``, and no delivery failure charged to the agent."""
    agent_id = f"{namespace}.nulls.a"

    def reply(env: TaskEnvelope) -> dict[str, Any]:
        return {
            "task_id": env.task_id,
            "agent_id": agent_id,
            "attempt": env.attempt,
            "state": "SUCCEEDED",
            "result": {"echo": env.payload},
            "error": None,
            "cached": None,
            "duration_ms": None,
            "queued_ms": None,
        }

    async with _hand_agent(settings, agent_id, "keys:nulls:v1", reply):
        health = hub.registry.agents[agent_id].health
        before = health.value
        async with Client(settings=settings) as mesh:
            res = await mesh.request(capability="keys:nulls:v1", payload={"n": 1}, timeout=5)
        assert res.state is TaskState.SUCCEEDED, res.error
        assert res.result == {"echo": {"n": 1}} and not res.cached
        assert health.value >= before


async def test_a_reply_with_its_error_first_is_a_reply(
    hub: Hub, settings: MeshSettings, namespace: str
) -> None:
    """An agent whose JSON encoder writes ``error`` before ``task_id`` (keys sorted, say)
    answers FAILED: the caller gets that outcome — the handler's error, typed — and the hub
    does not take the reply for an error body of its own (``REACH_INTERNAL``, a delivery
    failure charged to the agent)."""
    agent_id = f"{namespace}.sorted.a"
    cap = "keys:sorted:v1"

    def reply(env: TaskEnvelope) -> dict[str, Any]:
        return {
            "error": {"code": "REACH_HANDLER_FAILED", "message": "no such invoice"},
            "agent_id": agent_id,
            "attempt": env.attempt,
            "state": "FAILED",
            "task_id": env.task_id,
        }

    async with _hand_agent(settings, agent_id, cap, reply) as registered:
        # What it cannot learn elsewhere (the mesh's settings, not the NATS server's).
        assert registered.max_payload == settings.max_payload
        assert registered.suspect_timeout == settings.suspect_timeout
        health = hub.registry.agents[agent_id].health
        before = health.value
        async with Client(settings=settings) as mesh:
            res = await mesh.request(capability=cap, payload={"invoice": 7}, timeout=5)
            assert res.state is TaskState.FAILED and res.agent_id == agent_id
            assert res.error is not None and res.error.code == "REACH_HANDLER_FAILED"
            with pytest.raises(HandlerError, match="no such invoice"):
                res.raise_for_error()
        assert health.value >= before  # no delivery failure charged to the agent


@asynccontextmanager
async def _hand_agent(
    settings: MeshSettings,
    agent_id: str,
    cap: str,
    reply: Callable[[TaskEnvelope], dict[str, Any]],
) -> AsyncIterator[RegisterReply]:
    """An agent written by hand on a plain connection, as one in another language is: it
    answers each task with ``reply(envelope)`` as JSON, and unregisters at the end (no ghost
    for the next test's hub)."""
    assert settings.nats_url is not None
    nc = await nats.connect(settings.nats_url)

    async def take(msg: Msg) -> None:
        env = TaskEnvelope.model_validate_json(msg.data)
        await nc.publish(msg.reply, json.dumps(reply(env)).encode())

    try:
        await nc.subscribe(protocol.agent_task(agent_id), cb=take)
        registered = await register_by_hand(nc, AgentCard(agent_id=agent_id, capabilities=[cap]))
        yield registered
        bye = UnregisterRequest(agent_id=agent_id, session=registered.session)
        await nc.request(protocol.hub_agent_subject(agent_id, "unregister"), protocol.encode(bye))
    finally:
        await nc.close()


def test_an_error_body_is_an_object_whose_only_member_is_error() -> None:
    """The rule both ways: ``{"error": …}`` alone raises its typed error; with any other
    member beside it, it is the subject's success body and raises nothing."""
    err = {"code": "REACH_NO_MATCH", "message": "nobody"}
    with pytest.raises(Exception, match="nobody") as got:
        protocol.raise_for_error(json.dumps({"error": err}).encode())
    assert getattr(got.value, "code", None) == "REACH_NO_MATCH"
    with pytest.raises(Exception, match="nobody"):  # however much whitespace comes first
        protocol.raise_for_error(b" " * 64 + json.dumps({"error": err}).encode())
    protocol.raise_for_error(json.dumps({"error": err, "task_id": "t1"}).encode())
    protocol.raise_for_error(json.dumps({"error": None, "task_id": "t1"}).encode())


def test_a_null_is_read_as_the_field_absent_and_nothing_else_is() -> None:
    """The reader's rule, field by field: a ``null`` in a field that is not nullable is its
    default, nested or not; a required field's ``null``, a ``null`` list item or a wrong type
    beside a ``null`` are refused with the error of the message as it came."""
    spec = protocol.decode(
        b'{"workflow_id":"w1","kind":"fanout","policy":null,"timeout":null,'
        b'"steps":[{"capability":"a:b:v1","timeout":null,"retry":{"retries":null},'
        b'"payload":{"kept":null}}]}',
        WorkflowSpec,
    )
    assert spec.policy == "all" and spec.steps[0].timeout == 30.0
    assert spec.steps[0].retry.retries is None and spec.steps[0].payload == {"kept": None}
    event = {"task_id": "t1", "attempt": 1, "agent_id": "a.b", "state": "SUCCEEDED"}
    held = protocol.validate_object(TaskStatusEvent.model_validate, {**event, "cached": None})
    assert held.cached is False
    refused = [
        (b'{"task_id":null,"attempt":1,"agent_id":"a.b","state":"SUCCEEDED"}', "task_id"),
        (b'{"task_id":"t1","attempt":null,"agent_id":"a.b","state":"RUNNING"}', "attempt"),
        (
            b'{"task_id":"t1","attempt":1,"agent_id":"a.b","state":"RUNNING","cached":null,'
            b'"duration_ms":"slow"}',
            "cached",
        ),
    ]
    for data, field in refused:
        with pytest.raises(BadRequestError) as got:
            protocol.decode(data, TaskStatusEvent)
        assert got.value.details["field"] == field, got.value
    with pytest.raises(BadRequestError, match=r"capabilities\.0"):
        protocol.decode(b'{"agent_id":"ns.a.b","capabilities":[null]}', AgentCard)
