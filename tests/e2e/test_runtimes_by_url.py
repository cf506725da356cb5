"""Runtimes by URL end to end: ``twistd infx --runtime-url`` (and ``--runtime-pod-label``) in front of real
runtimes, driven by the official ``openai`` client, with no engine agent process.

- llama.cpp's own server (the tiny model, behind its API key): answers through infx equal the
  server's own, chat and streamed chat and completions (:mod:`tests.support.llama_answers`);
- the recording runtime: the lossless suite's request shapes (:mod:`tests.support.lossless`), each
  sent straight to the runtime and through infx, must reach it and come back the same;
- one model served by a runtime by URL and a dial-in agent together;
- a peer gateway serving requests with another gateway's runtime by URL, through the exchange;
- a runtime pod found by its label on the test Kubernetes API server, by a twistd child.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import pytest_twisted
from twisted.internet import reactor, task, threads

from harness.gguf_models import write_model
from harness.llama_server import LlamaCppServer
from harness.recording_runtime import Answer, RecordingRuntime
from harness.twistd_processes import Engine, Gateway
from infx.gateway.runtime_engines import runtime_engine_id
from tests.support.llama_answers import messages, stable
from tests.support.lossless import EXCHANGED, MODEL, RATE_LIMITED, SHAPES, Shape, chat_answer, exchange, request_view

RUNTIME_KEY = "runtime-secret-by-url"


# --- llama.cpp's server -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llama_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LlamaCppServer, Gateway]]:
    logs = tmp_path_factory.mktemp("by-url-llama")
    key_file = logs / "runtime-key"
    key_file.write_text(RUNTIME_KEY + "\n")
    llama = LlamaCppServer(write_model(logs / "tiny.gguf"), logs, api_key=RUNTIME_KEY)
    gateway = None
    try:
        gateway = Gateway(logs, extra=["--runtime-url", llama.url, "--runtime-api-key-file", str(key_file)])
        gateway.wait_for_engine(gateway.runtime_engine_id(f"127.0.0.1:{llama.port}"), children=[llama])
        yield llama, gateway
    finally:
        for child in (gateway, llama):
            if child is not None:
                child.stop()


def llama_clients(stack: tuple[LlamaCppServer, Gateway]) -> tuple[openai.OpenAI, openai.OpenAI]:
    llama, gateway = stack
    return (openai.OpenAI(base_url=llama.url + "/v1", api_key=RUNTIME_KEY, max_retries=0),
            openai.OpenAI(base_url=gateway.base_url, api_key="unused", max_retries=0))


def test_the_gateway_serves_the_model_llama_server_lists_as_a_local_engine(llama_stack):
    llama, gateway = llama_stack
    engine = gateway.engines()[gateway.runtime_engine_id(f"127.0.0.1:{llama.port}")]
    assert engine["locality"] == "local"
    assert [(m["id"], m["ready"]) for m in engine["models"]] == [("tiny", True)]


@pytest.mark.parametrize("extra", [
    pytest.param({"max_tokens": 16, "seed": 0}, id="seed 0"),
    pytest.param({"max_tokens": 24, "seed": 7, "stop": ["e", "a"]}, id="stop words"),
])
def test_a_chat_answer_by_url_equals_the_servers_own(llama_stack, extra):
    direct, through = llama_clients(llama_stack)
    request = {"model": "tiny", "messages": messages(f"By URL {extra['seed']}."), "temperature": 0, **extra}
    own = direct.chat.completions.create(**request).model_dump()
    answer = through.chat.completions.create(**request).model_dump()
    assert stable(answer) == stable(own)
    # Second and the same: all but one prompt token came from the server's cache, so it arrived as sent.
    assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == answer["usage"]["prompt_tokens"] - 1


def test_a_streamed_chat_by_url_equals_the_servers_own_chunk_by_chunk(llama_stack):
    direct, through = llama_clients(llama_stack)
    request = {"model": "tiny", "messages": messages("Stream by URL."), "temperature": 0, "seed": 3,
               "max_tokens": 24, "stream": True, "stream_options": {"include_usage": True}}
    own = [chunk.model_dump() for chunk in direct.chat.completions.create(**request)]
    answer = [chunk.model_dump() for chunk in through.chat.completions.create(**request)]
    assert stable(answer) == stable(own)
    assert len(answer) > 3 and answer[-1]["usage"]["completion_tokens"] == 24


def test_a_completion_by_url_equals_the_servers_own(llama_stack):
    direct, through = llama_clients(llama_stack)
    request = {"model": "tiny", "prompt": "the dog ran", "max_tokens": 12, "temperature": 0, "seed": 0}
    assert stable(through.completions.create(**request).model_dump()) == stable(
        direct.completions.create(**request).model_dump())


# --- the lossless suite's shapes, through the URL path --------------------------------------------------


@pytest.fixture(scope="module")
def recording_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RecordingRuntime, Gateway]]:
    logs = tmp_path_factory.mktemp("by-url-lossless")
    runtime = RecordingRuntime(logs)
    gateway = None
    try:
        gateway = Gateway(logs, extra=["--runtime-url", f"{runtime.url}={MODEL}"])
        gateway.wait_for_engine(gateway.runtime_engine_id(runtime.url.removeprefix("http://")))
        yield runtime, gateway
    finally:
        for child in (gateway, runtime):
            if child is not None:
                child.stop()


@pytest.mark.parametrize("shape", SHAPES, ids=[s.name for s in SHAPES])
def test_by_url_the_runtime_gets_what_the_client_sent_and_the_client_what_the_runtime_answered(
        recording_stack: tuple[RecordingRuntime, Gateway], shape: Shape) -> None:
    runtime, gateway = recording_stack
    direct, via, received = exchange(runtime, gateway.base_url, shape)
    assert len(received) == 2, [r.path for r in received]
    assert request_view(received[1]) == request_view(received[0])
    assert received[1].header("x-request-id"), "the gateway names the request for the runtime"
    assert via == direct
    assert via.body == shape.answer.payload and via.status == shape.answer.status


def test_by_url_a_runtimes_429_reaches_the_client_unchanged_and_is_not_resent(tmp_path: Path) -> None:
    runtime = RecordingRuntime(tmp_path)
    gateway = None
    try:
        gateway = Gateway(tmp_path, extra=["--runtime-url", f"{runtime.url}={MODEL}"])
        gateway.wait_for_engine(gateway.runtime_engine_id(runtime.url.removeprefix("http://")))
        direct, via, received = exchange(runtime, gateway.base_url, RATE_LIMITED)
    finally:
        for child in (gateway, runtime):
            if child is not None:
                child.stop()
    assert len(received) == 2 and request_view(received[1]) == request_view(received[0])
    assert via == direct and ("retry-after", "60") in via.headers


# --- by URL beside a dial-in agent; through a peer ------------------------------------------------------


def test_a_runtime_by_url_and_a_dial_in_agent_serve_one_model_together(tmp_path: Path) -> None:
    runtime = RecordingRuntime(tmp_path)
    children: list[Any] = [runtime]
    try:
        gateway = Gateway(tmp_path, extra=["--runtime-url", f"{runtime.url}={MODEL}", "--routing-policy",
                                           "round_robin"])
        children.append(gateway)
        children.append(Engine(tmp_path, gateway, "dial-in", [MODEL]))  # the echo runtime: answers with the prompt
        gateway.wait_for_engine(gateway.runtime_engine_id(runtime.url.removeprefix("http://")))
        runtime.reset()
        runtime.script(*[chat_answer("from the runtime by URL")] * 2)
        client = openai.OpenAI(base_url=gateway.base_url, api_key="x", max_retries=0, timeout=20)
        answers = sorted(client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "echoed by the agent"}]).choices[0].message.content
            for _ in range(4))
        assert answers == ["echoed by the agent"] * 2 + ["from the runtime by URL"] * 2
        assert len(runtime.requests()) == 2
    finally:
        for child in reversed(children):
            child.stop()


@pytest.fixture(scope="module")
def peered(recording_stack: tuple[RecordingRuntime, Gateway], tmp_path_factory: pytest.TempPathFactory,
           ) -> Iterator[tuple[RecordingRuntime, Gateway, Gateway]]:
    """Gateway A with no engine of its own, peered with B, which serves the recording runtime by URL."""
    runtime, _ = recording_stack
    logs = tmp_path_factory.mktemp("by-url-peered")
    a = b = None
    try:
        a = Gateway(logs, name="gateway-a", extra=["--status-interval", "0.2"])
        b = Gateway(logs, name="gateway-b", extra=["--peers", f"127.0.0.1:{a.internal_port}", "--status-interval",
                                                   "0.2", "--runtime-url", f"{runtime.url}={MODEL}"])
        by_url = b.runtime_engine_id(runtime.url.removeprefix("http://"))
        a.wait_for_engine(b.remote_engine_id(by_url), children=[b.child])
        yield runtime, a, b
    finally:
        for child in (b, a):
            if child is not None:
                child.stop()


@pytest.mark.parametrize("shape", EXCHANGED, ids=[s.name for s in EXCHANGED])
def test_a_peer_gateway_serves_requests_with_a_runtime_by_url_of_another_gateway(
        peered: tuple[RecordingRuntime, Gateway, Gateway], shape: Shape) -> None:
    runtime, a, b = peered
    by_url = a.engines()[b.remote_engine_id(b.runtime_engine_id(runtime.url.removeprefix("http://")))]
    assert by_url["locality"] == "remote"
    direct, via, received = exchange(runtime, a.base_url, shape)
    assert len(received) == 2 and request_view(received[1]) == request_view(received[0])
    assert via == direct and via.body == shape.answer.payload


# --- a runtime pod found on the test Kubernetes API server ----------------------------------------------


@pytest_twisted.inlineCallbacks
def test_a_gateway_process_serves_the_runtime_of_a_pod_its_label_selects(tmp_path: Path):
    """``twistd infx --runtime-pod-label app=vllm`` with the kubernetes client against the test API
    server (served by this test's reactor, so every wait here yields to it)."""
    from harness.kubeapi import PODS, FakeKubeAPI, write_kubeconfig

    api = FakeKubeAPI(reactor).start()
    runtime = RecordingRuntime(tmp_path)
    port = int(runtime.url.rsplit(":", 1)[1])
    gateway = Gateway(tmp_path, wait=False, extra=["--runtime-pod-label", "app=vllm", "--runtime-port", str(port)],
                      env={"POD_NAME": "gw-0", "NAMESPACE": "default",
                           "KUBECONFIG": str(write_kubeconfig(tmp_path / "kubeconfig", api.url))})

    @pytest_twisted.inlineCallbacks
    def until(predicate: Any, what: str) -> Any:
        for _ in range(600):
            gateway.child.check_alive()
            value = yield threads.deferToThread(lambda: _quietly(predicate))
            if value:
                return value
            yield task.deferLater(reactor, 0.05, lambda: None)
        raise AssertionError(f"timed out waiting for {what}\n{gateway.child.output()[-3000:]}")

    try:
        yield until(lambda: gateway.readyz() == 200, "the gateway")
        api.create(PODS, {"metadata": {"name": "vllm-0", "labels": {"app": "vllm"},
                                       "annotations": {"infx.io/models": MODEL}},
                          "spec": {"containers": [{"name": "vllm", "image": "vllm:test"}]},
                          "status": {"phase": "Running", "podIP": "127.0.0.1",
                                     "conditions": [{"type": "Ready", "status": "True"}]}})
        engine_id = runtime_engine_id("vllm-0", "gw-0")  # the gateway is pod gw-0 (POD_NAME)
        yield until(lambda: (gateway.engines().get(engine_id) or {}).get("ready"), "the pod's engine")
        runtime.script(chat_answer("from the pod"))

        def ask() -> str:
            client = openai.OpenAI(base_url=gateway.base_url, api_key="x", max_retries=0, timeout=20)
            return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}]
                                                  ).choices[0].message.content or ""

        assert (yield threads.deferToThread(ask)) == "from the pod"
        api.set_ready("vllm-0", False)
        yield until(lambda: engine_id not in gateway.engines(), "the engine to leave once the pod is not ready")
    finally:
        gateway.stop()
        runtime.stop()
        yield api.stop()


def _quietly(predicate: Any) -> Any:
    try:
        return predicate()
    except (OSError, AssertionError, json.JSONDecodeError):
        return None
