"""The inference processor: task queue, engines, routing, retries, ordered results.

No I/O, no clock reads: every input is a method call that takes ``now`` (in
seconds, on any monotonic scale the caller likes) and returns the effects the
caller must perform, in order, as values (see :mod:`protocol.processor.effects`).
``next_deadline()`` says when to call ``handle_timeout(now)``. Every input is
here; what it does to tasks, engines and slots is done by the parts below, and
every accepted task ends exactly once: with a ``DeliverResult(last=True)``, a
``FailRequest``, or the caller's own ``cancel``.

Inputs
    ``submit``                 a request from a client or a peer (untargeted or targeted)
    ``cancel``                 the client went away: drop the request, stop the engine
    ``results_consumed``       the consumer took delivered results (bounded buffering)
    ``update_engine``          an ``EngineStatus`` from a local engine or a peer's report
    ``remove_engine``          an engine disappeared (peer report)
    ``close_route``            a stream ended: its engines go, its tasks fail over
    ``receive_result``         a ``TaskResult`` arrived on a route
    ``dispatch_failed``        a ``SendTask`` could not be sent
    ``dispatch_refused``       a route at its queue cap did not take a ``SendTask``
    ``route_blocked``          a route's stream stopped draining (backpressure)
    ``route_writable``         a blocked route drains again
    ``go_away``                ask local engines to reconnect elsewhere
    ``drain``                  shutdown: ``go_away``, and tasks no engine left can take fail at once
    ``fail_waiting``           the scaler gives up on a model: fail its waiting tasks
    ``handle_timeout``         time passed: deadlines, queue timeouts, retries, heartbeats

Outputs (effects, performed by the caller in the order given)
    ``SendTask``               send a Task on a route (engine stream or accepted peer)
    ``CancelTaskOnEngine``     send a cancel Task on a route (best effort)
    ``DeliverResult``          hand the next result to its origin; ``last`` ends the request
    ``FailRequest``            end the request with an HTTP status and a reason
    ``CloseEngine``            close a local engine's stream (missed heartbeats)
    ``CloseRoute``             close a route that stayed blocked past ``route_stuck_timeout``
    ``RefuseEngine``           end the stream of an engine that claims another engine process's id
    ``TaskQueued``             a task waits for a model no ready engine serves (scaler hook)
    ``LocalEnginesChanged``    re-report local engines to peers (dialled peers)
    ``EnginesRemoved``         engines left: accepted peers may register what their peers reported

Parts (collaborating objects, each with its own state; none imports another's privates)
    ``tasks.TaskTable``        live tasks, the task life cycle (drawn and enforced there), attempts, timers
    ``engines.EngineTable``    engines by key, tenant and (tenant, model); busy runtimes' back-offs
    ``control.ControlTasks``   the processor's own tasks (heartbeats, go-aways, cancels), clash probes
    ``slots.Slots``            slots held and tasks waiting, per caller, model and engine; caps, the reserve
    ``endings.Endings``        a task's end: delivered, failed or cancelled, in one place
    ``dispatcher.TaskDispatcher`` where a task goes (routing, dispatch) and which waiting task takes a freed slot
    ``retries.Retries``        a failed attempt: sent again, held, or the end
    ``membership.Membership``  engines joining, changing and leaving; heartbeats, go-away, id clashes
    the router                 :class:`protocol.routing.router.Router`, the policy ``config.routing`` names
    ``route_flow.RouteFlow``   routes that stopped draining

Routing: engines of the task's tenant only, and only those that can take the
task's request (:func:`protocol.openai.task_forms.eligible`; each gets the form it
understands, :func:`protocol.openai.task_forms.for_engine`), ready with the model
ready; engines that already failed this task last. Then the policy of
``config.routing`` (:mod:`protocol.routing.router`): ``affinity`` (infx's, for a task
submitted with ``RoutingHints``: bounded-load consistent hashing refined by
prefix, session and adapter affinity), ``round_robin``, or
``least_in_progress`` (LLMariner's, and the rule for tasks without hints):
local before remote, then fewest in-flight tasks, then engine id (so the
choice is deterministic).

Backpressure (:mod:`protocol.processor.route_flow`): an engine whose route is blocked
(not draining) counts as full, so its tasks go elsewhere or wait; a task the
route refused at its queue cap is routed again at once, with no retry counted;
a route blocked for ``route_stuck_timeout`` is closed and its tasks fail over.

Caps, fair queues and shedding: see :mod:`protocol.processor.slots`; routing, dispatch and
the waiting tasks that take freed slots: :mod:`protocol.processor.dispatcher`; attempts,
retries and busy runtimes: :mod:`protocol.processor.retries`; the task life cycle:
:mod:`protocol.processor.tasks`.

Draining (``drain``, on shutdown): local engines are told to go away, and a
task that would wait (no routable engine, local or a peer's, serves its
model) fails at once with 503 and ``busy_retry_after`` instead, as do those
already waiting for such a model: nothing will come to serve them here, and
the client is better off retrying at once elsewhere than holding on for the
grace period. Tasks a peer's engine can take are still routed to it.

Size (over 600 lines): it is the processor's whole surface, every input and every query
GatewayCore and the metrics read, each a few lines handing the work to the parts (``tasks``,
``slots``, ``dispatcher``...); its docstring is the processor's manual.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

from protocol.agent.prompt_usage import prompt_usage
from protocol.openai import task_forms
from protocol.pb import status_pb2, worker_pb2
from protocol.processor.attempts import AttemptFailure, failure_of
from protocol.processor.control import ControlTasks
from protocol.processor.counters import ProcessorCounters
from protocol.processor.dispatcher import TaskDispatcher
from protocol.processor.endings import Endings
from protocol.processor.engines import EngineReport, EngineTable, EngineView
from protocol.processor.fair_queue import Criticality, weight_problem
from protocol.processor.membership import Membership
from protocol.processor.retries import ENGINE_LOST_MID_STREAM, Retries
from protocol.processor.route_flow import RouteFlow
from protocol.processor.slots import Slots
from protocol.processor.tasks import ON_ENGINE, TaskOutcome, TaskRecord, TaskState, TaskTable
from protocol.processor.config import ProcessorConfig
from protocol.processor.effects import (
    CancelTaskOnEngine,
    CloseEngine,
    CloseRoute,
    DeliverResult,
    Effect,
    EnginesRemoved,
    FailRequest,
    LocalEnginesChanged,
    RefuseEngine,
    SendTask,
    TaskQueued,
)
from protocol.processor.errors import ProcessorUsageError
from protocol.processor.keys import EngineKey, Locality, Origin, Route
from protocol.processor.requests import is_streaming, model_of
from protocol.routing.hints import RoutingHints
from protocol.routing.router import Router

__all__ = [
    "ENGINE_LOST_MID_STREAM",
    "CancelTaskOnEngine",
    "CloseEngine",
    "CloseRoute",
    "DeliverResult",
    "Effect",
    "EngineKey",
    "EngineReport",
    "EngineView",
    "EnginesRemoved",
    "FailRequest",
    "Locality",
    "LocalEnginesChanged",
    "Processor",
    "ProcessorConfig",
    "ProcessorCounters",
    "ProcessorUsageError",
    "RefuseEngine",
    "SendTask",
    "TaskOutcome",
    "TaskQueued",
    "TaskState",
]


class Processor:
    """Routes tasks to engines and results back to requests; see the module docstring."""

    def __init__(self, config: ProcessorConfig | None = None) -> None:
        self.config = config = config or ProcessorConfig()
        self.counters = counters = ProcessorCounters()
        self._tasks = tasks = TaskTable()
        self._engines = engines = EngineTable()
        self._router = router = Router(config.routing)
        self._flow = flow = RouteFlow(config.route_stuck_timeout)
        self._control = control = ControlTasks(config.control_task_prefix, engines)
        self._slots = slots = Slots(config, tasks, engines, router, flow)
        self._endings = endings = Endings(config, counters, tasks, slots, control)
        self._dispatcher = dispatcher = TaskDispatcher(config, counters, tasks, engines, slots, endings, router)
        self._retries = retries = Retries(config, counters, tasks, engines, slots, endings, dispatcher)
        self._membership = Membership(config, counters, tasks, engines, router, flow, control, endings, dispatcher,
                                      retries)

    # --- queries ----------------------------------------------------------

    def has_task(self, task_id: str) -> bool:
        """Whether ``task_id`` is accepted and has not ended."""
        return task_id in self._tasks

    def attempt_owner(self, wire_id: str) -> str | None:
        """The task whose current attempt carries ``wire_id`` on the wire, if any."""
        task = self._tasks.by_attempt(wire_id)
        return None if task is None else task.id

    def task_state(self, task_id: str) -> TaskState:
        """The state of a live task."""
        state = self._tasks.require(task_id).state
        assert state is not None
        return state

    def waiting_counts(self) -> dict[tuple[str, str], int]:
        """Tasks waiting for an engine, per (tenant, model), peers' tasks waiting for a slot on
        one of ours included: the scaler's demand signal and the queued metric."""
        return self._slots.waiting_counts()

    def waiting_task_ids(self, tenant_id: str, model_id: str) -> list[str]:
        """Tasks waiting for (tenant, model), oldest first."""
        return list(self._slots.waiting.get((tenant_id, model_id), ()))

    def slots_held(self, tenant_id: str, model_id: str) -> dict[str, int]:
        """Tasks on an engine per caller (flow) of (tenant, model): what fairness counts."""
        return self._slots.shares.held(tenant_id, model_id)

    def in_flight_counts(self) -> dict[tuple[str, str], int]:
        """Tasks on an engine (dispatched or streaming), per (tenant, model)."""
        counts: dict[tuple[str, str], int] = {}
        for task in self._tasks.values():
            if task.state in ON_ENGINE:
                counts[(task.tenant_id, task.model)] = counts.get((task.tenant_id, task.model), 0) + 1
        return counts

    def engine_counts(self) -> dict[tuple[str, Locality], int]:
        """Engines per (tenant, locality)."""
        return self._engines.counts()

    def routable_engine_counts(self) -> dict[tuple[str, Locality], int]:
        """Engines that take tasks now (ready, not told to go away), per (tenant, locality)."""
        return self._engines.counts(routable_only=True)

    def tenants(self) -> list[str]:
        """Tenants with at least one engine registered, sorted."""
        return self._engines.tenants()

    def engine(self, tenant_id: str, engine_id: str) -> EngineView | None:
        """What the processor knows of one engine, or None if it is not registered."""
        return self._engines.view(EngineKey(tenant_id, engine_id))

    def engine_reports(self, tenant: str | None = None) -> list[EngineReport]:
        """Every engine (with ``tenant``, that tenant's), by tenant then name here."""
        out = []
        for tenant_id, engines in self._engines.by_tenant():
            if tenant is not None and tenant_id != tenant:
                continue
            for _, e in sorted(engines.items()):
                out.append(EngineReport(e.key, e.route, e.locality, e.status, e.routable, e.draining, e.busy_until,
                                        tuple(sorted(e.in_flight)), tuple(self._slots.waiting_on_engine(e.key)),
                                        self._router.load(e.key)))
        return out

    def criticality_counts(self) -> dict[tuple[str, str], int]:
        """Live tasks (waiting or on an engine) per (tenant, criticality)."""
        return dict(Counter((t.tenant_id, t.criticality.value) for t in self._tasks.values()))

    def routing_decisions(self) -> dict[tuple[str, str, str], int]:
        """Tasks the routing policy placed since start, per (tenant, model, decision)
        (:class:`~protocol.routing.policy.RoutingDecision`)."""
        return dict(self._router.decisions)

    def takes_http_request(self, tenant_id: str, model_id: str) -> bool:
        """Whether an engine of the tenant that lists the model (ready or not) runs verbatim requests."""
        return self._engines.takes_http_request(tenant_id, model_id)

    def typed_form_wanted(self, tenant_id: str, model_id: str) -> bool:
        """Whether a request for the model needs its typed form built now: an engine that may get
        it takes only that form, or none is known yet (see :mod:`protocol.openai.verbatim`)."""
        return self._engines.typed_form_wanted(tenant_id, model_id, self.config.dynamic_model_loading)

    def serves(self, tenant_id: str, model_id: str) -> bool:
        """Whether an engine of the tenant lists the model (ready or loading)."""
        return self._engines.serves(tenant_id, model_id)

    def known_models(self, tenant_id: str, ready_only: bool = False) -> set[str]:
        """Models the tenant's engines list (loading ones too); with ``ready_only``,
        only those a task could be routed to now."""
        return self._engines.known_models(tenant_id, ready_only)

    def tips_recorded(self) -> int:
        """New spilled tips recorded for local engines since start: when it grows, what
        :meth:`local_engines` reports has changed beyond load counts."""
        return self._router.tips_recorded()

    def local_engines(self) -> list[tuple[str, status_pb2.EngineStatus]]:
        """(tenant, status copy) of every local engine, with its real readiness."""
        out = []
        for engine in self._engines.local():
            copy = status_pb2.EngineStatus()
            copy.CopyFrom(engine.status)
            self._router.annotate(engine.key, copy)  # what peers learn of its spilled prompts
            out.append((engine.key.tenant_id, copy))
        return out

    def status(self, tenant: str | None = None) -> dict[str, Any]:
        """A JSON-able dump of tenants, engines, their tasks and the queue; with ``tenant``, of
        that tenant alone (what its own admin may see)."""
        tenants: dict[str, Any] = {}
        for tenant_id, engines in self._engines.by_tenant():
            if tenant is not None and tenant_id != tenant:
                continue
            tenants[tenant_id] = {
                "engines": {
                    engine_id: {
                        # The id it reports (a peer's engine is named with its gateway's pod here).
                        "engine_id": e.status.engine_id,
                        "locality": e.locality.value,
                        "ready": e.status.ready,
                        "draining": e.draining,
                        "busy_until": e.busy_until,
                        "cluster_id": e.status.cluster_id,
                        "models": [
                            {"id": m.id, "ready": m.is_ready, "in_progress": m.in_progress_task_count}
                            for m in sorted(e.status.models, key=lambda m: m.id)
                        ],
                        "tasks": sorted(e.in_flight),
                        # Peers' tasks waiting here for a slot on it.
                        "waiting": self._slots.waiting_on_engine(e.key),
                    }
                    for engine_id, e in sorted(engines.items())
                }
            }
        queue: dict[str, Any] = {}
        for (tenant_id, model), ids in sorted(self._slots.waiting.items()):
            if ids and tenant in (None, tenant_id):
                queue.setdefault(tenant_id, {})[model] = list(ids)
        retrying = sorted(t.id for t in self._tasks.values()
                          if t.state is TaskState.RETRY_PENDING and tenant in (None, t.tenant_id))
        tasks = len(self._tasks) if tenant is None else self._tasks.of_tenant(tenant)
        return {"tenants": tenants, "waiting": queue, "retry_pending": retrying, "tasks": tasks}

    # --- requests ---------------------------------------------------------

    def submit(
        self,
        *,
        task_id: str,
        tenant_id: str,
        request: worker_pb2.TaskRequest,
        origin: Origin,
        header: Mapping[str, Sequence[str]] | None = None,
        deadline: float | None = None,
        target_engine_id: str = "",
        criticality: Criticality = Criticality.STANDARD,
        flow: str = "",
        weight: float = 1.0,
        hints: RoutingHints | None = None,
        now: float,
    ) -> list[Effect]:
        """Accept a task; it ends exactly once (result, failure, or ``cancel``).

        ``deadline`` is absolute, on the scale of ``now``; None means
        ``now + config.max_task_duration``. ``target_engine_id`` pins the task
        to one engine of the tenant (a task forwarded by a peer, a heartbeat):
        it is never retried, and fails with 503 at once if that engine is not
        there or not ready, so that a forwarding peer can retry elsewhere.
        ``criticality``, ``flow`` and ``weight`` place it in its model's queue
        should it wait (see the module docstring).
        ``hints`` (:func:`protocol.routing.hints.hints_from_json`) let the
        affinity policy route by prefix, session and adapter.
        """
        if task_id in self._tasks or task_id in self._control:
            raise ProcessorUsageError(f"task {task_id!r} is already in progress")
        if not task_id or task_id.startswith(self.config.control_task_prefix):
            raise ProcessorUsageError(f"task id {task_id!r} is empty or uses the control prefix")
        if request.WhichOneof("request") is None:
            raise ProcessorUsageError(f"task {task_id!r} has an empty request")
        weight_refused = weight_problem(weight)
        if weight_refused:
            raise ProcessorUsageError(f"task {task_id!r}: {weight_refused}")
        model = model_of(request)
        if not model and not target_engine_id:
            raise ProcessorUsageError(f"task {task_id!r} names neither a model nor a target engine")
        task = TaskRecord(
            id=task_id,
            tenant_id=tenant_id,
            model=model,
            request=request,
            header={name: list(values) for name, values in (header or {}).items()},
            origin=origin,
            streaming=is_streaming(request),
            deadline=now + self.config.max_task_duration if deadline is None else deadline,
            target=target_engine_id,
            criticality=criticality,
            flow=flow,
            weight=weight,
            hints=hints,
        )
        tenant_cap = self.config.max_tasks_per_tenant
        over_tenant_cap = tenant_cap is not None and self._tasks.of_tenant(tenant_id) >= tenant_cap
        self._tasks.add(task)
        self.counters.accepted += 1
        effects: list[Effect] = []
        if over_tenant_cap:
            self.counters.tenant_cap_refusals += 1
            message = f"too many tasks in progress for this tenant (limit {tenant_cap})"
            self._endings.fail(task, 503 if task.target else 429, message, effects, self.config.busy_retry_after)
        elif task.deadline <= now:
            self._endings.fail(task, 504, "deadline exceeded before the task was scheduled", effects)
        elif task.target:
            engine = self._engines.of_tenant(tenant_id).get(task.target)
            if engine is None:
                self._endings.fail(task, 503, f"engine {task.target!r} is not connected", effects)
            elif not task_forms.eligible(request, engine.status):
                self._endings.fail(task, 503, f"engine {task.target!r} cannot take this request's form", effects)
            elif not engine.routable:
                self._endings.fail(task, 503, f"engine {task.target!r} is not ready", effects)
            elif engine.route in self._flow:
                message = f"engine {task.target!r} is not taking tasks (its stream is not draining)"
                self._endings.fail(task, 503, message, effects, self.config.busy_retry_after)
            elif self._slots.full(engine, self._slots.may_use_reserve(task)):
                self._dispatcher.wait_on_engine(now, task, engine, effects)
            else:
                self._dispatcher.dispatch(now, task, engine, effects)
        else:
            self._dispatcher.route(now, task, effects)
        self._dispatcher.refill(now, effects)
        return effects

    def cancel(self, task_id: str, now: float) -> list[Effect]:
        """The client went away: the request ends with no answer, and its engine is told to stop."""
        task = self._tasks.require(task_id)
        effects: list[Effect] = []
        self._endings.stop_on_engine(task, effects)
        self._endings.end(task, TaskOutcome.CANCELLED)
        self._dispatcher.refill(now, effects)
        return effects

    def results_consumed(self, task_id: str, count: int = 1) -> None:
        """The consumer of ``task_id`` took ``count`` more delivered results.

        Acknowledging a task that has already ended is expected (the last
        result ends it) and does nothing.
        """
        task = self._tasks.get(task_id)
        if task is None:
            return
        if count < 0 or count > task.unconsumed:
            raise ProcessorUsageError(
                f"task {task_id!r}: {count} results acknowledged, {task.unconsumed} unacknowledged"
            )
        task.unconsumed -= count

    def fail_waiting(self, tenant_id: str, model_id: str, status: int, message: str, now: float) -> list[Effect]:
        """Fail every task waiting for (tenant, model) now, e.g. when the scaler cannot provide it."""
        effects: list[Effect] = []
        for task_id in list(self._slots.waiting.get((tenant_id, model_id), ())):
            self._endings.fail(self._tasks[task_id], status, message, effects)
        self._dispatcher.refill(now, effects)
        return effects

    # --- engines ----------------------------------------------------------

    def update_engine(
        self, route: Route, tenant_id: str, status: status_pb2.EngineStatus, locality: Locality, now: float
    ) -> list[Effect]:
        """Add an engine or take its new status; waiting tasks it can serve go to it now.

        ``ready=false`` takes the engine out of routing but keeps its tasks.
        A new ``route`` for a known engine (it reconnected) takes over new
        tasks; tasks already sent on the old route stay there until it closes.
        The engine is named here by the id it reports; see :meth:`update_engine_as`.

        A local engine's id is one engine process's: a status on a new route
        that names another process (``infx_instance``, which LLMariner's engines
        leave empty) than the engine registered under that id is a clash, not
        a reconnect. It is refused (``RefuseEngine``, counted) and registers
        nothing; the engine holding the id is sent a heartbeat, and closed if
        it does not answer within ``clash_probe_timeout`` (a stream that died
        without a word), so that the newcomer's next attempt gets in.
        """
        if not status.engine_id:
            raise ProcessorUsageError("engine status without engine_id")
        return self.update_engine_as(route, EngineKey(tenant_id, status.engine_id), status, locality, now)

    def update_engine_as(
        self, route: Route, key: EngineKey, status: status_pb2.EngineStatus, locality: Locality, now: float
    ) -> list[Effect]:
        """:meth:`update_engine` for an engine named ``key`` here, which may differ from the id
        it reports (``status.engine_id``, what tasks sent on its route carry): a peer's engine
        is named with the peer's pod (:func:`protocol.exchange.accepted_peer.peer_engine_id`), so that engines
        of one id attached to two gateways are two engines everywhere."""
        if not status.engine_id or not key.engine_id:
            raise ProcessorUsageError("engine status without engine_id")
        effects = self._membership.update(route, key, status, locality, now)
        self._dispatcher.refill(now, effects)
        return effects

    def remove_engine(self, tenant_id: str, engine_id: str, reason: str, now: float) -> list[Effect]:
        """An engine is gone: it leaves routing and its in-flight tasks fail over."""
        engine = self._engines.get(EngineKey(tenant_id, engine_id))
        if engine is None:
            raise ProcessorUsageError(f"no engine {engine_id!r} of tenant {tenant_id!r}")
        effects: list[Effect] = []
        self._membership.remove(now, [engine], reason, effects)
        self._dispatcher.refill(now, effects)
        return effects

    def close_route(self, route: Route, reason: str, now: float) -> list[Effect]:
        """A stream ended: engines registered on it go, tasks sent on it fail over.

        Closing a route that never registered an engine is harmless.
        """
        effects: list[Effect] = []
        self._membership.close_route(now, route, reason, effects)
        self._dispatcher.refill(now, effects)
        return effects

    # --- backpressure -----------------------------------------------------

    def route_blocked(self, route: Route, now: float) -> list[Effect]:
        """``route``'s stream stopped draining: its engines get no new tasks until
        ``route_writable``, and it is closed if that does not come within
        ``route_stuck_timeout``. Reporting it again keeps the first time."""
        self._flow.block(route, now)
        return []

    def route_writable(self, route: Route, now: float) -> list[Effect]:
        """``route`` drains again: its engines take waiting tasks now.

        A route that was not blocked (or has closed) is left as it is.
        """
        effects: list[Effect] = []
        if self._flow.unblock(route):
            for engine in [e for e in self._engines.on_route(route) if e.routable]:
                self._dispatcher.dispatch_waiting(now, engine, effects)
        self._dispatcher.refill(now, effects)
        return effects

    def dispatch_refused(self, task_id: str, route: Route, now: float) -> list[Effect]:
        """``route`` did not take the ``SendTask`` whose task carried ``task_id``: its
        queue is at its cap. The route counts as blocked (``route_blocked``), and the
        task is routed again at once, to another engine or the queue; this is not a
        failure of the engine, so no retry is counted and the engine is not avoided.
        A targeted task (a peer's) fails with 503 instead, so that its peer tries elsewhere.

        A stale report (the task ended or moved on) only blocks the route.
        """
        self._flow.block(route, now)
        effects: list[Effect] = []
        control = self._control.get(task_id)
        if control is not None:
            if control.route == route:
                self._control.discard(task_id)
            return effects
        task = self._tasks.by_attempt(task_id)
        if task is None or task.state is not TaskState.DISPATCHED or task.route != route:
            return effects
        if task.target:
            # A peer's task is for this engine only: as on arrival at a blocked route, the peer tries elsewhere.
            message = f"engine {task.target!r} is not taking tasks (its stream is not draining)"
            self._endings.fail(task, 503, message, effects, self.config.busy_retry_after)
        else:
            retried = task.attempts.unsent()
            if retried is not None:
                # Reported in the reactor turn that counted the send, so no scrape saw that count.
                self.counters.retries[retried.value] -= 1
            self._slots.unassign(task)
            self._tasks.move(task, TaskState.RETRY_PENDING)
            self._dispatcher.route(now, task, effects)
        self._dispatcher.refill(now, effects)
        return effects

    def go_away(self, now: float) -> list[Effect]:
        """Ask every local engine to reconnect (shutdown); they get no new tasks on this route."""
        effects: list[Effect] = []
        self._membership.go_away(effects)
        self._dispatcher.refill(now, effects)
        return effects

    def drain(self, now: float) -> list[Effect]:
        """Shutdown: ``go_away`` to local engines; from now on a task that no routable engine
        serves fails at once (503, ``busy_retry_after``) rather than waiting, and so do
        those waiting now. Tasks waiting only for a slot on a busy engine keep waiting."""
        effects = self.go_away(now)
        self._dispatcher.draining = True
        waiting = self._slots.waiting
        for key in list(waiting):
            for task_id in list(waiting.get(key, ())):
                task = self._tasks[task_id]
                if self._dispatcher.pick(task, ignore_cap=True) is None:
                    self._endings.refuse_draining(task, effects)
        self._dispatcher.refill(now, effects)
        return effects

    # --- results ----------------------------------------------------------

    def receive_result(self, route: Route, result: worker_pb2.TaskResult, now: float) -> list[Effect]:
        """A result arrived on ``route``; deliver it in order, retry, or end the task.

        ``result.task_id`` names an attempt (the id its ``SendTask`` carried).
        Results for ended tasks, for an earlier attempt of a task (a late reply
        from an engine or peer it was taken from, even over the same route), or
        from a route the task is not on are counted and ignored.
        """
        effects = self._receive_result(now, route, result)
        self._dispatcher.refill(now, effects)
        return effects

    def _receive_result(self, now: float, route: Route, result: worker_pb2.TaskResult) -> list[Effect]:
        effects: list[Effect] = []
        control = self._control.get(result.task_id)
        if control is not None and control.route == route:
            self._control.replied(result.task_id, control)
            return effects
        task = self._tasks.by_attempt(result.task_id)
        if task is None or task.state not in ON_ENGINE or task.route != route:
            self.counters.results_ignored += 1
            return effects
        kind = result.WhichOneof("message")
        violation = task.out_of_order(result, kind)
        if violation:
            self.counters.protocol_errors += 1
            self._endings.stop_on_engine(task, effects)
            self._endings.fail(task, 502, "The engine sent an answer out of order; the response is incomplete.", effects,
                       code="engine_protocol_error", detail=violation)
            return effects
        if kind == "http_response":
            failure = None if task.target else failure_of(result)
            if failure is AttemptFailure.RUNTIME_DROPPED:
                self._retries.runtime_dropped(now, task, result, effects)
                return effects
            if failure is not None:
                self._retries.runtime_busy(now, task, result, failure, effects)
                return effects
            code = result.http_response.status_code
            last = not task.streaming or code < 200 or code >= 400
        else:
            last = result.server_sent_event.is_last_event
        if task.hints is not None and task.engine is not None:
            usage = prompt_usage(result)  # what the runtime reused of the prompt: routing checks its index
            if usage is not None:
                self._router.task_answered(task.engine, task.model, task.hints, usage.prompt_tokens,
                                           usage.cached_tokens)
        self._endings.deliver(task, result, last, effects)
        return effects

    def dispatch_failed(self, task_id: str, reason: str, route: Route | None, now: float) -> list[Effect]:
        """A ``SendTask`` whose task carried ``task_id`` (on ``route``, if given) could
        not be sent; the task fails over like one whose engine was lost.

        A stale report is harmless and does nothing: the task has ended, got a
        result, or has already moved on to another route (its stream closed
        first, say), so the adapter may report a failed send at any later time.
        """
        control = self._control.get(task_id)
        if control is not None:
            if route is None or control.route == route:
                self._control.discard(task_id)
            return []
        task = self._tasks.by_attempt(task_id)
        if task is None or task.state is not TaskState.DISPATCHED or (route is not None and task.route != route):
            return []
        effects: list[Effect] = []
        self._retries.engine_lost(now, task, AttemptFailure.SEND_FAILED, f"sending the task failed: {reason}", effects)
        self._dispatcher.refill(now, effects)
        return effects

    # --- time -------------------------------------------------------------

    def next_deadline(self) -> float | None:
        """When ``handle_timeout`` must next be called, or None if nothing is timed."""
        # Asked after every input: compared in line, no list of candidates built each time.
        first = self._tasks.next_timer()
        for when in (self._control.next_heartbeat, self._engines.next_backoff(), self._flow.next_deadline()):
            if when is not None and (first is None or when < first):
                first = when
        probes = self._control.probes
        if probes:
            probe = min(probes.values())
            if first is None or probe < first:
                first = probe
        return first

    def handle_timeout(self, now: float) -> list[Effect]:
        """Fire everything due at ``now``: deadlines, queue timeouts, retries, heartbeats."""
        effects: list[Effect] = []
        for task in self._tasks.due(now):
            self._task_timer(now, task, effects)
        next_heartbeat = self._control.next_heartbeat
        if next_heartbeat is not None and next_heartbeat <= now:
            self._membership.heartbeat_round(now, effects)
        for engine in self._engines.backoffs_over(now):
            if engine.routable:
                self._dispatcher.dispatch_waiting(now, engine, effects)
        self._membership.probes_unanswered(now, effects)
        for route in self._flow.stuck(now):
            reason = f"stream not draining for {self.config.route_stuck_timeout:g}s"
            effects.append(CloseRoute(route, reason))
            self._membership.close_route(now, route, reason, effects)
        self._dispatcher.refill(now, effects)
        return effects

    # --- internals: timers, engines leaving, heartbeats ------------------------

    def _task_timer(self, now: float, task: TaskRecord, effects: list[Effect]) -> None:
        if task.state is TaskState.WAITING and task.busy_reply is not None:
            # Time ran out waiting for a busy runtime: its own answer is the truest one.
            self._endings.deliver(task, task.busy_reply, True, effects)
        elif now >= task.deadline:
            self._endings.stop_on_engine(task, effects)
            self._endings.fail(task, 504, f"deadline exceeded while {task.state.value if task.state else ''}", effects)
        elif task.state is TaskState.WAITING and task.target:
            engine = self._engines.get(EngineKey(task.tenant_id, task.target))
            cap = self._slots.cap(engine) if engine is not None else self.config.max_in_flight_per_engine
            message = (f"engine {task.target!r} stayed at its limit of {cap} "
                       f"tasks (waited {self.config.queue_timeout:g}s)")
            self._endings.fail(task, 503, message, effects, self.config.busy_retry_after)
        elif task.state is TaskState.WAITING:
            if self._dispatcher.served_but_full(task):
                cap = self.config.max_in_flight_per_engine
                message = f"every engine serving model {task.model!r} is busy"
                if cap is not None:
                    message += f" or at its limit of {cap} tasks"
                elif self._slots.capped:
                    message += " or running as many tasks as its runtime has slots"
            else:
                message = f"no ready engine serves model {task.model!r}"
            message += f" (waited {self.config.queue_timeout:g}s)"
            self._endings.fail(task, 503, message, effects, self.config.busy_retry_after)
        elif task.state is TaskState.RETRY_PENDING:
            self._dispatcher.route(now, task, effects)
