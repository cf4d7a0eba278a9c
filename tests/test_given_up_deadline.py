"""``StatusTracker.given_up_read`` (e3ed77d) and the step's deadline, on a real nats-server.

A step whose attempts given up on went to several agents reads their stored statuses one
after another, each unanswered read taking its timeout (1 s) and then its patient one (10 s):
while ``REACH_STATUS`` answers nothing (no leader) a step with three such agents spends 33 s
in one ``given_up_read``, and the step's deadline was looked at only before and after it: the
read is now bound by the deadline (``StepRunner``)."""

from __future__ import annotations

import asyncio
import time

import pytest

from reach_mesh import Client, MeshSettings, MeshUnavailableError, Step, protocol
from reach_mesh.hub import Hub, _status_reads
from reach_mesh.models import TaskState
from reach_mesh.workflow import (
    AttemptRecord,
    TaskRecord,
    TaskStatusEvent,
)

from .test_policy_takeovers import _owned_by_a_gone_hub

pytestmark = pytest.mark.timeout(120)


async def test_given_up_reads_hold_a_step_far_past_its_deadline(
    wf_hub: Hub, wf_settings: MeshSettings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fanout taken over from a gone hub, its one step's attempts 1-3 given up (``lost``) on
    three agents, attempt 4 recorded with no agent; ``REACH_STATUS`` answers no read of that
    step (each read fails after its own timeout, as a stream without a leader does). The
    workflow's timeout is 4 s: its result (TIMEOUT) is due then plus the bounded hold of a
    step at its deadline (``given_up_final``: a read, then reads on for 10 s; 15 s in all
    here). Without the bound on ``given_up_read``: 39 s before that hold (one
    ``given_up_read`` of 3 x (1 s + 10 s) before the deadline was looked at)."""
    ns = wf_settings.namespace
    engine = wf_hub.workflows
    assert engine is not None
    tracker = engine._tracker
    last_status = tracker.last_status
    wf_id = "given-up-deadline"
    branch = f"{wf_id}-0"
    agents = [f"{ns}.gone.a{n}" for n in range(3)]

    async def unanswered(
        ns_: str, task_id: str, agent_id: str | None = None, *, patient: bool = False
    ) -> TaskStatusEvent | None:
        if task_id == branch:
            # As a read of a stream without a leader: no answer within the read's timeout.
            await asyncio.sleep(
                _status_reads._STATUS_READ_PATIENT
                if patient
                else _status_reads._STATUS_READ_TIMEOUT
            )
            raise MeshUnavailableError("REACH_STATUS did not answer")
        return await last_status(ns_, task_id, agent_id, patient=patient)

    monkeypatch.setattr(tracker, "last_status", unanswered)
    timeout = 4.0
    steps = [Step(capability="wf:gone:v1", payload=0, timeout=2)]
    async with Client(settings=wf_settings) as mesh:
        js = await _owned_by_a_gone_hub(mesh, ns, wf_id, steps, "all", agents[0], timeout=timeout)
        tasks = await js.key_value(protocol.KV_TASKS)
        fenced = TaskRecord(
            task_id=branch,
            workflow_id=wf_id,
            step=0,
            namespace=ns,
            attempt=4,
            delivery_failures=3,
            created_at=time.time(),
            history=[
                AttemptRecord(attempt=n + 1, agent_id=a, code="lost") for n, a in enumerate(agents)
            ],
        )
        await tasks.put(protocol.task_key(ns, branch), protocol.encode(fenced))
        started = time.monotonic()
        await mesh.submit_fanout(steps, policy="all", workflow_id=wf_id, timeout=timeout)
        res = await mesh.workflow(wf_id, timeout=100)
        took = time.monotonic() - started
    assert res.steps[0].state is TaskState.TIMEOUT, res
    hold = _status_reads._STATUS_READ_TIMEOUT + _status_reads._STATUS_READ_PATIENT
    assert took < timeout + hold + 4.0, (
        f"the workflow's {timeout:g}s deadline decided after {took:.1f}s"
    )
