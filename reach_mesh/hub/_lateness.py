"""Whose lateness an expired proxy attempt is: told by the order of the hub's own reading, not
by the agent's word (:class:`LatenessMixin`, a base of
:class:`~reach_mesh.hub._route_end.RouteEndMixin`).

A proxy attempt whose deadline passes unanswered ends at once for its caller
(``REACH_TIMEOUT``); what it costs its agent — an accept timeout on its health, a failure on
its breaker — waits. The hub reads the answers to its attempts, in the order they come, on
reply subjects every agent of their namespace may publish on (it answers there:
``hub/_reply_boxes.py``): an identity flooding them holds that namespace's answers unread in
the hub's queue (or, faster than the hub reads, those of every namespace on its connection in
its socket) past their deadlines, and an answer may also be lost with the connection or dropped
as a slow consumer. Charged at once, each such expiry was the flood's doing charged to a
healthy agent: another namespace's agent was QUARANTINED for most of a 10 s flood of 100-byte
messages, when every namespace shared one reply subscription (docs/security.md).

So the sweep that expires attempts keeps each one pending (``_late``) and, once per pass that
expired any, publishes a *marker* per namespace of them — an empty message on a reply subject
of that namespace's, a fresh 64-bit random token (``reply_token``: an agent may publish on its
namespace's reply subjects, and a guessable marker would let it end the wait early) — on the
connection whose reply subscription of that namespace reads the answers (the server's order
holds within one subscription only). nats-server delivers it behind every message it already
had for that subscription, and the subscription's one callback reads them in order
(``_on_agent_reply``, never concurrently). Then, for each attempt of that pass:

- its reply read before the marker was at the server by then, before the hub's expiry pass
  published the marker (the server's order, not the agent's clock; the hub's own server's
  only: in a cluster a reply still in a route between servers then is read after the
  marker, and charged — docs/security.md): it counts as if read in
  time (``_read_reply``: a success, or a timeout or failure of its own on the breaker, a
  caller's bad payload or a cached answer nothing; "no responders" nothing) — ``answered``;
  unless it was read, or the marker left, more than ``_SWEEP_SLACK`` past the deadline
  (this hub's loop behind): then the reply may have come after the deadline — ``behind``;
- the marker read and the reply not before it: it did not answer in time — an accept timeout
  and a breaker failure, as before — ``charged``;
- the marker not back within ``MARKER_WAIT``, or the connection reconnected, or a message of
  that namespace's reply subscription dropped as a slow consumer (``_nats.slow_drops``: counted
  in the read loop as it is dropped, so before the marker behind it is read) since the
  attempt's route began: the reply may have been lost; neither charged nor credited —
  ``behind``.

The agent's word is not asked: an agent that never answers its routes is charged whatever it
says elsewhere. ``MARKER_WAIT`` (2 s, what the former ``task_state`` ask and its check waited
at most): a marker comes back in a round trip when the hub reads in time; a hub two seconds
behind its reading cannot tell, and the bound keeps the pending attempts' memory short-lived.

Bounded: ``EXPIRY_PENDING_MOST`` attempts pending per hub and ``EXPIRY_PENDING_PER_NAMESPACE``
of one namespace (a caller whose routes time out on purpose cannot take every tenant's
share). An expiry past them is not charged (``skipped``): the checked ones of an agent that
stopped answering still open its breaker. A reply read in time costs nothing of this; a late
one a dict lookup.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

from reach_mesh._batch import reply_token
from reach_mesh.errors import ReachError
from reach_mesh.hub._reply_boxes import ReplyBox, ReplyBoxes
from reach_mesh.hub.registry import AgentView, Registry
from reach_mesh.tracing.metrics import HubMetrics

if TYPE_CHECKING:
    from reach_mesh.hub._route_end import _Flight, _ReplyHead

__all__ = [
    "EXPIRY_PENDING_MOST",
    "EXPIRY_PENDING_PER_NAMESPACE",
    "MARKER_WAIT",
    "LatenessMixin",
]

#: Expired attempts a hub keeps pending for their marker, at most, and of one namespace.
EXPIRY_PENDING_MOST: Final = 1024
EXPIRY_PENDING_PER_NAMESPACE: Final = 128
#: How long a marker is waited for (seconds): not back by then, its attempts are ``behind``.
MARKER_WAIT: Final = 2.0
#: How far past an attempt's deadline (seconds) the sweep may expire it and still credit a
#: reply read before the marker (the sweep runs every 5 ms): later, a reply at the server
#: before the marker may have come after the deadline.
_SWEEP_SLACK: Final = 0.05


@dataclass(slots=True, eq=False)
class _Marker:
    """A marker in flight: the reply subjects it went to, the expired attempts it decides,
    and their subscription's losses (reconnections and slow-consumer drops) when its pass
    began."""

    replies: ReplyBox
    tokens: list[str]
    losses: int
    timer: asyncio.TimerHandle | None = None


@dataclass(slots=True, eq=False)
class _Pending:
    """An expired attempt awaiting its marker, and when (perf_counter) that marker left."""

    flight: _Flight
    marked_at: float = math.inf


class LatenessMixin:
    """The methods of ``Hub`` that charge an expired proxy attempt to its agent once ordered
    against a marker (``Hub`` sets every attribute below)."""

    registry: Registry
    metrics: HubMetrics
    _replies: ReplyBoxes
    #: Expired attempts awaiting their marker, by reply token, and their count per namespace
    #: (none kept at 0).
    _late: dict[str, _Pending]
    _late_by_ns: dict[str, int]
    #: The namespaces' reply subjects with attempts expired in the sweep's current pass (in
    #: their ``swept``: one marker each at its end, on the subscription their replies are
    #: read on — the server's order holds within one subscription only).
    _late_swept: list[ReplyBox]
    #: Markers in flight, by token.
    _markers: dict[str, _Marker]

    if TYPE_CHECKING:

        def _read_reply(self, view: AgentView, flight: _Flight, data: bytes) -> _ReplyHead: ...

    def _reply_losses(self, replies: ReplyBox) -> int:
        """Reconnections of the replies' connection and messages of ``replies``'
        subscription dropped as a slow consumer, so far: a reply may be lost with either."""
        return self._replies.losses(replies)

    def _note_losses(self, replies: ReplyBox) -> None:
        """Called by the sweep as it expires an attempt answered on ``replies``: a loss seen
        now (not seen before) may have taken a reply of any attempt whose route began before
        it."""
        losses = self._reply_losses(replies)
        if losses != replies.losses_seen:
            replies.losses_seen = losses
            replies.lost_at = time.perf_counter()

    def _check_expiry(self, flight: _Flight) -> None:
        """``flight``'s attempt expired unanswered: keep it pending for this pass's marker
        (module docstring), within the bounds; past them, nothing is charged."""
        replies = flight.replies
        if replies is None:  # (never sent: there is nothing to be late)
            self.metrics.expiry_checks_total.labels("behind").inc()
            return
        self._note_losses(replies)
        if flight.t0 <= replies.lost_at:  # its reply may be lost already
            self.metrics.expiry_checks_total.labels("behind").inc()
            return
        ns = flight.ns
        by_ns = self._late_by_ns
        held = by_ns.get(ns, 0)
        if len(self._late) >= EXPIRY_PENDING_MOST or held >= EXPIRY_PENDING_PER_NAMESPACE:
            self.metrics.expiry_checks_total.labels("skipped").inc()
            return
        by_ns[ns] = held + 1
        self._late[flight.token] = _Pending(flight)
        if not replies.swept:
            self._late_swept.append(replies)
        replies.swept.append(flight.token)

    async def _send_markers(self) -> None:
        """The sweep's pass expired attempts (``_late_swept``): send a marker for each
        namespace's, on that namespace's reply subjects."""
        swept, self._late_swept = self._late_swept, []
        for replies in swept:
            await self._send_marker(replies)

    async def _send_marker(self, replies: ReplyBox) -> None:
        tokens, replies.swept = replies.swept, []
        if not tokens:
            return
        token = reply_token()
        marker = self._markers[token] = _Marker(replies, tokens, replies.losses_seen)
        late, now = self._late, time.perf_counter()
        for t in tokens:
            pending = late.get(t)
            if pending is not None:
                pending.marked_at = now
        marker.timer = asyncio.get_running_loop().call_later(
            MARKER_WAIT, self._marker_overdue, token
        )
        try:
            await replies.nc.publish(replies.prefix + token, b"")
        except Exception:  # (closing, or its buffer full): it cannot tell
            self._marker_overdue(token)

    def _late_reply(self, token: str, data: bytes, no_responders: bool) -> None:
        """A reply on ``token``, whose attempt is no longer in flight: read before its marker,
        it counts as if read in time (its caller was answered already)."""
        self.metrics.late_reply_total.inc()
        pending = self._late.pop(token, None)
        if pending is None:
            return
        flight = pending.flight
        self._release(flight.ns)
        # At the server before the marker left, and before it was read: past the slack, it
        # may have come after the deadline (this hub's loop behind): it cannot tell.
        if min(pending.marked_at, time.perf_counter()) - flight.deadline > _SWEEP_SLACK:
            self.metrics.expiry_checks_total.labels("behind").inc()
            return
        view = flight.view
        assert view is not None
        if not no_responders and self.registry.agents.get(view.agent_id) is view:
            # (A malformed reply is charged there, as in time; an error body raised.)
            with contextlib.suppress(ReachError):
                self._read_reply(view, flight, data)
        self.metrics.expiry_checks_total.labels("answered").inc()

    def _marker_back(self, token: str) -> bool:
        """An empty message on a reply subject: if it is a marker in flight, what was not read
        before it was not at the server by then. Whether it was one."""
        marker = self._markers.pop(token, None)
        if marker is None:
            return False
        if marker.timer is not None:
            marker.timer.cancel()
        replies = marker.replies
        lost = self._reply_losses(replies) != marker.losses
        lost_at = replies.lost_at
        late, checks = self._late, self.metrics.expiry_checks_total
        for t in marker.tokens:
            pending = late.pop(t, None)
            if pending is None:  # answered before it
                continue
            flight = pending.flight
            self._release(flight.ns)
            if lost or flight.t0 <= lost_at:
                checks.labels("behind").inc()
            else:
                self._charge(flight)
                checks.labels("charged").inc()
        return True

    def _marker_overdue(self, token: str) -> None:
        """The marker did not come back in time (or could not be sent): this hub cannot tell
        whether its attempts were answered."""
        marker = self._markers.pop(token, None)
        if marker is None:
            return
        if marker.timer is not None:
            marker.timer.cancel()
        for t in marker.tokens:
            pending = self._late.pop(t, None)
            if pending is not None:
                self._release(pending.flight.ns)
                self.metrics.expiry_checks_total.labels("behind").inc()

    def _forget_late(self) -> None:
        """The hub closes: the markers' timers cancelled, nothing pending charged."""
        for marker in self._markers.values():
            if marker.timer is not None:
                marker.timer.cancel()
        self._markers.clear()
        self._late.clear()
        self._late_by_ns.clear()
        for replies in self._late_swept:
            replies.swept.clear()
        self._late_swept.clear()

    def _release(self, ns: str) -> None:
        by_ns = self._late_by_ns
        by_ns[ns] -= 1
        if not by_ns[ns]:
            del by_ns[ns]

    def _charge(self, flight: _Flight) -> None:
        """An accept timeout and a breaker failure on the agent of ``flight``: on the health
        and breaker of the registration its attempt went to, which the agent's next
        registration keeps (under a new session too: ``_registry_watch``), as an expiry
        charged at once was. (Charged only while that registration was still the agent's, a
        never-answering agent escaped every charge by registering again within each route's
        timeout.)"""
        view = flight.view
        assert view is not None
        view.health.accept_timeout()
        view.breaker.record(False, unanswered=True)
        current = self.registry.agents.get(view.agent_id)
        if current is not None:
            self.registry.regrade(current)
