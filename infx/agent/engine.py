"""The engine agent on Twisted: performs the effects of :class:`protocol.agent.core.EngineAgentCore`.

Rules this file keeps: no bookkeeping of its own beyond handles (which link
is stream 3, which runtime handle is task "t-1"); every decision (what to
answer, which stream, when to report, when to reconnect) is the pure core's.
The clock, the links to the gateway and the runtime are passed in; one
``callLater`` is armed from ``next_deadline()``; effects are performed in the
order the core returned them, through one queue, so that a runtime answering
synchronously cannot reorder them.

What a stream to the gateway is, is the links' business (:class:`GatewayLinks`):
:class:`GrpcLinks` dials the gateway's engine port, as ``twistd infx-engine``
and the built-in echo engine do; :mod:`infx.agent.in_process` makes each stream a
route of the gateway's own processor, for runtimes the gateway serves by URL.
Over gRPC the stream is ``InferenceWorkerService/ProcessTasks`` on LLMariner's
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
from typing import Any, Protocol

from twisted.application.service import MultiService, Service
from twisted.internet.defer import Deferred, DeferredList, maybeDeferred, succeed
from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger
from twisted.python.failure import Failure

from infx.agent.runtimes import Runtime, RunningTask, event_result, openai_error_result
from infx.deadline import DeadlineTimer
from infx.transport import ClientCall, GrpcChannel
from protocol.agent.core import AgentState, EngineAgentCore, GatewayProtocolError
from protocol.agent.effects import (
    AbortTask,
    CloseStream,
    Effect,
    OpenStream,
    SendResult,
    SendStatus,
    StartTask,
    Stopped,
)
from protocol.agent.prompt_usage import may_hold_usage
from protocol.agent.runtime_load import RuntimeLoad
from protocol.openai.errors import UpstreamError
from protocol.pb import status_pb2, worker_pb2
from protocol.repeats import RepeatKind, RepeatReport, RepeatSuppressor

__all__ = ["PROCESS_TASKS", "AgentServices", "EngineAgent", "GatewayLink", "GatewayLinks", "GrpcLinks"]

PROCESS_TASKS = "/llmariner.inference.server.v1.InferenceWorkerService/ProcessTasks"

log = Logger(namespace="infx.engine")


class GatewayLink(Protocol):
    """One stream to the gateway, as the agent writes to it."""

    def send_status(self, status: status_pb2.EngineStatus) -> None:
        """Report this engine's status."""

    def send_result(self, result: worker_pb2.TaskResult) -> None:
        """Send a task's result (its task id and index already stamped)."""

    def when_writable(self) -> Deferred[None] | None:
        """None if more results may be sent now; else fires once the stream drained."""

    def end(self) -> None:
        """We send nothing more on this stream (the core closed it)."""


class GatewayLinks(Protocol):
    """How the agent's streams to the gateway are opened, and closed when it stops."""

    def open(self, stream_id: int, new_connection: bool, agent: EngineAgent) -> GatewayLink:
        """Open stream ``stream_id`` (on a new connection when ``new_connection``); what arrives
        on it goes to ``agent``'s :meth:`~EngineAgent.task_arrived`, :meth:`~EngineAgent.stream_confirmed`
        and :meth:`~EngineAgent.stream_ended`, never before this returns."""

    def stop(self) -> Deferred[None]:
        """The agent drained: let the streams end, then release what they used."""


@dataclass
class _Sink:
    """Reports one task's results to the agent; inert once the task ended."""

    agent: EngineAgent
    task_id: str
    ended: bool = False
    handle: RunningTask | None = field(default=None, repr=False)
    #: Where the task's events go once its stream is spliced (:meth:`EngineAgent.splice`); it
    #: answers False for an event it cannot take now, which then goes the usual way.
    spliced: Callable[[bytes], bool] | None = field(default=None, repr=False)

    def send(self, result: worker_pb2.TaskResult) -> None:
        if self.ended:
            return
        agent = self.agent
        effect = agent.core.send_result(self.task_id, result)
        if effect is None:
            return
        if agent._running_effects:
            agent._queue.append(effect)  # behind the effects being performed, in order
        else:
            agent._perform(effect)  # a result moves no deadline: the timer stays as armed

    def event(self, data: bytes) -> None:
        spliced = self.spliced
        # What may hold the prompt's usage goes the usual way: the core and routing count it.
        if spliced is None or self.ended or may_hold_usage(data) or not spliced(data):
            self.send(event_result(data))

    def when_writable(self) -> Deferred[None] | None:
        return None if self.ended else self.agent._when_writable(self.task_id)

    def finish(self) -> None:
        if not self.ended:
            self.ended = True
            self.agent._tasks.pop(self.task_id, None)
            self.agent._run(self.agent.core.finish_task(self.task_id, self.agent.clock.seconds()))


class EngineAgent(Service):
    """Serves the gateway's tasks on ``runtime`` over ``links`` (a Twisted service).

    ``stopService`` reports ready=false and waits for in-flight tasks, up to
    ``grace`` seconds, then ends the streams (:meth:`GatewayLinks.stop`).
    ``jitter()`` gives a number in [0, 1) for the reconnect backoff.
    """

    def __init__(
        self,
        clock: IReactorTime,
        core: EngineAgentCore,
        runtime: Runtime,
        links: GatewayLinks,
        *,
        grace: float = 30.0,
        jitter: Callable[[], float] = random.random,
    ) -> None:
        self.clock = clock
        self.core = core
        self.runtime = runtime
        self.links = links
        self.grace = grace
        self._jitter = jitter
        self._streams: dict[int, GatewayLink] = {}
        self._tasks: dict[str, _Sink] = {}
        self._queue: deque[Effect] = deque()
        self._running_effects = False
        # The core does only what is due when woken (handle_timeout), so an early wake-up is harmless.
        self._timer = DeadlineTimer(clock, self._on_timer, early_ok=True)
        self._stopped: Deferred[None] | None = None

    @property
    def engine_id(self) -> str:
        return self.core.config.engine_id

    # -- service ------------------------------------------------------------------

    def startService(self) -> None:
        super().startService()
        log.info("engine {engine_id} starting", engine_id=self.engine_id)
        self._run(self.core.start(self.clock.seconds()))

    def stopService(self) -> Deferred[None]:
        super().stopService()
        if self.core.state is AgentState.STOPPED:
            return self.links.stop()
        stopped: Deferred[None] = Deferred()
        self._stopped = stopped
        log.info("engine {engine_id} draining {n} tasks", engine_id=self.engine_id, n=self.core.in_progress)
        self._run(self.core.shutdown(self.grace, self.clock.seconds()))
        return stopped

    def runtime_changed(self, ready: bool, models: tuple[str, ...]) -> None:
        """The runtime's health check changed its verdict (:mod:`infx.agent.runtime_watch`)."""
        self._run(self.core.runtime_changed(ready, models, self.clock.seconds()))

    def runtime_identified(self, kind: str, version: str) -> None:
        """The runtime said what it is (:mod:`protocol.agent.runtime_identity`)."""
        self._run(self.core.runtime_identified(kind, version, self.clock.seconds()))

    def runtime_load_changed(self, load: RuntimeLoad | None) -> None:
        """The runtime's own load changed enough to report (:mod:`infx.agent.runtime_load_watch`)."""
        self._run(self.core.runtime_load_changed(load, self.clock.seconds()))

    def slot_keeping_changed(self, counts: status_pb2.EngineStatus.SlotKeeping) -> None:
        """The slot keeper's counts changed (:mod:`infx.agent.slot_keeping`)."""
        self._run(self.core.slot_keeping_changed(counts, self.clock.seconds()))

    # -- what the links report ------------------------------------------------------

    def task_arrived(self, stream_id: int, task: worker_pb2.Task) -> None:
        """A task came on stream ``stream_id``."""
        try:
            effects = self.core.task_received(stream_id, task, self.clock.seconds())
        except GatewayProtocolError as exc:
            log.warn("engine {engine_id}: {error}", engine_id=self.engine_id, error=str(exc))
        else:
            self._run(effects)

    def stream_confirmed(self, stream_id: int) -> None:
        """The gateway took stream ``stream_id`` (the reconnect backoff starts over)."""
        self.core.stream_confirmed(stream_id)

    def splice(self, task_id: str, spliced: Callable[[bytes], bool]) -> None:
        """Task ``task_id``'s stream is committed to a client of the gateway this agent runs in:
        from now on its events go to ``spliced``, past the core and the gateway's processor, which
        still get the answer's head, every event that may hold usage, and its end
        (:mod:`infx.gateway.in_process`)."""
        sink = self._tasks.get(task_id)
        if sink is not None:
            sink.spliced = spliced

    def stream_ended(self, stream_id: int) -> None:
        """Stream ``stream_id`` is over, whoever ended it; its tasks are aborted."""
        self._streams.pop(stream_id, None)
        self._run(self.core.stream_closed(stream_id, self._jitter(), self.clock.seconds()))

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
        self._timer.arm(self.core.next_deadline())

    def _perform(self, effect: Effect) -> None:
        if isinstance(effect, SendResult):
            link = self._streams.get(effect.stream_id)
            if link is not None:
                link.send_result(effect.result)
        elif isinstance(effect, SendStatus):
            link = self._streams.get(effect.stream_id)
            if link is not None:
                link.send_status(effect.status)
        elif isinstance(effect, StartTask):
            self._start_task(effect.task)
        elif isinstance(effect, AbortTask):
            sink = self._tasks.pop(effect.task_id, None)
            if sink is not None:
                sink.ended = True
                if sink.handle is not None:
                    sink.handle.abort()
        elif isinstance(effect, OpenStream):
            self._streams[effect.stream_id] = self.links.open(effect.stream_id, effect.new_connection, self)
        elif isinstance(effect, CloseStream):
            link = self._streams.get(effect.stream_id)
            if link is not None:
                link.end()
        elif isinstance(effect, Stopped):
            self._finish_stop()

    def _on_timer(self) -> None:
        self._run(self.core.handle_timeout(self.clock.seconds()))

    def _when_writable(self, task_id: str) -> Deferred[None] | None:
        stream_id = self.core.task_stream(task_id)
        link = self._streams.get(stream_id) if stream_id is not None else None
        return None if link is None else link.when_writable()

    # -- tasks --------------------------------------------------------------------

    def _start_task(self, task: worker_pb2.Task) -> None:
        sink = _Sink(self, task.id)
        self._tasks[task.id] = sink
        try:
            handle = self.runtime.start(task, sink)
        except Exception:
            log.failure("engine runtime failed to start task {task_id}", task_id=task.id)
            sink.send(openai_error_result(UpstreamError("The engine failed to start the task.")))
            sink.finish()
            return
        sink.handle = handle

    # -- stop ---------------------------------------------------------------------

    def _finish_stop(self) -> None:
        log.info("engine {engine_id} drained", engine_id=self.engine_id)
        self._timer.cancel()
        ended = self.links.stop()
        stopped = self._stopped
        if stopped is not None:
            self._stopped = None
            ended.chainDeferred(stopped)


class AgentServices(MultiService):
    """An engine agent and the services it uses (its runtime's client, health check, load scrapes).

    On stop the agent drains first (its tasks finish within its grace period, still using the
    others), then the others stop: a ``MultiService`` would stop them all at once, closing the
    runtime's connections under the tasks still running.
    """

    def __init__(self, agent: EngineAgent) -> None:
        super().__init__()
        self.agent = agent

    def stopService(self) -> Deferred[None]:
        Service.stopService(self)
        drained: Deferred[Any] = maybeDeferred(self.agent.stopService) if self.agent.running else succeed(None)

        def the_rest(_: Any) -> Deferred[None]:
            others = [maybeDeferred(s.stopService) for s in reversed(list(self)) if s is not self.agent and s.running]
            done: Deferred[Any] = DeferredList(others)
            return done.addCallback(lambda _: None)

        return drained.addBoth(the_rest)


# -- streams over gRPC ----------------------------------------------------------------

#: The key of ``ProcessTasksRequest.task_result`` (field 2, length-delimited) on the wire.
_TASK_RESULT_KEY = b"\x12"


def _result_request(result: worker_pb2.TaskResult) -> bytes:
    """``ProcessTasksRequest(task_result=result)`` encoded, without first copying ``result`` (and its
    body) into a wrapper message: a streamed answer sends one per event."""
    body = result.SerializeToString()
    size = len(body)
    prefix = bytearray(_TASK_RESULT_KEY)
    while size > 0x7F:
        prefix.append((size & 0x7F) | 0x80)
        size >>= 7
    prefix.append(size)
    return bytes(prefix) + body


def _encode_request(message: worker_pb2.ProcessTasksRequest | bytes) -> bytes:
    """What the stream sends: a status as its message, a result already encoded (:func:`_result_request`)."""
    return message if type(message) is bytes else message.SerializeToString()



@dataclass
class _GrpcStream:
    """A stream over gRPC: its call, its channel, and the last send the call could not take at once."""

    stream_id: int
    call: ClientCall
    channel: GrpcChannel
    backlog: Deferred[None] | None = None

    def send_status(self, status: status_pb2.EngineStatus) -> None:
        self._send(worker_pb2.ProcessTasksRequest(engine_status=status))

    def send_result(self, result: worker_pb2.TaskResult) -> None:
        self._send(_result_request(result))

    def _send(self, message: worker_pb2.ProcessTasksRequest | bytes) -> None:
        sent = self.call.send(message)
        # A failed send shows up as the end of the stream on the read side.
        sent.addErrback(lambda _: None)
        if not sent.called:
            self.backlog = sent

    def when_writable(self) -> Deferred[None] | None:
        backlog = self.backlog
        if backlog is None or backlog.called:
            return None
        writable: Deferred[None] = Deferred()
        backlog.addBoth(lambda result: (writable.callback(None), result)[1])
        return writable

    def end(self) -> None:
        self.call.end()


@dataclass
class _ChannelUse:
    streams: int = 0


class GrpcLinks:
    """Streams to the gateway's engine port: ``connect()`` returns a new :class:`GrpcChannel`
    to it; ``key`` goes out as ``authorization: Bearer <key>``. On stop, streams still open
    get ``close_timeout`` seconds to end before their channels are closed."""

    def __init__(self, clock: IReactorTime, connect: Callable[[], GrpcChannel], *, key: str = "",
                 close_timeout: float = 5.0) -> None:
        self.clock = clock
        self._connect = connect
        self._metadata: tuple[tuple[str, str], ...] = (("authorization", f"Bearer {key}"),) if key else ()
        self.close_timeout = close_timeout
        self._streams: dict[int, _GrpcStream] = {}
        self._channels: dict[GrpcChannel, _ChannelUse] = {}
        self._channel: GrpcChannel | None = None
        #: A gateway that refuses us (wrong key) or is not there fails every reconnect the same way.
        self._stream_failures = RepeatSuppressor()
        #: Streams the gateway accepted so far: the first is a connect, the others reconnects.
        self._accepted = 0

    def open(self, stream_id: int, new_connection: bool, agent: EngineAgent) -> GatewayLink:
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
            _encode_request,
            worker_pb2.ProcessTasksResponse.FromString,
            metadata=self._metadata,
        )
        stream = _GrpcStream(stream_id, call, channel)
        self._streams[stream_id] = stream

        def confirmed(_: Any) -> None:
            if call.final is None:
                agent.stream_confirmed(stream_id)
                self._log_repeats(agent, self._stream_failures.cleared("stream", self.clock.seconds()))
                self._accepted += 1
                log.info("engine {engine_id}: {connected} to the gateway (stream {stream_id})",
                         engine_id=agent.engine_id, stream_id=stream_id,
                         connected="connected" if self._accepted == 1 else "reconnected", event="engine_connected")

        def received(message: worker_pb2.ProcessTasksResponse) -> None:
            if message.HasField("new_task"):
                agent.task_arrived(stream_id, message.new_task)

        call.initial_metadata().addCallback(confirmed)
        # Each task as it arrives, without a Deferred per message; then the stream's end.
        call.read_each(received).addCallbacks(
            lambda _: self._ended(agent, stream, None),
            lambda failure: self._ended(agent, stream, failure),
        )
        return stream

    def _ended(self, agent: EngineAgent, stream: _GrpcStream, failure: Failure | None) -> None:
        self._streams.pop(stream.stream_id, None)
        reason = "ended by the gateway" if failure is None else failure.getErrorMessage()
        self._log_repeats(agent, self._stream_failures.occurred("stream", f"stream closed: {reason}",
                                                                self.clock.seconds()))
        use = self._channels.get(stream.channel)
        if use is not None:
            use.streams -= 1
            if use.streams == 0 and stream.channel is not self._channel:
                self._close_channel(stream.channel)
        agent.stream_ended(stream.stream_id)

    def _log_repeats(self, agent: EngineAgent, reports: list[RepeatReport]) -> None:
        for report in reports:
            emit = log.info if report.kind is RepeatKind.STOPPED else log.warn
            emit("engine {engine_id}: {text}", engine_id=agent.engine_id, text=report.text(),
                 repeat=report.kind.value, count=report.count)

    def _close_channel(self, channel: GrpcChannel) -> Deferred[None]:
        use = self._channels.pop(channel, None)
        if channel is self._channel:
            self._channel = None
        if use is None:
            return succeed(None)
        return channel.close()

    def stop(self) -> Deferred[None]:
        waiting = [stream.call.status() for stream in self._streams.values()]
        ended: Deferred[Any] = DeferredList(waiting) if waiting else succeed(None)
        guard = self.clock.callLater(self.close_timeout, ended.cancel) if waiting else None

        def close(_: Any) -> Deferred[None]:
            if guard is not None and guard.active():
                guard.cancel()
            closing = [self._close_channel(channel) for channel in list(self._channels)]
            done: Deferred[Any] = DeferredList(closing)
            return done.addCallback(lambda _: None)

        return ended.addBoth(close)
