"""The hub's HTTP face, on FastAPI/Starlette served by uvicorn on the hub's own event loop:
Prometheus ``/metrics``, ``/healthz``, a REST gateway whose OpenAPI document FastAPI generates
from the pydantic wire models, the operators' dashboard, and MCP at ``/mcp`` (``_mcp.py``).

``POST /api/route`` (and an MCP ``tools/call``, an A2A ``message/send``) is routed by this hub as
it routes a request on ``reach.hub.<ns>.route`` (``Hub.route``: the same admission, throttle,
decision and flight), without a NATS round trip to the hub queue group and back, so the HTTP path
adds no second routing logic. The REST route is a plain ASGI handler (``_gateway.py``): its body
is validated once, by the hub's decoder, and the hub's answer bytes are the response.

Every request first passes :class:`GuardMiddleware`, which calls the same
:meth:`~reach_mesh.hub.http_guard.HttpGuard.check` the security tests pin down; paths under
``/api/`` and ``/mcp`` want the bearer token when ``http_token`` is set. Another module adds a
GET route with ``hub.http.app.get("/api/…")(handler)``: it is guarded and documented like these.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Awaitable
from importlib import resources
from typing import TYPE_CHECKING, Annotated, Any, Final, Literal

from fastapi import Body, FastAPI, Path, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match, Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from reach_mesh import protocol
from reach_mesh._asgi import AsgiServer
from reach_mesh._nats import has_identity
from reach_mesh.errors import (
    BadRequestError,
    MeshTimeoutError,
    ReachError,
    UnknownAgentError,
)
from reach_mesh.hub import _dashboard as dash
from reach_mesh.hub._a2a import HubA2a, rpc_error
from reach_mesh.hub._agent_view import ATTENTION
from reach_mesh.hub._fleet import FleetAsk, fleet_answer, fleet_asked
from reach_mesh.hub._gateway import (
    NamespaceQuery,
    RouteEndpoint,
    body_within,
    discard_body,
    error_response,
    replay,
    route_contract,
    served_by,
    status_for,
)
from reach_mesh.hub._http_models import (
    AdminBody,
    AdminResult,
    AgentList,
    CancelBody,
    Health,
    ToolMenu,
    errors,
)
from reach_mesh.hub._mcp import HubMcp
from reach_mesh.hub.http_guard import HttpGuard
from reach_mesh.models import AgentInfo, AgentState, RouteReply
from reach_mesh.tracing import inject
from reach_mesh.tracing.metrics import CONTENT_TYPE
from reach_mesh.workflow import CancelResult, WorkflowList, WorkflowView

if TYPE_CHECKING:
    from reach_mesh.hub._hub import Hub

__all__ = ["HubHttp", "status_for"]

_VERSION: Final = "0.1.0"
#: Bytes of a request body past ``max_payload`` the guard lets through (``HttpGuard.max_body``):
#: the largest envelope any route allows around a payload (MCP's and A2A's JSON-RPC).
BODY_SLACK: Final = 64 * 1024
#: A refused request's body is read and dropped before the answer, up to this many bytes (or
#: four times ``max_body``, if more) and ``DISCARD_TIMEOUT`` seconds: uvicorn closes a
#: connection with the body's bytes unread under it, and the client still sending them then
#: gets the connection reset instead of the answer (ci179). Past them, the answer says
#: ``Connection: close``.
DISCARD_MIN: Final = 8 << 20
DISCARD_TIMEOUT: Final = 10.0
#: Paths behind the bearer token (when ``http_token`` is set).
_GUARDED_PREFIXES: Final = ("/api/", "/mcp", "/a2a/")
#: Path parameters carry their grammar, so the document says what is accepted.
AgentIdPath = Annotated[
    str,
    Path(pattern=protocol.AGENT_ID_RE.pattern, max_length=194, description="<ns>.<group>.<name>"),
]
WorkflowIdPath = Annotated[
    str, Path(pattern=protocol.WORKFLOW_ID_RE.pattern, description="the workflow's id")
]
AdminOp = Literal["cordon", "uncordon", "quarantine", "release", "remove", "simulate-lost"]
#: Who asked, in the audit events of what this hub's HTTP API (REST, dashboard) asks itself:
#: whoever holds its bearer token (``http_token``).
HTTP_REQUESTER: Final = "http"
#: Bytes of agents one ``GET /api/agents`` answers at most (about 40,000 agents): past them,
#: ``truncated`` and ``next_offset``, as the fleet query over NATS within ``max_payload``.
HTTP_FLEET_MAX: Final = 16 << 20
#: The filters and page of a fleet listing (``/api/agents``, ``/api/dashboard/fleet``).
StatesQuery = Annotated[list[str] | None, Query(description="only these states (repeat for more)")]
CapabilityQuery = Annotated[str | None, Query(description="only agents serving it")]
OffsetQuery = Annotated[int, Query(ge=0, description="skip the first agents matched")]
AfterQuery = Annotated[
    str | None, Query(description="only agents whose id sorts after it: the next page")
]
AttentionQuery = Annotated[
    bool, Query(description="only agents that need an operator's look (their `attention`)")
]

log = logging.getLogger("reach_mesh.hub")

#: On every answer but the gateway's (JSON for programs): no page may show the hub's in a
#: frame. Framed, the dashboard acts for whoever clicks in it — with its tab's token — while
#: another page lays its own bait over it (clickjacking; docs/security.md, "HTTP surface").
_NEVER_FRAMED: Final = (
    (b"x-frame-options", b"DENY"),
    (b"content-security-policy", b"frame-ancestors 'none'"),
)


def _never_framed(send: Send) -> Send:
    """``send`` with :data:`_NEVER_FRAMED` added to the response's headers."""

    async def sent(message: Message) -> None:
        if message["type"] == "http.response.start":
            message = {**message, "headers": [*message.get("headers", ()), *_NEVER_FRAMED]}
        await send(message)

    return sent


class GuardMiddleware:
    """Pure ASGI middleware (streams pass through untouched, as MCP's SSE needs): the guard's
    checks before any route, counted in ``reach_http_refused_total``.

    A ``POST /api/route`` that passes goes straight to its endpoint (``HubHttp.route``, the one
    FastAPI's route calls too), past the framework's middleware and route table: on the gateway's
    hot path they cost as much as the endpoint itself."""

    def __init__(self, app: ASGIApp, http: HubHttp) -> None:
        self.app = app
        self.http = http
        self._posts: dict[str, ASGIApp] = {"/api/route": http.route}
        #: Paths behind the token when it is set (``/metrics`` only if asked).
        self._guarded = http.guarded_prefixes
        #: Bytes of a refused body read and dropped before the answer, at most.
        self._discard = max(DISCARD_MIN, 4 * (http.guard.max_body or 0))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "websocket":
            # No route serves one, and the checks below judge HTTP: closed before any route
            # (browsers open websockets across origins without asking; an A2A mount once took
            # them, token or not, and raised).
            await send({"type": "websocket.close", "code": 1008})
            return
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path: str = scope["path"]
        target = self._posts.get(path, self.app) if scope["method"] == "POST" else self.app
        if target is self.app:
            send = _never_framed(send)
        if target is self.app and not any(
            r.matches(scope)[0] is Match.FULL for r in self.http.app.router.routes
        ):
            # No route takes it: the app answers 404 or 405 and nothing runs.
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        guard = self.http.guard
        refusal = guard.check(scope["method"], path, headers, auth=path.startswith(self._guarded))
        # (the body read from: ``100 Continue`` sent, if the client waits for it)
        asked = (
            refusal is None and "transfer-encoding" in headers and "content-length" not in headers
        )
        if asked:
            # A chunked body says no length: read here, within the guard's bound, before any
            # route (each reads a body its own way, some with no bound at all).
            got = await body_within(receive, guard)
            if got is None:
                return  # the client went away: nobody to answer
            if isinstance(got, bytes):
                receive = replay(got, receive)
            else:
                refusal = got
        if refusal is None:
            await target(scope, receive, send)
            return
        self.http.hub.metrics.http_refused_total.labels(refusal.error.code).inc()
        body = refusal.error.to_wire()
        if refusal.status == 413 and path.startswith("/a2a/"):
            # A2A speaks JSON-RPC: a body over the bound is an invalid request there, as the
            # mount answered it before the guard bounded every route (docs/protocol.md).
            body = rpc_error(None, -32600, refusal.error.message)
        response = JSONResponse(body, refusal.status, dict(refusal.headers))
        if not await self._dropped(receive, headers, asked=asked):
            response.headers["connection"] = "close"
        await response(scope, receive, send)

    async def _dropped(self, receive: Receive, headers: dict[str, str], *, asked: bool) -> bool:
        """Read and drop the rest of a refused request's body, within ``self._discard`` bytes
        and ``DISCARD_TIMEOUT``: True once none is left unread (the connection may stay open);
        False to close it after the answer. ``asked``: the body has been read from already
        (``100 Continue`` sent, if the client waited for it)."""
        declared = headers.get("content-length")
        if declared == "0" or (declared is None and "transfer-encoding" not in headers):
            return True  # no body
        if not asked and headers.get("expect", "").lower() == "100-continue":
            # The client waits to be asked before it sends the body: answered unasked, it
            # sends none (RFC 9110 §10.1.1), and the connection has no body left in it.
            return False
        if declared is not None and not (declared.isdigit() and int(declared) <= self._discard):
            return False  # too much to read for nothing: the client may see a reset
        return await discard_body(receive, self._discard, DISCARD_TIMEOUT)


class HubHttp:
    """The hub's HTTP server: ``app`` (FastAPI) served by uvicorn on the hub's event loop."""

    def __init__(self, hub: Hub) -> None:
        self.hub = hub
        s = hub.settings
        self.guard = HttpGuard(
            bind_host=s.http_host,
            allowed_hosts=s.http_allowed_hosts,
            allowed_origins=s.http_allowed_origins,
            token=s.http_token,
            # Secure mode: guarded routes act with the hub's NATS rights, so not for anyone
            # who can reach the port.
            # Its HTTP API would act with the hub's NATS identity's rights.
            closed=has_identity(s),
            # The most any route takes (a route's, an MCP or A2A message's payload and its
            # envelope): the admin and cancel bodies had no bound at all.
            max_body=s.max_payload + BODY_SLACK,
        )
        #: ``POST /api/route``, the gateway's hot path (``_gateway.py``).
        self.route = RouteEndpoint(hub)
        self.mcp = HubMcp(self)
        self.a2a = HubA2a(self)
        self.app = self._build_app()
        self.server = AsgiServer(GuardMiddleware(self.app, self))
        self._host = "127.0.0.1"

    def _build_app(self) -> FastAPI:
        app = FastAPI(
            title="reach-mesh hub",
            version=_VERSION,
            summary="REST gateway, operator actions and tool menu of one reach-mesh hub",
            docs_url=None,
            redoc_url=None,
            lifespan=self.mcp.lifespan,
        )
        app.add_exception_handler(RequestValidationError, _validation_error)
        app.add_exception_handler(StarletteHTTPException, _http_error)
        app.add_exception_handler(ReachError, _reach_error)
        # What the guard answers before a route runs: 403 (Host/Origin), 401 with a token.
        refused = (401, 403) if self.guard_has_token else (403,)
        # The task gateway (behind the bearer token when ``http_token`` is set) first: the route
        # table is scanned in order on every request.
        app.router.add_api_route(
            "/api/route",
            route_contract,
            methods=["POST"],
            name="route",
            summary="Route one task to a live agent and return its answer",
            response_model=RouteReply,
            responses=errors(400, 404, 409, 413, 415, 429, 502, 503, 504, *refused),
            route_class_override=served_by(self.route),
        )
        # Open: what a browser, a prober or Prometheus fetches.
        app.get("/", include_in_schema=False, response_class=HTMLResponse)(self.dashboard)
        app.get(
            "/metrics",
            summary="Prometheus metrics (text exposition)",
            response_class=Response,
            responses={
                200: {"content": {CONTENT_TYPE: {"schema": {"type": "string"}}}},
                # Behind the token only with ``http_metrics_auth``.
                **(errors(*refused) if self.hub.settings.http_metrics_auth else {}),
            },
        )(self.metrics)
        app.get(
            "/healthz",
            summary="Liveness of this hub",
            response_model=Health,
            responses={503: {"model": Health, "description": "NATS down"}},
        )(self.healthz)
        # Behind the bearer token when ``http_token`` is set: fleet data, operator actions.
        app.get(
            "/api/agents",
            summary="Agents as this hub sees them",
            response_model=AgentList,
            responses=errors(400, *refused),
        )(self.list_agents)
        app.get(
            "/api/agents/{agent_id}",
            summary="One agent",
            response_model=AgentInfo,
            responses=errors(400, 404, *refused),
        )(self.get_agent)
        app.post(
            "/api/agents/{agent_id}/{op}",
            summary="Operator action on one agent",
            response_model=AdminResult,
            responses=errors(400, 404, 415, 502, 503, *refused),
        )(self.agent_op)
        app.get(
            "/api/workflows",
            summary="A namespace's recent workflows, newest first: state, steps, owner, error",
            response_model=WorkflowList,
            responses=errors(400, 429, 503, 504, *refused),
        )(self.list_workflows)
        app.get(
            "/api/workflows/{workflow_id}",
            summary="One workflow as it stands: owner, each step's state, attempts and errors",
            response_model=WorkflowView,
            responses=errors(400, 404, 429, 503, 504, *refused),
        )(self.get_workflow)
        app.post(
            "/api/workflows/{workflow_id}/cancel",
            summary="Cancel a workflow: its unfinished steps are cancelled, its result is FAILED "
            "(REACH_WORKFLOW_CANCELLED); with before_start, one no hub has started yet never runs",
            response_model=CancelResult,
            responses=errors(400, 404, 415, 429, 502, 503, *refused),
        )(self.cancel_workflow)
        app.get(
            "/api/tools",
            summary="The mesh's tool menu (union over live, routable agents)",
            response_model=ToolMenu,
            responses=errors(400, *refused),
        )(self.tools)
        app.get("/favicon.ico", include_in_schema=False)(self.favicon)
        # The dashboard's data (hub/_dashboard.py): one JSON view per panel.
        views = {
            "settings": (
                "This hub's id, sampling interval and trace viewer link template",
                dash.settings,
            ),
            "traffic": (
                "Request rate, success rate, p50/p99 over the last minute, and a series",
                dash.traffic,
            ),
            "workflows": (
                "Recent workflows, each step's six-state progress and attempts",
                dash.workflows,
            ),
            "pending": (
                "Routes in flight, workflows running, steps waiting for an agent",
                dash.pending,
            ),
        }
        app.get(
            "/api/dashboard/fleet",
            summary="One page of agents (filtered as /api/agents is), with the counts of all: "
            "by state; running (of max) and queued apart; applicable actions",
            response_model=dict[str, Any],
            responses=errors(400, *refused),
        )(self.dashboard_fleet)
        for part, (summary, build) in views.items():
            app.get(
                f"/api/dashboard/{part}",
                summary=summary,
                response_model=dict[str, Any],
                responses=errors(400, *refused),
            )(self._view(build))
        app.get(
            "/api/dashboard/decisions",
            summary="This hub's last route outcomes with the router's explanation, newest first",
            response_model=dict[str, Any],
            responses=errors(400, *refused),
        )(self.decisions)
        app.router.routes.append(
            Route("/mcp", self.mcp.asgi_app, methods=["GET", "POST", "DELETE"])
        )
        app.router.routes.append(Mount("/a2a/{namespace}", app=self.a2a.asgi_app))
        static = resources.files("reach_mesh.hub").joinpath("static")
        app.mount("/static", StaticFiles(directory=str(static)), name="static")
        app.openapi = self._openapi  # type: ignore[method-assign]
        return app

    @property
    def guard_has_token(self) -> bool:
        return self.hub.settings.http_token is not None

    @property
    def guarded_prefixes(self) -> tuple[str, ...]:
        """Paths (prefixes) that want the bearer token when the hub has one: the API's, and
        ``/metrics`` with ``http_metrics_auth``."""
        extra = ("/metrics",) if self.hub.settings.http_metrics_auth else ()
        return (*_GUARDED_PREFIXES, *extra)

    def _openapi(self) -> dict[str, Any]:
        """FastAPI's document plus the bearer scheme (required on /api/ when a token is set)."""
        if self.app.openapi_schema is None:
            from fastapi.openapi.utils import get_openapi

            doc = get_openapi(
                title=self.app.title,
                version=self.app.version,
                summary=self.app.summary,
                routes=self.app.routes,
            )
            components = doc.setdefault("components", {})
            components["securitySchemes"] = {
                "bearer": {
                    "type": "http",
                    "scheme": "bearer",
                    "description": "http_token (REACH_HTTP_TOKEN); wanted on /api/ and /mcp "
                    "when the hub has one",
                }
            }
            for path, item in doc["paths"].items():
                for operation in item.values():
                    if self.guard_has_token and path.startswith(self.guarded_prefixes):
                        operation["security"] = [{"bearer": []}]
                    # Validation answers 400 with the typed body (not FastAPI's 422).
                    responses = operation["responses"]
                    if responses.pop("422", None) is not None:
                        responses.setdefault("400", errors(400)[400] | {})
            schemas = components.setdefault("schemas", {})
            schemas.pop("HTTPValidationError", None)
            schemas.pop("ValidationError", None)
            _fix_400(doc)
            self.app.openapi_schema = doc
        return self.app.openapi_schema

    async def start(self, host: str, port: int) -> None:
        self._host = host
        await self.server.start(host, port)
        if self.guard.closed:
            # Said once, at start: its API answers 401 until then (docs/security.md).
            log.warning(
                "HTTP API on port %d is closed: this hub has a NATS identity (secure mode) and "
                "no http_token (REACH_HTTP_TOKEN), so /api/, /mcp%s answer 401",
                self.port,
                ", /a2a/ and /metrics" if self.hub.settings.http_metrics_auth else " and /a2a/",
            )

    async def close(self) -> None:
        await self.server.close()

    @property
    def port(self) -> int:
        return self.server.port

    @property
    def url(self) -> str:
        """Where this machine reaches the server: a wildcard bind is reached on loopback (a
        name the Host check accepts; ``http://0.0.0.0:…`` would be refused)."""
        host = {"": "127.0.0.1", "0.0.0.0": "127.0.0.1", "::": "::1"}.get(self._host, self._host)
        return f"http://[{host}]:{self.port}" if ":" in host else f"http://{host}:{self.port}"

    # ------------------------------------------------------------------ operators

    def _view(self, build: Any) -> Any:
        """A GET handler answering ``build(hub)`` as JSON."""

        async def view() -> dict[str, Any]:
            result: dict[str, Any] = build(self.hub)
            return result

        return view

    async def dashboard_fleet(
        self,
        namespace: NamespaceQuery = None,
        state: StatesQuery = None,
        capability: CapabilityQuery = None,
        limit: Annotated[
            int,
            Query(
                ge=0,
                le=dash.FLEET_PAGE_MAX,
                description="most agents listed (0: the counts only)",
            ),
        ] = dash.FLEET_PAGE,
        offset: OffsetQuery = 0,
        attention: AttentionQuery = False,
    ) -> dict[str, Any]:
        """The dashboard's fleet view: one page, at most ``dash.FLEET_PAGE_MAX`` agents."""
        ask = _fleet_ask(namespace, state, capability, limit, offset, attention=attention)
        return dash.fleet(self.hub, ask, namespace)

    async def decisions(
        self, n: Annotated[int, Query(ge=1, le=dash.DECISIONS)] = 50
    ) -> dict[str, Any]:
        return dash.recent_decisions(self.hub, n)

    async def favicon(self) -> Response:
        icon = resources.files("reach_mesh.hub").joinpath("static/favicon.svg").read_bytes()
        return Response(
            icon, media_type="image/svg+xml", headers={"Cache-Control": "max-age=86400"}
        )

    async def dashboard(self) -> HTMLResponse:
        page = resources.files("reach_mesh.hub").joinpath("static/dashboard.html").read_text()
        return HTMLResponse(page)

    async def metrics(self) -> Response:
        self.refresh_gauges()
        return Response(self.hub.metrics.render(), media_type=CONTENT_TYPE)

    def refresh_gauges(self) -> None:
        """Agent gauges are computed at scrape time from the registry (no per-event upkeep).
        A configured namespace is written with no agent too: all zeros, not absent, when its
        last agent is gone (another one's series go with its last agent; the alert rules read
        that as 0)."""
        m = self.hub.metrics
        counts: dict[tuple[str, str], int] = {}
        concerns: dict[tuple[str, str], int] = {}
        namespaces: set[str] = set(self.hub.configured_namespaces)
        for view in self.hub.registry:
            ns = view.record.card.namespace
            namespaces.add(ns)
            key = (ns, view.state.value)
            counts[key] = counts.get(key, 0) + 1
            for why in view.concerns():
                concerns[ns, why] = concerns.get((ns, why), 0) + 1
        m.agents.clear()
        m.agents_attention.clear()
        for ns in namespaces:
            for state in AgentState:
                m.agents.labels(ns, state.value).set(counts.get((ns, state.value), 0))
            for why in ATTENTION:
                m.agents_attention.labels(ns, why).set(concerns.get((ns, why), 0))
        m.preonline_count.set(
            sum(c for (_, st), c in counts.items() if st == AgentState.PRE_ONLINE.value)
        )
        m.registry_blind.set(1 if self.hub.registry.blind() else 0)
        m.clock_skew.set(self.hub.registry.server_clock.skew)
        self.hub.forget_gone_namespaces()

    async def healthz(self) -> JSONResponse:
        ok = self.hub.nats_connected
        health = Health(
            hub_id=self.hub.hub_id,
            nats_connected=ok,
            agents=len(self.hub.registry),
            registry_blind=self.hub.registry.blind(),
            registry_blind_reason=self.hub.registry.blind_reason(),
            nats_servers=self.hub.together.servers(),
            nats_split=self.hub.together.apart(),
        )
        return JSONResponse(health.model_dump(mode="json"), 200 if ok else 503)

    async def list_agents(
        self,
        namespace: NamespaceQuery = None,
        state: StatesQuery = None,
        capability: CapabilityQuery = None,
        limit: Annotated[
            int | None, Query(ge=0, description="most agents listed (0: the counts only)")
        ] = None,
        offset: OffsetQuery = 0,
        after: AfterQuery = None,
        attention: AttentionQuery = False,
    ) -> Response:
        """The fleet query over HTTP: the same answer, filters and pages (a fleet of thousands
        need not come whole every time), bounded at ``HTTP_FLEET_MAX`` bytes."""
        ask = _fleet_ask(namespace, state, capability, limit, offset, after, attention=attention)
        data = fleet_answer(self.hub.registry, self.hub.hub_id, namespace, ask, HTTP_FLEET_MAX)
        return Response(data, media_type="application/json")

    async def get_agent(self, agent_id: AgentIdPath) -> AgentInfo:
        view = self.hub.registry.require(protocol.validate_agent_id(agent_id))
        return view.info(self.hub.registry.now)

    async def list_workflows(
        self,
        namespace: NamespaceQuery = None,
        state: Annotated[
            list[str] | None, Query(description="only these states (repeat for more)")
        ] = None,
        limit: Annotated[
            int, Query(ge=1, le=protocol.WORKFLOW_LIST_MAX, description="most workflows listed")
        ] = protocol.WORKFLOW_LIST_LIMIT,
        since_s: Annotated[
            float, Query(gt=0, le=protocol.WORKFLOW_LIST_SINCE_MAX, description="seconds back")
        ] = protocol.WORKFLOW_LIST_SINCE,
        all_namespaces: Annotated[
            bool, Query(description="every namespace's (an operator's list; not with namespace)")
        ] = False,
    ) -> Response:
        """``reach.hub.<ns>.workflows`` (``namespace``: ``default`` when not given), asked
        like any caller asks it: the same budget, any hub. ``all_namespaces``: the operators'
        ``workflows`` admin op, which this hub answers (the token is an operator's)."""
        ns = protocol.DEFAULT_NAMESPACE if namespace is None else namespace
        body = {"state": state or [], "limit": limit, "since_s": since_s}
        if all_namespaces:
            if namespace is not None:
                raise BadRequestError(
                    "all_namespaces lists every namespace: leave out namespace",
                    field="namespace",
                )
            asked = protocol.dumps({"op": "workflows", **body})
            return await self._answer(
                protocol.hub_subject(ns, "admin"), self.hub.admin_op(ns, asked, HTTP_REQUESTER)
            )
        data = await self.nats_request(
            protocol.hub_subject(protocol.validate_namespace(ns), "workflows"),
            protocol.dumps(body),
        )
        return Response(data, media_type="application/json")

    async def get_workflow(
        self, workflow_id: WorkflowIdPath, namespace: NamespaceQuery = None
    ) -> Response:
        """``reach.hub.<ns>.workflow`` (``namespace``: ``default`` when not given, as for
        ``POST /api/route``), asked like any caller asks it: the same throttle, any hub."""
        ns = protocol.DEFAULT_NAMESPACE if namespace is None else namespace
        data = await self.nats_request(
            protocol.hub_subject(protocol.validate_namespace(ns), "workflow"),
            protocol.dumps({"workflow_id": protocol.validate_workflow_id(workflow_id)}),
        )
        return Response(data, media_type="application/json")

    async def cancel_workflow(
        self,
        workflow_id: WorkflowIdPath,
        namespace: NamespaceQuery = None,
        body: Annotated[
            CancelBody | None, Body(description="optional: why, and before_start")
        ] = None,
    ) -> Response:
        """``reach.hub.<ns>.cancel``, taken by this hub as it takes one sent on NATS
        (``namespace``: ``default`` when not given): the same budget, audited with requester
        ``http``. One answer: ``final`` false means the owner is still stopping it — POST
        again (a cancel is idempotent)."""
        ns = protocol.validate_namespace(
            protocol.DEFAULT_NAMESPACE if namespace is None else namespace
        )
        asked = protocol.dumps(
            {
                "workflow_id": protocol.validate_workflow_id(workflow_id),
                "reason": None if body is None else body.reason,
                "before_start": body is not None and body.before_start,
            }
        )
        return await self._answer(
            protocol.hub_subject(ns, "cancel"),
            self.hub.cancel_workflow(ns, asked, HTTP_REQUESTER),
        )

    async def agent_op(
        self,
        agent_id: AgentIdPath,
        op: Annotated[AdminOp, Path()],
        body: Annotated[
            AdminBody | None, Body(description="optional: why (send {} for none: a POST is JSON)")
        ] = None,
    ) -> Response:
        """What ``reach-mesh <op> AGENT_ID`` does (every hub follows), or, for
        ``simulate-lost``, a drill on this hub only; audited (kind ``admin``) with the reason
        and requester ``http``."""
        # Taken by this hub as it takes reach.hub.<ns>.admin (as POST /api/route is routed
        # here): sent over NATS, the audit could name only the hub's own inbox as who asked.
        protocol.validate_agent_id(agent_id)
        reason = protocol.validate_reason(None if body is None else body.reason)
        if op == "simulate-lost":
            # Drill for operators: this hub stops counting the agent's lease now, as if
            # its heartbeats were lost; the next real heartbeat brings it back.
            view = self.hub.registry.require(agent_id)
            view.last_seen = self.hub.registry.now - view.record.lease_timeout - 1e-3
            self.hub.registry.regrade(view)
            await self.hub.audit.record(
                view.record.card.namespace,
                "admin",
                agent_id=agent_id,
                op=op,
                requester=HTTP_REQUESTER,
                reason=reason,
            )
            result = AdminResult(agent_id=agent_id, op=op, state=view.state)
            return JSONResponse(result.model_dump(mode="json"))
        asked = protocol.dumps({"op": op, "agent_id": agent_id, "reason": reason})
        ns = protocol.namespace_of(agent_id)
        return await self._answer(
            protocol.hub_subject(ns, "admin"), self.hub.admin_op(ns, asked, HTTP_REQUESTER)
        )

    async def _answer(self, subject: str, answer: Awaitable[bytes]) -> Response:
        """What this hub answers itself to a request it would take on ``subject``, as its
        NATS dispatcher would (``Hub.error_body``): an error is raised typed, for its status
        (never a bare 500)."""
        try:
            data = await answer
        except Exception as err:
            data = self.hub.error_body(subject, err)
            protocol.raise_for_error(data)
        return Response(data, media_type="application/json")

    # ------------------------------------------------------------------ gateway

    async def route_task(
        self, body: bytes, namespace: str, headers: dict[str, str] | None = None
    ) -> bytes:
        """Route one ``RouteRequest`` (JSON) through this hub; an error answer raises its typed
        :class:`ReachError`, else the ``RouteReply`` bytes are returned."""
        data = await self.hub.route(body, namespace, headers)
        protocol.raise_for_error(data)
        return data

    async def nats_request(self, subject: str, body: bytes, timeout: float = 10.0) -> bytes:
        """One NATS request; NATS failures and typed error replies raise :class:`ReachError`."""
        try:
            msg = await self.hub.nc.request(subject, body, timeout=timeout, headers=inject({}))
        except NoRespondersError as err:
            raise UnknownAgentError(f"no responder on {subject}") from err
        except (NatsTimeoutError, TimeoutError) as err:
            raise MeshTimeoutError(f"no answer on {subject} within {timeout:g}s") from err
        protocol.raise_for_error(msg.data)
        data: bytes = msg.data
        return data

    # ------------------------------------------------------------------ tools

    def tool_menu(self, namespace: str | None = None) -> list[dict[str, Any]]:
        """The union of tools over live agents, MCP-shaped, with the agents serving each.

        Tools merge by name within a namespace only: a name offered in several namespaces is
        listed once per namespace as ``<namespace>.<name>``, and so is any name with a dot
        (``b.search`` offered in ``a``: ``a.b.search``), which could pass for a qualified one:
        no tenant's tool can take another's name (its description, its schema, where a call
        goes)."""
        menu: dict[tuple[str, str], dict[str, Any]] = {}
        for view in self.hub.registry:
            if not self.hub.registry.routable(view):
                continue
            card = view.record.card
            if namespace is not None and card.namespace != namespace:
                continue
            for tool in card.tools:
                entry = menu.setdefault(
                    (card.namespace, tool.name),
                    {
                        "name": tool.name,
                        "description": tool.description,
                        "inputSchema": tool.parameters,
                        "capability": tool.capability,
                        "agents": [],
                    },
                )
                entry["agents"].append(card.agent_id)
        offered = Counter(name for _, name in menu)
        for (ns, name), entry in menu.items():
            if offered[name] > 1 or "." in name:
                entry["name"] = f"{ns}.{name}"
        return sorted(menu.values(), key=lambda t: str(t["name"]))

    async def tools(self, namespace: NamespaceQuery = None) -> ToolMenu:
        if namespace is not None:
            protocol.validate_namespace(namespace)
        return ToolMenu.model_validate({"tools": self.tool_menu(namespace)})


def _fleet_ask(
    namespace: str | None,
    state: list[str] | None,
    capability: str | None,
    limit: int | None,
    offset: int,
    after: str | None = None,
    *,
    attention: bool = False,
) -> FleetAsk:
    """The query parameters of a fleet listing (``/api/agents``, ``/api/dashboard/fleet``)
    read as the fleet query reads its body: ``REACH_BAD_REQUEST`` (400) naming the field."""
    if namespace is not None:
        protocol.validate_namespace(namespace)
    body: dict[str, Any] = {
        "state": state or [],
        "limit": limit,
        "offset": offset,
        "attention": attention,
    }
    if capability is not None:
        body["capability"] = capability
    if after is not None:
        body["after"] = after
    return fleet_asked(body)


def _fix_400(doc: dict[str, Any]) -> None:
    """Point every documented 400 at the typed error body."""
    ref = {"$ref": "#/components/schemas/ErrorResponse"}
    for item in doc["paths"].values():
        for operation in item.values():
            r400 = operation["responses"].get("400")
            if r400 is not None:
                r400["content"] = {"application/json": {"schema": ref}}


async def _validation_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, RequestValidationError)
    first = exc.errors()[0] if exc.errors() else {}
    where = ".".join(str(p) for p in first.get("loc", ()))
    err = BadRequestError(f"{where}: {first.get('msg', 'invalid request')}", field=where)
    return error_response(err)


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, StarletteHTTPException)
    code = {404: "REACH_NOT_FOUND", 405: "REACH_METHOD_NOT_ALLOWED"}.get(
        exc.status_code, "REACH_BAD_REQUEST"
    )
    body = {"error": {"code": code, "message": str(exc.detail)}}
    return JSONResponse(body, exc.status_code, dict(exc.headers or {}))


async def _reach_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ReachError)
    return error_response(exc)
