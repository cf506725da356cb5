"""The inference processor as pure code, with a hand-stepped clock: one test per behaviour of issue #4."""

from __future__ import annotations

import json

import pytest

from protocol.openai.task_forms import HTTP_REQUEST_CAPABILITY
from protocol.processor.core import TaskState
from protocol.processor.types import (
    CancelTaskOnEngine,
    CloseEngine,
    DeliverResult,
    EngineKey,
    EnginesRemoved,
    FailRequest,
    LocalEnginesChanged,
    ProcessorConfig,
    ProcessorUsageError,
    SendTask,
    TaskQueued,
)
from tests.support.processor import (
    LOCAL,
    REMOTE,
    T0,
    audio,
    chat,
    embedding,
    engine_status,
    http,
    join,
    make,
    one,
    only,
    response,
    sent_to,
    sse,
    submit,
)


# --- engines ---------------------------------------------------------------


def test_not_ready_engine_leaves_routing_but_keeps_its_in_flight_tasks():
    p = make()
    join(p, "e1", "m")
    assert sent_to(submit(p, "a")) == ["e1"]
    p.update_engine("route-e1", "t", engine_status("e1", "m", ready=False), LOCAL, T0)
    assert only(submit(p, "b"), TaskQueued)
    assert p.task_state("a") is TaskState.DISPATCHED
    done = p.receive_result("route-e1", http("a"), T0)
    assert one(done, DeliverResult).last and not p.has_task("a")


def test_removing_an_engine_fails_its_in_flight_tasks_over_to_another_engine():
    p = make(retry_delay=0)
    join(p, "e1", "m")
    submit(p, "a")
    join(p, "e2", "m")
    effects = p.remove_engine("t", "e1", "peer dropped it", T0)
    assert sent_to(effects) == ["e2"]
    assert p.task_state("a") is TaskState.DISPATCHED


def test_closing_a_route_removes_its_engines_and_fails_over_their_tasks():
    p = make(retry_delay=0)
    join(p, "e1", "m", route="peer")
    join(p, "e2", "m", route="peer")
    join(p, "e3", "m", route="other", locality=REMOTE)
    submit(p, "a")
    effects = p.close_route("peer", "stream ended", T0)
    assert sent_to(effects) == ["e3"]
    assert p.engine_counts() == {("t", REMOTE): 1}


def test_an_engine_reconnecting_on_a_new_route_takes_new_tasks_and_the_old_route_only_fails_its_own():
    p = make(retry_delay=0)
    join(p, "e1", "m", route="old")
    submit(p, "a")
    join(p, "e1", "m", route="new")
    assert [e.route for e in only(submit(p, "b"), SendTask)] == ["new"]
    effects = p.close_route("old", "go-away done", T0)
    assert [e.route for e in only(effects, SendTask)] == ["new"]  # task a failed over to the new stream
    assert p.engine_counts() == {("t", LOCAL): 1}
    assert p.task_state("b") is TaskState.DISPATCHED


# --- routing ---------------------------------------------------------------


def test_routes_only_to_engines_of_the_task_tenant():
    p = make()
    join(p, "e1", "m", tenant="other")
    assert only(submit(p, "a", tenant="t"), TaskQueued)
    effects = join(p, "e1", "m", tenant="t")
    assert sent_to(effects) == ["e1"]
    assert one(effects, SendTask).engine == EngineKey("t", "e1")


def test_routes_only_to_engines_whose_model_is_ready():
    p = make()
    join(p, "e1", "other")
    join(p, "e2", loading=("m",))
    assert only(submit(p, "a"), TaskQueued)
    assert sent_to(join(p, "e2", "m")) == ["e2"]


def test_prefers_local_engines_then_the_fewest_in_flight_tasks():
    p = make()
    join(p, "r1", "m", locality=REMOTE)
    join(p, "l1", "m")
    join(p, "l2", "m")
    order = [sent_to(submit(p, f"t{i}"))[0] for i in range(4)]
    assert order == ["l1", "l2", "l1", "l2"]
    p.update_engine("route-l1", "t", engine_status("l1", "m", ready=False), LOCAL, T0)
    p.update_engine("route-l2", "t", engine_status("l2", "m", ready=False), LOCAL, T0)
    assert sent_to(submit(p, "t5")) == ["r1"]


def test_a_targeted_task_goes_to_its_engine_and_fails_503_at_once_when_it_is_absent_or_not_ready():
    p = make()
    join(p, "e1", "m")
    join(p, "e2", "m", ready=False)
    assert sent_to(submit(p, "a", target_engine_id="e1")) == ["e1"]
    absent = one(submit(p, "b", target_engine_id="nope"), FailRequest)
    not_ready = one(submit(p, "c", target_engine_id="e2"), FailRequest)
    assert (absent.status, not_ready.status) == (503, 503)
    assert "not connected" in absent.message and "not ready" in not_ready.message


def test_dynamic_model_loading_picks_the_ready_engine_with_the_fewest_models():
    p = make(dynamic_model_loading=True)
    join(p, "big", "x", "y")
    join(p, "small", "z")
    join(p, "off", ready=False)
    assert sent_to(submit(p, "a", request=chat("new-model"))) == ["small"]


def test_without_dynamic_loading_an_unserved_model_waits():
    p = make()
    join(p, "e1", "x")
    assert one(submit(p, "a", request=chat("new-model")), TaskQueued).model_id == "new-model"


# --- waiting instead of failing --------------------------------------------


def test_a_task_waits_for_its_model_and_is_dispatched_the_moment_an_engine_reports_it_ready():
    p = make()
    queued = one(submit(p, "a", request=chat("m")), TaskQueued)
    assert queued == TaskQueued("t", "m", "a", 1)
    assert one(submit(p, "b", request=chat("m"), now=T0 + 1), TaskQueued).waiting == 2
    assert p.waiting_counts() == {("t", "m"): 2}
    assert p.waiting_task_ids("t", "m") == ["a", "b"]
    effects = join(p, "e1", loading=("m",), now=T0 + 5)
    assert not only(effects, SendTask)
    effects = join(p, "e1", "m", now=T0 + 6)
    assert [s.task.id for s in only(effects, SendTask)] == ["a", "b"]
    assert p.waiting_counts() == {}


def test_a_waiting_task_fails_with_503_after_the_queue_timeout():
    p = make(queue_timeout=30)
    submit(p, "a")
    assert p.next_deadline() == T0 + 30
    assert p.handle_timeout(T0 + 29.9) == []
    failed = one(p.handle_timeout(T0 + 30), FailRequest)
    assert failed.status == 503 and "'m'" in failed.message and failed.retry_after == 5.0
    assert p.next_deadline() is None


def test_a_waiting_task_never_waits_past_its_deadline_and_then_fails_with_504():
    p = make(queue_timeout=30)
    submit(p, "a", deadline=T0 + 5)
    assert p.next_deadline() == T0 + 5
    assert one(p.handle_timeout(T0 + 5), FailRequest).status == 504


def test_a_task_fails_with_503_at_once_when_the_waiting_queue_is_full():
    p = make(max_waiting_tasks=1)
    submit(p, "a")
    failed = one(submit(p, "b"), FailRequest)
    assert failed.status == 503 and "too many" in failed.message and failed.retry_after == 5.0


def test_the_scaler_can_fail_the_waiting_tasks_of_a_model_early_with_a_reason():
    p = make()
    submit(p, "a", request=chat("m"))
    submit(p, "b", request=chat("other"))
    effects = p.fail_waiting("t", "m", 503, "model m cannot be scaled up", T0 + 1)
    assert [(f.task_id, f.status, f.message) for f in only(effects, FailRequest)] == [
        ("a", 503, "model m cannot be scaled up")
    ]
    assert p.waiting_counts() == {("t", "other"): 1}


# --- retries -----------------------------------------------------------------


def test_a_failed_send_requeues_the_task_after_the_retry_delay_avoiding_that_engine():
    p = make(retry_delay=2)
    join(p, "e1", "m")
    join(p, "e2", "m")
    assert sent_to(submit(p, "a")) == ["e1"]
    assert p.dispatch_failed("a", "stream closed", route=None, now=T0 + 1) == []
    assert p.task_state("a") is TaskState.RETRY_PENDING
    assert p.next_deadline() == T0 + 3
    effects = p.handle_timeout(T0 + 3)
    assert sent_to(effects) == ["e2"]
    assert p.counters.retries == {"send_failed": 1}


def test_a_retried_task_goes_back_to_the_engine_that_failed_it_when_it_is_the_only_one():
    p = make(retry_delay=0)
    join(p, "e1", "m")
    submit(p, "a")
    assert sent_to(p.dispatch_failed("a", "stream closed", route=None, now=T0)) == ["e1"]


def test_a_retried_task_with_no_engine_left_waits_for_one():
    p = make(retry_delay=0)
    join(p, "e1", "m")
    submit(p, "a")
    assert only(p.remove_engine("t", "e1", "gone", T0), TaskQueued)
    assert p.task_state("a") is TaskState.WAITING


def test_sends_stop_after_max_attempts_and_the_request_fails_with_503():
    p = make(retry_delay=0, max_attempts=3)
    join(p, "e1", "m")
    submit(p, "a")
    for attempt in ("a", "a#2"):
        assert sent_to(p.dispatch_failed(attempt, "stream closed", route=None, now=T0)) == ["e1"]
    failed = one(p.dispatch_failed("a#3", "stream closed", route=None, now=T0), FailRequest)
    assert (failed.status, failed.code, failed.retries) == (503, "engine_unavailable", 2)
    assert "3 attempts failed" in failed.message and "stream closed" in failed.detail
    assert not p.has_task("a")


def test_losing_engines_max_attempts_times_fails_the_request_with_503_and_the_reason_in_its_detail():
    p = make(retry_delay=0, max_attempts=2)
    join(p, "e1", "m")
    submit(p, "a")
    join(p, "e2", "m")
    p.remove_engine("t", "e1", "gone", T0)
    failed = one(p.remove_engine("t", "e2", "gone too", T0), FailRequest)
    assert failed.status == 503 and "e2" in failed.detail and "e2" not in failed.message


def test_no_retry_once_a_result_was_delivered_engine_loss_mid_stream_fails_with_502():
    p = make(retry_delay=0)
    join(p, "e1", "m")
    join(p, "e2", "m")
    submit(p, "a", request=chat(stream=True))
    p.receive_result("route-e1", http("a"), T0)
    failed = one(p.remove_engine("t", "e1", "gone", T0), FailRequest)
    assert (failed.status, failed.code, failed.delivered) == (502, "engine_lost", 1)
    assert "gone" in failed.detail and "gone" not in failed.message
    assert not only(p.remove_engine("t", "e2", "x", T0), SendTask)


def test_a_streaming_task_lets_go_of_its_request_once_the_answer_started():
    """Once results flow the task can never be dispatched again, so the processor holds
    neither the request (its verbatim and typed forms) nor its headers while it streams:
    that is most of what an open stream would otherwise cost (issue #16, "Open streams")."""
    p = make(retry_delay=0)
    status = engine_status("e1", "m")
    status.infx_capabilities.append(HTTP_REQUEST_CAPABILITY)
    p.update_engine("route-e1", "t", status, LOCAL, T0)
    request = chat(stream=True)
    request.http_request.body = b"x" * 4096
    sent = one(submit(p, "a", request=request, header={"x-request-id": ["r1"]}), SendTask)
    assert sent.task.request.http_request.body == b"x" * 4096 and sent.task.header["x-request-id"].values == ["r1"]
    p.receive_result("route-e1", http("a"), T0)
    task = p._tasks["a"]  # the record itself: what it holds is the point
    assert task.request.ByteSize() == 0 and not task.header
    assert one(p.receive_result("route-e1", sse("a", 1), T0), DeliverResult).result.server_sent_event.data
    assert one(p.receive_result("route-e1", sse("a", 2, last=True), T0), DeliverResult).last
    assert "a" not in p._tasks


def test_a_targeted_task_is_never_retried():
    p = make(retry_delay=0)
    join(p, "e1", "m")
    join(p, "e2", "m")
    submit(p, "a", target_engine_id="e1")
    assert one(p.receive_result("route-e1", http("a", 503), T0), DeliverResult).last
    submit(p, "b", target_engine_id="e1")
    failed = one(p.remove_engine("t", "e1", "gone", T0), FailRequest)
    assert failed.task_id == "b" and failed.status == 503


@pytest.mark.parametrize("code", [400, 404, 422, 500, 502])
def test_engine_replies_of_500_and_4xx_are_final_and_passed_to_the_client_as_they_are(code):
    p = make(retry_delay=0)
    join(p, "e1", "m")
    join(p, "e2", "m")
    submit(p, "a", request=chat(stream=True))
    result = http("a", code, body=b'{"error": "x"}')
    delivered = one(p.receive_result("route-e1", result, T0), DeliverResult)
    assert delivered.last and delivered.result == result
    assert not p.counters.retries


def test_a_task_whose_send_failed_is_retried_elsewhere():
    p = make(retry_delay=0)
    join(p, "e1", "m")
    join(p, "e2", "m")
    submit(p, "a")
    assert sent_to(p.dispatch_failed("a", "stream closed", route="route-e1", now=T0)) == ["e2"]


def test_a_stale_report_of_a_failed_send_does_nothing():
    p = make(retry_delay=0)
    join(p, "e1", "m")
    join(p, "e2", "m")
    submit(p, "a")
    p.close_route("route-e1", "closed", T0)  # a moved on to e2 before the failed send was reported
    assert p.dispatch_failed("a", "stream closed", route="route-e1", now=T0) == []
    assert p.task_state("a") is TaskState.DISPATCHED
    p.receive_result("route-e2", http("a"), T0)
    assert p.dispatch_failed("a", "stream closed", route=None, now=T0) == []


# --- results -----------------------------------------------------------------


@pytest.mark.parametrize("request_", [chat(stream=True), audio(stream=True), response(stream=True)])
def test_a_streaming_task_delivers_its_results_in_order_and_completes_on_the_last_event(request_):
    p = make()
    join(p, "e1", "m")
    submit(p, "a", request=request_)
    out = []
    for result in [http("a"), sse("a", 1), sse("a", 2), sse("a", 3, last=True)]:
        out += p.receive_result("route-e1", result, T0)
    assert [(d.result.result_index, d.last) for d in only(out, DeliverResult)] == [
        (0, False), (1, False), (2, False), (3, True)]
    assert not p.has_task("a")
    assert p.counters.outcomes["completed"] == 1


@pytest.mark.parametrize("request_", [chat(), embedding(), audio(), response()])
def test_a_non_streaming_task_completes_on_its_http_response(request_):
    p = make()
    join(p, "e1", "m")
    submit(p, "a", request=request_)
    assert one(p.receive_result("route-e1", http("a"), T0), DeliverResult).last


def test_a_streaming_task_completes_on_an_error_status():
    p = make()
    join(p, "e1", "m")
    submit(p, "a", request=chat(stream=True))
    assert one(p.receive_result("route-e1", http("a", 400), T0), DeliverResult).last


@pytest.mark.parametrize(
    "results",
    [
        [http("a"), sse("a", 2)],  # gap
        [http("a"), sse("a", 1), sse("a", 1)],  # duplicate
        [sse("a", 0)],  # events before the response
        [http("a"), http("a", index=1)],  # a second response
    ],
    ids=["gap", "duplicate", "event-first", "second-response"],
)
def test_an_out_of_order_or_duplicate_result_fails_the_task_cleanly_and_stops_the_engine(results):
    p = make()
    join(p, "e1", "m")
    submit(p, "a", request=chat(stream=True))
    out = []
    for result in results:
        out += p.receive_result("route-e1", result, T0)
    failed = one(out, FailRequest)
    assert failed.status == 502
    assert one(out, CancelTaskOnEngine).cancelled_task_id == "a"
    assert p.counters.protocol_errors == 1 and not p.has_task("a")
    assert p.engine("t", "e1").in_flight == 0


def test_a_server_sent_event_for_a_non_streaming_task_is_a_protocol_error():
    p = make()
    join(p, "e1", "m")
    submit(p, "a", request=chat(), target_engine_id="e1")
    p.receive_result("route-e1", http("a", 200), T0)
    submit(p, "b", request=embedding())
    p.receive_result("route-e1", http("b", index=0), T0)
    assert p.counters.protocol_errors == 0
    submit(p, "c", request=chat())
    assert one(p.receive_result("route-e1", sse("c", 0), T0), FailRequest).status == 502


# --- nothing dropped -----------------------------------------------------------


def test_a_result_for_a_finished_task_is_counted_and_ignored():
    p = make()
    join(p, "e1", "m")
    submit(p, "a")
    p.receive_result("route-e1", http("a"), T0)
    assert p.receive_result("route-e1", http("a", index=1), T0) == []
    assert p.receive_result("route-e1", http("never-existed"), T0) == []
    assert p.counters.results_ignored == 2


def test_a_late_result_from_an_engine_the_task_was_taken_from_is_ignored():
    p = make(retry_delay=0)
    join(p, "e1", "m")
    join(p, "e2", "m")
    submit(p, "a")
    p.receive_result("route-e1", http("a", 503), T0)
    assert p.receive_result("route-e1", http("a"), T0) == []
    assert p.receive_result("route-e2", http("a"), T0) == []  # the first attempt's id, on the new route
    assert one(p.receive_result("route-e2", http("a#2"), T0), DeliverResult).last


def test_a_consumer_that_cannot_keep_up_gets_an_error_and_other_tasks_go_on():
    p = make(max_unconsumed_results=3)
    join(p, "e1", "m")
    submit(p, "slow", request=chat(stream=True))
    submit(p, "fast", request=chat(stream=True))
    for task_id in ("slow", "fast"):
        p.receive_result("route-e1", http(task_id), T0)
    p.results_consumed("fast")
    out = []
    for i in range(1, 5):
        out += p.receive_result("route-e1", sse("slow", i), T0)
        fast = p.receive_result("route-e1", sse("fast", i), T0)
        assert one(fast, DeliverResult).result.result_index == i
        p.results_consumed("fast")
    assert [d.result.result_index for d in only(out, DeliverResult)] == [1, 2]
    failed = one(out, FailRequest)
    assert failed.task_id == "slow" and failed.delivered == 3 and "keep up" in failed.message
    assert one(out, CancelTaskOnEngine).cancelled_task_id == "slow"
    assert p.counters.slow_consumers == 1 and p.has_task("fast")


def test_acknowledging_more_results_than_delivered_is_misuse_but_acks_after_the_end_are_fine():
    p = make()
    join(p, "e1", "m")
    submit(p, "a", request=chat(stream=True))
    p.receive_result("route-e1", http("a"), T0)
    with pytest.raises(ProcessorUsageError):
        p.results_consumed("a", 2)
    p.receive_result("route-e1", sse("a", 1, last=True), T0)
    p.results_consumed("a", 2)


# --- cancellation and deadlines ---------------------------------------------------


def test_a_client_that_goes_away_drops_its_request_and_the_engine_is_told_to_stop():
    p = make()
    join(p, "e1", "m")
    submit(p, "a", request=chat(stream=True))
    effects = p.cancel("a", T0 + 1)
    cancel = one(effects, CancelTaskOnEngine)
    assert not only(effects, FailRequest) and not only(effects, DeliverResult)
    assert cancel.route == "route-e1" and cancel.task.request.cancel_task.task_id == "a"
    assert cancel.task.id != "a" and cancel.task.engine_id == "e1"
    # A LLMariner engine answers the cancel request with 501: harmless and not a stray result.
    assert p.receive_result("route-e1", http(cancel.task.id, 501), T0 + 1) == []
    assert p.counters.results_ignored == 0
    assert p.counters.outcomes["cancelled"] == 1


def test_cancelling_a_waiting_task_needs_no_engine():
    p = make()
    submit(p, "a")
    assert p.cancel("a", T0) == []
    assert p.waiting_counts() == {} and p.next_deadline() is None


def test_a_passed_deadline_stops_the_engine_and_ends_the_request_with_504():
    p = make()
    join(p, "e1", "m")
    submit(p, "a", request=chat(stream=True), deadline=T0 + 10)
    p.receive_result("route-e1", http("a"), T0 + 1)
    assert p.next_deadline() == T0 + 10
    effects = p.handle_timeout(T0 + 10)
    assert one(effects, CancelTaskOnEngine).cancelled_task_id == "a"
    assert one(effects, FailRequest).status == 504


def test_the_deadline_is_sent_as_timeout_seconds_and_defaults_to_the_max_task_duration():
    p = make(max_task_duration=120)
    join(p, "e1", "m")
    assert one(submit(p, "a", deadline=T0 + 30.5), SendTask).task.timeout_seconds == 30
    assert one(submit(p, "b", deadline=T0 + 0.2), SendTask).task.timeout_seconds == 1
    assert one(submit(p, "c"), SendTask).task.timeout_seconds == 120


def test_a_task_already_past_its_deadline_fails_with_504_at_once():
    p = make()
    join(p, "e1", "m")
    assert one(submit(p, "a", deadline=T0), FailRequest).status == 504


def test_a_dispatched_task_carries_its_id_request_headers_and_engine():
    p = make()
    join(p, "e1", "m")
    send = one(submit(p, "a", header={"X-Request-ID": ["r1"], "A": ["1", "2"]}), SendTask)
    assert send.task.id == "a" and send.task.engine_id == "e1"
    assert send.task.request == chat()
    assert {k: list(v.values) for k, v in send.task.header.items()} == {"X-Request-ID": ["r1"], "A": ["1", "2"]}


# --- heartbeats and go-away ---------------------------------------------------------


def test_heartbeats_go_to_local_engines_only_and_an_answer_keeps_the_engine():
    p = make(heartbeat_interval=10, heartbeat_max_missed=2)
    join(p, "l1", "m")
    join(p, "r1", "m", locality=REMOTE)
    assert p.next_deadline() == T0 + 10
    beats = only(p.handle_timeout(T0 + 10), SendTask)
    assert [(b.engine.engine_id, b.task.request.WhichOneof("request")) for b in beats] == [("l1", "heartbeat")]
    assert p.receive_result("route-l1", http(beats[0].task.id), T0 + 11) == []
    for round_ in range(2, 6):
        beat = one(p.handle_timeout(T0 + 10 * round_), SendTask)
        p.receive_result("route-l1", http(beat.task.id), T0 + 10 * round_)
    assert p.engine_counts()[("t", LOCAL)] == 1


def test_a_local_engine_that_misses_n_heartbeats_is_removed_and_its_tasks_fail_over():
    p = make(heartbeat_interval=10, heartbeat_max_missed=2, retry_delay=0)
    join(p, "l1", "m")
    join(p, "r1", "m", locality=REMOTE)
    submit(p, "a")
    p.handle_timeout(T0 + 10)
    assert sent_to(p.handle_timeout(T0 + 20)) == ["l1"]  # first miss: another heartbeat
    effects = p.handle_timeout(T0 + 30)
    assert one(effects, CloseEngine) == CloseEngine("route-l1", EngineKey("t", "l1"), "missed 2 heartbeats")
    assert sent_to(effects) == ["r1"]
    assert p.counters.heartbeats_missed == 2
    assert p.next_deadline() == T0 + 600  # only task a's deadline is left: no local engine, no heartbeats


def test_go_away_goes_to_local_engines_which_then_get_no_new_tasks():
    p = make()
    join(p, "l1", "m")
    join(p, "r1", "m", locality=REMOTE)
    effects = p.go_away(T0)
    assert [(s.engine.engine_id, s.task.request.WhichOneof("request")) for s in only(effects, SendTask)] == [
        ("l1", "go_away")]
    go_away_id = one(effects, SendTask).task.id
    assert p.receive_result("route-l1", http(go_away_id, 202), T0) == []
    assert sent_to(submit(p, "a")) == ["r1"]
    assert one(submit(p, "b", target_engine_id="l1"), FailRequest).status == 503


# --- status, metrics, misuse -------------------------------------------------------


def test_the_status_dump_is_json_and_shows_engines_tasks_and_the_queue():
    p = make()
    join(p, "l1", "m")
    join(p, "r1", "m", tenant="u", locality=REMOTE)
    submit(p, "a")
    submit(p, "w", request=chat("missing"))
    dump = json.loads(json.dumps(p.status()))
    assert dump["tenants"]["t"]["engines"]["l1"]["tasks"] == ["a"]
    assert dump["tenants"]["t"]["engines"]["l1"]["locality"] == "local"
    assert dump["tenants"]["u"]["engines"]["r1"]["models"] == [{"id": "m", "ready": True, "in_progress": 0}]
    assert dump["waiting"] == {"t": {"missing": ["w"]}}


def test_metrics_count_engines_in_flight_and_queued_tasks_per_tenant_and_model():
    p = make()
    join(p, "l1", "m")
    join(p, "r1", "m", locality=REMOTE)
    submit(p, "a")
    submit(p, "w", request=chat("missing"))
    assert p.engine_counts() == {("t", LOCAL): 1, ("t", REMOTE): 1}
    assert p.in_flight_counts() == {("t", "m"): 1}
    assert p.waiting_counts() == {("t", "missing"): 1}
    assert p.counters.accepted == 2


def test_known_models_lists_what_engines_of_a_tenant_serve_and_what_is_routable_now():
    p = make()
    join(p, "e1", "a", loading=("b",))
    join(p, "e2", "c", ready=False)
    join(p, "e3", "d", tenant="other")
    assert p.known_models("t") == {"a", "b", "c"}
    assert p.known_models("t", ready_only=True) == {"a"}
    assert p.known_models("nobody") == set()


def test_local_engine_changes_are_signalled_and_reported_with_real_readiness():
    p = make()
    assert only(join(p, "l1", "m"), LocalEnginesChanged)
    assert not only(join(p, "l1", "m"), LocalEnginesChanged)  # same status again
    assert only(join(p, "l1", "m", ready=False), LocalEnginesChanged)
    assert not only(join(p, "r1", "m", locality=REMOTE), LocalEnginesChanged)
    assert [(tenant, s.engine_id, s.ready) for tenant, s in p.local_engines()] == [("t", "l1", False)]
    assert only(p.remove_engine("t", "l1", "gone", T0), LocalEnginesChanged)


def test_timers_of_ended_tasks_do_not_pile_up():
    p = make()
    join(p, "e1", "m")
    for i in range(1000):
        submit(p, f"t{i}")
        p.receive_result("route-e1", http(f"t{i}"), T0)
    assert len(p._tasks.timers) <= 64 + 1
    assert p.next_deadline() is None


def test_misuse_raises_a_local_error():
    p = make()
    join(p, "e1", "m")
    submit(p, "a")
    with pytest.raises(ProcessorUsageError):
        submit(p, "a")
    with pytest.raises(ProcessorUsageError):
        p.cancel("unknown", T0)
    with pytest.raises(ProcessorUsageError):
        submit(p, "infx-ctl-x")
    with pytest.raises(ProcessorUsageError):
        p.submit(task_id="h", tenant_id="t", request=chat(""), origin="c", now=T0)
    with pytest.raises(ProcessorUsageError):
        p.remove_engine("t", "nope", "x", T0)
    with pytest.raises(ProcessorUsageError):
        ProcessorConfig(max_attempts=0, queue_timeout=-1)


# --- attempts: findings F2 and F3 of the cluster simulation (harness/sim/FINDINGS.md) ----


def test_a_retry_over_the_same_peer_route_has_its_own_wire_id_and_late_answers_to_the_first_are_ignored():
    """F2: e1 and e2 are both behind one peer stream. After e1 is reported gone the task is
    sent again on that stream; the peer's late 503 (or a late failed-send report) for the
    first attempt must not be taken as the retry's answer."""
    p = make(retry_delay=0)
    join(p, "e1", "m", locality=REMOTE, route="peer")
    join(p, "e2", "m", locality=REMOTE, route="peer")
    assert [e.task.id for e in only(submit(p, "a"), SendTask)] == ["a"]  # the first attempt keeps the id
    retry = one(p.remove_engine("t", "e1", "gone", T0), SendTask)
    assert (retry.route, retry.engine.engine_id, retry.task.id) == ("peer", "e2", "a#2")
    assert p.attempt_owner("a#2") == "a" and p.attempt_owner("a") is None
    assert p.receive_result("peer", http("a", 503), T0) == []
    assert p.receive_result("peer", http("a", 503, body=b"task 'a' is already running"), T0) == []
    assert p.dispatch_failed("a", "stream closed", route="peer", now=T0) == []
    assert p.task_state("a") is TaskState.DISPATCHED and p.counters.retries == {"engine_lost": 1}
    delivered = one(p.receive_result("peer", http("a#2", body=b"ok"), T0), DeliverResult)
    assert (delivered.task_id, delivered.result.task_id, delivered.result.http_response.body) == ("a", "a", b"ok")
    assert delivered.last and not p.has_task("a")


def test_an_attempt_id_never_clashes_with_another_task_that_uses_it_as_its_own_id():
    """Task ids are opaque: a peer may forward a task whose id looks like a retry's wire id."""
    p = make(retry_delay=0)
    join(p, "e1", "m")
    join(p, "e2", "m")
    assert sent_to(submit(p, "a#2")) == ["e1"]
    assert sent_to(submit(p, "a")) == ["e2"]
    retry = one(p.receive_result("route-e2", http("a", 503), T0), SendTask)
    assert retry.task.id not in ("a", "a#2") and p.attempt_owner(retry.task.id) == "a"
    assert p.attempt_owner("a#2") == "a#2"
    assert one(p.receive_result("route-e1", http("a#2"), T0), DeliverResult).task_id == "a#2"
    assert one(p.receive_result("route-e1", http(retry.task.id), T0), DeliverResult).task_id == "a"


def test_a_task_failed_over_from_a_removed_engine_is_cancelled_on_its_older_still_open_stream():
    """F3: e0 reconnected on stream B while stream A (told to go away) still runs task a.
    When B ends, e0 goes and a fails over, but A is still open: a is cancelled there first."""
    p = make(retry_delay=0)
    join(p, "e0", "m", route="stream-A")
    join(p, "e1", "m", locality=REMOTE, route="peer")
    assert sent_to(submit(p, "a")) == ["e0"]
    join(p, "e0", "m", route="stream-B")
    effects = p.close_route("stream-B", "engine stream ended", T0)
    cancel = one(effects, CancelTaskOnEngine)
    assert (cancel.route, cancel.engine, cancel.cancelled_task_id) == ("stream-A", EngineKey("t", "e0"), "a")
    assert cancel.task.request.cancel_task.task_id == "a"
    retry = one(effects, SendTask)
    assert effects.index(cancel) < effects.index(retry) and retry.engine.engine_id == "e1"
    # The engine's answer to the cancel on A is consumed, not taken for a task.
    assert p.receive_result("stream-A", http(cancel.task.id, 501), T0) == []
    assert p.counters.results_ignored == 0


def test_a_remote_engine_reported_gone_has_its_tasks_cancelled_on_the_peer_stream():
    """The peer stream stays open when its report drops an engine: the abandoned attempt is
    cancelled there, whether the task is retried or fails (it had started streaming)."""
    p = make(retry_delay=0)
    join(p, "e1", "m", locality=REMOTE, route="peer")
    submit(p, "a")
    submit(p, "b", request=chat(stream=True))
    p.receive_result("peer", http("b"), T0)
    effects = p.remove_engine("t", "e1", "no longer reported", T0)
    assert sorted((c.route, c.cancelled_task_id) for c in only(effects, CancelTaskOnEngine)) == [
        ("peer", "a"), ("peer", "b")]
    assert one(effects, FailRequest).status == 502


def test_no_cancel_is_sent_on_the_stream_that_is_closing():
    """A closed stream cannot carry a cancel: close_route and a heartbeat give-up send none there."""
    p = make(retry_delay=0, heartbeat_interval=1.0, heartbeat_max_missed=1)
    join(p, "e0", "m")
    join(p, "e1", "m")
    submit(p, "a")
    assert not only(p.close_route("route-e0", "ended", T0), CancelTaskOnEngine)
    p.handle_timeout(T0 + 1)
    effects = p.handle_timeout(T0 + 2)
    assert one(effects, CloseEngine).route == "route-e1"
    assert not only(effects, CancelTaskOnEngine)


def test_engines_leaving_are_announced_for_the_senders():
    """F1's hook: every removal names the engines that went (senders may register them)."""
    p = make()
    join(p, "e0", "m", route="s")
    join(p, "e1", "m", route="s")
    join(p, "e2", "m", locality=REMOTE, route="peer")
    assert one(p.close_route("s", "ended", T0), EnginesRemoved).engines == (EngineKey("t", "e0"), EngineKey("t", "e1"))
    assert one(p.remove_engine("t", "e2", "gone", T0), EnginesRemoved).engines == (EngineKey("t", "e2"),)
    assert not only(p.close_route("nothing-here", "ended", T0), EnginesRemoved)
