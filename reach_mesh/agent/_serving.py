"""The agent's request-reply serving path: :class:`ServingMixin` (a base of
:class:`~reach_mesh.agent.Agent`) takes tasks (alone or in batches), bounds them to the handler
slots, keeps recent results for idempotency, runs attempts, answers, and answers the agent's
control subject. Running one handler attempt, shaping its outcome and counting it is its base
:class:`~reach_mesh.agent._attempts.AttemptsMixin` (``_attempts.py``), where durable workflow
steps run theirs too."""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import time
import typing
from collections import deque
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any

from nats.aio.msg import Msg
from opentelemetry import context as otel_context
from opentelemetry import trace
from pydantic import TypeAdapter

from reach_mesh import protocol
from reach_mesh._batch import AnswerBatcher
from reach_mesh.agent._attempts import AttemptsMixin
from reach_mesh.agent._results import _abandoned_error, _end_handle_span
from reach_mesh.agent._table import Results, _Entry
from reach_mesh.agent._task import Task
from reach_mesh.errors import AgentBusyError, BadRequestError, NoHandlerError, ReachError
from reach_mesh.logs import LineBudget
from reach_mesh.models import ErrorBody, TaskEnvelope, TaskReply, TaskState
from reach_mesh.tracing import (
    TRACEPARENT,
    carried_span,
    inject,
    trace_id_from_headers,
    tracing_enabled,
)

if typing.TYPE_CHECKING:
    from reach_mesh.agent._work import WorkConsumer

__all__ = ["AgentStatus", "ServingMixin"]

log = logging.getLogger("reach_mesh.agent")


@dataclass(slots=True, eq=False)
class _Request:
    """Where a task attempt came from: its reply subject, its headers (the trace context), and
    — for an attempt that came in a batch — the batch's reply subject, where its answer may go
    together with others."""

    reply: str
    headers: dict[str, str] | None
    batch: str | None = None


class AgentStatus(enum.Enum):
    """Lifecycle of an :class:`Agent`: ``NEW → RUNNING → DRAINING → CLOSED``."""

    NEW = "new"
    RUNNING = "running"
    DRAINING = "draining"
    CLOSED = "closed"


@dataclass(slots=True)
class _Handler:
    capability: str
    fn: Callable[[Task[Any]], Awaitable[Any]]
    payload: TypeAdapter[Any]
    result: TypeAdapter[Any] | None


class ServingMixin(AttemptsMixin):
    """The serving and control-subject methods of ``Agent`` (which sets every attribute below,
    and those of :class:`~reach_mesh.agent._attempts.AttemptsMixin`, in its ``__init__`` and
    ``start``)."""

    status: AgentStatus
    session: str
    cordoned: bool
    max_concurrency: int
    max_queue: int
    handled: int
    work: WorkConsumer | None
    _answers: AnswerBatcher
    _handlers: dict[str, _Handler]
    _results: Results
    #: Copies of running request-reply tasks waiting for their run's reply (``_duplicate``).
    _copies: int
    _running: int
    _slot_waiters: deque[asyncio.Future[None]]
    _waiting: int
    _tasks: set[asyncio.Task[None]]
    #: Malformed lines of task batches: one line per subject per minute.
    _malformed_lines: LineBudget
    _max_envelope: int

    _confirming: asyncio.Task[bool] | None
    fault: ReachError | None

    if typing.TYPE_CHECKING:

        @property
        def capabilities(self) -> list[str]: ...

        def may_be_replaced(self) -> bool: ...

        def confirm_soon(self) -> None: ...

    # ------------------------------------------------------------------ serving
    #
    # The request-reply path runs once per task and is what bounds an agent's throughput, so it
    # avoids what it can: no TaskReply model on success (the reply JSON is written directly and
    # parsed back only if a duplicate or a state query asks for it), cached labelled metric
    # children, handler slots counted here instead of by an ``asyncio.Semaphore``, one timer
    # shared by all running handlers instead of ``asyncio.timeout()``, with tracing off the
    # request's trace context made current without a span scope (``span()`` would do the same
    # work and more), and the request's trace headers echoed on the reply instead of
    # re-injected.

    async def _on_task(self, msg: Msg) -> None:
        await self._take(msg.data, _Request(msg.reply, msg.headers))

    async def _on_batch(self, msg: Msg) -> None:
        """``reach.agent.<id>.batch``: attempts a hub decided together, one line each,
        ``<reply subject> <traceparent> <TaskEnvelope JSON>``; each is taken as if it had come
        alone (docs/protocol.md, "Task batches")."""
        batch = msg.reply or None
        requests, malformed = protocol.split_batch(msg.data)
        for reply, traceparent, data in requests:
            await self._take(data, _Request(reply, {TRACEPARENT: traceparent}, batch))
        if malformed:  # no reply subject to answer on: only the log can be told (at a rate)
            self._malformed_lines.warn(
                log,
                msg.subject,
                "batch on %s: %d malformed line(s) dropped",
                msg.subject,
                malformed,
            )
        # Let this batch's handlers run (and answer) before the next batch is read.
        await asyncio.sleep(0)

    async def _take(self, data: bytes, req: _Request, *, confirmed: bool = False) -> None:
        # Runs on the subscription's reader: never block here.
        if not confirmed and self.may_be_replaced():
            # Silent to the hubs for as long as a new process of this id waits to start (a
            # pause): a task read now may have reached that process too. Taken once we know.
            self.confirm_soon()
            self._spawn(self._take_when_confirmed(data, req))
            return
        try:
            env = protocol.decode(data, TaskEnvelope, max_size=self._max_envelope)
        except ReachError as err:
            await self._respond(req, protocol.encode_error(err))
            return
        entry = self._results.get(env.task_id)
        # (A rerun is decided here, on the reader, so a second copy read next sees its entry.)
        if entry is not None and not _runs_again(entry, env, self._abandoned):
            waits = entry.running
            if waits and self._copies >= self.max_concurrency + self.max_queue:
                # Copies of running tasks wait for their runs: as many as the agent takes.
                await self._respond(
                    req,
                    protocol.encode_error(
                        AgentBusyError(
                            f"{self.agent_id} holds {self._copies} copies of running tasks",
                            agent_id=self.agent_id,
                        )
                    ),
                )
                return
            self._copies += waits  # counted here: many copies may come in one read
            self._spawn(self._duplicate(req, env, entry, waits))
            return
        if entry is None and self.cordoned:
            # An operator's cordon, as the hubs' heartbeat replies say it: no new task id,
            # whoever sent it (a caller may publish here itself, and a route naming this agent
            # with ``after_attempt`` is admitted whatever the cordon says). A task id held or
            # finished here is answered above; a later attempt of one that failed here runs.
            await self._respond(
                req,
                protocol.encode_error(
                    AgentBusyError(
                        f"{self.agent_id} is cordoned by an operator: it takes no new tasks",
                        agent_id=self.agent_id,
                        cordoned=True,
                    )
                ),
            )
            return
        if self.status is not AgentStatus.RUNNING:
            await self._respond(
                req, protocol.encode_error(AgentBusyError(f"{self.agent_id} is draining"))
            )
            return
        if self._running >= self.max_concurrency and self.wedged:
            await self._respond(
                req,
                protocol.encode_error(
                    AgentBusyError(
                        f"{self.agent_id} has every handler slot held by a handler that did "
                        "not stop at its timeout",
                        agent_id=self.agent_id,
                    )
                ),
            )
            return
        if self._running + self._waiting >= self.max_concurrency + self.max_queue:
            await self._respond(
                req,
                protocol.encode_error(
                    AgentBusyError(
                        f"{self.agent_id} is full ({self._running} running, "
                        f"{self._waiting} queued)",
                        agent_id=self.agent_id,
                    )
                ),
            )
            return
        handler = self._pick_handler(env.capability)
        if handler is None:
            await self._respond(
                req,
                protocol.encode_error(
                    NoHandlerError(
                        f"{self.agent_id} has no handler for {env.capability!r}"
                        if env.capability is not None
                        else f"the task names no capability and {self.agent_id} has "
                        f"{len(self._handlers)} handlers: name one (capability)",
                        agent_id=self.agent_id,
                        capabilities=self.capabilities,
                    )
                ),
            )
            return
        entry = _Entry(env.attempt, TaskState.DELIVERED)
        self._remember(env.task_id, entry)
        self._waiting += 1
        self._spawn(self._run(req, env, handler, entry))

    @property
    def wedged(self) -> bool:
        """Every handler slot is held by a handler still running ``handler_abandon_grace``
        past its deadline (one that ignores its cancellation). Until one returns, the agent
        takes no new work: it refuses tasks (``REACH_AGENT_BUSY``, before accepting them),
        reports every capability unavailable in its heartbeats, and gives up the steps that
        wait for a slot when a hub asks about them (``WorkConsumer.give_up_queued``)."""
        return self._deadlines.stuck() >= self.max_concurrency

    def _pick_handler(self, capability: str | None) -> _Handler | None:
        if capability is None:
            return next(iter(self._handlers.values())) if len(self._handlers) == 1 else None
        return self._handlers.get(capability)

    def _spawn(
        self, coro: Coroutine[Any, Any, None], loop: asyncio.AbstractEventLoop | None = None
    ) -> None:
        """Run ``coro`` as a task the agent keeps until it ends. ``loop``: the running one, when
        the caller has it (``asyncio.create_task`` asks for it: a ``getpid`` system call on
        Python 3.11, once per work message on the step path)."""
        task = (loop or asyncio.get_running_loop()).create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _remember(self, task_id: str, entry: _Entry) -> None:
        """Keep ``entry`` as ``task_id``'s (see :class:`~reach_mesh.agent._table.Results`)."""
        self._results.remember(task_id, entry)

    async def _take_when_confirmed(self, data: bytes, req: _Request) -> None:
        """A task read while this process may have been replaced (``may_be_replaced``): taken
        once no other process answered for the id. Else it is left unanswered: its caller asks
        again with its task id, and the retry reaches the process that serves the id now (which
        may have run it already) — a refusal from here would send it on to another agent. Left
        so too when nobody could be asked (cut off from NATS: the confirmation failed, and the
        process may still have been replaced)."""
        if self._confirming is not None:
            with contextlib.suppress(Exception):
                await asyncio.shield(self._confirming)
        if self.fault is None and self.status is AgentStatus.RUNNING and not self.may_be_replaced():
            await self._take(data, req, confirmed=True)

    async def _duplicate(
        self, req: _Request, env: TaskEnvelope, entry: _Entry, counted: bool
    ) -> None:
        """Same task again (not a later attempt of a failed one: ``_take`` runs those): never
        run a finished or running task twice. ``counted``: in ``_copies`` (it was running)."""
        try:
            reply = entry.reply
            if reply is None:
                # Still running: answer when it ends. The future exists only once one waits.
                if entry.done is None:
                    entry.done = asyncio.get_running_loop().create_future()
                reply = await asyncio.shield(entry.done)
        finally:
            self._copies -= counted
        await self._respond(req, protocol.encode(reply.model_copy(update={"cached": True})))

    async def _run(
        self, req: _Request, env: TaskEnvelope, handler: _Handler, entry: _Entry
    ) -> None:
        """Run one request-reply attempt (``entry`` is its idempotency record) and answer."""
        t_queued = time.perf_counter()
        headers = dict(req.headers) if req.headers else {}
        # Tracing off (the common case): the traceparent is parsed once, here, into the span
        # that the handler runs under. Otherwise, or without a valid one, span() decides.
        parent = None if tracing_enabled() else carried_span(headers)
        trace_id = parent.trace_id if parent is not None else trace_id_from_headers(headers)
        out: bytes | TaskReply

        def abandon() -> None:
            # The handler ignored its timeout's cancellation for ``handler_abandon_grace``:
            # the task is TIMEOUT for whoever asks for it meanwhile (a duplicate waits no
            # more). Its caller had its answer already (its hub's deadline); should the
            # handler return at last, its outcome replaces this one below.
            if not entry.running:
                return
            self._told_abandoned(env, handler.capability, trace_id, kind="request")
            reply = self._reply(env, TaskState.TIMEOUT, error=_abandoned_error(env.timeout))
            entry.finish(TaskState.TIMEOUT, reply, b"")
            waiter, entry.done = entry.done, None
            if waiter is not None and not waiter.done():
                waiter.set_result(reply)

        queued = True
        try:
            if self._running < self.max_concurrency:
                self._running += 1  # what _slot() does first, without a coroutine
            else:
                await self._slot()
            queued = False
            self._waiting -= 1
            t_start = time.perf_counter()
            try:
                if parent is None:
                    with self._handle_span(env, handler, headers) as sp:
                        out = await self._attempt(env, handler, trace_id, sp, None, None, abandon)
                        _end_handle_span(sp, out)
                else:
                    # What span() does with tracing off, minus its scope object and a parse.
                    token = otel_context.attach(trace.set_span_in_context(parent))
                    try:
                        out = await self._attempt(
                            env, handler, trace_id, parent, None, None, abandon
                        )
                    finally:
                        otel_context.detach(token)
            except asyncio.CancelledError:
                if not self._counted_when_abandoned(env):
                    self._count_cancelled(handler.capability, time.perf_counter() - t_start)
                raise
            finally:
                self._release_slot()
            t_end = time.perf_counter()
            if not self._counted_when_abandoned(env):
                self._count(handler.capability, out, t_end - t_start)
        except asyncio.CancelledError:
            if queued:
                self._waiting -= 1  # cancelled while it waited for a slot
            out = self._reply(
                env,
                TaskState.FAILED,
                error=ErrorBody(code="REACH_CANCELLED", message="agent shut down"),
            )
            t_start = t_end = time.perf_counter()
        except Exception as err:
            out = self._failed_here(env, err)  # (``_attempt`` answers for the handler)
            t_start = t_end = time.perf_counter()
        duration_ms = (t_end - t_start) * 1000
        queued_ms = (t_start - t_queued) * 1000
        self.handled += 1
        reply: TaskReply | None = None
        if type(out) is bytes:
            body = self._success(env, out, duration_ms, queued_ms)
            state = TaskState.SUCCEEDED
        else:
            reply = typing.cast(TaskReply, out)
            reply.duration_ms = round(duration_ms, 3)
            reply.queued_ms = round(queued_ms, 3)
            body = protocol.encode(reply)
            state = reply.state
        # Our own record, even if the cache has moved on (evicted, or a newer attempt): whoever
        # still holds it (a duplicate about to wait) then sees the reply.
        entry.finish(state, reply, body)
        waiter, entry.done = entry.done, None
        if waiter is not None and not waiter.done():
            waiter.set_result(reply or TaskReply.model_validate_json(body))
        if parent is None:  # tracing on, or no valid traceparent came
            headers = inject(headers)
        # else: the request's valid traceparent (and tracestate) go back as they came, which is
        # what inject() would leave there; no parsing or formatting on the hot path.
        await self._answer(req, body, headers)

    async def _slot(self) -> None:
        """Take a handler slot (``_running`` counts the taken ones), in line if none is free."""
        if self._running < self.max_concurrency:
            self._running += 1
            return
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._slot_waiters.append(waiter)
        try:
            await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                self._release_slot()  # handed one just as we were cancelled: pass it on
            raise

    def _release_slot(self) -> None:
        """Give a handler slot back: to the first task still waiting for one, if any."""
        waiters = self._slot_waiters
        while waiters:
            waiter = waiters.popleft()
            if not waiter.done():  # else cancelled while it waited
                waiter.set_result(None)  # the slot changes hands: ``_running`` stays
                return
        self._running -= 1

    # ------------------------------------------------------------------ answering

    async def _respond(self, req: _Request, body: bytes) -> None:
        """Answer before (or instead of) running a handler: refusals, bad input, duplicates."""
        await self._answer(req, body, None if req.batch else inject({}))

    async def _answer(self, req: _Request, body: bytes, headers: dict[str, str] | None) -> None:
        """Send an attempt's answer: now on its reply subject, or — for an attempt that came in
        a batch — with the other answers to that batch ready in this pass of the event loop, as
        one message of ``<reply subject> <answer>`` lines (no headers: the hub knows its trace).
        """
        if not req.reply or self._nc is None:
            return
        if req.batch is not None and self._answers.add(req.batch, req.reply, body):
            return
        with contextlib.suppress(Exception):
            await self._nc.publish(req.reply, body, headers=headers if req.batch is None else None)

    # ------------------------------------------------------------------ the control subject

    def _task_state(self, body: dict[str, Any]) -> bytes:
        """Answer ctl ``task_state`` (docs/protocol.md). With ``fence: n`` the hub is about to
        give attempt ``n`` up: an agent that does not have the task in hand (or only finished
        an earlier attempt of it) promises never to start attempt ``n`` or an earlier one, and
        says so with ``"fenced": true``."""
        task_id = protocol.validate_task_id(str(body.get("task_id")))
        fence = body.get("fence")
        if isinstance(fence, bool) or not isinstance(fence, int):
            fence = None
        elif fence < 1:
            raise BadRequestError(f"fence must be an attempt (>= 1), got {fence}")
        recorded = body.get("next")
        if recorded is not None and (
            fence is None
            or isinstance(recorded, bool)
            or not isinstance(recorded, int)
            or recorded <= fence
        ):
            raise BadRequestError(
                f"next must be the attempt recorded after fence {fence}, got {recorded!r}",
                field="next",
            )
        entry = self._results.get(task_id)
        asker = _asking_workflow(body)
        # ``route: true``: a hub asks whether a resent request-reply task is here
        # (hub/_holders.py) — a workflow's step of the same id is not.
        route = body.get("route") is True
        if entry is not None and (
            (asker is not None and (entry.owner is None or entry.owner[0] != asker))
            or (route and entry.owner is not None)
        ):
            # The id was another workflow's step, or a request-reply task: not what is asked.
            entry = None
        if entry is None and not route and self.work is not None and self.work.checking(task_id):
            # In hand, its fence being read: the hub must not give this attempt up (and, asked
            # after its fence, watches it again: the fence read must not drop it).
            if recorded is not None:
                self.work.fences.revive(task_id, recorded, asker)
            return protocol.dumps({"task_id": task_id, "state": TaskState.DELIVERED})
        if entry is not None and entry.reply is None:
            if (
                fence is not None
                and self.work is not None
                and self.work.give_up_queued(task_id, fence, asker)
            ):
                # It waited for a slot that handlers past their timeout hold (wedged).
                return protocol.dumps(
                    {"task_id": task_id, "state": TaskState.PENDING, "fenced": True}
                )
            # Running (this attempt or an earlier one): either may deliver. Asked after the
            # hub's fence: it watches the attempt again, which our fence on return from LOST
            # must then not cancel.
            if recorded is not None and self.work is not None:
                self.work.fences.revive(task_id, recorded, asker)
            return protocol.dumps(
                {"task_id": task_id, "attempt": entry.attempt, "state": entry.state}
            )
        promised = (
            fence is not None
            and self.work is not None
            and (entry is None or entry.attempt < fence)
            and self.work.promise(task_id, fence, asker)
        )
        if entry is None:
            out: dict[str, Any] = {"task_id": task_id, "state": TaskState.PENDING}
        else:
            assert entry.reply is not None
            out = entry.reply.model_dump(mode="json", exclude_none=True)
        if promised:
            out["fenced"] = True
        return protocol.dumps(out)

    async def _on_ctl(self, msg: Msg) -> None:
        try:
            body = protocol.loads_object(msg.data or b"{}")
            op = body.get("op", "ping")
            if op == "ping":
                out: dict[str, Any] = {
                    "agent_id": self.agent_id,
                    "status": self.status.value,
                    "inflight": self._running,
                    "queued": self._waiting,
                    "session": self.session,
                }
                data = protocol.dumps(out)
            elif op == "task_state":
                data = self._task_state(body)
            elif op == "cancel":
                # A durable step the hub no longer needs (any/quorum past its policy).
                task_id = protocol.validate_task_id(str(body.get("task_id")))
                attempt = body.get("attempt")
                if isinstance(attempt, bool) or not isinstance(attempt, int) or attempt < 1:
                    raise BadRequestError("cancel needs an attempt: an integer >= 1")
                cancelled = self.work is not None and self.work.cancel(
                    task_id, attempt, _asking_workflow(body)
                )
                data = protocol.dumps({"task_id": task_id, "cancelled": cancelled})
            else:
                raise BadRequestError(f"unknown ctl op {op!r}")
        except ReachError as err:
            data = protocol.encode_error(err)
        await self._respond(_Request(msg.reply, None), data)


def _asking_workflow(body: dict[str, Any]) -> str | None:
    """The workflow a hub's ctl request names (``workflow_id``; hubs send it), or None: what
    it asks about is then any step of the task id, as from hubs before they named it."""
    got = body.get("workflow_id")
    return got if isinstance(got, str) else None


def _runs_again(entry: _Entry, env: TaskEnvelope, abandoned: set[tuple[str, int]]) -> bool:
    """Whether ``env`` is a later attempt of a task that failed or timed out here: it runs
    again (a copy of a running or succeeded one never does, nor one of a task whose handler
    was abandoned and still runs — ``abandoned``: it is answered that TIMEOUT, as a copy is,
    rather than run twice at once — nor one of a task that failed for good, ``retryable``
    false: that failure is its outcome. A caller whose wait for it timed out, its answer lost
    on the way, asks again as the next attempt, as after a timeout: it ran twice under the
    chaos ``partition`` fault)."""
    return (
        not entry.running
        and entry.state is not TaskState.SUCCEEDED
        and env.attempt > entry.attempt
        and (not abandoned or (env.task_id, entry.attempt) not in abandoned)
        and not _failed_for_good(entry)
    )


def _failed_for_good(entry: _Entry) -> bool:
    """A FAILED entry whose error says ``retryable: false`` (``TaskFailed(retryable=False)``,
    a payload the handler cannot take)."""
    if entry.state is not TaskState.FAILED:
        return False
    reply = entry.reply
    err = None if reply is None else reply.error
    return err is not None and err.details.get("retryable", True) is False
