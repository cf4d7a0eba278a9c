"""Connecting to NATS and creating JetStream resources, with nats errors translated at the edge."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
from typing import Any

import nats
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext
from nats.js.api import KeyValueConfig, StorageType
from nats.js.errors import BucketNotFoundError
from nats.js.kv import KeyValue

from reach_mesh.config import MeshSettings
from reach_mesh.errors import MeshUnavailableError

__all__ = ["connect", "ensure_kv"]

log = logging.getLogger("reach_mesh.nats")


async def connect(
    url: str | None,
    *,
    name: str,
    settings: MeshSettings | None = None,
    timeout: float | None = None,
    **options: Any,
) -> NATS:
    """Connect to ``url`` (comma-separated list allowed) or raise ``MeshUnavailableError``.

    A dead URL makes nats-py retry for minutes; the connect is bounded by ``timeout``
    (default ``settings.connect_timeout``) and reconnection after a successful connect is
    unlimited (a hub or agent outlives a server restart or a cluster failover). Credentials
    and TLS come from ``settings`` (``nats_creds``, ``nats_token``, ``nats_nkey_seed`` with
    ``nats_inbox_prefix``, ``nats_tls_*``); a user and password may also be given in the URL.
    """
    if not url:
        raise MeshUnavailableError(
            "no NATS URL: pass --nats URL / set REACH_NATS_URL, or run `reach-mesh up`"
        )
    if timeout is None:
        timeout = settings.connect_timeout if settings is not None else 5.0
    servers = [u.strip() for u in url.split(",") if u.strip()]
    opts: dict[str, Any] = {
        "name": name,
        "servers": servers,
        "connect_timeout": min(timeout, 2.0),
        "max_reconnect_attempts": -1,
        "reconnect_time_wait": 0.25,
        "allow_reconnect": True,
        "pending_size": 64 * 1024 * 1024,
    }
    if settings is not None:
        opts.update(_auth_options(settings))
    opts.update(options)

    async def _on_error(err: Exception) -> None:
        # A permissions violation is the server refusing this identity a subject (secure mode,
        # docs/security.md); without a word here it would only show as a timeout. Other
        # asynchronous errors surface where they matter (reconnects, failed requests).
        if "permissions violation" in str(err).lower():
            log.warning("NATS refused %s: %s", name, err)

    opts.setdefault("error_cb", _on_error)
    nc = NATS()
    try:
        await asyncio.wait_for(_first_connect(nc, opts), timeout)
    except (TimeoutError, OSError, nats.errors.Error) as err:
        with contextlib.suppress(Exception):
            await nc.close()
        raise MeshUnavailableError(f"cannot connect to NATS at {url}: {err!r}") from err
    return nc


def _auth_options(settings: MeshSettings) -> dict[str, Any]:
    opts: dict[str, Any] = {}
    if settings.nats_creds:
        opts["user_credentials"] = settings.nats_creds
    if settings.nats_token:
        opts["token"] = settings.nats_token
    if settings.nats_nkey_seed:
        opts["nkeys_seed"] = settings.nats_nkey_seed
    if settings.nats_inbox_prefix:
        opts["inbox_prefix"] = settings.nats_inbox_prefix
    if settings.nats_tls_ca or settings.nats_tls_cert:
        ctx = ssl.create_default_context(cafile=settings.nats_tls_ca)
        if settings.nats_tls_cert:
            ctx.load_cert_chain(settings.nats_tls_cert, settings.nats_tls_key)
        opts["tls"] = ctx
    return opts


async def _first_connect(nc: NATS, opts: dict[str, Any]) -> None:
    # During the first connect nats-py only retries when reconnects are allowed; keep them on
    # and let the outer wait_for bound the time.
    await nc.connect(**opts)


async def ensure_kv(
    js: JetStreamContext,
    bucket: str,
    *,
    replicas: int = 1,
    history: int = 1,
    ttl: float | None = None,
    description: str = "",
) -> KeyValue:
    """Bind to ``bucket``, creating it if it does not exist yet (idempotent across hubs)."""
    try:
        return await js.key_value(bucket)
    except BucketNotFoundError:
        pass
    cfg = KeyValueConfig(
        bucket=bucket,
        description=description,
        history=history,
        ttl=ttl,
        replicas=replicas,
        storage=StorageType.FILE,
        # Reads by key then name the key in the API subject ($JS.API.DIRECT.GET.<stream>.<key>),
        # where NATS permissions can limit an identity to its own keys (docs/security.md).
        direct=True,
    )
    try:
        return await js.create_key_value(cfg)
    except nats.js.errors.BadRequestError:
        # Another hub created it first with the same config (or a compatible one).
        return await js.key_value(bucket)
