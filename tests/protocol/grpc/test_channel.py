"""protocol.grpc.channel: a client channel's connectivity, redial backoff and
transparent-retry eligibility, on a hand-stepped clock with a seeded rng."""

from __future__ import annotations

import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from protocol.backoff import Backoff
from protocol.grpc.channel import (
    MAX_ATTEMPTS,
    RETRY_BUFFER_LIMIT,
    AttachWaiting,
    CancelConnect,
    ChannelMachine,
    ChannelState,
    ChannelUsageError,
    CloseConnection,
    Connect,
    FailCall,
    ReleaseRetryBuffer,
    RetryCall,
)
from protocol.grpc.metadata import StatusCode

NO_JITTER = Backoff(initial=1.0, factor=2.0, cap=5.0, jitter=0.0)


def machine(backoff: Backoff = NO_JITTER, seed: int = 1) -> ChannelMachine[str]:
    return ChannelMachine(random.Random(seed), backoff)


def ready(m: ChannelMachine[str], *calls: str) -> None:
    """Dial and connect, attaching ``calls`` as the adapter would."""
    for call in calls:
        m.call_opened(call, None, False, 0.0)
    if m.state is ChannelState.IDLE:
        assert m.call_opened("dial", None, False, 0.0) == [Connect()]
    effects = m.connect_succeeded(0.0)
    assert effects == ([AttachWaiting()] if m.waiting else [])
    for call in m.waiting:
        m.call_attached(call, 0.0)


def test_the_first_call_dials_and_waits_until_the_connection_is_ready() -> None:
    m = machine()
    assert m.state is ChannelState.IDLE
    assert m.call_opened("a", None, False, 0.0) == [Connect()]
    assert m.state is ChannelState.CONNECTING
    assert m.call_opened("b", None, False, 0.0) == []
    assert m.waiting == ("a", "b")
    assert m.connect_succeeded(0.5) == [AttachWaiting()]
    assert m.state is ChannelState.READY
    m.call_attached("a", 0.5)
    m.call_attached("b", 0.5)
    assert m.waiting == ()


def test_on_a_ready_channel_a_call_attaches_at_once_unless_others_wait_ahead_of_it() -> None:
    m = machine()
    ready(m)
    assert m.call_opened("a", None, False, 1.0) == [AttachWaiting()]
    # "a" did not fit (the peer's stream limit): "b" queues behind it, no new attach.
    assert m.call_opened("b", None, False, 1.0) == []
    assert m.waiting == ("a", "b")
    # A call ending frees a stream: try the waiting ones again.
    assert m.call_finished("dial", 2.0) == [AttachWaiting()]


def test_a_failed_dial_fails_calls_not_waiting_for_ready_and_redials_after_the_backoff() -> None:
    m = machine()
    m.call_opened("a", None, False, 0.0)
    m.call_opened("patient", None, True, 0.0)
    effects = m.connect_failed("refused", 10.0)
    assert effects == [FailCall("a", StatusCode.UNAVAILABLE, "connect failed: refused")]
    assert m.state is ChannelState.TRANSIENT_FAILURE
    assert m.waiting == ("patient",)
    assert m.next_deadline() == 11.0
    # Meanwhile a new call fails fast unless it waits for ready.
    assert m.call_opened("c", None, False, 10.5) == [
        FailCall("c", StatusCode.UNAVAILABLE, "not connected")]
    assert m.handle_timeout(10.9) == []
    assert m.handle_timeout(11.0) == [Connect()]
    assert m.state is ChannelState.CONNECTING


def test_consecutive_failures_back_off_exponentially_and_a_success_starts_over() -> None:
    m = machine()
    m.call_opened("patient", None, True, 0.0)
    now, delays = 0.0, []
    for _ in range(5):
        m.connect_failed("refused", now)
        deadline = m.next_deadline()
        assert deadline is not None
        delays.append(deadline - now)
        now = deadline
        assert m.handle_timeout(now) == [Connect()]
    assert delays == [1.0, 2.0, 4.0, 5.0, 5.0]
    m.connect_succeeded(now)
    m.call_attached("patient", now)
    m.connection_ended(now)
    m.call_opened("next", None, True, now)
    m.connect_failed("refused", now)
    assert m.next_deadline() == now + 1.0


def test_the_jitter_comes_from_the_rng_it_was_given() -> None:
    backoff = Backoff(initial=1.0, factor=2.0, cap=5.0, jitter=0.2)
    deadlines = []
    for _ in range(2):
        m = machine(backoff, seed=7)
        m.call_opened("a", None, True, 0.0)
        m.connect_failed("refused", 0.0)
        deadlines.append(m.next_deadline())
    assert deadlines[0] == deadlines[1] == backoff.delay(1, random.Random(7).random())


def test_a_waiting_call_fails_at_its_deadline() -> None:
    m = machine()
    m.call_opened("a", 3.0, True, 0.0)
    m.call_opened("b", None, True, 0.0)
    m.connect_failed("refused", 0.0)
    assert m.next_deadline() == 1.0
    m.handle_timeout(1.0)
    assert m.next_deadline() == 3.0
    assert m.handle_timeout(3.0) == [FailCall(
        "a", StatusCode.DEADLINE_EXCEEDED, "deadline exceeded while waiting for a connection")]
    assert m.waiting == ("b",)
    assert m.next_deadline() is None


def test_an_attached_call_has_no_waiting_deadline() -> None:
    m = machine()
    ready(m)
    m.call_opened("a", 3.0, False, 0.0)
    m.call_attached("a", 0.0)
    assert m.next_deadline() is None
    assert m.handle_timeout(5.0) == []


def test_a_goaway_sends_waiting_calls_to_a_new_connection() -> None:
    m = machine()
    ready(m, "old")
    assert m.connection_ended(1.0) == []
    assert m.state is ChannelState.IDLE
    assert m.call_opened("new", None, False, 1.0) == [Connect()]
    m2 = machine()
    ready(m2)
    m2.call_opened("x", None, False, 0.0)  # did not fit
    assert m2.connection_ended(1.0) == [Connect()]


def test_a_refused_call_is_retried_first_while_its_requests_fit_the_retry_buffer() -> None:
    m = machine()
    ready(m, "a")
    m.call_opened("b", None, False, 0.0)  # waits behind the stream limit
    assert m.message_queued("a", 1000, 0.0) == []
    assert m.call_refused("a", 0.1) == [RetryCall("a"), AttachWaiting()]
    assert m.waiting == ("a", "b")


def test_a_call_refused_by_goaway_is_retried_on_a_new_connection() -> None:
    m = machine()
    ready(m, "a")
    m.connection_ended(0.1)
    assert m.call_refused("a", 0.1) == [RetryCall("a"), Connect()]


def test_a_call_that_sent_more_than_the_retry_buffer_is_not_retried() -> None:
    m = machine()
    ready(m, "a")
    assert m.message_queued("a", RETRY_BUFFER_LIMIT, 0.0) == []
    assert m.message_queued("a", 1, 0.0) == [ReleaseRetryBuffer("a")]
    assert m.message_queued("a", 1, 0.0) == []
    assert m.call_refused("a", 0.1) == []


def test_a_call_the_server_answered_is_not_retried() -> None:
    m = machine()
    ready(m, "a")
    assert m.response_started("a", 0.0) == [ReleaseRetryBuffer("a")]
    assert m.response_started("a", 0.0) == []
    assert m.call_refused("a", 0.1) == []


def test_a_call_is_tried_at_most_max_attempts_times() -> None:
    m = machine()
    ready(m, "a")
    for _ in range(MAX_ATTEMPTS - 1):
        assert RetryCall("a") in m.call_refused("a", 0.1)
        m.call_attached("a", 0.1)
    assert m.call_refused("a", 0.1) == []


def test_a_call_past_its_deadline_is_not_retried() -> None:
    m = machine()
    ready(m)
    m.call_opened("a", 2.0, False, 0.0)
    m.call_attached("a", 0.0)
    assert m.call_refused("a", 2.0) == []


def test_close_fails_waiting_calls_cancels_the_dial_and_refuses_new_calls() -> None:
    m = machine()
    m.call_opened("a", 5.0, True, 0.0)
    assert m.close(1.0) == [CancelConnect(),
                            FailCall("a", StatusCode.UNAVAILABLE, "channel closed")]
    assert m.state is ChannelState.SHUTDOWN
    assert m.next_deadline() is None
    assert m.call_opened("b", None, True, 1.0) == [
        FailCall("b", StatusCode.UNAVAILABLE, "channel closed")]
    # A dial that completes anyway is closed; a failed one is ignored.
    assert m.connect_succeeded(1.5) == [CloseConnection()]
    assert m.connect_failed("late", 1.5) == []


def test_close_of_a_ready_channel_closes_its_connection() -> None:
    m = machine()
    ready(m)
    assert m.close(1.0) == [CloseConnection()]
    assert m.connection_ended(1.0) == []


def test_misuse_is_a_channel_usage_error() -> None:
    m = machine()
    with pytest.raises(ChannelUsageError):
        m.connect_succeeded(0.0)  # nothing was dialled
    m.call_opened("a", None, False, 0.0)
    with pytest.raises(ChannelUsageError):
        m.call_opened("a", None, False, 0.0)
    with pytest.raises(ChannelUsageError):
        m.message_queued("unknown", 1, 0.0)
    with pytest.raises(ChannelUsageError):
        m.connection_ended(0.0)  # not ready


@given(st.lists(st.tuples(st.sampled_from(
    ["open", "open_patient", "attach", "finish", "refuse", "ok", "fail", "end", "tick"]),
    st.integers(0, 5)), max_size=60), st.integers(0, 2**16))
def test_any_sequence_keeps_waiting_calls_open_and_the_deadline_in_the_future(
        steps: list[tuple[str, int]], seed: int) -> None:
    """Whatever the adapter feeds (within the rules), every waiting call is an
    open one, each appears once, and after handle_timeout nothing is overdue."""
    m: ChannelMachine[int] = ChannelMachine(random.Random(seed), Backoff(initial=1.0))
    now, opened, finished = 0.0, 0, set()
    for action, n in steps:
        now += 0.25
        if action.startswith("open"):
            for effect in m.call_opened(opened, now + 1 + n, action == "open_patient", now):
                if isinstance(effect, FailCall):
                    finished.add(effect.call)  # never open: the adapter ends it at once
            opened += 1
        elif action == "attach" and m.waiting and m.state is ChannelState.READY:
            m.call_attached(m.waiting[0], now)
        elif action in ("finish", "refuse") and opened:
            call = n % opened
            if call in finished:
                continue
            if action == "refuse" and call not in m.waiting:
                m.call_refused(call, now)
            else:
                m.call_finished(call, now)
                finished.add(call)
        elif action == "ok" and m.state is ChannelState.CONNECTING:
            m.connect_succeeded(now)
        elif action == "fail" and m.state is ChannelState.CONNECTING:
            for effect in m.connect_failed("x", now):
                if isinstance(effect, FailCall):
                    m.call_finished(effect.call, now)
                    finished.add(effect.call)
        elif action == "end" and m.state is ChannelState.READY:
            m.connection_ended(now)
        elif action == "tick":
            for effect in m.handle_timeout(now):
                if isinstance(effect, FailCall):
                    m.call_finished(effect.call, now)
                    finished.add(effect.call)
            deadline = m.next_deadline()
            assert deadline is None or deadline > now
        assert len(set(m.waiting)) == len(m.waiting)
        assert not set(m.waiting) & finished
