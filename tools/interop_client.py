#!/usr/bin/env python
"""The standard gRPC interop client on infx's own gRPC stack: runs one case, exits 0 when it passes.

    .venv/bin/python tools/interop_client.py --server_host=127.0.0.1 --server_port=10000 \\
        --test_case=large_unary [--use_tls=true --use_test_ca=true --server_host_override=foo.test.google.fr]

The cases follow grpc/grpc doc/interop-test-descriptions.md; infx adds
``large_request_rejected`` and ``large_response_rejected`` (5 MiB each way
ends RESOURCE_EXHAUSTED under the default 4 MiB receive limit),
``max_size_request`` (4 MiB - 64 B goes through), ``bidi_1mib_x10`` (ten
1 MiB messages each way on one bidi call) and ``half_duplex`` (ping_pong's
messages on HalfDuplexCall). On failure the client prints what did not hold
and exits 1.

TLS flags as grpc's interop clients have them: ``--use_tls=true`` verifies
the server against the system's roots, or with ``--use_test_ca=true`` against
the test CA in ``tools/interop_testdata/`` (what ``tools/interop_server.py
--use_tls=true`` serves), or against ``--ca_file``. ``--server_host_override``
is the name verified and the ``:authority`` claimed, instead of
``--server_host``. Other standard flags are accepted and ignored with a note
on stderr.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography import x509
from OpenSSL import crypto
from twisted.internet import task
from twisted.internet.defer import Deferred
from twisted.internet.endpoints import wrapClientTLS
from twisted.internet.interfaces import IStreamClientEndpoint
from twisted.internet.ssl import Certificate, optionsForClientTLS, trustRootFromCertificates

from infx.transport import ClientCall, GrpcChannel, GrpcError, client_endpoint
from protocol.grpc import StatusCode
from protocol.pb.grpc_testing import empty_pb2, messages_pb2

SERVICE = "grpc.testing.TestService"
ECHO_INITIAL = "x-grpc-test-echo-initial"
ECHO_TRAILING = "x-grpc-test-echo-trailing-bin"
INITIAL_VALUE = "test_initial_metadata_value"
TRAILING_VALUE = b"\xab\xab\xab"
MiB = 1 << 20
DEFAULT_MAX_MESSAGE = 4 * MiB
SPECIAL_MESSAGE = "\t\ntest with whitespace\r\nand Unicode BMP \u263a and non-BMP \U0001f608\t\n"
PING_PONG = [(27182, 31415), (8, 9), (1828, 2653), (45904, 58979)]
TEST_CA = Path(__file__).resolve().parent / "interop_testdata" / "ca.pem"


class InteropFailure(Exception):
    """A case's assertion did not hold."""


def check(condition: bool, message: str) -> None:
    if not condition:
        raise InteropFailure(message)


@dataclass
class Client:
    """The channel a case runs on, with shorthands for TestService's methods."""

    channel: GrpcChannel

    def stream(self, method: str, response: Any, *, service: str = SERVICE, **options: Any) -> ClientCall:
        return self.channel.stream(f"/{service}/{method}", _serialize, response.FromString, **options)

    def unary(self, method: str, request: Any, response: Any, **options: Any) -> Deferred[Any]:
        return self.channel.unary(f"/{SERVICE}/{method}", request, _serialize, response.FromString, **options)


def _serialize(message: Any) -> bytes:
    return message.SerializeToString()  # type: ignore[no-any-return]


def _zeros(size: int) -> messages_pb2.Payload:
    return messages_pb2.Payload(body=bytes(size))


def _large_unary_request(**fields: Any) -> messages_pb2.SimpleRequest:
    return messages_pb2.SimpleRequest(response_size=314159, payload=_zeros(271828), **fields)


def _check_large_unary(response: messages_pb2.SimpleResponse) -> None:
    body = response.payload.body
    check(body == bytes(314159), f"response payload of {len(body)} bytes, expected 314159 zeros")


def _output_request(request_size: int, response_size: int) -> messages_pb2.StreamingOutputCallRequest:
    """A request of ``request_size`` zero bytes asking for one response of ``response_size``."""
    return messages_pb2.StreamingOutputCallRequest(
        response_parameters=[messages_pb2.ResponseParameters(size=response_size)],
        payload=_zeros(request_size),
    )


async def _expect_status(code: StatusCode, call: Awaitable[Any], message: str | None = None) -> GrpcError:
    try:
        await call
    except GrpcError as error:
        check(error.code == code, f"expected status {code.name}, got {error.code.name}: {error.message!r}")
        if message is not None:
            check(error.message == message, f"expected status message {message!r}, got {error.message!r}")
        return error
    raise InteropFailure(f"expected status {code.name}, but the call succeeded")


async def _drain(call: ClientCall) -> list[Any]:
    return [response async for response in call]


async def _one_shot(call: ClientCall, request: Any) -> list[Any]:
    """Send one request, half-close, read every response (GrpcError on a non-OK status)."""
    await call.send(request)
    call.end()
    return await _drain(call)


# -- the standard cases ----------------------------------------------------


async def empty_unary(client: Client) -> None:
    response = await client.unary("EmptyCall", empty_pb2.Empty(), empty_pb2.Empty)
    check(isinstance(response, empty_pb2.Empty), f"EmptyCall returned {response!r}")


async def large_unary(client: Client) -> None:
    _check_large_unary(await client.unary("UnaryCall", _large_unary_request(), messages_pb2.SimpleResponse))


async def client_streaming(client: Client) -> None:
    call = client.stream("StreamingInputCall", messages_pb2.StreamingInputCallResponse)
    for size in (27182, 8, 1828, 45904):
        await call.send(messages_pb2.StreamingInputCallRequest(payload=_zeros(size)))
    call.end()
    responses = await _drain(call)
    check(len(responses) == 1, f"{len(responses)} responses to a client-streaming call")
    size = responses[0].aggregated_payload_size
    check(size == 74922, f"aggregated_payload_size {size}, expected 74922")


async def server_streaming(client: Client) -> None:
    sizes = [31415, 9, 2653, 58979]
    request = messages_pb2.StreamingOutputCallRequest(
        response_parameters=[messages_pb2.ResponseParameters(size=n) for n in sizes]
    )
    call = client.stream("StreamingOutputCall", messages_pb2.StreamingOutputCallResponse)
    bodies = [r.payload.body for r in await _one_shot(call, request)]
    check(bodies == [bytes(n) for n in sizes], f"response sizes {[len(b) for b in bodies]}, expected {sizes}")


async def ping_pong(client: Client) -> None:
    call = client.stream("FullDuplexCall", messages_pb2.StreamingOutputCallResponse)
    for request_size, response_size in PING_PONG:
        await call.send(_output_request(request_size, response_size))
        response = await call.recv()
        check(response is not None, f"the call ended before the response of {response_size} bytes")
        body = response.payload.body
        check(body == bytes(response_size), f"response of {len(body)} bytes, expected {response_size}")
    call.end()
    rest = await _drain(call)
    check(rest == [], f"{len(rest)} responses after the fourth")


async def empty_stream(client: Client) -> None:
    call = client.stream("FullDuplexCall", messages_pb2.StreamingOutputCallResponse)
    call.end()
    responses = await _drain(call)
    check(responses == [], f"{len(responses)} responses to an empty stream")


async def cancel_after_begin(client: Client) -> None:
    call = client.stream("StreamingInputCall", messages_pb2.StreamingInputCallResponse)
    call.cancel()
    status = await call.status()
    check(status.code == StatusCode.CANCELLED, f"status {StatusCode(status.code).name}, expected CANCELLED")


async def cancel_after_first_response(client: Client) -> None:
    call = client.stream("FullDuplexCall", messages_pb2.StreamingOutputCallResponse)
    await call.send(_output_request(27182, 31415))
    response = await call.recv()
    check(response is not None and len(response.payload.body) == 31415, "no first response of 31415 bytes")
    call.cancel()
    status = await call.status()
    check(status.code == StatusCode.CANCELLED, f"status {StatusCode(status.code).name}, expected CANCELLED")


async def timeout_on_sleeping_server(client: Client) -> None:
    call = client.stream("FullDuplexCall", messages_pb2.StreamingOutputCallResponse, timeout=0.001)
    try:
        await call.send(messages_pb2.StreamingOutputCallRequest(payload=_zeros(27182)))
    except GrpcError:
        pass  # the deadline may pass before the request is written; the status says which
    status = await call.status()
    check(status.code == StatusCode.DEADLINE_EXCEEDED,
          f"status {StatusCode(status.code).name}, expected DEADLINE_EXCEEDED")


async def custom_metadata(client: Client) -> None:
    metadata = ((ECHO_INITIAL, INITIAL_VALUE), (ECHO_TRAILING, TRAILING_VALUE))

    async def check_echo(call: ClientCall, what: str) -> None:
        initial = await call.initial_metadata()
        check((ECHO_INITIAL, INITIAL_VALUE) in initial, f"{what}: initial metadata {initial!r} lacks the echo")
        status = await call.status()
        check((ECHO_TRAILING, TRAILING_VALUE) in status.trailers,
              f"{what}: trailing metadata {status.trailers!r} lacks the echo")

    unary = client.stream("UnaryCall", messages_pb2.SimpleResponse, metadata=metadata)
    responses = await _one_shot(unary, _large_unary_request())
    check(len(responses) == 1, f"UnaryCall: {len(responses)} responses")
    _check_large_unary(responses[0])
    await check_echo(unary, "UnaryCall")

    duplex = client.stream("FullDuplexCall", messages_pb2.StreamingOutputCallResponse, metadata=metadata)
    sizes = [len(r.payload.body) for r in await _one_shot(duplex, _output_request(271828, 314159))]
    check(sizes == [314159], f"FullDuplexCall: response sizes {sizes}")
    await check_echo(duplex, "FullDuplexCall")


async def _echo_status(client: Client, message: str, duplex: bool) -> None:
    status = messages_pb2.EchoStatus(code=2, message=message)
    unary = client.unary("UnaryCall", messages_pb2.SimpleRequest(response_status=status), messages_pb2.SimpleResponse)
    await _expect_status(StatusCode.UNKNOWN, unary, message)
    if duplex:
        call = client.stream("FullDuplexCall", messages_pb2.StreamingOutputCallResponse)
        await _expect_status(StatusCode.UNKNOWN,
                             _one_shot(call, messages_pb2.StreamingOutputCallRequest(response_status=status)), message)


async def status_code_and_message(client: Client) -> None:
    await _echo_status(client, "test status message", duplex=True)


async def special_status_message(client: Client) -> None:
    await _echo_status(client, SPECIAL_MESSAGE, duplex=False)


async def unimplemented_method(client: Client) -> None:
    call = client.stream("UnimplementedCall", empty_pb2.Empty)
    await _expect_status(StatusCode.UNIMPLEMENTED, _one_shot(call, empty_pb2.Empty()))


async def unimplemented_service(client: Client) -> None:
    call = client.stream("UnimplementedCall", empty_pb2.Empty, service="grpc.testing.UnimplementedService")
    await _expect_status(StatusCode.UNIMPLEMENTED, _one_shot(call, empty_pb2.Empty()))


async def client_compressed_unary(client: Client) -> None:
    expecting = _large_unary_request(expect_compressed=messages_pb2.BoolValue(value=True))
    probe = client.stream("UnaryCall", messages_pb2.SimpleResponse)
    await _expect_status(StatusCode.INVALID_ARGUMENT, _one_shot(probe, expecting))

    compressed = client.stream("UnaryCall", messages_pb2.SimpleResponse, compression="gzip")
    await compressed.send(expecting, compress=True)
    compressed.end()
    (response,) = await _drain(compressed)
    _check_large_unary(response)

    plain = client.stream("UnaryCall", messages_pb2.SimpleResponse)
    not_expecting = _large_unary_request(expect_compressed=messages_pb2.BoolValue(value=False))
    (response,) = await _one_shot(plain, not_expecting)
    _check_large_unary(response)


async def client_compressed_streaming(client: Client) -> None:
    first = messages_pb2.StreamingInputCallRequest(
        expect_compressed=messages_pb2.BoolValue(value=True), payload=_zeros(27182))
    probe = client.stream("StreamingInputCall", messages_pb2.StreamingInputCallResponse)
    await _expect_status(StatusCode.INVALID_ARGUMENT, _one_shot(probe, first))

    call = client.stream("StreamingInputCall", messages_pb2.StreamingInputCallResponse, compression="gzip")
    await call.send(first, compress=True)
    await call.send(messages_pb2.StreamingInputCallRequest(
        expect_compressed=messages_pb2.BoolValue(value=False), payload=_zeros(45904)), compress=False)
    call.end()
    (response,) = await _drain(call)
    size = response.aggregated_payload_size
    check(size == 73086, f"aggregated_payload_size {size}, expected 73086")


async def server_compressed_unary(client: Client) -> None:
    for compressed in (True, False):
        call = client.stream("UnaryCall", messages_pb2.SimpleResponse)
        await call.send(_large_unary_request(response_compressed=messages_pb2.BoolValue(value=compressed)))
        call.end()
        response = await call.recv()
        check(response is not None, "no response")
        check(call.last_message_compressed == compressed,
              f"response_compressed={compressed} but the response's compressed flag is {call.last_message_compressed}")
        _check_large_unary(response)
        check(await _drain(call) == [], "more than one response to a unary call")


async def server_compressed_streaming(client: Client) -> None:
    expected = [(31415, True), (92653, False)]
    request = messages_pb2.StreamingOutputCallRequest(response_parameters=[
        messages_pb2.ResponseParameters(size=size, compressed=messages_pb2.BoolValue(value=flag))
        for size, flag in expected
    ])
    call = client.stream("StreamingOutputCall", messages_pb2.StreamingOutputCallResponse)
    await call.send(request)
    call.end()
    for size, compressed in expected:
        response = await call.recv()
        check(response is not None, f"the call ended before the response of {size} bytes")
        check(len(response.payload.body) == size, f"response of {len(response.payload.body)} bytes, expected {size}")
        check(call.last_message_compressed == compressed,
              f"compressed={compressed} but the response's compressed flag is {call.last_message_compressed}")
    check(await _drain(call) == [], "more than two responses")


# -- infx's extras -----------------------------------------------------------


async def large_request_rejected(client: Client) -> None:
    """A 5 MiB request exceeds the server's default 4 MiB receive limit."""
    request = messages_pb2.SimpleRequest(response_size=1, payload=_zeros(5 * MiB))
    await _expect_status(StatusCode.RESOURCE_EXHAUSTED, client.unary("UnaryCall", request, messages_pb2.SimpleResponse))


async def large_response_rejected(client: Client) -> None:
    """A 5 MiB response exceeds this client's default 4 MiB receive limit."""
    request = messages_pb2.SimpleRequest(response_size=5 * MiB)
    await _expect_status(StatusCode.RESOURCE_EXHAUSTED, client.unary("UnaryCall", request, messages_pb2.SimpleResponse))


def _request_of_size(size: int, **fields: Any) -> messages_pb2.SimpleRequest:
    """A SimpleRequest with ``fields`` and a zero payload that make it exactly ``size`` bytes serialized."""
    body = size
    while (excess := messages_pb2.SimpleRequest(payload=_zeros(body), **fields).ByteSize() - size) != 0:
        body -= excess
    return messages_pb2.SimpleRequest(payload=_zeros(body), **fields)


async def max_size_request(client: Client) -> None:
    """A request of 4 MiB - 64 B, just under the default limit, goes through."""
    request = _request_of_size(DEFAULT_MAX_MESSAGE - 64, response_size=1)
    response = await client.unary("UnaryCall", request, messages_pb2.SimpleResponse)
    check(response.payload.body == b"\0", f"response payload {response.payload.body[:16]!r}")


async def bidi_1mib_x10(client: Client) -> None:
    """Ten 1 MiB messages each way on one bidi call, the requests sent while the responses arrive."""
    call = client.stream("FullDuplexCall", messages_pb2.StreamingOutputCallResponse)
    request = _output_request(MiB, MiB)

    async def send_all() -> None:
        for _ in range(10):
            await call.send(request)
        call.end()

    sending = Deferred.fromCoroutine(send_all())
    sizes = [len(r.payload.body) for r in await _drain(call)]
    await sending
    check(sizes == [MiB] * 10, f"response sizes {sizes}")


async def half_duplex(client: Client) -> None:
    """ping_pong's messages on HalfDuplexCall, all sent before the client half-closes; the server must not answer
    before that (watched for 0.1 s), as it would on FullDuplexCall."""
    call = client.stream("HalfDuplexCall", messages_pb2.StreamingOutputCallResponse)
    for request_size, response_size in PING_PONG:
        await call.send(_output_request(request_size, response_size))
    first = call.recv()
    await task.deferLater(client.channel.clock, 0.1)
    if first.called:
        await first  # raises the call's status if it failed
        raise InteropFailure("the server answered before the client half-closed")
    call.end()
    responses = [await first, *await _drain(call)]
    sizes = [response_size for _, response_size in PING_PONG]
    check([r.payload.body for r in responses] == [bytes(n) for n in sizes],
          f"response sizes {[len(r.payload.body) for r in responses]}, expected {sizes}")


CASES: dict[str, Callable[[Client], Awaitable[None]]] = {
    case.__name__: case
    for case in [
        empty_unary, large_unary, client_streaming, server_streaming, ping_pong, empty_stream,
        cancel_after_begin, cancel_after_first_response, timeout_on_sleeping_server, custom_metadata,
        status_code_and_message, special_status_message, unimplemented_method, unimplemented_service,
        client_compressed_unary, client_compressed_streaming, server_compressed_unary,
        server_compressed_streaming, large_request_rejected, large_response_rejected, max_size_request,
        bidi_1mib_x10, half_duplex,
    ]
}


def _parse_bool(value: str) -> bool:
    if value.lower() in ("true", "1", "yes"):
        return True
    if value.lower() in ("false", "0", "no"):
        return False
    raise argparse.ArgumentTypeError(f"not a boolean: {value!r}")


def _trust_root(options: argparse.Namespace) -> Any:
    """``--ca_file``'s certificates, else the test CA with ``--use_test_ca``, else None (the system's roots)."""
    if options.ca_file is None and not options.use_test_ca:
        return None
    pem = Path(options.ca_file or TEST_CA).read_bytes()
    authorities = x509.load_pem_x509_certificates(pem)
    certificates = [Certificate(crypto.X509.from_cryptography(c)) for c in authorities]  # type: ignore[no-untyped-call]
    return trustRootFromCertificates(certificates)  # type: ignore[no-untyped-call]


def _endpoint(reactor: Any, options: argparse.Namespace) -> IStreamClientEndpoint:
    """TCP to ``--server_host``; with ``--use_tls``, TLS (ALPN h2) verifying ``--server_host_override`` if given."""
    endpoint = client_endpoint(reactor, options.server_host, options.server_port)
    if not options.use_tls:
        return endpoint
    server_name = options.server_host_override or options.server_host
    tls = optionsForClientTLS(server_name, trustRoot=_trust_root(options), acceptableProtocols=[b"h2"])
    return wrapClientTLS(tls, endpoint)


async def run(reactor: Any, options: argparse.Namespace) -> None:
    """Run the case; a failure exits 1 (``task.react`` turns SystemExit into the exit status)."""
    authority = f"{options.server_host_override or options.server_host}:{options.server_port}"
    channel = GrpcChannel(reactor, _endpoint(reactor, options), authority=authority,
                          scheme="https" if options.use_tls else "http")
    try:
        await CASES[options.test_case](Client(channel))
    except (InteropFailure, GrpcError) as error:
        print(f"FAIL {options.test_case}: {_describe(error)}", file=sys.stderr)
        raise SystemExit(1)
    finally:
        channel.close()
    print(f"PASS {options.test_case}")


def _describe(error: Exception) -> str:
    if isinstance(error, GrpcError):
        return f"unexpected status {error.code.name}: {error.message!r}"
    return str(error)


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description="gRPC interop client on infx's gRPC stack")
    parser.add_argument("--server_host", default="localhost")
    parser.add_argument("--server_host_override", default=None,
                        help="the TLS server name to verify and the :authority to claim")
    parser.add_argument("--server_port", type=int, required=True)
    parser.add_argument("--test_case", required=True, choices=sorted(CASES))
    parser.add_argument("--use_tls", type=_parse_bool, default=False)
    parser.add_argument("--use_test_ca", type=_parse_bool, default=False,
                        help="with --use_tls, trust the test CA (tools/interop_testdata/ca.pem), not the system's")
    parser.add_argument("--ca_file", default=None, help="with --use_tls, trust the CA certificates in this PEM file")
    options, unknown = parser.parse_known_args(argv)
    if unknown:
        print(f"ignoring unsupported flags: {' '.join(unknown)}", file=sys.stderr)
    # Any other exception exits 1 too, with its traceback logged.
    task.react(lambda reactor: Deferred.fromCoroutine(run(reactor, options)))


if __name__ == "__main__":
    main(sys.argv[1:])
