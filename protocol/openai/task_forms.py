"""Which form of a request an engine gets: the client's verbatim request or the typed one; pure.

Rules this file keeps: no I/O, no clock reads, no state; requests in, new
requests out (the caller's are never changed).

A task from infx's gateway may carry two forms of the client's request
(see ``TaskRequest`` in ``proto/worker.proto``):

- ``http_request``: the client's method, path and body byte for byte, for
  engines that announce :data:`HTTP_REQUEST_CAPABILITY` (infx's agent in front
  of an OpenAI-compatible runtime). Such an engine gets it with only the
  routing fields (model, stream) of the typed form, so a large body (images
  as data URLs, audio files) is never sent twice.
- the typed oneof: LLMariner's protobuf conversion, for every other engine.
  When that conversion is impossible (``typed_request_incomplete`` says
  why), only engines that take ``http_request`` are eligible.
"""

from __future__ import annotations

from protocol.pb import status_pb2, worker_pb2

#: The ``EngineStatus.infx_capabilities`` value of an engine that runs ``http_request`` verbatim.
HTTP_REQUEST_CAPABILITY = "http-request"

#: ``typed_request_incomplete`` of a task reduced to its routing fields on the way to a capable engine.
ROUTING_FIELDS_ONLY = "only the routing fields (model, stream); the request is in http_request"

#: Request kinds whose typed form has a ``stream`` flag (the rest have only ``model``).
STREAMABLE_KINDS = frozenset({"chat_completion", "audio_transcription", "model_response"})


def takes_http_request(status: status_pb2.EngineStatus) -> bool:
    """Whether the engine runs the client's verbatim request."""
    return HTTP_REQUEST_CAPABILITY in status.infx_capabilities


def eligible(request: worker_pb2.TaskRequest, status: status_pb2.EngineStatus) -> bool:
    """Whether an engine with ``status`` can serve ``request`` without losing what the typed form cannot hold."""
    return not request.typed_request_incomplete or takes_http_request(status)


def routing_fields(kind: str, model: str, stream: bool) -> worker_pb2.TaskRequest:
    """A typed request of ``kind`` that holds only ``model`` (and ``stream``, where the kind has one)."""
    request = worker_pb2.TaskRequest()
    typed = getattr(request, kind)
    typed.model = model
    if kind in STREAMABLE_KINDS:
        typed.stream = stream
    return request


def for_engine(request: worker_pb2.TaskRequest, status: status_pb2.EngineStatus) -> worker_pb2.TaskRequest:
    """The form of ``request`` to send to an engine with ``status`` (which must be :func:`eligible`).

    Without an ``http_request`` the request goes as it is.
    """
    if not request.HasField("http_request"):
        return request
    kind = request.WhichOneof("request")
    assert kind is not None, "a task request with http_request but no typed form"
    if "model" not in getattr(request, kind).DESCRIPTOR.fields_by_name:
        # A control request (heartbeat, cancel...) has no client request to carry: it goes alone.
        out = worker_pb2.TaskRequest()
        getattr(out, kind).CopyFrom(getattr(request, kind))
        return out
    if takes_http_request(status):
        if request.typed_request_incomplete:
            return request
        typed = getattr(request, kind)
        out = routing_fields(kind, typed.model, bool(getattr(typed, "stream", False)))
        out.http_request.CopyFrom(request.http_request)
        out.typed_request_incomplete = ROUTING_FIELDS_ONLY
        return out
    out = worker_pb2.TaskRequest()
    getattr(out, kind).CopyFrom(getattr(request, kind))
    return out
