"""Bounded steps of a graceful stop: a hub or an agent that is told to stop, stops.

Each step of ``close()`` (unsubscribe, hand workflows back, drain the connection, ...) gets a
time limit. A step that overruns it is logged with the name of the step and left behind
(cancelled, not awaited: ``asyncio.wait_for`` would wait for a task that ignores its
cancellation), and the stop goes on with the next step.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable
from typing import Any

__all__ = ["within"]


async def within(what: str, aw: Awaitable[Any], timeout: float, log: logging.Logger) -> None:
    """Await ``aw`` for at most ``timeout`` seconds; log and give up past it. Errors of the step
    are logged at debug level and swallowed: a stop must reach its end."""
    task = asyncio.ensure_future(aw)
    done, _ = await asyncio.wait({task}, timeout=timeout)
    if not done:
        task.cancel()
        log.warning("stop: %s did not finish within %gs; going on without it", what, timeout)
        return
    if not task.cancelled() and task.exception() is not None:
        log.debug("stop: %s failed", what, exc_info=task.exception())
