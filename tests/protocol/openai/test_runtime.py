"""Engine direction: wire TaskRequest -> the OpenAI request the runtime takes."""

import base64
import email.parser
import email.policy
import json

import pytest

from protocol.openai.errors import InvalidRequestError, OpenAIUsageError
from protocol.openai.requests import parse_audio_transcription
from protocol.openai.runtime import MultipartForm, runtime_request
from protocol.pb import chat_pb2, embeddings_pb2, worker_pb2


def chat_request(**fields):
    req = chat_pb2.CreateChatCompletionRequest(model="m", **fields)
    req.messages.add(role="user").content.add(type="text", text="hi")
    return req


def to_json(req):
    return runtime_request(worker_pb2.TaskRequest(chat_completion=req)).json


def test_temperature_and_top_p_follow_is_set_so_an_explicit_zero_reaches_the_runtime():
    assert to_json(chat_request(is_temperature_set=True, is_top_p_set=True))["temperature"] == 0.0
    assert to_json(chat_request(is_temperature_set=True, is_top_p_set=True))["top_p"] == 0.0
    unset = to_json(chat_request())
    assert "temperature" not in unset and "top_p" not in unset
    # A gateway that forgot is_*_set still gets its non-zero value through.
    assert to_json(chat_request(temperature=0.7))["temperature"] == 0.7


def test_encoded_fields_from_an_llmariner_gateway_are_decoded():
    go_urlencoded = "eyJhIjoiPz8-In0="  # Go base64.URLEncoding of {"a":"??>"}
    req = chat_request(encoded_chat_template_kwargs=go_urlencoded)
    req.tools.add(type="function").function.CopyFrom(
        chat_pb2.CreateChatCompletionRequest.Tool.Function(name="f", encoded_parameters=go_urlencoded))
    req.response_format.type = "json_schema"
    req.response_format.json_schema.name = "s"
    req.response_format.json_schema.encoded_schema = go_urlencoded
    out = to_json(req)
    assert out["chat_template_kwargs"] == {"a": "??>"}
    assert out["tools"] == [{"type": "function", "function": {"name": "f", "parameters": {"a": "??>"}}}]
    assert out["response_format"] == {"type": "json_schema", "json_schema": {"name": "s", "schema": {"a": "??>"}}}


@pytest.mark.parametrize("encoded", [
    "eyJhIjoiPz8+In0=",  # standard alphabet
    "eyJhIjoiPz8-In0",   # padding dropped
    '{"a":"??>"}',       # plain JSON text
])
def test_encoded_fields_are_read_leniently(encoded):
    assert to_json(chat_request(encoded_chat_template_kwargs=encoded))["chat_template_kwargs"] == {"a": "??>"}


@pytest.mark.parametrize("encoded", ["!!!", base64.urlsafe_b64encode(b"{nope").decode(), "e30=e30="])
def test_a_corrupt_encoded_field_is_a_400_naming_the_field(encoded):
    with pytest.raises(InvalidRequestError) as info:
        to_json(chat_request(encoded_chat_template_kwargs=encoded))
    assert info.value.param == "chat_template_kwargs"


def test_a_single_text_part_becomes_a_string_and_other_content_stays_an_array():
    req = chat_pb2.CreateChatCompletionRequest(model="m")
    req.messages.add(role="user").content.add(type="text", text="one")
    two = req.messages.add(role="user")
    two.content.add(type="text", text="a")
    two.content.add(type="image_url").image_url.url = "u"
    req.messages.add(role="assistant").tool_calls.add(id="c", type="function").function.name = "f"
    out = to_json(req)["messages"]
    assert out[0] == {"role": "user", "content": "one"}
    assert out[1]["content"] == [{"type": "text", "text": "a"}, {"type": "image_url", "image_url": {"url": "u"}}]
    assert out[2] == {"role": "assistant",
                      "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": ""}}]}


def test_stream_options_are_only_sent_with_stream():
    req = chat_request(stream=False)
    req.stream_options.include_usage = True
    assert "stream_options" not in to_json(req)
    req.stream = True
    assert to_json(req)["stream_options"] == {"include_usage": True}


def test_embedding_encoded_input_becomes_the_array_again_and_json_text_is_accepted():
    for encoded in (base64.urlsafe_b64encode(b'["a","b"]').decode(), '["a","b"]'):
        req = embeddings_pb2.CreateEmbeddingRequest(model="e", encoded_input=encoded)
        assert runtime_request(worker_pb2.TaskRequest(embedding=req)).json == {"model": "e", "input": ["a", "b"]}


@pytest.mark.parametrize("kind", ["heartbeat", "go_away", "cancel_task"])
def test_agent_business_is_not_a_runtime_request(kind):
    request = worker_pb2.TaskRequest()
    getattr(request, kind).SetInParent()
    with pytest.raises(OpenAIUsageError):
        runtime_request(request)
    with pytest.raises(OpenAIUsageError):
        runtime_request(worker_pb2.TaskRequest())


def parse_multipart(content_type, body):
    message = email.parser.BytesParser(policy=email.policy.HTTP).parsebytes(
        b"Content-Type: " + content_type.encode() + b"\r\n\r\n" + body)
    return [(part.get_param("name", header="content-disposition"), part.get_filename(),
             part.get_payload(decode=True)) for part in message.iter_parts()]


def test_audio_transcription_becomes_a_multipart_form_a_standard_parser_reads():
    parsed = parse_audio_transcription(
        {"model": "w", "language": "en", "temperature": "0.25", "stream": "true"}, b"\x00RIFF\r\n--x", 'a "b".wav')
    runtime = runtime_request(parsed.request)
    assert runtime.path == "/v1/audio/transcriptions" and runtime.json is None and runtime.stream
    content_type, body = runtime.form.encode("bOuNdArY")
    assert content_type == "multipart/form-data; boundary=bOuNdArY"
    assert parse_multipart(content_type, body) == [
        ("model", None, b"w"), ("language", None, b"en"), ("temperature", None, b"0.25"),
        ("stream", None, b"true"), ("file", "a %22b%22.wav", b"\x00RIFF\r\n--x"),
    ]


def test_a_boundary_that_occurs_in_the_content_is_refused():
    form = MultipartForm(fields=(("model", "w"),), filename="a.wav", file=b"...--abc...")
    with pytest.raises(OpenAIUsageError):
        form.encode("abc")


def test_runtime_request_json_is_serialisable_as_sent():
    out = to_json(chat_request(stop=["\n"], n=2, seed=5, logprobs=True, top_logprobs=3))
    assert json.loads(json.dumps(out)) == out
    assert (out["stop"], out["n"], out["seed"], out["logprobs"], out["top_logprobs"]) == (["\n"], 2, 5, True, 3)


def test_max_completion_tokens_is_mirrored_into_max_tokens_for_runtimes_that_read_only_that():
    assert to_json(chat_request(max_completion_tokens=9))["max_tokens"] == 9
    assert to_json(chat_request(max_completion_tokens=9, max_tokens=4))["max_tokens"] == 4
