"""The held-task order: criticality bands, then weighted fair turns across flows."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from protocol.processor.fair_queue import Criticality, FairQueueUsageError, HeldQueue, parse_criticality

CRITICAL, STANDARD, SHEDDABLE = Criticality.CRITICAL, Criticality.STANDARD, Criticality.SHEDDABLE


def drain(queue: HeldQueue, n: int | None = None) -> list[str]:
    served = []
    while (task := queue.peek()) is not None and (n is None or len(served) < n):
        queue.take(task)
        served.append(task)
    return served


def test_one_flow_is_served_in_arrival_order():
    q = HeldQueue()
    for i in range(5):
        q.add(f"t{i}", "a")
    assert drain(q) == ["t0", "t1", "t2", "t3", "t4"]
    assert len(q) == 0 and q.peek() is None


def test_a_burst_of_one_flow_does_not_hold_back_a_flow_that_arrives_after_it():
    q = HeldQueue()
    for i in range(1000):
        q.add(f"a{i}", "burst")
    served = drain(q, 3)
    q.add("b0", "calm")
    q.add("b1", "calm")
    assert drain(q, 4) == ["a3", "b0", "a4", "b1"]
    assert served == ["a0", "a1", "a2"]


def test_weights_split_the_turns():
    q = HeldQueue()
    for i in range(30):
        q.add(f"a{i}", "a", weight=2.0)
        q.add(f"b{i}", "b", weight=1.0)
    first = drain(q, 30)
    assert sum(t.startswith("a") for t in first) == 20


def test_critical_goes_first_and_sheddable_last_whatever_the_flows():
    q = HeldQueue()
    q.add("s", "x", criticality=SHEDDABLE)
    q.add("n", "x")
    q.add("c", "y", criticality=CRITICAL)
    assert drain(q) == ["c", "n", "s"]


def test_removing_unserved_tasks_charges_nothing():
    q = HeldQueue()
    for i in range(3):
        q.add(f"b{i}", "b")
    q.add("a0", "a")
    q.add("a1", "a")
    q.remove("a0")  # cancelled before its turn: a1 takes that turn (had it been charged, b1 would go first)
    assert drain(q, 3) == ["b0", "a1", "b1"]
    q.remove("b2")
    assert drain(q) == []


def test_a_flow_that_comes_back_cannot_claim_the_turns_it_missed():
    q = HeldQueue()
    for i in range(10):
        q.add(f"a{i}", "a")
    q.add("b0", "b")
    assert drain(q, 2) == ["a0", "b0"]
    drain(q, 5)  # b is away while a is served
    q.add("b1", "b")
    q.add("b2", "b")
    assert drain(q, 4) == ["a6", "b1", "a7", "b2"]  # alternating: no run of turns for b


def test_iteration_is_in_arrival_order_whatever_the_turns():
    q = HeldQueue()
    q.add("s1", "a", criticality=SHEDDABLE)
    q.add("s2", "b", criticality=SHEDDABLE)
    q.add("n", "a")
    assert list(q) == ["s1", "s2", "n"] and "n" in q and "x" not in q


def test_many_flows_take_turns_in_order_of_arrival_at_equal_weight():
    q = HeldQueue()
    for i in range(3):
        for flow in range(200):
            q.add(f"f{flow}-{i}", f"f{flow}")
    served = drain(q)
    assert served[:200] == [f"f{flow}-0" for flow in range(200)]
    assert served[200:400] == [f"f{flow}-1" for flow in range(200)]


def test_misuse_is_refused():
    q = HeldQueue()
    q.add("t", "a")
    with pytest.raises(FairQueueUsageError):
        q.add("t", "a")
    with pytest.raises(FairQueueUsageError):
        q.take("nope")
    with pytest.raises(FairQueueUsageError):
        q.add("u", "a", weight=0)


def test_criticality_names_parse_in_any_case_and_others_are_refused():
    assert parse_criticality(" Critical ") is CRITICAL
    with pytest.raises(ValueError, match="critical, standard or sheddable"):
        parse_criticality("urgent")


ops = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.sampled_from("abc"), st.sampled_from([1.0, 2.0, 0.5]),
                  st.sampled_from(list(Criticality))),
        st.tuples(st.just("take")),
        st.tuples(st.just("remove"), st.integers(0, 50)),
    ),
    max_size=80,
)


@settings(max_examples=200, deadline=None)
@given(ops)
def test_every_flow_keeps_its_order_bands_are_strict_and_nothing_is_lost(script):
    q = HeldQueue()
    held: dict[str, tuple[str, Criticality]] = {}
    order: list[str] = []
    served: list[str] = []
    for n, op in enumerate(script):
        if op[0] == "add":
            task = f"{op[1]}{n}"
            q.add(task, op[1], op[2], op[3])
            held[task] = (op[1], op[3])
            order.append(task)
        elif op[0] == "take" and (task := q.peek()) is not None:
            # Nothing held is more critical than what is served.
            assert all(c.rank >= held[task][1].rank for _, c in held.values())
            q.take(task)
            served.append(task)
            del held[task]
        elif op[0] == "remove" and held:
            task = sorted(held)[op[1] % len(held)]
            q.remove(task)
            del held[task]
        assert len(q) == len(held) and set(q) == set(held)
    for flow in "abc":
        for band in Criticality:
            mine = [t for t in served if t[0] == flow and _band(script, t) is band]
            assert mine == [t for t in order if t in mine]


def _band(script, task):
    return script[int(task[1:])][3]
