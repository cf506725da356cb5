"""The lossless suite's request shapes, and sending one straight to the recording runtime and through a
gateway: what ``tests/e2e/test_lossless.py`` (the dial-in path) and ``tests/e2e/test_runtimes_by_url.py``
(runtimes by URL) both check."""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass, field
from email.parser import BytesParser
from email.policy import HTTP as HTTP_POLICY
from typing import Any

import openai

from harness.recording_runtime import Answer, Recorded, RecordingRuntime

MODEL = "m"
HELLO = [{"role": "user", "content": "hi"}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "strict": True, "description": "w",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"], "additionalProperties": False}}}]
# The headers a hop owns: credentials, framing, the connection, the gateway's request id.
HOP_REQUEST_HEADERS = {"host", "content-length", "authorization", "accept-encoding", "connection", "x-request-id"}
HOP_ANSWER_HEADERS = {"date", "server", "content-length", "transfer-encoding", "connection", "x-request-id"}
JSON = (("Content-Type", "application/json"),)
SSE = (("Content-Type", "text/event-stream"), ("Cache-Control", "no-cache"))


def chat_answer(text: str = "hello", **extra: Any) -> Answer:
    body = {"id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": MODEL,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop",
                         "stop_reason": None}],
            "usage": {"prompt_tokens": 4, "completion_tokens": 1, "total_tokens": 5}, **extra}
    return Answer(headers=JSON + (("x-runtime-extra", "kept"),), body=json.dumps(body).encode())


def events(*payloads: Any, done: bool = True) -> tuple[bytes, ...]:
    chunks = tuple(b"data: " + json.dumps(p).encode() + b"\n\n" for p in payloads)
    return chunks + ((b"data: [DONE]\n\n",) if done else ())


def chunk(delta: dict[str, Any], finish: str | None = None, **extra: Any) -> dict[str, Any]:
    return {"id": "c1", "object": "chat.completion.chunk", "created": 1, "model": MODEL,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}], **extra}


def error(status: int, reason: str, message: str, *headers: tuple[str, str], code: Any = None) -> Answer:
    body = json.dumps({"object": "error", "message": message, "type": "BadRequestError", "param": None,
                       "code": code if code is not None else status}).encode()
    return Answer(status=status, reason=reason, headers=JSON + headers, body=body)


TRANSCRIPT = Answer(headers=JSON, body=b'{"text":"hello there","usage":{"type":"duration","seconds":1}}')
COMPLETION = Answer(headers=JSON, body=json.dumps({
    "id": "cmpl-1", "object": "text_completion", "created": 1, "model": MODEL,
    "choices": [{"index": 0, "text": " world", "logprobs": None, "finish_reason": "length", "stop_reason": None,
                 "prompt_logprobs": [None, {"11": {"logprob": -1.5, "rank": 1, "decoded_token": "a"}}]}],
    "usage": {"prompt_tokens": 4, "completion_tokens": 1, "total_tokens": 5}}).encode())
EMBEDDING = Answer(headers=JSON, body=json.dumps({
    "object": "list", "model": MODEL, "data": [{"object": "embedding", "index": 0, "embedding": [0.5, -0.25]}],
    "usage": {"prompt_tokens": 1, "total_tokens": 1}}).encode())
RESPONSE = Answer(headers=JSON, body=json.dumps({
    "id": "resp_1", "object": "response", "created_at": 1, "model": MODEL, "status": "completed",
    "output": [{"type": "message", "id": "msg_1", "role": "assistant", "status": "completed",
                "content": [{"type": "output_text", "text": "hi", "annotations": []}]}],
    "parallel_tool_calls": False, "tool_choice": "auto", "tools": []}).encode())
WAV = b"RIFF\x24\x00\x00\x00WAVEfmt " + bytes(range(40))


@dataclass(frozen=True)
class Shape:
    """One request shape: which API, its arguments, and the runtime's scripted answer."""

    name: str
    api: str
    kwargs: dict[str, Any]
    answer: Answer
    options: dict[str, Any] = field(default_factory=dict)


def chat(name: str, answer: Answer | None = None, **kwargs: Any) -> Shape:
    kwargs.setdefault("messages", HELLO)
    return Shape(name, "chat.completions", {"model": MODEL, **kwargs}, answer or chat_answer())


def vllm(name: str, **extra_body: Any) -> Shape:
    return chat(name, extra_body=extra_body)


# A runtime's 429 pauses its engine until the Retry-After (the busy rule), so
# it has a stack of its own below rather than a row that would hold up the rest.
RATE_LIMITED = chat("rate limited with retry after", answer=error(
    429, "Too Many Requests", "slow down", ("Retry-After", "60"), ("x-ratelimit-limit-requests", "10"),
    ("x-ratelimit-remaining-requests", "0"), ("x-ratelimit-reset-requests", "60s")))

SHAPES = [
    chat("plain"),
    chat("seed zero", seed=0),
    chat("seed above int32", seed=2**40),
    chat("store false", store=False),
    chat("logprobs false", logprobs=False),
    chat("logprobs with top logprobs", logprobs=True, top_logprobs=3),
    chat("parallel tool calls false and strict tools", tools=TOOLS, parallel_tool_calls=False),
    chat("tool choice required", tools=TOOLS, tool_choice="required"),
    chat("tool choice named function", tools=TOOLS,
         tool_choice={"type": "function", "function": {"name": "get_weather"}}),
    chat("reasoning effort", reasoning_effort="low"),
    chat("metadata and store", metadata={"team": "a"}, store=True),
    chat("service tier", service_tier="flex"),
    chat("prompt cache key", prompt_cache_key="k1"),
    chat("verbosity", verbosity="low"),
    chat("modalities", modalities=["text"]),
    chat("prediction", prediction={"type": "content", "content": "hello"}),
    chat("max completion tokens alone", max_completion_tokens=7),
    chat("max tokens", max_tokens=3),
    chat("temperature and top p zero", temperature=0, top_p=0),
    chat("n and stop list", n=2, stop=["\n", "END"]),
    chat("logit bias and user", logit_bias={"50256": -100}, user="u1"),
    chat("frequency and presence penalty zero", frequency_penalty=0, presence_penalty=0),
    chat("json schema response format", response_format={"type": "json_schema", "json_schema": {
        "name": "x", "strict": True, "schema": {"type": "object", "properties": {}}}}),
    chat("one-part content array", messages=[{"role": "user", "content": [{"type": "text", "text": "hi"}]}]),
    chat("image data url", messages=[{"role": "user", "content": [
        {"type": "text", "text": "what is it"},
        {"type": "image_url", "image_url": {
            "url": "data:image/png;base64," + base64.b64encode(b"\x89PNG" * 64).decode(), "detail": "low"}}]}]),
    chat("video url part", messages=[{"role": "user", "content": [
        {"type": "video_url", "video_url": {"url": "https://example.invalid/v.mp4"}}]}]),
    chat("file part", messages=[{"role": "user", "content": [
        {"type": "file", "file": {"filename": "a.pdf", "file_data": "data:application/pdf;base64,JVBERi0="}}]}]),
    chat("input audio part", messages=[{"role": "user", "content": [
        {"type": "input_audio", "input_audio": {"data": base64.b64encode(WAV).decode(), "format": "wav"}}]}]),
    chat("reasoning content in history", messages=[
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello", "reasoning_content": "the user greets"},
        {"role": "user", "content": "again"}]),
    chat("tool call history", messages=[
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": "{\"city\":\"P\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}], tools=TOOLS),
    chat("developer role and name", messages=[{"role": "developer", "content": "be brief"},
                                              {"role": "user", "content": "hi", "name": "ann"}]),
    chat("chat template kwargs", extra_body={"chat_template_kwargs": {"enable_thinking": False}}),
    vllm("vllm sampling extras", top_k=5, min_p=0.1, repetition_penalty=1.2),
    vllm("vllm guided json", guided_json={"type": "object"}),
    vllm("vllm guided choice", guided_choice=["yes", "no"]),
    vllm("vllm tokens extras", min_tokens=2, stop_token_ids=[7, 8], skip_special_tokens=False),
    vllm("vllm priority and mm kwargs", priority=1, mm_processor_kwargs={"fps": 2}),
    chat("stream", stream=True, answer=Answer(headers=SSE, chunks=events(
        chunk({"role": "assistant", "content": ""}), chunk({"content": "he"}), chunk({"content": "llo"}, "stop")))),
    chat("stream with usage chunk", stream=True, stream_options={"include_usage": True}, answer=Answer(
        headers=SSE, chunks=events(chunk({"content": "hi"}, "stop"), {
            "id": "c1", "object": "chat.completion.chunk", "created": 1, "model": MODEL, "choices": [],
            "usage": {"prompt_tokens": 4, "completion_tokens": 1, "total_tokens": 5}}))),
    chat("stream of tool call deltas", stream=True, tools=TOOLS, parallel_tool_calls=False, answer=Answer(
        headers=SSE, chunks=events(
            chunk({"role": "assistant", "tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                                                        "function": {"name": "get_weather", "arguments": ""}}]}),
            chunk({"tool_calls": [{"index": 0, "function": {"arguments": "{\"city\":"}}]}),
            chunk({"tool_calls": [{"index": 0, "function": {"arguments": "\"Paris\"}"}}]}),
            chunk({}, "tool_calls")))),
    chat("context length error", answer=error(
        400, "Bad Request", "This model's maximum context length is 16 tokens.", code="context_length_exceeded")),
    chat("server error with a text body", answer=Answer(
        status=500, reason="Internal Server Error", headers=(("Content-Type", "text/plain; charset=utf-8"),),
        body=b"Internal Server Error")),
    chat("stream refused by the runtime", stream=True, answer=error(400, "Bad Request", "bad stream")),
    chat("ok answer with rate limit headers", answer=Answer(
        headers=JSON + (("x-ratelimit-remaining-tokens", "99"),), body=chat_answer().body)),
    Shape("query string and custom header", "chat.completions", {"model": MODEL, "messages": HELLO},
          chat_answer(), {"extra_query": {"api-version": "2024-01"}, "extra_headers": {"x-custom": "1"}}),
    Shape("completions", "completions", {"model": MODEL, "prompt": "Say this is"}, COMPLETION),
    Shape("completions echo", "completions", {"model": MODEL, "prompt": "hi", "echo": True}, COMPLETION),
    Shape("completions logprobs", "completions", {"model": MODEL, "prompt": "hi", "logprobs": 2}, COMPLETION),
    Shape("completions suffix", "completions", {"model": MODEL, "prompt": "hi", "suffix": "end"}, COMPLETION),
    Shape("completions best of", "completions", {"model": MODEL, "prompt": "hi", "best_of": 2, "n": 1}, COMPLETION),
    Shape("completions two prompts", "completions", {"model": MODEL, "prompt": ["a", "b"]}, COMPLETION),
    Shape("completions token ids", "completions", {"model": MODEL, "prompt": [1, 2, 3], "seed": 0}, COMPLETION),
    Shape("completions stream", "completions", {"model": MODEL, "prompt": "hi", "stream": True}, Answer(
        headers=SSE, chunks=events({"id": "c", "object": "text_completion", "created": 1, "model": MODEL,
                                    "choices": [{"index": 0, "text": "x", "finish_reason": "length",
                                                 "stop_reason": None}]}))),
    Shape("embeddings string", "embeddings", {"model": MODEL, "input": "hello"}, EMBEDDING),
    Shape("embeddings list base64 dimensions", "embeddings",
          {"model": MODEL, "input": ["a", "b"], "encoding_format": "base64", "dimensions": 2}, EMBEDDING),
    Shape("embeddings token ids", "embeddings", {"model": MODEL, "input": [[1, 2], [3]]}, EMBEDDING),
    Shape("responses", "responses", {"model": MODEL, "input": "hi"}, RESPONSE),
    Shape("responses store and parallel tool calls false", "responses",
          {"model": MODEL, "input": "hi", "store": False, "parallel_tool_calls": False}, RESPONSE),
    Shape("responses reasoning verbosity metadata", "responses",
          {"model": MODEL, "input": [{"role": "user", "content": "hi"}], "reasoning": {"effort": "low"},
           "text": {"verbosity": "low"}, "metadata": {"a": "b"}, "service_tier": "flex",
           "prompt_cache_key": "k"}, RESPONSE),
    Shape("responses stream has no done", "responses", {"model": MODEL, "input": "hi", "stream": True}, Answer(
        headers=SSE, chunks=(
            b'event: response.created\ndata: {"type":"response.created","sequence_number":0}\n\n',
            b'event: response.output_text.delta\ndata: {"type":"response.output_text.delta","delta":"hi",'
            b'"sequence_number":1}\n\n',
            b'event: response.completed\ndata: {"type":"response.completed","sequence_number":2}\n\n'))),
    Shape("transcription wav", "audio.transcriptions",
          {"model": MODEL, "file": ("a.wav", WAV, "audio/wav")}, TRANSCRIPT),
    Shape("transcription timestamp granularities", "audio.transcriptions",
          {"model": MODEL, "file": ("a.mp3", WAV, "audio/mpeg"), "response_format": "verbose_json",
           "timestamp_granularities": ["word", "segment"], "language": "en", "prompt": "p", "temperature": 0},
          TRANSCRIPT),
    Shape("transcription as plain text", "audio.transcriptions",
          {"model": MODEL, "file": ("a.flac", WAV, "audio/flac"), "response_format": "text"},
          Answer(headers=(("Content-Type", "text/plain; charset=utf-8"),), body=b"hello there\n")),
    Shape("transcription as srt", "audio.transcriptions",
          {"model": MODEL, "file": ("a.ogg", WAV, "audio/ogg"), "response_format": "srt"},
          Answer(headers=(("Content-Type", "text/plain; charset=utf-8"),),
                 body=b"1\n00:00:00,000 --> 00:00:01,000\nhello there\n\n")),
    Shape("transcription stream", "audio.transcriptions",
          {"model": MODEL, "file": ("a.wav", WAV, "audio/wav"), "stream": True}, Answer(headers=SSE, chunks=(
              b'data: {"type":"transcript.text.delta","delta":"hello"}\n\n',
              b'data: {"type":"transcript.text.done","text":"hello"}\n\n'))),
]


@dataclass(frozen=True)
class Outcome:
    """What the client got: status, reason, headers (lower-case, hop ones removed), body bytes."""

    status: int
    reason: str
    headers: tuple[tuple[str, str], ...]
    body: bytes


def call(client: openai.OpenAI, shape: Shape) -> Outcome:
    target: Any = client
    for part in shape.api.split("."):
        target = getattr(target, part)
    try:
        with target.with_streaming_response.create(**shape.kwargs, **shape.options) as response:
            http = response.http_response
            return outcome(http, b"".join(response.iter_bytes()))
    except openai.APIStatusError as exc:
        return outcome(exc.response, exc.response.content)


def outcome(http: Any, body: bytes) -> Outcome:
    headers = tuple(sorted(
        (n.lower(), v) for n, v in http.headers.multi_items() if n.lower() not in HOP_ANSWER_HEADERS))
    return Outcome(http.status_code, http.reason_phrase, headers, body)


def request_view(recorded: Recorded) -> tuple[Any, ...]:
    """A received request with what may differ between the two hops taken out."""
    headers = []
    for name, value in recorded.headers:
        if name.lower() in HOP_REQUEST_HEADERS:
            continue
        if name.lower() == "content-type" and value.startswith("multipart/form-data"):
            value = "multipart/form-data"
        headers.append((name.lower(), value))
    content_type = recorded.header("content-type") or ""
    body: Any = recorded.body
    if content_type.startswith("multipart/form-data"):
        message = BytesParser(policy=HTTP_POLICY).parsebytes(
            b"Content-Type: " + content_type.encode() + b"\r\n\r\n" + recorded.body)
        body = [(part.get_param("name", header="content-disposition"), part.get_filename(),
                 part.get_content_type(), part.get_payload(decode=True)) for part in message.iter_parts()]
    return recorded.method, recorded.path, tuple(sorted(headers)), body


def client_for(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url, api_key="sk-client", max_retries=0, timeout=20)


def exchange(runtime: RecordingRuntime, base_url: str, shape: Shape) -> tuple[Outcome, Outcome, list[Recorded]]:
    """The shape sent straight to the runtime and through ``base_url``; both outcomes and both requests."""
    runtime.reset()
    runtime.script(shape.answer, shape.answer)
    direct = call(client_for(runtime.url + "/v1"), shape)
    via = call(client_for(base_url), shape)
    return direct, via, runtime.requests()


EXCHANGED = [s for s in SHAPES if s.name in {
    "seed zero", "vllm sampling extras", "video url part", "stream of tool call deltas",
    "completions echo", "embeddings token ids", "responses stream has no done", "transcription timestamp granularities",
}]
