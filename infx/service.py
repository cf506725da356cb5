"""The gateway's service tree: what ``twistd infx`` runs, and what an embedding app mounts.

:func:`build_gateway` wires processor, dispatcher, HTTP API and worker gRPC
service from a :class:`~infx.config.GatewayConfig`, taking the reactor as an
argument; it returns a :class:`GatewayService` (an ``IService``) whose
children listen on the configured endpoints. Applications that already run
a twisted.web site can instead mount ``service.http_resource`` themselves.

Size (over 600 lines): it is the one place the gateway's parts are wired into one service
(processor, dispatcher, HTTP servers, exchange, workers, runtimes by URL, scaler, status); every
part lives in its own module, and the wiring reads best in one ``GatewayService``.
"""

from __future__ import annotations

import errno
import os
import re
import secrets
import socket
from typing import Any, Callable, Mapping

from prometheus_client import CollectorRegistry
from twisted.application import service
from twisted.application.internet import TimerService
from twisted.internet import defer
from twisted.internet.endpoints import serverFromString
from twisted.internet.defer import Deferred
from twisted.logger import Logger
from twisted.python.failure import Failure

import infx
from infx.config import (
    ConfigError, GatewayConfig, endpoint_port, internal_tls, routing_config, runtime_targets, tracing_config,
)
from infx.gateway.cluster_status import ClusterStatus, RequestJournal, StatusSources
from infx.exchange.exchanger import Exchanger, ExchangerConfig
from infx.gateway.auth import KeyStore, Principal
from infx.gateway.dispatcher import Dispatcher
from infx.gateway.metrics import GatewayMetrics
from infx.gateway.runtime_engines import RuntimeEngines, RuntimeSettings
from infx.gateway.workers import WorkerService
from infx.http.api import HttpApi
from infx.http.resources import build_resource, own_metrics_resource
from infx.http.lean import LeanSite
from infx.http.site import GatewaySite
from infx.supervisor.peers import SiblingPeerSource
from infx.supervisor.role import WorkerRole
from infx.transport import GrpcChannel, GrpcServer
from protocol.discovery.peers import PeerAddress, PeerChange
from protocol.gateway.effects import DIAL_BACK_SECONDS, PEER_LEARNING_SECONDS, CoreConfig
from protocol.grpc import GrpcConfig
from protocol.processor.core import Processor
from protocol.processor.config import ProcessorConfig
from protocol.routing.config import RoutingPolicy
from protocol.scaling.scaler import DEFAULT_STARTUP_TIMEOUT, ScalerConfig
from protocol.supervisor.siblings import IN_EVERY_WORKER, workers_header

log = Logger()



class ListenFailed(Exception):
    """A listen option's endpoint could not be bound; ``str()`` is the one line an operator sees."""


class ListeningService(service.Service):
    """Listens on a Twisted server endpoint string; remembers the port (tests read it).

    The port is bound in ``privilegedStartService``, which ``twistd`` calls
    before ``-u``/``-g`` drop root, so that ports below 1024 work; an
    application that only calls ``startService`` gets it bound there.
    :attr:`bound` fires with the port, or fails with :class:`ListenFailed`
    naming the option, the endpoint and why.
    """

    def __init__(self, reactor: Any, option: str, description: str, factory: Any, endpoint: Any = None) -> None:
        """``endpoint``, when given, is listened on instead of ``description``'s (a socket a
        supervisor made, or an internal port 0 held since the gateway was built:
        :class:`~infx.supervisor.sockets.AdoptedEndpoint`); ``description`` still names it in errors."""
        self.reactor = reactor
        self.option = option
        self.description = description
        self.factory = factory
        self.endpoint = endpoint
        self.port: Any = None
        self.bound: Deferred[Any] = Deferred()
        self._listening: Deferred[Any] | None = None
        self._abandoned = False

    def abandon(self) -> None:
        """Another port of the same gateway failed: close this one, or never bind it."""
        self._abandoned = True
        if self.port is not None:
            port, self.port = self.port, None
            port.stopListening()

    def privilegedStartService(self) -> None:
        service.Service.privilegedStartService(self)
        self._listen()

    def startService(self) -> None:
        service.Service.startService(self)
        self._listen()

    def _listen(self) -> None:
        if self._listening is not None or self._abandoned:
            return
        self._listening = defer.maybeDeferred(
            lambda: (self.endpoint or serverFromString(self.reactor, self.description)).listen(self.factory))
        self._listening.addCallbacks(self._listened, self._failed)

    def _listened(self, port: Any) -> None:
        self.port = port
        self.bound.callback(port)

    def _failed(self, reason: Failure) -> None:
        self.bound.errback(ListenFailed(f"{self.option}: cannot listen on {self.description}: "
                                        f"{_listen_error(reason.value, self.description)}"))

    def stopService(self) -> Deferred[None] | None:
        service.Service.stopService(self)
        if self.port is not None:
            port, self.port = self.port, None
            return defer.maybeDeferred(port.stopListening)
        return None


def _listen_error(error: BaseException, description: str) -> str:
    """The reason in words, with the hint an operator needs for the usual two."""
    socket_error = getattr(error, "socketError", None)
    if isinstance(socket_error, OSError) and socket_error.errno == errno.EADDRINUSE:
        return f"port {_port_of(description)} is already in use"
    if isinstance(socket_error, OSError) and socket_error.errno in (errno.EACCES, errno.EPERM):
        return (f"permission denied for port {_port_of(description)} (ports below 1024 need root: "
                "start twistd as root with -u/-g to drop privileges after binding)")
    if isinstance(socket_error, OSError) and socket_error.strerror:
        return socket_error.strerror
    return str(error) or type(error).__name__


def _port_of(description: str) -> str:
    try:
        return str(endpoint_port(description))
    except ConfigError:
        return description


class GatewayService(service.MultiService):
    """The gateway; on stop it turns unready, sends go-away and lets requests finish."""

    def __init__(self, reactor: Any, config: GatewayConfig, registry: CollectorRegistry | None = None,
                 pod_name: str | None = None, environ: Mapping[str, str] | None = None,
                 role: WorkerRole | None = None) -> None:
        """``pod_name`` names this gateway to its peers (default: ``POD_NAME``, else derived
        from the internal listen address; see :func:`default_pod_name`); ``environ`` is
        where ``POD_NAME``, ``NAMESPACE`` and ``KUBECONFIG`` are read (default: ``os.environ``);
        ``role``: this gateway is one worker of ``twistd infx --workers N`` (its name, its
        siblings and the sockets it adopts; see :mod:`infx.supervisor`)."""
        super().__init__()
        self.environ: Mapping[str, str] = os.environ if environ is None else environ
        self.reactor = reactor
        self.config = config
        self.role = role
        self.registry = registry or CollectorRegistry()
        self.metrics = GatewayMetrics(self.registry)
        self.key_reload: Any = None
        if config.api_keys:
            from infx.gateway.key_reload import watched_key_store

            keys, self.key_reload = watched_key_store(reactor, config.api_keys)
            self.key_reload.setServiceParent(self)
        else:
            keys = KeyStore.disabled()
        self.keys = keys
        self._log_auth()
        # With the scaler, a task may wait for a cold start, not only for an engine to reconnect.
        queue_timeout = max(config.queue_timeout, DEFAULT_STARTUP_TIMEOUT) if config.scaler else config.queue_timeout
        routing, hints = routing_config(config)
        self.processor = Processor(ProcessorConfig(
            queue_timeout=queue_timeout, max_task_duration=config.max_task_duration,
            max_attempts=config.max_attempts,
            heartbeat_interval=config.heartbeat_interval,
            max_in_flight_per_engine=config.max_in_flight_per_engine,
            cap_at_runtime_slots=config.cap_at_runtime_slots,
            max_tasks_per_tenant=config.max_tasks_per_tenant,
            shed_waiting_threshold=config.shed_waiting_threshold,
            fair_reserve=config.fair_reserve,
            routing=routing,
            route_stuck_timeout=config.route_stuck_timeout,
        ))
        self._held_internal = self._hold_internal_port_0() if role is None else None
        self.pod_name = pod_name or (role.pod_name if role is not None else
                                     default_pod_name(config, self.environ, self._held_peer_port()))
        self.dispatcher = Dispatcher(reactor, self.processor, self.metrics,
                                     config=CoreConfig(pod_name=self.pod_name, status_interval=config.status_interval,
                                                       learn_peers_within=PEER_LEARNING_SECONDS,
                                                       redial_when_dialled_in=True,
                                                       dial_back_after=DIAL_BACK_SECONDS))
        self.metrics.watch(self.dispatcher.gauges, lambda: self.processor.counters)
        # Only the affinity policy reads a request's hints: the others route without making them.
        self.gateway = HttpApi(self.dispatcher, reactor, self.metrics, keys, max_body_size=config.max_body_size,
                               hints=hints if routing.policy is RoutingPolicy.AFFINITY else None)
        self.tracing = self._start_tracing()
        self.gateway.tracing = self.dispatcher.tracing = self.tracing
        self.http_resource = build_resource(self.gateway, self._metrics_of_every_worker() if role else None)
        site = self._http_site(config)
        self.http = ListeningService(reactor, "--http", config.http, site, self._adopted("http"))
        self.http.setServiceParent(self)

        grpc_config = GrpcConfig(
            client_side=False,
            max_receive_message_length=config.max_message_size,
            max_send_message_length=config.max_message_size,
            require_authentication=True,
        )
        self.worker_server = GrpcServer(reactor, grpc_config)
        self.workers = WorkerService(self.dispatcher, keys, config.route_max_queued_bytes)
        self.workers.register(self.worker_server)
        self.worker_grpc = ListeningService(reactor, "--worker-grpc", config.worker_grpc, self.worker_server,
                                            self._adopted("worker_grpc"))
        self.worker_grpc.setServiceParent(self)
        self._private_listeners = self._worker_private_ports() if role is not None else []
        self.builtin_engine = self._builtin_engine() if config.echo_models else None
        self.runtime_engines = self._runtime_engines()
        self._build_exchange(self.pod_name)
        self.metrics.watch_route_queues(lambda: [("engine", stream.queued_bytes) for stream in self.workers.streams]
                                        + [("peer", stream.queued_bytes) for stream in self.exchanger.streams])
        self.scaler: Any = self._build_scaler() if config.scaler else None
        self._build_cluster_status(routing.policy.value)
        self._start_all_or_nothing()

    def _start_tracing(self) -> Any:
        """``--otlp-traces-endpoint``: this gateway's tracer (docs/tracing.md); else None, and no
        opentelemetry module is imported."""
        traces = tracing_config(self.config)
        if traces is None:
            return None
        from infx.tracing import start_tracing

        log.info("tracing: OTLP {protocol} to {endpoint}, sampling {ratio:g} of new traces",
                 protocol=traces.protocol, endpoint=traces.endpoint, ratio=traces.sample_ratio)
        return start_tracing(traces, "infx-gateway", self.pod_name, self.reactor, self.metrics.trace_spans_lost.inc)

    def _http_site(self, config: GatewayConfig) -> Any:
        """The server of the API on ``--http``: httptools' (:mod:`infx.http.lean`) or twisted.web's,
        which also serves an ``ssl:`` endpoint (HTTP/2 by ALPN). One resource tree either way."""
        if config.http_server == "httptools" and not config.http.startswith("ssl:"):
            return LeanSite(self.http_resource, max_body_size=config.max_body_size,
                            on_refused=self.gateway.refused_early, reactor=self.reactor)
        return GatewaySite(self.http_resource, max_body_size=config.max_body_size,
                           on_refused=self.gateway.refused_early)
    # --- what operators see (infx/gateway/cluster_status.py, infx/http/admin.py) -------

    def _build_cluster_status(self, routing_policy: str) -> None:
        """The /admin/status document and the records it reads: every request that ends is
        journalled, and the routing decisions are sampled into the timeline once a bucket."""
        journal = RequestJournal()
        gateway = self.gateway
        self.cluster_status = ClusterStatus(self.reactor, StatusSources(
            core=self.dispatcher.core,
            gateway_of=self.dispatcher.gateway_of,
            journal=journal,
            version=infx.__version__,
            started_at=self.reactor.seconds(),
            address=lambda: _address(self.internal_grpc.port) if self.internal_grpc.port is not None else None,
            ready=lambda: gateway.ready,
            draining=lambda: gateway.shutting_down,
            exchanger=self.exchanger,
            scaler=self.scaler.scaler.machine if self.scaler is not None else None,
            can_start=self.dispatcher.can_start,
            in_flight=lambda: [(call.trace.tenant, call.trace.request_id, call) for call in gateway.active_calls],
            max_in_flight_per_engine=self.config.max_in_flight_per_engine,
            routing_policy=routing_policy,
        ))
        gateway.journal = journal
        gateway.cluster_status = self.cluster_status
        self.metrics.watch_routing(self.processor.routing_decisions, self.dispatcher.model_label)
        exchanger = self.exchanger
        self.metrics.watch_status_traffic(lambda: [
            *((peer, "in", t.reports_received, t.bytes_received) for peer, t in exchanger.reports_received.items()),
            *((peer, "out", t.reports_sent, t.bytes_sent) for peer, t in exchanger.reports_sent.items())])
        sampler = TimerService(journal.timeline.config.bucket_seconds, self.cluster_status.sample_routing)
        sampler.clock = self.reactor
        sampler.setServiceParent(self)

    # --- scaling engine deployments (infx/scaling/scaler.py) -------------------------

    def _build_scaler(self) -> Any:
        """``--scaler``: watch scalable deployments in this namespace and hold tasks through cold starts."""
        import random

        from infx.discovery.kube import PodWatcherConfig, kube_api_client
        from infx.scaling.scaler import ProcessorLink, kubernetes_scaler

        namespace = PodWatcherConfig.from_environment(
            self.config.pod_label, self.config.effective_peer_port, environ=self.environ).namespace
        scaler_service = kubernetes_scaler(self.reactor, kube_api_client(self.environ), namespace, self.pod_name,
                                           rng=random.SystemRandom(),
                                           config=ScalerConfig(peer_report_interval=self.config.status_interval),
                                           registry=self.registry)
        scaler_service.setServiceParent(self)
        self.scaler_link = ProcessorLink(scaler_service.scaler, self.dispatcher)
        self.dispatcher.on_request_started.append(scaler_service.scaler.request_started)
        self.dispatcher.on_request_finished.append(scaler_service.scaler.request_finished)
        # Requests other gateways accepted: the leader's rps would otherwise be its own share only.
        self.exchanger.on_peer_requests.append(scaler_service.scaler.observe_peer_requests)
        self.exchanger.on_peer_gone.append(scaler_service.scaler.forget_peer)
        return scaler_service

    def _builtin_engine(self) -> Any:
        """An echo engine in this process that dials our own worker port.

        It takes the same path as any engine (gRPC over loopback), so what
        ``tools/run`` shows is what a real deployment does. It starts once
        the worker port listens and stops first on shutdown. Its id names this
        gateway (:func:`builtin_engine_id`): every gateway runs one, and a peer
        that does not scope engine ids by gateway (LLMariner's) must not take
        them for one engine.
        """
        from infx.agent.engine import EngineAgent, GrpcLinks
        from infx.agent.runtimes import EchoRuntime
        from infx.transport import GrpcChannel, client_endpoint
        from protocol.agent.core import EngineAgentCore
        from protocol.agent.effects import AgentConfig
        from protocol.agent.echo import EchoConfig

        key = secrets.token_urlsafe(24)
        if self.keys.enabled:
            self.keys.add_engine_key(key, Principal(tenant=self.config.echo_tenant, key_id="builtin-echo"))

        # A worker's own engine-facing port is shared with its siblings: its engine dials a private one.
        listener = self.engines_private if self.role is not None else self.worker_grpc

        def connect() -> GrpcChannel:
            address = listener.port.getHost()
            host = "127.0.0.1" if address.host in ("0.0.0.0", "::", "") else address.host
            config = GrpcConfig(client_side=True, max_receive_message_length=self.config.max_message_size)
            return GrpcChannel(self.reactor, client_endpoint(self.reactor, host, address.port), config)

        # Every worker runs one: a sibling's is not this worker's to serve (protocol/supervisor/siblings.py).
        capabilities = (IN_EVERY_WORKER,) if self.role is not None else ()
        core = EngineAgentCore(AgentConfig(engine_id=builtin_engine_id(self.pod_name), models=self.config.echo_models,
                                           instance=secrets.token_hex(8), capabilities=capabilities,
                                           runtime_kind="echo", agent_version=infx.__version__))
        runtime: Any = EchoRuntime(self.reactor, EchoConfig(token_delay=self.config.echo_token_delay))
        if self.tracing is not None:
            from infx.tracing.runtime import TracedRuntime

            runtime = TracedRuntime(runtime, self.tracing, core.config.engine_id, None)
        return EngineAgent(self.reactor, core, runtime, GrpcLinks(self.reactor, connect, key=key),
                           grace=self.config.grace_period)

    def _runtime_engines(self) -> RuntimeEngines:
        """Runtimes this gateway serves itself, no agent in between (docs/runtimes-by-url.md):
        ``--runtime-url``, and with ``--runtime-pod-label`` the pods of this namespace it picks."""
        config = self.config
        settings = RuntimeSettings(tenant=config.runtime_tenant, max_concurrency=config.runtime_max_concurrency,
                                   api_key_file=config.runtime_api_key_file, grace=config.grace_period,
                                   slot_files=config.runtime_slot_files, tracing=self.tracing,
                                   capabilities=(IN_EVERY_WORKER,) if self.role is not None else ())
        discover = None
        if config.runtime_pod_label:
            import random

            from kubernetes import client

            from infx.discovery.kube import PodWatcherConfig, RuntimePodWatcher, kube_api_client

            label = config.runtime_pod_label
            namespace = PodWatcherConfig.from_environment(label, config.runtime_port, environ=self.environ).namespace
            api = client.CoreV1Api(kube_api_client(self.environ))

            def discover(on_change: Callable[[Any], None]) -> RuntimePodWatcher:
                # Seeded by the OS: replicas restarted together must not back off in step.
                return RuntimePodWatcher(self.reactor, api, namespace, label, config.runtime_port, on_change,
                                         random.SystemRandom())

        return RuntimeEngines(self.reactor, self.dispatcher, self.pod_name, settings, runtime_targets(config),
                              discover)

    # --- start-up: all ports or none ----------------------------------------

    def _start_all_or_nothing(self) -> None:
        """Nothing that depends on a port (readiness, the built-in engine, peers, the scaler)
        starts until every port listens; one that cannot be bound closes the others."""
        self._listeners = [self.http, self.worker_grpc, self.internal_grpc, *self._private_listeners]
        self._all_bound = False
        self._dependents_started = False
        self._listen_failure: Failure | None = None
        self._listen_waiters: list[Deferred[None]] = []
        bound = defer.gatherResults([listener.bound for listener in self._listeners], consumeErrors=True)
        bound.addCallbacks(self._every_port_listens, self._a_port_failed)

    def when_listening(self) -> Deferred[None]:
        """Fires once every port listens; fails with :class:`ListenFailed` if one cannot be bound."""
        waiter: Deferred[None] = Deferred()
        if self._listen_failure is not None:
            waiter.errback(self._listen_failure)
        elif self._all_bound:
            waiter.callback(None)
        else:
            self._listen_waiters.append(waiter)
        return waiter

    @property
    def listen_failure(self) -> ListenFailed | None:
        """Why a port could not be bound, once one could not (twistd's start-up checks it)."""
        error = None if self._listen_failure is None else self._listen_failure.value
        return error if isinstance(error, ListenFailed) else None

    def startService(self) -> None:
        service.MultiService.startService(self)
        self._start_dependents()

    def _log_auth(self) -> None:
        """Say at start whether anyone may call: an open gateway must not look like a locked one."""
        if not self.keys.enabled:
            log.warn("auth is off (no --api-keys): every caller is in the default tenant, engines need no key, "
                     "and /admin/status is open", event="auth_off")
        else:
            clients, engines = self.keys.counts()
            log.info("API keys: loaded {clients} client and {engines} engine key(s) from {path}",
                     clients=clients, engines=engines, path=self.keys.source, event="keys_loaded")
        if self.config.internal_secret is None:
            log.info("peers need no internal secret (no --internal-secret-file, $INFX_INTERNAL_SECRET or "
                     "--internal-secret)", event="peer_auth_off")

    def _every_port_listens(self, _: Any) -> None:
        self._all_bound = True
        log.info("listening: HTTP API on {http}, engines on {worker}, peers on {internal}",
                 http=_address(self.http.port), worker=_address(self.worker_grpc.port),
                 internal=_address(self.internal_grpc.port), event="listening")
        self._start_dependents()
        waiters, self._listen_waiters = self._listen_waiters, []
        for waiter in waiters:
            waiter.callback(None)

    def _a_port_failed(self, reason: Failure) -> None:
        failure = reason.value.subFailure if isinstance(reason.value, defer.FirstError) else reason
        self._listen_failure = failure
        log.critical("{error}", error=str(failure.value))
        for listener in self._listeners:
            listener.abandon()
        waiters, self._listen_waiters = self._listen_waiters, []
        for waiter in waiters:
            waiter.errback(failure)

    def _start_dependents(self) -> None:
        if not (self.running and self._all_bound) or self._dependents_started:
            return
        self._dependents_started = True
        self.exchanger.start()
        if self.builtin_engine is not None:
            self.builtin_engine.startService()
        self.runtime_engines.start()
        self.gateway.listening = True

    @defer.inlineCallbacks
    def stopService(self) -> Any:
        """Graceful shutdown: unready, go-away to engines, drain within the grace period, stop."""
        self.gateway.shutting_down = True
        self.workers.accepting = False
        # Before the dispatcher's drain, whose go-away would have them open new streams.
        runtimes_drained = self.runtime_engines.drain()
        self.dispatcher.drain()
        exchange_drained = self.exchanger.drain()
        deadline = self.reactor.seconds() + self.config.grace_period
        while ((self.gateway.active_calls or not exchange_drained.called)
               and self.reactor.seconds() < deadline):
            yield _sleep(self.reactor, 0.1)
        if self.gateway.active_calls:
            log.warn("{count} requests still running after the grace period", count=len(self.gateway.active_calls))
            for call in list(self.gateway.active_calls):
                # An explicit answer (an error event if streaming) rather than a dropped connection.
                if call.handle is not None:
                    call.handle.cancel()
                call.failed(503, "the gateway shut down before the request finished", None)
        if self.scaler is not None:
            self.scaler_link.stop()
        yield self.exchanger.stop()
        if self.builtin_engine is not None and self.builtin_engine.running:
            yield self.builtin_engine.stopService()
        yield runtimes_drained
        yield defer.maybeDeferred(service.MultiService.stopService, self)


    # --- task exchange between gateway replicas (infx/exchange/exchanger.py) ----------

    def _build_exchange(self, pod_name: str) -> None:
        """The internal gRPC server on ``internal_grpc`` and the exchanger; peers are dialled once it listens."""
        config = self.config
        self.internal_server = GrpcServer(self.reactor, GrpcConfig(
            client_side=False,
            max_receive_message_length=config.max_message_size,
            max_send_message_length=config.max_message_size,
            require_authentication=True,
        ))
        self.exchanger = Exchanger(
            self.reactor, self.dispatcher,
            self._exchanger_config(pod_name), self._peer_source, self._peer_channel,
        )
        if isinstance(self.exchanger.source, SiblingPeerSource):
            self.exchanger.on_dial_accepted.append(self.exchanger.source.dial_accepted)
        self.exchanger.register(self.internal_server)
        # --internal-tls-*: TLS requiring a client certificate from the internal CA, on the same endpoint;
        # the files are read again as connections come, to pick up a rotation.
        credentials = internal_tls(config)
        self.peer_tls: Any = None
        listening_factory: Any = self.internal_server
        if credentials is not None:
            from infx.exchange.peer_tls import PeerTLS

            self.peer_tls = PeerTLS(self.reactor, credentials)
            listening_factory = self.peer_tls.server_factory(self.reactor, self.internal_server)
        self.internal_grpc = ListeningService(self.reactor, "--internal-grpc", config.internal_grpc,
                                              listening_factory, self._internal_endpoint())
        self.internal_grpc.setServiceParent(self)

    def _exchanger_config(self, pod_name: str) -> ExchangerConfig:
        config, role = self.config, self.role
        if role is None:
            return ExchangerConfig(pod_name=pod_name, secret=config.internal_secret, peer_port=self._peer_port(),
                                   max_queued_bytes=config.route_max_queued_bytes)
        return ExchangerConfig(pod_name=pod_name, secret=config.internal_secret,
                               peer_port=role.internal_ports[role.index], max_queued_bytes=config.route_max_queued_bytes,
                               accept_metadata=(workers_header(role.internal_ports),),
                               siblings=frozenset(role.siblings))

    # --- a worker of twistd infx --workers N (infx/supervisor/) -----------------------------

    def _adopted(self, name: str) -> Any:
        """The socket the supervisor made for this listen option, or None (bind it here)."""
        if self.role is None:
            return None
        from infx.supervisor.sockets import AdoptedEndpoint

        description = getattr(self.config, name, "tcp:0")
        return AdoptedEndpoint(self.reactor, self.role.fds[name], self.role.families[name], description)

    def _worker_private_ports(self) -> list[ListeningService]:
        """A worker's loopback ports of its own: its engine-facing service, for its built-in engine
        (the shared port may hand its connection to a sibling), and its own ``/metrics``, which the
        worker answering a scrape reads from each sibling."""
        from twisted.web import server as web_server

        self.engines_private = ListeningService(self.reactor, "--worker-grpc (this worker's own)", "tcp:0",
                                                self.worker_server, self._adopted("engines_private"))
        self.engines_private.setServiceParent(self)
        metrics_site = web_server.Site(own_metrics_resource(self.registry))
        metrics_site.log = lambda request: None  # type: ignore[method-assign]
        self.metrics_private = ListeningService(self.reactor, "/metrics (this worker's own)", "tcp:0", metrics_site,
                                                self._adopted("metrics_private"))
        self.metrics_private.setServiceParent(self)
        return [self.engines_private, self.metrics_private]

    def _metrics_of_every_worker(self) -> Any:
        """``/metrics`` of a worker: every worker's series, each labelled with its ``worker``."""
        from infx.supervisor.metrics import EveryWorkerMetrics

        assert self.role is not None
        return EveryWorkerMetrics(self.reactor, self.registry, self.role.index, self.role.metrics_ports)

    # --- an internal endpoint on port 0 --------------------------------------------------

    def _hold_internal_port_0(self) -> tuple[int, int, int] | None:
        """``--internal-grpc`` on port 0 is bound here, as the gateway is built: the port the
        kernel picks names this gateway (:func:`default_pod_name`) and is what peers dial back,
        so it must be known before anything that carries the name is made. Returns the socket's
        descriptor, family and port; None for a given port (bound in ``privilegedStartService``,
        before root is dropped), an endpoint without a port (``unix:``), or a bind that fails
        (tried again on start, which reports it as any port's failure is)."""
        from infx.supervisor.sockets import bind_one, listen_address

        try:
            address = listen_address(self.config.internal_grpc, "--internal-grpc")
            if address.port != 0:
                return None
            sock = bind_one(address, "--internal-grpc")
        except (ConfigError, ListenFailed):
            return None
        port = int(sock.getsockname()[1])
        return sock.detach(), address.family, port

    def _held_peer_port(self) -> int | None:
        """The held internal port, where it names the gateway and is dialled back (no ``--peer-port``)."""
        if self._held_internal is None or self.config.peer_port is not None:
            return None
        return self._held_internal[2]

    def _internal_endpoint(self) -> Any:
        """Where ``--internal-grpc`` listens: the held port 0 socket, a worker's adopted one, or None (bind it)."""
        if self._held_internal is None:
            return self._adopted("internal_grpc")
        from infx.supervisor.sockets import AdoptedEndpoint

        fd, family, _ = self._held_internal
        return AdoptedEndpoint(self.reactor, fd, family, self.config.internal_grpc)

    def _peer_port(self) -> int | None:
        """The port peers dial back (a unix: internal endpoint has none)."""
        held = self._held_peer_port()
        if held is not None:
            return held
        try:
            return self.config.effective_peer_port
        except ConfigError:
            return None

    def _peer_source(self, on_change: Callable[[PeerChange], None]) -> Any:
        """Static ``--peers``, or with ``--kube`` the pod watcher (in-cluster config or ``KUBECONFIG``);
        a worker's, with its siblings and each peer's other workers (:mod:`infx.supervisor.peers`)."""
        if self.role is None:
            return self._configured_peers(on_change)
        siblings = {pod: PeerAddress(host, port) for pod, (host, port) in self.role.siblings.items()}
        return SiblingPeerSource(siblings, self._configured_peers, on_change)

    def _configured_peers(self, on_change: Callable[[PeerChange], None]) -> Any:
        from infx.discovery.kube import StaticPeers

        if not self.config.kube:
            return StaticPeers(self.config.peers, on_change)
        import random

        from kubernetes import client

        from infx.discovery.kube import PodWatcher, PodWatcherConfig, kube_api_client

        watcher_config = PodWatcherConfig.from_environment(self.config.pod_label, self.config.effective_peer_port,
                                                           environ=self.environ)
        api = client.CoreV1Api(kube_api_client(self.environ))
        # Seeded by the OS: replicas restarted together must not back off in step.
        return PodWatcher(self.reactor, api, watcher_config, on_change, random.SystemRandom())

    def _peer_channel(self, address: PeerAddress) -> GrpcChannel:
        from infx.transport import client_endpoint

        config = GrpcConfig(client_side=True, max_receive_message_length=self.config.max_message_size,
                            max_send_message_length=self.config.max_message_size)
        endpoint = client_endpoint(self.reactor, address.host, address.port)
        if self.peer_tls is not None:
            endpoint = self.peer_tls.client_endpoint(self.reactor, endpoint)
        return GrpcChannel(self.reactor, endpoint, config)


def default_pod_name(config: GatewayConfig, environ: Mapping[str, str], internal_port: int | None = None) -> str:
    """``POD_NAME``; else ``ADDRESS:PORT`` of the internal listen endpoint (``internal_port`` in
    place of its port: a worker's of ``--workers N``, or the one the kernel picked for port 0),
    which is what static peers dial, with the host name standing in for a wildcard address."""
    if environ.get("POD_NAME"):
        return environ["POD_NAME"]
    interface = re.search(r"(?:^|:)interface=([^:]+)", config.internal_grpc)
    host = interface.group(1) if interface else ""
    if host in ("", "0.0.0.0", "::"):
        host = socket.gethostname()
    if internal_port is not None:
        return f"{host}:{internal_port}"
    try:
        return f"{host}:{config.effective_peer_port}"
    except ConfigError:  # an endpoint without a port number (unix:...)
        return host


def _address(port: Any) -> str:
    """Where a listening port accepts connections: HOST:PORT (every interface: 0.0.0.0 or ::),
    or the address as Twisted gives it (a unix socket)."""
    address = port.getHost()
    host, number = getattr(address, "host", None), getattr(address, "port", None)
    if host is None or number is None:
        return str(address)
    return f"[{host}]:{number}" if ":" in str(host) else f"{host}:{number}"


def builtin_engine_id(pod_name: str) -> str:
    """The id of the built-in echo engine of the gateway ``pod_name``."""
    return f"builtin-echo-{pod_name}"


def _sleep(reactor: Any, seconds: float) -> Deferred[None]:
    d: Deferred[None] = Deferred()
    reactor.callLater(seconds, d.callback, None)
    return d


def build_gateway(reactor: Any, config: GatewayConfig, registry: CollectorRegistry | None = None,
                  role: WorkerRole | None = None) -> GatewayService:
    """The gateway as an ``IService``, for ``twistd infx`` or an embedding application; ``role``
    for a worker of ``twistd infx --workers N`` (:mod:`infx.supervisor`)."""
    return GatewayService(reactor, config, registry, role=role)
