from protocol.pb import audio_pb2 as _audio_pb2
from protocol.pb import chat_pb2 as _chat_pb2
from protocol.pb import embeddings_pb2 as _embeddings_pb2
from protocol.pb import model_response_pb2 as _model_response_pb2
from protocol.pb import status_pb2 as _status_pb2
from protocol.pb import tokenize_pb2 as _tokenize_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RuntimeFailure(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    RUNTIME_FAILURE_UNSPECIFIED: _ClassVar[RuntimeFailure]
    RUNTIME_UNREACHABLE: _ClassVar[RuntimeFailure]
    RUNTIME_DROPPED: _ClassVar[RuntimeFailure]
RUNTIME_FAILURE_UNSPECIFIED: RuntimeFailure
RUNTIME_UNREACHABLE: RuntimeFailure
RUNTIME_DROPPED: RuntimeFailure

class HeaderValue(_message.Message):
    __slots__ = ("values",)
    VALUES_FIELD_NUMBER: _ClassVar[int]
    values: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, values: _Optional[_Iterable[str]] = ...) -> None: ...

class HttpResponse(_message.Message):
    __slots__ = ("status_code", "status", "header", "body", "latency_ms")
    class HeaderEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: HeaderValue
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[HeaderValue, _Mapping]] = ...) -> None: ...
    STATUS_CODE_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    HEADER_FIELD_NUMBER: _ClassVar[int]
    BODY_FIELD_NUMBER: _ClassVar[int]
    LATENCY_MS_FIELD_NUMBER: _ClassVar[int]
    status_code: int
    status: str
    header: _containers.MessageMap[str, HeaderValue]
    body: bytes
    latency_ms: int
    def __init__(self, status_code: _Optional[int] = ..., status: _Optional[str] = ..., header: _Optional[_Mapping[str, HeaderValue]] = ..., body: _Optional[bytes] = ..., latency_ms: _Optional[int] = ...) -> None: ...

class ServerSentEvent(_message.Message):
    __slots__ = ("data", "is_last_event", "latency_ms")
    DATA_FIELD_NUMBER: _ClassVar[int]
    IS_LAST_EVENT_FIELD_NUMBER: _ClassVar[int]
    LATENCY_MS_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    is_last_event: bool
    latency_ms: int
    def __init__(self, data: _Optional[bytes] = ..., is_last_event: _Optional[bool] = ..., latency_ms: _Optional[int] = ...) -> None: ...

class TaskResult(_message.Message):
    __slots__ = ("task_id", "http_response", "server_sent_event", "result_index", "verbatim_answer", "infx_runtime_failure")
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    HTTP_RESPONSE_FIELD_NUMBER: _ClassVar[int]
    SERVER_SENT_EVENT_FIELD_NUMBER: _ClassVar[int]
    RESULT_INDEX_FIELD_NUMBER: _ClassVar[int]
    VERBATIM_ANSWER_FIELD_NUMBER: _ClassVar[int]
    INFX_RUNTIME_FAILURE_FIELD_NUMBER: _ClassVar[int]
    task_id: str
    http_response: HttpResponse
    server_sent_event: ServerSentEvent
    result_index: int
    verbatim_answer: bool
    infx_runtime_failure: RuntimeFailure
    def __init__(self, task_id: _Optional[str] = ..., http_response: _Optional[_Union[HttpResponse, _Mapping]] = ..., server_sent_event: _Optional[_Union[ServerSentEvent, _Mapping]] = ..., result_index: _Optional[int] = ..., verbatim_answer: _Optional[bool] = ..., infx_runtime_failure: _Optional[_Union[RuntimeFailure, str]] = ...) -> None: ...

class ProcessTasksRequest(_message.Message):
    __slots__ = ("engine_status", "task_result")
    ENGINE_STATUS_FIELD_NUMBER: _ClassVar[int]
    TASK_RESULT_FIELD_NUMBER: _ClassVar[int]
    engine_status: _status_pb2.EngineStatus
    task_result: TaskResult
    def __init__(self, engine_status: _Optional[_Union[_status_pb2.EngineStatus, _Mapping]] = ..., task_result: _Optional[_Union[TaskResult, _Mapping]] = ...) -> None: ...

class GoAwayRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CancelTaskRequest(_message.Message):
    __slots__ = ("task_id",)
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    task_id: str
    def __init__(self, task_id: _Optional[str] = ...) -> None: ...

class HttpRequest(_message.Message):
    __slots__ = ("method", "path", "body")
    METHOD_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    BODY_FIELD_NUMBER: _ClassVar[int]
    method: str
    path: str
    body: bytes
    def __init__(self, method: _Optional[str] = ..., path: _Optional[str] = ..., body: _Optional[bytes] = ...) -> None: ...

class TaskRequest(_message.Message):
    __slots__ = ("chat_completion", "embedding", "go_away", "heartbeat", "audio_transcription", "model_response", "tokenize_request", "cancel_task", "http_request", "typed_request_incomplete", "infx_prefix_tip", "infx_caller")
    CHAT_COMPLETION_FIELD_NUMBER: _ClassVar[int]
    EMBEDDING_FIELD_NUMBER: _ClassVar[int]
    GO_AWAY_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    AUDIO_TRANSCRIPTION_FIELD_NUMBER: _ClassVar[int]
    MODEL_RESPONSE_FIELD_NUMBER: _ClassVar[int]
    TOKENIZE_REQUEST_FIELD_NUMBER: _ClassVar[int]
    CANCEL_TASK_FIELD_NUMBER: _ClassVar[int]
    HTTP_REQUEST_FIELD_NUMBER: _ClassVar[int]
    TYPED_REQUEST_INCOMPLETE_FIELD_NUMBER: _ClassVar[int]
    INFX_PREFIX_TIP_FIELD_NUMBER: _ClassVar[int]
    INFX_CALLER_FIELD_NUMBER: _ClassVar[int]
    chat_completion: _chat_pb2.CreateChatCompletionRequest
    embedding: _embeddings_pb2.CreateEmbeddingRequest
    go_away: GoAwayRequest
    heartbeat: HeartbeatRequest
    audio_transcription: _audio_pb2.CreateAudioTranscriptionRequest
    model_response: _model_response_pb2.CreateModelResponseRequest
    tokenize_request: _tokenize_pb2.TokenizeRequest
    cancel_task: CancelTaskRequest
    http_request: HttpRequest
    typed_request_incomplete: str
    infx_prefix_tip: int
    infx_caller: Caller
    def __init__(self, chat_completion: _Optional[_Union[_chat_pb2.CreateChatCompletionRequest, _Mapping]] = ..., embedding: _Optional[_Union[_embeddings_pb2.CreateEmbeddingRequest, _Mapping]] = ..., go_away: _Optional[_Union[GoAwayRequest, _Mapping]] = ..., heartbeat: _Optional[_Union[HeartbeatRequest, _Mapping]] = ..., audio_transcription: _Optional[_Union[_audio_pb2.CreateAudioTranscriptionRequest, _Mapping]] = ..., model_response: _Optional[_Union[_model_response_pb2.CreateModelResponseRequest, _Mapping]] = ..., tokenize_request: _Optional[_Union[_tokenize_pb2.TokenizeRequest, _Mapping]] = ..., cancel_task: _Optional[_Union[CancelTaskRequest, _Mapping]] = ..., http_request: _Optional[_Union[HttpRequest, _Mapping]] = ..., typed_request_incomplete: _Optional[str] = ..., infx_prefix_tip: _Optional[int] = ..., infx_caller: _Optional[_Union[Caller, _Mapping]] = ...) -> None: ...

class Caller(_message.Message):
    __slots__ = ("flow", "weight", "criticality")
    class Criticality(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        CRITICALITY_STANDARD: _ClassVar[Caller.Criticality]
        CRITICALITY_CRITICAL: _ClassVar[Caller.Criticality]
        CRITICALITY_SHEDDABLE: _ClassVar[Caller.Criticality]
    CRITICALITY_STANDARD: Caller.Criticality
    CRITICALITY_CRITICAL: Caller.Criticality
    CRITICALITY_SHEDDABLE: Caller.Criticality
    FLOW_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    CRITICALITY_FIELD_NUMBER: _ClassVar[int]
    flow: str
    weight: float
    criticality: Caller.Criticality
    def __init__(self, flow: _Optional[str] = ..., weight: _Optional[float] = ..., criticality: _Optional[_Union[Caller.Criticality, str]] = ...) -> None: ...

class Task(_message.Message):
    __slots__ = ("id", "header", "request", "engine_id", "timeout_seconds")
    class HeaderEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: HeaderValue
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[HeaderValue, _Mapping]] = ...) -> None: ...
    ID_FIELD_NUMBER: _ClassVar[int]
    HEADER_FIELD_NUMBER: _ClassVar[int]
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    id: str
    header: _containers.MessageMap[str, HeaderValue]
    request: TaskRequest
    engine_id: str
    timeout_seconds: int
    def __init__(self, id: _Optional[str] = ..., header: _Optional[_Mapping[str, HeaderValue]] = ..., request: _Optional[_Union[TaskRequest, _Mapping]] = ..., engine_id: _Optional[str] = ..., timeout_seconds: _Optional[int] = ...) -> None: ...

class ProcessTasksResponse(_message.Message):
    __slots__ = ("new_task",)
    NEW_TASK_FIELD_NUMBER: _ClassVar[int]
    new_task: Task
    def __init__(self, new_task: _Optional[_Union[Task, _Mapping]] = ...) -> None: ...
