"""The scaler on Twisted: performs :mod:`protocol.scaling.scaler`'s decisions against Kubernetes.

Scale engine deployments from zero when a request arrives (without losing
it), autoscale them from load measured in this process and reported by the
other gateways (started requests in the exchanger's status reports, tasks in
progress in the engines'), and take them to zero when idle. Every decision
is made by the pure :class:`protocol.scaling.scaler.Scaler`; :class:`InferenceScaler`
owns its one timer (the machine's deadline, autoscaler ticks included, on an
injected clock), performs its scale writes and Events and keeps its metrics.
A held request ends available, or with a 503 and ``Retry-After``; never with
a blind forward.

The rest lives next door: the Kubernetes adapters (Scale, Events, Lease) in
:mod:`infx.scaling.kube`, leader election in :mod:`infx.scaling.lease`, the
deployment and pod informers in :mod:`infx.scaling.watch`.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable, Hashable, Iterable, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily
from twisted.application import service
from twisted.internet import defer
from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger

from infx.deadline import DeadlineTimer
from infx.scaling.kube import (
    EventRecorder,
    KubernetesAPIError,
    KubernetesEvents,
    KubernetesLease,
    KubernetesServiceQuery,
    ScaleConflict,
    ServiceQuery,
)
from infx.scaling.lease import LeaseElector
from infx.scaling.watch import ScalerWatches
from protocol.scaling.scaler import (
    ColdStartFinished,
    DeploymentKey,
    Effect,
    FailHeld,
    HoldResolved,
    PostEvent,
    ScaleError,
    Scaler,
    ScalerConfig,
    ScaleWrite,
    ScalingLocalError,
    ScalingRemoteError,
    deployment_snapshot,
    pod_crash_reason,
)

COLD_START_BUCKETS = (0.01, 0.1, 0.5, 1, 2.5, 5, 10, 20, 30, 60, 120, 300, 600)
MAX_CAS_ATTEMPTS = 10
"""Read-resolve-replace rounds before a scale write gives up (each 409 means someone else moved)."""


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
    timeout); ``leader`` says whether this gateway runs the autoscaler until
    :meth:`leader_changed` says otherwise. The machine's deadlines (holds,
    startup timeouts, retries and the autoscaler's ticks) are one timer.
    """

    def __init__(
        self,
        clock: IReactorTime,
        service_query: ServiceQuery,
        *,
        events: EventRecorder | None = None,
        config: ScalerConfig | None = None,
        registry: CollectorRegistry | None = None,
        fail_held: Callable[[str, ScaleError], None] | None = None,
        leader: bool = True,
    ) -> None:
        # The namespace operators know, from before infx/scaling/ (a class-level Logger would take the new path).
        self.log = Logger(namespace="infx.scaler.InferenceScaler", source=self)
        self.clock = clock
        self.service_query = service_query
        self.events = events
        self.machine = Scaler(config)
        self.metrics = ScalerMetrics(registry, self.machine) if registry is not None else None
        #: Fails the processor's held tasks of a model (crash loop, startup timeout).
        self.fail_held = fail_held
        self._waiters: dict[Hashable, defer.Deferred[HoldResolved]] = {}
        self._ids = itertools.count()
        self._timer = DeadlineTimer(clock, self._timeout)
        self.writes_in_flight: set[defer.Deferred[None]] = set()

    # -- lifecycle -----------------------------------------------------------

        self.leader_changed(leader)

    def start(self) -> None:
        """Start the autoscaler's ticks."""
        self._apply(self.machine.start(self.clock.seconds()))

    def stop(self) -> None:
        """Stop the ticks and the timer; held requests stay held (the caller ends or cancels them)."""
        self.machine.stop()
        self._timer.cancel()

    def leader_changed(self, leader: bool) -> None:
        """This gateway now runs the autoscaler, or no longer does (the Lease elector's hook)."""
        if self.metrics is not None:
            self.metrics.leader.set(1 if leader else 0)
        self._apply(self.machine.lead(leader, self.clock.seconds()))

    # -- holds ---------------------------------------------------------------

    def hold(self, model: str, request_id: Hashable | None = None,
             timeout: float | None = None) -> defer.Deferred[HoldResolved]:
        """Hold a request for ``model`` that found no ready engine until one serves it.

        The processor dispatches the request itself when the engine reports
        ready; this Deferred fires with the machine's :class:`HoldResolved`,
        telling the caller whether to keep waiting (``available``) or to
        answer ``error`` (404, or 503 with Retry-After).
        """
        if request_id is None:
            request_id = ("hold", next(self._ids))
        now = self.clock.seconds()
        deadline = None if timeout is None else now + timeout
        d = self._waiter(request_id)
        self._apply(self.machine.hold_model(request_id, model, deadline, now))
        return d

    def release(self, request_id: Hashable) -> None:
        """Forget a held request (it was dispatched, or its client left); its Deferred never fires.

        Cancelling the Deferred returned by :meth:`hold` does the same and
        errbacks it with ``CancelledError``.
        """
        if self._waiters.pop(request_id, None) is not None:
            self._apply(self.machine.release(request_id, self.clock.seconds()))

    def _waiter(self, request_id: Hashable) -> defer.Deferred[HoldResolved]:
        if request_id in self._waiters:
            raise ScalingLocalError(f"request {request_id!r} is already held")

        def cancel(_: defer.Deferred[HoldResolved]) -> None:
            if self._waiters.pop(request_id, None) is not None:
                self._apply(self.machine.release(request_id, self.clock.seconds()))

        d: defer.Deferred[HoldResolved] = defer.Deferred(cancel)
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
            effects += self.machine.recheck_pods(snapshot.key, now)
        self._apply(effects)

    def forget_deployment(self, namespace: str, name: str) -> None:
        """A Deployment was deleted."""
        self._apply(self.machine.forget_deployment(DeploymentKey(namespace, name), self.clock.seconds()))

    def observe_pod(self, pod: Mapping[str, Any], deleted: bool = False) -> None:
        """A Pod was added, modified or (``deleted``) removed: recheck crash loops of its deployments."""
        metadata = pod.get("metadata") or {}
        labels: Mapping[str, str] = metadata.get("labels") or {}
        self._apply(self.machine.observe_pod(metadata.get("namespace") or "default", metadata.get("name") or "",
                                             labels, None if deleted else pod_crash_reason(pod), deleted,
                                             self.clock.seconds()))

    def model_ready(self, model: str) -> None:
        """An engine reported ``model`` ready (processor hook)."""
        self._apply(self.machine.model_ready(model, self.clock.seconds()))

    def model_gone(self, model: str) -> None:
        """No engine serves ``model`` any more (processor hook)."""
        self._apply_some(self.machine.model_gone(model, self.clock.seconds()))

    def request_started(self, model: str) -> None:
        """Count a request for ``model`` accepted here (rps and in-flight load)."""
        self._apply_some(self.machine.request_started(model, self.clock.seconds()))

    def request_finished(self, model: str) -> None:
        """The request counted by :meth:`request_started` ended."""
        self._apply_some(self.machine.request_finished(model, self.clock.seconds()))

    def observe_in_progress(self, model: str, count: int) -> None:
        """Engines (of every gateway) report ``count`` tasks in progress for ``model``."""
        self._apply_some(self.machine.observe_in_progress(model, count, self.clock.seconds()))

    def observe_peer_requests(self, peer: Hashable, counts: Mapping[str, int]) -> None:
        """A peer gateway reported the requests per model it accepted since it started (rps load)."""
        self._apply_some(self.machine.observe_peer_requests(peer, counts, self.clock.seconds()))

    def forget_peer(self, peer: Hashable) -> None:
        """``peer``'s reports ended; the next ones start a new baseline."""
        self._apply_some(self.machine.forget_peer(peer))

    # -- effects ---------------------------------------------------------------

    def _apply(self, effects: Iterable[Effect]) -> None:
        for effect in effects:
            if isinstance(effect, HoldResolved):
                d = self._waiters.pop(effect.request_id, None)
                if d is not None:
                    d.callback(effect)
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

    def _apply_some(self, effects: list[Effect]) -> None:
        """:meth:`_apply` for the per-request inputs, which rarely have effects: no rearm when none."""
        if effects:
            self._apply(effects)

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
    :class:`infx.gateway.dispatcher.Dispatcher`, which hands this link those effects).

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
        from protocol.gateway.effects import ModelServed, ReportLoad, TaskReleased
        from protocol.processor.effects import TaskQueued

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


class ScalerService(service.Service):
    """The scaler in a service tree: its timer, its watches and (optionally) leader election."""

    def __init__(self, scaler: InferenceScaler, watches: ScalerWatches | None = None,
                 elector: LeaseElector | None = None) -> None:
        self.scaler = scaler
        self.watches = watches
        self.elector = elector

    def startService(self) -> None:
        super().startService()
        self.scaler.start()
        if self.watches is not None:
            self.watches.start()
        if self.elector is not None:
            self.elector.start()

    def stopService(self) -> defer.Deferred[None]:
        """Stop watching and ticking; done once the watch threads returned and a held Lease is handed back."""
        stopped = [self.watches.stop()] if self.watches is not None else []
        if self.elector is not None:
            stopped.append(self.elector.stop())
        self.scaler.stop()
        super().stopService()
        return defer.gatherResults(stopped, consumeErrors=True).addCallback(lambda _: None)


def kubernetes_scaler(
    reactor: Any, api_client: Any, namespace: str, identity: str, *, rng: random.Random,
    config: ScalerConfig | None = None, registry: CollectorRegistry | None = None,
    fail_held: Callable[[str, ScaleError], None] | None = None, lease_name: str = "infx-scaler",
    watch_timeout: int = 30,
) -> ScalerService:
    """Wire an :class:`InferenceScaler` to Kubernetes in ``namespace``: what ``--scaler`` builds.

    ``identity`` (the pod name) names this gateway in the Lease and Events;
    ``rng`` jitters the watches' backoff. The autoscaler runs while this
    gateway holds the Lease.
    """
    scaler = InferenceScaler(
        reactor, KubernetesServiceQuery(reactor, api_client),
        events=KubernetesEvents(reactor, api_client, reactor, identity), config=config,
        registry=registry, fail_held=fail_held, leader=False)
    elector = LeaseElector(reactor, KubernetesLease(reactor, api_client, lease_name, namespace), identity,
                           lease_name, on_change=scaler.leader_changed)
    watches = ScalerWatches(reactor, api_client, scaler, namespace, rng=rng, watch_timeout=watch_timeout)
    return ScalerService(scaler, watches, elector)


__all__ = [
    "InferenceScaler", "ProcessorLink", "ScalerMetrics", "ScalerService", "kubernetes_scaler",
]
