"""The engine agent over real loopback gRPC, against a small gateway built in the test
from ``infx.transport.GrpcServer`` that plays the gateway's side of ProcessTasks."""

from __future__ import annotations

import json
from collections.abc import Generator
from typing import Any

import pytest
import pytest_twisted
from twisted.internet import defer, reactor, task
from twisted.internet.endpoints import TCP4ServerEndpoint
from twisted.web import resource, server


from infx.agent.engine import EngineAgent, GrpcLinks
from infx.agent.runtime_client import RuntimeClient
from infx.agent.runtimes import EchoRuntime, OpenAIRuntime, Runtime
from infx.transport import GrpcChannel, client_endpoint, listen_grpc
from protocol.agent.core import EngineAgentCore
from protocol.agent.effects import AgentConfig
from protocol.agent.echo import EchoConfig
from protocol.pb import chat_pb2, embeddings_pb2, worker_pb2
from tests.support.engine_loopback import FakeGateway, control, gateway, with_timeout


def chat(task_id: str, text: str, *, stream: bool = False) -> worker_pb2.Task:
    req = chat_pb2.CreateChatCompletionRequest(model="m", stream=stream)
    req.messages.add(role="user").content.add(type="text", text=text)
    return worker_pb2.Task(id=task_id, engine_id="e1", request=worker_pb2.TaskRequest(chat_completion=req))


def make_agent(port: int, runtime: Runtime, *, grace: float = 5.0, **config: Any) -> EngineAgent:
    settings: dict[str, Any] = dict(engine_id="e1", models=("m",), go_away_linger=0.05, status_min_interval=0.0)
    settings.update(config)
    return EngineAgent(
        reactor, EngineAgentCore(AgentConfig(**settings)), runtime,
        GrpcLinks(reactor, lambda: GrpcChannel(reactor, client_endpoint(reactor, "127.0.0.1", port)),
                  key="engine-key"),
        grace=grace,
    )


@pytest.fixture
def echo_agent(gateway: tuple[FakeGateway, int]) -> Generator[tuple[FakeGateway, EngineAgent], None, None]:
    gw, port = gateway
    agent = make_agent(port, EchoRuntime(reactor, EchoConfig(token_delay=0.002)))
    agent.startService()
    yield gw, agent
    if agent.running:
        stopped = agent.stopService()
        gw.end_all()
        pytest_twisted.blockon(with_timeout(stopped))


@pytest_twisted.inlineCallbacks
def test_engine_registers_with_status_and_key_then_answers_heartbeat_200(echo_agent):
    gw, agent = echo_agent
    stream = yield gw.next_stream()
    yield stream.wait_for(lambda: bool(stream.statuses))
    status = stream.statuses[0]
    assert status.engine_id == "e1" and status.ready
    assert [(m.id, m.is_ready) for m in status.models] == [("m", True)]
    assert ("authorization", "Bearer engine-key") in [(k, v) for k, v in stream.call.metadata]
    stream.send(control("hb-1", heartbeat=worker_pb2.HeartbeatRequest()))
    [answer] = yield stream.complete("hb-1")
    assert answer.http_response.status_code == 200


@pytest_twisted.inlineCallbacks
def test_echo_tasks_stream_and_not_and_embeddings_come_back_in_order(echo_agent):
    gw, agent = echo_agent
    stream = yield gw.next_stream()
    stream.send(chat("s1", "one two three", stream=True))
    stream.send(chat("n1", "plain answer"))
    emb = embeddings_pb2.CreateEmbeddingRequest(model="m", input="vector me")
    stream.send(worker_pb2.Task(id="e1", request=worker_pb2.TaskRequest(embedding=emb)))
    streamed = yield stream.complete("s1")
    plain = yield stream.complete("n1")
    embedded = yield stream.complete("e1")
    assert [r.result_index for r in streamed] == list(range(len(streamed)))
    assert streamed[0].http_response.status_code == 200
    datas = [r.server_sent_event.data for r in streamed[1:-1]]
    assert datas[-1] == b"data: [DONE]\n\n" and streamed[-1].server_sent_event.data == b""
    text = "".join(
        c["choices"][0]["delta"].get("content", "")
        for c in (json.loads(d[len(b"data: "):]) for d in datas if d != b"data: [DONE]\n\n")
        if c["choices"]
    )
    assert text == "one two three"
    assert streamed[-1].server_sent_event.is_last_event
    assert json.loads(plain[0].http_response.body)["choices"][0]["message"]["content"] == "plain answer"
    assert len(json.loads(embedded[0].http_response.body)["data"][0]["embedding"]) == 16


@pytest_twisted.inlineCallbacks
def test_cancel_is_answered_200_and_the_task_sends_nothing_after_it(echo_agent):
    gw, agent = echo_agent
    stream = yield gw.next_stream()
    stream.send(chat("long", " ".join(["word"] * 2000), stream=True))
    yield stream.wait_for(lambda: len(stream.results.get("long", [])) >= 3)
    stream.send(control("c-1", cancel_task=worker_pb2.CancelTaskRequest(task_id="long")))
    yield stream.complete("c-1")
    assert stream.results["c-1"][0].http_response.status_code == 200
    seen = len(stream.results["long"])
    stream.send(control("hb", heartbeat=worker_pb2.HeartbeatRequest()))
    yield stream.complete("hb")
    assert len(stream.results["long"]) == seen
    assert not any(r.server_sent_event.is_last_event for r in stream.results["long"])
    stream.send(control("c-2", cancel_task=worker_pb2.CancelTaskRequest(task_id="long")))
    [again] = yield stream.complete("c-2")
    assert again.http_response.status_code == 404


@pytest_twisted.inlineCallbacks
def test_go_away_is_answered_202_the_engine_reconnects_and_finishes_old_tasks_on_the_old_stream(echo_agent):
    gw, agent = echo_agent
    old = yield gw.next_stream()
    old.send(chat("inflight", " ".join(["w"] * 100), stream=True))
    yield old.wait_for(lambda: "inflight" in old.results)
    old.send(control("g-1", go_away=worker_pb2.GoAwayRequest()))
    new = yield gw.next_stream()
    yield new.wait_for(lambda: bool(new.statuses))
    assert new.statuses[0].engine_id == "e1" and new.statuses[0].ready
    results = yield old.complete("inflight")
    assert results[-1].server_sent_event.is_last_event
    assert old.results["g-1"][0].http_response.status_code == 202
    # The old stream is retired: the engine half-closes it once idle.
    yield old.wait_for(lambda: old.half_closed)
    old.end.callback(None)
    new.send(chat("after", "fresh"))
    [answer] = yield new.complete("after")
    assert answer.http_response.status_code == 200


@pytest_twisted.inlineCallbacks
def test_lost_stream_is_reopened(echo_agent):
    gw, agent = echo_agent
    first = yield gw.next_stream()
    first.end.callback(None)  # the gateway ends the call
    second = yield gw.next_stream()
    yield second.wait_for(lambda: bool(second.statuses))
    second.send(control("hb", heartbeat=worker_pb2.HeartbeatRequest()))
    [answer] = yield second.complete("hb")
    assert answer.http_response.status_code == 200


@pytest_twisted.inlineCallbacks
def test_shutdown_reports_not_ready_drains_the_task_in_flight_then_closes(echo_agent):
    gw, agent = echo_agent
    stream = yield gw.next_stream()
    stream.send(chat("last", " ".join(["w"] * 50), stream=True))
    yield stream.wait_for(lambda: "last" in stream.results)
    stopped = agent.stopService()
    yield stream.wait_for(lambda: any(not s.ready for s in stream.statuses))
    results = yield stream.complete("last")
    assert results[-1].server_sent_event.is_last_event
    yield stream.wait_for(lambda: stream.half_closed)
    assert not stopped.called
    stream.end.callback(None)
    yield with_timeout(stopped)


class SlowRuntime(resource.Resource):
    isLeaf = True

    def __init__(self) -> None:
        super().__init__()
        self.lost: defer.Deferred[None] = defer.Deferred()

    def render_POST(self, request: server.Request) -> Any:
        request.setHeader(b"content-type", b"text/event-stream")
        request.write(b'data: {"first":true}\n\n')
        request.notifyFinish().addBoth(lambda _: self.lost.callback(None))
        return server.NOT_DONE_YET


@pytest_twisted.inlineCallbacks
def test_openai_runtime_over_grpc_relays_the_stream_and_a_cancel_aborts_upstream(gateway):
    gw, port = gateway
    slow = SlowRuntime()
    http_port = yield TCP4ServerEndpoint(reactor, 0, interface="127.0.0.1").listen(server.Site(slow))
    url = f"http://127.0.0.1:{http_port.getHost().port}"
    client = RuntimeClient(reactor, url)
    runtime = OpenAIRuntime(reactor, client, url)
    agent = make_agent(port, runtime)
    agent.startService()
    try:
        stream = yield gw.next_stream()
        stream.send(chat("up", "hello", stream=True))
        yield stream.wait_for(lambda: len(stream.results.get("up", [])) >= 2)
        head, first = stream.results["up"]
        assert head.http_response.status_code == 200
        assert first.server_sent_event.data == b'data: {"first":true}\n\n' and first.result_index == 1
        stream.send(control("c", cancel_task=worker_pb2.CancelTaskRequest(task_id="up")))
        yield stream.complete("c")
        yield with_timeout(slow.lost)
    finally:
        stopped = agent.stopService()
        gw.end_all()
        yield with_timeout(stopped)
        yield client.close()
        yield http_port.stopListening()


@pytest_twisted.inlineCallbacks
def test_engine_keeps_retrying_until_the_gateway_listens():
    gw = FakeGateway()
    probe = yield listen_grpc(reactor, "tcp:0:interface=127.0.0.1", gw.server)
    free = probe.getHost().port
    yield probe.stopListening()
    agent = make_agent(free, EchoRuntime(reactor, EchoConfig(token_delay=0.0)),
                       reconnect_initial=0.02, reconnect_max=0.05)
    agent.startService()
    try:
        # Let a few attempts fail against the closed port before the gateway appears.
        yield task.deferLater(reactor, 0.1, lambda: None)
        port = yield listen_grpc(reactor, f"tcp:{free}:interface=127.0.0.1", gw.server)
        stream = yield gw.next_stream()
        yield stream.wait_for(lambda: bool(stream.statuses))
        assert stream.statuses[0].ready
    finally:
        stopped = agent.stopService()
        gw.end_all()
        yield with_timeout(stopped)
        yield port.stopListening()


@pytest_twisted.inlineCallbacks
def test_shutdown_aborts_tasks_still_running_when_the_grace_period_ends(gateway):
    gw, port = gateway
    agent = make_agent(port, EchoRuntime(reactor, EchoConfig(token_delay=1.0)), grace=0.05)
    agent.startService()
    stream = yield gw.next_stream()
    stream.send(chat("slow", "many words that take a second each", stream=True))
    yield stream.wait_for(lambda: "slow" in stream.results)
    stopped = agent.stopService()
    yield stream.wait_for(lambda: stream.half_closed)
    assert not any(r.server_sent_event.is_last_event for r in stream.results["slow"])
    stream.end.callback(None)
    yield with_timeout(stopped)


@pytest.mark.parametrize("size", [0, 5, 127, 128, 300, 70_000, 3_000_000])
def test_a_result_is_encoded_as_the_process_tasks_request_that_wraps_it(size: int) -> None:
    from infx.agent.engine import _result_request

    result = worker_pb2.TaskResult(task_id="t", result_index=3,
                                   http_response=worker_pb2.HttpResponse(status_code=200, body=b"x" * size))
    assert _result_request(result) == worker_pb2.ProcessTasksRequest(task_result=result).SerializeToString()
