"""Real ``twistd -n infx`` and ``twistd -n infx-engine`` child processes for end-to-end tests.

Each child runs on loopback ports (a gateway on the kernel's picks, read back from
its log) with its output in a log file, so a failing test can show what the process said. Readiness is polled over HTTP
(``/readyz``, ``/admin/status``) with a deadline; a child that dies while it
is awaited fails the wait at once with its log. ``stop()`` kills whatever is
still running, so fixtures can always call it in teardown.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from infx.gateway.runtime_engines import runtime_engine_id
from infx.service import builtin_engine_id
from protocol.exchange.accepted_peer import peer_engine_id

ROOT = Path(__file__).resolve().parents[1]
TWISTD = str(Path(sys.executable).with_name("twistd"))
#: Seconds a child gets to come up or to reach a state the test waits for.
STARTUP_TIMEOUT = 20.0


def free_port() -> int:
    """A loopback port nobody listens on right now (the kernel's pick)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


#: The supervisor's line saying where ``twistd infx --workers N`` listens (its ports, port 0's included).
SUPERVISOR_LISTENING = re.compile(r"\d+ workers share the HTTP API's port \S+?:(\d+) and the engines' port "
                                  r"\S+?:(\d+); their peer ports are \S+?:([\d,]+), one each")


#: One gateway process's line saying where ``twistd infx`` listens (port 0's pick included).
GATEWAY_LISTENING = re.compile(r"listening: HTTP API on \S+:(\d+), engines on \S+:(\d+), peers on \S+:(\d+)")


def gateway_ports(log: str) -> tuple[int, int, int] | None:
    """The HTTP, engine-facing and internal port one gateway process bound, from its log."""
    found = GATEWAY_LISTENING.search(log)
    if found is None:
        return None
    return int(found.group(1)), int(found.group(2)), int(found.group(3))


def supervisor_ports(log: str) -> tuple[int, int, tuple[int, ...]] | None:
    """The HTTP, engine-facing and each worker's internal port a supervisor bound, from its log."""
    found = SUPERVISOR_LISTENING.search(log)
    if found is None:
        return None
    return int(found.group(1)), int(found.group(2)), tuple(int(p) for p in found.group(3).split(","))


def children_of(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (a supervisor's workers)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                found.append(int(entry.name))
    return sorted(found)


def http_get(url: str, headers: dict[str, str] | None = None, timeout: float = 5.0) -> tuple[int, bytes]:
    """Status and body of a GET; error statuses are returned, not raised."""
    request = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


class ChildDied(AssertionError):
    """A child process exited while the test still needed it."""


class TwistdChild:
    """One ``twistd -n`` process; stdout and stderr go to ``log_path``."""

    def __init__(self, name: str, args: Sequence[str], log_dir: Path, env: dict[str, str] | None = None,
                 twistd: str = TWISTD) -> None:
        """``twistd``: another checkout's (with ``PYTHONPATH`` in ``env``: a baseline's processes)."""
        self.name = name
        self.log_path = log_dir / f"{name}.log"
        argv = [twistd, "-n", "--pidfile=", *args]
        child_env = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
        with self.log_path.open("wb") as log:
            self.process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=child_env)

    @property
    def alive(self) -> bool:
        return self.process.poll() is None

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")

    def signal(self, sig: int) -> None:
        self.process.send_signal(sig)

    def kill(self) -> None:
        """SIGKILL: the process gets no chance to say goodbye (a crash, an OOM kill)."""
        if self.alive:
            self.process.send_signal(signal.SIGKILL)
        self.process.wait(timeout=10)

    def wait(self, timeout: float) -> int:
        return self.process.wait(timeout=timeout)

    def stop(self) -> None:
        if self.alive:
            self.process.send_signal(signal.SIGKILL)
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass

    def check_alive(self) -> None:
        if not self.alive:
            raise ChildDied(f"{self.name} exited with {self.process.returncode}:\n{self.output()[-4000:]}")


def wait_until(predicate: Callable[[], Any], what: str, children: Sequence[TwistdChild] = (),
               timeout: float = STARTUP_TIMEOUT) -> Any:
    """Poll ``predicate`` until it returns something truthy; fail on timeout or if a child dies."""
    deadline = time.monotonic() + timeout
    while True:
        for child in children:
            child.check_alive()
        try:
            value = predicate()
        except (OSError, urllib.error.URLError):
            value = None
        if value:
            return value
        if time.monotonic() > deadline:
            logs = "\n".join(f"--- {c.name}:\n{c.output()[-3000:]}" for c in children)
            raise AssertionError(f"timed out waiting for {what}\n{logs}")
        time.sleep(0.05)


class Gateway:
    """``twistd -n infx`` on loopback ports (HTTP API, engine-facing and peer-facing gRPC)."""

    def __init__(self, log_dir: Path, *, api_keys: Path | None = None, admin_key: str | None = None,
                 extra: Sequence[str] = (), name: str = "gateway", same_ports_as: Gateway | None = None,
                 ports: tuple[int, int, int] | None = None, env: dict[str, str] | None = None,
                 wait: bool = True, workers: int = 1, twistd: str = TWISTD) -> None:
        """``same_ports_as``: listen where that (dead) gateway did, as a restarted process would;
        ``ports``: the HTTP, worker and internal ports picked beforehand (for a test that must
        name them before the gateway runs); ``env``: more environment for the child
        (``KUBECONFIG``, ``POD_NAME``); without ``wait`` the caller waits for ``/readyz``
        itself (a test whose reactor serves the gateway's needs); ``workers``: ``--workers``
        (1, one process, unless a test is about workers; worker i's internal port is the
        internal port plus i, or the kernel's pick: see below); ``twistd``: another checkout's,
        which gets ``ports`` (an older infx may not name itself by an internal port 0).

        Without ports, the gateway binds port 0 everywhere and the harness reads the ports it
        got from its log (one process's ``listening:`` line, a supervisor's line for its
        workers), so no other process can take one first; its peers are given them once it runs."""
        self.admin_key = admin_key
        self.workers = workers
        if same_ports_as is not None:
            ports = (same_ports_as.http_port, same_ports_as.worker_port, same_ports_as.internal_port)
        self.http_port, self.worker_port, self.internal_port = ports or (0, 0, 0)
        #: Each worker's internal port, by index.
        self.internal_ports: tuple[int, ...] = tuple(self.internal_port + i for i in range(workers))
        args = ["infx", "--http", f"tcp:{self.http_port}:interface=127.0.0.1",
                "--worker-grpc", f"tcp:{self.worker_port}:interface=127.0.0.1",
                "--internal-grpc", f"tcp:{self.internal_port}:interface=127.0.0.1",
                "--workers", str(workers), *extra]
        if api_keys is not None:
            args += ["--api-keys", str(api_keys)]
        self.child = TwistdChild(name, args, log_dir, env, twistd)
        if ports is None and workers > 1:
            bound = wait_until(lambda: supervisor_ports(self.child.output()), "the supervisor's ports", [self.child])
            self.http_port, self.worker_port, self.internal_ports = bound
            self.internal_port = self.internal_ports[0]
        elif ports is None:
            bound = wait_until(lambda: gateway_ports(self.child.output()), "the gateway's ports", [self.child])
            self.http_port, self.worker_port, self.internal_port = bound
            self.internal_ports = (self.internal_port,)
        if wait:
            wait_until(lambda: self.readyz() == 200, "the gateway's /readyz", [self.child])

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    @property
    def base_url(self) -> str:
        """What the openai client takes as ``base_url``."""
        return self.url + "/v1"

    @property
    def worker_address(self) -> str:
        return f"127.0.0.1:{self.worker_port}"

    @property
    def pod_name(self) -> str:
        """How the gateway names itself to its peers: without POD_NAME, its internal endpoint's address."""
        return f"127.0.0.1:{self.internal_port}"

    @property
    def builtin_engine_id(self) -> str:
        """The id of its built-in echo engine (``--echo-models``)."""
        return builtin_engine_id(self.pod_name)

    def runtime_engine_id(self, name: str) -> str:
        """The id of its engine for the runtime by URL ``name`` (``HOST:PORT``, or a runtime pod's name)."""
        return runtime_engine_id(name, self.pod_name)

    def worker_pod_name(self, index: int) -> str:
        """How worker ``index`` of ``--workers N`` names itself: its own internal port's address."""
        return f"127.0.0.1:{self.internal_ports[index]}"

    def remote_engine_id(self, engine_id: str) -> str:
        """What the engine ``engine_id`` attached to this gateway is named at its peers."""
        return peer_engine_id(engine_id, self.pod_name)

    def readyz(self) -> int:
        return http_get(self.url + "/readyz")[0]

    def status(self) -> dict[str, Any]:
        """The processor's dump from ``/admin/status``."""
        headers = {"Authorization": f"Bearer {self.admin_key}"} if self.admin_key else {}
        code, body = http_get(self.url + "/admin/status", headers)
        assert code == 200, body
        result: dict[str, Any] = json.loads(body)
        return result

    def engines(self, tenant: str = "default") -> dict[str, Any]:
        engines: dict[str, Any] = self.status()["tenants"].get(tenant, {}).get("engines", {})
        return engines

    def wait_for_engine(self, engine_id: str, tenant: str = "default", children: Sequence[TwistdChild] = (),
                        models_ready: bool = True) -> None:
        """Until the engine is registered with every model ready (or, without ``models_ready``,
        registered at all: its runtime may not answer yet)."""

        def ready() -> bool:
            engine = self.engines(tenant).get(engine_id)
            if not models_ready:
                return bool(engine)
            return bool(engine and engine["ready"] and engine["models"] and all(m["ready"] for m in engine["models"]))

        wait_until(ready, f"engine {engine_id} to register", [self.child, *children])

    def wait_until_idle(self) -> dict[str, Any]:
        """Until no task is in the processor at all; returns that status dump."""
        status: dict[str, Any] = wait_until(lambda: (s := self.status())["tasks"] == 0 and s, "no task in flight",
                                            [self.child])
        return status

    def stop(self) -> None:
        self.child.stop()


class Engine:
    """``twistd -n infx-engine`` connected to a :class:`Gateway`; waits until it registered."""

    def __init__(self, log_dir: Path, gateway: Gateway, engine_id: str, models: Sequence[str], *,
                 runtime: str = "echo", upstream: str | None = None, token_delay: float | None = None,
                 key: str | None = None, tenant: str = "default", extra: Sequence[str] = (),
                 env: dict[str, str] | None = None, models_ready: bool = True, twistd: str = TWISTD) -> None:
        """``models`` may be empty with the openai runtime (it serves what its runtime lists);
        ``models_ready=False`` waits only for the engine to register (its runtime may be down)."""
        self.engine_id = engine_id
        args = ["infx-engine", "--server", gateway.worker_address, "--engine-id", engine_id, "--runtime", runtime,
                *extra]
        if models:
            args += ["--models", ",".join(models)]
        if upstream is not None:
            args += ["--upstream", upstream]
        if token_delay is not None:
            args += ["--token-delay", str(token_delay)]
        # The key travels in the environment, as the option's help recommends.
        child_env = {"INFX_ENGINE_KEY": key} if key else {}
        self.child = TwistdChild(f"engine-{engine_id}", args, log_dir, {**child_env, **(env or {})}, twistd)
        try:
            gateway.wait_for_engine(engine_id, tenant, [self.child], models_ready=models_ready)
        except BaseException:
            self.child.stop()  # the caller never gets this object to stop: no process outlives the test
            raise

    def stop(self) -> None:
        self.child.stop()
