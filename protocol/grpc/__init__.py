"""gRPC over HTTP/2, client and server roles, as a sans-IO machine: :class:`GrpcConnection`.

``connection`` is the public machine and ``types`` its configuration, events and errors;
its parts are objects it holds, not base classes: ``calls`` (``ConnectionState``: the h2
machine, the calls, ending them, the send path), ``receive`` (``Inbound``: what each received
HTTP/2 event does) and ``liveness`` (``Liveness``: pings, keepalive, the drain ping); ``wire``
holds the message prefix, header and status tables;
``metadata`` codes header values; ``h2_budgets`` and ``h2_tuned`` are the HTTP/2 layer under
it; ``channel`` is a client channel's connectivity, redial backoff and transparent retry.

The names below are what ``protocol.grpc`` exported when it was one module, so
``from protocol.grpc import GrpcConnection, StatusCode`` keeps working.
"""

from protocol.grpc.connection import GrpcConnection
from protocol.grpc.h2_budgets import ConnectionBudgets
from protocol.grpc.metadata import (
    Metadata,
    MetadataError,
    MetadataValue,
    StatusCode,
    decode_grpc_message,
    decode_timeout,
    encode_grpc_message,
    encode_timeout,
)
from protocol.grpc.types import (
    GOAWAY_ACK_TIMEOUT,
    CallEnded,
    CallLimitReached,
    CallStarted,
    ConnectionTerminated,
    EndCause,
    Event,
    GoAwayReceived,
    GrpcConfig,
    InputEnded,
    InvalidMetadata,
    LocalProtocolError,
    MessageReceived,
    MessageTooLarge,
    PingAcknowledged,
    ResponseHeadersReceived,
    SendBufferDrained,
)
from protocol.grpc.wire import status_for_http, status_for_reset

__all__ = [
    "CallEnded", "CallLimitReached", "CallStarted", "ConnectionBudgets", "ConnectionTerminated",
    "EndCause", "Event",
    "GOAWAY_ACK_TIMEOUT",
    "GoAwayReceived", "GrpcConfig", "GrpcConnection", "InputEnded", "InvalidMetadata",
    "LocalProtocolError", "MessageReceived", "MessageTooLarge", "Metadata",
    "MetadataError", "MetadataValue", "PingAcknowledged",
    "ResponseHeadersReceived", "SendBufferDrained", "StatusCode",
    "decode_grpc_message", "decode_timeout", "encode_grpc_message",
    "encode_timeout", "status_for_http", "status_for_reset",
]
