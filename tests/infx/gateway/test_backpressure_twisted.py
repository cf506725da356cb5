"""Backpressure in the Twisted layer, deterministically: ``Clock`` and ``StringTransport``.

The worker service serves one engine whose HTTP/2 client (``h2``, fed by hand)
opens no flow-control window. What the pure processor decides
(``tests/protocol/processor/test_backpressure.py``) is checked here through the real
adapter: the engine stream's send backpressure blocks the route, its queued
bytes stay under the cap, a window update lets the waiting tasks go, and a
route stuck past the timeout is reset with its tasks failing over.
"""

from __future__ import annotations

import struct

import h2.config
import h2.connection
import h2.events
import h2.settings
from prometheus_client import CollectorRegistry
from twisted.internet import task
from twisted.internet.address import IPv4Address
from twisted.internet.testing import StringTransport

from infx.gateway.auth import KeyStore
from infx.gateway.dispatcher import Dispatcher
from infx.gateway.metrics import GatewayMetrics
from infx.gateway.workers import PROCESS_TASKS, EngineStream, WorkerService
from infx.transport import GrpcServer
from protocol.pb import chat_pb2, status_pb2, worker_pb2
from protocol.processor.core import Processor, ProcessorConfig, TaskState
from protocol.processor.effects import DeliverResult, FailRequest

CAP = 256 * 1024
TASK_BYTES = 100 * 1024


class Origin:
    """Records how each submitted task ended."""

    def __init__(self) -> None:
        self.failed: dict[str, FailRequest] = {}

    def result_delivered(self, effect: DeliverResult) -> None:
        raise AssertionError("no engine answers in these tests")

    def request_failed(self, effect: FailRequest) -> None:
        self.failed[effect.task_id] = effect


class Link:
    """A worker service on a Clock and one engine's h2 client, over a StringTransport."""

    def __init__(self, stuck_timeout: float = 5.0) -> None:
        self.clock = task.Clock()
        self.clock.advance(1_000)
        self.processor = Processor(ProcessorConfig(route_stuck_timeout=stuck_timeout, retry_delay=0,
                                                   queue_timeout=3))
        self.dispatcher = Dispatcher(self.clock, self.processor, GatewayMetrics(CollectorRegistry()))
        self.workers = WorkerService(self.dispatcher, KeyStore.disabled(), max_queued_bytes=CAP)
        server = GrpcServer(self.clock)
        self.workers.register(server)
        self.protocol = server.buildProtocol(IPv4Address("TCP", "127.0.0.1", 1))
        self.transport = StringTransport()
        self.protocol.makeConnection(self.transport)
        self.client = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding="utf-8"))
        self.client.local_settings = h2.settings.Settings(client=True, initial_values={
            h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 0})
        self.client.initiate_connection()
        self.events: list[object] = []
        self.origin = Origin()
        self.submitted = 0
        self.pump()

    def pump(self) -> None:
        for _ in range(100):
            self.clock.advance(0)
            out = self.client.data_to_send()
            if out:
                self.protocol.dataReceived(out)
            self.clock.advance(0)
            back = self.transport.value()
            self.transport.clear()
            if back:
                self.events += self.client.receive_data(back)
            if not out and not back:
                return
        raise AssertionError("the link never went quiet")

    def register_engine(self, engine_id: str = "z") -> int:
        stream_id = self.client.get_next_available_stream_id()
        self.client.send_headers(stream_id, [(":method", "POST"), (":scheme", "http"), (":path", PROCESS_TASKS),
                                             (":authority", "gw"), ("content-type", "application/grpc"),
                                             ("te", "trailers")])
        status = status_pb2.EngineStatus(engine_id=engine_id, ready=True,
                                         models=[status_pb2.EngineStatus.Model(id="m", is_ready=True)])
        message = worker_pb2.ProcessTasksRequest(engine_status=status).SerializeToString()
        self.client.send_data(stream_id, struct.pack(">BI", 0, len(message)) + message)
        self.pump()
        return stream_id

    @property
    def stream(self) -> EngineStream:
        (stream,) = self.workers.streams
        return stream

    def submit(self, count: int) -> list[str]:
        ids = []
        for _ in range(count):
            self.submitted += 1
            task_id = f"t{self.submitted}"
            chat = chat_pb2.CreateChatCompletionRequest(model="m")
            chat.messages.add(role="user").content.add(type="text", text="x" * TASK_BYTES)
            request = worker_pb2.TaskRequest(chat_completion=chat)
            self.dispatcher.perform(self.processor.submit(
                task_id=task_id,
                tenant_id="default",
                request=request,
                origin=self.origin,
                now=self.clock.seconds(),
            ))
            ids.append(task_id)
        self.pump()
        return ids

    def tasks_received(self) -> int:
        return sum(1 for e in self.events if isinstance(e, h2.events.DataReceived))

    def states(self, ids: list[str]) -> list[TaskState]:
        return [self.processor.task_state(task_id) for task_id in ids]


def test_a_zero_window_engine_gets_one_task_and_the_rest_wait_until_it_opens_its_window():
    link = Link()
    stream_id = link.register_engine()
    ids = link.submit(10)
    assert link.states(ids) == [TaskState.DISPATCHED] + [TaskState.WAITING] * 9
    assert TASK_BYTES < link.stream.call.buffered_amount < TASK_BYTES + 1024
    assert link.tasks_received() == 0
    # The engine reads: the queue drains, the route is writable again, and the waiting tasks go.
    link.client.increment_flow_control_window(1 << 30)
    link.client.increment_flow_control_window(1 << 30, stream_id=stream_id)
    link.pump()
    assert link.processor.waiting_task_ids("default", "m") == []
    assert link.states(ids) == [TaskState.DISPATCHED] * 10
    assert not link.processor.counters.retries


def test_a_burst_for_an_engine_that_does_not_read_stops_at_the_queue_cap_without_retries():
    """Ten waiting tasks meet a new engine in one input: the stream takes tasks up to
    its cap of queued bytes and refuses the rest, which go back to the queue unharmed."""
    link = Link()
    ids = link.submit(10)
    assert link.states(ids) == [TaskState.WAITING] * 10
    link.register_engine()
    dispatched = [i for i, state in zip(ids, link.states(ids)) if state is TaskState.DISPATCHED]
    assert 1 < len(dispatched) < 10
    assert link.stream.call.buffered_amount <= CAP + TASK_BYTES + 1024
    assert link.processor.waiting_task_ids("default", "m") == ids[len(dispatched):]
    assert not link.processor.counters.retries


def test_an_engine_stuck_past_the_timeout_is_reset_and_its_tasks_fail_over():
    link = Link(stuck_timeout=5.0)
    stream_id = link.register_engine()
    ids = link.submit(3)
    link.clock.advance(4.9)
    link.pump()
    assert link.processor.engine("default", "z") is not None
    link.clock.advance(0.2)
    link.pump()
    # The status would wait behind the unread task forever: the stream is reset instead.
    resets = [e for e in link.events if isinstance(e, h2.events.StreamReset)]
    assert [(e.stream_id, e.error_code) for e in resets] == [(stream_id, h2.errors.ErrorCodes.CANCEL)]
    assert link.processor.engine("default", "z") is None and link.workers.streams == set()
    # With no engine left for the model, every task waits and then ends with 503.
    link.clock.advance(3)
    link.pump()
    assert sorted(link.origin.failed) == sorted(ids)
    assert {effect.status for effect in link.origin.failed.values()} == {503}


def test_a_task_whose_request_ended_while_queued_whole_is_withdrawn_and_no_cancel_follows():
    """The client of the task on the engine's queue goes away: the task leaves the queue
    unsent, so the engine, reading at last, gets neither it nor a cancel for it, only the
    task that was waiting; the engine counted as blocked until it read."""
    link = Link()
    stream_id = link.register_engine()
    first, second = link.submit(2)
    assert link.states([first, second]) == [TaskState.DISPATCHED, TaskState.WAITING]
    link.dispatcher.perform(link.processor.cancel(first, link.clock.seconds()))
    link.pump()
    assert link.stream.queued_bytes == 0
    assert link.dispatcher.metrics.registry.get_sample_value("infx_route_withdrawn_tasks_total") == 1
    # Withdrawing is not reading: the route takes no task until the engine opens its window.
    assert link.states([second]) == [TaskState.WAITING]
    link.client.increment_flow_control_window(1 << 30)
    link.client.increment_flow_control_window(1 << 30, stream_id=stream_id)
    link.pump()
    assert link.states([second]) == [TaskState.DISPATCHED]
    data = b"".join(e.data for e in link.events if isinstance(e, h2.events.DataReceived))
    sent = []
    while data:
        length = int.from_bytes(data[1:5], "big")
        sent.append(worker_pb2.ProcessTasksResponse.FromString(data[5:5 + length]).new_task)
        data = data[5 + length:]
    assert [task_.id for task_ in sent] == [second]


def test_a_task_past_its_deadline_on_the_queue_is_withdrawn_and_the_stream_is_still_closed_when_stuck():
    """The task waiting whole on a zero-window engine's queue ends 504 at its deadline and
    leaves the queue; the engine still reads nothing, so its stream is reset once stuck."""
    link = Link(stuck_timeout=5.0)
    stream_id = link.register_engine()
    chat = chat_pb2.CreateChatCompletionRequest(model="m")
    chat.messages.add(role="user").content.add(type="text", text="x" * TASK_BYTES)
    link.dispatcher.perform(link.processor.submit(
        task_id="late", tenant_id="default", request=worker_pb2.TaskRequest(chat_completion=chat),
        origin=link.origin, now=link.clock.seconds(), deadline=link.clock.seconds() + 2))
    link.pump()
    assert link.stream.queued_bytes > TASK_BYTES
    link.clock.advance(2)
    link.pump()
    assert link.origin.failed["late"].status == 504
    assert link.stream.queued_bytes == 0
    link.clock.advance(3.1)
    link.pump()
    # Nothing is queued any more, so the status is not stuck behind it: UNAVAILABLE, not a reset.
    (trailers,) = [e for e in link.events if isinstance(e, h2.events.TrailersReceived)]
    assert trailers.stream_id == stream_id and dict(trailers.headers)["grpc-status"] == "14"
    assert link.processor.engine("default", "z") is None
