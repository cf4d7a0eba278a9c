"""Submissions the hubs' consumer has forgotten (its ack floor passed them across a JetStream
election while they were still stored: chaos seed 84, ``node_kill``) are adopted by a hub's
sweep, on a real nats-server of the test's own. The test leaves the consumer in the state the
election left it in: its ack floor past messages still stored (``_forget``)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from nats.js import JetStreamContext

from reach_mesh import Client, MeshSettings, Step, protocol
from reach_mesh.hub import Hub, _wf_orphans
from reach_mesh.server import EmbeddedNats
from reach_mesh.workflow import WorkflowRecord

from .helpers import Fleet, echo_agent, eventually, free_port

pytestmark = pytest.mark.timeout(60)


async def _forget(js: JetStreamContext) -> None:
    """Move the hubs' consumer past every message stored now, leaving them in the stream, as
    the election did: its filter narrowed to one namespace for a moment, a message of that
    namespace taken and acked (the consumer passes every other one), its filter restored."""
    info = await js.consumer_info(protocol.STREAM_WF, protocol.CONSUMER_HUBS)
    config = info.config
    config.filter_subject = protocol.wf_submit("nobody")
    await js.add_consumer(protocol.STREAM_WF, config)
    await js.publish(protocol.wf_submit("nobody"), b"{}")
    sub = await js.pull_subscribe_bind(protocol.CONSUMER_HUBS, stream=protocol.STREAM_WF)
    (msg,) = await sub.fetch(1, timeout=5)
    await msg.ack_sync()
    await sub.unsubscribe()
    config.filter_subject = protocol.wf_submit("*")
    await js.add_consumer(protocol.STREAM_WF, config)
    info = await js.consumer_info(protocol.STREAM_WF, protocol.CONSUMER_HUBS)
    assert info.ack_floor is not None and info.num_ack_pending == 0
    stored = (await js.stream_info(protocol.STREAM_WF)).state
    assert stored.messages > 0 and info.ack_floor.stream_seq == stored.last_seq


async def test_a_submission_the_consumer_forgot_is_adopted(
    wf_settings: MeshSettings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Forgotten submissions: one no hub took (no record: a hub adopts it), one whose record
    names a hub that is gone (a live hub adopts it), one whose record names hub A, which does
    not run it (A adopts it), one whose record names hub B, alive (B adopts it, not A). Each
    ends SUCCEEDED, and their messages leave the stream."""
    monkeypatch.setattr(_wf_orphans, "ORPHAN_SWEEP_EVERY", 0.2)
    server = EmbeddedNats(tmp_path, port=free_port())
    await server.astart()
    s = wf_settings.model_copy(update={"nats_url": server.url})
    ns = s.namespace
    hub_a, hub_b = Hub(settings=s, hub_id="hub-a"), Hub(settings=s, hub_id="hub-b")
    fleet = Fleet(s)
    try:
        for hub in (hub_a, hub_b):
            await hub.start()
            engine = hub.workflows
            assert engine is not None and engine._pull is not None
            await engine._pull.stop()  # only the sweeps take submissions here
            await hub.nc.flush()
        await echo_agent(fleet, "ok.a1", "wf:ok:v1").start()
        async with Client(settings=s) as mesh:
            js = mesh.nc.jetstream()
            kv = await js.key_value(protocol.KV_WORKFLOWS)
            untaken = await mesh.submit_chain([Step(capability="wf:ok:v1")], timeout=60)
            owned: dict[str, str] = {}
            for owner in ("hub-gone", "hub-a", "hub-b"):
                steps = [Step(capability="wf:ok:v1")]
                spec = mesh._workflow_spec("chain", steps, "all", 60, None)
                ack = await js.publish(
                    protocol.wf_submit(ns),
                    protocol.encode(spec),
                    headers={
                        protocol.HDR_MSG_ID: protocol.submit_msg_id(ns, spec.workflow_id, "n")
                    },
                )
                record = WorkflowRecord(
                    spec=spec, owner=owner, submitted_at=time.time(), submission_seq=ack.seq
                )
                await kv.put(protocol.workflow_key(ns, spec.workflow_id), protocol.encode(record))
                owned[owner] = spec.workflow_id
            await _forget(js)
            assert (await mesh.workflow(untaken, timeout=15)).ok
            gone = await mesh.workflow(owned["hub-gone"], timeout=15)
            assert gone.ok and gone.hub_id in ("hub-a", "hub-b")
            assert (await mesh.workflow(owned["hub-a"], timeout=15)).hub_id == "hub-a"
            assert (await mesh.workflow(owned["hub-b"], timeout=15)).hub_id == "hub-b"

            async def stream_empty() -> bool:
                return (await js.stream_info(protocol.STREAM_WF)).state.messages == 0

            await eventually(stream_empty, timeout=10)
    finally:
        await fleet.close()
        await hub_a.close()
        await hub_b.close()
        server.stop()
