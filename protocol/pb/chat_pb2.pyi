from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ChatCompletionMessage(_message.Message):
    __slots__ = ("content", "role", "name", "tool_calls", "tool_call_id")
    class ToolCall(_message.Message):
        __slots__ = ("id", "type", "function")
        class Function(_message.Message):
            __slots__ = ("name", "arguments")
            NAME_FIELD_NUMBER: _ClassVar[int]
            ARGUMENTS_FIELD_NUMBER: _ClassVar[int]
            name: str
            arguments: str
            def __init__(self, name: _Optional[str] = ..., arguments: _Optional[str] = ...) -> None: ...
        ID_FIELD_NUMBER: _ClassVar[int]
        TYPE_FIELD_NUMBER: _ClassVar[int]
        FUNCTION_FIELD_NUMBER: _ClassVar[int]
        id: str
        type: str
        function: ChatCompletionMessage.ToolCall.Function
        def __init__(self, id: _Optional[str] = ..., type: _Optional[str] = ..., function: _Optional[_Union[ChatCompletionMessage.ToolCall.Function, _Mapping]] = ...) -> None: ...
    class Content(_message.Message):
        __slots__ = ("type", "text", "image_url", "input_audio", "audio_url")
        class ImageUrl(_message.Message):
            __slots__ = ("url", "detail")
            URL_FIELD_NUMBER: _ClassVar[int]
            DETAIL_FIELD_NUMBER: _ClassVar[int]
            url: str
            detail: str
            def __init__(self, url: _Optional[str] = ..., detail: _Optional[str] = ...) -> None: ...
        class InputAudio(_message.Message):
            __slots__ = ("data", "format")
            DATA_FIELD_NUMBER: _ClassVar[int]
            FORMAT_FIELD_NUMBER: _ClassVar[int]
            data: str
            format: str
            def __init__(self, data: _Optional[str] = ..., format: _Optional[str] = ...) -> None: ...
        class AudioUrl(_message.Message):
            __slots__ = ("url",)
            URL_FIELD_NUMBER: _ClassVar[int]
            url: str
            def __init__(self, url: _Optional[str] = ...) -> None: ...
        TYPE_FIELD_NUMBER: _ClassVar[int]
        TEXT_FIELD_NUMBER: _ClassVar[int]
        IMAGE_URL_FIELD_NUMBER: _ClassVar[int]
        INPUT_AUDIO_FIELD_NUMBER: _ClassVar[int]
        AUDIO_URL_FIELD_NUMBER: _ClassVar[int]
        type: str
        text: str
        image_url: ChatCompletionMessage.Content.ImageUrl
        input_audio: ChatCompletionMessage.Content.InputAudio
        audio_url: ChatCompletionMessage.Content.AudioUrl
        def __init__(self, type: _Optional[str] = ..., text: _Optional[str] = ..., image_url: _Optional[_Union[ChatCompletionMessage.Content.ImageUrl, _Mapping]] = ..., input_audio: _Optional[_Union[ChatCompletionMessage.Content.InputAudio, _Mapping]] = ..., audio_url: _Optional[_Union[ChatCompletionMessage.Content.AudioUrl, _Mapping]] = ...) -> None: ...
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALL_ID_FIELD_NUMBER: _ClassVar[int]
    content: _containers.RepeatedCompositeFieldContainer[ChatCompletionMessage.Content]
    role: str
    name: str
    tool_calls: _containers.RepeatedCompositeFieldContainer[ChatCompletionMessage.ToolCall]
    tool_call_id: str
    def __init__(self, content: _Optional[_Iterable[_Union[ChatCompletionMessage.Content, _Mapping]]] = ..., role: _Optional[str] = ..., name: _Optional[str] = ..., tool_calls: _Optional[_Iterable[_Union[ChatCompletionMessage.ToolCall, _Mapping]]] = ..., tool_call_id: _Optional[str] = ...) -> None: ...

class CreateChatCompletionRequest(_message.Message):
    __slots__ = ("messages", "model", "frequency_penalty", "logit_bias", "logprobs", "top_logprobs", "max_tokens", "n", "presence_penalty", "response_format", "seed", "stop", "stream", "temperature", "top_p", "tools", "tool_choice", "user", "stream_options", "tool_choice_object", "max_completion_tokens", "encoded_chat_template_kwargs", "is_temperature_set", "is_top_p_set")
    class ToolChoice(_message.Message):
        __slots__ = ("type", "function")
        class Function(_message.Message):
            __slots__ = ("name",)
            NAME_FIELD_NUMBER: _ClassVar[int]
            name: str
            def __init__(self, name: _Optional[str] = ...) -> None: ...
        TYPE_FIELD_NUMBER: _ClassVar[int]
        FUNCTION_FIELD_NUMBER: _ClassVar[int]
        type: str
        function: CreateChatCompletionRequest.ToolChoice.Function
        def __init__(self, type: _Optional[str] = ..., function: _Optional[_Union[CreateChatCompletionRequest.ToolChoice.Function, _Mapping]] = ...) -> None: ...
    class ResponseFormat(_message.Message):
        __slots__ = ("type", "json_schema")
        class JsonSchema(_message.Message):
            __slots__ = ("name", "description", "encoded_schema", "strict")
            NAME_FIELD_NUMBER: _ClassVar[int]
            DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
            ENCODED_SCHEMA_FIELD_NUMBER: _ClassVar[int]
            STRICT_FIELD_NUMBER: _ClassVar[int]
            name: str
            description: str
            encoded_schema: str
            strict: bool
            def __init__(self, name: _Optional[str] = ..., description: _Optional[str] = ..., encoded_schema: _Optional[str] = ..., strict: _Optional[bool] = ...) -> None: ...
        TYPE_FIELD_NUMBER: _ClassVar[int]
        JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
        type: str
        json_schema: CreateChatCompletionRequest.ResponseFormat.JsonSchema
        def __init__(self, type: _Optional[str] = ..., json_schema: _Optional[_Union[CreateChatCompletionRequest.ResponseFormat.JsonSchema, _Mapping]] = ...) -> None: ...
    class Tool(_message.Message):
        __slots__ = ("type", "function")
        class Function(_message.Message):
            __slots__ = ("description", "name", "encoded_parameters")
            DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
            NAME_FIELD_NUMBER: _ClassVar[int]
            ENCODED_PARAMETERS_FIELD_NUMBER: _ClassVar[int]
            description: str
            name: str
            encoded_parameters: str
            def __init__(self, description: _Optional[str] = ..., name: _Optional[str] = ..., encoded_parameters: _Optional[str] = ...) -> None: ...
        TYPE_FIELD_NUMBER: _ClassVar[int]
        FUNCTION_FIELD_NUMBER: _ClassVar[int]
        type: str
        function: CreateChatCompletionRequest.Tool.Function
        def __init__(self, type: _Optional[str] = ..., function: _Optional[_Union[CreateChatCompletionRequest.Tool.Function, _Mapping]] = ...) -> None: ...
    class StreamOptions(_message.Message):
        __slots__ = ("include_usage",)
        INCLUDE_USAGE_FIELD_NUMBER: _ClassVar[int]
        include_usage: bool
        def __init__(self, include_usage: _Optional[bool] = ...) -> None: ...
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FORMAT_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STREAM_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOOLS_FIELD_NUMBER: _ClassVar[int]
    TOOL_CHOICE_FIELD_NUMBER: _ClassVar[int]
    USER_FIELD_NUMBER: _ClassVar[int]
    STREAM_OPTIONS_FIELD_NUMBER: _ClassVar[int]
    TOOL_CHOICE_OBJECT_FIELD_NUMBER: _ClassVar[int]
    MAX_COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ENCODED_CHAT_TEMPLATE_KWARGS_FIELD_NUMBER: _ClassVar[int]
    IS_TEMPERATURE_SET_FIELD_NUMBER: _ClassVar[int]
    IS_TOP_P_SET_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatCompletionMessage]
    model: str
    frequency_penalty: float
    logit_bias: _containers.ScalarMap[str, float]
    logprobs: bool
    top_logprobs: int
    max_tokens: int
    n: int
    presence_penalty: float
    response_format: CreateChatCompletionRequest.ResponseFormat
    seed: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    stream: bool
    temperature: float
    top_p: float
    tools: _containers.RepeatedCompositeFieldContainer[CreateChatCompletionRequest.Tool]
    tool_choice: str
    user: str
    stream_options: CreateChatCompletionRequest.StreamOptions
    tool_choice_object: CreateChatCompletionRequest.ToolChoice
    max_completion_tokens: int
    encoded_chat_template_kwargs: str
    is_temperature_set: bool
    is_top_p_set: bool
    def __init__(self, messages: _Optional[_Iterable[_Union[ChatCompletionMessage, _Mapping]]] = ..., model: _Optional[str] = ..., frequency_penalty: _Optional[float] = ..., logit_bias: _Optional[_Mapping[str, float]] = ..., logprobs: _Optional[bool] = ..., top_logprobs: _Optional[int] = ..., max_tokens: _Optional[int] = ..., n: _Optional[int] = ..., presence_penalty: _Optional[float] = ..., response_format: _Optional[_Union[CreateChatCompletionRequest.ResponseFormat, _Mapping]] = ..., seed: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., stream: _Optional[bool] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., tools: _Optional[_Iterable[_Union[CreateChatCompletionRequest.Tool, _Mapping]]] = ..., tool_choice: _Optional[str] = ..., user: _Optional[str] = ..., stream_options: _Optional[_Union[CreateChatCompletionRequest.StreamOptions, _Mapping]] = ..., tool_choice_object: _Optional[_Union[CreateChatCompletionRequest.ToolChoice, _Mapping]] = ..., max_completion_tokens: _Optional[int] = ..., encoded_chat_template_kwargs: _Optional[str] = ..., is_temperature_set: _Optional[bool] = ..., is_top_p_set: _Optional[bool] = ...) -> None: ...
