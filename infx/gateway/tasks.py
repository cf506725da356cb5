"""What the HTTP gateway needs from the task machinery, as small interfaces.

The gateway turns a request into a :class:`Submission` and hands it, with a
:class:`ResultSink`, to a :class:`TaskRunner`; the runner (the processor's
Twisted owner, :mod:`infx.gateway.dispatcher`) calls the sink back exactly once with
``completed`` or ``failed``, after any number of results. Keeping this
boundary small lets the gateway be tested against a scripted runner and the
runner against a scripted sink.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from protocol.gateway.core import Availability
from protocol.pb import worker_pb2
from protocol.processor.fair_queue import Criticality
from protocol.routing.hints import RoutingHints

__all__ = ["Availability", "ResultSink", "ServedBy", "Submission", "TaskHandle", "TaskRunner"]


@dataclass(frozen=True)
class Submission:
    """One client request, ready to become a task."""

    tenant: str
    model: str
    request: worker_pb2.TaskRequest
    streaming: bool
    #: Headers forwarded to the engine (lower-case names).
    headers: dict[str, list[str]] = field(default_factory=dict)
    #: Seconds from now until the client's deadline; None: the runner's default.
    timeout: float | None = None
    #: Correlates logs and the engine's work with the client's request.
    request_id: str = ""
    #: Its place should it wait for an engine (see :mod:`protocol.processor.fair_queue`): how much it
    #: matters, which caller it is one of, and that caller's share.
    criticality: Criticality = Criticality.STANDARD
    flow: str = ""
    weight: float = 1.0
    #: Prefix blocks, session and adapter for the routing policy (None: route by load).
    routing_hints: RoutingHints | None = None
    #: The request's span when tracing is on (:class:`infx.tracing.spans.RequestSpan`); its
    #: queue wait ends when the task is first sent.
    trace: Any = None


@dataclass
class ServedBy:
    """Where a request's task ran, for its log line: the runner fills it in as it goes."""

    engine_id: str = ""
    #: The gateway whose engine served it: this one's pod name, or the peer's that relayed the result.
    gateway: str = ""
    retries: int = 0
    #: Seconds from submission to the first dispatch (None: never dispatched).
    queued_seconds: float | None = None


class ResultSink(Protocol):
    """Receives one task's outcome, in order; exactly one of completed/failed ends it."""

    def response_received(self, response: worker_pb2.HttpResponse, verbatim: bool = False) -> None:
        """The engine's status line and headers (and, unless streaming, the body).

        ``verbatim``: the runtime's own answer to the client's own request
        (``TaskResult.verbatim_answer``), to relay unchanged.
        """

    def event_received(self, data: bytes) -> None:
        """One server-sent event, framed as the runtime sent it."""

    def event_spliced(self, data: bytes) -> bool:
        """The next event of a verbatim stream, handed on past the processor (no ``consumed`` for it):
        write it now and say True, or say False if it cannot be written at once (the client is behind,
        or the answer is not a verbatim stream): it then comes again through ``event_received``."""

    def completed(self) -> None:
        """The task ended normally (the last event, or the non-streaming body)."""

    def failed(self, status: int, message: str, retry_after: float | None, code: str | None = None,
               detail: str = "") -> None:
        """The task ended without a (complete) answer; ``status`` is an HTTP status, ``message``
        and ``code`` what the client reads, ``detail`` what broke, for the log only."""


class TaskHandle(Protocol):
    #: Who served the task so far (None: the runner does not say).
    served_by: ServedBy | None

    def cancel(self) -> None:
        """The client is gone: stop the task and call the sink no more."""

    def consumed(self, count: int) -> None:
        """``count`` more results have been written out to the client (flow control)."""


class TaskRunner(Protocol):
    def submit(self, submission: Submission, sink: ResultSink) -> TaskHandle:
        """Accept a task; its outcome reaches ``sink``."""

    def availability(self, tenant: str, model: str) -> Availability:
        """Whether the tenant's engines serve the model, could, did recently, or never did."""

    def takes_http_request(self, tenant: str, model: str) -> bool:
        """Whether an engine of the tenant listing the model runs the client's request verbatim."""

    def typed_form_wanted(self, tenant: str, model: str) -> bool:
        """Whether a request for the model needs its typed (LLMariner) form built as it arrives."""

    def models(self, tenant: str) -> list[str]:
        """The models ready engines of the tenant serve, local and remote, sorted."""

    def status(self, tenant: str | None = None) -> dict[str, Any]:
        """A JSON-able dump for ``/admin/status``: every tenant's, or ``tenant``'s alone."""
