"""The routing policy through the processor's API: the same choice on every gateway,
bounded loads, prefix/session/adapter affinity, runtime load, round-robin, bounded memory."""

import json
import math

from hypothesis import given, settings
from hypothesis import strategies as st

from protocol.pb import status_pb2
from protocol.processor.core import Processor, ProcessorConfig, SendTask
from protocol.processor.types import EngineKey, Locality
from protocol.routing.hints import RoutingHints, hints_from_json
from protocol.routing.config import RoutingConfig, RoutingPolicy
from protocol.routing.prefix_index import PrefixIndex
from tests.support.processor import chat, engine_status, http, one
from tests.support.routing import ENGINES, conversation

C = RoutingConfig().load_factor


def gateway(policy=RoutingPolicy.AFFINITY, local=(), **routing):
    processor = Processor(ProcessorConfig(routing=RoutingConfig(policy=policy, **routing)))
    for engine_id in ENGINES:
        locality = Locality.LOCAL if engine_id in local else Locality.REMOTE
        processor.update_engine(("route", engine_id), "t", engine_status(engine_id, "m"), locality, 0.0)
    return processor


class Driver:
    """Submits tasks and finishes them, remembering where each went."""

    def __init__(self, processor):
        self.processor = processor
        self.seq = 0

    def send(self, hints):
        self.seq += 1
        task_id = f"task-{self.seq}"
        sent = one(self.processor.submit(now=0.0, task_id=task_id, tenant_id="t", request=chat(), origin="o", hints=hints),
                   SendTask)
        return task_id, sent.engine.engine_id, sent.route

    def finish(self, task_id, route):
        self.processor.receive_result(route, http(task_id), 0.0)


def test_two_gateways_with_the_same_engines_send_a_conversation_to_the_same_engine():
    a, b = Driver(gateway(local=ENGINES[:4])), Driver(gateway(local=ENGINES[4:]))
    for n in range(40):
        assert a.send(conversation(n))[1] == b.send(conversation(n))[1]


def test_gateways_that_name_each_others_engines_with_the_pod_still_agree_on_every_home():
    """A peer's engine is named id@pod here (protocol.sender.peer_engine_id); the ring hashes
    the id it reports, so a's e0..e3 and b's e4..e7 have the same points at a and at b."""
    drivers = {}
    for name, mine in (("a", ENGINES[:4]), ("b", ENGINES[4:])):
        processor = Processor(ProcessorConfig(routing=RoutingConfig(policy=RoutingPolicy.AFFINITY)))
        for engine_id in ENGINES:
            status = engine_status(engine_id, "m")
            if engine_id in mine:
                processor.update_engine(("route", engine_id), "t", status, Locality.LOCAL, 0.0)
            else:
                holder = "b" if name == "a" else "a"
                processor.update_engine_as(("peer", holder), EngineKey("t", f"{engine_id}@{holder}"), status,
                                           Locality.REMOTE, 0.0)
        drivers[name] = processor

    def reported(processor, n):
        sent = one(processor.submit(now=0.0, task_id=f"task-{n}", tenant_id="t", request=chat(), origin="o",
                                    hints=conversation(n)), SendTask)
        return sent.task.engine_id

    homes = [reported(drivers["a"], n) for n in range(40)]
    assert homes == [reported(drivers["b"], n) for n in range(40)]
    assert len(set(homes)) >= 6


def test_the_same_choice_holds_when_loads_differ_a_little():
    a, b = Driver(gateway()), Driver(gateway())
    # Gateway a has a dozen more tasks running than b, spread over the engines.
    for n in range(100, 112):
        a.send(conversation(n))
    agree = 0
    for n in range(60):
        (task_a, engine_a, route_a), (task_b, engine_b, route_b) = a.send(conversation(n)), b.send(conversation(n))
        agree += engine_a == engine_b
        a.finish(task_a, route_a)
        b.finish(task_b, route_b)
    assert agree >= 55


def test_a_conversation_goes_home_on_every_turn_and_spreads_with_others():
    d = Driver(gateway())
    homes = []
    for n in range(32):
        task_id, first, route = d.send(conversation(n, turns=1))
        d.finish(task_id, route)
        task_id, second, route = d.send(conversation(n, turns=3))
        d.finish(task_id, route)
        assert first == second
        homes.append(first)
    assert len(set(homes)) >= 6  # conversations are spread over the engines


def test_no_engine_is_loaded_above_the_bound_however_many_share_a_home():
    d = Driver(gateway())
    shared = conversation(7)
    load = dict.fromkeys(ENGINES, 0)
    for _ in range(200):
        _, engine_id, _ = d.send(shared)
        total = sum(load.values())
        assert load[engine_id] < max(math.ceil(C * (total + 1) / len(ENGINES)), 4)
        load[engine_id] += 1
    assert max(load.values()) <= C * (sum(load.values()) / len(ENGINES)) + 1
    assert len({e for e, n in load.items() if n}) >= math.ceil(len(ENGINES) / C)  # the spill spreads it


def test_a_spilled_conversation_comes_back_to_the_engine_that_holds_its_prefix():
    d = Driver(gateway())
    busy = [d.send(RoutingHints(blocks=(1, 2, 3), home=42)) for _ in range(12)]
    home = busy[0][1]
    # The conversation's first turn shares the home key but finds its home full: it spills.
    task_id, spilled, route = d.send(RoutingHints(blocks=(10, 11, 12, 13), home=42))
    assert spilled != home
    for done in busy + [(task_id, spilled, route)]:
        d.finish(done[0], done[2])
    # With the home free again, the next turn still goes where its prefix is cached.
    assert d.send(RoutingHints(blocks=(10, 11, 12, 13, 14, 15), home=42))[1] == spilled
    # A request nothing is known of goes home.
    assert d.send(RoutingHints(blocks=(20, 21), home=42))[1] == home


def test_runtime_waiting_requests_steer_away_from_a_busy_engine():
    processor = gateway()
    d = Driver(processor)
    hints = conversation(11)
    home = d.send(hints)[1]
    status = engine_status(home, "m")
    status.models[0].runtime_load.CopyFrom(status_pb2.EngineStatus.RuntimeLoad(running_requests=30, waiting_requests=20))
    processor.update_engine(("route", home), "t", status, Locality.REMOTE, 0.0)
    assert d.send(hints)[1] != home


def test_in_progress_counts_are_the_fallback_load():
    processor = gateway()
    d = Driver(processor)
    hints = conversation(12)
    home = d.send(hints)[1]
    status = engine_status(home, "m")
    status.models[0].in_progress_task_count = 50
    processor.update_engine(("route", home), "t", status, Locality.REMOTE, 0.0)
    assert d.send(hints)[1] != home


def test_sessions_stick_to_their_engine_and_adapters_prefer_engines_that_hold_them():
    processor = gateway()
    d = Driver(processor)
    chat_body = {"model": "m", "messages": [{"role": "user", "content": "hello"}], "user": "alice"}
    alice = hints_from_json("chat/completions", json.dumps(chat_body), {})
    first = d.send(alice)[1]
    assert all(d.send(alice)[1] == first for _ in range(3))
    holder = next(e for e in ENGINES if e != first)
    status = engine_status(holder, "m")
    status.models[0].runtime_load.CopyFrom(status_pb2.EngineStatus.RuntimeLoad(loaded_adapters=["m"]))
    fresh = Processor(ProcessorConfig(routing=RoutingConfig(home_weight=0.2)))
    for engine_id in ENGINES:
        fresh.update_engine(("route", engine_id), "t", status if engine_id == holder else engine_status(engine_id, "m"), Locality.REMOTE, 0.0)
    assert Driver(fresh).send(conversation(99))[1] == holder


def test_round_robin_takes_engines_in_turn():
    d = Driver(gateway(RoutingPolicy.ROUND_ROBIN))
    assert [d.send(conversation(1))[1] for _ in range(10)] == ENGINES + ENGINES[:2]


def test_least_in_progress_keeps_local_engines_first():
    d = Driver(gateway(RoutingPolicy.LEAST_IN_PROGRESS, local=["e5"]))
    assert d.send(conversation(1))[1] == "e5"


def test_an_engine_that_failed_the_task_is_avoided_on_retry():
    processor = Processor(ProcessorConfig(retry_delay=0, routing=RoutingConfig()))
    for engine_id in ENGINES:
        processor.update_engine(("route", engine_id), "t", engine_status(engine_id, "m"), Locality.REMOTE, 0.0)
    sent = one(processor.submit(now=0.0, task_id="x", tenant_id="t", request=chat(), origin="o", hints=conversation(5)), SendTask)
    retried = one(processor.receive_result(sent.route, http("x", code=503), 0.0), SendTask)
    assert retried.engine != sent.engine


def test_a_removed_engine_leaves_routing_and_the_index():
    processor = gateway()
    d = Driver(processor)
    hints = conversation(21)
    home = d.send(hints)[1]
    processor.remove_engine("t", home, "gone", 0.0)
    assert d.send(hints)[1] != home
    assert all(key.engine_id != home for key in processor._router.policy.index.depths(hints.blocks))


def test_the_prefix_index_is_bounded_per_engine_and_in_total():
    index = PrefixIndex(per_engine=10, total=25)
    for i in range(5):
        index.record(EngineKey("t", f"e{i}"), tuple(range(i * 100, i * 100 + 40)))
        assert index.size <= 25
    assert index.size == 25  # five engines of five entries each
    index.record(EngineKey("t", "e0"), (1, 2, 3))
    assert index.depths((1, 2, 3)) == {EngineKey("t", "e0"): 3}
    assert index.size <= 25


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5), st.booleans()), min_size=1, max_size=120))
def test_every_choice_respects_the_load_bound(steps):
    processor = gateway()
    d = Driver(processor)
    running = []
    for conv, finish in steps:
        if finish and running:
            d.finish(*running.pop(0))
            continue
        loads = {e: processor.engine("t", e).in_flight for e in ENGINES}
        task_id, engine_id, route = d.send(conversation(conv))
        capacity = max(math.ceil(C * (sum(loads.values()) + 1) / len(ENGINES)), 4)
        assert loads[engine_id] < capacity
        running.append((task_id, route))


def test_a_block_sent_to_several_engines_is_held_by_each_until_it_forgets():
    index = PrefixIndex(per_engine=100, total=1000)
    a, b, c = EngineKey("t", "a"), EngineKey("t", "b"), EngineKey("t", "c")
    index.record(a, (1, 2, 3))
    index.record(b, (1, 2))
    index.record(c, (1,))
    assert index.depths((1, 2, 3, 4)) == {a: 3, b: 2, c: 1}
    index.forget(b)
    index.forget(c)
    assert index.depths((1, 2, 3)) == {a: 3}
    index.forget(a)
    assert index.depths((1,)) == {} and index.size == 0


def test_the_in_flight_cap_holds_under_affinity_and_a_freed_slot_takes_a_waiting_task():
    processor = Processor(ProcessorConfig(max_in_flight_per_engine=2, routing=RoutingConfig()))
    for engine_id in ("a", "b"):
        processor.update_engine(("route", engine_id), "t", engine_status(engine_id, "m"), Locality.REMOTE, 0.0)
    shared = conversation(1)
    sent = []
    for n in range(5):
        effects = processor.submit(now=0.0, task_id=f"x{n}", tenant_id="t", request=chat(), origin="o", hints=shared)
        sent += [e for e in effects if isinstance(e, SendTask)]
    assert sorted(e.engine.engine_id for e in sent) == ["a", "a", "b", "b"]
    assert processor.waiting_task_ids("t", "m") == ["x4"]
    freed = one(processor.receive_result(sent[0].route, http(sent[0].task.id), 0.0), SendTask)
    assert freed.task.id == "x4" and freed.engine == sent[0].engine
