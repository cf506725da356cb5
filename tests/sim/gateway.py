"""A simulated gateway: the real processor, receivers, senders and gRPC machines, glued as infx glues them.

Rules this file keeps: every decision is the pure machines'; this file only
performs their effects, in the order returned, the way ``infx/dispatcher.py``
(effects, timer), ``infx/workers.py`` (engine streams) and the peer exchange
(receiver/sender adapters as ``protocol/receiver.py`` and
``protocol/sender.py`` describe them) do. After every input the gateway
flushes: gRPC events are handled, bytes go to the links, and each machine's
one timer is re-armed from its ``next_deadline()``. Along the way it reports
what the invariants need to see (tasks sent, statuses advertised).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Union

from protocol.grpc import (
    CallEnded,
    CallStarted,
    Event,
    GrpcConfig,
    InputEnded,
    LocalProtocolError,
    MessageReceived,
    ResponseHeadersReceived,
    StatusCode,
)
from protocol.pb import internal_pb2, worker_pb2
from protocol.processor import Processor
from protocol.processor_types import (
    CancelTaskOnEngine,
    CloseEngine,
    DeliverResult,
    Effect,
    EnginesRemoved,
    FailRequest,
    Locality,
    LocalEnginesChanged,
    ProcessorConfig,
    RemoteProtocolError,
    SendTask,
    TaskQueued,
)
from protocol.peers import Backoff
from protocol.receiver import Receiver, ReceiverConfig, ReceiverState
from protocol.sender import Sender
from tests.sim.invariants import NO_LOOP, ClientRequest
from tests.sim.link import Link
from tests.sim.wire import GrpcEnd

if TYPE_CHECKING:
    from tests.sim.cluster import Cluster

PROCESS_TASKS = "/llmariner.inference.server.v1.InferenceWorkerService/ProcessTasks"
PROCESS_TASKS_INTERNAL = "/llmariner.inference.server.v1.InferenceInternalService/ProcessTasksInternal"

#: The exchanger's default redial backoff (ExchangerConfig.backoff).
REDIAL_BACKOFF = Backoff(initial=0.2, factor=2.0, cap=10.0, jitter=0.5)
SERVER_GRPC = GrpcConfig(client_side=False, keepalive_interval=8.0, keepalive_timeout=4.0, min_ping_interval=1.0)
PEER_CLIENT_GRPC = GrpcConfig(client_side=True, keepalive_interval=8.0, keepalive_timeout=4.0)


def engine_key(tenant: str) -> str:
    """The bearer key an engine of ``tenant`` presents (the gateway's KeyStore, reduced to a rule)."""
    return f"Bearer key-{tenant}"


def tenant_of_key(value: str | None) -> str | None:
    if value is None or not value.startswith("Bearer key-"):
        return None
    return value[len("Bearer key-"):] or None


def _metadata_value(metadata: tuple[tuple[str, object], ...], name: str) -> str | None:
    for key, value in metadata:
        if key == name:
            return value.decode("latin-1") if isinstance(value, bytes) else str(value)
    return None


class EngineStream:
    """One engine's ProcessTasks stream on this gateway: its route (as ``infx.workers.EngineStream``)."""

    def __init__(self, gateway: Gateway, end: GrpcEnd, stream_id: int, tenant: str) -> None:
        self.gateway = gateway
        self.end = end
        self.stream_id = stream_id
        self.tenant = tenant
        self.closed = False

    def send_task(self, effect: Union[SendTask, CancelTaskOnEngine]) -> bool:
        if self.closed:
            return False
        self.gateway.cluster.ledger.task_sent(effect.task, self.tenant, f"engine stream of tenant {self.tenant}")
        message = worker_pb2.ProcessTasksResponse(new_task=effect.task)
        try:
            self.end.conn.send_message(self.stream_id, message.SerializeToString())
        except LocalProtocolError:
            pass  # the call ended under us: its CallEnded fails the task over
        return True

    def close(self, reason: str) -> None:
        # Mirrors ServerCall.abort: status out, the call forgotten; the handler never
        # reaches its `finally`, so there is no route_closed (the processor removed the engine).
        if not self.closed:
            self.closed = True
            self.gateway.calls.pop((self.end, self.stream_id), None)
            self.end.conn.send_status(self.stream_id, StatusCode.UNAVAILABLE, reason)

    # -- the handler (WorkerService.process_tasks) ------------------------------------

    def message(self, data: bytes) -> None:
        message = worker_pb2.ProcessTasksRequest.FromString(data)
        kind = message.WhichOneof("message")
        gateway = self.gateway
        if kind == "engine_status":
            if not message.engine_status.engine_id:
                self._finish(StatusCode.INVALID_ARGUMENT, "engine status without engine_id")
                return
            gateway.run(lambda now: gateway.processor.update_engine(
                now, self, self.tenant, message.engine_status, Locality.LOCAL))
        elif kind == "task_result":
            gateway.run(lambda now: gateway.processor.receive_result(now, self, message.task_result))

    def input_ended(self) -> None:
        self._finish(StatusCode.OK, "")

    def ended(self, event: CallEnded) -> None:
        self.closed = True
        reason = f"engine stream ended: {event.status.name} {event.message}"
        self.gateway.run(lambda now: self.gateway.processor.close_route(now, self, reason))

    def _finish(self, code: StatusCode, message: str) -> None:
        self.closed = True
        self.gateway.calls.pop((self.end, self.stream_id), None)
        reason = "engine stream ended" if code is StatusCode.OK else f"engine stream ended: {code.name} {message}"
        self.gateway.run(lambda now: self.gateway.processor.close_route(now, self, reason))
        self.end.conn.send_status(self.stream_id, code, message)

    def __repr__(self) -> str:
        return f"<EngineStream {self.gateway.name}:{self.stream_id}>"


class PeerSenderStream:
    """A peer's ProcessTasksInternal stream accepted here (``infx.exchanger.PeerStream``): the route
    of the engines the peer reports; its sender is made on the first status report."""

    def __init__(self, gateway: Gateway, end: GrpcEnd, stream_id: int) -> None:
        self.gateway = gateway
        self.end = end
        self.stream_id = stream_id
        self.sender: Sender | None = None
        self.closed = False
        self.forgotten = False
        # Headers at once: they tell the peer's receiver the stream is accepted.
        end.conn.send_initial_metadata(stream_id)

    @property
    def pod_name(self) -> str:
        return self.sender.pod_name if self.sender is not None else ""

    def send_task(self, effect: Union[SendTask, CancelTaskOnEngine]) -> bool:
        if self.closed or self.sender is None:
            return False
        message = self.sender.task_message(effect)
        try:
            self.end.conn.send_message(self.stream_id, message.SerializeToString())
        except LocalProtocolError:
            pass
        return True

    def close(self, reason: str) -> None:
        """Abort with UNAVAILABLE; the handler's pending read wakes and it forgets the stream."""
        if not self.closed:
            self.closed = True
            self.gateway.calls.pop((self.end, self.stream_id), None)
            self.end.conn.send_status(self.stream_id, StatusCode.UNAVAILABLE, reason)
            self.gateway.forget_stream(self)

    # -- the handler (Exchanger.process_tasks_internal) ------------------------------------

    def message(self, data: bytes) -> None:
        request = internal_pb2.ProcessTasksInternalRequest.FromString(data)
        gateway = self.gateway
        kind = request.WhichOneof("message")
        try:
            if kind == "server_status":
                gateway.cluster.stats["status_reports"] += 1
                gateway.add_or_update_server_status(self, request)
            elif self.sender is None:
                self._exit(StatusCode.FAILED_PRECONDITION, "a task result arrived before any ServerStatus")
            else:
                sender = self.sender
                gateway.run(lambda now: sender.message_received(now, request))
        except RemoteProtocolError as exc:
            self._exit(StatusCode.INVALID_ARGUMENT, str(exc))

    def input_ended(self) -> None:
        self._exit(StatusCode.OK, "")

    def ended(self, event: CallEnded) -> None:
        self.closed = True
        self.gateway.forget_stream(self)

    def _exit(self, code: StatusCode, message: str) -> None:
        self.closed = True
        self.gateway.calls.pop((self.end, self.stream_id), None)
        self.gateway.forget_stream(self)
        self.end.conn.send_status(self.stream_id, code, message)

    def __repr__(self) -> str:
        return f"<PeerSender {self.gateway.name}<-{self.pod_name}:{self.stream_id}>"


class PeerDial:
    """This gateway's outgoing ProcessTasksInternal stream to one peer: the receiver's adapter
    and the origin of the tasks the peer forwards here."""

    def __init__(self, gateway: Gateway, peer: str) -> None:
        self.gateway = gateway
        self.peer = peer
        self.end: GrpcEnd | None = None
        self.stream_id = 0
        self.receiver: Receiver | None = None
        #: Forwarded tasks in flight here and their deadlines (for the deadline invariant).
        self.deadlines: dict[str, float] = {}
        self._held: list[internal_pb2.ProcessTasksInternalRequest] | None = None
        #: Streams in a row that the peer did not accept (the redial backoff grows with them).
        self.failures = 0
        self.accepted = False

    @property
    def open(self) -> bool:
        return self.receiver is not None

    def dial(self) -> None:
        gateway = self.gateway
        cluster = gateway.cluster
        link = cluster.new_link(f"{gateway.name}->{self.peer}")
        self.end = gateway.add_end(link, 0, PEER_CLIENT_GRPC)
        cluster.accept(self.peer, link)
        self.accepted = False
        self.stream_id = self.end.conn.start_call(PROCESS_TASKS_INTERNAL, now=cluster.scheduler.now)
        self.receiver = Receiver(gateway.processor, ReceiverConfig(pod_name=gateway.name, status_interval=5.0), self)
        self.receiver.connected(cluster.scheduler.now)
        self.pump()

    def pump(self) -> None:
        """Write what the receiver queued; the status faults bend reports on their way out."""
        if self.receiver is None or self.end is None:
            return
        cluster = self.gateway.cluster
        for message in self.receiver.pop_messages():
            if message.HasField("server_status"):
                self._check_advertised(message.server_status)
                fault = cluster.faults.status_fault(self)
                if fault == "late" and self._held is None:
                    self._held = []
                    cluster.scheduler.after(cluster.rng.uniform(0.5, 4.0), self._release, "late-status")
                if fault == "duplicate":
                    self._write(message)
            self._write(message)

    def _write(self, message: internal_pb2.ProcessTasksInternalRequest) -> None:
        if self._held is not None:
            self._held.append(message)
            return
        assert self.end is not None
        try:
            self.end.conn.send_message(self.stream_id, message.SerializeToString())
        except LocalProtocolError:
            pass

    def _release(self) -> None:
        held, self._held = self._held, None
        if held is None or self.receiver is None:
            return
        for message in held:
            self._write(message)
        self.gateway.flush()

    def _check_advertised(self, status: internal_pb2.ServerStatus) -> None:
        processor = self.gateway.processor
        for entry in status.engine_statuses:
            self.gateway.cluster.ledger.checks += 1
            engine = processor.engine(entry.tenant_id, entry.engine_status.engine_id)
            if engine is None or engine.locality is not Locality.LOCAL:
                where = "unknown" if engine is None else engine.locality.value
                self.gateway.cluster.ledger.fail(
                    NO_LOOP, f"{self.gateway.name} advertised engine {entry.engine_status.engine_id!r} "
                    f"({entry.tenant_id}) to {self.peer}, but it is {where} there")

    # -- origin of forwarded tasks -------------------------------------------------------

    def result_delivered(self, effect: DeliverResult) -> None:
        self._relay(effect)

    def request_failed(self, effect: FailRequest) -> None:
        self._relay(effect)

    def _relay(self, effect: Union[DeliverResult, FailRequest]) -> None:
        receiver = self.receiver
        if receiver is None or receiver.state not in (ReceiverState.OPEN, ReceiverState.DRAINING):
            return
        receiver.deliver(effect)
        if isinstance(effect, FailRequest) or effect.last:
            self.deadlines.pop(effect.task_id, None)
        self.pump()

    # -- the stream ---------------------------------------------------------------------

    def message(self, data: bytes) -> None:
        receiver = self.receiver
        assert receiver is not None
        response = internal_pb2.ProcessTasksInternalResponse.FromString(data)
        before = receiver.tasks_in_flight
        gateway = self.gateway
        try:
            gateway.run(lambda now: receiver.task_received(now, response))
        except RemoteProtocolError as exc:
            assert self.end is not None
            self.end.conn.cancel(self.stream_id)
            self.ended(str(exc))
            return
        task = response.new_task
        if task.request.WhichOneof("request") == "cancel_task":
            # The peer's cancel ends the forwarded task without a result.
            self.deadlines.pop(task.request.cancel_task.task_id, None)
        elif receiver.tasks_in_flight > before and task.timeout_seconds > 0 and gateway.processor.has_task(task.id):
            self.deadlines[task.id] = gateway.cluster.scheduler.now + task.timeout_seconds
        self.pump()

    def ended(self, reason: str) -> None:
        receiver, self.receiver = self.receiver, None
        self._held = None
        if receiver is None:
            return
        self.deadlines.clear()
        if receiver.state is not ReceiverState.CLOSED:
            self.gateway.run(receiver.closed)
        self.failures = 0 if self.accepted else self.failures + 1
        delay = REDIAL_BACKOFF.delay(max(1, self.failures), self.gateway.cluster.rng)
        self.gateway.cluster.redial_later(self.gateway, self.peer, delay)

    def local_engines_changed(self) -> None:
        if self.receiver is not None:
            self.receiver.local_engines_changed(self.gateway.cluster.scheduler.now)
            self.pump()

    def on_timer(self) -> None:
        if self.receiver is not None:
            self.receiver.handle_timeout(self.gateway.cluster.scheduler.now)
            self.pump()
        self.gateway.flush()

    def __repr__(self) -> str:
        return f"<PeerDial {self.gateway.name}->{self.peer}>"


class Gateway:
    """One gateway process: a processor and every connection it holds."""

    def __init__(self, cluster: Cluster, name: str, config: ProcessorConfig) -> None:
        self.cluster = cluster
        self.name = name
        self.processor = Processor(config)
        self.alive = True
        self.ends: list[GrpcEnd] = []
        self.calls: dict[tuple[GrpcEnd, int], Union[EngineStream, PeerSenderStream]] = {}
        self.dials: dict[str, PeerDial] = {}
        self.clients: dict[str, ClientRequest] = {}
        #: The newest stream each peer pod opened to us (Exchanger._by_pod).
        self.by_pod: dict[str, PeerSenderStream] = {}
        self._flushing = False

    # -- peers that dial us (infx.exchanger.Exchanger) ---------------------------------------

    def add_or_update_server_status(self, stream: PeerSenderStream,
                                    message: internal_pb2.ProcessTasksInternalRequest) -> None:
        """The stream's sender is made on its first report; a newer stream from the same pod
        replaces the older one."""
        if stream.sender is None:
            stream.sender = Sender(self.processor, route=stream)
        sender = stream.sender
        pod = message.server_status.pod_name
        older = self.by_pod.get(pod)
        if older is not None and older is not stream:
            self.remove_server(pod)
        self.run(lambda now: sender.message_received(now, message))
        if pod:
            self.by_pod[pod] = stream

    def remove_server(self, pod: str) -> None:
        stream = self.by_pod.pop(pod, None)
        if stream is not None:
            self.forget_stream(stream)
            stream.close(f"peer {pod!r} reconnected or is gone")

    def forget_stream(self, stream: PeerSenderStream) -> None:
        if stream.forgotten:
            return
        stream.forgotten = True
        if self.by_pod.get(stream.pod_name) is stream:
            del self.by_pod[stream.pod_name]
        if stream.sender is not None:
            self.run(stream.sender.closed)

    # -- performing the processor's effects (infx.dispatcher.Dispatcher) -------------------

    def run(self, step: Callable[[float], list[Effect]]) -> None:
        """Run one processor input now and perform what it returns."""
        self.perform(step(self.cluster.scheduler.now))

    def perform(self, effects: list[Effect]) -> None:
        for effect in effects:
            self._perform_one(effect)

    def _perform_one(self, effect: Effect) -> None:
        cluster = self.cluster
        if isinstance(effect, SendTask):
            cluster.ledger.attempt_sent(effect.task.id, self.processor.attempt_owner(effect.task.id))
            cluster.ledger.task_sent(effect.task, effect.engine.tenant_id, f"engine {effect.engine.engine_id}")
            route = effect.route
            assert isinstance(route, (EngineStream, PeerSenderStream))
            if not route.send_task(effect):
                task_id = effect.task.id
                # Dispatcher._perform_later: reported after the effects at hand.
                cluster.scheduler.at(cluster.scheduler.now, lambda: self._dispatch_failed(task_id, route), "failed-send")
        elif isinstance(effect, (DeliverResult, FailRequest)):
            origin = effect.origin
            assert isinstance(origin, (ClientRequest, PeerDial))
            if isinstance(effect, DeliverResult):
                origin.result_delivered(effect)
                if isinstance(origin, ClientRequest):
                    self._consumed(effect)
            else:
                origin.request_failed(effect)
            if isinstance(origin, ClientRequest) and not origin.live:
                self.clients.pop(origin.task_id, None)
        elif isinstance(effect, CancelTaskOnEngine):
            route = effect.route
            assert isinstance(route, (EngineStream, PeerSenderStream))
            route.send_task(effect)
        elif isinstance(effect, CloseEngine):
            route = effect.route
            assert isinstance(route, (EngineStream, PeerSenderStream))
            route.close(effect.reason)
        elif isinstance(effect, TaskQueued):
            cluster.stats["tasks_queued"] += 1
        elif isinstance(effect, LocalEnginesChanged):
            for dial in list(self.dials.values()):
                dial.local_engines_changed()
        elif isinstance(effect, EnginesRemoved):
            # Exchanger.engines_removed: every open peer stream's sender may register them.
            for call in list(self.calls.values()):
                if isinstance(call, PeerSenderStream) and not call.forgotten and call.sender is not None \
                        and not call.closed:
                    sender = call.sender
                    self.run(lambda now: sender.engines_removed(now, effect.engines))

    def _consumed(self, effect: DeliverResult) -> None:
        # HttpOrigin: a response head or a bare last event is consumed at once; an event
        # with data when the HTTP transport took it (here: at once as well).
        self.processor.results_consumed(effect.task_id, 1)

    def _dispatch_failed(self, task_id: str, route: object) -> None:
        if self.alive:
            self.run(lambda now: self.processor.dispatch_failed(now, task_id, "engine stream closed", route=route))
            self.flush()

    # -- clients ----------------------------------------------------------------------

    def submit(self, request: ClientRequest, task: worker_pb2.TaskRequest, timeout: float | None) -> None:
        now = self.cluster.scheduler.now
        self.clients[request.task_id] = request
        self.cluster.ledger.accepted(request)
        self.perform(self.processor.submit(
            now, task_id=request.task_id, tenant_id=request.tenant, request=task, origin=request,
            deadline=None if timeout is None else now + timeout,
        ))
        self.flush()

    def client_gone(self, request: ClientRequest) -> None:
        """The client disconnected (HttpOrigin.cancel)."""
        if request.live:
            request.cancelled()
            self.clients.pop(request.task_id, None)
            self.run(lambda now: self.processor.cancel(now, request.task_id))
            self.flush()

    # -- connections ------------------------------------------------------------------

    def add_end(self, link: Link, side: int, config: GrpcConfig) -> GrpcEnd:
        end = GrpcEnd(self.cluster.scheduler, link, side, config, self._events, self.flush)
        self.ends.append(end)
        return end

    def accept(self, link: Link) -> GrpcEnd:
        return self.add_end(link, 1, SERVER_GRPC)

    def _events(self, end: GrpcEnd, events: list[Event]) -> None:
        for event in events:
            if not self.alive:
                return
            if end.side == 0:
                self._dial_event(end, event)
            else:
                self._server_event(end, event)

    def _server_event(self, end: GrpcEnd, event: Event) -> None:
        if isinstance(event, CallStarted):
            self._start(end, event)
            return
        stream_id = getattr(event, "stream_id", None)
        if stream_id is None:
            return
        call = self.calls.get((end, stream_id))
        if call is None:
            return
        if isinstance(event, MessageReceived):
            end.conn.acknowledge(stream_id, event.flow_controlled_length)
            call.message(event.data)
        elif isinstance(event, InputEnded):
            call.input_ended()
        elif isinstance(event, CallEnded):
            del self.calls[(end, stream_id)]
            call.ended(event)

    def _start(self, end: GrpcEnd, event: CallStarted) -> None:
        if event.method == PROCESS_TASKS:
            tenant = tenant_of_key(_metadata_value(event.metadata, "authorization"))
            if tenant is None:
                end.conn.send_status(event.stream_id, StatusCode.UNAUTHENTICATED, "missing or unknown engine key")
                return
            self.calls[(end, event.stream_id)] = EngineStream(self, end, event.stream_id, tenant)
        elif event.method == PROCESS_TASKS_INTERNAL:
            self.calls[(end, event.stream_id)] = PeerSenderStream(self, end, event.stream_id)
        else:
            end.conn.send_status(event.stream_id, StatusCode.UNIMPLEMENTED, f"Method not found: {event.method}")

    def _dial_event(self, end: GrpcEnd, event: Event) -> None:
        dial = next((d for d in self.dials.values() if d.end is end), None)
        if dial is None or dial.receiver is None:
            return
        if isinstance(event, ResponseHeadersReceived) and event.stream_id == dial.stream_id:
            dial.accepted = True
        elif isinstance(event, MessageReceived) and event.stream_id == dial.stream_id:
            end.conn.acknowledge(event.stream_id, event.flow_controlled_length)
            dial.message(event.data)
        elif isinstance(event, CallEnded) and event.stream_id == dial.stream_id:
            dial.ended(f"{event.status.name} {event.message}")
            if not end.closed:
                end.conn.go_away()

    # -- time and flushing ------------------------------------------------------------

    def flush(self) -> None:
        """After any input: let every connection write and re-arm every timer."""
        if self._flushing or not self.alive:
            return
        self._flushing = True
        try:
            for end in list(self.ends):
                end.flush()
            self.ends = [end for end in self.ends if not end.closed]
            scheduler = self.cluster.scheduler
            scheduler.arm((self, "processor"), self.processor.next_deadline(), self._on_timer, "processor-timer")
            for dial in self.dials.values():
                receiver = dial.receiver
                scheduler.arm((self, dial.peer), receiver.next_deadline() if receiver else None, dial.on_timer,
                              "receiver-timer")
        finally:
            self._flushing = False

    def _on_timer(self) -> None:
        self.run(self.processor.handle_timeout)
        self.flush()

    def die(self) -> None:
        """The process is gone: every connection drops, clients see their requests fail."""
        self.alive = False
        scheduler = self.cluster.scheduler
        scheduler.arm((self, "processor"), None, self._on_timer)
        for dial in self.dials.values():
            scheduler.arm((self, dial.peer), None, dial.on_timer)
        for end in self.ends:
            end.abandon()
            end.link.reset(f"gateway {self.name} died")
        self.ends = []
        for request in list(self.clients.values()):
            request.connection_lost()
        self.clients.clear()

    # -- queries for the invariants -----------------------------------------------------

    def live_tasks(self) -> int:
        counters = self.processor.counters
        return counters.accepted - sum(counters.outcomes.values())

    def forwarded_in_flight(self) -> int:
        return sum(d.receiver.tasks_in_flight for d in self.dials.values() if d.receiver is not None)

    def __repr__(self) -> str:
        return f"<Gateway {self.name}>"
