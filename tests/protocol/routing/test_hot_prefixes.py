"""Capacity from the runtime's slots and hot prefixes spread over engines (issue #24): the affinity
policy alone on hand-made pools of engines that report two slots each, no processor, no clock."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from protocol.processor.keys import EngineKey
from protocol.routing.affinity import Affinity
from protocol.routing.config import RoutingConfig
from protocol.routing.hints import RoutingHints, hints_from_json
from protocol.routing.pools import Pools
from protocol.routing.router import Router
from tests.support.processor import engine_status

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


def user(n: int, turns: int = 1, system: str = SYSTEM) -> RoutingHints:
    """User ``n`` of one application: its shared system prompt, then its own turns."""
    messages = [{"role": "system", "content": system}]
    for t in range(turns):
        messages.append({"role": "user", "content": f"user {n} asks question {t} " * 8})
        if t < turns - 1:
            messages.append({"role": "assistant", "content": f"answer {n}.{t} " * 8})
    hints = hints_from_json("chat/completions", json.dumps({"model": "m", "messages": messages}),
                            {"x-session-id": [f"user-{n}"]})
    assert hints is not None and hints.home_blocks > 0
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


def test_a_hot_system_prompt_spreads_over_as_many_engines_as_its_load_needs():
    """Six users of one application in flight at once on engines of two slots: three engines run
    them, none waits behind two others while an engine idles."""
    g = Gateway()
    engines = [g.send(user(n)) for n in range(6)]
    load = {e: engines.count(e) for e in set(engines)}
    assert len(load) == 3 and max(load.values()) == 2
    assert g.policy.homes(g.pool, user(99)) == 4  # a seventh needs a fourth engine's slot


def test_a_cold_system_prompt_keeps_one_home_and_engines_that_report_no_slots_keep_todays_rule():
    g = Gateway()
    first = g.send(user(0))
    g.finish(first, user(0))
    assert g.send(user(1)) == first  # one at a time: all on the key's first engine
    unslotted = Gateway(slots=0)
    assert len({unslotted.send(user(n)) for n in range(4)}) == 1  # the bound's minimum of 4, as before


def test_a_conversations_later_turn_goes_back_to_its_engine_among_the_keys_homes():
    g = Gateway()
    sent = {n: g.send(user(n)) for n in range(6)}
    for n in (0, 3, 5):  # three turns end; their users come back with their next turns
        g.finish(sent[n], user(n))
        assert g.send(user(n, turns=2)) == sent[n]


def test_the_spread_shrinks_back_when_the_load_falls():
    g = Gateway()
    sent = [(g.send(user(n)), user(n)) for n in range(8)]
    assert g.policy.homes(g.pool, user(99)) == 4
    for engine, hints in sent:
        g.finish(engine, hints)
    assert g.policy.homes(g.pool, user(99)) == 1
    assert g.policy.state_size()["hot_keys"] == 0 and g.policy.state_size()["spread_keys"] == 0


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 11)), min_size=1, max_size=80))
def test_gateways_that_saw_the_same_requests_choose_the_same_and_no_engine_takes_a_third_while_one_idles(steps):
    """Determinism across gateways (two policies fed the same sends and ends choose alike), and the
    spread's promise: a user of the hot key never goes to an engine with both slots busy while another
    engine has none busy."""
    a, b = Gateway(), Gateway()
    live: list[tuple[EngineKey, RoutingHints]] = []
    for send, n in steps:
        if send or not live:
            hints = user(n, turns=1 + n % 3)
            loads = {k: m.load for k, m in a.pool.members.items()}
            chosen = a.send(hints)
            assert b.send(hints) == chosen
            if loads[chosen] >= 2 and n % 3 == 0:  # a first turn (a later one may wait for its cache)
                assert min(loads.values()) >= 1
            live.append((chosen, hints))
        else:
            engine, hints = live.pop(n % len(live))
            a.finish(engine, hints)
            b.finish(engine, hints)


def test_the_bounded_load_rule_takes_the_runtimes_slots_for_its_minimum():
    g = Gateway()
    assert g.policy.capacity(0, 4, slots=2) == 2 and g.policy.capacity(0, 4) == RoutingConfig().min_capacity
    assert g.policy.capacity(20, 4, slots=2) == 7  # above the slots, the mean's bound as before


def test_a_router_without_runtime_slots_ignores_the_slots_engines_report():
    """RoutingConfig.runtime_slots off (a config file's routing_runtime_slots: false): the reported slots shape nothing, so the
    bound keeps min_capacity and a hot prefix keeps its one home, as before slots were reported."""
    status = engine_status("a", "m")
    status.infx_runtime_slots = 2
    for enabled, slots in ((False, 0), (True, 2)):
        router = Router(RoutingConfig(runtime_slots=enabled))
        router.engine_updated(key("a"), frozenset({"m"}), status, True)
        pool = router.pools.pool("t", "m")
        assert pool is not None and pool.members[key("a")].slots == slots
