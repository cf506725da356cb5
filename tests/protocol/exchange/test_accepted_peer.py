"""The task accepted peer as pure code, then two gateways wired through a dialled peer and a
accepted peer with no I/O: tasks run end to end, errors travel back as 503 results, and
a shutting-down gateway drains."""

from __future__ import annotations

from collections import defaultdict, deque

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from protocol.pb import internal_pb2, worker_pb2
from protocol.processor.core import Processor, TaskState
from protocol.processor.config import ProcessorConfig
from protocol.processor.effects import (
    CancelTaskOnEngine,
    DeliverResult,
    EnginesRemoved,
    FailRequest,
    LocalEnginesChanged,
    SendTask,
)
from protocol.processor.errors import PeerProtocolError, ProcessorUsageError
from protocol.processor.keys import EngineKey, Locality
from protocol.exchange.dialled_peer import DialledPeer, DialledPeerConfig
from protocol.exchange.accepted_peer import AcceptedPeer, peer_engine_id
from tests.support.processor import chat, engine_status, http, one, only, sse
from tests.support.dialled_peer import BufferedReceiver

T0 = 10.0
RETRY_DELAY = 1.0


def report(pod: str, *engines: tuple[str, str, bool]) -> internal_pb2.ProcessTasksInternalRequest:
    status = internal_pb2.ServerStatus(pod_name=pod)
    for tenant, engine_id, ready in engines:
        status.engine_statuses.add(engine_status=engine_status(engine_id, "m", ready=ready), tenant_id=tenant)
    return internal_pb2.ProcessTasksInternalRequest(server_status=status)


def result_msg(result: worker_pb2.TaskResult) -> internal_pb2.ProcessTasksInternalRequest:
    return internal_pb2.ProcessTasksInternalRequest(task_result=result)


def task_message(effect: SendTask | CancelTaskOnEngine) -> internal_pb2.ProcessTasksInternalResponse:
    """The message a peer stream carries for a task (or a cancel), with the engine's tenant."""
    return internal_pb2.ProcessTasksInternalResponse(new_task=effect.task, tenant_id=effect.engine.tenant_id)


def submit(p: Processor, task_id: str, **kw: object) -> list[object]:
    return list(p.submit(task_id=task_id, tenant_id="t", request=kw.pop("request", chat()), origin="client", **kw, now=T0))


# --- the accepted peer alone ---------------------------------------------------------------


def test_reported_engines_are_registered_as_remote_with_the_tenant_from_the_report():
    p = Processor()
    s = AcceptedPeer(p)
    s.message_received(report("pod-b", ("t", "e1", True), ("u", "e2", True)), T0)
    assert s.pod_name == "pod-b"
    assert s.engines == {EngineKey("t", "e1@pod-b"), EngineKey("u", "e2@pod-b")}
    assert p.engine_counts() == {("t", Locality.REMOTE): 1, ("u", Locality.REMOTE): 1}
    assert p.engine("t", peer_engine_id("e1", "pod-b")).route is s


def test_tasks_for_the_peer_engines_are_forwarded_with_their_tenant_id():
    p = Processor()
    s = AcceptedPeer(p)
    s.message_received(report("pod-b", ("t", "e1", True)), T0)
    message = task_message(one(submit(p, "a"), SendTask))
    assert message.tenant_id == "t" and message.new_task.id == "a" and message.new_task.engine_id == "e1"


def test_results_from_the_peer_go_to_the_original_task():
    p = Processor()
    s = AcceptedPeer(p)
    s.message_received(report("pod-b", ("t", "e1", True)), T0)
    submit(p, "a", request=chat(stream=True))
    effects = s.message_received(result_msg(http("a")), T0) + s.message_received(result_msg(sse("a", 1, last=True)), T0)
    assert [(d.task_id, d.result.result_index, d.last) for d in only(effects, DeliverResult)] == [
        ("a", 0, False), ("a", 1, True)]


def test_engines_missing_from_a_report_are_removed_and_their_tasks_fail_over():
    p = Processor(ProcessorConfig(retry_delay=0))
    s = AcceptedPeer(p)
    s.message_received(report("pod-b", ("t", "e1", True), ("t", "e2", True)), T0)
    submit(p, "a")  # goes to e1 (fewest in flight, then id)
    effects = s.message_received(report("pod-b", ("t", "e2", True)), T0)
    assert [(e.engine.engine_id, e.task.engine_id, e.task.id) for e in only(effects, SendTask)] == [
        ("e2@pod-b", "e2", "a#2")]
    assert s.engines == {EngineKey("t", "e2@pod-b")}


def test_a_not_ready_report_takes_engines_out_of_routing_but_keeps_their_tasks():
    p = Processor()
    s = AcceptedPeer(p)
    s.message_received(report("pod-b", ("t", "e1", True)), T0)
    submit(p, "a")
    s.message_received(report("pod-b", ("t", "e1", False)), T0)
    assert p.engine("t", "e1@pod-b").in_flight == 1
    assert not only(submit(p, "b"), SendTask)


def test_when_the_stream_ends_every_engine_of_the_peer_goes_and_its_tasks_fail_over():
    p = Processor(ProcessorConfig(retry_delay=0))
    p.update_engine("engine:local", "t", engine_status("local", "m", ready=False), Locality.LOCAL, T0)
    s = AcceptedPeer(p)
    s.message_received(report("pod-b", ("t", "e1", True), ("t", "e2", True)), T0)
    submit(p, "a")
    p.update_engine("engine:local", "t", engine_status("local", "m"), Locality.LOCAL, T0)
    effects = s.closed(T0)
    assert [(e.engine.engine_id, e.task.id) for e in only(effects, SendTask)] == [("local", "a#2")]
    assert p.engine_counts() == {("t", Locality.LOCAL): 1}


def test_engines_of_one_id_here_and_at_two_peers_are_three_engines_each_reached_by_the_id_it_reports():
    """Issue 22 item 2: every gateway's built-in engine is builtin-echo, and operators reuse
    --engine-id. Each peer's engine is named with its pod here: none shadows another."""
    p = Processor(ProcessorConfig(max_in_flight_per_engine=1))
    p.update_engine("engine:e1", "t", engine_status("e1", "m"), Locality.LOCAL, T0)
    first, second = AcceptedPeer(p), AcceptedPeer(p)
    first.message_received(report("pod-b", ("t", "e1", True)), T0)
    second.message_received(report("pod-c", ("t", "e1", True)), T0)
    assert {name: p.engine("t", name).route for name in ("e1", "e1@pod-b", "e1@pod-c")} == {
        "e1": "engine:e1", "e1@pod-b": first, "e1@pod-c": second}
    assert p.engine_counts() == {("t", Locality.LOCAL): 1, ("t", Locality.REMOTE): 2}
    sends = [one(submit(p, f"task-{n}"), SendTask) for n in range(3)]
    assert sorted((send.engine.engine_id, send.task.engine_id) for send in sends) == [
        ("e1", "e1"), ("e1@pod-b", "e1"), ("e1@pod-c", "e1")]
    second.message_received(report("pod-c"), T0)  # pod-c's removal takes only its own
    assert p.engine("t", "e1") is not None and p.engine("t", "e1@pod-b") is not None
    assert p.engine("t", "e1@pod-c") is None


def test_a_peer_that_renames_itself_on_its_stream_breaks_the_protocol():
    """Its engines are named with its pod here: a new name on the same stream would orphan them."""
    s = AcceptedPeer(Processor())
    s.message_received(report("pod-b", ("t", "e1", True)), T0)
    with pytest.raises(PeerProtocolError, match="now calls itself 'pod-x'"):
        s.message_received(report("pod-x", ("t", "e1", True)), T0)


def test_the_request_counts_a_peer_receiver_reports_are_kept_for_the_autoscaler():
    counts = {"m": 7, "n": 1}
    dialled = BufferedReceiver(Processor(), DialledPeerConfig("pod-b"), requests_started=lambda: counts)
    dialled.connected(T0)
    s = AcceptedPeer(Processor())
    assert s.requests_started == {}
    for message in dialled.pop_messages():
        s.message_received(message, T0)
    assert s.requests_started == {"m": 7, "n": 1}
    s.message_received(report("pod-b"), T0 + 1)  # a LLMariner peer reports none
    assert s.requests_started == {}


def test_misuse_and_remote_violations_raise_distinct_errors():
    p = Processor()
    s = AcceptedPeer(p)
    with pytest.raises(PeerProtocolError):
        s.message_received(internal_pb2.ProcessTasksInternalRequest(), T0)
    s.closed(T0)
    with pytest.raises(ProcessorUsageError):
        s.closed(T0)


# --- F1 of the cluster simulation: reports shadowed by another registration -----------


def removed(effects: list[object]) -> tuple[EngineKey, ...]:
    return one(effects, EnginesRemoved).engines


def test_an_engine_a_peer_reports_while_its_old_stream_here_lingers_is_reached_through_the_peer_at_once():
    """F1: e0 is attached here and also reports through pod-c (it reconnected there while its
    old stream here lingers). Named with pod-c's pod, pod-c's e0 is registered at once and
    stays when the old stream ends."""
    p = Processor(ProcessorConfig(queue_timeout=30))
    p.update_engine("engine:e0", "t", engine_status("e0", "m"), Locality.LOCAL, T0)
    s = AcceptedPeer(p)
    s.message_received(report("pod-c", ("t", "e0", True)), T0)
    assert s.engines == {EngineKey("t", "e0@pod-c")} and p.engine("t", "e0@pod-c").route is s
    assert s.engines_removed(removed(p.close_route("engine:e0", "stream ended", T0)), T0) == []
    assert p.engine("t", "e0") is None and p.engine("t", "e0@pod-c").route is s
    assert [(e.route, e.task.engine_id) for e in only(submit(p, "a"), SendTask)] == [(s, "e0")]


def test_a_peer_engine_whose_name_here_a_local_engine_took_is_registered_once_the_local_one_goes():
    """A name here can still be taken (a local engine named e0@pod-c): the peer's engine waits
    for it, from the report pod-c will not repeat, since nothing changed on its side."""
    p = Processor(ProcessorConfig(queue_timeout=30))
    p.update_engine("engine:x", "t", engine_status("e0@pod-c", "m"), Locality.LOCAL, T0)
    s = AcceptedPeer(p)
    assert s.message_received(report("pod-c", ("t", "e0", True)), T0) == []
    assert p.engine("t", "e0@pod-c").locality is Locality.LOCAL and s.engines == frozenset()
    gone = removed(p.close_route("engine:x", "stream ended", T0))
    submit(p, "a")  # waits: no engine for m yet
    effects = s.engines_removed(gone, T0)
    assert p.engine("t", "e0@pod-c").route is s and s.engines == {EngineKey("t", "e0@pod-c")}
    assert [(e.route, e.task.engine_id, e.task.id) for e in only(effects, SendTask)] == [(s, "e0", "a")]


def test_an_engine_that_moved_between_peers_is_reached_where_it_is_whichever_report_came_first():
    """The engine moved from pod-b to pod-c, and pod-c's report came first."""
    p = Processor()
    b, c = AcceptedPeer(p), AcceptedPeer(p)
    b.message_received(report("pod-b", ("t", "e0", True)), T0)
    c.message_received(report("pod-c", ("t", "e0", True)), T0)
    assert p.engine("t", "e0@pod-b").route is b and p.engine("t", "e0@pod-c").route is c
    gone = removed(b.message_received(report("pod-b"), T0))
    assert c.engines_removed(gone, T0) == [] and p.engine("t", "e0@pod-c").route is c
    assert p.engine("t", "e0@pod-b") is None


def test_when_the_local_engine_that_took_a_peer_engines_name_comes_and_goes_again_the_peer_report_still_counts():
    """The inverse case: pod-c's registration is overridden by a local attach under its name
    (no new report from pod-c), then the local stream ends: the name is pod-c's again."""
    p = Processor()
    c = AcceptedPeer(p)
    c.message_received(report("pod-c", ("t", "e0", True)), T0)
    p.update_engine("engine:x", "t", engine_status("e0@pod-c", "m"), Locality.LOCAL, T0)
    assert p.engine("t", "e0@pod-c").route == "engine:x"
    c.engines_removed(removed(p.close_route("engine:x", "stream ended", T0)), T0)
    assert p.engine("t", "e0@pod-c").route is c
    c.message_received(report("pod-c"), T0)  # and pod-c's own removal still works
    assert p.engine("t", "e0@pod-c") is None


def test_a_sender_registers_only_what_its_peer_still_reports_and_nothing_once_closed():
    p = Processor()
    p.update_engine("engine:e0", "t", engine_status("e0@pod-c", "m"), Locality.LOCAL, T0)
    p.update_engine("engine:e1", "t", engine_status("e1@pod-d", "m"), Locality.LOCAL, T0)
    c, d = AcceptedPeer(p), AcceptedPeer(p)
    c.message_received(report("pod-c", ("t", "e0", True)), T0)
    c.message_received(report("pod-c"), T0)  # pod-c no longer has e0
    d.message_received(report("pod-d", ("t", "e1", True)), T0)
    d.closed(T0)
    assert c.engines_removed(removed(p.close_route("engine:e0", "ended", T0)), T0) == []
    assert d.engines_removed(removed(p.close_route("engine:e1", "ended", T0)), T0) == []
    assert p.engine_counts() == {}


def test_an_engine_that_reconnected_to_a_peer_is_reached_through_it_once_its_old_stream_here_ends(net):
    """F1 end to end: eb is attached to B and also, on a stream that lingers, to A; when
    that stream ends, A routes to eb through B without B reporting again."""
    network, a, b = net
    a.engine_joins("eb")
    assert a.p.engine("t", "eb").locality is Locality.LOCAL
    a.dispatch(a.p.close_route("engine:eb", "old stream ended", network.now))
    assert a.p.engine("t", "eb") is None and a.p.engine("t", "eb@pod-b").locality is Locality.REMOTE
    a.request("task-1")
    assert [t.id for t in b.engine_inbox["eb"]] == ["task-1"]


# --- two gateways, end to end ---------------------------------------------------------


class Gateway:
    """One gateway's pure parts: a processor, its local engines (routes ``engine:<id>``),
    its clients, and the effect dispatch a Twisted adapter would do."""

    def __init__(self, name: str, network: Network) -> None:
        self.name = name
        self.network = network
        self.p = Processor(ProcessorConfig(retry_delay=RETRY_DELAY))
        self.receivers: list[DialledPeer] = []
        self.client: dict[str, list[worker_pb2.TaskResult]] = defaultdict(list)
        self.failed: dict[str, FailRequest] = {}
        self.ended: set[str] = set()
        self.engine_inbox: dict[str, list[worker_pb2.Task]] = defaultdict(list)
        network.gateways.append(self)

    def dispatch(self, effects: list[object]) -> None:
        for effect in effects:
            if isinstance(effect, (SendTask, CancelTaskOnEngine)):
                if isinstance(effect.route, AcceptedPeer):
                    self.network.carry_task(effect.route, task_message(effect))
                else:
                    self.engine_inbox[effect.engine.engine_id].append(effect.task)
            elif isinstance(effect, (DeliverResult, FailRequest)):
                if isinstance(effect.origin, DialledPeer):
                    effect.origin.deliver(effect)
                else:
                    assert effect.task_id not in self.ended, f"{effect} after the end of its request"
                    if isinstance(effect, DeliverResult):
                        self.client[effect.task_id].append(effect.result)
                        self.p.results_consumed(effect.task_id)
                        if effect.last:
                            self.ended.add(effect.task_id)
                    else:
                        self.failed[effect.task_id] = effect
                        self.ended.add(effect.task_id)
            elif isinstance(effect, LocalEnginesChanged):
                for dialled in self.receivers:
                    dialled.local_engines_changed(self.network.now)
            elif isinstance(effect, EnginesRemoved):
                for accepted_peer in [s for _, _, s, sending in self.network.links if sending is self]:
                    self.dispatch(accepted_peer.engines_removed(effect.engines, self.network.now))
        self.network.pump()

    def engine_joins(self, engine_id: str, ready: bool = True) -> None:
        status = engine_status(engine_id, "m", ready=ready)
        self.dispatch(self.p.update_engine(f"engine:{engine_id}", "t", status, Locality.LOCAL, self.network.now))

    def engine_says(self, engine_id: str, result: worker_pb2.TaskResult) -> None:
        self.dispatch(self.p.receive_result(f"engine:{engine_id}", result, self.network.now))

    def request(self, task_id: str, **kw: object) -> None:
        self.dispatch(self.p.submit(
            task_id=task_id,
            tenant_id="t",
            origin="client",
            request=kw.pop("request", chat()),
            **kw,
            now=self.network.now,
        ))


class Network:
    """Carries the messages of ProcessTasksInternal streams by hand, in order, no I/O."""

    def __init__(self) -> None:
        self.now = T0
        self.links: list[tuple[DialledPeer, Gateway, AcceptedPeer, Gateway]] = []
        self.gateways: list[Gateway] = []
        self.to_receiver: deque[tuple[AcceptedPeer, internal_pb2.ProcessTasksInternalResponse]] = deque()
        self.pumping = False

    def connect(self, receiving: Gateway, sending: Gateway) -> tuple[DialledPeer, AcceptedPeer]:
        """``receiving`` dials ``sending``: its dialled peer reports to ``sending``'s new accepted peer."""
        dialled = BufferedReceiver(receiving.p, DialledPeerConfig(receiving.name))
        accepted_peer = AcceptedPeer(sending.p)
        receiving.receivers.append(dialled)
        self.links.append((dialled, receiving, accepted_peer, sending))
        dialled.connected(self.now)
        self.pump()
        return dialled, accepted_peer

    def tick(self, seconds: float) -> None:
        """Step the clock and fire every timer that is due."""
        self.now += seconds
        for dialled, *_ in self.links:
            dialled.handle_timeout(self.now)
        for gateway in self.gateways:
            gateway.dispatch(gateway.p.handle_timeout(self.now))

    def disconnect(self) -> None:
        """Every stream breaks: messages in flight are lost, both ends clean up."""
        links, self.links = self.links, []
        self.to_receiver.clear()
        for dialled, receiving, accepted_peer, sending in links:
            receiving.receivers.remove(dialled)
            sending.dispatch(accepted_peer.closed(self.now))
            receiving.dispatch(dialled.closed(self.now))

    def carry_task(self, accepted_peer: AcceptedPeer, message: internal_pb2.ProcessTasksInternalResponse) -> None:
        self.to_receiver.append((accepted_peer, message))

    def pump(self) -> None:
        if self.pumping:
            return
        self.pumping = True
        try:
            moved = True
            while moved:
                moved = False
                for dialled, receiving, accepted_peer, sending in self.links:
                    for message in dialled.pop_messages():
                        moved = True
                        sending.dispatch(accepted_peer.message_received(message, self.now))
                while self.to_receiver:
                    moved = True
                    accepted_peer, message = self.to_receiver.popleft()
                    dialled, receiving = next((r, g) for r, g, s, _ in self.links if s is accepted_peer)
                    receiving.dispatch(dialled.task_received(message, self.now))
        finally:
            self.pumping = False


@pytest.fixture
def net() -> tuple[Network, Gateway, Gateway]:
    network = Network()
    a, b = Gateway("pod-a", network), Gateway("pod-b", network)
    b.engine_joins("eb")
    network.connect(b, a)
    return network, a, b


def test_a_task_runs_end_to_end_through_the_peer_and_its_results_come_back_in_order(net):
    network, a, b = net
    assert a.p.engine("t", "eb@pod-b").locality is Locality.REMOTE
    a.request("task-1", request=chat(stream=True), deadline=T0 + 20)
    forwarded = b.engine_inbox["eb"][-1]
    assert forwarded.id == "task-1" and forwarded.timeout_seconds == 20
    for result in [http("task-1"), sse("task-1", 1), sse("task-1", 2, last=True)]:
        b.engine_says("eb", result)
    assert [r.result_index for r in a.client["task-1"]] == [0, 1, 2]
    assert not a.p.has_task("task-1") and not b.p.has_task("task-1")


def test_a_peer_that_cannot_run_a_task_answers_503_at_once_and_the_origin_retries_elsewhere(net):
    network, a, b = net
    a.engine_joins("ea", ready=False)
    # B's engine leaves, and A has not heard of it yet when it forwards a task there.
    b.p.remove_engine("t", "eb", "crashed", network.now)
    a.request("task-1")
    # The refusal is a busy answer (a peer's 503): the task waits, with no engine left for it.
    assert a.p.task_state("task-1") is TaskState.WAITING and a.p.counters.attempt_failures == {"runtime_busy": 1}
    network.links[0][0].local_engines_changed(network.now)  # B's report catches up
    network.pump()
    assert a.p.engine("t", "eb@pod-b") is None
    a.engine_joins("ea")
    assert [t.id for t in a.engine_inbox["ea"]] == ["task-1#2"]  # the retry's own wire id


def test_a_task_refused_by_a_peer_whose_engine_is_not_ready_waits_for_another_engine(net):
    network, a, b = net
    b.p.update_engine("engine:eb", "t", engine_status("eb", "m", ready=False), Locality.LOCAL, network.now)
    a.request("task-1")  # A still believes eb is ready: B refuses it at once with 503
    network.links[0][0].local_engines_changed(network.now)
    network.pump()
    network.tick(RETRY_DELAY)
    assert a.p.task_state("task-1") is TaskState.WAITING
    a.engine_joins("ea")
    assert [t.id for t in a.engine_inbox["ea"]] == ["task-1#2"]  # the retry's own wire id


def test_a_targeted_task_whose_engine_fails_on_the_peer_comes_back_as_a_503_the_origin_retries(net):
    network, a, b = net
    a.engine_joins("ea", ready=False)
    a.request("task-1")
    a.engine_joins("ea")
    b.dispatch(b.p.remove_engine("t", "eb", "crashed", network.now))
    assert a.p.engine("t", "eb@pod-b") is None and a.p.task_state("task-1") is TaskState.RETRY_PENDING
    network.tick(RETRY_DELAY)
    assert [t.id for t in a.engine_inbox["ea"]] == ["task-1#2"]  # the retry's own wire id
    a.engine_says("ea", http("task-1#2", body=b"ok"))
    assert [r.http_response.body for r in a.client["task-1"]] == [b"ok"]


def test_a_client_that_goes_away_stops_the_engine_on_the_peer(net):
    network, a, b = net
    a.request("task-1", request=chat(stream=True))
    a.dispatch(a.p.cancel("task-1", network.now))
    cancel = b.engine_inbox["eb"][-1]
    assert cancel.request.cancel_task.task_id == "task-1"
    assert not b.p.has_task("task-1")
    assert a.p.counters.results_ignored == 0  # the peer's answer to the cancel request is not a stray result


def test_a_shutting_down_peer_gets_no_new_tasks_and_finishes_the_ones_it_has(net):
    network, a, b = net
    dialled = network.links[0][0]
    a.request("task-1")
    dialled.shutdown(network.now)
    network.pump()
    assert a.p.engine("t", "eb@pod-b").routable is False
    a.request("task-2")
    assert a.p.task_state("task-2") is TaskState.WAITING
    assert not dialled.drained
    b.engine_says("eb", http("task-1", body=b"done"))
    assert [r.http_response.body for r in a.client["task-1"]] == [b"done"]
    assert dialled.drained


def test_when_the_peer_stream_ends_both_sides_clean_up(net):
    network, a, b = net
    a.engine_joins("ea", ready=False)
    a.request("task-1", request=chat(stream=True))
    b.engine_says("eb", http("task-1"))
    dialled, _, accepted_peer, _ = network.links[0]
    a.dispatch(accepted_peer.closed(network.now))
    b.dispatch(dialled.closed(network.now))
    assert a.failed["task-1"].status == 502  # lost after its response started: no retry
    assert b.engine_inbox["eb"][-1].request.cancel_task.task_id == "task-1"
    assert a.p.engine("t", "eb@pod-b") is None and not b.p.has_task("task-1")


def test_an_adapter_can_name_its_own_object_as_the_route_of_the_peer_engines():
    p = Processor()
    stream = object()
    s = AcceptedPeer(p, route=stream)
    s.message_received(report("pod-b", ("t", "e1", True)), T0)
    assert p.engine("t", "e1@pod-b").route is stream
    send = one(submit(p, "a"), SendTask)
    assert send.route is stream and send.task.id == "a"
    assert one(s.message_received(result_msg(http("a")), T0), DeliverResult).last
    s.closed(T0)
    assert p.engine("t", "e1@pod-b") is None


# --- two gateways, random interleavings -------------------------------------------------

EXCHANGE_OPS = {
    "request": st.tuples(st.just("request"), st.booleans(), st.sampled_from([None, 3.0, 30.0])),
    "answer": st.tuples(st.just("answer"), st.sampled_from("ab"), st.integers(0, 20),
                        st.sampled_from(["next"] * 5 + ["last"] * 2 + ["503", "500"])),
    "engine": st.tuples(st.just("engine"), st.sampled_from("ab"), st.sampled_from([True, True, False])),
    "engine_gone": st.tuples(st.just("engine_gone"), st.sampled_from("ab")),
    "cancel": st.tuples(st.just("cancel"), st.integers(0, 20)),
    "tick": st.tuples(st.just("tick"), st.sampled_from([0.5, 1.0, 5.0, 20.0])),
    "shutdown_b": st.tuples(st.just("shutdown_b")),
    "reconnect": st.tuples(st.just("reconnect")),
}
EXCHANGE_WEIGHTS = {"request": 4, "answer": 10, "engine": 2, "engine_gone": 1, "cancel": 1, "tick": 2,
                    "shutdown_b": 1, "reconnect": 1}
exchange_ops = st.sampled_from(
    [kind for kind, weight in EXCHANGE_WEIGHTS.items() for _ in range(weight)]).flatmap(EXCHANGE_OPS.__getitem__)


class Exchange:
    """Gateways A (clients) and B (engine eb) wired by a dialled peer and accepted peer; A has engine ea too."""

    def __init__(self) -> None:
        self.net = Network()
        self.a, self.b = Gateway("pod-a", self.net), Gateway("pod-b", self.net)
        self.requested: list[str] = []
        self.cancelled: set[str] = set()
        self.answered: dict[tuple[str, str], int] = {}  # (gateway, task id) -> results the engine sent
        self.b.engine_joins("eb")
        self.net.connect(self.b, self.a)

    def gateway(self, name: str) -> Gateway:
        return self.a if name == "a" else self.b

    def step(self, op: tuple) -> None:  # type: ignore[type-arg]
        kind = op[0]
        if kind == "request":
            task_id = f"r{len(self.requested)}"
            self.requested.append(task_id)
            deadline = None if op[2] is None else self.net.now + op[2]
            self.a.request(task_id, request=chat(stream=op[1]), deadline=deadline)
        elif kind == "answer":
            gateway = self.gateway(op[1])
            engine_id = f"e{op[1]}"
            tasks = [t for t in gateway.engine_inbox[engine_id] if t.request.WhichOneof("request") == "chat_completion"]
            if not tasks:
                return
            task = tasks[op[2] % len(tasks)]
            sent = self.answered.get((op[1], task.id), 0)
            how = op[3]
            if how in ("503", "500"):
                result = http(task.id, int(how), index=sent)
            elif sent == 0:
                result = http(task.id)
            else:
                result = sse(task.id, sent, last=how == "last")
            self.answered[(op[1], task.id)] = sent + 1
            gateway.engine_says(engine_id, result)
        elif kind == "engine":
            self.gateway(op[1]).engine_joins(f"e{op[1]}", ready=op[2])
        elif kind == "engine_gone":
            gateway = self.gateway(op[1])
            gateway.dispatch(gateway.p.close_route(f"engine:e{op[1]}", "engine stream ended", self.net.now))
        elif kind == "cancel":
            live = [t for t in self.requested if t not in self.a.ended and t not in self.cancelled]
            if live:
                task_id = live[op[1] % len(live)]
                self.cancelled.add(task_id)
                self.a.dispatch(self.a.p.cancel(task_id, self.net.now))
        elif kind == "tick":
            self.net.tick(op[1])
        elif kind == "shutdown_b":
            for dialled, *_ in self.net.links:
                dialled.shutdown(self.net.now)
            self.net.pump()
        elif kind == "reconnect":
            self.net.disconnect()
            self.net.connect(self.b, self.a)
        for task_id in self.requested:
            assert self.a.p.has_task(task_id) == (task_id not in self.a.ended and task_id not in self.cancelled)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(exchange_ops, min_size=20, max_size=60))
def test_through_two_gateways_every_request_ends_exactly_once_whatever_the_interleaving(script):
    ex = Exchange()
    for op in script:
        ex.step(op)
    ex.net.disconnect()
    for _ in range(20):
        deadlines = [d for d in (ex.a.p.next_deadline(), ex.b.p.next_deadline()) if d is not None]
        if not deadlines:
            break
        ex.net.tick(max(0.0, min(deadlines) - ex.net.now))
    assert sorted(ex.a.ended | ex.cancelled) == sorted(ex.requested)
    assert not ex.a.ended & ex.cancelled
    assert ex.a.p.status()["tasks"] == 0 and ex.b.p.status()["tasks"] == 0


def test_a_draining_peers_engines_get_no_new_tasks_whatever_readiness_they_report():
    p = Processor(ProcessorConfig(queue_timeout=5))
    s = AcceptedPeer(p)
    s.message_received(report("pod-b", ("t", "e1", True)), T0)
    assert not s.peer_draining and p.engine("t", "e1@pod-b").routable
    draining = report("pod-b", ("t", "e1", True))
    draining.server_status.draining = True
    s.message_received(draining, T0)
    assert s.peer_draining and not p.engine("t", "e1@pod-b").routable
    assert not only(submit(p, "a"), SendTask)
    # The peer came back (a new process under the same name, not draining): routable again.
    assert only(s.message_received(report("pod-b", ("t", "e1", True)), T0), SendTask)
