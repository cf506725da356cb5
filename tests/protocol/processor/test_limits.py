"""The processor's caps, with a hand-stepped clock: tasks in flight per engine and live tasks per tenant (issue #8)."""

from __future__ import annotations

import json

import pytest

from protocol.processor.core import Processor, TaskState
from protocol.processor.config import ProcessorConfig
from protocol.processor.effects import DeliverResult, FailRequest, SendTask, TaskQueued
from protocol.processor.errors import ProcessorUsageError
from protocol.processor.keys import Locality
from tests.support.processor import chat, engine_status, http, one, only, sse

LOCAL = Locality.LOCAL
T0 = 1000.0


def make(**config: object) -> Processor:
    return Processor(ProcessorConfig(**config))  # type: ignore[arg-type]


def join(p: Processor, engine_id: str, *models: str, tenant: str = "t", now: float = T0) -> list[object]:
    return list(p.update_engine(f"route-{engine_id}", tenant, engine_status(engine_id, *models), LOCAL, now))


def submit(p: Processor, task_id: str, now: float = T0, tenant: str = "t", model: str = "m", stream: bool = False,
           **kw: object) -> list[object]:
    return list(p.submit(task_id=task_id, tenant_id=tenant, request=chat(model, stream), origin="client", **kw, now=now))


def sent(effects: list[object]) -> list[tuple[str, str]]:
    return [(e.task.id, e.engine.engine_id) for e in only(effects, SendTask)]


@pytest.mark.parametrize("field", ["max_in_flight_per_engine", "max_tasks_per_tenant"])
def test_caps_must_be_positive_or_none(field):
    with pytest.raises(ProcessorUsageError, match=field):
        make(**{field: 0})
    assert getattr(ProcessorConfig(), field) is None


# --- tasks in flight per engine ------------------------------------------------


def test_engine_at_its_cap_is_skipped_and_the_task_goes_to_another_engine():
    p = make(max_in_flight_per_engine=1)
    join(p, "e1", "m")
    join(p, "e2", "m")
    assert sent(submit(p, "a")) == [("a", "e1")]
    assert sent(submit(p, "b")) == [("b", "e2")]
    assert p.engine("t", "e1").in_flight == 1 and p.engine("t", "e2").in_flight == 1


def test_task_waits_when_every_engine_is_full_and_a_freed_slot_dispatches_it():
    p = make(max_in_flight_per_engine=2)
    join(p, "e1", "m")
    assert sent(submit(p, "a") + submit(p, "b")) == [("a", "e1"), ("b", "e1")]
    waiting = submit(p, "c") + submit(p, "d")
    assert not only(waiting, SendTask)
    assert p.waiting_task_ids("t", "m") == ["c", "d"]
    done = p.receive_result("route-e1", http("a"), T0 + 1)
    assert one(done, DeliverResult).last
    # The slot "a" freed goes to the oldest waiting task, within the same input.
    assert sent(done) == [("c", "e1")]
    assert p.task_state("c") is TaskState.DISPATCHED and p.waiting_task_ids("t", "m") == ["d"]
    assert p.engine("t", "e1").in_flight == 2


def test_waiting_only_for_a_slot_is_not_reported_to_the_scaler_as_a_missing_model():
    """TaskQueued means "no ready engine serves this model" (the scaler starts one); a full engine serves it."""
    p = make(max_in_flight_per_engine=1)
    assert only(submit(p, "a"), TaskQueued)  # no engine at all: the scaler must hear of it
    join(p, "e1", "m")
    assert not p.waiting_task_ids("t", "m")
    assert not only(submit(p, "b"), TaskQueued)
    assert p.waiting_task_ids("t", "m") == ["b"]


@pytest.mark.parametrize("ending", ["cancel", "deadline", "stream_error", "engine_500"])
def test_every_way_a_task_leaves_an_engine_frees_its_slot(ending):
    p = make(max_in_flight_per_engine=1, retry_delay=0, max_attempts=1)
    join(p, "e1", "m")
    submit(p, "a", deadline=T0 + 10, stream=True)
    submit(p, "b")
    assert p.task_state("b") is TaskState.WAITING
    if ending == "cancel":
        effects = p.cancel("a", T0 + 1)
    elif ending == "deadline":
        effects = p.handle_timeout(T0 + 10)
    elif ending == "stream_error":
        p.receive_result("route-e1", http("a"), T0 + 1)
        effects = p.receive_result("route-e1", http("a", index=1), T0 + 1)  # an HttpResponse mid-stream
    else:
        effects = p.receive_result("route-e1", http("a", code=500), T0 + 1)
    assert not p.has_task("a")
    assert sent(effects) == [("b", "e1")]


def test_cap_is_never_exceeded_while_results_stream_in():
    p = make(max_in_flight_per_engine=1)
    join(p, "e1", "m")
    submit(p, "a", stream=True)
    submit(p, "b")
    effects = p.receive_result("route-e1", http("a"), T0) + p.receive_result("route-e1", sse("a", 1), T0)
    assert not only(effects, SendTask) and p.engine("t", "e1").in_flight == 1
    assert sent(p.receive_result("route-e1", sse("a", 2, last=True), T0)) == [("b", "e1")]


def test_waiting_for_a_slot_times_out_with_503_that_names_the_cap():
    p = make(max_in_flight_per_engine=1, queue_timeout=5, busy_retry_after=7)
    join(p, "e1", "m")
    submit(p, "a")
    submit(p, "b")
    failed = one(p.handle_timeout(T0 + 5), FailRequest)
    assert (failed.task_id, failed.status, failed.retry_after) == ("b", 503, 7)
    assert "at its limit of 1 tasks" in failed.message
    assert p.task_state("a") is TaskState.DISPATCHED


def test_an_engine_removed_while_full_takes_no_waiting_task():
    p = make(max_in_flight_per_engine=1, retry_delay=0)
    join(p, "e1", "m")
    submit(p, "a")
    submit(p, "b")
    effects = p.remove_engine("t", "e1", "gone", T0)
    assert not only(effects, SendTask)
    assert p.task_state("b") is TaskState.WAITING
    # "a" is back in line behind "b" and both go to the next engine as its slots allow.
    assert sent(join(p, "e2", "m")) == [("b", "e2")]


# --- tasks per tenant ------------------------------------------------------------


def test_tenant_at_its_cap_gets_429_with_retry_after_and_other_tenants_are_served():
    p = make(max_tasks_per_tenant=2, busy_retry_after=4)
    join(p, "e1", "m", tenant="t")
    join(p, "u1", "m", tenant="u")
    submit(p, "a")
    submit(p, "b", model="not-served")  # waiting tasks count too
    refused = one(submit(p, "c"), FailRequest)
    assert (refused.task_id, refused.status, refused.retry_after) == ("c", 429, 4)
    assert json_error_code(refused) == 429
    assert not p.has_task("c") and p.counters.tenant_cap_refusals == 1
    assert sent(submit(p, "x", tenant="u") + submit(p, "y", tenant="u")) == [("x", "u1"), ("y", "u1")]


def test_tenant_gets_room_again_when_one_of_its_tasks_ends():
    p = make(max_tasks_per_tenant=1)
    join(p, "e1", "m")
    submit(p, "a")
    assert one(submit(p, "b"), FailRequest).status == 429
    p.receive_result("route-e1", http("a"), T0)
    assert sent(submit(p, "c")) == [("c", "e1")]


def test_targeted_tasks_count_and_are_refused_with_503_for_the_peer_to_retry():
    p = make(max_tasks_per_tenant=1)
    join(p, "e1", "m")
    assert sent(submit(p, "fwd-1", target_engine_id="e1")) == [("fwd-1", "e1")]
    assert one(submit(p, "own"), FailRequest).status == 429
    assert one(submit(p, "fwd-2", target_engine_id="e1"), FailRequest).status == 503


def json_error_code(failed: FailRequest) -> int:
    return int(json.loads(failed.error_body())["error"]["code"])
