from protocol.pb import status_pb2 as _status_pb2
from protocol.pb import worker_pb2 as _worker_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ServerStatus(_message.Message):
    __slots__ = ("pod_name", "engine_statuses", "model_requests_started", "draining", "delta", "removed_engines", "sequence")
    class EngineStatusWithTenantID(_message.Message):
        __slots__ = ("engine_status", "tenant_id")
        ENGINE_STATUS_FIELD_NUMBER: _ClassVar[int]
        TENANT_ID_FIELD_NUMBER: _ClassVar[int]
        engine_status: _status_pb2.EngineStatus
        tenant_id: str
        def __init__(self, engine_status: _Optional[_Union[_status_pb2.EngineStatus, _Mapping]] = ..., tenant_id: _Optional[str] = ...) -> None: ...
    class ModelRequestsStartedEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class RemovedEngine(_message.Message):
        __slots__ = ("engine_id", "tenant_id")
        ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
        TENANT_ID_FIELD_NUMBER: _ClassVar[int]
        engine_id: str
        tenant_id: str
        def __init__(self, engine_id: _Optional[str] = ..., tenant_id: _Optional[str] = ...) -> None: ...
    POD_NAME_FIELD_NUMBER: _ClassVar[int]
    ENGINE_STATUSES_FIELD_NUMBER: _ClassVar[int]
    MODEL_REQUESTS_STARTED_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    DELTA_FIELD_NUMBER: _ClassVar[int]
    REMOVED_ENGINES_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    pod_name: str
    engine_statuses: _containers.RepeatedCompositeFieldContainer[ServerStatus.EngineStatusWithTenantID]
    model_requests_started: _containers.ScalarMap[str, int]
    draining: bool
    delta: bool
    removed_engines: _containers.RepeatedCompositeFieldContainer[ServerStatus.RemovedEngine]
    sequence: int
    def __init__(self, pod_name: _Optional[str] = ..., engine_statuses: _Optional[_Iterable[_Union[ServerStatus.EngineStatusWithTenantID, _Mapping]]] = ..., model_requests_started: _Optional[_Mapping[str, int]] = ..., draining: _Optional[bool] = ..., delta: _Optional[bool] = ..., removed_engines: _Optional[_Iterable[_Union[ServerStatus.RemovedEngine, _Mapping]]] = ..., sequence: _Optional[int] = ...) -> None: ...

class ProcessTasksInternalRequest(_message.Message):
    __slots__ = ("server_status", "task_result")
    SERVER_STATUS_FIELD_NUMBER: _ClassVar[int]
    TASK_RESULT_FIELD_NUMBER: _ClassVar[int]
    server_status: ServerStatus
    task_result: _worker_pb2.TaskResult
    def __init__(self, server_status: _Optional[_Union[ServerStatus, _Mapping]] = ..., task_result: _Optional[_Union[_worker_pb2.TaskResult, _Mapping]] = ...) -> None: ...

class ProcessTasksInternalResponse(_message.Message):
    __slots__ = ("new_task", "tenant_id")
    NEW_TASK_FIELD_NUMBER: _ClassVar[int]
    TENANT_ID_FIELD_NUMBER: _ClassVar[int]
    new_task: _worker_pb2.Task
    tenant_id: str
    def __init__(self, new_task: _Optional[_Union[_worker_pb2.Task, _Mapping]] = ..., tenant_id: _Optional[str] = ...) -> None: ...
