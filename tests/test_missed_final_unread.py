"""Before the hub times an attempt out itself — overdue, or at the step's deadline — it looks
for a final status it missed (``StatusTracker.missed_final``): in ``REACH_STATUS``, then from
the attempt's agent. With the stream's read unanswered (an election: no leader, or a slow one)
and the agent cut off, the hub took its own TIMEOUT: overdue, the step was retried and ran
again; at the deadline, the step ended TIMEOUT — while the attempt's SUCCEEDED, stored before,
would have decided it. Now an unanswered read is made again patiently, as the silence probe
does: overdue, the attempt is not timed out while it stays unread (asked again later, the
deadline deciding at the latest); at the deadline, the hub reads on for a bounded while
(``_STATUS_READ_PATIENT``) before the deadline decides. On a real nats-server.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Literal

import pytest
from nats.errors import TimeoutError as NatsTimeoutError

from reach_mesh import MeshSettings, RetryPolicy, Step, TaskState
from reach_mesh.agent import Agent
from reach_mesh.hub import _status_reads
from reach_mesh.hub._tracking import StatusTracker, StepTrack
from reach_mesh.hub.workflows import WorkflowEngine
from reach_mesh.workflow import TaskStatusEvent

from .helpers import partition
from .test_status_unread import _unavailable, with_reads
from .test_step_timeouts import _final_missed

pytestmark = pytest.mark.timeout(60)


# ---------------------------------------------------------------- missed_final itself


async def _missed_final_with_reads(
    settings: MeshSettings, reads: list[Any], *, hold: bool = False
) -> tuple[bool, TaskStatusEvent | None, int]:
    """``missed_final`` of a gone agent's attempt (``with_reads``): what it returned, the
    step's outcome, and how many reads were made."""
    if hold:
        return await with_reads(settings, reads, lambda t, track: t.missed_final(track, hold=True))
    return await with_reads(settings, reads, lambda t, track: t.missed_final(track))


def _stored(settings: MeshSettings) -> TaskStatusEvent:
    return TaskStatusEvent(
        task_id="gone-task",
        attempt=1,
        agent_id=f"{settings.namespace}.gone.a1",
        state=TaskState.SUCCEEDED,
        workflow_id="gone",
        step=0,
        result=7,
    )


async def test_an_unanswered_read_is_made_again_patiently_before_a_timeout(
    settings: MeshSettings,
) -> None:
    """The quick read unanswered, the agent silent, the patient read finds the outcome."""
    read, final, made = await _missed_final_with_reads(
        settings, [_unavailable(), _stored(settings)]
    )
    assert made == 2, "no patient read of the unanswered status"
    assert read is True and final is not None and final.result == 7


async def test_a_read_unanswered_even_patiently_is_reported(settings: MeshSettings) -> None:
    """Both reads unanswered: False — the hub must not take its own TIMEOUT on that."""
    read, final, made = await _missed_final_with_reads(settings, [_unavailable()])
    assert (read, final, made) == (False, None, 2)


async def test_a_read_that_finds_nothing_lets_the_timeout_go_ahead(
    settings: MeshSettings,
) -> None:
    """Negative: the stream answered, with nothing stored — True, no outcome, one read."""
    read, final, made = await _missed_final_with_reads(settings, [None])
    assert (read, final, made) == (True, None, 1)


async def test_at_the_deadline_reads_go_on_through_an_election(settings: MeshSettings) -> None:
    """``hold``: a stream without leader refuses a read at once (503), the patient one too;
    the reads are made again until it answers (here the fifth read), within the hold."""
    reads: list[Any] = [_unavailable()] * 4 + [_stored(settings)]
    read, final, made = await _missed_final_with_reads(settings, reads, hold=True)
    assert made == 5 and read is True and final is not None and final.result == 7


async def test_at_the_deadline_the_hold_is_bounded(
    settings: MeshSettings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``hold`` with the stream never answering: False after ``_STATUS_READ_PATIENT`` (1.5 s
    here) — the deadline then decides; reads every ``_REREAD_PAUSE`` meanwhile."""
    monkeypatch.setattr(_status_reads, "_STATUS_READ_PATIENT", 1.5)
    t0 = time.monotonic()
    read, final, made = await _missed_final_with_reads(settings, [_unavailable()], hold=True)
    took = time.monotonic() - t0
    assert read is False and final is None
    assert made >= 4, made  # quick, patient, then about one per 0.5 s
    assert took < 5, f"held {took:.1f}s"


# ---------------------------------------------------------------- a step, end to end


class _Reads:
    """The hub's status reads (``StatusTracker.last_status``) as a status stream in an election
    answers them. ``mode``: "quick" — the quick reads time out, a patient one is answered (a
    slow leader); "all" — every read is refused (no leader); None — all answered."""

    def __init__(self, tracker: StatusTracker, monkeypatch: pytest.MonkeyPatch) -> None:
        self.mode: Literal["quick", "all"] | None = None
        #: Whether each read made was a patient one.
        self.made: list[bool] = []
        real = tracker.last_status

        async def read(
            ns: str, task_id: str, agent_id: str | None = None, *, patient: bool = False
        ) -> TaskStatusEvent | None:
            self.made.append(patient)
            if self.mode == "all":
                raise _unavailable()
            if self.mode == "quick" and not patient:
                raise NatsTimeoutError
            return await real(ns, task_id, agent_id, patient=patient)

        monkeypatch.setattr(tracker, "last_status", read)


async def _stored_unread(
    s: MeshSettings,
    monkeypatch: pytest.MonkeyPatch,
    step: Step,
    *,
    timeout: float,
    mode: Literal["quick", "all"],
    answer_at: float | None,
) -> None:
    """One fanout of ``step`` (wall ``timeout``) whose attempt's SUCCEEDED is stored in
    ``REACH_STATUS`` but lost on its way to the hub (``_final_missed``); its agent is then
    cut off (nobody answers ``task_state``; its lease holds), and the hub's status reads go
    as ``mode`` says, until ``answer_at`` seconds after the submission (None: throughout).
    The stored result must decide the step: one attempt, run once, none taken overdue."""
    cap = step.capability
    assert cap is not None
    reads: list[_Reads] = []

    async def cut_off(agent: Agent, engine: WorkflowEngine, t0: float) -> None:
        reads.append(_Reads(engine._tracker, monkeypatch))
        reads[0].mode = mode
        await partition(agent)
        if answer_at is not None:
            await asyncio.sleep(answer_at - (time.monotonic() - t0))
            assert engine.overdue_total == 0, "timed out while its status was unread"
            reads[0].mode = None

    await _final_missed(s, cap, step, timeout, lost=cut_off)
    assert True in reads[0].made, "no patient read of the unanswered status"


def _cut_off_agents_keep_their_lease(wf_settings: MeshSettings, **update: Any) -> MeshSettings:
    """``wf_settings`` with leases long enough that the cut-off agent is not declared LOST
    (or SUSPECT) while the test runs: the hub still takes it for heard, and asks it."""
    return wf_settings.model_copy(update={"lease_timeout": 30.0, "suspect_timeout": 30.0, **update})


@pytest.mark.parametrize(
    ("mode", "answer_at"),
    [("quick", None), ("all", 3.0)],
    ids=["slow-leader", "no-leader"],
)
async def test_an_overdue_attempt_whose_stored_status_is_unread_is_not_timed_out(
    wf_settings: MeshSettings,
    monkeypatch: pytest.MonkeyPatch,
    mode: Literal["quick", "all"],
    answer_at: float | None,
) -> None:
    """Overdue (``timeout`` 1 s + ``step_overdue_grace`` 0.5 s, heard within its 5 s silence
    timeout), its SUCCEEDED missed and stored, the agent cut off. ``slow-leader``: the quick
    read unanswered, the patient one decides the step at once. ``no-leader``: every read
    refused until 3 s, past the overdue time: the attempt is watched on, and decided by what
    is stored once the stream answers. Before: the hub's TIMEOUT (overdue), and the step run
    again."""
    s = _cut_off_agents_keep_their_lease(wf_settings, step_overdue_grace=0.5)
    retry = RetryPolicy(retries=1, silence_timeout=5.0)
    step = Step(capability="wf:overdueunread:v1", payload=7, timeout=1.0, retry=retry)
    await _stored_unread(s, monkeypatch, step, timeout=30, mode=mode, answer_at=answer_at)


@pytest.mark.parametrize(
    ("mode", "answer_at"),
    [("quick", None), ("all", 4.5)],
    ids=["slow-leader", "no-leader"],
)
async def test_a_step_whose_stored_status_is_unread_at_its_deadline_is_no_timeout(
    wf_settings: MeshSettings,
    monkeypatch: pytest.MonkeyPatch,
    mode: Literal["quick", "all"],
    answer_at: float | None,
) -> None:
    """The workflow's deadline (2.5 s) comes while the hub waits out the step's silence
    (10 s): its SUCCEEDED, stored long before, was missed, the agent is cut off.
    ``slow-leader``: the quick read unanswered, the patient one decides the step.
    ``no-leader``: every read refused until 2 s past the deadline: the hub reads on (within
    its bounded hold) and the stored result decides. Before: the step ended TIMEOUT."""
    s = _cut_off_agents_keep_their_lease(wf_settings, step_silence_timeout=10.0)
    step = Step(capability="wf:deadlineunread:v1", payload=7, timeout=1.0, retries=0)
    await _stored_unread(s, monkeypatch, step, timeout=2.5, mode=mode, answer_at=answer_at)


# ---------------------------------------------------------------- between attempts


async def _given_up_final_with_reads(
    settings: MeshSettings, reads: list[Any]
) -> tuple[tuple[bool, tuple[int, str] | None], TaskStatusEvent | None, int]:
    """``given_up_final`` at a step's deadline between attempts (``with_reads``): the gone
    agent's attempt 1 given up on — attempt 2 recorded, no agent yet. What it returned with
    the attempt revived (if any), the step's outcome, and how many reads were made."""

    async def at_deadline(t: StatusTracker, track: StepTrack) -> tuple[bool, Any]:
        t.fence(track, 2)
        read = await t.given_up_final(track)
        return read, track.revived

    return await with_reads(settings, reads, at_deadline)


async def test_between_attempts_the_deadline_reads_go_on_through_an_election(
    settings: MeshSettings,
) -> None:
    """The deadline reached between attempts: the stored SUCCEEDED of the attempt given up
    on is read through an election (the fifth read answers, within the hold) and decides."""
    reads: list[Any] = [_unavailable()] * 4 + [_stored(settings)]
    (read, _), final, made = await _given_up_final_with_reads(settings, reads)
    assert made == 5 and read is True and final is not None and final.result == 7


async def test_between_attempts_the_deadline_hold_is_bounded(
    settings: MeshSettings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The stream never answering: False after ``_STATUS_READ_PATIENT`` (1.5 s here); the
    deadline then decides."""
    monkeypatch.setattr(_status_reads, "_STATUS_READ_PATIENT", 1.5)
    t0 = time.monotonic()
    (read, _), final, made = await _given_up_final_with_reads(settings, [_unavailable()])
    took = time.monotonic() - t0
    assert read is False and final is None
    assert made >= 4, made  # quick, patient, then about one per 0.5 s
    assert took < 5, f"held {took:.1f}s"


async def test_between_attempts_a_stored_keep_alive_revives_nothing(
    settings: MeshSettings,
) -> None:
    """Negative: only final statuses of attempts given up on are applied — a stored RUNNING
    (however old) is no news of the attempt now, and does not revive it; nothing unread."""
    running = _stored(settings).model_copy(update={"state": TaskState.RUNNING, "result": None})
    (read, revived), final, made = await _given_up_final_with_reads(settings, [running])
    assert (read, revived, final, made) == (True, None, None, 1)
