"""Backpressure in the processor, on a hand-stepped clock (issue #13, item 4).

A route whose stream is not draining counts as full: routing skips its
engines, a task the route refused at its queue cap is routed again with no
retry counted, the route gets tasks again once it drains, and a route blocked
past ``route_stuck_timeout`` is closed with its tasks failing over.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from protocol.gateway.core import GatewayCore
from protocol.gateway.effects import CoreConfig
from protocol.processor.core import Processor, TaskState
from protocol.processor.route_flow import RouteFlow
from protocol.processor.config import ProcessorConfig
from protocol.processor.effects import CancelTaskOnEngine, CloseRoute, EnginesRemoved, FailRequest, SendTask, TaskQueued
from protocol.processor.errors import ProcessorUsageError
from protocol.processor.keys import Locality
from tests.support.processor import chat, engine_status, http, one, only

LOCAL = Locality.LOCAL
REMOTE = Locality.REMOTE
T0 = 1000.0


def make(**config: object) -> Processor:
    config.setdefault("retry_delay", 0.0)
    return Processor(ProcessorConfig(**config))  # type: ignore[arg-type]


def join(p: Processor, engine_id: str, *models: str, route: str | None = None, locality: Locality = LOCAL,
         now: float = T0) -> list[object]:
    return list(p.update_engine(route or f"route-{engine_id}", "t", engine_status(engine_id, *models), locality, now))


def submit(p: Processor, task_id: str, now: float = T0, **kw: object) -> list[object]:
    return list(p.submit(task_id=task_id, tenant_id="t", request=chat("m"), origin="client", **kw, now=now))


def sent(effects: list[object]) -> list[tuple[str, str]]:
    return [(e.task.id, e.engine.engine_id) for e in only(effects, SendTask)]


def test_stuck_timeout_must_be_positive_or_none():
    with pytest.raises(ProcessorUsageError, match="route_stuck_timeout"):
        make(route_stuck_timeout=0)
    assert make(route_stuck_timeout=None).next_deadline() is None


def test_a_blocked_route_gets_no_tasks_and_they_go_to_a_draining_engine():
    p = make()
    join(p, "e1", "m")
    join(p, "e2", "m")
    p.route_blocked("route-e1", T0)
    assert sent(submit(p, "a") + submit(p, "b")) == [("a", "e2"), ("b", "e2")]


def test_with_every_route_blocked_tasks_wait_and_a_drain_dispatches_them_oldest_first():
    p = make()
    join(p, "e1", "m")
    p.route_blocked("route-e1", T0)
    waiting = submit(p, "a") + submit(p, "b")
    assert not only(waiting, SendTask)
    # A served model that waits for a drain is not a missing model: the scaler hears nothing.
    assert not only(waiting, TaskQueued)
    assert p.waiting_task_ids("t", "m") == ["a", "b"]
    assert sent(p.route_writable("route-e1", T0 + 1)) == [("a", "e1"), ("b", "e1")]
    assert p.waiting_task_ids("t", "m") == []


def test_writable_for_a_route_that_was_not_blocked_dispatches_nothing():
    p = make()
    join(p, "e1", "m")
    assert p.route_writable("route-e1", T0) == []
    assert p.route_writable("never-seen", T0) == []


def test_a_refused_task_is_routed_again_without_counting_a_retry_or_avoiding_the_engine():
    p = make(max_attempts=1)
    join(p, "e1", "m")
    join(p, "e2", "m")
    assert sent(submit(p, "a")) == [("a", "e1")]
    # e1's route is at its queue cap: the task moves on to e2 at once, even with no other attempt allowed.
    moved = p.dispatch_refused("a", "route-e1", T0)
    assert sent(moved) == [("a#2", "e2")]
    assert not only(moved, FailRequest)
    assert not p.counters.retries and not p.counters.attempt_failures
    assert p.engine("t", "e1").in_flight == 0
    # The refusal blocks e1's route until it drains.
    assert sent(submit(p, "b")) == [("b", "e2")]
    p.route_writable("route-e1", T0 + 1)
    assert sent(submit(p, "c", now=T0 + 1)) == [("c", "e1")]


def test_a_refused_task_with_nowhere_to_go_waits_and_is_sent_once_the_route_drains():
    p = make()
    join(p, "e1", "m")
    assert sent(submit(p, "a")) == [("a", "e1")]
    assert sent(p.dispatch_refused("a", "route-e1", T0)) == []
    assert p.task_state("a") is TaskState.WAITING
    assert sent(p.route_writable("route-e1", T0 + 1)) == [("a#2", "e1")]


def test_a_stale_refusal_only_blocks_the_route():
    p = make()
    join(p, "e1", "m")
    join(p, "e2", "m")
    submit(p, "a")
    p.receive_result("route-e1", http("a"), T0)
    assert p.dispatch_refused("a", "route-e1", T0) == []
    assert sent(submit(p, "b")) == [("b", "e2")]


def test_a_targeted_task_for_an_engine_on_a_blocked_route_fails_at_once_for_the_peer_to_retry():
    p = make()
    join(p, "e1", "m")
    p.route_blocked("route-e1", T0)
    failed = one(submit(p, "a", target_engine_id="e1"), FailRequest)
    assert failed.status == 503 and "not draining" in failed.message and failed.retry_after is not None


@pytest.mark.parametrize("cap", [None, 1])
def test_a_targeted_task_its_engines_route_refused_fails_for_the_peer_to_retry_and_never_moves(cap):
    """A peer's task is for its engine only: refused by that engine's route, it neither goes to
    another engine (which the peer did not choose) nor waits in the model's queue (with a cap,
    where it ended with a KeyError on leaving it); it fails 503 at once, as on arrival."""
    p = make(max_in_flight_per_engine=cap, busy_retry_after=3)
    join(p, "e1", "m")
    join(p, "e2", "m")
    if cap:
        assert sent(submit(p, "a")) == [("a", "e1")]  # e1 is full: no other engine has room
    assert sent(submit(p, "fwd", target_engine_id="e2")) == [("fwd", "e2")]
    effects = p.dispatch_refused("fwd", "route-e2", T0)
    assert sent(effects) == []
    failed = one(effects, FailRequest)
    assert (failed.task_id, failed.status, failed.retry_after) == ("fwd", 503, 3) and "not draining" in failed.message
    assert not p.has_task("fwd") and p.waiting_counts() == {} and p.engine("t", "e2").in_flight == 0
    assert p.slots_held("t", "m") == ({"": 1} if cap else {})


def test_a_route_blocked_past_the_timeout_is_closed_and_its_tasks_fail_over():
    p = make(route_stuck_timeout=10.0)
    join(p, "e1", "m")
    join(p, "e2", "m")
    assert sent(submit(p, "a")) == [("a", "e1")]
    p.route_blocked("route-e1", T0 + 1)
    assert p.next_deadline() == T0 + 11
    assert p.handle_timeout(T0 + 10.9) == []
    effects = p.handle_timeout(T0 + 11)
    assert one(effects, CloseRoute) == CloseRoute("route-e1", "stream not draining for 10s")
    assert one(effects, EnginesRemoved).engines[0].engine_id == "e1"
    assert sent(effects) == [("a#2", "e2")]
    assert p.engine("t", "e1") is None
    # The stream's own end, reported later by the adapter, is harmless.
    assert sent(p.close_route("route-e1", "engine stream ended", T0 + 12)) == []


def test_a_drain_restarts_the_stuck_clock_so_a_slow_reader_is_not_closed():
    p = make(route_stuck_timeout=10.0)
    join(p, "e1", "m")
    for second in range(0, 60, 5):
        p.route_blocked("route-e1", T0 + second)
        assert not only(p.handle_timeout(T0 + second + 4), CloseRoute)
        p.route_writable("route-e1", T0 + second + 4)
    assert p.engine("t", "e1") is not None
    assert p.next_deadline() is None


def test_a_repeated_block_report_keeps_the_first_time():
    p = make(route_stuck_timeout=10.0)
    join(p, "e1", "m")
    p.route_blocked("route-e1", T0)
    p.route_blocked("route-e1", T0 + 9)
    assert only(p.handle_timeout(T0 + 10), CloseRoute)


def test_routes_stuck_together_are_all_closed_and_no_task_fails_over_onto_one_of_them():
    p = make(route_stuck_timeout=3.0)
    join(p, "e1", "m")
    join(p, "e2", "m")
    submit(p, "a")
    p.route_blocked("route-e1", T0)
    p.route_blocked("route-e2", T0)
    effects = p.handle_timeout(T0 + 3)
    assert [e.route for e in only(effects, CloseRoute)] == ["route-e1", "route-e2"]
    assert sent(effects) == []
    assert p.task_state("a") is TaskState.WAITING


def test_a_stuck_peer_route_takes_all_its_remote_engines_with_it():
    p = make(route_stuck_timeout=5.0)
    join(p, "r1", "m", route="peer", locality=REMOTE)
    join(p, "r2", "m", route="peer", locality=REMOTE)
    join(p, "e1", "m")
    p.route_blocked("route-e1", T0)
    assert sent(submit(p, "a")) == [("a", "r1")]
    p.route_blocked("peer", T0)
    effects = p.handle_timeout(T0 + 5)
    assert [e.route for e in only(effects, CloseRoute)] == ["route-e1", "peer"]
    assert p.engine("t", "r1") is None and p.engine("t", "r2") is None and p.engine("t", "e1") is None
    # Its task fails over like any lost engine's: with no engine left it waits for one.
    assert not only(effects, FailRequest) and one(effects, TaskQueued).task_id == "a"


def test_a_closed_route_is_forgotten_and_its_reconnected_engine_is_not_blocked():
    p = make(route_stuck_timeout=5.0)
    join(p, "e1", "m", route="old")
    p.route_blocked("old", T0)
    p.close_route("old", "engine stream ended", T0)
    assert p.next_deadline() is None
    join(p, "e1", "m", route="new")
    assert sent(submit(p, "a")) == [("a", "e1")]


def test_route_flow_takes_stuck_routes_in_the_order_they_blocked():
    flow = RouteFlow(stuck_after=2.0)
    flow.block("b", 1.0)
    flow.block("a", 0.5)
    flow.block("c", 5.0)
    assert flow.next_deadline() == 2.5
    assert flow.stuck(3.0) == ["a", "b"]
    assert flow.unblock("a") and not flow.unblock("a")
    assert "c" in flow and len(flow) == 2
    assert RouteFlow(stuck_after=None).stuck(1e9) == []


_ops = st.lists(
    st.tuples(st.sampled_from(["submit", "block", "writable", "refuse", "result", "tick"]),
              st.sampled_from(["e1", "e2"])),
    max_size=40,
)


@settings(max_examples=200, deadline=None)
@given(_ops)
def test_no_task_is_ever_sent_on_a_blocked_route_and_every_task_ends_or_is_live(ops):
    """Whatever the order of blocks, drains, refusals and results, no SendTask goes to a
    route the processor was told is blocked, and every accepted task is either live or
    ended exactly once."""
    p = make(route_stuck_timeout=3.0, queue_timeout=5.0)
    join(p, "e1", "m")
    join(p, "e2", "m")
    blocked: set[str] = set()
    now = T0
    ended: list[str] = []
    accepted: list[str] = []

    def perform(effects: list[object]) -> None:
        for effect in effects:
            if isinstance(effect, SendTask):
                assert effect.route not in blocked
            elif isinstance(effect, CloseRoute):
                blocked.discard(str(effect.route))
            elif isinstance(effect, FailRequest):
                ended.append(effect.task_id)
        for effect in effects:
            if hasattr(effect, "last") and effect.last:
                ended.append(effect.task_id)

    for n, (op, engine_id) in enumerate(ops):
        route = f"route-{engine_id}"
        if op == "submit":
            accepted.append(f"t{n}")
            perform(submit(p, f"t{n}", now=now))
        elif op == "block":
            blocked.add(route)
            perform(p.route_blocked(route, now))
        elif op == "writable":
            blocked.discard(route)
            perform(p.route_writable(route, now))
        elif op == "refuse" and accepted:
            wire_id = next((w for w in (f"{t}#{k}" if k > 1 else t for t in accepted for k in range(1, 4))
                            if p.attempt_owner(w) is not None), None)
            if wire_id is not None:
                blocked.add(route)
                perform(p.dispatch_refused(wire_id, route, now))
        elif op == "result" and accepted:
            for task_id in accepted:
                if p.has_task(task_id) and p.task_state(task_id) is TaskState.DISPATCHED:
                    engines = p.status()["tenants"].get("t", {}).get("engines", {})
                    engine = next(e for e, view in engines.items() if task_id in view["tasks"])
                    wire = next(w for w in [task_id] + [f"{task_id}#{k}" for k in range(2, 9)]
                                if p.attempt_owner(w) == task_id)
                    perform(p.receive_result(f"route-{engine}", http(wire), now))
                    break
        elif op == "tick":
            now += 2.0
            perform(p.handle_timeout(now))
    for task_id in accepted:
        assert ended.count(task_id) == (0 if p.has_task(task_id) else 1)


def test_a_cancel_left_unsent_because_its_task_was_withdrawn_is_forgotten():
    """The adapter took the task back from its route's queue instead of sending the cancel:
    the cancel is reported not sent, so the processor awaits no answer to it (an engine's
    reply with its id would be ignored as for any ended task) and holds nothing for it."""
    p = make()
    join(p, "e1", "m")
    assert sent(submit(p, "a")) == [("a", "e1")]
    (cancel,) = only(p.cancel("a", T0 + 1), CancelTaskOnEngine)
    assert cancel.cancelled_task_id == "a"
    core = GatewayCore(p, CoreConfig(pod_name="gw"), random.Random(0))
    assert core.cancel_unsent("route-e1", cancel.task.id, T0 + 1) == []
    p.receive_result("route-e1", http(cancel.task.id, 501), T0 + 2)
    assert p.counters.results_ignored == 1
