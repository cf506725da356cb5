"""The scaler's Kubernetes adapters: deployment Scale writes, Events and the Lease, off the reactor thread.

Each blocking call of the official client runs in the reactor's thread pool
and comes back as a Deferred; API errors are mapped to :class:`ScaleConflict`
(409: re-read and decide again) and :class:`KubernetesAPIError`. No decision
is made here: :mod:`protocol.scaling.scaler` decides, :mod:`infx.scaling.scaler` performs.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from twisted.internet import defer, threads
from twisted.internet.interfaces import IReactorTime

from protocol.scaling.lease import micro_time
from protocol.scaling.scaler import PostEvent

__all__ = [
    "EventRecorder", "KubernetesAPIError", "KubernetesEvents", "KubernetesLease", "KubernetesServiceQuery",
    "LeaseStore", "ScaleConflict", "ScaleRecord", "ServiceQuery",
]

T = TypeVar("T")


@dataclass(frozen=True)
class ScaleRecord:
    """A Scale subresource as read: replicas (0 when the server omitted them) and its resourceVersion."""

    replicas: int
    resource_version: str


class ScaleConflict(Exception):
    """The Scale changed since it was read (HTTP 409): re-read and decide again."""

    http_status = 409


class KubernetesAPIError(Exception):
    """The API server refused or failed a call; ``status`` is its HTTP status (0: no answer)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"{status} {message}")
        self.status = status


class ServiceQuery(Protocol):
    """Read and compare-and-set a deployment's replicas through its Scale subresource."""

    def read_scale(self, service: str, namespace: str) -> defer.Deferred[ScaleRecord]:
        """Read the Scale subresource."""

    def replace_scale(self, service: str, namespace: str, replicas: int,
                      resource_version: str) -> defer.Deferred[None]:
        """Replace the Scale if it is still at ``resource_version``; errbacks ScaleConflict if not."""


class EventRecorder(Protocol):
    """Where the scaler's Kubernetes Events go."""

    def post(self, event: PostEvent) -> defer.Deferred[None]:
        """Record ``event`` on its deployment."""


class LeaseStore(Protocol):
    """Read and compare-and-set one Lease object."""

    def read(self) -> defer.Deferred[dict[str, Any] | None]:
        """The Lease as JSON, or None when it does not exist."""

    def create(self, body: dict[str, Any]) -> defer.Deferred[None]:
        """Create it; errbacks ScaleConflict if someone else did first."""

    def replace(self, body: dict[str, Any]) -> defer.Deferred[None]:
        """Replace it at the resourceVersion in ``body``; errbacks ScaleConflict on a race."""


def _api_error(error: Exception) -> Exception:
    from kubernetes.client.rest import ApiException

    if isinstance(error, ApiException):
        if error.status == 409:
            return ScaleConflict(str(error.reason))
        return KubernetesAPIError(int(error.status or 0), str(error.reason))
    return error


class _InThread:
    """Run blocking client calls in the reactor's thread pool, mapping API errors."""

    def __init__(self, reactor: Any) -> None:
        self.reactor = reactor

    def call(self, f: Callable[..., T], *args: Any, **kwargs: Any) -> defer.Deferred[T]:
        def run() -> T:
            try:
                return f(*args, **kwargs)
            except Exception as error:
                raise _api_error(error) from error
        return threads.deferToThreadPool(self.reactor, self.reactor.getThreadPool(), run)


class KubernetesServiceQuery(_InThread):
    """:class:`ServiceQuery` on the ``apps/v1`` API: deployments and their Scale subresource.

    The Scale is replaced with the resourceVersion that was read: a JSON-patch
    ``test`` cannot express "still at zero", because the API server omits
    ``spec.replicas`` from a Scale when it is 0.
    """

    def __init__(self, reactor: Any, api_client: Any) -> None:
        super().__init__(reactor)
        from kubernetes import client

        self.apps = client.AppsV1Api(api_client)

    def read_scale(self, service: str, namespace: str) -> defer.Deferred[ScaleRecord]:
        def read() -> ScaleRecord:
            response = self.apps.read_namespaced_deployment_scale(service, namespace, _preload_content=False)
            scale = json.loads(response.data)
            return ScaleRecord(int((scale.get("spec") or {}).get("replicas") or 0),
                               scale["metadata"]["resourceVersion"])
        return self.call(read)

    def replace_scale(self, service: str, namespace: str, replicas: int,
                      resource_version: str) -> defer.Deferred[None]:
        body = {"apiVersion": "autoscaling/v1", "kind": "Scale",
                "metadata": {"name": service, "namespace": namespace, "resourceVersion": resource_version},
                "spec": {"replicas": replicas}}

        def replace() -> None:
            self.apps.replace_namespaced_deployment_scale(service, namespace, body, _preload_content=False)
        return self.call(replace)


class KubernetesEvents(_InThread):
    """:class:`EventRecorder` posting ``events.k8s.io/v1`` Events regarding the deployment."""

    def __init__(self, reactor: Any, api_client: Any, clock: IReactorTime, instance: str,
                 controller: str = "infx.io/scaler") -> None:
        super().__init__(reactor)
        from kubernetes import client

        self.api = client.EventsV1Api(api_client)
        self.clock = clock
        self.instance = instance
        self.controller = controller

    def post(self, event: PostEvent) -> defer.Deferred[None]:
        key = event.key
        body = {
            "apiVersion": "events.k8s.io/v1", "kind": "Event",
            "metadata": {"generateName": f"{key.name}.", "namespace": key.namespace},
            "eventTime": micro_time(self.clock.seconds()),
            "reportingController": self.controller, "reportingInstance": self.instance,
            "action": "Scale", "reason": event.reason, "note": event.message[:1024], "type": event.type,
            "regarding": {"apiVersion": "apps/v1", "kind": "Deployment", "name": key.name,
                          "namespace": key.namespace},
        }

        def create() -> None:
            self.api.create_namespaced_event(key.namespace, body, _preload_content=False)
        return self.call(create)


class KubernetesLease(_InThread):
    """:class:`LeaseStore` on one ``coordination.k8s.io/v1`` Lease."""

    def __init__(self, reactor: Any, api_client: Any, name: str, namespace: str) -> None:
        super().__init__(reactor)
        from kubernetes import client

        self.api = client.CoordinationV1Api(api_client)
        self.name = name
        self.namespace = namespace

    def read(self) -> defer.Deferred[dict[str, Any] | None]:
        def read() -> dict[str, Any] | None:
            from kubernetes.client.rest import ApiException
            try:
                response = self.api.read_namespaced_lease(self.name, self.namespace, _preload_content=False)
            except ApiException as error:
                if error.status == 404:
                    return None
                raise
            lease: dict[str, Any] = json.loads(response.data)
            return lease
        return self.call(read)

    def create(self, body: dict[str, Any]) -> defer.Deferred[None]:
        def create() -> None:
            self.api.create_namespaced_lease(self.namespace, body, _preload_content=False)
        return self.call(create)

    def replace(self, body: dict[str, Any]) -> defer.Deferred[None]:
        def replace() -> None:
            self.api.replace_namespaced_lease(self.name, self.namespace, body, _preload_content=False)
        return self.call(replace)
