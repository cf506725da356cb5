"""One virtual clock and a seeded scheduler: the only source of time and order in the simulation.

Rules this file keeps: nothing here reads the real clock or uses global
randomness. Every event is a callable due at a virtual time; the scheduler
runs the earliest, and breaks ties between events due at the same time with
its seeded RNG, so that one seed is one interleaving and another seed is
another. Timers of pure machines are *armed* under a key: re-arming a key
supersedes its previous entry, so each machine has at most one live wake-up.
"""

from __future__ import annotations

import heapq
import random
from collections.abc import Callable, Hashable

#: A heap entry: (when, tiebreak, seq, action, key, label). A plain tuple compares in C;
#: ``seq`` is unique, so the comparison never reaches the action.
_Entry = tuple[float, float, int, Callable[[], None], Hashable, str]


class Scheduler:
    """Virtual time plus a heap of due actions; ``step()`` runs exactly one of them."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.now = 0.0
        self._heap: list[_Entry] = []
        self._seq = 0
        # key -> seq of its live entry (superseded entries are skipped when popped).
        self._armed: dict[Hashable, int] = {}
        self._live_when: dict[Hashable, float] = {}

    def at(self, when: float, action: Callable[[], None], label: str = "") -> None:
        """Run ``action`` at virtual time ``when`` (never in the past)."""
        self._seq += 1
        heapq.heappush(self._heap, (max(when, self.now), self.rng.random(), self._seq, action, None, label))

    def after(self, delay: float, action: Callable[[], None], label: str = "") -> None:
        self.at(self.now + delay, action, label)

    def arm(self, key: Hashable, when: float | None, action: Callable[[], None], label: str = "") -> None:
        """Make ``action`` the one wake-up of ``key`` at ``when`` (None disarms)."""
        live = self._armed.get(key)
        if when is None:
            if live is not None:
                del self._armed[key]
                del self._live_when[key]
            return
        when = max(when, self.now)
        if live is not None and self._live_when.get(key) == when:
            return
        self._seq += 1
        self._armed[key] = self._seq
        self._live_when[key] = when
        heapq.heappush(self._heap, (when, self.rng.random(), self._seq, action, key, label))

    def next_time(self) -> float | None:
        """When the next live action is due, or None if none is scheduled."""
        self._drop_stale()
        return self._heap[0][0] if self._heap else None

    def step(self) -> str | None:
        """Advance the clock to the next live action and run it; None when nothing is left."""
        self._drop_stale()
        if not self._heap:
            return None
        when, _, _, action, key, label = heapq.heappop(self._heap)
        if key is not None:
            del self._armed[key]
            del self._live_when[key]
        self.now = when
        action()
        return label

    def _drop_stale(self) -> None:
        heap = self._heap
        while heap:
            _, _, seq, _, key, _ = heap[0]
            if key is None or self._armed.get(key) == seq:
                return
            heapq.heappop(heap)
