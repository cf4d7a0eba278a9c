"""The audit log: routing decisions, registrations, state changes and operator actions, appended
to a JetStream stream with bounded retention.

Events are published with core NATS publish into the stream's subjects (no ack round trip on the
hot path); the stream stores them. ``reach-mesh audit`` reads them back filtered by request id,
agent id or trace id.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from typing import Any

from nats.aio.client import Client as NATS
from nats.js import JetStreamContext
from nats.js.api import DiscardPolicy, RetentionPolicy, StorageType, StreamConfig

from reach_mesh import protocol

__all__ = ["AuditLog"]

log = logging.getLogger("reach_mesh.hub.audit")


class AuditLog:
    def __init__(
        self,
        nc: NATS,
        js: JetStreamContext,
        hub_id: str,
        *,
        max_age: float,
        max_bytes: int,
        replicas: int = 1,
        enabled: bool = True,
    ) -> None:
        self._nc = nc
        self._js = js
        self._hub_id = hub_id
        self._max_age = max_age
        self._max_bytes = max_bytes
        self._replicas = replicas
        self.enabled = enabled

    async def start(self) -> None:
        if not self.enabled:
            return
        config = StreamConfig(
            name=protocol.STREAM_AUDIT,
            description="reach-mesh audit log",
            subjects=[protocol.audit_subject("*", "*")],
            retention=RetentionPolicy.LIMITS,
            discard=DiscardPolicy.OLD,
            max_age=self._max_age,
            max_bytes=self._max_bytes,
            storage=StorageType.FILE,
            num_replicas=self._replicas,
        )
        try:
            await self._js.add_stream(config)
        except Exception:
            with contextlib.suppress(Exception):
                await self._js.update_stream(config)

    async def record(self, namespace: str, kind: str, **fields: Any) -> None:
        """Append one event (fire-and-forget; an audit failure never fails a request)."""
        if not self.enabled:
            return
        event = {"ts": round(time.time(), 6), "kind": kind, "hub_id": self._hub_id}
        event.update({k: v for k, v in fields.items() if v is not None})
        try:
            await self._nc.publish(
                protocol.audit_subject(namespace, kind),
                json.dumps(event, separators=(",", ":"), default=str).encode(),
            )
        except Exception as err:  # pragma: no cover - connection gone
            log.debug("audit publish failed: %r", err)
