"""Gateway direction: the client's request kept verbatim, beside its typed form; pure, no I/O.

Rules this file keeps: the gateway reads from a request only what it needs
itself -- the JSON must be an object, ``model`` a non-empty string (routing),
``stream`` a boolean and ``stream_options.include_usage`` a boolean (how to
relay the answer) -- and refuses nothing else: whether ``seed: 2**40``, a
``video_url`` part or ``echo: true`` is acceptable is the runtime's call. The
body travels byte for byte in ``TaskRequest.http_request`` (path and body;
the headers travel in ``Task.header``), for engines that run it verbatim.

Beside it goes the typed conversion of :mod:`protocol.openai.requests`, for
LLMariner engines. When that conversion refuses the request, the typed form
holds only the routing fields, ``typed_request_incomplete`` says why, and
only infx engines may serve it (:mod:`protocol.openai.task_forms`); the refusal is
kept in ``ParsedRequest.typed_error`` so that the gateway can answer it as
before when no such engine serves the model.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from protocol.openai.errors import InvalidRequestError
from protocol.openai.json import (
    JSONObject,
    as_bool,
    as_nonempty_str,
    as_object,
    loads_object,
    one_of,
    optional,
    required,
)
from protocol.openai.requests import ParsedRequest, parse_audio_transcription
from protocol.openai.task_forms import STREAMABLE_KINDS, routing_fields

#: An endpoint's typed conversion (:mod:`protocol.openai.requests`), given the parsed JSON object.
TypedParser = Callable[[JSONObject], ParsedRequest]


def parse_json(kind: str, path: str, body: bytes, typed: TypedParser) -> ParsedRequest:
    """A JSON endpoint's request: ``body`` verbatim at ``path``, with ``typed(obj)`` beside it if it converts.

    ``kind`` is the typed request kind ``typed`` produces (legacy completions become
    ``chat_completion``); only kinds with a stream flag read ``stream``.
    """
    obj = loads_object(body)
    model = required(obj, "model", "", as_nonempty_str)
    stream = kind in STREAMABLE_KINDS and bool(optional(obj, "stream", "", as_bool))
    include_usage = False
    if stream:
        options = optional(obj, "stream_options", "", as_object)
        include_usage = bool(optional(options or {}, "include_usage", "stream_options", as_bool))
    return _with_verbatim(kind, model, stream, include_usage, path, body, lambda: typed(obj), obj)


def parse_form(path: str, body: bytes, fields: Mapping[str, str], file: bytes | None, filename: str) -> ParsedRequest:
    """A multipart transcription request: ``body`` verbatim (files and their content types as sent).

    ``fields``, ``file`` and ``filename`` are the form as the gateway decoded it.
    """
    model = as_nonempty_str(fields.get("model", ""), "model")
    stream = one_of(fields.get("stream") or "false", "stream", ("true", "false")) == "true"
    return _with_verbatim(
        "audio_transcription", model, stream, False, path, body,
        lambda: parse_audio_transcription(fields, file, filename),
    )


def _with_verbatim(kind: str, model: str, stream: bool, include_usage: bool, path: str, body: bytes,
                   typed: Callable[[], ParsedRequest], body_json: JSONObject | None = None) -> ParsedRequest:
    typed_error: InvalidRequestError | None = None
    try:
        request = typed().request
    except InvalidRequestError as exc:
        typed_error = exc
        request = routing_fields(kind, model, stream)
        request.typed_request_incomplete = exc.message
    verbatim = request.http_request
    verbatim.method, verbatim.path, verbatim.body = "POST", path, body
    return ParsedRequest(request=request, model=model, stream=stream, include_usage=include_usage,
                         typed_error=typed_error, body_json=body_json)
