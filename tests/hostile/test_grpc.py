"""Hostile peers against the pure gRPC machine and its Twisted adapter.

What tests/protocol/grpc/test_connection.py pins down call by call, this suite throws
at the machine in bulk: random frames, splits, lengths, flags, header blocks
and timing from a peer that breaks HTTP/2 and gRPC in every way the drivers in
tools/fuzz/drivers.py know (the same drivers the atheris target runs). Every
such input must end in a gRPC status for the call or a GOAWAY for the
connection, never an exception or a busy timer; and a hostile call must not
disturb a well-behaved call on the same connection, nor a hostile connection
another connection of the same server.
"""

from __future__ import annotations

import gzip
import struct
from dataclasses import dataclass

import h2.config
import h2.connection
import h2.events
import h2.settings
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st
from twisted.internet import task
from twisted.internet.testing import StringTransport

from infx.transport import CallKind, GrpcServer, ServerCall
from protocol.grpc import (
    CallEnded,
    CallStarted,
    ConnectionTerminated,
    GrpcConfig,
    GrpcConnection,
    InputEnded,
    LocalProtocolError,
    MessageReceived,
    StatusCode,
)
from tests.support.hostile import RawClient, prefixed
from tools.fuzz.drivers import (
    DATA,
    HEADERS,
    PING,
    PREFACE,
    SETTINGS,
    WINDOW_UPDATE,
    CONTINUATION,
    GrpcClientDriver,
    GrpcServerDriver,
    HypothesisSource,
    raw_frame,
)

FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
FEW = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# -- random hostile peers (the atheris drivers, under Hypothesis) --------------------


@FUZZ
@given(st.data())
def test_a_hostile_client_never_breaks_the_server_machine(data):
    """Random frames, header blocks, splits and clock steps from a client: every
    call ends once, no exception escapes, no timer is due in the past."""
    GrpcServerDriver(HypothesisSource(data, steps=10)).run()


@FUZZ
@given(st.data())
def test_a_hostile_server_never_breaks_the_client_machine(data):
    """The same for the client role: each call ends exactly once with a status."""
    GrpcClientDriver(HypothesisSource(data, steps=10)).run()


@FEW
@given(st.binary(min_size=1, max_size=300), st.integers(1, 64))
def test_random_bytes_after_the_preface_end_in_goaway_or_are_ignored(garbage, chunk):
    """Bytes that are not HTTP/2 end the connection with GOAWAY (a protocol
    error code) and every open call with UNAVAILABLE, or, when they happen to
    be frames h2 may ignore, leave the connection working."""
    raw = RawClient(GrpcConnection(GrpcConfig(client_side=False)))
    sid = raw.request()
    raw.exchange()  # the call is open on the server before the garbage
    events = []
    for i in range(0, len(garbage), chunk):
        events += raw.server.receive_data(garbage[i:i + chunk], 0)
    terminated = [e for e in events if isinstance(e, ConnectionTerminated)]
    if terminated:
        assert [(e.stream_id, e.status) for e in events if isinstance(e, CallEnded)] == \
            [(sid, StatusCode.UNAVAILABLE)]
        if terminated[0].error_code:
            sent = raw.h2.receive_data(raw.server.data_to_send())
            assert [e.error_code for e in sent if isinstance(e, h2.events.ConnectionTerminated)] == \
                [terminated[0].error_code]
        assert raw.server.next_deadline() is None
        assert raw.server.receive_data(b"more", 1) == []


# -- a hostile call next to a well-behaved one ----------------------------------------


@dataclass(frozen=True)
class Hostile:
    """One way a call can break gRPC, and the status the server must end it with."""

    name: str
    headers: tuple[tuple[bytes, bytes], ...] = ()
    body: bytes = b""
    status: int | None = None
    method: bytes = b"POST"
    content_type: bytes = b"application/grpc"
    reset: bool = False
    trailers: bool = False


LIMIT = 1000
HOSTILE_CALLS = [
    Hostile("grpc-timeout too long", ((b"grpc-timeout", b"123456789S"),), status=13),
    Hostile("grpc-timeout without unit", ((b"grpc-timeout", b"10"),), status=13),
    Hostile("malformed base64 metadata", ((b"x-trace-bin", b"!!not base64!!"),), status=13),
    Hostile("header list too large", ((b"x-big", b"v" * 3000),), status=8),
    Hostile("unknown grpc-encoding", ((b"grpc-encoding", b"snappy"),), status=12),
    Hostile("GET", method=b"GET", status=13),
    Hostile("not application/grpc", content_type=b"text/html", status=13),
    Hostile("length prefix over the limit", body=struct.pack(">BI", 0, LIMIT + 1), status=8),
    Hostile("length prefix of 4 GiB", body=struct.pack(">BI", 0, 2**32 - 1) + b"x" * 50, status=8),
    Hostile("compressed flag without an encoding", body=prefixed(gzip.compress(b"x"), 1), status=13),
    Hostile("reserved message flag", body=prefixed(b"x", 0x80), status=13),
    Hostile("corrupt gzip", ((b"grpc-encoding", b"gzip"),), body=prefixed(b"not gzip", 1), status=13),
    Hostile("truncated gzip", ((b"grpc-encoding", b"gzip"),), body=prefixed(gzip.compress(b"x" * 99)[:-6], 1),
            status=13),
    Hostile("gzip bomb over the limit", ((b"grpc-encoding", b"gzip"),),
            body=prefixed(gzip.compress(bytes(LIMIT * 50)), 1), status=8),
    Hostile("half-close inside a message", body=struct.pack(">BI", 0, 10) + b"abc", status=13),
    Hostile("trailers inside a message", body=struct.pack(">BI", 0, 10) + b"abc", trailers=True),
    Hostile("reset inside a message", body=struct.pack(">BI", 0, 10) + b"abc", reset=True),
]


@FEW
@given(st.sampled_from(HOSTILE_CALLS), st.integers(1, 40), st.booleans(), st.binary(max_size=200))
def test_a_hostile_call_ends_alone_and_a_well_behaved_call_beside_it_still_works(hostile, chunk, good_first, good):
    """Whatever one call breaks ends that call with its gRPC status; a good call
    opened before or after it on the same connection gets its message, its
    half-close, and its OK status, however the wire cuts the bytes."""
    server = GrpcConnection(GrpcConfig(client_side=False, max_receive_message_length=LIMIT,
                                       max_header_list_size=2048))
    raw = RawClient(server)
    good_sid = raw.request() if good_first else None
    bad = raw.request(list(hostile.headers), method=hostile.method, content_type=hostile.content_type,
                      end_stream=not hostile.body and not hostile.trailers and not hostile.reset)
    if hostile.body:
        raw.h2.send_data(bad, hostile.body, end_stream=not hostile.trailers and not hostile.reset)
    if hostile.trailers:
        raw.h2.send_headers(bad, [(b"x-trailer", b"1")], end_stream=True)
    if hostile.reset:
        raw.h2.reset_stream(bad, 8)
    raw.exchange(chunk)
    if good_sid is None:
        good_sid = raw.request()
    raw.h2.send_data(good_sid, prefixed(good), end_stream=True)
    raw.exchange(chunk)

    started = {e.stream_id for e in raw.server_events if isinstance(e, CallStarted)}
    assert good_sid in started
    got = [e.data for e in raw.server_events if isinstance(e, MessageReceived) and e.stream_id == good_sid]
    assert got == [good]
    assert any(isinstance(e, InputEnded) and e.stream_id == good_sid for e in raw.server_events)
    assert not any(isinstance(e, ConnectionTerminated) for e in raw.server_events)
    server.send_message(good_sid, good[::-1])
    server.send_status(good_sid, StatusCode.OK)
    raw.exchange(chunk)
    assert raw.status_of(good_sid) == b"0"
    if hostile.status is not None:
        assert raw.status_of(bad) == b"%d" % hostile.status
        if bad in started:
            # The application saw the call start, so it is told the call is over.
            ends = [e for e in raw.server_events if isinstance(e, CallEnded) and e.stream_id == bad]
            assert [e.status for e in ends] == [StatusCode(hostile.status)]
    else:
        # Cut short by the client: the handler learns the call is over (reset
        # -> CANCELLED) or sees the half-close in the middle of a message.
        ends = [e for e in raw.server_events if isinstance(e, (CallEnded, InputEnded)) and e.stream_id == bad]
        assert ends
    assert server.active_calls == 0 or (hostile.trailers and server.active_calls == 1)


# -- connection errors from a peer that breaks HTTP/2 (through h2) --------------------


CONNECTION_ERRORS = {
    "DATA on stream 0": raw_frame(DATA, 0, 0, b"x"),
    "HEADERS on an even stream": raw_frame(HEADERS, 0x4, 2, b"\x82"),
    "CONTINUATION without HEADERS": raw_frame(CONTINUATION, 0x4, 1, b"\x82"),
    "SETTINGS with a bad length": raw_frame(SETTINGS, 0, 0, b"\x00\x04\x00"),
    "SETTINGS window over 2^31-1": raw_frame(SETTINGS, 0, 0, struct.pack(">HI", 4, 2**31)),
    "SETTINGS max frame size too small": raw_frame(SETTINGS, 0, 0, struct.pack(">HI", 5, 100)),
    "PING of 7 bytes": raw_frame(PING, 0, 0, b"1234567"),
    "PING on a stream": raw_frame(PING, 0, 1, bytes(8)),
    "WINDOW_UPDATE overflowing the connection window": raw_frame(WINDOW_UPDATE, 0, 0, struct.pack(">I", 2**31 - 1)),
    "WINDOW_UPDATE of zero": raw_frame(WINDOW_UPDATE, 0, 0, struct.pack(">I", 0)),
    "undecodable header block": raw_frame(HEADERS, 0x5, 3, b"\xff\xff\xff\xff"),
}


@pytest.mark.parametrize("name", sorted(CONNECTION_ERRORS))
def test_a_connection_error_ends_every_call_unavailable_with_goaway(name):
    """RFC 9113 connection errors end the connection with GOAWAY and its error
    code; the application hears UNAVAILABLE for every call, and nothing raises."""
    raw = RawClient(GrpcConnection(GrpcConfig(client_side=False)))
    sid = raw.request()
    raw.exchange()
    events = raw.server.receive_data(CONNECTION_ERRORS[name], 0)
    (terminated,) = [e for e in events if isinstance(e, ConnectionTerminated)]
    assert terminated.error_code != 0 and not terminated.remote
    assert [(e.stream_id, e.status) for e in events if isinstance(e, CallEnded)] == \
        [(sid, StatusCode.UNAVAILABLE)]
    out = raw.server.data_to_send()
    goaway = [e for e in raw.h2.receive_data(out) if isinstance(e, h2.events.ConnectionTerminated)]
    assert goaway and goaway[0].error_code == terminated.error_code


def test_the_preface_must_come_first():
    server = GrpcConnection(GrpcConfig(client_side=False))
    server.initiate(0)
    events = server.receive_data(b"PRI * HTTP/1.1\r\n\r\nXX\r\n\r\n" + bytes(20), 0)
    assert any(isinstance(e, ConnectionTerminated) for e in events)


# -- through the Twisted adapter: a hostile connection leaves the others alone --------


class Echo:
    async def echo(self, call: ServerCall) -> None:
        async for message in call:
            await call.send(message[::-1])


def connect(server: GrpcServer) -> tuple[object, StringTransport, GrpcConnection]:
    protocol = server.buildProtocol(None)
    transport = StringTransport()
    protocol.makeConnection(transport)
    client = GrpcConnection(GrpcConfig(client_side=True))
    client.initiate(0)
    protocol.dataReceived(client.data_to_send())
    client.receive_data(transport.value(), 0)
    transport.clear()
    return protocol, transport, client


@FEW
@given(st.binary(min_size=1, max_size=200))
def test_a_hostile_connection_is_closed_alone_and_other_connections_keep_their_calls(garbage):
    """Hostile bytes close their own connection (GOAWAY, then the transport);
    a call in flight on another connection of the same server completes."""
    clock = task.Clock()
    server = GrpcServer(clock)
    server.add_method("/t.S/Echo", Echo().echo, kind=CallKind.STREAM_STREAM)
    good_protocol, good_transport, client = connect(server)
    bad_protocol, bad_transport, _ = connect(server)
    sid = client.start_call("/t.S/Echo", now=0)
    client.send_message(sid, b"abc")
    good_protocol.dataReceived(client.data_to_send())

    bad_protocol.dataReceived(PREFACE + garbage)
    clock.advance(0)

    client.end_stream(sid)
    good_protocol.dataReceived(client.data_to_send())
    clock.advance(0)
    events = client.receive_data(good_transport.value(), 0)
    assert [e.data for e in events if isinstance(e, MessageReceived)] == [b"cba"]
    assert [e.status for e in events if isinstance(e, CallEnded)] == [StatusCode.OK]
    assert not good_transport.disconnecting
    if bad_transport.disconnecting:
        # What the hostile peer got last is a GOAWAY (type 7) with an error code.
        peer = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
        peer.initiate_connection()
        goaways = [e for e in peer.receive_data(bad_transport.value())
                   if isinstance(e, h2.events.ConnectionTerminated)]
        assert goaways and goaways[-1].error_code != 0


def test_a_drain_that_ends_on_a_deadline_does_not_ping_a_finished_connection():
    """Regression (found by the drivers): after GOAWAY(NO_ERROR) the last call's
    deadline and the keepalive timer fall due together; the expired call ends
    the drain, and the keepalive must then not try to PING the terminated
    connection (that raised LocalProtocolError out of handle_timeout)."""
    server = GrpcConnection(GrpcConfig(client_side=False))
    client = GrpcConnection(GrpcConfig(client_side=True, keepalive_interval=5.0))
    client.initiate(0)
    server.initiate(0)
    sid = client.start_call("/s/M", timeout=5.0, now=0)
    server.receive_data(client.data_to_send(), 0)
    server.go_away(now=0)
    events = client.receive_data(server.data_to_send(), 0)
    assert not any(isinstance(e, ConnectionTerminated) for e in events)
    assert client.next_deadline() == 5.0
    events = client.handle_timeout(5.0)
    assert [(e.stream_id, e.status) for e in events if isinstance(e, CallEnded)] == \
        [(sid, StatusCode.DEADLINE_EXCEEDED)]
    assert [e.error_code for e in events if isinstance(e, ConnectionTerminated)] == [0]
    assert client.next_deadline() is None


@pytest.mark.parametrize("side", ["server", "client"])
def test_answering_a_message_whose_call_ended_later_in_the_same_batch_is_not_an_error(side):
    """Regression (found by the drivers): one DATA frame carries a good message
    and then a length prefix over the limit, so the batch is [MessageReceived,
    CallEnded]. The application answers the message before it reaches the
    CallEnded; those commands are dropped (they used to raise
    LocalProtocolError), the peer sees RESOURCE_EXHAUSTED, and the next input
    makes such commands misuse again."""
    bad_tail = struct.pack(">BI", 0, 11) + b"x" * 11
    if side == "server":
        conn = GrpcConnection(GrpcConfig(client_side=False, max_receive_message_length=10))
        raw = RawClient(conn)
        sid = raw.request()
        raw.exchange()
        raw.h2.send_data(sid, prefixed(b"abc") + bad_tail)
        events = conn.receive_data(raw.h2.data_to_send(), 0)
        assert [type(e) for e in events][-2:] == [MessageReceived, CallEnded]
        conn.send_initial_metadata(sid)
        conn.send_message(sid, b"cba")
        conn.send_status(sid, StatusCode.OK)
        raw.events.extend(raw.h2.receive_data(conn.data_to_send()))
        assert raw.status_of(sid) == b"8"
    else:
        server = GrpcConnection(GrpcConfig(client_side=False))
        conn = GrpcConnection(GrpcConfig(client_side=True, max_receive_message_length=10))
        conn.initiate(0)
        server.initiate(0)
        sid = conn.start_call("/s/M", now=0)
        server.receive_data(conn.data_to_send(), 0)
        conn.receive_data(server.data_to_send(), 0)
        server.send_initial_metadata(sid)
        server._h2.send_data(sid, prefixed(b"abc") + bad_tail)
        events = conn.receive_data(server.data_to_send(), 0)
        assert [type(e) for e in events][-2:] == [MessageReceived, CallEnded]
        conn.send_message(sid, b"more")
        conn.end_stream(sid)
        conn.cancel(sid)
    conn.receive_data(b"", 1)
    with pytest.raises(LocalProtocolError):
        conn.send_message(sid, b"after the next input")


def test_a_handler_answering_such_a_message_logs_no_error():
    """The same through the Twisted adapter: an echo handler replies to the
    good message; nothing is logged as a failure and the client gets
    RESOURCE_EXHAUSTED."""
    from twisted.logger import globalLogPublisher

    failures: list[dict] = []

    def observe(event: dict) -> None:
        if event.get("log_failure") is not None or event.get("isError"):
            failures.append(event)

    globalLogPublisher.addObserver(observe)
    try:
        clock = task.Clock()
        server = GrpcServer(clock, GrpcConfig(client_side=False, max_receive_message_length=10))
        server.add_method("/t.S/Echo", Echo().echo, kind=CallKind.STREAM_STREAM)
        protocol, transport, client = connect(server)
        sid = client.start_call("/t.S/Echo", now=0)
        protocol.dataReceived(client.data_to_send())
        client._h2.send_data(sid, prefixed(b"abc") + struct.pack(">BI", 0, 11) + b"x" * 11)
        protocol.dataReceived(client.data_to_send())
        clock.advance(0)
        events = client.receive_data(transport.value(), 0)
    finally:
        globalLogPublisher.removeObserver(observe)
    assert [e.status for e in events if isinstance(e, CallEnded)] == [StatusCode.RESOURCE_EXHAUSTED]
    assert failures == []
