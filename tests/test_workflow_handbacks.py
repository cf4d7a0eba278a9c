"""A workflow its hub handed back that the hubs' consumer never delivers again is adopted by
that hub from its records (``HandBacks``), on a real nats-server of the test's own.

The server's side is what a new leader of ``REACH_WF`` did at an election (nats-server 2.15.1,
chaos): the handed-back submission deleted, unacked, before the ``nak`` reached it — or, in
the variant, the ``nak`` lost while the message stays stored and no hub pulls it again."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from nats.aio.msg import Msg

from reach_mesh import Client, MeshSettings, Step, protocol
from reach_mesh._retry import RetriesExhausted
from reach_mesh.hub import Hub
from reach_mesh.hub._wf_orphans import _Adopted
from reach_mesh.hub.workflows import WorkflowEngine
from reach_mesh.models import TaskState
from reach_mesh.server import EmbeddedNats

from .helpers import Fleet, Held, echo_agent, eventually, free_port

pytestmark = pytest.mark.timeout(60)

_CAP = "wf:handback:v1"


@pytest.fixture
async def one_hub(
    wf_settings: MeshSettings, tmp_path: Path
) -> AsyncIterator[tuple[MeshSettings, Hub, Fleet]]:
    """A nats-server of the test's own, one hub and an echo agent of ``_CAP``."""
    server = EmbeddedNats(tmp_path, port=free_port())
    await server.astart()
    s = wf_settings.model_copy(update={"nats_url": server.url})
    hub = Hub(settings=s, hub_id="hub-a")
    fleet = Fleet(s)
    try:
        await hub.start()
        await echo_agent(fleet, "echo.a1", _CAP).start()
        yield s, hub, fleet
    finally:
        await fleet.close()
        await hub.close()
        server.stop()


def _hand_back_once(
    engine: WorkflowEngine,
    monkeypatch: pytest.MonkeyPatch,
    on_nak: Callable[[Msg, Callable[..., Awaitable[None]], float | None], Awaitable[None]],
) -> list[int]:
    """The first run's final write outlives its retries (an outage: ``_own`` hands the
    workflow back, its step done), and that delivery's ``nak`` goes through ``on_nak``
    (the message, its real ``nak``, the delay). Returns the stream sequences handed back."""
    store, own = engine._store, engine._own
    failed: list[bool] = []
    handed: list[int] = []

    async def flaky_store(wf: Any, result: Any) -> Any:
        if not failed:
            failed.append(True)
            raise RetriesExhausted(f"write {wf.id}: timed out")
        return await store(wf, result)

    async def owning(msg: Msg) -> None:
        if not handed and not isinstance(msg, _Adopted):  # (a delivery)
            real = msg.nak

            async def nak(delay: float | None = None) -> None:
                handed.append(msg.metadata.sequence.stream)
                await on_nak(msg, real, delay)

            monkeypatch.setattr(msg, "nak", nak)
        await own(msg)

    monkeypatch.setattr(engine, "_store", flaky_store)
    monkeypatch.setattr(engine, "_own", owning)
    return handed


async def _run_handed_back(
    s: MeshSettings, hub: Hub, fleet: Fleet, handed: list[int], caplog: pytest.LogCaptureFixture
) -> None:
    """Submit a one-step chain; check it ends SUCCEEDED after its hand-back, its step run
    once, adopted and told once, and its submission gone from the stream."""
    engine = hub.workflows
    assert engine is not None and hub.metrics is not None
    caplog.set_level(logging.INFO, logger="reach_mesh.hub.workflows")
    async with Client(settings=s) as mesh:
        wf_id = await mesh.submit_chain([Step(capability=_CAP, payload=7)], timeout=60)
        # Past 3 ack waits and a keepalive tick after the hand-back (1 + 2 ack waits).
        res = await mesh.workflow(wf_id, timeout=4 + 3 * s.workflow_ack_wait)
        assert handed, "the workflow was not handed back"
        assert res.state is TaskState.SUCCEEDED, res
        assert res.steps[0].result == {"by": fleet.agents[0].agent_id, "in": 7}
        assert sum(fleet.runs.values()) == 1  # its step ran once: resumed, not run again
        lines = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        adopted = [m for m in lines if "not delivered again since: adopted" in m]
        assert len(adopted) == 1 and wf_id in adopted[0], lines
        assert engine.orphans_adopted == 1
        assert hub.metrics.workflow_orphans_total.labels("adopted")._value.get() == 1
        assert engine._handed == {}
        js = mesh.nc.jetstream()

        async def stream_empty() -> bool:
            return (await js.stream_info(protocol.STREAM_WF)).state.messages == 0

        await eventually(stream_empty, timeout=5)


async def test_a_hand_back_the_server_deleted_is_adopted_from_the_records(
    one_hub: tuple[MeshSettings, Hub, Fleet],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The handed-back submission is deleted from the stream before its ``nak`` (what the
    new stream leader did): never delivered again, not stored for the orphan sweep. The hub
    adopts the workflow from a submission rebuilt from its records, under the record's
    ``submission_seq``; it ends SUCCEEDED, its step run once."""
    s, hub, fleet = one_hub
    engine = hub.workflows
    assert engine is not None

    async def deleted_first(
        msg: Msg, nak: Callable[..., Awaitable[None]], delay: float | None
    ) -> None:
        await engine._js.delete_msg(protocol.STREAM_WF, msg.metadata.sequence.stream)
        await nak(delay=delay)

    handed = _hand_back_once(engine, monkeypatch, deleted_first)
    await _run_handed_back(s, hub, fleet, handed, caplog)


async def test_a_hand_back_whose_nak_was_lost_is_adopted_from_the_stored_message(
    one_hub: tuple[MeshSettings, Hub, Fleet],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The ``nak`` is lost and no hub pulls again (the hub's pull stopped): the submission
    stays stored, unacked, never delivered again. The hub adopts the workflow from the stored
    message, and deletes it once the result is stored."""
    s, hub, fleet = one_hub
    engine = hub.workflows
    assert engine is not None and engine._pull is not None
    pull = engine._pull

    async def lost(msg: Msg, nak: Callable[..., Awaitable[None]], delay: float | None) -> None:
        await pull.stop()

    handed = _hand_back_once(engine, monkeypatch, lost)
    await _run_handed_back(s, hub, fleet, handed, caplog)


async def test_a_delivery_of_an_adopted_submission_stops_the_adopted_run(
    one_hub: tuple[MeshSettings, Hub, Fleet], caplog: pytest.LogCaptureFixture
) -> None:
    """The hub adopts a submission (as from a hand-back not delivered again), and the
    consumer then delivers that submission to it after all (chaos seed 182, ``partition``):
    the delivered run takes the workflow over from the adopted one by CAS — the record names
    the same hub — and the adopted run stops then, not at its next write: one run of the
    workflow on the hub, its step run once, the result stored once."""
    s, hub, fleet = one_hub
    engine = hub.workflows
    assert engine is not None and engine._pull is not None
    held = await Held(fleet).start()
    await engine._pull.stop()  # the submission waits in the consumer, delivered by the test
    caplog.set_level(logging.INFO, logger="reach_mesh.hub.workflows")
    async with Client(settings=s) as mesh:
        js = mesh.nc.jetstream()
        wf_id = await mesh.submit_chain([Step(capability="wf:slow:v1")], timeout=60)
        raw = await js.get_msg(
            protocol.STREAM_WF, seq=1, subject=protocol.wf_submit(s.namespace), next=True
        )
        engine._start_adopted(raw, s.namespace)
        await eventually(lambda: held.started == 1, timeout=10)
        (adopted,) = engine._adopting.values()

        consumer = await js.pull_subscribe_bind(protocol.CONSUMER_HUBS, protocol.STREAM_WF)
        (delivered,) = await consumer.fetch(1, timeout=10)
        engine._on_submit(delivered)
        await eventually(lambda: engine.takeover_total == 1, timeout=10)
        # The adopted run stops with the takeover, while the step is still running.
        await eventually(adopted.done, timeout=5)
        assert held.started == 1 and held.finished == 0
        assert not engine._adopting and len(engine._running) == 1
        assert engine.owned == [(s.namespace, wf_id)]

        held.release.set()
        res = await mesh.workflow(wf_id, timeout=20)
        assert res.state is TaskState.SUCCEEDED, res
        assert res.steps[0].result == "done"
        assert held.started == 1 and held.finished == 1
        assert engine.workflows_done == 1
        lines = [r.getMessage() for r in caplog.records]
        assert any("another run of it on this hub" in m for m in lines), lines

        async def stream_empty() -> bool:
            return (await js.stream_info(protocol.STREAM_WF)).state.messages == 0

        await eventually(stream_empty, timeout=5)  # the delivered run acked it


async def test_a_hand_back_delivered_again_is_not_adopted_before_its_run_takes_it(
    one_hub: tuple[MeshSettings, Hub, Fleet], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The hub handed a workflow back and the consumer delivered it again: a run of it is on
    the hub, though not yet in ``_owning`` (its compare-and-set not made yet). The hand-back
    check must leave it to that run, not adopt a second run of the same workflow."""
    s, hub, fleet = one_hub
    engine = hub.workflows
    assert engine is not None
    go = asyncio.Event()
    delivered: list[int] = []

    async def quick(msg: Msg, nak: Callable[..., Awaitable[None]], delay: float | None) -> None:
        await nak(delay=0.1)

    handed = _hand_back_once(engine, monkeypatch, quick)
    own = engine._own

    async def held_again(msg: Msg) -> None:
        if handed and not isinstance(msg, _Adopted):
            delivered.append(msg.metadata.sequence.stream)
            await go.wait()  # delivered again, its run not started yet
        await own(msg)

    monkeypatch.setattr(engine, "_own", held_again)
    async with Client(settings=s) as mesh:
        wf_id = await mesh.submit_chain([Step(capability=_CAP, payload=7)], timeout=60)
        await eventually(lambda: delivered == handed and bool(handed), timeout=10)
        key = (s.namespace, wf_id)
        wf, _ = engine._handed[key]
        # Old enough to be adopted (past the delivery it waits for, not yet forgotten).
        since = asyncio.get_running_loop().time() - (1.5 + 2 * s.workflow_ack_wait)
        engine._handed[key] = (wf, since)
        await engine._check_hand_backs()
        assert engine.orphans_adopted == 0 and not engine._adopting
        assert key not in engine._handed  # left to the delivered run
        go.set()
        res = await mesh.workflow(wf_id, timeout=20)
        assert res.state is TaskState.SUCCEEDED, res
        assert sum(fleet.runs.values()) == 1
        assert engine.orphans_adopted == 0
