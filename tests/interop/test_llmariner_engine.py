"""A LLMariner engine (grpcio, infx's own protos) against the real ``twistd infx`` gateway.

The gateway runs as a child process with an API key file (two tenants and an
engine key); the engine is :class:`harness.llmariner_engine.LLMarinerEngine`
in this process, and the clients are the official ``openai`` client. Each
test proves one part of the wire contract: registration, tasks as LLMariner
engines receive them, results as they send them, and what infx does when an
engine breaks the protocol or a client leaves.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator

import grpc
import openai
import pytest

from harness.llmariner_engine import Answer, LLMarinerEngine, Payload, http_response, last_event, runtime_answer, sse
from harness.twistd_processes import Gateway, wait_until
from protocol.pb import worker_pb2

#: The gateway runs as a real twistd child process.
pytestmark = pytest.mark.e2e

KEYS = """
keys:
  - {key: sk-team-a, tenant: team-a, admin: true}
  - {key: sk-team-b, tenant: team-b}
engine_keys:
  - {key: ek-team-a, tenant: team-a}
"""


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    logs = tmp_path_factory.mktemp("llmariner")
    keys = logs / "keys.yaml"
    keys.write_text(KEYS)
    # LLMariner's own routing (least in progress), as the server this module stands in for: under
    # infx's affinity policy two unrelated small requests may share one engine while another idles.
    gateway = Gateway(logs, api_keys=keys, admin_key="sk-team-a", extra=["--routing-policy", "least_in_progress"])
    yield gateway
    gateway.stop()


def client(gateway: Gateway, key: str = "sk-team-a") -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway.base_url, api_key=key, max_retries=0, timeout=10)


class Engines:
    """Starts grpcio engines for one test; closes them and waits until the gateway dropped them."""

    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway
        self.started: list[LLMarinerEngine] = []

    def start(self, engine_id: str, models: list[str], answer: Answer = runtime_answer, key: str = "ek-team-a",
              wait: bool = True) -> LLMarinerEngine:
        engine = LLMarinerEngine(self.gateway.worker_address, engine_id, models, key=key, answer=answer)
        self.started.append(engine)
        if wait:
            self.gateway.wait_for_engine(engine_id, "team-a")
        return engine

    def close(self) -> None:
        for engine in self.started:
            engine.close()
        ids = {e.engine_id for e in self.started}
        wait_until(lambda: not ids & set(self.gateway.engines("team-a")), "the engines to be dropped",
                   [self.gateway.child])


@pytest.fixture
def engines(gateway: Gateway) -> Iterator[Engines]:
    started = Engines(gateway)
    yield started
    started.close()


def test_registered_model_is_listed_for_the_engines_tenant_only(gateway: Gateway, engines: Engines) -> None:
    engines.start("llmariner-list", ["llama-3", "phi-4"])
    assert sorted(m.id for m in client(gateway).models.list()) == ["llama-3", "phi-4"]
    assert [m.id for m in client(gateway, "sk-team-b").models.list()] == []
    engine = gateway.engines("team-a")["llmariner-list"]
    assert engine["locality"] == "local" and engine["ready"] and engine["tasks"] == []


def test_non_streaming_chat_is_one_task_answered_by_one_http_response(gateway: Gateway, engines: Engines) -> None:
    engine = engines.start("llmariner-chat", ["llama-3"])
    reply = client(gateway).chat.completions.with_raw_response.create(
        model="llama-3", messages=[{"role": "user", "content": "tell me about infx"}],
        extra_headers={"x-request-id": "req-42", "x-custom": "kept"})
    assert reply.parse().choices[0].message.content == "llmariner: tell me about infx"
    [task] = engine.tasks
    assert task.engine_id == "llmariner-chat" and task.id and task.timeout_seconds > 0
    request = task.request.chat_completion
    assert request.model == "llama-3" and not request.stream
    assert [(m.role, m.content[0].text) for m in request.messages] == [("user", "tell me about infx")]
    # Request headers travel to the engine, except credentials and hop-by-hop ones.
    assert list(task.header["x-request-id"].values) == ["req-42"]
    assert list(task.header["x-custom"].values) == ["kept"]
    assert "authorization" not in task.header
    assert reply.headers["x-request-id"] == "req-42"
    assert gateway.wait_until_idle()["tenants"]["team-a"]["engines"]["llmariner-chat"]["tasks"] == []


def test_streamed_chat_events_reach_the_client_in_order_and_end_it(gateway: Gateway, engines: Engines) -> None:
    engine = engines.start("llmariner-stream", ["llama-3"])
    stream = client(gateway).chat.completions.create(
        model="llama-3", stream=True, messages=[{"role": "user", "content": "one two three four"}])
    pieces = [chunk.choices[0].delta.content for chunk in stream]
    assert pieces == ["llmariner:", " one", " two", " three", " four"]
    assert engine.tasks[0].request.chat_completion.stream
    gateway.wait_until_idle()


def test_embeddings_task_is_answered_by_the_engine(gateway: Gateway, engines: Engines) -> None:
    engine = engines.start("llmariner-embed", ["e5"])
    result = client(gateway).embeddings.create(model="e5", input="vector me")
    assert result.data[0].embedding == [0.25, 0.5, 0.75]
    assert engine.tasks[0].request.embedding.model == "e5"


def test_engine_error_response_reaches_the_client_as_the_matching_openai_error(
    gateway: Gateway, engines: Engines,
) -> None:
    def refuse(task: worker_pb2.Task) -> Iterator[Payload]:
        body = {"error": {"message": "max_tokens is too large", "type": "invalid_request_error",
                          "param": "max_tokens", "code": None}}
        yield http_response(400, json.dumps(body).encode(), "application/json")

    engines.start("llmariner-refuse", ["llama-3"], answer=refuse)
    with pytest.raises(openai.BadRequestError, match="max_tokens is too large"):
        client(gateway).chat.completions.create(model="llama-3", messages=[{"role": "user", "content": "x"}])


def test_result_out_of_order_fails_the_request_with_502_and_cancels_the_task_on_the_engine(
    gateway: Gateway, engines: Engines,
) -> None:
    def skip_head(task: worker_pb2.Task) -> Iterator[Payload]:
        yield worker_pb2.TaskResult(result_index=1, server_sent_event=sse(b"data: {}"))

    engine = engines.start("llmariner-rogue", ["llama-3"], answer=skip_head)
    with pytest.raises(openai.InternalServerError) as raised:
        client(gateway).chat.completions.create(model="llama-3", messages=[{"role": "user", "content": "x"}])
    assert raised.value.status_code == 502
    work = engine.tasks[0]
    cancel = engine.wait_for_task(lambda t: t.request.cancel_task.task_id == work.id)
    assert cancel.engine_id == "llmariner-rogue"
    gateway.wait_until_idle()


def test_client_leaving_mid_stream_cancels_the_task_on_the_engine(gateway: Gateway, engines: Engines) -> None:
    released = threading.Event()

    def first_word_then_hold(task: worker_pb2.Task) -> Iterator[Payload]:
        yield http_response(200, content_type="text/event-stream")
        chunk = {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "llama-3",
                 "choices": [{"index": 0, "delta": {"content": "first"}, "finish_reason": None}]}
        yield sse(b"data: " + json.dumps(chunk).encode())
        # An aborted runtime request sends nothing more.
        released.wait(10)

    engine = engines.start("llmariner-hold", ["llama-3"], answer=first_word_then_hold)
    try:
        stream = client(gateway).chat.completions.create(
            model="llama-3", stream=True, messages=[{"role": "user", "content": "x"}])
        assert next(iter(stream)).choices[0].delta.content == "first"
        stream.close()
        work = engine.tasks[0]
        engine.wait_for_task(lambda t: t.request.cancel_task.task_id == work.id)
        gateway.wait_until_idle()
    finally:
        released.set()


def test_last_event_after_done_completes_a_stream_whose_runtime_sent_no_done(
    gateway: Gateway, engines: Engines,
) -> None:
    def no_done(task: worker_pb2.Task) -> Iterator[Payload]:
        yield http_response(200, content_type="text/event-stream")
        chunk = {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "llama-3",
                 "choices": [{"index": 0, "delta": {"content": "only"}, "finish_reason": "stop"}]}
        yield sse(b"data: " + json.dumps(chunk).encode())
        yield last_event()

    engines.start("llmariner-nodone", ["llama-3"], answer=no_done)
    stream = client(gateway).chat.completions.with_raw_response.create(
        model="llama-3", stream=True, messages=[{"role": "user", "content": "x"}])
    body = stream.http_response.read()
    # The gateway ends the client's stream with [DONE] itself.
    assert body.rstrip().endswith(b"data: [DONE]") and b'"only"' in body


def test_engine_with_an_unknown_key_is_refused_as_unauthenticated(gateway: Gateway, engines: Engines) -> None:
    engine = engines.start("llmariner-intruder", ["llama-3"], key="ek-stolen", wait=False)
    assert engine.ended.wait(10)
    assert engine.error is not None and engine.error.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "llmariner-intruder" not in gateway.engines("team-a")


def test_two_engines_share_concurrent_tasks(gateway: Gateway, engines: Engines) -> None:
    both_started = threading.Barrier(2, timeout=10)

    def meet(task: worker_pb2.Task) -> Iterator[Payload]:
        # Each engine holds its task until the other has one too: the two run at once.
        both_started.wait()
        yield from runtime_answer(task)

    first = engines.start("llmariner-x", ["llama-3"], answer=meet)
    second = engines.start("llmariner-y", ["llama-3"], answer=meet)
    results: list[str] = []

    def ask(text: str) -> None:
        reply = client(gateway).chat.completions.create(model="llama-3", messages=[{"role": "user", "content": text}])
        results.append(reply.choices[0].message.content or "")

    threads = [threading.Thread(target=ask, args=(text,)) for text in ("alpha", "beta")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(15)
    assert sorted(results) == ["llmariner: alpha", "llmariner: beta"]
    assert len(first.tasks) == len(second.tasks) == 1

