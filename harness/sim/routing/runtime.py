"""A modelled inference runtime: continuous batching with a prefix cache of limited size.

Tokens are ints; a prompt is cut into blocks of ``BLOCK_TOKENS`` whose
hashes chain (Python's hash of int tuples, the same in every process). An
iteration admits waiting requests up to ``max_batch``, costs ``prefill``
seconds per prompt token not found in the cache plus a decode step that grows
with the batch, and gives every running request one token; a request's first
token ends the iteration that admitted it. A finished request's prompt and
output blocks stay in the LRU cache, as vLLM's automatic prefix caching and
llama.cpp's prompt cache keep them.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field

BLOCK_TOKENS = 16


def chain(tokens: list[int], start: int = 0, previous: int = 0) -> list[int]:
    """Chained hashes of the full blocks of ``tokens`` from block ``start`` on."""
    out = []
    for i in range(start, len(tokens) // BLOCK_TOKENS):
        previous = hash((previous, tuple(tokens[i * BLOCK_TOKENS:(i + 1) * BLOCK_TOKENS])))
        out.append(previous)
    return out


@dataclass(frozen=True)
class RuntimeSpec:
    """The hardware: cache size in blocks, batch size, seconds per prefill token and decode step.

    The defaults are one 8B model (Llama 3 8B, bf16) under vLLM on one A100 40 GB: vLLM
    reports 5,691 KV blocks of 16 tokens there after 15 GiB of weights (11.1 GiB of KV
    cache, 128 KiB per token); a decode step at batch 1 takes about 13 ms (75 tokens/s)
    and batching 8 costs about 3 ms more; prefill runs at about 10,000 uncached tokens/s
    (2 x 8e9 FLOP per token at about half the A100's 312 bf16 TFLOP/s). docs/routing.md,
    "Routing simulation", has the sources.
    """

    cache_blocks: int = 5691
    max_batch: int = 32
    prefill_per_token: float = 0.0001
    decode_base: float = 0.015
    decode_per_seq: float = 0.0005


@dataclass
class Job:
    key: tuple[int, str]  # (gateway index, wire task id)
    prompt: list[int]
    output: list[int]
    submitted: float
    group: str
    produced: int = 0
    first_token: float | None = None
    cached_tokens: int = 0


@dataclass
class SimRuntime:
    """One engine's runtime; ``step`` runs one iteration and says when the next one ends."""

    name: str
    spec: RuntimeSpec
    cache: OrderedDict[int, None] = field(default_factory=OrderedDict)
    waiting: deque[Job] = field(default_factory=deque)
    running: list[Job] = field(default_factory=list)
    busy_until: float | None = None

    def cached_prefix_blocks(self, blocks: list[int]) -> int:
        count = 0
        for block in blocks:
            if block not in self.cache:
                break
            count += 1
        return count

    def _touch(self, blocks: list[int]) -> None:
        for block in blocks:
            if block in self.cache:
                self.cache.move_to_end(block)
            else:
                self.cache[block] = None
        while len(self.cache) > self.spec.cache_blocks:
            self.cache.popitem(last=False)

    def load(self) -> int:
        return len(self.running) + len(self.waiting)

    def kv_usage(self) -> float:
        tokens = sum(len(j.prompt) + j.produced for j in self.running)
        return min(1.0, tokens / (self.spec.cache_blocks * BLOCK_TOKENS))

    def start_iteration(self, now: float) -> tuple[float, list[Job]]:
        """Admit and run one iteration from ``now``: (when it ends, jobs admitted in it)."""
        admitted = []
        prefill_tokens = 0
        while self.waiting and len(self.running) < self.spec.max_batch:
            job = self.waiting.popleft()
            blocks = chain(job.prompt)
            hit = self.cached_prefix_blocks(blocks)
            job.cached_tokens = hit * BLOCK_TOKENS
            prefill_tokens += len(job.prompt) - job.cached_tokens
            self._touch(blocks)
            self.running.append(job)
            admitted.append(job)
        duration = (self.spec.decode_base + self.spec.decode_per_seq * len(self.running)
                    + self.spec.prefill_per_token * prefill_tokens)
        self.busy_until = now + duration
        return self.busy_until, admitted

    def end_iteration(self, now: float) -> tuple[list[Job], list[Job]]:
        """Every running job got a token: (jobs whose first token this was, jobs finished)."""
        first, done = [], []
        for job in self.running:
            job.produced += 1
            if job.first_token is None:
                job.first_token = now
                first.append(job)
            if job.produced >= len(job.output):
                done.append(job)
        for job in done:
            self.running.remove(job)
            self._touch(chain(job.prompt + job.output))
        self.busy_until = None
        return first, done
