"""The engine agent dials its runtime through endpoints built once (infx.agent.runtimes.RuntimeEndpoints)."""

from __future__ import annotations

import pytest
import pytest_twisted
from twisted.internet import reactor
from twisted.internet.endpoints import HostnameEndpoint, TCP4ServerEndpoint
from twisted.web import resource, server
from twisted.web.client import URI, HTTPConnectionPool, readBody
from twisted.web.error import SchemeNotSupported

from infx.agent.runtimes import RuntimeEndpoints, runtime_agent


class Hello(resource.Resource):
    isLeaf = True

    def render_GET(self, request: server.Request) -> bytes:
        return b"hello " + request.path


def test_one_endpoint_per_scheme_host_and_port_and_tls_for_https() -> None:
    endpoints = RuntimeEndpoints(reactor, connect_timeout=3)
    first = endpoints.endpointForURI(URI.fromBytes(b"http://127.0.0.1:8000/v1/chat/completions"))
    assert isinstance(first, HostnameEndpoint)
    assert endpoints.endpointForURI(URI.fromBytes(b"http://127.0.0.1:8000/v1/embeddings")) is first
    other = endpoints.endpointForURI(URI.fromBytes(b"http://127.0.0.1:8001/v1/embeddings"))
    assert other is not first
    secure = endpoints.endpointForURI(URI.fromBytes(b"https://127.0.0.1:8000/v1/embeddings"))
    assert secure is not first and not isinstance(secure, HostnameEndpoint)
    with pytest.raises(SchemeNotSupported):
        endpoints.endpointForURI(URI.fromBytes(b"ftp://127.0.0.1:8000/x"))


@pytest_twisted.inlineCallbacks
def test_the_runtime_agent_serves_requests_over_its_pool() -> None:
    port = yield TCP4ServerEndpoint(reactor, 0, interface="127.0.0.1").listen(server.Site(Hello()))
    pool = HTTPConnectionPool(reactor, persistent=True)
    try:
        agent = runtime_agent(reactor, pool, connect_timeout=5)
        base = f"http://127.0.0.1:{port.getHost().port}".encode()
        bodies = []
        for path in (b"/a", b"/b"):
            response = yield agent.request(b"GET", base + path)
            bodies.append((response.code, (yield readBody(response))))
        assert bodies == [(200, b"hello /a"), (200, b"hello /b")]
    finally:
        yield pool.closeCachedConnections()
        yield port.stopListening()
