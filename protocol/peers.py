"""Which peer gateways to dial, decided from pod objects; and the list-then-watch loop.

Rules this file keeps: no I/O, no threads, no clock reads. Time comes in as a
``now`` argument, randomness (backoff jitter) from an injected ``random.Random``,
and pods arrive as already-decoded JSON objects (the dicts the Kubernetes API
sends). Everything that decides "this pod is a peer at that address" lives here;
the Twisted adapter (``infx/kube.py``) only moves bytes and threads.

Two machines:

- :class:`PeerSet` turns pod snapshots and pod events, in any order, into
  :class:`PeerAdded` / :class:`PeerAddressChanged` / :class:`PeerRemoved`
  changes, so that the set of peers always equals the desired peers of the pods
  last seen.
- :class:`PodWatch` is the list-then-watch loop of a Kubernetes informer:
  list, watch from the list's resourceVersion, follow events and bookmarks,
  resume a dropped watch from the last resourceVersion, relist on 410 Gone,
  and back off (jittered, exponential, capped) after errors.
"""

from __future__ import annotations

import enum
import ipaddress
import random
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Union

__all__ = [
    "Backoff",
    "BookmarkReceived",
    "InvalidPeerAddress",
    "MalformedWatchObject",
    "PeerAdded",
    "PeerAddress",
    "PeerAddressChanged",
    "PeerChange",
    "PeerRemoved",
    "PeerSet",
    "PodDeleted",
    "PodState",
    "PodUpdated",
    "PodWatch",
    "WatchErrorReceived",
    "WatchEvent",
    "WatchMisuse",
    "WatchState",
    "desired_peer",
    "parse_peer_address",
    "parse_watch_event",
    "pod_state",
]

HTTP_GONE = 410


class MalformedWatchObject(ValueError):
    """The API server sent an object or event we cannot read (a remote violation).

    Carries the HTTP status the API server would use for a malformed body, so
    the adapter can treat it like any other failed watch.
    """

    http_status = 500


class WatchMisuse(RuntimeError):
    """The caller drove :class:`PodWatch` out of order (a local error)."""


class InvalidPeerAddress(ValueError):
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


def _mapping(value: object, what: str) -> Mapping[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise MalformedWatchObject(f"{what} is not an object")
    return value


def pod_state(obj: Mapping[str, Any]) -> PodState:
    """Extract a :class:`PodState` from a pod as the API server encodes it (camelCase JSON)."""
    metadata = _mapping(obj.get("metadata"), "pod metadata")
    status = _mapping(obj.get("status"), "pod status")
    name = metadata.get("name")
    if not isinstance(name, str) or not name:
        raise MalformedWatchObject("pod has no metadata.name")
    ready = False
    conditions = status.get("conditions") or []
    if not isinstance(conditions, list):
        raise MalformedWatchObject(f"pod {name} status.conditions is not a list")
    for condition in conditions:
        condition = _mapping(condition, "pod condition")
        if condition.get("type") == "Ready":
            ready = condition.get("status") == "True"
    labels = _mapping(metadata.get("labels"), "pod labels")
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


def desired_peer(pod: PodState, port: int) -> PeerAddress | None:
    """The address to dial for ``pod``, or None while it must not get a receiver.

    A pod is dialled only when it can answer: it has an IP, is Running and
    Ready, and is not terminating (a deletion timestamp means it is draining).
    """
    if pod.ip is None or pod.deletion_timestamp is not None:
        return None
    if pod.phase != "Running" or not pod.ready:
        return None
    try:
        host = str(ipaddress.ip_address(pod.ip))
    except ValueError:
        return None
    return PeerAddress(host, port)


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

    Every input is a statement about the whole truth of one pod (or, for
    :meth:`relisted`, of all pods), so events may be duplicated or replayed
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

    def relisted(self, pods: Iterable[PodState]) -> list[PeerChange]:
        """A full list replaced everything known: pods missing from it are gone."""
        desired: dict[str, PeerAddress] = {}
        for pod in pods:
            address = desired_peer(pod, self._port)
            if address is not None and pod.name != self._own:
                desired[pod.name] = address
        changes: list[PeerChange] = []
        for name in sorted(set(self._peers) - set(desired)):
            changes += self._set(name, None)
        for name in sorted(desired):
            changes += self._set(name, desired[name])
        return changes

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


@dataclass(frozen=True)
class PodUpdated:
    """A watch ADDED or MODIFIED event."""

    pod: PodState


@dataclass(frozen=True)
class PodDeleted:
    """A watch DELETED event."""

    pod: PodState


@dataclass(frozen=True)
class BookmarkReceived:
    """A watch BOOKMARK: nothing changed up to ``resource_version``."""

    resource_version: str


@dataclass(frozen=True)
class WatchErrorReceived:
    """A watch ERROR event: the API server ends the watch with a ``Status``.

    ``code`` is its HTTP status; 410 means the resourceVersion was compacted
    away and only a relist can recover.
    """

    code: int
    reason: str
    message: str


WatchEvent = Union[PodUpdated, PodDeleted, BookmarkReceived, WatchErrorReceived]


def parse_watch_event(event: Mapping[str, Any]) -> WatchEvent:
    """Decode one ``{"type": ..., "object": ...}`` line of a pod watch stream."""
    if not isinstance(event, Mapping):  # any JSON value can arrive on the wire
        raise MalformedWatchObject("watch event is not an object")
    kind = event.get("type")
    obj = _mapping(event.get("object"), "watch event object")
    if kind in ("ADDED", "MODIFIED"):
        return PodUpdated(pod_state(obj))
    if kind == "DELETED":
        return PodDeleted(pod_state(obj))
    if kind == "BOOKMARK":
        rv = _mapping(obj.get("metadata"), "bookmark metadata").get("resourceVersion")
        if not isinstance(rv, str) or not rv:
            raise MalformedWatchObject("bookmark without metadata.resourceVersion")
        return BookmarkReceived(rv)
    if kind == "ERROR":
        code = obj.get("code")
        return WatchErrorReceived(
            code=code if isinstance(code, int) else 500,
            reason=str(obj.get("reason", "")),
            message=str(obj.get("message", "")),
        )
    raise MalformedWatchObject(f"unknown watch event type {kind!r}")


@dataclass(frozen=True)
class Backoff:
    """Reconnect delays after failed lists or watches.

    The n-th consecutive failure waits ``min(cap, initial * factor**(n-1))``
    scaled by a uniform factor in ``[1 - jitter, 1]``, so replicas restarted
    together do not hammer the API server in step.
    """

    initial: float = 0.5
    factor: float = 2.0
    cap: float = 30.0
    jitter: float = 0.5

    def __post_init__(self) -> None:
        if self.initial <= 0 or self.cap < self.initial or self.factor < 1:
            raise ValueError("backoff needs 0 < initial <= cap and factor >= 1")
        if not 0 <= self.jitter <= 1:
            raise ValueError("backoff jitter is a fraction in [0, 1]")

    def delay(self, failures: int, rng: random.Random) -> float:
        """Delay before the next attempt after ``failures`` consecutive failures (>= 1)."""
        try:
            base = min(self.cap, self.initial * self.factor ** (failures - 1))
        except OverflowError:
            base = self.cap
        return base * (1 - self.jitter * rng.random())


class WatchState(enum.Enum):
    """Where :class:`PodWatch` is; each state names what the adapter must be doing."""

    IDLE = "idle"  # not started
    LISTING = "listing"  # a list request is (to be) in flight
    WATCHING = "watching"  # a watch request from resource_version is (to be) in flight
    BACKING_OFF = "backing off"  # waiting for next_deadline() before retrying
    STOPPED = "stopped"  # final


class PodWatch:
    """The list-then-watch loop of one pod informer, as a state machine.

    The adapter performs the request that :attr:`state` names (a list in
    LISTING, a watch from :attr:`resource_version` in WATCHING), feeds back
    what happened, and in BACKING_OFF calls :meth:`handle_timer` at
    :meth:`next_deadline`. Peer changes come back from the methods that
    carry pods.
    """

    def __init__(
        self,
        own_pod_name: str | None,
        port: int,
        backoff: Backoff | None = None,
        rng: random.Random | None = None,
    ) -> None:
        self.peers = PeerSet(own_pod_name, port)
        self._backoff = backoff or Backoff()
        self._rng = rng or random.Random()
        self._state = WatchState.IDLE
        self._rv: str | None = None
        self._failures = 0
        # A relist that a 410 forced, with no watch event since: a second 410 backs off.
        self._relisted_without_progress = False
        self._deadline: float | None = None

    @property
    def state(self) -> WatchState:
        return self._state

    @property
    def resource_version(self) -> str | None:
        """Where the next watch resumes; None until listed and after a 410."""
        return self._rv

    @property
    def failures(self) -> int:
        """Consecutive failed attempts since the last sign of progress."""
        return self._failures

    def next_deadline(self) -> float | None:
        """When :meth:`handle_timer` must be called, while backing off."""
        return self._deadline

    def _expect(self, *states: WatchState) -> None:
        if self._state not in states:
            raise WatchMisuse(f"not allowed while {self._state.value}")

    def start(self) -> None:
        """Begin with a list."""
        self._expect(WatchState.IDLE)
        self._state = WatchState.LISTING

    def listed(self, pods: Iterable[PodState], resource_version: str) -> list[PeerChange]:
        """The list succeeded: replace everything known and watch from its resourceVersion."""
        self._expect(WatchState.LISTING)
        if not resource_version:
            raise MalformedWatchObject("pod list without metadata.resourceVersion")
        self._rv = resource_version
        self._state = WatchState.WATCHING
        return self.peers.relisted(pods)

    def event_received(self, event: WatchEvent) -> list[PeerChange]:
        """One event of the open watch; an ERROR event is reported as :meth:`failed` instead."""
        self._expect(WatchState.WATCHING)
        self._progressed()
        if isinstance(event, BookmarkReceived):
            self._rv = event.resource_version
            return []
        if isinstance(event, WatchErrorReceived):
            raise WatchMisuse("an ERROR event ends the watch: report it with failed()")
        if event.pod.resource_version:
            self._rv = event.pod.resource_version
        if isinstance(event, PodDeleted):
            return self.peers.pod_deleted(event.pod.name)
        return self.peers.pod_updated(event.pod)

    def watch_ended(self) -> None:
        """The watch closed cleanly (its timeout): resume from the last resourceVersion."""
        self._expect(WatchState.WATCHING)
        self._progressed()

    def _progressed(self) -> None:
        self._failures = 0
        self._relisted_without_progress = False

    def failed(self, now: float, http_status: int | None = None) -> None:
        """The list or watch failed; ``http_status`` is the API server's, if it answered.

        410 Gone (the resourceVersion was compacted) forgets the
        resourceVersion and relists at once, unless the watch has not
        progressed since a relist that a 410 forced, in which case it backs
        off like any other error (so a confused server is not hammered).
        """
        self._expect(WatchState.LISTING, WatchState.WATCHING)
        if http_status == HTTP_GONE:
            self._rv = None
            if not self._relisted_without_progress:
                self._relisted_without_progress = True
                self._state = WatchState.LISTING
                return
        self._failures += 1
        self._deadline = now + self._backoff.delay(self._failures, self._rng)
        self._state = WatchState.BACKING_OFF

    def handle_timer(self, now: float) -> None:
        """Retry once the backoff deadline has passed (early calls are ignored)."""
        if self._state is not WatchState.BACKING_OFF:
            return
        assert self._deadline is not None
        if now < self._deadline:
            return
        self._deadline = None
        self._state = WatchState.LISTING if self._rv is None else WatchState.WATCHING

    def stop(self) -> None:
        """Stop for good; any later result from an in-flight request must be dropped."""
        self._state = WatchState.STOPPED
        self._deadline = None
