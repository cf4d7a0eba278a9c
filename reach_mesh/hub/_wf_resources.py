"""The JetStream resources of durable workflows, created at a hub's start and again when found
gone.

A stream or a consumer deleted under a running mesh (by hand, ``nats stream rm``; a bucket
removed with its stream) left every hub retrying in silence: steps published into a work
stream that was not there any more were handed back again and again, and a hub whose
submissions consumer was gone took no new workflow. The hubs now check when JetStream gives a
sign of it — a pull answered 503 for a while (``PullConsumer``'s ``on_gone``), a workflow
handed back after "no stream answered" — and create again what is missing, as at start.
What a deleted stream held is gone with it: its work messages are sent again by their steps'
deadlines, and a deleted record bucket loses the records (docs/operations.md, "A stream of the
mesh was deleted").
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Final

import nats.js.errors
from nats.js import JetStreamContext
from nats.js.api import (
    AckPolicy,
    ConsumerConfig,
    DeliverPolicy,
    RetentionPolicy,
    StorageType,
    StreamConfig,
)
from nats.js.errors import NotFoundError

from reach_mesh import protocol
from reach_mesh._consume import ensure_stream, ensure_task_resources
from reach_mesh._nats import ensure_kv
from reach_mesh._retry import describe
from reach_mesh.config import MeshSettings

__all__ = ["WorkflowResources"]

log = logging.getLogger("reach_mesh.hub.workflows")

#: The streams (a bucket's is ``KV_<bucket>``) that durable workflows need.
STREAMS: Final = (
    protocol.STREAM_WF,
    protocol.STREAM_WF_EVENTS,
    protocol.STREAM_WORK,
    protocol.STREAM_STATUS,
    f"KV_{protocol.KV_TASKS}",
    f"KV_{protocol.KV_WORKFLOWS}",
)
#: Least time between two checks prompted by failures (a flood of retries is one check).
CHECK_EVERY: Final = 5.0
#: Time between two checks that nothing prompted: what no write of the hub would notice (the
#: event and status streams, which agents and hubs fill by core publishes).
CHECK_IDLE: Final = 30.0


class WorkflowResources:
    """Creates the workflow streams, buckets and the hubs' submissions consumer
    (:meth:`ensure`), and creates again the ones found gone (:meth:`check`)."""

    def __init__(
        self,
        js: JetStreamContext,
        settings: MeshSettings,
        *,
        counted: Callable[[int], None] | None = None,
    ) -> None:
        self._js = js
        self._settings = settings
        #: Told how many were created again (``reach_jetstream_recreated_total``).
        self._counted = counted
        self._checking: asyncio.Task[None] | None = None
        self._last_check = -CHECK_EVERY
        self._idle: asyncio.Task[None] | None = None
        #: Streams and consumers found gone and created again, over the hub's life.
        self.recreated_total = 0

    async def ensure(self) -> None:
        """Create whatever does not exist (idempotent across hubs and agents)."""
        s = self._settings
        js = self._js
        await ensure_stream(
            js,
            StreamConfig(
                name=protocol.STREAM_WF,
                subjects=[protocol.wf_submit("*")],
                retention=RetentionPolicy.WORK_QUEUE,
                storage=StorageType.FILE,
                max_age=s.workflow_retention,
                duplicate_window=min(s.dedup_window, s.workflow_retention),
                num_replicas=s.kv_replicas,
                description="reach-mesh workflow submissions (dedup on <ns>.<workflow_id>.<nonce>)",
            ),
        )
        await ensure_stream(
            js,
            StreamConfig(
                name=protocol.STREAM_WF_EVENTS,
                # ``.done`` is announced on core NATS, not stored: its result is the record's.
                subjects=[protocol.wf_event("*", "*")],
                retention=RetentionPolicy.LIMITS,
                storage=StorageType.FILE,
                max_age=s.workflow_retention,
                num_replicas=s.kv_replicas,
                description="reach-mesh workflow step events",
            ),
        )
        await ensure_task_resources(js, s)
        await ensure_kv(
            js,
            protocol.KV_WORKFLOWS,
            replicas=s.kv_replicas,
            ttl=s.workflow_retention,
            description="reach-mesh workflow records",
        )
        await js.add_consumer(
            protocol.STREAM_WF,
            ConsumerConfig(
                durable_name=protocol.CONSUMER_HUBS,
                ack_policy=AckPolicy.EXPLICIT,
                deliver_policy=DeliverPolicy.ALL,
                ack_wait=s.workflow_ack_wait,
                max_deliver=-1,
                # Submissions deferred for fairness wait here (a nak's delay keeps them
                # pending), so that other namespaces' are still delivered behind a flood.
                max_ack_pending=max(s.workflow_concurrency * 64, 65_536),
            ),
        )

    def start(self) -> None:
        """Check every ``CHECK_IDLE`` seconds from now on."""
        self._idle = asyncio.create_task(self._check_idle(), name="reach-wf-resources-idle")

    def stop(self) -> None:
        for task in (self._idle, self._checking):
            if task is not None:
                task.cancel()

    async def _check_idle(self) -> None:
        while True:
            await asyncio.sleep(CHECK_IDLE)
            if time.monotonic() - self._last_check >= CHECK_IDLE:
                await self.check()

    def check_soon(self, err: BaseException) -> None:
        """After a JetStream operation failed with ``err`` (retried): check, when no stream
        answered (one may be gone), at most every ``CHECK_EVERY`` seconds."""
        if not _no_stream(err) or time.monotonic() - self._last_check < CHECK_EVERY:
            return
        if self._checking is None or self._checking.done():
            self._checking = asyncio.create_task(self.check(), name="reach-wf-resources")

    async def check(self) -> None:
        """Create again the streams and the submissions consumer that are gone, saying which
        (an ERROR: what they held is lost). Nothing when all are there, or when JetStream
        does not answer (an election: ``not found`` is the only proof of absence)."""
        self._last_check = time.monotonic()
        gone = [name for name in STREAMS if await _gone(self._js.stream_info(name))]
        if protocol.STREAM_WF not in gone and await _gone(
            self._js.consumer_info(protocol.STREAM_WF, protocol.CONSUMER_HUBS, timeout=5.0)
        ):
            gone.append(f"consumer {protocol.CONSUMER_HUBS} of {protocol.STREAM_WF}")
        if not gone:
            return
        try:
            await self.ensure()
        except Exception as err:
            log.error("%s gone, and not created again yet: %s", ", ".join(gone), describe(err))
            return
        self.recreated_total += len(gone)
        if self._counted is not None:
            self._counted(len(gone))
        log.error(
            "%s gone (deleted?): created again; what it held is lost — steps in flight are "
            "sent again by their deadlines (docs/operations.md, A stream of the mesh was "
            "deleted)",
            ", ".join(gone),
        )


async def _gone(read: Awaitable[object]) -> bool:
    """Whether JetStream says what ``read`` reads does not exist (any other failure: no)."""
    try:
        await read
    except NotFoundError:
        return True
    except Exception:
        return False
    return False


def _no_stream(err: BaseException | None) -> bool:
    """Whether ``err``, or what caused it, is JetStream's "no stream answered"."""
    while err is not None:
        if isinstance(err, nats.js.errors.NoStreamResponseError):
            return True
        err = err.__cause__
    return False
