"""The grpcio half of the interop tests: grpc.testing.TestService on a grpcio server, and the cases on a grpcio client.

Both follow grpc/grpc doc/interop-test-descriptions.md and use grpcio's generic
handlers and multicallables on raw bytes with the generated messages (no
generated stubs), so that neither side shares code with infx's stack. The
infx extras (message size limits, 1 MiB bidi) sit at the end.
"""

from __future__ import annotations

import queue
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from typing import Any

import grpc

from protocol.pb.grpc_testing import empty_pb2, messages_pb2
from tests.support.interop_sniffer import CompressionSniffer

SERVICE = "grpc.testing.TestService"
ECHO_INITIAL = "x-grpc-test-echo-initial"
ECHO_TRAILING = "x-grpc-test-echo-trailing-bin"
MiB = 1 << 20
DEFAULT_MAX_MESSAGE = 4 * MiB

CASES = [
    "empty_unary",
    "large_unary",
    "client_streaming",
    "server_streaming",
    "ping_pong",
    "empty_stream",
    "cancel_after_begin",
    "cancel_after_first_response",
    "timeout_on_sleeping_server",
    "custom_metadata",
    "status_code_and_message",
    "special_status_message",
    "unimplemented_method",
    "unimplemented_service",
    "client_compressed_unary",
    "client_compressed_streaming",
    "server_compressed_unary",
    "server_compressed_streaming",
    "large_request_rejected",
    "large_response_rejected",
    "max_size_request",
    "bidi_1mib_x10",
    "half_duplex",
]


def zeros(size: int) -> messages_pb2.Payload:
    return messages_pb2.Payload(body=bytes(size))


def simple_request_of_size(size: int, **fields: Any) -> messages_pb2.SimpleRequest:
    """A SimpleRequest with ``fields`` and a zero payload that make it exactly ``size`` bytes serialized."""
    body = size
    while True:
        request = messages_pb2.SimpleRequest(payload=zeros(body), **fields)
        excess = request.ByteSize() - size
        if excess == 0:
            return request
        body -= excess


# --------------------------------------------------------------------------
# Server
# --------------------------------------------------------------------------


class GrpcioTestService:
    """TestService on grpcio; request compression is read from a CompressionSniffer in front of it."""

    def __init__(self, sniffer: Callable[[], CompressionSniffer]) -> None:
        self._sniffer = sniffer

    def handler(self) -> grpc.GenericRpcHandler:
        return grpc.method_handlers_generic_handler(
            SERVICE,
            {
                "EmptyCall": grpc.unary_unary_rpc_method_handler(self.empty_call),
                "UnaryCall": grpc.unary_unary_rpc_method_handler(self.unary_call),
                "StreamingOutputCall": grpc.unary_stream_rpc_method_handler(self.streaming_output_call),
                "StreamingInputCall": grpc.stream_unary_rpc_method_handler(self.streaming_input_call),
                "FullDuplexCall": grpc.stream_stream_rpc_method_handler(self.full_duplex_call),
                "HalfDuplexCall": grpc.stream_stream_rpc_method_handler(self.half_duplex_call),
            },
        )

    def empty_call(self, raw: bytes, context: grpc.ServicerContext) -> bytes:
        empty_pb2.Empty.FromString(raw)
        return b""

    def unary_call(self, raw: bytes, context: grpc.ServicerContext) -> bytes:
        request = messages_pb2.SimpleRequest.FromString(raw)
        if request.response_compressed.value:
            context.set_compression(grpc.Compression.Gzip)
        _echo_metadata(context)
        if request.expect_compressed.value:
            self._check_compressed(context, "UnaryCall", 0)
        _echo_status(context, request.response_status)
        return messages_pb2.SimpleResponse(payload=zeros(request.response_size)).SerializeToString()

    def streaming_output_call(self, raw: bytes, context: grpc.ServicerContext) -> Iterator[bytes]:
        request = messages_pb2.StreamingOutputCallRequest.FromString(raw)
        if any(p.compressed.value for p in request.response_parameters):
            context.set_compression(grpc.Compression.Gzip)
        _echo_metadata(context)
        _echo_status(context, request.response_status)
        yield from _responses(context, request)

    def streaming_input_call(self, requests: Iterator[bytes], context: grpc.ServicerContext) -> bytes:
        _echo_metadata(context)
        total = 0
        for index, raw in enumerate(requests):
            request = messages_pb2.StreamingInputCallRequest.FromString(raw)
            if request.expect_compressed.value:
                self._check_compressed(context, "StreamingInputCall", index)
            total += len(request.payload.body)
        return messages_pb2.StreamingInputCallResponse(aggregated_payload_size=total).SerializeToString()

    def full_duplex_call(self, requests: Iterator[bytes], context: grpc.ServicerContext) -> Iterator[bytes]:
        _echo_metadata(context)
        for raw in requests:
            request = messages_pb2.StreamingOutputCallRequest.FromString(raw)
            _echo_status(context, request.response_status)
            yield from _responses(context, request)

    def half_duplex_call(self, requests: Iterator[bytes], context: grpc.ServicerContext) -> Iterator[bytes]:
        """FullDuplexCall, started once the client has half-closed."""
        return self.full_duplex_call(iter(list(requests)), context)

    def _check_compressed(self, context: grpc.ServicerContext, method: str, index: int) -> None:
        if not self._sniffer().request_compressed(f"/{SERVICE}/{method}", index):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "expected a compressed request")


def _echo_metadata(context: grpc.ServicerContext) -> None:
    received = dict(context.invocation_metadata())
    if ECHO_INITIAL in received:
        context.send_initial_metadata([(ECHO_INITIAL, received[ECHO_INITIAL])])
    if ECHO_TRAILING in received:
        context.set_trailing_metadata([(ECHO_TRAILING, received[ECHO_TRAILING])])


def _echo_status(context: grpc.ServicerContext, status: messages_pb2.EchoStatus) -> None:
    if status.code != 0:
        code = next(c for c in grpc.StatusCode if c.value[0] == status.code)
        context.abort(code, status.message)


def _responses(context: grpc.ServicerContext, request: messages_pb2.StreamingOutputCallRequest) -> Iterator[bytes]:
    for parameters in request.response_parameters:
        if parameters.interval_us:
            time.sleep(parameters.interval_us / 1e6)
        if parameters.HasField("compressed") and not parameters.compressed.value:
            context.disable_next_message_compression()
        yield messages_pb2.StreamingOutputCallResponse(payload=zeros(parameters.size)).SerializeToString()


class GrpcioInteropServer:
    """A grpcio TestService on a loopback port, reached through a CompressionSniffer at ``port``."""

    def __init__(self) -> None:
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
        self._server.add_generic_rpc_handlers([GrpcioTestService(lambda: self.sniffer).handler()])
        upstream = self._server.add_insecure_port("127.0.0.1:0")
        self._server.start()
        self.sniffer = CompressionSniffer(upstream)
        self.port = self.sniffer.port

    def stop(self) -> None:
        self.sniffer.close()
        self._server.stop(grace=None)


# --------------------------------------------------------------------------
# Client
# --------------------------------------------------------------------------


class InteropFailure(AssertionError):
    """A case's assertion did not hold."""


def check(condition: bool, message: str) -> None:
    if not condition:
        raise InteropFailure(message)


class Requests:
    """A request iterator fed from the test, so that a stream's requests are sent on demand."""

    _END = object()

    def __init__(self) -> None:
        self._queue: queue.Queue[object] = queue.Queue()

    def send(self, message: object) -> None:
        self._queue.put(message)

    def close(self) -> None:
        self._queue.put(self._END)

    def __iter__(self) -> Iterator[bytes]:
        while (item := self._queue.get()) is not self._END:
            yield item.SerializeToString()  # type: ignore[attr-defined]


def _method(channel: grpc.Channel, kind: str, name: str, service: str = SERVICE) -> Any:
    """The multicallable of ``kind`` (e.g. "unary_unary") for a method, on raw bytes."""
    return getattr(channel, kind)(f"/{service}/{name}")


def expect_status(code: grpc.StatusCode, call: Callable[[], object], message: str | None = None) -> grpc.RpcError:
    try:
        call()
    except grpc.RpcError as error:
        check(error.code() == code, f"expected {code}, got {error.code()}: {error.details()!r}")
        if message is not None:
            check(error.details() == message, f"expected message {message!r}, got {error.details()!r}")
        return error
    raise InteropFailure(f"expected {code}, but the call succeeded")


def _simple(raw: bytes) -> Any:
    return messages_pb2.SimpleResponse.FromString(raw)


def _output(raw: bytes) -> Any:
    return messages_pb2.StreamingOutputCallResponse.FromString(raw)


def _large_unary_request(**fields: Any) -> messages_pb2.SimpleRequest:
    return messages_pb2.SimpleRequest(response_size=314159, payload=zeros(271828), **fields)


def _check_large_unary(raw: bytes) -> None:
    response = _simple(raw)
    check(response.payload.body == bytes(314159), f"payload of {len(response.payload.body)} bytes, not 314159 zeros")


def empty_unary(channel: grpc.Channel) -> None:
    response = _method(channel, "unary_unary", "EmptyCall")(empty_pb2.Empty().SerializeToString())
    check(response == b"", f"EmptyCall returned {response!r}")


def large_unary(channel: grpc.Channel) -> None:
    _check_large_unary(_method(channel, "unary_unary", "UnaryCall")(_large_unary_request().SerializeToString()))


def client_streaming(channel: grpc.Channel) -> None:
    requests = (messages_pb2.StreamingInputCallRequest(payload=zeros(n)).SerializeToString() for n in (27182, 8, 1828, 45904))
    response = messages_pb2.StreamingInputCallResponse.FromString(
        _method(channel, "stream_unary", "StreamingInputCall")(requests)
    )
    check(response.aggregated_payload_size == 74922, f"aggregated_payload_size {response.aggregated_payload_size}")


def server_streaming(channel: grpc.Channel) -> None:
    sizes = [31415, 9, 2653, 58979]
    request = messages_pb2.StreamingOutputCallRequest(
        response_parameters=[messages_pb2.ResponseParameters(size=n) for n in sizes]
    )
    bodies = [_output(raw).payload.body for raw in _method(channel, "unary_stream", "StreamingOutputCall")(request.SerializeToString())]
    check(bodies == [bytes(n) for n in sizes], f"response sizes {[len(b) for b in bodies]}")


def ping_pong(channel: grpc.Channel) -> None:
    requests = Requests()
    call = _method(channel, "stream_stream", "FullDuplexCall")(iter(requests))
    for request_size, response_size in [(27182, 31415), (8, 9), (1828, 2653), (45904, 58979)]:
        requests.send(messages_pb2.StreamingOutputCallRequest(
            response_parameters=[messages_pb2.ResponseParameters(size=response_size)], payload=zeros(request_size),
        ))
        body = _output(next(call)).payload.body
        check(body == bytes(response_size), f"response of {len(body)} bytes, expected {response_size}")
    requests.close()
    rest = list(call)
    check(rest == [], f"{len(rest)} responses after the fourth")
    check(call.code() == grpc.StatusCode.OK, f"status {call.code()}")


def half_duplex(channel: grpc.Channel) -> None:
    """ping_pong's requests on HalfDuplexCall, all sent before the half-close; then every response."""
    sizes = [(27182, 31415), (8, 9), (1828, 2653), (45904, 58979)]
    requests = [messages_pb2.StreamingOutputCallRequest(
        response_parameters=[messages_pb2.ResponseParameters(size=response_size)], payload=zeros(request_size),
    ).SerializeToString() for request_size, response_size in sizes]
    call = _method(channel, "stream_stream", "HalfDuplexCall")(iter(requests))
    bodies = [_output(raw).payload.body for raw in call]
    check(bodies == [bytes(response) for _, response in sizes], f"response sizes {[len(b) for b in bodies]}")
    check(call.code() == grpc.StatusCode.OK, f"status {call.code()}")


def empty_stream(channel: grpc.Channel) -> None:
    call = _method(channel, "stream_stream", "FullDuplexCall")(iter([]))
    responses = list(call)
    check(responses == [], f"{len(responses)} responses to an empty stream")
    check(call.code() == grpc.StatusCode.OK, f"status {call.code()}")


def cancel_after_begin(channel: grpc.Channel) -> None:
    requests = Requests()
    future = _method(channel, "stream_unary", "StreamingInputCall").future(iter(requests))
    future.cancel()
    requests.close()
    check(future.cancelled(), "the call was not cancelled")
    check(future.code() == grpc.StatusCode.CANCELLED, f"status {future.code()}")


def cancel_after_first_response(channel: grpc.Channel) -> None:
    requests = Requests()
    call = _method(channel, "stream_stream", "FullDuplexCall")(iter(requests))
    requests.send(messages_pb2.StreamingOutputCallRequest(
        response_parameters=[messages_pb2.ResponseParameters(size=31415)], payload=zeros(27182),
    ))
    body = _output(next(call)).payload.body
    check(len(body) == 31415, f"first response of {len(body)} bytes")
    call.cancel()
    requests.close()
    check(call.code() == grpc.StatusCode.CANCELLED, f"status {call.code()}")


def timeout_on_sleeping_server(channel: grpc.Channel) -> None:
    requests = Requests()
    call = _method(channel, "stream_stream", "FullDuplexCall")(iter(requests), timeout=0.001)
    requests.send(messages_pb2.StreamingOutputCallRequest(payload=zeros(27182)))
    try:
        expect_status(grpc.StatusCode.DEADLINE_EXCEEDED, lambda: list(call))
    finally:
        requests.close()


def custom_metadata(channel: grpc.Channel) -> None:
    metadata = [(ECHO_INITIAL, "test_initial_metadata_value"), (ECHO_TRAILING, b"\xab\xab\xab")]

    def check_echo(initial: Any, trailing: Any) -> None:
        check((ECHO_INITIAL, "test_initial_metadata_value") in list(initial), f"initial metadata {initial}")
        check((ECHO_TRAILING, b"\xab\xab\xab") in list(trailing), f"trailing metadata {trailing}")

    raw, call = _method(channel, "unary_unary", "UnaryCall").with_call(
        _large_unary_request().SerializeToString(), metadata=metadata
    )
    _check_large_unary(raw)
    check_echo(call.initial_metadata(), call.trailing_metadata())

    request = messages_pb2.StreamingOutputCallRequest(
        response_parameters=[messages_pb2.ResponseParameters(size=314159)], payload=zeros(271828),
    )
    stream = _method(channel, "stream_stream", "FullDuplexCall")(iter([request.SerializeToString()]), metadata=metadata)
    bodies = [len(_output(raw).payload.body) for raw in stream]
    check(bodies == [314159], f"responses {bodies}")
    check_echo(stream.initial_metadata(), stream.trailing_metadata())


def _echo_status_case(channel: grpc.Channel, message: str, duplex: bool) -> None:
    status = messages_pb2.EchoStatus(code=2, message=message)
    unary = messages_pb2.SimpleRequest(response_status=status).SerializeToString()
    expect_status(grpc.StatusCode.UNKNOWN, lambda: _method(channel, "unary_unary", "UnaryCall")(unary), message)
    if duplex:
        request = messages_pb2.StreamingOutputCallRequest(response_status=status).SerializeToString()
        stream = _method(channel, "stream_stream", "FullDuplexCall")
        expect_status(grpc.StatusCode.UNKNOWN, lambda: list(stream(iter([request]))), message)


def status_code_and_message(channel: grpc.Channel) -> None:
    _echo_status_case(channel, "test status message", duplex=True)


def special_status_message(channel: grpc.Channel) -> None:
    _echo_status_case(channel, "\t\ntest with whitespace\r\nand Unicode BMP ☺ and non-BMP 😈\t\n", duplex=False)


def unimplemented_method(channel: grpc.Channel) -> None:
    method = _method(channel, "unary_unary", "UnimplementedCall")
    expect_status(grpc.StatusCode.UNIMPLEMENTED, lambda: method(b""))


def unimplemented_service(channel: grpc.Channel) -> None:
    method = _method(channel, "unary_unary", "UnimplementedCall", service="grpc.testing.UnimplementedService")
    expect_status(grpc.StatusCode.UNIMPLEMENTED, lambda: method(b""))


def client_compressed_unary(channel: grpc.Channel) -> None:
    method = _method(channel, "unary_unary", "UnaryCall")
    expecting = _large_unary_request(expect_compressed=messages_pb2.BoolValue(value=True)).SerializeToString()
    expect_status(grpc.StatusCode.INVALID_ARGUMENT, lambda: method(expecting))
    _check_large_unary(method(expecting, compression=grpc.Compression.Gzip))
    not_expecting = _large_unary_request(expect_compressed=messages_pb2.BoolValue(value=False)).SerializeToString()
    _check_large_unary(method(not_expecting))


def client_compressed_streaming(channel: grpc.Channel) -> None:
    """As described, except that grpcio's Python API compresses all or none of a call's messages.

    So the second message (expect_compressed false) goes compressed too,
    which the CompressedRequest feature allows.
    """
    method = _method(channel, "stream_unary", "StreamingInputCall")
    probe = messages_pb2.StreamingInputCallRequest(expect_compressed=messages_pb2.BoolValue(value=True), payload=zeros(27182))
    expect_status(grpc.StatusCode.INVALID_ARGUMENT, lambda: method(iter([probe.SerializeToString()])))
    second = messages_pb2.StreamingInputCallRequest(expect_compressed=messages_pb2.BoolValue(value=False), payload=zeros(45904))
    raw = method(iter([probe.SerializeToString(), second.SerializeToString()]), compression=grpc.Compression.Gzip)
    size = messages_pb2.StreamingInputCallResponse.FromString(raw).aggregated_payload_size
    check(size == 73086, f"aggregated_payload_size {size}")


def server_compressed_unary(channel: grpc.Channel) -> None:
    """grpcio's Python client hides the compressed flag, so only the responses are checked."""
    method = _method(channel, "unary_unary", "UnaryCall")
    for compressed in (True, False):
        request = _large_unary_request(response_compressed=messages_pb2.BoolValue(value=compressed))
        _check_large_unary(method(request.SerializeToString()))


def server_compressed_streaming(channel: grpc.Channel) -> None:
    """grpcio's Python client hides the compressed flag, so only the responses are checked."""
    request = messages_pb2.StreamingOutputCallRequest(response_parameters=[
        messages_pb2.ResponseParameters(size=31415, compressed=messages_pb2.BoolValue(value=True)),
        messages_pb2.ResponseParameters(size=92653, compressed=messages_pb2.BoolValue(value=False)),
    ])
    stream = _method(channel, "unary_stream", "StreamingOutputCall")(request.SerializeToString())
    bodies = [_output(raw).payload.body for raw in stream]
    check(bodies == [bytes(31415), bytes(92653)], f"response sizes {[len(b) for b in bodies]}")


def large_request_rejected(channel: grpc.Channel) -> None:
    """A 5 MiB request exceeds the server's default 4 MiB receive limit."""
    request = messages_pb2.SimpleRequest(response_size=1, payload=zeros(5 * MiB)).SerializeToString()
    method = _method(channel, "unary_unary", "UnaryCall")
    expect_status(grpc.StatusCode.RESOURCE_EXHAUSTED, lambda: method(request))


def large_response_rejected(channel: grpc.Channel) -> None:
    """A 5 MiB response exceeds the client's default 4 MiB receive limit."""
    request = messages_pb2.SimpleRequest(response_size=5 * MiB).SerializeToString()
    method = _method(channel, "unary_unary", "UnaryCall")
    expect_status(grpc.StatusCode.RESOURCE_EXHAUSTED, lambda: method(request))


def max_size_request(channel: grpc.Channel) -> None:
    """A request of 4 MiB - 64 B, just under the default limit, goes through."""
    request = simple_request_of_size(DEFAULT_MAX_MESSAGE - 64, response_size=1)
    raw = _method(channel, "unary_unary", "UnaryCall")(request.SerializeToString())
    check(_simple(raw).payload.body == b"\0", "unexpected response")


def bidi_1mib_x10(channel: grpc.Channel) -> None:
    """Ten 1 MiB messages each way on one bidi call, the requests streamed while responses arrive."""
    request = messages_pb2.StreamingOutputCallRequest(
        response_parameters=[messages_pb2.ResponseParameters(size=MiB)], payload=zeros(MiB),
    ).SerializeToString()
    call = _method(channel, "stream_stream", "FullDuplexCall")(iter([request] * 10))
    sizes = [len(_output(raw).payload.body) for raw in call]
    check(sizes == [MiB] * 10, f"response sizes {sizes}")


GRPCIO_CASES: dict[str, Callable[[grpc.Channel], None]] = {name: globals()[name] for name in CASES}


def run_case(name: str, port: int) -> None:
    """Run one case with a fresh grpcio channel to 127.0.0.1:``port``."""
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        GRPCIO_CASES[name](channel)
