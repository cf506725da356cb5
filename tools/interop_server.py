#!/usr/bin/env python
"""The standard gRPC interop server (grpc.testing.TestService) on infx's own gRPC stack.

    .venv/bin/python tools/interop_server.py --port=10000 \\
        [--use_tls=true [--tls_cert_file=server.pem --tls_key_file=server.key]]

Implements the server features of grpc/grpc doc/interop-test-descriptions.md:
EmptyCall, UnaryCall, StreamingOutputCall, StreamingInputCall,
FullDuplexCall, HalfDuplexCall, CompressedRequest (``expect_compressed``),
CompressedResponse (``response_compressed`` / ``ResponseParameters.compressed``),
Echo Status, Echo Metadata and ``interval_us``. ``TestService.UnimplementedCall``
and the whole ``grpc.testing.UnimplementedService`` are left unregistered so
that callers get UNIMPLEMENTED. Requests over the default 4 MiB receive limit end
with RESOURCE_EXHAUSTED (infx's default configuration).

``--use_tls=true`` serves TLS (ALPN ``h2``) with the test certificate in
``tools/interop_testdata/`` unless ``--tls_cert_file`` / ``--tls_key_file``
name another; clients trust it with ``--use_test_ca=true`` and reach it as
``--server_host_override=foo.test.google.fr`` (or localhost, 127.0.0.1).

It prints the port it listens on (useful with ``--port=0``) and serves until
interrupted.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from twisted.internet import task
from twisted.internet.defer import Deferred
from twisted.internet.endpoints import quoteStringArgument
from twisted.internet.interfaces import IReactorTime

from infx.transport import CallKind, GrpcError, GrpcServer, ServerCall, listen_grpc
from protocol.grpc import Metadata, StatusCode
from protocol.pb.grpc_testing import empty_pb2, messages_pb2

SERVICE = "grpc.testing.TestService"
ECHO_INITIAL = "x-grpc-test-echo-initial"
ECHO_TRAILING = "x-grpc-test-echo-trailing-bin"
TESTDATA = Path(__file__).resolve().parent / "interop_testdata"


class TestService:
    """grpc.testing.TestService; ``clock`` paces ``interval_us``."""

    def __init__(self, clock: IReactorTime) -> None:
        self._clock = clock

    def register(self, server: GrpcServer) -> None:
        methods: list[tuple[str, Any, Any, CallKind]] = [
            ("EmptyCall", self.empty_call, empty_pb2.Empty.FromString, CallKind.UNARY_UNARY),
            ("UnaryCall", self.unary_call, messages_pb2.SimpleRequest.FromString, CallKind.UNARY_UNARY),
            ("StreamingOutputCall", self.streaming_output_call,
             messages_pb2.StreamingOutputCallRequest.FromString, CallKind.UNARY_STREAM),
            ("StreamingInputCall", self.streaming_input_call,
             messages_pb2.StreamingInputCallRequest.FromString, CallKind.STREAM_UNARY),
            ("FullDuplexCall", self.full_duplex_call,
             messages_pb2.StreamingOutputCallRequest.FromString, CallKind.STREAM_STREAM),
            ("HalfDuplexCall", self.half_duplex_call,
             messages_pb2.StreamingOutputCallRequest.FromString, CallKind.STREAM_STREAM),
        ]
        for name, handler, deserializer, kind in methods:
            server.add_method(f"/{SERVICE}/{name}", handler, deserializer, _serialize, kind=kind)

    def empty_call(self, request: empty_pb2.Empty, call: ServerCall) -> empty_pb2.Empty:
        return empty_pb2.Empty()

    def unary_call(self, request: messages_pb2.SimpleRequest, call: ServerCall) -> messages_pb2.SimpleResponse:
        if request.response_compressed.value:
            call.set_compression("gzip")  # before any headers go out
        _echo_metadata(call)
        if request.expect_compressed.value:
            _require_compressed(call)
        _echo_status(request.response_status)
        return messages_pb2.SimpleResponse(payload=_zeros(request.response_size))

    async def streaming_output_call(self, request: messages_pb2.StreamingOutputCallRequest, call: ServerCall) -> None:
        if any(p.compressed.value for p in request.response_parameters):
            call.set_compression("gzip")  # before any headers go out
        _echo_metadata(call)
        _echo_status(request.response_status)
        await self._respond(request, call)

    async def streaming_input_call(self, call: ServerCall) -> messages_pb2.StreamingInputCallResponse:
        _echo_metadata(call)
        total = 0
        while (request := await call.recv()) is not None:
            if request.expect_compressed.value:
                _require_compressed(call)
            total += len(request.payload.body)
        return messages_pb2.StreamingInputCallResponse(aggregated_payload_size=total)

    async def full_duplex_call(self, call: ServerCall) -> None:
        _echo_metadata(call)
        async for request in call:
            await self._answer_duplex(request, call)

    async def half_duplex_call(self, call: ServerCall) -> None:
        """FullDuplexCall deferred: test.proto has HalfDuplexCall read every request before answering."""
        _echo_metadata(call)
        for request in [request async for request in call]:
            await self._answer_duplex(request, call)

    async def _answer_duplex(self, request: messages_pb2.StreamingOutputCallRequest, call: ServerCall) -> None:
        """Echo the request's status, or send its responses (the call turns to gzip at the first compressed one)."""
        _echo_status(request.response_status)
        if any(p.compressed.value for p in request.response_parameters):
            call.set_compression("gzip")
        await self._respond(request, call)

    async def _respond(self, request: messages_pb2.StreamingOutputCallRequest, call: ServerCall) -> None:
        """One response per ResponseParameters, each after its ``interval_us``."""
        for parameters in request.response_parameters:
            if parameters.interval_us:
                await task.deferLater(self._clock, parameters.interval_us / 1e6)
            response = messages_pb2.StreamingOutputCallResponse(payload=_zeros(parameters.size))
            await call.send(response, compress=parameters.compressed.value)


def _serialize(message: Any) -> bytes:
    return message.SerializeToString()  # type: ignore[no-any-return]


def _zeros(size: int) -> messages_pb2.Payload:
    return messages_pb2.Payload(body=bytes(size))


def _echo_metadata(call: ServerCall) -> None:
    """Echo Metadata: the initial key back in the headers, the trailing one in the trailers."""
    received = dict(call.metadata)
    if ECHO_INITIAL in received:
        call.send_initial_metadata(((ECHO_INITIAL, received[ECHO_INITIAL]),))
    if ECHO_TRAILING in received:
        trailing: Metadata = ((ECHO_TRAILING, received[ECHO_TRAILING]),)
        call.set_trailing_metadata(trailing)


def _echo_status(status: messages_pb2.EchoStatus) -> None:
    """Echo Status: end the call with the status the client asked for."""
    if status.code != 0:
        raise GrpcError(StatusCode(status.code), status.message)


def _require_compressed(call: ServerCall) -> None:
    """CompressedRequest: a request that says it is compressed must be."""
    if not call.last_message_compressed:
        raise GrpcError(StatusCode.INVALID_ARGUMENT, "expect_compressed is set but the request was not compressed")


def _parse_bool(value: str) -> bool:
    if value.lower() in ("true", "1", "yes"):
        return True
    if value.lower() in ("false", "0", "no"):
        return False
    raise argparse.ArgumentTypeError(f"not a boolean: {value!r}")


def _endpoint(options: argparse.Namespace) -> str:
    """The server endpoint string: ``ssl:`` with the certificate and key files for ``--use_tls``."""
    if not options.use_tls:
        return f"tcp:{options.port}"
    key = quoteStringArgument(options.tls_key_file)  # type: ignore[no-untyped-call]
    cert = quoteStringArgument(options.tls_cert_file)  # type: ignore[no-untyped-call]
    return f"ssl:{options.port}:privateKey={key}:certKey={cert}"


async def serve(reactor: Any, endpoint: str) -> None:
    server = GrpcServer(reactor)
    TestService(reactor).register(server)
    listening: Any = await listen_grpc(reactor, endpoint, server)
    address = listening.getHost()
    print(f"listening on port {address.port}", flush=True)
    await Deferred()  # until the reactor stops (SIGINT / SIGTERM)


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description="gRPC interop server on infx's gRPC stack")
    parser.add_argument("--port", type=int, required=True, help="port to listen on (0: any)")
    parser.add_argument("--use_tls", type=_parse_bool, default=False, help="serve TLS (ALPN h2)")
    parser.add_argument("--tls_cert_file", default=str(TESTDATA / "server.pem"),
                        help="PEM server certificate for --use_tls; default: the test certificate")
    parser.add_argument("--tls_key_file", default=str(TESTDATA / "server.key"),
                        help="PEM private key of --tls_cert_file; default: the test certificate's")
    options, unknown = parser.parse_known_args(argv)
    if unknown:
        print(f"ignoring unsupported flags: {' '.join(unknown)}", file=sys.stderr)
    task.react(lambda reactor: Deferred.fromCoroutine(serve(reactor, _endpoint(options))))


if __name__ == "__main__":
    main(sys.argv[1:])
