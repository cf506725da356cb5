"""The gateway core's Twisted owner: feeds it inputs, performs its effects, arms its timer.

The core (:mod:`protocol.gateway.core`, which owns the processor, the peer
accepted peers and dialled peers, request accounting and the scaler's signals) decides;
this module acts. It is the one place that calls the core, so every input is
followed by performing the returned effects in order and re-arming the single
``callLater`` from ``next_deadline()``. Routes (engine streams, peer streams)
and HTTP requests are objects with the small interfaces below; effects on
peer dials and peer streams go to the exchanger's performer and the scaler's
signals to the scaler link, so the worker service, the gateway, the exchanger
and the scaler plug in without knowing each other. Logging and metrics stay
here.
"""

from __future__ import annotations

import enum
import itertools
import random
import secrets
from typing import Any, Callable, Iterator, Protocol

from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger

from infx.deadline import DeadlineTimer
from infx.gateway.metrics import OTHER_MODEL, GatewayMetrics
from infx.gateway.tasks import Availability, ResultSink, ServedBy, Submission, TaskHandle
from protocol.gateway.core import GatewayCore
from protocol.gateway.effects import (
    CancelDial,
    CoreConfig,
    CoreEffect,
    EndPeerStream,
    HalfCloseDial,
    ModelServed,
    OpenDial,
    PeerDialledBack,
    PeerDialledIn,
    PeerDisconnected,
    PeerDraining,
    PeerGone,
    PeerOneWay,
    PeerRequests,
    ReportLoad,
    RequestDispatched,
    RequestFinished,
    RequestStarted,
    SendOnDial,
    TaskReleased,
)
from protocol.pb import status_pb2, worker_pb2
from protocol.processor.core import Processor
from protocol.processor.effects import (
    CancelTaskOnEngine,
    CloseEngine,
    CloseRoute,
    DeliverResult,
    FailRequest,
    RefuseEngine,
    SendTask,
    TaskQueued,
)
from protocol.processor.keys import Locality
from protocol.processor.route_flow import MAX_ROUTE_QUEUED_BYTES

log = Logger(namespace="infx.dispatcher")


class SendOutcome(enum.Enum):
    """What became of a task handed to a route."""

    SENT = "sent"  # queued, and the stream takes more
    BLOCKED = "blocked"  # queued, but the stream is not draining: the route reports when it drains
    REFUSED = "refused"  # not queued: the stream already holds its cap of queued bytes
    GONE = "gone"  # not queued: the route is closed


class EngineRoute(Protocol):
    """Where tasks for an engine go: a local engine's stream or the accepted peer that reported it."""

    def send_task(self, task: worker_pb2.Task, tenant_id: str) -> SendOutcome:
        """Queue ``task`` for sending, or say why not; a route that answers BLOCKED
        calls :meth:`Dispatcher.route_writable` once its stream drains."""

    def withdraw_task(self, wire_id: str) -> bool:
        """Take the task sent as ``wire_id`` back if it still waits whole in the stream's
        queue (its engine never sees it); whether it did."""

    def close(self, reason: str) -> None:
        """End the route (the processor gave up on its engine)."""


class SplicingRoute(EngineRoute, Protocol):
    """An engine's route in this process (:mod:`infx.gateway.in_process`), which takes a committed
    stream's events past the processor."""

    def splice(self, wire_id: str, origin: HttpOrigin) -> None:
        """The stream of the task sent as ``wire_id`` is committed to ``origin``: hand its events to
        :meth:`HttpOrigin.spliced_event` from now on, but those that may hold the prompt's usage
        and its end, which still come as results."""


class RefusableRoute(EngineRoute, Protocol):
    """A local engine's stream, which the processor may refuse (another engine process's id)."""

    def refuse(self, reason: str) -> None:
        """End the stream with ALREADY_EXISTS and ``reason`` (its owner logs the refusal)."""


class StreamSendGate:
    """A route's sends on its gRPC call, with the call's backpressure turned into
    :class:`SendOutcome` (shared by engine streams and peer streams).

    The call's ``send()`` Deferred is already fired while the stream takes more;
    an unfired one means the stream is over its high-water mark (the peer's
    flow-control window is shut, or the transport is paused): the gate is blocked
    until it fires, and while blocked refuses a task once ``max_queued_bytes`` are
    queued, so a peer that never reads holds at most that much (plus one task).
    Each task is queued under its wire id, so that one whose request ended can be
    withdrawn while none of it went out (:meth:`withdraw`): what a peer that reads
    nothing holds drops to nothing once the requests sent its way have ended.
    """

    def __init__(self, call: Any, on_drained: Callable[[], None],
                 max_queued_bytes: int = MAX_ROUTE_QUEUED_BYTES) -> None:
        self.call = call
        self.on_drained = on_drained
        self.max_queued_bytes = max_queued_bytes
        self.blocked = False

    def send(self, message: Any, wire_id: str) -> SendOutcome:
        if self.blocked and self.call.buffered_amount >= self.max_queued_bytes:
            return SendOutcome.REFUSED
        sent = self.call.send(message, key=wire_id)
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

    def withdraw(self, wire_id: str) -> bool:
        """Take the task sent as ``wire_id`` back if none of it went out; whether it did.
        The gate stays blocked: only the peer reading again unblocks it."""
        return bool(self.call.withdraw(wire_id))

    @property
    def queued_bytes(self) -> int:
        """Bytes queued on the stream that its peer has not taken yet."""
        return int(self.call.buffered_amount)

    def _drained(self, _: object) -> None:
        self.blocked = False
        self.on_drained()


class TaskOrigin(Protocol):
    """An HTTP request, as the effects of its task name it."""

    def dispatched(self, now: float) -> None: ...

    def result_delivered(self, effect: DeliverResult) -> None: ...

    def request_failed(self, effect: FailRequest) -> None: ...


#: Effects on peer dials and accepted peer streams: performed by the exchanger.
PEER_EFFECTS = (OpenDial, SendOnDial, HalfCloseDial, CancelDial, EndPeerStream, PeerDialledIn, PeerDialledBack,
                PeerOneWay, PeerDraining, PeerDisconnected, PeerRequests, PeerGone)
#: The scaler's signals: performed by the scaler link.
SCALER_EFFECTS = (TaskQueued, ModelServed, TaskReleased, ReportLoad)


class Dispatcher:
    """Owns one :class:`~protocol.gateway.core.GatewayCore` on a reactor; the gateway's TaskRunner."""

    def __init__(self, clock: IReactorTime, processor: Processor, metrics: GatewayMetrics,
                 task_ids: Callable[[], str] | None = None, config: CoreConfig | None = None,
                 rng: random.Random | None = None) -> None:
        self.clock = clock
        self.processor = processor
        self.core = GatewayCore(processor, config or CoreConfig(pod_name=""), rng or random.Random())
        self.metrics = metrics
        counter = itertools.count(1)
        # A task forwarded to a peer keeps its id there, beside the peer's own tasks: a random
        # prefix per gateway keeps two gateways' counters from handing out the same id.
        prefix = secrets.token_hex(4)
        self._new_id = task_ids or (lambda: f"t{prefix}-{next(counter)}")
        self._timer = DeadlineTimer(clock, self._fire)
        # The wire id of the last SendTask its route refused (its request's wait goes on).
        self._refused_wire_id = ""
        #: Performs effects on peer dials and peer streams (the exchanger sets it).
        self.peer_effects: Callable[[CoreEffect], None] | None = None
        #: Performs the scaler's signals (the scaler link sets it).
        self.scaler_effects: Callable[[CoreEffect], None] | None = None
        #: Called with the model of each accepted HTTP request, and again when it ends (load for the scaler).
        self.on_request_started: list[Callable[[str], None]] = []
        self.on_request_finished: list[Callable[[str], None]] = []
        #: The tracer when tracing is on (:class:`infx.tracing.spans.Tracing`): a span per task routed.
        self.tracing: Any = None

    @property
    def pod_name(self) -> str:
        """This gateway's name, for the request log of requests its own engines served."""
        return self.core.config.pod_name

    @property
    def requests_started(self) -> dict[str, int]:
        """Requests accepted from clients since start, per model (reported to every peer)."""
        return self.core.requests_started

    # --- inputs -----------------------------------------------------------

    def run(self, step: Callable[[float], list[CoreEffect]]) -> None:
        """Run one core input at the current time and perform what it returns."""
        self.perform(step(self.clock.seconds()))

    def perform(self, effects: list[Any]) -> None:
        for effect in effects:
            self._perform_one(effect)
        self._arm()

    def _perform_one(self, effect: CoreEffect) -> None:
        # One dict look-up by the effect's type, not a walk down a chain of isinstance checks:
        # a request by URL performs five effects, and SendTask was the only one found first.
        performer = _PERFORMERS.get(type(effect)) or _performer_of(type(effect))
        performer(self, effect)

    def _send_task(self, effect: SendTask) -> None:
        route: EngineRoute = effect.route  # type: ignore[assignment]
        processor = self.processor
        engine = processor.engine(effect.engine.tenant_id, effect.engine.engine_id)
        if engine is not None and engine.locality is Locality.REMOTE:
            self.metrics.exchanged.labels("out").inc()
        if self.tracing is not None and not effect.task.id.startswith(processor.config.control_task_prefix):
            self.tracing.task_routed(effect, self.pod_name, self.gateway_of(effect.route),
                                     None if engine is None else engine.locality,
                                     processor.config.routing.policy.value)
        outcome = route.send_task(effect.task, effect.engine.tenant_id)
        if outcome is SendOutcome.SENT:
            return
        wire_id = effect.task.id
        now = self.clock.seconds()
        if outcome is SendOutcome.GONE:
            self._perform_later(self.core.task_not_sent(route, wire_id, now))
        elif outcome is SendOutcome.REFUSED:
            self._refused_wire_id = wire_id
            self._perform_later(self.core.task_refused(route, wire_id, now))
        elif outcome is SendOutcome.BLOCKED:
            self._blocked(route)

    def _request_dispatched(self, effect: RequestDispatched) -> None:
        # A refused task goes back to the queue: its wait has not ended.
        if effect.wire_id != self._refused_wire_id:
            origin: TaskOrigin = effect.origin  # type: ignore[assignment]
            origin.dispatched(self.clock.seconds())

    def _deliver_result(self, effect: DeliverResult) -> None:
        origin: TaskOrigin = effect.origin  # type: ignore[assignment]
        origin.result_delivered(effect)

    def _fail_request(self, effect: FailRequest) -> None:
        origin: TaskOrigin = effect.origin  # type: ignore[assignment]
        origin.request_failed(effect)

    def _cancel_task_on_engine(self, effect: CancelTaskOnEngine) -> None:
        route: EngineRoute = effect.route  # type: ignore[assignment]
        if route.withdraw_task(effect.cancelled_task_id):
            # Its engine never saw the task: neither the task nor a cancel goes out.
            self.metrics.withdrawn_tasks.inc()
            self._perform_later(self.core.cancel_unsent(route, effect.task.id, self.clock.seconds()))
        # Best effort: a cancel the route refuses is dropped, but a stream it shows
        # to be blocked is blocked for tasks too.
        elif route.send_task(effect.task, effect.engine.tenant_id) is SendOutcome.BLOCKED:
            self._blocked(route)

    def _close_engine(self, effect: CloseEngine) -> None:
        route: EngineRoute = effect.route  # type: ignore[assignment]
        log.warn("closing engine {engine}: {reason}", engine=effect.engine.engine_id, reason=effect.reason)
        route.close(effect.reason)

    def _refuse_engine(self, effect: RefuseEngine) -> None:
        refused: RefusableRoute = effect.route  # type: ignore[assignment]
        refused.refuse(effect.reason)

    def _close_route(self, effect: CloseRoute) -> None:
        route: EngineRoute = effect.route  # type: ignore[assignment]
        log.warn("closing {route}: {reason}", route=repr(route), reason=effect.reason)
        route.close(effect.reason)

    def _request_started(self, effect: RequestStarted) -> None:
        for started in self.on_request_started:
            started(effect.model)

    def _request_finished(self, effect: RequestFinished) -> None:
        for finished in self.on_request_finished:
            finished(effect.model)

    def _peer_effect(self, effect: CoreEffect) -> None:
        if self.peer_effects is not None:
            self.peer_effects(effect)

    def _scaler_effect(self, effect: CoreEffect) -> None:
        if self.scaler_effects is not None:
            self.scaler_effects(effect)

    def _blocked(self, route: EngineRoute) -> None:
        # Told now, not later, so that the very next input already routes around it.
        effects = self.core.route_blocked(route, self.clock.seconds())
        if effects:
            self._perform_later(effects)

    def _perform_later(self, effects: list[CoreEffect]) -> None:
        # Effects produced while performing others run after them, in order.
        self.clock.callLater(0, self.perform, effects)

    def run_later(self, step: Callable[[float], list[CoreEffect]]) -> None:
        """Run a core input once the effects being performed are done."""
        self.clock.callLater(0, self.run, step)

    def _arm(self) -> None:
        self._timer.arm(self.core.next_deadline())

    def _fire(self) -> None:
        self.run(self.core.handle_timeout)

    # --- engines (called by the worker service) ---------------------------

    def engine_status(self, route: EngineRoute, tenant_id: str, status: status_pb2.EngineStatus,
                      locality: Locality = Locality.LOCAL) -> None:
        self.run(lambda now: self.core.engine_status(route, tenant_id, status, locality, now))

    def route_closed(self, route: EngineRoute, reason: str) -> None:
        self.run(lambda now: self.core.engine_closed(route, reason, now))

    def route_writable(self, route: EngineRoute) -> None:
        """A route that answered BLOCKED drains again: it takes tasks again."""
        self.run(lambda now: self.core.route_writable(route, now))

    def result_received(self, route: EngineRoute, result: worker_pb2.TaskResult) -> None:
        # Once per relayed event: the core called directly, not through run() and a lambda.
        self.perform(self.core.engine_result(route, result, self.clock.seconds()))

    def drain(self) -> None:
        """Shutdown: local engines go away; what no peer's engine can take fails at once with 503."""
        self.run(self.core.drain)

    # --- the gateway's TaskRunner -----------------------------------------

    def submit(self, submission: Submission, sink: ResultSink) -> TaskHandle:
        task_id = self._new_id()
        now = self.clock.seconds()
        origin = HttpOrigin(self, task_id, submission.tenant, submission.model, sink, now, submission.trace)
        deadline = None if submission.timeout is None else now + submission.timeout
        self.perform(self.core.submit(origin, task_id, submission.tenant, submission.model, submission.request,
                                      submission.headers, deadline, now, criticality=submission.criticality,
                                      flow=submission.flow, weight=submission.weight,
                                      hints=submission.routing_hints))
        return origin

    def availability(self, tenant: str, model: str) -> Availability:
        return self.core.availability(tenant, model, self.clock.seconds())

    def can_start(self, tenant: str, model: str) -> bool:
        """Whether the scaler could start an engine for ``model``."""
        return self.core.can_start(tenant, model)

    def takes_http_request(self, tenant: str, model: str) -> bool:
        return self.processor.takes_http_request(tenant, model)

    def typed_form_wanted(self, tenant: str, model: str) -> bool:
        return self.processor.typed_form_wanted(tenant, model)

    def models(self, tenant: str) -> list[str]:
        return sorted(self.processor.known_models(tenant, ready_only=True))

    def status(self, tenant: str | None = None) -> dict[str, Any]:
        return self.processor.status(tenant)

    def model_label(self, tenant: str, model: str) -> str:
        """``model`` as a metric label: itself if the tenant's engines list it, else OTHER_MODEL."""
        # serves() looks the model up; known_models() would build the set of all the tenant's models.
        return model if self.processor.serves(tenant, model) else OTHER_MODEL

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


#: Each effect's performer, by the effect's type.
_PERFORMERS: dict[type, Callable[[Dispatcher, Any], None]] = {
    SendTask: Dispatcher._send_task, RequestDispatched: Dispatcher._request_dispatched,
    DeliverResult: Dispatcher._deliver_result, FailRequest: Dispatcher._fail_request,
    CancelTaskOnEngine: Dispatcher._cancel_task_on_engine, CloseEngine: Dispatcher._close_engine,
    RefuseEngine: Dispatcher._refuse_engine, CloseRoute: Dispatcher._close_route,
    RequestStarted: Dispatcher._request_started, RequestFinished: Dispatcher._request_finished,
    **{kind: Dispatcher._peer_effect for kind in PEER_EFFECTS},
    **{kind: Dispatcher._scaler_effect for kind in SCALER_EFFECTS},
}


def _performer_of(kind: type) -> Callable[[Dispatcher, Any], None]:
    """The performer of a subclass of an effect type (none is made today), found by its bases."""
    for base in kind.__mro__:
        if base in _PERFORMERS:
            return _PERFORMERS[base]
    raise AssertionError(f"no performer for {kind.__name__}")


class HttpOrigin:
    """Turns the processor's effects for one HTTP request into ResultSink calls; its TaskHandle."""

    def __init__(self, dispatcher: Dispatcher, task_id: str, tenant: str, model: str, sink: ResultSink,
                 submitted_at: float, trace: Any = None) -> None:
        self.dispatcher = dispatcher
        self.task_id = task_id
        self.tenant = tenant
        self.model = model
        self.sink = sink
        self.submitted_at = submitted_at
        self.served_by: ServedBy | None = ServedBy()
        self.ended = False
        #: The request's span when tracing is on (:class:`infx.tracing.spans.RequestSpan`).
        self.trace = trace

    def dispatched(self, now: float) -> None:
        """The first SendTask for this request is being performed: its wait in the queue ends."""
        served = self.served_by
        if served is not None and served.queued_seconds is None:
            if self.trace is not None:
                self.trace.dispatched()
            served.queued_seconds = now - self.submitted_at
            label = self.dispatcher.model_label(self.tenant, self.model)
            metrics = self.dispatcher.metrics
            metrics.child(metrics.queue_seconds, self.tenant, label).observe(served.queued_seconds)

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
            self.ended = True
        kind = result.WhichOneof("message")
        if kind == "http_response":
            # Headers (and a non-streaming body) are written out at once.
            self.sink.response_received(result.http_response, verbatim=result.verbatim_answer)
            self.consumed(1)
            if not effect.last and result.verbatim_answer:
                # The runtime's own stream, committed: an engine in this process hands its events
                # straight to the client (SplicingRoute).
                splice = getattr(effect.route, "splice", None)
                if splice is not None:
                    splice(effect.wire_id, self)
        elif kind == "server_sent_event" and result.server_sent_event.data:
            self.sink.event_received(bytes(result.server_sent_event.data))
        else:
            # A result with nothing to relay (the bare last event) is consumed at once.
            self.consumed(1)
        if effect.last:
            self.sink.completed()

    def spliced_event(self, data: bytes) -> bool:
        """An event of this request's spliced stream, from its engine in this process; False: not
        written now (the client is behind), so it comes again the usual way, in order."""
        if self.ended:
            return True  # cancelled: as the processor drops the results of a task that ended
        return self.sink.event_spliced(data)

    def request_failed(self, effect: FailRequest) -> None:
        self._served(effect)
        self.ended = True
        self.sink.failed(effect.status, effect.message, effect.retry_after, effect.code, effect.detail)

    # TaskHandle

    def cancel(self) -> None:
        if not self.ended:
            self.ended = True
            self.dispatcher.run(lambda now: self.dispatcher.core.cancel(self.task_id, now))

    def consumed(self, count: int) -> None:
        effects = self.dispatcher.core.results_consumed(self.task_id, count, self.dispatcher.clock.seconds())
        if effects:
            self.dispatcher.perform(effects)
