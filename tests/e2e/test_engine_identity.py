"""Engine identity across real processes (issue 22 item 2): three peered ``twistd infx``
gateways, each with its built-in echo engine, and two ``twistd infx-engine`` agents given the
same ``--engine-id`` on two of them. Every model is served from every gateway; a third agent
under that id on a gateway that already has one is refused on its own stream, with a status
and a message that say what to change, logged on both sides and counted."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from harness.twistd_processes import Engine, Gateway, TwistdChild, http_get, wait_until

ECHO_MODELS = ("echo-a", "echo-b", "echo-c")
AGENT_MODELS = ("x", "y")
SHARED_ID = "gpu-0"


class Cluster:
    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.gateways: list[Gateway] = []
        self.agents: list[Engine | TwistdChild] = []
        # On ports the kernel picks: each gateway dials those started before it, which dial it back
        # (protocol/exchange/dial_backs.py).
        for model in ECHO_MODELS:
            peers = [f"--peers={','.join(f'127.0.0.1:{g.internal_port}' for g in self.gateways)}"] if self.gateways else []
            self.gateways.append(Gateway(log_dir, name=f"gateway-{model[-1]}", extra=[
                *peers, "--echo-models", model, "--status-interval", "0.5"]))

    @property
    def children(self) -> list[TwistdChild]:
        return [g.child for g in self.gateways] + [a.child if isinstance(a, Engine) else a for a in self.agents]

    def stop(self) -> None:
        for child in reversed(self.children):
            child.stop()


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    c = Cluster(tmp_path)
    try:
        yield c
    finally:
        c.stop()


def listed(gateway: Gateway) -> set[str]:
    code, body = http_get(gateway.base_url + "/models")
    assert code == 200, body
    return set(re.findall(r'"id": "([^"]+)"', body.decode()))


def test_every_model_is_served_from_every_gateway_and_a_same_gateway_clash_is_refused(cluster: Cluster):
    a, b, c = cluster.gateways
    for gateway, model in zip((a, b), AGENT_MODELS):
        cluster.agents.append(Engine(cluster.log_dir, gateway, SHARED_ID, [model]))
    everything = set(ECHO_MODELS) | set(AGENT_MODELS)
    for gateway in cluster.gateways:
        wait_until(lambda g=gateway: listed(g) == everything, f"{gateway.child.name} to list every model",
                   cluster.children)
    for gateway in cluster.gateways:
        client = openai.OpenAI(base_url=gateway.base_url, api_key="x", max_retries=0, timeout=10)
        for model in sorted(everything):
            text = f"{model} via {gateway.child.name}"
            reply = client.chat.completions.create(model=model, messages=[{"role": "user", "content": text}])
            assert reply.choices[0].message.content == text
    # At c, a's and b's gpu-0 are two engines, named with their gateways; each reports its own id.
    engines = c.engines()
    assert {a.remote_engine_id(SHARED_ID), b.remote_engine_id(SHARED_ID)} <= engines.keys()
    assert {engines[g.remote_engine_id(SHARED_ID)]["engine_id"] for g in (a, b)} == {SHARED_ID}

    # A second gpu-0 on a: refused on its own stream, with what to change; the first keeps serving.
    intruder = TwistdChild("engine-gpu-0-again", ["infx-engine", "--server", a.worker_address, "--engine-id", SHARED_ID,
                                                  "--runtime", "echo", "--models", "z"], cluster.log_dir)
    cluster.agents.append(intruder)
    wait_until(lambda: "ALREADY_EXISTS" in intruder.output(), "the second gpu-0 to be refused", cluster.children)
    said = intruder.output()
    assert "engine gpu-0: stream closed: ALREADY_EXISTS: engine id 'gpu-0' (tenant 'default') is already connected " \
           "to this gateway from another engine process; give each engine its own --engine-id" in said, said
    wait_until(lambda: "engine at 127.0.0.1 refused: engine id 'gpu-0'" in a.child.output(), "a's warning",
               cluster.children)
    assert "engine gpu-0 connected from" in a.child.output()  # the first, once: the refused one never was
    assert a.child.output().count("engine gpu-0 connected from") == 1
    code, metrics = http_get(a.url + "/metrics")
    clashes = re.search(r"^infx_engine_id_clashes_total (\S+)$", metrics.decode(), re.M)
    assert clashes is not None and float(clashes.group(1)) >= 1
    assert "z" not in listed(a)
    reply = openai.OpenAI(base_url=a.base_url, api_key="x", max_retries=0, timeout=10).chat.completions.create(
        model="x", messages=[{"role": "user", "content": "still here"}])
    assert reply.choices[0].message.content == "still here"
