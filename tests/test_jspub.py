"""The engine's JetStream publisher against a real nats-server: acks, deduplication, KV
compare-and-set, and the errors ``_retry`` tells apart (an answer vs the infrastructure)."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import nats
import nats.errors
import pytest
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.errors import MaxPayloadError
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, StreamConfig
from nats.js.errors import (
    APIError,
    BadRequestError,
    KeyNotFoundError,
    KeyWrongLastSequenceError,
    NoStreamResponseError,
    NotFoundError,
)

from reach_mesh import _jspub
from reach_mesh._consume import _FULL_FOR, PullConsumer
from reach_mesh._inline import Inline
from reach_mesh._jspub import JsClient
from reach_mesh._nats import ensure_kv
from reach_mesh._retry import RetriesExhausted, no_message, transient
from reach_mesh.hub import _durable
from reach_mesh.hub._durable import infrastructure
from tests.helpers import eventually


async def test_acks_dedup_cas_and_errors(nats_url: str) -> None:
    nc = await nats.connect(nats_url)
    pub = JsClient(nc, timeout=2.0)
    await pub.start()
    name = f"JSPUB_{uuid.uuid4().hex[:8]}"
    js = nc.jetstream()
    try:
        await js.add_stream(StreamConfig(name=name, subjects=[f"{name.lower()}.>"]))
        subject = f"{name.lower()}.a"
        first = await pub.publish(subject, b"one", {"Nats-Msg-Id": "m1"})
        again = await pub.publish(subject, b"one", {"Nats-Msg-Id": "m1"})
        assert (first.stream, first.seq, first.duplicate) == (name, 1, False)
        assert again.duplicate and again.seq == 1
        # The expected-stream header: an answer (refused), not an infrastructure error.
        with pytest.raises(BadRequestError) as refused:
            await pub.publish(subject, b"x", {"Nats-Expected-Stream": "OTHER"})
        assert not transient(refused.value)
        # No stream takes the subject: NATS' 503, which is retried.
        with pytest.raises(NoStreamResponseError) as nobody:
            await pub.publish(f"nostream.{uuid.uuid4().hex}", b"x")
        assert transient(nobody.value)

        bucket = f"jspub_{uuid.uuid4().hex[:8]}"
        kv = await ensure_kv(js, bucket)  # direct gets allowed, as every reach bucket
        rev = await pub.kv_write(bucket, "k", b"v1", 0)
        assert (await kv.get("k")).value == b"v1"
        with pytest.raises(KeyWrongLastSequenceError):
            await pub.kv_write(bucket, "k", b"v2", 0)  # exists already
        with pytest.raises(KeyWrongLastSequenceError):
            await pub.kv_write(bucket, "k", b"v2", rev + 5)
        rev2 = await pub.kv_write(bucket, "k", b"v2", rev)
        assert rev2 > rev and (await kv.get("k")).value == b"v2"
        # Direct gets: the value and its revision; absent, deleted and empty keys are None.
        assert await pub.kv_get(bucket, "k") == (b"v2", rev2)
        assert await pub.kv_get(bucket, "missing") is None
        # ... and with when the server stored it (its clock: this host's, here).
        stored = await pub.kv_get_stored(bucket, "k")
        assert stored is not None and stored[:2] == (b"v2", rev2)
        assert stored[2] is not None and abs(stored[2] - time.time()) < 2.0, stored
        assert await pub.kv_get_stored(bucket, "missing") is None
        await kv.put("empty", b"")
        assert await pub.kv_get(bucket, "empty") is None
        await kv.delete("k")
        assert await pub.kv_get(bucket, "k") is None
        assert await pub.kv_get_stored(bucket, "k") is None
        # ... though kv_entry shows its delete marker and the marker's revision.
        marker = await pub.kv_entry(bucket, "k")
        assert marker is not None and marker[2] and marker[1] > rev2
        assert await pub.kv_entry(bucket, "missing") is None
        assert await pub.kv_entry(bucket, "empty") is None
        # The leader's reading is the same (what a compare-and-set is decided by).
        assert await pub.kv_entry_at_leader(bucket, "k") == marker
        assert await pub.kv_entry_at_leader(bucket, "missing") is None
        assert await pub.kv_entry_at_leader(bucket, "empty") is None
        with pytest.raises(NotFoundError) as no_stream:
            await pub.kv_entry_at_leader(f"nobucket_{uuid.uuid4().hex[:8]}", "k")
        assert not no_message(no_stream.value)  # the stream, not the key: never "no record"
        # A create writes over a delete marker, and is refused by a live value.
        far = asyncio.get_running_loop().time() + 5
        made = await _durable.create(_durable.Bucket(bucket, pub), "k", b"v3", far)
        assert await pub.kv_get(bucket, "k") == (b"v3", made)
        with pytest.raises(KeyWrongLastSequenceError):
            await _durable.create(_durable.Bucket(bucket, pub), "k", b"v4", far)
        await js.delete_key_value(bucket)
    finally:
        await pub.stop()
        with pytest.raises(nats.errors.ConnectionClosedError):
            await pub.publish("any", b"")  # stopped: refused at once
        await js.delete_stream(name)
        await nc.close()


async def test_later_rides_along_in_order_or_leaves_after_the_linger(nats_url: str) -> None:
    """``later``: held until the next request (and sent before it, in order), else sent once
    the linger is over, and never lost by ``stop``."""
    nc = await nats.connect(nats_url)
    pub = JsClient(nc, timeout=2.0, linger=0.2)
    await pub.start()
    name = f"JSLATER_{uuid.uuid4().hex[:8]}"
    js = nc.jetstream()
    watcher = await nats.connect(nats_url)
    seen: list[bytes] = []

    async def on_msg(msg: Msg) -> None:
        seen.append(msg.data)

    sub = await watcher.subscribe(f"{name.lower()}.>", cb=on_msg)
    await watcher.flush()
    try:
        await js.add_stream(StreamConfig(name=name, subjects=[f"{name.lower()}.>"]))
        pub.later(f"{name.lower()}.ev", b"e1")
        pub.later(f"{name.lower()}.ev", b"e2")
        await asyncio.sleep(0.05)
        assert seen == []  # held: no request yet, the linger is not over
        ack = await pub.publish(f"{name.lower()}.w", b"w1")
        # They went first, in order: the stream stored them before the request's message.
        assert ack.seq == 3
        await eventually(lambda: seen == [b"e1", b"e2", b"w1"])
        # Alone: out once the linger is over.
        pub.later(f"{name.lower()}.ev", b"e3")
        await eventually(lambda: seen[-1:] == [b"e3"], timeout=2.0)
        # Stop sends what is held at once: held by a client whose linger (60 s) outlasts the
        # wait, e4 arrives only if ``stop`` sent it (not 0.15 s against a 0.2 s linger: a
        # loaded box can take longer than that to carry any message to the watcher).
        holding = JsClient(nc, timeout=2.0, linger=60.0)
        await holding.start()
        holding.later(f"{name.lower()}.ev", b"e4")
        await holding.stop()
        await eventually(lambda: seen[-1:] == [b"e4"], timeout=10)
        assert seen == [b"e1", b"e2", b"w1", b"e3", b"e4"]
        await js.delete_stream(name)
    finally:
        await pub.stop()
        await sub.unsubscribe()
        await watcher.close()
        await nc.close()


async def test_ack_later_acks_with_the_next_flush(nats_url: str) -> None:
    """``ack_later``: the JetStream ack leaves with the next flush, not before."""
    nc = await nats.connect(nats_url)
    pub = JsClient(nc, timeout=2.0, linger=5.0)
    await pub.start()
    name = f"JSACK_{uuid.uuid4().hex[:8]}"
    js = nc.jetstream()
    try:
        await js.add_stream(StreamConfig(name=name, subjects=[f"{name.lower()}.>"]))
        await pub.publish(f"{name.lower()}.a", b"x")
        sub = await js.pull_subscribe(f"{name.lower()}.a", durable="d")
        (msg,) = await sub.fetch(1, timeout=2)
        pub.ack_later(msg)
        await nc.flush()
        assert (await sub.consumer_info()).num_ack_pending == 1  # held, not sent
        await pub.flush_later()

        async def acked() -> bool:  # the server applies an ack a moment after reading it
            return (await sub.consumer_info()).num_ack_pending == 0

        await eventually(acked, timeout=2)
        await js.delete_stream(name)
    finally:
        await pub.stop()
        await nc.close()


async def test_send_leaves_now_behind_what_later_holds_and_raises_when_it_cannot(
    nats_url: str,
) -> None:
    """``send`` (a workflow's ``.done``): out at once, after the messages ``later`` holds, in
    order — written to the socket when it returns, not queued for nats-py's flusher to write
    after the caller's code that follows (a workflow's caller waits on it); unlike theirs, its
    failure is raised (the hub then hands the workflow back instead of acking a result nobody
    was told)."""
    nc = await nats.connect(nats_url)
    pub = JsClient(nc, timeout=2.0, linger=5.0)
    await pub.start()
    subject = f"jssend.{uuid.uuid4().hex[:8]}"
    got = await nc.subscribe(subject)
    try:
        pub.later(subject, b"event")
        await pub.send(subject, b"done")
        assert nc.pending_data_size == 0  # both written, not left for the flusher's pass
        assert [(await got.next_msg(timeout=2)).data for _ in range(2)] == [b"event", b"done"]
        await pub.stop()
        await nc.close()
        pub.later(subject, b"event")
        with pytest.raises(nats.errors.ConnectionClosedError):
            await pub.send(subject, b"done")
    finally:
        await pub.stop()
        await nc.close()


async def test_answers_are_taken_as_they_are_read(nats_url: str) -> None:
    """A client's answers (acks, reads) wake their waiters from nats-py's reader, not from a
    subscription task of their own a pass of the loop later: starting one starts no task. An
    answer nobody waits for is dropped, and one whose handling fails leaves the reader
    reading."""
    nc = await nats.connect(nats_url)
    pub = JsClient(nc, timeout=2.0)
    before = asyncio.all_tasks()
    await pub.start()
    try:
        assert asyncio.all_tasks() - before == set()
        await nc.publish(pub._prefix + "nobody", b"stray")
        name = f"JSANS_{uuid.uuid4().hex[:8]}"
        js = nc.jetstream()
        await js.add_stream(StreamConfig(name=name, subjects=[f"{name.lower()}.>"]))
        assert (await pub.publish(f"{name.lower()}.a", b"x")).seq == 1
        await js.delete_stream(name)
    finally:
        await pub.stop()
        await nc.close()

    def fail(msg: Msg) -> None:
        raise RuntimeError(msg.subject)

    failing = Inline(fail)
    failing.set_result(Msg(nc, subject="x"))  # logged, not raised into the reader
    assert not failing.done() and not failing.cancelled()


async def test_ask_has_an_unguessable_reply_and_knows_no_responders(nats_url: str) -> None:
    """``JsClient.ask``: a plain request whose reply subject carries 64 random bits (not a
    nats-py NUID); nobody listening is ``NoRespondersError``, not an empty answer."""
    nc = await nats.connect(nats_url)
    jsc = JsClient(nc, timeout=2.0)
    await jsc.start()
    subject = f"ask.{uuid.uuid4().hex}"
    seen: list[str] = []

    async def echo(msg: Msg) -> None:
        seen.append(msg.reply)
        await msg.respond(msg.data)

    try:
        with pytest.raises(nats.errors.NoRespondersError):
            await jsc.ask(subject, b"x", timeout=2)
        sub = await nc.subscribe(subject, cb=echo)
        await nc.flush()
        assert (await jsc.ask(subject, b"one", timeout=2)).data == b"one"
        assert (await jsc.ask(subject, b"two", timeout=2)).data == b"two"
        await sub.unsubscribe()
        nuid = nc.new_inbox().rpartition(".")[2]
        for reply in seen:
            prefix, _, token = reply.rpartition(".")
            assert len(token) == 16 and int(token, 16) >= 0  # 64 random bits
            assert nuid[:12] not in prefix  # nats-py's NUID generator is nowhere in it
    finally:
        await jsc.stop()
        await nc.close()


async def test_requests_time_out_at_their_deadlines_on_one_timer(nats_url: str) -> None:
    """Unanswered requests time out when their own timeouts run out, in order or not (a
    shorter one made after a longer one gets a timer of its own); answered ones leave the
    queue of deadlines, and one timer serves it."""
    nc = await nats.connect(nats_url)
    jsc = JsClient(nc, timeout=1.0)
    await jsc.start()
    silent = f"silent.{uuid.uuid4().hex}"
    subject = f"echo.{uuid.uuid4().hex}"

    async def echo(msg: Msg) -> None:
        await msg.respond(msg.data)

    async def timed(coro: Any) -> tuple[float, BaseException | None]:
        t0 = asyncio.get_running_loop().time()
        try:
            await coro
            err = None
        except Exception as e:
            err = e
        return asyncio.get_running_loop().time() - t0, err

    sub = await nc.subscribe(silent)  # listens, never answers
    echo_sub = await nc.subscribe(subject, cb=echo)
    try:
        await nc.flush()
        got = await asyncio.gather(
            timed(jsc.request(silent, b"a")),
            timed(jsc.request(subject, b"b")),
            timed(jsc.request(silent, b"c", timeout=0.15)),
            timed(jsc.request(silent, b"d")),
        )
        (ta, ea), (tb, eb), (tc, ec), (td, ed) = got
        # Bounds from what they tell apart, not from a quiet machine's timing: the short one
        # served by the long ones' timer would end at 1.0 s, not 0.15 s; a timer not set again
        # after the answered one left the queue, never. 0.5 s to spare either way for a loaded
        # box (it was 0.2 s against a 0.4 s timeout: one stall of the loop away from failing).
        assert eb is None and tb < 0.5
        for took, err, want in ((ta, ea, 1.0), (tc, ec, 0.15), (td, ed, 1.0)):
            assert isinstance(err, nats.errors.TimeoutError)
            assert want - 0.01 <= took < want + 0.5
        assert not jsc._futures
        await eventually(lambda: not jsc._deadlines and jsc._deadline_timer is None)
    finally:
        await sub.unsubscribe()
        await echo_sub.unsubscribe()
        await jsc.stop()
        await nc.close()


@contextlib.asynccontextmanager
async def _pulling(
    nats_url: str, capacity: int
) -> AsyncIterator[tuple[NATS, JetStreamContext, str, list[Msg], PullConsumer]]:
    """A stream of its own with a durable ``c``, pulled by a started ``PullConsumer`` of
    ``capacity`` that hands its messages to the list yielded."""
    nc = await nats.connect(nats_url)
    js = nc.jetstream()
    name = f"PULL_{uuid.uuid4().hex[:8]}"
    got: list[Msg] = []
    pull = PullConsumer(nc, name, "c", got.append, capacity)
    try:
        await js.add_stream(StreamConfig(name=name, subjects=[f"{name.lower()}.>"]))
        await js.add_consumer(name, ConsumerConfig(durable_name="c", ack_policy=AckPolicy.EXPLICIT))
        await pull.start()
        yield nc, js, name, got, pull
    finally:
        await pull.stop()
        await nc.close()


async def test_pull_consumer_takes_only_jetstream_deliveries(nats_url: str) -> None:
    """Its inbox is unguessable, and a message published into it (not a delivery: no
    ``$JS.ACK`` reply subject) is dropped, never handed over nor acked."""
    from reach_mesh._guard import refused_total

    async with _pulling(nats_url, 4) as (nc, js, name, got, pull):
        inbox = pull._inbox
        assert len(inbox.rpartition(".")[2]) == 16
        refused = refused_total()
        await nc.publish(inbox, b"forged", reply=f"$KV.x.{name}")
        await nc.publish(inbox, b"forged")
        await js.publish(f"{name.lower()}.a", b"real")
        await eventually(lambda: len(got) == 1)
        assert got[0].data == b"real" and got[0].reply.startswith("$JS.ACK.")
        assert refused_total() == refused + 2


async def test_a_pull_consumer_pulls_nothing_after_a_put_back_until_room_frees(
    nats_url: str,
) -> None:
    """A message given back for want of room (``put_back``: a work batch larger than what is
    left) leaves the pulls stopped until a held message is released — the next one would
    most likely be given back too, every pull — or, should none be, for ``_FULL_FOR``."""

    async with _pulling(nats_url, 2) as (_, js, name, got, pull):
        for body in (b"held", b"no room"):
            await js.publish(f"{name.lower()}.a", body)
        await eventually(lambda: len(got) == 2)
        pull.put_back()  # "no room": given back (nak'd: it comes back)
        await got[1].nak()
        await js.publish(f"{name.lower()}.a", b"next")
        await asyncio.sleep(0.6)  # (past a watchdog tick)
        assert len(got) == 2
        await got[0].ack()
        pull.release()  # room: pulled again
        await eventually(lambda: len(got) == 4)
        assert sorted(m.data for m in got[2:]) == [b"next", b"no room"]
        for msg in got[2:]:
            await msg.ack()
        pull.release()
        pull.release()
        # No release ever comes: the watchdog pulls again after _FULL_FOR all the same.
        for body in (b"full", b"full too"):  # (what the open pulls bring)
            await js.publish(f"{name.lower()}.a", body)
        await eventually(lambda: len(got) == 6)
        pull.put_back()
        pull.put_back()
        await js.publish(f"{name.lower()}.a", b"later")
        await asyncio.sleep(_FULL_FOR / 2)
        assert len(got) == 6
        await eventually(lambda: len(got) == 7, timeout=_FULL_FOR + 2)


def test_a_publish_still_in_process_is_asked_again_not_an_answer() -> None:
    """JetStream's 409 "duplicate message id is in process" (err_code 10158): a publish with
    the same Nats-Msg-Id is still being stored — its stream leader froze or changed while it
    was proposed (chaos node_stop). Asked again it is stored or answered as a duplicate; taken
    for an answer it ended steps FAILED ("step crashed")."""
    with pytest.raises(APIError) as in_process:
        APIError.from_error(
            {"code": 409, "err_code": 10158, "description": "duplicate message id is in process"}
        )
    assert transient(in_process.value)
    with pytest.raises(APIError) as other_409:
        APIError.from_error({"code": 409, "err_code": 10999, "description": "something else"})
    assert not transient(other_409.value)


def test_what_hands_a_workflow_back_instead_of_becoming_an_outcome() -> None:
    """``_durable.infrastructure``: the errors a workflow step is never decided by — the
    infrastructure's, and NATS's own answers that pass (a replica behind, a write in process,
    the ingest back-pressure's 429) — but not the size the server always refuses, nor a bug."""
    with pytest.raises(APIError) as too_many:
        APIError.from_error({"code": 429, "err_code": 10167, "description": "too many requests"})
    assert transient(too_many.value)
    assert infrastructure(too_many.value)
    assert infrastructure(KeyNotFoundError())  # nats-py's Key* errors carry no API fields
    assert not transient(KeyNotFoundError())
    assert infrastructure(RetriesExhausted("write k"))
    assert not infrastructure(MaxPayloadError())
    assert not infrastructure(ValueError("a bug"))


async def _scripted_replica(nc: NATS, bucket: str, answer: list[bool]) -> list[str]:
    """A replica of a bucket no stream serves (so nothing else answers), on a real server:
    the n-th direct get it is asked is answered (value, revision 7) if ``answer[n]``; never,
    like a frozen node's, otherwise. Returns the requests' reply subjects as they come."""
    asked: list[str] = []

    async def replica(msg: Msg) -> None:
        n = len(asked)
        asked.append(msg.reply)
        if n < len(answer) and answer[n]:
            await nc.publish(msg.reply, b"value", headers={"Nats-Sequence": "7"})

    await nc.subscribe(f"$JS.API.DIRECT.GET.KV_{bucket}.>", cb=replica)
    await nc.flush()
    return asked


async def test_a_direct_get_not_answered_is_asked_again(nats_url: str) -> None:
    """The first try goes unanswered: the read is asked again after ``HEDGE_AFTER`` and the
    second answer is the read's; nothing is left waiting, and no hedge is counted after."""
    nc = await nats.connect(nats_url)
    try:
        asked = await _scripted_replica(nc, "hedgeonce", [False, True])
        jsc = JsClient(nc, timeout=2.0)
        await jsc.start()
        t = asyncio.get_running_loop().time()
        assert await jsc.kv_get("hedgeonce", "k") == (b"value", 7)
        took = asyncio.get_running_loop().time() - t
        assert len(asked) == 2 and asked[0] != asked[1]  # two requests, two reply tokens
        assert _jspub.HEDGE_AFTER <= took < 1.0, took
        await asyncio.sleep(0)  # the cancelled first try's callbacks
        assert jsc._futures == {} and jsc._hedging == 0
        await jsc.stop()
    finally:
        await nc.close()


async def test_a_read_nobody_answers_holds_one_hedge_not_all(
    nats_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A read asked again every ``HEDGE_AFTER`` holds one of the client's ``HEDGES_MAX``, not
    one per try: while a read nobody answers goes on (here for 3 s), another read whose first
    try is lost is still asked again at once. (With a slot per try the first read held them
    all within half a second, and the second waited for its deadline.)"""
    monkeypatch.setattr(_jspub, "HEDGES_MAX", 2)
    nc = await nats.connect(nats_url)
    try:
        asked: dict[str, int] = {}

        async def replica(msg: Msg) -> None:
            key = msg.subject.rsplit(".", 1)[-1]
            asked[key] = asked.get(key, 0) + 1
            if key == "b" and asked[key] > 1:  # "a" never; "b" from its second try on
                await nc.publish(msg.reply, b"value", headers={"Nats-Sequence": "7"})

        await nc.subscribe("$JS.API.DIRECT.GET.KV_hedgeshare.>", cb=replica)
        await nc.flush()
        jsc = JsClient(nc, timeout=3.0)
        await jsc.start()
        stuck = asyncio.ensure_future(jsc.kv_get("hedgeshare", "a"))
        await asyncio.sleep(0.8)  # "a" has been asked four times
        loop = asyncio.get_running_loop()
        t = loop.time()
        assert await jsc.kv_get("hedgeshare", "b") == (b"value", 7)
        assert loop.time() - t < 0.6
        assert not stuck.done() and asked["b"] == 2
        with pytest.raises(nats.errors.TimeoutError):
            await stuck
        assert jsc._futures == {} and jsc._hedging == 0
        await jsc.stop()
    finally:
        await nc.close()


async def test_hedges_are_capped_and_a_read_nobody_answers_times_out(
    nats_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With ``HEDGES_MAX`` hedges already out, a read is not asked again; a read nobody
    answers raises ``nats.errors.TimeoutError`` at the client's timeout, as before."""
    nc = await nats.connect(nats_url)
    try:
        asked = await _scripted_replica(nc, "hedgecap", [])
        jsc = JsClient(nc, timeout=0.6)
        await jsc.start()
        monkeypatch.setattr(_jspub, "HEDGES_MAX", 0)
        with pytest.raises(nats.errors.TimeoutError):
            await jsc.kv_get("hedgecap", "k")
        assert len(asked) == 1
        monkeypatch.setattr(_jspub, "HEDGES_MAX", 16)
        with pytest.raises(nats.errors.TimeoutError):
            await jsc.kv_get("hedgecap", "k")
        assert len(asked) == 1 + 3  # at 0, 0.25 and 0.5 s; the next (0.75 s) is past 0.6 s
        await asyncio.sleep(0)
        assert jsc._futures == {} and jsc._hedging == 0
        await jsc.stop()
    finally:
        await nc.close()


async def _scripted_stream(nc: NATS, subject: str, answers: list[bytes | None]) -> list[str]:
    """What answers publishes on ``subject`` (no stream serves it), on a real server: the n-th
    publish is answered ``answers[n]``, or never (a leader frozen or gone) where it is None or
    past the list. Returns the publishes' reply subjects as they come."""
    asked: list[str] = []

    async def leader(msg: Msg) -> None:
        n = len(asked)
        asked.append(msg.reply)
        if n < len(answers) and answers[n] is not None:
            await nc.publish(msg.reply, answers[n] or b"")

    await nc.subscribe(subject, cb=leader)
    await nc.flush()
    return asked


_IN_PROCESS = (
    b'{"error":{"code":400,"err_code":10158,"description":"duplicate message id is in process"}}'
)


async def test_a_hedged_publish_is_sent_again_until_one_try_is_stored(nats_url: str) -> None:
    """Unanswered, it is sent again after ``PUBLISH_HEDGE_AFTER``; "in process" (an earlier try
    is being stored) is not its answer: the next try's ack is. A stream's own refusal is
    raised at once; tries nobody answers end at the timeout, with nothing left waiting."""
    nc = await nats.connect(nats_url)
    try:
        ack = b'{"stream":"S","seq":9}'
        asked = await _scripted_stream(nc, "hedged.once", [None, _IN_PROCESS, ack])
        jsc = JsClient(nc, timeout=3.0)
        await jsc.start()
        loop = asyncio.get_running_loop()
        t = loop.time()
        got = await jsc.publish_hedged("hedged.once", b"x", {"Nats-Msg-Id": "m1"}, every=0.2)
        assert got == _jspub.Ack("S", 9, False)
        assert len(asked) == 3 and len(set(asked)) == 3  # three tries, three reply tokens
        assert 0.4 <= loop.time() - t < 1.5
        assert jsc._futures == {} and jsc._publishing == {}

        refusal = b'{"error":{"code":400,"err_code":10060,"description":"expected stream"}}'
        asked = await _scripted_stream(nc, "hedged.refused", [None, refusal])
        with pytest.raises(APIError) as refused:
            await jsc.publish_hedged("hedged.refused", b"x", {"Nats-Msg-Id": "m2"}, every=0.2)
        assert refused.value.err_code == 10060 and len(asked) == 2

        asked = await _scripted_stream(nc, "hedged.never", [])
        t = loop.time()
        with pytest.raises(nats.errors.TimeoutError):
            await jsc.publish_hedged(
                "hedged.never", b"x", {"Nats-Msg-Id": "m3"}, every=0.2, timeout=1.0
            )
        assert 1.0 <= loop.time() - t < 1.5 and 5 <= len(asked) <= 6
        assert jsc._futures == {} and jsc._publishing == {} and jsc._publish_hedging == 0
        # Past ``PUBLISH_HEDGES_MAX`` publishes sending again, one waits for its first try.
        jsc._publish_hedging = _jspub.PUBLISH_HEDGES_MAX
        asked = await _scripted_stream(nc, "hedged.capped", [])
        with pytest.raises(nats.errors.TimeoutError):
            await jsc.publish_hedged(
                "hedged.capped", b"x", {"Nats-Msg-Id": "m4"}, every=0.2, timeout=1.0
            )
        assert len(asked) == 1 and jsc._publish_hedging == _jspub.PUBLISH_HEDGES_MAX
        jsc._publish_hedging = 0
        await jsc.stop()
    finally:
        await nc.close()


async def test_a_hedged_publish_answered_no_responders_is_sent_again(nats_url: str) -> None:
    """A try answered "no responders" (503: in an election no server has interest in the
    stream's subjects yet) is not the publish's answer: the next try, once the subject is
    served again, is stored. Only when every try until the timeout got a 503 is it raised."""
    nc = await nats.connect(nats_url)
    try:
        jsc = JsClient(nc, timeout=3.0)
        await jsc.start()
        loop = asyncio.get_running_loop()

        async def served_later() -> list[str]:
            await asyncio.sleep(0.5)
            return await _scripted_stream(nc, "hedged.elected", [b'{"stream":"S","seq":4}'])

        serving = asyncio.ensure_future(served_later())
        t = loop.time()
        got = await jsc.publish_hedged("hedged.elected", b"x", {"Nats-Msg-Id": "n1"}, every=0.2)
        assert got == _jspub.Ack("S", 4, False)
        assert 0.5 <= loop.time() - t < 1.5
        assert len(await serving) == 1  # the tries before it got 503s; one reached it
        assert jsc._futures == {} and jsc._publishing == {} and jsc._publish_hedging == 0

        t = loop.time()
        with pytest.raises(NoStreamResponseError):
            await jsc.publish_hedged(
                "hedged.nobody", b"x", {"Nats-Msg-Id": "n2"}, every=0.2, timeout=1.0
            )
        assert 0.8 <= loop.time() - t < 1.5
        assert jsc._futures == {} and jsc._publishing == {} and jsc._publish_hedging == 0
        await jsc.stop()
    finally:
        await nc.close()


async def test_a_hedged_publishs_first_try_answered_late_or_at_once(nats_url: str) -> None:
    """The first try waits on the client's one hedge timer, not one of its own: answered at
    once, it is sent once and leaves nothing waiting; answered only after the publish sent
    again, its answer still counts (its future was replaced under the same reply token). A
    shorter ``every`` than those queued still wakes on time."""
    nc = await nats.connect(nats_url)
    try:
        jsc = JsClient(nc, timeout=3.0)
        await jsc.start()
        loop = asyncio.get_running_loop()
        ack = b'{"stream":"S","seq":4}'
        asked = await _scripted_stream(nc, "hedged.fast", [ack, ack])
        got = await jsc.publish_hedged("hedged.fast", b"x", {"Nats-Msg-Id": "f1"}, every=0.2)
        assert got == _jspub.Ack("S", 4, False) and len(jsc._hedges) == 1
        await asyncio.sleep(0.3)  # past its ``every``: nothing sent again, the queue drained
        assert len(asked) == 1 and not jsc._hedges and jsc._hedge_timer is None

        first: list[str] = []

        async def slow_leader(msg: Msg) -> None:
            first.append(msg.reply)
            if len(first) == 2:  # answers the first try once it was sent again, never the others
                await nc.publish(first[0], b'{"stream":"S","seq":5,"duplicate":false}')

        await nc.subscribe("hedged.late", cb=slow_leader)
        await nc.flush()
        t = loop.time()
        got = await jsc.publish_hedged("hedged.late", b"x", {"Nats-Msg-Id": "f2"}, every=0.5)
        # Answered when the second try arrived (not after a fixed 0.35 s, 0.05 s before a
        # third try at 0.4 s: one slow trip through a loaded server away from three tries):
        # ``every`` for the answer to come back before a third.
        assert got == _jspub.Ack("S", 5, False) and len(first) == 2
        assert 0.5 <= loop.time() - t < 1.0

        # A shorter ``every`` than the one queued before it (a timer of its own).
        never = await _scripted_stream(nc, "hedged.short", [])
        await _scripted_stream(nc, "hedged.long", [])
        slow = asyncio.create_task(
            jsc.publish_hedged("hedged.long", b"x", {"Nats-Msg-Id": "f3"}, every=2.0)
        )
        await asyncio.sleep(0.05)
        with pytest.raises(nats.errors.TimeoutError):
            await jsc.publish_hedged(
                "hedged.short", b"x", {"Nats-Msg-Id": "f4"}, every=0.1, timeout=1.0
            )
        # Ten tries on time; on the long one's timer (2 s), one. Each try is timed from the
        # one before (a late wake delays the rest): at least five leaves a loaded loop 0.5 s
        # of lateness in all (three of four in 0.35 s left it 0.15 s).
        assert 5 <= len(never) <= 10, never
        slow.cancel()
        with pytest.raises(asyncio.CancelledError):
            await slow
        assert jsc._futures == {} and jsc._publishing == {} and jsc._publish_hedging == 0
        await jsc.stop()
    finally:
        await nc.close()


async def test_a_hedged_publish_takes_an_answer_in_hand_and_resends_an_error_later(
    nats_url: str,
) -> None:
    """An answer that came as the hedge fired (the new future already resolved) is taken at
    once, nothing sent again; a first try answered "in process" is sent again ``every``
    after it, not at once (a try at once mostly earns the same answer)."""
    nc = await nats.connect(nats_url)
    try:
        jsc = JsClient(nc, timeout=3.0)
        await jsc.start()
        loop = asyncio.get_running_loop()
        asked = await _scripted_stream(nc, "hedged.inhand", [])
        hedge_one = jsc._hedge_one

        def hedge_then_answer(token: str) -> None:
            hedge_one(token)
            fresh = jsc._futures.get(token)
            if fresh is not None and not fresh.done():
                ack = b'{"stream":"S","seq":7}'
                fresh.set_result(Msg(_client=nc, subject="x", reply="", data=ack, headers=None))

        jsc._hedge_one = hedge_then_answer  # type: ignore[method-assign]
        t = loop.time()
        got = await jsc.publish_hedged("hedged.inhand", b"x", {"Nats-Msg-Id": "h1"}, every=0.2)
        assert got == _jspub.Ack("S", 7, False)
        assert len(asked) == 1 and loop.time() - t < 0.35
        jsc._hedge_one = hedge_one  # type: ignore[method-assign]

        times: list[float] = []

        async def leader(msg: Msg) -> None:
            times.append(loop.time())
            answer = _IN_PROCESS if len(times) == 1 else b'{"stream":"S","seq":8}'
            await nc.publish(msg.reply, answer)

        await nc.subscribe("hedged.busy", cb=leader)
        await nc.flush()
        got = await jsc.publish_hedged("hedged.busy", b"x", {"Nats-Msg-Id": "h2"}, every=0.2)
        assert got == _jspub.Ack("S", 8, False) and len(times) == 2
        assert times[1] - times[0] >= 0.18, times
        assert jsc._futures == {} and jsc._publishing == {} and jsc._publish_hedging == 0
        await jsc.stop()
    finally:
        await nc.close()
