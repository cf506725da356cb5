"""The last minutes of a gateway's traffic per model, in fixed time buckets, for the operator page's charts.

Rules this file keeps: no I/O, no clock reads (``now`` is every input's last
argument). Memory is bounded whatever the traffic: ``buckets`` buckets of
``bucket_seconds`` per (tenant, model label), each a few counters and a
fixed histogram of times to first token (``TTFT_BOUNDS``), so p50 and p99
are read from the histogram (each within one bin, 25 % wide) rather than
from every sample. Model labels are the metrics' bounded labels (a name no
engine lists is ``__other__``), so clients naming random models add nothing.

Requests count in the bucket in which they ended; routing decisions (how
the routing policy placed a task, :class:`~protocol.routing.policy.RoutingDecision`)
in the bucket in which the caller sampled them.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["TTFT_BOUNDS", "Timeline", "TimelineConfig"]

#: Upper bounds (seconds) of the time-to-first-token histogram: 1 ms to about 10 minutes, each
#: bin 25 % wider than the one before; a longer time falls in the last bin.
TTFT_BOUNDS: tuple[float, ...] = tuple(0.001 * 1.25 ** k for k in range(60))


@dataclass(frozen=True, slots=True)
class TimelineConfig:
    """How long the timeline reaches back: ``buckets`` times ``bucket_seconds``."""

    bucket_seconds: float = 5.0
    buckets: int = 72

    def __post_init__(self) -> None:
        if not self.bucket_seconds > 0 or self.buckets < 1:
            raise ValueError("bucket_seconds must be > 0 and buckets >= 1")


@dataclass(slots=True)
class _Bucket:
    requests: int = 0
    errors: int = 0
    tokens_in: int = 0
    tokens_out: int = 0
    ttft: list[int] = field(default_factory=list)  # counts per TTFT_BOUNDS bin, made when first needed
    routing: dict[str, int] = field(default_factory=dict)


class Timeline:
    """Per (tenant, model label): requests, server errors, tokens, TTFT and routing decisions over time."""

    def __init__(self, config: TimelineConfig | None = None) -> None:
        self.config = config or TimelineConfig()
        # (tenant, model) -> bucket index (time // bucket_seconds) -> bucket.
        self._series: dict[tuple[str, str], dict[int, _Bucket]] = {}

    def _bucket(self, tenant: str, model: str, now: float) -> _Bucket:
        index = self._index(now)
        buckets = self._series.setdefault((tenant, model), {})
        bucket = buckets.get(index)
        if bucket is None:
            bucket = buckets[index] = _Bucket()
            oldest = index - self.config.buckets
            for old in [i for i in buckets if i <= oldest]:
                del buckets[old]
        return bucket

    def _index(self, now: float) -> int:
        return math.floor(now / self.config.bucket_seconds)

    def request_ended(self, tenant: str, model: str, status: int, first_token_seconds: float | None,
                      tokens_in: int | None, tokens_out: int | None, now: float) -> None:
        """A request for ``model`` (its label) ended with ``status``; a 5xx counts as an error."""
        bucket = self._bucket(tenant, model, now)
        bucket.requests += 1
        if status >= 500:
            bucket.errors += 1
        bucket.tokens_in += tokens_in or 0
        bucket.tokens_out += tokens_out or 0
        if first_token_seconds is not None:
            if not bucket.ttft:
                bucket.ttft = [0] * len(TTFT_BOUNDS)
            bucket.ttft[min(bisect_left(TTFT_BOUNDS, first_token_seconds), len(TTFT_BOUNDS) - 1)] += 1

    def routed(self, tenant: str, model: str, counts: Mapping[str, int], now: float) -> None:
        """Tasks of ``model`` the routing policy placed since the last call, by decision."""
        if not any(counts.values()):
            return
        routing = self._bucket(tenant, model, now).routing
        for decision, count in counts.items():
            if count:
                routing[decision] = routing.get(decision, 0) + count

    def forget_idle(self, now: float) -> None:
        """Drop the series with no bucket left in the window (a model gone for long)."""
        oldest = self._index(now) - self.config.buckets
        for key in [k for k, buckets in self._series.items() if all(i <= oldest for i in buckets)]:
            del self._series[key]

    def series(self, now: float, tenants: Iterable[str] | None = None) -> dict[str, Any]:
        """The window ending with the bucket ``now`` falls in, as per-second rates and TTFT
        quantiles per (tenant, model), oldest bucket first; with ``tenants``, theirs alone."""
        wanted = None if tenants is None else set(tenants)
        width = self.config.bucket_seconds
        last = self._index(now)
        first = last - self.config.buckets + 1
        models = []
        for (tenant, model), buckets in sorted(self._series.items()):
            if wanted is not None and tenant not in wanted:
                continue
            window = [buckets.get(i) for i in range(first, last + 1)]
            if not any(window):
                continue
            decisions = sorted({d for b in window if b for d in b.routing})
            models.append({
                "tenant": tenant,
                "model": model,
                "requests_per_second": [_rate(b.requests if b else 0, width) for b in window],
                "errors_per_second": [_rate(b.errors if b else 0, width) for b in window],
                "input_tokens_per_second": [_rate(b.tokens_in if b else 0, width) for b in window],
                "output_tokens_per_second": [_rate(b.tokens_out if b else 0, width) for b in window],
                "ttft_p50_seconds": [_quantile(b.ttft, 0.5) if b else None for b in window],
                "ttft_p99_seconds": [_quantile(b.ttft, 0.99) if b else None for b in window],
                "routing_per_second": {d: [_rate(b.routing.get(d, 0) if b else 0, width) for b in window]
                                       for d in decisions},
            })
        return {"bucket_seconds": width, "buckets": self.config.buckets, "end": (last + 1) * width,
                "models": models}


def _rate(count: int, width: float) -> float:
    return round(count / width, 3) if count else 0.0


def _quantile(histogram: list[int], q: float) -> float | None:
    """The ``q`` quantile of a TTFT histogram: the geometric middle of the bin it falls in."""
    total = sum(histogram)
    if not total:
        return None
    rank = q * total
    seen = 0
    for i, count in enumerate(histogram):
        seen += count
        if seen >= rank and count:
            upper = TTFT_BOUNDS[i]
            lower = TTFT_BOUNDS[i - 1] if i else upper / 1.25
            return round(math.sqrt(lower * upper), 4)
    return round(TTFT_BOUNDS[-1], 4)
