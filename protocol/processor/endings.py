"""How a task ends, in one place: a result delivered, a failure, or the client's cancel; and the
results on the way there; pure, no I/O, no clock reads.

Rules this file keeps: every accepted task ends exactly once, here (:meth:`Endings.end`): it
lets go of its queue and its slot, leaves the task table and is counted by outcome. A task
ends with a ``DeliverResult(last=True)`` (:meth:`Endings.deliver`), a ``FailRequest``
(:meth:`Endings.fail`) or the caller's ``cancel``; an attempt abandoned while its stream may
still be open is cancelled on that stream (:meth:`Endings.stop_on_engine`). Results reach the
origin in order, at most ``max_unconsumed_results`` unacknowledged: past it the consumer is too
slow, and its task alone fails.
"""

from __future__ import annotations

from collections.abc import Callable

from protocol.pb import worker_pb2
from protocol.processor.control import ControlKind, ControlTasks
from protocol.processor.counters import ProcessorCounters
from protocol.processor.slots import Slots
from protocol.processor.tasks import ON_ENGINE, TaskOutcome, TaskRecord, TaskState, TaskTable
from protocol.processor.config import ProcessorConfig
from protocol.processor.effects import CancelTaskOnEngine, DeliverResult, Effect, FailRequest
from protocol.processor.keys import EngineKey

__all__ = ["Endings"]


class Endings:
    """A task's end (delivered, failed, cancelled) and the effects that say so."""

    def __init__(self, config: ProcessorConfig, counters: ProcessorCounters, tasks: TaskTable, slots: Slots,
                 control: ControlTasks) -> None:
        self.config = config
        self.counters = counters
        self._tasks = tasks
        self._slots = slots
        self._control = control

    def deliver(self, task: TaskRecord, result: worker_pb2.TaskResult, last: bool, effects: list[Effect]) -> None:
        """Hand ``result`` to the task's origin; ``last`` ends the task, the first of a stream
        makes it streaming (it is never sent again)."""
        if task.unconsumed >= self.config.max_unconsumed_results:
            self.counters.slow_consumers += 1
            self.stop_on_engine(task, effects)
            self.fail(task, 503, f"client did not keep up: {task.unconsumed} results unread", effects)
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
                                     task.attempts.retries, task.wire_id))
        if last:
            self.end(task, TaskOutcome.COMPLETED)
        elif task.state is TaskState.DISPATCHED:
            self._tasks.move(task, TaskState.STREAMING)
            task.release_request()

    def fail(
        self, task: TaskRecord, status: int, message: str, effects: list[Effect], retry_after: float | None = None,
        *, code: str | None = None, detail: str = "",
    ) -> None:
        """End ``task`` with an HTTP ``status`` and ``message`` for the client (``detail``: for the log)."""
        effects.append(FailRequest(task.origin, task.id, status, message, task.next_index, retry_after,
                                   task.engine, task.route, task.attempts.retries, code, detail))
        self.end(task, TaskOutcome.FAILED)

    def end(self, task: TaskRecord, outcome: TaskOutcome) -> None:
        """The one way out: ``task`` leaves its queue, its engine and the table."""
        if task.state is TaskState.WAITING:
            self._slots.unwait(task)
        self._slots.unassign(task)
        self._tasks.end(task)
        self.counters.outcomes[outcome.value] += 1

    def stop_on_engine(self, task: TaskRecord, effects: list[Effect]) -> None:
        """Cancel the current attempt on the route it was sent on, whether or not its
        engine is still registered (a removed engine's older stream may still be open)."""
        if task.state not in ON_ENGINE or task.engine is None:
            return
        request = worker_pb2.TaskRequest(cancel_task=worker_pb2.CancelTaskRequest(task_id=task.wire_id))
        send = self._control.send(ControlKind.CANCEL, task.engine, task.reported_engine_id, task.route, request)
        effects.append(CancelTaskOnEngine(send.route, send.engine, send.task, task.wire_id))

    # --- failures for lack of room -------------------------------------------------

    def shed(self, task: TaskRecord, effects: list[Effect]) -> None:
        """A sheddable task finds the engines saturated: 429, retry later."""
        self.counters.shed += 1
        message = f"engines for model {task.model!r} are saturated and this request is sheddable; retry later"
        self.fail(task, 429, message, effects, self.config.busy_retry_after)

    def refuse_draining(self, task: TaskRecord, effects: list[Effect]) -> None:
        """The gateway is shutting down and nothing here will serve the task: 503, retry elsewhere."""
        self.counters.drain_refusals += 1
        message = f"this gateway is shutting down and no other engine serves model {task.model!r}; retry"
        self.fail(task, 503, message, effects, self.config.busy_retry_after)

    def fail_waiting_on(
        self, key: EngineKey, reason: str, effects: list[Effect],
        which: Callable[[TaskRecord], bool] = lambda task: True,
    ) -> None:
        """The engine peers' tasks wait for leaves routing, or can no longer take ``which`` of
        them: they fail (503) at once, so that their gateways send them elsewhere."""
        for task_id in [t for t in self._slots.waiting_on_engine(key) if which(self._tasks[t])]:
            message = f"engine {key.engine_id!r} {reason} while the task waited for a slot on it"
            self.fail(self._tasks[task_id], 503, message, effects, self.config.busy_retry_after)
