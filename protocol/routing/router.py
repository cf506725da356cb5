"""Which engine a task goes to: the processor's routing policy; pure, no I/O, no clock.

Rules this file keeps: the processor tells the router every change it must
know (an engine's status, readiness and models; a task sent to or leaving an
engine) and asks it for a choice; the router keeps nothing else, so the same
inputs give the same choice in every process. Memory is bounded by
:class:`RoutingConfig` whatever the traffic.

Policies (``RoutingConfig.policy``):

``affinity`` (infx's)
    Bounded-load consistent hashing, refined by what this gateway learned.
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
``least_in_progress`` (LLMariner's)
    Local engines first, then the fewest tasks in flight, then engine id; it
    lives in the processor, which asks the router nothing.
``round_robin``
    Each (tenant, model)'s engines in turn, by engine id.

Load of an engine: the larger of this processor's tasks in flight on it and
what the engine last reported plus the tasks this processor sent it since,
less those that left it since.
The report is its runtime's running plus waiting requests
(``EngineStatus.Model.runtime_load``), else its ``in_progress_task_count``,
summed over its models; it counts every gateway's tasks, so with several
gateways each sees about the same load and makes about the same choice.
"""

from __future__ import annotations

import hashlib
import math
from bisect import bisect_left
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING

from protocol.pb import status_pb2
from protocol.routing.hints import RoutingHints
from protocol.routing.spills import SpilledTips

if TYPE_CHECKING:  # protocol.processor.types holds RoutingConfig in ProcessorConfig
    from protocol.processor.types import EngineKey

__all__ = ["PrefixIndex", "RouteChoice", "Router", "RoutingConfig", "RoutingDecision", "RoutingPolicy",
           "reported_load"]


class RoutingPolicy(Enum):
    """How the processor chooses among the engines that can take a task."""

    AFFINITY = "affinity"
    LEAST_IN_PROGRESS = "least_in_progress"
    ROUND_ROBIN = "round_robin"


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


@dataclass(frozen=True)
class RoutingConfig:
    """The routing policy and its knobs (see the module docstring for the score).

    load_factor: the bounded-load factor c (> 1): no engine is chosen whose
        load would exceed c times the mean load plus one.
    min_capacity: the load every engine may take whatever the mean (an idle
        cluster still batches a shared prefix on one engine).
    prefix_weight, home_weight, session_weight, adapter_weight, queue_weight,
        kv_weight: weights of the affinity score.
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
    explain: keep why each engine was chosen (:class:`RouteChoice`, for
        traces); off, routing keeps nothing but the choice.
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
    ring_points: int = 100
    spare_candidates: int = 2
    index_blocks_per_engine: int = 2048
    index_blocks_total: int = 250_000
    sessions: int = 100_000
    spilled_tips: int = 64
    explain: bool = False

    def __post_init__(self) -> None:
        problems = []
        if not self.load_factor > 1:
            problems.append("load_factor must be > 1")
        for name in ("prefix_weight", "home_weight", "session_weight", "adapter_weight", "queue_weight", "kv_weight"):
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


def reported_load(status: status_pb2.EngineStatus) -> tuple[int, float | None, frozenset[str]]:
    """What an engine says of its load: requests in its runtime (running + waiting, else
    in-progress tasks), the highest KV-cache usage reported (None: none), loaded adapters."""
    requests, kv, adapters = 0, None, set()
    for model in status.models:
        if model.HasField("runtime_load"):
            load = model.runtime_load
            requests += load.running_requests + load.waiting_requests
            if load.HasField("kv_cache_usage"):
                kv = load.kv_cache_usage if kv is None else max(kv, load.kv_cache_usage)
            adapters.update(load.loaded_adapters)
        else:
            requests += model.in_progress_task_count
    return requests, kv, frozenset(adapters)


_NO_STATUS = status_pb2.EngineStatus()
#: Engines with the request's adapter loaded that are scored besides the ring's (bounded work).
_ADAPTER_CANDIDATES = 4


def _point(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8, key=b"infx-ring").digest(), "big")


class PrefixIndex:
    """Which engines this gateway sent each prefix block to, LRU per engine.

    An engine's entries are capped at ``min(per_engine, total // engines)``,
    checked whenever it is sent a task and whenever an engine joins, so the
    index never holds more than ``total`` entries. A request's blocks are
    recorded deepest first, so an engine forgets a prompt's tail before its
    shared head.
    """

    def __init__(self, per_engine: int, total: int) -> None:
        self._per_engine = per_engine
        self._total = total
        self._by_engine: dict[EngineKey, OrderedDict[int, None]] = {}
        # Block -> the engine it was sent to, or engines (in the order first sent) when several:
        # most blocks have one holder, and a bare key takes a fraction of a dict's memory.
        self._holders: dict[int, EngineKey | dict[EngineKey, None]] = {}
        self.size = 0

    def _cap(self) -> int:
        return min(self._per_engine, self._total // max(1, len(self._by_engine)))

    def record(self, key: EngineKey, blocks: tuple[int, ...]) -> None:
        """``blocks`` were sent to ``key``: remember them, most recent last."""
        if not blocks:
            return
        lru = self._by_engine.get(key)
        if lru is None:
            lru = self._by_engine[key] = OrderedDict()
            cap = self._cap()
            for other in list(self._by_engine):
                self._trim(other, cap)
        for block in reversed(blocks):
            if block in lru:
                lru.move_to_end(block)
            else:
                lru[block] = None
                held = self._holders.get(block)
                if held is None:
                    self._holders[block] = key
                elif isinstance(held, dict):
                    held[key] = None
                else:
                    self._holders[block] = {held: None, key: None}
                self.size += 1
        self._trim(key, self._cap())

    def _trim(self, key: EngineKey, cap: int) -> None:
        lru = self._by_engine[key]
        while len(lru) > cap:
            block, _ = lru.popitem(last=False)
            held = self._holders[block]
            if isinstance(held, dict):
                del held[key]
                if len(held) == 1:
                    self._holders[block] = next(iter(held))
            else:
                del self._holders[block]
            self.size -= 1

    def holds(self, key: EngineKey, block: int) -> bool:
        """Whether ``block`` was sent to ``key`` (and is still remembered)."""
        lru = self._by_engine.get(key)
        return lru is not None and block in lru

    def forget(self, key: EngineKey) -> None:
        """The engine is gone: drop its entries."""
        if key in self._by_engine:
            self._trim(key, 0)
            del self._by_engine[key]

    def depths(self, blocks: tuple[int, ...]) -> dict[EngineKey, int]:
        """Per engine, how many leading blocks of ``blocks`` it was sent (0: absent)."""
        depth: dict[EngineKey, int] = {}
        for i, block in enumerate(blocks):
            held = self._holders.get(block)
            if held is None:
                break
            if isinstance(held, dict):
                for key in held:
                    depth[key] = i + 1
            else:
                depth[held] = i + 1
        return depth


@dataclass(slots=True)
class _Member:
    key: EngineKey
    # The id the engine reports, the same on every gateway (``key`` names a peer's engine
    # with its gateway's pod here): what its points on the ring are hashed from.
    reported_id: str = ""
    pools: frozenset[str] = frozenset()
    local: bool = False
    own: int = 0
    reported: int = 0
    # Tasks this processor sent minus those that left since the engine's last report,
    # which cannot count them yet.
    since_report: int = 0
    kv: float | None = None
    adapters: frozenset[str] = frozenset()

    @property
    def load(self) -> int:
        return max(self.own, self.reported + self.since_report)


@dataclass(slots=True)
class _Pool:
    """The routable engines of one (tenant, model), their total load and hash ring."""

    members: dict[EngineKey, _Member] = field(default_factory=dict)
    total: int = 0
    ring: list[int] | None = None
    ring_members: list[_Member] = field(default_factory=list)
    in_turn: list[_Member] | None = None
    turn: int = 0


@dataclass(frozen=True, slots=True)
class RouteChoice:
    """Why ``engine`` was chosen for a task: read by traces, never by routing.

    ``reason`` names what won: ``in turn`` (round robin), ``fewest in flight`` (least in
    progress, or a task without routing hints), the forwarding gateway's choice (policy
    ``targeted``: a peer's task runs on the engine it names), or for affinity what the engine had among
    ``home``, ``prefix``, ``session``, ``adapter`` (else ``load``: only its load set it apart),
    with ``fallback`` when only engines that had failed the task could take it. ``score`` is
    its affinity score among ``candidates`` scored; ``prefix_blocks`` of the request's
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


class Router:
    """The routing state of one processor: pools, loads, prefix index, sessions."""

    def __init__(self, config: RoutingConfig) -> None:
        self.config = config
        self._members: dict[EngineKey, _Member] = {}
        self._pools: dict[tuple[str, str], _Pool] = {}
        self.index = PrefixIndex(config.index_blocks_per_engine, config.index_blocks_total)
        self.spills = SpilledTips(config.spilled_tips)
        self._sessions: OrderedDict[tuple[str, str, str], EngineKey] = OrderedDict()
        # Adapter name -> engines that report it loaded.
        self._adapters: dict[str, dict[EngineKey, None]] = {}
        #: Tasks placed since start per (tenant, model, :class:`RoutingDecision` value).
        self.decisions: Counter[tuple[str, str, str]] = Counter()
        #: With ``config.explain``: why the last engine was chosen, until taken (:meth:`take_choice`).
        self.last_choice: RouteChoice | None = None

    # --- what the processor tells -------------------------------------------

    def engine_updated(
        self, key: EngineKey, models: frozenset[str], status: status_pb2.EngineStatus, local: bool,
    ) -> None:
        """``key`` takes tasks for ``models`` now (empty: none) and reported ``status``; ``local``:
        attached here (its spilled tips are recorded here), else a peer's (they come in ``status``)."""
        member = self._members.get(key)
        if member is None:
            member = self._members[key] = _Member(key, status.engine_id, local=local)
        elif member.local is not local:
            self.spills.forget(key)
            member.local = local
        if not local:
            self.spills.reported(key, status)
        reported, member.kv, adapters = reported_load(status)
        self._set_load(member, member.own, reported, 0)
        if adapters != member.adapters:
            for adapter in member.adapters - adapters:
                holders = self._adapters[adapter]
                del holders[key]
                if not holders:
                    del self._adapters[adapter]
            for adapter in sorted(adapters - member.adapters):
                self._adapters.setdefault(adapter, {})[key] = None
            member.adapters = adapters
        if models != member.pools:
            for model in member.pools - models:
                pool = self._pools[(key.tenant_id, model)]
                del pool.members[key]
                pool.total -= member.load
                pool.ring = pool.in_turn = None
                if not pool.members:
                    del self._pools[(key.tenant_id, model)]
            for model in models - member.pools:
                pool = self._pools.setdefault((key.tenant_id, model), _Pool())
                pool.members[key] = member
                pool.total += member.load
                pool.ring = pool.in_turn = None
            member.pools = models

    def engine_removed(self, key: EngineKey) -> None:
        """``key`` is gone: it leaves every pool and the index."""
        member = self._members.get(key)
        if member is not None:
            self.engine_updated(key, frozenset(), _NO_STATUS, member.local)
            del self._members[key]
        self.index.forget(key)
        self.spills.forget(key)

    def task_sent(self, key: EngineKey, model: str, hints: RoutingHints | None, forwarded_tip: int = 0,
                  forwarded: bool = False) -> int:
        """A task was dispatched to ``key``: count it, and remember its prefix and session there.

        A prompt routed off its ring home is a spill (:mod:`protocol.routing.spills`): its tip
        is recorded here when ``key`` is local, else returned, to be carried on the forwarded
        task (``TaskRequest.infx_prefix_tip``) to the engine's gateway. ``forwarded_tip`` is
        such a tip on a task a peer forwarded (``forwarded``: a peer placed it, so it is not
        counted in :attr:`decisions`). Returns the tip to carry, or 0.
        """
        member = self._members.get(key)
        if member is not None:
            self._set_load(member, member.own + 1, member.reported, member.since_report + 1)
        if not forwarded:
            self.decisions[(key.tenant_id, model, self._decision(key, model, hints).value)] += 1
        if hints is None or self.config.policy is not RoutingPolicy.AFFINITY:
            if forwarded_tip and member is not None and member.local:
                self.spills.record(key, model, forwarded_tip)
                return 0
            return forwarded_tip
        self.index.record(key, hints.blocks)
        carried = 0
        if hints.blocks and self.config.spilled_tips and self._spilled(key, model, hints):
            if member is not None and member.local:
                self.spills.record(key, model, hints.blocks[-1])
            else:
                carried = hints.blocks[-1]
        if hints.session and self.config.sessions:
            session = (key.tenant_id, model, hints.session)
            self._sessions[session] = key
            self._sessions.move_to_end(session)
            if len(self._sessions) > self.config.sessions:
                self._sessions.popitem(last=False)
        return carried

    def _decision(self, key: EngineKey, model: str, hints: RoutingHints | None) -> RoutingDecision:
        """How ``key`` was chosen for a prompt (read before the prompt is recorded there)."""
        if hints is None or self.config.policy is not RoutingPolicy.AFFINITY:
            return RoutingDecision.LOAD
        if hints.blocks and (self.index.holds(key, hints.blocks[0]) or key in self.spills.depths(hints.blocks)):
            return RoutingDecision.PREFIX_HIT
        pool = self._pools.get((key.tenant_id, model))
        if pool is None or key not in pool.members:
            return RoutingDecision.HOME
        ring = pool.ring if pool.ring is not None else self._build_ring(pool)
        home = pool.ring_members[bisect_left(ring, hints.home) % len(ring)].key
        return RoutingDecision.HOME if home == key else RoutingDecision.SPILL

    def _spilled(self, key: EngineKey, model: str, hints: RoutingHints) -> bool:
        """Whether another gateway would not send this prompt's next turn to ``key`` by itself:
        ``key`` is not the first engine on the ring for the home key, or the spilled tips place
        this prompt's prefix on another engine (the conversation moves back or on)."""
        pool = self._pools.get((key.tenant_id, model))
        if pool is None or key not in pool.members:
            return False
        ring = pool.ring if pool.ring is not None else self._build_ring(pool)
        if pool.ring_members[bisect_left(ring, hints.home) % len(ring)].key != key:
            return True
        return any(other != key for other in self.spills.depths(hints.blocks))

    def task_left(self, key: EngineKey) -> None:
        """A task this processor sent to ``key`` left it (ended, failed over)."""
        member = self._members.get(key)
        if member is not None:
            self._set_load(member, member.own - 1, member.reported, member.since_report - 1)

    def _set_load(self, member: _Member, own: int, reported: int, since_report: int) -> None:
        before = member.load
        member.own, member.reported, member.since_report = own, reported, since_report
        delta = member.load - before
        if delta:
            for model in member.pools:
                self._pools[(member.key.tenant_id, model)].total += delta

    # --- what the processor asks --------------------------------------------

    def choose(
        self, tenant_id: str, model: str, hints: RoutingHints | None, avoid: set[str],
        blocked: Callable[[EngineKey], bool],
    ) -> EngineKey | None:
        """The engine for a task of (tenant, model), or None when every engine is ``blocked``.

        ``blocked`` says which engines the processor holds back now (at its
        in-flight cap, say); they are never chosen. Engines in ``avoid`` (they
        failed this task) are chosen only when no other engine can take it.
        ``hints`` is None for round-robin.
        """
        pool = self._pools.get((tenant_id, model))
        if pool is None:
            return None
        if hints is None or self.config.policy is RoutingPolicy.ROUND_ROBIN:
            key = self._in_turn(pool, avoid, blocked)
            if key is not None and self.config.explain:
                self.last_choice = RouteChoice(key, RoutingPolicy.ROUND_ROBIN.value, "in turn",
                                               decision=RoutingDecision.LOAD.value)
            return key
        chosen = self._affinity(tenant_id, model, pool, hints, avoid, blocked, fallback=False)
        return chosen or self._affinity(tenant_id, model, pool, hints, avoid, blocked, fallback=True)

    def capacity(self, total: int, engines: int) -> int:
        """The bounded-load rule: an engine with this load (or more) takes no task by affinity."""
        return max(math.ceil(self.config.load_factor * (total + 1) / engines), self.config.min_capacity)

    def _in_turn(self, pool: _Pool, avoid: set[str], blocked: Callable[[EngineKey], bool]) -> EngineKey | None:
        if pool.in_turn is None:
            pool.in_turn = sorted(pool.members.values(), key=lambda m: m.key.engine_id)
        engines = pool.in_turn
        for avoided_too in (False, True):
            for step in range(len(engines)):
                member = engines[(pool.turn + step) % len(engines)]
                if (avoided_too or member.key.engine_id not in avoid) and not blocked(member.key):
                    pool.turn = (pool.turn + step + 1) % len(engines)
                    return member.key
        return None

    def _build_ring(self, pool: _Pool) -> list[int]:
        points = sorted(
            (_point(f"{key.tenant_id}\0{member.reported_id}\0{i}".encode()), key.engine_id, member)
            for key, member in pool.members.items()
            for i in range(self.config.ring_points)
        )
        pool.ring = [p for p, _, _ in points]
        pool.ring_members = [m for _, _, m in points]
        return pool.ring

    def _affinity(
        self, tenant_id: str, model: str, pool: _Pool, hints: RoutingHints, avoid: set[str],
        blocked: Callable[[EngineKey], bool], fallback: bool,
    ) -> EngineKey | None:
        config = self.config
        capacity = self.capacity(pool.total, len(pool.members))

        def takes(member: _Member) -> bool:
            return (member.load < capacity and (fallback or member.key.engine_id not in avoid)
                    and not blocked(member.key))

        ring = pool.ring if pool.ring is not None else self._build_ring(pool)
        candidates: dict[EngineKey, _Member] = {}
        start = bisect_left(ring, hints.home)
        wanted = 1 + config.spare_candidates
        seen: set[EngineKey] = set()
        for step in range(len(ring)):
            member = pool.ring_members[(start + step) % len(ring)]
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
            for key, depth in self.spills.depths(hints.blocks).items():
                if depth > depths.get(key, 0):
                    depths[key] = depth
        for key in depths:
            held = pool.members.get(key)
            if held is not None and takes(held):
                candidates.setdefault(key, held)
        session_engine = self._sessions.get((tenant_id, model, hints.session)) if hints.session else None
        if session_engine is not None:
            last = pool.members.get(session_engine)
            if last is not None and takes(last):
                candidates.setdefault(session_engine, last)
        if hints.adapter:
            added = 0
            for key in self._adapters.get(hints.adapter, ()):
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
        if config.explain:
            self.last_choice = self._explain(best, best_score, home, depths.get(best, 0), blocks, session_engine,
                                             hints, len(candidates), fallback, self._decision(best, model, hints))
        return best

    def _explain(self, best: EngineKey, score: float, home: EngineKey, depth: int, blocks: int,
                 session_engine: EngineKey | None, hints: RoutingHints, candidates: int,
                 fallback: bool, decision: RoutingDecision) -> RouteChoice:
        had = [name for name, held in (("home", best == home), ("prefix", depth > 0),
                                       ("session", best == session_engine),
                                       ("adapter", bool(hints.adapter)
                                        and hints.adapter in self._members[best].adapters)) if held]
        if fallback:
            had.append("fallback")
        return RouteChoice(best, RoutingPolicy.AFFINITY.value, ",".join(had) or "load", score, candidates, depth,
                           blocks, decision.value)

    def take_choice(self, key: EngineKey) -> RouteChoice | None:
        """Why ``key`` was chosen, if it was the last choice (once: the choice is forgotten)."""
        choice, self.last_choice = self.last_choice, None
        return choice if choice is not None and choice.engine == key else None

    # --- what tools read ----------------------------------------------------

    def load(self, key: EngineKey) -> int:
        """The load routing counts for ``key`` (0 if unknown)."""
        member = self._members.get(key)
        return 0 if member is None else member.load

    def state_size(self) -> dict[str, int]:
        """Entries held: prefix-index blocks, spilled tips, sessions, engines, ring points."""
        return {
            "index_blocks": self.index.size,
            "spilled_tips": len(self.spills),
            "sessions": len(self._sessions),
            "engines": len(self._members),
            "ring_points": sum(len(p.ring or ()) for p in self._pools.values()),
        }
