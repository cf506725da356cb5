"""The relay's pure half: the HTTP/1.1 request a task becomes, and which answer headers come back.

Rules this file keeps: no I/O, no clock reads; bytes for the wire are built
here once per task, so that the Twisted client (:mod:`infx.agent.runtime_client`)
only writes them.

A task that carries the client's request verbatim (``TaskRequest.http_request``,
see :mod:`protocol.openai.task_forms`) is sent as it came: the client's method,
path with query, body and headers, but those that belong to the gateway's hop
or its credentials (hop-by-hop ones, ``Authorization``, ``Cookie``, ``Host``,
``Content-Length``, ``Accept-Encoding``, ``Expect``). A task with only the typed
form (from a gateway that speaks LLMariner's protocol) is converted by
:mod:`protocol.openai.runtime` and sent as JSON or a multipart form, with the
task's headers but its ``Content-Type``. ``User-Agent`` is ``infx-engine``
unless the client sent one; the runtime's own credentials go out as
``Authorization: Bearer`` when given.

What no runtime should see is refused with 400 before anything is sent: a
request line that is not an absolute path and a method token, a method
whose answer has no body to frame (``HEAD``, ``CONNECT``: the relay reads
every answer by its framing), a header name that is not a token, or a value
holding CR, LF or NUL (a peer's task could otherwise smuggle a second request
onto a kept-alive connection).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from protocol.openai.errors import InvalidRequestError, LocalUsageError
from protocol.openai.runtime import RuntimeRequest, runtime_request
from protocol.pb import worker_pb2
from protocol.processor.types import is_streaming

__all__ = ["RelayRequest", "answer_headers", "relay_request", "request_id"]

#: The client's headers that describe the gateway's hop or its credentials, for a verbatim request.
_VERBATIM_DROPPED = frozenset(
    {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "proxy-connection", "te", "trailer",
     "transfer-encoding", "upgrade", "host", "content-length", "accept-encoding", "authorization", "cookie", "expect"}
)
#: For a typed request the agent also sets the content type itself (its body is the agent's own).
_TYPED_DROPPED = _VERBATIM_DROPPED | {"content-type"}
#: The runtime's headers that describe its hop to the agent, not the answer.
_ANSWER_DROPPED = frozenset(
    {"connection", "keep-alive", "proxy-authenticate", "te", "trailer", "transfer-encoding", "upgrade",
     "content-length"}
)
#: Methods whose answers the relay could not frame (no body follows their headers, or a tunnel does).
_UNFRAMED_METHODS = frozenset({"HEAD", "CONNECT"})
# An absolute path with its query (no spaces or controls), and a method or header name, as RFC 9112 allows them.
_REQUEST_TARGET = re.compile(r"/[\x21-\x7e]*")
_TOKEN = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")
_USER_AGENT = b"User-Agent: infx-engine\r\n"


@dataclass(frozen=True, slots=True)
class RelayRequest:
    """One request to the runtime: the request line's parts, its header lines (each ending in
    CRLF, without ``Host`` and ``Content-Length``, which the connection adds) and its body."""

    method: bytes
    target: bytes
    fields: bytes
    body: bytes
    #: The answer is a stream of server-sent events when it is a success.
    stream: bool
    #: The answer is the runtime's own to the client's own request (``TaskResult.verbatim_answer``).
    verbatim: bool


def request_id(task: worker_pb2.Task) -> str:
    """What the gateway's request log names the request by (its ``X-Request-Id``), else the task id,
    so that the agent's log lines about it meet the gateway's."""
    for name, values in task.header.items():
        if name.lower() == "x-request-id" and values.values:
            return str(values.values[0])
    return task.id


def relay_request(task: worker_pb2.Task, authorization: str | None,
                  boundary: Callable[[], str]) -> RelayRequest:
    """The request ``task`` becomes; ``authorization`` is the runtime's own key (or None),
    ``boundary`` draws a multipart boundary for a typed audio request.

    Raises :class:`~protocol.openai.errors.OpenAIError` (400) for a task no runtime should see.
    """
    verbatim = task.request.HasField("http_request")
    if verbatim:
        http = task.request.http_request
        method, path, body = (http.method or "POST"), http.path, bytes(http.body)
        stream = is_streaming(task.request)
        dropped = _VERBATIM_DROPPED
        lines = []
    else:
        typed = runtime_request(task.request)
        stream = typed.stream
        content_type, body = _typed_body(typed, boundary)
        method, path = "POST", typed.path
        dropped = _TYPED_DROPPED
        lines = [b"Content-Type: ", _field_value(content_type), b"\r\n"]
    if not _REQUEST_TARGET.fullmatch(path) or not _TOKEN.fullmatch(method):
        raise InvalidRequestError(f"The task's request line {method!r} {path!r} is not valid.")
    if method.upper() in _UNFRAMED_METHODS:
        raise InvalidRequestError(f"The method {method!r} is not relayed to runtimes.")
    user_agent = False
    for name, values in task.header.items():
        lower = name.lower()
        if lower in dropped:
            continue
        if not _TOKEN.fullmatch(name):
            raise InvalidRequestError(f"The task's header name {name!r} is not valid.")
        encoded_name = name.encode("latin-1")
        for value in values.values:
            lines += (encoded_name, b": ", _field_value(value), b"\r\n")
        user_agent = user_agent or (lower == "user-agent" and bool(values.values))
    if not user_agent:
        lines.append(_USER_AGENT)
    if authorization is not None:
        lines += (b"Authorization: Bearer ", _field_value(authorization), b"\r\n")
    return RelayRequest(method.encode("ascii"), path.encode("ascii"), b"".join(lines), body, stream, verbatim)


def _field_value(value: str) -> bytes:
    if "\r" in value or "\n" in value or "\0" in value:
        raise InvalidRequestError("A header value of the task holds a line break or NUL.")
    try:
        return value.encode("latin-1")
    except UnicodeEncodeError:
        raise InvalidRequestError("A header value of the task is not Latin-1 text.") from None


def _typed_body(typed: RuntimeRequest, boundary: Callable[[], str]) -> tuple[str, bytes]:
    if typed.form is not None:
        while True:
            try:
                return typed.form.encode(boundary())
            except LocalUsageError:  # the boundary occurs in the file: draw another
                continue
    return "application/json", json.dumps(typed.json, ensure_ascii=False, separators=(",", ":")).encode("utf-8")


def answer_headers(fields: Iterable[tuple[bytes, bytes]]) -> dict[str, list[str]]:
    """The runtime's answer headers to relay, by name as the runtime first wrote it (names that
    differ only in case are one header), values in order; its hop's own are left out."""
    headers: dict[str, list[str]] = {}
    names: dict[str, str] = {}
    for raw_name, raw_value in fields:
        name = raw_name.decode("latin-1")
        lower = name.lower()
        if lower in _ANSWER_DROPPED:
            continue
        first = names.setdefault(lower, name)
        headers.setdefault(first, []).append(raw_value.decode("latin-1"))
    return headers
