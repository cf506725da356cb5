"""One deployment's crash guard: crash evidence, and the scale-up block it earns (exponential backoff).

Rules this file keeps: no I/O, no clock reads (``now`` comes in, last).
Evidence is a pod's waiting reason (CrashLoopBackOff, ImagePullBackOff,
ErrImagePull) or a rollout past its progress deadline. Evidence appearing
outside a running block begins an episode that blocks scale-ups for
``crash_backoff * 2**(episodes-1)`` seconds (capped); evidence that flickers
inside it (a pod between restarts) does not. A new generation of the pod
template (new image, new args) lifts everything; one that only changed
replicas (every scale write bumps it) lifts nothing. :class:`PodCrashes`
keeps the pods seen, so that a deployment learns its pods' evidence.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from protocol.scaling.labels import DeploymentKey, DeploymentSnapshot

__all__ = ["CrashGuard", "PodCrashes", "selects"]


@dataclass
class CrashGuard:
    """The crash evidence and scale-up block of deployment ``key``."""

    key: DeploymentKey
    seen_generation: int
    seen_template: str
    progress_failure: str | None = None
    from_pods: str | None = None
    crashing: bool = False
    block_count: int = 0
    blocked_until: float = -math.inf
    block_reason: str | None = None
    announced: bool = False
    """Whether a refused request already posted this episode's ScaleUpBlocked Event."""

    @classmethod
    def first_seen(cls, snapshot: DeploymentSnapshot) -> CrashGuard:
        return cls(snapshot.key, snapshot.generation, snapshot.template_hash, snapshot.progress_failure)

    def observe_snapshot(self, snapshot: DeploymentSnapshot) -> None:
        """A newer state of the Deployment; a new pod template lifts the block."""
        if snapshot.generation > self.seen_generation and snapshot.template_hash != self.seen_template:
            self.block_count = 0
            self.blocked_until = -math.inf
            self.block_reason = None
            self.announced = False
            self.from_pods = None
            self.crashing = False
        if snapshot.generation >= self.seen_generation:
            self.seen_generation = snapshot.generation
            self.seen_template = snapshot.template_hash
        self.progress_failure = snapshot.progress_failure

    def observe_pods(self, reason: str | None) -> None:
        """The crash reason of the deployment's pods now (None: none crashes)."""
        self.from_pods = reason

    def reason(self) -> str | None:
        """The crash evidence seen now, if any."""
        return self.from_pods or self.progress_failure

    def blocked(self, now: float) -> bool:
        """Whether scale-ups are refused now."""
        return self.reason() is not None or now < self.blocked_until

    def check(self, backoff: float, backoff_max: float, now: float) -> float | None:
        """Seconds of the block an episode beginning now earns, or None if none begins."""
        reason = self.reason()
        was_crashing, self.crashing = self.crashing, reason is not None
        if reason is None or was_crashing:
            return None
        if now < self.blocked_until:
            self.block_reason = reason  # evidence flickering inside one episode
            return None
        self.block_count += 1
        seconds: float = min(backoff * 2.0 ** (self.block_count - 1), backoff_max)
        self.blocked_until = now + seconds
        self.block_reason = reason
        self.announced = False
        return seconds

    def refusal(self, now: float) -> tuple[str, float]:
        """Why a request is refused while blocked, and the seconds the block has left (0: unknown)."""
        return self.reason() or self.block_reason or "crash loop", max(0.0, self.blocked_until - now)

    def announce(self) -> bool:
        """True once per episode: the first refused request posts an Event."""
        first, self.announced = not self.announced, True
        return first


def selects(selector: Mapping[str, str], labels: Mapping[str, str]) -> bool:
    """Whether a deployment's ``matchLabels`` select a pod with ``labels`` (an empty selector selects none)."""
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


class PodCrashes:
    """The pods seen, by namespace and name: their labels and crash reason (None: not crashing)."""

    def __init__(self) -> None:
        self._pods: dict[tuple[str, str], tuple[Mapping[str, str], str | None]] = {}

    def pod_updated(self, namespace: str, name: str, labels: Mapping[str, str], reason: str | None) -> None:
        self._pods[(namespace, name)] = (dict(labels), reason)

    def pod_deleted(self, namespace: str, name: str) -> None:
        self._pods.pop((namespace, name), None)

    def reason(self, namespace: str, selector: Mapping[str, str]) -> str | None:
        """The crash reason of a pod in ``namespace`` that ``selector`` selects, if any crashes."""
        if not selector:
            return None
        for (pod_namespace, _), (labels, reason) in self._pods.items():
            if reason is not None and pod_namespace == namespace and selects(selector, labels):
                return reason
        return None
