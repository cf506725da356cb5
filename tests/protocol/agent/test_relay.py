"""The request a task becomes on the runtime's connection, and the answer headers that come back."""

from __future__ import annotations

import json

import pytest

from protocol.agent.relay import answer_headers, relay_request, request_id
from protocol.openai.errors import InvalidRequestError
from protocol.pb import audio_pb2, chat_pb2, worker_pb2


def verbatim(path: str = "/v1/chat/completions?x=1", body: bytes = b'{"model":"m"}', method: str = "POST",
             stream: bool = False, **headers: list[str]) -> worker_pb2.Task:
    task = worker_pb2.Task(id="t1")
    task.request.chat_completion.model = "m"
    task.request.chat_completion.stream = stream
    task.request.http_request.CopyFrom(worker_pb2.HttpRequest(method=method, path=path, body=body))
    for name, values in headers.items():
        task.header[name.replace("_", "-")].values.extend(values)
    return task


def lines(fields: bytes) -> list[bytes]:
    assert fields.endswith(b"\r\n") or not fields
    return fields.split(b"\r\n")[:-1]


def test_a_verbatim_request_keeps_method_path_body_and_the_clients_headers() -> None:
    task = verbatim(Content_Type=["application/json; charset=utf-8"], X_Custom=["a", "b"],
                    User_Agent=["OpenAI/Python 9"])
    request = relay_request(task, None, lambda: "unused")
    assert (request.method, request.target, request.body) == (b"POST", b"/v1/chat/completions?x=1", b'{"model":"m"}')
    # A header's values keep their order (the task's header map has none between names).
    assert sorted(lines(request.fields)) == [b"Content-Type: application/json; charset=utf-8",
                                             b"User-Agent: OpenAI/Python 9", b"X-Custom: a", b"X-Custom: b"]
    assert request.verbatim and not request.stream


def test_the_hops_own_headers_and_the_clients_credentials_never_reach_the_runtime() -> None:
    hop = {name: ["x"] for name in ("Connection", "Keep_Alive", "TE", "Trailer", "Transfer_Encoding", "Upgrade",
                                    "Host", "Content_Length", "Accept_Encoding", "Authorization", "Cookie",
                                    "Expect", "Proxy_Authorization", "Proxy_Connection")}
    request = relay_request(verbatim(X_Kept=["1"], **hop), None, lambda: "unused")
    assert lines(request.fields) == [b"X-Kept: 1", b"User-Agent: infx-engine"]


def test_the_runtimes_own_key_goes_out_as_a_bearer_token() -> None:
    request = relay_request(verbatim(Authorization=["Bearer client-secret"]), "runtime-key", lambda: "unused")
    assert b"Authorization: Bearer runtime-key" in lines(request.fields)
    assert b"client-secret" not in request.fields


def test_a_typed_request_is_sent_as_openai_json_with_the_agents_content_type() -> None:
    req = chat_pb2.CreateChatCompletionRequest(model="m", stream=True)
    req.messages.add(role="user").content.add(type="text", text="hi")
    task = worker_pb2.Task(id="t1", request=worker_pb2.TaskRequest(chat_completion=req))
    task.header["Content-Type"].values.append("text/plain")
    task.header["X-Request-Id"].values.append("req-1")
    request = relay_request(task, None, lambda: "unused")
    assert (request.method, request.target, request.stream, request.verbatim) == (
        b"POST", b"/v1/chat/completions", True, False)
    assert lines(request.fields)[0] == b"Content-Type: application/json"
    assert sorted(lines(request.fields)[1:]) == [b"User-Agent: infx-engine", b"X-Request-Id: req-1"]
    assert json.loads(request.body)["messages"] == [{"role": "user", "content": "hi"}]


def test_a_typed_audio_request_draws_another_boundary_when_the_file_holds_the_first() -> None:
    req = audio_pb2.CreateAudioTranscriptionRequest(model="w", file=b"--clash--", filename="a.wav")
    task = worker_pb2.Task(id="a1", request=worker_pb2.TaskRequest(audio_transcription=req))
    boundaries = iter(["clash", "fresh"])
    request = relay_request(task, None, lambda: next(boundaries))
    assert lines(request.fields)[0] == b"Content-Type: multipart/form-data; boundary=fresh"
    assert b"--fresh\r\n" in request.body


@pytest.mark.parametrize("path, method", [("v1/x", "POST"), ("/v1/x\r\nX-Evil: 1", "POST"), ("/v1/a b", "POST"),
                                          ("/v1/x", "PO ST"), ("/v1/x", "HEAD"), ("/v1/x", "connect")])
def test_a_request_line_no_runtime_should_see_is_refused(path: str, method: str) -> None:
    with pytest.raises(InvalidRequestError):
        relay_request(verbatim(path=path, method=method), None, lambda: "unused")


@pytest.mark.parametrize("headers", [
    {"X_Evil": ["a\r\nX-Second: 1"]}, {"X_Evil": ["a\nb"]}, {"X_Nul": ["a\0b"]}, {"Bad Name": ["x"]},
    {"X_Wide": ["\u20ac"]},
])
def test_a_header_that_could_smuggle_a_second_request_is_refused(headers: dict[str, list[str]]) -> None:
    task = verbatim()
    for name, values in headers.items():
        task.header[name.replace("_", "-")].values.extend(values)
    with pytest.raises(InvalidRequestError):
        relay_request(task, None, lambda: "unused")


def test_a_runtime_key_with_a_line_break_is_refused_rather_than_sent() -> None:
    with pytest.raises(InvalidRequestError):
        relay_request(verbatim(), "key\r\nX-Evil: 1", lambda: "unused")


def test_the_request_id_is_the_gateways_else_the_task_id() -> None:
    assert request_id(verbatim(x_request_id=["req-7"])) == "req-7"
    assert request_id(verbatim()) == "t1"


def test_answer_headers_drop_the_runtimes_hop_and_keep_the_rest_in_order() -> None:
    fields = [(b"content-type", b"text/event-stream"), (b"Transfer-Encoding", b"chunked"), (b"x-ratelimit-a", b"1"),
              (b"Content-Length", b"5"), (b"Connection", b"keep-alive"), (b"Set-Cookie", b"a=1"),
              (b"set-cookie", b"b=2"), (b"Retry-After", b"3")]
    assert answer_headers(fields) == {"content-type": ["text/event-stream"], "x-ratelimit-a": ["1"],
                                      "Set-Cookie": ["a=1", "b=2"], "Retry-After": ["3"]}


def test_answer_headers_keep_latin1_bytes_as_they_came() -> None:
    assert answer_headers([(b"X-Name", b"caf\xe9")]) == {"X-Name": ["caf\xe9"]}
