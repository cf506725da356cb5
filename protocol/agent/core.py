"""The engine agent's bookkeeping: streams to the gateway, tasks in flight, status; pure.

Rules this file keeps: no I/O, no clock reads, no randomness. Every input is
a method call that takes ``now`` (seconds, any monotonic scale; always the
last argument, never defaulted) and returns the effects the caller must
perform, in order, as frozen dataclasses; ``next_deadline()`` says when to
call ``handle_timeout(now)``. Jitter for the reconnect backoff is an
argument the caller must give, so a simulation decides it. A closed stream
is forgotten at once (its id stays known as closed, because ids only grow),
so that reconnecting for days keeps the machine as small as on day one. Everything
that changes which task runs, which stream a result goes to, and what the
gateway is told about this engine lives here; running a task is the
runtime's business (``StartTask`` / ``AbortTask``).

Streams (``StreamState``)::

    start / reconnect / go-away -> OPEN     the current stream; status reports go here
    OPEN    -> RETIRING   go-away: answered 202, a new stream replaces it; its tasks finish here
    OPEN | RETIRING -> CLOSED   the gateway ended it / it failed / it is retired and idle (then forgotten)

Agent (``AgentState``)::

    IDLE     -> RUNNING    start: the first stream opens
    IDLE     -> STOPPED    shutdown before start
    RUNNING  -> DRAINING   shutdown: ready=false, no new work, in-flight tasks finish
    DRAINING -> STOPPED    all tasks done, or the grace period ran out (tasks aborted)

Tasks: at most ``max_concurrency`` run at once; up to ``max_queued`` more
wait in arrival order and count as in progress (the gateway routes by that
count); one more is answered 503 at once, so that the gateway retries it on
another engine instead of it waiting here without bound. A task lives
until its runtime reports it finished, it is cancelled by the gateway, its
stream goes away (nobody is left to read its results), or its
``timeout_seconds`` (counted from its arrival) pass: then it is aborted. A
task whose deadline passes before its first result is answered 504; one
already streaming is only aborted, and the gateway's own deadline ends the
client's response. Either way the runtime stops working for nobody. Results of a task that is no longer known are dropped, because a
runtime may still be unwinding after an abort.

Models are ready while the runtime is (``runtime_changed``, from the health
check of :mod:`protocol.agent.runtime_health`): with ``wait_for_runtime`` they are
reported not ready until the runtime first answers, and again whenever it
stops answering, so that the gateway holds their requests in its queue
instead of sending them here. With no ``models`` configured, the models are
those the runtime lists. Readiness changes are reported at once.
The runtime's own load (``runtime_load_changed``, from the monitor of
:mod:`protocol.agent.runtime_load`, which already coalesces it) goes out with every
model's status as ``runtime_load``; with none, the field is absent and the
gateway routes by in-progress counts alone. The monitor stamps each reading
with :meth:`EngineAgentCore.load_sample`, taken when its scrape went out: the
runtime tasks received on the current stream so far and how many of them
ended (every task the stream carried to this agent counts, a refused one as
received and ended at once), which go out as ``runtime_load.tasks_received``
and ``tasks_ended`` while that stream is the one reported on. The runtime's
slots (``--runtime-slots`` in ``runtime_slots``, else what the monitor read)
go out as ``infx_runtime_slots``. And every answer the runtime gives is read
for its prompt's tokens and how many its cache served
(:mod:`protocol.agent.prompt_usage`, once per task), summed per model into
``infx_prompt_cache``. What the slot keeper did (``slot_keeping_changed``, from
:mod:`protocol.agent.slot_keeper`'s counts) goes out as ``infx_slot_keeping``.

Control tasks are answered here: heartbeat 200, go-away 202, cancel 200
(404 when the named task is unknown), an empty request 501 (as LLMariner's
engine does, so a newer gateway can add kinds); runtime tasks that arrive
while draining get 503 so that the gateway retries them on another engine.

Size (over 600 lines): one machine, whose streams, tasks, readiness, load stamps and prompt
counts all change together on each input; its configuration and effects are values of their own
(:mod:`protocol.agent.effects`).
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field
from enum import Enum

from protocol.agent.effects import (
    AbortTask, AgentConfig, AgentUsageError, CloseStream, Effect, OpenStream, SendResult, SendStatus, StartTask, Stopped,
)
from protocol.agent.prompt_usage import prompt_usage
from protocol.agent.runtime_load import LoadSample, RuntimeLoad
from protocol.errors import RemoteProtocolError
from protocol.openai.errors import error_json, status_line
from protocol.pb import status_pb2, worker_pb2

__all__ = ["AgentState", "EngineAgentCore", "GatewayProtocolError", "StreamState", "control_response"]

RUNTIME_KINDS = frozenset(
    {"chat_completion", "embedding", "audio_transcription", "model_response", "tokenize_request"}
)


class GatewayProtocolError(RemoteProtocolError):
    """The gateway broke the protocol (e.g. reused the id of a task still in flight).

    The offending task is dropped; the stream goes on.
    """


# -- state ---------------------------------------------------------------------------


class AgentState(Enum):
    """Life of the whole agent."""

    IDLE = "idle"
    RUNNING = "running"
    DRAINING = "draining"
    STOPPED = "stopped"


class StreamState(Enum):
    """Life of one ProcessTasks stream."""

    OPEN = "open"
    RETIRING = "retiring"
    CLOSED = "closed"


@dataclass
class _Stream:
    id: int
    state: StreamState
    tasks: dict[str, None] = field(default_factory=dict)  # ordered: aborted in arrival order
    last_status: status_pb2.EngineStatus | None = None
    last_status_at: float = -math.inf
    #: The agent's change counters when ``last_status`` was sent (or found unchanged).
    last_changes: int = -1
    last_readiness: int = -1
    linger_until: float = -math.inf
    #: Runtime tasks this stream brought, and how many of them ended (what a load reading's stamp counts).
    received: int = 0
    ended: int = 0


@dataclass
class _Task:
    task: worker_pb2.Task
    stream_id: int
    model: str
    deadline: float | None = None
    running: bool = False
    next_index: int = 0
    #: Whether an answer of its already said what its prompt cost (it is counted once).
    usage_seen: bool = False


@dataclass
class _PromptCache:
    answers: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0


def control_response(task_id: str, status: int) -> worker_pb2.TaskResult:
    """The single HttpResponse that answers a control task (heartbeat, go-away, cancel)."""
    response = worker_pb2.HttpResponse(status_code=status, status=status_line(status))
    return worker_pb2.TaskResult(task_id=task_id, http_response=response, result_index=0)


def _error_response(task_id: str, status: int, message: str) -> worker_pb2.TaskResult:
    result = control_response(task_id, status)
    result.http_response.header["Content-Type"].values.append("application/json")
    result.http_response.body = error_json(status, message)
    return result


def task_model(task: worker_pb2.Task) -> str:
    """The model a runtime task names ("" for control tasks)."""
    kind = task.request.WhichOneof("request")
    if kind not in RUNTIME_KINDS:
        return ""
    model: str = getattr(task.request, kind).model
    return model


class EngineAgentCore:
    """The agent's state machine; see the module docstring for its rules."""

    def __init__(self, config: AgentConfig) -> None:
        self.config = config
        self.state = AgentState.IDLE
        self._streams: dict[int, _Stream] = {}
        self._current: int | None = None
        self._next_stream_id = 1
        self._tasks: dict[str, _Task] = {}
        # Kept as tasks come and go, so that a result costs the same with 10 or 10,000 in flight:
        self._queue: dict[str, None] = {}  # waiting for a slot, in arrival order
        self._model_counts: dict[str, int] = {}  # tasks held, by model
        self._deadlines: list[tuple[float, str]] = []  # a heap; entries of forgotten tasks linger
        self._running = 0
        self._reconnect_at: float | None = None
        self._failures = 0
        self._drain_deadline: float | None = None
        self._runtime_ready = not config.wait_for_runtime
        self._runtime_models: tuple[str, ...] = ()
        self._runtime_load: RuntimeLoad | None = None
        self._runtime_slots: int | None = None
        self._prompt_cache: dict[str, _PromptCache] = {}
        self._slot_keeping: status_pb2.EngineStatus.SlotKeeping | None = None
        #: What the status says is counted, not compared: ``_changes`` grows with every change of
        #: it (a task's count, the state, the runtime, its load, its slots, a prompt cache count, the
        #: slot keeper's counts, the stream reported on, what the runtime said it is), ``_readiness``
        #: with those that must reach the gateway at once (which models it may route here). Deciding whether a report is
        #: due then costs two comparisons of integers per input, and the status is built only when
        #: one is (at most every ``status_min_interval`` while tasks come and go).
        self._changes = 0
        self._readiness = 0
        self._status_cache: tuple[int, status_pb2.EngineStatus] | None = None
        # (kind, version) the runtime told of itself ("" while unknown).
        self._runtime_identity: tuple[str, str] = ("", "")

    # -- inspection ---------------------------------------------------------------

    @property
    def current_stream(self) -> int | None:
        """The stream that status reports and new tasks use (None while reconnecting)."""
        return self._current

    def stream_state(self, stream_id: int) -> StreamState:
        """State of a stream this machine opened."""
        stream = self._stream(stream_id)
        return StreamState.CLOSED if stream is None else stream.state

    @property
    def held_streams(self) -> tuple[int, ...]:
        """The streams the machine keeps (open or retiring): closed ones are forgotten."""
        return tuple(self._streams)

    @property
    def in_progress(self) -> int:
        """Tasks held: running plus waiting for a slot."""
        return len(self._tasks)

    @property
    def queued(self) -> int:
        """Tasks waiting for a slot."""
        return len(self._queue)

    @property
    def running(self) -> int:
        """Tasks running on the runtime now."""
        return self._running

    def task_stream(self, task_id: str) -> int | None:
        """The stream a task's results go to (None if the task is not in flight)."""
        task = self._tasks.get(task_id)
        return None if task is None else task.stream_id

    @property
    def models(self) -> tuple[str, ...]:
        """The models this engine serves: those configured, else those the runtime listed."""
        return self.config.models or self._runtime_models

    def engine_status(self) -> status_pb2.EngineStatus:
        """What the gateway should know about this engine now (the same message while nothing changed:
        callers never change it)."""
        cached = self._status_cache
        if cached is not None and cached[0] == self._changes:
            return cached[1]
        models = self.models
        status = status_pb2.EngineStatus(
            engine_id=self.config.engine_id,
            ready=self.state is AgentState.RUNNING,
            cluster_id=self.config.cluster_id,
            infx_capabilities=self.config.capabilities,
            infx_instance=self.config.instance,
            infx_runtime_slots=self.config.runtime_slots or self._runtime_slots or 0,
            infx_runtime_name=self.config.runtime_name,
            models=[
                status_pb2.EngineStatus.Model(id=m, is_ready=self._runtime_ready,
                                              in_progress_task_count=self._model_counts.get(m, 0))
                for m in models
            ],
        )
        for model in status.models:
            cache = self._prompt_cache.get(model.id)
            if cache is not None:
                model.infx_prompt_cache.answers = cache.answers
                model.infx_prompt_cache.prompt_tokens = cache.prompt_tokens
                model.infx_prompt_cache.cached_tokens = cache.cached_tokens
        if self._runtime_load is not None:
            load = self._runtime_load.to_pb()
            sample = self._runtime_load.sample
            if sample is not None and sample.stream_id == self._current:
                load.tasks_received = sample.received
                load.tasks_ended = sample.ended
            # One runtime serves all of this engine's models: its load is each one's.
            for model in status.models:
                model.runtime_load.CopyFrom(load)
        if self.config.runtime_kind or self.config.agent_version:
            source = self._runtime_load.source if self._runtime_load is not None else ""
            kind = self._runtime_identity[0] or source or self.config.runtime_kind
            status.infx_runtime.CopyFrom(status_pb2.EngineStatus.RuntimeInfo(
                kind=kind, version=self._runtime_identity[1], agent_version=self.config.agent_version))
        if self._slot_keeping is not None:
            status.infx_slot_keeping.CopyFrom(self._slot_keeping)
        self._status_cache = (self._changes, status)
        return status

    def _changed(self, readiness: bool = False) -> None:
        """What the status says changed (``readiness``: which models the gateway may route here)."""
        self._changes += 1
        if readiness:
            self._readiness += 1

    def next_deadline(self) -> float | None:
        """When ``handle_timeout`` must run next, or None."""
        # Asked after every input: compared in line, no list of candidates built each time.
        first = self._earliest_task_deadline()
        for when in (self._reconnect_at, self._drain_deadline):
            if when is not None and (first is None or when < first):
                first = when
        current = self._streams.get(self._current) if self._current is not None else None
        if current is not None:
            due = self._status_due(current)
            if first is None or due < first:
                first = due
        for stream in self._streams.values():
            if stream.state is StreamState.RETIRING and not stream.tasks and (
                    first is None or stream.linger_until < first):
                first = stream.linger_until
        return first

    # -- commands -----------------------------------------------------------------

    def start(self, now: float) -> list[Effect]:
        """Begin: open the first stream."""
        if self.state is not AgentState.IDLE:
            raise AgentUsageError(f"start() in state {self.state.value}")
        self.state = AgentState.RUNNING
        self._changed(readiness=True)
        effects: list[Effect] = []
        self._open(now, False, effects)
        return effects

    def runtime_changed(self, ready: bool, models: tuple[str, ...], now: float) -> list[Effect]:
        """The runtime started or stopped answering, or lists other ``models`` (``()``: none of its
        own); the gateway is told at once."""
        if any(not m for m in models) or len(set(models)) != len(models):
            raise AgentUsageError("runtime models must be distinct, non-empty ids")
        if ready != self._runtime_ready or models != self._runtime_models:
            self._runtime_ready = ready
            self._runtime_models = models
            self._changed(readiness=True)
        effects: list[Effect] = []
        self._report(now, effects)
        return effects

    def runtime_identified(self, kind: str, version: str, now: float) -> list[Effect]:
        """The runtime said what it is and its version (either may be ""): the gateway is told."""
        if (kind, version) == self._runtime_identity:
            return []
        self._runtime_identity = (kind, version)
        self._changed()
        effects: list[Effect] = []
        self._report(now, effects)
        return effects

    def load_sample(self) -> LoadSample | None:
        """What a runtime load read now includes of the gateway's tasks (None while no stream is current)."""
        if self._current is None:
            return None
        stream = self._streams[self._current]
        return LoadSample(stream.id, stream.received, stream.ended)

    def runtime_load_changed(self, load: RuntimeLoad | None, now: float) -> list[Effect]:
        """The runtime's own load changed enough to tell the gateway (None: it reports none now)."""
        if load != self._runtime_load:
            self._runtime_load = load
            # The slots are the engine's capacity, which routing's bounds and a later turn's engine
            # depend on: learned (a fresh engine's first reading) or changed, they go out at once, as
            # readiness does, and not a coalescing interval after the requests it let in.
            capacity = (load is not None and load.slots is not None and load.slots != self._runtime_slots
                        and self.config.runtime_slots is None)
            if load is not None and load.slots is not None:
                self._runtime_slots = load.slots
            self._changed(readiness=capacity)
        effects: list[Effect] = []
        self._report(now, effects)
        return effects

    def slot_keeping_changed(self, counts: status_pb2.EngineStatus.SlotKeeping, now: float) -> list[Effect]:
        """The slot keeper's counts changed (a task placed, a save or restore ended, keeping turned off)."""
        if counts != self._slot_keeping:
            self._slot_keeping = counts
            self._changed()
        effects: list[Effect] = []
        self._report(now, effects)
        return effects

    def stream_confirmed(self, stream_id: int) -> None:
        """The gateway answered on this stream (headers or a task): the backoff starts over."""
        if self._stream(stream_id) is not None:
            self._failures = 0

    def task_received(self, stream_id: int, task: worker_pb2.Task, now: float) -> list[Effect]:
        """A Task arrived on a stream.

        A task on a stream we already closed is dropped: we half-closed it,
        so it cannot be answered, and the gateway fails it over when the
        stream ends. Raises :class:`GatewayProtocolError` (and changes nothing) when its
        id is that of a task still in flight.
        """
        stream = self._stream(stream_id)
        if stream is None:
            return []
        self.stream_confirmed(stream_id)
        if task.id in self._tasks:
            raise GatewayProtocolError(f"task id {task.id!r} is already in flight")
        effects: list[Effect] = []
        kind = task.request.WhichOneof("request")
        if kind == "heartbeat":
            effects.append(SendResult(stream_id, control_response(task.id, 200)))
        elif kind == "go_away":
            effects.append(SendResult(stream_id, control_response(task.id, 202)))
            self._go_away(now, stream, effects)
        elif kind == "cancel_task":
            target = task.request.cancel_task.task_id
            found = target in self._tasks
            effects.append(SendResult(stream_id, control_response(task.id, 200 if found else 404)))
            if found:
                self._drop(target, effects)
                self._start_waiting(effects)
        elif kind in RUNTIME_KINDS:
            stream.received += 1
            if self.state is not AgentState.RUNNING:
                stream.ended += 1
                effects.append(SendResult(stream_id, _error_response(task.id, 503, "The engine is shutting down.")))
            elif self._running >= self.config.max_concurrency and len(self._queue) >= self.config.queue_limit:
                stream.ended += 1
                message = f"The engine is at capacity ({self.config.queue_limit} tasks already wait)."
                effects.append(SendResult(stream_id, _error_response(task.id, 503, message)))
            else:
                deadline = now + task.timeout_seconds if task.timeout_seconds > 0 else None
                model = task_model(task)
                self._tasks[task.id] = _Task(task=task, stream_id=stream_id, model=model, deadline=deadline)
                self._model_counts[model] = self._model_counts.get(model, 0) + 1
                self._changed()
                stream.tasks[task.id] = None
                self._queue[task.id] = None
                if deadline is not None:
                    heapq.heappush(self._deadlines, (deadline, task.id))
                self._start_waiting(effects)
        else:
            effects.append(SendResult(stream_id, _error_response(task.id, 501, f"Unknown task request {kind!r}.")))
        self._report(now, effects)
        return effects

    def send_result(self, task_id: str, result: worker_pb2.TaskResult) -> SendResult | None:
        """The runtime produced the task's next result; it goes to the task's stream.

        The machine takes ``result`` over (a body is not copied) and sets its ``task_id`` and
        ``result_index`` (0, 1, 2, ...). A result of a task no longer known (aborted) is dropped
        (None). The one effect, not a list: this runs per streamed event, and changes no deadline.
        """
        task = self._tasks.get(task_id)
        if task is None:
            return None
        if not task.running:
            raise AgentUsageError(f"result for task {task_id!r} before it started")
        if not task.usage_seen:
            usage = prompt_usage(result)
            if usage is not None:
                task.usage_seen = True
                cache = self._prompt_cache.setdefault(task.model, _PromptCache())
                cache.answers += 1
                cache.prompt_tokens += usage.prompt_tokens
                cache.cached_tokens += usage.cached_tokens
                self._changed()
        result.task_id = task_id
        result.result_index = task.next_index
        task.next_index += 1
        return SendResult(task.stream_id, result)

    def finish_task(self, task_id: str, now: float) -> list[Effect]:
        """The runtime is done with the task (after its last result, or after failing)."""
        task = self._tasks.get(task_id)
        if task is None:
            return []
        if not task.running:
            raise AgentUsageError(f"finish_task for task {task_id!r} that never started")
        effects: list[Effect] = []
        self._forget(task_id)
        self._start_waiting(effects)
        self._retire_idle(now, effects)
        self._report(now, effects)
        self._check_drained(effects)
        return effects

    def stream_closed(self, stream_id: int, jitter: float, now: float) -> list[Effect]:
        """The stream ended (the gateway closed it, or it failed); its tasks are aborted.

        ``jitter`` in [0, 1) places the reconnect delay within its band.
        Reporting a stream that is already closed is harmless.
        """
        stream = self._stream(stream_id)
        effects: list[Effect] = []
        if stream is None:
            return effects
        for task_id in list(stream.tasks):
            self._drop(task_id, effects)
        self._close(stream)
        self._start_waiting(effects)
        if stream_id == self._current:
            self._current = None
            if self.state is AgentState.RUNNING:
                self._schedule_reconnect(now, jitter)
        self._report(now, effects)
        self._check_drained(effects)
        return effects

    def shutdown(self, grace: float, now: float) -> list[Effect]:
        """Stop taking work: report ready=false, let tasks finish for up to ``grace`` seconds."""
        if self.state is AgentState.IDLE:
            self.state = AgentState.STOPPED
            return [Stopped()]
        if self.state is not AgentState.RUNNING:
            raise AgentUsageError(f"shutdown() in state {self.state.value}")
        self.state = AgentState.DRAINING
        self._changed(readiness=True)
        self._reconnect_at = None
        self._drain_deadline = now + max(grace, 0.0)
        effects: list[Effect] = []
        self._report(now, effects)
        self._check_drained(effects)
        return effects

    def handle_timeout(self, now: float) -> list[Effect]:
        """Time passed: expire tasks, reconnect, periodic status, retire idle streams, end the drain."""
        effects: list[Effect] = []
        if self._drain_deadline is not None and now >= self._drain_deadline:
            for task_id in list(self._tasks):
                self._drop(task_id, effects)
            self._check_drained(effects)
            return effects
        expired: dict[str, _Task] = {}  # an id back in flight with its old deadline has two entries
        while (due := self._earliest_task_deadline()) is not None and now >= due:
            task_id = heapq.heappop(self._deadlines)[1]
            expired[task_id] = self._tasks[task_id]
        for task in expired.values():
            if task.next_index == 0:
                effects.append(SendResult(task.stream_id, _error_response(
                    task.task.id, 504, "The task's deadline passed before the engine answered.")))
            self._drop(task.task.id, effects)
        if expired:
            self._start_waiting(effects)
            self._check_drained(effects)
        if self._reconnect_at is not None and now >= self._reconnect_at:
            self._reconnect_at = None
            self._open(now, True, effects)
        self._retire_idle(now, effects)
        self._report(now, effects)
        return effects

    # -- internals ----------------------------------------------------------------

    def _stream(self, stream_id: int) -> _Stream | None:
        """The stream, or None once it is closed; ids this machine never gave out are misuse."""
        if not 1 <= stream_id < self._next_stream_id:
            raise AgentUsageError(f"unknown stream {stream_id}")
        return self._streams.get(stream_id)

    def _close(self, stream: _Stream) -> None:
        """The stream is CLOSED: forget it (its id, below ``_next_stream_id``, reads as closed)."""
        stream.state = StreamState.CLOSED
        del self._streams[stream.id]

    def _open(self, now: float, new_connection: bool, effects: list[Effect]) -> None:
        stream = _Stream(id=self._next_stream_id, state=StreamState.OPEN)
        self._next_stream_id += 1
        self._streams[stream.id] = stream
        self._current = stream.id
        self._changed()  # a runtime load's stamp counts the current stream's tasks
        effects.append(OpenStream(stream.id, new_connection))
        self._report(now, effects)

    def _go_away(self, now: float, stream: _Stream, effects: list[Effect]) -> None:
        if stream.state is not StreamState.OPEN:
            return
        stream.state = StreamState.RETIRING
        stream.linger_until = now + self.config.go_away_linger
        if stream.id == self._current:
            self._current = None
            if self.state is AgentState.RUNNING:
                self._open(now, True, effects)

    def _schedule_reconnect(self, now: float, jitter: float) -> None:
        self._failures += 1
        delay = self.config.reconnect_backoff.delay(self._failures, min(max(jitter, 0.0), 1.0))
        self._reconnect_at = now + delay

    def _start_waiting(self, effects: list[Effect]) -> None:
        while self._queue and self._running < self.config.max_concurrency:
            task_id = next(iter(self._queue))
            del self._queue[task_id]
            task = self._tasks[task_id]
            task.running = True
            self._running += 1
            effects.append(StartTask(task.task))

    def _drop(self, task_id: str, effects: list[Effect]) -> None:
        task = self._tasks[task_id]
        if task.running:
            effects.append(AbortTask(task_id))
        else:
            del self._queue[task_id]
        self._forget(task_id)

    def _forget(self, task_id: str) -> None:
        task = self._tasks.pop(task_id)
        if task.running:
            self._running -= 1
        left = self._model_counts[task.model] - 1
        if left:
            self._model_counts[task.model] = left
        else:
            del self._model_counts[task.model]
        self._changed()
        stream = self._streams.get(task.stream_id)
        if stream is not None:
            stream.tasks.pop(task_id, None)
            stream.ended += 1

    def _earliest_task_deadline(self) -> float | None:
        """The soonest deadline of a task in flight; heap entries of tasks already gone are dropped
        here (an id is never reused while in flight, but may come back later with another deadline)."""
        while self._deadlines:
            deadline, task_id = self._deadlines[0]
            task = self._tasks.get(task_id)
            if task is not None and task.deadline == deadline:
                return deadline
            heapq.heappop(self._deadlines)
        return None

    def _retire_idle(self, now: float, effects: list[Effect]) -> None:
        for stream in list(self._streams.values()):
            if stream.state is StreamState.RETIRING and not stream.tasks and now >= stream.linger_until:
                self._close(stream)
                effects.append(CloseStream(stream.id))

    def _status_due(self, stream: _Stream) -> float:
        if stream.last_status is None:
            return -math.inf
        if stream.last_changes == self._changes:
            return stream.last_status_at + self.config.status_interval
        if stream.last_readiness != self._readiness:
            return stream.last_status_at
        return stream.last_status_at + self.config.status_min_interval

    def _report(self, now: float, effects: list[Effect]) -> None:
        if self._current is None:
            return
        stream = self._streams[self._current]
        if now < self._status_due(stream):
            return
        status = self.engine_status()
        unchanged = stream.last_changes != self._changes and status == stream.last_status
        stream.last_changes = self._changes
        stream.last_readiness = self._readiness
        if unchanged:
            return  # counts that came and went since the last report: the periodic one is next
        stream.last_status = status
        stream.last_status_at = now
        effects.append(SendStatus(stream.id, status))

    def _check_drained(self, effects: list[Effect]) -> None:
        if self.state is not AgentState.DRAINING or self._tasks:
            return
        self.state = AgentState.STOPPED
        self._changed(readiness=True)
        self._drain_deadline = None
        self._current = None
        for stream in list(self._streams.values()):
            self._close(stream)
            effects.append(CloseStream(stream.id))
        effects.append(Stopped())
