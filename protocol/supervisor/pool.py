"""The gateway's worker processes under one supervisor: when to start, restart, stop and kill them.

Rules this file keeps: no I/O, no clock reads (``now`` is every input's last
argument), no randomness but the draw passed in; decisions come out as frozen
effects the supervisor (``infx/supervisor/supervisor.py``) performs in order,
and it wakes the pool at ``next_deadline()`` with ``handle_timeout(now)``.

Each worker slot goes ``SPAWNING`` (asked for a process) → ``STARTING`` (it
runs, its ports not announced yet) → ``LISTENING`` → and, when its process
exits, ``WAITING`` for its restart, or ``STOPPED`` once the pool stops.

- A worker that exits is started again after a backoff that grows while its
  processes keep dying young (before ``stable_after`` seconds), and starts from
  the first step once one lived that long: a crash loop is slowed, a rare crash
  costs one short delay.
- A worker that exits before it ever listened while the pool has never been
  up (every worker listening once) is a start-up failure that restarting will
  not mend (its log says why): the pool stops and the supervisor exits with
  :data:`EXIT_WORKER_FAILED`.
- ``stop`` (SIGTERM to the supervisor) sends every live worker SIGTERM, which
  drains it; a worker still running ``kill_after`` seconds later gets SIGKILL;
  the pool is done (``PoolStopped``) when every process has exited.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Union

from protocol.backoff import Backoff
from protocol.errors import LocalUsageError

__all__ = [
    "EXIT_WORKER_FAILED", "KillWorker", "PoolConfig", "PoolEffect", "PoolListening", "PoolStopped", "SpawnWorker",
    "StopWorker", "WorkerPool", "WorkerRestartDue", "WorkerState",
]

#: The supervisor's exit code when a worker could not start (as when a port cannot be bound).
EXIT_WORKER_FAILED = 1


class WorkerState(enum.Enum):
    SPAWNING = "spawning"
    STARTING = "starting"
    LISTENING = "listening"
    WAITING = "waiting"
    STOPPED = "stopped"


@dataclass(frozen=True)
class SpawnWorker:
    """Start a process for worker ``index`` (its ``attempt``-th since the pool started)."""

    index: int
    attempt: int


@dataclass(frozen=True)
class StopWorker:
    """Send worker ``index``'s process SIGTERM: it drains within its grace period, then exits."""

    index: int


@dataclass(frozen=True)
class KillWorker:
    """Send worker ``index``'s process SIGKILL: it outlived the grace period."""

    index: int


@dataclass(frozen=True)
class WorkerRestartDue:
    """Worker ``index`` exited with ``code`` (None: killed by a signal); it starts again in ``delay`` seconds."""

    index: int
    code: int | None
    delay: float


@dataclass(frozen=True)
class PoolListening:
    """Every worker listens (the first time since the pool started)."""


@dataclass(frozen=True)
class PoolStopped:
    """Every process has exited; the supervisor ends with ``exit_code``; ``reason`` says why when not 0."""

    exit_code: int
    reason: str = ""


PoolEffect = Union[SpawnWorker, StopWorker, KillWorker, WorkerRestartDue, PoolListening, PoolStopped]


@dataclass(frozen=True)
class PoolConfig:
    """``workers``: how many processes; ``kill_after``: seconds between SIGTERM and SIGKILL on stop
    (the gateway's grace period and a margin); ``stable_after``: seconds a process must live for its
    next crash to restart it after the shortest delay; ``restart_backoff``: the delays between restarts."""

    workers: int
    kill_after: float = 40.0
    stable_after: float = 10.0
    restart_backoff: Backoff = field(default_factory=lambda: Backoff(initial=0.5, factor=2.0, cap=30.0, jitter=0.2))

    def __post_init__(self) -> None:
        if self.workers < 1:
            raise LocalUsageError("a worker pool has at least one worker")


@dataclass
class _Slot:
    state: WorkerState = WorkerState.SPAWNING
    attempts: int = 0
    started_at: float = 0.0
    young_exits: int = 0
    restart_at: float | None = None
    ever_listened: bool = False


class WorkerPool:
    """The worker slots of one supervisor; see the module docstring."""

    def __init__(self, config: PoolConfig) -> None:
        self.config = config
        self._slots = [_Slot() for _ in range(config.workers)]
        self._started = False
        self._up = False
        self._stopping = False
        self._kill_at: float | None = None
        self._exit_code = 0
        self._reason = ""
        self._done = False

    # --- inputs -----------------------------------------------------------------------

    def start(self, now: float) -> list[PoolEffect]:
        """Start every worker."""
        if self._started:
            raise LocalUsageError("the pool was started already")
        self._started = True
        return [self._spawn(index) for index in range(len(self._slots))]

    def spawned(self, index: int, now: float) -> list[PoolEffect]:
        """Worker ``index``'s process runs."""
        slot = self._slot(index, WorkerState.SPAWNING)
        slot.state = WorkerState.STARTING
        slot.started_at = now
        return [StopWorker(index)] if self._stopping else []

    def listening(self, index: int, now: float) -> list[PoolEffect]:
        """Worker ``index`` says every port of its listens (and it serves)."""
        slot = self._slots[index]
        if slot.state is not WorkerState.STARTING:
            return []  # a late word from a process that is stopping: nothing to decide
        slot.state = WorkerState.LISTENING
        slot.ever_listened = True
        if not self._up and all(s.state is WorkerState.LISTENING for s in self._slots):
            self._up = True
            return [PoolListening()]
        return []

    def exited(self, index: int, code: int | None, now: float, draw: float = 0.5) -> list[PoolEffect]:
        """Worker ``index``'s process ended with ``code`` (None: a signal); ``draw`` in [0, 1] jitters
        its restart."""
        slot = self._slots[index]
        if slot.state not in (WorkerState.STARTING, WorkerState.LISTENING):
            raise LocalUsageError(f"worker {index} exited while {slot.state.value}")
        if self._stopping:
            slot.state = WorkerState.STOPPED
            return self._maybe_done()
        if not self._up and not slot.ever_listened:
            slot.state = WorkerState.STOPPED
            self._exit_code = EXIT_WORKER_FAILED
            self._reason = f"worker {index} exited with {_said(code)} before it listened"
            return self._begin_stop(now)
        slot.young_exits = slot.young_exits + 1 if now - slot.started_at < self.config.stable_after else 1
        delay = self.config.restart_backoff.delay(slot.young_exits, draw)
        slot.state = WorkerState.WAITING
        slot.restart_at = now + delay
        return [WorkerRestartDue(index, code, delay)]

    def stop(self, now: float) -> list[PoolEffect]:
        """Drain and stop every worker (SIGTERM to the supervisor)."""
        if self._stopping:
            return []
        return self._begin_stop(now)

    def handle_timeout(self, now: float) -> list[PoolEffect]:
        out: list[PoolEffect] = []
        if self._stopping:
            if self._kill_at is not None and now >= self._kill_at:
                self._kill_at = None
                out += [KillWorker(i) for i, s in enumerate(self._slots)
                        if s.state in (WorkerState.STARTING, WorkerState.LISTENING)]
            return out
        for index, slot in enumerate(self._slots):
            if slot.state is WorkerState.WAITING and slot.restart_at is not None and now >= slot.restart_at:
                out.append(self._spawn(index))
        return out

    def next_deadline(self) -> float | None:
        if self._stopping:
            return self._kill_at
        return min((s.restart_at for s in self._slots if s.state is WorkerState.WAITING and s.restart_at is not None),
                   default=None)

    # --- queries ------------------------------------------------------------------------

    def state(self, index: int) -> WorkerState:
        return self._slots[index].state

    @property
    def up(self) -> bool:
        """Every worker listened at least once since the pool started."""
        return self._up

    @property
    def stopping(self) -> bool:
        return self._stopping

    # --- helpers --------------------------------------------------------------------------

    def _slot(self, index: int, expected: WorkerState) -> _Slot:
        slot = self._slots[index]
        if slot.state is not expected:
            raise LocalUsageError(f"worker {index} is {slot.state.value}, not {expected.value}")
        return slot

    def _spawn(self, index: int) -> SpawnWorker:
        slot = self._slots[index]
        slot.state = WorkerState.SPAWNING
        slot.restart_at = None
        slot.attempts += 1
        return SpawnWorker(index, slot.attempts)

    def _begin_stop(self, now: float) -> list[PoolEffect]:
        self._stopping = True
        out: list[PoolEffect] = []
        live = False
        for index, slot in enumerate(self._slots):
            if slot.state in (WorkerState.STARTING, WorkerState.LISTENING):
                out.append(StopWorker(index))
                live = True
            elif slot.state is WorkerState.WAITING:
                slot.state = WorkerState.STOPPED
                slot.restart_at = None
            elif slot.state is WorkerState.SPAWNING:
                live = True  # stopped once it runs (see spawned)
        self._kill_at = now + self.config.kill_after if live else None
        return out + self._maybe_done()

    def _maybe_done(self) -> list[PoolEffect]:
        if self._done or any(s.state is not WorkerState.STOPPED for s in self._slots):
            return []
        self._done = True
        self._kill_at = None
        return [PoolStopped(self._exit_code, self._reason)]


def _said(code: int | None) -> str:
    return "a signal" if code is None else f"code {code}"
