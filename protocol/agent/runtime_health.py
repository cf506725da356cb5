"""Whether the runtime behind an engine agent answers: its health check as a state machine; pure.

Rules this file keeps: no I/O, no clock reads. Inputs are method calls that
take ``now`` (last, never defaulted) and return effects as frozen
dataclasses; ``next_deadline()`` says when to call ``handle_timeout(now)``. The caller performs a
:class:`CheckRuntime` (an HTTP GET of ``path`` on the runtime) and reports
its outcome with the check's ``check_id``; an outcome of a check that was
abandoned (it timed out) is ignored.

States (``HealthState``)::

    UNKNOWN -> UP | DOWN    the first check answered / failed
    UP      -> DOWN         a check failed, or timed out
    DOWN    -> UP           a check answered

Checks run at start, every ``interval`` seconds while up, every
``down_interval`` while down or unknown (a loading runtime becomes ready
between two checks), and at once when a task could not reach the runtime
(``connection_failed``). The path is ``/health`` (vLLM, SGLang, llama.cpp's
own server) until the runtime answers it 404 or 405: then ``GET /v1/models``
(llama-cpp-python, Ollama) for good. A server that has neither (404 or 405
there too) is up whenever it answers at all: that is the only sign it
gives. With ``list_models`` the check is ``GET /v1/models`` from the start,
since its answer also says which models the runtime serves: any answer but
a 2xx with a model list counts as a failure there.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from enum import Enum

from protocol.errors import LocalUsageError

__all__ = [
    "CheckRuntime", "HealthConfig", "HealthEffect", "HealthState", "HealthUsageError", "ReadinessChanged",
    "RuntimeHealth", "listed_models",
]

HEALTH_PATH = "/health"
MODELS_PATH = "/v1/models"
#: Answers to /health that mean "this runtime has no such endpoint".
_NO_HEALTH_ENDPOINT = frozenset({404, 405})


class HealthUsageError(LocalUsageError):
    """The caller drove the machine wrongly (bad config, start twice)."""


class HealthState(Enum):
    """What the last check said."""

    UNKNOWN = "unknown"
    UP = "up"
    DOWN = "down"


@dataclass(frozen=True)
class HealthConfig:
    """``interval``: seconds between checks while the runtime is up; ``down_interval``: while
    it is down or not yet known; ``timeout``: a check not answered in this long failed;
    ``list_models``: learn the served models from ``GET /v1/models``."""

    interval: float = 5.0
    down_interval: float = 1.0
    timeout: float = 5.0
    list_models: bool = False

    def __post_init__(self) -> None:
        for name in ("interval", "down_interval", "timeout"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise HealthUsageError(f"{name} must be a finite number > 0")


@dataclass(frozen=True)
class CheckRuntime:
    """GET ``path`` on the runtime; report with ``check_answered`` or ``check_failed``."""

    check_id: int
    path: str


@dataclass(frozen=True)
class ReadinessChanged:
    """The runtime's readiness (or its list of models) changed; ``reason`` says why, for the log."""

    ready: bool
    models: tuple[str, ...]
    reason: str


HealthEffect = CheckRuntime | ReadinessChanged


def listed_models(body: bytes) -> tuple[str, ...] | None:
    """The model ids of an OpenAI ``GET /v1/models`` answer, in order; None if it is not one."""
    try:
        document = json.loads(body)
    except (UnicodeDecodeError, ValueError):
        return None
    data = document.get("data") if isinstance(document, dict) else None
    if not isinstance(data, list):
        return None
    ids: list[str] = []
    for entry in data:
        model = entry.get("id") if isinstance(entry, dict) else None
        if not isinstance(model, str) or not model:
            return None
        ids.append(model)
    return tuple(dict.fromkeys(ids))


class RuntimeHealth:
    """The health check's state machine; see the module docstring."""

    def __init__(self, config: HealthConfig) -> None:
        self.config = config
        self.state = HealthState.UNKNOWN
        self.models: tuple[str, ...] = ()
        self.path = MODELS_PATH if config.list_models else HEALTH_PATH
        self._started = False
        self._next_id = 1
        self._in_flight: int | None = None
        self._in_flight_since = 0.0
        self._next_check: float | None = None

    @property
    def ready(self) -> bool:
        return self.state is HealthState.UP

    def next_deadline(self) -> float | None:
        """When ``handle_timeout`` must run next, or None."""
        if self._in_flight is not None:
            return self._in_flight_since + self.config.timeout
        return self._next_check

    def start(self, now: float) -> list[HealthEffect]:
        """The first check."""
        if self._started:
            raise HealthUsageError("start() twice")
        self._started = True
        return [self._check(now)]

    def check_answered(self, check_id: int, status: int, body: bytes, now: float) -> list[HealthEffect]:
        """The runtime answered check ``check_id`` with ``status`` and ``body``."""
        if check_id != self._in_flight:
            return []
        self._in_flight = None
        if self.path == HEALTH_PATH and status in _NO_HEALTH_ENDPOINT:
            self.path = MODELS_PATH
            return [self._check(now)]
        if not self.config.list_models and status in _NO_HEALTH_ENDPOINT:
            return self._up(now, self.models, f"the runtime answers, with no {HEALTH_PATH} nor {MODELS_PATH}")
        if not 200 <= status < 300:
            return self._down(now, f"{self.path} answered {status}")
        models = self.models
        if self.config.list_models:
            listed = listed_models(body)
            if listed is None:
                return self._down(now, f"{self.path} answered {status} without a model list")
            models = listed
        return self._up(now, models, f"{self.path} answered")

    def check_failed(self, check_id: int, reason: str, now: float) -> list[HealthEffect]:
        """Check ``check_id`` got no answer (connection refused, reset, ...)."""
        if check_id != self._in_flight:
            return []
        self._in_flight = None
        return self._down(now, reason)

    def connection_failed(self, now: float) -> list[HealthEffect]:
        """A task could not reach the runtime: check at once (unless a check is on its way)."""
        if not self._started or self._in_flight is not None:
            return []
        return [self._check(now)]

    def handle_timeout(self, now: float) -> list[HealthEffect]:
        """Time passed: a check timed out, or the next one is due."""
        if self._in_flight is not None:
            if now < self._in_flight_since + self.config.timeout:
                return []
            self._in_flight = None
            return self._down(now, f"{self.path} did not answer within {self.config.timeout:g}s")
        if self._next_check is not None and now >= self._next_check:
            return [self._check(now)]
        return []

    # -- internals --------------------------------------------------------------

    def _check(self, now: float) -> CheckRuntime:
        check = CheckRuntime(self._next_id, self.path)
        self._next_id += 1
        self._in_flight = check.check_id
        self._in_flight_since = now
        self._next_check = None
        return check

    def _up(self, now: float, models: tuple[str, ...], reason: str) -> list[HealthEffect]:
        changed = self.state is not HealthState.UP or models != self.models
        self.state = HealthState.UP
        self.models = models
        self._next_check = now + self.config.interval
        return [ReadinessChanged(True, models, reason)] if changed else []

    def _down(self, now: float, reason: str) -> list[HealthEffect]:
        changed = self.state is not HealthState.DOWN
        self.state = HealthState.DOWN
        self._next_check = now + self.config.down_interval
        return [ReadinessChanged(False, self.models, reason)] if changed else []
