"""Open-ended input: any JSON (or any bytes) ends in a request or a 400, never another exception;
and whatever the gateway accepts, the engine side turns back into the same OpenAI request."""

import json

from hypothesis import given, settings, strategies as st

from protocol.openai.errors import InvalidRequestError
from protocol.openai.requests import (
    parse_audio_transcription,
    parse_chat_completion,
    parse_completion,
    parse_embedding,
    parse_model_response,
    parse_tokenize,
)
from protocol.openai.runtime import runtime_request

SETTINGS = settings(max_examples=150, deadline=None)
PARSERS = [parse_chat_completion, parse_completion, parse_embedding, parse_model_response, parse_tokenize]
KEYS = [
    "model", "messages", "role", "content", "type", "text", "image_url", "url", "detail", "input_audio", "data",
    "format", "audio_url", "name", "tool_calls", "id", "function", "arguments", "tool_call_id", "temperature",
    "top_p", "n", "max_tokens", "max_completion_tokens", "seed", "stop", "stream", "stream_options",
    "include_usage", "logit_bias", "logprobs", "top_logprobs", "frequency_penalty", "presence_penalty", "user",
    "tools", "parameters", "description", "tool_choice", "response_format", "json_schema", "schema", "strict",
    "chat_template_kwargs", "prompt", "echo", "suffix", "best_of", "input", "dimensions", "encoding_format",
    "text", "truncation", "metadata", "include", "reasoning", "effort", "mode", "version", "background",
]

scalars = (
    st.none() | st.booleans() | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=20)
    | st.sampled_from(["user", "text", "function", "auto", "json_schema", "image_url", "m", "true",
                       "lone \ud800 surrogate"])
)
json_values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
        st.sampled_from(KEYS) | st.text(max_size=5) | st.just("\udc80"), inner, max_size=6),
    max_leaves=30,
)


def accepted_or_400(parser, raw):
    try:
        parsed = parser(raw)
    except InvalidRequestError as err:
        assert err.status == 400
        json.loads(err.to_json())
        return None
    parsed.request.SerializeToString()
    # Whatever the gateway accepts, the engine can turn into a runtime request.
    runtime = runtime_request(parsed.request)
    json.dumps(runtime.json)
    return parsed


@SETTINGS
@given(st.dictionaries(st.sampled_from(KEYS), json_values, max_size=10))
def test_any_json_object_ends_in_a_request_or_a_400(obj):
    raw = json.dumps(obj).encode()
    for parser in PARSERS:
        accepted_or_400(parser, raw)


@SETTINGS
@given(json_values)
def test_any_json_value_ends_in_a_request_or_a_400(value):
    raw = json.dumps(value).encode()
    for parser in PARSERS:
        accepted_or_400(parser, raw)


@SETTINGS
@given(st.binary(max_size=200))
def test_any_bytes_end_in_a_request_or_a_400(raw):
    for parser in PARSERS:
        accepted_or_400(parser, raw)


VALID_CHAT = {
    "model": "m",
    "messages": [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "image_url", "image_url": {"url": "u"}}]},
        {"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
    ],
    "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
    "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": {}}},
    "stream": True, "stream_options": {"include_usage": True}, "temperature": 1, "stop": ["x"],
}


def paths(value, prefix=()):
    yield prefix
    if isinstance(value, dict):
        for key, item in value.items():
            yield from paths(item, prefix + (key,))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from paths(item, prefix + (index,))


ALL_PATHS = [p for p in paths(VALID_CHAT) if p]


@SETTINGS
@given(st.sampled_from(ALL_PATHS), json_values)
def test_a_valid_request_with_any_one_value_replaced_ends_in_a_request_or_a_400(path, replacement):
    obj = json.loads(json.dumps(VALID_CHAT))
    target = obj
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = replacement
    raw = json.dumps(obj).encode()
    accepted_or_400(parse_chat_completion, raw)
    accepted_or_400(parse_tokenize, raw)


@SETTINGS
@given(st.dictionaries(st.sampled_from(["model", "prompt", "language", "response_format", "temperature", "stream"]),
                       st.text(max_size=10) | st.binary(max_size=5) | st.none()),
       st.none() | st.binary(max_size=10), st.text(max_size=10) | st.none())
def test_any_audio_form_ends_in_a_request_or_a_400(fields, file, filename):
    accepted_or_400(lambda _: parse_audio_transcription(fields, file, filename), None)


# -- round trips over generated valid requests ---------------------------------------

words = st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]), max_size=12)
nonempty = words.filter(bool)
json_objects = st.dictionaries(st.text(max_size=5), st.recursive(
    st.none() | st.booleans() | st.integers(-1000, 1000) | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=8), max_size=4)

text_part = st.builds(lambda t: {"type": "text", "text": t}, words)
image_part = st.builds(lambda u, d: {"type": "image_url", "image_url": {"url": u, **({"detail": d} if d else {})}},
                       nonempty, st.sampled_from([None, "auto", "low", "high"]))
audio_part = st.builds(lambda d, f: {"type": "input_audio", "input_audio": {"data": d, "format": f}}, words, words)
content = words | st.lists(text_part | image_part | audio_part, min_size=1, max_size=3)
tool_call = st.builds(lambda i, n, a: {"id": i, "type": "function", "function": {"name": n, "arguments": a}},
                      words, nonempty, words)
message = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant", "tool", "developer"])},
    optional={"content": content, "name": nonempty, "tool_call_id": nonempty,
              "tool_calls": st.lists(tool_call, min_size=1, max_size=2)},
)
tool = st.builds(
    lambda n, d, p: {"type": "function", "function": {"name": n, **({"description": d} if d else {}),
                                                       **({"parameters": p} if p is not None else {})}},
    nonempty, words, st.none() | json_objects)
response_format = st.sampled_from([{"type": "text"}, {"type": "json_object"}]) | st.builds(
    lambda n, s, strict: {"type": "json_schema", "json_schema": {"name": n, "schema": s, **({"strict": True} if strict else {})}},
    words, json_objects, st.booleans())
chat_requests = st.fixed_dictionaries(
    {"model": nonempty, "messages": st.lists(message, min_size=1, max_size=4)},
    optional={
        "temperature": st.floats(0, 2), "top_p": st.floats(0, 1), "n": st.integers(1, 8),
        "max_tokens": st.integers(1, 2**31 - 1), "max_completion_tokens": st.integers(1, 4096),
        "seed": st.integers(-(2**31), 2**31 - 1).filter(bool), "stop": words | st.lists(words, max_size=3),
        "frequency_penalty": st.floats(-2, 2), "presence_penalty": st.floats(-2, 2),
        "logit_bias": st.dictionaries(st.integers(0, 50000).map(str), st.floats(-100, 100), max_size=3),
        "logprobs": st.booleans(), "top_logprobs": st.integers(0, 20), "user": words,
        "tools": st.lists(tool, max_size=2), "response_format": response_format,
        "tool_choice": st.sampled_from(["none", "auto", "required"]) | st.builds(
            lambda n: {"type": "function", "function": {"name": n}}, nonempty),
        "chat_template_kwargs": json_objects,
        "stream": st.booleans(),
    },
)

ZERO_IS_UNSET = {"frequency_penalty", "presence_penalty", "top_logprobs", "user", "logprobs", "stream"}


def normalize_content(value):
    if isinstance(value, list) and len(value) == 1 and value[0]["type"] == "text":
        return value[0]["text"]
    return value


def normalize_chat(obj):
    """What the wire promises to keep, in one canonical form (proto3 zero = unset)."""
    out = {k: v for k, v in obj.items() if not (k in ZERO_IS_UNSET and not v)}
    out["messages"] = [{**m, "content": normalize_content(m["content"])} if "content" in m else m
                       for m in obj["messages"]]
    if isinstance(out.get("stop"), str):
        out["stop"] = [out["stop"]]
    for key in ("stop", "tools", "logit_bias"):
        if key in out and not out[key]:
            del out[key]
    for key in ("temperature", "top_p", "frequency_penalty", "presence_penalty"):
        if key in out:
            out[key] = float(out[key])
    if "logit_bias" in out:
        out["logit_bias"] = {k: float(v) for k, v in out["logit_bias"].items()}
    if "max_completion_tokens" in out:
        out.setdefault("max_tokens", out["max_completion_tokens"])
    return out


@SETTINGS
@given(chat_requests, st.booleans())
def test_chat_json_to_wire_to_json_keeps_every_meaningful_field(obj, include_usage):
    if obj.get("stream"):
        obj["stream_options"] = {"include_usage": include_usage}
    parsed = parse_chat_completion(json.dumps(obj).encode())
    wire = type(parsed.request).FromString(parsed.request.SerializeToString())
    runtime = runtime_request(wire)
    assert runtime.path == "/v1/chat/completions" and runtime.stream == bool(obj.get("stream"))
    assert runtime.json == normalize_chat(obj)


embedding_inputs = (nonempty | st.lists(nonempty, min_size=1, max_size=3)
                    | st.lists(st.integers(0, 2**31 - 1), min_size=1, max_size=5)
                    | st.lists(st.lists(st.integers(0, 100), min_size=1, max_size=3), min_size=1, max_size=3))


@SETTINGS
@given(st.fixed_dictionaries({"model": nonempty, "input": embedding_inputs},
                             optional={"dimensions": st.integers(1, 4096), "user": nonempty,
                                       "encoding_format": st.sampled_from(["float", "base64"])}))
def test_embedding_json_to_wire_to_json_is_identity(obj):
    parsed = parse_embedding(json.dumps(obj).encode())
    assert runtime_request(parsed.request).json == obj


response_requests = st.fixed_dictionaries(
    {"model": nonempty, "input": nonempty | st.lists(
        st.builds(lambda r, t: {"role": r, "content": [{"type": "input_text", "text": t}]},
                  st.sampled_from(["user", "system"]), words), min_size=1, max_size=3)},
    optional={
        "instructions": nonempty, "max_output_tokens": st.integers(1, 10000), "temperature": st.floats(0, 2),
        "top_p": st.floats(0, 1), "store": st.just(True), "background": st.just(True),
        "parallel_tool_calls": st.just(True), "previous_response_id": nonempty, "top_logprobs": st.integers(1, 20),
        "metadata": st.dictionaries(nonempty, words, max_size=3).filter(bool),
        "include": st.lists(nonempty, min_size=1, max_size=2), "truncation": st.just("auto"),
        "tools": st.lists(st.builds(lambda n, p: {"type": "function", "name": n, "parameters": p},
                                    nonempty, json_objects), max_size=2),
        "tool_choice": st.sampled_from(["none", "auto", "required"]) | st.builds(
            lambda n: {"type": "function", "name": n}, nonempty) | st.builds(
            lambda n: {"type": "allowed_tools", "mode": "auto", "tools": [{"type": "function", "name": n}]}, nonempty),
        "text": st.builds(lambda s, n: {"format": {"type": "json_schema", "name": n, "schema": s, "strict": True}},
                          json_objects, nonempty),
        "reasoning": st.builds(lambda e: {"effort": e}, st.sampled_from(["low", "medium", "high"])),
        "stream": st.just(True), "user": nonempty,
    },
)


@SETTINGS
@given(response_requests)
def test_responses_json_to_wire_to_json_keeps_every_meaningful_field(obj):
    parsed = parse_model_response(json.dumps(obj).encode())
    expected = {k: (float(v) if k in ("temperature", "top_p") else v) for k, v in obj.items()}
    assert runtime_request(parsed.request).json == expected


@SETTINGS
@given(st.fixed_dictionaries({"model": nonempty},
                             optional={"prompt": nonempty, "messages": st.lists(message, min_size=1, max_size=3)}))
def test_tokenize_json_to_wire_to_json_keeps_prompt_and_messages(obj):
    try:
        parsed = parse_tokenize(json.dumps(obj).encode())
    except InvalidRequestError:
        assert "prompt" not in obj and "messages" not in obj
        return
    out = runtime_request(parsed.request).json
    expected = normalize_chat({**obj, "messages": obj.get("messages", [])})
    if not expected["messages"]:
        del expected["messages"]
    assert out == expected
