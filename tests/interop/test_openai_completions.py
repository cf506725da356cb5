"""Legacy completions answers: chat.completion(.chunk) -> text_completion, checked with the openai library's own types."""

import json

import pytest
from openai.types import Completion

from protocol.openai.completions import (
    text_completion_body,
    text_completion_chunk_from_chat,
    text_completion_event_data,
    text_completion_from_chat,
)
from protocol.openai.errors import UpstreamError

CHAT = {
    "id": "chatcmpl-1", "object": "chat.completion", "created": 1700000000, "model": "m",
    "system_fingerprint": "fp",
    "choices": [
        {"index": 0, "message": {"role": "assistant", "content": "Hello there"}, "logprobs": None,
         "finish_reason": "stop"},
        {"index": 1, "message": {"role": "assistant", "content": None}, "logprobs": None,
         "finish_reason": "length"},
    ],
    "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5},
}


def chunk(delta, finish_reason=None, usage=None, choices=True):
    out = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1700000000, "model": "m",
           "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}] if choices else []}
    if usage is not None:
        out["usage"] = usage
    return json.dumps(out).encode()


def test_a_chat_completion_becomes_a_text_completion():
    out = json.loads(text_completion_body(json.dumps(CHAT).encode()))
    Completion.model_validate(out)
    assert out["object"] == "text_completion" and out["id"] == "chatcmpl-1" and out["created"] == 1700000000
    assert out["choices"] == [
        {"text": "Hello there", "index": 0, "logprobs": None, "finish_reason": "stop"},
        {"text": "", "index": 1, "logprobs": None, "finish_reason": "length"},
    ]
    assert out["usage"] == CHAT["usage"] and out["system_fingerprint"] == "fp"


def test_stream_chunks_become_text_completion_chunks_and_usage_and_done_pass_through():
    role = json.loads(text_completion_event_data(chunk({"role": "assistant", "content": ""})))
    word = json.loads(text_completion_event_data(chunk({"content": "Hello"})))
    last = json.loads(text_completion_event_data(chunk({}, "stop")))
    usage = json.loads(text_completion_event_data(chunk({}, usage={"prompt_tokens": 1, "completion_tokens": 1,
                                                                   "total_tokens": 2}, choices=False)))
    for out in (role, word, last, usage):
        assert out["object"] == "text_completion"
    # The library's type wants a finish_reason, which only the last chunk of a real stream has.
    Completion.model_validate(last)
    assert role["choices"][0]["text"] == "" and word["choices"][0]["text"] == "Hello"
    assert last["choices"][0]["finish_reason"] == "stop"
    assert usage["choices"] == [] and usage["usage"]["total_tokens"] == 2
    assert text_completion_event_data(b"[DONE]") == b"[DONE]"


def test_an_error_event_in_the_stream_passes_through():
    error = {"error": {"message": "boom", "type": "server_error", "param": None, "code": None}}
    assert json.loads(text_completion_event_data(json.dumps(error).encode())) == error


@pytest.mark.parametrize("data", [b"not json", b"[1]", b'{"choices": 3}', b'{"choices": [1]}',
                                  b'{"choices": [{"message": {"content": [1]}}]}',
                                  b'{"choices": [{"message": "x"}]}'])
def test_a_malformed_runtime_answer_is_a_502(data):
    with pytest.raises(UpstreamError) as info:
        text_completion_body(data)
    assert info.value.status == 502
    assert json.loads(info.value.to_json())["error"]["type"] == "upstream_error"


def test_vllm_stop_reason_and_prompt_logprobs_survive_the_conversion():
    chat = {"id": "c", "object": "chat.completion", "created": 1, "model": "m",
            "prompt_logprobs": [None, {"11": {"logprob": -1.5}}],
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "x"}, "finish_reason": "stop",
                         "stop_reason": 50256}]}
    choice = text_completion_from_chat(chat)["choices"][0]
    assert choice["stop_reason"] == 50256
    assert choice["prompt_logprobs"] == [None, {"11": {"logprob": -1.5}}]
    chunk = {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m",
             "choices": [{"index": 0, "delta": {"content": "y"}, "finish_reason": "stop", "stop_reason": "END"}]}
    assert text_completion_chunk_from_chat(chunk)["choices"][0]["stop_reason"] == "END"
