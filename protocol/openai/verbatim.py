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

The typed form costs more than everything else the gateway does with a
request's body, and only LLMariner engines read it: a request no such engine
may get is parsed without it (``typed_wanted``), holding only its routing
fields and :data:`~protocol.openai.task_forms.ROUTING_FIELDS_ONLY`, and
:func:`with_typed_form` builds it should one become the request's engine after
all (it joined while the request waited).
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
from protocol.openai.requests import (
    ParsedRequest,
    parse_audio_transcription,
    parse_chat_completion,
    parse_completion,
    parse_embedding,
    parse_model_response,
    parse_tokenize,
)
from protocol.openai.task_forms import ROUTING_FIELDS_ONLY, STREAMABLE_KINDS, routing_fields
from protocol.pb import worker_pb2

#: An endpoint's typed conversion (:mod:`protocol.openai.requests`), given the parsed JSON object.
TypedParser = Callable[[JSONObject], ParsedRequest]

#: Each JSON endpoint's typed conversion, by the path the runtime serves it at (the verbatim
#: form's path without its query): legacy completions become chat completions.
TYPED_BY_PATH: dict[str, TypedParser] = {
    "/v1/chat/completions": parse_chat_completion,
    "/v1/completions": parse_completion,
    "/v1/embeddings": parse_embedding,
    "/v1/responses": parse_model_response,
    "/tokenize": parse_tokenize,
}


def parse_json(kind: str, path: str, body: bytes, typed: TypedParser,
               typed_wanted: Callable[[str], bool] | None = None) -> ParsedRequest:
    """A JSON endpoint's request: ``body`` verbatim at ``path``, with ``typed(obj)`` beside it if it converts.

    ``kind`` is the typed request kind ``typed`` produces (legacy completions become
    ``chat_completion``); only kinds with a stream flag read ``stream``. When
    ``typed_wanted(model)`` says no engine that may get the request takes the typed form,
    it is not built (see the module docstring).
    """
    obj = loads_object(body)
    model = required(obj, "model", "", as_nonempty_str)
    stream = kind in STREAMABLE_KINDS and bool(optional(obj, "stream", "", as_bool))
    include_usage = False
    if stream:
        options = optional(obj, "stream_options", "", as_object)
        include_usage = bool(optional(options or {}, "include_usage", "stream_options", as_bool))
    later = typed_wanted is not None and not typed_wanted(model)
    return _with_verbatim(kind, model, stream, include_usage, path, body, None if later else lambda: typed(obj), obj)


def typed_form_deferred(request: worker_pb2.TaskRequest) -> bool:
    """Whether ``request`` holds its routing fields only because its typed form was not built
    yet (:func:`with_typed_form` can build it), not because it cannot be."""
    return (request.typed_request_incomplete == ROUTING_FIELDS_ONLY
            and request.http_request.path.partition("?")[0] in TYPED_BY_PATH)


def with_typed_form(request: worker_pb2.TaskRequest) -> worker_pb2.TaskRequest:
    """``request`` (:func:`typed_form_deferred`) with its typed form built from its verbatim
    body, or, if it does not convert, with the reason in ``typed_request_incomplete``; the
    caller's request is not changed."""
    kind = request.WhichOneof("request")
    assert kind is not None and typed_form_deferred(request), "a request without a typed form to build"
    http = request.http_request
    typed = TYPED_BY_PATH[http.path.partition("?")[0]]
    routing = getattr(request, kind)
    stream = bool(getattr(routing, "stream", False))

    def convert() -> ParsedRequest:
        return typed(loads_object(http.body))

    out = _with_verbatim(kind, routing.model, stream, False, http.path, http.body, convert).request
    out.http_request.method = http.method
    out.infx_prefix_tip = request.infx_prefix_tip
    if request.HasField("infx_caller"):
        out.infx_caller.CopyFrom(request.infx_caller)
    return out


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
                   typed: Callable[[], ParsedRequest] | None, body_json: JSONObject | None = None) -> ParsedRequest:
    """The request with its verbatim form and ``typed()``'s conversion beside it, or only the routing
    fields: with the reason ``typed()`` refused, or, ``typed`` None, :data:`ROUTING_FIELDS_ONLY`
    (built later if ever wanted, :func:`with_typed_form`)."""
    typed_error: InvalidRequestError | None = None
    if typed is None:
        request = routing_fields(kind, model, stream)
        request.typed_request_incomplete = ROUTING_FIELDS_ONLY
    else:
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
