"""What an OpenAI-style answer says about itself: its first content token, its token usage, its end.

No I/O, no clock reads; nothing here changes a byte of the answer (the
gateway relays it as it came). Time to first token is measured at the first
event that carries output (content, a tool call, a refusal, reasoning, a
completion's text, a ``*.delta`` of the Responses or transcription streams),
not at the role-only chunk that chat streams open with. Token counts come
from ``usage`` in a whole answer or in a stream's final chunk (chat and
completions with ``stream_options.include_usage``, ``response.completed``).
A stream that ends with an error event (``data: {"error": {...}}``, as infx
and vLLM send one) failed, whatever its status line said: :class:`StreamWatcher`
keeps that error. A stream's last event tells whether it ended or was cut off
(:func:`ends_stream`): chat and completions streams end with ``[DONE]``,
Responses streams with ``response.completed`` (or ``.failed``,
``.incomplete``), transcription streams with ``[DONE]`` or
``transcript.text.done``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from protocol.openai.errors import status_of_error
from protocol.openai.sse import DONE_DATA, EventReceived, SSEParser

__all__ = ["StreamError", "StreamWatcher", "Usage", "carries_output", "ends_stream", "usage_of", "usage_of_body"]

#: ``type`` of the events that end a Responses or transcription stream.
_FINAL_TYPES = frozenset({"response.completed", "response.failed", "response.incomplete", "transcript.text.done"})

#: How bytes that end on an event boundary end (a blank line after LF or CRLF).
_EVENT_ENDS = (b"\n\n", b"\n\r\n")
#: Delta members that are output (tool calls and the legacy function call count: they are what was generated).
_OUTPUT_DELTAS = ("content", "tool_calls", "function_call", "refusal", "reasoning_content", "reasoning", "audio")


@dataclass(frozen=True, slots=True)
class Usage:
    """Tokens the engine reported: read (prompt, input) and generated (completion, output)."""

    input_tokens: int
    output_tokens: int


def carries_output(chunk: Any) -> bool:
    """Whether one decoded stream event carries generated output (not only a role or a finish)."""
    if not isinstance(chunk, dict):
        return False
    kind = chunk.get("type")
    if isinstance(kind, str) and kind.endswith(".delta"):
        return bool(chunk.get("delta"))
    choices = chunk.get("choices")
    if not isinstance(choices, list):
        return False
    for choice in choices:
        if not isinstance(choice, dict):
            continue
        if choice.get("text"):
            return True
        delta = choice.get("delta")
        if isinstance(delta, dict) and any(delta.get(name) for name in _OUTPUT_DELTAS):
            return True
    return False


def usage_of(answer: Any) -> Usage | None:
    """The usage an answer or event reports, in either naming (prompt/completion, input/output)."""
    if not isinstance(answer, dict):
        return None
    usage = answer.get("usage")
    if usage is None and isinstance(answer.get("response"), dict):
        usage = answer["response"].get("usage")
    if not isinstance(usage, dict):
        return None
    read = _count(usage, "prompt_tokens", "input_tokens")
    written = _count(usage, "completion_tokens", "output_tokens")
    if read is None and written is None:
        return None
    return Usage(read or 0, written or 0)


def usage_of_body(body: bytes) -> Usage | None:
    """The usage of a whole (non-streaming) JSON answer; None if it has none or is not JSON."""
    if b'"usage"' not in body:
        return None
    try:
        return usage_of(json.loads(body))
    except ValueError:
        return None


@dataclass(frozen=True, slots=True)
class StreamError:
    """The error event a stream ended with: the status it stands for and its code (or type)."""

    status: int
    code: str


def _stream_error(chunk: Any) -> StreamError | None:
    if not isinstance(chunk, dict) or not isinstance(chunk.get("error"), dict):
        return None
    error = chunk["error"]
    code = error.get("code")
    name = code if isinstance(code, str) and code else error.get("type")
    return StreamError(status_of_error(error), name if isinstance(name, str) else "")


def ends_stream(event: bytes) -> bool:
    """Whether one whole event (as framed on the wire) is one a stream may end with: ``[DONE]``,
    an error, or the final event of a Responses or transcription stream."""
    for parsed in SSEParser(max_event_size=None).receive_data(event if event.endswith(_EVENT_ENDS) else event + b"\n\n"):
        if not isinstance(parsed, EventReceived):
            continue
        if parsed.data == DONE_DATA:
            return True
        try:
            chunk = json.loads(parsed.data)
        except ValueError:
            return False
        return _stream_error(chunk) is not None or (isinstance(chunk, dict) and chunk.get("type") in _FINAL_TYPES)
    return False


def _count(usage: dict[str, Any], *names: str) -> int | None:
    for name in names:
        value = usage.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            return value
    return None


class StreamWatcher:
    """Reads a relayed event stream for its first output, its usage and an error it ends with,
    without altering it.

    Event JSON is decoded only until the first output is seen; after that
    only events that mention ``usage`` or ``error`` are, and whole events that
    mention neither (the relay's usual case) are not even parsed: a long
    stream costs two substring searches per event.
    """

    def __init__(self) -> None:
        self._parser = SSEParser()
        self.first_output_seen = False
        self.usage: Usage | None = None
        #: The error event the stream carried, if any (a stream ends with it).
        self.error: StreamError | None = None

    def feed(self, data: bytes) -> bool:
        """Take the bytes of one relayed event; True if they hold the stream's first output."""
        if (self.first_output_seen and b'"usage"' not in data and b'"error"' not in data
                and data.endswith(_EVENT_ENDS) and self._parser.between_events):
            return False  # whole events without usage or an error: nothing in them is read
        first = False
        for event in self._parser.receive_data(data):
            if not isinstance(event, EventReceived) or event.data == DONE_DATA:
                continue
            if self.first_output_seen and '"usage"' not in event.data and '"error"' not in event.data:
                continue
            try:
                chunk = json.loads(event.data)
            except ValueError:
                continue
            if not self.first_output_seen and carries_output(chunk):
                self.first_output_seen = first = True
            usage = usage_of(chunk)
            if usage is not None:
                self.usage = usage
            self.error = _stream_error(chunk) or self.error
        return first
