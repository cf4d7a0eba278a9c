"""The watch on the leader of the hubs' submissions consumer (``hub/_stale_leader.py``): when
it sits on a server whose copy of ``REACH_WF`` is stale, a hub asks it to step down.

Chaos (nats-server 2.15.1, ``partition``): ``REACH_WF``'s replica on ``n1`` diverged and never
caught up ("Expected first catchup entry to be a snapshot and peerstate, will retry"), and
``reach-hubs`` later elected ``n1`` its leader: 207 workflows submitted after that were never
delivered to any hub, with no error anywhere (nats-io/nats-server#3299)."""

from __future__ import annotations

import itertools
from datetime import UTC, datetime

from nats.js.api import (
    ClusterInfo,
    ConsumerConfig,
    ConsumerInfo,
    PeerInfo,
    SequenceInfo,
    StreamConfig,
    StreamInfo,
    StreamState,
)

from reach_mesh import protocol
from reach_mesh.hub._stale_leader import StaleLeaderWatch


def _stream(
    last_seq: int,
    *,
    leader: str = "n0",
    stale: str = "n1",
    current: bool = True,
    lag: int = 0,
    messages: int = 10,
) -> StreamInfo:
    others = [p for p in ("n0", "n1", "n2") if p != leader]
    replicas = [
        PeerInfo(
            name=p,
            current=current if p == stale else True,
            lag=lag if p == stale else 0,
            active=100_000_000,
        )
        for p in others
    ]
    return StreamInfo(
        config=StreamConfig(name=protocol.STREAM_WF),
        state=StreamState(
            messages=messages, bytes=1000, first_seq=1, last_seq=last_seq, consumer_count=1
        ),
        cluster=ClusterInfo(name="mesh", leader=leader, replicas=replicas),
    )


def _consumer(
    delivered: int, *, leader: str = "n1", waiting: int = 3, ack_pending: int = 0
) -> ConsumerInfo:
    return ConsumerInfo(
        name=protocol.CONSUMER_HUBS,
        stream_name=protocol.STREAM_WF,
        config=ConsumerConfig(durable_name=protocol.CONSUMER_HUBS, max_ack_pending=65_536),
        created=datetime(2026, 1, 1, tzinfo=UTC),
        delivered=SequenceInfo(consumer_seq=delivered, stream_seq=delivered),
        num_ack_pending=ack_pending,
        num_waiting=waiting,
        num_pending=0,
        cluster=ClusterInfo(name="mesh", leader=leader),
    )


def test_a_healthy_consumer_leader_is_left_alone() -> None:
    watch = StaleLeaderWatch(10.0)
    for t in range(0, 120, 5):
        # Led by another server than the stream's, its replica current, everything delivered
        # (or deliveries moving along): nothing to do.
        seq = 100 + t
        assert watch.observe(_stream(seq), _consumer(seq), float(t)) is None
        assert watch.observe(_stream(seq + 3), _consumer(seq + t % 2), t + 0.5) is None
    # A follower under load, lagging at every look but catching up between them (its lag
    # smaller than at the look before, now and then), everything delivered: left alone.
    for t in range(0, 120, 5):
        lag = 3 + t % 10
        assert (
            watch.observe(_stream(500 + t, lag=lag), _consumer(500 + t, waiting=0), 120.0 + t)
            is None
        )
    # Led by the stream's leader: never, whatever the numbers say.
    for t in range(0, 120, 5):
        assert watch.observe(_stream(900), _consumer(591, leader="n0"), 300.0 + t) is None
    assert watch.step_downs == 0


def test_a_consumer_leader_on_a_stale_replica_is_asked_to_step_down() -> None:
    watch = StaleLeaderWatch(10.0)
    verdict = None
    t = 0.0
    while verdict is None and t < 60:
        verdict = watch.observe(_stream(800 + int(t), current=False), _consumer(591), t)
        t += 5.0
    assert verdict is not None
    assert t - 5.0 > 10.0  # more than the hold, on every look
    assert verdict.server == "n1" and verdict.prefer == "n0"
    assert "current=False" in verdict.why and "delivered.stream_seq 591" in verdict.why


def test_a_stall_without_a_replica_behind_is_asked_too() -> None:
    """The stale replica reads current (its raft log agrees), yet nothing past seq 591 goes
    out while pulls wait."""
    watch = StaleLeaderWatch(10.0)
    verdicts = [watch.observe(_stream(900), _consumer(591), float(t)) for t in range(0, 20, 5)]
    assert verdicts[:3] == [None, None, None]
    assert verdicts[3] is not None and verdicts[3].server == "n1"
    # No pull waiting, or the consumer full of unacked deliveries: no stall to speak of.
    for consumer in (_consumer(591, waiting=0), _consumer(591, ack_pending=65_536)):
        idle = StaleLeaderWatch(10.0)
        assert all(idle.observe(_stream(900), consumer, float(t)) is None for t in range(0, 60, 5))


def test_a_single_look_is_never_enough() -> None:
    watch = StaleLeaderWatch(10.0)
    assert watch.observe(_stream(900, current=False), _consumer(591), 100.0) is None
    # Two looks 100 s apart say nothing of the time between (the hub's loop stalled), and
    # healthy looks in between start the run again.
    for t in range(0, 100, 10):
        assert watch.observe(_stream(900, current=False), _consumer(591), 200.0 + t) is None
        assert watch.observe(_stream(900), _consumer(900), 205.0 + t) is None
    # Deliveries that move break a stall's run; a leader that changes starts it again; a
    # look that could not be read too.
    for t in range(0, 100, 5):
        assert watch.observe(_stream(2000), _consumer(1000 + t), 400.0 + t) is None
    for t in range(0, 100, 5):
        leader = "n1" if t % 10 else "n2"
        assert watch.observe(_stream(2000), _consumer(591, leader=leader), 600.0 + t) is None
    for t in range(0, 100, 5):
        if t % 10 == 0:
            watch.unread()
        assert watch.observe(_stream(2000, current=False), _consumer(591), 800.0 + t) is None
    assert watch.step_downs == 0


def test_step_downs_are_rate_limited() -> None:
    watch = StaleLeaderWatch(10.0, every=30.0)
    asked = [
        t
        for t in range(0, 200, 5)
        if watch.observe(_stream(900, lag=5), _consumer(591), float(t)) is not None
    ]
    # The first after more than 10 s of looks; then the run starts again after each one, and
    # no two are less than 30 s apart.
    assert asked[0] == 15
    assert all(b - a >= 30 for a, b in itertools.pairwise(asked))
    assert len(asked) == len(range(15, 200, 30))
    assert watch.step_downs == len(asked)


def test_a_deleted_tail_is_no_stall() -> None:
    """The newest submissions gone undelivered (deleted: a work queue's message, a hand-back's)
    leave ``last_seq`` past ``delivered`` for good; with no message in the stream beyond
    those the consumer has out, that is no stall, however long it lasts."""
    watch = StaleLeaderWatch(10.0)
    for t in range(0, 120, 5):
        got = watch.observe(_stream(120, messages=2), _consumer(100, ack_pending=2), float(t))
        assert got is None
    # The same with undelivered messages in the stream: asked for once the hold is over.
    watch = StaleLeaderWatch(10.0)
    asked = [
        watch.observe(_stream(120, messages=30), _consumer(100, ack_pending=2), float(t))
        for t in range(0, 20, 5)
    ]
    assert asked[:2] == [None, None] and asked[-1] is not None
