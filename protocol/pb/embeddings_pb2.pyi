from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class CreateEmbeddingRequest(_message.Message):
    __slots__ = ("input", "model", "encoding_format", "dimensions", "user", "encoded_input")
    INPUT_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    ENCODING_FORMAT_FIELD_NUMBER: _ClassVar[int]
    DIMENSIONS_FIELD_NUMBER: _ClassVar[int]
    USER_FIELD_NUMBER: _ClassVar[int]
    ENCODED_INPUT_FIELD_NUMBER: _ClassVar[int]
    input: str
    model: str
    encoding_format: str
    dimensions: int
    user: str
    encoded_input: str
    def __init__(self, input: _Optional[str] = ..., model: _Optional[str] = ..., encoding_format: _Optional[str] = ..., dimensions: _Optional[int] = ..., user: _Optional[str] = ..., encoded_input: _Optional[str] = ...) -> None: ...
