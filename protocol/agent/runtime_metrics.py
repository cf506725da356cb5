"""What a runtime says about its own load: parsers of vLLM, llama.cpp and SGLang signals; pure.

Rules this file keeps: no I/O, no clock reads, no state. Text in, a
:class:`LoadReading` (or None: "this runtime says nothing we know") out; a
body that is not what its endpoint promises raises :class:`MetricsFormatError`,
a remote error (the runtime misbehaved), never a crash of the caller.

Names, as the runtimes' own sources spell them (a Prometheus counter is
exposed with ``_total`` appended):

=========  =========================================================================
vLLM       ``vllm:num_requests_running``, ``vllm:num_requests_waiting``,
           ``vllm:kv_cache_usage_perc`` (older: ``vllm:gpu_cache_usage_perc``; a
           fraction 0..1 despite the name), prefix cache counters in tokens
           ``vllm:prefix_cache_hits_total`` / ``vllm:prefix_cache_queries_total``
           (older: ``vllm:gpu_prefix_cache_hits_total`` / ``..._queries_total``; v0:
           the gauge ``vllm:gpu_prefix_cache_hit_rate``), and
           ``vllm:lora_requests_info`` whose label ``running_lora_adapters`` lists
           the adapters in use (its value is a timestamp: the newest sample wins).
llama.cpp  ``llamacpp:requests_processing``, ``llamacpp:requests_deferred``,
           ``llamacpp:kv_cache_usage_ratio`` (gone from current builds, read when
           there) on ``/metrics`` (``--metrics``), and the prefix-cache counters
           in tokens ``llamacpp:prompt_tokens_cached_total`` (served from the
           cache) and ``llamacpp:prompt_tokens_total`` (computed, the cached ones
           excluded: queries are their sum; older builds lack the first and give
           no counters). ``GET /slots`` lists the slots, each with
           ``is_processing`` and ``id_task``, ``n_prompt_tokens`` (what the
           slot's context holds, generated tokens included),
           ``n_prompt_tokens_processed`` and ``n_prompt_tokens_cache`` of its
           current or last task; the server zeroes the statistics when a task
           ends, so only running slots' tasks are read, each prompt being
           cached + computed once computing began. Those snapshots are how a
           server without the counters gives a hit rate. The list's length is
           the server's slots (``-np``); ``GET /props`` has it as
           ``total_slots`` too.
SGLang     ``sglang:num_running_reqs``, ``sglang:num_queue_reqs``,
           ``sglang:token_usage`` (KV pool use, 0..1), ``sglang:cache_hit_rate``
           (0..1, the runtime's own recent rate).
=========  =========================================================================

Several series of one name (vLLM's data-parallel ``engine`` label, one per
``model_name``) are summed for counts and counters; KV use takes the fullest.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TypeGuard

from protocol.errors import RemoteProtocolError

__all__ = [
    "WANTED", "LoadReading", "MetricsFormatError", "Sample", "SlotTask", "parse_exposition",
    "parse_slots", "reading_from_metrics", "reading_from_slots", "total_slots_from_props",
]

#: Bodies larger than this are not parsed (the Twisted side stops reading there).
MAX_BODY = 4 * 1024 * 1024


class MetricsFormatError(RemoteProtocolError):
    """The runtime's metrics or slots body is malformed."""


@dataclass(frozen=True)
class Sample:
    """One exposition line: a series' name, its labels, its value."""

    name: str
    labels: tuple[tuple[str, str], ...]
    value: float

    def label(self, name: str) -> str | None:
        return next((v for k, v in self.labels if k == name), None)


@dataclass(frozen=True)
class SlotTask:
    """The task a llama.cpp slot runs or ran last, with its prompt's cache use."""

    slot_id: int
    task_id: int
    prompt_tokens: int
    cached_tokens: int


@dataclass(frozen=True)
class LoadReading:
    """One scrape's worth of a runtime's load.

    ``prefix_hits`` / ``prefix_queries`` are cumulative counters (tokens), to
    be turned into a rate over a window by whoever keeps history;
    ``prefix_hit_rate`` is a rate the runtime computed itself (SGLang, vLLM
    v0). ``slot_tasks`` are llama.cpp's per-slot last tasks (same purpose).
    """

    source: str
    running: int
    waiting: int
    kv_cache_usage: float | None = None
    prefix_hits: float | None = None
    prefix_queries: float | None = None
    prefix_hit_rate: float | None = None
    adapters: tuple[str, ...] = ()
    slot_tasks: tuple[SlotTask, ...] = ()
    #: Requests the runtime runs at once (llama.cpp's slots), when it says.
    slots: int | None = None


_VLLM = {
    "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
    "vllm:gpu_cache_usage_perc", "vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total",
    "vllm:gpu_prefix_cache_hits_total", "vllm:gpu_prefix_cache_queries_total",
    "vllm:gpu_prefix_cache_hit_rate", "vllm:lora_requests_info",
}
_LLAMACPP = {
    "llamacpp:requests_processing", "llamacpp:requests_deferred", "llamacpp:kv_cache_usage_ratio",
    "llamacpp:prompt_tokens_total", "llamacpp:prompt_tokens_cached_total",
}
_SGLANG = {"sglang:num_running_reqs", "sglang:num_queue_reqs", "sglang:token_usage", "sglang:cache_hit_rate"}
WANTED = frozenset(_VLLM | _LLAMACPP | _SGLANG)

_ESCAPES = {"\\": "\\", '"': '"', "n": "\n"}


def parse_exposition(text: str, wanted: Iterable[str] = WANTED) -> list[Sample]:
    """The samples of the ``wanted`` series in a Prometheus text exposition.

    Lines of other series are skipped unread (a vLLM body is mostly
    histograms nobody here needs); a wanted line that does not parse raises
    :class:`MetricsFormatError`.
    """
    names = frozenset(wanted)
    samples: list[Sample] = []
    # Lines end at "\n" alone (str.splitlines would also split at characters a label value may hold).
    for number, line in enumerate(text.split("\n"), 1):
        line = line.strip(" \t\r")
        if not line or line.startswith("#"):
            continue
        end = len(line)
        for stop in ("{", " ", "\t"):
            found = line.find(stop)
            if 0 <= found < end:
                end = found
        name = line[:end]
        if name not in names:
            continue
        try:
            samples.append(_sample(name, line[end:]))
        except (ValueError, IndexError) as e:
            raise MetricsFormatError(f"metrics line {number} ({name}): {e}") from None
    return samples


def _sample(name: str, rest: str) -> Sample:
    labels: list[tuple[str, str]] = []
    i = 0
    if rest.startswith("{"):
        i = 1
        while True:
            while rest[i] in " ,":
                i += 1
            if rest[i] == "}":
                i += 1
                break
            eq = rest.index("=", i)
            key = rest[i:eq].strip()
            if not key or rest[eq + 1] != '"':
                raise ValueError("label without a quoted value")
            j = eq + 2
            value: list[str] = []
            while rest[j] != '"':
                if rest[j] == "\\":
                    value.append(_ESCAPES.get(rest[j + 1], "\\" + rest[j + 1]))
                    j += 2
                else:
                    value.append(rest[j])
                    j += 1
            labels.append((key, "".join(value)))
            i = j + 1
    fields = rest[i:].split()
    if not 1 <= len(fields) <= 2:
        raise ValueError("expected a value and an optional timestamp")
    return Sample(name, tuple(labels), float(fields[0]))


def _sum(samples: list[Sample], *names: str) -> float | None:
    """The sum over every series of the first of ``names`` present, or None."""
    values = _first_present(samples, names)
    return sum(values) if values else None


def _max(samples: list[Sample], *names: str) -> float | None:
    """The largest value over every series of the first of ``names`` present, or None."""
    values = _first_present(samples, names)
    return max(values) if values else None


def _first_present(samples: list[Sample], names: tuple[str, ...]) -> list[float]:
    """The finite values of the first of ``names`` that has any ([] if none has)."""
    for name in names:
        values = [s.value for s in samples if s.name == name and math.isfinite(s.value)]
        if values:
            return values
    return []


#: Counts go out as int32 (``RuntimeLoad.running_requests``); a runtime's absurd figure is capped there.
_MAX_COUNT = 2**31 - 1


def _count(value: float | None) -> int:
    return 0 if value is None else min(_MAX_COUNT, max(0, round(value)))


def _fraction(value: float | None) -> float | None:
    return None if value is None else min(1.0, max(0.0, value))


def reading_from_metrics(text: str) -> LoadReading | None:
    """The load in a ``/metrics`` body, by whichever runtime's names it carries; None if none."""
    samples = parse_exposition(text)
    names = {s.name for s in samples}
    if names & _VLLM:
        return _vllm(samples)
    if names & _SGLANG:
        return LoadReading(
            source="sglang",
            running=_count(_sum(samples, "sglang:num_running_reqs")),
            waiting=_count(_sum(samples, "sglang:num_queue_reqs")),
            kv_cache_usage=_fraction(_max(samples, "sglang:token_usage")),
            prefix_hit_rate=_fraction(_max(samples, "sglang:cache_hit_rate")),
        )
    if names & _LLAMACPP:
        cached = _sum(samples, "llamacpp:prompt_tokens_cached_total")
        computed = _sum(samples, "llamacpp:prompt_tokens_total")
        queries = None if cached is None or computed is None else cached + computed
        return LoadReading(
            source="llama.cpp",
            running=_count(_sum(samples, "llamacpp:requests_processing")),
            waiting=_count(_sum(samples, "llamacpp:requests_deferred")),
            kv_cache_usage=_fraction(_max(samples, "llamacpp:kv_cache_usage_ratio")),
            prefix_hits=None if queries is None else cached,
            prefix_queries=queries,
        )
    return None


def _vllm(samples: list[Sample]) -> LoadReading:
    lora = [s for s in samples if s.name == "vllm:lora_requests_info"]
    adapters: tuple[str, ...] = ()
    if lora:
        newest = max(lora, key=lambda s: s.value)
        listed = (newest.label("running_lora_adapters") or "").split(",")
        adapters = tuple(sorted({a.strip() for a in listed if a.strip()}))
    return LoadReading(
        source="vllm",
        running=_count(_sum(samples, "vllm:num_requests_running")),
        waiting=_count(_sum(samples, "vllm:num_requests_waiting")),
        kv_cache_usage=_fraction(_max(samples, "vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")),
        prefix_hits=_sum(samples, "vllm:prefix_cache_hits_total", "vllm:gpu_prefix_cache_hits_total"),
        prefix_queries=_sum(samples, "vllm:prefix_cache_queries_total", "vllm:gpu_prefix_cache_queries_total"),
        prefix_hit_rate=_fraction(_max(samples, "vllm:gpu_prefix_cache_hit_rate")),
        adapters=adapters,
    )


def _slot_list(body: bytes) -> list[dict[str, object]]:
    try:
        slots = json.loads(body)
    except (UnicodeDecodeError, ValueError) as e:
        raise MetricsFormatError(f"/slots is not JSON: {e}") from None
    if not isinstance(slots, list) or not all(isinstance(s, dict) for s in slots):
        raise MetricsFormatError("/slots is not a list of slot objects")
    return slots


def parse_slots(body: bytes) -> tuple[int, tuple[SlotTask, ...]]:
    """llama.cpp's ``GET /slots``: (slots processing now, each slot's current or last task)."""
    return _parse_slots(_slot_list(body))


def _parse_slots(slots: list[dict[str, object]]) -> tuple[int, tuple[SlotTask, ...]]:
    processing = 0
    tasks: list[SlotTask] = []
    for slot in slots:
        if not isinstance(slot.get("is_processing"), bool) or not isinstance(slot.get("id"), int):
            raise MetricsFormatError("a /slots entry lacks 'id' or a boolean 'is_processing'")
        if not slot["is_processing"]:
            continue  # an idle slot's statistics were zeroed when its task ended
        processing += 1
        task, prompt, cached = slot.get("id_task"), slot.get("n_prompt_tokens"), slot.get("n_prompt_tokens_cache")
        computed = slot.get("n_prompt_tokens_processed")
        if not (_is_int(task) and _is_int(prompt) and _is_int(cached)):
            continue
        if _is_int(computed) and computed > 0:
            prompt = cached + computed  # n_prompt_tokens also counts what was generated since
        slot_id = slot["id"]
        assert isinstance(slot_id, int)
        tasks.append(SlotTask(slot_id, task, max(0, prompt), max(0, min(cached, prompt))))
    return processing, tuple(tasks)


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def reading_from_slots(body: bytes, metrics: LoadReading | None) -> LoadReading:
    """A llama.cpp reading from ``/slots``, merged with its ``/metrics`` reading when there is one.

    The slots count what runs; only ``/metrics`` knows what was deferred.
    """
    slots = _slot_list(body)
    processing, tasks = _parse_slots(slots)
    total = len(slots) or None
    if metrics is None:
        return LoadReading(source="llama.cpp", running=processing, waiting=0, slot_tasks=tasks, slots=total)
    return LoadReading(
        source="llama.cpp", running=processing, waiting=metrics.waiting,
        kv_cache_usage=metrics.kv_cache_usage, prefix_hits=metrics.prefix_hits,
        prefix_queries=metrics.prefix_queries, slot_tasks=tasks, slots=total,
    )


def total_slots_from_props(body: bytes) -> int | None:
    """``total_slots`` of llama.cpp's ``GET /props`` (what ``-np`` set), or None if it has none."""
    try:
        props = json.loads(body)
    except (UnicodeDecodeError, ValueError) as e:
        raise MetricsFormatError(f"/props is not JSON: {e}") from None
    slots = props.get("total_slots") if isinstance(props, dict) else None
    return slots if _is_int(slots) and slots > 0 else None
