"""HTTP/1.1 pipelining on the gateway's site, deterministically: ``Clock`` and ``StringTransport``.

A client may send requests without reading the answers (issue #22 item 6: 5,000
pipelined GETs slowed every other client while the gateway worked through them
in one go). :class:`~infx.gateway_site.GatewayChannel` answers them one per
reactor turn, parses none while the transport says the answers are not being
read, and closes the connection after ``MAX_PIPELINED_REQUESTS`` answered back
to back; a client that waits for each answer is never held back.
"""

from __future__ import annotations

from twisted.internet import task
from twisted.internet.address import IPv4Address
from twisted.internet.testing import StringTransport
from twisted.web import resource, server

import pytest

from infx.http.site import MAX_PIPELINED_REQUESTS
from tests.support.http_api import SITES


class Answers(resource.Resource):
    """``GET /now/N`` answers at once; ``GET /later/N`` once the test calls ``finish_later``."""

    isLeaf = True

    def __init__(self) -> None:
        super().__init__()
        self.later: list[server.Request] = []

    def render_GET(self, request: server.Request) -> bytes | int:
        if request.path.startswith(b"/later/"):
            self.later.append(request)
            return server.NOT_DONE_YET
        return b"answer " + request.path

    def render_POST(self, request: server.Request) -> bytes:
        return b"posted " + request.content.read()

    def finish_later(self) -> None:
        for request in self.later:
            request.write(b"answer " + request.path)
            request.finish()
        self.later = []


class Turns(task.Clock):
    """A Clock stepped one reactor iteration at a time: :meth:`turn` runs the calls due when it
    starts, and those they schedule for now wait for the next turn (as the reactor's do)."""

    def turn(self) -> None:
        due = [call for call in self.calls if call.getTime() <= self.seconds()]
        for call in due:
            if call in self.calls:  # not cancelled by an earlier one
                self.calls.remove(call)
                call.called = 1
                call.func(*call.args, **call.kw)


class Connection:
    """One client connection to a site (twisted.web's or the httptools one) on a Clock."""

    def __init__(self, site_class: type) -> None:
        self.clock = Turns()
        self.root = Answers()
        site = site_class(self.root, max_body_size=1 << 20, reactor=self.clock)
        self.protocol = site.buildProtocol(IPv4Address("TCP", "127.0.0.1", 1))
        self.transport = StringTransport()
        self.protocol.makeConnection(self.transport)

    def send(self, *paths: str) -> None:
        self.protocol.dataReceived(b"".join(b"GET %s HTTP/1.1\r\nHost: gw\r\n\r\n" % p.encode() for p in paths))

    def answers(self) -> list[bytes]:
        """The bodies answered so far, in order (with a Content-Length, or chunked)."""
        bodies = []
        for response in self._responses():
            head, body = response.split(b"\r\n\r\n", 1)
            if b"transfer-encoding: chunked" in head.lower():
                chunks = body.split(b"\r\n")
                body = b"".join(chunks[1::2])
            bodies.append(body)
        return bodies

    def _responses(self) -> list[bytes]:
        return [b"HTTP/1.1 " + part for part in self.transport.value().split(b"HTTP/1.1 ")[1:]]

    def closes(self) -> list[bool]:
        """Whether each answer so far said ``Connection: close``."""
        return [b"\r\nconnection: close\r\n" in part.split(b"\r\n\r\n", 1)[0].lower() for part in self._responses()]

    def turns(self, count: int) -> None:
        for _ in range(count):
            self.clock.turn()


@pytest.fixture(params=sorted(SITES))
def link(request) -> Connection:
    return Connection(SITES[request.param])


def test_pipelined_requests_are_answered_one_per_reactor_turn_and_reading_waits_meanwhile(link):
    """Between two pipelined answers the reactor serves others; the connection is not read
    while its requests wait."""
    link.send(*(f"/now/{n}" for n in range(4)))
    assert link.answers() == [b"answer /now/0"]
    assert link.transport.producerState == "paused"
    for n in range(1, 4):
        link.turns(1)
        assert link.answers() == [b"answer /now/%d" % i for i in range(n + 1)]
    assert link.transport.producerState == "producing"
    assert link.closes() == [False] * 4


def test_no_pipelined_request_is_parsed_while_the_answers_are_not_being_read(link):
    """The transport pauses its producer once its write buffer is over its bound (the client
    does not read): the waiting requests stay unparsed until it resumes."""
    link.send(*(f"/now/{n}" for n in range(4)))
    channel = link.transport.producer  # the channel, producing for its transport
    channel.pauseProducing()  # what the transport does when its write buffer is over its bound
    link.turns(10)
    assert link.answers() == [b"answer /now/0"]
    channel.resumeProducing()
    link.turns(10)
    assert len(link.answers()) == 4


def test_a_run_of_pipelined_answers_ends_at_the_cap_with_connection_close(link):
    """Requests sent without reading any answer get at most MAX_PIPELINED_REQUESTS answers;
    the last says ``Connection: close`` and the rest is dropped unread (a pipelining client
    sends them again, RFC 9112 9.3.2)."""
    link.send(*(f"/now/{n}" for n in range(5 * MAX_PIPELINED_REQUESTS)))
    link.turns(10 * MAX_PIPELINED_REQUESTS)
    assert link.answers() == [b"answer /now/%d" % n for n in range(MAX_PIPELINED_REQUESTS)]
    assert link.closes() == [False] * (MAX_PIPELINED_REQUESTS - 1) + [True]
    assert link.transport.disconnecting


def test_a_client_that_waits_for_each_answer_is_never_capped(link):
    for n in range(3 * MAX_PIPELINED_REQUESTS):
        link.send(f"/now/{n}")
        link.turns(1)
    assert len(link.answers()) == 3 * MAX_PIPELINED_REQUESTS
    assert not any(link.closes()) and not link.transport.disconnecting


def test_a_client_that_posts_bodies_and_waits_for_each_answer_is_never_capped(link):
    """A body that ends exactly where its request does leaves nothing waiting behind it."""
    for n in range(3 * MAX_PIPELINED_REQUESTS):
        body = b"body %d" % n
        link.protocol.dataReceived(b"POST /now/%d HTTP/1.1\r\nHost: gw\r\nContent-Length: %d\r\n\r\n%s"
                                   % (n, len(body), body))
        link.turns(1)
    assert link.answers()[-1] == b"posted body %d" % (3 * MAX_PIPELINED_REQUESTS - 1)
    assert len(link.answers()) == 3 * MAX_PIPELINED_REQUESTS
    assert not any(link.closes()) and not link.transport.disconnecting


def test_a_short_pipeline_starts_a_new_run_each_time_it_is_answered(link):
    """A client that pipelines a few requests, then reads them all, then sends a few more,
    never comes near the cap: each batch is a run of its own."""
    for batch in range(3 * MAX_PIPELINED_REQUESTS // 3):
        link.send(*(f"/now/{batch}-{n}" for n in range(3)))
        link.turns(5)
    assert len(link.answers()) == 3 * (3 * MAX_PIPELINED_REQUESTS // 3)
    assert not any(link.closes())


def test_requests_pipelined_behind_a_slow_answer_wait_for_it_then_go_one_per_turn(link):
    link.send("/later/0", "/now/1", "/now/2")
    link.turns(5)
    assert link.answers() == []
    link.root.finish_later()
    assert link.answers() == [b"answer /later/0"]
    link.turns(1)
    assert link.answers() == [b"answer /later/0", b"answer /now/1"]
    link.turns(1)
    assert len(link.answers()) == 3


def test_a_connection_lost_while_requests_wait_leaves_nothing_scheduled(link):
    link.send("/now/0", "/now/1")
    link.protocol.connectionLost(Exception("gone"))
    assert not [call for call in link.clock.getDelayedCalls() if call.getTime() <= link.clock.seconds()]
    link.turns(3)
    assert link.answers() == [b"answer /now/0"]
