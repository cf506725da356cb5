"""The whole gateway in one process: HTTP API, processor, worker gRPC and the built-in echo engine.

Driven by the official openai client over loopback; the engine is the real
engine agent dialling the real worker port.
"""

from __future__ import annotations

import openai
import pytest
import pytest_twisted
from twisted.internet import reactor, task, threads

from infx.config import build_config
from infx.service import build_gateway, builtin_engine_id


@pytest.fixture
def running_gateway():
    services = []

    @pytest_twisted.inlineCallbacks
    def start(**options):
        config = build_config({}, {"http": "tcp:0:interface=127.0.0.1", "worker_grpc": "tcp:0:interface=127.0.0.1",
                                   "internal_grpc": "tcp:0:interface=127.0.0.1",
                                   **options})
        gateway = build_gateway(reactor, config)
        yield gateway.startService()
        services.append(gateway)
        if config.echo_models:
            for _ in range(200):
                if gateway.dispatcher.models("default"):
                    break
                yield task.deferLater(reactor, 0.02, lambda: None)
        return gateway, f"http://127.0.0.1:{gateway.http.port.getHost().port}/v1"

    yield start
    for gateway in services:
        pytest_twisted.blockon(gateway.stopService()) if gateway.running else None


def chat(base, **kwargs):
    client = openai.OpenAI(base_url=base, api_key="x", max_retries=0, timeout=10)
    return client.chat.completions.create(messages=[{"role": "user", "content": "hello infx world"}], **kwargs)


@pytest_twisted.inlineCallbacks
def test_builtin_echo_engine_answers_chat_streamed_and_not(running_gateway):
    gateway, base = yield running_gateway(echo_models="echo")
    reply = yield threads.deferToThread(chat, base, model="echo")
    assert reply.choices[0].message.content == "hello infx world"

    def streamed():
        return "".join(c.choices[0].delta.content or "" for c in chat(base, model="echo", stream=True) if c.choices)

    assert (yield threads.deferToThread(streamed)) == "hello infx world"
    status = gateway.dispatcher.status()
    assert status["tasks"] == 0
    assert list(status["tenants"]["default"]["engines"]) == [builtin_engine_id(gateway.pod_name)]


@pytest_twisted.inlineCallbacks
def test_unknown_model_is_404_when_no_engine_serves_it(running_gateway):
    _, base = yield running_gateway(echo_models="echo")
    with pytest.raises(openai.NotFoundError):
        yield threads.deferToThread(chat, base, model="nope")


@pytest_twisted.inlineCallbacks
def test_metrics_export_engines_and_task_counts_read_at_scrape_time(running_gateway):
    gateway, base = yield running_gateway(echo_models="echo")
    yield threads.deferToThread(chat, base, model="echo")
    from prometheus_client import generate_latest

    text = generate_latest(gateway.registry).decode()
    assert 'infx_engines{locality="local",tenant="default"} 1.0' in text
    assert 'infx_http_requests_total{endpoint="chat/completions",model="echo",status="200",tenant="default"} 1.0' in text
    assert "# TYPE infx_tasks_queued gauge" in text and "# TYPE infx_tasks_in_flight gauge" in text
    for reason in ("engine_lost", "send_failed", "runtime_busy", "runtime_unreachable", "runtime_dropped"):
        assert gateway.registry.get_sample_value("infx_task_retries_total", {"reason": reason}) == 0
        assert gateway.registry.get_sample_value("infx_task_attempt_failures_total", {"reason": reason}) == 0
    assert gateway.registry.get_sample_value("infx_tasks_ended_total", {"outcome": "completed"}) == 1


@pytest_twisted.inlineCallbacks
def test_heartbeats_keep_answering_engines_and_remove_silent_ones(running_gateway):
    """An engine that answers heartbeats stays; one whose stream is open but silent is removed."""
    import grpc

    from protocol.pb import status_pb2, worker_pb2

    gateway, base = yield running_gateway(echo_models="echo", heartbeat_interval="0.2")
    port = gateway.worker_grpc.port.getHost().port
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    process = channel.stream_stream(
        "/llmariner.inference.server.v1.InferenceWorkerService/ProcessTasks",
        request_serializer=worker_pb2.ProcessTasksRequest.SerializeToString,
        response_deserializer=worker_pb2.ProcessTasksResponse.FromString,
    )
    import queue

    outbox: queue.Queue = queue.Queue()
    outbox.put(worker_pb2.ProcessTasksRequest(engine_status=status_pb2.EngineStatus(
        engine_id="silent", ready=True, models=[status_pb2.EngineStatus.Model(id="quiet", is_ready=True)])))
    responses = process(iter(outbox.get, None))
    received = []

    def read():
        try:
            for response in responses:
                received.append(response.new_task)
        except grpc.RpcError as error:
            return error.code()

    ended = threads.deferToThread(read)
    try:
        for _ in range(200):
            engines = gateway.dispatcher.status()["tenants"].get("default", {}).get("engines", {})
            if "silent" in engines:
                break
            yield task.deferLater(reactor, 0.02, lambda: None)
        code = yield ended
        assert code == grpc.StatusCode.UNAVAILABLE
        assert any(t.request.WhichOneof("request") == "heartbeat" for t in received)
        engines = gateway.dispatcher.status()["tenants"]["default"]["engines"]
        assert "silent" not in engines and builtin_engine_id(gateway.pod_name) in engines
        reply = yield threads.deferToThread(chat, base, model="echo")
        assert reply.choices[0].message.content == "hello infx world"
    finally:
        outbox.put(None)
        channel.close()


@pytest_twisted.inlineCallbacks
def test_the_builtin_echo_engine_serves_the_echo_tenant_reached_with_that_tenants_key(running_gateway, tmp_path):
    keys = tmp_path / "keys.yaml"
    keys.write_text("keys:\n  - {key: sk-a, tenant: team-a}\n  - {key: sk-default}\n")
    gateway, base = yield running_gateway(echo_models="echo", echo_tenant="team-a", api_keys=str(keys))
    for _ in range(200):
        if gateway.dispatcher.models("team-a"):
            break
        yield task.deferLater(reactor, 0.02, lambda: None)

    def chat_as(key):
        client = openai.OpenAI(base_url=base, api_key=key, max_retries=0, timeout=10)
        return client.chat.completions.create(model="echo", messages=[{"role": "user", "content": "hi"}])

    reply = yield threads.deferToThread(chat_as, "sk-a")
    assert reply.choices[0].message.content == "hi"
    with pytest.raises(openai.NotFoundError):
        yield threads.deferToThread(chat_as, "sk-default")
    assert list(gateway.dispatcher.status()["tenants"]["team-a"]["engines"]) == [builtin_engine_id(gateway.pod_name)]


def test_an_echo_tenant_other_than_default_needs_a_key_file():
    from infx.config import ConfigError

    with pytest.raises(ConfigError, match="--echo-tenant 'team-a' needs --api-keys"):
        build_config({}, {"echo_models": "echo", "echo_tenant": "team-a"})
