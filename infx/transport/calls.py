"""What server and client calls share: status, errors, call kinds, and the
receive queue and send backpressure of one call.

Rules this file keeps: no protocol logic; a call talks to its connection
adapter only through :class:`~infx.transport.connection.GrpcProtocol`'s
public methods, and the adapter feeds it through :meth:`CallBase.received`
and :meth:`CallBase.send_buffer_drained`.
"""

from __future__ import annotations

import enum
import inspect
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from twisted.internet.defer import Deferred, fail, succeed

from protocol.grpc import LocalProtocolError, MessageReceived, Metadata, StatusCode

if TYPE_CHECKING:
    from infx.transport.connection import GrpcProtocol

__all__ = ["CallBase", "CallKind", "Deserializer", "GrpcError", "Serializer", "Status"]

Serializer = Callable[[Any], bytes]
Deserializer = Callable[[bytes], Any]


def identity(data: Any) -> Any:
    """The (de)serializer of raw-bytes methods."""
    return data


def as_deferred(result: Any) -> Deferred[Any]:
    """A handler's result (value, Deferred or coroutine) as a Deferred."""
    if isinstance(result, Deferred):
        return result
    if inspect.iscoroutine(result):
        return Deferred.fromCoroutine(result)
    return succeed(result)


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


class CallBase:
    """What server and client calls share: ``recv()`` from the messages
    received so far (each handed over by ``_take``), ``async for message
    in call`` (reading until ``recv()`` gives None), and the backpressure of
    ``send()``, which returns an already-fired Deferred while the stream can
    take more, else one Deferred that fires when the stream's buffer drains
    or the transport resumes (both call :meth:`send_buffer_drained`)."""

    _protocol: GrpcProtocol | None
    stream_id: int | None
    _send_waiter: Deferred[None] | None
    _recv_waiter: Deferred[Any] | None
    #: Received and not yet read: messages, and on a server None for the half-close.
    _inbox: deque[MessageReceived | None]
    #: While :meth:`read_each` reads the call: where each message goes.
    _on_message: Callable[[Any], None] | None = None

    def _take(self, item: Any) -> Any:
        """A received item as the reader gets it (acknowledging its bytes); raises GrpcError
        if it cannot be read (the call is then ended)."""
        raise NotImplementedError

    def _deliver(self, item: Any) -> Deferred[Any]:
        try:
            return succeed(self._take(item))
        except GrpcError as exc:
            return fail(exc)

    def _input_over(self) -> Deferred[Any] | None:
        """What ``recv()`` gives once the inbox is empty and no more will come, else None."""
        raise NotImplementedError

    def recv(self) -> Deferred[Any]:
        """The next message; None at the end of the input (a server: the
        client half-closed; a client: the call ended OK); fails with
        GrpcError if the call ended otherwise."""
        if self._recv_waiter is not None:
            return fail(LocalProtocolError("recv() already pending"))
        self._on_message = None
        if self._inbox:
            return self._deliver(self._inbox.popleft())
        over = self._input_over()
        if over is not None:
            return over
        self._recv_waiter = Deferred()
        return self._recv_waiter

    def read_each(self, on_message: Callable[[Any], None]) -> Deferred[None]:
        """Read the call to its end, handing each message to ``on_message`` as it arrives.

        Exactly what a loop of ``await recv()`` that handles each message at
        once does (same order, same turns, the call's end seen only between
        messages), without a Deferred and a resumed coroutine per message.
        Fires None at the end of the input; fails as ``recv()`` would, or
        with what ``on_message`` raised (after which it gets nothing more).
        """
        if self._recv_waiter is not None:
            return fail(LocalProtocolError("recv() already pending"))
        done: Deferred[None] = Deferred()
        self._on_message = on_message
        if self._inbox:
            self._push(done, self._inbox.popleft())
        else:
            self._wait_next(done)
        return done

    def _wait_next(self, done: Deferred[None]) -> None:
        """What the loop's next ``recv()`` would do once the inbox is empty."""
        over = self._input_over()
        if over is None:
            # As recv()'s waiter, ``done`` hears of the call's end from the adapter.
            self._recv_waiter = done
        else:
            self._on_message = None
            over.chainDeferred(done)

    def _push(self, done: Deferred[None], item: MessageReceived | None) -> None:
        on_message = self._on_message
        assert on_message is not None
        while True:
            try:
                value = self._take(item)
                if value is None:
                    self._on_message = None
                    done.callback(None)
                    return
                on_message(value)
            except Exception as exc:
                self._on_message = None
                done.errback(exc)
                return
            if not self._inbox:
                self._wait_next(done)
                return
            item = self._inbox.popleft()

    def received(self, item: MessageReceived | None) -> None:
        """The adapter: a message arrived (on a server, None: the client half-closed)."""
        waiter = self._recv_waiter
        if waiter is not None and self._on_message is not None:
            # Handling it, the reader is busy: the call's end waits for the next wait.
            self._recv_waiter = None
            self._push(waiter, item)
        elif waiter is not None:
            # Straight to the waiting reader: no Deferred of its own per message.
            self._recv_waiter = None
            try:
                value = self._take(item)
            except GrpcError as exc:
                waiter.errback(exc)
            else:
                waiter.callback(value)
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
        assert protocol is not None and self.stream_id is not None
        protocol.schedule_flush()
        if protocol.writable(self.stream_id):
            return succeed(None)
        if self._send_waiter is None:
            self._send_waiter = Deferred()
            if protocol.paused:
                protocol.when_resumed(self.send_buffer_drained)
        return self._send_waiter

    def send_buffer_drained(self) -> None:
        """The adapter: the stream's buffer drained or the transport resumed;
        fire a waiting send() once the stream can take more."""
        waiter = self._send_waiter
        protocol = self._protocol
        if waiter is None or protocol is None or self.stream_id is None:
            return
        if protocol.paused:
            protocol.when_resumed(self.send_buffer_drained)
            return
        if not protocol.writable(self.stream_id):
            return
        self._send_waiter = None
        waiter.callback(None)
