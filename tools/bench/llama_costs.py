"""What llama-server's iterations cost: the constants of the routing simulation's runtime model, measured.

Starts ``llama-server`` (one slot, one thread, the prompt cache off) on a
model of :mod:`harness.gguf_models` and measures, as CPU seconds of the
server process (what a dedicated core would take; wall time grows with
whatever else shares the machine, and is printed beside):

- prefill: prompts of 128 to 2,048 random tokens with one token to
  generate; a least-squares fit of ``iteration + N x prompt_token +
  N^2/2 x prompt_token_per_position`` (attention over the tokens before);
- generation: 33 tokens after prompts of 64 to 2,048 tokens; a fit of the
  cost of one generated token as ``generated_token + context x
  generated_token_per_position``.

It prints them as :class:`harness.sim.routing.llama.LlamaCosts` arguments.

    .venv/bin/python tools/bench/llama_costs.py               # the BENCH model
    .venv/bin/python tools/bench/llama_costs.py --model tiny
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import urllib.request
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from harness.gguf_models import BENCH, TINY, write_model  # noqa: E402
from harness.llama_server import LlamaCppServer  # noqa: E402


def complete(server: LlamaCppServer, tokens: list[int], n_predict: int) -> tuple[dict[str, float], float]:
    """(the answer's timings, the server's CPU seconds) for one uncached prompt."""
    body = {"prompt": tokens, "n_predict": n_predict, "cache_prompt": False, "temperature": 0, "ignore_eos": True}
    request = urllib.request.Request(server.url + "/completion", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    before = server.cpu_seconds()
    with urllib.request.urlopen(request, timeout=600) as response:
        answer = json.loads(response.read())
    return answer["timings"], server.cpu_seconds() - before


def fit(xs: list[list[float]], ys: list[float]) -> list[float]:
    """Least squares: the coefficients c minimising sum((xs[i] . c - ys[i])^2) (normal equations)."""
    n = len(xs[0])
    a = [[sum(x[i] * x[j] for x in xs) for j in range(n)] for i in range(n)]
    b = [sum(x[i] * y for x, y in zip(xs, ys)) for i in range(n)]
    for col in range(n):  # Gauss-Jordan
        pivot = max(range(col, n), key=lambda r: abs(a[r][col]))
        a[col], a[pivot], b[col], b[pivot] = a[pivot], a[col], b[pivot], b[col]
        for row in range(n):
            if row != col:
                factor = a[row][col] / a[col][col]
                a[row] = [v - factor * p for v, p in zip(a[row], a[col])]
                b[row] -= factor * b[col]
    return [b[i] / a[i][i] for i in range(n)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=("bench", "tiny"), default="bench")
    parser.add_argument("--runs", type=int, default=3, help="runs per point (medians)")
    args = parser.parse_args()
    shape = BENCH if args.model == "bench" else replace(TINY, context_length=4096)
    rng = random.Random(0)
    lengths = (128, 512, 1024, 2048)
    contexts = (64, 1024, 2048)
    generated = 33
    with tempfile.TemporaryDirectory(prefix="infx-llama-costs-") as tmp:
        model = write_model(Path(tmp) / "model.gguf", shape)
        server = LlamaCppServer(model, Path(tmp), slots=1, context_per_slot=4096, threads=1)
        try:
            complete(server, [rng.randrange(256) for _ in range(64)], 2)  # first-use costs out of the way
            prefill = {n: [complete(server, [rng.randrange(256) for _ in range(n)], 1) for _ in range(args.runs)]
                       for n in lengths}
            decode = {c: [complete(server, [rng.randrange(256) for _ in range(c)], generated)
                          for _ in range(args.runs)] for c in contexts}
        finally:
            server.stop()
    prefill_cpu = {n: statistics.median(cpu for _, cpu in runs) for n, runs in prefill.items()}
    prefill_wall = {n: statistics.median(t["prompt_ms"] / 1000 for t, _ in runs) for n, runs in prefill.items()}
    iteration, per_token, per_position = fit([[1.0, n, n * n / 2] for n in lengths], [prefill_cpu[n] for n in lengths])
    # CPU of the generation: the whole request's, less its prefill (from the fit), over the tokens generated.
    step_cpu = {c: statistics.median(cpu for _, cpu in runs) for c, runs in decode.items()}
    steps = {c: (step_cpu[c] - (iteration + c * per_token + c * c / 2 * per_position)) / (generated - 1)
             for c in contexts}
    step_wall = {c: statistics.median(t["predicted_ms"] / 1000 / t["predicted_n"] for t, _ in runs)
                 for c, runs in decode.items()}
    generated_token, generated_per_position = fit([[1.0, c] for c in contexts], [steps[c] for c in contexts])
    print(f"{args.model} model, one thread, medians of {args.runs}:")
    for n in lengths:
        print(f"  prefill {n:5d} tokens: {prefill_cpu[n]:.3f} s CPU, {prefill_wall[n]:.3f} s wall")
    for c in contexts:
        print(f"  a generated token after {c:5d}: {steps[c] * 1000:.2f} ms CPU, {step_wall[c] * 1000:.2f} ms wall")
    print(f"LlamaCosts(iteration={max(iteration, 0.0):.3g}, prompt_token={per_token:.3g}, "
          f"prompt_token_per_position={max(per_position, 0.0):.3g}, generated_token={max(generated_token, 0.0):.3g}, "
          f"generated_token_per_position={max(generated_per_position, 0.0):.3g})")


if __name__ == "__main__":
    main()
