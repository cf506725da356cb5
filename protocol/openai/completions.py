"""Legacy completions, response side: ``chat.completion`` -> ``text_completion``; pure, no I/O.

Rules this file keeps: a LLMariner engine has no completions request on its
wire, so the gateway asks it for a chat completion instead (see
:func:`protocol.openai.requests.parse_completion`) and rewrites each of its
answers here, whole bodies and streamed chunks alike; vLLM's extras that mean
the same in both APIs (``stop_reason``, ``prompt_logprobs``) are kept. An infx
engine gets ``/v1/completions`` itself and its answer is never converted. An
answer that is not the chat JSON the API promises raises
:class:`~protocol.openai.errors.UpstreamError` (HTTP 502); nothing else escapes.
"""

from __future__ import annotations

import json
from typing import Any

from protocol.openai.errors import UpstreamError
from protocol.openai.json import JSONObject
from protocol.openai.sse import DONE_DATA

_DONE = DONE_DATA.encode("ascii")


def text_completion_from_chat(chat: JSONObject) -> JSONObject:
    """A ``chat.completion`` object as the ``text_completion`` object OpenAI's legacy API returns."""
    return _convert(chat, "message")


def text_completion_chunk_from_chat(chunk: JSONObject) -> JSONObject:
    """A ``chat.completion.chunk`` as a streamed ``text_completion`` chunk.

    The role-only first chunk becomes a chunk with empty text; the usage
    chunk (no choices) keeps its usage and empty choices; an error event
    passes through unchanged.
    """
    return _convert(chunk, "delta")


def text_completion_body(body: bytes) -> bytes:
    """:func:`text_completion_from_chat` on an encoded body."""
    return _encode(text_completion_from_chat(_decode(body)))


def text_completion_event_data(data: bytes) -> bytes:
    """:func:`text_completion_chunk_from_chat` on one SSE event's data; ``[DONE]`` passes through."""
    if data.strip() == _DONE:
        return _DONE
    return _encode(text_completion_chunk_from_chat(_decode(data)))


def _convert(chat: JSONObject, key: str) -> JSONObject:
    if "error" in chat and "choices" not in chat:
        return chat  # an error event mid-stream means the same in both APIs
    choices = chat.get("choices")
    if not isinstance(choices, list):
        raise UpstreamError("The runtime's answer has no 'choices' array.")
    out: JSONObject = {
        "id": chat.get("id", ""),
        "object": "text_completion",
        "created": chat.get("created", 0),
        "model": chat.get("model", ""),
        "choices": [_choice(choice, key, chat.get("prompt_logprobs")) for choice in choices],
    }
    if chat.get("system_fingerprint") is not None:
        out["system_fingerprint"] = chat["system_fingerprint"]
    if chat.get("usage") is not None:
        out["usage"] = chat["usage"]
    return out


def _choice(choice: Any, key: str, prompt_logprobs: Any) -> JSONObject:
    if not isinstance(choice, dict):
        raise UpstreamError("A choice in the runtime's answer is not an object.")
    message = choice.get(key) or {}
    if not isinstance(message, dict):
        raise UpstreamError(f"A choice's '{key}' in the runtime's answer is not an object.")
    text = message.get("content") or ""
    if not isinstance(text, str):
        raise UpstreamError("A choice's content in the runtime's answer is not a string.")
    out: JSONObject = {
        "text": text,
        "index": choice.get("index", 0),
        "logprobs": None,
        "finish_reason": choice.get("finish_reason"),
    }
    if "stop_reason" in choice:
        out["stop_reason"] = choice["stop_reason"]
    # vLLM puts a chat answer's prompt_logprobs beside the choices, a completion's in each choice.
    if "prompt_logprobs" in choice:
        out["prompt_logprobs"] = choice["prompt_logprobs"]
    elif prompt_logprobs is not None:
        out["prompt_logprobs"] = prompt_logprobs
    return out


def _decode(data: bytes) -> JSONObject:
    try:
        value = json.loads(data)
    except (ValueError, RecursionError):
        raise UpstreamError("The runtime's answer is not valid JSON.") from None
    if not isinstance(value, dict):
        raise UpstreamError("The runtime's answer is not a JSON object.")
    return value


def _encode(value: JSONObject) -> bytes:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode("utf-8", "surrogatepass")
