"""The processor's (tenant, model) index of engines against a brute-force scan of every engine:
whatever engines come, change models or readiness, go away or leave with their route, routing
picks the engine the full scan would, and the served/known-model answers agree."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from protocol.openai import task_forms
from protocol.processor.core import Processor
from protocol.processor.engines import EngineRecord
from protocol.processor.tasks import TaskRecord
from protocol.processor.types import Locality, ProcessorConfig
from tests.support.processor import chat, engine_status

T0 = 10.0
TENANTS = ("t1", "t2")
MODELS = ("m1", "m2", "m3")
ENGINES = ("e1", "e2", "e3", "e4")


def brute_pick(p: Processor, task: TaskRecord) -> EngineRecord | None:
    """Least-in-progress over every engine of every tenant, filtered as routing filters."""
    best, best_rank = None, None
    for engine in p._engines.values():
        if engine.key.tenant_id != task.tenant_id or not engine.routable:
            continue
        if task.model not in {m.id for m in engine.status.models if m.is_ready} or p._slots.blocked(engine, False):
            continue
        if not task_forms.eligible(task.request, engine.status):
            continue
        rank = (engine.key.engine_id in task.avoid, engine.locality is not Locality.LOCAL,
                len(engine.in_flight), engine.key.engine_id)
        if best_rank is None or rank < best_rank:
            best, best_rank = engine, rank
    return best


def probe(tenant: str, model: str, avoid: set[str]) -> TaskRecord:
    return TaskRecord(id="probe", tenant_id=tenant, model=model, request=chat(model), header={}, origin=None,
                 streaming=False, deadline=T0 + 60, target="", avoid=avoid)


update = st.tuples(st.just("update"), st.sampled_from(TENANTS), st.sampled_from(ENGINES),
                   st.dictionaries(st.sampled_from(MODELS), st.booleans(), max_size=3), st.booleans(),
                   st.sampled_from(("r1", "r2")), st.sampled_from(list(Locality)))
remove = st.tuples(st.just("remove"), st.sampled_from(TENANTS), st.sampled_from(ENGINES))
close = st.tuples(st.just("close"), st.sampled_from(("r1", "r2")))
task = st.tuples(st.just("task"), st.sampled_from(TENANTS), st.sampled_from(MODELS))
go_away = st.tuples(st.just("go_away"))


@settings(max_examples=300, deadline=None)
@given(st.lists(st.one_of(update, remove, close, task, go_away), max_size=30),
       st.sets(st.sampled_from(ENGINES), max_size=2))
def test_the_index_routes_as_the_scan_of_every_engine_through_any_updates(ops, avoid):
    p = Processor(ProcessorConfig(max_in_flight_per_engine=2))
    tasks = 0
    for op in ops:
        kind = op[0]
        if kind == "update":
            _, tenant, engine_id, models, ready, route, locality = op
            status = engine_status(engine_id, *[m for m, r in models.items() if r], ready=ready,
                                   loading=[m for m, r in models.items() if not r])
            p.update_engine(f"{route}:{tenant}", tenant, status, locality, T0)
        elif kind == "remove" and p.engine(op[1], op[2]) is not None:
            p.remove_engine(op[1], op[2], "gone", T0)
        elif kind == "close":
            for tenant in TENANTS:
                p.close_route(f"{op[1]}:{tenant}", "closed", T0)
        elif kind == "task":
            tasks += 1
            p.submit(task_id=f"task-{tasks}", tenant_id=op[1], request=chat(op[2]), origin="client", now=T0)
        elif kind == "go_away":
            p.go_away(T0)
        for tenant in TENANTS:
            engines = [e for e in p._engines.values() if e.key.tenant_id == tenant]
            listed = {m.id for e in engines for m in e.status.models}
            assert p.known_models(tenant) == listed
            assert p.known_models(tenant, ready_only=True) == {
                m.id for e in engines if e.routable for m in e.status.models if m.is_ready}
            for model in MODELS:
                assert p.serves(tenant, model) == (model in listed)
                assert p.takes_http_request(tenant, model) == any(
                    task_forms.takes_http_request(e.status) and model in {m.id for m in e.status.models}
                    for e in engines)
                want = brute_pick(p, probe(tenant, model, avoid))
                got = p._dispatcher.pick(probe(tenant, model, avoid))
                assert (got and got.key) == (want and want.key)
    # Nothing is left in the index once every engine has gone.
    for route in ("r1", "r2"):
        for tenant in TENANTS:
            p.close_route(f"{route}:{tenant}", "closed", T0)
    assert p._engines.listing == {} and p._engines.ready_for == {}
