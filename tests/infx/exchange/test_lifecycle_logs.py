"""Engine and peer lifecycle lines: connected, models changed, refused and why, gone; a wrong
internal secret is a warning naming the peer, logged once however often the peer redials.
Real gateways on loopback; engines are grpcio (LLMariner's wire) on threads."""

from __future__ import annotations

import socket
from collections.abc import Generator
from typing import Any

import grpc
import pytest_twisted
from twisted.internet import threads
from twisted.logger import LogLevel

from harness.llmariner_engine import LLMarinerEngine
from infx.gateway.auth import KeyStore
from infx.service import GatewayService
from tests.support.exchange import gateways, internal_address, until  # noqa: F401  (fixture)
from tests.support.logs import LogLines

Steps = Generator[Any, Any, None]


def worker_address(gateway: GatewayService) -> str:
    return f"127.0.0.1:{gateway.worker_grpc.port.getHost().port}"


@pytest_twisted.inlineCallbacks
def test_engine_connected_models_changed_and_gone_are_each_one_line(gateways) -> Steps:  # noqa: F811
    gateway = yield gateways("a")
    with LogLines() as logs:
        engine = LLMarinerEngine(worker_address(gateway), "e1", ["llama"])
        try:
            yield until(lambda: bool(logs.matching("engine e1 connected")))
            engine.models = ["llama", "mistral"]
            engine.report()
            yield until(lambda: bool(logs.matching("engine e1: models now")))
        finally:
            yield threads.deferToThread(engine.close)
        yield until(lambda: bool(logs.matching("engine e1 gone")))
    [connected] = logs.matching("engine e1 connected")
    assert "tenant 'default'" in connected and "llama (ready)" in connected and "127.0.0.1:" in connected
    [changed] = logs.matching("engine e1: models now")
    assert changed.endswith("models now llama (ready), mistral (ready)")
    assert len(logs.matching("engine e1 gone")) == 1


@pytest_twisted.inlineCallbacks
def test_an_engine_with_a_wrong_key_is_refused_with_one_warning_however_often_it_redials(
    gateways, tmp_path,  # noqa: F811
) -> Steps:
    keys = tmp_path / "keys.yaml"
    keys.write_text("engine_keys:\n  - key: right\n")
    gateway = yield gateways("a", api_keys=str(keys))
    assert isinstance(gateway.keys, KeyStore) and gateway.keys.enabled
    with LogLines() as logs:
        for _ in range(4):
            engine = LLMarinerEngine(worker_address(gateway), "e1", ["llama"], key="wrong")
            yield threads.deferToThread(engine.ended.wait, 10)
            assert engine.error is not None and engine.error.code() == grpc.StatusCode.UNAUTHENTICATED
            yield threads.deferToThread(engine.close)
    refusals = [e for e in logs.events if e.get("event") == "engine_refused"]
    assert len(refusals) == 1
    assert refusals[0]["log_level"] is LogLevel.warn
    assert "engine at 127.0.0.1 refused: missing or unknown engine key" in logs.matching("refused")[0]


@pytest_twisted.inlineCallbacks
def test_a_wrong_internal_secret_is_one_warning_on_each_side_that_names_the_peer(gateways) -> Steps:  # noqa: F811
    a = yield gateways("a", internal_secret="right")
    with LogLines() as logs:
        b = yield gateways("b", echo_models="m", peers=internal_address(a), internal_secret="wrong")
        receiver = b.exchanger.receivers[internal_address(a)]
        yield until(lambda: receiver.failures >= 4)
    warnings = [e for e in logs.events if e["log_level"] is LogLevel.warn]
    accepting = [e for e in warnings if e.get("event") == "peer_refused"]
    dialling = [e for e in warnings if e.get("event") == "peer_failure"]
    assert len(accepting) == 1 and "peer at 127.0.0.1 refused: missing or wrong internal secret" in accepting[0]["text"]
    assert len(dialling) == 1 and f"peer {internal_address(a)} refused our internal secret" in dialling[0]["text"]


@pytest_twisted.inlineCallbacks
def test_peer_connected_and_gone_lines_name_the_pod(gateways) -> Steps:  # noqa: F811
    a = yield gateways("a")
    with LogLines() as logs:
        b = yield gateways("b", echo_models="m", peers=internal_address(a))
        yield until(lambda: bool(logs.matching("peer b dialled in")))
        yield b.stopService()
        yield until(lambda: bool(logs.matching("peer b disconnected")))
    assert logs.matching(f"peer {internal_address(a)}: connected at")
    assert logs.matching("peer b dialled in from 127.0.0.1:")
    assert logs.matching("peer b is draining: its engines take no new tasks from here")


@pytest_twisted.inlineCallbacks
def test_a_peer_that_is_not_there_is_one_line_however_often_it_is_redialled(gateways) -> Steps:  # noqa: F811
    # A port held bound and never listened on: refused, and no other process can take it meanwhile.
    with socket.socket() as held, LogLines() as logs:
        held.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{held.getsockname()[1]}"
        b = yield gateways("b", peers=address)
        receiver = b.exchanger.receivers[address]
        yield until(lambda: receiver.failures >= 4)
    lines = [e for e in logs.events if e.get("event") == "peer_failure"]
    assert len(lines) == 1 and f"peer {address} cannot be reached: UNAVAILABLE" in lines[0]["text"]
    assert lines[0]["log_level"] is LogLevel.info
