"""Values of the inference processor: configuration, effects, errors, request helpers.

No I/O, no clock reads, no mutable state: everything here is a frozen value or
a pure function of its arguments. The machine that produces these values is
:mod:`protocol.processor.core`; the Twisted layer performs the effects.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field
from enum import Enum
from typing import Union

from protocol import errors
from protocol.openai.errors import error_event, error_json
from protocol.pb import worker_pb2
from protocol.routing.config import RoutingConfig

#: What the caller uses to reach an engine: for a local engine its gRPC
#: stream (or any key for it), for a remote engine the peer's sender. The
#: processor only compares routes and hands them back in effects.
Route = Hashable

#: What the caller uses to reach whoever submitted a task: an HTTP request,
#: a peer's receiver. Handed back in :class:`DeliverResult` and
#: :class:`FailRequest` so that one dispatcher serves every origin.
Origin = Hashable


class ProcessorError(Exception):
    """Base of the processor's exceptions."""


class ProcessorUsageError(ProcessorError, errors.LocalUsageError):
    """The caller misused the processor (duplicate task id, unknown task, bad config).

    Remote misbehaviour (an engine sending results out of order, an engine
    vanishing) never raises: it ends the affected task with a
    :class:`FailRequest` whose status says what went wrong on the wire.
    """


class RemoteProtocolError(ProcessorError, errors.RemoteProtocolError):
    """A peer gateway sent a message that breaks the protocol; its stream should end.

    ``grpc_status`` is the status to end the stream with (3, INVALID_ARGUMENT).
    """

    grpc_status = 3


class Locality(Enum):
    """Whether an engine is attached to this gateway or reported by a peer gateway."""

    LOCAL = "local"
    REMOTE = "remote"


@dataclass(frozen=True, slots=True)
class EngineKey:
    """Engines are identified per tenant: two tenants may reuse an engine id."""

    tenant_id: str
    engine_id: str


@dataclass(frozen=True)
class ProcessorConfig:
    """Every tunable of the processor, validated once on construction.

    queue_timeout: how long a task waits for an engine that serves its model
        before it fails with 503 (never past the task's own deadline).
    max_task_duration: deadline of a task whose client gave none.
    max_attempts: sends of one task to engines, in all, before any result
        was delivered: whatever failed (a lost engine, a failed send, a busy
        or unreachable runtime, a runtime that dropped it) and on whichever
        engine. A task a runtime read and dropped is sent again at most once
        (:mod:`protocol.processor.attempts`). When none is left, the client gets the
        last failure's answer at once.
    retry_delay: pause before sending a task again after its engine was lost,
        the send failed or a runtime dropped it, so that a flapping engine is
        not hammered; 0 sends it again at once. (A busy runtime's task goes at
        once to another engine with room, or waits.)
    dynamic_model_loading: when no engine serves a model, send the task to the
        ready engine with the fewest models (which loads it on demand) instead
        of waiting.
    max_waiting_tasks: tasks that may wait for an engine at once, over all
        tenants and models; past it a new task fails with 503 at once.
    max_unconsumed_results: results delivered to one request and not yet
        acknowledged with ``results_consumed``; past it that request alone
        fails (its consumer is too slow) and its engine is told to stop.
    heartbeat_interval: seconds between heartbeats to local engines; None
        sends none.
    heartbeat_max_missed: unanswered heartbeats in a row after which a local
        engine is removed and its stream closed.
    control_task_prefix: prefix of the ids of tasks the processor makes itself
        (heartbeat, go-away, cancel); callers must not use it for their ids.
    busy_retry_after: the ``Retry-After`` (seconds) suggested with a 503 for
        lack of capacity (queue full, queue timeout, engine or tenant at its
        cap) and with the 429 of the tenant cap.
    max_in_flight_per_engine: tasks one engine holds at once (dispatched or
        streaming), counted as the larger of this processor's tasks on it and
        what the engine last reported (its runtime's running and waiting
        requests, else its ``in_progress_task_count``, which count every
        gateway's tasks) plus the tasks this processor sent it since. An engine
        at it is skipped by routing, so a task goes to another engine or waits
        in the queue and is dispatched when a task on the engine ends. A
        targeted task (forwarded by a peer) for an engine at it waits for a slot
        on that engine, in its caller's turn among every gateway's callers
        (``TaskRequest.infx_caller``); a sheddable one is refused with 503 at
        once, so that the peer tries elsewhere. None: no cap (the engine agent
        bounds its own queue).
    cap_at_runtime_slots: without ``max_in_flight_per_engine``, a local engine
        that reports its runtime's slots (``EngineStatus.infx_runtime_slots``)
        holds at most that many, so that a request waits in this gateway's fair
        queue rather than inside a full runtime; a peer's engine is capped by
        its own gateway, whose count is exact (a task forwarded there waits in
        that engine's queue). Engines that report no slots have no cap.
    fair_reserve: with ``max_in_flight_per_engine``, the last free slots of
        each engine (at most the cap less one) that only a task of the caller
        holding the fewest slots per weight on its model, or a critical task,
        may take (:mod:`protocol.processor.fair_share`): a caller's burst leaves them
        for the others' next requests, which then start at once on the engine
        that holds their cache. 0: none.
    max_tasks_per_tenant: live tasks (waiting, retrying or on an engine) one
        tenant may have in this processor; past it the tenant's next task fails
        at once with 429 and ``busy_retry_after``, and other tenants are not
        affected. Targeted tasks forwarded by peers count too, since they hold
        this gateway's queue and engines as much as a client's own; one refused
        for the cap gets 503 instead of 429, so that the forwarding peer retries
        it elsewhere rather than handing the client a limit of this gateway's.
        None: no cap.
    busy_backoff: seconds an engine whose runtime answered busy (503 or 429,
        see ``BUSY_STATUSES``) without a ``Retry-After`` gets no task; with one
        it gets none for that long (never less than ``busy_backoff``, so that a
        ``Retry-After: 0`` cannot make a busy loop; at most ``max_busy_backoff``). The task that
        got the answer goes to another engine with room at once, or waits in
        the queue (for ``queue_timeout`` from its first busy answer, never past
        its deadline) and, if time or its ``max_attempts`` run out, gets the
        runtime's own answer.
    shed_waiting_threshold: a sheddable task that would wait while every
        engine serving its model is at ``max_in_flight_per_engine`` fails at
        once with 429 and ``busy_retry_after`` when its model's queue already
        holds this many tasks (0: sheddable tasks never wait behind full
        engines). They are also the first refused when the whole queue is full.
    routing: the routing policy and its weights (:mod:`protocol.routing.router`).
    route_stuck_timeout: seconds a route (an engine's or a peer's stream) may
        stay blocked (its adapter reported it not draining, and no drain since)
        before the processor closes it with ``CloseRoute``; its tasks fail over
        like any lost engine's. A blocked route gets no new tasks meanwhile.
        None: blocked routes are never closed for it.
    clash_probe_timeout: seconds a local engine has to answer the heartbeat it
        is sent when another engine process claims its id on this gateway
        (``update_engine``); one that does not is taken for a dead stream (a
        half-open connection) and closed, so that the newcomer's next attempt
        gets in.
    """

    queue_timeout: float = 30.0
    max_task_duration: float = 600.0
    max_attempts: int = 3
    retry_delay: float = 3.0
    dynamic_model_loading: bool = False
    max_waiting_tasks: int = 10_000
    max_unconsumed_results: int = 1024
    heartbeat_interval: float | None = None
    heartbeat_max_missed: int = 3
    control_task_prefix: str = "infx-ctl-"
    busy_retry_after: float = 5.0
    max_in_flight_per_engine: int | None = None
    cap_at_runtime_slots: bool = False
    fair_reserve: int = 2
    max_tasks_per_tenant: int | None = None
    busy_backoff: float = 1.0
    max_busy_backoff: float = 60.0
    shed_waiting_threshold: int = 0
    routing: RoutingConfig = field(default_factory=RoutingConfig)
    route_stuck_timeout: float | None = 30.0
    clash_probe_timeout: float = 5.0

    def __post_init__(self) -> None:
        problems = []
        if self.queue_timeout < 0:
            problems.append("queue_timeout must be >= 0")
        if self.max_task_duration <= 0:
            problems.append("max_task_duration must be > 0")
        if self.max_attempts < 1:
            problems.append("max_attempts must be >= 1")
        if self.retry_delay < 0:
            problems.append("retry_delay must be >= 0")
        if self.max_waiting_tasks < 0:
            problems.append("max_waiting_tasks must be >= 0")
        if self.max_unconsumed_results < 1:
            problems.append("max_unconsumed_results must be >= 1")
        if self.heartbeat_interval is not None and self.heartbeat_interval <= 0:
            problems.append("heartbeat_interval must be > 0 or None")
        if self.heartbeat_max_missed < 1:
            problems.append("heartbeat_max_missed must be >= 1")
        if self.busy_retry_after < 0:
            problems.append("busy_retry_after must be >= 0")
        if self.max_in_flight_per_engine is not None and self.max_in_flight_per_engine < 1:
            problems.append("max_in_flight_per_engine must be >= 1 or None")
        if self.fair_reserve < 0:
            problems.append("fair_reserve must be >= 0")
        if self.max_tasks_per_tenant is not None and self.max_tasks_per_tenant < 1:
            problems.append("max_tasks_per_tenant must be >= 1 or None")
        if not 0 < self.busy_backoff <= self.max_busy_backoff:
            problems.append("busy_backoff must be > 0 and <= max_busy_backoff")
        if self.shed_waiting_threshold < 0:
            problems.append("shed_waiting_threshold must be >= 0")
        if self.route_stuck_timeout is not None and self.route_stuck_timeout <= 0:
            problems.append("route_stuck_timeout must be > 0 or None")
        if self.clash_probe_timeout <= 0:
            problems.append("clash_probe_timeout must be > 0")
        if not self.control_task_prefix:
            problems.append("control_task_prefix must not be empty")
        if problems:
            raise ProcessorUsageError("; ".join(problems))


# --- effects: what the caller must do -------------------------------------


@dataclass(frozen=True, slots=True)
class SendTask:
    """Send ``task`` on ``route`` (as ``ProcessTasksResponse.new_task``, or for a
    remote engine as ``ProcessTasksInternalResponse`` with ``engine.tenant_id``).

    ``task.id`` names this attempt on the wire: the task id for a first
    dispatch, ``"{id}#{n}"`` for a retry (results are mapped back to the task).
    If the send fails, report it with ``Processor.dispatch_failed(now, task.id, ...)``;
    if the route refused it at its queue cap, with ``Processor.dispatch_refused``.
    """

    route: Route
    engine: EngineKey
    task: worker_pb2.Task


@dataclass(frozen=True, slots=True)
class CancelTaskOnEngine:
    """Tell the engine to stop ``cancelled_task_id`` (the attempt's id on the wire):
    send ``task`` (a ``TaskRequest.cancel_task`` with an id of its own) on ``route``.

    Best effort: an engine that does not know the request answers 501, which
    the processor ignores, and a failed send needs no report.
    """

    route: Route
    engine: EngineKey
    task: worker_pb2.Task
    cancelled_task_id: str


@dataclass(frozen=True, slots=True)
class DeliverResult:
    """Hand ``result`` to the request ``task_id`` of ``origin``.

    Results come in ``result_index`` order. ``last`` ends the request (the
    non-streaming response, the last event, or an error status). The caller
    acknowledges with ``Processor.results_consumed`` once its consumer took
    the result; unacknowledged results are bounded per request.
    """

    origin: Origin
    task_id: str
    result: worker_pb2.TaskResult
    last: bool
    #: Who served it, for logs and metrics: the engine, the route it was reached by
    #: (a peer's for a remote engine), and its retries (sends after a failed attempt).
    engine: EngineKey | None = None
    route: Route = None
    retries: int = 0


@dataclass(frozen=True, slots=True)
class FailRequest:
    """End the request ``task_id`` of ``origin`` with an error.

    ``status`` is the HTTP status to answer with (if the response has already
    started, it only goes into the error body). ``delivered`` is how many
    results the request had received before the failure. ``retry_after``
    (seconds) is set when the failure is a lack of capacity that may pass
    (queue full, no engine for the model in time, a cap reached; 429 for the
    tenant's task cap): the ``Retry-After`` header. ``code`` is the OpenAI
    error code the client sees (None: the status); ``detail`` is for the log
    only (what broke, in the words of the layer that saw it), never for the
    client, whose ``message`` is short and stable.
    """

    origin: Origin
    task_id: str
    status: int
    message: str
    delivered: int = 0
    retry_after: float | None = None
    #: As in :class:`DeliverResult`: the engine the task was last on (if any), its route, retries.
    engine: EngineKey | None = None
    route: Route = None
    retries: int = 0
    code: str | None = None
    detail: str = ""

    def error_body(self) -> bytes:
        """The OpenAI-style JSON error body for this failure."""
        return error_json(self.status, self.message, code=self.status if self.code is None else self.code)


@dataclass(frozen=True, slots=True)
class CloseEngine:
    """Close the stream of a local engine the processor gave up on (missed heartbeats).

    The processor has already removed the engine and failed over its tasks.
    """

    route: Route
    engine: EngineKey
    reason: str


@dataclass(frozen=True, slots=True)
class RefuseEngine:
    """End the stream ``route`` of an engine that claims ``engine``'s id while another engine
    process holds it here, with gRPC ALREADY_EXISTS and ``reason`` (the newcomer's operator can
    fix it: give it another id). Nothing of its status was registered."""

    route: Route
    engine: EngineKey
    reason: str


@dataclass(frozen=True, slots=True)
class CloseRoute:
    """Close ``route`` (an engine's or a peer's stream): it stopped draining and stayed
    blocked for ``route_stuck_timeout``. Whatever is still queued on it is dropped.

    The processor has already removed its engines and failed over their tasks.
    """

    route: Route
    reason: str


@dataclass(frozen=True, slots=True)
class TaskQueued:
    """A task started waiting because no ready engine of its tenant serves its model.

    The scaler's hook to scale from zero. A task that waits only because every
    engine serving its model is at ``max_in_flight_per_engine`` emits none: the
    model is served, and its queue shows in ``Processor.waiting_counts``. ``waiting`` counts the tasks now
    waiting for this (tenant, model).
    """

    tenant_id: str
    model_id: str
    task_id: str
    waiting: int


@dataclass(frozen=True, slots=True)
class LocalEnginesChanged:
    """A local engine was added, removed, or reported a different status.

    Receivers re-report this gateway's local engines to their peers.
    """


@dataclass(frozen=True, slots=True)
class EnginesRemoved:
    """``engines`` left the processor (removed, their stream closed, heartbeats missed).

    Every open sender hears of it (``Sender.engines_removed``): a peer may have
    reported one of them while it was registered here on another route, and
    that report is the only word of where the engine is now.
    """

    engines: tuple[EngineKey, ...]


Effect = Union[
    SendTask,
    CancelTaskOnEngine,
    DeliverResult,
    FailRequest,
    CloseEngine,
    CloseRoute,
    RefuseEngine,
    TaskQueued,
    LocalEnginesChanged,
    EnginesRemoved,
]


# --- busy runtimes -----------------------------------------------------------


def retry_after_seconds(response: worker_pb2.HttpResponse) -> float | None:
    """The ``Retry-After`` of a response in seconds, or None when absent or not delay-seconds.

    An HTTP-date is treated as absent: the processor has no wall clock to
    subtract it from, and the default back-off is a safe reading of it.
    """
    for name, values in response.header.items():
        if name.lower() == "retry-after" and values.values:
            text = values.values[0].strip()
            if text.isdigit():
                return float(text)
            return None
    return None


# --- request helpers -------------------------------------------------------

_MODEL_REQUESTS = ("chat_completion", "embedding", "audio_transcription", "model_response", "tokenize_request")
_STREAMABLE_REQUESTS = ("chat_completion", "audio_transcription", "model_response")


def model_of(request: worker_pb2.TaskRequest) -> str:
    """The model a request asks for, or "" for requests without one (heartbeat, go-away)."""
    kind = request.WhichOneof("request")
    if kind in _MODEL_REQUESTS:
        model: str = getattr(request, kind).model
        return model
    return ""


def is_streaming(request: worker_pb2.TaskRequest) -> bool:
    """Whether the engine will answer with server-sent events after the HttpResponse.

    Every request kind with a ``stream`` flag counts, not only chat.
    """
    kind = request.WhichOneof("request")
    if kind in _STREAMABLE_REQUESTS:
        stream: bool = getattr(request, kind).stream
        return stream
    return False


def sse_error_event(status: int, message: str, code: str | None = None) -> bytes:
    """An error as one server-sent event, for a stream whose headers are already out."""
    return error_event(status, message, code=status if code is None else code)
