"""infx.deadline.DeadlineTimer on a hand-stepped clock: one delayed call, at the machine's deadline."""

from __future__ import annotations

from twisted.internet import task

from infx.deadline import DeadlineTimer


def test_one_call_moved_only_when_the_deadline_moves_and_fired_once() -> None:
    clock = task.Clock()
    fired: list[float] = []
    timer = DeadlineTimer(clock, lambda: fired.append(clock.seconds()))
    timer.arm(5.0)
    (call,) = clock.getDelayedCalls()
    timer.arm(5.0)
    assert clock.getDelayedCalls() == [call]  # the same deadline keeps the same call
    timer.arm(3.0)
    assert [c.getTime() for c in clock.getDelayedCalls()] == [3.0]
    clock.advance(3.0)
    assert fired == [3.0] and clock.getDelayedCalls() == []
    timer.arm(3.0)  # due at once after firing: armed again, not taken as already armed
    clock.advance(0)
    assert fired == [3.0, 3.0]


def test_none_and_cancel_leave_nothing_armed() -> None:
    clock = task.Clock()
    timer = DeadlineTimer(clock, lambda: None)
    timer.arm(1.0)
    timer.arm(None)
    assert clock.getDelayedCalls() == []
    timer.arm(2.0)
    timer.cancel()
    assert clock.getDelayedCalls() == []
    timer.cancel()


def test_a_timer_that_may_fire_early_keeps_its_call_for_a_later_deadline_and_moves_it_for_an_earlier() -> None:
    clock = task.Clock()
    fired: list[float] = []
    timer = DeadlineTimer(clock, lambda: fired.append(clock.seconds()), early_ok=True)
    timer.arm(5.0)
    (call,) = clock.getDelayedCalls()
    timer.arm(9.0)
    assert clock.getDelayedCalls() == [call], "a later deadline keeps the earlier call"
    timer.arm(2.0)
    assert [c.getTime() for c in clock.getDelayedCalls()] == [2.0]
    clock.advance(2.0)
    assert fired == [2.0] and clock.getDelayedCalls() == []
    timer.arm(None)
    assert clock.getDelayedCalls() == []
