"""``POST /api/route``, the hub's REST gateway, as a plain ASGI handler on the route's hot path.

The hub routes the request itself (``Hub.route``: the admission, throttle, decision and flight of
a request on ``reach.hub.<ns>.route``, with no NATS round trip to the hub queue group and back).
The body goes to the hub as it came and is validated once, by the hub's decoder (``RouteRequest``,
a typed 400); the hub's answer bytes are the response, not re-encoded.

FastAPI documents the route from :func:`route_contract` (body model, query, response model, the
typed errors) like any other; :func:`served_by` makes the route call :class:`RouteEndpoint`
instead of FastAPI's per-request dependency solving and body model, which would validate the body
a second time and cost more than the route itself. ``GuardMiddleware`` (``http.py``) sends a
``POST /api/route`` that passes the guard straight here, past the framework's middleware stack
and route table; the endpoint is the same either way.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from typing import TYPE_CHECKING, Annotated, Any, Final
from urllib.parse import parse_qsl

from fastapi import Query
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from reach_mesh import protocol
from reach_mesh.errors import (
    AgentBusyError,
    BadRequestError,
    InternalError,
    MeshTimeoutError,
    MeshUnavailableError,
    NoHandlerError,
    NoMatchError,
    PayloadTooLargeError,
    ReachError,
    StaleAttemptError,
    ThrottledError,
    UnknownAgentError,
    UnknownWorkflowError,
    WorkflowConflictError,
)
from reach_mesh.models import RouteReply, RouteRequest
from reach_mesh.tracing import TRACEPARENT, TRACESTATE

if TYPE_CHECKING:
    from reach_mesh.hub._hub import Hub
    from reach_mesh.hub.http_guard import HttpGuard, Refusal

__all__ = [
    "NamespaceQuery",
    "RouteEndpoint",
    "body_within",
    "discard_body",
    "error_response",
    "read_body",
    "replay",
    "route_contract",
    "served_by",
    "status_for",
]

log = logging.getLogger("reach_mesh.hub.http")

#: Bytes of a ``RouteRequest`` allowed on top of ``max_payload`` for its own fields (as the hub).
_ENVELOPE_SLACK: Final = 16 * 1024
_JSON_HEADERS: Final = [(b"content-type", b"application/json")]
_TRACE_HEADERS: Final = (TRACEPARENT.encode(), TRACESTATE.encode())

#: Query parameters carry their grammar, so the document says what is accepted.
NamespaceQuery = Annotated[
    str | None,
    Query(pattern=protocol.TOKEN_RE.pattern, max_length=64, description="tenant namespace"),
]


def status_for(err: ReachError) -> int:
    """The HTTP status of a typed error: client errors are 4xx, the mesh's own trouble 5xx."""
    if isinstance(err, PayloadTooLargeError):
        return 413
    if isinstance(err, BadRequestError):
        return 400
    if isinstance(err, NoMatchError | UnknownAgentError | UnknownWorkflowError | NoHandlerError):
        return 404
    if isinstance(err, WorkflowConflictError | StaleAttemptError):
        return 409
    if isinstance(err, ThrottledError):
        return 429
    if isinstance(err, AgentBusyError | MeshUnavailableError):
        return 503
    if isinstance(err, MeshTimeoutError):
        return 504
    return 502


def error_response(err: ReachError) -> JSONResponse:
    """The typed error body ``{"error": {...}}`` with its status (and ``Retry-After``)."""
    headers = {}
    if isinstance(err, ThrottledError):
        headers["Retry-After"] = str(max(1, math.ceil(err.retry_after)))
    return JSONResponse(err.to_wire(), status_for(err), headers)


async def route_contract(
    body: RouteRequest, namespace: NamespaceQuery = None
) -> RouteReply:  # pragma: no cover - documents the route; RouteEndpoint serves it
    """``POST /api/route?namespace=ns``: a ``RouteRequest`` → its ``RouteReply``. The namespace is
    the agent's own when the body names an ``agent_id``, else ``namespace`` (``default``)."""
    raise NotImplementedError


def served_by(app: ASGIApp) -> type[APIRoute]:
    """An :class:`APIRoute` class that FastAPI documents from its endpoint (the contract) like
    any other, and that serves requests with the ASGI ``app``."""

    class RawRoute(APIRoute):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.app = app

    return RawRoute


class RouteEndpoint:
    """The ASGI handler of ``POST /api/route`` (behind the guard)."""

    def __init__(self, hub: Hub) -> None:
        self.hub = hub
        self.limit = hub.settings.max_payload + _ENVELOPE_SLACK

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            raw = await read_body(receive, self.limit)
            if raw is None:
                return  # the client went away: nobody to answer
            ns = _route_namespace(raw, _query_namespace(scope))
            data = await self.hub.route(raw, ns, _trace_headers(scope))
            protocol.raise_for_error(data)
        except ReachError as err:
            await error_response(err)(scope, receive, send)
            return
        except Exception as err:  # a bug, not the input: still a typed answer
            log.exception("POST /api/route failed")
            await error_response(InternalError(f"internal error: {type(err).__name__}"))(
                scope, receive, send
            )
            return
        headers = [*_JSON_HEADERS, (b"content-length", str(len(data)).encode())]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": data})


async def read_body(receive: Receive, limit: int, *, slack: int = _ENVELOPE_SLACK) -> bytes | None:
    """The request body (``None`` if the client disconnected), refused past ``limit`` bytes
    (the error names ``limit - slack``, the payload limit within that envelope)."""
    chunks: list[bytes] = []
    size = 0
    while True:
        message: Message = await receive()
        if message["type"] != "http.request":
            return None
        chunk: bytes = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise PayloadTooLargeError(
                f"request body of {size}+ bytes is over max_payload",
                limit=limit - slack,
            )
        chunks.append(chunk)
        if not message.get("more_body", False):
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)


async def body_within(receive: Receive, guard: HttpGuard) -> bytes | Refusal | None:
    """A chunked request body, read whole, or the guard's refusal once it passes ``max_body``
    (nothing more is kept: the server drops the rest as it comes, after the answer); None:
    the client went away."""
    limit = guard.max_body
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return None
        chunk: bytes = message.get("body", b"")
        size += len(chunk)
        if limit is not None and size > limit:
            return guard.too_large(size)
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


async def discard_body(receive: Receive, most: int, timeout: float) -> bool:
    """Read the rest of a request body and drop it as it comes (nothing kept): True once all of
    it is read; False when more than ``most`` bytes came, ``timeout`` seconds passed first, or
    the client went away."""
    size = 0
    try:
        async with asyncio.timeout(timeout):
            while True:
                message = await receive()
                if message["type"] != "http.request":
                    return False
                if not message.get("more_body", False):
                    return True
                size += len(message.get("body", b""))
                if size > most:
                    return False
    except TimeoutError:
        return False


def replay(body: bytes, receive: Receive) -> Receive:
    """``receive`` with ``body`` given first, as one message (then the server's own, such as
    a disconnect)."""
    given = False

    async def replayed() -> Message:
        nonlocal given
        if given:
            return await receive()
        given = True
        return {"type": "http.request", "body": body, "more_body": False}

    return replayed


def _query_namespace(scope: Scope) -> str | None:
    """``?namespace=`` (the last one, as FastAPI reads a query parameter), if given."""
    query: bytes = scope.get("query_string", b"")
    if not query:
        return None
    if b"%" in query or b"+" in query:  # escapes: the standard parser decodes them
        pairs = parse_qsl(query.decode("latin-1"), keep_blank_values=True)
    else:
        pairs = [pair.partition("=")[::2] for pair in query.decode("latin-1").split("&")]
    found = None
    for name, value in pairs:
        if name == "namespace":
            found = value
    return found


def _route_namespace(raw: bytes, namespace: str | None) -> str:
    """Where a REST route goes: the agent's own namespace when the body names an ``agent_id``
    (a route on ``reach.hub.<ns>.route`` must), else ``?namespace=``, else ``default``."""
    ns = protocol.DEFAULT_NAMESPACE if namespace is None else protocol.validate_namespace(namespace)
    if b"agent_id" in raw or b"namespace" in raw or b"\\u" in raw:  # (keys may use escapes)
        try:
            body = protocol.loads(raw)
            said = body.get("namespace")
            agent_id = body.get("agent_id")
        except (ReachError, AttributeError, TypeError):
            return ns  # not a JSON object: the hub's decoder says what is wrong
        # (no valid agent id: the hub's decoder says what is wrong with one)
        with contextlib.suppress(TypeError, ReachError):
            ns = protocol.namespace_of(protocol.validate_agent_id(agent_id))
        if said is not None and said != ns:
            # A RouteRequest has no namespace: the field would be ignored, and the task routed
            # in another namespace than its caller meant.
            raise BadRequestError(
                f"a REST route's namespace is its query's (?namespace=...) or its agent_id's, "
                f"here {ns!r}: the body's namespace {str(said)[:64]!r} is not read",
                field="namespace",
            )
    return ns


def _trace_headers(scope: Scope) -> dict[str, str] | None:
    """The caller's W3C trace context, which the route continues (none: it starts a trace)."""
    found: dict[str, str] | None = None
    for name, value in scope["headers"]:
        if name in _TRACE_HEADERS:
            if found is None:
                found = {}
            found[name.decode()] = value.decode("latin-1")
    return found if found is not None and TRACEPARENT in found else None
