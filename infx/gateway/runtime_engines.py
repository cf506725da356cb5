"""Runtimes by URL: the gateway serves OpenAI-compatible runtimes it reaches itself, no agent in between.

Each runtime (given with ``--runtime-url``, or a pod ``--runtime-pod-label``
picks, :mod:`protocol.discovery.runtimes`) gets a :class:`RuntimeEngine`: the
engine agent of ``twistd infx-engine --runtime openai`` run in this process
(its pure core, the ``openai`` runtime on the lean client of
:mod:`infx.agent.runtime_client`, its health check and its load scrapes),
whose streams are routes of this gateway's own processor
(:mod:`infx.gateway.in_process`). Its engine is a local engine like any
other: routing, fair queues, the exchange (peers see it and send it tasks),
the scaler, metrics and ``/admin/status`` treat it so; only no gRPC hop
and no encoding lie between the gateway and the runtime's connection.

Engine ids are this gateway's: ``runtime-NAME-POD``, ``NAME`` being the
runtime's ``HOST:PORT`` (a static URL) or its pod's name, ``POD`` this
gateway's pod, so that every gateway serving one runtime has an engine of
its own id for it, as with the built-in echo engine.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Any, Callable
from urllib.parse import urlsplit

from twisted.application.service import Service
from twisted.internet.defer import Deferred, DeferredList, succeed
from twisted.logger import Logger
from twisted.web.client import Agent

import infx
from infx.agent.engine import AgentServices, EngineAgent
from infx.agent.runtime_client import RuntimeClient
from infx.agent.runtime_load_watch import ReadWhenReady, RuntimeLoadWatch, scrape_pool
from infx.agent.runtime_watch import RuntimeWatch, check_pool
from infx.agent.runtimes import CAPABILITIES, OpenAIRuntime, Runtime
from infx.agent.slot_keeping import SlotKeepingRuntime
from infx.agent.upstream_key import UpstreamKey
from infx.gateway.dispatcher import Dispatcher
from infx.gateway.in_process import InProcessLinks
from protocol.agent.core import EngineAgentCore
from protocol.agent.effects import AgentConfig
from protocol.agent.runtime_health import HealthConfig, RuntimeHealth
from protocol.agent.runtime_load import LoadConfig, RuntimeLoadMonitor
from protocol.discovery.runtimes import RuntimeAdded, RuntimeChange, RuntimeTarget

__all__ = ["RuntimeEngine", "RuntimeEngines", "RuntimeSettings", "runtime_engine_id"]

log = Logger(namespace="infx.gateway.runtime_engines")


@dataclass(frozen=True)
class RuntimeSettings:
    """What every runtime by URL of this gateway shares (the ``--runtime-*`` options)."""

    tenant: str = "default"
    max_concurrency: int = 32
    api_key_file: str | None = None
    #: Seconds its tasks get to finish when the runtime leaves or the gateway stops.
    grace: float = 30.0
    #: Each runtime's slots kept for conversations in up to this many files (``--runtime-slot-files``,
    #: :mod:`infx.agent.slot_keeping`); 0: not kept.
    slot_files: int = 0
    health: HealthConfig = HealthConfig()
    load: LoadConfig | None = LoadConfig()
    #: Capabilities beyond the runtime's own: under ``--workers`` every worker runs its runtimes by
    #: URL and says so (``in-every-worker``), so none forwards to a sibling what it can send itself.
    capabilities: tuple[str, ...] = ()
    #: The gateway's tracer when tracing is on (:class:`infx.tracing.spans.Tracing`): each task gets the
    #: agent's spans, and the runtime's request its ``traceparent`` (:mod:`infx.tracing.runtime`).
    tracing: Any = None


def runtime_engine_id(name: str, pod_name: str) -> str:
    """The engine id, on the gateway ``pod_name``, of the runtime named ``name`` (``HOST:PORT`` or a pod)."""
    return f"runtime-{name}-{pod_name}"


class _Closer(Service):
    """Closes an HTTP client's connections when its runtime engine stops."""

    def __init__(self, close: Callable[[], Deferred[None]]) -> None:
        self.close = close

    def stopService(self) -> Deferred[None]:
        super().stopService()
        return self.close()


class RuntimeEngine(AgentServices):
    """One runtime served by URL: the engine agent in process with its health check and load scrapes;
    stopping it drains the engine first, then closes its connections."""

    def __init__(self, reactor: Any, dispatcher: Dispatcher, target: RuntimeTarget, name: str, engine_id: str,
                 settings: RuntimeSettings) -> None:
        """``name``: the runtime's, the same on every gateway and worker that serves it
        (``EngineStatus.infx_runtime_name``); ``engine_id``: its engine's here."""
        self.target = target
        credentials = UpstreamKey(reactor, path=settings.api_key_file) if settings.api_key_file else None
        # One kept-alive connection per running task at most (the core runs max_concurrency).
        client = RuntimeClient(reactor, target.url, connect_timeout=10, max_idle=settings.max_concurrency)
        self.runtime = OpenAIRuntime(reactor, client, target.url, credentials=credentials)
        core = EngineAgentCore(AgentConfig(
            engine_id=engine_id, models=target.models, max_concurrency=settings.max_concurrency,
            wait_for_runtime=True, capabilities=CAPABILITIES + settings.capabilities, instance=secrets.token_hex(8),
            runtime_kind="openai", agent_version=infx.__version__, runtime_name=name))
        runtime: Runtime = self.runtime
        kept = None
        if settings.slot_files:
            kept = runtime = SlotKeepingRuntime(self.runtime, settings.slot_files, engine_id)
        if settings.tracing is not None:
            from infx.tracing.runtime import TracedRuntime

            runtime = TracedRuntime(self.runtime, settings.tracing, engine_id, self.runtime.root)
        super().__init__(EngineAgent(reactor, core, runtime,
                                     InProcessLinks(reactor, dispatcher, settings.tenant, self.runtime.root),
                                     grace=settings.grace))
        if kept is not None:
            kept.report = self.agent.slot_keeping_changed
            kept.changed()
        _Closer(client.close).setServiceParent(self)
        checks = check_pool(reactor)
        _Closer(checks.closeCachedConnections).setServiceParent(self)
        health = HealthConfig(interval=settings.health.interval, down_interval=settings.health.down_interval,
                              timeout=settings.health.timeout, list_models=not target.models)
        watch = RuntimeWatch(reactor, RuntimeHealth(health), Agent(reactor, pool=checks, connectTimeout=5),
                             self.runtime, self.agent.runtime_changed)
        watch.identified = self.agent.runtime_identified
        watch.setServiceParent(self)
        if settings.load is not None:
            scrapes = scrape_pool(reactor)
            _Closer(scrapes.closeCachedConnections).setServiceParent(self)
            load = RuntimeLoadWatch(reactor, RuntimeLoadMonitor(settings.load),
                                    Agent(reactor, pool=scrapes, connectTimeout=5), self.runtime.root,
                                    self.agent.runtime_load_changed, authorize=self.runtime.authorize,
                                    refused=credentials.refused if credentials is not None else None,
                                    sample=self.agent.core.load_sample)
            load.setServiceParent(self)
            watch.changed = ReadWhenReady(self.agent.runtime_changed, load)
        self.agent.setServiceParent(self)

    @property
    def engine_id(self) -> str:
        return self.agent.engine_id


class RuntimeEngines:
    """This gateway's runtimes by URL: those configured, and those pod discovery finds.

    ``pod_name`` scopes engine ids (:func:`runtime_engine_id`); ``discover(on_change)``, if
    given, returns a started-on-:meth:`start` source of
    :data:`~protocol.discovery.runtimes.RuntimeChange` (the runtime pod watcher).
    """

    def __init__(self, reactor: Any, dispatcher: Dispatcher, pod_name: str, settings: RuntimeSettings,
                 targets: tuple[RuntimeTarget, ...] = (),
                 discover: Callable[[Callable[[RuntimeChange], None]], Any] | None = None) -> None:
        self.reactor = reactor
        self.dispatcher = dispatcher
        self.pod_name = pod_name
        self.settings = settings
        self.targets = targets
        #: Serving, by runtime name (``HOST:PORT`` of a static URL, or the pod's name).
        self.engines: dict[str, RuntimeEngine] = {}
        #: Runtimes removed whose engines are still draining, by name.
        self._leaving: dict[str, Deferred[None]] = {}
        self._source = discover(self._discovered) if discover is not None else None
        self.running = False

    def start(self) -> None:
        """Serve the configured runtimes and start discovering the others."""
        self.running = True
        for target in self.targets:
            self._add(urlsplit(target.url).netloc, target)
        if self._source is not None:
            self._source.start()

    def drain(self) -> Deferred[None]:
        """Shutdown: every engine stops taking tasks and lets those in flight finish (each within
        the grace period); fires once all are stopped."""
        self.running = False
        stopping: list[Deferred[Any]] = []
        if self._source is not None:
            stopping.append(self._source.stop())
        for name in list(self.engines):
            self._remove(name)
        stopping.extend(self._leaving.values())
        if not stopping:
            return succeed(None)
        done: Deferred[Any] = DeferredList(stopping)
        return done.addCallback(lambda _: None)

    def _discovered(self, change: RuntimeChange) -> None:
        if not self.running:
            return
        if isinstance(change, RuntimeAdded):
            self._add(change.name, change.target)
        else:
            self._remove(change.name)

    def _add(self, name: str, target: RuntimeTarget) -> None:
        leaving = self._leaving.get(name)
        if leaving is not None:
            # A pod served anew (its address or models changed): its new engine has the old one's id,
            # which the processor would refuse while the old one drains.
            leaving.addBoth(lambda result: (self._add_if_wanted(name, target), result)[1])
            return
        engine = RuntimeEngine(self.reactor, self.dispatcher, target, name, runtime_engine_id(name, self.pod_name),
                               self.settings)
        self.engines[name] = engine
        log.info("serving the runtime at {url} as engine {engine_id} (models: {models})", url=engine.runtime.root,
                 engine_id=engine.engine_id, models=", ".join(target.models) or "those it lists",
                 event="runtime_added")
        engine.startService()

    def _add_if_wanted(self, name: str, target: RuntimeTarget) -> None:
        """Serve ``target`` as ``name`` once its old engine left, unless discovery moved on meanwhile."""
        if self.running and name not in self.engines and self._source is not None \
                and self._source.targets.get(name) == target:
            self._add(name, target)

    def _remove(self, name: str) -> None:
        engine = self.engines.pop(name)
        log.info("no longer serving the runtime at {url} (engine {engine_id}): it drains", url=engine.runtime.root,
                 engine_id=engine.engine_id, event="runtime_removed")
        stopped = engine.stopService()
        self._leaving[name] = stopped

        def left(result: Any) -> Any:
            if self._leaving.get(name) is stopped:
                del self._leaving[name]
            return result

        stopped.addBoth(left)
