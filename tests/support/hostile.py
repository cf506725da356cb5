"""The HTTP gateway over a StringTransport with echo engines, and a raw HTTP/2 gRPC client, for hostile-input tests."""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from typing import Any, Callable

import h2.config
import h2.connection
import h2.events
import h2.settings
from prometheus_client import CollectorRegistry
from twisted.internet import task
from twisted.internet.address import IPv4Address
from twisted.internet.error import ConnectionDone
from twisted.internet.testing import StringTransport
from twisted.python.failure import Failure

from infx.gateway.auth import KeyStore
from infx.gateway.dispatcher import Dispatcher, SendOutcome
from infx.gateway.metrics import GatewayMetrics
from infx.http.api import HttpApi
from infx.http.resources import build_resource
from protocol.agent.echo import EchoConfig, echo_task
from protocol.grpc import GrpcConnection
from protocol.pb import status_pb2, worker_pb2
from protocol.processor.core import Locality, Processor, ProcessorConfig


#: Streamed tokens 10 ms apart, so a stream spreads over clock time as a real one does.
ECHO = EchoConfig(token_delay=0.01)


@dataclass(eq=False)
class EchoEngine:
    """An engine route answering with the echo runtime core after the clock moves.

    ``answer`` may replace the echo runtime: it gets each task and returns the
    TaskResults to send (a hostile engine).
    """

    stack: Stack
    answer: Callable[[worker_pb2.Task], list[worker_pb2.TaskResult]] | None = None
    tasks: list[worker_pb2.Task] = field(default_factory=list)
    closed: bool = False
    hold: bool = False

    def send_task(self, task_: worker_pb2.Task, tenant_id: str) -> SendOutcome:
        if self.closed:
            return SendOutcome.GONE
        self.tasks.append(task_)
        if task_.request.WhichOneof("request") in ("cancel_task", "heartbeat", "go_away") or self.hold:
            return SendOutcome.SENT
        if self.answer is not None:
            scheduled = [(0.0, result) for result in self.answer(task_)]
        else:
            scheduled = [(r.due, r.result) for r in echo_task(task_, ECHO, 0.0)]
        for due, result in scheduled:
            self.stack.clock.callLater(due, self.stack.dispatcher.result_received, self, result)
        return SendOutcome.SENT

    def withdraw_task(self, wire_id: str) -> bool:
        return False  # a task sent here is never left queued

    def close(self, reason: str) -> None:
        self.closed = True


class Stack:
    """HttpApi, dispatcher and processor on one Clock; HTTP connections on StringTransports."""

    def __init__(self, *, max_body_size: int = 1 << 20, max_buffered_bytes: int = 1 << 20,
                 keys: KeyStore | None = None, processor: ProcessorConfig | None = None, site: str = "twisted") -> None:
        """``site``: which server of the tree (``tests.support.http_api.SITES``) the connections reach."""
        self.clock = task.Clock()
        self.clock.advance(1_000)  # a clock that does not start at 0, as a reactor's does not
        self.metrics = GatewayMetrics(CollectorRegistry())
        self.processor = Processor(processor or ProcessorConfig(queue_timeout=5, max_task_duration=60))
        self.dispatcher = Dispatcher(self.clock, self.processor, self.metrics)
        self.gateway = HttpApi(self.dispatcher, self.clock, self.metrics, keys, max_buffered_bytes=max_buffered_bytes)
        self.gateway.listening = True
        from tests.support.http_api import SITES

        self.site = SITES[site](build_resource(self.gateway), max_body_size=max_body_size, reactor=self.clock)
        self.clients: list[HttpClient] = []

    def engine(self, engine_id: str = "e1", models: tuple[str, ...] = ("m",), tenant: str = "default",
               **kwargs: Any) -> EchoEngine:
        engine = EchoEngine(self, **kwargs)
        status = status_pb2.EngineStatus(engine_id=engine_id, ready=True, models=[
            status_pb2.EngineStatus.Model(id=m, is_ready=True) for m in models])
        self.dispatcher.engine_status(engine, tenant, status, Locality.LOCAL)
        return engine

    def connect(self) -> HttpClient:
        client = HttpClient(self)
        self.clients.append(client)
        return client

    def reap(self) -> None:
        """A StringTransport never reports its own close: do it, as a reactor would."""
        for client in self.clients:
            if client.transport.disconnecting and not client.lost:
                client.lost = True
                client.protocol.connectionLost(Failure(ConnectionDone()))

    def settle(self, seconds: float = 0.0) -> None:
        """Let ``seconds`` pass, running every call that falls due on the way."""
        target = self.clock.seconds() + seconds
        self.clock.advance(0)
        self.reap()
        for _ in range(10_000):
            due = [c.getTime() for c in self.clock.getDelayedCalls() if c.getTime() <= target]
            if not due:
                break
            self.clock.advance(max(0.0, min(due) - self.clock.seconds()))
            self.reap()
        self.clock.advance(max(0.0, target - self.clock.seconds()))
        self.reap()


@dataclass
class Response:
    status: int
    headers: dict[bytes, bytes]
    body: bytes

    def error(self) -> dict[str, Any]:
        """The OpenAI error object of this response (asserting it has one)."""
        assert self.headers.get(b"content-type", b"").startswith(b"application/json"), self.headers
        document = json.loads(self.body)
        assert isinstance(document["error"]["message"], str)
        return document["error"]


class HttpClient:
    """One HTTP/1.1 connection to the site, fed by hand; parses what comes back."""

    def __init__(self, stack: Stack) -> None:
        self.stack = stack
        self.protocol = stack.site.buildProtocol(IPv4Address("TCP", "127.0.0.1", 1234))
        self.transport = StringTransport(peerAddress=IPv4Address("TCP", "127.0.0.1", 1234))
        self.protocol.makeConnection(self.transport)
        self._buffer = b""
        self.lost = False

    def send(self, data: bytes) -> None:
        self.protocol.dataReceived(data)
        self.stack.reap()

    def request(self, path: str, body: bytes = b"", headers: dict[str, str] | None = None,
                method: str = "POST") -> None:
        lines = [f"{method} {path} HTTP/1.1", "Host: gateway"]
        lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
        if method == "POST" and not any(k.lower() == "content-length" for k in (headers or {})):
            lines.append(f"Content-Length: {len(body)}")
        self.send("\r\n".join(lines).encode("latin-1") + b"\r\n\r\n" + body)

    @property
    def open(self) -> bool:
        return not self.transport.disconnecting and not self.lost

    def responses(self) -> list[Response]:
        """Every complete response received so far (removed from the buffer)."""
        self._buffer += self.transport.value()
        self.transport.clear()
        out = []
        while True:
            parsed = _parse_response(self._buffer)
            if parsed is None:
                return out
            response, self._buffer = parsed
            out.append(response)

    def exchange(self, path: str, body: bytes = b"", headers: dict[str, str] | None = None,
                 method: str = "POST", settle: float = 1.0) -> Response:
        self.request(path, body, headers, method)
        self.stack.settle(settle)
        (response,) = self.responses()
        return response


def _parse_response(buffer: bytes) -> tuple[Response, bytes] | None:
    head_end = buffer.find(b"\r\n\r\n")
    if head_end < 0:
        return None
    lines = buffer[:head_end].split(b"\r\n")
    status = int(lines[0].split(b" ")[1])
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(b":")
        headers[name.strip().lower()] = value.strip()
    rest = buffer[head_end + 4:]
    if headers.get(b"transfer-encoding") == b"chunked":
        body = b""
        while True:
            size_end = rest.find(b"\r\n")
            if size_end < 0:
                return None
            size = int(rest[:size_end].split(b";")[0], 16)
            if len(rest) < size_end + 2 + size + 2:
                return None
            body += rest[size_end + 2:size_end + 2 + size]
            rest = rest[size_end + 2 + size + 2:]
            if size == 0:
                return Response(status, headers, body), rest
    length = int(headers.get(b"content-length", b"0"))
    if len(rest) < length:
        return None
    return Response(status, headers, rest[:length]), rest[length:]


CHAT = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hello there"}]}).encode()


JSON = {"content-type": "application/json"}


def assert_well_behaved_request_works(stack: Stack, client: HttpClient | None = None) -> None:
    client = client if client is not None and client.open else stack.connect()
    response = client.exchange("/v1/chat/completions", CHAT, JSON)
    assert response.status == 200, response
    assert json.loads(response.body)["choices"][0]["message"]["content"] == "hello there"


def prefixed(data: bytes, flag: int = 0) -> bytes:
    return struct.pack(">BI", flag, len(data)) + data


class RawClient:
    """A bare h2 client (outbound header validation off) to send exactly what a test wants."""

    def __init__(self, server: GrpcConnection) -> None:
        self.h2 = h2.connection.H2Connection(h2.config.H2Configuration(
            client_side=True, header_encoding=None, validate_outbound_headers=False,
            normalize_outbound_headers=False))
        self.h2.local_settings = h2.settings.Settings(client=True, initial_values={
            h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 2**24})
        self.h2.initiate_connection()
        self.h2.increment_flow_control_window(2**30)
        self.server = server
        self.server.initiate(0)
        self.events: list[object] = []
        self.server_events: list[object] = []
        self.exchange()

    def exchange(self, chunk: int | None = None) -> None:
        for _ in range(1000):
            a = self.h2.data_to_send()
            b = self.server.data_to_send()
            if not a and not b:
                return
            step = chunk or max(1, len(a))
            for i in range(0, len(a), step):
                self.server_events.extend(self.server.receive_data(a[i:i + step], 0))
            if b:
                self.events.extend(self.h2.receive_data(b))
        raise AssertionError("link never went quiet")

    def request(self, extra: list[tuple[bytes, bytes]] = (), *, method: bytes = b"POST",
                content_type: bytes = b"application/grpc", end_stream: bool = False) -> int:
        sid = self.h2.get_next_available_stream_id()
        headers = [(b":method", method), (b":scheme", b"http"), (b":path", b"/s/M"),
                   (b":authority", b"x"), (b"te", b"trailers"),
                   (b"content-type", content_type)] + list(extra)
        self.h2.send_headers(sid, headers, end_stream=end_stream)
        return sid

    def status_of(self, sid: int) -> bytes | None:
        """grpc-status the server sent on ``sid`` (trailers or trailers-only)."""
        for event in self.events:
            if isinstance(event, (h2.events.ResponseReceived, h2.events.TrailersReceived)) \
                    and event.stream_id == sid:
                headers = dict(event.headers)
                if b"grpc-status" in headers:
                    return headers[b"grpc-status"]
        return None
