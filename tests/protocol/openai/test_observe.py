"""First output token and usage, read from answers as the gateway relays them (pure)."""

import json

import pytest

from hypothesis import given
from hypothesis import strategies as st

from protocol.openai.observe import (
    StreamError, StreamWatcher, Usage, carries_output, ends_stream, usage_of, usage_of_body,
)


def event(obj) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def chat_chunk(**delta) -> dict:
    return {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": delta, "finish_reason": None}]}


def test_the_role_only_chunk_and_empty_content_are_not_output():
    assert not carries_output(chat_chunk(role="assistant"))
    assert not carries_output(chat_chunk(role="assistant", content=""))
    assert not carries_output({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
    assert not carries_output({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 5}})


def test_content_tool_calls_refusals_and_reasoning_are_output():
    assert carries_output(chat_chunk(content="Hel"))
    assert carries_output(chat_chunk(tool_calls=[{"index": 0, "function": {"name": "f"}}]))
    assert carries_output(chat_chunk(refusal="I can't"))
    assert carries_output(chat_chunk(reasoning_content="thinking"))


def test_completions_text_and_responses_or_transcription_deltas_are_output():
    assert carries_output({"object": "text_completion", "choices": [{"index": 0, "text": "Once"}]})
    assert not carries_output({"object": "text_completion", "choices": [{"index": 0, "text": ""}]})
    assert carries_output({"type": "response.output_text.delta", "delta": "Hi"})
    assert carries_output({"type": "transcript.text.delta", "delta": "Hi"})
    assert not carries_output({"type": "response.created", "response": {}})


def test_usage_in_either_naming_and_in_a_completed_response():
    assert usage_of({"usage": {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8}}) == Usage(3, 5)
    assert usage_of({"usage": {"input_tokens": 2, "output_tokens": 7}}) == Usage(2, 7)
    assert usage_of({"type": "response.completed", "response": {"usage": {"input_tokens": 1, "output_tokens": 4}}}) \
        == Usage(1, 4)
    assert usage_of({"usage": {"prompt_tokens": 6, "total_tokens": 6}}) == Usage(6, 0)  # embeddings
    assert usage_of({"usage": None}) is None and usage_of({"usage": {"prompt_tokens": "3"}}) is None
    assert usage_of({"usage": {"prompt_tokens": True}}) is None


def test_usage_of_a_whole_body_tolerates_anything():
    assert usage_of_body(b'{"usage": {"prompt_tokens": 1, "completion_tokens": 2}}') == Usage(1, 2)
    assert usage_of_body(b'not json "usage"') is None
    assert usage_of_body(b"") is None


def test_the_watcher_finds_the_first_output_after_the_role_chunk_and_the_final_usage():
    watcher = StreamWatcher()
    assert watcher.feed(event(chat_chunk(role="assistant", content=""))) is False
    assert watcher.feed(event(chat_chunk(content="Hel"))) is True
    assert watcher.feed(event(chat_chunk(content="lo"))) is False
    assert watcher.feed(event({"choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 2}})) is False
    assert watcher.feed(b"data: [DONE]\n\n") is False
    assert watcher.usage == Usage(4, 2)


def test_the_watcher_reads_an_event_split_across_results():
    watcher = StreamWatcher()
    data = event(chat_chunk(content="x"))
    assert watcher.feed(data[:7]) is False
    assert watcher.feed(data[7:]) is True


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
        st.sampled_from(["choices", "delta", "content", "text", "type", "usage", "prompt_tokens", "response",
                         "tool_calls", "input_tokens", "output_tokens"]), inner, max_size=4),
    max_leaves=12,
)


@given(json_values)
def test_any_json_an_engine_sends_is_read_without_raising(value):
    carries_output(value)
    usage = usage_of(value)
    assert usage is None or (usage.input_tokens >= 0 and usage.output_tokens >= 0)
    StreamWatcher().feed(event(value))


@given(st.binary(max_size=200))
def test_any_bytes_in_a_stream_are_read_without_raising(data):
    StreamWatcher().feed(data)
    usage_of_body(data)


def reference_watch(chunks: list[bytes]) -> tuple[list[bool], Usage | None, bool]:
    """What the watcher must find: every event parsed and decoded, none skipped."""
    from protocol.openai.sse import DONE_DATA, EventReceived, SSEParser

    parser, seen, usage, firsts, failed = SSEParser(), False, None, [], False
    for chunk in chunks:
        first = False
        for ev in parser.receive_data(chunk):
            if not isinstance(ev, EventReceived) or ev.data == DONE_DATA:
                continue
            try:
                decoded = json.loads(ev.data)
            except ValueError:
                continue
            if not seen and carries_output(decoded):
                seen = first = True
            usage = usage_of(decoded) or usage
            failed = failed or (isinstance(decoded, dict) and isinstance(decoded.get("error"), dict))
        firsts.append(first)
    return firsts, usage, failed


stream_events = st.lists(
    st.one_of(
        st.builds(lambda c: event(chat_chunk(content=c)), st.text(max_size=3)),
        st.builds(lambda n: event({"choices": [], "usage": {"prompt_tokens": n, "completion_tokens": n + 1}}),
                  st.integers(0, 9)),
        st.just(b"data: [DONE]\n\n"), st.just(b": keep-alive\n\n"), st.just(b"event: x\r\ndata: {}\r\n\r\n"),
        st.just(b"data: {\"usage\"\n"), st.just(b"\r"), st.just(b"\n"),
        st.just(b'data: {"error":{"message":"x","type":"upstream_error","code":"runtime_stream_broken"}}\n\n'),
    ),
    max_size=12,
)


@given(stream_events, st.lists(st.integers(0, 400), max_size=6), st.booleans())
def test_the_watcher_skipping_whole_events_finds_what_parsing_every_event_finds(events, cuts, one_per_result):
    """Events without usage after the first output are not parsed: the same first output and usage
    are found as by parsing everything, however the stream is cut into results."""
    stream = b"".join(events)
    bounds = sorted({0, len(stream), *(c for c in cuts if c < len(stream))})
    chunks = events if one_per_result else [stream[a:b] for a, b in zip(bounds, bounds[1:])] or [stream]
    watcher = StreamWatcher()
    firsts = [watcher.feed(chunk) for chunk in chunks]
    assert (firsts, watcher.usage, watcher.error is not None) == reference_watch(chunks)


# --- how a stream ended -----------------------------------------------------------------


def test_a_stream_that_carried_an_error_event_failed_with_that_errors_status_and_code():
    """Issue #22: a stream cut by a dying runtime was logged status=200; the watcher keeps the
    error event it ended with, so the request log and metrics record the real outcome."""
    watcher = StreamWatcher()
    watcher.feed(event(chat_chunk(content="partial")))
    assert watcher.error is None
    watcher.feed(b'data: {"error":{"message":"cut","type":"upstream_error","param":null,'
                 b'"code":"runtime_stream_broken"}}\n\n')
    assert watcher.error == StreamError(502, "runtime_stream_broken")


def test_a_runtimes_own_stream_error_counts_with_the_status_it_names():
    watcher = StreamWatcher()
    watcher.feed(b'data: {"error":{"object":"error","message":"boom","type":"BadRequestError","code":400}}\n\n')
    assert watcher.error == StreamError(400, "BadRequestError")


def test_content_that_mentions_an_error_is_not_an_error_event():
    watcher = StreamWatcher()
    watcher.feed(event(chat_chunk(content="ok")))
    watcher.feed(event(chat_chunk(content='{"error": {"message": "quoted"}}')))
    watcher.feed(event({"choices": [], "error": "not an object"}))
    assert watcher.error is None


@pytest.mark.parametrize(("last", "ends"), [
    (b"data: [DONE]\n\n", True),
    (b"data: [DONE]", True),  # the last event's blank line may be missing too
    (b'data: {"error":{"message":"x","type":"server_error"}}\n\n', True),
    (b'event: response.completed\ndata: {"type":"response.completed","response":{}}\n\n', True),
    (b'event: response.failed\ndata: {"type":"response.failed","response":{}}\n\n', True),
    (b'data: {"type":"transcript.text.done","text":"hi"}\n\n', True),
    (b'data: {"choices":[{"delta":{"content":"a"}}]}\n\n', False),
    (b'data: {"type":"response.output_text.delta","delta":"a"}\n\n', False),
    (b": keep-alive\n\n", False),
    (b"", False),
    (b"data: [DONE", False),
])
def test_a_stream_may_end_only_with_a_final_event(last, ends):
    """A stream that ended only because its connection closed (no framing) is whole only if its
    last event is one a stream ends with; else the runtime died mid-stream."""
    assert ends_stream(last) is ends
