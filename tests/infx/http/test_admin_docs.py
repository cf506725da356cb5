"""``/admin/status`` and docs/admin.md hold each other: every field the JSON has is documented there,
and every field documented there is in the JSON of a live pair of gateways (with a peer, an engine
reporting its runtime's load and its slot keeping, requests that succeeded, failed and were searched, routing decisions,
and the scaler's view of a deployment)."""

from __future__ import annotations

import dataclasses
import json
import re
import urllib.request
from pathlib import Path
from typing import Any

import openai
import pytest
import pytest_twisted
from twisted.internet import defer, reactor, task, threads

from infx.config import build_config
from infx.gateway.cluster_status import ClusterStatus
from infx.service import GatewayService
from protocol.agent.runtime_load import RuntimeLoad
from protocol.pb import status_pb2
from protocol.scaling.labels import MODELS_ANNOTATION, SCALABLE_LABEL, deployment_snapshot
from protocol.scaling.scaler import Scaler

ROOT = Path(__file__).resolve().parents[3]
DOC = ROOT / "docs" / "admin.md"
SECTION = "## `/admin/status`, field by field"

#: Objects whose keys the cluster chooses (pods, tenants, engines, models, callers, decisions): ``*`` in paths.
DYNAMIC = {"gateways", "tenants", "tenants.*.engines", "tenants.*.models", "tenants.*.slots_held",
           "tenants.*.slot_share", "waiting", "waiting.*", "series.models[].routing_per_second"}


def paths(value: Any, prefix: str = "") -> set[str]:
    """Every field path of a JSON value (see the module docstring's conventions)."""
    found: set[str] = set()
    if isinstance(value, dict):
        for key, child in value.items():
            name = "*" if prefix in DYNAMIC else key
            path = f"{prefix}.{name}" if prefix else name
            found.add(path)
            found |= paths(child, path)
    elif isinstance(value, list):
        for item in value:
            if isinstance(item, (dict, list)):
                found |= paths(item, prefix + "[]")
    return found


def documented() -> set[str]:
    text = DOC.read_text()
    section = text[text.index(SECTION):]
    section = section[:section.index("\n## ", 1)]
    return set(re.findall(r"^\| `([^`]+)` \|", section, flags=re.M))


def test_the_path_conventions_see_maps_lists_and_nulls():
    assert paths({"tenants": {"a": {"engines": {"e": {"models": [{"id": "m"}], "load": None}}}}}) == {
        "tenants", "tenants.*", "tenants.*.engines", "tenants.*.engines.*", "tenants.*.engines.*.models",
        "tenants.*.engines.*.models[].id", "tenants.*.engines.*.load"}
    assert "failures[].route.peer" in documented() and "tenants.*.engines.*.load.source" in documented()


def _config(**options):
    return build_config({}, {"http": "tcp:0:interface=127.0.0.1", "worker_grpc": "tcp:0:interface=127.0.0.1",
                             "internal_grpc": "tcp:0:interface=127.0.0.1", "echo_models": "echo",
                             **options})


def _get(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(url, timeout=10) as response:
        return json.loads(response.read())


@pytest.fixture
def two_gateways():
    started = []

    @pytest_twisted.inlineCallbacks
    def start():
        pair: list[GatewayService] = []
        # On ports the kernel picks: gw-b dials gw-a, which dials it back (protocol/exchange/dial_backs.py).
        for name in ("gw-a", "gw-b"):
            peers = tuple(f"127.0.0.1:{g.internal_grpc.port.getHost().port}" for g in pair)
            # Slow echoes and one slot per engine: concurrent requests hold slots and wait.
            gateway = GatewayService(reactor, _config(peers=peers, echo_token_delay=0.2, max_in_flight_per_engine=1),
                                     pod_name=name)
            yield gateway.startService()
            started.append(gateway)
            pair.append(gateway)
        return tuple(pair)

    yield start
    for gateway in reversed(started):
        pytest_twisted.blockon(gateway.stopService())


@pytest_twisted.inlineCallbacks
def test_every_field_of_the_status_is_documented_and_every_documented_field_is_in_it(two_gateways):
    a, b = yield two_gateways()
    base = f"http://127.0.0.1:{a.http.port.getHost().port}"
    a.builtin_engine.runtime_load_changed(RuntimeLoad("vllm", 2, 1, kv_cache_usage=0.4, prefix_cache_hit_rate=0.5,
                                                      adapters=("sql-lora",)))
    a.builtin_engine.slot_keeping_changed(status_pb2.EngineStatus.SlotKeeping(held=2, restored=1, cold=3, saved=4))
    for _ in range(300):
        status = yield threads.deferToThread(_get, base + "/admin/status")
        engines = status["tenants"].get("default", {}).get("engines", {})
        peer = [g for g in status["gateways"].values() if not g["self"]]
        if len(engines) == 2 and peer and peer[0]["state"] == "connected" and \
                any(e["load"] and e["slot_keeping"] for e in engines.values()):
            break
        yield task.deferLater(reactor, 0.05, lambda: None)
    else:
        raise AssertionError(f"the pair never settled: {status}")

    def requests() -> None:
        client = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0, timeout=10)
        for n in range(3):
            client.chat.completions.create(model="echo", messages=[{"role": "user", "content": f"hello {n}"}],
                                           extra_headers={"x-request-id": f"doc-{n}"})
        with pytest.raises(openai.NotFoundError):
            client.chat.completions.create(model="missing", messages=[{"role": "user", "content": "x"}])

    yield threads.deferToThread(requests)
    # Four slow streams at once on two one-slot engines: two hold the slots, two wait.
    client = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0, timeout=30)
    busy = [threads.deferToThread(lambda: list(client.chat.completions.create(
        model="echo", stream=True, messages=[{"role": "user", "content": "one two three four five six"}])))
        for _ in range(4)]
    for _ in range(300):
        loaded = yield threads.deferToThread(_get, base + "/admin/status")
        if loaded["waiting"] and loaded["tenants"]["default"]["slots_held"]:
            break
        yield task.deferLater(reactor, 0.05, lambda: None)
    else:
        raise AssertionError(f"no request ever waited: {loaded}")
    yield defer.gatherResults(busy)
    a.cluster_status.sample_routing()
    status = yield threads.deferToThread(_get, base + "/admin/status?request=doc-1")
    assert status["request"]["route"]["engine"] and status["failures"] and status["series"]["models"]
    # The scaler's view needs --scaler and a Kubernetes API: the same status, with a real scaler machine
    # that watched a deployment serving the model.
    machine = Scaler()
    machine.observe_deployment(deployment_snapshot({
        "metadata": {"name": "llama", "namespace": "ml", "generation": 1,
                     "labels": {SCALABLE_LABEL: "true"}, "annotations": {MODELS_ANNOTATION: "llama-3"}},
        "spec": {"replicas": 0, "selector": {"matchLabels": {"app": "llama"}}}, "status": {}}), 0.0)
    scaled = ClusterStatus(reactor, dataclasses.replace(a.cluster_status.sources, scaler=machine,
                                                        can_start=lambda tenant, model: model == "llama-3"))
    with_scaler = json.loads(json.dumps(scaled.status(), default=str))
    assert with_scaler["tenants"]["default"]["models"]["llama-3"]["state"] == "startable"

    seen = paths(status) | paths(with_scaler) | paths(loaded)
    seen |= {p.replace("request.", "failures[].", 1) for p in seen if p.startswith("request.")}
    seen -= {p for p in seen if p.startswith("request.")}
    doc = documented()
    assert sorted(seen - doc) == [], "fields in /admin/status that docs/admin.md does not document"
    assert sorted(doc - seen) == [], "fields docs/admin.md documents that /admin/status lacks"
