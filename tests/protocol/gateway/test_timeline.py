"""The timeline behind the operator page's charts: rates per bucket, TTFT quantiles, a bounded window."""

import pytest

from protocol.gateway.timeline import TTFT_BOUNDS, Timeline, TimelineConfig


def test_requests_errors_and_tokens_become_rates_in_the_bucket_they_ended_in():
    timeline = Timeline(TimelineConfig(bucket_seconds=5, buckets=3))
    for status in (200, 200, 502, 404):
        timeline.request_ended("t", "m", status, None, 10, 20, now=101.0)
    timeline.request_ended("t", "m", 200, None, None, None, now=106.0)
    series = timeline.series(now=107.0)
    assert series["end"] == 110.0 and series["bucket_seconds"] == 5 and series["buckets"] == 3
    (model,) = series["models"]
    assert (model["tenant"], model["model"]) == ("t", "m")
    assert model["requests_per_second"] == [0.0, 0.8, 0.2]
    assert model["errors_per_second"] == [0.0, 0.2, 0.0]  # a 4xx is the client's, not an error
    assert model["input_tokens_per_second"] == [0.0, 8.0, 0.0]
    assert model["output_tokens_per_second"] == [0.0, 16.0, 0.0]


def test_ttft_quantiles_fall_within_one_bin_of_the_true_ones():
    timeline = Timeline(TimelineConfig(bucket_seconds=10, buckets=1))
    samples = [0.1] * 98 + [2.0, 2.0]
    for seconds in samples:
        timeline.request_ended("t", "m", 200, seconds, None, None, now=1.0)
    timeline.request_ended("t", "m", 200, None, None, None, now=1.0)  # no first token: not a sample
    (model,) = timeline.series(now=1.0)["models"]
    (p50,), (p99,) = model["ttft_p50_seconds"], model["ttft_p99_seconds"]
    assert 0.1 / 1.25 < p50 < 0.1 * 1.25
    assert 2.0 / 1.25 < p99 < 2.0 * 1.25


def test_a_bucket_without_first_tokens_has_no_quantile_and_a_huge_one_lands_in_the_last_bin():
    timeline = Timeline(TimelineConfig(bucket_seconds=1, buckets=2))
    timeline.request_ended("t", "m", 200, 10_000.0, None, None, now=0.5)
    timeline.request_ended("t", "m", 200, None, None, None, now=1.5)
    (model,) = timeline.series(now=1.5)["models"]
    assert model["ttft_p50_seconds"][1] is None
    assert model["ttft_p50_seconds"][0] == pytest.approx(TTFT_BOUNDS[-1] / 1.25 ** 0.5, rel=1e-3)


def test_routing_decisions_are_rates_per_decision():
    timeline = Timeline(TimelineConfig(bucket_seconds=2, buckets=2))
    timeline.routed("t", "m", {"prefix_hit": 4, "spill": 2, "home": 0}, now=3.0)
    timeline.routed("t", "m", {"prefix_hit": 0}, now=5.0)  # nothing placed: no bucket made
    (model,) = timeline.series(now=3.0)["models"]
    assert model["routing_per_second"] == {"prefix_hit": [0.0, 2.0], "spill": [0.0, 1.0]}


def test_the_window_slides_and_memory_stays_bounded():
    timeline = Timeline(TimelineConfig(bucket_seconds=1, buckets=4))
    for second in range(1000):
        timeline.request_ended("t", "m", 200, 0.05, 1, 1, now=second + 0.5)
    assert len(timeline._series[("t", "m")]) <= 5
    (model,) = timeline.series(now=999.5)["models"]
    assert model["requests_per_second"] == [1.0] * 4
    assert timeline.series(now=2000.0)["models"] == []
    timeline.forget_idle(now=2000.0)
    assert timeline._series == {}


def test_series_are_scoped_to_the_tenants_asked_for():
    timeline = Timeline()
    timeline.request_ended("a", "m", 200, None, None, None, now=1.0)
    timeline.request_ended("b", "m", 200, None, None, None, now=1.0)
    assert [m["tenant"] for m in timeline.series(now=1.0)["models"]] == ["a", "b"]
    assert [m["tenant"] for m in timeline.series(now=1.0, tenants=["b"])["models"]] == ["b"]


def test_a_window_of_no_bucket_is_refused():
    with pytest.raises(ValueError):
        TimelineConfig(buckets=0)
