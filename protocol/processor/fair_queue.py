"""The order in which held requests get an engine slot: criticality first, then fair across flows; pure.

Rules this file keeps: no I/O, no clock, no randomness; the same inputs give
the same order in every process (ties go to the earlier arrival), so the
simulation replays a seed exactly.

One :class:`HeldQueue` holds the tasks of one (tenant, model) that wait for
an engine. Its order:

1. **Criticality bands**, strictly: every ``critical`` task before any
   ``standard`` one, every ``standard`` before any ``sheddable`` one.
2. **Within a band, the flow holding the fewest engine slots per weight**
   (a flow is one caller sharing the tenant's engines: an API key, or the
   name several keys share; ``served`` tells the queue how many slots each
   holds, :class:`protocol.processor.fair_share.FairShares`). Fairness by slots held
   rather than by slots granted: a caller whose requests run long or come
   often gets the slots it needs up to its share, and one that bursts 1,000
   requests takes a freed slot only while it holds no more than the others.
3. **Among flows holding as much, weighted fair queueing** by virtual finish
   time: a flow's next task finishes at ``start + 1/weight``, where ``start``
   is the later of the band's virtual clock (the finish time of the task
   served last) and the flow's own last finish. Each flow's tasks keep their
   arrival order. A flow that leaves and comes back cannot claim slots for
   the time it was away (its start is never before the clock), nor skip its
   debt (its last finish is kept while it is ahead).

Removing a task without serving it (cancel, queue timeout) charges nothing:
the flow's next task takes its place in the turn. Memory is one entry per
held task plus one per flow that holds tasks or is ahead of the clock; a
band that empties forgets its flows (a new busy period starts even).
``peek`` costs O(flows with held tasks) (callers waiting at once are few;
a flow's tasks are one entry), as does each band's head from ``heads``;
``take`` and ``remove`` O(1).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from enum import Enum

from protocol.errors import LocalUsageError, RemoteProtocolError

__all__ = ["Criticality", "CriticalityRefused", "FairQueueUsageError", "HeldQueue", "parse_criticality",
           "requested_criticality"]


#: The weights a caller may have: shares from a thousandth to a thousand times the default 1
#: (a million to one between two callers). Past them ``1/weight`` in the virtual times would
#: lose its precision or overflow, and fairness with it.
MIN_WEIGHT, MAX_WEIGHT = 1e-3, 1e3


def weight_problem(weight: object) -> str | None:
    """Why ``weight`` cannot be a caller's weight, or None if it can."""
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not MIN_WEIGHT <= weight <= MAX_WEIGHT:
        return f"weight must be a number from {MIN_WEIGHT:g} to {MAX_WEIGHT:g}, got {weight!r}"
    return None


class FairQueueUsageError(LocalUsageError):
    """The caller drove the queue wrongly (a task twice, an unknown task, a bad weight)."""


class Criticality(Enum):
    """How much a request matters when engines are saturated (the Gateway API Inference
    Extension's three levels): ``critical`` is dequeued first, ``sheddable`` refused first."""

    CRITICAL = "critical"
    STANDARD = "standard"
    SHEDDABLE = "sheddable"

    @property
    def rank(self) -> int:
        """0 for the most important; a lower rank is served first."""
        return _RANK[self]


_RANK = {Criticality.CRITICAL: 0, Criticality.STANDARD: 1, Criticality.SHEDDABLE: 2}


def parse_criticality(value: str) -> Criticality:
    """``critical`` / ``standard`` / ``sheddable`` (any case); raises ValueError naming the choices."""
    try:
        return Criticality(value.strip().lower())
    except ValueError:
        raise ValueError(f"criticality must be critical, standard or sheddable, got {value!r}") from None


class CriticalityRefused(ValueError, RemoteProtocolError):
    """A request asked for a criticality it may not have (unknown, or above its key's)."""


def requested_criticality(allowed: Criticality, admin: bool, header: str | None) -> Criticality:
    """A request's criticality: its key's, or the one its header asks for.

    The header may only lower what the key allows (a critical key's batch job
    may mark itself sheddable), except for an admin key, which may set any;
    asking for more is refused rather than quietly lowered, so that the
    client learns at once that its request would not be treated as it thinks.
    """
    if header is None or not header.strip():
        return allowed
    try:
        wanted = parse_criticality(header)
    except ValueError as e:
        raise CriticalityRefused(str(e)) from None
    if wanted.rank < allowed.rank and not admin:
        raise CriticalityRefused(f"this API key allows criticality {allowed.value} at most, not {wanted.value}")
    return wanted


@dataclass
class _Flow:
    weight: float
    tasks: dict[str, None] = field(default_factory=dict)
    head_finish: float = 0.0
    last_finish: float = 0.0


@dataclass
class _Band:
    clock: float = 0.0
    flows: dict[str, _Flow] = field(default_factory=dict)
    size: int = 0


@dataclass(frozen=True, slots=True)
class _Entry:
    flow: str
    criticality: Criticality
    seq: int


class HeldQueue:
    """The held tasks of one (tenant, model); see the module docstring for the order."""

    def __init__(self) -> None:
        self._entries: dict[str, _Entry] = {}
        self._bands = [_Band() for _ in Criticality]
        self._seq = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[str]:
        """The held task ids in arrival order."""
        return iter(list(self._entries))

    def __contains__(self, task_id: object) -> bool:
        return task_id in self._entries

    def add(self, task_id: str, flow: str = "", weight: float = 1.0,
            criticality: Criticality = Criticality.STANDARD) -> None:
        """Hold ``task_id`` for ``flow`` (whose share is ``weight``, > 0) at ``criticality``."""
        if task_id in self._entries:
            raise FairQueueUsageError(f"task {task_id!r} is already held")
        problem = weight_problem(weight)
        if problem:
            raise FairQueueUsageError(problem)
        band = self._bands[criticality.rank]
        state = band.flows.get(flow)
        if state is None:
            state = band.flows[flow] = _Flow(weight, last_finish=band.clock)
        state.weight = weight
        was_idle = not state.tasks
        if was_idle:
            state.head_finish = max(band.clock, state.last_finish) + 1.0 / weight
        state.tasks[task_id] = None
        band.size += 1
        self._entries[task_id] = _Entry(flow, criticality, self._seq)
        self._seq += 1

    def peek(self, served: Callable[[str], float] = lambda flow: 0.0) -> str | None:
        """The task to serve next, or None when nothing is held; ``served(flow)`` is the
        engine slots ``flow`` holds per weight (see the module docstring)."""
        return next(self.heads(served), None)

    def heads(self, served: Callable[[str], float] = lambda flow: 0.0) -> Iterator[str]:
        """The task each criticality band would serve next, most important band first: the
        next to try when the bands above it may take no free slot (an engine's reserve)."""
        for band in self._bands:
            best: tuple[float, float, int] | None = None
            chosen: _Flow | None = None
            for name, flow in band.flows.items():
                if flow.tasks:
                    rank = (served(name), flow.head_finish, self._head_seq(flow))
                    if best is None or rank < best:
                        best, chosen = rank, flow
            if chosen is not None:
                yield next(iter(chosen.tasks))

    def take(self, task_id: str) -> None:
        """``task_id`` got a slot: it leaves, and its flow's turn is spent."""
        entry, band, flow = self._locate(task_id)
        first = next(iter(flow.tasks)) == task_id
        del flow.tasks[task_id]
        if first:
            band.clock = max(band.clock, flow.head_finish)
            flow.last_finish = flow.head_finish
            if flow.tasks:
                flow.head_finish = flow.last_finish + 1.0 / flow.weight
        self._forget(task_id, entry, band)

    def remove(self, task_id: str) -> None:
        """``task_id`` leaves unserved (cancelled, timed out, shed): its flow is charged nothing."""
        entry, band, flow = self._locate(task_id)
        first = next(iter(flow.tasks)) == task_id
        del flow.tasks[task_id]
        if first and not flow.tasks:
            flow.last_finish = flow.head_finish - 1.0 / flow.weight
        self._forget(task_id, entry, band)

    def _head_seq(self, flow: _Flow) -> int:
        return self._entries[next(iter(flow.tasks))].seq

    def _locate(self, task_id: str) -> tuple[_Entry, _Band, _Flow]:
        entry = self._entries.get(task_id)
        if entry is None:
            raise FairQueueUsageError(f"task {task_id!r} is not held")
        band = self._bands[entry.criticality.rank]
        return entry, band, band.flows[entry.flow]

    def _forget(self, task_id: str, entry: _Entry, band: _Band) -> None:
        del self._entries[task_id]
        band.size -= 1
        if not band.size:
            band.flows.clear()  # idle: the next busy period starts even
            return
        flow = band.flows[entry.flow]
        if not flow.tasks and flow.last_finish <= band.clock:
            del band.flows[entry.flow]  # nothing held and nothing owed: as good as new
