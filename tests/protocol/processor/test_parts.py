"""The processor's parts alone, each with its own state and no Processor around it: the task
table (the life cycle enforced in one place, attempts, timers), the engine table (its index and
back-offs), control tasks, slots, a task's ending, and the dispatcher's choice."""

from __future__ import annotations

import itertools

import pytest

from protocol.pb import worker_pb2
from protocol.processor.control import ControlKind, ControlTasks
from protocol.processor.counters import ProcessorCounters
from protocol.processor.dispatcher import Dispatcher
from protocol.processor.endings import Endings
from protocol.processor.engines import EngineRecord, EngineTable
from protocol.processor.route_flow import RouteFlow
from protocol.processor.slots import Slots
from protocol.processor.tasks import TRANSITIONS, TaskOutcome, TaskRecord, TaskState, TaskTable
from protocol.processor.types import (
    CancelTaskOnEngine,
    DeliverResult,
    EngineKey,
    FailRequest,
    Locality,
    ProcessorConfig,
    ProcessorUsageError,
    SendTask,
)
from protocol.routing.router import Router
from tests.support.processor import chat, engine_status, http, only


def record(task_id: str = "a", tenant: str = "t", model: str = "m", target: str = "") -> TaskRecord:
    return TaskRecord(id=task_id, tenant_id=tenant, model=model, request=chat(model), header={}, origin="o",
                      streaming=False, deadline=100.0, target=target)


class Parts:
    """Every part wired as the processor wires them, for tests that drive one directly."""

    def __init__(self, **config: object) -> None:
        self.config = ProcessorConfig(**config)  # type: ignore[arg-type]
        self.counters = ProcessorCounters()
        self.tasks = TaskTable()
        self.engines = EngineTable()
        self.router = Router(self.config.routing)
        self.flow = RouteFlow(self.config.route_stuck_timeout)
        self.control = ControlTasks(self.config.control_task_prefix, self.engines)
        self.slots = Slots(self.config, self.tasks, self.engines, self.router, self.flow)
        self.endings = Endings(self.config, self.counters, self.tasks, self.slots, self.control)
        self.dispatcher = Dispatcher(self.config, self.counters, self.tasks, self.engines, self.slots, self.endings,
                                     self.router)

    def engine(self, engine_id: str, *models: str, local: bool = True) -> EngineRecord:
        key = EngineKey("t", engine_id)
        engine = EngineRecord(key, f"route-{engine_id}", Locality.LOCAL if local else Locality.REMOTE,
                              engine_status(engine_id, *models))
        self.engines.add(engine)
        self.engines.index(engine, frozenset(models), frozenset(models))
        self.router.engine_updated(key, frozenset(models), engine.status, local)
        return engine

    def task(self, task_id: str = "a", **fields: object) -> TaskRecord:
        task = record(task_id, **fields)  # type: ignore[arg-type]
        self.tasks.add(task)
        return task


# --- the task table -------------------------------------------------------------


def test_the_life_cycle_allows_exactly_the_transitions_it_draws():
    drawn = {(None, TaskState.WAITING), (None, TaskState.DISPATCHED),
             (TaskState.WAITING, TaskState.DISPATCHED),
             (TaskState.DISPATCHED, TaskState.STREAMING), (TaskState.DISPATCHED, TaskState.RETRY_PENDING),
             (TaskState.RETRY_PENDING, TaskState.DISPATCHED), (TaskState.RETRY_PENDING, TaskState.WAITING)}
    assert {(a, b) for a, targets in TRANSITIONS.items() for b in targets} == drawn
    table = TaskTable()
    for before, after in itertools.product([None, *TaskState], TaskState):
        task = record()
        task.state = before
        if (before, after) in drawn:
            table.move(task, after)
            assert task.state is after
        else:
            with pytest.raises(AssertionError, match="no transition"):
                table.move(task, after)
            assert task.state is before


def test_tasks_enter_and_leave_the_table_counted_per_tenant():
    table = TaskTable()
    a, b, c = record("a"), record("b"), record("c", tenant="u")
    for task in (a, b, c):
        table.add(task)
    assert (table.of_tenant("t"), table.of_tenant("u"), len(table)) == (2, 1, 3)
    table.move(a, TaskState.DISPATCHED)
    table.end(a)
    assert a.state is None and "a" not in table and table.get("a") is None and table.of_tenant("t") == 1
    with pytest.raises(ProcessorUsageError, match="no task 'a'"):
        table.require("a")
    assert table.require("b") is b


def test_each_attempt_has_its_own_wire_id_and_only_the_current_one_is_found():
    table = TaskTable()
    task = record("x")
    table.add(task)
    table.attempt_sent(task)
    assert task.wire_id == "x" and table.by_attempt("x") is task
    table.attempt_over(task)
    table.attempt_sent(task)
    assert task.wire_id == "x#2" and table.by_attempt("x") is None and table.by_attempt("x#2") is task
    # Another task whose id looks like the next attempt id: the attempt takes another.
    lookalike = record("x#3")
    table.add(lookalike)
    table.attempt_sent(lookalike)
    table.attempt_over(task)
    table.attempt_sent(task)
    assert task.wire_id == "x#3#2" and table.by_attempt("x#3") is lookalike


def test_a_task_has_one_live_timer_and_due_ones_come_in_time_order():
    table = TaskTable()
    a, b = record("a"), record("b")
    table.add(a)
    table.add(b)
    table.set_timer(a, 5.0)
    table.set_timer(b, 3.0)
    table.set_timer(a, 2.0)  # replaces a's 5.0
    assert table.next_timer() == 2.0
    assert [t.id for t in table.due(4.0)] == ["a", "b"]
    assert table.next_timer() is None  # a's superseded 5.0 is not a live timer
    table.set_timer(a, 9.0)
    table.end(a)
    assert list(table.due(10.0)) == [] and table.timers == []


# --- the engine table -------------------------------------------------------------


def test_the_model_index_follows_every_change_and_empties_when_engines_go():
    engines = EngineTable()
    e1 = EngineRecord(EngineKey("t", "e1"), "r", Locality.LOCAL, engine_status("e1", "m"))
    engines.add(e1)
    engines.index(e1, frozenset({"m", "n"}), frozenset({"m"}))
    assert engines.serves("t", "n") and engines.known_models("t") == {"m", "n"}
    assert engines.known_models("t", ready_only=True) == {"m"}
    e1.draining = True
    assert engines.known_models("t", ready_only=True) == set()
    engines.index(e1, frozenset({"n"}), frozenset({"n"}))
    assert not engines.serves("t", "m")
    engines.remove(e1)
    assert (engines.listing, engines.ready_for, engines.tenants(), len(engines)) == ({}, {}, [], 0)


def test_a_busy_back_off_ends_at_its_latest_time_only():
    engines = EngineTable()
    e1 = EngineRecord(EngineKey("t", "e1"), "r", Locality.LOCAL, engine_status("e1", "m"))
    engines.add(e1)
    engines.back_off(e1, 5.0)
    engines.back_off(e1, 3.0)  # an earlier end does not shorten it
    engines.back_off(e1, 8.0)
    assert list(engines.backoffs_over(6.0)) == [] and e1.busy_until == 8.0
    assert list(engines.backoffs_over(8.0)) == [e1] and e1.busy_until is None
    assert engines.next_backoff() is None


# --- control tasks ------------------------------------------------------------------


def test_control_tasks_carry_the_prefix_and_a_heartbeat_reply_proves_the_engine_alive():
    engines = EngineTable()
    e1 = EngineRecord(EngineKey("t", "e1"), "r1", Locality.LOCAL, engine_status("e1", "m"))
    engines.add(e1)
    control = ControlTasks("ctl-", engines)
    send = control.heartbeat(e1.key, "e1", "r1")
    assert isinstance(send, SendTask) and send.task.id == "ctl-heartbeat-1" and send.task.engine_id == "e1"
    e1.pending_heartbeat, e1.missed_heartbeats = send.task.id, 2
    control.probes[e1.key] = 9.0
    control.replied(send.task.id, control.get(send.task.id))
    assert (e1.pending_heartbeat, e1.missed_heartbeats, control.probes) == (None, 0, {})
    assert send.task.id not in control


def test_control_tasks_go_with_their_engine_or_their_route():
    control = ControlTasks("ctl-", EngineTable())
    request = worker_pb2.TaskRequest(go_away=worker_pb2.GoAwayRequest())
    a = control.send(ControlKind.GO_AWAY, EngineKey("t", "a"), "a", "r1", request)
    b = control.send(ControlKind.GO_AWAY, EngineKey("t", "b"), "b", "r2", request)
    control.probes[EngineKey("t", "a")] = 1.0
    control.forget_engine(EngineKey("t", "a"))
    assert a.task.id not in control and b.task.id in control and control.probes == {}
    control.forget_route("r2")
    assert control.items() == []


# --- slots -----------------------------------------------------------------------------


def test_a_slot_is_taken_at_dispatch_and_given_back_once_with_its_attempt():
    parts = Parts(max_in_flight_per_engine=1, fair_reserve=0)
    engine = parts.engine("e1", "m")
    task = parts.task("a")
    parts.tasks.attempt_sent(task)
    task.engine, task.route = engine.key, engine.route
    parts.slots.take(task, engine)
    assert engine.in_flight == {"a"} and parts.slots.full(engine) and parts.router.load(engine.key) == 0
    parts.slots.unassign(task)
    assert engine.in_flight == set() and not task.holds_slot and task.engine is None and task.wire_id == ""
    assert parts.slots.freed == {engine.key: None} and parts.slots.shares.held("t", "m") == {}
    parts.slots.unassign(task)  # again: nothing more to give back
    assert parts.slots.shares.held("t", "m") == {}


def test_waiting_is_counted_per_queue_and_in_all():
    parts = Parts()
    a, b = parts.task("a"), parts.task("b", target="e1")
    parts.slots.hold(0.0, a, parts.slots.model_queue(a))
    engine = parts.engine("e1", "m")
    parts.slots.hold(0.0, b, parts.slots.engine_queue(engine, "m"))
    assert parts.slots.waiting_total == 2 and parts.slots.waiting_counts() == {("t", "m"): 2}
    assert a.state is b.state is TaskState.WAITING and parts.tasks.next_timer() == ProcessorConfig().queue_timeout
    parts.slots.unwait(a)
    parts.slots.unwait(b, served=True)
    assert (parts.slots.waiting_total, parts.slots.waiting, parts.slots.waiting_on) == (0, {}, {})


def test_an_engine_on_a_blocked_route_is_full_and_the_reserve_is_for_the_least_served():
    parts = Parts(max_in_flight_per_engine=3, fair_reserve=1)
    engine = parts.engine("e1", "m")
    for task_id in ("a", "b"):
        task = parts.task(task_id)
        task.flow = "heavy"
        parts.slots.take(task, engine)
    assert not parts.slots.full(engine, may_use_reserve=True) and parts.slots.full(engine, may_use_reserve=False)
    light = record("c")
    light.flow = "light"
    assert parts.slots.may_use_reserve(light)
    parts.flow.block(engine.route, 0.0)
    assert parts.slots.full(engine) and parts.slots.blocked(engine, ignore_cap=False)
    assert not parts.slots.blocked(engine, ignore_cap=True)


# --- endings -----------------------------------------------------------------------------


def test_every_way_out_leaves_no_queue_slot_or_record_behind():
    parts = Parts()
    engine = parts.engine("e1", "m")
    waiting, dispatched = parts.task("w"), parts.task("d")
    parts.slots.hold(0.0, waiting, parts.slots.model_queue(waiting))
    parts.dispatcher.dispatch(0.0, dispatched, engine, [])
    effects: list[object] = []
    parts.endings.fail(waiting, 503, "no", effects)  # type: ignore[arg-type]
    parts.endings.end(dispatched, TaskOutcome.CANCELLED)
    assert len(parts.tasks) == 0 and parts.slots.waiting_total == 0 and engine.in_flight == set()
    assert parts.tasks.by_attempt("d") is None and parts.slots.shares.held("t", "m") == {}
    assert only(effects, FailRequest)[0].status == 503
    assert dict(parts.counters.outcomes) == {"failed": 1, "cancelled": 1}


def test_a_retrys_result_reaches_the_origin_under_the_tasks_own_id_and_a_slow_consumer_is_cut_off():
    parts = Parts(max_unconsumed_results=1)
    engine = parts.engine("e1", "m")
    task = parts.task("a")
    task.streaming = True
    task.attempt = 1  # the next send is the task's second attempt
    parts.dispatcher.dispatch(0.0, task, engine, [])
    assert task.wire_id == "a#2"
    effects: list[object] = []
    parts.endings.deliver(task, http("a#2"), False, effects)  # type: ignore[arg-type]
    (delivered,) = only(effects, DeliverResult)
    assert delivered.result.task_id == "a" and task.state is TaskState.STREAMING
    parts.endings.deliver(task, http("a#2", index=1), False, effects)  # type: ignore[arg-type]
    assert only(effects, FailRequest)[0].message == "client did not keep up: 1 results unread"
    assert only(effects, CancelTaskOnEngine)[0].cancelled_task_id == "a#2" and parts.counters.slow_consumers == 1


# --- the dispatcher ---------------------------------------------------------------------


def test_the_dispatcher_asks_the_policy_and_holds_back_what_cannot_take_the_task():
    parts = Parts(max_in_flight_per_engine=1, fair_reserve=0)
    local, remote = parts.engine("l", "m"), parts.engine("r", "m", local=False)
    task = parts.task("a")
    assert parts.dispatcher.pick(task) is local  # least_in_progress for a task without hints: local first
    parts.dispatcher.dispatch(0.0, parts.task("b"), local, [])
    assert parts.dispatcher.pick(task) is remote  # the local engine is at its cap: held back
    remote.busy_until = 5.0
    assert parts.dispatcher.pick(task) is None and parts.dispatcher.served_but_full(task)
    assert parts.dispatcher.pick(record("x", model="other")) is None


def test_a_waiting_task_takes_a_slot_freed_during_the_same_input():
    parts = Parts(max_in_flight_per_engine=1, fair_reserve=0)
    engine = parts.engine("e1", "m")
    first, second = parts.task("a"), parts.task("b")
    effects: list[object] = []
    parts.dispatcher.route(0.0, first, effects)  # type: ignore[arg-type]
    parts.dispatcher.route(0.0, second, effects)  # type: ignore[arg-type]
    assert second.state is TaskState.WAITING
    parts.endings.deliver(first, http("a"), True, effects)  # type: ignore[arg-type]
    parts.dispatcher.refill(0.0, effects)  # type: ignore[arg-type]
    assert [s.task.id for s in only(effects, SendTask)] == ["a", "b"] and engine.in_flight == {"b"}
    assert parts.slots.waiting == {} and parts.slots.freed == {}
