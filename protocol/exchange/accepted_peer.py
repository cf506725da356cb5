"""The accepted peer: this gateway's side of one ``ProcessTasksInternal`` stream a peer opened to it.

No I/O, no clock reads; time comes in as ``now``. The peer (its dialled peer)
reports the engines attached to it; the accepted peer registers them in the local
:class:`~protocol.processor.core.Processor` as remote engines (tenant from the
report) whose route is the accepted peer, or the object the adapter names as its
route. It removes those that disappear from a report and all of them when the
stream ends (their in-flight tasks fail over as the processor specifies).

Engine ids are chosen by each engine's operator (or default to the same
built-in name), so two gateways may each hold an engine of one id. Here a
peer's engine is named :func:`peer_engine_id` (its id scoped by the peer's
pod name), never its bare id: it cannot shadow a local engine or another
peer's, and every such engine serves every gateway. Tasks for it still carry
the id it reports (the processor keeps both), so the wire is LLMariner's.
A scoped name can still be taken on another route (a local engine named so,
or the stream of the same pod this one replaced): that registration is left
alone while it lasts; the accepted peer remembers the peer's last report and
registers the engine as soon as the processor says the other went
(``engines_removed``), since the peer re-reports only when something changes
on its side. Results the peer returns go into the
processor as results of the original tasks. A peer whose report says it is
``draining`` (infx's field 101) has its engines registered not ready, so they
get no new tasks from here whatever readiness they report. The per-model request counts of
the peer's last report are kept in :attr:`AcceptedPeer.requests_started` for the
autoscaler (a LLMariner peer sends none).

Reports are read by a :class:`~protocol.exchange.status_reports.ReportReader`: a full
snapshot replaces what the peer reported before; a delta (from an infx peer
this side's headers offered them to) adds or replaces the engines it carries
and removes those it lists. A report out of sequence is a protocol error,
which ends the stream: the peer's redial starts with a full snapshot.

Shape, for the Twisted adapter (one ``AcceptedPeer`` per accepted stream):

- ``message_received(request, now)`` for each ``ProcessTasksInternalRequest``;
  returns processor effects to perform.
- A ``SendTask`` or ``CancelTaskOnEngine`` effect whose ``route`` is this
  accepted peer's ``route`` is written on the stream with the engine's tenant id.
- ``engines_removed(keys, now)`` for every ``EnginesRemoved`` effect the
  processor emits (whatever input produced it); returns processor effects.
- ``closed(now)`` when the stream ends; returns processor effects.
"""

from __future__ import annotations

from protocol.exchange.status_reports import ReportReader
from protocol.pb import internal_pb2, status_pb2
from protocol.processor.core import Processor
from protocol.processor.effects import Effect
from protocol.processor.errors import PeerProtocolError, ProcessorUsageError
from protocol.processor.keys import EngineKey, Locality, Route

__all__ = ["AcceptedPeer", "peer_engine_id"]


def peer_engine_id(engine_id: str, pod_name: str) -> str:
    """What the engine ``engine_id`` that the gateway ``pod_name`` holds is named at its peers."""
    return f"{engine_id}@{pod_name}"


class AcceptedPeer:
    """Registers one peer's engines as remote engines and forwards their tasks."""

    def __init__(self, processor: Processor, route: Route | None = None) -> None:
        """``route`` is what the processor's effects name for this peer's engines:
        the adapter's own object for the stream, or by default this accepted peer."""
        self.processor = processor
        self.route: Route = self if route is None else route
        self.pod_name = ""
        # The peer's engines registered here, by their names here (peer_engine_id).
        self._engines: set[EngineKey] = set()
        # What the peer reports now, every engine of it by its reported id, registered here or not.
        self._reports = ReportReader()
        self._closed = False

    @property
    def peer_draining(self) -> bool:
        """The peer said it is draining (shutting down): its engines get no new tasks from here."""
        return self._reports.draining

    @property
    def requests_started(self) -> dict[str, int]:
        """Requests per model the peer accepted from its clients since it started, as last reported."""
        return self._reports.requests_started

    def message_received(self, request: internal_pb2.ProcessTasksInternalRequest, now: float) -> list[Effect]:
        """A status report or a task result from the peer.

        Raises :class:`PeerProtocolError` for a message with neither.
        """
        if self._closed:
            raise ProcessorUsageError("message received on a closed accepted peer")
        kind = request.WhichOneof("message")
        if kind == "server_status":
            return self._status_received(request.server_status, now)
        if kind == "task_result":
            return self.processor.receive_result(self.route, request.task_result, now)
        raise PeerProtocolError(f"peer {self.pod_name!r} sent an empty ProcessTasksInternalRequest")

    def closed(self, now: float) -> list[Effect]:
        """The stream ended: every engine it reported goes, and tasks sent on it fail over."""
        if self._closed:
            raise ProcessorUsageError("accepted peer closed twice")
        self._closed = True
        self._engines.clear()
        self._reports = ReportReader()
        return self.processor.close_route(self.route, f"peer {self.pod_name!r} disconnected", now)

    def engines_removed(self, keys: tuple[EngineKey, ...], now: float) -> list[Effect]:
        """Engines left the processor: register those the peer last reported, if nothing
        else has registered them meanwhile. A closed accepted peer registers nothing."""
        effects: list[Effect] = []
        if self._closed or not self._reports.engines:
            return effects
        suffix = peer_engine_id("", self.pod_name)
        for here in keys:
            if not here.engine_id.endswith(suffix):
                continue
            reported = EngineKey(here.tenant_id, here.engine_id[:-len(suffix)])
            if reported not in self._reports.engines or self.processor.engine(here.tenant_id, here.engine_id):
                continue
            self._engines.add(here)
            effects += self.processor.update_engine_as(self.route, here, self._effective(reported),
                                                       Locality.REMOTE, now)
        return effects

    @property
    def engines(self) -> frozenset[EngineKey]:
        """The engines this peer reported and this accepted peer registered, by their names here."""
        return frozenset(self._engines)

    def _here(self, reported: EngineKey) -> EngineKey:
        return EngineKey(reported.tenant_id, peer_engine_id(reported.engine_id, self.pod_name))

    def _effective(self, key: EngineKey) -> status_pb2.EngineStatus:
        """The peer's status of an engine as registered here: not ready while the peer drains."""
        reported = self._reports.engines[key]
        if not self._reports.draining:
            return reported
        status = status_pb2.EngineStatus()
        status.CopyFrom(reported)
        status.ready = False
        return status

    def _status_received(self, status: internal_pb2.ServerStatus, now: float) -> list[Effect]:
        if self._reports.engines and status.pod_name != self.pod_name:
            # Its engines are named with its pod here: a new name would orphan them.
            raise PeerProtocolError(f"peer {self.pod_name!r} now calls itself {status.pod_name!r}")
        self.pod_name = status.pod_name
        read = self._reports.read(status)
        effects: list[Effect] = []
        if read is None:
            return effects  # a repeat of a report already read
        # A change of the peer's draining re-registers every engine it reports, carried or not.
        updated = sorted(self._reports.engines, key=lambda k: (k.tenant_id, k.engine_id)) if read.draining_changed \
            else read.upserted
        for key in updated:
            here = self._here(key)
            known = self.processor.engine(here.tenant_id, here.engine_id)
            if known is not None and known.route is not self.route:
                # Its name is taken on another route: that registration stays until it goes
                # (engines_removed).
                self._engines.discard(here)
                continue
            self._engines.add(here)
            effects += self.processor.update_engine_as(self.route, here, self._effective(key), Locality.REMOTE, now)
        for key in sorted(read.removed, key=lambda k: (k.tenant_id, k.engine_id)):
            here = self._here(key)
            if here not in self._engines:
                continue
            self._engines.discard(here)
            known = self.processor.engine(here.tenant_id, here.engine_id)
            if known is not None and known.route is self.route:
                reason = f"no longer reported by peer {self.pod_name!r}"
                effects += self.processor.remove_engine(here.tenant_id, here.engine_id, reason, now)
        return effects
