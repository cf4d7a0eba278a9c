"""The hub's HTTP face: Prometheus ``/metrics``, a REST gateway with an OpenAPI document, the
operators' dashboard, and an MCP endpoint serving the mesh's tool menu.

REST calls go through NATS like any other client (``/api/route`` requests ``reach.hub.<ns>.route``),
so any hub in the queue group may answer and the HTTP path adds no second routing logic.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from importlib import resources
from typing import TYPE_CHECKING, Any, Final

from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError

from reach_mesh import protocol
from reach_mesh._http import Handler, HttpError, HttpRequest, HttpResponse, HttpServer
from reach_mesh.errors import (
    BadRequestError,
    MeshTimeoutError,
    NoMatchError,
    ReachError,
    ThrottledError,
    UnknownAgentError,
)
from reach_mesh.hub import _dashboard as dash
from reach_mesh.hub.http_guard import HttpGuard
from reach_mesh.models import AgentState, RouteRequest
from reach_mesh.tracing import inject
from reach_mesh.tracing.metrics import CONTENT_TYPE

if TYPE_CHECKING:
    from reach_mesh.hub._hub import Hub

__all__ = ["HubHttp"]

_HTML: Final = "text/html; charset=utf-8"
_MCP_PROTOCOL: Final = "2025-06-18"


def _status_for(err: ReachError) -> int:
    if isinstance(err, NoMatchError | UnknownAgentError):
        return 404
    if isinstance(err, ThrottledError):
        return 429
    if isinstance(err, MeshTimeoutError):
        return 504
    if isinstance(err, BadRequestError):
        return 413 if err.code == "REACH_PAYLOAD_TOO_LARGE" else 400
    return 502


def _error(err: ReachError) -> HttpResponse:
    headers = {}
    if isinstance(err, ThrottledError):
        headers["Retry-After"] = str(max(1, round(err.retry_after)))
    return HttpResponse.json(err.to_wire(), _status_for(err), headers)


class HubHttp:
    def __init__(self, hub: Hub) -> None:
        self.hub = hub
        self.server = HttpServer(max_body_size=hub.settings.max_payload + 64 * 1024)
        s = hub.settings
        self.guard = HttpGuard(
            bind_host=s.http_host,
            allowed_hosts=s.http_allowed_hosts,
            allowed_origins=s.http_allowed_origins,
            token=s.http_token,
        )
        open_, g = self._open, self._guarded
        r = self.server.route
        # Open: what a browser, a prober or Prometheus fetches.
        r("GET", "/", open_(self.dashboard))
        r("GET", "/metrics", open_(self.metrics))
        r("GET", "/healthz", open_(self.healthz))
        r("GET", "/openapi.json", open_(self.openapi))
        r("GET", "/favicon.ico", open_(self.favicon))
        # Behind the bearer token when ``http_token`` is set: fleet data, operator actions,
        # the task gateway.
        r("GET", "/api/agents", g(self.list_agents))
        r("GET", "/api/agents/{agent_id}", g(self.get_agent))
        r("POST", "/api/agents/{agent_id}/{op}", g(self.agent_op))
        r("POST", "/api/route", g(self.route))
        r("GET", "/api/tools", g(self.tools))
        r("POST", "/mcp", g(self.mcp))
        # The dashboard's data (hub/_dashboard.py): one JSON view per panel.
        r("GET", "/api/dashboard/settings", g(self._view(lambda q: dash.settings(self.hub))))
        r("GET", "/api/dashboard/fleet", g(self._view(lambda q: dash.fleet(self.hub))))
        r("GET", "/api/dashboard/traffic", g(self._view(lambda q: dash.traffic(self.hub))))
        r("GET", "/api/dashboard/decisions", g(self._view(self._decisions)))
        r("GET", "/api/dashboard/workflows", g(self._view(lambda q: dash.workflows(self.hub))))
        r("GET", "/api/dashboard/pending", g(self._view(lambda q: dash.pending(self.hub))))
        self._host = "127.0.0.1"

    def _open(self, handler: Handler) -> Handler:
        """``handler`` behind the guard's Host, Origin and content-type checks."""
        return self._checked(handler, auth=False)

    def _guarded(self, handler: Handler) -> Handler:
        """``handler`` behind the same checks plus the bearer token (when configured)."""
        return self._checked(handler, auth=True)

    def _checked(self, handler: Handler, *, auth: bool) -> Handler:
        guard = self.guard
        refused = self.hub.metrics.http_refused_total

        async def checked(request: HttpRequest) -> HttpResponse:
            refusal = guard.check(request.method, request.path, request.headers, auth=auth)
            if refusal is None:
                return await handler(request)
            refused.labels(refusal.error.code).inc()
            return HttpResponse.json(refusal.error.to_wire(), refusal.status, refusal.headers)

        return checked

    def _view(self, build: Callable[[HttpRequest], dict[str, Any]]) -> Handler:
        """A GET handler answering ``build(request)`` as JSON (a ``ReachError`` as typed)."""

        async def view(request: HttpRequest) -> HttpResponse:
            try:
                return HttpResponse.json(build(request))
            except ReachError as err:
                return _error(err)

        return view

    def _decisions(self, request: HttpRequest) -> dict[str, Any]:
        return dash.recent_decisions(self.hub, dash.decisions_limit(request.query_value("n")))

    async def start(self, host: str, port: int) -> None:
        self._host = host
        await self.server.start(host, port)

    async def close(self) -> None:
        await self.server.close()

    @property
    def url(self) -> str:
        """Where this machine reaches the server: a wildcard bind is reached on loopback (a
        name the Host check accepts; ``http://0.0.0.0:…`` would be refused)."""
        host = {"": "127.0.0.1", "0.0.0.0": "127.0.0.1", "::": "::1"}.get(self._host, self._host)
        return (
            f"http://[{host}]:{self.server.port}"
            if ":" in host
            else f"http://{host}:{self.server.port}"
        )

    # ------------------------------------------------------------------ operators

    async def dashboard(self, request: HttpRequest) -> HttpResponse:
        page = resources.files("reach_mesh.hub").joinpath("static/dashboard.html").read_text()
        return HttpResponse.text(page, content_type=_HTML)

    async def favicon(self, request: HttpRequest) -> HttpResponse:
        icon = resources.files("reach_mesh.hub").joinpath("static/favicon.svg").read_bytes()
        return HttpResponse(200, icon, "image/svg+xml", {"Cache-Control": "max-age=86400"})

    async def metrics(self, request: HttpRequest) -> HttpResponse:
        self.refresh_gauges()
        return HttpResponse(200, self.hub.metrics.render(), CONTENT_TYPE)

    def refresh_gauges(self) -> None:
        """Agent gauges are computed at scrape time from the registry (no per-event upkeep)."""
        m = self.hub.metrics
        counts: dict[tuple[str, str], int] = {}
        namespaces: set[str] = set()
        for view in self.hub.registry:
            ns = view.record.card.namespace
            namespaces.add(ns)
            key = (ns, view.state.value)
            counts[key] = counts.get(key, 0) + 1
        m.agents.clear()
        for ns in namespaces:
            for state in AgentState:
                m.agents.labels(ns, state.value).set(counts.get((ns, state.value), 0))
        m.preonline_count.set(
            sum(c for (_, st), c in counts.items() if st == AgentState.PRE_ONLINE.value)
        )

    async def healthz(self, request: HttpRequest) -> HttpResponse:
        nc = self.hub.nc
        ok = nc.is_connected
        return HttpResponse.json(
            {"hub_id": self.hub.hub_id, "nats_connected": ok, "agents": len(self.hub.registry)},
            200 if ok else 503,
        )

    async def list_agents(self, request: HttpRequest) -> HttpResponse:
        ns = request.query_value("namespace")
        if ns is not None:
            try:
                protocol.validate_namespace(ns)
            except ReachError as err:
                return _error(err)
        infos = self.hub.registry.infos(ns)
        return HttpResponse.json(
            {"hub_id": self.hub.hub_id, "agents": [i.model_dump(mode="json") for i in infos]}
        )

    async def get_agent(self, request: HttpRequest) -> HttpResponse:
        try:
            agent_id = protocol.validate_agent_id(request.path_params["agent_id"])
            view = self.hub.registry.require(agent_id)
        except ReachError as err:
            return _error(err)
        return HttpResponse.json(view.info(self.hub.registry.now).model_dump(mode="json"))

    async def agent_op(self, request: HttpRequest) -> HttpResponse:
        op = request.path_params["op"]
        agent_id = request.path_params["agent_id"]
        try:
            protocol.validate_agent_id(agent_id)
            if op == "simulate-lost":
                # Drill for operators: this hub stops counting the agent's lease now, as if
                # its heartbeats were lost; the next real heartbeat brings it back.
                view = self.hub.registry.require(agent_id)
                view.last_seen = self.hub.registry.now - view.record.lease_timeout - 1e-3
                self.hub.registry.regrade(view)
                await self.hub.audit.record(
                    view.record.card.namespace, "admin", agent_id=agent_id, op=op
                )
                return HttpResponse.json(
                    {"agent_id": agent_id, "op": op, "state": view.state.value}
                )
            data = await self._nats(
                protocol.hub_subject(protocol.namespace_of(agent_id), "admin"),
                protocol.dumps({"op": op, "agent_id": agent_id}),
            )
        except ReachError as err:
            return _error(err)
        return HttpResponse(200, data, "application/json")

    # ------------------------------------------------------------------ gateway

    async def route(self, request: HttpRequest) -> HttpResponse:
        """``POST /api/route?namespace=ns`` with a RouteRequest body → RouteReply."""
        try:
            ns = protocol.validate_namespace(request.query_value("namespace") or "default")
            req = protocol.decode(
                request.body, RouteRequest, max_size=self.hub.settings.max_payload + 16 * 1024
            )
            if req.agent_id is not None:
                ns = protocol.namespace_of(req.agent_id)
            data = await self._nats(
                protocol.hub_subject(ns, "route"), request.body, timeout=req.timeout + 2
            )
        except ReachError as err:
            return _error(err)
        return HttpResponse(200, data, "application/json")

    async def _nats(self, subject: str, body: bytes, timeout: float = 10.0) -> bytes:
        try:
            msg = await self.hub.nc.request(subject, body, timeout=timeout, headers=inject({}))
        except NoRespondersError as err:
            raise UnknownAgentError(f"no responder on {subject}") from err
        except (NatsTimeoutError, TimeoutError) as err:
            raise MeshTimeoutError(f"no answer on {subject} within {timeout:g}s") from err
        protocol.raise_for_error(msg.data)
        data: bytes = msg.data
        return data

    # ------------------------------------------------------------------ tools / MCP

    def tool_menu(self, namespace: str | None = None) -> list[dict[str, Any]]:
        """The union of tools over live agents, MCP-shaped, with the agents serving each."""
        menu: dict[str, dict[str, Any]] = {}
        for view in self.hub.registry:
            if not self.hub.registry.routable(view):
                continue
            card = view.record.card
            if namespace is not None and card.namespace != namespace:
                continue
            for tool in card.tools:
                entry = menu.setdefault(
                    tool.name,
                    {
                        "name": tool.name,
                        "description": tool.description,
                        "inputSchema": tool.parameters,
                        "capability": tool.capability,
                        "agents": [],
                    },
                )
                entry["agents"].append(card.agent_id)
        return sorted(menu.values(), key=lambda t: str(t["name"]))

    async def tools(self, request: HttpRequest) -> HttpResponse:
        return HttpResponse.json({"tools": self.tool_menu(request.query_value("namespace"))})

    async def mcp(self, request: HttpRequest) -> HttpResponse:
        """A minimal MCP (JSON-RPC 2.0 over HTTP POST) server: initialize, tools/list,
        tools/call (routed to a live agent serving the tool's capability)."""
        try:
            body = request.json()
        except HttpError:
            return HttpResponse.json(_rpc_error(None, -32700, "parse error"))
        if not isinstance(body, dict):
            return HttpResponse.json(_rpc_error(None, -32600, "invalid request"))
        rpc_id = body.get("id")
        method = body.get("method")
        params = body.get("params") or {}
        ns = request.query_value("namespace")
        if method == "initialize":
            return HttpResponse.json(
                {
                    "jsonrpc": "2.0",
                    "id": rpc_id,
                    "result": {
                        "protocolVersion": _MCP_PROTOCOL,
                        "capabilities": {"tools": {"listChanged": False}},
                        "serverInfo": {"name": "reach-mesh", "version": "0.1.0"},
                    },
                }
            )
        if method == "notifications/initialized":
            return HttpResponse(202)
        if method == "tools/list":
            tools = [
                {k: t[k] for k in ("name", "description", "inputSchema")}
                for t in self.tool_menu(ns)
            ]
            return HttpResponse.json({"jsonrpc": "2.0", "id": rpc_id, "result": {"tools": tools}})
        if method == "tools/call":
            name = params.get("name") if isinstance(params, dict) else None
            tool = next((t for t in self.tool_menu(ns) if t["name"] == name), None)
            if tool is None or not tool["capability"]:
                return HttpResponse.json(_rpc_error(rpc_id, -32602, f"unknown tool {name!r}"))
            req = RouteRequest(capability=tool["capability"], payload=params.get("arguments") or {})
            agent_ns = protocol.namespace_of(tool["agents"][0])
            try:
                data = await self._nats(
                    protocol.hub_subject(agent_ns, "route"),
                    protocol.encode(req),
                    timeout=req.timeout + 2,
                )
            except ReachError as err:
                return HttpResponse.json(
                    {
                        "jsonrpc": "2.0",
                        "id": rpc_id,
                        "result": {
                            "isError": True,
                            "content": [{"type": "text", "text": f"{err.code}: {err.message}"}],
                        },
                    }
                )
            reply = json.loads(data)
            task = reply.get("task") or {}
            failed = task.get("state") != "SUCCEEDED"
            text = json.dumps(task.get("error") if failed else task.get("result"))
            return HttpResponse.json(
                {
                    "jsonrpc": "2.0",
                    "id": rpc_id,
                    "result": {"isError": failed, "content": [{"type": "text", "text": text}]},
                }
            )
        return HttpResponse.json(_rpc_error(rpc_id, -32601, f"method {method!r} not found"))

    async def openapi(self, request: HttpRequest) -> HttpResponse:
        return HttpResponse.json(openapi_document())


#: The dashboard's JSON views (docs/protocol.md, "Dashboard endpoints").
_DASHBOARD_PATHS: Final[tuple[tuple[str, str, list[dict[str, Any]]], ...]] = (
    ("settings", "This hub's id, sampling interval and trace viewer link template", []),
    ("fleet", "Agents by state; running (of max) and queued apart; applicable actions", []),
    ("traffic", "Request rate, success rate, p50/p99 over the last minute, and a series", []),
    (
        "decisions",
        "This hub's last route outcomes with the router's explanation, newest first",
        [{"name": "n", "in": "query", "schema": {"type": "integer", "minimum": 1, "maximum": 200}}],
    ),
    ("workflows", "Recent workflows, each step's six-state progress and attempts", []),
    ("pending", "Routes in flight, workflows running, steps waiting for an agent", []),
)


def _rpc_error(rpc_id: Any, code: int, message: str) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "id": rpc_id, "error": {"code": code, "message": message}}


def openapi_document() -> dict[str, Any]:
    """OpenAPI 3.1 description of the REST gateway (schemas from the pydantic wire models)."""
    from reach_mesh.models import AgentInfo, RouteReply

    err = {
        "description": "typed error",
        "content": {
            "application/json": {
                "schema": {
                    "type": "object",
                    "properties": {
                        "error": {
                            "type": "object",
                            "properties": {
                                "code": {"type": "string"},
                                "message": {"type": "string"},
                                "details": {"type": "object"},
                            },
                        }
                    },
                }
            }
        },
    }

    def ref(model: Any) -> dict[str, Any]:
        return {"content": {"application/json": {"schema": model.model_json_schema()}}}

    agent_id = {"name": "agent_id", "in": "path", "required": True, "schema": {"type": "string"}}
    # What the guard (http_guard.py) answers before a POST's handler runs: bearer token,
    # Host / Origin, content type (docs/security.md).
    refused = {"401": err, "403": err, "415": err}
    dashboard = {
        f"/api/dashboard/{part}": {
            "get": {
                "summary": summary,
                "parameters": params,
                "responses": {"200": {"description": part}, "400": err, "401": err},
            }
        }
        for part, summary, params in _DASHBOARD_PATHS
    }
    return {
        "openapi": "3.1.0",
        "info": {"title": "reach-mesh hub", "version": "0.1.0"},
        "paths": {
            **dashboard,
            "/api/route": {
                "post": {
                    "summary": "Route one task to a live agent (proxy mode) and return its answer",
                    "parameters": [
                        {"name": "namespace", "in": "query", "schema": {"type": "string"}}
                    ],
                    "requestBody": {"required": True, **ref(RouteRequest)},
                    "responses": {
                        "200": {"description": "routed", **ref(RouteReply)},
                        "400": err,
                        "404": err,
                        "413": err,
                        "429": err,
                        "504": err,
                        **refused,
                    },
                }
            },
            "/api/agents": {
                "get": {
                    "summary": "Agents as this hub sees them",
                    "parameters": [
                        {"name": "namespace", "in": "query", "schema": {"type": "string"}}
                    ],
                    "responses": {
                        "200": {
                            "description": "agents",
                            "content": {
                                "application/json": {
                                    "schema": {
                                        "type": "object",
                                        "properties": {
                                            "hub_id": {"type": "string"},
                                            "agents": {
                                                "type": "array",
                                                "items": AgentInfo.model_json_schema(),
                                            },
                                        },
                                    }
                                }
                            },
                        }
                    },
                }
            },
            "/api/agents/{agent_id}": {
                "get": {
                    "summary": "One agent",
                    "parameters": [agent_id],
                    "responses": {"200": {"description": "agent", **ref(AgentInfo)}, "404": err},
                }
            },
            "/api/agents/{agent_id}/{op}": {
                "post": {
                    "summary": "Operator action: cordon, uncordon, quarantine, release, remove, "
                    "simulate-lost",
                    "parameters": [
                        agent_id,
                        {
                            "name": "op",
                            "in": "path",
                            "required": True,
                            "schema": {
                                "type": "string",
                                "enum": [
                                    "cordon",
                                    "uncordon",
                                    "quarantine",
                                    "release",
                                    "remove",
                                    "simulate-lost",
                                ],
                            },
                        },
                    ],
                    "responses": {
                        "200": {"description": "done"},
                        "400": err,
                        "404": err,
                        **refused,
                    },
                }
            },
            "/api/tools": {
                "get": {
                    "summary": "The mesh's tool menu (union over live agents)",
                    "responses": {"200": {"description": "tools"}},
                }
            },
            "/mcp": {
                "post": {
                    "summary": "MCP JSON-RPC: initialize, tools/list, tools/call",
                    "responses": {"200": {"description": "JSON-RPC response"}, **refused},
                }
            },
            "/metrics": {
                "get": {
                    "summary": "Prometheus metrics",
                    "responses": {"200": {"description": "text exposition"}},
                }
            },
            "/healthz": {
                "get": {
                    "summary": "Liveness of this hub",
                    "responses": {
                        "200": {"description": "ok"},
                        "503": {"description": "NATS down"},
                    },
                }
            },
        },
    }
