"""A fake Kubernetes API server for tests; see :mod:`harness.kubeapi.server` for what it serves.

Typical use in a pytest-twisted test::

    api = FakeKubeAPI(reactor).start()
    api.add_live_pod("gw-1", ip="10.0.0.1", labels={"app": "infx"})
    core = CoreV1Api(ApiClient(api.client_configuration()))
    pods = yield threads.deferToThread(core.list_namespaced_pod, "default")
    ...
    yield api.stop()
"""

from harness.kubeapi.kubeconfig import write_kubeconfig
from harness.kubeapi.server import FakeKubeAPI, RecordedRequest, scale_of
from harness.kubeapi.store import (
    CORE_EVENTS,
    DEPLOYMENTS,
    EVENTS,
    LEASES,
    PODS,
    ApiError,
    ResourceType,
    Store,
)

__all__ = [
    "CORE_EVENTS",
    "DEPLOYMENTS",
    "EVENTS",
    "LEASES",
    "PODS",
    "ApiError",
    "FakeKubeAPI",
    "RecordedRequest",
    "ResourceType",
    "Store",
    "scale_of",
    "write_kubeconfig",
]
