"""Due times in one heap, pure: the earliest and what is due, against a scan of every key."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from protocol.gateway.due_times import DueTimes


def test_a_due_time_moved_earlier_later_or_cleared_is_what_counts():
    due: DueTimes[str] = DueTimes()
    assert due.earliest() is None and due.pop_due(100.0) == []
    due.set("b", 10.0, 1)
    due.set("c", 12.0, 2)
    assert due.earliest() == 10.0
    due.set("b", 15.0, 1)  # later: its 10.0 is stale
    assert due.earliest() == 12.0
    due.set("c", 5.0, 2)  # earlier
    assert due.earliest() == 5.0
    due.set("c", None, 2)  # not due at all
    assert due.earliest() == 15.0 and len(due) == 1
    assert due.pop_due(14.9) == [] and due.pop_due(15.0) == ["b"]
    assert due.earliest() is None and len(due) == 0


def test_what_is_due_by_now_comes_in_order_not_in_time_and_only_once():
    due: DueTimes[str] = DueTimes()
    due.set("first", 9.0, 0)
    due.set("second", 3.0, 1)
    due.set("third", 6.0, 2)
    due.set("third", 7.0, 2)
    due.set("third", 6.0, 2)  # back to a time it had: two live entries, one key
    assert due.pop_due(8.0) == ["second", "third"]
    assert due.pop_due(8.0) == [] and due.earliest() == 9.0


def test_a_heap_of_mostly_stale_entries_is_rebuilt_from_what_counts():
    due: DueTimes[int] = DueTimes()
    for step in range(500):
        due.set(step % 3, float(500 - step), step % 3)
    assert len(due._heap) <= 2 * 3 + 64
    assert due.earliest() == 1.0 and due.pop_due(3.0) == [0, 1, 2]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.one_of(
    st.tuples(st.just("set"), st.integers(0, 5), st.one_of(st.none(), st.integers(0, 40).map(float))),
    st.tuples(st.just("pop"), st.integers(0, 40).map(float)),
), max_size=80))
def test_the_heap_answers_what_a_scan_of_every_key_does(steps):
    due: DueTimes[int] = DueTimes()
    plain: dict[int, float] = {}
    for kind, *args in steps:
        if kind == "set":
            key, at = args
            due.set(key, at, order=10 - key)
            if at is None:
                plain.pop(key, None)
            else:
                plain[key] = at
        else:
            now = args[0]
            expected = sorted((k for k, at in plain.items() if at <= now), key=lambda k: 10 - k)
            assert due.pop_due(now) == expected
            for key in expected:
                del plain[key]
        assert due.earliest() == (min(plain.values()) if plain else None)
        assert len(due) == len(plain)
