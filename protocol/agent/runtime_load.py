"""The engine agent's reading of its runtime's load: when to scrape, what to report; pure.

Rules this file keeps: no I/O, no clock reads. Inputs are method calls that
take ``now`` (last, never defaulted) and return effects as frozen
dataclasses; ``next_deadline()`` says when to call ``handle_timeout(now)``. The caller performs a
:class:`ScrapeRuntime` (HTTP GETs of its paths on the runtime, with the
runtime's credentials) and reports the answers with its ``scrape_id``; the
answers to a scrape that was abandoned (it timed out) are ignored. Parsing is
:mod:`protocol.agent.runtime_metrics`'.

Which paths (``LoadSource``)::

    PROBING   -> METRICS            /metrics answered with names we know, /slots is not there
    PROBING   -> SLOTS              /metrics has none (404, 501, other names); /slots answered
    PROBING   -> ABSENT             neither: the runtime reports no load (llama-cpp-python)
    PROBING   -> METRICS+SLOTS      /metrics is llama.cpp's: its /slots says what runs and what
                                    the prompt cache served
    METRICS+SLOTS -> METRICS        /slots is off (404, 501): /props says the slots, once
    ABSENT    -> PROBING            every ``absent_interval``: the runtime may have been replaced

A probe asks /metrics and /slots at once, so that a llama.cpp server's first
reading says its slots.

Scrapes run every ``interval`` seconds (every ``absent_interval`` while
ABSENT), and at once when the runtime turns ready (``runtime_ready``). What
is reported (:class:`LoadChanged`) is coalesced: the first reading at once,
then only a change that matters (a count off by at least
``max(1, count_step × old)``, a fraction by ``fraction_step``, another
adapter set) and at most once per ``report_min_interval`` (a change of the
runtime's slots at once), so that a busy runtime whose counts move on every
scrape does not send a status per scrape.
After ``stale_after`` scrapes in a row fail, the load is withdrawn
(``LoadChanged(None)``): routing then falls back to in-progress counts
rather than trust numbers that no longer describe the runtime.

The runtime's capacity comes with its load: a llama.cpp server's slots are
the entries of its ``/slots`` (or, with ``/slots`` off, ``total_slots`` of
its ``/props``, read once), reported as ``RuntimeLoad.slots``.

Each scrape is stamped: the caller says, as it sends the scrape's requests,
which of the gateway's tasks the agent had received and seen end by then (a
:class:`LoadSample`), and the load read from its answers carries that stamp,
so that the gateway adds to it only the tasks sent after it, and takes off
only those that ended after it. The stamp alone changing is no change worth a
report: an older reading with its older stamp is as good.

A prefix-cache hit rate from counters (vLLM's hits and queries in tokens,
llama.cpp's cached and computed prompt tokens, else the cached prompt tokens
of each task its slots show) is the ratio of their increase
over the last ``hit_rate_window`` seconds; with no query in that window the
last rate stands (it describes the traffic this cache last saw). A counter
that goes down means the runtime restarted: its history starts over.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, replace
from enum import Enum

from protocol.agent.runtime_metrics import (
    LoadReading,
    MetricsFormatError,
    reading_from_metrics,
    reading_from_slots,
    total_slots_from_props,
)
from protocol.errors import LocalUsageError
from protocol.pb import status_pb2

__all__ = [
    "LoadChanged", "LoadConfig", "LoadEffect", "LoadSample", "LoadSource", "LoadUsageError", "RuntimeLoad",
    "RuntimeLoadMonitor", "ScrapeAnswer", "ScrapeRuntime",
]

METRICS_PATH = "/metrics"
SLOTS_PATH = "/slots"
PROPS_PATH = "/props"
#: Answers that mean "this runtime has no such endpoint" (llama.cpp answers 501 without --metrics).
_NOT_THERE = frozenset({404, 405, 501})


class LoadUsageError(LocalUsageError):
    """The caller drove the machine wrongly (bad config, start twice)."""


class LoadSource(Enum):
    """Which endpoints the runtime's load comes from."""

    PROBING = "probing"
    METRICS = "metrics"
    METRICS_AND_SLOTS = "metrics+slots"
    SLOTS = "slots"
    ABSENT = "absent"


_PATHS = {
    # Both at once: a llama.cpp server's first reading then says its slots (its capacity).
    LoadSource.PROBING: (METRICS_PATH, SLOTS_PATH),
    LoadSource.METRICS: (METRICS_PATH,),
    LoadSource.METRICS_AND_SLOTS: (METRICS_PATH, SLOTS_PATH),
    LoadSource.SLOTS: (SLOTS_PATH,),
    LoadSource.ABSENT: (METRICS_PATH,),
}


@dataclass(frozen=True)
class LoadConfig:
    """The monitor's settings; see the module docstring for what each does."""

    interval: float = 1.0
    report_min_interval: float = 2.0
    timeout: float = 2.0
    absent_interval: float = 30.0
    hit_rate_window: float = 60.0
    stale_after: int = 3
    count_step: float = 0.1
    fraction_step: float = 0.05

    def __post_init__(self) -> None:
        for name in ("interval", "timeout", "absent_interval", "hit_rate_window"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise LoadUsageError(f"{name} must be a finite number > 0")
        for name in ("report_min_interval", "count_step", "fraction_step"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise LoadUsageError(f"{name} must be a finite number >= 0")
        if self.stale_after < 1:
            raise LoadUsageError("stale_after must be at least 1")


@dataclass(frozen=True)
class LoadSample:
    """Which of the gateway's tasks a reading includes: when its scrape went out, the agent had received
    ``received`` runtime tasks on its stream ``stream_id``, and ``ended`` of them had ended."""

    stream_id: int
    received: int
    ended: int


@dataclass(frozen=True)
class RuntimeLoad:
    """The load as reported to the gateway (``EngineStatus.Model.runtime_load``), with the runtime's slots
    (``EngineStatus.infx_runtime_slots``) and the reading's stamp, which the agent's core places."""

    source: str
    running: int
    waiting: int
    kv_cache_usage: float | None = None
    prefix_cache_hit_rate: float | None = None
    adapters: tuple[str, ...] = ()
    slots: int | None = None
    sample: LoadSample | None = None

    def to_pb(self) -> status_pb2.EngineStatus.RuntimeLoad:
        """The wire message, without the stamp (which only the core knows how to place)."""
        message = status_pb2.EngineStatus.RuntimeLoad(
            running_requests=self.running, waiting_requests=self.waiting,
            loaded_adapters=list(self.adapters), source=self.source,
        )
        if self.kv_cache_usage is not None:
            message.kv_cache_usage = self.kv_cache_usage
        if self.prefix_cache_hit_rate is not None:
            message.prefix_cache_hit_rate = self.prefix_cache_hit_rate
        return message


@dataclass(frozen=True)
class ScrapeRuntime:
    """GET each of ``paths`` on the runtime; report every answer with ``scrape_done``."""

    scrape_id: int
    paths: tuple[str, ...]


@dataclass(frozen=True)
class LoadChanged:
    """Report this load with the engine's status from now on (None: report none)."""

    load: RuntimeLoad | None


LoadEffect = ScrapeRuntime | LoadChanged


@dataclass(frozen=True)
class ScrapeAnswer:
    """What one GET gave: its HTTP status and body, or ``status`` None when it failed to connect."""

    status: int | None
    body: bytes = b""

    @property
    def ok(self) -> bool:
        return self.status is not None and 200 <= self.status < 300

    @property
    def not_there(self) -> bool:
        return self.status in _NOT_THERE


class _HitWindow:
    """Cumulative (hits, queries) points over the last ``window`` seconds, and the rate they give."""

    def __init__(self, window: float) -> None:
        self.window = window
        self.points: deque[tuple[float, float, float]] = deque()
        self.rate: float | None = None

    def add(self, hits: float, queries: float, now: float) -> float | None:
        if self.points and (hits < self.points[-1][1] or queries < self.points[-1][2]):
            self.points.clear()  # the runtime restarted: its counters began again
        self.points.append((now, hits, queries))
        # Keep one point at or before the window's start, so that the window is covered whole.
        while len(self.points) > 1 and self.points[1][0] <= now - self.window:
            self.points.popleft()
        _, first_hits, first_queries = self.points[0]
        if queries > first_queries:
            self.rate = min(1.0, max(0.0, (hits - first_hits) / (queries - first_queries)))
        return self.rate


class RuntimeLoadMonitor:
    """Scrapes a runtime's own load signals and says what to report; see the module docstring."""

    def __init__(self, config: LoadConfig | None = None) -> None:
        self.config = config or LoadConfig()
        self.source = LoadSource.PROBING
        self.started = False
        self._next_id = 1
        self._pending: tuple[int, float, tuple[str, ...]] | None = None
        self._scrape_at: float | None = None
        self._failures = 0
        self._hits = _HitWindow(self.config.hit_rate_window)
        self._slot_seen: dict[int, int] = {}
        #: llama.cpp's slots from /props, for a server whose /slots is off (asked once).
        self._llama = False
        self._props_asked = False
        self._props_slots: int | None = None
        self._slot_hits = 0.0
        self._slot_queries = 0.0
        self._latest: RuntimeLoad | None = None
        self._reported: RuntimeLoad | None = None
        self._reported_at = -math.inf
        self._report_due: float | None = None

    # -- inspection ---------------------------------------------------------------

    @property
    def reported(self) -> RuntimeLoad | None:
        """The load last handed out with :class:`LoadChanged`."""
        return self._reported

    @property
    def reading(self) -> bool:
        """A scrape is under way: sent, neither answered nor abandoned yet."""
        return self._pending is not None

    def next_deadline(self) -> float | None:
        """When ``handle_timeout`` must run next, or None."""
        candidates = [t for t in (self._scrape_at, self._report_due) if t is not None]
        if self._pending is not None:
            candidates.append(self._pending[1] + self.config.timeout)
        return min(candidates) if candidates else None

    # -- commands -----------------------------------------------------------------

    def start(self, now: float) -> list[LoadEffect]:
        """Begin: scrape at once."""
        if self.started:
            raise LoadUsageError("start() called twice")
        self.started = True
        return self._scrape(now)

    def runtime_ready(self, now: float) -> list[LoadEffect]:
        """The runtime turned ready (its health check answers): read it at once, not at the next
        scrape's time (up to ``interval`` away after failed reads, ``absent_interval`` once it showed
        no load), so that the tasks readiness lets in are soon routed by its slots. A scrape under
        way stands."""
        if not self.started or self._pending is not None:
            return []
        return self._scrape(now)

    def scrape_done(self, scrape_id: int, answers: Mapping[str, ScrapeAnswer], sample: LoadSample | None,
                    now: float) -> list[LoadEffect]:
        """The answers to scrape ``scrape_id`` (a path missing from ``answers`` failed); ``sample``: the
        gateway's tasks the agent had received and seen end when it sent the scrape (None: unknown)."""
        if self._pending is None or self._pending[0] != scrape_id:
            return []
        paths = self._pending[2]
        self._pending = None
        self._scrape_at = now + self.config.interval
        failed = ScrapeAnswer(None)
        reading = self._read({path: answers.get(path, failed) for path in paths})
        effects: list[LoadEffect] = []
        if reading is None:
            self._failed(now, effects)
        else:
            self._failures = 0
            self._take(now, reading, sample, effects)
        if self.source is LoadSource.ABSENT:
            self._scrape_at = now + self.config.absent_interval
        return effects

    def handle_timeout(self, now: float) -> list[LoadEffect]:
        """Time passed: abandon a scrape that took too long, scrape, send a held-back report."""
        effects: list[LoadEffect] = []
        if self._pending is not None and now >= self._pending[1] + self.config.timeout:
            self._pending = None
            self._scrape_at = now + self.config.interval
            self._failed(now, effects)
        if self._report_due is not None and now >= self._report_due:
            self._report_due = None
            if self._latest is not None:
                self._report(now, self._latest, effects)
        if self._pending is None and self._scrape_at is not None and now >= self._scrape_at:
            effects.extend(self._scrape(now))
        return effects

    # -- internals ----------------------------------------------------------------

    def _scrape(self, now: float) -> list[LoadEffect]:
        if self.source is LoadSource.ABSENT:
            self.source = LoadSource.PROBING
        paths = _PATHS[self.source]
        if self.source is LoadSource.METRICS and self._llama and not self._props_asked:
            paths += (PROPS_PATH,)
        self._pending = (self._next_id, now, paths)
        self._scrape_at = None
        self._next_id += 1
        return [ScrapeRuntime(self._pending[0], paths)]

    def _read(self, answers: Mapping[str, ScrapeAnswer]) -> LoadReading | None:
        """The reading in the answers, moving between sources as the runtime shows what it has."""
        metrics = answers.get(METRICS_PATH)
        slots = answers.get(SLOTS_PATH)
        props = answers.get(PROPS_PATH)
        if props is not None and (props.ok or props.not_there):
            self._props_asked = True
            if props.ok:
                try:
                    self._props_slots = total_slots_from_props(props.body)
                except MetricsFormatError:
                    pass  # the slots stay unknown; the load is read all the same
        from_metrics: LoadReading | None = None
        if metrics is not None and metrics.ok:
            try:
                from_metrics = reading_from_metrics(metrics.body.decode("utf-8", "replace"))
            except MetricsFormatError:
                return None
            if from_metrics is not None and from_metrics.source == "llama.cpp":
                self._llama = True
                if from_metrics.slots is None and self._props_slots is not None:
                    from_metrics = replace(from_metrics, slots=self._props_slots)
        probing = self.source is LoadSource.PROBING
        # /metrics answered, whether or not with names we know (a failed GET tells nothing).
        answered = metrics is not None and (metrics.ok or metrics.not_there)
        if slots is not None and slots.ok:
            try:
                reading = reading_from_slots(slots.body, from_metrics)
            except MetricsFormatError:
                return None
            if probing and answered:
                self.source = LoadSource.METRICS_AND_SLOTS if from_metrics is not None else LoadSource.SLOTS
            return reading
        if slots is not None and slots.not_there:
            if from_metrics is not None:
                self.source = LoadSource.METRICS
            elif answered or not probing:
                self.source = LoadSource.ABSENT
            return from_metrics
        if from_metrics is not None:
            if probing:
                # /slots failed: llama.cpp's is asked again; a server that has it off stays on METRICS.
                llama = from_metrics.source == "llama.cpp"
                self.source = LoadSource.METRICS_AND_SLOTS if llama else LoadSource.METRICS
            return from_metrics
        if probing and answered:
            self.source = LoadSource.SLOTS  # llama.cpp without --metrics still has /slots
        elif metrics is not None and metrics.ok:
            self.source = LoadSource.ABSENT  # it answers, with names of no runtime we know
        return None

    def _failed(self, now: float, effects: list[LoadEffect]) -> None:
        self._failures += 1
        if self._failures >= self.config.stale_after:
            self._props_asked = False  # a runtime back after an outage may have been started with other slots
        if self._failures >= self.config.stale_after and (self._reported is not None or self._latest is not None):
            self._latest = None
            self._report_due = None
            if self._reported is not None:
                self._reported = None
                self._reported_at = now
                effects.append(LoadChanged(None))

    def _hit_rate(self, now: float, reading: LoadReading) -> float | None:
        if reading.prefix_hits is not None and reading.prefix_queries is not None:
            return self._hits.add(reading.prefix_hits, reading.prefix_queries, now)
        if reading.slot_tasks:
            for task in reading.slot_tasks:
                if self._slot_seen.get(task.slot_id) != task.task_id:
                    self._slot_seen[task.slot_id] = task.task_id
                    self._slot_hits += task.cached_tokens
                    self._slot_queries += task.prompt_tokens
            return self._hits.add(self._slot_hits, self._slot_queries, now)
        return reading.prefix_hit_rate

    def _take(self, now: float, reading: LoadReading, sample: LoadSample | None, effects: list[LoadEffect]) -> None:
        load = RuntimeLoad(
            source=reading.source, running=reading.running, waiting=reading.waiting,
            kv_cache_usage=reading.kv_cache_usage, prefix_cache_hit_rate=self._hit_rate(now, reading),
            adapters=reading.adapters, slots=reading.slots, sample=sample,
        )
        if self._reported is not None and not self._matters(self._reported, load):
            # What the gateway holds is as good: a stamp of its own says what it already counts.
            self._latest = self._reported
            self._report_due = None
            return
        self._latest = load
        due = self._reported_at + self.config.report_min_interval
        # The slots are the engine's capacity: a change of them is not held back.
        if self._reported is None or now >= due or load.slots != self._reported.slots:
            self._report(now, load, effects)
        else:
            self._report_due = due

    def _report(self, now: float, load: RuntimeLoad, effects: list[LoadEffect]) -> None:
        if (self._reported is not None and replace(load, sample=None) == replace(self._reported, sample=None)
                and _stream(load) == _stream(self._reported)):
            return
        self._reported = load
        self._reported_at = now
        effects.append(LoadChanged(load))

    def _matters(self, old: RuntimeLoad, new: RuntimeLoad) -> bool:
        """Whether ``new`` differs from what the gateway was told enough to tell it again."""
        c = self.config
        if (old.source, old.adapters, old.slots, _stream(old)) != (new.source, new.adapters, new.slots, _stream(new)):
            # A stamp of another stream (or none) says nothing of what the gateway counts now.
            return True
        for before, after in ((old.running, new.running), (old.waiting, new.waiting)):
            if abs(after - before) >= max(1.0, c.count_step * before):
                return True
        for was, now_is in ((old.kv_cache_usage, new.kv_cache_usage),
                            (old.prefix_cache_hit_rate, new.prefix_cache_hit_rate)):
            if (was is None) != (now_is is None):
                return True
            if was is not None and now_is is not None and abs(now_is - was) >= c.fraction_step:
                return True
        return False


def _stream(load: RuntimeLoad) -> int | None:
    """The stream whose tasks a reading's stamp counts (None: unstamped)."""
    return None if load.sample is None else load.sample.stream_id
