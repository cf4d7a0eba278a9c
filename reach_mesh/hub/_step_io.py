"""The infrastructure under a workflow's steps: :class:`StepIO`, the base of
:class:`~reach_mesh.hub._steps.StepRunner` — JetStream operations retried through faults (never
an outcome), the task record's compare-and-set, fence markers, asking agents to stop attempts
no longer needed, and the engine's background tasks and pending-step count."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, Final, TypeVar

from nats.aio.client import Client as NATS
from nats.js import JetStreamContext
from nats.js.errors import KeyWrongLastSequenceError

from reach_mesh import protocol
from reach_mesh._jspub import JsClient
from reach_mesh.config import MeshSettings
from reach_mesh.hub import _durable
from reach_mesh.hub._placing import StepPlacing
from reach_mesh.hub._resources import Resources
from reach_mesh.hub._step_state import NotOwnerError, Workflow
from reach_mesh.hub._tracking import StatusTracker
from reach_mesh.hub._work_out import WorkOut
from reach_mesh.hub.registry import Registry
from reach_mesh.hub.router import Router
from reach_mesh.hub.throttle import Pacer
from reach_mesh.models import TaskState
from reach_mesh.tracing import inject
from reach_mesh.workflow import TaskRecord

__all__ = ["StepIO"]

T = TypeVar("T")

#: An attempt whose agent reported one of these has ended there: nothing to stop.
_ENDED: Final = frozenset({TaskState.SUCCEEDED, TaskState.FAILED})


class StepIO(StepPlacing):
    """JetStream and agent I/O of the steps a hub runs (a base of ``StepRunner``;
    ``WorkflowEngine`` sets every attribute below)."""

    _nc: NATS
    _js: JetStreamContext
    _registry: Registry
    _router: Router
    _settings: MeshSettings
    _metrics: Any
    _tasks_kv: _durable.Bucket | None
    _jsc: JsClient
    _tracker: StatusTracker
    _resources: Resources
    _bg: set[asyncio.Future[Any]]
    _pending: int
    #: The steps counted in ``_pending``, by (namespace, workflow id, step index): what each
    #: waits for (workflow ids are unique per namespace only: callers may choose them).
    _waiting_steps: dict[tuple[str, str, int], dict[str, Any]]
    #: Set when the hub stops: its unfinished workflows go back to the stream for another hub.
    _stopping: bool
    #: Turns of steps placed again (after a try that found no agent, or failed), per namespace.
    _replacing: Pacer
    #: JetStream operations repeated after an infrastructure error (never an outcome).
    infra_retry_total: int
    #: The steps' work messages, batched per agent per pass of the loop.
    _work_out: WorkOut

    # ------------------------------------------------------------------ infrastructure

    def _io_deadline(self, deadline: float | None = None) -> float:
        """How long an infrastructure error is retried: to ``deadline`` (loop time), and at
        least ``workflow_ack_wait`` from now (past a deadline the TIMEOUT must be written)."""
        now = self._loop.time()
        floor = now + self._settings.workflow_ack_wait
        return floor if deadline is None else max(deadline, floor)

    async def _io(self, what: str, op: Callable[[], Awaitable[T]], deadline: float | None) -> T:
        return await _durable.retrying(
            what, op, self._io_deadline(deadline), on_retry=self._infra_retry
        )

    def _input_limit(self) -> int:
        """The largest step input, in bytes of JSON: ``max_payload`` (what an agent takes), and
        room for the work message's own fields and headers in what the NATS server takes."""
        return protocol.carried_max(self._settings.max_payload, self._nc.max_payload)

    def _infra_retry(self, err: BaseException) -> None:
        self.infra_retry_total += 1
        if self._metrics is not None:
            self._metrics.infra_retry_total.inc()
        self._resources.check_soon(err)  # "no stream answered": one may have been deleted

    def _cancel_attempt(self, agent_id: str, rec: TaskRecord, attempt: int) -> None:
        """Stop a handler of ``rec``'s step that is already running, in the background (best
        effort: the task record already fences its result; this frees the agent's slot
        sooner)."""
        body = protocol.dumps(
            {
                "op": "cancel",
                "task_id": rec.task_id,
                "attempt": attempt,
                "workflow_id": rec.workflow_id,
            }
        )
        self._background(self._registry.ask_agent(agent_id, body, timeout=1.0))

    def _stop_others(self, rec: TaskRecord, decided: int | None) -> None:
        """Ask the agent of every attempt of ``rec``'s step that may still run, but attempt
        ``decided`` (whose outcome decided the step; None: none did), to stop it. Earlier
        attempts too: a hub that gives an attempt up (its agent silent, or LOST) lets it run,
        since its result may still decide the step; once the step is decided or cancelled
        none of them is needed. Attempts whose agent reported their end are skipped."""
        for past in rec.history:
            if past.agent_id is None or past.attempt == decided or past.state in _ENDED:
                continue
            self._cancel_attempt(past.agent_id, rec, past.attempt)

    async def _publish_work(
        self, wf: Workflow, agent_id: str, task_id: str, attempt: int, envelope: bytes
    ) -> None:
        """Store the work message of attempt ``attempt`` of ``task_id`` for ``agent_id``:
        retried through infrastructure errors, and, for an agent that takes work batches
        (``card.work_batch``), with the other attempts this pass of the loop decides for it
        (``hub/_work_out.py``). Its trace context is the current one."""
        headers = inject({})
        # The attempt's id: a repeat after an infrastructure error is dropped by JetStream.
        headers[protocol.HDR_MSG_ID] = protocol.attempt_msg_id(wf.ns, task_id, attempt)
        headers[protocol.HDR_EXPECTED_STREAM] = protocol.STREAM_WORK
        view = self._registry.agents.get(agent_id)
        # A batch line carries one traceparent: richer trace context goes on its own.
        limit = 1
        if view is not None and view.record.card.work_batch and len(headers) == 3:
            limit = view.record.card.max_concurrency
        await self._work_out.send(
            wf.ns,
            agent_id,
            task_id,
            attempt,
            envelope,
            headers,
            limit=limit,
            until=self._io_deadline(wf.deadline),
            # What the server takes in one message, less room for the batch's headers.
            max_bytes=self._nc.max_payload - protocol.MESSAGE_ROOM,
        )

    async def _mark(self, wf: Workflow, agent_id: str, task_id: str, attempt: int) -> None:
        """Store a fence marker for ``attempt`` on ``agent_id``'s work subject, after the
        record that gives the attempt up: if its work message still waits in the stream, the
        marker is pending behind it, and the agent drops the message without running it
        (``reach_mesh/agent/_fences.py``). Deduplicated by ``Nats-Msg-Id``: the markers are
        stored again on a takeover and when a branch is cancelled (``_remark``)."""
        subject = protocol.work_subject(wf.ns, agent_id)
        headers = {
            protocol.HDR_MSG_ID: protocol.fence_msg_id(wf.ns, task_id, attempt),
            protocol.HDR_EXPECTED_STREAM: protocol.STREAM_WORK,
            protocol.HDR_FENCE: str(attempt),
        }
        body = protocol.dumps({"task_id": task_id, "attempt": attempt, "workflow_id": wf.id})
        await self._io(
            f"publish {subject}",
            lambda: self._jsc.publish(subject, body, headers),
            wf.deadline,
        )

    async def _remark(self, wf: Workflow, rec: TaskRecord) -> None:
        """Store (again: deduplicated) the markers of every attempt ``rec`` gives up: on a
        takeover (the previous owner may have died between a record and its markers) and
        when a branch is cancelled (its step may have been stopped between them)."""
        for past in rec.history:
            if past.agent_id is None:
                continue
            decided_it = rec.state.final and past.attempt == rec.decided_by
            if decided_it and rec.state is not TaskState.TIMEOUT:
                continue  # its own outcome decided the step
            if past.attempt < rec.attempt or rec.cancelled or rec.state.final:
                await self._mark(wf, past.agent_id, rec.task_id, past.attempt)

    async def _cas(self, key: str, rec: TaskRecord, rev: int, deadline: float) -> int:
        assert self._tasks_kv is not None
        try:
            return await _durable.cas(
                self._tasks_kv,
                key,
                protocol.encode(rec),
                rev,
                self._io_deadline(deadline),
                on_retry=self._infra_retry,
            )
        except KeyWrongLastSequenceError as err:
            raise NotOwnerError(key) from err

    def _background(self, aw: Awaitable[Any]) -> None:
        task = asyncio.ensure_future(aw)
        self._bg.add(task)
        task.add_done_callback(self._bg_done)

    def _bg_done(self, task: asyncio.Future[Any]) -> None:
        self._bg.discard(task)
        if not task.cancelled():
            task.exception()

    def _pending_delta(self, delta: int) -> None:
        self._pending += delta
        if self._metrics is not None:
            self._metrics.pending_tasks.set(self._pending)
