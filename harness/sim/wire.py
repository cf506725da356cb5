"""A :class:`~protocol.grpc.GrpcConnection` at one end of a link: what ``infx.transport.GrpcProtocol`` does, in memory.

Rules this file keeps: the machine is driven only from the simulation's
scheduler (bytes in, timers, connection loss) and from its owner's commands;
after any of these, ``flush`` hands the events to the owner, writes the bytes
to the link in one write, and re-arms the connection's single timer. A
``ConnectionTerminated`` writes what is left and closes the link (FIN), as
``GrpcProtocol._terminated`` does.

Work is proportional to what was touched: an owner's command reaches the
machine through :attr:`GrpcEnd.conn`, which puts the end in its owner's
``pending`` set, and the owner's flush flushes only the ends in that set (an
end nobody touched has no events, no bytes and the same deadline). The owner
hears ``gone(end)`` once, when the end closes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from protocol.grpc import ConnectionTerminated, Event, GrpcConfig, GrpcConnection

if TYPE_CHECKING:
    from harness.sim.link import Link
    from harness.sim.scheduler import Scheduler


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
        pending: dict[GrpcEnd, None],
        gone: Callable[[GrpcEnd], None],
    ) -> None:
        self.scheduler = scheduler
        self.link = link
        self.side = side
        self._conn = GrpcConnection(config)
        self._dispatch = dispatch
        #: The owner's own flush (its other machines may have work after our events).
        self._after = after
        #: The owner's ends to flush at its next flush (a dict: insertion order, deterministic).
        self._pending = pending
        self._gone = gone
        self.closed = False
        self._terminated = False
        self._flushing = False
        link.ends[side] = self
        self.conn.initiate(scheduler.now)

    @property
    def conn(self) -> GrpcConnection:
        """The machine, for the owner's commands and queries: using it may leave events
        or bytes behind, so the end is flushed at the owner's next flush."""
        if not self.closed:
            self._pending[self] = None
        return self._conn

    # -- LinkEnd ------------------------------------------------------------------

    def data_received(self, data: bytes) -> None:
        if self.closed:
            return
        self._handle(self._conn.receive_data(data, self.scheduler.now))
        self._after()

    def connection_lost(self, reason: str) -> None:
        if self.closed:
            return
        self._close()
        self._handle(self._conn.connection_lost(reason))
        self._gone(self)  # after the owner has seen the events of the loss
        self._after()

    # -- driving ------------------------------------------------------------------

    def flush(self) -> None:
        """Dispatch what commands caused, write the bytes, re-arm the timer."""
        self._pending.pop(self, None)
        if self._flushing:
            return
        self._flushing = True
        conn = self._conn
        try:
            events = conn.take_events()
            while events:
                self._dispatch_events(events)
                events = conn.take_events()
        finally:
            self._flushing = False
        if self.closed:
            return
        self.link.send(self.side, conn.data_to_send())
        if self._terminated:
            self._close()
            self._gone(self)
            self.link.close(self.side, "connection terminated")
            return
        self.scheduler.arm(self, conn.next_deadline(), self._on_timer, "grpc-timer")

    def abandon(self) -> None:
        """The owner's process died: no more bytes, timers or events from this end."""
        if not self.closed:
            self._close()
            self._gone(self)
        self.link.forget_end(self.side)

    def _close(self) -> None:
        self.closed = True
        self.scheduler.arm(self, None, self._on_timer)
        self._pending.pop(self, None)

    def _on_timer(self) -> None:
        if self.closed:
            return
        self._handle(self._conn.handle_timeout(self.scheduler.now))
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
