"""Run one FullDuplexCall exchange on infx's client and print the response sizes (a subprocess helper).

    python -m tests.support.interop_infx_duplex PORT '[[request_size, response_size], ...]'

The Hypothesis size test drives infx's client from a separate process because
its examples run synchronously while infx's client needs a running reactor.
"""

from __future__ import annotations

import json
import sys
from typing import Any

from twisted.internet import task
from twisted.internet.defer import Deferred

from infx.transport import GrpcChannel, client_endpoint
from protocol.pb.grpc_testing import messages_pb2
from tests.support.interop_grpcio import SERVICE


def duplex_request(request_size: int, response_size: int) -> messages_pb2.StreamingOutputCallRequest:
    return messages_pb2.StreamingOutputCallRequest(
        response_parameters=[messages_pb2.ResponseParameters(size=response_size)],
        payload=messages_pb2.Payload(body=bytes(request_size)),
    )


async def exchange(reactor: Any, port: int, pairs: list[tuple[int, int]]) -> None:
    channel = GrpcChannel(reactor, client_endpoint(reactor, "127.0.0.1", port))
    try:
        call = channel.stream(
            f"/{SERVICE}/FullDuplexCall",
            messages_pb2.StreamingOutputCallRequest.SerializeToString,
            messages_pb2.StreamingOutputCallResponse.FromString,
        )
        for request_size, response_size in pairs:
            await call.send(duplex_request(request_size, response_size))
        call.end()
        print(json.dumps([len(response.payload.body) async for response in call]))
    finally:
        await channel.close()


if __name__ == "__main__":
    task.react(lambda reactor: Deferred.fromCoroutine(exchange(reactor, int(sys.argv[1]), json.loads(sys.argv[2]))))
