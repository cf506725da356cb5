"""What the scaler watches: scalable deployments and the pods of a namespace, through two informers.

Each is an :class:`infx.discovery.kube.KubeInformer` (the one adapter of
:class:`protocol.discovery.informer.Informer`) over raw JSON objects; their cache
changes become :class:`~infx.scaling.scaler.InferenceScaler` observations: a
deployment added or modified is observed, one deleted is forgotten, and every
pod change rechecks the crash loops of the deployments that select it.
"""

from __future__ import annotations

import random
from collections.abc import Hashable, Mapping
from typing import Any, Protocol

from twisted.internet import defer

from infx.discovery.kube import InformerConfig, KubeInformer, ThreadingClock
from protocol.backoff import Backoff
from protocol.discovery.informer import WATCH_BACKOFF, Added, CacheEvent, Deleted, MalformedWatchObject, Modified, object_mapping
from protocol.scaling.scaler import SCALABLE_LABEL

__all__ = ["ScalerWatches", "kube_object", "object_key", "object_version"]


class Observer(Protocol):
    """The observations :class:`ScalerWatches` makes (an :class:`~infx.scaling.scaler.InferenceScaler`)."""

    def observe_deployment(self, deployment: Mapping[str, Any]) -> None: ...

    def forget_deployment(self, namespace: str, name: str) -> None: ...

    def observe_pod(self, pod: Mapping[str, Any], deleted: bool = False) -> None: ...


def kube_object(obj: Mapping[str, Any]) -> Mapping[str, Any]:
    """A namespaced object as the API server sends it; it must at least have a name."""
    name = object_mapping(obj.get("metadata"), "object metadata").get("name")
    if not isinstance(name, str) or not name:
        raise MalformedWatchObject("object has no metadata.name")
    return obj


def object_key(obj: Mapping[str, Any]) -> Hashable:
    """``(namespace, name)``: an object's key in the informer's cache."""
    metadata = obj["metadata"]
    return (metadata.get("namespace") or "default", metadata["name"])


def object_version(obj: Mapping[str, Any]) -> str | None:
    """An object's ``metadata.resourceVersion``, if it has one."""
    rv = obj["metadata"].get("resourceVersion")
    return rv if isinstance(rv, str) else None


class ScalerWatches:
    """The deployment and pod informers of one namespace, feeding ``scaler``.

    Deployments are those labelled ``infx.io/scalable=true``; pods are all
    of the namespace's (the scaler matches them to deployments by selector).
    """

    def __init__(self, reactor: ThreadingClock, api_client: Any, scaler: Observer, namespace: str, *,
                 rng: random.Random, watch_timeout: int = 30, request_timeout: float = 10.0,
                 backoff: Backoff | None = None) -> None:
        from kubernetes import client

        self.scaler = scaler
        backoff = backoff or WATCH_BACKOFF
        self.deployments: KubeInformer[Mapping[str, Any]] = KubeInformer(
            reactor, client.AppsV1Api(api_client).list_namespaced_deployment, kube_object, object_key,
            object_version, self._deployments_changed,
            InformerConfig("deployments", namespace, f"{SCALABLE_LABEL}=true", watch_timeout, request_timeout,
                           backoff), rng)
        self.pods: KubeInformer[Mapping[str, Any]] = KubeInformer(
            reactor, client.CoreV1Api(api_client).list_namespaced_pod, kube_object, object_key, object_version,
            self._pods_changed, InformerConfig("pods", namespace, None, watch_timeout, request_timeout, backoff),
            rng)

    def start(self) -> None:
        self.deployments.start()
        self.pods.start()

    def stop(self) -> defer.Deferred[None]:
        """No more observations after this; fires once both informers' threads returned."""
        d = defer.gatherResults([self.deployments.stop(), self.pods.stop()], consumeErrors=True)
        return d.addCallback(lambda _: None)

    def _deployments_changed(self, events: list[CacheEvent[Mapping[str, Any]]]) -> None:
        for event in events:
            if isinstance(event, (Added, Modified)):
                self.scaler.observe_deployment(event.obj)
            elif isinstance(event, Deleted):
                metadata = event.obj["metadata"]
                self.scaler.forget_deployment(metadata.get("namespace") or "default", metadata["name"])

    def _pods_changed(self, events: list[CacheEvent[Mapping[str, Any]]]) -> None:
        for event in events:
            if isinstance(event, (Added, Modified, Deleted)):
                self.scaler.observe_pod(event.obj, deleted=isinstance(event, Deleted))
