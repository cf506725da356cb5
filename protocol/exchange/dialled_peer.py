"""The dialled peer: this gateway's side of one ``ProcessTasksInternal`` stream it opened to a peer.

No I/O, no clock reads; time comes in as ``now``. It reports this gateway's
*local* engines only (never remote ones, so reports cannot loop between
gateways) with their real readiness, runs the tasks the peer forwards through
the local :class:`~protocol.processor.core.Processor` as tasks targeted at the
named local engine, and relays their results back in order. A forwarded task
that cannot run here is answered at once with an error ``TaskResult`` (an
``HttpResponse`` of 503 with a reason) so that the peer retries elsewhere
without waiting for the next status report; one that is no task at all (an
empty request, a gateway's own go_away or heartbeat to its engines, a
malformed caller, an id in the processor's own control namespace) with 400: remote input, never a local misuse error.

Every report also carries how many requests per model this gateway accepted
from its clients since it started (read from a callable the adapter passes
in): only one gateway runs the autoscaler, and it must see the requests that
arrive here too. A change of those counts alone goes out at the next periodic
check.

Reports (:mod:`protocol.exchange.status_reports`): a full snapshot when the stream
opens; after ``deltas_offered`` (the peer's headers said it reads deltas),
only what changed. A change of load counts alone (in-progress tasks, the
runtime's load figures) is coalesced: it goes out with the next report, at
the latest ``status_interval / 4`` after it happened, so that a busy engine
does not cost a report per task; an engine that comes, goes, or changes its
readiness or models is reported at once.

Shape, for the Twisted adapter (one ``DialledPeer`` per stream; a reconnect makes
a new one):

Every input returns its outputs: :class:`SendToPeer` (a message to write on
the stream, in order) and processor effects to perform like any others.

- ``connected(now)`` once the stream is open; ``deltas_offered(now)`` if the
  peer's response headers offer status deltas.
- ``task_received(response, now)`` for each ``ProcessTasksInternalResponse``.
  Effects whose ``origin`` is this dialled peer's ``origin`` (``DeliverResult``,
  ``FailRequest``) go to ``deliver(effect)``.
- ``local_engines_changed(now)`` whenever the processor emits
  ``LocalEnginesChanged``; ``handle_timeout(now)`` at ``next_deadline()``.
- ``shutdown(now)`` to drain: every engine is reported not ready and the
  report says ``draining`` (an infx extension, field 101), in-flight tasks go
  on, new ones are refused; close the stream once ``drained``.
- ``closed(now)`` when the stream ends: its tasks are cancelled (the peer's
  clients are gone).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Union

from protocol.exchange.status_reports import LocalStatuses, ReportWriter
from protocol.openai.errors import status_line
from protocol.pb import internal_pb2, worker_pb2
from protocol.processor.core import Processor
from protocol.processor.fair_share import CallerRefused, forwarded_caller
from protocol.processor.effects import DeliverResult, Effect, FailRequest
from protocol.processor.errors import PeerProtocolError, ProcessorUsageError
from protocol.processor.keys import Locality, Origin
from protocol.processor.requests import sse_error_event

__all__ = ["DialledPeer", "DialledPeerConfig", "DialledPeerOutput", "DialledPeerState", "SendToPeer", "error_result", "peer_result"]


@dataclass(frozen=True, slots=True)
class SendToPeer:
    """Write ``message`` on the dialled peer's stream (after those returned before it)."""

    message: internal_pb2.ProcessTasksInternalRequest


DialledPeerOutput = Union[Effect, SendToPeer]


class DialledPeerState(Enum):
    """IDLE until the stream opens; DRAINING after ``shutdown``; CLOSED once the stream ended."""

    IDLE = "idle"
    OPEN = "open"
    DRAINING = "draining"
    CLOSED = "closed"


#: TaskRequest kinds a gateway sends its own engines (drain, liveness): never a peer's to forward.
_ENGINE_CONTROL = frozenset({"go_away", "heartbeat"})

# Which commands each state accepts; anything else is caller misuse.
_ACCEPTS: dict[str, frozenset[DialledPeerState]] = {
    "connected": frozenset({DialledPeerState.IDLE}),
    "deltas_offered": frozenset({DialledPeerState.OPEN, DialledPeerState.DRAINING}),
    "task_received": frozenset({DialledPeerState.OPEN, DialledPeerState.DRAINING}),
    "deliver": frozenset({DialledPeerState.OPEN, DialledPeerState.DRAINING}),
    "local_engines_changed": frozenset({DialledPeerState.OPEN, DialledPeerState.DRAINING}),
    "handle_timeout": frozenset({DialledPeerState.OPEN, DialledPeerState.DRAINING}),
    "shutdown": frozenset({DialledPeerState.OPEN, DialledPeerState.DRAINING}),
    "closed": frozenset({DialledPeerState.IDLE, DialledPeerState.OPEN, DialledPeerState.DRAINING}),
}


@dataclass(frozen=True)
class DialledPeerConfig:
    """pod_name: this gateway's name in its reports; status_interval: seconds
    between checks that re-report the local engines and request counts if anything changed
    (a change of load counts alone waits at most a quarter of it)."""

    pod_name: str
    status_interval: float = 10.0

    def __post_init__(self) -> None:
        if self.status_interval <= 0:
            raise ProcessorUsageError("status_interval must be > 0")


def error_result(task_id: str, status: int, message: str, delivered: int = 0,
                 code: str | None = None) -> worker_pb2.TaskResult:
    """A failure as the next ``TaskResult`` of a task: an ``HttpResponse`` with the
    status if nothing was sent yet, else a last server-sent event carrying the error."""
    if delivered == 0:
        body = FailRequest(None, task_id, status, message, code=code).error_body()
        response = worker_pb2.HttpResponse(status_code=status, status=status_line(status), body=body)
        response.header["Content-Type"].values.append("application/json")
        return worker_pb2.TaskResult(task_id=task_id, result_index=0, http_response=response)
    event = worker_pb2.ServerSentEvent(data=sse_error_event(status, message, code), is_last_event=True)
    return worker_pb2.TaskResult(task_id=task_id, result_index=delivered, server_sent_event=event)


def peer_result(effect: Union[DeliverResult, FailRequest]) -> worker_pb2.TaskResult:
    """What a forwarded task's processor effect sends back to the gateway that forwarded it: the
    result itself (the processor names it by the task's id), or the failure as a result."""
    if isinstance(effect, DeliverResult):
        return effect.result
    return error_result(effect.task_id, effect.status, effect.message, effect.delivered, effect.code)


def _send_result(result: worker_pb2.TaskResult) -> SendToPeer:
    return SendToPeer(internal_pb2.ProcessTasksInternalRequest(task_result=result))


class DialledPeer:
    """Runs one peer's forwarded tasks on local engines; see the module docstring."""

    def __init__(self, processor: Processor, config: DialledPeerConfig, origin: Origin | None = None,
                 requests_started: Callable[[], Mapping[str, int]] = dict,
                 local_statuses: Callable[[], LocalStatuses] | None = None) -> None:
        """``origin`` is what the processor's effects name as the origin of this
        stream's tasks: the adapter's own object, or by default this dialled peer.
        ``requests_started()`` is the number of requests per model this gateway
        has accepted from clients since it started, read at every report.
        ``local_statuses()`` is the processor's local engines as they are now: the
        gateway core's, shared by all its dialled peers and refreshed once per change; by
        default this dialled peer's own, refreshed from the processor at every read."""
        if local_statuses is None:
            own = LocalStatuses()

            def local_statuses() -> LocalStatuses:
                return own.refresh(processor.local_engines())

        self.processor = processor
        self._local_statuses = local_statuses
        self.origin: Origin = self if origin is None else origin
        self.config = config
        self.state = DialledPeerState.IDLE
        self._requests_started = requests_started
        self._tasks: set[str] = set()
        self._writer = ReportWriter(config.pod_name)
        self._next_report: float | None = None
        # When a coalesced change of load counts must go out at the latest.
        self._load_due: float | None = None

    # --- commands -----------------------------------------------------------

    def connected(self, now: float) -> list[DialledPeerOutput]:
        """The stream is open: report the local engines, even if there are none."""
        self._enter("connected")
        self.state = DialledPeerState.OPEN
        return self._report(now, force=True)

    def deltas_offered(self, now: float) -> list[DialledPeerOutput]:
        """The peer reads status deltas: from now on, reports carry only what changed."""
        self._enter("deltas_offered")
        self._writer.deltas = True
        return []

    @property
    def sends_deltas(self) -> bool:
        """Whether the peer offered status deltas (else every report is a full snapshot)."""
        return self._writer.deltas

    def local_engines_changed(self, now: float) -> list[DialledPeerOutput]:
        """Re-report the local engines if what the peer last heard differs: at once, unless
        only load counts changed (then within a quarter of the status interval)."""
        self._enter("local_engines_changed")
        local = self._local_statuses()
        if self._writer.urgent(local, self.state is DialledPeerState.DRAINING):
            return self._report(now, force=False, local=local)
        if self._load_due is None:
            self._load_due = now + self.config.status_interval / 4
        return []

    def task_received(self, response: internal_pb2.ProcessTasksInternalResponse, now: float) -> list[DialledPeerOutput]:
        """Run a forwarded task on the local engine it names, or refuse it at once.

        Raises :class:`PeerProtocolError` for a message without a task id.
        """
        self._enter("task_received")
        task, tenant_id = response.new_task, response.tenant_id
        if not response.HasField("new_task") or not task.id:
            raise PeerProtocolError("peer sent a ProcessTasksInternalResponse without a task id")
        if task.request.WhichOneof("request") == "cancel_task":
            return self._cancel_received(task, now)
        malformed = self._malformed(task)
        if malformed:
            return [_send_result(error_result(task.id, 400, malformed))]
        refusal = self._refusal(task, tenant_id)
        if refusal:
            return [_send_result(error_result(task.id, 503, refusal))]
        try:
            flow, weight, criticality = forwarded_caller(task.request)
        except CallerRefused as e:
            return [_send_result(error_result(task.id, 400, str(e)))]
        self._tasks.add(task.id)
        outputs: list[DialledPeerOutput] = []
        outputs += self.processor.submit(
            task_id=task.id,
            tenant_id=tenant_id,
            request=task.request,
            origin=self.origin,
            header={name: list(value.values) for name, value in task.header.items()},
            deadline=now + task.timeout_seconds if task.timeout_seconds > 0 else None,
            target_engine_id=task.engine_id,
            criticality=criticality,
            flow=flow,
            weight=weight,
            now=now,
        )
        return outputs

    def deliver(self, effect: Union[DeliverResult, FailRequest]) -> list[DialledPeerOutput]:
        """Relay a processor effect whose origin is this dialled peer to the peer."""
        self._enter("deliver")
        if effect.origin is not self.origin or effect.task_id not in self._tasks:
            raise ProcessorUsageError(f"task {effect.task_id!r} was not received on this stream")
        if isinstance(effect, DeliverResult):
            # The peer's stream is this result's consumer; its flow control is the transport's.
            self.processor.results_consumed(effect.task_id)
            if effect.last:
                self._tasks.discard(effect.task_id)
        else:
            self._tasks.discard(effect.task_id)
        return [_send_result(peer_result(effect))]

    def shutdown(self, now: float) -> list[DialledPeerOutput]:
        """Report every local engine not ready; keep serving in-flight tasks, refuse new ones."""
        self._enter("shutdown")
        self.state = DialledPeerState.DRAINING
        return self._report(now, force=False)

    def closed(self, now: float) -> list[DialledPeerOutput]:
        """The stream ended: the peer can no longer take results, so its tasks are cancelled."""
        self._enter("closed")
        self.state = DialledPeerState.CLOSED
        self._next_report = self._load_due = None
        effects: list[DialledPeerOutput] = []
        for task_id in sorted(self._tasks):
            effects += self.processor.cancel(task_id, now)
        self._tasks.clear()
        return effects

    # --- time and queries -------------------------------------------------------

    def next_deadline(self) -> float | None:
        """When the next periodic status check, or a coalesced load report, is due."""
        due = [t for t in (self._next_report, self._load_due) if t is not None]
        return min(due) if due else None

    def handle_timeout(self, now: float) -> list[DialledPeerOutput]:
        """Periodic status check, or coalesced load counts due: report only if something changed."""
        self._enter("handle_timeout")
        deadline = self.next_deadline()
        if deadline is not None and now >= deadline:
            return self._report(now, force=False)
        return []

    @property
    def drained(self) -> bool:
        """Shutting down and no forwarded task left in flight: the stream may close."""
        return self.state is DialledPeerState.DRAINING and not self._tasks

    @property
    def task_ids(self) -> frozenset[str]:
        """The forwarded tasks not finished yet."""
        return frozenset(self._tasks)

    @property
    def tasks_in_flight(self) -> int:
        """Forwarded tasks not finished yet."""
        return len(self._tasks)

    # --- internals -------------------------------------------------------------

    def _enter(self, command: str) -> None:
        if self.state not in _ACCEPTS[command]:
            raise ProcessorUsageError(f"dialled peer is {self.state.value}: {command} is not allowed")

    def _malformed(self, task: worker_pb2.Task) -> str:
        """Why a peer's task is no task the processor takes (which would be this gateway's own
        misuse, :class:`ProcessorUsageError`, were its code to submit it): '' if none."""
        kind = task.request.WhichOneof("request")
        if kind is None:
            return f"forwarded task {task.id!r} has an empty request"
        if kind in _ENGINE_CONTROL:
            return (f"forwarded task {task.id!r}: {kind} is a gateway's message to its own engines, "
                    "not a request a peer may forward")
        if task.id.startswith(self.processor.config.control_task_prefix):
            return f"forwarded task id {task.id!r} starts with this gateway's prefix for its own tasks"
        return ""

    def _refusal(self, task: worker_pb2.Task, tenant_id: str) -> str:
        if self.state is DialledPeerState.DRAINING:
            return f"gateway {self.config.pod_name!r} is shutting down"
        if task.id in self._tasks or self.processor.has_task(task.id):
            return f"task {task.id!r} is already running on gateway {self.config.pod_name!r}"
        engine = self.processor.engine(tenant_id, task.engine_id) if task.engine_id else None
        if engine is None or engine.locality is not Locality.LOCAL:
            return f"engine {task.engine_id!r} is not attached to gateway {self.config.pod_name!r}"
        return ""

    def _cancel_received(self, task: worker_pb2.Task, now: float) -> list[DialledPeerOutput]:
        target = task.request.cancel_task.task_id
        if target not in self._tasks:
            return [_send_result(error_result(task.id, 404, f"no task {target!r} on this stream"))]
        self._tasks.discard(target)
        outputs: list[DialledPeerOutput] = []
        outputs += self.processor.cancel(target, now)
        ok = worker_pb2.HttpResponse(status_code=200, status=status_line(200))
        outputs.append(_send_result(worker_pb2.TaskResult(task_id=task.id, http_response=ok)))
        return outputs

    def _report(self, now: float, force: bool, local: LocalStatuses | None = None) -> list[DialledPeerOutput]:
        self._next_report = now + self.config.status_interval
        self._load_due = None
        report = self._writer.report(self._local_statuses() if local is None else local,
                                     self._requests_started(), self.state is DialledPeerState.DRAINING, force)
        if report is None:
            return []
        return [SendToPeer(internal_pb2.ProcessTasksInternalRequest(server_status=report))]
