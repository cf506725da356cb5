"""The lean HTTP/1.1 client to one runtime: persistent connections, responses read by httptools.

Why not ``twisted.web``'s ``Agent``: it was a third of the engine agent's CPU
(URI parsing, a Deferred chain and a body protocol per request, and its
response parser); ``tools/bench/http_parser_bench.py`` measured its parsing
at 12-20x httptools' (llhttp, C) and h11's at 26-28x, on this project's
machine. Here a request is one ``writeSequence`` of bytes built once
(:mod:`protocol.agent.relay`), and the answer reaches a
:class:`ResponseHandler` as plain calls: its status line and headers, each
body piece as read, its end. No Deferred is made per request unless a new
connection has to be dialled.

Connections are kept alive and reused, most recently used first; at most
``max_idle`` wait idle (the engine agent's core bounds those in use: one per
running task). A connection is reused only if nothing was read on it while
idle: it is checked with a non-blocking ``MSG_PEEK`` first, so that one the
runtime closed while idle (uvicorn closes them after 5 s) is dropped before a
request is written to it, rather than that request being reported dropped.

What a failure means for the request (:mod:`protocol.agent.runtime_failures`):
a connection that could not be made (refused, timed out, the name did not
resolve) never carried the request (``UNREACHABLE``); a connection lost after
the request was written and before the answer's headers (``DROPPED``: the
runtime may have read it); a body broken off after the headers
(``response_broken``: framing cut short, or bytes that are not HTTP). A body
framed by neither a length nor chunked coding ends where the connection does
(``response_ended(framed=False)``), as HTTP/1.1 allows; the caller decides
whether that end is whole. An aborted exchange closes its connection at once
(the runtime sees the client gone and stops generating) and reports nothing
more. Answers to ``HEAD`` cannot be framed by their headers and are not
supported (:mod:`protocol.agent.relay` refuses the method).
"""

from __future__ import annotations

import socket
from typing import Any, Protocol
from urllib.parse import urlsplit

from httptools import HttpParserError, HttpParserUpgrade, HttpResponseParser
from twisted.internet.defer import CancelledError, Deferred, DeferredList, succeed
from twisted.internet.endpoints import HostnameEndpoint, wrapClientTLS
from twisted.internet.interfaces import IStreamClientEndpoint
from twisted.internet.protocol import Factory, connectionDone
from twisted.internet.protocol import Protocol as TwistedProtocol
from twisted.python.failure import Failure
from twisted.web.client import BrowserLikePolicyForHTTPS

from infx.transport.writes import write_buffers
from protocol.agent.runtime_failures import RuntimeFailure

__all__ = ["Exchange", "ResponseHandler", "RuntimeClient", "describe"]

_PEEK = socket.MSG_PEEK | socket.MSG_DONTWAIT


class ResponseHandler(Protocol):
    """Hears of one request's answer; exactly one of ``response_ended``, ``response_broken`` or
    ``request_failed`` ends it (none after an abort)."""

    def response_started(self, status: int, reason: bytes, fields: list[tuple[bytes, bytes]]) -> None:
        """The final status line and the header fields as they came (interim 1xx answers are skipped)."""

    def body_received(self, data: bytes) -> None:
        """The next piece of the body, as read (chunked coding removed)."""

    def response_ended(self, framed: bool) -> None:
        """The body is whole: by its framing, or (``framed`` False) where the connection closed."""

    def response_broken(self, detail: str) -> None:
        """The body broke off after the headers; ``detail`` is for the log."""

    def request_failed(self, failure: RuntimeFailure, detail: str) -> None:
        """No answer: the runtime was not reached, or it dropped the request; ``detail`` is for the log."""


def describe(failure: Failure) -> str:
    """What a connection's failure says, for the log: type and message, no repr."""
    return f"{type(failure.value).__name__}: {failure.getErrorMessage()}"


class Exchange:
    """One request and its answer: the handle its caller pauses, resumes or aborts."""

    __slots__ = ("handler", "data", "connection", "connecting", "started", "done")

    def __init__(self, handler: ResponseHandler, data: list[bytes]) -> None:
        self.handler = handler
        self.data = data
        self.connection: _Connection | None = None
        self.connecting: Deferred[Any] | None = None
        self.started = False
        self.done = False

    def pause(self) -> None:
        """Read no more of the answer until :meth:`resume` (the caller's consumer is full)."""
        if not self.done and self.connection is not None:
            self.connection.transport.pauseProducing()

    def resume(self) -> None:
        if not self.done and self.connection is not None:
            self.connection.transport.resumeProducing()

    def abort(self) -> None:
        """Stop now: the connection closes at once and the handler hears nothing more."""
        if self.done:
            return
        self.done = True
        if self.connecting is not None:
            self.connecting.cancel()
        elif self.connection is not None:
            self.connection.abort()


class _Connection(TwistedProtocol):
    """One kept-alive connection to the runtime, its answers parsed by httptools."""

    def __init__(self, client: RuntimeClient) -> None:
        self.client = client
        self.parser = HttpResponseParser(self)
        self.exchange: Exchange | None = None
        self.status = 0
        self.reason = b""
        self.fields: list[tuple[bytes, bytes]] = []
        self.framed = True
        self.lost: Deferred[None] | None = None
        self.closed = False

    def connectionMade(self) -> None:
        set_no_delay = getattr(self.transport, "setTcpNoDelay", None)
        if set_no_delay is not None:
            set_no_delay(True)

    def send(self, exchange: Exchange) -> None:
        self.exchange = exchange
        exchange.connection = self
        self.status = 0
        self.reason = b""
        self.fields = []
        data, exchange.data = exchange.data, []  # the body is not held for the answer's sake
        # Straight to the socket when nothing waits in Twisted's buffer: no reactor turn, no poll.
        write_buffers(self.transport, data)

    def usable(self) -> bool:
        """Whether this idle connection may carry a request: open, and nothing (an end, or
        bytes no request asked for) waits to be read on it."""
        if self.closed or self.transport.disconnecting:
            return False
        handle = self.transport.getHandle() if hasattr(self.transport, "getHandle") else None
        if not isinstance(handle, socket.socket):
            return True  # TLS, or a test's transport: nothing to peek at
        try:
            handle.recv(1, _PEEK)
        except BlockingIOError:
            return True
        except OSError:
            return False
        return False

    def abort(self) -> None:
        self.closed = True
        self.transport.abortConnection()

    # -- bytes from the runtime

    def dataReceived(self, data: bytes) -> None:
        exchange = self.exchange
        if exchange is None or exchange.done:
            self.abort()  # bytes no request asked for: the connection cannot be trusted
            return
        try:
            self.parser.feed_data(data)
        except HttpParserUpgrade:
            self._broken(exchange, "the runtime switched protocols")
        except HttpParserError as error:
            self._broken(exchange, f"its answer is not HTTP/1.1: {error}")

    def _broken(self, exchange: Exchange, detail: str) -> None:
        self.abort()
        if not exchange.done:
            exchange.done = True
            if exchange.started:
                exchange.handler.response_broken(detail)
            else:
                exchange.handler.request_failed(RuntimeFailure.DROPPED, detail)

    # -- httptools' callbacks

    def on_status(self, reason: bytes) -> None:
        self.reason += reason

    def on_header(self, name: bytes, value: bytes) -> None:
        self.fields.append((name, value))

    def on_headers_complete(self) -> None:
        status = self.parser.get_status_code()
        exchange = self.exchange
        if status < 200 or exchange is None or exchange.done:
            # An interim answer (100 Continue, 103 Early Hints): the final one follows.
            self.reason = b""
            self.fields = []
            return
        self.status = status
        self.framed = _framed(self.fields)
        exchange.started = True
        exchange.handler.response_started(status, self.reason, self.fields)

    def on_body(self, body: bytes) -> None:
        exchange = self.exchange
        if exchange is not None and not exchange.done:
            exchange.handler.body_received(body)

    def on_message_complete(self) -> None:
        exchange = self.exchange
        if self.status == 0 or exchange is None or exchange.done:
            return  # the end of an interim answer, or of one no longer wanted
        exchange.done = True
        self.exchange = None
        # Back in the pool first, so that a request the handler makes at once can reuse it.
        self.client._release(self, self.parser.should_keep_alive())
        exchange.handler.response_ended(True)

    # -- the end

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        self.closed = True
        self.client._forget(self)
        if self.lost is not None:
            self.lost.callback(None)
        exchange = self.exchange
        self.exchange = None
        if exchange is None or exchange.done:
            return
        exchange.done = True
        if not exchange.started:
            exchange.handler.request_failed(RuntimeFailure.DROPPED, describe(reason))
        elif not self.framed:
            exchange.handler.response_ended(False)
        else:
            exchange.handler.response_broken(describe(reason))


def _framed(fields: list[tuple[bytes, bytes]]) -> bool:
    """Whether a body's end is in its headers (a length, or chunked coding last) rather than
    where the connection closes."""
    framed = False
    for name, value in fields:
        lower = name.lower()
        if lower == b"content-length":
            framed = True
        elif lower == b"transfer-encoding":
            framed = value.rsplit(b",", 1)[-1].strip().lower() == b"chunked"
    return framed


class _ConnectionFactory(Factory):
    noisy = False

    def __init__(self, client: RuntimeClient) -> None:
        self.client = client

    def buildProtocol(self, addr: Any) -> _Connection:
        return _Connection(self.client)


class RuntimeClient:
    """Kept-alive HTTP/1.1 connections to the runtime at ``url`` (``http`` or ``https``; its
    path is not used: requests name theirs).

    ``endpoint`` dials it (default: a ``HostnameEndpoint`` timing out after ``connect_timeout``
    seconds, wrapped in TLS for ``https``); ``max_idle`` connections at most wait idle.
    """

    def __init__(self, reactor: Any, url: str, *, endpoint: IStreamClientEndpoint | None = None,
                 connect_timeout: float = 10.0, max_idle: int = 32) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"a runtime's URL is http:// or https:// with a host, got {url!r}")
        default_port = 443 if parts.scheme == "https" else 80
        port = parts.port or default_port
        host = parts.hostname
        netloc = f"[{host}]" if ":" in host else host
        if port != default_port:
            netloc = f"{netloc}:{port}"
        self._host_line = b" HTTP/1.1\r\nHost: " + netloc.encode("idna") + b"\r\n"
        if endpoint is None:
            endpoint = HostnameEndpoint(reactor, host, port, timeout=connect_timeout)
            if parts.scheme == "https":
                endpoint = wrapClientTLS(BrowserLikePolicyForHTTPS().creatorForNetloc(host.encode("idna"), port),
                                         endpoint)
        self._endpoint = endpoint
        self._factory = _ConnectionFactory(self)
        self.max_idle = max_idle
        self._idle: list[_Connection] = []
        self._open: set[_Connection] = set()
        self._closed = False
        #: Connections dialled so far (tests and benchmarks read it to see reuse).
        self.dialled = 0

    @property
    def idle(self) -> int:
        """Connections waiting idle for a request."""
        return len(self._idle)

    def request(self, method: bytes, target: bytes, fields: bytes, body: bytes,
                handler: ResponseHandler) -> Exchange:
        """Send a request (``fields``: header lines, each ending in CRLF, without ``Host`` and
        ``Content-Length``); its answer goes to ``handler``, never before this returns."""
        data = [method, b" ", target, self._host_line, fields, b"Content-Length: %d\r\n\r\n" % len(body)]
        if body:
            data.append(body)
        exchange = Exchange(handler, data)
        idle = self._idle
        while idle:
            connection = idle.pop()
            if connection.usable():
                connection.send(exchange)
                return exchange
            connection.abort()
        self._dial(exchange)
        return exchange

    def _dial(self, exchange: Exchange) -> None:
        self.dialled += 1
        connecting: Deferred[Any] = self._endpoint.connect(self._factory)
        exchange.connecting = connecting

        def connected(connection: _Connection) -> None:
            exchange.connecting = None
            if self._closed:
                connection.abort()
                if not exchange.done:
                    exchange.done = True
                    exchange.handler.request_failed(RuntimeFailure.UNREACHABLE, "the runtime's client is closed")
                return
            self._open.add(connection)
            if exchange.done:
                self._release(connection, True)  # aborted while dialling: the connection is still good
            else:
                connection.send(exchange)

        def failed(failure: Failure) -> None:
            exchange.connecting = None
            if exchange.done or failure.check(CancelledError):
                return
            exchange.done = True
            exchange.handler.request_failed(RuntimeFailure.UNREACHABLE, describe(failure))

        connecting.addCallbacks(connected, failed)

    def _release(self, connection: _Connection, keep_alive: bool) -> None:
        if keep_alive and not self._closed and not connection.closed and len(self._idle) < self.max_idle:
            self._idle.append(connection)
        else:
            connection.closed = True
            connection.transport.loseConnection()

    def _forget(self, connection: _Connection) -> None:
        self._open.discard(connection)
        if connection in self._idle:
            self._idle.remove(connection)

    def close(self) -> Deferred[None]:
        """Close idle connections now and the others as their requests end (a graceful stop: the
        caller aborts what must not finish); fires once every connection is closed."""
        self._closed = True
        waiting = []
        for connection in list(self._open):  # connections not lost yet
            if connection.lost is None:
                connection.lost = Deferred()
            waiting.append(connection.lost)
            if connection.exchange is None and not connection.closed:
                connection.closed = True
                connection.transport.loseConnection()
        self._idle.clear()
        if not waiting:
            return succeed(None)
        closed: Deferred[Any] = DeferredList(waiting)
        return closed.addCallback(lambda _: None)
