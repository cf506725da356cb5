"""infx.agent.side_http.CappedBody: a body within its cap arrives whole; past it, the transfer
stops and the answer is truncated (health checks) or fails (load scrapes)."""

from twisted.internet.defer import Deferred
from twisted.python.failure import Failure
from twisted.internet.testing import StringTransport
from twisted.web.client import ResponseDone, ResponseFailed

from infx.agent.side_http import CappedBody


def _read(chunks, limit, truncate, end=ResponseDone()):
    done: Deferred[bytes] = Deferred()
    results = []
    done.addBoth(results.append)
    body = CappedBody(done, limit, truncate)
    transport = StringTransport()
    body.makeConnection(transport)
    for chunk in chunks:
        body.dataReceived(chunk)
    body.connectionLost(Failure(end))
    return results[0], transport


def test_a_body_within_the_cap_arrives_whole():
    result, transport = _read([b"ab", b"cd"], 4, truncate=False)
    assert result == b"abcd" and transport.producerState == "producing"


def test_past_the_cap_the_transfer_stops_and_a_check_takes_what_came():
    result, transport = _read([b"ab", b"cd", b"e"], 4, truncate=True)
    assert result == b"abcd" and transport.producerState == "stopped"


def test_past_the_cap_a_scrape_fails():
    result, transport = _read([b"ab", b"cde"], 4, truncate=False)
    assert isinstance(result, Failure) and result.check(ValueError)
    assert transport.producerState == "stopped"


def test_a_broken_transfer_fails_either_way():
    for truncate in (True, False):
        result, _ = _read([b"ab"], 4, truncate, end=ResponseFailed([]))
        assert isinstance(result, Failure) and result.check(ResponseFailed)
