"""One Kubernetes informer: list, then watch, with a cache of the objects by key, as a pure machine.

Rules this file keeps: no I/O, no threads, no clock reads. Time comes in as a
``now`` argument (always last); randomness (backoff jitter) from a
``random.Random`` the caller must pass; objects arrive already decoded by a
``decode`` function of the caller's (pods for peer discovery, deployments and
pods for the scaler). Every input returns its effects, in order: the request
to make next (:class:`ListRequested`, :class:`WatchRequested`) and the cache's
changes (:class:`Added`, :class:`Modified`, :class:`Deleted`, :class:`Synced`).
Out-of-turn input is :class:`WatchMisuse` (a local error); a watch line the
machine cannot read is :class:`MalformedWatchObject` (a remote one).

The loop is the one client-go's reflector runs: list, watch from the list's
resourceVersion, follow events and bookmarks, resume a watch that ended or
dropped from the last resourceVersion, relist on 410 Gone (once at once, then
with backoff while no progress is made), and back off (jittered, exponential,
capped) after errors. A relist is diffed against the cache, so consumers see
only what changed, then :class:`Synced`.
"""

from __future__ import annotations

import enum
import random
from collections.abc import Callable, Hashable, Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Generic, TypeVar, Union

from protocol.backoff import Backoff
from protocol.errors import LocalUsageError, RemoteProtocolError

__all__ = [
    "Added",
    "BookmarkReceived",
    "CacheEvent",
    "Deleted",
    "Effect",
    "HTTP_GONE",
    "Informer",
    "InformerState",
    "ListRequested",
    "MalformedWatchObject",
    "Modified",
    "ObjectDeleted",
    "ObjectUpdated",
    "Synced",
    "WATCH_BACKOFF",
    "WatchErrorReceived",
    "WatchEvent",
    "WatchMisuse",
    "WatchRequested",
    "object_mapping",
    "parse_watch_event",
]

T = TypeVar("T")

HTTP_GONE = 410


class MalformedWatchObject(ValueError, RemoteProtocolError):
    """A list or watch carried an object the machine cannot read (a remote violation).

    Carries the HTTP status the API server would use for a malformed body, so
    the adapter can treat it like any other failed watch.
    """

    http_status = 500


class WatchMisuse(RuntimeError, LocalUsageError):
    """The caller drove the :class:`Informer` out of order (a local error)."""


#: Redial delays after failed lists or watches (client-go's reflector backs off
#: from 0.8 s to 30 s; ours starts a little sooner and jitters widely, so
#: replicas restarted together do not hammer the API server in step).
WATCH_BACKOFF = Backoff(initial=0.5, factor=2.0, cap=30.0, jitter=0.5)


# --- watch lines, decoded -------------------------------------------------------------


@dataclass(frozen=True)
class ObjectUpdated(Generic[T]):
    """A watch ADDED or MODIFIED event: ``obj`` is the object's whole new state."""

    obj: T


@dataclass(frozen=True)
class ObjectDeleted(Generic[T]):
    """A watch DELETED event: ``obj`` is the object's last state."""

    obj: T


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


WatchEvent = Union[ObjectUpdated[T], ObjectDeleted[T], BookmarkReceived, WatchErrorReceived]


def object_mapping(value: object, what: str) -> Mapping[str, Any]:
    """``value`` as a JSON object (None reads as empty); anything else is malformed."""
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise MalformedWatchObject(f"{what} is not an object")
    return value


def parse_watch_event(event: object, decode: Callable[[Mapping[str, Any]], T]) -> WatchEvent[T]:
    """Decode one ``{"type": ..., "object": ...}`` line of a watch stream; ``decode`` reads the object."""
    if not isinstance(event, Mapping):  # any JSON value can arrive on the wire
        raise MalformedWatchObject("watch event is not an object")
    kind = event.get("type")
    obj = object_mapping(event.get("object"), "watch event object")
    if kind in ("ADDED", "MODIFIED"):
        return ObjectUpdated(decode(obj))
    if kind == "DELETED":
        return ObjectDeleted(decode(obj))
    if kind == "BOOKMARK":
        rv = object_mapping(obj.get("metadata"), "bookmark metadata").get("resourceVersion")
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


# --- effects ----------------------------------------------------------------------------


@dataclass(frozen=True)
class ListRequested:
    """List the collection now; report with :meth:`Informer.listed` or :meth:`Informer.failed`."""


@dataclass(frozen=True)
class WatchRequested:
    """Open a watch from ``resource_version``; feed its events, then ``watch_ended`` or ``failed``."""

    resource_version: str


@dataclass(frozen=True)
class Added(Generic[T]):
    """``key`` entered the cache."""

    key: Hashable
    obj: T


@dataclass(frozen=True)
class Modified(Generic[T]):
    """``key``'s object changed from ``previous`` to ``obj``."""

    key: Hashable
    previous: T
    obj: T


@dataclass(frozen=True)
class Deleted(Generic[T]):
    """``key`` left the cache; ``obj`` is its last state known."""

    key: Hashable
    obj: T


@dataclass(frozen=True)
class Synced:
    """A list was applied: the cache now equals the collection as of that list (``size`` objects)."""

    size: int


CacheEvent = Union[Added[T], Modified[T], Deleted[T], Synced]
Effect = Union[ListRequested, WatchRequested, Added[T], Modified[T], Deleted[T], Synced]


class InformerState(enum.Enum):
    """Where the :class:`Informer` is; each state names the request that is out (or due)."""

    IDLE = "idle"  # not started
    LISTING = "listing"  # a list request is in flight
    WATCHING = "watching"  # a watch from resource_version is in flight
    BACKING_OFF = "backing off"  # waiting for next_deadline() before retrying
    STOPPED = "stopped"  # final


class Informer(Generic[T]):
    """The list-then-watch loop of one collection and the cache it keeps.

    ``key(obj)`` names an object in the cache; ``version(obj)`` is its
    ``metadata.resourceVersion`` (None if absent), which advances the watch
    position. Objects must compare equal when nothing in them changed, so a
    replayed event or an unchanged object in a relist yields no effect.
    """

    def __init__(
        self,
        key: Callable[[T], Hashable],
        version: Callable[[T], str | None],
        backoff: Backoff,
        rng: random.Random,
    ) -> None:
        self._key = key
        self._version = version
        self._backoff = backoff
        self._rng = rng
        self._state = InformerState.IDLE
        self._cache: dict[Hashable, T] = {}
        self._rv: str | None = None
        self._failures = 0
        # A relist that a 410 forced, with no watch progress since: a second 410 backs off.
        self._relisted_without_progress = False
        self._deadline: float | None = None

    @property
    def state(self) -> InformerState:
        return self._state

    @property
    def resource_version(self) -> str | None:
        """Where the next watch resumes; None until listed and after a 410."""
        return self._rv

    @property
    def failures(self) -> int:
        """Consecutive failed attempts since the last sign of progress."""
        return self._failures

    @property
    def objects(self) -> Mapping[Hashable, T]:
        """The cache, by key (a read-only view)."""
        return MappingProxyType(self._cache)

    def next_deadline(self) -> float | None:
        """When :meth:`handle_timeout` must be called, while backing off."""
        return self._deadline

    def _expect(self, *states: InformerState) -> None:
        if self._state not in states:
            raise WatchMisuse(f"not allowed while {self._state.value}")

    def start(self) -> list[Effect[T]]:
        """Begin with a list."""
        self._expect(InformerState.IDLE)
        self._state = InformerState.LISTING
        return [ListRequested()]

    def listed(self, objects: Iterable[T], resource_version: str) -> list[Effect[T]]:
        """The list succeeded: diff it into the cache and watch from its resourceVersion."""
        self._expect(InformerState.LISTING)
        if not resource_version:
            raise MalformedWatchObject("list without metadata.resourceVersion")
        fresh: dict[Hashable, T] = {}
        for obj in objects:
            fresh[self._key(obj)] = obj
        effects: list[Effect[T]] = []
        for key in [k for k in self._cache if k not in fresh]:
            effects.append(Deleted(key, self._cache.pop(key)))
        for key, obj in fresh.items():
            effects.extend(self._put(key, obj))
        effects.append(Synced(len(self._cache)))
        self._rv = resource_version
        self._state = InformerState.WATCHING
        effects.append(WatchRequested(resource_version))
        return effects

    def event_received(self, event: WatchEvent[T]) -> list[Effect[T]]:
        """One event of the open watch; an ERROR event is reported as :meth:`failed` instead."""
        self._expect(InformerState.WATCHING)
        if isinstance(event, WatchErrorReceived):
            raise WatchMisuse("an ERROR event ends the watch: report it with failed()")
        self._progressed()
        if isinstance(event, BookmarkReceived):
            self._rv = event.resource_version
            return []
        rv = self._version(event.obj)
        if rv:
            self._rv = rv
        key = self._key(event.obj)
        if isinstance(event, ObjectDeleted):
            if key not in self._cache:
                return []
            del self._cache[key]
            return [Deleted(key, event.obj)]
        return self._put(key, event.obj)

    def _put(self, key: Hashable, obj: T) -> list[Effect[T]]:
        previous = self._cache.get(key)
        self._cache[key] = obj
        if previous is None:
            return [Added(key, obj)]
        if previous == obj:
            return []
        return [Modified(key, previous, obj)]

    def watch_ended(self) -> list[Effect[T]]:
        """The watch closed cleanly (its timeout): resume from the last resourceVersion."""
        self._expect(InformerState.WATCHING)
        self._progressed()
        assert self._rv is not None
        return [WatchRequested(self._rv)]

    def _progressed(self) -> None:
        self._failures = 0
        self._relisted_without_progress = False

    def failed(self, http_status: int | None, now: float) -> list[Effect[T]]:
        """The list or watch failed; ``http_status`` is the API server's, if it answered.

        410 Gone (the resourceVersion was compacted) forgets the
        resourceVersion and relists at once, unless the watch has not
        progressed since a relist that a 410 forced, in which case it backs
        off like any other error (so a confused server is not hammered).
        """
        self._expect(InformerState.LISTING, InformerState.WATCHING)
        if http_status == HTTP_GONE:
            self._rv = None
            if not self._relisted_without_progress:
                self._relisted_without_progress = True
                self._state = InformerState.LISTING
                return [ListRequested()]
        self._failures += 1
        self._deadline = now + self._backoff.delay(self._failures, self._rng.random())
        self._state = InformerState.BACKING_OFF
        return []

    def handle_timeout(self, now: float) -> list[Effect[T]]:
        """Retry once the backoff deadline has passed (early or stray calls do nothing)."""
        if self._state is not InformerState.BACKING_OFF:
            return []
        assert self._deadline is not None
        if now < self._deadline:
            return []
        self._deadline = None
        if self._rv is None:
            self._state = InformerState.LISTING
            return [ListRequested()]
        self._state = InformerState.WATCHING
        return [WatchRequested(self._rv)]

    def stop(self) -> list[Effect[T]]:
        """Stop for good; any later result from a request in flight must be dropped."""
        self._state = InformerState.STOPPED
        self._deadline = None
        return []
