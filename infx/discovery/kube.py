"""The Kubernetes informer's one adapter, and peer discovery on it (pods watched, or a static list).

The Twisted side of :mod:`protocol.discovery.informer` and :mod:`protocol.discovery.peers`.
:class:`KubeInformer` is the one adapter of the pure list-then-watch machine
(peer discovery and the scaler both use it): the official ``kubernetes``
client blocks, so each of its requests runs in the informer's own one-thread
pool (never the reactor's shared pool, which a long watch would starve);
watch events are handed back with ``callFromThread`` and every decision is
made on the reactor thread by the pure machines. Backoff timers use the
injected clock.
"""

from __future__ import annotations

import json
import os
import random
import threading
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any, Callable, Generic, Iterable, Mapping, Protocol, TypeVar, cast

import yaml
from kubernetes import client, config
from kubernetes.client.exceptions import ApiException
from twisted.application.service import Service
from twisted.internet import defer
from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.internet.threads import deferToThreadPool
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.python.threadpool import ThreadPool

from infx.config import ConfigError
from infx.deadline import DeadlineTimer
from protocol.backoff import Backoff
from protocol.discovery.informer import (
    WATCH_BACKOFF,
    CacheEvent,
    Effect,
    Informer,
    InformerState,
    ListRequested,
    MalformedWatchObject,
    WatchErrorReceived,
    WatchEvent,
    WatchRequested,
    object_mapping,
    parse_watch_event,
)
from protocol.discovery.runtimes import (
    RuntimeChange,
    RuntimePod,
    RuntimeSet,
    RuntimeTarget,
    runtime_pod,
    runtime_pod_key,
    runtime_pod_version,
)
from protocol.discovery.peers import (
    PeerAdded,
    PeerAddress,
    PeerChange,
    PeerSet,
    PodState,
    parse_peer_address,
    pod_key,
    pod_state,
    pod_version,
)

__all__ = [
    "InformerConfig",
    "KubeInformer",
    "PeerSource",
    "PeerSourceService",
    "PodWatcher",
    "PodWatcherConfig",
    "RuntimePodWatcher",
    "StaticPeers",
    "WatchFailed",
    "kube_api_client",
]

log = Logger(namespace="infx.kube")

T = TypeVar("T")

SERVICE_ACCOUNT_NAMESPACE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"


class ThreadingClock(Protocol):
    """What the watcher needs of a reactor: time, timers, and a way back from threads."""

    def seconds(self) -> float: ...

    def callLater(self, delay: float, callable: Callable[..., Any], *args: Any, **kw: Any) -> IDelayedCall: ...

    def callFromThread(self, callable: Callable[..., Any], *args: Any, **kw: Any) -> None: ...


class PeerSource(Protocol):
    """Where the exchanger learns its peers: ``on_change`` (given at construction) gets every change."""

    @property
    def peers(self) -> Mapping[str, PeerAddress]: ...

    def start(self) -> None: ...

    def stop(self) -> defer.Deferred[None]: ...


class WatchFailed(Exception):
    """The API server ended a watch with an ERROR event; ``code`` is its HTTP status."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(f"watch failed with {code}: {message}")
        self.code = code


@dataclass(frozen=True)
class InformerConfig:
    """One collection to list and watch, and how patiently.

    ``what`` names the collection in logs and thread names (``pods``).
    ``watch_timeout`` is the ``timeoutSeconds`` asked of the API server: a
    watch is re-opened from the last resourceVersion at least that often.
    ``request_timeout`` bounds lists and connects, so stopping never waits
    longer than that for a list.
    """

    what: str
    namespace: str
    label_selector: str | None = None
    watch_timeout: int = 60
    request_timeout: float = 10.0
    backoff: Backoff = WATCH_BACKOFF

    def __post_init__(self) -> None:
        if self.watch_timeout < 1:
            raise ValueError("watch_timeout is a whole number of seconds, at least 1")


@dataclass(frozen=True)
class PodWatcherConfig:
    """What to watch and how patiently.

    ``namespace``, ``label_selector`` (``key=value``, from ``--pod-label``) and
    ``own_pod_name`` (``POD_NAME``, skipped) choose the pods; peers are dialled
    at their pod IP and ``peer_port``. ``watch_timeout`` is the
    ``timeoutSeconds`` asked of the API server: a watch is re-opened from the
    last resourceVersion at least that often. ``request_timeout`` bounds lists
    and connects, so stopping never waits longer than that for a list.
    """

    namespace: str
    label_selector: str
    own_pod_name: str | None
    peer_port: int
    watch_timeout: int = 60
    request_timeout: float = 10.0
    backoff: Backoff = WATCH_BACKOFF

    def __post_init__(self) -> None:
        if self.watch_timeout < 1:
            raise ValueError("watch_timeout is a whole number of seconds, at least 1")
        if not 0 < self.peer_port < 65536:
            raise ValueError("peer_port is out of range")

    @classmethod
    def from_environment(
        cls,
        label_selector: str,
        peer_port: int,
        environ: Mapping[str, str] | None = None,
        **options: Any,
    ) -> PodWatcherConfig:
        """Read ``POD_NAME`` and ``NAMESPACE`` (else the service account's namespace, else "default")."""
        environ = os.environ if environ is None else environ
        namespace = environ.get("NAMESPACE")
        if not namespace:
            try:
                with open(SERVICE_ACCOUNT_NAMESPACE) as f:
                    namespace = f.read().strip()
            except OSError:
                namespace = "default"
        return cls(namespace=namespace, label_selector=label_selector,
                   own_pod_name=environ.get("POD_NAME") or None, peer_port=peer_port, **options)


def kube_api_client(environ: Mapping[str, str] | None = None) -> client.ApiClient:
    """An API client from in-cluster settings when running in a pod, else from ``KUBECONFIG``.

    Each call builds its own ``Configuration``; the client library's global
    default is left alone.
    """
    environ = os.environ if environ is None else environ
    configuration = client.Configuration()
    try:
        if environ.get("KUBERNETES_SERVICE_HOST"):
            config.load_incluster_config(client_configuration=configuration)  # type: ignore[no-untyped-call]
        else:
            config.load_kube_config(  # type: ignore[no-untyped-call]
                config_file=environ.get("KUBECONFIG") or None, client_configuration=configuration)
    except (config.ConfigException, yaml.YAMLError, OSError, ValueError, TypeError, AttributeError) as e:
        # The client library's messages for a missing or malformed config (a mapping
        # file that is not a kubeconfig raises the last three).
        where = ("in-cluster settings (KUBERNETES_SERVICE_HOST and the service account)"
                 if environ.get("KUBERNETES_SERVICE_HOST") else environ.get("KUBECONFIG") or "~/.kube/config")
        raise ConfigError(f"--kube: no usable Kubernetes client config from {where}: {_one_line(e)}") from None
    return client.ApiClient(configuration)


def _one_line(error: BaseException) -> str:
    text = " ".join(str(error).split())
    return text or type(error).__name__


class KubeInformer(Generic[T]):
    """Drives one :class:`~protocol.discovery.informer.Informer` against the API server with the official client.

    ``list_call`` is a ``list_namespaced_*`` method of a client API object
    (``CoreV1Api.list_namespaced_pod``, ``AppsV1Api.list_namespaced_deployment``);
    ``decode`` reads one object of the collection as JSON (raising
    :class:`~protocol.discovery.informer.MalformedWatchObject` on garbage). The
    blocking calls run in this informer's own one-thread pool (never the
    reactor's shared pool, which a long watch would starve); watch events come
    back with ``callFromThread``, and ``on_events`` gets the cache's changes on
    the reactor thread. After :meth:`stop` it is never called again.
    """

    def __init__(
        self,
        reactor: ThreadingClock,
        list_call: Callable[..., Any],
        decode: Callable[[Mapping[str, Any]], T],
        key: Callable[[T], Hashable],
        version: Callable[[T], str | None],
        on_events: Callable[[list[CacheEvent[T]]], None],
        config: InformerConfig,
        rng: random.Random,
    ) -> None:
        self._reactor = reactor
        self._list_call = list_call
        self._decode = decode
        self._on_events = on_events
        self._config = config
        self._machine: Informer[T] = Informer(key, version, config.backoff, rng)
        self._pool = ThreadPool(minthreads=0, maxthreads=1, name=f"infx-kube-{config.what}-{config.namespace}")
        self._in_flight: defer.Deferred[Any] | None = None
        self._timer = DeadlineTimer(cast(IReactorTime, reactor), self._timer_fired)  # a ThreadingClock is one
        self._stopped: list[defer.Deferred[None]] = []
        # Shared with the pool thread: the open watch response, so stop() can unblock its read.
        self._lock = threading.Lock()
        self._stopping = False
        self._response: Any = None

    @property
    def objects(self) -> Mapping[Hashable, T]:
        """The cache, by key."""
        return self._machine.objects

    @property
    def state(self) -> InformerState:
        return self._machine.state

    @property
    def resource_version(self) -> str | None:
        """Where the next watch resumes (None until listed, and after a 410)."""
        return self._machine.resource_version

    def start(self) -> None:
        self._pool.start()
        log.info("watching {what} in {namespace} with {selector!r}", what=self._config.what,
                 namespace=self._config.namespace, selector=self._config.label_selector)
        self._perform(self._machine.start())

    def stop(self) -> defer.Deferred[None]:
        """Stop at once for callbacks; the Deferred fires when the pool thread has returned.

        Idempotent. A blocked watch read is unblocked at once; a list in
        flight finishes within ``request_timeout``.
        """
        self._machine.stop()
        self._timer.cancel()
        with self._lock:
            self._stopping = True
            response = self._response
        if response is not None:
            _shutdown(response)
        if self._in_flight is None:
            if self._pool.started:
                self._pool.stop()
            return defer.succeed(None)
        d: defer.Deferred[None] = defer.Deferred()
        self._stopped.append(d)
        return d

    # --- reactor thread --------------------------------------------------------------

    def _perform(self, effects: list[Effect[T]]) -> None:
        """Start the request the machine asks for, hand its cache changes on, arm its deadline."""
        changes: list[CacheEvent[T]] = []
        for effect in effects:
            if isinstance(effect, ListRequested):
                self._run(self._list_blocking).addCallbacks(self._listed, self._failed)
            elif isinstance(effect, WatchRequested):
                self._run(self._watch_blocking, effect.resource_version).addCallbacks(
                    self._watch_ended, self._failed)
            else:
                changes.append(effect)
        if changes:
            try:
                self._on_events(changes)
            except Exception:
                log.failure("on_events raised for {what}", what=self._config.what)
        deadline = self._machine.next_deadline()
        if deadline is not None:
            log.info("retrying the {what} watch in {delay:.2f}s", what=self._config.what,
                     delay=max(0.0, deadline - self._reactor.seconds()))
        self._timer.arm(deadline)

    def _run(self, f: Callable[..., Any], *args: Any) -> defer.Deferred[Any]:
        d = deferToThreadPool(self._reactor, self._pool, f, *args)  # type: ignore[arg-type]
        self._in_flight = d

        def landed(result: Any) -> Any:
            self._in_flight = None
            if self._machine.state is InformerState.STOPPED:
                if self._pool.started:
                    self._pool.stop()
                waiters, self._stopped[:] = list(self._stopped), []
                for waiter in waiters:
                    waiter.callback(None)
                return None  # a late result after stop() is dropped
            return result

        d.addBoth(landed)
        return d

    def _timer_fired(self) -> None:
        self._perform(self._machine.handle_timeout(self._reactor.seconds()))

    def _listed(self, result: tuple[list[T], str] | None) -> None:
        if result is None:
            return
        objects, rv = result
        log.info("listed {count} {what} at resourceVersion {rv}", count=len(objects), what=self._config.what,
                 rv=rv)
        self._perform(self._machine.listed(objects, rv))

    def _event_received(self, event: WatchEvent[T]) -> None:
        if self._machine.state is InformerState.WATCHING:
            self._perform(self._machine.event_received(event))

    def _watch_ended(self, result: None) -> None:
        if self._machine.state is not InformerState.WATCHING:
            return
        self._perform(self._machine.watch_ended())

    def _failed(self, failure: Failure) -> None:
        if self._machine.state not in (InformerState.LISTING, InformerState.WATCHING):
            return
        error = failure.value
        status: int | None = None
        if isinstance(error, ApiException):
            status = error.status
        elif isinstance(error, WatchFailed):
            status = error.code
        log.warn("{kind} {what} failed ({status}): {error}", kind=self._config.what,
                 what=self._machine.state.value, status=status, error=error)
        self._perform(self._machine.failed(status, self._reactor.seconds()))

    # --- pool thread -----------------------------------------------------------------

    def _list_blocking(self) -> tuple[list[T], str]:
        response = self._list_call(
            self._config.namespace,
            label_selector=self._config.label_selector or None,
            _preload_content=False,
            _request_timeout=self._config.request_timeout,
        )
        try:
            raw = json.loads(response.data)
        except ValueError as error:
            raise MalformedWatchObject(f"bad list body: {error}") from None
        raw = object_mapping(raw, "list body")
        rv = object_mapping(raw.get("metadata"), "list metadata").get("resourceVersion")
        if not isinstance(rv, str):
            raise MalformedWatchObject(f"{self._config.what} list without metadata.resourceVersion")
        items = raw.get("items") or []
        if not isinstance(items, list):
            raise MalformedWatchObject(f"{self._config.what} list items is not a list")
        return [self._decode(object_mapping(item, "list item")) for item in items], rv

    def _watch_blocking(self, resource_version: str) -> None:
        """One watch request, its events handed to the reactor, until it ends or breaks."""
        response: Any = self._list_call(
            self._config.namespace,
            label_selector=self._config.label_selector or None,
            watch=True,
            resource_version=resource_version,
            allow_watch_bookmarks=True,
            timeout_seconds=self._config.watch_timeout,
            _preload_content=False,
            _request_timeout=(self._config.request_timeout,
                              self._config.watch_timeout + self._config.request_timeout),
        )
        with self._lock:
            if self._stopping:
                response.close()
                return
            self._response = response
        try:
            for line in _lines(response):
                try:
                    event = parse_watch_event(json.loads(line), self._decode)
                except ValueError as error:
                    raise MalformedWatchObject(f"bad watch event: {error}") from None
                if isinstance(event, WatchErrorReceived):
                    raise WatchFailed(event.code, event.message)
                self._reactor.callFromThread(self._event_received, event)
        finally:
            with self._lock:
                self._response = None
            response.close()


class PodWatcher:
    """Keeps ``on_change`` told of the live peer pods: a pod :class:`KubeInformer` and a :class:`PeerSet`.

    ``api`` is a ``kubernetes.client.CoreV1Api``. ``on_change`` runs on the
    reactor thread, once per :data:`~protocol.discovery.peers.PeerChange`; after
    :meth:`stop` it is never called again. ``rng`` jitters the backoff.
    """

    def __init__(
        self,
        reactor: ThreadingClock,
        api: client.CoreV1Api,
        config: PodWatcherConfig,
        on_change: Callable[[PeerChange], None],
        rng: random.Random,
    ) -> None:
        self._on_change = on_change
        self._peers = PeerSet(config.own_pod_name, config.peer_port)
        self._informer: KubeInformer[PodState] = KubeInformer(
            reactor, api.list_namespaced_pod, pod_state, pod_key, pod_version, self._cache_changed,
            InformerConfig("pods", config.namespace, config.label_selector, config.watch_timeout,
                           config.request_timeout, config.backoff), rng)

    @property
    def peers(self) -> Mapping[str, PeerAddress]:
        return self._peers.peers

    @property
    def state(self) -> InformerState:
        return self._informer.state

    @property
    def resource_version(self) -> str | None:
        """Where the next watch resumes (None until listed, and after a 410)."""
        return self._informer.resource_version

    def start(self) -> None:
        self._informer.start()

    def stop(self) -> defer.Deferred[None]:
        """See :meth:`KubeInformer.stop`."""
        return self._informer.stop()

    def _cache_changed(self, events: list[CacheEvent[PodState]]) -> None:
        for event in events:
            for change in self._peers.cache_changed(event):
                log.info("peer change: {change}", change=change)
                try:
                    self._on_change(change)
                except Exception:
                    log.failure("on_change raised for {change}", change=change)


class RuntimePodWatcher:
    """Keeps ``on_change`` told of the runtimes to serve by URL: a pod :class:`KubeInformer` over
    the pods ``label_selector`` picks in ``namespace``, and a :class:`~protocol.discovery.runtimes.RuntimeSet`
    serving each live one on ``port``. ``on_change`` runs on the reactor thread; never after :meth:`stop`."""

    def __init__(self, reactor: ThreadingClock, api: client.CoreV1Api, namespace: str, label_selector: str,
                 port: int, on_change: Callable[[RuntimeChange], None], rng: random.Random,
                 watch_timeout: int = 60, request_timeout: float = 10.0, backoff: Backoff = WATCH_BACKOFF) -> None:
        self._on_change = on_change
        self._runtimes = RuntimeSet(port)
        self._informer: KubeInformer[RuntimePod] = KubeInformer(
            reactor, api.list_namespaced_pod, runtime_pod, runtime_pod_key, runtime_pod_version, self._cache_changed,
            InformerConfig("runtime-pods", namespace, label_selector, watch_timeout, request_timeout, backoff), rng)

    @property
    def state(self) -> InformerState:
        return self._informer.state

    @property
    def targets(self) -> Mapping[str, RuntimeTarget]:
        """The runtimes to serve now, by pod name."""
        return self._runtimes.targets

    def start(self) -> None:
        self._informer.start()

    def stop(self) -> defer.Deferred[None]:
        """See :meth:`KubeInformer.stop`."""
        return self._informer.stop()

    def _cache_changed(self, events: list[CacheEvent[RuntimePod]]) -> None:
        for event in events:
            for change in self._runtimes.cache_changed(event):
                log.info("runtime change: {change}", change=change)
                try:
                    self._on_change(change)
                except Exception:
                    log.failure("on_change raised for {change}", change=change)


def _lines(response: Any) -> Iterable[bytes]:
    """The non-empty lines of a streamed body, each yielded as soon as it is complete."""
    buffer = bytearray()
    for chunk in response.stream(amt=None, decode_content=False):
        buffer += chunk
        *complete, rest = buffer.split(b"\n")
        buffer = bytearray(rest)
        yield from (bytes(line) for line in complete if line.strip())


def _shutdown(response: Any) -> None:
    """Unblock the pool thread's read of a watch response (urllib3 >= 2.3)."""
    try:
        response.shutdown()
    except (ValueError, RuntimeError, OSError):
        pass  # already released or closed: the thread is on its way out anyway


class StaticPeers:
    """Peers from ``--peers HOST:PORT,...``: all added at start, never changed."""

    def __init__(self, addresses: Iterable[str], on_change: Callable[[PeerChange], None]) -> None:
        parsed = [parse_peer_address(a) for a in addresses]
        self._peers = {str(address): address for address in parsed}
        self._on_change = on_change
        self._started = False

    @property
    def peers(self) -> Mapping[str, PeerAddress]:
        return dict(self._peers) if self._started else {}

    def start(self) -> None:
        self._started = True
        for name, address in self._peers.items():
            self._on_change(PeerAdded(name, address))

    def stop(self) -> defer.Deferred[None]:
        self._started = False
        return defer.succeed(None)


class PeerSourceService(Service):
    """Runs a :class:`PeerSource` as part of a service tree; stopping waits for its thread."""

    def __init__(self, source: PeerSource) -> None:
        self.source = source

    def startService(self) -> None:
        super().startService()  # type: ignore[no-untyped-call]
        self.source.start()

    def stopService(self) -> defer.Deferred[None]:
        super().stopService()  # type: ignore[no-untyped-call]
        return self.source.stop()
