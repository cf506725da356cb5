"""A gateway in miniature for engine-agent tests: a real gRPC server that plays the gateway's ``ProcessTasks`` side."""

from __future__ import annotations

from collections.abc import Callable, Generator
from typing import Any

import pytest
import pytest_twisted
from twisted.internet import defer, reactor, task

from infx.agent.engine import PROCESS_TASKS
from infx.transport import CallKind, GrpcServer, ServerCall, listen_grpc
from protocol.pb import worker_pb2


TIMEOUT = 10.0


def with_timeout(d: defer.Deferred[Any]) -> defer.Deferred[Any]:
    return d.addTimeout(TIMEOUT, reactor)


class GatewayStream:
    """One ProcessTasks call as the gateway sees it."""

    def __init__(self, call: ServerCall) -> None:
        self.call = call
        self.statuses: list[worker_pb2.EngineStatus] = []
        self.results: dict[str, list[worker_pb2.TaskResult]] = {}
        self.end: defer.Deferred[None] = defer.Deferred()
        self.half_closed = False

    def send(self, task: worker_pb2.Task) -> None:
        self.call.send(worker_pb2.ProcessTasksResponse(new_task=task))

    @defer.inlineCallbacks
    def next_message(self) -> Generator[Any, Any, worker_pb2.ProcessTasksRequest | None]:
        message = yield with_timeout(self.call.recv())
        if message is None:
            self.half_closed = True
        elif message.HasField("engine_status"):
            self.statuses.append(message.engine_status)
        else:
            self.results.setdefault(message.task_result.task_id, []).append(message.task_result)
        return message

    @defer.inlineCallbacks
    def wait_for(self, done: Callable[[], bool]) -> Generator[Any, Any, None]:
        while not done():
            message = yield self.next_message()
            assert message is not None or done(), "the engine half-closed the stream early"

    @defer.inlineCallbacks
    def complete(self, task_id: str) -> Generator[Any, Any, list[worker_pb2.TaskResult]]:
        """Read until the task's results are complete; return them."""
        def finished() -> bool:
            results = self.results.get(task_id, [])
            if not results:
                return False
            last = results[-1]
            if last.WhichOneof("message") == "server_sent_event":
                return last.server_sent_event.is_last_event
            head = results[0].http_response
            return "text/event-stream" not in head.header.get("Content-Type", worker_pb2.HeaderValue()).values

        yield self.wait_for(finished)
        return self.results[task_id]


class FakeGateway:
    """Accepts ProcessTasks calls and hands each to the test as a GatewayStream."""

    def __init__(self) -> None:
        self.streams: defer.DeferredQueue[GatewayStream] = defer.DeferredQueue()
        self.all: list[GatewayStream] = []
        self.server = GrpcServer(reactor)
        self.server.add_method(PROCESS_TASKS, self.handle, worker_pb2.ProcessTasksRequest.FromString,
                               worker_pb2.ProcessTasksResponse.SerializeToString, kind=CallKind.STREAM_STREAM)

    def handle(self, call: ServerCall) -> defer.Deferred[None]:
        stream = GatewayStream(call)
        self.all.append(stream)
        self.streams.put(stream)
        return stream.end

    def end_all(self) -> None:
        for stream in self.all:
            if not stream.end.called:
                stream.end.callback(None)

    def next_stream(self) -> defer.Deferred[GatewayStream]:
        return with_timeout(self.streams.get())


def control(task_id: str, **request: Any) -> worker_pb2.Task:
    return worker_pb2.Task(id=task_id, request=worker_pb2.TaskRequest(**request))


@pytest.fixture
def gateway() -> Generator[tuple[FakeGateway, int], None, None]:
    gw = FakeGateway()
    port = pytest_twisted.blockon(listen_grpc(reactor, "tcp:0:interface=127.0.0.1", gw.server))
    yield gw, port.getHost().port
    pytest_twisted.blockon(defer.maybeDeferred(port.stopListening))
