"""A hub's watch on the leader of the shared submissions consumer (``reach-hubs``).

A consumer's leader delivers only what its own server's copy of the stream holds. Chaos
(nats-server 2.15.1, ``partition``): ``REACH_WF``'s replica on ``n1`` diverged in the cut (its
raft log kept uncommitted entries of an old term; it logged "Expected first catchup entry to
be a snapshot and peerstate, will retry" ever after, its store stuck at seq 591), and later
``reach-hubs`` elected ``n1`` its leader: nothing stored after that (seq 793 on, on the other
two replicas) was delivered to any hub — 207 workflows never started, with no error anywhere
(pulls expired; ``num_pending``, computed by that leader, read ~0). Upstream:
nats-io/nats-server#3299 ("consumer leader should step down if its stream peer is inactive").

Every ``SUBMISSIONS_EVERY`` seconds each hub reads the stream's info (answered by its leader)
and the consumer's (:class:`StaleLeaderWatch`). When, on every look for more than ``hold``
seconds (``max(10 s, 2 * workflow_ack_wait)``), the consumer's leader is not the stream's
leader and either

* the stream's replica on the consumer leader's server is behind (not ``current``, or a
  ``lag``) and not catching up (its ``lag`` never smaller than at the look before: a healthy
  follower under load lags by a few entries at times, then less), or
* the stream holds submissions past the consumer's ``delivered.stream_seq``, more messages
  than the consumer has out (``num_ack_pending``), while hubs' pulls wait (``num_waiting``)
  and the consumer may deliver (``num_ack_pending`` under its ``max_ack_pending``), and
  ``delivered.stream_seq`` did not move,

the hub asks the consumer's leader to step down (``$JS.API.CONSUMER.LEADER.STEPDOWN``,
preferring the stream leader's server), at most once per ``STEP_DOWN_EVERY`` seconds, with a
WARNING naming the server and what was seen. Nothing is deleted or created.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Final

from nats.aio.client import Client as NATS
from nats.js.api import ConsumerInfo, StreamInfo

__all__ = ["STEP_DOWN_EVERY", "StaleLeaderWatch", "Verdict", "step_down"]

log = logging.getLogger("reach_mesh.hub.workflows")

#: Least seconds between two step-downs asked by one hub.
STEP_DOWN_EVERY: Final = 30.0
#: Least seconds a stale leader must be seen before a step-down (``hold``'s floor).
HOLD_FLOOR: Final = 10.0
#: Most seconds between two looks of one run: a longer gap (the hub's loop stalled, reads
#: failed) says nothing of the time between them, and the runs start again.
LOOK_GAP: Final = 15.0


@dataclass(frozen=True, slots=True)
class Verdict:
    """A step-down to ask for: of ``server`` (the consumer's leader), preferring ``prefer``
    (the stream's leader), for ``why``."""

    server: str
    prefer: str | None
    why: str


@dataclass(frozen=True, slots=True)
class _Look:
    consumer_leader: str
    stream_leader: str | None
    behind: bool
    lag: int
    stalled: bool
    delivered: int
    why: str


def _look(stream: StreamInfo, consumer: ConsumerInfo) -> _Look | None:
    """What one look shows, or None when it shows nothing to act on (no leaders known, the
    consumer led by the stream's leader, or neither sign)."""
    c_leader = consumer.cluster.leader if consumer.cluster is not None else None
    s_leader = stream.cluster.leader if stream.cluster is not None else None
    if not c_leader or not s_leader or c_leader == s_leader:
        return None
    replica = None
    if stream.cluster is not None:
        replica = next((r for r in stream.cluster.replicas or () if r.name == c_leader), None)
    behind = replica is not None and (not replica.current or (replica.lag or 0) > 0)
    last_seq = stream.state.last_seq
    delivered = consumer.delivered.stream_seq if consumer.delivered is not None else 0
    max_pending = consumer.config.max_ack_pending
    can_deliver = (
        max_pending is None or max_pending <= 0 or ((consumer.num_ack_pending or 0) < max_pending)
    )
    # Messages the stream (its leader) holds beyond those the consumer has out: undelivered
    # ones. ``last_seq`` past ``delivered`` alone is no sign: a work queue's newest messages
    # may be gone undelivered (deleted, a hand-back's), and an idle mesh would step down
    # every ``STEP_DOWN_EVERY`` for them.
    undelivered = stream.state.messages > (consumer.num_ack_pending or 0)
    stalled = (
        last_seq > delivered and undelivered and (consumer.num_waiting or 0) > 0 and can_deliver
    )
    if not behind and not stalled:
        return None
    parts = []
    if replica is not None:
        parts.append(
            f"its replica of {stream.config.name} current={replica.current} lag={replica.lag}"
        )
    parts.append(
        f"stream last_seq {last_seq} (leader {s_leader}), consumer delivered.stream_seq "
        f"{delivered}, {consumer.num_waiting or 0} pull(s) waiting, "
        f"{consumer.num_ack_pending or 0} ack pending"
    )
    lag = (replica.lag or 0) if replica is not None else 0
    return _Look(c_leader, s_leader, behind, lag, stalled, delivered, "; ".join(parts))


class StaleLeaderWatch:
    """Decides, look by look, whether to ask the consumer's leader to step down (see the
    module). Pure: :meth:`observe` takes the two infos and the time; the caller asks."""

    def __init__(
        self, hold: float, *, every: float = STEP_DOWN_EVERY, gap: float = LOOK_GAP
    ) -> None:
        #: Seconds a sign must be seen, on every look, before a step-down.
        self.hold = hold
        self.every = every
        self.gap = gap
        self._looked_at: float | None = None
        #: The leader the current runs of looks are of, and since when each sign was seen on
        #: every look (the stall: with ``delivered.stream_seq`` at ``_stalled_at``).
        self._leader: str | None = None
        self._behind_since: float | None = None
        self._lag = 0
        self._stalled_since: float | None = None
        self._stalled_at = 0
        self._stepped_at: float | None = None
        #: Step-downs asked for (``Verdict``s given).
        self.step_downs = 0

    def unread(self) -> None:
        """A look that could not be read: the runs of looks start again."""
        self._leader = self._behind_since = self._stalled_since = None
        self._lag = 0

    def observe(self, stream: StreamInfo, consumer: ConsumerInfo, now: float) -> Verdict | None:
        """One look at ``stream`` and ``consumer`` at ``now`` (monotonic): a step-down to ask
        for, or None. A single look never is one."""
        seen = _look(stream, consumer)
        late = self._looked_at is not None and now - self._looked_at > self.gap
        self._looked_at = now
        if seen is None or seen.consumer_leader != self._leader or late:
            self.unread()
            if seen is None:
                return None
            self._leader = seen.consumer_leader
        if not seen.behind or seen.lag < self._lag:
            self._behind_since = None  # caught up, or catching up
        if seen.behind and self._behind_since is None:
            self._behind_since = now
        self._lag = seen.lag
        if not seen.stalled or (
            self._stalled_since is not None and seen.delivered != self._stalled_at
        ):
            self._stalled_since = None
        if seen.stalled and self._stalled_since is None:
            self._stalled_since, self._stalled_at = now, seen.delivered
        since = min(
            (t for t in (self._behind_since, self._stalled_since) if t is not None),
            default=now,
        )
        if now - since <= self.hold:
            return None
        if self._stepped_at is not None and now - self._stepped_at < self.every:
            return None
        self._stepped_at = now
        self.unread()
        self.step_downs += 1
        return Verdict(
            seen.consumer_leader, seen.stream_leader, f"for {now - since:.0f}s: {seen.why}"
        )


async def step_down(
    nc: NATS,
    stream: str,
    durable: str,
    prefer: str | None,
    *,
    of: str | None = None,
    timeout: float = 5.0,
) -> str:
    """Ask ``durable``'s leader to step down, preferring ``prefer`` (a server name) as the new
    one; asked again with no preference when that one is refused (not a peer, already the
    leader). With ``of``, first read who leads now, before each request, and ask only if
    ``of`` still does: a step-down goes to whoever leads when it lands, and three hubs that saw
    the same stale leader would otherwise move a healthy one on (the one the first step-down
    chose, asked with its own name preferred, is refused and then asked with none). What the
    server answered, for the log."""
    subject = f"$JS.API.CONSUMER.LEADER.STEPDOWN.{stream}.{durable}"
    bodies = [b""]
    if prefer:
        bodies.insert(0, json.dumps({"placement": {"preferred": prefer}}).encode())
    said = ""
    for body in bodies:
        if of is not None:
            msg = await nc.request(
                f"$JS.API.CONSUMER.INFO.{stream}.{durable}", b"", timeout=timeout
            )
            info = json.loads(msg.data or b"{}")
            now = (info.get("cluster") or {}).get("leader")
            if now != of:
                return f"not asked: {now or 'no server'} leads it now"
        msg = await nc.request(subject, body, timeout=timeout)
        answer = json.loads(msg.data or b"{}")
        if answer.get("success"):
            return f"done (preferred {prefer})" if body else "done"
        said = str(answer.get("error") or answer)
    return f"refused: {said}"
