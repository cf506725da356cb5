"""Engine slots and how a task lets go of one: the in-flight cap and its fair reserve, the held
queues (a model's, and a peer's tasks per engine), and a task's end; pure (the base of
:class:`~protocol.processor.core.Processor`).

A task holds a slot from its dispatch until it leaves its engine, counted for its caller
(:class:`protocol.processor.fair_share.FairShares`); every way a task ends, fails or waits passes here,
so the counts of slots held and of tasks waiting cannot drift from the tasks themselves.

Caps (``ProcessorConfig``): an engine holding ``max_in_flight_per_engine``
tasks is skipped by routing. It holds the larger of this processor's tasks on
it and what it last reported plus the tasks sent to it since, so a peer's
engine counts every gateway's tasks. A task that finds every engine for its
model full waits in the model's queue, and a slot freed when a task leaves an
engine goes to a waiting task before the input that freed it returns. A
peer's task (targeted) that finds its engine full waits in that engine's
queue here, at the engine's gateway, which every task for the engine passes
through (a sheddable one is refused with 503 instead, so that the peer tries
elsewhere); it fails with 503 when the engine leaves routing or its
``queue_timeout`` runs out. Each queue is a :class:`protocol.processor.fair_queue.HeldQueue`:
critical tasks first, then standard, then sheddable, and within each the
caller (``flow``, weighted; a peer's task carries its caller) holding the
fewest slots of the model's engines first. The last ``fair_reserve`` slots of
an engine go only to a task of such a caller, or a critical one
(:mod:`protocol.processor.fair_share`); one the head of the queue may not take while
the head of a lower band may goes to the head all the same (criticality comes
first), rather than to the less critical task or stay idle while both wait.

Shedding: a ``sheddable`` task that would wait while every engine serving its
model is at its cap and the model's queue holds ``shed_waiting_threshold``
tasks or more, or while the whole queue is at ``max_waiting_tasks``, fails at
once with 429 and ``busy_retry_after``. A critical or standard task that
finds the whole queue full takes the place of the newest sheddable task
waiting (which fails so), and is refused with 503 only when none waits. A tenant with
``max_tasks_per_tenant`` live tasks has its next one failed at once (429, or
503 for a targeted task so that the forwarding peer retries elsewhere).
"""

from __future__ import annotations

from collections.abc import Callable

from protocol.pb import worker_pb2
from protocol.processor.fair_queue import Criticality, HeldQueue
from protocol.processor.tables import ProcessorTables, TaskOutcome, TaskState, _ON_ENGINE, _ControlKind, _Engine, _Task
from protocol.processor.types import CancelTaskOnEngine, DeliverResult, Effect, EngineKey, FailRequest

__all__ = ["ProcessorSlots"]


class ProcessorSlots(ProcessorTables):
    """The slot and queue bookkeeping of :class:`~protocol.processor.core.Processor`."""

    def _hold(self, now: float, task: _Task, queue: HeldQueue) -> None:
        """``task`` waits in ``queue`` for a slot, for at most ``queue_timeout``."""
        self._move(task, TaskState.WAITING)
        queue.add(task.id, task.flow, task.weight, task.criticality)
        self._shares.started_waiting(task.tenant_id, task.model, task.flow, task.weight)
        self._waiting_total += 1
        queued_since = now if task.busy_since is None else task.busy_since
        self._set_timer(task, min(queued_since + self.config.queue_timeout, task.deadline))

    def _wait_on_engine(self, now: float, task: _Task, engine: _Engine, effects: list[Effect]) -> None:
        """A peer's task for an engine at its cap waits for a slot on it, in its caller's turn
        among every gateway's callers; a sheddable one, or one that finds the queue full, is
        refused (503) so that the peer may try elsewhere."""
        if task.criticality is Criticality.SHEDDABLE or self._waiting_total >= self.config.max_waiting_tasks:
            message = f"engine {task.target!r} is at its limit of {self.config.max_in_flight_per_engine} tasks"
            self._fail(task, 503, message, effects, self.config.busy_retry_after)
            return
        self._hold(now, task, self._waiting_on.setdefault(engine.key, {}).setdefault(task.model, HeldQueue()))

    def _fail_waiting_on(
        self, key: EngineKey, reason: str, effects: list[Effect], which: Callable[[_Task], bool] = lambda task: True,
    ) -> None:
        """The engine peers' tasks wait for leaves routing, or can no longer take ``which`` of
        them: they fail (503) at once, so that their gateways send them elsewhere."""
        for task_id in [t for queue in self._waiting_on.get(key, {}).values() for t in queue
                        if which(self._tasks[t])]:
            message = f"engine {key.engine_id!r} {reason} while the task waited for a slot on it"
            self._fail(self._tasks[task_id], 503, message, effects, self.config.busy_retry_after)

    def _shed(self, task: _Task, effects: list[Effect]) -> None:
        self.counters.shed += 1
        message = f"engines for model {task.model!r} are saturated and this request is sheddable; retry later"
        self._fail(task, 429, message, effects, self.config.busy_retry_after)

    def _full(self, engine: _Engine, may_use_reserve: bool = True) -> bool:
        """On a route that is not draining, or at its in-flight cap: its tasks counted as the
        larger of this processor's on it and what it reported plus those sent since (every
        gateway's), less the reserve for a task that may not take it (``fair_reserve``)."""
        if engine.route in self._flow:
            return True
        cap = self.config.max_in_flight_per_engine
        if cap is None:
            return False
        limit = cap if may_use_reserve else cap - min(self.config.fair_reserve, cap - 1)
        return max(len(engine.in_flight), self._router.load(engine.key)) >= limit

    def _may_use_reserve(self, task: _Task) -> bool:
        """Whether ``task`` may take an engine's reserved last slots: it is critical, or its
        flow holds no more slots per weight than any other on its model (fair_share.py)."""
        return (self.config.max_in_flight_per_engine is None or task.criticality is Criticality.CRITICAL
                or self._shares.least_served(task.tenant_id, task.model, task.flow, task.weight))

    def _blocked(self, engine: _Engine, ignore_cap: bool, may_use_reserve: bool = True) -> bool:
        """Whether routing must skip a routable engine for now (full, its route not
        draining, or its runtime busy)."""
        return not ignore_cap and (self._full(engine, may_use_reserve) or engine.busy_until is not None)

    def _served_for(self, key: tuple[str, str]) -> Callable[[str], float]:
        """Slots each flow of (tenant, model) holds per weight, for the held queue's order."""
        tenant_id, model = key
        return lambda flow: self._shares.served(tenant_id, model, flow)

    def _unwait(self, task: _Task, served: bool = False) -> None:
        engine_key = EngineKey(task.tenant_id, task.target)
        queue = self._waiting_on[engine_key][task.model] if task.target else self._waiting[(task.tenant_id, task.model)]
        if served:
            queue.take(task.id)
        else:
            queue.remove(task.id)
            self._shares_changed(task)
        self._sheddable.pop(task.id, None)
        self._shares.stopped_waiting(task.tenant_id, task.model, task.flow)
        self._waiting_total -= 1
        if not queue and task.target:
            del self._waiting_on[engine_key][task.model]
            if not self._waiting_on[engine_key]:
                del self._waiting_on[engine_key]
        elif not queue:
            del self._waiting[(task.tenant_id, task.model)]

    def _fail(
        self, task: _Task, status: int, message: str, effects: list[Effect], retry_after: float | None = None,
        *, code: str | None = None, detail: str = "",
    ) -> None:
        effects.append(FailRequest(task.origin, task.id, status, message, task.next_index, retry_after,
                                   task.engine, task.route, task.attempts.retries, code, detail))
        self._end(task, TaskOutcome.FAILED)

    def _end(self, task: _Task, outcome: TaskOutcome) -> None:
        if task.state is TaskState.WAITING:
            self._unwait(task)
        self._unassign(task)
        task.state = None
        del self._tasks[task.id]
        self._tenant_tasks[task.tenant_id] -= 1
        if not self._tenant_tasks[task.tenant_id]:
            del self._tenant_tasks[task.tenant_id]
        self.counters.outcomes[outcome.value] += 1

    def _stop_on_engine(self, task: _Task, effects: list[Effect]) -> None:
        """Cancel the current attempt on the route it was sent on, whether or not its
        engine is still registered (a removed engine's older stream may still be open)."""
        if task.state not in _ON_ENGINE or task.engine is None:
            return
        request = worker_pb2.TaskRequest(cancel_task=worker_pb2.CancelTaskRequest(task_id=task.wire_id))
        send = self._control_task(_ControlKind.CANCEL, task.engine, task.reported_engine_id, task.route,
                                  request)
        effects.append(CancelTaskOnEngine(send.route, send.engine, send.task, task.wire_id))

    def _deliver(self, task: _Task, result: worker_pb2.TaskResult, last: bool, effects: list[Effect]) -> None:
        if task.unconsumed >= self.config.max_unconsumed_results:
            self.counters.slow_consumers += 1
            self._stop_on_engine(task, effects)
            self._fail(task, 503, f"client did not keep up: {task.unconsumed} results unread", effects)
            return
        task.unconsumed += 1
        task.next_index += 1
        if result.task_id != task.id:
            # A retry's result names its attempt; the origin knows the task by its own id.
            renamed = worker_pb2.TaskResult()
            renamed.CopyFrom(result)
            renamed.task_id = task.id
            result = renamed
        effects.append(DeliverResult(task.origin, task.id, result, last, task.engine, task.route,
                                     task.attempts.retries))
        if last:
            self._end(task, TaskOutcome.COMPLETED)
        elif task.state is TaskState.DISPATCHED:
            self._move(task, TaskState.STREAMING)
            task.release_request()

    def _refuse_draining(self, task: _Task, effects: list[Effect]) -> None:
        self.counters.drain_refusals += 1
        message = f"this gateway is shutting down and no other engine serves model {task.model!r}; retry"
        self._fail(task, 503, message, effects, self.config.busy_retry_after)

    def _no_engine_takes_it(self, task: _Task) -> bool:
        """Engines list the task's model, but none can take its request (only its verbatim form
        exists and they are LLMariner engines): waiting would not help."""
        return (
            bool(task.request.typed_request_incomplete)
            and self.serves(task.tenant_id, task.model)
            and not self.takes_http_request(task.tenant_id, task.model)
        )
