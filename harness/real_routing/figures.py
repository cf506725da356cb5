"""The figures of one run of the real-runtime routing benchmark, from what each request's answer said; pure.

Every figure comes from :class:`Record` s: one per request, as the client
saw it (when it was sent, its first content token, its end) and as the
runtime reported it in the answer itself: which engine served it (the
``model`` every llama-server answer names: each server is started with an
alias of its own) and the runtime's own prompt counters of that request,
``timings.cache_n`` (prompt tokens served from its cache) and
``timings.prompt_n`` (prompt tokens computed).

A *later turn moved off a free home* is a turn after a conversation's first
that went to another engine than its previous turn, reused less than that
previous turn's whole prompt (which its previous engine held, unless that
engine had since evicted it), while the previous engine had a free slot when
the turn was sent (fewer of the run's requests in flight there than it has
slots). It is what a router should never do: the home could have served the
turn at once from its cache.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

__all__ = ["Figures", "Record", "figures", "percentile"]


@dataclass(frozen=True)
class Record:
    """One request: who sent it, what happened to it, and what the runtime said about its prompt."""

    client: str
    group: str
    conversation: str
    turn: int
    #: Which router replica it was sent to.
    replica: int
    sent: float
    #: When its first content token arrived (None: none did).
    first: float | None
    ended: float
    #: HTTP status (0: no answer at all); an answer that is not 200 with a whole stream is an error.
    status: int
    error: str = ""
    engine: str = ""
    cache_n: int = 0
    prompt_n: int = 0

    @property
    def ok(self) -> bool:
        return self.status == 200 and not self.error

    @property
    def ttft(self) -> float | None:
        return None if self.first is None else self.first - self.sent

    @property
    def prompt_tokens(self) -> int:
        return self.cache_n + self.prompt_n


@dataclass(frozen=True)
class Figures:
    """What one run measured (see the module docstring for the moves)."""

    requests: int
    errors: int
    cached_share: float
    prompt_computed: int
    wall: float
    ttft_p50: float
    ttft_p90: float
    ttft_p99: float
    #: p99 time to first token of each group (tenant).
    group_p99: dict[str, float]
    #: Requests each engine served, by engine name.
    per_engine: dict[str, int]
    later_turns: int
    moved: int
    moved_off_free_home: int
    #: Upper bounds on ``cached_share`` from the run's own trace (:mod:`harness.real_routing.bounds`; NaN: not
    #: computed): one cache holding every earlier prompt, and the engines' real capacity.
    bound_all: float = math.nan
    bound_capacity: float = math.nan

    @property
    def max_over_mean(self) -> float:
        """The busiest engine's requests over the mean (engines that served none count as 0)."""
        counts = list(self.per_engine.values())
        mean = statistics.fmean(counts) if counts else 0.0
        return max(counts) / mean if mean else math.nan


def percentile(values: Sequence[float], q: float) -> float:
    """The nearest-rank ``q`` percentile (0 < q <= 100) of ``values``; NaN for none."""
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def figures(records: Iterable[Record], engines: Sequence[str], slots: int, wall: float) -> Figures:
    """The figures of a run whose requests are ``records``, served by ``engines`` of ``slots`` slots each."""
    records = sorted(records, key=lambda r: r.sent)
    ok = [r for r in records if r.ok]
    cached = sum(r.cache_n for r in ok)
    computed = sum(r.prompt_n for r in ok)
    ttfts = [t for r in ok if (t := r.ttft) is not None]
    groups: dict[str, list[float]] = {}
    for r in ok:
        if (t := r.ttft) is not None:
            groups.setdefault(r.group, []).append(t)
    per_engine = dict.fromkeys(engines, 0)
    for r in ok:
        per_engine[r.engine] = per_engine.get(r.engine, 0) + 1
    later = moved = off_free = 0
    previous: dict[str, Record] = {}
    by_engine: dict[str, list[Record]] = {}
    for r in ok:
        by_engine.setdefault(r.engine, []).append(r)
    for r in ok:
        before = previous.get(r.conversation)
        previous[r.conversation] = r
        if before is None:
            continue
        later += 1
        if r.engine == before.engine:
            continue
        moved += 1
        if r.cache_n >= before.prompt_tokens:
            continue
        busy = sum(1 for other in by_engine.get(before.engine, ()) if other.sent <= r.sent < other.ended)
        if busy < slots:
            off_free += 1
    return Figures(
        requests=len(records), errors=len(records) - len(ok),
        cached_share=cached / (cached + computed) if cached + computed else 0.0, prompt_computed=computed,
        wall=wall, ttft_p50=percentile(ttfts, 50), ttft_p90=percentile(ttfts, 90), ttft_p99=percentile(ttfts, 99),
        group_p99={g: percentile(v, 99) for g, v in sorted(groups.items())}, per_engine=per_engine,
        later_turns=later, moved=moved, moved_off_free_home=off_free,
    )
