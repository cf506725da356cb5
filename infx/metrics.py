"""Prometheus metrics of one gateway, on a registry passed in (never the global one).

One object owns every metric so that tests can build a gateway with a fresh
registry and read exact values back.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


#: Gauges read from the processor when /metrics is scraped: name -> (help, label names).
PROCESSOR_GAUGES = {
    "queued": ("infx_tasks_queued", "Tasks waiting for an engine that serves their model.", ("tenant", "model")),
    "in_flight": ("infx_tasks_in_flight", "Tasks sent to an engine and not yet ended.", ("tenant", "model")),
    "engines": ("infx_engines", "Engines known to this gateway.", ("tenant", "locality")),
}

GaugeSource = Callable[[], Iterable[tuple[str, tuple[str, ...], int]]]


class _ProcessorGauges(Collector):
    """Reads task and engine counts at scrape time, so the request path never updates gauges."""

    def __init__(self, source: GaugeSource) -> None:
        self.source = source

    def collect(self) -> Iterator[GaugeMetricFamily]:
        families = {
            key: GaugeMetricFamily(name, text, labels=list(labels))
            for key, (name, text, labels) in PROCESSOR_GAUGES.items()
        }
        for key, labels, value in self.source():
            families[key].add_metric(list(labels), value)
        yield from families.values()


class GatewayMetrics:
    """Request, task, engine and exchange metrics of the gateway."""

    def watch(self, source: GaugeSource) -> None:
        """Export the processor's queued/in-flight/engine counts, read from ``source`` at each scrape."""
        self.registry.register(_ProcessorGauges(source))

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.requests = Counter(
            "infx_http_requests", "HTTP API requests by endpoint, model and status.",
            ["endpoint", "model", "status"], registry=registry,
        )
        self.request_seconds = Histogram(
            "infx_http_request_duration_seconds", "Time from request to the end of its response.",
            ["endpoint", "model", "status"], buckets=LATENCY_BUCKETS, registry=registry,
        )
        self.first_token_seconds = Histogram(
            "infx_time_to_first_token_seconds", "Time from request to the first streamed event.",
            ["model"], buckets=LATENCY_BUCKETS, registry=registry,
        )
        self.exchanged = Counter(
            "infx_exchanged_tasks", "Tasks sent to a peer gateway (out) or received from one (in).",
            ["direction"], registry=registry,
        )
        self.retries = Counter("infx_task_retries", "Tasks re-dispatched after a failure.", registry=registry)
        self.slow_clients = Counter(
            "infx_slow_client_aborts", "Streams ended because the client read too slowly.", registry=registry,
        )
