"""W3C Trace Context (https://www.w3.org/TR/trace-context/): ``traceparent`` and ``tracestate``.

Rules this file keeps: pure functions of header values, nothing raises on a client's input. A
malformed ``traceparent`` (a wrong length or version, upper-case or non-hex digits, an all-zero
id, two of them) reads as none, so the request starts a new trace; a malformed ``tracestate``
(a bad key or value, a key twice, more than 32 members) reads as none while its
``traceparent`` still stands, as the specification asks. Neither ever fails a request.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

__all__ = ["TRACEPARENT", "TRACESTATE", "TraceParent", "form_traceparent", "form_tracestate", "header_values",
           "parse_traceparent", "parse_tracestate"]

#: The header names, lower case as HTTP/2 and the task's headers carry them.
TRACEPARENT = "traceparent"
TRACESTATE = "tracestate"

#: Bit 0 of the trace flags: the caller may have recorded this trace (sampled).
SAMPLED = 0x01
#: ``tracestate`` carries at most this many members.
MAX_TRACESTATE_MEMBERS = 32

_HEX = frozenset("0123456789abcdef")
# A simple key, or a multi-tenant ``tenant@system`` key.
_KEY = re.compile(r"(?:[a-z][a-z0-9_\-*/]{0,255}|[a-z0-9][a-z0-9_\-*/]{0,240}@[a-z][a-z0-9_\-*/]{0,13})")
# Printable ASCII but ',' and '=', at most 256 characters, not ending in a space.
_VALUE = re.compile(r"[\x20-\x2b\x2d-\x3c\x3e-\x7e]{0,255}[\x21-\x2b\x2d-\x3c\x3e-\x7e]")


@dataclass(frozen=True, slots=True)
class TraceParent:
    """A caller's span: the trace it belongs to, its id, and its trace flags."""

    trace_id: int
    span_id: int
    flags: int

    @property
    def sampled(self) -> bool:
        """Whether the caller may have recorded its span (the ``sampled`` flag)."""
        return bool(self.flags & SAMPLED)


def header_values(headers: Mapping[str, Sequence[str]], name: str) -> list[str]:
    """Every value of header ``name`` (lower case) in ``headers``, whatever the case of its key."""
    values = headers.get(name)
    if values is not None:
        return list(values)
    found: list[str] = []
    for key, more in headers.items():
        if key.lower() == name:
            found.extend(more)
    return found


def _hex_id(text: str) -> int | None:
    if not set(text) <= _HEX:
        return None
    value = int(text, 16)
    return value or None  # all zeros is invalid


def parse_traceparent(values: Sequence[str]) -> TraceParent | None:
    """The caller's span from the ``traceparent`` header's values, or None: absent, sent twice, or malformed."""
    if len(values) != 1:
        return None
    text = values[0].strip(" \t")
    if len(text) < 55:
        return None
    version = text[:2]
    if not set(version) <= _HEX or version == "ff":
        return None
    # Version 00 is exactly 55 characters; a later version may add fields after the flags.
    if (version == "00" and len(text) != 55) or (len(text) > 55 and text[55] != "-"):
        return None
    if text[2] != "-" or text[35] != "-" or text[52] != "-":
        return None
    trace_id, span_id, flags = _hex_id(text[3:35]), _hex_id(text[36:52]), text[53:55]
    if trace_id is None or span_id is None or not set(flags) <= _HEX:
        return None
    return TraceParent(trace_id, span_id, int(flags, 16))


def form_traceparent(trace_id: int, span_id: int, flags: int) -> str:
    """The ``traceparent`` value (version 00) naming span ``span_id`` of trace ``trace_id``."""
    if not 0 < trace_id < 1 << 128 or not 0 < span_id < 1 << 64 or not 0 <= flags <= 0xFF:
        raise ValueError("a trace id is 128 bits and a span id 64, neither zero; flags are one byte")
    return f"00-{trace_id:032x}-{span_id:016x}-{flags:02x}"


def parse_tracestate(values: Sequence[str]) -> tuple[tuple[str, str], ...] | None:
    """The members of the ``tracestate`` header's values (several combine, in order), or None if
    any is malformed or there are too many; empty members are skipped."""
    members: list[tuple[str, str]] = []
    seen: set[str] = set()
    for value in values:
        for member in value.split(","):
            member = member.strip(" \t")
            if not member:
                continue
            key, sep, text = member.partition("=")
            if not sep or not _KEY.fullmatch(key) or not _VALUE.fullmatch(text) or key in seen:
                return None
            seen.add(key)
            members.append((key, text))
            if len(members) > MAX_TRACESTATE_MEMBERS:
                return None  # at once: a huge header costs no more than 33 members
    return tuple(members)


def form_tracestate(members: Sequence[tuple[str, str]]) -> str:
    """The ``tracestate`` value of ``members`` (keys and values as :func:`parse_tracestate` gives them)."""
    return ",".join(f"{key}={value}" for key, value in members)
