"""One deployment's single-flight cold start: its phase, its held requests and its write.

Rules this file keeps: no I/O, no clock reads (``now`` comes in, last); the
phase moves only along :data:`PHASE_TRANSITIONS` (anything else is
:class:`~protocol.scaling.types.ScalingLocalError`). The first held request
begins one cold start and one :class:`~protocol.scaling.types.ScaleWrite`;
every further request joins it. :class:`protocol.scaling.scaler.Scaler` decides
when; this record keeps what a cold start is, so no other part of the
scaler touches its fields.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Hashable
from dataclasses import dataclass, field

from protocol.scaling.labels import DeploymentKey, ScalingSettings
from protocol.scaling.types import ScaleReason, ScaleWrite, ScalingLocalError

__all__ = ["ColdStart", "ColdStartPhase", "Hold", "PHASE_TRANSITIONS", "cold_start_target"]


def cold_start_target(held: int, settings: ScalingSettings) -> int:
    """Replicas a cold start asks for: ``clamp(ceil(held / target), max(1, min), max)``."""
    want = math.ceil(held / settings.target_load) if held else 0
    return min(max(want, max(1, settings.min_replicas)), settings.max_replicas)


class ColdStartPhase(enum.Enum):
    """Where a deployment's single-flight cold start is."""

    IDLE = "idle"
    """No cold start; a held request begins one."""
    WRITING = "writing"
    """A ScaleWrite is out; its result is awaited."""
    WAITING = "waiting"
    """Replicas are requested; waiting for an engine to report a model ready."""


PHASE_TRANSITIONS: dict[ColdStartPhase, frozenset[ColdStartPhase]] = {
    ColdStartPhase.IDLE: frozenset({ColdStartPhase.WRITING, ColdStartPhase.WAITING}),
    ColdStartPhase.WRITING: frozenset({ColdStartPhase.WAITING, ColdStartPhase.IDLE}),
    ColdStartPhase.WAITING: frozenset({ColdStartPhase.WRITING, ColdStartPhase.IDLE}),
}


@dataclass
class Hold:
    """One request waiting for ``model``'s deployment ``key`` since ``since``, until ``deadline``."""

    request_id: Hashable
    key: DeploymentKey
    model: str
    since: float
    deadline: float


@dataclass
class ColdStart:
    """The cold start of deployment ``key``."""

    key: DeploymentKey
    phase: ColdStartPhase = ColdStartPhase.IDLE
    started_at: float | None = None
    """When the first request of this cold start was held (None: none is running)."""
    timed: bool = False
    """Whether an engine was ready since ``started_at`` (its time is counted once)."""
    retry_write_at: float | None = None
    """When a failed write is tried again."""
    write_out: ScaleWrite | None = None
    """The cold-start write being performed."""
    holds: dict[Hashable, Hold] = field(default_factory=dict)

    def set_phase(self, phase: ColdStartPhase) -> None:
        if phase is self.phase:
            return
        if phase not in PHASE_TRANSITIONS[self.phase]:
            raise ScalingLocalError(f"{self.key}: cold start cannot go {self.phase.value} -> {phase.value}")
        self.phase = phase

    def start(self, now: float) -> None:
        """A request is held: the cold start runs from now, unless one runs already."""
        if self.started_at is None:
            self.started_at, self.timed = now, False

    def finished(self, now: float) -> float | None:
        """An engine is ready: the seconds this cold start took, once (None: none runs, or it was counted).
        The engine may come before the write's answer (a pod already starting): it ended then too."""
        if self.started_at is None or self.timed or self.phase is ColdStartPhase.IDLE:
            return None
        self.timed = True
        return now - self.started_at

    def begin_write(self, replicas: int, settings: ScalingSettings, now: float) -> ScaleWrite:
        """Ask for the replicas the held requests need, from ``replicas``."""
        self.start(now)
        write = ScaleWrite(self.key, replicas, cold_start_target(len(self.holds), settings), ScaleReason.COLD_START)
        self.set_phase(ColdStartPhase.WRITING)
        self.write_out = write
        return write

    def hold_left(self) -> None:
        """With nobody waiting, a cold start has nothing left to time out (a write still lands)."""
        if self.holds:
            return
        self.retry_write_at = None
        if self.phase is not ColdStartPhase.WRITING:
            self.set_phase(ColdStartPhase.IDLE)
            self.started_at = None

    def abandon(self) -> None:
        """Its held requests were failed (crash loop, startup timeout): the next request starts anew."""
        self.started_at = None
        if self.phase is ColdStartPhase.WAITING:
            self.set_phase(ColdStartPhase.IDLE)

    def timed_out(self, startup_timeout: float, now: float) -> bool:
        """Whether requests wait and the cold start ran past ``startup_timeout``."""
        return self.started_at is not None and bool(self.holds) and now >= self.started_at + startup_timeout

    def deadline(self, startup_timeout: float) -> float:
        """When a retry or the startup timeout falls due (``math.inf``: never)."""
        best = math.inf if self.retry_write_at is None else self.retry_write_at
        if self.started_at is not None and self.holds:
            best = min(best, self.started_at + startup_timeout)
        return best
