"""The ``round_robin`` policy: each (tenant, model)'s engines in turn, by engine id; pure.

It keeps, per pool, the engines in id order and whose turn is next. The order is rebuilt when
the pool's members change; the turn carries on from where it was (and starts again at the
first engine when the pool is gone and comes back).
"""

from __future__ import annotations

from collections.abc import Set
from dataclasses import dataclass
from typing import TYPE_CHECKING

from protocol.routing.config import RoutingConfig
from protocol.routing.hints import RoutingHints
from protocol.routing.policy import HeldBack, Policy
from protocol.routing.pools import Member, Pool, Pools

if TYPE_CHECKING:  # protocol.processor.types holds RoutingConfig in ProcessorConfig
    from protocol.processor.types import EngineKey

__all__ = ["RoundRobin"]


@dataclass(slots=True)
class _Turns:
    """One pool's engines in id order (None: to rebuild) and the index of the next in turn."""

    order: list[Member] | None = None
    turn: int = 0


class RoundRobin(Policy):
    """Each pool's engines in turn, by engine id; those in ``avoid`` only when no other may."""

    def __init__(self, config: RoutingConfig, pools: Pools) -> None:
        super().__init__(config, pools)
        self._turns: dict[tuple[str, str], _Turns] = {}

    def choose(self, pool: Pool, hints: RoutingHints | None, avoid: Set[str], held_back: HeldBack) -> EngineKey | None:
        turns = self._turns.get((pool.tenant_id, pool.model))
        if turns is None:
            turns = self._turns[(pool.tenant_id, pool.model)] = _Turns()
        if turns.order is None:
            turns.order = sorted(pool.members.values(), key=lambda m: m.key.engine_id)
        engines = turns.order
        for avoided_too in (False, True):
            for step in range(len(engines)):
                member = engines[(turns.turn + step) % len(engines)]
                if (avoided_too or member.key.engine_id not in avoid) and not held_back(member.key):
                    turns.turn = (turns.turn + step + 1) % len(engines)
                    return member.key
        return None

    def pool_changed(self, pool: Pool) -> None:
        key = (pool.tenant_id, pool.model)
        if not pool.members:
            self._turns.pop(key, None)
        elif key in self._turns:
            self._turns[key].order = None
