"""The ``affinity`` policy (infx's): bounded-load consistent hashing, refined by what this
gateway learned; pure, no I/O, no clock.

Every engine of a (tenant, model) has ``ring_points`` points on a hash
ring; a request's home key (:mod:`protocol.routing.hints`) lands on the
ring and the first engine clockwise *with room* is its home. Room is the
bounded-load rule: an engine's load must stay below the capacity
``max(ceil(load_factor * (total load + 1) / engines), min_capacity)``, so
no engine carries more than ``load_factor`` times the mean, plus one
(below ``min_capacity`` requests an engine is never loaded enough for
the bound to matter, and affinity is worth most). Where every engine of
the pool reports its runtime's slots (``infx_runtime_slots``), the fewest
of them replace ``min_capacity``: a runtime runs that many at once, and a
request beyond them waits inside it.

A hot home key spreads: a shared system prompt that keeps more requests in
flight than one engine's slots run at once has as many homes as its load
needs, ``ceil((its requests in flight + 1) / slots)``: the first that many
engines clockwise from the key, the same list on every gateway, of which a
gateway that counts a different load takes a longer or shorter beginning.
Its requests in flight are this gateway's, scaled by the pool's load over
this gateway's share of it (other gateways send theirs alike). Every home
is credited with the key's blocks (``RoutingHints.home_blocks``) as if it
held them, which it does after its first request, so a first turn goes to
the home with room to run it now and a later turn follows its own prefix;
as the load falls, the homes fall back to the first (a conversation that
went to another keeps following its prefix there). Engines that report no
slots keep one home.

A few home keys over a few engines collide on the ring (three keys on three
engines share a first engine more often than not), and a collision costs the
key that spills a second copy of its prefix once its home's slots fill. So
the first turn of a key new here (no engine holds any of its prompt, none of its requests in
flight from this gateway) whose first engine runs other keys' requests from
this gateway goes to the first engine clockwise that runs the fewest, if
that is fewer. Its next requests from here follow its prefix there; where
that engine is this gateway's own, the key's shared part is recorded on it
as a spilled tip too, so every gateway credits it with the key and sends the
key's next first turns there (where it is a peer's, the forwarded task
carries only the conversation's tip, and another gateway, which sends its
share of the same keys, may count them alike and choose the same engine);
and a conversation's later turns follow the spilled tip its first turn left,
from any gateway. Every gateway knows
the same engines from the exchange, and hashes each by the id it reports
(a peer's engine is named with its pod here), or by the name of its runtime
where engines of several gateways and workers front one runtime served by URL
(each routes to its own, :mod:`protocol.routing.pools`), so a conversation arriving at any
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
  - busy_weight    * requests it would wait behind / slots

(a hot key's homes all count as the home) and the best wins (ties: ring
order). The last term is for engines that report their slots: a request
sent to an engine whose slots are all busy waits in its runtime, worth it
for a long cached prefix (a conversation's later turn, whose engine holds
its whole history) and not for a shared one another engine with a free
slot holds as well. A task without hints (embeddings,
targeted or internal tasks) is routed the ``least_in_progress`` way.

Where engines report their slots, a later turn is not placed again: it
stays on its *own* engine (the one known to hold most of its prompt past the
home key's shared part, else its session's last engine here, else, for a
prompt that holds an earlier answer and that this gateway has not seen, the
key's first engine on the ring, where any gateway sent it unless a spilled
tip says otherwise) while that engine has a free slot and is below the
mean's bound. With its slots busy it is scored with the rest, credited with
its prompt, and bound by the mean's rule, not by the slots: the slots bound
first placements, which lose nothing by going where a slot is free, while a
later turn elsewhere computes its whole history again.

What it keeps of its own, bounded by :class:`~protocol.routing.config.RoutingConfig`: each
pool's ring (rebuilt when its members change), the prefix index
(:mod:`protocol.routing.prefix_index`), the last engine of each session (LRU) and this
gateway's requests in flight per home key and engine (an entry per request in flight at most).
"""

from __future__ import annotations

import hashlib
import itertools
import math
from bisect import bisect_left
from collections import OrderedDict
from collections.abc import Callable, Set
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from protocol.routing.config import RoutingConfig
from protocol.routing.hints import RoutingHints
from protocol.routing.least_in_progress import least_in_progress
from protocol.routing.policy import HeldBack, Policy, RouteChoice, RoutingDecision
from protocol.routing.pools import Member, Pool, Pools
from protocol.routing.prefix_index import PrefixIndex

if TYPE_CHECKING:  # protocol.processor.config holds RoutingConfig in ProcessorConfig
    from protocol.processor.keys import EngineKey

__all__ = ["Affinity"]

#: Home keys whose spread is remembered (LRU): the hot ones, a few per application.
_SPREAD_KEYS = 4096
#: Engines with the request's adapter loaded that are scored besides the ring's (bounded work).
_ADAPTER_CANDIDATES = 4


def _point(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8, key=b"infx-ring").digest(), "big")


@dataclass(slots=True)
class _Ring:
    """One pool's hash ring: sorted points and the engine of each."""

    points: list[int]
    members: list[Member]


def _conversation(hints: RoutingHints) -> bytes | None:
    """What names the request's conversation among those of its home key: its session, else the
    first block past the key's part (the conversation's opening, repeated every turn)."""
    if hints.session:
        return b"session\0" + hints.session.encode("utf-8", "replace")
    if len(hints.blocks) > hints.home_blocks:
        return b"block\0" + hints.blocks[hints.home_blocks].to_bytes(8, "big")
    return None


class Affinity(Policy):
    """Bounded-load consistent hashing with prefix, session and adapter affinity."""

    def __init__(self, config: RoutingConfig, pools: Pools) -> None:
        super().__init__(config, pools)
        self.index = PrefixIndex(config.index_blocks_per_engine, config.index_blocks_total)
        self._sessions: OrderedDict[tuple[str, str, str], EngineKey] = OrderedDict()
        #: (engine, tip block) -> (blocks of the prompt the index held there when sent, the oldest stamp of
        #: those past the home key's part): what its answer is checked against (an entry per task in flight).
        self._expected: dict[tuple[EngineKey, int], tuple[int, int]] = {}
        self._rings: dict[tuple[str, str], _Ring] = {}
        #: With ``config.explain``: why the last engine was chosen by affinity (its decision aside).
        self._explained: RouteChoice | None = None
        #: (tenant, model, home key) -> engine -> this gateway's requests in flight there.
        self._hot: dict[tuple[str, str, int], dict[EngineKey, int]] = {}
        #: (tenant, model, home key) -> its homes, where more than one (LRU).
        self._spread: OrderedDict[tuple[str, str, int], int] = OrderedDict()

    def choose(self, pool: Pool, hints: RoutingHints | None, avoid: Set[str], held_back: HeldBack) -> EngineKey | None:
        self._explained = None
        if hints is None:
            return least_in_progress(pool, avoid, held_back)
        chosen = self._affinity(pool, hints, avoid, held_back, fallback=False)
        return chosen or self._affinity(pool, hints, avoid, held_back, fallback=True)

    def capacity(self, total: int, engines: int, slots: int = 0) -> int:
        """The bounded-load rule: an engine with this load (or more) takes no task by affinity
        (``slots``: the fewest any engine of the pool runs at once, 0 when one does not say)."""
        return max(math.ceil(self.config.load_factor * (total + 1) / engines), slots or self.config.min_capacity)

    def pool_changed(self, pool: Pool) -> None:
        self._rings.pop((pool.tenant_id, pool.model), None)

    def engine_removed(self, key: EngineKey) -> None:
        self.index.forget(key)
        for expected in [k for k in self._expected if k[0] == key]:
            del self._expected[expected]
        for hot_key in [k for k, engines in self._hot.items() if key in engines]:
            engines = self._hot[hot_key]
            del engines[key]
            if not engines:
                del self._hot[hot_key]

    def task_left(self, key: EngineKey, model: str, hints: RoutingHints | None) -> None:
        if hints is not None and hints.blocks:
            self._expected.pop((key, hints.blocks[-1]), None)
        if hints is None or not hints.home_blocks:
            return
        hot_key = (key.tenant_id, model, hints.home)
        engines = self._hot.get(hot_key)
        if engines is None or key not in engines:
            return
        engines[key] -= 1
        if not engines[key]:
            del engines[key]
            if not engines:
                del self._hot[hot_key]

    def homes(self, pool: Pool, hints: RoutingHints) -> int:
        """How many engines the request's home key has now (see the module docstring)."""
        if not hints.home_blocks:
            return 1
        slots = min((m.slots for m in pool.members.values()), default=0)
        if not slots:
            return 1
        hot_key = (pool.tenant_id, pool.model, hints.home)
        engines = self._hot.get(hot_key)
        mine = sum(engines.values()) if engines else 0
        own = sum(m.in_flight for m in pool.members.values())
        load = mine * max(1.0, pool.total / own) if own else mine
        needed = min(len(pool.members), max(1, math.ceil((load + 1) / slots)))
        spread = self._spread.get(hot_key, 1)
        # Grow at once; shrink only past a whole engine's slack, so that a load that comes and
        # goes around a boundary does not move conversations back and forth; none in flight: one.
        if not mine:
            spread = 1
        elif needed > spread or needed < spread - 1:
            spread = needed if needed > spread else needed + 1
        spread = min(spread, len(pool.members))
        if spread > 1:
            self._spread[hot_key] = spread
            self._spread.move_to_end(hot_key)
            if len(self._spread) > _SPREAD_KEYS:
                self._spread.popitem(last=False)
        else:
            self._spread.pop(hot_key, None)
        return spread

    def task_sent(self, member: Member | None, key: EngineKey, model: str, hints: RoutingHints | None,
                  forwarded_tip: int) -> int:
        """Remember the prompt's blocks and session on ``key``; a prompt routed off its ring home
        is a spill (:mod:`protocol.routing.spills`): its tip is recorded here when ``key`` is
        local, else returned, to be carried on the forwarded task to the engine's gateway."""
        if hints is None:
            return super().task_sent(member, key, model, hints, forwarded_tip)
        # A prompt with no block of its own past the home key's part (a first turn shorter than a
        # block) is named by its conversation's opening, which its later turns repeat.
        tip = hints.blocks[-1] if len(hints.blocks) > hints.home_blocks or not hints.opening else hints.opening
        spilled = bool(tip) and bool(self.config.spilled_tips) and self._spilled(key, model, hints)
        local = member is not None and member.local
        # Read before this send is counted: only a local spill asks it.
        apart = spilled and local and self._new_here(key, model, hints)
        if hints.home_blocks:
            engines = self._hot.setdefault((key.tenant_id, model, hints.home), {})
            engines[key] = engines.get(key, 0) + 1
        held = self.index.stamps(key, hints.blocks)
        if len(held) > hints.home_blocks:
            self._expected[(key, hints.blocks[-1])] = (len(held), min(held[hints.home_blocks:]))
        self.index.record(key, hints.blocks)
        carried = 0
        if spilled:
            if local:
                self.pools.spills.record(key, model, tip)
                if apart:
                    # Placed off its ring home (apart from other keys, or the home had no room): every
                    # gateway credits this engine with the key's shared part, so the key's next first
                    # turns follow it there from any gateway, not only from this one.
                    self.pools.spills.record(key, model, hints.blocks[hints.home_blocks - 1])
            else:
                carried = tip
        if hints.session and self.config.sessions:
            session = (key.tenant_id, model, hints.session)
            self._sessions[session] = key
            self._sessions.move_to_end(session)
            if len(self._sessions) > self.config.sessions:
                self._sessions.popitem(last=False)
        return carried

    def task_answered(self, key: EngineKey, model: str, hints: RoutingHints | None, prompt_tokens: int,
                      cached_tokens: int) -> None:
        """``key``'s runtime answered a task of ``model`` saying it reused ``cached_tokens`` of its
        ``prompt_tokens``. Far less than the index held there when it was sent (under the midpoint
        between the home key's shared part and what was held, in shares of the prompt) says the runtime
        evicted the prompt: the index forgets it and everything sent there before it
        (:meth:`PrefixIndex.evict_through`). A later turn of a conversation so forgotten still goes
        to its session's engine while that has a free slot, but is credited there with the shared
        part alone, so it no longer waits for a busy engine that holds no more of it than others."""
        if hints is None or not hints.blocks or prompt_tokens <= 0:
            return
        expected = self._expected.pop((key, hints.blocks[-1]), None)
        if expected is None:
            return
        held, stamp = expected
        if cached_tokens / prompt_tokens < (hints.home_blocks + held) / 2 / len(hints.blocks):
            self.index.evict_through(key, stamp)

    def decision(self, key: EngineKey, model: str, hints: RoutingHints | None) -> RoutingDecision:
        """A prompt's engine held its start (``prefix_hit``), else was its ring home, else took it
        past its home's load bound (``spill``); without hints, by load."""
        if hints is None:
            return RoutingDecision.LOAD
        if hints.blocks and (self.index.holds(key, hints.blocks[0]) or key in self.pools.spills.depths(hints.blocks)):
            return RoutingDecision.PREFIX_HIT
        pool = self.pools.pool(key.tenant_id, model)
        if pool is None or key not in pool.members:
            return RoutingDecision.HOME
        ring = self._ring(pool)
        home = ring.members[bisect_left(ring.points, hints.home) % len(ring.points)].key
        return RoutingDecision.HOME if home == key else RoutingDecision.SPILL

    def state_size(self) -> dict[str, int]:
        return {"index_blocks": self.index.size, "sessions": len(self._sessions), "expected": len(self._expected),
                "ring_points": sum(len(ring.points) for ring in self._rings.values()),
                "hot_keys": len(self._hot), "spread_keys": len(self._spread)}

    def _new_here(self, key: EngineKey, model: str, hints: RoutingHints) -> bool:
        """Whether the prompt's home key is new here: none of its requests in flight from here, none
        of its shared part held anywhere."""
        home = hints.blocks[:hints.home_blocks]
        return bool(home) and not self._hot.get((key.tenant_id, model, hints.home)) \
            and not self.index.depths(home) and not self.pools.spills.depths(home)

    def _spilled(self, key: EngineKey, model: str, hints: RoutingHints) -> bool:
        """Whether another gateway would not send this prompt's next turn to ``key`` by itself:
        ``key`` is not the first engine on the ring for the home key, or the spilled tips place
        this prompt's prefix (or its conversation's opening) on another engine (the conversation
        moves back or on)."""
        pool = self.pools.pool(key.tenant_id, model)
        if pool is None or key not in pool.members:
            return False
        ring = self._ring(pool)
        if ring.members[bisect_left(ring.points, hints.home) % len(ring.points)].key != key:
            return True
        return any(other != key for other in self.pools.spilled_depths(hints.blocks)) or \
            any(other != key for other in self.pools.spilled_holders(hints.opening))

    def _ring(self, pool: Pool) -> _Ring:
        ring = self._rings.get((pool.tenant_id, pool.model))
        if ring is None:
            points = sorted(
                (_point(f"{key.tenant_id}\0{member.ring_id}\0{i}".encode()), key.engine_id, member)
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
        slots = min((m.slots for m in pool.members.values()), default=0)
        capacity = self.capacity(pool.total, len(pool.members), slots)
        depths = self.index.depths(hints.blocks) if config.prefix_weight else {}
        if config.prefix_weight:
            for key, depth in self.pools.spilled_depths(hints.blocks).items():
                if depth > depths.get(key, 0):
                    depths[key] = depth
        ring = self._ring(pool)
        start = bisect_left(ring.points, hints.home)
        session_engine = self._sessions.get((pool.tenant_id, pool.model, hints.session)) if hints.session else None
        # Where engines say nothing of their slots, routing is as it was before them, but for a later turn
        # whose conversation opened on an engine off its ring home (a first turn with no block of its own
        # leaves only its opening as a tip): that engine is credited with the prompt's start.
        mine, mine_depth = self._own(pool, hints, depths, session_engine,
                                     ring.members[start % len(ring.points)].key) if slots else (None, 0)
        if not slots and hints.continues and config.prefix_weight:
            for key in self._opened(pool, hints):
                depths[key] = max(depths.get(key, 0), hints.home_blocks, len(hints.blocks) - 1)
        # A later turn's own engine, and any engine holding its own prefix (past the home key's
        # shared part), are bound by the mean alone, not by the slots: waiting there for a slot
        # costs less than computing the history again elsewhere (the busy term weighs it); the
        # slots bound first placements, which lose nothing by going where a slot is free.
        own_capacity = self.capacity(pool.total, len(pool.members)) if slots else capacity
        own = {key for key, depth in depths.items() if depth > hints.home_blocks}
        if mine is not None:
            own.add(mine)

        def takes(member: Member) -> bool:
            return (member.load < (own_capacity if member.key in own else capacity)
                    and (fallback or member.key.engine_id not in avoid) and not held_back(member.key))

        if mine is not None:
            member = pool.members[mine]
            if takes(member) and member.load < member.slots:  # it has a free slot: the turn stays
                if config.explain:
                    had = [name for name, held in (("home", mine == ring.members[start % len(ring.points)].key),
                                                   ("prefix", depths.get(mine, 0) > 0),
                                                   ("session", mine == session_engine)) if held]
                    self._explained = RouteChoice(mine, config.policy.value, ",".join(["own", *had]), 0.0, 1,
                                                  depths.get(mine, 0), len(hints.blocks))
                return mine
        candidates: dict[EngineKey, Member] = {}
        spread = self.homes(pool, hints)
        wanted = spread + config.spare_candidates
        seen: dict[EngineKey, None] = {}  # in ring order
        for step in range(len(ring.points)):
            member = ring.members[(start + step) % len(ring.points)]
            if member.key in seen:
                continue
            seen[member.key] = None
            if takes(member):
                candidates[member.key] = member
                if len(candidates) == wanted:
                    break
            if len(seen) == len(pool.members):
                break
        if not candidates:
            return None
        # A spread key's homes are its first ``spread`` engines on the ring; the conversation's
        # own is the one its session ranks first among them, the same on every gateway that
        # counts the same spread (else, all of them full, the first engine with room).
        spread_homes = [key for key in itertools.islice(seen, spread) if key in candidates] if spread > 1 else []
        home = next(iter(candidates))
        if spread > 1 and session_engine in spread_homes:
            home = session_engine  # a conversation stays where the key's spread found it
        elif spread > 1:
            conversation = _conversation(hints)
            if conversation is not None:
                ranked = max(itertools.islice(seen, spread),
                             key=lambda key: _point(conversation + pool.members[key].ring_id.encode()))
                if ranked in candidates:
                    home = ranked
            elif spread_homes:
                home = spread_homes[0]
        # A first turn of a key new here goes apart from other keys (:meth:`_apart`); a later turn never
        # does, even where nothing here knows its conversation: it follows its opening's spilled tip,
        # else its ring home, where any gateway sent its first turn unless that tip says otherwise.
        if not hints.continues and mine is None and spread == 1 and not depths and hints.home_blocks \
                and not self._hot.get((pool.tenant_id, pool.model, hints.home)):
            apart = self._apart(pool, ring, start, home, takes)
            if apart is not None:
                candidates.setdefault(apart, pool.members[apart])
                home = apart
        for key in depths:
            held = pool.members.get(key)
            if held is not None and takes(held):
                candidates.setdefault(key, held)
        if mine is not None:
            home = mine  # a later turn's home is its own engine, whatever its key's
        for known in (session_engine, mine):
            if known is not None:
                last = pool.members.get(known)
                if last is not None and takes(last):
                    candidates.setdefault(known, last)
        if hints.adapter:
            added = 0
            for key in self.pools.holding_adapter(hints.adapter):
                loaded = pool.members.get(key)
                if loaded is not None and takes(loaded) and key not in candidates:
                    candidates[key] = loaded
                    added += 1
                    if added == _ADAPTER_CANDIDATES:
                        break
        best, best_score = next(iter(candidates)), -math.inf
        blocks = len(hints.blocks)
        for key, member in candidates.items():
            score = -config.queue_weight * member.load / capacity
            if member.slots:
                score -= config.busy_weight * max(0, member.load + 1 - member.slots) / member.slots
            if blocks:
                depth = depths.get(key, 0)
                if key == mine:
                    depth = max(depth, mine_depth)
                if key in spread_homes:
                    depth = max(depth, hints.home_blocks)
                score += config.prefix_weight * depth / blocks
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
            had = [name for name, held in (("home", best == home), ("prefix", depths.get(best, 0) > 0),
                                           ("session", best == session_engine),
                                           ("adapter", bool(hints.adapter)
                                            and hints.adapter in candidates[best].adapters)) if held]
            if fallback:
                had.append("fallback")
            self._explained = RouteChoice(best, self.config.policy.value, ",".join(had) or "load", best_score,
                                          len(candidates), depths.get(best, 0), blocks)
        return best

    def _apart(self, pool: Pool, ring: _Ring, start: int, home: EngineKey,
               takes: Callable[[Member], bool]) -> EngineKey | None:
        """For a home key new here (nothing of its prompt held anywhere, none of its requests in flight)
        whose home runs another key's requests from this gateway: the first engine on the ring from the
        key that runs the fewest other keys' requests and has room, if it runs fewer than the home."""
        busy: dict[EngineKey, int] = {}
        for (tenant, model, _), engines in self._hot.items():
            if tenant == pool.tenant_id and model == pool.model:
                for key in engines:
                    busy[key] = busy.get(key, 0) + 1
        if not busy.get(home):
            return None
        best, fewest = None, busy[home]
        seen: set[EngineKey] = set()
        for step in range(len(ring.points)):
            member = ring.members[(start + step) % len(ring.points)]
            if member.key in seen:
                continue
            seen.add(member.key)
            if busy.get(member.key, 0) < fewest and takes(member):
                best, fewest = member.key, busy.get(member.key, 0)
                if not fewest:
                    break
            if len(seen) == len(pool.members):
                break
        return best

    def _own(self, pool: Pool, hints: RoutingHints, depths: dict[EngineKey, int], session_engine: EngineKey | None,
             ring_home: EngineKey) -> tuple[EngineKey | None, int]:
        """The engine a later turn stays on while it has a free slot (else it is scored, its bound
        the mean's), and the blocks of the prompt it is credited with: the engine known to hold
        most of the prompt's own part (past the home key's shared part), else the one that served
        the session last from here, else, for a prompt that continues a conversation this gateway
        has not seen, the engine a gateway reported its opening spilled to (a first turn with no
        block of its own is reported by its opening), else the key's first engine on the ring,
        credited with all but the last block: any gateway sent the earlier turn there unless it
        reported the turn's tip elsewhere (:mod:`protocol.routing.spills`), which the first case finds. (None, 0): a first turn."""
        deepest = max(depths.values(), default=0)
        if deepest > hints.home_blocks:
            held = [key for key, depth in depths.items() if depth == deepest and key in pool.members]
            if held:
                return (session_engine if session_engine in held else min(held, key=lambda k: k.engine_id)), deepest
        if session_engine is not None and session_engine in pool.members:
            return session_engine, depths.get(session_engine, 0)
        if hints.continues:
            # Where a gateway reported the conversation's opening spilled (its first turn, which had
            # no block of its own to report), else the key's first engine on the ring.
            opened = self._opened(pool, hints)
            return (opened[0] if opened else ring_home), max(0, len(hints.blocks) - 1)
        return None, 0

    def _opened(self, pool: Pool, hints: RoutingHints) -> list[EngineKey]:
        """The engines of ``pool`` a gateway reported this conversation's opening spilled to, by engine id."""
        if not hints.opening:
            return []
        return [key for key in self.pools.spilled_holders(hints.opening) if key in pool.members]

    def explain(self, key: EngineKey, model: str, hints: RoutingHints | None) -> RouteChoice:
        explained = self._explained
        if explained is None or explained.engine != key:
            return super().explain(key, model, hints)
        return replace(explained, decision=self.decision(key, model, hints).value)
