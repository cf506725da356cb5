"""What each runtime's own endpoint says of its name and version, and what is not an answer."""

import json

import pytest

from protocol.agent.runtime_identity import IDENTITY_PATHS, identity_of


@pytest.mark.parametrize(("path", "document", "expected"), [
    ("/props", {"build_info": "b6000-1a2b3c4d", "total_slots": 4}, ("llama.cpp", "b6000-1a2b3c4d")),
    ("/get_server_info", {"version": "0.5.1", "tp_size": 1}, ("sglang", "0.5.1")),
    ("/version", {"version": "0.11.0"}, ("vllm", "0.11.0")),
    ("/api/version", {"version": "0.12.3"}, ("ollama", "0.12.3")),
])
def test_each_runtimes_answer_names_it_and_its_version(path, document, expected):
    assert identity_of(path, 200, json.dumps(document).encode()) == expected


@pytest.mark.parametrize(("path", "status", "body"), [
    ("/version", 404, b'{"detail": "Not Found"}'),
    ("/version", 200, b"not json"),
    ("/version", 200, b'["0.1"]'),
    ("/props", 200, b'{"total_slots": 4}'),  # an older llama.cpp without build_info
    ("/version", 200, b'{"version": ""}'),
    ("/version", 200, json.dumps({"version": "x" * 101}).encode()),
    ("/elsewhere", 200, b'{"version": "1"}'),
])
def test_what_does_not_say_is_no_answer(path, status, body):
    assert identity_of(path, status, body) is None


def test_the_runtime_specific_paths_are_asked_before_vllms_version():
    assert IDENTITY_PATHS.index("/version") > IDENTITY_PATHS.index("/props")
    assert IDENTITY_PATHS.index("/version") > IDENTITY_PATHS.index("/get_server_info")
