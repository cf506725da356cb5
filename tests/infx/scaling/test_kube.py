"""infx.scaling.scaler against the fake Kubernetes API server, with the official client over real HTTP.

Scale writes are compare-and-set on the Scale subresource; several gateways
racing still make one write; Events and the Lease land in the API server.
"""

from __future__ import annotations

import random
from typing import Any, Callable

import pytest
import pytest_twisted
from kubernetes import client
from prometheus_client import CollectorRegistry
from twisted.internet import defer, reactor, task

from harness.kubeapi import DEPLOYMENTS, EVENTS, PODS, FakeKubeAPI
from infx.scaling.kube import KubernetesEvents, KubernetesLease, KubernetesServiceQuery, ScaleConflict
from infx.scaling.lease import LeaseElector
from infx.scaling.scaler import InferenceScaler, kubernetes_scaler
from protocol.scaling.scaler import (
    MIN_SCALE_LABEL,
    MODELS_ANNOTATION,
    SCALABLE_LABEL,
    ZERO_DURATION_LABEL,
    DeploymentKey,
    HoldResolved,
)

KEY = DeploymentKey("default", "llama")
LABELS = {"app": "llama", SCALABLE_LABEL: "true", MIN_SCALE_LABEL: "0"}


@pytest.fixture
def api() -> Any:
    server = FakeKubeAPI(reactor).start()
    yield server
    pytest_twisted.blockon(server.stop())


def api_client(api: FakeKubeAPI) -> client.ApiClient:
    return client.ApiClient(api.client_configuration())


def gateway(api: FakeKubeAPI, name: str, clock: Any = reactor,
            registry: CollectorRegistry | None = None) -> InferenceScaler:
    c = api_client(api)
    return InferenceScaler(clock, KubernetesServiceQuery(reactor, c),
                           events=KubernetesEvents(reactor, c, clock, name), registry=registry)


def scale_puts(api: FakeKubeAPI) -> int:
    return sum(1 for r in api.requests if r.method == "PUT" and r.path.endswith("/scale"))


@defer.inlineCallbacks
def until(condition: Callable[[], bool], limit: float = 10.0) -> Any:
    """Let the reactor run until ``condition()``; fail after ``limit`` seconds (a safety net)."""
    waited = 0.0
    while not condition():
        if waited >= limit:
            raise AssertionError(f"condition not met within {limit}s")
        yield task.deferLater(reactor, 0.01, lambda: None)
        waited += 0.01


@defer.inlineCallbacks
def settled(*scalers: InferenceScaler) -> Any:
    yield until(lambda: all(not s.writes_in_flight for s in scalers))


@pytest_twisted.inlineCallbacks
def test_thousand_held_requests_make_exactly_one_scale_write_and_one_event(api: FakeKubeAPI) -> Any:
    api.add_deployment("llama", replicas=0, labels=LABELS, annotations={MODELS_ANNOTATION: "llama-3"})
    registry = CollectorRegistry()
    scaler = gateway(api, "gw-1", registry=registry)
    scaler.observe_deployment(api.deployment("llama"))
    results: list[HoldResolved] = []
    for _ in range(1000):
        scaler.hold("llama-3", timeout=600).addCallback(results.append)
    yield settled(scaler)
    yield until(lambda: len(api.list(EVENTS)) >= 1)
    deployment = api.deployment("llama")
    # clamp(ceil(1000 held / target 10), 1, max 5), in one write.
    assert deployment["spec"]["replicas"] == 5
    assert deployment["metadata"]["generation"] == 2  # one spec change: one write
    assert scale_puts(api) == 1
    [event] = api.list(EVENTS)
    assert (event["reason"], event["regarding"]["name"], event["reportingInstance"]) == (
        "ScaledFromZero", "llama", "gw-1")
    assert results == []
    scaler.model_ready("llama-3")  # the engine connected and reported the model ready
    assert len(results) == 1000 and all(r.available and r.error is None for r in results)
    assert registry.get_sample_value("infx_scaler_scale_writes_total",
                                     {"deployment": "default/llama", "reason": "cold_start"}) == 1


@pytest_twisted.inlineCallbacks
def test_three_gateways_racing_make_one_write(api: FakeKubeAPI) -> Any:
    api.add_deployment("llama", replicas=0, labels=LABELS, annotations={MODELS_ANNOTATION: "llama-3"})
    gateways = [gateway(api, f"gw-{i}") for i in range(3)]
    results: list[HoldResolved] = []
    for g in gateways:
        g.observe_deployment(api.deployment("llama"))
    for i in range(999):
        gateways[i % 3].hold("llama-3", timeout=600).addCallback(results.append)
    yield settled(*gateways)
    yield until(lambda: len(api.list(EVENTS)) >= 1)
    deployment = api.deployment("llama")
    assert deployment["metadata"]["generation"] == 2
    assert len(api.list(EVENTS)) == 1
    for g in gateways:
        g.model_ready("llama-3")
    assert len(results) == 999 and all(r.available for r in results)


@pytest_twisted.inlineCallbacks
def test_scale_subresource_omitting_zero_replicas_reads_as_zero(api: FakeKubeAPI) -> Any:
    api.add_deployment("llama", replicas=0, labels=LABELS, annotations={MODELS_ANNOTATION: "llama-3"})
    query = KubernetesServiceQuery(reactor, api_client(api))
    record = yield query.read_scale("llama", "default")
    assert record.replicas == 0
    yield query.replace_scale("llama", "default", 2, record.resource_version)
    scaled = yield query.read_scale("llama", "default")
    assert scaled.replicas == 2
    with pytest.raises(ScaleConflict):  # compare-and-set: a stale read writes nothing
        yield query.replace_scale("llama", "default", 3, record.resource_version)
    assert api.deployment("llama")["spec"]["replicas"] == 2


@pytest_twisted.inlineCallbacks
def test_one_to_zero_after_zero_duration_and_not_before(api: FakeKubeAPI) -> Any:
    api.add_deployment("llama", replicas=1, annotations={MODELS_ANNOTATION: "llama-3"},
                       labels={**LABELS, ZERO_DURATION_LABEL: "3m"})
    clock = task.Clock()
    clock.advance(1_700_000_000)
    scaler = gateway(api, "gw-1", clock=clock)
    scaler.observe_deployment(api.deployment("llama"))
    scaler.start()
    scaler.request_started("llama-3")
    clock.advance(30)
    scaler.request_finished("llama-3")
    for _ in range(179):
        clock.advance(1)
    yield settled(scaler)
    assert scale_puts(api) == 0 and api.deployment("llama")["spec"]["replicas"] == 1
    clock.advance(1)
    yield settled(scaler)
    yield until(lambda: len(api.list(EVENTS)) >= 1)
    assert api.deployment("llama")["spec"]["replicas"] == 0
    assert [e["reason"] for e in api.list(EVENTS)] == ["ScaledToZero"]
    scaler.stop()


@pytest_twisted.inlineCallbacks
def test_watched_crash_loop_fails_held_requests_within_five_seconds(api: FakeKubeAPI) -> Any:
    api.add_deployment("llama", replicas=0, labels=LABELS, annotations={MODELS_ANNOTATION: "llama-3"})
    svc = kubernetes_scaler(reactor, api_client(api), "default", "gw-1", rng=random.Random(1),
                            watch_timeout=5)
    svc.startService()
    try:
        scaler = svc.scaler
        yield until(lambda: scaler.machine.deployments() == [KEY])
        results: list[HoldResolved] = []
        for _ in range(20):
            scaler.hold("llama-3", timeout=600).addCallback(results.append)
        yield until(lambda: api.deployment("llama")["spec"]["replicas"] == 2)
        api.add_pod("llama-abc", labels={"app": "llama", SCALABLE_LABEL: "true", MIN_SCALE_LABEL: "0"})

        def crash(pod: dict[str, Any]) -> None:
            pod["status"]["containerStatuses"] = [{"name": "engine", "state": {"waiting": {
                "reason": "CrashLoopBackOff", "message": "back-off 10s restarting failed container"}}}]

        api.update(PODS, "llama-abc", crash)
        yield until(lambda: len(results) == 20, limit=5.0)
        assert all(r.error is not None and r.error.http_status == 503
                   and "CrashLoopBackOff" in r.error.message for r in results)
        assert api.deployment("llama")["metadata"]["labels"][MIN_SCALE_LABEL] == "0"  # min untouched
        yield until(lambda: "CrashLoop" in [e["reason"] for e in api.list(EVENTS)])
        assert svc.elector is not None and svc.elector.is_leader()
        assert api.lease("infx-scaler")["spec"]["holderIdentity"] == "gw-1"
    finally:
        yield svc.stopService()


@pytest_twisted.inlineCallbacks
def test_lease_elects_one_leader_among_gateways(api: FakeKubeAPI) -> Any:
    electors = [LeaseElector(reactor, KubernetesLease(reactor, api_client(api), "infx-scaler", "default"),
                             f"gw-{i}") for i in range(3)]
    yield defer.gatherResults([e.round() for e in electors])
    yield defer.gatherResults([e.round() for e in electors])
    assert sum(e.is_leader() for e in electors) == 1
    leader = next(e for e in electors if e.is_leader())
    assert api.lease("infx-scaler")["spec"]["holderIdentity"] == leader.identity


@pytest_twisted.inlineCallbacks
def test_a_stopping_leader_hands_the_lease_over_at_once(api: FakeKubeAPI) -> Any:
    """Without the release the others would wait out the 15 s Lease."""
    electors = [LeaseElector(reactor, KubernetesLease(reactor, api_client(api), "infx-scaler", "default"),
                             f"gw-{i}") for i in range(2)]
    yield electors[0].round()
    yield electors[1].round()
    assert [e.is_leader() for e in electors] == [True, False]
    yield electors[0].stop()
    assert not electors[0].is_leader()
    assert api.lease("infx-scaler")["spec"]["holderIdentity"] == ""
    yield electors[1].round()
    assert electors[1].is_leader()
    assert api.lease("infx-scaler")["spec"]["holderIdentity"] == "gw-1"
    yield electors[0].round()  # stopped: it neither takes the Lease nor claims to lead
    assert not electors[0].is_leader()
    assert api.lease("infx-scaler")["spec"]["holderIdentity"] == "gw-1"
    yield electors[1].stop()


@pytest_twisted.inlineCallbacks
def test_watch_follows_changes_relists_after_a_dropped_watch_and_forgets_deleted(api: FakeKubeAPI) -> Any:
    svc = kubernetes_scaler(reactor, api_client(api), "default", "gw-1", rng=random.Random(1),
                            watch_timeout=5)
    svc.startService()
    try:
        scaler = svc.scaler
        yield api.when_watching(2)
        api.add_deployment("llama", replicas=0, labels=LABELS, annotations={MODELS_ANNOTATION: "llama-3"})
        api.add_deployment("plain", labels={"app": "plain"})  # not opted in: never seen
        yield until(lambda: scaler.machine.deployments() == [KEY])
        api.compact()
        api.drop_watches()
        api.add_deployment("other", labels={**LABELS, "app": "other"}, annotations={MODELS_ANNOTATION: "m2"})
        yield until(lambda: DeploymentKey("default", "other") in scaler.machine.deployments())
        results: list[HoldResolved] = []
        scaler.hold("llama-3", timeout=600).addCallback(results.append)
        yield settled(scaler)
        api.delete(DEPLOYMENTS, "llama")
        yield until(lambda: len(results) == 1)
        assert results[0].error is not None and results[0].error.http_status == 404
        assert sorted(k.name for k in scaler.machine.deployments()) == ["other"]
    finally:
        yield svc.stopService()
