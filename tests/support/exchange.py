"""Real gateway services on loopback for exchange tests: started per test, stopped after it, and their addresses."""

from __future__ import annotations

from typing import Any, Callable

import openai
import pytest
import pytest_twisted
from twisted.internet import defer, reactor, task

from infx.config import build_config
from infx.service import GatewayService
from protocol.processor.keys import Locality


LOOPBACK = "tcp:0:interface=127.0.0.1"


@pytest.fixture
def gateways():
    started: list[GatewayService] = []

    @pytest_twisted.inlineCallbacks
    def start(name: str, **options: Any):
        config = build_config({}, {"http": LOOPBACK, "worker_grpc": LOOPBACK, "internal_grpc": LOOPBACK,
                                   "status_interval": 0.5, **options})
        gateway = GatewayService(reactor, config, pod_name=name)
        yield gateway.startService()
        started.append(gateway)
        return gateway

    yield start
    for gateway in reversed(started):
        if gateway.running:
            pytest_twisted.blockon(gateway.stopService())


def internal_address(gateway: GatewayService) -> str:
    return f"127.0.0.1:{gateway.internal_grpc.port.getHost().port}"


def base_url(gateway: GatewayService) -> str:
    return f"http://127.0.0.1:{gateway.http.port.getHost().port}/v1"


@defer.inlineCallbacks
def until(condition: Callable[[], bool], timeout: float = 10.0):
    """Poll the reactor until ``condition()`` holds; fail after ``timeout`` seconds."""
    deadline = reactor.seconds() + timeout
    while not condition():
        if reactor.seconds() > deadline:
            raise AssertionError("condition not met in time")
        yield task.deferLater(reactor, 0.02, lambda: None)


def engines(gateway: GatewayService) -> dict[tuple[str, Locality], int]:
    return gateway.processor.engine_counts()


def chat(base: str, **kwargs: Any) -> Any:
    client = openai.OpenAI(base_url=base, api_key="x", max_retries=0, timeout=10)
    return client.chat.completions.create(messages=[{"role": "user", "content": "hello infx world"}], **kwargs)
