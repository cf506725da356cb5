"""The processor's Twisted owner: feeds it inputs, performs its effects, arms its timer.

The processor (:mod:`protocol.processor`) decides; this module acts. It is the
one place that calls the processor, so every input is followed by performing
the returned effects in order and re-arming the single ``callLater`` from
``next_deadline()``. Routes (engine streams, peer senders) and origins (HTTP
requests, peer receivers) are objects with the small interfaces below, so the
worker service, the gateway and the exchanger plug in without knowing each
other.
"""

from __future__ import annotations

import enum
import itertools
import secrets
from typing import Any, Callable, Iterator, Protocol

from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger

from infx.deadline import DeadlineTimer
from infx.metrics import OTHER_MODEL, GatewayMetrics
from infx.tasks import Availability, ResultSink, ServedBy, Submission, TaskHandle
from protocol.pb import internal_pb2, status_pb2, worker_pb2
from protocol.processor import Processor
from protocol.processor_types import (
    CancelTaskOnEngine,
    CloseEngine,
    CloseRoute,
    DeliverResult,
    Effect,
    EngineKey,
    EnginesRemoved,
    FailRequest,
    Locality,
    LocalEnginesChanged,
    SendTask,
    TaskQueued,
)
from protocol.receiver import Receiver
from protocol.sender import Sender

log = Logger()

#: A model no engine has listed for this long is unknown (404) again rather than gone (503).
FORGET_MODELS_AFTER = 3600.0
#: Bytes a route's stream may hold queued (not yet taken by its peer's flow control) before
#: it refuses further tasks, which the processor then routes elsewhere.
MAX_ROUTE_QUEUED_BYTES = 4 * 1024 * 1024


class SendOutcome(enum.Enum):
    """What became of a task handed to a route."""

    SENT = "sent"  # queued, and the stream takes more
    BLOCKED = "blocked"  # queued, but the stream is not draining: the route reports when it drains
    REFUSED = "refused"  # not queued: the stream already holds its cap of queued bytes
    GONE = "gone"  # not queued: the route is closed


class EngineRoute(Protocol):
    """Where tasks for an engine go: a local engine's stream or a peer's sender."""

    def send_task(self, task: worker_pb2.Task, tenant_id: str) -> SendOutcome:
        """Queue ``task`` for sending, or say why not; a route that answers BLOCKED
        calls :meth:`Dispatcher.route_writable` once its stream drains."""

    def close(self, reason: str) -> None:
        """End the route (the processor gave up on its engine)."""


class StreamSendGate:
    """A route's sends on its gRPC call, with the call's backpressure turned into
    :class:`SendOutcome` (shared by engine streams and peer streams).

    The call's ``send()`` Deferred is already fired while the stream takes more;
    an unfired one means the stream is over its high-water mark (the peer's
    flow-control window is shut, or the transport is paused): the gate is blocked
    until it fires, and while blocked refuses a task once ``max_queued_bytes`` are
    queued, so a peer that never reads holds at most that much (plus one task).
    """

    def __init__(self, call: Any, on_drained: Callable[[], None],
                 max_queued_bytes: int = MAX_ROUTE_QUEUED_BYTES) -> None:
        self.call = call
        self.on_drained = on_drained
        self.max_queued_bytes = max_queued_bytes
        self.blocked = False

    def send(self, message: Any) -> SendOutcome:
        if self.blocked and self.call.buffered_amount >= self.max_queued_bytes:
            return SendOutcome.REFUSED
        sent = self.call.send(message)
        if sent.called and not self.blocked:
            sent.addErrback(lambda _: None)
            return SendOutcome.SENT
        if self.blocked:
            sent.addErrback(lambda _: None)
        else:
            self.blocked = True
            # An error means the call ended: the route's close reports that, not a drain.
            sent.addCallbacks(self._drained, lambda _: None)
        return SendOutcome.BLOCKED

    def _drained(self, _: object) -> None:
        self.blocked = False
        self.on_drained()


class TaskOrigin(Protocol):
    """Who submitted a task: an HTTP request or a peer's receiver."""

    def result_delivered(self, effect: DeliverResult) -> None: ...

    def request_failed(self, effect: FailRequest) -> None: ...


class Dispatcher:
    """Owns one :class:`~protocol.processor.Processor` on a reactor; the gateway's TaskRunner."""

    def __init__(self, clock: IReactorTime, processor: Processor, metrics: GatewayMetrics,
                 task_ids: Callable[[], str] | None = None) -> None:
        self.clock = clock
        self.processor = processor
        self.metrics = metrics
        counter = itertools.count(1)
        # A task forwarded to a peer keeps its id there, beside the peer's own tasks: a random
        # prefix per gateway keeps two gateways' counters from handing out the same id.
        prefix = secrets.token_hex(4)
        self._new_id = task_ids or (lambda: f"t{prefix}-{next(counter)}")
        self._timer = DeadlineTimer(clock, self._fire)
        #: Called with each TaskQueued (the scaler's scale-from-zero hook).
        self.on_task_queued: list[Callable[[TaskQueued], None]] = []
        #: Called when local engines changed (receivers re-report to peers).
        self.on_local_engines_changed: list[Callable[[], None]] = []
        #: Called with each EnginesRemoved (senders register engines their peers reported meanwhile).
        self.on_engines_removed: list[Callable[[EnginesRemoved], None]] = []
        #: Called with the model of each accepted HTTP request, and again when it ends (load for the scaler).
        self.on_request_started: list[Callable[[str], None]] = []
        self.on_request_finished: list[Callable[[str], None]] = []
        #: Requests accepted from clients since start, per model (never tasks peers forwarded):
        #: reported to every peer, whose autoscaler counts them as started requests.
        self.requests_started: dict[str, int] = {}
        #: Answers whether a model with no engine could still be started (the scaler).
        self.can_start: Callable[[str, str], bool] = lambda tenant, model: False
        #: When each (tenant, model) was last listed by an engine: tells "gone" from "unknown".
        self._recent_models: dict[tuple[str, str], float] = {}
        #: This gateway's name, for the request log of requests its own engines served.
        self.pod_name = ""
        #: HTTP requests in progress by task id, to time their wait for a first dispatch.
        self._http: dict[str, HttpOrigin] = {}

    # --- inputs -----------------------------------------------------------

    def run(self, step: Callable[[float], list[Effect]]) -> None:
        """Run one processor input at the current time and perform what it returns."""
        self.perform(step(self.clock.seconds()))

    def perform(self, effects: list[Effect]) -> None:
        for effect in effects:
            self._perform_one(effect)
        self._arm()

    def _perform_one(self, effect: Effect) -> None:
        if isinstance(effect, SendTask):
            route: EngineRoute = effect.route  # type: ignore[assignment]
            engine = self.processor.engine(effect.engine.tenant_id, effect.engine.engine_id)
            if engine is not None and engine.locality is Locality.REMOTE:
                self.metrics.exchanged.labels("out").inc()
            owner = self._http.get(self.processor.attempt_owner(effect.task.id) or "")
            outcome = route.send_task(effect.task, effect.engine.tenant_id)
            now = self.clock.seconds()
            if owner is not None and outcome is not SendOutcome.REFUSED:
                # A refused task goes back to the queue: its wait has not ended.
                owner.dispatched(now)
            if outcome is SendOutcome.GONE:
                self._perform_later(self.processor.dispatch_failed(now, effect.task.id, "engine stream closed", route=route))
            elif outcome is SendOutcome.REFUSED:
                self._perform_later(self.processor.dispatch_refused(now, effect.task.id, route))
            elif outcome is SendOutcome.BLOCKED:
                self._blocked(route)
        elif isinstance(effect, DeliverResult):
            origin: TaskOrigin = effect.origin  # type: ignore[assignment]
            origin.result_delivered(effect)
        elif isinstance(effect, FailRequest):
            origin = effect.origin  # type: ignore[assignment]
            origin.request_failed(effect)
        elif isinstance(effect, CancelTaskOnEngine):
            # Best effort: a cancel the route refuses is dropped, but a stream it shows
            # to be blocked is blocked for tasks too.
            route = effect.route  # type: ignore[assignment]
            if route.send_task(effect.task, effect.engine.tenant_id) is SendOutcome.BLOCKED:
                self._blocked(route)
        elif isinstance(effect, CloseEngine):
            route = effect.route  # type: ignore[assignment]
            log.warn("closing engine {engine}: {reason}", engine=effect.engine.engine_id, reason=effect.reason)
            route.close(effect.reason)
        elif isinstance(effect, CloseRoute):
            route = effect.route  # type: ignore[assignment]
            log.warn("closing {route}: {reason}", route=repr(route), reason=effect.reason)
            route.close(effect.reason)
        elif isinstance(effect, TaskQueued):
            for listener in self.on_task_queued:
                listener(effect)
        elif isinstance(effect, LocalEnginesChanged):
            for changed in self.on_local_engines_changed:
                changed()
        elif isinstance(effect, EnginesRemoved):
            for removed in self.on_engines_removed:
                removed(effect)

    def _blocked(self, route: EngineRoute) -> None:
        # Told now, not later, so that the very next input already routes around it.
        effects = self.processor.route_blocked(self.clock.seconds(), route)
        if effects:
            self._perform_later(effects)

    def _perform_later(self, effects: list[Effect]) -> None:
        # Effects produced while performing others run after them, in order.
        self.clock.callLater(0, self.perform, effects)

    def _arm(self) -> None:
        self._timer.arm(self.processor.next_deadline())

    def _fire(self) -> None:
        self.run(self.processor.handle_timeout)

    # --- engines (called by the worker service and the exchanger) ---------

    def engine_status(self, route: EngineRoute, tenant_id: str, status: status_pb2.EngineStatus,
                      locality: Locality) -> None:
        self.run(lambda now: self.processor.update_engine(now, route, tenant_id, status, locality))
        self._engines_changed()

    def engine_removed(self, tenant_id: str, engine_id: str, reason: str) -> None:
        self.run(lambda now: self.processor.remove_engine(now, tenant_id, engine_id, reason))
        self._engines_changed()

    def route_closed(self, route: EngineRoute, reason: str) -> None:
        self.run(lambda now: self.processor.close_route(now, route, reason))
        self._engines_changed()

    def route_writable(self, route: EngineRoute) -> None:
        """A route that answered BLOCKED drains again: it takes tasks again."""
        self.run(lambda now: self.processor.route_writable(now, route))

    def result_received(self, route: EngineRoute, result: worker_pb2.TaskResult) -> None:
        self.run(lambda now: self.processor.receive_result(now, route, result))

    def drain(self) -> None:
        """Shutdown: local engines go away; what no peer's engine can take fails at once with 503."""
        self.run(self.processor.drain)

    # --- peers (called by the exchanger, infx/exchanger.py) -----------------

    def peer_reported(self, sender: Sender, message: internal_pb2.ProcessTasksInternalRequest) -> None:
        """A status report or task result from a peer's receiver, on the stream ``sender`` serves."""
        self.run(lambda now: sender.message_received(now, message))
        self._engines_changed()

    def peer_stream_closed(self, sender: Sender) -> None:
        """A peer's stream to us ended: its engines go and their tasks fail over."""
        self.run(sender.closed)
        self._engines_changed()

    def peer_engines_removed(self, sender: Sender, engines: tuple[EngineKey, ...]) -> None:
        """Engines left the processor: ``sender`` registers those its peer reported meanwhile."""
        self.run(lambda now: sender.engines_removed(now, engines))
        self._engines_changed()

    def task_forwarded(self, receiver: Receiver, message: internal_pb2.ProcessTasksInternalResponse) -> None:
        """A peer forwarded a task (or a cancel) to our local engines through ``receiver``."""
        if message.new_task.request.WhichOneof("request") != "cancel_task":
            self.metrics.exchanged.labels("in").inc()
        self.run(lambda now: receiver.task_received(now, message))

    def receiver_closed(self, receiver: Receiver) -> None:
        """Our stream to a peer ended: the tasks it forwarded are cancelled here."""
        self.run(receiver.closed)

    # --- the gateway's TaskRunner -----------------------------------------

    def submit(self, submission: Submission, sink: ResultSink) -> TaskHandle:
        task_id = self._new_id()
        now = self.clock.seconds()
        origin = HttpOrigin(self, task_id, submission.tenant, submission.model, sink, now)
        self._http[task_id] = origin
        self.requests_started[submission.model] = self.requests_started.get(submission.model, 0) + 1
        for started in self.on_request_started:
            started(submission.model)
        deadline = None if submission.timeout is None else now + submission.timeout
        self.perform(self.processor.submit(
            now, task_id=task_id, tenant_id=submission.tenant, request=submission.request, origin=origin,
            header=submission.headers, deadline=deadline, criticality=submission.criticality,
            flow=submission.flow, weight=submission.weight,
        ))
        return origin

    def availability(self, tenant: str, model: str) -> Availability:
        now = self.clock.seconds()
        if model in self.processor.known_models(tenant):
            self._recent_models[(tenant, model)] = now
            return Availability.SERVED
        if self.can_start(tenant, model):
            return Availability.STARTABLE
        last_seen = self._recent_models.get((tenant, model))
        if last_seen is not None and now - last_seen < FORGET_MODELS_AFTER:
            return Availability.GONE
        return Availability.UNKNOWN

    def _remember_models(self, tenant: str) -> None:
        now = self.clock.seconds()
        for model in self.processor.known_models(tenant):
            self._recent_models[(tenant, model)] = now

    def takes_http_request(self, tenant: str, model: str) -> bool:
        return self.processor.takes_http_request(tenant, model)

    def models(self, tenant: str) -> list[str]:
        return sorted(self.processor.known_models(tenant, ready_only=True))

    def status(self) -> dict[str, Any]:
        return self.processor.status()

    def _engines_changed(self) -> None:
        for tenant, _ in self.processor.engine_counts():
            self._remember_models(tenant)

    def model_label(self, tenant: str, model: str) -> str:
        """``model`` as a metric label: itself if the tenant's engines list it, else OTHER_MODEL."""
        return model if model in self.processor.known_models(tenant) else OTHER_MODEL

    def gauges(self) -> Iterator[tuple[str, tuple[str, ...], int]]:
        """Current (metric, labels, value) of the processor's gauges, read when /metrics is scraped.

        Queued and in-flight are also given at zero for every model an engine lists, so that
        a dashboard sees an idle model as 0 rather than as no data.
        """
        known = {tenant: self.processor.known_models(tenant) for tenant in self.processor.tenants()}
        for tenant, models in known.items():
            for model in models:
                yield "queued", (tenant, model), 0
                yield "in_flight", (tenant, model), 0
            yield "models_ready", (tenant,), len(self.processor.known_models(tenant, ready_only=True))
        for (tenant, model), count in self.processor.waiting_counts().items():
            yield "queued", (tenant, model if model in known.get(tenant, ()) else OTHER_MODEL), count
        for (tenant, model), count in self.processor.in_flight_counts().items():
            yield "in_flight", (tenant, model if model in known.get(tenant, ()) else OTHER_MODEL), count
        for (tenant, locality), count in self.processor.engine_counts().items():
            yield "engines", (tenant, locality.value), count
            yield "engines_ready", (tenant, locality.value), 0
        for (tenant, locality), count in self.processor.routable_engine_counts().items():
            yield "engines_ready", (tenant, locality.value), count

    def gateway_of(self, route: object) -> str:
        """The gateway an engine's route leads to: the peer's pod for a peer's stream, else this one."""
        pod = getattr(route, "pod_name", None)
        return self.pod_name if pod is None else str(pod)


class HttpOrigin:
    """Turns the processor's effects for one HTTP request into ResultSink calls; its TaskHandle."""

    def __init__(self, dispatcher: Dispatcher, task_id: str, tenant: str, model: str, sink: ResultSink,
                 submitted_at: float) -> None:
        self.dispatcher = dispatcher
        self.task_id = task_id
        self.tenant = tenant
        self.model = model
        self.sink = sink
        self.submitted_at = submitted_at
        self.served_by: ServedBy | None = ServedBy()
        self.ended = False

    def _end(self) -> None:
        if not self.ended:
            self.ended = True
            self.dispatcher._http.pop(self.task_id, None)
            for finished in self.dispatcher.on_request_finished:
                finished(self.model)

    def dispatched(self, now: float) -> None:
        """A SendTask for this request was performed: the first one ends its wait in the queue."""
        served = self.served_by
        if served is not None and served.queued_seconds is None:
            served.queued_seconds = now - self.submitted_at
            label = self.dispatcher.model_label(self.tenant, self.model)
            self.dispatcher.metrics.queue_seconds.labels(self.tenant, label).observe(served.queued_seconds)

    def _served(self, effect: DeliverResult | FailRequest) -> None:
        served = self.served_by
        if served is None:
            return
        served.retries = effect.retries
        if effect.engine is not None:
            served.engine_id = effect.engine.engine_id
            served.gateway = self.dispatcher.gateway_of(effect.route)

    def result_delivered(self, effect: DeliverResult) -> None:
        self._served(effect)
        result = effect.result
        if effect.last:
            self._end()
        kind = result.WhichOneof("message")
        if kind == "http_response":
            # Headers (and a non-streaming body) are written out at once.
            self.sink.response_received(result.http_response, verbatim=result.verbatim_answer)
            self.consumed(1)
        elif kind == "server_sent_event" and result.server_sent_event.data:
            self.sink.event_received(bytes(result.server_sent_event.data))
        else:
            # A result with nothing to relay (the bare last event) is consumed at once.
            self.consumed(1)
        if effect.last:
            self.sink.completed()

    def request_failed(self, effect: FailRequest) -> None:
        self._served(effect)
        self._end()
        self.sink.failed(effect.status, effect.message, effect.retry_after)

    # TaskHandle

    def cancel(self) -> None:
        if not self.ended:
            self._end()
            self.dispatcher.run(lambda now: self.dispatcher.processor.cancel(now, self.task_id))

    def consumed(self, count: int) -> None:
        self.dispatcher.processor.results_consumed(self.task_id, count)
