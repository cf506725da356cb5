"""``twistd infx-engine``: option validation, the service tree, and the real command
against a gateway stand-in on loopback."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from typing import Any

import pytest
import pytest_twisted
from twisted.application.service import MultiService
from twisted.internet import defer, protocol, reactor
from twisted.python import usage

from infx.agent.engine import EngineAgent
from infx.engine_tap import AgentOptions, makeService, parse_host_port
from protocol.agent.effects import AgentConfig
from protocol.pb import worker_pb2
from tests.support.engine_loopback import control, gateway, with_timeout  # noqa: F401 (gateway is a fixture)

ROOT = Path(__file__).resolve().parents[2]


def parse(*argv: str) -> AgentOptions:
    options = AgentOptions()
    options.parseOptions(list(argv))
    return options


def test_minimal_options_give_defaults() -> None:
    options = parse("--server", "gw:8082", "--models", "a, b")
    assert (options["host"], options["port"]) == ("gw", 8082)
    assert options["models"] == ("a", "b")
    assert options["runtime"] == "echo"
    assert options["engine-id"]
    config = options["agent-config"]
    assert (config.max_concurrency, config.status_interval) == (32, 10.0)
    assert options["echo-config"].token_delay == 0.0


def test_ipv6_server_address_is_accepted() -> None:
    assert parse_host_port("[::1]:8082") == ("::1", 8082)


def test_key_defaults_to_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("INFX_ENGINE_KEY", "from-env")
    assert parse("--server", "gw:1", "--models", "m")["key"] == "from-env"
    assert parse("--server", "gw:1", "--models", "m", "--key", "flag")["key"] == "flag"


@pytest.mark.parametrize(
    "argv",
    [
        ["--models", "m"],
        ["--server", "gw", "--models", "m"],
        ["--server", "gw:0", "--models", "m"],
        ["--server", "gw:1"],
        ["--server", "gw:1", "--models", "m,m"],
        ["--server", "gw:1", "--models", "m", "--runtime", "vllm"],
        ["--server", "gw:1", "--models", "m", "--runtime", "openai"],
        ["--server", "gw:1", "--runtime", "openai", "--upstream", "http://h:1", "--runtime-check-interval", "0"],
        ["--server", "gw:1", "--models", "m", "--upstream-api-key-file", "/nonexistent"],
        ["--server", "gw:1", "--models", "m", "--runtime", "openai", "--upstream", "ftp://x"],
        ["--server", "gw:1", "--models", "m", "--upstream", "http://x:1"],
        ["--server", "gw:1", "--models", "m", "--max-concurrency", "0"],
        ["--server", "gw:1", "--models", "m", "--max-concurrency", "many"],
        ["--server", "gw:1", "--models", "m", "--status-interval", "0"],
        ["--server", "gw:1", "--models", "m", "--token-delay", "-1"],
        ["--server", "gw:1", "--models", "m", "--token-delay", "nan"],
        ["--server", "gw:1", "--models", "m", "--ca", "/nonexistent.pem"],
        ["--server", "gw:1", "--models", "m", "--tls", "--ca", "/nonexistent.pem"],
        ["--server", "gw:1", "--models", "m", "--runtime-slots", "4"],
        ["--server", "gw:1", "--runtime", "openai", "--upstream", "http://h:1", "--runtime-slots", "0"],
        ["--server", "gw:1", "--runtime", "openai", "--upstream", "http://h:1", "--runtime-slots", "1.5"],
        ["--server", "gw:1", "--models", "m", "--runtime-slot-files", "8"],
        ["--server", "gw:1", "--runtime", "openai", "--upstream", "http://h:1", "--runtime-slot-files", "-1"],
    ],
)
def test_bad_options_are_usage_errors(argv: list[str]) -> None:
    with pytest.raises(usage.UsageError):
        parse(*argv)


def test_twistd_infx_engine_max_queued_option_reaches_the_agent_config() -> None:
    from twisted.python import usage

    from infx.engine_tap import AgentOptions

    def parse(*extra: str) -> AgentConfig:
        options = AgentOptions()
        options.parseOptions(["--server", "gw:1", "--models", "m", "--max-concurrency", "2", *extra])
        agent_config: AgentConfig = options["agent-config"]
        return agent_config

    assert parse().queue_limit == 8
    assert parse("--max-queued", "0").queue_limit == 0
    for bad in ("-1", "many"):
        with pytest.raises(usage.UsageError, match="--max-queued"):
            parse("--max-queued", bad)


def test_runtime_slots_reach_the_agent_config_and_default_to_what_the_runtime_says() -> None:
    openai = ["--server", "gw:1", "--runtime", "openai", "--upstream", "http://h:1"]
    assert parse(*openai)["agent-config"].runtime_slots is None
    assert parse(*openai, "--runtime-slots", "256")["agent-config"].runtime_slots == 256


def test_runtime_slot_files_put_the_slot_keeper_before_the_runtime() -> None:
    from infx.agent.slot_keeping import SlotKeepingRuntime

    openai = ["--server", "gw:1", "--runtime", "openai", "--upstream", "http://h:1", "--engine-id", "e:1"]
    plain = [s for s in makeService(parse(*openai)) if isinstance(s, EngineAgent)][0]
    assert not isinstance(plain.runtime, SlotKeepingRuntime)
    agent = [s for s in makeService(parse(*openai, "--runtime-slot-files", "8", "--runtime-slots", "2"))
             if isinstance(s, EngineAgent)][0]
    assert isinstance(agent.runtime, SlotKeepingRuntime)
    assert agent.runtime.keeper is not None and agent.runtime.prefix == "infx-e_1-"


@pytest.mark.parametrize("runtime", [["--runtime", "echo"], ["--runtime", "openai", "--upstream", "http://h:8000/v1"]])
def test_make_service_builds_a_tree_with_the_agent(runtime: list[str]) -> None:
    service = makeService(parse("--server", "gw:8082", "--models", "m", *runtime))
    assert isinstance(service, MultiService)
    agents = [s for s in service if isinstance(s, EngineAgent)]
    assert len(agents) == 1 and agents[0].core.config.models == ("m",)


def test_openai_runtime_without_models_serves_what_the_runtime_lists() -> None:
    options = parse("--server", "gw:1", "--runtime", "openai", "--upstream", "http://h:8000")
    config = options["agent-config"]
    assert config.models == () and config.wait_for_runtime
    assert not parse("--server", "gw:1", "--models", "m")["agent-config"].wait_for_runtime


def test_upstream_key_comes_from_a_file_or_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    openai = ["--server", "gw:1", "--runtime", "openai", "--upstream", "http://h:8000"]
    key_file = tmp_path / "key"
    key_file.write_text("sk-file\n")
    assert parse(*openai, "--upstream-api-key-file", str(key_file))["upstream-key"] is None
    monkeypatch.setenv("INFX_UPSTREAM_API_KEY", "sk-env")
    assert parse(*openai)["upstream-key"] == "sk-env"
    with pytest.raises(usage.UsageError, match="not both"):
        parse(*openai, "--upstream-api-key-file", str(key_file))
    with pytest.raises(usage.UsageError, match="only applies to --runtime openai"):
        parse("--server", "gw:1", "--models", "m")
    monkeypatch.delenv("INFX_UPSTREAM_API_KEY")
    key_file.write_text("")
    with pytest.raises(usage.UsageError, match="--upstream-api-key-file: .* is empty"):
        parse(*openai, "--upstream-api-key-file", str(key_file))


def test_the_openai_tree_watches_its_runtime_and_tells_the_agent(tmp_path: Path) -> None:
    from infx.agent.runtime_load_watch import ReadWhenReady, RuntimeLoadWatch
    from infx.agent.runtime_watch import RuntimeWatch

    key_file = tmp_path / "key"
    key_file.write_text("sk-1")
    service = makeService(parse("--server", "gw:1", "--runtime", "openai", "--upstream", "http://h:8000",
                                "--upstream-api-key-file", str(key_file), "--runtime-check-interval", "2"))
    watches = [s for s in service if isinstance(s, RuntimeWatch)]
    agent = next(s for s in service if isinstance(s, EngineAgent))
    load, = [s for s in service if isinstance(s, RuntimeLoadWatch)]
    # The agent hears of each verdict, and a runtime that turns ready has its load read at once.
    assert len(watches) == 1 and isinstance(told := watches[0].changed, ReadWhenReady)
    assert told.changed == agent.runtime_changed and told.load is load
    assert watches[0].machine.config.interval == 2 and watches[0].machine.config.list_models
    assert watches[0].runtime.credentials is not None and watches[0].runtime.credentials.current() == "sk-1"


class _Output(protocol.ProcessProtocol):
    def __init__(self) -> None:
        self.output = b""
        self.ended: defer.Deferred[Any] = defer.Deferred()

    def outReceived(self, data: bytes) -> None:
        self.output += data

    errReceived = outReceived

    def processEnded(self, reason: Any) -> None:
        self.ended.callback((reason.value.exitCode, reason.value.signal))


@pytest.mark.e2e
@pytest_twisted.inlineCallbacks
def test_twistd_infx_engine_registers_answers_and_reports_not_ready_on_sigterm(gateway):  # noqa: F811
    gw, port = gateway
    out = _Output()
    twistd = str(Path(sys.executable).with_name("twistd"))
    argv = [twistd, "-n", "--pidfile=", "infx-engine", "--server", f"127.0.0.1:{port}", "--models", "m1,m2",
            "--engine-id", "cli-engine", "--key", "k"]
    process = reactor.spawnProcess(out, twistd, argv, env={**os.environ, "PYTHONPATH": str(ROOT)}, path=str(ROOT))
    try:
        stream = yield gw.next_stream()
        yield stream.wait_for(lambda: bool(stream.statuses))
        status = stream.statuses[0]
        assert status.engine_id == "cli-engine" and status.ready
        assert [m.id for m in status.models] == ["m1", "m2"]
        stream.send(control("hb", heartbeat=worker_pb2.HeartbeatRequest()))
        [answer] = yield stream.complete("hb")
        assert answer.http_response.status_code == 200
        process.signalProcess(signal.SIGTERM)
        yield stream.wait_for(lambda: any(not s.ready for s in stream.statuses))
        yield stream.wait_for(lambda: stream.half_closed)
        stream.end.callback(None)
        code, sig = yield with_timeout(out.ended)
        # twistd ends a clean SIGTERM shutdown by re-raising the signal on itself.
        assert code == 0 or sig == signal.SIGTERM, out.output.decode(errors="replace")
        assert b"drained" in out.output and b"Traceback" not in out.output
    finally:
        if process.pid is not None:
            process.signalProcess(signal.SIGKILL)


def test_tracing_options_of_the_agent_are_checked_and_off_by_default() -> None:
    from infx.tracing import TracingConfig

    assert parse("--server", "gw:1", "--models", "m")["tracing-config"] is None
    options = parse("--server", "gw:1", "--models", "m", "--otlp-traces-endpoint", "http://c:4317",
                    "--otlp-traces-protocol", "grpc", "--trace-sample-ratio", "0.5")
    assert options["tracing-config"] == TracingConfig("http://c:4317", "grpc", 0.5)
    for bad, message in ((["--otlp-traces-endpoint", "c:4317"], "--otlp-traces-endpoint"),
                         (["--otlp-traces-endpoint", "http://c", "--otlp-traces-protocol", "x"], "--otlp-traces-protocol"),
                         (["--trace-sample-ratio", "2"], "--trace-sample-ratio")):
        with pytest.raises(usage.UsageError, match=message):
            parse("--server", "gw:1", "--models", "m", *bad)
