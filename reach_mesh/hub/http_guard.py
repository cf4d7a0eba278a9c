"""What the hub's HTTP API refuses before any handler runs: the browser-facing checks.

One small layer, separate from the HTTP server and the routes: it reads a request's method, path
and (lower-case) headers and answers either ``None`` (go on) or a :class:`Refusal` (status,
typed error, headers). ``reach_mesh.hub.http`` applies it to every route; a different server
(Starlette, say) would call the same :meth:`HttpGuard.check` from its middleware.

The checks, in order (docs/security.md, "HTTP surface"):

- **Host** — every request: the ``Host`` header must name this hub (a loopback name, the bound
  address, or ``http_allowed_hosts``). A page on a DNS-rebinding domain that resolves to
  127.0.0.1 sends its own name and is refused: 403 ``REACH_FORBIDDEN_HOST``.
- **Origin** — state-changing methods and every ``/mcp`` request: an ``Origin`` header, when
  present, must be the hub's own origin (same scheme-less host and port as ``Host``) or one of
  ``http_allowed_origins``; ``Origin: null`` never passes. No ``Origin``: not a browser, allowed.
  403 ``REACH_FORBIDDEN_ORIGIN``.
- **Content type** — every POST must say ``Content-Type: application/json``: a page can send
  ``text/plain`` or a form anywhere without asking, but ``application/json`` across origins needs
  a CORS preflight, which the hub never grants. 415 ``REACH_UNSUPPORTED_MEDIA_TYPE``.
- **Bearer token** — guarded routes, when ``http_token`` is set: ``Authorization: Bearer <token>``,
  the scheme in any case (RFC 9110 §11.1), compared in constant time. 401 ``REACH_UNAUTHORIZED``.
  A hub with a NATS identity (secure mode) and no token keeps its guarded routes closed: they
  would act with the hub's rights for any local process. 401 ``REACH_UNAUTHORIZED`` too.
- **Body size** — every request that passed the checks above: a ``Content-Length`` over
  ``max_body`` (the hub's ``max_payload`` and 64 KiB for a request's own fields: the most any
  route takes) is refused before any route reads the body. A chunked body, which declares no
  length, is read by the server's middleware up to ``max_body`` (:meth:`HttpGuard.too_large`
  once it passes) before any route runs. The middleware reads and drops the rest of a refused
  body, within bounds, before it answers: a client still sending reads the answer, not a
  reset connection. 413 ``REACH_PAYLOAD_TOO_LARGE``.
"""

from __future__ import annotations

import functools
import hmac
import ipaddress
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Final
from urllib.parse import urlsplit

from reach_mesh.errors import (
    ForbiddenHostError,
    ForbiddenOriginError,
    PayloadTooLargeError,
    ReachError,
    UnauthorizedError,
    UnsupportedMediaTypeError,
)

__all__ = ["HttpGuard", "Refusal"]

#: Methods that change state; a browser sends them cross-origin only with an Origin header.
_UNSAFE: Final = frozenset({"POST", "PUT", "PATCH", "DELETE"})
_LOOPBACK_NAMES: Final = frozenset({"localhost", "127.0.0.1", "::1"})
_WILDCARD_BINDS: Final = frozenset({"", "0.0.0.0", "::"})
_JSON: Final = "application/json"
_WWW_AUTHENTICATE: Final = {"WWW-Authenticate": 'Bearer realm="reach-mesh"'}


@dataclass(frozen=True, slots=True)
class Refusal:
    """Why a request is refused: the HTTP status, the typed error for the body, and headers."""

    status: int
    error: ReachError
    headers: Mapping[str, str] = field(default_factory=dict)


class HttpGuard:
    """The checks for one hub's HTTP API (see the module docstring).

    ``bind_host`` is the address the server listens on; ``allowed_hosts`` extra ``Host`` names
    (``"*"``: any); ``allowed_origins`` extra ``scheme://host[:port]`` origins; ``token`` the
    bearer token of guarded routes (``None``: no token wanted, unless ``closed``: then guarded
    routes are refused to everyone); ``max_body`` the most bytes of a request body (``None``:
    no bound).
    """

    def __init__(
        self,
        *,
        bind_host: str,
        allowed_hosts: Iterable[str] = (),
        allowed_origins: Iterable[str] = (),
        token: str | None = None,
        closed: bool = False,
        max_body: int | None = None,
    ) -> None:
        hosts = {_host_name(h) for h in allowed_hosts}
        self._any_host = "*" in hosts
        hosts |= _LOOPBACK_NAMES
        if bind_host not in _WILDCARD_BINDS:
            hosts.add(_host_name(bind_host))
        self._hosts = frozenset(hosts)
        self._origins = frozenset(o.rstrip("/").lower() for o in allowed_origins)
        self._token = token.encode() if token is not None else None
        self._closed = closed and token is None
        self.max_body = max_body

    @property
    def closed(self) -> bool:
        """Guarded routes refuse everyone: a NATS identity and no token (secure mode)."""
        return self._closed

    def check(
        self, method: str, path: str, headers: Mapping[str, str], *, auth: bool
    ) -> Refusal | None:
        """``None`` when the request may go on to its handler, else the refusal to answer.
        ``auth``: the route wants the bearer token (when one is configured)."""
        host = headers.get("host", "")
        if not self._any_host and _host_name(_strip_port(host)) not in self._hosts:
            return Refusal(
                403,
                ForbiddenHostError(
                    f"Host {host!r} is not this hub's: add it to http_allowed_hosts "
                    "(REACH_HTTP_ALLOWED_HOSTS) if clients reach the hub by that name",
                    host=host,
                ),
            )
        origin = headers.get("origin")
        if (
            origin is not None
            and (method in _UNSAFE or path == "/mcp")
            and not self._origin_allowed(origin, host)
        ):
            return Refusal(
                403,
                ForbiddenOriginError(
                    f"cross-origin request from {origin!r} refused: only the hub's own origin "
                    "and http_allowed_origins (REACH_HTTP_ALLOWED_ORIGINS) may change state",
                    origin=origin,
                ),
            )
        if method == "POST" and _media_type(headers.get("content-type", "")) != _JSON:
            return Refusal(
                415,
                UnsupportedMediaTypeError(
                    f"POST wants 'Content-Type: {_JSON}', got "
                    f"{headers.get('content-type') or 'none'}",
                    expected=_JSON,
                ),
            )
        if auth and self._closed:
            return Refusal(
                401,
                UnauthorizedError(
                    "this hub runs with a NATS identity (secure mode): its HTTP API is closed "
                    "until it has a bearer token, http_token (REACH_HTTP_TOKEN)"
                ),
                _WWW_AUTHENTICATE,
            )
        if auth and self._token is not None and not self._authorized(headers):
            return Refusal(
                401,
                UnauthorizedError(
                    "this hub's HTTP API wants 'Authorization: Bearer <token>' (REACH_HTTP_TOKEN)"
                ),
                _WWW_AUTHENTICATE,
            )
        declared = headers.get("content-length")
        if self.max_body is not None and declared is not None:
            size = _length(declared)
            if size is None or size > self.max_body:
                return self.too_large(size, declared=True)
        return None

    def too_large(self, size: int | None, *, declared: bool = False) -> Refusal:
        """The refusal of a body of ``size`` bytes (or more, when not ``declared``: a chunked
        body read up to there; None: a ``Content-Length`` that is no length)."""
        assert self.max_body is not None
        said = "no length" if size is None else f"{size}{'' if declared else '+'} bytes"
        return Refusal(
            413,
            PayloadTooLargeError(
                f"request body of {said} is over this hub's limit of {self.max_body} bytes "
                "(max_payload and 64 KiB for the request's own fields)",
                size=size,
                max_size=self.max_body,
            ),
        )

    def _origin_allowed(self, origin: str, host: str) -> bool:
        origin = origin.strip().lower()
        if origin in self._origins:
            return True
        try:
            parts = urlsplit(origin)
        except ValueError:
            return False
        # Same origin: the page was loaded from this very host and port (http, or https when a
        # TLS proxy fronts the hub). "null" (a sandboxed frame, a file: page) has no netloc.
        return (
            parts.scheme in ("http", "https")
            and bool(parts.netloc)
            and parts.netloc == host.strip().lower()
            and not parts.path
        )

    def _authorized(self, headers: Mapping[str, str]) -> bool:
        assert self._token is not None
        scheme, _, credentials = headers.get("authorization", "").strip().partition(" ")
        if scheme.lower() != "bearer":
            return False
        return hmac.compare_digest(credentials.strip().encode(), self._token)


def _strip_port(host: str) -> str:
    """``"[::1]:80"`` → ``"[::1]"``, ``"example.com:80"`` → ``"example.com"``."""
    host = host.strip()
    if host.startswith("["):
        return host.partition("]")[0] + "]"
    name, sep, port = host.rpartition(":")
    return name if sep and port.isdigit() else host


@functools.lru_cache(maxsize=256)
def _host_name(host: str) -> str:
    """A host name or address in one canonical spelling: lower case, no brackets, no trailing
    dot, IP addresses normalised (``::0001`` is ``::1``). Cached (bounded): every request's
    ``Host`` header comes here, and parsing it as an address costs more than the rest of the
    checks together."""
    name = host.strip().lower().removeprefix("[").removesuffix("]").rstrip(".")
    try:
        return str(ipaddress.ip_address(name))
    except ValueError:
        return name


def _media_type(content_type: str) -> str:
    return content_type.partition(";")[0].strip().lower()


def _length(value: str) -> int | None:
    """A ``Content-Length`` as a number of bytes (None: not one)."""
    value = value.strip()
    return int(value) if value.isdigit() and value.isascii() else None
