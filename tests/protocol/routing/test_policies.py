"""Routing policies as one kind: each policy alone on hand-made pools (no processor), the pools
every policy reads, and the router that holds the one ``--routing-policy`` names."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from protocol.processor.core import Processor, ProcessorConfig, SendTask
from protocol.processor.keys import EngineKey, Locality
from protocol.routing.affinity import Affinity
from protocol.routing.config import RoutingConfig, RoutingPolicy
from protocol.routing.least_in_progress import LeastInProgress, least_in_progress
from protocol.routing.policy import Policy
from protocol.routing.pools import Pools
from protocol.routing.round_robin import RoundRobin
from protocol.routing.router import POLICIES, Router
from tests.support.processor import chat, engine_status, http, only
from tests.support.routing import conversation

def key(engine_id: str) -> EngineKey:
    return EngineKey("t", engine_id)


def pools_of(*engines: tuple[str, bool], model: str = "m") -> Pools:
    """Pools where each (engine id, local) engine has ``model`` ready."""
    pools = Pools(spilled_tips=8)
    for engine_id, local in engines:
        pools.engine_updated(key(engine_id), frozenset({model}), engine_status(engine_id, model), local)
    return pools


def held(*engine_ids: str):
    keys = {key(e) for e in engine_ids}
    return lambda k: k in keys


def test_every_policy_the_option_names_has_an_implementation_of_the_one_interface():
    assert set(POLICIES) == set(RoutingPolicy)
    assert all(issubclass(cls, Policy) for cls in POLICIES.values())
    for policy in RoutingPolicy:
        assert isinstance(Router(RoutingConfig(policy=policy)).policy, POLICIES[policy])


def test_least_in_progress_ranks_unavoided_then_local_then_fewest_in_flight_then_id():
    pools = pools_of(("a", False), ("b", True), ("c", True))
    pool = pools.pool("t", "m")
    assert least_in_progress(pool, set(), held()) == key("b")  # local, both idle: the lower id
    pools.task_sent(key("b"))
    assert least_in_progress(pool, set(), held()) == key("c")  # fewer in flight
    pools.task_sent(key("c"))
    pools.task_sent(key("c"))
    assert least_in_progress(pool, set(), held()) == key("b")
    assert least_in_progress(pool, {"b"}, held()) == key("c")  # avoided last
    assert least_in_progress(pool, {"b", "c"}, held()) == key("a")  # a remote engine before an avoided one
    assert least_in_progress(pool, {"a", "b", "c"}, held("b")) == key("c")
    assert least_in_progress(pool, set(), held("a", "b", "c")) is None


def test_least_in_progress_counts_this_processors_tasks_not_what_the_engine_reported():
    pools = pools_of(("a", True), ("b", True))
    busy = engine_status("a", "m")
    busy.models[0].in_progress_task_count = 50  # every gateway's tasks: the affinity load, not this rank
    pools.engine_updated(key("a"), frozenset({"m"}), busy, True)
    pools.task_sent(key("b"))
    assert least_in_progress(pools.pool("t", "m"), set(), held()) == key("a")
    assert LeastInProgress(RoutingConfig(), pools).choose(pools.pool("t", "m"), conversation(1), set(), held()) == key("a")


def test_round_robin_takes_each_engine_in_id_order_and_skips_held_back_and_avoided_ones():
    pools = pools_of(("c", False), ("a", False), ("b", False))
    policy = RoundRobin(RoutingConfig(), pools)
    pool = pools.pool("t", "m")
    assert [policy.choose(pool, None, set(), held()) for _ in range(4)] == [key("a"), key("b"), key("c"), key("a")]
    assert policy.choose(pool, None, set(), held("b")) == key("c")  # b's turn, but it is held back
    assert policy.choose(pool, None, {"a"}, held()) == key("b")
    assert policy.choose(pool, None, {"a", "b", "c"}, held()) == key("c")  # only avoided ones left: in turn
    assert policy.choose(pool, None, set(), held("a", "b", "c")) is None


def test_round_robin_keeps_its_turn_when_engines_join_and_starts_again_when_the_pool_is_gone():
    router = Router(RoutingConfig(policy=RoutingPolicy.ROUND_ROBIN))
    for engine_id in ("a", "b"):
        router.engine_updated(key(engine_id), frozenset({"m"}), engine_status(engine_id, "m"), False)
    assert router.choose("t", "m", None, set(), held()) == key("a")
    router.engine_updated(key("c"), frozenset({"m"}), engine_status("c", "m"), False)
    assert [router.choose("t", "m", None, set(), held()) for _ in range(3)] == [key("b"), key("c"), key("a")]
    for engine_id in ("a", "b", "c"):
        router.engine_removed(key(engine_id))
    assert router.choose("t", "m", None, set(), held()) is None
    for engine_id in ("b", "a"):
        router.engine_updated(key(engine_id), frozenset({"m"}), engine_status(engine_id, "m"), False)
    assert router.choose("t", "m", None, set(), held()) == key("a")


def test_affinity_routes_a_task_without_hints_the_least_in_progress_way():
    pools = pools_of(("a", False), ("b", True))
    policy = Affinity(RoutingConfig(), pools)
    assert policy.choose(pools.pool("t", "m"), None, set(), held()) == key("b")
    assert policy.state_size() == {"index_blocks": 0, "sessions": 0, "expected": 0, "ring_points": 0, "hot_keys": 0,
                                   "spread_keys": 0}


def test_affinity_sends_a_conversation_home_and_remembers_its_prefix_and_session():
    pools = pools_of(*[(f"e{i}", False) for i in range(4)])
    policy = Affinity(RoutingConfig(), pools)
    pool = pools.pool("t", "m")
    hints = conversation(3, turns=2)
    home = policy.choose(pool, hints, set(), held())
    assert policy.choose(pool, hints, set(), held()) == home  # nothing changed: the same home
    policy.task_sent(pools.task_sent(home), home, "m", hints, 0)
    assert policy.index.depths(hints.blocks) == {home: len(hints.blocks)}
    size = policy.state_size()
    assert size["index_blocks"] == len(hints.blocks) and size["ring_points"] == 4 * RoutingConfig().ring_points
    assert policy.choose(pool, hints, set(), held(home.engine_id)) != home  # held back: never chosen
    policy.engine_removed(home)
    assert policy.index.depths(hints.blocks) == {}


def test_affinity_rebuilds_a_ring_when_its_pool_changes():
    pools = pools_of(("a", False), ("b", False))
    policy = Affinity(RoutingConfig(), pools)
    policy.choose(pools.pool("t", "m"), conversation(1), set(), held())
    assert policy.state_size()["ring_points"] == 2 * RoutingConfig().ring_points
    for pool in pools.engine_updated(key("c"), frozenset({"m"}), engine_status("c", "m"), False):
        policy.pool_changed(pool)
    assert policy.state_size()["ring_points"] == 0
    policy.choose(pools.pool("t", "m"), conversation(1), set(), held())
    assert policy.state_size()["ring_points"] == 3 * RoutingConfig().ring_points


def test_affinity_refuses_an_engine_at_its_load_bound_even_when_nobody_holds_it_back():
    config = RoutingConfig(min_capacity=1)
    pools = pools_of(("a", False), ("b", False))
    policy = Affinity(config, pools)
    hints = conversation(9)
    home = policy.choose(pools.pool("t", "m"), hints, set(), held())
    loaded = engine_status(home.engine_id, "m")
    loaded.models[0].in_progress_task_count = 10
    pools.engine_updated(home, frozenset({"m"}), loaded, False)
    assert policy.capacity(pools.pool("t", "m").total, 2) <= 10
    assert policy.choose(pools.pool("t", "m"), hints, set(), held()) not in (home, None)


def test_a_policy_of_ones_own_plugs_into_the_same_interface():
    class Last(Policy):
        """The highest engine id not held back."""

        def choose(self, pool, hints, avoid, held_back):
            keys = sorted((k for k in pool.members if not held_back(k)), key=lambda k: k.engine_id)
            return keys[-1] if keys else None

    pools = pools_of(("a", True), ("b", True))
    policy = Last(RoutingConfig(), pools)
    assert policy.choose(pools.pool("t", "m"), None, set(), held()) == key("b")
    assert policy.task_sent(pools.member(key("b")), key("b"), "m", None, 7) == 0  # a local engine keeps the tip
    assert pools.spills.depths((7,)) == {key("b"): 1}
    assert policy.task_sent(None, key("x"), "m", None, 7) == 7  # an engine routing does not know: carried on


def test_pools_count_loads_and_say_which_pools_changed():
    pools = Pools(spilled_tips=0)
    changed = pools.engine_updated(key("a"), frozenset({"m", "n"}), engine_status("a", "m", "n"), True)
    assert sorted(p.model for p in changed) == ["m", "n"]
    assert pools.engine_updated(key("a"), frozenset({"m", "n"}), engine_status("a", "m", "n"), True) == []
    pools.task_sent(key("a"))
    pools.task_sent(key("a"))
    assert pools.load(key("a")) == 2 and pools.pool("t", "m").total == 2
    reported = engine_status("a", "m", "n")
    reported.models[0].in_progress_task_count = 5
    pools.engine_updated(key("a"), frozenset({"m", "n"}), reported, True)
    assert pools.load(key("a")) == 5  # the report replaces what was sent before it
    pools.task_left(key("a"))
    assert pools.load(key("a")) == 4 and pools.member(key("a")).in_flight == 1
    (gone,) = pools.engine_updated(key("a"), frozenset({"m"}), reported, True)
    assert gone.model == "n" and not gone.members and pools.pool("t", "n") is None
    assert [p.model for p in pools.engine_removed(key("a"))] == ["m"] and len(pools) == 0
    assert pools.load(key("a")) == 0


def test_pools_index_loaded_adapters():
    pools = Pools(spilled_tips=0)
    status = engine_status("a", "m")
    status.models[0].runtime_load.loaded_adapters.extend(["x", "y"])
    pools.engine_updated(key("a"), frozenset({"m"}), status, True)
    assert list(pools.holding_adapter("x")) == [key("a")]
    pools.engine_updated(key("a"), frozenset({"m"}), engine_status("a", "m"), True)
    assert list(pools.holding_adapter("x")) == []


@settings(max_examples=40, deadline=None)
@given(st.sampled_from(list(RoutingPolicy)),
       st.lists(st.tuples(st.sampled_from(["submit", "answer", "remove", "join"]), st.integers(0, 3)), max_size=60))
def test_routing_counts_exactly_the_processors_tasks_on_each_engine(policy, steps):
    """What least_in_progress ranks by (a pool member's ``in_flight``) is the processor's own
    count of its tasks on that engine, whatever happens to tasks and engines."""
    processor = Processor(ProcessorConfig(routing=RoutingConfig(policy=policy), retry_delay=0))
    sent: list[SendTask] = []
    seq = 0
    for op, n in steps:
        engine_id = f"e{n}"
        if op == "join":
            processor.update_engine(("route", engine_id), "t", engine_status(engine_id, "m"),
                                    Locality.LOCAL if n % 2 else Locality.REMOTE, 0.0)
        elif op == "remove" and processor.engine("t", engine_id) is not None:
            sent += only(processor.remove_engine("t", engine_id, "gone", 0.0), SendTask)
        elif op == "submit":
            seq += 1
            sent += only(processor.submit(task_id=f"x{seq}", tenant_id="t", request=chat(), origin="o",
                                          hints=conversation(n), now=0.0), SendTask)
        elif op == "answer" and sent:
            send = sent.pop(n % len(sent))
            sent += only(processor.receive_result(send.route, http(send.task.id), 0.0), SendTask)
        for engine_id in processor.status()["tenants"].get("t", {}).get("engines", {}):
            member = processor._router.pools.member(key(engine_id))
            assert member is not None and member.in_flight == processor.engine("t", engine_id).in_flight
