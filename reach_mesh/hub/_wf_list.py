"""A namespace's recent workflows, for the people running the mesh: the answer to
``reach.hub.<ns>.workflows`` (``reach-mesh workflows``, ``Client.list_workflows``) — what an
operator asks first when callers report failures without an id, or to see what runs now.

Any hub answers, from the ``reach_workflows`` bucket's stream, which keeps each workflow's
newest record write (its final record once it has one): the namespace's records written in the
window asked for (``since_s``; a deleted one is left out). The list is bounded whatever the mesh
holds: at most :data:`SCAN_MAX` records are read, the newest (a busy namespace's older records
of the window are then not read, and the answer says so), within :data:`LIST_DEADLINE`
seconds; records are read without their payloads (``_SlimRecord``).
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import Collection
from datetime import UTC, datetime
from typing import Final

from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import ConsumerConfig, DeliverPolicy
from pydantic import ValidationError

from reach_mesh import protocol
from reach_mesh.hub._wf_view import _SlimRecord
from reach_mesh.models import TaskState
from reach_mesh.workflow import WorkflowList, WorkflowSummary

__all__ = ["LIST_DEADLINE", "LIST_MAX", "SCAN_MAX", "SINCE_MAX", "list_workflows"]

#: Records one list reads at most (the bucket keeps one per workflow: its newest write).
SCAN_MAX: Final = 10_000
#: Workflows one answer holds at most (``limit``).
LIST_MAX: Final = 500
#: The longest window (s) a list may ask for: records are kept ``workflow_retention`` anyway.
SINCE_MAX: Final = 7 * 86_400.0
#: Seconds a list may take; what has not been read by then is left out (``truncated``).
LIST_DEADLINE: Final = 2.5
#: Messages read between two turns of the event loop.
_YIELD_EVERY: Final = 256
_STREAM: Final = f"KV_{protocol.KV_WORKFLOWS}"


async def list_workflows(
    js: JetStreamContext,
    ns: str,
    *,
    hub_id: str,
    states: Collection[TaskState] = (),
    limit: int = 50,
    since_s: float = 3600.0,
    within: float = LIST_DEADLINE,
) -> WorkflowList:
    """The workflows of ``ns`` whose record was written in the last ``since_s`` seconds, newest
    first, at most ``limit``; only those in ``states`` when given."""
    loop = asyncio.get_running_loop()
    end = loop.time() + within
    since = datetime.now(UTC).timestamp() - since_s
    subject = f"$KV.{protocol.KV_WORKFLOWS}.{ns}.*"
    prefix = subject[:-1]
    truncated = False
    sub = await _reader(js, subject, DeliverPolicy.BY_START_TIME, start_time=since)
    try:
        pending = await _to_read(sub)
        if pending > SCAN_MAX:
            # More records in the window than one list reads: the newest of the whole bucket
            # (of every namespace: the filter cannot count back), down to the window's start.
            await _close(sub)
            info = await js.stream_info(_STREAM)
            first = max(info.state.first_seq, info.state.last_seq - SCAN_MAX + 1)
            sub = await _reader(js, subject, DeliverPolicy.BY_START_SEQUENCE, start_seq=first)
            pending = await _to_read(sub)
            truncated = True
        newest: dict[str, WorkflowSummary] = {}  # by id, in the order of their newest write
        scanned = 0
        oldest: float | None = None
        while scanned < pending:
            left = end - loop.time()
            if left <= 0:
                truncated = True
                break
            try:
                msg = await sub.next_msg(timeout=left)
            except TimeoutError:
                truncated = True
                break
            scanned += 1
            written = msg.metadata.timestamp.timestamp()
            oldest = written if oldest is None else oldest
            wf_id = msg.subject[len(prefix) :] if msg.subject.startswith(prefix) else None
            if wf_id is not None and written >= since:
                newest.pop(wf_id, None)
                summary = _summary(wf_id, msg, written)
                if summary is not None:
                    newest[wf_id] = summary
            if msg.metadata.num_pending == 0:
                break
            if scanned % _YIELD_EVERY == 0:
                await asyncio.sleep(0)
    finally:
        await _close(sub)
    wanted = set(states)
    matched = [s for s in reversed(newest.values()) if not wanted or s.state in wanted]
    return WorkflowList(
        namespace=ns,
        hub_id=hub_id,
        workflows=matched[:limit],
        matched=len(matched),
        scanned=scanned,
        truncated=truncated,
        since=round(since, 3),
        oldest_read_at=None if oldest is None else round(oldest, 3),
    )


async def _reader(
    js: JetStreamContext,
    subject: str,
    policy: DeliverPolicy,
    *,
    start_time: float | None = None,
    start_seq: int | None = None,
) -> JetStreamContext.PushSubscription:
    """An ordered consumer of the bucket's stream on ``subject`` (named: its filter travels in
    the API subject, as NATS permissions want it), from ``start_time`` or ``start_seq``."""
    config = ConsumerConfig(
        name=f"reach-{uuid.uuid4().hex}",
        deliver_policy=policy,
        opt_start_time=None if start_time is None else datetime.fromtimestamp(start_time, UTC),
        opt_start_seq=start_seq,
    )
    return await js.subscribe(
        subject,
        stream=_STREAM,
        ordered_consumer=True,
        deliver_policy=policy,
        inactive_threshold=30.0,
        config=config,
        pending_msgs_limit=SCAN_MAX,
    )


async def _to_read(sub: JetStreamContext.PushSubscription) -> int:
    """The messages a new consumer has for us: those pending at the server, and those it
    pushed already (they wait in the subscription)."""
    info = await sub.consumer_info()
    return (info.num_pending or 0) + (info.delivered.consumer_seq or 0 if info.delivered else 0)


async def _close(sub: JetStreamContext.PushSubscription) -> None:
    with contextlib.suppress(Exception):
        await sub.unsubscribe()


def _summary(wf_id: str, msg: Msg, written: float) -> WorkflowSummary | None:
    """What a list shows of one record write; None for a delete, or a record it cannot read."""
    if (msg.headers or {}).get("KV-Operation") in ("DEL", "PURGE") or not msg.data:
        return None
    try:
        record = _SlimRecord.model_validate_json(msg.data)
    except ValidationError:
        return None
    result = record.result
    if result is not None:
        return WorkflowSummary(
            workflow_id=wf_id,
            kind=result.kind,
            state=result.state,
            steps=len(result.steps),
            failed_steps=sum(1 for s in result.steps if s.state is not TaskState.SUCCEEDED),
            owner=result.hub_id or record.owner,
            trace_id=result.trace_id or record.trace_id,
            submitted_at=record.submitted_at,
            finished_at=result.finished_at,
            duration_ms=result.duration_ms,
            error=result.error,
            updated_at=round(written, 3),
        )
    unstarted = record.owner is None and record.cancel is not None
    return WorkflowSummary(
        workflow_id=wf_id,
        kind=None if record.spec is None else record.spec.kind,
        state=TaskState.PENDING if unstarted else record.state,
        steps=0 if record.spec is None else len(record.spec.steps),
        owner=record.owner,
        trace_id=record.trace_id,
        submitted_at=record.submitted_at,
        timeout=None if record.spec is None else record.spec.timeout,
        error=record.cancel,
        updated_at=round(written, 3),
    )
