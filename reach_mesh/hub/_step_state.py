"""The state a workflow's steps run on: the workflow being run (:class:`Workflow`), a step's
retry policy, and the small pure helpers that make and update task records. Split from
:mod:`reach_mesh.hub._steps`, which runs the steps."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Final

from opentelemetry.context import Context
from pydantic_core import to_json

from reach_mesh import protocol
from reach_mesh.errors import (
    BadRequestError,
    PayloadTooLargeError,
    ReachError,
    TaskIdConflictError,
)
from reach_mesh.hub.registry import AgentView
from reach_mesh.models import ErrorBody, RouteRequest, TaskState
from reach_mesh.workflow import (
    AttemptRecord,
    StepSpec,
    TaskRecord,
    TaskStatusEvent,
    WorkflowEvent,
    WorkflowRecord,
    WorkflowResult,
    WorkflowSpec,
)

__all__ = [
    "NotOwnerError",
    "Policy",
    "TaskIdTaken",
    "TooLarge",
    "Unroutable",
    "Workflow",
    "backoff",
    "fit_result",
    "id_conflict",
    "kept_outcome",
    "new_record",
    "note",
    "record_bytes",
    "refused",
    "retryable",
    "sent",
    "settles",
    "step_route",
]


class NotOwnerError(Exception):
    """Another hub wrote this workflow's records: it owns the workflow now."""


class TaskIdTaken(Exception):
    """A step's task record is another workflow's: a caller-chosen task id used twice."""

    def __init__(self, workflow_id: str) -> None:
        super().__init__(workflow_id)
        self.workflow_id = workflow_id


class Unroutable(Exception):
    """The router refused a step's route as the caller's mistake (a ``BadRequestError``: a
    strategy it does not know, ...). That is the step's outcome — FAILED with ``error`` — and
    no infrastructure error: handed back, the workflow would fail the same way on every hub,
    forever, and its caller would never get an answer."""

    def __init__(self, error: BadRequestError) -> None:
        super().__init__(error.message)
        self.error = error


@dataclass(frozen=True, slots=True)
class Policy:
    retries: int
    fast_attempts: int
    base: float
    cap: float
    pending_interval: float
    ttl: float
    deliver_timeout: float
    silence_timeout: float
    #: The step's own ``timeout`` (one attempt's handler run), and how long past it an attempt
    #: still reported running is given before the hub takes it as a TIMEOUT.
    attempt_timeout: float
    overdue_grace: float


@dataclass(slots=True, eq=False)
class Workflow:
    spec: WorkflowSpec
    need: int
    deadline: float  # loop time
    submitted_at: float  # server wall time
    headers: dict[str, str]
    trace_id: str | None
    digest: str
    #: The submission's stream sequence (``WorkflowRecord.submission_seq``), if known.
    seq: int | None = None
    records: dict[int, TaskRecord] = field(default_factory=dict)
    #: Revision of this hub's write of the workflow record (the final write is a CAS on it).
    rev: int = 0
    #: Agents chosen for the attempts sent when this hub started the workflow (per step; None
    #: when none matched or the step starts later). A step takes its choice when it starts.
    first: list[tuple[AgentView, str | None] | None] = field(default_factory=list)
    #: The workflow record's ``first_agents`` (this hub's choices, or the stored record's
    #: when ``taken_over`` from another hub).
    first_agents: list[str | None] = field(default_factory=list)
    taken_over: bool = False
    #: Per step stopped undecided (a cancel, an unneeded branch): the outcomes it had in hand
    #: and had not applied (``StatusTracker.close``), for ``WorkflowShapes._cancel_step``.
    unapplied: dict[int, list[TaskStatusEvent]] = field(default_factory=dict)
    #: Per step stopped undecided: its record as its runner here had it and the revision of
    #: the runner's last write of it (``StepRunner._step``), for ``_cancel_step``: a read
    #: behind this hub's own write (a replica, with no leader to ask) is not the step's record.
    written: dict[int, tuple[TaskRecord, int]] = field(default_factory=dict)
    #: Events not sent yet (``StepRunner._event``): made (and their trace context written)
    #: only when sent, with the trace context current when they happened; and the timer.
    held: list[tuple[Callable[[], WorkflowEvent], Context]] = field(default_factory=list)
    hold_timer: asyncio.TimerHandle | None = None
    #: Set by a cancel (:meth:`cancel`): the error the workflow ends with. Made when first
    #: needed (a shape waits on it, or a cancel comes first).
    stop: asyncio.Future[ErrorBody] | None = None
    #: The task running a chain's step (inline: the workflow's own task) while it runs one:
    #: a cancel interrupts it there (``interrupted``), and ``WorkflowShapes._chain`` takes
    #: the interruption back (``Task.uncancel``) to stop the step. No task of its own: that
    #: cost a chain(3) 8 % of its throughput.
    step_task: asyncio.Task[Any] | None = None
    interrupted: bool = False
    #: The cancel is in the workflow record (``WorkflowShapes._record_cancel``): written by
    #: this hub, or found there when it took the workflow over.
    cancel_recorded: bool = False
    #: The result is the cancel's (its final record keeps ``cancel``: how a cancel's answer
    #: tells it from a step's error of the same code).
    cancel_won: bool = False
    #: The fanout cancelled the branches it had not seen end (its policy met, a cancel, an
    #: error): one that runs on through its cancellation (an await in it swallowed it) starts
    #: nothing more (:meth:`halted`).
    branches_stopped: bool = False

    def stopper(self) -> asyncio.Future[ErrorBody]:
        """The future a cancel sets (:attr:`stop`), made on first use."""
        if self.stop is None:
            self.stop = asyncio.get_running_loop().create_future()
        return self.stop

    def cancel(self, error: ErrorBody) -> bool:
        """Stop the workflow with ``error`` (its shape cancels the steps not finished, as a
        policy's unneeded branches, and ends FAILED); False when asked before."""
        stop = self.stopper()
        if stop.done():
            return False
        stop.set_result(error)
        if self.step_task is not None and not self.interrupted:
            self.interrupted = True
            self.step_task.cancel()
        return True

    def take_back(self) -> bool:
        """After a chain step was interrupted (or ran on through the interruption): take the
        cancel back from the workflow's task; False when it is cancelled for another reason
        too (the hub stops), or was not interrupted."""
        if not self.interrupted:
            return False
        self.interrupted = False
        task = asyncio.current_task()
        return task is not None and task.uncancel() == 0

    def halted(self) -> bool:
        """Whether the step that asks was stopped — a fanout's branch its fanout no longer
        waits for (``branches_stopped``), a chain's step a cancel interrupted — and runs on
        only because an await in it swallowed the cancellation (Python 3.11's ``wait_for``,
        under nats-py's requests, returns a result that came with the cancel: raised again
        now, ``_nats._Connection``; this is the backstop for any other such await). Such a step
        records and sends no new attempt and watches none on (``StepRunner._step``, ``_watch``):
        it ends as cancelled, and its shape stops it as any other. An outcome it has in hand
        still decides it (``WorkflowShapes._fanout``'s ``ran_on``)."""
        return self.branches_stopped or self.interrupted

    def first_agent(self, index: int) -> str | None:
        """The agent the workflow record names for step ``index``'s attempt 1, if any."""
        return self.first_agents[index] if index < len(self.first_agents) else None

    @property
    def ns(self) -> str:
        return self.spec.namespace

    @property
    def id(self) -> str:
        return self.spec.workflow_id


#: Route requests by step target: workflows repeat the same few targets, and a request is
#: made and validated once per target (never changed after; bounded: cleared when full).
_ROUTES: dict[tuple[str | None, str | None, str | None, str | None], RouteRequest] = {}
_ROUTES_MAX: Final = 4096


def step_route(step: StepSpec) -> RouteRequest:
    """The route request that chooses a step's agent."""
    key = (step.agent_id, step.capability, step.selector, step.strategy)
    route = _ROUTES.get(key)
    if route is None:
        route = RouteRequest(
            agent_id=step.agent_id,
            capability=step.capability,
            selector=step.selector,
            strategy=step.strategy,
        )
        if len(_ROUTES) >= _ROUTES_MAX:
            _ROUTES.clear()
        _ROUTES[key] = route
    return route


def new_record(wf: Workflow, index: int, task_id: str, created_at: float) -> TaskRecord:
    """A step's record before any attempt (attempt 0, no agent)."""
    return TaskRecord(
        task_id=task_id,
        workflow_id=wf.id,
        step=index,
        namespace=wf.ns,
        created_at=created_at,
        updated_at=created_at,
    )


def id_conflict(wf: Workflow, index: int, task_id: str, other: str) -> TaskRecord:
    """The outcome of a step whose task id another workflow holds: FAILED, never sent (not
    written: the record under that key is the other workflow's)."""
    err = TaskIdConflictError(
        f"step {index}: task id {task_id!r} belongs to workflow {other!r} of namespace "
        f"{wf.ns!r}; a task id names one step of one workflow",
        task_id=task_id,
        workflow_id=other,
    )
    return refused(wf, index, task_id, err)


def refused(wf: Workflow, index: int, task_id: str, err: ReachError) -> TaskRecord:
    """The outcome of a step the hub does not send, for ``err``: FAILED, never run, and not
    written — the same on every owner that gets there (the refusal follows from what is
    stored)."""
    rec = new_record(wf, index, task_id, time.time())
    rec.state = TaskState.FAILED
    rec.error = ErrorBody(code=err.code, message=err.message, details=err.details)
    return rec


def sent(rec: TaskRecord, agent_id: str) -> None:
    """``rec`` as attempt 1 sent to ``agent_id``."""
    rec.attempt = 1
    rec.agent_id = agent_id
    rec.history = [AttemptRecord(attempt=1, agent_id=agent_id)]


def note(rec: TaskRecord, event: TaskStatusEvent) -> None:
    """Write an attempt's final state into the record's history."""
    for h in reversed(rec.history):
        if h.attempt == event.attempt:
            h.state = event.state
            h.code = event.error.code if event.error else None
            return


def retryable(event: TaskStatusEvent) -> bool:
    if event.state is TaskState.TIMEOUT:
        return True
    err = event.error
    if err is None:
        return True
    return err.details.get("retryable", True) is not False


def settles(event: TaskStatusEvent, failures: int, retries: int) -> tuple[bool, int]:
    """Whether an attempt's final status decides its step — a success, a failure not to be
    retried, or one past ``retries`` handler failures — and the step's handler failures
    counted with it (``failures`` before it)."""
    if event.state is TaskState.SUCCEEDED or not retryable(event):
        return True, failures
    return failures + 1 > retries, failures + 1


def backoff(n: int, base: float, cap: float) -> float:
    """base * 2**(n-1), capped, with equal jitter (half fixed, half random)."""
    d = float(min(cap, base * float(2 ** max(0, n - 1))))
    return d / 2 + random.uniform(0, d / 2)


class TooLarge(Exception):
    """A workflow whose record could never be written (``error`` says why): rejected, as a
    malformed submission is."""

    def __init__(self, error: PayloadTooLargeError) -> None:
        super().__init__(error.message)
        self.error = error


def record_bytes(record: WorkflowRecord, result_json: bytes) -> bytes:
    """``protocol.encode(record)``, byte for byte, with its result encoded already
    (``result_json``: ``protocol.encode(record.result)``, which ``.done`` sends too): the
    result is the last field a final record writes (``submission_seq``, after it, is None
    there). Encoding the result once instead of twice was ~1 % of a hub's CPU per workflow."""
    assert record.result is not None and record.submission_seq is None
    head = record.model_dump_json(exclude_none=True, exclude=_RESULT).encode()
    return head[:-1] + (b',"result":' if len(head) > 2 else b'"result":') + result_json + b"}"


_RESULT: Final = {"result"}


def fit_result(
    result: WorkflowResult, limit: int, other: int, *, steps: bool = False
) -> WorkflowResult:
    """What a workflow record can hold of ``result`` in ``limit`` bytes, ``other`` of them
    taken by the record's other fields.

    Errors go first — the workflow's and the steps' are cut to their code, 200 characters and
    ``retryable`` — then results: kept in step order while they fit (a later, smaller one may
    still fit), the others left out (null) and named in ``details.results_left_out``.
    ``steps``: the last resort, no steps at all (``details.steps_left_out``). When anything
    is left out, a workflow that had SUCCEEDED ends FAILED with ``REACH_PAYLOAD_TOO_LARGE``
    (its caller cannot have its results), any other keeps its state and error, with those
    details added (and ``record_max_size``)."""
    fanout, n = result.kind == "fanout", len(result.steps)
    cut = [
        s.model_copy(update={"result": None, "error": None if s.error is None else _cut(s.error)})
        for s in result.steps
    ]
    error = None if result.error is None else _cut(result.error)
    bare = result.model_copy(
        update={"steps": cut, "result": [None] * n if fanout else None, "error": error}
    )
    # The room left, less the words and the list of an error saying what was left out.
    budget = limit - other - len(protocol.encode(bare)) - 2048 - 8 * n
    last_output = result.kind == "chain" and result.state is TaskState.SUCCEEDED
    left_out: list[int] = []
    for i, (was, now) in enumerate(zip(result.steps, cut, strict=True)):
        if was.result is None:
            continue
        # A fanout's ``result`` lists its succeeded results again; a chain's is its output.
        weight = 2 if (fanout and was.ok) or (last_output and i == n - 1) else 1
        size = len(to_json(was.result)) * weight
        if steps or size > budget:
            left_out.append(was.index)
        else:
            budget -= size
            now.result = was.result
    kept = [s.result if s.ok else None for s in cut] if fanout else None
    if not left_out and not steps:
        output = cut[-1].result if last_output and cut else None
        return bare.model_copy(update={"result": kept if fanout else output})
    room: dict[str, Any] = {"results_left_out": left_out, "record_max_size": limit}
    if steps:
        room["steps_left_out"] = True
    state = result.state
    if state is TaskState.SUCCEEDED or error is None:
        state = TaskState.FAILED
        err = PayloadTooLargeError(
            f"the workflow's results do not fit in its record ({limit} bytes: the NATS "
            f"server's max_payload less {protocol.MESSAGE_ROOM}): those in "
            "details.results_left_out are left out; each stays in its agent's final status "
            "on REACH_STATUS",
            **room,
        )
        error = ErrorBody(code=err.code, message=err.message, details=err.details)
    else:
        error = error.model_copy(update={"details": {**error.details, **room}})
    return bare.model_copy(
        update={"state": state, "steps": [] if steps else cut, "result": kept, "error": error}
    )


def kept_outcome(event: TaskStatusEvent, limit: int) -> TaskStatusEvent:
    """A final status from an agent that does not cap what it sends, as the step's records
    can hold it: a result over ``limit`` bytes of JSON (the server's ``max_payload`` less
    ``MESSAGE_ROOM``, what the SDK's agents keep under) is that attempt's failure
    ``REACH_PAYLOAD_TOO_LARGE``, not retried — what such an agent answers itself; a long
    error is cut (as :func:`fit_result` cuts it). Only for a status message over ``limit``:
    a smaller one fits a record with its other fields (``MESSAGE_ROOM`` holds them: the
    history keeps at most 32 attempts, each with an error code of at most 64 characters)."""
    if not event.state.final:
        return event
    size = 0 if event.result is None else len(to_json(event.result))
    if size > limit:
        err = PayloadTooLargeError(
            f"the agent's result is {size} bytes of JSON, over the {limit} bytes a step's "
            f"record may hold (the NATS server's max_payload less {protocol.MESSAGE_ROOM})",
            retryable=False,
            size=size,
            max_size=limit,
        )
        error = ErrorBody(code=err.code, message=err.message, details=err.details)
        return event.model_copy(update={"state": TaskState.FAILED, "result": None, "error": error})
    if event.error is not None:
        return event.model_copy(update={"error": _cut(event.error)})
    return event


def _cut(error: ErrorBody) -> ErrorBody:
    """An error as a record short of room keeps it: as it is when short (a message of 200
    characters, details of 512 bytes at most), else its code, 200 characters of message and
    ``retryable``."""
    if len(error.message) <= 200 and len(to_json(error.details)) <= 512:
        return error
    keep = {k: error.details[k] for k in ("retryable",) if k in error.details}
    return ErrorBody(code=error.code, message=error.message[:200], details=keep)
