"""One runtime, one member: engines of several gateways (or workers) that front the same runtime
served by URL (``EngineStatus.infx_runtime_name``) are routed to as one. Each gateway places the
runtime at the same point of its ring, whatever its engine is called there, and sends to its own
engine for it; a gateway that serves none of them sends to one peer's. Pure: no processor, no clock.
"""

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
from tests.support.routing import conversation_hints

RUNTIMES = ("10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000")
GATEWAYS = ("gw-a", "gw-b", "gw-c")
ALL = frozenset({"m"})


def front(runtime: str, gateway: str, load: int = 0, name: bool = True):
    """The status of ``gateway``'s engine for ``runtime``, as runtimes by URL report it."""
    status = engine_status(f"runtime-{runtime}-{gateway}", "m")
    if name:
        status.infx_runtime_name = runtime
    status.models[0].in_progress_task_count = load
    return status


def key_of(runtime: str, gateway: str, here: str) -> EngineKey:
    """How gateway ``here`` keys ``gateway``'s engine for ``runtime`` (a peer's, named with its pod)."""
    engine = f"runtime-{runtime}-{gateway}"
    return EngineKey("t", engine if gateway == here else f"{gateway}/{engine}")


def gateway_pools(here: str, serving: tuple[str, ...] = GATEWAYS, name: bool = True) -> Pools:
    """The pools of gateway ``here``, which knows the engines of every gateway in ``serving``."""
    pools = Pools(spilled_tips=8)
    for gateway in serving:
        for runtime in RUNTIMES:
            pools.engine_updated(key_of(runtime, gateway, here), ALL, front(runtime, gateway, name=name),
                                 gateway == here)
    return pools


def prompt(n: int) -> RoutingHints:
    text = f"You are assistant number {n}. " + "Answer briefly and cite your sources. " * 20
    hints = hints_from_json("chat/completions", json.dumps(
        {"model": "m", "messages": [{"role": "system", "content": text}, {"role": "user", "content": "hi"}]}), {})
    assert hints is not None
    return hints


def runtime_of(key: EngineKey) -> str:
    return key.engine_id.split("/")[-1].removeprefix("runtime-").rsplit("-gw-", 1)[0]


def test_a_pool_holds_one_engine_per_runtime_its_own():
    pools = gateway_pools("gw-a")
    pool = pools.pool("t", "m")
    assert pool is not None
    assert sorted(pool.members) == sorted(key_of(r, "gw-a", "gw-a") for r in RUNTIMES)
    # The engines that sit out are still known (their loads are kept), and lead to the one routed to.
    remote = key_of(RUNTIMES[0], "gw-b", "gw-a")
    assert pools.member(remote) is not None
    assert pools.serving(remote) == key_of(RUNTIMES[0], "gw-a", "gw-a")


def test_a_runtime_counts_once_in_its_pools_total_with_every_gateways_tasks_there():
    """Its load here is this gateway's tasks in flight there plus those each peer's engine of it
    reports, not the runtime's reading, which this gateway takes apart from the others' sends."""
    pools = Pools(spilled_tips=8)
    own = key_of(RUNTIMES[0], "gw-a", "gw-a")
    status = front(RUNTIMES[0], "gw-a")
    status.models[0].runtime_load.running_requests = 7  # a reading taken a while ago
    pools.engine_updated(own, ALL, status, True)
    assert pools.load(own) == 7
    for gateway, tasks in (("gw-b", 2), ("gw-c", 1)):
        pools.engine_updated(key_of(RUNTIMES[0], gateway, "gw-a"), ALL, front(RUNTIMES[0], gateway, load=tasks), False)
    pool = pools.pool("t", "m")
    assert pool is not None and list(pool.members) == [own]
    assert pools.load(own) == pool.total == 3
    pools.task_sent(own)
    assert pools.load(own) == pool.total == 4
    pools.engine_updated(key_of(RUNTIMES[0], "gw-b", "gw-a"), ALL, front(RUNTIMES[0], "gw-b", load=0), False)
    assert pools.load(own) == pool.total == 2
    pools.engine_removed(key_of(RUNTIMES[0], "gw-c", "gw-a"))
    pools.engine_removed(key_of(RUNTIMES[0], "gw-b", "gw-a"))
    assert pools.load(own) == pool.total == 7 + 1, "alone, it is counted by its runtime's reading again"


def test_an_engine_that_stops_naming_its_runtime_is_counted_by_its_own_load_again():
    pools = Pools(spilled_tips=8)
    own = key_of(RUNTIMES[0], "gw-a", "gw-a")
    pools.engine_updated(own, ALL, front(RUNTIMES[0], "gw-a", load=1), True)
    pools.engine_updated(key_of(RUNTIMES[0], "gw-b", "gw-a"), ALL, front(RUNTIMES[0], "gw-b", load=5), False)
    assert pools.load(own) == 5
    pools.engine_updated(own, ALL, front(RUNTIMES[0], "gw-a", load=1, name=False), True)
    pool = pools.pool("t", "m")
    assert pool is not None and len(pool.members) == 2
    assert pools.load(own) == 1 and pool.total == 1 + 5


def test_its_own_engine_leaving_hands_the_runtime_to_a_peers_and_back():
    pools = gateway_pools("gw-a")
    own = key_of(RUNTIMES[0], "gw-a", "gw-a")
    pools.engine_removed(own)
    pool = pools.pool("t", "m")
    assert pool is not None
    # The least engine id of the peers' engines for it: every gateway without its own picks the same.
    assert key_of(RUNTIMES[0], "gw-b", "gw-a") in pool.members
    assert key_of(RUNTIMES[0], "gw-c", "gw-a") not in pool.members
    assert len(pool.members) == 3
    pools.engine_updated(own, ALL, front(RUNTIMES[0], "gw-a"), True)
    assert own in pool.members and key_of(RUNTIMES[0], "gw-b", "gw-a") not in pool.members


def test_an_engine_that_takes_no_tasks_gives_way_to_one_that_does():
    pools = gateway_pools("gw-a")
    own, peer = key_of(RUNTIMES[0], "gw-a", "gw-a"), key_of(RUNTIMES[0], "gw-b", "gw-a")
    pools.engine_updated(own, frozenset(), front(RUNTIMES[0], "gw-a"), True)  # its health check fails here
    pool = pools.pool("t", "m")
    assert pool is not None and peer in pool.members and own not in pool.members
    pools.engine_updated(own, ALL, front(RUNTIMES[0], "gw-a"), True)
    assert own in pool.members and peer not in pool.members


def test_every_gateway_homes_a_prompt_on_the_same_runtime_through_its_own_engine():
    policies = {here: Affinity(RoutingConfig(), gateway_pools(here)) for here in GATEWAYS}
    # A gateway that serves no runtime itself sees only its peers' engines.
    policies["gw-d"] = Affinity(RoutingConfig(), gateway_pools("gw-d"))
    homes = set()
    for n in range(40):
        chosen = {}
        for here, policy in policies.items():
            pool = policy.pools.pool("t", "m")
            key = policy.choose(pool, prompt(n), set(), lambda k: False)
            assert key is not None
            if here != "gw-d":
                assert key == key_of(runtime_of(key), here, here), "routed through a peer's engine"
            chosen[here] = runtime_of(key)
        assert len(set(chosen.values())) == 1, f"prompt {n} has different homes: {chosen}"
        homes.add(chosen["gw-a"])
    assert homes == set(RUNTIMES)


def test_engines_that_name_no_runtime_are_each_their_own():
    pools = gateway_pools("gw-a", name=False)
    pool = pools.pool("t", "m")
    assert pool is not None and len(pool.members) == len(RUNTIMES) * len(GATEWAYS)


def test_a_tip_a_peer_reports_on_its_engine_for_a_runtime_leads_to_this_gateways_own_for_it():
    """A turn that spilled at gateway B is recorded on B's engine for the runtime it went to;
    gateway A sends the conversation's next turn to that runtime through A's own engine."""
    pools = gateway_pools("gw-a")
    policy = Affinity(RoutingConfig(), pools)
    pool = pools.pool("t", "m")
    assert pool is not None
    hints = next(h for h in map(prompt, range(40))
                 if runtime_of(policy.choose(pool, h, set(), lambda k: False)) != RUNTIMES[1])
    status = front(RUNTIMES[1], "gw-b")
    status.models[0].infx_prefix_tips.append(hints.blocks[-1])
    pools.engine_updated(key_of(RUNTIMES[1], "gw-b", "gw-a"), ALL, status, False)
    assert policy.choose(pool, hints, set(), lambda k: False) == key_of(RUNTIMES[1], "gw-a", "gw-a")


class Fronts:
    """Three gateways that each serve the three runtimes by URL, and relay their engines' statuses
    (with spilled tips, and each engine's tasks) to each other at once."""

    def __init__(self) -> None:
        self.pools = [Pools(spilled_tips=8) for _ in GATEWAYS]
        self.policies = [Affinity(RoutingConfig(), pools) for pools in self.pools]
        #: Each gateway's tasks at each runtime.
        self.tasks: dict[tuple[str, str], int] = {(g, r): 0 for g in GATEWAYS for r in RUNTIMES}
        self.relay()

    def running(self, runtime: str) -> int:
        return sum(self.tasks[(g, runtime)] for g in GATEWAYS)

    def relay(self) -> None:
        for owner, gateway in enumerate(GATEWAYS):
            for runtime in RUNTIMES:
                for g, here in enumerate(GATEWAYS):
                    status = front(runtime, gateway, load=self.tasks[(gateway, runtime)])
                    status.infx_runtime_slots = 2
                    if g != owner:
                        self.pools[owner].spills.annotate(key_of(runtime, gateway, gateway), status)
                    self.pools[g].engine_updated(key_of(runtime, gateway, here), ALL, status, g == owner)

    def send(self, g: int, hints: RoutingHints) -> EngineKey:
        pools, policy = self.pools[g], self.policies[g]
        chosen = policy.choose(pools.pool("t", "m"), hints, set(), lambda k: False)
        assert chosen is not None and pools.member(chosen).local
        policy.task_sent(pools.task_sent(chosen), chosen, "m", hints, 0)
        self.tasks[(GATEWAYS[g], runtime_of(chosen))] += 1
        self.relay()
        return chosen

    def finish(self, g: int, engine: EngineKey, hints: RoutingHints) -> None:
        self.pools[g].task_left(engine)
        self.policies[g].task_left(engine, "m", hints)
        self.tasks[(GATEWAYS[g], runtime_of(engine))] -= 1
        self.relay()


def turn(n: int, turns: int) -> RoutingHints:
    """User ``n``'s request of turn ``turns``: short questions and answers after a shared system prompt."""
    return conversation_hints(n, turns, "You are a helpful assistant. " * 40, question_repeats=1)


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 2), st.integers(0, 2), st.integers(0, 5)), min_size=1, max_size=40))
def test_a_later_turn_goes_to_its_first_turns_runtime_from_any_gateway(steps):
    """As tests/protocol/routing/test_gateways_agree.py, with every gateway serving every runtime:
    the second turn goes to the first turn's runtime whenever that runtime has a free slot."""
    fronts = Fronts()
    in_flight: list[tuple[int, EngineKey, RoutingHints]] = []
    for n, (a, b, keep) in enumerate(steps):
        first = turn(n, 1)
        engine = fronts.send(a, first)
        fronts.finish(a, engine, first)
        later = turn(n, 2)
        free = fronts.running(runtime_of(engine)) < 2
        assert all(fronts.pools[g].load(key_of(r, GATEWAYS[g], GATEWAYS[g])) == fronts.running(r)
                   for g in range(3) for r in RUNTIMES), "a gateway counts every gateway's tasks at a runtime"
        chosen = fronts.send(b, later)
        if free:
            assert runtime_of(chosen) == runtime_of(engine)
        in_flight.append((b, chosen, later))
        while len(in_flight) > keep:
            fronts.finish(*in_flight.pop(0))


def ask(n: int, user: str) -> RoutingHints:
    """A first turn of system prompt ``n`` (a home key of its own), asking ``user``."""
    text = f"You are assistant number {n}. " + "Answer briefly and cite your sources. " * 20
    hints = hints_from_json("chat/completions", json.dumps(
        {"model": "m", "messages": [{"role": "system", "content": text}, {"role": "user", "content": user}]}), {})
    assert hints is not None
    return hints


def test_a_key_placed_apart_at_one_gateway_is_followed_there_from_the_others():
    """Two home keys whose ring homes collide: the gateway that sends the second while the first runs
    there places it apart, and tells its peers; their first turns of that key go where it went."""
    probe = Fronts()
    homes: dict[str, list[int]] = {}
    for n in range(40):
        home = probe.send(0, ask(n, "probe"))
        probe.finish(0, home, ask(n, "probe"))
        homes.setdefault(runtime_of(home), []).append(n)
    first, second = next(keys for keys in homes.values() if len(keys) >= 2)[:2]
    fronts = Fronts()
    held = fronts.send(0, ask(first, "a question"))
    apart = fronts.send(0, ask(second, "a question"))
    assert runtime_of(apart) != runtime_of(held), "placed apart from the key running on its home"
    followed = fronts.send(1, ask(second, "another question"))
    assert runtime_of(followed) == runtime_of(apart)
