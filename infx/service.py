"""The gateway's service tree: what ``twistd infx`` runs, and what an embedding app mounts.

:func:`build_gateway` wires processor, dispatcher, HTTP API and worker gRPC
service from a :class:`~infx.config.GatewayConfig`, taking the reactor as an
argument; it returns a :class:`GatewayService` (an ``IService``) whose
children listen on the configured endpoints. Applications that already run
a twisted.web site can instead mount ``service.http_resource`` themselves.
"""

from __future__ import annotations

import os
import re
import secrets
import socket
from typing import Any, Callable, Mapping

from prometheus_client import CollectorRegistry
from twisted.application import service
from twisted.internet import defer
from twisted.internet.endpoints import serverFromString
from twisted.internet.defer import Deferred
from twisted.logger import Logger

from infx.auth import DEFAULT_TENANT, KeyStore, Principal
from infx.config import ConfigError, GatewayConfig, internal_tls
from infx.dispatcher import Dispatcher
from infx.exchanger import Exchanger, ExchangerConfig
from infx.gateway import Gateway, GatewaySite, build_resource
from infx.metrics import GatewayMetrics
from infx.transport import GrpcChannel, GrpcServer
from infx.workers import WorkerService
from protocol.grpc import GrpcConfig
from protocol.peers import PeerAddress, PeerChange
from protocol.processor import Processor
from protocol.processor_types import ProcessorConfig
from protocol.scaling import DEFAULT_STARTUP_TIMEOUT, ScalerConfig

log = Logger()


class _ListeningService(service.Service):
    """Listens on a Twisted server endpoint string; remembers the port (tests read it)."""

    def __init__(self, reactor: Any, description: str, factory: Any, on_listening: Any = None) -> None:
        self.reactor = reactor
        self.description = description
        self.factory = factory
        self.port: Any = None
        self._on_listening = on_listening

    @defer.inlineCallbacks
    def startService(self) -> Any:
        service.Service.startService(self)
        endpoint = serverFromString(self.reactor, self.description)
        self.port = yield endpoint.listen(self.factory)
        if self._on_listening is not None:
            self._on_listening()

    def stopService(self) -> Deferred[None] | None:
        service.Service.stopService(self)
        if self.port is not None:
            port, self.port = self.port, None
            return defer.maybeDeferred(port.stopListening)
        return None


class GatewayService(service.MultiService):
    """The gateway; on stop it turns unready, sends go-away and lets requests finish."""

    def __init__(self, reactor: Any, config: GatewayConfig, registry: CollectorRegistry | None = None,
                 pod_name: str | None = None, environ: Mapping[str, str] | None = None) -> None:
        """``pod_name`` names this gateway to its peers (default: ``POD_NAME``, else derived
        from the internal listen address; see :meth:`_default_pod_name`); ``environ`` is
        where ``POD_NAME``, ``NAMESPACE`` and ``KUBECONFIG`` are read (default: ``os.environ``)."""
        super().__init__()
        self.environ: Mapping[str, str] = os.environ if environ is None else environ
        self.reactor = reactor
        self.config = config
        self.registry = registry or CollectorRegistry()
        self.metrics = GatewayMetrics(self.registry)
        keys = KeyStore.from_file(config.api_keys) if config.api_keys else KeyStore.disabled()
        self.keys = keys
        # With the scaler, a task may wait for a cold start, not only for an engine to reconnect.
        queue_timeout = max(config.queue_timeout, DEFAULT_STARTUP_TIMEOUT) if config.scaler else config.queue_timeout
        self.processor = Processor(ProcessorConfig(
            queue_timeout=queue_timeout, max_task_duration=config.max_task_duration,
            heartbeat_interval=config.heartbeat_interval,
            max_in_flight_per_engine=config.max_in_flight_per_engine,
            max_tasks_per_tenant=config.max_tasks_per_tenant,
            route_stuck_timeout=config.route_stuck_timeout,
        ))
        self.dispatcher = Dispatcher(reactor, self.processor, self.metrics)
        self.metrics.watch(self.dispatcher.gauges, lambda: self.processor.counters)
        self.gateway = Gateway(self.dispatcher, reactor, self.metrics, keys, max_body_size=config.max_body_size)
        self.http_resource = build_resource(self.gateway)
        site = GatewaySite(self.http_resource, max_body_size=config.max_body_size)
        self.http = _ListeningService(reactor, config.http, site, on_listening=self._http_listening)
        self.http.setServiceParent(self)

        grpc_config = GrpcConfig(
            client_side=False,
            max_receive_message_length=config.max_message_size,
            max_send_message_length=config.max_message_size,
        )
        self.worker_server = GrpcServer(reactor, grpc_config)
        self.workers = WorkerService(self.dispatcher, keys)
        self.workers.register(self.worker_server)
        self.worker_grpc = _ListeningService(reactor, config.worker_grpc, self.worker_server,
                                             on_listening=self._worker_listening)
        self.worker_grpc.setServiceParent(self)
        self.builtin_engine = self._builtin_engine() if config.echo_models else None
        self.pod_name = pod_name or self._default_pod_name()
        self._build_exchange(self.pod_name)
        self.scaler: Any = self._build_scaler() if config.scaler else None

    # --- scaling engine deployments (infx/scaler.py) -------------------------

    def _build_scaler(self) -> Any:
        """``--scaler``: watch scalable deployments in this namespace and hold tasks through cold starts."""
        from infx.kube import PodWatcherConfig, kube_api_client
        from infx.scaler import ProcessorLink, kubernetes_scaler

        namespace = PodWatcherConfig.from_environment(
            self.config.pod_label, self.config.effective_peer_port, environ=self.environ).namespace
        scaler_service = kubernetes_scaler(self.reactor, kube_api_client(self.environ), namespace, self.pod_name,
                                           config=ScalerConfig(peer_report_interval=self.config.status_interval),
                                           registry=self.registry)
        scaler_service.setServiceParent(self)
        self.scaler_link = ProcessorLink(scaler_service.scaler, self.dispatcher, self.reactor)
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
        the worker port listens and stops first on shutdown.
        """
        from infx.engine import EngineAgent
        from infx.runtimes import EchoRuntime
        from infx.transport import GrpcChannel, client_endpoint
        from protocol.echo import EchoConfig
        from protocol.engine_agent import AgentConfig, EngineAgentCore

        key = secrets.token_urlsafe(24)
        if self.keys.enabled:
            self.keys.add_engine_key(key, Principal(tenant=DEFAULT_TENANT, key_id="builtin-echo"))

        def connect() -> GrpcChannel:
            address = self.worker_grpc.port.getHost()
            host = "127.0.0.1" if address.host in ("0.0.0.0", "::", "") else address.host
            config = GrpcConfig(client_side=True, max_receive_message_length=self.config.max_message_size)
            return GrpcChannel(self.reactor, client_endpoint(self.reactor, host, address.port), config)

        core = EngineAgentCore(AgentConfig(engine_id="builtin-echo", models=self.config.echo_models))
        runtime = EchoRuntime(self.reactor, EchoConfig(token_delay=self.config.echo_token_delay))
        return EngineAgent(self.reactor, core, runtime, connect,
                           key=key, grace=self.config.grace_period)

    def _worker_listening(self) -> None:
        if self.builtin_engine is not None:
            self.builtin_engine.startService()
        if self.scaler is not None:
            self.scaler_link.start()

    def _http_listening(self) -> None:
        self.gateway.listening = True

    @defer.inlineCallbacks
    def stopService(self) -> Any:
        """Graceful shutdown: unready, go-away to engines, drain within the grace period, stop."""
        self.gateway.shutting_down = True
        self.workers.accepting = False
        self.dispatcher.go_away()
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
        yield defer.maybeDeferred(service.MultiService.stopService, self)


    # --- task exchange between gateway replicas (infx/exchanger.py) ----------

    def _build_exchange(self, pod_name: str) -> None:
        """The internal gRPC server on ``internal_grpc`` and the exchanger; peers are dialled once it listens."""
        config = self.config
        self.internal_server = GrpcServer(self.reactor, GrpcConfig(
            client_side=False,
            max_receive_message_length=config.max_message_size,
            max_send_message_length=config.max_message_size,
        ))
        self.exchanger = Exchanger(
            self.reactor, self.dispatcher,
            ExchangerConfig(pod_name=pod_name, status_interval=config.status_interval, secret=config.internal_secret),
            self._peer_source, self._peer_channel,
        )
        self.exchanger.register(self.internal_server)
        # --internal-tls-*: TLS requiring a client certificate from the internal CA, on the same endpoint;
        # the files are read again as connections come, to pick up a rotation.
        credentials = internal_tls(config)
        self.peer_tls: Any = None
        listening_factory: Any = self.internal_server
        if credentials is not None:
            from infx.peer_tls import PeerTLS

            self.peer_tls = PeerTLS(self.reactor, credentials)
            listening_factory = self.peer_tls.server_factory(self.reactor, self.internal_server)
        self.internal_grpc = _ListeningService(self.reactor, config.internal_grpc, listening_factory,
                                               on_listening=self.exchanger.start)
        self.internal_grpc.setServiceParent(self)

    def _default_pod_name(self) -> str:
        """``POD_NAME``; else ``ADDRESS:PORT`` of the internal listen endpoint, which is what
        static peers dial, with the host name standing in for a wildcard address."""
        if self.environ.get("POD_NAME"):
            return self.environ["POD_NAME"]
        interface = re.search(r"(?:^|:)interface=([^:]+)", self.config.internal_grpc)
        host = interface.group(1) if interface else ""
        if host in ("", "0.0.0.0", "::"):
            host = socket.gethostname()
        try:
            return f"{host}:{self.config.effective_peer_port}"
        except ConfigError:  # an endpoint without a port number (unix:...)
            return host

    def _peer_source(self, on_change: Callable[[PeerChange], None]) -> Any:
        """Static ``--peers``, or with ``--kube`` the pod watcher (in-cluster config or ``KUBECONFIG``)."""
        from infx.kube import StaticPeers

        if not self.config.kube:
            return StaticPeers(self.config.peers, on_change)
        from kubernetes import client

        from infx.kube import PodWatcher, PodWatcherConfig, kube_api_client

        watcher_config = PodWatcherConfig.from_environment(self.config.pod_label, self.config.effective_peer_port,
                                                           environ=self.environ)
        api = client.CoreV1Api(kube_api_client(self.environ))
        return PodWatcher(self.reactor, api, watcher_config, on_change)

    def _peer_channel(self, address: PeerAddress) -> GrpcChannel:
        from infx.transport import client_endpoint

        config = GrpcConfig(client_side=True, max_receive_message_length=self.config.max_message_size,
                            max_send_message_length=self.config.max_message_size)
        endpoint = client_endpoint(self.reactor, address.host, address.port)
        if self.peer_tls is not None:
            endpoint = self.peer_tls.client_endpoint(self.reactor, endpoint)
        return GrpcChannel(self.reactor, endpoint, config)


def _sleep(reactor: Any, seconds: float) -> Deferred[None]:
    d: Deferred[None] = Deferred()
    reactor.callLater(seconds, d.callback, None)
    return d


def build_gateway(reactor: Any, config: GatewayConfig, registry: CollectorRegistry | None = None) -> GatewayService:
    """The gateway as an ``IService``, for ``twistd infx`` or an embedding application."""
    return GatewayService(reactor, config, registry)
