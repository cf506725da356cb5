"""The gateway's HTTP site: a request body over the limit is refused with 413 before any resource
runs, and one connection's pipelined requests cannot keep the others waiting.

:class:`GatewaySite` serves the resource tree of :func:`infx.http.resources.build_resource`
with :class:`GatewayRequest`, which answers an oversized body (a ``Content-Length``
over the limit, or a chunked body that grows past it) with an OpenAI-style 413 as
soon as it is known and closes the connection after a small drain allowance, so
an endless body costs neither memory nor a connection held open. Mounted in a
site of its own, the tree still checks the (then fully buffered) body itself.
A handler that fails is answered with a JSON 500, not Twisted's HTML page (the
traceback goes to the log). Both are told to the site's ``on_refused``, which
logs and counts them as the gateway's other refusals.
Each connection is a :class:`GatewayChannel`, which bounds the work a client that
pipelines requests without reading the answers makes the gateway do.
"""

from __future__ import annotations

from collections.abc import Callable
from io import BytesIO
from typing import Any

from twisted.internet.interfaces import IDelayedCall
from twisted.logger import Logger
from twisted.web import http, resource, server

from protocol.openai.errors import error_json, reason_phrase


#: What :class:`GatewayRequest` still reads (and drops) of a body it refused, after its 413 is
#: written, so that a client busy sending sees the answer rather than a reset; then, or after
#: ``REFUSED_BODY_DRAIN_SECONDS``, the connection is closed.
REFUSED_BODY_DRAIN_BYTES = 256 * 1024
REFUSED_BODY_DRAIN_SECONDS = 2.0
#: The body limit of a request served by a site other than :class:`GatewaySite`.
DEFAULT_MAX_BODY_SIZE = 32 * 1024 * 1024
#: Requests one connection gets answered back to back while it has more pipelined behind
#: them (it sent them before reading the answers); the last of them says ``Connection: close``
#: and what the client sent after it is dropped unread (a pipelining client sends it again,
#: RFC 9112 9.3.2). A client that waits for each answer, or reads a few at a time, never
#: comes near it.
MAX_PIPELINED_REQUESTS = 16

#: Told of a refusal the site made itself: the request's path, the status, the error code, a detail.
RefusalHook = Callable[[bytes, int, str, str], None]

log = Logger(namespace="infx.gateway_site")


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
        # The request line is the channel's still: the request itself gets it once the body is in.
        self._told_refused(getattr(self.channel, "_path", b""), 413, "request_too_large", message)
        head = (b"HTTP/1.1 413 %s\r\ncontent-type: application/json\r\n"
                b"content-length: %d\r\nconnection: close\r\n\r\n" % (reason_phrase(413).encode(), len(body)))
        self.channel.transport.write(head + body)
        self.channel.persistent = False
        self._drain_timer = self.channel.callLater(REFUSED_BODY_DRAIN_SECONDS, self._close)

    def processingFailed(self, reason: Any) -> Any:
        """A handler raised: a JSON 500 rather than Twisted's HTML page; the traceback is logged."""
        log.failure("the gateway failed to handle {method} {path}", reason,
                    method=self.method.decode("latin-1"), path=self.path.decode("latin-1"))
        self._told_refused(self.path, 500, "internal_error", reason.getErrorMessage())
        if self.startedWriting:
            # Headers are out: the answer cannot change now, only end.
            self.channel.loseConnection()
            return reason
        body = error_json(500, "The gateway failed to handle this request.", code="internal_error")
        self.setResponseCode(500, reason_phrase(500).encode())
        self.responseHeaders.setRawHeaders(b"content-type", [b"application/json"])
        self.responseHeaders.setRawHeaders(b"content-length", [b"%d" % len(body)])
        self.write(body)
        self.finish()
        return reason

    def _told_refused(self, path: bytes, status: int, code: str, detail: str) -> None:
        hook = getattr(self.channel.site, "on_refused", None) if self.channel is not None else None
        if hook is not None:
            hook(path, status, code, detail)

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


class GatewayChannel(http.HTTPChannel):
    """An HTTP/1.1 connection whose pipelined requests wait their turn.

    twisted.web answers pipelined requests one after the other (head-of-line),
    but parses the next as soon as the previous is answered, in the same
    reactor turn: a client that sends thousands of GETs at once has them all
    answered before any other connection is read, and answers it does not read
    pile up in the kernel's buffers first, where the transport's backpressure
    cannot see them. Here a request that was already waiting when the one
    before it was answered (a pipelined one) is parsed on a later reactor turn,
    so that other connections are served in between; none is parsed while the
    transport has paused us (its write buffer is over its bound: the client is
    not reading); and a run of ``max_pipelined`` answers ends with
    ``Connection: close``. The connection is not read while its pipelined
    requests wait.

    This leans on ``twisted.web.http.HTTPChannel``'s own head-of-line state
    (``_dataBuffer``, ``_handlingRequest``, ``_waitingForTransport``,
    ``_networkProducer``) and on ``LineReceiver`` parsing nothing while
    ``paused`` (keeping the rest in ``_buffer``).
    """

    max_pipelined = MAX_PIPELINED_REQUESTS
    #: Requests of the current run that were waiting when the one before was answered.
    _pipelined = 0
    _turn: IDelayedCall | None = None

    def requestDone(self, request: http.Request) -> None:
        # (A body that ended exactly with its request leaves an empty piece in _dataBuffer.)
        waiting = any(self._dataBuffer) or bool(self._buffer)
        if waiting and self.persistent:
            # Hold the parser (the rest stays buffered) before Twisted replays the buffered bytes.
            self.paused = True
        super().requestDone(request)
        if not self.paused:
            self._pipelined = 0
            return
        self._pipelined += 1
        self._networkProducer.pauseProducing()
        self._next_turn()

    def checkPersistence(self, request: http.Request, version: bytes) -> bool:
        persistent: bool = super().checkPersistence(request, version)
        if persistent and self._pipelined + 1 >= self.max_pipelined:
            request.responseHeaders.setRawHeaders(b"connection", [b"close"])
            return False
        return persistent

    def resumeProducing(self) -> None:
        """The transport took what we wrote: a pipelined request held back for it may go."""
        super().resumeProducing()
        if self.paused:
            self._next_turn()

    def connectionLost(self, reason: Any) -> None:
        if self._turn is not None and self._turn.active():
            self._turn.cancel()
        self._turn = None
        super().connectionLost(reason)

    def _next_turn(self) -> None:
        if self._turn is None and not self._waitingForTransport:
            self._turn = self.callLater(0, self._parse_next)

    def _parse_next(self) -> None:
        self._turn = None
        if self.transport is None or self.transport.disconnecting or self._waitingForTransport:
            return  # closing; or resumeProducing will come back here
        self.paused = False
        if not self._handlingRequest:
            self._networkProducer.resumeProducing()
        self.dataReceived(b"")


class GatewaySite(server.Site):
    """A Site that uses :class:`GatewayRequest` and :class:`GatewayChannel` and knows the body
    size limit."""

    def __init__(self, root: resource.Resource, max_body_size: int, on_refused: RefusalHook | None = None,
                 **kwargs: Any) -> None:
        # No request.args from the body: no handler reads them, and deciding whether a body is a
        # form took an email.message parse of every request's Content-Type.
        kwargs.setdefault("parsePOSTFormSubmission", False)
        super().__init__(root, requestFactory=GatewayRequest, **kwargs)
        self.max_body_size = max_body_size
        self.on_refused = on_refused

    def protocol(self) -> Any:  # type: ignore[override]
        """A :class:`GatewayChannel`, in the wrapper that switches to HTTP/2 when TLS negotiates it
        (what ``Site.protocol`` builds around a plain ``HTTPChannel``)."""
        return http._GenericHTTPChannelProtocol(GatewayChannel())

    def log(self, request: server.Request) -> None:
        """No access log line of twisted.web's: each request's line is :mod:`infx.http.request_log`'s."""
