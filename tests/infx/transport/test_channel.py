"""GrpcChannel performs protocol.grpc.channel's effects: dials when the machine
says so, on a hand-stepped Clock (no real time, no sockets)."""

from __future__ import annotations

import random

import h2.errors
from twisted.internet import defer, task
from twisted.internet.error import ConnectionRefusedError
from twisted.internet.interfaces import IStreamClientEndpoint
from twisted.internet.testing import StringTransport
from zope.interface import implementer

from infx.transport import ChannelState, GrpcChannel, GrpcError, StatusCode
from protocol.backoff import Backoff
from protocol.grpc import CallStarted, GrpcConfig, GrpcConnection, MessageReceived


@implementer(IStreamClientEndpoint)
class FlakyEndpoint:
    """Refuses the first ``failures`` dials, then connects to a StringTransport."""

    def __init__(self, clock: task.Clock, failures: int) -> None:
        self.clock = clock
        self.failures = failures
        self.dialled_at: list[float] = []

    def connect(self, factory):
        self.dialled_at.append(self.clock.seconds())
        if len(self.dialled_at) <= self.failures:
            return defer.fail(ConnectionRefusedError("nobody home"))
        protocol = factory.buildProtocol(None)
        protocol.makeConnection(StringTransport())
        return defer.succeed(protocol)


def test_redials_follow_the_backoff_on_the_clock_and_a_patient_call_starts_when_ready():
    clock = task.Clock()
    endpoint = FlakyEndpoint(clock, failures=3)
    channel = GrpcChannel(clock, endpoint, backoff=Backoff(initial=1.0, factor=2.0, jitter=0.0),
                          rng=random.Random(3))
    patient = channel.stream("/t.S/Echo", wait_for_ready=True)
    impatient = channel.stream("/t.S/Echo")
    assert endpoint.dialled_at == [0.0]
    assert impatient.final is not None and impatient.final.code == StatusCode.UNAVAILABLE
    assert impatient.final.message == "not connected"  # the dial already failed
    assert channel.state is ChannelState.TRANSIENT_FAILURE
    clock.advance(1.0)
    clock.advance(2.0)
    assert endpoint.dialled_at == [0.0, 1.0, 3.0]
    clock.advance(4.0)
    assert endpoint.dialled_at == [0.0, 1.0, 3.0, 7.0]
    assert channel.state is ChannelState.READY
    assert patient.stream_id == 1 and patient.final is None
    channel.close()
    assert channel.state is ChannelState.SHUTDOWN
    assert channel.protocol is None


def test_a_call_waiting_for_ready_fails_at_its_deadline_on_the_clock():
    clock = task.Clock()
    endpoint = FlakyEndpoint(clock, failures=100)
    channel = GrpcChannel(clock, endpoint, backoff=Backoff(initial=1.0, jitter=0.0))
    result = channel.unary("/t.S/Echo", b"", timeout=2.5, wait_for_ready=True)
    failures: list[GrpcError] = []
    result.addErrback(lambda f: failures.append(f.value))
    clock.advance(2.4)
    assert not failures
    clock.advance(0.1)
    assert [f.code for f in failures] == [StatusCode.DEADLINE_EXCEEDED]
    assert channel.close().called


@implementer(IStreamClientEndpoint)
class StringEndpoint:
    """Connects at once to a StringTransport, kept in ``transports``."""

    def __init__(self) -> None:
        self.transports: list[StringTransport] = []

    def connect(self, factory):
        protocol = factory.buildProtocol(None)
        transport = StringTransport()
        self.transports.append(transport)
        protocol.makeConnection(transport)
        return defer.succeed(protocol)


def test_a_call_refused_unseen_is_replayed_with_its_request_and_then_answered():
    """REFUSED_STREAM before any response: the channel starts the call again on
    a new stream with the same request bytes (gRPC's transparent retry)."""
    clock = task.Clock()
    endpoint = StringEndpoint()
    channel = GrpcChannel(clock, endpoint)
    result = channel.unary("/t.S/Echo", b"hello", timeout=5)
    protocol, transport = channel.protocol, endpoint.transports[0]
    server = GrpcConnection(GrpcConfig(client_side=False))
    server.initiate(0.0)

    def exchange() -> list:
        events = server.receive_data(transport.value(), clock.seconds())
        transport.clear()
        protocol.dataReceived(server.data_to_send())
        return events

    first = [e.stream_id for e in exchange() if isinstance(e, CallStarted)]
    assert first == [1]
    # The peer's h2 refuses the stream as a server past its limit or behind a GOAWAY does.
    server._h2.reset_stream(1, h2.errors.ErrorCodes.REFUSED_STREAM)
    protocol.dataReceived(server.data_to_send())
    assert not result.called
    replayed = exchange()
    assert [(e.stream_id, e.data) for e in replayed if isinstance(e, MessageReceived)] == [
        (3, b"hello")]
    server.send_message(3, b"olleh")
    server.send_status(3, StatusCode.OK)
    protocol.dataReceived(server.data_to_send())
    assert result.result == b"olleh"
    channel.close()
