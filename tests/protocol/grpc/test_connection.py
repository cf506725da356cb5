"""The pure gRPC machine: a client and a server GrpcConnection back to back
through a fake link (and raw h2 peers where a misbehaving peer is needed),
time stepped by hand."""

from __future__ import annotations

import gzip
import struct

import h2.config
import h2.connection
import h2.events
import h2.settings
import pytest
from hypothesis import given, settings, strategies as st

from protocol.grpc import (
    CallEnded,
    CallStarted,
    ConnectionTerminated,
    EndCause,
    GoAwayReceived,
    GOAWAY_ACK_TIMEOUT,
    GrpcConfig,
    GrpcConnection,
    InputEnded,
    LocalProtocolError,
    MessageReceived,
    MessageTooLarge,
    PingAcknowledged,
    ResponseHeadersReceived,
    SendBufferDrained,
    StatusCode,
)

SPECIAL = "\t\ntest with whitespace\r\nand Unicode BMP ☺ and non-BMP 😈\t\n"
FAST = settings(max_examples=40, deadline=None)


def frame(data: bytes, compressed: bool = False) -> bytes:
    return struct.pack(">BI", int(compressed), len(data)) + data


class Link:
    """Two machines joined by a fake wire that can cut bytes into any pieces."""

    def __init__(self, client_config: GrpcConfig | None = None,
                 server_config: GrpcConfig | None = None, chunk: int | None = None) -> None:
        self.now = 0.0
        self.client = GrpcConnection(client_config or GrpcConfig(client_side=True))
        self.server = GrpcConnection(server_config or GrpcConfig(client_side=False))
        self.chunk = chunk
        self.client_events: list[object] = []
        self.server_events: list[object] = []
        self.client.initiate(self.now)
        self.server.initiate(self.now)
        self.pump()

    def _deliver(self, data: bytes, to: GrpcConnection, into: list[object]) -> None:
        step = self.chunk or len(data)
        for i in range(0, len(data), step):
            into.extend(to.receive_data(data[i:i + step], self.now))

    def pump(self) -> None:
        # Commands may have caused events too (e.g. a drain completing).
        self.client_events.extend(self.client.take_events())
        self.server_events.extend(self.server.take_events())
        for _ in range(10_000):
            a = self.client.data_to_send()
            b = self.server.data_to_send()
            self.client_events.extend(self.client.take_events())
            self.server_events.extend(self.server.take_events())
            if not a and not b:
                return
            if a:
                self._deliver(a, self.server, self.server_events)
            if b:
                self._deliver(b, self.client, self.client_events)
        raise AssertionError("link never went quiet")

    def advance(self, seconds: float) -> None:
        self.now += seconds
        for conn, into in ((self.client, self.client_events), (self.server, self.server_events)):
            deadline = conn.next_deadline()
            if deadline is not None and deadline <= self.now:
                into.extend(conn.handle_timeout(self.now))
        self.pump()

    def take(self, side: str, kind: type | None = None) -> list:
        events = self.client_events if side == "client" else self.server_events
        taken = [e for e in events if kind is None or isinstance(e, kind)]
        events[:] = [e for e in events if not (kind is None or isinstance(e, kind))]
        return taken


def started(link: Link) -> CallStarted:
    (event,) = link.take("server", CallStarted)
    return event


def ended(link: Link, side: str = "client") -> CallEnded:
    (event,) = link.take(side, CallEnded)
    return event


# -- the four call shapes --------------------------------------------------


@pytest.mark.parametrize("chunk", [1, None], ids=["one-byte-at-a-time", "whole-writes"])
def test_unary_call_round_trip_with_metadata_and_trailers(chunk):
    link = Link(chunk=chunk)
    sid = link.client.start_call("/pkg.Svc/Method", (("x-a", "1"), ("x-b-bin", b"\x00\xff")),
                                 timeout=30, now=link.now)
    link.client.send_message(sid, b"request")
    link.client.end_stream(sid)
    link.pump()
    call = started(link)
    assert call.method == "/pkg.Svc/Method"
    assert ("x-a", "1") in call.metadata and ("x-b-bin", b"\x00\xff") in call.metadata
    assert call.deadline == pytest.approx(30)
    assert [e.data for e in link.take("server", MessageReceived)] == [b"request"]
    assert link.take("server", InputEnded) == [InputEnded(sid)]
    link.server.send_initial_metadata(sid, (("h", "v"),))
    link.server.send_message(sid, b"response")
    link.server.send_status(sid, StatusCode.OK, "", (("t-bin", b"\x01"),))
    link.pump()
    (headers,) = link.take("client", ResponseHeadersReceived)
    assert headers.metadata == (("h", "v"),)
    assert [e.data for e in link.take("client", MessageReceived)] == [b"response"]
    end = ended(link)
    assert (end.status, end.cause, end.trailers) == (StatusCode.OK, EndCause.TRAILERS,
                                                     (("t-bin", b"\x01"),))
    assert link.client.active_calls == 0 and link.server.active_calls == 0


def test_client_streaming_server_streaming_and_bidi_keep_order():
    link = Link()
    sid = link.client.start_call("/s/Bidi", now=link.now)
    for i in range(5):
        link.client.send_message(sid, b"c%d" % i)
    link.pump()
    started(link)
    assert [e.data for e in link.take("server", MessageReceived)] == [b"c%d" % i for i in range(5)]
    for i in range(7):
        link.server.send_message(sid, b"s%d" % i)
    link.pump()
    assert [e.data for e in link.take("client", MessageReceived)] == [b"s%d" % i for i in range(7)]
    link.client.send_message(sid, b"last")
    link.client.end_stream(sid)
    link.server.send_message(sid, b"more")
    link.pump()
    assert [e.data for e in link.take("server", MessageReceived)] == [b"last"]
    assert link.take("server", InputEnded)
    link.server.send_status(sid, StatusCode.OK)
    link.pump()
    assert [e.data for e in link.take("client", MessageReceived)] == [b"more"]
    assert ended(link).status == StatusCode.OK


def test_many_concurrent_calls_interleave_independently():
    link = Link(chunk=1000)
    sids = [link.client.start_call("/s/M", now=link.now) for _ in range(50)]
    for round_ in range(3):
        for sid in sids:
            link.client.send_message(sid, b"%d:%d" % (sid, round_))
    for sid in sids:
        link.client.end_stream(sid)
    link.pump()
    assert len(link.take("server", CallStarted)) == 50
    received: dict[int, list[bytes]] = {}
    for e in link.take("server", MessageReceived):
        received.setdefault(e.stream_id, []).append(e.data)
    assert received == {sid: [b"%d:%d" % (sid, r) for r in range(3)] for sid in sids}
    for sid in reversed(sids):
        link.server.send_status(sid, StatusCode.OK)
    link.pump()
    assert sorted(e.stream_id for e in link.take("client", CallEnded)) == sorted(sids)


def test_zero_length_messages_are_messages():
    link = Link(chunk=3)
    sid = link.client.start_call("/s/M", now=link.now)
    link.client.send_message(sid, b"")
    link.client.send_message(sid, b"")
    link.client.end_stream(sid)
    link.pump()
    assert [e.data for e in link.take("server", MessageReceived)] == [b"", b""]


# -- framing against a raw h2 client that splits/packs DATA frames freely ---


class RawClient:
    """A bare h2 client, to send exactly the frames a test wants."""

    def __init__(self, server: GrpcConnection, now: float = 0.0, initial_window: int = 2**24) -> None:
        self.h2 = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True,
                                                                      header_encoding=None))
        self.h2.local_settings = h2.settings.Settings(client=True, initial_values={
            h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: initial_window,
            h2.settings.SettingCodes.MAX_FRAME_SIZE: 2**24 - 1})
        self.h2.max_inbound_frame_size = 2**24 - 1
        self.h2.initiate_connection()
        self.h2.increment_flow_control_window(2**30)
        self.server = server
        self.now = now
        self.server.initiate(now)
        self.events: list[object] = []
        self.server_events: list[object] = []
        self.exchange()

    def exchange(self) -> None:
        for _ in range(1000):
            a = self.h2.data_to_send()
            b = self.server.data_to_send()
            if not a and not b:
                return
            if a:
                self.server_events.extend(self.server.receive_data(a, self.now))
            if b:
                self.events.extend(self.h2.receive_data(b))

    def request(self, extra: list[tuple[bytes, bytes]] = (), *, content_type=b"application/grpc",
                method=b"POST", end_stream=False) -> int:
        sid = self.h2.get_next_available_stream_id()
        headers = [(b":method", method), (b":scheme", b"http"), (b":path", b"/s/M"),
                   (b":authority", b"x"), (b"te", b"trailers"),
                   (b"content-type", content_type)] + list(extra)
        self.h2.send_headers(sid, headers, end_stream=end_stream)
        self.exchange()
        return sid

    def response_headers(self, sid: int) -> dict[bytes, bytes]:
        for e in self.events:
            if isinstance(e, (h2.events.ResponseReceived, h2.events.TrailersReceived)) \
                    and e.stream_id == sid:
                return dict(e.headers)
        raise AssertionError("no headers")


@FAST
@given(st.lists(st.binary(max_size=300), min_size=1, max_size=8), st.data())
def test_messages_split_across_and_packed_within_data_frames_any_way(messages, data):
    server = GrpcConnection(GrpcConfig(client_side=False))
    raw = RawClient(server)
    sid = raw.request()
    wire = b"".join(frame(m) for m in messages)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(wire)), max_size=10)))
    pieces = [wire[a:b] for a, b in zip([0] + cuts, cuts + [len(wire)])]
    for piece in pieces:
        raw.h2.send_data(sid, piece)
        raw.exchange()
    raw.h2.end_stream(sid)
    raw.exchange()
    got = [e.data for e in raw.server_events if isinstance(e, MessageReceived)]
    assert got == messages
    assert isinstance(raw.server_events[-1], InputEnded)
    # Every flow-controlled byte is owned by exactly one message or was
    # acknowledged on arrival: acknowledging the messages empties the debt.
    for e in raw.server_events:
        if isinstance(e, MessageReceived):
            server.acknowledge(sid, e.flow_controlled_length)
    assert server._calls[sid].unacked == 0


@FAST
@given(st.lists(st.binary(max_size=2000), min_size=1, max_size=5),
       st.integers(min_value=1, max_value=700))
def test_back_to_back_machines_survive_any_wire_chunking(messages, chunk):
    link = Link(chunk=chunk)
    sid = link.client.start_call("/s/M", now=link.now)
    for m in messages:
        link.client.send_message(sid, m)
    link.client.end_stream(sid)
    link.pump()
    assert [e.data for e in link.take("server", MessageReceived)] == messages
    for m in messages:
        link.server.send_message(sid, m, compress=True)
    link.server.send_status(sid, StatusCode.OK)
    link.pump()
    assert [e.data for e in link.take("client", MessageReceived)] == messages


def test_oversized_length_prefix_ends_only_that_call_before_buffering():
    server = GrpcConnection(GrpcConfig(client_side=False, max_receive_message_length=1000))
    raw = RawClient(server)
    big = raw.request()
    small = raw.request()
    # Only the 5-byte prefix arrives: the limit applies before any buffering.
    raw.h2.send_data(big, struct.pack(">BI", 0, 1001))
    raw.exchange()
    (end,) = [e for e in raw.server_events if isinstance(e, CallEnded)]
    assert (end.stream_id, end.status) == (big, StatusCode.RESOURCE_EXHAUSTED)
    headers = raw.response_headers(big)
    assert headers[b"grpc-status"] == b"8"
    raw.h2.send_data(small, frame(b"x" * 1000), end_stream=True)
    raw.exchange()
    assert [e.data for e in raw.server_events if isinstance(e, MessageReceived)] == [b"x" * 1000]


def test_client_receiving_oversized_message_reports_resource_exhausted():
    link = Link(client_config=GrpcConfig(client_side=True, max_receive_message_length=10))
    sid = link.client.start_call("/s/M", now=link.now)
    link.pump()
    link.server.send_message(sid, b"x" * 11)
    link.pump()
    end = ended(link)
    assert (end.status, end.cause) == (StatusCode.RESOURCE_EXHAUSTED, EndCause.SYNTHESIZED)
    assert link.take("server", CallEnded)[0].status == StatusCode.CANCELLED


def test_send_limit_raises_message_too_large():
    link = Link(client_config=GrpcConfig(client_side=True, max_send_message_length=4))
    sid = link.client.start_call("/s/M", now=link.now)
    with pytest.raises(MessageTooLarge) as info:
        link.client.send_message(sid, b"12345")
    assert info.value.code == StatusCode.RESOURCE_EXHAUSTED


# -- compression ---------------------------------------------------------------


def test_gzip_both_ways_sets_the_compressed_flag():
    link = Link()
    sid = link.client.start_call("/s/M", now=link.now, encoding="gzip")
    link.client.send_message(sid, b"a" * 1000, compress=True)
    link.client.send_message(sid, b"plain", compress=False)
    link.pump()
    assert started(link).encoding == "gzip"
    msgs = link.take("server", MessageReceived)
    assert [(m.data, m.compressed) for m in msgs] == [(b"a" * 1000, True), (b"plain", False)]
    assert msgs[0].flow_controlled_length < 1000
    link.server.send_initial_metadata(sid, encoding="gzip")
    link.server.send_message(sid, b"b" * 1000, compress=True)
    link.pump()
    assert link.take("client", ResponseHeadersReceived)[0].encoding == "gzip"
    (msg,) = link.take("client", MessageReceived)
    assert (msg.data, msg.compressed) == (b"b" * 1000, True)


def test_compressed_flag_without_encoding_is_internal():
    server = GrpcConnection(GrpcConfig(client_side=False))
    raw = RawClient(server)
    sid = raw.request()
    raw.h2.send_data(sid, frame(gzip.compress(b"x"), compressed=True))
    raw.exchange()
    assert raw.response_headers(sid)[b"grpc-status"] == b"13"


def test_unsupported_encoding_is_unimplemented_with_accept_encoding():
    server = GrpcConnection(GrpcConfig(client_side=False))
    raw = RawClient(server)
    sid = raw.request([(b"grpc-encoding", b"snappy")])
    headers = raw.response_headers(sid)
    assert headers[b"grpc-status"] == b"12"
    assert b"gzip" in headers[b"grpc-accept-encoding"]
    assert not [e for e in raw.server_events if isinstance(e, CallStarted)]


def test_corrupt_gzip_is_internal():
    server = GrpcConnection(GrpcConfig(client_side=False))
    raw = RawClient(server)
    sid = raw.request([(b"grpc-encoding", b"gzip")])
    raw.h2.send_data(sid, frame(b"not gzip", compressed=True))
    raw.exchange()
    assert raw.response_headers(sid)[b"grpc-status"] == b"13"


# -- request headers ------------------------------------------------------------


def test_non_grpc_content_type_gets_http_415():
    server = GrpcConnection(GrpcConfig(client_side=False))
    raw = RawClient(server)
    sid = raw.request(content_type=b"text/plain")
    assert raw.response_headers(sid)[b":status"] == b"415"


def test_grpc_proto_content_type_is_accepted_and_get_is_405():
    server = GrpcConnection(GrpcConfig(client_side=False))
    raw = RawClient(server)
    raw.request(content_type=b"application/grpc+proto")
    assert [e for e in raw.server_events if isinstance(e, CallStarted)]
    sid = raw.request(method=b"GET", end_stream=True)
    assert raw.response_headers(sid)[b":status"] == b"405"


def test_malformed_grpc_timeout_is_rejected_per_call():
    server = GrpcConnection(GrpcConfig(client_side=False))
    raw = RawClient(server)
    sid = raw.request([(b"grpc-timeout", b"123456789S")])
    assert raw.response_headers(sid)[b"grpc-status"] == b"13"


def test_oversized_request_headers_end_that_call_with_resource_exhausted():
    server = GrpcConnection(GrpcConfig(client_side=False, max_header_list_size=2048))
    raw = RawClient(server)
    sid = raw.request([(b"x-big", b"v" * 3000)])
    assert raw.response_headers(sid)[b"grpc-status"] == b"8"
    raw.request()
    assert [e for e in raw.server_events if isinstance(e, CallStarted)]


def test_client_sends_required_request_headers():
    server = GrpcConnection(GrpcConfig(client_side=False))
    client = GrpcConnection(GrpcConfig(client_side=True, user_agent="ua/1"))
    client.initiate(0)
    client.start_call("/a/B", timeout=1.5, now=0, authority="svc:1")
    peer = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False,
                                                               header_encoding=None))
    peer.initiate_connection()
    events = peer.receive_data(client.data_to_send())
    (request,) = [e for e in events if isinstance(e, h2.events.RequestReceived)]
    headers = dict(request.headers)
    assert headers[b":method"] == b"POST" and headers[b":path"] == b"/a/B"
    assert headers[b":authority"] == b"svc:1" and headers[b":scheme"] == b"http"
    assert headers[b"te"] == b"trailers" and headers[b"content-type"] == b"application/grpc"
    assert headers[b"user-agent"] == b"ua/1" and headers[b"grpc-timeout"] == b"1500000u"


# -- status ---------------------------------------------------------------------


def test_status_without_headers_is_trailers_only_and_message_round_trips():
    link = Link()
    sid = link.client.start_call("/s/M", now=link.now)
    link.client.end_stream(sid)
    link.pump()
    link.server.send_status(sid, StatusCode.UNKNOWN, SPECIAL, (("k", "v"),))
    link.pump()
    assert not link.take("client", ResponseHeadersReceived)
    end = ended(link)
    assert (end.status, end.message, end.cause, end.trailers) == (
        StatusCode.UNKNOWN, SPECIAL, EndCause.TRAILERS_ONLY, (("k", "v"),))


class RawServer:
    """A bare h2 server answering our client machine with arbitrary headers."""

    def __init__(self) -> None:
        self.client = GrpcConnection(GrpcConfig(client_side=True))
        self.client.initiate(0)
        self.h2 = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False,
                                                                      header_encoding=None))
        self.h2.initiate_connection()
        self.events: list[object] = []
        self.exchange()

    def exchange(self, now: float = 0) -> None:
        for _ in range(100):
            a = self.client.data_to_send()
            b = self.h2.data_to_send()
            if not a and not b:
                return
            if a:
                self.h2.receive_data(a)
            if b:
                self.events.extend(self.client.receive_data(b, now))

    def call(self) -> int:
        sid = self.client.start_call("/s/M", now=0)
        self.client.end_stream(sid)
        self.exchange()
        return sid

    def ended(self) -> CallEnded:
        (end,) = [e for e in self.events if isinstance(e, CallEnded)]
        return end


@pytest.mark.parametrize("http_status,code", [
    (b"400", StatusCode.INTERNAL), (b"401", StatusCode.UNAUTHENTICATED),
    (b"403", StatusCode.PERMISSION_DENIED), (b"404", StatusCode.UNIMPLEMENTED),
    (b"429", StatusCode.UNAVAILABLE), (b"502", StatusCode.UNAVAILABLE),
    (b"503", StatusCode.UNAVAILABLE), (b"504", StatusCode.UNAVAILABLE),
    (b"500", StatusCode.UNKNOWN),
])
@pytest.mark.parametrize("ends_stream", [True, False])
def test_non_200_response_becomes_a_synthesized_status(http_status, code, ends_stream):
    raw = RawServer()
    sid = raw.call()
    raw.h2.send_headers(sid, [(b":status", http_status), (b"content-type", b"text/html")],
                        end_stream=ends_stream)
    raw.exchange()
    end = raw.ended()
    assert (end.status, end.cause) == (code, EndCause.SYNTHESIZED)


def test_wrong_response_content_type_and_missing_status_are_synthesized():
    raw = RawServer()
    sid = raw.call()
    raw.h2.send_headers(sid, [(b":status", b"200"), (b"content-type", b"text/html")])
    raw.exchange()
    assert (raw.ended().status, raw.ended().cause) == (StatusCode.INTERNAL, EndCause.SYNTHESIZED)
    raw = RawServer()
    sid = raw.call()
    raw.h2.send_headers(sid, [(b":status", b"200"), (b"content-type", b"application/grpc")])
    raw.h2.send_headers(sid, [(b"x", b"y")], end_stream=True)
    raw.exchange()
    assert raw.ended().status == StatusCode.UNKNOWN
    raw = RawServer()
    sid = raw.call()
    raw.h2.send_headers(sid, [(b":status", b"200"), (b"content-type", b"application/grpc")])
    raw.h2.send_data(sid, frame(b"x"), end_stream=True)
    raw.exchange()
    assert raw.ended().status == StatusCode.INTERNAL


@pytest.mark.parametrize("error_code,code", [
    (0, StatusCode.INTERNAL), (1, StatusCode.INTERNAL), (2, StatusCode.INTERNAL),
    (3, StatusCode.INTERNAL), (4, StatusCode.INTERNAL), (6, StatusCode.INTERNAL),
    (7, StatusCode.UNAVAILABLE), (8, StatusCode.CANCELLED), (9, StatusCode.INTERNAL),
    (10, StatusCode.INTERNAL), (11, StatusCode.RESOURCE_EXHAUSTED),
    (12, StatusCode.PERMISSION_DENIED),
])
def test_rst_stream_codes_map_to_status_as_the_spec_says(error_code, code):
    raw = RawServer()
    sid = raw.call()
    raw.h2.reset_stream(sid, error_code)
    raw.exchange()
    end = raw.ended()
    assert (end.status, end.reset_code) == (code, error_code)
    assert end.cause == (EndCause.REFUSED if error_code == 7 else EndCause.RESET)


def test_early_status_is_followed_by_rst_stream_no_error():
    server = GrpcConnection(GrpcConfig(client_side=False))
    raw = RawClient(server)
    sid = raw.request()
    server.send_status(sid, StatusCode.OK)
    raw.exchange()
    (reset,) = [e for e in raw.events if isinstance(e, h2.events.StreamReset)]
    assert (reset.stream_id, reset.error_code) == (sid, 0)


def test_client_gets_status_even_if_rst_no_error_follows_trailers():
    link = Link()
    sid = link.client.start_call("/s/M", now=link.now)
    link.pump()
    link.server.send_status(sid, StatusCode.ALREADY_EXISTS, "early")
    link.pump()
    end = ended(link)
    assert (end.status, end.message) == (StatusCode.ALREADY_EXISTS, "early")


# -- deadlines and cancellation ------------------------------------------------------


def test_deadline_both_sides_client_reports_it_server_resets_and_stops_handler():
    link = Link()
    sid = link.client.start_call("/s/M", timeout=5, now=link.now)
    link.pump()
    started(link)
    assert link.client.next_deadline() == 5 and link.server.next_deadline() == 5
    link.now = 5
    server_events = link.server.handle_timeout(link.now)
    (server_end,) = [e for e in server_events if isinstance(e, CallEnded)]
    assert (server_end.status, server_end.cause) == (StatusCode.DEADLINE_EXCEEDED,
                                                     EndCause.DEADLINE)
    client_events = link.client.handle_timeout(link.now)
    (client_end,) = [e for e in client_events if isinstance(e, CallEnded)]
    assert (client_end.status, client_end.cause) == (StatusCode.DEADLINE_EXCEEDED,
                                                     EndCause.DEADLINE)
    link.pump()
    assert link.client.active_calls == 0 and link.server.active_calls == 0
    assert link.client.next_deadline() is None
    with pytest.raises(LocalProtocolError):
        link.server.send_message(sid, b"late")


def test_server_deadline_sends_deadline_exceeded_then_resets_the_stream():
    server = GrpcConnection(GrpcConfig(client_side=False))
    raw = RawClient(server)
    sid = raw.request([(b"grpc-timeout", b"100m")])
    assert server.next_deadline() == pytest.approx(0.1)
    server.handle_timeout(0.1)
    raw.exchange()
    assert raw.response_headers(sid)[b"grpc-status"] == b"4"
    (reset,) = [e for e in raw.events if isinstance(e, h2.events.StreamReset)]
    assert reset.stream_id == sid


def test_queued_request_is_dropped_when_a_rejection_closes_the_stream_in_the_same_read():
    # The request is queued (64 KiB default window before the server's
    # SETTINGS); the server's SETTINGS, window update and trailers-only
    # rejection then arrive in one read.
    fresh = GrpcConnection(GrpcConfig(client_side=True))
    fresh.initiate(0)
    sid = fresh.start_call("/s/M", now=0)
    fresh.send_message(sid, bytes(200_000))
    fresh.end_stream(sid)
    server = GrpcConnection(GrpcConfig(client_side=False, max_receive_message_length=100))
    server.initiate(0)
    ended_calls = []
    for _ in range(100):
        out = fresh.data_to_send()
        server.receive_data(out, 0)
        back = server.data_to_send()
        if not out and not back:
            break
        ended_calls += [e for e in fresh.receive_data(back, 0) if isinstance(e, CallEnded)]
    assert [(e.stream_id, e.status) for e in ended_calls] == [(sid, StatusCode.RESOURCE_EXHAUSTED)]


def test_client_cancel_reaches_the_server_as_cancelled():
    link = Link()
    sid = link.client.start_call("/s/M", now=link.now)
    link.pump()
    link.client.cancel(sid)
    link.pump()
    end = ended(link, "server")
    assert (end.status, end.cause, end.reset_code) == (StatusCode.CANCELLED, EndCause.RESET, 8)
    assert not link.take("client", CallEnded)


# -- flow control -------------------------------------------------------------------


SMALL = dict(initial_window_size=65_535, connection_window_size=65_535)


def test_slow_consumer_pushes_back_and_acknowledging_resumes_the_sender():
    link = Link(client_config=GrpcConfig(client_side=True, **SMALL))
    sid = link.client.start_call("/s/M", now=link.now)
    link.pump()
    for _ in range(20):
        link.server.send_message(sid, b"x" * 10_000)
    link.pump()
    received = link.take("client", MessageReceived)
    assert len(received) < 20
    assert link.server.buffered_amount(sid) > 0
    for _ in range(50):
        for e in received:
            link.client.acknowledge(sid, e.flow_controlled_length)
        link.pump()
        received = link.take("client", MessageReceived)
        if not received:
            break
    assert link.server.buffered_amount(sid) == 0
    assert link.take("server", SendBufferDrained) != []


def test_message_larger_than_the_window_still_flows():
    link = Link(client_config=GrpcConfig(client_side=True, **SMALL),
                server_config=GrpcConfig(client_side=False, **SMALL))
    sid = link.client.start_call("/s/M", now=link.now)
    link.client.send_message(sid, bytes(300_000))
    link.client.end_stream(sid)
    link.pump()
    (msg,) = link.take("server", MessageReceived)
    assert len(msg.data) == 300_000
    assert link.take("server", InputEnded)


def test_bytes_of_ended_calls_are_returned_to_the_connection_window():
    link = Link(client_config=GrpcConfig(client_side=True, **SMALL),
                server_config=GrpcConfig(client_side=False, **SMALL))
    first = link.client.start_call("/s/M", now=link.now)
    link.client.send_message(first, bytes(40_000))
    link.pump()
    assert link.take("server", MessageReceived)  # never acknowledged by the app
    link.server.send_status(first, StatusCode.OK)
    link.pump()
    # The unread message's bytes went back to the connection: another
    # 60 KB fits although the connection window is 64 KiB.
    second = link.client.start_call("/s/M", now=link.now)
    link.client.send_message(second, bytes(60_000))
    link.client.end_stream(second)
    link.pump()
    assert [len(m.data) for m in link.take("server", MessageReceived)] == [60_000]


def test_sending_resumes_after_window_shrinks_below_zero_via_settings():
    server = GrpcConnection(GrpcConfig(client_side=False))
    raw = RawClient(server)
    raw.h2.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 100_000})
    raw.exchange()
    sid = raw.request()
    server.send_message(sid, bytes(90_000))
    raw.exchange()  # the client consumes but does not return the window
    raw.h2.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 10_000})
    raw.exchange()
    assert server._h2.local_flow_control_window(sid) < 0
    server.send_message(sid, b"y" * 20_000)
    raw.exchange()
    assert server.buffered_amount(sid) > 0
    got = sum(len(e.data) for e in raw.events if isinstance(e, h2.events.DataReceived))
    raw.h2.increment_flow_control_window(200_000, stream_id=sid)
    raw.exchange()
    got = sum(len(e.data) for e in raw.events if isinstance(e, h2.events.DataReceived))
    assert got == 90_005 + 20_005 and server.buffered_amount(sid) == 0


def test_status_waits_behind_queued_messages():
    link = Link(client_config=GrpcConfig(client_side=True, **SMALL))
    sid = link.client.start_call("/s/M", now=link.now)
    link.pump()
    for _ in range(10):
        link.server.send_message(sid, bytes(10_000))
    link.server.send_status(sid, StatusCode.OK)
    link.pump()
    assert not link.take("client", CallEnded)
    for _ in range(10):
        for e in link.take("client", MessageReceived):
            link.client.acknowledge(sid, e.flow_controlled_length)
        link.pump()
    assert ended(link).status == StatusCode.OK


# -- withdrawing queued messages --------------------------------------------------------


def stream_data(raw: RawClient, sid: int) -> bytes:
    """Every DATA byte the raw client received on ``sid``."""
    return b"".join(e.data for e in raw.events if isinstance(e, h2.events.DataReceived) and e.stream_id == sid)


def messages_in(data: bytes) -> list[bytes]:
    """The gRPC messages of a stream's DATA bytes (the whole of each)."""
    out = []
    while data:
        _, length = struct.unpack(">BI", data[:5])
        assert len(data) >= 5 + length, "a message cut short"
        out.append(data[5:5 + length])
        data = data[5 + length:]
    return out


def zero_window_stream() -> tuple[GrpcConnection, RawClient, int]:
    """A server call whose client opened no stream window: what the server sends stays queued."""
    server = GrpcConnection(GrpcConfig(client_side=False))
    raw = RawClient(server, initial_window=0)
    sid = raw.request()
    return server, raw, sid


def test_a_queued_message_is_withdrawn_whole_and_its_bytes_are_never_sent():
    """A message none of whose bytes went to HTTP/2 is taken back by its key: the
    peer later receives the others, whole and in order, and never a byte of it."""
    server, raw, sid = zero_window_stream()
    small, large, last = b"s" * 100, b"L" * (1 << 20), b"t" * 10
    server.send_message(sid, small, key="small")
    server.send_message(sid, large, key="large")
    server.send_message(sid, last, key="last")
    raw.exchange()
    assert server.buffered_amount(sid) == 3 * 5 + 100 + (1 << 20) + 10
    assert server.withdraw_message(sid, "large")
    assert server.buffered_amount(sid) == 2 * 5 + 100 + 10
    assert not server.withdraw_message(sid, "large")  # once
    raw.h2.increment_flow_control_window(1 << 21, stream_id=sid)
    raw.exchange()
    assert messages_in(stream_data(raw, sid)) == [small, last]
    assert server.buffered_amount(sid) == 0


def test_a_message_handed_to_http2_even_in_part_is_not_withdrawn_and_arrives_whole():
    server, raw, sid = zero_window_stream()
    message = b"m" * 100_000
    server.send_message(sid, message, key="task")
    raw.h2.increment_flow_control_window(1000, stream_id=sid)
    raw.exchange()
    assert 0 < len(stream_data(raw, sid)) < len(message)
    assert not server.withdraw_message(sid, "task")
    raw.h2.increment_flow_control_window(1 << 20, stream_id=sid)
    raw.exchange()
    assert messages_in(stream_data(raw, sid)) == [message]
    # Its key was let go when it was handed over: the key may name a new message.
    server.send_message(sid, b"again", key="task")
    assert server.withdraw_message(sid, "task")


def test_keys_are_unique_among_queued_messages():
    server, raw, sid = zero_window_stream()
    server.send_message(sid, b"a", key=1)
    with pytest.raises(LocalProtocolError):
        server.send_message(sid, b"b", key=1)
    assert not server.withdraw_message(sid, 2) and not server.withdraw_message(sid + 2, 1)
    server.send_message(sid, b"c")  # unkeyed messages are never withdrawn
    assert server.withdraw_message(sid, 1) and server.buffered_amount(sid) == 6


def test_a_queue_emptied_by_withdrawal_drains_when_the_peer_opens_its_window_not_before():
    """Withdrawing is not the peer reading: a sender waiting for the queue to drain
    hears of it only once the peer takes bytes again."""
    server, raw, sid = zero_window_stream()
    server.send_message(sid, b"x" * 200_000, key="task")
    raw.exchange()
    assert server.withdraw_message(sid, "task")
    raw.exchange()
    assert server.buffered_amount(sid) == 0
    assert not [e for e in server.take_events() + raw.server_events if isinstance(e, SendBufferDrained)]
    raw.h2.increment_flow_control_window(1, stream_id=sid)
    raw.exchange()
    drained = [e for e in server.take_events() + raw.server_events if isinstance(e, SendBufferDrained)]
    assert [e.stream_id for e in drained] == [sid]
    assert stream_data(raw, sid) == b""


def test_a_withdrawal_before_the_next_write_sends_nothing_and_drains_at_once():
    server = GrpcConnection(GrpcConfig(client_side=False))
    raw = RawClient(server)
    sid = raw.request()
    server.send_message(sid, b"x" * 10, key="task")
    assert server.withdraw_message(sid, "task")
    raw.exchange()
    drained = [e for e in server.take_events() + raw.server_events if isinstance(e, SendBufferDrained)]
    assert [e.stream_id for e in drained] == [sid]
    assert stream_data(raw, sid) == b""


def test_a_status_queued_behind_withdrawn_messages_goes_out_at_once():
    server, raw, sid = zero_window_stream()
    server.send_message(sid, b"x" * 100, key="task")
    server.send_status(sid, StatusCode.OK)
    raw.exchange()
    assert not any(isinstance(e, h2.events.StreamEnded) for e in raw.events)
    assert server.withdraw_message(sid, "task")
    raw.exchange()
    (trailers,) = [e for e in raw.events if isinstance(e, h2.events.TrailersReceived)]
    assert dict(trailers.headers)[b"grpc-status"] == b"0"
    assert stream_data(raw, sid) == b""


@FAST
@given(st.lists(st.tuples(st.sampled_from(["send", "withdraw", "open"]), st.integers(0, 150_000)),
                min_size=1, max_size=30))
def test_whatever_is_withdrawn_the_peer_gets_exactly_the_rest_whole_and_in_order(steps):
    """Sends of any size, withdrawals of any queued key and window openings of any
    size, interleaved: the peer receives every message that was not withdrawn, whole
    and in order, and withdrawal succeeds only for a message of which it got nothing."""
    server, raw, sid = zero_window_stream()
    sent: dict[int, bytes] = {}
    withdrawn: set[int] = set()
    for n, (step, size) in enumerate(steps):
        if step == "send":
            sent[n] = bytes([n % 251]) * size
            server.send_message(sid, sent[n], key=n)
        elif step == "withdraw" and sent:
            key = list(sent)[size % len(sent)]
            before = len(stream_data(raw, sid))
            if server.withdraw_message(sid, key):
                withdrawn.add(key)
            assert len(stream_data(raw, sid)) == before
        elif step == "open":
            raw.h2.increment_flow_control_window(size + 1, stream_id=sid)
        raw.exchange()
    raw.h2.increment_flow_control_window(1 << 23, stream_id=sid)
    raw.exchange()
    assert messages_in(stream_data(raw, sid)) == [m for k, m in sent.items() if k not in withdrawn]
    assert server.buffered_amount(sid) == 0


# -- GOAWAY, keepalive, pings -------------------------------------------------------


def test_graceful_goaway_serves_calls_that_raced_it_then_drains():
    """Two-phase GOAWAY: a call the client started before it saw the
    GOAWAY is served, not refused; the final GOAWAY names it as the last."""
    link = Link()
    old = link.client.start_call("/s/M", now=link.now)
    link.pump()
    started(link)
    link.server.go_away(now=link.now)
    assert link.server.next_deadline() == pytest.approx(link.now + GOAWAY_ACK_TIMEOUT)
    racing = link.client.start_call("/s/M", now=link.now)
    link.pump()
    goaways = [(g.last_stream_id, g.error_code) for g in link.take("client", GoAwayReceived)]
    assert goaways == [(2**31 - 1, 0), (racing, 0)]
    assert started(link).stream_id == racing
    assert link.server.next_deadline() is None
    assert not link.client.accepting_calls
    with pytest.raises(LocalProtocolError):
        link.client.start_call("/s/M", now=link.now)
    for sid in (old, racing):
        link.client.send_message(sid, b"still works")
        link.client.end_stream(sid)
    link.pump()
    assert [e.data for e in link.take("server", MessageReceived)] == [b"still works"] * 2
    link.server.send_status(old, StatusCode.OK)
    link.pump()
    assert not link.take("server", ConnectionTerminated)
    link.server.send_status(racing, StatusCode.OK)
    link.pump()
    assert [e.status for e in link.take("client", CallEnded)] == [StatusCode.OK] * 2
    assert link.take("server", ConnectionTerminated)[0].error_code == 0
    assert link.take("client", ConnectionTerminated)[0].error_code == 0


def test_final_goaway_without_the_ping_ack_refuses_later_streams():
    """A client that never answers the PING gets the final GOAWAY after
    GOAWAY_ACK_TIMEOUT; a stream past its last id is refused (safe to
    retry) while the older call still finishes."""
    link = Link()
    old = link.client.start_call("/s/M", now=link.now)
    link.pump()
    started(link)
    link.server.go_away(now=link.now)
    link.server.data_to_send()  # the first GOAWAY and its PING are lost
    link.now += GOAWAY_ACK_TIMEOUT
    link.server.handle_timeout(link.now)
    late = link.client.start_call("/s/M", now=link.now)
    link.pump()
    assert [g.last_stream_id for g in link.take("client", GoAwayReceived)] == [old]
    assert not link.take("server", CallStarted)
    end = ended(link)
    assert (end.stream_id, end.status, end.cause) == (late, StatusCode.UNAVAILABLE,
                                                      EndCause.REFUSED)
    link.client.end_stream(old)
    link.server.send_status(old, StatusCode.OK)
    link.pump()
    assert ended(link).status == StatusCode.OK
    assert link.take("server", ConnectionTerminated)[0].error_code == 0


def test_goaway_with_error_fails_every_call_unavailable():
    link = Link()
    sid = link.client.start_call("/s/M", now=link.now)
    link.pump()
    link.server.go_away(error_code=2, debug_data=b"bye", now=link.now)
    link.pump()
    end = ended(link)
    assert (end.stream_id, end.status, end.cause) == (sid, StatusCode.UNAVAILABLE,
                                                      EndCause.CONNECTION)
    assert link.take("client", ConnectionTerminated)[0].remote


def test_keepalive_pings_and_declares_a_silent_peer_dead():
    link = Link(client_config=GrpcConfig(client_side=True, keepalive_interval=10,
                                         keepalive_timeout=5))
    sid = link.client.start_call("/s/M", now=link.now)
    link.pump()
    assert link.client.next_deadline() == pytest.approx(10)
    link.advance(10)  # ping goes out, the server answers: alive
    assert link.client.next_deadline() == pytest.approx(20)
    link.now = 20
    link.client.handle_timeout(link.now)
    assert link.client.next_deadline() == pytest.approx(25)
    link.client.data_to_send()  # the ping is lost: the peer is silent
    events = link.client.handle_timeout(25)
    assert [type(e) for e in events] == [CallEnded, ConnectionTerminated]
    assert events[0].stream_id == sid and events[0].status == StatusCode.UNAVAILABLE


def test_ping_flood_gets_goaway_enhance_your_calm():
    link = Link()
    for _ in range(4):
        link.client.ping(link.now)
        link.pump()
    (goaway,) = link.take("client", GoAwayReceived)
    assert (goaway.error_code, goaway.debug_data) == (11, b"too_many_pings")
    assert link.take("server", ConnectionTerminated)[0].error_code == 11


def test_pings_are_not_strikes_while_the_receiver_is_sending():
    link = Link()
    sid = link.client.start_call("/s/M", now=link.now)
    link.pump()
    for _ in range(6):
        link.server.send_message(sid, b"data")
        link.client.ping(link.now)
        link.pump()
    assert not link.take("client", GoAwayReceived)
    assert len(link.take("client", PingAcknowledged)) == 6


def test_ping_ack_reports_round_trip_time():
    link = Link()
    payload = link.client.ping(link.now)
    link.now = 0.25
    link.pump()
    (ack,) = link.take("client", PingAcknowledged)
    assert ack.payload == payload and ack.round_trip_time == pytest.approx(0.25)


def test_peer_protocol_error_terminates_without_raising():
    link = Link()
    sid = link.client.start_call("/s/M", now=link.now)
    link.pump()
    # A DATA frame on stream 0 is a connection error (RFC 9113 6.1).
    events = link.client.receive_data(b"\x00\x00\x01\x00\x00\x00\x00\x00\x00X", 0)
    assert any(isinstance(e, ConnectionTerminated) for e in events)
    (end,) = [e for e in events if isinstance(e, CallEnded)]
    assert (end.stream_id, end.status) == (sid, StatusCode.UNAVAILABLE)


# -- local misuse -------------------------------------------------------------------


def test_local_misuse_raises_local_protocol_error():
    link = Link()
    with pytest.raises(LocalProtocolError):
        link.server.start_call("/s/M", now=link.now)
    sid = link.client.start_call("/s/M", now=link.now)
    with pytest.raises(LocalProtocolError):
        link.client.send_status(sid, StatusCode.OK)
    link.client.end_stream(sid)
    with pytest.raises(LocalProtocolError):
        link.client.send_message(sid, b"after half-close")
    with pytest.raises(LocalProtocolError):
        link.client.start_call("/s/M", (("grpc-status", "0"),), now=link.now)
    with pytest.raises(LocalProtocolError):
        link.client.start_call("/s/M", encoding="br", now=link.now)


# -- performance-motivated behaviour ---------------------------------------------------


def test_received_data_frames_are_never_hex_dumped(monkeypatch):
    """h2 formats repr(frame) for every received frame; hyperframe's DATA
    repr hex-encodes the whole payload (PERF-NOTES).  The machine must not
    pay for it."""
    import hyperframe.frame

    original = hyperframe.frame._raw_data_repr

    def guarded(data):
        # Small header blocks may be formatted; the 1 MiB payload may not.
        assert data is None or len(data) < 4096, "DATA payload was hex-dumped"
        return original(data)

    monkeypatch.setattr(hyperframe.frame, "_raw_data_repr", guarded)
    link = Link()
    sid = link.client.start_call("/s/M", now=link.now)
    link.client.send_message(sid, bytes(1 << 20))
    link.pump()
    assert [len(e.data) for e in link.take("server", MessageReceived)] == [1 << 20]


def test_a_burst_of_small_messages_shares_data_frames():
    server = GrpcConnection(GrpcConfig(client_side=False))
    raw = RawClient(server)
    sid = raw.request()
    raw.events.clear()
    for i in range(100):
        server.send_message(sid, b"m%03d" % i)
    raw.exchange()
    frames = [e for e in raw.events if isinstance(e, h2.events.DataReceived)]
    assert len(frames) == 1
    assert frames[0].data == b"".join(frame(b"m%03d" % i) for i in range(100))


def test_buffered_amount_counts_until_handed_to_http2():
    link = Link()
    sid = link.client.start_call("/s/M", now=link.now)
    link.client.send_message(sid, b"abc")
    assert link.client.buffered_amount(sid) == 8
    link.client.data_to_send()
    assert link.client.buffered_amount(sid) == 0


def test_streams_past_the_limit_are_refused_alone_not_the_connection():
    """RFC 9113 5.1.2: a client that opens streams before our SETTINGS
    arrive may exceed SETTINGS_MAX_CONCURRENT_STREAMS; the excess stream is
    refused (REFUSED_STREAM: never processed, safe to retry), the rest of
    the connection carries on."""
    client = GrpcConnection(GrpcConfig(client_side=True))
    server = GrpcConnection(GrpcConfig(client_side=False, max_concurrent_streams=2))
    client.initiate(0)
    server.initiate(0)
    sids = [client.start_call("/s/M", now=0) for _ in range(3)]
    for sid in sids:
        client.send_message(sid, b"x")
        client.end_stream(sid)
    server_events = server.receive_data(client.data_to_send(), 0)
    assert [e.stream_id for e in server_events if isinstance(e, CallStarted)] == sids[:2]
    client_events = client.receive_data(server.data_to_send(), 0)
    (refused,) = [e for e in client_events if isinstance(e, CallEnded)]
    assert (refused.stream_id, refused.status, refused.cause, refused.reset_code) == (
        sids[2], StatusCode.UNAVAILABLE, EndCause.REFUSED, 7)
    server.send_status(sids[0], StatusCode.OK)
    client_events = client.receive_data(server.data_to_send(), 0)
    assert [e.status for e in client_events if isinstance(e, CallEnded)] == [StatusCode.OK]
    again = client.start_call("/s/M", now=0)
    assert any(isinstance(e, CallStarted) and e.stream_id == again
               for e in server.receive_data(client.data_to_send(), 0))


@settings(max_examples=25, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=150_000), min_size=1, max_size=8),
       st.integers(min_value=1, max_value=4), st.integers(min_value=200, max_value=70_000))
def test_any_message_sizes_flow_through_small_windows_with_lagging_acks(sizes, ack_every, chunk):
    """Whatever the sizes, the wire chunking and how late the receiver
    acknowledges, every message arrives intact and in order and the sender's
    queue empties: flow control never deadlocks."""
    link = Link(client_config=GrpcConfig(client_side=True, **SMALL),
                server_config=GrpcConfig(client_side=False, **SMALL), chunk=chunk)
    sid = link.client.start_call("/s/M", now=link.now)
    messages = [bytes([i % 251]) * size for i, size in enumerate(sizes)]
    for m in messages:
        link.client.send_message(sid, m)
    link.client.end_stream(sid)
    got: list[bytes] = []
    unacked: list[MessageReceived] = []
    for _ in range(500):
        link.pump()
        new = link.take("server", MessageReceived)
        got += [e.data for e in new]
        unacked += new
        if len(unacked) >= ack_every or (unacked and not new):
            for e in unacked:
                link.server.acknowledge(sid, e.flow_controlled_length)
            unacked = []
        elif not new and link.take("server", InputEnded):
            break
    assert got == messages
    assert link.client.buffered_amount(sid) == 0


def test_acknowledging_a_batch_of_messages_reopens_the_windows_with_one_update_per_stream():
    """Acknowledgements reach h2 when bytes are next taken to write: one WINDOW_UPDATE for the
    stream (and one for the connection) per batch, however many messages were acknowledged."""
    server = GrpcConnection(GrpcConfig(client_side=False, **SMALL))
    raw = RawClient(server)
    sid = raw.request()
    raw.h2.send_data(sid, b"".join(frame(bytes(1_000)) for _ in range(50)))
    raw.exchange()
    received = [e for e in raw.server_events if isinstance(e, MessageReceived)]
    assert len(received) == 50
    assert raw.h2.local_flow_control_window(sid) == 65_535 - 50 * 1_005
    raw.events.clear()
    for e in received:
        server.acknowledge(sid, e.flow_controlled_length)
    raw.exchange()
    updates = [e for e in raw.events if isinstance(e, h2.events.WindowUpdated)]
    assert sorted(e.stream_id for e in updates) == [0, sid]
    assert raw.h2.local_flow_control_window(sid) == 65_535
