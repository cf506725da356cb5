"""Prometheus metrics of one gateway, on a registry passed in (never the global one).

One object owns every metric so that tests can build a gateway with a fresh
registry and read exact values back. Cardinality is bounded by construction:
a ``model`` label takes only models some engine of the tenant lists (or
that the scaler can start), every other name counts as :data:`OTHER_MODEL`,
so clients naming random models add no series; ``tenant`` comes from the
API key file (one value, ``default``, when auth is off); ``endpoint`` and
``status`` are the gateway's own finite sets.
"""

from __future__ import annotations

from collections import Counter as Tally
from collections.abc import Callable, Iterable, Iterator, Mapping
from importlib import metadata
from typing import Any

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from protocol.processor.attempts import AttemptFailure

# ``*_created`` series would double every counter and histogram, for nothing an operator reads.
prometheus_client.disable_created_metrics()

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)

#: The model label of requests for models no engine serves here (404s, typos, probes).
OTHER_MODEL = "__other__"

#: Gauges read from the processor when /metrics is scraped: name -> (help, label names).
PROCESSOR_GAUGES = {
    "queued": ("infx_tasks_queued", "Tasks waiting for an engine that serves their model.", ("tenant", "model")),
    "in_flight": ("infx_tasks_in_flight", "Tasks sent to an engine and not yet ended.", ("tenant", "model")),
    "engines": ("infx_engines", "Engines known to this gateway.", ("tenant", "locality")),
    "engines_ready": ("infx_engines_ready", "Engines that take tasks now (ready, not told to go away).",
                      ("tenant", "locality")),
    "models_ready": ("infx_models_ready", "Models that some ready engine of the tenant serves.", ("tenant",)),
}

#: Counters the processor keeps, exported at scrape time: attribute -> (name, help).
PROCESSOR_COUNTERS = {
    "results_ignored": ("infx_results_ignored", "Results for tasks that had already ended."),
    "protocol_errors": ("infx_engine_protocol_errors", "Tasks ended because an engine broke the result order."),
    "slow_consumers": ("infx_slow_consumer_failures", "Requests failed because their consumer fell too far behind."),
    "heartbeats_missed": ("infx_heartbeats_missed", "Heartbeats local engines did not answer in time."),
    "engine_id_clashes": ("infx_engine_id_clashes",
                          "Engine streams refused because another engine process holds their engine id here."),
    "tenant_cap_refusals": ("infx_tenant_cap_refusals", "Tasks refused because their tenant was at its cap."),
    "drain_refusals": ("infx_drain_refusals",
                       "Tasks failed at once (503) while draining because no engine left here serves their model."),
    "shed": ("infx_sheddable_refusals",
             "Sheddable tasks refused (429) because the engines of their model were saturated."),
}

_REASONS = tuple(failure.value for failure in AttemptFailure)

#: Counters the processor keeps by one label: attribute -> (name, help, label, its values). Every
#: value is a fixed name of the processor's, exported from the start (at 0) so that rates need no
#: first sample.
PROCESSOR_LABELLED_COUNTERS = {
    "outcomes": ("infx_tasks_ended", "Tasks ended, by outcome.", "outcome", ()),
    "attempt_failures": ("infx_task_attempt_failures",
                         "Sends of a task to an engine that failed without an answer for the client, by reason "
                         "(engine_lost, send_failed, runtime_busy, runtime_unreachable, runtime_dropped).",
                         "reason", _REASONS),
    "retries": ("infx_task_retries",
                "Sends of a task to an engine after an earlier send of it failed, by that failure's reason.",
                "reason", _REASONS),
}

GaugeSource = Callable[[], Iterable[tuple[str, tuple[str, ...], int]]]
CounterSource = Callable[[], Any]
#: (route kind, bytes queued on one route) for every open route.
RouteQueueSource = Callable[[], Iterable[tuple[str, int]]]


def version() -> str:
    """infx's installed version, for ``infx_build_info``."""
    try:
        return metadata.version("infx")
    except metadata.PackageNotFoundError:
        return "unknown"


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
        # Sources may name a label set more than once (models folded into OTHER_MODEL): sum them.
        values: Tally[tuple[str, tuple[str, ...]]] = Tally()
        for key, labels, value in self.gauges():
            values[(key, labels)] += value
        for (key, labels), value in sorted(values.items()):
            families[key].add_metric(list(labels), value)
        yield from families.values()
        counters = self.counters()
        for attribute, (name, text) in PROCESSOR_COUNTERS.items():
            yield CounterMetricFamily(name, text, value=getattr(counters, attribute))
        for attribute, (name, text, label, values) in PROCESSOR_LABELLED_COUNTERS.items():
            family = CounterMetricFamily(name, text, labels=[label])
            counts = getattr(counters, attribute)
            for value in sorted(set(values) | set(counts)):
                family.add_metric([value], counts[value])
            yield family


class _RouteQueues(Collector):
    """Reads the bytes queued on engine and peer streams at scrape time."""

    def __init__(self, source: RouteQueueSource) -> None:
        self.source = source

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily(
            "infx_route_queued_bytes",
            "Bytes of tasks queued on engine (route=engine) and peer (route=peer) streams that they have not "
            "taken yet.", labels=["route"])
        totals: Tally[str] = Tally({"engine": 0, "peer": 0})
        for route, queued in self.source():
            totals[route] += queued
        for route, queued in sorted(totals.items()):
            family.add_metric([route], queued)
        yield family


#: Tasks placed since start per (tenant, model, routing decision).
DecisionSource = Callable[[], Mapping[tuple[str, str, str], int]]
#: (peer, direction, reports, bytes) of the status reports exchanged with each peer since start.
StatusTrafficSource = Callable[[], Iterable[tuple[str, str, int, int]]]


class _Routing(Collector):
    """Reads the routing policy's decisions at scrape time (``protocol.routing.policy.RoutingDecision``)."""

    def __init__(self, decisions: DecisionSource, model_label: Callable[[str, str], str]) -> None:
        self.decisions = decisions
        self.model_label = model_label

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = CounterMetricFamily(
            "infx_routing_decisions", "Tasks this gateway's routing policy placed, by how: prefix_hit (the engine "
            "held the start of the prompt), home (the prompt's ring home), spill (moved off its home by load), "
            "load (by load alone).", labels=["tenant", "model", "decision"])
        totals: Tally[tuple[str, str, str]] = Tally()
        for (tenant, model, decision), count in self.decisions().items():
            totals[(tenant, self.model_label(tenant, model), decision)] += count
        for labels, count in sorted(totals.items()):
            family.add_metric(list(labels), count)
        yield family


class _StatusTraffic(Collector):
    """Reads the status reports exchanged with each peer at scrape time."""

    def __init__(self, source: StatusTrafficSource) -> None:
        self.source = source

    def collect(self) -> Iterator[CounterMetricFamily]:
        reports = CounterMetricFamily("infx_peer_status_reports",
                                      "Status reports (ServerStatus) exchanged with each peer, by direction.",
                                      labels=["peer", "direction"])
        sizes = CounterMetricFamily("infx_peer_status_report_bytes",
                                    "Encoded bytes of the status reports exchanged with each peer, by direction.",
                                    labels=["peer", "direction"])
        for peer, direction, count, size in sorted(self.source()):
            reports.add_metric([peer, direction], count)
            sizes.add_metric([peer, direction], size)
        yield reports
        yield sizes


class GatewayMetrics:
    """Request, task, engine and exchange metrics of the gateway."""

    def watch_routing(self, decisions: DecisionSource, model_label: Callable[[str, str], str]) -> None:
        """Export the routing decisions, read at each scrape (models as bounded labels)."""
        self.registry.register(_Routing(decisions, model_label))

    def watch_status_traffic(self, source: StatusTrafficSource) -> None:
        """Export the status reports exchanged with each peer, read at each scrape."""
        self.registry.register(_StatusTraffic(source))

    def watch(self, gauges: GaugeSource, counters: CounterSource) -> None:
        """Export the processor's queued/in-flight/engine counts and its counters, read at each scrape."""
        self.registry.register(_ProcessorMetrics(gauges, counters))

    def watch_route_queues(self, source: RouteQueueSource) -> None:
        """Export the bytes queued on each kind of route (``engine``, ``peer``), read at each scrape."""
        self.registry.register(_RouteQueues(source))

    def child(self, metric: Any, *labels: str) -> Any:
        """``metric.labels(*labels)``, looked up once per label set (``labels()`` validates and locks
        on every call; the sets are bounded, see the module docstring)."""
        key = (id(metric), labels)
        found = self._children.get(key)
        if found is None:
            found = self._children[key] = metric.labels(*labels)
        return found

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self._children: dict[tuple[int, tuple[str, ...]], Any] = {}
        by_request = ["endpoint", "tenant", "model", "status"]
        self.requests = Counter(
            "infx_http_requests", "HTTP API requests by endpoint, tenant, model and status.",
            by_request, registry=registry,
        )
        self.request_seconds = Histogram(
            "infx_http_request_duration_seconds", "Time from request to the end of its response.",
            by_request, buckets=LATENCY_BUCKETS, registry=registry,
        )
        self.first_token_seconds = Histogram(
            "infx_time_to_first_token_seconds",
            "Time from request to the first streamed event that carries output (not the role-only chunk).",
            ["endpoint", "tenant", "model"], buckets=LATENCY_BUCKETS, registry=registry,
        )
        self.queue_seconds = Histogram(
            "infx_queue_wait_seconds", "Time from a request's arrival to its first dispatch to an engine.",
            ["tenant", "model"], buckets=LATENCY_BUCKETS, registry=registry,
        )
        self.input_tokens = Counter(
            "infx_input_tokens", "Prompt (input) tokens, as the engines' usage reports them.",
            ["tenant", "model"], registry=registry,
        )
        self.output_tokens = Counter(
            "infx_output_tokens", "Generated (output) tokens, as the engines' usage reports them.",
            ["tenant", "model"], registry=registry,
        )
        self.request_retries = Counter(
            "infx_request_retries",
            "Retries (sends to an engine after a failed one) of HTTP requests that ended, as their log lines count "
            "them: once every request has ended, the sum of infx_task_retries_total over its reasons.",
            ["tenant", "model"], registry=registry,
        )
        self.exchanged = Counter(
            "infx_exchanged_tasks", "Tasks sent to a peer gateway (out) or received from one (in).",
            ["direction"], registry=registry,
        )
        self.withdrawn_tasks = Counter(
            "infx_route_withdrawn_tasks",
            "Tasks taken back unsent from an engine's or peer's stream: their request ended before it read them.",
            registry=registry,
        )
        self.slow_clients = Counter(
            "infx_slow_client_aborts", "Streams ended because the client read too slowly.", registry=registry,
        )
        self.trace_spans_lost = Counter(
            "infx_trace_spans_lost", "Spans the OTLP exporter could not deliver, after its own retries "
            "(--otlp-traces-endpoint unreachable or refusing them); docs/tracing.md.", registry=registry,
        )
        build = Gauge("infx_build_info", "infx's version; the value is always 1.", ["version"], registry=registry)
        build.labels(version()).set(1)
        for direction in ("in", "out"):
            self.exchanged.labels(direction)
