"""A conversation's later turn goes where its earlier turn went, from any gateway (issue #24, part
4): three affinity policies, each holding one of three engines that report two slots, relaying their
engines' spilled tips to each other as the exchange does at once. A first turn that adds less than a
block past a shared system prompt has no block of its own to report; it is reported by its
conversation's opening, which every later turn repeats. Pure: no processor, no clock."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from protocol.processor.keys import EngineKey
from protocol.routing.affinity import Affinity
from protocol.routing.config import RoutingConfig
from protocol.routing.hints import RoutingHints, hints_from_json
from protocol.routing.pools import Pools
from tests.support.processor import engine_status
from tests.support.routing import SYSTEM

ENGINES = ("e0", "e1", "e2")


def turn(n: int, turns: int, system: str = SYSTEM) -> RoutingHints:
    """User ``n``'s request of turn ``turns``: short questions and answers after a shared system prompt."""
    messages = [{"role": "system", "content": system}]
    for t in range(turns):
        messages.append({"role": "user", "content": f"user {n} asks {t}"})
        if t < turns - 1:
            messages.append({"role": "assistant", "content": f"answer {t}"})
    hints = hints_from_json("chat/completions", json.dumps({"model": "m", "messages": messages}),
                            {"x-session-id": [f"user-{n}"]})
    assert hints is not None
    return hints


def test_every_turn_of_a_conversation_names_its_opening_alike_and_other_conversations_not():
    first, later = turn(1, 1), turn(1, 3)
    assert first.opening and first.opening == later.opening != turn(2, 1).opening
    assert len(first.blocks) == first.home_blocks  # nothing of its own to report but its opening
    only_system = hints_from_json("chat/completions", json.dumps(
        {"model": "m", "messages": [{"role": "system", "content": SYSTEM}]}), {})
    assert only_system is not None and only_system.opening == 0


class Exchange:
    """Three gateways, gateway i holding engine i, which see each other's engines as the exchange
    reports them: with spilled tips and (exact) loads, relayed at once."""

    def __init__(self) -> None:
        self.pools = [Pools(spilled_tips=8) for _ in ENGINES]
        self.policies = [Affinity(RoutingConfig(), pools) for pools in self.pools]
        self.relay()

    def status(self, owner: int):
        engine = ENGINES[owner]
        status = engine_status(engine, "m")
        status.infx_runtime_slots = 2
        status.models[0].in_progress_task_count = self.pools[owner].load(EngineKey("t", engine))
        return status

    def relay(self) -> None:
        for owner, engine in enumerate(ENGINES):
            key = EngineKey("t", engine)
            for g, pools in enumerate(self.pools):
                status = self.status(owner)
                if g != owner:
                    self.pools[owner].spills.annotate(key, status)
                pools.engine_updated(key, frozenset({"m"}), status, g == owner)

    def send(self, g: int, hints: RoutingHints) -> EngineKey:
        pools, policy = self.pools[g], self.policies[g]
        chosen = policy.choose(pools.pool("t", "m"), hints, set(), lambda k: False)
        assert chosen is not None
        carried = policy.task_sent(pools.task_sent(chosen), chosen, "m", hints, 0)
        owner = ENGINES.index(chosen.engine_id)
        if owner != g:  # the engine's gateway runs the forwarded task, and records the tip it carries
            self.policies[owner].task_sent(self.pools[owner].task_sent(chosen), chosen, "m", None, carried)
        self.relay()
        return chosen

    def finish(self, g: int, engine: EngineKey, hints: RoutingHints) -> None:
        self.pools[g].task_left(engine)
        self.policies[g].task_left(engine, "m", hints)
        owner = ENGINES.index(engine.engine_id)
        if owner != g:
            self.pools[owner].task_left(engine)
        self.relay()


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 2), st.integers(0, 2), st.integers(0, 5)), min_size=1, max_size=40))
def test_a_later_turn_goes_where_its_first_turn_went_from_any_gateway(steps):
    """Each step opens a conversation at one gateway and sends its second turn from another (or the
    same), while some requests stay in flight so that the system prompt spreads over engines: the
    second turn goes to the first turn's engine whenever that engine has a free slot."""
    exchange = Exchange()
    in_flight: list[tuple[int, EngineKey, RoutingHints]] = []
    for n, (a, b, keep) in enumerate(steps):
        first = turn(n, 1)
        engine = exchange.send(a, first)
        exchange.finish(a, engine, first)
        later = turn(n, 2)
        free = exchange.pools[b].load(engine) < 2
        chosen = exchange.send(b, later)
        if free:
            assert chosen == engine
        in_flight.append((b, chosen, later))
        while len(in_flight) > keep:
            exchange.finish(*in_flight.pop(0))
