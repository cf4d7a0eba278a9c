"""A step taken over with an attempt its previous owner gave up on (``lost``) whose success was
stored after the give-up, on a real nats-server: the new owner reads it — patiently, and again
after a while when ``REACH_STATUS`` does not answer — before it sends another attempt, and the
stored success decides the step (chaos secure seed 193, ``partition``)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from opentelemetry.trace import INVALID_SPAN_CONTEXT, NonRecordingSpan

from reach_mesh import (
    Client,
    MeshSettings,
    MeshUnavailableError,
    Step,
    WorkflowResult,
    protocol,
)
from reach_mesh.hub import Hub
from reach_mesh.models import TaskState
from reach_mesh.workflow import AttemptRecord, TaskRecord, TaskStatusEvent

from .helpers import Fleet, echo_agent, task_record
from .test_policy_takeovers import _owned_by_a_gone_hub

pytestmark = pytest.mark.timeout(60)


@contextlib.contextmanager
def _opened(tracker: Any, rec: TaskRecord) -> Iterator[Any]:
    """The step of ``rec`` tracked by ``tracker`` (closed after)."""
    key = protocol.task_key(rec.namespace, rec.task_id)
    track = tracker.open(rec, key, NonRecordingSpan(INVALID_SPAN_CONTEXT))
    try:
        yield track
    finally:
        tracker.close(track, None)


async def _taken_over(
    hub: Hub,
    fleet: Fleet,
    settings: MeshSettings,
    monkeypatch: pytest.MonkeyPatch,
    wf_id: str,
    refused: Callable[[bool], bool],
    timeout: float = 30,
) -> WorkflowResult:
    """A fanout of one step, ``wf_id`` (``timeout``), owned by a hub that is gone: attempt 1
    (on an agent that is there) given up as ``lost`` (its agent cut off, declared LOST) and
    fenced — attempt 2 recorded with no agent yet — before it died; attempt 1 had run, and
    its SUCCEEDED was stored after the give-up. The submission comes back to ``hub``
    (JetStream redelivers it: the owner died), whose status reads of the step are refused (no
    leader) while ``refused(patient)`` says so. The workflow's result."""
    ns = settings.namespace
    engine = hub.workflows
    assert engine is not None
    tracker = engine._tracker
    last_status = tracker.last_status
    branch = f"{wf_id}-0"

    async def no_leader(
        ns_: str, task_id: str, agent_id: str | None = None, *, patient: bool = False
    ) -> TaskStatusEvent | None:
        if task_id == branch and refused(patient):
            raise MeshUnavailableError("REACH_STATUS did not answer")
        return await last_status(ns_, task_id, agent_id, patient=patient)

    monkeypatch.setattr(tracker, "last_status", no_leader)
    cap = f"wf:{wf_id}:v1"
    agent = echo_agent(fleet, f"{wf_id}.a1", cap)
    await agent.start()
    steps = [Step(capability=cap, payload=0, timeout=10)]
    async with Client(settings=settings) as mesh:
        js = await _owned_by_a_gone_hub(
            mesh, ns, wf_id, steps, "all", agent.agent_id, timeout=timeout
        )
        tasks = await js.key_value(protocol.KV_TASKS)
        fenced = TaskRecord(
            task_id=branch,
            workflow_id=wf_id,
            step=0,
            namespace=ns,
            attempt=2,
            delivery_failures=1,
            created_at=time.time(),
            history=[AttemptRecord(attempt=1, agent_id=agent.agent_id, code="lost")],
        )
        await tasks.put(protocol.task_key(ns, branch), protocol.encode(fenced))
        status = TaskStatusEvent(
            task_id=branch,
            attempt=1,
            agent_id=agent.agent_id,
            state=TaskState.SUCCEEDED,
            workflow_id=wf_id,
            step=0,
            result="stored",
        )
        await js.publish(protocol.task_status(agent.agent_id, branch), protocol.encode(status))
        await mesh.submit_fanout(steps, policy="all", workflow_id=wf_id, timeout=timeout)
        return await mesh.workflow(wf_id, timeout=20)


def _decided_by_the_stored_success(res: WorkflowResult, fleet: Fleet) -> None:
    assert res.state is TaskState.SUCCEEDED, res
    got = res.steps[0]
    assert got.decided_by == 1 and got.result == "stored", got
    assert fleet.runs[got.task_id] == 0, "attempt 2 was sent and ran"


@pytest.mark.parametrize("unanswered", [1, 4])
async def test_a_given_up_attempts_stored_success_decides_the_step_taken_over(
    wf_hub: Hub,
    fleet: Fleet,
    wf_settings: MeshSettings,
    monkeypatch: pytest.MonkeyPatch,
    unanswered: int,
) -> None:
    """A fanout owned by a hub that is gone: its step's attempt 1 was given up as ``lost``
    (the record names attempt 2, no agent yet) and its SUCCEEDED was stored in
    ``REACH_STATUS`` after the give-up. The hub that takes the workflow over read the stored
    statuses (``catch_up``), found no answer (the stream without a leader), ignored the
    unread agent and sent attempt 2: the step ran again, the stored success thrown away.
    The status reads of the step fail ``unanswered`` times here (1: the takeover's read; 4:
    its patient read again, and the first read after a wait): the step must end with
    attempt 1's success, attempt 2 never sent."""
    ns = wf_settings.namespace
    wf_id = f"given-up-{unanswered}"
    branch = f"{wf_id}-0"
    reads: list[bool] = []

    def refused(patient: bool) -> bool:
        reads.append(patient)
        return len(reads) <= unanswered

    res = await _taken_over(wf_hub, fleet, wf_settings, monkeypatch, wf_id, refused)
    _decided_by_the_stored_success(res, fleet)
    rec: Any = await task_record(wf_hub.nc, ns, branch)
    assert rec is not None and rec.state is TaskState.SUCCEEDED, rec
    assert rec.decided_by == 1 and rec.result == "stored" and rec.attempt == 2, rec
    assert len(reads) > unanswered, reads
    if unanswered > 1:
        assert True in reads, "no patient read of the unanswered status"


async def test_only_attempts_given_up_are_read_before_a_new_one_once_each(
    wf_hub: Hub, wf_settings: MeshSettings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``given_up_read``: nothing is read for a step whose earlier attempts have outcomes (a
    retry after a handler failure: the hot path); an attempt given up on (``lost``) is read
    once, and not again once read; one whose read went unanswered (also patiently) holds the
    next attempt back (False) and is read again the next time."""
    ns = wf_settings.namespace
    engine = wf_hub.workflows
    assert engine is not None
    tracker = engine._tracker
    reads: list[tuple[str | None, bool]] = []
    answering = True

    async def counted(
        ns_: str, task_id: str, agent_id: str | None = None, *, patient: bool = False
    ) -> TaskStatusEvent | None:
        reads.append((agent_id, patient))
        if not answering:
            raise MeshUnavailableError("REACH_STATUS did not answer")
        return None

    monkeypatch.setattr(tracker, "last_status", counted)
    a1, a2 = f"{ns}.read.a1", f"{ns}.read.a2"
    failed = TaskRecord(
        task_id="read-0",
        workflow_id="read",
        step=0,
        namespace=ns,
        attempt=2,
        history=[AttemptRecord(attempt=1, agent_id=a1, state=TaskState.FAILED)],
    )
    track = tracker.open(
        failed, protocol.task_key(ns, "read-0"), NonRecordingSpan(INVALID_SPAN_CONTEXT)
    )
    try:
        assert await tracker.given_up_read(track) and reads == []
    finally:
        tracker.close(track, None)
    lost = TaskRecord(
        task_id="read-1",
        workflow_id="read",
        step=1,
        namespace=ns,
        attempt=3,
        history=[
            AttemptRecord(attempt=1, agent_id=a1, state=TaskState.FAILED),
            AttemptRecord(attempt=2, agent_id=a2, code="lost"),
        ],
    )
    track = tracker.open(
        lost, protocol.task_key(ns, "read-1"), NonRecordingSpan(INVALID_SPAN_CONTEXT)
    )
    try:
        answering = False
        assert not await tracker.given_up_read(track)
        assert reads == [(a2, False), (a2, True)], reads
        answering = True
        assert await tracker.given_up_read(track)
        assert reads[2:] == [(a2, False)], reads
        assert await tracker.given_up_read(track)
        assert len(reads) == 3, reads  # read once: not again
    finally:
        tracker.close(track, None)


async def test_a_given_up_attempts_stored_success_unread_at_the_deadline_decides_the_step(
    wf_hub: Hub, fleet: Fleet, wf_settings: MeshSettings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As above, the fanout (3 s) taken over with attempt 1 given up as ``lost`` and its
    SUCCEEDED stored, but ``REACH_STATUS`` refuses every read of the step until 2 s past the
    workflow's deadline (no leader): the new owner sends no attempt 2 on an unread status
    (``given_up_read``), and the deadline comes between attempts. There the hub read once,
    ignored the unread agent and ended the step TIMEOUT: the stored success thrown away. It
    now reads on (``given_up_final``: the bounded hold of the ``_watch`` deadline), and the
    stored success decides the step once the stream answers; attempt 2 never sent."""
    timeout = 3.0
    reads: list[float] = []

    def refused(patient: bool) -> bool:
        reads.append(time.monotonic() - t0)
        return reads[-1] < timeout + 2.0

    t0 = time.monotonic()
    res = await _taken_over(
        wf_hub, fleet, wf_settings, monkeypatch, "given-up-deadline", refused, timeout
    )
    took = time.monotonic() - t0
    _decided_by_the_stored_success(res, fleet)
    assert any(r >= timeout for r in reads), reads  # read at the deadline (and on)
    assert took < timeout + 6.0, f"decided {took:.1f}s after the submission"


def _nine_given_up(
    tracker: Any, ns: str, wf_id: str, monkeypatch: pytest.MonkeyPatch, *, attempt: int
) -> TaskRecord:
    """A step whose attempts 1-9, given up as ``lost``, went to nine agents, attempt 1's
    SUCCEEDED stored (``tracker``'s reads find it, and nothing for the others); its record
    names ``attempt``."""
    agents = [f"{ns}.{wf_id}.a{n}" for n in range(9)]
    success = TaskStatusEvent(
        task_id=f"{wf_id}-0",
        attempt=1,
        agent_id=agents[0],
        state=TaskState.SUCCEEDED,
        workflow_id=wf_id,
        step=0,
        result="stored",
    )

    async def stored(
        ns_: str, task_id: str, agent_id: str | None = None, *, patient: bool = False
    ) -> TaskStatusEvent | None:
        return success if agent_id == agents[0] else None

    monkeypatch.setattr(tracker, "last_status", stored)
    return TaskRecord(
        task_id=f"{wf_id}-0",
        workflow_id=wf_id,
        step=0,
        namespace=ns,
        attempt=attempt,
        history=[
            AttemptRecord(attempt=n + 1, agent_id=a, code="lost") for n, a in enumerate(agents)
        ],
    )


async def test_every_attempt_given_up_is_read_before_a_new_one(
    wf_hub: Hub, wf_settings: MeshSettings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A step whose attempts given up on went to more agents than one status read asks of
    (``_CATCH_UP_AGENTS``, 8): the oldest one's stored success was never read, and
    ``given_up_read`` said all was read — a new attempt sent, the step run again."""
    engine = wf_hub.workflows
    assert engine is not None
    tracker = engine._tracker
    rec = _nine_given_up(tracker, wf_settings.namespace, "many", monkeypatch, attempt=10)
    with _opened(tracker, rec) as track:
        read = await tracker.given_up_read(track)
        assert track.final is not None or not read, "attempt 1's stored success never read"


async def test_an_attempt_its_agent_promised_never_to_start_holds_no_retry_back(
    wf_hub: Hub, wf_settings: MeshSettings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Attempt 1 given up as ``undelivered`` after its agent promised never to start it (ctl
    ``task_state`` with ``fence``: ``"fenced": true``) stored nothing and never will: its
    unanswered status read (``REACH_STATUS`` electing a leader) must not hold attempt 2 back.
    It did, a ``step_deliver_timeout`` per try, until the stream answered again."""
    ns = wf_settings.namespace
    engine = wf_hub.workflows
    assert engine is not None
    tracker = engine._tracker
    reads: list[str | None] = []

    async def unanswered(
        ns_: str, task_id: str, agent_id: str | None = None, *, patient: bool = False
    ) -> TaskStatusEvent | None:
        reads.append(agent_id)
        raise MeshUnavailableError("REACH_STATUS did not answer")

    monkeypatch.setattr(tracker, "last_status", unanswered)
    rec = TaskRecord(
        task_id="promised-0",
        workflow_id="promised",
        step=0,
        namespace=ns,
        attempt=2,
        history=[AttemptRecord(attempt=1, agent_id=f"{ns}.promised.a1", code="undelivered")],
    )
    with _opened(tracker, rec) as track:
        track.promised = 1  # (as ``_ask`` notes the agent's "fenced": true for attempt 1)
        assert await tracker.given_up_read(track), reads
        assert reads == []


async def test_every_attempt_given_up_is_read_at_the_deadline(
    wf_hub: Hub, wf_settings: MeshSettings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The deadline reached between attempts reads every agent of the attempts given up on,
    as ``given_up_read`` does (b9227e7), not the newest ``_CATCH_UP_AGENTS`` (8): with nine,
    attempt 1's stored success (stored after ``given_up_read`` had checked it) was never
    read, and the step ended ``TIMEOUT`` — a valid result thrown away."""
    engine = wf_hub.workflows
    assert engine is not None
    tracker = engine._tracker
    rec = _nine_given_up(tracker, wf_settings.namespace, "late", monkeypatch, attempt=9)
    with _opened(tracker, rec) as track:
        await tracker.given_up_final(track)
        assert track.final is not None, "attempt 1's stored success never read"
        assert track.final.result == "stored"
