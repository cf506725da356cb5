"""``twistd infx``: command-line options and the gateway's service tree.

Each option has a YAML key of the same name (see :mod:`infx.config`);
``--config FILE`` reads them, and flags given here win over the file.
"""

from __future__ import annotations

import os
from typing import Any

from twisted.application.service import IService
from twisted.python import usage

from infx.cli import VersionOption, one_line_errors, service_or_exit
from infx.config import ConfigError, GatewayConfig, build_config, load_yaml
from infx.gateway.auth import KeyFileError, KeyStore

_DEFAULTS = GatewayConfig()

# Task exchange between gateway replicas (infx/exchange/exchanger.py).
_FLAGS: list[list[str | None]] = [
    ["kube", None, "Discover peer gateways by watching this namespace's pods (POD_NAME, NAMESPACE, "
                   "in-cluster config or KUBECONFIG); exclusive with --peers."],
    ["scaler", None, "Scale engine deployments labelled infx.io/scalable=true from zero and by load "
                     "(needs --kube)."],
    ["trace-content", None, "With --otlp-traces-endpoint: put prompt and completion text (request body, "
                            "answer; 16 KiB each at most) on the request's span; off, no span carries them."],
    ["routing-runtime-slots", None, "The affinity policy uses the slots engines report (the load bound's minimum, "
                                    "hot prefixes spread over engines, a full runtime's wait in the score); "
                                    "on by default; docs/routing-real.md."],
    ["no-routing-runtime-slots", None, "The affinity policy ignores the slots engines report and routes as "
                                       "engines that report none (routing_runtime_slots: false in the config file)."],
    ["cap-at-runtime-slots", None, "Without --max-in-flight-per-engine: a local engine whose agent reports its "
                                   "runtime's slots holds at most that many tasks; more wait in the fair queue."],
]
# OpenTelemetry traces (infx/tracing/, docs/tracing.md).
_TRACING_PARAMETERS: list[list[Any]] = [
    ["otlp-traces-endpoint", None, None,
     "Export OpenTelemetry traces to this OTLP receiver (http/protobuf: http://collector:4318/v1/traces; grpc: "
     "http://collector:4317); needs the otel extra (pip install 'infx[otel]') [default: no tracing]."],
    ["otlp-traces-protocol", None, None, f"http/protobuf or grpc [default: {_DEFAULTS.otlp_traces_protocol}]."],
    ["trace-sample-ratio", None, None, "Share of new traces recorded, 0 to 1; a client's traceparent decides "
     f"for its own trace [default: {_DEFAULTS.trace_sample_ratio:g}]."],
]
_EXCHANGE_PARAMETERS: list[list[Any]] = [
    ["internal-grpc", None, None,
     f"Peer-facing gRPC listen port or endpoint [default: {_DEFAULTS.internal_grpc}]."],
    ["peers", None, None, "Static peer gateways' internal addresses, HOST:PORT,... (no Kubernetes needed)."],
    ["peer-port", None, None, "With --kube: port dialled on each peer pod's IP [default: the internal port's number]."],
    ["pod-label", None, None, f"With --kube: key=value label of the gateway's pods [default: {_DEFAULTS.pod_label}]."],
    ["internal-secret", None, None,
     "Shared secret peers present as 'authorization: Bearer ...' (peer auth is off without it); "
     "visible in ps: prefer --internal-secret-file or $INFX_INTERNAL_SECRET (read when neither option is given)."],
    ["internal-secret-file", None, None, "File holding --internal-secret (e.g. a mounted Kubernetes Secret)."],
    ["status-interval", None, None,
     "Seconds between checks that re-report local engines and request counts to peers "
     f"[default: {_DEFAULTS.status_interval:g}]."],
    ["internal-tls-cert", None, None,
     "PEM certificate presented to peers; with --internal-tls-key and --internal-tls-ca, peers use mutual TLS."],
    ["internal-tls-key", None, None, "PEM private key of --internal-tls-cert."],
    ["internal-tls-ca", None, None,
     "PEM CA certificate(s) peers' certificates must chain to (their names and IPs are not checked)."],
]

# The affinity policy's knobs (protocol/routing/router.py, protocol/routing/hints.py; docs/routing.md).
_ROUTING_PARAMETERS: list[list[Any]] = [
    ["routing-load-factor", None, None, "Bounded load: no engine takes a task by affinity above this times the "
     f"mean load, plus one (> 1) [default: {_DEFAULTS.routing_load_factor:g}]."],
    ["routing-min-capacity", None, None,
     f"Tasks any engine may take by affinity whatever the mean [default: {_DEFAULTS.routing_min_capacity}]."],
    ["routing-weights", None, None, "Score weights, name=value,... over prefix, home, session, adapter, queue, kv, "
     "busy [default: prefix=8,home=0.5,session=0.5,adapter=0.5,queue=0.5,kv=0.25,busy=2]."],
    ["routing-block-bytes", None, None,
     f"Bytes of canonical prompt per prefix block (>= 16) [default: {_DEFAULTS.routing_block_bytes}]."],
    ["routing-max-blocks", None, None, f"Prefix blocks hashed per request [default: {_DEFAULTS.routing_max_blocks}]."],
    ["routing-index-blocks-per-engine", None, None, "Prefix blocks remembered per engine, about its prefix cache "
     f"[default: {_DEFAULTS.routing_index_blocks_per_engine}]."],
    ["routing-index-blocks", None, None,
     f"Prefix blocks remembered over all engines [default: {_DEFAULTS.routing_index_blocks}]."],
    ["routing-sessions", None, None, f"Sessions whose last engine is remembered [default: {_DEFAULTS.routing_sessions}]."],
    ["routing-spilled-tips", None, None, "Spilled prompts per local engine reported to peers, so that every "
     f"gateway follows them; 0: none [default: {_DEFAULTS.routing_spilled_tips}]."],
]


# Runtimes served by URL from this process, no engine agent in between (infx/gateway/runtime_engines.py).
_RUNTIME_PARAMETERS: list[list[Any]] = [
    ["runtime-pod-label", None, None,
     "key=value label of this namespace's pods that run a runtime to serve by URL (http://POD_IP:--runtime-port; "
     "models from the pod's infx.io/models annotation, else from the runtime); needs a Kubernetes client config."],
    ["runtime-port", None, None, f"Port of the runtime on each --runtime-pod-label pod [default: {_DEFAULTS.runtime_port}]."],
    ["runtime-tenant", None, None,
     f"Tenant whose callers the runtimes by URL serve (other than default needs --api-keys) "
     f"[default: {_DEFAULTS.runtime_tenant}]."],
    ["runtime-max-concurrency", None, None,
     "Tasks each runtime by URL runs at once; up to four times as many more wait there "
     f"[default: {_DEFAULTS.runtime_max_concurrency}]."],
    ["runtime-api-key-file", None, None,
     "File holding the runtimes' API key, sent as 'Authorization: Bearer KEY'; reread when it changes."],
    ["runtime-slot-files", None, None,
     "llama.cpp servers started with --slot-save-path: run each chat and completions request in a slot the "
     "gateway picks, save each conversation's context to one of this many files per runtime and restore it "
     "into a free slot for its next turn (docs/operations.md, 'Slots kept'); needs --workers 1, and each "
     f"runtime must be this gateway's alone. 0: off [default: {_DEFAULTS.runtime_slot_files}]."],
]


class GatewayOptions(VersionOption, usage.Options):
    """Options of ``twistd infx``; validated once, in ``postOptions``."""

    optFlags: list[list[str | None]] = _FLAGS
    optParameters: list[list[Any]] = [
        ["config", "c", None, "YAML file with any of these options as keys (flags win)."],
        ["http", None, None, f"HTTP API listen port or endpoint [default: {_DEFAULTS.http}]."],
        ["worker-grpc", None, None, f"Engine-facing gRPC listen port or endpoint [default: {_DEFAULTS.worker_grpc}]."],
        ["interface", None, None, "Address the listen ports bind to when they name none, e.g. 127.0.0.1 "
                                  "(tools/run passes it) [default: every interface]."],
        ["echo-models", None, None,
         "Comma-separated models served by a built-in echo engine in this process (for trying infx)."],
        ["echo-tenant", None, None,
         "Tenant the built-in echo engine serves; other than default needs --api-keys, and callers reach "
         f"it with a key of that tenant [default: {_DEFAULTS.echo_tenant}]."],
        ["echo-token-delay", None, None,
         f"Seconds between the built-in echo engine's streamed words [default: {_DEFAULTS.echo_token_delay:g}]."],
        ["api-keys", None, None, "YAML file of API keys and tenants (auth is off without it)."],
        ["queue-timeout", None, None, f"Seconds a task waits for an engine [default: {_DEFAULTS.queue_timeout:g}]."],
        ["max-attempts", None, None,
         "Sends of one request to engines in all, whatever failed; one a runtime read and dropped is sent at "
         f"most twice [default: {_DEFAULTS.max_attempts}]."],
        ["max-task-duration", None, None,
         f"Deadline of a task whose client set none, seconds [default: {_DEFAULTS.max_task_duration:g}]."],
        ["max-body-size", None, None, f"Largest HTTP request body, bytes [default: {_DEFAULTS.max_body_size}]."],
        ["max-message-size", None, None,
         f"Largest gRPC message to/from engines, bytes [default: {_DEFAULTS.max_message_size}]."],
        ["heartbeat-interval", None, None,
         "Seconds between heartbeats to local engines; one that misses three is removed [default: none]."],
        ["max-in-flight-per-engine", None, None,
         "Tasks one engine holds at once, every gateway's; more go to other engines or wait [default: no cap]."],
        ["max-tasks-per-tenant", None, None,
         "Live tasks one tenant may have on this gateway; past it, 429 with Retry-After [default: no cap]."],
        ["fair-reserve", None, None,
         "With --max-in-flight-per-engine: each engine's last free slots (at most the cap less one), "
         "kept for the caller holding the fewest, or critical requests, so that one caller's burst "
         f"cannot take them all; 0: none [default: {_DEFAULTS.fair_reserve}]."],
        ["shed-waiting-threshold", None, None,
         "Sheddable requests get 429 with Retry-After when every engine of their model is at "
         "--max-in-flight-per-engine and this many requests wait already [default: 0]."],
        ["routing-policy", None, None,
         f"affinity, least_in_progress (LLMariner's) or round_robin [default: {_DEFAULTS.routing_policy}]."],
        *_ROUTING_PARAMETERS,
        ["route-stuck-timeout", None, None,
         "Seconds an engine or peer may leave its stream unread before it is closed and its tasks "
         f"fail over [default: {_DEFAULTS.route_stuck_timeout:g}]."],
        ["route-max-queued-bytes", None, None,
         "Bytes of tasks an engine's or peer's stream may hold unread before it takes no more; "
         f"a task whose request ended is taken back unsent [default: {_DEFAULTS.route_max_queued_bytes}]."],
        ["http-server", None, None,
         "What serves --http: httptools (its own HTTP/1.1 server, parsed in C) or twisted (twisted.web); an "
         f"ssl: endpoint is always twisted.web's, for HTTP/2 [default: {_DEFAULTS.http_server}]."],
        ["workers", None, None,
         "Gateway processes sharing the listening ports under this one (docs/workers.md); 1: one process "
         "[default: the cores this process may use, its CPU affinity within its cgroup's quota]."],
        ["grace-period", None, None,
         f"Seconds in-flight requests get on shutdown [default: {_DEFAULTS.grace_period:g}]."],
        *_EXCHANGE_PARAMETERS,
        *_RUNTIME_PARAMETERS,
        *_TRACING_PARAMETERS,
    ]

    config_value: GatewayConfig

    def __init__(self) -> None:
        super().__init__()
        self["runtime-url"] = None

    def opt_runtime_url(self, value: str) -> None:
        """Serve the runtime at URL (models: what it lists) or URL=model,model with no agent; repeatable."""
        self["runtime-url"] = [*(self["runtime-url"] or []), value]

    def postOptions(self) -> None:
        flags = {name: self[name] for name in self if name not in ("config", "no-routing-runtime-slots")}
        flags.update(self._flag_values())
        try:
            file_values = load_yaml(self["config"]) if self["config"] else {}
            given = ("internal-secret", "internal-secret-file", "internal_secret", "internal_secret_file")
            if not any(flags.get(name) or file_values.get(name) for name in given):
                flags["internal-secret"] = os.environ.get("INFX_INTERNAL_SECRET") or None
            self.config_value = build_config(file_values, flags)
            if self.config_value.api_keys:
                KeyStore.from_file(self.config_value.api_keys)
        except KeyFileError as e:
            raise usage.UsageError(f"--api-keys: {e}") from None
        except ConfigError as e:
            raise usage.UsageError(str(e)) from None

    def _flag_values(self) -> dict[str, Any]:
        # An absent flag is None, not False, so that the config file's value stands.
        values = {name: (True if self[name] else None) for name, *_ in _FLAGS if name is not None}
        if values.pop("no-routing-runtime-slots"):
            if values["routing-runtime-slots"]:
                raise usage.UsageError("--routing-runtime-slots and --no-routing-runtime-slots: give one")
            values["routing-runtime-slots"] = False
        return values


#: What twistd parses: the same options, with errors as one line (see :mod:`infx.cli`).
CommandLineOptions = one_line_errors(GatewayOptions, "infx")


def makeService(options: GatewayOptions) -> IService:
    """Build the gateway's service tree from validated options; the process ends if a port
    cannot be bound (see :class:`~infx.cli.ExitIfCannotListen`)."""
    from twisted.internet import reactor

    from infx.cli import ExitIfCannotListen
    from infx.service import build_gateway
    from infx.text_log import TextLog

    from infx.config import worker_count

    twistd = getattr(options, "parent", None)  # twistd's own options: -n or not
    daemon = twistd is not None and not twistd.get("nodaemon", True)
    config = options.config_value
    workers = worker_count(config)
    if workers > 1:
        # Workers write their lines to standard output themselves when that is where twistd logs text.
        log_text = (twistd is None or (not daemon and twistd.get("logfile") in (None, "-")
                                       and not twistd.get("logger") and not twistd.get("syslog")))
        return service_or_exit("infx", lambda: supervisor(reactor, config, workers, daemon, log_text))
    return service_or_exit("infx", lambda: TextLog(ExitIfCannotListen(
        reactor, build_gateway(reactor, config), daemon=daemon), twistd))


def supervisor(reactor: Any, config: GatewayConfig, workers: int, daemon: bool, log_text: bool) -> IService:
    """``--workers N``: a supervisor of N gateway processes (:mod:`infx.supervisor`)."""
    from infx.service import default_pod_name
    from infx.supervisor.role import worker_pod_name
    from infx.supervisor.sockets import listen_address
    from infx.supervisor.supervisor import Supervisor

    for name, option in (("http", "--http"), ("worker_grpc", "--worker-grpc"), ("internal_grpc", "--internal-grpc")):
        listen_address(getattr(config, name), option)  # a ConfigError for an endpoint workers cannot share
    if config.kube:
        # What building a gateway checks besides the options: here, before any worker starts.
        from infx.discovery.kube import kube_api_client

        kube_api_client(os.environ)

    def pod_name(internal_port: int, index: int) -> str:
        if os.environ.get("POD_NAME"):
            return worker_pod_name(os.environ["POD_NAME"], index)
        return default_pod_name(config, os.environ, internal_port)

    return Supervisor(reactor, config, workers, pod_name, daemon=daemon, log_text=log_text)
