"""The gRPC server on Twisted: registered methods, their handlers, and the
connection adapter that routes the machine's events to calls.

Rules this file keeps: no protocol logic (it lives in :mod:`protocol.grpc`);
the reactor's clock and endpoints are passed in; (de)serialisation happens
here, the machine moves bytes.

Server::

    server = GrpcServer(reactor)
    server.add_method("/pkg.Svc/Echo", echo, Request.FromString,
                      Response.SerializeToString, kind=CallKind.UNARY_UNARY)
    port = await listen_grpc(reactor, "tcp:50051", server)
"""

from __future__ import annotations

import inspect
from collections import deque
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass
from typing import Any

from twisted.internet.defer import CancelledError, Deferred, fail, succeed
from twisted.internet.endpoints import serverFromString
from twisted.internet.interfaces import IListeningPort, IProtocolNegotiationFactory, IReactorTime
from twisted.internet.protocol import Factory
from twisted.logger import Logger
from twisted.python.failure import Failure
from zope.interface import implementer

from infx.transport.calls import (
    CallBase, CallKind, Deserializer, GrpcError, Serializer, as_deferred, identity,
)
from infx.transport.connection import GrpcProtocol
from protocol.grpc import (
    CallEnded,
    CallStarted,
    EndCause,
    GrpcConfig,
    InputEnded,
    LocalProtocolError,
    MessageReceived,
    MessageTooLarge,
    Metadata,
    SendBufferDrained,
    StatusCode,
)

__all__ = ["GrpcServer", "Method", "ServerCall", "ServerProtocol", "listen_grpc"]

log = Logger()


@dataclass(frozen=True)
class Method:
    """A registered method: its handler, how messages are (de)serialized, its kind."""

    handler: Callable[..., Any]
    deserializer: Deserializer
    serializer: Serializer
    kind: CallKind


class ServerCall(CallBase):
    """What a handler sees of its call.

    ``method``, ``metadata`` (the client's), ``peer`` (``host:port``),
    ``authority``, ``deadline`` (clock time or None).  ``recv()`` gives the
    next request (None after the client half-closed), ``send()`` a Deferred
    that fires when the stream can take more, ``cancelled`` /
    ``when_cancelled()`` tell the handler the client went away or the
    deadline passed.  ``async for request in call`` reads all requests.
    """

    _protocol: ServerProtocol
    stream_id: int

    def __init__(self, protocol: ServerProtocol, event: CallStarted,
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

    def _take(self, item: MessageReceived | None) -> Any:
        if item is None:
            return None
        self._conn.acknowledge(self.stream_id, item.flow_controlled_length)
        self._protocol.schedule_flush()
        self.last_message_compressed = item.compressed
        try:
            return self._deserializer(item.data)
        except Exception as exc:
            self.abort(StatusCode.INTERNAL, f"Exception deserializing request: {exc}")
            raise GrpcError(StatusCode.INTERNAL, "request could not be deserialized") from None

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

    def send(self, message: Any, *, compress: bool | None = None,
             key: Hashable | None = None) -> Deferred[None]:
        """Send a response message; the Deferred fires when the call can take
        more (already fired unless buffers are full).

        ``compress``: None compresses iff :meth:`set_compression` was used;
        True compresses (choosing gzip if the client accepts it and headers
        are not out yet); False sends this message uncompressed.
        ``key`` lets :meth:`withdraw` take the message back while it waits
        whole in the send queue.
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
            self._conn.send_message(self.stream_id, data, compress=compress, key=key)
        except MessageTooLarge as exc:
            self.abort(exc.code, str(exc))
            return fail(GrpcError(exc.code, str(exc)))
        return self._sent()

    def withdraw(self, key: Hashable) -> bool:
        """Take back the message sent with ``key`` if none of it went out yet (the
        peer never sees it); whether it did. A send() waiting for the queue to drain
        still waits for the peer to take bytes again."""
        if self._ended is not None or self._finished:
            return False
        withdrawn: bool = self._conn.withdraw_message(self.stream_id, key)
        if withdrawn:
            # A status queued behind it may go out now.
            self._protocol.schedule_flush()
        return withdrawn

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
        self.ended(CallEnded(self.stream_id, StatusCode.CANCELLED, message, (), EndCause.RESET))
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

    def ended(self, event: CallEnded) -> None:
        """The adapter: the call ended without our status (reset, deadline,
        connection lost)."""
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

    # -- the handler ------------------------------------------------------------------

    def run(self, method: Method) -> None:
        """The adapter: run ``method``'s handler for this call; its outcome is the status."""
        handler = Deferred.fromCoroutine(self._run_handler(method))
        self._handler = handler
        handler.addBoth(self._handler_done)

    async def _run_handler(self, method: Method) -> None:
        kind = method.kind
        if kind is CallKind.UNARY_UNARY or kind is CallKind.UNARY_STREAM:
            request = await self.recv()
            if request is None:
                raise GrpcError(StatusCode.INTERNAL, "expected one request message")
            result = method.handler(request, self)
        else:
            result = method.handler(self)
        if isinstance(result, Deferred) or inspect.iscoroutine(result):
            result = await as_deferred(result)
        if kind is CallKind.UNARY_UNARY or kind is CallKind.STREAM_UNARY:
            if not self._finished and self._ended is None:
                await self.send(result)
        else:
            await _send_all(self, result)

    def _handler_done(self, result: Any) -> None:
        self._handler = None
        if self._ended is not None or self._finished:
            if isinstance(result, Failure) and not result.check(CancelledError, GrpcError):
                log.failure("handler for {method} failed after the call ended",
                            result, method=self.method)
            return None
        self._finished = True
        self._protocol.finished(self)
        if isinstance(result, Failure):
            if result.check(GrpcError):
                error = result.value
                assert isinstance(error, GrpcError)
                code, message = error.code, error.message
                trailers = error.trailers or self._trailing
            else:
                log.failure("handler for {method} raised", result, method=self.method)
                code, message, trailers = (StatusCode.UNKNOWN,
                                           f"Exception calling application: {result.value}",
                                           self._trailing)
        else:
            code, message, trailers = StatusCode.OK, "", self._trailing
        self._conn.send_status(self.stream_id, code, message, trailers)
        self._protocol.flush()
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


class ServerProtocol(GrpcProtocol):
    """One server connection: starts a :class:`ServerCall` per call and routes
    the machine's events to it."""

    def __init__(self, server: GrpcServer) -> None:
        super().__init__(server.clock, server.config)
        self.server = server
        self.calls: dict[int, ServerCall] = {}

    def connectionMade(self) -> None:
        super().connectionMade()
        self.server.connection_opened(self)

    def connection_closed(self, reason: Failure) -> None:
        self.server.connection_gone(self)

    def finished(self, call: ServerCall) -> None:
        """``call`` sent its status: it gets no more events."""
        self.calls.pop(call.stream_id, None)

    def _on_message(self, event: MessageReceived) -> None:
        call = self.calls.get(event.stream_id)
        if call is not None:
            call.received(event)

    def _on_input_ended(self, event: InputEnded) -> None:
        call = self.calls.get(event.stream_id)
        if call is not None:
            call.received(None)

    def _on_drained(self, event: SendBufferDrained) -> None:
        call = self.calls.get(event.stream_id)
        if call is not None:
            call.send_buffer_drained()

    def _on_ended(self, event: CallEnded) -> None:
        call = self.calls.pop(event.stream_id, None)
        if call is not None:
            call.ended(event)

    def _on_started(self, event: CallStarted) -> None:
        method = self.server.method(event.method)
        if method is None:
            self.conn.send_status(event.stream_id, StatusCode.UNIMPLEMENTED,
                                  f"Method not found: {event.method}")
            return
        call = ServerCall(self, event, method.deserializer, method.serializer)
        self.calls[event.stream_id] = call
        call.run(method)

    handlers = {
        **GrpcProtocol.handlers,
        MessageReceived: _on_message,
        CallStarted: _on_started,
        InputEnded: _on_input_ended,
        SendBufferDrained: _on_drained,
        CallEnded: _on_ended,
    }


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
        self._methods: dict[str, Method] = {}
        self._connections: set[ServerProtocol] = set()
        self._stopping: list[Deferred[None]] = []

    def acceptableProtocols(self) -> list[bytes]:
        return [b"h2"]

    def buildProtocol(self, addr: Any) -> ServerProtocol:
        return ServerProtocol(self)

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
        self._methods[path] = Method(handler, request_deserializer or identity,
                                     response_serializer or identity, kind)

    def method(self, path: str) -> Method | None:
        """The method registered at ``path``, if any."""
        return self._methods.get(path)

    @property
    def connections(self) -> frozenset[ServerProtocol]:
        """The connections open now."""
        return frozenset(self._connections)

    def connection_opened(self, protocol: ServerProtocol) -> None:
        """The adapter: a connection is up."""
        self._connections.add(protocol)

    def connection_gone(self, protocol: ServerProtocol) -> None:
        """The adapter: a connection closed (a pending :meth:`stop` may be done)."""
        self._connections.discard(protocol)
        if not self._connections:
            waiters, self._stopping = self._stopping, []
            for d in waiters:
                d.callback(None)

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


def listen_grpc(reactor: Any, description: str, server: GrpcServer) -> Deferred[IListeningPort]:
    """Listen with ``serverFromString`` (``tcp:50051``,
    ``ssl:443:privateKey=key.pem:certKey=cert.pem``); TLS endpoints
    negotiate ALPN ``h2`` because the server factory asks for it."""
    endpoint = serverFromString(reactor, description)
    listening: Deferred[IListeningPort] = endpoint.listen(server)
    return listening
