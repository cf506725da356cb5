"""What any router could have reused on one run: upper bounds on the cached share, from the run's own trace; pure.

Both bounds take the run's requests as they happened (each prompt's tokens,
when it was sent, when its first token came, when it ended) and ask how much
of each prompt a router could have had cached, whatever engine it chose. A
prompt can reuse only what an engine holds from a request that *ended* before
it (a slot's context is its own until then) and before its own first token
(it was running by then), and llama-server computes at least one token of
every prompt. A context holds its prompt and all but the last token generated
after it, which may match what the next prompt has there: where a prompt
extends an earlier one whole, those tokens count as reusable too.

``all``
    One cache holding every earlier prompt, of any size (issue #24's bound):
    each prompt reuses its longest common prefix with any of them.
``capacity``
    The engines' real capacity, as llama-server keeps prompts (the vendored
    ``tools/server``: ``server_prompt_cache::alloc`` stores a slot's context
    whole, one entry per context, dropping only entries the new one holds
    whole; an idle slot keeps its last context; ``--cache-ram`` bounds the
    entries' bytes). A later turn reuses past what every prompt could
    share anyway (the longest prefix in common with another conversation's
    earlier prompt, credited free as if always held) only if its
    conversation's previous context was kept from that turn's end until it
    was sent: in an idle slot (the engines' slots less those certainly busy,
    generating an answer) or as a host cache entry, at most the host cache's
    bytes over the smallest context kept per engine. Which contexts to keep
    is chosen with hindsight, to reuse the most (a max-weight interval
    packing, solved exactly as a min-cost flow). Every relaxation favours
    the bound: the shared part is free, the capacity is counted in whole
    contexts of the smallest size, pooled over engines, and slots busy
    reading a prompt or waiting count as free. Keeping an older context of
    the conversation instead reuses less per token kept over a longer time,
    so only the previous one is considered.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from harness.real_routing.figures import Record

__all__ = ["Bounds", "common_prefix", "reuse_bounds"]


@dataclass(frozen=True)
class Bounds:
    """Upper bounds on a run's cached share (see the module docstring); ``capacity`` None: not computed
    (a run without a small host cache, whose ``all`` bound is its capacity's)."""

    all: float
    capacity: float | None


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token sequences (binary search over slice compares)."""
    low, high = 0, min(len(a), len(b))
    while low < high:
        mid = (low + high + 1) // 2
        if a[low:mid] == b[low:mid]:
            low = mid
        else:
            high = mid - 1
    return low


def reuse_bounds(records: Sequence[Record], prompt: Callable[[str, int], Sequence[int]], *, engines: int, slots: int,
                 host_tokens: int | None, generated: int, preloaded: Sequence[Sequence[int]] = ()) -> Bounds:
    """The bounds of a run whose requests are ``records`` (those that failed are left out, as from the cached
    share); ``prompt(conversation, turn)`` is a request's tokens; ``host_tokens``: each engine's host prompt
    cache in tokens (None: no capacity bound); ``generated``: tokens each request generated; ``preloaded``:
    prompts every engine ran before the run (the bench's warm-up request)."""
    ok = sorted((r for r in records if r.ok), key=lambda r: r.sent)
    tokens = {(r.conversation, r.turn): tuple(prompt(r.conversation, r.turn)) for r in ok}
    warm = [tuple(p) for p in preloaded]

    def reused(mine: tuple[int, ...], earlier: tuple[int, ...]) -> int:
        """What ``mine`` can reuse of a context that ran ``earlier``: their common prefix, and where ``mine``
        extends all of ``earlier``, as many of the tokens generated after it as were kept (all but the last),
        which may happen to match."""
        shared = common_prefix(mine, earlier)
        return min(len(mine), shared + generated - 1) if shared == len(earlier) else shared

    total = sum(len(t) for t in tokens.values())
    if not total:
        return Bounds(0.0, None if host_tokens is None else 0.0)
    by_end = sorted(ok, key=lambda r: r.ended)
    every = other = 0
    gains: list[tuple[float, float, int, int]] = []  # (kept from, kept to, context size, tokens gained)
    previous: dict[str, Record] = {}
    for r in ok:
        mine = tokens[(r.conversation, r.turn)]
        cut = len(mine) - 1
        started = r.first if r.first is not None else r.ended
        best_any = best_other = max((common_prefix(mine, w) for w in warm), default=0)
        for before in by_end:
            if before.ended > started:
                break
            if before is r:
                continue
            shared = reused(mine, tokens[(before.conversation, before.turn)])
            best_any = max(best_any, shared)
            if before.conversation != r.conversation:
                best_other = max(best_other, shared)
        every += min(cut, best_any)
        other += min(cut, best_other)
        last = previous.get(r.conversation)
        previous[r.conversation] = r
        if last is not None and last.ended <= r.sent:
            last_tokens = tokens[(last.conversation, last.turn)]
            own = min(cut, reused(mine, last_tokens))
            if own > min(cut, best_other):
                gains.append((last.ended, r.sent, len(last_tokens) + generated - 1, own - min(cut, best_other)))
    capacity = None
    if host_tokens is not None:
        capacity = (other + _best_packing(gains, ok, engines, slots, host_tokens)) / total
    return Bounds(every / total, capacity)


def _best_packing(gains: list[tuple[float, float, int, int]], ok: Sequence[Record], engines: int, slots: int,
                  host_tokens: int) -> int:
    """The most tokens gained by keeping contexts over their intervals, with at most (idle slots + host
    entries) kept at any time (see the module docstring)."""
    if not gains:
        return 0
    host = engines * (host_tokens // min(size for _, _, size, _ in gains))
    times = sorted({t for start, end, _, _ in gains for t in (start, end)}
                   | {t for r in ok if r.first is not None for t in (r.first, r.ended)})
    index = {t: i for i, t in enumerate(times)}
    generating = [0] * len(times)  # requests certainly in a slot during [times[i], times[i + 1])
    for r in ok:
        if r.first is not None:
            for i in range(index[r.first], index[r.ended]):
                generating[i] += 1
    room = [host + max(0, engines * slots - g) for g in generating]
    units = max(room)
    if units >= len(gains):
        overlap = [0] * len(times)
        for start, end, _, _ in gains:
            for i in range(index[start], index[end]):
                overlap[i] += 1
        if all(o <= c for o, c in zip(overlap, room)):
            return sum(gain for *_, gain in gains)
    # Min-cost flow: ``units`` flow along the time line; a unit crossing [t_i, t_i+1) on the line is a place
    # not holding a context then, at least ``units - room[i]`` must (a bonus larger than every gain makes
    # them), and a unit taking a context's edge holds it over its interval.
    bonus = sum(gain for *_, gain in gains) + 1
    graph = _Graph(len(times))
    for i in range(len(times) - 1):
        graph.add(i, i + 1, units - room[i], -bonus)
        graph.add(i, i + 1, room[i], 0)
    instant = 0  # kept for no time at all: an answer and the next turn at one instant
    for start, end, _, gain in gains:
        if index[start] == index[end]:
            instant += gain
        else:
            graph.add(index[start], index[end], 1, -gain)
    cost = graph.min_cost_flow(0, len(times) - 1, units)
    forced = sum(units - room[i] for i in range(len(times) - 1))
    return instant - (cost + forced * bonus)


class _Graph:
    """A flow network whose edges go forward in time (a DAG, so the first potentials come in one pass)."""

    def __init__(self, nodes: int) -> None:
        self.edges: list[list[int]] = []  # [to, capacity, cost, reverse edge]
        self.out: list[list[int]] = [[] for _ in range(nodes)]

    def add(self, a: int, b: int, capacity: int, cost: int) -> None:
        if capacity <= 0:
            return
        self.out[a].append(len(self.edges))
        self.edges.append([b, capacity, cost, len(self.edges) + 1])
        self.out[b].append(len(self.edges))
        self.edges.append([a, 0, -cost, len(self.edges) - 1])

    def min_cost_flow(self, source: int, sink: int, amount: int) -> int:
        """Send ``amount`` from ``source`` to ``sink`` at the least cost (successive shortest paths,
        Dijkstra on costs reduced by potentials)."""
        n = len(self.out)
        far = 1 << 62
        potential = [far] * n
        potential[source] = 0
        for a in range(n):  # nodes are in time order and edges go forward: one pass gives shortest paths
            if potential[a] == far:
                continue
            for e in self.out[a]:
                to, capacity, cost, _ = self.edges[e]
                if capacity and potential[a] + cost < potential[to]:
                    potential[to] = potential[a] + cost
        total = 0
        while amount:
            distance = [far] * n
            via = [-1] * n
            distance[source] = 0
            heap = [(0, source)]
            while heap:
                d, a = heapq.heappop(heap)
                if d > distance[a]:
                    continue
                for e in self.out[a]:
                    to, capacity, cost, _ = self.edges[e]
                    if capacity:
                        nd = d + cost + potential[a] - potential[to]
                        if nd < distance[to]:
                            distance[to], via[to] = nd, e
                            heapq.heappush(heap, (nd, to))
            if distance[sink] == far:
                raise ValueError("no path left for the flow")
            for a in range(n):
                if distance[a] < far:
                    potential[a] += distance[a]
            push, a = amount, sink
            while a != source:
                e = via[a]
                push = min(push, self.edges[e][1])
                a = self.edges[self.edges[e][3]][0]
            a = sink
            while a != source:
                e = via[a]
                self.edges[e][1] -= push
                self.edges[self.edges[e][3]][1] += push
                total += push * self.edges[e][2]
                a = self.edges[self.edges[e][3]][0]
            amount -= push
        return total
