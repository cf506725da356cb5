"""Measure a legitimate client while each attack of issue #13 runs against a real gateway.

Starts ``twistd -n infx`` on free loopback ports (built-in echo engine, API keys,
an internal secret; a stuck route is closed after ``--route-stuck-timeout``),
runs the legitimate client of :mod:`tools.bench.attacks` throughout (chat
completions with checked answers, ``/healthz``, a gRPC probe on both gRPC
ports), and runs every attack for ``--seconds`` on each gRPC port and the HTTP
port, one after the other (an attack the gateway cuts short is made again
until the time is up). Per attack it prints the legitimate p50/p99 latency
and failed calls during the attack, the gateway's RSS growth (peak during the
attack, over what it had before) and its RSS ``--settle`` seconds after the
attack ended, and what the attacker saw. Loopback only; bounded in time
(about ``(seconds + settle + 1) x attacks``).

    .venv/bin/python tools/bench/attack_bench.py --seconds 3
    .venv/bin/python tools/bench/attack_bench.py --only rapid-reset,zero-window --ports worker

Targets (issue #13): the gateway stays up; legitimate p99 < 250 ms during any
single attack; RSS growth < 64 MiB per attack and back within 5 s; no
legitimate call fails. Rows that miss a target are marked with ``!``.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from harness.twistd_processes import Gateway  # noqa: E402
from tools.bench import attacks  # noqa: E402
from tools.bench.attacks import LegitimateClient, Outcome, Target  # noqa: E402

MiB = 1024 * 1024
P99_TARGET = 0.250
RSS_TARGET = 64 * MiB


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=3.0, help="how long each attack runs [3]")
    parser.add_argument("--settle", type=float, default=5.0, help="seconds after an attack before RSS is read [5]")
    parser.add_argument("--only", default="", help="comma-separated attack names (default: all)")
    parser.add_argument("--ports", default="worker,internal,http", help="which ports to attack [worker,internal,http]")
    parser.add_argument("--route-stuck-timeout", default="2", help="the gateway's --route-stuck-timeout [2]")
    args = parser.parse_args()
    only = {name for name in args.only.split(",") if name}
    ports = tuple(p for p in args.ports.split(",") if p)
    with tempfile.TemporaryDirectory(prefix="attack-bench-") as tmp:
        gateway, target = start_gateway(Path(tmp), args.route_stuck_timeout)
        try:
            return run(gateway, target, ports, only, args.seconds, args.settle)
        finally:
            gateway.stop()


def start_gateway(log_dir: Path, stuck_timeout: str) -> tuple[Gateway, Target]:
    client_key, engine_key, secret = "sk-bench-client", "ek-bench-engine", "bench-peer-secret"
    keys = log_dir / "keys.yaml"
    keys.write_text(f"keys:\n  - key: {client_key}\n    tenant: default\n    admin: true\n"
                    f"engine_keys:\n  - key: {engine_key}\n    tenant: default\n")
    extra = ["--echo-models", "m", "--echo-token-delay", "0", "--internal-secret", secret,
             "--route-stuck-timeout", stuck_timeout, "--queue-timeout", "5"]
    gateway = Gateway(log_dir, api_keys=keys, admin_key=client_key, extra=extra)
    gateway.wait_for_engine(gateway.builtin_engine_id)
    return gateway, Target("127.0.0.1", gateway.http_port, gateway.worker_port, gateway.internal_port,
                           engine_key=engine_key, client_key=client_key, internal_secret=secret)


def run(gateway: Gateway, target: Target, ports: tuple[str, ...], only: set[str], seconds: float,
        settle: float) -> int:
    pid = gateway.child.process.pid
    client = LegitimateClient(target)
    client.start()
    try:
        start = time.monotonic()
        time.sleep(3.0)
        base = client.stats(start)
        print(f"baseline: {base.calls} legitimate calls, p50 {base.p50 * 1e3:.1f} ms, p99 {base.p99 * 1e3:.1f} ms, "
              f"failed {base.failures}, RSS {attacks.rss_bytes(pid) / MiB:.0f} MiB", flush=True)
        print("| attack | port | legit p50 ms | legit p99 ms | failed/calls | RSS growth MiB | RSS +5 s MiB "
              "| attacker saw |")
        print("|---|---|---:|---:|---:|---:|---:|---|", flush=True)
        missed = 0
        grpc_ports = tuple(p for p in ports if p != "http")
        for name, port, attack in attacks.catalogue(grpc_ports):
            if (only and name not in only) or port not in ports:
                continue
            missed += measure(gateway, client, target, name, port, attack, seconds, settle, pid)
            if not gateway.child.alive:
                print("! the gateway died", flush=True)
                return 2
    finally:
        client.stop()
    return 1 if missed else 0


def measure(gateway: Gateway, client: LegitimateClient, target: Target, name: str, port: str,
            attack: object, seconds: float, settle: float, pid: int) -> int:
    before = attacks.rss_bytes(pid)
    peak = [before]
    done = threading.Event()
    result: list[Outcome] = []

    def sample() -> None:
        while not done.wait(0.05):
            try:
                peak[0] = max(peak[0], attacks.rss_bytes(pid))
            except (OSError, RuntimeError):
                return

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    started = time.monotonic()
    # An attack the gateway ends early (a GOAWAY, a reset) is made again at once, by a new
    # connection, until the time is up: the legitimate client is measured under it throughout.
    total, rounds = Outcome(name), 0
    while (left := started + seconds - time.monotonic()) > 0.05 and gateway.child.alive:
        rounds += 1
        try:
            total.merge(attack(target, left))  # type: ignore[operator]
        except Exception as e:  # the attacker's own failure is a row, not the end of the run
            total.notes.append(f"attacker failed: {type(e).__name__}: {e}")
            break
    total.notes.append(f"{rounds} rounds")
    result.append(total)
    ended = time.monotonic()
    done.set()
    sampler.join()
    during = client.stats(started, ended)
    time.sleep(settle)
    after = attacks.rss_bytes(pid) if gateway.child.alive else 0
    growth = peak[0] - before
    ok = (gateway.child.alive and during.failures == 0 and during.p99 < P99_TARGET and growth < RSS_TARGET
          and after - before < RSS_TARGET / 4)
    mark = "" if ok else "! "
    print(f"| {mark}{name} | {port} | {during.p50 * 1e3:.1f} | {during.p99 * 1e3:.1f} | "
          f"{during.failures}/{during.calls} | {growth / MiB:.1f} | {(after - before) / MiB:+.1f} | "
          f"{result[0].summary()} |", flush=True)
    for note in during.notes[:2]:
        print(f"|   | | | | | | | legit failure: {note} |", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
