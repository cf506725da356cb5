"""A LLMariner engine written with grpcio, to prove infx's worker service serves real LLMariner engines.

It speaks ``InferenceWorkerService/ProcessTasks`` with infx's generated
messages the way LLMariner's engine does (engine/internal/processor in
llmariner/inference-manager): it opens the stream with
``authorization: Bearer KEY`` metadata and an ``EngineStatus``, then runs
every received ``Task`` on its own thread (LLMariner uses a goroutine per
task) and answers with ``TaskResult``s: the runtime's ``HttpResponse`` as
result 0, then, for a streamed answer, one ``ServerSentEvent`` per runtime
event framed as ``data: ...\\n\\n`` (results 1..N), and last an empty event
with ``is_last_event``. Go-away is answered 202 and heartbeat 200; anything
else it does not know (infx's ``cancel_task``) gets 501, as LLMariner's
``handleUnimplemented`` does.

How a model "answers" is a generator per task (see :data:`Answer`), so a
test can script it, block it, or break the protocol on purpose.
"""

from __future__ import annotations

import json
import queue
import threading
from collections.abc import Callable, Collection, Iterator
from typing import Any, Union

import grpc

from protocol.pb import status_pb2, worker_pb2

PROCESS_TASKS = "/llmariner.inference.server.v1.InferenceWorkerService/ProcessTasks"

#: One item of an answer: a payload the engine numbers itself, or a TaskResult sent exactly as given.
Payload = Union[worker_pb2.HttpResponse, worker_pb2.ServerSentEvent, worker_pb2.TaskResult]
#: Yields the results of one task, in order; runs on the task's own thread and may block.
Answer = Callable[[worker_pb2.Task], Iterator[Payload]]


def http_response(status: int, body: bytes = b"", content_type: str | None = None) -> worker_pb2.HttpResponse:
    """An ``HttpResponse`` as the engine relays it from its runtime."""
    response = worker_pb2.HttpResponse(status_code=status, status=f"{status}", body=body)
    if content_type is not None:
        response.header["Content-Type"].values.append(content_type)
    return response


def sse(data: bytes) -> worker_pb2.ServerSentEvent:
    """One runtime event, framed as LLMariner's engine frames it (the scanner's block + a blank line)."""
    return worker_pb2.ServerSentEvent(data=data + b"\n\n")


def last_event() -> worker_pb2.ServerSentEvent:
    return worker_pb2.ServerSentEvent(is_last_event=True)


def last_user_text(task: worker_pb2.Task) -> str:
    messages = [m for m in task.request.chat_completion.messages if m.role == "user"]
    return "".join(part.text for part in messages[-1].content if part.type == "text") if messages else ""


def runtime_answer(task: worker_pb2.Task) -> Iterator[Payload]:
    """What a vLLM behind the engine would answer: the user's words back, prefixed, streamed or not."""
    kind = task.request.WhichOneof("request")
    body: dict[str, Any]
    if kind == "embedding":
        body = {"object": "list", "model": task.request.embedding.model, "data": [
            {"object": "embedding", "index": 0, "embedding": [0.25, 0.5, 0.75]}],
            "usage": {"prompt_tokens": 1, "total_tokens": 1}}
        yield http_response(200, json.dumps(body).encode(), "application/json")
        return
    if kind != "chat_completion":
        yield http_response(501, b'{"error": {"message": "not served", "type": "server_error"}}', "application/json")
        return
    request = task.request.chat_completion
    words = ["llmariner:"] + last_user_text(task).split()
    if not request.stream:
        body = {"id": "chatcmpl-" + task.id, "object": "chat.completion", "created": 1, "model": request.model,
                "choices": [{"index": 0, "finish_reason": "stop",
                             "message": {"role": "assistant", "content": " ".join(words)}}]}
        yield http_response(200, json.dumps(body).encode(), "application/json")
        return
    yield http_response(200, content_type="text/event-stream")
    for i, word in enumerate(words):
        chunk = {"id": "chatcmpl-" + task.id, "object": "chat.completion.chunk", "created": 1,
                 "model": request.model,
                 "choices": [{"index": 0, "delta": {"content": word if i == 0 else " " + word},
                              "finish_reason": None}]}
        yield sse(b"data: " + json.dumps(chunk).encode())
    yield sse(b"data: [DONE]")
    yield last_event()


class LLMarinerEngine:
    """One engine on one ProcessTasks stream; ``tasks`` lists every Task received, in order."""

    def __init__(self, target: str, engine_id: str, models: list[str], *, key: str | None = None,
                 answer: Answer = runtime_answer, loading: Collection[str] = ()) -> None:
        self.engine_id = engine_id
        self.models = models
        self.answer = answer
        self.tasks: list[worker_pb2.Task] = []
        self.error: grpc.RpcError | None = None
        self.ended = threading.Event()
        self._changed = threading.Condition()
        self._outbox: queue.Queue[worker_pb2.ProcessTasksRequest | None] = queue.Queue()
        self.channel = grpc.insecure_channel(target)
        method = self.channel.stream_stream(
            PROCESS_TASKS,
            request_serializer=worker_pb2.ProcessTasksRequest.SerializeToString,
            response_deserializer=worker_pb2.ProcessTasksResponse.FromString,
        )
        self.report(loading=loading)
        metadata = [("authorization", f"Bearer {key}")] if key else None
        self.call = method(self._requests(), metadata=metadata)
        self._reader = threading.Thread(target=self._read, name=f"engine-{engine_id}", daemon=True)
        self._reader.start()

    def report(self, ready: bool = True, loading: Collection[str] = ()) -> None:
        """Send an ``EngineStatus``; models in ``loading`` are listed but not ready yet."""
        status = status_pb2.EngineStatus(
            engine_id=self.engine_id, ready=ready,
            models=[status_pb2.EngineStatus.Model(id=m, is_ready=m not in loading) for m in self.models],
        )
        self._outbox.put(worker_pb2.ProcessTasksRequest(engine_status=status))

    def _requests(self) -> Iterator[worker_pb2.ProcessTasksRequest]:
        while (message := self._outbox.get()) is not None:
            yield message

    def _read(self) -> None:
        try:
            for response in self.call:
                task = response.new_task
                with self._changed:
                    self.tasks.append(task)
                    self._changed.notify_all()
                threading.Thread(target=self._process, args=(task,), daemon=True).start()
        except grpc.RpcError as e:
            self.error = e
        finally:
            self.ended.set()
            with self._changed:
                self._changed.notify_all()

    def _process(self, task: worker_pb2.Task) -> None:
        kind = task.request.WhichOneof("request")
        if kind == "go_away":
            self.send(worker_pb2.TaskResult(task_id=task.id, http_response=http_response(202)))
        elif kind == "heartbeat":
            self.send(worker_pb2.TaskResult(task_id=task.id, http_response=http_response(200)))
        elif kind in ("chat_completion", "embedding", "audio_transcription", "model_response", "tokenize_request"):
            for index, payload in enumerate(self.answer(task)):
                if isinstance(payload, worker_pb2.TaskResult):
                    result = payload
                    result.task_id = result.task_id or task.id
                elif isinstance(payload, worker_pb2.HttpResponse):
                    result = worker_pb2.TaskResult(task_id=task.id, http_response=payload, result_index=index)
                else:
                    result = worker_pb2.TaskResult(task_id=task.id, server_sent_event=payload, result_index=index)
                self.send(result)
        else:
            self.send(worker_pb2.TaskResult(task_id=task.id, http_response=http_response(501)))

    def send(self, result: worker_pb2.TaskResult) -> None:
        self._outbox.put(worker_pb2.ProcessTasksRequest(task_result=result))

    def wait_for_task(self, predicate: Callable[[worker_pb2.Task], bool], timeout: float = 10.0) -> worker_pb2.Task:
        """The first received task matching ``predicate``, waiting for it if need be."""
        with self._changed:
            found = self._changed.wait_for(
                lambda: next((t for t in self.tasks if predicate(t)), None) or self.ended.is_set(), timeout)
            match = next((t for t in self.tasks if predicate(t)), None)
        assert match is not None, f"no such task reached engine {self.engine_id} (ended={self.ended.is_set()}, {found})"
        return match

    def close(self) -> None:
        """Half-close the stream (as an engine that stops), then drop the connection."""
        self._outbox.put(None)
        self.call.cancel()
        self._reader.join(timeout=10)
        self.channel.close()
