"""The connection adapter: one HTTP/2 connection fed to :mod:`protocol.grpc`.

Rules this file keeps: no protocol logic (framing, status, flow control and
deadlines live in the pure :class:`protocol.grpc.GrpcConnection`); the
reactor's clock is passed in; one ``callLater`` per connection armed from
``next_deadline()`` (plus a zero-delay one that batches a burst of sends into
one flush, and one that feeds input held back by the frame budget); one
write per batch (:func:`infx.transport.writes.write_buffers`).

Backpressure: the protocol is the transport's push producer; calls ask
:meth:`GrpcProtocol.writable` whether to let their sender go on, and
:meth:`GrpcProtocol.when_resumed` to hear when the transport resumed.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, ClassVar

from twisted.internet.interfaces import IDelayedCall, IPushProducer, IReactorTime
from twisted.internet.protocol import Protocol, connectionDone
from twisted.python.failure import Failure
from zope.interface import implementer

from infx.deadline import DeadlineTimer
from infx.transport.writes import write_buffers
from protocol.grpc import ConnectionTerminated, Event, GrpcConfig, GrpcConnection

__all__ = ["GrpcProtocol", "READ_SIZE", "SEND_HIGH_WATER"]

#: Bytes asked of the socket per read.
READ_SIZE = 1 << 20
#: A call's send() Deferred is already fired while fewer than this many
#: bytes wait to be handed to HTTP/2 (and the transport is not paused).
SEND_HIGH_WATER = 64 * 1024


def _weakly(method: Callable[[], None]) -> Callable[[], None]:
    """``method`` without the reference to its object: a no-op once the
    object is gone (a timer or delayed call then never keeps it alive)."""
    ref = weakref.WeakMethod(method)

    def call() -> None:
        bound = ref()
        if bound is not None:
            bound()

    return call


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
            if candidate is None:
                continue
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

    def connectionLost(self, reason: Failure = connectionDone) -> None:
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
            write_buffers(self.transport, out)
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
            write_buffers(self.transport, out)

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

    @property
    def closed(self) -> bool:
        """True once the transport is gone."""
        return self._closed

    def dispatch(self, events: list[Event]) -> None:
        """Hand each of the machine's events to its handler (:attr:`handlers`)."""
        handlers = self.handlers
        for event in events:
            handler = handlers.get(type(event))
            if handler is not None:
                handler(self, event)

    # -- for subclasses ---------------------------------------------------------

    #: Event type -> handler; subclasses extend it.  A table, not an
    #: isinstance chain: one lookup per event on the hot path.
    handlers: ClassVar[dict[type[Event], Callable[[Any, Any], None]]] = {
        ConnectionTerminated: _terminated,
    }

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
