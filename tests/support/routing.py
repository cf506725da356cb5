"""Routing test helpers: conversations as hints, engines, an affinity policy fed as a gateway feeds it."""

from __future__ import annotations

import json

from protocol.processor.keys import EngineKey
from protocol.routing.affinity import Affinity
from protocol.routing.config import RoutingConfig
from protocol.routing.hints import RoutingHints, hints_from_json
from protocol.routing.pools import Pools
from tests.support.processor import engine_status


ENGINES = [f"e{i}" for i in range(8)]


def conversation(n, turns=1, user_words=60):
    messages = [{"role": "system", "content": "Be brief."}]
    for t in range(turns):
        messages.append({"role": "user", "content": f"conversation {n} turn {t} " * user_words})
        if t < turns - 1:
            messages.append({"role": "assistant", "content": f"answer {n}.{t} " * user_words})
    return hints_from_json("chat/completions", json.dumps({"model": "m", "messages": messages}), {})


SYSTEM = "You are assistant number one. " + "words of a long shared system prompt " * 40


def key(engine_id: str) -> EngineKey:
    return EngineKey("t", engine_id)


def slotted(*engine_ids: str, slots: int = 2) -> Pools:
    pools = Pools(spilled_tips=8)
    for engine_id in engine_ids:
        status = engine_status(engine_id, "m")
        status.infx_runtime_slots = slots
        pools.engine_updated(key(engine_id), frozenset({"m"}), status, True)
    return pools


def conversation_hints(n: int, turns: int, system: str, question_repeats: int = 8) -> RoutingHints:
    """User ``n``'s conversation under ``system``: ``turns`` questions (each its words
    ``question_repeats`` times), each but the last answered."""
    messages = [{"role": "system", "content": system}]
    for t in range(turns):
        messages.append({"role": "user", "content": f"user {n} asks question {t} " * question_repeats})
        if t < turns - 1:
            messages.append({"role": "assistant", "content": f"answer {n}.{t} " * 8})
    hints = hints_from_json("chat/completions", json.dumps({"model": "m", "messages": messages}),
                            {"x-session-id": [f"user-{n}"]})
    assert hints is not None
    return hints


def user(n: int, turns: int = 1, system: str = SYSTEM) -> RoutingHints:
    """User ``n`` of one application: its shared system prompt, then its own turns."""
    hints = conversation_hints(n, turns, system)
    assert hints.home_blocks > 0
    return hints


class Gateway:
    """One affinity policy on its pools, sending and finishing requests as a processor would."""

    def __init__(self, engines: tuple[str, ...] = ("e0", "e1", "e2", "e3"), slots: int = 2) -> None:
        self.pools = slotted(*engines, slots=slots)
        self.policy = Affinity(RoutingConfig(), self.pools)
        self.pool = self.pools.pool("t", "m")

    def send(self, hints: RoutingHints) -> EngineKey:
        chosen = self.policy.choose(self.pool, hints, set(), lambda k: False)
        assert chosen is not None
        self.policy.task_sent(self.pools.task_sent(chosen), chosen, "m", hints, 0)
        return chosen

    def finish(self, engine: EngineKey, hints: RoutingHints) -> None:
        self.pools.task_left(engine)
        self.policy.task_left(engine, "m", hints)
