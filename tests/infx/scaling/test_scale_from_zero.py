"""Scale from zero through the whole gateway: ``twistd infx --kube --scaler`` options, the official
kubernetes client against the test API server, the official openai client, and a real engine agent.

Chat requests for a model whose deployment is at zero are held (not 404, not lost); exactly one
scale write raises the deployment to one replica; when an engine for the model connects, every
held request is answered.
"""

from __future__ import annotations

from pathlib import Path

import openai
import pytest_twisted
from twisted.internet import defer, reactor, task, threads

from harness.kubeapi import EVENTS, FakeKubeAPI, write_kubeconfig
from infx.agent.engine import EngineAgent, GrpcLinks
from infx.agent.runtimes import EchoRuntime
from infx.service import GatewayService
from infx.tap import GatewayOptions
from infx.transport import GrpcChannel, client_endpoint
from protocol.agent.core import EngineAgentCore
from protocol.agent.effects import AgentConfig
from protocol.agent.echo import EchoConfig
from protocol.grpc import GrpcConfig


@defer.inlineCallbacks
def poll(condition, limit=15.0):
    for _ in range(int(limit / 0.02)):
        if condition():
            return
        yield task.deferLater(reactor, 0.02, lambda: None)
    raise AssertionError(f"condition not met within {limit}s")


def ask(base: str, words: str) -> str:
    client = openai.OpenAI(base_url=base, api_key="x", max_retries=0, timeout=30)
    reply = client.chat.completions.create(model="llama", messages=[{"role": "user", "content": words}])
    return reply.choices[0].message.content


@pytest_twisted.inlineCallbacks
def test_requests_for_a_model_at_zero_are_held_scaled_once_and_all_served(tmp_path: Path):
    api = FakeKubeAPI(reactor).start()
    kubeconfig = write_kubeconfig(tmp_path / "kubeconfig", api.url)
    api.add_deployment(
        "llama-engine", replicas=0,
        labels={"app": "llama-engine", "infx.io/scalable": "true", "ai.tensorchord.scale.min": "0"},
        annotations={"infx.io/models": "llama"},
    )
    options = GatewayOptions()
    # Every port the kernel's pick; --kube on port 0 takes --peer-port, the port of the other gateway
    # pods it finds (none here).
    options.parseOptions(["--kube", "--scaler", "--peer-port", "8083",
                          *(f"--{option}=tcp:0:interface=127.0.0.1" for option in ("http", "worker-grpc", "internal-grpc"))])
    gateway = GatewayService(reactor, options.config_value, environ={
        "POD_NAME": "gw-0", "NAMESPACE": "default", "KUBECONFIG": str(kubeconfig)})
    engine = None
    try:
        yield gateway.startService()
        http, worker = (listener.port.getHost().port for listener in (gateway.http, gateway.worker_grpc))
        # Requests other gateways accept reach this scaler in their reports (the rps load).
        scaler = gateway.scaler.scaler
        assert scaler.observe_peer_requests in gateway.exchanger.on_peer_requests
        assert scaler.forget_peer in gateway.exchanger.on_peer_gone
        assert scaler.machine.config.peer_report_interval == options.config_value.status_interval
        yield poll(lambda: gateway.dispatcher.can_start("default", "llama"))
        base = f"http://127.0.0.1:{http}/v1"
        # Eight: the reactor's thread pool (where the blocking openai client runs) has ten threads.
        replies = [threads.deferToThread(ask, base, f"request {i}") for i in range(8)]
        yield poll(lambda: sum(gateway.processor.waiting_counts().values()) == 8)
        yield poll(lambda: api.deployment("llama-engine")["spec"].get("replicas") == 1)
        assert not any(d.called for d in replies), "held requests must wait for an engine, not fail"

        # The "pod" comes up: an engine for the model dials the worker port.
        def connect() -> GrpcChannel:
            return GrpcChannel(reactor, client_endpoint(reactor, "127.0.0.1", worker), GrpcConfig(client_side=True))

        engine = EngineAgent(reactor, EngineAgentCore(AgentConfig(engine_id="llama-0", models=("llama",))),
                             EchoRuntime(reactor, EchoConfig()), GrpcLinks(reactor, connect))
        engine.startService()
        answers = yield defer.gatherResults(replies)
        assert sorted(answers) == sorted(f"request {i}" for i in range(8))
        scale_writes = [r for r in api.requests if r.method in ("PUT", "PATCH") and r.path.endswith("/scale")]
        assert len(scale_writes) == 1
        events = [e for e in api.list(EVENTS) if "llama-engine" in str(e.get("regarding", {}))]
        assert len(events) >= 1
        assert gateway.processor.status()["tasks"] == 0
    finally:
        if engine is not None and engine.running:
            yield engine.stopService()
        yield gateway.stopService()
        yield api.stop()
