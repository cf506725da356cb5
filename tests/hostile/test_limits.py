"""Resource limits: each exceeded limit gives its own error, and the process stays healthy.

Limits covered, and the error each gives:

- HTTP request body size (``max_body_size``): 413 with an OpenAI error body as
  soon as the body is known to be too large (``Content-Length`` at once, a
  chunked body when it grows past it), then the connection closes after a
  small drain allowance;
- HTTP header size (Twisted's ``totalHeadersSize``) and count: 400, connection closed;
- gRPC header list size (``max_header_list_size``): RESOURCE_EXHAUSTED for that
  call; past HPACK's own bound, the connection ends with GOAWAY;
- concurrent gRPC streams per connection (``max_concurrent_streams``): a
  client waits for a free stream; a stream past the limit (a client that
  ignores it, or has not seen it yet) is refused alone with REFUSED_STREAM,
  which the channel retries transparently;
- gRPC message size (``max_receive_message_length``): RESOURCE_EXHAUSTED for that call;
- held requests (``ProcessorConfig.max_waiting_tasks``): 503 with ``Retry-After``;
- tasks in flight per engine (``ProcessorConfig.max_in_flight_per_engine``): the
  next task waits in the queue and runs when a slot frees up;
- tasks per tenant (``ProcessorConfig.max_tasks_per_tenant``): 429 with
  ``Retry-After`` for that tenant alone;
- tasks queued in the engine agent (``AgentConfig.max_queued``): 503 from the
  agent, which the gateway retries on another engine;
- bytes buffered for a slow streaming client (``max_buffered_bytes``): that
  client alone is cut off and its task cancelled.

After each, a well-behaved request to the same gateway or connection succeeds.
"""

from __future__ import annotations

import json

import pytest
import pytest_twisted
from twisted.internet import defer, reactor, task
from twisted.internet.endpoints import TCP4ClientEndpoint
from twisted.internet.testing import StringTransport

from infx.gateway.auth import KeyStore
from infx.gateway.dispatcher import SendOutcome
from infx.http.site import REFUSED_BODY_DRAIN_BYTES, REFUSED_BODY_DRAIN_SECONDS
from infx.transport import CallKind, GrpcChannel, GrpcServer, ServerCall, listen_grpc
from protocol.agent.core import EngineAgentCore
from protocol.agent.effects import AgentConfig, SendResult, StartTask
from protocol.agent.echo import echo_task
from protocol.grpc import (
    CallEnded,
    CallLimitReached,
    CallStarted,
    ConnectionTerminated,
    EndCause,
    GrpcConfig,
    GrpcConnection,
    MessageReceived,
    StatusCode,
)
from protocol.pb import status_pb2, worker_pb2
from protocol.processor.core import Locality, ProcessorConfig
from tests.support.http_api import SITES
from tests.support.hostile import (
    CHAT,
    ECHO,
    JSON,
    EchoEngine,
    RawClient,
    Stack,
    assert_well_behaved_request_works,
    prefixed,
)

# -- HTTP request body and headers ------------------------------------------------------


@pytest.mark.parametrize("site", sorted(SITES))
def test_a_content_length_over_the_limit_is_413_at_once_and_the_connection_closes(site):
    """A declared 100 GiB body is refused as soon as the headers are in: not a byte of
    it needs to arrive, and the connection does not stay open for the rest."""
    stack = Stack(max_body_size=1_000, site=site)
    stack.engine()
    client = stack.connect()
    client.send(b"POST /v1/chat/completions HTTP/1.1\r\nHost: g\r\nContent-Length: %d\r\n"
                b"Expect: 100-continue\r\n\r\n" % (100 << 30))
    (response,) = client.responses()
    assert response.status == 413 and response.error()["code"] == "request_too_large"
    assert b"107374182400 bytes" in response.body
    assert response.headers[b"connection"] == b"close"
    # Within the drain allowance the rest is read and dropped; past it, the connection closes.
    client.send(b"x" * 1_000)
    assert client.open
    client.send(b"x" * REFUSED_BODY_DRAIN_BYTES)
    assert not client.open
    assert client.responses() == []
    assert_well_behaved_request_works(stack, stack.connect())


@pytest.mark.parametrize("site", sorted(SITES))
def test_a_refused_body_that_never_ends_is_cut_off_after_the_drain_time(site):
    stack = Stack(max_body_size=1_000, site=site)
    client = stack.connect()
    client.send(b"POST /v1/chat/completions HTTP/1.1\r\nHost: g\r\nContent-Length: 5000\r\n\r\n" + b"x" * 100)
    assert client.responses()[0].status == 413
    stack.settle(REFUSED_BODY_DRAIN_SECONDS - 0.1)
    assert client.open
    stack.settle(0.2)
    assert not client.open


@pytest.mark.parametrize("site", sorted(SITES))
def test_a_body_just_over_the_limit_is_answered_once_and_the_connection_closes(site):
    """The whole refused body arrives within the drain allowance: one 413, no second
    answer from the handler, and the connection closes."""
    stack = Stack(max_body_size=1_000, site=site)
    stack.engine()
    client = stack.connect()
    client.request("/v1/chat/completions", b"x" * 5_000, JSON)
    stack.settle(1)
    (response,) = client.responses()
    assert response.status == 413 and response.error()["code"] == "request_too_large"
    assert not client.open


@pytest.mark.parametrize("site", sorted(SITES))
def test_an_endless_chunked_body_is_413_once_it_grows_over_the_limit_and_the_connection_closes(site):
    """No Content-Length to refuse up front: the body is counted as it arrives, and
    the 413 goes out the moment it passes the limit, long before any end."""
    stack = Stack(max_body_size=1_000, site=site)
    stack.engine()
    client = stack.connect()
    client.send(b"POST /v1/chat/completions HTTP/1.1\r\nHost: g\r\nTransfer-Encoding: chunked\r\n\r\n")
    chunk = b"%x\r\n%s\r\n" % (400, b"y" * 400)
    for _ in range(3):
        client.send(chunk)
    (response,) = client.responses()
    assert response.status == 413 and response.error()["message"]
    while client.open:
        client.send(chunk * 64)
    assert stack.processor.counters.accepted == 0
    assert_well_behaved_request_works(stack, stack.connect())


@pytest.mark.parametrize("headers,answered", [
    (b"".join(b"X-Big-%d: %s\r\n" % (i, b"v" * 2_000) for i in range(10)), True),
    (b"".join(b"X-H%d: v\r\n" % i for i in range(600)), True),
    (b"X-Line: " + b"v" * 20_000 + b"\r\n", False),
], ids=["header bytes", "header count", "one line over 16 KiB"])
@pytest.mark.parametrize("site", sorted(SITES))
def test_too_many_header_bytes_or_headers_is_400_and_other_clients_are_served(headers, answered, site):
    """Over 16 KiB of headers or 500 of them: 400 and the connection closes;
    a single line too long to buffer closes the connection without an answer."""
    stack = Stack(site=site)
    stack.engine()
    client = stack.connect()
    client.send(b"POST /v1/chat/completions HTTP/1.1\r\nHost: g\r\n" + headers + b"Content-Length: 0\r\n\r\n")
    stack.settle(1)
    assert [r.status for r in client.responses()] == ([400] if answered else [])
    assert not client.open
    assert not stack.gateway.active_calls
    assert_well_behaved_request_works(stack)


# -- gRPC header list size -------------------------------------------------------------------


def test_a_header_list_over_the_limit_ends_that_call_and_one_past_hpacks_bound_ends_the_connection():
    """Between max_header_list_size and HPACK's hard bound (4x, at least 64 KiB)
    only the call ends (RESOURCE_EXHAUSTED) and the connection serves the next
    call; beyond the hard bound the header block cannot even be decoded
    safely, so the connection ends with GOAWAY."""
    server = GrpcConnection(GrpcConfig(client_side=False, max_header_list_size=2_048))
    raw = RawClient(server)
    big = raw.request([(b"x-big", b"v" * 3_000)], end_stream=True)
    good = raw.request(end_stream=True)
    raw.exchange()
    assert raw.status_of(big) == b"8"
    assert good in {e.stream_id for e in raw.server_events if isinstance(e, CallStarted)}
    huge = raw.request([(b"x-big", b"v" * 70_000)], end_stream=True)
    raw.exchange()
    (terminated,) = [e for e in raw.server_events if isinstance(e, ConnectionTerminated)]
    assert terminated.error_code != 0
    assert huge not in {e.stream_id for e in raw.server_events if isinstance(e, CallStarted)}
    ends = [e for e in raw.server_events if isinstance(e, CallEnded) and e.stream_id == good]
    assert [e.status for e in ends] == [StatusCode.UNAVAILABLE]


# -- gRPC concurrent streams ----------------------------------------------------------------


def test_a_client_machine_stops_at_the_peers_stream_limit_until_a_call_ends():
    server = GrpcConnection(GrpcConfig(client_side=False, max_concurrent_streams=2))
    client = GrpcConnection(GrpcConfig(client_side=True))
    server.initiate(0)
    client.initiate(0)
    for _ in range(3):
        server.receive_data(client.data_to_send(), 0)
        client.receive_data(server.data_to_send(), 0)
    assert client.max_concurrent_calls == 2
    first = client.start_call("/s/M", now=0)
    client.start_call("/s/M", now=0)
    with pytest.raises(CallLimitReached):
        client.start_call("/s/M", now=0)
    client.end_stream(first)
    server.receive_data(client.data_to_send(), 0)
    server.send_status(first, StatusCode.OK)
    client.receive_data(server.data_to_send(), 0)
    assert client.start_call("/s/M", now=0) > first


def test_a_stream_past_the_limit_is_refused_alone_and_the_connection_keeps_serving():
    """A client that ignores SETTINGS_MAX_CONCURRENT_STREAMS (or has not seen
    it yet) gets RST_STREAM(REFUSED_STREAM) for the extra stream, the stream
    error RFC 9113 5.1.2 asks for: UNAVAILABLE, safe to retry. Its other
    calls, its connection and the other connections carry on."""
    clock = task.Clock()
    server = GrpcServer(clock, GrpcConfig(client_side=False, max_concurrent_streams=2))
    server.add_method("/t.S/Echo", _echo, kind=CallKind.STREAM_STREAM)
    polite = _Connection(server)
    rude = _Connection(server)
    polite_call = polite.client.start_call("/t.S/Echo", now=0)
    polite.client.send_message(polite_call, b"abc")
    polite.flush()
    # The rude client pretends it never saw the server's limit.
    rude.client._h2.remote_settings._settings[3] = [100]
    first, second, third = (rude.client.start_call("/t.S/Echo", now=0) for _ in range(3))
    rude.flush()
    clock.advance(0)
    refused = [e for e in rude.events if isinstance(e, CallEnded)]
    assert [(e.stream_id, e.status, e.cause) for e in refused] == [(third, StatusCode.UNAVAILABLE, EndCause.REFUSED)]
    assert not rude.transport.disconnecting
    rude.client.send_message(first, b"xyz")
    rude.client.end_stream(first)
    rude.flush()
    clock.advance(0)
    rude.flush()
    assert [e.data for e in rude.events if isinstance(e, MessageReceived)] == [b"zyx"]
    polite.client.end_stream(polite_call)
    polite.flush()
    clock.advance(0)
    polite.flush()
    assert [e.data for e in polite.events if isinstance(e, MessageReceived)] == [b"cba"]
    assert [e.status for e in polite.events if isinstance(e, CallEnded)] == [StatusCode.OK]
    assert not polite.transport.disconnecting


async def _echo(call: ServerCall) -> None:
    async for message in call:
        await call.send(message[::-1])


class _Connection:
    """A client machine wired to one server protocol over a StringTransport."""

    def __init__(self, server: GrpcServer) -> None:
        self.protocol = server.buildProtocol(None)
        self.transport = StringTransport()
        self.protocol.makeConnection(self.transport)
        self.client = GrpcConnection(GrpcConfig(client_side=True))
        self.client.initiate(0)
        self.events: list[object] = []
        self.flush()

    def flush(self) -> None:
        for _ in range(10):
            data = self.client.data_to_send()
            if data and not self.transport.disconnecting:
                self.protocol.dataReceived(data)
            reply = self.transport.value()
            self.transport.clear()
            if reply:
                self.events += self.client.receive_data(reply, 0)
            if not data and not reply:
                return


@pytest_twisted.ensureDeferred
async def test_calls_past_the_stream_limit_wait_for_a_free_stream_over_loopback():
    """Over real sockets: with a limit of 2 streams, 6 concurrent calls on one
    channel all complete; the channel queues what the connection cannot take."""
    server = GrpcServer(reactor, GrpcConfig(client_side=False, max_concurrent_streams=2))
    running = []
    peak = []

    async def slow_echo(request: bytes, call: ServerCall) -> bytes:
        running.append(call)
        peak.append(len(running))
        await task.deferLater(reactor, 0.02, lambda: None)
        running.remove(call)
        return request[::-1]

    server.add_method("/t.S/Slow", slow_echo)
    port = await listen_grpc(reactor, "tcp:0:interface=127.0.0.1", server)
    channel = GrpcChannel(reactor, TCP4ClientEndpoint(reactor, "127.0.0.1", port.getHost().port))
    try:
        # One call first, so the server's SETTINGS (and its limit) have arrived:
        # see the race test below for a burst on a fresh connection.
        assert await _unary(channel, b"warm") == b"mraw"
        peak.clear()
        replies = await defer.gatherResults(
            [defer.ensureDeferred(_unary(channel, b"%d" % i)) for i in range(6)])
        assert replies == [(b"%d" % i)[::-1] for i in range(6)]
        assert max(peak) <= 2
    finally:
        await channel.close()
        await port.stopListening()


async def _unary(channel: GrpcChannel, request: bytes) -> bytes:
    return await channel.unary("/t.S/Slow", request, timeout=10)


# -- gRPC message size ------------------------------------------------------------------------


def test_a_message_over_the_receive_limit_ends_its_call_and_the_next_call_works():
    server = GrpcConnection(GrpcConfig(client_side=False, max_receive_message_length=100))
    raw = RawClient(server)
    big = raw.request()
    raw.h2.send_data(big, prefixed(b"x" * 101), end_stream=True)
    good = raw.request()
    raw.h2.send_data(good, prefixed(b"x" * 100), end_stream=True)
    raw.exchange()
    assert raw.status_of(big) == b"8"
    assert [e.data for e in raw.server_events if isinstance(e, MessageReceived)] == [b"x" * 100]


# -- held requests ----------------------------------------------------------------------------


def test_requests_past_the_waiting_limit_get_503_with_retry_after_and_others_are_served():
    """Tasks wait for an engine that is not ready yet; past ``max_waiting_tasks``
    a new one fails at once with 503 and Retry-After (the answer is written
    even though the refusal happens inside submit); models with a ready
    engine are still served; the held ones get 503 at the queue timeout."""
    stack = Stack(processor=ProcessorConfig(queue_timeout=5, max_waiting_tasks=2, busy_retry_after=7))
    stack.engine("ready", models=("m",))
    stack.dispatcher.engine_status(object(), "default", status_pb2.EngineStatus(
        engine_id="loading", ready=True, models=[status_pb2.EngineStatus.Model(id="w", is_ready=False)]),
        Locality.LOCAL)
    held = [stack.connect() for _ in range(2)]
    wait_body = CHAT.replace(b'"m"', b'"w"')
    for client in held:
        client.request("/v1/chat/completions", wait_body, JSON)
    stack.settle()
    assert stack.processor.waiting_counts() == {("default", "w"): 2}
    refused = stack.connect().exchange("/v1/chat/completions", wait_body, JSON)
    assert refused.status == 503 and refused.headers[b"retry-after"] == b"7"
    assert "waiting" in refused.error()["message"]
    assert_well_behaved_request_works(stack)
    stack.settle(6)
    for client in held:
        (response,) = client.responses()
        assert response.status == 503 and response.error()
    assert not stack.gateway.active_calls


# -- tasks in flight per engine ---------------------------------------------------------------


def test_a_task_past_the_engine_cap_waits_and_succeeds_once_a_slot_frees_while_other_engines_serve():
    """With one task allowed per engine, a second request for the same model waits in
    the queue instead of piling onto the engine, and gets its 200 after the first ends;
    a request for a model of another engine is served meanwhile."""
    stack = Stack(processor=ProcessorConfig(queue_timeout=5, max_task_duration=60, max_in_flight_per_engine=1))
    busy = stack.engine("busy", models=("m",))
    other = stack.engine("other", models=("n",))
    first, second = stack.connect(), stack.connect()
    first.request("/v1/chat/completions", CHAT, JSON)
    second.request("/v1/chat/completions", CHAT, JSON)
    assert len(busy.tasks) == 1
    assert stack.processor.waiting_counts() == {("default", "m"): 1}
    served = stack.connect().exchange("/v1/chat/completions", CHAT.replace(b'"m"', b'"n"'), JSON)
    assert served.status == 200 and len(other.tasks) == 1
    stack.settle(1)
    for client in (first, second):
        (response,) = client.responses()
        assert response.status == 200
        assert json.loads(response.body)["choices"][0]["message"]["content"] == "hello there"
    assert len(busy.tasks) == 2
    assert not stack.gateway.active_calls and stack.processor.status()["tasks"] == 0


# -- tasks per tenant -----------------------------------------------------------------------


def test_a_tenant_at_its_task_cap_gets_429_with_retry_after_and_another_tenant_is_served():
    """Tenant "a" holds two tasks (its engine has not answered); its third request
    is refused at once with 429 and Retry-After, while tenant "b" is served; once
    a's requests end, a is served again."""
    keys = KeyStore.from_mapping({"keys": [{"key": "sk-a", "tenant": "a"}, {"key": "sk-b", "tenant": "b"}]})
    stack = Stack(keys=keys, processor=ProcessorConfig(
        queue_timeout=5, max_task_duration=60, max_tasks_per_tenant=2, busy_retry_after=3))
    slow = stack.engine("a1", tenant="a", hold=True)
    stack.engine("b1", tenant="b")
    as_a, as_b = {**JSON, "authorization": "Bearer sk-a"}, {**JSON, "authorization": "Bearer sk-b"}
    held = [stack.connect() for _ in range(2)]
    for client in held:
        client.request("/v1/chat/completions", CHAT, as_a)
    stack.settle(1)
    assert len(slow.tasks) == 2
    refused = stack.connect().exchange("/v1/chat/completions", CHAT, as_a)
    assert refused.status == 429 and refused.headers[b"retry-after"] == b"3"
    assert "too many tasks" in refused.error()["message"]
    for _ in range(3):
        assert stack.connect().exchange("/v1/chat/completions", CHAT, as_b).status == 200
    for client in held:  # the clients give up: their tasks end, and tenant "a" has room again
        client.transport.loseConnection()
    stack.settle(0)
    slow.hold = False
    assert stack.connect().exchange("/v1/chat/completions", CHAT, as_a).status == 200
    assert not stack.gateway.active_calls


# -- tasks queued in the engine agent ------------------------------------------------------------


def test_a_task_past_the_agents_queue_bound_is_retried_by_the_gateway_on_another_engine():
    """Local engine "full" (the real agent core) runs one task and queues one more; a third
    sent to it is answered 503 by the agent at once, and the gateway retries it on the
    remote engine "spare" (local engines are preferred, so it got none before): every
    client gets its 200, and the agent never holds more than its bound."""
    stack = Stack(processor=ProcessorConfig(queue_timeout=5, max_task_duration=60, retry_delay=0))
    full = _AgentRoute(stack, AgentConfig(engine_id="full", models=("m",), max_concurrency=1, max_queued=1))
    spare = EchoEngine(stack)
    for route, engine_id, locality in ((full, "full", Locality.LOCAL), (spare, "spare", Locality.REMOTE)):
        stack.dispatcher.engine_status(route, "default", status_pb2.EngineStatus(
            engine_id=engine_id, ready=True, models=[status_pb2.EngineStatus.Model(id="m", is_ready=True)]), locality)
    clients = [stack.connect() for _ in range(3)]
    for client in clients:
        client.request("/v1/chat/completions", CHAT, JSON)
    assert (full.core.running, full.core.queued) == (1, 1)
    stack.settle(1)
    assert full.refused == 1 and full.most_held == 2
    assert len(spare.tasks) == 1
    for client in clients:
        (response,) = client.responses()
        assert response.status == 200
        assert json.loads(response.body)["choices"][0]["message"]["content"] == "hello there"
    assert not stack.gateway.active_calls and stack.processor.status()["tasks"] == 0


class _AgentRoute:
    """An engine stream served by the real engine agent core, its runtime the echo core,
    on the stack's clock (what :class:`infx.agent.engine.EngineAgent` does over gRPC)."""

    def __init__(self, stack: Stack, config: AgentConfig) -> None:
        self.stack = stack
        self.core = EngineAgentCore(config)
        self.core.start(stack.clock.seconds())
        self.refused = 0
        self.most_held = 0

    def send_task(self, task_: worker_pb2.Task, tenant_id: str) -> SendOutcome:
        self._perform(self.core.task_received(1, task_, self.stack.clock.seconds()))
        self.most_held = max(self.most_held, self.core.in_progress)
        return SendOutcome.SENT

    def withdraw_task(self, wire_id: str) -> bool:
        return False  # a task sent here is taken by the agent at once

    def close(self, reason: str) -> None:
        raise AssertionError(f"the gateway closed the agent's stream: {reason}")

    def _perform(self, effects: list[object]) -> None:
        for effect in effects:
            if isinstance(effect, SendResult):
                if effect.result.http_response.status_code == 503:
                    self.refused += 1
                self.stack.clock.callLater(0, self.stack.dispatcher.result_received, self, effect.result)
            elif isinstance(effect, StartTask):
                scheduled = echo_task(effect.task, ECHO, 0.0)
                for n, item in enumerate(scheduled):
                    self.stack.clock.callLater(item.due, self._result, effect.task.id, item.result,
                                               n == len(scheduled) - 1)

    def _result(self, task_id: str, result: worker_pb2.TaskResult, last: bool) -> None:
        sent = self.core.send_result(task_id, result)
        self._perform([sent] if sent is not None else [])
        if last:
            self._perform(self.core.finish_task(task_id, self.stack.clock.seconds()))


# -- bytes buffered for a slow client ----------------------------------------------------------


@pytest.mark.parametrize("site", sorted(SITES))
def test_a_slow_streaming_client_is_cut_off_alone_once_its_buffer_is_full(site):
    """The client stops reading (its transport pauses the channel) while the
    engine streams: once more than ``max_buffered_bytes`` wait for it, that
    client alone is cut off and its task cancelled on the engine."""
    stack = Stack(max_buffered_bytes=2_000, site=site)
    engine = stack.engine()
    slow = stack.connect()
    words = " ".join(["word"] * 400)
    body = json.dumps({"model": "m", "stream": True, "messages": [{"role": "user", "content": words}]}).encode()
    slow.request("/v1/chat/completions", body, JSON)
    stack.clock.advance(0)
    slow.transport.producer.pauseProducing()
    stack.settle(1)
    assert slow.transport.disconnected  # aborted, not closed politely
    assert stack.metrics.slow_clients._value.get() == 1
    assert [t.request.cancel_task.task_id for t in engine.tasks if t.request.HasField("cancel_task")] == \
        [engine.tasks[0].id]
    assert not stack.gateway.active_calls and stack.processor.status()["tasks"] == 0
    assert_well_behaved_request_works(stack)


@pytest.mark.parametrize("site", sorted(SITES))
def test_a_streaming_client_that_reads_gets_everything(site):
    """The same stream to a client that keeps reading is delivered whole (the
    bound is on what waits, not on the size of the stream)."""
    stack = Stack(max_buffered_bytes=2_000, site=site)
    stack.engine()
    client = stack.connect()
    words = " ".join(["word"] * 400)
    body = json.dumps({"model": "m", "stream": True, "messages": [{"role": "user", "content": words}]}).encode()
    client.request("/v1/chat/completions", body, JSON)
    stack.settle(10)
    (response,) = client.responses()
    assert response.status == 200 and response.body.endswith(b"data: [DONE]\n\n")
    assert response.body.count(b'"content":"word') == 400
    assert stack.metrics.slow_clients._value.get() == 0



@pytest_twisted.ensureDeferred
async def test_a_burst_of_calls_on_a_fresh_connection_is_not_lost_to_the_settings_race():
    """Calls started before the server's SETTINGS arrive may exceed its stream
    limit: the extra streams are refused (REFUSED_STREAM) and the channel
    retries them transparently, so every call succeeds."""
    server = GrpcServer(reactor, GrpcConfig(client_side=False, max_concurrent_streams=2))
    server.add_method("/t.S/Slow", _reverse)
    port = await listen_grpc(reactor, "tcp:0:interface=127.0.0.1", server)
    channel = GrpcChannel(reactor, TCP4ClientEndpoint(reactor, "127.0.0.1", port.getHost().port))
    try:
        results = await defer.DeferredList(
            [defer.ensureDeferred(_unary(channel, b"%d" % i)) for i in range(6)], consumeErrors=True)
        assert all(ok for ok, _ in results), [r for ok, r in results if not ok][:1]
    finally:
        await channel.close()
        await port.stopListening()


def _reverse(request: bytes, call: ServerCall) -> bytes:
    return request[::-1]
