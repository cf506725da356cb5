"""The engine agent's configuration and the effects its core returns; pure values.

The vocabulary of :mod:`protocol.agent.core`: :class:`AgentConfig` (validated
when made, so a bad setting fails at start) and the frozen effects the machine
returns for its adapter (:mod:`infx.agent.engine`) to perform, in order.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from protocol.backoff import Backoff
from protocol.errors import LocalUsageError
from protocol.pb import status_pb2, worker_pb2

__all__ = [
    "AbortTask", "AgentConfig", "AgentUsageError", "CloseStream", "Effect", "OpenStream", "SendResult",
    "SendStatus", "StartTask", "Stopped",
]


class AgentUsageError(LocalUsageError):
    """The caller drove the machine wrongly (unknown stream, start twice, bad config)."""


@dataclass(frozen=True)
class AgentConfig:
    """The agent's settings.

    ``engine_id``, ``models`` and ``cluster_id`` are what ``EngineStatus``
    reports. ``max_concurrency``: tasks that run at once (more wait).
    ``max_queued``: tasks that may wait for a slot; past it a task is answered
    503. None means four times ``max_concurrency``: enough to keep the runtime
    busy across the gateway's routing lag, few enough that a task does not sit
    here for many task durations while another engine is free.
    ``status_interval``: seconds between periodic reports on the current
    stream (they also keep an idle stream alive through proxies).
    ``status_min_interval``: in-progress counts change with every task, so
    such changes are coalesced to at most one report per this many seconds;
    readiness changes are reported at once. ``reconnect_initial`` /
    ``reconnect_max`` / ``reconnect_multiplier``: exponential backoff between
    attempts to open a stream, each delay scaled by ``1 ± reconnect_jitter``.
    ``go_away_linger``: a retired stream stays open at least this long, since
    the gateway may have sent tasks on it before it saw our 202.
    ``capabilities``: what the runtime understands beyond LLMariner's protocol,
    reported as ``EngineStatus.infx_capabilities`` (see :mod:`protocol.openai.task_forms`).
    ``wait_for_runtime``: models are not ready until ``runtime_changed`` says
    the runtime answers (without it they are always ready, as with the echo
    runtime); ``models`` may then be empty: the runtime's own list is served.
    ``instance``: a token drawn once per agent process (the adapter draws it),
    sent as ``EngineStatus.infx_instance`` on every stream, so that a gateway
    tells this process reconnecting from another process given the same
    ``engine_id`` (which it refuses).
    ``runtime_kind`` and ``agent_version``: what ``EngineStatus.infx_runtime``
    says runs behind this engine (for operators; the kind gives way to the
    runtime's own name once its load or :meth:`EngineAgentCore.runtime_identified`
    tells it); both empty: no ``infx_runtime``.
    ``runtime_slots``: requests the runtime runs at once, as the operator
    knows it (vLLM's ``--max-num-seqs``); None: what the runtime says, if it
    says (llama.cpp's slots), reported as ``EngineStatus.infx_runtime_slots``.
    ``runtime_name``: the runtime's name where engines of other gateways or
    workers front it too (a runtime served by URL), reported as
    ``EngineStatus.infx_runtime_name``: routing counts them as one runtime.
    """

    engine_id: str
    models: tuple[str, ...]
    cluster_id: str = ""
    max_concurrency: int = 32
    max_queued: int | None = None
    status_interval: float = 10.0
    status_min_interval: float = 0.1
    reconnect_initial: float = 0.5
    reconnect_max: float = 30.0
    reconnect_multiplier: float = 2.0
    reconnect_jitter: float = 0.2
    go_away_linger: float = 5.0
    capabilities: tuple[str, ...] = ()
    wait_for_runtime: bool = False
    instance: str = ""
    runtime_kind: str = ""
    agent_version: str = ""
    runtime_slots: int | None = None
    runtime_name: str = ""

    def __post_init__(self) -> None:
        if not self.engine_id:
            raise AgentUsageError("engine_id must not be empty")
        if not self.models and not self.wait_for_runtime:
            raise AgentUsageError("models must not be empty unless they come from the runtime (wait_for_runtime)")
        if any(not m for m in self.models) or len(set(self.models)) != len(self.models):
            raise AgentUsageError("models must be distinct, non-empty ids")
        if self.max_concurrency < 1:
            raise AgentUsageError("max_concurrency must be at least 1")
        if self.max_queued is not None and self.max_queued < 0:
            raise AgentUsageError("max_queued must be at least 0")
        if self.runtime_slots is not None and not 1 <= self.runtime_slots < 2**32:
            raise AgentUsageError("runtime_slots must be at least 1")
        for name in ("status_interval", "reconnect_initial", "reconnect_max", "reconnect_multiplier"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise AgentUsageError(f"{name} must be a finite number > 0")
        for name in ("status_min_interval", "go_away_linger"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise AgentUsageError(f"{name} must be a finite number >= 0")
        if not 0 <= self.reconnect_jitter < 1:
            raise AgentUsageError("reconnect_jitter must be in [0, 1)")
        try:
            self.reconnect_backoff  # built once here, so that bad settings fail now
        except ValueError as exc:
            raise AgentUsageError(f"reconnect backoff: {exc}") from None

    @property
    def reconnect_backoff(self) -> Backoff:
        """The ``reconnect_*`` settings as the one redial rule (:mod:`protocol.backoff`)."""
        return Backoff(initial=self.reconnect_initial, factor=self.reconnect_multiplier,
                       cap=self.reconnect_max, jitter=self.reconnect_jitter)

    @property
    def queue_limit(self) -> int:
        """Tasks that may wait for a slot: ``max_queued``, or its default."""
        return 4 * self.max_concurrency if self.max_queued is None else self.max_queued


# -- effects -------------------------------------------------------------------------


@dataclass(frozen=True)
class OpenStream:
    """Open a ProcessTasks stream with this id; on a new connection when ``new_connection``
    (after a go-away, so that a load balancer may pick another gateway replica)."""

    stream_id: int
    new_connection: bool


@dataclass(frozen=True)
class SendStatus:
    """Send this ``EngineStatus`` on the stream."""

    stream_id: int
    status: status_pb2.EngineStatus


@dataclass(frozen=True)
class SendResult:
    """Send this ``TaskResult`` on the stream (task id and result index already set)."""

    stream_id: int
    result: worker_pb2.TaskResult


@dataclass(frozen=True)
class StartTask:
    """Run this task on the runtime; report with ``send_result`` and ``finish_task``."""

    task: worker_pb2.Task


@dataclass(frozen=True)
class AbortTask:
    """Stop the runtime's work on this task; whatever it still reports is dropped."""

    task_id: str


@dataclass(frozen=True)
class CloseStream:
    """Half-close the stream (we send nothing more on it); it is CLOSED here already."""

    stream_id: int


@dataclass(frozen=True)
class Stopped:
    """The drain is over: every task ended and every stream is closed."""


Effect = OpenStream | SendStatus | SendResult | StartTask | AbortTask | CloseStream | Stopped
