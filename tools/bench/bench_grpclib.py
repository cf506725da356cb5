"""grpclib's half of the gRPC benchmark: its low-level Server/Channel with a raw-bytes codec, default configuration."""

from __future__ import annotations

import asyncio
import sys
import time
from typing import Any

from grpclib.client import Channel, StreamUnaryMethod, UnaryUnaryMethod
from grpclib.const import Cardinality, Handler
from grpclib.encoding.base import CodecBase
from grpclib.server import Server, Stream

from bench_common import SINK, TESTS, UNARY, UNARY_PAYLOAD, WARMUP_CALLS, Result, announce_port, check_sink_reply, encode_count


class RawCodec(CodecBase):
    """Passes bytes through, under the usual ``application/grpc+proto`` content type."""

    __content_subtype__ = "proto"

    def encode(self, message: Any, message_type: Any) -> bytes:
        return bytes(message)

    def decode(self, data: bytes, message_type: Any) -> Any:
        return data


class BenchService:
    """The two bench methods, mapped the way grpclib's generated bases map theirs."""

    async def unary(self, stream: Stream[bytes, bytes]) -> None:
        request = await stream.recv_message()
        assert request is not None
        await stream.send_message(request)

    async def sink(self, stream: Stream[bytes, bytes]) -> None:
        count = 0
        async for _ in stream:
            count += 1
        await stream.send_message(encode_count(count))

    def __mapping__(self) -> dict[str, Handler]:
        return {
            UNARY: Handler(self.unary, Cardinality.UNARY_UNARY, bytes, bytes),
            SINK: Handler(self.sink, Cardinality.STREAM_UNARY, bytes, bytes),
        }


def serve() -> None:
    """Serve until stdin closes (the orchestrator holds the other end)."""
    asyncio.run(_serve())


async def _serve() -> None:
    server = Server([BenchService()], codec=RawCodec())
    await server.start("127.0.0.1", 0)
    listening: Any = server._server  # grpclib exposes the bound port only here
    announce_port(listening.sockets[0].getsockname()[1])
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    server.close()
    await server.wait_closed()


def run(test: str, port: int, duration: float) -> Result:
    return asyncio.run(_run(test, port, duration))


async def _run(test: str, port: int, duration: float) -> Result:
    channel = Channel("127.0.0.1", port, codec=RawCodec())
    try:
        unary = UnaryUnaryMethod[bytes, bytes](channel, UNARY, bytes, bytes)
        for _ in range(WARMUP_CALLS):
            await unary(UNARY_PAYLOAD)
        if test == "unary":
            return await _unary(unary, duration)
        sink = StreamUnaryMethod[bytes, bytes](channel, SINK, bytes, bytes)
        return await _stream(sink, bytes(TESTS[test][0]), duration)
    finally:
        channel.close()


async def _unary(unary: UnaryUnaryMethod[bytes, bytes], duration: float) -> Result:
    count = 0
    start = time.perf_counter()
    end = start + duration
    while time.perf_counter() < end:
        await unary(UNARY_PAYLOAD)
        count += 1
    return Result(count, len(UNARY_PAYLOAD), time.perf_counter() - start)


async def _stream(sink: StreamUnaryMethod[bytes, bytes], message: bytes, duration: float) -> Result:
    sent = 0
    start = time.perf_counter()
    end = start + duration
    async with sink.open() as stream:
        while time.perf_counter() < end:
            await stream.send_message(message)
            sent += 1
        await stream.end()
        reply = await stream.recv_message()
    seconds = time.perf_counter() - start
    assert reply is not None
    check_sink_reply(sent, reply)
    return Result(sent, len(message), seconds)
