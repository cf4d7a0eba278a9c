"""A workflow step's ``StepTrack`` is freed by reference counting, not by the cyclic collector.

Its ACK machine reported transitions through a closure over the track, kept by the track and
its machine: every step a workflow ran left a reference cycle (the track with its machine,
signal and queues, about ten objects) that only a garbage collection freed — some 70,000
objects in a 2 s window of a loaded hub, and young collections of up to 18 ms. The machine's
recorder holds the step's span and the attempt instead (its span events:
``test_traces_e2e.py``).
"""

from __future__ import annotations

import gc

import pytest

from reach_mesh import Client, MeshSettings, Step, TaskState
from reach_mesh.hub import Hub
from reach_mesh.hub._step_track import StepTrack

from .helpers import Fleet, echo_agent

pytestmark = pytest.mark.timeout(60)


async def test_finished_steps_leave_no_cycle(
    wf_hub: Hub, fleet: Fleet, wf_settings: MeshSettings
) -> None:
    """Six steps run and finish on a real hub; none of their tracks is left for the cyclic
    collector to find."""
    await echo_agent(fleet, "cycles.a").start()
    async with Client(settings=wf_settings) as mesh:
        await mesh.fanout([Step(capability="wf:echo:v1", payload=0)], timeout=10)  # warm
        gc.collect()
        gc.set_debug(gc.DEBUG_SAVEALL)  # what the collector frees is kept in gc.garbage
        try:
            fan = await mesh.fanout(
                [Step(capability="wf:echo:v1", payload=i) for i in range(3)], timeout=10
            )
            chain = await mesh.chain(
                [Step(capability="wf:echo:v1", payload=i) for i in range(3)], timeout=10
            )
            gc.collect()
            tracks = [o for o in gc.garbage if isinstance(o, StepTrack)]
        finally:
            gc.set_debug(0)
            gc.garbage.clear()
    assert fan.state is TaskState.SUCCEEDED and chain.state is TaskState.SUCCEEDED
    assert tracks == []
