"""A :class:`~protocol.grpc.GrpcConnection` at one end of a link: what ``infx.transport.GrpcProtocol`` does, in memory.

Rules this file keeps: the machine is driven only from the simulation's
scheduler (bytes in, timers, connection loss) and from its owner's commands;
after any of these, ``flush`` hands the events to the owner, writes the bytes
to the link in one write, and re-arms the connection's single timer. A
``ConnectionTerminated`` writes what is left and closes the link (FIN), as
``GrpcProtocol._terminated`` does.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from protocol.grpc import ConnectionTerminated, Event, GrpcConfig, GrpcConnection

if TYPE_CHECKING:
    from tests.sim.link import Link
    from tests.sim.scheduler import Scheduler


class GrpcEnd:
    """One side of a link; ``dispatch`` is the owner's handler for the machine's events."""

    def __init__(
        self,
        scheduler: Scheduler,
        link: Link,
        side: int,
        config: GrpcConfig,
        dispatch: Callable[[GrpcEnd, list[Event]], None],
        after: Callable[[], None],
    ) -> None:
        self.scheduler = scheduler
        self.link = link
        self.side = side
        self.conn = GrpcConnection(config)
        self._dispatch = dispatch
        #: The owner's own flush (its other machines may have work after our events).
        self._after = after
        self.closed = False
        self._terminated = False
        self._flushing = False
        link.ends[side] = self
        self.conn.initiate(scheduler.now)

    # -- LinkEnd ------------------------------------------------------------------

    def data_received(self, data: bytes) -> None:
        if self.closed:
            return
        self._handle(self.conn.receive_data(data, self.scheduler.now))
        self._after()

    def connection_lost(self, reason: str) -> None:
        if self.closed:
            return
        self.closed = True
        self.scheduler.arm(self, None, self._on_timer)
        self._handle(self.conn.connection_lost(reason))
        self._after()

    # -- driving ------------------------------------------------------------------

    def flush(self) -> None:
        """Dispatch what commands caused, write the bytes, re-arm the timer."""
        if self._flushing:
            return
        self._flushing = True
        try:
            events = self.conn.take_events()
            while events:
                self._dispatch_events(events)
                events = self.conn.take_events()
        finally:
            self._flushing = False
        if self.closed:
            return
        self.link.send(self.side, self.conn.data_to_send())
        if self._terminated:
            self.closed = True
            self.scheduler.arm(self, None, self._on_timer)
            self.link.close(self.side, "connection terminated")
            return
        self.scheduler.arm(self, self.conn.next_deadline(), self._on_timer, "grpc-timer")

    def abandon(self) -> None:
        """The owner's process died: no more bytes, timers or events from this end."""
        self.closed = True
        self.scheduler.arm(self, None, self._on_timer)
        self.link.forget_end(self.side)

    def _on_timer(self) -> None:
        if self.closed:
            return
        self._handle(self.conn.handle_timeout(self.scheduler.now))
        self._after()

    def _handle(self, events: list[Event]) -> None:
        self._flushing = True
        try:
            self._dispatch_events(events)
        finally:
            self._flushing = False
        self.flush()

    def _dispatch_events(self, events: list[Event]) -> None:
        if events:
            if any(isinstance(e, ConnectionTerminated) for e in events):
                self._terminated = True
            self._dispatch(self, events)
