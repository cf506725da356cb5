"""The processor's tables: task and engine records, their states, and the queries over them.

No I/O, no clock reads. Split from :mod:`protocol.processor.core` (which holds every
input and transition) so that each file keeps to one concern: this one owns
what the processor knows (tasks by id, engines by key and by tenant, the
waiting queues, the timer heap, counters) and answers questions about it
without changing it; the state table ``_TRANSITIONS`` is enforced by
``_move``, the one place a task changes state.

Engines are also indexed by (tenant, model): those that list the model and
those that have it ready, kept by ``_index`` (the one place an engine's model
sets change), so that routing a task and asking whether a model is served
cost the engines of that model, not every engine.
"""

from __future__ import annotations

import heapq
from collections import Counter
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from protocol.openai import task_forms
from protocol.processor.attempts import Attempts
from protocol.pb import status_pb2, worker_pb2
from protocol.processor.fair_queue import Criticality, HeldQueue
from protocol.processor.fair_share import FairShares
from protocol.processor.route_flow import RouteFlow
from protocol.processor.types import EngineKey, Locality, Origin, ProcessorConfig, ProcessorUsageError, Route, SendTask
from protocol.routing.hints import RoutingHints
from protocol.routing.router import Router

__all__ = ["EngineView", "ProcessorCounters", "ProcessorTables", "TaskOutcome", "TaskState"]


class TaskState(Enum):
    """Where a live task is; a finished task has no state (it is gone)."""

    WAITING = "waiting"
    RETRY_PENDING = "retry_pending"
    DISPATCHED = "dispatched"
    STREAMING = "streaming"


_TRANSITIONS: dict[TaskState | None, frozenset[TaskState]] = {
    None: frozenset({TaskState.WAITING, TaskState.DISPATCHED}),
    TaskState.WAITING: frozenset({TaskState.DISPATCHED}),
    TaskState.RETRY_PENDING: frozenset({TaskState.DISPATCHED, TaskState.WAITING}),
    TaskState.DISPATCHED: frozenset({TaskState.STREAMING, TaskState.RETRY_PENDING}),
    TaskState.STREAMING: frozenset(),
}

_ON_ENGINE = (TaskState.DISPATCHED, TaskState.STREAMING)


class TaskOutcome(Enum):
    """How a task ended, for metrics."""

    COMPLETED = "completed"  # the engine's last result was delivered (whatever its status)
    FAILED = "failed"  # FailRequest: deadline, queue timeout, retries exhausted, protocol error...
    CANCELLED = "cancelled"  # the client went away


class _ControlKind(Enum):
    HEARTBEAT = "heartbeat"
    GO_AWAY = "go_away"
    CANCEL = "cancel"


@dataclass(slots=True)
class _Control:
    """A task the processor sent on its own; its reply is consumed here."""

    kind: _ControlKind
    engine: EngineKey
    route: Route


#: What a streaming task holds in place of its request (see ``_Task.release_request``); never mutated.
_RELEASED_REQUEST = worker_pb2.TaskRequest()


@dataclass(slots=True)
class _Task:
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
    # named here with its gateway's pod, see ``update_engine_as``): its cancel carries it too.
    reported_engine_id: str = ""
    route: Route = None
    avoid: set[str] = field(default_factory=set)
    next_index: int = 0
    unconsumed: int = 0
    timer_seq: int = 0
    # Dispatches so far, and the id the current one carries on the wire (see ``_attempt_id``).
    attempt: int = 0
    wire_id: str = ""
    # The latest busy answer of a runtime (see "Busy runtimes"), and when the first came.
    busy_reply: worker_pb2.TaskResult | None = None
    busy_since: float | None = None
    # Its sends to engines that failed, and the retries sent (``protocol.attempts``).
    attempts: Attempts = field(default_factory=Attempts)

    def release_request(self) -> None:
        """The response has started: the task can never be dispatched again, so the request
        (in both its forms, verbatim and typed) and its headers need not be held while it streams."""
        self.request = _RELEASED_REQUEST
        self.header = {}
    # Its place in a held queue (see ``protocol.processor.fair_queue``).
    criticality: Criticality = Criticality.STANDARD
    flow: str = ""
    weight: float = 1.0
    hints: RoutingHints | None = None
    # Whether it counts in its flow's slots held now (``FairShares``), from dispatch until it
    # leaves the engine (the engine may be gone from the tables by then).
    holds_slot: bool = False


@dataclass(slots=True)
class _Engine:
    key: EngineKey
    route: Route
    locality: Locality
    status: status_pb2.EngineStatus
    ready_models: frozenset[str] = frozenset()
    # Every model its status lists, ready or loading (kept with ``ready_models`` by ``_index``).
    listed_models: frozenset[str] = frozenset()
    draining: bool = False
    in_flight: set[str] = field(default_factory=set)
    pending_heartbeat: str | None = None
    missed_heartbeats: int = 0
    # Set while the engine's runtime said it is busy: routing skips it until then.
    busy_until: float | None = None

    @property
    def routable(self) -> bool:
        return self.status.ready and not self.draining


@dataclass(frozen=True, slots=True)
class EngineView:
    """A read-only snapshot of one engine: ``routable`` is ready and not told to go away."""

    key: EngineKey
    route: Route
    locality: Locality
    routable: bool
    in_flight: int


@dataclass
class ProcessorCounters:
    """Monotonic counters the Twisted layer exports as metrics."""

    accepted: int = 0
    #: Sends of a task after one of its attempts failed, by that failure (``AttemptFailure``).
    retries: Counter[str] = field(default_factory=Counter)
    #: Attempts that failed without an answer for the client, by failure, retried or not.
    attempt_failures: Counter[str] = field(default_factory=Counter)
    results_ignored: int = 0
    protocol_errors: int = 0
    slow_consumers: int = 0
    heartbeats_missed: int = 0
    engine_id_clashes: int = 0
    tenant_cap_refusals: int = 0
    drain_refusals: int = 0
    shed: int = 0
    outcomes: Counter[str] = field(default_factory=Counter)



class ProcessorTables:
    """What the processor knows, and the read-only queries over it (the base of
    :class:`~protocol.processor.core.Processor`)."""

    def __init__(self, config: ProcessorConfig | None = None) -> None:
        self.config = config or ProcessorConfig()
        self.counters = ProcessorCounters()
        self._tasks: dict[str, _Task] = {}
        self._engines: dict[EngineKey, _Engine] = {}
        self._by_tenant: dict[str, dict[str, _Engine]] = {}
        # tenant -> model -> the tenant's engines that list it / that have it ready (see ``_index``).
        self._listing: dict[str, dict[str, dict[EngineKey, _Engine]]] = {}
        self._ready_for: dict[str, dict[str, dict[EngineKey, _Engine]]] = {}
        # (tenant, model) -> the tasks waiting for an engine, in the order they will get one.
        self._waiting: dict[tuple[str, str], HeldQueue] = {}
        # Targeted tasks (a peer's) waiting for a slot on their engine, per engine and model.
        self._waiting_on: dict[EngineKey, dict[str, HeldQueue]] = {}
        # Slots held and tasks waiting per caller, for fairness by slots held.
        self._shares = FairShares()
        self._waiting_total = 0
        # Sheddable tasks waiting, oldest first: the newest is shed when the whole queue is full.
        self._sheddable: dict[str, None] = {}
        self._timers: list[tuple[float, int, str]] = []
        self._timer_seq = 0
        self._control: dict[str, _Control] = {}
        self._control_seq = 0
        # The task each attempt on an engine belongs to, by the id it carries on the wire.
        self._attempts: dict[str, _Task] = {}
        self._next_heartbeat: float | None = None
        # Local engines another engine process claimed the id of, and when their answer to a
        # heartbeat is due (see ``Processor.update_engine``).
        self._probes: dict[EngineKey, float] = {}
        # Live tasks per tenant (every state), for ``max_tasks_per_tenant``.
        self._tenant_tasks: Counter[str] = Counter()
        # Engines a task left since the current input began: with an in-flight cap,
        # their freed slots go to waiting tasks before the input returns (``_refill``).
        self._freed: dict[EngineKey, None] = {}
        # (tenant, model)s whose slots held or waiting callers changed since the input began: with
        # a reserve, who may take an engine's last slots may have changed (``_refill``).
        self._reshuffled: dict[tuple[str, str], None] = {}
        # The waiting callers of (tenant, model) that were the least served when last retried.
        self._reserve_takers: dict[tuple[str, str], frozenset[str]] = {}
        # Set by ``drain``: a task that would wait fails at once instead.
        self.draining = False
        # (busy_until, seq, engine): when an engine's busy back-off ends.
        self._backoffs: list[tuple[float, int, EngineKey]] = []
        # Routes whose streams are not draining (backpressure), and since when.
        self._flow = RouteFlow(self.config.route_stuck_timeout)
        self._router = Router(self.config.routing)
    # --- queries ----------------------------------------------------------

    def has_task(self, task_id: str) -> bool:
        """Whether ``task_id`` is accepted and has not ended."""
        return task_id in self._tasks

    def attempt_owner(self, wire_id: str) -> str | None:
        """The task whose current attempt carries ``wire_id`` on the wire, if any."""
        task = self._attempts.get(wire_id)
        return None if task is None else task.id

    def task_state(self, task_id: str) -> TaskState:
        """The state of a live task."""
        state = self._require(task_id).state
        assert state is not None
        return state

    def waiting_counts(self) -> dict[tuple[str, str], int]:
        """Tasks waiting for an engine, per (tenant, model), peers' tasks waiting for a slot on
        one of ours included: the scaler's demand signal and the queued metric."""
        counts = Counter({key: len(ids) for key, ids in self._waiting.items() if ids})
        for engine_key, queues in self._waiting_on.items():
            for model, queue in queues.items():
                counts[(engine_key.tenant_id, model)] += len(queue)
        return dict(counts)

    def waiting_task_ids(self, tenant_id: str, model_id: str) -> list[str]:
        """Tasks waiting for (tenant, model), oldest first."""
        return list(self._waiting.get((tenant_id, model_id), ()))

    def slots_held(self, tenant_id: str, model_id: str) -> dict[str, int]:
        """Tasks on an engine per caller (flow) of (tenant, model): what fairness counts."""
        return self._shares.held(tenant_id, model_id)

    def in_flight_counts(self) -> dict[tuple[str, str], int]:
        """Tasks on an engine (dispatched or streaming), per (tenant, model)."""
        counts: Counter[tuple[str, str]] = Counter()
        for task in self._tasks.values():
            if task.state in _ON_ENGINE:
                counts[(task.tenant_id, task.model)] += 1
        return dict(counts)

    def engine_counts(self) -> dict[tuple[str, Locality], int]:
        """Engines per (tenant, locality)."""
        return dict(Counter((e.key.tenant_id, e.locality) for e in self._engines.values()))

    def routable_engine_counts(self) -> dict[tuple[str, Locality], int]:
        """Engines that take tasks now (ready, not told to go away), per (tenant, locality)."""
        return dict(Counter((e.key.tenant_id, e.locality) for e in self._engines.values() if e.routable))

    def tenants(self) -> list[str]:
        """Tenants with at least one engine registered, sorted."""
        return sorted(self._by_tenant)

    def engine(self, tenant_id: str, engine_id: str) -> EngineView | None:
        """What the processor knows of one engine, or None if it is not registered."""
        engine = self._engines.get(EngineKey(tenant_id, engine_id))
        if engine is None:
            return None
        return EngineView(engine.key, engine.route, engine.locality, engine.routable, len(engine.in_flight))

    def takes_http_request(self, tenant_id: str, model_id: str) -> bool:
        """Whether an engine of the tenant that lists the model (ready or not) runs verbatim requests."""
        listing = self._listing.get(tenant_id, {}).get(model_id, {})
        return any(task_forms.takes_http_request(e.status) for e in listing.values())

    def serves(self, tenant_id: str, model_id: str) -> bool:
        """Whether an engine of the tenant lists the model (ready or loading)."""
        return model_id in self._listing.get(tenant_id, {})

    def known_models(self, tenant_id: str, ready_only: bool = False) -> set[str]:
        """Models the tenant's engines list (loading ones too); with ``ready_only``,
        only those a task could be routed to now."""
        if not ready_only:
            return set(self._listing.get(tenant_id, {}))
        return {model for model, engines in self._ready_for.get(tenant_id, {}).items()
                if any(engine.routable for engine in engines.values())}

    def local_engines(self) -> list[tuple[str, status_pb2.EngineStatus]]:
        """(tenant, status copy) of every local engine, with its real readiness."""
        out = []
        for engine in self._engines.values():
            if engine.locality is Locality.LOCAL:
                copy = status_pb2.EngineStatus()
                copy.CopyFrom(engine.status)
                self._router.annotate(engine.key, copy)  # what peers learn of its spilled prompts
                out.append((engine.key.tenant_id, copy))
        return out

    def status(self, tenant: str | None = None) -> dict[str, Any]:
        """A JSON-able dump of tenants, engines, their tasks and the queue; with ``tenant``, of
        that tenant alone (what its own admin may see)."""
        tenants: dict[str, Any] = {}
        for tenant_id, engines in sorted(self._by_tenant.items()):
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
                        "waiting": [t for queue in self._waiting_on.get(e.key, {}).values() for t in queue],
                    }
                    for engine_id, e in sorted(engines.items())
                }
            }
        queue: dict[str, Any] = {}
        for (tenant_id, model), ids in sorted(self._waiting.items()):
            if ids and tenant in (None, tenant_id):
                queue.setdefault(tenant_id, {})[model] = list(ids)
        retrying = sorted(t.id for t in self._tasks.values()
                          if t.state is TaskState.RETRY_PENDING and tenant in (None, t.tenant_id))
        tasks = len(self._tasks) if tenant is None else self._tenant_tasks[tenant]
        return {"tenants": tenants, "waiting": queue, "retry_pending": retrying, "tasks": tasks}
    # --- internals: bookkeeping -------------------------------------------

    def _index(self, engine: _Engine, listed: frozenset[str], ready: frozenset[str]) -> None:
        """Set the models an engine lists and has ready, and the (tenant, model) index with them
        (both empty: it leaves the index)."""
        tenant, key = engine.key.tenant_id, engine.key
        for table, old, new in ((self._listing, engine.listed_models, listed),
                                (self._ready_for, engine.ready_models, ready)):
            models = table.setdefault(tenant, {})
            for model in old - new:
                holders = models[model]
                del holders[key]
                if not holders:
                    del models[model]
            for model in new - old:
                models.setdefault(model, {})[key] = engine
            if not models:
                del table[tenant]
        engine.listed_models, engine.ready_models = listed, ready

    def _move(self, task: _Task, state: TaskState) -> None:
        if state not in _TRANSITIONS[task.state]:
            raise AssertionError(f"task {task.id!r}: no transition {task.state} -> {state}")
        task.state = state

    def _set_timer(self, task: _Task, when: float) -> None:
        # Superseded entries stay in the heap until they surface; compact it
        # when they outnumber the live tasks, so memory follows the live load.
        if len(self._timers) > 2 * len(self._tasks) + 64:
            self._timers = [entry for entry in self._timers if self._timer_live(entry)]
            heapq.heapify(self._timers)
        self._timer_seq += 1
        task.timer_seq = self._timer_seq
        heapq.heappush(self._timers, (when, self._timer_seq, task.id))

    def _timer_live(self, entry: tuple[float, int, str]) -> bool:
        task = self._tasks.get(entry[2])
        return task is not None and task.timer_seq == entry[1]

    def _require(self, task_id: str) -> _Task:
        task = self._tasks.get(task_id)
        if task is None:
            raise ProcessorUsageError(f"no task {task_id!r} in progress")
        return task

    def _check_result(self, task: _Task, result: worker_pb2.TaskResult, kind: str | None) -> str:
        engine_id = task.engine.engine_id if task.engine else ""
        if result.result_index != task.next_index:
            return f"engine {engine_id!r} sent result {result.result_index}, expected {task.next_index}"
        if task.next_index == 0 and kind != "http_response":
            return f"engine {engine_id!r} sent {kind} before the HTTP response"
        if task.next_index > 0 and (kind != "server_sent_event" or not task.streaming):
            flavour = "streaming" if task.streaming else "non-streaming"
            return f"engine {engine_id!r} sent {kind} as result {task.next_index} of a {flavour} task"
        return ""

    def _attempt_id(self, task: _Task) -> str:
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

    def _unassign(self, task: _Task) -> None:
        if task.holds_slot:
            task.holds_slot = False
            self._shares.left(task.tenant_id, task.model, task.flow)
            self._shares_changed(task)
        if task.engine is not None:
            engine = self._engines.get(task.engine)
            if engine is not None:
                if task.id in engine.in_flight:
                    engine.in_flight.remove(task.id)
                    self._router.task_left(engine.key)
                if self.config.max_in_flight_per_engine is not None:
                    self._freed[engine.key] = None
        if task.wire_id:
            del self._attempts[task.wire_id]
            task.wire_id = ""
        task.engine = None
        task.route = None

    def _shares_changed(self, task: _Task) -> None:
        """``task``'s caller took or gave back a slot, or stopped waiting unserved: with a
        reserve, another caller may now be the least served, and take a reserved slot."""
        cap = self.config.max_in_flight_per_engine
        if cap is not None and min(self.config.fair_reserve, cap - 1) > 0:
            self._reshuffled[(task.tenant_id, task.model)] = None

    def _control_task(
        self, kind: _ControlKind, engine: EngineKey, reported_id: str, route: Route, request: worker_pb2.TaskRequest
    ) -> SendTask:
        """A task of the processor's own to ``engine``, which reports ``reported_id`` on ``route``."""
        self._control_seq += 1
        control_id = f"{self.config.control_task_prefix}{kind.value}-{self._control_seq}"
        self._control[control_id] = _Control(kind, engine, route)
        wire = worker_pb2.Task(id=control_id, request=request, engine_id=reported_id)
        return SendTask(route, engine, wire)

    def _control_replied(self, control_id: str, control: _Control) -> None:
        del self._control[control_id]
        if control.kind is _ControlKind.HEARTBEAT:
            self._probes.pop(control.engine, None)  # alive: an engine that claimed its id was refused rightly
            engine = self._engines.get(control.engine)
            if engine is not None and engine.pending_heartbeat == control_id:
                engine.pending_heartbeat = None
                engine.missed_heartbeats = 0
