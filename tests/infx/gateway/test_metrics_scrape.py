"""``/metrics`` scraped over HTTP from real gateways (loopback, built-in echo engines, a peer):
bounded series under random model names, zeros for idle models, build info, and the request
log naming the engine and the gateway that served a request, across the exchange."""

from __future__ import annotations

import json
import uuid
from collections.abc import Generator
from typing import Any

import pytest
import openai
import pytest_twisted
from prometheus_client.parser import text_string_to_metric_families
from twisted.internet import threads

from infx.gateway.metrics import OTHER_MODEL, version
from protocol.processor.keys import Locality
from tests.support.exchange import base_url, engines, gateways, internal_address, until  # noqa: F401
from tests.support.http_api import raw
from tests.support.logs import LogLines

Steps = Generator[Any, Any, None]


def scrape(gateway: Any) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    status, headers, body = raw(f"http://127.0.0.1:{gateway.http.port.getHost().port}", "GET", "/metrics")
    assert status == 200 and headers["content-type"].startswith("text/plain")
    samples = {}
    for family in text_string_to_metric_families(body.decode()):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def chat(base: str, model: str, **kwargs: Any) -> Any:
    client = openai.OpenAI(base_url=base, api_key="x", max_retries=0, timeout=10)
    return client.chat.completions.create(model=model, messages=[{"role": "user", "content": "a b c"}], **kwargs)


def not_found(base: str, model: str) -> int:
    status, _, _ = raw(base.removesuffix("/v1"), "POST", "/v1/chat/completions",
                       json.dumps({"model": model, "messages": [{"role": "user", "content": "x"}]}).encode(),
                       {"Content-Type": "application/json"})
    return status


@pytest_twisted.inlineCallbacks
def test_thirty_random_model_names_add_no_series(gateways) -> Steps:  # noqa: F811
    gateway = yield gateways("solo", echo_models="echo")
    yield until(lambda: bool(gateway.dispatcher.models("default")))
    yield threads.deferToThread(chat, base_url(gateway), "echo")
    yield threads.deferToThread(not_found, base_url(gateway), "first-typo")
    before = yield threads.deferToThread(scrape, gateway)
    statuses = yield threads.deferToThread(
        lambda: [not_found(base_url(gateway), f"random-{uuid.uuid4().hex}") for _ in range(30)])
    after = yield threads.deferToThread(scrape, gateway)
    assert set(statuses) == {404}
    assert set(after) == set(before), sorted(set(after) - set(before))
    key = ("infx_http_requests_total", (("endpoint", "chat/completions"), ("model", OTHER_MODEL),
                                         ("status", "404"), ("tenant", "default")))
    assert after[key] == 31
    assert not [name for name, labels in after if any("random-" in value for _, value in labels)]


@pytest_twisted.inlineCallbacks
def test_idle_models_show_zero_in_flight_and_queued_and_build_info_is_exported(gateways) -> Steps:  # noqa: F811
    gateway = yield gateways("solo", echo_models="echo,other")
    yield until(lambda: len(gateway.dispatcher.models("default")) == 2)
    samples = yield threads.deferToThread(scrape, gateway)
    for model in ("echo", "other"):
        for name in ("infx_tasks_in_flight", "infx_tasks_queued"):
            assert samples[(name, (("model", model), ("tenant", "default")))] == 0
    assert samples[("infx_engines_ready", (("locality", "local"), ("tenant", "default")))] == 1
    assert samples[("infx_models_ready", (("tenant", "default"),))] == 2
    assert samples[("infx_build_info", (("version", version()),))] == 1
    assert samples[("infx_exchanged_tasks_total", (("direction", "out"),))] == 0
    assert not [name for name, _ in samples if name.endswith("_created")]


@pytest_twisted.inlineCallbacks
def test_the_request_log_names_the_peer_gateway_and_engine_that_served_a_request(gateways) -> Steps:  # noqa: F811
    a = yield gateways("a")
    yield gateways("b", echo_models="echo", peers=internal_address(a))
    yield until(lambda: engines(a) == {("default", Locality.REMOTE): 1})
    with LogLines() as logs:
        yield threads.deferToThread(lambda: list(chat(base_url(a), "echo", stream=True)))
        yield until(lambda: any(e.get("event") == "request" and e.get("endpoint") == "chat/completions"
                                and e.get("log_logger") is not None for e in logs.events))
    served_here = [e for e in logs.events if e.get("event") == "request"]
    [line] = served_here
    assert (line["engine_id"], line["gateway"], line["status"], line["model"]) == ("builtin-echo-b@b", "b", 200, "echo")
    assert line["queued_seconds"] is not None and line["time_to_first_token_seconds"] is not None
    samples = yield threads.deferToThread(scrape, a)
    assert samples[("infx_exchanged_tasks_total", (("direction", "out"),))] == 1


def test_bytes_queued_on_routes_are_summed_per_kind_and_both_kinds_always_shown() -> None:
    from prometheus_client import CollectorRegistry

    from infx.gateway.metrics import GatewayMetrics

    registry = CollectorRegistry()
    queues: list[tuple[str, int]] = []
    GatewayMetrics(registry).watch_route_queues(lambda: queues)
    assert registry.get_sample_value("infx_route_queued_bytes", {"route": "engine"}) == 0
    assert registry.get_sample_value("infx_route_queued_bytes", {"route": "peer"}) == 0
    queues[:] = [("engine", 100), ("peer", 7), ("engine", 5)]
    assert registry.get_sample_value("infx_route_queued_bytes", {"route": "engine"}) == 105
    assert registry.get_sample_value("infx_route_queued_bytes", {"route": "peer"}) == 7


def test_the_operations_metrics_table_lists_exactly_the_metrics_a_gateway_exports() -> None:
    import re
    from pathlib import Path

    from prometheus_client import CollectorRegistry

    from infx.gateway.metrics import GatewayMetrics
    from protocol.processor.core import Processor

    registry = CollectorRegistry()
    metrics = GatewayMetrics(registry)
    metrics.watch(lambda: [], lambda: Processor().counters)
    metrics.watch_route_queues(lambda: [])
    metrics.watch_routing(lambda: {}, lambda tenant, model: model)
    metrics.watch_status_traffic(lambda: [])
    exported = set()
    for family in registry.collect():
        exported.add(family.name + ("_total" if family.type == "counter" else ""))
    operations = (Path(__file__).resolve().parents[3] / "docs" / "operations.md").read_text()
    table = operations[operations.index("## Metrics, logs and draining"):operations.index("## What reaches the runtime")]
    documented = set(re.findall(r"`(infx_[a-z_]+)`", table))
    # The operator's metrics (routing decisions, status traffic) are in docs/admin.md.
    admin = (Path(__file__).resolve().parents[3] / "docs" / "admin.md").read_text()
    documented |= set(re.findall(r"`(infx_[a-z_]+)[{`]", admin[admin.index("## The Grafana dashboard"):]))
    # The scaler's metrics (--scaler) have their own registry owner, infx/scaling/scaler.py.
    assert {name for name in documented if not name.startswith("infx_scaler_")} == exported


@pytest.mark.e2e
def test_a_twistd_gateways_metrics_stay_bounded_under_random_model_names(tmp_path) -> None:
    """The issue's case on a real ``twistd infx`` process: 30 random names in 404s add no series."""
    from harness.twistd_processes import Gateway, http_get

    gateway = Gateway(tmp_path, extra=["--echo-models", "echo"])
    try:
        def series() -> set[str]:
            status, body = http_get(gateway.url + "/metrics")
            assert status == 200
            return {line.rsplit(" ", 1)[0] for line in body.decode().splitlines() if not line.startswith("#")}

        assert not_found(gateway.base_url, "warm-up-typo") == 404
        before = series()
        assert {not_found(gateway.base_url, f"random-{uuid.uuid4().hex}") for _ in range(30)} == {404}
        after = series()
        assert after == before
        assert not any("random-" in line for line in after)
    finally:
        gateway.stop()
