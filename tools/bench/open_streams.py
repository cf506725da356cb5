#!/usr/bin/env python
"""Many concurrent streaming chat requests through one real gateway, over loopback.

One ``twistd infx`` gateway; ``--engines`` engine processes
(``open_streams_engine.py``: a lean ``ProcessTasks`` client, or infx's
engine agent with ``--agent``, dialling the gateway's worker port, with a
runtime that sends one token every
``--token-interval`` milliseconds per stream, uniform in the range and
seeded, each token stamped with its send time); ``--clients`` client
processes (``open_streams_clients.py``: asyncio, one connection per stream,
small receive buffers, slow paced reads but for the latency probes) that
open ``--streams`` streams evenly over ``--ramp`` seconds and keep them open
through a measured window of ``--hold`` seconds. Every process it starts is
stopped at the end, and nothing outlives ``--seconds``.

It prints:

- streams open at peak (response headers in, end not yet seen), on a grid
  of instants ``GRID`` seconds apart, and the requests sent and not ended
  then (more, when the gateway cannot keep up: those wait in its accept
  queue or for their answer);
- memory per open stream in the gateway: its RSS (``/proc/PID/status``
  VmRSS) at the peak instant minus its RSS idle (after a warm-up round of
  streams, before the ramp), less the bytes in flight at that instant,
  divided by the streams open then (an upper bound when requests wait
  unanswered besides, since they cost memory too). Bytes in flight are measured at the
  clients, after the fact: every token whose stamp is before the instant and
  whose arrival is after it was somewhere on the way, so their sizes summed
  are an upper bound on what the gateway held then (they include the
  kernel's socket buffers and the engine's queues, which are not in the
  gateway's RSS);
- added latency per relayed event, p50/p99/max, on the probe streams (which
  read at once): arrival minus the engine's stamp, same clock; it includes
  the engine agent's send path, so it bounds what the gateway adds;
- events relayed per second in the window (all streams), against what the
  engines were asked to offer (streams / mean interval);
- the loss check: every stream got every token the engine says it sent, in
  order, and ended with ``[DONE]``; failures are counted by kind;
- CPU shares in the window: gateway, engines, clients; and the machine's
  load average, since everything shares its cores.

    .venv/bin/python tools/bench/open_streams.py                       # 10,000 streams, 50-200 ms
    .venv/bin/python tools/bench/open_streams.py --streams 2000 --token-interval 500-1000
    .venv/bin/python tools/bench/open_streams.py --json                # one JSON object
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT))

from bench_processes import BenchError, Child, bound_ports, free_port, wait_for_model  # noqa: E402
from open_streams_clients import BUCKET, GRID, grid_index  # noqa: E402

MODEL = "bench"
#: Seconds the clients get after the engines stop sending, for the ends to arrive: every
#: stream ends at once, and a gateway short of CPU takes a while to close thousands.
DRAIN_MIN = 10.0
DRAIN_PER_STREAM = 0.002
#: Targets of issue #16.
MAX_STREAM_KIB = 16.0
MAX_P99_MS = 5.0


def vm_rss(pid: int) -> int:
    """Resident set size in bytes, from ``/proc/PID/status``."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise BenchError(f"no VmRSS for {pid}")


def cpu_seconds(pid: int) -> float:
    """User plus system CPU seconds of a process, from ``/proc/PID/stat``."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_wait_seconds(pid: int) -> float | None:
    """Seconds a process was runnable but waited for a CPU (``/proc/PID/schedstat``); None if unknown."""
    try:
        return int(Path(f"/proc/{pid}/schedstat").read_text().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return None


def raise_file_limit(wanted: int) -> int:
    """The soft ``RLIMIT_NOFILE`` raised towards ``wanted`` (children inherit it); the limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        soft = target
    return soft


def drain_seconds(streams: int) -> float:
    return max(DRAIN_MIN, streams * DRAIN_PER_STREAM)


def parse_interval(text: str) -> tuple[float, float]:
    """``"50-200"`` or ``"100"`` milliseconds -> (min, max) seconds."""
    low, _, high = text.partition("-")
    bounds = float(low) / 1000, float(high or low) / 1000
    if not 0 < bounds[0] <= bounds[1]:
        raise argparse.ArgumentTypeError(f"--token-interval: want MIN-MAX milliseconds, 0 < MIN <= MAX, got {text!r}")
    return bounds


class Processes:
    """The gateway and the engines, up and serving; :meth:`stop` ends them (gateway first)."""

    def __init__(self, options: argparse.Namespace, logs: Path) -> None:
        self.children: list[Child] = []
        try:
            # Port 0 everywhere, read back from its log: no port picked here could be taken first.
            argv = [sys.executable, "-c", "from twisted.scripts.twistd import run; run()", "-n", "--pidfile=",
                    f"--logfile={logs / 'gateway.twistd.log'}", "infx",
                    "--http", "tcp:0:interface=127.0.0.1:backlog=4096",
                    "--worker-grpc", "tcp:0:interface=127.0.0.1",
                    "--internal-grpc", "tcp:0:interface=127.0.0.1", "--grace-period", "1",
                    "--workers", "1"]
            self.gateway = Child("gateway", argv, logs, stdin=subprocess.PIPE)
            self.children.append(self.gateway)
            self.http_port, worker = bound_ports(self.gateway, logs / "gateway.twistd.log")
            per_engine = math.ceil(options.streams / options.engines) + 100
            self.engines = []
            for n in range(options.engines):
                engine = Child(f"engine-{n}", [
                    sys.executable, str(HERE / "open_streams_engine.py"), "--port", str(worker),
                    "--engine-id", f"bench-engine-{n}", "--max-concurrency", str(per_engine),
                    "--seed", str(options.seed), "--min-interval", str(options.token_interval[0]),
                    "--max-interval", str(options.token_interval[1]), *(["--agent"] if options.agent else [])], logs, stdin=subprocess.PIPE)
                self.engines.append(engine)
                self.children.append(engine)
            wait_for_model(self.http_port, MODEL, self.children)
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        for child in self.children:
            child.stop()


def run_clients(options: argparse.Namespace, port: int, logs: Path, streams: int, clients: int, start_at: float,
                ramp: float, until: float, window: tuple[float, float], deadline: float,
                tag: str) -> list[dict[str, Any]]:
    """Client processes sharing ``streams`` (ids interleaved); their reports once all have exited."""
    children = []
    try:
        for n in range(min(clients, streams)):
            share = streams // clients + (n < streams % clients)
            children.append(Child(f"clients-{tag}-{n}", [
                sys.executable, str(HERE / "open_streams_clients.py"), "--port", str(port),
                "--streams", str(share), "--first-id", str(n), "--step", str(clients),
                "--probe-every", str(options.probe_every), "--start-at", repr(start_at), "--ramp", repr(ramp),
                "--until", repr(until), "--window-start", repr(window[0]), "--window-end", repr(window[1]),
                "--deadline", repr(deadline), "--read-pause", str(options.read_pause),
                "--rcvbuf", str(options.rcvbuf)], logs, stdin=subprocess.PIPE, stdout=subprocess.PIPE))
        return [collect(child, deadline) for child in children]
    finally:
        for child in children:
            child.stop()


def collect(child: Child, deadline: float) -> dict[str, Any]:
    try:
        out, _ = child.process.communicate(timeout=max(1.0, deadline - time.monotonic() + 5))
    except subprocess.TimeoutExpired:
        raise BenchError(f"{child.name} did not report by its deadline: {child.log_tail()}") from None
    lines = out.decode().strip().splitlines()
    if child.process.returncode != 0 or not lines:
        raise BenchError(f"{child.name} failed ({child.process.returncode}): {child.log_tail()}")
    report: dict[str, Any] = json.loads(lines[-1])
    return report


def merged(reports: list[dict[str, Any]], key: str) -> dict[int, int]:
    out: dict[int, int] = {}
    for report in reports:
        for k, v in report[key].items():
            out[int(k)] = out.get(int(k), 0) + v
    return out


def percentile(histogram: dict[int, int], q: float) -> float | None:
    """The ``q`` quantile in milliseconds of a histogram of ``BUCKET``-second buckets (bucket tops)."""
    total = sum(histogram.values())
    if not total:
        return None
    rank, seen = q * total, 0
    for bucket in sorted(histogram):
        seen += histogram[bucket]
        if seen >= rank:
            return (bucket + 1) * BUCKET * 1000
    return (max(histogram) + 1) * BUCKET * 1000


def measure(options: argparse.Namespace, logs: Path) -> dict[str, Any]:
    """One run (see the module docstring); the figures as one dict."""
    hard_end = time.monotonic() + options.seconds
    fd_limit = raise_file_limit(options.streams + 2000)
    load_before = os.getloadavg()[0]
    processes = Processes(options, logs)
    try:
        gateway_pid = processes.gateway.process.pid
        engine_pids = [engine.process.pid for engine in processes.engines]
        # A warm-up round: the first requests' imports and caches are not a stream's cost.
        now = time.monotonic()
        # Small next to the run: memory its streams leave in the allocator's pools is not counted per stream.
        warm = max(1, min(100, options.streams // 20))
        warm_reports = run_clients(options, processes.http_port, logs, warm, 1, now, 0.2, now + 1.0,
                                   (now, now), min(hard_end, now + 20), "warmup")
        if any(r["failures"] for r in warm_reports):
            raise BenchError(f"warm-up streams failed: {warm_reports[0]['failure_samples']}")
        time.sleep(1.0)
        idle = []
        for _ in range(3):
            time.sleep(0.1)
            idle.append(vm_rss(gateway_pid))
        idle_rss = min(idle)
        start_at = time.monotonic() + 1.0
        window = (start_at + options.ramp + options.settle, start_at + options.ramp + options.settle + options.hold)
        until = window[1] + 0.5
        deadline = min(until + drain_seconds(options.streams), hard_end - 5)
        samples: dict[int, int] = {}
        cpu: dict[str, list[float]] = {}

        def sample_cpu(label: str) -> None:
            cpu[label] = [cpu_seconds(gateway_pid), *(cpu_seconds(p) for p in engine_pids)]
            cpu[label + "_wait"] = [cpu_wait_seconds(gateway_pid) or 0.0]

        def sampler() -> None:
            k = grid_index(start_at) + 1
            window_marks = {grid_index(window[0]) + 1: "start", grid_index(window[1]): "end"}
            while k * GRID < until and time.monotonic() < hard_end:
                delay = k * GRID - time.monotonic()
                if delay > 0:
                    time.sleep(delay)
                try:
                    samples[k] = vm_rss(gateway_pid)
                    if k in window_marks:
                        sample_cpu(window_marks[k])
                        cpu[window_marks[k] + "_at"] = [k * GRID]
                except (OSError, BenchError):
                    return
                k += 1

        thread = threading.Thread(target=sampler, daemon=True)
        thread.start()
        reports = run_clients(options, processes.http_port, logs, options.streams, options.clients, start_at,
                              options.ramp, until, window, deadline, "main")
        thread.join(timeout=5)
        load_after = os.getloadavg()[0]
    finally:
        processes.stop()
    return summarise(options, reports, samples, idle_rss, cpu, window, fd_limit, (load_before, load_after))


def summarise(options: argparse.Namespace, reports: list[dict[str, Any]], samples: dict[int, int], idle_rss: int,
              cpu: dict[str, list[float]], window: tuple[float, float], fd_limit: int,
              load: tuple[float, float]) -> dict[str, Any]:
    open_at = merged(reports, "open_streams")
    sent_at = merged(reports, "sent_streams")
    inflight = merged(reports, "inflight_bytes")
    latency = merged(reports, "latency_buckets")
    failures: dict[str, int] = {}
    for report in reports:
        for kind, count in report["failures"].items():
            failures[kind] = failures.get(kind, 0) + count
    measured = [k for k in samples if open_at.get(k)]
    out: dict[str, Any] = {
        "streams": options.streams, "token_interval_ms": [x * 1000 for x in options.token_interval],
        "engines": options.engines, "clients": options.clients, "fd_limit": fd_limit,
        "completed": sum(r["completed"] for r in reports), "answered": sum(r["opened"] for r in reports),
        "failures": failures,
        "failure_samples": [s for r in reports for s in r["failure_samples"]][:5],
        "tokens": sum(r["tokens"] for r in reports), "idle_rss_mib": idle_rss / 2**20,
        "load_average": list(load), "window_s": window[1] - window[0],
    }
    if measured:
        peak = max(measured, key=lambda k: (open_at[k], samples[k]))
        streams = open_at[peak]
        rss = samples[peak]
        out.update(peak_open_streams=streams, requests_held_at_peak=sent_at.get(peak, 0), peak_rss_mib=rss / 2**20,
                   inflight_bytes_at_peak=inflight.get(peak, 0),
                   raw_kib_per_stream=(rss - idle_rss) / streams / 1024,
                   kib_per_stream=(rss - idle_rss - inflight.get(peak, 0)) / streams / 1024,
                   max_rss_mib=max(samples.values()) / 2**20)
    window_s = window[1] - window[0]
    events = sum(r["events_in_window"] for r in reports)
    mean_interval = sum(options.token_interval) / 2
    out.update(events_per_s=events / window_s, offered_events_per_s=out.get("peak_open_streams", 0) / mean_interval,
               latency_p50_ms=percentile(latency, 0.5), latency_p99_ms=percentile(latency, 0.99),
               latency_max_ms=percentile(latency, 1.0), latency_samples=sum(latency.values()),
               client_cpu_s=sum(r["cpu_s"] for r in reports))
    if "start" in cpu and "end" in cpu:
        seconds = cpu["end_at"][0] - cpu["start_at"][0]
        shares = [(b - a) / seconds for a, b in zip(cpu["start"], cpu["end"])]
        out.update(gateway_cpu=shares[0], engines_cpu=sum(shares[1:]),
                   events_per_gateway_cpu_s=events / (shares[0] * seconds) if shares[0] else None,
                   gateway_cpu_wait=(cpu["end_wait"][0] - cpu["start_wait"][0]) / seconds)
    return out


def report_text(out: dict[str, Any]) -> None:
    def f(key: str, spec: str = ",.1f") -> str:
        value = out.get(key)
        return "-" if value is None else format(value, spec)

    lo, hi = out["token_interval_ms"]
    print(f"{out['streams']:,} streams, a token every {lo:g}-{hi:g} ms per stream, {out['engines']} engine "
          f"process(es), {out['clients']} client process(es), {os.cpu_count()} cores, load average "
          f"{out['load_average'][0]:.1f} before / {out['load_average'][1]:.1f} after")
    print(f"streams open at peak:        {f('peak_open_streams', ',.0f')} (requests sent and not ended then: "
          f"{f('requests_held_at_peak', ',.0f')}; {out['answered']:,} of {out['streams']:,} were ever answered)")
    print(f"gateway RSS idle / at peak:  {f('idle_rss_mib')} / {f('peak_rss_mib')} MiB "
          f"(max in the run {f('max_rss_mib')} MiB)")
    print(f"bytes in flight at peak:     {f('inflight_bytes_at_peak', ',.0f')} (upper bound, measured at the clients)")
    print(f"memory per open stream:      {f('kib_per_stream', ',.2f')} KiB excluding bytes in flight "
          f"({f('raw_kib_per_stream', ',.2f')} KiB including them); target <= {MAX_STREAM_KIB:g} KiB")
    print(f"added latency per event:     p50 {f('latency_p50_ms', '.2f')} ms, p99 {f('latency_p99_ms', '.2f')} ms, "
          f"max {f('latency_max_ms', '.2f')} ms over {f('latency_samples', ',.0f')} probe events; "
          f"target p99 <= {MAX_P99_MS:g} ms")
    print(f"events relayed per second:   {f('events_per_s', ',.0f')} (offered {f('offered_events_per_s', ',.0f')}) "
          f"over {out['window_s']:g} s; {f('events_per_gateway_cpu_s', ',.0f')} per gateway CPU second")
    print(f"CPU share in the window:     gateway {f('gateway_cpu', '.0%')} (runnable but waiting for a CPU "
          f"{f('gateway_cpu_wait', '.0%')}), engines {f('engines_cpu', '.0%')}; clients {f('client_cpu_s', '.1f')} "
          "CPU s in the whole run")
    failed = sum(out["failures"].values())
    print(f"loss check:                  {out['completed']:,} of {out['streams']:,} streams complete and in order, "
          f"{out['tokens']:,} tokens; {failed} failed {out['failures'] or ''}")
    for sample in out["failure_samples"]:
        print(f"  e.g. {sample}")


def options_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=10000, help="concurrent streams (default 10,000)")
    parser.add_argument("--token-interval", type=parse_interval, default=(0.05, 0.2),
                        help="milliseconds between a stream's tokens, MIN-MAX uniform or one value (default 50-200)")
    parser.add_argument("--engines", type=int, default=2, help="engine processes (default 2)")
    parser.add_argument("--agent", action="store_true",
                        help="engines run infx's engine agent (the lean ProcessTasks client by default)")
    parser.add_argument("--clients", type=int, default=4, help="client processes (default 4)")
    parser.add_argument("--ramp", type=float, help="seconds over which the streams open (default streams / 1,000)")
    parser.add_argument("--settle", type=float, help="seconds between the ramp's end and the measured window, for "
                        "streams that open late on a busy machine (default: the ramp's length, at least 1)")
    parser.add_argument("--hold", type=float, default=10.0, help="measured seconds with every stream open")
    parser.add_argument("--seconds", type=float, default=150.0, help="hard bound on the whole run (default 150)")
    parser.add_argument("--probe-every", type=int, default=20, help="every N-th stream reads at once (latency)")
    parser.add_argument("--read-pause", type=float, default=0.1, help="slow readers' pause after each read (s)")
    parser.add_argument("--rcvbuf", type=int, default=4096, help="clients' SO_RCVBUF in bytes")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", action="store_true", help="one JSON object")
    parser.add_argument("--logs", type=Path, help="keep every process's log in this directory")
    return parser


def main(argv: list[str]) -> int:
    parser = options_parser()
    options = parser.parse_args(argv)
    if options.ramp is None:
        options.ramp = max(1.0, options.streams / 1000)
    if options.settle is None:
        options.settle = max(1.0, options.ramp)
    needed = 10 + options.ramp + options.settle + options.hold + 0.5 + drain_seconds(options.streams)
    if options.seconds < needed:
        parser.error(f"--seconds {options.seconds:g} is too short for this ramp and hold (needs {needed:g})")
    with tempfile.TemporaryDirectory(prefix="open_streams-") as tmp:
        logs = Path(tmp) if options.logs is None else options.logs.resolve()
        logs.mkdir(parents=True, exist_ok=True)
        try:
            out = measure(options, logs)
        except BenchError as error:
            print(f"error: {error}", file=sys.stderr)
            return 1
    if options.json:
        print(json.dumps(out))
    else:
        report_text(out)
    return 0 if not out["failures"] and out["completed"] == options.streams else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
