"""nats-py's awaits that swallow a cancellation, on reach-mesh's connection (``_nats.connect``)
against a real nats-server: Python 3.11's ``asyncio.wait_for`` under ``Client.request`` (every
JetStream context and KV call) and ``Client.flush`` returns the answer when the cancel lands in
the loop iteration that brought it (CPython gh-86296), and ``Client._flush_pending`` ends in
``except asyncio.CancelledError: pass``. A task cancelled there ran on — a hub's fanout branch
cancelled as its status read was answered recorded and sent five more attempts (chaos secure
seed 184, ``node_stop``). Each await here is cancelled exactly as it completes (a done-callback
on the future it waits for: no timing), and must raise ``CancelledError``."""

from __future__ import annotations

import ast
import asyncio
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from nats.aio.client import Client as NATS
from nats.js.api import StreamConfig

import reach_mesh
from reach_mesh._cancels import uncancelled
from reach_mesh._nats import connect

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
async def conn(nats_url: str) -> AsyncIterator[NATS]:
    nc = await connect(nats_url, name="cancels")
    yield nc
    await nc.close()


class _CancelOnAnswer(dict[str, "asyncio.Future[Any]"]):
    """nats-py's ``_resp_map`` (reply token -> the request's future): the future of a request
    that ``victim`` makes cancels ``victim`` as the answer completes it."""

    victim: asyncio.Task[Any] | None = None
    answered = 0

    def __setitem__(self, token: str, future: asyncio.Future[Any]) -> None:
        task = asyncio.current_task()
        if task is not None and task is self.victim:
            future.add_done_callback(lambda _: self._cancel(task))
        super().__setitem__(token, future)

    def _cancel(self, task: asyncio.Task[Any]) -> None:
        self.answered += 1
        task.cancel()


class _CancelOnPong(list["asyncio.Future[Any]"]):
    """nats-py's ``_pongs``: the PONG a flush waits for cancels ``victim`` as it comes."""

    victim: asyncio.Task[Any] | None = None
    answered = 0

    def append(self, future: asyncio.Future[Any]) -> None:
        task = asyncio.current_task()
        if task is not None and task is self.victim:
            future.add_done_callback(lambda _: self._cancel(task))
        super().append(future)

    def _cancel(self, task: asyncio.Task[Any]) -> None:
        self.answered += 1
        task.cancel()


async def _ran_on(op: Callable[[], Awaitable[Any]], hook: _CancelOnAnswer | _CancelOnPong) -> Any:
    """Run ``op`` in a task that ``hook`` cancels as ``op``'s answer comes; what it did after
    (``"ran on"``), or ``"cancelled"``."""
    trail: list[str] = []

    async def branch() -> None:
        await op()
        trail.append("returned")
        await asyncio.sleep(0.05)  # a later await is not cancelled either
        trail.append("ran on")

    task = asyncio.ensure_future(branch())
    hook.victim = task
    try:
        await task
    except asyncio.CancelledError:
        assert task.cancelled()
        return "cancelled"
    finally:
        hook.victim = None
    return trail[-1]


async def test_a_jetstream_read_cancelled_as_it_is_answered_raises(conn: NATS) -> None:
    """``get_last_msg`` (the hub's status read, ``StatusTracker._last_stored``): its request
    waits in ``wait_for``, the answer and the cancel in one iteration."""
    js = conn.jetstream(timeout=5.0)
    stream = f"CANCELS_{uuid.uuid4().hex[:8]}"
    await js.add_stream(StreamConfig(name=stream, subjects=[f"{stream}.>"]))
    try:
        await js.publish(f"{stream}.a", b"status")
        hook = _CancelOnAnswer(conn._resp_map)
        conn._resp_map = hook
        got = await _ran_on(lambda: js.get_last_msg(stream, f"{stream}.a"), hook)
        assert hook.answered == 1, "the read was never answered"
        assert got == "cancelled", f"the task {got} through its cancel"
    finally:
        await js.delete_stream(stream)


async def test_a_flush_cancelled_as_its_pong_comes_raises(conn: NATS) -> None:
    """``Client.flush`` waits for its PONG in ``wait_for``."""
    hook = _CancelOnPong(conn._pongs)
    conn._pongs = hook
    got = await _ran_on(conn.flush, hook)
    assert hook.answered == 1, "no PONG came"
    assert got == "cancelled", f"the task {got} through its cancel"


async def test_a_publish_cancelled_in_a_forced_flush_raises(conn: NATS) -> None:
    """``Client._flush_pending``: a publish past ``pending_size`` waits for the flusher, and a
    cancel there is swallowed outright (``except CancelledError: pass``), not only in a race."""
    size = conn._max_pending_size
    conn._max_pending_size = 8  # this publish is past it: a forced flush
    trail: list[str] = []

    async def branch() -> None:
        await conn.publish("cancels.x", b"0123456789abcdef")
        trail.append("ran on")

    task = asyncio.ensure_future(branch())
    try:
        await asyncio.sleep(0)  # waiting in the forced flush
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert trail == [], trail
    finally:
        conn._max_pending_size = size


async def test_an_await_that_swallowed_a_cancel_raises_it_again() -> None:
    """``uncancelled``: a cancel an await swallowed (``wait_for``'s, here, on a future done as
    the cancel lands) is raised when the await returns; one it took back (``uncancel``, as
    ``asyncio.timeout`` does) is not."""
    loop = asyncio.get_running_loop()

    async def swallowed(inner: asyncio.Future[str]) -> str:
        return await asyncio.wait_for(inner, 5)

    async def taken_back(inner: asyncio.Future[str]) -> str:
        try:
            return await inner
        except asyncio.CancelledError:
            task = asyncio.current_task()
            assert task is not None
            task.uncancel()
            return "taken back"

    for make, wrapped, expect in [
        (swallowed, False, "answer"),  # Python 3.11's wait_for: the mechanism
        (swallowed, True, "cancelled"),
        (taken_back, True, "taken back"),
    ]:
        inner: asyncio.Future[str] = loop.create_future()
        aw = make(inner)
        task = asyncio.ensure_future(uncancelled(aw) if wrapped else aw)
        await asyncio.sleep(0)  # waiting on ``inner``
        if make is swallowed:
            inner.set_result("answer")  # the answer ...
        task.cancel()  # ... and the cancel, in one iteration
        try:
            got = await task
        except asyncio.CancelledError:
            got = "cancelled"
        assert got == expect, (make.__name__, wrapped, got)


def _wait_fors(tree: ast.AST) -> list[int]:
    """Lines of ``tree`` that name ``asyncio.wait_for`` (``asyncio.wait_for``,
    ``asyncio.tasks.wait_for``, ``from asyncio import wait_for``): calls, or a reference that
    calls it later."""
    lines: list[int] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr == "wait_for":
            base = node.value
            if isinstance(base, ast.Attribute) and base.attr == "tasks":
                base = base.value
            if isinstance(base, ast.Name) and base.id == "asyncio":
                lines.append(node.lineno)
        elif (
            isinstance(node, ast.ImportFrom)
            and node.module in ("asyncio", "asyncio.tasks")
            and any(alias.name == "wait_for" for alias in node.names)
        ):
            lines.append(node.lineno)
    return lines


def test_reach_mesh_does_not_await_in_wait_for() -> None:
    """reach-mesh's own awaits with a deadline use ``asyncio.timeout``: Python 3.11's
    ``wait_for`` swallows a cancel that lands as its awaitable completes (above)."""
    assert _wait_fors(ast.parse("import asyncio\nasyncio.wait_for(f, 1)\n")) == [2]
    assert _wait_fors(ast.parse("from asyncio import wait_for\n")) == [1]
    assert _wait_fors(ast.parse("# asyncio.wait_for(f, 1)\nx.wait_for(f)\n")) == []
    package = Path(reach_mesh.__file__).parent
    found = [
        f"{path.relative_to(package.parent)}:{line}"
        for path in sorted(package.rglob("*.py"))
        for line in _wait_fors(ast.parse(path.read_text(encoding="utf-8"), str(path)))
    ]
    assert not found, (
        f"asyncio.wait_for in reach_mesh ({', '.join(found)}): Python 3.11's wait_for swallows "
        "a cancellation that lands in the loop iteration its awaitable completes (CPython "
        "gh-86296); use `async with asyncio.timeout(t): await x` (see reach_mesh/_cancels.py's "
        "docstring)"
    )
