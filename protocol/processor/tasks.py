"""The task table: every live task's record, the task life cycle, attempts by wire id, and
task timers; pure, no I/O, no clock reads.

Rules this file keeps: a task changes state only through :meth:`TaskTable.move`, which
enforces the transition table below (the one place the life cycle is drawn and kept); a task
enters the table with :meth:`TaskTable.add` and leaves it with :meth:`TaskTable.end`, which is
how every task ends, whatever its state. The table knows nothing of engines or queues: what a
state means for them is the other parts' (:mod:`protocol.processor.slots`,
:mod:`protocol.processor.endings`).

Task life cycle (``TaskState``; ending is leaving the table from any state)::

    submit -> WAITING | DISPATCHED
    WAITING       -> DISPATCHED                   an engine for the model became ready
    DISPATCHED    -> STREAMING                    first result delivered (no retries after)
    DISPATCHED    -> RETRY_PENDING                the attempt failed and another may be made (see Attempts)
    RETRY_PENDING -> DISPATCHED | WAITING         retry delay over (a busy runtime's task: at once)

Attempts: each dispatch of a task is an attempt with its own wire id (the task
id, then ``"{id}#2"``, ``"{id}#3"``...); results are matched to the current
attempt only (:meth:`TaskTable.by_attempt`), so a late answer to an abandoned attempt is ignored.

Timers: one live timer per task (its deadline, queue timeout or retry delay, whichever is
next); superseded entries stay in the heap until they surface, and the heap is compacted
when they outnumber the live tasks, so memory follows the live load.
"""

from __future__ import annotations

import heapq
from collections import Counter
from collections.abc import Callable, Iterator, ValuesView
from dataclasses import dataclass, field
from enum import Enum

from protocol.pb import worker_pb2
from protocol.processor.attempts import Attempts
from protocol.processor.fair_queue import Criticality
from protocol.processor.types import EngineKey, Origin, ProcessorUsageError, Route
from protocol.routing.hints import RoutingHints

__all__ = ["ON_ENGINE", "TRANSITIONS", "TaskOutcome", "TaskRecord", "TaskState", "TaskTable"]


class TaskState(Enum):
    """Where a live task is; a finished task has no state (it is gone)."""

    WAITING = "waiting"
    RETRY_PENDING = "retry_pending"
    DISPATCHED = "dispatched"
    STREAMING = "streaming"


#: The task life cycle: the states each state may move to (None: not yet placed).
TRANSITIONS: dict[TaskState | None, frozenset[TaskState]] = {
    None: frozenset({TaskState.WAITING, TaskState.DISPATCHED}),
    TaskState.WAITING: frozenset({TaskState.DISPATCHED}),
    TaskState.RETRY_PENDING: frozenset({TaskState.DISPATCHED, TaskState.WAITING}),
    TaskState.DISPATCHED: frozenset({TaskState.STREAMING, TaskState.RETRY_PENDING}),
    TaskState.STREAMING: frozenset(),
}

#: The states of a task that is on an engine (it holds a slot there, and results may come).
ON_ENGINE = (TaskState.DISPATCHED, TaskState.STREAMING)


class TaskOutcome(Enum):
    """How a task ended, for metrics."""

    COMPLETED = "completed"  # the engine's last result was delivered (whatever its status)
    FAILED = "failed"  # FailRequest: deadline, queue timeout, retries exhausted, protocol error...
    CANCELLED = "cancelled"  # the client went away


#: What a streaming task holds in place of its request (see ``TaskRecord.release_request``); never mutated.
_RELEASED_REQUEST = worker_pb2.TaskRequest()


@dataclass(slots=True)
class TaskRecord:
    """What the processor knows of one live task."""

    id: str
    tenant_id: str
    model: str
    request: worker_pb2.TaskRequest
    header: dict[str, list[str]]
    origin: Origin
    streaming: bool
    deadline: float
    target: str
    state: TaskState | None = None
    engine: EngineKey | None = None
    # The id that engine reports, which the attempt carries on its route (a peer's engine is
    # named here with its gateway's pod, see ``Processor.update_engine_as``): its cancel carries it too.
    reported_engine_id: str = ""
    route: Route = None
    avoid: set[str] = field(default_factory=set)
    next_index: int = 0
    unconsumed: int = 0
    timer_seq: int = 0
    # Dispatches so far, and the id the current one carries on the wire (see ``TaskTable.attempt_sent``).
    attempt: int = 0
    wire_id: str = ""
    # The latest busy answer of a runtime (see "Busy runtimes"), and when the first came.
    busy_reply: worker_pb2.TaskResult | None = None
    busy_since: float | None = None
    # Its sends to engines that failed, and the retries sent (``protocol.processor.attempts``).
    attempts: Attempts = field(default_factory=Attempts)
    # Its place in a held queue (see ``protocol.processor.fair_queue``).
    criticality: Criticality = Criticality.STANDARD
    flow: str = ""
    weight: float = 1.0
    hints: RoutingHints | None = None
    # Whether it counts in its flow's slots held now (``FairShares``), from dispatch until it
    # leaves the engine (the engine may be gone from the tables by then).
    holds_slot: bool = False

    def release_request(self) -> None:
        """The response has started: the task can never be dispatched again, so the request
        (in both its forms, verbatim and typed) and its headers need not be held while it streams."""
        self.request = _RELEASED_REQUEST
        self.header = {}

    def out_of_order(self, result: worker_pb2.TaskResult, kind: str | None) -> str:
        """Why ``result`` (of ``kind``) cannot be the task's next result, or "" if it can."""
        engine_id = self.engine.engine_id if self.engine else ""
        if result.result_index != self.next_index:
            return f"engine {engine_id!r} sent result {result.result_index}, expected {self.next_index}"
        if self.next_index == 0 and kind != "http_response":
            return f"engine {engine_id!r} sent {kind} before the HTTP response"
        if self.next_index > 0 and (kind != "server_sent_event" or not self.streaming):
            flavour = "streaming" if self.streaming else "non-streaming"
            return f"engine {engine_id!r} sent {kind} as result {self.next_index} of a {flavour} task"
        return ""


class TaskTable:
    """Live tasks by id, per tenant and by the wire id of their current attempt, and their timers."""

    def __init__(self) -> None:
        self._by_id: dict[str, TaskRecord] = {}
        #: The live task of an id, or None (the dict's own ``get``: it is on every input's path).
        self.get: Callable[[str], TaskRecord | None] = self._by_id.get
        # Live tasks per tenant (every state), for ``max_tasks_per_tenant``.
        self._per_tenant: Counter[str] = Counter()
        # The task each attempt on an engine belongs to, by the id it carries on the wire.
        self._attempts: dict[str, TaskRecord] = {}
        #: (when, seq, task id): every task's timer, superseded entries included until they surface.
        self.timers: list[tuple[float, int, str]] = []
        self._timer_seq = 0

    # --- the mapping of live tasks ------------------------------------------

    def __getitem__(self, task_id: str) -> TaskRecord:
        return self._by_id[task_id]

    def __iter__(self) -> Iterator[str]:
        return iter(self._by_id)

    def __len__(self) -> int:
        return len(self._by_id)

    def __contains__(self, task_id: object) -> bool:
        return task_id in self._by_id

    def values(self) -> ValuesView[TaskRecord]:
        return self._by_id.values()

    def require(self, task_id: str) -> TaskRecord:
        """The live task ``task_id``; the caller misused the processor if there is none."""
        task = self._by_id.get(task_id)
        if task is None:
            raise ProcessorUsageError(f"no task {task_id!r} in progress")
        return task

    def of_tenant(self, tenant_id: str) -> int:
        """Live tasks of the tenant."""
        return self._per_tenant[tenant_id]

    # --- life cycle ----------------------------------------------------------

    def add(self, task: TaskRecord) -> None:
        """``task`` was accepted; it has no state until it first moves."""
        self._by_id[task.id] = task
        self._per_tenant[task.tenant_id] += 1

    def move(self, task: TaskRecord, state: TaskState) -> None:
        """The one place a task changes state: only along the life cycle's transitions."""
        if state not in TRANSITIONS[task.state]:
            raise AssertionError(f"task {task.id!r}: no transition {task.state} -> {state}")
        task.state = state

    def end(self, task: TaskRecord) -> None:
        """``task`` leaves the table, from whatever state (it let go of its queue and engine first)."""
        task.state = None
        del self._by_id[task.id]
        self._per_tenant[task.tenant_id] -= 1
        if not self._per_tenant[task.tenant_id]:
            del self._per_tenant[task.tenant_id]

    # --- attempts --------------------------------------------------------------

    def by_attempt(self, wire_id: str) -> TaskRecord | None:
        """The task whose current attempt carries ``wire_id`` on the wire, if any."""
        return self._attempts.get(wire_id)

    def attempt_sent(self, task: TaskRecord) -> None:
        """A new attempt of ``task`` is sent: it gets its wire id (``task.wire_id``)."""
        task.attempt += 1
        task.wire_id = self._attempt_id(task)
        self._attempts[task.wire_id] = task

    def attempt_over(self, task: TaskRecord) -> None:
        """The current attempt of ``task`` is over: its results are no longer taken."""
        if task.wire_id:
            del self._attempts[task.wire_id]
            task.wire_id = ""

    def _attempt_id(self, task: TaskRecord) -> str:
        """The id attempt ``task.attempt`` carries on the wire: the task id for the first,
        ``"{id}#{attempt}"`` for a retry, so that a late answer to an earlier attempt (a 503,
        a peer's refusal) is never taken for the current one, even over the same route.
        Engines and peers treat it as an opaque task id; results are mapped back here."""
        base = task.id if task.attempt == 1 else f"{task.id}#{task.attempt}"
        candidate, clash = base, 1
        while candidate in self._attempts:  # another task's id happens to look like an attempt id
            clash += 1
            candidate = f"{base}#{clash}"
        return candidate

    # --- timers ---------------------------------------------------------------

    def set_timer(self, task: TaskRecord, when: float) -> None:
        """``task``'s one timer fires at ``when`` (replacing any it had)."""
        if len(self.timers) > 2 * len(self._by_id) + 64:
            self.timers = [entry for entry in self.timers if self._timer_live(entry)]
            heapq.heapify(self.timers)
        self._timer_seq += 1
        task.timer_seq = self._timer_seq
        heapq.heappush(self.timers, (when, self._timer_seq, task.id))

    def next_timer(self) -> float | None:
        """When the next live timer fires, if any."""
        while self.timers and not self._timer_live(self.timers[0]):
            heapq.heappop(self.timers)
        return self.timers[0][0] if self.timers else None

    def due(self, now: float) -> Iterator[TaskRecord]:
        """The tasks whose timer fired by ``now``, in order; one set while iterating comes too if due."""
        while self.timers and self.timers[0][0] <= now:
            entry = heapq.heappop(self.timers)
            if self._timer_live(entry):
                yield self._by_id[entry[2]]

    def _timer_live(self, entry: tuple[float, int, str]) -> bool:
        task = self._by_id.get(entry[2])
        return task is not None and task.timer_seq == entry[1]
