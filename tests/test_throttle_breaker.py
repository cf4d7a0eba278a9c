"""Token buckets, the circuit breaker and the health score, on an injected clock (no sleeping)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from reach_mesh.hub.breaker import (
    DEAF,
    HEALTH_THRESHOLD,
    BreakerState,
    CircuitBreaker,
    HealthScore,
)
from reach_mesh.hub.shares import Shares, defer_delay
from reach_mesh.hub.throttle import Pacer, Throttle, TokenBucket


class FakeClock:
    """A manual monotonic clock."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


# -- token bucket ------------------------------------------------------------------------------


def test_bucket_burst_then_retry_after() -> None:
    clock = FakeClock()
    bucket = TokenBucket(rate=2.0, burst=3.0, clock=clock)
    assert [bucket.try_take() for _ in range(3)] == [0.0, 0.0, 0.0]
    assert bucket.try_take() == pytest.approx(0.5)  # one token at 2/s
    assert bucket.try_take() == pytest.approx(0.5)  # a refusal takes nothing
    clock.advance(0.25)
    assert bucket.try_take() == pytest.approx(0.25)
    clock.advance(0.25)
    assert bucket.try_take() == 0.0
    assert bucket.try_take(2.0) == pytest.approx(1.0)


def test_bucket_refill_is_capped_at_burst() -> None:
    clock = FakeClock()
    bucket = TokenBucket(rate=10.0, burst=5.0, clock=clock)
    clock.advance(3600)
    assert bucket.tokens == 5.0
    clock.advance(-10)  # a clock stepping back does not drain or overfill
    assert bucket.tokens == 5.0


def test_bucket_validation() -> None:
    with pytest.raises(ValueError):
        TokenBucket(rate=0.0, burst=1.0)
    with pytest.raises(ValueError):
        TokenBucket(rate=1.0, burst=-1.0)
    with pytest.raises(ValueError):
        TokenBucket(rate=1.0, burst=2.0).try_take(3.0)


@settings(max_examples=200, deadline=None)
@given(
    st.floats(0.1, 100.0),
    st.floats(1.0, 50.0),
    st.lists(st.floats(0.0, 2.0), min_size=1, max_size=60),
)
def test_bucket_never_exceeds_rate(rate: float, burst: float, gaps: list[float]) -> None:
    clock = FakeClock(0.0)
    bucket = TokenBucket(rate, burst, clock)
    taken = 0
    for gap in gaps:
        clock.advance(gap)
        retry_after = bucket.try_take()
        assert retry_after >= 0.0
        if retry_after == 0.0:
            taken += 1
        else:
            # Waiting exactly retry_after is enough.
            clock.advance(retry_after)
            assert bucket.try_take() == 0.0
            taken += 1
    assert taken <= burst + rate * clock.now + 1e-6


def test_throttle_keys_are_independent_and_bounded() -> None:
    clock = FakeClock()
    throttle = Throttle(rate=1.0, burst=2.0, max_keys=3, clock=clock)
    assert throttle.check("ns-a") == 0.0
    assert throttle.check("ns-a") == 0.0
    assert throttle.check("ns-a") == pytest.approx(1.0)
    assert throttle.check("ns-b") == 0.0
    assert throttle.check("ns-c") == 0.0
    assert len(throttle) == 3
    assert throttle.check("ns-a") > 0.0  # touch a: b is now least recently used
    assert throttle.check("ns-d") == 0.0
    assert len(throttle) == 3
    assert "ns-b" not in throttle
    assert "ns-a" in throttle
    assert throttle.check("ns-a") > 0.0  # a kept its (empty) bucket


def test_pacer_books_one_turn_each_after_the_burst() -> None:
    clock = FakeClock()
    pacer = Pacer(10.0, 3.0, clock=clock)
    assert [round(pacer.turn("a"), 3) for _ in range(6)] == [0, 0, 0, 0.1, 0.2, 0.3]
    assert pacer.turn("b") == 0  # keys are paced apart
    clock.now += 10.0  # idle: the burst is there again, no more
    assert [round(pacer.turn("a"), 3) for _ in range(4)] == [0, 0, 0, 0.1]
    with pytest.raises(ValueError):
        Pacer(0.0, 1.0)


def test_throttle_validation() -> None:
    with pytest.raises(ValueError):
        Throttle(rate=1.0, burst=1.0, max_keys=0)
    with pytest.raises(ValueError):
        Throttle(rate=-1.0, burst=1.0)


# -- circuit breaker ---------------------------------------------------------------------------


def _state(breaker: CircuitBreaker) -> BreakerState:
    # Through a function: mypy would otherwise narrow ``breaker.state`` across assertions,
    # while the whole point is that the property changes with time and records.
    return breaker.state


def _breaker(clock: FakeClock) -> CircuitBreaker:
    return CircuitBreaker(clock=clock)


def test_breaker_needs_min_requests() -> None:
    clock = FakeClock()
    breaker = _breaker(clock)
    for _ in range(4):
        breaker.record(False)
    assert _state(breaker) is BreakerState.CLOSED  # 4 < min_requests
    breaker.record(False)
    assert _state(breaker) is BreakerState.OPEN
    assert not breaker.allow()


def test_breaker_ratio_threshold() -> None:
    clock = FakeClock()
    breaker = _breaker(clock)
    for outcome in [True, True, True, False, False]:  # 40 % failures
        breaker.record(outcome)
    assert _state(breaker) is BreakerState.CLOSED
    assert breaker.counts() == (3, 2)
    breaker.record(False)  # 3 of 6 = 50 %
    assert _state(breaker) is BreakerState.OPEN


def test_breaker_window_slides() -> None:
    clock = FakeClock()
    breaker = _breaker(clock)
    for _ in range(4):
        breaker.record(False)
    clock.advance(61)  # those failures leave the 60 s window
    assert breaker.counts() == (0, 0)
    for _ in range(4):
        breaker.record(True)
    breaker.record(False)
    assert _state(breaker) is BreakerState.CLOSED


def test_breaker_window_is_bucketed() -> None:
    clock = FakeClock()
    breaker = _breaker(clock)
    for _ in range(10_000):
        breaker.record(True)
    for _ in range(100):
        clock.advance(0.5)
        breaker.record(True)
    assert len(breaker._buckets) <= 61


def test_breaker_open_half_open_closed() -> None:
    clock = FakeClock()
    breaker = _breaker(clock)
    for _ in range(5):
        breaker.record(False)
    assert _state(breaker) is BreakerState.OPEN
    clock.advance(29.9)
    assert _state(breaker) is BreakerState.OPEN
    breaker.record(True)  # late replies while open are ignored
    assert _state(breaker) is BreakerState.OPEN
    clock.advance(0.1)
    assert _state(breaker) is BreakerState.HALF_OPEN
    assert breaker.probe_available
    assert breaker.allow()  # the single probe
    assert not breaker.probe_available
    assert not breaker.allow()
    assert not breaker.allow()
    breaker.record(True)
    assert _state(breaker) is BreakerState.CLOSED
    assert breaker.counts() == (0, 0)  # fresh window
    assert breaker.allow()
    for _ in range(4):
        breaker.record(False)
    assert _state(breaker) is BreakerState.CLOSED


def test_breaker_half_open_failure_reopens() -> None:
    clock = FakeClock()
    breaker = _breaker(clock)
    for _ in range(5):
        breaker.record(False)
    clock.advance(30)
    assert breaker.allow()
    breaker.record(False)
    assert _state(breaker) is BreakerState.OPEN
    assert not breaker.allow()
    clock.advance(30)
    assert _state(breaker) is BreakerState.HALF_OPEN
    assert breaker.allow()


def test_a_breaker_closed_forgets_why_it_opened() -> None:
    """A deaf verdict (or any trip) is over once the breaker closes, by its half-open probe
    or an operator's reset: a holder whose probe reached it is not kept out as deaf
    (``Router``'s ``why != DEAF``) until a ping of its ctl subject is answered."""
    clock = FakeClock()
    breaker = _breaker(clock)
    breaker.trip(DEAF)
    assert breaker.why == DEAF
    clock.advance(30)
    assert breaker.allow()  # the half-open probe
    breaker.record(True)
    assert _state(breaker) is BreakerState.CLOSED
    assert breaker.why == ""
    breaker.trip()
    assert breaker.why == "operator quarantine"
    breaker.reset()
    assert breaker.why == ""


def test_breaker_lost_probe_is_reissued() -> None:
    clock = FakeClock()
    breaker = CircuitBreaker(clock=clock, probe_timeout=10.0)
    for _ in range(5):
        breaker.record(False)
    clock.advance(30)
    assert breaker.allow()
    clock.advance(9)
    assert not breaker.allow()
    clock.advance(1)
    assert breaker.allow()


def test_breaker_custom_parameters_and_reset() -> None:
    clock = FakeClock()
    breaker = CircuitBreaker(
        window=10.0, failure_ratio=0.25, min_requests=2, open_timeout=5.0, clock=clock
    )
    breaker.record(True)
    breaker.record(False)
    assert _state(breaker) is BreakerState.OPEN
    clock.advance(5)
    assert _state(breaker) is BreakerState.HALF_OPEN
    breaker.reset()
    assert _state(breaker) is BreakerState.CLOSED
    with pytest.raises(ValueError):
        CircuitBreaker(window=1.0, bucket=2.0)


# -- health score ------------------------------------------------------------------------------


def test_health_score() -> None:
    health = HealthScore()
    assert health.value == 100
    assert health.healthy
    health.success()
    assert health.value == 100  # capped
    health.delivery_failure()
    health.accept_timeout()
    assert health.value == 85
    health.overloaded()
    assert health.value == 65
    assert health.healthy
    health.accept_timeout()
    assert health.value == HEALTH_THRESHOLD == 60
    assert health.healthy
    health.success()
    health.delivery_failure()
    assert health.value == 51
    assert not health.healthy
    for _ in range(10):
        health.overloaded()
    assert health.value == 0  # floor


def test_health_score_configurable() -> None:
    health = HealthScore(initial=50, threshold=40, delivery_failure_penalty=30, success_bonus=5)
    health.delivery_failure()
    assert health.value == 20
    assert not health.healthy
    for _ in range(4):
        health.success()
    assert health.value == 40
    assert health.healthy


def test_shares_are_fair_once_the_hub_is_full() -> None:
    shares = Shares(4)
    for _ in range(4):  # alone, a namespace may use the whole capacity
        assert shares.admits("a")
        shares.take("a")
    assert shares.total == 4 and not shares.admits("a")
    # Full: a newcomer is below its fair share (4 // 2) and still takes, past the capacity.
    assert shares.share("b") == 2 and shares.admits("b")
    shares.take("b")
    shares.take("b")
    assert not shares.admits("b") and shares.total == 6
    # A third namespace: shares are 4 // 3 = 1 each; "a" waits until the hub has room again.
    assert shares.admits("c") and not shares.admits("a")
    assert shares.ceiling == 16
    for _ in range(3):
        shares.give("a")
    assert shares.total == 3 and shares.admits("a")  # room again: anyone may take it
    shares.give("a")
    shares.give("a")  # one give too many changes nothing
    shares.give("b")
    shares.give("b")
    assert shares.total == 0 and len(shares) == 0
    with pytest.raises(ValueError):
        Shares(0)


def test_deferred_submissions_wait_longer_each_time_up_to_a_bound() -> None:
    delays = [defer_delay(n) for n in range(0, 12)]
    assert delays[:5] == [0.0, 0.0, 0.5, 1.0, 2.0]  # at once the first time: another hub?
    assert delays == sorted(delays) and max(delays) == 30.0
    assert defer_delay(10**9) == 30.0


def test_fair_shares_stop_at_the_ceiling() -> None:
    """Namespaces filling a hub one after another each keep what they took: past the
    capacity the shares add up, and at four times it nobody takes more."""
    shares = Shares(4)
    ns = 0
    while shares.admits(f"n{ns}"):
        while shares.admits(f"n{ns}"):
            shares.take(f"n{ns}")
        ns += 1
    assert shares.total == 16 and len(shares) == ns  # took 4, 2, 1, 1, 1, ... up to 16
    assert not shares.admits("newcomer")


def test_breaker_says_why_it_opened() -> None:
    clock = FakeClock()
    breaker = _breaker(clock)
    for outcome in [True, True, True, False, False, False]:
        breaker.record(outcome)
    assert _state(breaker) is BreakerState.OPEN and breaker.why == "3 of its last 6 requests failed"
    clock.advance(31)  # past open_timeout: half-open, and its probe fails
    assert breaker.allow()
    breaker.record(False)
    assert _state(breaker) is BreakerState.OPEN and breaker.why == (
        "its half-open probe failed (opened: 3 of its last 6 requests failed)"
    )
    breaker.reset()
    breaker.trip()
    assert breaker.why == "operator quarantine"


def test_breaker_counts_unanswered_routes_apart_in_its_reason() -> None:
    """Routes the agent never answered (expiries charged) are failures its own metrics and logs
    know nothing of: the reason says how many of the failures were those, within the window
    (older ones, gone from it, are not named)."""
    clock = FakeClock()
    breaker = _breaker(clock)
    breaker.record(False, unanswered=True)
    clock.advance(61)  # out of the 60 s window
    breaker.record(True)
    breaker.record(False, unanswered=True)
    breaker.record(True, unanswered=True)  # (a success is never unanswered)
    breaker.record(False)  # (a handler's failure)
    assert _state(breaker) is BreakerState.CLOSED
    breaker.record(False, unanswered=True)
    assert _state(breaker) is BreakerState.OPEN
    assert breaker.why == "3 of its last 5 requests failed (2 not answered within their timeout)"
