"""Where spilled prompts went, known alike by every gateway through the exchange; pure.

Bounded-load consistent hashing sends a conversation to the same engine from
every gateway while its ring home has room. When the bound moves a turn
elsewhere (a *spill*), only the gateway that moved it knows where its prefix
is now cached (its own prefix index), and the next turn may well arrive at
another gateway, which would send it back to the ring home and lose the
cache. So a spill is told to the one gateway every task for that engine
passes through, the engine's own: on the forwarded task
(``TaskRequest.infx_prefix_tip``, the hash of the prompt's deepest prefix
block) or directly when the engine is local. That gateway keeps each local
engine's recent spilled tips (LRU, ``per_engine``) and reports them with the
engine's status to every peer (``EngineStatus.Model.infx_prefix_tips``), at
once when a tip is new (:attr:`SpilledTips.recorded`). Every gateway then
holds the same tips for every engine before the spilled turn is answered,
and scores an engine holding a tip of a request's prompt as if its
prefix index had seen that prefix there. No central service, no new message:
the tips ride on the status reports the exchange already sends.

Block hashes chain (a block's hash names the whole prompt up to its end), so
a tip matches exactly the requests whose prompt extends that prompt: the
next turns of one conversation. When a conversation has moved twice, the
engine holding the deepest tip of it wins.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING

from protocol.pb import status_pb2

if TYPE_CHECKING:  # protocol.processor.config holds RoutingConfig in ProcessorConfig
    from protocol.processor.keys import EngineKey

__all__ = ["SpilledTips"]


class SpilledTips:
    """Spilled prompts' tips per engine: recorded for local engines, reported for the others."""

    def __init__(self, per_engine: int) -> None:
        self._per_engine = per_engine
        # A local engine's tips, oldest first, with the model each prompt was for.
        self._local: dict[EngineKey, OrderedDict[int, str]] = {}
        # A remote engine's tips as its gateway last reported them.
        self._reported: dict[EngineKey, tuple[int, ...]] = {}
        self._holders: dict[int, dict[EngineKey, None]] = {}
        #: New tips recorded for local engines since start: peers must hear of one before the
        #: conversation's next turn can reach them (the gateway reports at once when it grows).
        self.recorded = 0

    def __len__(self) -> int:
        return sum(len(t) for t in self._local.values()) + sum(len(t) for t in self._reported.values())

    def record(self, key: EngineKey, model: str, tip: int) -> None:
        """A prompt whose deepest block is ``tip`` was routed off its ring home to local ``key``."""
        if not self._per_engine or not tip:
            return
        tips = self._local.setdefault(key, OrderedDict())
        if tip in tips:
            tips.move_to_end(tip)
            return
        tips[tip] = model
        self.recorded += 1
        self._holders.setdefault(tip, {})[key] = None
        if len(tips) > self._per_engine:
            old, _ = tips.popitem(last=False)
            self._drop(old, key)

    def reported(self, key: EngineKey, status: status_pb2.EngineStatus) -> None:
        """Remote ``key``'s gateway reported ``status``: its tips replace those it reported before."""
        tips: tuple[int, ...] = ()
        if self._per_engine:
            tips = tuple(dict.fromkeys(t for m in status.models for t in m.infx_prefix_tips))[-self._per_engine:]
        before = self._reported.get(key, ())
        if tips == before:
            return
        for tip in before:
            self._drop(tip, key)
        for tip in tips:
            self._holders.setdefault(tip, {})[key] = None
        if tips:
            self._reported[key] = tips
        else:
            self._reported.pop(key, None)

    def forget(self, key: EngineKey) -> None:
        """The engine is gone (or changed sides): drop its tips."""
        for tip in self._local.pop(key, ()):
            self._drop(tip, key)
        for tip in self._reported.pop(key, ()):
            self._drop(tip, key)

    def _drop(self, tip: int, key: EngineKey) -> None:
        holders = self._holders.get(tip)
        if holders is not None:
            holders.pop(key, None)
            if not holders:
                del self._holders[tip]

    def depths(self, blocks: tuple[int, ...]) -> dict[EngineKey, int]:
        """Per engine holding a tip among ``blocks``, how many leading blocks that tip covers."""
        depth: dict[EngineKey, int] = {}
        if not self._holders:
            return depth
        for i, block in enumerate(blocks):
            holders = self._holders.get(block)
            if holders is not None:
                for key in holders:
                    depth[key] = i + 1
        return depth

    def holders(self, tip: int) -> tuple[EngineKey, ...]:
        """The engines holding ``tip`` (a conversation's opening, say), by engine id."""
        holders = self._holders.get(tip)
        return tuple(sorted(holders, key=lambda k: k.engine_id)) if holders else ()

    def annotate(self, key: EngineKey, status: status_pb2.EngineStatus) -> None:
        """Add local ``key``'s tips to ``status`` (a copy going to peers), each under its model."""
        tips = self._local.get(key)
        if not tips:
            return
        for model in status.models:
            del model.infx_prefix_tips[:]
            model.infx_prefix_tips.extend(tip for tip, of in tips.items() if of == model.id)
