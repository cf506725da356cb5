"""The gateway's own HTTP/1.1 port, parsed by httptools: the same resource tree twisted.web serves.

:class:`LeanSite` serves :func:`infx.http.resources.build_resource`'s tree, as
:class:`~infx.http.site.GatewaySite` does, but parses requests with ``httptools``
(llhttp, Node's parser, in C) instead of twisted.web's line parser, and writes
answers with less machinery. The API itself (admission, the call, the relay, its
errors, the request log) is not here: each request is a :class:`LeanRequest`, which
offers the part of twisted.web's ``Request`` that the tree uses, and the tree's
resources render it as they render twisted.web's. So there is one API, driven by
two servers: this one on ``twistd infx``'s own ``tcp:`` port, twisted.web where the
tree is mounted in an application's site, on ``ssl:`` (HTTP/2 by ALPN) and for
``--http-server twisted``.

What :mod:`infx.http.site` guarantees holds here, by the same rules and the same
tests (run against both): a ``Content-Length`` over the limit is refused with 413
as soon as the headers are in, a chunked body once it grows past it, then the
connection closes after :data:`~infx.http.site.REFUSED_BODY_DRAIN_BYTES` or
:data:`~infx.http.site.REFUSED_BODY_DRAIN_SECONDS`; a handler that fails is a JSON
500; requests pipelined behind another are handled one per reactor turn, none
while the transport's write buffer is over its bound, and a run of
:data:`~infx.http.site.MAX_PIPELINED_REQUESTS` answered back to back ends with
``Connection: close``; a streamed answer's producer is paused with the transport.
Status lines, headers (``Server`` and ``Date`` too), chunking and persistence are
twisted.web's: HTTP/1.1 keeps the connection unless the client says ``close``,
HTTP/1.0 closes it. A request twisted.web would refuse as malformed (a bad request
line or header, more than :data:`MAX_HEADERS` headers or :data:`MAX_HEADER_BYTES`
of them) gets its bare ``400 Bad Request`` and the connection closes.

Size (over 600 lines): the request twisted.web's tree reads and the connection that parses,
queues and answers it are one adapter of httptools, and call each other on every request (the
current request, its producer, its bytes out); apart, each would reach into the other's state.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from io import BytesIO
from typing import Any
from urllib.parse import parse_qs, unquote_to_bytes

import httptools
from twisted.internet import defer, interfaces, protocol
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web import http, resource, server
from zope.interface import implementer

from infx.http.headers import LeanHeaders
from infx.http.site import (
    DEFAULT_MAX_BODY_SIZE, MAX_PIPELINED_REQUESTS, REFUSED_BODY_DRAIN_BYTES, REFUSED_BODY_DRAIN_SECONDS, RefusalHook,
)
from infx.transport.writes import write_buffers
from protocol.openai.errors import error_json, reason_phrase

__all__ = ["LeanRequest", "LeanSite"]

log = Logger(namespace="infx.gateway_site")

#: twisted.web's limits on a request's head (``HTTPChannel.maxHeaders``, ``totalHeadersSize``).
MAX_HEADERS = 500
MAX_HEADER_BYTES = 16384
#: Bytes handed to the parser at once where a request starts: a pipelining client's many small
#: requests are parsed a slice at a time, as the ones before them are answered (a body is fed whole).
PARSE_SLICE = 4096
BAD_REQUEST = b"HTTP/1.1 400 Bad Request\r\n\r\n"
#: A chunk of an answer up to this size is written framed in one buffer; a larger one is not copied.
JOINED_CHUNK_BYTES = 16384
#: Methods llhttp parses as any request; the others are parsed as PUT (see LeanChannel._other_method).
_LLHTTP_METHODS = frozenset({b"GET", b"HEAD", b"POST", b"PUT", b"DELETE", b"OPTIONS", b"PATCH", b"TRACE"})
#: RFC 9110's token characters, of which a method is made.
_TCHAR = frozenset(b"!#$%&'*+-.^_`|~0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz")
_NO_BODY_CODES = (204, 304)
#: The fields the server itself reads from a request's head (the body's size, 100-continue, persistence).
_FRAMING_NAMES = frozenset({b"content-length", b"expect", b"connection"})
_FRAMING_NAME_LENGTHS = frozenset(len(name) for name in _FRAMING_NAMES)


class _Date:
    """``Date`` in HTTP form, made once a second."""

    second = -1
    text = b""

    def __call__(self) -> bytes:
        now = int(time.time())
        if now != self.second:
            self.second, self.text = now, http.datetimeToString(now)
        return self.text


_date = _Date()


class LeanRequest:
    """One request on a :class:`LeanChannel`: what the resource tree reads and calls of
    twisted.web's ``Request`` (method, uri, path, query arguments, headers, content; status,
    headers, redirect, write, finish, notifyFinish, a producer; ``channel.transport``)."""

    defaultContentType: bytes | None = b"text/html"

    def __init__(self, channel: LeanChannel, method: bytes, uri: bytes, version: bytes,
                 headers: list[tuple[bytes, bytes]], content: BytesIO, persistent: bool) -> None:
        self.channel: LeanChannel | None = channel
        self.method = method
        self.uri = uri
        self.clientproto = version
        self.path = path = uri.split(b"?", 1)[0]
        self.prepath: list[bytes] = []
        segments = path[1:].split(b"/")
        # unquote_to_bytes returns a segment without "%" as it is: only a quoted path needs it.
        self.postpath = [unquote_to_bytes(segment) for segment in segments] if b"%" in path else segments
        self._fields = headers
        self._request_headers: LeanHeaders | None = None
        #: Each field's last value by its lower-case name, made at the first getHeader.
        self._last_values: dict[bytes, bytes] | None = None
        self.content: BytesIO | None = content
        self.responseHeaders = LeanHeaders()
        self.code = 200
        self.code_message = b"OK"
        self.startedWriting = False
        self.finished = False
        self._disconnected = False
        self.persistent = persistent
        self._chunked = False
        self._no_body = False
        self._when_done: list[Callable[[Failure | None], object]] = []
        self.producer: Any = None

    # --- what handlers read --------------------------------------------------------------

    @property
    def args(self) -> dict[bytes, list[bytes]]:
        """The query's arguments, as twisted.web parses them (blank values kept); parsed when
        asked, since the API's own calls never read them."""
        _, _, query = self.uri.partition(b"?")
        return parse_qs(query, keep_blank_values=True)

    @property
    def requestHeaders(self) -> LeanHeaders:
        """twisted.web's form of the head's fields, made when first asked for: the API's own calls
        read their few headers from the fields as parsed (:meth:`getHeader`, :attr:`header_pairs`)."""
        headers = self._request_headers
        if headers is None:
            headers = self._request_headers = LeanHeaders()
            for name, value in self._fields:
                headers.addRawHeader(name, value)
        return headers

    @property
    def header_pairs(self) -> list[tuple[bytes, bytes]] | None:
        """The head's fields as parsed, in order, while :attr:`requestHeaders` has not been made
        (once it has, a handler may have changed it, and it is the truth): None then."""
        return self._fields if self._request_headers is None else None

    def getHeader(self, name: bytes | str) -> bytes | str | None:
        if type(name) is bytes and self._request_headers is None:
            # The last value of the field, as Headers gives it, read from the fields as parsed;
            # a value with a line break (which Headers rewrites) takes Headers' own path.
            last = self._last_values
            if last is None:
                last = self._last_values = {field.lower(): value for field, value in self._fields}
            found = last.get(name.lower())
            if found is None or (b"\r" not in found and b"\n" not in found):
                return found
        values = self.requestHeaders.getRawHeaders(name)
        return None if values is None else values[-1]

    # --- what handlers answer --------------------------------------------------------------

    def setResponseCode(self, code: int, message: bytes | None = None) -> None:
        self.code = code
        self.code_message = message if message is not None else reason_phrase(code).encode()

    def redirect(self, url: bytes) -> None:
        """Answers 302 to ``url``, as twisted.web's ``Request.redirect``."""
        self.setResponseCode(http.FOUND)
        self.setHeader(b"location", url)

    def setHeader(self, name: bytes | str, value: bytes | str) -> None:
        self.responseHeaders.setRawHeaders(name, [value])

    def write(self, data: bytes) -> None:
        if self.finished:
            raise RuntimeError("Request.write called on a request after Request.finish was called.")
        if self._disconnected or self.channel is None:
            return
        out = [] if self.startedWriting else [self._head()]
        if data and not self._no_body:
            if not self._chunked:
                out.append(data)
            elif len(data) <= JOINED_CHUNK_BYTES:
                # A stream's event is one buffer with its chunk's framing: one piece for the socket
                # to take instead of three (a copy of a small event costs less than the calls).
                out.append(b"%x\r\n%b\r\n" % (len(data), data))
            else:
                out += (b"%x\r\n" % len(data), data, b"\r\n")
        if out:
            self.channel.send(out)

    def _head(self) -> bytes:
        """The status line and headers: they leave with the first body bytes, in one write."""
        self.startedWriting = True
        headers = self.responseHeaders
        length = headers.getRawHeaders(b"content-length")
        if (self.code not in _NO_BODY_CODES and self.defaultContentType is not None
                and not headers.hasHeader(b"content-type") and not (length and length[0] == b"0")):
            headers.setRawHeaders(b"content-type", [self.defaultContentType])
        if (self.clientproto == b"HTTP/1.1" and length is None and self.method != b"HEAD"
                and self.code not in _NO_BODY_CODES):
            headers.setRawHeaders(b"transfer-encoding", [b"chunked"])
            self._chunked = True
        self._no_body = self.method == b"HEAD" or self.code in _NO_BODY_CODES
        parts = [self.clientproto, b" %d " % self.code, self.code_message, b"\r\n"]
        for name, values in headers.getAllRawHeaders():
            for value in values:
                parts += (name, b": ", value, b"\r\n")
        parts.append(b"\r\n")
        return b"".join(parts)

    def finish(self) -> None:
        if self._disconnected or self.channel is None:
            return
        if self.finished:
            raise RuntimeError("Request.finish called on a request after its connection was lost.")
        if not self.startedWriting:
            self.write(b"")
        self.finished = True
        channel = self.channel
        if self._chunked:
            channel.send([b"0\r\n\r\n"])
        calls, self._when_done = self._when_done, []
        for call in calls:
            call(None)
        channel.request_done(self)

    def notifyFinish(self) -> defer.Deferred[None]:
        d: defer.Deferred[None] = defer.Deferred()
        self.call_when_done(lambda reason: d.callback(None) if reason is None else d.errback(reason))
        return d

    def call_when_done(self, call: Callable[[Failure | None], object]) -> None:
        """``notifyFinish().addBoth(call)``, no Deferred: ``call(None)`` once finished, else ``call(reason)``."""
        if self._disconnected:
            call(Failure(ConnectionError("the connection was lost")))
        elif self.finished:
            call(None)
        else:
            self._when_done.append(call)

    def registerProducer(self, producer: Any, streaming: bool) -> None:
        self.producer = producer
        if self.channel is not None:
            self.channel.request_producer(producer)

    def unregisterProducer(self) -> None:
        self.producer = None
        if self.channel is not None:
            self.channel.request_producer(None)

    def connectionLost(self, reason: Failure) -> None:
        self._disconnected = True
        self.channel = None
        if self.content is not None:
            self.content.close()
        calls, self._when_done = self._when_done, []
        for call in calls:
            call(reason)

    # --- the answer of the site itself -----------------------------------------------------------

    def render(self, root: resource.Resource) -> None:
        """Find the resource for this request in ``root`` and render it, as twisted.web does."""
        self.setHeader(b"server", server.version)
        self.setHeader(b"date", _date())
        try:
            target = resource.getChildForRequest(root, self)
            body = target.render(self)
        except server.UnsupportedMethod as e:
            allowed = b", ".join(e.allowedMethods)
            self.setHeader(b"allow", allowed)
            body = self._refusal(405, f"Invalid method for URL ({self.method.decode('latin-1')[:16]}).",
                                 "method_not_allowed")
        except Exception:
            self._failed(Failure())
            return
        if body is server.NOT_DONE_YET:
            return
        if not isinstance(body, bytes):
            self._failed(Failure(TypeError(f"a resource rendered {type(body).__name__}, not bytes")))
            return
        self.setHeader(b"content-length", b"%d" % len(body))
        self.write(b"" if self.method == b"HEAD" else body)
        self.finish()

    def _refusal(self, status: int, message: str, code: str) -> bytes:
        self.setResponseCode(status, reason_phrase(status).encode())
        self.setHeader(b"content-type", b"application/json")
        return error_json(status, message, code=code)

    def _failed(self, reason: Failure) -> None:
        """A handler raised: a JSON 500, told to the site's hook; the traceback is logged."""
        log.failure("the gateway failed to handle {method} {path}", reason,
                    method=self.method.decode("latin-1"), path=self.path.decode("latin-1"))
        channel = self.channel
        if channel is not None:
            channel.site.told_refused(self.path, 500, "internal_error", reason.getErrorMessage())
        if self.startedWriting:
            if channel is not None:
                channel.transport.loseConnection()
            return
        body = error_json(500, "The gateway failed to handle this request.", code="internal_error")
        self.responseHeaders = LeanHeaders()
        self.setHeader(b"server", server.version)
        self.setHeader(b"date", _date())
        self.setResponseCode(500, reason_phrase(500).encode())
        self.setHeader(b"content-type", b"application/json")
        self.setHeader(b"content-length", b"%d" % len(body))
        self.write(body)
        self.finish()


class _Incoming:
    """A request being parsed: its URL, headers and body so far."""

    __slots__ = ("url", "headers", "framing", "header_bytes", "body", "body_bytes", "refused")

    def __init__(self) -> None:
        self.url = b""
        self.headers: list[tuple[bytes, bytes]] = []
        #: The first value of each of :data:`_FRAMING_NAMES` (lower-case) the head holds.
        self.framing: dict[bytes, bytes] = {}
        self.header_bytes = 0
        self.body = BytesIO()
        self.body_bytes = 0
        self.refused = False


class _BadRequest(Exception):
    """The request's head breaks twisted.web's limits (httptools hands it on wrapped in its
    ``HttpParserCallbackError``; :attr:`LeanChannel._line_too_long` says which limit)."""


@implementer(interfaces.IPushProducer)
class LeanChannel(protocol.Protocol):
    """One HTTP/1.1 connection; see the module docstring. It is the producer its transport pauses."""

    def __init__(self, site: LeanSite) -> None:
        self.site = site
        self.parser = httptools.HttpRequestParser(self)
        # Header values with control characters (DEL, say) are read, as twisted.web reads them, not
        # refused: a client's odd header must not cost it its answer. Framing stays strict.
        self.parser.set_dangerous_leniencies(lenient_headers=True)
        self._unparsed = b""
        self._incoming: _Incoming | None = None
        #: Requests parsed whole, waiting their turn: (method, url, version, headers, body, persistent).
        self._waiting: deque[tuple[bytes, bytes, bytes, list[tuple[bytes, bytes]], BytesIO, bool]] = deque()
        self._current: LeanRequest | None = None
        self._producer: Any = None
        self._paused = False  # by the transport: its write buffer is over its bound
        self._turn: Any = None
        self._pipelined = 0
        self._closing = False
        self._refused = False
        self._drained = 0
        self._drain_timer: Any = None
        self._reading = True
        #: The method of the request being parsed, when llhttp parses it as another (see _other_method).
        self._real_method = b""
        #: The head broke off on a line longer than twisted.web buffers.
        self._line_too_long = False

    # --- bytes in -------------------------------------------------------------------------

    def connectionMade(self) -> None:
        # An answer's bytes go out as they are made (send): a chunked answer's last chunk, a
        # separate small write, must not wait for the client's delayed ACK (Nagle, 40 ms).
        set_no_delay = getattr(self.transport, "setTcpNoDelay", None)
        if set_no_delay is not None:
            set_no_delay(True)
        self.transport.registerProducer(self, True)

    def dataReceived(self, data: bytes) -> None:
        if self._closing:
            return
        if self._refused:
            # What follows a refused body's head is read and dropped, within the allowance; the
            # parser still sees it, to tell when that body ends.
            self._drained += len(data)
            if self._drained > REFUSED_BODY_DRAIN_BYTES:
                self._close()
                return
        self._unparsed += data
        self._parse()

    def _parse(self) -> None:
        """Feed the parser while nothing waits its turn (or a body is being read)."""
        while self._unparsed and not self._closing and (not self._waiting or self._incoming is not None):
            if self._incoming is None:
                # A request starts here: a slice at a time, so that many small pipelined ones are
                # parsed as the ones before them are answered.
                if not self._real_method:
                    self._other_method()
                piece, self._unparsed = self._unparsed[:PARSE_SLICE], self._unparsed[PARSE_SLICE:]
            else:
                piece, self._unparsed = self._unparsed, b""  # the rest of a request: its body, whole
            try:
                self.parser.feed_data(piece)
            except (httptools.HttpParserError, httptools.HttpParserUpgrade, _BadRequest):
                if self._line_too_long:  # twisted.web's line reader drops the connection without a word
                    self._closing = True
                    self.transport.loseConnection()
                else:
                    self._bad_request()
                return
        self._next()
        self._reading_while(not self._waiting)

    def _other_method(self) -> None:
        """A request line whose method llhttp does not take (``FOO``, ``get``, ``CONNECT``, which it
        takes for a tunnel) is parsed as ``PUT``, and handled with its own method: the tree answers
        it (405 with ``Allow``), as under twisted.web. This works where a request starts a read (one
        pipelined behind another in the same read gets the bare 400 of a malformed request)."""
        space = self._unparsed.find(b" ", 0, 33)
        if space <= 0:
            return
        method = self._unparsed[:space]
        if method not in _LLHTTP_METHODS and all(c in _TCHAR for c in method):
            self._real_method = method
            self._unparsed = b"PUT" + self._unparsed[space:]

    def _reading_while(self, reading: bool) -> None:
        """The connection is read only while none of its requests waits (it is read while one is
        handled: a client that goes away is seen at once)."""
        if reading != self._reading and self.transport is not None and not self._closing:
            self._reading = reading
            if reading:
                self.transport.resumeProducing()
            else:
                self.transport.pauseProducing()

    # httptools' callbacks

    def on_message_begin(self) -> None:
        self._incoming = _Incoming()

    def on_url(self, url: bytes) -> None:
        incoming = self._incoming
        assert incoming is not None
        incoming.url += url
        incoming.header_bytes += len(url)
        if len(incoming.url) > MAX_HEADER_BYTES:
            self._line_too_long = True
            raise _BadRequest()

    def on_header(self, name: bytes, value: bytes) -> None:
        incoming = self._incoming
        assert incoming is not None
        headers = incoming.headers
        headers.append((name, value))
        size = len(name) + len(value)
        incoming.header_bytes += size
        if size > MAX_HEADER_BYTES:
            self._line_too_long = True
            raise _BadRequest()
        if incoming.header_bytes > MAX_HEADER_BYTES or len(headers) > MAX_HEADERS:
            raise _BadRequest()
        if len(name) in _FRAMING_NAME_LENGTHS:
            # The first Content-Length, Expect and Connection frame the request: kept as they come.
            lower = name.lower()
            if lower in _FRAMING_NAMES and lower not in incoming.framing:
                incoming.framing[lower] = value

    def on_headers_complete(self) -> None:
        incoming = self._incoming
        assert incoming is not None
        framing = incoming.framing
        length = framing.get(b"content-length")
        limit = self.site.max_body_size
        if length is not None and length.strip().isdigit() and int(length) > limit:
            self._refuse_body(incoming, f"The request body ({int(length)} bytes) is larger than this gateway "
                                        f"accepts ({limit} bytes).")
            return
        expect = framing.get(b"expect", b"")
        if expect.lower() == b"100-continue" and self.parser.get_http_version() == "1.1":
            self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")

    def on_body(self, body: bytes) -> None:
        incoming = self._incoming
        if incoming is None or incoming.refused:
            return
        incoming.body_bytes += len(body)
        if incoming.body_bytes > self.site.max_body_size:
            self._refuse_body(incoming, f"The request body is larger than this gateway accepts "
                                        f"({self.site.max_body_size} bytes).")
            return
        incoming.body.write(body)

    def on_message_complete(self) -> None:
        incoming, self._incoming = self._incoming, None
        method, self._real_method = self._real_method or self.parser.get_method(), b""
        if incoming is None or incoming.refused:
            if incoming is not None:
                self._close()  # the refused body ended within the drain allowance: answered already
            return
        version = b"HTTP/" + self.parser.get_http_version().encode()
        connection = incoming.framing.get(b"connection", b"")
        persistent = version == b"HTTP/1.1" and b"close" not in connection.lower().split()
        incoming.body.seek(0)
        self._waiting.append((method, incoming.url, version, incoming.headers, incoming.body, persistent))

    # --- one request at a time ---------------------------------------------------------------

    def _next(self) -> None:
        if self._current is not None or not self._waiting or self._paused or self._closing or self._turn:
            return
        method, url, version, headers, body, persistent = self._waiting.popleft()
        if persistent and self._pipelined + 1 >= MAX_PIPELINED_REQUESTS:
            persistent = False
        request = LeanRequest(self, method, url, version, headers, body, persistent)
        if not persistent and version == b"HTTP/1.1":
            request.responseHeaders.setRawHeaders(b"connection", [b"close"])
        self._current = request
        request.render(self.site.resource)

    def request_done(self, request: LeanRequest) -> None:
        if request is not self._current:
            return
        self._current = None
        self._producer = None
        if not request.persistent:
            self._closing = True
            self.transport.loseConnection()
            return
        waiting = bool(self._waiting or self._unparsed)
        if not waiting:
            self._pipelined = 0
            self._reading_while(True)
            return
        # Pipelined: the next waits for a later reactor turn, and for the transport to take our answers.
        self._pipelined += 1
        self._next_turn()

    def _next_turn(self) -> None:
        if self._turn is None and not self._paused:
            self._turn = self.site.reactor.callLater(0, self._take_turn)

    def _take_turn(self) -> None:
        self._turn = None
        if self.transport is None or self._closing:
            return
        if self._waiting:
            self._next()
            self._reading_while(not self._waiting)
        else:
            self._parse()

    # --- bytes out --------------------------------------------------------------------------

    def send(self, buffers: list[bytes]) -> None:
        """Bytes of the answer, to the socket at once when nothing waits in Twisted's buffer: an
        answer leaves in the reactor turn that made it, in one ``sendmsg``, rather than after
        another poll (and the two ``epoll_ctl`` calls that arm and disarm it)."""
        write_buffers(self.transport, buffers)

    def request_producer(self, producer: Any) -> None:
        self._producer = producer
        if producer is not None and self._paused:
            producer.pauseProducing()

    # IPushProducer, for the transport

    def pauseProducing(self) -> None:
        self._paused = True
        if self._producer is not None:
            self._producer.pauseProducing()

    def resumeProducing(self) -> None:
        self._paused = False
        if self._producer is not None:
            self._producer.resumeProducing()
        if self._current is None and (self._waiting or self._unparsed):
            self._next_turn()

    def stopProducing(self) -> None:
        if self._producer is not None:
            self._producer.stopProducing()

    # --- refusals and the end -------------------------------------------------------------------

    def _refuse_body(self, incoming: _Incoming, message: str) -> None:
        incoming.refused = True
        self._refused = True
        path = incoming.url.split(b"?", 1)[0]
        self.site.told_refused(path, 413, "request_too_large", message)
        body = error_json(413, message, code="request_too_large")
        self.transport.write(b"HTTP/1.1 413 %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
                             b"connection: close\r\n\r\n%s" % (reason_phrase(413).encode(), len(body), body))
        self._drain_timer = self.site.reactor.callLater(REFUSED_BODY_DRAIN_SECONDS, self._close)

    def _bad_request(self) -> None:
        self._closing = True
        self.transport.write(BAD_REQUEST)
        self.transport.loseConnection()

    def _close(self) -> None:
        if self._drain_timer is not None and self._drain_timer.active():
            self._drain_timer.cancel()
        self._drain_timer = None
        if not self._closing and self.transport is not None:
            self._closing = True
            self.transport.loseConnection()

    def connectionLost(self, reason: Failure = protocol.connectionDone) -> None:
        self._closing = True
        if self._turn is not None and self._turn.active():
            self._turn.cancel()
        self._turn = None
        if self._drain_timer is not None and self._drain_timer.active():
            self._drain_timer.cancel()
        self._drain_timer = None
        self._waiting.clear()
        current, self._current = self._current, None
        if current is not None and not current.finished:
            if self._producer is not None:
                self._producer.stopProducing()
            current.connectionLost(reason)


class LeanSite(protocol.ServerFactory):
    """Serves ``root`` (the tree of :func:`~infx.http.resources.build_resource`) on HTTP/1.1 with
    httptools; ``on_refused`` hears of the refusals the site makes itself (413, 500)."""

    noisy = False

    def __init__(self, root: resource.Resource, max_body_size: int = DEFAULT_MAX_BODY_SIZE,
                 on_refused: RefusalHook | None = None, reactor: Any = None) -> None:
        if reactor is None:
            from twisted.internet import reactor as default_reactor

            reactor = default_reactor
        self.resource = root
        self.max_body_size = max_body_size
        self.on_refused = on_refused
        self.reactor = reactor

    def buildProtocol(self, addr: Any) -> LeanChannel:
        channel = LeanChannel(self)
        channel.factory = self
        return channel

    def told_refused(self, path: bytes, status: int, code: str, detail: str) -> None:
        if self.on_refused is not None:
            self.on_refused(path, status, code, detail)
