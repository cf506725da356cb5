"""The gateway's configuration: one documented dataclass, loaded from YAML and flags.

Every command-line option of ``twistd infx`` has a YAML key of the same name
with dashes turned into underscores (``--worker-grpc`` ↔ ``worker_grpc``);
a flag given on the command line wins over the file. Validation happens
here, once, and raises :class:`ConfigError` with a message fit for a user.

Size (over 600 lines): one dataclass of every option and its checks, so that an option's
default, its YAML key and its validation are read in one place.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping
from urllib.parse import urlsplit

import yaml

from protocol.discovery.runtimes import RuntimeTarget
from protocol.processor.route_flow import MAX_ROUTE_QUEUED_BYTES
from protocol.routing.hints import HintsConfig
from protocol.routing.config import RoutingConfig, RoutingPolicy

_ROUTING = RoutingConfig()
_HINTS = HintsConfig()
#: ``--routing-weights`` names and the ``RoutingConfig`` weight each sets.
ROUTING_WEIGHTS = {name: f"{name}_weight" for name in ("prefix", "home", "session", "adapter", "queue", "kv",
                                                             "busy")}


class ConfigError(ValueError):
    """A configuration value is missing, malformed or out of range."""


@dataclass(frozen=True)
class GatewayConfig:
    """Everything ``twistd infx`` can be told; defaults follow LLMariner's ports."""

    #: OpenAI HTTP API, ``/metrics``, ``/healthz``, ``/readyz``: a port or a Twisted server endpoint string.
    http: str = "tcp:8080"
    #: Engine-facing gRPC (``ProcessTasks``).
    worker_grpc: str = "tcp:8082"
    #: Peer-facing gRPC (``ProcessTasksInternal``).
    internal_grpc: str = "tcp:8083"
    #: The address the three listen options bind to when they name none (a port number,
    #: ``tcp:PORT``, or the defaults): ``127.0.0.1`` keeps the gateway to this machine
    #: (``tools/run`` passes it); empty, every interface.
    interface: str = ""
    #: Static peers as ``host:port`` (exclusive with ``kube``).
    peers: tuple[str, ...] = ()
    #: Discover peers by watching this namespace's pods.
    kube: bool = False
    #: Port dialled on each peer pod's IP; default: the internal listen port's number.
    peer_port: int | None = None
    #: ``key=value`` label selecting the gateway's own pods.
    pod_label: str = "app=infx"
    #: YAML file of API keys (see :mod:`infx.gateway.auth`); none means auth is off.
    api_keys: str | None = None
    #: Shared secret peers present as ``authorization: Bearer ...``; none means no peer auth.
    #: Given on the command line it shows in ``ps``: prefer ``internal_secret_file`` or the
    #: ``INFX_INTERNAL_SECRET`` environment variable (``twistd infx`` reads it when neither is given).
    internal_secret: str | None = None
    #: A file holding the shared secret (a mounted Kubernetes Secret), read at start.
    internal_secret_file: str | None = None
    #: Models served by an in-process echo engine (what ``tools/run`` starts).
    echo_models: tuple[str, ...] = ()
    #: Tenant the built-in echo engine serves. Without ``api_keys`` every caller is in the
    #: default tenant, so another tenant needs a key file (callers reach it with a key of that tenant).
    echo_tenant: str = "default"
    #: Seconds between the built-in echo engine's streamed words (0: as fast as it can).
    echo_token_delay: float = 0.01
    #: Seconds a task may wait for an engine that serves its model.
    queue_timeout: float = 30.0
    #: Deadline of a task whose client set none, in seconds.
    max_task_duration: float = 600.0
    #: Sends of one request to engines, in all, whatever failed (a lost engine, a busy or
    #: unreachable runtime, one that dropped the request); one a runtime read and dropped is
    #: sent at most twice, a Responses request once (see :mod:`protocol.processor.attempts`).
    max_attempts: int = 3
    #: Largest accepted HTTP request body, in bytes.
    max_body_size: int = 32 * 1024 * 1024
    #: Largest gRPC message on the worker and internal services, in bytes: the
    #: largest task is a request body of ``max_body_size`` plus its headers and
    #: framing (1 MiB).  It is also what a connection may hold of incomplete
    #: messages, so it bounds a hoarding peer's cost (docs/operations.md, "Connection budgets").
    max_message_size: int = 33 * 1024 * 1024
    #: Seconds in-flight requests get to finish on shutdown.
    grace_period: float = 30.0
    #: Seconds between heartbeats to local engines (none when unset); an engine
    #: that misses three in a row is removed and its tasks fail over.
    heartbeat_interval: float | None = None
    #: Tasks one engine holds at once, every gateway's (as it reports them, plus those
    #: sent since); an engine at it gets no more until one ends (tasks go to another
    #: engine or wait; a peer's task for it waits at this gateway, its engine's). None: no cap.
    max_in_flight_per_engine: int | None = None
    #: Without max_in_flight_per_engine: a local engine that reports its runtime's slots holds
    #: at most that many tasks (protocol/processor/config.py's cap_at_runtime_slots).
    cap_at_runtime_slots: bool = False
    #: The affinity policy takes the runtimes' reported slots into account (RoutingConfig.runtime_slots).
    routing_runtime_slots: bool = True
    #: Live tasks (waiting or running) one tenant may have on this gateway, forwarded
    #: ones included; past it the tenant gets 429 with Retry-After. None: no cap.
    max_tasks_per_tenant: int | None = None
    #: A sheddable request that would wait while every engine of its model is at
    #: max_in_flight_per_engine gets 429 with Retry-After once this many wait already.
    shed_waiting_threshold: int = 0
    #: With max_in_flight_per_engine: each engine's last free slots, kept for the caller holding
    #: the fewest (protocol/processor/fair_share.py), so that another caller's burst cannot take them all.
    fair_reserve: int = 2
    #: How tasks are routed among engines: ``affinity`` (prefix, session and adapter
    #: affinity with bounded loads, the same on every replica), ``least_in_progress``
    #: (LLMariner's) or ``round_robin``; see :mod:`protocol.routing.router`.
    routing_policy: str = "affinity"
    #: The affinity policy's knobs (docs/routing.md; :class:`protocol.routing.router.RoutingConfig`):
    #: the bounded-load factor (> 1: no engine above it times the mean load, plus one)...
    routing_load_factor: float = _ROUTING.load_factor
    #: ...the load any engine may take whatever the mean...
    routing_min_capacity: int = _ROUTING.min_capacity
    #: ...score weights as ``name=value,...`` over prefix, home, session, adapter, queue, kv, busy
    #: (those not named keep their defaults)...
    routing_weights: str = ""
    #: ...bytes of canonical prompt per prefix block, and blocks hashed per request...
    routing_block_bytes: int = _HINTS.block_bytes
    routing_max_blocks: int = _HINTS.max_blocks
    #: ...prefix blocks remembered per engine (about its prefix cache in blocks) and in all...
    routing_index_blocks_per_engine: int = _ROUTING.index_blocks_per_engine
    routing_index_blocks: int = _ROUTING.index_blocks_total
    #: ...sessions remembered, and spilled prompts per local engine reported to peers.
    routing_sessions: int = _ROUTING.sessions
    routing_spilled_tips: int = _ROUTING.spilled_tips
    #: Seconds an engine's or peer's stream may stay blocked (not reading what it is sent)
    #: before it is closed and its tasks fail over; a blocked stream gets no new tasks.
    route_stuck_timeout: float | None = 30.0
    #: Bytes of tasks an engine's or peer's stream may hold queued (not yet taken by its
    #: flow-control window) before it refuses more; a task whose request ended is taken
    #: back from the queue unsent.
    route_max_queued_bytes: int = MAX_ROUTE_QUEUED_BYTES
    #: Seconds between unchanged status reports to peers.
    status_interval: float = 10.0
    #: PEM certificate (leaf first, then intermediates) this gateway presents to its peers;
    #: with the key and CA below, peers speak mutual TLS (see :mod:`infx.exchange.peer_tls`).
    internal_tls_cert: str | None = None
    #: PEM private key of ``internal_tls_cert``.
    internal_tls_key: str | None = None
    #: PEM CA certificate(s) every peer's certificate must chain to.
    internal_tls_ca: str | None = None
    #: Enable scaling engine deployments (needs ``kube``).
    scaler: bool = False
    #: Runtimes this gateway serves itself, no engine agent in between (docs/runtimes-by-url.md):
    #: each ``URL`` (its models: those it lists at ``/v1/models``) or ``URL=model,model``.
    runtime_url: tuple[str, ...] = ()
    #: ``key=value`` label of this namespace's pods that run a runtime to serve by URL.
    runtime_pod_label: str | None = None
    #: Port of the runtime on each pod ``runtime_pod_label`` selects.
    runtime_port: int = 8000
    #: Tenant whose callers the runtimes by URL serve.
    runtime_tenant: str = "default"
    #: Tasks each runtime by URL runs at once; up to four times as many more wait there in order.
    runtime_max_concurrency: int = 32
    #: File holding the runtimes' API key, sent as ``Authorization: Bearer`` (reread as it changes).
    runtime_api_key_file: str | None = None
    #: llama.cpp servers started with ``--slot-save-path``: each runtime by URL's slots kept for
    #: conversations in up to this many files (:mod:`infx.agent.slot_keeping`); 0: off. One worker only.
    runtime_slot_files: int = 0
    #: What serves the HTTP API on ``http``: ``httptools`` (:mod:`infx.http.lean`, the default; an
    #: ``ssl:`` endpoint is served by twisted.web whatever this says, for HTTP/2 by ALPN) or
    #: ``twisted`` (twisted.web's site, :mod:`infx.http.site`). Both serve the same API.
    http_server: str = "httptools"
    #: Gateway processes sharing the listening ports under one supervisor (``twistd infx``
    #: itself); None: the cores this process may use (:func:`usable_cores`); 1: one process,
    #: no supervisor. See :mod:`infx.supervisor` and docs/workers.md.
    workers: int | None = None
    #: OpenTelemetry traces (docs/tracing.md): the OTLP receiver's URL; None: no tracing, and no
    #: opentelemetry module is loaded. Needs the ``otel`` extra.
    otlp_traces_endpoint: str | None = None
    #: ``http/protobuf`` or ``grpc`` (see :class:`infx.tracing.TracingConfig`).
    otlp_traces_protocol: str = "http/protobuf"
    #: Share of new traces recorded, 0 to 1; a caller's ``traceparent`` decides for its own.
    trace_sample_ratio: float = 1.0
    #: Put prompt and completion text (the request body, the answer) on the request's span.
    trace_content: bool = False

    @property
    def pod_label_pair(self) -> tuple[str, str]:
        key, _, value = self.pod_label.partition("=")
        return key, value

    @property
    def effective_peer_port(self) -> int:
        if self.peer_port is not None:
            return self.peer_port
        return endpoint_port(self.internal_grpc)


_PORT_ONLY = re.compile(r"^\d+$")
_SIGNED = re.compile(r"^-?\d+$")
_HOST_PORT = re.compile(r"^(\[[0-9a-fA-F:.]+\]|[A-Za-z0-9_.-]+):(\d+)$")
_TCP_PORT_ONLY = re.compile(r"^tcp:\d+$")


def listen_endpoint(value: str, option: str, interface: str = "") -> str:
    """A bare port number becomes ``tcp:PORT``, and with ``interface`` a ``tcp:PORT`` that names
    no interface listens there (``tcp:PORT:interface=ADDR``); anything else must be a Twisted
    server endpoint string that can listen. Checked here, before anything starts, so that a typo
    is a usage error rather than a port that never opens."""
    value = str(value).strip()
    if _PORT_ONLY.match(value):
        port = int(value)
        if port > 65535:
            raise ConfigError(f"{option}: port {port} is out of range")
        value = f"tcp:{port}"
    if interface and _TCP_PORT_ONLY.match(value):
        value = f"{value}:interface={interface.replace(':', chr(92) + ':')}"
    if ":" not in value:
        raise ConfigError(f"{option}: expected a port number or an endpoint such as tcp:8080, got {value!r}")
    _check_server_endpoint(value, option)
    return value


#: Endpoint types whose description carries a TCP port (``tcp:PORT``, ``port=PORT``).
_TCP_TYPES = frozenset({"tcp", "tcp6", "ssl"})


def _one_line(error: Exception) -> str:
    """Twisted's parser quotes the bad part raw: a config error stays one line."""
    return " ".join(str(error).splitlines())


def _check_server_endpoint(value: str, option: str) -> None:
    """Refuse what Twisted's parser refuses, and ports outside 0-65535 (which it only refuses
    at listen time). Building an endpoint does not touch the reactor, so none is given."""
    from OpenSSL import SSL, crypto
    from twisted.internet.endpoints import serverFromString

    host_port = _HOST_PORT.match(value)
    try:
        serverFromString(None, value)
    except ValueError as e:
        if host_port and str(e).startswith("Unknown endpoint type"):
            host, port = host_port.group(1), host_port.group(2)
            kind = "tcp6" if host.startswith("[") else "tcp"
            interface = host.strip("[]").replace(":", "\\:")
            raise ConfigError(f"{option}: {value!r} is HOST:PORT, which is not a listen endpoint; "
                              f"did you mean {kind}:{port}:interface={interface}?") from None
        raise ConfigError(f"{option}: {value!r} is not a server endpoint ({_one_line(e)}); "
                          "expected a port number or e.g. tcp:8080:interface=127.0.0.1") from None
    except (TypeError, RuntimeError, IndexError, KeyError, AttributeError) as e:
        # An unknown parameter (interfce=) or a string the parser trips over (a trailing backslash,
        # an empty ssl: method name as in ``ssl::::``).
        raise ConfigError(f"{option}: {value!r} is not a server endpoint ({_one_line(e) or type(e).__name__})") from None
    except OSError as e:  # ssl: a certificate or key file that cannot be read
        raise ConfigError(f"{option}: cannot read {e.filename}: {e.strerror}") from None
    except (SSL.Error, crypto.Error):
        raise ConfigError(f"{option}: the certificate and private key of {value!r} are not PEM that loads "
                          "(privateKey= and certKey= name the files)") from None
    if value.split(":", 1)[0] in _TCP_TYPES:
        try:
            port = endpoint_port(value)
        except ConfigError:
            # Twisted reads escapes (``tcp:\\0`` is port 0); the peer port and the README need digits.
            raise ConfigError(f"{option}: cannot tell the port of {value!r}; "
                              "write it as plain digits, e.g. tcp:8080") from None
        if not 0 <= port <= 65535:
            raise ConfigError(f"{option}: port {port} is out of range")


def read_secret_file(path: str, option: str) -> str:
    """The secret in the file at ``path`` (surrounding white space dropped: a Secret's file may
    end with a newline); it travels in a header, so it must be printable ASCII without spaces."""
    try:
        secret = Path(path).read_text().strip()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{option}: cannot read {path}: {getattr(e, 'strerror', None) or e}") from None
    if not secret:
        raise ConfigError(f"{option}: {path} is empty")
    if not _printable(secret):
        raise ConfigError(f"{option}: the secret in {path} must be printable ASCII without spaces")
    return secret


def _printable(secret: str) -> bool:
    return all(0x21 <= ord(c) <= 0x7E for c in secret)


def endpoint_port(endpoint: str) -> int:
    """The port number inside ``tcp:8083:interface=...``-style strings."""
    parts = endpoint.split(":")
    for part in parts[1:]:
        if _SIGNED.match(part):
            return int(part)
        if part.startswith("port=") and _SIGNED.match(part[5:]):
            return int(part[5:])
    raise ConfigError(f"cannot tell the port of endpoint {endpoint!r}; set peer_port")


def host_port(value: str, option: str) -> tuple[str, int]:
    match = _HOST_PORT.match(value.strip())
    if not match or not 0 < int(match.group(2)) <= 65535:
        raise ConfigError(f"{option}: expected HOST:PORT, got {value!r}")
    return match.group(1).strip("[]"), int(match.group(2))


#: Durations for which 0 is meaningful rather than a mistake.
_ZERO_ALLOWED = frozenset({"echo_token_delay", "routing_index_blocks_per_engine", "routing_index_blocks",
                           "routing_sessions", "routing_spilled_tips", "fair_reserve", "trace_sample_ratio",
                           "runtime_slot_files"})


def _split_list(value: Any) -> tuple[str, ...]:
    if isinstance(value, str):
        return tuple(item.strip() for item in value.split(",") if item.strip())
    if isinstance(value, (list, tuple)):
        return tuple(str(item).strip() for item in value if str(item).strip())
    raise ConfigError(f"expected a comma-separated string or a list, got {value!r}")


def _runtime_urls(value: Any) -> tuple[str, ...]:
    """``--runtime-url`` entries, each whole (``URL=model,model`` holds commas): one string, or a
    list of strings or of ``{url: URL, models: [..]}`` mappings (the YAML forms)."""
    entries = value if isinstance(value, (list, tuple)) else [value]
    out = []
    for entry in entries:
        if isinstance(entry, Mapping):
            unknown = set(entry) - {"url", "models"}
            if unknown or not isinstance(entry.get("url"), str):
                raise ConfigError(f"--runtime-url: a mapping takes url (a string) and models, got {dict(entry)!r}")
            models = entry.get("models") or ()
            models = _split_list(models)
            out.append(entry["url"] + ("=" + ",".join(models) if models else ""))
        elif isinstance(entry, str) and entry.strip():
            out.append(entry.strip())
        else:
            raise ConfigError(f"--runtime-url: expected URL or URL=model,model, got {entry!r}")
    return tuple(out)


def runtime_targets(config: GatewayConfig) -> tuple[RuntimeTarget, ...]:
    """The runtimes of ``--runtime-url``; raises :class:`ConfigError` for an entry that is not
    ``http(s)://HOST[:PORT][/PATH]`` with distinct model names, or a runtime given twice."""
    targets: list[RuntimeTarget] = []
    for entry in config.runtime_url:
        url, sep, models_text = entry.partition("=")
        parts = urlsplit(url)
        try:
            parts.port
        except ValueError:
            raise ConfigError(f"--runtime-url: {url!r} has no valid port") from None
        if parts.scheme not in ("http", "https") or not parts.hostname or parts.query or parts.fragment \
                or parts.username or parts.password:
            raise ConfigError(f"--runtime-url: expected http(s)://HOST[:PORT] (a trailing /v1 is dropped), "
                              f"optionally =model,model; got {entry!r}")
        models = tuple(m.strip() for m in models_text.split(",") if m.strip())
        if sep and not models:
            raise ConfigError(f"--runtime-url: {entry!r} names no model after '='")
        if len(set(models)) != len(models):
            raise ConfigError(f"--runtime-url: {entry!r} names a model twice")
        root = url.rstrip("/").removesuffix("/v1")
        if any(target.url == root for target in targets):
            raise ConfigError(f"--runtime-url: {root} is given twice")
        targets.append(RuntimeTarget(root, models))
    return tuple(targets)


def _coerce(name: str, kind: Any, value: Any) -> Any:
    option = "--" + name.replace("_", "-")
    try:
        if kind == "bool":
            if isinstance(value, bool):
                return value
            text = str(value).lower()
            if text in ("1", "true", "yes", "on"):
                return True
            if text in ("0", "false", "no", "off"):
                return False
            raise ValueError(value)
        if kind == "float":
            number = float(value)
            if not (number > 0 or (number == 0 and name in _ZERO_ALLOWED)) or number == float("inf"):
                raise ValueError(value)
            return number
        if kind == "int":
            number = int(value)
            if not (number > 0 or (number == 0 and name in _ZERO_ALLOWED)):
                raise ValueError(value)
            return number
        if kind == "float | None":
            return None if value in (None, "") else _coerce(name, "float", value)
        if kind == "int | None":
            return None if value is None else int(value)
        if name == "runtime_url":
            return _runtime_urls(value)
        if kind == "tuple[str, ...]":
            return _split_list(value)
        if kind == "str | None":
            return None if value in (None, "") else str(value)
        return str(value)
    except ConfigError:
        raise
    except ValueError:
        raise ConfigError(f"{option}: invalid value {value!r}") from None


def load_yaml(path: str) -> dict[str, Any]:
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise ConfigError(f"--config: cannot read {path}: {e.strerror}") from None
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"--config: {path} is not valid YAML: {yaml_problem(e)}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"--config: {path} must hold a mapping of option names to values")
    return data


def yaml_problem(error: yaml.YAMLError) -> str:
    """PyYAML's complaint on one line: where it is and what is wrong, without the quoted source."""
    mark = getattr(error, "problem_mark", None)
    problem = getattr(error, "problem", None) or str(error)
    where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
    return where + " ".join(str(problem).split())


def build_config(file_values: Mapping[str, Any], flags: Mapping[str, Any]) -> GatewayConfig:
    """Merge YAML values and command-line flags (flags win) into a validated config."""
    fields = {f.name: f for f in dataclasses.fields(GatewayConfig)}
    merged: dict[str, Any] = {}
    for source in (file_values, flags):
        for raw_name, value in source.items():
            name = str(raw_name).replace("-", "_")
            if name not in fields:
                raise ConfigError(f"unknown option {raw_name!r}")
            if value is None:
                continue
            merged[name] = _coerce(name, fields[name].type, value)
    config = GatewayConfig(**merged)
    return validate(config)


def validate(config: GatewayConfig) -> GatewayConfig:
    if config.internal_grpc.startswith("ssl:") and any(
            (config.internal_tls_cert, config.internal_tls_key, config.internal_tls_ca)):
        raise ConfigError("--internal-grpc: give a tcp: endpoint; --internal-tls-* add TLS with client certificates")
    replaced: dict[str, Any] = {
        "http": listen_endpoint(config.http, "--http", config.interface),
        "worker_grpc": listen_endpoint(config.worker_grpc, "--worker-grpc", config.interface),
        "internal_grpc": listen_endpoint(config.internal_grpc, "--internal-grpc", config.interface),
    }
    if config.internal_secret_file:
        if config.internal_secret:
            raise ConfigError("--internal-secret-file and --internal-secret: give the secret once")
        replaced["internal_secret"] = read_secret_file(config.internal_secret_file, "--internal-secret-file")
    elif config.internal_secret is not None and not _printable(config.internal_secret):
        raise ConfigError("--internal-secret (or $INFX_INTERNAL_SECRET): must be printable ASCII without spaces")
    for peer in config.peers:
        host_port(peer, "--peers")
    if config.echo_tenant != "default" and not config.api_keys:
        raise ConfigError(f"--echo-tenant {config.echo_tenant!r} needs --api-keys: without a key file every caller "
                          "is in the default tenant and could never reach it")
    if not config.echo_tenant:
        raise ConfigError("--echo-tenant: must be a non-empty tenant name")
    if config.peers and config.kube:
        raise ConfigError("--peers and --kube are exclusive: peers come from one source")
    if config.scaler and not config.kube:
        raise ConfigError("--scaler needs --kube: it scales Kubernetes deployments")
    key, sep, _ = config.pod_label.partition("=")
    if not sep or not key:
        raise ConfigError(f"--pod-label: expected key=value, got {config.pod_label!r}")
    if config.peer_port is not None and not 0 < config.peer_port <= 65535:
        raise ConfigError(f"--peer-port: {config.peer_port} is out of range")
    for name in ("max_in_flight_per_engine", "max_tasks_per_tenant"):
        cap = getattr(config, name)
        if cap is not None and cap < 1:
            raise ConfigError(f"--{name.replace('_', '-')}: must be at least 1, got {cap}")
    if config.shed_waiting_threshold < 0:
        raise ConfigError(f"--shed-waiting-threshold: must be at least 0, got {config.shed_waiting_threshold}")
    policies = [policy.value for policy in RoutingPolicy]
    if config.routing_policy not in policies:
        raise ConfigError(f"--routing-policy: expected one of {', '.join(policies)}, got {config.routing_policy!r}")
    routing_config(config)  # raises ConfigError for a knob out of range
    runtime_targets(config)  # raises ConfigError for an entry that is not a runtime's URL
    if config.runtime_pod_label is not None:
        key, sep, _ = config.runtime_pod_label.partition("=")
        if not sep or not key:
            raise ConfigError(f"--runtime-pod-label: expected key=value, got {config.runtime_pod_label!r}")
    if not 0 < config.runtime_port <= 65535:
        raise ConfigError(f"--runtime-port: {config.runtime_port} is out of range")
    if not config.runtime_tenant:
        raise ConfigError("--runtime-tenant: must be a non-empty tenant name")
    if config.runtime_tenant != "default" and not config.api_keys:
        raise ConfigError(f"--runtime-tenant {config.runtime_tenant!r} needs --api-keys: without a key file every "
                          "caller is in the default tenant and could never reach it")
    if config.runtime_api_key_file:
        from infx.agent.upstream_key import UpstreamKeyError, read_key_file

        try:
            read_key_file(config.runtime_api_key_file)
        except UpstreamKeyError as exc:
            raise ConfigError(f"--runtime-api-key-file: {exc}") from None
    if config.runtime_slot_files and not config.runtime_url and config.runtime_pod_label is None:
        raise ConfigError("--runtime-slot-files keeps the slots of runtimes by URL: give --runtime-url or "
                          "--runtime-pod-label (an engine agent keeps its runtime's: twistd infx-engine "
                          "--runtime-slot-files)")
    if config.runtime_slot_files and config.workers != 1 and worker_count(config) > 1:
        raise ConfigError(f"--runtime-slot-files needs --workers 1 (this would run {worker_count(config)}): every "
                          "worker serves each runtime by URL, and each would keep the runtime's slots as its own")
    if config.http_server not in HTTP_SERVERS:
        raise ConfigError(f"--http-server: expected one of {', '.join(HTTP_SERVERS)}, got {config.http_server!r}")
    if config.workers is not None and not 1 <= config.workers <= MAX_WORKERS:
        raise ConfigError(f"--workers: expected 1 to {MAX_WORKERS}, got {config.workers}")
    if config.route_stuck_timeout is not None and config.route_stuck_timeout <= 0:
        raise ConfigError(f"--route-stuck-timeout: must be more than 0, got {config.route_stuck_timeout:g}")
    from infx.tracing import tracing_problem

    problem = tracing_problem(config.otlp_traces_endpoint, config.otlp_traces_protocol, config.trace_sample_ratio)
    if problem:
        raise ConfigError(problem)
    config = dataclasses.replace(config, **replaced)
    internal_tls(config)
    if config.kube and not 0 < config.effective_peer_port <= 65535:  # raises ConfigError if not derivable
        raise ConfigError(f"--peer-port: peers cannot be dialled at port {config.effective_peer_port}; "
                          "give --peer-port when --internal-grpc listens on port 0")
    return config


#: The servers of the HTTP API (``--http-server``).
HTTP_SERVERS = ("httptools", "twisted")
#: The most gateway processes one supervisor runs.
MAX_WORKERS = 256


def usable_cores(cpu_max: str = "/sys/fs/cgroup/cpu.max") -> int:
    """The cores this process may use: its CPU affinity, and no more than its cgroup's CPU quota
    (a container limited to 2 CPUs on a 64-core node may run on every core, 2 at a time)."""
    cores = len(os.sched_getaffinity(0))
    try:
        quota, period = Path(cpu_max).read_text().split()[:2]
    except (OSError, ValueError):
        return cores
    if quota == "max" or not quota.isdigit() or not period.isdigit() or int(period) == 0:
        return cores
    return max(1, min(cores, math.ceil(int(quota) / int(period))))


def tracing_config(config: GatewayConfig) -> Any:
    """The :class:`~infx.tracing.TracingConfig` of ``config``, or None when tracing is off."""
    if config.otlp_traces_endpoint is None:
        return None
    from infx.tracing import TracingConfig

    return TracingConfig(config.otlp_traces_endpoint, config.otlp_traces_protocol, config.trace_sample_ratio,
                         config.trace_content)


def worker_count(config: GatewayConfig) -> int:
    """How many gateway processes ``config`` asks for (``--workers``, else the usable cores)."""
    return config.workers if config.workers is not None else min(usable_cores(), MAX_WORKERS)


def routing_weights(text: str) -> dict[str, float]:
    """``--routing-weights``: ``name=value,...`` as ``RoutingConfig`` weight fields."""
    weights: dict[str, float] = {}
    for item in filter(None, (part.strip() for part in str(text).split(","))):
        name, sep, value = item.partition("=")
        if not sep or name.strip() not in ROUTING_WEIGHTS:
            raise ConfigError(f"--routing-weights: expected name=value with a name among "
                              f"{', '.join(ROUTING_WEIGHTS)}, got {item!r}")
        try:
            weight = float(value)
        except ValueError:
            weight = -1.0
        if not 0 <= weight < float("inf"):
            raise ConfigError(f"--routing-weights: {name.strip()} must be a number >= 0, got {value.strip()!r}")
        weights[ROUTING_WEIGHTS[name.strip()]] = weight
    return weights


def routing_config(config: GatewayConfig) -> tuple[RoutingConfig, HintsConfig]:
    """The routing policy and how the gateway cuts prompts into blocks, from ``config``;
    raises :class:`ConfigError` naming the option of a knob out of range."""
    if not config.routing_load_factor > 1:
        raise ConfigError(f"--routing-load-factor: must be more than 1, got {config.routing_load_factor:g}")
    if config.routing_block_bytes < 16:
        raise ConfigError(f"--routing-block-bytes: must be at least 16, got {config.routing_block_bytes}")
    routing = RoutingConfig(
        policy=RoutingPolicy(config.routing_policy), load_factor=config.routing_load_factor,
        min_capacity=config.routing_min_capacity, index_blocks_per_engine=config.routing_index_blocks_per_engine,
        index_blocks_total=config.routing_index_blocks, sessions=config.routing_sessions,
        spilled_tips=config.routing_spilled_tips, runtime_slots=config.routing_runtime_slots,
        explain=config.otlp_traces_endpoint is not None,
        **routing_weights(config.routing_weights),
    )
    return routing, HintsConfig(block_bytes=config.routing_block_bytes, max_blocks=config.routing_max_blocks)


def internal_tls(config: GatewayConfig) -> Any:
    """The loaded :class:`~infx.exchange.peer_tls.PeerCredentials` when mutual TLS between peers is
    configured, else None; all three files or none, each readable and parseable."""
    paths = {"--internal-tls-cert": config.internal_tls_cert, "--internal-tls-key": config.internal_tls_key,
             "--internal-tls-ca": config.internal_tls_ca}
    given = [option for option, path in paths.items() if path]
    if not given:
        return None
    if len(given) < len(paths):
        missing = ", ".join(option for option in paths if option not in given)
        raise ConfigError(f"{', '.join(given)} needs {missing} too: peer TLS takes a certificate, its key and a CA")
    if config.internal_grpc.startswith("ssl:"):
        raise ConfigError("--internal-grpc: give a tcp: endpoint; --internal-tls-* add TLS with client certificates")
    from infx.exchange.peer_tls import PeerCredentials

    return PeerCredentials.from_files(str(config.internal_tls_cert), str(config.internal_tls_key),
                                      str(config.internal_tls_ca))


__all__ = ["ConfigError", "GatewayConfig", "usable_cores", "worker_count", "build_config", "load_yaml", "yaml_problem",
           "listen_endpoint", "host_port", "internal_tls", "routing_config", "runtime_targets", "tracing_config"]
