"""Durable workflows: what a caller writes (:class:`Step`), what crosses the wire
(:class:`WorkflowSpec`, :class:`TaskStatusEvent`, records in KV) and what comes back
(:class:`WorkflowResult`).

Pure: no I/O. The engine lives in :mod:`reach_mesh.hub.workflows`, the agent side in
:mod:`reach_mesh.agent._work` (and ``_fences``); ``docs/workflows.md`` explains the design and
``docs/protocol-workflows.md`` the wire format.
"""

from __future__ import annotations

import hashlib
import os
import re
from typing import Any, Final, Literal, Protocol, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from pydantic_core import to_json

from reach_mesh import protocol
from reach_mesh.errors import (
    BadRequestError,
    PayloadTooLargeError,
    ReachError,
    SelectorError,
    WorkflowSpecError,
    error_from_wire,
)
from reach_mesh.models import ErrorBody, TaskState
from reach_mesh.selector import Selector

__all__ = [
    "MAX_STEPS",
    "CancelResult",
    "RetryPolicy",
    "Step",
    "StepResult",
    "StepSpec",
    "StepView",
    "TaskRecord",
    "TaskStatusEvent",
    "WorkflowEvent",
    "WorkflowKind",
    "WorkflowList",
    "WorkflowRecord",
    "WorkflowResult",
    "WorkflowSpec",
    "WorkflowSummary",
    "WorkflowView",
    "check_payload_sizes",
    "input_too_large",
    "merge_payload",
    "parse_policy",
    "spec_digest",
    "step_task_id",
    "validate_spec",
]

MAX_STEPS: Final = 256
WorkflowKind = Literal["fanout", "chain"]
#: ASCII: without it ``\d`` and ``\s`` match other scripts' digits and spaces (which ``int``
#: reads too: ``quorum(\u0661)``, an Arabic-Indic one, was a quorum of 1).
_QUORUM_RE: Final = re.compile(r"^quorum\(\s*(\d{1,6})\s*\)$", re.ASCII)


class _Wire(BaseModel):
    model_config = ConfigDict(extra="ignore", str_max_length=1 << 20)


#: The longest timeout or interval a workflow may ask for (a day, as a route's ``timeout``):
#: an infinite one passed ``gt=0``.
SECONDS_MAX: Final = 86400.0
#: The shortest retry backoff a workflow may ask for (``RetryPolicy.backoff_*``), seconds.
BACKOFF_MIN: Final = 0.01
#: The shortest re-delivery interval and delivery/silence timeout a workflow may ask for.
INTERVAL_MIN: Final = 0.1


class RetryPolicy(_Wire):
    """Per-step retry and delivery intervals; ``None`` fields take the hub's settings.

    The intervals have floors (``BACKOFF_MIN``, ``INTERVAL_MIN``) that the hub applies when it
    runs the step (``StepRunner._policy``): they pace what it does for the step (KV writes,
    work messages, re-checks), and a caller must not be able to set it spinning. A spec under
    a floor is taken as sent and run at the floor — refusing it would fail a running
    workflow that a hub of an earlier version accepted, and change no digest."""

    #: Handler failures (retryable ones) to retry.
    retries: int | None = Field(default=None, ge=0, le=100)
    #: Delivery attempts with exponential backoff before slow pending re-delivery.
    fast_attempts: int | None = Field(default=None, ge=0, le=100)
    backoff_base: float | None = Field(default=None, gt=0, le=SECONDS_MAX)
    backoff_cap: float | None = Field(default=None, gt=0, le=SECONDS_MAX)
    pending_interval: float | None = Field(default=None, gt=0, le=SECONDS_MAX)
    #: How long the step may stay unfinished before it is TIMEOUT.
    ttl: float | None = Field(default=None, gt=0, le=SECONDS_MAX)
    deliver_timeout: float | None = Field(default=None, gt=0, le=SECONDS_MAX)
    silence_timeout: float | None = Field(default=None, gt=0, le=SECONDS_MAX)


class StepSpec(_Wire):
    """One branch of a fanout or one step of a chain, on the wire."""

    agent_id: str | None = None
    capability: str | None = None
    selector: str | None = Field(default=None, max_length=4096)
    payload: Any = None
    #: Seconds one attempt's handler may run (enforced by the agent).
    timeout: float = Field(default=30.0, gt=0, le=86400)
    retry: RetryPolicy = Field(default_factory=RetryPolicy)
    task_id: str | None = None
    strategy: str | None = Field(default=None, max_length=32)


class WorkflowSpec(_Wire):
    """caller → hubs on ``reach.wf.<ns>.submit`` (``Nats-Msg-Id`` =
    ``<ns>.<workflow_id>.<nonce>``: ``protocol.submit_msg_id``)."""

    workflow_id: str
    kind: WorkflowKind
    steps: list[StepSpec] = Field(max_length=MAX_STEPS)
    policy: str = "all"
    #: Seconds from submission (JetStream server time) until unfinished steps are TIMEOUT.
    timeout: float | None = Field(default=None, gt=0, le=SECONDS_MAX)
    namespace: str = protocol.DEFAULT_NAMESPACE


class Step:
    """One step of a workflow, as a caller writes it.

    Exactly one target: ``agent_id`` (that agent), ``capability`` (any agent with it) or
    ``selector`` (``"cap=nlp:intent:v1 AND region=cn-east"``). ``timeout`` bounds one attempt of
    the handler; ``retries`` is how many retryable handler failures are retried; ``retry`` sets
    the rest of the retry policy (backoff, pending interval, ttl). ``task_id`` defaults to
    ``<workflow_id>-<index>`` so a re-submitted workflow finds its steps again.
    """

    __slots__ = (
        "agent_id",
        "capability",
        "payload",
        "retries",
        "retry",
        "selector",
        "task_id",
        "timeout",
    )

    def __init__(
        self,
        *,
        agent_id: str | None = None,
        capability: str | None = None,
        selector: str | None = None,
        payload: Any = None,
        timeout: float = 30.0,
        retries: int | None = None,
        retry: RetryPolicy | None = None,
        task_id: str | None = None,
    ) -> None:
        self.agent_id = agent_id
        self.capability = capability
        self.selector = selector
        self.payload = payload
        self.timeout = timeout
        self.retries = retries
        self.retry = retry or RetryPolicy()
        self.task_id = task_id

    def spec(self) -> StepSpec:
        """The wire form (validated by :func:`validate_spec`)."""
        return StepSpec(
            agent_id=self.agent_id,
            capability=self.capability,
            selector=self.selector,
            payload=self.payload,
            timeout=self.timeout,
            # ``retries`` validated here with the rest (a WorkflowSpecError before sending).
            retry=self.retry
            if self.retries is None
            else {**self.retry.model_dump(), "retries": self.retries},
            task_id=self.task_id,
        )

    def __repr__(self) -> str:
        target = self.agent_id or self.capability or self.selector
        return f"Step({target!r})"


# --------------------------------------------------------------------------- validation


def parse_policy(policy: str, branches: int) -> int:
    """How many successes complete a fanout: ``all`` → branches, ``any`` → 1,
    ``quorum(k)`` → k. Raises ``WorkflowSpecError`` for anything else."""
    if policy == "all":
        return branches
    if policy == "any":
        return 1
    m = _QUORUM_RE.fullmatch(policy)
    if m is None:
        raise WorkflowSpecError(
            f"unknown policy {policy!r}: expected 'all', 'any' or 'quorum(k)'",
            field="policy",
            value=policy[:100],
        )
    k = int(m.group(1))
    if not 1 <= k <= branches:
        raise WorkflowSpecError(
            f"policy {policy!r} needs {k} successes but the fanout has {branches} branches",
            field="policy",
            value=policy,
            branches=branches,
        )
    return k


def validate_spec(spec: WorkflowSpec) -> int:
    """Check a workflow spec; return the number of successes that complete it.

    Raises ``WorkflowSpecError`` (empty, unknown policy, quorum > branches, a step without
    exactly one target, an unknown strategy), ``InvalidAgentIdError``, ``InvalidCapabilityError``,
    ``SelectorError`` (with the position) or ``BadRequestError`` for a bad id.
    """
    protocol.validate_workflow_id(spec.workflow_id)
    protocol.validate_namespace(spec.namespace)
    if not spec.steps:
        raise WorkflowSpecError(f"a {spec.kind} needs at least one step", field="steps")
    need = parse_policy(spec.policy, len(spec.steps)) if spec.kind == "fanout" else len(spec.steps)
    if spec.kind == "chain" and spec.policy != "all":
        raise WorkflowSpecError("a chain has no completion policy", field="policy")
    task_ids: set[str] = set()
    for i, step in enumerate(spec.steps):
        given = [n for n in ("agent_id", "capability", "selector") if getattr(step, n)]
        if len(given) != 1:
            raise WorkflowSpecError(
                f"step {i}: exactly one of agent_id, capability, selector is required"
                + (f" (got {', '.join(given)})" if given else ""),
                field=f"steps.{i}",
                step=i,
            )
        try:
            if step.agent_id is not None:
                protocol.validate_agent_id(step.agent_id)
                if protocol.namespace_of(step.agent_id) != spec.namespace:
                    raise WorkflowSpecError(
                        f"agent {step.agent_id!r} is not in namespace {spec.namespace!r}",
                        field=f"steps.{i}.agent_id",
                        step=i,
                    )
            elif step.capability is not None:
                protocol.validate_capability(step.capability)
            elif step.selector is not None:
                Selector.parse(step.selector)
            if step.task_id is not None:
                protocol.validate_task_id(step.task_id)
            if step.strategy is not None and step.strategy not in protocol.STRATEGY_NAMES:
                # Refused here: the router would refuse it each time the step is placed.
                expected = sorted(protocol.STRATEGY_NAMES)
                raise WorkflowSpecError(
                    f"unknown strategy {step.strategy!r}: expected one of {', '.join(expected)} "
                    "(or none: the hub's default_strategy)",
                    field=f"steps.{i}.strategy",
                    value=step.strategy,
                    expected=expected,
                )
        except (BadRequestError, SelectorError) as err:
            err.details.setdefault("step", i)
            err.message = f"step {i}: {err.message}"
            err.args = (err.message,)
            raise
        tid = step_task_id(spec.workflow_id, i, step)
        if tid in task_ids:
            raise WorkflowSpecError(f"step {i}: duplicate task_id {tid!r}", step=i)
        task_ids.add(tid)
    return need


def input_too_large(index: int, payload: Any, max_payload: int) -> PayloadTooLargeError | None:
    """The error of step ``index`` when its input is over ``max_payload`` bytes of JSON (what
    an agent takes in a task: ``docs/protocol.md``, "Sizes"), else None."""
    size = len(to_json(payload))
    if size <= max_payload:
        return None
    return PayloadTooLargeError(
        f"step {index}: its input is {size} bytes of JSON, over the {max_payload} bytes "
        "(max_payload) an agent takes in a task",
        step=index,
        size=size,
        max_size=max_payload,
        retryable=False,
    )


def check_payload_sizes(spec: WorkflowSpec, size: int, max_payload: int) -> None:
    """Raise ``PayloadTooLargeError`` for the first step whose payload is over ``max_payload``
    (:func:`input_too_large`). ``size`` is the submission's: one within the limit cannot
    hold such a step, so nothing is encoded then (every submission a hub or caller sees)."""
    if size <= max_payload:
        return
    for i, step in enumerate(spec.steps):
        err = input_too_large(i, step.payload, max_payload)
        if err is not None:
            raise err


class _NamesItsTask(Protocol):
    task_id: str | None


def step_task_id(workflow_id: str, index: int, step: _NamesItsTask) -> str:
    """The task id of a step: the caller's, else ``<workflow_id>-<index>`` (deterministic, so a
    hub that takes the workflow over finds the step's record)."""
    return step.task_id or f"{workflow_id}-{index}"


def spec_digest(spec: WorkflowSpec) -> str:
    """A digest of what a workflow runs — kind, policy, namespace and steps, canonically
    encoded; not its ``timeout``, which says how long, not what. Two submissions under one
    workflow id are the same workflow only when their digests match (else: a conflict)."""
    what = spec.model_dump_json(exclude_none=True, include={"kind", "policy", "namespace", "steps"})
    return hashlib.sha256(what.encode()).hexdigest()[:32]


def new_workflow_id() -> str:
    """32 random hex digits (128 bits, as ``uuid4().hex`` gave, at a quarter of its cost)."""
    return os.urandom(16).hex()


def merge_payload(previous: Any, own: Any) -> Any:
    """The input of a chain step from the previous step's output and the step's own payload.

    - no own payload: the previous output, unchanged;
    - both are objects: the previous output with the step's keys added or overriding;
    - own payload is an object, the previous output is not: ``{"input": previous, **own}``;
    - own payload is not an object: the step's payload (it said exactly what it wants).
    """
    if own is None:
        return previous
    if isinstance(own, dict):
        if isinstance(previous, dict):
            return {**previous, **own}
        if previous is None:
            return own
        return {"input": previous, **own}
    return own


# --------------------------------------------------------------------------- status & records


class TaskStatusEvent(_Wire):
    """agent → hubs on ``reach.status.<agent_id>.<task_id>``: one six-state transition of one
    attempt (captured by the ``REACH_STATUS`` stream)."""

    task_id: str
    attempt: int = Field(ge=1)
    agent_id: str
    state: TaskState
    workflow_id: str | None = None
    step: int | None = None
    result: Any = None
    error: ErrorBody | None = None
    #: Free-form progress from ``task.progress(info)`` (RUNNING events).
    progress: Any = None
    cached: bool = False
    duration_ms: float = 0.0
    queued_ms: float = 0.0


class AttemptRecord(_Wire):
    attempt: int
    agent_id: str | None = None
    state: TaskState = TaskState.PENDING
    code: str | None = None


class TaskRecord(_Wire):
    """Value in ``reach_tasks`` (key ``<ns>.<task_id>``), written by the owning hub with CAS.

    ``attempt`` is the fence: a status from any other attempt is stale. An agent reads it before
    running a work message and drops attempts that are no longer current.

    The record is written when the fence must change: when the step must try again, when it is
    cancelled, and when its outcome is decided by anything but its current attempt (an earlier
    attempt's outcome, or the deadline); and before an attempt is sent, except the attempts
    sent when the workflow starts, which its ``WorkflowRecord`` names (``first_agents``):
    attempt 1 needs no fence until there is an attempt 2. A hub that takes a workflow over
    writes each unfinished step's record once (created from ``first_agents`` if it had none),
    so that a write of the previous owner still in flight fails. A step with a caller-chosen
    ``task_id`` does not start with the workflow: its record is created first, and that create
    claims the id (a record of another workflow under the key fails the step with
    ``REACH_TASK_ID_CONFLICT``). A step decided by its current
    attempt keeps its record as it was, or has none (that attempt's agent has the outcome;
    every other attempt is fenced by the attempt number already): the workflow record's result
    is where its outcome is kept (``StepResult.decided_by``).
    """

    task_id: str
    workflow_id: str
    step: int
    namespace: str
    attempt: int = 0
    agent_id: str | None = None
    state: TaskState = TaskState.PENDING
    result: Any = None
    error: ErrorBody | None = None
    handler_failures: int = 0
    delivery_failures: int = 0
    history: list[AttemptRecord] = Field(default_factory=list)
    #: Results rejected because their attempt was no longer current.
    stale: int = 0
    cancelled: bool = False
    cached: bool = False
    #: The attempt whose outcome decided the step (set with a final ``state``).
    decided_by: int | None = None
    #: Hub wall time (seconds since epoch) of creation and last write.
    created_at: float = 0.0
    updated_at: float = 0.0
    duration_ms: float = 0.0

    def is_step(self, workflow_id: str | None, step: int | None) -> bool:
        """Whether this is the record of that workflow's step — not of another workflow's
        step that named the same task id (``REACH_TASK_ID_CONFLICT``)."""
        return self.workflow_id == workflow_id and self.step == step


class StepResult(_Wire):
    """The outcome of one step."""

    index: int
    task_id: str
    state: TaskState
    agent_id: str | None = None
    attempts: int = 0
    #: The attempt whose outcome decided the step; for a TIMEOUT by the deadline, the attempt
    #: current then (None: cancelled, or timed out before any attempt was sent).
    decided_by: int | None = None
    result: Any = None
    error: ErrorBody | None = None
    #: Not run to the end: the policy was met without it, or an earlier chain step failed.
    cancelled: bool = False
    cached: bool = False
    stale: int = 0
    #: Handler time of the deciding attempt (agent clock) and wall time in the workflow.
    duration_ms: float = 0.0
    started_at: float | None = None
    finished_at: float | None = None

    @property
    def ok(self) -> bool:
        return self.state is TaskState.SUCCEEDED

    @property
    def exception(self) -> ReachError | None:
        """``error`` as the typed ``ReachError``."""
        return None if self.error is None else error_from_wire(self.error.model_dump())


class WorkflowResult(_Wire):
    """The honest, complete answer for one workflow (also the body of ``...<wf_id>.done``)."""

    workflow_id: str
    kind: WorkflowKind
    state: TaskState
    policy: str = "all"
    steps: list[StepResult] = Field(default_factory=list)
    #: A chain's final output; a fanout's list of branch results (``None`` where unfinished).
    result: Any = None
    #: The first failure (or the spec error), when ``state`` is not SUCCEEDED.
    error: ErrorBody | None = None
    trace_id: str | None = None
    hub_id: str | None = None
    submitted_at: float | None = None
    finished_at: float | None = None
    duration_ms: float = 0.0
    #: :func:`spec_digest` of the spec that ran (None for a submission refused as malformed,
    #: and from hubs before this field): a caller that submitted another spec under the same
    #: id learns from it that the result is not its workflow's.
    spec_digest: str | None = None

    @property
    def ok(self) -> bool:
        return self.state is TaskState.SUCCEEDED

    @property
    def exception(self) -> ReachError | None:
        return None if self.error is None else error_from_wire(self.error.model_dump())

    def raise_for_error(self) -> WorkflowResult:
        """Raise the typed error unless the workflow SUCCEEDED."""
        err = self.exception
        if err is not None and not self.ok:
            raise err
        return self


class WorkflowRecord(_Wire):
    """Value in ``reach_workflows`` (key ``<ns>.<workflow_id>``)."""

    spec: WorkflowSpec | None = None
    #: :func:`spec_digest` of the spec this id was first submitted with (kept in the final
    #: record, whose spec is dropped): a re-submission with another digest is a conflict.
    spec_digest: str | None = None
    state: TaskState = TaskState.RUNNING
    owner: str | None = None
    trace_id: str | None = None
    submitted_at: float | None = None
    #: Per step, the agent its attempt 1 was sent to when the workflow started (every fanout
    #: step, a chain's step 0; None: chosen later). Such a step has no task record until its
    #: fence must change (``TaskRecord``): a hub taking the workflow over adopts that attempt.
    first_agents: list[str | None] = Field(default_factory=list)
    #: A cancel its owner took (``reach.hub.<ns>.cancel``), written before any step is
    #: stopped for it: a hub that takes the workflow over finishes the cancel.
    cancel: ErrorBody | None = None
    result: WorkflowResult | None = None
    #: The stream sequence (``REACH_WF``) of the submission its owner runs it from: that
    #: message stays in the stream, unacked, until the result is stored. Another message of
    #: the same id while it runs (a re-submission: each is stored) is no takeover; that
    #: one, redelivered when its owner is gone, is (absent in records of older hubs).
    submission_seq: int | None = None

    @property
    def cancelled_before_start(self) -> bool:
        """A record holding only a cancel, made before any hub took the submission
        (``before_start``): the hub that takes it ends the workflow cancelled, unstarted."""
        return self.owner is None and self.result is None and self.cancel is not None


class WorkflowEvent(_Wire):
    """hub → ``reach.wf.<ns>.<wf_id>.event``: a step changed state (``kind=step``), or the
    workflow started (``kind=start``). The final result is on ``.done``."""

    workflow_id: str
    kind: Literal["start", "step", "done"]
    state: TaskState
    step: int | None = None
    task_id: str | None = None
    attempt: int | None = None
    agent_id: str | None = None
    error: ErrorBody | None = None
    #: ``start``: per step, the agent its attempt 1 is sent to right away (the workflow
    #: record's ``first_agents``); those attempts get no ``step`` PENDING event of their own.
    first_agents: list[str | None] | None = None
    result: WorkflowResult | None = None


class StepView(_Wire):
    """One step of a :class:`WorkflowView`: where it stands and what it went through."""

    index: int
    task_id: str
    #: What it asks for: ``agent_id=…``, ``capability=…`` or ``selector=…`` (None once the
    #: workflow is final: its record keeps the result, not the spec).
    target: str | None = None
    state: TaskState = TaskState.PENDING
    #: The current attempt (0: none sent yet) and the agent it went to (None: not sent yet);
    #: once the step is decided, the agent of the attempt that decided it (``decided_by``,
    #: which may be an earlier attempt: the first outcome of any attempt wins).
    attempt: int = 0
    agent_id: str | None = None
    decided_by: int | None = None
    #: The attempts recorded for the step, oldest first, at most the newest 32 (from its task
    #: record: only a step whose fence had to change has one, e.g. after a retry).
    history: list[AttemptRecord] = Field(default_factory=list)
    handler_failures: int = 0
    delivery_failures: int = 0
    error: ErrorBody | None = None
    cancelled: bool = False
    duration_ms: float | None = None
    #: Why it waits for an agent, and in how many seconds it tries again (the owner's view).
    waiting: str | None = None
    retry_in_s: float | None = None


class WorkflowView(_Wire):
    """hub → operator (``reach.hub.<ns>.workflow``): one workflow as it stands, running or
    final — its owner, each step's state, attempts, agents and errors. The result payloads are
    not in it (``Client.workflow`` returns them)."""

    workflow_id: str
    namespace: str
    kind: WorkflowKind | None = None
    state: TaskState = TaskState.RUNNING
    policy: str | None = None
    #: The hub running it (final: the hub that finished it).
    owner: str | None = None
    trace_id: str | None = None
    submitted_at: float | None = None
    finished_at: float | None = None
    duration_ms: float | None = None
    timeout: float | None = None
    error: ErrorBody | None = None
    steps: list[StepView] = Field(default_factory=list)
    #: The hub that built the view (the owner, when another hub asked it); ``live``: it is the
    #: owner and added what only the owner knows (each attempt's state, why a step waits).
    hub_id: str | None = None
    live: bool = False
    #: The owner the record names was asked for its live view and did not answer within a
    #: second (stopped, died, cut off or busy): this view was built from the records. A dead
    #: owner's workflows are taken over by another hub within ``workflow_ack_wait``.
    owner_silent: bool = False
    #: What could not be read (a stream or bucket that did not answer): the view is partial.
    unreadable: list[str] = Field(default_factory=list)


class WorkflowSummary(_Wire):
    """One workflow of a :class:`WorkflowList`, as its newest record has it."""

    #: Its namespace (None from hubs before this field).
    namespace: str | None = None
    workflow_id: str
    kind: WorkflowKind | None = None
    #: RUNNING until its result is stored; PENDING for one cancelled before any hub took it
    #: (it will not run: ``error`` says why), or one no hub has taken yet (no record: only
    #: its id and submission time are known).
    state: TaskState
    steps: int = 0
    #: Once final: the steps that did not succeed (failed, timed out, cancelled, or never run:
    #: a chain's steps after the one it failed at).
    failed_steps: int = 0
    owner: str | None = None
    trace_id: str | None = None
    submitted_at: float | None = None
    finished_at: float | None = None
    duration_ms: float | None = None
    #: While it runs: the seconds it may take from its submission (its spec's ``timeout``).
    timeout: float | None = None
    error: ErrorBody | None = None
    #: When its newest record was written (the server's time): the order of the list.
    updated_at: float


class WorkflowList(_Wire):
    """hub → caller or operator (``reach.hub.<ns>.workflows``): a namespace's workflows whose
    record was written in the window asked for, newest first (``reach-mesh workflows``); or,
    to an operator (``{"op": "workflows"}`` on ``reach.hub.<ns>.admin``), every namespace's.

    The bucket keeps each workflow's newest record, written when it starts and when it ends;
    the unfinished workflows not in the window (running since before it, or taken by no hub
    yet, whenever submitted: PENDING) are listed too, in the same order.
    ``truncated``: the window held more records than one list reads, and its older ones were
    not read (an older workflow may be missing), or not every unfinished older one was read;
    ``oldest_read_at``
    is the time of the oldest record read in the window."""

    #: The namespace listed; None: every namespace (an operator's list).
    namespace: str | None = None
    hub_id: str
    workflows: list[WorkflowSummary] = Field(default_factory=list)
    #: Workflows in the window that match the filter (``workflows`` holds the newest ``limit``).
    matched: int = 0
    #: Records read, and whether older ones of the window were left unread.
    scanned: int = 0
    truncated: bool = False
    since: float
    oldest_read_at: float | None = None


class CancelResult(_Wire):
    """hub → caller or operator (``reach.hub.<ns>.cancel``): what a cancel did.

    ``final``: the workflow has its one final result (``result``). ``cancelled``: that result
    is a cancel's (FAILED, error ``REACH_WORKFLOW_CANCELLED``: this request's or an earlier
    one's); False: the workflow had ended by itself before a cancel took effect. Not
    ``final``: its owner has the cancel and is stopping the workflow, but has not stored its
    result yet (``cancelled`` null: whether the cancel or the workflow's own end comes first
    is not known yet) — ask again (a cancel is idempotent) or wait for the result."""

    workflow_id: str
    namespace: str
    final: bool
    cancelled: bool | None = None
    state: TaskState
    #: The hub that runs (final: ran) it.
    owner: str | None = None
    result: WorkflowResult | None = None

    @property
    def recorded_before_start(self) -> bool:
        """The answer to a ``before_start`` cancel of a workflow no hub has started yet: the
        cancel is recorded, and nothing changes until a hub takes its submission."""
        return not self.final and self.owner is None and self.state is TaskState.PENDING


_Stored = TypeVar("_Stored", bound=BaseModel)


def stored_record(model: type[_Stored], got: tuple[bytes, int] | None) -> _Stored | None:
    """The record a KV read returned (``(value, revision)``, as ``JsClient.kv_get`` gives it):
    None when the key is absent or holds something that is not a ``model``."""
    if got is None:
        return None
    try:
        return model.model_validate_json(got[0])
    except ValidationError:
        return None
