"""Status traffic between gateways, from the deterministic simulation (``harness/sim``).

For each shape (gateways x engines) it runs the same seeds and counts the
``ServerStatus`` messages the gateways' internal servers received and their
bytes, per gateway and per virtual second, with the request and fault load of
the simulation's defaults. Counts come from the simulation's own stats
(``status_reports``, ``status_bytes``), so two trees can be compared by
running this file in each (the simulation is deterministic per seed).

Run: ``.venv/bin/python tools/bench/status_traffic.py [--shapes 3x5,10x30,20x100] [--seeds 3]
[--steps 100] [--json]``.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import Counter

from harness.sim.cluster import SimConfig, run_seed


def measure(gateways: int, engines: int, seeds: int, steps: int) -> dict[str, object]:
    """Status messages and bytes per gateway over ``seeds`` runs of one shape."""
    totals: Counter[str] = Counter()
    virtual = 0.0
    started = time.perf_counter()
    failed = 0
    for seed in range(seeds):
        result = run_seed(seed, SimConfig(steps=steps, gateways=gateways, engines=(engines, engines)))
        totals.update(result.stats)
        virtual += result.virtual_time
        failed += not result.ok
    per_gateway = gateways * seeds
    return {
        "gateways": gateways,
        "engines": engines,
        "seeds": seeds,
        "steps": steps,
        "failed_seeds": failed,
        "status_messages_per_gateway": round(totals["status_reports"] / per_gateway, 1),
        "status_bytes_per_gateway": round(totals["status_bytes"] / per_gateway),
        "status_bytes_per_gateway_per_s": round(totals["status_bytes"] / gateways / virtual, 1),
        "virtual_seconds": round(virtual, 1),
        "wall_seconds": round(time.perf_counter() - started, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="3x5,10x30,20x100", help="gateways x engines, comma separated")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=100, help="fault-phase steps per seed")
    parser.add_argument("--json", action="store_true", help="one JSON object per shape and line")
    args = parser.parse_args()
    for shape in args.shapes.split(","):
        gateways, engines = (int(part) for part in shape.lower().split("x"))
        record = measure(gateways, engines, args.seeds, args.steps)
        if args.json:
            print(json.dumps(record), flush=True)
        else:
            print(f"{gateways:>3} gateways x {engines:>4} engines: {record['status_messages_per_gateway']:>9} "
                  f"messages, {record['status_bytes_per_gateway']:>11,} bytes per gateway "
                  f"({record['status_bytes_per_gateway_per_s']:,} B/s); {record['failed_seeds']} seeds failed, "
                  f"{record['wall_seconds']} s", flush=True)


if __name__ == "__main__":
    main()
