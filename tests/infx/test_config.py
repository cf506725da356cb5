"""Gateway configuration: YAML keys and flags merge, and bad values are refused with a clear message."""

import pytest

from infx.config import ConfigError, build_config, load_yaml


def test_defaults_follow_llmariner_ports():
    config = build_config({}, {})
    assert (config.http, config.worker_grpc, config.internal_grpc) == ("tcp:8080", "tcp:8082", "tcp:8083")
    assert config.effective_peer_port == 8083


def test_flags_win_over_the_file_and_dashes_match_underscores(tmp_path):
    path = tmp_path / "infx.yaml"
    path.write_text("http: 9000\nworker_grpc: 'tcp:9002:interface=127.0.0.2'\npeers: [a:1, b:2]\nqueue-timeout: 3\n")
    config = build_config(load_yaml(str(path)), {"http": "9100", "peers": None})
    assert config.http == "tcp:9100"
    assert config.worker_grpc == "tcp:9002:interface=127.0.0.2"
    assert config.peers == ("a:1", "b:2")
    assert config.queue_timeout == 3.0


def test_peer_port_defaults_to_the_internal_listen_port_number():
    config = build_config({}, {"internal_grpc": "tcp:9183:interface=127.0.0.3", "kube": True})
    assert config.effective_peer_port == 9183


@pytest.mark.parametrize(
    "values,message",
    [
        ({"http": "99999"}, "--http: port 99999 is out of range"),
        ({"http": "eighty"}, "--http: expected a port number"),
        ({"peers": "nohost"}, "--peers: expected HOST:PORT"),
        ({"peers": "a:1", "kube": True}, "exclusive"),
        ({"scaler": True}, "--scaler needs --kube"),
        ({"pod_label": "app"}, "--pod-label: expected key=value"),
        ({"queue_timeout": "-1"}, "--queue-timeout: invalid value"),
        ({"kube": "maybe"}, "--kube: invalid value"),
        ({"colour": "blue"}, "unknown option 'colour'"),
    ],
)
def test_invalid_values_are_refused_with_the_option_named(values, message):
    with pytest.raises(ConfigError, match=message):
        build_config(values, {})


def test_config_file_must_be_a_yaml_mapping(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("- just\n- a list\n")
    with pytest.raises(ConfigError, match="must hold a mapping"):
        load_yaml(str(path))
    with pytest.raises(ConfigError, match="cannot read"):
        load_yaml(str(tmp_path / "missing.yaml"))


def test_echo_token_delay_may_be_zero_but_not_negative():
    assert build_config({}, {"echo_token_delay": "0"}).echo_token_delay == 0.0
    with pytest.raises(ConfigError, match="--echo-token-delay"):
        build_config({}, {"echo_token_delay": "-0.5"})


def test_heartbeats_are_off_unless_an_interval_is_given():
    assert build_config({}, {}).heartbeat_interval is None
    assert build_config({"heartbeat_interval": 5}, {}).heartbeat_interval == 5.0
    with pytest.raises(ConfigError, match="--heartbeat-interval"):
        build_config({}, {"heartbeat_interval": "0"})


def test_engine_and_tenant_caps_are_off_unless_given_and_must_be_positive():
    defaults = build_config({}, {})
    assert (defaults.max_in_flight_per_engine, defaults.max_tasks_per_tenant) == (None, None)
    config = build_config({"max_in_flight_per_engine": 4}, {"max-tasks-per-tenant": "10"})
    assert (config.max_in_flight_per_engine, config.max_tasks_per_tenant) == (4, 10)
    with pytest.raises(ConfigError, match="--max-in-flight-per-engine: must be at least 1"):
        build_config({}, {"max_in_flight_per_engine": "0"})
    with pytest.raises(ConfigError, match="--max-tasks-per-tenant: invalid value"):
        build_config({}, {"max_tasks_per_tenant": "lots"})


def test_twistd_infx_cap_flags_reach_the_processor():
    from twisted.internet.task import Clock

    from infx.service import GatewayService
    from infx.tap import GatewayOptions

    options = GatewayOptions()
    options.parseOptions(["--max-in-flight-per-engine", "3", "--max-tasks-per-tenant", "7", "--max-attempts", "2"])
    processor = GatewayService(Clock(), options.config_value, environ={}).processor
    assert (processor.config.max_in_flight_per_engine, processor.config.max_tasks_per_tenant) == (3, 7)
    assert processor.config.max_attempts == 2


def test_a_request_is_sent_three_times_at_most_unless_told_otherwise_and_at_least_once():
    assert build_config({}, {}).max_attempts == 3
    with pytest.raises(ConfigError, match="--max-attempts"):
        build_config({}, {"max_attempts": "0"})


# --- listen endpoints: refused before anything starts ------------------------------------------------

from hypothesis import example, given, settings, strategies as st  # noqa: E402

from infx.config import listen_endpoint  # noqa: E402


@pytest.mark.parametrize("value,message", [
    ("tcp:99999", "--http: port 99999 is out of range"),
    ("tcp:-1", "--http: port -1 is out of range"),
    ("tcp:port=70000", "--http: port 70000 is out of range"),
    ("tcp:notaport", r"--http: 'tcp:notaport' is not a server endpoint \(invalid literal"),
    ("foo:bar", r"--http: 'foo:bar' is not a server endpoint \(Unknown endpoint type: 'foo'\)"),
    ("tcp:8080:interfce=127.0.0.1", "unexpected keyword argument 'interfce'"),
    ("ssl::::", r"--http: 'ssl::::' is not a server endpoint"),
    ("tcp:\\0", r"--http: cannot tell the port of 'tcp:\\\\0'"),
    ("127.0.0.1:28080", r"'127.0.0.1:28080' is HOST:PORT.*did you mean tcp:28080:interface=127.0.0.1\?"),
    ("localhost:8080", r"did you mean tcp:8080:interface=localhost\?"),
    ("[::1]:8080", r"did you mean tcp6:8080:interface=\\:\\:1\?"),
    ("ssl:8443:privateKey=/nonexistent/key.pem", "--http: cannot read /nonexistent/key.pem: No such file"),
])
def test_listen_endpoints_that_could_never_listen_are_refused(value, message):
    with pytest.raises(ConfigError, match=message):
        listen_endpoint(value, "--http")


def test_an_ssl_endpoint_whose_files_are_not_pem_is_refused(tmp_path):
    junk = tmp_path / "junk.pem"
    junk.write_text("not a key\n")
    with pytest.raises(ConfigError, match="certificate and private key of .* are not PEM that loads"):
        listen_endpoint(f"ssl:8443:privateKey={junk}", "--http")


@pytest.mark.parametrize("value,expected", [
    ("8080", "tcp:8080"), ("0", "tcp:0"), ("tcp:0:interface=127.0.0.1", "tcp:0:interface=127.0.0.1"),
    ("tcp6:8080:interface=\\:\\:1", "tcp6:8080:interface=\\:\\:1"), ("unix:/run/infx.sock", "unix:/run/infx.sock"),
    ("tcp:port=8080:backlog=100", "tcp:port=8080:backlog=100"),
])
def test_ports_and_endpoint_strings_that_can_listen_are_accepted(value, expected):
    assert listen_endpoint(value, "--http") == expected


@settings(max_examples=300, deadline=None)
@given(st.one_of(st.text(max_size=40),
                 st.builds(lambda kind, rest: f"{kind}:{rest}", st.sampled_from(["tcp", "tcp6", "unix", "ssl", "x"]),
                           st.text(alphabet="0123456789:=-abcdefghinoprtx.\\", max_size=30))))
@example("0\n:")  # Twisted quotes the unknown type raw, newline and all
def test_any_listen_value_is_accepted_as_an_endpoint_or_refused_with_a_config_error(value):
    from twisted.internet.endpoints import serverFromString

    try:
        endpoint = listen_endpoint(value, "--http")
    except ConfigError as e:
        assert str(e).startswith("--http") and "\n" not in str(e)
        return
    serverFromString(None, endpoint)  # what the service will do, later, with the reactor
def test_routing_policy_is_one_of_the_three():
    from infx.config import ConfigError, GatewayConfig, validate

    assert validate(GatewayConfig()).routing_policy == "affinity"
    assert validate(GatewayConfig(routing_policy="round_robin")).routing_policy == "round_robin"
    with pytest.raises(ConfigError, match="--routing-policy: expected one of affinity, least_in_progress, round_robin"):
        validate(GatewayConfig(routing_policy="random"))


def test_routing_policy_flag_reaches_the_config():
    from infx.tap import GatewayOptions

    options = GatewayOptions()
    options.parseOptions(["--routing-policy", "least_in_progress"])
    assert options.config_value.routing_policy == "least_in_progress"


def test_routing_knobs_default_to_the_policys_own_defaults():
    from infx.config import routing_config
    from protocol.routing.hints import HintsConfig
    from protocol.routing.config import RoutingConfig

    assert routing_config(build_config({}, {})) == (RoutingConfig(), HintsConfig())


def test_routing_knobs_from_flags_and_file_reach_the_policy(tmp_path):
    from infx.config import routing_config
    from infx.tap import GatewayOptions

    path = tmp_path / "infx.yaml"
    path.write_text("routing_weights: 'prefix=4, kv=0'\nrouting_sessions: 0\n")
    options = GatewayOptions()
    options.parseOptions(["--config", str(path), "--routing-load-factor", "1.5", "--routing-min-capacity", "2",
                          "--routing-block-bytes", "128", "--routing-max-blocks", "32",
                          "--routing-index-blocks-per-engine", "1000", "--routing-index-blocks", "0",
                          "--routing-spilled-tips", "16"])
    routing, hints = routing_config(options.config_value)
    assert (routing.load_factor, routing.min_capacity, routing.prefix_weight, routing.kv_weight,
            routing.home_weight) == (1.5, 2, 4.0, 0.0, 0.5)
    assert (routing.index_blocks_per_engine, routing.index_blocks_total, routing.sessions,
            routing.spilled_tips) == (1000, 0, 0, 16)
    assert (hints.block_bytes, hints.max_blocks) == (128, 32)


@pytest.mark.parametrize("flags, message", [
    ({"routing_load_factor": "1"}, "--routing-load-factor: must be more than 1, got 1"),
    ({"routing_load_factor": "x"}, "--routing-load-factor: invalid value 'x'"),
    ({"routing_min_capacity": "0"}, "--routing-min-capacity: invalid value '0'"),
    ({"routing_block_bytes": "8"}, "--routing-block-bytes: must be at least 16, got 8"),
    ({"routing_max_blocks": "0"}, "--routing-max-blocks: invalid value '0'"),
    ({"routing_index_blocks": "-1"}, "--routing-index-blocks: invalid value '-1'"),
    ({"routing_weights": "prefix=8,speed=1"}, "--routing-weights: expected name=value with a name among prefix, "
                                              "home, session, adapter, queue, kv, busy, got 'speed=1'"),
    ({"routing_weights": "queue"}, "--routing-weights: expected name=value"),
    ({"routing_weights": "queue=-1"}, "--routing-weights: queue must be a number >= 0, got '-1'"),
    ({"routing_weights": "kv=nan"}, "--routing-weights: kv must be a number >= 0, got 'nan'"),
])
def test_a_routing_knob_out_of_range_is_one_line_naming_its_option(flags, message):
    with pytest.raises(ConfigError) as raised:
        build_config({}, flags)
    assert str(raised.value).startswith(message) and "\n" not in str(raised.value)


# --- runtimes by URL -------------------------------------------------------------------------------


def test_runtime_urls_come_from_repeated_flags_or_a_yaml_list_of_strings_and_mappings(tmp_path):
    from infx.config import runtime_targets
    from infx.tap import GatewayOptions
    from protocol.discovery.runtimes import RuntimeTarget

    options = GatewayOptions()
    options.parseOptions(["--runtime-url", "http://a:8000/v1/=llama-3,llama-3-lora", "--runtime-url", "https://b"])
    assert runtime_targets(options.config_value) == (
        RuntimeTarget("http://a:8000", ("llama-3", "llama-3-lora")), RuntimeTarget("https://b"))
    path = tmp_path / "infx.yaml"
    path.write_text("runtime_url:\n  - http://a:8000=m\n  - {url: 'http://b:9000', models: [x, y]}\n"
                    "  - {url: 'http://c:9000'}\nruntime_pod_label: app=vllm\nruntime_port: 8001\n")
    config = build_config(load_yaml(str(path)), {})
    assert runtime_targets(config) == (RuntimeTarget("http://a:8000", ("m",)), RuntimeTarget("http://b:9000", ("x", "y")),
                                       RuntimeTarget("http://c:9000"))
    assert (config.runtime_pod_label, config.runtime_port, config.runtime_max_concurrency) == ("app=vllm", 8001, 32)


@pytest.mark.parametrize(
    "values,message",
    [
        ({"runtime_url": "a:8000"}, "--runtime-url: expected http"),
        ({"runtime_url": "ftp://a:1"}, "--runtime-url: expected http"),
        ({"runtime_url": "http://a:8000?x=1"}, "--runtime-url: expected http"),
        ({"runtime_url": "http://user:pw@a:8000"}, "--runtime-url: expected http"),
        ({"runtime_url": "http://a:99999"}, "--runtime-url: 'http://a:99999' has no valid port"),
        ({"runtime_url": "http://a:8000="}, "names no model"),
        ({"runtime_url": "http://a:8000=m,m"}, "names a model twice"),
        ({"runtime_url": ["http://a:8000", "http://a:8000/v1"]}, "http://a:8000 is given twice"),
        ({"runtime_url": [{"url": "http://a:1", "modles": ["m"]}]}, "a mapping takes url"),
        ({"runtime_url": [3]}, "--runtime-url: expected URL"),
        ({"runtime_pod_label": "vllm"}, "--runtime-pod-label: expected key=value"),
        ({"runtime_port": "70000"}, "--runtime-port: 70000 is out of range"),
        ({"runtime_max_concurrency": "0"}, "--runtime-max-concurrency: invalid value"),
        ({"runtime_tenant": "team-a"}, "--runtime-tenant 'team-a' needs --api-keys"),
        ({"runtime_api_key_file": "/nonexistent/key"}, "--runtime-api-key-file: cannot read"),
        ({"runtime_slot_files": "-1"}, "--runtime-slot-files: invalid value '-1'"),
        ({"runtime_slot_files": "8", "workers": 1}, "--runtime-slot-files keeps the slots of runtimes by URL"),
        ({"runtime_url": "http://a:8000", "runtime_slot_files": "8", "workers": 2},
         "--runtime-slot-files needs --workers 1 \\(this would run 2\\)"),
    ],
)
def test_a_runtime_option_that_cannot_work_is_refused_with_the_option_named(values, message):
    with pytest.raises(ConfigError, match=message):
        build_config(values, {})
def test_runtime_slot_files_keep_the_slots_of_runtimes_by_url_from_one_worker():
    config = build_config({"runtime_url": "http://a:8000", "runtime_slot_files": 16}, {"workers": "1"})
    assert config.runtime_slot_files == 16
    assert build_config({}, {}).runtime_slot_files == 0


def test_workers_default_to_the_cores_the_process_may_use_within_its_cgroup_quota(tmp_path):
    """--workers: given, it is taken (1 to 256); not given, the CPU affinity, capped by cgroup v2's
    cpu.max quota (a container limited to 1.5 CPUs on a larger node gets 2, never more than its cores)."""
    import os

    from infx.config import ConfigError, build_config, usable_cores, worker_count

    cores = len(os.sched_getaffinity(0))
    cpu_max = tmp_path / "cpu.max"
    assert usable_cores(str(tmp_path / "absent")) == cores
    cpu_max.write_text("max 100000\n")
    assert usable_cores(str(cpu_max)) == cores
    cpu_max.write_text("150000 100000\n")
    assert usable_cores(str(cpu_max)) == min(cores, 2)
    cpu_max.write_text("10000 100000\n")
    assert usable_cores(str(cpu_max)) == 1
    assert worker_count(build_config({}, {"workers": "3"})) == 3
    assert worker_count(build_config({"workers": 1}, {})) == 1
    assert 1 <= worker_count(build_config({}, {})) <= cores
    for bad in ("0", "257", "two"):
        with pytest.raises(ConfigError, match="--workers"):
            build_config({}, {"workers": bad})
    with pytest.raises(ConfigError, match="--http-server"):
        build_config({}, {"http_server": "nginx"})


def test_tracing_is_off_by_default_and_its_options_come_from_flags_or_the_file(tmp_path):
    from infx.config import routing_config, tracing_config
    from infx.tap import GatewayOptions
    from infx.tracing import TracingConfig

    assert tracing_config(build_config({}, {})) is None
    assert not routing_config(build_config({}, {}))[0].explain
    path = tmp_path / "infx.yaml"
    path.write_text("otlp_traces_endpoint: http://collector:4317\notlp_traces_protocol: grpc\n"
                    "trace_sample_ratio: 0.25\ntrace_content: true\n")
    options = GatewayOptions()
    options.parseOptions(["--config", str(path), "--trace-sample-ratio", "0"])
    config = options.config_value
    assert tracing_config(config) == TracingConfig("http://collector:4317", "grpc", 0.0, True)
    # Tracing asks routing to say why it chose each engine.
    assert routing_config(config)[0].explain
    options = GatewayOptions()
    options.parseOptions(["--otlp-traces-endpoint", "http://collector:4318/v1/traces", "--trace-content"])
    assert tracing_config(options.config_value) == TracingConfig("http://collector:4318/v1/traces",
                                                                 "http/protobuf", 1.0, True)


@pytest.mark.parametrize("flags,message", [
    ({"otlp_traces_endpoint": "collector:4318"}, "--otlp-traces-endpoint: expected an http(s) URL"),
    ({"otlp_traces_endpoint": "http://c:4318", "otlp_traces_protocol": "thrift"}, "--otlp-traces-protocol"),
    ({"otlp_traces_endpoint": "http://c:4318", "trace_sample_ratio": "1.5"}, "--trace-sample-ratio"),
    ({"trace_sample_ratio": "-0.1"}, "--trace-sample-ratio"),
])
def test_bad_tracing_options_are_one_line_naming_the_option(flags, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        build_config({}, flags)


def test_tracing_without_the_otel_extra_is_refused_naming_it(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name.startswith("opentelemetry.sdk") else real(name, *a))
    with pytest.raises(ConfigError, match=r"needs the otel extra: pip install 'infx\[otel\]'"):
        build_config({}, {"otlp_traces_endpoint": "http://collector:4318"})


def test_routing_by_the_runtimes_slots_is_on_unless_the_config_or_a_flag_turns_it_off():
    from twisted.python import usage

    from infx.config import routing_config
    from infx.tap import GatewayOptions

    assert routing_config(build_config({}, {}))[0].runtime_slots
    options = GatewayOptions()
    options.parseOptions(["--routing-runtime-slots"])
    assert routing_config(options.config_value)[0].runtime_slots
    assert not routing_config(build_config({"routing_runtime_slots": False}, {}))[0].runtime_slots
    options = GatewayOptions()
    options.parseOptions(["--no-routing-runtime-slots"])
    assert not routing_config(options.config_value)[0].runtime_slots
    with pytest.raises(usage.UsageError, match="give one"):
        GatewayOptions().parseOptions(["--routing-runtime-slots", "--no-routing-runtime-slots"])
