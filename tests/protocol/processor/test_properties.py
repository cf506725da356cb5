"""Property test of the processor: random interleavings of engine joins, leaves and
readiness flips, results (in order, out of order, duplicated, 503s), client cancels,
slow consumers and clock steps, with infx and LLMariner engines and requests in
typed, verbatim or both forms. Every accepted task ends exactly once, nothing is
delivered out of order or after the end, every engine gets only a form it takes
(a verbatim body travels alone), and the internal books stay consistent;
with the caps on, no engine holds more than its cap, no slot stays idle while a task
it could serve waits, and a tenant is refused (429) only when it is itself at its cap."""

from __future__ import annotations

from collections import defaultdict

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from protocol.openai import task_forms
from protocol.processor.core import Processor, TaskState
from protocol.processor.types import (
    CancelTaskOnEngine,
    CloseEngine,
    DeliverResult,
    FailRequest,
    Locality,
    ProcessorConfig,
    SendTask,
)
from tests.support.processor import chat, engine_status, http, sse

ENGINES = ["e0", "e1", "e2"]
MODELS = ["m0", "m1"]
DEAF = "e2"  # the one engine that never answers heartbeats

join = st.tuples(st.just("join"), st.sampled_from(ENGINES), st.sets(st.sampled_from(MODELS)),
                 st.sampled_from([True, True, True, False]), st.sampled_from(list(Locality)), st.booleans())
# Tenant "u" has no engines: its tasks only wait, and must never crowd out tenant "t".
submit = st.tuples(st.just("submit"), st.sampled_from(MODELS), st.booleans(),
                   st.sampled_from([None, None, None, None, *ENGINES]), st.sampled_from([None, 5.0, 50.0]),
                   st.sampled_from(["t", "t", "t", "u"]), st.sampled_from(["typed", "typed", "both", "verbatim"]))
result = st.tuples(st.just("result"), st.integers(0, 50),
                   st.sampled_from(["next"] * 6 + ["last"] * 2 + ["skip", "dup", "503", "500"]))
OPS = {
    "join": join,
    "submit": submit,
    "result": result,
    "leave": st.tuples(st.just("leave"), st.sampled_from(ENGINES), st.booleans()),
    "cancel": st.tuples(st.just("cancel"), st.integers(0, 50)),
    "consume": st.tuples(st.just("consume"), st.integers(0, 50)),
    "send_failed": st.tuples(st.just("send_failed"), st.integers(0, 50)),
    "tick": st.tuples(st.just("tick"), st.sampled_from([0.5, 1.0, 1.0, 3.0, 3.0, 10.0, 40.0])),
    "go_away": st.tuples(st.just("go_away")),
    "drain": st.tuples(st.just("drain")),
}
# Weighted so that a typical script runs many tasks through to their results.
WEIGHTS = {"join": 2, "submit": 4, "result": 10, "leave": 1, "cancel": 1, "consume": 3, "send_failed": 1,
           "tick": 3, "go_away": 1, "drain": 1}
ops = st.sampled_from([kind for kind, weight in WEIGHTS.items() for _ in range(weight)]).flatmap(OPS.__getitem__)
# Two engines serve both models at the start, so that most scripts get tasks onto engines.
START = [("join", "e0", {"m0", "m1"}, True, Locality.LOCAL, True),
         ("join", "e1", {"m0", "m1"}, True, Locality.REMOTE, False)]


def request_in(form: str, model: str, stream: bool):
    """A request in one of the forms the gateway submits: typed only, typed + verbatim, verbatim only."""
    request = chat(model, stream)
    if form == "typed":
        return request
    if form == "verbatim":
        request = task_forms.routing_fields("chat_completion", model, stream)
        request.typed_request_incomplete = "the typed form refused it"
    else:
        request.chat_completion.user = "typed detail"
    request.http_request.path = "/v1/chat/completions"
    request.http_request.body = b'{"model":"%s"}' % model.encode()
    return request
script = st.lists(ops, min_size=20, max_size=100).map(lambda ops: START + ops)


class World:
    """The processor plus fake engines and clients that follow (or break) the protocol."""

    def __init__(self, config: ProcessorConfig) -> None:
        self.p = Processor(config)
        self.now = 0.0
        self.n = 0
        self.accepted: list[str] = []
        self.ended: dict[str, str] = {}
        self.delivered: dict[str, list[int]] = defaultdict(list)
        self.unconsumed: dict[str, int] = defaultdict(int)
        # What each fake engine has been asked to run: attempt (wire) id -> (route, engine id, next index).
        self.on_engine: dict[str, tuple[str, str, int]] = {}
        self.route_gen: dict[str, int] = defaultdict(int)
        self.tenant_of: dict[str, str] = {}
        self.form_of: dict[str, str] = {}
        self.capable: dict[str, bool] = {}

    def route(self, engine_id: str) -> str:
        return f"{engine_id}#{self.route_gen[engine_id]}"

    def apply(self, effects: list[object]) -> None:
        for effect in effects:
            if isinstance(effect, SendTask):
                request = effect.task.request
                kind = request.WhichOneof("request")
                if request.HasField("http_request"):
                    assert self.capable[effect.engine.engine_id], "a verbatim request sent to a LLMariner engine"
                    assert not request.chat_completion.user, "the typed details travel beside the verbatim body"
                elif kind == "chat_completion":
                    assert not request.typed_request_incomplete
                    task_id = effect.task.id.split("#")[0]
                    assert self.form_of.get(task_id, "typed") != "verbatim", "a task with no typed form sent typed"
                if kind == "chat_completion":
                    self.on_engine[effect.task.id] = (str(effect.route), effect.engine.engine_id, 0)
                elif kind == "heartbeat" and effect.engine.engine_id != DEAF:
                    self.apply(self.p.receive_result(effect.route, http(effect.task.id), self.now))
            elif isinstance(effect, DeliverResult):
                assert effect.task_id not in self.ended, f"result after the end of {effect.task_id}"
                indexes = self.delivered[effect.task_id]
                assert effect.result.result_index == len(indexes), "results out of order"
                indexes.append(effect.result.result_index)
                self.unconsumed[effect.task_id] += 1
                if effect.last:
                    self.end(effect.task_id, "completed")
            elif isinstance(effect, FailRequest):
                self.end(effect.task_id, f"failed {effect.status}")
            elif isinstance(effect, CancelTaskOnEngine):
                # The attempt it names is over (its task ended or moved on to another attempt).
                assert self.p.attempt_owner(effect.cancelled_task_id) is None, "an engine told to stop a live attempt"
            elif isinstance(effect, CloseEngine):
                self.p.close_route(effect.route, "closed", self.now)

    def end(self, task_id: str, how: str) -> None:
        assert task_id in self.accepted, f"unknown task {task_id} ended"
        assert task_id not in self.ended, f"{task_id} ended twice: {self.ended[task_id]}, then {how}"
        self.ended[task_id] = how
        for attempt in [a for a in self.on_engine if a == task_id or a.startswith(f"{task_id}#")]:
            del self.on_engine[attempt]

    def live_tasks(self) -> list[str]:
        return [t for t in self.accepted if t not in self.ended]

    def live(self, index: int) -> str | None:
        live = self.live_tasks()
        return live[index % len(live)] if live else None

    def step(self, op: tuple) -> None:  # type: ignore[type-arg]
        p, kind = self.p, op[0]
        if kind == "join":
            _, engine_id, models, ready, locality, capable = op
            status = engine_status(engine_id, *sorted(models), ready=ready)
            if capable:
                status.infx_capabilities.append(task_forms.HTTP_REQUEST_CAPABILITY)
            self.capable[engine_id] = capable
            self.apply(p.update_engine(self.route(engine_id), "t", status, locality, self.now))
        elif kind == "leave":
            _, engine_id, whole_stream = op
            if whole_stream:
                self.apply(p.close_route(self.route(engine_id), "stream ended", self.now))
                self.route_gen[engine_id] += 1
            elif p.engine_counts() and engine_id in p.status()["tenants"].get("t", {}).get("engines", {}):
                self.apply(p.remove_engine("t", engine_id, "left", self.now))
        elif kind == "submit":
            _, model, stream, target, timeout, tenant, form = op
            self.n += 1
            task_id = f"task{self.n}"
            live_before = sum(1 for t in self.live_tasks() if self.tenant_of[t] == tenant)
            self.accepted.append(task_id)
            self.tenant_of[task_id] = tenant
            self.form_of[task_id] = form
            deadline = None if timeout is None else self.now + timeout
            request = request_in(form, model, stream)
            effects = p.submit(
                task_id=task_id,
                tenant_id=tenant,
                request=request,
                origin="c",
                deadline=deadline,
                target_engine_id=target or "",
                now=self.now,
            )
            refused = any(isinstance(e, FailRequest) and e.status == 429 for e in effects)
            cap = p.config.max_tasks_per_tenant
            assert refused == (cap is not None and not target and live_before >= cap), "tenant cap misapplied"
            self.apply(effects)
        elif kind == "result":
            _, index, how = op
            if not self.on_engine:
                return
            task_id = sorted(self.on_engine)[index % len(self.on_engine)]
            route, _, nxt = self.on_engine[task_id]
            if how == "503":
                result = http(task_id, 503, index=nxt)
            elif how == "500":
                result = http(task_id, 500, index=nxt)
            elif nxt == 0:
                result = http(task_id, index={"skip": 1}.get(how, 0))
            else:
                result = sse(task_id, {"skip": nxt + 1, "dup": nxt - 1}.get(how, nxt), last=how == "last")
            self.on_engine[task_id] = (route, self.on_engine[task_id][1], nxt + 1)
            self.apply(p.receive_result(route, result, self.now))
        elif kind == "cancel":
            task_id = self.live(op[1])
            if task_id is not None:
                self.apply(p.cancel(task_id, self.now))
                self.end(task_id, "cancelled")
        elif kind == "consume":
            task_id = self.live(op[1])
            if task_id is not None and self.unconsumed[task_id]:
                p.results_consumed(task_id, self.unconsumed[task_id])
                self.unconsumed[task_id] = 0
        elif kind == "send_failed":
            task_id = self.live(op[1])
            if task_id is not None:  # possibly stale: the task may have moved on or got results
                route = self.on_engine[task_id][0] if task_id in self.on_engine else None
                self.apply(p.dispatch_failed(task_id, "write failed", route=route, now=self.now))
        elif kind == "tick":
            self.now += op[1]
            self.apply(p.handle_timeout(self.now))
            deadline = p.next_deadline()
            assert deadline is None or deadline > self.now, "a timer due now was not fired"
        elif kind == "go_away":
            self.apply(p.go_away(self.now))
        elif kind == "drain":
            self.apply(p.drain(self.now))
        self.check()

    def check(self) -> None:
        p = self.p
        for task_id in self.accepted:
            assert p.has_task(task_id) == (task_id not in self.ended)
        live = [t for t in self.accepted if t not in self.ended]
        waiting = sum(p.waiting_counts().values())
        assert waiting == sum(1 for t in live if p.task_state(t) is TaskState.WAITING)
        on_engines = sum(view.in_flight for view in (p.engine("t", e) for e in ENGINES) if view)
        assert on_engines == sum(1 for t in live if p.task_state(t) in (TaskState.DISPATCHED, TaskState.STREAMING))
        tenant_cap = p.config.max_tasks_per_tenant
        if tenant_cap is not None:
            for tenant in ("t", "u"):
                assert sum(1 for t in live if self.tenant_of[t] == tenant) <= tenant_cap
        engine_cap = p.config.max_in_flight_per_engine
        if engine_cap is not None:
            engines = p.status()["tenants"].get("t", {}).get("engines", {})
            assert all(len(e["tasks"]) <= engine_cap for e in engines.values()), "an engine over its cap"
        self.check_no_idle_slot()

    def check_no_idle_slot(self) -> None:
        """A task waits only while every engine that would take it is full or its runtime busy
        (or none would)."""
        p = self.p
        engine_cap = p.config.max_in_flight_per_engine
        if engine_cap is None:
            return
        engines = p.status()["tenants"].get("t", {}).get("engines", {})
        for model in MODELS:
            for task_id in p.waiting_task_ids("t", model):
                for engine_id, e in engines.items():
                    takes = e["ready"] and not e["draining"] and e["busy_until"] is None and (
                        p.config.dynamic_model_loading or any(m["id"] == model and m["ready"] for m in e["models"]))
                    takes = takes and (self.form_of[task_id] != "verbatim" or self.capable[engine_id])
                    assert not takes or len(e["tasks"]) >= engine_cap, f"{engine_id} has a free slot while tasks wait"


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(script, st.booleans(), st.sampled_from([0.0, 2.0]), st.sampled_from([None, 1, 2]),
       st.sampled_from([None, 3, 8]))
# A verbatim-only task waits for e1 (an infx engine at its cap of 1); e1 comes back as a LLMariner
# engine: the task went to it typed once task1 ended, rather than failing when e1 changed.
@example(START + [("join", "e1", {"m0"}, True, Locality.LOCAL, True),
                  ("submit", "m0", False, "e1", None, "t", "typed"),
                  ("submit", "m0", False, "e1", None, "t", "verbatim"),
                  ("join", "e1", {"m0"}, True, Locality.LOCAL, False),
                  ("result", 0, "next")], False, 0.0, 1, None)
def test_every_accepted_task_ends_exactly_once_whatever_the_interleaving(
        script, dynamic, retry_delay, engine_cap, tenant_cap):
    world = World(ProcessorConfig(queue_timeout=20, max_task_duration=100, retry_delay=retry_delay,
                                  max_unconsumed_results=4, dynamic_model_loading=dynamic,
                                  heartbeat_interval=15, heartbeat_max_missed=2, max_waiting_tasks=20,
                                  max_in_flight_per_engine=engine_cap, max_tasks_per_tenant=tenant_cap))
    for op in script:
        world.step(op)
    # Let time run out: every task has a deadline, so every task must end.
    for _ in range(5):
        deadline = world.p.next_deadline()
        if deadline is None:
            break
        world.now = max(world.now, deadline)
        world.apply(world.p.handle_timeout(world.now))
        world.check()
    world.now += 1000
    world.apply(world.p.handle_timeout(world.now))
    assert sorted(world.ended) == sorted(world.accepted)
    assert world.p.status()["tasks"] == 0
    assert sum(world.p.counters.outcomes.values()) == len(world.accepted)
