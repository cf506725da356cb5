"""The pure scaler, driven with a hand-stepped clock: cold starts, holds, autoscaling, zero, crash loops."""

import math

import pytest
from hypothesis import given, settings, strategies as st

from protocol.scaling.scaler import (
    MAX_SCALE_LABEL,
    MIN_SCALE_LABEL,
    MODELS_ANNOTATION,
    SCALABLE_LABEL,
    SCALE_TYPE_LABEL,
    SCALING_FACTOR_LABEL,
    STARTUP_TIMEOUT_LABEL,
    TARGET_LOAD_LABEL,
    ZERO_DURATION_LABEL,
    ColdStartFinished,
    ColdStartPhase,
    DeploymentKey,
    FailHeld,
    HoldResolved,
    PostEvent,
    ScaleError,
    ScaleReason,
    Scaler,
    ScalerConfig,
    ScaleWrite,
    ScalingLocalError,
    cold_start_target,
    deployment_snapshot,
    parse_scaling_labels,
)

KEY = DeploymentKey("ml", "llama")


def snap(replicas=0, generation=1, models="llama-3", progress_failure=False, name="llama",
         image="engine:1", **labels):
    status = {}
    if progress_failure:
        status["conditions"] = [{"type": "Progressing", "reason": "ProgressDeadlineExceeded",
                                 "message": "timed out progressing"}]
    return deployment_snapshot({
        "metadata": {"name": name, "namespace": "ml", "generation": generation,
                     "labels": {SCALABLE_LABEL: "true", **labels},
                     "annotations": {MODELS_ANNOTATION: models}},
        "spec": {"replicas": replicas, "template": {"spec": {"containers": [{"name": "e", "image": image}]}}},
        "status": status})


def of(effects, kind):
    return [e for e in effects if isinstance(e, kind)]


def scaler_with(now=0.0, config=None, **kw):
    scaler = Scaler(config or ScalerConfig())
    scaler.observe_deployment(snap(**kw), now)
    return scaler


def perform(scaler, write, cluster, now):
    """What the Kubernetes side does: read, resolve, write (no conflict here)."""
    replicas = scaler.resolve_write(write, cluster[write.key], now)
    if replicas is not None:
        cluster[write.key] = replicas
    return scaler.write_done(write, replicas, now)


# -- cold start ---------------------------------------------------------------

def test_cold_start_target_clamps_held_over_target_between_one_or_min_and_max():
    s = parse_scaling_labels({TARGET_LOAD_LABEL: "10", MIN_SCALE_LABEL: "0", MAX_SCALE_LABEL: "4"}).settings
    assert [cold_start_target(n, s) for n in (0, 1, 10, 11, 35, 1000)] == [1, 1, 1, 2, 4, 4]
    s2 = parse_scaling_labels({MIN_SCALE_LABEL: "3", MAX_SCALE_LABEL: "5"}).settings
    assert cold_start_target(1, s2) == 3


def test_a_thousand_held_requests_make_one_cold_start_and_one_write():
    scaler = scaler_with(**{MIN_SCALE_LABEL: "0", TARGET_LOAD_LABEL: "100", MAX_SCALE_LABEL: "20"})
    effects = []
    for i in range(1000):
        effects += scaler.hold_model(i, "llama-3", None, i / 1000)
    writes = of(effects, ScaleWrite)
    assert writes == [ScaleWrite(KEY, 0, 1, ScaleReason.COLD_START)]
    assert of(effects, HoldResolved) == []
    assert scaler.held_count(KEY) == 1000
    assert scaler.phase(KEY) is ColdStartPhase.WRITING
    # Resolved at write time with everything held so far: ceil(1000 / 100).
    assert scaler.resolve_write(writes[0], 0, 1.0) == 10


def test_held_requests_are_served_when_an_engine_reports_the_model_ready():
    scaler = scaler_with(**{MIN_SCALE_LABEL: "0"})
    cluster = {KEY: 0}
    [write] = scaler.hold_model("a", "llama-3", None, 0.0)
    scaler.hold_model("b", "llama-3", None, 0.5)
    effects = perform(scaler, write, cluster, 1.0)
    assert cluster[KEY] == 1
    assert of(effects, PostEvent)[0].reason == "ScaledFromZero"
    assert scaler.phase(KEY) is ColdStartPhase.WAITING
    effects = scaler.model_ready("llama-3", 42.0)
    assert of(effects, ColdStartFinished) == [ColdStartFinished(KEY, 42.0)]
    resolved = of(effects, HoldResolved)
    assert {(r.request_id, r.available, r.found, r.error) for r in resolved} == {
        ("a", True, True, None), ("b", True, True, None)}
    assert [r.waited for r in resolved] == [42.0, 41.5]
    assert scaler.phase(KEY) is ColdStartPhase.IDLE
    assert scaler.hold_model("c", "llama-3", None, 43.0) == [HoldResolved("c", None, True, True, None, 0.0)]


def test_an_engine_ready_before_the_write_returns_is_timed_once():
    """The replicas were stored and an engine came up before this gateway read the write's answer
    (a pod already starting, a fast one): the cold start still ended then, and is timed once."""
    scaler = scaler_with(**{MIN_SCALE_LABEL: "0"})
    cluster = {KEY: 0}
    [write] = scaler.hold_model("a", "llama-3", None, 0.0)
    assert scaler.phase(KEY) is ColdStartPhase.WRITING
    effects = scaler.model_ready("llama-3", 3.0)
    assert of(effects, ColdStartFinished) == [ColdStartFinished(KEY, 3.0)]
    assert [r.request_id for r in of(effects, HoldResolved)] == ["a"]
    later = perform(scaler, write, cluster, 3.5) + scaler.model_ready("llama-3", 4.0)
    assert of(later, ColdStartFinished) == [] and scaler.phase(KEY) is ColdStartPhase.IDLE
    # The next cold start is timed from its own first held request.
    scaler.model_gone("llama-3", 10.0)
    scaler.observe_deployment(snap(replicas=0, generation=2, **{MIN_SCALE_LABEL: "0"}), 10.0)
    [again] = scaler.hold_model("b", "llama-3", None, 11.0)
    perform(scaler, again, cluster | {KEY: 0}, 11.5)
    assert of(scaler.model_ready("llama-3", 20.0), ColdStartFinished) == [ColdStartFinished(KEY, 9.0)]


def test_losing_gateway_writes_nothing_and_waits_for_the_engine():
    """Two gateways, one cluster: both decide a cold start, the CAS resolve lets only one write."""
    g1, g2 = scaler_with(), scaler_with()
    cluster = {KEY: 0}
    [w1] = g1.hold_model("r1", "llama-3", None, 0.0)
    [w2] = g2.hold_model("r2", "llama-3", None, 0.0)
    events = perform(g1, w1, cluster, 0.1) + perform(g2, w2, cluster, 0.1)
    assert cluster[KEY] == 1
    assert len(of(events, PostEvent)) == 1
    assert g2.phase(KEY) is ColdStartPhase.WAITING
    assert of(g2.model_ready("llama-3", 5.0), HoldResolved)[0].available


def test_deployment_already_scaled_up_needs_no_write():
    scaler = scaler_with(replicas=2)
    assert scaler.hold_model("a", "llama-3", None, 0.0) == []
    assert scaler.phase(KEY) is ColdStartPhase.WAITING


def test_unknown_model_is_not_found():
    scaler = scaler_with()
    [r] = scaler.hold_model("a", "other", None, 0.0)
    assert (r.available, r.found, r.error.http_status) == (False, False, 404)
    assert r.error.openai_body()["error"]["type"] == "invalid_request_error"
    assert r.error.openai_body()["error"]["code"] == "model_not_found"
    assert r.error.headers() == {}


def test_not_scalable_deployment_answers_503_at_once():
    scaler = scaler_with(**{MAX_SCALE_LABEL: "0"})
    [r] = scaler.hold_model("a", "llama-3", None, 0.0)
    assert (r.available, r.found, r.error.http_status) == (False, True, 503)
    assert "not scalable" in r.error.message


def test_holding_the_same_request_twice_is_local_misuse():
    scaler = scaler_with()
    scaler.hold_model("a", "llama-3", None, 0.0)
    with pytest.raises(ScalingLocalError):
        scaler.hold_model("a", "llama-3", None, 0.0)


def test_one_cold_start_for_a_deployment_of_two_models_and_each_model_ready_ends_its_own_holds():
    scaler = scaler_with(models="m1,m2")
    [write] = scaler.hold_model("x", "m1", None, 0.0)
    assert write.reason is ScaleReason.COLD_START
    assert scaler.hold_model("y", "m2", None, 0.0) == []
    perform(scaler, write, {KEY: 0}, 0.0)
    [r] = of(scaler.model_ready("m2", 3.0), HoldResolved)
    assert (r.request_id, r.available, r.key) == ("y", True, KEY)
    assert scaler.held_count(KEY) == 1


def test_hold_cap_answers_503_with_retry_after_beyond_it():
    scaler = scaler_with(config=ScalerConfig(held_cap=3, retry_after=7))
    for i in range(3):
        scaler.hold_model(i, "llama-3", None, 0.0)
    [r] = scaler.hold_model(3, "llama-3", None, 0.0)
    assert (r.found, r.error.http_status, r.error.headers()) == (True, 503, {"Retry-After": "7"})
    scaler.release(0, 1.0)
    assert scaler.hold_model(4, "llama-3", None, 1.0) == []


def test_hold_expires_at_its_own_deadline_with_503_and_retry_after():
    scaler = scaler_with(config=ScalerConfig(retry_after=5))
    scaler.hold_model("a", "llama-3", 30.0, 0.0)
    scaler.hold_model("b", "llama-3", 60.0, 0.0)
    assert scaler.next_deadline() == 30.0
    assert scaler.handle_timeout(29.9) == []
    [r] = scaler.handle_timeout(30.0)
    assert (r.request_id, r.available, r.error.http_status, r.waited) == ("a", False, 503, 30.0)
    assert r.error.headers() == {"Retry-After": "5"}
    assert r.error.openai_body()["error"]["type"] == "server_error"
    assert scaler.next_deadline() == 60.0


def test_released_hold_is_forgotten_and_its_deadline_dropped():
    scaler = scaler_with()
    [write] = scaler.hold_model("a", "llama-3", 30.0, 0.0)
    perform(scaler, write, {KEY: 0}, 0.0)
    scaler.release("a", 1.0)
    assert scaler.held_count(KEY) == 0
    assert scaler.next_deadline() is None
    assert scaler.phase(KEY) is ColdStartPhase.IDLE
    assert scaler.handle_timeout(100.0) == []
    assert scaler.release("a", 2.0) == []


def test_startup_timeout_fails_every_held_request_and_posts_an_event():
    scaler = scaler_with(**{STARTUP_TIMEOUT_LABEL: "2m"})
    [write] = scaler.hold_model("a", "llama-3", None, 0.0)
    scaler.hold_model("b", "llama-3", 1000.0, 10.0)
    perform(scaler, write, {KEY: 0}, 0.5)
    assert scaler.next_deadline() == 120.0
    assert scaler.handle_timeout(119.0) == []
    effects = scaler.handle_timeout(120.0)
    resolved = of(effects, HoldResolved)
    assert {r.request_id for r in resolved} == {"a", "b"}
    assert all(r.error.http_status == 503 and "within 120s" in r.error.message for r in resolved)
    assert [e.reason for e in of(effects, PostEvent)] == ["StartupTimeout"]
    assert scaler.phase(KEY) is ColdStartPhase.IDLE


def test_failed_cold_start_write_is_retried_while_requests_wait():
    scaler = scaler_with(config=ScalerConfig(write_retry_delay=2.0))
    [write] = scaler.hold_model("a", "llama-3", None, 0.0)
    effects = scaler.write_failed(write, "500 Internal Server Error", 0.1)
    assert of(effects, PostEvent)[0].type == "Warning"
    assert scaler.hold_model("b", "llama-3", None, 0.5) == []  # joins; no second write yet
    assert scaler.next_deadline() == pytest.approx(2.1)
    [again] = scaler.handle_timeout(2.1)
    assert again.reason is ScaleReason.COLD_START
    perform(scaler, again, {KEY: 0}, 2.2)
    with pytest.raises(ScalingLocalError):  # nothing is out any more
        scaler.write_done(again, 1, 3.0)


def test_cold_start_is_asked_again_if_the_deployment_is_seen_back_at_zero():
    scaler = scaler_with()
    cluster = {KEY: 0}
    [write] = scaler.hold_model("a", "llama-3", None, 0.0)
    perform(scaler, write, cluster, 0.0)
    cluster[KEY] = 0  # another gateway's leader took it to zero meanwhile
    [again] = scaler.observe_deployment(snap(replicas=0, generation=3), 1.0)
    assert again.reason is ScaleReason.COLD_START
    assert perform(scaler, again, cluster, 1.0) and cluster[KEY] == 1


def test_deleted_deployment_fails_its_held_requests_with_404():
    scaler = scaler_with()
    scaler.hold_model("a", "llama-3", None, 0.0)
    [r] = scaler.forget_deployment(KEY, 1.0)
    assert (r.request_id, r.error.http_status) == ("a", 404)
    assert scaler.deployments() == []


def test_deployment_opting_out_is_forgotten():
    scaler = scaler_with()
    s = snap()
    scaler.observe_deployment(s.__class__(**{**s.__dict__, "opted_in": False}), 1.0)
    assert scaler.deployments() == []


def test_invalid_labels_post_one_warning_event_until_they_change():
    scaler = Scaler()
    effects = scaler.observe_deployment(snap(**{MIN_SCALE_LABEL: "lots"}), 0.0)
    [event] = of(effects, PostEvent)
    assert (event.reason, event.type) == ("InvalidScalingLabel", "Warning")
    assert MIN_SCALE_LABEL in event.message
    assert scaler.observe_deployment(snap(**{MIN_SCALE_LABEL: "lots"}), 1.0) == []


# -- crash loops ---------------------------------------------------------------

def test_crash_loop_fails_held_requests_at_once_with_the_reason():
    scaler = scaler_with(config=ScalerConfig(crash_backoff=10))
    [write] = scaler.hold_model("a", "llama-3", None, 0.0)
    perform(scaler, write, {KEY: 0}, 0.0)
    effects = scaler.observe_pods(KEY, "container engine in CrashLoopBackOff", 20.0)
    [r] = of(effects, HoldResolved)
    assert (r.available, r.error.http_status, r.error.retry_after) == (False, 503, 10)
    assert "CrashLoopBackOff" in r.error.message
    [fail] = of(effects, FailHeld)
    assert fail.model == "llama-3" and fail.error == r.error
    assert [e.reason for e in of(effects, PostEvent)] == ["CrashLoop"]


def test_requests_for_a_crash_looping_deployment_fail_fast_and_blocked_is_posted_once():
    scaler = scaler_with()
    scaler.observe_pods(KEY, "container engine in ImagePullBackOff", 0.0)
    first = scaler.hold_model("a", "llama-3", None, 1.0)
    second = scaler.hold_model("b", "llama-3", None, 2.0)
    assert of(first, HoldResolved)[0].error.http_status == 503
    assert [e.reason for e in of(first, PostEvent)] == ["ScaleUpBlocked"]
    assert of(second, PostEvent) == [] and of(second, ScaleWrite) == []


def test_crash_block_backs_off_exponentially_and_min_is_never_rewritten():
    scaler = scaler_with(config=ScalerConfig(crash_backoff=10, crash_backoff_max=25),
                         **{MIN_SCALE_LABEL: "2"})
    blocks = []
    now = 0.0
    for _ in range(4):
        scaler.observe_pods(KEY, "container engine in CrashLoopBackOff", now)
        scaler.observe_pods(KEY, None, now + 1)  # pods gone (e.g. scaled away)
        [r] = of(scaler.hold_model(("probe", now), "llama-3", None, now + 1), HoldResolved)
        blocks.append(r.error.retry_after)
        now += 100
    assert blocks == [9, 19, 24, 24]
    assert scaler.snapshot(KEY).settings.min_replicas == 2
    # Once the backoff is over, a request may cold start again.
    assert of(scaler.hold_model("late", "llama-3", None, now), ScaleWrite)


def test_crash_evidence_flickering_inside_a_backoff_is_one_episode():
    scaler = scaler_with(config=ScalerConfig(crash_backoff=10))
    assert of(scaler.observe_pods(KEY, "container e in CrashLoopBackOff", 0.0), PostEvent)
    scaler.observe_pods(KEY, None, 1.0)
    assert scaler.observe_pods(KEY, "container e in CrashLoopBackOff", 2.0) == []
    scaler.observe_pods(KEY, None, 3.0)
    [r] = of(scaler.hold_model("a", "llama-3", None, 4.0), HoldResolved)
    assert r.error.retry_after == 6.0


def test_progress_deadline_exceeded_blocks_like_a_crash_loop():
    scaler = scaler_with()
    scaler.hold_model("a", "llama-3", None, 0.0)
    effects = scaler.observe_deployment(snap(replicas=1, progress_failure=True), 5.0)
    [r] = of(effects, HoldResolved)
    assert "timed out progressing" in r.error.message


def test_new_generation_of_the_pod_template_lifts_the_block():
    scaler = scaler_with(generation=1)
    scaler.observe_pods(KEY, "container e in ErrImagePull", 0.0)
    assert of(scaler.hold_model("a", "llama-3", None, 1.0), HoldResolved)
    scaler.observe_deployment(snap(generation=2, image="engine:2"), 2.0)
    assert of(scaler.hold_model("b", "llama-3", None, 3.0), ScaleWrite)


def test_a_generation_that_only_changed_replicas_does_not_lift_the_block():
    scaler = scaler_with(generation=1)
    scaler.observe_pods(KEY, "container e in ErrImagePull", 0.0)
    scaler.observe_deployment(snap(generation=2, replicas=0), 2.0)  # e.g. scaled to zero
    [r] = of(scaler.hold_model("b", "llama-3", None, 3.0), HoldResolved)
    assert r.error.http_status == 503


def test_a_stale_event_with_an_older_generation_does_not_lift_the_block():
    scaler = scaler_with(generation=5)
    scaler.observe_pods(KEY, "container e in ErrImagePull", 0.0)
    scaler.observe_deployment(snap(generation=4, image="engine:0"), 1.0)
    assert of(scaler.hold_model("b", "llama-3", None, 3.0), HoldResolved)


def test_hold_prefers_a_deployment_that_is_not_blocked():
    scaler = scaler_with()
    scaler.observe_deployment(snap(name="llama-b"), 0.0)
    scaler.observe_pods(KEY, "container e in ErrImagePull", 0.0)
    [write] = scaler.hold_model("a", "llama-3", None, 1.0)
    assert write.key == DeploymentKey("ml", "llama-b")


# -- autoscaler -------------------------------------------------------------------

def run_ticks(scaler, start, end, cluster=None, step=1.0):
    """Tick from start to end (exclusive), performing writes; returns the writes."""
    writes = []
    t = start
    while t < end:
        for write in of(scaler.tick(t), ScaleWrite):
            writes.append((t, write))
            if cluster is not None:
                perform(scaler, write, cluster, t)
        t += step
    return writes


def test_capacity_scales_to_ceil_of_load_over_target_within_bounds():
    scaler = scaler_with(replicas=1, **{TARGET_LOAD_LABEL: "10", SCALING_FACTOR_LABEL: "100",
                                        MAX_SCALE_LABEL: "4"})
    for _ in range(25):
        scaler.request_started("llama-3", 0.0)
    [(t, write)] = run_ticks(scaler, 0.0, 1.0)
    # 25 in flight sustained is a panic (>= 2x one replica), which may go straight up.
    assert (write.from_replicas, write.replicas, write.reason) == (1, 3, ScaleReason.SCALE_UP)
    scaler.write_done(write, 3, 0.0)
    for _ in range(100):
        scaler.request_started("llama-3", 1.0)
    [(_, write)] = run_ticks(scaler, 1.0, 2.0)
    assert write.replicas == 4  # clamped to max
    assert scaler.desired(KEY) == 4


def test_factor_bounds_each_step_as_a_percentage_of_max():
    scaler = scaler_with(replicas=1, **{TARGET_LOAD_LABEL: "1", SCALING_FACTOR_LABEL: "20",
                                        MAX_SCALE_LABEL: "10"})
    for _ in range(50):
        scaler.request_started("llama-3", 0.0)
    cluster = {KEY: 1}
    writes = run_ticks(scaler, 0.0, 5.0, cluster)
    assert [w.replicas for _, w in writes] == [3, 5, 7, 9, 10]


def test_rps_uses_started_requests_per_second_over_the_stable_window():
    scaler = scaler_with(replicas=1, **{SCALE_TYPE_LABEL: "rps", TARGET_LOAD_LABEL: "1",
                                        SCALING_FACTOR_LABEL: "100", MAX_SCALE_LABEL: "10"})
    cluster = {KEY: 1}
    writes = []
    for second in range(120):
        for i in range(3):  # 3 requests per second, each done at once
            scaler.request_started("llama-3", second + i / 3)
            scaler.request_finished("llama-3", second + i / 3)
        writes += run_ticks(scaler, second + 0.999, second + 1.0, cluster)
    assert cluster[KEY] == 3
    assert all(w.reason is ScaleReason.SCALE_UP for _, w in writes)


def test_panic_scales_up_fast_and_forbids_scale_down_while_it_lasts():
    cfg = ScalerConfig(panic_window=6, stable_window=60, scale_down_window=3)
    scaler = scaler_with(replicas=1, config=cfg, **{TARGET_LOAD_LABEL: "10", SCALING_FACTOR_LABEL: "100",
                                                    MAX_SCALE_LABEL: "10"})
    cluster = {KEY: 1}
    run_ticks(scaler, 0.0, 30.0, cluster)  # idle history keeps the stable average low
    for _ in range(40):
        scaler.request_started("llama-3", 30.0)
    up = run_ticks(scaler, 30.0, 36.0, cluster)
    # The 6 s average reaches 40 in flight; the 60 s one is still under 10, so
    # without panic this would stay at one replica.
    assert [(t, w.replicas) for t, w in up] == [(31.0, 2), (33.0, 3), (34.0, 4)]
    for _ in range(40):
        scaler.request_finished("llama-3", 36.0)
    # Load is gone at 36, but panic (entered at 31, when 2 replicas were needed
    # for 1) forbids scale-down until 37, then the 3 s scale-down window runs.
    assert run_ticks(scaler, 36.0, 40.0, cluster) == []
    later = run_ticks(scaler, 40.0, 60.0, cluster)
    assert later[0][0] == 40.0
    assert all(w.reason is ScaleReason.SCALE_DOWN for _, w in later)
    assert cluster[KEY] == 1


def test_scale_down_waits_for_the_stabilisation_window_then_halves_at_most():
    cfg = ScalerConfig(scale_down_window=10, stable_window=2, panic_window=1)
    scaler = scaler_with(replicas=8, config=cfg, **{TARGET_LOAD_LABEL: "1", SCALING_FACTOR_LABEL: "100",
                                                    MAX_SCALE_LABEL: "8", MIN_SCALE_LABEL: "1"})
    for _ in range(8):
        scaler.request_started("llama-3", 0.0)
    cluster = {KEY: 8}
    assert run_ticks(scaler, 0.0, 3.0, cluster) == []
    for _ in range(8):
        scaler.request_finished("llama-3", 3.0)
    writes = run_ticks(scaler, 3.0, 30.0, cluster)
    assert [(t, w.replicas) for t, w in writes] == [(13.0, 4), (14.0, 2), (15.0, 1)]


def test_a_brief_dip_does_not_scale_down():
    cfg = ScalerConfig(scale_down_window=10, stable_window=1, panic_window=1)
    scaler = scaler_with(replicas=4, config=cfg, **{TARGET_LOAD_LABEL: "1", MAX_SCALE_LABEL: "4",
                                                    SCALING_FACTOR_LABEL: "100"})
    cluster = {KEY: 4}
    for t in range(30):
        busy = 4 if t % 8 else 0  # one idle second in eight
        for _ in range(busy):
            scaler.request_started("llama-3", float(t))
        assert run_ticks(scaler, float(t), t + 1.0, cluster) == []
        for _ in range(busy):
            scaler.request_finished("llama-3", t + 0.5)


def test_autoscaler_never_goes_below_max_of_one_and_min():
    scaler = scaler_with(replicas=3, config=ScalerConfig(scale_down_window=1),
                         **{MIN_SCALE_LABEL: "2", SCALING_FACTOR_LABEL: "100"})
    cluster = {KEY: 3}
    run_ticks(scaler, 0.0, 500.0, cluster)
    assert cluster[KEY] == 2


def test_blocked_deployment_is_not_scaled_up_by_the_autoscaler():
    scaler = scaler_with(replicas=1, **{TARGET_LOAD_LABEL: "1", SCALING_FACTOR_LABEL: "100"})
    scaler.observe_pods(KEY, "container e in CrashLoopBackOff", 0.0)
    for _ in range(10):
        scaler.request_started("llama-3", 0.0)
    assert run_ticks(scaler, 0.0, 5.0) == []


def test_autoscaler_write_is_dropped_if_someone_else_moved_first():
    scaler = scaler_with(replicas=1, **{TARGET_LOAD_LABEL: "1", SCALING_FACTOR_LABEL: "100"})
    for _ in range(3):
        scaler.request_started("llama-3", 0.0)
    [write] = of(scaler.tick(0.0), ScaleWrite)
    assert scaler.resolve_write(write, 1, 0.0) == write.replicas
    assert scaler.resolve_write(write, 2, 0.0) is None


# -- scale to zero --------------------------------------------------------------------

def zero_scaler(duration="3m", replicas=1):
    return scaler_with(replicas=replicas, **{MIN_SCALE_LABEL: "0", ZERO_DURATION_LABEL: duration})


def test_goes_to_zero_zero_duration_after_the_last_completion_and_not_before():
    scaler = zero_scaler("3m")
    cluster = {KEY: 1}
    scaler.request_started("llama-3", 10.0)
    scaler.request_finished("llama-3", 50.0)
    writes = run_ticks(scaler, 0.0, 400.0, cluster, step=0.5)
    assert [(t, w.replicas, w.reason) for t, w in writes] == [(230.0, 0, ScaleReason.SCALE_TO_ZERO)]
    assert cluster[KEY] == 0


def test_a_request_in_flight_keeps_it_up_however_long():
    scaler = zero_scaler("10s")
    scaler.request_started("llama-3", 0.0)
    assert run_ticks(scaler, 0.0, 100.0) == []


def test_engine_reported_work_from_other_gateways_keeps_it_up():
    scaler = zero_scaler("10s")
    cluster = {KEY: 1}
    scaler.observe_in_progress("llama-3", 2, 0.0)
    assert run_ticks(scaler, 0.0, 50.0, cluster) == []
    scaler.observe_in_progress("llama-3", 0, 50.0)
    [(t, _)] = run_ticks(scaler, 50.0, 100.0, cluster)
    assert t == 60.0


def test_the_scalers_own_writes_do_not_reset_the_idle_clock():
    scaler = scaler_with(replicas=1, config=ScalerConfig(scale_down_window=1),
                         **{MIN_SCALE_LABEL: "0", ZERO_DURATION_LABEL: "20", TARGET_LOAD_LABEL: "1",
                            SCALING_FACTOR_LABEL: "100"})
    cluster = {KEY: 1}
    for _ in range(3):
        scaler.request_started("llama-3", 0.0)
    writes = run_ticks(scaler, 0.0, 2.0, cluster)
    for _ in range(3):
        scaler.request_finished("llama-3", 2.0)
    writes += run_ticks(scaler, 2.0, 40.0, cluster)
    assert writes[0][1].reason is ScaleReason.SCALE_UP
    assert any(w.reason is ScaleReason.SCALE_DOWN for _, w in writes)
    assert writes[-1] == (22.0, ScaleWrite(KEY, writes[-1][1].from_replicas, 0, ScaleReason.SCALE_TO_ZERO))


def test_min_one_never_goes_to_zero():
    scaler = scaler_with(replicas=1)
    assert run_ticks(scaler, 0.0, 1000.0, step=10.0) == []


def test_fresh_gateway_counts_idle_time_from_when_it_first_saw_the_deployment():
    scaler = Scaler()
    scaler.observe_deployment(snap(replicas=1, **{MIN_SCALE_LABEL: "0", ZERO_DURATION_LABEL: "30"}), 100.0)
    [(t, _)] = run_ticks(scaler, 100.0, 200.0, {KEY: 1})
    assert t == 130.0


def test_a_request_arriving_while_going_to_zero_cancels_it():
    scaler = zero_scaler("10s")
    [write] = of(scaler.tick(10.0), ScaleWrite)
    scaler.request_started("llama-3", 10.1)
    assert scaler.resolve_write(write, 1, 10.2) is None
    scaler.request_finished("llama-3", 10.3)
    assert scaler.resolve_write(write, 1, 10.4) is None  # idle clock restarted at 10.3
    assert scaler.resolve_write(write, 1, 20.3) == 0


def test_going_to_zero_forgets_ready_models_so_the_next_request_cold_starts():
    scaler = zero_scaler("10s")
    cluster = {KEY: 1}
    scaler.model_ready("llama-3", 0.0)
    run_ticks(scaler, 0.0, 11.0, cluster)
    assert cluster[KEY] == 0
    assert of(scaler.hold_model("a", "llama-3", None, 20.0), ScaleWrite)


# -- properties ---------------------------------------------------------------------------

ops = st.lists(st.tuples(
    st.sampled_from(["hold", "release", "time", "ready", "gone", "crash", "heal", "write"]),
    st.integers(0, 20)), max_size=60)


@settings(max_examples=150, deadline=None)
@given(ops)
def test_single_flight_and_every_hold_ends_once(sequence):
    """Whatever happens, at most one cold-start write is out, and each hold resolves at most once."""
    scaler = scaler_with(config=ScalerConfig(held_cap=10), **{STARTUP_TIMEOUT_LABEL: "30"})
    cluster = {KEY: 0}
    now = 0.0
    out = []
    resolved = []
    held = set()
    next_id = 0

    def absorb(effects):
        for e in effects:
            if isinstance(e, ScaleWrite):
                assert e.reason is ScaleReason.COLD_START
                out.append(e)
                assert len(out) == 1
            elif isinstance(e, HoldResolved):
                resolved.append(e.request_id)
                assert e.error is None or isinstance(e.error, ScaleError)

    for op, arg in sequence:
        if op == "hold":
            next_id += 1
            held.add(next_id)
            absorb(scaler.hold_model(next_id, "llama-3", now + arg, now))
        elif op == "release" and held:
            absorb(scaler.release(sorted(held)[arg % len(held)], now))
        elif op == "time":
            now += arg
            deadline = scaler.next_deadline()
            if deadline is not None:
                assert deadline >= 0
            absorb(scaler.handle_timeout(now))
        elif op == "ready":
            absorb(scaler.model_ready("llama-3", now))
        elif op == "gone":
            scaler.model_gone("llama-3", now)
            cluster[KEY] = 0
        elif op == "crash":
            absorb(scaler.observe_pods(KEY, "container e in CrashLoopBackOff", now))
        elif op == "heal":
            absorb(scaler.observe_pods(KEY, None, now))
        elif op == "write" and out:
            write = out.pop()
            absorb(perform(scaler, write, cluster, now))
        assert scaler.held_count(KEY) <= 10
    assert len(resolved) == len(set(resolved))
    if not out:
        assert scaler.phase(KEY) is not ColdStartPhase.WRITING
    deadline = scaler.next_deadline()
    assert deadline is None or not math.isnan(deadline)


def test_next_tick_skips_a_deployment_whose_autoscaler_write_is_still_out():
    scaler = scaler_with(replicas=1, **{TARGET_LOAD_LABEL: "1", SCALING_FACTOR_LABEL: "100"})
    for _ in range(3):
        scaler.request_started("llama-3", 0.0)
    [write] = of(scaler.tick(0.0), ScaleWrite)
    assert of(scaler.tick(1.0), ScaleWrite) == []
    [event] = scaler.write_failed(write, "503 from the API server", 1.5)
    assert event.type == "Warning"
    assert of(scaler.tick(2.0), ScaleWrite)  # free to decide again


def test_request_racing_a_landing_scale_to_zero_still_gets_its_cold_start():
    scaler = zero_scaler("10s")
    cluster = {KEY: 1}
    [to_zero] = of(scaler.tick(10.0), ScaleWrite)
    assert scaler.resolve_write(to_zero, 1, 10.0) == 0  # the replace is on the wire...
    # ...when a request arrives: with 1 replica up it only waits for the engine.
    assert scaler.hold_model("a", "llama-3", None, 10.1) == []
    cluster[KEY] = 0
    effects = scaler.write_done(to_zero, 0, 10.3)        # then the scale to zero lands
    [again] = of(effects, ScaleWrite)
    assert again.reason is ScaleReason.COLD_START
    perform(scaler, again, cluster, 10.4)
    assert cluster[KEY] == 1


def test_available_replicas_do_not_end_a_model_hold_only_an_engine_ready_does():
    scaler = scaler_with()
    [write] = scaler.hold_model("m", "llama-3", None, 0.0)
    perform(scaler, write, {KEY: 0}, 0.0)
    available = deployment_snapshot({
        "metadata": {"name": "llama", "namespace": "ml", "generation": 2,
                     "labels": {SCALABLE_LABEL: "true"}, "annotations": {MODELS_ANNOTATION: "llama-3"}},
        "spec": {"replicas": 1}, "status": {"availableReplicas": 1}})
    assert of(scaler.observe_deployment(available, 5.0), HoldResolved) == []
    assert scaler.held_count(KEY) == 1  # the request waits for its engine, not for the pod
    [r] = of(scaler.model_ready("llama-3", 6.0), HoldResolved)
    assert (r.request_id, r.available) == ("m", True)


@settings(max_examples=80, deadline=None)
@given(
    st.integers(0, 4), st.integers(1, 12), st.integers(1, 100), st.sampled_from(["rps", "capacity"]),
    st.lists(st.integers(0, 60), min_size=1, max_size=40),
)
def test_autoscaler_steps_stay_within_bounds(min_r, max_r, factor, kind, loads):
    """Every write stays in [max(1, min), max], moves at most one factor step, and at most halves."""
    max_r = max(max_r, min_r)
    scaler = scaler_with(replicas=max(1, min_r), config=ScalerConfig(scale_down_window=2, stable_window=4,
                                                                     panic_window=2),
                         **{MIN_SCALE_LABEL: str(min_r), MAX_SCALE_LABEL: str(max_r),
                            SCALING_FACTOR_LABEL: str(factor), TARGET_LOAD_LABEL: "3",
                            SCALE_TYPE_LABEL: kind, ZERO_DURATION_LABEL: "1000"})
    step = max(1, math.ceil(max_r * factor / 100))
    cluster = {KEY: max(1, min_r)}
    in_flight = 0
    for t, load in enumerate(loads):
        while in_flight < load:
            scaler.request_started("llama-3", float(t))
            in_flight += 1
        while in_flight > load:
            scaler.request_finished("llama-3", float(t))
            in_flight -= 1
        for write in of(scaler.tick(float(t)), ScaleWrite):
            old = cluster[KEY]
            assert write.from_replicas == old
            assert max(1, min_r) <= write.replicas <= max_r
            assert abs(write.replicas - old) <= step
            assert write.replicas >= math.ceil(old / 2)
            perform(scaler, write, cluster, float(t))


def test_hold_prefers_a_scalable_deployment_over_one_with_max_zero():
    scaler = Scaler()
    scaler.observe_deployment(snap(name="a-pinned", **{MAX_SCALE_LABEL: "0"}), 0.0)
    scaler.observe_deployment(snap(name="b-scalable"), 0.0)
    [write] = scaler.hold_model("r", "llama-3", None, 1.0)
    assert write.key == DeploymentKey("ml", "b-scalable")
    assert scaler.serves("llama-3") and not scaler.serves("other")


# -- requests started at other gateways ------------------------------------------------------
# Only the leader autoscales, and behind a load balancer it accepts 1/N of the
# requests; every peer reports its cumulative count per model (each report
# every 10 s while the counts change, as a gateway's receiver does).

def test_a_first_report_sets_the_baseline_and_each_next_one_adds_its_increase_over_the_gap():
    scaler = Scaler()
    scaler.observe_peer_requests("gw-b", {"llama-3": 100}, 0.0)
    assert scaler.started_rates("llama-3", 0.0) == (0.0, 0.0)  # history before we listened
    scaler.observe_peer_requests("gw-b", {"llama-3": 160}, 10.0)
    # 60 started over seconds 1..10: 60 in the 60 s window, 36 in the 6 s one.
    assert scaler.started_rates("llama-3", 10.0) == pytest.approx((1.0, 6.0))
    scaler.request_started("llama-3", 10.5)  # the leader's own requests add up with them
    assert scaler.started_rates("llama-3", 10.5) == pytest.approx((61 / 60, 37 / 6))


def test_each_peer_has_its_own_baseline_and_a_model_new_in_a_report_counts_from_zero():
    scaler = Scaler()
    scaler.observe_peer_requests("gw-b", {"llama-3": 5}, 0.0)
    scaler.observe_peer_requests("gw-c", {"llama-3": 500}, 0.0)
    scaler.observe_peer_requests("gw-b", {"llama-3": 5, "mistral": 6}, 6.0)
    scaler.observe_peer_requests("gw-c", {"llama-3": 506}, 6.0)
    assert scaler.started_rates("llama-3", 6.0) == pytest.approx((0.1, 1.0))
    assert scaler.started_rates("mistral", 6.0) == pytest.approx((0.1, 1.0))


def test_a_counter_that_went_down_or_vanished_is_a_restart_and_only_a_new_baseline():
    scaler = Scaler()
    scaler.observe_peer_requests("gw-b", {"llama-3": 100, "mistral": 7}, 0.0)
    scaler.observe_peer_requests("gw-b", {"llama-3": 160, "mistral": 7}, 10.0)
    scaler.observe_peer_requests("gw-b", {"llama-3": 5, "mistral": 9}, 20.0)  # restarted
    assert scaler.started_rates("llama-3", 20.0) == pytest.approx((1.0, 0.0))
    assert scaler.started_rates("mistral", 20.0) == (0.0, 0.0)
    scaler.observe_peer_requests("gw-b", {"llama-3": 11}, 30.0)  # mistral vanished: restarted again
    assert scaler.started_rates("llama-3", 30.0) == pytest.approx((1.0, 0.0))
    scaler.observe_peer_requests("gw-b", {"llama-3": 17, "mistral": -4}, 40.0)  # nonsense is zero
    assert scaler.started_rates("llama-3", 40.0) == pytest.approx((66 / 60, 0.6))
    assert scaler.started_rates("mistral", 40.0) == (0.0, 0.0)


def test_a_forgotten_peer_starts_again_from_a_baseline():
    scaler = Scaler()
    scaler.observe_peer_requests("gw-b", {"llama-3": 100}, 0.0)
    scaler.forget_peer("gw-b")
    scaler.forget_peer("gw-b")  # its stream ended twice over: harmless
    scaler.observe_peer_requests("gw-b", {"llama-3": 130}, 5.0)
    assert scaler.started_rates("llama-3", 5.0) == (0.0, 0.0)


def test_after_an_idle_spell_an_increase_is_spread_over_one_report_interval_not_the_spell():
    scaler = Scaler(ScalerConfig(peer_report_interval=10))
    scaler.observe_peer_requests("gw-b", {"llama-3": 0}, 0.0)
    scaler.observe_peer_requests("gw-b", {"llama-3": 100}, 100.0)
    # A burst after 100 s of silence lands in seconds 91..100 and shows as a burst.
    assert scaler.started_rates("llama-3", 100.0) == pytest.approx((100 / 60, 10.0))
    # Reports on the same second put the increase on that second.
    scaler.observe_peer_requests("gw-b", {"llama-3": 103}, 100.5)
    assert scaler.started_rates("llama-3", 100.5) == pytest.approx((103 / 60, 63 / 6))
    # What falls out of the stable window is forgotten as usual.
    assert scaler.started_rates("llama-3", 200.0) == (0.0, 0.0)


def three_gateways(scaler, seconds, local_rps, peer_rps, peers=("gw-b", "gw-c"), cluster=None):
    """Tick every second while the leader accepts ``local_rps`` and each peer ``peer_rps``,
    the peers reporting their totals every 10 s; returns the writes."""
    writes = []
    for second in range(seconds):
        for i in range(local_rps):
            scaler.request_started("llama-3", second + i / local_rps)
            scaler.request_finished("llama-3", second + i / local_rps)
        if second % 10 == 0:
            for peer in peers:
                scaler.observe_peer_requests(peer, {"llama-3": round(peer_rps * second)}, float(second))
        writes += run_ticks(scaler, float(second), second + 1.0, cluster)
    return writes


@pytest.mark.parametrize("peers, replicas", [(("gw-b", "gw-c"), 3), ((), 1)])
def test_rps_scales_to_the_load_of_every_gateway_not_the_leaders_share(peers, replicas):
    """3 gateways x 10 rps with a target of 10: 3 replicas; counting the leader's share alone, 1."""
    scaler = scaler_with(replicas=1, **{SCALE_TYPE_LABEL: "rps", TARGET_LOAD_LABEL: "10",
                                        SCALING_FACTOR_LABEL: "100", MAX_SCALE_LABEL: "10"})
    cluster = {KEY: 1}
    writes = three_gateways(scaler, 180, 10, 10, peers, cluster)
    assert cluster[KEY] == replicas
    assert all(w.reason is ScaleReason.SCALE_UP for _, w in writes)


def test_peer_reports_every_10_s_do_not_make_a_steady_load_look_like_a_panic():
    """7 rps for a target of 10 needs 1 replica. Were each 10 s report counted on its own second,
    the 6 s panic window would see 2 + 2 x 25 / 6 = 10.3 rps at every report and panic to 2."""
    scaler = scaler_with(replicas=1, **{SCALE_TYPE_LABEL: "rps", TARGET_LOAD_LABEL: "10",
                                        SCALING_FACTOR_LABEL: "100", MAX_SCALE_LABEL: "10"})
    assert three_gateways(scaler, 180, 2, 2.5) == []


def test_a_burst_at_a_peer_shows_in_the_panic_window():
    scaler = scaler_with(replicas=1, **{SCALE_TYPE_LABEL: "rps", TARGET_LOAD_LABEL: "10",
                                        SCALING_FACTOR_LABEL: "100", MAX_SCALE_LABEL: "10"})
    cluster = {KEY: 1}
    scaler.observe_peer_requests("gw-b", {"llama-3": 0}, 0.0)
    assert run_ticks(scaler, 0.0, 35.0, cluster) == []
    scaler.observe_peer_requests("gw-b", {"llama-3": 300}, 35.0)  # 30 rps for its last 10 s
    [(t, write)] = run_ticks(scaler, 35.0, 36.0, cluster)
    # The 60 s average (5 rps) wants 1 replica; the 6 s one (30 rps) wants 3.
    assert (t, write.replicas, write.reason) == (35.0, 3, ScaleReason.SCALE_UP)


def test_requests_started_at_peers_keep_a_deployment_from_going_to_zero():
    scaler = zero_scaler("10s")
    cluster = {KEY: 1}
    for t in range(0, 60, 5):
        scaler.observe_peer_requests("gw-b", {"llama-3": t}, float(t))
        assert run_ticks(scaler, float(t), t + 5.0, cluster) == []
    [(t, write)] = run_ticks(scaler, 60.0, 100.0, cluster)
    assert (t, write.reason) == (65.0, ScaleReason.SCALE_TO_ZERO)  # 10 s after the last increase


def test_ticks_are_deadlines_of_the_machine_and_run_only_while_it_leads():
    scaler = scaler_with(replicas=1, **{TARGET_LOAD_LABEL: "1", MAX_SCALE_LABEL: "5"})
    assert scaler.start(100.0) == []
    assert scaler.next_deadline() is None  # not leading: nothing to wake for
    for _ in range(3):
        scaler.request_started("llama-3", 100.0)
    scaler.lead(True, 100.5)
    assert scaler.next_deadline() == 101.0
    assert scaler.handle_timeout(100.9) == []
    [write] = of(scaler.handle_timeout(101.0), ScaleWrite)
    assert (write.reason, write.replicas) == (ScaleReason.SCALE_UP, 2)
    assert scaler.next_deadline() == 102.0
    scaler.write_failed(write, "down", 101.0)
    scaler.handle_timeout(105.5)  # late: one tick, and the missed ones are skipped
    assert scaler.next_deadline() == 106.0
    scaler.lead(False, 105.6)
    assert scaler.next_deadline() is None
    scaler.lead(True, 108.2)  # the schedule kept its beat
    assert scaler.next_deadline() == 109.0
    scaler.stop()
    assert scaler.next_deadline() is None


def selected_snap(replicas=0):
    return deployment_snapshot({
        "metadata": {"name": "llama", "namespace": "ml", "generation": 1,
                     "labels": {SCALABLE_LABEL: "true"}, "annotations": {MODELS_ANNOTATION: "llama-3"}},
        "spec": {"replicas": replicas, "selector": {"matchLabels": {"app": "llama"}}}})


def test_a_crashing_pod_blocks_the_deployments_selecting_it_in_its_namespace_only():
    scaler = Scaler(ScalerConfig(crash_backoff=10))
    scaler.observe_deployment(selected_snap(), 0.0)
    assert scaler.observe_pod("other", "p", {"app": "llama"}, "ImagePullBackOff", False, 0.0) == []
    assert scaler.observe_pod("ml", "q", {"app": "else"}, "ImagePullBackOff", False, 0.0) == []
    [event] = of(scaler.observe_pod("ml", "p", {"app": "llama"}, "ImagePullBackOff", False, 1.0), PostEvent)
    assert event.reason == "CrashLoop" and "ImagePullBackOff" in event.message
    [r] = of(scaler.hold_model("a", "llama-3", None, 2.0), HoldResolved)
    assert r.error.http_status == 503


def test_pods_seen_before_their_deployment_count_once_it_is_rechecked():
    scaler = Scaler(ScalerConfig())
    scaler.observe_pod("ml", "p", {"app": "llama"}, "CrashLoopBackOff", False, 0.0)
    scaler.observe_deployment(selected_snap(), 0.0)
    assert of(scaler.recheck_pods(KEY, 0.0), PostEvent)[0].reason == "CrashLoop"
    scaler.observe_pod("ml", "p", {"app": "llama"}, None, True, 1.0)  # the pod is deleted
    assert scaler.recheck_pods(KEY, 100.0) == []
    assert of(scaler.hold_model("a", "llama-3", None, 100.0), ScaleWrite)  # the block ran out
