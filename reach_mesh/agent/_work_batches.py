"""Work batches on the agent: one JetStream message holding several steps.

A hub sends an agent whose card says ``work_batch: true`` the attempts it decided for it in one
pass of its loop as one message on the agent's work subject (``reach_mesh/_work_batch.py``;
docs/protocol-workflows.md, "Work batches"). Each line is taken as if it had come alone: the
work consumer handles a :class:`BatchPart` exactly as a message of its own (duplicates, stored
results, promises, fences, the handler, its statuses), and what it does to the part's "message"
— ack, nak, term, in progress — is done to the batch's JetStream message once every part is
settled (:class:`WorkBatch`):

- every part acked or termed (its final status stored, or dropped unrun, fenced, or a
  malformed line refused): the message is acked;
- a part nak'd (its fence unreadable now, a copy of a step being checked, its final status
  not stored) while other parts are still held: it is taken again here after the delay asked,
  as a redelivery would bring it (its fence read, never skipped), while the others run on —
  a nak of the whole message would hold it back until the slowest of them ends;
- a part nak'd with no other part held (each other one settled, or itself nak'd and waiting to
  be taken again): settled so, and once every part is, the message is nak'd with the longest
  delay asked. The redelivery runs nothing that finished: each finished part is a duplicate
  then, answered from the idempotency table (its final status published again);
- a part left unsettled (the agent stops while it waits or runs): the message is neither, and
  JetStream delivers it again after ``ack_wait``, as a single step's.

``+WPI`` for any held part keeps the whole message (sent at most once per ``_WPI_EVERY``).

The pulls count messages (``PullConsumer``), and each may be a batch: a batch is taken only
if the agent, holding it, holds at most ``max_concurrency + max_queue`` steps (or holds nothing
else). One that arrives without room is nak'd unrun (``_NO_ROOM_DELAY``) — it waits in the
stream, where the hub sees its steps undelivered, as a single step waits for a pull — and
nothing more is pulled until a held message is done.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any, Final

from nats.aio.msg import Msg

from reach_mesh import _work_batch, protocol
from reach_mesh._consume import PullConsumer
from reach_mesh._jspub import JsClient
from reach_mesh.agent._fences import Behind, Delivery, Fences
from reach_mesh.errors import ReachError

if TYPE_CHECKING:
    from reach_mesh.agent._agent import Agent

__all__ = ["BatchIntake", "BatchPart", "WorkBatch", "ack_later"]

log = logging.getLogger("reach_mesh.agent.work")

#: ``+WPI`` on one batch message at most this often (s): the agent's ticker asks for every held
#: part in one go.
_WPI_EVERY: Final = 0.05
#: A batch that arrives while the agent holds too many steps to take all of its own is nak'd
#: with this delay (s): it waits in the stream, as a step does for a pull, not at the agent.
#: No delay: the next pull (after a held message is done) brings it back first, in its order — a
#: delay let later batches by and then put them back too, each waiting it out (an agent of
#: 4 + 4 ran 200 steps in batches of 4 in 1.6-1.8 s with 0.2 s, 1.13 s with none, as it
#: did holding them all).
_NO_ROOM_DELAY: Final = 0.0


class WorkBatch:
    """One work message holding ``parts`` steps: settled once each of them is."""

    __slots__ = (
        "_jsc",
        "_left",
        "_nak",
        "_spawn",
        "_wpi_at",
        "msg",
        "on_end",
        "retry",
        "waiting",
    )

    def __init__(
        self,
        msg: Msg,
        parts: int,
        jsc: JsClient | None,
        spawn: Callable[[Coroutine[Any, Any, None]], None],
    ) -> None:
        self.msg = msg
        self._left = parts
        self._jsc = jsc
        self._spawn = spawn
        #: The longest delay a part's nak asked for (None: none was nak'd).
        self._nak: float | None = None
        self._wpi_at = -1.0
        #: Called once every part is settled (the consumer stops counting what arrived
        #: behind the message then).
        self.on_end: Callable[[], None] | None = None
        #: Takes a part nak'd while others are held again after the delay (``nak``); None:
        #: every nak settles its part.
        self.retry: Callable[[BatchPart, float], None] | None = None
        #: Parts nak'd and not yet taken again (``retry``): unsettled, but not held.
        self.waiting = 0

    @property
    def settled(self) -> bool:
        return self._left <= 0

    @property
    def unsettled(self) -> int:
        """Parts not settled yet."""
        return self._left

    def settle(self, nak: float | None) -> None:
        """One part is settled: acked or termed (``nak`` None), or nak'd with that delay."""
        if nak is not None:
            self._nak = max(self._nak or 0.0, nak)
        self._left -= 1
        if self._left:
            return
        if self.on_end is not None:
            self.on_end()
        if self._nak is not None:
            self._spawn(self._nak_msg(self._nak))
        elif self._jsc is not None:
            # Every outcome is stored: nothing waits on the ack (``JsClient.ack_later``).
            self._jsc.ack_later(self.msg)
        else:
            self._spawn(self._ack_msg())

    async def _nak_msg(self, delay: float) -> None:
        with contextlib.suppress(Exception):
            await self.msg.nak(delay=delay)

    async def _ack_msg(self) -> None:
        with contextlib.suppress(Exception):
            await self.msg.ack()

    async def in_progress(self) -> None:
        now = time.monotonic()
        if self.settled or now - self._wpi_at < _WPI_EVERY:
            return
        self._wpi_at = now
        await self.msg.in_progress()


class BatchPart(Msg):
    """One step of a :class:`WorkBatch`, handled as a message of its own: its JetStream acks
    settle its share of the batch. ``reply`` is empty (nothing is ever published for a part
    alone); ``headers`` hold its ``traceparent``."""

    def __init__(self, batch: WorkBatch, traceparent: str, data: bytes) -> None:
        msg = batch.msg
        headers = {"traceparent": traceparent}
        super().__init__(_client=msg._client, subject=msg.subject, data=data, headers=headers)
        self.batch = batch
        self.traceparent = traceparent
        #: Nak'd, waiting to be taken again (counted in ``WorkBatch.waiting``).
        self._waiting = False

    def taken(self) -> None:
        """A part nak'd earlier is taken again now (``WorkBatch.retry``): held again."""
        if self._waiting:
            self._waiting = False
            self.batch.waiting -= 1

    def _settle(self, nak: float | None) -> None:
        self.taken()
        if not self._ackd:
            self._ackd = True
            self.batch.settle(nak)

    async def ack(self) -> None:
        self._settle(None)

    async def term(self) -> None:
        self._settle(None)

    async def nak(self, delay: int | float | None = None) -> None:
        batch = self.batch
        if self._ackd:
            return
        if batch.retry is not None and batch.unsettled - batch.waiting > 1:
            # Others are held: this one comes back here, not with the whole message. (Parts
            # nak'd before and waiting to come back are not: were every part to wait so,
            # none would settle, the message would never be nak'd, and each redelivery
            # after ``ack_wait`` — no part held, no ``+WPI`` — would start them all again
            # beside the ones still waiting.)
            self._ackd = True
            again = BatchPart(batch, self.traceparent, self.data)
            again._waiting = True
            batch.waiting += 1
            batch.retry(again, delay or 0.0)
            return
        self._settle(float(delay or 0.0))

    async def in_progress(self) -> None:
        await self.batch.in_progress()


def ack_later(jsc: JsClient, msg: Msg) -> None:
    """``jsc.ack_later(msg)``, for a message or a :class:`BatchPart` (whose batch is acked
    through ``jsc`` once every part is settled)."""
    if type(msg) is BatchPart:
        msg._settle(None)
    else:
        jsc.ack_later(msg)


class BatchIntake:
    """Taking work batches in (a base of ``WorkConsumer``, which sets every attribute below)."""

    _agent: Agent
    _loop: asyncio.AbstractEventLoop
    _jsc: JsClient | None
    _pull: PullConsumer | None
    fences: Fences
    #: Lines of work batches that were no step (``_work_batch.split``): refused unrun.
    malformed_lines: int
    #: Work batches nak'd unrun: their steps would have held the agent past its capacity.
    batches_put_back: int

    if TYPE_CHECKING:

        async def _handle(
            self,
            msg: Msg,
            delivery: Delivery | None,
            behind: Behind | None,
            *,
            batch: bool = False,
        ) -> None: ...

        async def _settle_marker(self, msg: Msg, *, ok: bool) -> None: ...

        def _release(self) -> None: ...

    def _on_batch(self, msg: Msg, delivery: Delivery | None, behind: Behind | None) -> None:
        """A work batch: each line handled as a message of its own. Synchronous, on arrival
        (``WorkConsumer._on_msg``): the pulls count its steps at once."""
        try:
            lines = _work_batch.split(msg.data, (msg.headers or {}).get(protocol.HDR_WORK_BATCH))
        except ReachError as err:
            log.warning("dropping a malformed work batch on %s: %s", msg.subject, err.message)
            self._agent._spawn(self._settle_marker(msg, ok=False), self._loop)
            if behind is not None:
                self.fences.forget_behind(behind)
            return
        pull = self._pull
        if pull is not None:
            others = pull.held - 1  # (this message is counted already)
            if others > 0 and others + len(lines) > pull.capacity:
                # Its steps would take the agent past ``max_concurrency + max_queue`` (the
                # pulls count messages, and each may bring a batch): left in the stream,
                # unrun, and taken again once there is room for them.
                self.batches_put_back += 1
                pull.put_back()
                self._agent._spawn(self._put_back(msg), self._loop)
                if behind is not None:
                    self.fences.forget_behind(behind)
                return
            pull.hold(len(lines) - 1)  # each part is released on its own
        batch = WorkBatch(msg, len(lines), self._jsc, self._agent._spawn)
        if behind is not None:
            batch.on_end = functools.partial(self.fences.forget_behind, behind)
        batch.retry = functools.partial(self._part_again, delivery)
        for line in lines:
            if isinstance(line, ReachError):
                self.malformed_lines += 1
                log.warning("work batch on %s: %s", msg.subject, line.message)
                batch.settle(None)  # refused: no step to run, nothing to say
                self._release()
                continue
            part = BatchPart(batch, *line)
            self._agent._spawn(self._handle(part, delivery, behind, batch=True), self._loop)

    @staticmethod
    async def _put_back(msg: Msg) -> None:
        """Give a batch with no room here back to the stream, nothing of it run (the pulls
        let go of it already: ``PullConsumer.put_back``)."""
        with contextlib.suppress(Exception):
            await msg.nak(delay=_NO_ROOM_DELAY)

    def _part_again(self, delivery: Delivery | None, part: BatchPart, delay: float) -> None:
        """Take ``part`` (nak'd while others of its batch are held) again after ``delay``, as
        a redelivery of it: its fence is read (a delivery after the first is never fresh)."""
        if self._pull is not None:
            self._pull.hold(1)  # (its nak released it)
        again = None if delivery is None else delivery._replace(delivered=delivery.delivered + 1)
        self._agent._spawn(self._again(part, again, delay), self._loop)

    async def _again(self, part: BatchPart, delivery: Delivery | None, delay: float) -> None:
        await asyncio.sleep(delay)
        part.taken()
        await self._handle(part, delivery, None, batch=True)
