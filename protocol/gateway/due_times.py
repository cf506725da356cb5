"""When each of many things is next due, in one heap; pure.

The gateway's dials (:mod:`protocol.gateway.dialling`) have a dialled peer (or a
redial) per peer, each with its own next deadline; asking every one of them for
it on every call costs the number of peers, and a gateway calls ``next_deadline()`` after every input. Here a thing's
due time is set when it changes, the earliest is read from a heap, and entries
made stale by a later ``set`` are dropped lazily when they surface.
"""

from __future__ import annotations

import heapq
from collections.abc import Hashable
from typing import Generic, TypeVar

__all__ = ["DueTimes"]

K = TypeVar("K", bound=Hashable)


class DueTimes(Generic[K]):
    """Due times by key; ``order`` breaks ties and orders what :meth:`pop_due` returns."""

    def __init__(self) -> None:
        self._due: dict[K, tuple[float, int]] = {}
        self._heap: list[tuple[float, int, K]] = []

    def __len__(self) -> int:
        return len(self._due)

    def set(self, key: K, due: float | None, order: int) -> None:
        """``key`` is next due at ``due`` (None: not at all)."""
        if due is None:
            self._due.pop(key, None)
            return
        if self._due.get(key) == (due, order):
            return
        self._due[key] = (due, order)
        heapq.heappush(self._heap, (due, order, key))
        if len(self._heap) > 2 * len(self._due) + 64:  # mostly stale: rebuild from what counts
            self._heap = [(at, rank, k) for k, (at, rank) in self._due.items()]
            heapq.heapify(self._heap)

    def earliest(self) -> float | None:
        """The earliest due time, or None."""
        heap = self._heap
        while heap and self._due.get(heap[0][2]) != heap[0][:2]:
            heapq.heappop(heap)
        return heap[0][0] if heap else None

    def pop_due(self, now: float) -> list[K]:
        """The keys due by ``now``, by ``order``; they are no longer due until set again."""
        due: list[tuple[int, K]] = []
        heap = self._heap
        while heap and heap[0][0] <= now:
            at, order, key = heapq.heappop(heap)
            if self._due.get(key) == (at, order):
                del self._due[key]
                due.append((order, key))
        due.sort(key=lambda item: item[0])
        return [key for _, key in due]
