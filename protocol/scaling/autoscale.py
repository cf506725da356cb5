"""The autoscaler's arithmetic: load per model, and one deployment's desired replicas per tick.

Rules this file keeps: no I/O, no clock reads (``now`` comes in, last); no
effects: :class:`protocol.scaling.scaler.Scaler` turns a changed desired count into
a :class:`~protocol.scaling.types.ScaleWrite`. Load is started requests per
second (``rps``) or in-flight plus held (``capacity``), averaged over a
stable and a panic window; a burst (panic) only scales up; scale-down waits
out its window, takes the highest recommendation seen in it, and halves at
most per tick; every step is bounded by the scaling factor.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from protocol.scaling.labels import ScalingSettings
from protocol.scaling.types import ScalerConfig, ScaleWrite

__all__ = ["Autoscale", "Load"]


@dataclass
class Load:
    """In-process load of one model: counters, per-second start buckets, last activity."""

    in_flight: int = 0
    reported: int = 0
    last_activity: float = -math.inf
    buckets: deque[list[float]] = field(default_factory=deque)
    """[second, starts] pairs, oldest first, covering the stable window."""
    bucket_total: float = 0.0

    def started(self, now: float) -> None:
        self._add(math.floor(now), 1.0)

    def started_over(self, since: float, count: float, now: float) -> None:
        """``count`` starts spread evenly over the whole seconds after ``since``'s, up to ``now``'s."""
        last = math.floor(now)
        seconds = max(1, last - math.floor(since))
        for second in range(last - seconds + 1, last + 1):
            self._add(second, count / seconds)

    def _add(self, second: int, count: float) -> None:
        # Seconds stay in order; a peer's report may fill seconds already past.
        buckets = self.buckets
        i = len(buckets)
        while i and buckets[i - 1][0] > second:
            i -= 1
        if i and buckets[i - 1][0] == second:
            buckets[i - 1][1] += count
        else:
            buckets.insert(i, [second, count])
        self.bucket_total += count

    def rates(self, stable: float, panic: float, now: float) -> tuple[float, float]:
        """(stable, panic) started requests per second, ending at ``now``."""
        horizon = math.floor(now) - stable
        while self.buckets and self.buckets[0][0] <= horizon:
            self.bucket_total -= self.buckets.popleft()[1]
        panic_horizon = math.floor(now) - panic
        recent = 0.0
        for second, count in reversed(self.buckets):
            if second <= panic_horizon:
                break
            recent += count
        return self.bucket_total / stable, recent / panic


@dataclass
class Autoscale:
    """One deployment's autoscaler state between ticks."""

    write_out: ScaleWrite | None = None
    """The autoscaler's write being performed (the next tick skips the deployment until it ends)."""
    samples: deque[tuple[float, float]] = field(default_factory=deque)
    """(time, capacity load) per tick, covering the stable window."""
    sample_total: float = 0.0
    panic_until: float = -math.inf
    down_since: float | None = None
    recommendations: deque[tuple[float, int]] = field(default_factory=deque)
    """(time, desired) over the scale-down window, desired strictly decreasing: a sliding max."""
    desired: int | None = None

    def capacity(self, value: float, config: ScalerConfig, now: float) -> tuple[float, float]:
        """Sample ``value`` (in-flight plus held) now: the (stable, panic) window averages."""
        self.samples.append((now, value))
        self.sample_total += value
        while self.samples and self.samples[0][0] <= now - config.stable_window:
            self.sample_total -= self.samples.popleft()[1]
        recent = count = 0.0
        for at, sample in reversed(self.samples):
            if at <= now - config.panic_window:
                break
            recent += sample
            count += 1
        return self.sample_total / len(self.samples), recent / count

    def decide(self, current: int, stable: float, panic: float, settings: ScalingSettings,
               config: ScalerConfig, blocked: bool, now: float) -> int:
        """The replicas wanted now from ``current`` (kept as :attr:`desired`); ``blocked`` forbids going up."""
        floor = max(1, settings.min_replicas)
        want_stable = math.ceil(stable / settings.target_load)
        want_panic = math.ceil(panic / settings.target_load)
        if want_panic >= config.panic_threshold * current:
            self.panic_until = now + config.panic_window
        if now < self.panic_until:
            want = max(want_panic, want_stable, current)
        else:
            want = want_stable
        want = min(max(want, floor), settings.max_replicas)
        recs = self.recommendations
        while recs and recs[-1][1] <= want:
            recs.pop()
        recs.append((now, want))
        while recs[0][0] <= now - config.scale_down_window:
            recs.popleft()
        if want < current:
            if self.down_since is None:
                self.down_since = now
            if now - self.down_since < config.scale_down_window:
                self.desired = current
                return current
            want = max(recs[0][1], math.ceil(current * (1 - config.max_scale_down_ratio)),
                       current - settings.step, floor)
        else:
            self.down_since = None
            want = min(want, current + settings.step)
        if want > current and blocked:
            want = current
        self.desired = want
        return want
