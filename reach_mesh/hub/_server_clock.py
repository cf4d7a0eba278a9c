"""The NATS server's wall clock, as a hub can tell it from the messages it receives.

A workflow's deadline is its submission's time as JetStream stored it (the server's clock) plus
its timeout; a record loaded at start is aged by the server's timestamp. Reading "now" from the
hub's own wall clock mixed two clocks: a hub whose clock ran two minutes ahead of the server's
timed every workflow shorter than that out at once, dropping the results its agents sent, and
one behind gave them that much longer.

Every JetStream message carries the time the server stored it, and arrives after that. So
``local now - stored`` is the skew of the two clocks plus the message's delay, which is never
negative, and its minimum over recent messages is the skew (plus the least delay, well under
a millisecond on a LAN). The samples are the heartbeat entries the registry's watch delivers
live: each was written a moment before, by a hub that had just received the agent's beat.
Not submissions: one may have waited in the stream for minutes (no hub running, a backlog),
and at a hub's start it could be the only sample, taken for a skew of minutes.

The minimum is taken over the last one to two minutes (two windows), so that a clock corrected
by NTP is followed; when none came for two windows, the last known skew holds. The first sample
is asked for at the hub's start (:func:`ask_server_time`), before the registry ages the entries
it loads: a stream's info carries the server's time when it answered.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Callable
from datetime import datetime
from typing import Final

from nats.aio.client import Client as NATS

__all__ = ["ServerClock", "ask_server_time"]

log = logging.getLogger("reach_mesh.hub")

#: Seconds of one window of samples; the skew is the least over the current and the last one.
WINDOW: Final = 60.0


class ServerClock:
    """``now()``: the server's wall clock, estimated from :meth:`sample` (no I/O, O(1))."""

    def __init__(
        self,
        *,
        wall: Callable[[], float] | None = None,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        #: This host's wall clock (``time.time``, looked up at each call).
        self._wall = wall or _host_wall
        self._monotonic = monotonic
        self._current = math.inf
        self._last = math.inf
        self._window_end = monotonic() + WINDOW
        #: The skew last estimated (local minus server, seconds): kept through quiet windows.
        self._known = 0.0

    def sample(self, stored: datetime | float | None) -> None:
        """A JetStream message stored at ``stored`` (the server's time) arrived just now. Not
        for messages read back or replayed: their delay is not small, and only raises the
        minimum (harmless, but no information)."""
        if stored is None:
            return
        at = stored if isinstance(stored, float | int) else stored.timestamp()
        self._roll()
        skew = self._wall() - at
        if skew < self._current:
            self._current = skew
            self._known = min(self._current, self._last)

    @property
    def skew(self) -> float:
        """This host's wall clock minus the server's, as estimated now (seconds)."""
        self._roll()
        return self._known

    def now(self) -> float:
        """The server's wall clock now (epoch seconds), as estimated."""
        return self._wall() - self.skew

    def _roll(self) -> None:
        t = self._monotonic()
        if t < self._window_end:
            return
        # One window passed (or more: then the last is empty).
        self._last = self._current if t < self._window_end + WINDOW else math.inf
        self._current = math.inf
        self._window_end = t + WINDOW
        best = min(self._current, self._last)
        if best != math.inf:
            self._known = best


async def ask_server_time(nc: NATS, stream: str, clock: ServerClock) -> None:
    """Sample ``clock`` with the server's time as ``stream``'s info gives it (``ts``, when the
    server answered): the one sample a hub has before any message reaches it. Logged and
    skipped if the server does not say (the local clock holds until a heartbeat comes)."""
    try:
        msg = await nc.request(f"$JS.API.STREAM.INFO.{stream}", b"", timeout=2.0)
        ts = json.loads(msg.data).get("ts")
        clock.sample(datetime.fromisoformat(ts) if isinstance(ts, str) else None)
    except Exception as err:
        log.info("the NATS server's time is not known yet (%s): the local clock is used", err)


def _host_wall() -> float:
    return time.time()
