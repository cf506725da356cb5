"""The gateway core: one processor with its accepted peers, dialled peers, request accounting and scaler signals.

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
  every open dialled peer re-report; ``EnginesRemoved`` lets every accepted peer
  register engines its peer reported meanwhile; a result or failure of a task
  a peer forwarded goes to that stream's dialled peer and leaves as one
  :class:`SendOnDial` (core -> adapter once).
- *Peers that dial us* (a :class:`~protocol.exchange.accepted_peer.AcceptedPeer` per accepted
  stream, made on its first report): a newer stream from the same pod
  replaces the older one; a task result before any ``ServerStatus`` ends the
  stream with FAILED_PRECONDITION, a malformed message with INVALID_ARGUMENT.
- *Peers we dial*: one stream each, redialled, drained on shutdown, kept by
  :class:`~protocol.gateway.dialling.Dialling`. A peer that dials us unasked is
  dialled back (``dial_back_after``, :mod:`protocol.exchange.dial_backs`): one-way
  peering would leave it without our engines.
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
- *Costs per input*: the local engines every dialled peer reports are one
  :class:`~protocol.exchange.status_reports.LocalStatuses`, refreshed once per change
  (``LocalEnginesChanged``, or a ``SendTask``: it may record a spilled tip).
- *The scaler*: a queued task is held once (``TaskQueued``); when it leaves the
  queue for an engine the model is served (:class:`ModelServed`), when it ends
  otherwise it is released (:class:`TaskReleased`); in-flight tasks per model
  are reported every ``load_interval`` (:class:`ReportLoad`).

Size (over 600 lines): it is the one object that joins the pure machines (processor, accepted
peer streams, dials, accounting, scaler signals), each input a short hand-over.
"""

from __future__ import annotations

import enum
import random
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from protocol.exchange.accepted_peer import AcceptedPeer
from protocol.exchange.dial_backs import POD_HEADER, DialBacks
from protocol.exchange.dialled_peer import DialledPeerOutput, SendToPeer
from protocol.exchange.status_reports import STATUS_DELTA_METADATA, LocalStatuses
from protocol.gateway.dialling import Dialling, PeerDialling
from protocol.gateway.effects import (
    CoreConfig,
    CoreEffect,
    Dial,
    EndPeerStream,
    ModelServed,
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
    TaskReleased,
)
from protocol.grpc import StatusCode
from protocol.grpc.metadata import Metadata
from protocol.openai.errors import ModelNotFoundError
from protocol.pb import internal_pb2, status_pb2, worker_pb2
from protocol.processor.core import Processor, TaskState
from protocol.processor.effects import (
    CloseEngine,
    CloseRoute,
    DeliverResult,
    EnginesRemoved,
    FailRequest,
    LocalEnginesChanged,
    SendTask,
    TaskQueued,
)
from protocol.processor.errors import PeerProtocolError
from protocol.processor.keys import Locality, Route

__all__ = ["Availability", "GatewayCore"]



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
        # Accepted peer streams and their accepted peers (None until the first report).
        self._accepted: dict[object, AcceptedPeer | None] = {}
        self._by_pod: dict[str, object] = {}
        # Where each accepted stream's peer says it can be dialled back, and when to (protocol/exchange/dial_backs.py).
        self._dial_back_at: dict[object, object] = {}
        self._dial_backs = DialBacks(config.dial_back_after)
        self._dialling = Dialling(processor, config, rng, self._absorb, lambda: self.requests_started,
                                  self._local_statuses, lambda pod: pod in self._by_pod)
        # The local engines as every dialled peer reports them: refreshed at most once per change
        # (LocalEnginesChanged, or a SendTask, which may record a spilled tip on a local engine).
        self._local = LocalStatuses()
        self._local_stale = True
        # Spilled tips recorded so far: a new one is reported to peers at once, since the
        # conversation's next turn may reach any of them as soon as this turn is answered.
        self._tips_reported = 0
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
        an engine attached here (peers' engines come through :meth:`accepted_peer_message`)."""
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

    # --- peers that dial us (accepted peers) ------------------------------------------------

    @property
    def accept_metadata(self) -> Metadata:
        """The response headers of a ProcessTasksInternal stream accepted here: this gateway reads
        status deltas, and its pod (so the dialler knows which pod its dial reached)."""
        return (*STATUS_DELTA_METADATA, (POD_HEADER, self.config.pod_name))

    def accepted_peer_opened(self, stream: object, dial_back: object | None, now: float) -> list[CoreEffect]:
        """A peer opened ``ProcessTasksInternal`` to us (already authenticated); ``dial_back`` is
        where its headers say it can be dialled (:func:`protocol.dial_backs.dial_back_address`)."""
        if self._dialling.stopping:
            return [EndPeerStream(stream, StatusCode.UNAVAILABLE,
                                  f"gateway {self.config.pod_name!r} is shutting down")]
        self._accepted[stream] = None
        if dial_back is not None:
            self._dial_back_at[stream] = dial_back
        return []

    def accepted_peer_message(self, stream: object, message: internal_pb2.ProcessTasksInternalRequest,
                            now: float) -> list[CoreEffect]:
        """A status report or task result on an accepted peer stream."""
        out: list[CoreEffect] = []
        if stream not in self._accepted:
            return out  # already ended here; the adapter learns it from the EndPeerStream it got
        accepted_peer = self._accepted[stream]
        try:
            if message.WhichOneof("message") == "server_status":
                self._server_status(stream, accepted_peer, message, now, out)
            elif accepted_peer is None:
                self._forget_accepted(stream, now, out)
                out.append(EndPeerStream(stream, StatusCode.FAILED_PRECONDITION,
                                         "a task result arrived before any ServerStatus"))
            else:
                self._absorb(accepted_peer.message_received(message, now), now, out)
        except PeerProtocolError as e:
            self._forget_accepted(stream, now, out)
            out.append(EndPeerStream(stream, StatusCode.INVALID_ARGUMENT, str(e)))
        return self._after(now, out, engines_changed=True)

    def accepted_peer_closed(self, stream: object, now: float) -> list[CoreEffect]:
        """An accepted peer stream ended: its engines go here and their tasks fail over."""
        out: list[CoreEffect] = []
        self._forget_accepted(stream, now, out)
        return self._after(now, out, engines_changed=True)

    def _server_status(self, stream: object, accepted_peer: AcceptedPeer | None, message: internal_pb2.ProcessTasksInternalRequest,
                       now: float, out: list[CoreEffect]) -> None:
        status = message.server_status
        pod = status.pod_name
        if accepted_peer is None:
            accepted_peer = AcceptedPeer(self.processor, route=stream)
            self._accepted[stream] = accepted_peer
            out.append(PeerDialledIn(stream, pod, len(status.engine_statuses)))
            self._dialling.redial_now(pod, now, out)
            if pod and self._dialling.dialled(pod) is None:
                self._dial_backs.dialled_in(pod, self._dial_back_at.get(stream), now)
        if status.draining and not accepted_peer.peer_draining:
            out.append(PeerDraining(stream, pod))
        older = self._by_pod.get(pod)
        if older is not None and older is not stream:
            # The peer reconnected: its older stream is stale.
            self._forget_accepted(older, now, out)
            out.append(EndPeerStream(older, StatusCode.UNAVAILABLE, f"peer {pod!r} reconnected or is gone"))
        self._absorb(accepted_peer.message_received(message, now), now, out)
        if pod:
            self._by_pod[pod] = stream
        out.append(PeerRequests(stream, dict(accepted_peer.requests_started)))

    def _dial_back(self, now: float, out: list[CoreEffect]) -> None:
        """Dial back each peer whose time came that still dials us unasked, or warn that it cannot be."""
        for pod, address in self._dial_backs.due(now):
            if self._dialling.stopping or pod not in self._by_pod or self._dialling.dialled(pod) is not None:
                continue
            if address is None:
                out.append(PeerOneWay(pod))
                continue
            out.append(PeerDialledBack(pod, address))
            self._dialling.dial_back(pod, address, now, out)

    def _forget_accepted(self, stream: object, now: float, out: list[CoreEffect]) -> None:
        self._dial_back_at.pop(stream, None)
        if stream not in self._accepted:
            return
        accepted_peer = self._accepted.pop(stream)
        if accepted_peer is None:
            return
        if self._by_pod.get(accepted_peer.pod_name) is stream:
            del self._by_pod[accepted_peer.pod_name]
        out.append(PeerDisconnected(stream, accepted_peer.pod_name, len(accepted_peer.engines)))
        self._absorb(accepted_peer.closed(now), now, out)
        out.append(PeerGone(stream))

    # --- peers we dial (protocol/gateway/dialling.py) ----------------------------------------

    def peers_changed(self, peers: Mapping[str, object], now: float) -> list[CoreEffect]:
        """The peers to dial now, by pod name, with their addresses: one stream each."""
        out: list[CoreEffect] = []
        if peers and self._learning_until is None:
            self._learning_until = now + self.config.learn_peers_within
        self._dialling.want(peers, now, out)
        return self._after(now, out)

    def dial_accepted(self, dial: Dial, metadata: Metadata, now: float) -> list[CoreEffect]:
        """The peer answered ``dial``'s stream with headers (``metadata``): it accepted it (and
        our secret); if they offer status deltas, its dialled peer sends them from now on."""
        out: list[CoreEffect] = []
        pod = self._dialling.accepted(dial, metadata, now, out)
        if pod is not None:
            self._dial_backs.settled(pod)
        return out

    def dial_message(self, dial: Dial, message: internal_pb2.ProcessTasksInternalResponse,
                     now: float) -> list[CoreEffect]:
        """A task (or a cancel) the peer forwarded on ``dial``."""
        out: list[CoreEffect] = []
        self._dialling.message(dial, message, now, out)
        return self._after(now, out)

    def dial_closed(self, dial: Dial, now: float) -> list[CoreEffect]:
        """``dial``'s stream ended, for whatever reason: its forwarded tasks are cancelled
        here, and the peer is redialled (unless it is no longer wanted or we shut down)."""
        out: list[CoreEffect] = []
        self._dialling.closed(dial, now, out)
        return self._after(now, out)

    @property
    def dialling(self) -> int:
        """Peers with a stream open or a redial due: 0 once a drain of the peer streams has finished."""
        return len(self._dialling.peers)

    @property
    def forwarded_in_flight(self) -> int:
        """Tasks peers forwarded on the streams we dial that have not ended, over every peer."""
        return self._dialling.forwarded_in_flight

    @property
    def peers(self) -> Mapping[str, PeerDialling]:
        """The peers dialled now, by pod name (read only)."""
        return self._dialling.peers

    @property
    def shutting_down(self) -> bool:
        return self._dialling.stopping

    def models_gone(self, tenant_id: str, now: float) -> list[str]:
        """The tenant's models no engine lists now that one listed within ``forget_models_after``
        (their requests are answered 503, see :attr:`Availability.GONE`), sorted."""
        listed = self.processor.known_models(tenant_id)
        return sorted(model for (tenant, model), seen in self._recent_models.items()
                      if tenant == tenant_id and model not in listed and now - seen < self.config.forget_models_after)

    def learning(self, now: float) -> bool:
        """Whether this gateway is still learning its peers' engines at start-up (a request for a
        model nobody lists yet waits, see :attr:`Availability.LEARNING`)."""
        return not self._learned and self._learning_until is not None and now < self._learning_until

    def _local_statuses(self) -> LocalStatuses:
        """The local engines for every dialled peer's report, refreshed only if they may have changed."""
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
        out: list[CoreEffect] = []
        self._dialling.drain(now, out)
        return self._after(now, out)

    def stop(self, now: float) -> list[CoreEffect]:
        """Hard stop of the peer exchange: every stream we dial is cancelled, every stream
        peers opened to us is ended."""
        out: list[CoreEffect] = []
        self._dialling.stop(now, out)
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
        candidates = [self.processor.next_deadline(), self._next_load, self._dialling.next_deadline(),
                      self._dial_backs.next_deadline()]
        if self._learning_models and not self._learned:
            candidates.append(self._learning_until)
        due = [t for t in candidates if t is not None]
        return min(due) if due else None

    def handle_timeout(self, now: float) -> list[CoreEffect]:
        """Time passed: the processor's timers, periodic reports to peers, redials, load reports."""
        out: list[CoreEffect] = []
        self._absorb(self.processor.handle_timeout(now), now, out)
        self._dialling.handle_timeout(now, out)
        self._dial_back(now, out)
        if self._next_load is not None and self._next_load <= now:
            self._next_load = now + self.config.load_interval
            self._report_load(out)
        return self._after(now, out, engines_changed=True)

    # --- effects between machines --------------------------------------------------------

    def _absorb(self, effects: Iterable[DialledPeerOutput], now: float, out: list[CoreEffect]) -> None:
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
                tips = self.processor.tips_recorded()
                if tips != self._tips_reported:  # it did: peers hear of it now, ahead of its answer
                    self._tips_reported = tips
                    self._dialling.local_engines_changed(now, out)
            elif isinstance(effect, (DeliverResult, FailRequest)):
                origin = effect.origin
                if isinstance(origin, Dial):
                    self._dialling.relay(origin, effect, now, out)
                    continue
                if isinstance(effect, FailRequest) or effect.last:
                    request = self._http.pop(effect.task_id, None)
                    if request is not None:
                        out.append(RequestFinished(request.model))
                out.append(effect)
            elif isinstance(effect, LocalEnginesChanged):
                self._local_stale = True
                self._dialling.local_engines_changed(now, out)
                if self._next_load is not None:
                    self._report_load(out)
            elif isinstance(effect, EnginesRemoved):
                for accepted_peer in [s for s in self._accepted.values() if s is not None]:
                    self._absorb(accepted_peer.engines_removed(effect.engines, now), now, out)
            elif isinstance(effect, TaskQueued):
                if self._can_start is not None:
                    if effect.task_id in self._held:
                        continue
                    self._held[effect.task_id] = effect.model_id
                out.append(effect)
            elif isinstance(effect, (CloseRoute, CloseEngine)):
                out.append(effect)
                if effect.route in self._accepted:
                    # Closed here: its accepted peer must not register engines on it meanwhile.
                    self._forget_accepted(effect.route, now, out)
            elif isinstance(effect, SendToPeer):
                raise AssertionError("dialled peer output outside _absorb_receiver")
            else:
                out.append(effect)

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
                               for name, peer in self._dialling.peers.items()):
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
