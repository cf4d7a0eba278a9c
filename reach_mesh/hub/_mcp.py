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
from mcp.shared.subscriptions import ToolsListChanged

from reach_mesh import protocol
from reach_mesh.errors import NoMatchError, ReachError
from reach_mesh.logs import get_logger
from reach_mesh.models import RouteRequest

if TYPE_CHECKING:
    from fastapi import FastAPI

    from reach_mesh.hub.http import HubHttp

__all__ = ["HubMcp"]

_log = get_logger(__name__)
#: How often the menu is compared when no registry event woke the watcher.
_MENU_POLL: Final = 1.0


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
                await asyncio.wait_for(self._changed.wait(), _MENU_POLL)
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
        return types.ListToolsResult(
            tools=[
                types.Tool(
                    name=t["name"],
                    description=t["description"] or None,
                    input_schema=_object_schema(t["inputSchema"]),
                )
                for t in self.http.tool_menu(_namespace(ctx))
            ]
        )

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
    """``/mcp?namespace=ns`` narrows the menu to one tenant."""
    request = getattr(ctx, "request", None)
    query = getattr(request, "query_params", None)
    ns = None if query is None else query.get("namespace")
    return None if ns is None else protocol.validate_namespace(ns)


def _tool_error(text: str) -> types.CallToolResult:
    return types.CallToolResult(content=[types.TextContent(text=text)], is_error=True)


def _object_schema(schema: dict[str, Any]) -> dict[str, Any]:
    """MCP wants ``type: object`` at the root of an input schema."""
    return schema if schema.get("type") == "object" else {"type": "object"}
