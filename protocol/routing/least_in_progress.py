"""The ``least_in_progress`` policy (LLMariner's): local engines first, then the fewest tasks in
flight, then engine id; pure, no I/O, no clock.

It keeps nothing of its own, so it is also the choice of the ``affinity`` policy for a task
without hints, and the processor's when it asks which engine would take a task but for the
caps (``Router.least_in_progress``).
"""

from __future__ import annotations

from collections.abc import Set
from typing import TYPE_CHECKING

from protocol.routing.hints import RoutingHints
from protocol.routing.policy import HeldBack, Policy
from protocol.routing.pools import Pool

if TYPE_CHECKING:  # protocol.processor.types holds RoutingConfig in ProcessorConfig
    from protocol.processor.types import EngineKey

__all__ = ["LeastInProgress", "least_in_progress"]


def least_in_progress(pool: Pool, avoid: Set[str], held_back: HeldBack) -> EngineKey | None:
    """The engine of ``pool`` not held back that ranks first: not avoided, local, fewest tasks of
    this processor in flight, then engine id (a total order, so the choice is deterministic)."""
    best: EngineKey | None = None
    best_rank: tuple[bool, bool, int, str] | None = None
    for key, member in pool.members.items():
        rank = (key.engine_id in avoid, not member.local, member.in_flight, key.engine_id)
        # Ranks are distinct (engine ids are), so one that cannot win needs no ``held_back``.
        if (best_rank is None or rank < best_rank) and not held_back(key):
            best, best_rank = key, rank
    return best


class LeastInProgress(Policy):
    """Local first, then the fewest tasks in flight, then engine id; hints play no part."""

    def choose(self, pool: Pool, hints: RoutingHints | None, avoid: Set[str], held_back: HeldBack) -> EngineKey | None:
        return least_in_progress(pool, avoid, held_back)
