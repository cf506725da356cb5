#!/usr/bin/env python
"""Benchmark infx's HTTP gateway beside the gateways users pick instead, in front of the same runtime, over loopback.

Two runtimes (``--runtimes``) answer the same chat completions with the
same bytes:

- ``echo``: the lean echo server of ``http_echo_server.py`` (raw asyncio,
  one ``write`` per answer, a whole stream at once);
- ``starlette``: ``starlette_runtime.py``, an OpenAI-compatible Starlette
  app on uvicorn, which streams one chunk per word as vLLM, SGLang and
  llama-cpp-python do: a runtime like the ones users run.

In front of each runtime, the targets (``--targets``):

- ``direct``: the runtime alone (the baseline);
- ``agent``: ``twistd infx`` + ``twistd infx-engine --runtime openai``
  pointed at the runtime (infx's dial-in deployment);
- ``url``: ``twistd infx --runtime-url`` (the runtime served by URL: the
  engine agent runs inside the gateway's process, no gRPC hop);
- ``url-rr``: ``url`` with ``--routing-policy round_robin``, the policy the
  Rust routers run here (no prompt is hashed for routing hints);
- ``url-workers``: the same with ``--workers 2`` (every worker serves the
  runtime itself; every process's CPU is counted, the supervisor's too);
- ``floor``: ``proxy_floor.py``, the least a Twisted + httptools process
  spends relaying a request to the runtime and back (no routing, no
  guarantees): how far infx is from what Python on Twisted can do;
- ``floor-chores``: ``proxy_floor.py --chores``, the floor plus the least
  of what any gateway does per request besides relaying (the body parsed as
  JSON, a request log line, a counter and a histogram), the way infx does it;
- ``base``: with ``--baseline DIR`` (another checkout of infx, e.g. made
  with ``git worktree add DIR COMMIT``), that tree's dial-in path, as
  ``agent`` but run from ``DIR``: before and after a change in one run;
- ``base-url``: with ``--baseline DIR``, that tree's by-URL path, as ``url``;
- ``litellm``: the LiteLLM proxy (one worker);
- ``sglang``: sglang-router, round_robin;
- ``vllm``: vllm-router, round_robin;

and once, with no runtime, ``builtin``: ``twistd infx --echo-models``
(the built-in echo engine inside the gateway's process; its ratios are to
``direct-echo``, whose answers it matches), and ``workers``: the same with
``--workers 2`` (each worker serves from its own built-in engine, as each
serves runtimes by URL itself; every process's CPU is counted, the
supervisor's too), and ``twistedweb``: ``builtin`` served by twisted.web's
server (``--http-server twisted``) instead of the httptools one, to compare
the two. Every other infx target runs ``--workers 1``. The peers (LiteLLM and the
routers) are pinned releases installed on first use into ignored venvs by
``peers.py``, which documents their command lines; they run only when
named in ``--targets``.

Each target is measured with non-streaming chat at concurrency 1
(latency) and 32 (requests/s), and with streams of ``STREAM_WORDS`` words
(``STREAM_WORDS`` + 3 events each) at ``--stream-concurrency`` (relayed
events/s). The CPU time every process of the target used inside each
measured window (every thread of the gateway and agent, the proxy or the
router; the runtime's for ``direct``) is read from ``/proc``: CPU per
request or event is the figure that holds up when other work shares the
machine, which wall-clock rates do not, and ``server_cpu_wait`` is the
share of the window the target's first process was runnable but waited
for a CPU (high means the machine, not the target, set the pace). Every
process is separate, the load generator too (``http_load.py``, raw
asyncio keep-alive connections, a new process per measurement). Targets
alternate in a rotating order within each repetition so that machine
noise hits all alike; medians of ``--repeats`` are reported.

    .venv/bin/python tools/bench/http_bench.py                      # infx beside the runtimes
    .venv/bin/python tools/bench/http_bench.py --targets all        # + LiteLLM and both routers
    .venv/bin/python tools/bench/http_bench.py --json               # one JSON object per case
    .venv/bin/python tools/bench/http_bench.py --quick              # smoke run
    .venv/bin/python tools/bench/http_bench.py --profile DIR --cases agent-starlette_c1  # + cProfile

The non-streaming request is a system prompt and a one-word user message
(sglang-router refuses an empty one with 400), answered with that word;
the built-in echo engine runs with ``--echo-token-delay 0``.
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
sys.path.insert(0, str(ROOT))

from bench_processes import BenchError, Child, bound_ports, free_port, wait_for_model  # noqa: E402
from harness.twistd_processes import children_of  # noqa: E402
from peers import LITELLM, SGLANG_ROUTER, VLLM_ROUTER, Peer, start_litellm, start_sglang_router  # noqa: E402
from peers import start_vllm_router  # noqa: E402

MODEL = "echo"
#: Words per streamed answer and streams at once: issue #25's measure of relayed events.
STREAM_WORDS = 64
STREAM_CONCURRENCY = 8
#: Seconds a measured window with nothing in it yet may stay open for its first answer
#: (``http_load.py --patience``): on a loaded machine a slow figure, not a failed run.
PATIENCE_S = 30.0
#: Issue #25: the dial-in path's CPU per request at c=32 that it measured (ms), to be cut to 0.6x.
ISSUE_25_DIAL_IN_CPU_MS = 1.75

RUNTIMES = {
    "echo": "http_echo_server.py: raw asyncio, one write per answer",
    "starlette": "starlette_runtime.py: Starlette on uvicorn, one chunk per streamed word",
}
KINDS = {
    "direct": "the runtime alone",
    "agent": "twistd infx + twistd infx-engine --runtime openai",
    "url": "twistd infx --runtime-url (one process, no agent between)",
    "url-rr": "twistd infx --runtime-url --routing-policy round_robin (the Rust routers' policy here)",
    "url-workers": "twistd infx --workers 2 --runtime-url (the supervisor and 2 workers, each serving the runtime)",
    "floor": "proxy_floor.py: a bare Twisted + httptools relay to the runtime, no routing (the floor)",
    "floor-chores": "proxy_floor.py --chores: the floor, and per request a JSON parse, a log line and two metrics",
    "base": "the dial-in path of the --baseline tree",
    "base-url": "the by-URL path of the --baseline tree",
    "litellm": f"LiteLLM proxy {LITELLM.version}, one worker",
    "sglang": f"sglang-router {SGLANG_ROUTER.version}, round_robin",
    "vllm": f"vllm-router {VLLM_ROUTER.version}, round_robin",
    "builtin": "twistd infx --echo-models (built-in echo engine, no runtime)",
    "workers": "twistd infx --workers 2 --echo-models (a built-in echo engine in each worker, no runtime)",
    "twistedweb": "twistd infx --echo-models --http-server twisted (builtin, served by twisted.web's server)",
}
DEFAULT_KINDS = ("direct", "agent", "url", "builtin")
#: Targets with no runtime behind them (compared with ``direct-echo``).
RUNTIMELESS = ("builtin", "workers", "twistedweb")
ROUTER_KINDS = ("sglang", "vllm")


@dataclass(frozen=True)
class Target:
    """What serves the OpenAI API on ``port``: a kind of gateway (or none) in front of a runtime.

    ``pids`` are the processes whose CPU it is charged with (the runtime's only for ``direct``).
    """

    name: str
    kind: str
    runtime: str | None
    port: int
    pids: tuple[int, ...]


def target_name(kind: str, runtime: str | None) -> str:
    return kind if runtime is None else f"{kind}-{runtime}"


def baseline(target: Target) -> str:
    """The target whose latency and rate this one's are compared with: the runtime it fronts, alone."""
    return target_name("direct", target.runtime or "echo")


@dataclass(frozen=True)
class Case:
    """One measurement: a target, a request and a concurrency."""

    name: str
    target: str
    concurrency: int
    stream: bool


def cases(targets: list[str], stream_concurrency: int) -> list[Case]:
    out = [Case(f"{target}_c{c}", target, c, False) for c in (1, 32) for target in targets]
    out += [Case(f"{target}_stream", target, stream_concurrency, True) for target in targets]
    return out


def request_body(stream: bool) -> bytes:
    if stream:
        words = " ".join(f"word{i}" for i in range(STREAM_WORDS))
        messages = [{"role": "user", "content": words}]
    else:
        messages = [{"role": "system", "content": "You are a terse assistant; answer in as few words as you can."},
                    {"role": "user", "content": "Hello"}]
    return json.dumps({"model": MODEL, "stream": stream, "messages": messages}).encode()


class PortReporter(Child):
    """A script of this directory that reports its port on stdout and exits when stdin closes."""

    def __init__(self, name: str, argv: list[str], logs: Path) -> None:
        super().__init__(name, [sys.executable, *argv], logs, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        stdout: IO[bytes] = self.process.stdout  # type: ignore[assignment]
        line = stdout.readline().strip()
        if not line.isdigit():
            self.stop()
            raise BenchError(f"{name} did not start: {self.log_tail()}")
        self.port = int(line)
        self.url = f"http://127.0.0.1:{self.port}"


class RuntimeServer(PortReporter):
    """A runtime script of this directory."""

    SCRIPTS = {"echo": "http_echo_server.py", "starlette": "starlette_runtime.py"}

    def __init__(self, runtime: str, logs: Path) -> None:
        super().__init__(f"runtime-{runtime}", [str(HERE / self.SCRIPTS[runtime])], logs)


def twistd(name: str, plugin_args: list[str], logs: Path, profile: Path | None, tree: Path = ROOT,
           log_to_stdout: bool = False) -> Child:
    """``twistd`` with infx from ``tree`` (this checkout, or ``--baseline``'s). ``log_to_stdout``:
    twistd logs to its standard output (the Child's log file), as in a container; there a
    supervisor's workers write their own lines (docs/workers.md)."""
    log = "-" if log_to_stdout else twistd_log(name, logs)
    argv = [sys.executable, "-c", "from twisted.scripts.twistd import run; run()",
            "-n", "--pidfile=", f"--logfile={log}"]
    if profile is not None:
        argv += [f"--profile={profile / (name + '.prof')}", "--profiler=cprofile", "--savestats"]
    path = os.pathsep.join(filter(None, [str(tree), os.environ.get("PYTHONPATH")]))
    # Run in ``tree``: ``python -c`` puts its working directory first on the path, ahead of PYTHONPATH,
    # so a baseline run from this checkout would import this checkout's infx.
    return Child(name, argv + plugin_args, logs, env={**os.environ, "PYTHONPATH": path}, cwd=tree)


def twistd_log(name: str, logs: Path) -> Path:
    return logs / f"{name}.twistd.log"


def gateway_args(http: int = 0, worker: int = 0, workers: int = 1, internal: int = 0) -> list[str]:
    # Every port on loopback, the kernel's pick (read back with bound_ports: none can be taken first),
    # as several gateways run side by side (and beside other tests); the baseline's picked beforehand.
    return ["infx", "--http", f"tcp:{http}:interface=127.0.0.1",
            "--worker-grpc", f"tcp:{worker}:interface=127.0.0.1",
            "--internal-grpc", f"tcp:{internal}:interface=127.0.0.1", "--grace-period", "1",
            "--workers", str(workers)]


class Processes:
    """Starts the runtimes and every target in front of them; ``targets`` in a fixed order."""

    def __init__(self, logs: Path, profile: Path | None, runtimes: list[str], kinds: list[str],
                 baseline: Path | None = None) -> None:
        self.children: list[Child] = []
        self.peers: list[Peer] = []
        self.targets: list[Target] = []
        self.baseline = baseline
        try:
            self._start(logs, profile, runtimes, kinds)
        except BaseException:
            self.stop()
            raise

    def _start(self, logs: Path, profile: Path | None, runtimes: list[str], kinds: list[str]) -> None:
        waits: list[tuple[int, list[Child]]] = []
        #: Supervisors of --workers 2 targets: their workers are checked once every target serves.
        supervised: list[tuple[str, str | None, int, Child]] = []
        for runtime in runtimes:
            server = RuntimeServer(runtime, logs)
            self.children.append(server)
            if "direct" in kinds:
                self._add("direct", runtime, server.port, server.process.pid)
            for kind, tree in (("agent", ROOT), ("base", self.baseline)):
                if kind not in kinds or tree is None:
                    continue
                name = f"gateway-{kind}-{runtime}"
                # An older infx may name itself by an internal port 0 or say its ports otherwise.
                picked = (free_port(), free_port(), free_port()) if kind == "base" else (0, 0, 0)
                gateway = twistd(name, gateway_args(picked[0], picked[1], internal=picked[2]), logs, profile, tree)
                self.children.append(gateway)
                http, grpc = picked[:2] if kind == "base" else bound_ports(gateway, twistd_log(name, logs))
                engine = twistd(f"engine-{kind}-{runtime}", [
                    "infx-engine", "--server", f"127.0.0.1:{grpc}", "--runtime", "openai",
                    "--upstream", server.url, "--models", MODEL, "--max-concurrency", "64", "--grace", "1"],
                    logs, profile, tree)
                self.children.append(engine)
                waits.append((http, [gateway, engine]))
                self._add(kind, runtime, http, gateway.process.pid, engine.process.pid)
            for kind, tree in (("url", ROOT), ("url-rr", ROOT), ("base-url", self.baseline)):
                if kind not in kinds or tree is None:
                    continue
                name = f"gateway-{kind}-{runtime}"
                # An older infx may name itself by an internal port 0 or say its ports otherwise.
                picked = (free_port(), free_port(), free_port()) if kind == "base-url" else (0, 0, 0)
                policy = ["--routing-policy", "round_robin"] if kind == "url-rr" else []
                gateway = twistd(name, [
                    *gateway_args(picked[0], picked[1], internal=picked[2]), "--runtime-url", f"{server.url}={MODEL}",
                    "--runtime-max-concurrency", "64", *policy], logs, profile, tree)
                self.children.append(gateway)
                http = picked[0] if kind == "base-url" else bound_ports(gateway, twistd_log(name, logs))[0]
                waits.append((http, [gateway]))
                self._add(kind, runtime, http, gateway.process.pid)
            if "url-workers" in kinds:
                gateway = twistd(f"gateway-url-workers-{runtime}", [
                    *gateway_args(workers=2), "--runtime-url", f"{server.url}={MODEL}",
                    "--runtime-max-concurrency", "64"], logs, profile, log_to_stdout=True)
                self.children.append(gateway)
                http, _ = bound_ports(gateway, gateway.log_path, workers=2)
                waits.append((http, [gateway]))
                supervised.append(("url-workers", runtime, http, gateway))
            # The chores' request log beside, not in, the process's own log (logs/NAME.log).
            chores = ["--chores", str(logs / f"floor-chores-{runtime}.requests.log")]
            for kind, extra in (("floor", []), ("floor-chores", chores)):
                if kind in kinds:
                    floor = PortReporter(f"{kind}-{runtime}",
                                         [str(HERE / "proxy_floor.py"), "--upstream", server.url, *extra], logs)
                    self.children.append(floor)
                    self._add(kind, runtime, floor.port, floor.process.pid)
        if "builtin" in kinds:
            gateway = twistd("gateway-builtin", [*gateway_args(),
                                                 "--echo-models", MODEL, "--echo-token-delay", "0"], logs, profile)
            self.children.append(gateway)
            http, _ = bound_ports(gateway, twistd_log(gateway.name, logs))
            waits.append((http, [gateway]))
            self._add("builtin", None, http, gateway.process.pid)
        if "twistedweb" in kinds:
            gateway = twistd("gateway-twistedweb", [*gateway_args(), "--http-server", "twisted",
                                                    "--echo-models", MODEL, "--echo-token-delay", "0"], logs, profile)
            self.children.append(gateway)
            http, _ = bound_ports(gateway, twistd_log(gateway.name, logs))
            waits.append((http, [gateway]))
            self._add("twistedweb", None, http, gateway.process.pid)
        if "workers" in kinds:
            supervisor = twistd("gateway-workers", [*gateway_args(workers=2),
                                                    "--echo-models", MODEL, "--echo-token-delay", "0"], logs, profile,
                                log_to_stdout=True)
            self.children.append(supervisor)
            http, _ = bound_ports(supervisor, supervisor.log_path, workers=2)
            waits.append((http, [supervisor]))
            supervised.append(("workers", None, http, supervisor))
        for port, children in waits:
            wait_for_model(port, MODEL, children)
        for kind, runtime, http, supervisor in supervised:
            workers = children_of(supervisor.process.pid)
            if len(workers) != 2:
                raise BenchError(f"--workers 2 runs {len(workers)} workers: {supervisor.log_tail()}")
            # Watched CPU counts a process's children: the supervisor's pid covers its workers.
            self._add(kind, runtime, http, supervisor.process.pid)
        starters: dict[str, Callable[[RuntimeServer], Peer]] = {
            "litellm": lambda s: start_litellm([s.url], MODEL, logs, name=f"litellm-{s.name}"),
            "sglang": lambda s: start_sglang_router([s.url], "round_robin", MODEL, logs, name=f"sglang-{s.name}"),
            "vllm": lambda s: start_vllm_router([s.url], "round_robin", MODEL, logs, name=f"vllm-{s.name}"),
        }
        servers = [child for child in self.children if isinstance(child, RuntimeServer)]
        for kind in (k for k in starters if k in kinds):
            for server in servers:
                peer = starters[kind](server)
                self.peers.append(peer)
                self._add(kind, server.name.removeprefix("runtime-"), peer.port, peer.pid)

    def _add(self, kind: str, runtime: str | None, port: int, *pids: int) -> None:
        self.targets.append(Target(target_name(kind, runtime), kind, runtime, port, pids))

    def stop(self) -> None:
        for peer in self.peers:
            peer.stop()
        # Gateways first: the engine agents then see a clean go-away.
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


def measure(all_cases: list[Case], targets: list[Target], bodies: dict[bool, Path], repeats: int,
            duration: float, warmup: float) -> dict[str, list[dict[str, Any]]]:
    """Runs per case; a failed run is reported on stderr and left out."""
    runs: dict[str, list[dict[str, Any]]] = {}
    by_name = {target.name: target for target in targets}
    names = [target.name for target in targets if any(case.target == target.name for case in all_cases)]
    for name in names:  # warm every target up once before anything is measured
        try:
            run_load(by_name[name].port, bodies[False], 32, warmup, 0.0, need_progress=False)
        except (BenchError, subprocess.TimeoutExpired) as error:
            print(f"error: warming up {name}: {error}", file=sys.stderr)
    for repeat in range(repeats):
        order = names[repeat % len(names):] + names[:repeat % len(names)]
        groups: dict[tuple[int, bool], list[Case]] = {}
        for case in all_cases:
            groups.setdefault((case.concurrency, case.stream), []).append(case)
        for group in groups.values():
            for case in sorted(group, key=lambda c: order.index(c.target)):
                target = by_name[case.target]
                try:
                    result = run_load(target.port, bodies[case.stream], case.concurrency, duration, warmup,
                                      target.pids)
                except (BenchError, subprocess.TimeoutExpired) as error:
                    print(f"error: {case.name}: {error}", file=sys.stderr)
                    continue
                runs.setdefault(case.name, []).append(result)
    return runs


def summarise(all_cases: list[Case], targets: list[Target],
              runs: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """One row per case: medians of its runs, CPU shares, and for gateways the ratios to their runtime alone."""
    by_name = {target.name: target for target in targets}

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
        """CPU milliseconds of every watched process (e.g. gateway and engine agent) per request or event."""
        def cost(run: dict[str, Any]) -> float | None:
            seconds = run["watched_cpu_s"]
            if not seconds or None in seconds or not run[done]:
                return None
            cost_ms: float = 1000.0 * sum(seconds) / run[done]
            return cost_ms
        return cost

    rows = []
    for case in all_cases:
        name, target = case.name, by_name[case.target]
        row: dict[str, Any] = {"case": name, "target": target.name, "kind": target.kind, "runtime": target.runtime,
                               "concurrency": case.concurrency}
        rate, done = ("events_per_s", "events") if case.stream else ("rps", "requests")
        row[rate] = median(name, lambda r: r[rate])
        row["p50_ms"] = median(name, lambda r: r["p50_ms"])
        row["p99_ms"] = median(name, lambda r: r["p99_ms"])
        row["runs"] = len(runs.get(name, []))
        row["client_cpu"] = median(name, lambda r: r["cpu_s"] / r["seconds"])
        row["server_cpu"] = median(name, watched(0))
        row["server_cpu_wait"] = median(name, watched(0, "watched_wait_s"))
        if target.kind in ("agent", "base"):
            row["engine_cpu"] = median(name, watched(1))
        row["per_server_cpu_s"] = median(name, per_cpu_s(done))
        row["cpu_ms_per_" + ("event" if case.stream else "request")] = median(name, all_cpu_ms(done))
        if not case.stream and target.kind != "direct":
            base = f"{baseline(target)}_c{case.concurrency}"
            base_rps, base_p50 = median(base, lambda r: r["rps"]), median(base, lambda r: r["p50_ms"])
            rps, p50 = row["rps"], row["p50_ms"]
            row["rps_ratio"] = rps / base_rps if rps is not None and base_rps else None
            row["p50_ratio"] = p50 / base_p50 if p50 is not None and base_p50 else None
            row["p50_overhead_ms"] = p50 - base_p50 if p50 is not None and base_p50 is not None else None
        rows.append(row)
    return rows


def overview(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Issue #25's columns, one row per target: c=1 p50 added, c=32 req/s, relayed events/s, CPU per request."""
    by_case = {row["case"]: row for row in rows}
    out = []
    for target in dict.fromkeys(row["target"] for row in rows):
        c1, c32, stream = (by_case.get(f"{target}_{suffix}", {}) for suffix in ("c1", "c32", "stream"))
        first = c1 or c32 or stream
        out.append({"target": target, "kind": first["kind"], "runtime": first["runtime"],
                    "c1_p50_added_ms": c1.get("p50_overhead_ms"), "c32_rps": c32.get("rps"),
                    "events_per_s": stream.get("events_per_s"), "c32_cpu_ms_per_request": c32.get("cpu_ms_per_request"),
                    "c1_cpu_ms_per_request": c1.get("cpu_ms_per_request")})
    return out


def verdicts(rows: list[dict[str, Any]]) -> list[str]:
    """Issue #25's comparisons, per runtime: infx's dial-in path and infx by URL against the best Rust
    router measured beside them."""
    out = []
    for runtime in dict.fromkeys(row["runtime"] for row in rows if row["runtime"]):
        mine = [row for row in rows if row["runtime"] == runtime]
        routers = [row for row in mine if row["kind"] in ROUTER_KINDS]
        agent = next((row for row in mine if row["kind"] == "agent"), None)
        base = next((row for row in mine if row["kind"] == "base"), None)
        if agent is not None and agent["c32_cpu_ms_per_request"] is not None:
            cpu = agent["c32_cpu_ms_per_request"]
            out.append(f"#25 [{runtime}] dial-in path CPU per request at c=32: {cpu:.3f} ms; target <= 0.6 x "
                       f"{ISSUE_25_DIAL_IN_CPU_MS:g} ms = {0.6 * ISSUE_25_DIAL_IN_CPU_MS:.2f} ms "
                       f"-> {'met' if cpu <= 0.6 * ISSUE_25_DIAL_IN_CPU_MS else 'MISSED'}")
            for key, what in (("c32_cpu_ms_per_request", "c=32"), ("c1_cpu_ms_per_request", "c=1")):
                if base is not None and base[key] and agent[key] is not None:
                    out.append(f"#25 [{runtime}] dial-in path CPU per request at {what}: {agent[key]:.3f} ms, the "
                               f"--baseline tree's {base[key]:.3f} ms = {agent[key] / base[key]:.2f}x "
                               f"(target <= 0.6x) -> {'met' if agent[key] <= 0.6 * base[key] else 'MISSED'}")
        url = next((row for row in mine if row["kind"] == "url"), None)
        base_url = next((row for row in mine if row["kind"] == "base-url"), None)
        if url is not None and base_url is not None:
            for key, what in (("c32_cpu_ms_per_request", "c=32"), ("c1_cpu_ms_per_request", "c=1")):
                if base_url[key] and url[key] is not None:
                    out.append(f"[{runtime}] by-URL path CPU per request at {what}: {url[key]:.3f} ms, the "
                               f"--baseline tree's {base_url[key]:.3f} ms = {url[key] / base_url[key]:.2f}x")
        for kind, name in (("url", "infx by URL"), ("url-rr", "infx by URL, round_robin"),
                           ("url-workers", "infx by URL, --workers 2"),
                           ("agent", "infx dial-in path"), ("floor", "the floor (proxy_floor.py)"),
                           ("floor-chores", "the floor with a gateway's chores (proxy_floor.py --chores)")):
            row = next((r for r in mine if r["kind"] == kind), None)
            if row is None:
                continue
            for key, what in (("c32_cpu_ms_per_request", "CPU per request at c=32"),
                              ("c1_p50_added_ms", "c=1 p50 added")):
                measured = [(r[key], r["target"]) for r in routers if r[key] is not None]
                if not measured or row[key] is None:
                    continue
                best, who = min(measured)
                verdict = f" -> {'met' if row[key] <= 2 * best else 'MISSED'}" if kind == "url" else ""
                out.append(f"#25 [{runtime}] {what}: best Rust router {best:.3f} ms ({who}); {name} "
                           f"{row[key]:.3f} ms = {row[key] / best:.1f}x (target for infx by URL: <= 2x){verdict}")
            for key, what in (("c32_rps", "requests/s at c=32"), ("events_per_s", "relayed events/s")):
                measured = [(r[key], r["target"]) for r in routers if r[key] is not None]
                if not measured or row[key] is None:
                    continue
                best, who = max(measured)
                verdict = f" -> {'met' if row[key] >= 0.8 * best else 'MISSED'}" if kind == "url-workers" else ""
                out.append(f"#25 [{runtime}] {what}: best Rust router {best:,.0f} ({who}); {name} "
                           f"{row[key]:,.0f} = {row[key] / best:.2f}x (target with --workers 2: >= 0.8x){verdict}")
    return out


def fmt(value: float | None, spec: str = ",.1f") -> str:
    return "-" if value is None else format(value, spec)


def print_table(table: list[list[str]]) -> None:
    widths = [max(len(r[i]) for r in table) for i in range(len(table[0]))]
    for r in table:
        print("  ".join(cell.ljust(width) for cell, width in zip(r, widths)).rstrip())


def report_table(rows: list[dict[str, Any]], repeats: int, duration: float, stream_concurrency: int) -> None:
    print(f"medians of {repeats} x {duration:g} s, loopback, every process separate, {os.cpu_count()} cores, "
          f"streams of {STREAM_WORDS} words at c={stream_concurrency}, "
          f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())} at the end")
    print("runtimes: " + "; ".join(f"{name}: {meaning}" for name, meaning in RUNTIMES.items()
                                   if any(row["runtime"] == name for row in rows)))
    print("targets: " + "; ".join(f"{kind}: {meaning}" for kind, meaning in KINDS.items()
                                  if any(row["kind"] == kind for row in rows)))
    table = [["target", "c=1 p50 added ms", "c=32 req/s", "relayed events/s", "CPU ms/request c=32",
              "CPU ms/request c=1"]]
    summary = overview(rows)
    for row in summary:
        table.append([row["target"], fmt(row["c1_p50_added_ms"], ".3f"), fmt(row["c32_rps"], ",.0f"),
                      fmt(row["events_per_s"], ",.0f"), fmt(row["c32_cpu_ms_per_request"], ".3f"),
                      fmt(row["c1_cpu_ms_per_request"], ".3f")])
    print_table(table)
    print()
    header = ["case", "conc", "req/s | events/s", "p50 ms", "p99 ms", "x runtime req/s", "x runtime p50",
              "p50 added ms", "per server cpu-s", "cpu ms per req|ev", "cpu: server", "engine", "client",
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
    print_table(table)
    for line in verdicts(summary):
        print(line)


def report_profiles(profile: Path, top: int = 25) -> None:
    for path in sorted(profile.glob("*.prof")):
        if not path.stat().st_size:
            continue
        print(f"\n=== {path.name}: top {top} by own time ===", file=sys.stderr)
        stats = pstats.Stats(str(path), stream=sys.stderr)
        stats.sort_stats("tottime").print_stats(top)


def names(parser: argparse.ArgumentParser, value: str, known: dict[str, str], what: str) -> list[str]:
    wanted = list(known) if value == "all" else value.split(",")
    unknown = sorted(set(wanted) - set(known))
    if unknown:
        parser.error(f"unknown {what}: {', '.join(unknown)}; known: {', '.join(known)} or all")
    return [name for name in known if name in wanted]


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="one JSON object per case")
    parser.add_argument("--quick", action="store_true", help="smoke run: one repetition of 0.3 s")
    parser.add_argument("--duration", type=float, help="measured seconds per run (default 3, quick 0.3)")
    parser.add_argument("--warmup", type=float, help="unmeasured seconds before each run (default 1, quick 0.1)")
    parser.add_argument("--repeats", type=int, help="repetitions; medians are reported (default 3, quick 1)")
    parser.add_argument("--stream-concurrency", type=int, default=STREAM_CONCURRENCY,
                        help=f"concurrent streams in the stream cases (default {STREAM_CONCURRENCY})")
    parser.add_argument("--runtimes", default="all", help=f"comma-separated of {', '.join(RUNTIMES)} (default all)")
    parser.add_argument("--targets", default=",".join(DEFAULT_KINDS),
                        help=f"comma-separated of {', '.join(KINDS)}, or all (default {','.join(DEFAULT_KINDS)}); "
                        "litellm, sglang and vllm are installed on first use into ignored venvs (peers.py)")
    parser.add_argument("--cases", help="comma-separated subset of the case names (default: all)")
    parser.add_argument("--baseline", type=Path, help="another checkout of infx (git worktree add DIR COMMIT): "
                        "its dial-in path runs beside this tree's as target base (named in --targets, or all)")
    parser.add_argument("--profile", type=Path, help="directory for cProfile stats of the gateways and engine "
                        "agents; their top functions are printed on stderr at the end")
    options = parser.parse_args(argv)
    duration = options.duration if options.duration is not None else (0.3 if options.quick else 3.0)
    warmup = options.warmup if options.warmup is not None else (0.1 if options.quick else 1.0)
    repeats = options.repeats if options.repeats is not None else (1 if options.quick else 3)
    runtimes = names(parser, options.runtimes, RUNTIMES, "runtimes")
    kinds = names(parser, options.targets, KINDS, "targets")
    if options.baseline is None:
        kinds = [kind for kind in kinds if kind not in ("base", "base-url")]
    elif not (options.baseline / "infx" / "tap.py").is_file():
        parser.error(f"--baseline {options.baseline}: not a checkout of infx (no infx/tap.py)")
    else:
        options.baseline = options.baseline.resolve()
        kinds = kinds if "base" in kinds or "base-url" in kinds else [*kinds, "base"]
    target_names = [target_name(kind, None if kind in RUNTIMELESS else runtime)
                    for kind in kinds for runtime in (runtimes if kind not in RUNTIMELESS else [None])]
    all_cases = cases(target_names, options.stream_concurrency)
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
        needed = {case.target for case in all_cases}
        needed_kinds = {kind for kind in kinds if any(target_name(kind, None if kind in RUNTIMELESS else runtime)
                                                      in needed for runtime in runtimes)}
        try:
            processes = Processes(logs, options.profile, runtimes, [k for k in kinds if k in needed_kinds],
                                  options.baseline)
        except BenchError as error:
            print(f"error: {error}", file=sys.stderr)
            return 1
        try:
            runs = measure(all_cases, processes.targets, bodies, repeats, duration, warmup)
        finally:
            processes.stop()
    rows = summarise(all_cases, processes.targets, runs)
    if options.json:
        for row in rows:
            print(json.dumps(row))
    else:
        report_table(rows, repeats, duration, options.stream_concurrency)
    if options.profile is not None:
        report_profiles(options.profile)
    return 0 if all(row["runs"] == repeats for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
