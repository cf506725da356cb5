"""The engine agent's spans: a task at the agent, and its request to the runtime.

:class:`TracedRuntime` stands in front of the agent's runtime (dial-in, or a
runtime by URL in the gateway's process). For each task it starts
``infx.agent.task`` (server) under the span the task's headers name, and, for a
runtime reached over HTTP, ``infx.runtime.call`` (client) under that; the task's
``traceparent`` then names the runtime call, so the request the runtime gets
carries it (the ``openai`` runtime forwards the task's headers) and the
runtime's own spans are its children. Both end with the task: its last result,
its failure, or its abort. The answer's status is the spans' status; an error
answer's message is their error cause.
"""

from __future__ import annotations

import json

from twisted.internet.defer import Deferred
from opentelemetry.trace import Span, SpanKind, Status, StatusCode, set_span_in_context

from infx.agent.runtimes import RunningTask, Runtime, TaskSink
from infx.tracing.spans import Tracing, set_task_context
from protocol.pb import worker_pb2

__all__ = ["TracedRuntime"]


class TracedRuntime:
    """``runtime`` with a span per task; ``url``: the runtime's root, for a runtime called over HTTP."""

    def __init__(self, runtime: Runtime, tracing: Tracing, engine_id: str, url: str | None) -> None:
        self.runtime = runtime
        self.tracing = tracing
        self.engine_id = engine_id
        self.url = url

    def start(self, task: worker_pb2.Task, sink: TaskSink) -> RunningTask:
        tracer = self.tracing.tracer
        agent = tracer.start_span("infx.agent.task", context=self.tracing.task_parent(task), kind=SpanKind.SERVER,
                                  attributes={"infx.task_id": task.id, "infx.engine_id": self.engine_id})
        spans = [agent]
        if self.url is not None:
            call = tracer.start_span("infx.runtime.call", context=set_span_in_context(agent), kind=SpanKind.CLIENT,
                                     attributes={"url.full": self.url, "infx.engine_id": self.engine_id})
            spans.append(call)
            set_task_context(task, call)
        else:
            set_task_context(task, agent)
        traced = _TracedSink(sink, spans)
        traced.running = self.runtime.start(task, traced)
        return traced


class _TracedSink:
    """Passes a task's results on, and ends its spans with the task."""

    def __init__(self, sink: TaskSink, spans: list[Span]) -> None:
        self.sink = sink
        self.spans = spans
        self.running: RunningTask | None = None
        self.ended = False

    # TaskSink

    def send(self, result: worker_pb2.TaskResult) -> None:
        if not self.ended and result.WhichOneof("message") == "http_response":
            response = result.http_response
            for span in self.spans:
                span.set_attribute("http.response.status_code", response.status_code)
            if response.status_code >= 400:
                cause = _message(bytes(response.body)) or response.status or str(response.status_code)
                for span in self.spans:
                    span.set_status(Status(StatusCode.ERROR, cause))
        self.sink.send(result)

    def event(self, data: bytes) -> None:
        self.sink.event(data)

    def finish(self) -> None:
        self._end()
        self.sink.finish()

    def when_writable(self) -> Deferred[None] | None:
        return self.sink.when_writable()

    # RunningTask

    def abort(self) -> None:
        if not self.ended:
            for span in self.spans:
                span.set_status(Status(StatusCode.ERROR, "aborted: the gateway cancelled the task"))
        self._end()
        if self.running is not None:
            self.running.abort()

    def _end(self) -> None:
        if not self.ended:
            self.ended = True
            for span in reversed(self.spans):
                span.end()


def _message(body: bytes) -> str:
    try:
        error = json.loads(body).get("error")
    except (ValueError, AttributeError):
        return ""
    message = error.get("message") if isinstance(error, dict) else None
    return message if isinstance(message, str) else ""
