"""A task's results collected as a runtime delivers them, and a chat task, for runtime tests."""

from __future__ import annotations

from twisted.internet import defer, task

from infx.agent.runtimes import event_result
from protocol.pb import chat_pb2, worker_pb2


class Sink:
    """Collects a task's results; ``done`` fires at finish()."""

    def __init__(self) -> None:
        self.results: list[worker_pb2.TaskResult] = []
        self.finished = 0
        self.done: defer.Deferred[None] = defer.Deferred()
        #: What when_writable() answers: None, or a Deferred standing for a full gRPC stream.
        self.blocked: defer.Deferred[None] | None = None

    def send(self, result: worker_pb2.TaskResult) -> None:
        assert self.finished == 0, "result after finish"
        self.results.append(result)

    def event(self, data: bytes) -> None:
        self.send(event_result(data))

    def finish(self) -> None:
        self.finished += 1
        self.done.callback(None)

    def when_writable(self) -> defer.Deferred[None] | None:
        return self.blocked

    @property
    def head(self) -> worker_pb2.HttpResponse:
        assert self.results[0].WhichOneof("message") == "http_response"
        return self.results[0].http_response

    @property
    def events(self) -> list[worker_pb2.ServerSentEvent]:
        return [r.server_sent_event for r in self.results[1:]]


def chat_task(text: str, *, model: str = "m", stream: bool = False, usage: bool = False,
              task_id: str = "t1") -> worker_pb2.Task:
    req = chat_pb2.CreateChatCompletionRequest(model=model, stream=stream)
    message = req.messages.add(role="user")
    message.content.add(type="text", text=text)
    if usage:
        req.stream_options.include_usage = True
    task = worker_pb2.Task(id=task_id, request=worker_pb2.TaskRequest(chat_completion=req))
    task.header["X-Request-Id"].values.append("req-1")
    task.header["Authorization"].values.append("Bearer client-secret")
    return task
