"""Pure header-value helpers: percent-encoding, grpc-timeout, binary metadata."""

import base64

import pytest
from hypothesis import given, settings, strategies as st

from protocol.grpc.metadata import (
    MetadataError,
    decode_binary_value,
    decode_grpc_message,
    decode_metadata,
    decode_timeout,
    encode_grpc_message,
    encode_metadata,
    encode_timeout,
    validate_metadata,
)

# The interop test "special_status_message" string (interop-test-descriptions.md).
SPECIAL = "\t\ntest with whitespace\r\nand Unicode BMP ☺ and non-BMP 😈\t\n"

FAST = settings(max_examples=200, deadline=None)


def test_special_status_message_round_trips_and_is_printable_ascii():
    encoded = encode_grpc_message(SPECIAL)
    assert encoded.isascii() and all(0x20 <= ord(c) < 0x7F for c in encoded)
    assert decode_grpc_message(encoded.encode("ascii")) == SPECIAL


def test_percent_encoding_matches_the_spec_byte_for_byte():
    assert encode_grpc_message("a%b é") == "a%25b %C3%A9"
    assert encode_grpc_message("plain text") == "plain text"


def test_malformed_percent_escapes_are_kept_literally_not_fatal():
    assert decode_grpc_message(b"100% sure %zz %4") == "100% sure %zz %4"
    assert decode_grpc_message(b"%FF") == "\ufffd"


@FAST
@given(st.text())
def test_any_status_message_round_trips(message):
    encoded = encode_grpc_message(message)
    assert all(0x20 <= ord(c) < 0x7F for c in encoded)
    assert decode_grpc_message(encoded.encode("ascii")) == message


@FAST
@given(st.floats(min_value=1e-9, max_value=3.5e11, allow_nan=False))
def test_timeout_encodes_in_at_most_8_digits_and_never_shortens(seconds):
    encoded = encode_timeout(seconds)
    assert 2 <= len(encoded) <= 9 and encoded[:-1].isdigit() and encoded[-1] in "HMSmun"
    decoded = decode_timeout(encoded)
    assert decoded >= seconds * (1 - 1e-12)
    # The finest unit that fits is chosen: at most one unit step of loss.
    assert decoded <= seconds * 1.001 + 1e-9


@FAST
@given(st.integers(min_value=0, max_value=99_999_999), st.sampled_from("HMSmun"))
def test_every_valid_timeout_header_decodes(value, unit):
    scale = {"H": 3600, "M": 60, "S": 1, "m": 1e-3, "u": 1e-6, "n": 1e-9}[unit]
    assert decode_timeout(f"{value}{unit}") == pytest.approx(value * scale)


@pytest.mark.parametrize("bad", ["", "1", "123456789S", "1s", "-1S", "1.5S", " 1S", "1 S"])
def test_malformed_timeouts_are_rejected(bad):
    with pytest.raises(MetadataError):
        decode_timeout(bad)


def test_timeouts_beyond_99999999_hours_are_clamped():
    assert encode_timeout(1e15) == "99999999H"


def test_expired_timeout_encodes_as_zero():
    assert encode_timeout(0) == "0n"
    assert encode_timeout(-5) == "0n"


_keys = st.from_regex(r"\A[a-z0-9_.\-]{1,12}\Z").filter(
    lambda k: not k.startswith("grpc-") and not k.endswith("-bin")
    and k not in {"te", "content-type", "connection", "host", "upgrade", "keep-alive",
                  "transfer-encoding", "proxy-connection"})


@FAST
@given(st.lists(st.one_of(
    st.tuples(_keys, st.from_regex(r"\A[\x20-\x7e]*\Z")),
    st.tuples(_keys.map(lambda k: k + "-bin"), st.binary(max_size=40)),
), max_size=6))
def test_metadata_round_trips_through_headers(pairs):
    metadata = validate_metadata(pairs)
    headers = encode_metadata(metadata)
    for key, value in headers:
        if key.endswith(b"-bin"):
            assert not value.endswith(b"="), "binary values are sent unpadded"
    assert decode_metadata(headers) == tuple(pairs)


def test_binary_values_accept_padding_and_comma_joined_values():
    padded = base64.b64encode(b"\x00\x01").decode()
    assert padded.endswith("=")
    assert decode_binary_value(padded.encode()) == [b"\x00\x01"]
    joined = b"AAE, " + base64.b64encode(b"xyz")
    assert decode_metadata([(b"k-bin", joined)]) == (("k-bin", b"\x00\x01"), ("k-bin", b"xyz"))


def test_malformed_base64_is_a_metadata_error():
    with pytest.raises(MetadataError):
        decode_binary_value(b"!!!")


@pytest.mark.parametrize("pairs", [
    [("grpc-status", "0")], [("grpc-foo", "x")], [("content-type", "x")], [("Upper", "x")],
    [("k", "caf\u00e9")], [("k", "line\nbreak")], [("k-bin", "not bytes")], [("k", b"bytes")],
])
def test_reserved_or_invalid_metadata_is_refused_before_sending(pairs):
    with pytest.raises(MetadataError):
        validate_metadata(pairs)


def test_received_protocol_headers_are_not_application_metadata():
    headers = [(b":status", b"200"), (b"content-type", b"application/grpc"),
               (b"grpc-status", b"0"), (b"grpc-message", b"x"), (b"grpc-encoding", b"gzip"),
               (b"x-user", b"1"), (b"grpc-status-details-bin", b"AAE")]
    assert decode_metadata(headers) == (("x-user", "1"), ("grpc-status-details-bin", b"\x00\x01"))
