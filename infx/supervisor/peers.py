"""A worker's peers: its siblings, and every worker of each peer its source names.

Wraps the configured peer source (``--peers`` or the pod watcher of ``--kube``) as a
:class:`~infx.discovery.kube.PeerSource`; the decisions are
:class:`protocol.supervisor.siblings.WorkerPeers`'. The exchanger tells it each accepted
dial's headers (:meth:`SiblingPeerSource.dial_accepted`), which list the peer's workers.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from twisted.internet import defer

from infx.discovery.kube import PeerSource
from protocol.discovery.peers import PeerAdded, PeerAddress, PeerChange
from protocol.grpc.metadata import Metadata
from protocol.supervisor.siblings import WorkerPeers

__all__ = ["SiblingPeerSource"]


class SiblingPeerSource:
    """The peers of one worker; ``make_inner(on_change)`` builds the configured source."""

    def __init__(self, siblings: Mapping[str, PeerAddress],
                 make_inner: Callable[[Callable[[PeerChange], None]], PeerSource],
                 on_change: Callable[[PeerChange], None]) -> None:
        self._peers = WorkerPeers(siblings)
        self._siblings = dict(siblings)
        self._on_change = on_change
        self._started = False
        self.inner = make_inner(self._inner_changed)

    @property
    def peers(self) -> Mapping[str, PeerAddress]:
        return self._peers.peers if self._started else {}

    def start(self) -> None:
        self._started = True
        self.inner.start()
        for name, address in self._siblings.items():
            self._on_change(PeerAdded(name, address))

    def stop(self) -> defer.Deferred[None]:
        self._started = False
        return self.inner.stop()

    def dial_accepted(self, name: str, address: Any, metadata: Metadata) -> None:
        """A dial to ``name`` was accepted with ``metadata``: its other workers become peers too."""
        if self._peers.learned(name, metadata):
            self._on_change(PeerAdded(name, address))

    def _inner_changed(self, change: PeerChange) -> None:
        self._peers.source_changed(self.inner.peers)
        if self._started:
            self._on_change(change)
