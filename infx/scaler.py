"""The scaler on Twisted: performs :mod:`protocol.scaling`'s decisions against Kubernetes.

Scale engine deployments from zero when a request arrives (without losing
it), autoscale them from load measured in this process and reported by the
other gateways (started requests in the exchanger's status reports, tasks in
progress in the engines'), and take them to zero when idle. Every decision
is made by the pure :class:`protocol.scaling.Scaler`; this module owns the
timers (one ``callLater`` for the machine's deadline, a ``LoopingCall`` for
the autoscaler tick, both on an injected clock), the Kubernetes I/O (off the
reactor thread), leader election, Events and metrics.

The shape keeps OpenModelZ's recognisable: a :class:`ServiceQuery` protocol
(``get_replicas``/``set_replicas``) with an in-memory and a Kubernetes
implementation, and :meth:`InferenceScaler.scale` returning a
:class:`FunctionScaleResult` — but a held request ends available, or with a
503 and ``Retry-After``; never with a blind forward.
"""

from __future__ import annotations

import itertools
import json
import threading
from collections.abc import Callable, Hashable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily
from twisted.application import service
from twisted.internet import defer, threads
from twisted.internet.interfaces import IReactorTime
from twisted.internet.task import LoopingCall
from twisted.logger import Logger

from infx.deadline import DeadlineTimer
from protocol.scaling import (
    SCALABLE_LABEL,
    ColdStartFinished,
    DeploymentKey,
    Effect,
    FailHeld,
    HoldResolved,
    PostEvent,
    ScaleError,
    ScaleReason,
    Scaler,
    ScalerConfig,
    ScaleWrite,
    ScalingLocalError,
    ScalingRemoteError,
    ServiceQueryResponse,
    as_service_query_response,
    deployment_snapshot,
    pod_crash_reason,
)
from protocol.scaling_lease import decide_lease, micro_time, release_lease

T = TypeVar("T")

COLD_START_BUCKETS = (0.01, 0.1, 0.5, 1, 2.5, 5, 10, 20, 30, 60, 120, 300, 600)
MAX_CAS_ATTEMPTS = 10
"""Read-resolve-replace rounds before a scale write gives up (each 409 means someone else moved)."""


@dataclass(frozen=True)
class FunctionScaleResult:
    """OpenModelZ's result of waiting for a deployment: available, or an error with its HTTP meaning."""

    available: bool
    error: ScaleError | None
    found: bool
    duration: float


@dataclass(frozen=True)
class ScaleRecord:
    """A Scale subresource as read: replicas (0 when the server omitted them) and its resourceVersion."""

    replicas: int
    resource_version: str


class ScaleConflict(Exception):
    """The Scale changed since it was read (HTTP 409): re-read and decide again."""

    http_status = 409


class KubernetesAPIError(Exception):
    """The API server refused or failed a call; ``status`` is its HTTP status (0: no answer)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"{status} {message}")
        self.status = status


class ServiceQuery(Protocol):
    """Read and write a deployment's replicas (OpenModelZ's interface, plus compare-and-set)."""

    def get_replicas(self, service: str, namespace: str) -> defer.Deferred[ServiceQueryResponse]:
        """The deployment's scaling view; errbacks KubernetesAPIError (404 if absent)."""

    def set_replicas(self, service: str, namespace: str, count: int) -> defer.Deferred[None]:
        """Set replicas unconditionally (OpenModelZ's SetReplicas; the scaler itself uses CAS)."""

    def read_scale(self, service: str, namespace: str) -> defer.Deferred[ScaleRecord]:
        """Read the Scale subresource."""

    def replace_scale(self, service: str, namespace: str, replicas: int,
                      resource_version: str) -> defer.Deferred[None]:
        """Replace the Scale if it is still at ``resource_version``; errbacks ScaleConflict if not."""


class EventRecorder(Protocol):
    """Where the scaler's Kubernetes Events go."""

    def post(self, event: PostEvent) -> defer.Deferred[None]:
        """Record ``event`` on its deployment."""


class LeaseStore(Protocol):
    """Read and compare-and-set one Lease object."""

    def read(self) -> defer.Deferred[dict[str, Any] | None]:
        """The Lease as JSON, or None when it does not exist."""

    def create(self, body: dict[str, Any]) -> defer.Deferred[None]:
        """Create it; errbacks ScaleConflict if someone else did first."""

    def replace(self, body: dict[str, Any]) -> defer.Deferred[None]:
        """Replace it at the resourceVersion in ``body``; errbacks ScaleConflict on a race."""


class ScalerMetrics:
    """Cold start seconds, held requests, desired/current replicas and scale writes by reason.

    Held, desired and current replicas are read from the machine when
    scraped, so holding a thousand requests costs no metric updates.
    """

    def __init__(self, registry: CollectorRegistry, machine: Scaler) -> None:
        self.machine = machine
        self.cold_start_seconds = Histogram(
            "infx_scaler_cold_start_seconds", "Time from the first held request to an engine ready.",
            ["deployment"], buckets=COLD_START_BUCKETS, registry=registry)
        self.writes = Counter("infx_scaler_scale_writes", "Replica counts written, by reason.",
                              ["deployment", "reason"], registry=registry)
        self.leader = Gauge("infx_scaler_leader", "1 while this gateway runs the autoscaler.",
                            registry=registry)
        registry.register(self)

    def describe(self) -> list[GaugeMetricFamily]:
        """Names only, so that registering does not call :meth:`collect` early."""
        return self._families()

    def collect(self) -> list[GaugeMetricFamily]:
        """The per-deployment gauges, as of now."""
        held, desired, current = families = self._families()
        for key in self.machine.deployments():
            label = [str(key)]
            held.add_metric(label, self.machine.held_count(key))
            snapshot = self.machine.snapshot(key)
            if snapshot is not None:
                current.add_metric(label, snapshot.replicas)
            want = self.machine.desired(key)
            if want is not None:
                desired.add_metric(label, want)
        return families

    @staticmethod
    def _families() -> list[GaugeMetricFamily]:
        return [
            GaugeMetricFamily("infx_scaler_held_requests", "Requests held waiting for a cold start.",
                              labels=["deployment"]),
            GaugeMetricFamily("infx_scaler_desired_replicas", "Replicas the autoscaler wants.",
                              labels=["deployment"]),
            GaugeMetricFamily("infx_scaler_current_replicas", "Replicas the deployment asks for (last seen).",
                              labels=["deployment"]),
        ]


class InferenceScaler:
    """Scale from zero, autoscale and scale to zero, for one gateway.

    ``clock`` drives every timer; ``service_query`` performs scale writes
    (compare-and-set); ``events`` records Kubernetes Events (a failure is
    logged and never blocks a scale); ``fail_held(model, error)`` lets the
    processor fail the tasks it holds for a model (crash loop, startup
    timeout); ``is_leader()`` says whether this gateway runs the autoscaler.
    """

    log = Logger()

    def __init__(
        self,
        clock: IReactorTime,
        service_query: ServiceQuery,
        *,
        events: EventRecorder | None = None,
        config: ScalerConfig | None = None,
        registry: CollectorRegistry | None = None,
        fail_held: Callable[[str, ScaleError], None] | None = None,
        is_leader: Callable[[], bool] = lambda: True,
    ) -> None:
        self.clock = clock
        self.service_query = service_query
        self.events = events
        self.machine = Scaler(config)
        self.metrics = ScalerMetrics(registry, self.machine) if registry is not None else None
        #: Fails the processor's held tasks of a model (crash loop, startup timeout).
        self.fail_held = fail_held
        self._is_leader = is_leader
        self._waiters: dict[Hashable, defer.Deferred[FunctionScaleResult]] = {}
        self._ids = itertools.count()
        self._timer = DeadlineTimer(clock, self._timeout)
        self._ticker = LoopingCall(self.tick)
        self._ticker.clock = clock
        self._pods: dict[tuple[str, str], tuple[Mapping[str, str], str | None]] = {}
        self.writes_in_flight: set[defer.Deferred[None]] = set()

    # -- lifecycle -----------------------------------------------------------

    def start(self) -> None:
        """Start the autoscaler tick."""
        if not self._ticker.running:
            self._ticker.start(self.machine.config.tick_interval, now=False)

    def stop(self) -> None:
        """Stop the timers; held requests stay held (the caller ends or cancels them)."""
        if self._ticker.running:
            self._ticker.stop()
        self._timer.cancel()

    # -- holds ---------------------------------------------------------------

    def scale(self, namespace: str, name: str, timeout: float | None = None) -> defer.Deferred[FunctionScaleResult]:
        """Wait until deployment ``namespace/name`` serves a model, starting it from zero if needed.

        Fires with a :class:`FunctionScaleResult`; cancelling the Deferred
        (client gone) releases the hold.
        """
        request_id = ("scale", next(self._ids))
        now = self.clock.seconds()
        deadline = None if timeout is None else now + timeout
        d = self._waiter(request_id)
        self._apply(self.machine.hold_deployment(request_id, DeploymentKey(namespace, name), now, deadline))
        return d

    def hold(self, model: str, request_id: Hashable | None = None,
             timeout: float | None = None) -> defer.Deferred[FunctionScaleResult]:
        """Hold a request for ``model`` that found no ready engine until one serves it.

        The processor dispatches the request itself when the engine reports
        ready; this Deferred tells the caller whether to keep waiting
        (``available``) or to answer ``error`` (404, or 503 with Retry-After).
        """
        if request_id is None:
            request_id = ("hold", next(self._ids))
        now = self.clock.seconds()
        deadline = None if timeout is None else now + timeout
        d = self._waiter(request_id)
        self._apply(self.machine.hold_model(request_id, model, now, deadline))
        return d

    def release(self, request_id: Hashable) -> None:
        """Forget a held request (it was dispatched, or its client left); its Deferred never fires.

        Cancelling the Deferred returned by :meth:`hold` does the same and
        errbacks it with ``CancelledError``.
        """
        if self._waiters.pop(request_id, None) is not None:
            self._apply(self.machine.release(request_id, self.clock.seconds()))

    def _waiter(self, request_id: Hashable) -> defer.Deferred[FunctionScaleResult]:
        if request_id in self._waiters:
            raise ScalingLocalError(f"request {request_id!r} is already held")

        def cancel(_: defer.Deferred[FunctionScaleResult]) -> None:
            if self._waiters.pop(request_id, None) is not None:
                self._apply(self.machine.release(request_id, self.clock.seconds()))

        d: defer.Deferred[FunctionScaleResult] = defer.Deferred(cancel)
        self._waiters[request_id] = d
        return d

    # -- observations --------------------------------------------------------

    def observe_deployment(self, deployment: Mapping[str, Any]) -> None:
        """A Deployment (JSON) was listed, added or modified."""
        try:
            snapshot = deployment_snapshot(deployment)
        except ScalingRemoteError:
            self.log.warn("ignoring a deployment without a name")
            return
        # Label warnings come back as PostEvent effects (once per change), logged by _post.
        now = self.clock.seconds()
        effects = self.machine.observe_deployment(snapshot, now)
        if snapshot.opted_in:
            effects += self.machine.observe_pods(snapshot.key, self._crash_reason(snapshot.selector,
                                                                                snapshot.key.namespace), now)
        self._apply(effects)

    def forget_deployment(self, namespace: str, name: str) -> None:
        """A Deployment was deleted."""
        self._apply(self.machine.forget_deployment(DeploymentKey(namespace, name), self.clock.seconds()))

    def reset_deployments(self, deployments: Iterable[Mapping[str, Any]]) -> None:
        """A full list: observe every item and forget the deployments it no longer has."""
        seen = set()
        for deployment in deployments:
            metadata = deployment.get("metadata") or {}
            seen.add(DeploymentKey(metadata.get("namespace") or "default", metadata.get("name") or ""))
            self.observe_deployment(deployment)
        for key in self.machine.deployments():
            if key not in seen:
                self.forget_deployment(key.namespace, key.name)

    def observe_pod(self, pod: Mapping[str, Any], deleted: bool = False) -> None:
        """A Pod was added, modified or (``deleted``) removed: recheck crash loops of its deployments."""
        metadata = pod.get("metadata") or {}
        namespace = metadata.get("namespace") or "default"
        pod_key = (namespace, metadata.get("name") or "")
        labels: Mapping[str, str] = metadata.get("labels") or {}
        if deleted:
            self._pods.pop(pod_key, None)
        else:
            self._pods[pod_key] = (labels, pod_crash_reason(pod))
        self._recheck_pods(namespace, labels)

    def reset_pods(self, pods: Iterable[Mapping[str, Any]]) -> None:
        """A full pod list replaces what was known."""
        self._pods.clear()
        for pod in pods:
            metadata = pod.get("metadata") or {}
            self._pods[(metadata.get("namespace") or "default", metadata.get("name") or "")] = (
                metadata.get("labels") or {}, pod_crash_reason(pod))
        now = self.clock.seconds()
        effects: list[Effect] = []
        for key in self.machine.deployments():
            snapshot = self.machine.snapshot(key)
            if snapshot is not None:
                effects += self.machine.observe_pods(key, self._crash_reason(snapshot.selector, key.namespace), now)
        self._apply(effects)

    def _recheck_pods(self, namespace: str, labels: Mapping[str, str]) -> None:
        now = self.clock.seconds()
        effects: list[Effect] = []
        for key in self.machine.deployments():
            snapshot = self.machine.snapshot(key)
            if snapshot is None or key.namespace != namespace or not _selects(snapshot.selector, labels):
                continue
            effects += self.machine.observe_pods(key, self._crash_reason(snapshot.selector, namespace), now)
        self._apply(effects)

    def _crash_reason(self, selector: Mapping[str, str], namespace: str) -> str | None:
        if not selector:
            return None
        for (pod_namespace, _), (labels, reason) in self._pods.items():
            if reason is not None and pod_namespace == namespace and _selects(selector, labels):
                return reason
        return None

    def model_ready(self, model: str) -> None:
        """An engine reported ``model`` ready (processor hook)."""
        self._apply(self.machine.model_ready(model, self.clock.seconds()))

    def model_gone(self, model: str) -> None:
        """No engine serves ``model`` any more (processor hook)."""
        self.machine.model_gone(model, self.clock.seconds())

    def request_started(self, model: str) -> None:
        """Count a request for ``model`` accepted here (rps and in-flight load)."""
        self.machine.request_started(model, self.clock.seconds())

    def request_finished(self, model: str) -> None:
        """The request counted by :meth:`request_started` ended."""
        self.machine.request_finished(model, self.clock.seconds())

    def observe_in_progress(self, model: str, count: int) -> None:
        """Engines (of every gateway) report ``count`` tasks in progress for ``model``."""
        self.machine.observe_in_progress(model, count, self.clock.seconds())

    def observe_peer_requests(self, peer: Hashable, counts: Mapping[str, int]) -> None:
        """A peer gateway reported the requests per model it accepted since it started (rps load)."""
        self.machine.observe_peer_requests(peer, counts, self.clock.seconds())

    def forget_peer(self, peer: Hashable) -> None:
        """``peer``'s reports ended; the next ones start a new baseline."""
        self.machine.forget_peer(peer)

    # -- autoscaler ------------------------------------------------------------

    def tick(self) -> None:
        """One autoscaler pass, if this gateway leads."""
        leader = self._is_leader()
        if self.metrics is not None:
            self.metrics.leader.set(1 if leader else 0)
        if not leader:
            return
        self._apply(self.machine.tick(self.clock.seconds()))

    # -- effects ---------------------------------------------------------------

    def _apply(self, effects: Iterable[Effect]) -> None:
        for effect in effects:
            if isinstance(effect, HoldResolved):
                d = self._waiters.pop(effect.request_id, None)
                if d is not None:
                    d.callback(FunctionScaleResult(effect.available, effect.error, effect.found, effect.waited))
            elif isinstance(effect, ScaleWrite):
                self._start_write(effect)
            elif isinstance(effect, PostEvent):
                self._post(effect)
            elif isinstance(effect, FailHeld):
                if self.fail_held is not None:
                    self.fail_held(effect.model, effect.error)
            elif isinstance(effect, ColdStartFinished):
                self.log.info("deployment {key} ready after {seconds:.3f}s", key=str(effect.key),
                              seconds=effect.seconds)
                if self.metrics is not None:
                    self.metrics.cold_start_seconds.labels(str(effect.key)).observe(effect.seconds)
        self._rearm()

    def _rearm(self) -> None:
        self._timer.arm(self.machine.next_deadline())

    def _timeout(self) -> None:
        self._apply(self.machine.handle_timeout(self.clock.seconds()))

    def _post(self, event: PostEvent) -> None:
        log = self.log.warn if event.type == "Warning" else self.log.info
        log("deployment {key}: {reason}: {message}", key=str(event.key), reason=event.reason,
            message=event.message)
        if self.events is None:
            return

        def failed(failure: Any) -> None:
            self.log.warn("could not post event {reason} on {key}: {error}", reason=event.reason,
                          key=str(event.key), error=failure.getErrorMessage())

        self.events.post(event).addErrback(failed)

    def _start_write(self, write: ScaleWrite) -> None:
        self.log.info("scale {key}: {reason} from {old} to {new}", key=str(write.key),
                      reason=write.reason.value, old=write.from_replicas, new=write.replicas)
        d = defer.ensureDeferred(self._write(write))
        self.writes_in_flight.add(d)
        d.addBoth(lambda _: self.writes_in_flight.discard(d))

    async def _write(self, write: ScaleWrite) -> None:
        """Read the Scale, let the machine decide against what was read, compare-and-set; 409: again."""
        key = write.key
        try:
            for _ in range(MAX_CAS_ATTEMPTS):
                record = await self.service_query.read_scale(key.name, key.namespace)
                replicas = self.machine.resolve_write(write, record.replicas, self.clock.seconds())
                if replicas is None or replicas == record.replicas:
                    self._apply(self.machine.write_done(write, None, self.clock.seconds()))
                    return
                try:
                    await self.service_query.replace_scale(key.name, key.namespace, replicas,
                                                           record.resource_version)
                except ScaleConflict:
                    continue
                if self.metrics is not None:
                    self.metrics.writes.labels(str(key), write.reason.value).inc()
                self._apply(self.machine.write_done(write, replicas, self.clock.seconds()))
                return
            raise KubernetesAPIError(409, f"gave up after {MAX_CAS_ATTEMPTS} conflicting writes")
        except Exception as error:  # any failure of the API call is reported to the machine
            self.log.failure("scale write to {key} failed", key=str(key))
            self._apply(self.machine.write_failed(write, str(error), self.clock.seconds()))


class ProcessorLink:
    """Joins an :class:`InferenceScaler` to the gateway core's scaler signals (through the
    :class:`infx.dispatcher.Dispatcher`, which hands this link those effects).

    - ``TaskQueued`` (a task waits because no ready engine serves its model; the
      core passes each task once): the model is gone whatever the scaler last
      heard (an engine may have crashed), and the task is held in the scaler,
      which begins or joins the model's cold start; the processor keeps the
      task and dispatches it itself the moment an engine reports the model ready.
    - ``ModelServed``: a held task left the queue for an engine, so the model is
      ready (the scaler resolves its held tasks); ``TaskReleased``: a held task
      ended otherwise and is forgotten.
    - ``ReportLoad``: in-flight tasks per model, so the leader never takes a busy
      deployment to zero.
    - When the scaler gives up on a model (crash loop, startup timeout), the
      processor's waiting tasks for it fail with the scaler's status and reason.
    - The core asks the scaler whether it could start a model no engine serves
      yet (not a 404).

    A task the scaler refuses on its own (no deployment, hold cap) stays in the
    processor's queue and ends with the processor's queue timeout.
    """

    def __init__(self, scaler: InferenceScaler, dispatcher: Any) -> None:
        self.scaler = scaler
        self.dispatcher = dispatcher
        dispatcher.scaler_effects = self.perform
        scaler.fail_held = self.fail_held
        dispatcher.run(lambda now: dispatcher.core.scaler_attached(
            lambda tenant, model: scaler.machine.serves(model), now))

    def stop(self) -> None:
        """No more load reports (the gateway is stopping)."""
        self.dispatcher.run(self.dispatcher.core.scaler_detached)

    def perform(self, effect: Any) -> None:
        """One of the core's scaler signals."""
        from protocol.gateway_effects import ModelServed, ReportLoad, TaskReleased
        from protocol.processor_types import TaskQueued

        if isinstance(effect, TaskQueued):
            self.scaler.model_gone(effect.model_id)
            self.scaler.hold(effect.model_id, request_id=effect.task_id)
        elif isinstance(effect, ModelServed):
            self.scaler.model_ready(effect.model)
        elif isinstance(effect, TaskReleased):
            self.scaler.release(effect.task_id)
        elif isinstance(effect, ReportLoad):
            self.scaler.observe_in_progress(effect.model, effect.count)

    def fail_held(self, model: str, error: ScaleError) -> None:
        """Fail every tenant's waiting tasks for ``model``."""
        self.dispatcher.run(lambda now: self.dispatcher.core.scaler_gave_up(
            model, error.http_status, error.message, now))


def _selects(selector: Mapping[str, str], labels: Mapping[str, str]) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


# -- in-memory implementations (tests, embedding without Kubernetes) ---------------


class InMemoryServiceQuery:
    """Deployments held in memory with resourceVersions, behaving like the scale subresource.

    Also an :class:`EventRecorder` (events land in ``events``), so a test or an
    embedded gateway can run the scaler with no Kubernetes at all.
    ``on_change(deployment)`` is called after every write, as a watch would.
    """

    def __init__(self, on_change: Callable[[dict[str, Any]], None] | None = None) -> None:
        self.deployments: dict[DeploymentKey, dict[str, Any]] = {}
        self.events: list[PostEvent] = []
        self.writes: list[tuple[DeploymentKey, int]] = []
        self.on_change = on_change
        self._version = itertools.count(1)

    def add(self, deployment: dict[str, Any]) -> dict[str, Any]:
        """Store a Deployment (JSON); returns it with its resourceVersion."""
        metadata = deployment.setdefault("metadata", {})
        metadata.setdefault("namespace", "default")
        metadata["resourceVersion"] = str(next(self._version))
        metadata.setdefault("generation", 1)
        key = DeploymentKey(metadata["namespace"], metadata["name"])
        self.deployments[key] = deployment
        return deployment

    def _get(self, service: str, namespace: str) -> dict[str, Any]:
        deployment = self.deployments.get(DeploymentKey(namespace, service))
        if deployment is None:
            raise KubernetesAPIError(404, f"deployments.apps {service!r} not found")
        return deployment

    def _set(self, deployment: dict[str, Any], count: int) -> None:
        metadata = deployment["metadata"]
        deployment.setdefault("spec", {})["replicas"] = count
        metadata["resourceVersion"] = str(next(self._version))
        metadata["generation"] = int(metadata.get("generation", 1)) + 1
        self.writes.append((DeploymentKey(metadata["namespace"], metadata["name"]), count))
        if self.on_change is not None:
            self.on_change(deployment)

    def get_replicas(self, service: str, namespace: str) -> defer.Deferred[ServiceQueryResponse]:
        return defer.maybeDeferred(lambda: as_service_query_response(self._get(service, namespace)))

    def set_replicas(self, service: str, namespace: str, count: int) -> defer.Deferred[None]:
        return defer.maybeDeferred(lambda: self._set(self._get(service, namespace), count))

    def read_scale(self, service: str, namespace: str) -> defer.Deferred[ScaleRecord]:
        def read() -> ScaleRecord:
            deployment = self._get(service, namespace)
            return ScaleRecord(int(deployment.get("spec", {}).get("replicas", 1)),
                               deployment["metadata"]["resourceVersion"])
        return defer.maybeDeferred(read)

    def replace_scale(self, service: str, namespace: str, replicas: int,
                      resource_version: str) -> defer.Deferred[None]:
        def replace() -> None:
            deployment = self._get(service, namespace)
            if deployment["metadata"]["resourceVersion"] != resource_version:
                raise ScaleConflict(f"{namespace}/{service} changed since {resource_version}")
            self._set(deployment, replicas)
        return defer.maybeDeferred(replace)

    def post(self, event: PostEvent) -> defer.Deferred[None]:
        self.events.append(event)
        return defer.succeed(None)


# -- Kubernetes implementations (official client, off the reactor thread) ------------------


def _api_error(error: Exception) -> Exception:
    from kubernetes.client.rest import ApiException

    if isinstance(error, ApiException):
        if error.status == 409:
            return ScaleConflict(str(error.reason))
        return KubernetesAPIError(int(error.status or 0), str(error.reason))
    return error


class _InThread:
    """Run blocking client calls in the reactor's thread pool, mapping API errors."""

    def __init__(self, reactor: Any) -> None:
        self.reactor = reactor

    def call(self, f: Callable[..., T], *args: Any, **kwargs: Any) -> defer.Deferred[T]:
        def run() -> T:
            try:
                return f(*args, **kwargs)
            except Exception as error:
                raise _api_error(error) from error
        return threads.deferToThreadPool(self.reactor, self.reactor.getThreadPool(), run)


class KubernetesServiceQuery(_InThread):
    """:class:`ServiceQuery` on the ``apps/v1`` API: deployments and their Scale subresource.

    The Scale is replaced with the resourceVersion that was read: a JSON-patch
    ``test`` cannot express "still at zero", because the API server omits
    ``spec.replicas`` from a Scale when it is 0.
    """

    def __init__(self, reactor: Any, api_client: Any) -> None:
        super().__init__(reactor)
        from kubernetes import client

        self.apps = client.AppsV1Api(api_client)

    def get_replicas(self, service: str, namespace: str) -> defer.Deferred[ServiceQueryResponse]:
        def read() -> ServiceQueryResponse:
            response = self.apps.read_namespaced_deployment(service, namespace, _preload_content=False)
            return as_service_query_response(json.loads(response.data))
        return self.call(read)

    def set_replicas(self, service: str, namespace: str, count: int) -> defer.Deferred[None]:
        def patch() -> None:
            self.apps.patch_namespaced_deployment_scale(service, namespace, {"spec": {"replicas": count}},
                                                        _preload_content=False)
        return self.call(patch)

    def read_scale(self, service: str, namespace: str) -> defer.Deferred[ScaleRecord]:
        def read() -> ScaleRecord:
            response = self.apps.read_namespaced_deployment_scale(service, namespace, _preload_content=False)
            scale = json.loads(response.data)
            return ScaleRecord(int((scale.get("spec") or {}).get("replicas") or 0),
                               scale["metadata"]["resourceVersion"])
        return self.call(read)

    def replace_scale(self, service: str, namespace: str, replicas: int,
                      resource_version: str) -> defer.Deferred[None]:
        body = {"apiVersion": "autoscaling/v1", "kind": "Scale",
                "metadata": {"name": service, "namespace": namespace, "resourceVersion": resource_version},
                "spec": {"replicas": replicas}}

        def replace() -> None:
            self.apps.replace_namespaced_deployment_scale(service, namespace, body, _preload_content=False)
        return self.call(replace)


class KubernetesEvents(_InThread):
    """:class:`EventRecorder` posting ``events.k8s.io/v1`` Events regarding the deployment."""

    def __init__(self, reactor: Any, api_client: Any, clock: IReactorTime, instance: str,
                 controller: str = "infx.io/scaler") -> None:
        super().__init__(reactor)
        from kubernetes import client

        self.api = client.EventsV1Api(api_client)
        self.clock = clock
        self.instance = instance
        self.controller = controller

    def post(self, event: PostEvent) -> defer.Deferred[None]:
        key = event.key
        body = {
            "apiVersion": "events.k8s.io/v1", "kind": "Event",
            "metadata": {"generateName": f"{key.name}.", "namespace": key.namespace},
            "eventTime": micro_time(self.clock.seconds()),
            "reportingController": self.controller, "reportingInstance": self.instance,
            "action": "Scale", "reason": event.reason, "note": event.message[:1024], "type": event.type,
            "regarding": {"apiVersion": "apps/v1", "kind": "Deployment", "name": key.name,
                          "namespace": key.namespace},
        }

        def create() -> None:
            self.api.create_namespaced_event(key.namespace, body, _preload_content=False)
        return self.call(create)


class KubernetesLease(_InThread):
    """:class:`LeaseStore` on one ``coordination.k8s.io/v1`` Lease."""

    def __init__(self, reactor: Any, api_client: Any, name: str, namespace: str) -> None:
        super().__init__(reactor)
        from kubernetes import client

        self.api = client.CoordinationV1Api(api_client)
        self.name = name
        self.namespace = namespace

    def read(self) -> defer.Deferred[dict[str, Any] | None]:
        def read() -> dict[str, Any] | None:
            from kubernetes.client.rest import ApiException
            try:
                response = self.api.read_namespaced_lease(self.name, self.namespace, _preload_content=False)
            except ApiException as error:
                if error.status == 404:
                    return None
                raise
            lease: dict[str, Any] = json.loads(response.data)
            return lease
        return self.call(read)

    def create(self, body: dict[str, Any]) -> defer.Deferred[None]:
        def create() -> None:
            self.api.create_namespaced_lease(self.namespace, body, _preload_content=False)
        return self.call(create)

    def replace(self, body: dict[str, Any]) -> defer.Deferred[None]:
        def replace() -> None:
            self.api.replace_namespaced_lease(self.name, self.namespace, body, _preload_content=False)
        return self.call(replace)


class LeaseElector:
    """Leader election: acquire or renew a Lease every ``renew_interval`` on ``clock``.

    Leading ends as soon as a renewal fails or someone else holds an
    unexpired Lease; ``clock.seconds()`` must be wall-clock time, since the
    Lease's times are compared across gateways.
    """

    log = Logger()

    def __init__(self, clock: IReactorTime, store: LeaseStore, identity: str, name: str = "infx-scaler",
                 duration: float = 15.0, renew_interval: float = 5.0,
                 on_change: Callable[[bool], None] | None = None) -> None:
        self.clock = clock
        self.store = store
        self.identity = identity
        self.name = name
        self.duration = duration
        self.leader = False
        self._on_change = on_change
        self._loop = LoopingCall(self.round)
        self._loop.clock = clock
        self._renew_interval = renew_interval
        self._stopped = False

    def start(self) -> None:
        """Try now, then every renew interval."""
        self._stopped = False
        if not self._loop.running:
            self._loop.start(self._renew_interval, now=True)

    def stop(self) -> defer.Deferred[None]:
        """Stop trying, and hand back a Lease we hold so that another
        gateway leads at its next round, not a Lease duration later."""
        self._stopped = True
        if self._loop.running:
            self._loop.stop()
        held = self.leader
        self._set(False)
        if not held:
            return defer.succeed(None)
        return defer.ensureDeferred(self._release())

    async def _release(self) -> None:
        try:
            body = release_lease(await self.store.read(), self.identity, self.clock.seconds())
            if body is not None:
                await self.store.replace(body)
        except ScaleConflict:
            pass  # it changed hands meanwhile: nothing of ours to release
        except Exception:
            self.log.failure("releasing lease {name} failed", name=self.name)

    def is_leader(self) -> bool:
        """Whether this gateway leads right now."""
        return self.leader

    def round(self) -> defer.Deferred[None]:
        """One acquire-or-renew attempt."""
        return defer.ensureDeferred(self._round())

    async def _round(self) -> None:
        try:
            lease = await self.store.read()
            if self._stopped:
                return
            decision = decide_lease(lease, self.identity, self.name, self.clock.seconds(), self.duration)
            if decision.body is not None:
                if decision.create:
                    await self.store.create(decision.body)
                else:
                    await self.store.replace(decision.body)
            if not self._stopped:
                self._set(decision.leader)
            elif decision.leader and decision.body is not None:
                await self._release()  # won just as we stopped
        except ScaleConflict:
            self._set(False)
        except Exception:
            self.log.failure("lease {name} round failed", name=self.name)
            self._set(False)

    def _set(self, leader: bool) -> None:
        if leader != self.leader:
            self.leader = leader
            self.log.info("{identity} {what} lease {name}", identity=self.identity, name=self.name,
                          what="now holds" if leader else "no longer holds")
            if self._on_change is not None:
                self._on_change(leader)


class KubernetesWatch:
    """List, then watch, one collection in a daemon thread; results go to the reactor thread.

    ``on_reset(items)`` gets every full list (first, and after 410 Gone or an
    error); ``on_event(type, object)`` each ADDED/MODIFIED/DELETED. Stopping
    takes effect at the next event or within ``watch_timeout`` seconds.
    """

    log = Logger()

    def __init__(self, reactor: Any, list_call: Callable[..., Any], on_reset: Callable[[list[Any]], None],
                 on_event: Callable[[str, dict[str, Any]], None], *, watch_timeout: int = 30,
                 retry_delay: float = 1.0, **list_kwargs: Any) -> None:
        self.reactor = reactor
        self.list_call = list_call
        self.list_kwargs = list_kwargs
        self.on_reset = on_reset
        self.on_event = on_event
        self.watch_timeout = watch_timeout
        self.retry_delay = retry_delay
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Begin listing and watching in a thread of its own."""
        self._stopped.clear()
        self._thread = threading.Thread(target=self._run, name="infx-scaler-watch", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """No more callbacks after this returns (on the reactor thread)."""
        self._stopped.set()

    def _deliver(self, f: Callable[..., None], *args: Any) -> None:
        def call() -> None:
            if not self._stopped.is_set():
                f(*args)
        self.reactor.callFromThread(call)

    def _run(self) -> None:
        from kubernetes import watch
        from kubernetes.client.rest import ApiException

        resource_version: str | None = None
        while not self._stopped.is_set():
            try:
                if resource_version is None:
                    response = self.list_call(_preload_content=False, **self.list_kwargs)
                    listed = json.loads(response.data)
                    resource_version = listed["metadata"]["resourceVersion"]
                    self._deliver(self.on_reset, listed.get("items") or [])
                stream = watch.Watch()
                for event in stream.stream(self.list_call, resource_version=resource_version,
                                           timeout_seconds=self.watch_timeout, allow_watch_bookmarks=True,
                                           **self.list_kwargs):
                    if self._stopped.is_set():
                        stream.stop()
                        break
                    kind, raw = event["type"], event["raw_object"]
                    if kind == "ERROR":
                        # 410 Gone: our resourceVersion is too old; anything else: back off first.
                        if raw.get("code") != 410:
                            self._wait_before_retry(RuntimeError(raw.get("message", "watch error")))
                        resource_version = None
                        break
                    resource_version = raw.get("metadata", {}).get("resourceVersion", resource_version)
                    if kind != "BOOKMARK":
                        self._deliver(self.on_event, kind, raw)
            except ApiException as error:
                if error.status != 410:
                    self._wait_before_retry(error)
                resource_version = None
            except Exception as error:  # the connection dropped, or the server answered garbage
                self._wait_before_retry(error)
                resource_version = None

    def _wait_before_retry(self, error: Exception) -> None:
        if not self._stopped.is_set():
            self.log.warn("watch failed, relisting: {error}", error=error)
            self._stopped.wait(self.retry_delay)


class ScalerService(service.Service):
    """The scaler in a service tree: its tick, its watches and (optionally) leader election."""

    def __init__(self, scaler: InferenceScaler, watches: Iterable[KubernetesWatch] = (),
                 elector: LeaseElector | None = None) -> None:
        self.scaler = scaler
        self.watches = list(watches)
        self.elector = elector

    def startService(self) -> None:
        super().startService()
        self.scaler.start()
        for w in self.watches:
            w.start()
        if self.elector is not None:
            self.elector.start()

    def stopService(self) -> defer.Deferred[None]:
        """Stop watching and ticking; done once a held Lease is handed back."""
        for w in self.watches:
            w.stop()
        released = self.elector.stop() if self.elector is not None else defer.succeed(None)
        self.scaler.stop()
        super().stopService()
        return released


def kubernetes_scaler(
    reactor: Any, api_client: Any, namespace: str, identity: str, *,
    config: ScalerConfig | None = None, registry: CollectorRegistry | None = None,
    fail_held: Callable[[str, ScaleError], None] | None = None, lease_name: str = "infx-scaler",
    watch_timeout: int = 30,
) -> ScalerService:
    """Wire an :class:`InferenceScaler` to Kubernetes in ``namespace``: what ``--scaler`` builds.

    ``identity`` (the pod name) names this gateway in the Lease and Events.
    """
    from kubernetes import client

    elector = LeaseElector(reactor, KubernetesLease(reactor, api_client, lease_name, namespace), identity,
                           lease_name)
    scaler = InferenceScaler(
        reactor, KubernetesServiceQuery(reactor, api_client),
        events=KubernetesEvents(reactor, api_client, reactor, identity), config=config,
        registry=registry, fail_held=fail_held, is_leader=elector.is_leader)
    apps = client.AppsV1Api(api_client)
    core = client.CoreV1Api(api_client)

    def deployment_event(kind: str, obj: dict[str, Any]) -> None:
        if kind == "DELETED":
            metadata = obj.get("metadata") or {}
            scaler.forget_deployment(metadata.get("namespace") or namespace, metadata.get("name") or "")
        else:
            scaler.observe_deployment(obj)

    deployments = KubernetesWatch(
        reactor, apps.list_namespaced_deployment, scaler.reset_deployments, deployment_event,
        watch_timeout=watch_timeout, namespace=namespace, label_selector=f"{SCALABLE_LABEL}=true")
    pods = KubernetesWatch(
        reactor, core.list_namespaced_pod, scaler.reset_pods,
        lambda kind, obj: scaler.observe_pod(obj, deleted=kind == "DELETED"),
        watch_timeout=watch_timeout, namespace=namespace)
    return ScalerService(scaler, [deployments, pods], elector)


__all__ = [
    "EventRecorder", "FunctionScaleResult", "InMemoryServiceQuery", "InferenceScaler",
    "KubernetesAPIError", "KubernetesEvents", "KubernetesLease", "KubernetesServiceQuery",
    "KubernetesWatch", "LeaseElector", "LeaseStore", "ProcessorLink", "ScaleConflict", "ScaleReason", "ScaleRecord",
    "ScalerMetrics", "ScalerService", "ServiceQuery", "kubernetes_scaler",
]
