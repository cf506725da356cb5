"""Where a task goes: routing to an engine, dispatch, and the waiting tasks that take the
slots freed or opened during an input; pure (the base of :class:`~protocol.processor.core.Processor`).

Split from :mod:`protocol.processor.core` (which holds every input) so that each file keeps to one
concern. Routing (``_pick``): the task's tenant's engines that serve its model and can take its
request, by ``config.routing``'s policy, skipping those full, busy or blocked
(:mod:`protocol.processor.slots`). A task no engine can take now waits in its model's held
queue (``_route``), or is shed, refused or failed. Waiting tasks get a slot when one frees on an
engine (``_dispatch_waiting``: peers' tasks held for it and this gateway's for its models, in
their callers' turn) or when a change of slots held lets a waiting caller take an engine's
reserved slots (``_refill``).
"""

from __future__ import annotations

import itertools

from protocol.openai import task_forms
from protocol.pb import worker_pb2
from protocol.processor.fair_queue import Criticality, HeldQueue
from protocol.processor.fair_share import caller_message
from protocol.processor.slots import ProcessorSlots
from protocol.processor.tables import TaskState, _Engine, _Task
from protocol.processor.types import Effect, Locality, SendTask, TaskQueued
from protocol.routing.router import RoutingPolicy

__all__ = ["ProcessorRouting"]


class ProcessorRouting(ProcessorSlots):
    """Routing and dispatch of :class:`~protocol.processor.core.Processor`."""

    def _route(self, now: float, task: _Task, effects: list[Effect]) -> None:
        engine = self._pick(task)
        if engine is not None:
            self._dispatch(now, task, engine, effects)
            return
        if self._no_engine_takes_it(task):
            self._fail(task, 400, self._typed_form_missing(task), effects)
            return
        if self._should_shed(task):
            self._shed(task, effects)
            return
        if self._waiting_total >= self.config.max_waiting_tasks:
            if not self._sheddable:
                if task.busy_reply is not None:
                    self._deliver(task, task.busy_reply, True, effects)
                else:
                    self._fail(task, 503, "too many tasks waiting for an engine", effects,
                               self.config.busy_retry_after)
                return
            self._shed(self._tasks[next(reversed(self._sheddable))], effects)
        if self.draining and self._pick(task, ignore_cap=True) is None:
            self._refuse_draining(task, effects)
            return
        self._hold(now, task, self._waiting.setdefault((task.tenant_id, task.model), HeldQueue()))
        if task.criticality is Criticality.SHEDDABLE:
            self._sheddable[task.id] = None
        if not self._served_but_full(task):
            queued = len(self._waiting[(task.tenant_id, task.model)])
            effects.append(TaskQueued(task.tenant_id, task.model, task.id, queued))

    @staticmethod
    def _typed_form_missing(task: _Task) -> str:
        return (f"no engine serving model {task.model!r} can take this request "
                f"(it needs infx's engine agent): {task.request.typed_request_incomplete}")

    def _should_shed(self, task: _Task) -> bool:
        """Whether a task that is about to wait is sheddable and the engines are saturated."""
        if task.criticality is not Criticality.SHEDDABLE:
            return False
        if self._waiting_total >= self.config.max_waiting_tasks:
            return True
        queue = self._waiting.get((task.tenant_id, task.model))
        held = len(queue) if queue is not None else 0
        return held >= self.config.shed_waiting_threshold and self._served_but_full(task)

    def _served_but_full(self, task: _Task) -> bool:
        """Whether the task waits only for room: an engine would take it but for its in-flight
        cap, its runtime's busy back-off or its blocked route."""
        return self._pick(task, ignore_cap=True) is not None

    def _held_back(self, task: _Task, engine: _Engine, may_use_reserve: bool) -> bool:
        """What the routing policy must not choose for ``task``: an engine that is full, busy
        or blocked, or that cannot take the task's request in any form."""
        return self._blocked(engine, False, may_use_reserve) or not task_forms.eligible(task.request, engine.status)

    def _pick(self, task: _Task, ignore_cap: bool = False, use_reserve: bool = False) -> _Engine | None:
        """The engine ``task`` goes to now, or None; ``ignore_cap``: one that serves it, full
        or not; ``use_reserve``: one with a reserved slot even if its caller may not take it."""
        policy = self.config.routing.policy
        reserve = ignore_cap or use_reserve or self._may_use_reserve(task)
        if not ignore_cap and policy is not RoutingPolicy.LEAST_IN_PROGRESS and \
                (task.hints is not None or policy is RoutingPolicy.ROUND_ROBIN):
            key = self._router.choose(task.tenant_id, task.model, task.hints, task.avoid,
                                      lambda key: self._held_back(task, self._engines[key], reserve))
            if key is not None or not self.config.dynamic_model_loading:
                return None if key is None else self._engines[key]
        best: _Engine | None = None
        best_rank: tuple[bool, bool, int, str] | None = None
        for engine in self._ready_engines(task.tenant_id, task.model):
            if not engine.routable or self._blocked(engine, ignore_cap, reserve):
                continue
            if not task_forms.eligible(task.request, engine.status):
                continue
            rank = (
                engine.key.engine_id in task.avoid,
                engine.locality is not Locality.LOCAL,
                len(engine.in_flight),
                engine.key.engine_id,
            )
            if best_rank is None or rank < best_rank:
                best, best_rank = engine, rank
        if best is None and self.config.dynamic_model_loading:
            # Any engine may load the model: this one scan is over every engine of the tenant.
            for engine in self._by_tenant.get(task.tenant_id, {}).values():
                if not engine.routable or self._blocked(engine, ignore_cap, reserve):
                    continue
                if not task_forms.eligible(task.request, engine.status):
                    continue
                rank = (engine.key.engine_id in task.avoid, False, len(engine.ready_models), engine.key.engine_id)
                if best_rank is None or rank < best_rank:
                    best, best_rank = engine, rank
        return best

    def _dispatch(self, now: float, task: _Task, engine: _Engine, effects: list[Effect]) -> None:
        self._move(task, TaskState.DISPATCHED)
        task.engine = engine.key
        task.reported_engine_id = engine.status.engine_id
        task.route = engine.route
        task.next_index = 0
        task.attempt += 1
        retried = task.attempts.sent()
        if retried is not None:
            self.counters.retries[retried.value] += 1
        task.wire_id = self._attempt_id(task)
        self._attempts[task.wire_id] = task
        engine.in_flight.add(task.id)
        task.holds_slot = True
        self._shares.dispatched(task.tenant_id, task.model, task.flow, task.weight)
        self._shares_changed(task)
        tip = self._router.task_sent(engine.key, task.model, task.hints, task.request.infx_prefix_tip)
        self._set_timer(task, task.deadline)
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
        effects.append(SendTask(engine.route, engine.key, wire))

    def _dispatch_waiting(self, now: float, engine: _Engine, effects: list[Effect]) -> None:
        tenant_id = engine.key.tenant_id
        for model, targeted in list(self._waiting_on.get(engine.key, {}).items()):
            self._dispatch_targeted(now, engine, model, targeted, effects)
        if self.config.dynamic_model_loading:
            keys = [key for key in self._waiting if key[0] == tenant_id]
        else:
            # In the order the queues formed, not the frozenset's (hash-seeded) order, so that the
            # same inputs dispatch the same way in every process (the simulation replays seeds).
            keys = [key for key in self._waiting if key[0] == tenant_id and key[1] in engine.ready_models]
        for key in keys:
            self._dispatch_queue(now, key, effects)

    def _dispatch_targeted(
        self, now: float, engine: _Engine, model: str, targeted: HeldQueue, effects: list[Effect],
        before_local: bool = True,
    ) -> None:
        """Peers' tasks for ``model`` waiting for ``engine`` take its free slots, in their turn
        among this gateway's own tasks waiting for the model: a local task that comes first
        (more critical, or of a caller holding fewer slots per weight) goes first, wherever
        it finds room (``before_local``: unless the local ones just found none)."""
        key = (engine.key.tenant_id, model)
        served = self._served_for(key)
        while targeted and (task_id := targeted.peek(served)) is not None:
            task = self._tasks[task_id]
            local = self._waiting.get(key) if before_local else None
            first = None if local is None else local.peek(served)
            if first is not None and self._comes_before(self._tasks[first], task):
                target = self._pick(self._tasks[first])
                if target is not None:
                    self._unwait(self._tasks[first], served=True)
                    self._dispatch(now, self._tasks[first], target, effects)
                    continue
            if self._full(engine, self._may_use_reserve(task)):
                break  # the least served flow waits; nobody else may take the slot before it
            self._unwait(task, served=True)
            self._dispatch(now, task, engine, effects)

    def _comes_before(self, task: _Task, other: _Task) -> bool:
        """Whether ``task`` takes a slot before ``other`` (both waiting for its model): more
        critical, or as critical and of a caller holding fewer slots per weight."""
        served = self._shares.served
        return (task.criticality.rank, served(task.tenant_id, task.model, task.flow)) < \
            (other.criticality.rank, served(other.tenant_id, other.model, other.flow))

    def _dispatch_queue(self, now: float, key: tuple[str, str], effects: list[Effect]) -> None:
        """Tasks waiting in the queue of (tenant, model) go to any engine with room, in their turn."""
        queue = self._waiting.get(key)
        while queue is not None and (task_id := queue.peek(self._served_for(key))) is not None:
            task = self._tasks[task_id]
            target = self._pick(task)
            if target is None and task.request.typed_request_incomplete:
                if self._no_engine_takes_it(task):
                    self._fail(task, 400, self._typed_form_missing(task), effects)
                else:
                    # The head waits for an engine that takes its verbatim form; a task
                    # behind it may take this one's typed form now.
                    task, target = self._typed_taker(queue, task)
                    if target is None:
                        break
                    self._unwait(task, served=True)
                    self._dispatch(now, task, target, effects)
                queue = self._waiting.get(key)
                continue
            if target is None and not self._may_use_reserve(task) and self._reserve_wanted_below(queue, key):
                target = self._pick(task, use_reserve=True)
            if target is None:
                break
            self._unwait(task, served=True)
            self._dispatch(now, task, target, effects)
            queue = self._waiting.get(key)

    def _typed_taker(self, queue: HeldQueue, head: _Task) -> tuple[_Task, _Engine | None]:
        """While ``head`` waits for an engine that takes its verbatim form, the task with a typed
        form that takes a free slot now, and its engine: the most critical (the oldest within a
        band), on a reserved slot its caller may not take if a less critical one's may (as
        :meth:`_reserve_wanted_below`); else (``head``, None)."""
        typed = sorted((t for t in map(self._tasks.__getitem__, queue) if not t.request.typed_request_incomplete),
                       key=lambda t: t.criticality.rank)
        taker = next((t for t in typed if self._pick(t) is not None), None)
        if taker is None:
            return head, None
        if typed[0].criticality.rank < taker.criticality.rank:
            return typed[0], self._pick(typed[0], use_reserve=True)
        return taker, self._pick(taker)

    def _reserve_wanted_below(self, queue: HeldQueue, key: tuple[str, str]) -> bool:
        """Whether the head of a lower criticality band than the queue's head may take the
        reserved slots the head may not (its caller holds the fewest), and finds one: then the
        head takes it, as criticality comes first, rather than leave it idle while both wait."""
        for task_id in itertools.islice(queue.heads(self._served_for(key)), 1, None):
            task = self._tasks[task_id]
            if self._may_use_reserve(task) and self._pick(task) is not None:
                return True
        return False

    def _refill(self, now: float, effects: list[Effect]) -> None:
        """Give the slots freed during this input to waiting tasks (only an in-flight cap
        can keep a task waiting while an engine serves its model, so only then is there work),
        and retry those of a model whose slots held changed when that made a waiting caller
        the least served, who may take an engine's reserved slots (``_reshuffled``)."""
        while self._freed or self._reshuffled:
            if self._freed:
                freed = next(iter(self._freed))
                del self._freed[freed]
                engine = self._engines.get(freed)
                if engine is not None and engine.routable:
                    self._dispatch_waiting(now, engine, effects)
                continue
            key = next(iter(self._reshuffled))
            del self._reshuffled[key]
            takers = self._shares.least_served_waiting(*key)
            before = self._reserve_takers.pop(key, frozenset())
            if takers:
                self._reserve_takers[key] = takers
            if not takers - before:
                continue  # no waiting caller may take a reserved slot it could not before
            tenant_id, model = key
            # This gateway's tasks first: then none of them can take a slot a peer's task may.
            self._dispatch_queue(now, key, effects)
            for engine_key, queues in list(self._waiting_on.items()):
                held = queues.get(model) if engine_key.tenant_id == tenant_id else None
                engine = self._engines.get(engine_key)
                if held is not None and engine is not None and engine.routable and not self._full(engine):
                    self._dispatch_targeted(now, engine, model, held, effects, before_local=False)
