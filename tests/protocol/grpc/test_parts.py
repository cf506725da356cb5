"""The gRPC connection's parts alone, with no GrpcConnection around them: the pings of
:class:`Liveness` (keepalive, ping strikes, acks, the drain ping), the call endings of
:class:`ConnectionState`, and :class:`Inbound`'s reassembly of messages from DATA frames (a plain h2 client's)."""

from __future__ import annotations

import struct

import h2.config
import h2.connection

from protocol.grpc.calls import ConnectionState
from protocol.grpc.liveness import KeepaliveDue, Liveness
from protocol.grpc.metadata import StatusCode
from protocol.grpc.receive import Inbound
from protocol.grpc.types import CallEnded, CallStarted, ConnectionTerminated, EndCause, GrpcConfig, MessageReceived
from protocol.grpc.wire import CallState


def server_parts(**config: object) -> tuple[ConnectionState, Liveness, Inbound]:
    grpc_config = GrpcConfig(client_side=False, **config)  # type: ignore[arg-type]
    liveness = Liveness(grpc_config)
    state = ConnectionState(grpc_config, liveness)
    return state, liveness, Inbound(state, liveness)


# --- liveness ---------------------------------------------------------------------


def test_keepalive_pings_after_the_interval_and_times_out_only_without_a_byte_in_answer():
    liveness = Liveness(GrpcConfig(client_side=True, keepalive_interval=10.0, keepalive_timeout=2.0))
    liveness.received(0.0)
    assert liveness.timer() == 10.0 and liveness.keepalive_due(9.9) is None
    assert liveness.keepalive_due(10.0) is KeepaliveDue.PING
    payload = liveness.ping_sent(10.0)
    liveness.keepalive_sent(payload, 10.0)
    assert liveness.timer() == 12.0 and liveness.keepalive_due(11.0) is None
    assert liveness.keepalive_due(12.0) is KeepaliveDue.TIMEOUT
    liveness.received(11.5)  # any byte proves the peer alive; the interval starts again
    assert liveness.keepalive_due(12.0) is None and liveness.timer() == 21.5
    # Keepalive's own ack is not a round trip anyone asked for.
    assert liveness.ack_received(payload, 11.6) is None


def test_without_keepalive_there_is_no_timer_but_the_drain_pings():
    liveness = Liveness(GrpcConfig(client_side=False))
    assert liveness.timer() is None and liveness.keepalive_due(1e9) is None
    payload = liveness.drain_ping_sent(5.0, timeout=3.0)
    assert liveness.drain_ping == payload and liveness.timer() == 8.0
    liveness.drain_ping_over()
    assert (liveness.drain_ping, liveness.timer()) == (None, None)


def test_a_callers_ping_is_acked_once_with_its_round_trip_and_payloads_never_repeat():
    liveness = Liveness(GrpcConfig(client_side=True))
    first, second = liveness.ping_sent(1.0), liveness.ping_sent(2.0)
    drain = liveness.drain_ping_sent(2.0, timeout=1.0)
    assert len({first, second, drain}) == 3 and first == struct.pack(">Q", 1)
    assert liveness.ack_received(second, 2.25) == 0.25
    assert liveness.ack_received(second, 2.5) is None  # acked already
    assert liveness.ack_received(b"unknown!", 2.5) is None


def test_pings_closer_than_the_minimum_interval_are_strikes_until_we_send_frames():
    liveness = Liveness(GrpcConfig(client_side=False, min_ping_interval=10.0, max_ping_strikes=2))
    assert not liveness.ping_received(0.0)
    assert not liveness.ping_received(1.0)  # strike 1
    assert not liveness.ping_received(2.0)  # strike 2
    liveness.sent_frames()  # we were sending: pings are fine then
    assert not liveness.ping_received(3.0) and not liveness.ping_received(4.0) and not liveness.ping_received(5.0)
    assert liveness.ping_received(6.0)  # strike 3 of 2 allowed
    spaced = Liveness(GrpcConfig(client_side=False, min_ping_interval=10.0, max_ping_strikes=2))
    assert not any(spaced.ping_received(t) for t in (0.0, 10.0, 20.0, 30.0))


# --- the connection's state ------------------------------------------------------------


class Peer:
    """A plain h2 client whose frames reach the parts' h2 machine and then :class:`Inbound`."""

    def __init__(self, **config: object) -> None:
        self.state, self.liveness, self.inbound = server_parts(**config)
        self.state.h2.initiate_connection()
        self.client = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
        self.client.initiate_connection()

    def deliver(self) -> list[object]:
        self.inbound.handle(self.state.h2.receive_data(self.client.data_to_send()), 0.0)
        self.client.receive_data(self.state.h2.data_to_send())
        return self.state.take_events()

    def call(self) -> int:
        stream_id = self.client.get_next_available_stream_id()
        self.client.send_headers(stream_id, [(":method", "POST"), (":scheme", "http"), (":path", "/s/M"),
                                             (":authority", "x"), ("content-type", "application/grpc"),
                                             ("te", "trailers")])
        (started,) = self.deliver()
        assert isinstance(started, CallStarted)
        return stream_id


def test_a_call_ends_once_and_its_unconsumed_bytes_go_back_with_it():
    peer = Peer()
    stream_id = peer.call()
    peer.client.send_data(stream_id, struct.pack(">BI", 0, 3) + b"abc")
    (message,) = peer.deliver()
    state = peer.state
    call = state.calls[stream_id]
    assert isinstance(message, MessageReceived) and call.unacked == 8
    state.end_call(call, StatusCode.CANCELLED, "gone", (), EndCause.RESET)
    state.forget(call)  # a second ending finds nothing
    (ended,) = state.take_events()
    assert isinstance(ended, CallEnded) and ended.stream_id == stream_id and ended.status == StatusCode.CANCELLED
    assert state.calls == {} and call.unacked == 0 and stream_id in state.just_ended and state.take_events() == []


def test_a_draining_connection_terminates_when_its_last_call_ends_and_not_before_the_drain_ping():
    state, liveness, _ = server_parts()
    call = CallState(1, None)
    state.calls[1] = call
    state.goaway_sent = True
    liveness.drain_ping_sent(0.0, timeout=1.0)
    state.forget(call)
    assert state.take_events() == [] and not state.terminated  # the drain ping is not answered yet
    liveness.drain_ping_over()
    state.maybe_drained()
    (terminated,) = state.take_events()
    assert isinstance(terminated, ConnectionTerminated) and terminated.error_code == 0 and state.terminated


# --- inbound ---------------------------------------------------------------------------


def test_messages_are_cut_from_data_frames_however_they_split_them():
    peer = Peer()
    stream_id = peer.call()
    wire = struct.pack(">BI", 0, 3) + b"abc" + struct.pack(">BI", 0, 600) + b"x" * 600
    for piece in (wire[:2], wire[2:9], wire[9:300], wire[300:]):
        peer.client.send_data(stream_id, piece)
    messages = peer.deliver()
    assert [m.data for m in messages] == [b"abc", b"x" * 600]  # type: ignore[attr-defined]
    # What the caller must acknowledge is what completed each message; the earlier pieces of a
    # message that spans frames went back to the window on arrival, and nothing is held.
    owed = sum(m.flow_controlled_length for m in messages)  # type: ignore[attr-defined]
    assert peer.state.calls[stream_id].unacked == owed and 313 <= owed < len(wire)
    assert peer.state.partial_total == 0


def test_a_message_over_the_limit_fails_its_call_alone():
    peer = Peer(max_receive_message_length=10)
    big, small = peer.call(), peer.call()
    peer.client.send_data(big, struct.pack(">BI", 0, 11) + b"y" * 11)
    peer.client.send_data(small, struct.pack(">BI", 0, 2) + b"ok")
    events = peer.deliver()
    (ended,) = [e for e in events if isinstance(e, CallEnded)]
    assert ended.stream_id == big and ended.status == StatusCode.RESOURCE_EXHAUSTED
    assert [(e.stream_id, e.data) for e in events if isinstance(e, MessageReceived)] == [(small, b"ok")]
