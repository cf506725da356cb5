"""Token bucket rate limits, stepped by hand."""

import pytest
from hypothesis import given, settings, strategies as st

from protocol.gateway.ratelimit import RateLimit, RateLimiter, KeyBucket


def test_burst_is_allowed_then_refused_with_retry_after():
    bucket = KeyBucket(RateLimit(rate=2.0, burst=3), now=0.0)
    assert [bucket.take(0.0).allowed for _ in range(3)] == [True, True, True]
    refused = bucket.take(0.0)
    assert not refused.allowed
    assert refused.remaining == 0
    assert refused.retry_after == pytest.approx(0.5)
    assert refused.reset_after == pytest.approx(1.5)


def test_tokens_refill_at_the_rate_and_cap_at_the_burst():
    bucket = KeyBucket(RateLimit(rate=1.0, burst=2), now=0.0)
    bucket.take(0.0)
    bucket.take(0.0)
    assert not bucket.take(0.5).allowed
    assert bucket.take(1.0).allowed
    # A long idle period refills to the burst, not beyond.
    assert bucket.take(100.0).remaining == 1


def test_clock_going_backwards_does_not_mint_tokens():
    bucket = KeyBucket(RateLimit(rate=1.0, burst=1), now=10.0)
    assert bucket.take(10.0).allowed
    assert not bucket.take(5.0).allowed


def test_limiter_keeps_keys_apart_and_passes_unlimited_keys():
    limiter = RateLimiter()
    limit = RateLimit(rate=1.0, burst=1)
    assert limiter.take("a", limit, 0.0).allowed
    assert not limiter.take("a", limit, 0.0).allowed
    assert limiter.take("b", limit, 0.0).allowed
    assert limiter.take("c", None, 0.0) is None


@pytest.mark.parametrize("rate,burst", [(0, 1), (-1, 1), (float("inf"), 1), (1, 0)])
def test_invalid_limits_are_rejected(rate, burst):
    with pytest.raises(ValueError):
        RateLimit(rate=rate, burst=burst)


@settings(max_examples=100, deadline=None)
@given(
    rate=st.floats(0.1, 100),
    burst=st.integers(1, 20),
    steps=st.lists(st.floats(0, 5), max_size=60),
)
def test_admitted_requests_never_exceed_burst_plus_rate_times_elapsed(rate, burst, steps):
    bucket = KeyBucket(RateLimit(rate=rate, burst=burst), now=0.0)
    now, admitted = 0.0, 0
    for step in steps:
        now += step
        admitted += bucket.take(now).allowed
        assert admitted <= burst + rate * now + 1e-6


def test_a_changed_limit_for_a_key_applies_at_once_without_minting_tokens():
    """A reloaded key file may change a key's limit: the next request is judged by the new one."""
    limiter = RateLimiter()
    generous, strict = RateLimit(rate=10, burst=10), RateLimit(rate=1, burst=2)
    assert all(limiter.take("k", generous, 0.0).allowed for _ in range(5))
    first = limiter.take("k", strict, 0.0)
    assert first.allowed and first.limit == 2  # 5 tokens left, capped at the new burst of 2
    assert limiter.take("k", strict, 0.0).allowed
    refused = limiter.take("k", strict, 0.0)
    assert not refused.allowed and refused.retry_after == 1.0
    assert limiter.take("k", generous, 0.0).allowed is False  # raising the limit mints nothing now
    assert limiter.take("k", generous, 0.1).allowed  # ...and refills at the new rate
