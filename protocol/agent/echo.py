"""The built-in echo runtime's pure core: a ``Task`` in, its timed ``TaskResult``s out.

Rules this file keeps: no I/O, no clock reads, no randomness; the same task,
``now`` and configuration always give the same results. Time is a value:
each result says how many seconds after the task's arrival it is due, and
the engine agent's timer sends it then (and drops the rest if the task is
cancelled). Go-away, heartbeat and cancel tasks are the agent's business and
are refused here as misuse.

What it answers:

- chat completions echo the last user message's text (exactly, word by
  word when streaming; ``max_tokens``/``max_completion_tokens`` cut it short
  with ``finish_reason: "length"``), counting whitespace-separated words as
  tokens;
- embeddings are unit vectors derived from a hash of each input;
- tokenize counts words;
- other kinds get HTTP 501 with an OpenAI error body.

Streamed events are framed exactly as a runtime's stream
(``data: {...}\\n\\n``) because that is what ``ServerSentEvent.data``
carries on LLMariner's wire; the last one is ``data: [DONE]`` with
``is_last_event`` set.
"""

from __future__ import annotations

import base64
import hashlib
import json
import math
import re
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from protocol.openai.errors import (
    InvalidRequestError,
    NotImplementedRequestError,
    OpenAIError,
    OpenAIUsageError,
    status_line,
)
from protocol.openai.json import JSONObject, decode_json_field
from protocol.openai.requests import MAX_CHOICES
from protocol.openai.sse import DONE_EVENT, encode_json
from protocol.pb import chat_pb2, embeddings_pb2, tokenize_pb2, worker_pb2

_PIECE = re.compile(r"\S+\s*")


@dataclass(frozen=True)
class EchoConfig:
    """How the echo runtime behaves.

    ``token_delay``: seconds between two streamed tokens (a non-streaming
    answer is due when its last token would have been).
    ``embedding_dimensions``: vector length when the request names none.
    ``max_embedding_dimensions``: larger ``dimensions`` are a 400, so that a
    request cannot make the engine allocate without bound.
    ``max_model_len``: what tokenize reports as the context length.
    """

    token_delay: float = 0.01
    embedding_dimensions: int = 16
    max_embedding_dimensions: int = 65536
    max_model_len: int = 4096

    def __post_init__(self) -> None:
        if self.token_delay < 0 or not math.isfinite(self.token_delay):
            raise OpenAIUsageError("token_delay must be a finite number of seconds >= 0")
        if not 1 <= self.embedding_dimensions <= self.max_embedding_dimensions:
            raise OpenAIUsageError("embedding_dimensions must be between 1 and max_embedding_dimensions")


@dataclass(frozen=True)
class ScheduledResult:
    """A ready ``TaskResult`` (task id and result index set) and when it is due.

    ``due`` is in seconds after the task's arrival; results come in due
    order, and ``is_last`` marks the one that completes the task.
    """

    due: float
    result: worker_pb2.TaskResult
    is_last: bool


def echo_task(task: worker_pb2.Task, config: EchoConfig, now: float) -> list[ScheduledResult]:
    """All results of ``task``, in order; ``now`` (seconds since the epoch) stamps ``created``."""
    kind = task.request.WhichOneof("request")
    created = int(now)
    try:
        if kind == "chat_completion":
            return _chat(task.id, task.request.chat_completion, created, config)
        if kind == "embedding":
            return [_reply(task.id, 0.0, 200, _embeddings(task.request.embedding, config))]
        if kind == "tokenize_request":
            return [_reply(task.id, 0.0, 200, _tokenize(task.request.tokenize_request, config))]
        if kind in ("audio_transcription", "model_response"):
            raise NotImplementedRequestError(f"The echo runtime does not serve {kind} requests.")
    except OpenAIError as exc:
        return [_reply(task.id, 0.0, exc.status, exc.body())]
    raise OpenAIUsageError(f"a {kind or 'empty'} task is for the engine agent, not the runtime")


def _reply(task_id: str, due: float, status: int, body: JSONObject) -> ScheduledResult:
    response = worker_pb2.HttpResponse(
        status_code=status,
        status=status_line(status),
        body=json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode("utf-8"),
    )
    response.header["Content-Type"].values.append("application/json")
    return ScheduledResult(
        due, worker_pb2.TaskResult(task_id=task_id, http_response=response, result_index=0), is_last=True
    )


# -- chat -------------------------------------------------------------------------


def _text_of(message: chat_pb2.ChatCompletionMessage) -> str:
    return "\n".join(part.text for part in message.content if part.type == "text")


def _chat(
    task_id: str, req: chat_pb2.CreateChatCompletionRequest, created: int, config: EchoConfig
) -> list[ScheduledResult]:
    if req.n > MAX_CHOICES:  # a gateway other than infx's may not have checked
        raise InvalidRequestError(f"'n' must be at most {MAX_CHOICES}.", param="n")
    user_texts = [_text_of(m) for m in req.messages if m.role == "user"]
    text = user_texts[-1] if user_texts else ""
    pieces = _PIECE.findall(text)
    if pieces:
        pieces[0] = text[: len(text) - len(text.lstrip())] + pieces[0]
    limits = [limit for limit in (req.max_completion_tokens, req.max_tokens) if limit > 0]
    finish_reason = "stop"
    if limits and len(pieces) > min(limits):
        pieces = pieces[: min(limits)]
        finish_reason = "length"
    prompt_tokens = sum(len(_text_of(m).split()) for m in req.messages)
    usage = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": len(pieces),
        "total_tokens": prompt_tokens + len(pieces),
        # As OpenAI's answers say it: echo caches nothing (the agent's infx_prompt_cache counts it).
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    choices = range(max(req.n, 1))
    completion_id = f"chatcmpl-{task_id}"
    end = len(pieces) * config.token_delay
    if not req.stream:
        body = {
            "id": completion_id,
            "object": "chat.completion",
            "created": created,
            "model": req.model,
            "choices": [
                {
                    "index": i,
                    "message": {"role": "assistant", "content": "".join(pieces)},
                    "logprobs": None,
                    "finish_reason": finish_reason,
                }
                for i in choices
            ],
            "usage": usage,
        }
        return [_reply(task_id, end, 200, body)]

    include_usage = req.stream_options.include_usage
    head = worker_pb2.HttpResponse(status_code=200, status="200 OK")
    head.header["Content-Type"].values.append("text/event-stream")
    results = [
        ScheduledResult(
            0.0, worker_pb2.TaskResult(task_id=task_id, http_response=head, result_index=0), is_last=False
        )
    ]

    def chunk(due: float, chunk_choices: list[JSONObject], chunk_usage: Any = None) -> None:
        payload: JSONObject = {
            "id": completion_id,
            "object": "chat.completion.chunk",
            "created": created,
            "model": req.model,
            "choices": chunk_choices,
        }
        if include_usage:
            payload["usage"] = chunk_usage
        _event(results, task_id, due, encode_json(payload), last=False)

    def choice(i: int, delta: JSONObject, reason: str | None = None) -> JSONObject:
        return {"index": i, "delta": delta, "logprobs": None, "finish_reason": reason}

    for i in choices:
        chunk(0.0, [choice(i, {"role": "assistant", "content": ""})])
    for k, piece in enumerate(pieces, start=1):
        for i in choices:
            chunk(k * config.token_delay, [choice(i, {"content": piece})])
    for i in choices:
        chunk(end, [choice(i, {}, finish_reason)])
    if include_usage:
        chunk(end, [], usage)
    _event(results, task_id, end, DONE_EVENT, last=True)
    return results


def _event(results: list[ScheduledResult], task_id: str, due: float, data: bytes, *, last: bool) -> None:
    event = worker_pb2.ServerSentEvent(data=data, is_last_event=last)
    results.append(
        ScheduledResult(
            due,
            worker_pb2.TaskResult(task_id=task_id, server_sent_event=event, result_index=len(results)),
            is_last=last,
        )
    )


# -- embeddings and tokenize ---------------------------------------------------------------


def _embedding_inputs(req: embeddings_pb2.CreateEmbeddingRequest) -> list[tuple[str, int]]:
    """Each input as (text to hash, tokens it counts for): words of a string, ids of a token array."""
    if not req.encoded_input:
        return [(req.input, len(req.input.split()))]
    value = decode_json_field(req.encoded_input, "input")
    if not isinstance(value, list) or not value:
        raise InvalidRequestError("'input' must be a non-empty array.", param="input")
    if all(isinstance(item, str) for item in value):
        return [(item, len(item.split())) for item in value]
    if all(isinstance(item, list) for item in value):
        return [(json.dumps(item), len(item)) for item in value]
    return [(json.dumps(value), len(value))]


def embedding_vector(text: str, dimensions: int) -> list[float]:
    """A deterministic unit vector for ``text``: hash bytes mapped to [-1, 1), then normalised."""
    digest = hashlib.shake_256(text.encode("utf-8", "surrogatepass")).digest(8 * dimensions)
    raw = [value / 2**63 - 1.0 for value in struct.unpack(f"<{dimensions}Q", digest)]
    norm = math.sqrt(math.fsum(x * x for x in raw))
    if norm == 0.0:
        return [1.0] + [0.0] * (dimensions - 1)
    return [x / norm for x in raw]


def _embeddings(req: embeddings_pb2.CreateEmbeddingRequest, config: EchoConfig) -> JSONObject:
    dimensions = req.dimensions or config.embedding_dimensions
    if not 1 <= dimensions <= config.max_embedding_dimensions:
        raise InvalidRequestError(
            f"'dimensions' must be between 1 and {config.max_embedding_dimensions}.", param="dimensions"
        )
    inputs = _embedding_inputs(req)
    data: list[JSONObject] = []
    for index, (text, _) in enumerate(inputs):
        vector = embedding_vector(text, dimensions)
        embedding: Any = vector
        if req.encoding_format == "base64":
            embedding = base64.b64encode(struct.pack(f"<{dimensions}f", *vector)).decode("ascii")
        data.append({"object": "embedding", "index": index, "embedding": embedding})
    tokens = sum(count for _, count in inputs)
    return {
        "object": "list",
        "data": data,
        "model": req.model,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }


def _token_ids(words: Iterable[str]) -> list[int]:
    return [int.from_bytes(hashlib.sha256(w.encode("utf-8", "surrogatepass")).digest()[:4], "little") % 32000
            for w in words]


def _tokenize(req: tokenize_pb2.TokenizeRequest, config: EchoConfig) -> JSONObject:
    texts = [req.prompt] if req.prompt else [_text_of(m) for m in req.messages]
    words = [word for text in texts for word in text.split()]
    return {"count": len(words), "max_model_len": config.max_model_len, "tokens": _token_ids(words)}
