"""End to end against llama.cpp's own server: ``twistd infx`` and ``twistd infx-engine --runtime openai`` in front of
``llama-server`` (:mod:`harness.llama_server`, the tiny model), driven by the official ``openai`` client.

Request by request, the answer through infx equals the server's own answer
to the same request (temperature 0, a seed): everything but the ids, the
``created`` stamps, the ``timings`` (milliseconds) and the cached prompt
tokens, which differ between any two runs; the request through infx comes
second and finds all but one of its prompt tokens in the server's cache,
which shows that it reached the server as sent. Requests sent while the
server loads its model wait in the gateway and then succeed. The agent reads
the server's readiness and load (its own ``/metrics`` counters) and reports
them in its ``EngineStatus``; a grpcio server stands in for the gateway there,
to read those reports as sent.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pytest
from openai import OpenAI

import infx
from harness.gguf_models import write_model
from harness.llama_server import LlamaCppServer, LoadGate
from protocol.pb import status_pb2, worker_pb2
from harness.twistd_processes import Engine, Gateway, TwistdChild, free_port, http_get, wait_until
from tests.support.llama_answers import messages, stable

KEYS = """
keys:
  - {key: sk-admin, tenant: default, admin: true}
  - {key: sk-user, tenant: default}
engine_keys:
  - {key: ek-default, tenant: default}
"""
RUNTIME_KEY = "runtime-secret-2"


@pytest.fixture(scope="module")
def logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("llama-server-e2e")


@pytest.fixture(scope="module")
def model(logs: Path) -> Path:
    return write_model(logs / "tiny.gguf")


@pytest.fixture(scope="module")
def keys(logs: Path) -> Path:
    path = logs / "keys.yaml"
    path.write_text(KEYS)
    return path


@pytest.fixture(scope="module")
def stack(logs: Path, model: Path, keys: Path) -> Iterator[tuple[LlamaCppServer, Gateway]]:
    key_file = logs / "runtime-key"
    key_file.write_text(RUNTIME_KEY + "\n")
    llama = LlamaCppServer(model, logs, api_key=RUNTIME_KEY)
    children: list[Any] = [llama]
    try:
        gateway = Gateway(logs, api_keys=keys, admin_key="sk-admin")
        children.append(gateway)
        children.append(Engine(logs, gateway, "llama-engine", [], runtime="openai", upstream=llama.url,
                               key="ek-default", extra=["--upstream-api-key-file", str(key_file)]))
        yield llama, gateway
    finally:
        for child in reversed(children):
            child.stop()


def clients(stack: tuple[LlamaCppServer, Gateway]) -> tuple[OpenAI, OpenAI]:
    """The server's own API, then infx's."""
    llama, gateway = stack
    return (OpenAI(base_url=llama.url + "/v1", api_key=RUNTIME_KEY, max_retries=0),
            OpenAI(base_url=gateway.base_url, api_key="sk-user", max_retries=0))


def test_the_agent_serves_the_model_the_server_lists(stack):
    _, gateway = stack
    engine = gateway.engines()["llama-engine"]
    assert [(m["id"], m["ready"]) for m in engine["models"]] == [("tiny", True)]


def test_the_gateway_names_the_runtime_and_its_version_as_the_server_states_them(stack):
    """/admin/status shows the runtime's kind and version: what llama-server's /props says of its build."""
    llama, gateway = stack
    code, body = http_get(llama.url + "/props", {"Authorization": f"Bearer {RUNTIME_KEY}"})
    assert code == 200
    build = json.loads(body)["build_info"]
    runtime = wait_until(lambda: (gateway.engines()["llama-engine"].get("runtime") or {}).get("version")
                         and gateway.engines()["llama-engine"]["runtime"], "the runtime's version", [gateway.child])
    assert runtime == {"kind": "llama.cpp", "version": build, "agent_version": infx.__version__}


@pytest.mark.parametrize("extra", [
    pytest.param({"max_tokens": 16, "seed": 0}, id="seed 0"),
    pytest.param({"max_tokens": 24, "seed": 7, "stop": ["e", "a"]}, id="stop words"),
])
def test_a_chat_answer_equals_the_servers_own(stack, extra):
    direct, through = clients(stack)
    request = {"model": "tiny", "messages": messages(f"Say something {extra['seed']}."), "temperature": 0, **extra}
    own = direct.chat.completions.create(**request).model_dump()
    answer = through.chat.completions.create(**request).model_dump()
    assert stable(answer) == stable(own)
    assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == answer["usage"]["prompt_tokens"] - 1


def test_a_streamed_chat_equals_the_servers_own_chunk_by_chunk(stack):
    direct, through = clients(stack)
    request = {"model": "tiny", "messages": messages("Stream something."), "temperature": 0, "seed": 3,
               "max_tokens": 24, "stream": True, "stream_options": {"include_usage": True}}
    own = [chunk.model_dump() for chunk in direct.chat.completions.create(**request)]
    answer = [chunk.model_dump() for chunk in through.chat.completions.create(**request)]
    assert stable(answer) == stable(own)
    assert len(answer) > 3 and answer[-1]["choices"] == [] and answer[-1]["usage"]["completion_tokens"] == 24


def test_a_completion_equals_the_servers_own(stack):
    direct, through = clients(stack)
    request = {"model": "tiny", "prompt": "the cat sat", "max_tokens": 12, "temperature": 0, "seed": 0}
    own = direct.completions.create(**request).model_dump()
    answer = through.completions.create(**request).model_dump()
    assert stable(answer) == stable(own)
    assert answer["usage"]["prompt_tokens"] == own["usage"]["prompt_tokens"]


def test_requests_sent_while_the_server_loads_wait_then_succeed(logs, model, keys):
    gate = LoadGate(model, logs)
    llama = LlamaCppServer(gate.path, logs, name="llama-loading", wait=False)
    children: list[Any] = [llama]
    try:
        wait_until(lambda: llama.health() == 503, "llama-server to answer while it loads", [llama])
        gateway = Gateway(logs, api_keys=keys, admin_key="sk-admin", name="gateway-loading",
                          extra=["--queue-timeout", "60"])
        children.append(gateway)
        engine = Engine(logs, gateway, "loading-engine", ["tiny"], runtime="openai", upstream=llama.url,
                        key="ek-default", models_ready=False)
        children.append(engine)
        assert [(m["id"], m["ready"]) for m in gateway.engines()["loading-engine"]["models"]] == [("tiny", False)]
        client = OpenAI(base_url=gateway.base_url, api_key="sk-user", max_retries=0, timeout=90)
        request = {"model": "tiny", "messages": messages("hello"), "max_tokens": 8, "temperature": 0, "seed": 5}
        answers: list[Any] = [None, None]

        def send(i: int) -> None:
            answers[i] = client.chat.completions.create(**request).model_dump()

        threads = [threading.Thread(target=send, args=(i,), daemon=True) for i in range(2)]
        for thread in threads:
            thread.start()
        wait_until(lambda: sum(len(v) for v in gateway.status()["waiting"].get("default", {}).values()) == 2,
                   "both requests to wait in the gateway", [gateway.child, engine.child, llama])
        assert llama.health() == 503  # still loading: the gate holds it

        gate.release(llama)
        for thread in threads:
            thread.join(60)
        own = OpenAI(base_url=llama.url + "/v1", api_key="unused", max_retries=0).chat.completions.create(**request)
        assert [stable(a) for a in answers] == [stable(own.model_dump())] * 2
    finally:
        for child in reversed(children):
            child.stop()


# --- what the agent reads from the server and reports ------------------------------------------------------


class StatusRecorder:
    """A grpcio ``InferenceWorkerService`` that keeps every ``EngineStatus`` an engine sends and sends it no task."""

    def __init__(self) -> None:
        self.statuses: list[status_pb2.EngineStatus] = []
        self._lock = threading.Lock()
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        handler = grpc.stream_stream_rpc_method_handler(
            self._process_tasks, request_deserializer=worker_pb2.ProcessTasksRequest.FromString,
            response_serializer=worker_pb2.ProcessTasksResponse.SerializeToString)
        self.server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(
            "llmariner.inference.server.v1.InferenceWorkerService", {"ProcessTasks": handler})])
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()

    def _process_tasks(self, requests: Iterator[worker_pb2.ProcessTasksRequest], context: Any
                       ) -> Iterator[worker_pb2.ProcessTasksResponse]:
        for request in requests:
            if request.HasField("engine_status"):
                with self._lock:
                    self.statuses.append(request.engine_status)
        return
        yield  # a generator: the stream stays open while the engine sends

    def latest(self) -> status_pb2.EngineStatus.Model | None:
        """The last status's only model, if any status came."""
        with self._lock:
            if not self.statuses:
                return None
            models = list(self.statuses[-1].models)
        assert [m.id for m in models] == ["tiny"]
        return models[0]

    def stop(self) -> None:
        self.server.stop(grace=None)


def test_the_agent_reports_the_servers_readiness_and_its_own_cache_counters(logs, model):
    """One repeated prompt: the hit rate the agent reports is the one the server's answer gives."""
    llama = LlamaCppServer(model, logs, name="llama-watched")
    prompt = {"model": "tiny", "messages": messages("a prompt asked twice"), "max_tokens": 2, "temperature": 0}
    client = OpenAI(base_url=llama.url + "/v1", api_key="unused", max_retries=0)
    client.chat.completions.create(**prompt)  # before the agent: its first scrape starts the counters' window
    recorder = StatusRecorder()
    children: list[Any] = [llama, recorder]
    try:
        agent = TwistdChild("engine-watched", [
            "infx-engine", "--server", f"127.0.0.1:{recorder.port}", "--engine-id", "watched", "--runtime", "openai",
            "--upstream", llama.url, "--runtime-check-interval", "0.5", "--runtime-load-interval", "0.2",
            "--runtime-load-report-interval", "0"], logs)
        children.append(agent)

        def reported(predicate: Any) -> Any:
            def check() -> Any:
                model = recorder.latest()
                return model is not None and predicate(model) and model
            return check

        first = wait_until(reported(lambda m: m.is_ready and m.HasField("runtime_load")),
                           "a ready model with the server's load", [agent, llama])
        load = first.runtime_load
        assert (load.source, load.running_requests, load.waiting_requests) == ("llama.cpp", 0, 0)
        assert not load.HasField("prefix_cache_hit_rate") and not load.HasField("kv_cache_usage")

        answer = client.chat.completions.create(**prompt)
        expected = answer.usage.prompt_tokens_details.cached_tokens / answer.usage.prompt_tokens
        assert expected == (answer.usage.prompt_tokens - 1) / answer.usage.prompt_tokens
        wait_until(reported(lambda m: m.runtime_load.prefix_cache_hit_rate == pytest.approx(expected, abs=1e-9)),
                   f"the hit rate {expected:.4f} of the server's counters", [agent, llama])

        port = llama.port
        llama.stop()
        wait_until(reported(lambda m: not m.is_ready), "the model reported not ready", [agent])
        children[0] = llama = LlamaCppServer(model, logs, name="llama-watched-again", port=port)
        wait_until(reported(lambda m: m.is_ready and m.HasField("runtime_load")), "the model ready again",
                   [agent, llama])
    finally:
        for child in reversed(children):
            child.stop()
