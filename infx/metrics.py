"""Prometheus metrics of one gateway, on a registry passed in (never the global one).

One object owns every metric so that tests can build a gateway with a fresh
registry and read exact values back.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


class GatewayMetrics:
    """Request, task, engine and exchange metrics of the gateway."""

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
        self.in_flight = Gauge(
            "infx_tasks_in_flight", "Tasks sent to an engine and not yet ended.", ["tenant", "model"], registry=registry,
        )
        self.queued = Gauge(
            "infx_tasks_queued", "Tasks waiting for an engine that serves their model.", ["tenant", "model"],
            registry=registry,
        )
        self.engines = Gauge(
            "infx_engines", "Engines known to this gateway.", ["tenant", "locality"], registry=registry,
        )
        self.exchanged = Counter(
            "infx_exchanged_tasks", "Tasks sent to a peer gateway (out) or received from one (in).",
            ["direction"], registry=registry,
        )
        self.retries = Counter("infx_task_retries", "Tasks re-dispatched after a failure.", registry=registry)
        self.slow_clients = Counter(
            "infx_slow_client_aborts", "Streams ended because the client read too slowly.", registry=registry,
        )
