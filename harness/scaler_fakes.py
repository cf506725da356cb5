"""An in-memory stand-in for Kubernetes deployments, for scaler tests that need no API server.

It keeps the Scale subresource's rules that the scaler relies on: every
write bumps the resourceVersion and the generation, and a replace at a stale
resourceVersion is a 409 (:class:`~infx.scaling.kube.ScaleConflict`).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

from twisted.internet import defer

from infx.scaling.kube import KubernetesAPIError, ScaleConflict, ScaleRecord
from protocol.scaling.scaler import DeploymentKey, PostEvent


class InMemoryServiceQuery:
    """Deployments held in memory with resourceVersions, behaving like the scale subresource.

    Also an :class:`~infx.scaling.kube.EventRecorder` (events land in
    ``events``), so a test can run the scaler with no Kubernetes at all.
    ``on_change(deployment)`` is called after every write, as a watch would.
    """

    def __init__(self, on_change: Callable[[dict[str, Any]], None] | None = None) -> None:
        self.deployments: dict[DeploymentKey, dict[str, Any]] = {}
        self.events: list[PostEvent] = []
        self.writes: list[tuple[DeploymentKey, int]] = []
        self.on_change = on_change
        self._version = itertools.count(1)

    def add(self, deployment: dict[str, Any]) -> dict[str, Any]:
        """Store a Deployment (JSON); returns it with its resourceVersion."""
        metadata = deployment.setdefault("metadata", {})
        metadata.setdefault("namespace", "default")
        metadata["resourceVersion"] = str(next(self._version))
        metadata.setdefault("generation", 1)
        key = DeploymentKey(metadata["namespace"], metadata["name"])
        self.deployments[key] = deployment
        return deployment

    def _get(self, service: str, namespace: str) -> dict[str, Any]:
        deployment = self.deployments.get(DeploymentKey(namespace, service))
        if deployment is None:
            raise KubernetesAPIError(404, f"deployments.apps {service!r} not found")
        return deployment

    def _set(self, deployment: dict[str, Any], count: int) -> None:
        metadata = deployment["metadata"]
        deployment.setdefault("spec", {})["replicas"] = count
        metadata["resourceVersion"] = str(next(self._version))
        metadata["generation"] = int(metadata.get("generation", 1)) + 1
        self.writes.append((DeploymentKey(metadata["namespace"], metadata["name"]), count))
        if self.on_change is not None:
            self.on_change(deployment)

    def read_scale(self, service: str, namespace: str) -> defer.Deferred[ScaleRecord]:
        def read() -> ScaleRecord:
            deployment = self._get(service, namespace)
            return ScaleRecord(int(deployment.get("spec", {}).get("replicas", 1)),
                               deployment["metadata"]["resourceVersion"])
        return defer.maybeDeferred(read)

    def replace_scale(self, service: str, namespace: str, replicas: int,
                      resource_version: str) -> defer.Deferred[None]:
        def replace() -> None:
            deployment = self._get(service, namespace)
            if deployment["metadata"]["resourceVersion"] != resource_version:
                raise ScaleConflict(f"{namespace}/{service} changed since {resource_version}")
            self._set(deployment, replicas)
        return defer.maybeDeferred(replace)

    def post(self, event: PostEvent) -> defer.Deferred[None]:
        self.events.append(event)
        return defer.succeed(None)
