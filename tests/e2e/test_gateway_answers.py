"""Every answer of a real ``twistd infx`` on every path and method (issue #22, item 3).

A GET on a POST-only path answered Twisted's HTML 405 page ("Your browser approached
me..."), DELETE or PUT its HTML 501 "Huh?", a 429's status line read "429 Unknown
Status", and 413 refusals appeared in neither the log nor the metrics. This walks every
route of the HTTP API, the probes, ``/metrics``, ``/admin/status``, directories and
unknown paths with every method and with bad bodies, over plain HTTP/1.1 (so the status
line itself is checked), and asserts on each answer: a refusal is OpenAI's JSON error
shape with the registered reason phrase (and ``Allow`` for a 405), and it is logged as a
request line and counted in ``infx_http_requests_total``. The official ``openai`` client
sees the same answers as the exceptions it is built to raise.
"""

from __future__ import annotations

import http.client
import json
import socket
from collections import Counter
from collections.abc import Iterator
from http import HTTPStatus

import openai
import pytest

from harness.twistd_processes import Gateway, http_get, wait_until

USER, ADMIN, LIMITED = "sk-user", "sk-admin", "sk-limited"
KEYS = f"""keys:
  - {{key: {USER}, tenant: default}}
  - {{key: {ADMIN}, tenant: default, admin: true}}
  - {{key: {LIMITED}, tenant: default, rate_limit: {{rate: 0.001, burst: 1}}}}
"""
POST_ROUTES = ["/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses", "/v1/tokenize",
               "/v1/audio/transcriptions"]
GET_ROUTES = ["/v1/models", "/v1/models/echo", "/healthz", "/readyz", "/metrics", "/admin/status"]
UNKNOWN = ["/", "/v1", "/v1/", "/v1/chat", "/v1/audio", "/admin/nothing", "/v2/anything", "/v1/nope", "/favicon.ico"]
METHODS = ["GET", "HEAD", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "TRACE", "FOO"]
#: Words that must never reach a client: a Python repr, a Twisted class or page, a traceback.
INTERNALS = ("<html", "<HTML", "Traceback", "twisted", "Twisted", "Failure", "browser approached", "Huh?")


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    logs = tmp_path_factory.mktemp("answers")
    keys = logs / "keys.yaml"
    keys.write_text(KEYS)
    gateway = Gateway(logs, api_keys=keys, admin_key=ADMIN,
                      extra=["--echo-models", "echo", "--max-body-size", "65536"])
    wait_until(lambda: b'"echo"' in http_get(gateway.url + "/v1/models", {"Authorization": f"Bearer {USER}"})[1],
               "the echo model", [gateway.child])
    yield gateway
    gateway.stop()


class Answer:
    """One exchange as the wire carried it."""

    def __init__(self, method: str, path: str, status: int, reason: str, headers: dict[str, str], body: bytes):
        self.method, self.path, self.status, self.reason, self.headers, self.body = (
            method, path, status, reason, headers, body)

    def __repr__(self) -> str:
        return f"{self.method} {self.path} -> {self.status} {self.reason!r} {self.body[:200]!r}"

    def check(self) -> None:
        """Whatever the answer, its reason phrase is the registered one; a refusal is OpenAI's JSON."""
        assert self.reason == HTTPStatus(self.status).phrase, self
        text = self.body.decode("utf-8", "replace")
        assert not any(word in text for word in INTERNALS), self
        if self.status < 400:
            return
        assert self.headers.get("content-type") == "application/json", self
        if self.method == "HEAD":
            return  # no body, by HTTP
        error = json.loads(self.body)["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"] and error["type"], self
        if self.status == 405:
            assert error["code"] == "method_not_allowed" and self.headers.get("allow"), self


def exchange(gateway: Gateway, method: str, path: str, body: bytes | None = None,
             headers: dict[str, str] | None = None) -> Answer:
    conn = http.client.HTTPConnection("127.0.0.1", gateway.http_port, timeout=10)
    try:
        conn.request(method, path, body=body, headers={"Authorization": f"Bearer {USER}", **(headers or {})})
        response = conn.getresponse()
        data = response.read()
        return Answer(method, path, response.status, response.reason,
                      {k.lower(): v for k, v in response.getheaders()}, data)
    finally:
        conn.close()


def refusals_counted(gateway: Gateway) -> Counter[int]:
    """``infx_http_requests_total`` of error statuses, by status, summed over every other label."""
    counted: Counter[int] = Counter()
    for line in http_get(gateway.url + "/metrics")[1].decode().splitlines():
        if line.startswith("infx_http_requests_total{"):
            status = int(line.split('status="')[1].split('"')[0])
            if status >= 400:
                counted[status] += int(float(line.rsplit(" ", 1)[1]))
    return counted


def refusals_logged(gateway: Gateway) -> Counter[int]:
    return Counter(int(line.split(" status=")[1].split()[0]) for line in gateway.child.output().splitlines()
                   if "[infx.request_log#info] request " in line and int(line.split(" status=")[1].split()[0]) >= 400)


def test_every_path_and_method_answers_json_with_the_right_status_line_and_every_refusal_is_counted(
        gateway: Gateway) -> None:
    before_counted, before_logged = refusals_counted(gateway), refusals_logged(gateway)
    answers: list[Answer] = []
    for path in POST_ROUTES + GET_ROUTES + UNKNOWN:
        for method in METHODS:
            body = b"{}" if method in ("POST", "PUT", "PATCH") else None
            answers.append(exchange(gateway, method, path, body,
                                    {"Content-Type": "application/json", "Authorization": f"Bearer {ADMIN}"}))
    for answer in answers:
        answer.check()
        if answer.path in UNKNOWN:
            assert answer.status == 404, answer
        elif answer.path in POST_ROUTES:
            assert answer.status == (400 if answer.method == "POST" else 405), answer  # "{}" names no model
            if answer.status == 405:
                assert answer.headers["allow"] == "POST", answer
        elif answer.method in ("GET", "HEAD"):
            assert answer.status == 200, answer
        else:
            assert answer.status == 405 and answer.headers["allow"] == "GET, HEAD", answer
    refused = Counter(a.status for a in answers if a.status >= 400)
    assert refused[405] == len(POST_ROUTES) * (len(METHODS) - 1) + len(GET_ROUTES) * (len(METHODS) - 2)
    # The /metrics scrapes above are answered, not refused: exactly the refusals are counted and logged.
    wait_until(lambda: refusals_logged(gateway) - before_logged == refused, "every refusal's log line",
               [gateway.child])
    assert refusals_counted(gateway) - before_counted == refused


@pytest.mark.parametrize(("path", "body", "content_type", "status"), [
    ("/v1/chat/completions", b"not json", "application/json", 400),
    ("/v1/chat/completions", b"[1, 2]", "application/json", 400),
    ("/v1/chat/completions", b"", "application/json", 400),
    ("/v1/chat/completions", b'{"model": "echo", "messages": "hi"}', "application/json", 400),
    ("/v1/chat/completions", b'{"model": "echo", "messages": [{"role": "user", "content": "\xff\xfe"}]}',
     "application/json", 400),
    ("/v1/chat/completions", b'{"model": "nobody-serves-this", "messages": []}', "application/json", 404),
    ("/v1/completions", b'{"model": "echo", "prompt": [1, 2, 3]}', "application/json", 400),
    ("/v1/embeddings", b'{"model": "echo", "input": {"a": 1}}', "application/json", 400),
    ("/v1/responses", b'{"model": 7}', "application/json", 400),
    ("/v1/tokenize", b"{", "application/json", 400),
    ("/v1/audio/transcriptions", b'{"model": "echo"}', "application/json", 400),
    ("/v1/audio/transcriptions", b"--x\r\nbroken", "multipart/form-data; boundary=x", 400),
])
def test_a_bad_body_on_any_route_is_a_json_error_with_its_reason_phrase(gateway, path, body, content_type, status):
    answer = exchange(gateway, "POST", path, body, {"Content-Type": content_type})
    answer.check()
    assert answer.status == status, answer


def raw_exchange(gateway: Gateway, head: bytes) -> tuple[bytes, dict[str, str], bytes]:
    """Send ``head`` (a request without its body) on a socket; the status line, headers and body."""
    with socket.create_connection(("127.0.0.1", gateway.http_port), timeout=10) as sock:
        sock.sendall(head)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    status_line, _, rest = data.partition(b"\r\n")
    header_block, _, body = rest.partition(b"\r\n\r\n")
    headers = {}
    for line in header_block.split(b"\r\n"):
        name, _, value = line.decode("latin-1").partition(":")
        headers[name.strip().lower()] = value.strip()
    return status_line, headers, body


def test_a_body_over_the_limit_is_a_413_with_its_phrase_logged_and_counted(gateway: Gateway) -> None:
    before = refusals_counted(gateway)[413]
    status_line, headers, body = raw_exchange(gateway, (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer sk-user\r\n"
        b"Content-Type: application/json\r\nContent-Length: 100000000\r\n\r\n"))
    assert status_line == b"HTTP/1.1 413 Request Entity Too Large" and headers["content-type"] == "application/json"
    assert json.loads(body)["error"]["code"] == "request_too_large"
    wait_until(lambda: refusals_counted(gateway)[413] == before + 1, "the 413 to be counted", [gateway.child])
    assert any("chat/completions" in line and "status=413 " in line and "error=request_too_large" in line
               for line in gateway.child.output().splitlines())


def test_a_rate_limited_request_reads_429_too_many_requests_and_is_counted_under_its_model(gateway):
    body = json.dumps({"model": "echo", "messages": [{"role": "user", "content": "hi"}]}).encode()
    headers = {"Authorization": f"Bearer {LIMITED}", "Content-Type": "application/json"}
    first = exchange(gateway, "POST", "/v1/chat/completions", body, headers)
    second = exchange(gateway, "POST", "/v1/chat/completions", body, headers)
    first.check()
    second.check()
    assert (first.status, second.status, second.reason) == (200, 429, "Too Many Requests")
    assert int(second.headers["retry-after"]) >= 1
    assert json.loads(second.body)["error"]["code"] == "rate_limit_exceeded"
    metrics = http_get(gateway.url + "/metrics")[1].decode()
    assert 'infx_http_requests_total{endpoint="chat/completions",model="echo",status="429",tenant="default"} 1.0' \
        in metrics


def test_keys_and_admin_refusals_are_json_with_their_phrase(gateway: Gateway) -> None:
    for answer, status in [
        (exchange(gateway, "GET", "/v1/models", headers={"Authorization": "Bearer wrong"}), 401),
        (exchange(gateway, "GET", "/v1/models/echo", headers={"Authorization": "Bearer wrong"}), 401),
        (exchange(gateway, "GET", "/v1/models/nope"), 404),
        (exchange(gateway, "GET", "/admin/status", headers={"Authorization": "Bearer wrong"}), 401),
        (exchange(gateway, "GET", "/admin/status"), 403),
        (exchange(gateway, "POST", "/v1/chat/completions", b"{}", {"Authorization": "Bearer wrong"}), 401),
    ]:
        answer.check()
        assert answer.status == status, answer


def test_the_openai_client_raises_the_exception_each_refusal_stands_for(gateway: Gateway) -> None:
    client = openai.OpenAI(base_url=gateway.base_url, api_key=USER, max_retries=0, timeout=10)
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model="echo", messages="hi")  # type: ignore[arg-type]
    with pytest.raises(openai.NotFoundError) as missing:
        client.models.retrieve("nope")
    with pytest.raises(openai.APIStatusError) as wrong_method:
        client.get("/chat/completions", cast_to=object)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=gateway.base_url, api_key="wrong", max_retries=0).models.list()
    assert bad.value.status_code == 400 and missing.value.code == "model_not_found"
    assert wrong_method.value.status_code == 405 and wrong_method.value.code == "method_not_allowed"
    assert wrong_method.value.response.headers["allow"] == "POST"
    limited = openai.OpenAI(base_url=gateway.base_url, api_key=LIMITED, max_retries=0, timeout=10)
    with pytest.raises(openai.RateLimitError) as limit:
        for _ in range(2):
            limited.chat.completions.create(model="echo", messages=[{"role": "user", "content": "hi"}])
    assert limit.value.code == "rate_limit_exceeded"


def test_no_log_line_of_the_walk_carries_a_traceback(gateway: Gateway) -> None:
    assert "Traceback" not in gateway.child.output()
