"""The one OpenAI error and status-line vocabulary: OpenAI's type map, the body's shape, error
events a stream parser reads back, and status lines that never fail on a non-standard code."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, strategies as st

from protocol.openai.errors import (
    status_of_error,
    InvalidRequestError,
    ModelNotFoundError,
    NotImplementedRequestError,
    OpenAIError,
    UpstreamError,
    error_body,
    error_event,
    error_json,
    error_type_for,
    event_of,
    reason_phrase,
    status_line,
)
from protocol.openai.sse import EventReceived, SSEParser


@pytest.mark.parametrize(("status", "kind"), [
    (400, "invalid_request_error"), (401, "invalid_request_error"), (403, "invalid_request_error"),
    (404, "invalid_request_error"), (413, "invalid_request_error"), (422, "invalid_request_error"),
    (429, "requests"),
    (500, "server_error"), (502, "server_error"), (503, "server_error"), (504, "server_error"),
    (522, "server_error"), (599, "server_error"),
])
def test_the_type_map_is_openais_own(status, kind):
    """OpenAI types client errors invalid_request_error, a 429 by the limit reached, and every
    server error (its 503 "overloaded" too) server_error: the gateway's old 503 service_unavailable
    and the processor's 504 timeout are gone."""
    assert error_type_for(status) == kind
    assert error_body(status, "m")["error"]["type"] == kind


def test_the_body_has_openais_four_fields_and_a_precise_kind_wins():
    assert error_body(404, "no such model", param="model", code="model_not_found") == {
        "error": {"message": "no such model", "type": "invalid_request_error", "param": "model",
                  "code": "model_not_found"}
    }
    assert error_body(502, "x", error_type="upstream_error")["error"]["type"] == "upstream_error"
    # The processor keeps the status in ``code``, as it always did.
    assert error_body(503, "x", code=503)["error"]["code"] == 503


def test_an_unknown_model_is_one_404_with_openais_code_and_param_whatever_the_reason():
    assert ModelNotFoundError("gpt-x").body() == {
        "error": {"message": "The model 'gpt-x' does not exist or no engine serves it.",
                  "type": "invalid_request_error", "param": "model", "code": "model_not_found"}
    }
    other = ModelNotFoundError("gpt-x", "no scalable deployment serves model 'gpt-x'")
    assert other.status == 404 and other.body()["error"] == {
        "message": "no scalable deployment serves model 'gpt-x'", "type": "invalid_request_error",
        "param": "model", "code": "model_not_found"}


def test_error_json_is_compact_utf8_and_keeps_what_the_message_says():
    raw = error_json(400, "é \ud800 \n")
    assert b'": ' not in raw and b', "' not in raw and b"\xc3\xa9" in raw
    assert json.loads(raw.decode("utf-8", "surrogatepass"))["error"]["message"] == "é \ud800 \n"


def test_an_error_event_is_one_sse_event_whose_data_is_the_body():
    event = error_event(503, "The engine is busy.\nTry later.", code=503)
    assert event.startswith(b"data: ") and event.endswith(b"\n\n") and event.count(b"\n") == 2
    (parsed,) = SSEParser().receive_data(event)
    assert isinstance(parsed, EventReceived)
    assert json.loads(parsed.data) == error_body(503, "The engine is busy.\nTry later.", code=503)
    assert event_of(error_body(503, "The engine is busy.\nTry later.", code=503)) == event


@pytest.mark.parametrize(("error", "status", "kind"), [
    (InvalidRequestError("bad", param="messages"), 400, "invalid_request_error"),
    (NotImplementedRequestError("no audio"), 501, "not_implemented"),
    (UpstreamError("garbled"), 502, "upstream_error"),
    (OpenAIError("bug"), 500, "server_error"),
])
def test_error_classes_speak_the_same_vocabulary(error, status, kind):
    assert error.status == status
    assert error.body() == error_body(status, error.message, error_type=kind, param=error.param, code=error.code)
    assert json.loads(error.to_json()) == error.body()
    assert error.to_event() == event_of(error.body())


@pytest.mark.parametrize(("status", "line"), [
    (200, "200 OK"), (202, "202 Accepted"), (404, "404 Not Found"), (503, "503 Service Unavailable"),
    (522, "522"), (599, "599"), (999, "999"),
])
def test_status_lines_name_registered_codes_and_never_fail_on_others(status, line):
    assert status_line(status) == line


def test_a_peers_own_reason_is_kept_as_sent():
    assert status_line(522, "Origin Connection Time-out") == "522 Origin Connection Time-out"
    assert status_line(200, "Fine") == "200 Fine"
    assert status_line(522, "") == "522"
    assert reason_phrase(599) == "" and reason_phrase(429) == "Too Many Requests"


@given(st.integers(min_value=-10, max_value=10_000))
def test_status_line_takes_any_code(status):
    line = status_line(status)
    assert line == str(status) or line.startswith(f"{status} ")


# -- one place: nobody else spells an error body, a status phrase or [DONE]


def _sources():
    from pathlib import Path

    root = Path(__file__).resolve().parents[3]
    for folder in ("protocol", "infx"):
        for path in sorted((root / folder).rglob("*.py")):
            if "pb" not in path.relative_to(root / folder).parts:
                yield path.relative_to(root).as_posix(), path.read_text()


def _vocabulary_spelled_elsewhere(name: str, source: str) -> list[str]:
    import ast

    tree = ast.parse(source)
    docstrings = {
        id(node.body[0].value) for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        and node.body and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)
    }
    found = []
    for node in ast.walk(tree):
        where = f"{name}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.Dict) and any(
            isinstance(k, ast.Constant) and k.value == "error" and isinstance(v, ast.Dict)
            for k, v in zip(node.keys, node.values)
        ) and name != "protocol/openai/errors.py":
            found.append(f"{where}: an error body built by hand")
        elif isinstance(node, ast.Constant) and id(node) not in docstrings:
            text = node.value.decode("latin-1") if isinstance(node.value, bytes) else node.value
            if isinstance(text, str):
                if '{"error"' in text and name != "protocol/openai/errors.py":
                    found.append(f"{where}: an error body spelled as text")
                if "[DONE]" in text and name != "protocol/openai/sse.py":
                    found.append(f"{where}: [DONE] spelled outside protocol/openai/sse.py")
        elif (isinstance(node, ast.Name) and node.id == "HTTPStatus" or isinstance(node, ast.Attribute)
              and node.attr in ("HTTPStatus", "RESPONSES")) and name != "protocol/openai/errors.py":
            found.append(f"{where}: a status phrase looked up outside protocol/openai/errors.py")
    return found


def test_error_bodies_status_phrases_and_done_come_only_from_the_vocabulary():
    found = [line for name, source in _sources() for line in _vocabulary_spelled_elsewhere(name, source)]
    assert found == []


@pytest.mark.parametrize("source", [
    'body = {"error": {"message": "x", "type": "server_error"}}',
    "body = b'{\"error\": {\"message\": \"x\"}}'",
    'from http import HTTPStatus\nphrase = HTTPStatus(522).phrase',
    'from twisted.web import http\nphrase = http.RESPONSES[404]',
    'DONE = b"data: [DONE]\\n\\n"',
])
def test_the_one_place_check_bites(source):
    assert _vocabulary_spelled_elsewhere("infx/elsewhere.py", source) != []


@pytest.mark.parametrize(("error", "status"), [
    ({"message": "x", "type": "upstream_error", "code": "runtime_stream_broken"}, 502),
    ({"message": "x", "type": "BadRequestError", "code": 400}, 400),  # vLLM names the status
    ({"message": "x", "type": "server_error", "code": 503}, 503),
    ({"message": "x", "type": "invalid_request_error"}, 400),
    ({"message": "x", "type": "requests"}, 429),
    ({"message": "x", "type": "not_implemented"}, 501),
    ({"message": "x", "type": "server_error", "code": 200}, 500),  # not an error status
    ({"message": "x", "code": True}, 500),
    ({"message": "x"}, 500),
    ("not an object", 500),
])
def test_an_error_objects_status_is_its_code_when_that_is_one_else_its_types(error, status):
    assert status_of_error(error) == status
