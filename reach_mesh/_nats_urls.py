"""NATS URLs as reach-mesh reads them: a comma-separated list of servers, the scheme optional
(``nats://`` when not given) — checked before a connect (:func:`check_url`), printed without
credentials (:func:`shown`), and read for what they say of the identity a process connects as;
and the servers asked whether they answer at all (:func:`diagnose`, :func:`answering`).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from typing import Any, Final
from urllib.parse import SplitResult, urlsplit

from nats.aio.client import Client as NATS

from reach_mesh.config import MeshSettings
from reach_mesh.errors import BadRequestError

__all__ = [
    "answering",
    "beside",
    "check_url",
    "diagnose",
    "has_credentials",
    "has_identity",
    "hosts",
    "servers",
    "shown",
]

_SCHEMES: Final = ("nats", "tls", "ws", "wss")


def servers(url: str | None) -> list[str]:
    """The servers of a NATS URL list, each as given."""
    return [u.strip() for u in (url or "").split(",") if u.strip()]


def beside(nc: NATS, url: str | None) -> dict[str, Any]:
    """``connect`` options for a connection to the server ``nc`` is connected to, first of
    ``url``'s (the others after it, in order, for its reconnections): one process's connections
    on one server. Spread over the cluster by chance, a hub's were on both sides of a partition
    between servers — route requests taken on one side, answers and agents on the other, each
    route's answer lost. Nothing when that server is not one of ``url``'s (one the cluster
    told of): the connection picks as usual."""
    at = nc.connected_url
    listed = servers(url)
    if at is None or len(listed) < 2:
        return {}
    here = [s for s in listed if (_split(s).hostname, _split(s).port) == (at.hostname, at.port)]
    if not here:
        return {}
    return {"servers": here + [s for s in listed if s not in here], "dont_randomize": True}


def _split(server: str) -> SplitResult:
    """One server's URL as nats-py reads it: ``nats://`` when no scheme is given."""
    return urlsplit(server if "://" in server else f"nats://{server}")


def has_credentials(url: str | None) -> bool:
    """Whether a NATS URL (comma-separated list allowed, scheme optional) carries a user or a
    password."""
    return any(p.username or p.password for p in map(_split, servers(url)))


def hosts(url: str | None) -> list[str]:
    """The host of each server of a NATS URL (comma-separated list allowed, scheme
    optional)."""
    return [_split(server).hostname or "" for server in servers(url)]


def has_identity(settings: MeshSettings) -> bool:
    """Whether a process connects to NATS as someone (nkey, creds, token, a client
    certificate, or a user and password in the URL): secure mode, where tenants are kept apart
    (a hub's HTTP API is closed without its token, answers name no other namespace)."""
    named = (settings.nats_nkey_seed, settings.nats_creds, settings.nats_token)
    return any(named) or settings.nats_tls_cert is not None or has_credentials(settings.nats_url)


def shown(url: str | None) -> str:
    """A NATS URL as it may be printed: every server's user and password left out."""
    out = []
    for server in servers(url):
        parts = _split(server)
        if parts.username is None and parts.password is None:
            out.append(server)
            continue
        host = parts.netloc.rpartition("@")[2]
        scheme = f"{parts.scheme}://" if "://" in server else ""
        out.append(f"{scheme}{host}{parts.path}")
    return ",".join(out)


def check_url(server: str) -> None:
    """A server's URL as nats-py can use it (a scheme it speaks, a port in range), else
    ``BadRequestError`` at once, not a connect that fails for it."""
    parts = _split(server)
    if parts.scheme not in _SCHEMES:
        raise BadRequestError(
            f"{server!r} is not a NATS URL: use nats://host:4222 "
            f"(schemes {', '.join(s + '://' for s in _SCHEMES)})"
        )
    try:
        parts.port  # noqa: B018 (urlsplit checks it when read)
    except ValueError:
        raise BadRequestError(
            f"{server!r} is not a NATS URL: its port is not a number in 0-65535"
        ) from None


_REFUSED: Final = "connection refused"
#: What to do when nothing listens where the URL points: the usual first-hour mistake.
_NO_SERVER_HINT: Final = (
    "is nats-server running? `reach-mesh up` starts one on 4222; else point --nats or "
    "$REACH_NATS_URL at yours"
)


async def diagnose(servers: list[str], err: BaseException) -> str:
    """Why the first connect failed, in words: unknown host, refused port, or what nats said."""
    loop = asyncio.get_running_loop()
    causes: list[str] = []
    for server in servers:
        parts = urlsplit(server if "://" in server else f"nats://{server}")
        host, port = parts.hostname or "127.0.0.1", parts.port or 4222
        try:
            async with asyncio.timeout(1.0):
                await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except (OSError, TimeoutError):
            causes.append(f"unknown host {host!r}")
            continue
        try:
            async with asyncio.timeout(1.0):
                reader, writer = await asyncio.open_connection(host, port)
        except ConnectionRefusedError:
            causes.append(f"{_REFUSED}: nothing listens on {host}:{port}")
            continue
        except (OSError, TimeoutError):
            causes.append(f"no answer from {host}:{port}")
            continue
        try:
            if parts.scheme in ("nats", "tls"):  # (a websocket port greets no one)
                greeting = await _greeting(reader)
                if not greeting.startswith(b"INFO"):
                    causes.append(_not_nats(host, port, greeting))
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()
    if not causes:
        # The port answers: the NATS handshake failed (TLS, authorization, not a NATS server).
        return str(err) or repr(err)
    said = "; ".join(dict.fromkeys(causes))
    if any(cause.startswith(_REFUSED) for cause in causes):
        said += f" ({_NO_SERVER_HINT})"
    return said


async def _greeting(reader: asyncio.StreamReader) -> bytes:
    """The first bytes a server sends on a new connection within a second (a NATS server's
    ``INFO {...}`` comes at once), or nothing."""
    try:
        async with asyncio.timeout(1.0):
            return await reader.read(16)
    except (OSError, TimeoutError):
        return b""


def _not_nats(host: str, port: int, greeting: bytes) -> str:
    """A port that takes connections but does not greet as a NATS server: the usual cause is
    the hub's HTTP port (the dashboard's URL) given as the NATS one."""
    said = f"it sent {greeting[:12]!r}" if greeting else "it sent nothing in 1s"
    return (
        f"{host}:{port} takes connections but is not a NATS server, or one too busy to answer "
        f"({said}; a NATS server greets with INFO at once): is it the hub's HTTP port? The "
        "NATS URL is the one `reach-mesh up` prints after `export REACH_NATS_URL=`"
    )


async def answering(servers: list[str]) -> bool:
    """Whether any of ``servers`` takes a TCP connection within a second (busy, not gone)."""
    for server in servers:
        parts = urlsplit(server if "://" in server else f"nats://{server}")
        try:
            async with asyncio.timeout(1.0):
                _, writer = await asyncio.open_connection(
                    parts.hostname or "127.0.0.1", parts.port or 4222
                )
        except (OSError, TimeoutError):
            continue
        writer.close()
        with contextlib.suppress(Exception):
            await writer.wait_closed()
        return True
    return False
