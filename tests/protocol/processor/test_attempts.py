"""One retry budget per task (issue #22, item 1), as pure code on a hand-stepped clock.

A request that made its runtime drop the connection was replayed about 30
times in 29 s: the agent answered "could not reach its runtime" (503), which
the processor took for a busy runtime, and busy answers were bounded only by
the queue time. Now every failure of every kind counts against one budget per
task (``max_attempts`` sends in all), a request a runtime read and dropped is
sent again at most once (a Responses request never), and the client gets the
last failure's answer in the same input that ends the budget.
"""

from __future__ import annotations

import pytest

from protocol.processor.attempts import AttemptFailure, Attempts, failure_of
from protocol.pb import worker_pb2
from protocol.processor.core import Processor, TaskState
from protocol.processor.config import ProcessorConfig
from protocol.processor.effects import DeliverResult, FailRequest, SendTask
from protocol.processor.keys import Locality
from protocol.agent.runtime_failures import RuntimeFailure, failure_result
from tests.support.processor import chat, embedding, engine_status, http, one, only, response

T0 = 1000.0


def make(**config: object) -> Processor:
    return Processor(ProcessorConfig(**config))  # type: ignore[arg-type]


def join(p: Processor, *engine_ids: str) -> None:
    for engine_id in engine_ids:
        p.update_engine(f"route-{engine_id}", "t", engine_status(engine_id, "m"), Locality.LOCAL, T0)


def submit(p: Processor, request: worker_pb2.TaskRequest | None = None, now: float = T0) -> SendTask:
    return one(p.submit(task_id="a", tenant_id="t", request=request or chat(), origin="client", now=now), SendTask)


def agent_says(failure: RuntimeFailure, wire_id: str) -> worker_pb2.TaskResult:
    """The engine agent's own answer for a runtime that failed the task, as it sends it."""
    result = failure_result(failure)
    result.task_id = wire_id
    return result


def dropped(p: Processor, sent: SendTask, now: float) -> list[object]:
    return list(p.receive_result(sent.route, agent_says(RuntimeFailure.DROPPED, sent.task.id), now))


# --- how an attempt failed ---------------------------------------------------------


@pytest.mark.parametrize(("result", "failure"), [
    (failure_result(RuntimeFailure.DROPPED), AttemptFailure.RUNTIME_DROPPED),
    (failure_result(RuntimeFailure.UNREACHABLE), AttemptFailure.RUNTIME_UNREACHABLE),
    (http("a", 503), AttemptFailure.RUNTIME_BUSY),
    (http("a", 429), AttemptFailure.RUNTIME_BUSY),
    (http("a", 502), None),  # a runtime's (or proxy's) own 502 is its answer
    (http("a", 500), None),
    (http("a", 400), None),
    (http("a", 200), None),
])
def test_an_engines_first_result_says_whether_the_attempt_failed_and_how(result, failure):
    assert failure_of(result) is failure


def test_the_agents_answers_for_a_failed_runtime_are_marked_and_say_only_what_a_client_can_act_on():
    unreachable, gone = failure_result(RuntimeFailure.UNREACHABLE), failure_result(RuntimeFailure.DROPPED)
    assert (unreachable.http_response.status_code, gone.http_response.status_code) == (503, 502)
    assert b'"code":"runtime_unreachable"' in unreachable.http_response.body
    assert b'"type":"upstream_error"' in gone.http_response.body and b'"code":"runtime_dropped"' in gone.http_response.body
    for result in (unreachable, gone):
        assert b"Failure" not in result.http_response.body and b"twisted" not in result.http_response.body


def test_the_budget_counts_every_kind_of_failure_and_a_dropped_request_twice_at_most():
    attempts = Attempts()
    assert attempts.sent() is None  # the first send retries nothing
    attempts.fail(AttemptFailure.ENGINE_LOST)
    assert attempts.refusal(3, "chat_completion") == ""
    assert attempts.sent() is AttemptFailure.ENGINE_LOST and attempts.retries == 1
    attempts.fail(AttemptFailure.RUNTIME_DROPPED)
    assert attempts.refusal(3, "chat_completion") == ""
    assert attempts.refusal(3, "model_response")  # a Responses request is never sent twice once read
    attempts.sent()
    attempts.fail(AttemptFailure.RUNTIME_BUSY)
    assert attempts.refusal(3, "chat_completion") == "3 attempts failed"
    assert attempts.refusal(4, "chat_completion") == ""
    attempts.sent()
    attempts.fail(AttemptFailure.RUNTIME_DROPPED)
    assert "2 times" in attempts.refusal(10, "chat_completion")


def test_a_send_its_route_refused_is_no_retry_and_leaves_the_retry_owed():
    attempts = Attempts()
    attempts.sent()
    attempts.fail(AttemptFailure.SEND_FAILED)
    assert attempts.sent() is AttemptFailure.SEND_FAILED and attempts.retries == 1
    assert attempts.unsent() is AttemptFailure.SEND_FAILED and attempts.retries == 0
    assert attempts.sent() is AttemptFailure.SEND_FAILED and attempts.retries == 1


# --- the processor -------------------------------------------------------------------


def test_a_request_the_runtime_dropped_is_sent_once_more_elsewhere_then_the_client_gets_the_502_at_once():
    p = make(retry_delay=3.0)
    join(p, "e1", "e2")
    first = submit(p)
    assert dropped(p, first, T0 + 0.2) == []
    assert p.task_state("a") is TaskState.RETRY_PENDING and p.next_deadline() == T0 + 3.2
    again = one(p.handle_timeout(T0 + 3.2), SendTask)
    assert (again.engine.engine_id, again.task.id) == ("e2", "a#2")
    last = one(dropped(p, again, T0 + 3.4), DeliverResult)
    assert last.last and last.retries == 1
    answer = last.result.http_response
    assert answer.status_code == 502 and b"runtime_dropped" in answer.body
    assert not p.has_task("a")
    assert p.counters.attempt_failures == {"runtime_dropped": 2} and p.counters.retries == {"runtime_dropped": 1}


def test_a_dropped_request_goes_back_to_the_only_engine_but_only_once():
    p = make(retry_delay=0)
    join(p, "e1")
    again = one(dropped(p, submit(p), T0), SendTask)
    assert again.engine.engine_id == "e1"
    assert one(dropped(p, again, T0), DeliverResult).last


def test_a_responses_request_the_runtime_dropped_is_never_sent_again():
    p = make(retry_delay=0)
    join(p, "e1", "e2")
    effects = dropped(p, submit(p, response()), T0)
    assert not only(effects, SendTask)
    assert one(effects, DeliverResult).result.http_response.status_code == 502
    assert p.counters.retries == {}


def test_an_embedding_the_runtime_dropped_is_retried_like_a_chat():
    p = make(retry_delay=0)
    join(p, "e1", "e2")
    assert one(dropped(p, submit(p, embedding()), T0), SendTask).engine.engine_id == "e2"


def test_every_kind_of_failure_draws_on_one_budget_of_three_sends():
    """A lost engine, a busy runtime, an unreachable one: three sends in all, then the client
    gets the last answer in the same input."""
    p = make(retry_delay=0, max_attempts=3, busy_backoff=1.0)
    join(p, "e1", "e2", "e3")
    first = submit(p)
    second = one(p.close_route(first.route, "stream reset", T0), SendTask)
    third = one(p.receive_result(second.route, http(second.task.id, 503), T0), SendTask)
    assert [s.engine.engine_id for s in (first, second, third)] == ["e1", "e2", "e3"]
    effects = p.receive_result(third.route, agent_says(RuntimeFailure.UNREACHABLE, third.task.id), T0)
    last = one(effects, DeliverResult)
    assert not only(effects, SendTask) and last.last and last.retries == 2
    assert last.result.http_response.status_code == 503 and b"runtime_unreachable" in last.result.http_response.body
    assert p.counters.attempt_failures == {"engine_lost": 1, "runtime_busy": 1, "runtime_unreachable": 1}
    assert p.counters.retries == {"engine_lost": 1, "runtime_busy": 1}


def test_a_lost_engine_after_the_last_attempt_fails_at_once_with_a_stable_message_and_the_cause_in_the_detail():
    p = make(retry_delay=5.0, max_attempts=2)
    join(p, "e1", "e2")
    first = submit(p)
    p.close_route(first.route, "UNAVAILABLE Connection was closed cleanly.", T0)
    second = one(p.handle_timeout(T0 + 5), SendTask)
    failed = one(p.close_route(second.route, "UNAVAILABLE Connection was closed cleanly.", T0 + 6), FailRequest)
    assert (failed.status, failed.code, failed.retries) == (503, "engine_unavailable", 1)
    assert failed.message == ("The engine serving this request went away before it answered "
                              "(2 attempts failed); retry later.")
    assert "Connection was closed cleanly" in failed.detail


def test_a_route_that_refuses_a_retry_costs_no_attempt_and_counts_no_retry():
    p = make(retry_delay=0, max_attempts=2)
    join(p, "e1", "e2", "e3")
    first = submit(p)
    retry = one(p.close_route(first.route, "gone", T0), SendTask)
    assert p.counters.retries == {"engine_lost": 1}
    moved = one(p.dispatch_refused(retry.task.id, retry.route, T0), SendTask)
    assert moved.engine.engine_id != retry.engine.engine_id
    assert p.counters.retries == {"engine_lost": 1}
    delivered = one(p.receive_result(moved.route, http(moved.task.id), T0), DeliverResult)
    assert delivered.retries == 1


def test_a_failure_after_the_deadline_ends_the_request_at_once():
    p = make(retry_delay=0)
    join(p, "e1", "e2")
    sent = one(p.submit(task_id="a", tenant_id="t", request=chat(), origin="client", deadline=T0 + 1, now=T0),
               SendTask)
    assert one(dropped(p, sent, T0 + 1), DeliverResult).last


def test_a_peers_task_that_a_runtime_dropped_goes_back_to_the_peer_as_it_is():
    """The forwarding gateway holds the budget: it reads the agent's mark on the relayed answer."""
    p = make(retry_delay=0)
    join(p, "e1", "e2")
    sent = one(p.submit(task_id="fwd", tenant_id="t", request=chat(), origin="peer", target_engine_id="e1",
                        now=T0), SendTask)
    delivered = one(dropped(p, sent, T0), DeliverResult)
    assert delivered.result.infx_runtime_failure == worker_pb2.RUNTIME_DROPPED
    assert p.counters.attempt_failures == {}
