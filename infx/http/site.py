"""The gateway's HTTP site: a request body over the limit is refused with 413 before any resource runs.

:class:`GatewaySite` serves the resource tree of :func:`infx.http.api.build_resource`
with :class:`GatewayRequest`, which answers an oversized body (a ``Content-Length``
over the limit, or a chunked body that grows past it) with an OpenAI-style 413 as
soon as it is known and closes the connection after a small drain allowance, so
an endless body costs neither memory nor a connection held open. Mounted in a
site of its own, the tree still checks the (then fully buffered) body itself.
"""

from __future__ import annotations

from io import BytesIO
from typing import Any

from twisted.web import resource, server

from protocol.openai.errors import error_json, reason_phrase


#: What :class:`GatewayRequest` still reads (and drops) of a body it refused, after its 413 is
#: written, so that a client busy sending sees the answer rather than a reset; then, or after
#: ``REFUSED_BODY_DRAIN_SECONDS``, the connection is closed.
REFUSED_BODY_DRAIN_BYTES = 256 * 1024
REFUSED_BODY_DRAIN_SECONDS = 2.0
#: The body limit of a request served by a site other than :class:`GatewaySite`.
DEFAULT_MAX_BODY_SIZE = 32 * 1024 * 1024


class GatewayRequest(server.Request):
    """A request that answers 413 as soon as its body is known to be over the site's limit.

    A ``Content-Length`` over the limit is refused once the headers are in, a
    chunked body once it grows past it: the 413 (an OpenAI-style error) goes
    out at once and the connection closes after a small drain allowance, so an
    endless body costs neither memory nor a connection held open.
    """

    body_too_large = False
    _received = 0
    _drained = 0
    _drain_timer: Any = None
    _closing = False

    def _limit(self) -> int:
        return int(getattr(self.channel.site, "max_body_size", DEFAULT_MAX_BODY_SIZE))

    def gotLength(self, length: int | None) -> None:
        if length is not None and length > self._limit():
            super().gotLength(0)
            self._refuse_body(f"The request body ({length} bytes) is larger than this gateway accepts "
                              f"({self._limit()} bytes).")
            return
        super().gotLength(length)

    def handleContentChunk(self, data: bytes) -> None:
        if self.body_too_large:
            self._drained += len(data)
            if self._drained > REFUSED_BODY_DRAIN_BYTES:
                self._close()
            return
        self._received += len(data)
        if self._received > self._limit():
            self.content = BytesIO()
            self._refuse_body(f"The request body is larger than this gateway accepts ({self._limit()} bytes).")
            return
        super().handleContentChunk(data)

    def requestReceived(self, command: bytes, path: bytes, version: bytes) -> None:
        if self.body_too_large:
            # The refused body ended within the drain allowance: it was answered already.
            self._close()
            return
        super().requestReceived(command, path, version)

    def _refuse_body(self, message: str) -> None:
        self.body_too_large = True
        # No "100 Continue" for a body that is refused.
        self.requestHeaders.removeHeader(b"expect")
        body = error_json(413, message, code="request_too_large")
        head = (b"HTTP/1.1 413 %s\r\ncontent-type: application/json\r\n"
                b"content-length: %d\r\nconnection: close\r\n\r\n" % (reason_phrase(413).encode(), len(body)))
        self.channel.transport.write(head + body)
        self.channel.persistent = False
        self._drain_timer = self.channel.callLater(REFUSED_BODY_DRAIN_SECONDS, self._close)

    def _close(self) -> None:
        if self._drain_timer is not None and self._drain_timer.active():
            self._drain_timer.cancel()
        self._drain_timer = None
        if not self._closing and self.channel is not None and self.channel.transport is not None:
            self._closing = True
            self.channel.loseConnection()

    def connectionLost(self, reason: Any) -> None:
        if self._drain_timer is not None and self._drain_timer.active():
            self._drain_timer.cancel()
        self._drain_timer = None
        super().connectionLost(reason)


class GatewaySite(server.Site):
    """A Site that uses :class:`GatewayRequest` and knows the body size limit."""

    def __init__(self, root: resource.Resource, max_body_size: int, **kwargs: Any) -> None:
        # No request.args from the body: no handler reads them, and deciding whether a body is a
        # form took an email.message parse of every request's Content-Type.
        kwargs.setdefault("parsePOSTFormSubmission", False)
        super().__init__(root, requestFactory=GatewayRequest, **kwargs)
        self.max_body_size = max_body_size

    def log(self, request: server.Request) -> None:
        """No access log line of twisted.web's: each request's line is :mod:`infx.http.request_log`'s."""
