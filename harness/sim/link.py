"""In-memory links that carry the real bytes between two gRPC machines, with seeded latencies.

Rules this file keeps: a link is a pair of ordered byte pipes (TCP keeps
order, so arrival times never go backwards within one direction); latencies
and how the bytes are cut into reads come from the simulation's seeded RNG;
faults are explicit commands (``reset``: in-flight bytes are lost and both
ends see the connection drop; ``black_hole``: from now on bytes vanish and
nobody is told, a half-open connection). Each end hears ``connection_lost``
at most once.
"""

from __future__ import annotations

from collections import deque
from enum import Enum
from functools import partial
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from harness.sim.scheduler import Scheduler


class LinkEnd(Protocol):
    """What sits at either end of a link (the adapter around a GrpcConnection)."""

    def data_received(self, data: bytes) -> None: ...

    def connection_lost(self, reason: str) -> None: ...


class LinkState(Enum):
    OPEN = "open"
    #: Bytes vanish in both directions and no end is told (a peer that stopped answering).
    BLACK_HOLE = "black_hole"
    #: Reset or closed: nothing more is delivered.
    CLOSED = "closed"


class Link:
    """Two ordered byte pipes between end ``0`` (the dialer) and end ``1`` (the acceptor)."""

    def __init__(self, scheduler: Scheduler, name: str, latency: tuple[float, float]) -> None:
        self.scheduler = scheduler
        self.name = name
        self.latency = latency
        self.state = LinkState.OPEN
        self.ends: list[LinkEnd | None] = [None, None]
        self._arrival = [0.0, 0.0]  # last arrival time per direction (towards end i)
        self._in_flight = [0, 0]  # bytes in flight towards end i
        self._lost_told = [False, False]
        self._queues: list[deque[bytes]] = [deque(), deque()]
        self._fin = [False, False]  # end i closed its side: deliver no more to it after the close
        self.bytes_carried = 0
        self.bytes_dropped = 0

    @property
    def in_flight(self) -> int:
        return self._in_flight[0] + self._in_flight[1]

    def send(self, side: int, data: bytes) -> None:
        """End ``side`` writes ``data``: it arrives at the other end in order, cut into a few reads."""
        if not data:
            return
        to = 1 - side
        if self.state is not LinkState.OPEN or self._fin[side]:
            self.bytes_dropped += len(data)
            return
        rng = self.scheduler.rng
        cuts = sorted(rng.sample(range(1, len(data)), min(rng.randrange(3), len(data) - 1))) if len(data) > 1 else []
        start = 0
        for end in [*cuts, len(data)]:
            piece = data[start:end]
            start = end
            arrival = max(self._arrival[to], self.scheduler.now + rng.uniform(*self.latency))
            self._arrival[to] = arrival
            self._in_flight[to] += len(piece)
            # Deliveries due at the same time may run in any order; the queue keeps the bytes' order.
            self._queues[to].append(piece)
            self.scheduler.at(arrival, lambda: self._deliver(to), f"{self.name}>{to}")

    def close(self, side: int, reason: str) -> None:
        """End ``side`` closed the connection after writing what it had (FIN): the
        other end reads the rest, then hears the close; ``side`` hears it now."""
        if self._fin[side]:
            return
        self._fin[side] = True
        to = 1 - side
        self._tell_lost(side, reason)
        if self.state is LinkState.OPEN:
            when = max(self._arrival[to], self.scheduler.now + self.latency[0])
            self.scheduler.at(when, lambda: self._tell_lost(to, f"peer closed: {reason}"), f"{self.name}fin>{to}")

    def reset(self, reason: str) -> None:
        """Drop every byte in flight; both ends hear the connection drop (each as its own event)."""
        if self.state is LinkState.CLOSED:
            return
        self.state = LinkState.CLOSED
        self.bytes_dropped += self.in_flight
        self._in_flight = [0, 0]
        for side in (0, 1):
            self.scheduler.at(self.scheduler.now, partial(self._tell_lost, side, reason), f"{self.name}rst")

    def black_hole(self) -> None:
        """Stop carrying bytes, silently: each end finds out only by its own timeouts."""
        if self.state is LinkState.OPEN:
            self.state = LinkState.BLACK_HOLE
            self.bytes_dropped += self.in_flight
            self._in_flight = [0, 0]

    def forget_end(self, side: int) -> None:
        """End ``side`` is gone with its process: it is told nothing more."""
        self._lost_told[side] = True

    @property
    def finished(self) -> bool:
        """Both ends have heard the connection end: the link holds nothing."""
        return all(self._lost_told)

    def _deliver(self, to: int) -> None:
        if self.state is not LinkState.OPEN:
            return
        piece = self._queues[to].popleft()
        self._in_flight[to] -= len(piece)
        if self._lost_told[to]:
            self.bytes_dropped += len(piece)
            return
        self.bytes_carried += len(piece)
        end = self.ends[to]
        assert end is not None
        end.data_received(piece)

    def _tell_lost(self, side: int, reason: str) -> None:
        if self._lost_told[side]:
            return
        self._lost_told[side] = True
        if self.state is LinkState.OPEN and all(self._fin):
            self.state = LinkState.CLOSED
        end = self.ends[side]
        if end is not None:
            end.connection_lost(reason)
