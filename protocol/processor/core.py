"""The inference processor: task queue, engines, routing, retries, ordered results.

No I/O, no clock reads: every input is a method call that takes ``now`` (in
seconds, on any monotonic scale the caller likes) and returns the effects the
caller must perform, in order, as values (see :mod:`protocol.processor.types`).
``next_deadline()`` says when to call ``handle_timeout(now)``. Everything that
changes a task's state lives here, and every accepted task ends exactly once:
with a ``DeliverResult(last=True)``, a ``FailRequest``, or the caller's own
``cancel``.

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
    ``SendTask``               send a Task on a route (engine stream or peer sender)
    ``CancelTaskOnEngine``     send a cancel Task on a route (best effort)
    ``DeliverResult``          hand the next result to its origin; ``last`` ends the request
    ``FailRequest``            end the request with an HTTP status and a reason
    ``CloseEngine``            close a local engine's stream (missed heartbeats)
    ``CloseRoute``             close a route that stayed blocked past ``route_stuck_timeout``
    ``RefuseEngine``           end the stream of an engine that claims another engine process's id
    ``TaskQueued``             a task waits for a model no ready engine serves (scaler hook)
    ``LocalEnginesChanged``    re-report local engines to peers (receivers)
    ``EnginesRemoved``         engines left: senders may register what their peers reported

Task life cycle (``TaskState``; ending is leaving the table from any state)::

    submit -> WAITING | DISPATCHED
    WAITING       -> DISPATCHED                   an engine for the model became ready
    DISPATCHED    -> STREAMING                    first result delivered (no retries after)
    DISPATCHED    -> RETRY_PENDING                the attempt failed and another may be made (see Attempts)
    RETRY_PENDING -> DISPATCHED | WAITING         retry delay over (a busy runtime's task: at once)

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
the waiting tasks that take freed slots: :mod:`protocol.processor.routing`.

Draining (``drain``, on shutdown): local engines are told to go away, and a
task that would wait (no routable engine, local or a peer's, serves its
model) fails at once with 503 and ``busy_retry_after`` instead, as do those
already waiting for such a model: nothing will come to serve them here, and
the client is better off retrying at once elsewhere than holding on for the
grace period. Tasks a peer's engine can take are still routed to it.
Attempts (:mod:`protocol.processor.attempts`): every send of a task to an engine is an
attempt, and a task (not a targeted one, whose forwarding peer decides) is sent
at most ``max_attempts`` times in all, whatever failed; one a runtime read and
dropped (the agent's ``RUNTIME_DROPPED``) at most twice, and a Responses
request once. A lost engine, a failed send or a dropped request is sent again
after ``retry_delay``, avoiding that engine; when no attempt is left the client
gets at once a 503 (engine lost) or the agent's 502 (runtime dropped it).

Busy runtimes: a runtime's 503 or 429 (``BUSY_STATUSES``; the agent's "could not
reach its runtime" too) before any result of a task (not a targeted one) is not
the loss of its engine. The engine gets no task until its ``Retry-After`` (or
``busy_backoff``) passed; the task goes at once to another engine with room, or
waits in the queue, counted from its first busy answer for ``queue_timeout``;
when that, its deadline or its attempts run out first, the client gets the
runtime's latest answer as it is (status, body, headers).

Attempts: each dispatch of a task is an attempt with its own wire id (the task
id, then ``"{id}#2"``, ``"{id}#3"``...); results are matched to the current
attempt only, so a late answer to an abandoned attempt is ignored. An attempt
abandoned while its stream may still be open is cancelled on that stream.
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping, Sequence

from protocol.openai import task_forms
from protocol.pb import status_pb2, worker_pb2
from protocol.processor.attempts import AttemptFailure, failure_of
from protocol.processor.fair_queue import Criticality, weight_problem
from protocol.processor.routing import ProcessorRouting
from protocol.processor.tables import (
    _ON_ENGINE,
    EngineView,
    ProcessorCounters,
    TaskOutcome,
    TaskState,
    _ControlKind,
    _Engine,
    _Task,
)
from protocol.processor.types import (
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
    Origin,
    ProcessorConfig,
    ProcessorUsageError,
    RefuseEngine,
    Route,
    SendTask,
    TaskQueued,
    is_streaming,
    model_of,
    retry_after_seconds,
)
from protocol.routing.hints import RoutingHints

#: What a client whose stream's engine went away reads, whatever the transport said (that goes to the log).
ENGINE_LOST_MID_STREAM = ("The engine serving this request went away before the response was complete, "
                          "so it is cut short; send the request again.")

__all__ = [
    "CancelTaskOnEngine",
    "CloseEngine",
    "CloseRoute",
    "DeliverResult",
    "Effect",
    "EngineKey",
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


class Processor(ProcessorRouting):
    """Routes tasks to engines and results back to requests; see the module docstring."""

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
        task = _Task(
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
        over_tenant_cap = tenant_cap is not None and self._tenant_tasks[tenant_id] >= tenant_cap
        self._tasks[task_id] = task
        self._tenant_tasks[tenant_id] += 1
        self.counters.accepted += 1
        effects: list[Effect] = []
        if over_tenant_cap:
            self.counters.tenant_cap_refusals += 1
            message = f"too many tasks in progress for this tenant (limit {tenant_cap})"
            self._fail(task, 503 if task.target else 429, message, effects, self.config.busy_retry_after)
        elif task.deadline <= now:
            self._fail(task, 504, "deadline exceeded before the task was scheduled", effects)
        elif task.target:
            engine = self._by_tenant.get(tenant_id, {}).get(task.target)
            if engine is None:
                self._fail(task, 503, f"engine {task.target!r} is not connected", effects)
            elif not task_forms.eligible(request, engine.status):
                self._fail(task, 503, f"engine {task.target!r} cannot take this request's form", effects)
            elif not engine.routable:
                self._fail(task, 503, f"engine {task.target!r} is not ready", effects)
            elif engine.route in self._flow:
                message = f"engine {task.target!r} is not taking tasks (its stream is not draining)"
                self._fail(task, 503, message, effects, self.config.busy_retry_after)
            elif self._full(engine, self._may_use_reserve(task)):
                self._wait_on_engine(now, task, engine, effects)
            else:
                self._dispatch(now, task, engine, effects)
        else:
            self._route(now, task, effects)
        self._refill(now, effects)
        return effects

    def cancel(self, task_id: str, now: float) -> list[Effect]:
        """The client went away: the request ends with no answer, and its engine is told to stop."""
        task = self._require(task_id)
        effects: list[Effect] = []
        self._stop_on_engine(task, effects)
        self._end(task, TaskOutcome.CANCELLED)
        self._refill(now, effects)
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
        for task_id in list(self._waiting.get((tenant_id, model_id), ())):
            self._fail(self._tasks[task_id], status, message, effects)
        self._refill(now, effects)
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
        is named with the peer's pod (:func:`protocol.sender.peer_engine_id`), so that engines
        of one id attached to two gateways are two engines everywhere."""
        if not status.engine_id or not key.engine_id:
            raise ProcessorUsageError("engine status without engine_id")
        engine = self._engines.get(key)
        if engine is not None and engine.route != route and Locality.LOCAL is locality is engine.locality \
                and engine.status.infx_instance != status.infx_instance:
            return self._clash(now, engine, route)
        snapshot = status_pb2.EngineStatus()
        snapshot.CopyFrom(status)
        effects: list[Effect] = []
        # An engine that stops taking verbatim requests cannot take the peers' tasks waiting for
        # it with no typed form: they fail now, as at submit, not reach it typed once it has room.
        if engine is not None and task_forms.takes_http_request(engine.status) \
                and not task_forms.takes_http_request(snapshot):
            self._fail_waiting_on(key, "no longer takes verbatim requests", effects,
                                  lambda task: not task_forms.eligible(task.request, snapshot))
        if engine is None:
            engine = _Engine(key=key, route=route, locality=locality, status=snapshot)
            self._engines[key] = engine
            self._by_tenant.setdefault(key.tenant_id, {})[key.engine_id] = engine
            changed, was_local = True, False
        else:
            changed = engine.status != snapshot or engine.locality is not locality
            was_local = engine.locality is Locality.LOCAL
            if engine.route != route:
                engine.route = route
                engine.draining = False
                engine.pending_heartbeat = None
                engine.missed_heartbeats = 0
                self._probes.pop(key, None)  # it reconnected: alive, and its old stream's heartbeat is moot
            engine.locality = locality
            engine.status = snapshot
        self._index(engine, frozenset(m.id for m in snapshot.models),
                    frozenset(m.id for m in snapshot.models if m.is_ready))
        self._router.engine_updated(key, engine.ready_models if engine.routable else frozenset(), snapshot,
                                    locality is Locality.LOCAL)
        if changed and (was_local or locality is Locality.LOCAL):
            effects.append(LocalEnginesChanged())
        if locality is Locality.LOCAL and self.config.heartbeat_interval is not None and self._next_heartbeat is None:
            self._next_heartbeat = now + self.config.heartbeat_interval
        if engine.routable:
            self._dispatch_waiting(now, engine, effects)
        else:
            self._fail_waiting_on(key, "is no longer ready", effects)
        self._refill(now, effects)
        return effects

    def _clash(self, now: float, holder: _Engine, route: Route) -> list[Effect]:
        """Another engine process claims ``holder``'s id on ``route``: refuse it, and check that
        the holder is alive (see :meth:`update_engine`)."""
        self.counters.engine_id_clashes += 1
        key = holder.key
        reason = (f"engine id {key.engine_id!r} (tenant {key.tenant_id!r}) is already connected to this gateway "
                  f"from another engine process; give each engine its own --engine-id")
        effects: list[Effect] = [RefuseEngine(route, key, reason)]
        if key not in self._probes:
            self._probes[key] = now + self.config.clash_probe_timeout
            if holder.pending_heartbeat is None:
                request = worker_pb2.TaskRequest(heartbeat=worker_pb2.HeartbeatRequest())
                send = self._control_task(_ControlKind.HEARTBEAT, key, holder.status.engine_id, holder.route, request)
                holder.pending_heartbeat = send.task.id
                effects.append(send)
        return effects

    def remove_engine(self, tenant_id: str, engine_id: str, reason: str, now: float) -> list[Effect]:
        """An engine is gone: it leaves routing and its in-flight tasks fail over."""
        engine = self._engines.get(EngineKey(tenant_id, engine_id))
        if engine is None:
            raise ProcessorUsageError(f"no engine {engine_id!r} of tenant {tenant_id!r}")
        effects: list[Effect] = []
        self._remove(now, [engine], reason, effects)
        self._refill(now, effects)
        return effects

    def close_route(self, route: Route, reason: str, now: float) -> list[Effect]:
        """A stream ended: engines registered on it go, tasks sent on it fail over.

        Closing a route that never registered an engine is harmless.
        """
        effects: list[Effect] = []
        self._close_route(now, route, reason, effects)
        self._refill(now, effects)
        return effects

    def _close_route(self, now: float, route: Route, reason: str, effects: list[Effect]) -> None:
        self._flow.unblock(route)
        self._remove(now, [e for e in self._engines.values() if e.route == route], reason, effects, closing=route)
        for task in [t for t in self._tasks.values() if t.state in _ON_ENGINE and t.route == route]:
            engine_id = task.engine.engine_id if task.engine else ""
            self._engine_lost(now, task, AttemptFailure.ENGINE_LOST, f"stream of engine {engine_id!r} closed: {reason}",
                              effects)
        for control_id in [c for c, ctl in self._control.items() if ctl.route == route]:
            del self._control[control_id]

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
            for engine in [e for e in self._engines.values() if e.route == route and e.routable]:
                self._dispatch_waiting(now, engine, effects)
        self._refill(now, effects)
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
                del self._control[task_id]
            return effects
        task = self._attempts.get(task_id)
        if task is None or task.state is not TaskState.DISPATCHED or task.route != route:
            return effects
        if task.target:
            # A peer's task is for this engine only: as on arrival at a blocked route, the peer tries elsewhere.
            message = f"engine {task.target!r} is not taking tasks (its stream is not draining)"
            self._fail(task, 503, message, effects, self.config.busy_retry_after)
        else:
            retried = task.attempts.unsent()
            if retried is not None:
                # Reported in the reactor turn that counted the send, so no scrape saw that count.
                self.counters.retries[retried.value] -= 1
            self._unassign(task)
            self._move(task, TaskState.RETRY_PENDING)
            self._route(now, task, effects)
        self._refill(now, effects)
        return effects

    def go_away(self, now: float) -> list[Effect]:
        """Ask every local engine to reconnect (shutdown); they get no new tasks on this route."""
        effects: list[Effect] = []
        for engine in self._engines.values():
            if engine.locality is Locality.LOCAL:
                engine.draining = True
                self._fail_waiting_on(engine.key, "is going away", effects)
                self._router.engine_updated(engine.key, frozenset(), engine.status, True)
                request = worker_pb2.TaskRequest(go_away=worker_pb2.GoAwayRequest())
                effects.append(self._control_task(_ControlKind.GO_AWAY, engine.key, engine.status.engine_id,
                                                  engine.route, request))
        self._refill(now, effects)
        return effects

    def drain(self, now: float) -> list[Effect]:
        """Shutdown: ``go_away`` to local engines; from now on a task that no routable engine
        serves fails at once (503, ``busy_retry_after``) rather than waiting, and so do
        those waiting now. Tasks waiting only for a slot on a busy engine keep waiting."""
        effects = self.go_away(now)
        self.draining = True
        for key in list(self._waiting):
            for task_id in list(self._waiting.get(key, ())):
                task = self._tasks[task_id]
                if self._pick(task, ignore_cap=True) is None:
                    self._refuse_draining(task, effects)
        self._refill(now, effects)
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
        self._refill(now, effects)
        return effects

    def _receive_result(self, now: float, route: Route, result: worker_pb2.TaskResult) -> list[Effect]:
        effects: list[Effect] = []
        control = self._control.get(result.task_id)
        if control is not None and control.route == route:
            self._control_replied(result.task_id, control)
            return effects
        task = self._attempts.get(result.task_id)
        if task is None or task.state not in _ON_ENGINE or task.route != route:
            self.counters.results_ignored += 1
            return effects
        kind = result.WhichOneof("message")
        violation = self._check_result(task, result, kind)
        if violation:
            self.counters.protocol_errors += 1
            self._stop_on_engine(task, effects)
            self._fail(task, 502, "The engine sent an answer out of order; the response is incomplete.", effects,
                       code="engine_protocol_error", detail=violation)
            return effects
        if kind == "http_response":
            failure = None if task.target else failure_of(result)
            if failure is AttemptFailure.RUNTIME_DROPPED:
                self._runtime_dropped(now, task, result, effects)
                return effects
            if failure is not None:
                self._runtime_busy(now, task, result, failure, effects)
                return effects
            code = result.http_response.status_code
            last = not task.streaming or code < 200 or code >= 400
        else:
            last = result.server_sent_event.is_last_event
        self._deliver(task, result, last, effects)
        return effects

    def dispatch_failed(self, task_id: str, reason: str, route: Route | None, now: float) -> list[Effect]:
        """A ``SendTask`` whose task carried ``task_id`` (on ``route``, if given) could
        not be sent; the task fails over like one whose engine was lost.

        A stale report is harmless and does nothing: the task has ended, got a
        result, or has already moved on to another route (its stream closed
        first, say), so the adapter may report a failed send at any later time.
        """
        if task_id in self._control:
            if route is None or self._control[task_id].route == route:
                del self._control[task_id]
            return []
        task = self._attempts.get(task_id)
        if task is None or task.state is not TaskState.DISPATCHED or (route is not None and task.route != route):
            return []
        effects: list[Effect] = []
        self._engine_lost(now, task, AttemptFailure.SEND_FAILED, f"sending the task failed: {reason}", effects)
        self._refill(now, effects)
        return effects

    # --- time -------------------------------------------------------------

    def next_deadline(self) -> float | None:
        """When ``handle_timeout`` must next be called, or None if nothing is timed."""
        while self._timers and not self._timer_live(self._timers[0]):
            heapq.heappop(self._timers)
        firsts = (self._timers[0][0] if self._timers else None, self._next_heartbeat,
                  self._backoffs[0][0] if self._backoffs else None, self._flow.next_deadline(),
                  min(self._probes.values(), default=None))
        candidates = [t for t in firsts if t is not None]
        return min(candidates) if candidates else None

    def handle_timeout(self, now: float) -> list[Effect]:
        """Fire everything due at ``now``: deadlines, queue timeouts, retries, heartbeats."""
        effects: list[Effect] = []
        while self._timers and self._timers[0][0] <= now:
            entry = heapq.heappop(self._timers)
            if self._timer_live(entry):
                self._task_timer(now, self._tasks[entry[2]], effects)
        if self._next_heartbeat is not None and self._next_heartbeat <= now:
            self._heartbeat_round(now, effects)
        while self._backoffs and self._backoffs[0][0] <= now:
            until, _, key = heapq.heappop(self._backoffs)
            engine = self._engines.get(key)
            if engine is not None and engine.busy_until == until:
                engine.busy_until = None
                if engine.routable:
                    self._dispatch_waiting(now, engine, effects)
        for key, due in [(key, due) for key, due in self._probes.items() if due <= now]:
            del self._probes[key]
            holder = self._engines[key]
            reason = f"no answer to a heartbeat within {self.config.clash_probe_timeout:g}s of another engine " \
                     "claiming its id"
            effects.append(CloseEngine(holder.route, key, reason))
            self._remove(now, [holder], reason, effects, closing=holder.route)
        for route in self._flow.stuck(now):
            reason = f"stream not draining for {self.config.route_stuck_timeout:g}s"
            effects.append(CloseRoute(route, reason))
            self._close_route(now, route, reason, effects)
        self._refill(now, effects)
        return effects

    # --- internals: failure and retries -----------------------------------

    def _attempt_failed(self, now: float, task: _Task, failure: AttemptFailure) -> str:
        """Count the current attempt's failure; say why no other may be made ("" if one may)."""
        task.attempts.fail(failure)
        self.counters.attempt_failures[failure.value] += 1
        if task.target:
            return "the gateway that forwarded it decides"
        if now >= task.deadline:
            return "its deadline passed"
        return task.attempts.refusal(self.config.max_attempts, task.request.WhichOneof("request"))

    def _engine_lost(self, now: float, task: _Task, failure: AttemptFailure, reason: str,
                     effects: list[Effect]) -> None:
        """The engine of a task on it went away (``reason``, for the log) or could not be sent to."""
        if task.state is TaskState.STREAMING:
            self._fail(task, 502, ENGINE_LOST_MID_STREAM, effects, code="engine_lost", detail=reason)
            return
        refusal = self._attempt_failed(now, task, failure)
        if refusal:
            message = f"The engine serving this request went away before it answered ({refusal}); retry later."
            self._fail(task, 503, message, effects, code="engine_unavailable", detail=reason)
        else:
            self._retry(now, task, effects)

    def _retry(self, now: float, task: _Task, effects: list[Effect]) -> None:
        if task.engine is not None:
            task.avoid.add(task.engine.engine_id)
        self._unassign(task)
        self._move(task, TaskState.RETRY_PENDING)
        if self.config.retry_delay == 0:
            self._route(now, task, effects)
        else:
            self._set_timer(task, min(now + self.config.retry_delay, task.deadline))

    def _runtime_dropped(self, now: float, task: _Task, result: worker_pb2.TaskResult, effects: list[Effect]) -> None:
        """The runtime read the request and dropped it: sent again at most once, else the agent's 502
        (its own words for what happened) is the client's answer."""
        if self._attempt_failed(now, task, AttemptFailure.RUNTIME_DROPPED):
            self._deliver(task, result, True, effects)
        else:
            self._retry(now, task, effects)

    def _runtime_busy(self, now: float, task: _Task, result: worker_pb2.TaskResult, failure: AttemptFailure,
                      effects: list[Effect]) -> None:
        engine = self._engines.get(task.engine) if task.engine is not None else None
        until: float | None = None
        if engine is not None:
            delay = retry_after_seconds(result.http_response)
            delay = self.config.busy_backoff if delay is None else max(delay, self.config.busy_backoff)
            until = now + min(delay, self.config.max_busy_backoff)
            if engine.busy_until is None or until > engine.busy_until:
                engine.busy_until = until
                self._timer_seq += 1
                heapq.heappush(self._backoffs, (until, self._timer_seq, engine.key))
            task.avoid.add(engine.key.engine_id)
        reply = worker_pb2.TaskResult()
        reply.CopyFrom(result)
        task.busy_reply = reply
        if task.busy_since is None:
            task.busy_since = now
        if self._attempt_failed(now, task, failure):
            # No attempt is left: the runtime's answer is the client's, from the engine it came from.
            self._deliver(task, reply, True, effects)
            return
        self._unassign(task)
        self._move(task, TaskState.RETRY_PENDING)
        give_up = min(task.busy_since + self.config.queue_timeout, task.deadline)
        if until is not None and until >= give_up and self._pick(task) is None:
            # Nobody can take it now, and its engine is not to be asked again before the wait
            # would end: waiting cannot help, so the client gets the runtime's answer at once.
            self._deliver(task, reply, True, effects)
            return
        self._route(now, task, effects)

    def _task_timer(self, now: float, task: _Task, effects: list[Effect]) -> None:
        if task.state is TaskState.WAITING and task.busy_reply is not None:
            # Time ran out waiting for a busy runtime: its own answer is the truest one.
            self._deliver(task, task.busy_reply, True, effects)
        elif now >= task.deadline:
            self._stop_on_engine(task, effects)
            self._fail(task, 504, f"deadline exceeded while {task.state.value if task.state else ''}", effects)
        elif task.state is TaskState.WAITING and task.target:
            message = (f"engine {task.target!r} stayed at its limit of {self.config.max_in_flight_per_engine} "
                       f"tasks (waited {self.config.queue_timeout:g}s)")
            self._fail(task, 503, message, effects, self.config.busy_retry_after)
        elif task.state is TaskState.WAITING:
            if self._served_but_full(task):
                cap = self.config.max_in_flight_per_engine
                message = f"every engine serving model {task.model!r} is busy"
                if cap is not None:
                    message += f" or at its limit of {cap} tasks"
            else:
                message = f"no ready engine serves model {task.model!r}"
            message += f" (waited {self.config.queue_timeout:g}s)"
            self._fail(task, 503, message, effects, self.config.busy_retry_after)
        elif task.state is TaskState.RETRY_PENDING:
            self._route(now, task, effects)

    def _remove(
        self, now: float, engines: list[_Engine], reason: str, effects: list[Effect], closing: Route = None
    ) -> None:
        """Take ``engines`` out of routing first, then fail over their tasks, so
        that no task fails over onto an engine that is going away with them.

        A task sent on a route other than ``closing`` (the route that is ending,
        if any) is cancelled there first: that stream may still be open (an
        older stream of the engine, a peer that reported the engine gone), and
        the abandoned attempt must not run on for nobody. Then every sender is
        told which engines went (``EnginesRemoved``), so that one whose peer
        reported them while they were registered here may register them now.
        """
        lost: list[tuple[_Engine, _Task]] = []
        for engine in engines:
            del self._engines[engine.key]
            self._index(engine, frozenset(), frozenset())
            self._router.engine_removed(engine.key)
            tenant = self._by_tenant[engine.key.tenant_id]
            del tenant[engine.key.engine_id]
            if not tenant:
                del self._by_tenant[engine.key.tenant_id]
            for control_id in [c for c, ctl in self._control.items() if ctl.engine == engine.key]:
                del self._control[control_id]
            self._probes.pop(engine.key, None)
            if engine.locality is Locality.LOCAL:
                effects.append(LocalEnginesChanged())
            self._fail_waiting_on(engine.key, f"was removed ({reason})", effects)
            lost += [(engine, self._tasks[task_id]) for task_id in sorted(engine.in_flight)]
        for engine, task in lost:
            if task.route != closing:
                self._stop_on_engine(task, effects)
            self._engine_lost(now, task, AttemptFailure.ENGINE_LOST, f"engine {engine.key.engine_id!r} removed: {reason}",
                              effects)
        if engines:
            effects.append(EnginesRemoved(tuple(engine.key for engine in engines)))

    # --- internals: results -----------------------------------------------

    # --- internals: control tasks and heartbeats --------------------------

    def _heartbeat_round(self, now: float, effects: list[Effect]) -> None:
        interval = self.config.heartbeat_interval
        assert interval is not None
        for engine in [e for e in self._engines.values() if e.locality is Locality.LOCAL]:
            if engine.pending_heartbeat is not None:
                self._control.pop(engine.pending_heartbeat, None)
                engine.pending_heartbeat = None
                engine.missed_heartbeats += 1
                self.counters.heartbeats_missed += 1
                if engine.missed_heartbeats >= self.config.heartbeat_max_missed:
                    reason = f"missed {engine.missed_heartbeats} heartbeats"
                    effects.append(CloseEngine(engine.route, engine.key, reason))
                    self._remove(now, [engine], reason, effects, closing=engine.route)
                    continue
            request = worker_pb2.TaskRequest(heartbeat=worker_pb2.HeartbeatRequest())
            send = self._control_task(_ControlKind.HEARTBEAT, engine.key, engine.status.engine_id,
                                      engine.route, request)
            engine.pending_heartbeat = send.task.id
            effects.append(send)
        has_local = any(e.locality is Locality.LOCAL for e in self._engines.values())
        self._next_heartbeat = now + interval if has_local else None
