"""The gateway's resource tree mounted in a plain ``twisted.web`` Site (issue #14).

``GatewayService.http_resource`` is meant to be mounted inside another
Twisted application. There the requests are plain ``server.Request`` objects,
not :class:`~infx.http.site.GatewayRequest`: chat requests must still work, and
the body limit must still hold (the host site buffers the body; the handler
refuses it with 413).
"""

from __future__ import annotations

import http.client
import json
from collections.abc import Iterator
from typing import Any

import pytest
import pytest_twisted
from twisted.internet import reactor, task, threads
from twisted.web import resource, server

from infx.config import build_config
from infx.service import GatewayService, build_gateway

LOOPBACK_OPTIONS = {name: "tcp:0:interface=127.0.0.1" for name in ("http", "worker_grpc", "internal_grpc")}


@pytest.fixture
def plain_site() -> Iterator[tuple[GatewayService, int]]:
    config = build_config({"echo_models": "m", "echo_token_delay": 0, "max_body_size": 10_000}, LOOPBACK_OPTIONS)
    service = build_gateway(reactor, config)
    service.startService()
    root = resource.Resource()
    root.putChild(b"infx", service.http_resource)
    port = reactor.listenTCP(0, server.Site(root), interface="127.0.0.1")
    yield service, port.getHost().port
    pytest_twisted.blockon(port.stopListening())
    pytest_twisted.blockon(service.stopService())


def post(port: int, path: str, body: bytes) -> tuple[int, dict[str, Any]]:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        connection.request("POST", path, body, {"content-type": "application/json"})
        response = connection.getresponse()
        return response.status, json.loads(response.read())
    finally:
        connection.close()


@pytest_twisted.inlineCallbacks
def test_chat_works_and_an_oversized_body_gets_413_under_a_plain_site(plain_site):
    service, port = plain_site
    for _ in range(500):
        if service.dispatcher.models("default"):
            break
        yield task.deferLater(reactor, 0.02, lambda: None)
    chat = json.dumps({"model": "m", "messages": [{"role": "user", "content": "plain site"}]}).encode()
    status, body = yield threads.deferToThread(post, port, "/infx/v1/chat/completions", chat)
    assert status == 200, body
    assert "plain site" in body["choices"][0]["message"]["content"]
    padded = json.dumps({"model": "m", "messages": [{"role": "user", "content": "x" * 20_000}]}).encode()
    status, body = yield threads.deferToThread(post, port, "/infx/v1/chat/completions", padded)
    assert status == 413 and body["error"]["code"] == "request_too_large"
    assert service.processor.counters.accepted == 1
