"""CallBase.read_each: a call's messages handed over one call each, exactly as an ``await recv()``
loop that handles each at once would see them (order, end of input, the call's end, a raise)."""

from __future__ import annotations

from typing import Any

from hypothesis import given
from hypothesis import strategies as st
from twisted.internet.defer import Deferred

from infx.transport.calls import GrpcError
from tests.support.transport import ScriptedCall


class Refused(Exception):
    pass


def handler_for(call: ScriptedCall, seen: list[Any]) -> Any:
    def handle(message: int) -> None:
        seen.append(message)
        if message == 7:
            raise Refused()
        if message == 5:
            call.end()  # the handler's own work ends the call (as an abort would)
    return handle


def outcome(d: Deferred[Any]) -> Any:
    results: list[Any] = []
    d.addCallbacks(lambda v: results.append(("done", v)), lambda f: results.append(("failed", f.type)))
    return results


async def recv_loop(call: ScriptedCall, handle: Any) -> None:
    while True:
        message = await call.recv()
        if message is None:
            return
        handle(message)


def run(script: list[Any], early: int, each: bool) -> tuple[list[Any], list[Any], list[Any]]:
    """Feed ``early`` items before reading starts, the rest after; returns (seen, outcome, left unread)."""
    call, seen = ScriptedCall(), []
    handle = handler_for(call, seen)
    for item in script[:early]:
        call.received(item) if item != "end" else call.end()
    d = call.read_each(handle) if each else Deferred.fromCoroutine(recv_loop(call, handle))
    result = outcome(d)
    for item in script[early:]:
        call.received(item) if item != "end" else call.end()
    return seen, result, [i for i in call._inbox]


items = st.lists(st.one_of(st.integers(0, 15), st.none(), st.just("end")), max_size=12)


@given(items, st.integers(0, 12))
def test_read_each_hands_over_what_a_recv_loop_would_and_ends_the_same_way(script: list[Any], early: int) -> None:
    assert run(script, early, each=True) == run(script, early, each=False)


def test_messages_already_received_go_first_then_each_as_it_arrives_and_the_half_close_ends_it() -> None:
    call, seen = ScriptedCall(), []
    call.received(1)
    call.received(2)
    result = outcome(call.read_each(seen.append))
    call.received(3)
    assert (seen, result) == ([1, 2, 3], [])
    call.received(None)
    assert result == [("done", None)]


def test_a_call_ended_while_a_message_is_handled_is_seen_after_it() -> None:
    call, seen = ScriptedCall(), []
    result = outcome(call.read_each(handler_for(call, seen)))
    call.received(5)  # its handling ends the call: read_each must not fire inside the handler
    assert seen == [5] and result == [("failed", GrpcError)]


def test_recv_while_read_each_waits_is_refused() -> None:
    call = ScriptedCall()
    call.read_each(lambda m: None)
    assert outcome(call.recv())[0][0] == "failed"
    assert outcome(ScriptedCall().recv()) == []  # a plain recv() waits
