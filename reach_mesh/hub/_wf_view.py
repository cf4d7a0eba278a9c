"""One workflow as it stands, for the people running the mesh: the answer to
``reach.hub.<ns>.workflow`` (``reach-mesh workflow <id>``, ``Client.inspect_workflow``).

Any hub answers, from what is durable: the workflow record (its spec, owner and the agents the
steps that started with it went to; its result once final), each step's task record (its
attempts, when its fence ever had to change) and the newest status event of each step's
current attempt in ``REACH_STATUS``. When the answering hub is the owner the record names, and
still runs the workflow, it adds what only the owner knows: each attempt's state as its engine
tracks it and why a step waits for an agent.

A view is cheap and bounded, whatever the workflow: records are read without their payloads
(``_Slim*`` models: only what the view shows is built), at most :data:`_READS` steps are read at
once, and the whole view has :data:`VIEW_DEADLINE` seconds — a read that has not answered by
then (a JetStream election) is left out and named in ``unreadable``, never made up.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any, Final, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from reach_mesh import protocol
from reach_mesh.errors import InternalError, MeshUnavailableError, UnknownWorkflowError
from reach_mesh.hub import _durable
from reach_mesh.hub._tracking import StatusTracker
from reach_mesh.models import ErrorBody, TaskState
from reach_mesh.workflow import (
    AttemptRecord,
    StepView,
    WorkflowKind,
    WorkflowView,
    step_task_id,
)

__all__ = ["STEPS_PER_CHARGE", "VIEW_DEADLINE", "within_time", "workflow_view"]

#: Steps read at once (two reads each: the task record, the current attempt's last status).
_READS: Final = 16
#: Seconds a whole view may take; what has not been read by then is named in ``unreadable``.
#: Below the client's 5 s per-request patience, so a view through an election still arrives.
VIEW_DEADLINE: Final = 2.5
#: A view of more steps than this counts one more against its namespace's view budget per this
#: many steps (``ControlMixin._on_workflow``).
STEPS_PER_CHARGE: Final = 16


# --------------------------------------------------------------------------- slim records


class _Slim(BaseModel):
    """What a view reads of a stored record: payloads and results are skipped, not built."""

    model_config = ConfigDict(extra="ignore")


class _SlimStepSpec(_Slim):
    agent_id: str | None = None
    capability: str | None = None
    selector: str | None = None
    task_id: str | None = None


class _SlimSpec(_Slim):
    kind: WorkflowKind
    steps: list[_SlimStepSpec] = Field(default_factory=list)
    policy: str = "all"
    timeout: float | None = None


class _SlimStepResult(_Slim):
    index: int
    task_id: str
    state: TaskState
    agent_id: str | None = None
    attempts: int = 0
    decided_by: int | None = None
    error: ErrorBody | None = None
    cancelled: bool = False
    duration_ms: float = 0.0


class _SlimResult(_Slim):
    kind: WorkflowKind
    state: TaskState
    policy: str = "all"
    steps: list[_SlimStepResult] = Field(default_factory=list)
    error: ErrorBody | None = None
    trace_id: str | None = None
    hub_id: str | None = None
    finished_at: float | None = None
    duration_ms: float = 0.0


class _SlimRecord(_Slim):
    spec: _SlimSpec | None = None
    state: TaskState = TaskState.RUNNING
    owner: str | None = None
    trace_id: str | None = None
    submitted_at: float | None = None
    first_agents: list[str | None] = Field(default_factory=list)
    cancel: ErrorBody | None = None
    result: _SlimResult | None = None


class _SlimTaskRecord(_Slim):
    workflow_id: str
    step: int
    decided_by: int | None = None
    attempt: int = 0
    agent_id: str | None = None
    state: TaskState = TaskState.PENDING
    error: ErrorBody | None = None
    handler_failures: int = 0
    delivery_failures: int = 0
    history: list[AttemptRecord] = Field(default_factory=list)
    cancelled: bool = False


# --------------------------------------------------------------------------- the view


def _target(step: _SlimStepSpec) -> str:
    if step.agent_id is not None:
        return f"agent_id={step.agent_id}"
    if step.capability is not None:
        return f"capability={step.capability}"
    return f"selector={step.selector}"


_T = TypeVar("_T")


async def within_time(aw: Awaitable[_T], end: float) -> _T:
    """``aw``'s result if it comes before loop time ``end``, else ``TimeoutError``. Unlike
    ``wait_for``, a read that does not end when cancelled (nats-py's flush swallows the
    cancellation) is left to end by itself instead of being waited for."""
    job = asyncio.ensure_future(aw)
    job.add_done_callback(_retrieved)
    done, _ = await asyncio.wait({job}, timeout=max(0.0, end - asyncio.get_running_loop().time()))
    if not done:
        job.cancel()
        raise TimeoutError
    return job.result()


def _retrieved(job: asyncio.Future[Any]) -> None:
    """Mark a job's outcome as seen (one given up on may still fail later)."""
    if not job.cancelled():
        job.exception()


async def workflow_view(
    ns: str,
    workflow_id: str,
    *,
    hub_id: str,
    records: _durable.Bucket,
    tasks: _durable.Bucket,
    tracker: StatusTracker,
    running_here: bool,
    waiting: Callable[[int], dict[str, Any] | None] = lambda index: None,
    silent_agent: Callable[[str], str | None] = lambda agent_id: None,
    charge: Callable[[int], None] | None = None,
    ask_owner: Callable[[str, float], Awaitable[WorkflowView | None]] | None = None,
    within: float = VIEW_DEADLINE,
) -> WorkflowView:
    """The view of ``workflow_id`` in ``ns``, within ``within`` seconds. ``running_here``:
    this hub runs it (``tracker`` and ``waiting(step index)`` then hold its live state, used if
    the record names this hub the owner). ``silent_agent(agent_id)``: why a running step's
    agent may hold it up (its heartbeats stopped: ``WorkflowQueries._silent_agent``), or None.
    ``charge(steps)`` is called once the step count is
    known, before any step is read (it may raise ``ThrottledError``). ``ask_owner(hub_id,
    end)``: the view of the running workflow's owner, asked before reading anything else
    (None: it did not answer by loop time ``end``; this hub reads the records then).
    ``UnknownWorkflowError`` when it has no record."""
    end = asyncio.get_running_loop().time() + min(within, VIEW_DEADLINE)
    key = protocol.workflow_key(ns, workflow_id)
    try:
        got = await within_time(_durable.get(records, key), end)
    except Exception as err:
        raise MeshUnavailableError(
            f"the record of workflow {workflow_id!r} could not be read: {type(err).__name__}"
        ) from err
    if got is None:
        raise UnknownWorkflowError(
            f"no workflow {workflow_id!r} in namespace {ns!r}: never submitted, not taken by a "
            "hub yet, or finished longer ago than workflow_retention",
            workflow_id=workflow_id,
        )
    try:
        record = _SlimRecord.model_validate_json(got[0])
    except ValidationError as err:
        raise InternalError(
            f"the record of workflow {workflow_id!r} does not parse (written by another "
            f"version?): {err.error_count()} error(s)"
        ) from err
    if record.result is not None:
        steps = len(record.result.steps)
    else:
        steps = 0 if record.spec is None else len(record.spec.steps)
    if charge is not None:
        charge(steps)
    owner = record.owner
    owner_silent = False
    if (
        ask_owner is not None
        and record.result is None
        and owner is not None
        and owner != hub_id
        and protocol.HUB_ID_RE.fullmatch(owner)
    ):
        # Only the owner knows why a step waits: its view, if it answers in a second.
        seen = await ask_owner(owner, min(end - 1.0, asyncio.get_running_loop().time() + 1.0))
        if seen is not None and (seen.namespace, seen.workflow_id) == (ns, workflow_id):
            return seen
        owner_silent = seen is None  # (it answered, about something else: not silent)
    view = WorkflowView(
        workflow_id=workflow_id,
        namespace=ns,
        state=record.state,
        owner=record.owner,
        trace_id=record.trace_id,
        submitted_at=record.submitted_at,
        hub_id=hub_id,
        # A hub cut off from the stream may still run a workflow another hub took over.
        live=running_here and record.result is None and record.owner == hub_id,
        owner_silent=owner_silent,
    )
    result = record.result
    if result is None and record.owner is None and record.cancel is not None:
        view.error = record.cancel  # cancelled before any hub started it: it will not run
    if result is not None:
        view.kind, view.state, view.policy = result.kind, result.state, result.policy
        view.finished_at, view.duration_ms = result.finished_at, result.duration_ms
        view.error = result.error
        view.trace_id = view.trace_id or result.trace_id
        view.owner = result.hub_id or view.owner
        for s in result.steps:
            view.steps.append(
                StepView(
                    index=s.index,
                    task_id=s.task_id,
                    state=s.state,
                    attempt=s.attempts,
                    agent_id=s.agent_id,
                    decided_by=s.decided_by,
                    error=s.error,
                    cancelled=s.cancelled,
                    duration_ms=s.duration_ms,
                )
            )
    elif record.spec is not None:
        spec = record.spec
        view.kind, view.policy, view.timeout = spec.kind, spec.policy, spec.timeout
        first = record.first_agents
        for i, asked in enumerate(spec.steps):
            agent = first[i] if i < len(first) else None
            view.steps.append(
                StepView(
                    index=i,
                    task_id=step_task_id(workflow_id, i, asked),
                    target=_target(asked),
                    attempt=0 if agent is None else 1,
                    agent_id=agent,
                )
            )
    unread = await _complete_all(ns, workflow_id, view, tasks, tracker, end)
    if view.live:
        # After the reads: what the step waits for now, not when the view began.
        now = time.time()
        for step in view.steps:
            w = waiting(step.index)
            if w is not None and not step.state.final:
                step.waiting = w.get("why")
                left = float(w.get("retry_in_s") or 0.0) - (now - float(w.get("since") or now))
                step.retry_in_s = round(max(0.0, left), 3)
    if result is None:
        # A step out to an agent whose heartbeats stopped (hung, paused, cut off) is held
        # until that agent answers again or is declared LOST: said, or the step reads
        # DELIVERED and nothing more for up to lease_timeout + suspect_timeout (45 s by
        # default).
        for step in view.steps:
            if (
                step.waiting is None
                and step.agent_id is not None
                and not (step.state.final or step.cancelled)
            ):
                step.waiting = silent_agent(step.agent_id)
    unasked = "its owner did not answer" if owner_silent else "ask its owner"
    if view.kind == "chain" and result is None:
        for before, step in zip(view.steps, view.steps[1:], strict=False):
            if step.attempt > 0 or step.agent_id is not None or step.waiting is not None:
                continue
            if {before.index, step.index} & unread:
                continue  # what could not be read is not guessed at
            if before.state is TaskState.SUCCEEDED:
                # Started, yet no agent has it: only its owner knows why (no match, backoff).
                step.waiting = "no agent has it yet" + ("" if view.live else f" ({unasked})")
            else:
                step.waiting = f"not started: step {before.index} has not succeeded yet"
    return view


async def _complete_all(
    ns: str,
    workflow_id: str,
    view: WorkflowView,
    tasks: _durable.Bucket,
    tracker: StatusTracker,
    end: float,
) -> set[int]:
    """Complete every step by loop time ``end``, :data:`_READS` at a time; what could not be
    read is named in ``view.unreadable``, in step order. Returns those steps' indices."""
    gate = asyncio.Semaphore(_READS)
    unread: list[tuple[int, str]] = []

    async def one(step: StepView) -> None:
        async with gate:
            await _complete(ns, workflow_id, step, tasks, tracker, view.live, unread)

    jobs = {asyncio.ensure_future(one(s)): s for s in view.steps}
    for job in jobs:
        job.add_done_callback(_retrieved)
    try:
        if jobs:
            left = max(0.0, end - asyncio.get_running_loop().time())
            await asyncio.wait(jobs, timeout=left)
    finally:
        for job, step in jobs.items():
            if not job.done():
                job.cancel()  # not waited for: see ``within_time``
                unread.append((step.index, f"step {step.index} (no answer in time)"))
            elif not job.cancelled() and job.exception() is not None:
                name = type(job.exception()).__name__
                unread.append((step.index, f"step {step.index} ({name})"))
    view.unreadable = [text for _, text in sorted(unread)]
    return {index for index, _ in unread}


async def _complete(
    ns: str,
    workflow_id: str,
    step: StepView,
    tasks: _durable.Bucket,
    tracker: StatusTracker,
    live: bool,
    unread: list[tuple[int, str]],
) -> None:
    """Fill ``step`` from its task record, then (running) from the engine's track when this
    hub is the live owner, else from the current attempt's last status event."""
    final = step.state.final or step.cancelled
    key = protocol.task_key(ns, step.task_id)
    rec: _SlimTaskRecord | None = None
    try:
        got = await _durable.get(tasks, key)
        if got is not None:
            rec = _SlimTaskRecord.model_validate_json(got[0])
    except Exception as err:
        unread.append((step.index, f"task record of step {step.index} ({type(err).__name__})"))
    if rec is not None and (rec.workflow_id != workflow_id or rec.step != step.index):
        rec = None  # a caller-chosen task id another workflow of the namespace uses too
    if rec is not None:
        step.history = rec.history
        step.handler_failures, step.delivery_failures = rec.handler_failures, rec.delivery_failures
        if not final:
            step.attempt, step.agent_id, step.state = rec.attempt, rec.agent_id, rec.state
            step.error, step.cancelled = rec.error, rec.cancelled
            step.decided_by = rec.decided_by if rec.state.final else None
    if not (final or step.state.final or step.cancelled):
        await _current(ns, workflow_id, step, tracker, live, unread)
    # The deciding attempt's history entry was recorded before it ran (the record is not
    # written again when the current attempt decides): say how it ended.
    ended = step.attempt if step.decided_by is None else step.decided_by
    for h in step.history:
        if h.attempt == ended and h.agent_id == step.agent_id and not h.state.final:
            h.state = step.state


async def _current(
    ns: str,
    workflow_id: str,
    step: StepView,
    tracker: StatusTracker,
    live: bool,
    unread: list[tuple[int, str]],
) -> None:
    """The state of a running step's current attempt."""
    track = tracker.track(protocol.task_key(ns, step.task_id)) if live else None
    if track is not None and track.workflow_id != workflow_id:
        track = None  # the task id's step in another workflow
    if track is not None and track.agent_id is not None:
        step.attempt, step.agent_id = track.attempt, track.agent_id
        step.state = track.machine.state
        return
    if step.agent_id is None:
        return  # not sent yet: no status to read
    try:
        last = await tracker.last_state(ns, step.task_id, step.agent_id)
    except Exception as err:
        unread.append((step.index, f"status of step {step.index} ({type(err).__name__})"))
        return
    if last is not None and last[0] == step.attempt:
        step.state, step.error = last[1], last[2] or step.error
