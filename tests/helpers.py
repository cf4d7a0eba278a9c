"""Small helpers shared by tests (not fixtures)."""

from __future__ import annotations

import asyncio
import time
import urllib.error
import urllib.request
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


async def fetch(
    url: str,
    method: str = "GET",
    body: bytes | None = None,
    headers: dict[str, str] | None = None,
) -> tuple[int, bytes]:
    """One HTTP request (in a thread, stdlib only): status and body, also for 4xx/5xx."""

    def call() -> tuple[int, bytes]:
        req = urllib.request.Request(url, data=body, method=method, headers=headers or {})
        try:
            with urllib.request.urlopen(req, timeout=10) as resp:
                return resp.status, resp.read()
        except urllib.error.HTTPError as err:
            return err.code, err.read()

    return await asyncio.to_thread(call)
