"""Exchange benchmark: what forwarding a request to a peer gateway adds to its latency.

Target from issue #6: the exchange adds at most 1 ms at p50. Two gateways and
one echo engine (no token delay) run as real ``twistd`` processes on
loopback: the engine attaches to gateway B, and B dials A, so A serves the
model through B. The same non-streaming chat request goes alternately to B
(served by its local engine) and to A (exchanged through B), over one
keep-alive HTTP connection each, so both see the same machine load.

Run: ``.venv/bin/python tools/bench/exchange_bench.py [--requests N] [--json]``.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
TWISTD = str(Path(sys.executable).with_name("twistd"))
HOST = "127.0.0.1"
BODY = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hello infx world"}]}).encode()


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def spawn(argv: list[str], log: Path) -> subprocess.Popen[bytes]:
    with open(log, "wb") as out:
        return subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT,
                                env={**os.environ, "PYTHONPATH": str(ROOT)})


def gateway(name: str, ports: dict[str, int], peers: str | None, logs: Path) -> subprocess.Popen[bytes]:
    argv = [TWISTD, "-n", "--pidfile=", "infx",
            "--http", f"tcp:{ports['http']}:interface={HOST}",
            "--worker-grpc", f"tcp:{ports['worker']}:interface={HOST}",
            "--internal-grpc", f"tcp:{ports['internal']}:interface={HOST}", "--workers", "1"]
    if peers:
        argv += ["--peers", peers]
    return spawn(argv, logs / f"{name}.log")


def models(port: int) -> list[str]:
    try:
        connection = http.client.HTTPConnection(HOST, port, timeout=2)
        connection.request("GET", "/v1/models")
        data = json.loads(connection.getresponse().read())
        connection.close()
        return [m["id"] for m in data.get("data", [])]
    except (OSError, ValueError):
        return []


def wait_for_model(port: int, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while "m" not in models(port):
        if time.monotonic() > deadline:
            raise SystemExit(f"the gateway on port {port} never served model m")
        time.sleep(0.05)


def request(connection: http.client.HTTPConnection) -> float:
    start = time.perf_counter()
    connection.request("POST", "/v1/chat/completions", BODY, {"Content-Type": "application/json"})
    response = connection.getresponse()
    body = response.read()
    elapsed = time.perf_counter() - start
    if response.status != 200:
        raise SystemExit(f"request failed: {response.status} {body[:200]!r}")
    return elapsed


def percentile(samples: list[float], p: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(p / 100 * len(ordered)))]


def run(requests: int, warmup: int) -> dict[str, Any]:
    a_ports = {k: free_port() for k in ("http", "worker", "internal")}
    b_ports = {k: free_port() for k in ("http", "worker", "internal")}
    processes: list[subprocess.Popen[bytes]] = []
    with tempfile.TemporaryDirectory(prefix="exchange-bench-") as tmp:
        logs = Path(tmp)
        try:
            processes.append(gateway("a", a_ports, None, logs))
            processes.append(gateway("b", b_ports, f"{HOST}:{a_ports['internal']}", logs))
            processes.append(spawn([TWISTD, "-n", "--pidfile=", "infx-engine", "--server",
                                    f"{HOST}:{b_ports['worker']}", "--runtime", "echo", "--models", "m",
                                    "--token-delay", "0"], logs / "engine.log"))
            wait_for_model(b_ports["http"])
            wait_for_model(a_ports["http"])
            local = http.client.HTTPConnection(HOST, b_ports["http"], timeout=10)
            exchanged = http.client.HTTPConnection(HOST, a_ports["http"], timeout=10)
            for _ in range(warmup):
                request(local)
                request(exchanged)
            samples: dict[str, list[float]] = {"local": [], "exchanged": []}
            for _ in range(requests):
                samples["local"].append(request(local))
                samples["exchanged"].append(request(exchanged))
            local.close()
            exchanged.close()
        finally:
            for process in processes:
                process.terminate()
            for process in processes:
                try:
                    process.wait(15)
                except subprocess.TimeoutExpired:
                    process.kill()
    result: dict[str, Any] = {"requests": requests}
    for name, values in samples.items():
        result[name] = {"p50_ms": statistics.median(values) * 1e3, "p99_ms": percentile(values, 99) * 1e3}
    result["added_p50_ms"] = result["exchanged"]["p50_ms"] - result["local"]["p50_ms"]
    result["added_p99_ms"] = result["exchanged"]["p99_ms"] - result["local"]["p99_ms"]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=500, help="requests per path (after warm-up)")
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    args = parser.parse_args()
    result = run(args.requests, args.warmup)
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(f"{args.requests} non-streaming chat requests per path, interleaved")
    for name in ("local", "exchanged"):
        print(f"  {name:<10} p50 {result[name]['p50_ms']:7.3f} ms   p99 {result[name]['p99_ms']:7.3f} ms")
    print(f"  exchange adds p50 {result['added_p50_ms']:+.3f} ms, p99 {result['added_p99_ms']:+.3f} ms"
          f" (target: <= 1 ms at p50)")


if __name__ == "__main__":
    main()
