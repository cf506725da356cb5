"""Gateway direction: OpenAI request JSON -> wire TaskRequest, and the 400s for what cannot be honoured."""

import base64
import json

import pytest

from protocol.openai.errors import InvalidRequestError
from protocol.openai.requests import (
    parse_audio_transcription,
    parse_chat_completion,
    parse_completion,
    parse_embedding,
    parse_model_response,
    parse_tokenize,
)


def body(**fields):
    return json.dumps(fields).encode()


def chat(**fields):
    fields.setdefault("model", "m")
    fields.setdefault("messages", [{"role": "user", "content": "hi"}])
    return parse_chat_completion(body(**fields))


def b64json(text):
    return json.loads(base64.urlsafe_b64decode(text))


def rejects(func, raw, param=None):
    with pytest.raises(InvalidRequestError) as info:
        func(raw)
    err = info.value
    assert err.status == 400
    payload = json.loads(err.to_json())
    assert payload["error"]["type"] == "invalid_request_error"
    assert payload["error"]["message"]
    if param is not None:
        assert payload["error"]["param"] == param
    return err


def test_string_content_becomes_one_text_part_and_model_stream_flags_are_reported():
    parsed = chat(stream=True, stream_options={"include_usage": True})
    req = parsed.request.chat_completion
    assert parsed.model == "m" and parsed.stream and parsed.include_usage
    assert [(p.type, p.text) for p in req.messages[0].content] == [("text", "hi")]
    assert req.stream_options.include_usage


def test_tool_parameters_schema_and_template_kwargs_travel_base64url_json():
    params = {"type": "object", "properties": {"x": {"type": "string"}}}
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    req = chat(
        tools=[{"type": "function", "function": {"name": "f", "description": "d", "parameters": params}}],
        response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": schema, "strict": True}},
        chat_template_kwargs={"enable_thinking": False},
    ).request.chat_completion
    assert b64json(req.tools[0].function.encoded_parameters) == params
    assert req.tools[0].function.description == "d"
    assert b64json(req.response_format.json_schema.encoded_schema) == schema
    assert req.response_format.json_schema.strict
    assert b64json(req.encoded_chat_template_kwargs) == {"enable_thinking": False}


def test_encoding_matches_go_base64_url_encoding_with_padding():
    req = chat(tools=[{"type": "function", "function": {"name": "f", "parameters": {"a": "??>"}}}])
    encoded = req.request.chat_completion.tools[0].function.encoded_parameters
    # Go: base64.URLEncoding.EncodeToString([]byte(`{"a":"??>"}`))
    assert encoded == "eyJhIjoiPz8-In0="


def test_tool_choice_string_and_object_forms_go_to_their_own_fields():
    assert chat(tool_choice="required").request.chat_completion.tool_choice == "required"
    req = chat(tool_choice={"type": "function", "function": {"name": "f"}}).request.chat_completion
    assert req.tool_choice == "" and req.tool_choice_object.function.name == "f"
    rejects(parse_chat_completion, body(model="m", messages=[{"role": "user", "content": "x"}], tool_choice="maybe"),
            "tool_choice")


def test_explicit_zero_temperature_and_top_p_are_marked_set():
    req = chat(temperature=0, top_p=0).request.chat_completion
    assert req.is_temperature_set and req.temperature == 0.0
    assert req.is_top_p_set and req.top_p == 0.0
    unset = chat().request.chat_completion
    assert not unset.is_temperature_set and not unset.is_top_p_set


def test_null_means_not_set():
    req = chat(temperature=None, max_tokens=None, stop=None, tools=None).request.chat_completion
    assert not req.is_temperature_set and req.max_tokens == 0 and not req.stop


def test_multimodal_parts_tool_calls_and_tool_messages():
    messages = [
        {"role": "user", "content": [
            {"type": "text", "text": "look"},
            {"type": "image_url", "image_url": {"url": "data:x", "detail": "low"}},
            {"type": "input_audio", "input_audio": {"data": "AAA", "format": "wav"}},
            {"type": "audio_url", "audio_url": {"url": "http://a"}},
        ]},
        {"role": "assistant", "content": None,
         "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "42", "name": "f"},
    ]
    req = chat(messages=messages).request.chat_completion
    parts = req.messages[0].content
    assert [p.type for p in parts] == ["text", "image_url", "input_audio", "audio_url"]
    assert parts[1].image_url.detail == "low" and parts[2].input_audio.format == "wav"
    assert len(req.messages[1].content) == 0
    assert req.messages[1].tool_calls[0].function.arguments == "{}"
    assert req.messages[2].tool_call_id == "c1" and req.messages[2].name == "f"


@pytest.mark.parametrize("raw, param", [
    (b"{", None),
    (b"[1, 2]", None),
    (b'"text"', None),
    (b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "temperature": NaN}', None),
    (b"\xff\xfe", None),
    (b"[" * 100000 + b"]" * 100000, None),
    (body(messages=[{"role": "user", "content": "x"}]), "model"),
    (body(model="", messages=[{"role": "user", "content": "x"}]), "model"),
    (body(model="m"), "messages"),
    (body(model="m", messages=[]), "messages"),
    (body(model="m", messages="hi"), "messages"),
    (body(model="m", messages=[{"content": "x"}]), "messages[0].role"),
    (body(model="m", messages=[{"role": "user", "content": [{"type": "video", "v": 1}]}]),
     "messages[0].content[0].type"),
    (body(model="m", messages=[{"role": "user", "content": 5}]), "messages[0].content"),
    (body(model="m", messages=[{"role": "user", "content": "x"}], temperature="hot"), "temperature"),
    (body(model="m", messages=[{"role": "user", "content": "x"}], temperature=2.5), "temperature"),
    (body(model="m", messages=[{"role": "user", "content": "x"}], top_p=1.5), "top_p"),
    (body(model="m", messages=[{"role": "user", "content": "x"}], n=0), "n"),
    (body(model="m", messages=[{"role": "user", "content": "x"}], n=1.5), "n"),
    (body(model="m", messages=[{"role": "user", "content": "x"}], n=129), "n"),
    (body(model="m", messages=[{"role": "user", "content": "x"}], n=True), "n"),
    (body(model="m", messages=[{"role": "user", "content": "x"}], seed=2**40), "seed"),
    (body(model="m", messages=[{"role": "user", "content": "x"}], max_tokens=0), "max_tokens"),
    (body(model="m", messages=[{"role": "user", "content": "x"}], presence_penalty=3), "presence_penalty"),
    (body(model="m", messages=[{"role": "user", "content": "x"}], logit_bias={"1": 200}), "logit_bias.1"),
    (body(model="m", messages=[{"role": "user", "content": "x"}], stream_options={"include_usage": True}),
     "stream_options"),
    (body(model="m", messages=[{"role": "user", "content": "x"}], response_format={"type": "xml"}),
     "response_format.type"),
    (body(model="m", messages=[{"role": "user", "content": "x"}], chat_template_kwargs=[1]), "chat_template_kwargs"),
    (b'{"model": "m\\ud800", "messages": [{"role": "user", "content": "x"}]}', "model"),
])
def test_bad_chat_requests_are_400_with_the_offending_param(raw, param):
    rejects(parse_chat_completion, raw, param)


def test_unknown_fields_are_ignored():
    assert chat(frobnicate={"x": 1}, parallel_tool_calls=False).model == "m"


def test_legacy_completion_prompt_becomes_the_user_message_with_the_legacy_default_max_tokens():
    parsed = parse_completion(body(model="m", prompt=["say this"], stop="\n", temperature=0.5, seed=7,
                                   stream=True, stream_options={"include_usage": True}, echo=False, best_of=1))
    req = parsed.request.chat_completion
    assert [(m.role, m.content[0].text) for m in req.messages] == [("user", "say this")]
    assert req.max_tokens == 16 and list(req.stop) == ["\n"] and req.seed == 7
    assert req.is_temperature_set and parsed.stream and parsed.include_usage
    assert parse_completion(body(model="m", prompt="", max_tokens=5)).request.chat_completion.max_tokens == 5


@pytest.mark.parametrize("fields, param", [
    ({"prompt": [1, 2, 3]}, "prompt"),
    ({"prompt": [[1, 2]]}, "prompt"),
    ({"prompt": ["a", "b"]}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({}, "prompt"),
    ({"prompt": "x", "echo": True}, "echo"),
    ({"prompt": "x", "suffix": "end"}, "suffix"),
    ({"prompt": "x", "best_of": 2}, "best_of"),
    ({"prompt": "x", "logprobs": 1}, "logprobs"),
])
def test_legacy_completion_rejects_what_a_chat_completion_cannot_honour(fields, param):
    rejects(parse_completion, body(model="m", **fields), param)


def test_embedding_string_input_stays_plain_and_arrays_are_encoded():
    plain = parse_embedding(body(model="e", input="hello", dimensions=8, encoding_format="base64"))
    assert plain.request.embedding.input == "hello" and plain.request.embedding.dimensions == 8
    for value in (["a", "b"], [1, 2, 3], [[1, 2], [3]]):
        req = parse_embedding(body(model="e", input=value)).request.embedding
        assert req.input == "" and b64json(req.encoded_input) == value


@pytest.mark.parametrize("fields, param", [
    ({"input": ""}, "input"), ({"input": []}, "input"), ({"input": ["a", 1]}, "input[1]"),
    ({"input": [[1], []]}, "input[1]"), ({"input": {"a": 1}}, "input"), ({}, "input"),
    ({"input": "x", "encoding_format": "hex"}, "encoding_format"), ({"input": "x", "dimensions": 0}, "dimensions"),
])
def test_bad_embedding_requests_are_400(fields, param):
    rejects(parse_embedding, body(model="e", **fields), param)


def test_responses_request_encodes_input_tools_tool_choice_tools_and_text_schema():
    items = [{"role": "user", "content": [{"type": "input_text", "text": "hi"}]}]
    tools = [{"type": "function", "name": "f", "parameters": {"type": "object"}}]
    parsed = parse_model_response(body(
        model="m", input=items, tools=tools, stream=True, temperature=0, truncation="auto",
        tool_choice={"type": "allowed_tools", "mode": "auto", "tools": [{"type": "function", "name": "f"}]},
        text={"format": {"type": "json_schema", "name": "s", "schema": {"type": "object"}, "strict": True}},
        metadata={"k": "v"}, include=["reasoning.encrypted_content"], reasoning={"effort": "low"},
    ))
    req = parsed.request.model_response
    assert parsed.stream and b64json(req.encoded_input) == items and b64json(req.encoded_tools) == tools
    assert req.tool_choice_object.mode == "auto"
    assert b64json(req.tool_choice_object.encoded_tools) == [{"type": "function", "name": "f"}]
    assert b64json(req.text.format.encoded_schema) == {"type": "object"}
    assert req.is_temperature_set and req.truncation and req.metadata["k"] == "v"
    assert parse_model_response(body(model="m", input="hi")).request.model_response.input == "hi"


@pytest.mark.parametrize("fields, param", [
    ({}, "input"), ({"input": ""}, "input"), ({"input": []}, "input"), ({"input": [1]}, "input[0]"),
    ({"input": "x", "truncation": "maybe"}, "truncation"), ({"input": "x", "metadata": {"k": 1}}, "metadata.k"),
    ({"input": "x", "tool_choice": "sometimes"}, "tool_choice"),
])
def test_bad_responses_requests_are_400(fields, param):
    rejects(parse_model_response, body(model="m", **fields), param)


def test_audio_transcription_form_fields_are_validated_and_carried():
    parsed = parse_audio_transcription(
        {"model": "w", "language": "en", "prompt": "p", "response_format": "text", "temperature": "0.2"},
        b"RIFF", "a.wav",
    )
    req = parsed.request.audio_transcription
    assert (req.model, req.file, req.filename, req.language, req.response_format) == ("w", b"RIFF", "a.wav", "en", "text")
    assert req.temperature == pytest.approx(0.2) and not parsed.stream
    assert parse_audio_transcription({"model": "w", "stream": "true"}, b"x", "a.wav").stream


@pytest.mark.parametrize("fields, file, param", [
    ({}, b"x", "model"), ({"model": "w"}, None, "file"), ({"model": "w"}, b"", "file"),
    ({"model": "w", "temperature": "warm"}, b"x", "temperature"),
    ({"model": "w", "temperature": "1.5"}, b"x", "temperature"),
    ({"model": "w", "temperature": "nan"}, b"x", "temperature"),
    ({"model": "w", "response_format": "mp3"}, b"x", "response_format"),
    ({"model": "w", "stream": "yes"}, b"x", "stream"),
])
def test_bad_audio_forms_are_400(fields, file, param):
    rejects(lambda _: parse_audio_transcription(fields, file, "a.wav"), None, param)


def test_tokenize_takes_a_prompt_or_messages():
    assert parse_tokenize(body(model="m", prompt="a b")).request.tokenize_request.prompt == "a b"
    req = parse_tokenize(body(model="m", messages=[{"role": "user", "content": "x"}])).request.tokenize_request
    assert req.messages[0].content[0].text == "x"
    rejects(parse_tokenize, body(model="m"), "prompt")
