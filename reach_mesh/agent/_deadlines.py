"""Handler deadlines: one timer for all of an agent's running handlers (:class:`_Deadlines`)
and the ``with`` block that arms one (:class:`_Alarm`)."""

from __future__ import annotations

import asyncio
import heapq
import itertools
import math
from collections.abc import Callable
from types import TracebackType
from typing import Any


class _Alarm:
    """One armed handler deadline (see :class:`_Deadlines`); a ``with`` block around the
    handler's ``await`` that turns the expiry's cancellation into ``TimeoutError`` exactly as
    ``asyncio.timeout()`` does."""

    __slots__ = ("_cancelling", "_deadlines", "armed", "expired", "on_abandon", "task")

    def __init__(
        self,
        deadlines: _Deadlines,
        task: asyncio.Task[Any],
        on_abandon: Callable[[], None] | None = None,
    ) -> None:
        self._deadlines = deadlines
        self.task = task
        self.armed = True
        self.expired = False
        self._cancelling = task.cancelling()
        #: Called if the handler is still running ``grace`` past its deadline.
        self.on_abandon = on_abandon

    def __enter__(self) -> None:
        return None

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self.expired:
            self._deadlines.overdue.pop(self, None)
            # Ours was the cancellation unless another one came meanwhile (shutdown): then that
            # one wins and the CancelledError goes on. The same test as asyncio.timeout's.
            if self.task.uncancel() <= self._cancelling and exc_type is asyncio.CancelledError:
                raise TimeoutError from exc
        elif self.armed:
            self.armed = False
            self._deadlines.dropped()


class _Deadlines:
    """Handler timeouts on one event-loop timer.

    ``asyncio.timeout()`` costs a ``Timeout`` object, two coroutine calls and a loop timer of
    its own per attempt (about 4.5 µs on uvloop, a tenth of an agent's CPU per request). Here
    all running attempts share one timer, set for the earliest deadline of a heap. A finished
    attempt only marks its alarm; marked alarms are dropped when they reach the top, or all at
    once when they outnumber the armed ones (so the heap stays near the number running).
    """

    __slots__ = ("_dead", "_grace", "_heap", "_loop", "_seq", "_timer", "_timer_at", "overdue")

    def __init__(self, grace: float = math.inf) -> None:
        #: How long past its deadline a handler that did not stop is abandoned (its alarm's
        #: ``on_abandon`` called): ``handler_abandon_grace``.
        self._grace = grace
        self._heap: list[tuple[float, int, _Alarm]] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = math.inf
        self._dead = 0
        self._seq = itertools.count()
        #: Handlers past their deadline that have not returned yet (cancelled, and still
        #: running: cleaning up, or ignoring the cancellation) -> when (loop time) they were
        #: cancelled: their deadline, or later when the loop ran late.
        self.overdue: dict[_Alarm, float] = {}

    def stuck(self) -> int:
        """Handlers still running ``grace`` seconds or more past their deadline."""
        if not self.overdue or self._loop is None:
            return 0
        limit = self._loop.time() - self._grace
        return sum(1 for expired in self.overdue.values() if expired <= limit)

    def arm(self, timeout: float, on_abandon: Callable[[], None] | None = None) -> _Alarm:
        """An alarm cancelling the current task ``timeout`` seconds from now (and calling
        ``on_abandon`` if the task has not stopped ``grace`` seconds later)."""
        loop = self._loop
        if loop is None:
            loop = self._loop = asyncio.get_running_loop()
        task = asyncio.current_task(loop)
        assert task is not None, "handlers run in a task"
        when = loop.time() + timeout
        alarm = _Alarm(self, task, on_abandon)
        heapq.heappush(self._heap, (when, next(self._seq), alarm))
        if when < self._timer_at:
            if self._timer is not None:
                self._timer.cancel()
            self._timer = loop.call_at(when, self._fire)
            self._timer_at = when
        return alarm

    def dropped(self) -> None:
        """An armed alarm was disarmed (its attempt ended in time)."""
        self._dead += 1
        heap = self._heap
        if self._dead > 64 and 2 * self._dead > len(heap):
            heap[:] = [item for item in heap if item[2].armed]
            heapq.heapify(heap)
            self._dead = 0

    def _abandon(self, alarm: _Alarm) -> None:
        """``grace`` past its deadline: a handler still running (it ignored its cancellation)
        is abandoned."""
        if alarm in self.overdue and alarm.on_abandon is not None:
            alarm.on_abandon()

    def _fire(self) -> None:
        loop = self._loop
        assert loop is not None
        # The loop ran the timer: its deadline counts as reached even if the clock (ms
        # resolution on uvloop) still reads a hair earlier.
        now = loop.time()
        limit = max(now, self._timer_at)
        self._timer = None
        self._timer_at = math.inf
        heap = self._heap
        while heap:
            when, _, alarm = heap[0]
            if not alarm.armed:
                heapq.heappop(heap)
                self._dead -= 1
                continue
            if when > limit:
                break
            heapq.heappop(heap)
            alarm.armed = False
            alarm.expired = True
            # The grace counts from the cancellation, not from the deadline: a loop that
            # ran late (the process frozen: SIGSTOP, a stalled VM) cancels only now, and a
            # handler that stops at once must not be taken for one that ignored it.
            cancelled = max(when, now)
            self.overdue[alarm] = cancelled
            if alarm.on_abandon is not None and self._grace < math.inf:
                loop.call_at(cancelled + self._grace, self._abandon, alarm)
            alarm.task.cancel()
        if heap:
            self._timer_at = heap[0][0]
            self._timer = loop.call_at(self._timer_at, self._fire)
