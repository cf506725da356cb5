"""Fair shares under random interleavings (issue #17): local and peers' (targeted) tasks of
several weighted callers, a peer's engine that reports its load, reserves, busy runtimes,
refused and failed sends, engines that flap, leave, miss heartbeats or come back on a new route,
go-away and drain.

After every input: the slots each caller holds are the tasks on engines (``slots_held``), every
engine's tasks are those routed to it, no task waits while an engine it may take has room, the
cap holds on local engines, and every accepted task ends exactly once."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from protocol.pb import status_pb2
from protocol.processor.core import Processor, TaskState
from protocol.processor.fair_queue import Criticality
from protocol.processor.types import DeliverResult, EngineKey, FailRequest, Locality, ProcessorConfig
from tests.support.processor import chat, engine_status, http

T0 = 1000.0
LOCAL_ENGINES = ("e1", "e2")
PEER_ROUTE = ("peer", "B")

_submit = st.tuples(st.just("submit"), st.sampled_from("ABC"), st.sampled_from(list(Criticality)),
                    st.sampled_from([1.0, 2.0]), st.sampled_from(["", "", "e1", "e2"]))
ops = st.lists(
    st.one_of(
        _submit, _submit, _submit, _submit, _submit,
        st.tuples(st.just("finish"), st.integers(0, 20)),
        st.tuples(st.just("finish"), st.integers(0, 20)),
        st.tuples(st.just("finish"), st.integers(0, 20)),
        st.tuples(st.just("busy"), st.integers(0, 20)),
        st.tuples(st.just("refuse"), st.integers(0, 20)),
        st.tuples(st.just("send_failed"), st.integers(0, 20)),
        st.tuples(st.just("cancel"), st.integers(0, 30)),
        st.tuples(st.just("wait"), st.sampled_from([0.5, 2.0, 20.0])),
        st.tuples(st.just("flap"), st.sampled_from(LOCAL_ENGINES)),
        st.tuples(st.just("reconnect"), st.sampled_from(LOCAL_ENGINES)),
        st.tuples(st.just("close"), st.sampled_from(LOCAL_ENGINES)),
        st.tuples(st.just("report"), st.integers(0, 4)),
        st.tuples(st.just("writable"),),
        st.tuples(st.just("go_away"),),
        st.tuples(st.just("drain"),),
        st.tuples(st.just("peer_engine_gone"),),
        st.tuples(st.just("heartbeat_replies"),),
    ),
    min_size=10,
    max_size=60,
)


def _room_for(p: Processor, task: object) -> str | None:
    """An engine ``task`` may take now by the processor's own rules, or None."""
    engine = p._dispatcher.pick(task)  # type: ignore[arg-type]
    return None if engine is None else engine.key.engine_id


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops, st.sampled_from([2, 3]), st.sampled_from([0, 1, 2]), st.sampled_from([0.0, 1.0]),
       st.sampled_from([None, 5.0]))
def test_fair_shares_hold_under_any_interleaving(script, cap, reserve, retry_delay, heartbeat):
    p = Processor(ProcessorConfig(max_in_flight_per_engine=cap, fair_reserve=reserve, queue_timeout=10,
                                  max_waiting_tasks=8, shed_waiting_threshold=2, retry_delay=retry_delay,
                                  heartbeat_interval=heartbeat, busy_backoff=1.0))
    now, n = T0, 0
    routes = {engine_id: f"route-{engine_id}" for engine_id in LOCAL_ENGINES}
    accepted: set[str] = set()
    ended: list[str] = []

    def apply(effects: list[object]) -> None:
        for e in effects:
            if isinstance(e, FailRequest) or (isinstance(e, DeliverResult) and e.last):
                ended.append(e.task_id)

    def join(engine_id: str) -> None:
        apply(p.update_engine(routes[engine_id], "t", engine_status(engine_id, "m"), Locality.LOCAL, now))

    def report(load: int) -> None:
        status = engine_status("r1", "m")
        status.models[0].runtime_load.CopyFrom(status_pb2.EngineStatus.RuntimeLoad(running_requests=load))
        apply(p.update_engine(PEER_ROUTE, "t", status, Locality.REMOTE, now))

    for engine_id in LOCAL_ENGINES:
        join(engine_id)
    report(0)

    def on_engines() -> list[object]:
        return sorted((t for t in p._tasks.values() if t.state in (TaskState.DISPATCHED, TaskState.STREAMING)),
                      key=lambda t: t.id)

    for op in script:
        kind = op[0]
        if kind == "submit":
            task_id = f"x{n}"
            n += 1
            accepted.add(task_id)
            origin = ("peer", "A") if op[4] else "client"
            apply(p.submit(task_id=task_id, tenant_id="t", request=chat("m"), origin=origin, flow=op[1],
                           criticality=op[2], weight=op[3], target_engine_id=op[4], now=now))
        elif kind in ("finish", "busy", "refuse", "send_failed") and on_engines():
            tasks = on_engines()
            task = tasks[op[1] % len(tasks)]
            if kind == "finish":
                apply(p.receive_result(task.route, http(task.wire_id), now))
            elif kind == "busy":
                apply(p.receive_result(task.route, http(task.wire_id, 503), now))
            elif kind == "refuse" and task.state is TaskState.DISPATCHED:
                apply(p.dispatch_refused(task.wire_id, task.route, now))
            elif kind == "send_failed" and task.state is TaskState.DISPATCHED:
                apply(p.dispatch_failed(task.wire_id, "connection lost", task.route, now))
        elif kind == "cancel":
            live = sorted(t for t in accepted if t not in ended)
            if live:
                task_id = live[op[1] % len(live)]
                ended.append(task_id)
                apply(p.cancel(task_id, now))
        elif kind == "wait":
            now += op[1]
            apply(p.handle_timeout(now))
        elif kind == "flap" and p.engine("t", op[1]) is not None:
            apply(p.update_engine(routes[op[1]], "t", engine_status(op[1], "m", ready=False), Locality.LOCAL, now))
            join(op[1])
        elif kind == "reconnect":
            # The engine comes back on a new stream; its tasks on the old one stay there.
            routes[op[1]] = f"{routes[op[1]]}+"
            join(op[1])
        elif kind == "close":
            apply(p.close_route(routes[op[1]], "stream closed", now))
            join(op[1])
        elif kind == "report":
            report(op[1])
        elif kind == "writable":
            for route in list(routes.values()):
                apply(p.route_writable(route, now))
        elif kind == "go_away":
            apply(p.go_away(now))
        elif kind == "drain":
            apply(p.drain(now))
        elif kind == "peer_engine_gone" and p.engine("t", "r1") is not None:
            apply(p.remove_engine("t", "r1", "peer reported it gone", now))
        elif kind == "heartbeat_replies":
            for control_id, control in list(p._control.items()):
                if control_id.startswith("infx-ctl-heartbeat"):
                    apply(p.receive_result(control.route, http(control_id), now))

        # Every accepted task ends once, and the live ones are exactly those not ended.
        assert len(ended) == len(set(ended)), f"a task ended twice: {ended}"
        assert {t for t in accepted if p.has_task(t)} == accepted - set(ended)
        # Slots held are the tasks on engines, per caller.
        held: dict[str, int] = {}
        for task in on_engines():
            held[task.flow] = held.get(task.flow, 0) + 1
        assert p.slots_held("t", "m") == held
        for key, engine in p._engines.items():
            assert engine.in_flight == {t.id for t in on_engines() if t.engine == key}
            if engine.locality is Locality.LOCAL:
                assert len(engine.in_flight) <= cap
        # Callers waiting are the tasks waiting, and a caller with neither is forgotten.
        waiting_tasks = [t for t in p._tasks.values() if t.state is TaskState.WAITING]
        assert p._slots.waiting_total == len(waiting_tasks) == sum(p.waiting_counts().values())
        waiting: dict[str, int] = {}
        for task in waiting_tasks:
            waiting[task.flow] = waiting.get(task.flow, 0) + 1
        shares = p._slots.shares._models.get(("t", "m"), {})
        assert {flow: share.waiting for flow, share in shares.items() if share.waiting} == waiting
        assert set(shares) == set(held) | set(waiting)
        # No task waits while an engine it may take has room.
        for task in [t for t in p._tasks.values() if t.state is TaskState.WAITING]:
            if task.target:
                engine = p._engines[EngineKey("t", task.target)]
                assert engine.routable
                assert p._slots.full(engine, p._slots.may_use_reserve(task)), f"{task.id} waits on {task.target} with room"
            else:
                assert _room_for(p, task) is None, f"{task.id} waits while {_room_for(p, task)} has room"
