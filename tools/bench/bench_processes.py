"""The processes a loopback benchmark starts: ports, children that die with it, waiting for a model.

Shared by ``http_bench.py``, ``open_streams.py`` and ``peers.py`` (each
runs as a script with this directory on ``sys.path``).
"""

from __future__ import annotations

import ctypes
import http.client
import json
import os
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import IO, Any

ROOT = Path(__file__).resolve().parent.parent.parent
PR_SET_PDEATHSIG = 1


class BenchError(Exception):
    """A process of the benchmark failed to start, answer or measure."""


def die_with_parent() -> None:
    """In the child before exec: get SIGTERM when the benchmark dies, even by SIGKILL (Linux only)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        pass


def free_port() -> int:
    """A port free right now on 127.0.0.1 (the child binds it a moment later)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Child:
    """A subprocess whose output goes to a log file, stopped with SIGTERM (then SIGKILL).

    ``popen`` goes to :class:`subprocess.Popen` (``stdin``/``stdout`` pipes, ``env``, ``cwd``: this
    checkout unless given); a piped stdin is closed when the child is stopped.
    """

    def __init__(self, name: str, argv: list[str], logs: Path, **popen: Any) -> None:
        self.name = name
        self.log_path = logs / f"{name}.log"
        self._log = open(self.log_path, "wb")
        # The repository on the path for infx's processes; a process given its own env gets only that.
        env = popen.pop("env", None) or {
            **os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
        popen.setdefault("stdout", self._log)
        popen.setdefault("cwd", ROOT)
        self.process = subprocess.Popen(argv, env=env, stderr=self._log, preexec_fn=die_with_parent, **popen)

    def log_tail(self) -> str:
        return self.log_path.read_text(errors="replace")[-3000:]

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        stdin: IO[bytes] | None = self.process.stdin
        if stdin is not None:
            stdin.close()
        self._log.close()


def bound_ports(gateway: Child, log: Path, workers: int = 1, timeout: float = 60.0) -> tuple[int, int]:
    """The HTTP and engine-facing ports a gateway on port 0 bound, from the line its log says them in
    (one process's, or with ``workers`` a supervisor's; the script puts the checkout on ``sys.path``)."""
    from harness.twistd_processes import gateway_ports, supervisor_ports

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if gateway.process.poll() is not None:
            raise BenchError(f"{gateway.name} exited with {gateway.process.returncode}: {gateway.log_tail()}")
        said = log.read_text(errors="replace") if log.exists() else ""
        found = supervisor_ports(said) if workers > 1 else gateway_ports(said)
        if found is not None:
            return found[0], found[1]
        time.sleep(0.05)
    raise BenchError(f"{gateway.name} said no ports after {timeout:g} s: {gateway.log_tail()}")


def wait_for_model(port: int, model: str, children: list[Child], timeout: float = 60.0) -> None:
    """Until ``GET /v1/models`` on ``port`` lists ``model``, i.e. an engine has registered."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for child in children:
            if child.process.poll() is not None:
                raise BenchError(f"{child.name} exited with {child.process.returncode}: {child.log_tail()}")
        try:
            connection = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            connection.request("GET", "/v1/models")
            response = connection.getresponse()
            body = response.read()
            connection.close()
            if response.status == 200 and any(m.get("id") == model for m in json.loads(body)["data"]):
                return
        except (OSError, ValueError, KeyError):
            pass
        time.sleep(0.1)
    raise BenchError(f"no engine serving {model!r} on port {port} after {timeout:g} s")


def wait_until_answers(port: int, model: str, children: list[Child], timeout: float = 60.0) -> None:
    """Until a chat completion for ``model`` on ``port`` answers 200: the whole path serves, not just its port."""
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "ready?"}]})
    deadline = time.monotonic() + timeout
    last = "no answer"
    while time.monotonic() < deadline:
        for child in children:
            if child.process.poll() is not None:
                raise BenchError(f"{child.name} exited with {child.process.returncode}: {child.log_tail()}")
        try:
            connection = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            connection.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
            response = connection.getresponse()
            answer = response.read()
            connection.close()
            if response.status == 200:
                return
            last = f"HTTP {response.status}: {answer[:200]!r}"
        except OSError as error:
            last = str(error)
        time.sleep(0.1)
    raise BenchError(f"no chat completion for {model!r} on port {port} after {timeout:g} s ({last})")
