"""``python -m tests.sim``: run a campaign of seeds, or replay one (``tools/sim`` wraps this).

    tools/sim --seeds 1000            seeds 0..999, summary at the end
    tools/sim --seed 17 --steps 500   replay one seed, with its violation if any
    tools/sim --seeds 200 --jobs 2    the campaign on two processes

Exit status 1 if any seed violated an invariant; each failing seed prints
the command that replays it.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import Counter
from concurrent.futures import ProcessPoolExecutor

from tests.sim.cluster import SimConfig, SimResult, run_seed


def _run(args: tuple[int, int]) -> SimResult:
    seed, steps = args
    result = run_seed(seed, SimConfig(steps=steps))
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
    options = parser.parse_args(argv)

    seeds = [options.seed] if options.seed is not None else list(range(options.first, options.first + options.seeds))
    started = time.perf_counter()
    work = [(seed, options.steps) for seed in seeds]
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
    print(f"{len(results)} seeds x {options.steps} fault-phase steps: {len(results) - len(failed)} passed, "
          f"{len(failed)} failed, in {elapsed:.1f}s")
    print(f"  steps {totals['steps']}, requests {totals['requests']} (completed {totals['requests_completed']}, "
          f"failed with a status {totals['requests_failed']}, 504 {totals['deadlines_expired']}), "
          f"probes {totals['probes']}, invariant checks {totals['invariant_checks']}")
    print("  faults injected: " + ", ".join(f"{kind} {count}" for kind, count in sorted(faults.items())))
    print(f"  runtime faults: stalls {totals['runtime_stalls']}, 500s {totals['runtime_500']}, "
          f"503s {totals['runtime_503']}; gateway restarts {totals['gateway_restarts']}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
