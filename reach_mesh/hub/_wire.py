"""The hub's wire bytes on the route path: request ids, the trace headers a route forwards,
and the proxy-mode ``TaskEnvelope`` and the ``RouteReply`` written directly (module-level
functions: the hot path calls them without indirection)."""

from __future__ import annotations

import os
import random
from typing import Any

from pydantic_core import to_json

from reach_mesh import protocol
from reach_mesh.hub.registry import AgentView
from reach_mesh.models import RouteDecision
from reach_mesh.tracing import TRACEPARENT, TRACESTATE, inject, trace_id_from_headers

# Request ids only need to be unique, not secret: 64 random bits from a private generator
# (a uuid4 per request showed up in the hub profile). Reseeded in a forked child so that two
# hub processes forked from one parent never mint the same ids.
_ids = random.Random()
os.register_at_fork(after_in_child=_ids.seed)


def _new_id() -> str:
    return f"{_ids.getrandbits(64):016x}"


def _forward_trace(headers: dict[str, str] | None) -> tuple[dict[str, str], str]:
    """The trace headers to send on (tracing off) and the trace id: the caller's
    ``traceparent``/``tracestate`` as received, or a new trace when it sent none valid."""
    if headers:
        trace_id = trace_id_from_headers(headers)
        if trace_id is not None:
            out = {TRACEPARENT: headers[TRACEPARENT]}
            state = headers.get(TRACESTATE)
            if state:
                out[TRACESTATE] = state
            return out, trace_id
    out = inject({})
    return out, out[TRACEPARENT][3:35]


def _envelope_bytes(
    task_id: str,
    attempt: int,
    capability: str | None,
    payload: Any,
    namespace: str,
    timeout: float,
) -> bytes:
    """A proxy-mode ``TaskEnvelope`` as JSON, written directly (pydantic's ``model_construct``
    plus ``model_dump_json`` cost several times more on every request). Ids, capability and
    namespace are validated protocol tokens: quoted without escaping; the payload goes through
    pydantic's JSON serialiser, as ``protocol.encode`` would."""
    parts = _envelope_parts(task_id, attempt, capability, payload, namespace)
    parts += (repr(timeout).encode(), b"}")
    return b"".join(parts)


def _envelope_parts(
    task_id: str, attempt: int, capability: str | None, payload: Any, namespace: str
) -> list[bytes]:
    """A ``TaskEnvelope``'s JSON up to its ``timeout`` value (both envelopes written here)."""
    parts = [b'{"task_id":"', task_id.encode(), b'","attempt":', str(attempt).encode()]
    if capability is not None:
        parts += (b',"capability":"', capability.encode(), b'"')
    if payload is not None:
        parts += (b',"payload":', to_json(payload))
    parts += (b',"namespace":"', namespace.encode(), b'","timeout":')
    return parts


def _step_envelope_bytes(
    task_id: str,
    attempt: int,
    capability: str | None,
    payload: Any,
    namespace: str,
    timeout: float,
    workflow_id: str,
    step: int,
) -> bytes:
    """A workflow step's ``TaskEnvelope`` (``track`` set) as JSON, written directly: the
    bytes ``protocol.encode`` makes of the model (``tests/test_workflow_submissions.py``
    compares them), without building and validating a model per attempt. ``task_id`` is
    checked here as the model's validator does (it is quoted without escaping); the workflow
    id, namespace and capability were validated on admission, the timeout by ``StepSpec``."""
    protocol.validate_task_id(task_id)
    parts = _envelope_parts(task_id, attempt, capability, payload, namespace)
    parts += (
        to_json(float(timeout)),
        b',"workflow_id":"',
        workflow_id.encode(),
        b'","step":',
        str(step).encode(),
        b',"track":true}',
    )
    return b"".join(parts)


def _reply_bytes(
    request_id: str,
    agent_id: str,
    *,
    subject: str | None,
    batch_subject: str | None,
    task: bytes | None,
    decision: RouteDecision | None,
    alternates: list[AgentView] | None,
    attempts: int,
) -> bytes:
    """The ``RouteReply`` JSON, with the agent's ``TaskReply`` bytes spliced in unchanged.

    Ids and subjects are validated protocol tokens (``[a-z0-9_-]`` and dots), so they are
    written between quotes without escaping.
    """
    parts = [b'{"request_id":"', request_id.encode(), b'","agent_id":"', agent_id.encode()]
    if subject is not None:
        parts += (b'","subject":"', subject.encode())
    if batch_subject is not None:
        parts += (b'","batch_subject":"', batch_subject.encode())
    parts.append(b'"')
    if task is not None:
        parts += (b',"task":', task)
    if decision is not None:
        parts += (b',"decision":', decision.model_dump_json(exclude_none=True).encode())
    if alternates:
        refs = [_agent_ref(v) for v in alternates]
        parts += (b',"alternates":', protocol.dumps(refs))
    parts += (b',"attempts":', str(attempts).encode(), b"}")
    return b"".join(parts)


def _batch_subject(view: AgentView) -> str | None:
    return protocol.agent_batch(view.agent_id) if view.record.card.batch else None


def _agent_ref(view: AgentView) -> dict[str, str]:
    """An ``AgentRef`` for a direct-mode caller: where to send it tasks, alone or batched."""
    ref = {"agent_id": view.agent_id, "subject": view.record.task_subject}
    batch = _batch_subject(view)
    if batch is not None:
        ref["batch_subject"] = batch
    return ref
