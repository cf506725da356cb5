"""The worker service (``infx.gateway.workers``) in-process on the reactor, against grpcio engines on threads.

The gateway is the real service tree from :func:`infx.service.build_gateway`
on loopback ports; engines are :class:`harness.llmariner_engine.LLMarinerEngine`
(grpcio, blocking) and the clients are the ``openai`` client, both run with
``deferToThread`` so the reactor keeps serving them. Being in-process, the
tests read the processor's own state and counters.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterator
from typing import Any

import grpc
import openai
import pytest
import pytest_twisted
from twisted.internet import reactor, task, threads

from harness.llmariner_engine import LLMarinerEngine, http_response
from infx.config import build_config
from infx.service import GatewayService, build_gateway
from protocol.pb import worker_pb2

StartEngine = Callable[..., LLMarinerEngine]
Steps = Generator[Any, Any, None]
LOOPBACK_OPTIONS = {name: "tcp:0:interface=127.0.0.1" for name in ("http", "worker_grpc", "internal_grpc")}


@pytest.fixture
def gateway() -> Iterator[GatewayService]:
    service = build_gateway(reactor, build_config({}, LOOPBACK_OPTIONS))
    service.startService()
    yield service
    pytest_twisted.blockon(service.stopService())


@pytest.fixture
def engines(gateway: GatewayService) -> Iterator[StartEngine]:
    started: list[LLMarinerEngine] = []

    def start(engine_id: str, models: list[str], **kwargs: Any) -> LLMarinerEngine:
        port = gateway.worker_grpc.port.getHost().port
        engine = LLMarinerEngine(f"127.0.0.1:{port}", engine_id, models, **kwargs)
        started.append(engine)
        return engine

    yield start
    for engine in started:
        pytest_twisted.blockon(threads.deferToThread(engine.close))


def until(predicate: Callable[[], Any], what: str, timeout: float = 10.0) -> Generator[Any, Any, Any]:
    """Let the reactor run until ``predicate()`` is truthy (use with ``yield from``)."""
    deadline = reactor.seconds() + timeout
    while not (value := predicate()):
        assert reactor.seconds() < deadline, f"timed out waiting for {what}"
        yield task.deferLater(reactor, 0.02, lambda: None)
    return value


def chat(gateway: GatewayService, text: str = "hi") -> Any:
    base = f"http://127.0.0.1:{gateway.http.port.getHost().port}/v1"
    client = openai.OpenAI(base_url=base, api_key="x", max_retries=0, timeout=10)
    return threads.deferToThread(
        client.chat.completions.create, model="llama", messages=[{"role": "user", "content": text}])


@pytest_twisted.inlineCallbacks
def test_status_without_engine_id_ends_the_stream_with_invalid_argument(
    gateway: GatewayService, engines: StartEngine,
) -> Steps:
    engine = engines("", ["llama"])
    yield threads.deferToThread(engine.ended.wait, 10)
    assert engine.error is not None and engine.error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert gateway.dispatcher.status()["tenants"] == {}


@pytest_twisted.inlineCallbacks
def test_engine_reporting_not_ready_leaves_routing_and_comes_back_when_ready(
    gateway: GatewayService, engines: StartEngine,
) -> Steps:
    engine = engines("flaky", ["llama"])
    yield from until(lambda: gateway.dispatcher.models("default") == ["llama"], "the engine to register")
    engine.report(ready=False)
    yield from until(lambda: gateway.dispatcher.models("default") == [], "the engine to leave routing")
    # Known but not ready: a request waits instead of being refused.
    reply = chat(gateway, "patience pays")
    yield from until(lambda: gateway.dispatcher.status()["waiting"], "the task to wait")
    assert engine.tasks == []
    engine.report(ready=True)
    assert (yield reply).choices[0].message.content == "llmariner: patience pays"
    assert gateway.dispatcher.status()["tasks"] == 0


@pytest_twisted.inlineCallbacks
def test_task_for_a_loading_model_is_dispatched_once_the_engine_reports_it_ready(
    gateway: GatewayService, engines: StartEngine,
) -> Steps:
    engine = engines("loader", ["llama"], loading=["llama"])
    yield from until(lambda: gateway.processor.known_models("default") == {"llama"}, "the engine to register")
    reply = chat(gateway, "load me")
    waiting = yield from until(lambda: gateway.dispatcher.status()["waiting"], "the task to wait")
    assert list(waiting["default"]) == ["llama"]
    engine.report(loading=())
    assert (yield reply).choices[0].message.content == "llmariner: load me"


@pytest_twisted.inlineCallbacks
def test_results_for_tasks_not_on_the_stream_are_ignored_and_the_stream_stays_up(
    gateway: GatewayService, engines: StartEngine,
) -> Steps:
    engine = engines("stray", ["llama"])
    yield from until(lambda: gateway.dispatcher.models("default"), "the engine to register")
    engine.send(worker_pb2.TaskResult(task_id="never-sent", http_response=http_response(200)))
    yield from until(lambda: gateway.processor.counters.results_ignored == 1, "the stray result to be counted")
    assert (yield chat(gateway, "still here")).choices[0].message.content == "llmariner: still here"


@pytest_twisted.inlineCallbacks
def test_engine_reconnecting_under_its_id_takes_new_tasks_on_the_new_stream(
    gateway: GatewayService, engines: StartEngine,
) -> Steps:
    old = engines("phoenix", ["llama"])
    yield from until(lambda: gateway.dispatcher.models("default"), "the first stream to register")
    first_route = gateway.processor.engine("default", "phoenix").route
    new = engines("phoenix", ["llama"])
    yield from until(lambda: gateway.processor.engine("default", "phoenix").route is not first_route,
                     "the second stream to take over")
    yield chat(gateway, "one")
    assert (len(old.tasks), len(new.tasks)) == (0, 1)
    # The old stream ending does not take the engine (now on the new stream) away.
    yield threads.deferToThread(old.close)
    yield from until(lambda: len(gateway.workers.streams) == 1, "the old stream to end")
    assert gateway.dispatcher.models("default") == ["llama"]
    yield chat(gateway, "two")
    assert len(new.tasks) == 2
