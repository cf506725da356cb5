"""Runtimes by URL in one process: the gateway with ``runtime_url`` in front of a twisted.web runtime on
loopback, driven by the official openai client. The engine agent runs inside the gateway; no engine
dials the worker port."""

from __future__ import annotations

import json
from typing import Any

import openai
import pytest
import pytest_twisted
from twisted.internet import defer, reactor, task, threads
from twisted.web import resource, server

from infx.agent.engine import EngineAgent, GrpcLinks
from infx.agent.runtimes import EchoRuntime
from infx.config import build_config
from infx.gateway.runtime_engines import runtime_engine_id
from infx.service import build_gateway
from infx.transport import GrpcChannel, client_endpoint
from protocol.agent.core import EngineAgentCore
from protocol.agent.effects import AgentConfig
from protocol.agent.echo import EchoConfig


class Runtime(resource.Resource):
    """An OpenAI-compatible runtime: /health, /v1/models, chat (``hang`` never answers, ``slow`` streams
    an event every 10 ms until the client goes)."""

    isLeaf = True

    def __init__(self, models: tuple[str, ...] = ("m",)) -> None:
        super().__init__()
        self.models = models
        self.healthy = True
        self.chats: list[dict[str, Any]] = []
        self.headers: list[dict[bytes, list[bytes]]] = []
        self.lost: defer.Deferred[None] = defer.Deferred()
        #: What /metrics answers (None: 404).
        self.metrics: bytes | None = None

    def render_GET(self, request: server.Request) -> bytes:
        if request.path == b"/metrics" and self.metrics is not None:
            request.setHeader(b"content-type", b"text/plain; version=0.0.4")
            return self.metrics
        if request.path == b"/health":
            request.setResponseCode(200 if self.healthy else 503)
            return b"{}"
        if request.path == b"/v1/models":
            request.setHeader(b"content-type", b"application/json")
            return json.dumps({"object": "list", "data": [{"id": m, "object": "model"} for m in self.models]}).encode()
        request.setResponseCode(404)
        return b"{}"

    def render_POST(self, request: server.Request) -> bytes | int:
        body = json.loads(request.content.read())
        self.chats.append(body)
        self.headers.append(dict(request.requestHeaders.getAllRawHeaders()))
        text = body["messages"][-1]["content"]
        if text == "hang":
            request.notifyFinish().addBoth(lambda _: self.lost.callback(None))
            return server.NOT_DONE_YET
        if not body.get("stream"):
            request.setHeader(b"content-type", b"application/json")
            return json.dumps({"id": "c1", "object": "chat.completion", "created": 1, "model": body["model"],
                               "choices": [{"index": 0, "message": {"role": "assistant", "content": f"runtime: {text}"},
                                            "finish_reason": "stop"}]}).encode()
        request.setHeader(b"content-type", b"text/event-stream")

        def event(content: str) -> bytes:
            return b"data: " + json.dumps({"id": "c1", "object": "chat.completion.chunk", "created": 1,
                                           "model": body["model"], "choices": [{"index": 0, "delta": {"content": content},
                                                                                "finish_reason": None}]}).encode() + b"\n\n"

        if text == "slow":
            request.notifyFinish().addBoth(lambda _: self.lost.callback(None))
            ticker = task.LoopingCall(lambda: request.write(event("x")))
            request.notifyFinish().addBoth(lambda _: ticker.stop())
            ticker.start(0.01)
            return server.NOT_DONE_YET
        for word in text.split():
            request.write(event(word + " "))
        request.write(b"data: [DONE]\n\n")
        request.finish()
        return server.NOT_DONE_YET


@pytest.fixture
def stack():
    started: list[Any] = []

    @pytest_twisted.inlineCallbacks
    def start(runtime: Runtime | None = None, models: str = "", **options: Any):
        runtime = runtime or Runtime()
        port = reactor.listenTCP(0, server.Site(runtime), interface="127.0.0.1")
        started.append(port)
        url = f"http://127.0.0.1:{port.getHost().port}" + (f"={models}" if models else "")
        config = build_config({}, {"http": "tcp:0:interface=127.0.0.1", "worker_grpc": "tcp:0:interface=127.0.0.1",
                                   "internal_grpc": "tcp:0:interface=127.0.0.1", "runtime_url": [url],
                                   "grace_period": 5, **options})
        gateway = build_gateway(reactor, config)
        yield gateway.startService()
        started.append(gateway)
        return runtime, gateway, port.getHost().port

    yield start
    for item in reversed(started):
        if hasattr(item, "stopListening"):
            pytest_twisted.blockon(defer.maybeDeferred(item.stopListening))
        elif item.running:
            pytest_twisted.blockon(item.stopService())


def base_url(gateway: Any) -> str:
    return f"http://127.0.0.1:{gateway.http.port.getHost().port}/v1"


@defer.inlineCallbacks
def until(predicate: Any, what: str) -> Any:
    for _ in range(500):
        value = predicate()
        if value:
            return value
        yield task.deferLater(reactor, 0.01, lambda: None)
    raise AssertionError(f"timed out waiting for {what}")


def engine_ready(gateway: Any, engine_id: str) -> bool:
    engine = gateway.dispatcher.status()["tenants"].get("default", {}).get("engines", {}).get(engine_id)
    return bool(engine and engine["ready"] and engine["models"] and all(m["ready"] for m in engine["models"]))


def client(gateway: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url(gateway), api_key="x", max_retries=0, timeout=10)


@pytest_twisted.inlineCallbacks
def test_a_runtime_by_url_is_a_local_engine_of_the_models_it_lists_and_serves_chat(stack):
    runtime, gateway, port = yield stack(Runtime(models=("alpha", "beta")))
    engine_id = runtime_engine_id(f"127.0.0.1:{port}", gateway.pod_name)
    yield until(lambda: engine_ready(gateway, engine_id), "the runtime's engine")
    engine = gateway.dispatcher.status()["tenants"]["default"]["engines"][engine_id]
    assert engine["locality"] == "local" and [m["id"] for m in engine["models"]] == ["alpha", "beta"]

    def ask() -> tuple[str, str]:
        answer = client(gateway).chat.completions.create(model="beta", messages=[{"role": "user", "content": "hi"}])
        streamed = client(gateway).chat.completions.create(model="alpha", stream=True,
                                                           messages=[{"role": "user", "content": "one two"}])
        return answer.choices[0].message.content or "", "".join(c.choices[0].delta.content or "" for c in streamed)

    assert (yield threads.deferToThread(ask)) == ("runtime: hi", "one two ")
    assert [c["model"] for c in runtime.chats] == ["beta", "alpha"]
    assert runtime.headers[0][b"X-Request-Id"], "the gateway names the request for the runtime"
    assert not gateway.workers.streams, "no engine dialled the worker port: the agent runs in the gateway"
    yield until(lambda: gateway.dispatcher.status()["tasks"] == 0, "no task left")


@pytest_twisted.inlineCallbacks
def test_a_client_that_leaves_mid_stream_closes_the_runtimes_connection(stack):
    runtime, gateway, port = yield stack(models="m")
    yield until(lambda: gateway.dispatcher.models("default") == ["m"], "model m")

    def leave_after_two_events() -> None:
        stream = client(gateway).chat.completions.create(model="m", stream=True,
                                                         messages=[{"role": "user", "content": "slow"}])
        for i, _ in enumerate(stream):
            if i == 1:
                stream.close()
                return

    yield threads.deferToThread(leave_after_two_events)
    yield runtime.lost
    yield until(lambda: gateway.dispatcher.status()["tasks"] == 0, "the task to end")


@pytest_twisted.inlineCallbacks
def test_a_runtime_by_urls_load_readings_say_which_of_its_engines_tasks_they_include(stack):
    """Stamped as the agent's are, so that the gateway adds only the tasks it sent after the reading
    (an unstamped one counts again the tasks that ended between the reading and its report)."""
    runtime = Runtime()
    runtime.metrics = b'vllm:num_requests_running{model_name="m"} 1.0\nvllm:num_requests_waiting{model_name="m"} 0.0\n'
    runtime, gateway, port = yield stack(runtime, models="m")

    def stamped() -> Any:
        report, = gateway.dispatcher.processor.engine_reports("default")
        load = report.status.models[0].runtime_load
        return load if load.HasField("tasks_received") else None

    load = yield until(stamped, "a stamped load reading")
    assert (load.source, load.running_requests) == ("vllm", 1)


@pytest_twisted.inlineCallbacks
def test_a_runtime_that_stops_answering_its_health_check_has_its_models_unready(stack):
    runtime, gateway, port = yield stack(models="m")
    engine_id = runtime_engine_id(f"127.0.0.1:{port}", gateway.pod_name)
    yield until(lambda: engine_ready(gateway, engine_id), "the engine ready")
    engine = gateway.runtime_engines.engines[f"127.0.0.1:{port}"]
    runtime.healthy = False
    # Checked every 5 s while it answers: run one at once, as a failed task would.
    engine.runtime.on_unreachable[0]()
    yield until(lambda: not engine_ready(gateway, engine_id), "the engine not ready")
    assert gateway.dispatcher.models("default") == []
    runtime.healthy = True
    engine.runtime.on_unreachable[0]()
    yield until(lambda: engine_ready(gateway, engine_id), "the engine ready again")


@pytest_twisted.inlineCallbacks
def test_shutdown_waits_the_grace_period_for_a_request_in_flight_then_answers_it(stack):
    runtime, gateway, port = yield stack(models="m", grace_period=1)
    yield until(lambda: gateway.dispatcher.models("default") == ["m"], "model m")
    answer = threads.deferToThread(lambda: client(gateway).chat.completions.create(
        model="m", messages=[{"role": "user", "content": "hang"}]).choices[0].message.content)
    yield until(lambda: runtime.chats, "the request at the runtime")
    stopping = gateway.stopService()
    yield task.deferLater(reactor, 0.1, lambda: None)
    assert not stopping.called, "the gateway waits for the request in flight"
    with pytest.raises(openai.InternalServerError):
        yield answer  # the grace period ran out: the gateway answers 503 rather than drop it
    yield stopping
    yield runtime.lost


@pytest_twisted.inlineCallbacks
def test_a_runtime_by_url_and_a_dial_in_engine_serve_one_model_together(stack):
    runtime, gateway, port = yield stack(models="m", routing_policy="round_robin")
    worker = gateway.worker_grpc.port.getHost().port
    dial_in = EngineAgent(reactor, EngineAgentCore(AgentConfig(engine_id="dial-in", models=("m",))),
                          EchoRuntime(reactor, EchoConfig(token_delay=0.0)),
                          GrpcLinks(reactor, lambda: GrpcChannel(reactor, client_endpoint(reactor, "127.0.0.1", worker))),
                          grace=1)
    dial_in.startService()
    try:
        by_url = runtime_engine_id(f"127.0.0.1:{port}", gateway.pod_name)
        yield until(lambda: engine_ready(gateway, by_url) and engine_ready(gateway, "dial-in"), "both engines")

        def ask() -> list[str]:
            return [client(gateway).chat.completions.create(
                model="m", messages=[{"role": "user", "content": "who"}]).choices[0].message.content or ""
                for _ in range(4)]

        answers = yield threads.deferToThread(ask)
        assert sorted(answers) == ["runtime: who", "runtime: who", "who", "who"]
    finally:
        yield dial_in.stopService()


@pytest_twisted.inlineCallbacks
def test_a_runtime_pod_found_by_its_label_is_served_while_it_is_ready(tmp_path):
    """The kubernetes client against the test API server: a Ready pod labelled app=vllm is served at
    its IP and --runtime-port with the models of its infx.io/models annotation; once it terminates,
    its engine drains and leaves."""
    from harness.kubeapi import PODS, FakeKubeAPI, write_kubeconfig
    from infx.service import GatewayService

    api = FakeKubeAPI(reactor).start()
    runtime = Runtime(models=("listed",))
    port = reactor.listenTCP(0, server.Site(runtime), interface="127.0.0.1")
    config = build_config({}, {"http": "tcp:0:interface=127.0.0.1", "worker_grpc": "tcp:0:interface=127.0.0.1",
                               "internal_grpc": "tcp:0:interface=127.0.0.1", "runtime_pod_label": "app=vllm",
                               "runtime_port": port.getHost().port, "grace_period": 1})
    gateway = GatewayService(reactor, config, environ={
        "POD_NAME": "gw-0", "NAMESPACE": "default", "KUBECONFIG": str(write_kubeconfig(tmp_path / "kc", api.url))})
    try:
        yield gateway.startService()
        api.add_pod("other-0", labels={"app": "other"}, ip="127.0.0.1", phase="Running", ready=True)
        api.create(PODS, {"metadata": {"name": "vllm-0", "labels": {"app": "vllm"},
                                       "annotations": {"infx.io/models": "annotated"}},
                          "spec": {"containers": [{"name": "vllm", "image": "vllm:test"}]},
                          "status": {"phase": "Running", "podIP": "127.0.0.1",
                                     "conditions": [{"type": "Ready", "status": "True"}]}})
        engine_id = runtime_engine_id("vllm-0", "gw-0")
        yield until(lambda: engine_ready(gateway, engine_id), "the pod's runtime engine")
        assert gateway.dispatcher.models("default") == ["annotated"]
        answer = yield threads.deferToThread(lambda: client(gateway).chat.completions.create(
            model="annotated", messages=[{"role": "user", "content": "found"}]).choices[0].message.content)
        assert answer == "runtime: found"
        assert list(gateway.runtime_engines.engines) == ["vllm-0"], "other-0 is not labelled app=vllm"

        def annotate(pod: dict) -> None:
            pod["metadata"]["annotations"] = {"infx.io/models": "renamed"}

        # Served anew under the same engine id once the old engine drained its request in flight (for the
        # grace period): the new one is never refused as a clash with the old.
        def hang() -> None:
            with pytest.raises(openai.APIError):
                client(gateway).chat.completions.create(model="annotated", messages=[{"role": "user", "content": "hang"}])

        hanging = threads.deferToThread(hang)
        yield until(lambda: len(runtime.chats) == 2, "the request in flight")
        api.update(PODS, "vllm-0", annotate)
        yield until(lambda: gateway.dispatcher.models("default") == ["renamed"] and engine_ready(gateway, engine_id),
                    "the pod's runtime served with its new models")
        assert gateway.processor.counters.engine_id_clashes == 0
        yield hanging
        api.mark_terminating("vllm-0")
        yield until(lambda: engine_id not in gateway.dispatcher.status()["tenants"].get("default", {}).get(
            "engines", {}), "the engine to leave")
        assert gateway.runtime_engines.engines == {}
    finally:
        yield gateway.stopService()
        yield port.stopListening()
        yield api.stop()
