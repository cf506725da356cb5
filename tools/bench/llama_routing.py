"""Real-runtime routing benchmark (issue #17): llama.cpp servers behind engine agents, two gateways,
multi-turn conversations; prefix-cache reuse and time to first token per routing policy.

The cluster and what is measured are :mod:`harness.llama_routing`'s (the same
run, smaller, is ``tests/e2e/test_llama_routing.py``). Each policy gets a fresh
cluster; the model is a random-weight llama of :mod:`harness.gguf_models`,
made larger here (``--width``, ``--layers``, ``--context``) so that prefill
costs enough to show in the time to first token. Timings vary with the
machine and its load: this is a benchmark, not a test. Needs the test
extras (``llama-cpp-python[server]``, ``gguf``).

    .venv/bin/python tools/bench/llama_routing.py --policies affinity,least_in_progress
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from harness.gguf_models import ModelShape, write_model  # noqa: E402
from harness.llama_routing import LlamaWorkload, run_policy  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--policies", default="affinity,least_in_progress")
    parser.add_argument("--engines", type=int, default=3)
    parser.add_argument("--conversations", type=int, default=6)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--system-bytes", type=int, default=600)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--context", type=int, default=2048, help="the model's context window, tokens")
    parser.add_argument("--width", type=int, default=256, help="the model's embedding width (prefill cost)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--json", action="store_true", help="one JSON line per policy instead of a table")
    parser.add_argument("--logs", help="keep the processes' logs in this directory")
    args = parser.parse_args()
    shape = ModelShape("infx-routing-bench", context_length=args.context, width=args.width, layers=args.layers,
                       heads=2, feed_forward=2 * args.width)
    with tempfile.TemporaryDirectory(prefix="infx-llama-routing-") as scratch:
        tmp = args.logs or scratch
        model = write_model(Path(tmp) / "model.gguf", shape)
        workload = LlamaWorkload(engines=args.engines, conversations=args.conversations, turns=args.turns,
                            system_bytes=args.system_bytes, max_tokens=args.max_tokens, context=args.context)
        rows = [run_policy(p, workload, model, Path(tmp) / p).row() for p in args.policies.split(",")]
    if args.json:
        for row in rows:
            print(json.dumps(row))
        return
    print(f"{args.engines} llama.cpp servers (prompt cache on), 2 gateways, {args.conversations} conversations "
          f"x {args.turns} turns, {args.system_bytes}-token system prompts")
    print(f"{'policy':<18} {'hit rate':>8} {'prefill s':>9} {'TTFT mean':>9} {'TTFT p90':>9} "
          f"{'max/mean':>8}  requests per engine  errors")
    for r in rows:
        print(f"{r['policy']:<18} {r['hit_rate']:>8.1%} {r['prefill_s']:>9.2f} {r['ttft_mean_s'] or 0:>9.3f} "
              f"{r['ttft_p90_s'] or 0:>9.3f} {r['max_over_mean_load'] or 0:>8.2f}  "
              f"{str(r['requests_per_engine']):<20} {r['errors']}")


if __name__ == "__main__":
    main()
