"""``twistd infx-engine``: command-line options and the engine agent's service tree.

Every option is validated in ``AgentOptions.postOptions`` (a ``UsageError`` names
the bad one); ``makeService`` only wires. ``--upstream`` is the runtime
server's root URL (``http://127.0.0.1:8000``); a trailing ``/v1`` is
accepted and dropped (see :mod:`infx.agent.runtimes`).

With ``--runtime openai`` the agent checks its runtime's health
(:mod:`infx.agent.runtime_watch`) and reports its models ready only while it
answers; without ``--models`` it serves the models the runtime lists. The
runtime's API key comes from ``--upstream-api-key-file`` (reread as it
changes, see :mod:`infx.agent.upstream_key`) or ``$INFX_UPSTREAM_API_KEY``.
With ``--runtime openai`` the agent also reads the runtime's own load
(:mod:`infx.agent.runtime_load_watch`) every ``--runtime-load-interval`` seconds
and reports it with its status.
"""

from __future__ import annotations

import math
import os
import secrets
import socket
from dataclasses import replace
from typing import Any
from urllib.parse import urlsplit

from twisted.application.service import IService, Service
from twisted.internet.defer import Deferred
from twisted.python import usage

import infx
from infx.cli import VersionOption, one_line_errors
from protocol.agent.effects import AgentConfig, AgentUsageError
from protocol.agent.echo import EchoConfig
from protocol.agent.runtime_load import LoadConfig, LoadUsageError

MiB = 1024 * 1024


def default_engine_id() -> str:
    """Host name and process id: unique per running agent, readable in the gateway's logs."""
    return f"{socket.gethostname()}-{os.getpid()}"


def parse_host_port(value: str) -> tuple[str, int]:
    """``HOST:PORT`` or ``[V6ADDR]:PORT``; raises ``UsageError``, which for a URL (the agent
    speaks gRPC, not HTTP) says what to write instead."""
    if "://" in value:
        parts = urlsplit(value)
        try:
            port = parts.port
        except ValueError:
            port = None
        if parts.hostname and port:
            host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
            tls = "--tls " if parts.scheme == "https" else ""
            raise usage.UsageError(f"--server takes the gateway's engine port as HOST:PORT, not a URL: "
                                   f"write {tls}--server {host}:{port}")
        raise usage.UsageError(f"--server takes the gateway's engine port as HOST:PORT (e.g. gateway:8082), "
                               f"not a URL, got {value!r}")
    host, sep, port = value.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise usage.UsageError(f"--server must be HOST:PORT, got {value!r}")
    return host, int(port)


class AgentOptions(VersionOption, usage.Options):
    """Options of ``twistd infx-engine``."""

    synopsis = "--server HOST:PORT [--models a,b] [--runtime echo|openai --upstream URL] [options]"

    optFlags = [
        ["tls", None, "Connect to the gateway over TLS (ALPN h2)."],
    ]
    optParameters: list[list[Any]] = [
        ["server", None, None, "The gateway's engine-facing gRPC address, HOST:PORT (required)."],
        ["runtime", None, "echo", "echo (built in, for trying and testing) or openai (forward to --upstream)."],
        ["upstream", None, None,
         "openai runtime: the server's root URL, e.g. http://127.0.0.1:8000 (a trailing /v1 is dropped)."],
        ["models", None, None,
         "Comma-separated model ids this engine serves (required with echo; with openai, "
         "default: the models the runtime lists at GET /v1/models)."],
        ["upstream-api-key-file", None, None,
         "openai runtime: file holding the runtime's API key, sent as 'Authorization: Bearer KEY'; "
         "reread when it changes (a mounted Secret). Default: the key in $INFX_UPSTREAM_API_KEY, if set."],
        ["runtime-check-interval", None, "5",
         "openai runtime: seconds between health checks of the runtime while it answers "
         "(every second while it does not)."],
        ["engine-id", None, None, "Engine id reported to the gateway (default: hostname-pid)."],
        ["key", None, None,
         "Engine API key, sent as 'authorization: Bearer KEY' (default: $INFX_ENGINE_KEY, "
         "which keeps it out of the process list)."],
        ["ca", None, None, "PEM file of the CA that signed the gateway's certificate (with --tls)."],
        ["max-concurrency", None, "32", "Tasks run at once; more wait in order."],
        ["max-queued", None, None,
         "Tasks that may wait for a slot; past it a task is answered 503 so that the gateway retries it "
         "elsewhere [default: 4 x --max-concurrency]."],
        ["status-interval", None, "10", "Seconds between periodic status reports."],
        ["token-delay", None, "0", "echo runtime: seconds between streamed tokens."],
        ["cluster-id", None, "", "Cluster id reported in EngineStatus."],
        ["grace", None, "30", "Seconds in-flight tasks get to finish on shutdown."],
        ["runtime-load-interval", None, "1",
         "openai runtime: seconds between reads of the runtime's own load (vLLM, SGLang, llama.cpp "
         "/metrics and /slots), reported to the gateway for routing; 0 turns it off."],
        ["runtime-load-report-interval", None, "2",
         "openai runtime: least seconds between two status reports sent only because the load changed."],
        ["otlp-traces-endpoint", None, None,
         "Export OpenTelemetry traces (a span per task, one per request to the runtime, which gets its "
         "traceparent) to this OTLP receiver; needs the otel extra (pip install 'infx[otel]') [default: no tracing]."],
        ["otlp-traces-protocol", None, "http/protobuf", "http/protobuf or grpc."],
        ["trace-sample-ratio", None, "1", "Share of new traces recorded, 0 to 1; a task's traceparent decides "
         "for its own trace."],
        ["runtime-slots", None, None,
         "openai runtime: requests the runtime runs at once (vLLM's --max-num-seqs), reported to the gateway "
         "[default: what the runtime says: llama.cpp's slots; else unknown]."],
        ["runtime-slot-files", None, "0",
         "openai runtime, llama.cpp's server started with --slot-save-path: run each chat and completions "
         "request in a slot this agent picks, save each conversation's context to one of this many files "
         "and restore it into a free slot for its next turn (docs/operations.md, 'Slots kept'); the runtime "
         "must be this agent's alone. 0: off."],
    ]

    def postOptions(self) -> None:
        if not self["server"]:
            raise usage.UsageError("--server HOST:PORT is required")
        self["host"], self["port"] = parse_host_port(self["server"])
        if self["runtime"] not in ("echo", "openai"):
            raise usage.UsageError(f"--runtime must be echo or openai, got {self['runtime']!r}")
        if self["runtime"] == "openai":
            url = self["upstream"]
            if not url:
                raise usage.UsageError("--upstream URL is required with --runtime openai")
            parts = urlsplit(url)
            if parts.scheme not in ("http", "https") or not parts.hostname or parts.query or parts.fragment:
                raise usage.UsageError(f"--upstream must be an http(s) URL without query, got {url!r}")
        elif self["upstream"]:
            raise usage.UsageError("--upstream only applies to --runtime openai")
        self._upstream_key()
        models = tuple(m.strip() for m in (self["models"] or "").split(",") if m.strip())
        if not models and self["runtime"] != "openai":
            raise usage.UsageError("--models a,b is required with --runtime echo")
        if len(set(models)) != len(models):
            raise usage.UsageError("--models lists a model twice")
        self["models"] = models
        self["engine-id"] = self["engine-id"] or default_engine_id()
        self["key"] = self["key"] or os.environ.get("INFX_ENGINE_KEY", "")
        self["max-concurrency"] = self._number("max-concurrency", int, minimum=1)
        if self["max-queued"] is not None:
            self["max-queued"] = self._number("max-queued", int, minimum=0)
        self["status-interval"] = self._number("status-interval", float, minimum=0.0, strict=True)
        self["token-delay"] = self._number("token-delay", float, minimum=0.0)
        self["grace"] = self._number("grace", float, minimum=0.0)
        self["runtime-check-interval"] = self._number("runtime-check-interval", float, minimum=0.0, strict=True)
        self["runtime-load-interval"] = self._number("runtime-load-interval", float, minimum=0.0)
        self["runtime-load-report-interval"] = self._number("runtime-load-report-interval", float, minimum=0.0)
        self["trace-sample-ratio"] = self._number("trace-sample-ratio", float, minimum=0.0)
        from infx.tracing import TracingConfig, tracing_problem

        problem = tracing_problem(self["otlp-traces-endpoint"], self["otlp-traces-protocol"],
                                  self["trace-sample-ratio"])
        if problem:
            raise usage.UsageError(problem)
        self["tracing-config"] = None
        if self["otlp-traces-endpoint"]:
            self["tracing-config"] = TracingConfig(self["otlp-traces-endpoint"], self["otlp-traces-protocol"],
                                                   self["trace-sample-ratio"])
        if self["runtime-slots"] is not None:
            if self["runtime"] != "openai":
                raise usage.UsageError("--runtime-slots only applies to --runtime openai")
            self["runtime-slots"] = self._number("runtime-slots", int, minimum=1)
        self["runtime-slot-files"] = self._number("runtime-slot-files", int, minimum=0)
        if self["runtime-slot-files"] and self["runtime"] != "openai":
            raise usage.UsageError("--runtime-slot-files only applies to --runtime openai")
        if self["ca"] and not self["tls"]:
            raise usage.UsageError("--ca needs --tls")
        self["trust-root"] = None
        if self["ca"]:
            from twisted.internet.ssl import Certificate

            try:
                with open(self["ca"], "rb") as pem:
                    self["trust-root"] = Certificate.loadPEM(pem.read())
            except Exception as exc:  # OSError, or OpenSSL's own error types for a bad PEM
                raise usage.UsageError(f"--ca {self['ca']!r}: {exc}") from exc
        try:
            self["agent-config"] = AgentConfig(
                engine_id=self["engine-id"], models=models, cluster_id=self["cluster-id"] or "",
                max_concurrency=self["max-concurrency"], max_queued=self["max-queued"],
                status_interval=self["status-interval"], wait_for_runtime=self["runtime"] == "openai",
                instance=secrets.token_hex(8), runtime_kind=self["runtime"], agent_version=infx.__version__,
                runtime_slots=self["runtime-slots"],
            )
            self["echo-config"] = EchoConfig(token_delay=self["token-delay"])
            self["load-config"] = None
            if self["runtime"] == "openai" and self["runtime-load-interval"] > 0:
                self["load-config"] = LoadConfig(interval=self["runtime-load-interval"],
                                                 report_min_interval=self["runtime-load-report-interval"])
        except (AgentUsageError, LoadUsageError, ValueError) as exc:
            raise usage.UsageError(str(exc)) from exc

    def _upstream_key(self) -> None:
        """Check the runtime's key source now, so that a bad file fails at start with its option named."""
        from infx.agent.upstream_key import UpstreamKeyError, read_key_file

        path = self["upstream-api-key-file"]
        env_key = os.environ.get("INFX_UPSTREAM_API_KEY", "").strip()
        self["upstream-key"] = None
        if (path or env_key) and self["runtime"] != "openai":
            raise usage.UsageError("an upstream API key only applies to --runtime openai")
        if path and env_key:
            raise usage.UsageError("give --upstream-api-key-file or $INFX_UPSTREAM_API_KEY, not both")
        if path:
            try:
                read_key_file(path)
            except UpstreamKeyError as exc:
                raise usage.UsageError(f"--upstream-api-key-file: {exc}") from None
        elif env_key:
            if any(not 0x21 <= ord(c) <= 0x7E for c in env_key):
                raise usage.UsageError("$INFX_UPSTREAM_API_KEY must be printable ASCII without spaces")
            self["upstream-key"] = env_key

    def _number(self, name: str, kind: type[int] | type[float], *, minimum: float, strict: bool = False) -> Any:
        raw = self[name]
        try:
            value = kind(raw)
        except (TypeError, ValueError):
            raise usage.UsageError(f"--{name} must be a number, got {raw!r}") from None
        if not math.isfinite(value) or value < minimum or (strict and value == minimum):
            bound = ">" if strict else ">="
            raise usage.UsageError(f"--{name} must be {bound} {minimum:g}, got {raw!r}")
        return value


#: What twistd parses: the same options, with errors as one line (see :mod:`infx.cli`).
CommandLineOptions = one_line_errors(AgentOptions, "infx-engine")


class _PoolCloser(Service):
    """Closes an HTTP client's kept-alive connections when the service tree stops (a
    ``twisted.web`` pool's, or a :class:`~infx.agent.runtime_client.RuntimeClient`'s)."""

    def __init__(self, close: Any) -> None:
        self.close = close

    def stopService(self) -> Deferred[None]:
        super().stopService()
        closed: Deferred[None] = self.close()
        return closed


def makeService(options: AgentOptions) -> IService:
    """Build the engine agent's service tree from validated options."""
    from twisted.internet import reactor
    from twisted.web.client import Agent

    from infx.agent.engine import AgentServices, EngineAgent, GrpcLinks
    from infx.agent.runtime_client import RuntimeClient
    from infx.agent.runtime_load_watch import ReadWhenReady, RuntimeLoadWatch, scrape_pool
    from infx.agent.runtime_watch import RuntimeWatch, check_pool
    from infx.agent.runtimes import CAPABILITIES as OPENAI_CAPABILITIES
    from infx.agent.runtimes import EchoRuntime, OpenAIRuntime, Runtime
    from infx.agent.upstream_key import UpstreamKey
    from infx.transport import GrpcChannel, client_endpoint
    from protocol.agent.core import EngineAgentCore
    from protocol.agent.runtime_health import HealthConfig, RuntimeHealth
    from protocol.agent.runtime_load import RuntimeLoadMonitor
    from protocol.grpc import GrpcConfig

    # What the agent uses, stopped once it drained (AgentServices).
    used: list[Service] = []
    runtime: Runtime
    agent_config = options["agent-config"]
    watch: RuntimeWatch | None = None
    if options["runtime"] == "openai":
        agent_config = replace(agent_config, capabilities=OPENAI_CAPABILITIES)
        # One kept-alive connection per running task at most (the core runs --max-concurrency).
        client = RuntimeClient(reactor, options["upstream"], connect_timeout=10,
                               max_idle=options["max-concurrency"])
        used.append(_PoolCloser(client.close))
        credentials = None
        if options["upstream-api-key-file"]:
            credentials = UpstreamKey(reactor, path=options["upstream-api-key-file"])
        elif options["upstream-key"]:
            credentials = UpstreamKey(reactor, key=options["upstream-key"])
        runtime = OpenAIRuntime(reactor, client, options["upstream"], credentials=credentials)
        health = HealthConfig(interval=options["runtime-check-interval"],
                              down_interval=min(1.0, options["runtime-check-interval"]),
                              list_models=not options["models"])
        checks_pool = check_pool(reactor)
        used.append(_PoolCloser(checks_pool.closeCachedConnections))
        checks = Agent(reactor, pool=checks_pool, connectTimeout=5)
        watch = RuntimeWatch(reactor, RuntimeHealth(health), checks, runtime, lambda ready, models: None)
    else:
        runtime = EchoRuntime(reactor, options["echo-config"])
    host, port, tls = options["host"], options["port"], bool(options["tls"])
    # Tasks may carry images or audio, far over gRPC's customary 4 MiB.
    grpc_config = GrpcConfig(client_side=True, max_receive_message_length=128 * MiB)

    def connect() -> GrpcChannel:
        endpoint = client_endpoint(reactor, host, port, tls=tls, trust_root=options["trust-root"])
        return GrpcChannel(reactor, endpoint, grpc_config, authority=f"{host}:{port}",
                           scheme="https" if tls else "http")

    served: Runtime = runtime
    kept = None
    if isinstance(runtime, OpenAIRuntime) and options["runtime-slot-files"]:
        from infx.agent.slot_keeping import SlotKeepingRuntime

        served = kept = SlotKeepingRuntime(runtime, options["runtime-slot-files"], options["engine-id"],
                                           slots=options["runtime-slots"])
    if options["tracing-config"] is not None:
        from infx.tracing import start_tracing
        from infx.tracing.runtime import TracedRuntime

        tracing = start_tracing(options["tracing-config"], "infx-engine", options["engine-id"], reactor)
        served = TracedRuntime(served, tracing, options["engine-id"],
                               runtime.root if isinstance(runtime, OpenAIRuntime) else None)
    agent = EngineAgent(reactor, EngineAgentCore(agent_config), served,
                        GrpcLinks(reactor, connect, key=options["key"] or ""), grace=options["grace"])
    if kept is not None:
        kept.report = agent.slot_keeping_changed
        kept.changed()  # keeping is on, nothing done yet: operators see the zeros at once
    if watch is not None:
        watch.changed = agent.runtime_changed
        watch.identified = agent.runtime_identified
        used.append(watch)
    if isinstance(runtime, OpenAIRuntime) and options["load-config"] is not None:
        scrapes = scrape_pool(reactor)
        used.append(_PoolCloser(scrapes.closeCachedConnections))
        load = RuntimeLoadWatch(reactor, RuntimeLoadMonitor(options["load-config"]),
                                Agent(reactor, pool=scrapes, connectTimeout=5), runtime.root,
                                agent.runtime_load_changed, authorize=runtime.authorize,
                                refused=runtime.credentials.refused if runtime.credentials else None,
                                sample=agent.core.load_sample)
        used.append(load)
        if watch is not None:
            watch.changed = ReadWhenReady(agent.runtime_changed, load)
    top = AgentServices(agent)
    for service in used:
        service.setServiceParent(top)
    agent.setServiceParent(top)
    return top
