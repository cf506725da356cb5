"""The spans of a request, made with OpenTelemetry's SDK and exported over OTLP (docs/tracing.md).

Only imported once tracing is on (:func:`infx.tracing.start_tracing`). A trace
crosses processes in the W3C headers of the task itself: the gateway writes
``traceparent`` (and the caller's ``tracestate``) into the task's headers, each
hop that makes a span writes its own span there before passing the task on
(the peer gateway, the engine agent), and the runtime receives the last one
with the request, so that vLLM's own spans join the trace. A LLMariner engine
forwards the task's headers as they are. The spans, parent first:

- ``infx.request`` (server): the client's request at the gateway it reached, from
  arrival to the end of its answer; ``infx.queue``, its child: the wait for an engine;
- ``infx.route``: each send of the task to an engine, local or a peer's, with why
  routing chose it; a peer gateway that routes the task to its own engine adds its own
  ``infx.route`` under the first;
- ``infx.agent.task`` (server): the task at the engine agent (dial-in or in the gateway's
  process), and ``infx.runtime.call`` (client): its request to the runtime
  (:mod:`infx.tracing.runtime`).

No span carries prompt or completion text unless ``record_content`` is set.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any
from urllib.parse import urlsplit

from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
from opentelemetry.trace import (
    NonRecordingSpan, Span, SpanContext, SpanKind, Status, StatusCode, TraceFlags, TraceState, set_span_in_context,
)

from infx import __version__
from infx.tracing import TracingConfig
from protocol.pb import worker_pb2
from protocol.processor.effects import SendTask
from protocol.processor.keys import Locality
from protocol.tracing.traceparent import (
    TRACEPARENT, TRACESTATE, form_traceparent, form_tracestate, header_values, parse_traceparent, parse_tracestate,
)

__all__ = ["MAX_CONTENT_BYTES", "RequestSpan", "Tracing"]

#: Bytes of a request body, and of an answer, a span carries with ``record_content``.
MAX_CONTENT_BYTES = 16 * 1024


class Tracing:
    """One process's tracer: makes spans, reads and writes trace context in headers."""

    def __init__(self, provider: TracerProvider, record_content: bool = False) -> None:
        self.provider = provider
        self.tracer = provider.get_tracer("infx", __version__)
        self.record_content = record_content

    @classmethod
    def exporting(cls, config: TracingConfig, service: str, instance: str,
                  lost: Callable[[int], None] = lambda count: None) -> Tracing:
        """A tracer whose spans are batched and exported to ``config.endpoint``; ``lost`` is told,
        on the exporter's thread, how many spans a batch that could not be delivered held."""
        resource = Resource.create({"service.name": service, "service.instance.id": instance,
                                    "service.version": __version__})
        provider = TracerProvider(resource=resource, sampler=ParentBased(TraceIdRatioBased(config.sample_ratio)))
        provider.add_span_processor(BatchSpanProcessor(ReportingExporter(_exporter(config), lost),
                                                       schedule_delay_millis=config.export_delay * 1000))
        return cls(provider, config.record_content)

    def shutdown(self) -> None:
        """Export what is batched and stop (the reactor has shut down; this blocks up to the export timeout)."""
        self.provider.shutdown()

    # -- trace context --------------------------------------------------------------------

    def parent(self, headers: Mapping[str, Sequence[str]]) -> Context:
        """The span ``headers`` name as the caller's (``traceparent``, ``tracestate``); an empty
        context (a new trace) if they name none or it is malformed."""
        parent = parse_traceparent(header_values(headers, TRACEPARENT))
        if parent is None:
            return Context()
        members = parse_tracestate(header_values(headers, TRACESTATE)) or ()
        context = SpanContext(parent.trace_id, parent.span_id, is_remote=True, trace_flags=TraceFlags(parent.flags),
                              trace_state=TraceState(list(members)))
        return set_span_in_context(NonRecordingSpan(context))

    def task_parent(self, task: worker_pb2.Task) -> Context:
        """The span a task's headers name (see :meth:`parent`)."""
        return self.parent({name: list(value.values) for name, value in task.header.items()
                            if name.lower() in (TRACEPARENT, TRACESTATE)})

    def request_started(self, headers: Mapping[str, Sequence[str]], endpoint: str, request_id: str) -> RequestSpan:
        """The span of a client's request, a child of the caller's span if its headers name one."""
        span = self.tracer.start_span("infx.request", context=self.parent(headers), kind=SpanKind.SERVER,
                                      attributes={"infx.request_id": request_id, "infx.endpoint": endpoint,
                                                  "http.route": "/v1/" + endpoint})
        return RequestSpan(self, span)

    def task_routed(self, effect: SendTask, gateway: str, engine_gateway: str, locality: Locality | None,
                    policy: str) -> None:
        """Routing chose an engine for a task (``effect``, about to be sent): its span, whose
        context replaces the one in the task's headers so that the next hop's spans are its children.

        ``gateway`` is this gateway, ``engine_gateway`` the one the engine is attached to."""
        task = effect.task
        choice = effect.choice
        attributes: dict[str, Any] = {
            "infx.task_id": task.id, "infx.gateway": gateway, "infx.engine_id": effect.engine.engine_id,
            "infx.engine.gateway": engine_gateway, "infx.routing.policy": choice.policy if choice else policy,
        }
        if locality is not None:
            attributes["infx.engine.locality"] = locality.value
        if choice is not None:
            attributes["infx.routing.reason"] = choice.reason
            if choice.decision:
                attributes["infx.routing.decision"] = choice.decision
            attributes["infx.routing.candidates"] = choice.candidates
            if choice.score is not None:
                attributes["infx.routing.score"] = choice.score
            if choice.blocks:
                attributes["infx.routing.prefix_blocks"] = choice.prefix_blocks
                attributes["infx.routing.blocks"] = choice.blocks
        attempt = task.id.rpartition("#")[2] if "#" in task.id else "1"
        attributes["infx.attempt"] = int(attempt) if attempt.isdigit() else 1
        kind = SpanKind.CLIENT if locality is Locality.REMOTE else SpanKind.INTERNAL
        span = self.tracer.start_span("infx.route", context=self.task_parent(task), kind=kind,
                                      attributes=attributes)
        set_task_context(task, span)
        span.end()


class RequestSpan:
    """A client request's span and its queue wait's (see :meth:`Tracing.request_started`)."""

    __slots__ = ("tracing", "span", "queue", "cause", "answer_bytes", "ended")

    def __init__(self, tracing: Tracing, span: Span) -> None:
        self.tracing = tracing
        self.span = span
        self.queue: Span | None = None
        #: The short cause the client was told, for the span's error status.
        self.cause = ""
        self.answer_bytes: list[bytes] | None = [] if tracing.record_content else None
        self.ended = False

    def submitted(self, headers: dict[str, list[str]], model: str, tenant: str, body: bytes) -> None:
        """The request became a task with these forwarded ``headers``: they carry this span on."""
        span = self.span
        span.set_attribute("gen_ai.request.model", model)
        span.set_attribute("infx.tenant", tenant)
        if self.tracing.record_content:
            span.set_attribute("infx.request.body", _text(body))
        for name in [name for name in headers if name.lower() in (TRACEPARENT, TRACESTATE)]:
            del headers[name]
        headers.update(_context_headers(span))
        self.queue = self.tracing.tracer.start_span("infx.queue", context=set_span_in_context(span))

    def dispatched(self) -> None:
        """The task was first sent to an engine: the wait is over."""
        if self.queue is not None and self.queue.is_recording():
            self.queue.end()

    def answered(self, data: bytes) -> None:
        """Part of the answer (a body, an event), kept with ``record_content``."""
        kept = self.answer_bytes
        if kept is not None and sum(map(len, kept)) < MAX_CONTENT_BYTES:
            kept.append(data)

    def failed(self, message: str) -> None:
        """The client is told ``message`` (the error's own words)."""
        self.cause = self.cause or message

    def error_body(self, body: bytes) -> None:
        """The client is answered with this OpenAI-style error body: its message is the cause."""
        if not self.cause:
            try:
                message = json.loads(body)["error"]["message"]
            except (ValueError, KeyError, TypeError):
                return
            if isinstance(message, str):
                self.cause = message

    def finish(self, status: int, code: str) -> None:
        """The answer ended with ``status`` (the outcome, a stream's error event included) and error ``code``."""
        if self.ended:
            return
        self.ended = True
        span = self.span
        if self.queue is not None and self.queue.is_recording():
            self.queue.set_status(Status(StatusCode.ERROR, "ended before an engine took it"))
            self.queue.end()
        span.set_attribute("http.response.status_code", status)
        if self.answer_bytes:
            span.set_attribute("infx.response.body", _text(b"".join(self.answer_bytes)))
        if status >= 400:
            if code:
                span.set_attribute("error.type", code)
            span.set_status(Status(StatusCode.ERROR, self.cause or code or str(status)))
        span.end()


class ReportingExporter(SpanExporter):
    """An exporter that reports each batch it could not deliver (after the OTLP exporter's own
    retries): those spans are lost, and the operator should hear of it."""

    def __init__(self, exporter: SpanExporter, lost: Callable[[int], None]) -> None:
        self.exporter = exporter
        self.lost = lost

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        result = self.exporter.export(spans)
        if result is not SpanExportResult.SUCCESS:
            self.lost(len(spans))
        return result

    def shutdown(self) -> None:
        self.exporter.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self.exporter.force_flush(timeout_millis)


def _context_headers(span: Span) -> dict[str, list[str]]:
    """``traceparent`` (and ``tracestate``) naming ``span``, as header values."""
    context = span.get_span_context()
    headers = {TRACEPARENT: [form_traceparent(context.trace_id, context.span_id, context.trace_flags)]}
    state = form_tracestate(list(context.trace_state.items()))
    if state:
        headers[TRACESTATE] = [state]
    return headers


def set_task_context(task: worker_pb2.Task, span: Span) -> None:
    """The task's ``traceparent``/``tracestate`` headers name ``span`` from now on."""
    for name in [name for name in task.header if name.lower() in (TRACEPARENT, TRACESTATE)]:
        del task.header[name]
    for name, values in _context_headers(span).items():
        task.header[name].values.extend(values)


def _text(data: bytes) -> str:
    return data[:MAX_CONTENT_BYTES].decode("utf-8", "replace")


def _exporter(config: TracingConfig) -> SpanExporter:
    if config.protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter

        return GrpcExporter(endpoint=config.endpoint, insecure=config.endpoint.startswith("http://"))
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter

    endpoint = config.endpoint
    if urlsplit(endpoint).path in ("", "/"):
        endpoint = endpoint.rstrip("/") + "/v1/traces"
    return HttpExporter(endpoint=endpoint, timeout=10)
