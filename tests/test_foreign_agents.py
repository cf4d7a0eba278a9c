"""What an agent written in another language may get wrong or do differently, on a real
nats-server: found by writing one from docs/protocol.md alone.

- A status event that does not validate (a ``null`` where the field's type has none) is
  refused loudly — counted in ``reach_messages_refused_total`` and logged
  (``REACH-MESSAGE-REFUSED``, naming the field) — instead of leaving its step waiting for a
  status that never counts, with nothing in any log.
- A reply whose serialiser put ``error`` first is still a reply (the error-body rule: an error
  body is an object whose *only* member is ``error``).
"""

from __future__ import annotations

import asyncio
import json
import logging

import nats
import pytest
from nats.aio.msg import Msg

from reach_mesh import Client, MeshSettings, Step, TaskState, _guard, protocol
from reach_mesh._nats import refused_messages
from reach_mesh.errors import HandlerError
from reach_mesh.hub import Hub
from reach_mesh.logs import MESSAGE_REFUSED, LineBudget
from reach_mesh.models import AgentCard, TaskEnvelope, UnregisterRequest

from .helpers import Fleet, eventually, held_handler, register_by_hand

pytestmark = pytest.mark.timeout(60)


async def test_a_status_event_that_does_not_validate_is_refused_loudly(
    wf_hub: Hub,
    fleet: Fleet,
    wf_settings: MeshSettings,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A RUNNING event with ``"duration_ms": null`` (the field is a number, never null) for a
    step the hub runs is dropped, counted on the hub's connection and logged with the field
    at fault; the step's real statuses go on counting and the workflow succeeds."""
    monkeypatch.setattr(_guard._refusals, "_lines", LineBudget(30.0))  # a line is due
    cap = "wf:foreign:v1"
    agent = fleet.agent("foreign.a")
    held = held_handler(agent, cap, {"ok": True})
    await agent.start()
    assert wf_settings.nats_url is not None
    nc = await nats.connect(wf_settings.nats_url)
    try:
        async with Client(settings=wf_settings) as mesh:
            wf_id = await mesh.submit_fanout([Step(capability=cap, timeout=20)], timeout=30)
            await asyncio.wait_for(held.started.wait(), 5)
            before = refused_messages(wf_hub.nc)
            bad = {
                "task_id": f"{wf_id}-0",
                "attempt": 1,
                "agent_id": agent.agent_id,
                "state": "RUNNING",
                "workflow_id": wf_id,
                "duration_ms": None,
            }
            with caplog.at_level(logging.WARNING, logger="reach_mesh"):
                await nc.publish(
                    protocol.task_status(agent.agent_id, f"{wf_id}-0"), json.dumps(bad).encode()
                )
                await nc.flush()
                await eventually(lambda: refused_messages(wf_hub.nc) > before, timeout=5)
            lines = [r.getMessage() for r in caplog.records if MESSAGE_REFUSED in str(r.__dict__)]
            assert any("TaskStatusEvent" in line and "duration_ms" in line for line in lines), lines
            held.release.set()
            res = await mesh.workflow(wf_id, timeout=10)
            assert res.state is TaskState.SUCCEEDED, res.error
            assert res.steps[0].result == {"ok": True}
    finally:
        await nc.close()


async def test_a_reply_with_its_error_first_is_a_reply(
    hub: Hub, settings: MeshSettings, namespace: str
) -> None:
    """An agent whose JSON encoder writes ``error`` before ``task_id`` (keys sorted, say)
    answers FAILED: the caller gets that outcome — the handler's error, typed — and the hub
    does not take the reply for an error body of its own (``REACH_INTERNAL``, a delivery
    failure charged to the agent)."""
    assert settings.nats_url is not None
    agent_id = f"{namespace}.sorted.a"
    cap = "keys:sorted:v1"
    nc = await nats.connect(settings.nats_url)

    async def take(msg: Msg) -> None:
        env = TaskEnvelope.model_validate_json(msg.data)
        reply = {
            "error": {"code": "REACH_HANDLER_FAILED", "message": "no such invoice"},
            "agent_id": agent_id,
            "attempt": env.attempt,
            "state": "FAILED",
            "task_id": env.task_id,
        }
        await nc.publish(msg.reply, json.dumps(reply).encode())

    try:
        await nc.subscribe(protocol.agent_task(agent_id), cb=take)
        registered = await register_by_hand(nc, AgentCard(agent_id=agent_id, capabilities=[cap]))
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
        bye = UnregisterRequest(
            agent_id=agent_id, session=registered.session
        )  # (no ghost for the next)
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
