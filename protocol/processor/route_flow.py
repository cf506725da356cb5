"""Which routes are not draining, since when, and which are stuck: the processor's backpressure.

No I/O, no clock reads: ``now`` comes in. The adapter of a route (a local
engine's stream, an accepted peer's stream) says when its stream stops draining
(its send buffer is over the high-water mark, or it refused a task at its
queue cap) and when it drains again; the processor routes no task to a
blocked route, and closes one that stays blocked for ``stuck_after`` seconds
(its tasks fail over like any lost engine's). Blocked means blocked without
a break: any drain starts the clock again, so a slow but live reader is never
taken for a stuck one.
"""

from __future__ import annotations

from protocol.processor.keys import Route

__all__ = ["MAX_ROUTE_QUEUED_BYTES", "RouteFlow"]

#: Bytes of tasks a route's stream may hold queued (not yet taken by its peer's flow
#: control) before it refuses further tasks, which are then routed elsewhere; one task
#: more may be queued past it. The default of ``--route-max-queued-bytes``.
MAX_ROUTE_QUEUED_BYTES = 4 * 1024 * 1024


class RouteFlow:
    """The blocked routes and when each became blocked."""

    def __init__(self, stuck_after: float | None) -> None:
        self.stuck_after = stuck_after
        self._since: dict[Route, float] = {}

    def __contains__(self, route: Route) -> bool:
        return route in self._since

    def __len__(self) -> int:
        return len(self._since)

    def block(self, route: Route, now: float) -> None:
        """``route`` stopped draining at ``now`` (a repeated report keeps the first time)."""
        self._since.setdefault(route, now)

    def unblock(self, route: Route) -> bool:
        """``route`` drains again (or is gone); whether it was blocked."""
        return self._since.pop(route, None) is not None

    def next_deadline(self) -> float | None:
        """When the longest-blocked route becomes stuck, if any route is blocked."""
        if self.stuck_after is None or not self._since:
            return None
        return min(self._since.values()) + self.stuck_after

    def stuck(self, now: float) -> list[Route]:
        """The routes blocked for ``stuck_after`` seconds by ``now``, in the order they
        became blocked. They stay blocked until ``unblock``: while the processor
        closes one, tasks failing over must not land on the next one it will close."""
        if self.stuck_after is None:
            return []
        limit = now - self.stuck_after
        return [route for route, since in sorted(self._since.items(), key=lambda item: item[1]) if since <= limit]
