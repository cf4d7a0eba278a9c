"""A step's ``timeout`` holds even against a handler that does not stop when cancelled.

A handler that swallows ``CancelledError`` used to keep its step RUNNING (its agent's
keep-alives went on) until the workflow's deadline, and the step was never retried. Now its
agent abandons it (``handler_abandon_grace`` after the deadline: answered TIMEOUT, keep-alives
stop, the slot stays taken), and the hub, by its own clock, takes an attempt still reported
running ``step_overdue_grace`` past its timeout as a TIMEOUT (an agent that does not enforce
its timeouts). Both on a real nats-server.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import pytest

from reach_mesh import Client, MeshSettings, RetryPolicy, Step, TaskState
from reach_mesh._cli_fleet import _print_agents
from reach_mesh.agent import Agent, Task
from reach_mesh.errors import AgentBusyError, ReachError
from reach_mesh.hub import Hub
from reach_mesh.hub.workflows import WorkflowEngine
from reach_mesh.workflow import step_task_id

from .helpers import (
    Fleet,
    LoseFirstFinal,
    abandoned,
    eventually,
    handled,
    status_events,
    task_record,
)

pytestmark = pytest.mark.timeout(60)


@dataclass
class Stubborn:
    """A handler that ignores every cancellation until ``release`` is set."""

    started: asyncio.Event = field(default_factory=asyncio.Event)
    release: asyncio.Event = field(default_factory=asyncio.Event)
    cancels: int = 0
    returned: int = 0


def stubborn_handler(agent: Agent, cap: str) -> Stubborn:
    state = Stubborn()

    @agent.handler(cap)
    async def run(task: Task[Any]) -> str:
        state.started.set()
        while not state.release.is_set():
            try:
                await asyncio.sleep(0.02)
            except asyncio.CancelledError:
                state.cancels += 1  # ... and carries on
        state.returned += 1
        return "late"

    return state


async def started_stubborn(agent: Agent, cap: str, release_all: list[Stubborn]) -> Stubborn:
    """``agent`` started with a stubborn handler of ``cap``, let go at the test's end."""
    stuck = stubborn_handler(agent, cap)
    release_all.append(stuck)
    await agent.start()
    return stuck


def good_handler(agent: Agent, cap: str) -> None:
    @agent.handler(cap)
    async def run(task: Task[Any]) -> str:
        return "ok"


async def retried_elsewhere(mesh: Client, fleet: Fleet, stuck: Stubborn, cap: str) -> str:
    """Submit a one-step fanout (timeout 0.5 s, one retry) that the stubborn handler takes,
    then start a good agent: the step must end there, long before the workflow's 30 s.
    Returns the workflow id."""
    t0 = time.monotonic()
    wf_id = await mesh.submit_fanout([Step(capability=cap, timeout=0.5, retries=1)], timeout=30)
    await asyncio.wait_for(stuck.started.wait(), 5)
    good = fleet.agent("good.a1")
    good_handler(good, cap)
    await good.start()
    res = await mesh.workflow(wf_id, timeout=20)
    took = time.monotonic() - t0
    assert res.state is TaskState.SUCCEEDED, res
    assert res.steps[0].agent_id == good.agent_id and res.steps[0].attempts == 2
    assert took < 10, f"took {took:.1f}s: not retried until the deadline"
    return wf_id


@pytest.fixture
async def release_all() -> AsyncIterator[list[Stubborn]]:
    """Stubborn handlers to let go at the end (so their agents can close)."""
    held: list[Stubborn] = []
    yield held
    for h in held:
        h.release.set()
    await asyncio.sleep(0.05)


async def test_an_agent_abandons_a_handler_that_ignores_its_timeout(
    wf_settings: MeshSettings, release_all: list[Stubborn]
) -> None:
    """The agent answers TIMEOUT ``handler_abandon_grace`` after the deadline and stops its
    keep-alives; the step is retried on another agent and succeeds long before the workflow's
    deadline. The abandoned handler keeps its slot; what it returns later is dropped."""
    s = wf_settings.model_copy(update={"handler_abandon_grace": 0.5, "step_overdue_grace": 60.0})
    ns, cap = s.namespace, "wf:stubborn:v1"
    fleet = Fleet(s)
    async with Hub(settings=s) as hub:
        stubborn = fleet.agent("stubborn.a1")
        stuck = await started_stubborn(stubborn, cap, release_all)
        try:
            async with Client(settings=s) as mesh:
                wf_id = await retried_elsewhere(mesh, fleet, stuck, cap)
                assert stuck.cancels >= 1 and stuck.returned == 0
                assert abandoned(stubborn, "step") == 1 and abandoned(stubborn, "request") == 0
                assert stubborn.inflight == 1  # it still runs: the agent's load says so
                task_id = step_task_id(wf_id, 0, Step(capability=cap))
                rec = await task_record(hub.nc, ns, task_id)
                assert rec is not None and rec.history[0].state is TaskState.TIMEOUT
                assert rec.history[0].agent_id == stubborn.agent_id

                # Nothing is said of the abandoned attempt after its final TIMEOUT ...
                await asyncio.sleep(0.6)  # three keep-alive intervals
                events = [
                    e
                    for e in await status_events(mesh, ns, task_id)
                    if e.agent_id == stubborn.agent_id
                ]
                assert events[-1].state is TaskState.TIMEOUT, events
                assert events[-1].error is not None and events[-1].error.details["abandoned"]
                # ... and what its handler returns at last is dropped.
                stuck.release.set()
                await eventually(lambda: stubborn.inflight == 0)
                assert stuck.returned == 1
                # Counted as it was answered, TIMEOUT, not as what the handler returned late.
                assert handled(stubborn, cap, "TIMEOUT") == 1
                assert handled(stubborn, cap, "SUCCEEDED") == 0
                await asyncio.sleep(0.3)
                later = [
                    e
                    for e in await status_events(mesh, ns, task_id)
                    if e.agent_id == stubborn.agent_id
                ]
                assert later == events
                assert (await mesh.workflow(wf_id, timeout=5)).steps[0].result == "ok"
                assert hub.workflows is not None and hub.workflows.overdue_total == 0
        finally:
            await fleet.close()


async def test_the_hub_times_out_an_attempt_its_agent_keeps_running(
    wf_settings: MeshSettings, release_all: list[Stubborn]
) -> None:
    """An agent that does not end a handler past its timeout (here: one that never abandons)
    holds the step no longer than ``timeout + step_overdue_grace`` by the hub's clock: the
    attempt is recorded TIMEOUT, its handler told to stop, and the step retried elsewhere."""
    s = wf_settings.model_copy(update={"step_overdue_grace": 0.5})
    ns, cap = s.namespace, "wf:kept:v1"
    fleet = Fleet(s)
    async with Hub(settings=s) as hub:
        engine = hub.workflows
        assert engine is not None
        # Its own grace is longer than the workflow: only the hub can end the attempt.
        kept = Agent(
            f"{ns}.kept.a1", settings=s.model_copy(update={"handler_abandon_grace": 120.0})
        )
        fleet.agents.append(kept)
        stuck = await started_stubborn(kept, cap, release_all)
        try:
            async with Client(settings=s) as mesh:
                wf_id = await retried_elsewhere(mesh, fleet, stuck, cap)
                assert engine.overdue_total == 1
                assert hub.metrics.overdue_total._value.get() == 1
                task_id = step_task_id(wf_id, 0, Step(capability=cap))
                rec = await task_record(hub.nc, ns, task_id)
                assert rec is not None
                first = rec.history[0]
                assert first.agent_id == kept.agent_id and first.state is TaskState.TIMEOUT
                assert first.code == "REACH_TIMEOUT"
                # Told to stop (a second cancellation, after its own deadline's), and its
                # agent says no more of the attempt (no RUNNING for an attempt given up).
                await eventually(lambda: stuck.cancels >= 2)
                before = await status_events(mesh, ns, task_id)
                await asyncio.sleep(0.6)
                assert await status_events(mesh, ns, task_id) == before
                assert abandoned(kept, "step") == 0
        finally:
            stuck.release.set()  # (its agent would wait for it to close)
            await fleet.close()


async def test_a_step_that_waits_for_a_slot_is_timed_from_its_start(
    wf_settings: MeshSettings,
) -> None:
    """The hub times a handler from when it heard it start, not from the dispatch: a step
    queued behind another on a one-slot agent is not overdue for the time it waited, and a
    handler that ends within its timeout is never overdue however small the grace."""
    s = wf_settings.model_copy(update={"step_overdue_grace": 0.3})
    cap = "wf:queued:v1"
    fleet = Fleet(s)
    async with Hub(settings=s) as hub:
        agent = fleet.agent("queued.a1", max_concurrency=1)

        @agent.handler(cap)
        async def run(task: Task[int]) -> int:
            await asyncio.sleep(0.7)
            return task.payload

        await agent.start()
        try:
            async with Client(settings=s) as mesh:
                steps = [Step(capability=cap, payload=i, timeout=1.0, retries=0) for i in range(2)]
                res = await mesh.fanout(steps, timeout=20)
                assert res.state is TaskState.SUCCEEDED, res
                assert [st.attempts for st in res.steps] == [1, 1]
                assert sorted(st.result for st in res.steps) == [0, 1]
                assert hub.workflows is not None and hub.workflows.overdue_total == 0
        finally:
            await fleet.close()


async def test_a_wedged_agent_takes_no_work_and_gives_back_what_waits(
    wf_settings: MeshSettings, release_all: list[Stubborn], capsys: pytest.CaptureFixture[str]
) -> None:
    """An agent whose every slot is held by a handler past its timeout takes no new work
    until one returns: a step waiting there for a slot is given back when the hub asks about
    it (and runs elsewhere long before its deadline), a task is refused before it is
    accepted, and its heartbeats report its capabilities unavailable."""
    s = wf_settings.model_copy(update={"handler_abandon_grace": 0.3, "step_overdue_grace": 60.0})
    cap = "wf:wedged:v1"
    fleet = Fleet(s)
    async with Hub(settings=s) as hub:
        wedged = fleet.agent("wedged.a1", max_concurrency=1, max_queue=4)
        stuck = await started_stubborn(wedged, cap, release_all)
        try:
            async with Client(settings=s) as mesh:
                first = await mesh.submit_fanout(
                    [Step(capability=cap, timeout=0.3, retries=0)], timeout=30
                )
                await asyncio.wait_for(stuck.started.wait(), 5)
                t0 = time.monotonic()
                second = await mesh.submit_fanout(
                    [Step(capability=cap, payload=2, timeout=5, retries=0)], timeout=30
                )
                await eventually(lambda: wedged._waiting == 1)  # behind the stuck handler
                good = fleet.agent("good.a1")
                good_handler(good, cap)
                await good.start()

                res = await mesh.workflow(first, timeout=20)
                assert res.state is TaskState.TIMEOUT, res
                await eventually(lambda: wedged.wedged)
                res = await mesh.workflow(second, timeout=20)
                assert res.state is TaskState.SUCCEEDED, res
                assert res.steps[0].agent_id == good.agent_id and res.steps[0].attempts == 2
                assert time.monotonic() - t0 < 10
                assert stuck.started.is_set() and wedged.inflight == 1

                with pytest.raises(AgentBusyError, match="did not stop at its timeout"):
                    await mesh.request(agent_id=wedged.agent_id, timeout=1)
                view = hub.registry.agents[wedged.agent_id]
                await eventually(lambda: view.unavailable == frozenset({cap}))
                # ... which `reach-mesh agents` shows.
                _print_agents(await mesh.agents())
                shown = capsys.readouterr().out
                assert f"{wedged.agent_id}" in shown and f"{cap} (down)" in shown, shown

                # Once the handler returns, the agent takes work again.
                stuck.release.set()
                await eventually(lambda: not wedged.wedged and not view.unavailable)
                reply = await mesh.request(agent_id=wedged.agent_id, timeout=5)
                assert reply.state is TaskState.SUCCEEDED
        finally:
            await fleet.close()


async def _final_missed(
    s: MeshSettings,
    cap: str,
    step: Step,
    timeout: float,
    *,
    lost: Callable[[Agent, WorkflowEngine, float], Awaitable[None]] | None = None,
) -> None:
    """One fanout of ``step`` to one agent whose handler takes 0.3 s (long enough to say
    ACCEPTED: the hub times it), the attempt's final status lost on its way to the hub: it
    must end SUCCEEDED, in one attempt, its handler run once, and no attempt taken overdue.
    ``lost``: awaited once that status was lost (stored by then), with the agent, the hub's
    engine and when (``time.monotonic``) the workflow was submitted."""
    fleet = Fleet(s)
    async with Hub(settings=s) as hub:
        engine = hub.workflows
        assert engine is not None
        agent = fleet.agent(f"{cap.split(':')[1]}.a1")

        @agent.handler(cap)
        async def run(task: Task[int]) -> int:
            fleet.runs[task.task_id] += 1
            await asyncio.sleep(0.3)
            return task.payload

        await agent.start()
        lose = LoseFirstFinal()
        engine.status_filter = lose
        try:
            async with Client(settings=s) as mesh:
                t0 = time.monotonic()
                wf_id = await mesh.submit_fanout([step], timeout=timeout)
                if lost is not None:
                    await eventually(lambda: bool(lose.dropped), timeout=5)
                    await lost(agent, engine, t0)
                res = await mesh.workflow(wf_id, timeout=30)
                assert lose.dropped, "the fault was not injected"
                assert engine.overdue_total == 0, "the hub took its own TIMEOUT (overdue)"
                assert res.state is TaskState.SUCCEEDED, res
                assert res.steps[0].result == 7
                assert res.steps[0].attempts == 1, res.steps[0]
                assert fleet.runs[res.steps[0].task_id] == 1
        finally:
            engine.status_filter = None
            await fleet.close()


async def test_a_final_status_the_hub_missed_is_no_overdue_timeout(
    wf_settings: MeshSettings,
) -> None:
    """A step whose ``silence_timeout`` is longer than its ``timeout`` + ``step_overdue_grace``
    (a caller's retry policy may say so): its attempt's final status never reaches the hub (the
    hub's statuses connection cut as it came; ``status_filter`` drops it here), so the hub last
    heard the attempt running when its overdue time comes. The outcome is in ``REACH_STATUS``
    and its agent holds it: it decides the step — not a TIMEOUT of the hub's own, which threw
    the result away and ran the step again (the audit's status_chaos run with cuts: 15 steps
    of 120 workflows run twice)."""
    s = wf_settings.model_copy(update={"step_overdue_grace": 0.5})
    retry = RetryPolicy(retries=1, silence_timeout=5.0)
    step = Step(capability="wf:missedfinal:v1", payload=7, timeout=1.0, retry=retry)
    await _final_missed(s, "wf:missedfinal:v1", step, timeout=20)


async def test_a_final_status_the_hub_missed_before_the_deadline_is_no_timeout(
    wf_settings: MeshSettings,
) -> None:
    """The workflow's deadline comes while the hub waits out a step's silence: its attempt
    ended, SUCCEEDED, long before it, but the status never reached the hub (its statuses
    connection cut as it came; ``status_filter`` drops it here), and the silence timeout that
    would have had the hub read it is longer than what was left. The outcome is in
    ``REACH_STATUS`` and its agent holds it: it decides the step, not a TIMEOUT of the
    deadline's — a connection cut is no outcome, and the agent's result is not thrown away."""
    s = wf_settings.model_copy(update={"step_silence_timeout": 10.0})
    step = Step(capability="wf:missedbydeadline:v1", payload=7, timeout=1.0, retries=0)
    await _final_missed(s, "wf:missedbydeadline:v1", step, timeout=2.5)


async def test_a_handler_cancelled_after_a_freeze_gets_its_grace(settings: MeshSettings) -> None:
    """An agent frozen past a running handler's deadline and its grace (SIGSTOP, a stalled VM)
    cancels the handler when it wakes, and the handler's grace counts from then: one that
    stops at its cancellation (a short async clean-up here) is answered TIMEOUT, not abandoned
    as one that ignored it — which logged ``REACH-HANDLER-ABANDONED`` and counted
    ``reach_agent_handlers_abandoned_total`` (alert ``ReachHandlersIgnoreTimeouts``, blaming
    the handler's code for an hour) for every handler in flight through the freeze."""
    s = settings.model_copy(update={"handler_abandon_grace": 0.5})
    cap = "wf:polite:v1"
    started = asyncio.Event()
    stopped = asyncio.Event()
    agent = Agent(f"{s.namespace}.polite.a1", settings=s)

    @agent.handler(cap)
    async def run(task: Task[Any]) -> str:
        started.set()
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            await asyncio.sleep(0.01)  # closes what it holds, then stops
            stopped.set()
            raise
        return "late"

    async with Hub(settings=s), agent, Client(settings=s) as mesh:
        asked = asyncio.create_task(mesh.request(capability=cap, payload={}, timeout=1.0))
        await asyncio.wait_for(started.wait(), 5)
        # The whole process frozen past the deadline (1 s) and the grace (0.5 s).
        time.sleep(2.0)  # noqa: ASYNC251 - the point: a frozen event loop
        await asyncio.wait_for(stopped.wait(), 5)
        await eventually(lambda: handled(agent, cap, "TIMEOUT") == 1)
        assert abandoned(agent, "request") == 0
        assert agent.inflight == 0
        asked.cancel()
        with contextlib.suppress(asyncio.CancelledError, ReachError):
            await asked
