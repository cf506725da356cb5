"""A busy runtime is not a dead engine: the processor's rule for 503/429 answers, on a stepped clock.

A runtime's 503 or 429 before any result sends the task at once to another
engine with room; otherwise it waits in the queue, that engine gets nothing
before its ``Retry-After`` (or the default back-off), and when time runs out
the client gets the runtime's own answer. Losing an engine's stream stays the
other case (retries, then the gateway's own 503).
"""

from __future__ import annotations

import pytest

from protocol.pb import worker_pb2
from protocol.processor.core import Processor, TaskState
from protocol.processor.config import ProcessorConfig
from protocol.processor.effects import DeliverResult, FailRequest, SendTask, TaskQueued
from protocol.processor.errors import ProcessorUsageError
from protocol.processor.keys import Locality
from protocol.processor.requests import retry_after_seconds
from tests.support.processor import chat, engine_status, http, one, only

T0 = 1000.0


def make(**config: object) -> Processor:
    return Processor(ProcessorConfig(**config))  # type: ignore[arg-type]


def join(p: Processor, engine_id: str, *models: str, now: float = T0) -> list[object]:
    return list(p.update_engine(f"route-{engine_id}", "t", engine_status(engine_id, *models), Locality.LOCAL, now))


def submit(p: Processor, task_id: str, now: float = T0, **kw: object) -> list[object]:
    return list(p.submit(
        task_id=task_id,
        tenant_id="t",
        request=kw.pop("request", None) or chat(),
        origin="client",
        **kw,
        now=now,
    ))


def busy(task_id: str, code: int = 503, retry_after: str | None = None, body: bytes = b'{"error":"busy"}'
         ) -> worker_pb2.TaskResult:
    result = http(task_id, code, body=body)
    if retry_after is not None:
        result.http_response.header["Retry-After"].values.append(retry_after)
    result.http_response.header["X-Runtime"].values.append("ollama")
    return result


def sent(effects: list[object]) -> list[tuple[str, str]]:
    return [(e.task.id, e.engine.engine_id) for e in only(effects, SendTask)]


@pytest.mark.parametrize("code", [503, 429])
def test_a_busy_answer_sends_the_task_to_another_engine_with_room_at_once(code):
    p = make()
    join(p, "e1", "m")
    join(p, "e2", "m")
    assert sent(submit(p, "a")) == [("a", "e1")]
    assert sent(p.receive_result("route-e1", busy("a", code), T0 + 0.5)) == [("a#2", "e2")]
    assert p.counters.attempt_failures == {"runtime_busy": 1} and p.counters.retries == {"runtime_busy": 1}


def test_with_no_other_engine_the_task_waits_and_is_not_resent_before_retry_after():
    p = make(queue_timeout=30)
    join(p, "e1", "m")
    submit(p, "a")
    effects = p.receive_result("route-e1", busy("a", retry_after="4"), T0 + 1)
    assert effects == []  # no resend, no failure, and no scale-from-zero signal: the model is served
    assert p.task_state("a") is TaskState.WAITING
    assert p.next_deadline() == T0 + 5
    assert p.handle_timeout(T0 + 4.9) == []
    assert sent(p.handle_timeout(T0 + 5)) == [("a#2", "e1")]


def test_without_retry_after_the_default_back_off_applies():
    p = make(busy_backoff=2.5)
    join(p, "e1", "m")
    submit(p, "a")
    p.receive_result("route-e1", busy("a"), T0)
    assert p.next_deadline() == T0 + 2.5
    assert sent(p.handle_timeout(T0 + 2.5)) == [("a#2", "e1")]


@pytest.mark.parametrize("header, expected", [("0", 1.0), ("Wed, 21 Oct 2015 07:28:00 GMT", 1.0), ("3600", 60.0)])
def test_retry_after_is_floored_at_the_default_and_capped(header, expected):
    """``Retry-After: 0`` cannot make a busy loop, an HTTP-date reads as absent, an hour is capped."""
    p = make(busy_backoff=1.0, max_busy_backoff=60.0, queue_timeout=120)
    join(p, "e1", "m")
    submit(p, "a")
    p.receive_result("route-e1", busy("a", retry_after=header), T0)
    assert p.next_deadline() == T0 + expected


def test_new_tasks_wait_for_a_busy_engine_too_and_all_go_when_its_back_off_ends():
    p = make()
    join(p, "e1", "m")
    submit(p, "a")
    p.receive_result("route-e1", busy("a", retry_after="3"), T0)
    assert sent(submit(p, "b", now=T0 + 1)) == []
    assert p.waiting_task_ids("t", "m") == ["a", "b"]
    assert sent(p.handle_timeout(T0 + 3)) == [("a#2", "e1"), ("b", "e1")]


def test_when_the_queue_timeout_passes_the_client_gets_the_runtimes_own_answer():
    p = make(queue_timeout=10)
    join(p, "e1", "m")
    submit(p, "a")
    p.receive_result("route-e1", busy("a", retry_after="2"), T0)
    p.handle_timeout(T0 + 2)
    # Busy again on the second attempt: the wait is counted from the first busy answer.
    p.receive_result("route-e1", busy("a#2", retry_after="3", body=b'{"error":"still busy"}'), T0 + 2)
    # Then the runtime restarts: its model is not ready when the back-off ends.
    p.update_engine("route-e1", "t", engine_status("e1", loading=["m"]), Locality.LOCAL, T0 + 3)
    assert p.handle_timeout(T0 + 5) == []
    assert p.next_deadline() == T0 + 10
    delivered = one(p.handle_timeout(T0 + 10), DeliverResult)
    assert delivered.last and delivered.task_id == "a" and delivered.result.task_id == "a"
    answer = delivered.result.http_response
    assert (answer.status_code, answer.body) == (503, b'{"error":"still busy"}')
    assert retry_after_seconds(answer) == 3.0 and list(answer.header["X-Runtime"].values) == ["ollama"]
    assert not p.has_task("a")


def test_a_retry_after_past_the_wait_gives_the_runtimes_answer_at_once_unless_another_engine_has_room():
    p = make(queue_timeout=30)
    join(p, "e1", "m")
    submit(p, "a")
    delivered = one(p.receive_result("route-e1", busy("a", code=429, retry_after="45"), T0), DeliverResult)
    assert delivered.last and delivered.result.http_response.status_code == 429 and not p.has_task("a")
    join(p, "e2", "m")
    p.handle_timeout(T0 + 45)  # e1's back-off ends
    submit(p, "b", now=T0 + 50)
    assert sent(p.receive_result("route-e1", busy("b", retry_after="45"), T0 + 50)) == [("b#2", "e2")]


def test_the_tasks_deadline_also_ends_the_wait_with_the_runtimes_answer():
    p = make(queue_timeout=30)
    join(p, "e1", "m")
    submit(p, "a", deadline=T0 + 5)
    p.receive_result("route-e1", busy("a", code=429, retry_after="2"), T0)
    p.handle_timeout(T0 + 2)
    p.receive_result("route-e1", busy("a#2", code=429, retry_after="2"), T0 + 2)
    delivered = one(p.handle_timeout(T0 + 5), DeliverResult)
    assert delivered.last and delivered.result.http_response.status_code == 429


def test_an_engine_that_comes_back_after_its_back_off_serves_the_task():
    p = make(queue_timeout=30)
    join(p, "e1", "m")
    submit(p, "a")
    p.receive_result("route-e1", busy("a", retry_after="2"), T0)
    retry = one(p.handle_timeout(T0 + 2), SendTask)
    delivered = one(p.receive_result("route-e1", http(retry.task.id, body=b"ok"), T0 + 2), DeliverResult)
    assert delivered.last and delivered.result.http_response.body == b"ok"


def test_busy_answers_use_up_the_same_attempts_and_the_last_one_reaches_the_client_at_once():
    """Issue #22: busy answers were bounded only by the queue time (30 s of replays); they
    count against ``max_attempts`` like every other failure, and the client gets the
    runtime's own answer as soon as none is left."""
    p = make(max_attempts=3, queue_timeout=30, busy_backoff=1.0)
    join(p, "e1", "m")
    submit(p, "a")
    wire = "a"
    for second in range(1, 3):
        p.receive_result("route-e1", busy(wire), T0 + second - 1)
        wire = one(p.handle_timeout(T0 + second), SendTask).task.id
    last = one(p.receive_result("route-e1", busy(wire, retry_after="4"), T0 + 2.5), DeliverResult)
    assert last.last and last.result.http_response.status_code == 503 and last.retries == 2
    assert last.engine is not None and last.engine.engine_id == "e1"  # whose runtime said so, for the log
    assert p.counters.attempt_failures == {"runtime_busy": 3} and p.counters.retries == {"runtime_busy": 2}
    assert not p.has_task("a") and p.next_deadline() == T0 + 6.5  # only e1's back-off is left


def test_a_targeted_task_gets_the_busy_answer_at_once_so_the_forwarding_peer_decides():
    p = make()
    join(p, "e1", "m")
    join(p, "e2", "m")
    submit(p, "fwd", target_engine_id="e1")
    delivered = one(p.receive_result("route-e1", busy("fwd"), T0), DeliverResult)
    assert delivered.last and delivered.result.http_response.status_code == 503


def test_a_streaming_tasks_busy_answer_is_handled_the_same_way():
    p = make()
    join(p, "e1", "m")
    join(p, "e2", "m")
    submit(p, "a", request=chat(stream=True))
    assert sent(p.receive_result("route-e1", busy("a"), T0)) == [("a#2", "e2")]


def test_losing_the_engines_stream_is_still_engine_gone_not_busy():
    p = make(retry_delay=0, max_attempts=1)
    join(p, "e1", "m")
    submit(p, "a")
    failed = one(p.close_route("route-e1", "stream reset", T0), FailRequest)
    assert failed.status == 503 and p.counters.attempt_failures == {"engine_lost": 1}


def test_a_task_waiting_on_a_not_ready_model_is_held_and_signalled_for_the_scaler():
    """Engine present, model not ready (its runtime is loading or restarting): the task waits."""
    p = make(queue_timeout=30)
    p.update_engine("route-e1", "t", engine_status("e1", loading=["m"]), Locality.LOCAL, T0)
    assert one(submit(p, "a"), TaskQueued).model_id == "m"
    assert p.task_state("a") is TaskState.WAITING
    assert sent(join(p, "e1", "m", now=T0 + 3)) == [("a", "e1")]


def test_busy_backoff_must_be_positive_and_within_its_cap():
    with pytest.raises(ProcessorUsageError):
        ProcessorConfig(busy_backoff=0)
    with pytest.raises(ProcessorUsageError):
        ProcessorConfig(busy_backoff=5, max_busy_backoff=2)
