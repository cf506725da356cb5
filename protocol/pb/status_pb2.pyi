from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class EngineStatus(_message.Message):
    __slots__ = ("engine_id", "ready", "models", "cluster_id", "infx_capabilities", "infx_instance", "infx_runtime", "infx_runtime_slots", "infx_slot_keeping", "infx_runtime_name")
    class Model(_message.Message):
        __slots__ = ("id", "is_ready", "in_progress_task_count", "gpu_allocated", "is_dynamically_loaded_lora", "status_details", "runtime_load", "infx_prefix_tips", "infx_prompt_cache")
        class StatusDetails(_message.Message):
            __slots__ = ("num_ready_pods", "num_total_pods", "status_message")
            NUM_READY_PODS_FIELD_NUMBER: _ClassVar[int]
            NUM_TOTAL_PODS_FIELD_NUMBER: _ClassVar[int]
            STATUS_MESSAGE_FIELD_NUMBER: _ClassVar[int]
            num_ready_pods: int
            num_total_pods: int
            status_message: str
            def __init__(self, num_ready_pods: _Optional[int] = ..., num_total_pods: _Optional[int] = ..., status_message: _Optional[str] = ...) -> None: ...
        ID_FIELD_NUMBER: _ClassVar[int]
        IS_READY_FIELD_NUMBER: _ClassVar[int]
        IN_PROGRESS_TASK_COUNT_FIELD_NUMBER: _ClassVar[int]
        GPU_ALLOCATED_FIELD_NUMBER: _ClassVar[int]
        IS_DYNAMICALLY_LOADED_LORA_FIELD_NUMBER: _ClassVar[int]
        STATUS_DETAILS_FIELD_NUMBER: _ClassVar[int]
        RUNTIME_LOAD_FIELD_NUMBER: _ClassVar[int]
        INFX_PREFIX_TIPS_FIELD_NUMBER: _ClassVar[int]
        INFX_PROMPT_CACHE_FIELD_NUMBER: _ClassVar[int]
        id: str
        is_ready: bool
        in_progress_task_count: int
        gpu_allocated: int
        is_dynamically_loaded_lora: bool
        status_details: EngineStatus.Model.StatusDetails
        runtime_load: EngineStatus.RuntimeLoad
        infx_prefix_tips: _containers.RepeatedScalarFieldContainer[int]
        infx_prompt_cache: EngineStatus.PromptCache
        def __init__(self, id: _Optional[str] = ..., is_ready: _Optional[bool] = ..., in_progress_task_count: _Optional[int] = ..., gpu_allocated: _Optional[int] = ..., is_dynamically_loaded_lora: _Optional[bool] = ..., status_details: _Optional[_Union[EngineStatus.Model.StatusDetails, _Mapping]] = ..., runtime_load: _Optional[_Union[EngineStatus.RuntimeLoad, _Mapping]] = ..., infx_prefix_tips: _Optional[_Iterable[int]] = ..., infx_prompt_cache: _Optional[_Union[EngineStatus.PromptCache, _Mapping]] = ...) -> None: ...
    class PromptCache(_message.Message):
        __slots__ = ("answers", "prompt_tokens", "cached_tokens")
        ANSWERS_FIELD_NUMBER: _ClassVar[int]
        PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
        CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
        answers: int
        prompt_tokens: int
        cached_tokens: int
        def __init__(self, answers: _Optional[int] = ..., prompt_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ...) -> None: ...
    class RuntimeLoad(_message.Message):
        __slots__ = ("running_requests", "waiting_requests", "kv_cache_usage", "prefix_cache_hit_rate", "loaded_adapters", "source", "tasks_received", "tasks_ended")
        RUNNING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
        WAITING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
        KV_CACHE_USAGE_FIELD_NUMBER: _ClassVar[int]
        PREFIX_CACHE_HIT_RATE_FIELD_NUMBER: _ClassVar[int]
        LOADED_ADAPTERS_FIELD_NUMBER: _ClassVar[int]
        SOURCE_FIELD_NUMBER: _ClassVar[int]
        TASKS_RECEIVED_FIELD_NUMBER: _ClassVar[int]
        TASKS_ENDED_FIELD_NUMBER: _ClassVar[int]
        running_requests: int
        waiting_requests: int
        kv_cache_usage: float
        prefix_cache_hit_rate: float
        loaded_adapters: _containers.RepeatedScalarFieldContainer[str]
        source: str
        tasks_received: int
        tasks_ended: int
        def __init__(self, running_requests: _Optional[int] = ..., waiting_requests: _Optional[int] = ..., kv_cache_usage: _Optional[float] = ..., prefix_cache_hit_rate: _Optional[float] = ..., loaded_adapters: _Optional[_Iterable[str]] = ..., source: _Optional[str] = ..., tasks_received: _Optional[int] = ..., tasks_ended: _Optional[int] = ...) -> None: ...
    class RuntimeInfo(_message.Message):
        __slots__ = ("kind", "version", "agent_version")
        KIND_FIELD_NUMBER: _ClassVar[int]
        VERSION_FIELD_NUMBER: _ClassVar[int]
        AGENT_VERSION_FIELD_NUMBER: _ClassVar[int]
        kind: str
        version: str
        agent_version: str
        def __init__(self, kind: _Optional[str] = ..., version: _Optional[str] = ..., agent_version: _Optional[str] = ...) -> None: ...
    class SlotKeeping(_message.Message):
        __slots__ = ("held", "restored", "cold", "failed", "saved", "off")
        HELD_FIELD_NUMBER: _ClassVar[int]
        RESTORED_FIELD_NUMBER: _ClassVar[int]
        COLD_FIELD_NUMBER: _ClassVar[int]
        FAILED_FIELD_NUMBER: _ClassVar[int]
        SAVED_FIELD_NUMBER: _ClassVar[int]
        OFF_FIELD_NUMBER: _ClassVar[int]
        held: int
        restored: int
        cold: int
        failed: int
        saved: int
        off: bool
        def __init__(self, held: _Optional[int] = ..., restored: _Optional[int] = ..., cold: _Optional[int] = ..., failed: _Optional[int] = ..., saved: _Optional[int] = ..., off: _Optional[bool] = ...) -> None: ...
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    READY_FIELD_NUMBER: _ClassVar[int]
    MODELS_FIELD_NUMBER: _ClassVar[int]
    CLUSTER_ID_FIELD_NUMBER: _ClassVar[int]
    INFX_CAPABILITIES_FIELD_NUMBER: _ClassVar[int]
    INFX_INSTANCE_FIELD_NUMBER: _ClassVar[int]
    INFX_RUNTIME_FIELD_NUMBER: _ClassVar[int]
    INFX_RUNTIME_SLOTS_FIELD_NUMBER: _ClassVar[int]
    INFX_SLOT_KEEPING_FIELD_NUMBER: _ClassVar[int]
    INFX_RUNTIME_NAME_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    ready: bool
    models: _containers.RepeatedCompositeFieldContainer[EngineStatus.Model]
    cluster_id: str
    infx_capabilities: _containers.RepeatedScalarFieldContainer[str]
    infx_instance: str
    infx_runtime: EngineStatus.RuntimeInfo
    infx_runtime_slots: int
    infx_slot_keeping: EngineStatus.SlotKeeping
    infx_runtime_name: str
    def __init__(self, engine_id: _Optional[str] = ..., ready: _Optional[bool] = ..., models: _Optional[_Iterable[_Union[EngineStatus.Model, _Mapping]]] = ..., cluster_id: _Optional[str] = ..., infx_capabilities: _Optional[_Iterable[str]] = ..., infx_instance: _Optional[str] = ..., infx_runtime: _Optional[_Union[EngineStatus.RuntimeInfo, _Mapping]] = ..., infx_runtime_slots: _Optional[int] = ..., infx_slot_keeping: _Optional[_Union[EngineStatus.SlotKeeping, _Mapping]] = ..., infx_runtime_name: _Optional[str] = ...) -> None: ...
