"""Per-connection budgets of the pure gRPC machine (protocol/grpc/h2_budgets.py).

Each budget is driven with raw frames from a hostile client, at least once
fed one byte at a time, and with time stepped by hand: over a budget the
connection ends with GOAWAY (ENHANCE_YOUR_CALM, FRAME_SIZE_ERROR or
FLOW_CONTROL_ERROR, naming the last stream we took) or the call with
RESOURCE_EXHAUSTED, before the offending bytes are buffered; under it,
nothing happens.  Hypothesis then checks that legitimate traffic between
two machines never trips a budget and hostile traffic always does.
"""

from __future__ import annotations

import struct

import pytest
from hpack import Encoder
from hypothesis import HealthCheck, given, settings, strategies as st

from protocol.grpc import (
    CallEnded,
    CallStarted,
    ConnectionBudgets,
    ConnectionTerminated,
    GrpcConfig,
    GrpcConnection,
    MessageReceived,
    StatusCode,
)
from protocol.grpc.h2_budgets import (
    ENHANCE_YOUR_CALM,
    FLOW_CONTROL_ERROR,
    FRAME_SIZE_ERROR,
    FrameScanner,
    TokenBucket,
    max_header_block_size,
)
from tests.support.h2_peer import ACK, END_HEADERS, END_STREAM, Peer, REQUEST, message
from tools.fuzz.drivers import (
    CONTINUATION,
    DATA,
    HEADERS,
    PING,
    RST_STREAM,
    SETTINGS,
    WINDOW_UPDATE,
    raw_frame,
)

GOAWAY = 0x7
CANCEL = 0x8
HYPO = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def wire_frames(data: bytes) -> list[tuple[int, int, int, bytes]]:
    """(type, flags, stream id, payload) of every frame in ``data``."""
    out = []
    pos = 0
    while pos + 9 <= len(data):
        length = int.from_bytes(data[pos:pos + 3], "big")
        kind, flags = data[pos + 3], data[pos + 4]
        sid = int.from_bytes(data[pos + 5:pos + 9], "big") & 0x7FFF_FFFF
        out.append((kind, flags, sid, data[pos + 9:pos + 9 + length]))
        pos += 9 + length
    return out


def goaway_of(conn: GrpcConnection) -> tuple[int, int, bytes] | None:
    """(last stream id, error code, debug data) of the GOAWAY the machine sent."""
    for kind, _, _, payload in wire_frames(conn.data_to_send()):
        if kind == GOAWAY:
            last, code = struct.unpack(">II", payload[:8])
            return last & 0x7FFF_FFFF, code, payload[8:]
    return None


# -- the token bucket -----------------------------------------------------------------


def test_a_token_bucket_allows_its_burst_then_its_rate_on_the_given_clock():
    bucket = TokenBucket(rate=2.0, burst=3)
    assert [bucket.take(10.0) for _ in range(4)] == [True, True, True, False]
    assert bucket.take(10.4) is False          # 0.8 of a token so far
    assert bucket.take(10.5) is True           # 1.0
    assert [bucket.take(100.0) for _ in range(4)] == [True, True, True, False]  # never above the burst


def test_a_token_bucket_ignores_a_clock_going_backwards():
    bucket = TokenBucket(rate=1.0, burst=1)
    assert bucket.take(5.0)
    assert not bucket.take(4.0)
    assert not bucket.take(5.5)
    assert bucket.take(6.0)


# -- 1. rapid reset --------------------------------------------------------------------


@pytest.mark.parametrize("chunk", [None, 1])
def test_streams_reset_before_they_are_answered_end_the_connection_past_the_burst(chunk):
    """Rapid reset (CVE-2023-44487): open+RST_STREAM pairs up to the burst are
    ordinary cancellations; the next one ends the connection with
    GOAWAY(ENHANCE_YOUR_CALM) naming the last stream the server took."""
    budgets = ConnectionBudgets(reset_burst=5, reset_rate=1.0)
    peer = Peer(budgets=budgets)
    wire = b""
    for _ in range(6):
        sid, frame = peer.headers()
        wire += frame + raw_frame(RST_STREAM, 0, sid, struct.pack(">I", CANCEL))
    peer.feed(wire, chunk=chunk)
    (terminated,) = peer.terminated()
    assert terminated.error_code == ENHANCE_YOUR_CALM
    assert goaway_of(peer.server) == (11, ENHANCE_YOUR_CALM, b"too many streams reset")
    cancelled = [e.stream_id for e in peer.events
                 if isinstance(e, CallEnded) and e.status == StatusCode.CANCELLED]
    assert cancelled == [1, 3, 5, 7, 9, 11]


def test_resets_at_the_allowed_rate_and_resets_of_answered_calls_never_trip():
    budgets = ConnectionBudgets(reset_burst=2, reset_rate=1.0)
    peer = Peer(budgets=budgets)
    for second in range(20):                   # one per second: the rate refills it
        sid, frame = peer.headers()
        peer.feed(frame + raw_frame(RST_STREAM, 0, sid, struct.pack(">I", CANCEL)), now=second)
    for _ in range(20):                        # answered first: not a rapid reset
        sid, frame = peer.headers()
        peer.feed(frame, now=30)
        peer.server.send_initial_metadata(sid)
        peer.server.data_to_send()
        peer.feed(raw_frame(RST_STREAM, 0, sid, struct.pack(">I", CANCEL)), now=30)
    assert peer.terminated() == []
    assert peer.server.accepting_calls


# -- 2. control frames whose reply the peer does not read ---------------------------------


@pytest.mark.parametrize("chunk", [None, 1])
def test_a_settings_flood_ends_the_connection_at_the_burst(chunk):
    peer = Peer(budgets=ConnectionBudgets(settings_burst=10, settings_rate=1.0))
    # The preface's SETTINGS took one token; nine more pass, the tenth trips.
    flood = raw_frame(SETTINGS, 0, 0, struct.pack(">HI", 0x4, 1 << 20)) * 10
    peer.feed(flood, chunk=chunk)
    (terminated,) = peer.terminated()
    assert terminated.error_code == ENHANCE_YOUR_CALM
    assert goaway_of(peer.server)[1:] == (ENHANCE_YOUR_CALM, b"too many SETTINGS frames")


def test_settings_at_the_allowed_rate_are_acknowledged_without_end():
    peer = Peer(budgets=ConnectionBudgets(settings_burst=2, settings_rate=1.0))
    peer.server.data_to_send()
    for second in range(1, 30):
        peer.feed(raw_frame(SETTINGS, 0, 0, struct.pack(">HI", 0x4, 1 << 20)), now=second)
    acks = [f for f in wire_frames(peer.server.data_to_send()) if f[0] == SETTINGS and f[1] & ACK]
    assert len(acks) == 29
    assert peer.terminated() == []


@pytest.mark.parametrize("chunk", [None, 1])
def test_pings_while_our_output_is_stalled_end_the_connection_past_the_bound(chunk):
    """A peer that does not read what we write but keeps sending frames we
    must answer (PING, SETTINGS) is flooding: past the bound, GOAWAY."""
    budgets = ConnectionBudgets(max_stalled_control_replies=20)
    peer = Peer(budgets=budgets, max_ping_strikes=0)
    pings = b"".join(raw_frame(PING, 0, 0, struct.pack(">Q", n)) for n in range(21))
    peer.feed(pings)                           # output flowing: any number is fine
    assert peer.terminated() == []
    peer.server.output_stalled()
    peer.feed(pings[:20 * 17])
    peer.server.output_drained()               # drained: the count starts again
    peer.server.output_stalled()
    peer.feed(pings, chunk=chunk)
    (terminated,) = peer.terminated()
    assert terminated.error_code == ENHANCE_YOUR_CALM
    assert goaway_of(peer.server)[2] == b"control frames sent while not reading"


# -- frames that do nothing ---------------------------------------------------------------

PRIORITY = 0x2


@pytest.mark.parametrize("name, frame", [
    ("priority", raw_frame(PRIORITY, 0, 1, struct.pack(">IB", 0, 15))),
    ("unknown type", raw_frame(0xEE, 0, 0, b"x")),
    ("empty DATA", raw_frame(DATA, 0, 1, b"")),
    ("PING ack", raw_frame(PING, ACK, 0, bytes(8))),
    ("SETTINGS ack", raw_frame(SETTINGS, ACK, 0, b"")),
    ("tiny WINDOW_UPDATE", raw_frame(WINDOW_UPDATE, 0, 0, struct.pack(">I", 1))),
])
@pytest.mark.parametrize("chunk", [None, 1])
def test_a_flood_of_frames_that_do_nothing_ends_the_connection_past_the_burst(name, frame, chunk):
    peer = Peer(budgets=ConnectionBudgets(idle_frame_burst=30, idle_frame_rate=1.0))
    sid, headers = peer.headers()
    peer.feed(headers)
    peer.feed(frame * 29, chunk=chunk)
    assert peer.terminated() == []
    peer.feed(frame * 2, chunk=chunk)
    (terminated,) = peer.terminated()
    assert terminated.error_code == ENHANCE_YOUR_CALM
    assert goaway_of(peer.server)[2] == b"too many frames that do nothing"


def test_frames_that_do_nothing_at_the_allowed_rate_and_ends_of_stream_never_trip():
    peer = Peer(budgets=ConnectionBudgets(idle_frame_burst=5, idle_frame_rate=1.0))
    for second in range(1, 40):
        sid, headers = peer.headers()
        # An empty DATA frame that ends the stream is a half-close, not idle.
        peer.feed(headers + raw_frame(DATA, END_STREAM, sid, b"")
                  + raw_frame(PRIORITY, 0, sid, struct.pack(">IB", 0, 15)), now=second)
        peer.server.send_status(sid, StatusCode.OK)
        peer.server.data_to_send()
    assert peer.terminated() == []


# -- 3. frame sizes for non-DATA frames ------------------------------------------------------


@pytest.mark.parametrize("kind, length, code", [
    (HEADERS, 64 * 1024 + 1, FRAME_SIZE_ERROR),
    (CONTINUATION, 1 << 20, FRAME_SIZE_ERROR),
    (0xEE, 16 * 1024 * 1024 - 1, FRAME_SIZE_ERROR),      # unknown type
    (SETTINGS, 300, FRAME_SIZE_ERROR),
    (DATA, 4 * 1024 * 1024 + 1, FLOW_CONTROL_ERROR),     # larger than the stream window
])
def test_an_oversized_frame_is_refused_when_its_header_arrives(kind, length, code):
    """Only the 9-byte header is sent, one byte at a time: the connection ends
    at its last byte, without waiting for (or buffering) the payload, although
    the advertised SETTINGS_MAX_FRAME_SIZE (16 MiB) would allow it."""
    peer = Peer()
    sid, frame = peer.headers()
    peer.feed(frame)
    header = struct.pack(">I", length)[1:] + bytes([kind, 0]) + struct.pack(">I", sid)
    for byte in header[:-1]:
        peer.feed(bytes([byte]))
        assert peer.terminated() == []
    peer.feed(header[-1:])
    (terminated,) = peer.terminated()
    assert terminated.error_code == code
    assert goaway_of(peer.server)[:2] == (sid, code)
    assert len(peer.server._h2.incoming_buffer._data) < 9


def test_frames_of_the_allowed_sizes_pass():
    """A 64 KiB unknown frame (ignored), a full-size DATA frame and a header
    block just under its bound go through."""
    peer = Peer(max_receive_message_length=8 * 1024 * 1024)
    sid, frame = peer.headers()
    body = message(b"x" * (4 * 1024 * 1024 - 5))
    peer.feed(raw_frame(0xEE, 0, 0, bytes(64 * 1024)) + frame + raw_frame(DATA, 0, sid, body))
    assert [len(e.data) for e in peer.events if isinstance(e, MessageReceived)] == [len(body) - 5]
    assert peer.terminated() == []


# -- 4. header-block bytes across HEADERS + CONTINUATION -------------------------------------


@pytest.mark.parametrize("chunk", [None, 1, 4096])
def test_a_header_block_ends_the_connection_once_its_bytes_pass_the_list_limit(chunk):
    """HEADERS without END_HEADERS, then CONTINUATION frames: the bytes are
    summed as frame headers arrive and the frame that crosses the bound is
    refused before its payload reaches h2."""
    peer = Peer(max_header_list_size=4096)
    bound = max_header_block_size(4096)
    piece = bytes(4000)
    wire = raw_frame(HEADERS, 0, 1, piece)
    frames_before_trip = bound // len(piece)
    wire += raw_frame(CONTINUATION, 0, 1, piece) * (frames_before_trip + 5)
    peer.feed(wire, chunk=chunk)
    (terminated,) = peer.terminated()
    assert terminated.error_code == ENHANCE_YOUR_CALM
    assert b"header block over" in goaway_of(peer.server)[2]
    assert peer.server._state.scanner._block <= bound + len(piece)
    assert not peer.server.has_pending_input


def test_a_header_block_within_the_limit_in_continuation_frames_starts_the_call():
    peer = Peer()
    block = peer.encoder.encode(REQUEST + [(b"x-meta", b"v" * 10_000)])
    parts = [block[i:i + 1000] for i in range(0, len(block), 1000)]
    wire = raw_frame(HEADERS, 0, 1, parts[0])
    wire += b"".join(raw_frame(CONTINUATION, 0, 1, p) for p in parts[1:-1])
    wire += raw_frame(CONTINUATION, END_HEADERS, 1, parts[-1])
    peer.feed(wire, chunk=7)
    assert [e.stream_id for e in peer.events if isinstance(e, CallStarted)] == [1]


def test_the_block_bound_admits_any_list_within_the_limit_under_huffman():
    """The worst HPACK Huffman code is 30 bits: a list of the limit's size
    made of such bytes still fits the block bound."""
    worst = b"\\" * 1000                       # '\\' is a 19-bit code
    block = Encoder().encode([(b"x", worst)])
    assert len(block) <= max_header_block_size(1000 + 1 + 32)


# -- 5. partial-message bytes ----------------------------------------------------------------


@pytest.mark.parametrize("chunk, scale", [(None, 100), (1000, 100), (1, 1)])
def test_partial_messages_over_the_budget_end_the_largest_hoarder(chunk, scale):
    """Streams sending parts of large messages, obeying flow control: once the
    parts held pass the budget, the call holding most ends RESOURCE_EXHAUSTED
    (RST_STREAM), the others continue, and what is held stays bounded."""
    budget = 3000 * scale
    peer = Peer(max_receive_message_length=1 << 20, max_partial_message_bytes=budget)
    wire = b""
    sids = []
    for size in (1000 * scale, 1200 * scale, 900 * scale):
        sid, frame = peer.headers()
        sids.append(sid)
        wire += frame + raw_frame(DATA, 0, sid, struct.pack(">BI", 0, 1 << 20) + bytes(size))
    peer.feed(wire, chunk=chunk)
    assert peer.terminated() == []
    assert peer.server._state.partial_total <= budget
    ended = [(e.stream_id, e.status) for e in peer.events if isinstance(e, CallEnded)]
    assert ended == [(sids[1], StatusCode.RESOURCE_EXHAUSTED)]
    out = wire_frames(peer.server.data_to_send())
    assert (RST_STREAM, sids[1]) in [(kind, sid) for kind, _, sid, _ in out]
    # The others still complete their messages.
    peer.feed(raw_frame(DATA, 0, sids[0], bytes((1 << 20) - 1000 * scale)))
    assert [e.stream_id for e in peer.events if isinstance(e, MessageReceived)] == [sids[0]]
    assert peer.server._state.partial_total == 900 * scale


def test_one_largest_message_always_fits_the_default_budget():
    config = GrpcConfig(client_side=False, max_receive_message_length=33 << 20)
    assert config.partial_message_budget() >= (33 << 20) + 5
    assert GrpcConfig(client_side=False).partial_message_budget() == 16 << 20


# -- 6. unauthenticated connections -------------------------------------------------------


def test_an_unauthenticated_connection_gets_small_windows_few_streams_and_small_messages():
    peer = Peer(require_authentication=True, max_receive_message_length=1 << 20)
    sid, frame = peer.headers()
    body = message(bytes(200_000))
    # Within the small window a message spanning frames may grow to one
    # window; a peer acknowledged further that keeps going is cut off.
    peer.feed(frame + raw_frame(DATA, 0, sid, body[:60_000]))
    assert [e for e in peer.events if isinstance(e, CallEnded)] == []
    peer.feed(raw_frame(DATA, 0, sid, body[60_000:120_000]))
    assert [(e.stream_id, e.status) for e in peer.events if isinstance(e, CallEnded)] == \
        [(sid, StatusCode.RESOURCE_EXHAUSTED)]
    # More streams than the few allowed are refused.
    wire = b"".join(peer.headers()[1] for _ in range(5))
    peer.feed(wire)
    out = wire_frames(peer.server.data_to_send())
    refused = [sid for kind, _, sid, payload in out
               if kind == RST_STREAM and payload == struct.pack(">I", 0x7)]
    assert refused == [11]
    # A DATA frame larger than the unauthenticated window is refused outright.
    peer.feed(raw_frame(DATA, 0, 3, bytes(65_536)))
    assert peer.terminated()[0].error_code == FLOW_CONTROL_ERROR


def test_an_unauthenticated_connection_has_a_tenth_of_the_reset_and_settings_budgets():
    peer = Peer(require_authentication=True)
    peer.feed(_rapid_reset(peer, 21))
    assert peer.terminated()[0].error_code == ENHANCE_YOUR_CALM
    peer = Peer(require_authentication=True)
    sid, frame = peer.headers()
    peer.feed(frame)
    peer.server.authenticate()
    peer.feed(_rapid_reset(peer, 150))          # within the authenticated burst of 200
    peer.feed(raw_frame(SETTINGS, 0, 0, b"") * 50)
    assert peer.terminated() == []


def test_authenticate_lifts_the_limits_with_new_settings_and_a_window_update():
    client = GrpcConnection(GrpcConfig(client_side=True))
    server = GrpcConnection(GrpcConfig(client_side=False, require_authentication=True,
                                       max_receive_message_length=4 << 20))
    client.initiate(0)
    server.initiate(0)

    def link() -> list[object]:
        got: list[object] = []
        for _ in range(20):
            a, b = client.data_to_send(), server.data_to_send()
            if not a and not b:
                break
            got += server.receive_data(a, 0)
            client.receive_data(b, 0)
        return got

    link()
    assert client.max_concurrent_calls == 4
    sid = client.start_call("/s/M", now=0)
    (started,) = [e for e in link() if isinstance(e, CallStarted)]
    assert not server.authenticated
    server.authenticate()
    link()
    assert server.authenticated and client.max_concurrent_calls == 1000
    client.send_message(sid, bytes(3 << 20))
    client.end_stream(sid)
    got = link()
    assert [len(e.data) for e in got if isinstance(e, MessageReceived)] == [3 << 20]
    assert not [e for e in got if isinstance(e, (CallEnded, ConnectionTerminated))]
    assert started.stream_id == sid


# -- 7. bounded work per receive ---------------------------------------------------------


@pytest.mark.parametrize("chunk", [None, 1])
def test_at_most_the_frame_budget_is_processed_per_receive_and_the_rest_waits(chunk):
    peer = Peer(budgets=ConnectionBudgets(max_frames_per_receive=10))
    frames = b"".join(peer.headers(end_stream=True)[1] for _ in range(25))
    server = peer.server
    if chunk is None:
        first = server.receive_data(frames, 0)
        assert len([e for e in first if isinstance(e, CallStarted)]) == 10
        assert server.has_pending_input
        second = server.receive_pending(0)
        assert len([e for e in second if isinstance(e, CallStarted)]) == 10
        third = server.receive_pending(0)
        assert len([e for e in third if isinstance(e, CallStarted)]) == 5
        assert not server.has_pending_input
    else:
        peer.feed(frames, chunk=1)
        assert len([e for e in peer.events if isinstance(e, CallStarted)]) == 25


def test_the_scanner_splits_only_at_frame_boundaries():
    scanner = FrameScanner(ConnectionBudgets(max_frames_per_receive=2), preface_size=0,
                           max_data_frame_size=1 << 20, max_header_list_size=16_384)
    wire = raw_frame(WINDOW_UPDATE, 0, 0, struct.pack(">I", 1)) * 5
    assert scanner.scan(wire, 0) == (26, None)
    assert scanner.scan(wire[26:], 0) == (26, None)
    assert scanner.scan(wire[52:], 0) == (13, None)


# -- Hypothesis: legitimate traffic never trips, hostile traffic always does ----------------


@pytest.mark.slow
@HYPO
@given(st.lists(st.tuples(st.integers(0, 300_000), st.booleans()), min_size=1, max_size=8),
       st.integers(1, 70_000), st.booleans())
def test_legitimate_traffic_never_trips_a_budget(calls, chunk, authenticate):
    """Calls with messages of any size up to the limit, some cancelled once
    answered, PINGs, through a link cutting the bytes anywhere: no budget trips."""
    client = GrpcConnection(GrpcConfig(client_side=True))
    server = GrpcConnection(GrpcConfig(client_side=False, require_authentication=authenticate,
                                       max_receive_message_length=1 << 20,
                                       budgets=ConnectionBudgets(max_frames_per_receive=16)))
    client.initiate(0)
    server.initiate(0)
    server_events: list[object] = []
    now = 0.0

    def link() -> None:
        for _ in range(200):
            a, b = client.data_to_send(), server.data_to_send()
            if not a and not b and not server.has_pending_input:
                return
            for i in range(0, len(a), chunk):
                got = server.receive_data(a[i:i + chunk], now)
                while server.has_pending_input:
                    got += server.receive_pending(now)
                for event in got:
                    server_events.append(event)
                    if isinstance(event, CallStarted):
                        server.authenticate()
                    if isinstance(event, MessageReceived):
                        server.acknowledge(event.stream_id, event.flow_controlled_length)
                        server.send_message(event.stream_id, b"ok")
                    if isinstance(event, CallEnded):
                        pass
            for event in client.receive_data(b, now):
                if isinstance(event, MessageReceived):
                    client.acknowledge(event.stream_id, event.flow_controlled_length)
        raise AssertionError("link never went quiet")

    link()
    for size, cancel in calls:
        now += 0.01
        sid = client.start_call("/s/M", now=now)
        client.send_message(sid, bytes(size))
        client.ping(now)
        link()
        if cancel:
            client.cancel(sid)
        else:
            client.end_stream(sid)
        link()
    assert not [e for e in server_events if isinstance(e, ConnectionTerminated)]
    assert not [e for e in server_events
                if isinstance(e, CallEnded) and e.status == StatusCode.RESOURCE_EXHAUSTED]
    assert server.accepting_calls


def _rapid_reset(peer: Peer, n: int) -> bytes:
    wire = b""
    for _ in range(n):
        sid, frame = peer.headers()
        wire += frame + raw_frame(RST_STREAM, 0, sid, struct.pack(">I", CANCEL))
    return wire


HOSTILE = {
    "rapid reset": lambda peer, n: _rapid_reset(peer, 21 + n),
    "settings flood": lambda peer, n: raw_frame(SETTINGS, 0, 0, b"") * (20 + n),
    "oversized headers": lambda peer, n: raw_frame(HEADERS, 0, 1, bytes(64 * 1024 + 1 + n)),
    "oversized settings": lambda peer, n: raw_frame(SETTINGS, 0, 0, bytes(6 * (43 + n))),
    "endless continuation": lambda peer, n: raw_frame(HEADERS, 0, 1, bytes(1000))
    + raw_frame(CONTINUATION, 0, 1, bytes(16_000)) * (4 + n),
    "priority flood": lambda peer, n: raw_frame(0x2, 0, 1, struct.pack(">IB", 0, 1)) * (1001 + n),
    "data beyond the window": lambda peer, n: peer.headers()[1]
    + raw_frame(DATA, 0, 1, bytes(4 * 1024 * 1024 + 1 + n)),
}


@HYPO
@given(st.sampled_from(sorted(HOSTILE)), st.integers(0, 30), st.integers(1, 5000),
       st.binary(max_size=100))
def test_hostile_traffic_always_trips_its_budget(name, extra, chunk, before):
    """Each flood or oversized frame, after any number of harmless bytes and
    cut anywhere, ends the connection with a GOAWAY carrying an error."""
    peer = Peer(budgets=ConnectionBudgets(reset_burst=20, settings_burst=20),
                max_header_list_size=16_384)
    harmless = raw_frame(0xEE, 0, 0, before)
    peer.feed(harmless + HOSTILE[name](peer, extra), chunk=chunk)
    (terminated,) = peer.terminated()
    assert terminated.error_code in {ENHANCE_YOUR_CALM, FRAME_SIZE_ERROR, FLOW_CONTROL_ERROR}
    assert goaway_of(peer.server)[1] == terminated.error_code
