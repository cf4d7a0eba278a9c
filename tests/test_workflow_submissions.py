"""A workflow runs from its own submission: a second message of its id while it runs (a
re-submission: each is stored) takes it from nobody, and its own message coming back to
a hub that refuses it (hubs of different versions or max_payloads, in a rolling change) ends
it FAILED rather than RUNNING for good — on a real mesh."""

from __future__ import annotations

import json
from typing import Any

import nats
import nats.js.errors
import pytest

from reach_mesh import Client, MeshSettings, Step, TaskState, protocol
from reach_mesh.errors import BadRequestError
from reach_mesh.hub import Hub
from reach_mesh.hub._wire import _step_envelope_bytes
from reach_mesh.models import TaskEnvelope
from reach_mesh.workflow import StepSpec, WorkflowRecord, WorkflowResult, WorkflowSpec

from .helpers import Fleet, Held, echo_agent, eventually, running

pytestmark = pytest.mark.timeout(60)


async def _record(settings: MeshSettings, wf_id: str) -> WorkflowRecord:
    nc = await nats.connect(settings.nats_url or "")
    try:
        kv = await nc.jetstream().key_value(protocol.KV_WORKFLOWS)
        entry = await kv.get(protocol.workflow_key(settings.namespace, wf_id))
        assert entry.value is not None
        return WorkflowRecord.model_validate_json(entry.value)
    finally:
        await nc.close()


async def test_a_resubmission_while_it_runs_takes_it_from_nobody(
    wf_hub: Hub, fleet: Fleet, wf_settings: MeshSettings
) -> None:
    """A re-submission is a new message (its Nats-Msg-Id has a nonce of its own; before that,
    past the dedup window): the hub that got it took the
    workflow over from its live owner (and restarted its deadline), and the owner's message,
    still in the stream, took it back later. It is dropped; the owner goes on."""
    held = await Held(fleet).start()
    engine = wf_hub.workflows
    assert engine is not None
    async with Client(settings=wf_settings) as mesh:
        wf_id = await mesh.submit_fanout([Step(capability="wf:slow:v1")], timeout=30)
        await running(mesh, wf_id)
        first = await _record(wf_settings, wf_id)
        assert first.submission_seq is not None and first.owner == wf_hub.hub_id
        run = engine._owning[(wf_settings.namespace, wf_id)][1]
        # The same spec again with no Nats-Msg-Id: stored as a new message, as after 600 s.
        assert first.spec is not None
        body = protocol.encode(first.spec)
        nc = await nats.connect(wf_settings.nats_url or "")
        try:
            js = nc.jetstream()
            ack = await js.publish(
                protocol.wf_submit(wf_settings.namespace), body, stream=protocol.STREAM_WF
            )
            assert ack.seq != first.submission_seq

            async def gone() -> bool:
                # Taken and acked (a work queue drops what is acked), not just not pulled yet.
                try:
                    await js.get_msg(protocol.STREAM_WF, ack.seq)
                except nats.js.errors.NotFoundError:
                    return True
                return False

            await eventually(gone)
        finally:
            await nc.close()
        again = await _record(wf_settings, wf_id)
        assert again.submission_seq == first.submission_seq  # not taken over by the copy
        assert engine._owning[(wf_settings.namespace, wf_id)][1] is run
        assert again.submitted_at == first.submitted_at
        held.release.set()
        result = await mesh.workflow(wf_id, timeout=10)
    assert result.ok, result
    assert held.started == 1


async def test_its_own_submission_back_at_a_hub_that_refuses_it_ends_it_failed(
    fleet: Fleet, wf_settings: MeshSettings
) -> None:
    """A hub that refuses a running workflow's own submission (here a smaller max_payload)
    termed it: the workflow stayed RUNNING with no message to resume it from, and its
    callers waited for good. It ends FAILED with the refusal, once."""
    payload: dict[str, Any] = {"blob": "x" * 4096}
    async with Client(settings=wf_settings) as mesh:
        async with Hub(settings=wf_settings):
            held = await Held(fleet).start()
            wf_id = await mesh.submit_fanout(
                [Step(capability="wf:slow:v1", payload=payload)], timeout=30
            )
            await running(mesh, wf_id)
        # The owner stopped (its submission handed back): a hub that takes less comes up.
        small = wf_settings.model_copy(update={"max_payload": 256})
        async with Hub(settings=small):
            result = await mesh.workflow(wf_id, timeout=15)
    assert result.state is TaskState.FAILED, result
    assert result.error is not None and result.error.code == "REACH_PAYLOAD_TOO_LARGE"
    record = await _record(wf_settings, wf_id)
    assert record.result is not None and record.result.state is TaskState.FAILED
    held.release.set()
    assert json.loads(result.model_dump_json())["workflow_id"] == wf_id


async def test_a_submission_with_no_trace_context_gets_one_trace(
    wf_hub: Hub, fleet: Fleet, wf_settings: MeshSettings
) -> None:
    """A submission sent with no ``traceparent`` (a client in another language) got no
    ``trace_id`` in its result or record, while the hub's ``.done`` carried a trace it had
    started for itself: the hub now starts the workflow's trace and keeps it everywhere."""
    agent = echo_agent(fleet, "tr.a1")
    await agent.start()
    ns = wf_settings.namespace
    spec = WorkflowSpec(
        workflow_id="no-trace-1",
        kind="fanout",
        steps=[StepSpec(capability="wf:echo:v1", payload=1)],
        timeout=20,
        namespace=ns,
    )
    nc = await nats.connect(wf_settings.nats_url or "")
    try:
        done = await nc.subscribe(protocol.wf_done(ns, spec.workflow_id))
        await nc.jetstream().publish(
            protocol.wf_submit(ns), protocol.encode(spec), stream=protocol.STREAM_WF
        )
        msg = await done.next_msg(timeout=15)
    finally:
        await nc.close()
    result = WorkflowResult.model_validate_json(msg.data)
    assert result.state is TaskState.SUCCEEDED
    assert result.trace_id is not None and len(result.trace_id) == 32
    assert msg.headers is not None
    assert msg.headers["traceparent"].split("-")[1] == result.trace_id
    record = await _record(wf_settings, spec.workflow_id)
    assert record.trace_id == result.trace_id


@pytest.mark.parametrize(
    "payload", [None, {"a": None, "b": [None, 1.5, 'é"x']}, 1e-7, "x", [], True, 10**30]
)
@pytest.mark.parametrize("timeout", [30.0, 0.001, 1e-5, 86400.0, 5])
@pytest.mark.parametrize("capability", [None, "bench:echo:v1"])
def test_a_steps_work_message_is_the_envelope_model_encoded(
    payload: Any, timeout: float, capability: str | None
) -> None:
    """The hub writes a step's work message directly (``_step_envelope_bytes``): the very
    bytes of the ``TaskEnvelope`` model through ``protocol.encode``, and a task id the model
    would refuse is refused."""
    env = TaskEnvelope(
        task_id="wf-1",
        attempt=2,
        capability=capability,
        payload=payload,
        namespace="ns",
        timeout=timeout,
        workflow_id="wf",
        step=1,
        track=True,
    )
    written = _step_envelope_bytes("wf-1", 2, capability, payload, "ns", timeout, "wf", 1)
    assert written == protocol.encode(env)
    with pytest.raises(BadRequestError):
        _step_envelope_bytes('a"b', 1, capability, payload, "ns", timeout, "wf", 1)
