#!/usr/bin/env python
"""The floor: the least a Twisted + httptools process spends relaying one HTTP request to a runtime.

``http_bench.py``'s ``floor`` target. It is not a gateway: no routing, no
admission, no queue, no retries, no metrics or log (but with ``--chores``,
below), no backpressure (a slow client's answer is buffered whole), no
failure handling beyond closing what broke. Each request is parsed by
httptools on a Twisted protocol, written to one pooled keep-alive connection to the runtime (its
header fields passed on as they came, minus the hop-by-hop ones), and the
answer is parsed by httptools and relayed back as it arrives: its status and
header fields, and its body framed as the runtime framed it (a length, or
chunked coding, one chunk per piece read). Writes go straight to the socket
when Twisted's buffer is empty (:func:`infx.transport.writes.write_buffers`,
as infx's own servers and its runtime client do).

So the distance between ``floor`` and infx by URL in one table is what
infx's own work costs (routing, queues, the agent's core, the request log,
metrics), and the distance between ``floor`` and the Rust routers is what
Python on Twisted costs for the same relay.

With ``--chores LOGFILE`` (``http_bench.py``'s ``floor-chores``) it also does,
per request, the least of what any gateway does besides relaying, the way infx
does it at its cheapest: the body parsed as JSON for the model it names, one
request log line written to ``LOGFILE`` through twisted.logger with infx's own
line formatter (:func:`infx.text_log.classic_line`), and a request counter and
a latency histogram of ``prometheus_client`` labelled by model and status
(children kept, as infx keeps them). What is left between ``floor-chores`` and
infx by URL is routing, admission, queues, retries and the layers between them.

    python tools/bench/proxy_floor.py --upstream http://127.0.0.1:PORT [--chores LOGFILE]

It prints the port it listens on (127.0.0.1) as its first stdout line and
exits when its stdin closes, as the benchmark's runtimes do.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import deque
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from twisted.internet import epollreactor

epollreactor.install()

import httptools  # noqa: E402
from prometheus_client import CollectorRegistry, Counter, Histogram  # noqa: E402
from twisted.internet import reactor, stdio  # noqa: E402
from twisted.internet.endpoints import TCP4ClientEndpoint, TCP4ServerEndpoint  # noqa: E402
from twisted.internet.protocol import Factory, Protocol  # noqa: E402
from twisted.logger import FileLogObserver, Logger  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent.parent))
from infx.supervisor.logs import CachedTime  # noqa: E402
from infx.text_log import classic_line  # noqa: E402
from infx.transport.writes import write_buffers  # noqa: E402

#: Fields a hop ends (RFC 9110 7.6.1) or that the relay frames itself.
_REQUEST_DROP = frozenset({b"connection", b"keep-alive", b"host", b"content-length", b"transfer-encoding",
                           b"te", b"upgrade", b"proxy-connection"})
_RESPONSE_DROP = frozenset({b"connection", b"keep-alive", b"transfer-encoding", b"proxy-connection"})


class Chores:
    """What every gateway does per request besides the relay, at its cheapest (see the module docstring)."""

    def __init__(self, log_file: Any) -> None:
        when = CachedTime()
        self.log = Logger(namespace="floor", observer=FileLogObserver(log_file, lambda e: classic_line(e, when)))
        registry = CollectorRegistry()
        self.requests = Counter("floor_requests", "Requests answered", ["model", "status"], registry=registry)
        self.seconds = Histogram("floor_request_seconds", "Request latency", ["model", "status"], registry=registry)
        self.children: dict[tuple[str, int], tuple[Any, Any]] = {}

    def model(self, body: bytes) -> str:
        try:
            model = json.loads(body).get("model")
        except (ValueError, AttributeError):
            return "-"
        return model if isinstance(model, str) else "-"

    def answered(self, model: str, status: int, started: float) -> None:
        seconds = time.monotonic() - started
        children = self.children.get((model, status))
        if children is None:
            label = str(status)
            children = self.children[(model, status)] = (self.requests.labels(model, label),
                                                         self.seconds.labels(model, label))
        children[0].inc()
        children[1].observe(seconds)
        self.log.info("{text}", text=f"request model={model!r} status={status} latency={seconds:.3f}s",
                      event="request", model=model, status=status, latency_seconds=seconds)


class Upstream(Protocol):
    """One kept-alive connection to the runtime, carrying one request at a time."""

    def __init__(self, pool: Pool) -> None:
        self.pool = pool
        self.parser = httptools.HttpResponseParser(self)
        self.client: Downstream | None = None
        self.head: list[bytes] = []
        self.reason = b""
        self.chunked = False

    def connectionMade(self) -> None:
        self.transport.setTcpNoDelay(True)

    def send(self, client: Downstream, data: list[bytes]) -> None:
        self.client = client
        client.upstream = self
        write_buffers(self.transport, data)

    def dataReceived(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self.transport.abortConnection()

    def on_message_begin(self) -> None:
        self.head = [b""]
        self.reason = b""
        self.chunked = False

    def on_status(self, reason: bytes) -> None:
        self.reason += reason

    def on_header(self, name: bytes, value: bytes) -> None:
        lower = name.lower()
        if lower == b"transfer-encoding":
            self.chunked = True
        if lower not in _RESPONSE_DROP:
            self.head += (name, b": ", value, b"\r\n")

    def on_headers_complete(self) -> None:
        head = self.head
        head[0] = b"HTTP/1.1 %d %s\r\n" % (self.parser.get_status_code(), self.reason)
        head.append(b"Transfer-Encoding: chunked\r\n\r\n" if self.chunked else b"\r\n")
        if self.client is not None:
            self.client.write(head)

    def on_body(self, body: bytes) -> None:
        if self.client is not None:
            self.client.write([b"%x\r\n" % len(body), body, b"\r\n"] if self.chunked else [body])

    def on_message_complete(self) -> None:
        client, self.client = self.client, None
        keep = self.parser.should_keep_alive()
        if keep:
            self.pool.idle.append(self)
        else:
            self.transport.loseConnection()
        if client is not None:
            client.upstream = None
            if self.chunked:
                client.write([b"0\r\n\r\n"])
            client.answered(self.parser.get_status_code())

    def connectionLost(self, reason: Any = None) -> None:
        if self in self.pool.idle:
            self.pool.idle.remove(self)
        client, self.client = self.client, None
        if client is not None:
            client.transport.abortConnection()


class Pool:
    """Idle connections to the runtime, most recently used first; one is dialled when none waits."""

    def __init__(self, url: str) -> None:
        parts = urlsplit(url)
        self.endpoint = TCP4ClientEndpoint(reactor, parts.hostname, parts.port or 80)
        self.host = b"Host: " + parts.netloc.encode() + b"\r\n"
        self.factory = Factory.forProtocol(lambda: Upstream(self))
        self.idle: list[Upstream] = []

    def send(self, client: Downstream, data: list[bytes]) -> None:
        if self.idle:
            self.idle.pop().send(client, data)
        else:
            self.endpoint.connect(self.factory).addCallbacks(
                lambda upstream: upstream.send(client, data), lambda _: client.transport.abortConnection())


class Downstream(Protocol):
    """One client's connection: requests parsed by httptools, answered in order, one at a time."""

    def __init__(self, pool: Pool, chores: Chores | None) -> None:
        self.pool = pool
        self.chores = chores
        self.parser = httptools.HttpRequestParser(self)
        self.upstream: Upstream | None = None
        #: With chores: each request's model and arrival, in order (answers come in order).
        self.asked: deque[tuple[str, float]] = deque()
        self.waiting: deque[list[bytes]] = deque()
        self.busy = False
        self.closing = False
        self.url = b""
        self.fields: list[bytes] = []
        self.body: list[bytes] = []

    def connectionMade(self) -> None:
        self.transport.setTcpNoDelay(True)

    def dataReceived(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self.transport.write(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
            self.transport.loseConnection()

    def on_message_begin(self) -> None:
        self.url = b""
        self.fields = []
        self.body = []

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        if name.lower() not in _REQUEST_DROP:
            self.fields += (name, b": ", value, b"\r\n")

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        body = b"".join(self.body)
        if self.chores is not None:
            self.asked.append((self.chores.model(body), time.monotonic()))
        data = [self.parser.get_method(), b" ", self.url, b" HTTP/1.1\r\n", self.pool.host, *self.fields,
                b"Content-Length: %d\r\n\r\n" % len(body), body]
        if not self.parser.should_keep_alive():
            self.closing = True  # answered, then closed; what follows is not read
            self.transport.pauseProducing()
        if self.busy:
            self.waiting.append(data)
        else:
            self.busy = True
            self.pool.send(self, data)

    def write(self, data: list[bytes]) -> None:
        write_buffers(self.transport, data)

    def answered(self, status: int) -> None:
        if self.chores is not None:
            model, started = self.asked.popleft()
            self.chores.answered(model, status, started)
        if self.waiting:
            self.pool.send(self, self.waiting.popleft())
        else:
            self.busy = False
            if self.closing:
                self.transport.loseConnection()

    def connectionLost(self, reason: Any = None) -> None:
        upstream, self.upstream = self.upstream, None
        if upstream is not None:
            upstream.client = None
            upstream.transport.abortConnection()  # the runtime sees the client gone


class StdinWatch(Protocol):
    def connectionLost(self, reason: Any = None) -> None:
        if reactor.running:
            reactor.stop()


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--upstream", required=True, help="the runtime's base URL (http://HOST:PORT)")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--chores", metavar="LOGFILE", type=Path,
                        help="also parse each body, log a line to LOGFILE and count the request (see above)")
    options = parser.parse_args(argv)
    pool = Pool(options.upstream)
    chores = Chores(options.chores.open("a", encoding="utf-8")) if options.chores is not None else None

    def listening(port: Any) -> None:
        os.write(1, b"%d\n" % port.getHost().port)

    TCP4ServerEndpoint(reactor, options.port, interface="127.0.0.1").listen(
        Factory.forProtocol(lambda: Downstream(pool, chores))).addCallback(listening)
    stdio.StandardIO(StdinWatch())
    reactor.run()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
