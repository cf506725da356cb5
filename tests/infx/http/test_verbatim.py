"""The gateway's side of the lossless path, over loopback with a scripted runner.

The request travels verbatim in the submission (path and query, body byte
for byte) and an answer marked verbatim reaches the client unchanged: status
and reason, headers, body, events, no ``[DONE]`` and no conversion of the
gateway's own.
"""

from __future__ import annotations

import http.client
import json

import pytest
import pytest_twisted
from prometheus_client import CollectorRegistry
from twisted.internet import reactor, threads
from twisted.internet.endpoints import TCP4ServerEndpoint
from twisted.web import resource

from infx.gateway.metrics import GatewayMetrics
from infx.gateway.tasks import Availability
from infx.http.api import HttpApi
from infx.http.resources import build_resource
from infx.http.site import GatewaySite
from protocol.openai import task_forms
from protocol.pb import chat_pb2, worker_pb2


def runtime_response(status: int, phrase: str, body: bytes = b"", **headers: str) -> worker_pb2.HttpResponse:
    response = worker_pb2.HttpResponse(status_code=status, status=f"{status} {phrase}", body=body)
    for name, value in headers.items():
        response.header[name.replace("_", "-")].values.append(value)
    return response


class VerbatimRunner:
    """Answers with the runtime answer a test put in ``answers`` (by model), marked verbatim."""

    def __init__(self, takes_http_request: bool = True, verbatim: bool = True, only_verbatim: bool = False) -> None:
        self.submissions = []
        self.answers = {}
        self._takes = takes_http_request
        self._verbatim = verbatim
        self._only_verbatim = only_verbatim  # every engine takes the verbatim form: no typed form wanted

    def availability(self, tenant, model):
        return Availability.SERVED

    def takes_http_request(self, tenant, model):
        return self._takes

    def typed_form_wanted(self, tenant, model):
        return not self._only_verbatim

    def models(self, tenant):
        return ["m"]

    def status(self, tenant=None):
        return {}

    def submit(self, submission, sink):
        self.submissions.append(submission)
        response, events = self.answers.get(submission.model, (runtime_response(200, "OK", b"{}"), None))

        def answer():
            sink.response_received(response, verbatim=self._verbatim)
            for event in events or ():
                sink.event_received(event)
            sink.completed()

        reactor.callLater(0, answer)

        class Handle:
            served_by = None

            def cancel(self):
                pass

            def consumed(self, count):
                pass

        return Handle()


@pytest.fixture
def start():
    ports = []

    def start(runner, mount: bytes | None = None):
        gateway = HttpApi(runner, reactor, GatewayMetrics(CollectorRegistry()))
        gateway.listening = True
        root = build_resource(gateway)
        if mount is not None:
            outer = resource.Resource()
            outer.putChild(mount, root)
            root = outer
        site = GatewaySite(root, max_body_size=1 << 20)
        d = TCP4ServerEndpoint(reactor, 0, interface="127.0.0.1").listen(site)
        return d.addCallback(lambda port: ports.append(port) or port.getHost().port)

    yield start
    for port in ports:
        port.stopListening()


def post(port: int, path: str, body: bytes, content_type: str = "application/json"):
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    connection.request("POST", path, body, {"Content-Type": content_type})
    response = connection.getresponse()
    data = response.read()
    connection.close()
    return response.status, response.reason, {k.lower(): v for k, v in response.getheaders()}, data


@pytest_twisted.inlineCallbacks
def test_the_submission_carries_the_clients_path_query_and_body_byte_for_byte(start):
    runner = VerbatimRunner()
    port = yield start(runner)
    body = b'{"model": "m",  "messages": [], "seed": 0, "top_k": 5, "x": 1e400}'
    yield threads.deferToThread(post, port, "/v1/chat/completions?api-version=1", body)
    verbatim = runner.submissions[0].request.http_request
    assert (verbatim.method, verbatim.path, verbatim.body) == ("POST", "/v1/chat/completions?api-version=1", body)


@pytest_twisted.inlineCallbacks
def test_a_gateway_mounted_under_a_prefix_sends_the_runtime_the_api_path_alone(start):
    runner = VerbatimRunner()
    port = yield start(runner, mount=b"llm")
    yield threads.deferToThread(post, port, "/llm/v1/embeddings?a=b", b'{"model":"m","input":"x"}')
    assert runner.submissions[0].request.http_request.path == "/v1/embeddings?a=b"


@pytest_twisted.inlineCallbacks
def test_tokenize_goes_to_the_runtimes_root_path(start):
    runner = VerbatimRunner()
    port = yield start(runner)
    yield threads.deferToThread(post, port, "/v1/tokenize", b'{"model":"m","prompt":"hi"}')
    assert runner.submissions[0].request.http_request.path == "/tokenize"


@pytest_twisted.inlineCallbacks
def test_a_request_the_typed_form_refuses_goes_on_for_an_engine_that_takes_it_verbatim(start):
    runner = VerbatimRunner(takes_http_request=True)
    port = yield start(runner)
    body = b'{"model":"m","prompt":"hi","echo":true,"logprobs":3}'
    status, _, _, _ = yield threads.deferToThread(post, port, "/v1/completions", body)
    assert status == 200
    request = runner.submissions[0].request
    assert "echo" in request.typed_request_incomplete and request.http_request.body == body


@pytest_twisted.inlineCallbacks
def test_no_typed_form_is_built_when_every_engine_takes_the_verbatim_one(start):
    runner = VerbatimRunner(only_verbatim=True)
    port = yield start(runner)
    body = b'{"model":"m","messages":[{"role":"user","content":"hi"}],"stream":true,"seed":3}'
    status, _, _, _ = yield threads.deferToThread(post, port, "/v1/chat/completions", body)
    assert status == 200
    request = runner.submissions[0].request
    assert request.typed_request_incomplete == task_forms.ROUTING_FIELDS_ONLY
    assert request.chat_completion == chat_pb2.CreateChatCompletionRequest(model="m", stream=True)
    assert request.http_request.body == body and runner.submissions[0].streaming


@pytest_twisted.inlineCallbacks
def test_the_same_request_is_refused_with_the_typed_forms_400_when_no_engine_takes_it_verbatim(start):
    runner = VerbatimRunner(takes_http_request=False)
    port = yield start(runner)
    status, _, _, body = yield threads.deferToThread(
        post, port, "/v1/completions", b'{"model":"m","prompt":"hi","echo":true}')
    assert status == 400 and json.loads(body)["error"]["param"] == "echo"
    assert not runner.submissions


@pytest_twisted.inlineCallbacks
def test_the_gateway_still_refuses_what_it_cannot_route_or_relay(start):
    runner = VerbatimRunner()
    port = yield start(runner)
    for body in (b"{not json", b'{"messages": []}', b'{"model": "m", "stream": "yes"}'):
        status, _, _, _ = yield threads.deferToThread(post, port, "/v1/chat/completions", body)
        assert status == 400, body
    assert not runner.submissions


@pytest_twisted.inlineCallbacks
def test_a_runtime_error_reaches_the_client_with_its_status_reason_headers_and_body_unchanged(start):
    runner = VerbatimRunner()
    body = b'{"object":"error","message":"slow down","code":429}'
    runner.answers["m"] = (runtime_response(429, "Slow Down", body, Content_Type="application/json",
                                            Retry_After="7", x_ratelimit_remaining_requests="0"), None)
    port = yield start(runner)
    status, reason, headers, data = yield threads.deferToThread(
        post, port, "/v1/chat/completions", b'{"model":"m","messages":[]}')
    assert (status, reason, data) == (429, "Slow Down", body)
    assert headers["retry-after"] == "7" and headers["x-ratelimit-remaining-requests"] == "0"
    assert headers["content-type"] == "application/json"


@pytest_twisted.inlineCallbacks
def test_an_answer_without_a_content_type_gets_none_from_the_gateway(start):
    runner = VerbatimRunner()
    runner.answers["m"] = (runtime_response(200, "OK", b"plain"), None)
    port = yield start(runner)
    _, _, headers, data = yield threads.deferToThread(post, port, "/v1/embeddings", b'{"model":"m","input":"x"}')
    assert data == b"plain" and "content-type" not in headers


@pytest_twisted.inlineCallbacks
def test_a_verbatim_stream_gets_no_done_and_no_headers_of_the_gateways(start):
    runner = VerbatimRunner()
    events = [b"event: response.created\ndata: {}\n\n", b"event: response.completed\ndata: {}\n\n"]
    runner.answers["m"] = (runtime_response(200, "OK", Content_Type="text/event-stream"), events)
    port = yield start(runner)
    _, _, headers, data = yield threads.deferToThread(
        post, port, "/v1/responses", b'{"model":"m","input":"hi","stream":true}')
    assert data == b"".join(events)
    assert "cache-control" not in headers and "x-accel-buffering" not in headers


@pytest_twisted.inlineCallbacks
def test_a_verbatim_completions_answer_is_not_converted(start):
    runner = VerbatimRunner()
    body = b'{"object":"text_completion","choices":[{"text":"x","index":0,"stop_reason":null}]}'
    runner.answers["m"] = (runtime_response(200, "OK", body, Content_Type="application/json"), None)
    port = yield start(runner)
    _, _, _, data = yield threads.deferToThread(post, port, "/v1/completions", b'{"model":"m","prompt":"hi"}')
    assert data == body


@pytest_twisted.inlineCallbacks
def test_a_llmariner_engines_responses_stream_gets_no_done_but_its_chat_stream_does(start):
    runner = VerbatimRunner(verbatim=False)
    events = [b'event: response.created\ndata: {"type":"response.created"}\n\n']
    runner.answers["m"] = (runtime_response(200, "OK", Content_Type="text/event-stream"), events)
    port = yield start(runner)
    _, _, _, data = yield threads.deferToThread(
        post, port, "/v1/responses", b'{"model":"m","input":"hi","stream":true}')
    assert data == events[0]
    runner.answers["m"] = (runtime_response(200, "OK", Content_Type="text/event-stream"), [b'data: {"choices":[]}\n\n'])
    _, _, _, data = yield threads.deferToThread(
        post, port, "/v1/chat/completions", b'{"model":"m","messages":[{"role":"user","content":"x"}],"stream":true}')
    assert data.endswith(b"data: [DONE]\n\n")
