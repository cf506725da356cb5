"""GrpcChannel performs protocol.channel's effects: dials when the machine
says so, on a hand-stepped Clock (no real time, no sockets)."""

from __future__ import annotations

import random

from twisted.internet import defer, task
from twisted.internet.error import ConnectionRefusedError
from twisted.internet.interfaces import IStreamClientEndpoint
from twisted.internet.testing import StringTransport
from zope.interface import implementer

from infx.transport import ChannelState, GrpcChannel, GrpcError, StatusCode
from protocol.backoff import Backoff


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
