"""AcceptedPeerStream.read_each: an accepted peer stream read without a Deferred per message, ending as the
``await recv()`` loop it replaced did: at the peer's half-close, when the stream is ended here (while
a message is handled, or while the read waits for the next), or with the call's error otherwise."""

from __future__ import annotations

from typing import Any

from hypothesis import given
from hypothesis import strategies as st
from twisted.internet.defer import CancelledError, Deferred, fail, succeed

from infx.exchange.exchanger import AcceptedPeerStream
from infx.transport.calls import GrpcError
from protocol.grpc import StatusCode
from tests.support.transport import ScriptedCall


class ScriptedServerCall(ScriptedCall):
    """A server call fed by hand, ending as ServerCall does: ``abort`` sends a status and wakes no
    reader; ``reset`` (ours) and ``peer_reset`` end the call and fail a waiting read. Items are ints
    (messages; 13 cannot be read, as a bad protobuf) and None (the peer half-closed)."""

    buffered_amount = 0  # bytes queued to send: with some, end(UNAVAILABLE) resets instead of aborting

    def __init__(self) -> None:
        super().__init__()
        self.finished = False
        self.peer = "peer"

    def _input_over(self) -> Deferred[Any] | None:
        if self.ended_with is not None:
            return fail(self.ended_with)
        return succeed(None) if self.finished else None

    @property
    def over(self) -> bool:
        return self.finished or self.ended_with is not None

    def received(self, item: Any) -> None:
        if not self.over:  # an ended call is no longer the connection's: it gets nothing more
            super().received(item)

    def abort(self, code: StatusCode, message: str = "") -> None:
        if not self.over:
            self.finished = True

    def reset(self, message: str) -> None:
        if not self.over:
            self.peer_reset()

    def peer_reset(self) -> None:
        if not self.over:
            self.end()


class RecvLoopPeerStream(AcceptedPeerStream):
    """The accepted stream as it was read before read_each: one ``recv()`` Deferred per message,
    which ``end()`` cancels; kept here as the behaviour read_each must match."""

    _pending: Deferred[Any] | None = None

    def end(self, code: StatusCode, message: str) -> None:
        super().end(code, message)  # ends the call; this stream never sets the read_each state
        if self._pending is not None and not self._pending.called:
            self._pending.cancel()

    async def recv(self) -> Any:
        if self.closed:
            return None
        self._pending = self.call.recv()
        try:
            message = await self._pending
        except CancelledError:
            return None
        finally:
            self._pending = None
        return message

    def read_each(self, on_message: Any) -> Deferred[None]:
        async def loop() -> None:
            while not self.closed:
                message = await self.recv()
                if message is None:
                    break
                on_message(message)

        return Deferred.fromCoroutine(loop())


class Refused(Exception):
    pass


def handler_for(stream: AcceptedPeerStream, seen: list[Any]) -> Any:
    """What the core does with some messages, synchronously inside the handler: 5 ends the stream
    (a status), 6 ends it while messages wait to be sent (a reset); 7 raises."""

    def handle(message: int) -> None:
        seen.append(message)
        if message == 5:
            stream.end(StatusCode.FAILED_PRECONDITION, "cut off")
        elif message == 6:
            stream.call.buffered_amount = 1
            stream.end(StatusCode.UNAVAILABLE, "engines gone")
        elif message == 7:
            raise Refused()

    return handle


def outcome(stream: AcceptedPeerStream, d: Deferred[Any]) -> list[Any]:
    """How the read ended; a stream closed here ends the call first, so the server takes the
    handler's end then as ``done`` whether it returned or raised CANCELLED or a GrpcError."""
    results: list[Any] = []

    def failed(f: Any) -> None:
        if stream.closed and f.check(CancelledError, GrpcError):
            results.append(("done", None))
        else:
            results.append(("failed", f.type))

    d.addCallbacks(lambda v: results.append(("done", v)), failed)
    return results


def run(script: list[Any], early: int, loop: bool) -> tuple[list[Any], list[Any], list[Any], bool]:
    """Feed ``early`` items before the read starts, the rest after; returns (handled, outcome,
    left unread, closed here). ``"end"`` ends the stream here, ``"reset"`` is the peer's reset."""
    call = ScriptedServerCall()
    stream: AcceptedPeerStream = (RecvLoopPeerStream if loop else AcceptedPeerStream)(call)  # type: ignore[arg-type]
    seen: list[Any] = []

    def feed(item: Any) -> None:
        if item == "end":
            stream.end(StatusCode.UNAVAILABLE, "gone")
        elif item == "reset":
            call.peer_reset()
        else:
            call.received(item)

    for item in script[:early]:
        feed(item)
    result = outcome(stream, stream.read_each(handler_for(stream, seen)))
    for item in script[early:]:
        feed(item)
    return seen, result, list(call._inbox), stream.closed


items = st.lists(st.one_of(st.integers(0, 15), st.none(), st.just("end"), st.just("reset")), max_size=12)


@given(items, st.integers(0, 12))
def test_read_each_handles_what_the_recv_loop_did_and_ends_the_same_way(script: list[Any], early: int) -> None:
    assert run(script, early, loop=False) == run(script, early, loop=True)


def test_ended_here_while_waiting_for_the_next_message_the_read_ends_at_once() -> None:
    seen: list[Any] = []
    stream = AcceptedPeerStream(ScriptedServerCall())  # type: ignore[arg-type]
    result = outcome(stream, stream.read_each(seen.append))
    stream.call.received(1)
    stream.end(StatusCode.UNAVAILABLE, "gone")  # an abort: the call itself wakes no reader
    assert (seen, result) == ([1], [("done", None)])


def test_ended_by_a_message_the_messages_behind_it_are_not_handled() -> None:
    call, seen = ScriptedServerCall(), []
    stream = AcceptedPeerStream(call)  # type: ignore[arg-type]
    for message in (1, 5, 2, 3):
        call.received(message)
    result = outcome(stream, stream.read_each(handler_for(stream, seen)))
    assert (seen, result) == ([1, 5], [("done", None)])


def test_a_reset_here_while_waiting_or_while_handling_ends_the_read_as_closed_here() -> None:
    for script in ([1, "reset-here"], [6, 2]):
        call, seen = ScriptedServerCall(), []
        stream = AcceptedPeerStream(call)  # type: ignore[arg-type]
        d = stream.read_each(handler_for(stream, seen))
        results: list[Any] = []
        d.addBoth(results.append)
        for item in script:
            if item == "reset-here":
                call.buffered_amount = 1
                stream.end(StatusCode.UNAVAILABLE, "engines gone")
            else:
                call.received(item)
        assert results == [None] and call.ended_with is not None


def test_the_peers_half_close_ends_the_read_and_the_peers_reset_fails_it() -> None:
    call, seen = ScriptedServerCall(), []
    stream = AcceptedPeerStream(call)  # type: ignore[arg-type]
    result = outcome(stream, stream.read_each(seen.append))
    call.received(1)
    call.received(None)
    assert (seen, result) == ([1], [("done", None)])
    call = ScriptedServerCall()
    stream = AcceptedPeerStream(call)  # type: ignore[arg-type]
    result = outcome(stream, stream.read_each(seen.append))
    call.peer_reset()
    assert result == [("failed", GrpcError)] and not stream.closed


def test_a_stream_ended_before_its_read_starts_reads_nothing() -> None:
    call = ScriptedServerCall()
    stream = AcceptedPeerStream(call)  # type: ignore[arg-type]
    stream.end(StatusCode.FAILED_PRECONDITION, "refused")
    call._inbox.append(1)
    seen: list[Any] = []
    assert outcome(stream, stream.read_each(seen.append)) == [("done", None)] and seen == []
