"""infx.scaling.scaler on a task.Clock with the in-memory ServiceQuery: holds, writes, ticks, leases."""

from __future__ import annotations

from typing import Any

import pytest
from prometheus_client import CollectorRegistry
from twisted.internet import defer, task

from harness.scaler_fakes import InMemoryServiceQuery
from infx.scaling.kube import ScaleConflict
from infx.scaling.lease import LeaseElector
from infx.scaling.scaler import InferenceScaler
from protocol.scaling.scaler import (
    MAX_SCALE_LABEL,
    MIN_SCALE_LABEL,
    MODELS_ANNOTATION,
    SCALABLE_LABEL,
    STARTUP_TIMEOUT_LABEL,
    TARGET_LOAD_LABEL,
    ZERO_DURATION_LABEL,
    DeploymentKey,
    ScalerConfig,
    HoldResolved,
    ScalingLocalError,
)

KEY = DeploymentKey("ml", "llama")


def deployment(replicas: int = 0, **labels: str) -> dict[str, Any]:
    return {"metadata": {"name": "llama", "namespace": "ml",
                         "labels": {SCALABLE_LABEL: "true", **labels},
                         "annotations": {MODELS_ANNOTATION: "llama-3"}},
            "spec": {"replicas": replicas, "selector": {"matchLabels": {"app": "llama"}}}}


def setup(replicas: int = 0, config: ScalerConfig | None = None, leader: bool = True, **labels: str):
    clock = task.Clock()
    clock.advance(1_000_000)
    registry = CollectorRegistry()
    failed: list[tuple[str, Any]] = []
    query = InMemoryServiceQuery()
    scaler = InferenceScaler(clock, query, events=query, config=config, registry=registry,
                             fail_held=lambda model, error: failed.append((model, error)),
                             leader=leader)
    query.on_change = scaler.observe_deployment
    scaler.observe_deployment(query.add(deployment(replicas, **labels)))
    return clock, query, scaler, registry, failed


def results(ds: list[defer.Deferred[HoldResolved]]) -> list[HoldResolved | None]:
    out: list[HoldResolved | None] = []
    for d in ds:
        d.addBoth(out.append)
    return out


def metric(registry: CollectorRegistry, name: str, **labels: str) -> float | None:
    return registry.get_sample_value(name, labels)


def test_thousand_concurrent_holds_make_one_write_and_one_event_and_all_are_served():
    clock, query, scaler, registry, _ = setup(**{MIN_SCALE_LABEL: "0"})
    ds = [scaler.hold("llama-3", timeout=600) for _ in range(1000)]
    out = results(ds)
    assert query.writes == [(KEY, 1)]
    assert [e.reason for e in query.events] == ["ScaledFromZero"]
    assert out == []
    assert metric(registry, "infx_scaler_held_requests", deployment="ml/llama") == 1000
    clock.advance(12.5)
    scaler.model_ready("llama-3")
    assert len(out) == 1000
    assert all(isinstance(r, HoldResolved) and r.available and r.found and r.error is None
               for r in out)
    assert metric(registry, "infx_scaler_scale_writes_total", deployment="ml/llama", reason="cold_start") == 1
    assert metric(registry, "infx_scaler_cold_start_seconds_count", deployment="ml/llama") == 1
    assert metric(registry, "infx_scaler_cold_start_seconds_sum", deployment="ml/llama") == 12.5
    assert metric(registry, "infx_scaler_held_requests", deployment="ml/llama") == 0


def test_a_held_request_ends_when_its_model_is_ready_and_reports_how_long_it_waited():
    clock, query, scaler, _, _ = setup()
    out = results([scaler.hold("llama-3")])
    clock.advance(3)
    scaler.model_ready("llama-3")
    [r] = out
    assert (r.available, r.found, r.error, r.waited, r.key) == (True, True, None, 3, KEY)
    [missing] = results([scaler.hold("other")])
    assert (missing.available, missing.found, missing.error.http_status) == (False, False, 404)


def test_hold_ends_with_503_and_retry_after_at_its_timeout():
    clock, _, scaler, _, _ = setup(config=ScalerConfig(retry_after=4))
    out = results([scaler.hold("llama-3", timeout=30)])
    clock.advance(29.9)
    assert out == []
    clock.advance(0.1)
    [r] = out
    assert (r.available, r.error.http_status, r.error.headers()) == (False, 503, {"Retry-After": "4"})


def test_startup_timeout_fails_held_requests_and_tells_the_processor():
    clock, query, scaler, _, failed = setup(**{STARTUP_TIMEOUT_LABEL: "60"})
    out = results([scaler.hold("llama-3") for _ in range(3)])
    clock.advance(60)
    assert len(out) == 3 and all(r.error.http_status == 503 for r in out)
    assert "StartupTimeout" in [e.reason for e in query.events]
    assert [(model, error.http_status) for model, error in failed] == [("llama-3", 503)]


def test_cancelling_a_hold_releases_it():
    clock, _, scaler, registry, _ = setup()
    d = scaler.hold("llama-3", request_id="t1", timeout=30)
    d.addErrback(lambda f: f.trap(defer.CancelledError))
    d.cancel()
    assert scaler.machine.held_count(KEY) == 0
    assert metric(registry, "infx_scaler_held_requests", deployment="ml/llama") == 0
    clock.advance(100)  # no timer left to fire into a released request
    assert scaler.machine.next_deadline() is None


def test_release_by_id_forgets_the_hold():
    clock, _, scaler, _, _ = setup()
    d = scaler.hold("llama-3", request_id="t1", timeout=5)
    scaler.release("t1")
    assert scaler.machine.held_count(KEY) == 0
    clock.advance(10)
    assert not d.called


def test_cap_on_held_requests_answers_503_beyond_it():
    _, _, scaler, _, _ = setup(config=ScalerConfig(held_cap=2))
    out = results([scaler.hold("llama-3") for _ in range(3)])
    [r] = out
    assert r.error.http_status == 503 and r.error.headers()["Retry-After"]


def test_conflict_rereads_and_stands_down_when_someone_else_scaled():
    clock, query, scaler, _, _ = setup()
    original = query.replace_scale

    def racing(service: str, namespace: str, replicas: int, version: str) -> defer.Deferred[None]:
        # Another gateway writes between our read and our replace.
        query.replace_scale = original
        dep = query.deployments[KEY]
        query._set(dep, 2)
        return defer.fail(ScaleConflict("changed"))

    query.replace_scale = racing  # type: ignore[method-assign]
    out = results([scaler.hold("llama-3")])
    assert query.writes == [(KEY, 2)]  # only the other gateway's write
    assert query.events == []
    scaler.model_ready("llama-3")
    assert out[0].available


def test_failed_write_is_retried_and_posts_a_warning():
    clock, query, scaler, _, _ = setup(config=ScalerConfig(write_retry_delay=2))
    original = query.replace_scale
    query.replace_scale = lambda *a: defer.fail(RuntimeError("API down"))  # type: ignore[method-assign]
    results([scaler.hold("llama-3")])
    assert [e.reason for e in query.events] == ["ScaleFailed"]
    query.replace_scale = original  # type: ignore[method-assign]
    clock.advance(2)
    assert query.writes == [(KEY, 1)]


def test_crash_looping_pod_fails_held_requests_at_once():
    _, _, scaler, _, failed = setup(replicas=1)
    out = results([scaler.hold("llama-3") for _ in range(5)])
    scaler.observe_pod({"metadata": {"name": "llama-1", "namespace": "ml", "labels": {"app": "llama"}},
                        "status": {"containerStatuses": [
                            {"name": "engine", "state": {"waiting": {"reason": "CrashLoopBackOff"}}}]}})
    assert len(out) == 5 and all("CrashLoopBackOff" in r.error.message for r in out)
    assert [m for m, _ in failed] == ["llama-3"]
    # A pod of another deployment does not count.
    scaler.observe_pod({"metadata": {"name": "x", "namespace": "ml", "labels": {"app": "other"}},
                        "status": {"containerStatuses": [
                            {"name": "e", "state": {"waiting": {"reason": "ErrImagePull"}}}]}})
    assert len(failed) == 1


def test_pod_crash_seen_before_its_deployment_still_blocks():
    clock = task.Clock()
    query = InMemoryServiceQuery()
    scaler = InferenceScaler(clock, query, events=query)
    scaler.observe_pod({"metadata": {"name": "p", "namespace": "ml", "labels": {"app": "llama"}},
                        "status": {"containerStatuses": [
                            {"name": "e", "state": {"waiting": {"reason": "ImagePullBackOff"}}}]}})
    scaler.observe_deployment(query.add(deployment()))
    [r] = results([scaler.hold("llama-3")])
    assert r.error.http_status == 503 and "ImagePullBackOff" in r.error.message


def test_a_deleted_deployment_fails_its_held_requests_with_404():
    _, _, scaler, _, _ = setup()
    out = results([scaler.hold("llama-3")])
    scaler.forget_deployment("ml", "llama")
    assert out[0].error.http_status == 404
    assert scaler.machine.deployments() == []


def test_one_to_zero_happens_zero_duration_after_the_last_request_and_not_before():
    clock, query, scaler, _, _ = setup(replicas=1, **{MIN_SCALE_LABEL: "0", ZERO_DURATION_LABEL: "3m"})
    scaler.start()
    scaler.request_started("llama-3")
    clock.advance(40)
    scaler.request_finished("llama-3")
    clock.pump([1] * 179)
    assert query.writes == []
    clock.advance(1)
    assert query.writes == [(KEY, 0)]
    assert [e.reason for e in query.events] == ["ScaledToZero"]
    scaler.stop()


def test_autoscaler_scales_up_under_load_only_while_leader():
    for leader, expected, desired in ((False, [], None), (True, [(KEY, 2)], 2)):
        clock, query, scaler, registry, _ = setup(replicas=1, leader=leader, **{TARGET_LOAD_LABEL: "1",
                                                                               MAX_SCALE_LABEL: "5"})
        scaler.start()
        for _ in range(3):
            scaler.request_started("llama-3")
        clock.advance(1)
        assert query.writes == expected
        assert metric(registry, "infx_scaler_leader") == float(leader)
        assert metric(registry, "infx_scaler_desired_replicas", deployment="ml/llama") == desired
        assert metric(registry, "infx_scaler_current_replicas", deployment="ml/llama") == (desired or 1)
        scaler.stop()


class MemoryLease:
    """A LeaseStore with a resourceVersion compare-and-set, shared by several electors."""

    def __init__(self) -> None:
        self.lease: dict[str, Any] | None = None
        self.version = 0

    def read(self) -> defer.Deferred[dict[str, Any] | None]:
        import copy
        return defer.succeed(copy.deepcopy(self.lease))

    def create(self, body: dict[str, Any]) -> defer.Deferred[None]:
        if self.lease is not None:
            return defer.fail(ScaleConflict("exists"))
        return self._store(body)

    def replace(self, body: dict[str, Any]) -> defer.Deferred[None]:
        if self.lease is None or body["metadata"].get("resourceVersion") != str(self.version):
            return defer.fail(ScaleConflict("changed"))
        return self._store(body)

    def _store(self, body: dict[str, Any]) -> defer.Deferred[None]:
        self.version += 1
        body["metadata"]["resourceVersion"] = str(self.version)
        self.lease = body
        return defer.succeed(None)


def test_only_one_elector_leads_and_another_takes_over_after_expiry():
    clock = task.Clock()
    clock.advance(1_700_000_000)
    store = MemoryLease()
    a = LeaseElector(clock, store, "gw-a", duration=15, renew_interval=5)
    b = LeaseElector(clock, store, "gw-b", duration=15, renew_interval=5)
    a.start()
    b.start()
    assert (a.is_leader(), b.is_leader()) == (True, False)
    clock.pump([5] * 6)
    assert (a.is_leader(), b.is_leader()) == (True, False)
    a._schedule.stop()  # gw-a dies without releasing
    a._timer.cancel()
    clock.pump([5] * 4)
    assert b.is_leader()
    assert store.lease["spec"]["holderIdentity"] == "gw-b"
    assert store.lease["spec"]["leaseTransitions"] == 1
    b.stop()
    assert not b.is_leader()


def test_racing_electors_cannot_both_win_the_same_version():
    clock = task.Clock()
    clock.advance(1_700_000_000)
    store = MemoryLease()
    a = LeaseElector(clock, store, "gw-a")
    b = LeaseElector(clock, store, "gw-b")
    a.round()
    clock.advance(100)  # a's lease expired; both now try from the same read
    stale = store.lease
    store.read = lambda: defer.succeed(__import__("copy").deepcopy(stale))  # type: ignore[method-assign]
    a.round()
    b.round()
    assert [e.is_leader() for e in (a, b)] == [True, False]


@pytest.mark.parametrize("labels", [{MAX_SCALE_LABEL: "0"}])
def test_not_scalable_deployment_answers_at_once(labels):
    _, query, scaler, _, _ = setup(**labels)
    [r] = results([scaler.hold("llama-3")])
    assert (r.found, r.error.http_status) == (True, 503)
    assert query.writes == []


def test_a_failing_event_never_blocks_the_scale_write():
    clock = task.Clock()
    query = InMemoryServiceQuery()

    class BrokenEvents:
        def post(self, event: Any) -> defer.Deferred[None]:
            return defer.fail(RuntimeError("events API down"))

    scaler = InferenceScaler(clock, query, events=BrokenEvents())
    scaler.observe_deployment(query.add(deployment()))
    out = results([scaler.hold("llama-3")])
    assert query.writes == [(KEY, 1)]
    scaler.model_ready("llama-3")
    assert out[0].available


def test_invalid_labels_are_posted_as_a_warning_event_once():
    _, query, scaler, _, _ = setup(**{MIN_SCALE_LABEL: "many"})
    scaler.observe_deployment(query.deployments[KEY])
    assert [(e.reason, e.type) for e in query.events] == [("InvalidScalingLabel", "Warning")]


def test_holding_a_request_id_twice_is_refused_and_keeps_the_first_waiter():
    _, _, scaler, _, _ = setup()
    first = scaler.hold("llama-3", request_id="t1")
    with pytest.raises(ScalingLocalError):
        scaler.hold("llama-3", request_id="t1")
    out = results([first])
    scaler.model_ready("llama-3")
    assert out[0].available


def test_the_autoscaler_ticks_on_the_machines_one_timer_from_when_the_lease_is_won():
    clock, query, scaler, registry, _ = setup(replicas=1, leader=False, **{TARGET_LOAD_LABEL: "1",
                                                                          MAX_SCALE_LABEL: "5"})
    scaler.start()
    assert clock.getDelayedCalls() == []  # nothing to wake for while not leading
    for _ in range(3):
        scaler.request_started("llama-3")
    scaler.leader_changed(True)
    assert metric(registry, "infx_scaler_leader") == 1
    (timer,) = clock.getDelayedCalls()
    assert timer.getTime() == clock.seconds() + 1
    clock.advance(1)
    assert query.writes == [(KEY, 2)]
    scaler.leader_changed(False)
    assert metric(registry, "infx_scaler_leader") == 0
    assert clock.getDelayedCalls() == []
    scaler.stop()
