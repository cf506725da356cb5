"""Hostile HTTP clients and hostile engines against the whole gateway stack, in process.

The stack is the real one (twisted.web site, :class:`~infx.http.api.Gateway`,
:class:`~infx.gateway.dispatcher.Dispatcher`, :class:`~protocol.processor.core.Processor`)
on a :class:`~twisted.internet.task.Clock`, with HTTP over a StringTransport
and an in-memory engine route that answers tasks with the real echo runtime
core (:func:`protocol.agent.echo.echo_task`), or with whatever a test makes it send.

Every hostile input must end in a complete HTTP response: 2xx, or a 4xx/5xx
with an OpenAI error body (``{"error": {"message": ...}}``); never an
exception, never a request left without an answer once its deadline has
passed; and a well-behaved request to the same gateway still gets its 200.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from infx.gateway.auth import KeyStore
from protocol.agent.echo import EchoConfig, echo_task
from protocol.pb import worker_pb2
from tests.support.http_api import SITES
from tests.support.hostile import CHAT, JSON, Response, Stack, assert_well_behaved_request_works
from tools.fuzz.drivers import HypothesisSource, RandomSource, Source, json_body

FEW = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# -- the stack ----------------------------------------------------------------------


def assert_openai_error_or_success(response: Response) -> None:
    if response.status >= 400:
        response.error()
    else:
        assert response.status == 200, response
        json.loads(response.body)


# -- hostile request bodies and headers ------------------------------------------------

ENDPOINTS = ["/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses", "/v1/tokenize",
             "/v1/audio/transcriptions"]
odd_header_values = st.sampled_from(
    ["", "nan", "inf", "-1", "0", "1e-300", "1e309", "abc", "0.5", "Bearer", "Bearer x", "\x7f", "ü"])


odd_requests = given(st.sampled_from(ENDPOINTS), st.data(),
                     st.dictionaries(st.sampled_from(["content-type", "authorization", "x-request-timeout",
                                                      "x-stainless-timeout", "x-request-id", "accept"]),
                                     odd_header_values, max_size=4))


# One test per server of the tree (tests.support.http_api.SITES): pytest-twisted's runner and
# Hypothesis's do not take a parametrized site together.
@FEW
@odd_requests
def test_any_body_and_headers_end_in_an_answer_and_the_next_request_works(path, data, headers):
    any_body_and_headers("twisted", path, data, headers)


@FEW
@odd_requests
def test_any_body_and_headers_end_in_an_answer_and_the_next_request_works_on_httptools(path, data, headers):
    any_body_and_headers("httptools", path, data, headers)


def any_body_and_headers(site, path, data, headers):
    """Random JSON (wrong types, huge strings, deep nesting) or bytes, with odd
    headers: the gateway answers 200 or an OpenAI error (400, 404, 413, 5xx),
    within the request's deadline; then a good request on the same connection
    still gets its 200."""
    stack = Stack(site=site)
    stack.engine(models=("m", "x"))
    client = stack.connect()
    body = json_body(HypothesisSource(data))
    client.request(path, body, headers)
    stack.settle(120)
    (response,) = client.responses()
    assert_openai_error_or_success(response)
    assert not stack.gateway.active_calls
    assert stack.processor.status()["tasks"] == 0
    assert_well_behaved_request_works(stack, client)


@pytest.mark.parametrize("site", sorted(SITES))
def test_a_timeout_so_short_it_has_passed_is_a_504_not_a_hang(site):
    """A client timeout that has already passed when the task is submitted
    fails inside ``submit``: the answer must still be written (504)."""
    stack = Stack(site=site)
    stack.engine()
    client = stack.connect()
    response = client.exchange("/v1/chat/completions", CHAT, {**JSON, "x-request-timeout": "1e-300"})
    assert response.status == 504 and response.error()["message"]
    assert not stack.gateway.active_calls
    assert_well_behaved_request_works(stack, client)


MALFORMED_HTTP = [
    b"POST /v1/chat/completions HTTP/1.1\r\nContent-Length: -5\r\n\r\n",
    b"POST /v1/chat/completions HTTP/1.1\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\n",
    b"POST /v1/chat/completions HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
    b"POST /v1/chat/completions HTTP/1.1\r\nBad Header\r\n\r\n",
    b"\x16\x03\x01\x00\xa5\x01\x00\x00\xa1\x03\x03" + bytes(40) + b"\r\n\r\n",
    b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",
    b"GET /" + b"a" * 20_000 + b" HTTP/1.1\r\n\r\n",
]


malformed = given(st.sampled_from(MALFORMED_HTTP) | st.binary(min_size=1, max_size=300).map(lambda b: b + b"\r\n\r\n"))
MALFORMED_EXAMPLES = settings(max_examples=len(MALFORMED_HTTP) + 15, deadline=None,
                              suppress_health_check=[HealthCheck.too_slow])


@MALFORMED_EXAMPLES
@malformed
def test_malformed_http_is_answered_or_dropped_and_the_gateway_keeps_serving(raw):
    malformed_http("twisted", raw)


@MALFORMED_EXAMPLES
@malformed
def test_malformed_http_is_answered_or_dropped_and_the_gateway_keeps_serving_on_httptools(raw):
    malformed_http("httptools", raw)


def malformed_http(site, raw):
    """Bytes that are not a valid HTTP/1.1 request get a 4xx (or the connection
    is closed) without raising, and other clients are served as before."""
    stack = Stack(site=site)
    stack.engine()
    client = stack.connect()
    client.send(raw)
    stack.settle(120)
    for response in client.responses():
        assert 400 <= response.status < 500
    assert not stack.gateway.active_calls
    assert_well_behaved_request_works(stack)


# -- hostile engines: what an engine (or a runtime behind it) sends back -----------------


def mutate(source: Source, result: worker_pb2.TaskResult) -> worker_pb2.TaskResult:
    """One TaskResult changed by a hostile engine: fields bent, or wire bytes flipped."""
    kind = source.integer(0, 6)
    out = worker_pb2.TaskResult()
    out.CopyFrom(result)
    if kind == 0:
        out.result_index = source.integer(0, 5)
    elif kind == 1 and out.HasField("http_response"):
        out.http_response.status_code = source.integer(0, 999)
        out.http_response.body = source.blob(60)
    elif kind == 2 and out.HasField("server_sent_event"):
        out.server_sent_event.data = source.blob(60)
    elif kind == 3:
        out.server_sent_event.is_last_event = source.flag()
    elif kind == 4:
        wire = bytearray(out.SerializeToString())
        for _ in range(source.integer(1, 4)):
            if wire:
                wire[source.integer(0, len(wire) - 1)] = source.integer(0, 255)
        try:
            parsed = worker_pb2.TaskResult.FromString(bytes(wire))
        except Exception:  # an undecodable message never reaches the processor (the transport's INTERNAL)
            return out
        parsed.task_id = result.task_id
        return parsed
    elif kind == 5:
        out.http_response.header["content-type"].values[:] = [source.blob(20).decode("latin-1")]
    return out


@FEW
@given(st.integers(0, 2**32), st.booleans(), st.sampled_from(["/v1/chat/completions", "/v1/completions"]))
def test_hostile_engine_results_end_in_an_answer_and_other_requests_are_unaffected(seed, stream, path):
    """TaskResults bent, reordered, duplicated, dropped or flipped on the wire
    (SSE data from a broken runtime included) end the request with what the
    engine said or an OpenAI error (502 for a protocol violation, 504 once the
    deadline passes): the request always gets its answer, and a request served
    by a well-behaved engine alongside is unaffected."""
    # The engine answers inside Twisted callbacks, where Hypothesis cannot
    # draw: its choices come from a seeded generator instead.
    source = RandomSource(seed)

    def hostile(task_: worker_pb2.Task) -> list[worker_pb2.TaskResult]:
        honest = [r.result for r in echo_task(task_, EchoConfig(), 0.0)]
        out = []
        for result in honest:
            action = source.integer(0, 5)
            if action == 0:
                continue
            out.append(mutate(source, result) if action <= 2 else result)
            if action == 3:
                out.append(result)
        return out

    stack = Stack()
    stack.engine("bad", models=("m",), answer=hostile)
    stack.engine("good", models=("g",))
    client = stack.connect()
    body = json.dumps({"model": "m", "stream": stream, "prompt": "a b c",
                       "messages": [{"role": "user", "content": "a b c"}]}).encode()
    other = stack.connect()
    client.request(path, body, JSON)
    other.request("/v1/chat/completions", CHAT.replace(b'"m"', b'"g"'), JSON)
    stack.settle(120)
    (response,) = client.responses()
    if response.headers.get(b"content-type") == b"text/event-stream":
        assert response.status == 200
        events = [e for e in response.body.split(b"\n\n") if e.strip()]
        # The stream ends: with [DONE], or with an error event as its last word.
        assert events[-1].strip() == b"data: [DONE]" or b'"error"' in events[-1] or not events
    else:
        # What the engine said (any final status), or the gateway's own error.
        assert 200 <= response.status <= 599
        if response.status in (502, 503, 504):
            response.error()
    (good,) = other.responses()
    assert good.status == 200 and b"hello there" in good.body
    assert not stack.gateway.active_calls
    assert stack.processor.status()["tasks"] == 0


def test_an_engine_that_never_answers_ends_in_504_at_the_deadline():
    stack = Stack()
    stack.engine(hold=True)
    client = stack.connect()
    client.request("/v1/chat/completions", CHAT, {**JSON, "x-request-timeout": "3"})
    stack.settle(2)
    assert client.responses() == []
    stack.settle(2)
    (response,) = client.responses()
    assert response.status == 504 and response.error()


@pytest.mark.parametrize("site", sorted(SITES))
def test_a_header_that_is_not_utf8_is_read_not_a_500(site):
    """Header values are bytes on the wire; one that is not UTF-8 (an
    ``Authorization`` in latin-1, say) is read as latin-1 rather than raising
    inside the handler (which Twisted turns into an HTML 500)."""
    stack = Stack(keys=KeyStore.from_mapping({"keys": [{"key": "sk-ok", "tenant": "default"}]}), site=site)
    stack.engine()
    client = stack.connect()
    client.send(b"POST /v1/chat/completions HTTP/1.1\r\nHost: g\r\nAuthorization: Bearer \xfc\xff\r\n"
                b"X-Request-Id: \xe9t\xe9\r\nContent-Length: %d\r\n\r\n%s" % (len(CHAT), CHAT))
    stack.settle(1)
    (response,) = client.responses()
    assert response.status == 401 and response.error()["code"] == "invalid_api_key"
    ok = client.exchange("/v1/chat/completions", CHAT, {**JSON, "authorization": "Bearer sk-ok"})
    assert ok.status == 200


@pytest.mark.parametrize("status", [1, 100, 150, 600, 1000, 2**31 - 1])
def test_an_engine_status_that_is_not_a_final_http_status_is_a_502(status):
    """Regression (found by the hostile-engine suite): an HttpResponse with
    status_code 1 was relayed as the status line ``HTTP/1.1 1``; anything
    outside 200-599 is now the gateway's 502 with an OpenAI error body."""
    def answer(task_: worker_pb2.Task) -> list[worker_pb2.TaskResult]:
        return [worker_pb2.TaskResult(task_id=task_.id, http_response=worker_pb2.HttpResponse(
            status_code=status, body=b"{}"))]

    stack = Stack()
    stack.engine(answer=answer)
    response = stack.connect().exchange("/v1/chat/completions", CHAT, JSON)
    assert response.status == 502 and str(status) in response.error()["message"]
    assert not stack.gateway.active_calls and stack.processor.status()["tasks"] == 0
