"""Every error class in protocol/ is either caller misuse or remote misbehaviour, never both or neither."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import pytest

import protocol
from protocol.errors import LocalUsageError, RemoteProtocolError


def _error_classes() -> list[type[BaseException]]:
    found: dict[str, type[BaseException]] = {}
    for module_info in pkgutil.walk_packages(protocol.__path__, "protocol."):
        if module_info.name.startswith("protocol.pb"):
            continue
        module = importlib.import_module(module_info.name)
        for name, value in vars(module).items():
            if (inspect.isclass(value) and issubclass(value, BaseException) and not name.startswith("_")
                    and value.__module__ == module.__name__):
                found[f"{value.__module__}.{value.__qualname__}"] = value
    return [found[key] for key in sorted(found)]


ERROR_CLASSES = _error_classes()
#: Neither kind by design: a base both kinds share, and a codec's value error that the gRPC
#: machine turns into one kind or the other (InvalidMetadata for the caller, a status for the peer).
#: Neither is raised to a caller as it is.
NEITHER = {"protocol.processor.errors.ProcessorError", "protocol.grpc.metadata.MetadataError"}


def test_the_walk_finds_the_machines_errors():
    names = {cls.__name__ for cls in ERROR_CLASSES}
    assert {"AgentUsageError", "GatewayProtocolError", "OpenAIError", "LocalUsageError",
            "RemoteProtocolError", "HealthUsageError"} <= names


@pytest.mark.parametrize("cls", ERROR_CLASSES, ids=lambda cls: f"{cls.__module__}.{cls.__qualname__}")
def test_each_error_is_exactly_one_kind(cls):
    if cls in (LocalUsageError, RemoteProtocolError):
        return
    if f"{cls.__module__}.{cls.__qualname__}" in NEITHER:
        assert not issubclass(cls, (LocalUsageError, RemoteProtocolError))
        return
    kinds = [base for base in (LocalUsageError, RemoteProtocolError) if issubclass(cls, base)]
    assert len(kinds) == 1, f"{cls.__qualname__} derives from {kinds or 'neither base'}"


def test_the_bases_are_unrelated_and_subclasses_keep_their_names_and_meaning():
    assert not issubclass(LocalUsageError, RemoteProtocolError)
    assert not issubclass(RemoteProtocolError, LocalUsageError)
    from protocol.openai.errors import InvalidRequestError

    error = InvalidRequestError("bad", param="model")
    assert isinstance(error, RemoteProtocolError) and error.status == 400
    assert error.body()["error"]["type"] == "invalid_request_error"


def test_a_class_of_neither_kind_is_never_raised_as_it_is():
    from pathlib import Path

    root = Path(__file__).resolve().parents[2] / "protocol"
    raised = "".join(path.read_text() for path in root.rglob("*.py") if "pb" not in path.parts)
    assert "raise ProcessorError(" not in raised
    from protocol.grpc.metadata import MetadataError, validate_metadata
    from protocol.grpc.types import InvalidMetadata

    assert issubclass(InvalidMetadata, MetadataError) and issubclass(InvalidMetadata, LocalUsageError)
    with pytest.raises(MetadataError):
        validate_metadata([("bad key", "x")])
