"""Policy fanouts (``any``, ``quorum(k)``) whose unneeded branch swallows its cancellation (an
await in it: Python 3.11's ``wait_for`` under nats-py's requests), on a real nats-server: an
outcome it ran on to is kept, and one with none holds neither the result nor the other stops
up. Split from ``test_policy_faults.py``."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import pytest
from nats.aio.msg import Msg

from reach_mesh import Client, MeshSettings, Step, WorkflowResult, protocol
from reach_mesh.agent import Task, TaskFailed
from reach_mesh.hub import Hub, _shapes
from reach_mesh.hub._step_state import Workflow
from reach_mesh.hub._step_track import StepTrack
from reach_mesh.models import TaskState

from .helpers import Fleet, eventually, task_record

pytestmark = pytest.mark.timeout(60)


async def test_a_step_that_ran_on_to_its_outcome_through_its_stop_keeps_it(
    wf_hub: Hub, fleet: Fleet, wf_settings: MeshSettings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A ``quorum(2)`` fanout's step 0 has its SUCCEEDED in hand but is held in an await (a
    read of the status stream, a question to its agent) when its two siblings meet the
    quorum. The fanout cancels it, and the await swallows the cancellation — Python 3.11's
    ``asyncio.wait_for``, under nats-py's requests, returns its future's result when that
    completed with the cancel — so the step runs on and decides by its SUCCEEDED (its event
    says so). The fanout took it for still running all the same: fenced as unneeded, its
    record read PENDING (its current attempt decided it: nothing written), its result thrown
    away and the step reported stopped (chaos secure seed 179, ``partition``,
    chaos-179-00590: a5's SUCCEEDED, stored 1 s before the deciding one, reported PENDING,
    stopped as unneeded)."""
    ns = wf_settings.namespace
    engine = wf_hub.workflows
    assert engine is not None
    in_hand = asyncio.Event()
    swallowed: list[bool] = []
    agent = fleet.agent("ranon.a")

    @agent.handler("wf:ranon:v1")
    async def work(task: Task[Any]) -> Any:
        if task.payload != 0:
            await in_hand.wait()  # the siblings succeed once step 0's outcome is in hand
        return task.payload

    await agent.start()
    real_watch = engine._watch

    async def held(track: StepTrack, pol: Any, deadline: float) -> Any:
        if track.task_id == "ranon-0":
            await eventually(lambda: track.final is not None, timeout=5)
            in_hand.set()
            try:
                await asyncio.Event().wait()  # a read the fanout's decision cancels
            except asyncio.CancelledError:
                swallowed.append(True)  # (as ``wait_for`` does when its read just answered)
        return await real_watch(track, pol, deadline)

    monkeypatch.setattr(engine, "_watch", held)
    async with Client(settings=wf_settings) as mesh:
        res = await mesh.fanout(
            [Step(capability="wf:ranon:v1", payload=i, task_id=f"ranon-{i}") for i in range(3)],
            policy="quorum(2)",
            timeout=15,
        )
    assert swallowed, "the fanout never cancelled step 0"
    assert res.state is TaskState.SUCCEEDED, res
    assert res.steps[0].state is TaskState.SUCCEEDED and not res.steps[0].cancelled, res.steps
    assert res.result == [0, 1, 2], res.result
    rec = await task_record(wf_hub.nc, ns, "ranon-0")
    assert rec is not None and not rec.cancelled, rec


@pytest.mark.parametrize("how", ["retried", "watched", "deaf"])
async def test_a_branch_that_ran_on_through_its_stop_without_an_outcome_holds_nothing_up(
    wf_hub: Hub,
    fleet: Fleet,
    wf_settings: MeshSettings,
    monkeypatch: pytest.MonkeyPatch,
    how: str,
) -> None:
    """An ``any`` fanout of three steps is decided by step 0 while steps 1 and 2 run. Step 2's
    runner is held in an await (a read of the status stream, a question to its agent) that
    swallows the fanout's cancellation, with no outcome in hand — then, ``retried``: its
    attempt 1 fails (retryable) and the step would send attempt 2; ``watched``: it watches
    its attempt 1 on, running; ``deaf``: the await swallows every cancel for 4 s.

    The fanout waited for the branch to end: the result stored, and step 1 fenced, only when
    it did, and meanwhile it recorded and sent new attempts (chaos secure seed 184,
    ``node_stop``, chaos-184-00972: an ``any`` fanout decided at 20.04 whose step 2 ran on
    for 23 s through five new attempts; the result stored at 43.02 and step 1's fence,
    stopping the unneeded branch, slipped to 43.001, so a3 ran step 1's attempt 16 at 42.04).
    Now the result and the fences come at once, and the branch starts nothing more."""
    ns = wf_settings.namespace
    engine = wf_hub.workflows
    assert engine is not None
    loop = asyncio.get_running_loop()
    started = {1: asyncio.Event(), 2: asyncio.Event()}
    swallowed = asyncio.Event()
    cancelled_at: list[float] = []  # when the fanout's (first) cancel reached step 2's await
    held_ended = asyncio.Event()
    runs: list[tuple[int, int]] = []  # (step, attempt) as handlers started
    stopped: dict[int, float] = {}  # step -> when its handler was cancelled

    async def work(task: Task[Any]) -> Any:
        step = task.payload
        if step == 0:
            await started[1].wait()
            await started[2].wait()  # decided while steps 1 and 2 run
            return 0
        runs.append((step, task.attempt))
        started[step].set()
        if how == "retried" and step == 2 and task.attempt == 1:
            await swallowed.wait()
            raise TaskFailed("once", retryable=True)
        try:
            await asyncio.sleep(8)
        except asyncio.CancelledError:
            stopped.setdefault(step, loop.time())
            raise
        return step

    for name in ("swal.a", "swal.b"):  # two: a retry of step 2 has another agent to go to
        fleet.agent(name).handler("wf:swal:v1")(work)
    for agent in fleet.agents:
        await agent.start()
    real_watch = engine._watch
    held_once: list[bool] = []

    async def held(track: StepTrack, pol: Any, deadline: float) -> Any:
        if track.task_id != f"swal-{how}-2" or held_once:
            return await real_watch(track, pol, deadline)
        held_once.append(True)
        try:
            try:
                await asyncio.Event().wait()  # a read the fanout's decision cancels
            except asyncio.CancelledError:
                cancelled_at.append(loop.time())  # swallowed, no outcome in hand
                swallowed.set()
            if how == "deaf":
                await _deaf(4.0)
            return await real_watch(track, pol, deadline)
        finally:
            held_ended.set()

    monkeypatch.setattr(engine, "_watch", held)
    async with Client(settings=wf_settings) as mesh:
        res = await _any_of_three(mesh, "wf:swal:v1", f"swal-{how}")
        done_at = loop.time()
    assert cancelled_at, "the fanout never cancelled step 2"
    decided_at = cancelled_at[0]
    # Stored at once: not when the branch that ignored its cancel ends (8 s, or 4 s deaf).
    assert done_at - decided_at < 2.0, f"result stored {done_at - decided_at:.2f}s after"
    assert res.state is TaskState.SUCCEEDED and res.result == [0, None, None], res
    assert res.steps[0].ok and res.steps[1].cancelled and res.steps[2].cancelled, res.steps
    # The other unneeded branch fenced and its handler stopped at once too.
    await eventually(lambda: 1 in stopped, timeout=3)
    assert stopped[1] - decided_at < 2.0, f"step 1 stopped {stopped[1] - decided_at:.2f}s after"
    if how != "retried":  # (its attempt 1 failed by itself)
        await eventually(lambda: 2 in stopped, timeout=3)
        assert stopped[2] - decided_at < 2.0, stopped
    # Once the branch has ended (the deaf await too): it started no attempt after the decision.
    await asyncio.wait_for(held_ended.wait(), timeout=10)
    await asyncio.sleep(0.5)  # (a retry's backoff is 0.02-0.1 s)
    assert [a for s, a in runs if s == 2] == [1], runs
    rec = await task_record(wf_hub.nc, ns, f"swal-{how}-2")
    assert rec is not None and rec.cancelled, rec
    assert all(h.attempt == 1 for h in rec.history if h.agent_id is not None), rec.history


async def test_a_branch_left_running_with_an_outcome_in_hand_keeps_it(
    wf_hub: Hub, fleet: Fleet, wf_settings: MeshSettings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An ``any`` fanout: step 2's success is in its runner's hands (heard live; not stored:
    purged here) but not yet applied — the runner held in an await that swallows every
    cancellation for 4 s — when step 0 decides. The fanout stops waiting for it after
    ``BRANCH_STOP_WAIT`` and stops the branch from the outcomes it has in hand, as a branch
    that ended would have left them (``Workflow.unapplied``): its success kept, not fenced
    from its record as unneeded and reported PENDING (a valid result thrown away)."""
    engine = wf_hub.workflows
    assert engine is not None
    in_hand = asyncio.Event()
    held_ended = asyncio.Event()

    async def work(task: Task[Any]) -> Any:
        if task.payload == 0:
            await in_hand.wait()  # decides once step 2's success is in hand, unapplied
        elif task.payload == 1:
            await asyncio.sleep(8)
        return task.payload

    fleet.agent("hand.a").handler("wf:hand:v1")(work)
    await fleet.agents[0].start()
    real_watch = engine._watch

    async def deaf(track: StepTrack, pol: Any, deadline: float) -> Any:
        if track.task_id != "hand-2":
            return await real_watch(track, pol, deadline)
        try:
            await eventually(lambda: track.final is not None, timeout=10)
            # Stored nowhere yet (its agent still retrying the store, say): in hand only.
            js = wf_hub.nc.jetstream()
            await js.purge_stream(
                protocol.STREAM_STATUS,
                subject=protocol.task_status(fleet.agents[0].agent_id, "hand-2"),
            )
            in_hand.set()
            await _deaf(4.0)
            return await real_watch(track, pol, deadline)
        finally:
            held_ended.set()

    monkeypatch.setattr(engine, "_watch", deaf)
    async with Client(settings=wf_settings) as mesh:
        res = await _any_of_three(mesh, "wf:hand:v1", "hand")
    assert res.state is TaskState.SUCCEEDED, res
    assert res.steps[2].ok and not res.steps[2].cancelled, res.steps[2]
    assert res.result == [0, None, 2], res.result
    assert res.steps[1].cancelled
    await asyncio.wait_for(held_ended.wait(), timeout=10)


@pytest.mark.parametrize("backstop", ["on", "off"])
async def test_a_branch_cancelled_as_its_status_read_is_answered_stops_at_the_read(
    wf_hub: Hub,
    fleet: Fleet,
    wf_settings: MeshSettings,
    monkeypatch: pytest.MonkeyPatch,
    backstop: str,
) -> None:
    """An ``any`` fanout of three steps is decided by step 0 while step 2's runner reads the
    status stream (``StatusTracker.catch_up``, as its probe of a silent attempt does: nats-py's
    ``get_last_msg``, a request awaited in ``asyncio.wait_for``), and the answer to that read
    comes in the very iteration in which the fanout cancels the branch: held back from the
    read until the fanout decides, and handed to it just before ``_end_branches`` cancels.

    Python 3.11's ``wait_for`` returned the answer and swallowed the cancel; the branch ran on
    (chaos secure seed 184, ``node_stop``, chaos-184-00972: step 2 ran on for 23 s through five
    new attempts). Now the read raises ``CancelledError`` (``_nats._Connection``) and the
    branch ends there. ``off``: without d5aeec7's backstop (``Workflow.halted``, and one
    cancel instead of one every 50 ms), so that the fix alone is what stops it."""
    engine = wf_hub.workflows
    assert engine is not None
    loop = asyncio.get_running_loop()
    if backstop == "off":
        monkeypatch.setattr(Workflow, "halted", lambda self: False)
        monkeypatch.setattr(_shapes, "BRANCH_RECANCEL", 6.0)
        monkeypatch.setattr(_shapes, "BRANCH_STOP_WAIT", 6.0)
    answered = asyncio.Event()  # step 2's read was answered (its answer held back)
    held: list[tuple[asyncio.Future[Msg], asyncio.Future[Msg]]] = []  # (the read's, the answer)
    branch: list[asyncio.Task[Any]] = []
    at_read: list[str] = []
    decided_at: list[float] = []

    async def work(task: Task[Any]) -> Any:
        if task.payload == 0:
            await answered.wait()  # decides while step 2's read waits for its answer
            return 0
        await asyncio.sleep(8)
        return task.payload

    agent = fleet.agent("read.a")
    agent.handler("wf:read:v1")(work)
    await agent.start()
    nc = engine._tracker._js_patient._nc  # the connection its status reads go through

    class HoldAnswer(dict[str, "asyncio.Future[Msg]"]):
        """nats-py's ``_resp_map``: step 2's read's answer goes to a future of the test's."""

        def __setitem__(self, token: str, future: asyncio.Future[Msg]) -> None:
            if not held and branch and asyncio.current_task() is branch[0]:
                answer: asyncio.Future[Msg] = loop.create_future()
                answer.add_done_callback(lambda _: answered.set())
                held.append((future, answer))
                future = answer
            super().__setitem__(token, future)

    real_watch = engine._watch
    real_end = engine._end_branches

    async def read_then_watch(track: StepTrack, pol: Any, deadline: float) -> Any:
        if track.task_id != "read-2" or branch:
            return await real_watch(track, pol, deadline)
        me = asyncio.current_task()
        assert me is not None
        branch.append(me)
        monkeypatch.setattr(nc, "_resp_map", HoldAnswer(nc._resp_map))
        try:
            await engine._tracker.catch_up(track, [agent.agent_id], patient=True)
        except asyncio.CancelledError:
            at_read.append("cancelled")
            raise
        at_read.append("ran on")
        return await real_watch(track, pol, deadline)

    async def end_branches(wf: Workflow, tasks: Any, pending: Any) -> None:
        decided_at.append(loop.time())
        if held and not held[0][0].done():
            read, answer = held[0]
            read.set_result(answer.result())  # the answer comes in as the cancel lands
        await real_end(wf, tasks, pending)

    monkeypatch.setattr(engine, "_watch", read_then_watch)
    monkeypatch.setattr(engine, "_end_branches", end_branches)
    async with Client(settings=wf_settings) as mesh:
        res = await _any_of_three(mesh, "wf:read:v1", "read")
        done_at = loop.time()
    assert held and decided_at, "step 2's read was not under way when the fanout decided"
    assert at_read == ["cancelled"], f"the branch {at_read} through its cancel at the read"
    assert branch[0].cancelled()
    assert done_at - decided_at[0] < 2.0, f"result stored {done_at - decided_at[0]:.2f}s after"
    assert res.state is TaskState.SUCCEEDED and res.result == [0, None, None], res
    assert res.steps[1].cancelled and res.steps[2].cancelled, res.steps


async def _deaf(seconds: float) -> None:
    """Swallow every cancellation for ``seconds``, as an await that swallows them would."""
    loop = asyncio.get_running_loop()
    until = loop.time() + seconds
    while loop.time() < until:
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.sleep(until - loop.time())


async def _any_of_three(mesh: Client, capability: str, prefix: str) -> WorkflowResult:
    """An ``any`` fanout of three steps of ``capability``, payloads 0-2, task ids
    ``<prefix>-<i>``."""
    steps = [
        Step(capability=capability, payload=i, task_id=f"{prefix}-{i}", timeout=10)
        for i in range(3)
    ]
    return await mesh.fanout(steps, policy="any", timeout=20)
