"""Submissions the hubs' consumer has forgotten (its ack floor passed them across a JetStream
election while they were still stored: chaos seed 84, ``node_kill``) are adopted by a hub's
sweep, on a real nats-server of the test's own. The test leaves the consumer in the state the
election left it in: its ack floor past messages still stored (``_forget``)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from nats.aio.msg import Msg
from nats.js import JetStreamContext

from reach_mesh import Client, MeshSettings, Step, protocol
from reach_mesh.agent import Task
from reach_mesh.hub import Hub, _wf_orphans, _wf_reject
from reach_mesh.hub.workflows import WorkflowEngine
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
            adopted = sum(
                hub.metrics.workflow_orphans_total.labels("adopted")._value.get()
                for hub in (hub_a, hub_b)
            )
            # (Both hubs may adopt one with no owner or a gone one at once: the CAS decides.)
            assert 4 <= adopted <= 6
    finally:
        await fleet.close()
        await hub_a.close()
        await hub_b.close()
        server.stop()


async def _hubs(s: MeshSettings, *ids: str) -> list[Hub]:
    """Started hubs whose pulls are stopped: only their sweeps take submissions."""
    hubs = []
    for hub_id in ids:
        hub = Hub(settings=s, hub_id=hub_id)
        hubs.append(hub)
        await hub.start()
        engine = hub.workflows
        assert engine is not None and engine._pull is not None
        await engine._pull.stop()
        await hub.nc.flush()
    return hubs


def _sweeping_only(hub_a: Hub, hub_b: Hub, monkeypatch: pytest.MonkeyPatch) -> WorkflowEngine:
    """Hub B alive (it answers probes) but not sweeping: only hub A adopts. A's engine."""

    async def no_sweep() -> None:
        return None

    assert hub_a.workflows is not None and hub_b.workflows is not None
    monkeypatch.setattr(hub_b.workflows, "_sweep_orphans", no_sweep)
    return hub_a.workflows


@pytest.fixture
async def two_hubs(
    wf_settings: MeshSettings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[tuple[MeshSettings, WorkflowEngine]]:
    """A nats-server of the test's own, hubs A and B with their pulls stopped, only A
    sweeping (``_sweeping_only``): the settings and A's engine."""
    server = EmbeddedNats(tmp_path, port=free_port())
    await server.astart()
    s = wf_settings.model_copy(update={"nats_url": server.url})
    hub_a, hub_b = await _hubs(s, "hub-a", "hub-b")
    try:
        yield s, _sweeping_only(hub_a, hub_b, monkeypatch)
    finally:
        await hub_a.close()
        await hub_b.close()
        server.stop()


async def _submit_owned(
    mesh: Client, js: JetStreamContext, owner: str, cap: str, submission_seq: int | None = None
) -> str:
    """A chain submission with a record naming ``owner``, running from ``submission_seq``
    (this message's own by default), as a hub that took it would have written."""
    ns = mesh.settings.namespace
    spec = mesh._workflow_spec("chain", [Step(capability=cap)], "all", 60, None)
    ack = await js.publish(
        protocol.wf_submit(ns),
        protocol.encode(spec),
        headers={protocol.HDR_MSG_ID: protocol.submit_msg_id(ns, spec.workflow_id, "n")},
    )
    record = WorkflowRecord(
        spec=spec,
        owner=owner,
        submitted_at=time.time(),
        submission_seq=ack.seq if submission_seq is None else submission_seq,
    )
    kv = await js.key_value(protocol.KV_WORKFLOWS)
    await kv.put(protocol.workflow_key(ns, spec.workflow_id), protocol.encode(record))
    return spec.workflow_id


async def test_forgotten_submissions_refused_or_run_from_another_message_are_deleted(
    wf_settings: MeshSettings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A forgotten submission the engine refuses, or finds its workflow run from another
    message, ends as a delivered one would — refused with a FAILED result, or dropped — and
    leaves the stream, adopted once: a malformed spec that names an id (its caller gets the
    refusal), a body that is not JSON (nobody to answer), a re-submission of a workflow whose
    record runs from another message."""
    monkeypatch.setattr(_wf_orphans, "ORPHAN_SWEEP_EVERY", 0.2)
    server = EmbeddedNats(tmp_path, port=free_port())
    await server.astart()
    s = wf_settings.model_copy(update={"nats_url": server.url})
    ns = s.namespace
    (hub,) = await _hubs(s, "hub-a")
    try:
        async with Client(settings=s) as mesh:
            js = mesh.nc.jetstream()
            await js.publish(
                protocol.wf_submit(ns),
                b'{"workflow_id": "wf-bad-1", "kind": "chain"}',
                headers={protocol.HDR_MSG_ID: protocol.submit_msg_id(ns, "wf-bad-1", "n")},
            )
            await js.publish(protocol.wf_submit(ns), b"not json")
            elsewhere = await _submit_owned(mesh, js, "hub-gone", "wf:ok:v1", submission_seq=1)
            await _forget(js)
            bad = await mesh.workflow("wf-bad-1", timeout=15)
            assert not bad.ok and bad.error is not None
            assert bad.error.code == "REACH_BAD_REQUEST"  # as a delivered one's

            async def stream_empty() -> bool:
                return (await js.stream_info(protocol.STREAM_WF)).state.messages == 0

            await eventually(stream_empty, timeout=10)
            engine = hub.workflows
            assert engine is not None
            await asyncio.sleep(1.0)  # five sweeps more: nothing adopted again
            assert engine.orphans_adopted == 3
            record = await engine._workflow_at_leader(ns, elsewhere)
            assert record is not None
            assert WorkflowRecord.model_validate_json(record[0]).owner == "hub-gone"
    finally:
        await hub.close()
        server.stop()


async def test_forgotten_submissions_of_a_live_owner_or_handed_back_stay(
    two_hubs: tuple[MeshSettings, WorkflowEngine], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two forgotten submissions this hub cannot parse, each naming a workflow whose record
    says it runs: one whose owner, hub B, is alive (left to B — never refused over B's run),
    and one whose record names this hub but not the message it runs from (refused submissions
    of it are handed back for later, as delivered ones are: here for 2 s). Both stay in the
    stream; the handed-back one is adopted again once its 2 s have passed, not before, and is
    counted as forgotten once."""
    monkeypatch.setattr(_wf_orphans, "ORPHAN_SWEEP_EVERY", 0.2)
    monkeypatch.setattr(_wf_reject, "_REFUSED_RUNNING_DELAY", 2.0)
    s, engine = two_hubs
    ns = s.namespace
    runs: list[float] = []  # when hub A ran an adopted submission (its pull is stopped)
    own = engine._own

    async def counted(msg: Msg) -> None:
        runs.append(time.monotonic())
        await own(msg)

    monkeypatch.setattr(engine, "_own", counted)
    async with Client(settings=s) as mesh:
        js = mesh.nc.jetstream()
        kv = await js.key_value(protocol.KV_WORKFLOWS)
        for wf_id, owner, own_seq in (
            ("wf-live-1", "hub-b", True),
            ("wf-held-1", "hub-a", False),
        ):
            ack = await js.publish(
                protocol.wf_submit(ns),
                b'{"workflow_id": "%s", "kind": "chain"}' % wf_id.encode(),
                headers={protocol.HDR_MSG_ID: protocol.submit_msg_id(ns, wf_id, "n")},
            )
            record = WorkflowRecord(
                owner=owner,
                submitted_at=time.time(),
                submission_seq=ack.seq if own_seq else None,
            )
            await kv.put(protocol.workflow_key(ns, wf_id), protocol.encode(record))
        await _forget(js)

        async def adopted() -> bool:
            return engine.orphans_adopted > 0

        await eventually(adopted, timeout=10)
        await asyncio.sleep(1.0)  # five sweeps more, within the 2 s
        assert (await js.stream_info(protocol.STREAM_WF)).state.messages == 2
        assert len(runs) == 1

        async def adopted_again() -> bool:
            return len(runs) > 1

        await eventually(adopted_again, timeout=5)
        assert runs[1] - runs[0] >= 2.0
        assert (await js.stream_info(protocol.STREAM_WF)).state.messages == 2
        assert engine.orphans_adopted == 1
        assert engine._metrics is not None
        assert engine._metrics.workflow_orphans_total.labels("adopted")._value.get() == 1
        for wf_id, owner in (("wf-live-1", "hub-b"), ("wf-held-1", "hub-a")):
            got = await engine._workflow_at_leader(ns, wf_id)
            assert got is not None
            held = WorkflowRecord.model_validate_json(got[0])
            assert held.owner == owner and held.result is None, held


async def test_sweeps_go_on_where_the_last_stopped_within_the_hubs_concurrency(
    wf_settings: MeshSettings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A sweep looks at two messages here: three forgotten submissions of a live hub that
    does not sweep stand in front of two no hub took; the sweeps go on behind them. The
    adopted runs count against ``workflow_concurrency`` (1): one at a time, counted as
    running. An owner that does not answer is gone only when silent twice an ack wait apart."""
    monkeypatch.setattr(_wf_orphans, "ORPHAN_SWEEP_EVERY", 0.2)
    monkeypatch.setattr(_wf_orphans, "_SWEEP_MAX", 2)
    server = EmbeddedNats(tmp_path, port=free_port())
    await server.astart()
    s = wf_settings.model_copy(update={"nats_url": server.url, "workflow_concurrency": 1})
    ns = s.namespace
    hub_a, hub_b = await _hubs(s, "hub-a", "hub-b")
    engine = _sweeping_only(hub_a, hub_b, monkeypatch)
    fleet = Fleet(s)
    agent = fleet.agent("slow.a1")

    @agent.handler("wf:slow:v1")
    async def slow(task: Task[Any]) -> Any:
        await asyncio.sleep(1.5)
        return {"in": task.payload}

    try:
        await agent.start()
        async with Client(settings=s) as mesh:
            js = mesh.nc.jetstream()
            for _ in range(3):
                await _submit_owned(mesh, js, "hub-b", "wf:slow:v1")
            first = await mesh.submit_chain([Step(capability="wf:slow:v1")], timeout=60)
            second = await mesh.submit_chain([Step(capability="wf:slow:v1")], timeout=60)
            await _forget(js)

            async def adopted() -> bool:
                return engine.orphans_adopted > 0

            await eventually(adopted, timeout=10)
            await asyncio.sleep(0.6)  # three sweeps: the other one waits for room
            assert engine.orphans_adopted == 1 and engine.running == 1
            assert (await mesh.workflow(first, timeout=15)).hub_id == "hub-a"
            assert (await mesh.workflow(second, timeout=15)).hub_id == "hub-a"
            assert engine.orphans_adopted == 2

            # The owner probe: silent once is not gone, however long the sweep that asked
            # lasts (one probe an owner and sweep); silent again an ack wait later is.
            probed: dict[str, tuple[bool, float]] = {}
            assert not await engine._gone(ns, "hub-gone", probed)
            await asyncio.sleep(s.workflow_ack_wait)
            assert not await engine._gone(ns, "hub-gone", probed)
            assert await engine._gone(ns, "hub-gone", {})
            assert not await engine._gone(ns, "hub-b", {})
    finally:
        await fleet.close()
        await hub_a.close()
        await hub_b.close()
        server.stop()


async def test_a_failed_sweep_goes_on_where_it_failed_and_old_silences_are_forgotten(
    two_hubs: tuple[MeshSettings, WorkflowEngine], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A sweep cut short by a JetStream error (a read of the stream that times out) leaves
    its cursor at the message it could not read: the next sweep starts there, not at the
    stream's start nor past it. An owner found silent is asked again at each sweep, forgotten
    once no forgotten submission has named it for ``_SILENCE_KEPT`` seconds; one that answers
    is forgotten at once."""
    s, engine = two_hubs
    ns = s.namespace
    async with Client(settings=s) as mesh:
        js = mesh.nc.jetstream()
        # Three forgotten submissions of hub B, alive: each sweep reads them and leaves them.
        for _ in range(3):
            await _submit_owned(mesh, js, "hub-b", "wf:ok:v1")
        await _forget(js)
        await asyncio.sleep(2 * s.workflow_ack_wait + 0.1)  # none "submitted lately"
        first_seq = (await js.stream_info(protocol.STREAM_WF)).state.first_seq
        read_at: list[int] = []
        get_msg = engine._js.get_msg
        fail_at = {2}  # the second read of the next sweep times out

        async def reading(*args: Any, **kwargs: Any) -> Any:
            read_at.append(kwargs["seq"])
            if len(read_at) in fail_at:
                raise TimeoutError
            return await get_msg(*args, **kwargs)

        monkeypatch.setattr(engine._js, "get_msg", reading)
        with pytest.raises(TimeoutError):
            await engine._sweep_orphans()
        assert read_at == [1, first_seq + 1]
        assert engine._sweep_from == first_seq + 1  # where it failed
        fail_at.clear()
        read_at.clear()
        await engine._sweep_orphans()
        assert read_at[0] == first_seq + 1  # went on from there
        assert engine._sweep_from == 1  # past the floor: the next sweep starts over
        assert engine.orphans_adopted == 0  # hub B's, alive
        assert (await js.stream_info(protocol.STREAM_WF)).state.messages == 3

    # Silent owners: asked again at each sweep's probe, forgotten when no longer named.
    assert not await engine._gone(ns, "hub-gone", {})
    assert "hub-gone" in engine._silent
    probed = await engine._probe_silent()
    assert probed["hub-gone"][0] is False and "hub-gone" in engine._silent
    monkeypatch.setattr(_wf_orphans, "_SILENCE_KEPT", 0.2)
    await asyncio.sleep(0.3)
    assert await engine._probe_silent() == {}
    assert engine._silent == {}
    # An owner taken for silent that answers now (back from a reconnect): forgotten.
    engine._silent["hub-b"] = (0.0, asyncio.get_running_loop().time(), ns)
    probed = await engine._probe_silent()
    assert probed["hub-b"][0] is True and engine._silent == {}
