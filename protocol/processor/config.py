"""The processor's configuration: every tunable, validated once on construction; a frozen value."""

from __future__ import annotations

from dataclasses import dataclass, field

from protocol.processor.errors import ProcessorUsageError
from protocol.routing.config import RoutingConfig

__all__ = ["ProcessorConfig"]


@dataclass(frozen=True)
class ProcessorConfig:
    """Every tunable of the processor, validated once on construction.

    queue_timeout: how long a task waits for an engine that serves its model
        before it fails with 503 (never past the task's own deadline).
    max_task_duration: deadline of a task whose client gave none.
    max_attempts: sends of one task to engines, in all, before any result
        was delivered: whatever failed (a lost engine, a failed send, a busy
        or unreachable runtime, a runtime that dropped it) and on whichever
        engine. A task a runtime read and dropped is sent again at most once
        (:mod:`protocol.processor.attempts`). When none is left, the client gets the
        last failure's answer at once.
    retry_delay: pause before sending a task again after its engine was lost,
        the send failed or a runtime dropped it, so that a flapping engine is
        not hammered; 0 sends it again at once. (A busy runtime's task goes at
        once to another engine with room, or waits.)
    dynamic_model_loading: when no engine serves a model, send the task to the
        ready engine with the fewest models (which loads it on demand) instead
        of waiting.
    max_waiting_tasks: tasks that may wait for an engine at once, over all
        tenants and models; past it a new task fails with 503 at once.
    max_unconsumed_results: results delivered to one request and not yet
        acknowledged with ``results_consumed``; past it that request alone
        fails (its consumer is too slow) and its engine is told to stop.
    heartbeat_interval: seconds between heartbeats to local engines; None
        sends none.
    heartbeat_max_missed: unanswered heartbeats in a row after which a local
        engine is removed and its stream closed.
    control_task_prefix: prefix of the ids of tasks the processor makes itself
        (heartbeat, go-away, cancel); callers must not use it for their ids.
    busy_retry_after: the ``Retry-After`` (seconds) suggested with a 503 for
        lack of capacity (queue full, queue timeout, engine or tenant at its
        cap) and with the 429 of the tenant cap.
    max_in_flight_per_engine: tasks one engine holds at once (dispatched or
        streaming), counted as the larger of this processor's tasks on it and
        what the engine last reported (its runtime's running and waiting
        requests, else its ``in_progress_task_count``, which count every
        gateway's tasks) plus the tasks this processor sent it since. An engine
        at it is skipped by routing, so a task goes to another engine or waits
        in the queue and is dispatched when a task on the engine ends. A
        targeted task (forwarded by a peer) for an engine at it waits for a slot
        on that engine, in its caller's turn among every gateway's callers
        (``TaskRequest.infx_caller``); a sheddable one is refused with 503 at
        once, so that the peer tries elsewhere. None: no cap (the engine agent
        bounds its own queue).
    cap_at_runtime_slots: without ``max_in_flight_per_engine``, a local engine
        that reports its runtime's slots (``EngineStatus.infx_runtime_slots``)
        holds at most that many, so that a request waits in this gateway's fair
        queue rather than inside a full runtime; a peer's engine is capped by
        its own gateway, whose count is exact (a task forwarded there waits in
        that engine's queue). Engines that report no slots have no cap.
    fair_reserve: with ``max_in_flight_per_engine``, the last free slots of
        each engine (at most the cap less one) that only a task of the caller
        holding the fewest slots per weight on its model, or a critical task,
        may take (:mod:`protocol.processor.fair_share`): a caller's burst leaves them
        for the others' next requests, which then start at once on the engine
        that holds their cache. 0: none.
    max_tasks_per_tenant: live tasks (waiting, retrying or on an engine) one
        tenant may have in this processor; past it the tenant's next task fails
        at once with 429 and ``busy_retry_after``, and other tenants are not
        affected. Targeted tasks forwarded by peers count too, since they hold
        this gateway's queue and engines as much as a client's own; one refused
        for the cap gets 503 instead of 429, so that the forwarding peer retries
        it elsewhere rather than handing the client a limit of this gateway's.
        None: no cap.
    busy_backoff: seconds an engine whose runtime answered busy (503 or 429,
        see ``BUSY_STATUSES``) without a ``Retry-After`` gets no task; with one
        it gets none for that long (never less than ``busy_backoff``, so that a
        ``Retry-After: 0`` cannot make a busy loop; at most ``max_busy_backoff``). The task that
        got the answer goes to another engine with room at once, or waits in
        the queue (for ``queue_timeout`` from its first busy answer, never past
        its deadline) and, if time or its ``max_attempts`` run out, gets the
        runtime's own answer.
    shed_waiting_threshold: a sheddable task that would wait while every
        engine serving its model is at ``max_in_flight_per_engine`` fails at
        once with 429 and ``busy_retry_after`` when its model's queue already
        holds this many tasks (0: sheddable tasks never wait behind full
        engines). They are also the first refused when the whole queue is full.
    routing: the routing policy and its weights (:mod:`protocol.routing.router`).
    route_stuck_timeout: seconds a route (an engine's or a peer's stream) may
        stay blocked (its adapter reported it not draining, and no drain since)
        before the processor closes it with ``CloseRoute``; its tasks fail over
        like any lost engine's. A blocked route gets no new tasks meanwhile.
        None: blocked routes are never closed for it.
    clash_probe_timeout: seconds a local engine has to answer the heartbeat it
        is sent when another engine process claims its id on this gateway
        (``update_engine``); one that does not is taken for a dead stream (a
        half-open connection) and closed, so that the newcomer's next attempt
        gets in.
    """

    queue_timeout: float = 30.0
    max_task_duration: float = 600.0
    max_attempts: int = 3
    retry_delay: float = 3.0
    dynamic_model_loading: bool = False
    max_waiting_tasks: int = 10_000
    max_unconsumed_results: int = 1024
    heartbeat_interval: float | None = None
    heartbeat_max_missed: int = 3
    control_task_prefix: str = "infx-ctl-"
    busy_retry_after: float = 5.0
    max_in_flight_per_engine: int | None = None
    cap_at_runtime_slots: bool = False
    fair_reserve: int = 2
    max_tasks_per_tenant: int | None = None
    busy_backoff: float = 1.0
    max_busy_backoff: float = 60.0
    shed_waiting_threshold: int = 0
    routing: RoutingConfig = field(default_factory=RoutingConfig)
    route_stuck_timeout: float | None = 30.0
    clash_probe_timeout: float = 5.0

    def __post_init__(self) -> None:
        problems = []
        if self.queue_timeout < 0:
            problems.append("queue_timeout must be >= 0")
        if self.max_task_duration <= 0:
            problems.append("max_task_duration must be > 0")
        if self.max_attempts < 1:
            problems.append("max_attempts must be >= 1")
        if self.retry_delay < 0:
            problems.append("retry_delay must be >= 0")
        if self.max_waiting_tasks < 0:
            problems.append("max_waiting_tasks must be >= 0")
        if self.max_unconsumed_results < 1:
            problems.append("max_unconsumed_results must be >= 1")
        if self.heartbeat_interval is not None and self.heartbeat_interval <= 0:
            problems.append("heartbeat_interval must be > 0 or None")
        if self.heartbeat_max_missed < 1:
            problems.append("heartbeat_max_missed must be >= 1")
        if self.busy_retry_after < 0:
            problems.append("busy_retry_after must be >= 0")
        if self.max_in_flight_per_engine is not None and self.max_in_flight_per_engine < 1:
            problems.append("max_in_flight_per_engine must be >= 1 or None")
        if self.fair_reserve < 0:
            problems.append("fair_reserve must be >= 0")
        if self.max_tasks_per_tenant is not None and self.max_tasks_per_tenant < 1:
            problems.append("max_tasks_per_tenant must be >= 1 or None")
        if not 0 < self.busy_backoff <= self.max_busy_backoff:
            problems.append("busy_backoff must be > 0 and <= max_busy_backoff")
        if self.shed_waiting_threshold < 0:
            problems.append("shed_waiting_threshold must be >= 0")
        if self.route_stuck_timeout is not None and self.route_stuck_timeout <= 0:
            problems.append("route_stuck_timeout must be > 0 or None")
        if self.clash_probe_timeout <= 0:
            problems.append("clash_probe_timeout must be > 0")
        if not self.control_task_prefix:
            problems.append("control_task_prefix must not be empty")
        if problems:
            raise ProcessorUsageError("; ".join(problems))
