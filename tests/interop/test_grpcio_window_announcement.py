"""grpc-core's per-call WINDOW_UPDATE is not a frame that does nothing.

Every call a grpcio client starts carries, between its HEADERS and its DATA,
a stream WINDOW_UPDATE of 5 bytes (the message prefix it reads first). The
budget for frames that do nothing counted it, so a grpcio client making more
than about a hundred calls on one unauthenticated connection got
GOAWAY(ENHANCE_YOUR_CALM) (the attack suite's legitimate gRPC probe saw it).
One such update per call is free; more on the same stream, or on the
connection, still count.
"""

from __future__ import annotations

import struct

from protocol.grpc import StatusCode
from protocol.grpc.h2_budgets import ENHANCE_YOUR_CALM
from tests.support.h2_peer import Peer, message
from tools.bench.attacks import DATA, END_STREAM, WINDOW_UPDATE, frame


def announce(sid: int) -> bytes:
    return frame(WINDOW_UPDATE, 0, sid, struct.pack(">I", 5))


def test_calls_that_each_announce_their_window_never_trip_the_budget():
    """What grpcio sends, 500 calls on an unauthenticated connection with the clock stopped."""
    peer = Peer(require_authentication=True)
    for _ in range(500):
        sid, headers = peer.headers()
        peer.feed(headers + announce(sid) + frame(DATA, END_STREAM, sid, message(b"")))
        peer.server.send_status(sid, StatusCode.UNIMPLEMENTED)
        peer.server.data_to_send()
    assert peer.terminated() == []


def test_more_tiny_updates_on_one_stream_still_count_as_a_flood():
    peer = Peer(require_authentication=True)
    sid, headers = peer.headers()
    peer.feed(headers)
    peer.feed(announce(sid) * 100)
    assert peer.terminated() == []
    peer.feed(announce(sid) * 2)
    (terminated,) = peer.terminated()
    assert terminated.error_code == ENHANCE_YOUR_CALM
