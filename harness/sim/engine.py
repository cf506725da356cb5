"""A simulated engine: the real :class:`~protocol.agent.core.EngineAgentCore` with a scripted runtime.

Rules this file keeps: the core decides everything; this file performs its
effects in order the way ``infx/agent/engine.py`` does (one gRPC connection per
``OpenStream(new_connection=True)``, a connection closed once its streams
have ended, results of unknown streams dropped). The runtime is scripted:
echo-like results whose content names their task and index (so a result
delivered to the wrong request or out of place is visible), with latencies,
errors and stalls drawn from the simulation's RNG.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING

from harness.sim.gateway import PROCESS_TASKS, engine_key
from harness.sim.wire import GrpcEnd
from protocol.agent.core import AgentState, EngineAgentCore, GatewayProtocolError
from protocol.agent.effects import (
    AbortTask,
    AgentConfig,
    CloseStream,
    Effect,
    OpenStream,
    SendResult,
    SendStatus,
    StartTask,
    Stopped,
)
from protocol.grpc import (
    CallEnded,
    Event,
    GrpcConfig,
    LocalProtocolError,
    MessageReceived,
    ResponseHeadersReceived,
)
from protocol.pb import status_pb2, worker_pb2
from protocol.exchange.accepted_peer import peer_engine_id
from protocol.processor.requests import is_streaming

if TYPE_CHECKING:
    from harness.sim.cluster import Cluster

ENGINE_GRPC = GrpcConfig(client_side=True, keepalive_interval=5.0, keepalive_timeout=4.0)


@dataclass(eq=False)
class _SimTask:
    task: worker_pb2.Task
    aborted: bool = False
    emitted: int = 0


class ScriptedRuntime:
    """Runs tasks as timed, seeded result scripts; ``live`` counts tasks not finished or aborted."""

    def __init__(self, engine: EngineNode) -> None:
        self.engine = engine
        self.live: dict[str, _SimTask] = {}

    def start(self, task: worker_pb2.Task) -> None:
        cluster = self.engine.cluster
        rng = cluster.rng
        run = _SimTask(task)
        self.live[task.id] = run
        faulty = cluster.faults.active
        roll = rng.random()
        delay = rng.uniform(*cluster.config.runtime_delay)
        if faulty and roll < 0.05:
            delay = rng.uniform(2.0, 15.0)  # a stall: deadlines expire, clients give up
            cluster.stats["runtime_stalls"] += 1
        script: list[tuple[float, worker_pb2.TaskResult]] = []
        if faulty and roll > 0.95:
            code = 503 if roll > 0.975 else 500
            cluster.stats[f"runtime_{code}"] += 1
            response = worker_pb2.HttpResponse(status_code=code, status=str(code), body=b'{"error":{}}')
            script.append((delay, worker_pb2.TaskResult(http_response=response)))
        else:
            # The body and events name the client request (not the attempt): the client checks them.
            request_id = cluster.ledger.request_id(task.id)
            response = worker_pb2.HttpResponse(status_code=200, status="200 OK", body=request_id.encode())
            if is_streaming(task.request):
                response.body = b""
            script.append((delay, worker_pb2.TaskResult(http_response=response)))
            if is_streaming(task.request):
                events = rng.randint(1, 4)
                for index in range(1, events + 1):
                    last = index == events
                    data = b"" if last and rng.random() < 0.3 else f"data: {request_id}:{index}\n\n".encode()
                    event = worker_pb2.ServerSentEvent(data=data, is_last_event=last)
                    script.append((rng.uniform(0.005, 0.2), worker_pb2.TaskResult(server_sent_event=event)))
        when = cluster.scheduler.now
        for position, (gap, result) in enumerate(script):
            when += gap
            last = position == len(script) - 1
            cluster.scheduler.at(when, partial(self._emit, run, result, last), "runtime")

    def abort(self, task_id: str) -> None:
        run = self.live.pop(task_id, None)
        if run is not None:
            run.aborted = True

    def _emit(self, run: _SimTask, result: worker_pb2.TaskResult, last: bool) -> None:
        engine = self.engine
        if run.aborted or engine.runtime is not self:
            return
        core = engine.core
        run.emitted += 1
        sent = core.send_result(run.task.id, result)
        if sent is not None:
            engine.perform([sent])
        if last:
            self.live.pop(run.task.id, None)
            engine.perform(core.finish_task(run.task.id, engine.cluster.scheduler.now))
        engine.flush()


class EngineNode:
    """One engine process: its agent core, runtime and connections to a gateway."""

    def __init__(self, cluster: Cluster, engine_id: str, tenant: str, models: tuple[str, ...],
                 max_concurrency: int, home: str | None = None) -> None:
        self.cluster = cluster
        self.engine_id = engine_id
        self.tenant = tenant
        self.models = models
        self.name = f"{tenant}/{engine_id}"
        self.max_concurrency = max_concurrency
        self.ready_override = True
        #: Processes started for this engine so far: each draws its own instance token.
        self.processes = 0
        self.core = self._new_core()
        self.runtime = ScriptedRuntime(self)
        # core stream id -> (connection, gRPC stream id)
        self.streams: dict[int, tuple[GrpcEnd, int]] = {}
        #: Open connections (a dict: insertion order), and those with commands not yet flushed.
        self.ends: dict[GrpcEnd, None] = {}
        self.pending: dict[GrpcEnd, None] = {}
        #: The gateway the first connection dials (then wherever the load balancer sends it).
        self.home = home
        self.current: GrpcEnd | None = None
        self.gateway_of: dict[GrpcEnd, str] = {}
        self.restart_pending = False
        #: The process is gone (crashed) until ``restart``: nothing of it runs.
        self.crashed = False

    def name_at(self, gateway: str) -> str:
        """What ``gateway`` names this engine now: its id where it is attached, else its id scoped
        by the gateway it is attached to (``protocol.exchange.accepted_peer.peer_engine_id``)."""
        attached = self.gateway_of.get(self.current) if self.current is not None else None
        return self.engine_id if attached in (None, gateway) else peer_engine_id(self.engine_id, attached)

    def _new_core(self) -> EngineAgentCore:
        # A restarted process is another instance: while its old stream lingers (half-open), the
        # gateway refuses it and probes the old one (protocol/processor/core.py, engine identity).
        self.processes += 1
        return EngineAgentCore(AgentConfig(
            engine_id=self.engine_id, models=self.models, max_concurrency=self.max_concurrency,
            instance=f"{self.name}#{self.processes}",
            status_interval=10.0, status_min_interval=0.1, reconnect_initial=0.3, reconnect_max=3.0,
            go_away_linger=2.0,
        ))

    # -- life ---------------------------------------------------------------------------

    def start(self) -> None:
        if self.crashed or self.core.state is not AgentState.IDLE:
            return  # crashed or restarted before its first start came round
        self.perform(self.core.start(self.cluster.scheduler.now))
        self.flush()

    def crash(self) -> None:
        """The process dies at once: its connections drop, its tasks are lost with it."""
        self.crashed = True
        for end in list(self.ends):
            end.abandon()
            end.link.reset(f"engine {self.name} crashed")
        self.gateway_of.clear()
        self.streams.clear()
        self.current = None
        self.runtime = ScriptedRuntime(self)
        self.cluster.scheduler.arm((self, "core"), None, self._on_timer)

    def restart(self) -> None:
        """A new process for the same engine: new core, new runtime, new connections."""
        self.crashed = False
        self.restart_pending = False
        for end in self.ends:
            if not end.closed:
                end.conn.go_away(now=self.cluster.scheduler.now)
        self.flush()
        self.core = self._new_core()
        self.runtime = ScriptedRuntime(self)
        self.streams.clear()
        self.current = None
        self.start()

    def shutdown(self, grace: float) -> None:
        if self.core.state is AgentState.RUNNING:
            self.perform(self.core.shutdown(grace, self.cluster.scheduler.now))
            self.flush()

    @property
    def up(self) -> bool:
        return not self.crashed and self.core.state is AgentState.RUNNING and self.ready_override

    def set_ready(self, ready: bool) -> None:
        """Flip what the engine reports as its readiness (a runtime loading or unloading)."""
        if ready == self.ready_override:
            return
        self.ready_override = ready
        stream = self.core.current_stream
        if stream is not None:
            self._send(stream, worker_pb2.ProcessTasksRequest(engine_status=self.core.engine_status()))
        self.flush()

    # -- effects (infx.agent.engine.EngineAgent._perform) ------------------------------------------

    def perform(self, effects: list[Effect]) -> None:
        self.cluster.checks.engine_touched(self)
        for effect in effects:
            if isinstance(effect, SendResult):
                self._send(effect.stream_id, worker_pb2.ProcessTasksRequest(task_result=effect.result))
            elif isinstance(effect, SendStatus):
                self._send(effect.stream_id, worker_pb2.ProcessTasksRequest(engine_status=effect.status))
            elif isinstance(effect, StartTask):
                self.runtime.start(effect.task)
            elif isinstance(effect, AbortTask):
                self.runtime.abort(effect.task_id)
            elif isinstance(effect, OpenStream):
                self._open(effect.stream_id, effect.new_connection)
            elif isinstance(effect, CloseStream):
                entry = self.streams.get(effect.stream_id)
                if entry is not None:
                    try:
                        entry[0].conn.end_stream(entry[1])
                    except LocalProtocolError:
                        pass
            elif isinstance(effect, Stopped):
                self.cluster.stats["engine_drains"] += 1
                for end in self.ends:
                    if not end.closed and end.conn.active_calls == 0:
                        end.conn.go_away(now=self.cluster.scheduler.now)
                if self.restart_pending:
                    self.cluster.scheduler.after(self.cluster.rng.uniform(0.2, 2.0), self.restart, "engine-restart")

    def _send(self, stream_id: int, message: worker_pb2.ProcessTasksRequest) -> None:
        entry = self.streams.get(stream_id)
        if entry is None:
            return
        if message.HasField("engine_status") and not self.ready_override:
            status = status_pb2.EngineStatus()
            status.CopyFrom(message.engine_status)
            status.ready = False
            message = worker_pb2.ProcessTasksRequest(engine_status=status)
        end, grpc_stream = entry
        try:
            end.conn.send_message(grpc_stream, message.SerializeToString())
        except LocalProtocolError:
            pass  # the call ended: its CallEnded reaches the core

    def _open(self, stream_id: int, new_connection: bool) -> None:
        cluster = self.cluster
        if new_connection or self.current is None or self.current.closed:
            previous = self.current
            home, self.home = self.home, None
            gateway = home if home is not None and cluster.gateways[home].alive else cluster.pick_gateway()
            link = cluster.new_link(f"{self.name}->{gateway}")
            end = GrpcEnd(cluster.scheduler, link, 0, ENGINE_GRPC, self._events, self.flush, self.pending,
                          self._end_gone)
            self.ends[end] = None
            self.gateway_of[end] = gateway
            cluster.accept(gateway, link)
            self.current = end
            if previous is not None and not previous.closed and not self._streams_on(previous):
                previous.conn.go_away(now=cluster.scheduler.now)
        end = self.current
        try:
            grpc_stream = end.conn.start_call(PROCESS_TASKS, (("authorization", engine_key(self.tenant)),),
                                              now=cluster.scheduler.now)
        except LocalProtocolError:
            # The connection is already gone: the stream fails at once, as a failed call would.
            cluster.scheduler.at(cluster.scheduler.now, partial(self._stream_failed, self.core, stream_id),
                                 "stream-failed")
            return
        self.streams[stream_id] = (end, grpc_stream)

    def _end_gone(self, end: GrpcEnd) -> None:
        self.ends.pop(end, None)
        self.gateway_of.pop(end, None)

    def _streams_on(self, end: GrpcEnd) -> bool:
        return any(e is end for e, _ in self.streams.values())

    def _stream_failed(self, core: EngineAgentCore, stream_id: int) -> None:
        if core is not self.core or self.crashed:
            return  # that process is gone
        self.perform(self.core.stream_closed(stream_id, self.cluster.rng.random(), self.cluster.scheduler.now))
        self.flush()

    # -- the connection's events -------------------------------------------------------

    def _events(self, end: GrpcEnd, events: list[Event]) -> None:
        now = self.cluster.scheduler.now
        for event in events:
            if isinstance(event, (ResponseHeadersReceived, MessageReceived, CallEnded)):
                stream_id = next((s for s, (e, g) in self.streams.items() if e is end and g == event.stream_id), None)
                if stream_id is None:
                    continue
                if isinstance(event, ResponseHeadersReceived):
                    self.core.stream_confirmed(stream_id)
                elif isinstance(event, MessageReceived):
                    end.conn.acknowledge(event.stream_id, event.flow_controlled_length)
                    message = worker_pb2.ProcessTasksResponse.FromString(event.data)
                    if message.HasField("new_task"):
                        self._task_received(now, stream_id, message.new_task)
                else:
                    del self.streams[stream_id]
                    if end is not self.current and not self._streams_on(end) and not end.closed:
                        end.conn.go_away(now=self.cluster.scheduler.now)
                    self.perform(self.core.stream_closed(stream_id, self.cluster.rng.random(), now))

    def _task_received(self, now: float, stream_id: int, task: worker_pb2.Task) -> None:
        if task.request.WhichOneof("request") in ("chat_completion", "embedding"):
            self.cluster.ledger.task_sent(task, self.tenant, f"engine {self.name}")
            self.cluster.stats["tasks_run"] += 1
        try:
            effects = self.core.task_received(stream_id, task, now)
        except GatewayProtocolError:
            self.cluster.stats["engine_protocol_errors"] += 1
            return
        self.perform(effects)

    # -- time and flushing ------------------------------------------------------------

    def flush(self) -> None:
        if self.crashed:
            return
        self.cluster.checks.engine_touched(self)
        pending = self.pending
        while pending:
            next(iter(pending)).flush()  # takes itself out of ``pending``
        self.cluster.scheduler.arm((self, "core"), self.core.next_deadline(), self._on_timer, "engine-timer")

    def _on_timer(self) -> None:
        if self.crashed:
            return
        self.perform(self.core.handle_timeout(self.cluster.scheduler.now))
        self.flush()

    def __repr__(self) -> str:
        return f"<Engine {self.name}>"
