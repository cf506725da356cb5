"""Which runtimes the gateway serves by URL, decided from pod objects.

Rules this file keeps: no I/O, no threads, no clock reads. Pods arrive as
the informer's cache events (:class:`protocol.discovery.informer.Informer`,
driven by ``infx/discovery/kube.py``).

Pods selected by ``--runtime-pod-label`` run an OpenAI-compatible runtime
(vLLM, SGLang, llama.cpp's server) that the gateway reaches itself, at
``http://POD_IP:PORT``, as the Rust routers' service discovery does. A pod is
served while it can answer (:func:`protocol.discovery.peers.live_ip`: Running,
Ready, not terminating), so its runtime has loaded its model when it joins;
its models are those its ``infx.io/models`` annotation names (as on the
scaler's deployments), else those the runtime lists. :class:`RuntimeSet` turns
the cache's changes into :class:`RuntimeAdded` and :class:`RuntimeRemoved`,
so that what is served always equals what the pods last seen want: a pod
whose address or models changed is removed and added again.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from dataclasses import dataclass
from typing import Any, Union

from protocol.discovery.informer import Added, CacheEvent, Deleted, Modified, object_mapping
from protocol.discovery.peers import PodState, live_ip, pod_state
from protocol.scaling.labels import MODELS_ANNOTATION, parse_models

__all__ = ["RuntimeAdded", "RuntimeChange", "RuntimePod", "RuntimeRemoved", "RuntimeSet", "RuntimeTarget",
           "runtime_pod", "runtime_pod_key", "runtime_pod_version"]


@dataclass(frozen=True)
class RuntimePod:
    """The fields of a pod that decide whether and how its runtime is served."""

    state: PodState
    models: tuple[str, ...] = ()


def runtime_pod(obj: Mapping[str, Any]) -> RuntimePod:
    """A :class:`RuntimePod` from a pod as the API server encodes it (camelCase JSON)."""
    annotations = object_mapping(object_mapping(obj.get("metadata"), "pod metadata").get("annotations"),
                                 "pod annotations")
    models = annotations.get(MODELS_ANNOTATION)
    return RuntimePod(pod_state(obj), parse_models(models if isinstance(models, str) else None))


def runtime_pod_key(pod: RuntimePod) -> Hashable:
    """A pod's key in the informer's cache: its name (one namespace is watched)."""
    return pod.state.name


def runtime_pod_version(pod: RuntimePod) -> str | None:
    return pod.state.resource_version


@dataclass(frozen=True)
class RuntimeTarget:
    """A runtime to serve: its server's root URL and the models to serve (none: those it lists)."""

    url: str
    models: tuple[str, ...] = ()


@dataclass(frozen=True)
class RuntimeAdded:
    """Serve the runtime of pod ``name``."""

    name: str
    target: RuntimeTarget


@dataclass(frozen=True)
class RuntimeRemoved:
    """Stop serving the runtime of pod ``name`` (gone, terminating, not ready, or changed)."""

    name: str
    target: RuntimeTarget


RuntimeChange = Union[RuntimeAdded, RuntimeRemoved]


class RuntimeSet:
    """The runtimes served, kept equal to those the pods last seen want, on ``port``."""

    def __init__(self, port: int) -> None:
        if not 0 < port < 65536:
            raise ValueError(f"runtime port {port} is out of range")
        self._port = port
        self._targets: dict[str, RuntimeTarget] = {}

    @property
    def targets(self) -> Mapping[str, RuntimeTarget]:
        """Runtimes served, by pod name (a copy)."""
        return dict(self._targets)

    def cache_changed(self, event: CacheEvent[RuntimePod]) -> list[RuntimeChange]:
        """One change of the pod informer's cache (a :class:`~protocol.discovery.informer.Synced` changes nothing)."""
        if isinstance(event, (Added, Modified)):
            return self._set(event.obj.state.name, self._target(event.obj))
        if isinstance(event, Deleted):
            return self._set(event.obj.state.name, None)
        return []

    def _target(self, pod: RuntimePod) -> RuntimeTarget | None:
        ip = live_ip(pod.state)
        if ip is None:
            return None
        host = f"[{ip}]" if ":" in ip else ip
        return RuntimeTarget(f"http://{host}:{self._port}", pod.models)

    def _set(self, name: str, target: RuntimeTarget | None) -> list[RuntimeChange]:
        previous = self._targets.get(name)
        if previous == target:
            return []
        changes: list[RuntimeChange] = []
        if previous is not None:
            del self._targets[name]
            changes.append(RuntimeRemoved(name, previous))
        if target is not None:
            self._targets[name] = target
            changes.append(RuntimeAdded(name, target))
        return changes
