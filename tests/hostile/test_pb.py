"""Hostile protobuf payloads from engines and peer gateways.

Random bytes and mutated valid messages go where the wire puts them:
``ProcessTasksRequest`` (``EngineStatus``, ``TaskResult``) into the worker
service and the processor, ``ProcessTasksInternalRequest`` (``ServerStatus``,
``TaskResult``) into a :class:`~protocol.exchange.accepted_peer.AcceptedPeer`,
``ProcessTasksInternalResponse`` into a :class:`~protocol.exchange.dialled_peer.DialledPeer`.

What each must end in: a message that does not decode ends its stream with
INTERNAL; one that decodes but breaks the protocol raises the documented
:class:`PeerProtocolError` (the stream's INVALID_ARGUMENT) or fails the
affected task with a 502; nothing else escapes, and a task served by a
well-behaved engine alongside still completes.
"""

from __future__ import annotations

from typing import Any

import pytest
from google.protobuf.message import DecodeError
from hypothesis import HealthCheck, given, settings, strategies as st
from prometheus_client import CollectorRegistry
from twisted.internet import task
from twisted.internet.testing import StringTransport

from infx.gateway.auth import KeyStore
from infx.gateway.dispatcher import Dispatcher
from infx.gateway.metrics import GatewayMetrics
from infx.gateway.workers import PROCESS_TASKS, WorkerService
from infx.transport import GrpcServer
from protocol.exchange.dialled_peer import DialledPeerConfig
from protocol.exchange.accepted_peer import AcceptedPeer
from protocol.grpc import CallEnded, GrpcConfig, GrpcConnection, StatusCode
from protocol.pb import internal_pb2, status_pb2, worker_pb2
from protocol.processor.core import Processor
from protocol.processor.config import ProcessorConfig
from protocol.processor.effects import DeliverResult, FailRequest, SendTask
from protocol.processor.errors import PeerProtocolError
from protocol.processor.keys import Locality
from tests.support.dialled_peer import BufferedReceiver

FEW = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def chat_request(model: str = "m", stream: bool = False) -> worker_pb2.TaskRequest:
    request = worker_pb2.TaskRequest()
    request.chat_completion.model = model
    request.chat_completion.stream = stream
    request.chat_completion.messages.add(role="user").content.add(type="text", text="hi")
    return request


def status(engine_id: str, *models: str, ready: bool = True) -> status_pb2.EngineStatus:
    return status_pb2.EngineStatus(engine_id=engine_id, ready=ready, models=[
        status_pb2.EngineStatus.Model(id=m, is_ready=True) for m in models])


def ok_result(task_id: str) -> worker_pb2.TaskResult:
    return worker_pb2.TaskResult(task_id=task_id, result_index=0, http_response=worker_pb2.HttpResponse(
        status_code=200, body=b'{"choices": []}'))


def flip(data: st.DataObject, message: Any) -> bytes:
    """The message's wire bytes with a few bytes changed, cut, or extended."""
    wire = bytearray(message.SerializeToString())
    for _ in range(data.draw(st.integers(1, 4))):
        kind = data.draw(st.integers(0, 2))
        if kind == 0 and wire:
            wire[data.draw(st.integers(0, len(wire) - 1))] = data.draw(st.integers(0, 255))
        elif kind == 1 and wire:
            del wire[data.draw(st.integers(0, len(wire) - 1)):]
        else:
            wire += data.draw(st.binary(max_size=12))
    return bytes(wire)


def decode(cls: Any, wire: bytes) -> Any | None:
    """What a deserializer gives the handler, or None where the transport answers INTERNAL."""
    try:
        return cls.FromString(wire)
    except DecodeError:
        return None


# -- engines -> processor ------------------------------------------------------------------


@FEW
@given(st.data())
def test_any_process_tasks_request_from_an_engine_leaves_other_engines_serving(data):
    """Whatever a hostile engine sends (random bytes, mutated statuses and
    results), each message decodes or is refused, the processor stays
    consistent, and a task for a well-behaved engine completes."""
    processor = Processor(ProcessorConfig(retry_delay=0))
    good, bad = object(), object()
    processor.update_engine(good, "t", status("good", "g"), Locality.LOCAL, 0)
    processor.update_engine(bad, "t", status("bad", "m"), Locality.LOCAL, 0)
    sent = processor.submit(task_id="t-bad", tenant_id="t", request=chat_request("m", True), origin="o", now=1)
    assert [e.route for e in sent if isinstance(e, SendTask)] == [bad]
    honest = [
        worker_pb2.ProcessTasksRequest(engine_status=status("bad", "m", "g")),
        worker_pb2.ProcessTasksRequest(task_result=ok_result("t-bad")),
        worker_pb2.ProcessTasksRequest(task_result=worker_pb2.TaskResult(
            task_id="t-bad", result_index=1,
            server_sent_event=worker_pb2.ServerSentEvent(data=b"data: {}\n\n", is_last_event=True))),
    ]
    ended: list[Any] = []
    for _ in range(data.draw(st.integers(1, 6))):
        choice = data.draw(st.integers(0, 3))
        if choice == 0:
            wire = data.draw(st.binary(max_size=80))
        else:
            wire = flip(data, data.draw(st.sampled_from(honest)))
        message = decode(worker_pb2.ProcessTasksRequest, wire)
        if message is None:
            continue
        kind = message.WhichOneof("message")
        if kind == "engine_status":
            if not message.engine_status.engine_id:
                continue  # the worker service answers INVALID_ARGUMENT (tested below)
            effects = processor.update_engine(bad, "t", message.engine_status, Locality.LOCAL, 2)
        elif kind == "task_result":
            effects = processor.receive_result(bad, message.task_result, 2)
        else:
            continue
        ended += [e for e in effects if isinstance(e, FailRequest) or (isinstance(e, DeliverResult) and e.last)]
    assert len(ended) <= 1  # the hostile engine's task ends at most once
    effects = processor.submit(task_id="t-good", tenant_id="t", request=chat_request("g"), origin="o2", now=3)
    (send,) = [e for e in effects if isinstance(e, SendTask)]
    effects = processor.receive_result(send.route, ok_result(send.task.id), 4)
    assert [(type(e), e.last) for e in effects if isinstance(e, DeliverResult)] == [(DeliverResult, True)]
    # Past every deadline nothing is left behind, whatever the hostile engine did.
    processor.handle_timeout(10_000)
    assert processor.status()["tasks"] == 0


# -- peers -> accepted peer (ServerStatus, TaskResult) ----------------------------------------------


@FEW
@given(st.data())
def test_any_internal_request_from_a_peer_is_taken_or_refused_as_a_protocol_error(data):
    """A peer's ServerStatus / TaskResult, random or mutated: the accepted peer takes it
    or raises PeerProtocolError (the stream ends INVALID_ARGUMENT); a local
    engine is never taken over by the peer's report."""
    processor = Processor()
    local = object()
    processor.update_engine(local, "t", status("local", "m"), Locality.LOCAL, 0)
    accepted_peer = AcceptedPeer(processor)
    report = internal_pb2.ServerStatus(pod_name="peer")
    report.engine_statuses.add(engine_status=status("remote", "m"), tenant_id="t")
    report.engine_statuses.add(engine_status=status("local", "m", ready=False), tenant_id="t")
    honest = [internal_pb2.ProcessTasksInternalRequest(server_status=report),
              internal_pb2.ProcessTasksInternalRequest(task_result=ok_result("x"))]
    for _ in range(data.draw(st.integers(1, 5))):
        if data.draw(st.booleans()):
            wire = data.draw(st.binary(max_size=80))
        else:
            wire = flip(data, data.draw(st.sampled_from(honest)))
        message = decode(internal_pb2.ProcessTasksInternalRequest, wire)
        if message is None:
            continue
        try:
            accepted_peer.message_received(message, 1)
        except PeerProtocolError as error:
            assert error.grpc_status == StatusCode.INVALID_ARGUMENT
    view = processor.engine("t", "local")
    assert view is not None and view.route is local and view.locality is Locality.LOCAL
    accepted_peer.closed(2)
    assert all(processor.engine(k.tenant_id, k.engine_id) is None for k in accepted_peer.engines)


# -- peers -> dialled peer (forwarded tasks) ---------------------------------------------------------


@FEW
@given(st.data())
def test_any_forwarded_task_from_a_peer_runs_is_refused_or_is_a_protocol_error(data):
    """A ProcessTasksInternalResponse, random or mutated: it runs on the named
    local engine, is answered at once with an error result, or raises
    PeerProtocolError; every task it starts ends when the stream closes."""
    processor = Processor()
    engine = object()
    engine_status = status("e1", "m")
    if data.draw(st.booleans()):  # an infx engine, which takes verbatim requests too
        engine_status.infx_capabilities.append("http-request")
    processor.update_engine(engine, "t", engine_status, Locality.LOCAL, 0)
    dialled = BufferedReceiver(processor, DialledPeerConfig(pod_name="me"))
    dialled.connected(0)
    dialled.pop_messages()
    honest = internal_pb2.ProcessTasksInternalResponse(tenant_id="t", new_task=worker_pb2.Task(
        id="f1", engine_id="e1", request=chat_request("m"), timeout_seconds=30))
    for _ in range(data.draw(st.integers(1, 5))):
        wire = data.draw(st.binary(max_size=80)) if data.draw(st.booleans()) else flip(data, honest)
        message = decode(internal_pb2.ProcessTasksInternalResponse, wire)
        if message is None:
            continue
        try:
            effects = dialled.task_received(message, 1)
        except PeerProtocolError:
            continue
        for effect in effects:
            if isinstance(effect, (DeliverResult, FailRequest)) and effect.origin is dialled:
                dialled.deliver(effect)
        for out in dialled.pop_messages():
            assert out.WhichOneof("message") in ("task_result", "server_status")
    dialled.closed(2)
    assert processor.status()["tasks"] == 0


# -- through the worker service: undecodable, invalid and oversized messages ---------------------


class Worker:
    """The worker service on a GrpcServer over StringTransports, with a Clock."""

    def __init__(self, max_message_size: int = 4096) -> None:
        self.clock = task.Clock()
        self.processor = Processor(ProcessorConfig(retry_delay=0))
        self.dispatcher = Dispatcher(self.clock, self.processor, GatewayMetrics(CollectorRegistry()))
        self.server = GrpcServer(self.clock, GrpcConfig(
            client_side=False, max_receive_message_length=max_message_size))
        WorkerService(self.dispatcher, KeyStore.disabled()).register(self.server)

    def engine(self) -> "EngineConnection":
        return EngineConnection(self)


class EngineConnection:
    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        self.protocol = worker.server.buildProtocol(None)
        self.transport = StringTransport()
        self.protocol.makeConnection(self.transport)
        self.client = GrpcConnection(GrpcConfig(client_side=True))
        self.client.initiate(0)
        self.events: list[Any] = []
        self.sid = self.client.start_call(PROCESS_TASKS, now=0)
        self.pump()

    def send(self, payload: bytes) -> None:
        self.client.send_message(self.sid, payload)
        self.pump()

    def pump(self) -> None:
        for _ in range(10):
            out = self.client.data_to_send()
            if out:
                self.protocol.dataReceived(out)
            self.worker.clock.advance(0)
            back = self.transport.value()
            self.transport.clear()
            if back:
                self.events += self.client.receive_data(back, 0)
            if not out and not back:
                return

    def tasks(self) -> list[worker_pb2.Task]:
        from protocol.grpc import MessageReceived

        return [worker_pb2.ProcessTasksResponse.FromString(e.data).new_task
                for e in self.events if isinstance(e, MessageReceived)]

    def status(self) -> StatusCode | None:
        ends = [e for e in self.events if isinstance(e, CallEnded)]
        return ends[0].status if ends else None


def register(connection: EngineConnection, engine_id: str, model: str) -> None:
    connection.send(worker_pb2.ProcessTasksRequest(engine_status=status(engine_id, model)).SerializeToString())


@pytest.mark.parametrize("payload,code", [
    (b"\xff\xff\xff", StatusCode.INTERNAL),
    (worker_pb2.ProcessTasksRequest(engine_status=status_pb2.EngineStatus(ready=True)).SerializeToString(),
     StatusCode.INVALID_ARGUMENT),
    (b"\x0a" + b"\xff" * 6000, StatusCode.RESOURCE_EXHAUSTED),
], ids=["undecodable", "status without engine id", "over max_message_size"])
def test_a_bad_message_ends_that_engines_stream_its_task_fails_over_and_other_engines_serve(payload, code):
    worker = Worker()
    hostile, healthy = worker.engine(), worker.engine()
    register(hostile, "bad", "m")
    register(healthy, "good", "m")
    submitted: list[Any] = []

    class Origin:
        def result_delivered(self, effect: DeliverResult) -> None:
            submitted.append(effect)

        def request_failed(self, effect: FailRequest) -> None:
            submitted.append(effect)

    worker.dispatcher.perform(worker.processor.submit(
        task_id="t1",
        tenant_id="default",
        request=chat_request("m"),
        origin=Origin(),
        now=worker.clock.seconds(),
    ))
    hostile.pump()
    assert [t.id for t in hostile.tasks()] == ["t1"]  # "bad" sorts first among idle engines
    hostile.send(payload)
    assert hostile.status() == code
    assert worker.processor.engine("default", "bad") is None
    healthy.pump()
    (task_,) = healthy.tasks()
    assert worker.processor.attempt_owner(task_.id) == "t1"  # failed over (a new attempt), not failed
    healthy.send(worker_pb2.ProcessTasksRequest(task_result=ok_result(task_.id)).SerializeToString())
    assert [type(e) for e in submitted] == [DeliverResult] and submitted[0].last
    assert healthy.status() is None
