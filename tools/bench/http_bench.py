#!/usr/bin/env python
"""Benchmark the HTTP gateway against a runtime with no gateway, over loopback.

Three targets serve the same non-streaming chat requests:

- ``direct`` (a): the lean echo server of ``http_echo_server.py``, alone
  (the baseline: a runtime with no gateway);
- ``agent`` (b): ``twistd infx`` plus ``twistd infx-engine --runtime openai``
  pointed at that echo server (the real deployment shape);
- ``builtin`` (c): ``twistd infx --echo-models`` (the built-in echo engine,
  which runs inside the gateway's process);
- ``litellm`` (d), with ``--litellm``: the LiteLLM proxy (one worker) in front
  of the same echo server, the alternative issue #16 compares with. It is
  installed once, pinned, into its own venv (``tools/bench/.venv-litellm``,
  not in git) and started with its cost map read locally and telemetry off.

Each is measured at concurrency 1 (latency) and 32 (requests/s and
latency). Streamed answers (server-sent events/s) are relayed by (c), as
issue #5 asks, and by (b), whose echo server sends each stream at once: the
built-in engine paces its tokens (10 ms apart) and runs at most 32 tasks,
so (c) cannot offer more than about 3,200 events/s whatever the gateway
does, while (b) is limited only by the processes on the path. The CPU time
the server (gateway or echo server) and the engine agent used inside each
measured window is read from ``/proc``: ``per_server_cpu_s`` (requests or
events per CPU second of the server process) is what one fully busy core
would do, a figure that holds up when other work shares the machine, and
``server_cpu_wait`` is the share of the window the server was runnable but
waited for a CPU (high means the machine, not the server, set the pace).
Every process is separate: echo server, gateways, engine agent and the load
generator (``http_load.py``, raw asyncio keep-alive connections, a new
process per measurement). Targets alternate in a rotating order within
each repetition so that machine noise hits all alike; medians of
``--repeats`` are reported, with the ratios to (a).

    .venv/bin/python tools/bench/http_bench.py               # table
    .venv/bin/python tools/bench/http_bench.py --json        # one JSON object per case
    .venv/bin/python tools/bench/http_bench.py --quick       # smoke run
    .venv/bin/python tools/bench/http_bench.py --profile DIR # + cProfile of both gateways
    .venv/bin/python tools/bench/http_bench.py --cases agent_c32,builtin_c32  # a subset
    .venv/bin/python tools/bench/http_bench.py --litellm     # + (d), installed on first use

The non-streaming request carries an empty user message: the built-in echo
engine waits ``token_delay`` (10 ms, not settable through ``twistd infx``)
per echoed word, which would swamp what is measured. The streamed request
echoes ``STREAM_WORDS`` words (``STREAM_WORDS`` + 3 events per stream).
"""

from __future__ import annotations

import argparse
import json
import os
import pstats
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Callable

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
sys.path.insert(0, str(HERE))

from bench_processes import BenchError, Child, free_port, wait_for_model  # noqa: E402

MODEL = "echo"
STREAM_WORDS = 100
# Targets of issue #5.
MAX_OVERHEAD_P50_MS = 2.0
MIN_RPS = 1000.0
MIN_EVENTS_PER_S = 10000.0
# Targets of issue #16 ("Up"), for (b): CPU of gateway and agent together per request, relayed
# events/s, and latency added at c=1.
MAX_CPU_MS_PER_REQUEST = 0.5
MIN_RELAYED_EVENTS_PER_S = 40000.0
MAX_OVERHEAD_C1_MS = 0.6
#: Seconds a measured window with nothing in it yet may stay open for its first answer
#: (``http_load.py --patience``): on a loaded machine a slow figure, not a failed run.
PATIENCE_S = 30.0

TARGETS = {
    "direct": "(a) echo server alone",
    "agent": "(b) gateway + infx-engine (openai runtime) + echo server",
    "builtin": "(c) gateway + built-in echo engine",
    "litellm": "(d) LiteLLM proxy (1 worker) + echo server",
}
#: The LiteLLM release (d) runs: pinned, so that figures compare across runs.
LITELLM_VERSION = "1.81.13"
LITELLM_VENV = HERE / ".venv-litellm"


@dataclass(frozen=True)
class Case:
    """One measurement: a target, a request and a concurrency."""

    name: str
    target: str
    concurrency: int
    stream: bool


def cases(stream_concurrency: int, targets: tuple[str, ...] = ("direct", "agent", "builtin")) -> list[Case]:
    out = [Case(f"{target}_c{c}", target, c, False) for c in (1, 32) for target in targets]
    out += [Case(f"{target}_stream", target, stream_concurrency, True) for target in targets]
    return out


def request_body(stream: bool) -> bytes:
    if stream:
        words = " ".join(f"word{i}" for i in range(STREAM_WORDS))
        messages = [{"role": "user", "content": words}]
    else:
        messages = [{"role": "system", "content": "You are a terse assistant; answer in as few words as you can."},
                    {"role": "user", "content": ""}]
    return json.dumps({"model": MODEL, "stream": stream, "messages": messages}).encode()


class EchoServer(Child):
    """``http_echo_server.py``; it reports its port on stdout and exits when stdin closes."""

    def __init__(self, logs: Path) -> None:
        super().__init__("echo-server", [sys.executable, str(HERE / "http_echo_server.py")], logs,
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        stdout: IO[bytes] = self.process.stdout  # type: ignore[assignment]
        line = stdout.readline().strip()
        if not line.isdigit():
            self.stop()
            raise BenchError(f"echo server did not start: {self.log_tail()}")
        self.port = int(line)

    def stop(self) -> None:
        stdin: IO[bytes] = self.process.stdin  # type: ignore[assignment]
        stdin.close()
        super().stop()


def twistd(name: str, plugin_args: list[str], logs: Path, profile: Path | None) -> Child:
    log = logs / f"{name}.twistd.log"
    argv = [sys.executable, "-c", "from twisted.scripts.twistd import run; run()",
            "-n", "--pidfile=", f"--logfile={log}"]
    if profile is not None:
        argv += [f"--profile={profile / (name + '.prof')}", "--profiler=cprofile", "--savestats"]
    return Child(name, argv + plugin_args, logs)


def litellm_venv() -> Path:
    """The ``litellm`` command of the pinned LiteLLM proxy, installed into its venv on first use."""
    command = LITELLM_VENV / "bin" / "litellm"
    python = LITELLM_VENV / "bin" / "python"
    version = [str(python), "-c", "import importlib.metadata as m; print(m.version('litellm'))"]
    if command.exists() and subprocess.run(version, capture_output=True, text=True).stdout.strip() == LITELLM_VERSION:
        return command
    print(f"installing litellm[proxy]=={LITELLM_VERSION} into {LITELLM_VENV} (once)", file=sys.stderr)
    steps = [[sys.executable, "-m", "venv", str(LITELLM_VENV)],
             [str(python), "-m", "pip", "install", "-q", f"litellm[proxy]=={LITELLM_VERSION}"]]
    for step in steps:
        done = subprocess.run(step, capture_output=True, text=True)
        if done.returncode != 0:
            raise BenchError(f"could not install LiteLLM ({' '.join(step[-2:])}): {done.stderr.strip()[-1500:]}")
    return command


def litellm_proxy(echo_port: int, logs: Path) -> tuple[Child, int]:
    """The LiteLLM proxy, one worker, serving MODEL from the echo server; (child, port)."""
    command = litellm_venv()
    config = logs / "litellm.yaml"
    config.write_text(
        "model_list:\n"
        f"  - model_name: {MODEL}\n"
        "    litellm_params:\n"
        f"      model: openai/{MODEL}\n"
        f"      api_base: http://127.0.0.1:{echo_port}/v1\n"
        "      api_key: none\n"
        "litellm_settings:\n"
        "  telemetry: false\n")
    port = free_port()
    # The cost map is read from the package, not fetched: the bench stays on loopback.
    env = {**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True", "LITELLM_LOG": "ERROR"}
    child = Child("litellm", [str(command), "--config", str(config), "--host", "127.0.0.1", "--port", str(port),
                              "--num_workers", "1"], logs, env=env)
    return child, port


class Targets:
    """Starts the targets' processes; ``ports`` maps each target to its HTTP port."""

    def __init__(self, logs: Path, profile: Path | None, litellm: bool = False) -> None:
        self.children: list[Child] = []
        try:
            echo = EchoServer(logs)
            self.children.append(echo)
            agent_http, agent_grpc, builtin_http, builtin_grpc = (free_port() for _ in range(4))

            def gateway_args(http: int, worker: int) -> list[str]:
                # Every port explicit and on loopback: two gateways run side by side (and beside other tests).
                return ["infx", "--http", f"tcp:{http}:interface=127.0.0.1",
                        "--worker-grpc", f"tcp:{worker}:interface=127.0.0.1",
                        "--internal-grpc", f"tcp:{free_port()}:interface=127.0.0.1", "--grace-period", "1"]

            agent_gateway = twistd("gateway-agent", gateway_args(agent_http, agent_grpc), logs, profile)
            self.children.append(agent_gateway)
            builtin_gateway = twistd("gateway-builtin", [*gateway_args(builtin_http, builtin_grpc),
                                                         "--echo-models", MODEL, "--echo-token-delay", "0"],
                              logs, profile)
            self.children.append(builtin_gateway)
            engine = twistd("engine-agent", [
                "infx-engine", "--server", f"127.0.0.1:{agent_grpc}", "--runtime", "openai",
                "--upstream", f"http://127.0.0.1:{echo.port}", "--models", MODEL,
                "--max-concurrency", "64", "--grace", "1"], logs, profile)
            self.children.append(engine)
            wait_for_model(agent_http, MODEL, [agent_gateway, engine])
            wait_for_model(builtin_http, MODEL, [builtin_gateway])
            self.ports = {"direct": echo.port, "agent": agent_http, "builtin": builtin_http}
            #: Processes whose CPU time each measurement reports: the server first, then the engine agent.
            self.pids = {"direct": (echo.process.pid,), "agent": (agent_gateway.process.pid, engine.process.pid),
                         "builtin": (builtin_gateway.process.pid,)}
            if litellm:
                proxy, proxy_port = litellm_proxy(echo.port, logs)
                self.children.append(proxy)
                wait_for_model(proxy_port, MODEL, [proxy], timeout=180)
                self.ports["litellm"] = proxy_port
                self.pids["litellm"] = (proxy.process.pid,)
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        # Gateways first: the engine agent then sees a clean go-away.
        for child in sorted(self.children, key=lambda c: not c.name.startswith("gateway")):
            child.stop()


def run_load(port: int, body_file: Path, concurrency: int, duration: float, warmup: float,
             watch: tuple[int, ...] = (), need_progress: bool = True) -> dict[str, Any]:
    argv = [sys.executable, str(HERE / "http_load.py"), "--port", str(port), "--body-file", str(body_file),
            "--concurrency", str(concurrency), "--duration", str(duration), "--warmup", str(warmup),
            "--patience", str(PATIENCE_S)]
    argv += [f"--watch-pid={pid}" for pid in watch]
    process = subprocess.run(argv, capture_output=True, text=True, timeout=duration + warmup + PATIENCE_S + 60)
    lines = process.stdout.strip().splitlines()
    if process.returncode != 0 or not lines:
        raise BenchError(f"load generator failed ({process.returncode}): {process.stderr.strip()[-2000:]}")
    result: dict[str, Any] = json.loads(lines[-1])
    if result["errors"]:
        raise BenchError(f"{result['errors']} failed requests on port {port}: {result['error_samples']}")
    if need_progress and not result["requests"] and not result["events"]:
        raise BenchError(f"nothing completed on port {port} in {duration + PATIENCE_S:g} s")
    return result


def measure(all_cases: list[Case], targets: Targets, bodies: dict[bool, Path], repeats: int,
            duration: float, warmup: float) -> dict[str, list[dict[str, Any]]]:
    """Runs per case; a failed run is reported on stderr and left out."""
    runs: dict[str, list[dict[str, Any]]] = {}
    ports = targets.ports
    names = [name for name in TARGETS if name in ports]
    for target in names:  # warm every target up once before anything is measured
        try:
            run_load(ports[target], bodies[False], 32, warmup, 0.0, need_progress=False)
        except (BenchError, subprocess.TimeoutExpired) as error:
            print(f"error: warming up {target}: {error}", file=sys.stderr)
    for repeat in range(repeats):
        order = names[repeat % len(names):] + names[:repeat % len(names)]
        groups: dict[tuple[int, bool], list[Case]] = {}
        for case in all_cases:
            groups.setdefault((case.concurrency, case.stream), []).append(case)
        for group in groups.values():
            for case in sorted(group, key=lambda c: order.index(c.target)):
                try:
                    result = run_load(ports[case.target], bodies[case.stream], case.concurrency, duration, warmup,
                                      targets.pids[case.target])
                except (BenchError, subprocess.TimeoutExpired) as error:
                    print(f"error: {case.name}: {error}", file=sys.stderr)
                    continue
                runs.setdefault(case.name, []).append(result)
    return runs


def summarise(all_cases: list[Case], runs: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """One row per case: medians of its runs, CPU shares, and for gateway targets the ratios to ``direct``."""

    def median(name: str, value: Callable[[dict[str, Any]], float | None]) -> float | None:
        values = [v for v in map(value, runs.get(name, [])) if v is not None]
        return statistics.median(values) if values else None

    def watched(index: int, key: str = "watched_cpu_s") -> Callable[[dict[str, Any]], float | None]:
        def share(run: dict[str, Any]) -> float | None:
            seconds = run[key][index] if len(run[key]) > index else None
            return None if seconds is None else seconds / run["seconds"]
        return share

    def per_cpu_s(done: str) -> Callable[[dict[str, Any]], float | None]:
        def rate(run: dict[str, Any]) -> float | None:
            cpu = run["watched_cpu_s"][0] if run["watched_cpu_s"] else None
            return run[done] / cpu if cpu else None
        return rate

    def all_cpu_ms(done: str) -> Callable[[dict[str, Any]], float | None]:
        """CPU milliseconds of every watched process (server and engine agent) per request or event."""
        def cost(run: dict[str, Any]) -> float | None:
            seconds = run["watched_cpu_s"]
            if not seconds or None in seconds or not run[done]:
                return None
            return 1000.0 * sum(seconds) / run[done]
        return cost

    rows = []
    for case in all_cases:
        name = case.name
        row: dict[str, Any] = {"case": name, "target": case.target, "concurrency": case.concurrency}
        rate, done = ("events_per_s", "events") if case.stream else ("rps", "requests")
        row[rate] = median(name, lambda r: r[rate])
        row["p50_ms"] = median(name, lambda r: r["p50_ms"])
        row["p99_ms"] = median(name, lambda r: r["p99_ms"])
        row["runs"] = len(runs.get(name, []))
        row["client_cpu"] = median(name, lambda r: r["cpu_s"] / r["seconds"])
        row["server_cpu"] = median(name, watched(0))
        row["server_cpu_wait"] = median(name, watched(0, "watched_wait_s"))
        if case.target == "agent":
            row["engine_cpu"] = median(name, watched(1))
        row["per_server_cpu_s"] = median(name, per_cpu_s(done))
        row["cpu_ms_per_" + ("event" if case.stream else "request")] = median(name, all_cpu_ms(done))
        if not case.stream and case.target != "direct":
            base = f"direct_c{case.concurrency}"
            base_rps, base_p50 = median(base, lambda r: r["rps"]), median(base, lambda r: r["p50_ms"])
            rps, p50 = row["rps"], row["p50_ms"]
            row["rps_ratio"] = rps / base_rps if rps is not None and base_rps else None
            row["p50_ratio"] = p50 / base_p50 if p50 is not None and base_p50 else None
            row["p50_overhead_ms"] = p50 - base_p50 if p50 is not None and base_p50 is not None else None
        rows.append(row)
    return rows


def verdicts(rows: list[dict[str, Any]]) -> list[str]:
    by_case = {row["case"]: row for row in rows}

    def check(label: str, value: float | None, ok: bool, unit: str) -> str:
        if value is None:
            return f"{label}: not measured"
        return f"{label}: {value:,.2f} {unit} -> {'met' if ok else 'MISSED'}"

    out = []
    for case, who in (("builtin_c1", "gateway (+ in-process echo engine)"), ("agent_c1", "gateway + engine agent")):
        overhead = by_case.get(case, {}).get("p50_overhead_ms")
        out.append(check(f"p50 overhead at c=1, {who}, target <= {MAX_OVERHEAD_P50_MS:g} ms", overhead,
                         overhead is not None and overhead <= MAX_OVERHEAD_P50_MS, "ms"))
    for case in ("builtin_c32", "agent_c32"):
        for key, what in (("rps", "requests/s"), ("per_server_cpu_s", "requests per gateway CPU second")):
            rps = by_case.get(case, {}).get(key)
            out.append(check(f"{case} {what}, target >= {MIN_RPS:,.0f}", rps, rps is not None and rps >= MIN_RPS,
                             "req/s"))
    for case in ("builtin_stream", "agent_stream"):
        for key, what in (("events_per_s", "relayed events/s"), ("per_server_cpu_s",
                                                                 "events per gateway CPU second")):
            value = by_case.get(case, {}).get(key)
            out.append(check(f"{case} {what}, target >= {MIN_EVENTS_PER_S:,.0f}", value,
                             value is not None and value >= MIN_EVENTS_PER_S, "events/s"))
    cpu = by_case.get("agent_c32", {}).get("cpu_ms_per_request")
    out.append(check(f"#16: agent_c32 CPU per request, gateway + agent, target <= {MAX_CPU_MS_PER_REQUEST:g} ms",
                     cpu, cpu is not None and cpu <= MAX_CPU_MS_PER_REQUEST, "ms"))
    events = by_case.get("agent_stream", {}).get("events_per_s")
    out.append(check(f"#16: agent_stream relayed events/s, target >= {MIN_RELAYED_EVENTS_PER_S:,.0f}", events,
                     events is not None and events >= MIN_RELAYED_EVENTS_PER_S, "events/s"))
    overhead = by_case.get("agent_c1", {}).get("p50_overhead_ms")
    out.append(check(f"#16: agent_c1 p50 added to direct, target <= {MAX_OVERHEAD_C1_MS:g} ms", overhead,
                     overhead is not None and overhead <= MAX_OVERHEAD_C1_MS, "ms"))
    return out


def report_table(rows: list[dict[str, Any]], repeats: int, duration: float) -> None:
    def fmt(value: float | None, spec: str = ",.1f") -> str:
        return "-" if value is None else format(value, spec)

    header = ["case", "conc", "req/s | events/s", "p50 ms", "p99 ms", "x direct req/s", "x direct p50",
              "p50 overhead ms", "per server cpu-s", "cpu ms per req|ev", "cpu: server", "engine", "client",
              "server waited"]
    table = [header]
    for row in rows:
        rate = row.get("rps", row.get("events_per_s"))
        unit = " ev/s" if "events_per_s" in row else ""
        table.append([
            row["case"], str(row["concurrency"]), fmt(rate, ",.0f") + unit, fmt(row["p50_ms"], ".3f"),
            fmt(row["p99_ms"], ".3f"), fmt(row.get("rps_ratio"), ".3f"), fmt(row.get("p50_ratio"), ".2f"),
            fmt(row.get("p50_overhead_ms"), ".3f"), fmt(row["per_server_cpu_s"], ",.0f"),
            fmt(row.get("cpu_ms_per_request", row.get("cpu_ms_per_event")), ".3f"),
            fmt(row["server_cpu"], ".0%"), fmt(row.get("engine_cpu"), ".0%"), fmt(row["client_cpu"], ".0%"),
            fmt(row["server_cpu_wait"], ".0%"),
        ])
    widths = [max(len(r[i]) for r in table) for i in range(len(header))]
    print(f"medians of {repeats} x {duration:g} s, loopback, every process separate, {os.cpu_count()} cores, "
          f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())} at the end")
    for target, meaning in TARGETS.items():
        if any(row["target"] == target for row in rows):
            print(f"  {target}: {meaning}")
    for r in table:
        print("  ".join(cell.ljust(width) for cell, width in zip(r, widths)).rstrip())
    for line in verdicts(rows):
        print(line)


def report_profiles(profile: Path, top: int = 25) -> None:
    for path in sorted(profile.glob("*.prof")):
        if not path.stat().st_size:
            continue
        print(f"\n=== {path.name}: top {top} by own time ===", file=sys.stderr)
        stats = pstats.Stats(str(path), stream=sys.stderr)
        stats.sort_stats("tottime").print_stats(top)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="one JSON object per case")
    parser.add_argument("--quick", action="store_true", help="smoke run: one repetition of 0.3 s")
    parser.add_argument("--duration", type=float, help="measured seconds per run (default 3, quick 0.3)")
    parser.add_argument("--warmup", type=float, help="unmeasured seconds before each run (default 1, quick 0.1)")
    parser.add_argument("--repeats", type=int, help="repetitions; medians are reported (default 3, quick 1)")
    parser.add_argument("--stream-concurrency", type=int, default=32,
                        help="concurrent streams in the stream cases (default 32, the engines' task limit)")
    parser.add_argument("--cases", help="comma-separated subset of the case names (default: all)")
    parser.add_argument("--profile", type=Path, help="directory for cProfile stats of both gateways and the "
                        "engine agent; their top functions are printed on stderr at the end")
    parser.add_argument("--litellm", action="store_true",
                        help=f"also run (d), the LiteLLM proxy {LITELLM_VERSION} (installed once into "
                        f"{LITELLM_VENV.relative_to(ROOT)})")
    options = parser.parse_args(argv)
    duration = options.duration if options.duration is not None else (0.3 if options.quick else 3.0)
    warmup = options.warmup if options.warmup is not None else (0.1 if options.quick else 1.0)
    repeats = options.repeats if options.repeats is not None else (1 if options.quick else 3)
    all_cases = cases(options.stream_concurrency,
                      ("direct", "agent", "builtin", "litellm") if options.litellm else ("direct", "agent", "builtin"))
    if options.cases:
        wanted = options.cases.split(",")
        unknown = sorted(set(wanted) - {case.name for case in all_cases})
        if unknown:
            parser.error(f"unknown cases: {', '.join(unknown)}; known: {', '.join(c.name for c in all_cases)}")
        all_cases = [case for case in all_cases if case.name in wanted]
    if options.profile is not None:
        options.profile.mkdir(parents=True, exist_ok=True)
        options.profile = options.profile.resolve()

    with tempfile.TemporaryDirectory(prefix="http_bench-") as tmp:
        logs = Path(tmp)
        bodies = {}
        for stream in (False, True):
            bodies[stream] = logs / f"body-{'stream' if stream else 'whole'}.json"
            bodies[stream].write_bytes(request_body(stream))
        try:
            targets = Targets(logs, options.profile, options.litellm)
        except BenchError as error:
            print(f"error: {error}", file=sys.stderr)
            return 1
        try:
            runs = measure(all_cases, targets, bodies, repeats, duration, warmup)
        finally:
            targets.stop()
    rows = summarise(all_cases, runs)
    if options.json:
        for row in rows:
            print(json.dumps(row))
    else:
        report_table(rows, repeats, duration)
    if options.profile is not None:
        report_profiles(options.profile)
    return 0 if all(row["runs"] == repeats for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
