"""Gateway direction: OpenAI request JSON -> LLMariner's typed ``TaskRequest``; pure, no I/O.

This is the form a LLMariner engine takes. infx's own engines get the
client's request verbatim instead (:mod:`protocol.openai.verbatim`, which
calls these parsers for the typed form beside it); what follows limits only
what LLMariner engines receive, and docs/operations.md lists it.

Rules this file keeps: every parser takes the client's bytes (or its
already parsed JSON object, or form fields) and returns a
:class:`ParsedRequest` or raises
:class:`~protocol.openai.errors.InvalidRequestError` (HTTP 400 with an
OpenAI error body) -- no other exception, whatever the input. Members the
typed messages have no field for are dropped (the verbatim form keeps them).
Values the wire cannot carry faithfully are rejected rather than silently
changed; such a request then goes only to infx engines.

Known proto3 limits, inherited from LLMariner's wire, where zero means "not
set": ``n``/``max_tokens`` below 1 are rejected; a zero penalty is the
runtime's default anyway; a ``seed`` of 0 is lost (the runtime samples
unseeded); in the Responses API, ``parallel_tool_calls: false`` and
``store: false`` are lost (the runtime's default, true, applies). A legacy
``/v1/completions`` request converts to a chat completion (see
:func:`parse_completion`).

Size (over 600 lines): one parser per OpenAI endpoint (chat, completions, embeddings, responses,
audio, tokenize) and the field readers they share at the bottom; split per endpoint, the shared
readers and the limits docs/operations.md lists would be spread over six files.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from protocol.openai.errors import InvalidRequestError
from protocol.openai.json import (
    JSONObject,
    as_bool,
    as_int,
    as_list,
    as_nonempty_str,
    as_number,
    as_object,
    as_str,
    check_text,
    encode_json_field,
    join,
    loads_object,
    one_of,
    optional,
    required,
)
from protocol.pb import (
    audio_pb2,
    chat_pb2,
    embeddings_pb2,
    model_response_pb2,
    tokenize_pb2,
    worker_pb2,
)

ChatRequest = chat_pb2.CreateChatCompletionRequest

TOOL_CHOICE_STRINGS = ("none", "auto", "required")
RESPONSE_FORMAT_TYPES = ("text", "json_object", "json_schema")
AUDIO_RESPONSE_FORMATS = ("json", "text", "srt", "verbose_json", "vtt")
EMBEDDING_ENCODINGS = ("float", "base64")
# The default of the legacy completions API (the chat API has none); kept so
# that a /v1/completions client gets what OpenAI would give it.
LEGACY_DEFAULT_MAX_TOKENS = 16
# OpenAI's upper bound for ``n``.
MAX_CHOICES = 128


@dataclass(frozen=True)
class ParsedRequest:
    """A client request ready to become a ``Task``.

    ``include_usage`` is what the client asked for in
    ``stream_options.include_usage``; the gateway may ask the engine for
    usage anyway (for metrics) and drop the usage chunk when this is false.
    ``typed_error`` says why ``request`` holds no typed form (only the
    client's verbatim request, see :mod:`protocol.openai.verbatim`): the
    400 to answer when no engine can take the verbatim form. ``body_json``
    is a JSON endpoint's body as decoded once, for whatever else reads it
    (routing hints), never changed.
    """

    request: worker_pb2.TaskRequest
    model: str
    stream: bool
    include_usage: bool = False
    typed_error: InvalidRequestError | None = None
    body_json: JSONObject | None = None


# -- chat completions ---------------------------------------------------------


def parse_chat_completion(body: bytes | str | JSONObject) -> ParsedRequest:
    """``POST /v1/chat/completions`` body -> ``TaskRequest.chat_completion``."""
    obj = _object(body)
    req = ChatRequest()
    req.model = required(obj, "model", "", as_nonempty_str)
    messages = required(obj, "messages", "", as_list)
    if not messages:
        raise InvalidRequestError(
            "'messages' must contain at least one message.", param="messages", code="empty_array"
        )
    for i, item in enumerate(messages):
        _message(item, join("messages", i), req.messages.add())
    _sampling(obj, req)
    _chat_only_fields(obj, req)
    include_usage = _stream(obj, req)
    return ParsedRequest(
        request=worker_pb2.TaskRequest(chat_completion=req),
        model=req.model,
        stream=req.stream,
        include_usage=include_usage,
    )


def _message(value: Any, path: str, out: chat_pb2.ChatCompletionMessage) -> None:
    msg = as_object(value, path)
    out.role = required(msg, "role", path, as_nonempty_str)
    content = msg.get("content")
    if isinstance(content, str):
        out.content.add(type="text", text=check_text(content, join(path, "content")))
    elif content is not None:
        parts = as_list(content, join(path, "content"))
        for i, part in enumerate(parts):
            _content_part(part, join(join(path, "content"), i), out.content.add())
    name = optional(msg, "name", path, as_str)
    if name is not None:
        out.name = name
    tool_call_id = optional(msg, "tool_call_id", path, as_str)
    if tool_call_id is not None:
        out.tool_call_id = tool_call_id
    for i, item in enumerate(optional(msg, "tool_calls", path, as_list) or ()):
        call_path = join(join(path, "tool_calls"), i)
        call = as_object(item, call_path)
        out_call = out.tool_calls.add()
        out_call.id = optional(call, "id", call_path, as_str) or ""
        out_call.type = optional(call, "type", call_path, as_str) or "function"
        function = required(call, "function", call_path, as_object)
        function_path = join(call_path, "function")
        out_call.function.name = required(function, "name", function_path, as_str)
        out_call.function.arguments = optional(function, "arguments", function_path, as_str) or ""


def _content_part(value: Any, path: str, out: chat_pb2.ChatCompletionMessage.Content) -> None:
    part = as_object(value, path)
    kind = required(part, "type", path, as_str)
    out.type = kind
    if kind == "text":
        out.text = required(part, "text", path, as_str)
    elif kind == "image_url":
        image = required(part, "image_url", path, as_object)
        image_path = join(path, "image_url")
        out.image_url.url = required(image, "url", image_path, as_str)
        detail = optional(image, "detail", image_path, as_str)
        if detail is not None:
            out.image_url.detail = one_of(detail, join(image_path, "detail"), ("auto", "low", "high"))
    elif kind == "input_audio":
        audio = required(part, "input_audio", path, as_object)
        audio_path = join(path, "input_audio")
        out.input_audio.data = required(audio, "data", audio_path, as_str)
        out.input_audio.format = required(audio, "format", audio_path, as_str)
    elif kind == "audio_url":
        audio_url = required(part, "audio_url", path, as_object)
        out.audio_url.url = required(audio_url, "url", join(path, "audio_url"), as_str)
    else:
        raise InvalidRequestError(
            f"Unsupported content part type {kind!r} in '{path}'; "
            "supported types are 'text', 'image_url', 'input_audio' and 'audio_url'.",
            param=join(path, "type"),
            code="invalid_value",
        )


def _sampling(obj: JSONObject, req: ChatRequest) -> None:
    """The sampling parameters chat completions and legacy completions share."""
    temperature = optional(obj, "temperature", "", _number_between(0.0, 2.0))
    if temperature is not None:
        req.temperature = temperature
        req.is_temperature_set = True
    top_p = optional(obj, "top_p", "", _number_between(0.0, 1.0))
    if top_p is not None:
        req.top_p = top_p
        req.is_top_p_set = True
    for key in ("frequency_penalty", "presence_penalty"):
        penalty = optional(obj, key, "", _number_between(-2.0, 2.0))
        if penalty is not None:
            setattr(req, key, penalty)
    logit_bias = optional(obj, "logit_bias", "", as_object)
    for token, bias in (logit_bias or {}).items():
        param = join("logit_bias", check_text(token, "logit_bias"))
        req.logit_bias[token] = as_number(bias, param, -100.0, 100.0)
    n = optional(obj, "n", "", _int_between(1, MAX_CHOICES))
    if n is not None:
        req.n = n
    max_tokens = optional(obj, "max_tokens", "", _int_at_least(1))
    if max_tokens is not None:
        req.max_tokens = max_tokens
    seed = optional(obj, "seed", "", as_int)
    if seed is not None:
        req.seed = seed
    stop = obj.get("stop")
    if isinstance(stop, str):
        req.stop.append(check_text(stop, "stop"))
    elif stop is not None:
        for i, item in enumerate(as_list(stop, "stop")):
            req.stop.append(as_str(item, join("stop", i)))
    user = optional(obj, "user", "", as_str)
    if user is not None:
        req.user = user


def _chat_only_fields(obj: JSONObject, req: ChatRequest) -> None:
    logprobs = optional(obj, "logprobs", "", as_bool)
    if logprobs is not None:
        req.logprobs = logprobs
    top_logprobs = optional(obj, "top_logprobs", "", _int_between(0, 20))
    if top_logprobs is not None:
        req.top_logprobs = top_logprobs
    max_completion_tokens = optional(obj, "max_completion_tokens", "", _int_at_least(1))
    if max_completion_tokens is not None:
        req.max_completion_tokens = max_completion_tokens
    kwargs = optional(obj, "chat_template_kwargs", "", as_object)
    if kwargs is not None:
        req.encoded_chat_template_kwargs = encode_json_field(kwargs)
    _response_format(obj, req)
    _tools(obj, req)


def _response_format(obj: JSONObject, req: ChatRequest) -> None:
    fmt = optional(obj, "response_format", "", as_object)
    if fmt is None:
        return
    kind = one_of(required(fmt, "type", "response_format", as_str), "response_format.type", RESPONSE_FORMAT_TYPES)
    req.response_format.type = kind
    if kind != "json_schema":
        return
    path = "response_format.json_schema"
    schema = required(fmt, "json_schema", "response_format", as_object)
    out = req.response_format.json_schema
    out.name = required(schema, "name", path, as_str)
    out.description = optional(schema, "description", path, as_str) or ""
    out.strict = bool(optional(schema, "strict", path, as_bool))
    body = optional(schema, "schema", path, as_object)
    if body is not None:
        out.encoded_schema = encode_json_field(body)


def _tools(obj: JSONObject, req: ChatRequest) -> None:
    for i, item in enumerate(optional(obj, "tools", "", as_list) or ()):
        path = join("tools", i)
        tool = as_object(item, path)
        out = req.tools.add()
        out.type = one_of(required(tool, "type", path, as_str), join(path, "type"), ("function",))
        function = required(tool, "function", path, as_object)
        function_path = join(path, "function")
        out.function.name = required(function, "name", function_path, as_nonempty_str)
        out.function.description = optional(function, "description", function_path, as_str) or ""
        parameters = optional(function, "parameters", function_path, as_object)
        if parameters is not None:
            out.function.encoded_parameters = encode_json_field(parameters)
    choice = obj.get("tool_choice")
    if isinstance(choice, str):
        req.tool_choice = one_of(choice, "tool_choice", TOOL_CHOICE_STRINGS)
    elif choice is not None:
        choice_obj = as_object(choice, "tool_choice")
        req.tool_choice_object.type = one_of(
            required(choice_obj, "type", "tool_choice", as_str), "tool_choice.type", ("function",)
        )
        function = required(choice_obj, "function", "tool_choice", as_object)
        req.tool_choice_object.function.name = required(function, "name", "tool_choice.function", as_nonempty_str)


def _stream(obj: JSONObject, req: ChatRequest) -> bool:
    """Sets ``stream``/``stream_options``; returns the client's ``include_usage``."""
    req.stream = bool(optional(obj, "stream", "", as_bool))
    options = optional(obj, "stream_options", "", as_object)
    if options is None:
        return False
    if not req.stream:
        raise InvalidRequestError(
            "'stream_options' is only allowed when 'stream' is true.", param="stream_options"
        )
    include_usage = bool(optional(options, "include_usage", "stream_options", as_bool))
    req.stream_options.include_usage = include_usage
    return include_usage


# -- legacy completions -------------------------------------------------------


def parse_completion(body: bytes | str | JSONObject) -> ParsedRequest:
    """``POST /v1/completions`` body -> a chat completion for the engine.

    The prompt becomes the single user message (a list holding one string
    is the same as that string). A list of several prompts asks OpenAI for
    independent completions per prompt, which one chat completion cannot
    give, so it is rejected, as are token-id prompts, ``echo``, ``suffix``,
    ``best_of`` > 1 and ``logprobs`` (the chat API's logprobs have another
    shape). ``max_tokens`` defaults to the legacy API's 16. The gateway
    turns the answer back with :mod:`protocol.openai.completions`.
    """
    obj = _object(body)
    req = ChatRequest()
    req.model = required(obj, "model", "", as_nonempty_str)
    req.messages.add(role="user").content.add(type="text", text=_legacy_prompt(obj))
    if obj.get("echo") is not None and as_bool(obj["echo"], "echo"):
        raise _unsupported("echo", "'echo' is not supported by this server.")
    suffix = optional(obj, "suffix", "", as_str)
    if suffix:
        raise _unsupported("suffix", "'suffix' is not supported by this server.")
    best_of = optional(obj, "best_of", "", _int_at_least(1))
    if best_of is not None and best_of > 1:
        raise _unsupported("best_of", "'best_of' greater than 1 is not supported by this server.")
    if obj.get("logprobs") is not None:
        as_int(obj["logprobs"], "logprobs", 0, 5)
        raise _unsupported("logprobs", "'logprobs' is not supported by this server's completions API.")
    _sampling(obj, req)
    if req.max_tokens == 0:
        req.max_tokens = LEGACY_DEFAULT_MAX_TOKENS
    include_usage = _stream(obj, req)
    return ParsedRequest(
        request=worker_pb2.TaskRequest(chat_completion=req),
        model=req.model,
        stream=req.stream,
        include_usage=include_usage,
    )


def _legacy_prompt(obj: JSONObject) -> str:
    prompt = required(obj, "prompt", "", lambda value, param: value)
    if isinstance(prompt, str):
        return check_text(prompt, "prompt")
    items = as_list(prompt, "prompt")
    if items and all(isinstance(item, str) for item in items):
        if len(items) > 1:
            raise _unsupported("prompt", "A list of several prompts is not supported; send one request per prompt.")
        return check_text(items[0], "prompt[0]")
    raise InvalidRequestError(
        "'prompt' must be a string or a list holding one string; token-id prompts are not supported.",
        param="prompt",
        code="invalid_type",
    )


def _unsupported(param: str, message: str) -> InvalidRequestError:
    return InvalidRequestError(message, param=param, code="unsupported_parameter")


# -- embeddings ----------------------------------------------------------------


def parse_embedding(body: bytes | str | JSONObject) -> ParsedRequest:
    """``POST /v1/embeddings`` body -> ``TaskRequest.embedding``.

    A string input travels in ``input``; an array (strings, token ids, or
    arrays of token ids) in ``encoded_input``.
    """
    obj = _object(body)
    req = embeddings_pb2.CreateEmbeddingRequest()
    req.model = required(obj, "model", "", as_nonempty_str)
    value = required(obj, "input", "", lambda v, param: v)
    if isinstance(value, str):
        req.input = as_nonempty_str(value, "input")
    else:
        req.encoded_input = encode_json_field(_embedding_input(value))
    encoding_format = optional(obj, "encoding_format", "", as_str)
    if encoding_format is not None:
        req.encoding_format = one_of(encoding_format, "encoding_format", EMBEDDING_ENCODINGS)
    dimensions = optional(obj, "dimensions", "", _int_at_least(1))
    if dimensions is not None:
        req.dimensions = dimensions
    user = optional(obj, "user", "", as_str)
    if user is not None:
        req.user = user
    return ParsedRequest(request=worker_pb2.TaskRequest(embedding=req), model=req.model, stream=False)


def _embedding_input(value: Any) -> list[Any]:
    """Strings, token ids, or arrays of token ids -- one kind throughout, as the first item says."""
    items = as_list(value, "input")
    if not items:
        raise InvalidRequestError("'input' must not be empty.", param="input", code="empty_array")
    for i, item in enumerate(items):
        param = join("input", i)
        if isinstance(items[0], str):
            as_nonempty_str(item, param)
        elif isinstance(items[0], list):
            if not as_list(item, param):
                raise InvalidRequestError("Token arrays must not be empty.", param=param, code="empty_array")
            for j, token in enumerate(item):
                as_int(token, join(param, j), 0)
        else:
            as_int(item, param, 0)
    return items


# -- responses -----------------------------------------------------------------


def parse_model_response(body: bytes | str | JSONObject) -> ParsedRequest:
    """``POST /v1/responses`` body -> ``TaskRequest.model_response``.

    A string ``input`` travels as is; any other input, ``tools``, the
    ``tools`` of an ``allowed_tools`` tool choice and ``text.format.schema``
    travel base64-encoded. ``truncation`` ("auto"/"disabled") maps onto the
    wire's bool.
    """
    obj = _object(body)
    req = model_response_pb2.CreateModelResponseRequest()
    req.model = required(obj, "model", "", as_nonempty_str)
    value = obj.get("input")
    if isinstance(value, str):
        req.input = as_nonempty_str(value, "input")
    elif value is not None:
        items = as_list(value, "input")
        if not items:
            raise InvalidRequestError("'input' must not be empty.", param="input", code="empty_array")
        for i, item in enumerate(items):
            as_object(item, join("input", i))
        req.encoded_input = encode_json_field(items)
    else:
        raise InvalidRequestError("Missing required parameter: 'input'.", param="input", code="missing_required_parameter")
    for key in ("background", "parallel_tool_calls", "store", "stream"):
        flag = optional(obj, key, "", as_bool)
        if flag is not None:
            setattr(req, key, flag)
    for key in ("instructions", "previous_response_id", "prompt_cache_key", "safety_identifier", "service_tier", "user"):
        text = optional(obj, key, "", as_str)
        if text is not None:
            setattr(req, key, text)
    for key in ("max_output_tokens", "max_tool_calls"):
        count = optional(obj, key, "", _int_at_least(1))
        if count is not None:
            setattr(req, key, count)
    top_logprobs = optional(obj, "top_logprobs", "", _int_between(0, 20))
    if top_logprobs is not None:
        req.top_logprobs = top_logprobs
    temperature = optional(obj, "temperature", "", _number_between(0.0, 2.0))
    if temperature is not None:
        req.temperature, req.is_temperature_set = temperature, True
    top_p = optional(obj, "top_p", "", _number_between(0.0, 1.0))
    if top_p is not None:
        req.top_p, req.is_top_p_set = top_p, True
    for i, item in enumerate(optional(obj, "include", "", as_list) or ()):
        req.include.append(as_str(item, join("include", i)))
    for key, item in (optional(obj, "metadata", "", as_object) or {}).items():
        req.metadata[check_text(key, "metadata")] = as_str(item, join("metadata", key))
    truncation = obj.get("truncation")
    if isinstance(truncation, str):
        req.truncation = one_of(truncation, "truncation", ("auto", "disabled")) == "auto"
    elif truncation is not None:
        req.truncation = as_bool(truncation, "truncation")
    _response_prompt_and_reasoning(obj, req)
    _response_text(obj, req)
    _response_tools(obj, req)
    if req.stream:
        options = optional(obj, "stream_options", "", as_object)
        if options is not None:
            flag = optional(options, "include_obfuscation", "stream_options", as_bool)
            req.stream_options.include_obfuscation = bool(flag)
    return ParsedRequest(request=worker_pb2.TaskRequest(model_response=req), model=req.model, stream=req.stream)


def _response_prompt_and_reasoning(obj: JSONObject, req: model_response_pb2.CreateModelResponseRequest) -> None:
    prompt = optional(obj, "prompt", "", as_object)
    if prompt is not None:
        req.prompt.id = required(prompt, "id", "prompt", as_str)
        req.prompt.version = optional(prompt, "version", "prompt", as_str) or ""
    reasoning = optional(obj, "reasoning", "", as_object)
    if reasoning is not None:
        req.reasoning.SetInParent()
        for key in ("effort", "generate_summary", "summary"):
            setattr(req.reasoning, key, optional(reasoning, key, "reasoning", as_str) or "")


def _response_text(obj: JSONObject, req: model_response_pb2.CreateModelResponseRequest) -> None:
    text = optional(obj, "text", "", as_object)
    if text is None:
        return
    req.text.SetInParent()
    req.text.verbosity = optional(text, "verbosity", "text", as_str) or ""
    fmt = optional(text, "format", "text", as_object)
    if fmt is None:
        return
    path = "text.format"
    out = req.text.format
    out.type = one_of(required(fmt, "type", path, as_str), join(path, "type"), RESPONSE_FORMAT_TYPES)
    out.name = optional(fmt, "name", path, as_str) or ""
    out.description = optional(fmt, "description", path, as_str) or ""
    out.strict = bool(optional(fmt, "strict", path, as_bool))
    schema = optional(fmt, "schema", path, as_object)
    if schema is not None:
        out.encoded_schema = encode_json_field(schema)


def _response_tools(obj: JSONObject, req: model_response_pb2.CreateModelResponseRequest) -> None:
    tools = optional(obj, "tools", "", as_list)
    if tools is not None:
        for i, tool in enumerate(tools):
            as_object(tool, join("tools", i))
        req.encoded_tools = encode_json_field(tools)
    choice = obj.get("tool_choice")
    if isinstance(choice, str):
        req.tool_choice = one_of(choice, "tool_choice", TOOL_CHOICE_STRINGS)
    elif choice is not None:
        choice_obj = as_object(choice, "tool_choice")
        out = req.tool_choice_object
        out.type = required(choice_obj, "type", "tool_choice", as_nonempty_str)
        for key in ("name", "mode", "server_label"):
            setattr(out, key, optional(choice_obj, key, "tool_choice", as_str) or "")
        allowed = optional(choice_obj, "tools", "tool_choice", as_list)
        if allowed is not None:
            out.encoded_tools = encode_json_field(allowed)


# -- audio transcriptions ------------------------------------------------------


def parse_audio_transcription(fields: Mapping[str, str], file: bytes | None, filename: str) -> ParsedRequest:
    """A ``POST /v1/audio/transcriptions`` multipart form -> ``TaskRequest.audio_transcription``.

    ``fields`` are the form's text fields, already decoded (the last value
    wins when a field repeats); ``file`` is the ``file`` part's content, or
    ``None`` when the form has no file part.
    """
    req = audio_pb2.CreateAudioTranscriptionRequest()

    def field(name: str) -> str:
        return as_str(fields.get(name, ""), name)

    req.model = as_nonempty_str(field("model"), "model")
    if file is None:
        raise InvalidRequestError("Missing required parameter: 'file'.", param="file", code="missing_required_parameter")
    if not file:
        raise InvalidRequestError("'file' must not be empty.", param="file")
    req.file = file
    req.filename = as_str(filename, "file")
    req.prompt = field("prompt")
    req.language = field("language")
    if field("response_format"):
        req.response_format = one_of(field("response_format"), "response_format", AUDIO_RESPONSE_FORMATS)
    if field("stream"):
        req.stream = one_of(field("stream"), "stream", ("true", "false")) == "true"
    if field("temperature"):
        try:
            value = float(field("temperature"))
        except ValueError:
            raise InvalidRequestError("'temperature' must be a number.", param="temperature") from None
        req.temperature = as_number(value, "temperature", 0.0, 1.0)
    return ParsedRequest(request=worker_pb2.TaskRequest(audio_transcription=req), model=req.model, stream=req.stream)


# -- tokenize -----------------------------------------------------------------


def parse_tokenize(body: bytes | str | JSONObject) -> ParsedRequest:
    """vLLM's ``POST /tokenize`` body (``prompt`` or chat ``messages``) -> ``TaskRequest.tokenize_request``."""
    obj = _object(body)
    req = tokenize_pb2.TokenizeRequest()
    req.model = required(obj, "model", "", as_nonempty_str)
    prompt = optional(obj, "prompt", "", as_str)
    if prompt is not None:
        req.prompt = prompt
    for i, item in enumerate(optional(obj, "messages", "", as_list) or ()):
        _message(item, join("messages", i), req.messages.add())
    if not req.prompt and not req.messages:
        raise InvalidRequestError(
            "One of 'prompt' or 'messages' is required.", param="prompt", code="missing_required_parameter"
        )
    return ParsedRequest(request=worker_pb2.TaskRequest(tokenize_request=req), model=req.model, stream=False)


# -- small readers -------------------------------------------------------------


def _object(body: bytes | str | JSONObject) -> JSONObject:
    """The request's JSON object; the gateway may have parsed it already (see :mod:`protocol.openai.verbatim`)."""
    return body if isinstance(body, dict) else loads_object(body)


def _number_between(minimum: float, maximum: float) -> Callable[[Any, str], float]:
    def read(value: Any, param: str) -> float:
        return as_number(value, param, minimum, maximum)

    return read


def _int_between(minimum: int, maximum: int) -> Callable[[Any, str], int]:
    def read(value: Any, param: str) -> int:
        return as_int(value, param, minimum, maximum)

    return read


def _int_at_least(minimum: int) -> Callable[[Any, str], int]:
    def read(value: Any, param: str) -> int:
        return as_int(value, param, minimum)

    return read
