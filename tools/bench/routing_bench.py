"""Routing decisions among 500 engines of one model with affinity state for 100,000 conversations.

The production ``Processor`` (affinity policy) with ``--engines`` engines of
one model; ``--conversations`` conversations each send a first turn (with
routing hints from :func:`protocol.routing.hints.hints_from_json`) that
completes, which fills the prefix index and the session table. Then timed:
``--decisions`` next turns of random conversations, each ``submit`` (routing,
dispatch, index update) plus the engine's answer, and ``Router.choose``
alone. Memory: what the routing state takes (``tracemalloc``: traced memory
after filling it, less before: the hash ring, prefix index and session
table), and its entry counts.

Usage: ``python tools/bench/routing_bench.py [--engines 500] [--conversations 100000]
[--opening-words 600] [--json]``
"""

from __future__ import annotations

import argparse
import json
import random
import time
import tracemalloc

from protocol.pb import chat_pb2, status_pb2, worker_pb2
from protocol.processor.core import Locality, Processor, ProcessorConfig, SendTask
from protocol.routing.hints import RoutingHints, hints_from_json


def _hints(rng: random.Random, n: int, turn: int, words: int) -> RoutingHints:
    opening = f"conversation {n}: " + " ".join(str(rng.randrange(10**6)) for _ in range(words))
    messages = [{"role": "system", "content": "You are helpful."}, {"role": "user", "content": opening}]
    for t in range(turn):
        messages += [{"role": "assistant", "content": f"answer {t} " * 20}, {"role": "user", "content": f"more {t}"}]
    hints = hints_from_json("chat/completions", json.dumps({"model": "m", "messages": messages, "user": f"u{n}"}), {})
    assert hints is not None
    return hints


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engines", type=int, default=500)
    parser.add_argument("--conversations", type=int, default=100_000)
    parser.add_argument("--decisions", type=int, default=20_000)
    parser.add_argument("--opening-words", type=int, default=600,
                        help="numbers in each conversation's first message (600: about 16 blocks)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    rng = random.Random(1)
    first = [_hints(random.Random(n), n, 0, args.opening_words) for n in range(args.conversations)]
    later = {n: _hints(random.Random(n), n, 1, args.opening_words) for n in rng.sample(range(args.conversations), min(2000, args.conversations))}
    request = worker_pb2.TaskRequest(chat_completion=chat_pb2.CreateChatCompletionRequest(model="m", stream=False))
    answer = worker_pb2.HttpResponse(status_code=200)

    tracemalloc.start()
    processor = Processor(ProcessorConfig())
    for i in range(args.engines):
        status = status_pb2.EngineStatus(engine_id=f"engine-{i}", ready=True)
        status.models.add(id="m", is_ready=True)
        processor.update_engine(("route", i), "t", status, Locality.REMOTE, 0.0)
    seq = 0

    def turn(hints: RoutingHints) -> None:
        nonlocal seq
        seq += 1
        task_id = f"t{seq}"
        (send,) = [e for e in processor.submit(now=0.0, task_id=task_id, tenant_id="t", request=request, origin=None,
                                               hints=hints) if isinstance(e, SendTask)]
        processor.receive_result(send.route, worker_pb2.TaskResult(task_id=task_id, http_response=answer), 0.0)

    base, _ = tracemalloc.get_traced_memory()  # the engines, before any routing state (ring included)
    for hints in first:
        turn(hints)
    filled, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    state = processor._router.state_size()

    keys = list(later)
    picks = [later[keys[rng.randrange(len(keys))]] for _ in range(args.decisions)]
    started = time.perf_counter()
    for hints in picks:
        turn(hints)
    per_turn = (time.perf_counter() - started) / len(picks) * 1e6
    router = processor._router
    started = time.perf_counter()
    for hints in picks:
        router.choose("t", "m", hints, set(), lambda key: False)
    per_choice = (time.perf_counter() - started) / len(picks) * 1e6
    blocks = sum(len(h.blocks) for h in first) / len(first)
    result = {
        "engines": args.engines, "conversations": args.conversations, "blocks_per_request": round(blocks, 1),
        "us_per_submit_and_answer": round(per_turn, 1), "us_per_choose": round(per_choice, 1),
        "state_mib": round((filled - base) / 2**20, 1), **state,
        "bytes_per_entry": round((filled - base) / max(1, state["index_blocks"] + state["sessions"])),
    }
    if args.json:
        print(json.dumps(result))
    else:
        for name, value in result.items():
            print(f"{name:28} {value}")


if __name__ == "__main__":
    main()
