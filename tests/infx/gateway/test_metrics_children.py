"""GatewayMetrics.child: a metric's child per label set, looked up once, counting like labels()."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from infx.gateway.metrics import GatewayMetrics


def test_a_child_is_found_once_per_metric_and_label_set_and_counts_into_the_series() -> None:
    registry = CollectorRegistry()
    metrics = GatewayMetrics(registry)
    labels = ("chat/completions", "default", "m", "200")
    first = metrics.child(metrics.requests, *labels)
    assert metrics.child(metrics.requests, *labels) is first
    assert metrics.child(metrics.requests, "chat/completions", "default", "m", "404") is not first
    assert metrics.child(metrics.request_seconds, *labels) is not first
    first.inc()
    metrics.child(metrics.requests, *labels).inc()
    metrics.requests.labels(*labels).inc()
    names = dict(zip(("endpoint", "tenant", "model", "status"), labels))
    assert registry.get_sample_value("infx_http_requests_total", names) == 3
