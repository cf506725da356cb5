"""Engine slots: who holds one, who waits for one, and who may take an engine's last ones;
pure, no I/O, no clock reads.

Rules this file keeps: a task takes a slot with :meth:`Slots.take` (at dispatch) and lets go
of it with :meth:`Slots.unassign` (it leaves its engine: it ended, failed over, or the route
refused it), counted for its caller (:class:`protocol.processor.fair_share.FairShares`); a
task waits with :meth:`Slots.hold` and stops with :meth:`Slots.unwait`. Every way a task ends,
fails or waits passes here, so the counts of slots held and of tasks waiting cannot drift from
the tasks themselves. Which waiting task takes a freed slot is the dispatcher's
(:mod:`protocol.processor.dispatcher`); this part records what it must look at again
(``freed``, ``reshuffled``).

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

from collections import Counter
from collections.abc import Callable

from protocol.processor.engines import EngineRecord, EngineTable
from protocol.processor.fair_queue import Criticality, HeldQueue
from protocol.processor.fair_share import FairShares
from protocol.processor.route_flow import RouteFlow
from protocol.processor.tasks import TaskRecord, TaskState, TaskTable
from protocol.processor.config import ProcessorConfig
from protocol.processor.keys import EngineKey, Locality
from protocol.routing.router import Router

__all__ = ["Slots"]


class Slots:
    """Slots held and tasks waiting, per caller, per (tenant, model) and per engine."""

    def __init__(self, config: ProcessorConfig, tasks: TaskTable, engines: EngineTable, router: Router,
                 flow: RouteFlow) -> None:
        self.config = config
        self._tasks = tasks
        self._engines = engines
        self._router = router
        self._flow = flow
        #: (tenant, model) -> the tasks waiting for an engine, in the order they will get one.
        self.waiting: dict[tuple[str, str], HeldQueue] = {}
        #: Targeted tasks (a peer's) waiting for a slot on their engine, per engine and model.
        self.waiting_on: dict[EngineKey, dict[str, HeldQueue]] = {}
        #: Slots held and tasks waiting per caller, for fairness by slots held.
        self.shares = FairShares()
        self.waiting_total = 0
        #: Sheddable tasks waiting, oldest first: the newest is shed when the whole queue is full.
        self.sheddable: dict[str, None] = {}
        #: Engines a task left since the current input began: with an in-flight cap,
        #: their freed slots go to waiting tasks before the input returns (``TaskDispatcher.refill``).
        self.freed: dict[EngineKey, None] = {}
        #: (tenant, model)s whose slots held or waiting callers changed since the input began: with
        #: a reserve, who may take an engine's last slots may have changed (``TaskDispatcher.refill``).
        self.reshuffled: dict[tuple[str, str], None] = {}
        #: The waiting callers of (tenant, model) that were the least served when last retried.
        self.reserve_takers: dict[tuple[str, str], frozenset[str]] = {}

    # --- holding a slot ---------------------------------------------------------

    def take(self, task: TaskRecord, engine: EngineRecord) -> None:
        """``task`` was dispatched to ``engine``: it holds a slot there, for its caller."""
        engine.in_flight.add(task.id)
        task.holds_slot = True
        self.shares.dispatched(task.tenant_id, task.model, task.flow, task.weight)
        self.shares_changed(task)

    def unassign(self, task: TaskRecord) -> None:
        """``task`` leaves its engine (if on one): its slot and its attempt are given back."""
        if task.holds_slot:
            task.holds_slot = False
            self.shares.left(task.tenant_id, task.model, task.flow)
            self.shares_changed(task)
        if task.engine is not None:
            engine = self._engines.get(task.engine)
            if engine is not None:
                if task.id in engine.in_flight:
                    engine.in_flight.remove(task.id)
                    self._router.task_left(engine.key, task.model, task.hints)
                if self.cap(engine) is not None:
                    self.freed[engine.key] = None
        self._tasks.attempt_over(task)
        task.engine = None
        task.route = None

    def shares_changed(self, task: TaskRecord) -> None:
        """``task``'s caller took or gave back a slot, or stopped waiting unserved: with a
        reserve, another caller may now be the least served, and take a reserved slot."""
        if self.capped and self.config.fair_reserve > 0:
            self.reshuffled[(task.tenant_id, task.model)] = None

    def full(self, engine: EngineRecord, may_use_reserve: bool = True) -> bool:
        """On a route that is not draining, or at its in-flight cap: its tasks counted as the
        larger of this processor's on it and what it reported plus those sent since (every
        gateway's), less the reserve for a task that may not take it (``fair_reserve``)."""
        if engine.route in self._flow:
            return True
        cap = self.cap(engine)
        if cap is None:
            return False
        limit = cap if may_use_reserve else cap - min(self.config.fair_reserve, cap - 1)
        return max(len(engine.in_flight), self._router.load(engine.key)) >= limit

    @property
    def capped(self) -> bool:
        """Whether any engine may have an in-flight cap (``max_in_flight_per_engine``, or the
        runtime's slots with ``cap_at_runtime_slots``)."""
        return self.config.max_in_flight_per_engine is not None or self.config.cap_at_runtime_slots

    def cap(self, engine: EngineRecord) -> int | None:
        """The tasks ``engine`` holds at most: ``max_in_flight_per_engine``, else (with
        ``cap_at_runtime_slots``) a local engine's runtime slots, else none."""
        if self.config.max_in_flight_per_engine is not None:
            return self.config.max_in_flight_per_engine
        if self.config.cap_at_runtime_slots and engine.locality is Locality.LOCAL \
                and engine.status.infx_runtime_slots:
            return int(engine.status.infx_runtime_slots)
        return None

    def may_use_reserve(self, task: TaskRecord) -> bool:
        """Whether ``task`` may take an engine's reserved last slots: it is critical, or its
        flow holds no more slots per weight than any other on its model (fair_share.py)."""
        return (not self.capped or task.criticality is Criticality.CRITICAL
                or self.shares.least_served(task.tenant_id, task.model, task.flow, task.weight))

    def blocked(self, engine: EngineRecord, ignore_cap: bool, may_use_reserve: bool = True) -> bool:
        """Whether routing must skip a routable engine for now (full, its route not
        draining, or its runtime busy)."""
        return not ignore_cap and (self.full(engine, may_use_reserve) or engine.busy_until is not None)

    # --- waiting ----------------------------------------------------------------------

    def hold(self, now: float, task: TaskRecord, queue: HeldQueue) -> None:
        """``task`` waits in ``queue`` for a slot, for at most ``queue_timeout``."""
        self._tasks.move(task, TaskState.WAITING)
        queue.add(task.id, task.flow, task.weight, task.criticality)
        self.shares.started_waiting(task.tenant_id, task.model, task.flow, task.weight)
        self.waiting_total += 1
        queued_since = now if task.busy_since is None else task.busy_since
        self._tasks.set_timer(task, min(queued_since + self.config.queue_timeout, task.deadline))

    def model_queue(self, task: TaskRecord) -> HeldQueue:
        """The queue of ``task``'s (tenant, model), made if it has none."""
        return self.waiting.setdefault((task.tenant_id, task.model), HeldQueue())

    def engine_queue(self, engine: EngineRecord, model: str) -> HeldQueue:
        """The queue of peers' tasks for ``model`` waiting for a slot on ``engine``, made if none."""
        return self.waiting_on.setdefault(engine.key, {}).setdefault(model, HeldQueue())

    def unwait(self, task: TaskRecord, served: bool = False) -> None:
        """``task`` stops waiting: it got a slot (``served``), or it ends or moves on unserved."""
        engine_key = EngineKey(task.tenant_id, task.target)
        queue = self.waiting_on[engine_key][task.model] if task.target else self.waiting[(task.tenant_id, task.model)]
        if served:
            queue.take(task.id)
        else:
            queue.remove(task.id)
            self.shares_changed(task)
        self.sheddable.pop(task.id, None)
        self.shares.stopped_waiting(task.tenant_id, task.model, task.flow)
        self.waiting_total -= 1
        if not queue and task.target:
            del self.waiting_on[engine_key][task.model]
            if not self.waiting_on[engine_key]:
                del self.waiting_on[engine_key]
        elif not queue:
            del self.waiting[(task.tenant_id, task.model)]

    def served_for(self, key: tuple[str, str]) -> Callable[[str], float]:
        """Slots each flow of (tenant, model) holds per weight, for the held queue's order."""
        tenant_id, model = key
        return lambda flow: self.shares.served(tenant_id, model, flow)

    def waiting_on_engine(self, key: EngineKey) -> list[str]:
        """Peers' tasks waiting here for a slot on ``key``."""
        return [t for queue in self.waiting_on.get(key, {}).values() for t in queue]

    def waiting_counts(self) -> dict[tuple[str, str], int]:
        """Tasks waiting for an engine, per (tenant, model), peers' tasks waiting for a slot on
        one of ours included."""
        counts = Counter({key: len(ids) for key, ids in self.waiting.items() if ids})
        for engine_key, queues in self.waiting_on.items():
            for model, queue in queues.items():
                counts[(engine_key.tenant_id, model)] += len(queue)
        return dict(counts)
