"""An attempt whose agent is gone is not given up while the status stream that may hold its
outcome cannot be read (chaos secure seed 173, ``partition``).

A node's rejoin left ``REACH_STATUS`` without a leader for 9.3 s. A workflow taken over in that
window could not read its steps' stored SUCCEEDED (stored before, its first owner heard them
live and handed the workflow back); their agent, cut off, was declared LOST, and the hub's
probe — its read unanswered, even the patient one — gave attempt 1 up and ran the steps
again: a valid result thrown away (invariant 3). The probe now says ``unread``: the attempt is
kept and asked about again; once the stream answers, its stored outcome decides the step.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import pytest
from nats.js.errors import ServiceUnavailableError
from opentelemetry.trace import INVALID_SPAN

from reach_mesh import Client, MeshSettings, Step, TaskState, protocol
from reach_mesh.hub import Hub
from reach_mesh.hub._tracking import StatusTracker, StepTrack
from reach_mesh.workflow import AttemptRecord, TaskRecord, TaskStatusEvent

from .helpers import Fleet, eventually, held_handler, partition

pytestmark = pytest.mark.timeout(90)

T = TypeVar("T")


def _unavailable() -> ServiceUnavailableError:
    return ServiceUnavailableError(code=503, err_code=10008, description="no leader")


async def with_reads(
    settings: MeshSettings,
    reads: list[Any],
    act: Callable[[StatusTracker, StepTrack], Awaitable[T]],
) -> tuple[T, TaskStatusEvent | None, int]:
    """``act`` on attempt 1 of a step whose agent is not there (no ctl subscriber, no lease):
    each status read takes the next of ``reads`` (an exception is raised, anything else
    returned; the last one again once they run out). Returns what ``act`` returned, the
    step's outcome, and how many reads were made."""
    agent_id = f"{settings.namespace}.gone.a1"
    async with Hub(settings=settings) as hub:
        assert hub.workflows is not None
        tracker = StatusTracker(hub.nc, hub.workflows._jsc, hub.registry)
        answers = list(reads)
        made = 0

        async def last_status(
            ns: str, task_id: str, agent_id: str | None = None, *, patient: bool = False
        ) -> TaskStatusEvent | None:
            nonlocal made
            made += 1
            got = answers.pop(0) if len(answers) > 1 else answers[0]
            if isinstance(got, BaseException):
                raise got
            assert got is None or isinstance(got, TaskStatusEvent)
            return got

        tracker.last_status = last_status  # type: ignore[method-assign]
        rec = TaskRecord(
            task_id="gone-task",
            workflow_id="gone",
            step=0,
            namespace=settings.namespace,
            attempt=1,
            agent_id=agent_id,
        )
        track = tracker.open(rec, protocol.task_key(settings.namespace, "gone-task"), INVALID_SPAN)
        got = await act(tracker, track)
        return got, track.final, made


async def _probe_with_reads(settings: MeshSettings, reads: list[Any]) -> tuple[str, Any]:
    """Probe the gone agent's attempt (``with_reads``): its verdict and the step's outcome."""
    verdict, final, made = await with_reads(settings, reads, lambda t, track: t.probe(track))
    assert made == len(reads), "every planned read was made"
    return verdict, final


async def test_a_gone_agents_attempt_is_kept_while_its_status_cannot_be_read(
    settings: MeshSettings,
) -> None:
    """Both reads (the quick one, then the patient one) unanswered: ``unread``, not ``gone``."""
    verdict, final = await _probe_with_reads(settings, [_unavailable(), _unavailable()])
    assert verdict == "unread" and final is None


async def test_a_gone_agents_attempt_with_nothing_stored_is_given_up(
    settings: MeshSettings,
) -> None:
    """Negative: the stream answered, with nothing stored — gone (the retry goes ahead)."""
    verdict, final = await _probe_with_reads(settings, [None])
    assert verdict == "gone" and final is None


async def test_a_patient_read_that_answers_decides_the_step(settings: MeshSettings) -> None:
    """Negative: the quick read unanswered, the patient one finds the outcome: done."""
    agent_id = f"{settings.namespace}.gone.a1"
    stored = TaskStatusEvent(
        task_id="gone-task",
        attempt=1,
        agent_id=agent_id,
        state=TaskState.SUCCEEDED,
        workflow_id="gone",
        step=0,
        result=7,
    )
    verdict, final = await _probe_with_reads(settings, [_unavailable(), stored])
    assert verdict == "done" and final is not None and final.result == 7


async def test_a_stored_result_is_kept_through_a_status_stream_without_leader(
    wf_hub: Hub, fleet: Fleet, wf_settings: MeshSettings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The seed-173 shape: attempt 1 on A succeeds and its status is stored, but the hub does
    not hear it (another owner did) and cannot read the stream (no leader); A is cut off and
    declared LOST. The hub must not run the step again on B: once the stream answers, A's
    stored result decides the step (attempt 1)."""
    engine = wf_hub.workflows
    assert engine is not None
    cap = "wf:unread:v1"
    a, b = fleet.agent("unread.a"), fleet.agent("unread.b")
    on_a, on_b = held_handler(a, cap, "answer of A"), held_handler(b, cap, "answer of B")
    leaderless = asyncio.Event()
    last_status = engine._tracker.last_status

    async def no_leader(ns: str, task_id: str, agent_id: str | None = None, **kw: Any) -> Any:
        if leaderless.is_set():
            raise _unavailable()
        return await last_status(ns, task_id, agent_id, **kw)

    monkeypatch.setattr(engine._tracker, "last_status", no_leader)
    # A's live statuses reach another hub only (this one took the workflow over since).
    engine.status_filter = lambda event: event.agent_id != a.agent_id
    await a.start()
    async with Client(settings=wf_settings) as mesh:
        wf_id = await mesh.submit_fanout([Step(capability=cap)], timeout=30)
        await asyncio.wait_for(on_a.started.wait(), 5)
        leaderless.set()
        await partition(a)  # no heartbeats, nobody on its ctl subject; its handler runs on
        on_a.release.set()
        subject = protocol.task_status(a.agent_id, f"{wf_id}-0")

        async def stored() -> bool:
            try:
                raw = await mesh.nc.jetstream().get_last_msg(protocol.STREAM_STATUS, subject)
            except Exception:
                return False
            return bool(json.loads(raw.data or b"{}").get("state") == "SUCCEEDED")

        await eventually(stored, timeout=10)
        await b.start()
        await eventually(lambda: a.agent_id not in wf_hub.registry.agents, timeout=20)
        await asyncio.sleep(3 * wf_settings.step_deliver_timeout)  # several probes
        ran_again = on_b.started.is_set()
        leaderless.clear()
        on_b.release.set()  # (before the fix: let attempt 2 finish)
        res = await mesh.workflow(wf_id, timeout=20)
    assert not ran_again, "attempt 1 given up while its stored result could not be read"
    step = res.steps[0]
    assert (step.state, step.result, step.decided_by) == (TaskState.SUCCEEDED, "answer of A", 1)


async def test_a_steps_agents_are_read_at_once(
    wf_hub: Hub, wf_settings: MeshSettings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``catch_up`` of a step sent to three agents, each read taking about 1 s (a slow leader):
    the reads run at once, so the step waits one read, not one per agent (with ``patient``
    an unanswered one takes up to 10 s: ``probe``, ``given_up_read`` and the deadline's hold
    waited up to 10 s per agent, eight at most). What is read is offered as one read after
    another offered it, newest attempt first (here attempt 3's read ends last), and an
    agent's failed read is its own (unread)."""
    ns = wf_settings.namespace
    engine = wf_hub.workflows
    assert engine is not None
    tracker = engine._tracker
    agents = [f"{ns}.atonce.a{n}" for n in range(3)]

    def stored(n: int, state: TaskState) -> TaskStatusEvent:
        return TaskStatusEvent(
            task_id="atonce-0",
            attempt=n + 1,
            agent_id=agents[n],
            state=state,
            workflow_id="atonce",
            step=0,
        )

    # (agent -> how long its read takes, and what it gives)
    answers: dict[str, tuple[float, Any]] = {
        agents[0]: (0.8, stored(0, TaskState.SUCCEEDED)),
        agents[1]: (1.0, _unavailable()),
        agents[2]: (1.2, stored(2, TaskState.FAILED)),
    }

    async def slow_reads(
        ns_: str, task_id: str, agent_id: str | None = None, *, patient: bool = False
    ) -> TaskStatusEvent | None:
        assert agent_id is not None
        took, got = answers[agent_id]
        await asyncio.sleep(took)
        if isinstance(got, BaseException):
            raise got
        assert isinstance(got, TaskStatusEvent)
        return got

    monkeypatch.setattr(tracker, "last_status", slow_reads)
    rec = TaskRecord(
        task_id="atonce-0",
        workflow_id="atonce",
        step=0,
        namespace=ns,
        attempt=3,
        agent_id=agents[2],
        history=[
            AttemptRecord(attempt=1, agent_id=agents[0], code="lost"),
            AttemptRecord(attempt=2, agent_id=agents[1], code="lost"),
            AttemptRecord(attempt=3, agent_id=agents[2]),
        ],
    )
    track = tracker.open(rec, protocol.task_key(ns, "atonce-0"), INVALID_SPAN)
    try:
        loop = asyncio.get_running_loop()
        t = loop.time()
        unread = await tracker.catch_up(track)
        took = loop.time() - t
        assert took < 2.0, f"the three reads took {took:.2f} s: one after another"
        assert unread == [agents[1]], unread
        assert [e.attempt for e in track.outcomes] == [3, 1], track.outcomes
    finally:
        tracker.close(track, None)
