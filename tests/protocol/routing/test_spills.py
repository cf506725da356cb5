"""Spilled conversations known alike by every gateway (protocol/routing/spills.py): a turn that
bounded load moved off its ring home is told to the engine's gateway on the forwarded task, which
reports it with the engine's status, so another gateway sends the next turn where it is cached."""

from protocol.pb import status_pb2
from protocol.processor.core import Processor, ProcessorConfig, SendTask
from protocol.processor.types import EngineKey, Locality
from protocol.routing.config import RoutingConfig
from protocol.routing.spills import SpilledTips
from tests.support.processor import chat, engine_status, one
from tests.support.routing import ENGINES, conversation


def gateway(local: bool, **routing) -> Processor:
    """A gateway whose engines are all attached to it (``local``) or all a peer's."""
    processor = Processor(ProcessorConfig(routing=RoutingConfig(**routing)))
    for engine_id in ENGINES:
        processor.update_engine(("route", engine_id), "t", engine_status(engine_id, "m"),
                                Locality.LOCAL if local else Locality.REMOTE, 0.0)
    return processor


def busy(engine_id: str, running: int = 10) -> status_pb2.EngineStatus:
    status = engine_status(engine_id, "m")
    status.models[0].runtime_load.running_requests = running
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


def reported(engine_gateway: Processor, engine_id: str) -> status_pb2.EngineStatus:
    return next(s for _, s in engine_gateway.local_engines() if s.engine_id == engine_id)


def test_a_spill_to_a_peers_engine_carries_its_tip_and_a_turn_sent_home_carries_none():
    first = conversation(1)
    home = home_of(first)
    a = gateway(local=False)
    assert send(a, "calm", first).task.request.infx_prefix_tip == 0
    a.update_engine(("route", home), "t", busy(home), Locality.REMOTE, 0.0)
    sent = send(a, "spilled", first)
    assert sent.engine.engine_id != home
    assert sent.task.request.infx_prefix_tip == first.blocks[-1]


def test_the_engines_gateway_reports_the_tip_and_another_gateway_follows_it():
    first, second = conversation(2, turns=1), conversation(2, turns=2)
    home = home_of(first)
    a, b, c = gateway(local=False), gateway(local=True), gateway(local=False)
    a.update_engine(("route", home), "t", busy(home), Locality.REMOTE, 0.0)
    spilled = send(a, "turn-1", first)
    at_engine = forward(b, spilled)
    assert at_engine.engine.engine_id == spilled.engine.engine_id
    assert at_engine.task.request.infx_prefix_tip == 0  # the tip is for gateways, never for the engine
    status = reported(b, spilled.engine.engine_id)
    assert list(status.models[0].infx_prefix_tips) == [first.blocks[-1]]
    # Gateway c never saw the first turn and its home has room there; b's report tells it where it went.
    assert home_of(second) == home
    c.update_engine(("route", status.engine_id), "t", status, Locality.REMOTE, 0.0)
    assert send(c, "turn-2", second).engine.engine_id == spilled.engine.engine_id


def test_a_spill_to_a_local_engine_is_recorded_at_once_and_not_sent_to_the_engine():
    first = conversation(3)
    home = home_of(first)
    b = gateway(local=True)
    b.update_engine(("route", home), "t", busy(home), Locality.LOCAL, 0.0)
    sent = send(b, "turn-1", first)
    assert sent.engine.engine_id != home and sent.task.request.infx_prefix_tip == 0
    assert list(reported(b, sent.engine.engine_id).models[0].infx_prefix_tips) == [first.blocks[-1]]
    assert not any(m.infx_prefix_tips for e in ENGINES if e != sent.engine.engine_id
                   for m in reported(b, e).models)


def test_a_conversation_back_home_is_reported_there_and_the_deepest_tip_wins():
    first, second, third = (conversation(4, turns=t) for t in (1, 2, 3))
    home = home_of(first)
    b, c = gateway(local=True), gateway(local=False)
    b.update_engine(("route", home), "t", busy(home), Locality.LOCAL, 0.0)
    away = send(b, "turn-1", first).engine.engine_id
    b.update_engine(("route", home), "t", engine_status(home, "m"), Locality.LOCAL, 0.0)
    b.update_engine(("route", away), "t", busy(away), Locality.LOCAL, 0.0)
    # The spilled engine is full now: the turn goes back home, and since the tips place the
    # conversation elsewhere, home reports it too, deeper.
    assert send(b, "turn-2", second).engine.engine_id == home
    assert list(reported(b, home).models[0].infx_prefix_tips) == [second.blocks[-1]]
    for engine_id in (home, away):
        c.update_engine(("route", engine_id), "t", reported(b, engine_id), Locality.REMOTE, 0.0)
    assert send(c, "turn-3", third).engine.engine_id == home


def test_no_tips_are_shared_when_spilled_tips_is_zero():
    first = conversation(5)
    home = home_of(first)
    a, b = gateway(local=False, spilled_tips=0), gateway(local=True, spilled_tips=0)
    a.update_engine(("route", home), "t", busy(home), Locality.REMOTE, 0.0)
    b.update_engine(("route", home), "t", busy(home), Locality.LOCAL, 0.0)
    spilled_away = send(a, "spilled", first)
    assert spilled_away.engine.engine_id != home and spilled_away.task.request.infx_prefix_tip == 0
    sent = send(b, "spilled", first)
    assert not any(m.infx_prefix_tips for e in ENGINES for m in reported(b, e).models)
    assert sent.task.request.infx_prefix_tip == 0


def test_tips_are_bounded_per_engine_and_forgotten_with_their_engine():
    tips = SpilledTips(per_engine=3)
    local, remote = EngineKey("t", "e0"), EngineKey("t", "e1")
    for tip in range(1, 6):
        tips.record(local, "m", tip)
    status = engine_status("e1", "m")
    status.models[0].infx_prefix_tips.extend(range(10, 20))
    tips.reported(remote, status)
    assert len(tips) == 6
    assert tips.depths((1, 2, 3, 4, 5)) == {local: 5}  # 1 and 2 were evicted; 5 is the deepest
    assert tips.depths((17, 18, 19)) == {remote: 3} and tips.depths((16,)) == {}
    copy = engine_status("e0", "m", "other")
    tips.annotate(local, copy)
    assert [list(m.infx_prefix_tips) for m in copy.models] == [[3, 4, 5], []]
    tips.forget(local)
    tips.reported(remote, engine_status("e1", "m"))
    assert len(tips) == 0 and tips.depths((5, 19)) == {}
