"""The OpenAI API surface of infx's pure core: conversions between OpenAI JSON and the wire.

Rules these modules keep: no I/O, no clock reads; bad client input ends in
:class:`InvalidRequestError` (HTTP 400, OpenAI error body) and nothing else.

- Gateway, request side: the client's request verbatim beside its typed
  form (:mod:`protocol.openai_verbatim`); the typed form for LLMariner
  engines: ``parse_chat_completion``, ``parse_completion``,
  ``parse_embedding``, ``parse_model_response``, ``parse_audio_transcription``,
  ``parse_tokenize`` -> :class:`ParsedRequest` (:mod:`protocol.openai_requests`).
- Gateway, legacy completions answers of LLMariner engines: ``text_completion_body``,
  ``text_completion_event_data`` (:mod:`protocol.openai_completions`).
- Engine, for a task with only the typed form: ``runtime_request`` ->
  :class:`RuntimeRequest` (path + JSON or multipart form) for the runtime
  (:mod:`protocol.openai_runtime`).
"""

from protocol.openai_completions import (
    text_completion_body,
    text_completion_chunk_from_chat,
    text_completion_event_data,
    text_completion_from_chat,
)
from protocol.openai_errors import (
    InvalidRequestError,
    LocalUsageError,
    NotImplementedRequestError,
    OpenAIError,
    UpstreamError,
)
from protocol.openai_requests import (
    ParsedRequest,
    parse_audio_transcription,
    parse_chat_completion,
    parse_completion,
    parse_embedding,
    parse_model_response,
    parse_tokenize,
)
from protocol.openai_runtime import (
    MultipartForm,
    RuntimeRequest,
    audio_transcription_form,
    chat_completion_json,
    embedding_json,
    model_response_json,
    runtime_request,
    tokenize_json,
)

__all__ = [
    "InvalidRequestError",
    "LocalUsageError",
    "MultipartForm",
    "NotImplementedRequestError",
    "OpenAIError",
    "ParsedRequest",
    "RuntimeRequest",
    "UpstreamError",
    "audio_transcription_form",
    "chat_completion_json",
    "embedding_json",
    "model_response_json",
    "parse_audio_transcription",
    "parse_chat_completion",
    "parse_completion",
    "parse_embedding",
    "parse_model_response",
    "parse_tokenize",
    "runtime_request",
    "text_completion_body",
    "text_completion_chunk_from_chat",
    "text_completion_event_data",
    "text_completion_from_chat",
    "tokenize_json",
]
