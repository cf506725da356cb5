"""One task's attempts on engines: how an attempt failed, and whether another may be sent.

No I/O, no clock reads. Each send of a task to an engine is an attempt. An
attempt fails without an answer for the client in one of five ways
(:class:`AttemptFailure`): its engine was lost, the send failed, the runtime
was busy (a true 503 or 429), the engine could not reach its runtime, or the
runtime read the request and dropped the connection without answering. The
processor asks :meth:`Attempts.refusal` whether another attempt may be made;
the rules, the same for every engine and every kind of failure:

- A task is sent to engines at most ``max_attempts`` times in all (3 by
  default), whatever failed and wherever it went: a request that breaks
  every runtime it reaches is not replayed until its queue time runs out.
- A runtime that read the request and then dropped the connection may have
  crashed on that very request, and another send may crash another runtime.
  Such a task is sent again at most once: a runtime that died of something
  else (an OOM kill, a restart) costs one more try, a request that kills
  runtimes at most two runtimes. A Responses API request (``model_response``)
  is never sent again once a runtime read it: it may have stored a response
  or advanced a conversation there (``store``, ``previous_response_id``), and
  a second send would do it twice. Chat, completions, embeddings,
  transcriptions and tokenize leave nothing behind at the runtime.
- Failures that mean the runtime never read the request (a lost engine
  before any result, a failed send, a busy or unreachable runtime) are
  retried within the budget alone.

What the engine agent reports (:mod:`protocol.agent.runtime_failures`) tells an
unreachable runtime from one that dropped the request; a runtime's own 503 or
429 is busy (:data:`BUSY_STATUSES`).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from protocol.pb import worker_pb2

__all__ = ["BUSY_STATUSES", "AttemptFailure", "Attempts", "failure_of"]

#: Runtime answers that mean "busy, try again later" rather than "this request is wrong":
#: vLLM, SGLang and Ollama send 503 when overloaded or loading, and 429 when a queue is full.
BUSY_STATUSES = frozenset({429, 503})

#: Times a task is sent again after a runtime read it and dropped it.
DROPPED_RETRIES = 1

#: Request kinds that may leave state at the runtime, so are never sent again once one read them.
_STATEFUL_KINDS = frozenset({"model_response"})


class AttemptFailure(Enum):
    """Why one attempt ended without an answer for the client; the ``reason`` of the retry metrics."""

    ENGINE_LOST = "engine_lost"  # its stream closed or it was removed before any result
    SEND_FAILED = "send_failed"  # the task could not be written to the engine's route
    RUNTIME_BUSY = "runtime_busy"  # a 503 or 429: the runtime (or the agent's queue) did not take it
    RUNTIME_UNREACHABLE = "runtime_unreachable"  # the agent could not reach its runtime: never read
    RUNTIME_DROPPED = "runtime_dropped"  # the runtime read it and closed the connection unanswered

    @property
    def read_by_runtime(self) -> bool:
        """Whether a runtime may have read (and acted on) the request."""
        return self is AttemptFailure.RUNTIME_DROPPED


def failure_of(result: worker_pb2.TaskResult) -> AttemptFailure | None:
    """How an engine's first result (its ``HttpResponse``) says the attempt failed;
    None: it is an answer for the client."""
    flag = result.infx_runtime_failure
    if flag == worker_pb2.RUNTIME_DROPPED:
        return AttemptFailure.RUNTIME_DROPPED
    if flag == worker_pb2.RUNTIME_UNREACHABLE:
        return AttemptFailure.RUNTIME_UNREACHABLE
    if result.http_response.status_code in BUSY_STATUSES:
        return AttemptFailure.RUNTIME_BUSY
    return None


@dataclass(slots=True)
class Attempts:
    """One task's attempts so far, and the retry it is owed (see the module docstring)."""

    #: Attempts that failed, of any kind.
    failed: int = 0
    #: Of those, attempts a runtime read and dropped.
    dropped: int = 0
    #: Sends after a failed attempt: what logs and metrics call a request's retries.
    retries: int = 0
    #: The failure the next send retries (None: the next send is the first, or was counted).
    owed: AttemptFailure | None = None
    #: The failure the current send retries (None: it is the first).
    current: AttemptFailure | None = None

    def fail(self, failure: AttemptFailure) -> None:
        """The current attempt failed so."""
        self.failed += 1
        if failure.read_by_runtime:
            self.dropped += 1
        self.owed, self.current = failure, None

    def refusal(self, max_attempts: int, request_kind: str | None) -> str:
        """Why no other attempt may be made after the last failure, in words for the client;
        "" if one may."""
        if self.failed >= max_attempts:
            return f"{self.failed} attempts failed"
        if self.dropped and request_kind in _STATEFUL_KINDS:
            return "a runtime failed on this request, and a Responses request is not sent twice"
        if self.dropped > DROPPED_RETRIES:
            return f"runtimes failed on this request {self.dropped} times"
        return ""

    def sent(self) -> AttemptFailure | None:
        """A send is being made: the failure it retries (counted here, once), or None for a first send."""
        self.current, self.owed = self.owed, None
        if self.current is not None:
            self.retries += 1
        return self.current

    def unsent(self) -> AttemptFailure | None:
        """The send :meth:`sent` counted never left (its route refused it): the retry is owed
        again; returns the failure it retried, so that its count can be taken back."""
        retried, self.current = self.current, None
        if retried is not None:
            self.retries -= 1
            self.owed = retried
        return retried
