"""Label and annotation parsing for the scaler: defaults, every invalid value, durations."""

import pytest
from hypothesis import given, settings, strategies as st

from protocol.scaling.scaler import (
    DEFAULT_MAX_REPLICAS,
    DEFAULT_MIN_REPLICAS,
    DEFAULT_SCALING_FACTOR,
    DEFAULT_STARTUP_TIMEOUT,
    DEFAULT_TARGET_LOAD,
    DEFAULT_ZERO_DURATION,
    FRAMEWORK_LABEL,
    MAX_SCALE_LABEL,
    MIN_SCALE_LABEL,
    MODELS_ANNOTATION,
    SCALABLE_LABEL,
    SCALE_TYPE_LABEL,
    SCALING_FACTOR_LABEL,
    STARTUP_TIMEOUT_LABEL,
    TARGET_LOAD_LABEL,
    ZERO_DURATION_LABEL,
    DeploymentKey,
    ScaleType,
    ScalingRemoteError,
    deployment_snapshot,
    parse_duration,
    parse_models,
    parse_scaling_labels,
    pod_crash_reason,
)


def deployment(labels=None, annotations=None, replicas=0, **extra):
    return {
        "metadata": {"name": "llama", "namespace": "ml", "generation": 3,
                     "labels": {SCALABLE_LABEL: "true", **(labels or {})},
                     "annotations": {MODELS_ANNOTATION: "llama-3", **(annotations or {})}},
        "spec": {"replicas": replicas, "selector": {"matchLabels": {"app": "llama"}}},
        "status": extra.get("status", {}),
    }


def test_label_names_and_defaults_match_openmodelz():
    assert (MIN_SCALE_LABEL, MAX_SCALE_LABEL, SCALING_FACTOR_LABEL, TARGET_LOAD_LABEL,
            ZERO_DURATION_LABEL, SCALE_TYPE_LABEL, FRAMEWORK_LABEL) == (
        "ai.tensorchord.scale.min", "ai.tensorchord.scale.max", "ai.tensorchord.scale.factor",
        "ai.tensorchord.scale.target", "ai.tensorchord.scale.zero-duration",
        "ai.tensorchord.scale.type", "ai.tensorchord.framework")
    assert (DEFAULT_MIN_REPLICAS, DEFAULT_MAX_REPLICAS, DEFAULT_ZERO_DURATION,
            DEFAULT_SCALING_FACTOR) == (1, 5, 180.0, 10)
    assert {t.value for t in ScaleType} == {"rps", "capacity"}


def test_no_labels_gives_defaults_without_warnings():
    parsed = parse_scaling_labels({})
    s = parsed.settings
    assert parsed.warnings == ()
    assert (s.min_replicas, s.max_replicas, s.scaling_factor, s.zero_duration,
            s.target_load, s.startup_timeout) == (
        1, 5, 10, 180.0, DEFAULT_TARGET_LOAD, DEFAULT_STARTUP_TIMEOUT)
    assert s.scalable


def test_valid_labels_are_all_read():
    parsed = parse_scaling_labels({
        MIN_SCALE_LABEL: "0", MAX_SCALE_LABEL: "8", SCALING_FACTOR_LABEL: "50",
        TARGET_LOAD_LABEL: "2.5", SCALE_TYPE_LABEL: "RPS", ZERO_DURATION_LABEL: "5m0s",
        STARTUP_TIMEOUT_LABEL: "90", FRAMEWORK_LABEL: "vllm"})
    s = parsed.settings
    assert parsed.warnings == ()
    assert (s.min_replicas, s.max_replicas, s.scaling_factor, s.target_load, s.scale_type,
            s.zero_duration, s.startup_timeout, s.framework) == (
        0, 8, 50, 2.5, ScaleType.RPS, 300.0, 90.0, "vllm")
    assert s.step == 4


@pytest.mark.parametrize("label,value,attr,default", [
    (MIN_SCALE_LABEL, "-1", "min_replicas", 1),
    (MIN_SCALE_LABEL, "one", "min_replicas", 1),
    (MIN_SCALE_LABEL, "1.5", "min_replicas", 1),
    (MAX_SCALE_LABEL, "", "max_replicas", 5),
    (MAX_SCALE_LABEL, "x", "max_replicas", 5),
    (SCALING_FACTOR_LABEL, "0", "scaling_factor", 10),
    (SCALING_FACTOR_LABEL, "101", "scaling_factor", 10),
    (SCALING_FACTOR_LABEL, "ten", "scaling_factor", 10),
    (TARGET_LOAD_LABEL, "0", "target_load", DEFAULT_TARGET_LOAD),
    (TARGET_LOAD_LABEL, "-3", "target_load", DEFAULT_TARGET_LOAD),
    (TARGET_LOAD_LABEL, "nan", "target_load", DEFAULT_TARGET_LOAD),
    (TARGET_LOAD_LABEL, "inf", "target_load", DEFAULT_TARGET_LOAD),
    (SCALE_TYPE_LABEL, "latency", "scale_type", ScaleType.CAPACITY),
    (ZERO_DURATION_LABEL, "3 minutes", "zero_duration", 180.0),
    (ZERO_DURATION_LABEL, "0", "zero_duration", 180.0),
    (ZERO_DURATION_LABEL, "-5m", "zero_duration", 180.0),
    (STARTUP_TIMEOUT_LABEL, "soon", "startup_timeout", 600.0),
])
def test_invalid_value_falls_back_to_default_with_a_warning(label, value, attr, default):
    parsed = parse_scaling_labels({label: value})
    assert getattr(parsed.settings, attr) == default
    assert [w.label for w in parsed.warnings] == [label]
    assert parsed.warnings[0].value == value
    assert label in parsed.warnings[0].message


@pytest.mark.parametrize("factor", ["1", "100", "+7"])
def test_factor_bounds_are_inclusive(factor):
    parsed = parse_scaling_labels({SCALING_FACTOR_LABEL: factor})
    assert parsed.warnings == ()
    assert parsed.settings.scaling_factor == int(factor)


def test_max_below_min_becomes_min_with_a_warning():
    parsed = parse_scaling_labels({MIN_SCALE_LABEL: "4", MAX_SCALE_LABEL: "2"})
    assert parsed.settings.max_replicas == 4
    assert [w.label for w in parsed.warnings] == [MAX_SCALE_LABEL]


def test_default_max_below_a_large_min_is_raised_too():
    parsed = parse_scaling_labels({MIN_SCALE_LABEL: "7"})
    assert (parsed.settings.min_replicas, parsed.settings.max_replicas) == (7, 7)
    assert len(parsed.warnings) == 1


def test_explicit_max_zero_means_not_scalable_even_with_a_min():
    parsed = parse_scaling_labels({MIN_SCALE_LABEL: "2", MAX_SCALE_LABEL: "0"})
    assert parsed.settings.max_replicas == 0
    assert not parsed.settings.scalable
    assert parsed.warnings == ()


def test_invalid_max_does_not_count_as_explicit_zero():
    parsed = parse_scaling_labels({MAX_SCALE_LABEL: "none"})
    assert parsed.settings.scalable


@pytest.mark.parametrize("text,seconds", [
    ("3m", 180.0), ("5m0s", 300.0), ("90", 90.0), ("1.5", 1.5), ("1h30m", 5400.0),
    ("250ms", 0.25), ("0.5m", 30.0), (" 45s ", 45.0), ("0", 0.0),
])
def test_parse_duration_accepts_go_forms_and_plain_seconds(text, seconds):
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["", "m", "3x", "3m 2s", "-1", "-3m", "1d", "s3", "nan", "inf", "3mm"])
def test_parse_duration_rejects_everything_else(text):
    assert parse_duration(text) is None


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 99), st.integers(0, 59), st.integers(0, 59))
def test_parse_duration_sums_hours_minutes_seconds(h, m, s):
    assert parse_duration(f"{h}h{m}m{s}s") == h * 3600 + m * 60 + s


@settings(max_examples=100, deadline=None)
@given(st.dictionaries(
    st.sampled_from([MIN_SCALE_LABEL, MAX_SCALE_LABEL, SCALING_FACTOR_LABEL, TARGET_LOAD_LABEL,
                     SCALE_TYPE_LABEL, ZERO_DURATION_LABEL, STARTUP_TIMEOUT_LABEL]),
    st.text(max_size=8)))
def test_any_label_values_give_consistent_settings(labels):
    """Whatever users write, parsing never raises and the invariants hold."""
    s = parse_scaling_labels(labels).settings
    assert s.max_replicas == 0 or s.max_replicas >= s.min_replicas >= 0
    assert 1 <= s.scaling_factor <= 100
    assert s.target_load > 0 and s.zero_duration > 0 and s.startup_timeout > 0


def test_models_annotation_is_split_trimmed_and_deduplicated():
    assert parse_models(" a, b ,,a,c ") == ("a", "b", "c")
    assert parse_models("") == ()
    assert parse_models(None) == ()


def test_deployment_snapshot_reads_labels_annotations_replicas_and_models():
    snap = deployment_snapshot(deployment(
        {MIN_SCALE_LABEL: "0", MAX_SCALE_LABEL: "3", FRAMEWORK_LABEL: "vllm"},
        {MODELS_ANNOTATION: "a,b", "note": "x"}, replicas=2, status={"availableReplicas": 1}))
    s = snap.settings
    assert (s.framework, snap.replicas, snap.available_replicas, s.min_replicas,
            s.max_replicas, snap.models) == ("vllm", 2, 1, 0, 3, ("a", "b"))
    assert snap.annotations["note"] == "x"
    assert s.zero_duration == 180.0 and s.scaling_factor == 10


def test_deployment_without_replicas_means_the_api_default_of_one():
    d = deployment()
    del d["spec"]["replicas"]
    assert deployment_snapshot(d).replicas == 1


def test_deployment_snapshot_reads_key_generation_selector_and_opt_in():
    snap = deployment_snapshot(deployment())
    assert snap.key == DeploymentKey("ml", "llama")
    assert (snap.generation, snap.opted_in, dict(snap.selector)) == (3, True, {"app": "llama"})
    d = deployment()
    d["metadata"]["labels"][SCALABLE_LABEL] = "false"
    assert not deployment_snapshot(d).opted_in


def test_opted_in_deployment_without_models_warns():
    d = deployment()
    del d["metadata"]["annotations"][MODELS_ANNOTATION]
    snap = deployment_snapshot(d)
    assert [w.label for w in snap.warnings] == [MODELS_ANNOTATION]


def test_progress_deadline_exceeded_is_read_from_conditions():
    snap = deployment_snapshot(deployment(status={"conditions": [
        {"type": "Available", "status": "False"},
        {"type": "Progressing", "status": "False", "reason": "ProgressDeadlineExceeded",
         "message": "ReplicaSet llama-1 has timed out progressing."}]}))
    assert snap.progress_failure == "ReplicaSet llama-1 has timed out progressing."
    assert deployment_snapshot(deployment()).progress_failure is None


def test_deployment_without_a_name_is_a_remote_error():
    with pytest.raises(ScalingRemoteError):
        deployment_snapshot({"metadata": {}})


@pytest.mark.parametrize("reason", ["CrashLoopBackOff", "ImagePullBackOff", "ErrImagePull"])
def test_pod_crash_reasons_are_detected_in_app_and_init_containers(reason):
    for kind in ("containerStatuses", "initContainerStatuses"):
        pod = {"status": {kind: [
            {"name": "ok", "state": {"running": {}}},
            {"name": "engine", "state": {"waiting": {"reason": reason, "message": "back-off"}}}]}}
        assert pod_crash_reason(pod) == f"container engine in {reason}: back-off"


def test_pods_that_are_merely_starting_are_not_crashing():
    for reason in ("ContainerCreating", "PodInitializing"):
        pod = {"status": {"containerStatuses": [{"name": "e", "state": {"waiting": {"reason": reason}}}]}}
        assert pod_crash_reason(pod) is None
    assert pod_crash_reason({}) is None
