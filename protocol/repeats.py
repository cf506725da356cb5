"""Repeated identical failures, logged once with a count rather than once per retry.

No I/O, no clock reads: ``now`` is an argument. A reconnect loop that fails
the same way every few seconds (a wrong key, a gateway that is not there)
would otherwise write the same lines forever; an operator needs the first
occurrence, then how often it went on, then that it stopped.

Shape: call :meth:`RepeatSuppressor.occurred` for every failure and
:meth:`RepeatSuppressor.cleared` on success; each returns the
:class:`RepeatReport` to log, or None when nothing new is worth a line.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from enum import Enum

__all__ = ["RepeatKind", "RepeatReport", "RepeatSuppressor"]


class RepeatKind(Enum):
    """Why a report is due."""

    FIRST = "first"  # the first occurrence of this failure (or a different failure than before)
    ONGOING = "ongoing"  # the same failure went on for a summary interval
    STOPPED = "stopped"  # the failure gave way to success or to a different failure


@dataclass(frozen=True, slots=True)
class RepeatReport:
    """One line worth logging: ``count`` occurrences of ``message`` over ``seconds``
    (FIRST: 1 over 0; ONGOING: those since the last line; STOPPED: the whole run)."""

    key: Hashable
    kind: RepeatKind
    message: str
    count: int
    seconds: float

    def text(self) -> str:
        """A readable line for the report."""
        if self.kind is RepeatKind.FIRST:
            return self.message
        if self.kind is RepeatKind.ONGOING:
            return f"{self.message} (repeated {self.count} more times in {self.seconds:.0f}s)"
        return f"{self.message} (happened {self.count} times in {self.seconds:.0f}s, now stopped)"


@dataclass(slots=True)
class _Run:
    message: str
    started: float
    total: int
    unreported: int
    reported_at: float


class RepeatSuppressor:
    """Tracks one run of identical failures per key (a stream, a peer, a channel).

    ``summary_interval`` seconds after the last line about a run that goes
    on, the next occurrence reports the count so far; a run that changes
    its message or clears reports how many times it happened in all. At most
    ``max_keys`` runs are tracked (keys may come from the network, such as the
    hosts that present a wrong key): a new one past it closes the oldest,
    which reports its count.
    """

    def __init__(self, summary_interval: float = 300.0, max_keys: int = 1024) -> None:
        if summary_interval <= 0:
            raise ValueError("summary_interval must be > 0")
        if max_keys < 1:
            raise ValueError("max_keys must be >= 1")
        self.summary_interval = summary_interval
        self.max_keys = max_keys
        self._runs: dict[Hashable, _Run] = {}

    def occurred(self, now: float, key: Hashable, message: str) -> list[RepeatReport]:
        """A failure happened: the lines to log now (none while a run is being counted)."""
        run = self._runs.get(key)
        reports: list[RepeatReport] = []
        if run is not None and run.message != message:
            reports += self._stop(now, key, run)
            run = None
        if run is None:
            if len(self._runs) >= self.max_keys:
                oldest = next(iter(self._runs))
                reports += self._stop(now, oldest, self._runs[oldest])
            self._runs[key] = _Run(message, now, 1, 0, now)
            reports.append(RepeatReport(key, RepeatKind.FIRST, message, 1, 0.0))
            return reports
        run.total += 1
        run.unreported += 1
        if now - run.reported_at >= self.summary_interval:
            reports.append(RepeatReport(key, RepeatKind.ONGOING, message, run.unreported, now - run.reported_at))
            run.unreported = 0
            run.reported_at = now
        return reports

    def cleared(self, now: float, key: Hashable) -> list[RepeatReport]:
        """The failing thing succeeded: a closing line if the failure had repeated."""
        run = self._runs.get(key)
        return [] if run is None else self._stop(now, key, run)

    def repeating(self, key: Hashable) -> int:
        """How many times the current run of ``key`` has happened (0: none)."""
        run = self._runs.get(key)
        return 0 if run is None else run.total

    def _stop(self, now: float, key: Hashable, run: _Run) -> list[RepeatReport]:
        del self._runs[key]
        if run.total == 1:
            return []
        return [RepeatReport(key, RepeatKind.STOPPED, run.message, run.total, now - run.started)]
