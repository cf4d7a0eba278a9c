"""Backpressure: token buckets per key (namespace, caller) for ``REACH_THROTTLED``.

Pure (no I/O); the clock is injected so tests never sleep.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Final, Generic, TypeVar

__all__ = ["DEFAULT_MAX_KEYS", "Pacer", "Throttle", "TokenBucket"]

#: Default bound on tracked keys: one bucket is ~100 bytes, so this caps memory near 1 MB.
DEFAULT_MAX_KEYS: Final = 10_000
V = TypeVar("V")
# Float slack: a caller that waits exactly the returned retry_after must then be admitted, even
# when rate * retry_after rounds to a hair below one token.
_EPSILON: Final = 1e-9


class TokenBucket:
    """A bucket of ``burst`` tokens refilled at ``rate`` tokens per second; starts full."""

    __slots__ = ("_clock", "_last", "_tokens", "burst", "rate")

    def __init__(
        self, rate: float, burst: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if not (rate > 0.0 and math.isfinite(rate)):
            raise ValueError(f"rate must be a positive finite number, got {rate!r}")
        if not (burst > 0.0 and math.isfinite(burst)):
            raise ValueError(f"burst must be a positive finite number, got {burst!r}")
        self.rate = rate
        self.burst = burst
        self._clock = clock
        self._tokens = burst
        self._last = clock()

    @property
    def tokens(self) -> float:
        """Tokens available now (refills as a side effect)."""
        self._refill()
        return self._tokens

    def _refill(self) -> None:
        now = self._clock()
        # max(): an injected clock that steps back must not drain the bucket.
        elapsed = max(0.0, now - self._last)
        self._last = now
        self._tokens = min(self.burst, self._tokens + elapsed * self.rate)

    def try_take(self, n: float = 1.0) -> float:
        """Take ``n`` tokens if available and return ``0.0``; otherwise take nothing and return
        the seconds until ``n`` tokens will be there (the ``retry_after``).

        ``n`` larger than ``burst`` can never be satisfied and raises ``ValueError``.
        """
        if n > self.burst:
            raise ValueError(f"cannot take {n} tokens from a bucket of burst {self.burst}")
        self._refill()
        if self._tokens + _EPSILON >= n:
            self._tokens = max(0.0, self._tokens - n)
            return 0.0
        return (n - self._tokens) / self.rate


class _PerKey(Generic[V]):
    """``rate`` and ``burst`` per key, at most ``max_keys`` keys (validated at once), each
    key's state in ``_keys``, least recently used first."""

    def __init__(
        self,
        rate: float,
        burst: float,
        *,
        max_keys: int = DEFAULT_MAX_KEYS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_keys < 1:
            raise ValueError(f"max_keys must be at least 1, got {max_keys!r}")
        # Validate rate/burst now rather than on the first request.
        TokenBucket(rate, burst, clock)
        self.rate = rate
        self.burst = burst
        self.max_keys = max_keys
        self._clock = clock
        self._keys: OrderedDict[str, V] = OrderedDict()


class Throttle(_PerKey[TokenBucket]):
    """Token buckets per key, created on first use, at most ``max_keys`` of them.

    The least recently used bucket is evicted beyond ``max_keys``. An evicted key starts again
    with a full bucket, so eviction can only be lenient, never wrongly throttle; size
    ``max_keys`` above the number of keys that are active within ``burst / rate`` seconds.
    """

    def check(self, key: str, n: float = 1.0) -> float:
        """Take ``n`` tokens from ``key``'s bucket: ``0.0`` if allowed, else ``retry_after``."""
        bucket = self._keys.get(key)
        if bucket is None:
            bucket = self._keys[key] = TokenBucket(self.rate, self.burst, self._clock)
            if len(self._keys) > self.max_keys:
                self._keys.popitem(last=False)
        else:
            self._keys.move_to_end(key)
        return bucket.try_take(n)

    def __len__(self) -> int:
        return len(self._keys)

    def __contains__(self, key: object) -> bool:
        return key in self._keys


class Pacer(_PerKey[float]):
    """Turns per key at ``rate`` a second after a first ``burst``: :meth:`turn` tells each
    caller how long to wait for its own, longer and longer while callers come faster than
    ``rate``.

    Unlike :meth:`Throttle.check`, which says "not now", a turn is booked: a thousand
    callers told to come back are a thousand wake-ups fighting for each token, a thousand
    booked turns are one each. At most ``max_keys`` keys (the least recently used forgotten,
    leniently); ``_keys`` holds, per key, when the turn after those booked would be, were
    there no burst."""

    def turn(self, key: str) -> float:
        """Book ``key``'s next turn: the seconds until it (0 within the burst)."""
        now = self._clock()
        booked = max(self._keys.get(key, now), now)
        self._keys[key] = booked + 1.0 / self.rate
        self._keys.move_to_end(key)
        if len(self._keys) > self.max_keys:
            self._keys.popitem(last=False)
        return max(0.0, booked - (self.burst - 1.0) / self.rate - now)
