"""Backpressure from engines that do not read, in-process on loopback (issue #13, item 4).

The real gateway service tree runs on the reactor with its built-in echo
engine; a hostile engine (``tools.bench.attacks.H2Peer`` with a zero
flow-control window, on a thread) registers for the same model and never
reads a byte of what it is sent. Being in-process, the test reads what the
gateway has queued on the hostile engine's stream.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Generator, Iterator
from typing import Any

import pytest
import pytest_twisted
from twisted.internet import reactor, task, threads

from infx.config import build_config
from infx.service import GatewayService, build_gateway, builtin_engine_id
from protocol.processor.route_flow import MAX_ROUTE_QUEUED_BYTES
from protocol.pb import status_pb2, worker_pb2
from tools.bench.attacks import H2Peer, Outcome, Target, grpc_message, request_headers

LOOPBACK_OPTIONS = {name: "tcp:0:interface=127.0.0.1" for name in ("http", "worker_grpc", "internal_grpc")}
TASK_BYTES = 1024 * 1024


@pytest.fixture
def gateway() -> Iterator[GatewayService]:
    config = build_config({"echo_models": "m", "echo_token_delay": 0, "route_stuck_timeout": 3}, LOOPBACK_OPTIONS)
    service = build_gateway(reactor, config)
    service.startService()
    yield service
    pytest_twisted.blockon(service.stopService())


def until(predicate: Any, what: str, timeout: float = 10.0) -> Generator[Any, Any, Any]:
    deadline = reactor.seconds() + timeout
    while not (value := predicate()):
        assert reactor.seconds() < deadline, f"timed out waiting for {what}"
        yield task.deferLater(reactor, 0.02, lambda: None)
    return value


def post_chat(port: int, content: str) -> tuple[int, str]:
    import http.client

    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": content}]})
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        connection.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
        response = connection.getresponse()
        data = json.loads(response.read())
        return response.status, data["choices"][0]["message"]["content"] if response.status == 200 else ""
    finally:
        connection.close()


@pytest_twisted.inlineCallbacks
def test_an_engine_that_never_reads_holds_a_bounded_queue_and_its_task_fails_over(gateway: GatewayService):
    worker_port = gateway.worker_grpc.port.getHost().port
    http_port = gateway.http.port.getHost().port
    yield from until(lambda: gateway.processor.engine("default", builtin_engine_id(gateway.pod_name)),
                     "the echo engine")
    target = Target("127.0.0.1", http_port, worker_port, 0)
    outcome = Outcome("zero-window engine")
    peer_done = threading.Event()

    def hostile_engine() -> None:
        peer = H2Peer(target, worker_port, outcome, initial_window=0)
        stream_id = peer.open(request_headers(target, "worker"))
        status = status_pb2.EngineStatus(engine_id="sink", ready=True, models=[
            status_pb2.EngineStatus.Model(id="m", is_ready=True)])
        peer.send_data(stream_id, grpc_message(worker_pb2.ProcessTasksRequest(engine_status=status).SerializeToString()))
        while not peer_done.is_set() and not peer.gone:
            peer.pump(0.1)
        peer.close()

    hostile = threads.deferToThread(hostile_engine)
    yield from until(lambda: gateway.processor.engine("default", "sink"), "the hostile engine to register")
    (stream,) = [s for s in gateway.workers.streams if gateway.processor.engine("default", "sink").route is s]
    # The hostile engine has no task in flight and a name after the echo engine's, so the first
    # request of a burst goes to the echo engine, the second to it (fewest in flight), and so on.
    replies = [threads.deferToThread(post_chat, http_port, f"{n} " + "x" * TASK_BYTES) for n in range(24)]
    most_queued = 0
    while not all(reply.called for reply in replies):
        most_queued = max(most_queued, stream.call.buffered_amount)
        yield task.deferLater(reactor, 0.01, lambda: None)
    results = []
    for reply in replies:
        results.append((yield reply))
    # Every request was answered by the echo engine, those first sent to the hostile engine
    # after its stream was closed as stuck.
    assert [status for status, _ in results] == [200] * 24
    assert all(content.startswith(f"{n} ") or f"{n} x" in content for n, (_, content) in enumerate(results))
    assert 0 < most_queued <= MAX_ROUTE_QUEUED_BYTES + 2 * TASK_BYTES
    assert outcome.resets, outcome.summary()
    assert gateway.processor.engine("default", "sink") is None
    peer_done.set()
    yield hostile


def post_sink(port: int, content: str, timeout: float) -> int:
    """A chat request for the model only the hostile engine serves, ending after ``timeout`` seconds."""
    import http.client

    body = json.dumps({"model": "sink", "messages": [{"role": "user", "content": content}]})
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        connection.request("POST", "/v1/chat/completions", body,
                           {"Content-Type": "application/json", "x-request-timeout": str(timeout)})
        response = connection.getresponse()
        response.read()
        return response.status
    finally:
        connection.close()


def tasks_in(data: bytes) -> list[worker_pb2.Task]:
    """The tasks of the whole gRPC messages in ``data`` (a ProcessTasks response stream)."""
    tasks = []
    while len(data) >= 5:
        length = int.from_bytes(data[1:5], "big")
        if len(data) < 5 + length:
            break
        tasks.append(worker_pb2.ProcessTasksResponse.FromString(bytes(data[5:5 + length])).new_task)
        data = data[5 + length:]
    return tasks


@pytest.fixture
def patient_gateway() -> Iterator[GatewayService]:
    """A gateway that closes no stuck stream during the test: what it holds is what it queued."""
    config = build_config({"echo_models": "m", "echo_token_delay": 0, "route_stuck_timeout": 600}, LOOPBACK_OPTIONS)
    service = build_gateway(reactor, config)
    service.startService()
    yield service
    pytest_twisted.blockon(service.stopService())


@pytest_twisted.inlineCallbacks
def test_a_zero_window_engine_holds_nothing_once_its_requests_ended_and_never_gets_their_tasks(
        patient_gateway: GatewayService):
    """Issue #22 item 6: requests sent to an engine that keeps its window at zero end (504 at
    their deadline) and their tasks leave its queue unsent, so that nothing stays queued for it;
    when it opens its window at last it gets none of them, counts as draining again, and the
    next request's task is what it reads."""
    gateway = patient_gateway
    worker_port = gateway.worker_grpc.port.getHost().port
    http_port = gateway.http.port.getHost().port
    target = Target("127.0.0.1", http_port, worker_port, 0)
    outcome = Outcome("zero-window engine")
    window_opened = threading.Event()
    peer_done = threading.Event()
    stream_id: list[int] = []
    received: dict[int, bytearray] = {}

    def hostile_engine() -> None:
        peer = H2Peer(target, worker_port, outcome, initial_window=0)
        stream_id.append(peer.open(request_headers(target, "worker")))
        status = status_pb2.EngineStatus(engine_id="zero-window", ready=True, models=[
            status_pb2.EngineStatus.Model(id="sink", is_ready=True)])
        peer.send_data(stream_id[0], grpc_message(
            worker_pb2.ProcessTasksRequest(engine_status=status).SerializeToString()))
        opened = False
        while not peer_done.is_set() and not peer.gone:
            if window_opened.is_set() and not opened:
                opened = True
                peer.open_window(stream_id[0], 64 * TASK_BYTES)
            peer.pump(0.05)
        received.update(peer.received)
        peer.close()

    hostile = threads.deferToThread(hostile_engine)
    yield from until(lambda: gateway.processor.engine("default", "zero-window"), "the hostile engine to register")
    (stream,) = [s for s in gateway.workers.streams if gateway.processor.engine("default", "zero-window").route is s]
    expired = [threads.deferToThread(post_sink, http_port, f"expired {n} " + "x" * TASK_BYTES, 1.0) for n in range(8)]
    most_queued = 0
    while not all(reply.called for reply in expired):
        most_queued = max(most_queued, stream.queued_bytes)
        yield task.deferLater(reactor, 0.01, lambda: None)
    assert [reply.result for reply in expired] == [504] * 8
    assert most_queued >= TASK_BYTES  # a task did wait on the stream
    assert stream.queued_bytes == 0 and not stream.closed
    assert gateway.registry.get_sample_value("infx_route_withdrawn_tasks_total") >= 1
    assert gateway.processor.engine("default", "zero-window").route is stream

    # Open now, the window lets the stream drain: the fresh request's task goes out (at once,
    # or from the queue once the gateway heard of the window), and the engine never answers it.
    window_opened.set()
    fresh = threads.deferToThread(post_sink, http_port, "fresh " + "y" * 1000, 5.0)
    yield from until(lambda: fresh.called, "the fresh request to end")
    assert fresh.result == 504
    peer_done.set()
    yield hostile
    got = tasks_in(received.get(stream_id[0], bytearray()))
    work = [t for t in got if t.request.WhichOneof("request") != "cancel_task"]
    assert len(work) == 1 and b"fresh" in work[0].SerializeToString(), [t.id for t in got]
    # Its cancel (after its 504) went out too: the engine had read the task.
    assert [t.request.cancel_task.task_id for t in got if t not in work] == [work[0].id]
