"""The REST API's wire models (``hub/http.py``): the bodies it takes and the answers it
gives, from which FastAPI writes the OpenAPI document, and the errors each path may answer."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field, StrictBool

from reach_mesh import protocol
from reach_mesh.models import AgentInfo, AgentState

__all__ = [
    "AdminBody",
    "AdminResult",
    "AgentList",
    "CancelBody",
    "ErrorDetail",
    "ErrorResponse",
    "Health",
    "ToolEntry",
    "ToolMenu",
    "errors",
]


class AdminBody(BaseModel):
    """The body of ``POST /api/agents/{agent_id}/{op}`` (``{}`` will do)."""

    reason: str | None = Field(
        default=None,
        max_length=protocol.REASON_MAX,
        description='why (printable text; audited, with requester "http")',
    )


class CancelBody(BaseModel):
    """The body of ``POST /api/workflows/{id}/cancel`` (optional)."""

    reason: str | None = Field(
        default=None,
        max_length=protocol.REASON_MAX,
        description='why (printable text; audited, with requester "http")',
    )
    before_start: StrictBool = Field(
        default=False,
        description="a workflow no hub has started yet (its submission waits) is cancelled "
        "before it starts: the cancel is recorded and it never runs",
    )


class ErrorDetail(BaseModel):
    code: str = Field(description="stable REACH_* code, e.g. REACH_NO_MATCH")
    message: str
    details: dict[str, Any] | None = None


class ErrorResponse(BaseModel):
    """Every error the HTTP API answers: ``{"error": {"code", "message", "details"?}}``."""

    error: ErrorDetail


class AgentList(BaseModel):
    """The agents asked for, in ``agent_id`` order, and what was left out (as the fleet query
    answers, ``hub/_fleet.py``)."""

    hub_id: str
    agents: list[AgentInfo]
    total: int = Field(description="agents in scope, whatever the filters")
    by_state: dict[str, int] = Field(description="those agents by state")
    matched: int = Field(description="agents the filters keep")
    offset: int = 0
    truncated: bool = Field(description="matched agents past the page were left out")
    next_after: str | None = Field(
        default=None, description="ask the next page after this agent id; null: none left"
    )
    next_offset: int | None = Field(description="where the next page starts; null: none left")
    recently_lost: list[dict[str, Any]] = Field(default_factory=list)
    recently_lost_total: int = 0


class AdminResult(BaseModel):
    agent_id: str
    op: str
    state: AgentState


class Health(BaseModel):
    hub_id: str
    nats_connected: bool
    agents: int
    #: Cannot read or write the registry in JetStream lately (``reach_registry_blind``): said,
    #: not a 503 — routing goes on, and a probe that restarted every hub on a JetStream
    #: election would make it worse.
    registry_blind: bool = False
    #: Why (the last such failure: ``JetStream storage is full: …``, ``cut off from NATS``).
    registry_blind_reason: str | None = None
    #: The NATS server each connection (main, routes, statuses) is on; None: reconnecting.
    nats_servers: dict[str, str | None] = {}
    #: Those up are on more than one server (``reach_nats_split``): said, not a 503.
    nats_split: bool = False


class ToolEntry(BaseModel):
    name: str
    description: str
    inputSchema: dict[str, Any]
    capability: str | None
    agents: list[str]


class ToolMenu(BaseModel):
    tools: list[ToolEntry]


def errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    text = {
        400: "bad request (REACH_BAD_REQUEST and its kinds)",
        401: "bearer token missing or wrong (REACH_UNAUTHORIZED)",
        403: "Host or Origin refused (REACH_FORBIDDEN_HOST / REACH_FORBIDDEN_ORIGIN)",
        404: "no such agent, no match, or no handler",
        409: "conflict",
        413: "payload too large",
        415: "POST without Content-Type: application/json",
        429: "throttled (Retry-After says when to try again)",
        502: "the agent or the mesh answered with an error",
        503: "no capacity or NATS unavailable",
        504: "no answer in time",
    }
    return {s: {"model": ErrorResponse, "description": text[s]} for s in statuses}
