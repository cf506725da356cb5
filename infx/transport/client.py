"""The gRPC client on Twisted: a channel to one address and its calls.

Rules this file keeps: no protocol logic: the HTTP/2 and gRPC wire is
:mod:`protocol.grpc`, connectivity, redial backoff and transparent-retry
eligibility are :class:`protocol.grpc.channel.ChannelMachine`; this file performs
their effects (dial, attach streams, fail calls) and arms one ``callLater``
per channel at the machine's ``next_deadline()``.  The reactor's clock and
endpoints are passed in; (de)serialisation happens here.

Client::

    channel = GrpcChannel(reactor, client_endpoint(reactor, "h", 50051))
    reply = await channel.unary("/pkg.Svc/Echo", req, Request.SerializeToString,
                                Response.FromString, timeout=5)
    call = channel.stream("/pkg.Svc/Chat", ser, deser)
    await call.send(msg); call.end()
    async for reply in call: ...

Size (over 600 lines): the channel, its protocol and its calls are one adapter of
:class:`protocol.grpc.channel.ChannelMachine` and call each other's hooks on every event
(attach, detach for a retry, response started); apart, each would reach into the others.
"""

from __future__ import annotations

import random
from collections import deque
from contextlib import nullcontext
from typing import Any

from twisted.internet.defer import CancelledError, Deferred, fail, succeed
from twisted.internet.interfaces import IReactorTime, IStreamClientEndpoint
from twisted.internet.protocol import Factory
from twisted.python.failure import Failure

from infx.deadline import DeadlineTimer
from infx.transport.calls import CallBase, Deserializer, GrpcError, Serializer, Status, identity
from infx.transport.connection import GrpcProtocol
from protocol.backoff import GRPC_CONNECTION_BACKOFF, Backoff
from protocol.grpc import (
    CallEnded,
    CallLimitReached,
    EndCause,
    GoAwayReceived,
    GrpcConfig,
    LocalProtocolError,
    MessageReceived,
    MessageTooLarge,
    Metadata,
    PingAcknowledged,
    ResponseHeadersReceived,
    SendBufferDrained,
    StatusCode,
)
from protocol.grpc.channel import (
    AttachWaiting,
    CancelConnect,
    ChannelEffect,
    ChannelMachine,
    ChannelState,
    CloseConnection,
    Connect,
    FailCall,
    ReleaseRetryBuffer,
    RetryCall,
)

__all__ = ["ChannelState", "ClientCall", "ClientProtocol", "GrpcChannel", "client_endpoint"]


class ClientCall(CallBase):
    """A call started by :meth:`GrpcChannel.stream`.

    ``send``/``end``/``recv``/``cancel``; ``initial_metadata()`` and
    ``status()`` Deferreds; once done, ``code``, ``details`` and
    ``trailing_metadata``.  ``async for msg in call`` reads all responses
    and raises GrpcError on a non-OK status.
    """

    _protocol: ClientProtocol | None

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
        self._protocol = None
        self.stream_id = None
        # Before the stream exists: what the caller already asked for.
        self._early: list[tuple[bytes, bool]] = []
        # What was sent, kept while the channel's machine says the call may
        # still be retried transparently; None once it may not.
        self._retry_buffer: list[tuple[bytes, bool]] | None = []
        self._early_waiter: Deferred[None] | None = None
        self._end_requested = False
        self._inbox: deque[MessageReceived | None] = deque()
        self._recv_waiter: Deferred[Any] | None = None
        self._send_waiter: Deferred[None] | None = None
        self._initial: Metadata | None = None
        self._initial_waiters: list[Deferred[Metadata]] = []
        self._status_waiters: list[Deferred[Status]] = []
        self.final: Status | None = None
        #: Whether the last response delivered by recv() was compressed.
        self.last_message_compressed = False
        self.code: StatusCode | None = None
        self.details: str | None = None
        self.trailing_metadata: Metadata = ()

    # -- the channel's side -------------------------------------------------------

    def attach(self, protocol: ClientProtocol) -> bool:
        """The channel: open the stream on ``protocol``; False if it cannot take
        it now (its stream limit).  True also when the call ended instead."""
        now = self._channel.clock.seconds()
        timeout = None if self.deadline is None else self.deadline - now
        if timeout is not None and timeout <= 0:
            self.finish(Status(StatusCode.DEADLINE_EXCEEDED, "deadline exceeded", ()))
            return True
        try:
            stream_id = protocol.conn.start_call(
                self.path, self.metadata, timeout,
                authority=self._channel.authority, scheme=self._channel.scheme,
                encoding=self.compression, now=now)
        except CallLimitReached:
            return False
        except LocalProtocolError as exc:
            self.finish(Status(StatusCode.INTERNAL, str(exc), ()))
            return True
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
            self._send_waiter = waiter
            self.send_buffer_drained()
        return True

    def detach_for_retry(self) -> None:
        """The channel: the stream was refused unseen; replay what was sent on
        the next attach."""
        assert self._retry_buffer is not None
        self._protocol = None
        self.stream_id = None
        self._early = list(self._retry_buffer)
        if self._send_waiter is not None:
            self._early_waiter, self._send_waiter = self._send_waiter, None

    def release_retry_buffer(self) -> None:
        """The channel: this call will not be retried; drop the copy of its requests."""
        self._retry_buffer = None

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
            self._retry_buffer.append((data, compress))
            self._channel.message_queued(self, len(data))
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
            self.finish(Status(exc.code, str(exc), ()))
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
        self.finish(Status(StatusCode.CANCELLED, "cancelled by the client", ()))

    # -- results -----------------------------------------------------------------

    def _input_over(self) -> Deferred[Any] | None:
        if self.final is None:
            return None
        if self.final.code == StatusCode.OK:
            return succeed(None)
        return fail(self.final.error())

    def _take(self, event: MessageReceived) -> Any:
        if self._protocol is not None:
            self._protocol.conn.acknowledge(event.stream_id, event.flow_controlled_length)
            self._protocol.schedule_flush()
        self.last_message_compressed = event.compressed
        try:
            return self._deserializer(event.data)
        except Exception as exc:
            self.cancel()
            raise GrpcError(StatusCode.INTERNAL, f"response could not be deserialized: {exc}") from None

    def unary_result(self, status: Status) -> Any:
        """The one response of a unary call that ended with ``status``."""
        if status.code != StatusCode.OK:
            raise status.error()
        event = self._inbox.popleft() if self._inbox else None
        if event is None:
            raise GrpcError(StatusCode.INTERNAL, "server sent no response message")
        self.last_message_compressed = event.compressed
        return self._deserializer(event.data)

    def initial_metadata(self) -> Deferred[Metadata]:
        """The server's response headers (empty for a trailers-only reply)."""
        if self._initial is not None:
            return succeed(self._initial)
        d: Deferred[Metadata] = Deferred()
        self._initial_waiters.append(d)
        return d

    def headers_received(self, metadata: Metadata) -> None:
        """The adapter: the server's response headers arrived (it saw the call)."""
        if self._initial is not None:
            return
        if self._retry_buffer is not None:
            self._channel.response_started(self)
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

    def finish(self, status: Status) -> None:
        """End the call with ``status`` (once; later calls are ignored)."""
        if self.final is not None:
            return
        self.final = status
        self.code, self.details, self.trailing_metadata = (
            status.code, status.message, status.trailers)
        self._retry_buffer = None
        self.headers_received(())
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
        self._channel.call_finished(self)


class ClientProtocol(GrpcProtocol):
    """One client connection: routes the machine's events to the channel's calls."""

    def __init__(self, channel: GrpcChannel) -> None:
        super().__init__(channel.clock, channel.config)
        self.channel = channel
        self.calls: dict[int, ClientCall] = {}
        self._ping_waiters: dict[bytes, Deferred[float]] = {}
        self.closed_waiters: list[Deferred[None]] = []

    def connectionMade(self) -> None:
        super().connectionMade()
        self.channel.connected(self)

    def connection_closed(self, reason: Failure) -> None:
        self.channel.disconnected(self)

    def ping(self) -> Deferred[float]:
        """Send a PING; fires with the round-trip time in seconds."""
        payload = self.conn.ping(self.clock.seconds())
        d: Deferred[float] = Deferred()
        self._ping_waiters[payload] = d
        self.flush()
        return d

    def _on_message(self, event: MessageReceived) -> None:
        call = self.calls.get(event.stream_id)
        if call is not None:
            call.received(event)

    def _on_headers(self, event: ResponseHeadersReceived) -> None:
        call = self.calls.get(event.stream_id)
        if call is not None:
            call.headers_received(event.metadata)

    def _on_ended(self, event: CallEnded) -> None:
        call = self.calls.pop(event.stream_id, None)
        if call is None:
            return
        if event.cause is EndCause.REFUSED and call.final is None \
                and self.channel.call_refused(call):
            return
        call.finish(Status(event.status, event.message, event.trailers))

    def _on_drained(self, event: SendBufferDrained) -> None:
        call = self.calls.get(event.stream_id)
        if call is not None:
            call.send_buffer_drained()

    def _on_goaway(self, event: GoAwayReceived) -> None:
        self.channel.goaway(self)

    def _on_ping_ack(self, event: PingAcknowledged) -> None:
        waiter = self._ping_waiters.pop(event.payload, None)
        if waiter is not None:
            waiter.callback(event.round_trip_time)

    handlers = {
        **GrpcProtocol.handlers,
        MessageReceived: _on_message,
        ResponseHeadersReceived: _on_headers,
        CallEnded: _on_ended,
        SendBufferDrained: _on_drained,
        GoAwayReceived: _on_goaway,
        PingAcknowledged: _on_ping_ack,
    }


class _ChannelFactory(Factory):
    """Builds the channel's protocol; asks TLS for ALPN ``h2``."""

    #: Not a line per dial: a reconnect loop would log two per attempt.
    noisy = False

    def __init__(self, channel: GrpcChannel) -> None:
        self.channel = channel

    def buildProtocol(self, addr: Any) -> ClientProtocol:
        return ClientProtocol(self.channel)


class GrpcChannel:
    """Client channel to one address over any IStreamClientEndpoint.

    Connects on first use.  Calls started while not connected wait for the
    connection (until their deadline); after a failed attempt the channel
    redials after ``backoff`` (grpc/grpc ``doc/connection-backoff.md``, jitter
    drawn from ``rng``) and, meanwhile, calls fail UNAVAILABLE unless
    ``wait_for_ready=True``.  A GOAWAY from the server sends new calls to a
    fresh connection while the old one drains; calls it refused unseen are
    retried there transparently.
    """

    def __init__(
        self,
        clock: IReactorTime,
        endpoint: IStreamClientEndpoint,
        config: GrpcConfig | None = None,
        *,
        authority: str = "localhost",
        scheme: str = "http",
        backoff: Backoff = GRPC_CONNECTION_BACKOFF,
        rng: random.Random | None = None,
    ) -> None:
        self.clock = clock
        self.endpoint = endpoint
        self.config = config or GrpcConfig(client_side=True)
        if not self.config.client_side:
            raise ValueError("GrpcChannel needs a client-side GrpcConfig")
        self.authority = authority
        self.scheme = scheme
        self.machine: ChannelMachine[ClientCall] = ChannelMachine(
            rng if rng is not None else random.Random(), backoff)
        self._protocol: ClientProtocol | None = None
        self._connecting: Deferred[Any] | None = None
        self._timer = DeadlineTimer(clock, self._on_timer)
        self._timer_at: float | None = None
        self._factory = _ChannelFactory(self)

    @property
    def state(self) -> ChannelState:
        """The channel's connectivity state."""
        return self.machine.state

    @property
    def protocol(self) -> ClientProtocol | None:
        """The connection new calls go to, if there is one."""
        return self._protocol

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
        call = ClientCall(self, path, serializer or identity, deserializer or identity,
                          timeout, metadata, compression, wait_for_ready)
        self._perform(self.machine.call_opened(call, call.deadline, wait_for_ready,
                                               self.clock.seconds()))
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
        return call.status().addCallback(call.unary_result)

    def ping(self) -> Deferred[float]:
        """Round-trip time of a PING on the current connection."""
        if self._protocol is None:
            return fail(GrpcError(StatusCode.UNAVAILABLE, "not connected"))
        return self._protocol.ping()

    def close(self) -> Deferred[None]:
        """Fail waiting calls, close the connection; fires when closed."""
        protocol = self._protocol
        done: Deferred[None] = Deferred()
        if protocol is not None and protocol.transport is not None and not protocol.closed:
            protocol.closed_waiters.append(done)
        else:
            done.callback(None)
        self._perform(self.machine.close(self.clock.seconds()), protocol)
        self._protocol = None
        return done

    # -- what the calls and connections tell the channel ----------------------------

    # Inputs that cannot bring a deadline forward perform their effects
    # without re-arming the timer (these run for every call).

    def message_queued(self, call: ClientCall, size: int) -> None:
        """``call`` sent ``size`` bytes (kept for a retry while they fit)."""
        effects = self.machine.message_queued(call, size, self.clock.seconds())
        if effects:
            self._perform(effects)

    def response_started(self, call: ClientCall) -> None:
        """The server saw ``call``: it is no longer retried."""
        effects = self.machine.response_started(call, self.clock.seconds())
        if effects:
            self._perform(effects)

    def call_refused(self, call: ClientCall) -> bool:
        """The server refused ``call`` unseen; True if it is being retried."""
        effects = self.machine.call_refused(call, self.clock.seconds())
        self._perform(effects)
        return any(isinstance(effect, RetryCall) for effect in effects)

    def call_finished(self, call: ClientCall) -> None:
        """``call`` ended."""
        effects = self.machine.call_finished(call, self.clock.seconds())
        if effects:
            self._perform(effects)

    def connected(self, protocol: ClientProtocol) -> None:
        """A dialled connection is up."""
        if self.machine.state is not ChannelState.SHUTDOWN:
            self._protocol = protocol
        self._perform(self.machine.connect_succeeded(self.clock.seconds()), protocol)

    def goaway(self, protocol: ClientProtocol) -> None:
        """``protocol`` received a GOAWAY: new calls go to a new connection."""
        if protocol is self._protocol:
            self._protocol = None
            self._perform(self.machine.connection_ended(self.clock.seconds()))

    def disconnected(self, protocol: ClientProtocol) -> None:
        """``protocol``'s transport is gone."""
        waiters, protocol.closed_waiters = protocol.closed_waiters, []
        for d in waiters:
            d.callback(None)
        self.goaway(protocol)

    # -- performing the machine's effects ---------------------------------------------

    def _perform(self, effects: list[ChannelEffect[ClientCall]],
                 protocol: ClientProtocol | None = None) -> None:
        for effect in effects:
            if isinstance(effect, FailCall):
                effect.call.finish(Status(effect.code, effect.message, ()))
            elif isinstance(effect, AttachWaiting):
                self._attach_waiting()
            elif isinstance(effect, RetryCall):
                effect.call.detach_for_retry()
            elif isinstance(effect, ReleaseRetryBuffer):
                effect.call.release_retry_buffer()
            elif isinstance(effect, Connect):
                self._connect()
            elif isinstance(effect, CancelConnect):
                if self._connecting is not None:
                    self._connecting.cancel()
            elif isinstance(effect, CloseConnection):
                if protocol is not None:
                    protocol.close()
        self._arm()

    def _arm(self) -> None:
        """Wake at the machine's next deadline, or earlier: a timer that fires
        before anything is due just re-arms, which costs less than moving it
        for every call (each call's deadline is later than the one before)."""
        deadline = self.machine.next_deadline()
        if deadline is None:
            if self.machine.state is ChannelState.SHUTDOWN:
                self._timer.cancel()
                self._timer_at = None
            return
        if self._timer_at is None or deadline < self._timer_at:
            self._timer_at = deadline
            self._timer.arm(deadline)

    def _attach_waiting(self) -> None:
        for call in self.machine.waiting:
            protocol = self._protocol
            if protocol is None or not protocol.conn.accepting_calls:
                return
            if call.final is not None or call.stream_id is not None:
                continue  # ended, or attached by a nested attach meanwhile
            if not call.attach(protocol):
                return
            if call.final is None:
                self.machine.call_attached(call, self.clock.seconds())  # no effects

    def _connect(self) -> None:
        d = self.endpoint.connect(self._factory)
        self._connecting = d
        d.addCallbacks(self._connect_succeeded, self._connect_failed)

    def _connect_succeeded(self, protocol: Any) -> None:
        self._connecting = None

    def _connect_failed(self, reason: Failure) -> None:
        self._connecting = None
        if reason.check(CancelledError):
            return
        # Not logged here: each call waiting on the channel fails with this reason, and its
        # owner (an engine agent, a peer receiver) logs it once per run of identical failures;
        # a line per dial from every channel would be the same failure again at each retry.
        self._perform(self.machine.connect_failed(reason.getErrorMessage(), self.clock.seconds()))

    def _on_timer(self) -> None:
        self._timer_at = None
        self._perform(self.machine.handle_timeout(self.clock.seconds()))


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
