from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class CreateModelResponseRequest(_message.Message):
    __slots__ = ("background", "include", "input", "encoded_input", "instructions", "max_output_tokens", "max_tool_calls", "metadata", "model", "parallel_tool_calls", "previous_response_id", "prompt", "prompt_cache_key", "reasoning", "safety_identifier", "service_tier", "store", "stream", "stream_options", "temperature", "is_temperature_set", "text", "tool_choice", "tool_choice_object", "top_logprobs", "top_p", "is_top_p_set", "truncation", "user", "encoded_tools")
    class Input(_message.Message):
        __slots__ = ("type", "content", "role", "status", "id")
        class Content(_message.Message):
            __slots__ = ("type", "text", "detail", "image_url", "file_id", "file_data", "file_url", "filename")
            TYPE_FIELD_NUMBER: _ClassVar[int]
            TEXT_FIELD_NUMBER: _ClassVar[int]
            DETAIL_FIELD_NUMBER: _ClassVar[int]
            IMAGE_URL_FIELD_NUMBER: _ClassVar[int]
            FILE_ID_FIELD_NUMBER: _ClassVar[int]
            FILE_DATA_FIELD_NUMBER: _ClassVar[int]
            FILE_URL_FIELD_NUMBER: _ClassVar[int]
            FILENAME_FIELD_NUMBER: _ClassVar[int]
            type: str
            text: str
            detail: str
            image_url: str
            file_id: str
            file_data: str
            file_url: str
            filename: str
            def __init__(self, type: _Optional[str] = ..., text: _Optional[str] = ..., detail: _Optional[str] = ..., image_url: _Optional[str] = ..., file_id: _Optional[str] = ..., file_data: _Optional[str] = ..., file_url: _Optional[str] = ..., filename: _Optional[str] = ...) -> None: ...
        TYPE_FIELD_NUMBER: _ClassVar[int]
        CONTENT_FIELD_NUMBER: _ClassVar[int]
        ROLE_FIELD_NUMBER: _ClassVar[int]
        STATUS_FIELD_NUMBER: _ClassVar[int]
        ID_FIELD_NUMBER: _ClassVar[int]
        type: str
        content: _containers.RepeatedCompositeFieldContainer[CreateModelResponseRequest.Input.Content]
        role: str
        status: str
        id: str
        def __init__(self, type: _Optional[str] = ..., content: _Optional[_Iterable[_Union[CreateModelResponseRequest.Input.Content, _Mapping]]] = ..., role: _Optional[str] = ..., status: _Optional[str] = ..., id: _Optional[str] = ...) -> None: ...
    class Prompt(_message.Message):
        __slots__ = ("id", "version")
        ID_FIELD_NUMBER: _ClassVar[int]
        VERSION_FIELD_NUMBER: _ClassVar[int]
        id: str
        version: str
        def __init__(self, id: _Optional[str] = ..., version: _Optional[str] = ...) -> None: ...
    class Reasoning(_message.Message):
        __slots__ = ("effort", "generate_summary", "summary")
        EFFORT_FIELD_NUMBER: _ClassVar[int]
        GENERATE_SUMMARY_FIELD_NUMBER: _ClassVar[int]
        SUMMARY_FIELD_NUMBER: _ClassVar[int]
        effort: str
        generate_summary: str
        summary: str
        def __init__(self, effort: _Optional[str] = ..., generate_summary: _Optional[str] = ..., summary: _Optional[str] = ...) -> None: ...
    class StreamOptions(_message.Message):
        __slots__ = ("include_obfuscation",)
        INCLUDE_OBFUSCATION_FIELD_NUMBER: _ClassVar[int]
        include_obfuscation: bool
        def __init__(self, include_obfuscation: _Optional[bool] = ...) -> None: ...
    class Text(_message.Message):
        __slots__ = ("format", "verbosity")
        class Format(_message.Message):
            __slots__ = ("type", "name", "encoded_schema", "description", "strict")
            TYPE_FIELD_NUMBER: _ClassVar[int]
            NAME_FIELD_NUMBER: _ClassVar[int]
            ENCODED_SCHEMA_FIELD_NUMBER: _ClassVar[int]
            DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
            STRICT_FIELD_NUMBER: _ClassVar[int]
            type: str
            name: str
            encoded_schema: str
            description: str
            strict: bool
            def __init__(self, type: _Optional[str] = ..., name: _Optional[str] = ..., encoded_schema: _Optional[str] = ..., description: _Optional[str] = ..., strict: _Optional[bool] = ...) -> None: ...
        FORMAT_FIELD_NUMBER: _ClassVar[int]
        VERBOSITY_FIELD_NUMBER: _ClassVar[int]
        format: CreateModelResponseRequest.Text.Format
        verbosity: str
        def __init__(self, format: _Optional[_Union[CreateModelResponseRequest.Text.Format, _Mapping]] = ..., verbosity: _Optional[str] = ...) -> None: ...
    class ToolChoice(_message.Message):
        __slots__ = ("type", "name", "mode", "encoded_tools", "server_label")
        TYPE_FIELD_NUMBER: _ClassVar[int]
        NAME_FIELD_NUMBER: _ClassVar[int]
        MODE_FIELD_NUMBER: _ClassVar[int]
        ENCODED_TOOLS_FIELD_NUMBER: _ClassVar[int]
        SERVER_LABEL_FIELD_NUMBER: _ClassVar[int]
        type: str
        name: str
        mode: str
        encoded_tools: str
        server_label: str
        def __init__(self, type: _Optional[str] = ..., name: _Optional[str] = ..., mode: _Optional[str] = ..., encoded_tools: _Optional[str] = ..., server_label: _Optional[str] = ...) -> None: ...
    class MetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    BACKGROUND_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_FIELD_NUMBER: _ClassVar[int]
    INPUT_FIELD_NUMBER: _ClassVar[int]
    ENCODED_INPUT_FIELD_NUMBER: _ClassVar[int]
    INSTRUCTIONS_FIELD_NUMBER: _ClassVar[int]
    MAX_OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PARALLEL_TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    PREVIOUS_RESPONSE_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_CACHE_KEY_FIELD_NUMBER: _ClassVar[int]
    REASONING_FIELD_NUMBER: _ClassVar[int]
    SAFETY_IDENTIFIER_FIELD_NUMBER: _ClassVar[int]
    SERVICE_TIER_FIELD_NUMBER: _ClassVar[int]
    STORE_FIELD_NUMBER: _ClassVar[int]
    STREAM_FIELD_NUMBER: _ClassVar[int]
    STREAM_OPTIONS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    IS_TEMPERATURE_SET_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOOL_CHOICE_FIELD_NUMBER: _ClassVar[int]
    TOOL_CHOICE_OBJECT_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    IS_TOP_P_SET_FIELD_NUMBER: _ClassVar[int]
    TRUNCATION_FIELD_NUMBER: _ClassVar[int]
    USER_FIELD_NUMBER: _ClassVar[int]
    ENCODED_TOOLS_FIELD_NUMBER: _ClassVar[int]
    background: bool
    include: _containers.RepeatedScalarFieldContainer[str]
    input: str
    encoded_input: str
    instructions: str
    max_output_tokens: int
    max_tool_calls: int
    metadata: _containers.ScalarMap[str, str]
    model: str
    parallel_tool_calls: bool
    previous_response_id: str
    prompt: CreateModelResponseRequest.Prompt
    prompt_cache_key: str
    reasoning: CreateModelResponseRequest.Reasoning
    safety_identifier: str
    service_tier: str
    store: bool
    stream: bool
    stream_options: CreateModelResponseRequest.StreamOptions
    temperature: float
    is_temperature_set: bool
    text: CreateModelResponseRequest.Text
    tool_choice: str
    tool_choice_object: CreateModelResponseRequest.ToolChoice
    top_logprobs: int
    top_p: float
    is_top_p_set: bool
    truncation: bool
    user: str
    encoded_tools: str
    def __init__(self, background: _Optional[bool] = ..., include: _Optional[_Iterable[str]] = ..., input: _Optional[str] = ..., encoded_input: _Optional[str] = ..., instructions: _Optional[str] = ..., max_output_tokens: _Optional[int] = ..., max_tool_calls: _Optional[int] = ..., metadata: _Optional[_Mapping[str, str]] = ..., model: _Optional[str] = ..., parallel_tool_calls: _Optional[bool] = ..., previous_response_id: _Optional[str] = ..., prompt: _Optional[_Union[CreateModelResponseRequest.Prompt, _Mapping]] = ..., prompt_cache_key: _Optional[str] = ..., reasoning: _Optional[_Union[CreateModelResponseRequest.Reasoning, _Mapping]] = ..., safety_identifier: _Optional[str] = ..., service_tier: _Optional[str] = ..., store: _Optional[bool] = ..., stream: _Optional[bool] = ..., stream_options: _Optional[_Union[CreateModelResponseRequest.StreamOptions, _Mapping]] = ..., temperature: _Optional[float] = ..., is_temperature_set: _Optional[bool] = ..., text: _Optional[_Union[CreateModelResponseRequest.Text, _Mapping]] = ..., tool_choice: _Optional[str] = ..., tool_choice_object: _Optional[_Union[CreateModelResponseRequest.ToolChoice, _Mapping]] = ..., top_logprobs: _Optional[int] = ..., top_p: _Optional[float] = ..., is_top_p_set: _Optional[bool] = ..., truncation: _Optional[bool] = ..., user: _Optional[str] = ..., encoded_tools: _Optional[str] = ...) -> None: ...
