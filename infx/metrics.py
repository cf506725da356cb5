"""Prometheus metrics of one gateway, on a registry passed in (never the global one).

One object owns every metric so that tests can build a gateway with a fresh
registry and read exact values back.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


#: Gauges read from the processor when /metrics is scraped: name -> (help, label names).
PROCESSOR_GAUGES = {
    "queued": ("infx_tasks_queued", "Tasks waiting for an engine that serves their model.", ("tenant", "model")),
    "in_flight": ("infx_tasks_in_flight", "Tasks sent to an engine and not yet ended.", ("tenant", "model")),
    "engines": ("infx_engines", "Engines known to this gateway.", ("tenant", "locality")),
}

#: Counters the processor keeps, exported at scrape time: attribute -> (name, help).
PROCESSOR_COUNTERS = {
    "retries": ("infx_task_retries", "Tasks re-dispatched after a scheduling failure, a lost engine or a 503."),
    "results_ignored": ("infx_results_ignored", "Results for tasks that had already ended."),
    "protocol_errors": ("infx_engine_protocol_errors", "Tasks ended because an engine broke the result order."),
    "slow_consumers": ("infx_slow_consumer_failures", "Requests failed because their consumer fell too far behind."),
    "heartbeats_missed": ("infx_heartbeats_missed", "Heartbeats local engines did not answer in time."),
    "tenant_cap_refusals": ("infx_tenant_cap_refusals", "Tasks refused because their tenant was at its cap."),
}

GaugeSource = Callable[[], Iterable[tuple[str, tuple[str, ...], int]]]
CounterSource = Callable[[], Any]


class _ProcessorMetrics(Collector):
    """Reads the processor's counts at scrape time, so the request path never updates metrics."""

    def __init__(self, gauges: GaugeSource, counters: CounterSource) -> None:
        self.gauges = gauges
        self.counters = counters

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        families = {
            key: GaugeMetricFamily(name, text, labels=list(labels))
            for key, (name, text, labels) in PROCESSOR_GAUGES.items()
        }
        for key, labels, value in self.gauges():
            families[key].add_metric(list(labels), value)
        yield from families.values()
        counters = self.counters()
        for attribute, (name, text) in PROCESSOR_COUNTERS.items():
            yield CounterMetricFamily(name, text, value=getattr(counters, attribute))
        outcomes = CounterMetricFamily("infx_tasks_ended", "Tasks ended, by outcome.", labels=["outcome"])
        for outcome, count in sorted(counters.outcomes.items()):
            outcomes.add_metric([outcome], count)
        yield outcomes


class GatewayMetrics:
    """Request, task, engine and exchange metrics of the gateway."""

    def watch(self, gauges: GaugeSource, counters: CounterSource) -> None:
        """Export the processor's queued/in-flight/engine counts and its counters, read at each scrape."""
        self.registry.register(_ProcessorMetrics(gauges, counters))

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
        self.slow_clients = Counter(
            "infx_slow_client_aborts", "Streams ended because the client read too slowly.", registry=registry,
        )
