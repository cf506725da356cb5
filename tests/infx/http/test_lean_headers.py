"""LeanHeaders answers as twisted.web's Headers does, whatever it is given: it is only a shorter path."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from twisted.web.http_headers import Headers, InvalidHeaderName

from infx.http.headers import LeanHeaders

NAMES = st.sampled_from([b"content-type", b"Content-Type", b"x-request-id", b"ETag", b"www-authenticate",
                         "content-type", "X-Custom", b"dnt", b"te"])
VALUES = st.one_of(st.binary(max_size=12), st.text(max_size=12),
                   st.sampled_from([b"a\r\nInjected: yes", b"a\nb", b"a\rb", "x\r\ny"]))
OPERATIONS = st.lists(st.one_of(
    st.tuples(st.just("set"), NAMES, st.lists(VALUES, max_size=3)),
    st.tuples(st.just("add"), NAMES, VALUES),
    st.tuples(st.just("remove"), NAMES),
), max_size=12)


def _apply(headers: Headers, operations: list[tuple[Any, ...]]) -> None:
    for operation in operations:
        if operation[0] == "set":
            headers.setRawHeaders(operation[1], operation[2])
        elif operation[0] == "add":
            headers.addRawHeader(operation[1], operation[2])
        else:
            headers.removeHeader(operation[1])


@given(OPERATIONS)
def test_every_sequence_of_writes_reads_back_as_twisted_headers_read_it(operations: list[tuple[Any, ...]]) -> None:
    twisted, lean = Headers(), LeanHeaders()
    _apply(twisted, operations)
    _apply(lean, operations)
    assert list(lean.getAllRawHeaders()) == list(twisted.getAllRawHeaders())
    for name in (b"content-type", "content-type", b"X-Request-Id", "x-custom", b"etag", b"absent", "absent"):
        assert lean.hasHeader(name) == twisted.hasHeader(name)
        assert _answer(lean.getRawHeaders, name) == _answer(twisted.getRawHeaders, name)
        assert _answer(lean.getRawHeaders, name, "default") == _answer(twisted.getRawHeaders, name, "default")


def _answer(read: Any, *args: Any) -> Any:
    """What a read returns, or the type of what it raises (a str name decodes the values as UTF-8)."""
    try:
        return read(*args)
    except Exception as error:
        return type(error)


def test_a_value_with_a_line_break_cannot_inject_a_header_and_a_bad_name_is_refused() -> None:
    lean = LeanHeaders()
    lean.setRawHeaders(b"x-a", [b"one\r\nInjected: yes"])
    lean.addRawHeader(b"x-b", b"two\nInjected: yes")
    assert lean.getRawHeaders(b"x-a") == [b"one Injected: yes"]
    assert lean.getRawHeaders(b"x-b") == [b"two Injected: yes"]
    for bad in (b"bad name", b"bad\r\nname", b""):
        with pytest.raises(InvalidHeaderName):
            lean.setRawHeaders(bad, [b"v"])
        with pytest.raises(InvalidHeaderName):
            lean.addRawHeader(bad, b"v")


FIELD_NAMES = st.sampled_from([b"content-type", b"Content-Type", b"X-Request-Id", b"x-request-id", b"Authorization",
                               b"te", b"TE", b"x-custom", b"Host", b"Cookie"])
FIELD_VALUES = st.one_of(st.binary(max_size=10), st.sampled_from([b"a\rb", b"a\nb", b"", b"v"]))


@given(st.lists(st.tuples(FIELD_NAMES, FIELD_VALUES), max_size=10))
def test_a_lean_request_reads_its_fields_as_parsed_as_twisted_headers_read_them(
        fields: list[tuple[bytes, bytes]]) -> None:
    """getHeader and the forwarded headers read the fields as parsed (no Headers built) and give what
    they give once Headers is built, line breaks and repeated names included."""
    from io import BytesIO

    from infx.http.api import _forwarded_headers
    from infx.http.lean import LeanRequest

    def request() -> LeanRequest:
        return LeanRequest(None, b"POST", b"/v1/chat/completions", b"HTTP/1.1", list(fields),  # type: ignore[arg-type]
                           BytesIO(), True)

    lean, built = request(), request()
    built.requestHeaders  # made: every read goes through Headers
    assert built.header_pairs is None and lean.header_pairs == fields
    for name in (b"content-type", b"x-request-id", b"TE", b"x-custom", b"absent"):
        assert lean.getHeader(name) == built.getHeader(name)
    if not any(b"\r" in value or b"\n" in value for _, value in fields):
        assert lean.header_pairs is not None  # reading a header made no Headers
    assert _forwarded_headers(lean, "rid") == _forwarded_headers(built, "rid")
