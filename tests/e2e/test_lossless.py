"""The lossless path, end to end: official openai client -> ``twistd infx`` -> ``twistd infx-engine
--runtime openai`` -> the recording runtime, against the same client talking to the runtime directly.

Each request shape of the table is sent twice with the same scripted answer:
straight to the recording runtime, and through infx. What the runtime received
must be the same both times (method, path and query, headers but the ones a
hop owns, body byte for byte; a multipart form part by part, since the client
picks a new boundary each time), and so must what the client got back (status,
reason, headers but hop-by-hop ones, body or stream byte for byte).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from harness.recording_runtime import Answer, RecordingRuntime
from harness.twistd_processes import Engine, Gateway
from tests.support.lossless import (
    EXCHANGED, JSON, MODEL, RATE_LIMITED, SHAPES, TOOLS, Shape, client_for, exchange, request_view,
)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RecordingRuntime, Gateway]]:
    logs = tmp_path_factory.mktemp("lossless")
    runtime = RecordingRuntime(logs)
    gateway = engine = None
    try:
        gateway = Gateway(logs)
        engine = Engine(logs, gateway, "infx-engine", [MODEL], runtime="openai", upstream=runtime.url)
        yield runtime, gateway
    finally:
        for child in (engine, gateway, runtime):
            if child is not None:
                child.stop()


@pytest.mark.parametrize("shape", SHAPES, ids=[s.name for s in SHAPES])
def test_the_runtime_gets_what_the_client_sent_and_the_client_gets_what_the_runtime_answered(
        stack: tuple[RecordingRuntime, Gateway], shape: Shape) -> None:
    runtime, gateway = stack
    direct, via, received = exchange(runtime, gateway.base_url, shape)
    assert len(received) == 2, [r.path for r in received]
    assert request_view(received[1]) == request_view(received[0])
    assert received[1].header("x-request-id"), "the gateway names the request for the runtime"
    assert via == direct
    assert via.body == shape.answer.payload
    assert via.status == shape.answer.status


def test_a_runtimes_429_and_its_rate_limit_headers_reach_the_client_unchanged_and_are_not_resent(
        tmp_path: Any) -> None:
    """Its Retry-After is longer than the queue timeout and no other engine serves the model,
    so waiting cannot help: the client gets the runtime's own answer at once, sent to it once."""
    runtime = RecordingRuntime(tmp_path)
    gateway = engine = None
    try:
        gateway = Gateway(tmp_path)
        engine = Engine(tmp_path, gateway, "infx-engine", [MODEL], runtime="openai", upstream=runtime.url)
        direct, via, received = exchange(runtime, gateway.base_url, RATE_LIMITED)
    finally:
        for child in (engine, gateway, runtime):
            if child is not None:
                child.stop()
    assert len(received) == 2, [r.path for r in received]
    assert request_view(received[1]) == request_view(received[0])
    assert via == direct
    assert via.status == 429 and ("retry-after", "60") in via.headers
    assert ("x-ratelimit-remaining-requests", "0") in via.headers


def test_the_table_covers_sixty_request_shapes() -> None:
    assert len(SHAPES) >= 60


# --- across the exchange: the request enters gateway A, the engine is attached to gateway B ------------

@pytest.fixture(scope="module")
def exchange_stack(stack: tuple[RecordingRuntime, Gateway], tmp_path_factory: pytest.TempPathFactory,
                   ) -> Iterator[tuple[RecordingRuntime, Gateway]]:
    """Gateway A with no engine of its own, peered with gateway B, which serves the recording runtime."""
    runtime, _ = stack
    logs = tmp_path_factory.mktemp("lossless-exchange")
    a = b = engine = None
    try:
        a = Gateway(logs, name="gateway-a", extra=["--status-interval", "0.2"])
        b = Gateway(logs, name="gateway-b",
                    extra=["--peers", f"127.0.0.1:{a.internal_port}", "--status-interval", "0.2"])
        engine = Engine(logs, b, "engine-on-b", [MODEL], runtime="openai", upstream=runtime.url)
        a.wait_for_engine(b.remote_engine_id("engine-on-b"), children=[b.child, engine.child])
        assert a.engines()[b.remote_engine_id("engine-on-b")]["locality"] == "remote"
        yield runtime, a
    finally:
        for child in (engine, b, a):
            if child is not None:
                child.stop()


@pytest.mark.parametrize("shape", EXCHANGED, ids=[s.name for s in EXCHANGED])
def test_a_request_served_by_a_peer_gateways_engine_is_as_lossless_as_a_local_one(
        exchange_stack: tuple[RecordingRuntime, Gateway], shape: Shape) -> None:
    runtime, gateway_a = exchange_stack
    direct, via, received = exchange(runtime, gateway_a.base_url, shape)
    assert len(received) == 2
    assert request_view(received[1]) == request_view(received[0])
    assert via == direct and via.body == shape.answer.payload


# --- a LLMariner engine still gets the typed fields it knows -------------------------------------------


@pytest.fixture(scope="module")
def llmariner_gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Gateway, Any]]:
    from harness.llmariner_engine import LLMarinerEngine

    logs = tmp_path_factory.mktemp("lossless-llmariner")
    gateway = Gateway(logs)
    engine = None
    try:
        engine = LLMarinerEngine(gateway.worker_address, "llmariner-engine", [MODEL])
        gateway.wait_for_engine("llmariner-engine")
        yield gateway, engine
    finally:
        if engine is not None:
            engine.close()
        gateway.stop()


def test_a_llmariner_engine_gets_the_typed_request_and_never_the_verbatim_body(
        llmariner_gateway: tuple[Gateway, Any]) -> None:
    gateway, engine = llmariner_gateway
    answer = client_for(gateway.base_url).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hello there"}], seed=5, temperature=0.5, tools=TOOLS,
        max_completion_tokens=9, extra_body={"top_k": 3})
    assert answer.choices[0].message.content == "llmariner: hello there"
    task = engine.tasks[-1]
    assert not task.request.HasField("http_request") and not task.request.typed_request_incomplete
    typed = task.request.chat_completion
    assert (typed.seed, typed.temperature, typed.max_completion_tokens) == (5, 0.5, 9)
    assert typed.tools[0].function.name == "get_weather"


def test_legacy_completions_reach_a_llmariner_engine_as_chat_and_come_back_as_completions(
        llmariner_gateway: tuple[Gateway, Any]) -> None:
    gateway, engine = llmariner_gateway
    answer = client_for(gateway.base_url).completions.create(model=MODEL, prompt="four words in here")
    assert answer.object == "text_completion" and answer.choices[0].text == "llmariner: four words in here"
    assert engine.tasks[-1].request.chat_completion.messages[0].content[0].text == "four words in here"


def test_a_request_with_no_typed_form_is_refused_with_400_when_only_llmariner_engines_serve_the_model(
        llmariner_gateway: tuple[Gateway, Any]) -> None:
    gateway, engine = llmariner_gateway
    seen = len(engine.tasks)
    with pytest.raises(openai.BadRequestError) as caught:
        client_for(gateway.base_url).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": [
            {"type": "video_url", "video_url": {"url": "https://example.invalid/v.mp4"}}]}])
    assert "video_url" in caught.value.message
    assert caught.value.body["param"] == "messages[0].content[0].type"
    assert len(engine.tasks) == seen


def test_tokenize_reaches_the_runtime_at_its_root_path_with_the_clients_body(
        stack: tuple[RecordingRuntime, Gateway]) -> None:
    import urllib.request

    runtime, gateway = stack
    runtime.reset()
    runtime.script(Answer(headers=JSON, body=b'{"count":2,"max_model_len":16,"tokens":[1,2]}'))
    body = b'{"model": "m", "prompt": "hi", "add_special_tokens": false}'
    request = urllib.request.Request(gateway.url + "/v1/tokenize", data=body, method="POST",
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=10) as response:
        assert response.read() == b'{"count":2,"max_model_len":16,"tokens":[1,2]}'
    (received,) = runtime.requests()
    assert (received.path, received.body) == ("/tokenize", body)
