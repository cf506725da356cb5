"""SSE parser and encoder: HTML-standard event-stream semantics, any split of the bytes, bounded event size."""

import json
import re

import pytest
from hypothesis import given, settings, strategies as st

from protocol.openai.errors import InvalidRequestError
from protocol.openai.errors import OpenAIUsageError
from protocol.openai.sse import (
    DONE_EVENT,
    EventReceived,
    EventTooLarge,
    RetryReceived,
    SSEBlockSplitter,
    SSEParser,
    encode_event,
    encode_json,
    ends_with_done,
)

SETTINGS = settings(max_examples=200, deadline=None)


def parse(data, parser=None):
    return (parser or SSEParser()).receive_data(data)


def parse_bytewise(data):
    parser = SSEParser()
    events = []
    for i in range(len(data)):
        events += parser.receive_data(data[i:i + 1])
    return events


def reference(stream: bytes):
    """The HTML standard's algorithm, written the obvious way over the whole stream."""
    text = stream.decode("utf-8", "replace")
    if text.startswith("\ufeff"):
        text = text[1:]
    lines = re.split(r"\r\n|\r|\n", text)[:-1]  # the text after the last line end is not a line
    events, data, event_type, last_id = [], [], "", ""
    for line in lines:
        if line == "":
            if data:
                events.append(EventReceived("\n".join(data), event_type or "message", last_id))
            data, event_type = [], ""
            continue
        if line.startswith(":"):
            continue
        name, colon, value = line.partition(":")
        if colon and value.startswith(" "):
            value = value[1:]
        if name == "data":
            data.append(value)
        elif name == "event":
            event_type = value
        elif name == "id" and "\0" not in value:
            last_id = value
        elif name == "retry" and value.isascii() and value.isdigit():
            events.append(RetryReceived(int(value)))
    return events


def test_data_lines_join_with_lf_and_a_blank_line_dispatches():
    events = parse(b"data: one\ndata:two\ndata\n\ndata: [DONE]\n\n")
    assert events == [EventReceived("one\ntwo\n"), EventReceived("[DONE]")]


@pytest.mark.parametrize("eol", [b"\n", b"\r\n", b"\r"])
def test_every_line_ending_style_is_understood(eol):
    stream = eol.join([b"event: add", b"id: 7", b"data: a", b"data: b", b"", b""])
    assert parse(stream) == [EventReceived("a\nb", "add", "7")]
    assert parse_bytewise(stream) == [EventReceived("a\nb", "add", "7")]


def test_comments_unknown_fields_and_empty_events_are_ignored():
    assert parse(b": keep-alive\n\nfoo: bar\n\nevent: x\n\ndata: y\n\n") == [EventReceived("y")]


def test_only_one_leading_space_is_stripped_and_the_first_colon_splits():
    assert parse(b"data:  two spaces: and a colon\n\n") == [EventReceived(" two spaces: and a colon")]


def test_last_event_id_persists_and_an_id_with_nul_is_ignored():
    events = parse(b"id: 1\ndata: a\n\ndata: b\n\nid: 2\x00\ndata: c\n\nid\ndata: d\n\n")
    assert [e.last_event_id for e in events] == ["1", "1", "1", ""]


def test_retry_takes_only_digits():
    assert parse(b"retry: 1500\nretry: 1s\n\n") == [RetryReceived(1500)]


def test_a_leading_bom_is_dropped_even_when_split():
    parser = SSEParser()
    assert parser.receive_data(b"\xef") == [] and parser.receive_data(b"\xbb") == []
    assert parser.receive_data(b"\xbfdata: x\n\n") == [EventReceived("x")]
    assert parse(b"data: x\n\n\xef\xbb\xbfdata: y\n\n") == [EventReceived("x")]  # only at the start


def test_a_crlf_split_between_two_reads_is_one_line_end():
    parser = SSEParser()
    assert parser.receive_data(b"data: a\r") == []
    assert parser.receive_data(b"\n\r") == [EventReceived("a")]
    assert parser.receive_data(b"\ndata: b\r\n\r\n") == [EventReceived("b")]


def test_an_unfinished_event_is_not_dispatched():
    parser = SSEParser()
    assert parser.receive_data(b"data: a\ndata: b\n") == []
    assert parser.receive_data(b"data: c") == []


def test_events_larger_than_4_kib_arrive_whole_in_any_split():
    payload = json.dumps({"content": "x" * 1_000_000})
    stream = encode_event(payload) + DONE_EVENT
    parser = SSEParser()
    events = []
    for i in range(0, len(stream), 4093):
        events += parser.receive_data(stream[i:i + 4093])
    assert events == [EventReceived(payload), EventReceived("[DONE]")]


def test_an_event_past_the_bound_raises_instead_of_growing_and_the_parser_then_refuses_data():
    parser = SSEParser(max_event_size=100)
    assert parser.receive_data(b"data: " + b"x" * 80 + b"\n\n") == [EventReceived("x" * 80)]
    with pytest.raises(EventTooLarge) as info:
        for _ in range(20):
            parser.receive_data(b"data: 0123456789\n")
    assert info.value.status == 502
    with pytest.raises(OpenAIUsageError):
        parser.receive_data(b"\n")
    with pytest.raises(EventTooLarge):
        SSEParser(max_event_size=100).receive_data(b"data: " + b"y" * 200)  # no line end at all


def test_no_bound_when_max_event_size_is_none():
    assert parse(b"data: " + b"z" * 100 + b"\n\n", SSEParser(max_event_size=None)) == [EventReceived("z" * 100)]


stream_tokens = st.sampled_from([
    "data", "data:", "data: ", "event:", "event: e", "id:", "id: 9", "retry: ", "retry:", ":", ": c",
    "x", "7", " ", "\r", "\n", "\r\n", "\n\n", "\x00", "\ufeff", "é", "[DONE]", "\u2028",
])


@SETTINGS
@given(st.lists(stream_tokens, max_size=40).map(lambda ts: "".join(ts).encode()), st.data())
def test_any_split_of_any_stream_gives_the_events_the_standard_defines(stream, data):
    cuts = sorted(data.draw(st.lists(st.integers(0, len(stream)), max_size=8)))
    parser = SSEParser()
    events = []
    for start, end in zip([0] + cuts, cuts + [len(stream)]):
        events += parser.receive_data(stream[start:end])
    assert events == reference(stream)


@SETTINGS
@given(st.binary(max_size=300))
def test_arbitrary_bytes_fed_one_at_a_time_match_the_whole_stream(stream):
    assert parse_bytewise(stream) == parse(stream) == reference(stream)


@SETTINGS
@given(st.lists(st.tuples(st.text(max_size=30), st.none() | st.text("abc", max_size=3)), max_size=5),
       st.sampled_from(["\n", "\r\n", "\r"]))
def test_encoded_events_parse_back_to_their_data(items, eol):
    stream = b"".join(encode_event(text, event=kind) for text, kind in items)
    events = parse_bytewise(stream.replace(b"\n", eol.encode()))
    assert events == [EventReceived(re.sub(r"\r\n|\r", "\n", text), kind or "message") for text, kind in items]


def test_encoder_frames_json_done_errors_and_refuses_multiline_names():
    assert encode_json({"a": 1}) == b'data: {"a":1}\n\n'
    assert encode_event("a\nb", event="e", event_id="1") == b"event: e\nid: 1\ndata: a\ndata: b\n\n"
    assert DONE_EVENT == b"data: [DONE]\n\n"
    assert encode_event(b'{"x":"\xc3\xa9"}\r\ny') == b'data: {"x":"\xc3\xa9"}\ndata: y\n\n'
    error = InvalidRequestError("bad", param="x")
    assert json.loads(parse(error.to_event())[0].data) == error.body()
    with pytest.raises(OpenAIUsageError):
        encode_event("x", event="a\nb")


# -- SSEBlockSplitter: the runtime's stream cut into its raw events, byte for byte


line_end = st.sampled_from(["\n", "\r\n", "\r"])
field_line = st.tuples(
    st.sampled_from(["data: ", "data:", "event: ", "id: ", ": "]),
    st.text(st.characters(blacklist_characters="\r\n", codec="utf-8"), max_size=30),
)


@st.composite
def event_streams(draw: st.DrawFn) -> tuple[list[bytes], bytes]:
    # One line-end style per stream: a CR then an LF is one CR LF, however it was meant.
    le = draw(line_end)
    blocks = []
    for _ in range(draw(st.integers(0, 6))):
        lines = draw(st.lists(field_line, min_size=1, max_size=4))
        text = "".join(prefix + value + le for prefix, value in lines) + le
        blocks.append(text.encode("utf-8"))
    # Extra blank lines between events dispatch nothing and are skipped.
    separators = [draw(st.sampled_from([b"", le.encode()])) for _ in blocks]
    stream = b"".join(sep + block for sep, block in zip(separators, blocks))
    return blocks, stream


@settings(max_examples=80, deadline=None)
@given(event_streams(), st.lists(st.integers(1, 40), max_size=20))
def test_splitter_returns_each_event_verbatim_however_the_stream_is_cut(
    case: tuple[list[bytes], bytes], cuts: list[int]
) -> None:
    blocks, stream = case
    splitter = SSEBlockSplitter()
    out: list[bytes] = []
    pos = 0
    for size in cuts:
        out += splitter.receive_data(stream[pos:pos + size])
        pos += size
    out += splitter.receive_data(stream[pos:])
    # A trailing lone CR may be the first half of CR LF: it completes at the end of stream.
    rest = splitter.end_of_stream()
    if rest is not None:
        assert blocks and blocks[-1].endswith(b"\r")
        out.append(blocks[-1])
    assert out == blocks


def test_splitter_relays_an_event_far_larger_than_4_kib_in_one_piece() -> None:
    payload = b"data: " + b"x" * 300_000 + b"\n\n"
    splitter = SSEBlockSplitter()
    out = []
    for i in range(0, len(payload), 1000):
        out += splitter.receive_data(payload[i:i + 1000])
    assert out == [payload]


def test_splitter_refuses_an_event_past_its_bound() -> None:
    splitter = SSEBlockSplitter(max_event_size=100)
    with pytest.raises(EventTooLarge):
        splitter.receive_data(b"data: " + b"x" * 200)


def test_splitter_closes_an_unterminated_last_event_at_end_of_stream() -> None:
    splitter = SSEBlockSplitter()
    assert splitter.receive_data(b"data: 1\n\ndata: [DONE]") == [b"data: 1\n\n"]
    assert splitter.end_of_stream() == b"data: [DONE]\n\n"
    assert splitter.end_of_stream() is None


@pytest.mark.parametrize(("data", "done"), [
    (b"data: [DONE]\n\n", True),
    (b"data: [DONE]", True),
    (b'data: {"n":1}\n\ndata: [DONE]\n\n', True),
    (b'data: {"n":1}\r\n\r\ndata: [DONE]\r\n\r\n', True),
    (b'data: {"n":1}\r\rdata: [DONE]\r\r', True),
    (b'data: [DONE]\n\ndata: {"n":1}\n\n', False),
    (b'data: {"text":"data: [DONE]"}\n\n', False),
    (b'event: end\ndata: [DONE]\n\n', False),
    (b'xdata: [DONE]\n\n', False),
])
def test_a_relayed_piece_ends_with_done_only_when_its_last_event_is_done(data: bytes, done: bool) -> None:
    assert ends_with_done(data) is done
