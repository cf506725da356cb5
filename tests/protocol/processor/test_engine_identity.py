"""Engine identity on one gateway, as pure code on a hand-stepped clock (issue 22 item 2).

A local engine's id belongs to one engine process (``EngineStatus.infx_instance``): the same
process on a new stream is a reconnect and takes over; another process under the same id is
refused on its own stream (the side that can fix it), counted, and never registered, while
the engine that holds the id keeps it. The holder is sent a heartbeat: if it does not answer
in ``clash_probe_timeout`` its stream died without a word, and it is closed so that the
newcomer's next attempt gets in. LLMariner's engines send no instance: for them a second
stream stays a reconnect, as before.
"""

from __future__ import annotations

import pytest

from protocol.pb import status_pb2
from protocol.processor.core import Processor
from protocol.processor.config import ProcessorConfig
from protocol.processor.effects import CloseEngine, LocalEnginesChanged, RefuseEngine, SendTask
from protocol.processor.keys import EngineKey, Locality
from tests.support.processor import chat, engine_status, http, one, only

T0 = 50.0
PROBE = 5.0


def status(engine_id: str, instance: str, *models: str) -> status_pb2.EngineStatus:
    reported = engine_status(engine_id, *(models or ("m",)))
    reported.infx_instance = instance
    return reported


def processor(**config: object) -> Processor:
    return Processor(ProcessorConfig(retry_delay=0, clash_probe_timeout=PROBE, **config))  # type: ignore[arg-type]


def join(p: Processor, route: str, instance: str, now: float = T0, engine_id: str = "gpu-0") -> list[object]:
    return list(p.update_engine(route, "t", status(engine_id, instance), Locality.LOCAL, now))


def submit(p: Processor, task_id: str, now: float = T0) -> list[object]:
    return list(p.submit(task_id=task_id, tenant_id="t", request=chat(), origin="client", now=now))


def test_another_process_under_a_taken_id_is_refused_on_its_own_stream_and_registers_nothing():
    p = processor()
    join(p, "stream-1", "proc-a")
    effects = join(p, "stream-2", "proc-b")
    refused = one(effects, RefuseEngine)
    assert (refused.route, refused.engine) == ("stream-2", EngineKey("t", "gpu-0"))
    assert "'gpu-0'" in refused.reason and "already connected" in refused.reason and "--engine-id" in refused.reason
    assert not only(effects, LocalEnginesChanged)
    assert p.counters.engine_id_clashes == 1
    assert p.engine("t", "gpu-0").route == "stream-1"
    assert [s.route for s in only(submit(p, "a"), SendTask)] == ["stream-1"]
    # The holder is asked whether it is alive: one heartbeat, on its own stream.
    [probe] = [s for s in only(effects, SendTask) if s.task.request.HasField("heartbeat")]
    assert probe.route == "stream-1" and probe.task.engine_id == "gpu-0"


def test_a_holder_that_answers_keeps_its_id_and_the_newcomer_stays_refused():
    p = processor()
    join(p, "stream-1", "proc-a")
    probe = one(join(p, "stream-2", "proc-b"), SendTask)
    assert p.receive_result("stream-1", http(probe.task.id), T0 + 1) == []
    assert p.next_deadline() is None  # nothing left to wait for
    assert p.handle_timeout(T0 + PROBE + 1) == []
    again = join(p, "stream-2", "proc-b", now=T0 + 10)
    assert one(again, RefuseEngine).route == "stream-2" and p.counters.engine_id_clashes == 2
    assert p.engine("t", "gpu-0").route == "stream-1"


def test_a_holder_whose_stream_died_without_a_word_is_closed_and_the_newcomer_gets_in_next_time():
    """A half-open connection: the engine restarted elsewhere, its old stream here never ended."""
    p = processor()
    join(p, "stream-1", "proc-a")
    submit(p, "a")
    join(p, "stream-2", "proc-b", now=T0 + 1)
    assert p.next_deadline() == T0 + 1 + PROBE
    assert p.handle_timeout(T0 + PROBE) == []
    effects = p.handle_timeout(T0 + 1 + PROBE)
    closed = one(effects, CloseEngine)
    assert closed.route == "stream-1" and "heartbeat" in closed.reason and p.engine("t", "gpu-0") is None
    joined = join(p, "stream-2", "proc-b", now=T0 + 7)
    assert not only(joined, RefuseEngine) and p.engine("t", "gpu-0").route == "stream-2"
    assert [(s.route, s.task.id) for s in only(joined, SendTask)] == [("stream-2", "a#2")]  # task a failed over


def test_a_holder_that_reconnects_while_probed_is_alive_and_its_new_stream_stays():
    """Its probe went on the old stream, which will never answer: the reconnect is the answer."""
    p = processor()
    join(p, "stream-1", "proc-a")
    join(p, "stream-2", "proc-b")
    join(p, "stream-3", "proc-a", now=T0 + 1)
    assert p.next_deadline() is None and p.handle_timeout(T0 + PROBE + 1) == []
    assert p.engine("t", "gpu-0").route == "stream-3"


def test_the_same_process_on_a_new_stream_is_a_reconnect_and_takes_over():
    p = processor()
    join(p, "stream-1", "proc-a")
    effects = join(p, "stream-2", "proc-a")
    assert not only(effects, RefuseEngine) and p.counters.engine_id_clashes == 0
    assert p.engine("t", "gpu-0").route == "stream-2"


def test_engines_that_send_no_instance_reconnect_as_llmariner_engines_always_did():
    p = processor()
    join(p, "stream-1", "")
    assert not only(join(p, "stream-2", ""), RefuseEngine)
    assert p.engine("t", "gpu-0").route == "stream-2"


@pytest.mark.parametrize("holder, newcomer", [("", "proc-b"), ("proc-a", "")])
def test_an_instance_against_none_is_another_process(holder, newcomer):
    p = processor()
    join(p, "stream-1", holder)
    assert one(join(p, "stream-2", newcomer), RefuseEngine).route == "stream-2"


def test_the_same_id_in_another_tenant_is_another_engine():
    p = processor()
    join(p, "stream-1", "proc-a")
    effects = p.update_engine("stream-2", "u", status("gpu-0", "proc-b"), Locality.LOCAL, T0)
    assert not only(effects, RefuseEngine)
    assert p.engine("u", "gpu-0").route == "stream-2" and p.engine("t", "gpu-0").route == "stream-1"


def test_a_holder_that_leaves_before_its_probe_is_due_ends_the_probe():
    p = processor()
    join(p, "stream-1", "proc-a")
    join(p, "stream-2", "proc-b")
    p.close_route("stream-1", "engine stream ended", T0 + 1)
    assert p.next_deadline() is None
    assert not only(join(p, "stream-2", "proc-b", now=T0 + 2), RefuseEngine)


def test_with_heartbeats_on_a_pending_heartbeat_is_the_probe_and_any_answer_clears_it():
    p = processor(heartbeat_interval=2.0)
    join(p, "stream-1", "proc-a")
    [round_one] = [s for s in only(p.handle_timeout(T0 + 2), SendTask) if s.task.request.HasField("heartbeat")]
    effects = join(p, "stream-2", "proc-b", now=T0 + 3)
    assert one(effects, RefuseEngine) and not only(effects, SendTask)  # the pending one serves
    p.receive_result("stream-1", http(round_one.task.id), T0 + 3.5)
    assert not only(p.handle_timeout(T0 + 3 + PROBE), CloseEngine)
    assert p.engine("t", "gpu-0").route == "stream-1"
