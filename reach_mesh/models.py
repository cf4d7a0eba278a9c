"""Pydantic v2 wire models: what crosses NATS, as JSON.

Field names here are the protocol (``docs/protocol.md``). Validation errors are turned into typed
``ReachError``\\ s by :func:`reach_mesh.protocol.decode`.
"""

from __future__ import annotations

import enum
from typing import Annotated, Any, Final, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

from reach_mesh.errors import BadLeaseError, BadRequestError, InvalidCapabilityError
from reach_mesh.protocol import (
    TASK_ID_RE,
    validate_agent_id,
    validate_capability,
    validate_task_id,
)

__all__ = [
    "AgentCard",
    "AgentInfo",
    "AgentRecord",
    "AgentRef",
    "AgentState",
    "CordonRecord",
    "ErrorBody",
    "FailureReport",
    "FilteredAgent",
    "Heartbeat",
    "HeartbeatRecord",
    "HeartbeatReply",
    "RecordReply",
    "RecordRequest",
    "RegisterReply",
    "RegisterRequest",
    "RouteDecision",
    "RouteReply",
    "RouteRequest",
    "TaskEnvelope",
    "TaskReply",
    "TaskState",
    "ToolSpec",
    "UnregisterRequest",
    "label_key_ok",
    "lease_error",
]


class TaskState(enum.StrEnum):
    """The six-state ACK machine (plus PENDING before delivery)."""

    PENDING = "PENDING"
    DELIVERED = "DELIVERED"
    ACCEPTED = "ACCEPTED"
    RUNNING = "RUNNING"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    TIMEOUT = "TIMEOUT"

    @property
    def final(self) -> bool:
        return self in _FINAL


_FINAL = frozenset({TaskState.SUCCEEDED, TaskState.FAILED, TaskState.TIMEOUT})


class AgentState(enum.StrEnum):
    """Graded liveness of an agent, as a hub sees it."""

    PRE_ONLINE = "PRE_ONLINE"
    ONLINE = "ONLINE"
    SUSPECT = "SUSPECT"
    LOST = "LOST"
    QUARANTINED = "QUARANTINED"
    DRAINING = "DRAINING"
    CORDONED = "CORDONED"


class _Wire(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=False, str_max_length=1 << 20)


Label = Annotated[str, Field(min_length=1, max_length=256)]
LABEL_MAX: Final = 256


def label_key_ok(key: str) -> bool:
    """Whether ``key`` is a valid label key: ``[a-z0-9][a-z0-9_.-]*`` (any case), ASCII only —
    a selector's keys are (``selector.KEY_RE``): a key in another script could never be
    selected."""
    return (
        bool(key)
        and key.isascii()
        and key[0].isalnum()
        and all(c.isalnum() or c in "_.-" for c in key)
    )


class ToolSpec(_Wire):
    """A tool an agent offers: name, description and JSON Schema of its parameters.

    Checked when the agent registers (:meth:`check`, from ``RegisterRequest``), not here: a
    card stored by a hub of an earlier version must still load."""

    name: str = Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_.:-]+$")
    description: str = Field(default="", max_length=4096)
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object"})
    capability: str | None = None

    def check(self, index: int) -> None:
        """Raise ``InvalidCapabilityError`` for a capability no route takes (A2A and MCP call
        the tool through it), ``BadRequestError`` for parameters whose top level is not a
        JSON Schema (MCP clients refuse a tool menu holding one). Only the keywords the MCP
        tool schema types are checked: the schema is the agent's to write."""
        where = f"card.tools.{index}"
        if self.capability is not None:
            try:
                validate_capability(self.capability)
            except InvalidCapabilityError as err:
                err.message = f"tool {self.name!r} ({where}.capability): {err.message}"
                err.args = (err.message,)
                err.details.setdefault("field", f"{where}.capability")
                raise
        wrong = _schema_mistake(self.parameters)
        if wrong is not None:
            raise BadRequestError(
                f"tool {self.name!r} ({where}.parameters): not a JSON Schema: {wrong}; "
                "give the tool the JSON Schema of its arguments (an object)",
                field=f"{where}.parameters",
            )


def _schema_mistake(schema: dict[str, Any]) -> str | None:
    """What makes ``schema``'s top level no JSON Schema, in the keywords MCP types (``type``,
    ``properties``, ``required``, ``$schema``); None when nothing does."""
    kind, props, required = schema.get("type"), schema.get("properties"), schema.get("required")
    if kind is not None and not _strings(kind, one=True):
        return "type must be a string or a list of strings"
    if props is not None and not (
        isinstance(props, dict) and all(isinstance(v, dict | bool) for v in props.values())
    ):
        return "properties must be an object of schemas (objects or booleans)"
    if required is not None and not _strings(required, one=False):
        return "required must be a list of strings"
    if not isinstance(schema.get("$schema", ""), str):
        return "$schema must be a string"
    return None


def _strings(value: Any, *, one: bool) -> bool:
    """Whether ``value`` is a list of strings (or, with ``one``, a string too)."""
    if one and isinstance(value, str):
        return True
    return isinstance(value, list) and all(isinstance(v, str) for v in value)


class AgentCard(_Wire):
    """Who an agent is and what it can do."""

    agent_id: str
    capabilities: list[str] = Field(min_length=1, max_length=256)
    labels: dict[Label, Label] = Field(default_factory=dict, max_length=128)
    tools: list[ToolSpec] = Field(default_factory=list, max_length=256)
    max_concurrency: int = Field(default=16, ge=1, le=100_000)
    weight: float = Field(default=1.0, gt=0, le=1000)
    region: str | None = Field(default=None, max_length=64)
    zone: str | None = Field(default=None, max_length=64)
    metadata: dict[str, Any] = Field(default_factory=dict)
    version: str | None = Field(default=None, max_length=64)
    #: False: the agent has no JetStream work consumer; hubs do not offer it workflow steps.
    durable_work: bool = True
    #: True: the agent also takes task batches on ``reach.agent.<id>.batch`` (see protocol.md).
    batch: bool = False
    #: True: the agent takes several workflow steps in one work message (a work batch, see
    #: protocol-workflows.md); hubs send batches only to such agents.
    work_batch: bool = False

    @field_validator("agent_id")
    @classmethod
    def _agent_id(cls, v: str) -> str:
        return validate_agent_id(v)

    @field_validator("capabilities")
    @classmethod
    def _caps(cls, v: list[str]) -> list[str]:
        for cap in v:
            validate_capability(cap)  # its length too; raises with the bad value named
        return sorted(set(v))

    @field_validator("labels")
    @classmethod
    def _labels(cls, v: dict[str, str]) -> dict[str, str]:
        out: dict[str, str] = {}
        given: dict[str, str] = {}  # lower-cased key -> as written
        for key, val in v.items():
            if not label_key_ok(key):
                raise ValueError(f"invalid label key {key!r}: expected [a-z0-9][a-z0-9_.-]*")
            low = key.lower()
            if low in given:
                # Keys are read in any case: the two were one label, the last value kept.
                raise ValueError(
                    f"label keys {given[low]!r} and {key!r} differ only in case "
                    "(keys are read in any case): keep one"
                )
            given[low] = key
            out[low] = val
        return out

    @property
    def namespace(self) -> str:
        return self.agent_id.split(".", 1)[0]

    def all_labels(self) -> dict[str, str]:
        """Labels plus ``region``/``zone`` as labels, as the selector sees them."""
        labels = dict(self.labels)
        if self.region:
            labels.setdefault("region", self.region)
        if self.zone:
            labels.setdefault("zone", self.zone)
        return labels


#: The least time between two KV writes of an agent's unchanged heartbeat (a hub writes one
#: at most every ``max(BEAT_WRITE_GAP, heartbeat_interval / 4)``: ``Registry.heartbeat``). The
#: other hubs renew the agent's lease only by those writes.
BEAT_WRITE_GAP: Final = 0.05
#: The shortest ``heartbeat_interval`` a registration (and ``MeshSettings``) may ask for: two
#: write gaps, so that every beat of an agent at the minimum, sent up to 10 % early (its
#: jitter), is still a KV write the other hubs read.
MIN_HEARTBEAT_INTERVAL: Final = 2 * BEAT_WRITE_GAP
#: The shortest ``lease_timeout``: ten write gaps. A lease of 30 ms (an agent may choose it)
#: lapsed on every other hub between two writes, 50 ms apart at the least, so that they saw
#: the agent SUSPECT and ONLINE again all the time; the write's ack, the watch's delivery and
#: the server-clock estimate the other hubs age it by take a few ms more; and a beat sent
#: three times (each try waiting at least 50 ms) at the minimum interval still lands within
#: half of it.
MIN_LEASE_TIMEOUT: Final = 10 * BEAT_WRITE_GAP


def _floor(field: str, value: float) -> str | None:
    """Why ``value`` of ``field`` is below its minimum (None: it is not)."""
    if field == "heartbeat_interval" and not value >= MIN_HEARTBEAT_INTERVAL:
        return (
            f"{value:g}s is below the minimum of {MIN_HEARTBEAT_INTERVAL:g}s "
            f"(hubs write an unchanged beat to the registry at most every "
            f"{BEAT_WRITE_GAP * 1000:g} ms)"
        )
    if field == "lease_timeout" and not value >= MIN_LEASE_TIMEOUT:
        return (
            f"{value:g}s is below the minimum of {MIN_LEASE_TIMEOUT:g}s (the other "
            "hubs renew a lease by the registry's writes of its beats, at most one per "
            f"{BEAT_WRITE_GAP * 1000:g} ms: a shorter lease lapses between them)"
        )
    return None


def lease_error(heartbeat_interval: float, lease_timeout: float) -> BadLeaseError | None:
    """What is wrong with a lease of ``lease_timeout`` renewed every ``heartbeat_interval``
    (None: nothing): the rule of registrations and of ``MeshSettings`` alike."""
    fields = {"heartbeat_interval": heartbeat_interval, "lease_timeout": lease_timeout}
    for field, value in fields.items():
        why = _floor(field, value)
        if why is not None:
            return BadLeaseError(f"{field} {why}", field=field, **fields)
    if lease_timeout < 3 * heartbeat_interval - 1e-9:
        return BadLeaseError(
            f"lease_timeout {lease_timeout:g}s is shorter than 3 x heartbeat_interval "
            f"({3 * heartbeat_interval:g}s)",
            **fields,
        )
    return None


class RegisterRequest(_Wire):
    """agent → hub on ``reach.hub.<ns>.register``."""

    card: AgentCard
    #: A fresh id per agent process start; fences heartbeats from an older incarnation.
    session: str = Field(min_length=1, max_length=64)
    #: At least :data:`MIN_HEARTBEAT_INTERVAL` and :data:`MIN_LEASE_TIMEOUT` (``_minimum``:
    #: the error says why; the schema shows the bounds).
    heartbeat_interval: float = Field(
        default=5.0, le=3600, json_schema_extra={"minimum": MIN_HEARTBEAT_INTERVAL}
    )
    lease_timeout: float = Field(
        default=15.0, le=86400, json_schema_extra={"minimum": MIN_LEASE_TIMEOUT}
    )

    @field_validator("heartbeat_interval", "lease_timeout")
    @classmethod
    def _minimum(cls, v: float, info: ValidationInfo) -> float:
        why = _floor(str(info.field_name), v)
        if why is not None:
            raise ValueError(why)
        return v

    @model_validator(mode="after")
    def _lease(self) -> RegisterRequest:
        err = lease_error(self.heartbeat_interval, self.lease_timeout)
        if err is not None:
            raise err
        return self

    @model_validator(mode="after")
    def _tools(self) -> RegisterRequest:
        for i, tool in enumerate(self.card.tools):
            tool.check(i)
        return self


class RegisterReply(_Wire):
    agent_id: str
    session: str
    state: AgentState
    heartbeat_interval: float
    lease_timeout: float
    hub_id: str
    #: The hub's settings an agent needs and no other message carries (None from a hub of an
    #: earlier version): the largest result or progress (bytes of JSON) it takes, and how
    #: long past a lapsed lease it waits before it declares an agent lost (seconds).
    max_payload: int | None = None
    suspect_timeout: float | None = None
    #: Whether an operator cordoned this agent id (as :class:`HeartbeatReply`'s).
    cordoned: bool = False


#: The largest ``inflight`` / ``queue_depth`` a heartbeat may report (no agent runs or queues a
#: billion tasks; a float holds it exactly).
LOAD_MAX: Final = 1_000_000_000


class Heartbeat(_Wire):
    """agent → hub on ``reach.hub.<ns>.heartbeat``. Carries load, never a timestamp."""

    agent_id: str
    session: str = Field(min_length=1, max_length=64)
    #: At most :data:`LOAD_MAX` each: hubs score an agent's load in floats, and an integer no
    #: float holds (JSON has no bound) once made every route among that agent's peers
    #: ``REACH_INTERNAL`` (an ``OverflowError``), however well the others served.
    inflight: int = Field(default=0, ge=0, le=LOAD_MAX)
    queue_depth: int = Field(default=0, ge=0, le=LOAD_MAX)
    pressure: float = Field(default=0.0, ge=0.0, le=1.0)
    #: Capabilities the agent reports it cannot serve right now (e.g. a dependency is down).
    unavailable: list[str] = Field(default_factory=list, max_length=256)
    draining: bool = False

    @field_validator("agent_id")
    @classmethod
    def _agent_id(cls, v: str) -> str:
        return validate_agent_id(v)


class HeartbeatReply(_Wire):
    state: AgentState
    lease_timeout: float
    #: Whether an operator cordoned this agent id, as the answering hub knows it (its
    #: ``reach_cordons`` watch, or the agent's record). Only hubs answer heartbeats: the agent
    #: takes it as the word on its cordon, and refuses new task ids while it is true (absent
    #: from hubs before this field: ``state`` ``CORDONED`` says the same).
    cordoned: bool = False


class UnregisterRequest(_Wire):
    agent_id: str
    session: str | None = None

    @field_validator("agent_id")
    @classmethod
    def _agent_id(cls, v: str) -> str:
        return validate_agent_id(v)


class AgentRecord(_Wire):
    """Value in the ``reach_agents`` KV bucket."""

    card: AgentCard
    session: str
    heartbeat_interval: float
    lease_timeout: float
    task_subject: str
    #: Server-side wall time (seconds since epoch) of the hub that accepted the registration.
    registered_at: float
    #: Cordoned by an operator (also kept, apart from the registration, in ``reach_cordons``:
    #: :class:`CordonRecord`).
    cordoned: bool = False


class CordonRecord(_Wire):
    """Value in the ``reach_cordons`` KV bucket, key the agent id: an operator's cordon, which
    outlives the agent's registrations (an unregister, a restart, a lease that ran out) until
    an operator lifts it. Written by the hub that took the ``cordon``."""

    #: The operator's reason, as audited.
    reason: str | None = None
    #: Who asked, as that hub could tell (``_requester``); None in open mode.
    requester: str | None = None
    #: The hub's wall time (seconds since epoch) when it was written: for people, not leases.
    cordoned_at: float


class HeartbeatRecord(_Wire):
    """Value in the ``reach_heartbeats`` KV bucket (written by the hub that got the beat)."""

    session: str
    inflight: int = 0
    queue_depth: int = 0
    pressure: float = 0.0
    unavailable: list[str] = Field(default_factory=list)
    draining: bool = False


#: The longest error ``code`` kept: a longer one (from an agent that does not check) is cut
#: to this, so that a step's record, which keeps one per attempt, stays within its room.
ERROR_CODE_MAX: Final = 64


#: The largest ``RouteRequest.after_attempt``: attempts are counted per request, a few each.
MAX_AFTER_ATTEMPT: Final = 1_000_000


class ErrorBody(_Wire):
    #: At most ``ERROR_CODE_MAX`` characters: readers cut a longer one (what the schema says
    #: writers write).
    code: str = Field(json_schema_extra={"maxLength": ERROR_CODE_MAX})
    message: str
    details: dict[str, Any] = Field(default_factory=dict)

    @field_validator("code")
    @classmethod
    def _short_code(cls, code: str) -> str:
        return code[:ERROR_CODE_MAX]


#: What protocol-schemas.json says of a task id (``validate_task_id`` checks it: the schema of
#: a plain ``str`` field said only "at most 1 MiB").
TASK_ID_SCHEMA: Final[dict[str, Any]] = {
    "pattern": TASK_ID_RE.pattern,
    "minLength": 1,
    "maxLength": 64,
}


Mode = Literal["proxy", "direct"]


class RouteRequest(_Wire):
    """caller → hub on ``reach.hub.<ns>.route``. Exactly one of agent_id/capability/selector.

    Strict: a field of the wrong JSON type is refused (``REACH_BAD_REQUEST`` naming it), not
    converted — ``"timeout": true`` was a 1 s timeout, ``"explain": "yes"`` an explanation."""

    model_config = ConfigDict(extra="ignore", str_max_length=1 << 20, strict=True)

    agent_id: str | None = None
    capability: str | None = None
    selector: str | None = Field(default=None, max_length=4096)
    payload: Any = None
    task_id: str | None = Field(default=None, json_schema_extra=TASK_ID_SCHEMA)
    timeout: float = Field(default=30.0, gt=0, le=86400)
    mode: Mode = "proxy"
    strategy: str | None = Field(default=None, max_length=32)
    session_id: str | None = Field(default=None, min_length=1, max_length=256)
    hash_key: str | None = Field(default=None, max_length=1024)
    region: str | None = Field(default=None, max_length=64)
    zone: str | None = Field(default=None, max_length=64)
    explain: bool = False
    #: Only decide; do not deliver (implies ``explain``).
    dry_run: bool = False
    #: A retry of ``task_id`` after its attempt ``after_attempt`` timed out (the
    #: ``REACH_TIMEOUT``'s ``details.attempt``): the hub numbers this request's attempts from
    #: ``after_attempt + 1``, which an agent that timed out runs again (attempt 1 would get its
    #: stored TIMEOUT). Proxy mode; a direct-mode caller numbers its envelopes itself.
    after_attempt: int | None = Field(default=None, ge=0, le=MAX_AFTER_ATTEMPT)

    @field_validator("agent_id")
    @classmethod
    def _agent_id(cls, v: str | None) -> str | None:
        return None if v is None else validate_agent_id(v)

    @field_validator("capability")
    @classmethod
    def _capability(cls, v: str | None) -> str | None:
        return None if v is None else validate_capability(v)

    @field_validator("task_id")
    @classmethod
    def _task_id(cls, v: str | None) -> str | None:
        return None if v is None else validate_task_id(v)

    @model_validator(mode="after")
    def _one_target(self) -> RouteRequest:
        # agent_id may name the handler with capability; otherwise exactly one target.
        if self.after_attempt and self.task_id is None:
            raise ValueError("after_attempt needs the task_id whose attempt timed out")
        given = [n for n in ("agent_id", "capability", "selector") if getattr(self, n)]
        if given == ["agent_id", "capability"]:
            return self
        if len(given) != 1:
            raise ValueError(
                "exactly one of agent_id, capability, selector is required"
                + (f" (got {', '.join(given)})" if given else "")
            )
        return self


class TaskEnvelope(_Wire):
    """hub/caller → agent on ``reach.agent.<agent_id>.task``: one attempt of one task."""

    task_id: str = Field(json_schema_extra=TASK_ID_SCHEMA)
    attempt: int = Field(default=1, ge=1)
    #: The handler to run; ``None`` means the agent's only handler.
    capability: str | None = None
    payload: Any = None
    namespace: str = "default"
    #: Seconds the handler may take (relative: the agent measures it on its own clock).
    timeout: float = Field(default=30.0, gt=0, le=86400)
    workflow_id: str | None = None
    step: int | None = None
    #: Publish status events (DELIVERED/ACCEPTED/RUNNING/final) on reach.status.<agent_id>.<id>.
    track: bool = False

    @field_validator("task_id")
    @classmethod
    def _task_id(cls, v: str) -> str:
        # It keys the agent's idempotency cache and names a status subject: a direct-mode
        # caller must not key it with a megabyte (or a subject wildcard).
        return validate_task_id(v)


class RecordRequest(_Wire):
    """agent → a hub on ``reach.hub.<ns>.record.<service>.<instance>``: read the task record
    of ``task_id`` in the agent's namespace (the subject's) at the records' stream leader."""

    task_id: str = Field(json_schema_extra=TASK_ID_SCHEMA)

    @field_validator("task_id")
    @classmethod
    def _task_id(cls, v: str) -> str:
        return validate_task_id(v)


class RecordReply(_Wire):
    """The answer to a ``RecordRequest``: the record as the stream's leader has it."""

    task_id: str
    #: The stream sequence of the key's last message (a delete or purge marker's too); 0 when
    #: the key never had one.
    revision: int = Field(default=0, ge=0)
    #: The stored value, a ``TaskRecord`` as JSON; null when the key is absent (no message,
    #: or a delete or purge marker) or its value is not a JSON object.
    record: dict[str, Any] | None = None


class TaskReply(_Wire):
    """agent → hub/caller: the final (or current, for a state query) state of an attempt."""

    task_id: str = Field(json_schema_extra=TASK_ID_SCHEMA)
    attempt: int
    agent_id: str
    state: TaskState
    result: Any = None
    error: ErrorBody | None = None
    #: Handler run time and time spent queued in the agent, in milliseconds (agent clock).
    duration_ms: float = 0.0
    queued_ms: float = 0.0
    #: True when this result was served from the agent's idempotency cache.
    cached: bool = False


class FailureReport(_Wire):
    """caller → every hub on ``reach.hub.<ns>.report`` (publish): an outcome the hub did not see
    itself (direct mode, or a caller-side failure), fed to the agent's circuit breaker.

    ``reporter`` names the calling client (the SDK sends one random id per ``Client``): each
    reporter's reports count at most ``breaker_report_budget`` times per agent per breaker
    window, and reports alone never open a breaker (docs/security.md)."""

    agent_id: str
    success: bool = False
    code: str | None = Field(default=None, max_length=64)
    task_id: str | None = None
    reporter: str | None = Field(default=None, max_length=128)

    @field_validator("agent_id")
    @classmethod
    def _agent_id(cls, v: str) -> str:
        return validate_agent_id(v)


class FilteredAgent(_Wire):
    agent_id: str
    reason: str


class RouteDecision(_Wire):
    """How the hub chose: the explain output of one routing decision."""

    request_id: str
    hub_id: str
    target: str
    strategy: str
    #: Matching agent ids, sorted; at most the first 100 (``candidate_count`` is the total).
    candidates: list[str] = Field(default_factory=list)
    candidate_count: int | None = None
    #: Set when the strategy looked at a random sample of this many candidates (large sets).
    sampled: int | None = None
    filtered: list[FilteredAgent] = Field(default_factory=list)
    scores: dict[str, float] = Field(default_factory=dict)
    sticky: Literal["hit", "miss", "none"] = "none"
    chosen: str | None = None
    fallback: str | None = None
    nearest: dict[str, Any] | None = None
    elapsed_us: float = 0.0


class AgentRef(_Wire):
    """An agent a caller may call itself (direct mode): its id and task subject."""

    agent_id: str
    subject: str
    #: ``reach.agent.<id>.batch`` if the agent takes task batches, else absent.
    batch_subject: str | None = None


class RouteReply(_Wire):
    """hub → caller. ``task`` in proxy mode; ``subject`` to call in direct mode."""

    request_id: str
    agent_id: str | None = None
    subject: str | None = None
    #: Direct mode: the agent's batch subject, if it takes task batches (``card.batch``).
    batch_subject: str | None = None
    task: TaskReply | None = None
    decision: RouteDecision | None = None
    attempts: int = 1
    #: Direct mode: other routable agents, best first, that the caller may use instead of
    #: ``agent_id`` (spreading load, failing over) while it caches this decision.
    alternates: list[AgentRef] = Field(default_factory=list)


class AgentInfo(_Wire):
    """One agent as a hub sees it (``agents``/``inspect`` replies, snapshots)."""

    agent_id: str
    state: AgentState
    capabilities: list[str]
    labels: dict[str, str]
    inflight: int
    max_concurrency: int
    load: float
    lease_left: float
    last_heartbeat_age: float
    health: float
    breaker: str
    session: str
    #: Why its breaker is not closed (open or half-open): ``N of its last M requests
    #: failed``, ``operator quarantine``, ``deaf: …``, or ``its half-open probe failed
    #: (opened: <one of those>)``.
    breaker_reason: str | None = None
    unavailable: list[str] = Field(default_factory=list)
    tools: list[ToolSpec] = Field(default_factory=list)
    region: str | None = None
    zone: str | None = None
    weight: float = 1.0
    metadata: dict[str, Any] = Field(default_factory=dict)
    durable_work: bool = True
    #: Why it needs an operator's look, empty when nothing does: ``suspect``,
    #: ``breaker_open``, ``breaker_half_open``, ``unhealthy``, ``unavailable``, ``saturated``,
    #: ``unreached`` (docs/protocol.md, "Fleet queries"). An older hub sends none.
    attention: list[str] = Field(default_factory=list)
