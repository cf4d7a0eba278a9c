"""Durable workflow steps on the agent: consume ``reach.work.<ns>.<agent_id>`` from JetStream.

For every work message (one attempt ``task_id#n`` of one step) the SDK:

1. drops it when it is a duplicate of an attempt it has (re-publishing the final status if that
   attempt is finished), answers from its stored result when an earlier attempt of the task
   SUCCEEDED, drops it when a hub gave the attempt up and we promised never to start it, and
   drops it when the hub's task record says the attempt is no longer current (fenced: another
   attempt superseded it, or the workflow no longer needs it). The record is read only where
   it can say more than the stream (``_fences.py``): a hub that gives up an attempt it sent
   stores a fence marker behind it on the same subject;
2. publishes ``DELIVERED``, ``ACCEPTED`` when the handler starts, ``RUNNING`` every
   ``step_running_interval`` while it runs (plus ``task.progress()``), then the final state,
   all on ``reach.status.<agent_id>.<task_id>`` (captured by ``REACH_STATUS``);
3. sends ``+WPI`` (in progress) while the handler runs and acks the message only after the
   final status is stored by JetStream. That status is the last event of its task's subject
   (nothing is said of an attempt after its final status): on start the agent reads the last
   event of each of its subjects back to rebuild its idempotency table.

A work batch (several steps in one message, header ``Reach-Work-Batch``: ``_work_batches.py``)
is taken line by line, each line as a message of its own.

Concurrency is the agent's own: the same semaphore and counters as request-reply tasks, and at
most ``max_concurrency + max_queue`` steps are held at once (a work batch counts its steps; one
without room for all of them is nak'd unrun: ``_work_batches.py``).

This module holds :class:`WorkConsumer`: its setup, the idempotency table it warms on start,
the intake of work messages (1.: duplicates, stored results, promises, fence checks) and what
the hub's ctl asks of it (promises, cancels, fencing after LOST). Running a step it holds, and
what is said of it (2., 3.), is its base :class:`~reach_mesh.agent._held.HeldSteps`
(``_held.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import math
import secrets
import time
from typing import TYPE_CHECKING, Final

from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from nats.js.errors import NotFoundError
from nats.js.kv import KeyValue
from pydantic import ValidationError

from reach_mesh import protocol
from reach_mesh._consume import PullConsumer, ensure_task_resources, last_per_subject
from reach_mesh._jspub import JsClient
from reach_mesh._retry import describe
from reach_mesh.agent._fences import Behind, Delivery, Fences, delivery_of, superseded
from reach_mesh.agent._held import HeldSteps, _Held
from reach_mesh.agent._leader_read import LeaderReads
from reach_mesh.agent._table import RESULT_CACHE, _Entry
from reach_mesh.agent._work_batches import BatchIntake
from reach_mesh.errors import IdentityMismatchError, NoHandlerError, ReachError
from reach_mesh.models import AgentState, ErrorBody, TaskEnvelope, TaskReply, TaskState
from reach_mesh.workflow import TaskRecord, TaskStatusEvent, stored_record

if TYPE_CHECKING:
    from reach_mesh.agent._agent import Agent

__all__ = ["WorkConsumer"]

log = logging.getLogger("reach_mesh.agent.work")

_TRACE_HEADERS: Final = ("traceparent", "tracestate", "baggage")
#: A step whose fence was read longer ago than this (it waited for a slot, or the process was
#: paused) reads it again before its handler starts: the hub may have moved on meanwhile.
_REFENCE_AFTER: Final = 0.25
#: How long (s) such a step waits before it asks again, out of touch or wary (``_fenced_since``).
_REFENCE_WAIT: Final = 0.5
#: A wary fence read (``_record``) takes the task records' stream leader's word only if it
#: heard from its replicas within this long (s): nats-server's raft heartbeat comes every
#: second. One cut off with the agent keeps leading for some ten seconds, behind.
_QUORUM_HEARD: Final = 2.0
#: How long (s) a failed check of the records' replicas answers for the wary reads that
#: follow (``_replicas_checked``).
_RECHECK_AFTER: Final = 0.25
#: What of a final status event makes the reply it announces (read back after a restart).
_REPLY_FIELDS: Final = set(TaskReply.model_fields)


class WorkConsumer(HeldSteps, BatchIntake):
    """The agent's JetStream work consumer (created by :class:`~reach_mesh.agent.Agent`)."""

    def __init__(self, agent: Agent) -> None:
        self._agent = agent
        s = agent.settings
        self._settings = s
        self._js: JetStreamContext | None = None
        self._tasks_kv: KeyValue | None = None
        # Described where ``HeldSteps`` types them: _jsc, _nonce_key, _pull, _held, _saying.
        self._jsc: JsClient | None = None
        self._nonce_key = secrets.token_bytes(32)
        self._nonce_hash = hashlib.blake2b(key=self._nonce_key, digest_size=16)
        self._pull: PullConsumer | None = None
        self._held: dict[str, _Held] = {}
        self._checking: set[str] = set()
        #: The last check that the task records' replicas caught up (``_replicas_checked``):
        #: when it was asked, its future, and when it ended (inf: not yet).
        self._replica_check: tuple[float, asyncio.Future[None], float] | None = None
        self._saying: dict[str, asyncio.Future[None]] = {}
        #: Promises never to start an attempt, what arrived behind each message, stalls.
        self.fences = Fences(agent)
        #: Wary reads whose replica check failed, read at the leader through a hub instead.
        self.leader_reads = LeaderReads(agent)
        self._ticker: asyncio.Task[None] | None = None
        self._retry: asyncio.Task[None] | None = None
        #: Duplicate deliveries of an attempt this agent already had (not run again).
        self.duplicates = 0
        self.fenced = 0
        #: Later attempts answered from a stored result without running the handler.
        self.cached = 0
        self.malformed_lines = 0
        self.batches_put_back = 0
        #: Work messages (or batch lines) whose envelope names another namespace: refused.
        self.foreign = 0
        #: Task records read before a first run (fences): only where the stream cannot tell
        #: (``Fences.fresh``).
        self.fence_reads = 0
        self._loop_watch: asyncio.Task[None] | None = None
        agent.metrics.step_counts(self.counts)

    def counts(self) -> dict[str, int]:
        """The step counters (exported as ``reach_agent_steps_dropped_total``,
        ``reach_agent_fence_reads_total``, ``reach_agent_fence_markers_total`` and
        ``reach_agent_leader_reads_total``, ``reach_agent_work_batches_put_back_total``)."""
        return {
            "fenced": self.fenced,
            "duplicate": self.duplicates,
            "cached": self.cached,
            "foreign": self.foreign,
            "malformed_line": self.malformed_lines,
            "batches_put_back": self.batches_put_back,
            "fence_reads": self.fence_reads,
            "markers": self.fences.markers,
            "leader_reads_answered": self.leader_reads.answered,
            "leader_reads_unanswered": self.leader_reads.unanswered,
        }

    def checking(self, task_id: str) -> bool:
        """True while a work message of ``task_id`` is between its arrival and its fence
        check (the agent has it; the hub's probe is answered DELIVERED)."""
        return task_id in self._checking

    def promise(self, task_id: str, attempt: int, workflow_id: str | None = None) -> bool:
        """A hub gives up ``attempt`` of ``task_id`` (ctl ``task_state`` with ``fence``):
        unless a work message of the task is in hand, promise never to start that attempt or
        an earlier one. True when promised (then the hub may send the next attempt at once).

        This is what makes giving an attempt up safe without a linearizable read of the task
        record: the promise and the arrival of the work message are ordered by this event loop
        (the arrival check in ``_handle_inner`` runs before any await), whereas the record may
        be read from a JetStream replica that has not applied the hub's fence yet.
        """
        if task_id in self._checking or task_id in self._held:
            return False
        self.fences.never_start(task_id, attempt, workflow_id)
        return True

    def give_up_queued(self, task_id: str, attempt: int, workflow_id: str | None) -> bool:
        """While the agent is wedged (``Agent.wedged``: every slot held by a handler past its
        timeout), a hub about to give up ``attempt`` of a step that waits here for a slot
        gets it back: dropped unrun, and promised never to start (the hub sends it
        elsewhere). Its task is before its handler starts, at an await: cancelled, it acks
        the message without a status (``_run``, fenced). True when given up."""
        held = self._held.get(task_id)
        if (
            held is None
            or held.accepted_at is not None
            or held.task is None
            or held.env.attempt > attempt
            or (workflow_id is not None and held.env.workflow_id != workflow_id)
            or not self._agent.wedged
        ):
            return False
        held.fenced = True
        held.task.cancel()
        self.fenced += 1
        self.fences.never_start(task_id, attempt, workflow_id)
        return True

    async def start(self) -> None:
        """Set up the consumer. JetStream may be briefly unavailable (a cluster electing a
        leader): then the agent still starts — request-reply is core NATS — and the consumer
        is set up in the background; steps wait in the stream meanwhile."""
        self._loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(max(self._settings.connect_timeout, 5.0)):
                await self._prepare()
            await self._open()
        except (TimeoutError, Exception) as err:
            log.warning(
                "workflow steps not available yet on %s (%r): retrying in the background",
                self._agent.agent_id,
                err,
            )
            self._retry = asyncio.create_task(self._setup_later(), name="reach-work-setup")

    async def _setup_later(self) -> None:
        delay = 0.5
        while True:
            await asyncio.sleep(delay)
            try:
                async with asyncio.timeout(10.0):
                    await self._prepare()
                await self._open()
            except (TimeoutError, Exception) as err:
                log.debug("work consumer setup failed: %r", err)
                delay = min(delay * 2, 5.0)
                continue
            log.info("workflow steps available on %s", self._agent.agent_id)
            return

    async def _prepare(self) -> None:
        """The JetStream side: the task resources and this agent's work consumer (bounded in
        time by the caller: JetStream may be electing a leader)."""
        agent = self._agent
        s = self._settings
        js = self._js = agent.nc.jetstream(timeout=10.0)
        if self._jsc is None:
            self._jsc = JsClient(agent.nc)
            await self._jsc.start()
        self._tasks_kv = await ensure_task_resources(js, s)
        capacity = agent.max_concurrency + agent.max_queue
        durable = protocol.work_consumer(agent.agent_id)
        # The agent creates its own consumer (idempotent): a step published before we ever
        # started waits in the work-queue stream and is delivered from the start. Named, so
        # the filter travels in the API subject ($JS.API.CONSUMER.CREATE.<stream>.<name>.
        # <filter>), where NATS permissions hold an agent to its own work subject.
        await js.add_consumer(
            protocol.STREAM_WORK,
            ConsumerConfig(
                name=durable,
                durable_name=durable,
                filter_subject=protocol.work_subject(agent.namespace, agent.agent_id),
                ack_policy=AckPolicy.EXPLICIT,
                deliver_policy=DeliverPolicy.ALL,
                ack_wait=s.work_ack_wait,
                max_deliver=-1,
                max_ack_pending=max(capacity * 2, 64),
                inactive_threshold=s.workflow_retention,
            ),
        )

    async def _open(self) -> None:
        """Warm the idempotency table (not bounded by the setup's time: it grows with what
        this agent ran within ``workflow_retention``), then start pulling steps."""
        agent = self._agent
        capacity = agent.max_concurrency + agent.max_queue
        durable = protocol.work_consumer(agent.agent_id)
        await self._load_results()
        if self._pull is not None:  # (a try before failed past this point)
            await self._pull.stop()
        self._pull = PullConsumer(
            agent.nc,
            protocol.STREAM_WORK,
            durable,
            self._on_msg,
            capacity,
            expires=5.0,
            on_gone=self._consumer_gone,
        )
        await self._pull.start()
        self._ticker = asyncio.create_task(self._tick(), name="reach-work-ticker")
        self._loop_watch = asyncio.create_task(self.fences.watch(), name="reach-loop-watch")

    async def _consumer_gone(self) -> None:
        """Nobody serves this agent's work consumer (its pulls answered 503) for a while. During
        an election its leader is being chosen: it exists, and the pulls go on. Gone (deleted
        by hand, with its stream, or idle past ``inactive_threshold``), it is created again
        here — as at start: no step would reach this agent otherwise, while its heartbeats
        say it is fine."""
        assert self._js is not None
        durable = protocol.work_consumer(self._agent.agent_id)
        try:
            await self._js.consumer_info(protocol.STREAM_WORK, durable, timeout=5.0)
            return
        except NotFoundError:
            pass
        except Exception as err:
            # No answer (an election: the stream or the meta group has no leader yet; NATS
            # unreachable): it may well be there, and the pulls go on; asked again at the next
            # check. Once an ERROR with a traceback, per agent and election (the chaos suite's
            # node_kill).
            log.info(
                "cannot tell now whether the work consumer of %s is there (%s): pulling on",
                self._agent.agent_id,
                describe(err),
            )
            return
        try:
            async with asyncio.timeout(10.0):
                await self._prepare()
        except Exception as err:  # its stream gone too, and no right to create it: hubs do
            log.warning(
                "the work consumer of %s is gone, and cannot be created again yet (%s): "
                "workflow steps do not reach it",
                self._agent.agent_id,
                describe(err),
            )
            return
        log.warning(
            "the work consumer of %s was gone (deleted, or its stream was): created again",
            self._agent.agent_id,
        )

    async def flush(self) -> None:
        """Send the acks still waiting to ride along (``JsClient.later``)."""
        if self._jsc is not None:
            await self._jsc.flush_later()

    async def stop(self) -> None:
        """Stop taking new steps (in-flight ones finish through the agent's drain; their final
        statuses go out through ``_jsc``, whose subscription ends with the connection's drain).
        Their keep-alives go on until :meth:`stop_keepalives`, after the drain."""
        if self._retry is not None:
            self._retry.cancel()
            self._retry = None
        if self._pull is not None:
            await self._pull.stop()
        if self._loop_watch is not None:
            self._loop_watch.cancel()
            self._loop_watch = None

    async def stop_keepalives(self) -> None:
        """Stop the ``+WPI`` and RUNNING keep-alives of held steps: once the agent's drain is
        over (a step still running through it must keep its ack deadline, or JetStream
        redelivers it — to another process of the same agent id in a rolling deploy)."""
        if self._ticker is not None:
            self._ticker.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._ticker
            self._ticker = None

    async def _load_results(self) -> None:
        """Warm the idempotency table from ``REACH_STATUS``: the last event of each of this
        agent's tasks, where it is a final status, is the outcome it gave (a restart keeps it)."""
        assert self._js is not None
        agent = self._agent
        try:
            # Its own subjects only: what NATS permissions allow an agent in secure mode.
            # The newest as many as the table keeps (older ones would be pushed out).
            msgs = await last_per_subject(
                self._js,
                protocol.STREAM_STATUS,
                protocol.task_status(agent.agent_id, "*"),
                keep=RESULT_CACHE,
                name=protocol.status_consumer(agent.agent_id),
            )
        except Exception:
            log.warning("cannot load the final statuses of %s", agent.agent_id, exc_info=True)
            return
        for msg in msgs:
            try:
                event = TaskStatusEvent.model_validate_json(msg.data)
            except ValidationError:
                continue
            if not event.state.final or event.agent_id != agent.agent_id:
                continue
            reply = TaskReply.model_validate(event.model_dump(include=_REPLY_FIELDS))
            owner = None if event.workflow_id is None else (event.workflow_id, event.step)
            agent._remember(
                reply.task_id, _Entry(reply.attempt, reply.state, reply=reply, owner=owner)
            )

    # ------------------------------------------------------------------ receiving

    def _on_msg(self, msg: Msg) -> None:
        # In stream order, before any task runs (``Fences.arrived``).
        delivery = delivery_of(msg.reply)
        behind: Behind | None = None
        headers = msg.headers
        if headers and protocol.HDR_FENCE in headers:
            marker = self.fences.on_marker(msg)
            self._agent._spawn(self._settle_marker(msg, ok=marker), self._loop)
        elif headers and protocol.HDR_WORK_BATCH in headers:
            behind = self.fences.behind_of(delivery)
            self._on_batch(msg, delivery, behind)
        else:
            behind = self.fences.behind_of(delivery)
            self._agent._spawn(self._handle(msg, delivery, behind), self._loop)
        self.fences.arrived(delivery, behind)

    async def _drop(self, msg: Msg) -> None:
        """Drop a work message unrun: its attempt is fenced (acked, counted, no status)."""
        self.fenced += 1
        with contextlib.suppress(Exception):
            await msg.ack()
        self._release()

    async def _handle(
        self, msg: Msg, delivery: Delivery | None, behind: Behind | None, *, batch: bool = False
    ) -> None:
        """``batch``: ``msg`` is a part of a work batch, whose parts share ``behind`` (let go
        of when the last part is settled: ``WorkBatch.on_end``)."""
        try:
            await self._handle_inner(msg, delivery, behind)
        except Exception:
            log.exception("work message failed on %s", self._agent.agent_id)
            with contextlib.suppress(Exception):
                await msg.nak(delay=1.0)
            self._release()
        finally:
            if behind is not None and not batch:
                self.fences.forget_behind(behind)  # on every early return too

    async def _handle_inner(
        self, msg: Msg, delivery: Delivery | None, behind: Behind | None
    ) -> None:
        """``behind``: what arrived behind it so far, when the server had messages queued
        behind it (``_on_msg``)."""
        agent = self._agent
        try:
            env = protocol.decode(
                msg.data, TaskEnvelope, max_size=self._settings.max_payload + 16 * 1024
            )
        except ReachError:
            log.warning("dropping a malformed work message on %s", msg.subject)
            with contextlib.suppress(Exception):
                await msg.term()
            self._release()
            return
        if env.namespace != agent.namespace:
            # Its subject is this agent's namespace's: a step of another would run unfenced
            # (a fresh delivery reads no record), or read that namespace's task record for
            # its fence (in secure mode a read the server refuses: nak'd, again and again,
            # its whole batch with it).
            mismatch = IdentityMismatchError(
                f"work message for namespace {env.namespace!r} on {agent.agent_id}",
                field="namespace",
                value=env.namespace,
                expected=agent.namespace,
            )
            log.warning("dropping a work message on %s: %s", msg.subject, mismatch.message)
            self.foreign += 1
            with contextlib.suppress(Exception):
                await msg.term()
            self._release()
            return
        if env.attempt <= self.fences.promised(env.task_id, env.workflow_id) and not (
            delivery is not None and delivery.delivered > 1 and self.fences.revived(env, None)
        ):
            # A hub gave this attempt up and we promised never to start it (see ``promise``)
            # — unless it asked again after its fence and was told the attempt is in hand, and
            # this is a copy sent again (its fence read failed): its record decides, read
            # below (a copy sent again always reads it).
            await self._drop(msg)
            return
        # Only the trace context travels on: the JetStream headers (Nats-Msg-Id, expected
        # stream) belong to the work message, not to the status events we publish.
        headers = _trace_headers(msg.headers)
        entry = agent._results.get(env.task_id)
        if entry is not None and _another_step(entry, env):
            # The task id was another workflow's step (a caller-chosen id used again after its
            # record expired): not this step's outcome. A new task once that one is over.
            if entry.reply is None:
                with contextlib.suppress(Exception):
                    await msg.nak(delay=0.5)
                self._release()
                return
            agent._results.pop(env.task_id)
            entry = None
        if entry is not None and await self._known(msg, env, headers, entry):
            return
        if env.task_id in self._checking:
            # A second copy while the first is between its fence check and its start: let it
            # come back in a moment, when the first is known (then it is a duplicate).
            with contextlib.suppress(Exception):
                await msg.nak(delay=0.2)
            self._release()
            return
        checked_at = time.monotonic()
        record: TaskRecord | None = None
        fences = self.fences
        read = delivery is None or not fences.fresh(delivery)
        if behind is not None:
            # Messages were queued behind it: a fence marker for it may be one of them.
            pull = self._pull
            if not read and (pull is None or behind.need > pull.open):
                read = True  # the pulls cannot bring them all now: do not hold the slot waiting
            if not read:
                self._checking.add(env.task_id)
                try:
                    # ... and still fresh after the wait (a stall may have begun meanwhile).
                    arrived = await fences.wait_behind(behind)
                    read = not arrived or delivery is None or not fences.fresh(delivery)
                finally:
                    self._checking.discard(env.task_id)
            fences.forget_behind(behind)
        if read and env.workflow_id is not None and not await agent.back_in_touch():
            # Out of touch with the hubs, and no hub answers now: its record, read here,
            # may be behind their fence (``Agent.back_in_touch``). JetStream brings it again.
            with contextlib.suppress(Exception):
                await msg.nak(delay=0.5)
            self._release()
            return
        if read:
            ok, record = await self._read_fence(msg, env)
            if not ok:
                return
        if (
            record is not None
            and self._fenced(env, record)
            and fences.revived(env, None)
            and not superseded(record, env, agent.agent_id)
        ):
            # Fenced by a promise only, with a record read before the fence of a hub that then
            # asked and was told the attempt is in hand (the read was going on): its marker is
            # that promise. The record as it stands now says whether anything fenced it since.
            ok, record = await self._read_fence(msg, env)
            if not ok:
                return
        if self._fenced(env, record):
            # Fenced before it ran: the hub moved on (another attempt, cancelled, finished),
            # as its record, a marker behind it or a cancel meanwhile says — unless the hub
            # asked after its fence and was told it is in hand (``Fences.revive``). Promised
            # too, unless the record read is older than the attempt (a replica behind): a
            # copy delivered again (this ack lost) may read a replica behind the fence.
            if record is None or record.attempt >= env.attempt:
                fences.never_start(env.task_id, env.attempt, env.workflow_id)
            await self._drop(msg)
            return
        handler = agent._pick_handler(env.capability)
        if handler is None:
            err = NoHandlerError(
                f"{agent.agent_id} has no handler for {env.capability!r}",
                agent_id=agent.agent_id,
            )
            # The final status implies DELIVERED.
            await self._final(
                env,
                headers,
                TaskReply(
                    task_id=env.task_id,
                    attempt=env.attempt,
                    agent_id=agent.agent_id,
                    state=TaskState.FAILED,
                    error=ErrorBody(code=err.code, message=err.message, details=err.details),
                ),
                [msg],
            )
            return
        owner = None if env.workflow_id is None else (env.workflow_id, env.step)
        entry = _Entry(env.attempt, TaskState.DELIVERED, owner=owner)
        agent._remember(env.task_id, entry)
        held = _Held(msg=msg, env=env, headers=headers, entry=entry, checked_at=checked_at)
        self._held[env.task_id] = held
        if agent._running >= agent.max_concurrency:
            # It waits for a slot: say it is in hand. With a slot free the handler starts in
            # this same pass and ACCEPTED implies DELIVERED (one status message fewer).
            self._publish(env, TaskState.DELIVERED, headers)
        held.task = asyncio.current_task(self._loop)
        await self._run(held, handler)

    async def _read_fence(self, msg: Msg, env: TaskEnvelope) -> tuple[bool, TaskRecord | None]:
        """``(True, the step's record)``, read with the attempt marked as in hand meanwhile
        (``checking``); ``(False, None)`` when it cannot be read now: the message comes again
        later (nak'd), never run unfenced."""
        self._checking.add(env.task_id)
        try:
            return True, await self._record(env)
        except Exception as exc:
            # The fence cannot be read (JetStream electing a leader, a reconnect): never run
            # unfenced — the step may be decided already. JetStream redelivers it.
            log.info("task record of %s unreadable (%r): retrying it later", env.task_id, exc)
            with contextlib.suppress(Exception):
                await msg.nak(delay=0.5)
            self._release()
            return False, None
        finally:
            self._checking.discard(env.task_id)

    def _fenced(self, env: TaskEnvelope, record: TaskRecord | None) -> bool:
        """Whether ``record`` (None: not read) or a promise fences this attempt, and no hub
        watches it again after asking (``Fences.revived``)."""
        fences = self.fences
        return (
            (record is not None and superseded(record, env, self._agent.agent_id))
            or env.attempt <= fences.promised(env.task_id, env.workflow_id)
        ) and not fences.revived(env, record)

    async def _settle_marker(self, msg: Msg, *, ok: bool) -> None:
        """Ack a fence marker (term a malformed one); it carries no step."""
        with contextlib.suppress(Exception):
            await (msg.ack() if ok else msg.term())
        self._release()

    async def _known(
        self, msg: Msg, env: TaskEnvelope, headers: dict[str, str], entry: _Entry
    ) -> bool:
        """A task this agent has seen. True when handled here (not run again)."""
        held = self._held.get(env.task_id)
        if entry.reply is None:
            # Still running (an earlier or the same attempt).
            self.duplicates += 1
            if held is not None:
                if env.attempt > held.env.attempt:
                    # The hub re-sent while we run it: answer for the newest attempt.
                    held.env = held.env.model_copy(update={"attempt": env.attempt})
                    entry.attempt = env.attempt
                    self._publish(held.env, TaskState.DELIVERED, headers)
                    self._publish(held.env, TaskState.ACCEPTED, headers)
                    self._publish(held.env, TaskState.RUNNING, headers)
                held.extra.append(msg)
            else:
                with contextlib.suppress(Exception):
                    await msg.ack()
            self._release()
            return True
        reply = entry.reply
        if env.attempt < entry.attempt:
            # An older attempt redelivered: superseded here already.
            await self._drop(msg)
            return True
        if env.attempt == entry.attempt:
            # The same attempt again (a lost ack or status): never run it twice; repeat the
            # final status in case the hub missed it. Nothing else: within the duplicate window
            # the stream drops the repeat (same Nats-Msg-Id), and a DELIVERED stored after the
            # final would hide it from a restart and from a hub's catch-up.
            self.duplicates += 1
            await self._final(env, headers, reply.model_copy(update={"cached": True}), [msg])
            return True
        if reply.state is TaskState.SUCCEEDED:
            # A later attempt of a task that already succeeded here: the stored result.
            self.cached += 1
            entry.attempt = env.attempt
            await self._final(
                env,
                headers,
                reply.model_copy(update={"attempt": env.attempt, "cached": True}),
                [msg],
            )
            return True
        return False  # a retry of a failed attempt: run again

    async def _record(self, env: TaskEnvelope) -> TaskRecord | None:
        """The hub's task record (the fence), or None for work sent without one. Raises when
        the record cannot be read now. A direct get, answered by any replica — while the
        agent is wary (``Agent.wary``: back from a silence its attempts may have been given up
        in, the replica next to it maybe behind the fences the hubs wrote meanwhile) only once
        the records' stream leader says every replica has caught up with it
        (``JsClient.replicas_caught_up``, one check at a time for all of them:
        ``_replicas_checked``; it is no longer wary then); else as the leader has it, read
        by a hub (``LeaderReads``: the agent stays wary), or it raises when no hub answers."""
        if self._tasks_kv is None or self._jsc is None or env.workflow_id is None:
            return None
        self.fence_reads += 1
        agent = self._agent
        key = protocol.task_key(env.namespace, env.task_id)
        if not agent.wary():
            return stored_record(TaskRecord, await self._jsc.kv_get(protocol.KV_TASKS, key))
        try:
            asked_at = await self._replicas_checked()
        except Exception as check:
            return await self.leader_reads.read(self._jsc, env, check)
        self.leader_reads.passed()
        entry = await self._jsc.kv_entry(protocol.KV_TASKS, key)
        agent.caught_up(asked_at)  # (the next steps read as usual)
        return stored_record(TaskRecord, None if entry is None or entry[2] else entry[:2])

    async def _replicas_checked(self) -> float:
        """When a check that the task records' replicas caught up with their leader began,
        once it passed (raises what it raised otherwise). One ``STREAM.INFO`` at a time for
        every wary read (``_record``): back from a partition, each step waiting asks, and
        each is redelivered every 0.5 s until a check passes — a request per step and
        redelivery to the JetStream API would be a load of its own while the cluster
        recovers. A check that failed less than ``_RECHECK_AFTER`` ago answers for a new one;
        a passed one does not (it ended the wary span it was asked in), nor one asked before
        the agent's last silence (``Agent.caught_up`` would not take it)."""
        assert self._jsc is not None
        check = self._replica_check
        if (
            check is None
            or check[0] < self._agent.wary_since()
            or (
                check[1].done()
                and (
                    check[1].cancelled()
                    or check[1].exception() is None
                    or time.monotonic() - check[2] > _RECHECK_AFTER
                )
            )
        ):
            asked_at = time.monotonic()
            future = asyncio.ensure_future(
                self._jsc.replicas_caught_up(protocol.KV_TASKS, heard_within=_QUORUM_HEARD)
            )
            check = self._replica_check = (asked_at, future, math.inf)
            future.add_done_callback(self._replicas_answered)
        await asyncio.shield(check[1])
        return check[0]

    def _replicas_answered(self, future: asyncio.Future[None]) -> None:
        check = self._replica_check
        if check is not None and check[1] is future:
            self._replica_check = (check[0], future, time.monotonic())
        if not future.cancelled():
            future.exception()  # (retrieved: an awaiter may have gone meanwhile)

    async def _fenced_since(self, held: _Held) -> bool:
        """True when the step's record, read again because its first reading is old, says the
        hub moved on (another attempt, cancelled, decided). Unreadable: run it (it passed) —
        but not out of touch with the hubs, nor wary (``Agent.wary``): the step may have
        waited for its slot through a silence the hubs gave its attempt up in, and the read
        that failed is the one that would say so (a cut-off connection, the replica next to
        us behind). Then it waits, slot held, until a hub answers and the record can be
        trusted, as a first read does (``_handle_inner``: nak'd then, until back in touch)."""
        env = held.env
        if env.workflow_id is None or time.monotonic() - held.checked_at < _REFENCE_AFTER:
            return False
        agent, fences = self._agent, self.fences
        while True:
            # (A hub that asked after giving it up, and was told it is in hand, watches it
            # again, whoever else answers us: ``Fences.revive``.)
            revived = fences.revived(env, None)
            if revived or await agent.back_in_touch():
                try:
                    record = await self._record(env)
                    break
                except Exception:
                    if revived or not agent.wary():
                        return False
            await asyncio.sleep(_REFENCE_WAIT)
        return (
            record is not None
            and superseded(record, env, agent.agent_id)
            and not fences.revived(env, record)
        )

    # ------------------------------------------------------------------ cancelled by a hub

    def cancel(self, task_id: str, attempt: int, workflow_id: str | None = None) -> bool:
        """The hub no longer needs this attempt (an ``any``/``quorum`` branch past its policy)
        of the step of ``workflow_id`` (any, when None): stop its handler and ack the message
        without a result. Returns whether it was held."""
        held = self._held.get(task_id)
        if held is not None and workflow_id is not None and held.env.workflow_id != workflow_id:
            held = None  # another workflow's step of the same id: not what is cancelled
        if held is None:
            entry = self._agent._results.get(task_id)
            if workflow_id is not None and entry is not None and entry.owner is not None:
                entry = entry if entry.owner[0] == workflow_id else None
            if entry is None or entry.running or entry.attempt < attempt:
                # Not here yet (still in the stream, or never sent, or its fence being read):
                # never start it. (One we finished is not run again anyway: idempotency.)
                self.fences.never_start(task_id, attempt, workflow_id)
            return False
        if held.env.attempt != attempt:
            return False
        held.fenced = True
        if held.task is not None:
            held.task.cancel()
        self._abandon_after_cancel(held)
        self.fenced += 1
        return True

    # ------------------------------------------------------------------ fencing after LOST

    async def fence_stale(self) -> int:
        """Back after being declared LOST (the agent is PRE_ONLINE): cancel every attempt the
        hubs have superseded meanwhile, so no stale result is even produced. Returns how many
        were fenced; the agent registers again afterwards."""
        agent = self._agent
        agent.state = AgentState.PRE_ONLINE
        fenced = 0
        for held in list(self._held.values()):
            record = await self._record(held.env)
            if (
                record is not None
                and superseded(record, held.env, agent.agent_id)
                and not self.fences.revived(held.env, record)
            ):
                held.fenced = True
                if held.task is not None:
                    held.task.cancel()
                self._abandon_after_cancel(held)
                fenced += 1
        self.fenced += fenced
        if fenced:
            log.warning("%s fenced %d stale attempt(s) before rejoining", agent.agent_id, fenced)
        return fenced


def _trace_headers(headers: dict[str, str] | None) -> dict[str, str]:
    out: dict[str, str] = {}
    if headers:
        for key in _TRACE_HEADERS:
            value = headers.get(key)
            if value is not None:
                out[key] = value
    return out


def _another_step(entry: _Entry, env: TaskEnvelope) -> bool:
    """Whether ``entry`` was remembered for a step of another workflow, another step, or a
    request-reply task (no owner) of the same id, when ``env`` is a workflow step."""
    return env.workflow_id is not None and entry.owner != (env.workflow_id, env.step)
