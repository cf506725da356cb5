"""Workers of one supervisor as peers: who dials whom, and what a worker takes from its siblings.

Rules this file keeps: no I/O, no clock reads; values in, values out.

Every worker is a gateway of its own with its own internal port, so every other gateway
must dial each of them (reports flow from the dialler: a gateway that dials only one
worker of a pod learns only that worker's engines, and only that worker learns its own).
A peer's ``--peers`` entry or its pod (``--kube``) names one port, so each accepting
worker lists the internal ports of all its supervisor's workers in its response headers
(:data:`WORKERS_HEADER`), and a dialler adds the others at the same host
(:class:`WorkerPeers`). Siblings are dialled at the addresses the supervisor gave them.

Engines a worker runs in its own process (the built-in echo engine; runtimes by URL) are
run by every worker alike, and say so with the capability :data:`IN_EVERY_WORKER` in
their status: a sibling's copy is dropped from what it reports (:class:`SiblingCopies`),
so each worker serves them itself and never forwards to a sibling what it can send
straight to the runtime. Other gateways get them from every worker, as any engine.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping

from protocol.discovery.peers import PeerAddress
from protocol.pb import internal_pb2

__all__ = ["IN_EVERY_WORKER", "WORKERS_HEADER", "SiblingCopies", "WorkerPeers", "without_engines", "workers_header",
           "worker_ports"]

#: ``EngineStatus.infx_capabilities`` of an engine that every worker of a supervisor runs in its own
#: process: a sibling's report of it is not registered.
IN_EVERY_WORKER = "in-every-worker"

#: Response-header key by which an accepting infx gateway lists the internal ports of every
#: worker of its supervisor (``8083,8084``), itself included.
WORKERS_HEADER = "x-infx-workers"


def workers_header(ports: Iterable[int]) -> tuple[str, str]:
    """The header pair that lists ``ports``."""
    return WORKERS_HEADER, ",".join(str(port) for port in ports)


def worker_ports(metadata: Iterable[tuple[str, str | bytes]]) -> tuple[int, ...]:
    """The ports an accepting gateway's headers list; () when it lists none or a malformed list
    (a LLMariner gateway, or an infx gateway of one worker)."""
    for key, value in metadata:
        if key != WORKERS_HEADER:
            continue
        text = value.decode("latin-1") if isinstance(value, bytes) else value
        parts = [part.strip() for part in text.split(",")]
        if not parts or not all(part.isdigit() and 0 < int(part) <= 65535 for part in parts):
            return ()
        return tuple(sorted(set(int(part) for part in parts)))
    return ()


class WorkerPeers:
    """The peers a worker dials: its siblings, the source's peers, and every worker of each.

    ``siblings`` (pod name → address) are fixed; :meth:`source_changed` takes the source's peers
    (``--peers`` or the pod watcher) and :meth:`learned` the ports a dial to one of them found in
    its headers. :attr:`peers` is what to dial: each source peer under its own name, the other
    workers of its supervisor as ``HOST:PORT``, and the siblings. What was learned of a peer is
    forgotten when the source drops it or moves it.
    """

    def __init__(self, siblings: Mapping[str, PeerAddress]) -> None:
        self._siblings = dict(siblings)
        self._source: dict[str, PeerAddress] = {}
        self._ports: dict[str, tuple[int, ...]] = {}

    def source_changed(self, peers: Mapping[str, PeerAddress]) -> bool:
        """The source's peers now; whether :attr:`peers` changed."""
        before, old = self.peers, self._source
        self._source = dict(peers)
        self._ports = {name: ports for name, ports in self._ports.items() if self._source.get(name) == old.get(name)}
        return self.peers != before

    def learned(self, name: str, metadata: Iterable[tuple[str, str | bytes]]) -> bool:
        """A dial to ``name`` was accepted with these headers; whether :attr:`peers` changed.
        Only the source's peers are expanded (a sibling, or a peer dialled back, is not)."""
        address = self._source.get(name)
        ports = worker_ports(metadata)
        if address is None or address.port not in ports or self._ports.get(name) == ports:
            return False
        before = self.peers
        self._ports[name] = ports
        return self.peers != before

    @property
    def peers(self) -> dict[str, PeerAddress]:
        peers = dict(self._siblings)
        for name, address in self._source.items():
            peers[name] = address
            for port in self._ports.get(name, ()):
                if port != address.port:
                    other = PeerAddress(address.host, port)
                    peers.setdefault(str(other), other)
        return peers


def without_engines(message: internal_pb2.ProcessTasksInternalRequest,
                    engine_ids: Collection[str]) -> internal_pb2.ProcessTasksInternalRequest:
    """``message`` without the engines ``engine_ids`` in its status report (listed or removed);
    the message itself when it names none of them."""
    if not engine_ids or message.WhichOneof("message") != "server_status":
        return message
    status = message.server_status
    if (not any(e.engine_status.engine_id in engine_ids for e in status.engine_statuses)
            and not any(r.engine_id in engine_ids for r in status.removed_engines)):
        return message
    kept = internal_pb2.ProcessTasksInternalRequest()
    kept.CopyFrom(message)
    trimmed = kept.server_status
    entries = [e for e in trimmed.engine_statuses if e.engine_status.engine_id not in engine_ids]
    removed = [r for r in trimmed.removed_engines if r.engine_id not in engine_ids]
    del trimmed.engine_statuses[:]
    trimmed.engine_statuses.extend(entries)
    del trimmed.removed_engines[:]
    trimmed.removed_engines.extend(removed)
    return kept


class SiblingCopies:
    """What one sibling's stream reports, less its copies of the engines every worker runs.

    An engine whose status carries :data:`IN_EVERY_WORKER` is dropped, and so is its later
    removal (a delta's ``removed_engines`` names ids only)."""

    def __init__(self) -> None:
        self._dropped: set[str] = set()

    def filter(self, message: internal_pb2.ProcessTasksInternalRequest) -> internal_pb2.ProcessTasksInternalRequest:
        if message.WhichOneof("message") != "server_status":
            return message
        status = message.server_status
        copies = {e.engine_status.engine_id for e in status.engine_statuses
                  if IN_EVERY_WORKER in e.engine_status.infx_capabilities}
        removed = {r.engine_id for r in status.removed_engines if r.engine_id in self._dropped}
        if not status.delta:
            self._dropped = set()  # a full snapshot replaces everything reported before
        self._dropped |= copies
        self._dropped -= removed
        return without_engines(message, copies | removed)
