"""Which peer gateways to dial, decided from pod objects.

Rules this file keeps: no I/O, no threads, no clock reads. Pods arrive as
already-decoded JSON objects (the dicts the Kubernetes API sends); everything
that decides "this pod is a peer at that address" lives here. The
list-then-watch loop that delivers the pods is :class:`protocol.discovery.informer.Informer`;
the Twisted adapter (``infx/discovery/kube.py``) only moves bytes and threads.

:class:`PeerSet` turns the informer's cache events (or pod snapshots and pod
events, in any order) into :class:`PeerAdded` / :class:`PeerAddressChanged` /
:class:`PeerRemoved` changes, so that the set of peers always equals the
desired peers of the pods last seen.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Hashable, Mapping
from dataclasses import dataclass, field
from typing import Any, Union

from protocol.discovery.informer import Added, CacheEvent, Deleted, MalformedWatchObject, Modified, object_mapping
from protocol.errors import LocalUsageError

__all__ = [
    "InvalidPeerAddress",
    "PeerAdded",
    "PeerAddress",
    "PeerAddressChanged",
    "PeerChange",
    "PeerRemoved",
    "PeerSet",
    "PodState",
    "desired_peer",
    "live_ip",
    "parse_peer_address",
    "pod_key",
    "pod_state",
    "pod_version",
]


class InvalidPeerAddress(ValueError, LocalUsageError):
    """A static peer was not given as ``HOST:PORT`` (a configuration error)."""


@dataclass(frozen=True, order=True)
class PeerAddress:
    """Where a peer's internal gRPC server listens."""

    host: str
    port: int

    def __str__(self) -> str:
        if ":" in self.host:
            return f"[{self.host}]:{self.port}"
        return f"{self.host}:{self.port}"


def parse_peer_address(text: str) -> PeerAddress:
    """Parse ``host:port`` or ``[v6]:port`` as given to ``--peers``."""
    host, sep, port_text = text.strip().rpartition(":")
    if not sep or not host or not port_text.isdigit():
        raise InvalidPeerAddress(f"peer address {text!r} is not HOST:PORT")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    elif ":" in host:
        raise InvalidPeerAddress(f"IPv6 peer address {text!r} needs brackets: [ADDR]:PORT")
    port = int(port_text)
    if not 0 < port < 65536:
        raise InvalidPeerAddress(f"peer port in {text!r} is out of range")
    return PeerAddress(host, port)


@dataclass(frozen=True)
class PodState:
    """The few fields of a pod that decide whether it is a peer."""

    name: str
    ip: str | None = None
    phase: str | None = None
    ready: bool = False
    deletion_timestamp: str | None = None
    labels: Mapping[str, str] = field(default_factory=dict)
    resource_version: str | None = None


def pod_state(obj: Mapping[str, Any]) -> PodState:
    """Extract a :class:`PodState` from a pod as the API server encodes it (camelCase JSON)."""
    metadata = object_mapping(obj.get("metadata"), "pod metadata")
    status = object_mapping(obj.get("status"), "pod status")
    name = metadata.get("name")
    if not isinstance(name, str) or not name:
        raise MalformedWatchObject("pod has no metadata.name")
    ready = False
    conditions = status.get("conditions") or []
    if not isinstance(conditions, list):
        raise MalformedWatchObject(f"pod {name} status.conditions is not a list")
    for condition in conditions:
        condition = object_mapping(condition, "pod condition")
        if condition.get("type") == "Ready":
            ready = condition.get("status") == "True"
    labels = object_mapping(metadata.get("labels"), "pod labels")
    ip = status.get("podIP") or None
    if ip is not None and not isinstance(ip, str):
        raise MalformedWatchObject(f"pod {name} status.podIP is not a string")
    rv = metadata.get("resourceVersion")
    return PodState(
        name=name,
        ip=ip,
        phase=status.get("phase"),
        ready=ready,
        deletion_timestamp=metadata.get("deletionTimestamp"),
        labels={str(k): str(v) for k, v in labels.items()},
        resource_version=rv if isinstance(rv, str) else None,
    )


def pod_key(pod: PodState) -> Hashable:
    """A pod's key in the informer's cache: its name (one namespace is watched)."""
    return pod.name


def pod_version(pod: PodState) -> str | None:
    """A pod's resourceVersion, where the informer's watch resumes."""
    return pod.resource_version


def live_ip(pod: PodState) -> str | None:
    """The IP of a pod that can answer (it has one, is Running and Ready, and is not terminating:
    a deletion timestamp means it is draining), else None."""
    if pod.ip is None or pod.deletion_timestamp is not None:
        return None
    if pod.phase != "Running" or not pod.ready:
        return None
    try:
        return str(ipaddress.ip_address(pod.ip))
    except ValueError:
        return None


def desired_peer(pod: PodState, port: int) -> PeerAddress | None:
    """The address to dial for ``pod``, or None while it must not get a receiver (see :func:`live_ip`)."""
    host = live_ip(pod)
    return None if host is None else PeerAddress(host, port)


@dataclass(frozen=True)
class PeerAdded:
    """A pod became a live peer: start a receiver towards ``address``."""

    name: str
    address: PeerAddress


@dataclass(frozen=True)
class PeerAddressChanged:
    """A live peer's IP changed: replace its receiver."""

    name: str
    previous: PeerAddress
    address: PeerAddress


@dataclass(frozen=True)
class PeerRemoved:
    """A peer is gone, terminating or no longer ready: stop its receiver."""

    name: str
    address: PeerAddress


PeerChange = Union[PeerAdded, PeerAddressChanged, PeerRemoved]


class PeerSet:
    """The live peers, kept equal to the desired peers of the pods last seen.

    Every input is a statement about the whole truth of one pod, so events
    may be duplicated or replayed
    and the outcome is still the desired set: the changes returned are the
    difference between what was live and what is now desired.
    """

    def __init__(self, own_pod_name: str | None, port: int) -> None:
        self._own = own_pod_name
        self._port = port
        self._peers: dict[str, PeerAddress] = {}

    @property
    def peers(self) -> Mapping[str, PeerAddress]:
        """Live peers by pod name (a copy)."""
        return dict(self._peers)

    def pod_updated(self, pod: PodState) -> list[PeerChange]:
        """A pod was added or modified."""
        if pod.name == self._own:
            return []
        return self._set(pod.name, desired_peer(pod, self._port))

    def pod_deleted(self, name: str) -> list[PeerChange]:
        """A pod was deleted."""
        return self._set(name, None)

    def cache_changed(self, event: CacheEvent[PodState]) -> list[PeerChange]:
        """One change of the pod informer's cache (a :class:`~protocol.discovery.informer.Synced` changes nothing)."""
        if isinstance(event, (Added, Modified)):
            return self.pod_updated(event.obj)
        if isinstance(event, Deleted):
            return self.pod_deleted(event.obj.name)
        return []

    def _set(self, name: str, address: PeerAddress | None) -> list[PeerChange]:
        previous = self._peers.get(name)
        if previous == address:
            return []
        if address is None:
            assert previous is not None
            del self._peers[name]
            return [PeerRemoved(name, previous)]
        self._peers[name] = address
        if previous is None:
            return [PeerAdded(name, address)]
        return [PeerAddressChanged(name, previous, address)]
