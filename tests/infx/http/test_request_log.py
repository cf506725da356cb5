"""Each API request ends in one structured log line and its metrics: request id, tenant, model,
endpoint, engine and gateway, status, latency, time to first token (at the first content token,
not the role chunk), tokens in/out, retries. The gateway's clock is a ``task.Clock`` stepped by
the scripted runner, so times are exact; HTTP runs over real loopback sockets."""

from __future__ import annotations

import json
from typing import Any

import pytest
import pytest_twisted
from prometheus_client import CollectorRegistry
from twisted.internet import reactor, task, threads
from twisted.internet.endpoints import TCP4ServerEndpoint

from infx.gateway.auth import KeyStore
from infx.gateway.metrics import OTHER_MODEL, GatewayMetrics
from infx.gateway.tasks import Availability, ServedBy
from infx.http.api import Gateway, build_resource
from infx.http.site import GatewaySite
from protocol.pb import worker_pb2
from tests.support.http_api import raw
from tests.support.logs import LogLines

SSE = {"Content-Type": worker_pb2.HeaderValue(values=["text/event-stream"])}


def sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def delta(**fields: Any) -> bytes:
    return sse({"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": fields, "finish_reason": None}]})


class SlowTokens:
    """An engine that opens with the role chunk at once, then gives a token every 2 s (on the clock)."""

    def __init__(self, clock: task.Clock) -> None:
        self.clock = clock
        self.served_by = ServedBy(engine_id="e7", gateway="gw-b", retries=1, queued_seconds=0.5)

    def availability(self, tenant: str, model: str) -> Availability:
        return Availability.SERVED if model == "slow" else Availability.UNKNOWN

    def models(self, tenant: str) -> list[str]:
        return ["slow"]

    def status(self) -> dict[str, Any]:
        return {}

    def submit(self, submission: Any, sink: Any) -> Any:
        runner = self

        class Handle:
            served_by = runner.served_by

            def cancel(self) -> None:
                pass

            def consumed(self, count: int) -> None:
                pass

        reactor.callLater(0, self.answer, submission, sink)
        return Handle()

    def answer(self, submission: Any, sink: Any) -> None:
        if not submission.streaming:
            self.clock.advance(1.5)
            body = json.dumps({"choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}}],
                               "usage": {"prompt_tokens": 11, "completion_tokens": 3}}).encode()
            sink.response_received(worker_pb2.HttpResponse(status_code=200, body=body))
            sink.completed()
            return
        sink.response_received(worker_pb2.HttpResponse(status_code=200, header=SSE))
        sink.event_received(delta(role="assistant", content=""))
        for word in ("Hello", " world"):
            self.clock.advance(2)
            sink.event_received(delta(content=word))
        sink.event_received(sse({"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 2}}))
        sink.event_received(b"data: [DONE]\n\n")
        sink.completed()


@pytest.fixture
def slow_gateway():
    ports = []

    @pytest_twisted.inlineCallbacks
    def start(keys: KeyStore | None = None):
        clock = task.Clock()
        clock.advance(1000)
        gateway = Gateway(SlowTokens(clock), clock, GatewayMetrics(CollectorRegistry()), keys)
        gateway.listening = True
        port = yield TCP4ServerEndpoint(reactor, 0, interface="127.0.0.1").listen(
            GatewaySite(build_resource(gateway), max_body_size=1 << 20))
        ports.append(port)
        return gateway, f"http://127.0.0.1:{port.getHost().port}"

    yield start
    for port in ports:
        port.stopListening()


def post(base: str, body: dict[str, Any], headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
    return raw(base, "POST", "/v1/chat/completions", json.dumps(body).encode(),
               {"Content-Type": "application/json", **(headers or {})})


def request_lines(logs: LogLines) -> list[dict[str, Any]]:
    return [e for e in logs.events if e.get("event") == "request"]


@pytest_twisted.inlineCallbacks
def test_time_to_first_token_is_the_first_content_chunk_not_the_role_chunk(slow_gateway):
    gateway, base = yield slow_gateway()
    with LogLines() as logs:
        status, headers, _ = yield threads.deferToThread(
            post, base, {"model": "slow", "stream": True, "messages": [{"role": "user", "content": "x"}]},
            {"X-Request-ID": "req-42"})
    assert status == 200 and headers["x-request-id"] == "req-42"
    registry = gateway.metrics.registry
    labels = {"endpoint": "chat/completions", "tenant": "default", "model": "slow"}
    assert registry.get_sample_value("infx_time_to_first_token_seconds_sum", labels) == 2.0
    assert registry.get_sample_value("infx_time_to_first_token_seconds_count", labels) == 1
    assert registry.get_sample_value("infx_input_tokens_total", {"tenant": "default", "model": "slow"}) == 7
    assert registry.get_sample_value("infx_output_tokens_total", {"tenant": "default", "model": "slow"}) == 2
    assert registry.get_sample_value("infx_request_retries_total", {"tenant": "default", "model": "slow"}) == 1
    assert registry.get_sample_value(
        "infx_http_request_duration_seconds_sum", {**labels, "status": "200"}) == 4.0
    [line] = request_lines(logs)
    expected = {
        "request_id": "req-42", "tenant": "default", "model": "slow", "endpoint": "chat/completions",
        "status": 200, "latency_seconds": 4.0, "time_to_first_token_seconds": 2.0, "tokens_in": 7,
        "tokens_out": 2, "engine_id": "e7", "gateway": "gw-b", "retries": 1, "queued_seconds": 0.5,
    }
    assert {name: line[name] for name in expected} == expected
    text = logs.matching("request req-42")[0]
    assert text == ("request req-42 chat/completions model='slow' tenant='default' status=200 latency=4.000s "
                    "ttft=2.000s tokens_in=7 tokens_out=2 engine='e7' gateway='gw-b' retries=1")


@pytest_twisted.inlineCallbacks
def test_a_request_without_an_id_gets_one_and_a_whole_answer_logs_its_usage(slow_gateway):
    _, base = yield slow_gateway()
    with LogLines() as logs:
        status, headers, _ = yield threads.deferToThread(
            post, base, {"model": "slow", "messages": [{"role": "user", "content": "x"}]})
    assert status == 200
    [line] = request_lines(logs)
    assert line["request_id"] == headers["x-request-id"] and len(line["request_id"]) == 32
    assert (line["tokens_in"], line["tokens_out"], line["time_to_first_token_seconds"]) == (11, 3, None)
    assert line["latency_seconds"] == 1.5


@pytest_twisted.inlineCallbacks
def test_refusals_are_logged_too_with_what_is_known(slow_gateway, tmp_path):
    keys = tmp_path / "keys.yaml"
    keys.write_text("keys:\n  - key: k1\n    tenant: acme\n")
    gateway, base = yield slow_gateway(KeyStore.from_file(str(keys)))
    with LogLines() as logs:
        bad_key = yield threads.deferToThread(post, base, {"model": "slow", "messages": []},
                                              {"Authorization": "Bearer nope"})
        unknown = yield threads.deferToThread(post, base, {"model": "nope", "messages": [
            {"role": "user", "content": "x"}]}, {"Authorization": "Bearer k1"})
    assert (bad_key[0], unknown[0]) == (401, 404)
    first, second = request_lines(logs)
    assert (first["status"], first["tenant"], first["engine_id"]) == (401, "", "")
    assert (second["status"], second["tenant"], second["model"]) == (404, "acme", "nope")
    assert gateway.metrics.registry.get_sample_value("infx_http_requests_total", {
        "endpoint": "chat/completions", "tenant": "acme", "model": OTHER_MODEL, "status": "404"}) == 1


@pytest_twisted.inlineCallbacks
def test_a_request_logs_one_line_with_no_twisted_web_access_line_beside_it(slow_gateway):
    from twisted.logger import formatEvent, globalLogPublisher

    _, base = yield slow_gateway()
    lines: list[str] = []
    observer = lambda event: lines.append(formatEvent(event))  # noqa: E731
    globalLogPublisher.addObserver(observer)
    try:
        status, headers, _ = yield threads.deferToThread(
            post, base, {"model": "slow", "messages": [{"role": "user", "content": "x"}]}, {"X-Request-ID": "r-1"})
    finally:
        globalLogPublisher.removeObserver(observer)
    assert status == 200
    assert [line for line in lines if "r-1" in line or "/v1/chat/completions" in line] == [
        "request r-1 chat/completions model='slow' tenant='default' status=200 latency=1.500s ttft=- "
        "tokens_in=11 tokens_out=3 engine='e7' gateway='gw-b' retries=1"]
