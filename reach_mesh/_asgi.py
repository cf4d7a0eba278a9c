"""Serve an ASGI application with uvicorn on the caller's event loop.

``uvicorn.Server.serve()`` runs as one task of the running loop: no thread, no second loop, and
no signal handlers (the library installs none; the process entry point does). Used by the hub
(REST, OpenAPI, MCP, dashboard) and by an agent's optional ``/metrics`` endpoint.

Each connection speaks HTTP/1.1 through :class:`_BoundedHeads`, uvicorn's httptools protocol with
the two bounds it lacks on a request's head (its request line and headers), which arrives before
any route, guard or token check: at most :data:`HEAD_MAX` bytes (431, typed) and
:data:`HEAD_TIMEOUT` seconds from a connection's opening, or from a head's first byte on a
kept-alive connection (408, typed; a connection that sent nothing is closed). Without them one
connection of anyone who could reach the port, token or not, sent 160 MB of small headers and
held the hub at 2.7 GB and its event loop up to 2.5 s late, and a connection that sent half a
head stayed open for good (slowloris) (docs/security.md, "HTTP surface").

A server also keeps at most :func:`connection_cap` connections open (:data:`CONNECTIONS_MAX`, or
half the process's file-descriptor limit if less): past it, a new connection closes the one that
has waited longest for a request's head (a legitimate client sends its head at once; a flood of
idle connections pushes out its own), or is itself closed when every connection is in a
request. Without it, 1,100 idle connections to a hub whose limit was 1,024 took every file
descriptor: every HTTP request timed out and the loop logged 35,913 ``accept`` tracebacks in
20 s. A request's body that goes :data:`BODY_IDLE_TIMEOUT` without a byte has its connection
closed (it held the connection and its route for good).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import weakref
from collections.abc import Callable, Generator
from typing import Any, Final

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
from uvicorn.server import ServerState

from reach_mesh.errors import (
    BadRequestError,
    MeshTimeoutError,
    PayloadTooLargeError,
    ReachError,
)

__all__ = ["CONNECTIONS_MAX", "HEAD_MAX", "HEAD_TIMEOUT", "AsgiServer", "connection_cap"]

_START_TIMEOUT: Final = 10.0
#: Bytes of one request's head (request line and headers) at most; nginx's largest default is
#: 32 KiB, and the hub's own requests take a few hundred bytes.
HEAD_MAX: Final = 64 * 1024
#: Seconds a request's head may take to arrive (from the connection's opening, for its first).
HEAD_TIMEOUT: Final = 10.0
#: Seconds a request's body may go without a byte arriving (reading not paused by the server)
#: before its connection is closed: the route reading it sees the client gone.
BODY_IDLE_TIMEOUT: Final = 30.0
#: Seconds between two sweeps of a server's connections for these two times.
_SWEEP_EVERY: Final = 1.0
#: Connections one server keeps open at most (:func:`connection_cap`).
CONNECTIONS_MAX: Final = 4096
#: Per server, its connections waiting for a request's head, longest-waiting first.
_WAITING: weakref.WeakKeyDictionary[ServerState, dict[_BoundedHeads, None]] = (
    weakref.WeakKeyDictionary()
)


def connection_cap() -> int:
    """:data:`CONNECTIONS_MAX`, or half the process's soft file-descriptor limit if less (the
    rest stays for NATS connections and files)."""
    cap = CONNECTIONS_MAX
    with contextlib.suppress(ImportError, OSError, ValueError):
        import resource  # not on Windows

        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        if soft != resource.RLIM_INFINITY:
            cap = min(cap, soft // 2)
    return max(cap, 16)


class _BoundedHeads(HttpToolsProtocol):
    """uvicorn's httptools protocol with a request head bounded in bytes and in time, a body
    that stops coming cut off, and connections capped (the module docstring). httptools keeps
    every header (and a header's partial value) it has read until the head ends, and uvicorn
    times only the wait between two requests of a kept-alive connection. The times are
    judged by :func:`_sweep`, once every :data:`_SWEEP_EVERY` per server, not by a timer per
    request: two timers a request cost the gateway's hot path about 5 µs."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._waiting = _WAITING.setdefault(self.server_state, {})
        if len(self.connections) > connection_cap():
            oldest = next(iter(self._waiting), None)
            if oldest is None:
                transport.close()  # every connection is in a request: this one goes
            else:
                del self._waiting[oldest]
                oldest.transport.close()
        self._waiting[self] = None
        #: Within a request's head (its first byte read, not yet its end).
        self._in_head = False
        #: A head began in the data being parsed: that chunk is not counted (bounded by the
        #: transport's read size; counted, the body after a pipelined head would be too).
        self._began = False
        self._head_bytes = 0
        #: Since when a head is awaited (None: none is, or uvicorn's keep-alive timer waits).
        self._head_since: float | None = self.loop.time()
        #: A request's body is still coming; when its last bytes came.
        self._in_body = False
        self._body_seen = 0.0

    def connection_lost(self, exc: Exception | None) -> None:
        self._waiting.pop(self, None)
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        self._began = False
        self._body_seen = self.loop.time()
        super().data_received(data)
        if self._in_head and not self._began and not self.transport.is_closing():
            self._head_bytes += len(data)
            if self._head_bytes > HEAD_MAX:
                self._refuse(
                    431,
                    PayloadTooLargeError(
                        f"request head (request line and headers) over {HEAD_MAX} bytes",
                        size=self._head_bytes,
                        max_size=HEAD_MAX,
                    ),
                )

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._in_head = self._began = True
        self._head_bytes = 0
        if self._head_since is None:
            self._head_since = self._body_seen  # this data's arrival
        self._in_body = False

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._head_since = None
        self._waiting.pop(self, None)
        super().on_headers_complete()
        self._in_body = True

    def on_message_complete(self) -> None:
        self._in_body = False
        super().on_message_complete()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self.timeout_keep_alive_task is not None:  # kept alive: waiting for the next head
            self._waiting[self] = None

    def send_400_response(self, msg: str) -> None:
        # What httptools cannot parse (no request line, a Content-Length that is no number,
        # both Content-Length and Transfer-Encoding): uvicorn answers it in plain text.
        self._refuse(400, BadRequestError(f"malformed HTTP request: {msg}"))

    def sweep(self, now: float) -> None:
        """Judge this connection's times (:func:`_sweep`)."""
        if self.transport.is_closing():
            return
        if self._head_since is not None and now - self._head_since > HEAD_TIMEOUT:
            self._head_since = None
            if not self._in_head:
                self.transport.close()  # nothing sent: nobody to answer, as uvicorn's keep-alive
                return
            self._refuse(
                408,
                MeshTimeoutError(
                    "request head (request line and headers) not received within "
                    f"{HEAD_TIMEOUT:g}s",
                    timeout_s=HEAD_TIMEOUT,
                ),
            )
        elif self._in_body and now - self._body_seen > BODY_IDLE_TIMEOUT:
            if self.flow.read_paused:  # the server is not reading it: not the client's doing
                self._body_seen = now
                return
            # A body that stopped coming (slow-body flood): the route waiting for it sees
            # the client gone.
            self._in_body = False
            self.transport.close()

    def _refuse(self, status: int, err: ReachError) -> None:
        """Answer ``err`` (typed JSON) and close: the rest of the request is never read."""
        self._in_head = False
        self._head_since = None
        body = json.dumps(err.to_wire(), separators=(",", ":")).encode()
        reason = {
            400: b"Bad Request",
            408: b"Request Timeout",
            431: b"Request Header Fields Too Large",
        }[status]
        self.transport.write(
            b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\nconnection: close\r\n\r\n%s" % (status, reason, len(body), body)
        )
        self.transport.close()


async def _sweep(state: ServerState) -> None:
    """Every :data:`_SWEEP_EVERY` seconds, each connection's head and body times are judged
    (:meth:`_BoundedHeads.sweep`): a timeout fires up to that much late."""
    loop = asyncio.get_running_loop()
    while True:
        await asyncio.sleep(_SWEEP_EVERY)
        now = loop.time()
        for connection in list(state.connections):
            if isinstance(connection, _BoundedHeads):
                connection.sweep(now)


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
            http=_BoundedHeads,
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
    sweeper = asyncio.get_running_loop().create_task(
        _sweep(server.server_state), name="reach-http-sweep"
    )
    try:
        await server.serve(sockets=[sock])
    except SystemExit as err:
        raise OSError(f"uvicorn exited with {err.code}") from None
    finally:
        sweeper.cancel()
