"""What one prefill costs llama.cpp's own server: a model shape's price per prompt, to size benchmark models.

Starts ``llama-server`` (:class:`harness.llama_server.LlamaCppServer`, one
slot, one thread) on a random-weight model of the given shape (default
:data:`harness.gguf_models.BENCH`) and sends ``--runs`` prompts of
``--tokens`` random byte tokens each with the prompt cache off, one at a
time. Reports the median of the server's own ``timings.prompt_ms`` (wall
time: it grows with whatever else shares the CPU) and of the CPU time the
server used per request (close to what the prefill takes on an idle core).
Needs the built server (``tools/test`` builds it, or ``python -m
harness.llama_server_build``).

    .venv/bin/python tools/bench/llama_prefill.py
    .venv/bin/python tools/bench/llama_prefill.py --width 384 --layers 6
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from harness.gguf_models import BENCH, ModelShape, write_model  # noqa: E402
from harness.llama_server import LlamaCppServer  # noqa: E402


def prefill(server: LlamaCppServer, tokens: list[int]) -> tuple[float, float]:
    """(the server's prompt_ms, the server's CPU seconds) for one uncached prompt."""
    body = {"prompt": tokens, "n_predict": 1, "cache_prompt": False, "temperature": 0}
    request = urllib.request.Request(server.url + "/completion", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    before = server.cpu_seconds()
    with urllib.request.urlopen(request, timeout=600) as response:
        answer = json.loads(response.read())
    timings = answer["timings"]
    assert timings["prompt_n"] == len(tokens) and timings["cache_n"] == 0, timings
    return timings["prompt_ms"], server.cpu_seconds() - before


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--width", type=int, default=BENCH.width)
    parser.add_argument("--layers", type=int, default=BENCH.layers)
    parser.add_argument("--heads", type=int, default=BENCH.heads)
    parser.add_argument("--feed-forward", type=int, default=BENCH.feed_forward)
    parser.add_argument("--tokens", type=int, default=1000, help="prompt length, tokens")
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    shape = ModelShape("infx-prefill-bench", context_length=max(BENCH.context_length, args.tokens + 64),
                       width=args.width, layers=args.layers, heads=args.heads, feed_forward=args.feed_forward)
    rng = random.Random(0)
    with tempfile.TemporaryDirectory(prefix="infx-llama-prefill-") as tmp:
        model = write_model(Path(tmp) / "model.gguf", shape)
        server = LlamaCppServer(model, Path(tmp), slots=1, context_per_slot=args.tokens + 64, threads=args.threads)
        try:
            prefill(server, [rng.randrange(256) for _ in range(64)])  # first-use costs out of the way
            runs = [prefill(server, [rng.randrange(256) for _ in range(args.tokens)]) for _ in range(args.runs)]
        finally:
            server.stop()
    wall = statistics.median(ms for ms, _ in runs) / 1000
    cpu = statistics.median(cpu for _, cpu in runs)
    print(f"width {shape.width}, {shape.layers} layers, {shape.heads} heads, feed-forward {shape.feed_forward} "
          f"({shape.parameters / 1e6:.1f} M parameters), {args.threads} thread(s): "
          f"{args.tokens}-token prefill median {wall:.3f} s wall (prompt_ms), {cpu:.3f} s CPU, {args.runs} runs")


if __name__ == "__main__":
    main()
