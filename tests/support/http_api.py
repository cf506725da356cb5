"""The HTTP API on a loopback port in front of a scripted task runner, and plain HTTP and openai clients for it."""

from __future__ import annotations

import json

import openai
import pytest
from prometheus_client import CollectorRegistry
from twisted.internet import reactor
from twisted.internet.endpoints import TCP4ServerEndpoint

from infx.gateway.metrics import GatewayMetrics
from infx.gateway.tasks import Availability
from infx.http.api import HttpApi
from infx.http.resources import build_resource
from infx.http.lean import LeanSite
from infx.http.site import GatewaySite
from protocol.pb import worker_pb2


def chat_body(text: str, model: str = "m") -> bytes:
    return json.dumps({
        "id": "c1", "object": "chat.completion", "created": 1, "model": model,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
    }).encode()


def chunk_event(text: str, finish: str | None = None) -> bytes:
    chunk = {"id": "c1", "object": "chat.completion.chunk", "created": 1, "model": "m",
             "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": finish}]}
    return b"data: " + json.dumps(chunk).encode() + b"\n\n"


class ScriptedRunner:
    """Answers each task from a script keyed by model; records submissions and cancellations."""

    def __init__(self):
        self.submissions = []
        self.cancelled = []
        self.consumed = 0
        self.sinks = []

    def availability(self, tenant, model):
        return {"unknown": Availability.UNKNOWN, "gone": Availability.GONE}.get(model, Availability.SERVED)

    def models(self, tenant):
        return ["m", "m2"]

    def takes_http_request(self, tenant, model):
        return False

    def typed_form_wanted(self, tenant, model):
        return True

    def status(self, tenant=None):
        return {"tasks": len(self.sinks)}

    def submit(self, submission, sink):
        self.submissions.append(submission)
        self.sinks.append(sink)
        runner = self

        class Handle:
            served_by = None

            def cancel(self):
                runner.cancelled.append(submission)

            def consumed(self, count):
                runner.consumed += count

        script = getattr(self, "script_" + submission.model.replace("-", "_"), None)
        if script is not None:
            reactor.callLater(0, script, submission, sink)
        return Handle()

    def script_m(self, submission, sink):
        ok = worker_pb2.HttpResponse(status_code=200, header={"Content-Type": worker_pb2.HeaderValue(values=["application/json"])})
        kind = submission.request.WhichOneof("request")
        if kind == "embedding":
            ok.body = json.dumps({"object": "list", "model": "m", "data": [
                {"object": "embedding", "index": 0, "embedding": [0.5, 0.25]}],
                "usage": {"prompt_tokens": 1, "total_tokens": 1}}).encode()
            sink.response_received(ok)
            sink.completed()
            return
        if not submission.streaming:
            ok.body = chat_body("hello there")
            sink.response_received(ok)
            sink.completed()
            return
        sink.response_received(ok)
        for word in ("hello", " there"):
            sink.event_received(chunk_event(word))
        sink.event_received(chunk_event("", "stop"))
        sink.completed()

    def script_busy(self, submission, sink):
        sink.failed(503, "no engine became available in time", 7.0)

    def script_slow(self, submission, sink):
        sink.failed(504, "deadline exceeded", None)

    def script_midstream(self, submission, sink):
        sink.response_received(worker_pb2.HttpResponse(status_code=200))
        sink.event_received(chunk_event("partial"))
        sink.failed(502, "engine vanished mid-stream", None)

    def script_origin_down(self, submission, sink):
        sink.response_received(worker_pb2.HttpResponse(status_code=522, status="522", body=b""))
        sink.completed()

    def script_odd_verbatim(self, submission, sink):
        sink.response_received(worker_pb2.HttpResponse(status_code=599, status="599", body=b"{}"), verbatim=True)
        sink.completed()

    def script_teapot(self, submission, sink):
        sink.response_received(worker_pb2.HttpResponse(
            status_code=400, body=b'{"error": {"message": "bad prompt", "type": "invalid_request_error"}}'))
        sink.completed()


#: The two servers of the same resource tree: twisted.web's site, and the httptools one of
#: ``twistd infx``'s own port. Every test of the API runs against both.
SITES = {"twisted": GatewaySite, "httptools": LeanSite}


@pytest.fixture(params=sorted(SITES))
def gateway_factory(request):
    ports = []
    site_class = SITES[request.param]

    def start(runner=None, keys=None, max_body_size=1 << 20, max_buffered=1 << 20):
        runner = runner or ScriptedRunner()
        metrics = GatewayMetrics(CollectorRegistry())
        gateway = HttpApi(runner, reactor, metrics, keys, max_buffered_bytes=max_buffered)
        gateway.listening = True
        site = site_class(build_resource(gateway), max_body_size=max_body_size)
        d = TCP4ServerEndpoint(reactor, 0, interface="127.0.0.1").listen(site)

        def listening(port):
            ports.append(port)
            base = f"http://127.0.0.1:{port.getHost().port}"
            return runner, gateway, base

        return d.addCallback(listening)

    yield start
    for port in ports:
        port.stopListening()


def client(base, key="none"):
    return openai.OpenAI(base_url=base + "/v1", api_key=key, max_retries=0, timeout=10)


def raw(base, method, path, body=b"", headers=None):
    """A plain HTTP/1.1 exchange, for requests the openai client will not make."""
    import http.client

    host, port = base.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    conn.request(method, path, body=body, headers=headers or {})
    response = conn.getresponse()
    data = response.read()
    conn.close()
    return response.status, {k.lower(): v for k, v in response.getheaders()}, data
