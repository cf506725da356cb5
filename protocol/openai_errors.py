"""OpenAI-style errors: pure values, no I/O; every error knows its HTTP status and JSON body.

A client's bad request (:class:`InvalidRequestError`) and a runtime's bad
answer (:class:`UpstreamError`) are remote violations: they end the HTTP
exchange with the status and body they carry. :class:`LocalUsageError` is
misuse of this package by its caller and is never shown to a client.
"""

from __future__ import annotations

import json
from typing import Any


class OpenAIError(Exception):
    """An error that ends an HTTP exchange with an OpenAI-style JSON body.

    The body has OpenAI's shape,
    ``{"error": {"message", "type", "param", "code"}}``, so that OpenAI
    client libraries raise their usual exception types for it.
    """

    status: int = 500
    error_type: str = "server_error"

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        """The JSON body to answer with, as a dict."""
        return {
            "error": {
                "message": self.message,
                "type": self.error_type,
                "param": self.param,
                "code": self.code,
            }
        }

    def to_json(self) -> bytes:
        """The JSON body to answer with, encoded."""
        return json.dumps(self.body(), ensure_ascii=False, separators=(",", ":")).encode(
            "utf-8", "surrogatepass"
        )

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.message!r}, param={self.param!r}, code={self.code!r})"


class InvalidRequestError(OpenAIError):
    """The client's request cannot be honoured as sent: HTTP 400."""

    status = 400
    error_type = "invalid_request_error"


class NotImplementedRequestError(OpenAIError):
    """The request is well formed but this runtime does not serve its kind: HTTP 501."""

    status = 501
    error_type = "not_implemented"


class UpstreamError(OpenAIError):
    """The engine or runtime answered with something that is not what the API promises: HTTP 502."""

    status = 502
    error_type = "upstream_error"


class LocalUsageError(Exception):
    """The caller used this package wrongly (e.g. passed a heartbeat to the runtime converter)."""
