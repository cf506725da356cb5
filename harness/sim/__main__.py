"""``python -m harness.sim``: run a campaign of seeds, or replay one (``tools/sim`` wraps this).

    tools/sim --seeds 1000            seeds 0..999, summary at the end
    tools/sim --seed 17 --steps 500   replay one seed, with its violation if any
    tools/sim --seeds 200 --jobs 2    the campaign on two processes
    tools/sim --gateways 50 --engines 500 --seeds 5
                                      a campaign at scale (shape and load options)
    tools/sim --report                the scale table (harness/sim/scale.py)

Exit status 1 if any seed violated an invariant; each failing seed prints
the command that replays it.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from collections import Counter
from concurrent.futures import ProcessPoolExecutor

from harness.sim.cluster import SimConfig, SimResult, run_seed


def _run(args: tuple[int, SimConfig]) -> SimResult:
    seed, config = args
    result = run_seed(seed, config)
    if result.violation is not None:
        # Exceptions do not always pickle with their cause; keep the text.
        result.violation.__cause__ = None
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tools/sim", description=__doc__.splitlines()[0])
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--seeds", type=int, default=20, help="run seeds FIRST..FIRST+N-1 (default 20)")
    which.add_argument("--seed", type=int, help="replay this one seed")
    parser.add_argument("--first", type=int, default=0, help="first seed of a campaign (default 0)")
    parser.add_argument("--steps", type=int, default=SimConfig().steps, help="steps of the fault phase per seed")
    parser.add_argument("--jobs", type=int, default=1, help="processes for a campaign (default 1)")
    parser.add_argument("--verbose", "-v", action="store_true", help="one line per seed")
    default = SimConfig()
    shape = parser.add_argument_group("shape and load")
    shape.add_argument("--gateways", type=_positive, default=default.gateways,
                       help=f"gateway replicas, a full mesh (default {default.gateways})")
    shape.add_argument("--engines", type=_engine_range, default=default.engines, metavar="N|LOW-HIGH",
                       help="engines in total, spread over the gateways; a range draws per seed "
                            f"(default {default.engines[0]}-{default.engines[1]})")
    shape.add_argument("--models", type=_positive, default=len(default.models),
                       help=f"models m1..mN; each engine serves a random subset (default {len(default.models)})")
    shape.add_argument("--tenants", type=_positive, default=len(default.tenants),
                       help=f"tenants t1..tN (default {len(default.tenants)})")
    shape.add_argument("--request-interval", type=_seconds, default=default.request_interval,
                       help=f"mean virtual seconds between client requests (default {default.request_interval:g})")
    shape.add_argument("--fault-interval", type=_seconds, default=default.fault_interval,
                       help=f"mean virtual seconds between faults (default {default.fault_interval:g})")
    shape.add_argument("--duration", type=_seconds, default=None,
                       help="end the fault phase at this virtual time instead of after --steps")
    parser.add_argument("--full-checks", action="store_true",
                        help="recompute every invariant after every step (not incrementally)")
    parser.add_argument("--report", action="store_true",
                        help="print the scale table (3, 10, 25, 50 gateways) instead of a campaign")
    options = parser.parse_args(argv)
    if options.report:
        from harness.sim.scale import main as report

        return report()
    config = dataclasses.replace(
        default, steps=options.steps, gateways=options.gateways, engines=options.engines,
        models=tuple(f"m{i}" for i in range(1, options.models + 1)) if options.models != len(default.models)
        else default.models,
        tenants=tuple(f"t{i}" for i in range(1, options.tenants + 1)),
        request_interval=options.request_interval, fault_interval=options.fault_interval,
        duration=options.duration, full_checks=options.full_checks)

    seeds = [options.seed] if options.seed is not None else list(range(options.first, options.first + options.seeds))
    started = time.perf_counter()
    work = [(seed, config) for seed in seeds]
    if options.jobs > 1 and len(seeds) > 1:
        with ProcessPoolExecutor(options.jobs) as pool:
            results = list(pool.map(_run, work, chunksize=4))
    else:
        results = [_run(item) for item in work]
    elapsed = time.perf_counter() - started

    totals: Counter[str] = Counter()
    faults: Counter[str] = Counter()
    failed = []
    for result in results:
        totals.update(result.stats)
        faults.update(result.faults)
        if not result.ok:
            failed.append(result)
        if options.verbose or options.seed is not None:
            print(f"{result.describe()}  [{result.stats['steps']} steps, {result.stats['requests']} requests, "
                  f"{result.virtual_time:.1f}s virtual, digest {result.digest}]")
    for result in failed:
        if not options.verbose and options.seed is None:
            print(result.describe())
    phase = f"{options.duration:g}s fault phase" if options.duration is not None else \
        f"{options.steps} fault-phase steps"
    print(f"{len(results)} seeds x {phase}{config.options()}: {len(results) - len(failed)} passed, "
          f"{len(failed)} failed, in {elapsed:.1f}s")
    print(f"  steps {totals['steps']}, requests {totals['requests']} (completed {totals['requests_completed']}, "
          f"failed with a status {totals['requests_failed']}, 504 {totals['deadlines_expired']}), "
          f"probes {totals['probes']}, invariant checks {totals['invariant_checks']}")
    print("  faults injected: " + ", ".join(f"{kind} {count}" for kind, count in sorted(faults.items())))
    print(f"  runtime faults: stalls {totals['runtime_stalls']}, 500s {totals['runtime_500']}, "
          f"503s {totals['runtime_503']}; gateway restarts {totals['gateway_restarts']}")
    phases = ("faults", "heal", "converge", "probe", "drain")
    print(f"  status reports {totals['status_reports']}; virtual seconds (steps) by phase: " + ", ".join(
        f"{name} {totals[f'ms_{name}'] / 1000:.1f} ({totals[f'steps_{name}']})" for name in phases))
    return 1 if failed else 0


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value


def _seconds(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, not {text}")
    return value


def _engine_range(text: str) -> tuple[int, int]:
    low, _, high = text.partition("-")
    bounds = (_positive(low), _positive(high or low))
    if bounds[0] > bounds[1]:
        raise argparse.ArgumentTypeError(f"empty range {text}")
    return bounds


if __name__ == "__main__":
    sys.exit(main())
