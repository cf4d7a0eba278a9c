"""What a reach-mesh connection logs about errors nats-py hands to its ``error_cb``, on a real
nats-server: an exception escaping one of our message callbacks is an ERROR with its traceback
(it was swallowed without a word before); a slow consumer's drops are a WARNING at once, then
counted; anything else while connected is one rate-limited WARNING line."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

import pytest
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from reach_mesh import MeshSettings, _nats
from reach_mesh._nats import connect

from .helpers import eventually, relayed


@pytest.fixture
async def nc(nats_url: str, caplog: pytest.LogCaptureFixture) -> AsyncIterator[NATS]:
    """A reach-mesh connection (``_nats.connect``: its ``error_cb`` is under test)."""
    caplog.set_level(logging.WARNING, logger="reach_mesh.nats")
    conn = await connect(nats_url, name="logs-test")
    yield conn
    await conn.close()


async def test_a_failing_callback_is_an_error_with_its_traceback(
    nc: NATS, caplog: pytest.LogCaptureFixture
) -> None:

    async def broken(msg: Msg) -> None:
        # As a handler with a bug would (nats-py runs it and hands the error over).
        raise KeyError(msg.subject)

    await nc.subscribe("cbtest.broken", cb=broken)
    await nc.publish("cbtest.broken", b"x")
    await nc.flush()
    await eventually(lambda: any(r.levelno == logging.ERROR for r in caplog.records))
    (record,) = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert "a NATS message callback failed" in record.getMessage()
    assert record.exc_info is not None and isinstance(record.exc_info[1], KeyError)
    # The subscription goes on.
    got: list[bytes] = []

    async def fine(msg: Msg) -> None:
        got.append(msg.data)

    await nc.subscribe("cbtest.fine", cb=fine)
    await nc.publish("cbtest.fine", b"y")
    await nc.flush()
    await eventually(lambda: got == [b"y"])


async def test_slow_consumer_drops_are_reported_then_counted(
    nc: NATS, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_nats, "_SLOW_LOG_INTERVAL", 0.3)
    release = asyncio.Event()

    async def stuck(msg: Msg) -> None:
        await release.wait()

    await nc.subscribe("cbtest.slow", cb=stuck, pending_msgs_limit=2)
    for i in range(20):
        await nc.publish("cbtest.slow", str(i).encode())
    await nc.flush()

    def lines() -> list[str]:
        return [r.getMessage() for r in caplog.records if "slow consumer" in r.getMessage()]

    await eventually(lambda: len(lines()) >= 2, timeout=5)
    first, second = lines()[:2]
    assert "a message on cbtest.slow dropped" in first
    assert "more message(s) dropped" in second and "cbtest.slow" in second
    release.set()


async def test_other_errors_while_connected_are_one_warning(
    nc: NATS, caplog: pytest.LogCaptureFixture
) -> None:
    cb: Any = nc._error_cb
    for _ in range(3):
        await cb(ValueError("raised inside nats-py, not by a reach-mesh callback"))
    warnings = [r for r in caplog.records if "NATS error" in r.getMessage()]
    assert len(warnings) == 1 and warnings[0].levelno == logging.WARNING, caplog.records
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


async def test_a_lost_connection_is_one_line_not_two(
    nats_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The server closing the socket: the ``lost NATS`` line says it — and which server of the
    configured ones it was (it named the whole list) —; nats-py's ``UnexpectedEOF`` handed to
    the error callback just before is not a second line."""
    caplog.set_level(logging.INFO, logger="reach_mesh.nats")
    relays = [(await relayed(nats_url, MeshSettings(nats_url=nats_url)))[0] for _ in range(2)]
    urls = [f"nats://127.0.0.1:{r.port}" for r in relays]
    conn = await connect(",".join(urls), name="loss-test")
    try:
        on = next(u for u in urls if u == conn.connected_url.geturl())  # type: ignore[union-attr]
        for relay in relays:
            await relay.cut()
        await eventually(lambda: not conn.is_connected, timeout=5)
        await eventually(lambda: any("lost NATS" in r.getMessage() for r in caplog.records))
        lost = [r.getMessage() for r in caplog.records if "lost NATS" in r.getMessage()]
        assert lost == [f"loss-test: lost NATS at {on}; reconnecting until it is back"], lost
        assert not [r for r in caplog.records if "NATS error" in r.getMessage()], caplog.records
    finally:
        await conn.close()


async def test_every_connection_pings_its_server_every_few_seconds(nats_url: str) -> None:
    """A server that stops answering without closing the socket is only found by PINGs:
    ``nats_ping_interval`` (2 s by default, with or without settings), three unanswered, not
    nats-py's 2 minutes (test_cluster.py freezes a node)."""
    plain = await connect(nats_url, name="ping-default")
    tuned = await connect(
        nats_url,
        name="ping-tuned",
        settings=MeshSettings(nats_url=nats_url, nats_ping_interval=0.7),
    )
    try:
        assert (plain.options["ping_interval"], plain.options["max_outstanding_pings"]) == (2.0, 3)
        assert (tuned.options["ping_interval"], tuned.options["max_outstanding_pings"]) == (0.7, 3)
    finally:
        await plain.close()
        await tuned.close()
