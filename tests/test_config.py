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
    from infx.tap import Options

    options = Options()
    options.parseOptions(["--max-in-flight-per-engine", "3", "--max-tasks-per-tenant", "7"])
    processor = GatewayService(Clock(), options.config_value, environ={}).processor
    assert (processor.config.max_in_flight_per_engine, processor.config.max_tasks_per_tenant) == (3, 7)


def test_routing_policy_is_one_of_the_three():
    from infx.config import ConfigError, GatewayConfig, validate

    assert validate(GatewayConfig()).routing_policy == "affinity"
    assert validate(GatewayConfig(routing_policy="round_robin")).routing_policy == "round_robin"
    with pytest.raises(ConfigError, match="--routing-policy: expected one of affinity, least_in_progress, round_robin"):
        validate(GatewayConfig(routing_policy="random"))


def test_routing_policy_flag_reaches_the_config():
    from infx.tap import Options

    options = Options()
    options.parseOptions(["--routing-policy", "least_in_progress"])
    assert options.config_value.routing_policy == "least_in_progress"
