"""infx/tracing with the SDK's in-memory exporter: trace context in and out of headers, the request's
spans, routing spans, the agent's spans, sampling; and the OTLP/gRPC exporter against a grpcio collector."""

from __future__ import annotations

import json
from concurrent import futures

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
from opentelemetry.trace import StatusCode
from twisted.internet.task import Clock

from infx.agent.runtimes import EchoRuntime, event_result
from infx.tracing import TracingConfig, start_tracing, tracing_problem
from infx.tracing.runtime import TracedRuntime
from infx.tracing.spans import MAX_CONTENT_BYTES, Tracing
from protocol.agent.echo import EchoConfig
from protocol.pb import worker_pb2
from protocol.processor.effects import SendTask
from protocol.processor.keys import EngineKey, Locality
from protocol.routing.policy import RouteChoice
from protocol.tracing.traceparent import parse_traceparent
from tests.support.processor import chat

TRACE = 0x4BF92F3577B34DA6A3CE929D0E0E4736
CALLER = 0x00F067AA0BA902B7
TRACEPARENT = f"00-{TRACE:032x}-{CALLER:016x}-01"


def tracer(ratio: float = 1.0, record_content: bool = False) -> tuple[Tracing, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider(sampler=ParentBased(TraceIdRatioBased(ratio)))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return Tracing(provider, record_content), exporter


def by_name(exporter: InMemorySpanExporter) -> dict[str, object]:
    return {span.name: span for span in exporter.get_finished_spans()}


def served_request(tracing: Tracing, headers: dict[str, list[str]], status: int = 200, code: str = "") -> dict:
    """A request through its span's life: submitted, dispatched, finished; the task's headers."""
    span = tracing.request_started(headers, "chat/completions", "req-1")
    forwarded = {"x-request-id": ["req-1"], **{k: list(v) for k, v in headers.items()}}
    span.submitted(forwarded, "m", "tenant-a", b'{"messages": "the prompt"}')
    span.dispatched()
    span.answered(b'{"choices": "the answer"}')
    span.finish(status, code)
    return forwarded


def test_a_callers_traceparent_makes_the_request_a_child_and_the_task_carries_the_request_span_on():
    tracing, exporter = tracer()
    forwarded = served_request(tracing, {"traceparent": [TRACEPARENT], "tracestate": ["vendor=kept"]})
    spans = by_name(exporter)
    request, queue = spans["infx.request"], spans["infx.queue"]
    assert request.context.trace_id == TRACE and request.parent.span_id == CALLER and request.parent.is_remote
    assert queue.parent.span_id == request.context.span_id
    assert dict(request.attributes) == {
        "infx.request_id": "req-1", "infx.endpoint": "chat/completions", "http.route": "/v1/chat/completions",
        "gen_ai.request.model": "m", "infx.tenant": "tenant-a", "http.response.status_code": 200}
    # The caller's headers gave way to the request span's; the others are untouched.
    parent = parse_traceparent(forwarded["traceparent"])
    assert (parent.trace_id, parent.span_id, parent.sampled) == (TRACE, request.context.span_id, True)
    assert forwarded["tracestate"] == ["vendor=kept"] and forwarded["x-request-id"] == ["req-1"]


def test_a_malformed_traceparent_starts_a_new_trace_and_a_malformed_tracestate_is_dropped_alone():
    tracing, exporter = tracer()
    served_request(tracing, {"traceparent": ["00-not-a-trace-01"]})
    (request,) = [s for s in exporter.get_finished_spans() if s.name == "infx.request"]
    assert request.parent is None and request.context.trace_id != TRACE
    exporter.clear()
    forwarded = served_request(tracing, {"traceparent": [TRACEPARENT], "tracestate": ["Bad Key=1"]})
    assert by_name(exporter)["infx.request"].context.trace_id == TRACE
    assert "tracestate" not in forwarded


def test_no_span_carries_the_prompt_or_the_answer_unless_asked():
    tracing, exporter = tracer()
    served_request(tracing, {})
    assert "the prompt" not in json.dumps([dict(s.attributes) for s in exporter.get_finished_spans()])
    tracing, exporter = tracer(record_content=True)
    served_request(tracing, {})
    request = by_name(exporter)["infx.request"]
    assert "the prompt" in request.attributes["infx.request.body"]
    assert "the answer" in request.attributes["infx.response.body"]


def test_record_content_keeps_at_most_its_cap_of_an_answer():
    tracing, exporter = tracer(record_content=True)
    span = tracing.request_started({}, "chat/completions", "r")
    span.submitted({}, "m", "t", b"x" * (3 * MAX_CONTENT_BYTES))
    for _ in range(100):
        span.answered(b"y" * 1000)
    span.finish(200, "")
    request = by_name(exporter)["infx.request"]
    assert len(request.attributes["infx.request.body"]) == MAX_CONTENT_BYTES
    assert len(request.attributes["infx.response.body"]) <= MAX_CONTENT_BYTES + 1000


def test_an_error_sets_the_status_with_the_clients_cause_and_a_request_that_never_left_the_queue_says_so():
    tracing, exporter = tracer()
    span = tracing.request_started({}, "chat/completions", "r")
    span.submitted({}, "m", "t", b"")
    span.failed("no engine took the task in time")
    span.finish(503, "model_unavailable")
    spans = by_name(exporter)
    request, queue = spans["infx.request"], spans["infx.queue"]
    assert (request.status.status_code, request.status.description) == (
        StatusCode.ERROR, "no engine took the task in time")
    assert request.attributes["error.type"] == "model_unavailable"
    assert queue.status.status_code is StatusCode.ERROR
    # An error answered with a body: its message is the cause.
    exporter.clear()
    span = tracing.request_started({}, "chat/completions", "r")
    span.error_body(b'{"error": {"message": "Missing or unknown API key.", "code": "invalid_api_key"}}')
    span.finish(401, "invalid_api_key")
    assert by_name(exporter)["infx.request"].status.description == "Missing or unknown API key."


def test_sampled_out_a_new_trace_records_nothing_but_still_tells_the_next_hop_not_to_record():
    tracing, exporter = tracer(ratio=0.0)
    forwarded = served_request(tracing, {})
    assert exporter.get_finished_spans() == ()
    parent = parse_traceparent(forwarded["traceparent"])
    assert parent is not None and not parent.sampled
    # A caller that records its trace has it recorded here too (the parent decides).
    served_request(tracing, {"traceparent": [TRACEPARENT]})
    assert {s.context.trace_id for s in exporter.get_finished_spans()} == {TRACE}


def routed(choice: RouteChoice | None, locality: Locality = Locality.REMOTE) -> tuple[SendTask, dict]:
    tracing, exporter = tracer()
    key = EngineKey("t", "e1@peer")
    task = worker_pb2.Task(id="t1#2")
    task.header["TraceParent"].values.append(TRACEPARENT)
    task.header["x-request-id"].values.append("r")
    effect = SendTask(None, key, task, choice)
    tracing.task_routed(effect, "gw-a", "peer", locality, "affinity")
    return effect, by_name(exporter)


def test_a_routed_task_gets_a_span_with_why_and_its_headers_name_that_span():
    choice = RouteChoice(EngineKey("t", "e1@peer"), "affinity", "home,prefix", 8.25, 3, 2, 4, "prefix_hit")
    effect, spans = routed(choice)
    route = spans["infx.route"]
    assert route.parent.span_id == CALLER and route.context.trace_id == TRACE
    assert dict(route.attributes) == {
        "infx.task_id": "t1#2", "infx.gateway": "gw-a", "infx.engine_id": "e1@peer", "infx.engine.gateway": "peer",
        "infx.engine.locality": "remote", "infx.routing.policy": "affinity", "infx.routing.reason": "home,prefix",
        "infx.routing.candidates": 3, "infx.routing.score": 8.25, "infx.routing.prefix_blocks": 2,
        "infx.routing.blocks": 4, "infx.routing.decision": "prefix_hit", "infx.attempt": 2}
    header = dict(effect.task.header)
    assert set(header) == {"traceparent", "x-request-id"}  # the other spelling replaced, not doubled
    assert parse_traceparent(header["traceparent"].values).span_id == route.context.span_id
    _, spans = routed(None, Locality.LOCAL)
    assert spans["infx.route"].attributes["infx.routing.policy"] == "affinity"
    assert "infx.routing.reason" not in spans["infx.route"].attributes


class _Sink:
    def __init__(self) -> None:
        self.results: list[worker_pb2.TaskResult] = []
        self.finished = False

    def send(self, result):
        self.results.append(result)

    def event(self, data):
        self.send(event_result(data))

    def finish(self):
        self.finished = True

    def when_writable(self):
        return None


def agent_task() -> worker_pb2.Task:
    task = worker_pb2.Task(id="t1", request=chat())
    task.header["traceparent"].values.append(TRACEPARENT)
    return task


def test_the_agents_task_span_and_its_runtime_call_nest_under_the_tasks_context_and_end_with_it():
    tracing, exporter = tracer()
    clock = Clock()
    task = agent_task()
    sink = _Sink()
    TracedRuntime(EchoRuntime(clock, EchoConfig()), tracing, "engine-1", "http://runtime:8000").start(task, sink)
    clock.advance(10)
    assert sink.finished and sink.results
    spans = by_name(exporter)
    agent, call = spans["infx.agent.task"], spans["infx.runtime.call"]
    assert agent.parent.span_id == CALLER and call.parent.span_id == agent.context.span_id
    assert call.attributes["url.full"] == "http://runtime:8000"
    assert call.attributes["http.response.status_code"] == 200
    # The runtime's request carries the task's headers: they name the runtime call now.
    assert parse_traceparent(task.header["traceparent"].values).span_id == call.context.span_id


def test_an_aborted_task_ends_its_spans_as_errors_and_a_runtime_not_called_over_http_has_no_call_span():
    tracing, exporter = tracer()
    clock = Clock()
    task = agent_task()
    running = TracedRuntime(EchoRuntime(clock, EchoConfig(token_delay=1)), tracing, "engine-1", None).start(
        task, _Sink())
    running.abort()
    clock.advance(100)
    (agent,) = exporter.get_finished_spans()
    assert agent.name == "infx.agent.task" and agent.status.status_code is StatusCode.ERROR
    assert parse_traceparent(task.header["traceparent"].values).span_id == agent.context.span_id


def test_an_error_answer_from_the_runtime_is_the_spans_cause():
    tracing, exporter = tracer()

    class Failing:
        def start(self, task, sink):
            body = b'{"error": {"message": "overloaded", "code": 503}}'
            sink.send(worker_pb2.TaskResult(http_response=worker_pb2.HttpResponse(status_code=503, body=body)))
            sink.finish()

    TracedRuntime(Failing(), tracing, "engine-1", "http://runtime").start(agent_task(), _Sink())
    for span in exporter.get_finished_spans():
        assert (span.status.status_code, span.status.description) == (StatusCode.ERROR, "overloaded")


def test_options_are_checked_at_start():
    assert tracing_problem(None, "http/protobuf", 1.0) is None
    assert tracing_problem("http://collector:4318", "grpc", 0.0) is None
    assert "--otlp-traces-protocol" in tracing_problem("http://c", "zipkin", 1.0)
    assert "--trace-sample-ratio" in tracing_problem("http://c", "grpc", 1.5)
    assert "--otlp-traces-endpoint" in tracing_problem("collector:4318", "grpc", 1.0)
    assert "--otlp-traces-endpoint" in tracing_problem("http://collector:port", "grpc", 1.0)


class _Collector(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self) -> None:
        self.names: list[str] = []

    def Export(self, request, context):  # noqa: N802 (the service's name)
        self.names += [s.name for r in request.resource_spans for ss in r.scope_spans for s in ss.spans]
        return trace_service_pb2.ExportTraceServiceResponse()


def test_otlp_over_grpc_reaches_a_collector():
    collector = _Collector()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(collector, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        tracing = Tracing.exporting(TracingConfig(f"http://127.0.0.1:{port}", "grpc"), "infx-gateway", "gw-a")
        served_request(tracing, {"traceparent": [TRACEPARENT]})
        tracing.shutdown()  # exports what is batched
        assert sorted(collector.names) == ["infx.queue", "infx.request"]
    finally:
        server.stop(0)


class _Refusing(SpanExporter):
    def export(self, spans):
        return SpanExportResult.FAILURE


class _Reactor:
    """What start_tracing uses of the reactor: a shutdown trigger and calls from the exporter's thread."""

    def __init__(self) -> None:
        self.triggers: list = []
        self.from_thread: list = []

    def addSystemEventTrigger(self, phase, event, call):  # noqa: N802 (Twisted's name)
        self.triggers.append((phase, event, call))

    def callFromThread(self, call, *args):  # noqa: N802
        self.from_thread.append((call, args))


def test_spans_the_exporter_could_not_deliver_are_logged_and_counted_on_the_reactor(monkeypatch):
    import infx.tracing.spans as spans_module

    monkeypatch.setattr(spans_module, "_exporter", lambda config: _Refusing())
    reactor, lost = _Reactor(), []
    tracing = start_tracing(TracingConfig("http://127.0.0.1:9"), "infx-gateway", "gw-a", reactor, lost.append)
    assert [(phase, event) for phase, event, _ in reactor.triggers] == [("after", "shutdown")]
    served_request(tracing, {})
    reactor.triggers[0][2]()  # the reactor shut down: what is batched is exported (and refused)
    assert lost == [] and reactor.from_thread  # told from the exporter's thread, performed on the reactor's
    for call, args in reactor.from_thread:
        call(*args)
    assert lost == [2]  # the request's span and its queue wait's
