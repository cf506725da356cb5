"""Three gateways on loopback, one echo engine attached to gateway C.

With static peers they are real ``twistd infx`` processes: each listens on its
own loopback address (127.0.0.2, .3, .4) with the same port numbers, so
``tcp:PORT:interface=ADDR`` endpoints are exercised and peers are dialled at
``ADDR:PORT``. With ``--kube`` they run in this process (built from the same
options, each with its own ``POD_NAME``), so that every gateway's receivers
can be compared with the live pods of the test API server at every step.
Requests go through the official openai client. Every wait polls with a
timeout; no test sleeps for a fixed time to make something happen.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import pytest_twisted
from twisted.internet import defer, reactor, task, threads

ROOT = Path(__file__).resolve().parents[2]
TWISTD = str(Path(sys.executable).with_name("twistd"))
HOSTS = {"a": "127.0.0.2", "b": "127.0.0.3", "c": "127.0.0.4"}
STATUS_INTERVAL = 1.0
WORDS = " ".join(f"w{i}" for i in range(30))


def _free_ports(count: int) -> list[int]:
    """Port numbers free on every gateway address (checked by binding them all)."""
    ports: list[int] = []
    while len(ports) < count:
        probe = socket.socket()
        probe.bind((HOSTS["a"], 0))
        port = probe.getsockname()[1]
        sockets = [probe]
        try:
            for host in list(HOSTS.values())[1:]:
                s = socket.socket()
                sockets.append(s)
                s.bind((host, port))
        except OSError:
            continue
        finally:
            for s in sockets:
                s.close()
        if port not in ports:
            ports.append(port)
    return ports


def _loopback_aliases_work() -> bool:
    try:
        with socket.socket() as s:
            s.bind((HOSTS["c"], 0))
        return True
    except OSError:
        return False


pytestmark = pytest.mark.skipif(not _loopback_aliases_work(), reason="127.0.0.x aliases are not bindable here")


def until(condition: Callable[[], Any], timeout: float = 15.0, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not met within {timeout}s")
        time.sleep(0.05)


class Cluster:
    """Starts, kills and stops the gateway and engine processes; logs go to ``tmp``."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.http, self.worker, self.internal = _free_ports(3)
        self.processes: dict[str, subprocess.Popen[bytes]] = {}
        self._starts = 0

    def _spawn(self, name: str, argv: list[str]) -> subprocess.Popen[bytes]:
        self._starts += 1
        log = open(self.tmp / f"{name}-{self._starts}.log", "wb")
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        env.pop("POD_NAME", None)
        process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=env)
        log.close()
        self.processes[name] = process
        return process

    def gateway(self, name: str, *extra: str) -> None:
        host = HOSTS[name]
        peers = ",".join(f"{h}:{self.internal}" for n, h in HOSTS.items() if n != name)
        self._spawn(name, [
            TWISTD, "-n", "--pidfile=", "infx",
            "--http", f"tcp:{self.http}:interface={host}",
            "--worker-grpc", f"tcp:{self.worker}:interface={host}",
            "--internal-grpc", f"tcp:{self.internal}:interface={host}",
            "--peers", peers, "--status-interval", str(STATUS_INTERVAL), "--grace-period", "10",
            "--queue-timeout", "2", "--workers", "1", *extra,
        ])
        until(lambda: self._healthy(name), what=f"gateway {name} healthy")

    def engine(self, gateway: str) -> None:
        self._spawn("engine", [
            TWISTD, "-n", "--pidfile=", "infx-engine", "--server", f"{HOSTS[gateway]}:{self.worker}",
            "--runtime", "echo", "--models", "m", "--engine-id", "echo-c", "--token-delay", "0.05",
            "--status-interval", "1",
        ])

    def base(self, name: str) -> str:
        return f"http://{HOSTS[name]}:{self.http}/v1"

    def _healthy(self, name: str) -> bool:
        if self.processes[name].poll() is not None:
            raise AssertionError(f"{name} exited with {self.processes[name].returncode}")
        try:
            with socket.create_connection((HOSTS[name], self.http), timeout=0.5):
                return True
        except OSError:
            return False

    def signal(self, name: str, sig: int) -> subprocess.Popen[bytes]:
        process = self.processes[name]
        process.send_signal(sig)
        return process

    def close(self) -> None:
        for process in self.processes.values():
            if process.poll() is None:
                process.kill()
            process.wait(10)


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    c = Cluster(tmp_path)
    try:
        yield c
    finally:
        c.close()


def client(base: str, timeout: float = 10) -> openai.OpenAI:
    return openai.OpenAI(base_url=base, api_key="x", max_retries=0, timeout=timeout)


def serves(base: str) -> bool:
    return "m" in [m.id for m in client(base, timeout=2).models.list().data]


def ask(base: str, stream: bool = False) -> str:
    messages = [{"role": "user", "content": WORDS}]
    if not stream:
        return client(base).chat.completions.create(model="m", messages=messages).choices[0].message.content
    chunks = client(base).chat.completions.create(model="m", messages=messages, stream=True)
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def refused_status(base: str) -> int | None:
    """The HTTP status of a refused request for ``m``, or None if it was served."""
    try:
        client(base, timeout=5).chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
    except openai.APIStatusError as e:
        return e.status_code
    return None


@pytest.mark.slow
def test_three_gateways_serve_through_c_survive_its_loss_and_drain_it_gracefully(cluster: Cluster):
    for name in ("a", "b", "c"):
        cluster.gateway(name)
    cluster.engine("c")
    for name in ("a", "b"):
        until(lambda: serves(cluster.base(name)), what=f"{name} learns c's engine")

    # Served through c, streaming and not, from both a and b.
    for name in ("a", "b"):
        assert ask(cluster.base(name)) == WORDS
        assert ask(cluster.base(name), stream=True) == WORDS

    # c dies hard: a and b stop offering m and answer 503 promptly (its engine went away:
    # retry later) instead of hanging.
    cluster.signal("c", signal.SIGKILL).wait(10)
    for name in ("a", "b"):
        status = until(lambda: refused_status(cluster.base(name)), timeout=3 * STATUS_INTERVAL,
                       what=f"{name} refuses m")
        assert status == 503
        assert not serves(cluster.base(name))

    # c comes back (the engine redials it): a and b serve again without a restart.
    cluster.gateway("c")
    for name in ("a", "b"):
        until(lambda: serves(cluster.base(name)), what=f"{name} learns c's engine again")
        assert ask(cluster.base(name)) == WORDS

    # A graceful stop of c lets a streamed request from a finish.
    chunks = client(cluster.base("a")).chat.completions.create(
        model="m", messages=[{"role": "user", "content": WORDS}], stream=True)
    pieces = []
    for chunk in chunks:
        if chunk.choices and chunk.choices[0].delta.content:
            if not pieces:
                cluster.signal("c", signal.SIGTERM)
            pieces.append(chunk.choices[0].delta.content)
    assert "".join(pieces) == WORDS
    cluster.processes["c"].wait(15)
    until(lambda: refused_status(cluster.base("a")), timeout=3 * STATUS_INTERVAL, what="a refuses m after c left")


# --- the same three gateways, peers found with --kube on the test API server ------------------


@pytest_twisted.inlineCallbacks
def test_three_gateways_with_kube_keep_one_receiver_per_live_peer_through_churn_and_watch_faults(tmp_path: Path):
    """In one process (so every receiver can be inspected), built from ``twistd infx --kube``
    options, each gateway reading its own POD_NAME; the pod watchers talk to the test API server
    over real HTTP with the official client."""
    from harness.kubeapi import PODS, FakeKubeAPI, write_kubeconfig
    from infx.service import GatewayService
    from infx.tap import Options
    from protocol.discovery.peers import PeerAddress

    api = FakeKubeAPI(reactor).start()
    kubeconfig = write_kubeconfig(tmp_path / "kubeconfig", api.url)
    http, worker, internal = _free_ports(3)
    app = {"app": "infx"}
    gateways: dict[str, GatewayService] = {}
    try:
        for name, host in HOSTS.items():
            api.add_live_pod(f"gw-{name}", ip=host, labels=app)
        api.add_live_pod("other", ip="127.0.0.9", labels={"app": "something-else"})
        for name, host in HOSTS.items():
            options = Options()
            options.parseOptions([
                "--kube", "--pod-label", "app=infx", "--status-interval", "0.5",
                "--http", f"tcp:{http}:interface={host}", "--worker-grpc", f"tcp:{worker}:interface={host}",
                "--internal-grpc", f"tcp:{internal}:interface={host}",
                *(["--echo-models", "m"] if name == "c" else []),
            ])
            gateway = GatewayService(reactor, options.config_value, environ={
                "POD_NAME": f"gw-{name}", "NAMESPACE": "default", "KUBECONFIG": str(kubeconfig)})
            yield gateway.startService()
            gateways[name] = gateway

        def live_peers(me: str) -> dict[str, PeerAddress]:
            out = {}
            for pod in api.list(PODS):
                metadata, status = pod["metadata"], pod.get("status", {})
                ready = any(c["type"] == "Ready" and c["status"] == "True" for c in status.get("conditions", []))
                if (metadata.get("labels", {}).get("app") == "infx" and metadata["name"] != me
                        and status.get("podIP") and status.get("phase") == "Running" and ready
                        and "deletionTimestamp" not in metadata):
                    out[metadata["name"]] = PeerAddress(status["podIP"], internal)
            return out

        def converged() -> bool:
            return all({pod: r.address for pod, r in gateway.exchanger.receivers.items()} == live_peers(f"gw-{name}")
                       for name, gateway in gateways.items())

        def remote_engines(name: str) -> int:
            return sum(n for (_, locality), n in gateways[name].processor.engine_counts().items()
                       if locality.value == "remote")

        yield poll(converged)
        yield poll(lambda: remote_engines("a") == remote_engines("b") == 1)
        reply = yield threads.deferToThread(ask, f"http://{HOSTS['a']}:{http}/v1")
        assert reply == WORDS

        # b's pod moves to an address where nothing listens, then back: receivers follow.
        receiver_a_to_b = gateways["a"].exchanger.receivers["gw-b"]
        api.set_pod_ip("gw-b", "127.0.0.5")
        yield poll(converged)
        assert gateways["a"].exchanger.receivers["gw-b"] is not receiver_a_to_b
        api.set_pod_ip("gw-b", HOSTS["b"])
        yield poll(converged)
        yield poll(lambda: all(g.exchanger.receivers["gw-b"].streams_opened == 1
                               for n, g in gateways.items() if n != "b"))

        # A pod appears; then the watches drop while it is deleted and another appears.
        api.add_live_pod("gw-d", ip="127.0.0.6", labels=app)
        yield poll(converged)
        yield api.when_watching(3)
        lists = len(api.list_requests())
        assert api.drop_watches() == 3
        api.delete_pod("gw-d")
        api.add_live_pod("gw-e", ip="127.0.0.7", labels=app)
        yield poll(converged)
        assert len(api.list_requests()) == lists  # resumed from the resourceVersion, no relist

        # The watches' resourceVersion expires (410 Gone): a relist catches up.
        yield api.when_watching(3)
        assert api.drop_watches() == 3
        api.delete_pod("gw-e")
        api.compact()
        yield poll(lambda: converged() and len(api.list_requests()) >= lists + 3)

        # c's pod starts terminating: a and b stop dialling it, c keeps lending its engine.
        api.mark_terminating("gw-c")
        yield poll(converged)
        assert "gw-c" not in gateways["a"].exchanger.receivers
        assert remote_engines("a") == 1
    finally:
        for gateway in gateways.values():
            yield gateway.stopService()
        yield api.stop()


@defer.inlineCallbacks
def poll(condition: Callable[[], bool], timeout: float = 15.0) -> Any:
    """``until`` for reactor-driven tests: waits on the reactor, never blocks it."""
    deadline = reactor.seconds() + timeout
    while not condition():
        if reactor.seconds() > deadline:
            raise AssertionError("condition not met in time")
        yield task.deferLater(reactor, 0.05, lambda: None)
