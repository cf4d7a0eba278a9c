"""A tiny HTTP/1.1 server on ``asyncio.start_server`` for ``/metrics``, the REST API and the
dashboard.

Deliberately small: one request per connection (``Connection: close``), ``Content-Length``
bodies only, exact paths with ``{name}`` segments. It runs on the caller's event loop — no
threads (prometheus-client's own server is threaded) and no extra dependency.

Hostile or broken input gets a 4xx answer and the connection closed; nothing a client sends can
stop the server or leak an exception into the loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any, Final
from urllib.parse import parse_qs, unquote

from reach_mesh.logs import get_logger

__all__ = ["Handler", "HttpError", "HttpRequest", "HttpResponse", "HttpServer"]

_log = get_logger(__name__)

_TOKEN_RE: Final = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_VERSION_RE: Final = re.compile(r"HTTP/(\d)\.(\d)")
_TEXT: Final = "text/plain; charset=utf-8"
_JSON: Final = "application/json"
_MAX_QUERY_FIELDS: Final = 1000
# After refusing a request whose body we never read, keep reading (and discarding) for a moment
# before closing: closing a socket with unread input sends a RST, which can destroy the error
# response before the client has read it.
_LINGER_TIMEOUT: Final = 1.0
_LINGER_BYTES: Final = 1 << 20


class HttpError(Exception):
    """Raised by a handler (or the parser) to answer with ``status`` and a short text body."""

    def __init__(self, status: int, message: str | None = None) -> None:
        self.status = status
        self.message = message if message is not None else _reason(status)
        super().__init__(f"{status} {self.message}")


@dataclass(frozen=True, slots=True)
class HttpRequest:
    """One parsed request. Header names are lower-case; ``path`` is percent-decoded."""

    method: str
    path: str
    query: Mapping[str, list[str]] = field(default_factory=dict)
    headers: Mapping[str, str] = field(default_factory=dict)
    body: bytes = b""
    path_params: Mapping[str, str] = field(default_factory=dict)
    client: str | None = None

    def query_value(self, name: str, default: str | None = None) -> str | None:
        """The first value of query parameter ``name``, or ``default``."""
        values = self.query.get(name)
        return values[0] if values else default

    def json(self) -> Any:
        """The body parsed as JSON; a malformed body raises ``HttpError(400)``."""
        try:
            return json.loads(self.body)
        except (ValueError, UnicodeDecodeError) as err:
            raise HttpError(400, f"request body is not valid JSON: {err}") from err


@dataclass(frozen=True, slots=True)
class HttpResponse:
    """What a handler returns."""

    status: int = 200
    body: bytes = b""
    content_type: str = _TEXT
    headers: Mapping[str, str] = field(default_factory=dict)

    @classmethod
    def json(
        cls, data: Any, status: int = 200, headers: Mapping[str, str] | None = None
    ) -> HttpResponse:
        """A JSON response (compact UTF-8) of ``data``, which must be JSON-serialisable."""
        body = json.dumps(data, ensure_ascii=False, separators=(",", ":")).encode()
        return cls(status, body, _JSON, headers or {})

    @classmethod
    def text(
        cls,
        text: str,
        status: int = 200,
        content_type: str = _TEXT,
        headers: Mapping[str, str] | None = None,
    ) -> HttpResponse:
        """A text response (UTF-8); pass ``content_type`` for HTML and the like."""
        return cls(status, text.encode(), content_type, headers or {})


Handler = Callable[[HttpRequest], Awaitable[HttpResponse]]
"""An async function from request to response."""


@dataclass(frozen=True, slots=True)
class _Route:
    method: str
    segments: tuple[str, ...]  # "{name}" captures one path segment
    handler: Handler


class HttpServer:
    """A small router plus server: register routes, then ``await start(host, port)``.

    Example::

        server = HttpServer()
        server.route("GET", "/metrics", metrics_handler)
        server.route("GET", "/v1/agents/{agent_id}", agent_handler)
        await server.start("127.0.0.1", 0)
        ...
        await server.close()
    """

    def __init__(
        self,
        *,
        max_body_size: int = 1 << 20,
        max_header_size: int = 32 << 10,
        read_timeout: float = 10.0,
    ) -> None:
        """Limits: bodies over ``max_body_size`` get 413, request heads over
        ``max_header_size`` get 431, a client slower than ``read_timeout`` gets 408."""
        self._max_body_size = max_body_size
        self._max_header_size = max_header_size
        self._read_timeout = read_timeout
        self._exact: dict[tuple[str, str], Handler] = {}
        self._patterns: list[_Route] = []
        self._paths: set[str] = set()
        self._server: asyncio.Server | None = None
        self._connections: set[asyncio.Task[Any]] = set()

    def route(self, method: str, path: str, handler: Handler) -> None:
        """Serve ``method path`` with ``handler``; ``{name}`` segments land in ``path_params``.

        A GET route also answers HEAD. Registering the same method and path twice raises.
        """
        method = method.upper()
        if not path.startswith("/"):
            raise ValueError(f"route path must start with '/': {path!r}")
        segments = tuple(path.split("/")[1:])
        if any(s.startswith("{") and s.endswith("}") for s in segments):
            if any(r.method == method and r.segments == segments for r in self._patterns):
                raise ValueError(f"route already registered: {method} {path}")
            self._patterns.append(_Route(method, segments, handler))
        else:
            if (method, path) in self._exact:
                raise ValueError(f"route already registered: {method} {path}")
            self._exact[(method, path)] = handler
        self._paths.add(path)

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> asyncio.Server:
        """Listen on ``host:port`` (``0``: a free port, see :attr:`port`)."""
        if self._server is not None:
            raise RuntimeError("HttpServer already started")
        self._server = await asyncio.start_server(
            self._on_connection, host, port, limit=self._max_header_size
        )
        return self._server

    @property
    def port(self) -> int:
        """The port of the first listening socket."""
        if self._server is None or not self._server.sockets:
            raise RuntimeError("HttpServer is not listening")
        return int(self._server.sockets[0].getsockname()[1])

    async def close(self) -> None:
        """Stop listening and cut open connections. Idempotent."""
        server, self._server = self._server, None
        if server is None:
            return
        server.close()
        # Python 3.11's wait_closed() does not wait for (or cancel) connection handlers.
        for task in list(self._connections):
            task.cancel()
        await asyncio.gather(*self._connections, return_exceptions=True)
        await server.wait_closed()

    async def _on_connection(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._connections.add(task)
        try:
            await self._serve_one(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass  # the client went away; nothing to answer
        except Exception:
            # Last line of defence: a bug here must cost one connection, never the server.
            _log.exception("http connection failed")
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()
            if task is not None:
                self._connections.discard(task)

    async def _serve_one(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peername")
        client = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) and len(peer) >= 2 else None
        body_unread = True
        head_only = False
        try:
            async with asyncio.timeout(self._read_timeout):
                request, raw_path = await self._read_request(reader, writer, client)
            body_unread = False
        except HttpError as err:
            response = _error_response(err)
        except TimeoutError:
            response = _error_response(HttpError(408))
        except asyncio.LimitOverrunError:
            response = _error_response(HttpError(431))
        except asyncio.IncompleteReadError as err:
            if not err.partial:
                return  # connected and closed without a byte: a health probe, say
            response = _error_response(HttpError(400, "incomplete request"))
        else:
            head_only = request.method == "HEAD"
            response = await self._dispatch(request, raw_path)
        await self._write(writer, response, head_only=head_only)
        if body_unread:
            await _linger(reader, writer)

    async def _read_request(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, client: str | None
    ) -> tuple[HttpRequest, str]:
        """The request and its raw (still percent-encoded) path."""
        raw = await reader.readuntil(b"\r\n\r\n")
        # latin-1 maps every byte, so decoding never fails; the grammar checks do the rejecting.
        lines = raw[:-4].decode("latin-1").split("\r\n")
        parts = lines[0].split(" ")
        if len(parts) != 3 or not _TOKEN_RE.fullmatch(parts[0]):
            raise HttpError(400, "malformed request line")
        method, target, version = parts
        version_match = _VERSION_RE.fullmatch(version)
        if version_match is None:
            raise HttpError(400, "malformed HTTP version")
        if version_match.group(1) != "1":
            raise HttpError(505)
        if not target.startswith("/"):
            raise HttpError(400, "request target must be a path")
        headers = _parse_headers(lines[1:])
        if "transfer-encoding" in headers:
            raise HttpError(501, "chunked request bodies are not supported")
        length = _content_length(headers)
        if length > self._max_body_size:
            raise HttpError(413, f"request body larger than {self._max_body_size} bytes")
        if length and headers.get("expect", "").lower() == "100-continue":
            writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            await writer.drain()
        body = await reader.readexactly(length) if length else b""
        raw_path, _, raw_query = target.partition("?")
        raw_path = raw_path.partition("#")[0]
        try:
            query = (
                parse_qs(
                    raw_query,
                    keep_blank_values=True,
                    max_num_fields=_MAX_QUERY_FIELDS,
                    errors="strict",
                )
                if raw_query
                else {}
            )
            path = unquote(raw_path, errors="strict")
        except (ValueError, UnicodeDecodeError) as err:
            raise HttpError(400, f"malformed request target: {err}") from err
        return HttpRequest(method, path, query, headers, body, {}, client), raw_path

    async def _dispatch(self, request: HttpRequest, raw_path: str) -> HttpResponse:
        handler, params, allowed = self._match(request, raw_path)
        if handler is None:
            if allowed:
                return _error_response(
                    HttpError(405), headers={"Allow": ", ".join(sorted(allowed))}
                )
            return _error_response(HttpError(404))
        if params:
            request = HttpRequest(
                request.method,
                request.path,
                request.query,
                request.headers,
                request.body,
                params,
                request.client,
            )
        try:
            response = await handler(request)
        except HttpError as err:
            return _error_response(err)
        except Exception:
            _log.exception("http handler failed", extra={"method": request.method})
            return _error_response(HttpError(500))
        if not isinstance(response, HttpResponse):
            _log.error("http handler returned %r, not an HttpResponse", type(response))
            return _error_response(HttpError(500))
        return response

    def _match(
        self, request: HttpRequest, raw_path: str
    ) -> tuple[Handler | None, dict[str, str], set[str]]:
        methods = (request.method, "GET") if request.method == "HEAD" else (request.method,)
        for method in methods:
            handler = self._exact.get((method, request.path))
            if handler is not None:
                return handler, {}, set()
        allowed = {m for (m, p) in self._exact if p == request.path}
        # Split before decoding, so an encoded "/" (%2F) stays inside its segment.
        segments = raw_path.split("/")[1:]
        for route in self._patterns:
            params = _match_segments(route.segments, segments)
            if params is None:
                continue
            if route.method in methods:
                return route.handler, params, set()
            allowed.add(route.method)
        return None, {}, allowed

    async def _write(
        self, writer: asyncio.StreamWriter, response: HttpResponse, *, head_only: bool
    ) -> None:
        items = response.headers.items()
        if any("\r" in text or "\n" in text for item in items for text in item):
            # A CR/LF inside a header would let a handler (or data it echoes) split the response.
            _log.error("http handler returned a header with a line break")
            response, items = _error_response(HttpError(500)), {}.items()
        extra = "".join(f"{name}: {value}\r\n" for name, value in items)
        head = (
            f"HTTP/1.1 {response.status} {_reason(response.status)}\r\n"
            f"Content-Type: {response.content_type}\r\n"
            f"Content-Length: {len(response.body)}\r\n"
            "Connection: close\r\n"
            f"{extra}\r\n"
        )
        writer.write(head.encode("latin-1", errors="replace"))
        if not head_only:
            writer.write(response.body)
        await writer.drain()


def _parse_headers(lines: list[str]) -> dict[str, str]:
    headers: dict[str, str] = {}
    for line in lines:
        name, sep, value = line.partition(":")
        # No whitespace before the colon, no obsolete line folding (RFC 9112 §5).
        if not sep or not _TOKEN_RE.fullmatch(name):
            raise HttpError(400, "malformed header line")
        key = name.lower()
        value = value.strip(" \t")
        headers[key] = f"{headers[key]}, {value}" if key in headers else value
    return headers


def _content_length(headers: Mapping[str, str]) -> int:
    raw = headers.get("content-length")
    if raw is None:
        return 0
    # Repeated identical values are allowed (RFC 9110 §8.6); anything else is a smuggling risk.
    values = {v.strip() for v in raw.split(",")}
    if len(values) != 1:
        raise HttpError(400, "conflicting Content-Length")
    value = values.pop()
    if not value.isascii() or not value.isdigit():
        raise HttpError(400, "malformed Content-Length")
    return int(value)


def _match_segments(pattern: tuple[str, ...], segments: list[str]) -> dict[str, str] | None:
    if len(pattern) != len(segments):
        return None
    params: dict[str, str] = {}
    for expected, actual in zip(pattern, segments, strict=True):
        if expected.startswith("{") and expected.endswith("}"):
            if not actual:
                return None
            params[expected[1:-1]] = unquote(actual)
        elif expected != actual:
            return None
    return params


def _reason(status: int) -> str:
    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return "Unknown"


def _error_response(err: HttpError, headers: Mapping[str, str] | None = None) -> HttpResponse:
    return HttpResponse.text(f"{err.status} {err.message}\n", err.status, headers=headers)


async def _linger(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    with contextlib.suppress(Exception):
        if writer.can_write_eof():
            writer.write_eof()
        discarded = 0
        async with asyncio.timeout(_LINGER_TIMEOUT):
            while discarded < _LINGER_BYTES:
                chunk = await reader.read(65536)
                if not chunk:
                    break
                discarded += len(chunk)
