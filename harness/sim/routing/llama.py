"""llama.cpp's ``llama-server`` as a modelled runtime: slots, their KV, its host prompt cache, its costs; no I/O.

What it reproduces, as the vendored server (llama-cpp-python 0.3.36's
``tools/server``) does it, with ``-np SLOTS`` (each slot its own KV: an
explicit ``-np`` turns the unified cache off) and ``--cache-ram``:

- **Slots.** A task taken from the queue goes to an idle slot: the one whose
  context shares the longest prefix with its prompt, as a fraction of the
  prompt, when that fraction exceeds ``--slot-prompt-similarity`` (0.1);
  else the least recently used (``t_last_used``; the last such slot on a
  tie). With every slot busy it waits (``requests_deferred``), first come
  first served. A slot reuses the longest common prefix of what it holds
  and the prompt, but always computes at least one prompt token.
- **Host prompt cache.** Before a slot takes a prompt by LRU, or by
  similarity while keeping under half of what it holds, it saves its
  context to the cache and restores the cached context that keeps the most
  of the new prompt (``server_prompt_cache::load``: an entry at least a
  quarter of which the prompt keeps, both keeping more and covering more of
  the prompt than the slot's own; a restored entry leaves the cache). When a
  task starts, every idle slot is saved too (``--cache-idle-slots``, on by
  default). An entry the cache holds whole is not saved again; entries the
  new one holds whole are dropped; the oldest go first past ``cache_ram``
  bytes (or past the server's total context in tokens, if that binds first).
- **Slot files** (``--slot-save-path``). A job may name its slot
  (``id_slot``): it waits until that slot is idle, and the host cache is
  consulted for that slot alone, as the server does. ``save_slot`` and
  ``restore_slot`` copy an idle slot's context to and from a named file,
  at no cost (milliseconds for real, against seconds of prefill).
- **Costs.** The server runs one iteration at a time: every generating slot
  adds one token, then prompt tokens of the slots still reading their
  prompts fill the batch up to ``n_batch``. An iteration costs
  :class:`LlamaCosts`: per prompt token, more the further into the context
  it sits (attention), and per generating slot, more the longer its context
  (one query's attention over it is not amortised as a prompt's is). A
  prompt's first token comes at the end of the iteration that read its last
  prompt token; its context then keeps the prompt and all but the last of
  the tokens it generates.

Tokens are ints; generated tokens are negative, unique per request, so that
no prompt ever matches them (a client sends back its own text, not the
model's tokens: see :mod:`harness.real_routing.workloads`).
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field, fields

__all__ = ["BENCH_COSTS", "TINY_COSTS", "LlamaCosts", "LlamaJob", "LlamaServerModel", "common_prefix"]


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token sequences."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


@dataclass(frozen=True)
class LlamaCosts:
    """Seconds an iteration of one server costs on one thread (see the module docstring).

    Defaults: :data:`harness.gguf_models.BENCH` on one thread of this
    project's 2-core machines, as ``tools/bench/llama_costs.py`` measured them
    (CPU seconds of the server; docs/routing-real.md has the measurement).
    """

    iteration: float = 0.0134
    prompt_token: float = 0.000336
    prompt_token_per_position: float = 6.19e-7
    generated_token: float = 0.00263
    generated_token_per_position: float = 9.86e-6

    def scaled(self, factor: float) -> LlamaCosts:
        """Every cost times ``factor``: a server that gets a share of a busy core."""
        return LlamaCosts(*(factor * getattr(self, f.name) for f in fields(self)))

    def iteration_seconds(self, prompt_positions: Sequence[tuple[int, int]], generating: Sequence[int]) -> float:
        """An iteration reading prompt tokens ``[start, end)`` of some slots and generating one token for slots
        of the given context lengths."""
        cost = self.iteration
        for start, end in prompt_positions:
            count = end - start
            cost += count * self.prompt_token + self.prompt_token_per_position * (start + end - 1) * count / 2
        for context in generating:
            cost += self.generated_token + self.generated_token_per_position * context
        return cost


#: :data:`harness.gguf_models.BENCH`'s costs (the defaults).
BENCH_COSTS = LlamaCosts()
#: :data:`harness.gguf_models.TINY`'s, from the same tool's wall times (its CPU times are below the clock tick).
TINY_COSTS = LlamaCosts(iteration=0.0002, prompt_token=1.5e-5, prompt_token_per_position=2.0e-8,
                        generated_token=0.00025, generated_token_per_position=5.0e-7)


@dataclass
class LlamaJob:
    """A request on the server: its prompt, tokens to generate, and what the server reports of it."""

    key: object
    prompt: Sequence[int]
    max_tokens: int
    #: The slot it names (``id_slot``; None: the server chooses).
    slot: int | None = None
    cache_n: int = 0
    prompt_n: int = 0
    generated: int = 0
    first_token: float | None = None
    done: float | None = None


@dataclass
class _LlamaSlot:
    id: int
    tokens: list[int] = field(default_factory=list)
    job: LlamaJob | None = None
    #: Prompt tokens read so far (from ``job.cache_n`` on); the prompt is read once it reaches its length.
    read: int = 0
    t_last_used: float = -1.0


@dataclass
class LlamaServerModel:
    """One ``llama-server``: ``submit`` jobs, ``step`` it at the times it asks for (see the module docstring)."""

    name: str
    slots: int = 2
    context_per_slot: int = 4096
    #: ``--cache-ram`` in bytes (None: off); the default server's is 8 GiB.
    cache_ram: int | None = 8192 * 1024 * 1024
    #: Bytes a saved token takes (BENCH: 7 layers x 384 wide x K and V x 2 bytes, and 12 of metadata).
    bytes_per_token: int = 7 * 384 * 2 * 2 + 12
    slot_prompt_similarity: float = 0.1
    n_batch: int = 2048
    costs: LlamaCosts = field(default_factory=LlamaCosts)

    def __post_init__(self) -> None:
        self._slots = [_LlamaSlot(i) for i in range(self.slots)]
        self._queue: deque[LlamaJob] = deque()
        #: The host prompt cache, oldest first: saved contexts.
        self._cache: list[list[int]] = []
        #: Slot files (``--slot-save-path``), by name.
        self._files: dict[str, list[int]] = {}
        self._generated = itertools.count(-1, -1)
        self.busy_until: float | None = None
        #: Counters as ``/metrics`` has them.
        self.prompt_tokens_total = 0
        self.prompt_tokens_cached_total = 0

    # -- what /metrics and /slots say -----------------------------------------------------------

    @property
    def processing(self) -> int:
        """``llamacpp:requests_processing``: slots with a task."""
        return sum(1 for s in self._slots if s.job is not None)

    @property
    def deferred(self) -> int:
        """``llamacpp:requests_deferred``: tasks waiting for a slot."""
        return len(self._queue)

    def metrics(self) -> str:
        """The ``/metrics`` body as llama-server writes the series the engine agent reads."""
        return (f"llamacpp:requests_processing {self.processing}\n"
                f"llamacpp:requests_deferred {self.deferred}\n"
                f"llamacpp:prompt_tokens_total {self.prompt_tokens_total}\n"
                f"llamacpp:prompt_tokens_cached_total {self.prompt_tokens_cached_total}\n")

    def slots_body(self) -> list[dict[str, object]]:
        """The ``/slots`` list (only what the agent reads of it)."""
        return [{"id": s.id, "is_processing": s.job is not None, "n_ctx": self.context_per_slot} for s in self._slots]

    # -- commands ---------------------------------------------------------------------------------

    def submit(self, job: LlamaJob, now: float) -> None:
        """A request arrives; the server takes it between two iterations (``step`` says when)."""
        self._queue.append(job)
        if self.busy_until is None:
            self.busy_until = now  # idle: it is taken at once

    def step(self, now: float) -> tuple[list[LlamaJob], list[LlamaJob]]:
        """Run the server at ``now`` (= ``busy_until``): end the iteration that ran, take waiting tasks, start
        the next iteration. Returns (jobs whose first token came, jobs that finished) at ``now``."""
        first, finished = self._end_iteration(now)
        self._take_waiting(now)
        self._start_iteration(now)
        return first, finished

    def save_slot(self, slot: int, file: str) -> None:
        """``POST /slots/SLOT?action=save``: the idle slot's context goes to ``file``."""
        self._files[file] = list(self._slots[slot].tokens)

    def restore_slot(self, slot: int, file: str) -> bool:
        """``POST /slots/SLOT?action=restore``: the idle slot takes ``file``'s context; False if there is none."""
        tokens = self._files.get(file)
        if tokens is None:
            return False
        self._slots[slot].tokens = list(tokens)
        return True

    # -- internals ------------------------------------------------------------------------------------

    def _take_waiting(self, now: float) -> None:
        while self._queue:
            slot = self._choose(self._queue[0].prompt, self._queue[0].slot)
            if slot is None:
                return
            job = self._queue.popleft()
            self._launch(slot, job)
            if self.cache_ram:
                for idle in self._slots:
                    if idle.job is None:
                        self._save(idle.tokens)

    def _choose(self, prompt: Sequence[int], pinned: int | None = None) -> _LlamaSlot | None:
        best, best_sim = None, 0.0
        if pinned is not None:
            best = self._slots[pinned]
            if best.job is not None:
                return None  # deferred until its slot is idle
        for slot in self._slots:
            if pinned is not None and slot.id != pinned:
                continue
            if slot.job is not None or not slot.tokens:
                continue
            sim = common_prefix(slot.tokens, prompt) / len(prompt)
            if sim > best_sim and sim > self.slot_prompt_similarity:
                best, best_sim = slot, sim
        update_cache = False
        if best is not None:
            # An empty named slot keeps nothing (the server's 0/0 is not below a half).
            if best.tokens and best_sim * len(prompt) / len(best.tokens) < 0.5:
                update_cache = True
        else:
            for slot in self._slots:
                if slot.job is None and (best is None or slot.t_last_used <= best.t_last_used):
                    best = slot
            update_cache = best is not None
        if best is not None and update_cache and self.cache_ram:
            self._save(best.tokens)
            self._load(best, prompt)
        return best

    def _launch(self, slot: _LlamaSlot, job: LlamaJob) -> None:
        reuse = min(common_prefix(slot.tokens, job.prompt), len(job.prompt) - 1)
        del slot.tokens[reuse:]
        job.cache_n = reuse
        job.prompt_n = len(job.prompt) - reuse
        slot.job = job
        slot.read = reuse

    def _save(self, tokens: list[int]) -> None:
        if not tokens or self.cache_ram is None:
            return
        if any(common_prefix(entry, tokens) == len(tokens) for entry in self._cache):
            return  # already held whole
        size = len(tokens) * self.bytes_per_token
        if size > self.cache_ram:
            return
        self._cache = [entry for entry in self._cache if common_prefix(entry, tokens) != len(entry)]
        while self._cache and self._cache_bytes() + size > self.cache_ram:
            self._cache.pop(0)
        self._cache.append(list(tokens))
        self._trim()

    def _load(self, slot: _LlamaSlot, prompt: Sequence[int]) -> None:
        lcp = common_prefix(slot.tokens, prompt)
        keep_best = lcp / len(slot.tokens) if slot.tokens else -1.0
        sim_best = lcp / len(prompt)
        chosen = None
        for i, entry in enumerate(self._cache):
            lcp_entry = common_prefix(entry, prompt)
            keep, sim = lcp_entry / len(entry), lcp_entry / len(prompt)
            if keep < 0.25:
                continue
            if keep_best < keep and sim_best < sim:
                keep_best, sim_best, chosen = keep, sim, i
        if chosen is not None:
            slot.tokens = self._cache.pop(chosen)
        self._trim()

    def _trim(self) -> None:
        """``server_prompt_cache::update``: the byte limit, then the token limit (the server's total context,
        or more if the bytes allow)."""
        if self.cache_ram:
            while self._cache and self._cache_bytes() > self.cache_ram:
                self._cache.pop(0)
        limit_tokens = max(self.slots * self.context_per_slot, (self.cache_ram or 0) // self.bytes_per_token)
        while self._cache and sum(len(e) for e in self._cache) > limit_tokens:
            self._cache.pop(0)

    def _cache_bytes(self) -> int:
        return sum(len(entry) for entry in self._cache) * self.bytes_per_token

    def _start_iteration(self, now: float) -> None:
        generating = [s for s in self._slots if s.job is not None and s.read >= len(s.job.prompt)]
        reading = [s for s in self._slots if s.job is not None and s.read < len(s.job.prompt)]
        if not generating and not reading:
            self.busy_until = None
            return
        budget = self.n_batch - len(generating)
        chunks = []
        self._reading: list[tuple[_LlamaSlot, int]] = []
        for slot in reading:
            if budget <= 0:
                break
            assert slot.job is not None
            take = min(budget, len(slot.job.prompt) - slot.read)
            chunks.append((slot.read, slot.read + take))
            self._reading.append((slot, take))
            budget -= take
        self._generating = generating
        self.busy_until = now + self.costs.iteration_seconds(chunks, [len(s.tokens) for s in generating])

    def _end_iteration(self, now: float) -> tuple[list[LlamaJob], list[LlamaJob]]:
        first: list[LlamaJob] = []
        finished: list[LlamaJob] = []
        for slot in getattr(self, "_generating", ()):
            job = slot.job
            assert job is not None
            if job.generated >= job.max_tokens:
                continue
            slot.tokens.append(next(self._generated))
            job.generated += 1
            if job.generated >= job.max_tokens:
                self._release(slot, now)
                finished.append(job)
        for slot, take in getattr(self, "_reading", ()):
            job = slot.job
            assert job is not None
            slot.tokens.extend(job.prompt[slot.read:slot.read + take])
            slot.read += take
            if slot.read >= len(job.prompt):
                # The prompt's last logits give the first token.
                job.first_token = now
                job.generated = 1
                self.prompt_tokens_total += job.prompt_n
                self.prompt_tokens_cached_total += job.cache_n
                first.append(job)
                if job.max_tokens <= 1:
                    self._release(slot, now)
                    finished.append(job)
        self._generating, self._reading = [], []
        return first, finished

    def _release(self, slot: _LlamaSlot, now: float) -> None:
        job = slot.job
        assert job is not None
        job.done = now
        slot.job = None
        slot.t_last_used = now
