"""Hostile server-sent events from runtimes, on both sides of the wire.

Engine side: :class:`~protocol.openai.sse.SSEBlockSplitter` cuts a runtime's stream
into the events ``ServerSentEvent.data`` carries. Gateway side:
:class:`~infx.http.api.CompletionTransform` turns chat events back into legacy
completion events. Fed any bytes (lone CRs, NULs, invalid UTF-8, no blank
lines, JSON that is not a chunk), each gives events or the runtime's 502
(:class:`~protocol.openai.errors.UpstreamError`), never anything else, and the
splitter's output does not depend on how the bytes were cut.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from infx.http.api import CompletionTransform
from protocol.openai.errors import UpstreamError
from protocol.openai.sse import SSEBlockSplitter
from tools.fuzz.drivers import check_runtime_answer

FEW = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])

stream_bytes = st.lists(
    st.sampled_from([b"\r", b"\n", b"\r\n", b"data: ", b"data:", b": c", b"event: x", b"id: 1", b"{", b"}",
                     b'{"choices": [{"delta": {"content": "w"}}]}', b"[DONE]", b"\x00", b"\xff\xfe", b"retry: 9"])
    | st.binary(max_size=8),
    max_size=40,
).map(b"".join)


def split_all(data: bytes, cuts: list[int], bound: int | None) -> list[bytes] | str:
    splitter = SSEBlockSplitter(max_event_size=bound)
    events: list[bytes] = []
    points = sorted({c % (len(data) + 1) for c in cuts} | {0, len(data)})
    try:
        for a, b in zip(points, points[1:]):
            events += splitter.receive_data(data[a:b])
    except UpstreamError as error:
        assert error.status == 502
        return "too large"
    tail = splitter.end_of_stream()
    return events + ([tail] if tail else [])


@FEW
@given(stream_bytes, st.lists(st.integers(0, 400), max_size=8))
def test_any_runtime_bytes_split_anywhere_give_the_same_events(data, cuts):
    whole = split_all(data, [], None)
    assert split_all(data, cuts, None) == whole
    assert isinstance(whole, list)
    for event in whole:
        assert event.endswith((b"\n\n", b"\r\r", b"\r\n\r\n", b"\n\r\n", b"\r\n\n", b"\n\r", b"\r\n\r", b"\r\r\n"))
    # Nothing is lost or invented: the events are the stream minus the blank
    # lines between them (and the closing blank line end_of_stream adds).
    assert b"".join(whole).replace(b"\r", b"").replace(b"\n", b"") == data.replace(b"\r", b"").replace(b"\n", b"")


@FEW
@given(stream_bytes, st.lists(st.integers(0, 400), max_size=8), st.integers(1, 64))
def test_a_bounded_splitter_gives_events_or_502_never_more_than_the_bound(data, cuts, bound):
    result = split_all(data, cuts, bound)
    if result != "too large":
        # The bound is on what waits unfinished; complete events pass whole.
        assert b"".join(result).replace(b"\r", b"").replace(b"\n", b"") == \
            data.replace(b"\r", b"").replace(b"\n", b"")


@FEW
@given(stream_bytes)
def test_any_event_data_from_an_engine_converts_for_completions_or_is_a_502(data):
    transform = CompletionTransform()
    try:
        out = transform.event(data)
    except UpstreamError as error:
        assert error.status == 502 and json.loads(error.to_json())["error"]["message"]
        return
    for block in out.split(b"\n\n"):
        if block.startswith(b"data: ") and block != b"data: [DONE]":
            json.loads(block[len(b"data: "):])
    check_runtime_answer(data)


@pytest.mark.parametrize("body", [
    b"", b"null", b"[]", b'{"choices": 3}', b'{"choices": [3]}', b'{"choices": [{"message": []}]}',
    b'{"choices": [{"message": {"content": 5}}]}', b"[" * 50_000, b"\xff", b'{"error": {"message": "x"}}',
])
def test_whole_runtime_answers_convert_or_are_a_502(body):
    check_runtime_answer(body)
