"""Where a task goes: routing it to an engine, dispatch, and the waiting tasks that take the
slots freed or opened during an input; pure, no I/O, no clock reads.

Rules this file keeps: a task is sent to an engine only by :meth:`TaskDispatcher.dispatch`, and
only to one routing chose (:meth:`TaskDispatcher.pick`: the task's tenant's engines that serve its
model and can take its request, by the policy ``config.routing`` names, skipping those full,
busy or blocked, see :mod:`protocol.processor.slots`). A task no engine can take now waits in
its model's held queue (:meth:`TaskDispatcher.route`), or is shed, refused or failed. Waiting tasks
get a slot when one frees on an engine (:meth:`TaskDispatcher.dispatch_waiting`: peers' tasks held
for it and this gateway's for its models, in their callers' turn) or when a change of slots
held lets a waiting caller take an engine's reserved slots; :meth:`TaskDispatcher.refill` does
both before every input returns.

Draining (``draining``, set by ``Processor.drain``): a task that would wait (no routable
engine, local or a peer's, serves its model) fails at once with 503 and ``busy_retry_after``.
"""

from __future__ import annotations

import itertools

from protocol.openai import task_forms, verbatim
from protocol.pb import worker_pb2
from protocol.processor.counters import ProcessorCounters
from protocol.processor.endings import Endings
from protocol.processor.engines import EngineRecord, EngineTable
from protocol.processor.fair_queue import Criticality, HeldQueue
from protocol.processor.fair_share import caller_message
from protocol.processor.slots import Slots
from protocol.processor.tasks import TaskRecord, TaskState, TaskTable
from protocol.processor.config import ProcessorConfig
from protocol.processor.effects import Effect, SendTask, TaskQueued
from protocol.processor.keys import EngineKey, Locality
from protocol.routing.policy import RouteChoice
from protocol.routing.router import Router

__all__ = ["TaskDispatcher"]


class TaskDispatcher:
    """Routes tasks to engines, and gives freed slots to waiting tasks."""

    def __init__(self, config: ProcessorConfig, counters: ProcessorCounters, tasks: TaskTable,
                 engines: EngineTable, slots: Slots, endings: Endings, router: Router) -> None:
        self.config = config
        self.counters = counters
        self._tasks = tasks
        self._engines = engines
        self._slots = slots
        self._endings = endings
        self._router = router
        #: Set by ``Processor.drain``: a task that would wait fails at once instead.
        self.draining = False

    def route(self, now: float, task: TaskRecord, effects: list[Effect]) -> None:
        """Send ``task`` to the engine routing picks, or let it wait (or shed, refuse, fail it)."""
        engine = self.pick(task)
        if engine is None and self._typed_form_built(task):
            engine = self.pick(task)
        if engine is not None:
            self.dispatch(now, task, engine, effects)
            return
        slots, endings = self._slots, self._endings
        if self.no_engine_takes_it(task):
            endings.fail(task, 400, self._typed_form_missing(task), effects)
            return
        if self._should_shed(task):
            endings.shed(task, effects)
            return
        if slots.waiting_total >= self.config.max_waiting_tasks:
            if not slots.sheddable:
                if task.busy_reply is not None:
                    endings.deliver(task, task.busy_reply, True, effects)
                else:
                    endings.fail(task, 503, "too many tasks waiting for an engine", effects,
                                 self.config.busy_retry_after)
                return
            endings.shed(self._tasks[next(reversed(slots.sheddable))], effects)
        if self.draining and self.pick(task, ignore_cap=True) is None:
            endings.refuse_draining(task, effects)
            return
        slots.hold(now, task, slots.model_queue(task))
        if task.criticality is Criticality.SHEDDABLE:
            slots.sheddable[task.id] = None
        if not self.served_but_full(task):
            queued = len(slots.waiting[(task.tenant_id, task.model)])
            effects.append(TaskQueued(task.tenant_id, task.model, task.id, queued))

    def wait_on_engine(self, now: float, task: TaskRecord, engine: EngineRecord, effects: list[Effect]) -> None:
        """A peer's task for an engine at its cap waits for a slot on it, in its caller's turn
        among every gateway's callers; a sheddable one, or one that finds the queue full, is
        refused (503) so that the peer may try elsewhere."""
        if task.criticality is Criticality.SHEDDABLE or self._slots.waiting_total >= self.config.max_waiting_tasks:
            message = f"engine {task.target!r} is at its limit of {self._slots.cap(engine)} tasks"
            self._endings.fail(task, 503, message, effects, self.config.busy_retry_after)
            return
        self._slots.hold(now, task, self._slots.engine_queue(engine, task.model))

    def _typed_form_built(self, task: TaskRecord) -> bool:
        """Whether the task's typed form, left unbuilt as it arrived (no engine then took only
        that form, :mod:`protocol.openai.verbatim`), was built now that one may take it."""
        if not verbatim.typed_form_deferred(task.request) or not self._engines.typed_form_wanted(
                task.tenant_id, task.model, self.config.dynamic_model_loading):
            return False
        task.request = verbatim.with_typed_form(task.request)
        return True

    @staticmethod
    def _typed_form_missing(task: TaskRecord) -> str:
        return (f"no engine serving model {task.model!r} can take this request "
                f"(it needs infx's engine agent): {task.request.typed_request_incomplete}")

    def no_engine_takes_it(self, task: TaskRecord) -> bool:
        """Engines list the task's model, but none can take its request (only its verbatim form
        exists and they are LLMariner engines): waiting would not help."""
        return (
            bool(task.request.typed_request_incomplete)
            and self._engines.serves(task.tenant_id, task.model)
            and not self._engines.takes_http_request(task.tenant_id, task.model)
        )

    def _should_shed(self, task: TaskRecord) -> bool:
        """Whether a task that is about to wait is sheddable and the engines are saturated."""
        if task.criticality is not Criticality.SHEDDABLE:
            return False
        if self._slots.waiting_total >= self.config.max_waiting_tasks:
            return True
        queue = self._slots.waiting.get((task.tenant_id, task.model))
        held = len(queue) if queue is not None else 0
        return held >= self.config.shed_waiting_threshold and self.served_but_full(task)

    def served_but_full(self, task: TaskRecord) -> bool:
        """Whether the task waits only for room: an engine would take it but for its in-flight
        cap, its runtime's busy back-off or its blocked route."""
        return self.pick(task, ignore_cap=True) is not None

    def pick(self, task: TaskRecord, ignore_cap: bool = False, use_reserve: bool = False) -> EngineRecord | None:
        """The engine for ``task`` by the routing policy, or None: every engine that serves its
        model is full, busy or blocked, or cannot take its request in any form. With
        ``ignore_cap``, the ``least_in_progress`` engine that could take it but for those; with
        ``use_reserve``, one with a reserved slot even if its caller may not take it."""
        slots = self._slots
        reserve = ignore_cap or use_reserve or slots.may_use_reserve(task)
        engines, request = self._engines, task.request
        engine_of = engines.get

        def held_back(key: EngineKey) -> bool:
            engine = engine_of(key)
            assert engine is not None  # the router knows only engines of the table
            return slots.blocked(engine, ignore_cap, reserve) or not task_forms.eligible(request, engine.status)

        if ignore_cap:
            key = self._router.least_in_progress(task.tenant_id, task.model, task.avoid, held_back)
        else:
            key = self._router.choose(task.tenant_id, task.model, task.hints, task.avoid, held_back)
            if key is None and self.config.dynamic_model_loading:
                # Past the affinity policy's load bound: any engine with room, else one to load the model.
                key = self._router.least_in_progress(task.tenant_id, task.model, task.avoid, held_back)
        if key is not None:
            return engine_of(key)
        if not self.config.dynamic_model_loading:
            return None
        # Any engine may load the model: this one scan is over every engine of the tenant.
        best: EngineRecord | None = None
        best_rank: tuple[bool, int, str] | None = None
        for engine in engines.of_tenant(task.tenant_id).values():
            if not engine.routable or slots.blocked(engine, ignore_cap, reserve):
                continue
            if not task_forms.eligible(request, engine.status):
                continue
            rank = (engine.key.engine_id in task.avoid, len(engine.ready_models), engine.key.engine_id)
            if best_rank is None or rank < best_rank:
                best, best_rank = engine, rank
        return best

    def dispatch(self, now: float, task: TaskRecord, engine: EngineRecord, effects: list[Effect]) -> None:
        """Send a new attempt of ``task`` to ``engine`` (``SendTask``)."""
        self._tasks.move(task, TaskState.DISPATCHED)
        task.engine = engine.key
        task.reported_engine_id = engine.status.engine_id
        task.route = engine.route
        task.next_index = 0
        retried = task.attempts.sent()
        if retried is not None:
            self.counters.retries[retried.value] += 1
        self._tasks.attempt_sent(task)
        self._slots.take(task, engine)
        tip = self._router.task_sent(engine.key, task.model, task.hints, task.request.infx_prefix_tip,
                                     forwarded=bool(task.target))
        self._tasks.set_timer(task, task.deadline)
        wire = worker_pb2.Task(
            id=task.wire_id,
            request=task_forms.for_engine(task.request, engine.status),
            engine_id=engine.status.engine_id,
            timeout_seconds=max(1, int(task.deadline - now)),
        )
        # A spill's tip, and the caller, go to a peer's engine's gateway (protocol/routing/spills.py,
        # fair_share.py), never to an engine.
        wire.request.infx_prefix_tip = tip
        remote = engine.locality is Locality.REMOTE
        caller = caller_message(task.flow, task.weight, task.criticality) if remote else None
        if caller is not None:
            wire.request.infx_caller.CopyFrom(caller)
        else:
            wire.request.ClearField("infx_caller")
        for name, values in task.header.items():
            wire.header[name].values.extend(values)
        choice = self._router.take_choice(engine.key)
        if choice is None and task.target and self.config.routing.explain:
            choice = RouteChoice(engine.key, "targeted", "named by the gateway that forwarded it")
        effects.append(SendTask(engine.route, engine.key, wire, choice))

    # --- waiting tasks take slots ----------------------------------------------------

    def dispatch_waiting(self, now: float, engine: EngineRecord, effects: list[Effect]) -> None:
        """``engine`` may have room: peers' tasks held for it, then this gateway's tasks waiting
        for its models, take it in their turn."""
        tenant_id = engine.key.tenant_id
        for model, targeted in list(self._slots.waiting_on.get(engine.key, {}).items()):
            self._dispatch_targeted(now, engine, model, targeted, effects)
        waiting = self._slots.waiting
        if self.config.dynamic_model_loading:
            keys = [key for key in waiting if key[0] == tenant_id]
        else:
            # In the order the queues formed, not the frozenset's (hash-seeded) order, so that the
            # same inputs dispatch the same way in every process (the simulation replays seeds).
            keys = [key for key in waiting if key[0] == tenant_id and key[1] in engine.ready_models]
        for key in keys:
            self._dispatch_queue(now, key, effects)

    def _dispatch_targeted(
        self, now: float, engine: EngineRecord, model: str, targeted: HeldQueue, effects: list[Effect],
        before_local: bool = True,
    ) -> None:
        """Peers' tasks for ``model`` waiting for ``engine`` take its free slots, in their turn
        among this gateway's own tasks waiting for the model: a local task that comes first
        (more critical, or of a caller holding fewer slots per weight) goes first, wherever
        it finds room (``before_local``: unless the local ones just found none)."""
        slots, tasks = self._slots, self._tasks
        key = (engine.key.tenant_id, model)
        served = slots.served_for(key)
        while targeted and (task_id := targeted.peek(served)) is not None:
            task = tasks[task_id]
            local = slots.waiting.get(key) if before_local else None
            first = None if local is None else local.peek(served)
            if first is not None and self._comes_before(tasks[first], task):
                target = self.pick(tasks[first])
                if target is not None:
                    slots.unwait(tasks[first], served=True)
                    self.dispatch(now, tasks[first], target, effects)
                    continue
            if slots.full(engine, slots.may_use_reserve(task)):
                break  # the least served flow waits; nobody else may take the slot before it
            slots.unwait(task, served=True)
            self.dispatch(now, task, engine, effects)

    def _comes_before(self, task: TaskRecord, other: TaskRecord) -> bool:
        """Whether ``task`` takes a slot before ``other`` (both waiting for its model): more
        critical, or as critical and of a caller holding fewer slots per weight."""
        served = self._slots.shares.served
        return (task.criticality.rank, served(task.tenant_id, task.model, task.flow)) < \
            (other.criticality.rank, served(other.tenant_id, other.model, other.flow))

    def _dispatch_queue(self, now: float, key: tuple[str, str], effects: list[Effect]) -> None:
        """Tasks waiting in the queue of (tenant, model) go to any engine with room, in their turn."""
        slots, tasks = self._slots, self._tasks
        queue = slots.waiting.get(key)
        while queue is not None and (task_id := queue.peek(slots.served_for(key))) is not None:
            task = tasks[task_id]
            target = self.pick(task)
            if target is None and self._typed_form_built(task):
                continue
            if target is None and task.request.typed_request_incomplete:
                if self.no_engine_takes_it(task):
                    self._endings.fail(task, 400, self._typed_form_missing(task), effects)
                else:
                    # The head waits for an engine that takes its verbatim form; a task
                    # behind it may take this one's typed form now.
                    task, target = self._typed_taker(queue, task)
                    if target is None:
                        break
                    slots.unwait(task, served=True)
                    self.dispatch(now, task, target, effects)
                queue = slots.waiting.get(key)
                continue
            if target is None and not slots.may_use_reserve(task) and self._reserve_wanted_below(queue, key):
                target = self.pick(task, use_reserve=True)
            if target is None:
                break
            slots.unwait(task, served=True)
            self.dispatch(now, task, target, effects)
            queue = slots.waiting.get(key)

    def _typed_taker(self, queue: HeldQueue, head: TaskRecord) -> tuple[TaskRecord, EngineRecord | None]:
        """While ``head`` waits for an engine that takes its verbatim form, the task with a typed
        form that takes a free slot now, and its engine: the most critical (the oldest within a
        band), on a reserved slot its caller may not take if a less critical one's may (as
        :meth:`_reserve_wanted_below`); else (``head``, None)."""
        typed = sorted((t for t in map(self._tasks.__getitem__, queue) if not t.request.typed_request_incomplete),
                       key=lambda t: t.criticality.rank)
        taker = next((t for t in typed if self.pick(t) is not None), None)
        if taker is None:
            return head, None
        if typed[0].criticality.rank < taker.criticality.rank:
            return typed[0], self.pick(typed[0], use_reserve=True)
        return taker, self.pick(taker)

    def _reserve_wanted_below(self, queue: HeldQueue, key: tuple[str, str]) -> bool:
        """Whether the head of a lower criticality band than the queue's head may take the
        reserved slots the head may not (its caller holds the fewest), and finds one: then the
        head takes it, as criticality comes first, rather than leave it idle while both wait."""
        for task_id in itertools.islice(queue.heads(self._slots.served_for(key)), 1, None):
            task = self._tasks[task_id]
            if self._slots.may_use_reserve(task) and self.pick(task) is not None:
                return True
        return False

    def refill(self, now: float, effects: list[Effect]) -> None:
        """Give the slots freed during this input to waiting tasks (only an in-flight cap
        can keep a task waiting while an engine serves its model, so only then is there work),
        and retry those of a model whose slots held changed when that made a waiting caller
        the least served, who may take an engine's reserved slots (``Slots.reshuffled``)."""
        slots = self._slots
        while slots.freed or slots.reshuffled:
            if slots.freed:
                freed = next(iter(slots.freed))
                del slots.freed[freed]
                engine = self._engines.get(freed)
                if engine is not None and engine.routable:
                    self.dispatch_waiting(now, engine, effects)
                continue
            key = next(iter(slots.reshuffled))
            del slots.reshuffled[key]
            takers = slots.shares.least_served_waiting(*key)
            before = slots.reserve_takers.pop(key, frozenset())
            if takers:
                slots.reserve_takers[key] = takers
            if not takers - before:
                continue  # no waiting caller may take a reserved slot it could not before
            tenant_id, model = key
            # This gateway's tasks first: then none of them can take a slot a peer's task may.
            self._dispatch_queue(now, key, effects)
            for engine_key, queues in list(slots.waiting_on.items()):
                held = queues.get(model) if engine_key.tenant_id == tenant_id else None
                engine = self._engines.get(engine_key)
                if held is not None and engine is not None and engine.routable and not slots.full(engine):
                    self._dispatch_targeted(now, engine, model, held, effects, before_local=False)
