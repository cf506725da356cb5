"""The gateway core as pure code, on a hand-stepped clock: two cores back to back with a
hand-carried link, peers dialled and redialled on their deadlines, streams replaced by pod,
protocol violations ended with their status, request accounting, gone-versus-unknown models,
and the scaler's signals as effects."""

from __future__ import annotations


from typing import Any

import pytest

from protocol.backoff import Backoff
from protocol.gateway.core import Availability
from protocol.gateway.dialling import DialState
from protocol.gateway.effects import (
    CancelDial,
    CoreConfig,
    EndPeerStream,
    HalfCloseDial,
    ModelServed,
    OpenDial,
    PeerDialledBack,
    PeerDialledIn,
    PeerGone,
    PeerOneWay,
    PeerRequests,
    ReportLoad,
    RequestDispatched,
    RequestFinished,
    RequestStarted,
    SendOnDial,
    TaskReleased,
)
from protocol.grpc import StatusCode
from protocol.openai.errors import ModelNotFoundError
from protocol.pb import internal_pb2
from protocol.processor.config import ProcessorConfig
from protocol.processor.effects import CancelTaskOnEngine, DeliverResult, FailRequest, SendTask, TaskQueued
from protocol.processor.keys import Locality
from tests.support.gateway_core import Client, Net, T0, core
from tests.support.processor import chat, engine_status, http, one, only, sse


def status_reports(effects: list[Any]) -> list[internal_pb2.ServerStatus]:
    return [e.message.server_status for e in only(effects, SendOnDial) if e.message.HasField("server_status")]


def task_results(effects: list[Any]) -> list[Any]:
    return [e.message.task_result for e in only(effects, SendOnDial) if e.message.HasField("task_result")]


def report(pod: str, *engines: str, draining: bool = False) -> internal_pb2.ProcessTasksInternalRequest:
    status = internal_pb2.ServerStatus(pod_name=pod, draining=draining)
    for engine_id in engines:
        status.engine_statuses.add(engine_status=engine_status(engine_id, "m"), tenant_id="t")
    return internal_pb2.ProcessTasksInternalRequest(server_status=status)


# --- two cores back to back -----------------------------------------------------------------------


def test_a_request_admitted_at_a_runs_on_bs_engine_and_each_result_crosses_back_once():
    net = Net("a", "b")
    net.engine_joins("b", "e1", "m")
    net.run("b", lambda now: net.cores["b"].peers_changed({"a": "a"}, now))
    assert net.cores["a"].processor.engine("t", "e1@b").locality is Locality.REMOTE
    client = net.submit("a", "r1", stream=True)
    assert net.sent_to_engine("b", "e1") == ["r1"]
    net.run("b", lambda now: net.cores["b"].engine_result("engine:e1", http("r1"), now))
    net.run("b", lambda now: net.cores["b"].engine_result("engine:e1", sse("r1", 1, last=True), now))
    # Core -> adapter once: each result leaves b's core as one message to a, never as a delivery.
    assert [(r.task_id, r.result_index) for r in task_results(net.effects["b"])] == [("r1", 0), ("r1", 1)]
    assert net.of("b", DeliverResult) == []
    delivered = net.of("a", DeliverResult)
    assert [(d.origin, d.result.result_index, d.last) for d in delivered] == [(client, 0, False), (client, 1, True)]
    assert [type(e) for e in net.effects["a"] if isinstance(e, (RequestStarted, RequestFinished))] == [
        RequestStarted, RequestFinished]
    assert one(net.effects["a"], RequestDispatched).origin is client
    assert net.cores["b"].peers["a"].dialled.tasks_in_flight == 0


@pytest.mark.parametrize("accepted_first", [False, True], ids=["before-accepted", "after-accepted"])
def test_a_local_engine_registered_after_the_first_report_to_a_peer_reaches_it(accepted_first):
    """Issue 22's start-up race: a gateway dials its peers before its built-in engine has
    registered, so its first report names no engine ("dialled in with 0 engines"). The engine's
    registration goes out on that stream when it comes, whether the peer's headers came yet."""
    a, b = core("a"), core("b")
    out = b.peers_changed({"a": "a"}, T0)
    dial, stream = one(out, OpenDial).dial, object()
    a.accepted_peer_opened(stream, None, T0)
    for sent in only(out, SendOnDial):
        assert one(a.accepted_peer_message(stream, sent.message, T0), PeerDialledIn).engines == 0
    if accepted_first:
        b.dial_accepted(dial, a.accept_metadata, T0)
    joined = b.engine_status("engine:e1", "t", engine_status("e1", "m"), Locality.LOCAL, T0 + 1)
    [later] = only(joined, SendOnDial)
    assert later.dial is dial
    assert [e.engine_status.engine_id for e in later.message.server_status.engine_statuses] == ["e1"]
    a.accepted_peer_message(stream, later.message, T0 + 1)
    if not accepted_first:
        b.dial_accepted(dial, a.accept_metadata, T0 + 1)
    assert a.processor.engine("t", "e1@b").routable and a.availability("t", "m", T0 + 1) is Availability.SERVED


def reports_on(effects: list[Any], peer: str) -> list[internal_pb2.ServerStatus]:
    return [e.message.server_status for e in only(effects, SendOnDial)
            if e.dial.name == peer and e.message.HasField("server_status")]


def test_deltas_flow_only_to_a_peer_whose_headers_offered_them():
    """b reports to a (infx: deltas) and to c (accepting like LLMariner: full snapshots);
    both end up with the same engines."""
    net = Net("a", "b", "c", llmariner=("c",))
    for engine_id in ("e1", "e2", "e3"):
        net.engine_joins("b", engine_id, "m")
    net.run("b", lambda now: net.cores["b"].peers_changed({"a": "a", "c": "c"}, now))
    assert net.cores["b"].peers["a"].dialled.sends_deltas and not net.cores["b"].peers["c"].dialled.sends_deltas
    net.effects["b"].clear()
    net.engine_joins("b", "e2", "m", ready=False)
    net.run("b", lambda now: net.cores["b"].engine_closed("engine:e3", "gone", now))
    to_a, to_c = reports_on(net.effects["b"], "a"), reports_on(net.effects["b"], "c")
    assert [(r.delta, [e.engine_status.engine_id for e in r.engine_statuses], [g.engine_id for g in r.removed_engines])
            for r in to_a] == [(True, ["e2"], []), (True, [], ["e3"])]
    assert [(r.delta, [e.engine_status.engine_id for e in r.engine_statuses], len(r.removed_engines))
            for r in to_c] == [(False, ["e1", "e2", "e3"], 0), (False, ["e1", "e2"], 0)]
    for name in ("a", "c"):
        processor = net.cores[name].processor
        assert processor.engine_counts() == {("t", Locality.REMOTE): 2}
        assert processor.engine("t", "e1@b").routable and not processor.engine("t", "e2@b").routable


def test_a_lost_delta_ends_the_stream_and_the_redial_starts_with_a_full_snapshot():
    net = Net("a", "b")
    net.engine_joins("b", "e1", "m")
    net.engine_joins("b", "e2", "m")
    net.run("b", lambda now: net.cores["b"].peers_changed({"a": "a"}, now))
    dial = net.cores["b"].peers["a"].dial
    _, stream = net.streams[dial]
    skipped = internal_pb2.ServerStatus(pod_name="b", delta=True, sequence=5)  # 2..4 never arrived
    out = net.run("a", lambda now: net.cores["a"].accepted_peer_message(
        stream, internal_pb2.ProcessTasksInternalRequest(server_status=skipped), now))
    ended = one(out, EndPeerStream)
    assert ended.code is StatusCode.INVALID_ARGUMENT and "report 5 follows 1: a report was lost" in ended.message
    assert net.cores["a"].processor.engine_counts() == {}
    net.effects["b"].clear()
    net.now = net.cores["b"].next_deadline()
    net.run("b", net.cores["b"].handle_timeout)
    [first] = reports_on(net.effects["b"], "a")
    assert not first.delta and first.sequence == 1 and len(first.engine_statuses) == 2
    assert net.cores["a"].processor.engine_counts() == {("t", Locality.REMOTE): 2}


def test_reports_carry_only_local_engines_so_they_never_loop():
    net = Net("a", "b")
    net.engine_joins("b", "e1", "m")
    net.run("a", lambda now: net.cores["a"].peers_changed({"b": "b"}, now))
    net.run("b", lambda now: net.cores["b"].peers_changed({"a": "a"}, now))
    for _ in range(3):
        net.now += 10
        for name in ("a", "b"):
            net.run(name, net.cores[name].handle_timeout)
    assert net.cores["a"].processor.engine("t", "e1@b").locality is Locality.REMOTE
    assert all(not s.engine_statuses for s in status_reports(net.effects["a"]))
    assert net.cores["b"].processor.engine("t", "e1").locality is Locality.LOCAL


def test_a_peer_report_carries_the_requests_accepted_here_per_model():
    net = Net("a", "b")
    net.run("b", lambda now: net.cores["b"].peers_changed({"a": "a"}, now))
    net.submit("b", "r1")
    net.submit("b", "r2")
    net.now += 10
    net.run("b", net.cores["b"].handle_timeout)
    assert dict(status_reports(net.effects["b"])[-1].model_requests_started) == {"m": 2}
    assert net.of("a", PeerRequests)[-1].counts == {"m": 2}


def test_engines_of_one_id_two_peers_report_are_two_engines_and_one_goes_with_its_peer():
    """Issue 22 item 2: b's e1 and c's e1 are named with their pods here; neither hides the other."""
    a = core("a")
    first, second = object(), object()
    for stream in (first, second):
        a.accepted_peer_opened(stream, None, T0)
    a.accepted_peer_message(first, report("b", "e1"), T0)
    a.accepted_peer_message(second, report("c", "e1"), T0)
    assert (a.processor.engine("t", "e1@b").route, a.processor.engine("t", "e1@c").route) == (first, second)
    effects = a.accepted_peer_closed(first, T0)
    assert a.processor.engine("t", "e1@b") is None and a.processor.engine("t", "e1@c").route is second
    assert one(effects, PeerGone).stream is first


def test_engines_removed_lets_a_peers_sender_register_what_it_reported_under_a_taken_name():
    """A peer's engine whose name here a local engine took is registered from the peer's last
    report as soon as the local one goes (its peer re-reports only on change)."""
    a = core("a")
    stream = object()
    a.engine_status("engine:x", "t", engine_status("e1@c", "m"), Locality.LOCAL, T0)
    a.accepted_peer_opened(stream, None, T0)
    a.accepted_peer_message(stream, report("c", "e1"), T0)
    assert a.processor.engine("t", "e1@c").route == "engine:x"
    a.engine_closed("engine:x", "stream ended", T0)
    assert a.processor.engine("t", "e1@c").route is stream


# --- peers that dial us -------------------------------------------------------------------------


def test_a_newer_stream_from_the_same_pod_replaces_the_older_one():
    a = core("a")
    old, new = object(), object()
    a.accepted_peer_opened(old, None, T0)
    a.accepted_peer_message(old, report("b", "e1"), T0)
    a.accepted_peer_opened(new, None, T0)
    effects = a.accepted_peer_message(new, report("b", "e1"), T0 + 1)
    ended = one(effects, EndPeerStream)
    assert (ended.stream, ended.code) == (old, StatusCode.UNAVAILABLE) and "reconnected" in ended.message
    assert a.processor.engine("t", "e1@b").route is new
    assert a.accepted_peer_message(old, report("b"), T0 + 2) == []  # the old stream is forgotten


def test_a_result_before_any_status_and_an_empty_message_end_the_stream_with_their_status():
    a = core("a")
    early, empty = object(), object()
    a.accepted_peer_opened(early, None, T0)
    result = internal_pb2.ProcessTasksInternalRequest(task_result=http("x"))
    ended = one(a.accepted_peer_message(early, result, T0), EndPeerStream)
    assert ended.code is StatusCode.FAILED_PRECONDITION
    a.accepted_peer_opened(empty, None, T0)
    a.accepted_peer_message(empty, report("b", "e1"), T0)
    effects = a.accepted_peer_message(empty, internal_pb2.ProcessTasksInternalRequest(), T0)
    assert one(effects, EndPeerStream).code is StatusCode.INVALID_ARGUMENT
    assert a.processor.engine("t", "e1@b") is None  # its engines went with it


def test_a_shutting_down_gateway_refuses_new_peer_streams():
    a = core("a")
    a.drain_peers(T0)
    ended = one(a.accepted_peer_opened(object(), None, T0), EndPeerStream)
    assert ended.code is StatusCode.UNAVAILABLE and "shutting down" in ended.message


# --- peers that dial us unasked: dialled back (issue 22 item 5) --------------------------------


def test_a_gateway_that_dials_one_way_is_dialled_back_and_each_serves_the_others_engines():
    """a lists b in its peers, b lists nobody: without the dial-back b would learn a's
    engines and a never b's (a answered 404 for b's models)."""
    net = Net("a", "b", dial_back_after=2.0)
    net.engine_joins("a", "ea", "model-a")
    net.engine_joins("b", "eb", "model-b")
    net.run("a", lambda now: net.cores["a"].peers_changed({"b": "b"}, now))
    assert net.cores["b"].processor.engine("t", "ea@a") and not net.cores["a"].processor.engine("t", "eb@b")
    assert net.cores["b"].next_deadline() == T0 + 2.0
    net.now = T0 + 2.0
    out = net.run("b", net.cores["b"].handle_timeout)
    assert (one(out, PeerDialledBack).pod_name, one(out, OpenDial).dial.address) == ("a", "a")
    assert net.cores["a"].processor.engine("t", "eb@b").routable
    assert net.cores["a"].availability("t", "model-b", net.now) is Availability.SERVED
    assert net.cores["b"].peers["a"].dialled_back and net.cores["b"].peers["a"].pod_name == "a"


def test_no_dial_back_when_a_dial_of_ours_reaches_that_pod_under_another_name():
    """b lists a as "alias" (another host name): once that dial is accepted, a's headers name
    pod a, and a dial-back would be a second stream to one pod."""
    b = core("b", dial_back_after=2.0)
    stream = object()
    b.accepted_peer_opened(stream, "a-address", T0)
    b.accepted_peer_message(stream, report("a", "e1"), T0)
    alias = one(b.peers_changed({"alias": "a-other-address"}, T0 + 1), OpenDial).dial
    b.dial_accepted(alias, core("a").accept_metadata, T0 + 1)
    assert b.handle_timeout(T0 + 2) == [] and list(b.peers) == ["alias"]


def test_a_dial_back_made_before_our_own_dial_reached_the_pod_is_given_up_then():
    b = core("b", dial_back_after=2.0)
    stream = object()
    b.accepted_peer_opened(stream, "a-address", T0)
    b.accepted_peer_message(stream, report("a", "e1"), T0)
    back = one(b.handle_timeout(T0 + 2), OpenDial).dial
    b.dial_accepted(back, core("a").accept_metadata, T0 + 2)
    alias = one(b.peers_changed({"alias": "a-other-address"}, T0 + 3), OpenDial).dial
    effects = b.dial_accepted(alias, core("a").accept_metadata, T0 + 4)
    assert one(effects, CancelDial).dial is back and list(b.peers) == ["alias"]


def test_a_dialler_that_gives_no_port_is_warned_about_once_its_time_comes():
    """A LLMariner gateway says nothing of where it listens: one-way peering is logged instead."""
    b = core("b", dial_back_after=2.0)
    stream = object()
    b.accepted_peer_opened(stream, None, T0)
    b.accepted_peer_message(stream, report("llmariner-0", "e1"), T0)
    effects = b.handle_timeout(T0 + 2)
    assert one(effects, PeerOneWay).pod_name == "llmariner-0" and not only(effects, OpenDial)
    assert b.next_deadline() is None


def test_a_dial_back_lasts_while_its_peer_dials_us_and_the_pod_source_can_take_it_over():
    b = core("b", dial_back_after=2.0)
    stream = object()
    b.accepted_peer_opened(stream, "a-address", T0)
    b.accepted_peer_message(stream, report("a", "e1"), T0)
    back = one(b.handle_timeout(T0 + 2), OpenDial).dial
    assert b.peers_changed({}, T0 + 3) == []  # the pod source's list does not name it: it stays
    taken = b.peers_changed({"a": "a-address-from-the-source"}, T0 + 3)
    assert one(taken, CancelDial).dial is back and one(taken, OpenDial).dial.address == "a-address-from-the-source"
    assert not b.peers["a"].dialled_back
    # A dial-back whose peer no longer dials us is not redialled.
    c = core("c", dial_back_after=2.0)
    c.accepted_peer_opened(stream, "a-address", T0)
    c.accepted_peer_message(stream, report("a", "e1"), T0)
    again = one(c.handle_timeout(T0 + 2), OpenDial).dial
    c.accepted_peer_closed(stream, T0 + 3)
    c.dial_closed(again, T0 + 3)
    assert dict(c.peers) == {} and c.next_deadline() is None


def test_a_peer_listed_under_another_name_that_dials_in_while_we_back_off_is_redialled_at_once():
    """Its headers named its pod when it first accepted our stream: its own report on the
    stream it opens after a restart says it is back, whatever our --peers call it."""
    a = core("a", redial_when_dialled_in=True, redial_backoff=Backoff(initial=5.0, factor=2.0, cap=10.0, jitter=0))
    first = one(a.peers_changed({"alias": "b-address"}, T0), OpenDial).dial
    a.dial_accepted(first, core("b").accept_metadata, T0)
    a.dial_closed(first, T0 + 1)  # b restarts
    assert a.next_deadline() == T0 + 6
    stream = object()
    a.accepted_peer_opened(stream, None, T0 + 2)
    assert one(a.accepted_peer_message(stream, report("b"), T0 + 2), OpenDial).dial.name == "alias"


def test_dial_backs_are_off_unless_configured():
    b = core("b")
    stream = object()
    b.accepted_peer_opened(stream, "a-address", T0)
    b.accepted_peer_message(stream, report("a", "e1"), T0)
    assert b.next_deadline() is None and dict(b.peers) == {}


# --- peers we dial ----------------------------------------------------------------------------


def test_a_peer_is_redialled_on_its_deadline_with_backoff_that_resets_once_accepted():
    a = core("a", redial_backoff=Backoff(initial=1.0, factor=2.0, cap=5.0, jitter=0.0))
    first = one(a.peers_changed({"b": "10.0.0.2:8083"}, T0), OpenDial).dial
    assert a.peers["b"].state is DialState.CONNECTING
    a.dial_closed(first, T0)
    assert a.peers["b"].state is DialState.BACKING_OFF and a.next_deadline() == T0 + 1
    assert only(a.handle_timeout(T0 + 0.999), OpenDial) == []  # not before its time
    second = one(a.handle_timeout(T0 + 1), OpenDial).dial
    assert second is not first and second.attempt == 2
    a.dial_closed(second, T0 + 1)
    assert a.next_deadline() == T0 + 3  # two failures in a row: 2 s
    third = one(a.handle_timeout(T0 + 3), OpenDial).dial
    a.dial_accepted(third, core("b").accept_metadata, T0 + 3)
    assert a.peers["b"].state is DialState.OPEN and a.peers["b"].streams_opened == 1
    a.dial_closed(third, T0 + 4)
    assert a.next_deadline() == T0 + 5  # accepted: back to the first delay
    assert a.dial_closed(first, T0 + 4) == []  # a late end of an old stream changes nothing


def test_peers_follow_the_wanted_set_one_stream_each_at_its_current_address():
    a = core("a")
    effects = a.peers_changed({"b": "b1", "c": "c1"}, T0)
    assert sorted((d.dial.name, d.dial.address) for d in only(effects, OpenDial)) == [("b", "b1"), ("c", "c1")]
    first_b = a.peers["b"]
    effects = a.peers_changed({"b": "b2", "c": "c1"}, T0)
    assert one(effects, CancelDial).dial.address == "b1" and one(effects, OpenDial).dial.address == "b2"
    assert first_b.state is DialState.STOPPED and a.peers["b"] is not first_b
    assert a.peers_changed({"b": "b2", "c": "c1"}, T0) == []  # nothing changed: nothing done
    effects = a.peers_changed({"b": "b2"}, T0)
    assert one(effects, CancelDial).dial.name == "c" and list(a.peers) == ["b"]
    a.stop(T0)
    assert a.peers_changed({"b": "b2"}, T0) == [] and dict(a.peers) == {}


def test_a_malformed_forwarded_task_gives_the_stream_up_and_the_peer_is_redialled():
    a = core("a", redial_backoff=Backoff(initial=1.0, factor=2.0, cap=5.0, jitter=0.0))
    dial = one(a.peers_changed({"b": "b"}, T0), OpenDial).dial
    a.dial_accepted(dial, core("b").accept_metadata, T0)
    effects = a.dial_message(dial, internal_pb2.ProcessTasksInternalResponse(tenant_id="t"), T0)
    assert "broke the protocol" in one(effects, CancelDial).reason
    assert a.peers["b"].state is DialState.BACKING_OFF and a.next_deadline() == T0 + 1


def test_draining_reports_every_engine_not_ready_then_half_closes_once_forwarded_tasks_end():
    net = Net("a", "b")
    net.engine_joins("b", "e1", "m")
    net.run("b", lambda now: net.cores["b"].peers_changed({"a": "a"}, now))
    net.submit("a", "r1")
    net.run("b", net.cores["b"].drain_peers)
    assert status_reports(net.effects["b"])[-1].draining
    assert not net.cores["a"].processor.engine("t", "e1@b").routable
    assert net.of("b", HalfCloseDial) == []  # r1 still runs
    net.run("b", lambda now: net.cores["b"].engine_result("engine:e1", http("r1"), now))
    assert len(net.of("b", HalfCloseDial)) == 1 and net.cores["b"].dialling == 0
    assert one(net.effects["a"], DeliverResult).last


def test_draining_gives_up_a_dial_its_peer_has_not_accepted_so_it_cannot_hold_the_drain():
    """A restarting worker's port takes connections and answers nothing (its supervisor holds the
    socket): a dial to it carries no task, and waiting for it held a sibling's drain for the whole
    grace period (found with twistd infx --workers 2)."""
    a = core("a")
    dial = one(a.peers_changed({"b": "b:1"}, T0), OpenDial).dial
    effects = a.drain_peers(T0 + 1)
    assert one(effects, CancelDial).dial == dial
    assert a.dialling == 0 and a.next_deadline() is None


def test_a_peer_that_dials_in_while_we_back_off_from_it_is_redialled_at_once():
    """A restarted peer dials us first; the backoff its outage grew must not delay its learning
    of our engines (found by tests/e2e/test_eight_gateways.py)."""
    a = core("a", redial_backoff=Backoff(initial=8.0, factor=2.0, cap=30.0, jitter=0.0), redial_when_dialled_in=True)
    first = one(a.peers_changed({"b": "b:1"}, T0), OpenDial).dial
    a.dial_closed(first, T0)  # b is down
    assert a.peers["b"].state is DialState.BACKING_OFF and a.next_deadline() == T0 + 8
    stream = object()
    a.accepted_peer_opened(stream, None, T0 + 1)
    redial = one(a.accepted_peer_message(stream, report("b", "e1"), T0 + 1), OpenDial).dial
    assert redial.attempt == 2 and a.peers["b"].state is DialState.CONNECTING
    # A peer we are connected to (or not dialling at all) is left alone when it dials in again.
    again = object()
    a.accepted_peer_opened(again, None, T0 + 2)
    assert only(a.accepted_peer_message(again, report("b", "e1"), T0 + 2), OpenDial) == []
    other = object()
    a.accepted_peer_opened(other, None, T0 + 2)
    assert only(a.accepted_peer_message(other, report("c", "e2"), T0 + 2), OpenDial) == []
    # Off (the default), the backoff runs its course.
    patient = core("a", redial_backoff=Backoff(initial=8.0, factor=2.0, cap=30.0, jitter=0.0))
    patient.dial_closed(one(patient.peers_changed({"b": "b:1"}, T0), OpenDial).dial, T0)
    patient.accepted_peer_opened(stream, None, T0 + 1)
    assert only(patient.accepted_peer_message(stream, report("b", "e1"), T0 + 1), OpenDial) == []


def test_at_start_up_a_model_only_a_peer_serves_waits_for_its_report_instead_of_404():
    """Found by tests/e2e/test_eight_gateways.py: a restarted gateway answered 404 for the models
    its peers serve in the moment before their first reports arrived."""
    net = Net("a", "b")
    net.cores["a"] = a = core("a", learn_peers_within=5.0)
    net.engine_joins("b", "e1", "m")
    net.run("a", lambda now: a.peers_changed({"b": "b"}, now))  # a dials b; b has not dialled a yet
    assert a.availability("t", "m", net.now) is Availability.LEARNING
    client = net.submit("a", "r1")
    assert net.of("a", FailRequest) == []
    net.run("b", lambda now: net.cores["b"].peers_changed({"a": "a"}, now))  # b's report reaches a
    assert a.availability("t", "m", net.now) is Availability.SERVED
    assert net.sent_to_engine("b", "e1") == ["r1"]
    net.run("b", lambda now: net.cores["b"].engine_result("engine:e1", http("r1"), now))
    assert one(net.effects["a"], DeliverResult).origin is client
    # Every dialled peer has reported: learning is over, an unknown model is 404 at once.
    assert a.availability("t", "nothing", net.now) is Availability.UNKNOWN


def test_start_up_learning_ends_with_404_for_a_model_no_peer_reported_in_time():
    a = core("a", learn_peers_within=5.0)
    a.peers_changed({"b": "b", "c": "c"}, T0)
    b = object()
    a.accepted_peer_opened(b, None, T0)
    a.accepted_peer_message(b, report("b", "e1"), T0)  # c never reports (it is down)
    assert a.availability("t", "nobody-serves-it", T0 + 1) is Availability.LEARNING
    a.submit(Client("r1"), "r1", "t", "nobody-serves-it", chat("nobody-serves-it"), {}, None, T0 + 1)
    assert a.next_deadline() == T0 + 5
    failed = one(a.handle_timeout(T0 + 5), FailRequest)
    assert (failed.task_id, failed.status, failed.message) == ("r1", 404, ModelNotFoundError("nobody-serves-it").message)
    assert a.availability("t", "nobody-serves-it", T0 + 5) is Availability.UNKNOWN
    # Learning happens once, at start-up: a peer lost later does not bring it back.
    a.accepted_peer_closed(b, T0 + 6)
    assert a.availability("t", "other", T0 + 6) is Availability.UNKNOWN
    # Without peers there is nothing to learn; without learn_peers_within, no learning at all.
    assert core("alone", learn_peers_within=5.0).availability("t", "m", T0) is Availability.UNKNOWN
    unlearning = core("a")
    unlearning.peers_changed({"b": "b"}, T0)
    assert unlearning.availability("t", "m", T0) is Availability.UNKNOWN


# --- HTTP requests, models and the scaler ---------------------------------------------------------


def test_a_model_no_engine_lists_any_more_is_gone_until_forgotten_then_unknown():
    a = core("a", forget_models_after=60)
    assert a.availability("t", "m", T0) is Availability.UNKNOWN
    a.engine_status("engine:e1", "t", engine_status("e1", "m"), Locality.LOCAL, T0)
    assert a.availability("t", "m", T0) is Availability.SERVED
    a.engine_status("engine:e1", "t", engine_status("e1", "m"), Locality.LOCAL, T0 + 10)  # listed, later
    a.engine_closed("engine:e1", "gone", T0 + 11)
    assert a.availability("t", "m", T0 + 69.5) is Availability.GONE
    assert a.availability("t", "m", T0 + 70) is Availability.UNKNOWN  # 60 s after it was last listed
    a.scaler_attached(lambda tenant, model: model == "m", T0)
    assert a.availability("t", "m", T0 + 70) is Availability.STARTABLE


def test_the_scaler_holds_a_queued_task_once_and_hears_when_it_leaves_the_queue():
    a = core("a", load_interval=1.0, processor=ProcessorConfig(queue_timeout=600))
    a.scaler_attached(lambda tenant, model: True, T0)
    served, cancelled = Client("r1"), Client("r2")
    held = only(a.submit(served, "r1", "t", "m", chat(), {}, None, T0), TaskQueued)
    held += only(a.submit(cancelled, "r2", "t", "m", chat(), {}, None, T0), TaskQueued)
    assert [q.task_id for q in held] == ["r1", "r2"]
    assert one(a.cancel("r2", T0), TaskReleased).task_id == "r2"
    effects = a.engine_status("engine:e1", "t", engine_status("e1", "m"), Locality.LOCAL, T0 + 1)
    assert one(effects, ModelServed).model == "m"
    assert [r for r in only(a.handle_timeout(T0 + 1), ReportLoad)] == [ReportLoad("m", 1)]
    a.engine_result("engine:e1", http("r1"), T0 + 1.5)
    assert only(a.handle_timeout(T0 + 2), ReportLoad) == [ReportLoad("m", 0)]
    a.scaler_detached(T0 + 2)
    assert a.next_deadline() is None


def test_the_scaler_giving_up_fails_every_tenants_waiting_tasks_for_the_model():
    a = core("a", processor=ProcessorConfig(queue_timeout=600))
    a.scaler_attached(lambda tenant, model: True, T0)
    client = Client("r1")
    a.submit(client, "r1", "t", "m", chat(), {}, None, T0)
    effects = a.scaler_gave_up("m", 503, "CrashLoopBackOff", T0 + 1)
    failed = one(effects, FailRequest)
    assert failed.origin is client and failed.status == 503 and "CrashLoopBackOff" in failed.message
    assert one(effects, RequestFinished).model == "m"


def test_a_request_counted_started_is_counted_finished_once_however_it_ends():
    a = core("a", processor=ProcessorConfig(queue_timeout=5))
    a.engine_status("engine:e1", "t", engine_status("e1", "m"), Locality.LOCAL, T0)
    effects = a.submit(Client("ok"), "ok", "t", "m", chat(), {}, None, T0)
    effects += a.engine_result("engine:e1", http("ok"), T0)
    effects += a.submit(Client("gone"), "gone", "t", "m", chat(), {}, None, T0)
    effects += a.cancel("gone", T0)
    effects += a.cancel("gone", T0)  # a second cancel of the same request counts nothing
    effects += a.submit(Client("late"), "late", "t", "other", chat("other"), {}, None, T0)
    effects += a.handle_timeout(T0 + 5)
    assert [e.model for e in only(effects, RequestStarted)] == ["m", "m", "other"]
    assert [e.model for e in only(effects, RequestFinished)] == ["m", "m", "other"]
    assert a.requests_started == {"m": 2, "other": 1}


def test_core_config_is_validated():
    with pytest.raises(Exception, match="status_interval"):
        CoreConfig(pod_name="a", status_interval=0)
    with pytest.raises(Exception, match="learn_peers_within"):
        CoreConfig(pod_name="a", learn_peers_within=-1)
