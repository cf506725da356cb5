"""The processor's own tasks to engines (heartbeats, go-aways, cancels) and what heartbeats
watch for: missed answers and clash probes; pure, no I/O, no clock reads.

Rules this file keeps: a control task's id starts with ``ProcessorConfig.control_task_prefix``
(callers may not use it), and its reply is consumed here (:meth:`ControlTasks.replied`),
never delivered to anyone. A control task whose engine or route goes is forgotten with it.

Heartbeats (``heartbeat_interval``): every local engine is sent one per round; one left
unanswered at the next round is missed, and an engine that misses ``heartbeat_max_missed`` in
a row is closed (the round itself is the processor's: closing an engine fails over its
tasks). Clash probes: when another engine process claims a local engine's id, the holder is
sent a heartbeat and must answer by ``probes[key]`` (see ``Processor.update_engine``).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from protocol.pb import worker_pb2
from protocol.processor.engines import EngineTable
from protocol.processor.types import EngineKey, Route, SendTask

__all__ = ["ControlKind", "ControlTask", "ControlTasks"]


class ControlKind(Enum):
    """What a control task asks of its engine."""

    HEARTBEAT = "heartbeat"
    GO_AWAY = "go_away"
    CANCEL = "cancel"


@dataclass(slots=True)
class ControlTask:
    """A task the processor sent on its own; its reply is consumed here."""

    kind: ControlKind
    engine: EngineKey
    route: Route


class ControlTasks:
    """Control tasks in flight by id, the next heartbeat round and the engines being probed."""

    def __init__(self, prefix: str, engines: EngineTable) -> None:
        self.prefix = prefix
        self._engines = engines
        self._by_id: dict[str, ControlTask] = {}
        self._seq = 0
        #: When the next heartbeat round is due (None: no local engine, or no heartbeats).
        self.next_heartbeat: float | None = None
        #: Local engines another engine process claimed the id of, and when their answer to a
        #: heartbeat is due.
        self.probes: dict[EngineKey, float] = {}

    def __contains__(self, control_id: object) -> bool:
        return control_id in self._by_id

    def get(self, control_id: str) -> ControlTask | None:
        return self._by_id.get(control_id)

    def items(self) -> list[tuple[str, ControlTask]]:
        return list(self._by_id.items())

    def send(self, kind: ControlKind, engine: EngineKey, reported_id: str, route: Route,
             request: worker_pb2.TaskRequest) -> SendTask:
        """A task of the processor's own to ``engine``, which reports ``reported_id`` on ``route``."""
        self._seq += 1
        control_id = f"{self.prefix}{kind.value}-{self._seq}"
        self._by_id[control_id] = ControlTask(kind, engine, route)
        wire = worker_pb2.Task(id=control_id, request=request, engine_id=reported_id)
        return SendTask(route, engine, wire)

    def heartbeat(self, engine: EngineKey, reported_id: str, route: Route) -> SendTask:
        """A heartbeat to ``engine`` on ``route``."""
        request = worker_pb2.TaskRequest(heartbeat=worker_pb2.HeartbeatRequest())
        return self.send(ControlKind.HEARTBEAT, engine, reported_id, route, request)

    def discard(self, control_id: str) -> None:
        """Stop waiting for ``control_id``'s reply (it was not sent, or no longer matters)."""
        self._by_id.pop(control_id, None)

    def replied(self, control_id: str, control: ControlTask) -> None:
        """``control_id``'s engine answered: a heartbeat proves it alive."""
        del self._by_id[control_id]
        if control.kind is ControlKind.HEARTBEAT:
            self.probes.pop(control.engine, None)  # alive: an engine that claimed its id was refused rightly
            engine = self._engines.get(control.engine)
            if engine is not None and engine.pending_heartbeat == control_id:
                engine.pending_heartbeat = None
                engine.missed_heartbeats = 0

    def forget_engine(self, key: EngineKey) -> None:
        """``key`` left: its control tasks and its probe with it."""
        for control_id in [c for c, ctl in self._by_id.items() if ctl.engine == key]:
            del self._by_id[control_id]
        self.probes.pop(key, None)

    def forget_route(self, route: Route) -> None:
        """``route`` closed: no reply will come on it."""
        for control_id in [c for c, ctl in self._by_id.items() if ctl.route == route]:
            del self._by_id[control_id]
