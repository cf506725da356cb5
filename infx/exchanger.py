"""The task exchanger: gateway replicas lend each other their engines over ``ProcessTasksInternal``.

Rules this file keeps: no routing decisions (the pure :mod:`protocol.receiver`,
:mod:`protocol.sender` and :mod:`protocol.processor` make them, through the
:class:`~infx.dispatcher.Dispatcher`, the one caller of the processor); the
clock, the dispatcher, the pod source and the channel factory are passed in;
one ``callLater`` per open receiver stream, armed from ``next_deadline()``.

Every gateway runs both halves. It *serves* ``ProcessTasksInternal`` on its
internal port: each peer that dials in gets a :class:`PeerStream`, and the
first ``ServerStatus`` on it creates the pure ``Sender`` that registers the
peer's engines as remote engines whose route is that stream. And it *dials*
every live peer pod: one :class:`PeerReceiver` per pod keeps a stream open
(reconnecting with jittered exponential backoff), reports this gateway's
local engines on it and runs the tasks the peer forwards.

The four data flows, from this gateway's point of view:

- Engine registration: a local engine's ``EngineStatus`` -> local processor
  (``LocalEnginesChanged``) -> every ``PeerReceiver`` re-reports the local
  engines -> peer's internal server -> peer's ``Sender`` -> peer's processor,
  where the engine is registered as remote. Remote engines are never
  re-reported, so reports cannot loop between gateways.
- New task scheduling: HTTP handler -> local processor, which picks a local
  engine (preferred) or a remote one; for a remote engine the task goes to
  the ``PeerStream`` of the peer that reported it, with its tenant id -> the
  peer's ``PeerReceiver`` -> the peer's processor, pinned to that engine.
- Task result processing: engine -> the peer's processor -> its
  ``PeerReceiver`` -> our ``PeerStream`` -> our ``Sender`` -> our processor,
  which orders the results and hands them to the HTTP request.
- Load for the autoscaler: HTTP handler -> the dispatcher counts the request
  per model -> every ``PeerReceiver``'s next report carries the cumulative
  counts -> the peer's ``Sender`` -> the peer's ``on_peer_requests`` hooks
  (its scaler), which count the increases as started requests; only one
  gateway runs the autoscaler, and it must see every gateway's requests.

Peers come from a :class:`~infx.kube.PeerSource` (``--peers`` or the pod
watcher of ``--kube``); :meth:`Exchanger.reconcile` keeps exactly one
receiver per live peer at its current address.
"""

from __future__ import annotations

import hmac
import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Union

from twisted.internet.defer import CancelledError, Deferred, DeferredList, succeed
from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.logger import Logger

from infx.deadline import DeadlineTimer
from infx.dispatcher import Dispatcher, SendOutcome, StreamSendGate
from infx.kube import PeerSource
from infx.transport import CallKind, ClientCall, GrpcChannel, GrpcError, GrpcServer, ServerCall
from protocol.grpc import StatusCode
from protocol.pb import internal_pb2, worker_pb2
from protocol.peers import Backoff, PeerAddress, PeerChange
from protocol.processor_types import DeliverResult, EnginesRemoved, FailRequest, RemoteProtocolError
from protocol.receiver import Receiver, ReceiverConfig, ReceiverState
from protocol.repeats import RepeatKind, RepeatReport, RepeatSuppressor
from protocol.sender import Sender

__all__ = [
    "PROCESS_TASKS_INTERNAL",
    "Exchanger",
    "ExchangerConfig",
    "PeerReceiver",
    "PeerStream",
    "ReceiverLoopState",
]

log = Logger()

PROCESS_TASKS_INTERNAL = "/llmariner.inference.server.v1.InferenceInternalService/ProcessTasksInternal"


@dataclass(frozen=True)
class ExchangerConfig:
    """How this gateway exchanges tasks with its peers.

    ``pod_name`` names this gateway in its status reports (peers tell
    gateways apart by it); ``status_interval`` is how often an unchanged
    report is re-checked; ``secret``, when set, is required of peers as
    ``authorization: Bearer <secret>`` and presented to them; ``backoff``
    spaces reconnects to a peer that cannot be reached.
    """

    pod_name: str
    status_interval: float = 10.0
    secret: str | None = None
    backoff: Backoff = field(default_factory=lambda: Backoff(initial=0.2, factor=2.0, cap=10.0, jitter=0.5))


#: Makes a channel to a peer's internal port (plain TCP or TLS is the caller's choice).
Connect = Callable[[PeerAddress], GrpcChannel]


# --- the accepting side: a peer dialled us ------------------------------------------


class PeerStream:
    """One accepted ``ProcessTasksInternal`` stream: the route of the engines its peer reports.

    The pure :class:`~protocol.sender.Sender` is created on the first status
    report (:meth:`Exchanger.add_or_update_server_status`). A peer that stops
    reading blocks the route (see :class:`~infx.dispatcher.StreamSendGate`);
    ``on_drained`` is called when it drains again.
    """

    def __init__(self, call: ServerCall, on_drained: Callable[[PeerStream], None] | None = None) -> None:
        self.call = call
        self.sender: Sender | None = None
        self.closed = False
        self._pending: Deferred[Any] | None = None
        self._on_drained = on_drained
        self._gate = StreamSendGate(call, self._drained)

    @property
    def pod_name(self) -> str:
        return self.sender.pod_name if self.sender is not None else ""

    def send_task(self, task: worker_pb2.Task, tenant_id: str) -> SendOutcome:
        if self.closed:
            return SendOutcome.GONE
        return self._gate.send(internal_pb2.ProcessTasksInternalResponse(new_task=task, tenant_id=tenant_id))

    def _drained(self) -> None:
        if not self.closed and self._on_drained is not None:
            self._on_drained(self)

    def close(self, reason: str) -> None:
        """End the stream with UNAVAILABLE (or a reset, if messages the peer has not read
        are queued: a status behind them would never go out); the handler then closes
        the sender."""
        if not self.closed:
            self.closed = True
            if self.call.buffered_amount:
                self.call.reset(reason)
            else:
                self.call.abort(StatusCode.UNAVAILABLE, reason)
            # An aborted call delivers nothing more: wake the handler's pending read.
            if self._pending is not None and not self._pending.called:
                self._pending.cancel()

    async def recv(self) -> internal_pb2.ProcessTasksInternalRequest | None:
        """The next message, or None once the peer half-closed or the stream was closed here."""
        if self.closed:
            return None
        self._pending = self.call.recv()
        try:
            message: internal_pb2.ProcessTasksInternalRequest | None = await self._pending
        except CancelledError:
            return None
        finally:
            self._pending = None
        return message

    def __repr__(self) -> str:
        return f"<PeerStream {self.pod_name or self.call.peer}>"


# --- the dialling side: we dial a peer --------------------------------------------------


class ReceiverLoopState(Enum):
    """Where a :class:`PeerReceiver` is: its stream not yet accepted, accepted, waiting to
    redial, draining, or stopped for good."""

    CONNECTING = "connecting"
    OPEN = "open"
    BACKING_OFF = "backing off"
    DRAINING = "draining"
    STOPPED = "stopped"


class _ReceiverStream:
    """One stream of a :class:`PeerReceiver`: the origin of the tasks forwarded on it."""

    def __init__(self, owner: PeerReceiver, channel: GrpcChannel, call: ClientCall, receiver: Receiver) -> None:
        self.owner = owner
        self.channel = channel
        self.call = call
        self.receiver = receiver
        self._timer = DeadlineTimer(owner.clock, self._fire)
        self._ended = False

    # TaskOrigin: the dispatcher hands us the results of tasks we submitted.

    def result_delivered(self, effect: DeliverResult) -> None:
        self._deliver(effect)

    def request_failed(self, effect: FailRequest) -> None:
        self._deliver(effect)

    def _deliver(self, effect: Union[DeliverResult, FailRequest]) -> None:
        if self.receiver.state in (ReceiverState.OPEN, ReceiverState.DRAINING):
            self.receiver.deliver(effect)
            self.flush()

    def flush(self) -> None:
        """Write what the receiver queued, re-arm its timer, and half-close once drained."""
        for message in self.receiver.pop_messages():
            self.call.send(message).addErrback(lambda _: None)
        if self.receiver.drained and not self._ended:
            self._ended = True
            self.call.end()
        self._arm()

    def _arm(self) -> None:
        self._timer.arm(self.receiver.next_deadline() if self.receiver.state is not ReceiverState.CLOSED else None)

    def _fire(self) -> None:
        if self.receiver.state in (ReceiverState.OPEN, ReceiverState.DRAINING):
            self.receiver.handle_timeout(self.owner.clock.seconds())
            self.flush()

    def disarm(self) -> None:
        self._timer.cancel()


class PeerReceiver:
    """Keeps one ``ProcessTasksInternal`` stream open to one peer pod.

    Each stream gets a fresh channel and a fresh pure
    :class:`~protocol.receiver.Receiver`; when a stream ends the receiver
    redials after a jittered exponential backoff (reset once a stream was
    accepted), until :meth:`stop` or :meth:`drain`. ``on_stopped`` is called
    with this receiver once its loop has ended for good.
    """

    def __init__(
        self,
        clock: IReactorTime,
        dispatcher: Dispatcher,
        config: ExchangerConfig,
        name: str,
        address: PeerAddress,
        connect: Connect,
        on_stopped: Callable[[PeerReceiver], None],
        rng: random.Random,
    ) -> None:
        self.clock = clock
        self.dispatcher = dispatcher
        self.config = config
        self.name = name
        self.address = address
        self._connect = connect
        self._on_stopped = on_stopped
        self._rng = rng
        self.state = ReceiverLoopState.CONNECTING
        self.stream: _ReceiverStream | None = None
        self.failures = 0
        #: Streams opened and accepted by the peer (tests and logs read it).
        self.streams_opened = 0
        self._sleep: Deferred[None] | None = None
        self._sleep_timer: IDelayedCall | None = None
        self._stopping = False
        self._done: Deferred[None] | None = None
        self._metadata: tuple[tuple[str, str], ...] = (
            (("authorization", f"Bearer {config.secret}"),) if config.secret else ())
        #: A peer that refuses us or is not there fails every redial alike: logged once, then counted.
        self._failures = RepeatSuppressor()

    def start(self) -> None:
        log.info("dialling peer {name} at {address}", name=self.name, address=str(self.address))
        self._done = Deferred.fromCoroutine(self._loop())
        self._done.addErrback(lambda f: log.failure("receiver for peer {name} failed", f, name=self.name))
        self._done.addBoth(lambda _: self._on_stopped(self))

    def stop(self) -> Deferred[None]:
        """Stop now: the open stream is cancelled (its forwarded tasks are cancelled here)."""
        self._stopping = True
        self._wake()
        if self.stream is not None:
            self.stream.call.cancel()
        return self._when_done()

    def drain(self) -> Deferred[None]:
        """Graceful stop: report every engine not ready, finish forwarded tasks, then half-close."""
        self._stopping = True
        self._wake()
        stream = self.stream
        if stream is not None and stream.receiver.state is ReceiverState.OPEN:
            self.state = ReceiverLoopState.DRAINING
            stream.receiver.shutdown(self.clock.seconds())
            stream.flush()
        return self._when_done()

    def local_engines_changed(self) -> None:
        stream = self.stream
        if stream is not None and stream.receiver.state in (ReceiverState.OPEN, ReceiverState.DRAINING):
            stream.receiver.local_engines_changed(self.clock.seconds())
            stream.flush()

    def _when_done(self) -> Deferred[None]:
        if self._done is None or self._done.called:
            return succeed(None)
        d: Deferred[None] = Deferred()

        def fired(result: Any) -> Any:
            d.callback(None)
            return result

        self._done.addBoth(fired)
        return d

    def _wake(self) -> None:
        if self._sleep_timer is not None and self._sleep_timer.active():
            self._sleep_timer.cancel()
        self._sleep_timer = None
        sleep, self._sleep = self._sleep, None
        if sleep is not None:
            sleep.callback(None)

    async def _loop(self) -> None:
        while not self._stopping:
            self.state = ReceiverLoopState.CONNECTING
            accepted = await self._run_stream()
            self.failures = 0 if accepted else self.failures + 1
            if self._stopping:
                break
            delay = self.config.backoff.delay(max(1, self.failures), self._rng)
            self.state = ReceiverLoopState.BACKING_OFF
            self._sleep = Deferred()
            self._sleep_timer = self.clock.callLater(delay, self._wake)
            await self._sleep
        self.state = ReceiverLoopState.STOPPED

    async def _run_stream(self) -> bool:
        """One stream from dial to end; True if the peer accepted it."""
        channel = self._connect(self.address)
        call = channel.stream(
            PROCESS_TASKS_INTERNAL,
            internal_pb2.ProcessTasksInternalRequest.SerializeToString,
            internal_pb2.ProcessTasksInternalResponse.FromString,
            metadata=self._metadata,
        )
        receiver = Receiver(self.dispatcher.processor,
                            ReceiverConfig(self.config.pod_name, self.config.status_interval),
                            requests_started=lambda: self.dispatcher.requests_started)
        stream = _ReceiverStream(self, channel, call, receiver)
        receiver.origin = stream
        self.stream = stream
        accepted = False

        def headers_received(_: object) -> None:
            # Response headers without a status: the peer accepted the stream (and our secret).
            nonlocal accepted
            if call.final is None:
                accepted = True
                self.streams_opened += 1
                if self.state is ReceiverLoopState.CONNECTING:
                    self.state = ReceiverLoopState.OPEN
                self._log(self._failures.cleared(self.clock.seconds(), "stream"))
                log.info("peer {name}: connected at {address}", name=self.name, address=str(self.address),
                         event="peer_connected")

        call.initial_metadata().addCallback(headers_received)
        try:
            # Report at once, not after the headers: a server may send none before its first task.
            receiver.connected(self.clock.seconds())
            stream.flush()
            while True:
                message = await call.recv()
                if message is None:
                    break
                self.dispatcher.task_forwarded(receiver, message)
                stream.flush()
        except GrpcError as e:
            if not self._stopping:
                if e.code is StatusCode.UNAUTHENTICATED:
                    why = f"refused our internal secret ({e.message})"
                elif accepted:
                    why = f"lost: {e.code.name} {e.message}"
                else:
                    why = f"cannot be reached: {e.code.name} {e.message}"
                self._log(self._failures.occurred(self.clock.seconds(), "stream", f"peer {self.name} {why}"),
                          warn=e.code is StatusCode.UNAUTHENTICATED)
        except RemoteProtocolError as e:
            log.warn("peer {name} broke the protocol: {error}", name=self.name, error=str(e))
            call.cancel()
        finally:
            self.stream = None
            stream.disarm()
            if receiver.state is not ReceiverState.CLOSED:
                self.dispatcher.receiver_closed(receiver)
            await channel.close()
        return accepted

    def _log(self, reports: list[RepeatReport], warn: bool = False) -> None:
        for report in reports:
            emit = log.warn if warn and report.kind is not RepeatKind.STOPPED else log.info
            emit("{text}", text=report.text(), name=self.name, event="peer_failure", count=report.count)

    def __repr__(self) -> str:
        return f"<PeerReceiver {self.name} {self.address} {self.state.value}>"


# --- the exchanger ------------------------------------------------------------------------


class Exchanger:
    """Receivers for the live peers, senders for the peers that dialled us; see the module docstring.

    ``make_source(on_change)`` builds the pod source (static peers or the
    Kubernetes pod watcher) that tells this exchanger of every peer change;
    ``connect`` makes a channel to a peer's internal port.
    """

    def __init__(
        self,
        clock: IReactorTime,
        dispatcher: Dispatcher,
        config: ExchangerConfig,
        make_source: Callable[[Callable[[PeerChange], None]], PeerSource],
        connect: Connect,
        rng: random.Random | None = None,
    ) -> None:
        self.clock = clock
        self.dispatcher = dispatcher
        self.config = config
        self.source = make_source(self.peer_changed)
        self._connect = connect
        self._rng = rng or random.Random()
        #: The receiver of each live peer pod, by pod name.
        self.receivers: dict[str, PeerReceiver] = {}
        #: Accepted streams of peers that dialled us.
        self.streams: set[PeerStream] = set()
        self._by_pod: dict[str, PeerStream] = {}
        #: Called with a peer's stream and the request counts of each report on it, then with
        #: the stream once it ended (the scaler counts the other gateways' requests).
        self.on_peer_requests: list[Callable[[PeerStream, Mapping[str, int]], None]] = []
        self.on_peer_gone: list[Callable[[PeerStream], None]] = []
        self._shutting_down = False
        self._recreating: dict[str, IDelayedCall] = {}
        #: A peer with the wrong secret redials forever: its refusal is logged once per host, then counted.
        self._refusals = RepeatSuppressor()

    # --- life cycle -------------------------------------------------------------

    def register(self, server: GrpcServer) -> None:
        """Serve ``ProcessTasksInternal`` on ``server`` (the internal port)."""
        server.add_method(
            PROCESS_TASKS_INTERNAL, self.process_tasks_internal,
            internal_pb2.ProcessTasksInternalRequest.FromString,
            internal_pb2.ProcessTasksInternalResponse.SerializeToString,
            kind=CallKind.STREAM_STREAM,
        )

    def start(self) -> None:
        """Start reporting local engine changes and learning peers."""
        self.dispatcher.on_local_engines_changed.append(self.local_engines_changed)
        self.dispatcher.on_engines_removed.append(self.engines_removed)
        self.source.start()

    def drain(self) -> Deferred[Any]:
        """First half of a graceful shutdown: peers stop routing to us; fires once forwarded tasks ended.

        Streams peers opened to us stay up, so that our own in-flight
        requests served by their engines can finish; :meth:`stop` ends them.
        """
        self._shutting_down = True
        self._cancel_recreations()
        stopping = self.source.stop()
        drains = [receiver.drain() for receiver in list(self.receivers.values())]
        return DeferredList([stopping, *drains], consumeErrors=True)

    def stop(self) -> Deferred[Any]:
        """Second half: cancel what is left of our receivers and end every stream peers opened to us."""
        self._shutting_down = True
        self._cancel_recreations()
        if self.local_engines_changed in self.dispatcher.on_local_engines_changed:
            self.dispatcher.on_local_engines_changed.remove(self.local_engines_changed)
        if self.engines_removed in self.dispatcher.on_engines_removed:
            self.dispatcher.on_engines_removed.remove(self.engines_removed)
        stops = [receiver.stop() for receiver in list(self.receivers.values())]
        for stream in list(self.streams):
            self._close_stream(stream, f"gateway {self.config.pod_name!r} is shutting down")
        return DeferredList([self.source.stop(), *stops], consumeErrors=True)

    def _cancel_recreations(self) -> None:
        for delayed in self._recreating.values():
            if delayed.active():
                delayed.cancel()
        self._recreating.clear()

    # --- peers we dial ------------------------------------------------------------

    def peer_changed(self, change: PeerChange) -> None:
        """The pod source's callback: bring that pod's receiver in line with the source."""
        self.reconcile(change.name)

    def reconcile(self, pod: str) -> None:
        """Create, replace or delete ``pod``'s receiver from its current state in the pod source."""
        desired = None if self._shutting_down else self.source.peers.get(pod)
        current = self.receivers.get(pod)
        if pod in self._recreating:
            return  # a failed receiver's replacement is already scheduled
        if current is not None and (desired != current.address or current.state is ReceiverLoopState.STOPPED):
            del self.receivers[pod]
            log.info("peer {name}: stopping its receiver", name=pod)
            current.stop()
            current = None
        if current is None and desired is not None:
            receiver = PeerReceiver(self.clock, self.dispatcher, self.config, pod, desired, self._connect,
                                    self._receiver_stopped, self._rng)
            self.receivers[pod] = receiver
            receiver.start()

    def _receiver_stopped(self, receiver: PeerReceiver) -> None:
        """A receiver that stopped on its own (not replaced, not shut down) failed: it is
        re-created, if still wanted, after a backoff delay (a synchronous failure would
        otherwise loop)."""
        if self.receivers.get(receiver.name) is not receiver or self._shutting_down:
            return
        del self.receivers[receiver.name]
        delay = self.config.backoff.delay(1, self._rng)
        self._recreating[receiver.name] = self.clock.callLater(delay, self._recreate, receiver.name)

    def _recreate(self, pod: str) -> None:
        del self._recreating[pod]
        self.reconcile(pod)

    def local_engines_changed(self) -> None:
        """Local engines changed: every receiver re-reports them (if the report differs)."""
        for receiver in list(self.receivers.values()):
            receiver.local_engines_changed()

    # --- peers that dial us ---------------------------------------------------------

    def engines_removed(self, effect: EnginesRemoved) -> None:
        """Engines left the processor: every peer's sender registers those its peer
        reported while they were registered elsewhere (peers re-report only on change)."""
        for stream in list(self.streams):
            if stream.sender is not None and not stream.closed:
                self.dispatcher.peer_engines_removed(stream.sender, effect.engines)

    async def process_tasks_internal(self, call: ServerCall) -> None:
        """Serve one peer's stream: its reports register its engines, its results reach our requests."""
        if self.config.secret is not None and not _bearer_matches(call, self.config.secret):
            address = str(call.peer)
            host = address.rsplit(":", 1)[0]
            text = f"peer at {host} refused: missing or wrong internal secret"
            for report in self._refusals.occurred(self.clock.seconds(), host, text):
                log.warn("{text}", text=report.text(), address=address, event="peer_refused", count=report.count)
            raise GrpcError(StatusCode.UNAUTHENTICATED, "missing or wrong internal secret")
        if self._shutting_down:
            raise GrpcError(StatusCode.UNAVAILABLE, f"gateway {self.config.pod_name!r} is shutting down")
        stream = PeerStream(call, self.dispatcher.route_writable)
        self.streams.add(stream)
        # Headers now tell the peer's receiver the stream is accepted before any task flows.
        call.send_initial_metadata()
        try:
            while True:
                message = await stream.recv()
                if message is None:
                    break
                kind = message.WhichOneof("message")
                if kind == "server_status":
                    self.add_or_update_server_status(stream, message)
                elif stream.sender is None:
                    raise GrpcError(StatusCode.FAILED_PRECONDITION, "a task result arrived before any ServerStatus")
                else:
                    self.dispatcher.peer_reported(stream.sender, message)
        except RemoteProtocolError as e:
            raise GrpcError(StatusCode.INVALID_ARGUMENT, str(e)) from None
        finally:
            self._forget_stream(stream)

    def add_or_update_server_status(self, stream: PeerStream,
                                    message: internal_pb2.ProcessTasksInternalRequest) -> None:
        """A peer reported its engines on ``stream``; the stream's sender is created on its first report.

        A newer stream from the same pod replaces the older one (the peer
        reconnected; the old connection is stale).
        """
        pod = message.server_status.pod_name
        if stream.sender is None:
            stream.sender = Sender(self.dispatcher.processor, route=stream)
            log.info("peer {pod} dialled in from {address} with {engines} engines", pod=pod or "?",
                     address=str(stream.call.peer), engines=len(message.server_status.engine_statuses),
                     event="peer_dialled_in")
        if message.server_status.draining and not stream.sender.peer_draining:
            log.info("peer {pod} is draining: its engines take no new tasks from here", pod=pod or "?",
                     event="peer_draining")
        older = self._by_pod.get(pod)
        if older is not None and older is not stream:
            self.remove_server(pod)
        self.dispatcher.peer_reported(stream.sender, message)
        if pod:
            self._by_pod[pod] = stream
        for listener in self.on_peer_requests:
            listener(stream, stream.sender.requests_started)

    def remove_server(self, pod_name: str) -> None:
        """Drop the stream ``pod_name`` opened to us: its engines go, their tasks fail over."""
        stream = self._by_pod.pop(pod_name, None)
        if stream is not None:
            self._close_stream(stream, f"peer {pod_name!r} reconnected or is gone")

    def _close_stream(self, stream: PeerStream, reason: str) -> None:
        self._forget_stream(stream)
        stream.close(reason)

    def _forget_stream(self, stream: PeerStream) -> None:
        if stream not in self.streams:
            return
        self.streams.discard(stream)
        if self._by_pod.get(stream.pod_name) is stream:
            del self._by_pod[stream.pod_name]
        if stream.sender is not None:
            log.info("peer {pod} disconnected: its {engines} engines are gone here", pod=stream.pod_name or "?",
                     engines=len(stream.sender.engines), event="peer_gone")
            self.dispatcher.peer_stream_closed(stream.sender)
            for gone in self.on_peer_gone:
                gone(stream)


def _bearer_matches(call: ServerCall, secret: str) -> bool:
    expected = f"Bearer {secret}".encode()
    for key, value in call.metadata:
        if key == "authorization":
            given = value if isinstance(value, bytes) else value.encode("latin-1")
            return hmac.compare_digest(given, expected)
    return False
