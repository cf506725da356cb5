"""The fake API server's object store: etcd-like resourceVersions, history, compaction, watches.

Plain Python, no I/O, driven from the reactor thread only. Every write takes
the next value of one global resourceVersion counter (as etcd revisions do),
is appended to a history that watches replay from, and is pushed to open
watches. ``compact()`` forgets history, so that a watch from an older
resourceVersion gets 410 Gone, as from the real API server.
"""

from __future__ import annotations

import copy
import re
import uuid
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Callable, Iterable, Mapping

Obj = dict[str, Any]


@dataclass(frozen=True)
class ResourceType:
    """One REST resource: where it lives and what its objects are called."""

    group: str
    version: str
    plural: str
    kind: str
    namespaced: bool = True
    status_subresource: bool = False

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    @property
    def prefix(self) -> str:
        return f"/apis/{self.group}/{self.version}" if self.group else f"/api/{self.version}"


PODS = ResourceType("", "v1", "pods", "Pod", status_subresource=True)
CORE_EVENTS = ResourceType("", "v1", "events", "Event")
DEPLOYMENTS = ResourceType("apps", "v1", "deployments", "Deployment", status_subresource=True)
EVENTS = ResourceType("events.k8s.io", "v1", "events", "Event")
LEASES = ResourceType("coordination.k8s.io", "v1", "leases", "Lease")
RESOURCES = (PODS, CORE_EVENTS, DEPLOYMENTS, EVENTS, LEASES)


class ApiError(Exception):
    """A failure the API server reports as a ``Status`` object with an HTTP code."""

    def __init__(self, code: int, reason: str, message: str, details: Obj | None = None) -> None:
        super().__init__(f"{code} {reason}: {message}")
        self.code = code
        self.reason = reason
        self.message = message
        self.details = details or {}

    def status(self) -> Obj:
        return {
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": self.message,
            "reason": self.reason,
            "details": self.details,
            "code": self.code,
        }


def not_found(resource: ResourceType, name: str) -> ApiError:
    return ApiError(404, "NotFound", f'{resource.plural} "{name}" not found',
                    {"name": name, "group": resource.group, "kind": resource.plural})


def conflict(resource: ResourceType, name: str) -> ApiError:
    return ApiError(
        409, "Conflict",
        f'Operation cannot be fulfilled on {resource.plural} "{name}": the object has been '
        "modified; please apply your changes to the latest version and try again",
        {"name": name, "group": resource.group, "kind": resource.plural},
    )


def gone(requested: int, oldest: int) -> ApiError:
    return ApiError(410, "Expired", f"too old resource version: {requested} ({oldest})")


def bad_request(message: str) -> ApiError:
    return ApiError(400, "BadRequest", message)


# --- label selectors -----------------------------------------------------------------

_REQUIREMENT = re.compile(
    r"\s*(?:(?P<not>!)\s*(?P<absent>[\w./-]+)"
    r"|(?P<key>[\w./-]+)\s*(?:(?P<op>==|=|!=)\s*(?P<value>[\w.-]*)"
    r"|\s+(?P<setop>in|notin)\s*\((?P<values>[^)]*)\))?)\s*(?:,|$)"
)


def label_selector(text: str | None) -> Callable[[Mapping[str, str]], bool]:
    """Compile a label selector (equality and set-based) into a predicate on labels."""
    tests: list[Callable[[Mapping[str, str]], bool]] = []
    text = (text or "").strip()
    pos = 0
    while pos < len(text):
        m = _REQUIREMENT.match(text, pos)
        if not m or m.end() == pos:
            raise bad_request(f"unable to parse requirement in label selector {text!r}")
        pos = m.end()
        if m["absent"]:
            tests.append(lambda labels, k=m["absent"]: k not in labels)
        elif m["op"] in ("=", "=="):
            tests.append(lambda labels, k=m["key"], v=m["value"]: labels.get(k) == v)
        elif m["op"] == "!=":
            tests.append(lambda labels, k=m["key"], v=m["value"]: labels.get(k) != v)
        elif m["setop"]:
            values = {v.strip() for v in m["values"].split(",")}
            if m["setop"] == "in":
                tests.append(lambda labels, k=m["key"], vs=values: labels.get(k) in vs)
            else:
                tests.append(lambda labels, k=m["key"], vs=values: labels.get(k) not in vs)
        else:
            tests.append(lambda labels, k=m["key"]: k in labels)
    return lambda labels: all(test(labels) for test in tests)


def field_selector(text: str | None) -> Callable[[Obj], bool]:
    """Compile the field selectors the fake supports: ``metadata.name`` and ``metadata.namespace``."""
    tests: list[Callable[[Obj], bool]] = []
    for part in filter(None, (p.strip() for p in (text or "").split(","))):
        m = re.fullmatch(r"metadata\.(name|namespace)\s*(==|=|!=)\s*(.*)", part)
        if not m:
            raise bad_request(f"field selector {part!r} is not supported by the fake API server")
        attr, op, value = m.groups()
        want = op != "!="
        tests.append(lambda obj, a=attr, v=value, w=want: (obj["metadata"].get(a) == v) == w)
    return lambda obj: all(test(obj) for test in tests)


# --- patches -------------------------------------------------------------------------


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch (also used for strategic merge patch: lists are replaced)."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = copy.deepcopy(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


def _pointer(path: str) -> list[str]:
    if path == "":
        return []
    if not path.startswith("/"):
        raise bad_request(f"JSON pointer {path!r} must start with /")
    return [p.replace("~1", "/").replace("~0", "~") for p in path[1:].split("/")]


def _parent(doc: Any, path: str) -> tuple[Any, str]:
    parts = _pointer(path)
    if not parts:
        raise bad_request("JSON patch on the whole document is not supported")
    node = doc
    for part in parts[:-1]:
        try:
            node = node[int(part)] if isinstance(node, list) else node[part]
        except (KeyError, IndexError, ValueError, TypeError):
            raise bad_request(f"JSON patch path {path!r} does not exist") from None
    return node, parts[-1]


def _get(doc: Any, path: str) -> Any:
    node, last = _parent(doc, path)
    try:
        return node[int(last)] if isinstance(node, list) else node[last]
    except (KeyError, IndexError, ValueError, TypeError):
        raise bad_request(f"JSON patch path {path!r} does not exist") from None


def _remove(doc: Any, path: str) -> Any:
    node, last = _parent(doc, path)
    try:
        return node.pop(int(last)) if isinstance(node, list) else node.pop(last)
    except (KeyError, IndexError, ValueError, TypeError):
        raise bad_request(f"JSON patch path {path!r} does not exist") from None


def _add(doc: Any, path: str, value: Any) -> None:
    node, last = _parent(doc, path)
    if isinstance(node, list):
        index = len(node) if last == "-" else int(last)
        if not 0 <= index <= len(node):
            raise bad_request(f"JSON patch index {path!r} out of range")
        node.insert(index, value)
    elif isinstance(node, dict):
        node[last] = value
    else:
        raise bad_request(f"JSON patch path {path!r} is not in an object or array")


def json_patch(target: Obj, operations: Any) -> Obj:
    """RFC 6902 JSON patch: add, remove, replace, move, copy, test."""
    if not isinstance(operations, list):
        raise bad_request("a JSON patch is a list of operations")
    doc = copy.deepcopy(target)
    for op in operations:
        kind, path = op.get("op"), op.get("path", "")
        if kind == "add":
            _add(doc, path, copy.deepcopy(op.get("value")))
        elif kind == "remove":
            _remove(doc, path)
        elif kind == "replace":
            _remove(doc, path)
            _add(doc, path, copy.deepcopy(op.get("value")))
        elif kind == "move":
            _add(doc, path, _remove(doc, op.get("from", "")))
        elif kind == "copy":
            _add(doc, path, copy.deepcopy(_get(doc, op.get("from", ""))))
        elif kind == "test":
            if _get(doc, path) != op.get("value"):
                raise ApiError(422, "Invalid", f"JSON patch test failed at {path!r}")
        else:
            raise bad_request(f"unknown JSON patch operation {kind!r}")
    return doc


# --- the store -----------------------------------------------------------------------


def _without_rv(obj: Obj) -> Obj:
    return obj | {"metadata": {k: v for k, v in obj["metadata"].items() if k != "resourceVersion"}}


def timestamp(seconds: float) -> str:
    return datetime.fromtimestamp(seconds, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass(frozen=True)
class Change:
    """One write, as kept in the history: the object before (None if created) and after."""

    resource_version: int
    resource: ResourceType
    type: str  # ADDED, MODIFIED or DELETED
    old: Obj | None
    new: Obj


@dataclass(eq=False)
class StoreWatch:
    """A registered watch: where it looks and whom it tells (``send(type, object)``)."""

    resource: ResourceType
    namespace: str | None
    matches: Callable[[Obj], bool]
    send: Callable[[str, Obj], None]
    store: Store
    cancelled: bool = field(default=False)

    def cancel(self) -> None:
        self.cancelled = True
        self.store._watches.discard(self)

    def deliver(self, change: Change) -> None:
        """Send ``change`` as seen through this watch's namespace and selectors.

        An object moving into the selector is ADDED for this watch and one
        moving out is DELETED, as the real API server does.
        """
        if change.resource != self.resource:
            return
        if self.namespace is not None and change.new["metadata"].get("namespace") != self.namespace:
            return
        was = change.old is not None and self.matches(change.old)
        now = self.matches(change.new)
        if change.type == "DELETED":
            kind = "DELETED" if was or now else None
        elif was and now:
            kind = "MODIFIED"
        elif now:
            kind = "ADDED"
        elif was:
            kind = "DELETED"
        else:
            kind = None
        if kind is not None:
            self.send(kind, copy.deepcopy(change.new))


class Store:
    """All objects of all resources, one resourceVersion counter, and the watch history."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._rv = 0
        self._objects: dict[tuple[ResourceType, str, str], Obj] = {}
        self._history: list[Change] = []
        self._compacted = 0
        self._watches: set[StoreWatch] = set()

    @property
    def resource_version(self) -> int:
        """The latest resourceVersion handed out."""
        return self._rv

    @property
    def compacted(self) -> int:
        """Watches and exact lists from a resourceVersion older than this get 410 Gone."""
        return self._compacted

    def compact(self, resource_version: int | None = None) -> None:
        """Forget history up to ``resource_version`` (default: everything so far)."""
        rv = self._rv if resource_version is None else resource_version
        self._compacted = max(self._compacted, rv)
        self._history = [c for c in self._history if c.resource_version > self._compacted]

    def _key(self, resource: ResourceType, namespace: str | None, name: str) -> tuple[ResourceType, str, str]:
        return (resource, namespace if resource.namespaced else "", name)

    def get(self, resource: ResourceType, namespace: str | None, name: str) -> Obj:
        try:
            return copy.deepcopy(self._objects[self._key(resource, namespace, name)])
        except KeyError:
            raise not_found(resource, name) from None

    def list(
        self,
        resource: ResourceType,
        namespace: str | None,
        matches: Callable[[Obj], bool] = lambda obj: True,
    ) -> tuple[list[Obj], int]:
        """Matching objects in creation order, with the resourceVersion the list is as of."""
        items = [
            copy.deepcopy(obj)
            for (res, ns, _), obj in self._objects.items()
            if res == resource and (namespace is None or ns == namespace) and matches(obj)
        ]
        return items, self._rv

    def _record(self, resource: ResourceType, kind: str, old: Obj | None, new: Obj) -> None:
        change = Change(self._rv, resource, kind, copy.deepcopy(old), copy.deepcopy(new))
        self._history.append(change)
        for watch in list(self._watches):
            if not watch.cancelled:
                watch.deliver(change)

    def create(self, resource: ResourceType, namespace: str | None, obj: Obj) -> Obj:
        obj = copy.deepcopy(obj)
        obj["apiVersion"], obj["kind"] = resource.api_version, resource.kind
        metadata = obj.setdefault("metadata", {})
        if not metadata.get("name"):
            prefix = metadata.get("generateName")
            if not prefix:
                raise ApiError(422, "Invalid", f"{resource.kind}: metadata.name is required")
            metadata["name"] = prefix + uuid.uuid4().hex[:5]
        name = metadata["name"]
        if resource.namespaced:
            if namespace is None or metadata.get("namespace", namespace) != namespace:
                raise bad_request("the namespace of the object does not match the request")
            metadata["namespace"] = namespace
        key = self._key(resource, namespace, name)
        if key in self._objects:
            raise ApiError(409, "AlreadyExists", f'{resource.plural} "{name}" already exists',
                           {"name": name, "group": resource.group, "kind": resource.plural})
        self._rv += 1
        metadata.update(
            uid=str(uuid.uuid4()),
            resourceVersion=str(self._rv),
            creationTimestamp=timestamp(self._clock()),
            generation=1,
        )
        self._objects[key] = obj
        self._record(resource, "ADDED", None, obj)
        return copy.deepcopy(obj)

    def replace(
        self,
        resource: ResourceType,
        namespace: str | None,
        name: str,
        obj: Obj,
        expected_rv: str | None = None,
    ) -> Obj:
        """Write a new version; if ``expected_rv`` is given it must be the current one (CAS)."""
        key, old = self._current(resource, namespace, name, expected_rv)
        new = copy.deepcopy(obj)
        new["apiVersion"], new["kind"] = resource.api_version, resource.kind
        metadata = new.setdefault("metadata", {})
        if metadata.get("name", name) != name:
            raise bad_request("the name of the object does not match the request")
        # Fields the server owns cannot be changed by a client.
        for owned in ("name", "namespace", "uid", "creationTimestamp", "generation", "deletionTimestamp"):
            if owned in old["metadata"]:
                metadata[owned] = old["metadata"][owned]
            else:
                metadata.pop(owned, None)
        if _without_rv(new) == _without_rv(old):
            return copy.deepcopy(old)  # a no-op write does not bump the resourceVersion
        return self._modified(resource, key, old, new)

    def update(
        self,
        resource: ResourceType,
        namespace: str | None,
        name: str,
        mutate: Callable[[Obj], None],
        expected_rv: str | None = None,
    ) -> Obj:
        """Read, mutate in place and write back, bypassing the server-owned-field rules."""
        key, old = self._current(resource, namespace, name, expected_rv)
        new = copy.deepcopy(old)
        mutate(new)
        if new == old:
            return copy.deepcopy(old)
        return self._modified(resource, key, old, new)

    def _current(self, resource: ResourceType, namespace: str | None, name: str,
                 expected_rv: str | None) -> tuple[tuple[ResourceType, str, str], Obj]:
        """The stored object to write over, checked against ``expected_rv`` (CAS)."""
        key = self._key(resource, namespace, name)
        old = self._objects.get(key)
        if old is None:
            raise not_found(resource, name)
        if expected_rv and expected_rv != old["metadata"]["resourceVersion"]:
            raise conflict(resource, name)
        return key, old

    def _modified(self, resource: ResourceType, key: tuple[ResourceType, str, str], old: Obj, new: Obj) -> Obj:
        """Store ``new`` in place of ``old``: a new generation if the spec changed, a new
        resourceVersion, a MODIFIED event."""
        metadata = new["metadata"]
        if new.get("spec") != old.get("spec"):
            metadata["generation"] = old["metadata"].get("generation", 1) + 1
        self._rv += 1
        metadata["resourceVersion"] = str(self._rv)
        self._objects[key] = new
        self._record(resource, "MODIFIED", old, new)
        return copy.deepcopy(new)

    def delete(self, resource: ResourceType, namespace: str | None, name: str) -> Obj:
        key = self._key(resource, namespace, name)
        old = self._objects.pop(key, None)
        if old is None:
            raise not_found(resource, name)
        self._rv += 1
        final = copy.deepcopy(old)
        final["metadata"]["resourceVersion"] = str(self._rv)
        self._record(resource, "DELETED", old, final)
        return final

    def watch(
        self,
        resource: ResourceType,
        namespace: str | None,
        matches: Callable[[Obj], bool],
        since: int | None,
        send: Callable[[str, Obj], None],
    ) -> StoreWatch:
        """Start a watch: replay what happened after ``since``, then follow new writes.

        ``since`` None (or 0) means "start at most recent": the current
        matching objects first arrive as synthetic ADDED events.
        """
        watch = StoreWatch(resource, namespace, matches, send, self)
        if not since:
            for obj in self.list(resource, namespace, matches)[0]:
                send("ADDED", obj)
        else:
            if since < self._compacted:
                raise gone(since, self._compacted)
            for change in self._history:
                if change.resource_version > since:
                    watch.deliver(change)
        self._watches.add(watch)
        return watch

    def watches(self) -> Iterable[StoreWatch]:
        return list(self._watches)
