"""gRPC on Twisted: a thin adapter that feeds :mod:`protocol.grpc` and
performs its effects.

Rules this file keeps: no protocol logic (framing, status, flow control and
deadlines live in the pure :class:`protocol.grpc.GrpcConnection`); the
reactor's clock and endpoints are always passed in, never imported; one
``callLater`` per connection armed from ``next_deadline()`` (plus a
zero-delay one that batches a burst of sends into one flush); one write
per batch (a gathering ``sendmsg``/``writeSequence`` on TCP, so that large
messages are not copied on their way out); (de)serialisation happens here,
the machine moves bytes.

Backpressure: a call's ``send()`` returns an already-fired Deferred while
little is queued for it and the transport is not paused (the protocol is
the transport's push producer); otherwise the Deferred fires when the
machine reports the queue drained (peer's flow-control window) and the
transport has resumed.  Received messages are acknowledged to HTTP/2 flow
control when ``recv()`` hands them over, so a slow reader slows its sender.

Server::

    server = GrpcServer(reactor)
    server.add_method("/pkg.Svc/Echo", echo, Request.FromString,
                      Response.SerializeToString, kind=CallKind.UNARY_UNARY)
    port = await listen_grpc(reactor, "tcp:50051", server)

Client::

    channel = GrpcChannel(reactor, client_endpoint(reactor, "h", 50051))
    reply = await channel.unary("/pkg.Svc/Echo", req, Request.SerializeToString,
                                Response.FromString, timeout=5)
    call = channel.stream("/pkg.Svc/Chat", ser, deser)
    await call.send(msg); call.end()
    async for reply in call: ...
"""

from __future__ import annotations

import enum
import inspect
import random
import weakref
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

from twisted.internet import error as internet_error
from twisted.internet import tcp
from twisted.internet.defer import CancelledError, Deferred, fail, succeed
from twisted.internet.endpoints import serverFromString
from twisted.internet.interfaces import (
    IDelayedCall,
    IListeningPort,
    IProtocolNegotiationFactory,
    IPushProducer,
    IReactorTime,
    IStreamClientEndpoint,
)
from twisted.internet.protocol import Factory, Protocol
from twisted.logger import Logger
from twisted.python.failure import Failure
from zope.interface import implementer

from infx.deadline import DeadlineTimer
from protocol.grpc import (
    CallEnded,
    CallLimitReached,
    CallStarted,
    ConnectionTerminated,
    EndCause,
    Event,
    GoAwayReceived,
    GrpcConfig,
    GrpcConnection,
    InputEnded,
    LocalProtocolError,
    MessageReceived,
    MessageTooLarge,
    Metadata,
    PingAcknowledged,
    ResponseHeadersReceived,
    SendBufferDrained,
    StatusCode,
)

__all__ = [
    "CallKind", "ChannelState", "ClientCall", "GrpcChannel", "GrpcError", "GrpcProtocol",
    "GrpcServer", "ServerCall", "Status", "StatusCode", "client_endpoint",
    "listen_grpc",
]

log = Logger()

#: Bytes asked of the socket per read.
READ_SIZE = 1 << 20
#: Bytes of requests a call keeps for a transparent retry (grpc-core's
#: default retry buffer); a call that sent more is not retried.
RETRY_BUFFER_LIMIT = 256 * 1024
#: Attempts of one call, counting the first, when streams are refused.
MAX_ATTEMPTS = 5
#: A call's send() Deferred is already fired while fewer than this many
#: bytes wait to be handed to HTTP/2 (and the transport is not paused).
SEND_HIGH_WATER = 64 * 1024
#: Buffers per ``sendmsg`` call, well under Linux's IOV_MAX (1024).
_IOV_MAX = 512

Serializer = Callable[[Any], bytes]
Deserializer = Callable[[bytes], Any]


def _identity(data: Any) -> Any:
    return data


def _weakly(method: Callable[[], None]) -> Callable[[], None]:
    """``method`` without the reference to its object: a no-op once the
    object is gone (a timer or delayed call then never keeps it alive)."""
    ref = weakref.WeakMethod(method)

    def call() -> None:
        bound = ref()
        if bound is not None:
            bound()

    return call


class GrpcError(Exception):
    """A call ended with a non-OK status.

    Raise it from a handler to end the call with that status; a client
    call's Deferreds fail with it.
    """

    def __init__(self, code: StatusCode, message: str = "", trailers: Metadata = ()) -> None:
        super().__init__(f"{StatusCode(code).name}: {message}")
        self.code = StatusCode(code)
        self.message = message
        self.trailers = trailers


@dataclass(frozen=True)
class Status:
    """The final status of a call."""

    code: StatusCode
    message: str
    trailers: Metadata

    def error(self) -> GrpcError:
        return GrpcError(self.code, self.message, self.trailers)


class CallKind(enum.Enum):
    """How a handler is called (all four share the same ServerCall)."""

    #: ``handler(request, call) -> response`` (value, Deferred or coroutine)
    UNARY_UNARY = "unary_unary"
    #: ``handler(request, call)`` sends with ``call.send``; it may instead
    #: return an iterable / async iterable of responses.
    UNARY_STREAM = "unary_stream"
    #: ``handler(call) -> response``; reads with ``call.recv()``.
    STREAM_UNARY = "stream_unary"
    #: ``handler(call)`` reads with ``call.recv()`` and sends with
    #: ``call.send``; may instead return an (async) iterable of responses.
    STREAM_STREAM = "stream_stream"


def _as_deferred(result: Any) -> Deferred[Any]:
    if isinstance(result, Deferred):
        return result
    if inspect.iscoroutine(result):
        return Deferred.fromCoroutine(result)
    return succeed(result)


# ---------------------------------------------------------------------------
# The connection adapter


def _write(transport: Any, buffers: list[bytes | memoryview]) -> None:
    """Write ``buffers`` in order, straight to the socket when Twisted's
    buffer is empty.

    Twisted's TCP ``write`` only buffers: the bytes leave on the next
    reactor turn, after another poll, and then at most 128 KiB per turn.
    For request/response traffic that is a poll per round trip (PERF-NOTES:
    up to +35 %); for large messages it is a poll per 128 KiB plus joining
    the payload into Twisted's buffer.  One gathering ``sendmsg`` hands the
    buffers (large payloads uncopied, see ``buffers_to_send``) to the
    kernel instead.  This leans on ``twisted.internet.abstract``
    ``FileDescriptor``/``tcp.Connection`` internals (``socket``,
    ``dataBuffer``/``offset``, ``_tempDataBuffer``), so it only takes the
    fast path for a plain TCP connection whose buffers are empty, and
    otherwise falls back to ``writeSequence`` (one ``write`` of the joined
    bytes on other transports); what the socket does not take is handed to
    ``writeSequence``, in order, behind nothing.
    """
    # Only a real TCP connection: TLS (and other wrappers) forward unknown
    # attributes to the socket transport underneath, bypassing encryption.
    if not isinstance(transport, tcp.Connection):
        transport.write(b"".join(buffers))  # one write per batch
        return
    if (transport.connected and not transport.disconnecting
            and not getattr(transport, "_writeDisconnected", True)
            and getattr(transport, "_tempDataBuffer", None) == []
            and transport.offset >= len(transport.dataBuffer)):
        buffers = _send_gathered(transport.socket, buffers)
    if buffers:
        transport.writeSequence([b if type(b) is bytes else bytes(b) for b in buffers])


def _send_gathered(sock: Any, buffers: list[bytes | memoryview]) -> list[bytes | memoryview]:
    """Send what a non-blocking socket takes now; return the rest, in order.

    Any error leaves the rest to Twisted's own write, which reports it the
    way it reports every write error.
    """
    index = 0
    count = len(buffers)
    while index < count:
        end = min(index + _IOV_MAX, count)
        batch = buffers[index:end]
        try:
            sent: int = sock.sendmsg(batch)
        except OSError:
            break
        partial = sent < sum(len(b) for b in batch)
        while index < end and sent >= len(buffers[index]):
            sent -= len(buffers[index])
            index += 1
        if partial:
            if sent:
                buffers[index] = memoryview(buffers[index])[sent:]
            break
    return buffers[index:]


@implementer(IPushProducer)
class GrpcProtocol(Protocol):
    """An HTTP/2 connection: feeds the machine, writes its bytes in one
    write per batch, runs its one timer, and pauses senders while the
    transport's buffer is full (it is the transport's push producer)."""

    def __init__(self, clock: IReactorTime, config: GrpcConfig) -> None:
        self.clock = clock
        self.conn = GrpcConnection(config)
        # The timer holds us weakly: a closed connection is then freed by
        # reference counting alone, not at the next full collection.
        self._timer = DeadlineTimer(clock, _weakly(self._on_timer))
        self._flush_call: IDelayedCall | None = None
        # The next turn's share of input held back by the frame budget.
        self._input_call: IDelayedCall | None = None
        self._reading_paused = False
        self._dispatching = False
        self._call_start_written = False
        self._closed = False
        #: True while the transport asked us to stop producing.
        self.paused = False
        self._resume_waiters: list[Callable[[], None]] = []

    # -- Twisted hooks ------------------------------------------------------

    def connectionMade(self) -> None:
        assert self.transport is not None
        # gRPC latency depends on small writes leaving at once (grpc-core
        # sets TCP_NODELAY too); TLS wrappers expose the socket via getHandle.
        for candidate in (self.transport, getattr(self.transport, "transport", None)):
            set_no_delay = getattr(candidate, "setTcpNoDelay", None)
            if set_no_delay is not None:
                set_no_delay(True)
                # Twisted reads 64 KiB per recv(); big messages arrive in
                # far fewer reads (and h2 calls) with 1 MiB (PERF-NOTES).
                if hasattr(candidate, "bufferSize"):
                    candidate.bufferSize = READ_SIZE
                break
        self.transport.registerProducer(self, True)
        self.conn.initiate(self.clock.seconds())
        self.flush()

    def dataReceived(self, data: bytes) -> None:
        self._receive(self.conn.receive_data, data)

    def _receive(self, receive: Callable[..., list[Event]], *data: bytes) -> None:
        """Feed the machine (at most its frame budget per turn), dispatch,
        write.  While input is held back, the transport stops reading and
        the rest goes in at the next reactor turn, after other connections
        had theirs: one connection's flood of tiny frames cannot starve them."""
        self._dispatching = True
        try:
            self.dispatch(receive(*data, self.clock.seconds()))
        finally:
            self._dispatching = False
        self.flush()
        if self._closed or self.transport is None:
            return
        if self.conn.has_pending_input:
            if not self._reading_paused:
                self._reading_paused = True
                self.transport.pauseProducing()
            if self._input_call is None:
                self._input_call = self.clock.callLater(0, _weakly(self._receive_pending))
        elif self._reading_paused:
            self._reading_paused = False
            self.transport.resumeProducing()

    def _receive_pending(self) -> None:
        self._input_call = None
        if not self._closed:
            self._receive(self.conn.receive_pending)

    def connectionLost(self, reason: Failure = internet_error.ConnectionDone()) -> None:  # type: ignore[assignment]
        self._closed = True
        self._timer.cancel()
        for delayed in (self._flush_call, self._input_call):
            if delayed is not None and delayed.active():
                delayed.cancel()
        self._flush_call = self._input_call = None
        self._dispatching = True
        try:
            self.dispatch(self.conn.connection_lost(str(reason.value)))
        finally:
            self._dispatching = False
        self.connection_closed(reason)

    # -- IPushProducer ------------------------------------------------------

    def pauseProducing(self) -> None:
        self.paused = True
        self.conn.output_stalled()

    def resumeProducing(self) -> None:
        self.paused = False
        self.conn.output_drained()
        waiters, self._resume_waiters = self._resume_waiters, []
        self._dispatching = True
        try:
            for waiter in waiters:
                waiter()
        finally:
            self._dispatching = False
        self.flush()

    def stopProducing(self) -> None:
        self.close()

    def close(self) -> None:
        """Close the transport after what is already written.

        The producer is unregistered first: a TLS transport does not start
        its shutdown while a producer is registered, so it would never close.
        """
        if self.transport is None or self._closed:
            return
        self.transport.unregisterProducer()
        self.transport.loseConnection()

    # -- effects --------------------------------------------------------------

    @contextmanager
    def batch(self) -> Iterator[None]:
        """Issue several commands, then write their bytes in one go."""
        if self._dispatching:
            yield
            return
        self._dispatching = True
        try:
            yield
        finally:
            self._dispatching = False
        self.flush()

    def when_resumed(self, callback: Callable[[], None]) -> None:
        """Run ``callback`` when the transport resumes us."""
        self._resume_waiters.append(callback)

    def flush(self) -> None:
        """Perform what commands caused: dispatch their events, write the
        bytes, re-arm the timer.  Inside a dispatch this waits until the
        batch is done, so that one batch is one write."""
        if self._dispatching or self._closed:
            return
        conn = self.conn
        out: list[bytes | memoryview] = []
        self._dispatching = True
        try:
            while True:
                events = conn.take_events()
                while events:
                    self.dispatch(events)
                    events = conn.take_events()
                out += conn.buffers_to_send()
                # Handing queued messages to HTTP/2 may itself cause events
                # (a send buffer drained, a queued status written).
                events = conn.take_events()
                if not events:
                    break
                self.dispatch(events)
        finally:
            self._dispatching = False
        if out and self.transport is not None:
            _write(self.transport, out)
        self._call_start_written = False
        self._timer.arm(conn.next_deadline())

    def write_call_start(self) -> None:
        """Write a call's HEADERS now, even inside a batch, so that the
        server decodes and routes the call while this side frames its
        messages: for unary calls that overlap is worth ~5 % of a round
        trip (grpclib gets it by writing after every h2 command).  Once per
        batch, so that a burst of calls still shares one write."""
        if self._call_start_written or self._closed or self.transport is None:
            return
        self._call_start_written = True
        out = self.conn.buffers_to_send()
        if out:
            _write(self.transport, out)

    def schedule_flush(self) -> None:
        """Flush at the next reactor turn (or at the end of the current
        batch): a burst of sends then shares writes and DATA frames."""
        if self._dispatching or self._closed or self._flush_call is not None:
            return
        self._flush_call = self.clock.callLater(0, self._scheduled_flush)

    def _scheduled_flush(self) -> None:
        self._flush_call = None
        self.flush()

    def writable(self, stream_id: int) -> bool:
        """Whether a sender on this stream may produce more now."""
        return not self.paused and self.conn.buffered_amount(stream_id) <= SEND_HIGH_WATER

    def _on_timer(self) -> None:
        self._dispatching = True
        try:
            self.dispatch(self.conn.handle_timeout(self.clock.seconds()))
        finally:
            self._dispatching = False
        self.flush()

    def _terminated(self, event: ConnectionTerminated) -> None:
        data = self.conn.data_to_send()
        if self.transport is not None and data:
            self.transport.write(data)
        self.close()

    # -- for subclasses ---------------------------------------------------------

    def dispatch(self, events: list[Event]) -> None:
        """Handle the machine's events (subclasses)."""
        raise NotImplementedError

    def connection_closed(self, reason: Failure) -> None:
        """The transport is gone (subclasses)."""

    def peer(self) -> str:
        """The remote address as ``host:port`` (or the transport's repr)."""
        if self.transport is None:
            return ""
        address = self.transport.getPeer()
        host = getattr(address, "host", None)
        port = getattr(address, "port", None)
        return f"{host}:{port}" if host is not None else str(address)


class _CallCommon:
    """What server and client calls share: ``recv()`` from the messages
    received so far (each handed over by ``_deliver``), ``async for message
    in call`` (reading until ``recv()`` gives None), and the backpressure of
    ``send()``, which returns an already-fired Deferred while the stream can
    take more, else one Deferred that fires when the stream's buffer drains
    or the transport resumes (both call :meth:`_writable`)."""

    _protocol: Any
    stream_id: Any
    _send_waiter: Deferred[None] | None
    _recv_waiter: Deferred[Any] | None
    #: Received and not yet read: messages, and on a server None for the half-close.
    _inbox: deque[MessageReceived | None]
    _deliver: Callable[[Any], Deferred[Any]]
    #: What ``recv()`` gives once the inbox is empty and no more will come, else None.
    _input_over: Callable[[], Deferred[Any] | None]

    def recv(self) -> Deferred[Any]:
        """The next message; None at the end of the input (a server: the
        client half-closed; a client: the call ended OK); fails with
        GrpcError if the call ended otherwise."""
        if self._recv_waiter is not None:
            return fail(LocalProtocolError("recv() already pending"))
        if self._inbox:
            return self._deliver(self._inbox.popleft())
        over = self._input_over()
        if over is not None:
            return over
        self._recv_waiter = Deferred()
        return self._recv_waiter

    def _received(self, item: MessageReceived | None) -> None:
        waiter = self._recv_waiter
        if waiter is not None:
            self._recv_waiter = None
            self._deliver(item).chainDeferred(waiter)
        else:
            self._inbox.append(item)

    def __aiter__(self) -> AsyncIterator[Any]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[Any]:
        while True:
            message = await self.recv()
            if message is None:
                return
            yield message

    @property
    def buffered_amount(self) -> int:
        """Bytes of this call's messages queued and not yet handed to HTTP/2
        (waiting for the next flush or for the peer's flow-control window)."""
        protocol = self._protocol
        if protocol is None or self.stream_id is None:
            return 0
        amount: int = protocol.conn.buffered_amount(self.stream_id)
        return amount

    def _sent(self) -> Deferred[None]:
        """After a message was queued: flush soon, and tell the sender whether to wait."""
        protocol = self._protocol
        protocol.schedule_flush()
        if protocol.writable(self.stream_id):
            return succeed(None)
        if self._send_waiter is None:
            self._send_waiter = Deferred()
            if protocol.paused:
                protocol.when_resumed(self._writable)
        return self._send_waiter

    def _writable(self) -> None:
        """Fire a waiting send() once the stream can take more."""
        waiter = self._send_waiter
        protocol = self._protocol
        if waiter is None or protocol is None or self.stream_id is None:
            return
        if protocol.paused:
            protocol.when_resumed(self._writable)
            return
        if not protocol.writable(self.stream_id):
            return
        self._send_waiter = None
        waiter.callback(None)


# ---------------------------------------------------------------------------
# Server


class ServerCall(_CallCommon):
    """What a handler sees of its call.

    ``method``, ``metadata`` (the client's), ``peer`` (``host:port``),
    ``authority``, ``deadline`` (clock time or None).  ``recv()`` gives the
    next request (None after the client half-closed), ``send()`` a Deferred
    that fires when the stream can take more, ``cancelled`` /
    ``when_cancelled()`` tell the handler the client went away or the
    deadline passed.  ``async for request in call`` reads all requests.
    """

    def __init__(self, protocol: _ServerProtocol, event: CallStarted,
                 deserializer: Deserializer, serializer: Serializer) -> None:
        self._protocol = protocol
        self._conn = protocol.conn
        self.stream_id = event.stream_id
        self.method = event.method
        self.metadata = event.metadata
        self.authority = event.authority
        self.deadline = event.deadline
        self.peer = protocol.peer()
        self._deserializer = deserializer
        self._serializer = serializer
        self._inbox: deque[MessageReceived | None] = deque()
        self._recv_waiter: Deferred[Any] | None = None
        self._send_waiter: Deferred[None] | None = None
        self._trailing: Metadata = ()
        self._compression: str | None = None
        self._compress_default = False
        self._headers_sent = False
        self._ended: GrpcError | None = None
        self._finished = False
        self._cancel_waiters: list[Deferred[GrpcError]] = []
        self._handler: Deferred[Any] | None = None
        self._accept_encodings = event.accept_encodings
        #: Whether the last request delivered by recv() was compressed.
        self.last_message_compressed = False

    def time_remaining(self) -> float | None:
        """Seconds until the deadline (None without one)."""
        if self.deadline is None:
            return None
        return max(0.0, self.deadline - self._protocol.clock.seconds())

    def authenticated(self) -> None:
        """The caller's credentials passed: lift the connection's
        unauthenticated limits (``GrpcConfig.require_authentication``)."""
        if not self._conn.authenticated:
            self._conn.authenticate()
            self._protocol.flush()

    # -- receiving ----------------------------------------------------------

    def _input_over(self) -> Deferred[Any] | None:
        # The call ended (CANCELLED, DEADLINE_EXCEEDED, ...), or our handler finished.
        if self._ended is not None:
            return fail(self._ended)
        if self._finished:
            return succeed(None)
        return None

    def _deliver(self, item: MessageReceived | None) -> Deferred[Any]:
        if item is None:
            return succeed(None)
        self._conn.acknowledge(self.stream_id, item.flow_controlled_length)
        self._protocol.schedule_flush()
        self.last_message_compressed = item.compressed
        try:
            return succeed(self._deserializer(item.data))
        except Exception as exc:
            self.abort(StatusCode.INTERNAL, f"Exception deserializing request: {exc}")
            return fail(GrpcError(StatusCode.INTERNAL, "request could not be deserialized"))

    # -- sending ----------------------------------------------------------------

    def set_compression(self, encoding: str | None) -> None:
        """Compress responses with ``encoding`` (e.g. "gzip") by default, if
        the client accepts it; call before the first message or initial
        metadata."""
        self._compression = encoding
        self._compress_default = encoding is not None

    def send_initial_metadata(self, metadata: Metadata = ()) -> None:
        """Send response headers now (else they go with the first message)."""
        self._check_open()
        self._conn.send_initial_metadata(self.stream_id, metadata, encoding=self._compression)
        self._headers_sent = True
        self._protocol.flush()

    def send(self, message: Any, *, compress: bool | None = None) -> Deferred[None]:
        """Send a response message; the Deferred fires when the call can take
        more (already fired unless buffers are full).

        ``compress``: None compresses iff :meth:`set_compression` was used;
        True compresses (choosing gzip if the client accepts it and headers
        are not out yet); False sends this message uncompressed.
        """
        if self._ended is not None:
            return fail(self._ended)
        if self._finished:
            return fail(LocalProtocolError("call already finished"))
        if compress is None:
            compress = self._compress_default
        elif compress and not self._headers_sent and self._compression is None \
                and "gzip" in self._accept_encodings:
            self._compression = "gzip"
        if not self._headers_sent:
            self._conn.send_initial_metadata(self.stream_id, (), encoding=self._compression)
            self._headers_sent = True
        try:
            data = self._serializer(message)
            self._conn.send_message(self.stream_id, data, compress=compress)
        except MessageTooLarge as exc:
            self.abort(exc.code, str(exc))
            return fail(GrpcError(exc.code, str(exc)))
        return self._sent()

    def set_trailing_metadata(self, metadata: Metadata) -> None:
        """Metadata to send with the final status."""
        self._trailing = tuple(metadata)

    def abort(self, code: StatusCode, message: str = "", trailers: Metadata = ()) -> None:
        """End the call now with this status; the handler should return."""
        if self._ended is not None or self._finished:
            return
        self._finished = True
        self._conn.send_status(self.stream_id, code, message, trailers or self._trailing)
        self._protocol.finished(self)
        self._protocol.flush()

    def reset(self, message: str) -> None:
        """End the call now with RST_STREAM(CANCEL), dropping what is still queued
        to send: for a peer that stopped reading, behind whose queued messages a
        status would wait forever.  The handler sees the call cancelled."""
        if self._ended is not None or self._finished:
            return
        self._conn.cancel(self.stream_id)
        self._protocol.finished(self)
        self._end(CallEnded(self.stream_id, StatusCode.CANCELLED, message, (), EndCause.RESET))
        self._protocol.flush()

    def _check_open(self) -> None:
        if self._ended is not None:
            raise self._ended
        if self._finished:
            raise LocalProtocolError("call already finished")

    # -- cancellation ---------------------------------------------------------------

    @property
    def cancelled(self) -> bool:
        """True once the call ended without our status (reset, deadline,
        connection lost)."""
        return self._ended is not None

    def when_cancelled(self) -> Deferred[GrpcError]:
        """Fires with the reason if the call ends without our status."""
        if self._ended is not None:
            return succeed(self._ended)
        d: Deferred[GrpcError] = Deferred()
        self._cancel_waiters.append(d)
        return d

    def _end(self, event: CallEnded) -> None:
        code = event.status
        if event.cause is EndCause.RESET:
            code = StatusCode.CANCELLED
        error = GrpcError(code, event.message)
        self._ended = error
        waiters, self._cancel_waiters = self._cancel_waiters, []
        for d in waiters:
            d.callback(error)
        if self._recv_waiter is not None:
            waiter, self._recv_waiter = self._recv_waiter, None
            waiter.errback(error)
        if self._send_waiter is not None:
            send_waiter, self._send_waiter = self._send_waiter, None
            send_waiter.errback(error)
        if self._handler is not None:
            self._handler.cancel()


@dataclass(frozen=True)
class _Method:
    handler: Callable[..., Any]
    deserializer: Deserializer
    serializer: Serializer
    kind: CallKind


class _ServerProtocol(GrpcProtocol):
    def __init__(self, server: GrpcServer) -> None:
        super().__init__(server.clock, server.config)
        self.server = server
        self.calls: dict[int, ServerCall] = {}

    def connectionMade(self) -> None:
        super().connectionMade()
        self.server._connections.add(self)

    def connection_closed(self, reason: Failure) -> None:
        self.server._connection_gone(self)

    def finished(self, call: ServerCall) -> None:
        self.calls.pop(call.stream_id, None)

    def dispatch(self, events: list[Event]) -> None:
        calls = self.calls
        for event in events:
            kind = type(event)
            if kind is MessageReceived:
                call = calls.get(event.stream_id)  # type: ignore[union-attr]
                if call is not None:
                    call._received(event)  # type: ignore[arg-type]
            elif kind is CallStarted:
                self._start(event)  # type: ignore[arg-type]
            elif kind is InputEnded:
                call = calls.get(event.stream_id)  # type: ignore[union-attr]
                if call is not None:
                    call._received(None)
            elif kind is SendBufferDrained:
                call = calls.get(event.stream_id)  # type: ignore[union-attr]
                if call is not None:
                    call._writable()
            elif kind is CallEnded:
                call = calls.pop(event.stream_id, None)  # type: ignore[union-attr]
                if call is not None:
                    call._end(event)  # type: ignore[arg-type]
            elif kind is ConnectionTerminated:
                self._terminated(event)  # type: ignore[arg-type]

    def _start(self, event: CallStarted) -> None:
        method = self.server._methods.get(event.method)
        if method is None:
            self.conn.send_status(event.stream_id, StatusCode.UNIMPLEMENTED,
                                  f"Method not found: {event.method}")
            return
        call = ServerCall(self, event, method.deserializer, method.serializer)
        self.calls[event.stream_id] = call
        handler = Deferred.fromCoroutine(_run_handler(call, method))
        call._handler = handler
        handler.addBoth(self._handler_done, call)

    def _handler_done(self, result: Any, call: ServerCall) -> None:
        call._handler = None
        if call._ended is not None or call._finished:
            if isinstance(result, Failure) and not result.check(CancelledError, GrpcError):
                log.failure("handler for {method} failed after the call ended",
                            result, method=call.method)
            return None
        call._finished = True
        self.calls.pop(call.stream_id, None)
        if isinstance(result, Failure):
            if result.check(GrpcError):
                error = result.value
                assert isinstance(error, GrpcError)
                code, message = error.code, error.message
                trailers = error.trailers or call._trailing
            else:
                log.failure("handler for {method} raised", result, method=call.method)
                code, message, trailers = (StatusCode.UNKNOWN,
                                           f"Exception calling application: {result.value}",
                                           call._trailing)
        else:
            code, message, trailers = StatusCode.OK, "", call._trailing
        self.conn.send_status(call.stream_id, code, message, trailers)
        self.flush()
        return None


async def _send_all(call: ServerCall, result: Any) -> None:
    """Send what a streaming handler returned: nothing, an iterable or an
    async iterable of responses."""
    if result is None:
        return
    if hasattr(result, "__aiter__"):
        async for item in result:
            await call.send(item)
    elif isinstance(result, Iterable):
        for item in result:
            await call.send(item)


async def _run_handler(call: ServerCall, method: _Method) -> None:
    kind = method.kind
    if kind is CallKind.UNARY_UNARY or kind is CallKind.UNARY_STREAM:
        request = await call.recv()
        if request is None:
            raise GrpcError(StatusCode.INTERNAL, "expected one request message")
        result = method.handler(request, call)
    else:
        result = method.handler(call)
    if isinstance(result, Deferred) or inspect.iscoroutine(result):
        result = await _as_deferred(result)
    if kind is CallKind.UNARY_UNARY or kind is CallKind.STREAM_UNARY:
        if not call._finished and call._ended is None:
            await call.send(result)
    else:
        await _send_all(call, result)


@implementer(IProtocolNegotiationFactory)
class GrpcServer(Factory):
    """A Twisted factory serving registered methods.

    Handlers get a :class:`ServerCall`; what else they get and return
    depends on the :class:`CallKind`.  An uncaught exception ends the call
    with UNKNOWN (as grpcio does), a :class:`GrpcError` with its status, an
    unknown method with UNIMPLEMENTED.  TLS endpoints negotiate ALPN ``h2``
    (this factory is an IProtocolNegotiationFactory).
    """

    def __init__(self, clock: IReactorTime, config: GrpcConfig | None = None) -> None:
        self.clock = clock
        self.config = config or GrpcConfig(client_side=False)
        if self.config.client_side:
            raise ValueError("GrpcServer needs a server-side GrpcConfig")
        self._methods: dict[str, _Method] = {}
        self._connections: set[_ServerProtocol] = set()
        self._stopping: list[Deferred[None]] = []

    def acceptableProtocols(self) -> list[bytes]:
        return [b"h2"]

    def buildProtocol(self, addr: Any) -> _ServerProtocol:
        return _ServerProtocol(self)

    def add_method(
        self,
        path: str,
        handler: Callable[..., Any],
        request_deserializer: Deserializer | None = None,
        response_serializer: Serializer | None = None,
        kind: CallKind = CallKind.UNARY_UNARY,
    ) -> None:
        """Serve ``path`` (``/package.Service/Method``) with ``handler``;
        without (de)serializers messages are raw bytes."""
        if path in self._methods:
            raise ValueError(f"{path} is already registered")
        self._methods[path] = _Method(handler, request_deserializer or _identity,
                                      response_serializer or _identity, kind)

    def add_service(self, service: Any, implementation: Any) -> None:
        """Register every method of a protobuf ``ServiceDescriptor`` (e.g.
        ``test_pb2.DESCRIPTOR.services_by_name["TestService"]``), taking the
        handler for ``Foo`` from ``implementation.Foo``."""
        from google.protobuf import message_factory

        for method in service.methods:
            request_class = message_factory.GetMessageClass(method.input_type)
            response_class = message_factory.GetMessageClass(method.output_type)
            kind = {
                (False, False): CallKind.UNARY_UNARY,
                (False, True): CallKind.UNARY_STREAM,
                (True, False): CallKind.STREAM_UNARY,
                (True, True): CallKind.STREAM_STREAM,
            }[(method.client_streaming, method.server_streaming)]
            handler = getattr(implementation, method.name, None)
            if handler is None:
                continue
            self.add_method(f"/{service.full_name}/{method.name}", handler,
                            request_class.FromString, response_class.SerializeToString, kind)

    def stop(self, grace: float | None = None) -> Deferred[None]:
        """Graceful shutdown: GOAWAY on every connection, let calls finish,
        and after ``grace`` seconds (if given) close what is left."""
        d: Deferred[None] = Deferred()
        if not self._connections:
            d.callback(None)
            return d
        self._stopping.append(d)
        for protocol in list(self._connections):
            protocol.dispatch(protocol.conn.go_away(now=self.clock.seconds()))
            protocol.flush()
        if grace is not None:
            self.clock.callLater(grace, self._force_close)
        return d

    def _force_close(self) -> None:
        for protocol in list(self._connections):
            protocol.close()

    def _connection_gone(self, protocol: _ServerProtocol) -> None:
        self._connections.discard(protocol)
        if not self._connections:
            waiters, self._stopping = self._stopping, []
            for d in waiters:
                d.callback(None)


def listen_grpc(reactor: Any, description: str, server: GrpcServer) -> Deferred[IListeningPort]:
    """Listen with ``serverFromString`` (``tcp:50051``,
    ``ssl:443:privateKey=key.pem:certKey=cert.pem``); TLS endpoints
    negotiate ALPN ``h2`` because the server factory asks for it."""
    endpoint = serverFromString(reactor, description)
    listening: Deferred[IListeningPort] = endpoint.listen(server)
    return listening


# ---------------------------------------------------------------------------
# Client


class ClientCall(_CallCommon):
    """A call started by :meth:`GrpcChannel.stream`.

    ``send``/``end``/``recv``/``cancel``; ``initial_metadata()`` and
    ``status()`` Deferreds; once done, ``code``, ``details`` and
    ``trailing_metadata``.  ``async for msg in call`` reads all responses
    and raises GrpcError on a non-OK status.
    """

    def __init__(self, channel: GrpcChannel, path: str, serializer: Serializer,
                 deserializer: Deserializer, timeout: float | None, metadata: Metadata,
                 compression: str | None, wait_for_ready: bool) -> None:
        self._channel = channel
        self.path = path
        self._serializer = serializer
        self._deserializer = deserializer
        self.deadline = None if timeout is None else channel.clock.seconds() + timeout
        self.metadata = tuple(metadata)
        self.compression = compression
        self.wait_for_ready = wait_for_ready
        self._protocol: _ClientProtocol | None = None
        self.stream_id: int | None = None
        # Before the stream exists: what the caller already asked for.
        self._early: list[tuple[bytes, bool]] = []
        # What was sent, kept until the server has seen the call (response
        # headers) so that a refused call can be retried transparently;
        # None once that is no longer possible.
        self._retry_buffer: list[tuple[bytes, bool]] | None = []
        self._retry_bytes = 0
        self._attempts = 1
        self._early_waiter: Deferred[None] | None = None
        self._end_requested = False
        self._inbox: deque[MessageReceived | None] = deque()
        self._recv_waiter: Deferred[Any] | None = None
        self._send_waiter: Deferred[None] | None = None
        self._initial: Metadata | None = None
        self._initial_waiters: list[Deferred[Metadata]] = []
        self._status_waiters: list[Deferred[Status]] = []
        self._wait_timer: IDelayedCall | None = None
        self.final: Status | None = None
        #: Whether the last response delivered by recv() was compressed.
        self.last_message_compressed = False
        self.code: StatusCode | None = None
        self.details: str | None = None
        self.trailing_metadata: Metadata = ()

    # -- starting -------------------------------------------------------------

    def _attach(self, protocol: _ClientProtocol) -> bool:
        """Open the stream on ``protocol``; False if it cannot take it now."""
        now = self._channel.clock.seconds()
        timeout = None if self.deadline is None else self.deadline - now
        if timeout is not None and timeout <= 0:
            self._finish(Status(StatusCode.DEADLINE_EXCEEDED, "deadline exceeded", ()))
            return True
        try:
            stream_id = protocol.conn.start_call(
                self.path, self.metadata, timeout, now,
                authority=self._channel.authority, scheme=self._channel.scheme,
                encoding=self.compression)
        except CallLimitReached:
            return False
        except LocalProtocolError as exc:
            self._finish(Status(StatusCode.INTERNAL, str(exc), ()))
            return True
        if self._wait_timer is not None and self._wait_timer.active():
            self._wait_timer.cancel()
        self._wait_timer = None
        self._protocol = protocol
        self.stream_id = stream_id
        protocol.calls[stream_id] = self
        protocol.write_call_start()
        for data, compress in self._early:
            protocol.conn.send_message(stream_id, data, compress=compress)
        self._early = []
        if self._end_requested:
            protocol.conn.end_stream(stream_id)
        protocol.flush()
        if self._early_waiter is not None:
            waiter, self._early_waiter = self._early_waiter, None
            self._wait_writable(waiter)
        return True

    def _retryable(self, now: float) -> bool:
        """Whether a refused attempt can be replayed: everything sent is
        still buffered, attempts remain and the deadline has not passed."""
        return (self._retry_buffer is not None and self.final is None
                and self._attempts < MAX_ATTEMPTS
                and (self.deadline is None or self.deadline > now))

    def _detach_for_retry(self) -> None:
        assert self._retry_buffer is not None
        self._protocol = None
        self.stream_id = None
        self._attempts += 1
        self._early = list(self._retry_buffer)
        if self._send_waiter is not None:
            self._early_waiter, self._send_waiter = self._send_waiter, None

    def _wait_writable(self, waiter: Deferred[None]) -> None:
        self._send_waiter = waiter
        self._writable()

    # -- commands ----------------------------------------------------------------

    def send(self, message: Any, *, compress: bool | None = None) -> Deferred[None]:
        """Send a request; fires when the call can take more (backpressure),
        fails with GrpcError if the call has ended.  ``compress``: None
        compresses iff the call has a ``compression``; False sends this
        message uncompressed."""
        if self.final is not None:
            return fail(self.final.error())
        if self._end_requested:
            return fail(LocalProtocolError("send() after end()"))
        data = self._serializer(message)
        compress = self.compression is not None and compress is not False
        if self._retry_buffer is not None:
            self._retry_bytes += len(data)
            if self._retry_bytes > RETRY_BUFFER_LIMIT:
                self._retry_buffer = None
            else:
                self._retry_buffer.append((data, compress))
        if self._protocol is None or self.stream_id is None:
            self._early.append((data, compress))
            if self._early_waiter is None:
                self._early_waiter = Deferred()
            return self._early_waiter
        conn = self._protocol.conn
        try:
            conn.send_message(self.stream_id, data, compress=compress)
        except MessageTooLarge as exc:
            self.cancel()
            self._finish(Status(exc.code, str(exc), ()))
            return fail(GrpcError(exc.code, str(exc)))
        return self._sent()

    def end(self) -> None:
        """Half-close: no more requests (ignored once the call has ended)."""
        if self._end_requested or self.final is not None:
            return
        self._end_requested = True
        if self._protocol is not None and self.stream_id is not None:
            self._protocol.conn.end_stream(self.stream_id)
            self._protocol.flush()

    def cancel(self) -> None:
        """Abandon the call (RST_STREAM CANCEL); it ends CANCELLED."""
        if self.final is not None:
            return
        if self._protocol is not None and self.stream_id is not None:
            self._protocol.calls.pop(self.stream_id, None)
            self._protocol.conn.cancel(self.stream_id)
            self._protocol.flush()
        self._finish(Status(StatusCode.CANCELLED, "cancelled by the client", ()))

    # -- results -----------------------------------------------------------------

    def _input_over(self) -> Deferred[Any] | None:
        if self.final is None:
            return None
        if self.final.code == StatusCode.OK:
            return succeed(None)
        return fail(self.final.error())

    def _deliver(self, event: MessageReceived) -> Deferred[Any]:
        if self._protocol is not None:
            self._protocol.conn.acknowledge(event.stream_id, event.flow_controlled_length)
            self._protocol.schedule_flush()
        self.last_message_compressed = event.compressed
        try:
            return succeed(self._deserializer(event.data))
        except Exception as exc:
            self.cancel()
            return fail(GrpcError(StatusCode.INTERNAL, f"response could not be deserialized: {exc}"))

    def initial_metadata(self) -> Deferred[Metadata]:
        """The server's response headers (empty for a trailers-only reply)."""
        if self._initial is not None:
            return succeed(self._initial)
        d: Deferred[Metadata] = Deferred()
        self._initial_waiters.append(d)
        return d

    def _got_initial(self, metadata: Metadata) -> None:
        if self._initial is not None:
            return
        self._retry_buffer = None
        self._initial = metadata
        waiters, self._initial_waiters = self._initial_waiters, []
        for d in waiters:
            d.callback(metadata)

    def status(self) -> Deferred[Status]:
        """Fires with the final Status (never fails)."""
        if self.final is not None:
            return succeed(self.final)
        d: Deferred[Status] = Deferred()
        self._status_waiters.append(d)
        return d

    def _finish(self, status: Status) -> None:
        if self.final is not None:
            return
        if self._wait_timer is not None and self._wait_timer.active():
            self._wait_timer.cancel()
        self._wait_timer = None
        self.final = status
        self.code, self.details, self.trailing_metadata = (
            status.code, status.message, status.trailers)
        self._got_initial(())
        if self._recv_waiter is not None:
            waiter, self._recv_waiter = self._recv_waiter, None
            if status.code == StatusCode.OK:
                waiter.callback(None)
            else:
                waiter.errback(status.error())
        for pending in (self._send_waiter, self._early_waiter):
            if pending is not None:
                pending.errback(status.error()) if status.code != StatusCode.OK \
                    else pending.callback(None)
        self._send_waiter = self._early_waiter = None
        waiters, self._status_waiters = self._status_waiters, []
        for d in waiters:
            d.callback(status)
        self._channel._call_finished(self)


class _ClientProtocol(GrpcProtocol):
    def __init__(self, channel: GrpcChannel) -> None:
        super().__init__(channel.clock, channel.config)
        self.channel = channel
        self.calls: dict[int, ClientCall] = {}
        self._ping_waiters: dict[bytes, Deferred[float]] = {}
        self.closed_waiters: list[Deferred[None]] = []

    def connectionMade(self) -> None:
        super().connectionMade()
        self.channel._connected(self)

    def connection_closed(self, reason: Failure) -> None:
        self.channel._disconnected(self, reason)

    def ping(self) -> Deferred[float]:
        """Send a PING; fires with the round-trip time in seconds."""
        payload = self.conn.ping(self.clock.seconds())
        d: Deferred[float] = Deferred()
        self._ping_waiters[payload] = d
        self.flush()
        return d

    def dispatch(self, events: list[Event]) -> None:
        calls = self.calls
        for event in events:
            kind = type(event)
            if kind is MessageReceived:
                call = calls.get(event.stream_id)  # type: ignore[union-attr]
                if call is not None:
                    call._received(event)  # type: ignore[arg-type]
            elif kind is ResponseHeadersReceived:
                call = calls.get(event.stream_id)  # type: ignore[union-attr]
                if call is not None:
                    call._got_initial(event.metadata)  # type: ignore[union-attr]
            elif kind is CallEnded:
                call = calls.pop(event.stream_id, None)  # type: ignore[union-attr]
                if call is not None:
                    assert isinstance(event, CallEnded)
                    if event.cause is EndCause.REFUSED and call._retryable(self.clock.seconds()):
                        # Never processed by the server (GOAWAY or
                        # REFUSED_STREAM): gRPC's transparent retry.
                        self.channel._retry_call(call)
                    else:
                        call._finish(Status(event.status, event.message, event.trailers))
            elif kind is SendBufferDrained:
                call = calls.get(event.stream_id)  # type: ignore[union-attr]
                if call is not None:
                    call._writable()
            elif kind is GoAwayReceived:
                self.channel._goaway(self)
            elif kind is PingAcknowledged:
                assert isinstance(event, PingAcknowledged)
                waiter = self._ping_waiters.pop(event.payload, None)
                if waiter is not None:
                    waiter.callback(event.round_trip_time)
            elif kind is ConnectionTerminated:
                self._terminated(event)  # type: ignore[arg-type]


class ChannelState(enum.Enum):
    """Connectivity, as grpc/grpc ``doc/connectivity-semantics-and-api.md``."""

    IDLE = "idle"
    CONNECTING = "connecting"
    READY = "ready"
    TRANSIENT_FAILURE = "transient-failure"
    SHUTDOWN = "shutdown"


class _ChannelFactory(Factory):
    """Builds the channel's protocol; asks TLS for ALPN ``h2``."""

    #: Not a line per dial: a reconnect loop would log two per attempt.
    noisy = False

    def __init__(self, channel: GrpcChannel) -> None:
        self.channel = channel

    def buildProtocol(self, addr: Any) -> _ClientProtocol:
        return _ClientProtocol(self.channel)


class GrpcChannel:
    """Client channel to one address over any IStreamClientEndpoint.

    Connects on first use.  Calls started while not connected wait for the
    connection (until their deadline); after a failed attempt the channel
    retries with jittered exponential backoff (grpc/grpc
    ``doc/connection-backoff.md``) and, meanwhile, calls fail UNAVAILABLE
    unless ``wait_for_ready=True``.  A GOAWAY from the server sends new
    calls to a fresh connection while the old one drains.
    """

    def __init__(
        self,
        clock: IReactorTime,
        endpoint: IStreamClientEndpoint,
        config: GrpcConfig | None = None,
        *,
        authority: str = "localhost",
        scheme: str = "http",
        initial_backoff: float = 1.0,
        max_backoff: float = 120.0,
        backoff_multiplier: float = 1.6,
        backoff_jitter: float = 0.2,
        rng: Callable[[], float] = random.random,
    ) -> None:
        self.clock = clock
        self.endpoint = endpoint
        self.config = config or GrpcConfig(client_side=True)
        if not self.config.client_side:
            raise ValueError("GrpcChannel needs a client-side GrpcConfig")
        self.authority = authority
        self.scheme = scheme
        self._initial_backoff = initial_backoff
        self._max_backoff = max_backoff
        self._multiplier = backoff_multiplier
        self._jitter = backoff_jitter
        self._rng = rng
        self._backoff = initial_backoff
        self.state = ChannelState.IDLE
        self._protocol: _ClientProtocol | None = None
        self._connecting: Deferred[Any] | None = None
        self._retry: IDelayedCall | None = None
        self._waiting: deque[ClientCall] = deque()
        self._factory = _ChannelFactory(self)

    # -- calls ---------------------------------------------------------------------

    def stream(
        self,
        path: str,
        serializer: Serializer | None = None,
        deserializer: Deserializer | None = None,
        *,
        timeout: float | None = None,
        metadata: Metadata = (),
        compression: str | None = None,
        wait_for_ready: bool = False,
    ) -> ClientCall:
        """Start a call of any kind; see :class:`ClientCall`."""
        call = ClientCall(self, path, serializer or _identity, deserializer or _identity,
                          timeout, metadata, compression, wait_for_ready)
        if self.state is ChannelState.SHUTDOWN:
            call._finish(Status(StatusCode.UNAVAILABLE, "channel closed", ()))
            return call
        protocol = self._protocol
        if (protocol is not None and self.state is ChannelState.READY
                and not self._waiting and call._attach(protocol)):
            return call
        if self.state is ChannelState.TRANSIENT_FAILURE and not wait_for_ready:
            call._finish(Status(StatusCode.UNAVAILABLE, "not connected", ()))
            return call
        self._waiting.append(call)
        if call.deadline is not None:
            call._wait_timer = self.clock.callLater(
                max(0.0, call.deadline - self.clock.seconds()), self._wait_expired, call)
        if self.state is ChannelState.IDLE:
            self._connect()
        return call

    def unary(
        self,
        path: str,
        request: Any,
        serializer: Serializer | None = None,
        deserializer: Deserializer | None = None,
        *,
        timeout: float | None = None,
        metadata: Metadata = (),
        compression: str | None = None,
        wait_for_ready: bool = False,
    ) -> Deferred[Any]:
        """One request, one response; fails with GrpcError on a non-OK status."""
        protocol = self._protocol
        with protocol.batch() if protocol is not None else nullcontext():
            call = self.stream(path, serializer, deserializer, timeout=timeout,
                               metadata=metadata, compression=compression,
                               wait_for_ready=wait_for_ready)
            call.send(request).addErrback(lambda _: None)
            call.end()
        return call.status().addCallback(_unary_result, call)

    def ping(self) -> Deferred[float]:
        """Round-trip time of a PING on the current connection."""
        if self._protocol is None:
            return fail(GrpcError(StatusCode.UNAVAILABLE, "not connected"))
        return self._protocol.ping()

    def close(self) -> Deferred[None]:
        """Fail waiting calls, close the connection; fires when closed."""
        self.state = ChannelState.SHUTDOWN
        if self._retry is not None and self._retry.active():
            self._retry.cancel()
        if self._connecting is not None:
            self._connecting.cancel()
        while self._waiting:
            self._waiting.popleft()._finish(Status(StatusCode.UNAVAILABLE, "channel closed", ()))
        protocol, self._protocol = self._protocol, None
        if protocol is None or protocol.transport is None or protocol._closed:
            return succeed(None)
        done: Deferred[None] = Deferred()
        protocol.closed_waiters.append(done)
        protocol.close()
        return done

    # -- connection management -------------------------------------------------------

    def _connect(self) -> None:
        self.state = ChannelState.CONNECTING
        self._retry = None
        d = self.endpoint.connect(self._factory)
        self._connecting = d
        d.addCallbacks(self._connect_succeeded, self._connect_failed)

    def _connect_succeeded(self, protocol: Any) -> None:
        self._connecting = None

    def _connect_failed(self, reason: Failure) -> None:
        self._connecting = None
        if self.state is ChannelState.SHUTDOWN or reason.check(CancelledError):
            return
        # Not logged here: each call waiting on the channel fails with this reason, and its
        # owner (an engine agent, a peer receiver) logs it once per run of identical failures;
        # a line per dial from every channel would be the same failure again at each retry.
        self.state = ChannelState.TRANSIENT_FAILURE
        for call in [c for c in self._waiting if not c.wait_for_ready]:
            self._waiting.remove(call)
            call._finish(Status(StatusCode.UNAVAILABLE,
                                f"connect failed: {reason.getErrorMessage()}", ()))
        delay = self._backoff * (1 + self._jitter * (2 * self._rng() - 1))
        self._backoff = min(self._backoff * self._multiplier, self._max_backoff)
        self._retry = self.clock.callLater(delay, self._connect)

    def _connected(self, protocol: _ClientProtocol) -> None:
        if self.state is ChannelState.SHUTDOWN:
            protocol.close()
            return
        self._protocol = protocol
        self.state = ChannelState.READY
        self._backoff = self._initial_backoff
        self._start_waiting()

    def _start_waiting(self) -> None:
        protocol = self._protocol
        while protocol is not None and self._waiting and protocol.conn.accepting_calls:
            call = self._waiting[0]
            if not call._attach(protocol):
                return
            if self._waiting and self._waiting[0] is call:
                self._waiting.popleft()

    def _retry_call(self, call: ClientCall) -> None:
        """Start a refused call again, ahead of calls not yet started."""
        call._detach_for_retry()
        self._waiting.appendleft(call)
        if call.deadline is not None:
            call._wait_timer = self.clock.callLater(
                max(0.0, call.deadline - self.clock.seconds()), self._wait_expired, call)
        if self.state is ChannelState.READY and self._protocol is not None:
            self._start_waiting()
        elif self.state is ChannelState.IDLE:
            self._connect()

    def _wait_expired(self, call: ClientCall) -> None:
        call._wait_timer = None
        if call in self._waiting:
            self._waiting.remove(call)
        call._finish(Status(StatusCode.DEADLINE_EXCEEDED,
                            "deadline exceeded while waiting for a connection", ()))

    def _call_finished(self, call: ClientCall) -> None:
        if call in self._waiting:
            self._waiting.remove(call)
        elif self._waiting and self.state is ChannelState.READY:
            self._start_waiting()

    def _goaway(self, protocol: _ClientProtocol) -> None:
        if protocol is self._protocol:
            self._protocol = None
            if self.state is not ChannelState.SHUTDOWN:
                self.state = ChannelState.IDLE
                if self._waiting:
                    self._connect()

    def _disconnected(self, protocol: _ClientProtocol, reason: Failure) -> None:
        waiters, protocol.closed_waiters = protocol.closed_waiters, []
        for d in waiters:
            d.callback(None)
        if protocol is not self._protocol:
            return
        self._protocol = None
        if self.state is ChannelState.SHUTDOWN:
            return
        self.state = ChannelState.IDLE
        if self._waiting:
            self._connect()


def _unary_result(status: Status, call: ClientCall) -> Any:
    if status.code != StatusCode.OK:
        raise status.error()
    event = call._inbox.popleft() if call._inbox else None
    if event is None:
        raise GrpcError(StatusCode.INTERNAL, "server sent no response message")
    call.last_message_compressed = event.compressed
    return call._deserializer(event.data)


def client_endpoint(reactor: Any, host: str, port: int, *, tls: bool = False,
                    trust_root: Any = None) -> IStreamClientEndpoint:
    """A HostnameEndpoint, wrapped in TLS with ALPN ``h2`` when ``tls``
    (``trust_root``: a ``twisted.internet.ssl.Certificate`` or None for the
    platform's trust store)."""
    from twisted.internet.endpoints import HostnameEndpoint, wrapClientTLS
    from twisted.internet.ssl import optionsForClientTLS

    endpoint: IStreamClientEndpoint = HostnameEndpoint(reactor, host, port)
    if tls:
        options = optionsForClientTLS(host, trustRoot=trust_root, acceptableProtocols=[b"h2"])
        endpoint = wrapClientTLS(options, endpoint)
    return endpoint
