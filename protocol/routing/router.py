"""Which engine a task goes to: the processor's router; pure, no I/O, no clock.

Rules this file keeps: the processor tells the router every change it must
know (an engine's status, readiness and models; a task sent to or leaving an
engine) and asks it for a choice; the router keeps nothing else, so the same
inputs give the same choice in every process. Memory is bounded by
:class:`~protocol.routing.config.RoutingConfig` whatever the traffic.

The router holds what every policy reads (:class:`~protocol.routing.pools.Pools`: the routable
engines of each (tenant, model), their loads, adapters and spilled tips) and the one policy
``RoutingConfig.policy`` names (:class:`~protocol.routing.policy.Policy`), one file each:

``affinity`` (infx's, :mod:`protocol.routing.affinity`)
    Bounded-load consistent hashing refined by prefix, session and adapter
    affinity; a task without hints (embeddings, targeted or internal tasks)
    is routed the ``least_in_progress`` way.
``least_in_progress`` (LLMariner's, :mod:`protocol.routing.least_in_progress`)
    Local engines first, then the fewest tasks in flight, then engine id.
``round_robin`` (:mod:`protocol.routing.round_robin`)
    Each (tenant, model)'s engines in turn, by engine id.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Set
from typing import TYPE_CHECKING

from protocol.pb import status_pb2
from protocol.routing.affinity import Affinity
from protocol.routing.config import RoutingConfig, RoutingPolicy
from protocol.routing.hints import RoutingHints
from protocol.routing.least_in_progress import LeastInProgress, least_in_progress
from protocol.routing.policy import HeldBack, Policy, RouteChoice, RoutingDecision
from protocol.routing.pools import Pools
from protocol.routing.round_robin import RoundRobin

if TYPE_CHECKING:  # protocol.processor.config holds RoutingConfig in ProcessorConfig
    from protocol.processor.keys import EngineKey

__all__ = ["POLICIES", "Router"]

#: The implementation of each policy ``--routing-policy`` may name.
POLICIES: dict[RoutingPolicy, type[Policy]] = {
    RoutingPolicy.AFFINITY: Affinity,
    RoutingPolicy.LEAST_IN_PROGRESS: LeastInProgress,
    RoutingPolicy.ROUND_ROBIN: RoundRobin,
}


class Router:
    """The routing state of one processor: the pools every policy reads, and the policy."""

    def __init__(self, config: RoutingConfig) -> None:
        self.config = config
        self.pools = Pools(config.spilled_tips, config.runtime_slots)
        self.policy = POLICIES[config.policy](config, self.pools)
        #: Tasks placed since start per (tenant, model, :class:`~protocol.routing.policy.RoutingDecision` value).
        self.decisions: Counter[tuple[str, str, str]] = Counter()
        #: With ``config.explain``: why the last engine was chosen, until taken (:meth:`take_choice`).
        self.last_choice: RouteChoice | None = None

    # --- what the processor tells -------------------------------------------

    def engine_updated(
        self, key: EngineKey, models: frozenset[str], status: status_pb2.EngineStatus, local: bool,
    ) -> None:
        """``key`` takes tasks for ``models`` now (empty: none) and reported ``status``; ``local``:
        attached here (its spilled tips are recorded here), else a peer's (they come in ``status``)."""
        for pool in self.pools.engine_updated(key, models, status, local):
            self.policy.pool_changed(pool)

    def stream_changed(self, key: EngineKey) -> None:
        """``key`` is reached on another stream now (its load reports' stamps count that stream's)."""
        self.pools.stream_changed(key)

    def engine_removed(self, key: EngineKey) -> None:
        """``key`` is gone: it leaves every pool, and the policy forgets it."""
        for pool in self.pools.engine_removed(key):
            self.policy.pool_changed(pool)
        self.policy.engine_removed(key)

    def task_sent(self, key: EngineKey, model: str, hints: RoutingHints | None, forwarded_tip: int = 0,
                  forwarded: bool = False) -> int:
        """A task was dispatched to ``key``: count it, and let the policy learn from it.

        ``forwarded_tip`` is a spilled prompt's tip on a task a peer forwarded
        (``TaskRequest.infx_prefix_tip``; ``forwarded``: a peer placed it, so it is not counted
        in :attr:`decisions`). Returns the tip the task must carry on to the engine's gateway
        (:mod:`protocol.routing.spills`), or 0.
        """
        member = self.pools.task_sent(key)
        if not forwarded:
            self.decisions[(key.tenant_id, model, self.policy.decision(key, model, hints).value)] += 1
        return self.policy.task_sent(member, key, model, hints, forwarded_tip)

    def task_answered(self, key: EngineKey, model: str, hints: RoutingHints | None, prompt_tokens: int,
                      cached_tokens: int) -> None:
        """``key``'s runtime said, in its answer to a task this processor sent it, that it reused
        ``cached_tokens`` of the prompt's ``prompt_tokens`` (the policy checks what it believed)."""
        self.policy.task_answered(key, model, hints, prompt_tokens, cached_tokens)

    def task_left(self, key: EngineKey, model: str = "", hints: RoutingHints | None = None) -> None:
        """A task of ``model`` this processor sent to ``key`` (with ``hints``) left it (ended, failed over)."""
        self.pools.task_left(key)
        self.policy.task_left(key, model, hints)

    # --- what the processor asks --------------------------------------------

    def choose(
        self, tenant_id: str, model: str, hints: RoutingHints | None, avoid: Set[str], held_back: HeldBack,
    ) -> EngineKey | None:
        """The policy's engine for a task of (tenant, model), or None when every engine is held back.

        ``held_back`` says which engines the processor holds back now (at its
        in-flight cap, say); they are never chosen. Engines in ``avoid`` (they
        failed this task) are chosen only when no other engine can take it.
        """
        pool = self.pools.pool(tenant_id, model)
        key = None if pool is None else self.policy.choose(pool, hints, avoid, held_back)
        if key is not None and self.config.explain:
            self.last_choice = self.policy.explain(key, model, hints)
        return key

    def least_in_progress(
        self, tenant_id: str, model: str, avoid: Set[str], held_back: HeldBack,
    ) -> EngineKey | None:
        """The ``least_in_progress`` choice whatever the policy: the processor's when it asks
        which engine would take a task but for the caps, or one past affinity's load bound."""
        pool = self.pools.pool(tenant_id, model)
        key = None if pool is None else least_in_progress(pool, avoid, held_back)
        if key is not None and self.config.explain:
            self.last_choice = RouteChoice(key, RoutingPolicy.LEAST_IN_PROGRESS.value, LeastInProgress.reason,
                                           decision=RoutingDecision.LOAD.value)
        return key

    def take_choice(self, key: EngineKey) -> RouteChoice | None:
        """Why ``key`` was chosen, if it was the last choice (once: the choice is forgotten)."""
        choice, self.last_choice = self.last_choice, None
        return choice if choice is not None and choice.engine == key else None

    def load(self, key: EngineKey) -> int:
        """The load routing counts for ``key`` (0 if unknown)."""
        return self.pools.load(key)

    def annotate(self, key: EngineKey, status: status_pb2.EngineStatus) -> None:
        """Add local ``key``'s spilled tips to ``status`` (a copy going to peers), and put this
        gateway's count of its load in place of the runtime's reading (:meth:`Pools.exact_load`)."""
        self.pools.spills.annotate(key, status)
        self.pools.exact_load(key, status)

    def tips_recorded(self) -> int:
        """New spilled tips recorded for local engines since start (:attr:`protocol.routing.spills.SpilledTips.recorded`)."""
        return self.pools.spills.recorded

    # --- what tools read ----------------------------------------------------

    def state_size(self) -> dict[str, int]:
        """Entries held: prefix-index blocks, spilled tips, sessions, engines, ring points."""
        held = self.policy.state_size()
        return {
            "index_blocks": held.get("index_blocks", 0),
            "spilled_tips": len(self.pools.spills),
            "sessions": held.get("sessions", 0),
            "engines": len(self.pools),
            "ring_points": held.get("ring_points", 0),
        }
