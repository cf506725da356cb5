"""cap_at_runtime_slots: a local engine that reports its runtime's slots holds at most that many tasks,
and the rest wait in the gateway's fair queue (issue #24); peers' engines and silent engines are not capped."""

from protocol.processor.core import Processor, ProcessorConfig, SendTask
from protocol.processor.keys import Locality
from tests.support.processor import chat, engine_status, http, one, only


def gateway(slots=2, locality=Locality.LOCAL, cap=True):
    processor = Processor(ProcessorConfig(cap_at_runtime_slots=cap))
    status = engine_status("e0", "m")
    status.infx_runtime_slots = slots
    processor.update_engine(("route", "e0"), "t", status, locality, 0.0)
    return processor


def submit(processor, task_id):
    return processor.submit(now=0.0, task_id=task_id, tenant_id="t", request=chat(), origin="o")


def test_a_third_task_waits_for_one_of_the_two_slots_and_takes_it_when_it_frees():
    processor = gateway()
    first = one(submit(processor, "a"), SendTask)
    one(submit(processor, "b"), SendTask)
    assert not only(submit(processor, "c"), SendTask)  # waits here, not inside the full runtime
    effects = processor.receive_result(first.route, http("a"), 0.1)
    assert one(effects, SendTask).task.id == "c"


def test_a_peers_engine_an_engine_without_slots_and_the_option_off_are_not_capped():
    for processor in (gateway(locality=Locality.REMOTE), gateway(slots=0), gateway(cap=False)):
        for n in range(4):
            one(submit(processor, f"t{n}"), SendTask)
