"""The wire side of :class:`~reach_mesh.client.Client`: a request's route fields, checked
as ``RouteRequest`` would check them, the task envelope of one attempt, and the typed dicts
replies are validated into."""

from __future__ import annotations

import os
import uuid
from typing import Any, Final, Literal, NotRequired, TypeVar

from opentelemetry.trace import Span, Status, StatusCode
from pydantic import TypeAdapter, ValidationError
from typing_extensions import TypedDict  # pydantic validates only this one on 3.11

from reach_mesh import protocol
from reach_mesh.errors import BadRequestError
from reach_mesh.models import (
    ErrorBody,
    RouteDecision,
    TaskState,
)
from reach_mesh.selector import Selector


def _reply_slack(timeout: float) -> float:
    """Extra time the caller waits beyond the task timeout for the hub's own reply (the hub
    answers a timed-out attempt with a typed error at the timeout): 5 % of it, 0.2-2 s. A
    caller whose hub died gets its error soon after its own timeout."""
    return min(2.0, max(0.2, 0.05 * timeout))


_MODES: Final = ("proxy", "direct")


class _RouteFields(TypedDict):
    """A ``RouteRequest`` as the dict it is sent as: fields that are ``None`` are left out.

    ``request()`` checks its arguments itself (:func:`_route_fields`) and writes this dict
    straight to JSON: building and dumping the pydantic model for every request cost more than
    twice as much. ``tests/test_client_fastpath.py`` holds the two ways to the same JSON and
    the same errors.
    """

    agent_id: NotRequired[str]
    capability: NotRequired[str]
    selector: NotRequired[str]
    payload: NotRequired[Any]
    task_id: str
    timeout: float
    mode: Literal["proxy", "direct"]
    strategy: NotRequired[str]
    session_id: NotRequired[str]
    hash_key: NotRequired[str]
    region: NotRequired[str]
    zone: NotRequired[str]
    explain: bool
    dry_run: bool


class _TaskReply(TypedDict):
    """The fields of a ``TaskReply`` that make a ``TaskResult``.

    Replies are validated into these dicts rather than into the models: the same checks,
    without building two model instances per reply (a third of the parsing cost).
    """

    task_id: str
    attempt: int
    agent_id: str
    state: TaskState
    result: NotRequired[Any]
    error: NotRequired[ErrorBody | None]
    duration_ms: NotRequired[float]
    cached: NotRequired[bool]


class _ProxyReply(TypedDict):
    """The fields of a proxy-mode ``RouteReply`` the caller uses."""

    request_id: str
    task: _TaskReply
    decision: NotRequired[RouteDecision | None]


_T = TypeVar("_T")
_TASK_REPLY: Final = TypeAdapter(_TaskReply)
_PROXY_REPLY: Final = TypeAdapter(_ProxyReply)


def _consumer_name() -> str:
    """A name for an ordered consumer (ephemeral: the server removes it when unused)."""
    return f"reach-{uuid.uuid4().hex}"


def _end_span(sp: Span, state: TaskState, code: str | None) -> None:
    """Record a caller span's outcome: the final state, and ERROR unless it SUCCEEDED."""
    if not sp.is_recording():
        return
    sp.set_attribute("reach.state", state.value)
    if state is not TaskState.SUCCEEDED:
        sp.set_status(Status(StatusCode.ERROR, code or state.value))


def _check_timeout(
    timeout: object, maximum: float = 86400.0, error: type[BadRequestError] = BadRequestError
) -> float:
    """``timeout`` as seconds in (0, ``maximum``], else ``error`` naming the field (a string,
    ``None``, a bool or NaN is no number of seconds here)."""
    if (
        isinstance(timeout, bool)
        or not isinstance(timeout, int | float)
        or not 0 < timeout <= maximum  # NaN fails too
    ):
        raise error(
            f"invalid timeout {timeout!r}: expected seconds in (0, {maximum:g}]",
            field="timeout",
            value=repr(timeout)[:100],
        )
    return float(timeout)


def _route_fields(
    *,
    agent_id: str | None,
    capability: str | None,
    selector: str | None,
    payload: Any,
    task_id: str | None,
    timeout: float,
    mode: Literal["proxy", "direct"],
    strategy: str | None,
    session_id: str | None,
    hash_key: str | None,
    region: str | None,
    zone: str | None,
    explain: bool,
) -> _RouteFields:
    """Check a request's arguments as ``RouteRequest`` would and return its fields.

    Raises what the model's validators raise (``InvalidAgentIdError``,
    ``InvalidCapabilityError``, ``BadRequestError`` for a task id) and ``BadRequestError``
    naming the field for its other constraints, before anything is sent.
    """
    if agent_id is not None:
        protocol.validate_agent_id(agent_id)
    if capability is not None:
        protocol.validate_capability(capability)
    if selector is not None:
        _check_text("selector", selector, 0, 4096)
    if task_id:
        protocol.validate_task_id(task_id)
    else:
        task_id = os.urandom(16).hex()  # what uuid4().hex is, at a quarter of the cost
    timeout = _check_timeout(timeout)
    if mode not in _MODES:
        raise BadRequestError(
            f"invalid mode {mode!r}: expected 'proxy' or 'direct'",
            field="mode",
            value=repr(mode)[:100],
        )
    fields: _RouteFields = {
        "task_id": task_id,
        "timeout": timeout,
        "mode": mode,
        "explain": bool(explain),
        "dry_run": False,
    }
    if agent_id is not None:
        fields["agent_id"] = agent_id
    if capability is not None:
        fields["capability"] = capability
    if selector is not None:
        fields["selector"] = selector
    if payload is not None:
        fields["payload"] = payload
    if strategy is not None:
        fields["strategy"] = _check_text("strategy", strategy, 0, 32)
    if session_id is not None:
        fields["session_id"] = _check_text("session_id", session_id, 1, 256)
    if hash_key is not None:
        fields["hash_key"] = _check_text("hash_key", hash_key, 0, 1024)
    if region is not None:
        fields["region"] = _check_text("region", region, 0, 64)
    if zone is not None:
        fields["zone"] = _check_text("zone", zone, 0, 64)
    # agent_id may name the handler with capability; otherwise exactly one target.
    if (selector and (agent_id or capability)) or not (agent_id or capability or selector):
        given = [n for n in ("agent_id", "capability", "selector") if fields.get(n)]
        raise BadRequestError(
            "exactly one of agent_id, capability, selector is required"
            + (f" (got {', '.join(given)})" if given else ""),
            field="target",
        )
    return fields


def _check_text(name: str, value: object, min_len: int, max_len: int) -> str:
    if not isinstance(value, str) or not min_len <= len(value) <= max_len:
        raise BadRequestError(
            f"invalid {name} {repr(value)[:100]}: expected a string of "
            f"{min_len}-{max_len} characters",
            field=name,
            value=repr(value)[:100],
        )
    return value


def _envelope(fields: _RouteFields, attempt: int, ns: str, timeout: float) -> dict[str, Any]:
    """The ``TaskEnvelope`` of one attempt, as the dict it is sent as (``None`` left out).

    Its ``capability`` is the one a hub would send in proxy mode: the request's own, or the
    selector's :attr:`~reach_mesh.selector.Selector.task_capability` (its first ``cap=``), so a
    multi-handler agent picks the same handler in both modes."""
    envelope: dict[str, Any] = {"task_id": fields["task_id"], "attempt": attempt}
    capability = fields.get("capability")
    if capability is None and "selector" in fields:
        capability = Selector.parse(fields["selector"]).task_capability  # parses are cached
    if capability is not None:
        envelope["capability"] = capability
    if "payload" in fields:
        envelope["payload"] = fields["payload"]
    envelope["namespace"] = ns
    envelope["timeout"] = timeout
    envelope["track"] = False
    return envelope


def _parse(adapter: TypeAdapter[_T], data: bytes, what: str) -> _T:
    """Validate a reply that is not an error body; a malformed one raises ``BadRequestError``
    naming the field, as ``protocol.decode`` does."""
    try:
        return protocol.validate_json(adapter.validate_json, data)
    except ValidationError as err:
        first = err.errors(include_url=False)[0]
        where = ".".join(str(p) for p in first["loc"]) or what
        raise BadRequestError(
            f"malformed {what}: {where}: {first['msg']}", field=where, type=first["type"]
        ) from err
