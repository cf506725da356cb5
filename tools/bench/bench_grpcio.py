"""grpcio's half of the gRPC benchmark: generic handlers and multicallables with ``None`` serializers (raw bytes)."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from concurrent import futures

import grpc

from bench_common import SERVICE, SINK, TESTS, UNARY, UNARY_PAYLOAD, WARMUP_CALLS, Result, announce_port, check_sink_reply, encode_count


def _echo(request: bytes, context: grpc.ServicerContext) -> bytes:
    return request


def _sink(requests: Iterator[bytes], context: grpc.ServicerContext) -> bytes:
    return encode_count(sum(1 for _ in requests))


def serve() -> None:
    """Serve until stdin closes (the orchestrator holds the other end)."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(SERVICE, {
        "Unary": grpc.unary_unary_rpc_method_handler(_echo),
        "Sink": grpc.stream_unary_rpc_method_handler(_sink),
    })])
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    announce_port(port)
    sys.stdin.read()
    server.stop(grace=None)


def run(test: str, port: int, duration: float) -> Result:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        unary = channel.unary_unary(UNARY)
        for _ in range(WARMUP_CALLS):
            unary(UNARY_PAYLOAD)
        size = TESTS[test][0]
        if test == "unary":
            return _unary(unary, duration)
        return _stream(channel.stream_unary(SINK), bytes(size), duration)


def _unary(unary: grpc.UnaryUnaryMultiCallable, duration: float) -> Result:
    count = 0
    start = time.perf_counter()
    end = start + duration
    while time.perf_counter() < end:
        unary(UNARY_PAYLOAD)
        count += 1
    return Result(count, len(UNARY_PAYLOAD), time.perf_counter() - start)


def _stream(sink: grpc.StreamUnaryMultiCallable, message: bytes, duration: float) -> Result:
    sent = 0

    def messages() -> Iterator[bytes]:
        nonlocal sent
        end = time.perf_counter() + duration
        while time.perf_counter() < end:
            sent += 1
            yield message

    start = time.perf_counter()
    reply = sink(messages())
    seconds = time.perf_counter() - start
    check_sink_reply(sent, reply)
    return Result(sent, len(message), seconds)
