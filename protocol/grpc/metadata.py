"""gRPC header values as pure functions: no I/O, no clock reads, no state.

Everything here converts between what an application means (a status
message, a timeout in seconds, metadata pairs) and the exact bytes gRPC puts
in HTTP/2 headers, following grpc/grpc ``doc/PROTOCOL-HTTP2.md``.  Encoders
are strict (they raise :class:`MetadataError` on values the spec forbids);
decoders are lenient where the spec asks for leniency (padded base64,
malformed percent-escapes) and strict where accepting would hide a peer bug
(a malformed ``grpc-timeout``).
"""

from __future__ import annotations

import base64
import binascii
import enum
import re
from collections.abc import Iterable

MetadataValue = str | bytes
#: Custom metadata: ordered (key, value) pairs; keys are lowercase ASCII,
#: values of ``-bin`` keys are bytes, all other values are printable ASCII str.
Metadata = tuple[tuple[str, MetadataValue], ...]


class StatusCode(enum.IntEnum):
    """The canonical gRPC status codes (grpc/grpc ``doc/statuscodes.md``)."""

    OK = 0
    CANCELLED = 1
    UNKNOWN = 2
    INVALID_ARGUMENT = 3
    DEADLINE_EXCEEDED = 4
    NOT_FOUND = 5
    ALREADY_EXISTS = 6
    PERMISSION_DENIED = 7
    RESOURCE_EXHAUSTED = 8
    FAILED_PRECONDITION = 9
    ABORTED = 10
    OUT_OF_RANGE = 11
    UNIMPLEMENTED = 12
    INTERNAL = 13
    UNAVAILABLE = 14
    DATA_LOSS = 15
    UNAUTHENTICATED = 16


class MetadataError(ValueError):
    """A header value that the gRPC spec does not allow (local misuse when
    encoding, a malformed peer header when decoding)."""


# ---------------------------------------------------------------------------
# grpc-message: percent-encoding of UTF-8 (PROTOCOL-HTTP2 "Status-Message")

_UNRESERVED = frozenset(range(0x20, 0x7F)) - {ord("%")}
_PERCENT_TABLE = [chr(b) if b in _UNRESERVED else f"%{b:02X}" for b in range(256)]
_PERCENT_RE = re.compile(rb"%([0-9A-Fa-f]{2})")


def encode_grpc_message(message: str) -> str:
    """Percent-encode a status message: UTF-8, then every byte outside
    printable ASCII (and ``%`` itself) as ``%XX``."""
    if message.isascii() and message.isprintable() and "%" not in message:
        return message
    return "".join([_PERCENT_TABLE[b] for b in message.encode("utf-8")])


def decode_grpc_message(value: bytes | str) -> str:
    """Undo :func:`encode_grpc_message`.

    The spec says a receiver must not fail on a malformed message: a ``%``
    not followed by two hex digits is kept literally, and bytes that are
    not valid UTF-8 become U+FFFD.
    """
    raw = value.encode("latin-1") if isinstance(value, str) else value
    if b"%" in raw:
        raw = _PERCENT_RE.sub(lambda m: bytes([int(m.group(1), 16)]), raw)
    return raw.decode("utf-8", errors="replace")


# ---------------------------------------------------------------------------
# grpc-timeout (PROTOCOL-HTTP2 "Timeout"): at most 8 digits and a unit

_TIMEOUT_UNITS: tuple[tuple[str, float], ...] = (
    ("n", 1e-9), ("u", 1e-6), ("m", 1e-3), ("S", 1.0), ("M", 60.0), ("H", 3600.0),
)
_TIMEOUT_SECONDS = dict(_TIMEOUT_UNITS)
_TIMEOUT_INT_UNITS = (("n", 1), ("u", 1_000), ("m", 1_000_000), ("S", 1_000_000_000),
                      ("M", 60_000_000_000), ("H", 3_600_000_000_000))
_TIMEOUT_RE = re.compile(r"\A([0-9]{1,8})([HMSmun])\Z")
_MAX_TIMEOUT_VALUE = 99_999_999


def encode_timeout(seconds: float) -> str:
    """Encode a timeout in the finest unit whose value fits in 8 digits.

    The value is rounded *up* so the peer never sees a shorter deadline than
    ours; timeouts beyond 99,999,999 hours are clamped (that is ~11,000
    years).  A timeout <= 0 encodes as ``0n`` (already expired).
    """
    if seconds != seconds:  # NaN
        raise MetadataError("timeout is NaN")
    if seconds <= 0:
        return "0n"
    nanos = int(seconds * 1e9)
    if nanos < seconds * 1e9:
        nanos += 1
    for unit, size in _TIMEOUT_INT_UNITS:
        value = -(-nanos // size)
        if value <= _MAX_TIMEOUT_VALUE:
            return f"{value}{unit}"
    return f"{_MAX_TIMEOUT_VALUE}H"


def decode_timeout(value: bytes | str) -> float:
    """Decode a ``grpc-timeout`` header to seconds; :class:`MetadataError`
    if it is not 1-8 ASCII digits followed by one of ``HMSmun``."""
    text = value.decode("ascii", errors="replace") if isinstance(value, bytes) else value
    match = _TIMEOUT_RE.match(text)
    if match is None:
        raise MetadataError(f"malformed grpc-timeout {text!r}")
    return int(match.group(1)) * _TIMEOUT_SECONDS[match.group(2)]


# ---------------------------------------------------------------------------
# Custom metadata

_KEY_RE = re.compile(r"\A[0-9a-z_.\-]+\Z")
_ASCII_VALUE_RE = re.compile(r"\A[\x20-\x7e]*\Z")

#: Headers that carry gRPC or HTTP/2 protocol state rather than application
#: metadata; they are never surfaced as custom metadata and may not be sent
#: as such.
PROTOCOL_HEADERS = frozenset({
    "te", "content-type", "grpc-timeout", "grpc-encoding", "grpc-accept-encoding",
    "grpc-status", "grpc-message", "grpc-message-type", "connection",
    "transfer-encoding", "upgrade", "keep-alive", "proxy-connection", "host",
})


def validate_metadata(metadata: Iterable[tuple[str, MetadataValue]]) -> Metadata:
    """Check application metadata before sending it and return it as a tuple.

    Keys must be lowercase ``[0-9a-z_.-]``, must not be reserved (``grpc-``
    prefixed, except ``grpc-status-details-bin``, or one of
    :data:`PROTOCOL_HEADERS`) and ``-bin`` keys take bytes while the others
    take printable ASCII.  Raises :class:`MetadataError`.
    """
    checked = tuple(metadata)
    for key, value in checked:
        if not isinstance(key, str) or not _KEY_RE.match(key):
            raise MetadataError(f"invalid metadata key {key!r}")
        if key in PROTOCOL_HEADERS or (key.startswith("grpc-") and key != "grpc-status-details-bin"):
            raise MetadataError(f"metadata key {key!r} is reserved")
        if key.endswith("-bin"):
            if not isinstance(value, (bytes, bytearray, memoryview)):
                raise MetadataError(f"value of binary key {key!r} must be bytes")
        elif not isinstance(value, str) or not _ASCII_VALUE_RE.match(value):
            raise MetadataError(f"value of {key!r} must be printable ASCII str")
    return checked


def encode_metadata(metadata: Metadata) -> list[tuple[bytes, bytes]]:
    """Turn validated metadata into header pairs; binary values are sent as
    unpadded base64, as the spec recommends."""
    headers: list[tuple[bytes, bytes]] = []
    for key, value in metadata:
        if isinstance(value, str):
            headers.append((key.encode("ascii"), value.encode("ascii")))
        else:
            headers.append((key.encode("ascii"), base64.b64encode(value).rstrip(b"=")))
    return headers


def decode_binary_value(value: bytes) -> list[bytes]:
    """Decode a ``-bin`` header value: comma-separated base64 parts
    (a peer or proxy may join repeated headers), padded or not."""
    parts = value.split(b",")
    decoded = []
    for part in parts:
        part = part.strip()
        try:
            decoded.append(base64.b64decode(part + b"=" * (-len(part) % 4), validate=True))
        except binascii.Error as exc:
            raise MetadataError(f"malformed base64 in binary metadata: {part!r}") from exc
    return decoded


def decode_metadata(headers: Iterable[tuple[bytes, bytes]]) -> Metadata:
    """Extract the application's metadata from received headers.

    Pseudo-headers and :data:`PROTOCOL_HEADERS` are dropped, ``-bin``
    values are base64-decoded (a comma-joined value becomes several pairs),
    other values are decoded as ASCII (undecodable bytes are replaced, never
    fatal).
    """
    result: list[tuple[str, MetadataValue]] = []
    for raw_key, raw_value in headers:
        if raw_key[:1] == b":":
            continue
        key = raw_key.decode("ascii", errors="replace")
        if key in PROTOCOL_HEADERS:
            continue
        if key.endswith("-bin"):
            for item in decode_binary_value(raw_value):
                result.append((key, item))
        else:
            result.append((key, raw_value.decode("ascii", errors="replace")))
    return tuple(result)
