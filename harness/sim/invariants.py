"""The cluster's invariants, checked as results arrive, after every step, and at the end.

Rules this file keeps: a violation is an :class:`InvariantViolated` naming
one invariant of :data:`INVARIANTS`, raised at the first moment it can be
observed; checks only read what the system under test exposes (effects it
hands back, messages on the wire, public queries), never change it.

The ledger holds what clients were promised: every request a gateway
accepted, its tenant and deadline, and the results it has seen so far.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from protocol.pb import worker_pb2
from protocol.processor.effects import DeliverResult, FailRequest

#: Invariant names, as reported.
ENDS_ONCE = "ends-exactly-once"
ORDER = "in-order-no-duplicates"
TENANT = "tenant-isolation"
NO_LOOP = "no-advertising-loops"
LIVENESS = "liveness-after-faults"
#: Once faults stop, every gateway learns every up engine of the cluster (locally or through a peer).
CONVERGENCE = "routing-converges"
DEADLINE = "deadline-plus-one-tick"
MEMORY = "memory-freed"
#: A machine raised where it must not (its own usage error, or an unhandled remote input).
NO_CRASH = "no-unexpected-exception"
INVARIANTS = (ENDS_ONCE, ORDER, TENANT, NO_LOOP, CONVERGENCE, LIVENESS, DEADLINE, MEMORY, NO_CRASH)

#: The simulation's time granularity: nothing may outlive its deadline by more.
TICK = 0.01


class InvariantViolated(Exception):
    """``invariant`` (one of :data:`INVARIANTS`) does not hold; ``detail`` says where."""

    def __init__(self, invariant: str, detail: str) -> None:
        super().__init__(f"{invariant}: {detail}")
        self.invariant = invariant
        self.detail = detail

    def __reduce__(self) -> tuple[type, tuple[str, str]]:
        # Campaign workers send results back pickled.
        return (InvariantViolated, (self.invariant, self.detail))


class SimOutcome:
    COMPLETED = "completed"  # the last result arrived
    FAILED = "failed"  # an explicit error status (FailRequest)
    CANCELLED = "cancelled"  # the client went away
    LOST = "lost"  # the client saw its gateway's connection drop (the gateway died)


@dataclass(eq=False)
class ClientRequest:
    """One HTTP client's request: the origin the gateway delivers to, and its checker."""

    ledger: Ledger
    task_id: str
    gateway: str
    tenant: str
    model: str
    streaming: bool
    deadline: float
    submitted_at: float
    probe: bool = False
    delivered: int = 0
    status: int = 0
    #: Why it failed: the FailRequest message, or the body of a final non-200 response.
    reason: str = ""
    outcome: str | None = None
    events: list[str] = field(default_factory=list)
    #: Virtual time of the first result (the gateway sets it; for latencies).
    first_result_at: float | None = None

    # -- the origin interface the gateway's dispatcher calls (as infx.gateway.dispatcher.HttpOrigin) --

    def result_delivered(self, effect: DeliverResult) -> None:
        self._check_live("a result")
        result = effect.result
        if result.task_id != self.task_id:
            self.ledger.fail(ORDER, f"{self.task_id}: got a result of task {result.task_id!r}")
        if result.result_index != self.delivered:
            self.ledger.fail(
                ORDER, f"{self.task_id}: result {result.result_index} delivered after {self.delivered} results"
            )
        kind = result.WhichOneof("message")
        index = self.delivered
        if index == 0:
            if kind != "http_response":
                self.ledger.fail(ORDER, f"{self.task_id}: first result is {kind}, not the HTTP response")
            self.status = result.http_response.status_code
            if self.status != 200:
                self.reason = result.http_response.body[:160].decode("utf-8", "replace")
            ends = not self.streaming or not 200 <= self.status < 300
            if self.status == 200 and result.http_response.body not in (b"", self.task_id.encode()):
                self.ledger.fail(ORDER, f"{self.task_id}: response body {result.http_response.body[:60]!r}")
        else:
            if kind != "server_sent_event" or not self.streaming:
                self.ledger.fail(ORDER, f"{self.task_id}: result {index} is {kind} (streaming={self.streaming})")
            event = result.server_sent_event
            ends = event.is_last_event
            expected = f"data: {self.task_id}:{index}\n\n".encode()
            error = event.data.startswith(b'data: {"error"') and event.is_last_event
            if event.data not in (b"", expected) and not error:
                self.ledger.fail(ORDER, f"{self.task_id}: event {index} carries {event.data[:60]!r}")
        if effect.last != ends:
            self.ledger.fail(ORDER, f"{self.task_id}: result {index} last={effect.last}, expected {ends}")
        self.delivered += 1
        self.events.append(f"r{index}")
        if effect.last:
            self._end(SimOutcome.COMPLETED)

    def request_failed(self, effect: FailRequest) -> None:
        self._check_live(f"a failure ({effect.status})")
        if effect.delivered != self.delivered:
            self.ledger.fail(ORDER, f"{self.task_id}: failure says {effect.delivered} delivered, saw {self.delivered}")
        self.status = effect.status
        # The client's words, and what broke in the words of the layer that saw it (the log's).
        self.reason = f"{effect.message} ({effect.detail})" if effect.detail else effect.message
        self.events.append(f"fail{effect.status}")
        self._end(SimOutcome.FAILED)

    # -- what the client itself does --------------------------------------------------

    def cancelled(self) -> None:
        self.events.append("cancel")
        self._end(SimOutcome.CANCELLED)

    def connection_lost(self) -> None:
        self.events.append("lost")
        self._end(SimOutcome.LOST)

    @property
    def live(self) -> bool:
        return self.outcome is None

    @property
    def succeeded(self) -> bool:
        return self.outcome == SimOutcome.COMPLETED and self.status == 200

    def _check_live(self, what: str) -> None:
        if self.outcome is not None:
            self.ledger.fail(ENDS_ONCE, f"{self.task_id}: {what} after it ended ({self.outcome}); {self.events}")

    def _end(self, outcome: str) -> None:
        self.outcome = outcome
        self.ledger.ended(self)

    def __repr__(self) -> str:
        return f"<{self.task_id} {self.tenant}/{self.model} {'stream' if self.streaming else 'unary'} {self.outcome}>"


class Ledger:
    """Every client request and forwarded task the cluster has accepted, and the checks over them."""

    def __init__(self) -> None:
        self.requests: dict[str, ClientRequest] = {}
        self.live: dict[str, ClientRequest] = {}
        self.tenant_of: dict[str, str] = {}
        #: Retry attempts' wire ids (``"c7#2"``) -> the client request they serve.
        self.attempts: dict[str, str] = {}
        self.checks = 0
        self.now = 0.0

    def fail(self, invariant: str, detail: str) -> None:
        raise InvariantViolated(invariant, f"t={self.now:.4f} {detail}")

    def accepted(self, request: ClientRequest) -> None:
        if request.task_id in self.requests:
            self.fail(ENDS_ONCE, f"task id {request.task_id} accepted twice")
        self.requests[request.task_id] = request
        self.live[request.task_id] = request
        self.tenant_of[request.task_id] = request.tenant

    def ended(self, request: ClientRequest) -> None:
        self.checks += 1
        del self.live[request.task_id]

    def attempt_sent(self, wire_id: str, task_id: str | None) -> None:
        """A gateway sent attempt ``wire_id`` of its task ``task_id`` (None for its own
        control tasks); a peer's task id is the attempt id its origin sent."""
        if task_id is not None and task_id != wire_id:
            self.attempts.setdefault(wire_id, self.request_id(task_id))

    def request_id(self, wire_id: str) -> str:
        """The client request a task id on the wire serves (itself, unless it is a retry's)."""
        return self.attempts.get(wire_id, wire_id)

    def task_sent(self, task: worker_pb2.Task, tenant: str, where: str) -> None:
        """A task reached (or is about to reach) an engine of ``tenant``."""
        self.checks += 1
        owner = self.tenant_of.get(self.request_id(task.id))
        if owner is not None and owner != tenant:
            self.fail(TENANT, f"task {task.id} of tenant {owner!r} sent to {where} of tenant {tenant!r}")
