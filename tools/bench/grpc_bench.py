#!/usr/bin/env python
"""Benchmark infx's gRPC stack against grpclib and grpcio over loopback.

Each implementation runs its server and its client in separate processes and
moves raw bytes (no protobuf cost). Three tests: unary round trips/s with a
100 B payload, one-way client-streamed 1 KiB messages/s, and client-streamed
1 MiB messages as MB/s. Each (implementation, test) runs ``--repeats`` times
and the median is reported; the implementations alternate within each
repetition (in a rotating order) so that machine noise hits all of them alike.

    .venv/bin/python tools/bench/grpc_bench.py            # table with ratios
    .venv/bin/python tools/bench/grpc_bench.py --json     # one JSON object per line
    .venv/bin/python tools/bench/grpc_bench.py --quick    # smoke run

Internally the same script is the server (``serve IMPL``) and the client
(``run IMPL TEST PORT DURATION``) of one implementation.
"""

from __future__ import annotations

import argparse
import importlib
import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import IO

from bench_common import TESTS, Result

IMPLS = ["infx", "grpclib", "grpcio"]
# The targets infx is held to, as multiples of grpclib's median.
TARGETS = {"unary": 1.2, "stream_1k": 1.2, "stream_1m": 1.5}
SCRIPT = str(Path(__file__).resolve())


class BenchError(Exception):
    """A server or client process of one implementation failed."""


class ServerProcess:
    """One implementation's server, alive until ``stop``; it exits when its stdin closes."""

    def __init__(self, impl: str) -> None:
        self.impl = impl
        self._process = subprocess.Popen(
            [sys.executable, SCRIPT, "serve", impl],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )
        stdout: IO[str] = self._process.stdout  # type: ignore[assignment]
        line = stdout.readline()
        if not line.strip().isdigit():
            self.stop()
            raise BenchError(f"{impl} server did not start (exit status {self._process.returncode})")
        self.port = int(line)

    def stop(self) -> None:
        stdin: IO[str] = self._process.stdin  # type: ignore[assignment]
        stdin.close()
        try:
            self._process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()


def run_client(impl: str, test: str, port: int, duration: float) -> Result:
    process = subprocess.run(
        [sys.executable, SCRIPT, "run", impl, test, str(port), str(duration)],
        capture_output=True, text=True, timeout=duration + 60,
    )
    lines = process.stdout.strip().splitlines()
    if process.returncode != 0 or not lines:
        raise BenchError(f"{impl} {test} client failed ({process.returncode}): {process.stderr.strip()[-2000:]}")
    return Result(**json.loads(lines[-1]))


def measure(impls: list[str], tests: list[str], repeats: int, duration: float) -> dict[tuple[str, str], list[float]]:
    """Rates per (impl, test); an implementation whose server or client fails is reported and dropped."""
    servers: dict[str, ServerProcess] = {}
    rates: dict[tuple[str, str], list[float]] = {}
    try:
        for impl in impls:
            try:
                servers[impl] = ServerProcess(impl)
            except BenchError as error:
                print(f"error: {error}", file=sys.stderr)
        for repeat in range(repeats):
            order = [impl for impl in impls[repeat % len(impls):] + impls[:repeat % len(impls)] if impl in servers]
            for test in tests:
                for impl in order:
                    try:
                        result = run_client(impl, test, servers[impl].port, duration)
                    except (BenchError, subprocess.TimeoutExpired) as error:
                        print(f"error: {error}", file=sys.stderr)
                        continue
                    rates.setdefault((impl, test), []).append(result.rate(test))
    finally:
        for server in servers.values():
            server.stop()
    return rates


def report_json(impls: list[str], tests: list[str], rates: dict[tuple[str, str], list[float]]) -> None:
    for test in tests:
        for impl in impls:
            runs = rates.get((impl, test))
            median = statistics.median(runs) if runs else None
            print(json.dumps({"impl": impl, "test": test, "median": median, "unit": TESTS[test][1]}))


def report_table(impls: list[str], tests: list[str], rates: dict[tuple[str, str], list[float]], repeats: int) -> None:
    medians = {key: statistics.median(runs) for key, runs in rates.items()}

    def ratio(test: str, other: str) -> str:
        if ("infx", test) in medians and (other, test) in medians:
            return f"{medians['infx', test] / medians[other, test]:.2f}x"
        return "-"

    header = ["test", "unit", *impls, "infx/grpclib", "infx/grpcio", "target (infx/grpclib)"]
    rows = [header]
    for test in tests:
        cells = [test, TESTS[test][1]]
        cells += [f"{medians[impl, test]:,.1f}" if (impl, test) in medians else "failed" for impl in impls]
        cells += [ratio(test, "grpclib"), ratio(test, "grpcio")]
        if ("infx", test) in medians and ("grpclib", test) in medians:
            met = medians["infx", test] >= TARGETS[test] * medians["grpclib", test]
            cells.append(f">= {TARGETS[test]}x: {'met' if met else 'MISSED'}")
        else:
            cells.append(f">= {TARGETS[test]}x: -")
        rows.append(cells)
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    print(f"medians of {repeats}, loopback, client and server in separate processes")
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip())


def main(argv: list[str]) -> int:
    if argv[:1] == ["serve"]:
        importlib.import_module(f"bench_{argv[1]}").serve()
        return 0
    if argv[:1] == ["run"]:
        impl, test, port, seconds = argv[1:5]
        importlib.import_module(f"bench_{impl}").run(test, int(port), float(seconds)).emit()
        return 0

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="one JSON object per (impl, test) line")
    parser.add_argument("--quick", action="store_true", help="smoke run: one repetition of 0.3 s")
    parser.add_argument("--duration", type=float, help="seconds per client run (default 2.5, quick 0.3)")
    parser.add_argument("--repeats", type=int, help="repetitions; the median is reported (default 3, quick 1)")
    parser.add_argument("--impls", default=",".join(IMPLS), help="comma-separated subset of " + ",".join(IMPLS))
    parser.add_argument("--tests", default=",".join(TESTS), help="comma-separated subset of " + ",".join(TESTS))
    options = parser.parse_args(argv)
    impls = options.impls.split(",")
    tests = options.tests.split(",")
    unknown = sorted(set(impls) - set(IMPLS)) + sorted(set(tests) - set(TESTS))
    if unknown:
        parser.error(f"unknown: {', '.join(unknown)}")
    duration = options.duration if options.duration is not None else (0.3 if options.quick else 2.5)
    repeats = options.repeats if options.repeats is not None else (1 if options.quick else 3)

    rates = measure(impls, tests, repeats, duration)
    if options.json:
        report_json(impls, tests, rates)
    else:
        report_table(impls, tests, rates, repeats)
    return 0 if all((impl, test) in rates for impl in impls for test in tests) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
