"""Capacity from the runtime's slots and hot prefixes spread over engines (issue #24): the affinity
policy alone on hand-made pools of engines that report two slots each, no processor, no clock."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from protocol.processor.keys import EngineKey
from protocol.routing.config import RoutingConfig
from protocol.routing.hints import RoutingHints
from protocol.routing.router import Router
from tests.support.processor import engine_status
from tests.support.routing import Gateway, conversation_hints, key, user

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


def _colliding_applications(g: Gateway) -> tuple[str, str]:
    """Two system prompts whose first engine on the ring is the same."""
    homes: dict[EngineKey, str] = {}
    for n in range(64):
        system = f"You are application {n}. " + "Answer with care. " * 20
        probe = Gateway(tuple(k.engine_id for k in g.pool.members))
        home = probe.send(user(0, system=system))
        if home in homes:
            return homes[home], system
        homes[home] = system
    raise AssertionError("no two of 64 system prompts share a home")


def test_a_new_application_whose_home_runs_another_goes_to_an_engine_that_runs_none():
    """Three toolsets on three engines, two of them homed on one engine by the ring: the second's first
    request goes where no other application's requests run (sglang-router's first placement by load
    does this; docs/routing-real.md, part 6), and its later users follow its prefix there."""
    g = Gateway(("e0", "e1", "e2"))
    first, second = _colliding_applications(g)
    a = g.send(user(0, system=first))
    b = g.send(user(1, system=second))
    assert b != a
    g.finish(b, user(1, system=second))
    assert g.send(user(2, system=second)) == b  # the next user of it finds its prefix there
    assert g.send(user(3, system=first)) == a


def test_with_every_engine_running_other_applications_a_new_one_goes_to_its_ring_home():
    g = Gateway(("e0", "e1"))
    first, second = _colliding_applications(g)
    third = "A third application. " + "Say little. " * 30
    home = Gateway(("e0", "e1")).send(user(2, system=second))
    g.send(user(0, system=first))
    g.send(user(1, system=third))  # now both engines run an application
    assert g.send(user(2, system=second)) == home


def test_without_runtime_slots_a_later_turn_follows_its_opening_from_another_gateway():
    """Engines that report no slots (llama-cpp-python's server, LLMariner's) have no engine of a
    conversation's own: a first turn with no block past its system prompt placed apart is found again
    only by its opening's spilled tip, and a later turn, which a gateway that never saw the
    conversation cannot tell from a first, is never placed apart itself (tests/e2e/test_llama_routing.py)."""
    g = Gateway(("e0", "e1", "e2"), slots=0)
    first, second = _colliding_applications(g)
    opening = conversation_hints(1, 1, second, question_repeats=1)
    assert len(opening.blocks) == opening.home_blocks  # nothing of its own to name it by but its opening
    a = g.send(conversation_hints(0, 1, first, question_repeats=1))
    b = g.send(opening)
    assert b != a
    other = Gateway(("e0", "e1", "e2"), slots=0)  # the next turn reaches another gateway,
    assert other.send(conversation_hints(5, 1, first, question_repeats=1)) == a  # busy with the first
    later = conversation_hints(1, 2, second, question_repeats=1)
    assert later.continues
    assert other.send(later) == a  # without the tip: the ring home, not apart from it
    status = engine_status(b.engine_id, "m")
    g.pools.spills.annotate(b, status)  # the engine's gateway reports its tips (at once: a new one)
    third = Gateway(("e0", "e1", "e2"), slots=0)
    third.pools.spills.reported(b, status)
    assert third.send(later) == b
