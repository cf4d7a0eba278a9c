"""Run a process's main coroutine on the fastest event loop available.

For process entry points only (the CLI, ``reach_mesh.agent.run``): uvloop when it is importable
(it is a dependency except on Windows; request round trips run about 1.3-1.5x faster on it),
else asyncio's own loop. It passes a loop factory to ``asyncio.Runner`` instead of installing an
event loop policy, so nothing global changes: the library itself never picks the loop of an
application that embeds it.
"""

from __future__ import annotations

import asyncio
import gc
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

__all__ = ["loop_name", "run", "settle"]

T = TypeVar("T")


def _loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    try:
        import uvloop
    except ImportError:
        return None
    factory: Callable[[], asyncio.AbstractEventLoop] = uvloop.new_event_loop
    return factory


def loop_name() -> str:
    """``"uvloop"`` or ``"asyncio"``: the loop :func:`run` uses here."""
    return "asyncio" if _loop_factory() is None else "uvloop"


def run(main: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run(main)``, on uvloop when available."""
    with asyncio.Runner(loop_factory=_loop_factory()) as runner:
        return runner.run(main)


#: Allocations between two young-generation collections (CPython's default is 700).
_YOUNG_THRESHOLD = 10_000


def settle() -> None:
    """Call once a long-running process has started (hub or agents up): collect garbage, then
    move every object that exists now — modules, pydantic schemas, connections — out of the
    collector's sight (``gc.freeze``), and collect the young generation less often.

    A full collection otherwise walks those ~10⁵ objects every time and stalls the event loop
    15-25 ms (measured in a hub and an agent process under load); frozen, it walks only what was
    made since. Nearly everything a message allocates is freed by reference counting before the
    next young collection; at CPython's default (every 700 allocations) the collector still ran
    every few messages and took ~6 % of a loaded hub's CPU. At 10,000 a young collection walks at
    most that many objects (well under a millisecond), and fanout(3) throughput rose ~6 %
    (hub -4 %, agents -9 % CPU per workflow). For process entry points only, like :func:`run`:
    an application that embeds the library decides its own garbage collection.
    """
    gc.collect()
    gc.freeze()
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(_YOUNG_THRESHOLD, older, oldest)
