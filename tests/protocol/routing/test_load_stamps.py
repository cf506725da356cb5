"""Load without double counting: a runtime load report says which of the engine's gateway's sends
it includes (``tasks_received`` / ``tasks_ended``), and that gateway adds only the rest."""

from hypothesis import given
from hypothesis import strategies as st

from protocol.pb import status_pb2
from protocol.processor.core import Processor, ProcessorConfig, SendTask
from protocol.processor.keys import EngineKey, Locality
from protocol.routing.pools import Pools
from tests.support.processor import chat, engine_status, http, one

KEY = EngineKey("t", "e0")


def report(running, waiting=0, received=None, ended=None, slots=0):
    status = engine_status("e0", "m")
    status.infx_runtime_slots = slots
    load = status.models[0].runtime_load
    load.CopyFrom(status_pb2.EngineStatus.RuntimeLoad(running_requests=running, waiting_requests=waiting))
    if received is not None:
        load.tasks_received, load.tasks_ended = received, ended
    return status


def pools(local=True):
    p = Pools(spilled_tips=0)
    p.engine_updated(KEY, frozenset({"m"}), engine_status("e0", "m"), local)
    return p


def test_a_task_that_ended_after_the_reading_is_not_counted_again():
    p = pools()
    for _ in range(3):
        p.task_sent(KEY)
    p.task_left(KEY)
    # Read while all three ran; the report arrives after one of them ended.
    p.engine_updated(KEY, frozenset({"m"}), report(3, received=3, ended=0), True)
    assert p.load(KEY) == 2


def test_a_task_sent_after_the_reading_is_counted_on_top_of_it():
    p = pools()
    for _ in range(2):
        p.task_sent(KEY)
    p.engine_updated(KEY, frozenset({"m"}), report(1, waiting=0, received=1, ended=0), True)
    assert p.load(KEY) == 2
    p.task_sent(KEY)
    assert p.load(KEY) == 3


def test_without_a_stamp_or_for_a_peers_engine_the_report_replaces_the_count():
    """The rule of before: what the engine says, plus what was sent after the report came."""
    for local, stamped in ((True, False), (False, True)):
        p = pools(local)
        for _ in range(3):
            p.task_sent(KEY)
        p.task_left(KEY)
        p.engine_updated(KEY, frozenset({"m"}), report(3, received=3 if stamped else None, ended=0), local)
        assert p.load(KEY) == 3


def test_a_stamp_of_more_tasks_than_were_sent_is_another_streams_and_stops_subtraction():
    p = pools()
    p.task_sent(KEY)
    p.engine_updated(KEY, frozenset({"m"}), report(4, received=5, ended=1), True)
    assert p.load(KEY) == 4
    p.engine_updated(KEY, frozenset({"m"}), report(1, received=1, ended=0), True)  # no longer trusted
    assert p.load(KEY) == 1


def test_another_stream_stops_subtraction():
    p = pools()
    p.task_sent(KEY)
    p.task_sent(KEY)
    p.stream_changed(KEY)
    p.engine_updated(KEY, frozenset({"m"}), report(0, received=0, ended=0), True)
    assert p.load(KEY) == 2  # this processor's own two in flight


def test_the_runtime_slots_are_read_from_the_status():
    p = pools()
    p.engine_updated(KEY, frozenset({"m"}), report(0, slots=2), True)
    member = p.member(KEY)
    assert member is not None and member.slots == 2


@given(st.lists(st.tuples(st.sampled_from(["send", "end", "read", "report"]), st.integers(0, 3)), max_size=60))
def test_the_load_is_the_tasks_in_flight_whenever_the_runtime_counts_exactly_those(steps):
    """A runtime that runs exactly the gateway's tasks: whenever a stamped reading arrives, however
    late, the load routing counts is the tasks in flight (the reading's figure plus sends since, less ends since)."""
    p = pools()
    in_flight = sent = ended = 0
    reading = None
    for action, _ in steps:
        if action == "send":
            p.task_sent(KEY)
            in_flight, sent = in_flight + 1, sent + 1
        elif action == "end" and in_flight:
            p.task_left(KEY)
            in_flight, ended = in_flight - 1, ended + 1
        elif action == "read":
            reading = (in_flight, sent, ended)
        elif action == "report" and reading is not None:
            running, received, done = reading
            p.engine_updated(KEY, frozenset({"m"}), report(running, received=received, ended=done), True)
            assert p.load(KEY) == in_flight


def test_through_the_processor_a_task_that_ended_before_its_report_came_is_counted_once():
    """A conversation's engine that counted its ended turn again would near its bound and push the
    next turn off its cache (issue #24: 4-13 of 216 later turns moved so)."""
    processor = Processor(ProcessorConfig())
    processor.update_engine(("route", "e0"), "t", engine_status("e0", "m"), Locality.LOCAL, 0.0)
    sent = one(processor.submit(now=0.0, task_id="a", tenant_id="t", request=chat(), origin="o"), SendTask)
    processor.receive_result(sent.route, http("a"), 0.1)
    processor.update_engine(("route", "e0"), "t", report(1, received=1, ended=0), Locality.LOCAL, 0.2)
    assert processor._router.load(EngineKey("t", "e0")) == 0


def test_peers_get_the_gateways_count_in_place_of_the_reading_and_its_stamp():
    """The engine's gateway relays its exact count: the reading (3 running) brought up to now (one of
    them ended since, one more was sent), without the stamp that counts a stream peers never see."""
    p = pools()
    for _ in range(3):
        p.task_sent(KEY)
    p.engine_updated(KEY, frozenset({"m"}), report(3, waiting=0, received=3, ended=0), True)
    p.task_left(KEY)
    p.task_sent(KEY)
    relayed = report(3, waiting=0, received=3, ended=0)
    p.exact_load(KEY, relayed)
    load = relayed.models[0].runtime_load
    assert load.running_requests == 3 and not load.HasField("tasks_received") and not load.HasField("tasks_ended")
    peer = pools(local=False)
    peer.engine_updated(KEY, frozenset({"m"}), relayed, False)
    assert peer.load(KEY) == 3
    unstamped = report(5)
    p.exact_load(KEY, unstamped)
    assert unstamped.models[0].runtime_load.running_requests == 5  # nothing to bring up to date
