"""The task exchanger: gateway replicas lend each other their engines over ``ProcessTasksInternal``.

Rules this file keeps: no decisions. The pure gateway core
(:mod:`protocol.gateway.core`, through the :class:`~infx.gateway.dispatcher.Dispatcher`,
its one caller) decides which peers to dial, when to redial, which stream
replaces which, what to report and what to refuse; this file maps gRPC calls
to the core's inputs and performs its peer effects (open, write, half-close,
cancel a dial; end an accepted stream; log; tell the scaler of peer reports).
The clock, the dispatcher, the pod source and the channel factory are passed
in.

Every gateway runs both halves. It *serves* ``ProcessTasksInternal`` on its
internal port: each peer that dials in gets a :class:`AcceptedPeerStream`, which the
core gives a pure ``AcceptedPeer`` on its first ``ServerStatus`` (the peer's
engines become remote engines whose route is that stream). And it *dials*
every live peer pod: for each :class:`~protocol.gateway.effects.Dial` the
core asks for, a :class:`DialledPeerStream` opens the call, feeds the core what the
peer forwards, and reports when the stream ends.

The four data flows, from this gateway's point of view:

- Engine registration: a local engine's ``EngineStatus`` -> local processor
  (``LocalEnginesChanged``) -> every dialled peer in the core re-reports the local
  engines -> peer's internal server -> peer's ``AcceptedPeer`` -> peer's processor,
  where the engine is registered as remote. Remote engines are never
  re-reported, so reports cannot loop between gateways. Accepted streams
  answer with ``x-infx-status-delta: 1`` in their headers, so an infx peer
  reports only what changed; a LLMariner peer ignores the header and a
  LLMariner server sends none (full snapshots, see
  :mod:`protocol.exchange.status_reports`).
- New task scheduling: HTTP handler -> local processor, which picks a local
  engine (preferred) or a remote one; for a remote engine the task goes to
  the ``AcceptedPeerStream`` of the peer that reported it, with its tenant id -> the
  peer's dialled peer -> the peer's processor, pinned to that engine.
- Task result processing: engine -> the peer's processor -> its
  dialled peer -> our ``AcceptedPeerStream`` -> our ``AcceptedPeer`` -> our processor,
  which orders the results and hands them to the HTTP request.
- Load for the autoscaler: HTTP handler -> the core counts the request
  per model -> every dialled peer's next report carries the cumulative
  counts -> the peer's ``AcceptedPeer`` -> the peer's ``on_peer_requests`` hooks
  (its scaler), which count the increases as started requests; only one
  gateway runs the autoscaler, and it must see every gateway's requests.

Peers come from a :class:`~infx.discovery.kube.PeerSource` (``--peers`` or the pod
watcher of ``--kube``); every change hands the core the live peers, and the
core keeps exactly one stream per live peer at its current address.
"""

from __future__ import annotations

import hmac
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from twisted.internet.defer import CancelledError, Deferred, DeferredList, succeed
from twisted.python.failure import Failure
from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger

from infx.discovery.kube import PeerSource
from infx.gateway.dispatcher import Dispatcher, SendOutcome, StreamSendGate
from infx.transport import CallKind, ClientCall, GrpcChannel, GrpcError, GrpcServer, ServerCall
from protocol.discovery.peers import PeerAddress, PeerChange
from protocol.exchange.dial_backs import PEER_PORT_HEADER, dial_back_address
from protocol.gateway.dialling import PeerDialling
from protocol.gateway.effects import (
    CancelDial,
    CoreEffect,
    Dial,
    EndPeerStream,
    HalfCloseDial,
    OpenDial,
    PeerDialledBack,
    PeerDialledIn,
    PeerDisconnected,
    PeerDraining,
    PeerGone,
    PeerOneWay,
    PeerRequests,
    SendOnDial,
)
from protocol.grpc import StatusCode
from protocol.grpc.metadata import Metadata
from protocol.pb import internal_pb2, worker_pb2
from protocol.supervisor.siblings import SiblingCopies
from protocol.repeats import RepeatKind, RepeatReport, RepeatSuppressor
from protocol.processor.route_flow import MAX_ROUTE_QUEUED_BYTES

__all__ = [
    "PROCESS_TASKS_INTERNAL",
    "DialledPeerStream",
    "Exchanger",
    "ExchangerConfig",
    "AcceptedPeerStream",
    "StatusTraffic",
]

log = Logger(namespace="infx.exchanger")

PROCESS_TASKS_INTERNAL = "/llmariner.inference.server.v1.InferenceInternalService/ProcessTasksInternal"


@dataclass(frozen=True)
class ExchangerConfig:
    """How this gateway's peer streams are authenticated and named in logs.

    ``pod_name`` names this gateway; ``secret``, when set, is required of
    peers as ``authorization: Bearer <secret>`` and presented to them;
    ``peer_port``, the port of this gateway's internal server, goes in the
    headers of every stream it dials, so that a peer that does not dial it
    dials it back (:mod:`protocol.exchange.dial_backs`); ``max_queued_bytes``
    is what a peer's stream may hold queued before it refuses tasks (see
    :class:`~infx.gateway.dispatcher.StreamSendGate`). A worker of
    ``twistd infx --workers N`` (:mod:`infx.supervisor`) adds ``accept_metadata`` to the
    headers of the streams it accepts (its siblings' internal ports) and drops from the
    reports of ``siblings`` (pod names) their copies of the engines every worker runs
    itself (:class:`~protocol.supervisor.siblings.SiblingCopies`). What the core needs
    (status interval, redial backoff) is in its
    :class:`~protocol.gateway.effects.CoreConfig`.
    """

    pod_name: str
    secret: str | None = None
    peer_port: int | None = None
    max_queued_bytes: int = MAX_ROUTE_QUEUED_BYTES
    accept_metadata: tuple[tuple[str, str], ...] = ()
    siblings: frozenset[str] = frozenset()


@dataclass
class StatusTraffic:
    """Status reports exchanged with one peer since start (``ServerStatus`` messages and their
    encoded bytes), and when its last report arrived (on the gateway's clock), for operators."""

    reports_sent: int = 0
    bytes_sent: int = 0
    reports_received: int = 0
    bytes_received: int = 0
    last_report_at: float | None = None


#: Makes a channel to a peer's internal port (plain TCP or TLS is the caller's choice).
Connect = Callable[[PeerAddress], GrpcChannel]


# --- the accepting side: a peer dialled us ------------------------------------------


class AcceptedPeerStream:
    """One accepted ``ProcessTasksInternal`` stream: the route of the engines its peer reports.

    A peer that stops reading blocks the route (see
    :class:`~infx.gateway.dispatcher.StreamSendGate`); ``on_drained`` is called when
    it drains again.
    """

    def __init__(self, call: ServerCall, on_drained: Callable[[AcceptedPeerStream], None] | None = None,
                 max_queued_bytes: int = MAX_ROUTE_QUEUED_BYTES) -> None:
        self.call = call
        #: The peer's pod name, from its first report; whether its reports say it is draining.
        self.pod_name = ""
        self.draining = False
        self.closed = False
        #: The read of :meth:`read_each`, and whether a message of it is being handled now.
        self._reading: Deferred[None] | None = None
        self._handling = False
        self._on_drained = on_drained
        self._gate = StreamSendGate(call, self._drained, max_queued_bytes)

    def send_task(self, task: worker_pb2.Task, tenant_id: str) -> SendOutcome:
        if self.closed:
            return SendOutcome.GONE
        return self._gate.send(internal_pb2.ProcessTasksInternalResponse(new_task=task, tenant_id=tenant_id), task.id)

    def withdraw_task(self, wire_id: str) -> bool:
        return not self.closed and self._gate.withdraw(wire_id)

    @property
    def queued_bytes(self) -> int:
        """Bytes queued for the peer that it has not taken yet."""
        return self._gate.queued_bytes

    def _drained(self) -> None:
        if not self.closed and self._on_drained is not None:
            self._on_drained(self)

    def close(self, reason: str) -> None:
        """End the stream with UNAVAILABLE (or a reset, if messages the peer has not read
        are queued: a status behind them would never go out)."""
        self.end(StatusCode.UNAVAILABLE, reason)

    def end(self, code: StatusCode, message: str) -> None:
        """End the stream with ``code``; the handler's read ends."""
        if self.closed:
            return
        self.closed = True
        if code is StatusCode.UNAVAILABLE and self.call.buffered_amount:
            self.call.reset(message)
        else:
            self.call.abort(code, message)
        # An aborted call delivers nothing more: wake a read that waits for the next message.
        # One handling a message now sees the call's end as soon as that handler returns.
        if self._reading is not None and not self._reading.called and not self._handling:
            self._reading.cancel()

    def read_each(self, on_message: Callable[[internal_pb2.ProcessTasksInternalRequest], None]) -> Deferred[None]:
        """Hand each message to ``on_message`` as it arrives (no Deferred per message, see
        :meth:`~infx.transport.calls.CallBase.read_each`) until the peer half-closed or the
        stream is closed here: then fires None, the messages behind the one whose handling
        closed it left unread; fails as the call's read does if the call ended otherwise."""
        if self.closed:
            return succeed(None)

        def each(message: internal_pb2.ProcessTasksInternalRequest) -> None:
            self._handling = True
            try:
                on_message(message)
            finally:
                self._handling = False
            if self.closed:
                raise _ClosedHere()  # the read stops here, as the recv() loop's ``while not closed`` did

        def ended_here(failure: Failure) -> None | Failure:
            # Stopped after a message, cancelled by end() while waiting, or the call reset by it.
            closed = isinstance(failure.value, (_ClosedHere, CancelledError, GrpcError)) and self.closed
            return None if closed else failure

        self._reading = self.call.read_each(each)
        self._reading.addErrback(ended_here)
        return self._reading

    def __repr__(self) -> str:
        return f"<AcceptedPeerStream {self.pod_name or self.call.peer}>"


class _ClosedHere(Exception):
    """Raised out of a message's handling that closed the stream: ends its read (never seen outside)."""


# --- the dialling side: we dial a peer --------------------------------------------------


class DialledPeerStream:
    """The gRPC call of one :class:`~protocol.gateway.effects.Dial`: what the peer forwards goes
    to the core, and the core hears when the peer accepted the stream and when it ended."""

    def __init__(self, exchanger: Exchanger, dial: Dial, channel: GrpcChannel) -> None:
        self.exchanger = exchanger
        self.dial = dial
        self.channel = channel
        self.call: ClientCall = channel.stream(
            PROCESS_TASKS_INTERNAL,
            internal_pb2.ProcessTasksInternalRequest.SerializeToString,
            internal_pb2.ProcessTasksInternalResponse.FromString,
            metadata=exchanger.metadata,
        )
        self.cancelled = False
        self.accepted = False
        # Known before it runs: a call that fails at once ends inside this constructor.
        exchanger.dials[dial] = self
        self.done: Deferred[None] = Deferred.fromCoroutine(self._run())
        self.done.addErrback(lambda f: log.failure("stream to peer {name} failed", f, name=dial.name))

    def send(self, message: internal_pb2.ProcessTasksInternalRequest) -> None:
        self.call.send(message).addErrback(lambda _: None)

    def cancel(self) -> None:
        self.cancelled = True
        self.call.cancel()

    def _headers_received(self, metadata: Metadata) -> None:
        # Response headers without a status: the peer accepted the stream (and our secret);
        # an infx peer's say it reads status deltas.
        if self.call.final is None and not self.accepted:
            self.accepted = True
            self.exchanger.dial_accepted(self, metadata)

    async def _run(self) -> None:
        exchanger, dial = self.exchanger, self.dial
        dispatcher = exchanger.dispatcher
        self.call.initial_metadata().addCallbacks(self._headers_received, lambda _: None)

        def on_message(message: internal_pb2.ProcessTasksInternalResponse) -> None:
            if message.new_task.request.WhichOneof("request") != "cancel_task":
                dispatcher.metrics.exchanged.labels("in").inc()
            dispatcher.run(lambda now: dispatcher.core.dial_message(dial, message, now))

        try:
            # Each message as it arrives (a result per relayed event), no Deferred each.
            await self.call.read_each(on_message)
        except GrpcError as e:
            if not self.cancelled and not dispatcher.core.shutting_down:
                exchanger.dial_failed(self, e)
        finally:
            await exchanger.dial_ended(self)


# --- the exchanger ------------------------------------------------------------------------


class Exchanger:
    """The gRPC side of the peer exchange; see the module docstring.

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
    ) -> None:
        self.clock = clock
        self.dispatcher = dispatcher
        self.config = config
        self.source = make_source(self.peer_changed)
        self._connect = connect
        self.metadata: tuple[tuple[str, str], ...] = (
            *((("authorization", f"Bearer {config.secret}"),) if config.secret else ()),
            *(((PEER_PORT_HEADER, str(config.peer_port)),) if config.peer_port else ()))
        #: Accepted streams of peers that dialled us.
        self.streams: set[AcceptedPeerStream] = set()
        #: The open call of each dial the core asked for.
        self.dials: dict[Dial, DialledPeerStream] = {}
        #: Called with a peer's stream and the request counts of each report on it, then with
        #: the stream once it ended (the scaler counts the other gateways' requests).
        self.on_peer_requests: list[Callable[[AcceptedPeerStream, Mapping[str, int]], None]] = []
        self.on_peer_gone: list[Callable[[AcceptedPeerStream], None]] = []
        #: Called with each accepted dial's peer name, address and response headers.
        self.on_dial_accepted: list[Callable[[str, PeerAddress, Metadata], None]] = []
        self._drained: list[Deferred[None]] = []
        #: A peer that refuses us or is not there fails every redial alike: logged once, then counted.
        self._failures: dict[str, RepeatSuppressor] = {}
        #: A peer with the wrong secret redials forever: its refusal is logged once per host, then counted.
        self._refusals = RepeatSuppressor()
        #: Status reports read from each peer, by the pod its reports name, and sent to each peer
        #: we dial, by the name we dial it under (``PeerDialling.name``).
        self.reports_received: dict[str, StatusTraffic] = {}
        self.reports_sent: dict[str, StatusTraffic] = {}

    @property
    def receivers(self) -> Mapping[str, PeerDialling]:
        """The peers dialled now, by pod name (the core's records, read only)."""
        return self.dispatcher.core.peers

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
        """Perform the core's peer effects and start learning peers."""
        self.dispatcher.peer_effects = self.perform
        self.source.start()

    def drain(self) -> Deferred[Any]:
        """First half of a graceful shutdown: peers stop routing to us; fires once forwarded tasks ended.

        Streams peers opened to us stay up, so that our own in-flight
        requests served by their engines can finish; :meth:`stop` ends them.
        """
        stopping = self.source.stop()
        self.dispatcher.run(self.dispatcher.core.drain_peers)
        drained: Deferred[None] = Deferred()
        self._drained.append(drained)
        self._check_drained()
        return DeferredList([stopping, drained], consumeErrors=True)

    def stop(self) -> Deferred[Any]:
        """Second half: cancel what is left of our dials and end every stream peers opened to us."""
        stopping = self.source.stop()
        self.dispatcher.run(self.dispatcher.core.stop)
        return DeferredList([stopping, *[stream.done for stream in list(self.dials.values())]], consumeErrors=True)

    def _check_drained(self) -> None:
        if self.dispatcher.core.dialling == 0 and not self.dials:
            waiters, self._drained = self._drained, []
            for waiter in waiters:
                waiter.callback(None)

    # --- peers we dial ------------------------------------------------------------

    def peer_changed(self, change: PeerChange) -> None:
        """The pod source's callback: the core brings its dials in line with the source."""
        self.dispatcher.run(lambda now: self.dispatcher.core.peers_changed(dict(self.source.peers), now))

    def dial_accepted(self, stream: DialledPeerStream, metadata: Metadata) -> None:
        name = stream.dial.name
        self._log(name, self._suppressor(name).cleared("stream", self.clock.seconds()))
        log.info("peer {name}: connected at {address}", name=name, address=str(stream.dial.address),
                 event="peer_connected")
        self.dispatcher.run(lambda now: self.dispatcher.core.dial_accepted(stream.dial, metadata, now))
        for listener in self.on_dial_accepted:
            listener(name, stream.dial.address, metadata)  # type: ignore[arg-type]

    def dial_failed(self, stream: DialledPeerStream, error: GrpcError) -> None:
        name = stream.dial.name
        if error.code is StatusCode.UNAUTHENTICATED:
            why = f"refused our internal secret ({error.message})"
        elif stream.accepted:
            why = f"lost: {error.code.name} {error.message}"
        else:
            why = f"cannot be reached: {error.code.name} {error.message}"
        self._log(name, self._suppressor(name).occurred("stream", f"peer {name} {why}", self.clock.seconds()),
                  warn=error.code is StatusCode.UNAUTHENTICATED)

    async def dial_ended(self, stream: DialledPeerStream) -> None:
        if self.dials.get(stream.dial) is stream:
            del self.dials[stream.dial]
        self.dispatcher.run(lambda now: self.dispatcher.core.dial_closed(stream.dial, now))
        await stream.channel.close()
        self._check_drained()

    def _suppressor(self, name: str) -> RepeatSuppressor:
        return self._failures.setdefault(name, RepeatSuppressor())

    def _log(self, name: str, reports: list[RepeatReport], warn: bool = False) -> None:
        for report in reports:
            emit = log.warn if warn and report.kind is not RepeatKind.STOPPED else log.info
            emit("{text}", text=report.text(), name=name, event="peer_failure", count=report.count)

    # --- the core's peer effects ---------------------------------------------------

    def perform(self, effect: CoreEffect) -> None:
        """Perform one of the core's effects on a dial or an accepted peer stream."""
        if isinstance(effect, OpenDial):
            self._open(effect.dial)
        elif isinstance(effect, SendOnDial):
            dialled = self.dials.get(effect.dial)
            if dialled is not None:
                dialled.send(effect.message)
                if effect.message.WhichOneof("message") == "server_status":
                    sent = self.reports_sent.setdefault(effect.dial.name, StatusTraffic())
                    sent.reports_sent += 1
                    sent.bytes_sent += effect.message.ByteSize()
        elif isinstance(effect, HalfCloseDial):
            dialled = self.dials.get(effect.dial)
            if dialled is not None:
                dialled.call.end()
        elif isinstance(effect, CancelDial):
            dialled = self.dials.get(effect.dial)
            log.info("peer {name}: stream given up: {reason}", name=effect.dial.name, reason=effect.reason)
            if dialled is not None:
                dialled.cancel()
        elif isinstance(effect, EndPeerStream):
            stream: AcceptedPeerStream = effect.stream  # type: ignore[assignment]
            self.streams.discard(stream)
            stream.end(effect.code, effect.message)
        elif isinstance(effect, PeerDialledIn):
            stream = effect.stream  # type: ignore[assignment]
            stream.pod_name = effect.pod_name
            log.info("peer {pod} dialled in from {address} with {engines} engines", pod=effect.pod_name or "?",
                     address=str(stream.call.peer), engines=effect.engines, event="peer_dialled_in")
        elif isinstance(effect, PeerDialledBack):
            log.info("peer {pod} dialled in and this gateway does not dial it: dialling it back at {address}",
                     pod=effect.pod_name, address=str(effect.address), event="peer_dialled_back")
        elif isinstance(effect, PeerOneWay):
            log.warn("peer {pod} dialled in, but this gateway does not dial it and it gave no port to dial it "
                     "back at: its engines serve here, this gateway's do not serve there; list it in --peers",
                     pod=effect.pod_name, event="peer_one_way")
        elif isinstance(effect, PeerDraining):
            draining: AcceptedPeerStream = effect.stream  # type: ignore[assignment]
            draining.draining = True
            log.info("peer {pod} is draining: its engines take no new tasks from here", pod=effect.pod_name or "?",
                     event="peer_draining")
        elif isinstance(effect, PeerDisconnected):
            log.info("peer {pod} disconnected: its {engines} engines are gone here", pod=effect.pod_name or "?",
                     engines=effect.engines, event="peer_gone")
        elif isinstance(effect, PeerRequests):
            for listener in self.on_peer_requests:
                listener(effect.stream, effect.counts)  # type: ignore[arg-type]
        elif isinstance(effect, PeerGone):
            self.streams.discard(effect.stream)  # type: ignore[arg-type]
            for gone in self.on_peer_gone:
                gone(effect.stream)  # type: ignore[arg-type]

    def _open(self, dial: Dial) -> None:
        if dial.attempt == 1:
            log.info("dialling peer {name} at {address}", name=dial.name, address=str(dial.address))
        try:
            DialledPeerStream(self, dial, self._connect(dial.address))  # type: ignore[arg-type]
        except Exception:
            log.failure("cannot dial peer {name}", name=dial.name)
            self.dispatcher.run_later(lambda now: self.dispatcher.core.dial_closed(dial, now))

    # --- peers that dial us ---------------------------------------------------------

    async def process_tasks_internal(self, call: ServerCall) -> None:
        """Serve one peer's stream: its reports register its engines, its results reach our requests."""
        if self.config.secret is not None and not _bearer_matches(call, self.config.secret):
            address = str(call.peer)
            host = address.rsplit(":", 1)[0]
            text = f"peer at {host} refused: missing or wrong internal secret"
            for report in self._refusals.occurred(host, text, self.clock.seconds()):
                log.warn("{text}", text=report.text(), address=address, event="peer_refused", count=report.count)
            raise GrpcError(StatusCode.UNAUTHENTICATED, "missing or wrong internal secret")
        call.authenticated()
        core = self.dispatcher.core
        stream = AcceptedPeerStream(call, self.dispatcher.route_writable, self.config.max_queued_bytes)
        self.streams.add(stream)
        dial_back = dial_back_address(call.metadata, str(call.peer).rsplit(":", 1)[0])
        self.dispatcher.run(lambda now: core.accepted_peer_opened(stream, dial_back, now))
        if not stream.closed:
            # Headers now tell the peer's dialled peer the stream is accepted before any task flows,
            # that this side reads status deltas (a LLMariner dialled peer ignores that) and its pod.
            call.send_initial_metadata((*core.accept_metadata, *self.config.accept_metadata))
        siblings, copies = self.config.siblings, SiblingCopies()

        def on_message(message: internal_pb2.ProcessTasksInternalRequest) -> None:
            if message.WhichOneof("message") == "server_status":
                read = self.reports_received.setdefault(message.server_status.pod_name, StatusTraffic())
                read.reports_received += 1
                read.bytes_received += message.ByteSize()
                read.last_report_at = self.clock.seconds()
                if siblings and message.server_status.pod_name in siblings:
                    message = copies.filter(message)
            self.dispatcher.run(lambda now: core.accepted_peer_message(stream, message, now))

        try:
            await stream.read_each(on_message)
        finally:
            self.streams.discard(stream)
            self.dispatcher.run(lambda now: core.accepted_peer_closed(stream, now))


def _bearer_matches(call: ServerCall, secret: str) -> bool:
    expected = f"Bearer {secret}".encode()
    for key, value in call.metadata:
        if key == "authorization":
            given = value if isinstance(value, bytes) else value.encode("latin-1")
            return hmac.compare_digest(given, expected)
    return False
