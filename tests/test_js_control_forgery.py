"""A forged JetStream control message on a push subscription's deliver subject makes no
reach-mesh connection publish where it says.

nats-py answers a status-100 message on a push subscription: an idle heartbeat carrying
``Nats-Consumer-Stalled: <subject>`` by publishing an empty message to that subject, a flow
control request by publishing one to its reply subject — with the subscriber's permissions
(a hub's: ``$JS.API.STREAM.DELETE.<stream>`` takes an empty body). The server's own always
name a ``$JS.FC.`` subject; ``MessageGuard._process_msg`` drops the others (refused). Both
spellings nats-py reads as status 100 are forged: the status line (``NATS/1.0 100 ...``, only
the server writes it) and a ``Status: 100`` header (any publisher's)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import nats
import pytest
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.protocol.command import hpub_cmd

from reach_mesh._nats import connect, flushed, refused_messages

from .helpers import eventually

STALLED_LINE = b"NATS/1.0 100 Idle Heartbeat\r\nNats-Consumer-Stalled: forged.target\r\n\r\n"
FLOW_LINE = b"NATS/1.0 100 FlowControl Request\r\n\r\n"


@pytest.fixture
async def ours(nats_url: str) -> AsyncIterator[NATS]:
    conn = await connect(nats_url, name="control-forgery")
    yield conn
    await conn.close()


async def _raw(nc: NATS, subject: str, reply: str, headers: bytes) -> None:
    """Publish ``headers`` as they are (nats-py writes no status line)."""
    await nc._send_command(hpub_cmd(subject, reply, headers, b""))


async def _stream(nc: NATS, name: str, subjects: list[str]) -> None:
    js = nc.jetstream()
    with_stream = [s.config.name for s in await js.streams_info()]
    if name in with_stream:
        await js.delete_stream(name)
    await js.add_stream(name=name, subjects=subjects)


@pytest.mark.parametrize("ordered", [False, True])
async def test_forged_flow_control_and_stalled_heartbeat_are_not_answered(
    ours: NATS, nc: NATS, nats_url: str, ordered: bool
) -> None:
    await _stream(nc, "FORGERY", ["forgery.>"])
    got: list[bytes] = []

    async def on_msg(msg: Msg) -> None:
        got.append(msg.data)

    js = ours.jetstream()
    if ordered:  # (what reach-mesh's own push subscriptions are)
        sub = await js.subscribe("forgery.>", cb=on_msg, ordered_consumer=True)
    else:
        sub = await js.subscribe("forgery.>", cb=on_msg, flow_control=True, idle_heartbeat=5.0)
    await nc.jetstream().publish("forgery.1", b"one")
    await eventually(lambda: got == [b"one"])  # (delivered: a flow control is answered at once)

    seen: list[str] = []

    async def spy(msg: Msg) -> None:
        seen.append(msg.subject)

    await nc.subscribe("forged.>", cb=spy)
    await flushed(nc)
    before = refused_messages(ours)

    rogue = await nats.connect(nats_url)
    try:
        # (Flow control first: nats-py takes a forged heartbeat for a gap in the consumer's
        # sequence, which resets an ordered consumer onto a new deliver subject.)
        await _raw(rogue, sub.subject, "forged.fc", FLOW_LINE)
        flow = {"Status": "100", "Description": "FlowControl Request"}
        await rogue.publish(sub.subject, b"", reply="forged.fc2", headers=flow)
        await _raw(rogue, sub.subject, "", STALLED_LINE)
        stalled = {"Status": "100", "Description": "Idle Heartbeat"}
        stalled["Nats-Consumer-Stalled"] = "forged.target2"
        await rogue.publish(sub.subject, b"", headers=stalled)
        await flushed(rogue)
    finally:
        await rogue.close()

    await asyncio.sleep(0.5)  # (an answer takes a round trip from the rogue's flush)
    assert seen == []
    await eventually(lambda: refused_messages(ours) == before + 4)
    # The subscription still delivers.
    await nc.jetstream().publish("forgery.2", b"two")
    await eventually(lambda: got == [b"one", b"two"])
    await sub.unsubscribe()


async def test_a_forged_heartbeat_does_not_end_the_read_loop(
    ours: NATS, nc: NATS, nats_url: str
) -> None:
    """nats-py takes an idle heartbeat without ``Nats-Last-Consumer`` for a gap in a
    (not ordered) push consumer's sequence and hands the error to ``_Watch.error``, whose
    ``str()`` of it raised in the read loop: the connection read nothing more."""
    await _stream(nc, "BEATING", ["beating.>"])
    got: list[bytes] = []

    async def on_msg(msg: Msg) -> None:
        got.append(msg.data)

    js = ours.jetstream()
    sub = await js.subscribe("beating.>", cb=on_msg, flow_control=True, idle_heartbeat=5.0)
    await nc.jetstream().publish("beating.1", b"one")
    await eventually(lambda: got == [b"one"])
    rogue = await nats.connect(nats_url)
    try:
        await _raw(rogue, sub.subject, "", b"NATS/1.0 100 Idle Heartbeat\r\n\r\n")
        await flushed(rogue)
    finally:
        await rogue.close()
    await nc.jetstream().publish("beating.2", b"two")
    await eventually(lambda: got == [b"one", b"two"])
    await sub.unsubscribe()


@pytest.mark.parametrize("ordered", [False, True])
async def test_genuine_flow_control_still_answered(ours: NATS, nc: NATS, ordered: bool) -> None:
    stream = f"FLOWING{int(ordered)}"
    await _stream(nc, stream, [f"flowing{int(ordered)}.>"])
    count, body = 3000, b"x" * 2048  # ~6 MB: past what the server sends before a reply
    for _ in range(count):
        await nc.publish(f"flowing{int(ordered)}.a", body)
    await flushed(nc)

    async def stored() -> bool:
        return (await nc.jetstream().stream_info(stream)).state.messages == count

    await eventually(stored)

    answers: list[str] = []

    async def spy(msg: Msg) -> None:
        answers.append(msg.subject)

    await nc.subscribe(f"$JS.FC.{stream}.>", cb=spy)
    await flushed(nc)
    before = refused_messages(ours)
    got = 0

    async def on_msg(msg: Msg) -> None:
        nonlocal got
        got += 1

    js = ours.jetstream()
    if ordered:
        sub = await js.subscribe(f"flowing{int(ordered)}.>", cb=on_msg, ordered_consumer=True)
    else:
        sub = await js.subscribe(
            f"flowing{int(ordered)}.>",
            cb=on_msg,
            flow_control=True,
            idle_heartbeat=1.0,
            manual_ack=True,
            config=nats.js.api.ConsumerConfig(ack_policy=nats.js.api.AckPolicy.NONE),
        )
    await eventually(lambda: got == count, timeout=20.0)
    assert answers, "no flow control request was answered"
    assert refused_messages(ours) == before
    await sub.unsubscribe()


@pytest.mark.parametrize("target", ["$JS.FC.forged target", "$JS.FC.forged\ttarget"])
async def test_a_stalled_heartbeat_naming_no_subject_does_not_end_the_read_loop(
    ours: NATS, nc: NATS, nats_url: str, target: str
) -> None:
    """A ``Nats-Consumer-Stalled`` under ``$JS.FC.`` with whitespace in it is no subject:
    nats-py's publish of the answer raised ``BadSubjectError`` in the read loop, which ended
    it (the connection read nothing more)."""
    await _stream(nc, "STALLING", ["stalling.>"])
    got: list[bytes] = []

    async def on_msg(msg: Msg) -> None:
        got.append(msg.data)

    js = ours.jetstream()
    sub = await js.subscribe("stalling.>", cb=on_msg, flow_control=True, idle_heartbeat=5.0)
    await nc.jetstream().publish("stalling.1", b"one")
    await eventually(lambda: got == [b"one"])
    before = refused_messages(ours)
    rogue = await nats.connect(nats_url)
    try:
        stalled = (
            b"NATS/1.0 100 Idle Heartbeat\r\nNats-Last-Consumer: 1\r\nNats-Last-Stream: 1\r\n"
            b"Nats-Consumer-Stalled: " + target.encode() + b"\r\n\r\n"
        )
        await _raw(rogue, sub.subject, "", stalled)
        await flushed(rogue)
    finally:
        await rogue.close()
    await eventually(lambda: refused_messages(ours) == before + 1)
    await nc.jetstream().publish("stalling.2", b"two")
    await eventually(lambda: got == [b"one", b"two"])
    await sub.unsubscribe()


@pytest.mark.parametrize("ordered", [False, True])
async def test_a_forged_delivery_with_a_reply_of_no_ack_does_not_end_the_read_loop(
    ours: NATS, nc: NATS, nats_url: str, ordered: bool
) -> None:
    """A message on a push subscription's deliver subject whose reply subject is no
    ``$JS.ACK.`` one: nats-py reads its metadata from the reply (an ordered consumer at once,
    another at its next idle heartbeat) and raised ``NotJSMessageError`` in the read loop."""
    prefix = f"replying{int(ordered)}"
    await _stream(nc, prefix.upper(), [f"{prefix}.>"])
    got: list[bytes] = []

    async def on_msg(msg: Msg) -> None:
        got.append(msg.data)

    js = ours.jetstream()
    if ordered:
        sub = await js.subscribe(f"{prefix}.>", cb=on_msg, ordered_consumer=True)
    else:
        sub = await js.subscribe(f"{prefix}.>", cb=on_msg, flow_control=True, idle_heartbeat=5.0)
    await nc.jetstream().publish(f"{prefix}.1", b"one")
    await eventually(lambda: got == [b"one"])
    rogue = await nats.connect(nats_url)
    try:
        await rogue.publish(sub.subject, b"forged", reply="forged.reply")
        # (The server's idle heartbeat, as it comes: nats-py checks the sequence at it.)
        beat = (
            b"NATS/1.0 100 Idle Heartbeat\r\nNats-Last-Consumer: 1\r\nNats-Last-Stream: 1\r\n\r\n"
        )
        await _raw(rogue, sub.subject, "", beat)
        await flushed(rogue)
    finally:
        await rogue.close()
    await nc.jetstream().publish(f"{prefix}.2", b"two")
    await eventually(lambda: got[-1:] == [b"two"])
    await sub.unsubscribe()


@pytest.mark.parametrize(
    "headers",
    [
        b"NATS/1.0\r\nStatus: 100\r\nDescription: Idle Heartbeat\r\n"
        b"Nats-Consumer-Stalled: $JS.API.STREAM.DELETE.STORED\r\n\r\n",
        b"NATS/1.0\r\nStatus: 100\r\nDescription: Idle Heartbeat\r\n"
        b"Nats-Consumer-Stalled: $JS.FC.a b\r\n\r\n",
        # Control messages nats-py answers under $JS.FC. or not at all: not answered
        # anywhere else, but neither delivered nor counted either (the consumer reset too).
        b"NATS/1.0\r\nStatus: 100\r\nDescription: Idle Heartbeat\r\n\r\n",
        b"NATS/1.0\r\nStatus: 100\r\nDescription: Idle Heartbeat\r\n"
        b"Nats-Consumer-Stalled: $JS.FC.x\r\n\r\n",
        b"NATS/1.0\r\nStatus: 100\r\nDescription: Anything\r\n\r\n",
    ],
    ids=["stalled", "stalled-no-subject", "idle", "idle-fc", "other"],
)
async def test_a_stored_message_dropped_unread_does_not_reset_an_ordered_consumer_forever(
    ours: NATS, nc: NATS, headers: bytes
) -> None:
    """A message stored with headers a connection drops unread (a forged control message:
    any publisher on the stream's subjects, an agent on its REACH_STATUS subjects), read by an
    ordered consumer (reach-mesh's last-per-subject reads, workflow lists): nats-py never saw
    its consumer sequence, took the next delivery for a gap and reset the consumer from before
    it — which delivered it again, dropped again, and nothing after it, ever (hundreds of
    consumers created a second)."""
    await _stream(nc, "STORED", ["stored.>"])
    await _raw(nc, "stored.forged", "", headers)
    await flushed(nc)
    await nc.jetstream().publish("stored.good", b"good")
    before = refused_messages(ours)
    got: list[bytes] = []

    async def on_msg(msg: Msg) -> None:
        got.append(msg.data)

    sub = await ours.jetstream().subscribe("stored.>", cb=on_msg, ordered_consumer=True)
    await eventually(lambda: got == [b"good"])
    await nc.jetstream().publish("stored.after", b"after")
    await eventually(lambda: got == [b"good", b"after"])
    assert refused_messages(ours) == before + 1
    await sub.unsubscribe()
