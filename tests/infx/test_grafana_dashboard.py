"""deploy/grafana-dashboard.json queries only metrics infx exports: every metric name in every
PromQL expression of the dashboard is in a live ``/metrics`` scrape of a test cluster.

The cluster runs in this process on loopback: gateway A with ``--kube --scaler`` against the test
Kubernetes API server, gateway B peered with it, their built-in echo engines, and an engine agent
that comes up for a model its deployment scaled from zero; the traffic has streamed answers (first
tokens, usage), an unknown model (404), and requests held through that cold start.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import openai
import pytest
import pytest_twisted
from prometheus_client.parser import text_string_to_metric_families
from twisted.internet import defer, reactor, task, threads

from harness.kubeapi import FakeKubeAPI, write_kubeconfig
from infx.agent.engine import EngineAgent, GrpcLinks
from infx.agent.runtimes import EchoRuntime
from infx.service import GatewayService
from infx.tap import GatewayOptions
from infx.transport import GrpcChannel, client_endpoint
from protocol.agent.core import EngineAgentCore
from protocol.agent.effects import AgentConfig
from protocol.agent.echo import EchoConfig
from protocol.grpc import GrpcConfig
from tests.support.http_api import raw

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana-dashboard.json"
#: PromQL words that are not metric names.
KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless",
            "offset", "inf", "nan"}


def expressions() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    found = []
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            found.append(target["expr"])
    return found


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects: every identifier that is not a function, a
    keyword, a label (in matchers or groupings), a string or a duration."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', "", expr)  # strings (label values)
    text = re.sub(r"\{[^}]*\}", "", text)  # label matchers
    text = re.sub(r"\[[^\]]*\]", "", text)  # range selectors ([5m], [$__rate_interval])
    text = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", text)  # groupings
    text = re.sub(r"\b\d+(?:\.\d+)?(?:ms|[smhdwy])?\b", "", text)  # numbers and durations (offset 5m)
    names = set()
    for match in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*", text):
        word = match.group()
        rest = text[match.end():].lstrip()
        if word.lower() in KEYWORDS or rest.startswith("("):
            continue
        names.add(word)
    return names


def test_the_promql_reader_finds_metric_names_and_nothing_else():
    assert metric_names('histogram_quantile(0.99, sum by (le, model) (rate(x_bucket{a="b",c=~"d.."}[5m])))') \
        == {"x_bucket"}
    assert metric_names('sum(rate(a_total{d="prefix_hit"}[$__rate_interval])) / sum without (x) (b)') \
        == {"a_total", "b"}
    assert metric_names("max by (deployment) (increase(w_total[$__range])) offset 5m") == {"w_total"}


def test_the_dashboard_is_a_grafana_dashboard_with_a_prometheus_data_source_and_queries():
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] and dashboard["title"] and dashboard["schemaVersion"] >= 30
    assert [v["type"] for v in dashboard["templating"]["list"]] == ["datasource"]
    names = set().union(*map(metric_names, expressions()))
    assert len(names) >= 25 and all(name.startswith("infx_") for name in names), names


def port_of(listener: Any) -> int:
    """The port a gateway's listener bound (the kernel's pick)."""
    return int(listener.port.getHost().port)


def scrape_names(port: int) -> set[str]:
    status, _, body = raw(f"http://127.0.0.1:{port}", "GET", "/metrics")
    assert status == 200
    return {sample.name for family in text_string_to_metric_families(body.decode()) for sample in family.samples}


@defer.inlineCallbacks
def poll(condition, what: str, limit: float = 20.0):
    for _ in range(int(limit / 0.02)):
        if condition():
            return
        yield task.deferLater(reactor, 0.02, lambda: None)
    raise AssertionError(f"{what}: not within {limit} s")


def traffic(base: str) -> None:
    client = openai.OpenAI(base_url=base, api_key="x", max_retries=0, timeout=30)
    for n in range(6):
        for _ in client.chat.completions.create(model="echo", stream=True, stream_options={"include_usage": True},
                                                messages=[{"role": "user", "content": f"turn {n} of a chat"}]):
            pass
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "x"}])


def held(base: str) -> str:
    client = openai.OpenAI(base_url=base, api_key="x", max_retries=0, timeout=30)
    return client.chat.completions.create(model="llama", messages=[{"role": "user", "content": "cold"}]
                                          ).choices[0].message.content


@pytest_twisted.inlineCallbacks
def test_every_metric_the_dashboard_queries_is_in_a_live_scrape(tmp_path: Path):
    api = FakeKubeAPI(reactor).start()
    kubeconfig = write_kubeconfig(tmp_path / "kubeconfig", api.url)
    api.add_deployment("llama-engine", replicas=0,
                       labels={"app": "llama-engine", "infx.io/scalable": "true", "ai.tensorchord.scale.min": "0"},
                       annotations={"infx.io/models": "llama"})
    # Every port the kernel's pick; --kube on port 0 takes --peer-port, the port of the other
    # gateway pods it finds (none here): B is given A's bound port.
    listen = [f"--{option}=tcp:0:interface=127.0.0.1" for option in ("http", "worker-grpc", "internal-grpc")]
    options_a, options_b = GatewayOptions(), GatewayOptions()
    options_a.parseOptions(["--kube", "--scaler", "--peer-port", "8083", *listen, "--echo-models", "echo"])
    a = GatewayService(reactor, options_a.config_value, pod_name="gw-a",
                       environ={"POD_NAME": "gw-a", "NAMESPACE": "default", "KUBECONFIG": str(kubeconfig)})
    b = engine = None
    try:
        a.startService()
        yield a.when_listening()
        options_b.parseOptions(["--peers", f"127.0.0.1:{port_of(a.internal_grpc)}", *listen, "--echo-models", "echo"])
        b = GatewayService(reactor, options_b.config_value, pod_name="gw-b")
        b.startService()
        yield b.when_listening()
        # B dials A, and A dials B back: each holds the other's echo engine.
        yield poll(lambda: len(a.dispatcher.processor.engine_reports()) == 2
                   and len(b.dispatcher.processor.engine_reports()) == 2, "the peers to learn each other's engines")
        yield poll(lambda: a.dispatcher.can_start("default", "llama"), "the scaler to know the deployment")
        base = f"http://127.0.0.1:{port_of(a.http)}/v1"
        yield threads.deferToThread(traffic, base)
        waiting = threads.deferToThread(held, base)
        yield poll(lambda: api.deployment("llama-engine")["spec"].get("replicas") == 1, "the scale from zero")

        def connect() -> GrpcChannel:
            return GrpcChannel(reactor, client_endpoint(reactor, "127.0.0.1", port_of(a.worker_grpc)),
                               GrpcConfig(client_side=True))

        engine = EngineAgent(reactor, EngineAgentCore(AgentConfig(engine_id="llama-0", models=("llama",))),
                             EchoRuntime(reactor, EchoConfig()), GrpcLinks(reactor, connect))
        engine.startService()
        assert (yield waiting) == "cold"

        def cold_start_timed() -> bool:
            return any(sample.name == "infx_scaler_cold_start_seconds_count" and sample.value
                       for family in a.registry.collect() for sample in family.samples)

        # The scaler times the cold start when it hears the model is served, which may come just after
        # the held request's answer.
        yield poll(cold_start_timed, "the cold start to be timed")
        yield poll(lambda: a.scaler.scaler.machine.desired(next(iter(a.scaler.scaler.machine.deployments())))
                   is not None, "the autoscaler's first tick")
        scraped = yield threads.deferToThread(
            lambda: scrape_names(port_of(a.http)) | scrape_names(port_of(b.http)))
    finally:
        if engine is not None and engine.running:
            yield engine.stopService()
        if b is not None:
            yield b.stopService()
        yield a.stopService()
        yield api.stop()
    missing = {expr: sorted(metric_names(expr) - scraped) for expr in expressions() if metric_names(expr) - scraped}
    assert missing == {}, "dashboard queries naming metrics no scrape has"
