"""A hub whose event loop stalls for longer than the workflow ack wait cannot renew its
submissions (``+WPI``): nats-server hands a running workflow's submission to another hub,
which takes the workflow over. The stalled hub's keepalive notices its own lateness when the
loop runs again (``WorkflowEngine._keepalive``'s clock check) and asks the records of what it
runs (``_stop_lost_runs``): it stops the run it lost. Otherwise its ``+WPI`` on its older
delivery would go on renewing the submission (nats-server takes it for the message's), and a
new owner that died would leave the workflow unresumed.

tests/test_workflows.py::test_a_hub_that_lost_a_workflow_while_paused_stops_keeping_its_submission
calls ``_stop_lost_runs`` itself; here the keepalive's lateness trigger does. Hub A runs on an
event loop of its own, in a thread, so that a blocking call stalls A alone while nats-server,
the agent and the other hubs (on the test's loop) go on."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Iterator
from typing import Any, TypeVar

import pytest

from reach_mesh import Client, MeshSettings, MeshUnavailableError, Step, TaskState, protocol
from reach_mesh._nats import flushed
from reach_mesh.hub import Hub

from .helpers import Fleet, LoopThread, a_server_of_its_own, eventually, held_handler

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def nats_url() -> Iterator[str]:
    """A server of this module's own: its tests count what their hubs own, take over, renew
    and leave unacked on the hubs' one submissions consumer, which serves every namespace. On
    the worker's shared server, a workflow another test left running (its hub closed: the
    submission handed back, its deadline not reached) is taken over by these hubs too."""
    yield from a_server_of_its_own()


T = TypeVar("T")

_TAKEN_OVER = "was taken over by hub hub-b while this hub could not keep it"


async def closed_on(side: LoopThread, hub: Hub | None) -> None:
    """Close ``hub`` on the side loop it runs on, then that loop."""
    try:
        if hub is not None:
            await side.run(hub.close())
    finally:
        side.close()


async def started_hub(settings: MeshSettings, hub_id: str) -> Hub:
    """A started hub (on the loop that runs this: the side loop, stalled by the tests)."""
    hub = Hub(settings=settings, hub_id=hub_id)
    await hub.start()
    return hub


@pytest.mark.parametrize("first_read_fails", [False, True])
async def test_a_hub_whose_loop_stalled_past_the_ack_wait_stops_the_run_it_lost(
    fleet: Fleet,
    wf_settings: MeshSettings,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
    first_read_fails: bool,
) -> None:
    """A runs a chain whose step is held; A's loop stalls; B takes the workflow over from the
    redelivered submission. A's keepalive, late, finds the record names B and stops its run
    (its log says so). Then B dies: the submission comes back — A no longer renews it — and
    hub C resumes the workflow and finishes it. ``first_read_fails``: the late tick cannot
    read the record (JetStream still recovering): the next tick, no longer late, asks again."""
    caplog.set_level(logging.WARNING, logger="reach_mesh.hub.workflows")
    ns = wf_settings.namespace
    key = (ns, "")
    agent = fleet.agent("late.x")
    held = held_handler(agent, "wf:late:v1", "done")

    side = LoopThread()
    unstall = threading.Event()

    hub_a: Hub | None = None
    hub_b = Hub(settings=wf_settings, hub_id="hub-b")
    hub_c = Hub(settings=wf_settings, hub_id="hub-c")
    try:
        hub_a = await side.run(started_hub(wf_settings, "hub-a"))
        engine_a = hub_a.workflows
        assert engine_a is not None and engine_a._pull is not None
        reads = 0
        record_now = engine_a._record_now

        async def first_fails(ns: str, workflow_id: str, end: float | None = None) -> Any:
            nonlocal reads
            if (ns, workflow_id) != key:
                return await record_now(ns, workflow_id, end)
            reads += 1
            if first_read_fails and reads == 1:
                raise MeshUnavailableError("no leader yet")
            return await record_now(ns, workflow_id, end)

        monkeypatch.setattr(engine_a, "_record_now", first_fails)
        await agent.start()
        async with Client(settings=wf_settings) as mesh:
            wf_id = await mesh.submit_chain([Step(capability="wf:late:v1")], timeout=60)
            key = (ns, wf_id)
            await asyncio.wait_for(held.started.wait(), 10)
            assert key in await side.call(lambda: engine_a.owned)
            await hub_b.start()
            engine_b = hub_b.workflows
            assert engine_b is not None
            # A pulls no more: the redelivered submission must go to B, not back to A's
            # pull request still open on the server (a race the stalled hub may win). Flushed:
            # the server has A's unsubscribe before A stalls, and drops its open pulls.
            await side.run(engine_a._pull.stop())
            await side.run(flushed(hub_a.nc))
            # Longer than an ack wait, whatever the keepalive's phase: its next pass is
            # late by its own clock (a +WPI buffered just before the stall is only sent
            # after it, so B's takeover alone would not say that much time passed).
            begun = side.stall(unstall, at_least=wf_settings.workflow_ack_wait + 0.2, limit=20.0)
            await eventually(begun.is_set, timeout=5)
            # Stalled: no +WPI from A. After an ack wait, B gets the submission and takes
            # the workflow over.
            await eventually(lambda: key in engine_b.owned, timeout=10)
            unstall.set()
            # A's loop runs again: its keepalive is late, asks, and stops the run it lost.
            await eventually(lambda: side.call(lambda: key not in engine_a.owned), timeout=10)
            assert any(_TAKEN_OVER in r.getMessage() for r in caplog.records), caplog.text
            assert reads == (2 if first_read_fails else 1)
            await hub_b.nc.close()  # the new owner dies: no ack, no nak, no more +WPI
            await hub_c.start()
            engine_c = hub_c.workflows
            assert engine_c is not None
            await eventually(lambda: key in engine_c.owned, timeout=10)
            held.release.set()
            res = await mesh.workflow(wf_id, timeout=15)
        assert res.state is TaskState.SUCCEEDED and res.hub_id == "hub-c", res
    finally:
        unstall.set()
        held.release.set()
        await closed_on(side, hub_a)
        await hub_b.close()
        await hub_c.close()


async def test_a_submission_that_comes_back_to_the_hub_running_it_renews_the_run(
    fleet: Fleet, wf_settings: MeshSettings
) -> None:
    """The only hub's loop stalls past the ack wait: nats-server delivers the submission again,
    to it. Its run goes on with the new delivery instead of taking the workflow over from
    itself (no takeover), and the submission is acked once it ends (not delivered again)."""
    agent = fleet.agent("renew.x")
    held = held_handler(agent, "wf:renew:v1", "done")
    side = LoopThread()
    unstall = threading.Event()

    hub_a: Hub | None = None
    try:
        hub_a = await side.run(started_hub(wf_settings, "hub-a"))
        engine = hub_a.workflows
        assert engine is not None
        await agent.start()
        async with Client(settings=wf_settings) as mesh:
            wf_id = await mesh.submit_chain([Step(capability="wf:renew:v1")], timeout=60)
            await asyncio.wait_for(held.started.wait(), 10)
            begun = side.stall(unstall, at_least=wf_settings.workflow_ack_wait + 0.5, limit=20.0)
            await eventually(begun.is_set, timeout=5)
            await asyncio.sleep(wf_settings.workflow_ack_wait + 0.7)  # redelivered meanwhile
            unstall.set()
            await eventually(lambda: side.call(lambda: engine.renewed_total >= 1), timeout=10)
            held.release.set()
            res = await mesh.workflow(wf_id, timeout=15)
            assert res.state is TaskState.SUCCEEDED and res.hub_id == "hub-a", res
            assert engine.takeover_total == 0
            js = mesh.nc.jetstream()

            async def unacked() -> int:
                info = await js.consumer_info(protocol.STREAM_WF, protocol.CONSUMER_HUBS)
                return (info.num_ack_pending or 0) + (info.num_pending or 0)

            async def settled() -> bool:
                return await unacked() == 0

            await eventually(settled, timeout=5)
            renewed = engine.renewed_total
            await asyncio.sleep(wf_settings.workflow_ack_wait * 1.5)
            assert await unacked() == 0 and engine.renewed_total == renewed
            assert not await side.call(lambda: engine.owned)
            # Both deliveries were one message to the pull: none is held any longer.
            assert await side.call(lambda: engine._pull is not None and engine._pull.held) == 0
    finally:
        unstall.set()
        held.release.set()
        await closed_on(side, hub_a)
