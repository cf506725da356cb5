"""The engine agent on Twisted: performs the effects of :class:`protocol.agent.core.EngineAgentCore`.

Rules this file keeps: no bookkeeping of its own beyond handles (which call
object is stream 3, which runtime handle is task "t-1"); every decision
(what to answer, which stream, when to report, when to reconnect) is the
pure core's. The clock, the channel factory and the runtime are passed in;
one ``callLater`` is armed from ``next_deadline()``; effects are performed
in the order the core returned them, through one queue, so that a runtime
answering synchronously cannot reorder them.

The gRPC stream is ``InferenceWorkerService/ProcessTasks`` on LLMariner's
wire: we send ``ProcessTasksRequest`` (status, results) and receive
``ProcessTasksResponse`` (tasks). Each opened stream of a go-away or a
reconnect gets a fresh channel (a new TCP connection), so that a load
balancer may pick another gateway replica, as LLMariner's engine does; a
channel is closed once its streams have ended.
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from twisted.application.service import Service
from twisted.internet.defer import Deferred, DeferredList, succeed
from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger
from twisted.python.failure import Failure

from infx.agent.runtimes import Runtime, RunningTask, _error_result
from infx.deadline import DeadlineTimer
from infx.transport import ClientCall, GrpcChannel
from protocol.agent.core import (
    AbortTask,
    AgentState,
    CloseStream,
    Effect,
    EngineAgentCore,
    GatewayProtocolError,
    OpenStream,
    SendResult,
    SendStatus,
    StartTask,
    Stopped,
)
from protocol.agent.runtime_load import RuntimeLoad
from protocol.openai.errors import UpstreamError
from protocol.pb import worker_pb2
from protocol.repeats import RepeatKind, RepeatReport, RepeatSuppressor

__all__ = ["PROCESS_TASKS", "EngineAgent"]

PROCESS_TASKS = "/llmariner.inference.server.v1.InferenceWorkerService/ProcessTasks"

log = Logger(namespace="infx.engine")


@dataclass
class _Stream:
    call: ClientCall
    channel: GrpcChannel
    #: The last send that the call could not take at once (its buffers are full).
    backlog: Deferred[None] | None = None


@dataclass
class _ChannelUse:
    streams: int = 0


@dataclass
class _Sink:
    """Reports one task's results to the agent; inert once the task ended."""

    agent: EngineAgent
    task_id: str
    ended: bool = False
    handle: RunningTask | None = field(default=None, repr=False)

    def send(self, result: worker_pb2.TaskResult) -> None:
        if not self.ended:
            self.agent._run(self.agent.core.send_result(self.task_id, result))

    def when_writable(self) -> Deferred[None] | None:
        return None if self.ended else self.agent._when_writable(self.task_id)

    def finish(self) -> None:
        if not self.ended:
            self.ended = True
            self.agent._tasks.pop(self.task_id, None)
            self.agent._run(self.agent.core.finish_task(self.task_id, self.agent.clock.seconds()))


class EngineAgent(Service):
    """Connects to a gateway and serves its tasks on ``runtime`` (a Twisted service).

    ``connect()`` returns a new :class:`GrpcChannel` to the gateway; ``key``
    goes out as ``authorization: Bearer <key>``. ``stopService`` reports
    ready=false and waits for in-flight tasks, up to ``grace`` seconds, then
    closes the streams and their connections. ``jitter()`` gives a number in
    [0, 1) for the reconnect backoff.
    """

    def __init__(
        self,
        clock: IReactorTime,
        core: EngineAgentCore,
        runtime: Runtime,
        connect: Callable[[], GrpcChannel],
        *,
        key: str = "",
        grace: float = 30.0,
        close_timeout: float = 5.0,
        jitter: Callable[[], float] = random.random,
    ) -> None:
        self.clock = clock
        self.core = core
        self.runtime = runtime
        self._connect = connect
        self._metadata: tuple[tuple[str, str], ...] = (("authorization", f"Bearer {key}"),) if key else ()
        self.grace = grace
        self.close_timeout = close_timeout
        self._jitter = jitter
        self._streams: dict[int, _Stream] = {}
        self._channels: dict[GrpcChannel, _ChannelUse] = {}
        self._channel: GrpcChannel | None = None
        self._tasks: dict[str, _Sink] = {}
        self._queue: deque[Effect] = deque()
        self._running_effects = False
        self._timer = DeadlineTimer(clock, self._on_timer)
        self._stopped: Deferred[None] | None = None
        #: A gateway that refuses us (wrong key) or is not there fails every reconnect the same way.
        self._stream_failures = RepeatSuppressor()
        #: Streams the gateway accepted so far: the first is a connect, the others reconnects.
        self._accepted = 0

    # -- service ------------------------------------------------------------------

    def startService(self) -> None:
        super().startService()
        log.info("engine {engine_id} starting", engine_id=self.core.config.engine_id)
        self._run(self.core.start(self.clock.seconds()))

    def stopService(self) -> Deferred[None]:
        super().stopService()
        if self.core.state is AgentState.STOPPED:
            return self._close_channels()
        stopped: Deferred[None] = Deferred()
        self._stopped = stopped
        log.info("engine {engine_id} draining {n} tasks", engine_id=self.core.config.engine_id,
                 n=self.core.in_progress)
        self._run(self.core.shutdown(self.grace, self.clock.seconds()))
        return stopped

    def runtime_changed(self, ready: bool, models: tuple[str, ...]) -> None:
        """The runtime's health check changed its verdict (:mod:`infx.agent.runtime_watch`)."""
        self._run(self.core.runtime_changed(ready, models, self.clock.seconds()))

    def runtime_load_changed(self, load: RuntimeLoad | None) -> None:
        """The runtime's own load changed enough to report (:mod:`infx.agent.runtime_load_watch`)."""
        self._run(self.core.runtime_load_changed(load, self.clock.seconds()))

    # -- effects ------------------------------------------------------------------

    def _run(self, effects: list[Effect]) -> None:
        self._queue.extend(effects)
        if self._running_effects:
            return
        self._running_effects = True
        try:
            while self._queue:
                self._perform(self._queue.popleft())
        finally:
            self._running_effects = False
        self._arm()

    def _perform(self, effect: Effect) -> None:
        if isinstance(effect, SendResult):
            self._send(effect.stream_id, worker_pb2.ProcessTasksRequest(task_result=effect.result))
        elif isinstance(effect, SendStatus):
            self._send(effect.stream_id, worker_pb2.ProcessTasksRequest(engine_status=effect.status))
        elif isinstance(effect, StartTask):
            self._start_task(effect.task)
        elif isinstance(effect, AbortTask):
            sink = self._tasks.pop(effect.task_id, None)
            if sink is not None:
                sink.ended = True
                if sink.handle is not None:
                    sink.handle.abort()
        elif isinstance(effect, OpenStream):
            self._open(effect.stream_id, effect.new_connection)
        elif isinstance(effect, CloseStream):
            stream = self._streams.get(effect.stream_id)
            if stream is not None:
                stream.call.end()
        elif isinstance(effect, Stopped):
            self._finish_stop()

    def _arm(self) -> None:
        self._timer.arm(self.core.next_deadline())

    def _on_timer(self) -> None:
        self._run(self.core.handle_timeout(self.clock.seconds()))

    # -- streams ------------------------------------------------------------------

    def _open(self, stream_id: int, new_connection: bool) -> None:
        if new_connection or self._channel is None:
            previous = self._channel
            self._channel = self._connect()
            self._channels[self._channel] = _ChannelUse()
            if previous is not None and self._channels[previous].streams == 0:
                self._close_channel(previous)
        channel = self._channel
        self._channels[channel].streams += 1
        call = channel.stream(
            PROCESS_TASKS,
            worker_pb2.ProcessTasksRequest.SerializeToString,
            worker_pb2.ProcessTasksResponse.FromString,
            metadata=self._metadata,
        )
        self._streams[stream_id] = _Stream(call, channel)

        def confirmed(_: Any) -> None:
            if call.final is None:
                self.core.stream_confirmed(stream_id)
                self._log_repeats(self._stream_failures.cleared("stream", self.clock.seconds()))
                self._accepted += 1
                log.info("engine {engine_id}: {connected} to the gateway (stream {stream_id})",
                         engine_id=self.core.config.engine_id, stream_id=stream_id,
                         connected="connected" if self._accepted == 1 else "reconnected", event="engine_connected")

        call.initial_metadata().addCallback(confirmed)
        self._read(stream_id, call)

    def _read(self, stream_id: int, call: ClientCall) -> None:
        # Each task as it arrives, without a Deferred per message; then the stream's end.
        call.read_each(lambda message: self._received(stream_id, message)).addCallbacks(
            lambda _: self._ended(stream_id, None),
            lambda failure: self._ended(stream_id, failure),
        )

    def _received(self, stream_id: int, message: worker_pb2.ProcessTasksResponse) -> None:
        if message.HasField("new_task"):
            try:
                effects = self.core.task_received(stream_id, message.new_task, self.clock.seconds())
            except GatewayProtocolError as exc:
                log.warn("engine {engine_id}: {error}", engine_id=self.core.config.engine_id, error=str(exc))
            else:
                self._run(effects)

    def _ended(self, stream_id: int, failure: Failure | None) -> None:
        stream = self._streams.pop(stream_id)
        reason = "ended by the gateway" if failure is None else failure.getErrorMessage()
        self._log_repeats(self._stream_failures.occurred("stream", f"stream closed: {reason}", self.clock.seconds()))
        use = self._channels[stream.channel]
        use.streams -= 1
        if use.streams == 0 and stream.channel is not self._channel:
            self._close_channel(stream.channel)
        self._run(self.core.stream_closed(stream_id, self._jitter(), self.clock.seconds()))

    def _log_repeats(self, reports: list[RepeatReport]) -> None:
        for report in reports:
            emit = log.info if report.kind is RepeatKind.STOPPED else log.warn
            emit("engine {engine_id}: {text}", engine_id=self.core.config.engine_id, text=report.text(),
                 repeat=report.kind.value, count=report.count)

    def _close_channel(self, channel: GrpcChannel) -> Deferred[None]:
        use = self._channels.pop(channel, None)
        if channel is self._channel:
            self._channel = None
        if use is None:
            return succeed(None)
        return channel.close()

    def _send(self, stream_id: int, message: worker_pb2.ProcessTasksRequest) -> None:
        stream = self._streams.get(stream_id)
        if stream is None:
            return
        sent = stream.call.send(message)
        # A failed send shows up as the end of the stream on the read side.
        sent.addErrback(lambda _: None)
        if not sent.called:
            stream.backlog = sent

    def _when_writable(self, task_id: str) -> Deferred[None] | None:
        stream_id = self.core.task_stream(task_id)
        stream = self._streams.get(stream_id) if stream_id is not None else None
        if stream is None or stream.backlog is None or stream.backlog.called:
            return None
        writable: Deferred[None] = Deferred()
        stream.backlog.addBoth(lambda result: (writable.callback(None), result)[1])
        return writable

    # -- tasks --------------------------------------------------------------------

    def _start_task(self, task: worker_pb2.Task) -> None:
        sink = _Sink(self, task.id)
        self._tasks[task.id] = sink
        try:
            handle = self.runtime.start(task, sink)
        except Exception:
            log.failure("engine runtime failed to start task {task_id}", task_id=task.id)
            sink.send(_error_result(UpstreamError("The engine failed to start the task.")))
            sink.finish()
            return
        sink.handle = handle

    # -- stop ---------------------------------------------------------------------

    def _finish_stop(self) -> None:
        log.info("engine {engine_id} drained", engine_id=self.core.config.engine_id)
        self._timer.cancel()
        waiting = [s.call.status() for s in self._streams.values()]
        ended: Deferred[Any] = DeferredList(waiting) if waiting else succeed(None)
        guard = self.clock.callLater(self.close_timeout, ended.cancel) if waiting else None

        def close(_: Any) -> Deferred[None]:
            if guard is not None and guard.active():
                guard.cancel()
            return self._close_channels()

        ended.addBoth(close)
        stopped = self._stopped
        if stopped is not None:
            self._stopped = None
            ended.chainDeferred(stopped)

    def _close_channels(self) -> Deferred[None]:
        closing = [self._close_channel(channel) for channel in list(self._channels)]
        done: Deferred[Any] = DeferredList(closing)
        return done.addCallback(lambda _: None)
