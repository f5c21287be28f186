"""The circuit breaker of one push destination, on a clock the test moves."""

from __future__ import annotations

from ketch.engine.cache_manager.breaker import CLOSED, HALF_OPEN, OPEN, CircuitBreaker


def test_opens_after_the_threshold_and_lets_one_probe_through_after_the_cooldown() -> None:
    breaker = CircuitBreaker(threshold=3, cooldown=10.0)
    for now in (0.0, 1.0):
        assert breaker.start(now) is None
        breaker.failed(now, "no ack")
        assert breaker.state(now) == CLOSED
    breaker.failed(2.0, "no ack in 10 s")
    assert breaker.state(2.0) == OPEN
    refusal = breaker.refusal(5.0)
    assert refusal is not None and "last 3 pushes failed (last: no ack in 10 s)" in refusal
    assert "7.0 s more" in refusal
    assert breaker.state(12.0) == HALF_OPEN
    assert breaker.refusal(12.0) is None and breaker.refusal(12.0, busy=True) is not None
    assert breaker.start(12.0) is None  # the probe
    assert "probe push is on its way" in (breaker.refusal(12.5) or "")
    breaker.failed(13.0, "still no ack")  # the probe failed: open again, for a full cooldown
    assert breaker.state(13.0) == OPEN and breaker.state(22.9) == OPEN
    assert breaker.start(23.0) is None
    breaker.succeeded()
    assert breaker.state(23.0) == CLOSED and breaker.failures == 0


def test_a_push_that_ends_without_a_verdict_frees_the_probe() -> None:
    breaker = CircuitBreaker(threshold=1, cooldown=1.0)
    breaker.failed(0.0, "no ack")
    assert breaker.start(1.5) is None
    breaker.ended()  # e.g. its deadline passed: says nothing about the peer
    assert breaker.state(1.5) == HALF_OPEN and breaker.refusal(1.5) is None
