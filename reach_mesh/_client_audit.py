"""``Client.audit``: reading the audit stream (``REACH_AUDIT``) with filters."""

from __future__ import annotations

import collections
import contextlib
import datetime
import json
import time
from typing import Any

import nats.js.errors
from nats.aio.client import Client as NATS
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js.api import ConsumerConfig, DeliverPolicy

from reach_mesh import protocol
from reach_mesh._client_fields import _consumer_name
from reach_mesh._nats import not_permitted, refused_first, refused_since
from reach_mesh.errors import MeshTimeoutError, MeshUnavailableError

__all__ = ["read_audit"]


async def read_audit(
    nc: NATS,
    *,
    request_id: str | None,
    agent_id: str | None,
    trace_id: str | None,
    task_id: str | None,
    namespace: str | None,
    since: float,
    limit: int,
) -> list[dict[str, Any]]:
    """What :meth:`reach_mesh.Client.audit` returns, read on ``nc``."""
    js = nc.jetstream()
    start = datetime.datetime.now(datetime.UTC) - datetime.timedelta(seconds=since)
    subject = protocol.audit_subject(namespace or "*", "*")
    config = ConsumerConfig(
        name=_consumer_name(),
        deliver_policy=DeliverPolicy.BY_START_TIME,
        opt_start_time=start,
    )
    asked_at = time.monotonic()
    # A caller identity may not read the audit stream: say so at once, not as a timeout.
    info_subject = f"$JS.API.STREAM.INFO.{protocol.STREAM_AUDIT}"
    try:
        info = await refused_first(nc, info_subject, js.stream_info(protocol.STREAM_AUDIT))
    except nats.js.errors.NotFoundError as err:
        raise MeshUnavailableError(
            f"no audit stream ({protocol.STREAM_AUDIT}) on this NATS: no hub has run here, "
            "or the hubs run with audit_enabled=false"
        ) from err
    if info.state.messages == 0:
        return []
    try:
        sub = await js.subscribe(
            subject, ordered_consumer=True, config=config, stream=protocol.STREAM_AUDIT
        )
    except (NatsTimeoutError, TimeoutError) as err:
        refused = refused_since(nc, asked_at, "$JS.API.")
        if refused is not None:
            raise not_permitted(refused) from err
        raise MeshTimeoutError("JetStream did not open the audit stream in time") from err
    wanted = {
        "request_id": request_id,
        "agent_id": agent_id,
        "trace_id": trace_id,
        "task_id": task_id,
    }
    wanted = {k: v for k, v in wanted.items() if v is not None}
    events: collections.deque[dict[str, Any]] = collections.deque(maxlen=limit)
    try:
        while True:
            try:
                msg = await sub.next_msg(timeout=1.0)
            except (NatsTimeoutError, TimeoutError):
                break
            # A message holds a batch of events, one JSON object per line.
            for line in msg.data.splitlines():
                try:
                    event = json.loads(line)
                except ValueError:
                    continue
                if not isinstance(event, dict):
                    continue
                if all(_audit_matches(event, k, v) for k, v in wanted.items()):
                    event["seq"] = msg.metadata.sequence.stream
                    events.append(event)
            if msg.metadata.num_pending == 0:
                break
    finally:
        with contextlib.suppress(Exception):
            await sub.unsubscribe()
    # Hubs publish events in batches per subject, so stream order is not event order:
    # order by the hub's timestamp (stable, so one batch keeps its own order).
    return sorted(events, key=lambda e: e.get("ts", 0.0))


def _audit_matches(event: dict[str, Any], key: str, value: object) -> bool:
    """Whether an audit event matches one filter. An agent's events include the requests that
    named it but were refused before it was chosen (no ``agent_id`` then: it is their
    ``target``) and the routes it refused before another agent took them (``refused_by``)."""
    if event.get(key) == value:
        return True
    if key != "agent_id":
        return False
    if event.get("agent_id") is None and event.get("target") == value:
        return True
    refused = event.get("refused_by")
    return isinstance(refused, list) and value in refused
