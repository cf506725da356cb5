"""infx's half of the gRPC benchmark: ``infx.transport`` on Twisted's default reactor, raw bytes, default configuration."""

from __future__ import annotations

import sys
import threading
import time
from typing import Any

from twisted.internet import task
from twisted.internet.defer import Deferred

from bench_common import SINK, TESTS, UNARY, UNARY_PAYLOAD, WARMUP_CALLS, Result, announce_port, check_sink_reply, encode_count
from infx.transport import CallKind, GrpcChannel, GrpcServer, ServerCall, client_endpoint, listen_grpc


def _raw(data: bytes) -> bytes:
    return data


def _echo(request: bytes, call: ServerCall) -> bytes:
    return request


async def _sink(call: ServerCall) -> bytes:
    count = 0
    while await call.recv() is not None:
        count += 1
    return encode_count(count)


def serve() -> None:
    """Serve until stdin closes (the orchestrator holds the other end)."""
    task.react(lambda reactor: Deferred.fromCoroutine(_serve(reactor)))


async def _serve(reactor: Any) -> None:
    server = GrpcServer(reactor)
    server.add_method(UNARY, _echo, _raw, _raw, kind=CallKind.UNARY_UNARY)
    server.add_method(SINK, _sink, _raw, _raw, kind=CallKind.STREAM_UNARY)
    listening: Any = await listen_grpc(reactor, "tcp:0:interface=127.0.0.1", server)
    announce_port(listening.getHost().port)
    stdin_closed: Deferred[None] = Deferred()

    def wait_for_stdin() -> None:
        sys.stdin.read()
        reactor.callFromThread(stdin_closed.callback, None)

    threading.Thread(target=wait_for_stdin, daemon=True).start()
    await stdin_closed


def run(test: str, port: int, duration: float) -> Result:
    results: list[Result] = []

    async def go(reactor: Any) -> None:
        results.append(await _run(reactor, test, port, duration))

    try:
        task.react(lambda reactor: Deferred.fromCoroutine(go(reactor)))
    except SystemExit as exit:
        if exit.code:
            raise
    return results[0]


async def _run(reactor: Any, test: str, port: int, duration: float) -> Result:
    channel = GrpcChannel(reactor, client_endpoint(reactor, "127.0.0.1", port))
    try:
        for _ in range(WARMUP_CALLS):
            await channel.unary(UNARY, UNARY_PAYLOAD, _raw, _raw)
        if test == "unary":
            return await _unary(channel, duration)
        return await _stream(channel, bytes(TESTS[test][0]), duration)
    finally:
        channel.close()


async def _unary(channel: GrpcChannel, duration: float) -> Result:
    count = 0
    start = time.perf_counter()
    end = start + duration
    while time.perf_counter() < end:
        await channel.unary(UNARY, UNARY_PAYLOAD, _raw, _raw)
        count += 1
    return Result(count, len(UNARY_PAYLOAD), time.perf_counter() - start)


async def _stream(channel: GrpcChannel, message: bytes, duration: float) -> Result:
    sent = 0
    start = time.perf_counter()
    end = start + duration
    call = channel.stream(SINK, _raw, _raw)
    while time.perf_counter() < end:
        await call.send(message)
        sent += 1
    call.end()
    reply = await call.recv()
    seconds = time.perf_counter() - start
    check_sink_reply(sent, reply)
    return Result(sent, len(message), seconds)
