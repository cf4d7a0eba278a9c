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


def settle() -> None:
    """Call once a long-running process has started (hub or agents up): collect garbage, then
    move every object that exists now — modules, pydantic schemas, connections — out of the
    collector's sight (``gc.freeze``).

    A full collection otherwise walks those ~10⁵ objects every time and stalls the event loop
    15-25 ms (measured in a hub and an agent process under load); frozen, it walks only what was
    made since. For process entry points only, like :func:`run`: an application that embeds the
    library decides its own garbage collection.
    """
    gc.collect()
    gc.freeze()
