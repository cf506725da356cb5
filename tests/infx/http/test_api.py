"""The OpenAI HTTP API over real loopback sockets, driven by the official openai client.

A scripted TaskRunner stands in for the processor so that each test pins down
the gateway's own behaviour: conversion, error statuses, SSE relaying,
headers, cancellation and backpressure.
"""

from __future__ import annotations

import json
import socket
import uuid

import openai
import pytest
import pytest_twisted
from twisted.internet import reactor, threads

from infx.gateway.auth import KeyStore
from infx.http.api import new_request_id
from protocol.pb import worker_pb2
from tests.support.http_api import ScriptedRunner, client, gateway_factory, raw


@pytest_twisted.inlineCallbacks
def test_chat_completion_non_streaming(gateway_factory):
    runner, _, base = yield gateway_factory()
    reply = yield threads.deferToThread(
        lambda: client(base).chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
    )
    assert reply.choices[0].message.content == "hello there"
    (submission,) = runner.submissions
    assert submission.request.chat_completion.messages[0].content[0].text == "hi"
    assert not submission.streaming


@pytest_twisted.inlineCallbacks
def test_chat_completion_streaming_relays_events_and_ends_with_done(gateway_factory):
    runner, _, base = yield gateway_factory()

    def stream():
        chunks = client(base).chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hi"}], stream=True)
        return [c.choices[0].delta.content for c in chunks]

    assert (yield threads.deferToThread(stream)) == ["hello", " there", ""]
    status, headers, body = yield threads.deferToThread(
        raw, base, "POST", "/v1/chat/completions",
        json.dumps({"model": "m", "stream": True, "messages": [{"role": "user", "content": "x"}]}).encode(),
        {"content-type": "application/json"},
    )
    assert status == 200 and headers["content-type"] == "text/event-stream"
    assert body.endswith(b"data: [DONE]\n\n") and body.count(b"[DONE]") == 1
    assert runner.consumed >= 3


@pytest_twisted.inlineCallbacks
def test_completions_are_converted_back_to_text_completion(gateway_factory):
    runner, _, base = yield gateway_factory()
    c = client(base)
    reply = yield threads.deferToThread(lambda: c.completions.create(model="m", prompt="say hi"))
    assert reply.object == "text_completion" and reply.choices[0].text == "hello there"
    assert runner.submissions[0].request.WhichOneof("request") == "chat_completion"
    texts = yield threads.deferToThread(
        lambda: [ch.choices[0].text for ch in c.completions.create(model="m", prompt="say hi", stream=True)])
    assert "".join(texts) == "hello there"


@pytest_twisted.inlineCallbacks
def test_embeddings_and_models(gateway_factory):
    _, _, base = yield gateway_factory()
    c = client(base)
    reply = yield threads.deferToThread(lambda: c.embeddings.create(model="m", input=["a", "b"]))
    assert reply.data[0].embedding == [0.5, 0.25]
    models = yield threads.deferToThread(lambda: [m.id for m in c.models.list()])
    assert models == ["m", "m2"]
    model = yield threads.deferToThread(lambda: c.models.retrieve("m2"))
    assert model.id == "m2"
    with pytest.raises(openai.NotFoundError):
        yield threads.deferToThread(lambda: c.models.retrieve("nope"))


@pytest_twisted.inlineCallbacks
def test_error_statuses_map_to_openai_exceptions(gateway_factory):
    _, _, base = yield gateway_factory()
    c = client(base)
    cases = [
        ("unknown", openai.NotFoundError, None),
        ("gone", openai.InternalServerError, "5"),
        ("busy", openai.InternalServerError, "7"),
        ("slow", openai.APIStatusError, None),
        ("teapot", openai.BadRequestError, None),
    ]
    for model, error, retry_after in cases:
        with pytest.raises(error) as info:
            yield threads.deferToThread(
                lambda: c.chat.completions.create(model=model, messages=[{"role": "user", "content": "x"}]))
        assert info.value.body is not None and "message" in info.value.body
        if retry_after:
            assert info.value.response.headers["retry-after"] == retry_after
    with pytest.raises(openai.BadRequestError):
        yield threads.deferToThread(
            lambda: c.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}], temperature=7))


@pytest_twisted.inlineCallbacks
def test_error_bodies_carry_openais_types_and_non_standard_statuses_pass_unharmed(gateway_factory):
    """503 is server_error (as OpenAI answers it), a client error invalid_request_error; an engine's
    522 or a runtime's verbatim 599 reach the client with their code, never a crash or a 500."""
    _, _, base = yield gateway_factory()

    def post(model):
        body = json.dumps({"model": model, "messages": [{"role": "user", "content": "x"}]}).encode()
        return threads.deferToThread(raw, base, "POST", "/v1/chat/completions", body)

    status, _, body = yield post("busy")
    assert status == 503 and json.loads(body)["error"]["type"] == "server_error"
    status, _, body = yield post("unknown")
    assert status == 404 and json.loads(body)["error"]["type"] == "invalid_request_error"
    status, _, body = yield post("origin-down")
    assert status == 522 and json.loads(body)["error"]["type"] == "server_error"
    status, _, body = yield post("odd-verbatim")
    assert (status, body) == (599, b"{}")


@pytest_twisted.inlineCallbacks
def test_malformed_json_and_oversized_bodies(gateway_factory):
    _, _, base = yield gateway_factory(max_body_size=1000)
    status, _, body = yield threads.deferToThread(raw, base, "POST", "/v1/chat/completions", b"{not json")
    assert status == 400 and json.loads(body)["error"]["type"] == "invalid_request_error"
    status, _, body = yield threads.deferToThread(raw, base, "POST", "/v1/chat/completions", b"x" * 5000)
    assert status == 413 and "error" in json.loads(body)
    status, _, body = yield threads.deferToThread(raw, base, "GET", "/v2/anything")
    assert status == 404 and "error" in json.loads(body)


@pytest_twisted.inlineCallbacks
def test_api_keys_map_to_tenants_and_rate_limits_answer_429(gateway_factory):
    keys = KeyStore.from_mapping({"keys": [
        {"key": "sk-a", "tenant": "team-a"},
        {"key": "sk-limited", "tenant": "team-b", "rate_limit": {"rate": 0.01, "burst": 1}},
    ]})
    runner, _, base = yield gateway_factory(keys=keys)
    with pytest.raises(openai.AuthenticationError):
        yield threads.deferToThread(
            lambda: client(base, "sk-wrong").chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}]))
    yield threads.deferToThread(
        lambda: client(base, "sk-a").chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}]))
    assert runner.submissions[-1].tenant == "team-a"
    limited = client(base, "sk-limited")
    yield threads.deferToThread(
        lambda: limited.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}]))
    with pytest.raises(openai.RateLimitError) as info:
        yield threads.deferToThread(
            lambda: limited.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}]))
    headers = info.value.response.headers
    assert int(headers["retry-after"]) >= 1 and headers["x-ratelimit-remaining-requests"] == "0"


@pytest_twisted.inlineCallbacks
def test_request_id_is_kept_and_credentials_are_not_forwarded(gateway_factory):
    runner, _, base = yield gateway_factory()
    status, headers, _ = yield threads.deferToThread(
        raw, base, "POST", "/v1/chat/completions",
        json.dumps({"model": "m", "messages": [{"role": "user", "content": "x"}]}).encode(),
        {"x-request-id": "req-42", "authorization": "Bearer secret", "connection": "keep-alive", "x-custom": "yes"},
    )
    assert status == 200 and headers["x-request-id"] == "req-42"
    forwarded = runner.submissions[-1].headers
    assert forwarded["x-request-id"] == ["req-42"] and forwarded["x-custom"] == ["yes"]
    assert "authorization" not in forwarded and "connection" not in forwarded
    _, headers, _ = yield threads.deferToThread(
        raw, base, "POST", "/v1/chat/completions",
        json.dumps({"model": "m", "messages": [{"role": "user", "content": "x"}]}).encode())
    assert len(headers["x-request-id"]) == 32


@pytest_twisted.inlineCallbacks
def test_an_open_stream_does_not_keep_the_http_requests_body_buffer(gateway_factory):
    """The body travels on in the task; the HTTP request's own copy is let go once read, so
    an open stream does not hold it for its lifetime (issue #16, memory per open stream)."""
    runner, _, base = yield gateway_factory()
    seen = []

    def held(submission, sink):
        seen.append((sink.request.content, submission.request.chat_completion.messages[0].content[0].text))
        runner.script_m(submission, sink)

    def stream():
        chunks = client(base).chat.completions.create(
            model="held", messages=[{"role": "user", "content": "x" * 10000}], stream=True)
        return [c.choices[0].delta.content for c in chunks]

    runner.script_held = held
    chunks = yield threads.deferToThread(stream)
    assert seen == [(None, "x" * 10000)] and chunks == ["hello", " there", ""]


@pytest_twisted.inlineCallbacks
def test_error_after_streaming_started_is_a_final_sse_event(gateway_factory):
    _, _, base = yield gateway_factory()
    status, _, body = yield threads.deferToThread(
        raw, base, "POST", "/v1/chat/completions",
        json.dumps({"model": "midstream", "stream": True, "messages": [{"role": "user", "content": "x"}]}).encode())
    assert status == 200
    events = [e for e in body.split(b"\n\n") if e]
    assert b"partial" in events[0]
    assert json.loads(events[-1].removeprefix(b"data: "))["error"]["message"] == "engine vanished mid-stream"
    assert b"HTTP/1.1" not in body


@pytest_twisted.inlineCallbacks
def test_client_going_away_cancels_its_task(gateway_factory):
    runner, _, base = yield gateway_factory()
    port = int(base.rsplit(":", 1)[1])
    body = json.dumps({"model": "hang", "stream": True, "messages": [{"role": "user", "content": "x"}]}).encode()

    def send_and_vanish():
        s = socket.create_connection(("127.0.0.1", port))
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        return s

    sock = yield threads.deferToThread(send_and_vanish)
    for _ in range(100):
        if runner.submissions:
            break
        yield deferLater(0.01)
    sock.close()
    for _ in range(100):
        if runner.cancelled:
            break
        yield deferLater(0.01)
    assert [s.model for s in runner.cancelled] == ["hang"]


@pytest_twisted.inlineCallbacks
def test_health_readiness_metrics_and_admin_status(gateway_factory):
    _, gateway, base = yield gateway_factory()
    assert (yield threads.deferToThread(raw, base, "GET", "/healthz"))[0] == 200
    assert (yield threads.deferToThread(raw, base, "GET", "/readyz"))[0] == 200
    gateway.shutting_down = True
    assert (yield threads.deferToThread(raw, base, "GET", "/readyz"))[0] == 503
    yield threads.deferToThread(
        lambda: client(base).chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}]))
    status, _, metrics = yield threads.deferToThread(raw, base, "GET", "/metrics")
    assert status == 200
    assert b'infx_http_requests_total{endpoint="chat/completions",model="m",status="200",tenant="default"} 1.0' in metrics
    status, _, dump = yield threads.deferToThread(raw, base, "GET", "/admin/status")
    assert status == 200 and "tasks" in json.loads(dump)


def deferLater(seconds):
    from twisted.internet import task

    return task.deferLater(reactor, seconds, lambda: None)


@pytest_twisted.inlineCallbacks
def test_slow_reader_is_cut_off_alone_with_bounded_buffering(gateway_factory):
    """A client that stops reading a stream is cut off once 1 MiB waits for it; others go on."""
    runner = ScriptedRunner()
    emitted = []

    def flood(submission, sink):
        sink.response_received(worker_pb2.HttpResponse(status_code=200))
        event = b"data: " + b"x" * 65536 + b"\n\n"

        def more():
            if runner.cancelled or len(emitted) >= 4000:
                return
            for _ in range(16):
                sink.event_received(event)
                emitted.append(1)
            reactor.callLater(0, more)

        more()

    runner.script_flood = flood
    _, gateway, base = yield gateway_factory(runner=runner, max_buffered=1 << 20)
    port = int(base.rsplit(":", 1)[1])
    body = json.dumps({"model": "flood", "stream": True, "messages": [{"role": "user", "content": "x"}]}).encode()
    sock = socket.create_connection(("127.0.0.1", port))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 65536)
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
    other = yield threads.deferToThread(
        lambda: client(base).chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}]))
    assert other.choices[0].message.content == "hello there"
    for _ in range(500):
        if runner.cancelled:
            break
        yield deferLater(0.01)
    sock.close()
    assert [s.model for s in runner.cancelled] == ["flood"]
    assert gateway.metrics.slow_clients._value.get() == 1
    # Cut off long before the flood ran out: what waited for the client stayed bounded.
    assert len(emitted) < 4000


def test_a_request_id_the_gateway_makes_is_a_random_uuid4_in_hex_and_never_repeats() -> None:
    ids = [new_request_id() for _ in range(2000)]
    assert len(set(ids)) == len(ids)
    for request_id in ids:
        parsed = uuid.UUID(hex=request_id)
        assert (parsed.hex, parsed.version, parsed.variant) == (request_id, 4, uuid.RFC_4122)
