"""What happens when an attempt fails: another attempt, a wait, or the task's end; pure, no I/O,
no clock reads.

Attempts (:mod:`protocol.processor.attempts`): every send of a task to an engine is an
attempt, and a task (not a targeted one, whose forwarding peer decides) is sent
at most ``max_attempts`` times in all, whatever failed; one a runtime read and
dropped (the agent's ``RUNTIME_DROPPED``) at most twice, and a Responses
request once. A lost engine, a failed send or a dropped request is sent again
after ``retry_delay``, avoiding that engine; when no attempt is left the client
gets at once a 503 (engine lost) or the agent's 502 (runtime dropped it). A task
whose response has started (streaming) is never sent again: losing its engine ends
it with a 502.

Busy runtimes: a runtime's 503 or 429 (``BUSY_STATUSES``; the agent's "could not
reach its runtime" too) before any result of a task (not a targeted one) is not
the loss of its engine. The engine gets no task until its ``Retry-After`` (or
``busy_backoff``) passed; the task goes at once to another engine with room, or
waits in the queue, counted from its first busy answer for ``queue_timeout``;
when that, its deadline or its attempts run out first, the client gets the
runtime's latest answer as it is (status, body, headers).
"""

from __future__ import annotations

from protocol.pb import worker_pb2
from protocol.processor.attempts import AttemptFailure
from protocol.processor.counters import ProcessorCounters
from protocol.processor.dispatcher import Dispatcher
from protocol.processor.endings import Endings
from protocol.processor.engines import EngineTable
from protocol.processor.slots import Slots
from protocol.processor.tasks import TaskRecord, TaskState, TaskTable
from protocol.processor.types import Effect, ProcessorConfig, retry_after_seconds

__all__ = ["ENGINE_LOST_MID_STREAM", "Retries"]

#: What a client whose stream's engine went away reads, whatever the transport said (that goes to the log).
ENGINE_LOST_MID_STREAM = ("The engine serving this request went away before the response was complete, "
                          "so it is cut short; send the request again.")


class Retries:
    """A failed attempt's consequences: counted, then sent again, held, or the end of the task."""

    def __init__(self, config: ProcessorConfig, counters: ProcessorCounters, tasks: TaskTable, engines: EngineTable,
                 slots: Slots, endings: Endings, dispatcher: Dispatcher) -> None:
        self.config = config
        self.counters = counters
        self._tasks = tasks
        self._engines = engines
        self._slots = slots
        self._endings = endings
        self._dispatcher = dispatcher

    def _attempt_failed(self, now: float, task: TaskRecord, failure: AttemptFailure) -> str:
        """Count the current attempt's failure; say why no other may be made ("" if one may)."""
        task.attempts.fail(failure)
        self.counters.attempt_failures[failure.value] += 1
        if task.target:
            return "the gateway that forwarded it decides"
        if now >= task.deadline:
            return "its deadline passed"
        return task.attempts.refusal(self.config.max_attempts, task.request.WhichOneof("request"))

    def engine_lost(self, now: float, task: TaskRecord, failure: AttemptFailure, reason: str,
                    effects: list[Effect]) -> None:
        """The engine of a task on it went away (``reason``, for the log) or could not be sent to."""
        if task.state is TaskState.STREAMING:
            self._endings.fail(task, 502, ENGINE_LOST_MID_STREAM, effects, code="engine_lost", detail=reason)
            return
        refusal = self._attempt_failed(now, task, failure)
        if refusal:
            message = f"The engine serving this request went away before it answered ({refusal}); retry later."
            self._endings.fail(task, 503, message, effects, code="engine_unavailable", detail=reason)
        else:
            self._retry(now, task, effects)

    def _retry(self, now: float, task: TaskRecord, effects: list[Effect]) -> None:
        if task.engine is not None:
            task.avoid.add(task.engine.engine_id)
        self._slots.unassign(task)
        self._tasks.move(task, TaskState.RETRY_PENDING)
        if self.config.retry_delay == 0:
            self._dispatcher.route(now, task, effects)
        else:
            self._tasks.set_timer(task, min(now + self.config.retry_delay, task.deadline))

    def runtime_dropped(self, now: float, task: TaskRecord, result: worker_pb2.TaskResult,
                        effects: list[Effect]) -> None:
        """The runtime read the request and dropped it: sent again at most once, else the agent's 502
        (its own words for what happened) is the client's answer."""
        if self._attempt_failed(now, task, AttemptFailure.RUNTIME_DROPPED):
            self._endings.deliver(task, result, True, effects)
        else:
            self._retry(now, task, effects)

    def runtime_busy(self, now: float, task: TaskRecord, result: worker_pb2.TaskResult, failure: AttemptFailure,
                     effects: list[Effect]) -> None:
        """The runtime did not take the task (busy, or unreachable): its engine backs off, and the
        task goes elsewhere, waits, or gets the runtime's answer (see the module docstring)."""
        engine = self._engines.get(task.engine) if task.engine is not None else None
        until: float | None = None
        if engine is not None:
            delay = retry_after_seconds(result.http_response)
            delay = self.config.busy_backoff if delay is None else max(delay, self.config.busy_backoff)
            until = now + min(delay, self.config.max_busy_backoff)
            self._engines.back_off(engine, until)
            task.avoid.add(engine.key.engine_id)
        reply = worker_pb2.TaskResult()
        reply.CopyFrom(result)
        task.busy_reply = reply
        if task.busy_since is None:
            task.busy_since = now
        if self._attempt_failed(now, task, failure):
            # No attempt is left: the runtime's answer is the client's, from the engine it came from.
            self._endings.deliver(task, reply, True, effects)
            return
        self._slots.unassign(task)
        self._tasks.move(task, TaskState.RETRY_PENDING)
        give_up = min(task.busy_since + self.config.queue_timeout, task.deadline)
        if until is not None and until >= give_up and self._dispatcher.pick(task) is None:
            # Nobody can take it now, and its engine is not to be asked again before the wait
            # would end: waiting cannot help, so the client gets the runtime's answer at once.
            self._endings.deliver(task, reply, True, effects)
            return
        self._dispatcher.route(now, task, effects)
