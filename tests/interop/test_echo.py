"""The echo runtime's pure core: deterministic answers with their due times, in the shapes OpenAI clients parse."""

import base64
import json
import math
import struct

import pytest
from hypothesis import given, settings, strategies as st
from openai.types import Completion, CreateEmbeddingResponse
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from protocol.agent.echo import EchoConfig, echo_task
from protocol.openai.completions import text_completion_event_data
from protocol.openai.errors import OpenAIUsageError
from protocol.openai.requests import (
    parse_audio_transcription,
    parse_chat_completion,
    parse_completion,
    parse_embedding,
    parse_model_response,
    parse_tokenize,
)
from protocol.openai.sse import EventReceived, SSEParser
from protocol.pb import worker_pb2

NOW = 1_700_000_000.75
CONFIG = EchoConfig(token_delay=0.5)


def task(parsed, task_id="t1"):
    return worker_pb2.Task(id=task_id, request=parsed.request)


def chat_task(text="  hello   brave new\tworld ", **fields):
    fields.setdefault("messages", [{"role": "system", "content": "sys prompt"},
                                   {"role": "user", "content": "earlier"},
                                   {"role": "assistant", "content": "ok"},
                                   {"role": "user", "content": text}])
    return task(parse_chat_completion(json.dumps({"model": "echo", **fields}).encode()))


def body_of(result):
    assert result.result.WhichOneof("message") == "http_response"
    return json.loads(result.result.http_response.body)


def stream_events(results):
    """The SSE data as the gateway sees it: the events' bytes concatenated into one body."""
    parser = SSEParser()
    events = []
    for r in results[1:]:
        events += parser.receive_data(r.result.server_sent_event.data)
    return [e.data for e in events if isinstance(e, EventReceived)]


def test_a_chat_completion_echoes_the_last_user_message_exactly_when_its_last_token_is_due():
    [result] = echo_task(chat_task(), CONFIG, NOW)
    completion = ChatCompletion.model_validate(body_of(result))
    assert completion.choices[0].message.content == "  hello   brave new\tworld "
    assert completion.choices[0].finish_reason == "stop"
    assert completion.created == 1_700_000_000 and completion.model == "echo" and completion.id == "chatcmpl-t1"
    assert (completion.usage.prompt_tokens, completion.usage.completion_tokens, completion.usage.total_tokens) \
        == (4 + 4, 4, 12)
    assert result.due == 2.0 and result.is_last
    http = result.result.http_response
    assert (result.result.task_id, result.result.result_index, http.status_code, http.status) == ("t1", 0, 200, "200 OK")
    assert list(http.header["Content-Type"].values) == ["application/json"]


def test_a_stream_sends_the_head_a_role_chunk_one_chunk_per_word_the_finish_the_usage_and_done():
    results = echo_task(chat_task(stream=True, stream_options={"include_usage": True}), CONFIG, NOW)
    head = results[0].result.http_response
    assert head.status_code == 200 and list(head.header["Content-Type"].values) == ["text/event-stream"]
    assert [r.result.result_index for r in results] == list(range(len(results)))
    assert [r.due for r in results] == [0.0, 0.0, 0.5, 1.0, 1.5, 2.0, 2.0, 2.0, 2.0]
    assert [r.is_last for r in results] == [False] * 8 + [True]
    assert results[-1].result.server_sent_event.is_last_event
    data = stream_events(results)
    assert data[-1] == "[DONE]"
    chunks = [ChatCompletionChunk.model_validate_json(d) for d in data[:-1]]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks[:-1]) == "  hello   brave new\tworld "
    assert chunks[-2].choices[0].finish_reason == "stop"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 4
    assert all(c.usage is None for c in chunks[:-1])


def test_without_include_usage_there_is_no_usage_chunk_and_no_usage_key():
    results = echo_task(chat_task(text="a b", stream=True), CONFIG, NOW)
    data = stream_events(results)
    assert len(data) == 1 + 2 + 1 + 1
    assert all("usage" not in json.loads(d) for d in data[:-1])


def test_max_tokens_cuts_the_echo_short_with_finish_reason_length():
    [result] = echo_task(chat_task(text="one two three four", max_tokens=2), CONFIG, NOW)
    choice = body_of(result)["choices"][0]
    assert choice["message"]["content"] == "one two " and choice["finish_reason"] == "length"
    assert result.due == 1.0


def test_n_choices_are_all_echoed():
    [result] = echo_task(chat_task(text="x", n=3), CONFIG, NOW)
    assert [c["index"] for c in body_of(result)["choices"]] == [0, 1, 2]
    streamed = echo_task(chat_task(text="x y", n=2, stream=True), CONFIG, NOW)
    chunks = [json.loads(d) for d in stream_events(streamed)[:-1]]
    assert sorted({c["choices"][0]["index"] for c in chunks}) == [0, 1]


def test_a_wire_n_beyond_openais_bound_is_a_400_result():
    request = chat_task()
    request.request.chat_completion.n = 2**31 - 1
    [result] = echo_task(request, CONFIG, NOW)
    assert result.result.http_response.status_code == 400 and body_of(result)["error"]["param"] == "n"


def test_a_conversation_without_a_user_message_echoes_nothing_at_once():
    [result] = echo_task(chat_task(messages=[{"role": "system", "content": "only system"}]), CONFIG, NOW)
    assert body_of(result)["choices"][0]["message"]["content"] == "" and result.due == 0.0


@settings(max_examples=100, deadline=None)
@given(st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]), max_size=60))
def test_streamed_pieces_rebuild_any_text_and_count_its_words(text):
    results = echo_task(chat_task(text=text, stream=True), EchoConfig(token_delay=0.1), NOW)
    chunks = [json.loads(d) for d in stream_events(results)[:-1]]
    content = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert content == (text if text.split() else "")
    assert len(chunks) == 2 + len(text.split())
    dues = [r.due for r in results]
    assert dues == sorted(dues)


def test_legacy_completions_stream_through_the_echo_and_back():
    parsed = parse_completion(json.dumps({"model": "echo", "prompt": "say it", "stream": True}).encode())
    results = echo_task(task(parsed), CONFIG, NOW)
    data = [text_completion_event_data(d.encode()) for d in stream_events(results)]
    assert data[-1] == b"[DONE]"
    texts = [json.loads(d)["choices"][0]["text"] for d in data[:-1]]
    assert "".join(texts) == "say it"
    Completion.model_validate_json(data[-2])


def embed(**fields):
    [result] = echo_task(task(parse_embedding(json.dumps({"model": "e", **fields}).encode())), CONFIG, NOW)
    return result


def test_embeddings_are_deterministic_unit_vectors_one_per_input():
    response = CreateEmbeddingResponse.model_validate(body_of(embed(input=["a b", "c", "a b"])))
    vectors = [d.embedding for d in response.data]
    assert [d.index for d in response.data] == [0, 1, 2] and all(len(v) == 16 for v in vectors)
    assert all(math.isclose(math.fsum(x * x for x in v), 1.0) for v in vectors)
    assert vectors[0] == vectors[2] != vectors[1]
    assert response.usage.prompt_tokens == 5
    assert body_of(embed(input="a b"))["data"][0]["embedding"] == vectors[0]


def test_embeddings_honour_dimensions_token_inputs_and_base64():
    assert len(body_of(embed(input="x", dimensions=5))["data"][0]["embedding"]) == 5
    tokens = body_of(embed(input=[[1, 2], [3]]))
    assert len(tokens["data"]) == 2 and tokens["usage"]["prompt_tokens"] == 3
    assert len(body_of(embed(input=[1, 2, 3]))["data"]) == 1
    floats = body_of(embed(input="x", dimensions=4))["data"][0]["embedding"]
    packed = body_of(embed(input="x", dimensions=4, encoding_format="base64"))["data"][0]["embedding"]
    assert struct.unpack("<4f", base64.b64decode(packed)) == pytest.approx(floats, rel=1e-6)


def test_too_many_dimensions_are_a_400_result_not_an_allocation():
    result = embed(input="x", dimensions=10**9)
    assert result.result.http_response.status_code == 400
    assert body_of(result)["error"]["param"] == "dimensions"


def test_tokenize_counts_words():
    [result] = echo_task(task(parse_tokenize(b'{"model": "m", "prompt": "a b  c"}')), CONFIG, NOW)
    out = body_of(result)
    assert out["count"] == 3 and len(out["tokens"]) == 3 and out["max_model_len"] == 4096
    [result] = echo_task(task(parse_tokenize(
        b'{"model": "m", "messages": [{"role": "user", "content": "a b"}, {"role": "user", "content": "c"}]}')), CONFIG, NOW)
    assert body_of(result)["count"] == 3


@pytest.mark.parametrize("parsed", [
    parse_audio_transcription({"model": "w"}, b"x", "a.wav"),
    parse_model_response(b'{"model": "m", "input": "hi"}'),
])
def test_kinds_the_echo_does_not_serve_get_a_501_with_an_openai_error_body(parsed):
    [result] = echo_task(task(parsed), CONFIG, NOW)
    assert result.result.http_response.status_code == 501 and result.is_last
    assert result.result.http_response.status == "501 Not Implemented"
    assert body_of(result)["error"]["type"] == "not_implemented"


@pytest.mark.parametrize("kind", ["heartbeat", "go_away", "cancel_task"])
def test_agent_business_is_refused_as_misuse(kind):
    request = worker_pb2.TaskRequest()
    getattr(request, kind).SetInParent()
    with pytest.raises(OpenAIUsageError):
        echo_task(worker_pb2.Task(id="x", request=request), CONFIG, NOW)


def test_config_is_validated():
    with pytest.raises(OpenAIUsageError):
        EchoConfig(token_delay=-1)
    with pytest.raises(OpenAIUsageError):
        EchoConfig(embedding_dimensions=0)
