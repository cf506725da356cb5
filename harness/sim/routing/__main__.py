"""``python -m harness.sim.routing`` (``tools/routing_sim``): the side-by-side routing table.

Every workload, policy and gateway count on the same seeds; figures are means
over the seeds. ``--check`` also prints the issue's targets and exits 1 if one is missed
(the bursty tenant's only with ``--fair-queue N``: without a cap no request
is held, so no queue can be fair).
"""

from __future__ import annotations

import argparse
import statistics
import sys

from harness.sim.routing.run import POLICIES, Result, simulate
from harness.sim.routing.runtime import RuntimeSpec
from harness.sim.routing.workloads import WORKLOADS
from protocol.processor.config import ProcessorConfig


def _row(results: list[Result]) -> dict[str, float]:
    def mean(values: list[float]) -> float:
        return statistics.fmean(values)

    return {
        "hit": mean([r.hit_rate for r in results]),
        "ttft_mean": mean([r.ttft_mean() for r in results]),
        "ttft_p99": mean([r.ttft_p99() for r in results]),
        "tokens": mean([r.tokens_per_second for r in results]),
        "imbalance": mean([r.load_imbalance for r in results]),
        "failed": sum(r.failed for r in results),
        "steady_p99": mean([r.ttft_p99("steady") for r in results]) if results[0].ttft.get("steady") else float("nan"),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=3, help="seeds 1..N [default: 3]")
    parser.add_argument("--duration", type=float, default=60.0, help="simulated seconds per run [default: 60]")
    parser.add_argument("--warmup", type=float, default=10.0, help="seconds not measured [default: 10]")
    parser.add_argument("--scale", type=float, default=1.0, help="clients, relative to the default [default: 1]")
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--cache-blocks", type=int, default=RuntimeSpec().cache_blocks, metavar="N",
                        help=f"each runtime's KV cache in blocks of 16 tokens [default: {RuntimeSpec().cache_blocks}, "
                             "an A100 40 GB's for an 8B model]")
    parser.add_argument("--fair-queue", type=int, default=0, metavar="N",
                        help="each gateway keeps at most N tasks on an engine (--max-in-flight-per-engine), "
                             "holding the rest in its fair queue [default: 0, no cap]")
    parser.add_argument("--fair-reserve", type=int, default=ProcessorConfig().fair_reserve, metavar="N",
                        help="with --fair-queue: each engine's last N slots are for the least-served caller "
                             f"(--fair-reserve) [default: {ProcessorConfig().fair_reserve}]")
    parser.add_argument("--check", action="store_true", help="print the targets and fail if one is missed")
    args = parser.parse_args(argv)
    table: dict[tuple[str, str, int], dict[str, float]] = {}
    print("| workload | policy | gateways | hit rate | TTFT mean s | TTFT p99 s | output tok/s | max/mean load | failed |")
    print("|---|---|---|---|---|---|---|---|---|")
    for workload in args.workloads.split(","):
        for gateways in (1, 3):
            for policy in args.policies.split(","):
                results = [simulate(workload, policy, gateways, seed, duration=args.duration, warmup=args.warmup,
                                    scale=args.scale, fair_queue=args.fair_queue, fair_reserve=args.fair_reserve,
                                    spec=RuntimeSpec(cache_blocks=args.cache_blocks))
                           for seed in range(1, args.seeds + 1)]
                row = table[(workload, policy, gateways)] = _row(results)
                print(f"| {workload} | {policy} | {gateways} | {row['hit']:.3f} | {row['ttft_mean']:.3f} | "
                      f"{row['ttft_p99']:.3f} | {row['tokens']:.0f} | {row['imbalance']:.2f} | {row['failed']} |",
                      flush=True)
    if not args.check:
        return 0
    missed = []
    print()
    for workload in ("shared-prefix", "multi-turn"):
        if not all((workload, policy, gateways) in table
                   for policy in ("affinity", "least_in_progress", "oracle") for gateways in (1, 3)):
            continue
        for gateways in (1, 3):
            infx, lip = table[(workload, "affinity", gateways)], table[(workload, "least_in_progress", gateways)]
            oracle = table[(workload, "oracle", gateways)]
            checks = {
                f"{workload} x{gateways}: throughput >= 2x least-in-progress ({infx['tokens'] / lip['tokens']:.2f}x)":
                    infx["tokens"] >= 2 * lip["tokens"],
                f"{workload} x{gateways}: hit rate within 10% of the oracle ({infx['hit'] / oracle['hit']:.3f})":
                    infx["hit"] >= 0.9 * oracle["hit"],
                f"{workload} x{gateways}: max/mean load <= 1.3 ({infx['imbalance']:.2f})": infx["imbalance"] <= 1.3,
            }
            if gateways == 3:
                one = table[(workload, "affinity", 1)]
                ratio = min(infx["hit"] / one["hit"], infx["tokens"] / one["tokens"])
                checks[f"{workload}: 3 gateways within 5% of 1 (hit and tok/s, worst {ratio:.3f})"] = ratio >= 0.95
            for name, ok in checks.items():
                print(f"{'ok  ' if ok else 'MISS'} {name}")
                if not ok:
                    missed.append(name)
    if ("bursty", "affinity", 1) in table and ("bursty-baseline", "affinity", 1) in table:
        for gateways in (1, 3):
            burst = table[("bursty", "affinity", gateways)]["steady_p99"]
            calm = table[("bursty-baseline", "affinity", gateways)]["steady_p99"]
            name = (f"bursty x{gateways}: other tenants' p99 TTFT {burst:.3f}s vs {calm:.3f}s without the burst "
                    f"({burst / calm:.2f}x; target <= 1.5x)")
            if not args.fair_queue:
                print(f"info {name}; requests are held, and fairly, only with --fair-queue N")
                continue
            ok = burst <= 1.5 * calm
            print(f"{'ok  ' if ok else 'MISS'} {name}")
            if not ok:
                missed.append(name)
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
