"""The Twisted side of the connection budgets (infx/transport/connection.py).

Fairness: one connection's burst of frames is fed to the machine a frame
budget per reactor turn, with the transport's reading paused in between, so
other connections are served meanwhile.  Freeing: closed connections (and
their calls) are freed by reference counting alone, with the garbage
collector off.  Authentication: a service's ``call.authenticated()`` lifts
the unauthenticated limits of its connection.
"""

from __future__ import annotations

import gc
import socket
import struct
import weakref

import pytest_twisted
from twisted.internet import defer, reactor, task
from twisted.internet.endpoints import TCP4ClientEndpoint
from twisted.internet.error import ConnectionDone
from twisted.internet.testing import StringTransport
from twisted.python.failure import Failure

from infx.transport import CallKind, GrpcChannel, GrpcServer, ServerCall, listen_grpc
from protocol.grpc import ConnectionBudgets, GrpcConfig
from protocol.grpc.h2_budgets import ENHANCE_YOUR_CALM
from tools.fuzz.drivers import PREFACE, SETTINGS, WINDOW_UPDATE, raw_frame

# Window updates big enough to be real work (tiny ones are a budget of their own).
TINY = raw_frame(WINDOW_UPDATE, 0, 0, struct.pack(">I", 1024))


def turn() -> defer.Deferred:
    return task.deferLater(reactor, 0, lambda: None)


def echo(request: bytes, call: ServerCall) -> bytes:
    return request


def test_a_burst_of_frames_is_fed_a_budget_per_turn_with_reading_paused():
    clock = task.Clock()
    server = GrpcServer(clock, GrpcConfig(client_side=False,
                                          budgets=ConnectionBudgets(max_frames_per_receive=100)))
    protocol = server.buildProtocol(None)
    transport = StringTransport()
    protocol.makeConnection(transport)
    protocol.dataReceived(PREFACE + raw_frame(SETTINGS, 0, 0, b"") + TINY * 250)
    assert transport.producerState == "paused"
    assert protocol.conn.has_pending_input
    # task.Clock runs the zero-delay turns one after another in one advance.
    clock.advance(0)
    assert not protocol.conn.has_pending_input
    assert transport.producerState == "producing"
    assert not [c for c in clock.getDelayedCalls() if c.getTime() <= clock.seconds()]


def test_a_connection_closed_while_input_waits_cancels_its_turn():
    clock = task.Clock()
    server = GrpcServer(clock, GrpcConfig(client_side=False,
                                          budgets=ConnectionBudgets(max_frames_per_receive=10)))
    protocol = server.buildProtocol(None)
    protocol.makeConnection(StringTransport())
    protocol.dataReceived(PREFACE + TINY * 50)
    assert clock.getDelayedCalls()
    protocol.connectionLost(Failure(ConnectionDone()))
    assert not [c for c in clock.getDelayedCalls() if c.active()]


def test_the_stalled_output_budget_is_fed_by_the_transport_pausing_us():
    """The transport pausing its producer (its buffer is full: the peer does
    not read) makes control frames count; the flood ends with GOAWAY."""
    clock = task.Clock()
    server = GrpcServer(clock, GrpcConfig(client_side=False, max_ping_strikes=0,
                                          budgets=ConnectionBudgets(max_stalled_control_replies=5)))
    protocol = server.buildProtocol(None)
    transport = StringTransport()
    protocol.makeConnection(transport)
    protocol.dataReceived(PREFACE + raw_frame(SETTINGS, 0, 0, b""))
    protocol.pauseProducing()
    protocol.dataReceived(raw_frame(6, 0, 0, bytes(8)) * 6)
    assert transport.disconnecting
    assert bytes([0x7]) in transport.value()    # a GOAWAY frame went out
    assert struct.pack(">I", ENHANCE_YOUR_CALM) in transport.value()


@pytest_twisted.ensureDeferred
async def test_a_flood_of_tiny_frames_does_not_hold_up_another_connection():
    """A raw socket writes 2 MiB of 13-byte frames (~160,000 frames); while the
    server is still working through them, a gRPC call on another connection
    is answered."""
    seen: list[bool] = []
    server = GrpcServer(reactor)

    def probe(request: bytes, call: ServerCall) -> bytes:
        seen.append(any(p.conn.has_pending_input for p in server.connections))
        return request

    server.add_method("/t.S/Probe", probe)
    port = await listen_grpc(reactor, "tcp:0:interface=127.0.0.1", server)
    flooder = socket.create_connection(("127.0.0.1", port.getHost().port))
    flooder.setblocking(False)
    channel = GrpcChannel(reactor, TCP4ClientEndpoint(reactor, "127.0.0.1", port.getHost().port))
    try:
        assert await channel.unary("/t.S/Probe", b"warm-up", timeout=10) == b"warm-up"
        flood = memoryview(PREFACE + raw_frame(SETTINGS, 0, 0, b"") + TINY * 160_000)
        sent = 0
        for _ in range(10_000):
            try:
                sent += flooder.send(flood[sent:])
            except BlockingIOError:
                pass
            if any(p.conn.has_pending_input for p in server.connections):
                break
            await turn()
        assert any(p.conn.has_pending_input for p in server.connections)
        assert await channel.unary("/t.S/Probe", b"during", timeout=10) == b"during"
        assert seen == [False, True]
    finally:
        flooder.close()
        await channel.close()
        await port.stopListening()
        await server.stop(grace=0)


@pytest_twisted.ensureDeferred
async def test_closed_connections_are_freed_without_the_garbage_collector():
    """Open connections, make calls of each kind, close them: with gc off,
    every protocol object (server and client side) and every server call is
    gone once the reactor has let go of them."""
    server = GrpcServer(reactor)
    server.add_method("/t.S/Echo", echo)

    async def upper(call: ServerCall) -> None:
        async for message in call:
            await call.send(message.upper())

    server.add_method("/t.S/Upper", upper, kind=CallKind.STREAM_STREAM)
    port = await listen_grpc(reactor, "tcp:0:interface=127.0.0.1", server)
    refs: list[weakref.ref] = []
    gc.collect()
    gc.disable()
    try:
        for _ in range(5):
            channel = GrpcChannel(reactor, TCP4ClientEndpoint(reactor, "127.0.0.1",
                                                              port.getHost().port))
            assert await channel.unary("/t.S/Echo", b"x" * 100_000, timeout=10) == b"x" * 100_000
            call = channel.stream("/t.S/Upper", timeout=10)
            await call.send(b"a")
            assert await call.recv() == b"A"
            call.end()
            assert await call.recv() is None
            refs.append(weakref.ref(channel.protocol))
            refs += [weakref.ref(p) for p in server.connections]
            await channel.close()
            del channel, call
            for _ in range(5):
                await turn()
        for _ in range(20):
            if all(ref() is None for ref in refs):
                break
            await turn()
        alive = [ref() for ref in refs if ref() is not None]
        assert alive == [], [gc.get_referrers(obj) for obj in alive][:1]
    finally:
        gc.enable()
        await port.stopListening()
        await server.stop(grace=0)


@pytest_twisted.ensureDeferred
async def test_a_service_lifts_the_unauthenticated_limits_of_its_connection():
    """Until a call passes authentication the client sees four streams and a
    64 KiB window; after ``call.authenticated()`` the full limits, and a
    large message flows."""
    server = GrpcServer(reactor, GrpcConfig(client_side=False, require_authentication=True,
                                            max_receive_message_length=8 << 20))

    def login(request: bytes, call: ServerCall) -> bytes:
        if request == b"secret":
            call.authenticated()
        return b"%d" % len(request)

    server.add_method("/t.S/Login", login)
    port = await listen_grpc(reactor, "tcp:0:interface=127.0.0.1", server)
    channel = GrpcChannel(reactor, TCP4ClientEndpoint(reactor, "127.0.0.1", port.getHost().port))
    try:
        assert await channel.unary("/t.S/Login", b"guess", timeout=10) == b"5"
        assert channel.protocol.conn.max_concurrent_calls == 4
        assert await channel.unary("/t.S/Login", b"secret", timeout=10) == b"6"
        for _ in range(5):
            await turn()
        assert channel.protocol.conn.max_concurrent_calls == 1000
        big = bytes(5 << 20)
        assert await channel.unary("/t.S/Login", big, timeout=10) == b"%d" % len(big)
    finally:
        await channel.close()
        await port.stopListening()
        await server.stop(grace=0)
