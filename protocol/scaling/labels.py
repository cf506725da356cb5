"""Scaling settings read from a Deployment's labels and annotations: pure parsing, no I/O.

Rules this file keeps: no I/O and no clock reads; an invalid value never
raises, it falls back to the default and yields a :class:`LabelWarning` the
caller logs and posts as a Kubernetes Event; only a Deployment object that is
not a Deployment at all (no name) is a remote error.

The label names and defaults keep OpenModelZ's (``ai.tensorchord.scale.*``)
so that deployments written for it work unchanged; infx adds its own opt-in
label, model list annotation and startup timeout under ``infx.io/``.
"""

from __future__ import annotations

import enum
import hashlib
import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from protocol.errors import RemoteProtocolError

DEFAULT_MIN_REPLICAS = 1
DEFAULT_MAX_REPLICAS = 5
DEFAULT_ZERO_DURATION = 180.0
"""Seconds without any request before a deployment with min 0 goes to zero."""
DEFAULT_SCALING_FACTOR = 10
"""Percentage of max replicas one autoscaling step may move."""
DEFAULT_TARGET_LOAD = 10.0
"""Load one replica is meant to carry (requests/s or concurrent requests)."""
DEFAULT_STARTUP_TIMEOUT = 600.0
"""Seconds a cold start may take before its held requests are answered 503."""


class ScaleType(str, enum.Enum):
    """What the target load measures."""

    RPS = "rps"
    """Started requests per second."""
    CAPACITY = "capacity"
    """Requests in flight plus requests held waiting for an engine."""


DEFAULT_SCALE_TYPE = ScaleType.CAPACITY

MIN_SCALE_LABEL = "ai.tensorchord.scale.min"
MAX_SCALE_LABEL = "ai.tensorchord.scale.max"
SCALING_FACTOR_LABEL = "ai.tensorchord.scale.factor"
TARGET_LOAD_LABEL = "ai.tensorchord.scale.target"
ZERO_DURATION_LABEL = "ai.tensorchord.scale.zero-duration"
SCALE_TYPE_LABEL = "ai.tensorchord.scale.type"
FRAMEWORK_LABEL = "ai.tensorchord.framework"
SCALABLE_LABEL = "infx.io/scalable"
"""Opt-in label; the watch selects ``infx.io/scalable=true``."""
MODELS_ANNOTATION = "infx.io/models"
"""Comma-separated model ids the deployment's engines serve."""
STARTUP_TIMEOUT_LABEL = "infx.io/startup-timeout"

_DURATION_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(h|ms|m|s)")
_DURATION_UNITS = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 0.001}


class ScalingRemoteError(RemoteProtocolError):
    """The Kubernetes API handed us an object we cannot interpret.

    Carries the HTTP status the gateway answers with when this blocks a
    request: 502, since the upstream (the API server) misbehaved.
    """

    http_status = 502


def parse_duration(text: str) -> float | None:
    """Seconds for ``"90"``, ``"1.5"``, ``"3m"``, ``"5m0s"``, ``"1h30m"``, ``"250ms"``.

    The unit forms are the subset of Go's ``time.ParseDuration`` that
    OpenModelZ users write; a bare number is seconds. Returns None for
    anything else, including negative and empty values, so that the caller
    can fall back to the default with a warning.
    """
    text = text.strip()
    if not text:
        return None
    try:
        seconds = float(text)
    except ValueError:
        pos = 0
        seconds = 0.0
        for match in _DURATION_PART.finditer(text):
            if match.start() != pos:
                return None
            seconds += float(match.group(1)) * _DURATION_UNITS[match.group(2)]
            pos = match.end()
        if pos != len(text) or pos == 0:
            return None
    if not math.isfinite(seconds) or seconds < 0:
        return None
    return seconds


@dataclass(frozen=True)
class LabelWarning:
    """A label value that was ignored or adjusted, and what was used instead."""

    label: str
    value: str
    used: str
    reason: str

    @property
    def message(self) -> str:
        """One line for the log and the Kubernetes Event."""
        return f"{self.label}={self.value!r} {self.reason}; using {self.used}"


@dataclass(frozen=True)
class ScalingSettings:
    """The effective scaling settings of one deployment, after defaults and fixes."""

    min_replicas: int = DEFAULT_MIN_REPLICAS
    max_replicas: int = DEFAULT_MAX_REPLICAS
    target_load: float = DEFAULT_TARGET_LOAD
    scale_type: ScaleType = DEFAULT_SCALE_TYPE
    zero_duration: float = DEFAULT_ZERO_DURATION
    scaling_factor: int = DEFAULT_SCALING_FACTOR
    startup_timeout: float = DEFAULT_STARTUP_TIMEOUT
    framework: str = ""

    @property
    def scalable(self) -> bool:
        """``max = 0`` opts a deployment out of every scaling decision."""
        return self.max_replicas > 0

    @property
    def step(self) -> int:
        """Most replicas one autoscaling step may add or remove (OpenFaaS's factor rule)."""
        return max(1, math.ceil(self.max_replicas * self.scaling_factor / 100))


@dataclass(frozen=True)
class ParsedLabels:
    """Settings plus every warning produced while reading them."""

    settings: ScalingSettings
    warnings: tuple[LabelWarning, ...] = field(default=())


def _int_label(
    labels: Mapping[str, str], name: str, default: int, low: int, high: int | None,
    warnings: list[LabelWarning],
) -> tuple[int, bool]:
    raw = labels.get(name)
    if raw is None:
        return default, False
    text = raw.strip()
    if re.fullmatch(r"\+?\d+", text):
        value = int(text)
        if value >= low and (high is None or value <= high):
            return value, True
    bound = f"an integer >= {low}" if high is None else f"an integer in {low}..{high}"
    warnings.append(LabelWarning(name, raw, str(default), f"is not {bound}"))
    return default, False


def _duration_label(
    labels: Mapping[str, str], name: str, default: float, warnings: list[LabelWarning],
) -> float:
    raw = labels.get(name)
    if raw is None:
        return default
    value = parse_duration(raw)
    if value is None or value <= 0:
        warnings.append(LabelWarning(
            name, raw, f"{default:g}s", "is not a positive duration (e.g. 3m, 5m0s, 90)"))
        return default
    return value


def parse_scaling_labels(labels: Mapping[str, str]) -> ParsedLabels:
    """Read OpenModelZ's scaling labels (plus ``infx.io/startup-timeout``).

    Every invalid value falls back to its default with a warning. ``max <
    min`` raises max to min (with a warning) rather than guessing which one the
    user meant to be smaller; an explicit ``max = 0`` marks the deployment not
    scalable and is left alone.
    """
    warnings: list[LabelWarning] = []
    min_replicas, _ = _int_label(labels, MIN_SCALE_LABEL, DEFAULT_MIN_REPLICAS, 0, None, warnings)
    max_replicas, max_given = _int_label(
        labels, MAX_SCALE_LABEL, DEFAULT_MAX_REPLICAS, 0, None, warnings)
    if max_replicas < min_replicas and not (max_given and max_replicas == 0):
        warnings.append(LabelWarning(
            MAX_SCALE_LABEL, labels.get(MAX_SCALE_LABEL, str(max_replicas)), str(min_replicas),
            f"is below {MIN_SCALE_LABEL}={min_replicas}"))
        max_replicas = min_replicas
    factor, _ = _int_label(
        labels, SCALING_FACTOR_LABEL, DEFAULT_SCALING_FACTOR, 1, 100, warnings)

    target = DEFAULT_TARGET_LOAD
    raw_target = labels.get(TARGET_LOAD_LABEL)
    if raw_target is not None:
        try:
            parsed = float(raw_target.strip())
        except ValueError:
            parsed = math.nan
        if math.isfinite(parsed) and parsed > 0:
            target = parsed
        else:
            warnings.append(LabelWarning(
                TARGET_LOAD_LABEL, raw_target, f"{DEFAULT_TARGET_LOAD:g}", "is not a positive number"))

    scale_type = DEFAULT_SCALE_TYPE
    raw_type = labels.get(SCALE_TYPE_LABEL)
    if raw_type is not None:
        try:
            scale_type = ScaleType(raw_type.strip().lower())
        except ValueError:
            warnings.append(LabelWarning(
                SCALE_TYPE_LABEL, raw_type, DEFAULT_SCALE_TYPE.value, "is not rps or capacity"))

    zero = _duration_label(labels, ZERO_DURATION_LABEL, DEFAULT_ZERO_DURATION, warnings)
    startup = _duration_label(labels, STARTUP_TIMEOUT_LABEL, DEFAULT_STARTUP_TIMEOUT, warnings)
    settings = ScalingSettings(
        min_replicas=min_replicas, max_replicas=max_replicas, target_load=target,
        scale_type=scale_type, zero_duration=zero, scaling_factor=factor,
        startup_timeout=startup, framework=labels.get(FRAMEWORK_LABEL, ""),
    )
    return ParsedLabels(settings, tuple(warnings))


def parse_models(annotation: str | None) -> tuple[str, ...]:
    """Model ids from ``infx.io/models``: comma-separated, blanks and repeats dropped."""
    if not annotation:
        return ()
    seen: dict[str, None] = {}
    for part in annotation.split(","):
        model = part.strip()
        if model:
            seen.setdefault(model, None)
    return tuple(seen)


CRASH_WAITING_REASONS = frozenset({"CrashLoopBackOff", "ImagePullBackOff", "ErrImagePull"})


def pod_crash_reason(pod: Mapping[str, Any]) -> str | None:
    """Why a pod (a Kubernetes JSON object) can never become ready, or None.

    Looks at the waiting reason of every init and app container; only the
    reasons that do not heal by waiting count (CrashLoopBackOff,
    ImagePullBackOff, ErrImagePull).
    """
    status = pod.get("status") or {}
    for kind in ("initContainerStatuses", "containerStatuses"):
        for container in status.get(kind) or ():
            waiting = ((container.get("state") or {}).get("waiting")) or {}
            reason = waiting.get("reason")
            if reason in CRASH_WAITING_REASONS:
                name = container.get("name", "?")
                detail = waiting.get("message")
                text = f"container {name} in {reason}"
                return f"{text}: {detail}" if detail else text
    return None


@dataclass(frozen=True)
class DeploymentKey:
    """Namespace and name: how the scaler refers to a deployment."""

    namespace: str
    name: str

    def __str__(self) -> str:
        return f"{self.namespace}/{self.name}"


@dataclass(frozen=True)
class DeploymentSnapshot:
    """What the scaler needs from one observed Deployment object."""

    key: DeploymentKey
    settings: ScalingSettings
    models: tuple[str, ...]
    replicas: int
    available_replicas: int
    generation: int
    opted_in: bool
    progress_failure: str | None = None
    """Set when the rollout exceeded its progress deadline."""
    warnings: tuple[LabelWarning, ...] = ()
    annotations: Mapping[str, str] = field(default_factory=dict)
    labels: Mapping[str, str] = field(default_factory=dict)
    selector: Mapping[str, str] = field(default_factory=dict)
    """``spec.selector.matchLabels``: which pods belong to it."""
    template_hash: str = ""
    """Digest of ``spec.template``: changes when the pods would (image, args), not on a scale."""


def deployment_snapshot(deployment: Mapping[str, Any]) -> DeploymentSnapshot:
    """Read a Deployment as the API server serialises it (camelCase JSON).

    ``spec.replicas`` absent means 1, the API server's default for a
    Deployment (unlike a Scale, where an absent value means 0).
    """
    metadata = deployment.get("metadata") or {}
    name = metadata.get("name")
    if not isinstance(name, str) or not name:
        raise ScalingRemoteError("deployment without metadata.name")
    namespace = metadata.get("namespace") or "default"
    labels: Mapping[str, str] = metadata.get("labels") or {}
    annotations: Mapping[str, str] = metadata.get("annotations") or {}
    spec = deployment.get("spec") or {}
    status = deployment.get("status") or {}
    parsed = parse_scaling_labels(labels)
    warnings = list(parsed.warnings)
    opted_in = str(labels.get(SCALABLE_LABEL, "")).lower() == "true"
    models = parse_models(annotations.get(MODELS_ANNOTATION))
    if opted_in and not models:
        warnings.append(LabelWarning(
            MODELS_ANNOTATION, annotations.get(MODELS_ANNOTATION, ""), "no models",
            "lists no model, so no request can wake this deployment"))
    progress_failure = None
    for condition in status.get("conditions") or ():
        if condition.get("type") == "Progressing" and condition.get("reason") == "ProgressDeadlineExceeded":
            progress_failure = condition.get("message") or "rollout exceeded its progress deadline"
    replicas = spec.get("replicas")
    return DeploymentSnapshot(
        key=DeploymentKey(namespace, name),
        settings=parsed.settings,
        models=models,
        replicas=1 if replicas is None else int(replicas),
        available_replicas=int(status.get("availableReplicas") or 0),
        generation=int(metadata.get("generation") or 0),
        opted_in=opted_in,
        progress_failure=progress_failure,
        warnings=tuple(warnings),
        annotations=dict(annotations),
        labels=dict(labels),
        selector=dict(((spec.get("selector") or {}).get("matchLabels")) or {}),
        template_hash=hashlib.sha256(
            json.dumps(spec.get("template") or {}, sort_keys=True).encode()).hexdigest()[:16],
    )
