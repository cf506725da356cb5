"""The lean HTTP/1.1 client against a scripted runtime on loopback: every body framing,
connections kept alive and reused, a runtime that closes, cancel, and what each failure means."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import pytest_twisted
from twisted.internet import defer, reactor, task
from twisted.internet.endpoints import TCP4ServerEndpoint
from twisted.internet.protocol import Factory, Protocol

from infx.agent.runtime_client import RuntimeClient
from protocol.agent.runtime_failures import RuntimeFailure


@dataclass
class Recorded:
    head: bytes
    body: bytes
    connection: int


class ScriptedRuntime(Factory):
    """Answers each request with what ``script(recorded, transport)`` writes; counts connections."""

    def __init__(self, script: Callable[[Recorded, Any], None]) -> None:
        self.script = script
        self.requests: list[Recorded] = []
        self.connections = 0
        self.lost: list[defer.Deferred[None]] = []

    def buildProtocol(self, addr: Any) -> Protocol:
        self.connections += 1
        return _ScriptedConnection(self, self.connections)


class _ScriptedConnection(Protocol):
    def __init__(self, runtime: ScriptedRuntime, number: int) -> None:
        self.runtime = runtime
        self.number = number
        self.buffer = b""
        self.gone: defer.Deferred[None] = defer.Deferred()
        runtime.lost.append(self.gone)

    def dataReceived(self, data: bytes) -> None:
        self.buffer += data
        while b"\r\n\r\n" in self.buffer:
            head, rest = self.buffer.split(b"\r\n\r\n", 1)
            length = 0
            for line in head.split(b"\r\n")[1:]:
                name, _, value = line.partition(b":")
                if name.strip().lower() == b"content-length":
                    length = int(value)
            if len(rest) < length:
                return
            self.buffer = rest[length:]
            recorded = Recorded(head, rest[:length], self.number)
            self.runtime.requests.append(recorded)
            self.runtime.script(recorded, self.transport)

    def connectionLost(self, reason: Any = None) -> None:
        self.gone.callback(None)


@dataclass
class Collected:
    """A ResponseHandler that keeps everything it hears."""

    status: int | None = None
    reason: bytes = b""
    fields: list[tuple[bytes, bytes]] = field(default_factory=list)
    body: list[bytes] = field(default_factory=list)
    ended: bool | None = None
    broken: str | None = None
    failed: tuple[RuntimeFailure, str] | None = None
    done: defer.Deferred[None] = field(default_factory=defer.Deferred)
    on_body: Callable[[bytes], None] | None = None

    def response_started(self, status: int, reason: bytes, fields: list[tuple[bytes, bytes]]) -> None:
        self.status, self.reason, self.fields = status, reason, list(fields)

    def body_received(self, data: bytes) -> None:
        self.body.append(data)
        if self.on_body is not None:
            self.on_body(data)

    def response_ended(self, framed: bool) -> None:
        self.ended = framed
        self.done.callback(None)

    def response_broken(self, detail: str) -> None:
        self.broken = detail
        self.done.callback(None)

    def request_failed(self, failure: RuntimeFailure, detail: str) -> None:
        self.failed = (failure, detail)
        self.done.callback(None)


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


@pytest.fixture
def serve():
    started: list[tuple[Any, RuntimeClient]] = []

    def start(script: Callable[[Recorded, Any], None], **client_options: Any) -> tuple[ScriptedRuntime, RuntimeClient]:
        runtime = ScriptedRuntime(script)
        port = reactor.listenTCP(0, runtime, interface="127.0.0.1")
        client = RuntimeClient(reactor, f"http://127.0.0.1:{port.getHost().port}", **client_options)
        started.append((port, client))
        return runtime, client

    yield start
    for port, client in started:
        pytest_twisted.blockon(client.close())
        pytest_twisted.blockon(defer.maybeDeferred(port.stopListening))


def post(client: RuntimeClient, body: bytes = b'{"a":1}', fields: bytes = b"X-Test: 1\r\n") -> Collected:
    collected = Collected()
    client.request(b"POST", b"/v1/chat/completions?x=1", fields, body, collected)
    return collected


JSON = b'{"ok":true}'


def json_answer(recorded: Recorded, transport: Any) -> None:
    transport.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                    % (len(JSON), JSON))


@pytest_twisted.inlineCallbacks
def test_the_request_goes_out_as_one_request_with_host_and_length_and_a_length_framed_answer_comes_back(serve):
    runtime, client = serve(json_answer)
    collected = post(client)
    yield collected.done
    head, body = runtime.requests[0].head, runtime.requests[0].body
    port = client._host_line.split(b":")[-1].strip()
    assert head.split(b"\r\n") == [b"POST /v1/chat/completions?x=1 HTTP/1.1", b"Host: 127.0.0.1:" + port,
                                   b"X-Test: 1", b"Content-Length: 7"]
    assert body == b'{"a":1}'
    assert (collected.status, collected.reason, collected.ended) == (200, b"OK", True)
    assert collected.fields == [(b"content-type", b"application/json"), (b"content-length", b"11")]
    assert b"".join(collected.body) == JSON


@pytest_twisted.inlineCallbacks
def test_sequential_requests_reuse_one_kept_alive_connection(serve):
    runtime, client = serve(json_answer)
    for _ in range(5):
        collected = post(client)
        yield collected.done
        assert collected.ended is True
    assert runtime.connections == 1 and client.dialled == 1 and client.idle == 1
    assert [r.connection for r in runtime.requests] == [1] * 5


@pytest_twisted.inlineCallbacks
def test_concurrent_requests_each_get_a_connection_and_at_most_max_idle_stay_open(serve):
    runtime, client = serve(json_answer, max_idle=2)
    answers = [post(client) for _ in range(4)]
    yield defer.gatherResults([a.done for a in answers])
    assert runtime.connections == 4 and all(a.ended for a in answers)
    assert client.idle == 2
    # Two were closed on release: the runtime sees them go.
    yield task.deferLater(reactor, 0.05, lambda: None)
    assert sum(1 for gone in runtime.lost if gone.called) == 2


@pytest_twisted.inlineCallbacks
def test_a_chunked_answer_arrives_piece_by_piece_without_its_framing(serve):
    def script(recorded: Recorded, transport: Any) -> None:
        transport.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
        transport.write(chunk(b"data: 1\n\n"))
        reactor.callLater(0.01, transport.write, chunk(b"data: 2\n\n") + b"0\r\n\r\n")

    runtime, client = serve(script)
    collected = post(client)
    yield collected.done
    assert collected.ended is True and b"".join(collected.body) == b"data: 1\n\ndata: 2\n\n"
    again = post(client)
    yield again.done
    assert runtime.connections == 1, "a chunked answer that ended keeps its connection"


@pytest_twisted.inlineCallbacks
def test_an_answer_framed_by_the_connections_close_ends_unframed(serve):
    def script(recorded: Recorded, transport: Any) -> None:
        transport.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n\r\ndata: 1\n\n")
        reactor.callLater(0.01, transport.loseConnection)

    runtime, client = serve(script)
    collected = post(client)
    yield collected.done
    assert collected.ended is False and b"".join(collected.body) == b"data: 1\n\n"
    assert client.idle == 0


@pytest_twisted.inlineCallbacks
def test_an_http_1_0_answer_and_connection_close_are_not_kept(serve):
    def script(recorded: Recorded, transport: Any) -> None:
        transport.write(b"HTTP/1.1 200 OK\r\nconnection: close\r\ncontent-length: 2\r\n\r\n{}")

    runtime, client = serve(script)
    for _ in range(2):
        collected = post(client)
        yield collected.done
        assert collected.ended is True
    assert runtime.connections == 2 and client.idle == 0


@pytest_twisted.inlineCallbacks
def test_interim_answers_are_skipped_and_the_final_one_is_reported(serve):
    def script(recorded: Recorded, transport: Any) -> None:
        transport.write(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nlink: </a>\r\n\r\n"
                        b"HTTP/1.1 429 Too Many Requests\r\nretry-after: 3\r\ncontent-length: 2\r\n\r\n{}")

    runtime, client = serve(script)
    collected = post(client)
    yield collected.done
    assert (collected.status, collected.reason) == (429, b"Too Many Requests")
    assert collected.fields == [(b"retry-after", b"3"), (b"content-length", b"2")]


@pytest_twisted.inlineCallbacks
def test_a_refused_connection_means_the_runtime_never_read_the_request(serve):
    listening = yield TCP4ServerEndpoint(reactor, 0, interface="127.0.0.1").listen(Factory.forProtocol(Protocol))
    free = listening.getHost().port
    yield listening.stopListening()
    client = RuntimeClient(reactor, f"http://127.0.0.1:{free}")
    collected = post(client)
    yield collected.done
    assert collected.failed is not None and collected.failed[0] is RuntimeFailure.UNREACHABLE
    assert "ConnectionRefusedError" in collected.failed[1]


@pytest_twisted.inlineCallbacks
def test_a_runtime_that_closes_after_reading_the_request_dropped_it(serve):
    runtime, client = serve(lambda recorded, transport: transport.loseConnection())
    collected = post(client)
    yield collected.done
    assert collected.failed is not None and collected.failed[0] is RuntimeFailure.DROPPED
    assert collected.failed[1].startswith("ConnectionDone")


@pytest_twisted.inlineCallbacks
def test_a_length_framed_body_cut_short_is_broken(serve):
    def script(recorded: Recorded, transport: Any) -> None:
        transport.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\n{\"partial\":")
        reactor.callLater(0.01, transport.loseConnection)

    runtime, client = serve(script)
    collected = post(client)
    yield collected.done
    assert collected.status == 200 and collected.broken is not None and collected.ended is None


@pytest_twisted.inlineCallbacks
def test_a_chunked_body_cut_short_is_broken(serve):
    def script(recorded: Recorded, transport: Any) -> None:
        transport.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n" + chunk(b"data: 1\n\n") + b"2a\r\nda")
        reactor.callLater(0.01, transport.abortConnection)

    runtime, client = serve(script)
    collected = post(client)
    yield collected.done
    assert collected.broken is not None and b"".join(collected.body).startswith(b"data: 1\n\n")


@pytest_twisted.inlineCallbacks
def test_bytes_that_are_not_http_before_the_answer_mean_a_dropped_request(serve):
    runtime, client = serve(lambda recorded, transport: transport.write(b"SSH-2.0-OpenSSH\r\n\r\n"))
    collected = post(client)
    yield collected.done
    assert collected.failed is not None and collected.failed[0] is RuntimeFailure.DROPPED
    assert "not HTTP/1.1" in collected.failed[1]


@pytest_twisted.inlineCallbacks
def test_an_idle_connection_the_runtime_closed_is_not_used_for_the_next_request(serve):
    def script(recorded: Recorded, transport: Any) -> None:
        json_answer(recorded, transport)
        if len(runtime.requests) == 1:
            transport.loseConnection()  # as a keep-alive timeout does, without saying so in the answer

    runtime, client = serve(script)
    first = post(client)
    yield first.done
    # The close may not have been read yet: the next request must not go out on it.
    second = post(client)
    yield second.done
    assert second.ended is True and runtime.connections == 2


@pytest_twisted.inlineCallbacks
def test_abort_before_the_answer_closes_the_connection_and_reports_nothing(serve):
    runtime, client = serve(lambda recorded, transport: None)  # never answers
    collected = Collected()
    exchange = client.request(b"POST", b"/v1/x", b"", b"{}", collected)
    while not runtime.requests:
        yield task.deferLater(reactor, 0.005, lambda: None)
    exchange.abort()
    yield runtime.lost[0]
    yield task.deferLater(reactor, 0.02, lambda: None)
    assert not collected.done.called and client.idle == 0


@pytest_twisted.inlineCallbacks
def test_abort_mid_body_closes_the_connection_and_nothing_more_is_heard(serve):
    def script(recorded: Recorded, transport: Any) -> None:
        transport.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n" + chunk(b"data: 1\n\n"))

    runtime, client = serve(script)
    collected = Collected()
    exchange = client.request(b"POST", b"/v1/x", b"", b"{}", collected)
    collected.on_body = lambda data: exchange.abort()
    while not runtime.lost:
        yield task.deferLater(reactor, 0.005, lambda: None)
    yield runtime.lost[0]
    yield task.deferLater(reactor, 0.02, lambda: None)
    assert collected.body == [b"data: 1\n\n"] and not collected.done.called


@pytest_twisted.inlineCallbacks
def test_a_paused_exchange_reads_nothing_until_resumed(serve):
    writes: list[Any] = []

    def script(recorded: Recorded, transport: Any) -> None:
        transport.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n" + chunk(b"one"))
        writes.append(transport)

    runtime, client = serve(script)
    collected = Collected()
    exchange = client.request(b"POST", b"/v1/x", b"", b"{}", collected)
    collected.on_body = lambda data: exchange.pause()
    while not collected.body:
        yield task.deferLater(reactor, 0.005, lambda: None)
    writes[0].write(chunk(b"two") + b"0\r\n\r\n")
    yield task.deferLater(reactor, 0.05, lambda: None)
    assert collected.body == [b"one"] and not collected.done.called
    collected.on_body = None
    exchange.resume()
    yield collected.done
    assert collected.body == [b"one", b"two"] and collected.ended is True


@pytest_twisted.inlineCallbacks
def test_a_request_made_while_the_answer_ends_reuses_that_connection(serve):
    runtime, client = serve(json_answer)
    second = Collected()
    first = Collected()
    original = first.response_ended

    def chain(framed: bool) -> None:
        original(framed)
        client.request(b"POST", b"/v1/y", b"", b"{}", second)

    first.response_ended = chain  # type: ignore[method-assign]
    client.request(b"POST", b"/v1/x", b"", b"{}", first)
    yield second.done
    assert second.ended is True and runtime.connections == 1


def test_a_runtime_url_must_be_http_with_a_host() -> None:
    for url in ("ftp://h:1", "http://", "h:8000"):
        with pytest.raises(ValueError):
            RuntimeClient(reactor, url)


@pytest.mark.parametrize("url, host", [
    ("http://h:8000/v1", b"Host: h:8000"), ("http://h/", b"Host: h"), ("https://h:443", b"Host: h"),
    ("http://[::1]:81", b"Host: [::1]:81"),
])
def test_the_host_header_names_the_runtime_as_its_url_does(url: str, host: bytes) -> None:
    assert RuntimeClient(reactor, url)._host_line == b" HTTP/1.1\r\n" + host + b"\r\n"


@pytest_twisted.inlineCallbacks
def test_close_closes_idle_connections_at_once_and_the_others_when_their_answer_ends(serve):
    held: list[Any] = []

    def script(recorded: Recorded, transport: Any) -> None:
        if recorded.body == b"hold":
            held.append(transport)
        else:
            json_answer(recorded, transport)

    runtime, client = serve(script)
    running = post(client, body=b"hold")
    first = post(client, body=b"{}")
    yield first.done
    while not held:
        yield task.deferLater(reactor, 0.005, lambda: None)
    assert client.idle == 1 and runtime.connections == 2
    closed = client.close()
    idle = next(r.connection for r in runtime.requests if r.body == b"{}")
    yield runtime.lost[idle - 1]
    assert not closed.called and not running.done.called
    held[0].write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}")
    yield running.done
    yield closed
    assert running.ended is True and client.idle == 0
