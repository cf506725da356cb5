"""A connection's pings: the ones the caller sends, keepalive, the peer's ping abuse and the PING
behind a draining server's first GOAWAY; pure, no I/O, no clock reads.

Rules this file keeps: every PING payload this side sends is made here (a counter, so no two
are alike), and an ack is matched to what it answers: a caller's ping (its round trip is
reported), the keepalive ping (it proves nothing more than any received byte does), or the
drain ping (the server may send its final GOAWAY). Keepalive (``keepalive_interval``): after
that long without receiving anything a PING goes out, and without any byte received within
``keepalive_timeout`` the connection is dead. Ping abuse (grpc-core's policy): a peer's PING
less than ``min_ping_interval`` after its previous one is a strike, unless we sent frames
between them; more than ``max_ping_strikes`` strikes end the connection.
"""

from __future__ import annotations

import struct
from enum import Enum

from protocol.grpc.types import GrpcConfig

__all__ = ["KeepaliveDue", "Liveness"]


class KeepaliveDue(Enum):
    """What keepalive asks of the connection at a timeout."""

    PING = "ping"  # nothing received for keepalive_interval: send a PING
    TIMEOUT = "timeout"  # the keepalive PING had no byte in answer within keepalive_timeout


class Liveness:
    """Pings sent and awaited, keepalive's timer, the peer's ping strikes, the drain ping."""

    def __init__(self, config: GrpcConfig) -> None:
        self.config = config
        self._counter = 0
        # Payload -> when it was sent, for the pings awaiting their ack.
        self._pings: dict[bytes, float] = {}
        self._last_received = 0.0
        self._keepalive_payload: bytes | None = None
        self._keepalive_deadline: float | None = None
        self._last_ping_received: float | None = None
        self._strikes = 0
        #: A draining server's PING sent behind its first GOAWAY, and when it sends the final
        #: GOAWAY without the ack (both None: no drain ping awaited).
        self.drain_ping: bytes | None = None
        self.drain_ping_deadline: float | None = None

    def _payload(self) -> bytes:
        self._counter += 1
        return struct.pack(">Q", self._counter)

    # --- what the connection tells it ---------------------------------------------

    def received(self, now: float) -> None:
        """Bytes arrived: the peer is alive, whatever keepalive was waiting for."""
        self._last_received = now
        self._keepalive_deadline = None

    def sent_frames(self) -> None:
        """We sent frames: the peer's pings are fine while we are sending (grpc-core)."""
        self._strikes = 0
        self._last_ping_received = None

    def ping_sent(self, now: float) -> bytes:
        """The payload of a PING sent at ``now``, whose ack is awaited."""
        payload = self._payload()
        self._pings[payload] = now
        return payload

    def drain_ping_sent(self, now: float, timeout: float) -> bytes:
        """The payload of the PING behind a draining server's first GOAWAY."""
        self.drain_ping = self._payload()
        self.drain_ping_deadline = now + timeout
        return self.drain_ping

    def drain_ping_over(self) -> None:
        """The final GOAWAY went out: the drain ping is no longer awaited."""
        self.drain_ping = None
        self.drain_ping_deadline = None

    def ping_received(self, now: float) -> bool:
        """The peer sent a PING at ``now``: whether that is one strike too many."""
        allowed = self.config.max_ping_strikes
        if allowed:
            last = self._last_ping_received
            if last is not None and now - last < self.config.min_ping_interval:
                self._strikes += 1
                if self._strikes > allowed:
                    return True
        self._last_ping_received = now
        return False

    def ack_received(self, payload: bytes, now: float) -> float | None:
        """The peer acked ``payload`` (not the drain ping): the round trip of a caller's ping,
        or None (unknown payload, or keepalive's, which the caller never sent)."""
        sent = self._pings.pop(payload, None)
        if sent is None or payload == self._keepalive_payload:
            return None
        return now - sent

    # --- time ------------------------------------------------------------------------

    def timer(self) -> float | None:
        """When the connection must next look at its pings (None: never)."""
        keepalive = self._keepalive_deadline
        if keepalive is None and self.config.keepalive_interval is not None:
            keepalive = self._last_received + self.config.keepalive_interval
        drain = self.drain_ping_deadline
        if keepalive is None or (drain is not None and drain < keepalive):
            return drain
        return keepalive

    def keepalive_due(self, now: float) -> KeepaliveDue | None:
        """What keepalive asks at ``now``, if anything."""
        if self._keepalive_deadline is not None:
            return KeepaliveDue.TIMEOUT if now >= self._keepalive_deadline else None
        interval = self.config.keepalive_interval
        if interval is not None and now >= self._last_received + interval:
            return KeepaliveDue.PING
        return None

    def keepalive_sent(self, payload: bytes, now: float) -> None:
        """Keepalive's PING ``payload`` went out at ``now``: a byte must come within the timeout."""
        self._keepalive_payload = payload
        self._keepalive_deadline = now + self.config.keepalive_timeout
