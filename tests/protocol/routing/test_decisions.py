"""How each routed task was placed (RoutingDecision), as the operator page and metrics count it:
a turn on the engine holding its prefix is a prefix hit, a first turn at its ring home is home,
one moved off its home by bounded load is a spill, load-only routing is load, and a task a peer
forwarded is counted by the peer that placed it, not here."""

from protocol.pb import status_pb2
from protocol.processor.core import Processor, ProcessorConfig, SendTask
from protocol.processor.keys import Locality
from protocol.routing.router import RoutingConfig, RoutingPolicy
from tests.support.processor import chat, embedding, engine_status, http, one
from tests.support.routing import ENGINES, conversation


def gateway(local: bool, **routing) -> Processor:
    """A gateway whose engines are all attached to it (``local``) or all a peer's."""
    processor = Processor(ProcessorConfig(routing=RoutingConfig(**routing)))
    for engine_id in ENGINES:
        processor.update_engine(("route", engine_id), "t", engine_status(engine_id, "m"),
                                Locality.LOCAL if local else Locality.REMOTE, 0.0)
    return processor


def busy(engine_id: str) -> status_pb2.EngineStatus:
    status = engine_status(engine_id, "m")
    status.models[0].runtime_load.running_requests = 10
    return status


def send(processor: Processor, task_id: str, hints) -> SendTask:
    return one(processor.submit(now=0.0, task_id=task_id, tenant_id="t", request=chat(), origin="o", hints=hints),
               SendTask)


def home_of(hints) -> str:
    return send(gateway(local=False), "probe", hints).engine.engine_id


def forward(engine_gateway: Processor, sent: SendTask) -> SendTask:
    """What the engine's gateway does with a forwarded task (as its receiver submits it)."""
    return one(engine_gateway.submit(now=0.0, task_id=sent.task.id, tenant_id="t", request=sent.task.request,
                                     origin="peer", target_engine_id=sent.engine.engine_id), SendTask)


def test_a_first_turn_is_home_and_the_next_turn_on_the_same_engine_a_prefix_hit():
    a = gateway(local=True)
    first = send(a, "turn-1", conversation(1))
    a.receive_result(first.route, http(first.task.id), 0.0)
    second = send(a, "turn-2", conversation(1, turns=2))
    assert second.engine == first.engine
    assert a.routing_decisions() == {("t", "m", "home"): 1, ("t", "m", "prefix_hit"): 1}


def test_a_turn_moved_off_its_busy_home_is_a_spill():
    hints = conversation(2)
    home = home_of(hints)
    a = gateway(local=False)
    a.update_engine(("route", home), "t", busy(home), Locality.REMOTE, 0.0)
    assert send(a, "spilled", hints).engine.engine_id != home
    assert a.routing_decisions() == {("t", "m", "spill"): 1}


def test_a_spilled_tip_a_peer_reported_makes_the_next_turn_a_prefix_hit_at_a_gateway_that_never_saw_it():
    first, second = conversation(3, turns=1), conversation(3, turns=2)
    home = home_of(first)
    a, b, c = gateway(local=False), gateway(local=True), gateway(local=False)
    a.update_engine(("route", home), "t", busy(home), Locality.REMOTE, 0.0)
    spilled = send(a, "turn-1", first)
    forward(b, spilled)
    status = next(s for _, s in b.local_engines() if s.engine_id == spilled.engine.engine_id)
    c.update_engine(("route", status.engine_id), "t", status, Locality.REMOTE, 0.0)
    assert send(c, "turn-2", second).engine.engine_id == spilled.engine.engine_id
    assert c.routing_decisions() == {("t", "m", "prefix_hit"): 1}
    # b only ran the task a placed: a counted it, b does not.
    assert b.routing_decisions() == {}


def test_tasks_without_hints_and_other_policies_are_placed_by_load():
    processor = Processor(ProcessorConfig(routing=RoutingConfig(policy=RoutingPolicy.LEAST_IN_PROGRESS)))
    processor.update_engine(("route", "e0"), "t", engine_status("e0", "m"), Locality.LOCAL, 0.0)
    one(processor.submit(now=0.0, task_id="x", tenant_id="t", request=chat(), origin="o",
                         hints=conversation(4)), SendTask)
    a = gateway(local=True)
    one(a.submit(now=0.0, task_id="y", tenant_id="t", request=embedding(), origin="o"), SendTask)
    assert processor.routing_decisions() == {("t", "m", "load"): 1}
    assert a.routing_decisions() == {("t", "m", "load"): 1}
