"""An engine agent that a gateway refuses, or that finds no gateway, logs the failure once
with a count, not a few lines per retry (real loopback gRPC, real reconnect loop)."""

from __future__ import annotations

from collections.abc import Generator
from typing import Any

import pytest_twisted
from twisted.internet import defer, reactor, task

from infx.agent.engine import PROCESS_TASKS, EngineAgent, GrpcLinks
from infx.agent.runtimes import EchoRuntime
from infx.transport import (
    CallKind,
    GrpcChannel,
    GrpcError,
    GrpcServer,
    ServerCall,
    client_endpoint,
    listen_grpc,
)
from protocol.agent.core import EngineAgentCore
from protocol.agent.effects import AgentConfig
from protocol.agent.echo import EchoConfig
from protocol.grpc import StatusCode
from protocol.pb import worker_pb2
from tests.support.logs import LogLines


def agent_for(port: int, dials: list[int] | None = None) -> EngineAgent:
    """An agent with a wrong key that redials fast; ``dials`` gets one entry per channel it opens."""
    config = AgentConfig(engine_id="e1", models=("m",), reconnect_initial=0.01, reconnect_max=0.02,
                         status_min_interval=0.0)

    def connect() -> GrpcChannel:
        if dials is not None:
            dials.append(port)
        return GrpcChannel(reactor, client_endpoint(reactor, "127.0.0.1", port))

    return EngineAgent(reactor, EngineAgentCore(config), EchoRuntime(reactor, EchoConfig(token_delay=0.0)),
                       GrpcLinks(reactor, connect, key="wrong"))


class RefusingGateway:
    """Refuses every ProcessTasks stream as a gateway refuses an unknown key, and counts them."""

    def __init__(self) -> None:
        self.refused = 0
        self.server = GrpcServer(reactor)
        self.server.add_method(PROCESS_TASKS, self.handle, worker_pb2.ProcessTasksRequest.FromString,
                               worker_pb2.ProcessTasksResponse.SerializeToString, kind=CallKind.STREAM_STREAM)

    async def handle(self, call: ServerCall) -> None:
        self.refused += 1
        raise GrpcError(StatusCode.UNAUTHENTICATED, "missing or unknown engine key")


@pytest_twisted.inlineCallbacks
def test_a_refused_engine_key_is_logged_once_however_often_the_agent_retries() -> Generator[Any, Any, None]:
    gateway = RefusingGateway()
    port = yield listen_grpc(reactor, "tcp:0:interface=127.0.0.1", gateway.server)
    agent = agent_for(port.getHost().port)
    with LogLines() as logs:
        agent.startService()
        try:
            while gateway.refused < 8:
                yield task.deferLater(reactor, 0.02, lambda: None)
        finally:
            yield agent.stopService()
            yield port.stopListening()
    assert gateway.refused >= 8
    assert len(logs.matching("missing or unknown engine key")) == 1
    assert not logs.matching("Starting factory <infx.transport.client._ChannelFactory")
    assert logs.matching("missing or unknown engine key")[0].startswith("engine e1: stream closed: ")


@pytest_twisted.inlineCallbacks
def test_an_unreachable_gateway_is_logged_once_then_the_recovery_with_its_count() -> Generator[Any, Any, None]:
    probe = yield listen_grpc(reactor, "tcp:0:interface=127.0.0.1", GrpcServer(reactor))
    free = probe.getHost().port
    yield probe.stopListening()
    dials: list[int] = []
    agent = agent_for(free, dials)
    accepted: defer.Deferred[None] = defer.Deferred()
    server = GrpcServer(reactor)

    async def serve(call: ServerCall) -> None:
        call.send_initial_metadata()
        if not accepted.called:
            accepted.callback(None)
        await call.recv()

    server.add_method(PROCESS_TASKS, serve, worker_pb2.ProcessTasksRequest.FromString,
                      worker_pb2.ProcessTasksResponse.SerializeToString, kind=CallKind.STREAM_STREAM)
    with LogLines() as logs:
        agent.startService()
        while len(dials) < 5:
            yield task.deferLater(reactor, 0.02, lambda: None)
        failed_lines = len([line for line in logs.matching("") if "connect failed" in line or "stream closed" in line])
        port = yield listen_grpc(reactor, f"tcp:{free}:interface=127.0.0.1", server)
        try:
            yield accepted.addTimeout(10, reactor)
            # The recovery line follows the gateway's answer (its headers) on the next turns.
            for _ in range(500):
                if any("now stopped" in line for line in logs.matching("connect failed")):
                    break
                yield task.deferLater(reactor, 0.01, lambda: None)
        finally:
            stopping = agent.stopService()
            yield port.stopListening()
            yield stopping.addTimeout(10, reactor)
    # One line for the failed streams (their reason names the failed connect), however many redials.
    assert failed_lines == 1
    assert "connect failed" in logs.matching("stream closed")[0]
    # Once the gateway answers, one line says how often it had failed.
    [summary] = [line for line in logs.matching("connect failed") if "now stopped" in line]
    assert "happened" in summary
    assert logs.matching("engine e1: connected to the gateway (stream ")
    # Nor does each dial announce its factory.
    assert not logs.matching("Starting factory <infx.transport.client._ChannelFactory")
