"""Spliced streams: a runtime by URL's streamed answer goes from its connection to the client's, past the
processor, once its head is delivered (:mod:`infx.gateway.in_process`). The gateway runs in process in
front of a twisted.web runtime on loopback; what reaches the processor is counted at the dispatcher."""

from __future__ import annotations

import json
import socket
from typing import Any

import openai
import pytest
import pytest_twisted
from twisted.internet import defer, reactor, task, threads
from twisted.web import resource, server

from infx.config import build_config
from infx.service import build_gateway

MODEL = "m"
#: A slow client's stream: large enough to fill the sockets between it and the gateway.
SLOW_EVENTS, SLOW_EVENT_BYTES = 400, 8192


def chunk(content: str, **extra: Any) -> bytes:
    body = {"id": "c1", "object": "chat.completion.chunk", "created": 1, "model": MODEL,
            "choices": [{"index": 0, "delta": {"content": content}, "finish_reason": None}], **extra}
    return b"data: " + json.dumps(body).encode() + b"\n\n"


#: The usage chunk a runtime sends last when asked to (``stream_options.include_usage``).
USAGE = b"data: " + json.dumps({"id": "c1", "object": "chat.completion.chunk", "created": 1, "model": MODEL,
                                "choices": [], "usage": {"prompt_tokens": 40, "completion_tokens": 3,
                                                         "total_tokens": 43,
                                                         "prompt_tokens_details": {"cached_tokens": 32}}}).encode() \
    + b"\n\n"


class Runtime(resource.Resource):
    """Streams the words of the last message one event each, 10 ms apart, then the usage chunk and
    ``[DONE]``; ``many`` streams SLOW_EVENTS large events, one reactor turn apart."""

    isLeaf = True

    def __init__(self) -> None:
        super().__init__()
        self.finished = 0

    def render_GET(self, request: server.Request) -> bytes:
        request.setHeader(b"content-type", b"application/json")
        if request.path == b"/v1/models":
            return json.dumps({"object": "list", "data": [{"id": MODEL, "object": "model"}]}).encode()
        return b"{}"

    def render_POST(self, request: server.Request) -> int:
        body = json.loads(request.content.read())
        text = body["messages"][-1]["content"]
        request.setHeader(b"content-type", b"text/event-stream")
        events = ([chunk(f"{n:05d}" + "x" * SLOW_EVENT_BYTES) for n in range(SLOW_EVENTS)] if text == "many"
                  else [chunk(word + " ") for word in text.split()] + [USAGE])
        events.append(b"data: [DONE]\n\n")

        def write(rest: list[bytes]) -> None:
            request.write(rest[0])
            if len(rest) == 1:  # the last event and the response's end together, as runtimes write them
                request.finish()
                self.finished += 1
                return
            reactor.callLater(0 if text == "many" else 0.01, write, rest[1:])

        write(events)
        return server.NOT_DONE_YET


@pytest.fixture
def stack():
    runtime = Runtime()
    port = reactor.listenTCP(0, server.Site(runtime), interface="127.0.0.1")
    config = build_config({}, {"http": "tcp:0:interface=127.0.0.1", "worker_grpc": "tcp:0:interface=127.0.0.1",
                               "internal_grpc": "tcp:0:interface=127.0.0.1", "grace_period": 5,
                               "runtime_url": [f"http://127.0.0.1:{port.getHost().port}={MODEL}"]})
    gateway = build_gateway(reactor, config)
    pytest_twisted.blockon(defer.maybeDeferred(gateway.startService))
    # What reaches the processor from the runtime's engine, as (kind, data) per result.
    results: list[tuple[str, bytes]] = []
    deliver = gateway.dispatcher.result_received

    def counted(route: Any, result: Any) -> None:
        kind = result.WhichOneof("message")
        results.append((kind, bytes(result.server_sent_event.data) if kind == "server_sent_event" else b""))
        deliver(route, result)

    gateway.dispatcher.result_received = counted
    pytest_twisted.blockon(until(lambda: gateway.dispatcher.models("default") == [MODEL], "the runtime's model"))
    yield runtime, gateway, results
    pytest_twisted.blockon(gateway.stopService())
    pytest_twisted.blockon(defer.maybeDeferred(port.stopListening))


@defer.inlineCallbacks
def until(predicate: Any, what: str) -> Any:
    for _ in range(1000):
        value = predicate()
        if value:
            return value
        yield task.deferLater(reactor, 0.01, lambda: None)
    raise AssertionError(f"timed out waiting for {what}")


def http_port(gateway: Any) -> int:
    return int(gateway.http.port.getHost().port)


def prompt_cache(gateway: Any) -> tuple[int, int, int] | None:
    """The engine's prompt cache counts as its last status reported them, once it has any."""
    report, = gateway.dispatcher.processor.engine_reports("default")
    cache = report.status.models[0].infx_prompt_cache
    return (cache.answers, cache.prompt_tokens, cache.cached_tokens) if cache.answers else None


@pytest_twisted.inlineCallbacks
def test_a_streamed_answer_passes_the_processor_by_but_its_head_its_usage_and_its_end(stack):
    runtime, gateway, results = stack

    def ask() -> list[Any]:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{http_port(gateway)}/v1", api_key="x", max_retries=0)
        return list(client.chat.completions.create(model=MODEL, stream=True, stream_options={"include_usage": True},
                                                    messages=[{"role": "user", "content": "one two three four"}]))

    chunks = yield threads.deferToThread(ask)
    assert "".join(c.choices[0].delta.content for c in chunks if c.choices) == "one two three four "
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == 32
    # The head, what holds the usage event (with any event read together with it) and the end:
    # what held no usage, the first words at least, was handed to the client directly.
    assert results[0][0] == "http_response" and results[-1] == ("server_sent_event", b"")
    middle = [data for _, data in results[1:-1]]
    assert middle and all(b'"cached_tokens"' in data for data in middle)
    assert USAGE in b"".join(middle) and not any(b'"one ' in data for data in middle)
    # The engine's core still counted the usage, as without the splice.
    assert (yield until(lambda: prompt_cache(gateway), "the engine's prompt cache counts")) == (1, 40, 32)
    yield until(lambda: gateway.dispatcher.status()["tasks"] == 0, "no task left")


def ask_without_reading(port: int) -> socket.socket:
    """POST a stream for ``many`` on a socket whose receive window is a few KiB; nothing read yet."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", port))
    body = json.dumps({"model": MODEL, "stream": True, "messages": [{"role": "user", "content": "many"}]}).encode()
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer x\r\n"
                 b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
    return sock


def read_all(sock: socket.socket) -> bytes:
    """The whole answer on ``sock``: its body, de-chunked."""
    data = b""
    while not data.endswith(b"\r\n0\r\n\r\n"):
        piece = sock.recv(1 << 16)
        assert piece, "the gateway closed the connection before the stream's end"
        data += piece
    sock.close()
    head, chunked = data.split(b"\r\n\r\n", 1)
    assert head.startswith(b"HTTP/1.1 200"), head
    out = b""
    while True:
        size, chunked = chunked.split(b"\r\n", 1)
        if int(size, 16) == 0:
            return out
        out, chunked = out + chunked[:int(size, 16)], chunked[int(size, 16) + 2:]


@pytest_twisted.inlineCallbacks
def test_a_client_that_falls_behind_gets_the_rest_the_usual_way_and_every_event_in_order(stack):
    runtime, gateway, results = stack
    sock = yield threads.deferToThread(ask_without_reading, http_port(gateway))
    yield until(lambda: runtime.finished, "the runtime to finish its stream")
    body = yield threads.deferToThread(read_all, sock)
    expected = b"".join(chunk(f"{n:05d}" + "x" * SLOW_EVENT_BYTES) for n in range(SLOW_EVENTS)) + b"data: [DONE]\n\n"
    assert body == expected
    queued = [data for kind, data in results if kind == "server_sent_event" and data]
    # Once the client was behind, events were buffered through the processor, in their order.
    assert queued, "no event went the usual way: the client never fell behind"
    assert len(queued) < SLOW_EVENTS, "no event was spliced"
    assert [expected.index(data) for data in queued] == sorted(expected.index(data) for data in queued)
    yield until(lambda: gateway.dispatcher.status()["tasks"] == 0, "no task left")
