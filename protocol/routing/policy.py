"""What a routing policy is: the one interface every policy implements; pure, no I/O, no clock.

A policy chooses one engine of a pool (:class:`~protocol.routing.pools.Pool`: the routable
engines of the task's tenant with its model ready) for a task, given the task's hints, the
engines it must avoid if it can and a ``held_back`` predicate: the engines the processor will
not load now (full, busy, blocked, or unable to take the request's form), which a policy never
chooses. It reads the pools (:class:`~protocol.routing.pools.Pools`, what every policy sees
alike) and may remember what it likes of its own (a ring, a turn, a prefix index), bounded by
:class:`~protocol.routing.config.RoutingConfig` whatever the traffic; the router tells it when
a pool's members change, when an engine goes and when a task was sent.

Rules every policy keeps: the same inputs give the same choice in every process (no seeded
``hash``, no iteration over an unordered set where order decides); an engine in ``avoid`` is
chosen only when no other can take the task. A new policy is a new file here, a member of
:class:`~protocol.routing.config.RoutingPolicy` and a line in :mod:`protocol.routing.router`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from collections.abc import Callable, Set
from enum import Enum
from typing import TYPE_CHECKING

from protocol.routing.config import RoutingConfig
from protocol.routing.hints import RoutingHints
from protocol.routing.pools import Member, Pool, Pools

if TYPE_CHECKING:  # protocol.processor.config holds RoutingConfig in ProcessorConfig
    from protocol.processor.keys import EngineKey

__all__ = ["HeldBack", "Policy", "RouteChoice", "RoutingDecision"]

#: Whether the processor holds an engine back from a task now; a policy never chooses one.
HeldBack = Callable[["EngineKey"], bool]


class RoutingDecision(Enum):
    """How a task this gateway routed was placed, as the operator page and metrics count it.

    The affinity policy's three are exclusive: ``prefix_hit`` (the engine chosen was sent
    the start of this prompt before, by this gateway or, as a spilled tip, by a peer: its
    prefix cache likely holds it), else ``home`` (the prompt's ring home), else ``spill``
    (bounded load moved it off its home, to an engine holding none of it). ``load``: placed
    by load alone (no hints, or the ``least_in_progress`` or ``round_robin`` policy).
    A task a peer forwarded was placed by that peer and is not counted here.
    """

    PREFIX_HIT = "prefix_hit"
    HOME = "home"
    SPILL = "spill"
    LOAD = "load"


@dataclass(frozen=True, slots=True)
class RouteChoice:
    """Why ``engine`` was chosen for a task: read by traces, never by routing.

    ``reason`` names what won: ``in turn`` (round robin), ``fewest in flight`` (least in
    progress, or a task without routing hints), the forwarding gateway's choice (policy
    ``targeted``: a peer's task runs on the engine it names), or for affinity what the engine had
    among ``home``, ``prefix``, ``session``, ``adapter`` (else ``load``: only its load set it
    apart), with ``fallback`` when only engines that had failed the task could take it. ``score``
    is its affinity score among ``candidates`` scored; ``prefix_blocks`` of the request's
    ``blocks`` were known cached on it. ``decision`` is how the placement is counted
    (:class:`RoutingDecision`'s value; empty for a peer's task, which that peer placed).
    """

    engine: EngineKey
    policy: str
    reason: str
    score: float | None = None
    candidates: int = 0
    prefix_blocks: int = 0
    blocks: int = 0
    decision: str = ""


class Policy(ABC):
    """One way of choosing an engine for a task; see the module docstring."""

    #: What :meth:`explain` says won by default.
    reason = "fewest in flight"

    def __init__(self, config: RoutingConfig, pools: Pools) -> None:
        self.config = config
        self.pools = pools

    @abstractmethod
    def choose(self, pool: Pool, hints: RoutingHints | None, avoid: Set[str], held_back: HeldBack) -> EngineKey | None:
        """The engine of ``pool`` for a task, or None when every one is held back.

        ``hints`` is what the request tells of itself (None: nothing, e.g. embeddings or a
        peer's task); ``avoid`` names engine ids that already failed the task.
        """

    def pool_changed(self, pool: Pool) -> None:
        """Engines joined or left ``pool`` (left empty: it is gone); what was kept of it is stale."""

    def engine_removed(self, key: EngineKey) -> None:
        """``key`` is gone: forget what was kept of it."""

    def task_sent(self, member: Member | None, key: EngineKey, model: str, hints: RoutingHints | None,
                  forwarded_tip: int) -> int:
        """A task of ``model`` was dispatched to ``key`` (``member``, if routing knows it): remember
        what the policy learns from it. Returns the spilled tip the task must carry to the
        engine's gateway (:mod:`protocol.routing.spills`), or 0.

        By default only a tip a peer forwarded (``forwarded_tip``) is kept: recorded here when
        ``key`` is local, else carried on.
        """
        if forwarded_tip and member is not None and member.local:
            self.pools.spills.record(key, model, forwarded_tip)
            return 0
        return forwarded_tip

    def decision(self, key: EngineKey, model: str, hints: RoutingHints | None) -> RoutingDecision:
        """How ``key`` was chosen for a task of ``model`` (asked before the policy learns from
        the task): by load alone, unless the policy says otherwise."""
        return RoutingDecision.LOAD

    def explain(self, key: EngineKey, model: str, hints: RoutingHints | None) -> RouteChoice:
        """Why ``key`` was the last choice (with ``RoutingConfig.explain``; asked right after
        :meth:`choose`, before the policy learns from the task)."""
        return RouteChoice(key, self.config.policy.value, self.reason,
                           decision=self.decision(key, model, hints).value)
    def task_answered(self, key: EngineKey, model: str, hints: RoutingHints | None, prompt_tokens: int,
                      cached_tokens: int) -> None:
        """``key``'s runtime answered a task of ``model`` this processor sent it (with ``hints``), saying
        it reused ``cached_tokens`` of its ``prompt_tokens`` from its prefix cache (once per task)."""

    def task_left(self, key: EngineKey, model: str, hints: RoutingHints | None) -> None:
        """A task of ``model`` this processor sent to ``key`` (with ``hints``) left it."""

    def state_size(self) -> dict[str, int]:
        """Entries the policy holds, by kind (for ``Router.state_size``)."""
        return {}
