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
from infx.http.api import HttpApi
from infx.http.resources import build_resource
from infx.http.site import GatewaySite
from protocol.pb import worker_pb2
from protocol.agent.runtime_failures import broken_stream_event
from protocol.processor.core import ENGINE_LOST_MID_STREAM
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
        return Availability.SERVED if model in ("slow", "cut", "lost") else Availability.UNKNOWN

    def models(self, tenant: str) -> list[str]:
        return ["slow"]

    def typed_form_wanted(self, tenant: str, model: str) -> bool:
        return True

    def status(self, tenant: str | None = None) -> dict[str, Any]:
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
        if submission.model in ("cut", "lost"):
            # A runtime that dies mid-stream (the agent's error event), or an engine lost mid-stream.
            sink.response_received(worker_pb2.HttpResponse(status_code=200, header=SSE))
            sink.event_received(delta(role="assistant", content="par"))
            self.clock.advance(1)
            if submission.model == "cut":
                sink.event_received(broken_stream_event())
                sink.completed()
            else:
                sink.failed(502, ENGINE_LOST_MID_STREAM, None, "engine_lost",
                            "stream of engine 'e7' closed: UNAVAILABLE Connection was closed cleanly.")
            return
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
        gateway = HttpApi(SlowTokens(clock), clock, GatewayMetrics(CollectorRegistry()), keys)
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


@pytest_twisted.inlineCallbacks
def test_a_stream_a_dying_runtime_cut_short_is_logged_and_counted_as_a_502_with_its_cause(slow_gateway):
    """Issue #22: such a stream was logged status=200, so error-rate alerts never saw it. Its status
    line did say 200; its last event says how it ended, and that is what is logged and counted.
    No [DONE] follows the error event."""
    gateway, base = yield slow_gateway()
    with LogLines() as logs:
        status, _, body = yield threads.deferToThread(
            post, base, {"model": "cut", "stream": True, "messages": [{"role": "user", "content": "x"}]},
            {"X-Request-ID": "cut-1"})
    assert status == 200 and b"runtime_stream_broken" in body and b"[DONE]" not in body
    [line] = request_lines(logs)
    assert (line["status"], line["error"], line["detail"]) == (502, "runtime_stream_broken", None)
    assert logs.matching("request cut-1")[0].endswith("retries=1 error=runtime_stream_broken")
    assert gateway.metrics.registry.get_sample_value("infx_http_requests_total", {
        "endpoint": "chat/completions", "tenant": "default", "model": "cut", "status": "502"}) == 1
    assert gateway.metrics.registry.get_sample_value("infx_http_requests_total", {
        "endpoint": "chat/completions", "tenant": "default", "model": "cut", "status": "200"}) is None


@pytest_twisted.inlineCallbacks
def test_an_engine_lost_mid_stream_tells_the_client_what_to_do_and_the_log_what_broke(slow_gateway):
    gateway, base = yield slow_gateway()
    with LogLines() as logs:
        status, _, body = yield threads.deferToThread(
            post, base, {"model": "lost", "stream": True, "messages": [{"role": "user", "content": "x"}]},
            {"X-Request-ID": "lost-1"})
    error = json.loads(body.split(b"data: ")[-1])["error"]
    assert status == 200 and (error["code"], error["message"]) == ("engine_lost", ENGINE_LOST_MID_STREAM)
    assert b"UNAVAILABLE" not in body and b"[DONE]" not in body
    [line] = request_lines(logs)
    assert (line["status"], line["error"]) == (502, "engine_lost")
    assert logs.matching("request lost-1")[0].endswith(
        "error=engine_lost detail=\"stream of engine 'e7' closed: UNAVAILABLE Connection was closed cleanly.\"")


@pytest_twisted.inlineCallbacks
def test_what_is_not_known_reads_as_a_dash_in_the_text(slow_gateway, tmp_path):
    keys = tmp_path / "keys.yaml"
    keys.write_text("keys:\n  - key: k1\n    tenant: acme\n")
    _, base = yield slow_gateway(KeyStore.from_file(str(keys)))
    with LogLines() as logs:
        yield threads.deferToThread(post, base, {"model": "slow", "messages": []}, {"X-Request-ID": "anon"})
    assert "ttft=- tokens_in=- tokens_out=- engine='' gateway='' retries=0 error=invalid_api_key" in \
        logs.matching("request anon")[0]


@pytest_twisted.inlineCallbacks
def test_a_rate_limited_request_for_a_served_model_is_counted_under_that_model(slow_gateway, tmp_path):
    """Issue #22: a 429 was counted under model="__other__": the limit was checked before the body
    named the model."""
    keys = tmp_path / "keys.yaml"
    keys.write_text("keys:\n  - {key: k1, tenant: acme, rate_limit: {rate: 0.001, burst: 1}}\n")
    gateway, base = yield slow_gateway(KeyStore.from_file(str(keys)))
    body = {"model": "slow", "messages": [{"role": "user", "content": "x"}]}
    first = yield threads.deferToThread(post, base, body, {"Authorization": "Bearer k1"})
    second = yield threads.deferToThread(post, base, body, {"Authorization": "Bearer k1"})
    assert (first[0], second[0]) == (200, 429)
    assert gateway.metrics.registry.get_sample_value("infx_http_requests_total", {
        "endpoint": "chat/completions", "tenant": "acme", "model": "slow", "status": "429"}) == 1
