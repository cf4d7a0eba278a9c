"""The steps a work consumer holds while their attempts run: :class:`_Held`, one work message in
hand, and :class:`HeldSteps`, a base of :class:`~reach_mesh.agent._work.WorkConsumer`.

What happens to a step once the consumer has taken it (``_work.py`` decides that: duplicates,
stored results, fences) is here: its attempt runs in one of the agent's handler slots
(``Agent._call``), what is said of it goes out on ``reach.status.<agent_id>.<task_id>`` —
DELIVERED while it waits for a slot, ACCEPTED, RUNNING and ``+WPI`` keep-alives while it runs,
then the final status, stored by JetStream before the message is acked — and a handler that
does not stop when its attempt is cancelled is abandoned (answered TIMEOUT, or dropped when
fenced) ``handler_abandon_grace`` later, keeping its slot until it returns.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import math
import time
import typing
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final

from nats.aio.msg import Msg
from pydantic_core import to_json

from reach_mesh import protocol
from reach_mesh._consume import PullConsumer
from reach_mesh._jspub import JsClient
from reach_mesh._retry import RetriesExhausted, describe, retrying, transient
from reach_mesh.agent._results import _abandoned_error, _json_string
from reach_mesh.agent._work_batches import ack_later
from reach_mesh.config import MeshSettings
from reach_mesh.errors import PayloadTooLargeError
from reach_mesh.models import TaskEnvelope, TaskReply, TaskState
from reach_mesh.tracing import inject, trace_id_from_headers
from reach_mesh.workflow import TaskStatusEvent

if TYPE_CHECKING:
    import hashlib

    from reach_mesh.agent._agent import Agent
    from reach_mesh.agent._fences import Fences
    from reach_mesh.agent._serving import _Handler
    from reach_mesh.agent._table import _Entry

__all__ = ["HeldSteps"]

#: The work consumer's logger (what happens to a held step is the consumer's to say).
log = logging.getLogger("reach_mesh.agent.work")

#: How long a final status is retried in place (infrastructure errors) before the message is
#: handed back for redelivery.
_FINAL_RETRY: Final = 10.0
#: ACCEPTED is published only for a handler still running this long after it started: a
#: quicker one's final status implies it (one status message fewer per step).
_ACCEPTED_AFTER: Final = 0.05
#: A SUCCEEDED step's final status as ``protocol.encode`` writes its ``TaskStatusEvent``
#: (``None`` fields left out, in the model's field order), around the result's JSON
#: (``HeldSteps._succeeded``): task id, attempt, agent id and state, workflow and step, result.
_STEP_SUCCEEDED: Final = (
    b'{"task_id":%b,"attempt":%d%b%b,"result":%b,"cached":false,"duration_ms":%.3f,'
    b'"queued_ms":%.3f}'
)
_STEP_SUCCEEDED_NULL: Final = (
    b'{"task_id":%b,"attempt":%d%b%b,"cached":false,"duration_ms":%.3f,"queued_ms":%.3f}'
)


@dataclass(slots=True, eq=False)
class _Held:
    """One work message this agent holds while its attempt runs."""

    msg: Msg
    env: TaskEnvelope
    headers: dict[str, str]
    #: Its idempotency record (``Agent._results``), while the table keeps it as this attempt's.
    entry: _Entry
    task: asyncio.Task[None] | None = None
    accepted_at: float | None = None
    last_running: float = 0.0
    fenced: bool = False
    #: When its fence was read (monotonic; a SIGSTOP pause counts): read again before the
    #: handler starts if that was long ago (``WorkConsumer._fenced_since``).
    checked_at: float = 0.0
    #: Other copies of the same attempt (duplicate deliveries): acked together with ``msg``.
    extra: list[Msg] = field(default_factory=list)
    #: The pending ACCEPTED status (see ``_ACCEPTED_AFTER``); None once said or not needed.
    accepted_timer: asyncio.TimerHandle | None = None
    #: When (monotonic) a handler that a cancel did not stop is abandoned
    #: (``HeldSteps._abandon``): ``handler_abandon_grace`` after the cancel that fenced
    #: it. (One past its deadline is abandoned by its alarm, ``_Deadlines``.)
    abandon_at: float = math.inf
    #: Abandoned: its attempt is answered (or dropped, when fenced) and no longer held; what
    #: the handler returns, if it ever does, is dropped.
    abandoned: bool = False
    #: The capability of the handler it runs (what its metrics are labelled by), once chosen.
    capability: str | None = None


class HeldSteps:
    """Running, announcing and letting go of the steps a work consumer holds (a base of
    ``WorkConsumer``, which sets every attribute below)."""

    _agent: Agent
    _settings: MeshSettings
    #: The event loop (``WorkConsumer.start``), asked once: on Python 3.11 each
    #: ``asyncio.get_running_loop()`` or ``current_task()`` is a ``getpid`` system call.
    _loop: asyncio.AbstractEventLoop
    #: Fence reads (direct gets of ``reach_tasks``) and final statuses.
    _jsc: JsClient | None
    #: Keys the nonce of each final-status id (``protocol.final_msg_id``): random per
    #: process, so no other agent can predict an id, nor one from another it has read.
    _nonce_key: bytes
    #: blake2b keyed with ``_nonce_key``, nothing hashed yet: each nonce starts from a copy.
    _nonce_hash: hashlib.blake2b
    _pull: PullConsumer | None
    _held: dict[str, _Held]
    #: The newest non-final status publish of each task still under way: the final status
    #: waits for it, so that it is the last event stored on the task's subject.
    _saying: dict[str, asyncio.Future[None]]
    #: Work messages dropped because their attempt was fenced (superseded or cancelled).
    fenced: int
    #: Promises never to start an attempt (``_fences.Fences``).
    fences: Fences

    if TYPE_CHECKING:

        async def _fenced_since(self, held: _Held) -> bool: ...

    def _release(self) -> None:
        """A message handed over by the pulls is done with (acked, nak'd or termed): room for
        the next one."""
        if self._pull is not None:
            self._pull.release()

    # ------------------------------------------------------------------ running

    async def _run(self, held: _Held, handler: _Handler) -> None:
        agent = self._agent
        env = held.env
        held.capability = handler.capability
        t_queued = time.perf_counter()
        t_start = t_queued
        agent._waiting += 1
        waiting = True

        def on_accept() -> None:
            held.accepted_at = held.last_running = time.monotonic()
            if agent._results.get(env.task_id) is held.entry:
                held.entry.state = TaskState.ACCEPTED
            held.accepted_timer = self._loop.call_later(_ACCEPTED_AFTER, self._say_accepted, held)

        async def progress(info: Any) -> None:
            if self._held.get(env.task_id) is not held:
                return  # finished: nothing is said of an attempt after its final status
            size, limit = len(to_json(info)), agent._max_result
            if size > limit:
                # A message NATS would refuse (or close the connection for): the handler hears.
                raise PayloadTooLargeError(
                    f"progress of {size} bytes of JSON, over the {limit} bytes a status may "
                    "carry (max_payload)",
                    size=size,
                    max_size=limit,
                    retryable=False,
                )
            held.last_running = time.monotonic()
            _quiet(held)  # RUNNING implies ACCEPTED
            self._publish(held.env, TaskState.RUNNING, held.headers, progress=info)

        try:
            await agent._slot()
            agent._waiting -= 1
            waiting = False
            try:  # the slot is ours until here, whatever ends the attempt (a cancel included)
                if await self._fenced_since(held):
                    # Dropped unrun, as a step fenced while we were away is (below): acked, no
                    # result published.
                    held.fenced = True
                    self.fenced += 1
                    raise asyncio.CancelledError
                t_start = time.perf_counter()
                out = await agent._call(
                    env,
                    handler,
                    held.headers,
                    on_accept=on_accept,
                    progress=progress,
                    on_abandon=functools.partial(self._abandon, held),
                )
            finally:
                agent._release_slot()
        except asyncio.CancelledError:
            if waiting:
                agent._waiting -= 1  # cancelled while queued for a slot
            if held.abandoned:
                raise  # its message was settled when it was abandoned
            self._held.pop(env.task_id, None)
            _quiet(held)
            self._forget(held)
            if held.fenced:
                # Superseded while we were away (PRE_ONLINE): the result would be rejected.
                await self._settle_fenced(held.env, [held.msg, *held.extra])
            else:
                # Shutdown: left un-acked, JetStream redelivers it after ack_wait.
                self._release()
            raise
        except Exception as err:
            # Not the handler's (``_attempt`` answers for those): the step still gets an
            # outcome, its entry and ``_held`` are let go below.
            out = agent._failed_here(env, err)
        t_end = time.perf_counter()
        if held.abandoned:
            # Answered TIMEOUT (or dropped, fenced) when it was abandoned: the attempt has its
            # final status, and nothing is said of an attempt after that.
            log.warning(
                "handler of %s attempt %d returned %s at last (%.1fs after it started), "
                "after it was abandoned: dropped",
                env.task_id,
                held.env.attempt,
                "SUCCEEDED" if type(out) is bytes else typing.cast(TaskReply, out).state.value,
                t_end - t_start,
            )
            return
        agent.handled += 1
        env = held.env  # (its attempt may have moved on meanwhile: ``WorkConsumer._known``)
        duration_ms = (t_end - t_start) * 1000
        queued_ms = (t_start - t_queued) * 1000
        if type(out) is bytes:
            # A success stays the result's JSON: its final status is written around it, and
            # the idempotency record keeps that status (a ``TaskReply`` once a copy asks).
            body = self._succeeded(env, out, duration_ms, queued_ms)
            self._settle(held, TaskState.SUCCEEDED, None, body)
        else:
            reply = typing.cast(TaskReply, out)
            reply.attempt = env.attempt
            reply.duration_ms = round(duration_ms, 3)
            reply.queued_ms = round(queued_ms, 3)
            body = protocol.encode(_event(env, reply.state, agent.agent_id, reply=reply))
            self._settle(held, reply.state, reply, body)
        self._held.pop(env.task_id, None)
        _quiet(held)  # the final status implies ACCEPTED
        await self._store_final(env, held.headers, body, [held.msg, *held.extra])

    def _succeeded(
        self, env: TaskEnvelope, result: bytes, duration_ms: float, queued_ms: float
    ) -> bytes:
        """The final status of ``env``'s attempt SUCCEEDED with the result JSON ``result``, as
        ``protocol.encode`` writes its ``TaskStatusEvent`` (several times cheaper than the
        models and their serialiser). ``task_id`` and ``workflow_id`` came from the wire,
        so they are escaped; the agent id is ours."""
        task_id = _json_string(env.task_id).encode()
        where = b""
        if env.workflow_id is not None:
            where = b',"workflow_id":' + _json_string(env.workflow_id).encode()
        if env.step is not None:
            where += b',"step":%d' % env.step
        ours = self._agent._succeeded
        if result == b"null":  # (a None result is left out, as any None field)
            return _STEP_SUCCEEDED_NULL % (
                task_id,
                env.attempt,
                ours,
                where,
                duration_ms,
                queued_ms,
            )
        return _STEP_SUCCEEDED % (task_id, env.attempt, ours, where, result, duration_ms, queued_ms)

    # ------------------------------------------------------------------ what is said of it

    async def _final(
        self, env: TaskEnvelope, headers: dict[str, str], reply: TaskReply, msgs: list[Msg]
    ) -> None:
        """Publish the final status (stored by JetStream: it is also what a restart of this
        agent reads back), then ack."""
        event = _event(env, reply.state, self._agent.agent_id, reply=reply)
        await self._store_final(env, headers, protocol.encode(event), msgs)

    async def _store_final(
        self,
        env: TaskEnvelope,
        headers: dict[str, str],
        body: bytes,
        msgs: list[Msg],
    ) -> None:
        """:meth:`_final` of the final status ``body``, written already."""
        assert self._jsc is not None
        jsc = self._jsc
        subject = protocol.task_status(self._agent.agent_id, env.task_id)
        out = inject(dict(headers))
        # A repeat of this publish (retried below) is stored once; subscribers see each.
        out[protocol.HDR_MSG_ID] = self._final_msg_id(env)
        saying = self._saying.get(env.task_id)
        if saying is not None:
            # What was said of the task before goes out first: the final status must be the
            # last event stored on its subject.
            await asyncio.wait([saying])
        # Through a JetStream election (a few seconds) at once, rather than by redelivery:
        # the hub takes the first outcome it hears, so a late one may be a wasted run. The
        # first try goes without ``retrying``'s machinery (it nearly always is the only one).
        # Hedged: a stream without a leader drops a publish, and the span with a leader
        # before the next fault may be short (a hub that cannot read this status gives the
        # attempt up as lost).
        failed: list[BaseException] = []
        deadline = self._loop.time() + _FINAL_RETRY
        try:
            await jsc.publish_hedged(subject, body, out)
        except Exception as err:
            if not transient(err):
                failed.append(err)
            else:
                what = f"final status of {env.task_id}"
                log.info("%s: %s; retrying", what, describe(err))
                try:
                    await retrying(
                        what, functools.partial(jsc.publish_hedged, subject, body, out), deadline
                    )
                except Exception as again:
                    failed.append(
                        again.__cause__
                        if isinstance(again, RetriesExhausted) and again.__cause__
                        else again
                    )
        if failed:
            # The status is not durable: let JetStream redeliver; the duplicate re-publishes.
            log.warning(
                "final status of %s not stored: %r %s",
                env.task_id,
                failed[0],
                getattr(failed[0], "description", ""),
            )
            for m in msgs:
                with contextlib.suppress(Exception):
                    await m.nak(delay=1.0)
        else:
            for m in msgs:
                # The outcome is stored: the ack is not urgent (nothing waits on it), so it
                # rides along with this connection's next JetStream request (``later``).
                ack_later(jsc, m)
        self._release()

    def _final_msg_id(self, env: TaskEnvelope) -> str:
        """The final status's ``Nats-Msg-Id``: its nonce is a keyed hash of the attempt, the
        same for every repeat of the status from this process (stored once) and unlike any
        other status's (one id read gives nobody the next)."""
        attempt = protocol.attempt_msg_id(self._agent.namespace, env.task_id, env.attempt)
        nonce = self._nonce_hash.copy()  # (keyed once: a copy skips hashing the key block)
        nonce.update(attempt.encode())
        return protocol.final_msg_id(
            self._agent.namespace, env.task_id, env.attempt, nonce.hexdigest()
        )

    def _say_accepted(self, held: _Held) -> None:
        held.accepted_timer = None
        if self._held.get(held.env.task_id) is held:
            self._publish(held.env, TaskState.ACCEPTED, held.headers)

    def _publish(
        self,
        env: TaskEnvelope,
        state: TaskState,
        headers: dict[str, str],
        *,
        progress: Any = None,
    ) -> None:
        """Publish a non-final status event (core publish; the status stream captures it)."""
        agent = self._agent
        if agent._nc is None:
            return
        event = _event(env, state, agent.agent_id, progress=progress)
        task = self._loop.create_task(
            agent._nc.publish(
                protocol.task_status(self._agent.agent_id, env.task_id),
                protocol.encode(event),
                headers=inject(dict(headers)),
            )
        )
        self._saying[env.task_id] = task
        task.add_done_callback(functools.partial(self._said, env.task_id))

    def _said(self, task_id: str, task: asyncio.Future[None]) -> None:
        if self._saying.get(task_id) is task:
            del self._saying[task_id]
        _ignore(task)

    async def _tick(self) -> None:
        """One loop for every held message: +WPI and RUNNING keep-alives."""
        s = self._settings
        interval = min(s.step_running_interval, s.work_ack_wait / 3) / 2
        while True:
            await asyncio.sleep(interval)
            now = time.monotonic()
            for held in list(self._held.values()):
                if now >= held.abandon_at:
                    self._abandon(held)
                    continue
                for m in [held.msg, *held.extra]:
                    with contextlib.suppress(Exception):
                        await m.in_progress()
                if (
                    held.accepted_at is not None
                    and not held.fenced  # the hub gave it up: nothing to say of it
                    and now - held.last_running >= s.step_running_interval
                    and self._held.get(held.env.task_id) is held  # not finished meanwhile
                ):
                    held.last_running = now
                    _quiet(held)
                    self._publish(held.env, TaskState.RUNNING, held.headers)

    # ------------------------------------------------------------------ letting go

    def _abandon(self, held: _Held) -> None:
        """Let go of a step whose handler did not stop when its attempt was cancelled (by
        its deadline, or by a fence) and ``handler_abandon_grace`` has passed since: a
        handler that swallows ``CancelledError`` would otherwise keep the step RUNNING, by
        its keep-alives, to the workflow's deadline. A timed-out attempt is answered TIMEOUT
        (the hub retries it, preferably elsewhere); a fenced one is acked without a result.
        The handler keeps its slot until it returns: it still runs, and the agent's load
        says so."""
        env = held.env
        if self._held.get(env.task_id) is not held:
            return  # finished meanwhile
        del self._held[env.task_id]
        held.abandoned = True
        _quiet(held)
        agent = self._agent
        trace_id = trace_id_from_headers(held.headers)
        capability = held.capability or env.capability
        agent._told_abandoned(env, capability, trace_id, kind="step", cancelled=held.fenced)
        msgs = [held.msg, *held.extra]
        if held.fenced:
            self._forget(held)
            agent._spawn(self._settle_fenced(env, msgs))
            return
        reply = TaskReply(
            task_id=env.task_id,
            attempt=env.attempt,
            agent_id=agent.agent_id,
            state=TaskState.TIMEOUT,
            error=_abandoned_error(env.timeout),
        )
        if held.accepted_at is not None:
            reply.duration_ms = round((time.monotonic() - held.accepted_at) * 1000, 3)
        agent.handled += 1
        self._settle(held, reply.state, reply, b"")
        agent._spawn(self._final(env, held.headers, reply, msgs))

    def _settle(self, held: _Held, state: TaskState, reply: TaskReply | None, body: bytes) -> None:
        """The attempt's outcome is ``reply`` (None: the final status ``body``, a success):
        its idempotency record keeps it (if the record is still this attempt's) and whoever
        waits on it (a copy sent as a request, ``ServingMixin._duplicate``) has it."""
        entry = held.entry
        if self._agent._results.get(held.env.task_id) is entry:
            entry.attempt = held.env.attempt
            entry.finish(state, reply, body)
        waiter, entry.done = entry.done, None
        if waiter is not None and not waiter.done():
            waiter.set_result(reply or TaskReply.model_validate_json(body))

    def _forget(self, held: _Held) -> None:
        """The attempt ends without an outcome (shutdown, fenced): its idempotency record goes
        (if still this attempt's), and whoever waits on it is let go."""
        entry = held.entry
        if self._agent._results.get(held.env.task_id) is entry:
            self._agent._results.pop(held.env.task_id)
        waiter, entry.done = entry.done, None
        if waiter is not None and not waiter.done():
            waiter.cancel()

    async def _settle_fenced(self, env: TaskEnvelope, msgs: list[Msg]) -> None:
        """Ack the messages of a fenced attempt (no result: the hub moved on), and promise
        never to start it again: an ack lost on its way (JetStream electing a leader) has the
        message delivered again, and the record read then may come from a replica behind the
        hub's fence or cancel (chaos secure seed 152, ``partition``: a step cancelled as
        unneeded ran again, in full, on the same agent 5 s later)."""
        self.fences.never_start(env.task_id, env.attempt, env.workflow_id)
        for m in msgs:
            with contextlib.suppress(Exception):
                await m.ack()
        self._release()

    def _abandon_after_cancel(self, held: _Held) -> None:
        """A cancelled handler that has not stopped ``handler_abandon_grace`` from now is
        abandoned (``_abandon``)."""
        when = time.monotonic() + self._settings.handler_abandon_grace
        held.abandon_at = min(held.abandon_at, when)


def _quiet(held: _Held) -> None:
    """Drop the pending ACCEPTED status: what is said next implies it."""
    if held.accepted_timer is not None:
        held.accepted_timer.cancel()
        held.accepted_timer = None


def _event(
    env: TaskEnvelope,
    state: TaskState,
    agent_id: str,
    *,
    reply: TaskReply | None = None,
    progress: Any = None,
) -> TaskStatusEvent:
    event = TaskStatusEvent(
        task_id=env.task_id,
        attempt=env.attempt,
        agent_id=agent_id,
        state=state,
        workflow_id=env.workflow_id,
        step=env.step,
        progress=progress,
    )
    if reply is not None:
        event.result = reply.result
        event.error = reply.error
        event.cached = reply.cached
        event.duration_ms = reply.duration_ms
        event.queued_ms = reply.queued_ms
    return event


def _ignore(task: asyncio.Future[None]) -> None:
    if not task.cancelled():
        task.exception()
