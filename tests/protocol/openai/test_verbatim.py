"""The gateway keeps the client's request verbatim beside its typed form (protocol.openai.verbatim); pure."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from protocol.openai.errors import InvalidRequestError
from protocol.openai.requests import parse_chat_completion, parse_completion, parse_embedding
from protocol.openai.task_forms import ROUTING_FIELDS_ONLY
from protocol.openai.verbatim import TYPED_BY_PATH, parse_form, parse_json, typed_form_deferred, with_typed_form


def test_a_request_the_typed_form_can_hold_carries_both_forms():
    body = b'{"model":"m","messages":[{"role":"user","content":"hi"}],"seed":3,"top_k":9}'
    parsed = parse_json("chat_completion", "/v1/chat/completions", body, parse_chat_completion)
    assert parsed.typed_error is None and not parsed.request.typed_request_incomplete
    assert parsed.request.chat_completion.seed == 3
    assert parsed.request.http_request.body == body and parsed.request.http_request.path == "/v1/chat/completions"


@pytest.mark.parametrize("body, param", [
    (b'{"model":"m","messages":[{"role":"user","content":[{"type":"video_url","video_url":{"url":"u"}}]}]}',
     "messages[0].content[0].type"),
    (b'{"model":"m","messages":[{"role":"user","content":"x"}],"seed":1099511627776}', "seed"),
    (b'{"model":"m","messages":[]}', "messages"),
])
def test_a_request_the_typed_form_refuses_keeps_only_its_routing_fields_and_the_reason(body, param):
    parsed = parse_json("chat_completion", "/v1/chat/completions", body, parse_chat_completion)
    assert parsed.typed_error is not None and parsed.typed_error.param == param
    assert parsed.request.typed_request_incomplete == parsed.typed_error.message
    assert parsed.request.chat_completion.model == "m" and not parsed.request.chat_completion.messages
    assert parsed.request.http_request.body == body


def test_legacy_completions_keep_their_own_body_and_stream_flags():
    body = b'{"model":"m","prompt":"hi","echo":true,"stream":true,"stream_options":{"include_usage":true}}'
    parsed = parse_json("chat_completion", "/v1/completions", body, parse_completion)
    assert parsed.stream and parsed.include_usage and parsed.request.chat_completion.stream
    assert parsed.typed_error is not None and parsed.typed_error.param == "echo"
    assert parsed.request.http_request.path == "/v1/completions"


@pytest.mark.parametrize("body", [b"[1]", b'{"model":""}', b'{"model":"m","stream":1}', b"\xff",
                                  b'{"model":"m","stream":true,"stream_options":{"include_usage":"y"}}'])
def test_the_gateway_refuses_only_what_it_needs_itself(body):
    with pytest.raises(InvalidRequestError):
        parse_json("chat_completion", "/v1/chat/completions", body, parse_chat_completion)


def test_a_stream_flag_means_nothing_to_kinds_that_do_not_stream():
    parsed = parse_json("embedding", "/v1/embeddings", b'{"model":"m","input":"x","stream":true}', parse_embedding)
    assert not parsed.stream


def test_a_transcription_form_travels_as_sent_with_its_fields_read_for_routing():
    parsed = parse_form("/v1/audio/transcriptions", b"raw form", {"model": "w", "stream": "true"}, b"\x00", "a.wav")
    assert parsed.model == "w" and parsed.stream and parsed.request.http_request.body == b"raw form"
    assert parsed.request.audio_transcription.file == b"\x00"
    with pytest.raises(InvalidRequestError):
        parse_form("/v1/audio/transcriptions", b"", {"model": "w", "stream": "maybe"}, b"\x00", "a.wav")


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20,
)


@given(st.dictionaries(st.text(max_size=12), json_values, max_size=8), st.booleans())
def test_any_json_object_with_a_model_travels_byte_for_byte_or_is_refused_with_400(extra, stream):
    body = json.dumps({**extra, "model": "m", "stream": stream}).encode()
    try:
        parsed = parse_json("chat_completion", "/v1/chat/completions", body, parse_chat_completion)
    except InvalidRequestError:
        assert "stream_options" in extra, "only what the gateway reads itself may be refused"
        return
    assert parsed.request.http_request.body == body
    assert parsed.model == "m" and parsed.stream is stream


@given(st.data())
def test_hostile_bodies_travel_verbatim_or_end_in_a_400_for_every_endpoint(data):
    from tools.fuzz.drivers import HypothesisSource, check_openai_body, json_body

    check_openai_body(json_body(HypothesisSource(data)))


def test_a_json_body_is_decoded_once_and_kept_for_the_routing_hints():
    from protocol.routing import hints as routing_hints

    body = json.dumps({"model": "m", "messages": [{"role": "system", "content": "s" * 300},
                                                   {"role": "user", "content": "hi"}], "user": "u1"}).encode()
    parsed = parse_json("chat_completion", "/v1/chat/completions", body, parse_chat_completion)
    assert parsed.body_json == json.loads(body)
    headers = {"x-session-id": ["s1"]}
    from_object = routing_hints.hints_from_json("chat/completions", parsed.body_json, headers)
    assert from_object is not None and from_object == routing_hints.hints_from_json("chat/completions", body, headers)


BODIES = {
    "/v1/chat/completions": ("chat_completion", b'{"model":"m","messages":[{"role":"user","content":"hi"}],"seed":3}'),
    "/v1/completions": ("chat_completion", b'{"model":"m","prompt":"hi","max_tokens":5,"stream":true}'),
    "/v1/embeddings": ("embedding", b'{"model":"m","input":["a","b"]}'),
    "/v1/responses": ("model_response", b'{"model":"m","input":"hi"}'),
    "/tokenize": ("tokenize_request", b'{"model":"m","prompt":"hi"}'),
}


@pytest.mark.parametrize("path", sorted(BODIES))
def test_a_typed_form_left_for_later_is_the_one_that_would_have_been_built_at_once(path):
    kind, body = BODIES[path]
    typed = TYPED_BY_PATH[path]
    at_once = parse_json(kind, path + "?x=1", body, typed)
    later = parse_json(kind, path + "?x=1", body, typed, typed_wanted=lambda model: False)
    assert later.request.typed_request_incomplete == ROUTING_FIELDS_ONLY and typed_form_deferred(later.request)
    assert (later.model, later.stream, later.include_usage) == (at_once.model, at_once.stream, at_once.include_usage)
    later.request.infx_prefix_tip = 7
    later.request.infx_caller.flow = "key-1"
    built = with_typed_form(later.request)
    assert later.request.typed_request_incomplete == ROUTING_FIELDS_ONLY, "the caller's request is left as it was"
    assert built.infx_prefix_tip == 7 and built.infx_caller.flow == "key-1"
    built.ClearField("infx_prefix_tip")
    built.ClearField("infx_caller")
    assert built == at_once.request


def test_a_typed_form_built_later_that_does_not_convert_says_why():
    body = b'{"model":"m","messages":[{"role":"user","content":"x"}],"seed":1099511627776}'
    later = parse_json("chat_completion", "/v1/chat/completions", body, parse_chat_completion, lambda model: False)
    built = with_typed_form(later.request)
    assert "seed" in built.typed_request_incomplete and not typed_form_deferred(built)
    assert built.http_request == later.request.http_request
