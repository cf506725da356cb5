"""Engines joining, changing and leaving: registration, id clashes, removal with fail-over,
closed routes, go-away and heartbeats; pure, no I/O, no clock reads.

Rules this file keeps: an engine leaves routing before its tasks fail over (:meth:`Membership.remove`),
so that no task fails over onto an engine that is going away with them; every accepted peer hears
which engines went (``EnginesRemoved``); a change to a local engine is re-reported to peers
(``LocalEnginesChanged``). A local engine's id is one engine process's: a status on a new route
that names another process (``infx_instance``) is a clash, refused and probed
(:meth:`Membership.update`, see ``Processor.update_engine``).
"""

from __future__ import annotations

from protocol.openai import task_forms
from protocol.pb import status_pb2, worker_pb2
from protocol.processor.attempts import AttemptFailure
from protocol.processor.control import ControlKind, ControlTasks
from protocol.processor.counters import ProcessorCounters
from protocol.processor.dispatcher import TaskDispatcher
from protocol.processor.endings import Endings
from protocol.processor.engines import EngineRecord, EngineTable
from protocol.processor.retries import Retries
from protocol.processor.route_flow import RouteFlow
from protocol.processor.tasks import ON_ENGINE, TaskRecord, TaskTable
from protocol.processor.config import ProcessorConfig
from protocol.processor.effects import CloseEngine, Effect, EnginesRemoved, LocalEnginesChanged, RefuseEngine
from protocol.processor.keys import EngineKey, Locality, Route
from protocol.routing.router import Router

__all__ = ["Membership"]


class Membership:
    """Which engines the processor routes to, as they come, change and go."""

    def __init__(self, config: ProcessorConfig, counters: ProcessorCounters, tasks: TaskTable, engines: EngineTable,
                 router: Router, flow: RouteFlow, control: ControlTasks, endings: Endings, dispatcher: TaskDispatcher,
                 retries: Retries) -> None:
        self.config = config
        self.counters = counters
        self._tasks = tasks
        self._engines = engines
        self._router = router
        self._flow = flow
        self._control = control
        self._endings = endings
        self._dispatcher = dispatcher
        self._retries = retries

    def update(self, route: Route, key: EngineKey, status: status_pb2.EngineStatus, locality: Locality,
               now: float) -> list[Effect]:
        """Add engine ``key`` or take its new status (see ``Processor.update_engine``)."""
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
            self._endings.fail_waiting_on(key, "no longer takes verbatim requests", effects,
                                          lambda task: not task_forms.eligible(task.request, snapshot))
        if engine is None:
            engine = EngineRecord(key=key, route=route, locality=locality, status=snapshot)
            self._engines.add(engine)
            changed, was_local = True, False
        else:
            changed = engine.status != snapshot or engine.locality is not locality
            was_local = engine.locality is Locality.LOCAL
            if engine.route != route:
                engine.route = route
                self._router.stream_changed(key)
                engine.draining = False
                engine.pending_heartbeat = None
                engine.missed_heartbeats = 0
                self._control.probes.pop(key, None)  # it reconnected: alive, and its old stream's heartbeat is moot
            engine.locality = locality
            engine.status = snapshot
        self._engines.index(engine, frozenset(m.id for m in snapshot.models),
                            frozenset(m.id for m in snapshot.models if m.is_ready))
        self._router.engine_updated(key, engine.ready_models if engine.routable else frozenset(), snapshot,
                                    locality is Locality.LOCAL)
        if changed and (was_local or locality is Locality.LOCAL):
            effects.append(LocalEnginesChanged())
        control = self._control
        if locality is Locality.LOCAL and self.config.heartbeat_interval is not None and control.next_heartbeat is None:
            control.next_heartbeat = now + self.config.heartbeat_interval
        if engine.routable:
            self._dispatcher.dispatch_waiting(now, engine, effects)
        else:
            self._endings.fail_waiting_on(key, "is no longer ready", effects)
        return effects

    def _clash(self, now: float, holder: EngineRecord, route: Route) -> list[Effect]:
        """Another engine process claims ``holder``'s id on ``route``: refuse it, and check that
        the holder is alive (see ``Processor.update_engine``)."""
        self.counters.engine_id_clashes += 1
        key = holder.key
        reason = (f"engine id {key.engine_id!r} (tenant {key.tenant_id!r}) is already connected to this gateway "
                  f"from another engine process; give each engine its own --engine-id")
        effects: list[Effect] = [RefuseEngine(route, key, reason)]
        if key not in self._control.probes:
            self._control.probes[key] = now + self.config.clash_probe_timeout
            if holder.pending_heartbeat is None:
                send = self._control.heartbeat(key, holder.status.engine_id, holder.route)
                holder.pending_heartbeat = send.task.id
                effects.append(send)
        return effects

    def remove(
        self, now: float, engines: list[EngineRecord], reason: str, effects: list[Effect], closing: Route = None
    ) -> None:
        """Take ``engines`` out of routing first, then fail over their tasks, so
        that no task fails over onto an engine that is going away with them.

        A task sent on a route other than ``closing`` (the route that is ending,
        if any) is cancelled there first: that stream may still be open (an
        older stream of the engine, a peer that reported the engine gone), and
        the abandoned attempt must not run on for nobody. Then every accepted peer is
        told which engines went (``EnginesRemoved``), so that one whose peer
        reported them while they were registered here may register them now.
        """
        lost: list[tuple[EngineRecord, TaskRecord]] = []
        for engine in engines:
            self._engines.remove(engine)
            self._router.engine_removed(engine.key)
            self._control.forget_engine(engine.key)
            if engine.locality is Locality.LOCAL:
                effects.append(LocalEnginesChanged())
            self._endings.fail_waiting_on(engine.key, f"was removed ({reason})", effects)
            lost += [(engine, self._tasks[task_id]) for task_id in sorted(engine.in_flight)]
        for engine, task in lost:
            if task.route != closing:
                self._endings.stop_on_engine(task, effects)
            self._retries.engine_lost(now, task, AttemptFailure.ENGINE_LOST,
                                      f"engine {engine.key.engine_id!r} removed: {reason}", effects)
        if engines:
            effects.append(EnginesRemoved(tuple(engine.key for engine in engines)))

    def close_route(self, now: float, route: Route, reason: str, effects: list[Effect]) -> None:
        """``route``'s stream ended: its engines go, and the tasks sent on it fail over."""
        self._flow.unblock(route)
        self.remove(now, self._engines.on_route(route), reason, effects, closing=route)
        for task in [t for t in self._tasks.values() if t.state in ON_ENGINE and t.route == route]:
            engine_id = task.engine.engine_id if task.engine else ""
            self._retries.engine_lost(now, task, AttemptFailure.ENGINE_LOST,
                                      f"stream of engine {engine_id!r} closed: {reason}", effects)
        self._control.forget_route(route)

    def go_away(self, effects: list[Effect]) -> None:
        """Ask every local engine to reconnect; they get no new tasks on this route."""
        for engine in self._engines.local():
            engine.draining = True
            self._endings.fail_waiting_on(engine.key, "is going away", effects)
            self._router.engine_updated(engine.key, frozenset(), engine.status, True)
            request = worker_pb2.TaskRequest(go_away=worker_pb2.GoAwayRequest())
            effects.append(self._control.send(ControlKind.GO_AWAY, engine.key, engine.status.engine_id,
                                              engine.route, request))

    def heartbeat_round(self, now: float, effects: list[Effect]) -> None:
        """Heartbeat every local engine; one that missed ``heartbeat_max_missed`` in a row is closed."""
        interval = self.config.heartbeat_interval
        assert interval is not None
        for engine in self._engines.local():
            if engine.pending_heartbeat is not None:
                self._control.discard(engine.pending_heartbeat)
                engine.pending_heartbeat = None
                engine.missed_heartbeats += 1
                self.counters.heartbeats_missed += 1
                if engine.missed_heartbeats >= self.config.heartbeat_max_missed:
                    reason = f"missed {engine.missed_heartbeats} heartbeats"
                    effects.append(CloseEngine(engine.route, engine.key, reason))
                    self.remove(now, [engine], reason, effects, closing=engine.route)
                    continue
            send = self._control.heartbeat(engine.key, engine.status.engine_id, engine.route)
            engine.pending_heartbeat = send.task.id
            effects.append(send)
        has_local = any(e.locality is Locality.LOCAL for e in self._engines.values())
        self._control.next_heartbeat = now + interval if has_local else None

    def probes_unanswered(self, now: float, effects: list[Effect]) -> None:
        """A probed engine that did not answer its heartbeat in time is taken for a dead stream
        and closed, so that the engine process that claimed its id gets in."""
        probes = self._control.probes
        for key, due in [(key, due) for key, due in probes.items() if due <= now]:
            del probes[key]
            holder = self._engines[key]
            reason = f"no answer to a heartbeat within {self.config.clash_probe_timeout:g}s of another engine " \
                     "claiming its id"
            effects.append(CloseEngine(holder.route, key, reason))
            self.remove(now, [holder], reason, effects, closing=holder.route)
