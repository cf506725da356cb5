"""The gateway core: one processor with its senders, receivers, request accounting and scaler signals.

Rules this file keeps: no I/O, no clock reads (``now`` is every input's last
argument, never defaulted), no randomness but the ``random.Random`` passed in.
Every decision that joins the pure machines lives here, so the Twisted
adapters (``infx/gateway/dispatcher.py``, ``infx/gateway/workers.py``, ``infx/exchange/exchanger.py``)
and the simulation (``harness/sim/``) drive this same object and only perform
what it returns: I/O effects (:mod:`protocol.gateway.effects`, plus the
processor's own ``SendTask``/``CancelTaskOnEngine``/``CloseEngine``/
``CloseRoute``/``DeliverResult``/``FailRequest``/``TaskQueued``), in order.
It wakes through ``next_deadline()`` / ``handle_timeout(now)``.

What it decides:

- *Effects between machines*: the processor's ``LocalEnginesChanged`` makes
  every open receiver re-report; ``EnginesRemoved`` lets every peer's sender
  register engines its peer reported meanwhile; a result or failure of a task
  a peer forwarded goes to that stream's receiver and leaves as one
  :class:`SendOnDial` (core -> adapter once).
- *Peers that dial us* (a :class:`~protocol.exchange.sender.Sender` per accepted
  stream, made on its first report): a newer stream from the same pod
  replaces the older one; a task result before any ``ServerStatus`` ends the
  stream with FAILED_PRECONDITION, a malformed message with INVALID_ARGUMENT.
- *Peers we dial* (a :class:`~protocol.exchange.receiver.Receiver` per stream): one
  stream per wanted peer at its current address, redialled after a jittered
  backoff that grows while the peer does not accept (with
  ``redial_when_dialled_in``, at once when that peer dials us: it is back);
  drained on shutdown. A peer that dials us unasked is dialled back
  (``dial_back_after``, :mod:`protocol.exchange.dial_backs`): one-way peering would
  leave it without our engines; a dial that turns out to reach a pod another
  dial reaches (the accepting side names its pod) gives up the dial-back.
- *Status deltas*: a stream accepted here answers with
  :attr:`GatewayCore.accept_metadata` in its headers (infx reads status deltas, and its pod);
  a dial whose peer answered so gets deltas after its first full report,
  any other (a LLMariner peer) full snapshots only
  (:mod:`protocol.exchange.status_reports`).
- *Accounting*: requests accepted from clients per model (reported to peers,
  and to the scaler as started/finished), and which models are gone (listed
  recently, 503) rather than unknown (404) on the clock; at start-up, until
  every dialled peer has reported (or ``learn_peers_within``), a model nobody
  lists yet may be a peer's: its requests wait (``LEARNING``), then get 404.
- *Costs per input*: each peer's next due time (its receiver's next report, or
  its redial) is re-read only after that receiver took an input or the redial
  changed, and kept in a heap, so :meth:`next_deadline` does not ask every
  peer; the local engines every receiver reports are one
  :class:`~protocol.exchange.status_reports.LocalStatuses`, refreshed once per change
  (``LocalEnginesChanged``, or a ``SendTask``: it may record a spilled tip).
- *The scaler*: a queued task is held once (``TaskQueued``); when it leaves the
  queue for an engine the model is served (:class:`ModelServed`), when it ends
  otherwise it is released (:class:`TaskReleased`); in-flight tasks per model
  are reported every ``load_interval`` (:class:`ReportLoad`).
"""

from __future__ import annotations

import enum
import itertools
import random
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from protocol.exchange.dial_backs import POD_HEADER, DialBacks, pod_of
from protocol.exchange.receiver import Receiver, ReceiverConfig, ReceiverOutput, ReceiverState, SendToPeer
from protocol.exchange.sender import Sender
from protocol.exchange.status_reports import STATUS_DELTA_METADATA, LocalStatuses, offers_deltas
from protocol.gateway.due_times import DueTimes
from protocol.gateway.effects import (
    CancelDial,
    CoreConfig,
    CoreEffect,
    Dial,
    EndPeerStream,
    HalfCloseDial,
    ModelServed,
    OpenDial,
    PeerDialledBack,
    PeerDialledIn,
    PeerDisconnected,
    PeerDraining,
    PeerGone,
    PeerOneWay,
    PeerRequests,
    ReportLoad,
    RequestDispatched,
    RequestFinished,
    RequestStarted,
    SendOnDial,
    TaskReleased,
)
from protocol.grpc import StatusCode
from protocol.grpc.metadata import Metadata
from protocol.openai.errors import ModelNotFoundError
from protocol.pb import internal_pb2, status_pb2, worker_pb2
from protocol.processor.core import Processor, TaskState
from protocol.processor.types import (
    CloseEngine,
    CloseRoute,
    DeliverResult,
    EnginesRemoved,
    FailRequest,
    Locality,
    LocalEnginesChanged,
    RemoteProtocolError,
    Route,
    SendTask,
    TaskQueued,
)

__all__ = ["Availability", "DialState", "DialledPeer", "GatewayCore"]

#: Receiver states in which a dial's stream takes messages.
_LIVE = (ReceiverState.OPEN, ReceiverState.DRAINING)


class Availability(enum.Enum):
    """What the gateway may promise a client about a model before accepting its task."""

    #: An engine of the tenant lists the model (ready or still loading): the task is routed or waits.
    SERVED = "served"
    #: No engine lists it, but one can be started (the scaler): the task waits for it.
    STARTABLE = "startable"
    #: Engines served it recently and none does now: 503, try again later.
    GONE = "gone"
    #: No engine lists it yet, but this gateway has only just started and not every peer has
    #: reported its engines: the task waits for their reports (404 if none lists it by then).
    LEARNING = "learning"
    #: Never served here and nothing can start it: 404.
    UNKNOWN = "unknown"


class _HttpRequest:
    __slots__ = ("origin", "model", "dispatched")

    def __init__(self, origin: object, model: str) -> None:
        self.origin = origin
        self.model = model
        self.dispatched = False


class DialState(enum.Enum):
    """Where a dialled peer is: its stream not yet accepted, accepted, waiting to redial,
    draining, or given up for good (no longer wanted, or this gateway stopped)."""

    CONNECTING = "connecting"
    OPEN = "open"
    BACKING_OFF = "backing off"
    DRAINING = "draining"
    STOPPED = "stopped"


class DialledPeer:
    """A peer this gateway dials: its current stream (if any) and its redial state.

    The core's own record; adapters and tests only read it.
    """

    __slots__ = ("name", "address", "order", "dial", "receiver", "accepted", "half_closed", "failures", "attempts",
                 "streams_opened", "redial_at", "stopped", "pod_name", "dialled_back")

    def __init__(self, name: str, address: object, order: int = 0, dialled_back: bool = False) -> None:
        self.name = name
        #: The pod the peer's headers named when it accepted our stream ("" until then, or LLMariner).
        self.pod_name = ""
        #: Dialled because it dialled us (named by its pod), not because the pod source lists it.
        self.dialled_back = dialled_back
        #: When the core made it, relative to the others: peers due at once are served in this order.
        self.order = order
        self.address = address
        self.dial: Dial | None = None
        self.receiver: Receiver | None = None
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
        if self.receiver is not None and self.receiver.state is ReceiverState.DRAINING:
            return DialState.DRAINING
        return DialState.OPEN if self.accepted else DialState.CONNECTING

    def __repr__(self) -> str:
        return f"<DialledPeer {self.name} {self.address} {self.state.value}>"


class GatewayCore:
    """The gateway's decisions in one pure object; see the module docstring."""

    def __init__(self, processor: Processor, config: CoreConfig, rng: random.Random) -> None:
        self.processor = processor
        self.config = config
        self._rng = rng
        #: Requests accepted from clients since start, per model (never tasks peers forwarded).
        self.requests_started: dict[str, int] = {}
        self._recent_models: dict[tuple[str, str], float] = {}
        self._http: dict[str, _HttpRequest] = {}
        # Accepted peer streams and their senders (None until the first report).
        self._accepted: dict[object, Sender | None] = {}
        self._by_pod: dict[str, object] = {}
        # Where each accepted stream's peer says it can be dialled back, and when to (protocol/exchange/dial_backs.py).
        self._dial_back_at: dict[object, object] = {}
        self._dial_backs = DialBacks(config.dial_back_after)
        self._peers: dict[str, DialledPeer] = {}
        self._by_dial: dict[Dial, DialledPeer] = {}
        self._made = itertools.count()
        # When each peer is next due: its receiver's next report, or its redial.
        self._due: DueTimes[DialledPeer] = DueTimes()
        # Tasks each peer forwarded on our stream to it that have not ended, and their sum.
        self._forwarded: dict[DialledPeer, int] = {}
        self._forwarded_in_flight = 0
        # The local engines as every receiver reports them: refreshed at most once per change
        # (LocalEnginesChanged, or a SendTask, which may record a spilled tip on a local engine).
        self._local = LocalStatuses()
        self._local_stale = True
        self._shutting_down = False
        # The scaler, once attached: what it can start, the tasks it holds, the load it heard.
        self._can_start: Callable[[str, str], bool] | None = None
        self._held: dict[str, str] = {}
        self._load_reported: set[str] = set()
        self._next_load: float | None = None
        # Start-up: until every peer we dial has reported to us, or ``learn_peers_within`` after
        # the first peers were known, a model nobody lists yet may be a peer's (see LEARNING).
        self._learning_until: float | None = None
        self._learned = False
        self._learning_models: set[tuple[str, str]] = set()

    # --- HTTP requests -----------------------------------------------------------

    def submit(self, origin: object, task_id: str, tenant_id: str, model: str, request: worker_pb2.TaskRequest,
               header: Mapping[str, list[str]], deadline: float | None, now: float, **routing: Any) -> list[CoreEffect]:
        """A client's request was admitted; ``origin`` is its handle in the effects.
        ``routing``: further keyword arguments of :meth:`Processor.submit`."""
        self.requests_started[model] = self.requests_started.get(model, 0) + 1
        self._http[task_id] = _HttpRequest(origin, model)
        out: list[CoreEffect] = [RequestStarted(model)]
        self._absorb(self.processor.submit(
            task_id=task_id,
            tenant_id=tenant_id,
            request=request,
            origin=origin,
            header=header,
            deadline=deadline,
            **routing,
            now=now,
        ), now, out)
        return self._after(now, out)

    def cancel(self, task_id: str, now: float) -> list[CoreEffect]:
        """The client went away: its request ends here and its task stops."""
        request = self._http.pop(task_id, None)
        if request is None:
            return []
        out: list[CoreEffect] = [RequestFinished(request.model)]
        self._absorb(self.processor.cancel(task_id, now), now, out)
        return self._after(now, out)

    def results_consumed(self, task_id: str, count: int, now: float) -> list[CoreEffect]:
        """``count`` more results of ``task_id`` were written out to its client."""
        self.processor.results_consumed(task_id, count)
        return []

    def availability(self, tenant_id: str, model: str, now: float) -> Availability:
        """Whether the tenant's engines serve ``model``, could (the scaler), did recently, or never did."""
        if self.processor.serves(tenant_id, model):
            self._recent_models[(tenant_id, model)] = now
            return Availability.SERVED
        if self.can_start(tenant_id, model):
            return Availability.STARTABLE
        last_seen = self._recent_models.get((tenant_id, model))
        if last_seen is not None and now - last_seen < self.config.forget_models_after:
            return Availability.GONE
        if not self._learned and self._learning_until is not None and now < self._learning_until:
            self._learning_models.add((tenant_id, model))
            return Availability.LEARNING
        return Availability.UNKNOWN

    # --- local engines ---------------------------------------------------------------

    def engine_status(self, stream: Route, tenant_id: str, status: status_pb2.EngineStatus, locality: Locality,
                      now: float) -> list[CoreEffect]:
        """An ``EngineStatus`` on an engine's stream (authenticated for ``tenant_id``): ``LOCAL`` for
        an engine attached here (peers' engines come through :meth:`peer_stream_message`)."""
        out: list[CoreEffect] = []
        self._absorb(self.processor.update_engine(stream, tenant_id, status, locality, now), now, out)
        return self._after(now, out, engines_changed=True)

    def engine_result(self, stream: Route, result: worker_pb2.TaskResult, now: float) -> list[CoreEffect]:
        """A ``TaskResult`` on a local engine's stream."""
        out: list[CoreEffect] = []
        self._absorb(self.processor.receive_result(stream, result, now), now, out)
        return self._after(now, out)

    def engine_closed(self, stream: Route, reason: str, now: float) -> list[CoreEffect]:
        """A local engine's stream ended: its engines go and their tasks fail over."""
        out: list[CoreEffect] = []
        self._absorb(self.processor.close_route(stream, reason, now), now, out)
        return self._after(now, out, engines_changed=True)

    # --- sends on routes (engine streams and accepted peer streams) ------------------

    def task_not_sent(self, route: Route, wire_id: str, now: float) -> list[CoreEffect]:
        """A ``SendTask`` found its route already closed."""
        out: list[CoreEffect] = []
        self._absorb(self.processor.dispatch_failed(wire_id, "engine stream closed", route=route, now=now), now, out)
        return self._after(now, out)

    def cancel_unsent(self, route: Route, cancel_wire_id: str, now: float) -> list[CoreEffect]:
        """The task a ``CancelTaskOnEngine`` stops was taken back from its route's queue
        before any of it was sent, so the cancel (``cancel_wire_id``) is not sent either:
        no answer to it will come."""
        out: list[CoreEffect] = []
        self._absorb(self.processor.dispatch_failed(cancel_wire_id, "its task was withdrawn unsent",
                                                    route=route, now=now), now, out)
        return self._after(now, out)

    def task_refused(self, route: Route, wire_id: str, now: float) -> list[CoreEffect]:
        """A route at its cap of queued bytes did not take a ``SendTask``: routed again at once
        (an HTTP request's wait in the queue goes on)."""
        out: list[CoreEffect] = []
        request = self._http.get(self.processor.attempt_owner(wire_id) or "")
        if request is not None:
            request.dispatched = False
        self._absorb(self.processor.dispatch_refused(wire_id, route, now), now, out)
        return self._after(now, out)

    def route_blocked(self, route: Route, now: float) -> list[CoreEffect]:
        """A route's stream stopped draining: it gets no tasks until :meth:`route_writable`."""
        out: list[CoreEffect] = []
        self._absorb(self.processor.route_blocked(route, now), now, out)
        return self._after(now, out)

    def route_writable(self, route: Route, now: float) -> list[CoreEffect]:
        """A blocked route drains again."""
        out: list[CoreEffect] = []
        self._absorb(self.processor.route_writable(route, now), now, out)
        return self._after(now, out)

    # --- peers that dial us (senders) ------------------------------------------------

    @property
    def accept_metadata(self) -> Metadata:
        """The response headers of a ProcessTasksInternal stream accepted here: this gateway reads
        status deltas, and its pod (so the dialler knows which pod its dial reached)."""
        return (*STATUS_DELTA_METADATA, (POD_HEADER, self.config.pod_name))

    def peer_stream_opened(self, stream: object, dial_back: object | None, now: float) -> list[CoreEffect]:
        """A peer opened ``ProcessTasksInternal`` to us (already authenticated); ``dial_back`` is
        where its headers say it can be dialled (:func:`protocol.dial_backs.dial_back_address`)."""
        if self._shutting_down:
            return [EndPeerStream(stream, StatusCode.UNAVAILABLE,
                                  f"gateway {self.config.pod_name!r} is shutting down")]
        self._accepted[stream] = None
        if dial_back is not None:
            self._dial_back_at[stream] = dial_back
        return []

    def peer_stream_message(self, stream: object, message: internal_pb2.ProcessTasksInternalRequest,
                            now: float) -> list[CoreEffect]:
        """A status report or task result on an accepted peer stream."""
        out: list[CoreEffect] = []
        if stream not in self._accepted:
            return out  # already ended here; the adapter learns it from the EndPeerStream it got
        sender = self._accepted[stream]
        try:
            if message.WhichOneof("message") == "server_status":
                self._server_status(stream, sender, message, now, out)
            elif sender is None:
                self._forget_accepted(stream, now, out)
                out.append(EndPeerStream(stream, StatusCode.FAILED_PRECONDITION,
                                         "a task result arrived before any ServerStatus"))
            else:
                self._absorb(sender.message_received(message, now), now, out)
        except RemoteProtocolError as e:
            self._forget_accepted(stream, now, out)
            out.append(EndPeerStream(stream, StatusCode.INVALID_ARGUMENT, str(e)))
        return self._after(now, out, engines_changed=True)

    def peer_stream_closed(self, stream: object, now: float) -> list[CoreEffect]:
        """An accepted peer stream ended: its engines go here and their tasks fail over."""
        out: list[CoreEffect] = []
        self._forget_accepted(stream, now, out)
        return self._after(now, out, engines_changed=True)

    def _server_status(self, stream: object, sender: Sender | None, message: internal_pb2.ProcessTasksInternalRequest,
                       now: float, out: list[CoreEffect]) -> None:
        status = message.server_status
        pod = status.pod_name
        if sender is None:
            sender = Sender(self.processor, route=stream)
            self._accepted[stream] = sender
            out.append(PeerDialledIn(stream, pod, len(status.engine_statuses)))
            self._redial_now(pod, now, out)
            if pod and not self._dials(pod):
                self._dial_backs.dialled_in(pod, self._dial_back_at.get(stream), now)
        if status.draining and not sender.peer_draining:
            out.append(PeerDraining(stream, pod))
        older = self._by_pod.get(pod)
        if older is not None and older is not stream:
            # The peer reconnected: its older stream is stale.
            self._forget_accepted(older, now, out)
            out.append(EndPeerStream(older, StatusCode.UNAVAILABLE, f"peer {pod!r} reconnected or is gone"))
        self._absorb(sender.message_received(message, now), now, out)
        if pod:
            self._by_pod[pod] = stream
        out.append(PeerRequests(stream, dict(sender.requests_started)))

    def _redial_now(self, pod: str, now: float, out: list[CoreEffect]) -> None:
        """A peer we wait to redial has just dialled us: it is up again (a restart), so the
        backoff its outage grew would only delay its learning of our engines."""
        if not self.config.redial_when_dialled_in or self._shutting_down:
            return
        peer = self._dialled(pod)
        if peer is not None and peer.dial is None and peer.redial_at is not None:
            self._open(peer, now, out)

    def _dialled(self, pod: str) -> DialledPeer | None:
        """Our dial meant for ``pod`` (by name) or that reached it (by its headers), if any."""
        return self._peers.get(pod) or next((peer for peer in self._peers.values() if peer.pod_name == pod), None)

    def _dials(self, pod: str) -> bool:
        return self._dialled(pod) is not None

    def _dial_back(self, now: float, out: list[CoreEffect]) -> None:
        """Dial back each peer whose time came that still dials us unasked, or warn that it cannot be."""
        for pod, address in self._dial_backs.due(now):
            if self._shutting_down or pod not in self._by_pod or self._dials(pod):
                continue
            if address is None:
                out.append(PeerOneWay(pod))
                continue
            peer = DialledPeer(pod, address, next(self._made), dialled_back=True)
            self._peers[pod] = peer
            out.append(PeerDialledBack(pod, address))
            self._open(peer, now, out)

    def _forget_accepted(self, stream: object, now: float, out: list[CoreEffect]) -> None:
        self._dial_back_at.pop(stream, None)
        if stream not in self._accepted:
            return
        sender = self._accepted.pop(stream)
        if sender is None:
            return
        if self._by_pod.get(sender.pod_name) is stream:
            del self._by_pod[sender.pod_name]
        out.append(PeerDisconnected(stream, sender.pod_name, len(sender.engines)))
        self._absorb(sender.closed(now), now, out)
        out.append(PeerGone(stream))

    # --- peers we dial (receivers) ---------------------------------------------------

    def peers_changed(self, peers: Mapping[str, object], now: float) -> list[CoreEffect]:
        """The peers to dial now, by pod name, with their addresses: one stream each."""
        out: list[CoreEffect] = []
        if peers and self._learning_until is None:
            self._learning_until = now + self.config.learn_peers_within
        for name in sorted(set(self._peers) | set(peers)):
            desired = None if self._shutting_down else peers.get(name)
            peer = self._peers.get(name)
            if peer is not None and peer.dialled_back and name not in peers and not self._shutting_down:
                continue  # ours to keep while the peer dials us; the source now naming it takes it over
            if peer is not None and (desired != peer.address or peer.dialled_back):
                self._give_up(peer, "peer left or moved", now, out)
                self._forget_peer(peer)
                peer = None
            if peer is None and desired is not None:
                peer = DialledPeer(name, desired, next(self._made))
                self._peers[name] = peer
                self._open(peer, now, out)
        return self._after(now, out)

    def dial_accepted(self, dial: Dial, metadata: Metadata, now: float) -> list[CoreEffect]:
        """The peer answered ``dial``'s stream with headers (``metadata``): it accepted it (and
        our secret); if they offer status deltas, its receiver sends them from now on."""
        out: list[CoreEffect] = []
        peer = self._by_dial.get(dial)
        if peer is not None and not peer.accepted:
            peer.accepted = True
            peer.streams_opened += 1
            receiver = peer.receiver
            if receiver is not None and receiver.state in _LIVE and offers_deltas(metadata):
                self._absorb_receiver(peer, receiver.deltas_offered(now), now, out)
            peer.pod_name = pod_of(metadata)
            self._dial_backs.settled(peer.pod_name)
            twin = self._peers.get(peer.pod_name)
            if twin is not None and twin is not peer and twin.dialled_back:
                # The pod dialled back is one this dial reaches under another name: one stream is enough.
                self._give_up(twin, f"peer {peer.pod_name!r} is dialled as {peer.name}", now, out)
                self._forget_peer(twin)
        return out

    def dial_message(self, dial: Dial, message: internal_pb2.ProcessTasksInternalResponse,
                     now: float) -> list[CoreEffect]:
        """A task (or a cancel) the peer forwarded on ``dial``."""
        out: list[CoreEffect] = []
        peer = self._by_dial.get(dial)
        if peer is None or peer.receiver is None or peer.receiver.state not in _LIVE:
            return out
        try:
            self._absorb_receiver(peer, peer.receiver.task_received(message, now), now, out)
        except RemoteProtocolError as e:
            out.append(CancelDial(dial, f"broke the protocol: {e}"))
            self._dial_ended(peer, now, out)
        return self._after(now, out)

    def dial_closed(self, dial: Dial, now: float) -> list[CoreEffect]:
        """``dial``'s stream ended, for whatever reason: its forwarded tasks are cancelled
        here, and the peer is redialled (unless it is no longer wanted or we shut down)."""
        out: list[CoreEffect] = []
        peer = self._by_dial.get(dial)
        if peer is not None:
            self._dial_ended(peer, now, out)
        return self._after(now, out)

    @property
    def dialling(self) -> int:
        """Peers with a stream open or a redial due: 0 once a drain of the peer streams has finished."""
        return len(self._peers)

    @property
    def forwarded_in_flight(self) -> int:
        """Tasks peers forwarded on the streams we dial that have not ended, over every peer."""
        return self._forwarded_in_flight

    @property
    def peers(self) -> Mapping[str, DialledPeer]:
        """The peers dialled now, by pod name (read only)."""
        return self._peers

    @property
    def shutting_down(self) -> bool:
        return self._shutting_down

    def _open(self, peer: DialledPeer, now: float, out: list[CoreEffect]) -> None:
        peer.attempts += 1
        peer.accepted = peer.half_closed = False
        peer.redial_at = None
        dial = Dial(peer.name, peer.address, peer.attempts)
        receiver = Receiver(self.processor, ReceiverConfig(self.config.pod_name, self.config.status_interval),
                            origin=dial, requests_started=lambda: self.requests_started,
                            local_statuses=self._local_statuses)
        peer.dial, peer.receiver = dial, receiver
        self._by_dial[dial] = peer
        out.append(OpenDial(dial))
        # Report at once, not after the headers: a server may send none before its first task.
        self._absorb_receiver(peer, receiver.connected(now), now, out)

    def _forget_peer(self, peer: DialledPeer) -> None:
        peer.stopped = True
        peer.redial_at = None
        if self._peers.get(peer.name) is peer:
            del self._peers[peer.name]
        self._peer_touched(peer)

    def _give_up(self, peer: DialledPeer, reason: str, now: float, out: list[CoreEffect]) -> None:
        """Cancel ``peer``'s stream now and forget the peer's redial."""
        peer.redial_at = None
        self._peer_touched(peer)
        dial, receiver = peer.dial, peer.receiver
        if dial is None or receiver is None:
            return
        out.append(CancelDial(dial, reason))
        self._close_dial(peer, now, out)

    def _close_dial(self, peer: DialledPeer, now: float, out: list[CoreEffect]) -> None:
        dial, receiver = peer.dial, peer.receiver
        peer.dial = peer.receiver = None
        if dial is not None:
            del self._by_dial[dial]
        if receiver is not None and receiver.state is not ReceiverState.CLOSED:
            self._absorb(receiver.closed(now), now, out)
        self._peer_touched(peer)

    def _dial_ended(self, peer: DialledPeer, now: float, out: list[CoreEffect]) -> None:
        self._close_dial(peer, now, out)
        peer.failures = 0 if peer.accepted else peer.failures + 1
        if self._peers.get(peer.name) is not peer:
            return  # replaced or given up
        if self._shutting_down or (peer.dialled_back and peer.name not in self._by_pod):
            # A dial-back lasts while its peer dials us: it is dialled back again when it does.
            self._forget_peer(peer)
            return
        peer.redial_at = now + self.config.redial_backoff.delay(max(1, peer.failures), self._rng.random())
        self._peer_touched(peer)

    def _absorb_receiver(self, peer: DialledPeer, outputs: Iterable[ReceiverOutput], now: float,
                         out: list[CoreEffect]) -> None:
        dial, receiver = peer.dial, peer.receiver
        for output in outputs:
            if isinstance(output, SendToPeer):
                if dial is not None and not peer.half_closed:
                    out.append(SendOnDial(dial, output.message))
            else:
                self._absorb((output,), now, out)
        if dial is not None and receiver is not None and receiver.drained and not peer.half_closed \
                and peer.dial is dial:
            # Nothing more goes out on it; the peer ends the stream (dial_closed).
            peer.half_closed = True
            out.append(HalfCloseDial(dial))
        self._peer_touched(peer)

    def _peer_touched(self, peer: DialledPeer) -> None:
        """``peer``'s receiver was called or its redial changed: keep when it is next due, and
        how many forwarded tasks it runs.

        Called after every input a receiver takes and every change of ``redial_at``, so that
        :meth:`next_deadline` reads the earliest peer from a heap instead of asking every one,
        and :attr:`forwarded_in_flight` is a sum kept as it changes."""
        due: float | None = None
        running = 0
        if self._peers.get(peer.name) is peer:
            receiver = peer.receiver
            report_at = receiver.next_deadline() if receiver is not None and receiver.state in _LIVE else None
            due = report_at if peer.redial_at is None else (
                peer.redial_at if report_at is None else min(report_at, peer.redial_at))
            running = receiver.tasks_in_flight if receiver is not None else 0
        self._due.set(peer, due, peer.order)
        self._forwarded_in_flight += running - self._forwarded.pop(peer, 0)
        if running:
            self._forwarded[peer] = running

    def _local_statuses(self) -> LocalStatuses:
        """The local engines for every receiver's report, refreshed only if they may have changed."""
        if self._local_stale:
            self._local.refresh(self.processor.local_engines())
            self._local_stale = False
        return self._local

    # --- shutdown ----------------------------------------------------------------------

    def go_away(self, now: float) -> list[CoreEffect]:
        """Ask local engines to reconnect elsewhere (their tasks go on)."""
        out: list[CoreEffect] = []
        self._absorb(self.processor.go_away(now), now, out)
        return self._after(now, out, engines_changed=True)

    def drain(self, now: float) -> list[CoreEffect]:
        """Shutdown: local engines go away; what no peer's engine can take fails at once with 503."""
        out: list[CoreEffect] = []
        self._absorb(self.processor.drain(now), now, out)
        return self._after(now, out)

    def drain_peers(self, now: float) -> list[CoreEffect]:
        """Graceful stop of the peer exchange: streams we dial report every engine not ready,
        finish their forwarded tasks, then half-close; no redials; new peer streams are refused.
        A dial its peer has not accepted yet carries no task: it is given up (a peer whose port
        takes connections but does not answer, as a restarting worker's, would hold the drain)."""
        self._shutting_down = True
        out: list[CoreEffect] = []
        for peer in list(self._peers.values()):
            receiver = peer.receiver
            if peer.dial is not None and not peer.accepted:
                self._give_up(peer, "gateway is draining", now, out)
                self._forget_peer(peer)
            elif receiver is not None and receiver.state is ReceiverState.OPEN:
                self._absorb_receiver(peer, receiver.shutdown(now), now, out)
            elif peer.dial is None:
                self._forget_peer(peer)
        return self._after(now, out)

    def stop(self, now: float) -> list[CoreEffect]:
        """Hard stop of the peer exchange: every stream we dial is cancelled, every stream
        peers opened to us is ended."""
        self._shutting_down = True
        out: list[CoreEffect] = []
        for peer in list(self._peers.values()):
            self._give_up(peer, "gateway is stopping", now, out)
            self._forget_peer(peer)
        for stream in list(self._accepted):
            self._forget_accepted(stream, now, out)
            out.append(EndPeerStream(stream, StatusCode.UNAVAILABLE,
                                     f"gateway {self.config.pod_name!r} is shutting down"))
        return self._after(now, out, engines_changed=True)

    # --- the scaler ----------------------------------------------------------------------

    def scaler_attached(self, can_start: Callable[[str, str], bool], now: float) -> list[CoreEffect]:
        """A scaler holds queued tasks through cold starts; ``can_start(tenant, model)`` says
        whether it could start an engine for a model none serves."""
        self._can_start = can_start
        self._next_load = now + self.config.load_interval
        return []

    def can_start(self, tenant_id: str, model: str) -> bool:
        """Whether an attached scaler could start an engine for ``model``."""
        return self._can_start is not None and self._can_start(tenant_id, model)

    def scaler_detached(self, now: float) -> list[CoreEffect]:
        """The scaler stops: no more load reports (held tasks stay in the queue)."""
        self._next_load = None
        return []

    def scaler_gave_up(self, model: str, status: int, message: str, now: float) -> list[CoreEffect]:
        """The scaler cannot start ``model`` (crash loop, start-up timeout): every tenant's
        waiting tasks for it fail with its status and reason."""
        out: list[CoreEffect] = []
        for tenant, waiting_model in sorted(self.processor.waiting_counts()):
            if waiting_model == model:
                self._absorb(self.processor.fail_waiting(tenant, model, status, message, now), now, out)
        return self._after(now, out)

    # --- time --------------------------------------------------------------------------

    def next_deadline(self) -> float | None:
        """When :meth:`handle_timeout` must next be called, or None."""
        candidates = [self.processor.next_deadline(), self._next_load, self._due.earliest(),
                      self._dial_backs.next_deadline()]
        if self._learning_models and not self._learned:
            candidates.append(self._learning_until)
        due = [t for t in candidates if t is not None]
        return min(due) if due else None

    def handle_timeout(self, now: float) -> list[CoreEffect]:
        """Time passed: the processor's timers, periodic reports to peers, redials, load reports."""
        out: list[CoreEffect] = []
        self._absorb(self.processor.handle_timeout(now), now, out)
        for peer in self._due.pop_due(now):  # in the order they were made, as in ``_peers``
            receiver = peer.receiver
            if receiver is not None and receiver.state in _LIVE:
                report_at = receiver.next_deadline()
                if report_at is not None and report_at <= now:
                    self._absorb_receiver(peer, receiver.handle_timeout(now), now, out)
            if peer.redial_at is not None and peer.redial_at <= now and self._peers.get(peer.name) is peer:
                self._open(peer, now, out)
            self._peer_touched(peer)
        self._dial_back(now, out)
        if self._next_load is not None and self._next_load <= now:
            self._next_load = now + self.config.load_interval
            self._report_load(out)
        return self._after(now, out, engines_changed=True)

    # --- effects between machines --------------------------------------------------------

    def _absorb(self, effects: Iterable[ReceiverOutput], now: float, out: list[CoreEffect]) -> None:
        """Append what the adapter must do for ``effects``; effects for other machines are
        fed to them here, in place, so the order is the order they happened in."""
        for effect in effects:
            if isinstance(effect, SendTask):
                self._local_stale = True  # the task may have recorded a spilled tip on a local engine
                out.append(effect)
                request = self._http.get(self.processor.attempt_owner(effect.task.id) or "")
                if request is not None and not request.dispatched:
                    request.dispatched = True
                    out.append(RequestDispatched(request.origin, effect.task.id))
            elif isinstance(effect, (DeliverResult, FailRequest)):
                origin = effect.origin
                if isinstance(origin, Dial):
                    self._relay(origin, effect, now, out)
                    continue
                if isinstance(effect, FailRequest) or effect.last:
                    request = self._http.pop(effect.task_id, None)
                    if request is not None:
                        out.append(RequestFinished(request.model))
                out.append(effect)
            elif isinstance(effect, LocalEnginesChanged):
                self._local_stale = True
                for peer in list(self._peers.values()):
                    if peer.receiver is not None and peer.receiver.state in _LIVE:
                        self._absorb_receiver(peer, peer.receiver.local_engines_changed(now), now, out)
                if self._next_load is not None:
                    self._report_load(out)
            elif isinstance(effect, EnginesRemoved):
                for sender in [s for s in self._accepted.values() if s is not None]:
                    self._absorb(sender.engines_removed(effect.engines, now), now, out)
            elif isinstance(effect, TaskQueued):
                if self._can_start is not None:
                    if effect.task_id in self._held:
                        continue
                    self._held[effect.task_id] = effect.model_id
                out.append(effect)
            elif isinstance(effect, (CloseRoute, CloseEngine)):
                out.append(effect)
                if effect.route in self._accepted:
                    # Closed here: its sender must not register engines on it meanwhile.
                    self._forget_accepted(effect.route, now, out)
            elif isinstance(effect, SendToPeer):
                raise AssertionError("receiver output outside _absorb_receiver")
            else:
                out.append(effect)

    def _relay(self, dial: Dial, effect: DeliverResult | FailRequest, now: float, out: list[CoreEffect]) -> None:
        peer = self._by_dial.get(dial)
        if peer is None or peer.receiver is None or peer.receiver.state not in _LIVE:
            return
        self._absorb_receiver(peer, peer.receiver.deliver(effect), now, out)

    def _after(self, now: float, out: list[CoreEffect], engines_changed: bool = False) -> list[CoreEffect]:
        if engines_changed:
            for tenant in self.processor.tenants():
                for model in self.processor.known_models(tenant):
                    self._recent_models[(tenant, model)] = now
        if self._held:
            self._check_held(out)
        if not self._learned and self._learning_until is not None:
            self._check_learned(self._learning_until, now, out)
        return out

    def _check_learned(self, until: float, now: float, out: list[CoreEffect]) -> None:
        """Start-up learning ends once every peer we dial has reported, or its time is up; a
        request that waited for a model no engine has listed since then gets its 404."""
        if now < until and any(name not in self._by_pod and peer.pod_name not in self._by_pod
                               for name, peer in self._peers.items()):
            return
        self._learned = True
        models, self._learning_models = self._learning_models, set()
        for tenant, model in sorted(models):
            if model not in self.processor.known_models(tenant) and (tenant, model) not in self._recent_models:
                unknown = ModelNotFoundError(model)
                self._absorb(self.processor.fail_waiting(tenant, model, unknown.status, unknown.message, now), now, out)

    def _check_held(self, out: list[CoreEffect]) -> None:
        served: set[str] = set()
        gone: list[str] = []
        for task_id, model in self._held.items():
            if not self.processor.has_task(task_id):
                gone.append(task_id)
            elif self.processor.task_state(task_id) is not TaskState.WAITING:
                served.add(model)
        for model in sorted(served):
            out.append(ModelServed(model))
        # The scaler resolves every task it held for a served model.
        self._held = {task_id: model for task_id, model in self._held.items() if model not in served}
        for task_id in gone:
            if self._held.pop(task_id, None) is not None:
                out.append(TaskReleased(task_id))

    def _report_load(self, out: list[CoreEffect]) -> None:
        in_flight: dict[str, int] = {}
        for (_, model), count in self.processor.in_flight_counts().items():
            in_flight[model] = in_flight.get(model, 0) + count
        for model in sorted(self._load_reported - in_flight.keys()):
            out.append(ReportLoad(model, 0))
        for model, count in sorted(in_flight.items()):
            out.append(ReportLoad(model, count))
        self._load_reported = set(in_flight)
