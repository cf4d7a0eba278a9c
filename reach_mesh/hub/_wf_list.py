"""A namespace's recent workflows, for the people running the mesh: the answer to
``reach.hub.<ns>.workflows`` (``reach-mesh workflows``, ``Client.list_workflows``) — what an
operator asks first when callers report failures without an id, or to see what runs now —
and every namespace's, for operators only (``{"op": "workflows"}`` on ``reach.hub.<ns>.admin``:
``reach-mesh workflows --all-namespaces``, the dashboard).

Any hub answers, from the ``reach_workflows`` bucket's stream, which keeps each workflow's
newest record write (written when it starts and when it ends; a deleted one is left out), in
the window asked for (``since_s``); and the unfinished workflows not in it (running since
before the window, or taken by no hub yet), from their submissions still in ``REACH_WF``
(``_unfinished``). The list is
bounded whatever the mesh holds: at most :data:`SCAN_MAX` records are read — when the window
holds more, those among the bucket's last :data:`SCAN_MAX` writes, and the answer says older
ones were not read — and
what a list keeps of each is brief (``_BriefRecord``: no payloads, no error details, an
error's message cut at :data:`MESSAGE_MAX`). The whole list, JetStream requests included, has
:data:`LIST_DEADLINE` seconds; past them it is ``REACH_UNAVAILABLE``, never a list that
silently misses the newest records. Its consumer is deleted when it is done.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
import uuid
from collections.abc import Collection
from datetime import UTC, datetime
from typing import Final

import nats.errors
import nats.js.errors
from nats.js import JetStreamContext
from nats.js.api import ConsumerConfig, DeliverPolicy, RawStreamMsg
from nats.js.errors import NotFoundError
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from reach_mesh import protocol
from reach_mesh._kv import kv_marker, kv_stream, kv_subject
from reach_mesh.errors import MeshUnavailableError, ReachError
from reach_mesh.models import ErrorBody, TaskState
from reach_mesh.workflow import WorkflowKind, WorkflowList, WorkflowSummary

__all__ = ["LIST_DEADLINE", "SCAN_MAX", "list_workflows"]

#: Records one list reads at most (the bucket keeps one per workflow: its newest write).
SCAN_MAX: Final = 10_000
#: Bytes of records one list reads at most (a record holds its workflow's results: forty
#: records of 6 MB made every list of their namespace ``REACH_UNAVAILABLE``, its parsing past
#: ``LIST_DEADLINE``). Past it, the newest records that fit are read, and the answer says
#: older ones were not; what the records weigh is read first from their headers alone, when
#: the whole bucket weighs more.
BYTES_MAX: Final = 32 << 20
#: Seconds a list may take, JetStream requests included (then ``REACH_UNAVAILABLE``).
LIST_DEADLINE: Final = 2.5
#: Unfinished workflows outside the window's records that one list reads at most, and for
#: how many seconds (of the list's ``LIST_DEADLINE``).
UNFINISHED_MAX: Final = 1_000
UNFINISHED_WITHIN: Final = 1.0
#: The states those unfinished workflows can be in (a list asking for
#: neither skips them), and the time left for the answer after they are read.
_UNFINISHED: Final = frozenset({TaskState.RUNNING, TaskState.PENDING})
_MARGIN: Final = 0.25
#: Characters of an error's message a list shows (its details are left out).
MESSAGE_MAX: Final = 300
#: Messages read between two turns of the event loop.
_YIELD_EVERY: Final = 256
_STREAM: Final = kv_stream(protocol.KV_WORKFLOWS)


async def list_workflows(
    js: JetStreamContext,
    ns: str | None,
    *,
    hub_id: str,
    states: Collection[TaskState] = (),
    limit: int = protocol.WORKFLOW_LIST_LIMIT,
    since_s: float = protocol.WORKFLOW_LIST_SINCE,
    within: float = LIST_DEADLINE,
) -> WorkflowList:
    """The workflows of ``ns`` (None: of every namespace) whose record was written in the last
    ``since_s`` seconds, newest first, at most ``limit``; only those in ``states`` when given.
    ``MeshUnavailableError`` when it cannot be read within ``within`` seconds (JetStream
    unavailable, or the hub too busy): a partial list would miss the newest records, which a
    list is asked for."""
    end = asyncio.get_running_loop().time() + within
    try:
        async with asyncio.timeout_at(end):
            return await _list(js, ns, hub_id, frozenset(states), limit, since_s, end)
    except TimeoutError:
        whose = "every namespace" if ns is None else f"namespace {ns!r}"
        raise MeshUnavailableError(
            f"the workflows of {whose} could not be read within {within:g} s "
            "(JetStream unavailable, or this hub busy): ask again, or for a shorter window"
        ) from None


async def _list(
    js: JetStreamContext,
    ns: str | None,
    hub_id: str,
    wanted: frozenset[TaskState],
    limit: int,
    since_s: float,
    end: float,
) -> WorkflowList:
    since = datetime.now(UTC).timestamp() - since_s
    subject = kv_subject(protocol.KV_WORKFLOWS, ">" if ns is None else f"{ns}.*")
    prefix = kv_subject(protocol.KV_WORKFLOWS, "")  # a record's key follows: <ns>.<id>
    truncated = False
    #: By key (``<ns>.<id>``), in the order of their newest write.
    newest: dict[str, WorkflowSummary] = {}
    scanned = 0
    oldest: float | None = None
    name = _name()
    sub = await _open(js, subject, name, DeliverPolicy.BY_START_TIME, start_time=since)
    try:
        pending = await _to_read(sub)
        first: int | None = None
        info = await js.stream_info(_STREAM) if pending > 0 else None
        if info is not None and pending > SCAN_MAX:
            # More records in the window than one list reads: those among the bucket's last
            # SCAN_MAX writes (of every namespace: the filter cannot count back; superseded
            # writes are gone, so there are fewer records than that).
            first = max(info.state.first_seq, info.state.last_seq - SCAN_MAX + 1)
        if info is not None and info.state.bytes > BYTES_MAX:
            weighed = await _fitting(js, subject, since, first, min(pending, SCAN_MAX))
            first = first if weighed is None else weighed
        if first is not None:
            await _close(js, sub, name)
            name = _name()
            sub = await _open(js, subject, name, DeliverPolicy.BY_START_SEQUENCE, start_seq=first)
            pending = await _to_read(sub)
            truncated = True
        if pending > 0:
            # (``messages``: no task per message, as ``next_msg`` makes; the caller's timeout
            # bounds the whole read.)
            async for msg in sub.messages:
                scanned += 1
                written = msg.metadata.timestamp.timestamp()
                oldest = written if oldest is None else oldest
                key = msg.subject[len(prefix) :]  # (the filter is under the prefix)
                if key.count(".") == 1 and written >= since:
                    newest.pop(key, None)
                    summary = _summary(key, msg.headers, msg.data, written)
                    if summary is not None:
                        newest[key] = summary
                if msg.metadata.num_pending == 0 or scanned >= pending:
                    break
                if scanned % _YIELD_EVERY == 0:
                    await asyncio.sleep(0)
    finally:
        # (shielded: a deadline that fires in it still deletes the consumer)
        await asyncio.shield(_close(js, sub, name))
    listed = list(reversed(newest.values()))
    if not wanted or wanted & _UNFINISHED:
        # (a list of final states only has nothing to find there)
        more, cut = await _unfinished(js, ns, newest, end - _MARGIN)
        scanned += len(more)
        truncated = truncated or cut
        listed = sorted(listed + more, key=lambda s: s.updated_at, reverse=True)
    matched = [s for s in listed if not wanted or s.state in wanted]
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


async def _fitting(
    js: JetStreamContext, subject: str, since: float, first: int | None, count: int
) -> int | None:
    """The stream sequence from which the records on ``subject`` (those written since
    ``since``, or from ``first``) weigh at most ``BYTES_MAX``, read from their headers alone;
    None when they all do."""
    name = _name()
    if first is None:
        sub = await _open(
            js, subject, name, DeliverPolicy.BY_START_TIME, start_time=since, headers_only=True
        )
    else:
        sub = await _open(
            js, subject, name, DeliverPolicy.BY_START_SEQUENCE, start_seq=first, headers_only=True
        )
    sizes: list[tuple[int, int]] = []
    try:
        async for msg in sub.messages:
            size = (msg.headers or {}).get("Nats-Msg-Size", "0")
            sizes.append((msg.metadata.sequence.stream, int(size) if size.isdigit() else 0))
            if msg.metadata.num_pending == 0 or len(sizes) >= count:
                break
            if len(sizes) % _YIELD_EVERY == 0:
                await asyncio.sleep(0)
    finally:
        await asyncio.shield(_close(js, sub, name))
    total = 0
    for i in range(len(sizes) - 1, -1, -1):
        total += sizes[i][1]
        if total > BYTES_MAX:
            return sizes[i + 1][0] if i + 1 < len(sizes) else sizes[i][0] + 1
    return None


async def _unfinished(
    js: JetStreamContext, ns: str | None, listed: Collection[str], end: float
) -> tuple[list[WorkflowSummary], bool]:
    """The unfinished workflows not in the window's list (``listed``): their submission still
    waits in ``REACH_WF`` (acked only once the result is stored) — running since before the
    window (their record was written when they started), or taken by no hub yet (no record,
    whenever submitted). At most :data:`UNFINISHED_MAX`,
    read for :data:`UNFINISHED_WITHIN` seconds at most and never past ``end`` (what the
    list's deadline leaves: a backlog of submissions must not cost the list its answer); and
    whether more were left unread — as when ``REACH_WF`` cannot be read (no leader), which
    leaves the window's list whole. A submission no hub has taken yet (no record) is
    PENDING, as of its submission."""
    out: list[WorkflowSummary] = []
    loop = asyncio.get_running_loop()
    try:
        async with asyncio.timeout_at(min(loop.time() + UNFINISHED_WITHIN, end)):
            return out, await _read_unfinished(js, ns, set(listed), out)
    except TimeoutError:
        return out, True
    except (nats.errors.Error, nats.js.errors.Error):
        return out, True


async def _read_unfinished(
    js: JetStreamContext,
    ns: str | None,
    seen: set[str],
    out: list[WorkflowSummary],
) -> bool:
    """Into ``out``, as :func:`_unfinished` says; True when more were left unread."""
    subject = protocol.wf_submit("*" if ns is None else ns)
    seq = 1
    while True:  # (each pass moves on in the stream, and its time is bounded)
        try:
            msg = await js.get_msg(protocol.STREAM_WF, seq=seq, subject=subject, next=True)
        except NotFoundError:
            return False
        submitted = msg.time.timestamp() if msg.time is not None else time.time()
        seq = (msg.seq or seq) + 1
        key = _submitted_key(msg)
        if key is None or key in seen:
            continue
        if len(out) == UNFINISHED_MAX:
            return True
        seen.add(key)
        try:
            record = await js.get_last_msg(_STREAM, kv_subject(protocol.KV_WORKFLOWS, key))
        except NotFoundError:
            ns_of, wf_id = key.split(".", 1)
            out.append(
                WorkflowSummary(
                    namespace=ns_of,
                    workflow_id=wf_id,
                    state=TaskState.PENDING,
                    submitted_at=round(submitted, 3),
                    updated_at=round(submitted, 3),
                )
            )
            continue
        written = record.time.timestamp() if record.time is not None else submitted
        summary = _summary(key, record.headers, record.data, written)
        if summary is not None:
            out.append(summary)
            if len(out) % _YIELD_EVERY == 0:
                await asyncio.sleep(0)


def _submitted_key(msg: RawStreamMsg) -> str | None:
    """``<ns>.<workflow_id>`` of a stored submission: its subject names the namespace, its
    ``Nats-Msg-Id`` the id a hub answers it under (it runs a spec whose body names the same
    id, and refuses any other submission under the header's), or — without a header naming a
    valid id — its body's ``workflow_id``; None when they read as none."""
    ns = protocol.submit_namespace(msg.subject or "")
    wf_id = protocol.named_workflow_id(msg.headers)
    if not wf_id:  # (the body's runs)
        try:
            wf_id = _SubmittedId.model_validate_json(msg.data or b"").workflow_id
        except ValidationError:
            return None
    try:
        protocol.validate_namespace(ns)  # (a literal "*" on an open bus: a wildcard key)
        protocol.validate_workflow_id(wf_id)
    except ReachError:
        return None
    return f"{ns}.{wf_id}"


def _name() -> str:
    return f"reach-{uuid.uuid4().hex}"


#: Consumers being deleted after their list was cut short (kept from the garbage collector).
_CLOSING: set[asyncio.Task[None]] = set()


async def _open(
    js: JetStreamContext,
    subject: str,
    name: str,
    policy: DeliverPolicy,
    *,
    start_time: float | None = None,
    start_seq: int | None = None,
    headers_only: bool = False,
) -> JetStreamContext.PushSubscription:
    """An ordered consumer of the bucket's stream on ``subject`` (named: its filter travels in
    the API subject, as NATS permissions want it), from ``start_time`` or ``start_seq``. It is
    deleted however its creation ends: a list cut short meanwhile (its deadline) lets the
    creation finish, then deletes what it made."""
    config = ConsumerConfig(
        name=name,
        deliver_policy=policy,
        opt_start_time=None if start_time is None else datetime.fromtimestamp(start_time, UTC),
        opt_start_seq=start_seq,
        headers_only=headers_only or None,
    )
    making = asyncio.ensure_future(
        js.subscribe(
            subject,
            stream=_STREAM,
            ordered_consumer=True,
            deliver_policy=policy,
            inactive_threshold=30.0,
            config=config,
        )
    )
    try:
        return await asyncio.shield(making)
    except asyncio.CancelledError:
        making.add_done_callback(functools.partial(_close_when_made, js, name))
        raise
    except Exception:
        await _close(js, None, name)  # (a timeout may leave it made at the server)
        raise


def _close_when_made(
    js: JetStreamContext, name: str, making: asyncio.Future[JetStreamContext.PushSubscription]
) -> None:
    made = None if making.cancelled() or making.exception() else making.result()
    task = asyncio.ensure_future(_close(js, made, name))
    _CLOSING.add(task)
    task.add_done_callback(_CLOSING.discard)


async def _to_read(sub: JetStreamContext.PushSubscription) -> int:
    """The messages a new consumer has for us: those pending at the server, and those it
    pushed already (they wait in the subscription)."""
    info = await sub.consumer_info()
    return (info.num_pending or 0) + (info.delivered.consumer_seq or 0 if info.delivered else 0)


async def _close(
    js: JetStreamContext, sub: JetStreamContext.PushSubscription | None, name: str
) -> None:
    """Unsubscribe and delete the consumer (an unsubscribe leaves it to its inactivity
    threshold: a loop of lists would pile them up on the server)."""
    if sub is not None:
        with contextlib.suppress(Exception):
            await sub.unsubscribe()
    with contextlib.suppress(Exception):
        await js.delete_consumer(_STREAM, name)


# --------------------------------------------------------------------------- brief records


class _Brief(BaseModel):
    """What a list reads of a stored record: payloads, results, error details and each step's
    outcome are skipped, not built (a list holds up to ``SCAN_MAX`` of them)."""

    model_config = ConfigDict(extra="ignore")


class _SubmittedId(_Brief):
    workflow_id: str


class _BriefError(_Brief):
    code: str
    message: str = ""


class _BriefStep(_Brief):
    state: TaskState


class _BriefSpec(_Brief):
    kind: WorkflowKind
    steps: list[_Brief] = Field(default_factory=list)  # counted
    timeout: float | None = None


class _BriefResult(_Brief):
    kind: WorkflowKind
    state: TaskState
    steps: list[_BriefStep] = Field(default_factory=list)
    error: _BriefError | None = None
    trace_id: str | None = None
    hub_id: str | None = None
    finished_at: float | None = None
    duration_ms: float = 0.0


class _BriefRecord(_Brief):
    spec: _BriefSpec | None = None
    state: TaskState = TaskState.RUNNING
    owner: str | None = None
    trace_id: str | None = None
    submitted_at: float | None = None
    cancel: _BriefError | None = None
    result: _BriefResult | None = None


def _error(error: _BriefError | None) -> ErrorBody | None:
    """An error as a list shows it: its code and the start of its message (an answer of
    ``protocol.WORKFLOW_LIST_MAX`` workflows stays far below NATS' ``max_payload``)."""
    if error is None:
        return None
    message = error.message
    if len(message) > MESSAGE_MAX:
        message = message[: MESSAGE_MAX - 1] + "…"
    return ErrorBody(code=error.code, message=message)


def _summary(
    key: str, headers: dict[str, str] | None, data: bytes | None, written: float
) -> WorkflowSummary | None:
    """What a list shows of the record write of ``key`` (``<ns>.<workflow_id>``); None for a
    delete, or a record it cannot read."""
    if kv_marker(headers) or not data:
        return None
    try:
        record = _BriefRecord.model_validate_json(data)
    except ValidationError:
        return None
    ns, wf_id = key.split(".", 1)
    result = record.result
    if result is not None:
        return WorkflowSummary(
            namespace=ns,
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
            error=_error(result.error),
            updated_at=round(written, 3),
        )
    unstarted = record.owner is None and record.cancel is not None
    return WorkflowSummary(
        namespace=ns,
        workflow_id=wf_id,
        kind=None if record.spec is None else record.spec.kind,
        state=TaskState.PENDING if unstarted else record.state,
        steps=0 if record.spec is None else len(record.spec.steps),
        owner=record.owner,
        trace_id=record.trace_id,
        submitted_at=record.submitted_at,
        timeout=None if record.spec is None else record.spec.timeout,
        error=_error(record.cancel),
        updated_at=round(written, 3),
    )
