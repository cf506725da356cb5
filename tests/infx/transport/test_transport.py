"""infx.transport over real loopback TCP (and TLS), against itself and
against grpcio in both directions; plus the adapter on a hand-stepped Clock."""

from __future__ import annotations

import datetime
import random
import threading
from concurrent import futures

import grpc
import pytest
import pytest_twisted
from twisted.internet import defer, reactor, task
from twisted.internet.endpoints import TCP4ClientEndpoint
from twisted.internet.interfaces import IStreamClientEndpoint
from twisted.internet.testing import StringTransport
from zope.interface import implementer

from infx.transport import (
    CallKind,
    ChannelState,
    GrpcChannel,
    GrpcError,
    GrpcServer,
    ServerCall,
    client_endpoint,
    listen_grpc,
)
from protocol.backoff import Backoff
from protocol.grpc import (
    CallEnded,
    EndCause,
    GrpcConfig,
    GrpcConnection,
    ResponseHeadersReceived,
    StatusCode,
)


#: Redials fast enough for a loopback test.
FAST_REDIAL = Backoff(initial=0.05)


def sleep(seconds: float) -> defer.Deferred:
    return task.deferLater(reactor, seconds, lambda: None)


class Recorder:
    """Handlers for a test service, remembering what the server saw."""

    def __init__(self) -> None:
        self.cancelled: defer.Deferred = defer.Deferred()
        self.calls: list[ServerCall] = []

    def echo(self, request: bytes, call: ServerCall) -> bytes:
        self.calls.append(call)
        call.send_initial_metadata((("x-peer-seen", "yes"),))
        call.set_trailing_metadata((("x-trailer-bin", b"\x00\x01"),))
        return request[::-1]

    async def count(self, request: bytes, call: ServerCall) -> None:
        for i in range(int(request)):
            await call.send(b"%d" % i)

    def gen(self, request: bytes, call: ServerCall):
        return (b"g%d" % i for i in range(int(request)))

    async def total(self, call: ServerCall) -> bytes:
        return b"%d" % sum([len(m) async for m in call])

    async def upper(self, call: ServerCall) -> None:
        async for message in call:
            await call.send(message.upper())

    def fail(self, request: bytes, call: ServerCall) -> bytes:
        raise GrpcError(StatusCode.FAILED_PRECONDITION, "nope ☺", (("why", "because"),))

    def crash(self, request: bytes, call: ServerCall) -> bytes:
        raise ZeroDivisionError("boom")

    async def slow(self, request: bytes, call: ServerCall) -> bytes:
        self.calls.append(call)
        call.when_cancelled().chainDeferred(self.cancelled)
        await sleep(5)
        return b"too late"

    async def flood(self, request: bytes, call: ServerCall) -> None:
        for _ in range(int(request)):
            await call.send(bytes(50_000))


def make_server(recorder: Recorder, config: GrpcConfig | None = None) -> GrpcServer:
    server = GrpcServer(reactor, config)
    server.add_method("/t.S/Echo", recorder.echo)
    server.add_method("/t.S/Count", recorder.count, kind=CallKind.UNARY_STREAM)
    server.add_method("/t.S/Gen", recorder.gen, kind=CallKind.UNARY_STREAM)
    server.add_method("/t.S/Total", recorder.total, kind=CallKind.STREAM_UNARY)
    server.add_method("/t.S/Upper", recorder.upper, kind=CallKind.STREAM_STREAM)
    server.add_method("/t.S/Fail", recorder.fail)
    server.add_method("/t.S/Crash", recorder.crash)
    server.add_method("/t.S/Slow", recorder.slow)
    server.add_method("/t.S/Flood", recorder.flood, kind=CallKind.UNARY_STREAM)
    return server


@pytest.fixture
def recorder():
    return Recorder()


@pytest_twisted.async_yield_fixture
async def served(recorder):
    server = make_server(recorder)
    port = await listen_grpc(reactor, "tcp:0:interface=127.0.0.1", server)
    channel = GrpcChannel(reactor, TCP4ClientEndpoint(reactor, "127.0.0.1", port.getHost().port))
    yield server, port, channel
    await channel.close()
    await port.stopListening()


# -- infx <-> infx ------------------------------------------------------------------


@pytest_twisted.ensureDeferred
async def test_unary_with_metadata_both_ways(served, recorder):
    server, port, channel = served
    call = channel.stream("/t.S/Echo", metadata=(("x-in", "1"), ("x-in-bin", b"\xff")))
    await call.send(b"abc")
    call.end()
    assert await call.recv() == b"cba"
    assert await call.recv() is None
    assert await call.initial_metadata() == (("x-peer-seen", "yes"),)
    assert call.trailing_metadata == (("x-trailer-bin", b"\x00\x01"),)
    seen = recorder.calls[0]
    assert ("x-in", "1") in seen.metadata and ("x-in-bin", b"\xff") in seen.metadata
    assert seen.peer.startswith("127.0.0.1:")
    assert await channel.unary("/t.S/Echo", b"xyz", timeout=5) == b"zyx"


@pytest_twisted.ensureDeferred
async def test_server_streaming_client_streaming_and_bidi(served):
    _, _, channel = served
    assert [m async for m in _started(channel.stream("/t.S/Count"), b"4")] == \
        [b"0", b"1", b"2", b"3"]
    assert [m async for m in _started(channel.stream("/t.S/Gen"), b"3")] == [b"g0", b"g1", b"g2"]
    total = channel.stream("/t.S/Total")
    for chunk in (b"ab", b"cde", b""):
        await total.send(chunk)
    total.end()
    assert await total.recv() == b"5"
    bidi = channel.stream("/t.S/Upper")
    for word in (b"ping", b"pong"):
        await bidi.send(word)
        assert await bidi.recv() == word.upper()
    bidi.end()
    assert await bidi.recv() is None
    assert (await bidi.status()).code == StatusCode.OK


def _started(call, request):
    call.send(request)
    call.end()
    return call


@pytest_twisted.ensureDeferred
async def test_handler_errors_become_statuses(served):
    _, _, channel = served
    with pytest.raises(GrpcError) as info:
        await channel.unary("/t.S/Fail", b"")
    assert (info.value.code, info.value.message, info.value.trailers) == (
        StatusCode.FAILED_PRECONDITION, "nope ☺", (("why", "because"),))
    with pytest.raises(GrpcError) as info:
        await channel.unary("/t.S/Crash", b"")
    assert info.value.code == StatusCode.UNKNOWN and "boom" in info.value.message
    with pytest.raises(GrpcError) as info:
        await channel.unary("/t.S/Missing", b"")
    assert info.value.code == StatusCode.UNIMPLEMENTED


@pytest_twisted.ensureDeferred
async def test_deadline_across_the_wire_cancels_the_handler(served, recorder):
    _, _, channel = served
    with pytest.raises(GrpcError) as info:
        await channel.unary("/t.S/Slow", b"", timeout=0.2)
    assert info.value.code == StatusCode.DEADLINE_EXCEEDED
    reason = await recorder.cancelled
    assert reason.code in (StatusCode.DEADLINE_EXCEEDED, StatusCode.CANCELLED)
    assert recorder.calls[0].cancelled


@pytest_twisted.ensureDeferred
async def test_client_cancel_reaches_the_handler(served, recorder):
    _, _, channel = served
    call = _started(channel.stream("/t.S/Slow"), b"")
    while not recorder.calls:
        await sleep(0.01)
    call.cancel()
    assert (await call.status()).code == StatusCode.CANCELLED
    assert (await recorder.cancelled).code == StatusCode.CANCELLED


@pytest_twisted.ensureDeferred
async def test_backpressure_server_send_waits_for_a_slow_reader(recorder):
    small = dict(initial_window_size=65_535, connection_window_size=65_535)
    server = make_server(recorder, GrpcConfig(client_side=False, **small))
    port = await listen_grpc(reactor, "tcp:0:interface=127.0.0.1", server)
    channel = GrpcChannel(reactor, TCP4ClientEndpoint(reactor, "127.0.0.1", port.getHost().port),
                          GrpcConfig(client_side=True, **small))
    try:
        sends: list[defer.Deferred] = []
        original = ServerCall.send

        def tracking_send(self, message, **kw):
            d = original(self, message, **kw)
            sends.append(d)
            return d

        ServerCall.send = tracking_send
        try:
            call = _started(channel.stream("/t.S/Flood"), b"20")
            await sleep(0.2)
            # The client has read nothing: the server is held back.
            assert sends and not sends[-1].called
            assert len(sends) < 20
            received = [m async for m in call]
        finally:
            ServerCall.send = original
        assert len(received) == 20 and all(len(m) == 50_000 for m in received)
    finally:
        await channel.close()
        await defer.maybeDeferred(port.stopListening)


@pytest_twisted.ensureDeferred
async def test_graceful_stop_lets_calls_finish_and_the_channel_reconnects(recorder):
    server = make_server(recorder)
    port = await listen_grpc(reactor, "tcp:0:interface=127.0.0.1", server)
    number = port.getHost().port
    channel = GrpcChannel(reactor, TCP4ClientEndpoint(reactor, "127.0.0.1", number),
                          backoff=FAST_REDIAL)
    try:
        bidi = channel.stream("/t.S/Upper")
        await bidi.send(b"a")
        assert await bidi.recv() == b"A"
        stopped = server.stop()
        await sleep(0.05)
        await bidi.send(b"b")
        assert await bidi.recv() == b"B"
        bidi.end()
        assert await bidi.recv() is None
        await stopped
        assert await channel.unary("/t.S/Echo", b"12", timeout=5) == b"21"
    finally:
        await channel.close()
        await defer.maybeDeferred(port.stopListening)


@pytest_twisted.ensureDeferred
async def test_calls_wait_for_a_connection_and_backoff_retries_until_it_exists(recorder):
    # Find a free port, then close it so the first attempts are refused.
    probe = await listen_grpc(reactor, "tcp:0:interface=127.0.0.1", make_server(recorder))
    number = probe.getHost().port
    await probe.stopListening()
    channel = GrpcChannel(reactor, TCP4ClientEndpoint(reactor, "127.0.0.1", number),
                          backoff=FAST_REDIAL, rng=random.Random(5))
    port = None
    try:
        waiting = channel.unary("/t.S/Echo", b"ab", timeout=5, wait_for_ready=True)
        await sleep(0.1)
        assert channel.state in (ChannelState.TRANSIENT_FAILURE, ChannelState.CONNECTING)
        with pytest.raises(GrpcError) as info:
            await channel.unary("/t.S/Echo", b"", timeout=5)
        assert info.value.code == StatusCode.UNAVAILABLE
        port = await listen_grpc(reactor, f"tcp:{number}:interface=127.0.0.1",
                                 make_server(recorder))
        assert await waiting == b"ba"
        assert channel.state is ChannelState.READY
    finally:
        await channel.close()
        if port is not None:
            await defer.maybeDeferred(port.stopListening)


# -- grpcio in both directions ------------------------------------------------------


def _in_thread(fn, *args):
    from twisted.internet.threads import deferToThread
    return deferToThread(fn, *args)


@pytest_twisted.ensureDeferred
async def test_grpcio_client_against_infx_server_unary_and_bidi(served):
    _, port, _ = served
    target = f"127.0.0.1:{port.getHost().port}"

    def run():
        with grpc.insecure_channel(target) as ch:
            unary = ch.unary_unary("/t.S/Echo")
            reply, call = unary.with_call(b"hello", timeout=5, metadata=(("x-a", "1"),))
            assert reply == b"olleh"
            assert ("x-peer-seen", "yes") in call.initial_metadata()
            assert ("x-trailer-bin", b"\x00\x01") in call.trailing_metadata()
            bidi = ch.stream_stream("/t.S/Upper")
            assert list(bidi(iter([b"a", b"b", b"c"]), timeout=5)) == [b"A", b"B", b"C"]
            big = ch.stream_stream("/t.S/Upper")
            payload = b"z" * (3 * 1024 * 1024)
            assert list(big(iter([payload, payload]), timeout=10)) == [payload.upper()] * 2
            with pytest.raises(grpc.RpcError) as info:
                ch.unary_unary("/t.S/Fail")(b"", timeout=5)
            assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert info.value.details() == "nope ☺"
            with pytest.raises(grpc.RpcError) as info:
                ch.unary_unary("/t.S/Slow")(b"", timeout=0.2)
            assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED

    await _in_thread(run)


class _GrpcioService(grpc.GenericRpcHandler):
    def __init__(self) -> None:
        self.cancelled = threading.Event()

    def service(self, details):
        if details.method == "/t.S/Echo":
            return grpc.unary_unary_rpc_method_handler(self._echo)
        if details.method == "/t.S/Upper":
            return grpc.stream_stream_rpc_method_handler(
                lambda it, ctx: (m.upper() for m in it))
        if details.method == "/t.S/Slow":
            return grpc.unary_unary_rpc_method_handler(self._slow)
        return None

    def _echo(self, request, context):
        context.send_initial_metadata((("x-h", "1"),))
        context.set_trailing_metadata((("x-t-bin", b"\x02"),))
        if request == b"fail":
            context.abort(grpc.StatusCode.OUT_OF_RANGE, "out ☺")
        return request[::-1]

    def _slow(self, request, context):
        context.add_callback(self.cancelled.set)
        self.cancelled.wait(5)
        return b""


@pytest.fixture
def grpcio_server():
    service = _GrpcioService()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    server.add_generic_rpc_handlers((service,))
    number = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield number, service
    server.stop(None)


@pytest_twisted.ensureDeferred
async def test_infx_channel_against_grpcio_server_unary_bidi_deadline(grpcio_server):
    number, service = grpcio_server
    channel = GrpcChannel(reactor, TCP4ClientEndpoint(reactor, "127.0.0.1", number))
    try:
        call = _started(channel.stream("/t.S/Echo"), b"hello")
        assert await call.recv() == b"olleh"
        assert await call.initial_metadata() == (("x-h", "1"),)
        assert (await call.status()).trailers == (("x-t-bin", b"\x02"),)
        with pytest.raises(GrpcError) as info:
            await channel.unary("/t.S/Echo", b"fail", timeout=5)
        assert (info.value.code, info.value.message) == (StatusCode.OUT_OF_RANGE, "out ☺")
        bidi = channel.stream("/t.S/Upper", timeout=10)
        for word in (b"x", b"y" * 2_000_000):
            await bidi.send(word)
            assert await bidi.recv() == word.upper()
        bidi.end()
        assert await bidi.recv() is None
        with pytest.raises(GrpcError) as info:
            await channel.unary("/t.S/Slow", b"", timeout=0.2)
        assert info.value.code == StatusCode.DEADLINE_EXCEEDED
        await _in_thread(service.cancelled.wait, 5)
        assert service.cancelled.is_set()
        with pytest.raises(GrpcError) as info:
            await channel.unary("/t.S/Missing", b"", timeout=5)
        assert info.value.code == StatusCode.UNIMPLEMENTED
    finally:
        await channel.close()


# -- TLS --------------------------------------------------------------------------------


def _self_signed(tmp_path):
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(days=1))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost")]), False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), True)
            .sign(key, hashes.SHA256()))
    cert_pem = cert.public_bytes(serialization.Encoding.PEM)
    key_pem = key.private_bytes(serialization.Encoding.PEM,
                                serialization.PrivateFormat.TraditionalOpenSSL,
                                serialization.NoEncryption())
    (tmp_path / "cert.pem").write_bytes(cert_pem)
    (tmp_path / "key.pem").write_bytes(key_pem)
    return tmp_path / "key.pem", tmp_path / "cert.pem", cert_pem


@pytest_twisted.ensureDeferred
async def test_tls_with_alpn_h2_for_grpcio_and_infx_clients(tmp_path, recorder):
    from twisted.internet.ssl import Certificate

    key, cert, cert_pem = _self_signed(tmp_path)
    port = await listen_grpc(
        reactor, f"ssl:0:interface=127.0.0.1:privateKey={key}:certKey={cert}",
        make_server(recorder))
    number = port.getHost().port
    channel = GrpcChannel(reactor, client_endpoint(reactor, "localhost", number, tls=True,
                                                   trust_root=Certificate.loadPEM(cert_pem)),
                          authority=f"localhost:{number}", scheme="https")
    try:
        assert await channel.unary("/t.S/Echo", b"tls", timeout=5) == b"slt"

        def run():
            creds = grpc.ssl_channel_credentials(root_certificates=cert_pem)
            with grpc.secure_channel(f"127.0.0.1:{number}", creds, options=[
                    ("grpc.ssl_target_name_override", "localhost")]) as ch:
                return ch.unary_unary("/t.S/Echo")(b"abc", timeout=5)

        assert await _in_thread(run) == b"cba"
    finally:
        await channel.close()
        await defer.maybeDeferred(port.stopListening)


# -- the adapter on a hand-stepped clock --------------------------------------------------


def test_server_protocol_arms_one_timer_from_the_machine_and_cancels_on_deadline(recorder):
    clock = task.Clock()
    server = make_server(recorder)
    server.clock = clock
    protocol = server.buildProtocol(None)
    transport = StringTransport()
    protocol.makeConnection(transport)
    client = GrpcConnection(GrpcConfig(client_side=True))
    client.initiate(0)
    sid = client.start_call("/t.S/Slow", timeout=2, now=0)
    client.send_message(sid, b"")
    client.end_stream(sid)
    protocol.dataReceived(client.data_to_send())
    client.receive_data(transport.value(), 0)
    transport.clear()
    assert [c.getTime() for c in clock.getDelayedCalls()] == [2]
    assert not recorder.cancelled.called
    clock.advance(2)
    assert recorder.cancelled.called
    events = client.receive_data(transport.value(), 2)
    (end,) = [e for e in events if isinstance(e, CallEnded)]
    # The server's own status, before the client's timer would fire.
    assert (end.status, end.cause) == (StatusCode.DEADLINE_EXCEEDED, EndCause.TRAILERS_ONLY)
    assert clock.getDelayedCalls() == []


def test_one_write_per_batch_of_events(recorder):
    clock = task.Clock()
    server = make_server(recorder)
    server.clock = clock
    protocol = server.buildProtocol(None)
    writes: list[bytes] = []
    transport = StringTransport()
    transport.write = writes.append
    protocol.makeConnection(transport)
    client = GrpcConnection(GrpcConfig(client_side=True))
    client.initiate(0)
    for _ in range(10):
        sid = client.start_call("/t.S/Echo", now=0)
        client.send_message(sid, b"abc")
        client.end_stream(sid)
    writes.clear()
    protocol.dataReceived(client.data_to_send())
    assert len(writes) == 1
    events = client.receive_data(writes[0], 0)
    assert len([e for e in events if isinstance(e, ResponseHeadersReceived)]) == 10
    assert [e.status for e in events if isinstance(e, CallEnded)] == [StatusCode.OK] * 10


def test_send_waits_while_the_transport_is_paused(recorder):
    """The protocol is the transport's push producer: while paused, a
    handler's send() Deferred stays unfired; resuming fires it."""
    clock = task.Clock()
    server = GrpcServer(clock)
    calls: list[ServerCall] = []
    server.add_method("/t.S/Hold", lambda call: calls.append(call) or defer.Deferred(),
                      kind=CallKind.STREAM_STREAM)
    protocol = server.buildProtocol(None)
    transport = StringTransport()
    protocol.makeConnection(transport)
    assert transport.producer is protocol and transport.streaming
    client = GrpcConnection(GrpcConfig(client_side=True))
    client.initiate(0)
    client.start_call("/t.S/Hold", now=0)
    protocol.dataReceived(client.data_to_send())
    (call,) = calls
    assert call.send(b"free").called
    protocol.pauseProducing()
    held = call.send(b"held")
    assert not held.called
    protocol.resumeProducing()
    assert held.called
    clock.advance(0)  # the scheduled flush writes both messages
    events = client.receive_data(transport.value(), 0)
    from protocol.grpc import MessageReceived
    assert [e.data for e in events if isinstance(e, MessageReceived)] == [b"free", b"held"]


@pytest_twisted.ensureDeferred
async def test_streams_refused_past_the_limit_are_retried_transparently():
    """Calls started before the server's SETTINGS arrive exceed its stream
    limit; the server refuses the excess (REFUSED_STREAM) and the channel
    replays them once streams free up: every call succeeds."""
    server = GrpcServer(reactor, GrpcConfig(client_side=False, max_concurrent_streams=2))
    server.add_method("/t.S/Rev", lambda request, call: request[::-1])
    port = await listen_grpc(reactor, "tcp:0:interface=127.0.0.1", server)
    channel = GrpcChannel(reactor, TCP4ClientEndpoint(reactor, "127.0.0.1", port.getHost().port))
    try:
        replies = await defer.gatherResults(
            [channel.unary("/t.S/Rev", b"a%d" % i, timeout=5) for i in range(6)])
        assert replies == [b"%da" % i for i in range(6)]
    finally:
        await channel.close()
        await port.stopListening()


@pytest_twisted.ensureDeferred
async def test_a_call_waiting_for_a_connection_ends_at_its_deadline(recorder):
    probe = await listen_grpc(reactor, "tcp:0:interface=127.0.0.1", make_server(recorder))
    number = probe.getHost().port
    await probe.stopListening()
    channel = GrpcChannel(reactor, TCP4ClientEndpoint(reactor, "127.0.0.1", number),
                          backoff=FAST_REDIAL)
    try:
        with pytest.raises(GrpcError) as info:
            await channel.unary("/t.S/Echo", b"", timeout=0.3, wait_for_ready=True)
        assert info.value.code == StatusCode.DEADLINE_EXCEEDED
    finally:
        await channel.close()


def _frame_kinds(data: bytes) -> list[tuple[int, int]]:
    """(type, stream id) of each HTTP/2 frame in ``data`` (no preface)."""
    kinds = []
    while data:
        length = int.from_bytes(data[:3], "big")
        kinds.append((data[3], int.from_bytes(data[5:9], "big") & 0x7FFF_FFFF))
        data = data[9 + length:]
    return kinds


def test_a_call_start_is_written_ahead_of_its_messages_once_per_batch():
    """A unary call's HEADERS leave before its message is framed, so the
    server starts on the call sooner; a burst of calls in one batch adds
    only that one early write."""
    clock = task.Clock()
    writes: list[bytes] = []

    @implementer(IStreamClientEndpoint)
    class Endpoint:
        def connect(self, factory):
            protocol = factory.buildProtocol(None)
            transport = StringTransport()
            transport.write = writes.append
            protocol.makeConnection(transport)
            return defer.succeed(protocol)

    channel = GrpcChannel(clock, Endpoint())
    channel.unary("/t.S/Echo", b"first")  # connects; the call waits for it
    writes.clear()
    channel.unary("/t.S/Echo", b"abc")
    HEADERS, DATA = 0x1, 0x0
    assert [_frame_kinds(w) for w in writes] == [[(HEADERS, 3)], [(DATA, 3)]]
    writes.clear()
    protocol = channel.protocol
    with protocol.batch():
        for _ in range(3):
            channel.unary("/t.S/Echo", b"abc")
    first, rest = [_frame_kinds(w) for w in writes]
    assert first == [(HEADERS, 5)]
    assert sorted(rest) == [(DATA, 5), (DATA, 7), (DATA, 9), (HEADERS, 7), (HEADERS, 9)]


@pytest_twisted.ensureDeferred
async def test_graceful_stop_drains_a_grpcio_client_in_two_phases(recorder):
    """grpcio answers the PING behind the first GOAWAY, its open call
    finishes, and it reconnects for the next one."""
    import queue

    server = make_server(recorder)
    port = await listen_grpc(reactor, "tcp:0:interface=127.0.0.1", server)
    requests: queue.Queue = queue.Queue()
    channel = grpc.insecure_channel(f"127.0.0.1:{port.getHost().port}")
    try:
        replies = channel.stream_stream("/t.S/Upper")(iter(requests.get, None), timeout=10)
        requests.put(b"a")
        assert await _in_thread(next, replies) == b"A"
        stopped = server.stop()
        await sleep(0.05)
        requests.put(b"b")
        assert await _in_thread(next, replies) == b"B"
        requests.put(None)
        assert await _in_thread(list, replies) == []
        await stopped
        echo = channel.unary_unary("/t.S/Echo")
        assert await _in_thread(lambda: echo(b"12", timeout=5)) == b"21"
    finally:
        channel.close()
        await defer.maybeDeferred(port.stopListening)
