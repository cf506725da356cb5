"""Which routing policy a processor uses, and its knobs; pure values, validated once.

``--routing-policy`` names a :class:`RoutingPolicy`; :mod:`protocol.routing.router` makes the
policy object it names (one file per policy: ``affinity``, ``least_in_progress``,
``round_robin``).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

__all__ = ["RoutingConfig", "RoutingPolicy"]


class RoutingPolicy(Enum):
    """How the processor chooses among the engines that can take a task."""

    AFFINITY = "affinity"
    LEAST_IN_PROGRESS = "least_in_progress"
    ROUND_ROBIN = "round_robin"


@dataclass(frozen=True)
class RoutingConfig:
    """The routing policy and its knobs (see :mod:`protocol.routing.affinity` for the score).

    load_factor: the bounded-load factor c (> 1): no engine is chosen whose
        load would exceed c times the mean load plus one.
    min_capacity: the load every engine may take whatever the mean (an idle
        cluster still batches a shared prefix on one engine); an engine that
        reports its runtime's slots may take that many instead.
    prefix_weight, home_weight, session_weight, adapter_weight, queue_weight,
        kv_weight, busy_weight: weights of the affinity score.
    ring_points: points per engine on the hash ring (more: an even split of
        home keys, a bigger ring to rebuild when engines change).
    spare_candidates: engines with room after the home, in ring order, that
        are scored too (they take the load-aware choice when affinity ties).
    index_blocks_per_engine: prefix blocks remembered per engine (about the
        engine's prefix cache, in blocks of ``HintsConfig.block_bytes``).
    index_blocks_total: prefix blocks remembered over all engines; the
        per-engine cap shrinks to ``index_blocks_total // engines``.
    sessions: sessions whose last engine is remembered (LRU).
    spilled_tips: spilled prompts remembered per local engine and reported
        to peers with its status (:mod:`protocol.routing.spills`; 0: none
        shared, each gateway knows only its own spills).
    runtime_slots: let the slots an engine's runtime reports
        (``infx_runtime_slots``) shape the affinity policy: the bound's minimum,
        hot prefixes spread over as many engines as their load needs, and the
        busy term of the score, a later turn bound by the mean's rule and kept on
        its engine while that has a free slot (:mod:`protocol.routing.affinity`).
        On by default since that last rule (part 2 had it off: its slot bound cost
        later chat turns their cache; docs/routing-real.md); off, reported slots
        are ignored by routing.
    explain: keep why each engine was chosen (:class:`~protocol.routing.policy.RouteChoice`,
        for traces); off, routing keeps nothing but the choice.
    """

    policy: RoutingPolicy = RoutingPolicy.AFFINITY
    load_factor: float = 1.3
    min_capacity: int = 4
    prefix_weight: float = 8.0
    home_weight: float = 0.5
    session_weight: float = 0.5
    adapter_weight: float = 0.5
    queue_weight: float = 0.5
    kv_weight: float = 0.25
    busy_weight: float = 2.0
    ring_points: int = 100
    spare_candidates: int = 2
    index_blocks_per_engine: int = 2048
    index_blocks_total: int = 250_000
    sessions: int = 100_000
    spilled_tips: int = 64
    runtime_slots: bool = True
    explain: bool = False

    def __post_init__(self) -> None:
        problems = []
        if not self.load_factor > 1:
            problems.append("load_factor must be > 1")
        for name in ("prefix_weight", "home_weight", "session_weight", "adapter_weight", "queue_weight", "kv_weight",
                     "busy_weight"):
            if not getattr(self, name) >= 0:
                problems.append(f"{name} must be >= 0")
        if self.min_capacity < 1:
            problems.append("min_capacity must be >= 1")
        if self.ring_points < 1:
            problems.append("ring_points must be >= 1")
        if self.spare_candidates < 0:
            problems.append("spare_candidates must be >= 0")
        for name in ("index_blocks_per_engine", "index_blocks_total", "sessions", "spilled_tips"):
            if getattr(self, name) < 0:
                problems.append(f"{name} must be >= 0")
        if problems:
            raise ValueError("; ".join(problems))
