"""What an agent knows, without reading the hub's task record, of whether an attempt is current.

A work message's attempt may have been given up by a hub before it arrives (the agent was out of
touch, the step waited, another attempt superseded it). The hub's task record is the fence, but
reading it costs a JetStream round trip per step, so the work consumer reads it only where what
this module keeps cannot tell (:meth:`Fences.fresh`):

- **promises**: attempts this agent promised a hub never to start (a ctl ``task_state`` with
  ``fence``, a cancelled branch, or a fence marker the hub stored on the work subject);
- **what arrived behind a message**: a hub that gives up an attempt it sent stores a fence marker
  behind it on the same subject, so once the messages queued behind a first delivery have all
  arrived, a marker for it among them has made its promise (counted by :meth:`Fences.arrived`;
  :meth:`Fences.behind_of`, :meth:`Fences.wait_behind`);
- **stalls of the event loop** (a CPU-bound handler, a GC pause, SIGSTOP): a message delivered
  before one may have been given up while it waited unread (:meth:`Fences.watch`).

Everything here runs on the agent's event loop: a marker's promise and a message's arrival are
ordered by it, which is what makes giving up an attempt safe without a linearizable read.
"""

from __future__ import annotations

import asyncio
import heapq
import logging
import math
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final, NamedTuple

from nats.aio.msg import Msg

from reach_mesh import protocol
from reach_mesh.errors import ReachError
from reach_mesh.models import TaskEnvelope
from reach_mesh.workflow import TaskRecord

if TYPE_CHECKING:
    from reach_mesh.agent._agent import Agent

__all__ = ["Behind", "Delivery", "Fences", "delivery_of", "superseded"]

log = logging.getLogger("reach_mesh.agent.work")

#: How long a first delivery waits for the messages the server had queued behind it (a fence
#: marker for it would be among them) before it reads its task record instead. They are
#: usually in the same read from the socket; past this, the pull they wait for is not open.
_BEHIND_WAIT: Final = 0.05
#: The event loop is checked every ``_TICK`` seconds; later than ``_STALL`` is a stall (a CPU
#: bound handler, a GC pause, SIGSTOP): for ``_STALL_MEMORY`` after one, every fence is read
#: — a message delivered before the stall may have been given up while it waited unread.
_TICK: Final = 0.05
_STALL: Final = 0.05
_STALL_MEMORY: Final = 1.0
#: Waits kept for messages behind, settled ones included, before those are dropped.
_COMPACT_AT: Final = 256
#: Fence promises kept (task ids, oldest forgotten first). A promise forgotten early leaves the
#: hub's task record as the fence, as for an agent that does not know promises.
_PROMISES: Final = 50_000
#: Workflows whose steps one task id is promised for at once (normally one).
_PROMISE_STEPS: Final = 4
#: Attempts a hub watches again after giving them up (task ids, oldest forgotten first).
_REVIVED: Final = 10_000


class Delivery(NamedTuple):
    """What a JetStream message's ack subject says of its delivery."""

    delivered: int  # times delivered, this one included
    sseq: int  # stream sequence
    cseq: int  # consumer sequence
    pending: int  # messages stored behind it, not delivered yet, as the server counted


@dataclass(slots=True, eq=False)
class Behind:
    """A run waiting for the messages queued behind its own (:meth:`Fences.wait_behind`)."""

    sseq: int
    #: The messages the server had stored behind it, not delivered yet.
    need: int
    #: Counted arrivals (``Fences._counted``) at which every one of them has arrived.
    target: int = 0
    #: Whether they all arrived (None: not known yet). Set once: by the count, a gap, or
    #: ``forget_behind`` (False).
    result: bool | None = None
    #: Made only when a run waits for the result (usually it is known by then).
    waiter: asyncio.Future[bool] | None = None

    def settle(self, result: bool) -> None:
        if self.result is None:
            self.result = result
            waiter = self.waiter
            if waiter is not None and not waiter.done():
                waiter.set_result(result)


class Fences:
    """Promises, arrivals and stalls of one agent's work consumer (see the module docstring)."""

    def __init__(self, agent: Agent) -> None:
        self._agent = agent
        #: Attempts promised to a hub never to start: task id -> the workflow whose step it is
        #: (None: any, as a hub that did not say) -> the highest such attempt.
        self._promised: OrderedDict[str, dict[str | None, int]] = OrderedDict()
        #: Runs waiting for the messages queued behind theirs, a heap by ``Behind.target``
        #: (ties in arrival order), and the last consumer sequence received (a gap means a
        #: delivery was lost: every waiter reads its record instead). ``_counted``: the first
        #: deliveries counted so far; ``_top_sseq``: the highest stream sequence of a waiter.
        self._behind_waits: list[tuple[int, int, Behind]] = []
        self._counted = 0
        self._top_sseq = -1
        self._compact_at = _COMPACT_AT
        self._last_cseq = -1
        #: When the event loop last stalled, and when the watch last woke (loop time;
        #: ``watch``): a watch overdue is a stall going on, or just over.
        self._stalled_at = -math.inf
        self._watched_at = math.inf
        #: Attempts a hub gave up, then asked about and was told are in hand, so watches
        #: again: task id -> (the workflow whose step it is, None: any; the attempt its
        #: record names since) (``revive``).
        self._revived: OrderedDict[str, tuple[str | None, int]] = OrderedDict()
        #: Fence markers received (a hub gave up an attempt it had sent us).
        self.markers = 0
        self._loop: asyncio.AbstractEventLoop | None = None

    def _running(self) -> asyncio.AbstractEventLoop:
        """The event loop, asked once: on Python 3.11 each ``asyncio.get_running_loop()`` is
        a ``getpid`` system call, and these are asked for every step delivered."""
        loop = self._loop
        if loop is None:
            loop = self._loop = asyncio.get_running_loop()
        return loop

    # ------------------------------------------------------------------ promises

    def promised(self, task_id: str, workflow_id: str | None = None) -> int:
        """The highest attempt of ``task_id`` promised never to start, or -1 — for the step of
        ``workflow_id``: a promise made for another workflow's step of the same id (the id
        used again once its record expired) promises nothing about this one."""
        got = self._promised.get(task_id)
        if got is None:
            return -1
        if workflow_id is None:
            return max(got.values())
        return max(got.get(workflow_id, -1), got.get(None, -1))

    def never_start(self, task_id: str, attempt: int, workflow_id: str | None = None) -> None:
        """Record that attempt ``attempt`` of ``task_id`` (or an earlier one) is never to be
        started — of the step of ``workflow_id`` when given (else of any): checked on arrival
        and again before a run starts. Attempts count from 1: a lower number promises
        nothing."""
        if attempt < 1:
            return
        got = self._promised.get(task_id)
        if got is None:
            got = self._promised[task_id] = {}
        if got.get(workflow_id, -1) < attempt:
            got[workflow_id] = attempt
            while len(got) > _PROMISE_STEPS:  # one id in many workflows at once: the oldest go
                del got[next(iter(got))]
        self._promised.move_to_end(task_id)
        while len(self._promised) > _PROMISES:
            self._promised.popitem(last=False)

    def revive(self, task_id: str, recorded: int, workflow_id: str | None = None) -> None:
        """A hub that gave up an attempt of ``task_id`` (the step of ``workflow_id``, when
        given) and wrote attempt ``recorded`` to its record asked about it afterwards (ctl
        ``task_state`` with ``fence`` and ``next``) and was told it is in hand: it watches
        that attempt again (``Tracker.recheck``). Neither that record nor the marker stored
        before the ask fences it (:meth:`revived`)."""
        got = self._revived.get(task_id)
        if got is None or got[0] != workflow_id or got[1] < recorded:
            self._revived[task_id] = (workflow_id, recorded)
        self._revived.move_to_end(task_id)
        while len(self._revived) > _REVIVED:
            self._revived.popitem(last=False)

    def revived(self, env: TaskEnvelope, record: TaskRecord | None) -> bool:
        """Whether attempt ``env.attempt``, which ``record`` (or, None, a promise) fences,
        is one a hub watches again (:meth:`revive`): the record still names the attempt
        recorded when the hub asked, with no agent, undecided. Anything the hub wrote since
        (another agent, a decision, a cancel, a later fence) fences it as usual."""
        got = self._revived.get(env.task_id)
        if got is None or (got[0] is not None and got[0] != env.workflow_id):
            return False  # (a step of another workflow: the id used again)
        recorded = got[1]
        if env.attempt >= recorded:
            return False
        return record is None or (
            record.is_step(env.workflow_id, env.step)
            and record.attempt == recorded
            and record.agent_id is None
            and not record.cancelled
            and not record.state.final
        )

    def on_marker(self, msg: Msg) -> bool:
        """A fence marker: a hub gave up attempt ``n`` of the task (header ``Reach-Fence: n``,
        body ``{"task_id", "attempt", "workflow_id"?}``), its record already says so. Never
        start attempt ``n`` or an earlier one of that step from now on (a copy in hand runs on:
        the record fences its result). Synchronous, on arrival, before :meth:`arrived` counts
        the marker. False when
        malformed."""
        self.markers += 1
        try:
            body = protocol.loads(msg.data)
            task_id = protocol.validate_task_id(str(body["task_id"]))
            attempt = body["attempt"]
            if isinstance(attempt, bool) or not isinstance(attempt, int) or attempt < 1:
                raise ValueError(f"attempt {attempt!r}")
        except (ValueError, KeyError, TypeError, ReachError):
            log.warning("dropping a malformed fence marker on %s", msg.subject)
            return False
        # Of that workflow's step; a marker that names none (or no valid one) covers any.
        workflow_id = body.get("workflow_id")
        if not isinstance(workflow_id, str) or not protocol.WORKFLOW_ID_RE.fullmatch(workflow_id):
            workflow_id = None
        self.never_start(task_id, attempt, workflow_id)
        return True

    # ------------------------------------------------------------------ freshness

    def fresh(self, delivery: Delivery) -> bool:
        """Whether this run may skip its task record: a first delivery, to an agent in touch
        with the hubs (``Agent.in_touch``: not paused, not cut off; and not ``Agent.wary``:
        back lately from a silence its attempts may have been given up in) whose event loop
        has not stalled lately (``watch``: a message delivered before a stall may have been
        given up while it waited unread), provided no fence marker for it was queued behind
        it (``wait_behind``, when ``pending`` > 0).

        A hub that gives up an attempt it sent writes the record, then stores a fence marker
        on the attempt's work subject (``on_marker``); a hub that cancels a branch or takes
        a workflow over stores them again. So if this attempt had been given up by the time
        it was delivered, the marker was among the messages the server counted as pending
        behind it — or the hub, between its record write and its marker, raced the
        delivery, as a hub's write races a record read.
        """
        agent = self._agent
        if delivery.delivered != 1 or not agent.in_touch() or agent.wary():
            return False
        now = self._running().time()
        # A stall seen lately, or one going on now (the watch overdue: this pass of the loop
        # may be the first after it, ahead of the watch's own wake-up).
        return now - self._stalled_at > _STALL_MEMORY and now - self._watched_at < _TICK + _STALL

    async def watch(self) -> None:
        """Note when the event loop stalls (see ``fresh``). Runs until cancelled."""
        loop = self._running()
        while True:
            t = self._watched_at = loop.time()
            await asyncio.sleep(_TICK)
            if loop.time() - t - _TICK > _STALL:
                self._stalled_at = loop.time()

    # ------------------------------------------------------------------ what arrives behind

    def behind_of(self, delivery: Delivery | None) -> Behind | None:
        """For a first delivery with messages queued behind it, what to count of them (pass it
        to ``arrived`` with this same message, before its run starts)."""
        if delivery is None or delivery.delivered != 1 or delivery.pending <= 0:
            return None
        # (Its target is set by ``arrived``, from the count after its own arrival.)
        return Behind(delivery.sseq, delivery.pending)

    def arrived(self, delivery: Delivery | None, behind: Behind | None) -> None:
        """Count a work message or marker, in stream order, before any run: a fence marker's
        promise is in place before a step queued ahead of it is told that the messages behind
        it arrived — provided :meth:`on_marker` took the marker first (``WorkConsumer._on_msg``
        calls both in one synchronous pass). ``behind``: this message's own count
        (``behind_of``), started now — the messages behind it may be in this same read from
        the socket."""
        if delivery is None:
            return
        delivered, sseq, cseq, _ = delivery
        gap = cseq != self._last_cseq + 1
        self._last_cseq = cseq
        waits = self._behind_waits
        if gap:
            # A delivery we never got (lost with a server), or the consumer's sequence moved
            # (a new leader): what was behind cannot be counted. Read the records.
            for _, _, w in waits:
                w.settle(False)
            waits.clear()
            self._top_sseq = -1
        elif delivered == 1 and waits:
            # (A redelivery is none of the messages that were pending behind.)
            self._count_behind(sseq)
        if behind is not None:
            # Counted from the next arrival: done once ``need`` more have come.
            behind.target = self._counted + behind.need
            self._top_sseq = max(self._top_sseq, behind.sseq)
            heapq.heappush(waits, (behind.target, cseq, behind))

    def _count_behind(self, sseq: int) -> None:
        """A first delivery of stream sequence ``sseq``: one more of the messages behind each
        waiter with a lower sequence (all of them, in stream order)."""
        waits = self._behind_waits
        if sseq <= self._top_sseq:
            # Not behind every waiter (not seen in stream order, but then counted exactly):
            # the ones it is not behind need one more arrival than they did.
            for i, (target, order, w) in enumerate(waits):
                if sseq <= w.sseq:
                    w.target = target + 1
                    waits[i] = (target + 1, order, w)
            heapq.heapify(waits)
        counted = self._counted = self._counted + 1
        while waits and waits[0][0] <= counted:
            heapq.heappop(waits)[2].settle(True)
        if not waits:
            self._top_sseq = -1
            self._compact_at = _COMPACT_AT

    @staticmethod
    async def wait_behind(behind: Behind) -> bool:
        """Wait (up to ``_BEHIND_WAIT``) for the messages the server had queued behind this
        one when it delivered it: first deliveries with a higher stream sequence, with no
        consumer sequence missing in between (counted by ``arrived`` from the moment this
        one arrived). A fence marker among them has made its promise by then. False when
        they did not all arrive in time, or a delivery went missing: read the record."""
        if behind.result is not None:  # usually: they came in the same read from the socket
            return behind.result
        waiter = behind.waiter
        if waiter is None:
            waiter = behind.waiter = asyncio.get_running_loop().create_future()
        try:
            async with asyncio.timeout(_BEHIND_WAIT):
                # Shielded: the steps of a work batch share it, and one's timeout is not
                # another's.
                return await asyncio.shield(waiter)
        except TimeoutError:
            return False

    def forget_behind(self, behind: Behind) -> None:
        """Stop counting for ``behind`` (its run read its record, or ended). It stays in the
        heap, settled, until its target comes (or a gap): at most as many as were pending."""
        behind.settle(False)
        if behind.waiter is not None and not behind.waiter.done():
            behind.waiter.cancel()
        waits = self._behind_waits
        if len(waits) > self._compact_at:
            # Many runs stopped counting for messages that have not arrived (they read their
            # records instead): keep only the waits still open.
            waits[:] = [e for e in waits if e[2].result is None]
            heapq.heapify(waits)
            self._compact_at = max(_COMPACT_AT, 2 * len(waits))


def delivery_of(reply: str | None) -> Delivery | None:
    """``(delivered, stream seq, consumer seq, pending)`` from a JetStream ack subject (v1:
    ``$JS.ACK.<stream>.<consumer>.<delivered>.<sseq>.<cseq>.<ts>.<pending>``; v2 adds domain
    and account hash first and a token last), or None. ``Msg.metadata`` says the same and
    more (a datetime, the names) at a few µs per message, on the path of every step."""
    if not reply:
        return None
    tokens = reply.split(".")
    if len(tokens) == 9:
        i = 4
    elif len(tokens) >= 11:
        i = 6
    else:
        return None
    if tokens[0] != "$JS" or tokens[1] != "ACK":
        return None
    try:
        return Delivery(int(tokens[i]), int(tokens[i + 1]), int(tokens[i + 2]), int(tokens[i + 4]))
    except ValueError:
        return None


def superseded(record: TaskRecord, env: TaskEnvelope, agent_id: str) -> bool:
    """Whether the hub's task record says it moved on from this attempt: another attempt, the
    branch cancelled, the task decided, or another agent's — or the record is another
    workflow's step of the same task id (the id is that workflow's: ``REACH_TASK_ID_CONFLICT``)."""
    return (
        not record.is_step(env.workflow_id, env.step)
        or record.attempt != env.attempt
        or record.cancelled
        or record.state.final
        or (record.agent_id is not None and record.agent_id != agent_id)
    )
