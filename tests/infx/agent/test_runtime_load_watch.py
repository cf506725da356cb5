"""The runtime load watch on loopback: a runtime's /metrics reach the gateway in the engine's status."""

from __future__ import annotations

from collections.abc import Generator
from typing import Any

import pytest
import pytest_twisted
from twisted.internet import defer, reactor, task
from twisted.python import usage
from twisted.web import resource, server
from twisted.web.client import Agent

from infx.agent.runtime_load_watch import ReadWhenReady, RuntimeLoadWatch, scrape_pool
from infx.engine_tap import AgentOptions, makeService
from protocol.agent.runtime_load import LoadConfig, LoadSample, LoadSource, RuntimeLoad, RuntimeLoadMonitor
from tests.support.engine_loopback import gateway, with_timeout  # noqa: F401 (gateway is a fixture)


class FakeRuntime(resource.Resource):
    """A runtime root whose /metrics body the test sets; every other path is 404."""

    isLeaf = True

    def __init__(self, metrics: bytes | None, key: str | None = None) -> None:
        super().__init__()
        self.metrics = metrics
        self.key = key
        self.paths: list[bytes] = []

    def render_GET(self, request: server.Request) -> bytes:
        self.paths.append(request.path)
        if self.key is not None and request.getHeader("authorization") != f"Bearer {self.key}":
            request.setResponseCode(401)
            return b"unauthorized"
        if request.path == b"/metrics" and self.metrics is not None:
            request.setHeader("content-type", "text/plain; version=0.0.4")
            return self.metrics
        request.setResponseCode(404)
        return b"Not Found"


def vllm(running: int, waiting: int) -> bytes:
    return (f'vllm:num_requests_running{{model_name="m"}} {running}.0\n'
            f'vllm:num_requests_waiting{{model_name="m"}} {waiting}.0\n'
            'vllm:kv_cache_usage_perc{model_name="m"} 0.5\n').encode()


@pytest.fixture
def runtime_server(request: pytest.FixtureRequest) -> Generator[tuple[FakeRuntime, str], None, None]:
    fake = FakeRuntime(*getattr(request, "param", (vllm(2, 1),)))
    port = reactor.listenTCP(0, server.Site(fake), interface="127.0.0.1")
    yield fake, f"http://127.0.0.1:{port.getHost().port}"
    pytest_twisted.blockon(defer.maybeDeferred(port.stopListening))


@defer.inlineCallbacks
def eventually(condition: Any) -> Generator[Any, Any, None]:
    """Wait (bounded) until ``condition()`` holds: the watch polls on the real reactor."""
    for _ in range(400):
        if condition():
            return
        yield task.deferLater(reactor, 0.01, lambda: None)
    raise AssertionError("condition never held")


@pytest_twisted.inlineCallbacks
def test_runtime_load_reaches_the_gateway_with_the_engine_status(gateway, runtime_server):  # noqa: F811
    gw, port = gateway
    fake, root = runtime_server
    options = AgentOptions()
    options.parseOptions(["--server", f"127.0.0.1:{port}", "--models", "m", "--runtime", "openai",
                          "--upstream", root, "--runtime-load-interval", "0.02",
                          "--runtime-load-report-interval", "0"])
    tree = makeService(options)
    tree.startService()
    try:
        stream = yield gw.next_stream()
        # A reading scraped before the stream opened has no stamp; the first one after it does,
        # although the figures are the same (the gateway must know what they include).
        def stamped() -> list[Any]:
            return [s.models[0].runtime_load for s in stream.statuses
                    if s.models[0].runtime_load.HasField("tasks_received")]
        yield stream.wait_for(lambda: bool(stamped()))
        load = stamped()[0]
        assert (load.source, load.running_requests, load.waiting_requests, load.kv_cache_usage) == ("vllm", 2, 1, 0.5)
        # Read before any task came: it includes none of the gateway's.
        assert (load.tasks_received, load.tasks_ended) == (0, 0)
        fake.metrics = vllm(7, 3)
        yield stream.wait_for(lambda: stream.statuses[-1].models[0].runtime_load.running_requests == 7)
        assert stream.statuses[-1].models[0].runtime_load.waiting_requests == 3
    finally:
        stopping = tree.stopService()
        gw.end_all()
        yield with_timeout(stopping)


def watch(root: str, changed: list[Any], **kwargs: Any) -> RuntimeLoadWatch:
    pool = scrape_pool(reactor)
    monitor = RuntimeLoadMonitor(LoadConfig(interval=0.01, absent_interval=60.0, report_min_interval=0.0))
    service = RuntimeLoadWatch(reactor, monitor, Agent(reactor, pool=pool), root, changed.append, **kwargs)
    service.pool = pool  # type: ignore[attr-defined]
    return service


@defer.inlineCallbacks
def stop(service: RuntimeLoadWatch) -> Generator[Any, Any, None]:
    service.stopService()
    yield service.pool.closeCachedConnections()  # type: ignore[attr-defined]


@pytest.mark.parametrize("runtime_server", [(None,)], indirect=True)
@pytest_twisted.inlineCallbacks
def test_a_runtime_without_metrics_or_slots_reports_no_load(runtime_server):
    fake, root = runtime_server
    changed: list[Any] = []
    service = watch(root, changed)
    service.startService()
    try:
        yield eventually(lambda: service.monitor.source is LoadSource.ABSENT)
        assert sorted(fake.paths) == [b"/metrics", b"/slots"]  # one probe asks both at once
        assert changed == []
    finally:
        yield stop(service)


@pytest_twisted.inlineCallbacks
def test_each_reading_carries_the_stamp_taken_as_its_scrape_went_out(runtime_server):
    _, root = runtime_server
    changed: list[Any] = []
    stamps = iter(LoadSample(1, n, n - 1) for n in range(1, 1000))
    service = watch(root, changed, sample=lambda: next(stamps))
    service.startService()
    try:
        yield eventually(lambda: bool(changed))
        assert changed[0] == RuntimeLoad("vllm", 2, 1, kv_cache_usage=0.5, sample=LoadSample(1, 1, 0))
    finally:
        yield stop(service)


@pytest.mark.parametrize("runtime_server", [(vllm(1, 0), "secret")], indirect=True)
@pytest_twisted.inlineCallbacks
def test_scrapes_carry_the_runtimes_credentials(runtime_server):
    _, root = runtime_server
    changed: list[Any] = []
    service = watch(root, changed, authorize=lambda headers: headers.setRawHeaders(b"authorization", [b"Bearer secret"]))
    service.startService()
    try:
        yield eventually(lambda: bool(changed))
        assert changed[0] == RuntimeLoad("vllm", 1, 0, kv_cache_usage=0.5)
    finally:
        yield stop(service)


@pytest.mark.parametrize("runtime_server", [(vllm(1, 0), "secret")], indirect=True)
@pytest_twisted.inlineCallbacks
def test_a_refused_key_is_reported_and_no_load_is(runtime_server):
    fake, root = runtime_server
    changed: list[Any] = []
    refusals: list[None] = []
    service = watch(root, changed, authorize=lambda headers: headers.setRawHeaders(b"authorization", [b"Bearer old"]),
                    refused=lambda: refusals.append(None))
    service.startService()
    try:
        yield eventually(lambda: len(refusals) >= 2)
        assert changed == [] and set(fake.paths[:2]) == {b"/metrics", b"/slots"}  # one probe, both refused
    finally:
        yield stop(service)


@pytest_twisted.inlineCallbacks
def test_a_runtime_that_turns_ready_is_read_at_once_not_a_scrape_interval_later(runtime_server):
    fake, root = runtime_server
    changed: list[Any] = []
    health: list[tuple[bool, tuple[str, ...]]] = []
    pool = scrape_pool(reactor)
    monitor = RuntimeLoadMonitor(LoadConfig(interval=60.0, report_min_interval=0.0))
    service = RuntimeLoadWatch(reactor, monitor, Agent(reactor, pool=pool), root, changed.append)
    seen = ReadWhenReady(lambda ready, models: health.append((ready, models)), service)
    service.startService()
    try:
        yield eventually(lambda: bool(changed))  # the first reading, at start
        asked = len(fake.paths)
        seen(False, ())
        yield task.deferLater(reactor, 0.05, lambda: None)
        assert len(fake.paths) == asked, "a runtime that is not ready is not read again"
        seen(True, ("m",))
        # Ready is told once that reading is in, after what it said: never while the gateway knows no load.
        assert health == [(False, ())]
        yield eventually(lambda: len(health) == 2)
        assert fake.paths[asked:] == [b"/metrics"]
        assert health == [(False, ()), (True, ("m",))]
        seen(True, ("m", "n"))
        assert health[-1] == (True, ("m", "n")), "a ready runtime's models are told at once"
    finally:
        service.stopService()
        yield pool.closeCachedConnections()


class Stalled(FakeRuntime):
    """Once ``stalled``, answers (404) only when the test lets it."""

    def __init__(self) -> None:
        super().__init__(vllm(0, 0))
        self.stalled = False
        self.held: list[server.Request] = []

    def render_GET(self, request: server.Request) -> bytes | int:
        if self.stalled:
            self.paths.append(request.path)
            self.held.append(request)
            return server.NOT_DONE_YET
        return super().render_GET(request)

    def answer(self) -> None:
        held, self.held = self.held, []
        for request in held:
            request.setResponseCode(404)
            request.finish()


@pytest_twisted.inlineCallbacks
def test_a_verdict_that_follows_while_the_reading_is_under_way_replaces_it():
    fake = Stalled()
    port = reactor.listenTCP(0, server.Site(fake), interface="127.0.0.1")
    health: list[tuple[bool, tuple[str, ...]]] = []
    pool = scrape_pool(reactor)
    service = RuntimeLoadWatch(reactor, RuntimeLoadMonitor(LoadConfig(interval=60.0, report_min_interval=0.0)),
                               Agent(reactor, pool=pool), f"http://127.0.0.1:{port.getHost().port}", lambda load: None)
    seen = ReadWhenReady(lambda ready, models: health.append((ready, models)), service)
    service.startService()
    try:
        yield eventually(lambda: not service.monitor.reading)  # the reading at start, answered
        fake.stalled = True
        seen(True, ("m",))
        yield eventually(lambda: bool(fake.held))
        seen(False, ())  # its health check failed meanwhile
        fake.answer()
        yield eventually(lambda: not service.monitor.reading)
        yield task.deferLater(reactor, 0.05, lambda: None)
        assert health == [(False, ())], "a reading that ends after a later verdict does not undo it"
        seen(True, ("m",))
        yield eventually(lambda: bool(fake.held))
        assert health == [(False, ())]
        fake.answer()  # a failed reading lets readiness through too: there is no load to wait for
        yield eventually(lambda: len(health) == 2)
        assert health[-1] == (True, ("m",))
    finally:
        fake.answer()
        service.stopService()
        yield pool.closeCachedConnections()
        yield port.stopListening()


def parse(*argv: str) -> AgentOptions:
    options = AgentOptions()
    options.parseOptions(["--server", "gw:1", "--models", "m", *argv])
    return options


def test_load_reading_is_on_by_default_for_openai_runtimes_only_and_can_be_turned_off() -> None:
    openai = ["--runtime", "openai", "--upstream", "http://h:8000"]
    config = parse(*openai)["load-config"]
    assert (config.interval, config.report_min_interval) == (1.0, 2.0)
    assert parse(*openai, "--runtime-load-interval", "0")["load-config"] is None
    assert parse()["load-config"] is None
    with pytest.raises(usage.UsageError):
        parse(*openai, "--runtime-load-interval", "-1")
