"""The server's UNARY_UNARY path: a handler returning a plain value is
answered (headers, message, status) in the write that follows the read
that brought its request, and every other outcome (Deferred, coroutine,
exceptions, abort, cancellation, backpressure) reaches the client with
the status the gRPC spec and grpcio give it.

The server protocol runs on a hand-stepped Clock over a StringTransport;
the client is the pure machine, so every byte and event is visible."""

from __future__ import annotations

from typing import Any

import pytest
from twisted.internet import defer, task
from twisted.internet.testing import StringTransport

from infx.transport import CallKind, GrpcError, GrpcServer, ServerCall
from protocol.grpc import (
    CallEnded,
    GrpcConfig,
    GrpcConnection,
    MessageReceived,
    ResponseHeadersReceived,
    StatusCode,
)

PATH = "/t.S/M"


class Harness:
    """One server connection serving ``handler`` at PATH, and a client machine."""

    def __init__(self, handler: Any, *, deserializer: Any = None, serializer: Any = None) -> None:
        self.clock = task.Clock()
        server = GrpcServer(self.clock)
        server.add_method(PATH, handler, deserializer, serializer)
        self.protocol = server.buildProtocol(None)
        self.writes: list[bytes] = []
        self.transport = StringTransport()
        self.transport.write = self.writes.append  # type: ignore[method-assign]
        self.protocol.makeConnection(self.transport)
        self.client = GrpcConnection(GrpcConfig(client_side=True))
        self.client.initiate(0)
        self.protocol.dataReceived(self.client.data_to_send())  # preface, SETTINGS
        self.client.receive_data(b"".join(self.writes), 0)
        self.writes.clear()

    def call(self, request: bytes | None) -> int:
        """Send one call (``None``: half-close without a request)."""
        sid = self.client.start_call(PATH, now=0)
        if request is not None:
            self.client.send_message(sid, request)
        self.client.end_stream(sid)
        self.protocol.dataReceived(self.client.data_to_send())
        return sid

    def received(self) -> list[Any]:
        """Client events caused by what the server wrote since last asked."""
        data = b"".join(self.writes)
        self.writes.clear()
        return self.client.receive_data(data, 0) if data else []


def _messages(events: list[Any]) -> list[bytes]:
    return [e.data for e in events if isinstance(e, MessageReceived)]


def _ended(events: list[Any]) -> tuple[StatusCode, str, tuple[Any, ...]]:
    (end,) = [e for e in events if isinstance(e, CallEnded)]
    return end.status, end.message, end.trailers


def test_plain_value_response_and_status_leave_in_the_read_that_brought_the_request():
    """Headers, the response and the OK status go out in one write during
    the dataReceived that delivered the request; nothing stays pending."""
    seen: list[ServerCall] = []

    def handler(request: bytes, call: ServerCall) -> bytes:
        seen.append(call)
        call.set_trailing_metadata((("x-t", "1"),))
        return request.upper()

    h = Harness(handler)
    h.call(b"abc")
    assert len(h.writes) == 1
    events = h.received()
    assert [type(e) for e in events if isinstance(e, ResponseHeadersReceived)] == \
        [ResponseHeadersReceived]
    assert _messages(events) == [b"ABC"]
    assert _ended(events) == (StatusCode.OK, "", (("x-t", "1"),))
    assert h.protocol.calls == {} and seen[0]._handler is None
    assert h.clock.getDelayedCalls() == []


def _raise_grpc(request: bytes, call: ServerCall) -> bytes:
    raise GrpcError(StatusCode.NOT_FOUND, "no such thing", (("why", "gone"),))


def _crash(request: bytes, call: ServerCall) -> bytes:
    raise ZeroDivisionError("boom")


def _abort(request: bytes, call: ServerCall) -> bytes:
    call.abort(StatusCode.PERMISSION_DENIED, "not you")
    return b"ignored"


async def _coroutine(request: bytes, call: ServerCall) -> bytes:
    return request + b"!"


def _not_bytes(request: bytes, call: ServerCall) -> Any:
    return 42  # the raw-bytes serializer (identity) cannot frame an int


@pytest.mark.parametrize("handler, messages, status", [
    (_raise_grpc, [], (StatusCode.NOT_FOUND, "no such thing", (("why", "gone"),))),
    (_crash, [], (StatusCode.UNKNOWN, "Exception calling application: boom", ())),
    (_abort, [], (StatusCode.PERMISSION_DENIED, "not you", ())),
    (_coroutine, [b"x!"], (StatusCode.OK, "", ())),
])
def test_handler_outcomes_become_the_same_statuses_as_before(handler, messages, status):
    """GrpcError keeps its code, message and trailers; other exceptions are
    UNKNOWN; abort() wins over the returned value; a coroutine's value is
    sent once it completes."""
    h = Harness(handler)
    h.call(b"x")
    events = h.received()
    assert _messages(events) == messages
    assert _ended(events) == status
    assert h.protocol.calls == {}


def test_a_serializer_that_raises_ends_the_call_unknown():
    def serializer(response: Any) -> bytes:
        raise TypeError("cannot serialize")

    h = Harness(lambda request, call: request, serializer=serializer)
    h.call(b"x")
    code, message, _ = _ended(h.received())
    assert code == StatusCode.UNKNOWN and "cannot serialize" in message


def test_a_request_that_does_not_deserialize_ends_the_call_internal_without_the_handler():
    ran: list[bytes] = []

    def deserializer(data: bytes) -> bytes:
        raise ValueError("garbage")

    h = Harness(lambda request, call: ran.append(request), deserializer=deserializer)
    h.call(b"x")
    code, message, _ = _ended(h.received())
    assert code == StatusCode.INTERNAL and "garbage" in message
    assert ran == []


def test_a_half_close_without_a_request_is_internal():
    h = Harness(lambda request, call: request)
    h.call(None)
    assert _ended(h.received()) == (StatusCode.INTERNAL, "expected one request message", ())


def test_a_deferred_result_is_sent_when_it_fires():
    pending: list[defer.Deferred[bytes]] = []

    def handler(request: bytes, call: ServerCall) -> defer.Deferred[bytes]:
        pending.append(defer.Deferred())
        return pending[0]

    h = Harness(handler)
    h.call(b"x")
    events = h.received()
    assert not [e for e in events if isinstance(e, (MessageReceived, CallEnded))]
    pending[0].callback(b"later")
    events = h.received()
    assert _messages(events) == [b"later"]
    assert _ended(events)[0] == StatusCode.OK


def test_a_reset_cancels_a_pending_deferred_result_and_sends_nothing():
    pending: list[defer.Deferred[bytes]] = []
    cancelled: list[GrpcError] = []

    def handler(request: bytes, call: ServerCall) -> defer.Deferred[bytes]:
        call.when_cancelled().addCallback(cancelled.append)
        pending.append(defer.Deferred())
        return pending[0]

    h = Harness(handler)
    sid = h.call(b"x")
    h.client.cancel(sid)
    h.protocol.dataReceived(h.client.data_to_send())
    assert [e.code for e in cancelled] == [StatusCode.CANCELLED]
    # Cancelled through the coroutine awaiting it (the error is consumed there).
    assert pending[0].called
    assert h.protocol.calls == {}
    assert _frame_types(b"".join(h.writes)) <= {_WINDOW_UPDATE}  # no headers, data or status


_WINDOW_UPDATE = 0x8


def _frame_types(data: bytes) -> set[int]:
    types = set()
    while data:
        length = int.from_bytes(data[:3], "big")
        types.add(data[3])
        data = data[9 + length:]
    return types


def test_the_status_waits_for_the_response_while_the_transport_is_paused():
    """As before: the status follows once send() may proceed, i.e. after
    the transport resumes the protocol."""
    h = Harness(lambda request, call: request)
    h.protocol.pauseProducing()
    h.call(b"x")
    events = h.received()
    assert _messages(events) == [b"x"]
    assert not [e for e in events if isinstance(e, CallEnded)]
    h.protocol.resumeProducing()
    assert _ended(h.received())[0] == StatusCode.OK


def test_a_second_request_message_is_not_delivered_to_the_handler():
    requests: list[bytes] = []

    def handler(request: bytes, call: ServerCall) -> bytes:
        requests.append(request)
        return request

    h = Harness(handler)
    sid = h.client.start_call(PATH, now=0)
    h.client.send_message(sid, b"one")
    h.client.send_message(sid, b"two")
    h.client.end_stream(sid)
    h.protocol.dataReceived(h.client.data_to_send())
    events = h.received()
    assert requests == [b"one"]
    assert _messages(events) == [b"one"] and _ended(events)[0] == StatusCode.OK
