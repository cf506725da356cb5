"""OpenTelemetry traces end to end (issue #26): real ``twistd infx`` gateways and a ``twistd infx-engine``
agent in front of the recording runtime, exporting over OTLP/HTTP to a receiver that decodes
``ExportTraceServiceRequest`` with the official ``opentelemetry-proto``.

- Through a peer: the client's request, with its ``traceparent``, reaches gateway A, which has no
  engine; A sends it to gateway B's engine. One trace, the client's, whose spans nest
  A's request -> A's route -> B's route -> the agent's task -> its runtime call, and the runtime's
  request carries a ``traceparent`` of that trace whose parent is the runtime call.
- By URL: one gateway serving the runtime itself nests the same spans, minus the agent process.
- Off (the default): nothing is added to the runtime's request, a client's own ``traceparent``
  still reaches it verbatim, and a gateway that served a request has loaded no opentelemetry module.
- The option without the ``otel`` extra: one line naming the extra, exit 2.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from harness.otlp_receiver import OtlpReceiver, ReceivedSpan
from harness.recording_runtime import Answer, RecordingRuntime
from harness.twistd_processes import Engine, Gateway, wait_until
from infx.cli import EXIT_USAGE
from protocol.tracing.traceparent import parse_traceparent

ROOT = Path(__file__).resolve().parents[2]
TWISTD = str(Path(sys.executable).with_name("twistd"))

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{CLIENT_SPAN}-01"
PROMPT = "the secret prompt text"
COMPLETION = "the secret completion text"
ANSWER = Answer(body=json.dumps({
    "id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": "m",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": COMPLETION}, "finish_reason": "stop"}],
    "usage": {"prompt_tokens": 4, "completion_tokens": 4, "total_tokens": 8}}).encode())
MESSAGES = [{"role": "user", "content": PROMPT}]
#: The spans of one request to a runtime by URL.
BY_URL = ["infx.request", "infx.queue", "infx.route", "infx.agent.task", "infx.runtime.call"]


def tracing(receiver: OtlpReceiver) -> list[str]:
    return ["--otlp-traces-endpoint", receiver.url]


def ask(gateway: Gateway, headers: dict[str, str]) -> None:
    client = openai.OpenAI(base_url=gateway.base_url, api_key="x", max_retries=0, timeout=30)
    answer = client.chat.completions.create(model="m", messages=MESSAGES, extra_headers=headers)
    assert answer.choices[0].message.content == COMPLETION


def spans_of_trace(receiver: OtlpReceiver, expected: list[str], children: list) -> dict[str, ReceivedSpan]:
    """The spans received by name, once every span named in ``expected`` has come (each process
    exports on its own schedule); then no more than those came."""
    def arrived() -> list[ReceivedSpan] | None:
        spans = receiver.spans()
        names = [s.name for s in spans]
        return spans if all(names.count(name) >= expected.count(name) for name in expected) else None

    spans: list[ReceivedSpan] = wait_until(arrived, f"the spans {expected}", children, timeout=60)
    assert sorted(s.name for s in spans) == sorted(expected)
    return {span.name: span for span in spans}


def child_of(span: ReceivedSpan, parent: ReceivedSpan) -> bool:
    return span.trace_id == parent.trace_id and span.parent_span_id == parent.span_id


def no_content(spans: list[ReceivedSpan]) -> None:
    """No attribute of any span carries the prompt or the completion."""
    text = json.dumps([s.attributes for s in spans])
    assert PROMPT not in text and COMPLETION not in text


@pytest.fixture(scope="module")
def receiver() -> Iterator[OtlpReceiver]:
    receiver = OtlpReceiver()
    yield receiver
    receiver.stop()


@pytest.fixture(scope="module")
def runtime(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RecordingRuntime]:
    runtime = RecordingRuntime(tmp_path_factory.mktemp("tracing-runtime"))
    yield runtime
    runtime.stop()


@pytest.fixture(autouse=True)
def fresh(receiver: OtlpReceiver, runtime: RecordingRuntime) -> None:
    receiver.reset()
    runtime.reset()


def test_one_trace_nests_gateway_peer_gateway_agent_and_runtime_call_under_the_clients_span(
        tmp_path: Path, receiver: OtlpReceiver, runtime: RecordingRuntime) -> None:
    a = b = engine = None
    try:
        a = Gateway(tmp_path, name="gateway-a", extra=["--status-interval", "0.2", *tracing(receiver)])
        b = Gateway(tmp_path, name="gateway-b",
                    extra=["--peers", f"127.0.0.1:{a.internal_port}", "--status-interval", "0.2", *tracing(receiver)])
        engine = Engine(tmp_path, b, "engine-on-b", ["m"], runtime="openai", upstream=runtime.url,
                        extra=tracing(receiver))
        a.wait_for_engine(b.remote_engine_id("engine-on-b"), children=[b.child, engine.child])
        runtime.script(ANSWER)
        ask(a, {"traceparent": TRACEPARENT, "tracestate": "vendor=kept", "x-request-id": "traced-1"})
        children = [a.child, b.child, engine.child]
        # ONE trace: the client's; every span in it once (routed once, on each gateway).
        by_name = spans_of_trace(receiver, ["infx.request", "infx.queue", "infx.route", "infx.route",
                                            "infx.agent.task", "infx.runtime.call"], children)
        spans = receiver.spans()
        assert {s.trace_id for s in spans} == {TRACE_ID}
        request = by_name["infx.request"]
        assert request.parent_span_id == CLIENT_SPAN and request.resource["service.instance.id"] == a.pod_name
        assert request.attributes["infx.request_id"] == "traced-1"
        assert request.attributes["gen_ai.request.model"] == "m"
        assert request.attributes["infx.tenant"] == "default"
        assert request.attributes["http.response.status_code"] == 200
        assert child_of(by_name["infx.queue"], request)
        routes = {s.attributes["infx.gateway"]: s for s in spans if s.name == "infx.route"}
        route_a, route_b = routes[a.pod_name], routes[b.pod_name]
        assert child_of(route_a, request) and child_of(route_b, route_a)
        assert route_a.attributes["infx.engine.locality"] == "remote"
        assert route_a.attributes["infx.engine.gateway"] == b.pod_name
        assert route_a.attributes["infx.engine_id"] == b.remote_engine_id("engine-on-b")
        assert route_b.attributes["infx.engine.locality"] == "local"
        assert route_b.attributes["infx.engine_id"] == "engine-on-b"
        # A chose B's engine by its policy; B runs the task on the engine A named.
        assert route_a.attributes["infx.routing.policy"] == "affinity"
        assert route_a.attributes["infx.routing.reason"] == "home" and route_a.attributes["infx.routing.candidates"] == 1
        assert isinstance(route_a.attributes["infx.routing.score"], float)
        assert route_a.attributes["infx.routing.decision"] == "home"
        assert route_b.attributes["infx.routing.policy"] == "targeted"
        assert route_b.attributes["infx.routing.reason"] == "named by the gateway that forwarded it"
        assert "infx.routing.decision" not in route_b.attributes
        agent = by_name["infx.agent.task"]
        assert child_of(agent, route_b) and agent.service == "infx-engine"
        call = by_name["infx.runtime.call"]
        assert child_of(call, agent) and call.attributes["http.response.status_code"] == 200
        assert call.attributes["url.full"] == runtime.url

        # The runtime's request joins the trace under the runtime call, the caller's tracestate kept.
        (received,) = runtime.requests()
        parent = parse_traceparent([received.header("traceparent") or ""])
        assert parent is not None and parent.sampled
        assert (f"{parent.trace_id:032x}", f"{parent.span_id:016x}") == (TRACE_ID, call.span_id)
        assert received.header("tracestate") == "vendor=kept"
        no_content(spans)
    finally:
        for child in (engine, b, a):
            if child is not None:
                child.stop()


def test_by_url_the_same_spans_nest_without_the_agent_process_errors_carry_the_clients_cause_and_bad_headers_start_anew(
        tmp_path: Path, receiver: OtlpReceiver, runtime: RecordingRuntime) -> None:
    gateway = Gateway(tmp_path, extra=["--runtime-url", f"{runtime.url}=m", *tracing(receiver)])
    try:
        gateway.wait_for_engine(gateway.runtime_engine_id(runtime.url.removeprefix("http://")))
        runtime.script(ANSWER)
        ask(gateway, {"traceparent": TRACEPARENT})
        by_name = spans_of_trace(receiver, BY_URL, [gateway.child])
        spans = receiver.spans()
        assert {s.trace_id for s in spans} == {TRACE_ID}
        assert {s.service for s in spans} == {"infx-gateway"}
        request, route = by_name["infx.request"], by_name["infx.route"]
        agent, call = by_name["infx.agent.task"], by_name["infx.runtime.call"]
        assert request.parent_span_id == CLIENT_SPAN
        assert child_of(route, request) and child_of(agent, route) and child_of(call, agent)
        assert route.attributes["infx.engine.locality"] == "local"
        (received,) = runtime.requests()
        parent = parse_traceparent([received.header("traceparent") or ""])
        assert parent is not None and f"{parent.span_id:016x}" == call.span_id
        no_content(spans)

        # An error: the spans' status is an error with the cause the client reads.
        receiver.reset()
        runtime.reset()
        overloaded = b'{"error": {"message": "the runtime is overloaded", "code": 400}}'
        runtime.script(Answer(status=400, reason="Bad Request", body=overloaded))
        client = openai.OpenAI(base_url=gateway.base_url, api_key="x", max_retries=0, timeout=30)
        with pytest.raises(openai.BadRequestError) as raised:
            client.chat.completions.create(model="m", messages=MESSAGES)
        assert raised.value.body["message"] == "the runtime is overloaded"  # type: ignore[index]
        by_name = spans_of_trace(receiver, BY_URL, [gateway.child])
        # No traceparent from the client: a new trace, its own.
        assert {s.trace_id for s in receiver.spans()} != {TRACE_ID}
        for name in ("infx.request", "infx.agent.task", "infx.runtime.call"):
            span = by_name[name]
            assert (span.status_code, span.status_message) == (2, "the runtime is overloaded"), name
        assert by_name["infx.request"].attributes["http.response.status_code"] == 400

        # A malformed traceparent is no error: the request is served, in a trace of its own.
        receiver.reset()
        runtime.reset()
        runtime.script(ANSWER)
        ask(gateway, {"traceparent": f"00-{TRACE_ID.upper()}-{CLIENT_SPAN}-01"})
        by_name = spans_of_trace(receiver, BY_URL, [gateway.child])
        assert by_name["infx.request"].parent_span_id == "" and by_name["infx.request"].trace_id != TRACE_ID
        (received,) = runtime.requests()
        assert parse_traceparent([received.header("traceparent") or ""]).span_id == int(
            by_name["infx.runtime.call"].span_id, 16)
    finally:
        gateway.stop()


def test_with_trace_content_the_request_span_carries_the_prompt_and_the_answer(
        tmp_path: Path, receiver: OtlpReceiver, runtime: RecordingRuntime) -> None:
    gateway = Gateway(tmp_path, extra=["--runtime-url", f"{runtime.url}=m", "--trace-content", *tracing(receiver)])
    try:
        gateway.wait_for_engine(gateway.runtime_engine_id(runtime.url.removeprefix("http://")))
        runtime.script(ANSWER)
        ask(gateway, {})
        request = spans_of_trace(receiver, BY_URL, [gateway.child])["infx.request"]
        assert PROMPT in request.attributes["infx.request.body"]
        assert COMPLETION in request.attributes["infx.response.body"]
    finally:
        gateway.stop()


def test_with_tracing_off_the_runtime_gets_no_traceparent_but_the_clients_own_verbatim(
        tmp_path: Path, runtime: RecordingRuntime) -> None:
    gateway = Gateway(tmp_path, extra=["--runtime-url", f"{runtime.url}=m"])
    try:
        gateway.wait_for_engine(gateway.runtime_engine_id(runtime.url.removeprefix("http://")))
        runtime.script(ANSWER, ANSWER)
        ask(gateway, {})
        ask(gateway, {"traceparent": TRACEPARENT, "tracestate": "vendor=kept"})
        first, second = runtime.requests()
        assert first.header("traceparent") is None and first.header("tracestate") is None
        assert (second.header("traceparent"), second.header("tracestate")) == (TRACEPARENT, "vendor=kept")
    finally:
        gateway.stop()


#: A gateway (the service twistd builds) started in this child, one request served by its echo engine;
#: then the opentelemetry modules it imported are printed.
_SERVE_ONE = textwrap.dedent("""
    import json, sys
    from twisted.internet import reactor, task
    from twisted.web.client import Agent, readBody
    from twisted.web.http_headers import Headers
    from twisted.internet.defer import ensureDeferred
    from infx.service import GatewayService
    from infx.tap import GatewayOptions, makeService

    options = GatewayOptions()
    options.parseOptions(["--http", "tcp:0:interface=127.0.0.1", "--worker-grpc", "tcp:0:interface=127.0.0.1",
                          "--internal-grpc", "tcp:0:interface=127.0.0.1", "--echo-models", "echo",
                          "--workers", "1"])
    service = makeService(options)
    service.startService()

    def gateway_in(top):
        # The GatewayService, wherever twistd's wrappers (ExitIfCannotListen, TextLog) put it.
        if isinstance(top, GatewayService):
            return top
        return next(filter(None, map(gateway_in, getattr(top, "services", []))), None)

    async def main():
        gateway = gateway_in(service)
        while not gateway.gateway.ready or not gateway.dispatcher.models("default"):
            await task.deferLater(reactor, 0.05)
        port = gateway.http.port.getHost().port
        body = json.dumps({"model": "echo", "messages": [{"role": "user", "content": "hi"}]}).encode()
        from twisted.web.client import FileBodyProducer
        from io import BytesIO
        answer = await Agent(reactor).request(
            b"POST", f"http://127.0.0.1:{port}/v1/chat/completions".encode(),
            Headers({b"content-type": [b"application/json"],
                     b"traceparent": [b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"]}),
            FileBodyProducer(BytesIO(body)))
        await readBody(answer)
        print(json.dumps({"status": answer.code,
                          "otel": sorted(m for m in sys.modules if m.split(".")[0] == "opentelemetry")}))

    def done(result):
        reactor.stop()
        return result

    reactor.callWhenRunning(lambda: ensureDeferred(main()).addBoth(done))
    reactor.run()
""")


def test_a_gateway_without_tracing_serves_requests_without_loading_any_opentelemetry_module() -> None:
    result = subprocess.run([sys.executable, "-c", _SERVE_ONE], capture_output=True, text=True, cwd=ROOT,
                            timeout=120)
    lines = [line for line in result.stdout.splitlines() if line.startswith("{")]
    assert lines, result.stdout + result.stderr
    assert json.loads(lines[-1]) == {"status": 200, "otel": []}


@pytest.mark.parametrize("command", [
    ["infx", "--http", "tcp:0", "--worker-grpc", "tcp:0", "--internal-grpc", "tcp:0"],
    ["infx-engine", "--server", "127.0.0.1:1", "--models", "m"],
])
def test_tracing_without_the_otel_extra_is_refused_at_start_with_one_line_naming_it(tmp_path, command):
    # A package of that name that has none of the SDK in it: as if the extra were not installed.
    (tmp_path / "opentelemetry").mkdir()
    (tmp_path / "opentelemetry" / "__init__.py").write_text("")
    env = {"PYTHONPATH": f"{tmp_path}:{ROOT}", "PATH": str(Path(sys.executable).parent)}
    result = subprocess.run([TWISTD, "-n", "--pidfile=", *command, "--otlp-traces-endpoint", "http://127.0.0.1:4318"],
                            capture_output=True, text=True, cwd=ROOT, env=env, timeout=60)
    assert result.returncode == EXIT_USAGE, result.stdout + result.stderr
    (line,) = result.stderr.splitlines()
    assert "--otlp-traces-endpoint needs the otel extra: pip install 'infx[otel]'" in line
