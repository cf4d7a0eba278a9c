"""MCP at ``/mcp`` on the official ``mcp`` SDK (streamable HTTP): the mesh's tool menu.

Tools are the tools of live, routable agents (``HubHttp.tool_menu``); a call is routed through
the mesh like ``POST /api/route``. The menu changes as agents come and go, so the server
declares ``tools.listChanged`` and tells its clients: handshake-era sessions (``initialize``)
get ``notifications/tools/list_changed``, 2026-07-28 clients get ``ToolsListChanged`` on their
``subscriptions/listen`` stream. Host, Origin and the bearer token are checked before the SDK
sees a request (``GuardMiddleware`` in ``http.py``); the SDK's own rebinding check is off so
there is one set of rules.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import weakref
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any, Final

import mcp_types as types
from mcp.server.lowlevel.server import NotificationOptions, Server
from mcp.server.session import ServerSession
from mcp.server.streamable_http_manager import StreamableHTTPASGIApp, StreamableHTTPSessionManager
from mcp.server.subscriptions import InMemorySubscriptionBus, ListenHandler
from mcp.server.transport_security import TransportSecuritySettings
from mcp.shared.exceptions import MCPError
from mcp.shared.subscriptions import ToolsListChanged
from mcp_types.methods import serialize_server_result
from mcp_types.version import KNOWN_PROTOCOL_VERSIONS
from pydantic import ValidationError

from reach_mesh import protocol
from reach_mesh.errors import NoMatchError, ReachError
from reach_mesh.logs import LineBudget, get_logger
from reach_mesh.models import RouteRequest

if TYPE_CHECKING:
    from fastapi import FastAPI

    from reach_mesh.hub.http import HubHttp

__all__ = ["HubMcp"]

_log = get_logger(__name__)
#: How often the menu is compared when no registry event woke the watcher.
_MENU_POLL: Final = 1.0
#: Tool schemas judged (``_servable``), remembered up to this many (then judged again).
_SCHEMAS_KEPT: Final = 4096


class _MeshServer(Server[Any]):
    def create_initialization_options(self, *args: Any, **kwargs: Any) -> Any:
        # The menu follows the fleet: handshake-era clients are told when it changes.
        return super().create_initialization_options(NotificationOptions(tools_changed=True))


class HubMcp:
    """The hub's MCP server: ``asgi_app`` for ``/mcp``, ``lifespan`` for the FastAPI app."""

    def __init__(self, http: HubHttp) -> None:
        self.http = http
        self.bus = InMemorySubscriptionBus()
        self._listen = ListenHandler(self.bus)
        self.server = _MeshServer(
            "reach-mesh",
            version="0.1.0",
            instructions="The tools of the live agents of a reach-mesh fleet.",
            on_list_tools=self._list_tools,
            on_call_tool=self._call_tool,
            on_subscriptions_listen=self._listen,
        )
        self.manager = StreamableHTTPSessionManager(
            app=self.server,
            security_settings=TransportSecuritySettings(enable_dns_rebinding_protection=False),
            max_request_body_size=http.hub.settings.max_payload + 64 * 1024,
        )
        self.asgi_app = StreamableHTTPASGIApp(self.manager)
        #: Handshake-era connections that listed the tools: they hear about changes.
        self._connections: weakref.WeakSet[Any] = weakref.WeakSet()
        self._changed = asyncio.Event()
        #: Tool JSON → whether every MCP protocol version takes it (``_servable``).
        self._servable_tools: dict[str, bool] = {}
        #: A tool left out of the menu is said once an hour per tool, not per ``tools/list``.
        self._left_out = LineBudget(3600.0)

    @contextlib.asynccontextmanager
    async def lifespan(self, app: FastAPI) -> AsyncIterator[None]:
        self.http.hub.registry.on_state_change(lambda *_: self._changed.set())
        async with self.manager.run():
            watcher = asyncio.create_task(self._watch_menu(), name="reach-mcp-menu")
            try:
                yield
            finally:
                watcher.cancel()
                self._listen.close()
                with contextlib.suppress(asyncio.CancelledError):
                    await watcher

    def _names(self) -> frozenset[str]:
        return frozenset(t["name"] for t in self.http.tool_menu())

    async def _watch_menu(self) -> None:
        names = self._names()
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(_MENU_POLL):
                    await self._changed.wait()
            self._changed.clear()
            now = self._names()
            if now == names:
                continue
            names = now
            await self.bus.publish(ToolsListChanged())
            for connection in list(self._connections):
                try:
                    await connection.send_tool_list_changed()
                except Exception:  # a gone connection: it is dropped
                    self._connections.discard(connection)

    async def _list_tools(
        self, ctx: Any, params: types.PaginatedRequestParams | None
    ) -> types.ListToolsResult:
        # The SDK makes a ServerSession per request; the connection behind it is what lasts.
        session = getattr(ctx, "session", None)
        if isinstance(session, ServerSession):
            self._connections.add(session._connection)
        tools = [
            types.Tool(
                name=t["name"],
                description=t["description"] or None,
                input_schema=_object_schema(t["inputSchema"]),
            )
            for t in self.http.tool_menu(_namespace(ctx))
        ]
        return types.ListToolsResult(tools=[t for t in tools if self._servable(t)])

    def _servable(self, tool: types.Tool) -> bool:
        """Whether every MCP protocol version's ``Tool`` takes ``tool``. The SDK checks the
        whole answer against the client's version only after the handler returned: one agent
        whose schema it refuses (``properties: 5``, registered by an agent of an earlier
        version, before registration checked it) would fail ``tools/list`` for every client
        with an internal error. Such a tool is left out, and said at WARNING once an hour."""
        # The answer's shape around the tool (its cache fields are the SDK's to fill).
        body = types.ListToolsResult(tools=[tool], cache_scope="private", ttl_ms=0).model_dump(
            by_alias=True, mode="json", exclude_none=True
        )
        key = json.dumps(body["tools"], sort_keys=True)
        ok = self._servable_tools.get(key)
        if ok is None:
            problem: str | None = None
            for version in KNOWN_PROTOCOL_VERSIONS:
                try:
                    serialize_server_result("tools/list", version, body)
                except KeyError:
                    continue  # a version without tools/list
                except ValidationError as err:
                    first = err.errors(include_url=False)[0]
                    where = ".".join(str(p) for p in first["loc"][2:])  # below tools.<i>
                    problem = f"{where}: {first['msg']} (protocol {version})"
                    break
            ok = problem is None
            if len(self._servable_tools) >= _SCHEMAS_KEPT:
                self._servable_tools.clear()
            self._servable_tools[key] = ok
            if problem is not None:
                self._left_out.warn(
                    _log,
                    tool.name,
                    "MCP tool %r left out of tools/list: its inputSchema is no JSON Schema "
                    "MCP clients take (%s); its agent must register it again with a valid one",
                    tool.name,
                    problem,
                )
        return ok

    async def _call_tool(
        self, ctx: Any, params: types.CallToolRequestParams
    ) -> types.CallToolResult:
        menu = self.http.tool_menu(_namespace(ctx))
        named = [t for t in menu if t["name"] == params.name]
        tool = named[0] if len(named) == 1 else None  # an ambiguous name calls nobody
        try:
            if tool is None or not tool["capability"]:
                raise NoMatchError(
                    f"no live agent serves tool {params.name!r} (its agents are gone, "
                    "not routable, or it never existed): list the tools again"
                )
            req = RouteRequest(capability=tool["capability"], payload=params.arguments or {})
            data = await self.http.route_task(
                protocol.encode(req), protocol.namespace_of(tool["agents"][0])
            )
        except ReachError as err:
            return _tool_error(f"{err.code}: {err.message}")
        task = json.loads(data).get("task") or {}
        if task.get("state") != "SUCCEEDED":
            error = task.get("error") or {"code": "REACH_HANDLER_FAILED"}
            return _tool_error(json.dumps(error))
        result = task.get("result")
        return types.CallToolResult(
            content=[types.TextContent(text=json.dumps(result))],
            structured_content=result if isinstance(result, dict) else None,
        )


def _namespace(ctx: Any) -> str | None:
    """``/mcp?namespace=ns`` narrows the menu to one tenant. An invalid one is the caller's
    mistake: JSON-RPC invalid params (-32602) with the typed error as its ``data`` — any
    other exception the SDK answers with code 0 and logs at ERROR with a traceback."""
    request = getattr(ctx, "request", None)
    query = getattr(request, "query_params", None)
    ns = None if query is None else query.get("namespace")
    try:
        return None if ns is None else protocol.validate_namespace(ns)
    except ReachError as err:
        raise MCPError(
            code=types.INVALID_PARAMS,
            message=f"{err.code}: {err.message} (in ?namespace=)",
            data=err.to_wire()["error"],
        ) from None


def _tool_error(text: str) -> types.CallToolResult:
    return types.CallToolResult(content=[types.TextContent(text=text)], is_error=True)


def _object_schema(schema: dict[str, Any]) -> dict[str, Any]:
    """MCP wants ``type: object`` at the root of an input schema."""
    return schema if schema.get("type") == "object" else {"type": "object"}
