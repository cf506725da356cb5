"""Criticality and fair queueing in the processor's held queue, with a hand-stepped clock (issue #17)."""

from __future__ import annotations

import pytest

from protocol.fair_queue import Criticality
from protocol.processor import Processor
from protocol.processor_types import FailRequest, Locality, ProcessorConfig, ProcessorUsageError, SendTask
from tests.processor_helpers import chat, engine_status, http, only

T0 = 1000.0
CRITICAL, STANDARD, SHEDDABLE = Criticality.CRITICAL, Criticality.STANDARD, Criticality.SHEDDABLE


def make(**config: object) -> Processor:
    p = Processor(ProcessorConfig(**config))  # type: ignore[arg-type]
    p.update_engine(T0, "route-e1", "t", engine_status("e1", "m"), Locality.LOCAL)
    return p


def submit(p: Processor, task_id: str, flow: str = "", now: float = T0, **kw: object) -> list[object]:
    return list(p.submit(now, task_id=task_id, tenant_id="t", request=chat("m"), origin="client", flow=flow, **kw))


def sent(effects: list[object]) -> list[str]:
    return [e.task.id for e in only(effects, SendTask)]


def finish(p: Processor, task_id: str, now: float) -> list[str]:
    """The task's engine answers it; return what the freed slot dispatched."""
    return sent(p.receive_result(now, "route-e1", http(task_id)))


def test_a_burst_from_one_caller_cannot_starve_another_callers_requests():
    """A sends 1,000 requests at once; B's two, sent later, wait one turn of A's each, not 1,000."""
    p = make(max_in_flight_per_engine=1, queue_timeout=10_000)
    running = sent(submit(p, "a0", "A"))
    for i in range(1, 1000):
        submit(p, f"a{i}", "A")
    now = T0
    for _ in range(3):  # A alone for a while
        now += 1
        running = finish(p, running[0], now)
    submit(p, "b0", "B", now=now)
    submit(p, "b1", "B", now=now)
    arrived, order = now, []
    while not {"b0", "b1"} <= set(order):
        now += 1
        running = finish(p, running[0], now)
        order += running
    assert order == ["a4", "b0", "a5", "b1"]
    # B's queue wait is bounded by its share (every other turn), whatever the size of A's burst.
    assert now - arrived == 4


def test_weights_give_callers_their_share_of_freed_slots():
    p = make(max_in_flight_per_engine=1, queue_timeout=10_000)
    running = sent(submit(p, "first", "X"))
    for i in range(40):
        submit(p, f"h{i}", "heavy", weight=3.0)
        submit(p, f"l{i}", "light", weight=1.0)
    served = []
    for step in range(40):
        running = finish(p, running[0], T0 + step + 1)
        served += running
    assert sum(t.startswith("h") for t in served) == 30


def test_critical_requests_get_the_next_slot_before_older_standard_ones():
    p = make(max_in_flight_per_engine=1, queue_timeout=10_000)
    running = sent(submit(p, "a", "A"))
    submit(p, "n1", "A")
    submit(p, "n2", "B")
    submit(p, "c", "C", criticality=CRITICAL)
    assert finish(p, running[0], T0 + 1) == ["c"]
    assert finish(p, "c", T0 + 2) == ["n1"]


def test_sheddable_is_refused_with_429_and_retry_after_when_every_engine_is_at_its_cap():
    p = make(max_in_flight_per_engine=1, busy_retry_after=7.0)
    sent(submit(p, "a"))
    [refusal] = only(submit(p, "s", criticality=SHEDDABLE), FailRequest)
    assert (refusal.task_id, refusal.status, refusal.retry_after) == ("s", 429, 7.0)
    assert "sheddable" in refusal.message and p.counters.shed == 1
    assert not only(submit(p, "n"), FailRequest)  # a standard one waits as before


def test_sheddable_waits_up_to_the_threshold():
    p = make(max_in_flight_per_engine=1, shed_waiting_threshold=2)
    sent(submit(p, "a"))
    assert not only(submit(p, "s1", criticality=SHEDDABLE) + submit(p, "n"), FailRequest)
    assert [f.status for f in only(submit(p, "s2", criticality=SHEDDABLE), FailRequest)] == [429]
    assert p.waiting_task_ids("t", "m") == ["s1", "n"]


def test_sheddable_still_waits_for_a_model_no_engine_serves_yet():
    """Nothing is saturated while the scaler starts the first engine: shedding would only lose work."""
    p = make(max_in_flight_per_engine=1)
    effects = list(p.submit(T0, task_id="s", tenant_id="t", request=chat("other"), origin="client",
                            criticality=SHEDDABLE))
    assert not only(effects, FailRequest) and p.waiting_task_ids("t", "other") == ["s"]


def test_a_full_queue_sheds_its_newest_sheddable_task_for_a_critical_or_standard_one():
    p = make(max_in_flight_per_engine=1, max_waiting_tasks=3, shed_waiting_threshold=10)
    sent(submit(p, "a"))
    submit(p, "s1", criticality=SHEDDABLE)
    submit(p, "s2", criticality=SHEDDABLE)
    submit(p, "n1")
    effects = submit(p, "c", criticality=CRITICAL)
    assert [(f.task_id, f.status) for f in only(effects, FailRequest)] == [("s2", 429)]
    assert p.waiting_task_ids("t", "m") == ["s1", "n1", "c"]
    assert [(f.task_id, f.status) for f in only(submit(p, "s3", criticality=SHEDDABLE), FailRequest)] == [("s3", 429)]
    submit(p, "n2")
    assert [(f.task_id, f.status) for f in only(submit(p, "n3"), FailRequest)] == [("n3", 503)]
    assert p.waiting_task_ids("t", "m") == ["n1", "c", "n2"]


def test_a_shed_or_cancelled_task_leaves_no_trace_in_the_queue():
    p = make(max_in_flight_per_engine=1, shed_waiting_threshold=5)
    running = sent(submit(p, "a"))
    submit(p, "s", "A", criticality=SHEDDABLE)
    submit(p, "n", "B")
    p.cancel(T0, "s")
    assert finish(p, running[0], T0 + 1) == ["n"]
    assert p.waiting_counts() == {}


def test_weight_and_threshold_are_validated():
    with pytest.raises(ProcessorUsageError, match="shed_waiting_threshold"):
        ProcessorConfig(shed_waiting_threshold=-1)
    p = make()
    with pytest.raises(ProcessorUsageError, match="weight"):
        submit(p, "x", weight=0.0)
