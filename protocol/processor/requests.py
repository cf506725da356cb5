"""What the processor reads of a request and an answer: a request's model, whether it streams,
a runtime's Retry-After, an error as a server-sent event; pure functions."""

from __future__ import annotations

from protocol.openai.errors import error_event
from protocol.pb import worker_pb2

__all__ = ["is_streaming", "model_of", "retry_after_seconds", "sse_error_event"]


# --- busy runtimes -----------------------------------------------------------


def retry_after_seconds(response: worker_pb2.HttpResponse) -> float | None:
    """The ``Retry-After`` of a response in seconds, or None when absent or not delay-seconds.

    An HTTP-date is treated as absent: the processor has no wall clock to
    subtract it from, and the default back-off is a safe reading of it.
    """
    for name, values in response.header.items():
        if name.lower() == "retry-after" and values.values:
            text = values.values[0].strip()
            if text.isdigit():
                return float(text)
            return None
    return None


# --- request helpers -------------------------------------------------------

_MODEL_REQUESTS = ("chat_completion", "embedding", "audio_transcription", "model_response", "tokenize_request")
_STREAMABLE_REQUESTS = ("chat_completion", "audio_transcription", "model_response")


def model_of(request: worker_pb2.TaskRequest) -> str:
    """The model a request asks for, or "" for requests without one (heartbeat, go-away)."""
    kind = request.WhichOneof("request")
    if kind in _MODEL_REQUESTS:
        model: str = getattr(request, kind).model
        return model
    return ""


def is_streaming(request: worker_pb2.TaskRequest) -> bool:
    """Whether the engine will answer with server-sent events after the HttpResponse.

    Every request kind with a ``stream`` flag counts, not only chat.
    """
    kind = request.WhichOneof("request")
    if kind in _STREAMABLE_REQUESTS:
        stream: bool = getattr(request, kind).stream
        return stream
    return False


def sse_error_event(status: int, message: str, code: str | None = None) -> bytes:
    """An error as one server-sent event, for a stream whose headers are already out."""
    return error_event(status, message, code=status if code is None else code)
