from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class CreateAudioTranscriptionRequest(_message.Message):
    __slots__ = ("file", "filename", "model", "prompt", "language", "response_format", "stream", "temperature")
    FILE_FIELD_NUMBER: _ClassVar[int]
    FILENAME_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    LANGUAGE_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FORMAT_FIELD_NUMBER: _ClassVar[int]
    STREAM_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    file: bytes
    filename: str
    model: str
    prompt: str
    language: str
    response_format: str
    stream: bool
    temperature: float
    def __init__(self, file: _Optional[bytes] = ..., filename: _Optional[str] = ..., model: _Optional[str] = ..., prompt: _Optional[str] = ..., language: _Optional[str] = ..., response_format: _Optional[str] = ..., stream: _Optional[bool] = ..., temperature: _Optional[float] = ...) -> None: ...
