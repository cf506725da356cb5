"""The httptools server's writes: an answer leaves at once, and small writes are not held back by Nagle."""

from __future__ import annotations

import socket

import pytest_twisted
from twisted.internet import reactor
from twisted.internet.defer import Deferred
from twisted.internet.endpoints import TCP4ServerEndpoint
from twisted.web import resource, server

from infx.http.lean import LeanSite


class _Chunked(resource.Resource):
    """Answers without a length, so chunked: the body and the last chunk are two writes."""

    isLeaf = True

    def render_GET(self, request: server.Request) -> int:
        request.write(b"hello")
        request.finish()
        return server.NOT_DONE_YET


@pytest_twisted.inlineCallbacks
def test_an_accepted_connection_has_tcp_nodelay_and_a_chunked_answer_arrives_whole():
    # Without TCP_NODELAY the last chunk, a second small write, waits for the client's delayed ACK.
    site = LeanSite(_Chunked())
    channels = []
    build = site.buildProtocol
    site.buildProtocol = lambda addr: channels.append(build(addr)) or channels[-1]
    port = yield TCP4ServerEndpoint(reactor, 0, interface="127.0.0.1").listen(site)
    client = socket.create_connection(("127.0.0.1", port.getHost().port))
    client.setblocking(False)
    try:
        client.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        received = b""
        while not received.endswith(b"0\r\n\r\n"):
            d = Deferred()
            reactor.callLater(0.01, d.callback, None)
            yield d
            try:
                received += client.recv(65536)
            except BlockingIOError:
                pass
        handle = channels[0].transport.getHandle()
        assert handle.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
        assert received.startswith(b"HTTP/1.1 200 OK\r\n")
        assert b"transfer-encoding: chunked" in received.lower()
        assert received.endswith(b"\r\n\r\n5\r\nhello\r\n0\r\n\r\n")
    finally:
        client.close()
        yield port.stopListening()


class _Sent:
    """A channel that keeps what the request sends, each send's buffers as a list."""

    def __init__(self) -> None:
        self.sends: list[list[bytes]] = []

    def send(self, buffers: list[bytes]) -> None:
        self.sends.append(list(buffers))


def test_a_chunk_goes_out_framed_the_same_whether_joined_into_one_buffer_or_not():
    """A small chunk (a stream's event) is one framed buffer, a large one three, uncopied: the same bytes."""
    from io import BytesIO

    from infx.http.lean import JOINED_CHUNK_BYTES, LeanRequest

    channel = _Sent()
    request = LeanRequest(channel, b"GET", b"/", b"HTTP/1.1", [], BytesIO(), True)  # type: ignore[arg-type]
    small, large = b"data: {}\n\n", b"x" * (JOINED_CHUNK_BYTES + 1)
    request.write(small)
    request.write(large)
    head, first = channel.sends[0][0], channel.sends[0][1:]
    assert b"transfer-encoding: chunked" in head.lower()
    assert first == [b"a\r\n" + small + b"\r\n"]
    assert channel.sends[1] == [b"%x\r\n" % len(large), large, b"\r\n"]
    assert channel.sends[1][1] is large
