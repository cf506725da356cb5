"""The scaler's vocabulary: its errors, effects and configuration (values only, no behaviour).

Rules this file keeps: every effect is a frozen dataclass the Twisted layer
performs; :class:`ScalingLocalError` is the caller's misuse (the cluster's
misbehaviour is :class:`~protocol.scaling.labels.ScalingRemoteError`); an
error answered to a client carries its HTTP status, message and
``Retry-After``. Shared by :mod:`protocol.scaling.scaler` and its sub-machines.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any, Union

from protocol.errors import LocalUsageError
from protocol.openai.errors import error_body
from protocol.scaling.labels import DeploymentKey

__all__ = [
    "ColdStartFinished", "Effect", "FailHeld", "HoldResolved", "PostEvent", "ScaleError", "ScaleReason",
    "ScaleWrite", "ScalerConfig", "ScalingLocalError",
]


class ScalingLocalError(LocalUsageError):
    """The caller drove the scaler out of turn (a bug in the caller, not the cluster)."""


@dataclass(frozen=True)
class ScaleError:
    """Why a held request was not served, in the terms the gateway answers with."""

    http_status: int
    message: str
    retry_after: float | None = None
    """Seconds for the ``Retry-After`` header; None when retrying cannot help."""
    code: str = "model_unavailable"

    def openai_body(self) -> dict[str, Any]:
        """The OpenAI-style error body for this answer."""
        return error_body(self.http_status, self.message, code=self.code)

    def headers(self) -> dict[str, str]:
        """``Retry-After`` (whole seconds, at least 1) when there is one."""
        if self.retry_after is None:
            return {}
        return {"Retry-After": str(max(1, math.ceil(self.retry_after)))}


class ScaleReason(str, enum.Enum):
    """Why a replica count is written; also the label of the scale-writes metric."""

    COLD_START = "cold_start"
    SCALE_UP = "scale_up"
    SCALE_DOWN = "scale_down"
    SCALE_TO_ZERO = "scale_to_zero"


@dataclass(frozen=True)
class ScaleWrite:
    """Set ``key``'s replicas to ``replicas``, decided while it had ``from_replicas``.

    The performer reads the Scale, passes the replicas it read to
    :meth:`Scaler.resolve_write` (which may cancel or change the write), and
    replaces it with the resourceVersion it read; on 409 it reads and resolves
    again. It reports back with :meth:`Scaler.write_done` or
    :meth:`Scaler.write_failed`.
    """

    key: DeploymentKey
    from_replicas: int
    replicas: int
    reason: ScaleReason


@dataclass(frozen=True)
class HoldResolved:
    """A held request's wait is over: ``available``, or failed with ``error``."""

    request_id: Hashable
    key: DeploymentKey | None
    available: bool
    found: bool
    error: ScaleError | None
    waited: float


@dataclass(frozen=True)
class FailHeld:
    """Fail every task the processor holds for ``model`` (the scaler's own holds get HoldResolved)."""

    model: str
    error: ScaleError


@dataclass(frozen=True)
class PostEvent:
    """Record a Kubernetes Event on the deployment (best effort: a failure blocks nothing)."""

    key: DeploymentKey
    reason: str
    message: str
    type: str = "Normal"


@dataclass(frozen=True)
class ColdStartFinished:
    """A cold start ended with an engine ready, ``seconds`` after it began (for the histogram)."""

    key: DeploymentKey
    seconds: float


Effect = Union[ScaleWrite, HoldResolved, FailHeld, PostEvent, ColdStartFinished]


@dataclass(frozen=True)
class ScalerConfig:
    """Every tunable of the scaler, with the defaults of issue #7."""

    tick_interval: float = 1.0
    """Seconds between autoscaler ticks (a deadline of the machine's, while it leads)."""
    stable_window: float = 60.0
    """Seconds of load averaged for ordinary decisions."""
    panic_window: float = 6.0
    """Seconds of load averaged to detect a burst."""
    panic_threshold: float = 2.0
    """Panic when the panic-window load needs this many times the current replicas."""
    scale_down_window: float = 60.0
    """Seconds a lower desired count must persist before scaling down (its highest value wins)."""
    max_scale_down_ratio: float = 0.5
    """At most this share of the replicas goes away in one tick."""
    held_cap: int = 1000
    """Held requests per deployment beyond which new ones are answered 503 at once."""
    crash_backoff: float = 10.0
    """First scale-up block after a crash loop; doubles each time, up to ``crash_backoff_max``."""
    crash_backoff_max: float = 600.0
    write_retry_delay: float = 1.0
    """Seconds before a cold-start write that failed (not a 409) is tried again."""
    retry_after: float = 10.0
    """``Retry-After`` on an expired hold or a full hold queue."""
    peer_report_interval: float = 10.0
    """Seconds between a peer gateway's reports while its counts change (its status interval):
    the longest span a reported increase is spread back over, so that a burst after an idle
    spell is not diluted over the whole spell."""

    def __post_init__(self) -> None:
        if min(self.tick_interval, self.stable_window, self.panic_window, self.peer_report_interval) <= 0:
            raise ScalingLocalError("tick interval, windows and peer report interval must be positive")
        if not 0 < self.max_scale_down_ratio <= 1:
            raise ScalingLocalError("max_scale_down_ratio must be in (0, 1]")
        if self.held_cap < 1:
            raise ScalingLocalError("held_cap must be at least 1")
