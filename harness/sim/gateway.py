"""A simulated gateway: the production gateway core behind the real gRPC machines, on simulated links.

Rules this file keeps: no decisions. Every one is the production
:class:`~protocol.gateway.core.GatewayCore`'s (which owns the processor, the
accepted and dialled peers); this file maps gRPC events on the links to the
core's inputs and performs the I/O effects it returns, in order, the way
``infx/gateway/dispatcher.py``, ``infx/gateway/workers.py`` and ``infx/exchange/exchanger.py`` do on a
reactor. After every input the gateway flushes: gRPC events are handled,
bytes go to the links (of the connections the input touched), and the core's
one timer is re-armed from its ``next_deadline()``. Along the way it reports
what the invariants need to see (tasks sent, statuses advertised, forwarded
tasks' deadlines, status traffic) and lets the status faults bend reports on
their way out.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Union

from harness.sim.invariants import NO_LOOP, ClientRequest
from harness.sim.link import Link
from harness.sim.wire import GrpcEnd
from protocol.gateway.core import GatewayCore
from protocol.gateway.effects import (
    PEER_LEARNING_SECONDS,
    CancelDial,
    CoreConfig,
    Dial,
    EndPeerStream,
    HalfCloseDial,
    OpenDial,
    SendOnDial,
)
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
from protocol.processor.core import Processor
from protocol.processor.config import ProcessorConfig
from protocol.processor.effects import (
    CancelTaskOnEngine,
    CloseEngine,
    CloseRoute,
    DeliverResult,
    FailRequest,
    SendTask,
    TaskQueued,
)
from protocol.processor.keys import Locality

if TYPE_CHECKING:
    from harness.sim.cluster import Cluster

PROCESS_TASKS = "/llmariner.inference.server.v1.InferenceWorkerService/ProcessTasks"
PROCESS_TASKS_INTERNAL = "/llmariner.inference.server.v1.InferenceInternalService/ProcessTasksInternal"

SERVER_GRPC = GrpcConfig(client_side=False, keepalive_interval=8.0, keepalive_timeout=4.0, min_ping_interval=1.0)
PEER_CLIENT_GRPC = GrpcConfig(client_side=True, keepalive_interval=8.0, keepalive_timeout=4.0)
#: Seconds between re-checks of the reports to peers (shorter than production's, for more traffic).
STATUS_INTERVAL = 5.0


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


class SimEngineStream:
    """One engine's ProcessTasks stream on this gateway: its route (as ``infx.gateway.workers.EngineStream``)."""

    def __init__(self, gateway: SimGateway, end: GrpcEnd, stream_id: int, tenant: str) -> None:
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
        # reaches its `finally`, so there is no engine_closed (the processor removed the engine).
        if not self.closed:
            self.closed = True
            self.gateway.calls.pop((self.end, self.stream_id), None)
            self.end.conn.send_status(self.stream_id, StatusCode.UNAVAILABLE, reason)

    # -- the handler (WorkerService.process_tasks) ------------------------------------

    def message(self, data: bytes) -> None:
        message = worker_pb2.ProcessTasksRequest.FromString(data)
        kind = message.WhichOneof("message")
        core = self.gateway.core
        if kind == "engine_status":
            if not message.engine_status.engine_id:
                self._finish(StatusCode.INVALID_ARGUMENT, "engine status without engine_id")
                return
            self.gateway.run(lambda now: core.engine_status(self, self.tenant, message.engine_status,
                                                            Locality.LOCAL, now))
        elif kind == "task_result":
            self.gateway.run(lambda now: core.engine_result(self, message.task_result, now))

    def input_ended(self) -> None:
        self._finish(StatusCode.OK, "")

    def ended(self, event: CallEnded) -> None:
        self.closed = True
        reason = f"engine stream ended: {event.status.name} {event.message}"
        self.gateway.run(lambda now: self.gateway.core.engine_closed(self, reason, now))

    def _finish(self, code: StatusCode, message: str) -> None:
        self.closed = True
        self.gateway.calls.pop((self.end, self.stream_id), None)
        reason = "engine stream ended" if code is StatusCode.OK else f"engine stream ended: {code.name} {message}"
        self.gateway.run(lambda now: self.gateway.core.engine_closed(self, reason, now))
        self.end.conn.send_status(self.stream_id, code, message)

    def __repr__(self) -> str:
        return f"<SimEngineStream {self.gateway.name}:{self.stream_id}>"


class SimAcceptedPeerStream:
    """A peer's ProcessTasksInternal stream accepted here (``infx.exchange.exchanger.AcceptedPeerStream``): the route
    of the engines the peer reports (the core gives it an accepted peer on its first report)."""

    def __init__(self, gateway: SimGateway, end: GrpcEnd, stream_id: int) -> None:
        self.gateway = gateway
        self.end = end
        self.stream_id = stream_id
        self.closed = False

    def send_task(self, effect: Union[SendTask, CancelTaskOnEngine]) -> bool:
        if self.closed:
            return False
        message = internal_pb2.ProcessTasksInternalResponse(new_task=effect.task, tenant_id=effect.engine.tenant_id)
        try:
            self.end.conn.send_message(self.stream_id, message.SerializeToString())
        except LocalProtocolError:
            pass
        return True

    def close(self, reason: str) -> None:
        self.end_with(StatusCode.UNAVAILABLE, reason)

    def end_with(self, code: StatusCode, message: str) -> None:
        """Send the status and forget the call (the core has already forgotten the stream)."""
        if not self.closed:
            self.closed = True
            self.gateway.calls.pop((self.end, self.stream_id), None)
            self.end.conn.send_status(self.stream_id, code, message)

    # -- the handler (Exchanger.process_tasks_internal) ------------------------------------

    def message(self, data: bytes) -> None:
        request = internal_pb2.ProcessTasksInternalRequest.FromString(data)
        if request.WhichOneof("message") == "server_status":
            self.gateway.cluster.stats["status_reports"] += 1
            self.gateway.cluster.stats["status_bytes"] += len(data)
        self.gateway.run(lambda now: self.gateway.core.accepted_peer_message(self, request, now))

    def input_ended(self) -> None:
        self.gateway.run(lambda now: self.gateway.core.accepted_peer_closed(self, now))
        self.end_with(StatusCode.OK, "")

    def ended(self, event: CallEnded) -> None:
        self.closed = True
        self.gateway.run(lambda now: self.gateway.core.accepted_peer_closed(self, now))

    def __repr__(self) -> str:
        return f"<PeerSender {self.gateway.name}:{self.stream_id}>"


class SimDialledPeerStream:
    """This gateway's outgoing ProcessTasksInternal stream to one peer (``infx.exchange.exchanger.DialledPeerStream``),
    for whichever :class:`~protocol.gateway.effects.Dial` the core has current."""

    def __init__(self, gateway: SimGateway, peer: str) -> None:
        self.gateway = gateway
        self.peer = peer
        self.dial: Dial | None = None
        self.end: GrpcEnd | None = None
        self.stream_id = 0
        #: Forwarded tasks in flight here and their deadlines (for the deadline invariant).
        self.deadlines: dict[str, float] = {}
        self._held: list[internal_pb2.ProcessTasksInternalRequest] | None = None

    @property
    def open(self) -> bool:
        return self.dial is not None

    def opened(self, dial: Dial) -> None:
        gateway = self.gateway
        cluster = gateway.cluster
        link = cluster.new_link(f"{gateway.name}->{self.peer}")
        self.dial = dial
        self.end = gateway.add_end(link, 0, PEER_CLIENT_GRPC)
        gateway.dial_of[self.end] = self
        self._held = None
        self.deadlines.clear()
        cluster.accept(self.peer, link)
        self.stream_id = self.end.conn.start_call(PROCESS_TASKS_INTERNAL, now=cluster.scheduler.now)

    def send(self, message: internal_pb2.ProcessTasksInternalRequest) -> None:
        """Write one message; the status faults bend reports on their way out."""
        cluster = self.gateway.cluster
        if message.HasField("task_result"):
            self._untrack_ended(message.task_result.task_id)
        elif message.HasField("server_status"):
            cluster.stats["status_sent"] += 1
            cluster.stats["status_bytes"] += 5 + message.ByteSize()  # with gRPC's 5-byte message prefix
            self._check_advertised(message.server_status)
            fault = cluster.faults.status_fault(self)
            if fault == "late" and self._held is None:
                self._held = []
                dial = self.dial
                cluster.scheduler.after(cluster.rng.uniform(0.5, 4.0), lambda: self._release(dial), "late-status")
            if fault == "duplicate":
                self._write(message)
        self._write(message)

    def _write(self, message: internal_pb2.ProcessTasksInternalRequest) -> None:
        if self._held is not None:
            self._held.append(message)
            return
        if self.end is None:
            return
        try:
            self.end.conn.send_message(self.stream_id, message.SerializeToString())
        except LocalProtocolError:
            pass

    def _release(self, dial: Dial | None) -> None:
        if dial is not self.dial:
            return  # that stream is gone; a newer one's held reports wait for their own release
        held, self._held = self._held, None
        if held is None:
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
                # A peer's engine is named with its pod there: an advertised one is unknown by its id.
                where = "not attached" if engine is None else engine.locality.value
                self.gateway.cluster.ledger.fail(
                    NO_LOOP, f"{self.gateway.name} advertised engine {entry.engine_status.engine_id!r} "
                    f"({entry.tenant_id}) to {self.peer}, but it is {where} there")

    def given_up(self) -> None:
        """The core cancelled this stream: reset it; nothing more is read from it."""
        if self.end is not None:
            self.end.conn.cancel(self.stream_id)
        self._forget()

    def _forget(self) -> None:
        self.dial = None
        self._held = None
        self.deadlines.clear()

    # -- the stream ---------------------------------------------------------------------

    def event(self, end: GrpcEnd, event: Event) -> None:
        dial = self.dial
        if dial is None or end is not self.end or getattr(event, "stream_id", None) != self.stream_id:
            return
        gateway = self.gateway
        core = gateway.core
        if isinstance(event, ResponseHeadersReceived):
            gateway.run(lambda now: core.dial_accepted(dial, event.metadata, now))
        elif isinstance(event, MessageReceived):
            end.conn.acknowledge(event.stream_id, event.flow_controlled_length)
            response = internal_pb2.ProcessTasksInternalResponse.FromString(event.data)
            gateway.run(lambda now: core.dial_message(dial, response, now))
            self._track_deadline(response)
        elif isinstance(event, CallEnded):
            self._forget()
            gateway.run(lambda now: core.dial_closed(dial, now))
            if not end.closed:
                end.conn.go_away(now=self.gateway.cluster.scheduler.now)

    def _track_deadline(self, response: internal_pb2.ProcessTasksInternalResponse) -> None:
        task = response.new_task
        if task.request.WhichOneof("request") == "cancel_task":
            # The peer's cancel ends the forwarded task without a result.
            self.deadlines.pop(task.request.cancel_task.task_id, None)
        elif task.timeout_seconds > 0 and task.id not in self.deadlines and task.id in self.forwarded():
            deadline = self.gateway.cluster.scheduler.now + task.timeout_seconds
            self.deadlines[task.id] = deadline
            self.gateway.cluster.checks.forwarded_deadline(self.gateway, self, task.id, deadline)

    def _untrack_ended(self, task_id: str) -> None:
        """A result of a forwarded task goes back: if it was the last, the task is over here."""
        if task_id in self.deadlines and task_id not in self.forwarded():
            del self.deadlines[task_id]

    def forwarded(self) -> frozenset[str]:
        """The forwarded tasks the core's dialled peer for this stream has in flight."""
        peer = self.gateway.core.peers.get(self.peer)
        if peer is None or peer.dial is not self.dial or peer.dialled is None:
            return frozenset()
        return peer.dialled.task_ids

    def __repr__(self) -> str:
        return f"<SimDialledPeerStream {self.gateway.name}->{self.peer}>"


class SimGateway:
    """One gateway process: the production core and every connection it holds."""

    def __init__(self, cluster: Cluster, name: str, config: ProcessorConfig) -> None:
        self.cluster = cluster
        self.name = name
        self.processor = Processor(config)
        self.core = GatewayCore(self.processor, CoreConfig(pod_name=name, status_interval=STATUS_INTERVAL,
                                                           # as infx/service.py runs it
                                                           learn_peers_within=PEER_LEARNING_SECONDS,
                                                           redial_when_dialled_in=True),
                                cluster.rng)
        self.alive = True
        #: Open connections (a dict: insertion order), and those with commands not yet flushed.
        self.ends: dict[GrpcEnd, None] = {}
        self.pending: dict[GrpcEnd, None] = {}
        #: The dial each outgoing connection carries.
        self.dial_of: dict[GrpcEnd, SimDialledPeerStream] = {}
        self.calls: dict[tuple[GrpcEnd, int], Union[SimEngineStream, SimAcceptedPeerStream]] = {}
        #: The stream to each peer, by peer name.
        self.dials: dict[str, SimDialledPeerStream] = {}
        self.clients: dict[str, ClientRequest] = {}
        self._flushing = False

    def start(self, peers: list[str]) -> None:
        """Dial every peer (the pod source's live peers; the address is the peer's name)."""
        for peer in peers:
            self.dials[peer] = SimDialledPeerStream(self, peer)
        self.run(lambda now: self.core.peers_changed({peer: peer for peer in peers}, now))
        self.flush()

    # -- performing the core's effects (infx.gateway.dispatcher.Dispatcher, infx.exchange.exchanger.Exchanger) ----

    def run(self, step: Callable[[float], list[Any]]) -> None:
        """Run one core input now and perform what it returns."""
        self.perform(step(self.cluster.scheduler.now))

    def perform(self, effects: list[Any]) -> None:
        self.cluster.checks.gateway_touched(self)
        for effect in effects:
            self._perform_one(effect)

    def _perform_one(self, effect: Any) -> None:
        cluster = self.cluster
        if isinstance(effect, SendTask):
            cluster.ledger.attempt_sent(effect.task.id, self.processor.attempt_owner(effect.task.id))
            cluster.ledger.task_sent(effect.task, effect.engine.tenant_id, f"engine {effect.engine.engine_id}")
            route = effect.route
            assert isinstance(route, (SimEngineStream, SimAcceptedPeerStream))
            if not route.send_task(effect):
                wire_id = effect.task.id
                # Dispatcher: a send that found its route gone is reported after the effects at hand.
                effects = self.core.task_not_sent(route, wire_id, cluster.scheduler.now)
                cluster.scheduler.at(cluster.scheduler.now, lambda: self._perform_later(effects), "failed-send")
        elif isinstance(effect, (DeliverResult, FailRequest)):
            origin = effect.origin
            assert isinstance(origin, ClientRequest), f"{effect} for {origin!r} left the core"
            if isinstance(effect, DeliverResult):
                if origin.first_result_at is None:
                    origin.first_result_at = cluster.scheduler.now
                origin.result_delivered(effect)
                # HttpOrigin: a response head or a bare last event is consumed at once; an event
                # with data when the HTTP transport took it (here: at once as well).
                self.perform(self.core.results_consumed(effect.task_id, 1, cluster.scheduler.now))
            else:
                origin.request_failed(effect)
            if not origin.live:
                self.clients.pop(origin.task_id, None)
        elif isinstance(effect, CancelTaskOnEngine):
            route = effect.route
            assert isinstance(route, (SimEngineStream, SimAcceptedPeerStream))
            route.send_task(effect)
        elif isinstance(effect, (CloseEngine, CloseRoute)):
            route = effect.route
            assert isinstance(route, (SimEngineStream, SimAcceptedPeerStream))
            route.close(effect.reason)
        elif isinstance(effect, TaskQueued):
            cluster.stats["tasks_queued"] += 1
        elif isinstance(effect, OpenDial):
            self.dials[effect.dial.name].opened(effect.dial)
        elif isinstance(effect, SendOnDial):
            dial = self.dials[effect.dial.name]
            if dial.dial is effect.dial:
                dial.send(effect.message)
        elif isinstance(effect, HalfCloseDial):
            dial = self.dials[effect.dial.name]
            if dial.dial is effect.dial and dial.end is not None:
                dial.end.conn.end_stream(dial.stream_id)
        elif isinstance(effect, CancelDial):
            dial = self.dials[effect.dial.name]
            if dial.dial is effect.dial:
                dial.given_up()
        elif isinstance(effect, EndPeerStream):
            stream = effect.stream
            assert isinstance(stream, SimAcceptedPeerStream)
            stream.end_with(effect.code, effect.message)
        # The rest (request accounting, peer reports for the scaler, log lines) has no I/O here.

    def _perform_later(self, effects: list[Any]) -> None:
        if self.alive:
            self.perform(effects)
            self.flush()

    # -- clients ----------------------------------------------------------------------

    def submit(self, request: ClientRequest, task: worker_pb2.TaskRequest, timeout: float | None) -> None:
        now = self.cluster.scheduler.now
        self.clients[request.task_id] = request
        self.cluster.ledger.accepted(request)
        self.perform(self.core.submit(request, request.task_id, request.tenant, request.model, task, {},
                                      None if timeout is None else now + timeout, now))
        self.flush()

    def client_gone(self, request: ClientRequest) -> None:
        """The client disconnected (HttpOrigin.cancel)."""
        if request.live:
            request.cancelled()
            self.clients.pop(request.task_id, None)
            self.run(lambda now: self.core.cancel(request.task_id, now))
            self.flush()

    # -- connections ------------------------------------------------------------------

    def add_end(self, link: Link, side: int, config: GrpcConfig) -> GrpcEnd:
        end = GrpcEnd(self.cluster.scheduler, link, side, config, self._events, self.flush, self.pending,
                      self._end_gone)
        self.ends[end] = None
        return end

    def _end_gone(self, end: GrpcEnd) -> None:
        self.ends.pop(end, None)
        self.dial_of.pop(end, None)

    def accept(self, link: Link) -> GrpcEnd:
        return self.add_end(link, 1, SERVER_GRPC)

    def _events(self, end: GrpcEnd, events: list[Event]) -> None:
        for event in events:
            if not self.alive:
                return
            if end.side == 0:
                dial = self.dial_of.get(end)
                if dial is not None:
                    dial.event(end, event)
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
            self.calls[(end, event.stream_id)] = SimEngineStream(self, end, event.stream_id, tenant)
        elif event.method == PROCESS_TASKS_INTERNAL:
            stream = SimAcceptedPeerStream(self, end, event.stream_id)
            self.calls[(end, event.stream_id)] = stream
            self.run(lambda now: self.core.accepted_peer_opened(stream, None, now))
            if not stream.closed:
                # Headers at once: they tell the peer's dialled peer the stream is accepted.
                end.conn.send_initial_metadata(event.stream_id, self.core.accept_metadata)
        else:
            end.conn.send_status(event.stream_id, StatusCode.UNIMPLEMENTED, f"Method not found: {event.method}")

    # -- time and flushing ------------------------------------------------------------

    def flush(self) -> None:
        """After any input: let every connection it touched write, and re-arm the core's timer."""
        if self._flushing or not self.alive:
            return
        self._flushing = True
        self.cluster.checks.gateway_touched(self)
        try:
            pending = self.pending
            while pending:
                next(iter(pending)).flush()  # takes itself out of ``pending``
            self.cluster.scheduler.arm((self, "core"), self.core.next_deadline(), self._on_timer, "core-timer")
        finally:
            self._flushing = False

    def _on_timer(self) -> None:
        self.run(self.core.handle_timeout)
        self.flush()

    def die(self) -> None:
        """The process is gone: every connection drops, clients see their requests fail."""
        self.alive = False
        self.cluster.scheduler.arm((self, "core"), None, self._on_timer)
        for end in list(self.ends):
            end.abandon()
            end.link.reset(f"gateway {self.name} died")
        for request in list(self.clients.values()):
            request.connection_lost()
        self.clients.clear()

    # -- queries for the invariants -----------------------------------------------------

    def live_tasks(self) -> int:
        counters = self.processor.counters
        return counters.accepted - sum(counters.outcomes.values())

    def forwarded_in_flight(self) -> int:
        return sum(p.dialled.tasks_in_flight for p in self.core.peers.values() if p.dialled is not None)

    def __repr__(self) -> str:
        return f"<SimGateway {self.name}>"
