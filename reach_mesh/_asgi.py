"""Serve an ASGI application with uvicorn on the caller's event loop.

``uvicorn.Server.serve()`` runs as one task of the running loop: no thread, no second loop, and
no signal handlers (the library installs none; the process entry point does). Used by the hub
(REST, OpenAPI, MCP, dashboard) and by an agent's optional ``/metrics`` endpoint.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Callable, Generator
from typing import Any, Final

import uvicorn

__all__ = ["AsgiServer"]

_START_TIMEOUT: Final = 10.0


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        # The library installs no signal handlers: the embedding process owns them.
        yield


class AsgiServer:
    """One listening uvicorn server for ``app``; ``await start(host, port)``, ``await close()``.

    ``port=0`` picks a free port; :attr:`port` tells which."""

    def __init__(self, app: Callable[..., Any], *, limit_concurrency: int | None = None) -> None:
        self.app = app
        self._limit_concurrency = limit_concurrency
        self._server: _Server | None = None
        self._task: asyncio.Task[None] | None = None
        self.port = 0

    async def start(self, host: str, port: int) -> None:
        if self._server is not None:
            raise RuntimeError("AsgiServer already started")
        config = uvicorn.Config(
            self.app,
            host=host,
            port=port,
            loop="none",
            lifespan="on",
            log_config=None,
            access_log=False,
            server_header=False,
            limit_concurrency=self._limit_concurrency,
            timeout_graceful_shutdown=2,
        )
        # Bind here, so a busy port is this call's OSError (uvicorn would log and exit).
        sock = await _bind(host, port)
        server = self._server = _Server(config)
        self._task = asyncio.get_running_loop().create_task(_serve(server, sock), name="reach-http")
        self.port = sock.getsockname()[1]
        loop = asyncio.get_running_loop()
        deadline = loop.time() + _START_TIMEOUT
        while not server.started:
            if self._task.done():
                self._server = None
                exc = self._task.exception() if not self._task.cancelled() else None
                raise OSError(f"HTTP server did not start on {host}:{port}: {exc}") from exc
            if loop.time() > deadline:
                raise TimeoutError(f"HTTP server did not start on {host}:{port}")
            await asyncio.sleep(0.005)

    async def close(self) -> None:
        server, task = self._server, self._task
        self._server = self._task = None
        if server is None or task is None:
            return
        server.should_exit = True
        with contextlib.suppress(asyncio.CancelledError, OSError):
            await task


async def _bind(host: str, port: int) -> socket.socket:
    host = host or "0.0.0.0"
    infos = await asyncio.get_running_loop().getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )
    family, kind, proto, _, address = infos[0]
    # The protocol must be IPPROTO_TCP: asyncio sets TCP_NODELAY on accepted connections only
    # then, and without it a keep-alive response's second write waits ~40 ms for a delayed ACK.
    sock = socket.socket(family, kind, proto or socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(1024)
    except OSError:
        sock.close()
        raise
    sock.setblocking(False)
    return sock


async def _serve(server: _Server, sock: socket.socket) -> None:
    # uvicorn answers a failed startup with sys.exit(); a SystemExit escaping a task would
    # stop the whole event loop, so it becomes an OSError of this task.
    try:
        await server.serve(sockets=[sock])
    except SystemExit as err:
        raise OSError(f"uvicorn exited with {err.code}") from None
