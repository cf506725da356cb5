"""Criticality and fair queueing in the processor's held queue, with a hand-stepped clock (issue #17)."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from protocol.openai import task_forms
from protocol.processor.core import Processor
from protocol.processor.fair_queue import Criticality
from protocol.processor.types import FailRequest, Locality, ProcessorConfig, ProcessorUsageError, SendTask
from tests.support.processor import chat, engine_status, http, only

T0 = 1000.0
CRITICAL, STANDARD, SHEDDABLE = Criticality.CRITICAL, Criticality.STANDARD, Criticality.SHEDDABLE


def make(**config: object) -> Processor:
    p = Processor(ProcessorConfig(**config))  # type: ignore[arg-type]
    p.update_engine("route-e1", "t", engine_status("e1", "m"), Locality.LOCAL, T0)
    return p


def submit(p: Processor, task_id: str, flow: str = "", now: float = T0, **kw: object) -> list[object]:
    return list(p.submit(task_id=task_id, tenant_id="t", request=chat("m"), origin="client", flow=flow, **kw, now=now))


def sent(effects: list[object]) -> list[str]:
    return [e.task.id for e in only(effects, SendTask)]


def finish(p: Processor, task_id: str, now: float) -> list[str]:
    """The task's engine answers it; return what the freed slot dispatched."""
    return sent(p.receive_result("route-e1", http(task_id), now))


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
    effects = list(p.submit(task_id="s", tenant_id="t", request=chat("other"), origin="client",
                            criticality=SHEDDABLE, now=T0))
    assert not only(effects, FailRequest) and p.waiting_task_ids("t", "other") == ["s"]


@pytest.mark.parametrize("fair_reserve", [0, 1])
def test_a_slot_the_verbatim_only_head_cannot_take_goes_to_the_most_critical_task_that_can(fair_reserve):
    """The critical head has only its verbatim form, and only the full infx engine takes it: the
    slot the LLMariner engine frees goes to the most critical task behind it, not the oldest one,
    even where that one's caller may not take the reserved slot that the sheddable one's may."""
    p = Processor(ProcessorConfig(max_in_flight_per_engine=2, fair_reserve=fair_reserve, queue_timeout=100,
                                  shed_waiting_threshold=5))
    infx = engine_status("infx", "m")
    infx.infx_capabilities.append("http-request")
    p.update_engine("route-infx", "t", infx, Locality.LOCAL, T0)
    p.update_engine("route-llm", "t", engine_status("llm", "m"), Locality.LOCAL, T0)
    assert sent(sum((submit(p, f"a{i}", "A") for i in range(4)), [])) == ["a0", "a1", "a2", "a3"]
    verbatim = task_forms.routing_fields("chat_completion", "m", False)
    verbatim.typed_request_incomplete = "the typed form refused it"
    verbatim.http_request.body = b'{"model": "m"}'
    held = p.submit(task_id="h", tenant_id="t", request=verbatim, origin="client", flow="H", criticality=CRITICAL,
                    now=T0)
    assert sent(held + submit(p, "s", "B", criticality=SHEDDABLE) + submit(p, "n", "A")) == []
    assert sent(p.receive_result("route-llm", http("a1"), T0 + 1)) == ["n"]
    assert p.waiting_task_ids("t", "m") == ["h", "s"]


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
    p.cancel("s", T0)
    assert finish(p, running[0], T0 + 1) == ["n"]
    assert p.waiting_counts() == {}


def test_weight_and_threshold_are_validated():
    with pytest.raises(ProcessorUsageError, match="shed_waiting_threshold"):
        ProcessorConfig(shed_waiting_threshold=-1)
    p = make()
    with pytest.raises(ProcessorUsageError, match="weight"):
        submit(p, "x", weight=0.0)


ORDER = {CRITICAL: 0, STANDARD: 1, SHEDDABLE: 2}
ops = st.lists(
    st.one_of(
        st.tuples(st.just("submit"), st.sampled_from("ABC"), st.sampled_from(list(Criticality))),
        st.tuples(st.just("finish")),
        st.tuples(st.just("cancel"), st.integers(0, 30)),
        st.tuples(st.just("wait"), st.sampled_from([1.0, 20.0])),
    ),
    max_size=60,
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops, st.sampled_from([0, 2]))
# A holds the one slot it may (x2), B (holding none) waits with a sheddable task: the reserved slot
# x1 frees went to B's x4 past A's standard x3, not to x3.
@example([("submit", "A", CRITICAL)] * 3 + [("finish",), ("submit", "A", STANDARD), ("submit", "B", SHEDDABLE),
          ("finish",)], 2)
def test_every_task_ends_once_and_a_freed_slot_never_skips_a_more_critical_waiting_task(script, threshold):
    p = make(max_in_flight_per_engine=2, queue_timeout=30, max_waiting_tasks=6, shed_waiting_threshold=threshold)
    now, n = T0, 0
    criticality: dict[str, Criticality] = {}
    running: list[str] = []
    ended: list[str] = []

    def apply(effects: list[object]) -> None:
        for e in effects:
            if isinstance(e, SendTask):
                waiting = p.waiting_task_ids("t", "m")
                # What got the slot is at least as critical as everything still waiting.
                assert all(ORDER[criticality[w]] >= ORDER[criticality[e.task.id]] for w in waiting)
                running.append(e.task.id)
            elif isinstance(e, FailRequest):
                ended.append(e.task_id)
                if e.task_id in running:
                    running.remove(e.task_id)

    for op in script:
        if op[0] == "submit":
            task_id = f"x{n}"
            n += 1
            criticality[task_id] = op[2]
            apply(submit(p, task_id, op[1], now=now, criticality=op[2]))
        elif op[0] == "finish" and running:
            task_id = running.pop(0)
            ended.append(task_id)
            apply(p.receive_result("route-e1", http(task_id), now))
        elif op[0] == "cancel":
            live = [t for t in criticality if t not in ended]
            if live:
                task_id = live[op[1] % len(live)]
                ended.append(task_id)
                if task_id in running:
                    running.remove(task_id)
                apply(p.cancel(task_id, now))
        elif op[0] == "wait":
            now += op[1]
            apply(p.handle_timeout(now))
    assert len(ended) == len(set(ended))
    assert p.status()["tasks"] == len(criticality) - len(ended)
