"""Builders for processor tests: requests, engine statuses, results, effect filters."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TypeVar

from protocol.pb import audio_pb2, chat_pb2, embeddings_pb2, model_response_pb2, status_pb2, worker_pb2
from protocol.processor.core import Processor
from protocol.processor.config import ProcessorConfig
from protocol.processor.effects import SendTask
from protocol.processor.keys import Locality

E = TypeVar("E")


def chat(model: str = "m", stream: bool = False) -> worker_pb2.TaskRequest:
    return worker_pb2.TaskRequest(chat_completion=chat_pb2.CreateChatCompletionRequest(model=model, stream=stream))


def embedding(model: str = "m") -> worker_pb2.TaskRequest:
    return worker_pb2.TaskRequest(embedding=embeddings_pb2.CreateEmbeddingRequest(model=model, input="x"))


def audio(model: str = "m", stream: bool = False) -> worker_pb2.TaskRequest:
    return worker_pb2.TaskRequest(
        audio_transcription=audio_pb2.CreateAudioTranscriptionRequest(model=model, stream=stream)
    )


def response(model: str = "m", stream: bool = False) -> worker_pb2.TaskRequest:
    return worker_pb2.TaskRequest(model_response=model_response_pb2.CreateModelResponseRequest(model=model, stream=stream))


def engine_status(engine_id: str, *models: str, ready: bool = True, loading: Iterable[str] = ()) -> status_pb2.EngineStatus:
    status = status_pb2.EngineStatus(engine_id=engine_id, ready=ready, cluster_id="c1")
    for model in models:
        status.models.add(id=model, is_ready=True)
    for model in loading:
        status.models.add(id=model, is_ready=False)
    return status


def http(task_id: str, code: int = 200, index: int = 0, body: bytes = b"{}") -> worker_pb2.TaskResult:
    return worker_pb2.TaskResult(
        task_id=task_id, result_index=index, http_response=worker_pb2.HttpResponse(status_code=code, body=body)
    )


def sse(task_id: str, index: int, last: bool = False, data: bytes = b"data: {}\n\n") -> worker_pb2.TaskResult:
    return worker_pb2.TaskResult(
        task_id=task_id,
        result_index=index,
        server_sent_event=worker_pb2.ServerSentEvent(data=data, is_last_event=last),
    )


def only(effects: Iterable[object], kind: type[E]) -> list[E]:
    return [e for e in effects if isinstance(e, kind)]


def one(effects: Iterable[object], kind: type[E]) -> E:
    found = only(effects, kind)
    assert len(found) == 1, f"expected one {kind.__name__} in {list(effects)}"
    return found[0]


LOCAL, REMOTE = Locality.LOCAL, Locality.REMOTE


T0 = 1000.0


def make(**config: object) -> Processor:
    return Processor(ProcessorConfig(**config))  # type: ignore[arg-type]


def join(p: Processor, engine_id: str, *models: str, tenant: str = "t", locality: Locality = LOCAL,
         route: object = None, now: float = T0, ready: bool = True, loading: tuple[str, ...] = ()) -> list[object]:
    return list(p.update_engine(
        route or f"route-{engine_id}",
        tenant,
        engine_status(engine_id, *models, ready=ready, loading=loading),
        locality,
        now,
    ))


def submit(p: Processor, task_id: str, request=None, now: float = T0, tenant: str = "t", **kw: object) -> list[object]:
    return list(p.submit(task_id=task_id, tenant_id=tenant, request=request or chat(), origin="client", **kw, now=now))


def sent_to(effects: list[object]) -> list[str]:
    return [e.engine.engine_id for e in only(effects, SendTask)]
