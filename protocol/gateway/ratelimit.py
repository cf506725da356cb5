"""Token buckets for per-API-key rate limits.

Pure: no I/O and no clock reads; every call takes ``now`` (seconds, any
monotonic origin). One bucket per key, refilled continuously.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class RateLimit:
    """``rate`` requests per second on average, bursts of up to ``burst``."""

    rate: float
    burst: int

    def __post_init__(self) -> None:
        if not (self.rate > 0 and math.isfinite(self.rate)):
            raise ValueError(f"rate must be a positive number, not {self.rate!r}")
        if self.burst < 1:
            raise ValueError(f"burst must be at least 1, not {self.burst!r}")


@dataclass(frozen=True)
class Decision:
    """The answer for one request, with what the ``X-RateLimit-*`` headers report."""

    allowed: bool
    limit: int
    remaining: int
    #: Seconds until one token is available again (0 when allowed).
    retry_after: float
    #: Seconds until the bucket is full again.
    reset_after: float


class KeyBucket:
    """One key's bucket: ``take(now)`` spends a token if there is one."""

    def __init__(self, limit: RateLimit, now: float) -> None:
        self._limit = limit
        self._tokens = float(limit.burst)
        self._updated = now

    @property
    def limit(self) -> RateLimit:
        return self._limit

    def set_limit(self, limit: RateLimit, now: float) -> None:
        """The key's limit changed (its key file was reloaded): tokens earned so far are kept,
        up to the new burst, and refill at the new rate from ``now``."""
        self._refill(now)
        self._limit = limit
        self._tokens = min(self._tokens, float(limit.burst))

    def _refill(self, now: float) -> None:
        elapsed = max(0.0, now - self._updated)
        self._tokens = min(float(self._limit.burst), self._tokens + elapsed * self._limit.rate)
        self._updated = max(self._updated, now)

    def take(self, now: float) -> Decision:
        self._refill(now)
        allowed = self._tokens >= 1.0
        if allowed:
            self._tokens -= 1.0
        missing = max(0.0, 1.0 - self._tokens)
        return Decision(
            allowed=allowed,
            limit=self._limit.burst,
            remaining=int(self._tokens),
            retry_after=0.0 if allowed else missing / self._limit.rate,
            reset_after=(self._limit.burst - self._tokens) / self._limit.rate,
        )


class RateLimiter:
    """Buckets by key, each with its own limit; keys without a limit always pass."""

    def __init__(self) -> None:
        self._buckets: dict[str, KeyBucket] = {}

    def take(self, key: str, limit: RateLimit | None, now: float) -> Decision | None:
        """Spend one token of ``key``'s bucket; ``None`` when the key is unlimited."""
        if limit is None:
            return None
        bucket = self._buckets.get(key)
        if bucket is None:
            bucket = self._buckets[key] = KeyBucket(limit, now)
        elif bucket.limit != limit:
            bucket.set_limit(limit, now)
        return bucket.take(now)
