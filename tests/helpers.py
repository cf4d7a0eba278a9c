"""Small helpers shared by tests (not fixtures)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable


async def eventually(
    predicate: Callable[[], bool], timeout: float = 5.0, interval: float = 0.02
) -> None:
    """Wait until ``predicate()`` is true; fail the test with a clear message otherwise."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        await asyncio.sleep(interval)
    raise AssertionError(f"condition not met within {timeout}s")
