"""A conversation's later turn stays on the engine that holds its history (issue #24, part 3): the
affinity policy alone on hand-made pools of engines that report two slots each, no processor, no
clock. The runtime's slots bound first placements; a later turn is bound by the mean's rule and
stays while its engine has a free slot, from any gateway."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from protocol.processor.keys import EngineKey
from protocol.routing.config import RoutingConfig
from protocol.routing.hints import RoutingHints
from tests.support.routing import SYSTEM, Gateway, conversation_hints, user

ENGINES = ("e0", "e1", "e2")


def slotted_gateway() -> Gateway:
    g = Gateway(ENGINES)
    g.policy.config = RoutingConfig(runtime_slots=True)
    return g


def private(n: int, turns: int = 1) -> RoutingHints:
    """User ``n``'s conversation under a system prompt shorter than a block: its home key is its session."""
    hints = conversation_hints(n, turns, "Be brief.")
    assert not hints.home_blocks
    return hints


def busy(g: Gateway, engine: EngineKey, tasks: int) -> None:
    """``tasks`` requests without hints (another model's, say) occupy ``engine``'s slots."""
    for _ in range(tasks):
        g.pools.task_sent(engine)


def test_a_later_turn_waits_for_its_engine_rather_than_computing_its_history_elsewhere():
    """Its engine's two slots are busy and another engine idles: a first placement would go to
    the idle one (the slots bound it), the later turn stays (its bound is the mean's)."""
    g = slotted_gateway()
    first = g.send(user(0))
    g.finish(first, user(0))
    busy(g, first, 2)
    later = g.send(user(0, turns=3))
    assert later == first
    assert g.send(user(1)) != first  # a first turn goes where a slot is free


def test_a_later_turn_with_a_free_slot_on_its_engine_never_moves():
    g = slotted_gateway()
    placed = {n: g.send(user(n)) for n in range(4)}
    for n, engine in placed.items():
        g.finish(engine, user(n))
    for n, engine in placed.items():
        busy(g, engine, 1)  # one slot of two taken, other engines idle
        assert g.send(user(n, turns=2)) == engine
        g.finish(engine, user(n, turns=2))
        g.pools.task_left(engine)


def test_a_gateway_that_never_saw_the_conversation_sends_its_later_turn_where_any_gateway_did():
    """The earlier turn went to its key's first engine on the ring (the engines idle); a second
    gateway, which has no index entry or session for it, sends the next turn there too: with a
    free slot there at once, and with both slots busy by its count (a peer's load is seconds old)
    rather than to an idle engine that would compute the whole history again."""
    a = slotted_gateway()
    first = a.send(private(7))
    later = private(7, turns=3)
    assert later.continues and not private(7).continues and len(later.blocks) > 2
    for tasks in (1, 2):
        b = slotted_gateway()
        busy(b, first, tasks)
        assert b.send(later) == first


def test_a_later_turn_leaves_only_past_the_means_bound():
    g = slotted_gateway()
    first = g.send(user(0))
    g.finish(first, user(0))
    busy(g, first, g.policy.capacity(g.pool.total, len(ENGINES)))  # at the mean's bound, and every other idle
    assert g.send(user(0, turns=2)) != first


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 2), st.integers(0, 9)), min_size=1, max_size=80))
def test_no_later_turn_leaves_an_engine_with_a_free_slot_and_gateways_agree(steps):
    """Sends of first and later turns of ten conversations and ends, in any order, on two gateways
    fed alike: both choose the same engine, and a later turn whose engine has a free slot stays."""
    a, b = slotted_gateway(), slotted_gateway()
    turns: dict[int, int] = {}
    last: dict[int, EngineKey] = {}
    live: list[tuple[EngineKey, RoutingHints]] = []
    for action, n in steps:
        if action == 0 and live:
            engine, hints = live.pop(n % len(live))
            a.finish(engine, hints)
            b.finish(engine, hints)
            continue
        turns[n] = turns.get(n, 0) + 1
        hints = user(n, turns=turns[n])
        before = a.pools.load(last[n]) if n in last else None
        chosen = a.send(hints)
        assert b.send(hints) == chosen
        if before is not None and before < 2:
            assert chosen == last[n]
        last[n] = chosen
        live.append((chosen, hints))


def test_the_system_prompt_of_these_tests_is_a_shared_home_key():
    assert user(0).home_blocks > 0 and user(0).home == user(1).home and len(SYSTEM) > 256
