"""A fake Kubernetes API server on loopback, for tests, that the official ``kubernetes`` client talks to.

Twisted (``twisted.web``) in the test's reactor. It speaks the REST API over
real HTTP/1.1: lists with ``metadata.resourceVersion``, watches as chunked
newline-delimited JSON events that follow resourceVersion semantics, bookmarks,
410 Gone after compaction, and ``Status`` error bodies. Tests change the
cluster with helpers (``add_pod``, ``set_ready``, ...) or through the REST verbs,
and break things on purpose (``drop_watches``, ``compact``, ``fail_next``).

Resources: ``v1`` pods (with ``/status``) and events; ``apps/v1`` deployments
(with ``/status`` and ``/scale``); ``events.k8s.io/v1`` events;
``coordination.k8s.io/v1`` leases. Each supports list, watch, get, create
(POST), replace (PUT, with resourceVersion compare-and-set), patch (JSON
patch, merge patch; strategic merge patch is treated as a merge patch, so
lists are replaced rather than merged by key) and delete.

Blocking clients (the official one) must run off the reactor thread, since this
server runs on it: ``threads.deferToThread(api.list_namespaced_pod, ...)``.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from typing import Any, Callable, Mapping
from urllib.parse import parse_qs, urlsplit

from twisted.internet import defer
from twisted.internet.interfaces import IListeningPort
from twisted.internet.task import LoopingCall
from twisted.protocols.policies import WrappingFactory
from twisted.web import resource, server

from harness.kubeapi.store import (
    DEPLOYMENTS,
    LEASES,
    PODS,
    RESOURCES,
    ApiError,
    Obj,
    ResourceType,
    Store,
    StoreWatch,
    bad_request,
    field_selector,
    json_patch,
    label_selector,
    merge_patch,
    timestamp,
)

@dataclass(frozen=True)
class RecordedRequest:
    """One request as the server saw it, for assertions like "the watcher relisted"."""

    method: str
    path: str
    query: Mapping[str, str]
    resource: str | None  # plural of the resource addressed, if any
    watch: bool


@dataclass
class _Fault:
    code: int
    count: int
    method: str | None
    resource: str | None
    watch: bool | None

    def matches(self, record: RecordedRequest) -> bool:
        return (
            (self.method is None or self.method == record.method)
            and (self.resource is None or self.resource == record.resource)
            and (self.watch is None or self.watch == record.watch)
        )


_REASONS = {400: "BadRequest", 401: "Unauthorized", 403: "Forbidden", 404: "NotFound",
            405: "MethodNotAllowed", 409: "Conflict", 410: "Expired", 415: "UnsupportedMediaType",
            422: "Invalid", 429: "TooManyRequests", 500: "InternalError", 503: "ServiceUnavailable",
            504: "Timeout"}


class _WatchStream:
    """One open watch request: events out as JSON lines, one chunk each."""

    def __init__(self, api: FakeKubeAPI, request: server.Request, res: ResourceType, bookmarks: bool):
        self.api = api
        self.request = request
        self.resource = res
        self.bookmarks = bookmarks
        self.store_watch: StoreWatch | None = None
        self.timer: Any = None
        self.done = False

    def send(self, kind: str, obj: Obj) -> None:
        if not self.done:
            self.request.write(json.dumps({"type": kind, "object": obj}).encode() + b"\n")

    def bookmark(self) -> None:
        if self.bookmarks:
            self.send("BOOKMARK", {
                "kind": self.resource.kind,
                "apiVersion": self.resource.api_version,
                "metadata": {"resourceVersion": str(self.api.store.resource_version)},
            })

    def closed(self, _: object = None) -> None:
        self.done = True
        if self.store_watch is not None:
            self.store_watch.cancel()
        if self.timer is not None and self.timer.active():
            self.timer.cancel()
        self.api._watches.discard(self)

    def finish(self) -> None:
        """End the watch cleanly, as the server does when ``timeoutSeconds`` is up."""
        if not self.done:
            self.closed()
            self.request.finish()

    def drop(self) -> None:
        """Close the connection mid-stream, without the terminating chunk.

        What was already written still goes out first (a FIN, not a reset),
        so the client sees the events sent so far and then a broken stream,
        as when an API server or a load balancer in between goes away.
        """
        if not self.done:
            self.closed()
            self.request.transport.loseConnection()


class _Site(server.Site):
    noisy = False

    def log(self, request: server.Request) -> None:
        """Access logs would drown the test output."""


class _Root(resource.Resource):
    isLeaf = True

    def __init__(self, api: FakeKubeAPI) -> None:
        super().__init__()
        self.api = api

    def render(self, request: server.Request) -> Any:
        return self.api._render(request)


class FakeKubeAPI:
    """An in-memory Kubernetes API server listening on ``127.0.0.1``.

    ``token``: if set, every request needs ``Authorization: Bearer <token>``.
    ``watch_timeout``: the longest a watch stays open when the client gives no
    ``timeoutSeconds`` (the real server picks 30-60 minutes).
    ``bookmark_interval``: if set, watches that allow bookmarks get one that often.

    Helpers, all on the reactor thread, each a real write (new resourceVersion,
    watch events):

    - lifecycle: ``start()`` (returns self), ``url``, ``client_configuration()``,
      ``stop()`` (Deferred); ``harness.kubeapi.write_kubeconfig(path, url, token=)``.
    - any resource (``PODS``, ``DEPLOYMENTS``, ``EVENTS``, ``CORE_EVENTS``,
      ``LEASES``): ``create(res, obj)``, ``get(res, name)``, ``list(res)``,
      ``update(res, name, mutate)``, ``delete(res, name)``; ``namespace=``
      defaults to "default".
    - pods: ``add_pod(name, labels=, ip=, phase=, ready=)``,
      ``add_live_pod(name, ip, labels=)``, ``set_pod_ip``, ``set_phase``,
      ``set_ready``, ``mark_terminating``, ``delete_pod``, ``pod``.
    - deployments: ``add_deployment(name, replicas=, labels=, annotations=)``,
      ``set_deployment_status(name, replicas=, ready_replicas=, ...)``,
      ``deployment``; ``scale_of(deployment)`` is what ``/scale`` serves.
    - leases: ``lease(name)``.
    - faults and observation: ``drop_watches()``, ``close_watches()``,
      ``send_bookmarks()``, ``compact(rv=None)``, ``fail_next(code, count=,
      method=, resource=, watch=)``, ``open_watches``, ``when_watching(n)``,
      ``requests`` (every :class:`RecordedRequest`), ``list_requests(plural)``,
      ``store.resource_version``.
    """

    def __init__(
        self,
        reactor: Any,
        *,
        token: str | None = None,
        watch_timeout: float | None = None,
        bookmark_interval: float | None = None,
    ) -> None:
        self.reactor = reactor
        self.token = token
        self.watch_timeout = watch_timeout
        self.store = Store(reactor.seconds)
        self.requests: list[RecordedRequest] = []
        self._faults: list[_Fault] = []
        self._watches: set[_WatchStream] = set()
        self._watch_waiters: list[tuple[int, defer.Deferred[None]]] = []
        # The wrapper remembers connections, so that stop() can close keep-alive ones.
        self._factory = WrappingFactory(_Site(_Root(self)))
        self._factory.noisy = False
        self._port: IListeningPort | None = None
        self._bookmarks = LoopingCall(self.send_bookmarks)
        self._bookmarks.clock = reactor
        self._bookmark_interval = bookmark_interval

    # --- lifecycle ---------------------------------------------------------------

    def start(self) -> FakeKubeAPI:
        """Listen on a random loopback port; returns self."""
        self._port = self.reactor.listenTCP(0, self._factory, interface="127.0.0.1")
        if self._bookmark_interval:
            self._bookmarks.start(self._bookmark_interval, now=False)
        return self

    @property
    def url(self) -> str:
        assert self._port is not None, "start() first"
        return f"http://127.0.0.1:{self._port.getHost().port}"

    def stop(self) -> defer.Deferred[None]:
        """Close watches and connections and stop listening."""
        if self._bookmarks.running:
            self._bookmarks.stop()
        self.close_watches()
        for connection in list(self._factory.protocols):
            connection.transport.abortConnection()
        assert self._port is not None
        return defer.maybeDeferred(self._port.stopListening)

    def client_configuration(self) -> Any:
        """A ``kubernetes.client.Configuration`` pointing at this server (not the global default)."""
        from kubernetes import client

        configuration = client.Configuration()
        configuration.host = self.url
        if self.token:
            configuration.api_key = {"BearerToken": self.token}
            configuration.api_key_prefix = {"BearerToken": "Bearer"}
        return configuration

    # --- watch control -------------------------------------------------------------

    @property
    def open_watches(self) -> int:
        return len(self._watches)

    def when_watching(self, count: int = 1) -> defer.Deferred[None]:
        """Fires once at least ``count`` watches are open."""
        d: defer.Deferred[None] = defer.Deferred()
        self._watch_waiters.append((count, d))
        self._check_waiters()
        return d

    def _check_waiters(self) -> None:
        ready = [(n, d) for n, d in self._watch_waiters if len(self._watches) >= n]
        for waiter in ready:
            self._watch_waiters.remove(waiter)
            waiter[1].callback(None)

    def drop_watches(self) -> int:
        """Abort every open watch connection mid-stream; returns how many."""
        streams = list(self._watches)
        for stream in streams:
            stream.drop()
        return len(streams)

    def close_watches(self) -> int:
        """End every open watch cleanly (as on its timeout); returns how many."""
        streams = list(self._watches)
        for stream in streams:
            stream.finish()
        return len(streams)

    def send_bookmarks(self) -> int:
        """Send a BOOKMARK at the current resourceVersion to watches that allow them."""
        streams = [s for s in self._watches if s.bookmarks]
        for stream in streams:
            stream.bookmark()
        return len(streams)

    def compact(self, resource_version: int | None = None) -> None:
        """Forget history up to ``resource_version`` (default: now), so older watches get 410."""
        self.store.compact(resource_version)

    def fail_next(
        self,
        code: int,
        *,
        count: int = 1,
        method: str | None = None,
        resource: str | None = None,
        watch: bool | None = None,
    ) -> None:
        """Answer the next ``count`` matching requests with a ``Status`` error ``code``."""
        self._faults.append(_Fault(code, count, method, resource, watch))

    def list_requests(self, plural: str = "pods") -> list[RecordedRequest]:
        """The non-watch GETs of a collection so far."""
        return [r for r in self.requests
                if r.method == "GET" and r.resource == plural and not r.watch
                and r.path.rstrip("/").endswith("/" + plural)]

    # --- generic object helpers ------------------------------------------------------

    def create(self, res: ResourceType, obj: Obj, namespace: str = "default") -> Obj:
        return self.store.create(res, namespace, obj)

    def get(self, res: ResourceType, name: str, namespace: str = "default") -> Obj:
        return self.store.get(res, namespace, name)

    def list(self, res: ResourceType, namespace: str | None = "default") -> list[Obj]:
        return self.store.list(res, namespace)[0]

    def update(self, res: ResourceType, name: str, mutate: Callable[[Obj], None],
               namespace: str = "default") -> Obj:
        return self.store.update(res, namespace, name, mutate)

    def delete(self, res: ResourceType, name: str, namespace: str = "default") -> Obj:
        return self.store.delete(res, namespace, name)

    # --- pods ------------------------------------------------------------------------

    def add_pod(
        self,
        name: str,
        *,
        labels: Mapping[str, str] | None = None,
        ip: str | None = None,
        phase: str = "Pending",
        ready: bool = False,
        namespace: str = "default",
    ) -> Obj:
        """Create a pod as a scheduler and kubelet would have left it."""
        status: Obj = {"phase": phase, "conditions": [
            {"type": "PodScheduled", "status": "True"},
            {"type": "Ready", "status": "True" if ready else "False"},
        ]}
        if ip:
            status["podIP"] = ip
            status["podIPs"] = [{"ip": ip}]
        return self.create(PODS, {
            "metadata": {"name": name, "labels": dict(labels or {})},
            "spec": {"containers": [{"name": "infx", "image": "infx:test"}]},
            "status": status,
        }, namespace)

    def add_live_pod(self, name: str, ip: str, *, labels: Mapping[str, str] | None = None,
                     namespace: str = "default") -> Obj:
        """A pod that is Running and Ready at ``ip``."""
        return self.add_pod(name, labels=labels, ip=ip, phase="Running", ready=True,
                            namespace=namespace)

    def pod(self, name: str, namespace: str = "default") -> Obj:
        return self.get(PODS, name, namespace)

    def set_pod_ip(self, name: str, ip: str | None, namespace: str = "default") -> Obj:
        def mutate(pod: Obj) -> None:
            status = pod.setdefault("status", {})
            if ip:
                status["podIP"], status["podIPs"] = ip, [{"ip": ip}]
            else:
                status.pop("podIP", None)
                status.pop("podIPs", None)
        return self.update(PODS, name, mutate, namespace)

    def set_phase(self, name: str, phase: str, namespace: str = "default") -> Obj:
        return self.update(PODS, name, lambda pod: pod["status"].__setitem__("phase", phase), namespace)

    def set_ready(self, name: str, ready: bool = True, namespace: str = "default") -> Obj:
        """Set the Ready condition (and phase Running when ready, as a kubelet would)."""
        def mutate(pod: Obj) -> None:
            status = pod.setdefault("status", {})
            if ready:
                status["phase"] = "Running"
            conditions = [c for c in status.get("conditions", []) if c.get("type") != "Ready"]
            conditions.append({"type": "Ready", "status": "True" if ready else "False"})
            status["conditions"] = conditions
        return self.update(PODS, name, mutate, namespace)

    def mark_terminating(self, name: str, grace_seconds: int = 30, namespace: str = "default") -> Obj:
        """Set a deletion timestamp, as a graceful delete does before the pod goes away."""
        def mutate(pod: Obj) -> None:
            pod["metadata"]["deletionTimestamp"] = timestamp(self.reactor.seconds() + grace_seconds)
            pod["metadata"]["deletionGracePeriodSeconds"] = grace_seconds
        return self.update(PODS, name, mutate, namespace)

    def delete_pod(self, name: str, namespace: str = "default") -> Obj:
        return self.delete(PODS, name, namespace)

    # --- deployments -------------------------------------------------------------------

    def add_deployment(
        self,
        name: str,
        *,
        replicas: int = 0,
        labels: Mapping[str, str] | None = None,
        annotations: Mapping[str, str] | None = None,
        namespace: str = "default",
    ) -> Obj:
        """Create a deployment whose selector and template carry ``labels`` (default ``app=<name>``)."""
        labels = dict(labels or {"app": name})
        return self.create(DEPLOYMENTS, {
            "metadata": {"name": name, "labels": labels, "annotations": dict(annotations or {})},
            "spec": {
                "replicas": replicas,
                "selector": {"matchLabels": labels},
                "template": {
                    "metadata": {"labels": labels},
                    "spec": {"containers": [{"name": "engine", "image": "engine:test"}]},
                },
            },
            "status": {},
        }, namespace)

    def deployment(self, name: str, namespace: str = "default") -> Obj:
        return self.get(DEPLOYMENTS, name, namespace)

    def set_deployment_status(self, name: str, namespace: str = "default", **status: int) -> Obj:
        """Set status fields as a controller would: ``replicas=2, ready_replicas=1, ...``.

        Keyword names are snake_case and become camelCase; ``observedGeneration``
        is set to the current generation.
        """
        def mutate(deployment: Obj) -> None:
            out = deployment.setdefault("status", {})
            for key, value in status.items():
                head, *rest = key.split("_")
                out[head + "".join(word.title() for word in rest)] = value
            out["observedGeneration"] = deployment["metadata"].get("generation", 1)
        return self.update(DEPLOYMENTS, name, mutate, namespace)

    def lease(self, name: str, namespace: str = "default") -> Obj:
        return self.get(LEASES, name, namespace)

    # --- HTTP ----------------------------------------------------------------------------

    def _render(self, request: server.Request) -> Any:
        method = request.method.decode()
        parts = urlsplit(request.uri.decode())
        query = {k: v[-1] for k, v in parse_qs(parts.query, keep_blank_values=True).items()}
        segments = [s for s in parts.path.split("/") if s]
        try:
            route = _route(segments)
        except ApiError as error:
            route = None
            routing_error: ApiError | None = error
        else:
            routing_error = None
        watching = method == "GET" and query.get("watch", "").lower() in ("1", "true")
        record = RecordedRequest(method, parts.path, query,
                                 route[0].plural if route else None, watching)
        self.requests.append(record)
        request.setHeader(b"content-type", b"application/json")
        try:
            self._authorize(request)
            self._inject_fault(record)
            if routing_error is not None:
                raise routing_error
            assert route is not None
            res, namespace, name, sub = route
            if name is None:
                if watching:
                    return self._watch(request, res, namespace, query)
                if method == "GET":
                    return self._reply(request, 200, self._list(res, namespace, query))
                if method == "POST":
                    if namespace is None and res.namespaced:
                        raise ApiError(405, "MethodNotAllowed", "POST needs a namespace")
                    return self._reply(request, 201, self.store.create(res, namespace, _body(request)))
            elif sub is None:
                return self._item(request, method, res, namespace, name)
            elif sub == "status" and res.status_subresource:
                return self._status(request, method, res, namespace, name)
            elif sub == "scale" and res is DEPLOYMENTS:
                return self._scale(request, method, namespace, name)
            else:
                raise ApiError(404, "NotFound", f"no subresource {sub!r} on {res.plural}")
            raise ApiError(405, "MethodNotAllowed", f"{method} is not supported here")
        except ApiError as error:
            return self._reply(request, error.code, error.status())

    def _authorize(self, request: server.Request) -> None:
        if self.token is None:
            return
        if request.getHeader(b"authorization") != f"Bearer {self.token}".encode():
            raise ApiError(401, "Unauthorized", "Unauthorized")

    def _inject_fault(self, record: RecordedRequest) -> None:
        for fault in self._faults:
            if fault.matches(record):
                fault.count -= 1
                if fault.count <= 0:
                    self._faults.remove(fault)
                reason = _REASONS.get(fault.code, "InternalError")
                raise ApiError(fault.code, reason, f"injected fault ({fault.code})")

    def _reply(self, request: server.Request, code: int, body: Obj) -> bytes:
        request.setResponseCode(code)
        return json.dumps(body).encode()

    def _selectors(self, query: Mapping[str, str]) -> Callable[[Obj], bool]:
        labels = label_selector(query.get("labelSelector"))
        fields = field_selector(query.get("fieldSelector"))
        return lambda obj: labels(obj["metadata"].get("labels") or {}) and fields(obj)

    def _list(self, res: ResourceType, namespace: str | None, query: Mapping[str, str]) -> Obj:
        rv = query.get("resourceVersion")
        if rv and query.get("resourceVersionMatch") == "Exact" and int(rv) < self.store.compacted:
            raise ApiError(410, "Expired", f"too old resource version: {rv} ({self.store.compacted})")
        items, list_rv = self.store.list(res, namespace, self._selectors(query))
        return {
            "kind": f"{res.kind}List",
            "apiVersion": res.api_version,
            "metadata": {"resourceVersion": str(list_rv)},
            "items": items,
        }

    def _watch(self, request: server.Request, res: ResourceType, namespace: str | None,
               query: Mapping[str, str]) -> Any:
        matches = self._selectors(query)
        try:
            since = int(query.get("resourceVersion") or 0)
            timeout = float(query["timeoutSeconds"]) if "timeoutSeconds" in query else self.watch_timeout
        except ValueError:
            raise bad_request("resourceVersion and timeoutSeconds must be numbers") from None
        bookmarks = query.get("allowWatchBookmarks", "").lower() in ("1", "true")
        stream = _WatchStream(self, request, res, bookmarks)
        request.setResponseCode(200)
        request.write(b"")  # headers now: the client returns from its call once they arrive
        try:
            stream.store_watch = self.store.watch(res, namespace, matches, since, stream.send)
        except ApiError as error:
            # Inside a watch the real server reports a too-old resourceVersion as an
            # ERROR event carrying the Status, then ends the stream.
            stream.send("ERROR", error.status())
            stream.finish()
            return server.NOT_DONE_YET
        request.notifyFinish().addBoth(stream.closed)
        if timeout is not None:
            stream.timer = self.reactor.callLater(timeout, stream.finish)
        self._watches.add(stream)
        self._check_waiters()
        return server.NOT_DONE_YET

    def _item(self, request: server.Request, method: str, res: ResourceType,
              namespace: str | None, name: str) -> Any:
        if method == "GET":
            return self._reply(request, 200, self.store.get(res, namespace, name))
        if method == "PUT":
            body = _body(request)
            expected = body.get("metadata", {}).get("resourceVersion")
            if res.status_subresource:
                body["status"] = self.store.get(res, namespace, name).get("status", {})
            return self._reply(request, 200, self.store.replace(res, namespace, name, body, expected))
        if method == "PATCH":
            current = self.store.get(res, namespace, name)
            patched = _patch(request, current)
            expected = _patched_rv(current, patched)
            if res.status_subresource:
                patched["status"] = current.get("status", {})
            return self._reply(request, 200, self.store.replace(res, namespace, name, patched, expected))
        if method == "DELETE":
            preconditions = (_body(request, optional=True) or {}).get("preconditions") or {}
            current = self.store.get(res, namespace, name)
            if preconditions.get("resourceVersion") not in (None, current["metadata"]["resourceVersion"]):
                raise ApiError(409, "Conflict", "precondition failed: resourceVersion")
            if preconditions.get("uid") not in (None, current["metadata"]["uid"]):
                raise ApiError(409, "Conflict", "precondition failed: uid")
            deleted = self.store.delete(res, namespace, name)
            if res is PODS:
                return self._reply(request, 200, deleted)
            return self._reply(request, 200, {
                "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success",
                "details": {"name": name, "group": res.group, "kind": res.plural,
                            "uid": deleted["metadata"]["uid"]},
            })
        raise ApiError(405, "MethodNotAllowed", f"{method} is not supported here")

    def _status(self, request: server.Request, method: str, res: ResourceType,
                namespace: str | None, name: str) -> Any:
        current = self.store.get(res, namespace, name)
        if method == "GET":
            return self._reply(request, 200, current)
        if method == "PUT":
            body = _body(request)
            expected = body.get("metadata", {}).get("resourceVersion")
        elif method == "PATCH":
            body = _patch(request, current)
            expected = _patched_rv(current, body)
        else:
            raise ApiError(405, "MethodNotAllowed", f"{method} is not supported here")
        updated = copy.deepcopy(current)
        updated["status"] = body.get("status", {})
        return self._reply(request, 200, self.store.replace(res, namespace, name, updated, expected))

    def _scale(self, request: server.Request, method: str, namespace: str | None, name: str) -> Any:
        current = self.store.get(DEPLOYMENTS, namespace, name)
        if method == "GET":
            return self._reply(request, 200, scale_of(current))
        if method == "PUT":
            body = _body(request)
        elif method == "PATCH":
            body = _patch(request, scale_of(current))
        else:
            raise ApiError(405, "MethodNotAllowed", f"{method} is not supported here")
        expected = body.get("metadata", {}).get("resourceVersion")
        replicas = (body.get("spec") or {}).get("replicas", 0)
        if not isinstance(replicas, int) or replicas < 0:
            raise ApiError(422, "Invalid", "spec.replicas must be a non-negative integer")

        def mutate(deployment: Obj) -> None:
            deployment["spec"]["replicas"] = replicas

        updated = self.store.update(DEPLOYMENTS, namespace, name, mutate, expected)
        return self._reply(request, 200, scale_of(updated))


def scale_of(deployment: Obj) -> Obj:
    """The autoscaling/v1 Scale of a deployment; like the real server, 0 replicas omits spec.replicas."""
    metadata = deployment["metadata"]
    replicas = deployment.get("spec", {}).get("replicas", 1)
    match = deployment.get("spec", {}).get("selector", {}).get("matchLabels", {})
    return {
        "kind": "Scale",
        "apiVersion": "autoscaling/v1",
        "metadata": {k: metadata[k] for k in
                     ("name", "namespace", "uid", "resourceVersion", "creationTimestamp") if k in metadata},
        "spec": {"replicas": replicas} if replicas else {},
        "status": {
            "replicas": deployment.get("status", {}).get("replicas", 0),
            "selector": ",".join(f"{k}={v}" for k, v in sorted(match.items())),
        },
    }


def _route(segments: list[str]) -> tuple[ResourceType, str | None, str | None, str | None]:
    """Map a path to (resource, namespace, name, subresource)."""
    if segments[:2] == ["api", "v1"]:
        group, version, rest = "", "v1", segments[2:]
    elif len(segments) >= 3 and segments[0] == "apis":
        group, version, rest = segments[1], segments[2], segments[3:]
    else:
        raise ApiError(404, "NotFound", "the server could not find the requested resource")
    namespace = None
    if len(rest) >= 3 and rest[0] == "namespaces":
        namespace, rest = rest[1], rest[2:]
    if not 1 <= len(rest) <= 3:
        raise ApiError(404, "NotFound", "the server could not find the requested resource")
    for res in RESOURCES:
        if (res.group, res.version, res.plural) == (group, version, rest[0]):
            if namespace is None and res.namespaced and len(rest) > 1:
                raise ApiError(404, "NotFound", f"{res.plural} are namespaced")
            return res, namespace, (rest[1] if len(rest) > 1 else None), (rest[2] if len(rest) > 2 else None)
    raise ApiError(404, "NotFound", "the server could not find the requested resource")


def _body(request: server.Request, optional: bool = False) -> Any:
    raw = request.content.read() if request.content is not None else b""
    if not raw.strip():
        if optional:
            return None
        raise bad_request("request body required")
    try:
        return json.loads(raw)
    except ValueError:
        raise bad_request("request body is not JSON") from None


def _patch(request: server.Request, current: Obj) -> Obj:
    content_type = (request.getHeader(b"content-type") or b"").decode().split(";")[0].strip()
    body = _body(request)
    if content_type == "application/json-patch+json":
        return json_patch(current, body)
    if content_type in ("application/merge-patch+json", "application/strategic-merge-patch+json"):
        if not isinstance(body, dict):
            raise bad_request("a merge patch is a JSON object")
        return merge_patch(current, body)
    raise ApiError(415, "UnsupportedMediaType", f"patch content type {content_type!r} is not supported")


def _patched_rv(current: Obj, patched: Obj) -> str | None:
    """A patch that sets metadata.resourceVersion makes it a precondition, as on the real server."""
    rv = patched.get("metadata", {}).get("resourceVersion")
    return rv if rv != current["metadata"]["resourceVersion"] else None
