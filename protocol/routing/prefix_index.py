"""Which engines this gateway sent each prefix block to: the ``affinity`` policy's memory of
prompts; pure, no I/O, bounded whatever the traffic.

Each entry carries the stamp of the request that last sent the block there (stamps grow by one
per request recorded), so an engine's entries are in stamp order. A runtime's answer that reused
less of a prompt than the index held says the runtime evicted it: a runtime's prompt cache drops
its least recently used contexts first, so everything the index holds of that engine from
before the evicted prompt was sent is gone as well (:meth:`PrefixIndex.evict_through`).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # protocol.processor.config holds RoutingConfig in ProcessorConfig
    from protocol.processor.keys import EngineKey

__all__ = ["PrefixIndex"]


class PrefixIndex:
    """Which engines this gateway sent each prefix block to, LRU per engine.

    An engine's entries are capped at ``min(per_engine, total // engines)``,
    checked whenever it is sent a task and whenever an engine joins, so the
    index never holds more than ``total`` entries. A request's blocks are
    recorded deepest first, so an engine forgets a prompt's tail before its
    shared head.
    """

    #: The stamp of the request last recorded (0: none yet).
    stamp: int

    def __init__(self, per_engine: int, total: int) -> None:
        self._per_engine = per_engine
        self._total = total
        self._by_engine: dict[EngineKey, OrderedDict[int, int]] = {}  # block -> stamp, oldest first
        # Block -> the engine it was sent to, or engines (in the order first sent) when several:
        # most blocks have one holder, and a bare key takes a fraction of a dict's memory.
        self._holders: dict[int, EngineKey | dict[EngineKey, None]] = {}
        self.size = 0
        self.stamp = 0

    def _cap(self) -> int:
        return min(self._per_engine, self._total // max(1, len(self._by_engine)))

    def record(self, key: EngineKey, blocks: tuple[int, ...]) -> None:
        """``blocks`` were sent to ``key``: remember them, most recent last, with the next stamp."""
        if not blocks:
            return
        self.stamp += 1
        lru = self._by_engine.get(key)
        if lru is None:
            lru = self._by_engine[key] = OrderedDict()
            cap = self._cap()
            for other in list(self._by_engine):
                self._trim(other, cap)
        for block in reversed(blocks):
            if block in lru:
                lru[block] = self.stamp
                lru.move_to_end(block)
            else:
                lru[block] = self.stamp
                held = self._holders.get(block)
                if held is None:
                    self._holders[block] = key
                elif isinstance(held, dict):
                    held[key] = None
                else:
                    self._holders[block] = {held: None, key: None}
                self.size += 1
        self._trim(key, self._cap())

    def _trim(self, key: EngineKey, cap: int, through: int = 0) -> None:
        """Drop ``key``'s oldest entries past ``cap``, and those stamped ``through`` or before."""
        lru = self._by_engine[key]
        while lru and (len(lru) > cap or next(iter(lru.values())) <= through):
            block, _ = lru.popitem(last=False)
            held = self._holders[block]
            if isinstance(held, dict):
                del held[key]
                if len(held) == 1:
                    self._holders[block] = next(iter(held))
            else:
                del self._holders[block]
            self.size -= 1

    def stamps(self, key: EngineKey, blocks: tuple[int, ...]) -> tuple[int, ...]:
        """The stamps of the leading ``blocks`` that ``key`` holds, shortest prefix first (stops at the
        first it does not hold)."""
        lru = self._by_engine.get(key)
        out: list[int] = []
        if lru is not None:
            for block in blocks:
                stamp = lru.get(block)
                if stamp is None:
                    break
                out.append(stamp)
        return tuple(out)

    def evict_through(self, key: EngineKey, stamp: int) -> None:
        """``key``'s runtime evicted what the request stamped ``stamp`` sent it: forget that and
        everything older there (entries sent again since keep their newer stamps)."""
        if key in self._by_engine:
            self._trim(key, self._cap(), stamp)

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
