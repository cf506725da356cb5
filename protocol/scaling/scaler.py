"""Scaling decisions for engine deployments: no I/O, no clock reads, effects are values.

Rules this file keeps: time is a ``now`` argument (always last) and
:meth:`Scaler.next_deadline` says when the machine must be woken, the
autoscaler's ticks included; every decision comes out as a frozen
effect value (:class:`ScaleWrite`, :class:`HoldResolved`, :class:`FailHeld`,
:class:`PostEvent`, :class:`ColdStartFinished`) that the Twisted layer
performs; calling a method out of turn (a write result for no pending write,
a request id held twice) raises :class:`ScalingLocalError`.

What it decides, and how it improves on OpenModelZ:

- Scale from zero is single flight: the first held request of a deployment
  begins one cold start and issues one :class:`ScaleWrite`; every further
  request joins it. The write is resolved against the replicas read just
  before a compare-and-set (:meth:`Scaler.resolve_write`), so a gateway that
  loses the race writes nothing.
- Held requests end available (an engine reported the model ready), or with a
  503 and ``Retry-After`` on their own deadline, the startup timeout, a cap on
  held requests, or a crash loop; never by a blind forward. Releasing a
  request (client gone) forgets it.
- The autoscaler (leader only, once a tick) uses load measured in process:
  started requests per second (``rps``) or in-flight plus held (``capacity``),
  over a stable and a panic window; scale-down is stabilised, halved at most
  per tick, and every step is bounded by the scaling factor. Requests started
  at the other gateways count too, or the leader behind a load balancer would
  see 1/N of the rate: each peer reports its cumulative per-model counts
  (:meth:`Scaler.observe_peer_requests`) and their increases are spread over
  the time since its previous report. In-flight load needs no such report:
  engines report their tasks in progress, whichever gateway sent them.
- Scale to zero happens zero-duration after the last request *completed*,
  only when min is 0; the scaler's own writes never reset that clock.
- A crash loop (pods in CrashLoopBackOff/ImagePullBackOff/ErrImagePull, or a
  rollout past its progress deadline) blocks scale-ups with exponential
  backoff and fails held requests at once; the user's min is never
  rewritten; a new deployment generation lifts the block.

:class:`Scaler` composes three sub-machines, each with a record and a file of
its own per deployment: :class:`~protocol.scaling.coldstart.ColdStart`,
:class:`~protocol.scaling.crash.CrashGuard` and
:class:`~protocol.scaling.autoscale.Autoscale`. Its vocabulary (effects,
errors, config) is :mod:`protocol.scaling.types`, re-exported here.

Size (over 600 lines): one state machine (deployment phases, held requests, single-flight cold
starts, idle scale-down, the autoscaler's ticks) whose transitions read each other's state; the
docstring records what it does better than OpenModelZ.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Hashable, Iterable, Mapping
from dataclasses import dataclass, field, replace

from protocol.scaling.autoscale import Autoscale, Load
from protocol.scaling.coldstart import ColdStart, ColdStartPhase, Hold, cold_start_target
from protocol.scaling.crash import CrashGuard, PodCrashes, selects

from protocol.scaling.labels import (
    CRASH_WAITING_REASONS,
    DEFAULT_MAX_REPLICAS,
    DEFAULT_MIN_REPLICAS,
    DEFAULT_SCALE_TYPE,
    DEFAULT_SCALING_FACTOR,
    DEFAULT_STARTUP_TIMEOUT,
    DEFAULT_TARGET_LOAD,
    DEFAULT_ZERO_DURATION,
    FRAMEWORK_LABEL,
    MAX_SCALE_LABEL,
    MIN_SCALE_LABEL,
    MODELS_ANNOTATION,
    SCALABLE_LABEL,
    SCALE_TYPE_LABEL,
    SCALING_FACTOR_LABEL,
    STARTUP_TIMEOUT_LABEL,
    TARGET_LOAD_LABEL,
    ZERO_DURATION_LABEL,
    DeploymentKey,
    DeploymentSnapshot,
    LabelWarning,
    ParsedLabels,
    ScaleType,
    ScalingRemoteError,
    ScalingSettings,
    deployment_snapshot,
    parse_duration,
    parse_models,
    parse_scaling_labels,
    pod_crash_reason,
)
from protocol.scaling.types import (
    ColdStartFinished,
    Effect,
    FailHeld,
    HoldResolved,
    PostEvent,
    ScaleError,
    ScaleReason,
    ScalerConfig,
    ScaleWrite,
    ScalingLocalError,
)

__all__ = [
    "CRASH_WAITING_REASONS", "DEFAULT_MAX_REPLICAS", "DEFAULT_MIN_REPLICAS",
    "DEFAULT_SCALE_TYPE", "DEFAULT_SCALING_FACTOR", "DEFAULT_STARTUP_TIMEOUT",
    "DEFAULT_TARGET_LOAD", "DEFAULT_ZERO_DURATION", "FRAMEWORK_LABEL", "MAX_SCALE_LABEL",
    "MIN_SCALE_LABEL", "MODELS_ANNOTATION", "SCALABLE_LABEL", "SCALE_TYPE_LABEL",
    "SCALING_FACTOR_LABEL", "STARTUP_TIMEOUT_LABEL", "TARGET_LOAD_LABEL",
    "ZERO_DURATION_LABEL", "ColdStartFinished", "ColdStartPhase", "DeploymentKey",
    "DeploymentSnapshot", "Effect", "FailHeld", "HoldResolved", "LabelWarning",
    "ParsedLabels", "PostEvent", "ScaleError", "ScaleReason", "ScaleType", "ScaleWrite",
    "Scaler", "ScalerConfig", "ScalingLocalError", "ScalingRemoteError", "ScalingSettings",
    "cold_start_target",
    "deployment_snapshot", "parse_duration", "parse_models", "parse_scaling_labels",
    "pod_crash_reason",
]



@dataclass
class _Deployment:
    """What the scaler knows of one deployment: its last snapshot and its three sub-machines' records."""

    snapshot: DeploymentSnapshot
    first_seen: float
    cold: ColdStart
    crash: CrashGuard
    auto: Autoscale = field(default_factory=Autoscale)
    warnings_posted: tuple[LabelWarning, ...] = ()

    @property
    def key(self) -> DeploymentKey:
        return self.snapshot.key


class Scaler:
    """Every scaling decision for the deployments one gateway knows about.

    Inputs are method calls taking ``now``; each returns the effects to
    perform, in order. The Twisted side (``infx.scaling.scaler``) feeds it the
    deployment and pod watches, engine readiness, request counters and the
    request counts peer gateways report, whether it holds the leader lease
    (:meth:`lead`), and calls :meth:`handle_timeout` at :meth:`next_deadline`,
    which also runs the autoscaler's ticks while leading.
    """

    def __init__(self, config: ScalerConfig | None = None) -> None:
        self.config = config or ScalerConfig()
        self._deployments: dict[DeploymentKey, _Deployment] = {}
        self._by_model: dict[str, list[DeploymentKey]] = {}
        self._loads: dict[str, Load] = {}
        # Each peer's last report: when, and its cumulative counts (the baseline of the next).
        self._peers: dict[Hashable, tuple[float, dict[str, int]]] = {}
        self._ready: set[str] = set()
        self._holds: dict[Hashable, Hold] = {}
        self._deadlines: list[tuple[float, int, Hashable]] = []
        self._seq = 0
        self._next_tick: float | None = None
        self._leading = False
        self._pods = PodCrashes()

    # -- observations --------------------------------------------------------

    def observe_deployment(self, snapshot: DeploymentSnapshot, now: float) -> list[Effect]:
        """A Deployment was added or changed (watch event, or the result of a read)."""
        effects: list[Effect] = []
        if not snapshot.opted_in:
            return self.forget_deployment(snapshot.key, now)
        dep = self._deployments.get(snapshot.key)
        if dep is None:
            dep = _Deployment(snapshot, now, ColdStart(snapshot.key), CrashGuard.first_seen(snapshot))
            self._deployments[snapshot.key] = dep
        else:
            for model in dep.snapshot.models:
                self._by_model[model].remove(dep.key)
                if not self._by_model[model]:
                    del self._by_model[model]
            dep.crash.observe_snapshot(snapshot)
            dep.snapshot = snapshot
        for model in snapshot.models:
            self._by_model.setdefault(model, []).append(snapshot.key)
            self._by_model[model].sort(key=lambda k: (k.namespace, k.name))
        if snapshot.warnings != dep.warnings_posted:
            dep.warnings_posted = snapshot.warnings
            for warning in snapshot.warnings:
                effects.append(PostEvent(dep.key, "InvalidScalingLabel", warning.message, "Warning"))
        effects.extend(self._check_crash(dep, now))
        if (dep.cold.phase is ColdStartPhase.WAITING and snapshot.replicas == 0 and dep.cold.holds
                and not dep.crash.blocked(now)):
            # Someone took it back to zero while we wait (another gateway's
            # leader going to zero): ask again; resolve_write skips if moot.
            effects.append(self._begin_write(dep, now))
        return effects

    def forget_deployment(self, key: DeploymentKey, now: float) -> list[Effect]:
        """The Deployment was deleted or opted out: its held requests fail with 404."""
        dep = self._deployments.pop(key, None)
        if dep is None:
            return []
        for model in dep.snapshot.models:
            keys = self._by_model[model]
            keys.remove(key)
            if not keys:
                del self._by_model[model]
        error = ScaleError(404, f"deployment {key} no longer serves its models", None, "model_not_found")
        return [self._resolve(dep, hold, False, error, now) for hold in list(dep.cold.holds.values())]

    def observe_pods(self, key: DeploymentKey, crash_reason: str | None, now: float) -> list[Effect]:
        """The deployment's pods changed; ``crash_reason`` from :func:`pod_crash_reason` of any pod."""
        dep = self._deployments.get(key)
        if dep is None:
            return []
        dep.crash.observe_pods(crash_reason)
        return self._check_crash(dep, now)

    def observe_pod(self, namespace: str, name: str, labels: Mapping[str, str], crash_reason: str | None,
                    deleted: bool, now: float) -> list[Effect]:
        """A pod was added, modified or (``deleted``) removed: recheck the deployments selecting it.

        ``crash_reason`` is :func:`pod_crash_reason` of the pod.
        """
        if deleted:
            self._pods.pod_deleted(namespace, name)
        else:
            self._pods.pod_updated(namespace, name, labels, crash_reason)
        effects: list[Effect] = []
        for dep in list(self._deployments.values()):
            if dep.key.namespace == namespace and selects(dep.snapshot.selector, labels):
                effects += self.recheck_pods(dep.key, now)
        return effects

    def recheck_pods(self, key: DeploymentKey, now: float) -> list[Effect]:
        """Tell ``key`` the crash evidence of the pods it selects, as last seen by :meth:`observe_pod`."""
        dep = self._deployments.get(key)
        if dep is None:
            return []
        return self.observe_pods(key, self._pods.reason(key.namespace, dep.snapshot.selector), now)

    def model_ready(self, model: str, now: float) -> list[Effect]:
        """An engine (on any gateway) reported ``model`` ready: its held requests are served."""
        self._ready.add(model)
        effects: list[Effect] = []
        for key in self._by_model.get(model, ()):
            dep = self._deployments[key]
            seconds = dep.cold.finished(now)
            if seconds is not None:
                effects.append(ColdStartFinished(key, seconds))
            for hold in list(dep.cold.holds.values()):
                if hold.model == model:
                    effects.append(self._resolve(dep, hold, True, None, now))
        return effects

    def model_gone(self, model: str, now: float) -> list[Effect]:
        """No engine serves ``model`` any more; later requests for it wait again."""
        self._ready.discard(model)
        return []

    def observe_in_progress(self, model: str, count: int, now: float) -> list[Effect]:
        """Engines reported ``count`` tasks in progress for ``model`` (across all gateways).

        This is what lets the leader see load that arrived at other gateways,
        so it never takes a busy deployment to zero.
        """
        load = self._load(model)
        if count > 0 or load.reported > 0:
            load.last_activity = now
        load.reported = count
        return []

    def request_started(self, model: str, now: float) -> list[Effect]:
        """A request for ``model`` was accepted by this gateway."""
        load = self._load(model)
        load.in_flight += 1
        load.started(now)
        load.last_activity = now
        return []

    def observe_peer_requests(self, peer: Hashable, counts: Mapping[str, int], now: float) -> list[Effect]:
        """Peer gateway ``peer`` reported ``counts``: requests per model it accepted since it started.

        The increase since the peer's previous report counts as requests
        started over the time between the two (at most
        ``peer_report_interval``), as if they had arrived here. A first report
        only sets the baseline; a counter that went down or vanished means the
        peer restarted, so the report becomes the new baseline.
        """
        counts = {model: max(0, count) for model, count in counts.items()}
        previous = self._peers.get(peer)
        self._peers[peer] = (now, counts)
        if previous is None:
            return []
        since, before = previous
        if any(counts.get(model, 0) < count for model, count in before.items()):
            return []
        since = max(since, now - self.config.peer_report_interval)
        for model, count in counts.items():
            increase = count - before.get(model, 0)
            if increase:
                load = self._load(model)
                load.started_over(since, increase, now)
                load.last_activity = now
        return []

    def forget_peer(self, peer: Hashable) -> list[Effect]:
        """``peer``'s reports ended (its stream closed): its next report is a first one."""
        self._peers.pop(peer, None)
        return []

    def request_finished(self, model: str, now: float) -> list[Effect]:
        """A request started with :meth:`request_started` completed (in any way)."""
        load = self._load(model)
        if load.in_flight <= 0:
            raise ScalingLocalError(f"request_finished for {model!r} without request_started")
        load.in_flight -= 1
        load.last_activity = now
        return []

    # -- holds ---------------------------------------------------------------

    def hold_model(self, request_id: Hashable, model: str, deadline: float | None, now: float) -> list[Effect]:
        """A request for ``model`` found no ready engine: wait (until ``deadline``, if any) for a deployment."""
        if model in self._ready:
            return [HoldResolved(request_id, None, True, True, None, 0.0)]
        keys = self._by_model.get(model)
        if not keys:
            error = ScaleError(404, f"no scalable deployment serves model {model!r}", None, "model_not_found")
            return [HoldResolved(request_id, None, False, False, error, 0.0)]
        # Prefer a deployment that can start: scalable, and not blocked by a crash loop.
        key = next((k for k in keys if self._deployments[k].snapshot.settings.scalable
                    and not self._deployments[k].crash.blocked(now)), keys[0])
        return self._hold(request_id, self._deployments[key], model, deadline, now)

    def release(self, request_id: Hashable, now: float) -> list[Effect]:
        """Forget a held request (client gone, or the processor dispatched it itself)."""
        hold = self._holds.pop(request_id, None)
        if hold is None:
            return []
        dep = self._deployments.get(hold.key)
        if dep is not None:
            del dep.cold.holds[request_id]
            dep.cold.hold_left()
        return []

    def serves(self, model: str) -> bool:
        """Whether a scalable deployment lists ``model``, so that a request for it can wait."""
        return any(self._deployments[key].snapshot.settings.scalable for key in self._by_model.get(model, ()))

    def in_progress(self, model: str) -> int:
        """Requests for ``model`` in flight: counted here, or reported by engines, whichever is more."""
        load = self._loads.get(model)
        return max(load.in_flight, load.reported) if load else 0

    def started_rates(self, model: str, now: float) -> tuple[float, float]:
        """(stable, panic) requests per second started for ``model``, here and at reporting peers."""
        load = self._loads.get(model)
        if load is None:
            return 0.0, 0.0
        return load.rates(self.config.stable_window, self.config.panic_window, now)

    def held_count(self, key: DeploymentKey) -> int:
        """Requests held for ``key`` right now."""
        dep = self._deployments.get(key)
        return len(dep.cold.holds) if dep else 0

    def phase(self, key: DeploymentKey) -> ColdStartPhase:
        """Where ``key``'s cold start is."""
        dep = self._deployments.get(key)
        if dep is None:
            raise ScalingLocalError(f"unknown deployment {key}")
        return dep.cold.phase

    def desired(self, key: DeploymentKey) -> int | None:
        """Replicas the last tick wanted for ``key`` (None before the first tick)."""
        dep = self._deployments.get(key)
        return dep.auto.desired if dep else None

    def snapshot(self, key: DeploymentKey) -> DeploymentSnapshot | None:
        """The last observed state of ``key``."""
        dep = self._deployments.get(key)
        return dep.snapshot if dep else None

    def deployments(self) -> list[DeploymentKey]:
        """Every scalable deployment known."""
        return list(self._deployments)

    # -- writes --------------------------------------------------------------

    def resolve_write(self, write: ScaleWrite, current: int, now: float) -> int | None:
        """Replicas to write now that ``current`` was read back, or None to write nothing.

        Called before every compare-and-set attempt, so a gateway that lost
        a race (or a going-to-zero overtaken by a request) stands down.
        """
        dep = self._deployments.get(write.key)
        if dep is None:
            return None
        if write.reason is ScaleReason.COLD_START:
            if current >= 1:
                return None
            if dep.crash.blocked(now):
                return None
            return cold_start_target(len(dep.cold.holds), dep.snapshot.settings)
        if write.reason is ScaleReason.SCALE_TO_ZERO:
            if current != write.from_replicas or not self._idle_long_enough(dep, now):
                return None
            return 0
        if current != write.from_replicas:
            return None
        return write.replicas

    def write_done(self, write: ScaleWrite, written: int | None, now: float) -> list[Effect]:
        """``write`` finished: ``written`` replicas were stored, or None if none was needed."""
        dep = self._deployments.get(write.key)
        if dep is None:
            return []
        effects: list[Effect] = []
        self._take_out(dep, write)
        if write.reason is ScaleReason.COLD_START:
            dep.cold.set_phase(ColdStartPhase.WAITING)
            dep.cold.hold_left()
        if written is not None:
            dep.snapshot = replace(dep.snapshot, replicas=written)
            effects.append(_event_for(write, written))
        if write.reason is ScaleReason.SCALE_TO_ZERO and written == 0:
            # Its engines are on their way out; a request from now on must
            # wait for (and trigger) a cold start, not trust a stale "ready".
            dep.auto.desired = 0
            self._ready.difference_update(dep.snapshot.models)
            if dep.cold.phase is ColdStartPhase.WAITING and dep.cold.holds:
                # A request arrived after this write was resolved: its cold
                # start saw replicas still up and wrote nothing; ask again.
                effects.append(self._begin_write(dep, now))
        return effects

    def _take_out(self, dep: _Deployment, write: ScaleWrite) -> None:
        if write.reason is ScaleReason.COLD_START:
            if dep.cold.write_out != write:
                raise ScalingLocalError(f"{write.key}: no such cold-start write out")
            dep.cold.write_out = None
        else:
            if dep.auto.write_out != write:
                raise ScalingLocalError(f"{write.key}: no such autoscaler write out")
            dep.auto.write_out = None

    def write_failed(self, write: ScaleWrite, message: str, now: float) -> list[Effect]:
        """``write`` could not be made (API error other than a 409 the performer retried)."""
        dep = self._deployments.get(write.key)
        if dep is None:
            return []
        self._take_out(dep, write)
        if write.reason is not ScaleReason.COLD_START:
            return [PostEvent(dep.key, "ScaleFailed", f"{write.reason.value} failed: {message}", "Warning")]
        dep.cold.set_phase(ColdStartPhase.IDLE)
        if dep.cold.holds:
            dep.cold.retry_write_at = now + self.config.write_retry_delay
        return [PostEvent(dep.key, "ScaleFailed", f"scaling from zero failed: {message}", "Warning")]

    # -- time ----------------------------------------------------------------

    def start(self, now: float) -> list[Effect]:
        """Begin the autoscaler's schedule: a tick every ``tick_interval`` from now, while leading."""
        self._next_tick = now + self.config.tick_interval
        return []

    def stop(self) -> list[Effect]:
        """End the schedule (holds keep their own deadlines)."""
        self._next_tick = None
        return []

    def lead(self, leading: bool, now: float) -> list[Effect]:
        """This gateway won or lost the autoscaler's lease; ticks run only while it leads."""
        self._leading = leading
        if self._next_tick is not None:
            while self._next_tick <= now:  # the schedule kept its beat while not leading
                self._next_tick += self.config.tick_interval
        return []

    @property
    def leading(self) -> bool:
        """Whether the autoscaler runs here (see :meth:`lead`)."""
        return self._leading

    def next_deadline(self) -> float | None:
        """When :meth:`handle_timeout` must run next (hold deadlines, startup timeouts, retries)."""
        while self._deadlines and self._deadlines[0][2] not in self._holds:
            heapq.heappop(self._deadlines)
        best = self._deadlines[0][0] if self._deadlines else math.inf
        for dep in self._deployments.values():
            best = min(best, dep.cold.deadline(dep.snapshot.settings.startup_timeout))
        if self._leading and self._next_tick is not None:
            best = min(best, self._next_tick)
        return None if best == math.inf else best

    def handle_timeout(self, now: float) -> list[Effect]:
        """Expire holds past their deadline or startup timeout; retry failed cold-start writes; tick.

        A tick that fell due runs once however late (missed ones are skipped).
        """
        effects: list[Effect] = []
        while self._deadlines and self._deadlines[0][0] <= now:
            _, _, request_id = heapq.heappop(self._deadlines)
            hold = self._holds.get(request_id)
            if hold is None or hold.deadline > now:
                continue
            dep = self._deployments[hold.key]
            error = ScaleError(503, f"model {hold.model} is still starting and the "
                               "request's deadline passed", self.config.retry_after)
            effects.append(self._resolve(dep, hold, False, error, now))
        for dep in list(self._deployments.values()):
            if dep.cold.timed_out(dep.snapshot.settings.startup_timeout, now):
                message = (f"deployment {dep.key} did not become ready within "
                           f"{dep.snapshot.settings.startup_timeout:g}s")
                error = ScaleError(503, message, self.config.retry_after)
                effects.extend(self._fail_all(dep, error, now))
                effects.extend(FailHeld(model, error) for model in dep.snapshot.models)
                effects.append(PostEvent(dep.key, "StartupTimeout", message, "Warning"))
                dep.cold.abandon()
            if dep.cold.retry_write_at is not None and now >= dep.cold.retry_write_at:
                dep.cold.retry_write_at = None
                if dep.cold.holds and dep.cold.phase is ColdStartPhase.IDLE and not dep.crash.blocked(now):
                    effects.append(self._begin_write(dep, now))
        if self._next_tick is not None and now >= self._next_tick:
            while self._next_tick <= now:
                self._next_tick += self.config.tick_interval
            if self._leading:
                effects.extend(self.tick(now))
        return effects

    # -- autoscaler ----------------------------------------------------------

    def tick(self, now: float) -> list[Effect]:
        """One autoscaler pass over every deployment (:meth:`handle_timeout` runs it on schedule)."""
        effects: list[Effect] = []
        cfg = self.config
        for dep in self._deployments.values():
            settings = dep.snapshot.settings
            if not settings.scalable or dep.cold.write_out is not None or dep.auto.write_out is not None:
                continue
            current = dep.snapshot.replicas
            stable, panic = self._measure(dep, now)
            if current == 0:
                dep.auto.desired = 0
                continue
            if dep.cold.phase is not ColdStartPhase.IDLE:
                continue
            if settings.min_replicas == 0 and self._idle_long_enough(dep, now):
                dep.auto.desired = 0
                dep.auto.write_out = ScaleWrite(dep.key, current, 0, ScaleReason.SCALE_TO_ZERO)
                effects.append(dep.auto.write_out)
                continue
            want = dep.auto.decide(current, stable, panic, settings, cfg, dep.crash.blocked(now), now)
            if want != current:
                reason = ScaleReason.SCALE_UP if want > current else ScaleReason.SCALE_DOWN
                dep.auto.write_out = ScaleWrite(dep.key, current, want, reason)
                effects.append(dep.auto.write_out)
        return effects

    # -- internals -----------------------------------------------------------

    def _load(self, model: str) -> Load:
        load = self._loads.get(model)
        if load is None:
            load = self._loads[model] = Load()
        return load

    def _measure(self, dep: _Deployment, now: float) -> tuple[float, float]:
        """(stable, panic) load of ``dep`` in its scale type's unit."""
        settings = dep.snapshot.settings
        if settings.scale_type is ScaleType.RPS:
            stable = panic = 0.0
            for model in dep.snapshot.models:
                s, p = self.started_rates(model, now)
                stable += s
                panic += p
            return stable, panic
        value = float(len(dep.cold.holds))
        for model in dep.snapshot.models:
            load = self._loads.get(model)
            if load is not None:
                value += max(load.in_flight, load.reported)
        return dep.auto.capacity(value, self.config, now)

    def _idle_long_enough(self, dep: _Deployment, now: float) -> bool:
        if dep.cold.holds:
            return False
        last = dep.first_seen
        for model in dep.snapshot.models:
            load = self._loads.get(model)
            if load is None:
                continue
            if load.in_flight or load.reported:
                return False
            last = max(last, load.last_activity)
        return now >= last + dep.snapshot.settings.zero_duration

    def _check_crash(self, dep: _Deployment, now: float) -> list[Effect]:
        """Start a block episode when crash evidence appears outside a running backoff."""
        backoff = dep.crash.check(self.config.crash_backoff, self.config.crash_backoff_max, now)
        if backoff is None:
            return []
        message = f"deployment {dep.key} cannot start: {dep.crash.reason()}"
        effects: list[Effect] = [PostEvent(dep.key, "CrashLoop", f"{message}; scale-ups blocked for "
                                           f"{backoff:g}s", "Warning")]
        error = ScaleError(503, message, backoff, "engine_crash_loop")
        effects.extend(self._fail_all(dep, error, now))
        for model in dep.snapshot.models:
            effects.append(FailHeld(model, error))
        dep.cold.abandon()
        return effects

    def _hold(self, request_id: Hashable, dep: _Deployment, model: str, deadline: float | None,
              now: float) -> list[Effect]:
        if request_id in self._holds:
            raise ScalingLocalError(f"request {request_id!r} is already held")
        settings = dep.snapshot.settings
        if not settings.scalable:
            error = ScaleError(503, f"deployment {dep.key} is not scalable (max replicas is 0)", None,
                               "model_not_scalable")
            return [HoldResolved(request_id, dep.key, False, True, error, 0.0)]
        if dep.crash.blocked(now):
            reason, left = dep.crash.refusal(now)
            error = ScaleError(503, f"deployment {dep.key} cannot start: {reason}",
                               left or self.config.retry_after, "engine_crash_loop")
            effects: list[Effect] = [HoldResolved(request_id, dep.key, False, True, error, 0.0)]
            if dep.crash.announce():
                effects.append(PostEvent(dep.key, "ScaleUpBlocked",
                                         f"request held for {dep.key} refused: {reason}", "Warning"))
            return effects
        if len(dep.cold.holds) >= self.config.held_cap:
            error = ScaleError(503, f"too many requests waiting for deployment {dep.key}",
                               self.config.retry_after, "too_many_waiting")
            return [HoldResolved(request_id, dep.key, False, True, error, 0.0)]
        hold = Hold(request_id, dep.key, model, now, math.inf if deadline is None else deadline)
        self._holds[request_id] = hold
        dep.cold.holds[request_id] = hold
        if deadline is not None:
            self._seq += 1
            heapq.heappush(self._deadlines, (deadline, self._seq, request_id))
        self._load(model).last_activity = now
        if dep.cold.phase is ColdStartPhase.IDLE and dep.cold.retry_write_at is None:
            dep.cold.start(now)
            if dep.snapshot.replicas >= 1:
                dep.cold.set_phase(ColdStartPhase.WAITING)
                return []
            return [self._begin_write(dep, now)]
        return []

    def _begin_write(self, dep: _Deployment, now: float) -> ScaleWrite:
        return dep.cold.begin_write(dep.snapshot.replicas, dep.snapshot.settings, now)

    def _resolve(self, dep: _Deployment, hold: Hold, available: bool, error: ScaleError | None,
                 now: float) -> HoldResolved:
        self._holds.pop(hold.request_id, None)
        dep.cold.holds.pop(hold.request_id, None)
        dep.cold.hold_left()
        return HoldResolved(hold.request_id, dep.key, available, True, error, now - hold.since)

    def _fail_all(self, dep: _Deployment, error: ScaleError, now: float) -> Iterable[Effect]:
        return [self._resolve(dep, hold, False, error, now) for hold in list(dep.cold.holds.values())]


def _event_for(write: ScaleWrite, written: int) -> PostEvent:
    if write.reason is ScaleReason.COLD_START:
        return PostEvent(write.key, "ScaledFromZero",
                         f"scaled from 0 to {written} replicas for held requests")
    if write.reason is ScaleReason.SCALE_TO_ZERO:
        return PostEvent(write.key, "ScaledToZero", "scaled to 0 replicas after idling")
    verb = "up" if write.reason is ScaleReason.SCALE_UP else "down"
    return PostEvent(write.key, "Scaled", f"scaled {verb} from {write.from_replicas} to {written} replicas")
