"""What infx's engine agent answers when its runtime fails a task; pure values, no I/O.

The agent tells these failures apart, because what the gateway may do next
depends on whether the runtime read the request (:mod:`protocol.processor.attempts`):

- ``UNREACHABLE``: the connection was refused, timed out, or was lost while the
  request was being written, so the runtime never read it. Answered 503
  (``runtime_unreachable``) and marked ``RUNTIME_UNREACHABLE``: the gateway
  treats it as a busy runtime and sends the task to another engine within
  its attempts.
- ``DROPPED``: the runtime read the whole request and closed the connection
  with no answer, or broke off its answer before the end: it may have crashed
  on this very request. Answered 502 (``runtime_dropped``) and marked
  ``RUNTIME_DROPPED``: the gateway sends it again at most once.
- a broken stream: a streamed answer broke off after it started (its chunked
  framing cut short, or an unframed stream closed before its final event).
  Part of the answer is with the client already, so nothing is sent again: the
  stream ends with an error event (:data:`BROKEN_STREAM_CODE`) and no
  ``[DONE]``, which the gateway logs and counts as a 502.

Clients read a short message that does not change; what the socket said goes
to the agent's log.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from protocol.openai.errors import UpstreamError, error_json, error_event, status_line
from protocol.pb import worker_pb2

__all__ = ["BROKEN_STREAM_CODE", "RuntimeFailure", "broken_stream_event", "failure_result"]

#: The error code of the event that ends a stream its runtime broke off.
BROKEN_STREAM_CODE = "runtime_stream_broken"
_BROKEN_STREAM_MESSAGE = "The runtime's stream broke off before its end; the response is incomplete."


class RuntimeFailure(Enum):
    """How the runtime failed a task before answering (see the module docstring); the value is
    the error code the client reads."""

    UNREACHABLE = "runtime_unreachable"
    DROPPED = "runtime_dropped"


@dataclass(frozen=True)
class _Answer:
    status: int
    message: str
    error_type: str | None
    flag: worker_pb2.RuntimeFailure


_ANSWERS = {
    RuntimeFailure.UNREACHABLE: _Answer(
        503, "The engine could not reach its runtime; retry later.", None, worker_pb2.RUNTIME_UNREACHABLE),
    RuntimeFailure.DROPPED: _Answer(
        502, "The runtime closed the connection before it answered; it may have failed on this request.",
        UpstreamError.error_type, worker_pb2.RUNTIME_DROPPED),
}


def failure_result(failure: RuntimeFailure, latency_ms: int = 0) -> worker_pb2.TaskResult:
    """The agent's answer for a task its runtime failed before answering, marked for the gateway."""
    answer = _ANSWERS[failure]
    body = error_json(answer.status, answer.message, error_type=answer.error_type, code=failure.value)
    response = worker_pb2.HttpResponse(status_code=answer.status, status=status_line(answer.status), body=body,
                                       latency_ms=latency_ms)
    response.header["Content-Type"].values.append("application/json")
    return worker_pb2.TaskResult(http_response=response, infx_runtime_failure=answer.flag)


def broken_stream_event() -> bytes:
    """The error event that ends a stream its runtime broke off."""
    return error_event(UpstreamError.status, _BROKEN_STREAM_MESSAGE, error_type=UpstreamError.error_type,
                       code=BROKEN_STREAM_CODE)
