"""A tiny, independent protobuf encoder for writing expected bytes by hand.

Golden tests spell each message out field by field with these helpers, so the
expected bytes come from the field numbers written in the test and never from
the generated code under test.
"""

from __future__ import annotations

import struct

VARINT, I64, LEN = 0, 1, 2


def varint(value: int) -> bytes:
    if value < 0:
        value += 1 << 64
    out = bytearray()
    while True:
        low = value & 0x7F
        value >>= 7
        if value:
            out.append(low | 0x80)
        else:
            out.append(low)
            return bytes(out)


def tag(number: int, wire_type: int) -> bytes:
    return varint(number << 3 | wire_type)


def uint(number: int, value: int) -> bytes:
    return tag(number, VARINT) + varint(value)


def boolean(number: int) -> bytes:
    return uint(number, 1)


def double(number: int, value: float) -> bytes:
    return tag(number, I64) + struct.pack("<d", value)


def ld(number: int, payload: bytes | str) -> bytes:
    """A length-delimited field: string, bytes or embedded message."""
    if isinstance(payload, str):
        payload = payload.encode()
    return tag(number, LEN) + varint(len(payload)) + payload
