"""Fairness by slots held, the reserve, and peers' tasks held at their engine's gateway, with a
hand-stepped clock (issue #17, bursty tenant)."""

from __future__ import annotations

import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from protocol.pb import status_pb2, worker_pb2
from protocol.processor.core import Processor, TaskState
from protocol.processor.fair_queue import Criticality
from protocol.processor.fair_share import CallerRefused, caller_message, forwarded_caller
from protocol.processor.types import FailRequest, Locality, ProcessorConfig, ProcessorUsageError, SendTask
from tests.support.processor import chat, engine_status, http, only

T0 = 1000.0
CRITICAL, STANDARD, SHEDDABLE = Criticality.CRITICAL, Criticality.STANDARD, Criticality.SHEDDABLE


def make(engines: tuple[str, ...] = ("e1",), **config: object) -> Processor:
    p = Processor(ProcessorConfig(**config))  # type: ignore[arg-type]
    for engine_id in engines:
        p.update_engine(f"route-{engine_id}", "t", engine_status(engine_id, "m"), Locality.LOCAL, T0)
    return p


def submit(p: Processor, task_id: str, flow: str = "", now: float = T0, **kw: object) -> list[object]:
    return list(p.submit(task_id=task_id, tenant_id="t", request=chat("m"), origin="client", flow=flow, **kw, now=now))


def sent(effects: list[object]) -> list[str]:
    return [e.task.id for e in only(effects, SendTask)]


def finish(p: Processor, task_id: str, engine_id: str = "e1", now: float = T0) -> list[str]:
    return sent(p.receive_result(f"route-{engine_id}", http(task_id), now))


# --- the reserve ----------------------------------------------------------------


def test_a_lone_caller_may_use_every_slot():
    p = make(max_in_flight_per_engine=4, fair_reserve=2)
    assert [sent(submit(p, f"a{i}", "A")) for i in range(5)] == [["a0"], ["a1"], ["a2"], ["a3"], []]


def test_a_burst_leaves_the_reserved_slots_to_another_caller():
    p = make(max_in_flight_per_engine=4, fair_reserve=2, queue_timeout=100)
    assert sent(submit(p, "s0", "steady")) == ["s0"]
    burst = [sent(submit(p, f"b{i}", "burst")) for i in range(4)]
    # b0 (holding none) and b1 (as many as steady) take slots; then burst holds more than steady,
    # and the last two slots are steady's to take.
    assert burst == [["b0"], ["b1"], [], []]
    assert p.slots_held("t", "m") == {"steady": 1, "burst": 2}
    assert sent(submit(p, "s1", "steady")) == ["s1"]
    assert sent(submit(p, "s2", "steady")) == []  # the cap itself holds for everyone
    # A freed slot goes to the flow holding fewer slots: s2, though b2 waited longer...
    assert finish(p, "s0") == ["s2"]
    # ...and once burst holds fewer than steady, to burst.
    assert finish(p, "b0") == ["b2"]


def test_a_critical_task_may_take_the_reserve():
    p = make(max_in_flight_per_engine=4, fair_reserve=2)
    sent(submit(p, "s0", "steady"))
    assert [sent(submit(p, f"b{i}", "burst")) for i in range(3)] == [["b0"], ["b1"], []]
    assert sent(submit(p, "c", "burst", criticality=CRITICAL)) == ["c"]


def test_the_reserve_never_takes_the_whole_cap():
    """A reserve at or above the cap leaves one slot of each engine to every caller: an idle
    engine takes anyone's task."""
    p = make(max_in_flight_per_engine=2, fair_reserve=5)
    sent(submit(p, "s0", "steady", weight=2.0))
    assert sent(submit(p, "b0", "burst")) == ["b0"]  # it held none: the least served
    p.update_engine("route-e2", "t", engine_status("e2", "m"), Locality.LOCAL, T0)
    assert sent(submit(p, "b1", "burst")) == ["b1"]  # on e2, idle, though burst is not the least served
    assert sent(submit(p, "b2", "burst")) == []


def test_no_reserve_without_a_cap():
    p = make(fair_reserve=2)
    sent(submit(p, "s0", "steady"))
    assert all(sent(submit(p, f"b{i}", "burst")) == [f"b{i}"] for i in range(50))


def test_reserve_is_validated():
    with pytest.raises(ProcessorUsageError, match="fair_reserve"):
        ProcessorConfig(fair_reserve=-1)


# --- the cap counts every gateway's tasks ---------------------------------------


def remote(p: Processor, engine_id: str, running: int, waiting: int = 0, now: float = T0) -> list[object]:
    status = engine_status(engine_id, "m")
    status.models[0].runtime_load.CopyFrom(
        status_pb2.EngineStatus.RuntimeLoad(running_requests=running, waiting_requests=waiting))
    return list(p.update_engine(("peer", "B"), "t", status, Locality.REMOTE, now))


def test_the_cap_counts_what_a_peers_engine_reports_it_holds():
    p = make(engines=(), max_in_flight_per_engine=4, fair_reserve=0)
    remote(p, "r1", running=3)
    assert sent(submit(p, "a")) == ["a"]
    assert sent(submit(p, "b")) == []  # 3 reported + 1 sent since: full
    assert remote(p, "r1", running=4) == []  # the next report counts ours too: still full
    assert sent(remote(p, "r1", running=2)) == ["b"]  # two left it


# --- a peer's task waits at its engine's gateway --------------------------------


def forwarded(p: Processor, task_id: str, flow: str = "", now: float = T0, engine_id: str = "e1",
              criticality: Criticality = STANDARD) -> list[object]:
    return list(p.submit(task_id=task_id, tenant_id="t", request=chat("m"), origin=("peer", "A"), flow=flow,
                         criticality=criticality, target_engine_id=engine_id, now=now))


def test_a_peers_task_for_a_full_engine_waits_for_a_slot_on_that_engine():
    p = make(engines=("e1", "e2"), max_in_flight_per_engine=1, queue_timeout=30)
    sent(submit(p, "a"))  # e1
    sent(submit(p, "b"))  # e2
    assert forwarded(p, "fwd") == [] and p.task_state("fwd") is TaskState.WAITING
    assert p.status()["tenants"]["t"]["engines"]["e1"]["waiting"] == ["fwd"]
    assert p.waiting_counts() == {("t", "m"): 1}
    assert finish(p, "b", "e2") == []  # a slot on another engine is not its engine's
    effects = p.receive_result("route-e1", http("a"), T0 + 1)
    assert [(e.task.id, e.engine.engine_id) for e in only(effects, SendTask)] == [("fwd", "e1")]


def test_a_peers_waiting_tasks_take_turns_by_slots_held_with_local_ones():
    p = make(max_in_flight_per_engine=2, fair_reserve=0, queue_timeout=30)
    sent(submit(p, "b0", "burst"))
    sent(forwarded(p, "b1", "burst"))
    forwarded(p, "b2", "burst")
    forwarded(p, "s0", "steady")
    assert p.slots_held("t", "m") == {"burst": 2}
    assert finish(p, "b0") == ["s0"]


@pytest.mark.parametrize("peer", ["burst", "steady"])
def test_a_freed_slot_goes_to_the_caller_holding_fewer_whether_its_task_is_local_or_a_peers(peer):
    """A peer's task waiting for its engine and a local one waiting for the model take the
    engine's freed slot in their callers' turn, not the peer's first."""
    p = make(max_in_flight_per_engine=2, fair_reserve=0, queue_timeout=30)
    sent(submit(p, "b0", "burst"))
    sent(forwarded(p, "b1", "burst"))
    wait = {"burst": forwarded if peer == "burst" else submit, "steady": forwarded if peer == "steady" else submit}
    assert wait["burst"](p, "b2", "burst") == [] and wait["steady"](p, "s0", "steady") == []
    assert finish(p, "b0") == ["s0"]
    assert finish(p, "b1") == ["b2"]


def test_a_sheddable_peers_task_for_a_full_engine_is_refused_so_the_peer_tries_elsewhere():
    p = make(max_in_flight_per_engine=1, busy_retry_after=4)
    sent(submit(p, "a"))
    [refusal] = only(forwarded(p, "fwd", criticality=SHEDDABLE), FailRequest)
    assert (refusal.status, refusal.retry_after) == (503, 4) and "limit of 1" in refusal.message
    assert not p.has_task("fwd")


def test_a_peers_task_that_waits_too_long_gets_503_naming_its_engine():
    p = make(max_in_flight_per_engine=1, queue_timeout=5, busy_retry_after=2)
    sent(submit(p, "a"))
    forwarded(p, "fwd")
    [failed] = only(p.handle_timeout(T0 + 5), FailRequest)
    assert (failed.task_id, failed.status, failed.retry_after) == ("fwd", 503, 2)
    assert "engine 'e1' stayed at its limit of 1 tasks" in failed.message


@pytest.mark.parametrize("leave", ["removed", "not ready", "go away"])
def test_peers_tasks_waiting_for_an_engine_that_leaves_fail_at_once(leave):
    p = make(max_in_flight_per_engine=1, busy_retry_after=3)
    sent(submit(p, "a"))
    forwarded(p, "fwd")
    if leave == "removed":
        effects = p.remove_engine("t", "e1", "stream closed", T0)
    elif leave == "not ready":
        effects = p.update_engine("route-e1", "t", engine_status("e1", "m", ready=False), Locality.LOCAL, T0)
    else:
        effects = p.go_away(T0)
    [failed] = [f for f in only(effects, FailRequest) if f.task_id == "fwd"]
    assert failed.status == 503 and "while the task waited for a slot on it" in failed.message
    assert p.waiting_counts() == {} and not p.has_task("fwd")


# --- a reserve that opens is taken at once ---------------------------------------


def test_a_peers_task_takes_its_engines_reserve_once_its_caller_becomes_the_least_served():
    """A slot freed on another engine can make a caller the least served: its peer's task
    waiting on an engine with a reserved slot free takes it then, not when that engine frees one."""
    p = make(engines=("e1", "e2", "e3"), max_in_flight_per_engine=2, fair_reserve=1, queue_timeout=30)
    assert sent(forwarded(p, "a0", "A", engine_id="e1") + forwarded(p, "a1", "A", engine_id="e3")) == ["a0", "a1"]
    assert sent(forwarded(p, "b0", "B", engine_id="e2")) == ["b0"]
    assert forwarded(p, "a2", "A", engine_id="e1") == []  # A holds 2, B 1: e1's last slot is B's
    assert finish(p, "b0", "e2") == ["a2"]  # A alone now: e1's last slot is A's
    assert p.slots_held("t", "m") == {"A": 3}


@pytest.mark.parametrize("leave", ["cancel", "timeout"])
def test_a_task_takes_the_reserve_once_the_caller_it_was_kept_for_stops_waiting(leave):
    p = make(engines=("e1", "e2"), max_in_flight_per_engine=2, fair_reserve=1, queue_timeout=30)
    assert sent(forwarded(p, "b0", "B", engine_id="e2") + forwarded(p, "b1", "B", engine_id="e2")) == ["b0", "b1"]
    assert forwarded(p, "c0", "C", engine_id="e2", now=T0 - 10) == []  # waits for e2, holding none
    assert sent(submit(p, "a0", "A")) == ["a0"]  # on e1
    assert sent(submit(p, "a1", "A")) == []  # A holds 1, C none: e1's last slot is C's
    effects = p.cancel("c0", T0) if leave == "cancel" else p.handle_timeout(T0 + 20)
    assert sent(effects) == ["a1"]  # A holds fewer than B now, and nobody else waits


def test_a_dispatch_that_makes_another_caller_the_least_served_lets_it_take_the_reserve():
    p = make(engines=("e1", "e2", "e3", "e4"), max_in_flight_per_engine=2, fair_reserve=1, queue_timeout=30)

    def heavy(task_id: str, engine_id: str) -> list[str]:
        return sent(p.submit(task_id=task_id, tenant_id="t", request=chat("m"), origin=("peer", "A"), flow="B",
                             weight=2.0, target_engine_id=engine_id, now=T0))

    assert sent(forwarded(p, "a0", "A", engine_id="e1") + forwarded(p, "a1", "A", engine_id="e3")) == ["a0", "a1"]
    assert heavy("b0", "e2") + heavy("b1", "e2") + heavy("b2", "e3") == ["b0", "b1", "b2"]
    assert forwarded(p, "a2", "A", engine_id="e1") == []  # A holds 2 per weight, B 1.5: e1's last slot is B's
    # B's next task (on e4) brings B to 2 per weight, as many as A: e1's last slot is A's too now.
    assert heavy("b3", "e4") == ["b3", "a2"]


def test_a_reserved_slot_a_lower_band_task_may_take_goes_to_the_more_critical_head_of_the_queue():
    """Criticality comes before the reserve: a reserved slot that the sheddable task of the caller
    it is kept for may take goes to the standard head of the queue, though that one's caller may
    not take it, rather than to a less critical task or stay idle while both wait."""
    p = make(max_in_flight_per_engine=4, fair_reserve=2, queue_timeout=30, shed_waiting_threshold=5)
    assert sent(sum((submit(p, f"a{i}", "A") for i in range(4)), [])) == ["a0", "a1", "a2", "a3"]
    assert submit(p, "c0", "C", criticality=SHEDDABLE) == [] and submit(p, "a4", "A") == []
    assert finish(p, "a0") == ["a4"]  # A holds 3, C none: the freed slot is reserved, and a4 comes first
    assert finish(p, "a1") == ["c0"]  # a4 gone, c0 heads the queue, and C holds the fewest
    assert p.slots_held("t", "m") == {"A": 3, "C": 1}



# --- the caller on the wire ---------------------------------------------------


def test_the_caller_goes_with_a_task_to_a_peers_engine_and_never_to_an_engine():
    p = make(engines=(), max_in_flight_per_engine=4)
    remote(p, "r1", running=0)
    [to_peer] = only(submit(p, "a", "key-1", weight=2.0, criticality=SHEDDABLE), SendTask)
    assert forwarded_caller(to_peer.task.request) == ("key-1", 2.0, SHEDDABLE)
    # The peer runs it on its own engine: the field stops there.
    q = make()
    request = worker_pb2.TaskRequest()
    request.CopyFrom(to_peer.task.request)
    [to_engine] = only(q.submit(task_id="a", tenant_id="t", request=request, origin=("peer", "A"), flow="key-1",
                                target_engine_id="e1", now=T0), SendTask)
    assert not to_engine.task.request.HasField("infx_caller")


def test_the_default_caller_sends_nothing():
    assert caller_message("", 1.0, STANDARD) is None
    assert forwarded_caller(worker_pb2.TaskRequest()) == ("", 1.0, STANDARD)


@pytest.mark.parametrize("caller, problem", [
    (worker_pb2.Caller(weight=-1.0), "weight"),
    (worker_pb2.Caller(weight=math.inf), "weight"),
    (worker_pb2.Caller(weight=math.nan), "weight"),
    (worker_pb2.Caller(weight=1e-320), "from 0.001 to 1000"),  # 1/weight would overflow the virtual times
    (worker_pb2.Caller(criticality=7), "criticality"),  # type: ignore[arg-type]
    (worker_pb2.Caller(flow="k" * 257), "longer than 256"),
])
def test_a_malformed_forwarded_caller_is_refused(caller, problem):
    request = worker_pb2.TaskRequest(infx_caller=caller)
    with pytest.raises(CallerRefused, match=problem):
        forwarded_caller(request)


# --- invariants under random interleavings ---------------------------------------

ops = st.lists(
    st.one_of(
        st.tuples(st.just("submit"), st.sampled_from("ABC"), st.sampled_from(list(Criticality)), st.booleans()),
        st.tuples(st.just("finish"), st.integers(0, 20)),
        st.tuples(st.just("cancel"), st.integers(0, 30)),
        st.tuples(st.just("wait"), st.sampled_from([1.0, 20.0])),
        st.tuples(st.just("flap")),
    ),
    max_size=60,
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops, st.sampled_from([0, 1, 2]))
def test_slots_held_match_the_tasks_on_engines_and_the_cap_holds(script, reserve):
    p = make(engines=("e1", "e2"), max_in_flight_per_engine=3, fair_reserve=reserve, queue_timeout=30,
             max_waiting_tasks=8, retry_delay=0)
    now, n = T0, 0
    flows: dict[str, str] = {}
    on_engine: dict[str, str] = {}  # task -> engine
    ended: set[str] = set()

    def apply(effects: list[object]) -> None:
        for e in effects:
            if isinstance(e, SendTask) and not e.task.id.startswith("infx-ctl-"):
                on_engine[p.attempt_owner(e.task.id) or e.task.id] = e.engine.engine_id
            elif isinstance(e, FailRequest):
                assert e.task_id not in ended
                ended.add(e.task_id)
                on_engine.pop(e.task_id, None)

    for op in script:
        if op[0] == "submit":
            task_id = f"x{n}"
            n += 1
            flows[task_id] = op[1]
            if op[3]:
                apply(forwarded(p, task_id, op[1], now=now, engine_id="e1", criticality=op[2]))
            else:
                apply(submit(p, task_id, op[1], now=now, criticality=op[2]))
        elif op[0] == "finish" and on_engine:
            task_id = sorted(on_engine)[op[1] % len(on_engine)]
            engine_id = on_engine.pop(task_id)
            ended.add(task_id)
            apply(p.receive_result(f"route-{engine_id}", http(task_id), now))
        elif op[0] == "cancel":
            live = sorted(t for t in flows if t not in ended)
            if live:
                task_id = live[op[1] % len(live)]
                ended.add(task_id)
                on_engine.pop(task_id, None)
                apply(p.cancel(task_id, now))
        elif op[0] == "wait":
            now += op[1]
            apply(p.handle_timeout(now))
        elif op[0] == "flap":
            apply(p.update_engine("route-e2", "t", engine_status("e2", "m", ready=False), Locality.LOCAL, now))
            apply(p.update_engine("route-e2", "t", engine_status("e2", "m"), Locality.LOCAL, now))
        held: dict[str, int] = {}
        for task_id in on_engine:
            held[flows[task_id]] = held.get(flows[task_id], 0) + 1
        assert p.slots_held("t", "m") == held
        for engine_id in ("e1", "e2"):
            view = p.engine("t", engine_id)
            assert view is not None and view.in_flight <= 3
    assert p.status()["tasks"] == len(flows) - len(ended)
