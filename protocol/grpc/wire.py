"""The gRPC wire, below the connection: message prefix, header and status
rules, and one call's state record.

Rules this file keeps: pure data and functions (no I/O, no clock); what
grpc/grpc ``doc/PROTOCOL-HTTP2.md`` and ``doc/http-grpc-status-mapping.md``
prescribe is a table here, used by :mod:`protocol.grpc` and its parts.
"""

from __future__ import annotations

import enum
import struct
from collections import deque
from collections.abc import Hashable

import h2.errors

from protocol.errors import RemoteProtocolError
from protocol.grpc.metadata import (
    Metadata,
    MetadataError,
    StatusCode,
    decode_grpc_message,
    validate_metadata,
)
from protocol.grpc.types import InvalidMetadata

__all__ = [
    "ACCEPT_ENCODING", "CallFailed", "CallState", "ERR", "HTTP_STATUS", "PIECE_MIN", "PREFIX",
    "Phase", "RESET_STATUS", "SUPPORTED_ENCODINGS", "TINY_WINDOW_UPDATE", "checked_metadata",
    "header_list_size", "header_map", "parse_status", "status_for_http", "status_for_reset",
]


def checked_metadata(metadata: Metadata) -> Metadata:
    try:
        return validate_metadata(metadata)
    except MetadataError as exc:
        raise InvalidMetadata(str(exc)) from exc


PREFIX = struct.Struct(">BI")
#: Pieces of a message spanning frames at least this large are kept by
#: reference until the message is complete; smaller ones are copied
#: together at once.
PIECE_MIN = 8 * 1024
#: WINDOW_UPDATE increments below this count as frames that do nothing.
TINY_WINDOW_UPDATE = 1024
SUPPORTED_ENCODINGS = ("identity", "gzip")
ACCEPT_ENCODING = b"identity,gzip"
ERR = h2.errors.ErrorCodes

#: PROTOCOL-HTTP2 "Errors": RST_STREAM code received -> status.
RESET_STATUS = {
    ERR.NO_ERROR: StatusCode.INTERNAL,
    ERR.PROTOCOL_ERROR: StatusCode.INTERNAL,
    ERR.INTERNAL_ERROR: StatusCode.INTERNAL,
    ERR.FLOW_CONTROL_ERROR: StatusCode.INTERNAL,
    ERR.SETTINGS_TIMEOUT: StatusCode.INTERNAL,
    ERR.STREAM_CLOSED: StatusCode.INTERNAL,
    ERR.FRAME_SIZE_ERROR: StatusCode.INTERNAL,
    ERR.REFUSED_STREAM: StatusCode.UNAVAILABLE,
    ERR.CANCEL: StatusCode.CANCELLED,
    ERR.COMPRESSION_ERROR: StatusCode.INTERNAL,
    ERR.CONNECT_ERROR: StatusCode.INTERNAL,
    ERR.ENHANCE_YOUR_CALM: StatusCode.RESOURCE_EXHAUSTED,
    ERR.INADEQUATE_SECURITY: StatusCode.PERMISSION_DENIED,
    ERR.HTTP_1_1_REQUIRED: StatusCode.INTERNAL,
}

#: grpc/grpc doc/http-grpc-status-mapping.md: HTTP status without a
#: grpc-status -> status.
HTTP_STATUS = {
    400: StatusCode.INTERNAL,
    401: StatusCode.UNAUTHENTICATED,
    403: StatusCode.PERMISSION_DENIED,
    404: StatusCode.UNIMPLEMENTED,
    429: StatusCode.UNAVAILABLE,
    502: StatusCode.UNAVAILABLE,
    503: StatusCode.UNAVAILABLE,
    504: StatusCode.UNAVAILABLE,
}


def status_for_reset(error_code: int) -> StatusCode:
    """The gRPC status a client reports for a received RST_STREAM code."""
    try:
        return RESET_STATUS[ERR(error_code)]
    except ValueError:
        return StatusCode.INTERNAL


def status_for_http(http_status: int) -> StatusCode:
    """The gRPC status for a non-200 HTTP response without grpc-status."""
    return HTTP_STATUS.get(http_status, StatusCode.UNKNOWN)


class Phase(enum.Enum):
    """Where a call is, as far as the application is concerned.

    Client: WAITING_HEADERS -> RECEIVING -> (removed on CallEnded).
    Server: WAITING_HEADERS (no response headers sent) -> RECEIVING
    (headers sent) -> CLOSING (status queued behind flow control) ->
    (removed once the status is written).
    """

    WAITING_HEADERS = "waiting-headers"
    RECEIVING = "receiving"
    CLOSING = "closing"


class CallState:
    """Per-stream state: reassembly, the send queue and the phase."""

    __slots__ = (
        "stream_id", "phase", "deadline", "send_encoding", "recv_encoding",
        "accept_encodings", "buf", "parts", "have", "need", "msg_flag", "in_body",
        "discarding",
        "pending", "pending_bytes", "pending_end", "unacked", "remote_closed",
        "local_closed", "window_announced", "queued_by_key", "key_by_part", "drain_owed",
    )

    def __init__(self, stream_id: int, deadline: float | None) -> None:
        self.stream_id = stream_id
        self.phase = Phase.WAITING_HEADERS
        self.deadline = deadline
        self.send_encoding: str | None = None
        self.recv_encoding: str | None = None
        self.accept_encodings: tuple[str, ...] = ()
        # Reassembly: bytes of the current prefix or body seen so far.
        self.buf = bytearray()
        # Reassembly of a body that spans frames: its pieces, not copied
        # until the last one arrives, and their total length.
        self.parts: list[bytes | bytearray] = []
        self.have = 0
        self.need = 5
        self.msg_flag = 0
        self.in_body = False
        # After a receive-side error the rest of the stream is dropped.
        self.discarding = False
        # Send queue: framed bytes waiting for window, then maybe an end.
        self.pending: deque[bytes | memoryview] = deque()
        self.pending_bytes = 0
        self.pending_end: list[tuple[bytes, bytes]] | bool | None = None
        # Messages queued with a key (``send_message(key=...)``) and none of
        # whose bytes went to HTTP/2 yet: key -> the message's first queued
        # buffer, and that buffer's id -> key (the send path forgets a key as
        # it hands the buffer over). None until a keyed message is queued.
        self.queued_by_key: dict[Hashable, bytes] | None = None
        self.key_by_part: dict[int, Hashable] | None = None
        # The queue was emptied by withdrawing messages, not by the peer
        # reading: SendBufferDrained waits until the peer takes bytes again
        # (messages queued since are handed over, or its window is open).
        self.drain_owed = False
        self.unacked = 0
        self.remote_closed = False
        self.local_closed = False
        # grpc-core opens each stream's window by the 5 bytes of the first
        # message prefix it will read: one tiny WINDOW_UPDATE that is no flood.
        self.window_announced = False

    def clear_queue(self) -> None:
        """Drop every queued message (the call ended, or was reset)."""
        self.pending.clear()
        self.pending_bytes = 0
        self.queued_by_key = self.key_by_part = None
        self.drain_owed = False


def header_map(headers: list[tuple[bytes, bytes]]) -> dict[bytes, bytes]:
    """First value of each header name (gRPC's reserved headers are single)."""
    result: dict[bytes, bytes] = {}
    for name, value in headers:
        if name not in result:
            result[name] = value
    return result


def header_list_size(headers: list[tuple[bytes, bytes]]) -> int:
    """RFC 7540 6.5.2: name + value + 32 per header."""
    return sum(len(name) + len(value) + 32 for name, value in headers)


def parse_status(fields: dict[bytes, bytes]) -> tuple[StatusCode, str] | None:
    raw = fields.get(b"grpc-status")
    if raw is None:
        return None
    message = decode_grpc_message(fields.get(b"grpc-message", b""))
    try:
        value = int(raw)
    except ValueError:
        return StatusCode.UNKNOWN, f"malformed grpc-status {raw!r}: {message}"
    try:
        return StatusCode(value), message
    except ValueError:
        return StatusCode.UNKNOWN, message


class CallFailed(RemoteProtocolError):
    """Internal: a received message or header breaks this call alone."""

    def __init__(self, code: StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
