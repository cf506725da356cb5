"""Engine direction: a typed ``TaskRequest`` -> the OpenAI request a runtime takes; pure, no I/O.

infx's agent uses this only for a task without the client's verbatim request
(``TaskRequest.http_request``, sent by infx's gateway to engines that announce
the ``http-request`` capability, which the agent runs as it is); that is, a
task from a gateway that only speaks LLMariner's typed protocol.

Rules this file keeps: the exact reverse of :mod:`protocol.openai.requests`.
A field is emitted only when the wire carries a non-zero value (proto3 has no
"unset"), except ``temperature``/``top_p``, which follow ``is_*_set`` so that
an explicit 0 reaches the runtime instead of its default of 1. A chat
request's ``max_completion_tokens`` is also sent as ``max_tokens`` when that
is unset, because Ollama reads only ``max_tokens`` (as LLMariner does). ``encoded_*``
fields are decoded back into JSON. A corrupt encoded field raises
:class:`~protocol.openai.errors.InvalidRequestError` (the engine answers
400); handing over a task that is not a runtime request (heartbeat, go-away,
cancel) raises :class:`~protocol.openai.errors.OpenAIUsageError`.

Message content: a single text part becomes a plain string again, and
anything else stays an array of parts. vLLM, Ollama, SGLang and llama.cpp
all accept arrays, but some chat templates and older servers (NIM,
llama.cpp before multimodal support) accept only strings, and a lone text
part means exactly its string, so this is the most widely accepted form.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from protocol.openai.errors import OpenAIUsageError
from protocol.openai.json import JSONObject, decode_json_field
from protocol.pb import (
    audio_pb2,
    chat_pb2,
    embeddings_pb2,
    model_response_pb2,
    tokenize_pb2,
    worker_pb2,
)

CHAT_COMPLETIONS_PATH = "/v1/chat/completions"
EMBEDDINGS_PATH = "/v1/embeddings"
AUDIO_TRANSCRIPTIONS_PATH = "/v1/audio/transcriptions"
RESPONSES_PATH = "/v1/responses"
TOKENIZE_PATH = "/tokenize"


@dataclass(frozen=True)
class MultipartForm:
    """A multipart/form-data body to build: text fields in order, then the file part."""

    fields: tuple[tuple[str, str], ...]
    filename: str
    file: bytes
    file_field: str = "file"

    def encode(self, boundary: str) -> tuple[str, bytes]:
        """``(content_type, body)`` per RFC 7578, names escaped as the HTML form algorithm does.

        The caller picks the boundary (randomness is its business); one that
        occurs in the content is refused.
        """
        marker = b"--" + boundary.encode("ascii")
        pieces: list[bytes] = []
        for name, value in self.fields:
            pieces += [
                marker,
                b"\r\nContent-Disposition: form-data; name=\"" + _escape(name) + b"\"\r\n\r\n",
                value.encode("utf-8"),
                b"\r\n",
            ]
        pieces += [
            marker,
            b"\r\nContent-Disposition: form-data; name=\"" + _escape(self.file_field)
            + b"\"; filename=\"" + _escape(self.filename) + b"\"\r\n"
            b"Content-Type: application/octet-stream\r\n\r\n",
            self.file,
            b"\r\n",
            marker,
            b"--\r\n",
        ]
        if any(marker in piece for piece in (self.file, *(v.encode("utf-8") for _, v in self.fields))):
            raise OpenAIUsageError("the multipart boundary occurs in the form's content; pick another")
        return f"multipart/form-data; boundary={boundary}", b"".join(pieces)


def _escape(name: str) -> bytes:
    return name.replace("\n", "%0A").replace("\r", "%0D").replace('"', "%22").encode("utf-8")


@dataclass(frozen=True)
class RuntimeRequest:
    """What to POST to the runtime: ``path`` with either ``json`` or ``form`` as the body."""

    path: str
    model: str
    stream: bool
    json: JSONObject | None = None
    form: MultipartForm | None = field(default=None)


def runtime_request(request: worker_pb2.TaskRequest) -> RuntimeRequest:
    """The runtime request for a task's request, whichever kind it is."""
    kind = request.WhichOneof("request")
    if kind == "chat_completion":
        chat = request.chat_completion
        return RuntimeRequest(CHAT_COMPLETIONS_PATH, chat.model, chat.stream, json=chat_completion_json(chat))
    if kind == "embedding":
        emb = request.embedding
        return RuntimeRequest(EMBEDDINGS_PATH, emb.model, False, json=embedding_json(emb))
    if kind == "model_response":
        resp = request.model_response
        return RuntimeRequest(RESPONSES_PATH, resp.model, resp.stream, json=model_response_json(resp))
    if kind == "tokenize_request":
        tok = request.tokenize_request
        return RuntimeRequest(TOKENIZE_PATH, tok.model, False, json=tokenize_json(tok))
    if kind == "audio_transcription":
        audio = request.audio_transcription
        return RuntimeRequest(
            AUDIO_TRANSCRIPTIONS_PATH, audio.model, audio.stream, form=audio_transcription_form(audio)
        )
    raise OpenAIUsageError(f"a {kind or 'empty'} task request is not for the runtime")


# -- chat -----------------------------------------------------------------------


def chat_completion_json(req: chat_pb2.CreateChatCompletionRequest) -> JSONObject:
    """The OpenAI chat completion request a wire request stands for."""
    out: JSONObject = {"model": req.model, "messages": [message_json(m) for m in req.messages]}
    _put_nonzero(out, req, "frequency_penalty", "presence_penalty", "logprobs", "top_logprobs",
                 "max_tokens", "max_completion_tokens", "n", "seed", "user")
    if req.max_completion_tokens and not req.max_tokens:
        out["max_tokens"] = req.max_completion_tokens  # Ollama reads only max_tokens
    if req.logit_bias:
        out["logit_bias"] = dict(req.logit_bias)
    if req.is_temperature_set or req.temperature:
        out["temperature"] = req.temperature
    if req.is_top_p_set or req.top_p:
        out["top_p"] = req.top_p
    if req.stop:
        out["stop"] = list(req.stop)
    if req.stream:
        out["stream"] = True
        if req.HasField("stream_options"):
            out["stream_options"] = {"include_usage": req.stream_options.include_usage}
    if req.HasField("response_format") and req.response_format.type:
        out["response_format"] = _response_format_json(req.response_format)
    if req.tools:
        out["tools"] = [_tool_json(t, i) for i, t in enumerate(req.tools)]
    if req.HasField("tool_choice_object"):
        out["tool_choice"] = {
            "type": req.tool_choice_object.type or "function",
            "function": {"name": req.tool_choice_object.function.name},
        }
    elif req.tool_choice:
        out["tool_choice"] = req.tool_choice
    if req.encoded_chat_template_kwargs:
        out["chat_template_kwargs"] = decode_json_field(req.encoded_chat_template_kwargs, "chat_template_kwargs")
    return out


def message_json(msg: chat_pb2.ChatCompletionMessage) -> JSONObject:
    """One chat message; see the module docstring for the content form."""
    out: JSONObject = {"role": msg.role}
    parts = list(msg.content)
    if len(parts) == 1 and parts[0].type == "text":
        out["content"] = parts[0].text
    elif parts:
        out["content"] = [_part_json(p) for p in parts]
    if msg.name:
        out["name"] = msg.name
    if msg.tool_calls:
        out["tool_calls"] = [
            {
                "id": call.id,
                "type": call.type or "function",
                "function": {"name": call.function.name, "arguments": call.function.arguments},
            }
            for call in msg.tool_calls
        ]
    if msg.tool_call_id:
        out["tool_call_id"] = msg.tool_call_id
    return out


def _part_json(part: chat_pb2.ChatCompletionMessage.Content) -> JSONObject:
    out: JSONObject = {"type": part.type}
    if part.type == "text" or part.text:
        out["text"] = part.text
    if part.HasField("image_url"):
        image: JSONObject = {"url": part.image_url.url}
        if part.image_url.detail:
            image["detail"] = part.image_url.detail
        out["image_url"] = image
    if part.HasField("input_audio"):
        out["input_audio"] = {"data": part.input_audio.data, "format": part.input_audio.format}
    if part.HasField("audio_url"):
        out["audio_url"] = {"url": part.audio_url.url}
    return out


def _response_format_json(fmt: chat_pb2.CreateChatCompletionRequest.ResponseFormat) -> JSONObject:
    out: JSONObject = {"type": fmt.type}
    if fmt.HasField("json_schema"):
        js = fmt.json_schema
        schema: JSONObject = {"name": js.name}
        if js.description:
            schema["description"] = js.description
        if js.encoded_schema:
            schema["schema"] = decode_json_field(js.encoded_schema, "response_format.json_schema.schema")
        if js.strict:
            schema["strict"] = True
        out["json_schema"] = schema
    return out


def _tool_json(tool: chat_pb2.CreateChatCompletionRequest.Tool, index: int) -> JSONObject:
    function: JSONObject = {"name": tool.function.name}
    if tool.function.description:
        function["description"] = tool.function.description
    if tool.function.encoded_parameters:
        function["parameters"] = decode_json_field(
            tool.function.encoded_parameters, f"tools[{index}].function.parameters"
        )
    return {"type": tool.type or "function", "function": function}


# -- embeddings, tokenize, audio ------------------------------------------------------


def embedding_json(req: embeddings_pb2.CreateEmbeddingRequest) -> JSONObject:
    """The OpenAI embeddings request; ``encoded_input`` becomes the JSON array it holds."""
    out: JSONObject = {"model": req.model}
    out["input"] = decode_json_field(req.encoded_input, "input") if req.encoded_input else req.input
    _put_nonzero(out, req, "encoding_format", "dimensions", "user")
    return out


def tokenize_json(req: tokenize_pb2.TokenizeRequest) -> JSONObject:
    """vLLM's tokenize request: ``prompt`` or chat ``messages``."""
    out: JSONObject = {"model": req.model}
    if req.prompt:
        out["prompt"] = req.prompt
    if req.messages:
        out["messages"] = [message_json(m) for m in req.messages]
    return out


def audio_transcription_form(req: audio_pb2.CreateAudioTranscriptionRequest) -> MultipartForm:
    """The multipart form OpenAI's transcription endpoint takes."""
    fields: list[tuple[str, str]] = [("model", req.model)]
    for key in ("language", "prompt", "response_format"):
        value = getattr(req, key)
        if value:
            fields.append((key, value))
    if req.temperature:
        fields.append(("temperature", repr(req.temperature)))
    if req.stream:
        fields.append(("stream", "true"))
    return MultipartForm(fields=tuple(fields), filename=req.filename, file=req.file)


# -- responses ----------------------------------------------------------------------


def model_response_json(req: model_response_pb2.CreateModelResponseRequest) -> JSONObject:
    """The OpenAI Responses API request, with every ``encoded_*`` field decoded."""
    out: JSONObject = {"model": req.model}
    if req.encoded_input:
        out["input"] = decode_json_field(req.encoded_input, "input")
    elif req.input:
        out["input"] = req.input
    _put_nonzero(out, req, "background", "instructions", "max_output_tokens", "max_tool_calls",
                 "parallel_tool_calls", "previous_response_id", "prompt_cache_key", "safety_identifier",
                 "service_tier", "store", "top_logprobs", "user")
    if req.include:
        out["include"] = list(req.include)
    if req.metadata:
        out["metadata"] = dict(req.metadata)
    if req.is_temperature_set or req.temperature:
        out["temperature"] = req.temperature
    if req.is_top_p_set or req.top_p:
        out["top_p"] = req.top_p
    if req.truncation:
        out["truncation"] = "auto"
    if req.stream:
        out["stream"] = True
        if req.HasField("stream_options"):
            out["stream_options"] = {"include_obfuscation": req.stream_options.include_obfuscation}
    if req.HasField("prompt"):
        prompt: JSONObject = {"id": req.prompt.id}
        if req.prompt.version:
            prompt["version"] = req.prompt.version
        out["prompt"] = prompt
    if req.HasField("reasoning"):
        out["reasoning"] = {
            key: getattr(req.reasoning, key)
            for key in ("effort", "generate_summary", "summary")
            if getattr(req.reasoning, key)
        }
    if req.HasField("text"):
        out["text"] = _text_json(req.text)
    if req.encoded_tools:
        out["tools"] = decode_json_field(req.encoded_tools, "tools")
    if req.HasField("tool_choice_object"):
        out["tool_choice"] = _tool_choice_json(req.tool_choice_object)
    elif req.tool_choice:
        out["tool_choice"] = req.tool_choice
    return out


def _text_json(text: model_response_pb2.CreateModelResponseRequest.Text) -> JSONObject:
    out: JSONObject = {}
    if text.verbosity:
        out["verbosity"] = text.verbosity
    if text.HasField("format"):
        fmt = text.format
        fmt_out: JSONObject = {"type": fmt.type}
        _put_nonzero(fmt_out, fmt, "name", "description", "strict")
        if fmt.encoded_schema:
            fmt_out["schema"] = decode_json_field(fmt.encoded_schema, "text.format.schema")
        out["format"] = fmt_out
    return out


def _tool_choice_json(choice: model_response_pb2.CreateModelResponseRequest.ToolChoice) -> JSONObject:
    out: JSONObject = {"type": choice.type}
    _put_nonzero(out, choice, "name", "mode", "server_label")
    if choice.encoded_tools:
        out["tools"] = decode_json_field(choice.encoded_tools, "tool_choice.tools")
    return out


def _put_nonzero(out: JSONObject, message: Any, *names: str) -> None:
    for name in names:
        value = getattr(message, name)
        if value:
            out[name] = value
