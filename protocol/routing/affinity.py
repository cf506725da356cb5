"""The ``affinity`` policy (infx's): bounded-load consistent hashing, refined by what this
gateway learned; pure, no I/O, no clock.

Every engine of a (tenant, model) has ``ring_points`` points on a hash
ring; a request's home key (:mod:`protocol.routing.hints`) lands on the
ring and the first engine clockwise *with room* is its home. Room is the
bounded-load rule: an engine's load must stay below the capacity
``max(ceil(load_factor * (total load + 1) / engines), min_capacity)``, so
no engine carries more than ``load_factor`` times the mean, plus one
(below ``min_capacity`` requests an engine is never loaded enough for
the bound to matter, and affinity is worth most). Every gateway knows
the same engines from the exchange, and hashes each by the id it reports
(a peer's engine is named with its pod here), so a conversation arriving at any
replica has the same home while that engine has room: no central
service. Where bounded load moved a turn off its home, the engine's
gateway reports the spill to every peer with the engine's status
(:mod:`protocol.routing.spills`), so the next turn follows it from any
gateway. The home, the next ``spare_candidates`` engines with room on
the ring, the engines this gateway's prefix index or the spilled tips
say hold the longest prefix of the request, the engine of the request's
session, and engines with its LoRA adapter loaded are then scored::

    prefix_weight  * (matched blocks / request blocks)
  + home_weight    * (is the home)
  + session_weight * (served this session last)
  + adapter_weight * (has the adapter loaded)
  - queue_weight   * load / capacity
  - kv_weight      * KV-cache usage

and the best wins (ties: ring order). A task without hints (embeddings,
targeted or internal tasks) is routed the ``least_in_progress`` way.

What it keeps of its own, bounded by :class:`~protocol.routing.config.RoutingConfig`: each
pool's ring (rebuilt when its members change), the prefix index
(:mod:`protocol.routing.prefix_index`) and the last engine of each session (LRU).
"""

from __future__ import annotations

import hashlib
import math
from bisect import bisect_left
from collections import OrderedDict
from collections.abc import Set
from dataclasses import dataclass
from typing import TYPE_CHECKING

from protocol.routing.config import RoutingConfig
from protocol.routing.hints import RoutingHints
from protocol.routing.least_in_progress import least_in_progress
from protocol.routing.policy import HeldBack, Policy
from protocol.routing.pools import Member, Pool, Pools
from protocol.routing.prefix_index import PrefixIndex

if TYPE_CHECKING:  # protocol.processor.types holds RoutingConfig in ProcessorConfig
    from protocol.processor.types import EngineKey

__all__ = ["Affinity"]

#: Engines with the request's adapter loaded that are scored besides the ring's (bounded work).
_ADAPTER_CANDIDATES = 4


def _point(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8, key=b"infx-ring").digest(), "big")


@dataclass(slots=True)
class _Ring:
    """One pool's hash ring: sorted points and the engine of each."""

    points: list[int]
    members: list[Member]


class Affinity(Policy):
    """Bounded-load consistent hashing with prefix, session and adapter affinity."""

    def __init__(self, config: RoutingConfig, pools: Pools) -> None:
        super().__init__(config, pools)
        self.index = PrefixIndex(config.index_blocks_per_engine, config.index_blocks_total)
        self._sessions: OrderedDict[tuple[str, str, str], EngineKey] = OrderedDict()
        self._rings: dict[tuple[str, str], _Ring] = {}

    def choose(self, pool: Pool, hints: RoutingHints | None, avoid: Set[str], held_back: HeldBack) -> EngineKey | None:
        if hints is None:
            return least_in_progress(pool, avoid, held_back)
        chosen = self._affinity(pool, hints, avoid, held_back, fallback=False)
        return chosen or self._affinity(pool, hints, avoid, held_back, fallback=True)

    def capacity(self, total: int, engines: int) -> int:
        """The bounded-load rule: an engine with this load (or more) takes no task by affinity."""
        return max(math.ceil(self.config.load_factor * (total + 1) / engines), self.config.min_capacity)

    def pool_changed(self, pool: Pool) -> None:
        self._rings.pop((pool.tenant_id, pool.model), None)

    def engine_removed(self, key: EngineKey) -> None:
        self.index.forget(key)

    def task_sent(self, member: Member | None, key: EngineKey, model: str, hints: RoutingHints | None,
                  forwarded_tip: int) -> int:
        """Remember the prompt's blocks and session on ``key``; a prompt routed off its ring home
        is a spill (:mod:`protocol.routing.spills`): its tip is recorded here when ``key`` is
        local, else returned, to be carried on the forwarded task to the engine's gateway."""
        if hints is None:
            return super().task_sent(member, key, model, hints, forwarded_tip)
        self.index.record(key, hints.blocks)
        carried = 0
        if hints.blocks and self.config.spilled_tips and self._spilled(key, model, hints):
            if member is not None and member.local:
                self.pools.spills.record(key, model, hints.blocks[-1])
            else:
                carried = hints.blocks[-1]
        if hints.session and self.config.sessions:
            session = (key.tenant_id, model, hints.session)
            self._sessions[session] = key
            self._sessions.move_to_end(session)
            if len(self._sessions) > self.config.sessions:
                self._sessions.popitem(last=False)
        return carried

    def state_size(self) -> dict[str, int]:
        return {"index_blocks": self.index.size, "sessions": len(self._sessions),
                "ring_points": sum(len(ring.points) for ring in self._rings.values())}

    def _spilled(self, key: EngineKey, model: str, hints: RoutingHints) -> bool:
        """Whether another gateway would not send this prompt's next turn to ``key`` by itself:
        ``key`` is not the first engine on the ring for the home key, or the spilled tips place
        this prompt's prefix on another engine (the conversation moves back or on)."""
        pool = self.pools.pool(key.tenant_id, model)
        if pool is None or key not in pool.members:
            return False
        ring = self._ring(pool)
        if ring.members[bisect_left(ring.points, hints.home) % len(ring.points)].key != key:
            return True
        return any(other != key for other in self.pools.spills.depths(hints.blocks))

    def _ring(self, pool: Pool) -> _Ring:
        ring = self._rings.get((pool.tenant_id, pool.model))
        if ring is None:
            points = sorted(
                (_point(f"{key.tenant_id}\0{member.reported_id}\0{i}".encode()), key.engine_id, member)
                for key, member in pool.members.items()
                for i in range(self.config.ring_points)
            )
            ring = self._rings[(pool.tenant_id, pool.model)] = _Ring([p for p, _, _ in points],
                                                                     [m for _, _, m in points])
        return ring

    def _affinity(
        self, pool: Pool, hints: RoutingHints, avoid: Set[str], held_back: HeldBack, fallback: bool,
    ) -> EngineKey | None:
        config = self.config
        capacity = self.capacity(pool.total, len(pool.members))

        def takes(member: Member) -> bool:
            return (member.load < capacity and (fallback or member.key.engine_id not in avoid)
                    and not held_back(member.key))

        ring = self._ring(pool)
        candidates: dict[EngineKey, Member] = {}
        start = bisect_left(ring.points, hints.home)
        wanted = 1 + config.spare_candidates
        seen: set[EngineKey] = set()
        for step in range(len(ring.points)):
            member = ring.members[(start + step) % len(ring.points)]
            if member.key in seen:
                continue
            seen.add(member.key)
            if takes(member):
                candidates[member.key] = member
                if len(candidates) == wanted:
                    break
            if len(seen) == len(pool.members):
                break
        if not candidates:
            return None
        home = next(iter(candidates))
        depths = self.index.depths(hints.blocks) if config.prefix_weight else {}
        if config.prefix_weight:
            for key, depth in self.pools.spills.depths(hints.blocks).items():
                if depth > depths.get(key, 0):
                    depths[key] = depth
        for key in depths:
            held = pool.members.get(key)
            if held is not None and takes(held):
                candidates.setdefault(key, held)
        session_engine = self._sessions.get((pool.tenant_id, pool.model, hints.session)) if hints.session else None
        if session_engine is not None:
            last = pool.members.get(session_engine)
            if last is not None and takes(last):
                candidates.setdefault(session_engine, last)
        if hints.adapter:
            added = 0
            for key in self.pools.holding_adapter(hints.adapter):
                loaded = pool.members.get(key)
                if loaded is not None and takes(loaded) and key not in candidates:
                    candidates[key] = loaded
                    added += 1
                    if added == _ADAPTER_CANDIDATES:
                        break
        best, best_score = home, -math.inf
        blocks = len(hints.blocks)
        for key, member in candidates.items():
            score = -config.queue_weight * member.load / capacity
            if blocks:
                score += config.prefix_weight * depths.get(key, 0) / blocks
            if key == home:
                score += config.home_weight
            if key == session_engine:
                score += config.session_weight
            if hints.adapter and hints.adapter in member.adapters:
                score += config.adapter_weight
            if member.kv is not None:
                score -= config.kv_weight * member.kv
            if score > best_score:
                best, best_score = key, score
        return best
