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
from collections.abc import Callable, Set
from typing import TYPE_CHECKING

from protocol.routing.config import RoutingConfig
from protocol.routing.hints import RoutingHints
from protocol.routing.pools import Member, Pool, Pools

if TYPE_CHECKING:  # protocol.processor.types holds RoutingConfig in ProcessorConfig
    from protocol.processor.types import EngineKey

__all__ = ["HeldBack", "Policy"]

#: Whether the processor holds an engine back from a task now; a policy never chooses one.
HeldBack = Callable[["EngineKey"], bool]


class Policy(ABC):
    """One way of choosing an engine for a task; see the module docstring."""

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

    def task_left(self, key: EngineKey, model: str, hints: RoutingHints | None) -> None:
        """A task of ``model`` this processor sent to ``key`` (with ``hints``) left it."""

    def state_size(self) -> dict[str, int]:
        """Entries the policy holds, by kind (for ``Router.state_size``)."""
        return {}
