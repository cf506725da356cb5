"""Pod objects, peer states and a pod informer driving a peer set by hand, for discovery tests."""

from __future__ import annotations

import random
from typing import Any

from hypothesis import strategies as st

from protocol.backoff import Backoff
from protocol.discovery.informer import (
    Effect,
    Informer,
    InformerState,
    ListRequested,
    ObjectDeleted,
    ObjectUpdated,
    WatchRequested,
)
from protocol.discovery.peers import (
    PeerAdded,
    PeerAddress,
    PeerAddressChanged,
    PeerChange,
    PeerSet,
    PodState,
    desired_peer,
    pod_key,
    pod_version,
)


PORT = 8083


def live(name: str, ip: str = "10.0.0.1", rv: str | None = None) -> PodState:
    return PodState(name=name, ip=ip, phase="Running", ready=True, resource_version=rv)


def pod_json(
    name: str,
    ip: str | None = "10.0.0.1",
    phase: str = "Running",
    ready: str = "True",
    rv: str = "7",
    deletion: str | None = None,
) -> dict[str, Any]:
    metadata: dict[str, Any] = {"name": name, "resourceVersion": rv, "labels": {"app": "infx"}}
    if deletion:
        metadata["deletionTimestamp"] = deletion
    status: dict[str, Any] = {"phase": phase, "conditions": [
        {"type": "PodScheduled", "status": "True"},
        {"type": "Ready", "status": ready},
    ]}
    if ip:
        status["podIP"] = ip
    return {"kind": "Pod", "apiVersion": "v1", "metadata": metadata, "status": status}


class Discovery:
    """Peer discovery as production composes it: a pod :class:`Informer` feeding a :class:`PeerSet`."""

    def __init__(self, own: str | None = "me", backoff: Backoff | None = None, seed: int = 0) -> None:
        self.informer: Informer[PodState] = Informer(
            pod_key, pod_version, backoff or Backoff(initial=1.0, factor=2.0, cap=30.0, jitter=0.0), random.Random(seed))
        self.peers = PeerSet(own, PORT)
        self.now = 0.0
        self.requests: list[Effect[PodState]] = []
        self.requests += self.informer.start()

    def feed(self, effects: list[Effect[PodState]]) -> list[PeerChange]:
        """Peer changes from the informer's effects; requests are kept in :attr:`requests`."""
        changes: list[PeerChange] = []
        for effect in effects:
            if isinstance(effect, (ListRequested, WatchRequested)):
                self.requests.append(effect)
            else:
                changes += self.peers.cache_changed(effect)
        return changes

    def updated(self, pod: PodState) -> list[PeerChange]:
        return self.feed(self.informer.event_received(ObjectUpdated(pod)))

    def deleted(self, name: str) -> list[PeerChange]:
        return self.feed(self.informer.event_received(ObjectDeleted(PodState(name))))

    def relist(self, pods: list[PodState], rv: str = "1") -> list[PeerChange]:
        """A fresh list of every pod, as after a 410 Gone."""
        if self.informer.state is InformerState.WATCHING:
            self.feed(self.informer.failed(410, self.now))
        if self.informer.state is InformerState.BACKING_OFF:
            deadline = self.informer.next_deadline()
            assert deadline is not None
            self.now = deadline
            self.feed(self.informer.handle_timeout(self.now))
        assert self.informer.state is InformerState.LISTING
        return self.feed(self.informer.listed(pods, rv))


NAMES = ["me", "a", "b", "c"]


pod_states = st.builds(
    PodState,
    name=st.sampled_from(NAMES),
    # Weighted towards live pods, so that peers come and go often.
    ip=st.sampled_from([None, "10.0.0.1", "10.0.0.2", "fd00::3"]),
    phase=st.sampled_from(["Running", "Running", "Running", "Pending", "Failed"]),
    ready=st.sampled_from([True, True, False]),
    deletion_timestamp=st.sampled_from([None, None, None, "2026-01-01T00:00:00Z"]),
)


def apply(view: dict[str, PeerAddress], changes: list[Any]) -> None:
    """Apply changes the way a consumer would, checking each is consistent with what it saw."""
    for change in changes:
        if isinstance(change, PeerAdded):
            assert change.name not in view
            view[change.name] = change.address
        elif isinstance(change, PeerAddressChanged):
            assert view[change.name] == change.previous != change.address
            view[change.name] = change.address
        else:
            assert view.pop(change.name) == change.address


def desired(cluster: dict[str, PodState]) -> dict[str, PeerAddress]:
    out = {}
    for name, pod in cluster.items():
        address = desired_peer(pod, PORT)
        if address is not None and name != "me":
            out[name] = address
    return out
