"""The processor's monotonic counters, which the Twisted layer exports as metrics; pure values."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

__all__ = ["ProcessorCounters"]


@dataclass
class ProcessorCounters:
    """Monotonic counters the Twisted layer exports as metrics."""

    accepted: int = 0
    #: Sends of a task after one of its attempts failed, by that failure (``AttemptFailure``).
    retries: Counter[str] = field(default_factory=Counter)
    #: Attempts that failed without an answer for the client, by failure, retried or not.
    attempt_failures: Counter[str] = field(default_factory=Counter)
    results_ignored: int = 0
    protocol_errors: int = 0
    slow_consumers: int = 0
    heartbeats_missed: int = 0
    engine_id_clashes: int = 0
    tenant_cap_refusals: int = 0
    drain_refusals: int = 0
    shed: int = 0
    outcomes: Counter[str] = field(default_factory=Counter)
