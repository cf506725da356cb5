"""What a runtime's answer says about its prompt: tokens, and how many its prefix cache served; pure.

Rules this file keeps: no I/O, no clock, no state; bytes in, a
:class:`PromptUsage` (or None: "this piece says nothing") out, never an
exception for a body it cannot read. It runs on every result the engine agent
relays, so a piece that cannot hold the figures is passed over on a substring
test, before any JSON is parsed.

Where the figures are, as the runtimes write them:

- llama.cpp's server: ``timings.cache_n`` (prompt tokens reused) and
  ``timings.prompt_n`` (computed) in every answer, in a stream's last chunk;
  and ``usage.prompt_tokens_details.cached_tokens`` with
  ``usage.prompt_tokens`` (which counts both);
- vLLM (``--enable-prompt-tokens-details``), SGLang, OpenAI:
  ``usage.prompt_tokens`` and ``usage.prompt_tokens_details.cached_tokens``;
  a stream carries ``usage`` only when the client asked for it
  (``stream_options.include_usage``).

A ``usage`` without ``prompt_tokens_details`` says nothing about the cache,
so it gives nothing rather than a hit rate of zero.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from protocol.pb import worker_pb2

__all__ = ["PromptUsage", "may_hold_usage", "prompt_usage"]

#: A piece that holds neither name holds no figures.
_CACHE_N, _CACHED_TOKENS = b'"cache_n"', b'"cached_tokens"'


@dataclass(frozen=True)
class PromptUsage:
    """One answer's prompt: its tokens, and how many of them came from the runtime's cache."""

    prompt_tokens: int
    cached_tokens: int


def prompt_usage(result: worker_pb2.TaskResult) -> PromptUsage | None:
    """The prompt usage a runtime wrote in this result (a whole answer's body, or one stream event), if any."""
    kind = result.WhichOneof("message")
    if kind == "http_response":
        data = result.http_response.body
    elif kind == "server_sent_event":
        data = result.server_sent_event.data
    else:
        return None
    if not may_hold_usage(data):
        return None
    for payload in _payloads(data):
        try:
            obj = json.loads(payload)
        except (ValueError, RecursionError):
            continue
        usage = _from_object(obj)
        if usage is not None:
            return usage
    return None


def may_hold_usage(data: bytes) -> bool:
    """False when ``data`` holds no prompt usage, on two substring tests (no generator per event)."""
    return _CACHE_N in data or _CACHED_TOKENS in data


def _payloads(data: bytes) -> list[bytes]:
    """The JSON texts in ``data``: an event's ``data:`` lines (one event may hold several), else the body."""
    stripped = data.lstrip()
    if not stripped.startswith(b"data:"):
        return [data]
    return [line[5:].strip() for line in data.split(b"\n") if line.startswith(b"data:") and b"{" in line]


def _count(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def _from_object(obj: Any) -> PromptUsage | None:
    if not isinstance(obj, dict):
        return None
    timings = obj.get("timings")
    if isinstance(timings, dict):
        cached, computed = _count(timings.get("cache_n")), _count(timings.get("prompt_n"))
        if cached is not None and computed is not None:
            return PromptUsage(cached + computed, cached)
    usage = obj.get("usage")
    if isinstance(usage, dict):
        details = usage.get("prompt_tokens_details")
        prompt = _count(usage.get("prompt_tokens"))
        if isinstance(details, dict) and prompt is not None:
            cached = _count(details.get("cached_tokens"))
            if cached is not None and cached <= prompt:
                return PromptUsage(prompt, cached)
    return None
