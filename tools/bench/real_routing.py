"""Routing measured on real runtimes (issue #24): infx's policies beside sglang-router and vllm-router.

Every run starts three fresh llama.cpp servers (``-np 2 --metrics``, one
thread each, the same model), puts one router configuration in front of
them (1 or 3 replicas), sends one workload's scripted requests (the same
bytes for every router: :mod:`harness.real_routing.workloads`), and reads
the figures from the answers themselves: the runtime's ``timings.cache_n``
and ``prompt_n`` of each request and the engine that served it
(:mod:`harness.real_routing.figures`; the servers' ``/metrics`` counters are
checked against them). Runs are interleaved: run 1 of every configuration,
then run 2 of every one, ...; each figure printed is the median over the runs.

Routers (``--routers``, :data:`ROUTERS`):

- ``infx`` (default policy, affinity), ``infx-lip`` (least_in_progress),
  ``infx-rr`` (round_robin): real ``twistd infx`` gateways and one
  ``twistd infx-engine --runtime openai`` per server, defaults otherwise
  (:class:`harness.real_routing.run.InfxRouter`: one gateway, or three
  peered gateways holding one agent each); ``infx-noload`` is the default
  with the agents' runtime load reports off (``--runtime-load-interval 0``),
  ``infx-cap2`` the default with ``--max-in-flight-per-engine 2`` (the
  runtime's slots), ``infx-slotcap`` with ``--cap-at-runtime-slots``,
  ``infx-relay1`` with ``--status-interval 1`` (engines' loads and spilled
  tips reach peers within 0.25 s instead of 2.5 s), ``infx-kept`` the
  default with the agents keeping the runtimes' slots
  (``--runtime-slot-files``, its servers started with ``--slot-save-path``);
  ``infx-url`` the default with no agents, each server served by URL
  (``--runtime-url``) by the gateway its agent would have dialled, and
  ``infx-url-all`` by every gateway (as replicas that find the runtime
  pods by label serve them);
  ``infx-baseline`` the default of another checkout (``--baseline DIR``:
  the tree before a change, with its own ``.venv``), ``infx-url-all-baseline``
  that checkout by URL at every gateway, ``infx-kept-baseline`` with its
  agents keeping slots;
- ``sglang-ca`` / ``sglang-rr``: sglang-router 0.3.2, ``cache_aware`` /
  ``round_robin``, its defaults; ``vllm-ca`` / ``vllm-ch``: vllm-router
  0.1.17, ``cache_aware`` / ``consistent_hash`` (clients send the
  conversation's id in ``x-session-id``, the header it hashes first). Each
  replica is an independent process in front of all three servers
  (:mod:`peers`, installed on first use into ignored venvs beside this file).

    .venv/bin/python tools/bench/real_routing.py --runs 3                       # everything, hours
    .venv/bin/python tools/bench/real_routing.py --workloads shared --replicas 1 --routers infx,vllm-ch
    .venv/bin/python tools/bench/real_routing.py --quick                        # the suite's tiny run

``--quick`` runs a tenth of each workload on the tiny test model with infx's
policies only (no peer needed), one run. ``--json FILE`` writes every run's
figures. The machine's load changes wall times and first-token times (not the
cache figures): say what else ran beside it when quoting them.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, replace
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE))

from harness.gguf_models import BENCH, TINY, write_model  # noqa: E402
from harness.real_routing.figures import Figures, Record  # noqa: E402
from harness.real_routing.run import (  # noqa: E402
    MODEL, SLOTS, InfxRouter, RouterUnderTest, RunResult, run_once, with_bounds)
from harness.real_routing.workloads import WORKLOADS, make  # noqa: E402
from harness.sim.routing.llama import BENCH_COSTS, TINY_COSTS, LlamaCosts  # noqa: E402

#: Routers measured by default, in the order of the table.
DEFAULT_ROUTERS = ("infx", "infx-kept", "infx-lip", "infx-rr", "sglang-ca", "sglang-rr", "vllm-ca", "vllm-ch")
INFX_ROUTERS = ("infx", "infx-lip", "infx-rr")


class PeerRouter:
    """``replicas`` independent processes of sglang-router or vllm-router, each in front of every runtime."""

    def __init__(self, name: str, kind: str, policy: str) -> None:
        self.name = name
        self.kind = kind
        self.policy = policy
        self.slot_saves = False
        self.peers: list = []

    def start(self, urls: Sequence[str], replicas: int, logs: Path, groups: Sequence[str]) -> list[str]:
        import peers

        start = peers.start_sglang_router if self.kind == "sglang" else peers.start_vllm_router
        self.peers = []
        for i in range(replicas):
            self.peers.append(start(list(urls), self.policy, MODEL, logs, name=f"{self.name}-{i}"))
        return [f"http://127.0.0.1:{p.port}" for p in self.peers]

    def stop(self) -> None:
        for peer in self.peers:
            peer.stop()
        self.peers = []


#: ``infx-kept``'s agents keep this many contexts per runtime on disk (``--runtime-slot-files``): every
#: conversation of the largest workload (pressure's 40).
SLOT_FILES = 64

#: ``--baseline``: another checkout whose infx runs as ``infx-baseline`` (its default policy).
BASELINE: list[Path] = []


def router(name: str) -> RouterUnderTest:
    """A fresh router of configuration ``name`` (see the module docstring)."""
    makers = {
        "infx-baseline": lambda: InfxRouter("infx-baseline", checkout=BASELINE[0]),
        "infx-url-all-baseline": lambda: InfxRouter("infx-url-all-baseline", checkout=BASELINE[0],
                                                    by_url_everywhere=True),
        "infx": lambda: InfxRouter("infx"),
        "infx-lip": lambda: InfxRouter("infx-lip", policy="least_in_progress"),
        "infx-rr": lambda: InfxRouter("infx-rr", policy="round_robin"),
        "infx-noload": lambda: InfxRouter("infx-noload", agent_extra=["--runtime-load-interval", "0"]),
        "infx-cap2": lambda: InfxRouter("infx-cap2", gateway_extra=["--max-in-flight-per-engine", "2"]),
        "infx-slotcap": lambda: InfxRouter("infx-slotcap", gateway_extra=["--cap-at-runtime-slots"]),
        "infx-relay1": lambda: InfxRouter("infx-relay1", gateway_extra=["--status-interval", "1"]),
        "infx-kept": lambda: InfxRouter("infx-kept", slot_files=SLOT_FILES),
        "infx-kept-baseline": lambda: InfxRouter("infx-kept-baseline", checkout=BASELINE[0],
                                                 slot_files=SLOT_FILES),
        "infx-url": lambda: InfxRouter("infx-url", by_url=True),
        "infx-url-all": lambda: InfxRouter("infx-url-all", by_url_everywhere=True),
        "sglang-ca": lambda: PeerRouter("sglang-ca", "sglang", "cache_aware"),
        "sglang-rr": lambda: PeerRouter("sglang-rr", "sglang", "round_robin"),
        "vllm-ca": lambda: PeerRouter("vllm-ca", "vllm", "cache_aware"),
        "vllm-ch": lambda: PeerRouter("vllm-ch", "vllm", "consistent_hash"),
    }
    if name not in makers:
        raise SystemExit(f"unknown router {name!r}: one of {', '.join(makers)}")
    return makers[name]()


ROUTERS = ("infx", "infx-baseline", "infx-url-all-baseline", "infx-kept-baseline", "infx-lip", "infx-rr",
           "infx-noload", "infx-cap2", "infx-slotcap", "infx-relay1", "infx-kept", "infx-url", "infx-url-all",
           "sglang-ca", "sglang-rr", "vllm-ca", "vllm-ch")


def summary(figures: Sequence[Figures], slowdowns: Sequence[float] = ()) -> dict[str, float]:
    """The medians over runs of one configuration (``slowdowns``: each run's, see :func:`run_slowdown`)."""
    def median(values: list[float]) -> float:
        return statistics.median(values)

    groups = sorted({g for f in figures for g in f.group_p99})
    row = {
        "runs": len(figures),
        "errors": sum(f.errors for f in figures),
        "cached_share": median([f.cached_share for f in figures]),
        "prompt_computed": median([f.prompt_computed for f in figures]),
        "wall": median([f.wall for f in figures]),
        "ttft_p50": median([f.ttft_p50 for f in figures]),
        "ttft_p90": median([f.ttft_p90 for f in figures]),
        "ttft_p99": median([f.ttft_p99 for f in figures]),
        "max_over_mean": median([f.max_over_mean for f in figures]),
        "later_turns": median([f.later_turns for f in figures]),
        "moved": median([f.moved for f in figures]),
        "moved_off_free_home": median([f.moved_off_free_home for f in figures]),
        "bound_all": median([f.bound_all for f in figures]),
        "bound_capacity": median([f.bound_capacity for f in figures]),
    }
    for g in groups:
        row[f"p99_{g}"] = median([f.group_p99.get(g, float("nan")) for f in figures])
    if slowdowns:
        row["slowdown"] = median(list(slowdowns))
    return row


def _share(value: float) -> str:
    return "-" if math.isnan(value) else f"{value:.1%}"


def table(rows: dict[tuple[str, int, str], dict[str, float]]) -> str:
    """The medians as a markdown table, one row per (workload, replicas, router)."""
    slow = any("slowdown" in row for row in rows.values())
    lines = ["| workload | replicas | router | cached share | prompt tokens computed | wall s | TTFT p50 / p90 / p99 s "
             "| per-tenant p99 s | max/mean requests per engine | later turns moved (off a free home) | errors "
             "| bound: all / capacity |" + (" runtime slowdown |" if slow else ""),
             "|---|---|---|---|---|---|---|---|---|---|---|---|" + ("---|" if slow else "")]
    for (workload, replicas, name), row in rows.items():
        tenants = ", ".join(f"{k[4:]} {v:.2f}" for k, v in row.items() if k.startswith("p99_"))
        lines.append(
            f"| {workload} | {replicas} | {name} | {row['cached_share']:.1%} | {row['prompt_computed']:,.0f} | "
            f"{row['wall']:.1f} | {row['ttft_p50']:.2f} / {row['ttft_p90']:.2f} / {row['ttft_p99']:.2f} | "
            f"{tenants} | {row['max_over_mean']:.2f} | {row['moved']:.0f} of {row['later_turns']:.0f} "
            f"({row['moved_off_free_home']:.0f}) | {row['errors']:.0f} | {_share(row['bound_all'])} / "
            f"{_share(row['bound_capacity'])} |" + (f" x{row['slowdown']:.1f} |" if slow else ""))
    return "\n".join(lines)


#: The infx configurations the simulation runs: (policy, runtime load reports, --max-in-flight-per-engine,
#: --runtime-slot-files).
SIMULATED = {"infx": ("affinity", True, None, 0), "infx-lip": ("least_in_progress", True, None, 0),
             "infx-rr": ("round_robin", True, None, 0), "infx-noload": ("affinity", False, None, 0),
             "infx-cap2": ("affinity", True, 2, 0), "infx-kept": ("affinity", True, None, SLOT_FILES)}


PROMPT_EVAL = re.compile(r"prompt eval time =\s*([\d.]+) ms /\s*(\d+) tokens")


def run_slowdown(logs: Path, run: dict, costs: LlamaCosts) -> float:
    """How much slower the run's runtimes read prompts than ``costs`` say a core does: the seconds their logs
    give (``prompt eval time``) over the model's cost of the prompt tokens the run's answers say they computed
    (the machine's other work, and prompts read in one batch with another's, both show in it)."""
    seconds = sum(float(m.group(1)) / 1000 for log in (logs / run_dir(run)).glob("llama-e*.log")
                  for m in PROMPT_EVAL.finditer(log.read_text(errors="replace")))
    model = sum(costs.iteration_seconds([(r["cache_n"], r["cache_n"] + r["prompt_n"])], []) for r in run["records"])
    return seconds / model if model else 1.0


#: Changes to infx's default the simulation can try: keyword arguments of ``simulate_run`` (load reports,
#: RoutingConfig and ProcessorConfig fields, a home per session).
WHAT_IF: dict[str, dict] = {
    "default": {},
    "no load reports": {"load_reports": False},
    "cap at the slots": {"processor": {"cap_at_runtime_slots": True}},
    "busy weight 0": {"routing": {"busy_weight": 0.0}},
    "home per session": {"home_by_session": True},
    "relay within 0.25 s": {"relay_interval": 0.25},
    "slots kept": {"slot_files": SLOT_FILES},
}


def what_if(workloads: Sequence[str], replica_counts: Sequence[int], runs: int, slowdown: float) -> int:
    """Medians over seeds 1..runs of the simulated figures of each :data:`WHAT_IF` change."""
    from harness.sim.routing.real_bench import simulate_run

    print(f"simulated, runtime costs x{slowdown:g}, medians of {runs} seed(s)")
    print("| workload | replicas | infx | cached share | TTFT p50 / p90 s | max/mean requests per engine "
          "| later turns moved (off a free home) |")
    print("|---|---|---|---|---|---|---|")
    for workload in workloads:
        for replicas in replica_counts:
            for name, change in WHAT_IF.items():
                figures = [simulate_run(make(workload, seed), "affinity", replicas, seed,
                                        costs=BENCH_COSTS.scaled(slowdown), **change).figures
                           for seed in range(1, runs + 1)]
                row = summary(figures)
                print(f"| {workload} | {replicas} | {name} | {row['cached_share']:.1%} | {row['ttft_p50']:.2f} / "
                      f"{row['ttft_p90']:.2f} | {row['max_over_mean']:.2f} | {row['moved']:.0f} of "
                      f"{row['later_turns']:.0f} ({row['moved_off_free_home']:.0f}) |", flush=True)
    return 0


def retable(path: Path, logs: Path | None) -> int:
    """The medians table of the runs in ``path``, in the order they ran."""
    runs = json.loads(path.read_text())
    grouped: dict[tuple[str, int, str], list[dict]] = {}
    for run in runs:
        grouped.setdefault((run["workload"], run["replicas"], run["router"]), []).append(run)
    workloads = list(dict.fromkeys(r["workload"] for r in runs))
    routers = list(dict.fromkeys(r["router"] for r in runs))
    rows = {}
    for key in sorted(grouped, key=lambda k: (workloads.index(k[0]), k[1], routers.index(k[2]))):
        slowdowns = [run_slowdown(logs, run, model_costs(run)) for run in grouped[key]] if logs else []
        rows[key] = summary([_bounded(run) for run in grouped[key]], slowdowns)
    print(f"medians of {max(len(v) for v in grouped.values())} run(s) per configuration, from {path.name}")
    print(table(rows))
    return 0


def _bounded(run: dict) -> Figures:
    """A run's figures from its JSON, with the bounds on its cached share computed from its records where the
    run is older than them."""
    found = Figures(**run["figures"])
    if "bound_all" in run["figures"]:
        return found
    shape = BENCH if run.get("model", "bench") == "bench" else replace(TINY, context_length=8192)
    return with_bounds(found, [Record(**r) for r in run["records"]], make(run["workload"], run["seed"],
                       run.get("scale", 1.0)), shape, len(found.per_engine), SLOTS)


def model_costs(run: dict) -> LlamaCosts:
    """The simulation's runtime costs for the model a run served."""
    return TINY_COSTS if run.get("model") == "tiny" else BENCH_COSTS


def run_dir(run: dict) -> str:
    return f"{run['workload']}-x{run['replicas']}-{run['router']}-{run['seed']}"


def simulate(path: Path, slowdown: float | None, logs: Path | None) -> int:
    """Every infx run of ``path`` simulated; the medians of real and simulated cached shares, and the check."""
    from harness.sim.routing.real_bench import calibration_problems, simulate_run

    if slowdown is None and logs is None:
        raise SystemExit("--simulate needs --logs (the real runs' logs) or --sim-slowdown")

    runs = [r for r in json.loads(path.read_text()) if r["router"] in SIMULATED]
    scale = runs[0].get("scale", 1.0) if runs else 1.0
    model = runs[0].get("model", "bench") if runs else "bench"
    costs, shape = (BENCH_COSTS, BENCH) if model == "bench" else (TINY_COSTS, TINY)
    real: dict[tuple[str, int, str], list[float]] = {}
    simulated: dict[tuple[str, int, str], list[float]] = {}
    slowdowns = []
    for run in runs:
        policy, load_reports, cap, slot_files = SIMULATED[run["router"]]
        key = (run["workload"], run["replicas"], run["router"])
        factor = slowdown if slowdown is not None else run_slowdown(logs, run, costs)  # type: ignore[arg-type]
        slowdowns.append(factor)
        sim = simulate_run(make(run["workload"], run["seed"], scale), policy, run["replicas"], run["seed"],
                           costs=costs.scaled(factor), bytes_per_token=shape.kv_bytes_per_token,
                           load_reports=load_reports, max_in_flight=cap, slot_files=slot_files)
        real.setdefault(key, []).append(run["figures"]["cached_share"])
        simulated.setdefault(key, []).append(sim.figures.cached_share)
    real_median = {k: statistics.median(v) for k, v in real.items()}
    sim_median = {k: statistics.median(v) for k, v in simulated.items()}
    print(f"cached share, real and simulated (runtime costs x{min(slowdowns):.1f} to x{max(slowdowns):.1f}), "
          f"medians of the runs in {path.name}")
    print("| workload | replicas | router | real | simulated | difference |")
    print("|---|---|---|---|---|---|")
    for key in sorted(real_median):
        r, sim_share = real_median[key], sim_median[key]
        print(f"| {key[0]} | {key[1]} | {key[2]} | {r:.1%} | {sim_share:.1%} | {(sim_share - r) * 100:+.1f} |")
    problems = calibration_problems(real_median, sim_median)
    for problem in problems:
        print(f"MISS {problem}")
    print("calibrated: every share within 3 points, the same ranking" if not problems else
          f"{len(problems)} miss(es)")
    return 1 if problems else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--routers", default=",".join(DEFAULT_ROUTERS), help=f"of {', '.join(ROUTERS)}")
    parser.add_argument("--replicas", default="1,3", help="router replicas, e.g. 1,3")
    parser.add_argument("--runs", type=int, default=3, help="runs of each configuration (seeds 1..N)")
    parser.add_argument("--scale", type=float, default=1.0, help="clients and conversations, relative")
    parser.add_argument("--model", choices=("bench", "tiny"), default="bench",
                        help="harness.gguf_models' BENCH (prefill shows in first-token times) or TINY")
    parser.add_argument("--quick", action="store_true",
                        help="the suite's run: tiny model, a tenth of each workload, infx's policies, 1 run")
    parser.add_argument("--json", metavar="FILE", help="write every run's figures here")
    parser.add_argument("--simulate", metavar="FILE",
                        help="start nothing: simulate every infx run of a --json FILE of real runs (the same requests, "
                             "seeds and replicas) and print the real and simulated cached shares side by side")
    parser.add_argument("--table", metavar="FILE",
                        help="start nothing: print the medians of a --json FILE of runs (with --logs, each "
                             "configuration's runtime slowdown too)")
    parser.add_argument("--what-if", action="store_true",
                        help="start nothing: simulate infx's default and changes to it (WHAT_IF) on the workloads, "
                             "replicas and runs given, at --sim-slowdown (default 1)")
    parser.add_argument("--sim-slowdown", type=float, default=None,
                        help="with --simulate: the runtimes' costs times this [default: each run's own, from the "
                             "llama-servers' logs under --logs: their prompt eval time over the model's cost]")
    parser.add_argument("--logs", metavar="DIR", help="keep every process's log here")
    parser.add_argument("--baseline", metavar="DIR",
                        help="another checkout (with its own .venv, as tools/test makes it) whose infx runs as the "
                             "router infx-baseline, e.g. the tree before a routing change")
    parser.add_argument("--first-seed", type=int, default=1, help="the first run's seed (runs take the next ones)")
    args = parser.parse_args(argv)
    if args.baseline:
        BASELINE.append(Path(args.baseline).resolve())
    if args.what_if:
        return what_if(args.workloads.split(","), [int(r) for r in args.replicas.split(",")], args.runs,
                       args.sim_slowdown or 1.0)
    if args.table:
        return retable(Path(args.table), Path(args.logs) if args.logs else None)
    if args.simulate:
        return simulate(Path(args.simulate), args.sim_slowdown, Path(args.logs) if args.logs else None)
    # A SIGTERM ends the run as Ctrl-C does: every process started is stopped on the way out.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if args.quick:
        args.model, args.scale, args.runs = "tiny", 0.1, 1
        if args.routers == ",".join(DEFAULT_ROUTERS):
            args.routers = ",".join(INFX_ROUTERS)
    workloads = args.workloads.split(",")
    names = args.routers.split(",")
    replica_counts = [int(r) for r in args.replicas.split(",")]
    for name in names:
        router(name)  # unknown names fail before anything starts
    with tempfile.TemporaryDirectory(prefix="infx-real-routing-") as scratch:
        logs = Path(args.logs or scratch)
        logs.mkdir(parents=True, exist_ok=True)
        shape = BENCH if args.model == "bench" else replace(TINY, context_length=8192)
        model = logs / f"{shape.name}.gguf"
        if not model.exists():
            write_model(model, shape)
        results: dict[tuple[str, int, str], list[RunResult]] = {}
        failed: list[str] = []
        every: list[dict] = []
        started = time.monotonic()
        for seed in range(args.first_seed, args.first_seed + args.runs):
            for workload_name in workloads:
                workload = make(workload_name, seed, args.scale)
                for replicas in replica_counts:
                    for name in names:
                        run_logs = logs / f"{workload_name}-x{replicas}-{name}-{seed}"
                        try:
                            result = run_once(workload, router(name), model, shape, run_logs, replicas=replicas,
                                              seed=seed, progress=lambda text: print(
                                                  f"[{time.monotonic() - started:7.0f} s] {text}", file=sys.stderr,
                                                  flush=True))
                        except Exception as e:  # one run lost is said and counted; the others go on
                            print(f"    run failed: {type(e).__name__}: {str(e)[:2000]}", file=sys.stderr, flush=True)
                            failed.append(f"{workload_name} x{replicas} {name} seed {seed}: {type(e).__name__}")
                            continue
                        results.setdefault((workload_name, replicas, name), []).append(result)
                        f = result.figures
                        print(f"    cached {f.cached_share:.1%}, computed {f.prompt_computed}, wall {f.wall:.1f} s, "
                              f"TTFT p50 {f.ttft_p50:.2f} p90 {f.ttft_p90:.2f}, engines {f.per_engine}, "
                              f"moved {f.moved}/{f.later_turns} ({f.moved_off_free_home} off a free home), "
                              f"errors {f.errors}, bound {_share(f.bound_all)} / {_share(f.bound_capacity)}",
                              file=sys.stderr, flush=True)
                        every.append({"workload": workload_name, "replicas": replicas, "router": name, "seed": seed,
                                      "model": args.model, "scale": args.scale,
                                      "figures": asdict(f), "counted": result.counted,
                                      "load_average": result.load_average,
                                      "records": [asdict(r) for r in result.records]})
                        if args.json:
                            Path(args.json).write_text(json.dumps(every, indent=1))
        rows = {key: summary([r.figures for r in runs]) for key, runs in sorted(results.items(), key=lambda kv: (
            workloads.index(kv[0][0]), kv[0][1], names.index(kv[0][2])))}
    print(f"{args.model} model, 3 llama-servers (-np 2, one thread each), medians of {args.runs} run(s)")
    print(table(rows))
    for run in failed:
        print(f"failed: {run}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
