"""Draining (the gateway's SIGTERM) in the pure processor, on a hand-stepped clock: a task a peer's
engine can take goes there; one nothing left here can serve fails at once with 503 and Retry-After,
instead of waiting out the grace period."""

from __future__ import annotations

from protocol.processor.effects import FailRequest, SendTask, TaskQueued
from tests.support.processor import LOCAL, REMOTE, T0, chat, http, join, make, one, only, sent_to, submit


def test_during_a_drain_a_new_task_goes_to_a_peers_engine_not_to_a_local_one_told_to_go_away():
    p = make()
    join(p, "local", "m")
    join(p, "remote", "m", locality=REMOTE, route="peer-b")
    p.drain(T0)
    assert sent_to(submit(p, "a", now=T0 + 1)) == ["remote"]
    assert p.counters.drain_refusals == 0


def test_during_a_drain_a_task_no_peer_can_take_fails_at_once_with_503_and_retry_after():
    p = make(busy_retry_after=4.0, queue_timeout=30.0)
    join(p, "local", "m")
    drained = p.drain(T0)
    assert [e.task.request.WhichOneof("request") for e in only(drained, SendTask)] == ["go_away"]
    effects = submit(p, "a", now=T0 + 1)
    failure = one(effects, FailRequest)
    assert (failure.status, failure.retry_after) == (503, 4.0)
    assert "shutting down" in failure.message and "'m'" in failure.message
    assert not only(effects, TaskQueued) and not p.has_task("a")
    assert p.next_deadline() is None
    assert p.counters.drain_refusals == 1


def test_tasks_waiting_when_the_drain_starts_fail_at_once_unless_an_engine_serves_their_model():
    p = make(max_in_flight_per_engine=1, queue_timeout=30.0)
    join(p, "remote", "busy", locality=REMOTE, route="peer-b")
    assert sent_to(submit(p, "first", request=chat(model="busy"))) == ["remote"]
    assert not sent_to(submit(p, "waits-for-slot", request=chat(model="busy")))
    assert only(submit(p, "nobody-serves", request=chat(model="m")), TaskQueued)
    effects = p.drain(T0 + 1)
    assert [e.task_id for e in only(effects, FailRequest)] == ["nobody-serves"]
    assert p.has_task("waits-for-slot")
    # The slot it waited for frees up: it is served, drain or not.
    assert sent_to(p.receive_result("peer-b", http("first"), T0 + 2)) == ["remote"]


def test_a_retry_during_a_drain_that_finds_no_engine_fails_at_once():
    p = make(retry_delay=1.0)
    join(p, "remote", "m", locality=REMOTE, route="peer-b")
    submit(p, "a")
    p.drain(T0)
    p.close_route("peer-b", "peer went away", T0)
    failure = one(p.handle_timeout(T0 + 1), FailRequest)
    assert (failure.task_id, failure.status) == ("a", 503) and failure.retry_after is not None
    assert failure.retries == 0  # the retry was never sent: nothing took it


def test_without_a_drain_the_same_task_waits_for_an_engine():
    p = make()
    join(p, "local", "m", ready=False)
    assert only(submit(p, "a"), TaskQueued)
    assert not only(submit(p, "b"), FailRequest)
    assert p.engine("t", "local").locality is LOCAL
