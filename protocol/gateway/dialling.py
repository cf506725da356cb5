"""The peers a gateway dials: one stream each at its current address, redialled after a backoff.

Rules this file keeps: no I/O, no clock reads (``now`` is every input's last
argument), no randomness but the ``random.Random`` passed in. It is the gateway
core's (:mod:`protocol.gateway.core`) bookkeeping of its dials, apart from the
core because it is a concern of its own: which peers are wanted where, each
one's :class:`~protocol.exchange.dialled_peer.DialledPeer` on its current
stream, its redial backoff, when each is next due, and the tasks peers
forwarded on them. What a dialled peer outputs for other machines (the
processor's effects for forwarded tasks) goes back through the core's
``absorb``, in place, so effects keep the order they happened in.

- One stream per wanted peer; a peer that moved is given up and dialled anew.
- A stream the peer did not accept counts a failure; the redial waits a
  jittered backoff that grows with them (``redial_backoff``), unless the peer
  dials us meanwhile (``redial_when_dialled_in``: it is back).
- A dial-back (a peer that dialled us unasked) lasts while that peer dials us;
  a dial that reaches a pod already dialled back under another name replaces it.
- Draining: each open stream reports every engine not ready, finishes its
  forwarded tasks and half-closes; a dial not yet accepted is given up.
- Costs per input: a peer's next due time (its dialled peer's next report, or
  its redial) is re-read only after that peer took an input or its redial
  changed, and kept in a heap (:class:`~protocol.gateway.due_times.DueTimes`).
"""

from __future__ import annotations

import enum
import itertools
import random
from collections.abc import Callable, Iterable, Mapping

from protocol.exchange.dial_backs import pod_of
from protocol.exchange.dialled_peer import DialledPeer, DialledPeerConfig, DialledPeerOutput, DialledPeerState, SendToPeer
from protocol.exchange.status_reports import LocalStatuses, offers_deltas
from protocol.gateway.due_times import DueTimes
from protocol.gateway.effects import CancelDial, CoreConfig, CoreEffect, Dial, HalfCloseDial, OpenDial, SendOnDial
from protocol.grpc.metadata import Metadata
from protocol.pb import internal_pb2
from protocol.processor.core import Processor
from protocol.processor.effects import DeliverResult, FailRequest
from protocol.processor.errors import PeerProtocolError

__all__ = ["Absorb", "DialState", "Dialling", "PeerDialling"]

#: DialledPeer states in which a dial's stream takes messages.
_LIVE = (DialledPeerState.OPEN, DialledPeerState.DRAINING)

#: The core's hand-over of a dialled peer's outputs for other machines (see the module docstring).
Absorb = Callable[[Iterable[DialledPeerOutput], float, list[CoreEffect]], None]


class DialState(enum.Enum):
    """Where a dialled peer is: its stream not yet accepted, accepted, waiting to redial,
    draining, or given up for good (no longer wanted, or this gateway stopped)."""

    CONNECTING = "connecting"
    OPEN = "open"
    BACKING_OFF = "backing off"
    DRAINING = "draining"
    STOPPED = "stopped"


class PeerDialling:
    """A peer this gateway dials: its current stream (if any) and its redial state.

    :class:`Dialling`'s own record; adapters and tests only read it.
    """

    __slots__ = ("name", "address", "order", "dial", "dialled", "accepted", "half_closed", "failures", "attempts",
                 "streams_opened", "redial_at", "stopped", "pod_name", "dialled_back")

    def __init__(self, name: str, address: object, order: int = 0, dialled_back: bool = False) -> None:
        self.name = name
        #: The pod the peer's headers named when it accepted our stream ("" until then, or LLMariner).
        self.pod_name = ""
        #: Dialled because it dialled us (named by its pod), not because the pod source lists it.
        self.dialled_back = dialled_back
        #: When it was made, relative to the others: peers due at once are served in this order.
        self.order = order
        self.address = address
        self.dial: Dial | None = None
        self.dialled: DialledPeer | None = None
        self.accepted = False
        self.half_closed = False
        #: Streams in a row the peer did not accept (the redial backoff grows with them).
        self.failures = 0
        self.attempts = 0
        #: Streams the peer accepted.
        self.streams_opened = 0
        self.redial_at: float | None = None
        self.stopped = False

    @property
    def state(self) -> DialState:
        if self.stopped:
            return DialState.STOPPED
        if self.dial is None:
            return DialState.BACKING_OFF
        if self.dialled is not None and self.dialled.state is DialledPeerState.DRAINING:
            return DialState.DRAINING
        return DialState.OPEN if self.accepted else DialState.CONNECTING

    def __repr__(self) -> str:
        return f"<PeerDialling {self.name} {self.address} {self.state.value}>"


class Dialling:
    """The peers dialled now, by name; see the module docstring.

    ``absorb`` is the core's hand-over; ``requests_started`` and ``local_statuses`` are what
    every dialled peer reports; ``dialled_in(pod)`` says whether that pod has a stream open to us.
    """

    def __init__(self, processor: Processor, config: CoreConfig, rng: random.Random, absorb: Absorb,
                 requests_started: Callable[[], Mapping[str, int]], local_statuses: Callable[[], LocalStatuses],
                 dialled_in: Callable[[str], bool]) -> None:
        self.processor = processor
        self.config = config
        self._rng = rng
        self._absorb = absorb
        self._requests_started = requests_started
        self._local_statuses = local_statuses
        self._dialled_in = dialled_in
        #: The peers dialled now, by name (read only outside).
        self.peers: dict[str, PeerDialling] = {}
        #: Set by :meth:`drain` or :meth:`stop`: no more dials, and no redials.
        self.stopping = False
        self._by_dial: dict[Dial, PeerDialling] = {}
        self._made = itertools.count()
        # When each peer is next due: its dialled peer's next report, or its redial.
        self._due: DueTimes[PeerDialling] = DueTimes()
        # Tasks each peer forwarded on our stream to it that have not ended, and their sum.
        self._forwarded: dict[PeerDialling, int] = {}
        self._forwarded_in_flight = 0

    @property
    def forwarded_in_flight(self) -> int:
        """Tasks peers forwarded on the streams we dial that have not ended, over every peer."""
        return self._forwarded_in_flight

    def next_deadline(self) -> float | None:
        return self._due.earliest()

    def dialled(self, pod: str) -> PeerDialling | None:
        """Our dial meant for ``pod`` (by name) or that reached it (by its headers), if any."""
        return self.peers.get(pod) or next((peer for peer in self.peers.values() if peer.pod_name == pod), None)

    # --- which peers -------------------------------------------------------------------

    def want(self, peers: Mapping[str, object], now: float, out: list[CoreEffect]) -> None:
        """The peers to dial now, by name, with their addresses."""
        for name in sorted(set(self.peers) | set(peers)):
            desired = None if self.stopping else peers.get(name)
            peer = self.peers.get(name)
            if peer is not None and peer.dialled_back and name not in peers and not self.stopping:
                continue  # ours to keep while the peer dials us; the source now naming it takes it over
            if peer is not None and (desired != peer.address or peer.dialled_back):
                self._give_up(peer, "peer left or moved", now, out)
                self._forget(peer)
                peer = None
            if peer is None and desired is not None:
                peer = PeerDialling(name, desired, next(self._made))
                self.peers[name] = peer
                self._open(peer, now, out)

    def dial_back(self, pod: str, address: object, now: float, out: list[CoreEffect]) -> None:
        """Dial ``pod`` at ``address`` because it dials us unasked."""
        peer = PeerDialling(pod, address, next(self._made), dialled_back=True)
        self.peers[pod] = peer
        self._open(peer, now, out)

    def redial_now(self, pod: str, now: float, out: list[CoreEffect]) -> None:
        """``pod``, which we wait to redial, dialled us: it is up again (a restart), so the
        backoff its outage grew would only delay its learning of our engines."""
        if not self.config.redial_when_dialled_in or self.stopping:
            return
        peer = self.dialled(pod)
        if peer is not None and peer.dial is None and peer.redial_at is not None:
            self._open(peer, now, out)

    # --- a dial's stream ---------------------------------------------------------------

    def accepted(self, dial: Dial, metadata: Metadata, now: float, out: list[CoreEffect]) -> str | None:
        """The peer answered ``dial`` with headers (``metadata``); returns the pod they name, or
        None if the dial was not waiting for them."""
        peer = self._by_dial.get(dial)
        if peer is None or peer.accepted:
            return None
        peer.accepted = True
        peer.streams_opened += 1
        dialled = peer.dialled
        if dialled is not None and dialled.state in _LIVE and offers_deltas(metadata):
            self._absorb_dialled(peer, dialled.deltas_offered(now), now, out)
        peer.pod_name = pod_of(metadata)
        twin = self.peers.get(peer.pod_name)
        if twin is not None and twin is not peer and twin.dialled_back:
            # The pod dialled back is one this dial reaches under another name: one stream is enough.
            self._give_up(twin, f"peer {peer.pod_name!r} is dialled as {peer.name}", now, out)
            self._forget(twin)
        return peer.pod_name

    def message(self, dial: Dial, message: internal_pb2.ProcessTasksInternalResponse, now: float,
                out: list[CoreEffect]) -> None:
        """A task (or a cancel) the peer forwarded on ``dial``."""
        peer = self._by_dial.get(dial)
        if peer is None or peer.dialled is None or peer.dialled.state not in _LIVE:
            return
        try:
            self._absorb_dialled(peer, peer.dialled.task_received(message, now), now, out)
        except PeerProtocolError as e:
            out.append(CancelDial(dial, f"broke the protocol: {e}"))
            self._ended(peer, now, out)

    def closed(self, dial: Dial, now: float, out: list[CoreEffect]) -> None:
        """``dial``'s stream ended: its forwarded tasks are cancelled, the peer redialled."""
        peer = self._by_dial.get(dial)
        if peer is not None:
            self._ended(peer, now, out)

    def relay(self, dial: Dial, effect: DeliverResult | FailRequest, now: float, out: list[CoreEffect]) -> None:
        """A result or failure of a task the peer forwarded on ``dial`` goes back on it."""
        peer = self._by_dial.get(dial)
        if peer is None or peer.dialled is None or peer.dialled.state not in _LIVE:
            return
        self._absorb_dialled(peer, peer.dialled.deliver(effect), now, out)

    def local_engines_changed(self, now: float, out: list[CoreEffect]) -> None:
        """Every open stream re-reports the local engines."""
        for peer in list(self.peers.values()):
            if peer.dialled is not None and peer.dialled.state in _LIVE:
                self._absorb_dialled(peer, peer.dialled.local_engines_changed(now), now, out)

    # --- time and stopping ---------------------------------------------------------------

    def handle_timeout(self, now: float, out: list[CoreEffect]) -> None:
        """Reports and redials that are due."""
        for peer in self._due.pop_due(now):  # in the order they were made, as in ``peers``
            dialled = peer.dialled
            if dialled is not None and dialled.state in _LIVE:
                report_at = dialled.next_deadline()
                if report_at is not None and report_at <= now:
                    self._absorb_dialled(peer, dialled.handle_timeout(now), now, out)
            if peer.redial_at is not None and peer.redial_at <= now and self.peers.get(peer.name) is peer:
                self._open(peer, now, out)
            self._touched(peer)

    def drain(self, now: float, out: list[CoreEffect]) -> None:
        """Graceful stop: open streams drain and half-close; dials not yet accepted are given up."""
        self.stopping = True
        for peer in list(self.peers.values()):
            dialled = peer.dialled
            if peer.dial is not None and not peer.accepted:
                self._give_up(peer, "gateway is draining", now, out)
                self._forget(peer)
            elif dialled is not None and dialled.state is DialledPeerState.OPEN:
                self._absorb_dialled(peer, dialled.shutdown(now), now, out)
            elif peer.dial is None:
                self._forget(peer)

    def stop(self, now: float, out: list[CoreEffect]) -> None:
        """Hard stop: every stream we dial is cancelled."""
        self.stopping = True
        for peer in list(self.peers.values()):
            self._give_up(peer, "gateway is stopping", now, out)
            self._forget(peer)

    # --- the record ----------------------------------------------------------------------

    def _open(self, peer: PeerDialling, now: float, out: list[CoreEffect]) -> None:
        peer.attempts += 1
        peer.accepted = peer.half_closed = False
        peer.redial_at = None
        dial = Dial(peer.name, peer.address, peer.attempts)
        dialled = DialledPeer(self.processor, DialledPeerConfig(self.config.pod_name, self.config.status_interval),
                              origin=dial, requests_started=self._requests_started,
                              local_statuses=self._local_statuses)
        peer.dial, peer.dialled = dial, dialled
        self._by_dial[dial] = peer
        out.append(OpenDial(dial))
        # Report at once, not after the headers: a server may send none before its first task.
        self._absorb_dialled(peer, dialled.connected(now), now, out)

    def _forget(self, peer: PeerDialling) -> None:
        peer.stopped = True
        peer.redial_at = None
        if self.peers.get(peer.name) is peer:
            del self.peers[peer.name]
        self._touched(peer)

    def _give_up(self, peer: PeerDialling, reason: str, now: float, out: list[CoreEffect]) -> None:
        """Cancel ``peer``'s stream now and forget the peer's redial."""
        peer.redial_at = None
        self._touched(peer)
        dial, dialled = peer.dial, peer.dialled
        if dial is None or dialled is None:
            return
        out.append(CancelDial(dial, reason))
        self._close_dial(peer, now, out)

    def _close_dial(self, peer: PeerDialling, now: float, out: list[CoreEffect]) -> None:
        dial, dialled = peer.dial, peer.dialled
        peer.dial = peer.dialled = None
        if dial is not None:
            del self._by_dial[dial]
        if dialled is not None and dialled.state is not DialledPeerState.CLOSED:
            self._absorb(dialled.closed(now), now, out)
        self._touched(peer)

    def _ended(self, peer: PeerDialling, now: float, out: list[CoreEffect]) -> None:
        self._close_dial(peer, now, out)
        peer.failures = 0 if peer.accepted else peer.failures + 1
        if self.peers.get(peer.name) is not peer:
            return  # replaced or given up
        if self.stopping or (peer.dialled_back and not self._dialled_in(peer.name)):
            # A dial-back lasts while its peer dials us: it is dialled back again when it does.
            self._forget(peer)
            return
        peer.redial_at = now + self.config.redial_backoff.delay(max(1, peer.failures), self._rng.random())
        self._touched(peer)

    def _absorb_dialled(self, peer: PeerDialling, outputs: Iterable[DialledPeerOutput], now: float,
                        out: list[CoreEffect]) -> None:
        dial, dialled = peer.dial, peer.dialled
        for output in outputs:
            if isinstance(output, SendToPeer):
                if dial is not None and not peer.half_closed:
                    out.append(SendOnDial(dial, output.message))
            else:
                self._absorb((output,), now, out)
        if dial is not None and dialled is not None and dialled.drained and not peer.half_closed \
                and peer.dial is dial:
            # Nothing more goes out on it; the peer ends the stream (``closed``).
            peer.half_closed = True
            out.append(HalfCloseDial(dial))
        self._touched(peer)

    def _touched(self, peer: PeerDialling) -> None:
        """``peer``'s dialled peer was called or its redial changed: keep when it is next due, and
        how many forwarded tasks it runs.

        Called after every input a dialled peer takes and every change of ``redial_at``, so that
        :meth:`next_deadline` reads the earliest peer from a heap instead of asking every one,
        and :attr:`forwarded_in_flight` is a sum kept as it changes."""
        due: float | None = None
        running = 0
        if self.peers.get(peer.name) is peer:
            dialled = peer.dialled
            report_at = dialled.next_deadline() if dialled is not None and dialled.state in _LIVE else None
            due = report_at if peer.redial_at is None else (
                peer.redial_at if report_at is None else min(report_at, peer.redial_at))
            running = dialled.tasks_in_flight if dialled is not None else 0
        self._due.set(peer, due, peer.order)
        self._forwarded_in_flight += running - self._forwarded.pop(peer, 0)
        if running:
            self._forwarded[peer] = running
