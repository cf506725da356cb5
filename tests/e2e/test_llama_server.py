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
    assert runtime == {"kind": "llama.cpp", "version": build, "agent_version": infx.__version__, "name": None}


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
        """The last status's only model, if any status named one (an agent given no ``--models`` names
        none until it has read the server's list)."""
        with self._lock:
            if not self.statuses:
                return None
            models = list(self.statuses[-1].models)
        if not models:
            return None
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


class TaskFeeder(StatusRecorder):
    """A grpcio stand-in for the gateway that also sends tasks (``send``) and keeps their results."""

    def __init__(self) -> None:
        import queue

        self.tasks: queue.Queue[worker_pb2.Task | None] = queue.Queue()
        self.results: dict[str, list[worker_pb2.TaskResult]] = {}
        super().__init__()

    def _process_tasks(self, requests: Iterator[worker_pb2.ProcessTasksRequest], context: Any
                       ) -> Iterator[worker_pb2.ProcessTasksResponse]:
        def read() -> None:
            for request in requests:
                with self._lock:
                    if request.HasField("engine_status"):
                        self.statuses.append(request.engine_status)
                    else:
                        self.results.setdefault(request.task_result.task_id, []).append(request.task_result)
            self.tasks.put(None)

        threading.Thread(target=read, daemon=True).start()
        while (task := self.tasks.get()) is not None:
            yield worker_pb2.ProcessTasksResponse(new_task=task)

    def send(self, task_id: str, body: dict[str, Any]) -> None:
        task = worker_pb2.Task(id=task_id, timeout_seconds=60)
        task.request.chat_completion.model = body["model"]
        task.request.chat_completion.stream = bool(body.get("stream"))
        task.request.typed_request_incomplete = "routing fields only"
        task.request.http_request.CopyFrom(worker_pb2.HttpRequest(
            method="POST", path="/v1/chat/completions", body=json.dumps(body).encode()))
        task.header["Content-Type"].values.append("application/json")
        self.tasks.put(task)

    def answer(self, task_id: str) -> dict[str, Any] | None:
        """The streamed answer's usage chunk, once the task's last event came."""
        with self._lock:
            results = list(self.results.get(task_id, ()))
        if not results or not results[-1].server_sent_event.is_last_event:
            return None
        # A verbatim stream's result holds the events one read of the server completed, one or more.
        for result in results:
            for line in result.server_sent_event.data.split(b"\n"):
                if line.startswith(b"data:") and b'"usage"' in line:
                    usage: dict[str, Any] = json.loads(line[5:])["usage"]
                    return usage
        raise AssertionError(f"no usage in {results}")

    def stop(self) -> None:
        self.tasks.put(None)
        super().stop()


def test_the_agent_reports_the_servers_slots_its_answers_prompts_and_what_its_load_includes(logs, model):
    """Through the agent: the server's 2 slots (from its /slots), each model's prompt tokens and cached
    tokens summed from the answers that passed (what the server's own usage said), and the runtime tasks
    the stream had brought and ended when the load was read."""
    llama = LlamaCppServer(model, logs, name="llama-counted", slots=2)
    feeder = TaskFeeder()
    children: list[Any] = [llama, feeder]
    try:
        agent = TwistdChild("engine-counted", [
            "infx-engine", "--server", f"127.0.0.1:{feeder.port}", "--engine-id", "counted", "--runtime", "openai",
            "--upstream", llama.url, "--models", "tiny", "--runtime-load-interval", "0.2",
            "--runtime-load-report-interval", "0", "--status-interval", "0.5"], logs)
        children.append(agent)
        wait_until(lambda: feeder.statuses and feeder.statuses[-1].infx_runtime_slots == 2,
                   "the server's two slots reported", [agent, llama])
        usages = []
        for i in range(3):
            body = {"model": "tiny", "messages": messages("the same question every time"), "max_tokens": 2,
                    "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
            feeder.send(f"t{i}", body)
            usages.append(wait_until(lambda i=i: feeder.answer(f"t{i}"), f"task t{i} answered", [agent, llama]))
        prompt = sum(u["prompt_tokens"] for u in usages)
        cached = sum(u["prompt_tokens_details"]["cached_tokens"] for u in usages)
        assert cached == 2 * (usages[0]["prompt_tokens"] - 1)  # the 2nd and 3rd found all but one token

        def counted() -> bool:
            cache = feeder.latest()
            return cache is not None and cache.infx_prompt_cache.answers == 3 and \
                cache.runtime_load.HasField("tasks_received") and cache.runtime_load.tasks_ended == 3
        wait_until(counted, "three answers counted and a load read after them", [agent, llama])
        model_status = feeder.latest()
        assert (model_status.infx_prompt_cache.prompt_tokens, model_status.infx_prompt_cache.cached_tokens) \
            == (prompt, cached)
        assert model_status.runtime_load.tasks_received == 3
    finally:
        for child in reversed(children):
            child.stop()
