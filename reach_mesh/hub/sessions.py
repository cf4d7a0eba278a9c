"""Sticky sessions: ``session_id`` → the agent that last succeeded for it, in JetStream KV.

The bucket has a max age (``sticky_ttl``), so an idle session is forgotten by the server. Each hub
keeps a small read-through cache with a short validity so that a session's requests don't pay a KV
round trip each, while a success recorded by another hub is seen within ``_CACHE_VALIDITY``.
"""

from __future__ import annotations

import contextlib
import hashlib
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Final

from nats.aio.client import Client as NATS
from nats.js import JetStreamContext
from nats.js.kv import KeyValue

from reach_mesh import protocol
from reach_mesh._jspub import JsClient
from reach_mesh._nats import ensure_kv

__all__ = ["SessionStore"]

_CACHE_SIZE: Final = 50_000
_CACHE_VALIDITY: Final = 1.0


class SessionStore:
    def __init__(
        self,
        nc: NATS,
        js: JetStreamContext,
        *,
        ttl: float,
        replicas: int = 1,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._nc = nc
        self._js = js
        self._ttl = ttl
        self._replicas = replicas
        self._clock = clock
        self._kv: KeyValue | None = None
        #: Reads: direct gets asked again when a replica does not answer soon (a frozen
        #: node's), not nats-py's, which wait out their whole timeout.
        self._reads: JsClient | None = None
        self._cache: OrderedDict[str, tuple[str | None, float]] = OrderedDict()

    async def ensure_bucket(self) -> None:
        """Create the sessions bucket unless it exists (at start, and when found gone)."""
        self._kv = await ensure_kv(
            self._js,
            protocol.KV_SESSIONS,
            replicas=self._replicas,
            ttl=self._ttl,
            description="reach-mesh sticky sessions",
        )

    async def start(self) -> None:
        await self.ensure_bucket()
        self._reads = JsClient(self._nc)
        await self._reads.start()

    @staticmethod
    def key(namespace: str, session_id: str) -> str:
        # Session ids are caller text; hash them into a valid, fixed-size KV key.
        digest = hashlib.blake2b(session_id.encode(), digest_size=16).hexdigest()
        return f"{namespace}.{digest}"

    async def get(self, namespace: str, session_id: str) -> str | None:
        key = self.key(namespace, session_id)
        now = self._clock()
        hit = self._cache.get(key)
        if hit is not None and now - hit[1] < _CACHE_VALIDITY:
            return hit[0]
        agent_id: str | None = None
        if self._reads is not None:
            with contextlib.suppress(Exception):
                got = await self._reads.kv_get(protocol.KV_SESSIONS, key)
                agent_id = got[0].decode() if got is not None else None
        self._remember(key, agent_id, now)
        return agent_id

    async def put(self, namespace: str, session_id: str, agent_id: str) -> None:
        key = self.key(namespace, session_id)
        hit = self._cache.get(key)
        now = self._clock()
        self._remember(key, agent_id, now)
        if hit is not None and hit[0] == agent_id and now - hit[1] < self._ttl / 4:
            return  # unchanged and recently written: don't rewrite on every success
        if self._kv is not None:
            with contextlib.suppress(Exception):
                await self._kv.put(key, agent_id.encode())

    def _remember(self, key: str, agent_id: str | None, now: float) -> None:
        self._cache[key] = (agent_id, now)
        self._cache.move_to_end(key)
        while len(self._cache) > _CACHE_SIZE:
            self._cache.popitem(last=False)
