"""The large-message path of infx's gRPC stack: DATA frames queued by
reference (``TunedH2Connection.send_data_parts``), received with one copy
(``TunedFrameBuffer``), reassembled without intermediate copies, and written
with one gathering ``sendmsg`` (``infx.transport.writes.send_gathered``).

These lean on h2 internals, so each is held to h2's own behaviour: the
same wire bytes, windows, stream states and errors as ``send_data`` and
h2's ``FrameBuffer``, for Hypothesis-chosen sizes and cuts; then whole
messages through two machines, and against grpcio in both directions over
real loopback sockets (the machine driven by hand, no reactor).
"""

from __future__ import annotations

import hashlib
import json
import select
import socket
import struct
import threading
from collections.abc import Callable, Iterator
from concurrent import futures

import grpc
import h2.config
import h2.connection
import h2.exceptions
import h2.frame_buffer
import h2.settings
import pytest
from hyperframe.frame import DataFrame, Frame, HeadersFrame, PingFrame, WindowUpdateFrame
from hypothesis import example, given, settings, strategies as st

from infx.transport.writes import send_gathered
from protocol.grpc import (
    CallEnded,
    GrpcConfig,
    GrpcConnection,
    InputEnded,
    MessageReceived,
    StatusCode,
)
from protocol.grpc.h2_tuned import TunedFrameBuffer, TunedH2Connection

KiB = 1024
MiB = 1024 * KiB
BIG = 64 * KiB  # the direct path's threshold in protocol.grpc.h2_tuned
FAST = settings(max_examples=25, deadline=None)
SLOW = settings(max_examples=6, deadline=None)

#: Sizes that matter: empty, tiny, around the direct-path threshold and the
#: default 16 KiB frame / 64 KiB window, and large.
SIZES = st.one_of(
    st.sampled_from([0, 1, 5, 16 * KiB - 5, BIG - 6, BIG - 5, BIG, BIG + 1, MiB]),
    st.integers(0, 300 * KiB),
)


def payload(size: int, seed: int = 0) -> bytes:
    """Distinct content per (size, seed), so that misplaced bytes show."""
    block = hashlib.sha256(b"%d/%d" % (size, seed)).digest()
    return (block * (size // len(block) + 1))[:size]


# ---------------------------------------------------------------------------
# send_data_parts against h2's send_data


def h2_pair() -> tuple[TunedH2Connection, h2.connection.H2Connection]:
    """Our h2 client with one open stream, against a plain h2 server that
    grants large windows and frames."""
    client = TunedH2Connection(h2.config.H2Configuration(client_side=True, header_encoding=None))
    server = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False))
    client.initiate_connection()
    server.initiate_connection()
    server.update_settings({
        h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 8 * MiB,
        h2.settings.SettingCodes.MAX_FRAME_SIZE: 2**24 - 1,
    })
    server.increment_flow_control_window(16 * MiB)
    for _ in range(3):
        server.receive_data(client.data_to_send())
        client.receive_data(server.data_to_send())
    client.send_headers(1, [(b":method", b"POST"), (b":scheme", b"http"),
                            (b":path", b"/t.S/M"), (b":authority", b"x")])
    server.receive_data(client.data_to_send())
    return client, server


def h2_state(conn: h2.connection.H2Connection, stream_id: int = 1) -> tuple[object, ...]:
    stream = conn.streams.get(stream_id)
    return (conn.outbound_flow_control_window, conn.state_machine.state,
            None if stream is None else stream.outbound_flow_control_window,
            None if stream is None else stream.state_machine.state)


def cut(data: bytes, points: list[int]) -> list[bytes]:
    """``data`` cut at the given points (taken modulo its length)."""
    if not data:
        return []
    edges = sorted({0, len(data), *(p % len(data) for p in points)})
    return [data[a:b] for a, b in zip(edges, edges[1:])]


@FAST
@given(sizes=st.lists(SIZES, min_size=1, max_size=4), points=st.lists(st.integers(0, 2**20)))
def test_gathered_frames_leave_h2_as_send_data_would(sizes: list[int], points: list[int]) -> None:
    """For any payloads, however they are split into parts: the same wire
    bytes, the same connection and stream windows and states as h2's own
    send_data, including when END_STREAM follows through h2."""
    ours, _ = h2_pair()
    reference, _ = h2_pair()
    for index, size in enumerate(sizes):
        data = payload(size, index)
        parts: list[bytes | memoryview] = [memoryview(p) for p in cut(data, points)] or [b""]
        ours.send_data_parts(1, parts, size)
        reference.send_data(1, data)
        assert h2_state(ours) == h2_state(reference)
    ours.end_stream(1)
    reference.end_stream(1)
    assert h2_state(ours) == h2_state(reference)
    assert b"".join(ours.buffers_to_send()) == reference.data_to_send()


def test_gathered_frames_stay_in_order_with_h2s_own_frames() -> None:
    """Frames queued through h2 before and after a gathered frame come out
    around it, whether read as buffers or as h2's data_to_send()."""
    for read in ("buffers", "bytes"):
        ours, _ = h2_pair()
        reference, _ = h2_pair()
        data = payload(200 * KiB)
        for conn in (ours, reference):
            conn.ping(b"12345678")
        ours.send_data_parts(1, [data], len(data))
        reference.send_data(1, data)
        for conn in (ours, reference):
            conn.send_headers(1, [(b"grpc-status", b"0")], end_stream=True)
        out = b"".join(ours.buffers_to_send()) if read == "buffers" else ours.data_to_send()
        assert out == reference.data_to_send()
        assert ours.data_to_send() == b""


def test_gathered_frame_refers_to_the_payload_instead_of_copying_it() -> None:
    ours, _ = h2_pair()
    data = payload(MiB)
    ours.send_data_parts(1, [b"\0\0\x10\0\0", data], MiB + 5)
    buffers = ours.buffers_to_send()
    assert any(buffer is data for buffer in buffers)
    assert ours.buffers_to_send() == []


@pytest.mark.parametrize("case", ["over-window", "over-frame-size", "half-closed", "unknown-stream"])
def test_gathered_frames_are_refused_as_send_data_refuses_them(case: str) -> None:
    """Misuse raises what send_data raises, debits nothing, and leaves h2
    in the state send_data leaves it in (h2 closes a stream on an invalid
    transition)."""
    outcomes = []
    for send in ("parts", "h2"):
        client, server = h2_pair()
        size, stream_id = 1000, 1
        if case == "over-window":
            size = client.local_flow_control_window(1) + 1
        elif case == "over-frame-size":
            server.update_settings({h2.settings.SettingCodes.MAX_FRAME_SIZE: 16 * KiB})
            client.receive_data(server.data_to_send())
            size = 16 * KiB + 1
        elif case == "half-closed":
            client.end_stream(1)
        else:
            stream_id = 3
        client.data_to_send()
        before = h2_state(client, stream_id)
        data = bytes(size)
        with pytest.raises(h2.exceptions.ProtocolError) as raised:
            if send == "parts":
                client.send_data_parts(stream_id, [data], size)
            else:
                client.send_data(stream_id, data)
        after = h2_state(client, stream_id)
        assert (after[0], after[2]) == (before[0], before[2])  # windows
        outcomes.append((type(raised.value), after, client.data_to_send()))
    assert outcomes[0] == outcomes[1]


# ---------------------------------------------------------------------------
# TunedFrameBuffer against h2's FrameBuffer


FRAMES = st.lists(st.one_of(
    st.tuples(st.just("data"), st.integers(1, 7), SIZES, st.booleans()),
    st.tuples(st.just("padded"), st.integers(1, 7), st.integers(0, 100 * KiB), st.booleans()),
    st.tuples(st.just("window"), st.integers(0, 7), st.integers(1, 1000), st.booleans()),
    st.tuples(st.just("ping"), st.just(0), st.just(0), st.booleans()),
    st.tuples(st.just("headers"), st.integers(1, 7), st.integers(0, 100), st.booleans()),
), min_size=1, max_size=6)


def build(kind: str, stream_id: int, size: int, flag: bool) -> Frame:
    frame: Frame
    if kind in ("data", "padded"):
        frame = DataFrame(stream_id, payload(size, stream_id))
        if flag:
            frame.flags.add("END_STREAM")
        if kind == "padded":
            frame.flags.add("PADDED")
            frame.pad_length = size % 256
    elif kind == "window":
        frame = WindowUpdateFrame(stream_id, window_increment=size)
    elif kind == "ping":
        frame = PingFrame(0, opaque_data=b"12345678")
        if flag:
            frame.flags.add("ACK")
    else:
        frame = HeadersFrame(stream_id, payload(size))
        frame.flags.add("END_HEADERS")
    return frame


def parsed(buffer: h2.frame_buffer.FrameBuffer, chunks: list[bytes]) -> list[tuple[object, ...]]:
    buffer.max_frame_size = 2**24 - 1
    out: list[tuple[object, ...]] = []
    for chunk in chunks:
        buffer.add_data(chunk)
        for frame in buffer:
            out.append((type(frame).__name__, frame.stream_id, sorted(frame.flags),
                        getattr(frame, "data", None), getattr(frame, "body_len", None),
                        getattr(frame, "pad_length", None),
                        getattr(frame, "window_increment", None)))
    return out


@FAST
@given(frames=FRAMES, points=st.lists(st.integers(0, 2**21), max_size=12),
       server=st.booleans())
@example(frames=[("window", 0, 5, False), ("data", 1, MiB, False), ("ping", 0, 0, True)],
         points=[20, 100, 500_000, MiB], server=True)
def test_frame_buffer_yields_what_h2s_yields_however_reads_are_cut(
        frames: list[tuple[str, int, int, bool]], points: list[int], server: bool) -> None:
    """Frames of every kind and size, read in any pieces (with the client
    preface first on the server side): the same frames, fields and data."""
    wire = b"".join(build(*spec).serialize() for spec in frames)
    if server:
        wire = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + wire
    chunks = cut(wire, points)
    expected = parsed(h2.frame_buffer.FrameBuffer(server=server), chunks)
    assert parsed(TunedFrameBuffer(server=server), chunks) == expected
    assert len(expected) == len(frames)


@pytest.mark.parametrize("wire", [
    # Longer than the frame size limit.
    struct.pack(">HBBBL", (2 * BIG + 1) >> 8, (2 * BIG + 1) & 0xFF, 0, 0, 1) + bytes(2 * BIG + 1),
    # A large DATA frame where a CONTINUATION must come.
    HeadersFrame(1, b"x").serialize() + DataFrame(1, bytes(BIG)).serialize(),
    # A large DATA frame on stream 0.
    struct.pack(">HBBBL", BIG >> 8, BIG & 0xFF, 0, 0, 0) + bytes(BIG),
], ids=["too-long", "inside-a-header-block", "stream-0"])
def test_frame_buffer_rejects_what_h2s_rejects(wire: bytes) -> None:
    errors = []
    for buffer in (h2.frame_buffer.FrameBuffer(), TunedFrameBuffer()):
        buffer.max_frame_size = 2 * BIG
        buffer.add_data(wire)
        with pytest.raises(h2.exceptions.ProtocolError) as raised:
            list(buffer)
        errors.append(type(raised.value))
    assert errors[0] is errors[1]


def test_frame_buffer_rejects_a_too_long_data_frame_once_its_header_is_in() -> None:
    """h2 waits for the whole frame before checking its length; the large
    DATA path checks at the header, so an oversized frame is not buffered."""
    buffer = TunedFrameBuffer()
    buffer.max_frame_size = 2 * BIG
    buffer.add_data(struct.pack(">HBBBL", 0xFFFF, 0xFF, 0, 0, 1) + bytes(BIG))
    with pytest.raises(h2.exceptions.FrameTooLargeError):
        list(buffer)


# ---------------------------------------------------------------------------
# Whole messages through two machines


@FAST
@given(sizes=st.lists(SIZES, min_size=1, max_size=5),
       window=st.sampled_from([65_535, 100_000, 4 * MiB]),
       frame_size=st.sampled_from([16 * KiB, 2**24 - 1]),
       read=st.sampled_from([7_000, 65_536, MiB]))
@example(sizes=[MiB, 3, BIG, MiB], window=100_000, frame_size=2**24 - 1, read=65_536)
@example(sizes=[MiB, 3, BIG, MiB], window=4 * MiB, frame_size=2**24 - 1, read=MiB)
def test_messages_of_any_size_cross_two_machines_intact(
        sizes: list[int], window: int, frame_size: int, read: int) -> None:
    """Client-streamed messages of any size arrive whole and in order,
    through small and large windows and frame limits and any read size;
    the receiver acknowledges as it consumes, so every window reopens."""
    client = GrpcConnection(GrpcConfig(client_side=True))
    server = GrpcConnection(GrpcConfig(client_side=False, initial_window_size=window,
                                       max_inbound_frame_size=frame_size))
    client.initiate(0.0)
    server.initiate(0.0)
    stream_id = client.start_call("/t.S/Sink", now=0.0)
    for index, size in enumerate(sizes):
        client.send_message(stream_id, payload(size, index))
    client.end_stream(stream_id)
    received: list[bytes] = []
    ended = False
    for _ in range(10_000):
        a = b"".join(client.buffers_to_send())
        b = server.data_to_send()
        client.take_events()
        if not a and not b:
            break
        for i in range(0, len(a), read):
            for event in server.receive_data(a[i:i + read], 0.0):
                if isinstance(event, MessageReceived):
                    received.append(event.data)
                    server.acknowledge(event.stream_id, event.flow_controlled_length)
                elif isinstance(event, InputEnded):
                    ended = True
        client.receive_data(b, 0.0)
    assert [len(m) for m in received] == sizes
    assert received == [payload(size, index) for index, size in enumerate(sizes)]
    assert ended


def test_a_large_message_is_handed_to_the_wire_uncopied() -> None:
    client = GrpcConnection(GrpcConfig(client_side=True))
    client.initiate(0.0)
    stream_id = client.start_call("/t.S/Sink", now=0.0)
    data = payload(MiB)
    client.send_message(stream_id, data)
    assert client.buffered_amount(stream_id) == MiB + 5
    # Before the peer's SETTINGS only 64 KiB may go; then the rest.
    first = client.buffers_to_send()
    assert client.buffered_amount(stream_id) > 0
    server = GrpcConnection(GrpcConfig(client_side=False))
    server.initiate(0.0)
    server.receive_data(b"".join(first), 0.0)
    client.receive_data(server.data_to_send(), 0.0)
    rest = client.buffers_to_send()
    assert client.buffered_amount(stream_id) == 0
    assert any(isinstance(b, memoryview) and b.obj is data for b in rest)


def test_a_large_payload_travels_as_a_data_frame_of_its_own() -> None:
    """Its prefix goes in the frame before and what follows in the frame
    after, so that the receiver can take the frame's data as the message
    without copying it."""
    client = GrpcConnection(GrpcConfig(client_side=True))
    server = GrpcConnection(GrpcConfig(client_side=False))
    client.initiate(0.0)
    server.initiate(0.0)
    server.receive_data(b"".join(client.buffers_to_send()), 0.0)
    client.receive_data(server.data_to_send(), 0.0)
    stream_id = client.start_call("/t.S/Sink", now=0.0)
    big = payload(3 * BIG)
    for message in (b"a", big, b"b", big):
        client.send_message(stream_id, message)
    wire = b"".join(client.buffers_to_send())
    frames = h2.frame_buffer.FrameBuffer()
    frames.max_frame_size = 2**24 - 1
    frames.add_data(wire)
    data = [f.data for f in frames if isinstance(f, DataFrame)]
    assert data == [b"\0\0\0\0\x01a" + struct.pack(">BI", 0, len(big)), big,
                    b"\0\0\0\0\x01b" + struct.pack(">BI", 0, len(big)), big]


# ---------------------------------------------------------------------------
# The gathering write


@FAST
@given(sizes=st.lists(st.integers(0, 200 * KiB), min_size=1, max_size=8),
       views=st.booleans())
def test_send_gathered_returns_in_order_what_the_socket_did_not_take(
        sizes: list[int], views: bool) -> None:
    """What the peer reads, followed by what is returned, is exactly the
    buffers in order, whether the socket takes all, some or none of it."""
    a, b = socket.socketpair()
    with a, b:
        a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 32 * KiB)
        a.setblocking(False)
        b.setblocking(False)
        buffers: list[bytes | memoryview] = [
            memoryview(payload(size, i)) if views else payload(size, i)
            for i, size in enumerate(sizes)]
        expected = b"".join(buffers)
        rest = send_gathered(a, list(buffers))
        received = bytearray()
        while True:
            try:
                chunk = b.recv(MiB)
            except BlockingIOError:
                break
            received += chunk
        assert bytes(received) + b"".join(rest) == expected
        assert all(len(r) for r in rest[:1])


def test_send_gathered_leaves_everything_to_twisted_on_an_error() -> None:
    a, b = socket.socketpair()
    b.close()
    with a:
        a.setblocking(False)
        buffers: list[bytes | memoryview] = [b"abc", payload(BIG)]
        assert send_gathered(a, list(buffers)) == buffers


# ---------------------------------------------------------------------------
# Against grpcio, over loopback, the machine driven by hand


def pump(sock: socket.socket, conn: GrpcConnection, handle: Callable[[object], None],
         done: Callable[[], bool]) -> None:
    """Shuttle bytes between a machine and a non-blocking socket until
    ``done()``; a peer silent for 20 s fails the test."""
    sock.setblocking(False)
    pending: list[bytes | memoryview] = []
    while not done():
        pending += conn.buffers_to_send()
        for event in conn.take_events():
            handle(event)
        readable, writable, _ = select.select([sock], [sock] if pending else [], [], 20.0)
        assert readable or writable, "peer stalled"
        if writable:
            pending = send_gathered(sock, pending)
        if readable:
            data = sock.recv(MiB)
            if not data:
                return
            for event in conn.receive_data(data, 0.0):
                handle(event)


def digest(messages: Iterator[bytes]) -> bytes:
    return json.dumps([[len(m), hashlib.sha256(m).hexdigest()] for m in messages]).encode()


@pytest.fixture(scope="module")
def grpcio_sink() -> Iterator[int]:
    """A grpcio server whose client-streaming /t.S/Sink answers with the
    length and hash of each message."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("t.S", {
        "Sink": grpc.stream_unary_rpc_method_handler(lambda requests, context: digest(requests)),
    })])
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield port
    server.stop(grace=None)


@SLOW
@given(sizes=st.lists(SIZES, min_size=1, max_size=4))
@example(sizes=[MiB, 5, BIG + 1, 0])
def test_grpcio_server_receives_infx_large_frames_intact(grpcio_sink: int, sizes: list[int]) -> None:
    messages = [payload(size, i) for i, size in enumerate(sizes)]
    conn = GrpcConnection(GrpcConfig(client_side=True))
    conn.initiate(0.0)
    stream_id = conn.start_call("/t.S/Sink", now=0.0)
    for message in messages:
        conn.send_message(stream_id, message)
    conn.end_stream(stream_id)
    replies: list[bytes] = []
    ends: list[CallEnded] = []

    def handle(event: object) -> None:
        if isinstance(event, MessageReceived):
            replies.append(event.data)
        elif isinstance(event, CallEnded):
            ends.append(event)

    with socket.create_connection(("127.0.0.1", grpcio_sink)) as sock:
        pump(sock, conn, handle, lambda: bool(ends))
    assert ends[0].status == StatusCode.OK, ends[0].message
    assert replies == [digest(iter(messages))]


@SLOW
@given(sizes=st.lists(SIZES, min_size=1, max_size=4))
@example(sizes=[MiB, 5, BIG + 1, 0])
def test_grpcio_client_gets_infx_large_frames_back_intact(sizes: list[int]) -> None:
    """grpcio streams messages to an infx server machine, which echoes each
    back: large frames received from grpcio and sent to it."""
    messages = [payload(size, i) for i, size in enumerate(sizes)]
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]
        result: list[object] = []

        def call() -> None:
            try:
                with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
                    echo = channel.stream_stream("/t.S/Echo")
                    result.extend(echo(iter(messages), timeout=30))
            except grpc.RpcError as exc:
                result.append(exc)

        client = threading.Thread(target=call, daemon=True)
        client.start()
        listener.settimeout(20.0)
        sock, _ = listener.accept()
        conn = GrpcConnection(GrpcConfig(client_side=False))
        conn.initiate(0.0)

        def handle(event: object) -> None:
            if isinstance(event, MessageReceived):
                conn.acknowledge(event.stream_id, event.flow_controlled_length)
                conn.send_message(event.stream_id, event.data)
            elif isinstance(event, InputEnded):
                conn.send_status(event.stream_id, StatusCode.OK)

        with sock:
            # Until grpcio has its status and closes the connection.
            pump(sock, conn, handle, lambda: not client.is_alive())
            client.join(20.0)
        assert [len(m) if isinstance(m, bytes) else m for m in result] == sizes
        assert result == messages

