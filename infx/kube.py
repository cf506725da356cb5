"""Peer discovery for the task exchanger: pods watched through the Kubernetes API, or a static list.

The Twisted side of :mod:`protocol.peers`. The official ``kubernetes`` client
blocks, so each of its requests runs in this watcher's own one-thread pool
(never the reactor's shared pool, which a long watch would starve); watch
events are handed back with ``callFromThread`` and every decision is made on
the reactor thread by the pure :class:`~protocol.peers.PodWatch` machine.
Backoff timers use the injected clock.
"""

from __future__ import annotations

import json
import os
import random
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Protocol

import yaml
from kubernetes import client, config
from kubernetes.client.exceptions import ApiException
from twisted.application.service import Service
from twisted.internet import defer
from twisted.internet.interfaces import IDelayedCall
from twisted.internet.threads import deferToThreadPool
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.python.threadpool import ThreadPool

from infx.config import ConfigError
from protocol.peers import (
    Backoff,
    MalformedWatchObject,
    PeerAdded,
    PeerAddress,
    PeerChange,
    PodState,
    PodWatch,
    WatchErrorReceived,
    WatchEvent,
    WatchState,
    parse_peer_address,
    parse_watch_event,
    pod_state,
)

__all__ = [
    "PeerSource",
    "PeerSourceService",
    "PodWatcher",
    "PodWatcherConfig",
    "StaticPeers",
    "WatchFailed",
    "kube_api_client",
]

log = Logger()

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
    backoff: Backoff = field(default_factory=Backoff)

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


class PodWatcher:
    """Keeps ``on_change`` told of the live peer pods, by list-then-watch on the API server.

    ``api`` is a ``kubernetes.client.CoreV1Api``. ``on_change`` runs on the
    reactor thread, once per :data:`~protocol.peers.PeerChange`; after
    :meth:`stop` it is never called again.
    """

    def __init__(
        self,
        reactor: ThreadingClock,
        api: client.CoreV1Api,
        config: PodWatcherConfig,
        on_change: Callable[[PeerChange], None],
        rng: random.Random | None = None,
    ) -> None:
        self._reactor = reactor
        self._api = api
        self._config = config
        self._on_change = on_change
        self._machine = PodWatch(config.own_pod_name, config.peer_port, config.backoff, rng)
        self._pool = ThreadPool(minthreads=0, maxthreads=1, name=f"infx-kube-{config.namespace}")
        self._in_flight: defer.Deferred[None] | None = None
        self._timer: Any = None  # an IDelayedCall
        self._stopped: list[defer.Deferred[None]] = []
        # Shared with the pool thread: the open watch response, so stop() can unblock its read.
        self._lock = threading.Lock()
        self._stopping = False
        self._response: Any = None

    @property
    def peers(self) -> Mapping[str, PeerAddress]:
        return self._machine.peers.peers

    @property
    def state(self) -> WatchState:
        return self._machine.state

    @property
    def resource_version(self) -> str | None:
        """Where the next watch resumes (None until listed, and after a 410)."""
        return self._machine.resource_version

    def start(self) -> None:
        self._pool.start()
        self._machine.start()
        log.info("watching pods in {namespace} with {selector!r}",
                 namespace=self._config.namespace, selector=self._config.label_selector)
        self._drive()

    def stop(self) -> defer.Deferred[None]:
        """Stop at once for callbacks; the Deferred fires when the watch thread has returned.

        Idempotent. A blocked watch read is unblocked at once; a list in
        flight finishes within ``request_timeout``.
        """
        self._machine.stop()
        if self._timer is not None and self._timer.active():
            self._timer.cancel()
        self._timer = None
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

    def _drive(self) -> None:
        """Start whatever the machine's state asks for, unless a request is already out."""
        state = self._machine.state
        if self._in_flight is not None or self._timer is not None:
            return
        if state is WatchState.LISTING:
            self._run(self._list_blocking).addCallbacks(self._listed, self._failed)
        elif state is WatchState.WATCHING:
            rv = self._machine.resource_version
            assert rv is not None
            self._run(self._watch_blocking, rv).addCallbacks(self._watch_ended, self._failed)
        elif state is WatchState.BACKING_OFF:
            deadline = self._machine.next_deadline()
            assert deadline is not None
            delay = max(0.0, deadline - self._reactor.seconds())
            log.info("retrying the pod watch in {delay:.2f}s", delay=delay)
            self._timer = self._reactor.callLater(delay, self._timer_fired)

    def _run(self, f: Callable[..., Any], *args: Any) -> defer.Deferred[Any]:
        d = deferToThreadPool(self._reactor, self._pool, f, *args)  # type: ignore[arg-type]
        self._in_flight = d

        def landed(result: Any) -> Any:
            self._in_flight = None
            if self._machine.state is WatchState.STOPPED:
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
        self._timer = None
        self._machine.handle_timer(self._reactor.seconds())
        self._drive()

    def _listed(self, result: tuple[list[PodState], str] | None) -> None:
        if result is None:
            return
        pods, rv = result
        self._emit(self._machine.listed(pods, rv))
        log.info("listed {count} pods at resourceVersion {rv}", count=len(pods), rv=rv)
        self._drive()

    def _event_received(self, event: WatchEvent) -> None:
        if self._machine.state is WatchState.WATCHING:
            self._emit(self._machine.event_received(event))

    def _watch_ended(self, result: None) -> None:
        if self._machine.state is not WatchState.WATCHING:
            return
        self._machine.watch_ended()
        self._drive()

    def _failed(self, failure: Failure) -> None:
        if self._machine.state not in (WatchState.LISTING, WatchState.WATCHING):
            return
        error = failure.value
        status: int | None = None
        if isinstance(error, ApiException):
            status = error.status
        elif isinstance(error, WatchFailed):
            status = error.code
        log.warn("pod {what} failed ({status}): {error}",
                 what=self._machine.state.value, status=status, error=error)
        self._machine.failed(self._reactor.seconds(), status)
        self._drive()

    def _emit(self, changes: list[PeerChange]) -> None:
        for change in changes:
            log.info("peer change: {change}", change=change)
            try:
                self._on_change(change)
            except Exception:
                log.failure("on_change raised for {change}", change=change)

    # --- pool thread -----------------------------------------------------------------

    def _list_blocking(self) -> tuple[list[PodState], str]:
        pod_list = self._api.list_namespaced_pod(
            self._config.namespace,
            label_selector=self._config.label_selector or None,
            _request_timeout=self._config.request_timeout,
        )
        raw = self._api.api_client.sanitize_for_serialization(pod_list)
        rv = (raw.get("metadata") or {}).get("resourceVersion")
        if not isinstance(rv, str):
            raise MalformedWatchObject("pod list without metadata.resourceVersion")
        return [pod_state(item) for item in raw.get("items") or []], rv

    def _watch_blocking(self, resource_version: str) -> None:
        """One watch request, its events handed to the reactor, until it ends or breaks."""
        response: Any = self._api.list_namespaced_pod(
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
                    event = parse_watch_event(json.loads(line))
                except ValueError as error:
                    raise MalformedWatchObject(f"bad watch event: {error}") from None
                if isinstance(event, WatchErrorReceived):
                    raise WatchFailed(event.code, event.message)
                self._reactor.callFromThread(self._event_received, event)
        finally:
            with self._lock:
                self._response = None
            response.close()


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
