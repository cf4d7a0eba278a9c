"""Counting the messages queued behind a step (``Fences.behind_of``, ``arrived``,
``wait_behind``, ``forget_behind``), without a server.

A first delivery with ``pending`` messages stored behind it waits (briefly) until that many
later first deliveries — of a higher stream sequence, no consumer sequence missing — have
arrived; a gap settles every wait False. The waits are kept in a heap by the arrival count at
which each is done; these tests hold it to the plain definition (a list walked on every
arrival, as it was counted before), over random delivery sequences.
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass
from typing import Any

import pytest

from reach_mesh.agent._fences import Behind, Delivery, Fences


@dataclass(eq=False)
class _Wait:
    sseq: int
    need: int
    result: bool | None = None


class _Plain:
    """The definition: every counted arrival walks every open wait."""

    def __init__(self) -> None:
        self.waits: list[_Wait] = []
        self.last_cseq = -1

    def arrived(self, d: Delivery, wait: _Wait | None) -> None:
        gap = d.cseq != self.last_cseq + 1
        self.last_cseq = d.cseq
        if gap:
            for w in self.waits:
                if w.result is None:
                    w.result = False
            self.waits = []
        elif d.delivered == 1:
            left = []
            for w in self.waits:
                if d.sseq > w.sseq:
                    w.need -= 1
                if w.need <= 0:
                    if w.result is None:
                        w.result = True
                else:
                    left.append(w)
            self.waits = left
        if wait is not None:
            self.waits.append(wait)

    def forget(self, wait: _Wait) -> None:
        if wait in self.waits:
            self.waits.remove(wait)
        if wait.result is None:
            wait.result = False


def _fences() -> Fences:
    agent: Any = object()
    return Fences(agent)


def test_a_batch_is_done_when_its_last_message_arrives() -> None:
    fences = _fences()
    waits: list[Behind] = []
    for i in range(5):
        d = Delivery(1, 10 + i, 1 + i, 4 - i)
        behind = fences.behind_of(d)
        fences.arrived(d, behind)
        if behind is not None:
            waits.append(behind)
        # Nothing is settled before the last of the batch is in.
        assert all(w.result is None for w in waits) == (i < 4)
    assert [w.result for w in waits] == [True] * 4


def test_a_gap_settles_every_wait_false() -> None:
    fences = _fences()
    d = Delivery(1, 10, 1, 3)
    behind = fences.behind_of(d)
    assert behind is not None
    fences.arrived(d, behind)
    fences.arrived(Delivery(1, 11, 3, 2), None)  # consumer sequence 2 never came
    assert behind.result is False


def test_same_results_as_the_plain_count() -> None:
    for seed in range(2000):
        rnd = random.Random(seed)
        fences, plain = _fences(), _Plain()
        live: list[tuple[Behind, _Wait]] = []
        sseq = cseq = 0
        for _ in range(rnd.randint(1, 80)):
            cseq += 1 if rnd.random() < 0.95 else rnd.randint(2, 3)
            delivered = 1 if rnd.random() < 0.85 else 2
            if delivered == 1:  # mostly in stream order; now and then not
                sseq += 1 if rnd.random() < 0.9 else rnd.randint(-3, 3)
            d = Delivery(delivered, max(1, sseq), cseq, rnd.choice([0, 0, 1, 2, 3, 5, 8, 40]))
            behind = fences.behind_of(d)
            wait = None if behind is None else _Wait(d.sseq, d.pending)
            fences.arrived(d, behind)
            plain.arrived(d, wait)
            if behind is not None and wait is not None:
                live.append((behind, wait))
            if live and rnd.random() < 0.2:
                behind, wait = live.pop(rnd.randrange(len(live)))
                fences.forget_behind(behind)
                plain.forget(wait)
            for behind, wait in live:
                assert behind.result == wait.result, seed


def test_forgotten_waits_do_not_pile_up() -> None:
    """Runs that read their records instead of waiting (their messages behind never come)
    leave settled waits behind, dropped once there are many."""
    fences = _fences()
    for i in range(5000):
        d = Delivery(1, 1 + i, 1 + i, 1_000_000)
        behind = fences.behind_of(d)
        assert behind is not None
        fences.arrived(d, behind)
        fences.forget_behind(behind)
    assert len(fences._behind_waits) <= 512


async def test_a_wait_is_answered_when_the_rest_arrives() -> None:
    fences = _fences()
    d = Delivery(1, 10, 1, 1)
    behind = fences.behind_of(d)
    assert behind is not None
    fences.arrived(d, behind)
    waiting = Fences.wait_behind(behind)
    fences.arrived(Delivery(1, 11, 2, 0), None)
    assert await waiting is True
    # Not all of it in time: False.
    d = Delivery(1, 12, 3, 2)
    late = fences.behind_of(d)
    assert late is not None
    fences.arrived(d, late)
    assert await Fences.wait_behind(late) is False


async def test_a_wait_cancelled_as_it_is_answered_raises() -> None:
    """The run's task cancelled (fenced: ``Work.give_up``, or the agent stopping) in the loop
    iteration its wait is answered: the cancel is raised there. Python 3.11's ``wait_for``
    returned the answer instead, and the run went on (to its handler, fenced or not):
    ``reach_mesh._cancels``. The answer and the cancel come in one synchronous pass, as a
    consumer's read and a give-up handled in one loop iteration do: no timing."""
    fences = _fences()
    d = Delivery(1, 10, 1, 1)
    behind = fences.behind_of(d)
    assert behind is not None
    fences.arrived(d, behind)
    trail: list[object] = []

    async def run() -> None:
        trail.append(await Fences.wait_behind(behind))
        await asyncio.sleep(0)  # a later await is not cancelled either
        trail.append("ran on")

    task = asyncio.ensure_future(run())
    await asyncio.sleep(0)  # waiting for the one behind it
    assert behind.waiter is not None and not task.done()
    fences.arrived(Delivery(1, 11, 2, 0), None)  # it arrives: the answer ...
    assert behind.waiter.done()
    task.cancel()  # ... and the cancel, before the task runs again
    with pytest.raises(asyncio.CancelledError):
        await task
    assert trail == [], trail
