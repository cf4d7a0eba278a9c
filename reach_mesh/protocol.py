"""Subjects, header names, bucket/stream names and the JSON codec — the wire, in one place.

Pure: no I/O. Every subject the mesh uses is built by a function here, so the protocol can be read
(and changed) in one file. See ``docs/protocol.md`` for the same facts in prose.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable, Mapping
from copy import copy
from typing import Any, Final, TypeVar

from pydantic import BaseModel, ValidationError
from pydantic_core import from_json

from reach_mesh.errors import (
    BadLeaseError,
    BadRequestError,
    InvalidAgentIdError,
    InvalidCapabilityError,
    PayloadTooLargeError,
    ReachError,
    error_from_wire,
)

__all__ = [
    "AGENT_ID_RE",
    "AGENT_VERBS",
    "CAPABILITY_RE",
    "DEFAULT_NAMESPACE",
    "HUB_QUEUE",
    "INBOX_PREFIX",
    "KV_AGENTS",
    "KV_CORDONS",
    "KV_HEARTBEATS",
    "KV_TASKS",
    "KV_WORKFLOWS",
    "MESH_STREAMS",
    "MESSAGE_ROOM",
    "PROTOCOL_VERSION",
    "REPLY_SUBJECT_RE",
    "STRATEGY_NAMES",
    "STREAM_STATUS",
    "STREAM_WF",
    "STREAM_WF_EVENTS",
    "STREAM_WORK",
    "TASK_ID_RE",
    "agent_batch",
    "agent_ctl",
    "agent_task",
    "attempt_msg_id",
    "audit_subject",
    "batch_line",
    "carried_max",
    "decode",
    "encode",
    "encode_error",
    "fence_msg_id",
    "final_msg_id",
    "hub_agent_subject",
    "hub_broadcast",
    "hub_peer",
    "hub_subject",
    "identity_of",
    "invalid",
    "is_inbox",
    "join_answers",
    "named_workflow_id",
    "namespace_of",
    "parse_reply",
    "raise_for_error",
    "split_answers",
    "split_batch",
    "status_identity",
    "status_max",
    "submit_msg_id",
    "task_key",
    "task_status",
    "validate_agent_id",
    "validate_capability",
    "validate_json",
    "validate_namespace",
    "validate_object",
    "validate_task_id",
    "validate_workflow_id",
    "wf_all",
    "wf_done",
    "wf_event",
    "wf_submit",
    "work_consumer",
    "work_subject",
    "workflow_id_of",
    "workflow_key",
]

#: 2: registration, heartbeats, unregistration and status events carry the sender's agent id in
#: their subjects (so NATS permissions can bind them to it); operator breaker broadcasts moved to
#: ``reach.hubs.<ns>.breaker`` (docs/protocol.md, "Version 2").
PROTOCOL_VERSION: Final = 2
DEFAULT_NAMESPACE: Final = "default"

#: Queue group every hub instance joins for request-reply subjects.
HUB_QUEUE: Final = "reach-hubs"

#: JetStream KV buckets.
KV_AGENTS: Final = "reach_agents"  # agent_id -> AgentRecord (registration)
KV_HEARTBEATS: Final = "reach_heartbeats"  # agent_id -> HeartbeatRecord (latest load report)
KV_CORDONS: Final = "reach_cordons"  # agent_id -> CordonRecord (kept across registrations)
KV_SESSIONS: Final = "reach_sessions"  # session key -> agent_id (sticky routing)

#: JetStream streams.
STREAM_AUDIT: Final = "REACH_AUDIT"  # reach.audit.<ns>.<kind>

# Workflows (docs/workflows.md, docs/protocol-workflows.md).
KV_WORKFLOWS: Final = "reach_workflows"  # <ns>.<workflow_id> -> WorkflowRecord
KV_TASKS: Final = "reach_tasks"  # <ns>.<task_id> -> TaskRecord (current attempt = the fence)
STREAM_WF: Final = "REACH_WF"  # reach.wf.<ns>.submit (work queue, dedup on workflow_id)
STREAM_WF_EVENTS: Final = "REACH_WF_EVENTS"  # reach.wf.<ns>.<wf_id>.event
STREAM_WORK: Final = "REACH_WORK"  # reach.work.<ns>.<agent_id> (work queue)
STREAM_STATUS: Final = "REACH_STATUS"  # reach.status.<agent_id>.<task_id> (last: agent idempotency)
#: Every stream of the mesh (a bucket's is ``KV_<bucket>``): what ``reach-mesh doctor`` checks
#: and a hub gives its ``kv_replicas``.
MESH_STREAMS: Final = (
    STREAM_WF,
    STREAM_WF_EVENTS,
    STREAM_WORK,
    STREAM_STATUS,
    STREAM_AUDIT,
    *(
        f"KV_{b}"
        for b in (KV_AGENTS, KV_HEARTBEATS, KV_CORDONS, KV_SESSIONS, KV_TASKS, KV_WORKFLOWS)
    ),
)
#: The durable pull consumer every hub shares on ``REACH_WF``.
CONSUMER_HUBS: Final = "reach-hubs"
WORKFLOW_ID_RE: Final = re.compile(r"^[A-Za-z0-9_-]{1,48}$")
#: A hub id: a token of subjects (``reach.micro.<hub_id>.…``, :func:`hub_peer`).
HUB_ID_RE: Final = re.compile(r"^[A-Za-z0-9_-]{1,64}$")

HDR_MSG_ID: Final = "Nats-Msg-Id"
#: JetStream refuses a publish with this header unless the named stream takes it.
HDR_EXPECTED_STREAM: Final = "Nats-Expected-Stream"
#: On a message of ``reach.work.<ns>.<agent_id>``: not a step but a fence marker — the hub gave
#: up this attempt number of the task in its body (docs/protocol-workflows.md).
HDR_FENCE: Final = "Reach-Fence"
#: On a message of ``reach.work.<ns>.<agent_id>``: several steps, one line each — this many
#: (``reach_mesh/_work_batch.py``; docs/protocol-workflows.md, "Work batches").
HDR_WORK_BATCH: Final = "Reach-Work-Batch"
#: On a route request: ``1`` — the caller sends again a request of this task id that it sent
#: before and saw no answer to (docs/protocol.md, "Resends"; ``hub/_holders.py``).
HDR_RESEND: Final = "Reach-Resend"

# Checked with fullmatch, never match: Python's $ also matches before a final newline, and an
# id ending in one passed (the subject it made was refused later, by nats-py). The patterns
# keep ^...$ for the OpenAPI document and pydantic, whose $ is the end of the text.
_TOKEN: Final = r"[a-z0-9][a-z0-9_-]*"
TOKEN_RE: Final = re.compile(rf"^{_TOKEN}$")
AGENT_ID_RE: Final = re.compile(rf"^{_TOKEN}\.{_TOKEN}\.{_TOKEN}$")
CAPABILITY_RE: Final = re.compile(rf"^{_TOKEN}:{_TOKEN}:v[0-9]+$")
TASK_ID_RE: Final = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_MAX_TOKEN_LEN: Final = 64
#: The longest agent id: three tokens and their two dots.
AGENT_ID_MAX: Final = 3 * _MAX_TOKEN_LEN + 2
#: The routing strategies a route or a workflow step may name (``strategy``). Here, not only in
#: ``reach_mesh.hub.strategies`` (which implements each, under these names), so that a workflow
#: spec is checked without the hub's code: a step naming another one could never be placed.
STRATEGY_NAMES: Final = frozenset(
    {"least_loaded", "round_robin", "weighted_random", "consistent_hash", "power_of_two"}
)

# --------------------------------------------------------------------------- validation


def validate_namespace(ns: str) -> str:
    """Return ``ns`` if it is a valid namespace token, else raise ``BadRequestError``."""
    if not isinstance(ns, str) or len(ns) > _MAX_TOKEN_LEN or not TOKEN_RE.fullmatch(ns):
        raise BadRequestError(
            f"invalid namespace {ns!r}: expected a token matching [a-z0-9][a-z0-9_-]*",
            field="namespace",
            value=str(ns)[:100],
        )
    return ns


def validate_agent_id(agent_id: str) -> str:
    """Return ``agent_id`` if it is ``<namespace>.<service>.<instance>``, else raise."""
    if (
        not isinstance(agent_id, str)
        or len(agent_id) > AGENT_ID_MAX
        or not AGENT_ID_RE.fullmatch(agent_id)
    ):
        raise InvalidAgentIdError(
            f"invalid agent_id {agent_id!r}: expected <namespace>.<service>.<instance>, "
            "each token [a-z0-9][a-z0-9_-]*",
            value=str(agent_id)[:200],
        )
    return agent_id


def validate_capability(cap: str) -> str:
    """Return ``cap`` if it is ``domain:action:vN``, else raise ``InvalidCapabilityError``."""
    if (
        not isinstance(cap, str)
        or len(cap) > 2 * _MAX_TOKEN_LEN + 10
        or not CAPABILITY_RE.fullmatch(cap)
    ):
        raise InvalidCapabilityError(
            f"invalid capability {cap!r}: expected domain:action:vN (e.g. email:send:v1)",
            value=str(cap)[:200],
        )
    return cap


def validate_task_id(task_id: str) -> str:
    if not isinstance(task_id, str) or not TASK_ID_RE.fullmatch(task_id):
        raise BadRequestError(
            f"invalid task_id {task_id!r}: expected 1-64 characters of [A-Za-z0-9_-]",
            field="task_id",
            value=str(task_id)[:100],
        )
    return task_id


def namespace_of(agent_id: str) -> str:
    """The namespace (tenant) token of a valid agent id."""
    return agent_id.split(".", 1)[0]


# --------------------------------------------------------------------------- subjects


def hub_subject(namespace: str, verb: str) -> str:
    """``reach.hub.<ns>.<verb>`` — verbs: route, route_batch, report, agents, workflow,
    workflows, cancel, admin.
    ``namespace`` may be ``*`` for the hub's wildcard subscriptions."""
    return f"reach.hub.{namespace}.{verb}"


#: The verbs an agent sends about itself, on subjects that name it (``hub_agent_subject``).
AGENT_VERBS: Final = ("register", "heartbeat", "unregister", "record")


def hub_agent_subject(agent_id: str, verb: str) -> str:
    """``reach.hub.<ns>.<verb>.<service>.<instance>`` — an agent's register, heartbeat,
    unregister and record (a leader read of one of its namespace's task records) requests, on
    a subject that carries its id so that NATS permissions can allow an agent these verbs for
    its own id only. ``agent_id`` may be ``*.*.*`` (subscriptions)."""
    ns, service, instance = agent_id.split(".")
    return f"reach.hub.{ns}.{verb}.{service}.{instance}"


def identity_of(subject: str) -> str | None:
    """The agent id a ``hub_agent_subject`` names, or None if the subject names none."""
    parts = subject.split(".")
    if len(parts) != 6:
        return None
    return f"{parts[2]}.{parts[4]}.{parts[5]}"


#: The NATS micro service name hubs register under (``$SRV.PING.reach-hub`` lists them).
MICRO_HUB_SERVICE: Final = "reach-hub"


def micro_subject(service_id: str, endpoint: str) -> str:
    """``reach.micro.<id>.<endpoint>`` — a NATS micro endpoint of one hub (by its hub id)."""
    return f"reach.micro.{service_id}.{endpoint}"


def hub_broadcast(namespace: str, verb: str) -> str:
    """``reach.hubs.<ns>.<verb>`` — messages from one hub to every hub (no queue group); only
    hubs may publish here. Verbs: ``breaker`` (an operator's quarantine / release), ``pins``
    (the agents the task ids a hub routed went to), ``pins_ask`` (a hub that started asks the
    others to send their newest pins again), ``pin_of`` (a request: which agent one resent
    task id went to; answered only by a hub that knows)."""
    return f"reach.hubs.{namespace}.{verb}"


def hub_peer(namespace: str, verb: str, hub_id: str) -> str:
    """``reach.hubs.<ns>.<verb>.<hub_id>`` — a request from one hub to the hub ``hub_id``; only
    hubs may publish here. Verbs: ``workflow`` (a view of a workflow that hub owns), ``cancel``
    (a cancel of one)."""
    return f"reach.hubs.{namespace}.{verb}.{hub_id}"


def agent_task(agent_id: str) -> str:
    """``reach.agent.<agent_id>.task`` — request-reply delivery of one task attempt."""
    return f"reach.agent.{agent_id}.task"


#: A reply subject named inside a batch line (docs/protocol.md): printable ASCII tokens without
#: wildcards or spaces, separated by dots — checked before anything is published to it.
REPLY_SUBJECT_RE: Final = re.compile(rb"[!-)+-\-/-=?-~]{1,256}(?:\.[!-)+-\-/-=?-~]{1,256}){0,15}")


#: Where every requester's answers go: nats-py's default inbox prefix is ``_INBOX``, and each
#: secure identity's is ``_INBOX.<role>.<name>`` (``nats_inbox_prefix`` must start with it).
INBOX_PREFIX: Final = "_INBOX."
_INBOX_B: Final = INBOX_PREFIX.encode()


def is_inbox(subject: str) -> bool:
    """Whether ``subject`` may be answered on: under ``_INBOX.``. A requester names its own
    reply subject and NATS checks it against nothing, while a hub may publish where answers
    must never go (``$KV.>``, ``$JS.API.>``, ``reach.>``): hubs and agents answer only here."""
    return subject.startswith(INBOX_PREFIX)


def batch_line(reply: str, traceparent: str, body: bytes) -> bytes:
    """One request of a batch: ``<reply subject> <traceparent> <body>`` (docs/protocol.md)."""
    return b" ".join((reply.encode(), traceparent.encode(), body))


def split_batch(data: bytes) -> tuple[list[tuple[str, str, bytes]], int]:
    """The requests of a batch message as (reply subject, traceparent, body), and how many lines
    could not be used (no valid reply subject under ``_INBOX.``: nobody to answer)."""
    requests = []
    malformed = 0
    for line in data.split(b"\n"):
        parts = line.split(b" ", 2)
        if (
            len(parts) != 3
            or not parts[0].startswith(_INBOX_B)
            or not REPLY_SUBJECT_RE.fullmatch(parts[0])
        ):
            malformed += 1
            continue
        reply, traceparent, body = parts
        requests.append((reply.decode(), traceparent.decode(errors="replace"), body))
    return requests, malformed


def join_answers(answers: list[tuple[str, bytes]]) -> bytes:
    """Answers to requests of batches, one message: ``<reply subject> <answer>`` per line."""
    return b"\n".join(b"%s %s" % (reply.encode(), body) for reply, body in answers)


def split_answers(data: bytes, prefix: bytes) -> list[tuple[str, bytes]]:
    """The answers in a message of ``<reply subject> <answer>`` lines whose reply subject starts
    with ``prefix``, as (the rest of the subject, answer); other lines are not ours."""
    start = len(prefix)
    out = []
    for line in data.split(b"\n"):
        subject, _, body = line.partition(b" ")
        if subject.startswith(prefix):
            out.append((subject[start:].decode(errors="replace"), body))
    return out


def agent_batch(agent_id: str) -> str:
    """``reach.agent.<agent_id>.batch`` — several task attempts in one message, for agents whose
    card says ``batch: true``: one line each, ``<reply subject> <traceparent> <TaskEnvelope>``."""
    return f"reach.agent.{agent_id}.batch"


def agent_ctl(agent_id: str) -> str:
    """``reach.agent.<agent_id>.ctl`` — control requests (ping, task state, drain)."""
    return f"reach.agent.{agent_id}.ctl"


def audit_subject(namespace: str, kind: str) -> str:
    """``reach.audit.<ns>.<kind>`` — audit events (captured by the ``REACH_AUDIT`` stream).

    Kinds: route, register, unregister, state, admin, cancel (``*`` for subscriptions)."""
    return f"reach.audit.{namespace}.{kind}"


def task_status(agent_id: str, task_id: str) -> str:
    """``reach.status.<agent_id>.<task_id>`` — six-state status events of a task, on a subject
    that names the agent running it (only that agent may publish there). ``agent_id`` may be
    ``*.*.*`` and ``task_id`` ``*`` (subscriptions)."""
    return f"reach.status.{agent_id}.{task_id}"


def status_identity(subject: str) -> tuple[str, str] | None:
    """(agent id, task id) of a ``task_status`` subject, or None if it is not one."""
    parts = subject.split(".")
    if len(parts) != 6:
        return None
    return f"{parts[2]}.{parts[3]}.{parts[4]}", parts[5]


def wf_submit(namespace: str) -> str:
    """``reach.wf.<ns>.submit`` — workflow submissions (``REACH_WF``, ``Nats-Msg-Id`` =
    :func:`submit_msg_id`). ``namespace`` may be ``*``."""
    return f"reach.wf.{namespace}.submit"


def submit_namespace(subject: str) -> str:
    """``<ns>`` of a submission's subject ``reach.wf.<ns>.submit`` ("" if it has none)."""
    parts = subject.split(".", 3)
    return parts[2] if len(parts) > 2 else ""


def wf_event(namespace: str, workflow_id: str) -> str:
    """``reach.wf.<ns>.<wf_id>.event`` — step progress of one workflow (``REACH_WF_EVENTS``)."""
    return f"reach.wf.{namespace}.{workflow_id}.event"


def wf_done(namespace: str, workflow_id: str) -> str:
    """``reach.wf.<ns>.<wf_id>.done`` — the final ``WorkflowResult``, announced on core NATS
    once the workflow record holds it (the record is the durable copy)."""
    return f"reach.wf.{namespace}.{workflow_id}.done"


def wf_all(namespace: str, workflow_id: str) -> str:
    """``reach.wf.<ns>.<wf_id>.*`` — events and the final result of one workflow."""
    return f"reach.wf.{namespace}.{workflow_id}.*"


def work_subject(namespace: str, agent_id: str) -> str:
    """``reach.work.<ns>.<agent_id>`` — durable step delivery to one agent (``REACH_WORK``)."""
    return f"reach.work.{namespace}.{agent_id}"


def work_consumer(agent_id: str) -> str:
    """Durable consumer name of ``agent_id`` on ``REACH_WORK`` (:func:`_agent_consumer`)."""
    return _agent_consumer("work", agent_id)


def status_consumer(agent_id: str) -> str:
    """Name of the consumer ``agent_id`` reads its final statuses back with, from
    ``REACH_STATUS`` at its start (one name per agent: NATS permissions allow an agent this
    consumer only, so no other identity can re-point or delete it; :func:`_agent_consumer`)."""
    return _agent_consumer("status", agent_id)


#: Longest consumer name :func:`_agent_consumer` makes.
_CONSUMER_NAME_MAX: Final = 200


def _agent_consumer(prefix: str, agent_id: str) -> str:
    """``<prefix>-<agent_id, dots as underscores>-<digest>``: dots are not allowed in names,
    and the digest (of the id) keeps ``a.b_c.d`` and ``a_b.c.d`` apart. An id too long for the
    name whole is cut, never its digest, which is then 128 bits long: no two agents' ids —
    however long, whoever chose them — make one name, which their permissions would both
    allow (either agent could delete or re-point the other's consumer)."""
    flat = agent_id.replace(".", "_")
    digest = hashlib.sha256(agent_id.encode()).hexdigest()
    name = f"{prefix}-{flat}-{digest[:10]}"
    if len(name) <= _CONSUMER_NAME_MAX:
        return name
    keep = _CONSUMER_NAME_MAX - len(prefix) - 2 - 32
    return f"{prefix}-{flat[:keep]}-{digest[:32]}"


def task_key(namespace: str, task_id: str) -> str:
    """Key of a task record in ``reach_tasks``."""
    return f"{namespace}.{task_id}"


def workflow_key(namespace: str, workflow_id: str) -> str:
    """Key of a workflow record in ``reach_workflows``."""
    return f"{namespace}.{workflow_id}"


# Message ids: JetStream drops a repeat of a ``Nats-Msg-Id`` across a whole stream, and
# workflow and task ids are unique within a namespace only, so every id carries it.


def submit_msg_id(namespace: str, workflow_id: str, nonce: str) -> str:
    """``<ns>.<workflow_id>.<nonce>`` — the ``Nats-Msg-Id`` of one submission: ``nonce`` is
    random per submission (its retries repeat it), so that JetStream drops the retries of this
    submission and nothing else. An id anyone could predict (``<ns>.<workflow_id>`` alone)
    would let any caller, of any namespace, store it first and have a workflow id a tenant
    chooses dropped as a repeat for the dedup window. Submissions of one workflow id are made
    one workflow by the hubs (its record), not by JetStream."""
    return f"{namespace}.{workflow_id}.{nonce}"


def workflow_id_of(msg_id: str) -> str:
    """The workflow id a submission's ``Nats-Msg-Id`` names: ``<ns>.<id>.<nonce>``, or
    ``<ns>.<id>`` and a bare ``<id>`` as earlier clients sent it (workflow ids, namespaces and
    nonces have no dots)."""
    parts = msg_id.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def named_workflow_id(headers: Mapping[str, str] | None) -> str:
    """The workflow id a submission's ``Nats-Msg-Id`` names, when it is a valid one, else
    "": the id a hub answers the submission under (it runs a spec whose body names the same
    id, and refuses any other submission under this one); without it, the body's id."""
    wf_id = workflow_id_of((headers or {}).get(HDR_MSG_ID, ""))
    return wf_id if WORKFLOW_ID_RE.fullmatch(wf_id) else ""


def attempt_msg_id(namespace: str, task_id: str, attempt: int) -> str:
    """``<ns>.<task_id>#n`` — the ``Nats-Msg-Id`` of one attempt's work message."""
    return f"{namespace}.{task_id}#{attempt}"


def final_msg_id(namespace: str, task_id: str, attempt: int, nonce: str) -> str:
    """``<ns>.<task_id>#n.final.<nonce>`` — the ``Nats-Msg-Id`` of attempt ``n``'s final
    status; ``nonce`` is unpredictable and the same for each repeat of that status from one
    agent process (retried or ``cached``: stored once), the Python agent's a keyed hash of the
    attempt under a key random per process. An id any agent could predict would let it store
    it first, on its own subject, and have the step's real final status dropped as a repeat."""
    return f"{namespace}.{task_id}#{attempt}.final.{nonce}"


def fence_msg_id(namespace: str, task_id: str, attempt: int) -> str:
    """``<ns>.<task_id>#n.fence`` — the ``Nats-Msg-Id`` of the fence marker of attempt
    ``n``."""
    return f"{namespace}.{task_id}#{attempt}.fence"


#: How long a hub holds a cancel (``reach.hub.<ns>.cancel``) before it answers "not final yet"
#: (s): under a client's 5 s request timeout.
CANCEL_WAIT: Final = 3.0
#: A list of workflows (``reach.hub.<ns>.workflows``): how many one answer holds (``limit``:
#: by default, at most) over a window of how many seconds (``since_s``: by default, at most).
WORKFLOW_LIST_LIMIT: Final = 50
WORKFLOW_LIST_MAX: Final = 500
WORKFLOW_LIST_SINCE: Final = 3600.0
WORKFLOW_LIST_SINCE_MAX: Final = 7 * 86_400.0
#: Largest body of a query or an operator's request to a hub (``agents``, ``workflow``,
#: ``workflows``, ``cancel``, ``admin`` and the hubs' own questions to each other): they name an
#: id or two and a reason, and a larger one is refused before it is parsed
#: (``REACH_PAYLOAD_TOO_LARGE``), so that nobody stalls a hub's event loop with a parse.
QUERY_MAX: Final = 64 * 1024
#: Longest reason a cancel or an operator action may give (kept in the audit and, for a
#: cancel, in the result's error message).
REASON_MAX: Final = 200


def validate_reason(reason: object) -> str | None:
    """The optional ``reason`` of a cancel or an operator action: printable text of at most
    ``REASON_MAX`` characters (it is shown in terminals and dashboards), stripped; None when
    absent or blank, else ``BadRequestError``."""
    if reason is None:
        return None
    if not isinstance(reason, str) or len(reason) > REASON_MAX or not reason.isprintable():
        raise BadRequestError(
            f"reason must be printable text of at most {REASON_MAX} characters",
            field="reason",
        )
    return reason.strip() or None


def validate_workflow_id(workflow_id: str) -> str:
    """Return ``workflow_id`` if it is 1-48 characters of ``[A-Za-z0-9_-]``, else raise."""
    if not isinstance(workflow_id, str) or not WORKFLOW_ID_RE.fullmatch(workflow_id):
        raise BadRequestError(
            f"invalid workflow_id {workflow_id!r}: expected 1-48 characters of [A-Za-z0-9_-]",
            field="workflow_id",
            value=str(workflow_id)[:100],
        )
    return workflow_id


#: What a NATS message needs beside the value it carries (its own fields and headers): a
#: workflow record, a result or a step input may take the server's ``max_payload`` less this.
MESSAGE_ROOM: Final = 16 * 1024


def carried_max(max_payload: int, server_max_payload: int) -> int:
    """The largest result or step input, in bytes of JSON: ``max_payload`` (what an agent
    takes), and what the server carries beside a message's own fields
    (docs/protocol.md, "Sizes")."""
    return min(max_payload, server_max_payload - MESSAGE_ROOM)


def status_max(max_payload: int, server_max_payload: int) -> int:
    """The largest status event an agent of the SDK sends, in bytes: a result or progress of
    at most :func:`carried_max`, and ``MESSAGE_ROOM`` for its other fields (an error is cut
    to 2,000 characters and 8 KiB of details). A hub drops a larger one unread."""
    return carried_max(max_payload, server_max_payload) + MESSAGE_ROOM


# --------------------------------------------------------------------------- codec

M = TypeVar("M", bound=BaseModel)
T = TypeVar("T")
D = TypeVar("D")

_FIELD_ERRORS: Final[dict[str, type[BadRequestError]]] = {
    "agent_id": InvalidAgentIdError,
    "capabilities": InvalidCapabilityError,
    "capability": InvalidCapabilityError,
    "lease_timeout": BadLeaseError,
    "heartbeat_interval": BadLeaseError,
}


def encode(model: BaseModel) -> bytes:
    """Serialise a wire model (``None`` fields left out)."""
    return model.model_dump_json(exclude_none=True).encode()


def encode_error(err: ReachError) -> bytes:
    return json.dumps(err.to_wire(), separators=(",", ":")).encode()


def decode(data: bytes, model: type[M], *, max_size: int | None = None) -> M:
    """Parse and validate ``data`` as ``model``; raise a typed ``BadRequestError`` naming the
    bad field and value. Never raises anything else."""
    if max_size is not None and len(data) > max_size:
        raise PayloadTooLargeError(
            f"message of {len(data)} bytes exceeds the maximum of {max_size} bytes",
            size=len(data),
            max_size=max_size,
        )
    try:
        return validate_json(model.model_validate_json, data)
    except ValidationError as err:
        raise invalid(err, model) from err
    except (ValueError, TypeError) as err:  # pragma: no cover - pydantic wraps these
        raise BadRequestError(f"malformed {model.__name__}: {err}") from err


def validate_json(validate: Callable[[bytes], T], data: bytes) -> T:
    """``validate(data)`` (a model's or adapter's ``validate_json``), reading a ``null`` in a
    field that is not nullable as the field's absence — its default where it has one — as
    protobuf's JSON mapping does: ``"duration_ms": null`` from an agent in another language is
    the agent's result all the same, not a message to drop. A required field's ``null`` is
    still refused, with the error of ``data`` as it came. A valid message costs one call more
    (status events and replies are hot paths): the second try is made only on a refusal."""
    try:
        return validate(data)
    except ValidationError as err:
        return _again(validate, data, err, _nulls_left_out)


def validate_object(validate: Callable[[dict[str, Any]], T], body: dict[str, Any]) -> T:
    """:func:`validate_json` for a message already parsed (``validate``: a ``model_validate``)."""
    try:
        return validate(body)
    except ValidationError as err:
        return _again(validate, body, err, _nulls_removed)


def _again(
    validate: Callable[[D], T],
    data: D,
    err: ValidationError,
    fix: Callable[[D, ValidationError], D | None],
) -> T:
    """``validate`` once more, on ``data`` without the nulls ``err`` refused; ``err`` itself
    when there is nothing to fix, or the fixed message fails too."""
    fixed = fix(data, err)
    if fixed is None:
        raise err
    try:
        return validate(fixed)
    except ValidationError:
        raise err from None


def _nulls_left_out(data: bytes, err: ValidationError) -> bytes | None:
    """``data`` without the ``null`` members ``err`` refused, re-encoded; None when something
    else was refused too (or ``data`` is no JSON object)."""
    try:
        body = json.loads(data)
    except (ValueError, RecursionError):
        return None
    fixed = _nulls_removed(body, err) if isinstance(body, dict) else None
    return None if fixed is None else dumps(fixed)


def _nulls_removed(body: dict[str, Any], err: ValidationError) -> dict[str, Any] | None:
    """A copy of ``body`` without the object members ``err`` refused for being ``null``; None
    when an error is of anything else (a missing field, a wrong value, a ``null`` list item):
    then nothing is fixed. Copied along the changed paths only."""
    nulls: set[tuple[str | int, ...]] = set()
    for e in err.errors(include_url=False):
        if e["type"] == "missing" or e.get("input", ...) is not None:
            return None
        at = _null_at(body, tuple(e["loc"]))
        if at is None:
            return None
        nulls.add(at)
    fixed = dict(body)
    for at in nulls:
        parent: Any = fixed
        for part in at[:-1]:
            parent[part] = copy(parent[part])
            parent = parent[part]
        del parent[at[-1]]
    return fixed


def _null_at(body: Any, loc: tuple[str | int, ...]) -> tuple[str | int, ...] | None:
    """The path in ``body`` along ``loc`` to an object member that is ``null`` (a union's
    member tags may follow it in ``loc``), or None."""
    node = body
    for i, part in enumerate(loc):
        if isinstance(node, dict) and isinstance(part, str) and part in node:
            if node[part] is None:
                return loc[: i + 1]
        elif not (isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node)):
            return None
        elif node[part] is None:
            return None  # a null item of a list is no absent field
        node = node[part]
    return None


def invalid(err: ValidationError, model: type[BaseModel]) -> BadRequestError:
    """``err`` (``model``'s validation failing) as the typed error that names its first field."""
    first = err.errors(include_url=False)[0]
    if first["type"] == "json_invalid":
        return BadRequestError(
            f"malformed JSON in {model.__name__}: {first['msg']}", type="json_invalid"
        )
    loc = [str(p) for p in first["loc"]]
    where = ".".join(loc) or model.__name__
    cls: type[BadRequestError] = BadRequestError
    for part in loc:
        if part in _FIELD_ERRORS:
            cls = _FIELD_ERRORS[part]
            break
    value = first.get("input")
    shown = "" if not loc or isinstance(value, dict) else f" (got {repr(value)[:200]})"
    msg = first["msg"].removeprefix("Value error, ")
    what = f"field {where!r}" if loc else "request"
    return cls(
        f"invalid {model.__name__} {what}: {msg}{shown}",
        field=where,
        type=first["type"],
        errors=len(err.errors()),
    )


def raise_for_error(data: bytes) -> None:
    """Raise the typed ``ReachError`` if ``data`` is an error body: an object whose only
    member is ``error`` (protocol.md, "The error-body rule"). Only a body that starts with
    ``error`` is parsed here; one with more members (a ``TaskReply`` serialised with its
    ``error`` first) is a success body, read by the caller's model."""
    head = (data.lstrip() if data[:1].isspace() else data)[:24]
    if head[:1] == b"{" and head[1:].lstrip().startswith(b'"error"'):
        try:
            body = json.loads(data)
            err = body["error"]
        except (ValueError, RecursionError, KeyError, TypeError) as exc:
            raise BadRequestError(f"malformed error reply: {exc}") from exc
        if len(body) > 1:
            return
        raise error_from_wire(err if isinstance(err, dict) else {"message": str(err)})


def parse_reply(data: bytes, model: type[M]) -> M:
    """Parse a reply: raise the typed ``ReachError`` if it is an error body."""
    raise_for_error(data)
    return validate_json(model.model_validate_json, data)


def dumps(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def loads(data: bytes | str) -> Any:
    """Parse JSON from the wire; a ``BadRequestError`` for anything that is not JSON.

    pydantic's parser, as the models': it refuses a lone surrogate (``"\\udce9"``, or its
    bytes), which Python's ``json`` takes — a string no JSON writer of the mesh can write
    again, so a hub that kept one from an agent failed each time it stored it — and nesting
    deeper than about 200 levels, which no model of the mesh would read either."""
    try:
        return from_json(data)
    except ValueError as err:
        if "recursion limit" in str(err):
            raise BadRequestError("malformed JSON: nested too deeply") from err
        raise BadRequestError(f"malformed JSON: {err}") from err


def loads_object(data: bytes | str) -> dict[str, Any]:
    """:func:`loads` of what must be a JSON object."""
    body = loads(data)
    if not isinstance(body, dict):
        raise BadRequestError("expected a JSON object")
    return body
