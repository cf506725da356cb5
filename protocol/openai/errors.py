"""OpenAI-style errors and HTTP status lines: pure values, no I/O; the one place they are made.

Every OpenAI error body infx writes (gateway, processor, dialled peer, scaler,
engine agent, runtimes) and every error event of a stream whose headers are
already out comes from :func:`error_body` / :func:`error_json` /
:func:`error_event` here, with one type map (:func:`error_type_for`); every
``HttpResponse.status`` line from :func:`status_line`, which never fails on a
code outside the IANA registry (a runtime or proxy may answer 522 or 599).

A client's bad request (:class:`InvalidRequestError`) and a runtime's bad
answer (:class:`UpstreamError`) are remote violations: they end the HTTP
exchange with the status and body they carry. :class:`OpenAIUsageError` is
misuse of this package by its caller and is never shown to a client.
"""

from __future__ import annotations

import json
from http import HTTPStatus
from typing import Any

from protocol import errors

#: OpenAI's error ``type`` for a 429: OpenAI names the limit that was reached
#: (``requests`` or ``tokens``); infx's limits count requests.
RATE_LIMIT_TYPE = "requests"


def error_type_for(status: int) -> str:
    """OpenAI's own ``type`` for an error answered with ``status``.

    OpenAI's API types every client error ``invalid_request_error`` (an
    unknown key too, with code ``invalid_api_key``; an unknown model with
    ``model_not_found``; an unknown path with ``unknown_url``), a rate limit
    by the limit reached (:data:`RATE_LIMIT_TYPE`), and every server error,
    its 503 "overloaded" included, ``server_error``. Clients pick their
    exception class by the status, not by this string.
    """
    if status == 429:
        return RATE_LIMIT_TYPE
    if 400 <= status < 500:
        return "invalid_request_error"
    return "server_error"


#: The status an error ``type`` stands for, where the type names a kind of its own.
_STATUS_OF_TYPE = {"invalid_request_error": 400, RATE_LIMIT_TYPE: 429, "tokens": 429, "not_implemented": 501,
                   "upstream_error": 502}


def status_of_error(error: Any) -> int:
    """The HTTP status an error object (the ``error`` member of OpenAI's shape) stands for: its
    ``code`` when that is a status (vLLM's stream errors carry one), else its ``type``'s, else 500.

    What a stream that ends with an error event is logged and counted as: its status line said
    200, but the answer failed.
    """
    if not isinstance(error, dict):
        return 500
    code = error.get("code")
    if isinstance(code, int) and not isinstance(code, bool) and 400 <= code <= 599:
        return code
    kind = error.get("type")
    return _STATUS_OF_TYPE.get(kind, 500) if isinstance(kind, str) else 500


def error_body(
    status: int, message: str, *, error_type: str | None = None, param: str | None = None,
    code: str | int | None = None,
) -> dict[str, Any]:
    """OpenAI's error shape, ``{"error": {"message", "type", "param", "code"}}``, as a dict.

    ``error_type`` names a kind more precise than the status's (see
    :func:`error_type_for`, the default).
    """
    kind = error_type if error_type is not None else error_type_for(status)
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_json(
    status: int, message: str, *, error_type: str | None = None, param: str | None = None,
    code: str | int | None = None,
) -> bytes:
    """:func:`error_body`, encoded as compact UTF-8 JSON (lone surrogates kept)."""
    return _encode(error_body(status, message, error_type=error_type, param=param, code=code))


def error_event(
    status: int, message: str, *, error_type: str | None = None, param: str | None = None,
    code: str | int | None = None,
) -> bytes:
    """The error as a stream's last server-sent event, as OpenAI and vLLM send it:
    ``data: {"error": {...}}`` and a blank line (the JSON is one line)."""
    return event_of(error_body(status, message, error_type=error_type, param=param, code=code))


def event_of(body: dict[str, Any]) -> bytes:
    """An error body (:meth:`OpenAIError.body`, :func:`error_body`) as one server-sent event."""
    return b"data: " + _encode(body) + b"\n\n"


def reason_phrase(status: int) -> str:
    """The registered reason phrase of ``status``, or ``""`` for a code outside the registry."""
    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return ""


def status_line(status: int, phrase: str | None = None) -> str:
    """``HttpResponse.status`` as LLMariner's engines fill it: ``"200 OK"``.

    ``phrase`` is the peer's own reason (kept as sent); without one, the
    registered phrase; a code outside the registry with no phrase is the
    code alone (``"599"``), as HTTP allows an empty reason.
    """
    reason = reason_phrase(status) if phrase is None else phrase
    return f"{status} {reason}" if reason else str(status)


def _encode(body: dict[str, Any]) -> bytes:
    return json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode("utf-8", "surrogatepass")


class OpenAIError(errors.RemoteProtocolError):
    """An error that ends an HTTP exchange with an OpenAI-style JSON body.

    The body has OpenAI's shape,
    ``{"error": {"message", "type", "param", "code"}}``, so that OpenAI
    client libraries raise their usual exception types for it.
    """

    status: int = 500
    #: None: OpenAI's type for the status (:func:`error_type_for`); a subclass may name a precise kind.
    error_type: str | None = None

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        """The JSON body to answer with, as a dict."""
        return error_body(self.status, self.message, error_type=self.error_type, param=self.param, code=self.code)

    def to_json(self) -> bytes:
        """The JSON body to answer with, encoded."""
        return _encode(self.body())

    def to_event(self) -> bytes:
        """The error as a stream's last server-sent event."""
        return event_of(self.body())

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.message!r}, param={self.param!r}, code={self.code!r})"


class InvalidRequestError(OpenAIError):
    """The client's request cannot be honoured as sent: HTTP 400."""

    status = 400


class ModelNotFoundError(OpenAIError):
    """No engine serves the model and none can be waited for: HTTP 404, OpenAI's ``model_not_found``.

    The one shape of every unknown-model answer, so that a client sees the same
    body (``e.code``, ``e.param``) whether the gateway knew at once or only once
    start-up learning ended; ``message`` gives another reason for the same
    answer (the scaler's).
    """

    status = 404

    def __init__(self, model: str, message: str | None = None) -> None:
        if message is None:
            message = f"The model '{model}' does not exist or no engine serves it."
        super().__init__(message, param="model", code="model_not_found")
        self.model = model


class NotImplementedRequestError(OpenAIError):
    """The request is well formed but this runtime does not serve its kind: HTTP 501."""

    status = 501
    error_type = "not_implemented"


class UpstreamError(OpenAIError):
    """The engine or runtime answered with something that is not what the API promises: HTTP 502."""

    status = 502
    error_type = "upstream_error"


class OpenAIUsageError(errors.LocalUsageError):
    """The caller used this package wrongly (e.g. passed a heartbeat to the runtime converter)."""
