"""The gRPC machine's vocabulary: its configuration, the events it emits
and the errors it raises (:mod:`protocol.grpc` re-exports all of them).

Rules this file keeps: frozen dataclasses and plain exceptions only; no
I/O, no clock reads, no h2 objects.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Union

from protocol.errors import LocalUsageError
from protocol.grpc.h2_budgets import UNAUTHENTICATED_BUDGETS, ConnectionBudgets
from protocol.grpc.metadata import Metadata, MetadataError, StatusCode

__all__ = [
    "GOAWAY_ACK_TIMEOUT", "CallEnded", "CallLimitReached", "CallStarted", "ConnectionTerminated",
    "EndCause", "Event", "GoAwayReceived", "GrpcConfig", "InputEnded", "InvalidMetadata",
    "LocalProtocolError", "MessageReceived", "MessageTooLarge", "MiB", "PingAcknowledged",
    "ResponseHeadersReceived", "SendBufferDrained",
]

MiB = 1024 * 1024
#: Seconds a draining server waits for the ack of the PING behind its first
#: GOAWAY before naming its last stream anyway (a round trip is far less).
GOAWAY_ACK_TIMEOUT = 1.0


@dataclass(frozen=True)
class GrpcConfig:
    """Every option of a :class:`GrpcConnection`, validated on construction.

    Window sizes are large on purpose: with HTTP/2's 64 KiB default a
    single stream cannot fill a loopback link (see PERF-NOTES.md).
    """

    #: True for the side that starts calls (the HTTP/2 client).
    client_side: bool
    #: Largest message (after decompression) we accept; a longer length
    #: prefix ends that call alone with RESOURCE_EXHAUSTED.  grpcio's default.
    max_receive_message_length: int = 4 * MiB
    #: Largest message we agree to send (None: no limit); over it,
    #: :meth:`GrpcConnection.send_message` raises :class:`MessageTooLarge`.
    max_send_message_length: int | None = None
    #: SETTINGS_INITIAL_WINDOW_SIZE we advertise (per stream receive window).
    initial_window_size: int = 4 * MiB
    #: Connection-level receive window, opened right after the preface.
    connection_window_size: int = 16 * MiB
    #: SETTINGS_MAX_FRAME_SIZE we advertise and accept at once; the protocol
    #: maximum is 2**24 - 1.
    max_inbound_frame_size: int = 2**24 - 1
    #: SETTINGS_MAX_HEADER_LIST_SIZE; a larger header block ends that call
    #: with RESOURCE_EXHAUSTED.
    max_header_list_size: int = 16 * 1024
    #: SETTINGS_MAX_CONCURRENT_STREAMS we advertise; a new stream past it
    #: is refused with RST_STREAM(REFUSED_STREAM), safe for the peer to retry.
    max_concurrent_streams: int = 1000
    #: Send a PING after this many seconds without receiving anything (None:
    #: no keepalive).  Servers built on grpc-core reject pings more often
    #: than every 5 minutes unless configured otherwise.
    keepalive_interval: float | None = None
    #: How long to wait for any bytes after a keepalive PING before declaring
    #: the connection dead.
    keepalive_timeout: float = 20.0
    #: Received PINGs closer together than this, while we have sent no
    #: headers or data in between, count as strikes (grpc-core's
    #: ``GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS``).
    min_ping_interval: float = 300.0
    #: More strikes than this and the connection ends with GOAWAY
    #: ENHANCE_YOUR_CALM (grpc-core's ``max_ping_strikes``); 0 disables.
    max_ping_strikes: int = 2
    #: ``user-agent`` sent on every call (client side).
    user_agent: str = "infx-grpc/0.1"
    #: What a connection may cost whoever the peer is (frame sizes, rates,
    #: frames per receive); see :class:`ConnectionBudgets`.
    budgets: ConnectionBudgets = ConnectionBudgets()
    #: Bytes of gRPC messages not yet complete, summed over a connection's
    #: calls; over it, the call holding most ends RESOURCE_EXHAUSTED.  None:
    #: one connection window, or one largest message if that is larger.
    max_partial_message_bytes: int | None = None
    #: Server side: connections start with the ``unauthenticated_*`` limits
    #: below (advertised in SETTINGS) until the service vouches for the peer
    #: with :meth:`GrpcConnection.authenticate`, so that a peer without
    #: credentials costs a small, fixed amount.  False: trusted from the start.
    require_authentication: bool = False
    unauthenticated_max_concurrent_streams: int = 4
    unauthenticated_budgets: ConnectionBudgets = UNAUTHENTICATED_BUDGETS
    #: Stream and connection receive windows until authenticated; also the
    #: partial-message budget, so no message spanning frames can be larger.
    unauthenticated_window_size: int = 65_535

    def __post_init__(self) -> None:
        if not 65_535 <= self.initial_window_size <= 2**31 - 1:
            raise ValueError("initial_window_size must be in [65535, 2**31-1]")
        if not 65_535 <= self.connection_window_size <= 2**31 - 1:
            raise ValueError("connection_window_size must be in [65535, 2**31-1]")
        if not 16_384 <= self.max_inbound_frame_size <= 2**24 - 1:
            raise ValueError("max_inbound_frame_size must be in [16384, 2**24-1]")
        if self.max_receive_message_length < 0:
            raise ValueError("max_receive_message_length must be >= 0")
        if self.max_send_message_length is not None and self.max_send_message_length < 0:
            raise ValueError("max_send_message_length must be >= 0 or None")
        if self.max_header_list_size < 1024:
            raise ValueError("max_header_list_size must be >= 1024")
        if self.max_concurrent_streams < 1:
            raise ValueError("max_concurrent_streams must be >= 1")
        if self.keepalive_interval is not None and self.keepalive_interval <= 0:
            raise ValueError("keepalive_interval must be > 0 or None")
        if self.keepalive_timeout <= 0:
            raise ValueError("keepalive_timeout must be > 0")
        if self.max_ping_strikes < 0 or self.min_ping_interval < 0:
            raise ValueError("ping flood settings must be >= 0")
        if self.max_partial_message_bytes is not None and self.max_partial_message_bytes < 0:
            raise ValueError("max_partial_message_bytes must be >= 0 or None")
        if self.unauthenticated_max_concurrent_streams < 1:
            raise ValueError("unauthenticated_max_concurrent_streams must be >= 1")
        if not 65_535 <= self.unauthenticated_window_size <= 2**31 - 1:
            raise ValueError("unauthenticated_window_size must be in [65535, 2**31-1]")

    def limits(self, authenticated: bool) -> tuple[int, int]:
        """(stream window, max concurrent streams) that apply to a peer: the
        unauthenticated ones never exceed the others."""
        if authenticated:
            return self.initial_window_size, self.max_concurrent_streams
        return (min(self.unauthenticated_window_size, self.initial_window_size),
                min(self.unauthenticated_max_concurrent_streams, self.max_concurrent_streams))

    def partial_message_budget(self, authenticated: bool = True) -> int:
        """Bytes of incomplete messages a connection may hold (see
        :attr:`max_partial_message_bytes`): at least one largest message
        must fit, or it could never arrive."""
        if not authenticated:
            return self.limits(False)[0]
        if self.max_partial_message_bytes is not None:
            return self.max_partial_message_bytes
        return max(self.connection_window_size, self.max_receive_message_length + 5)


class LocalProtocolError(LocalUsageError):
    """The caller used the machine wrongly (e.g. a command for a call that
    has already ended, or a server command on a client connection)."""


class InvalidMetadata(LocalProtocolError, MetadataError):
    """Metadata the caller asked to send is not allowed by the spec."""


class CallLimitReached(LocalProtocolError):
    """The peer's SETTINGS_MAX_CONCURRENT_STREAMS is reached: wait for a
    call to end before starting another."""


class MessageTooLarge(LocalProtocolError):
    """A message to send is over ``max_send_message_length``; the call
    should end with :attr:`code` (RESOURCE_EXHAUSTED, as grpcio does)."""

    code = StatusCode.RESOURCE_EXHAUSTED


class EndCause(enum.Enum):
    """Where a :class:`CallEnded` status came from."""

    #: The server's trailers after response headers (client side).
    TRAILERS = "trailers"
    #: A trailers-only response (one HEADERS frame ending the stream).
    TRAILERS_ONLY = "trailers-only"
    #: Synthesized from a malformed or non-gRPC response (non-200 :status,
    #: wrong content-type, missing grpc-status, stream ended without
    #: trailers), from a message over the receive limit or a bad encoding.
    SYNTHESIZED = "synthesized"
    #: The peer sent RST_STREAM (``reset_code`` says which).
    RESET = "reset"
    #: The call's deadline passed.
    DEADLINE = "deadline"
    #: The stream was refused by GOAWAY (stream id above the last id) or
    #: REFUSED_STREAM: the server never saw it, so it is safe to retry.
    REFUSED = "refused"
    #: The connection ended (GOAWAY with an error, protocol error, keepalive
    #: timeout, or :meth:`GrpcConnection.connection_lost`).
    CONNECTION = "connection"


@dataclass(frozen=True, slots=True)
class CallStarted:
    """Server side: a client started a call."""

    stream_id: int
    #: The ``:path``, e.g. ``/package.Service/Method``.
    method: str
    metadata: Metadata
    #: Absolute deadline on the caller's ``now`` scale, or None.
    deadline: float | None
    authority: str | None
    #: The request's ``grpc-encoding`` (None for identity).
    encoding: str | None
    #: Encodings the client accepts for responses (``grpc-accept-encoding``).
    accept_encodings: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class ResponseHeadersReceived:
    """Client side: the server sent its initial metadata (not sent for a
    trailers-only response: then only :class:`CallEnded` arrives)."""

    stream_id: int
    metadata: Metadata
    #: The response's ``grpc-encoding`` (None for identity).
    encoding: str | None


@dataclass(frozen=True, slots=True)
class MessageReceived:
    """One whole gRPC message (decompressed) arrived on a call.

    The caller must pass ``flow_controlled_length`` to
    :meth:`GrpcConnection.acknowledge` once it has consumed the message:
    that is what reopens the peer's send window, so a slow consumer pushes
    back on its sender.
    """

    stream_id: int
    data: bytes
    flow_controlled_length: int
    #: Whether the message arrived with the compressed flag set.
    compressed: bool


@dataclass(frozen=True, slots=True)
class InputEnded:
    """Server side: the client half-closed (no more request messages)."""

    stream_id: int


@dataclass(frozen=True, slots=True)
class CallEnded:
    """A call is over and its stream is gone.

    Client side: the final status of the call, whatever produced it (see
    :attr:`cause`).  Server side: the call ended without the application
    sending its status (the client reset it, the connection died, or the
    machine answered for it: DEADLINE_EXCEEDED when the deadline passed,
    RESOURCE_EXHAUSTED or INTERNAL for a request message it could not
    accept), so the handler must stop; commands on this stream are
    dropped or refused from then on.
    """

    stream_id: int
    status: StatusCode
    message: str
    trailers: Metadata
    cause: EndCause
    #: The HTTP/2 error code of the RST_STREAM, when cause is RESET/REFUSED.
    reset_code: int | None = None


@dataclass(frozen=True, slots=True)
class SendBufferDrained:
    """Everything queued on this call (waiting for flow-control window) has
    been handed to HTTP/2: the sender may produce more (backpressure)."""

    stream_id: int


@dataclass(frozen=True, slots=True)
class GoAwayReceived:
    """The peer sent GOAWAY: calls with stream ids up to ``last_stream_id``
    may still finish, later ones have already ended (REFUSED, UNAVAILABLE)
    and no new call may be started on this connection."""

    last_stream_id: int
    error_code: int
    debug_data: bytes


@dataclass(frozen=True, slots=True)
class PingAcknowledged:
    """A PING sent with :meth:`GrpcConnection.ping` was acknowledged."""

    payload: bytes
    #: Round-trip time in seconds, on the caller's ``now`` scale.
    round_trip_time: float


@dataclass(frozen=True, slots=True)
class ConnectionTerminated:
    """The connection is finished: flush :meth:`GrpcConnection.data_to_send`
    and close the transport.  Every call has already ended with a
    :class:`CallEnded` event."""

    #: HTTP/2 error code (0 for a clean, drained shutdown).
    error_code: int
    #: Human-readable reason (for logs).
    reason: str
    #: True when the peer ended it (GOAWAY received, closed the socket).
    remote: bool


Event = Union[
    CallStarted, ResponseHeadersReceived, MessageReceived, InputEnded,
    CallEnded, SendBufferDrained, GoAwayReceived, PingAcknowledged,
    ConnectionTerminated,
]
