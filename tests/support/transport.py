"""A scripted server call (its inbox, an unreadable message, a reset), for tests of reading a gRPC call's messages."""

from __future__ import annotations

from collections import deque
from typing import Any

from twisted.internet.defer import Deferred, fail

from infx.transport.calls import CallBase, GrpcError
from protocol.grpc import StatusCode


class ScriptedCall(CallBase):
    """A call fed by hand: items are ints (a message), None (the half-close); ``end`` resets it
    the way ServerCall.ended does; message 13 cannot be read (a GrpcError, as a bad protobuf)."""

    def __init__(self) -> None:
        self._protocol = None
        self.stream_id = None
        self._send_waiter = None
        self._recv_waiter = None
        self._inbox = deque()
        self.ended_with: GrpcError | None = None

    def _take(self, item: Any) -> Any:
        if item == 13:
            raise GrpcError(StatusCode.INTERNAL, "request could not be deserialized")
        return item

    def _input_over(self) -> Deferred[Any] | None:
        return None if self.ended_with is None else fail(self.ended_with)

    def end(self) -> None:
        self.ended_with = GrpcError(StatusCode.CANCELLED, "reset")
        if self._recv_waiter is not None:
            waiter, self._recv_waiter = self._recv_waiter, None
            waiter.errback(self.ended_with)
