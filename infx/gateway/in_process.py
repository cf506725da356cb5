"""An engine agent inside the gateway's process: its streams are routes of the gateway's own processor.

For a runtime the gateway reaches by URL (:mod:`infx.gateway.runtime_engines`),
the engine agent (:class:`~infx.agent.engine.EngineAgent`, its pure core and
the ``openai`` runtime) runs here, and each of its streams is a route of the
dispatcher, as an engine's ``ProcessTasks`` stream is
(:class:`~infx.gateway.workers.EngineStream`): its status registers a local
engine, tasks are handed to the agent, results to the dispatcher. Nothing is
encoded or framed between them: the protobuf messages are passed as they are.

Rules this file keeps: one turn of the dispatcher never re-enters it. What
the agent sends while the dispatcher is handing it a task (a control task's
answer, a capacity refusal, a status) waits for the next reactor turn, in
order, as it would have on a stream; everything else (results from the
runtime's connection, health and load changes) goes at once. A stream ended
by either side is ended on both.

A streamed answer to a client of this gateway is spliced once committed (its
head delivered): its events go from the runtime's connection to the client's
request (:meth:`~infx.gateway.dispatcher.HttpOrigin.spliced_event`), past the
agent's core and the processor, which is most of a relayed event's cost. The
processor still gets the head, the end, and every event that may hold the
prompt's usage (the core counts it, routing learns from it); an event goes the
usual way whenever the client is behind or anything waits in line here, so
that none overtakes another.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

from twisted.internet.defer import Deferred, succeed
from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.logger import Logger

from infx.agent.engine import EngineAgent, GatewayLink
from infx.gateway.dispatcher import Dispatcher, HttpOrigin, SendOutcome
from protocol.pb import status_pb2, worker_pb2
from protocol.processor.keys import Locality

__all__ = ["InProcessLinks"]

log = Logger(namespace="infx.gateway.in_process")


class _InProcessStream:
    """One of the agent's streams: the agent's link to the gateway and the processor's route to it."""

    def __init__(self, links: InProcessLinks, stream_id: int, agent: EngineAgent) -> None:
        self.links = links
        self.stream_id = stream_id
        self.agent = agent
        self.closed = False
        #: Why the processor refused this engine, if it did (another engine process holds its id).
        self.refusal = ""
        self.models: tuple[tuple[str, bool], ...] | None = None

    # -- the processor's route (infx.gateway.dispatcher.EngineRoute) --------------------

    def send_task(self, task: worker_pb2.Task, tenant_id: str) -> SendOutcome:
        if self.closed:
            return SendOutcome.GONE
        links = self.links
        links.handing += 1
        try:
            self.agent.task_arrived(self.stream_id, task)
        finally:
            links.handing -= 1
        return SendOutcome.SENT

    def withdraw_task(self, wire_id: str) -> bool:
        return False  # a task is the agent's the moment it is sent: none ever waits on this route

    def splice(self, wire_id: str, origin: HttpOrigin) -> None:
        links = self.links

        def spliced(data: bytes) -> bool:
            # Only while nothing waits in line to be delivered, which the event would overtake.
            return not (self.closed or links.busy) and origin.spliced_event(data)

        self.agent.splice(wire_id, spliced)

    def close(self, reason: str) -> None:
        """The processor gave up on the engine (missed heartbeats, a stuck route)."""
        self.links.handing += 1  # the dispatcher is performing its effects: what follows waits
        try:
            self._end_both(reason)
        finally:
            self.links.handing -= 1

    def refuse(self, reason: str) -> None:
        """Another engine holds this engine's id here (a dial-in agent given the same id)."""
        if not self.closed:
            self.refusal = reason
            log.warn("engine {engine_id} refused: {reason}", engine_id=self.agent.engine_id, reason=reason,
                     event="engine_refused")
            self.close(reason)

    # -- the agent's link (infx.agent.engine.GatewayLink) ------------------------------

    def send_status(self, status: status_pb2.EngineStatus) -> None:
        if not self.closed:
            self.links.deliver(self._status, status)

    def send_result(self, result: worker_pb2.TaskResult) -> None:
        if not self.closed:
            self.links.deliver(self.links.dispatcher.result_received, self, result)

    def when_writable(self) -> Deferred[None] | None:
        return None  # the dispatcher takes results as they come; a slow client is the HTTP call's business

    def end(self) -> None:
        """The agent sends nothing more (a retired stream, or the drain is over)."""
        self._end_both("the engine closed its stream")

    # -- both --------------------------------------------------------------------------

    def _status(self, status: status_pb2.EngineStatus) -> None:
        if self.closed:
            return
        links = self.links
        links.dispatcher.engine_status(self, links.tenant, status, Locality.LOCAL)
        if self.closed:
            return  # refused
        reported = tuple(sorted((m.id, m.is_ready and status.ready) for m in status.models))
        if reported != self.models:
            text = ", ".join(f"{m} ({'ready' if ready else 'not ready'})" for m, ready in reported) or "none"
            if self.models is None:
                log.info("engine {engine_id} serving {url} in process: tenant {tenant!r}, models {models}",
                         engine_id=status.engine_id, url=links.url, tenant=links.tenant, models=text,
                         event="engine_connected")
            else:
                log.info("engine {engine_id}: models now {models}", engine_id=status.engine_id, models=text,
                         event="engine_models_changed")
            self.models = reported

    def _end_both(self, reason: str) -> None:
        if self.closed:
            return
        self.closed = True
        links = self.links
        links.streams.pop(self.stream_id, None)
        links.deliver(links.dispatcher.route_closed, self, reason)
        links.deliver(self.agent.stream_ended, self.stream_id)

    def __repr__(self) -> str:
        return f"<in-process engine {self.agent.engine_id} stream {self.stream_id}>"


class InProcessLinks:
    """The agent's streams as routes of ``dispatcher``, its engine in ``tenant``; ``url`` names
    its runtime in the log."""

    def __init__(self, clock: IReactorTime, dispatcher: Dispatcher, tenant: str, url: str) -> None:
        self.clock = clock
        self.dispatcher = dispatcher
        self.tenant = tenant
        self.url = url
        self.streams: dict[int, _InProcessStream] = {}
        #: Above 0 while the dispatcher is handing a task to the agent (it must not be re-entered).
        self.handing = 0
        self._waiting: deque[tuple[Callable[..., Any], tuple[Any, ...]]] = deque()
        self._flush: IDelayedCall | None = None

    def open(self, stream_id: int, new_connection: bool, agent: EngineAgent) -> GatewayLink:
        stream = _InProcessStream(self, stream_id, agent)
        self.streams[stream_id] = stream
        # In process, the stream is taken as soon as it is opened (no handshake to wait for).
        self.deliver(agent.stream_confirmed, stream_id)
        return stream

    @property
    def busy(self) -> bool:
        """A call now would re-enter the dispatcher or overtake what waits already."""
        return bool(self.handing or self._waiting)

    def deliver(self, call: Callable[..., Any], *args: Any) -> None:
        """Call now, unless the links are :attr:`busy`: then in order, on the next reactor turn."""
        if self.busy:
            self._waiting.append((call, args))
            if self._flush is None:
                self._flush = self.clock.callLater(0, self._deliver_waiting)
        else:
            call(*args)

    def _deliver_waiting(self) -> None:
        self._flush = None
        while self._waiting and not self.handing:
            call, args = self._waiting.popleft()
            call(*args)

    def stop(self) -> Deferred[None]:
        """The agent drained: streams still open end (their engine leaves the processor)."""
        for stream in list(self.streams.values()):
            stream.end()
        return succeed(None)
