"""What a runtime's answer says about its prompt, read as the agent relays it: llama.cpp's timings, the usage
OpenAI's API defines (vLLM, SGLang), nothing from anything else."""

import json

from hypothesis import given
from hypothesis import strategies as st

from protocol.agent.prompt_usage import PromptUsage, prompt_usage
from protocol.pb import worker_pb2


def body(payload: object) -> worker_pb2.TaskResult:
    return worker_pb2.TaskResult(http_response=worker_pb2.HttpResponse(status_code=200,
                                                                       body=json.dumps(payload).encode()))


def event(data: bytes) -> worker_pb2.TaskResult:
    return worker_pb2.TaskResult(server_sent_event=worker_pb2.ServerSentEvent(data=data))


def test_a_llamacpp_answer_gives_its_timings():
    """llama-server: cache_n reused, prompt_n computed; its usage says the same."""
    answer = {"choices": [], "usage": {"prompt_tokens": 46, "prompt_tokens_details": {"cached_tokens": 45}},
              "timings": {"cache_n": 45, "prompt_n": 1, "prompt_ms": 3.4}}
    assert prompt_usage(body(answer)) == PromptUsage(46, 45)


def test_a_stream_gives_it_in_the_event_that_carries_it():
    last = b'data: {"choices":[{"finish_reason":"length","delta":{}}],"timings":{"cache_n":373,"prompt_n":13}}\n\n'
    assert prompt_usage(event(b'data: {"choices":[{"delta":{"content":"\\"cache_n\\""}}]}\n\n')) is None
    assert prompt_usage(event(last)) == PromptUsage(386, 373)


def test_openais_usage_gives_it_when_it_has_the_details():
    """vLLM (--enable-prompt-tokens-details), SGLang and OpenAI write cached_tokens in prompt_tokens_details."""
    usage = {"prompt_tokens": 1000, "completion_tokens": 5, "prompt_tokens_details": {"cached_tokens": 768}}
    assert prompt_usage(event(b"data: " + json.dumps({"choices": [], "usage": usage}).encode() + b"\n\n")) \
        == PromptUsage(1000, 768)
    assert prompt_usage(body({"usage": {"prompt_tokens": 1000, "completion_tokens": 5}})) is None
    assert prompt_usage(body({"usage": {"prompt_tokens": 10, "prompt_tokens_details": {"cached_tokens": 11}}})) is None


def test_other_results_and_unreadable_bodies_say_nothing():
    assert prompt_usage(worker_pb2.TaskResult()) is None
    assert prompt_usage(event(b"data: [DONE]\n\n")) is None
    assert prompt_usage(body({"error": {"message": "x"}})) is None
    not_json = worker_pb2.TaskResult(http_response=worker_pb2.HttpResponse(body=b'{"cache_n": oops'))
    assert prompt_usage(not_json) is None
    assert prompt_usage(body({"timings": {"cache_n": -1, "prompt_n": 3}})) is None


@given(st.binary(max_size=300))
def test_any_bytes_give_an_answer_or_none_never_an_error(data):
    for result in (event(data), event(b'data: {"cache_n":' + data), body(None)):
        result.http_response.body = data if result.HasField("http_response") else b""
        assert prompt_usage(result) is None or isinstance(prompt_usage(result), PromptUsage)
