"""Cancellations an await swallowed, raised again.

Python 3.11's ``asyncio.wait_for`` returns its inner future's result when the cancellation of
the task waiting in it lands in the loop iteration that completed that future (CPython
gh-86296 / bpo-42130, fixed in 3.12 only): the ``CancelledError`` is lost and the task runs on,
though its ``cancelling()`` count says it was cancelled. nats-py awaits ``wait_for`` under
every request (``Client.request``, and with it every call of a JetStream context or KV bucket
made through it) and in ``Client.flush``; its ``Client._flush_pending`` even ends in ``except
asyncio.CancelledError: pass``, which swallows a cancel wherever it suspends (a forced flush, a
full flusher queue). A hub's step cancelled while it read the status stream, its answer just
in, ran on for 23 s through five new attempts (chaos secure seed 184, ``node_stop``).

:func:`uncancelled` raises the
``CancelledError`` again when the task's ``cancelling()`` count rose during the await but the
await returned: a cancel that came in it, and did not come out of it. A cancel taken back
inside it (``Task.uncancel``, as ``asyncio.timeout`` does) leaves the count as it was and is
not raised. ``reach_mesh._nats._Connection`` applies it to nats-py's swallowing awaits, so every
connection reach-mesh makes (hub, agent, client) has them raise a cancel as any await does.

reach-mesh's own code bounds an await with ``async with asyncio.timeout(t): await x``, never
``asyncio.wait_for`` (``tests/test_nats_cancels.py`` holds it to that): on 3.11 the timeout's
cancel is delivered at the await itself, so a cancel of the task that comes with the answer is
raised there, and it is the timeout's own cancel alone that becomes ``TimeoutError``. Unlike
``wait_for``, ``x`` runs in the awaiting task, not a task of its own: an await in ``x`` that
swallows a cancel swallows the caller's, so such an ``x`` is awaited through
:func:`uncancelled` (nats-py's ``drain``; a caller's own nats-py connection, which is no
``_Connection``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

__all__ = ["uncancelled"]

T = TypeVar("T")


async def uncancelled(aw: Awaitable[T]) -> T:
    """``await aw``, raising ``CancelledError`` if the task was cancelled during it and ``aw``
    swallowed that (returned a result, or raised something else)."""
    task = asyncio.current_task()
    before = 0 if task is None else task.cancelling()
    try:
        got = await aw
    except asyncio.CancelledError:
        raise
    except BaseException:
        _raise_swallowed(task, before)  # (converted into another error: the cancel comes first)
        raise
    _raise_swallowed(task, before)
    return got


def _raise_swallowed(task: asyncio.Task[object] | None, before: int) -> None:
    """Raise ``CancelledError`` if ``task`` was cancelled since its ``cancelling()`` count was
    ``before`` and that cancellation was not raised (an await returned in spite of it)."""
    if task is not None and task.cancelling() > before:
        raise asyncio.CancelledError("a cancellation an await swallowed, raised again")
