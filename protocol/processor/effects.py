"""The processor's effects: what the caller must do, in the order given, as frozen values.

The machine that produces them is :mod:`protocol.processor.core`; the Twisted layer (and the
simulation) performs them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union

from protocol.openai.errors import error_json
from protocol.pb import worker_pb2
from protocol.processor.keys import EngineKey, Origin, Route
from protocol.routing.policy import RouteChoice

__all__ = [
    "CancelTaskOnEngine", "CloseEngine", "CloseRoute", "DeliverResult", "Effect", "EnginesRemoved", "FailRequest",
    "LocalEnginesChanged", "RefuseEngine", "SendTask", "TaskQueued",
]


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
    #: Why routing chose the engine, with ``RoutingConfig.explain`` (for traces); else None.
    choice: RouteChoice | None = None


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
    #: The id the result's attempt carries on the wire (what its engine knows the task by).
    wire_id: str = ""


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

    Every open accepted peer hears of it (``AcceptedPeer.engines_removed``): a peer may have
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
