"""The repeat suppressor: the first failure logged, then counts, never one line per retry."""

from hypothesis import given
from hypothesis import strategies as st

from protocol.repeats import RepeatKind, RepeatSuppressor


def test_first_occurrence_is_reported_and_repeats_are_counted_silently():
    repeats = RepeatSuppressor(summary_interval=300)
    [first] = repeats.occurred(0, "stream", "UNAUTHENTICATED: bad key")
    assert (first.kind, first.count, first.text()) == (RepeatKind.FIRST, 1, "UNAUTHENTICATED: bad key")
    for second in range(1, 100):
        assert repeats.occurred(second, "stream", "UNAUTHENTICATED: bad key") == []
    assert repeats.repeating("stream") == 100


def test_a_failure_that_goes_on_is_summarised_every_interval():
    repeats = RepeatSuppressor(summary_interval=300)
    repeats.occurred(0, "k", "down")
    lines = [r for t in range(10, 901, 10) for r in repeats.occurred(t, "k", "down")]
    assert [(r.kind, r.count, r.seconds) for r in lines] == [
        (RepeatKind.ONGOING, 30, 300), (RepeatKind.ONGOING, 30, 300), (RepeatKind.ONGOING, 30, 300)]
    assert lines[0].text() == "down (repeated 30 more times in 300s)"


def test_success_after_repeats_reports_the_total_once():
    repeats = RepeatSuppressor()
    for t in range(5):
        repeats.occurred(t, "k", "down")
    [stopped] = repeats.cleared(7, "k")
    assert (stopped.kind, stopped.count, stopped.seconds) == (RepeatKind.STOPPED, 5, 7)
    assert "5 times" in stopped.text()
    assert repeats.cleared(8, "k") == []
    assert repeats.occurred(9, "k", "down")[0].kind is RepeatKind.FIRST


def test_a_single_failure_then_success_needs_no_closing_line():
    repeats = RepeatSuppressor()
    repeats.occurred(0, "k", "down")
    assert repeats.cleared(1, "k") == []


def test_a_different_failure_closes_the_old_run_and_is_reported_at_once():
    repeats = RepeatSuppressor()
    repeats.occurred(0, "k", "refused")
    repeats.occurred(1, "k", "refused")
    stopped, first = repeats.occurred(2, "k", "bad key")
    assert (stopped.kind, stopped.message, stopped.count) == (RepeatKind.STOPPED, "refused", 2)
    assert (first.kind, first.message) == (RepeatKind.FIRST, "bad key")


def test_keys_are_independent():
    repeats = RepeatSuppressor()
    assert repeats.occurred(0, "a", "down")
    assert repeats.occurred(0, "b", "down")
    assert repeats.occurred(1, "a", "down") == []


@given(st.lists(st.tuples(st.integers(0, 50), st.sampled_from(["x", "y", "ok"])), max_size=200))
def test_lines_stay_few_and_every_occurrence_is_accounted_for(steps):
    """Whatever the sequence, each run is reported once at its start and closes with its full count."""
    repeats = RepeatSuppressor(summary_interval=1e9)
    now, counted, happened, firsts, runs = 0, 0, 0, 0, 0
    previous = None
    for gap, what in steps:
        now += gap
        if what == "ok":
            reports = repeats.cleared(now, "k")
            previous = None
        else:
            happened += 1
            reports = repeats.occurred(now, "k", what)
            if what != previous:
                runs += 1
            previous = what
        for report in reports:
            if report.kind is RepeatKind.FIRST:
                firsts += 1
                counted += 1
            elif report.kind is RepeatKind.STOPPED:
                counted += report.count - 1
    counted += max(0, repeats.repeating("k") - 1)
    assert firsts == runs
    assert counted == happened


def test_keys_from_the_network_are_bounded_the_oldest_run_closing_with_its_count():
    repeats = RepeatSuppressor(max_keys=2)
    repeats.occurred(0, "host-1", "bad key")
    repeats.occurred(1, "host-1", "bad key")
    repeats.occurred(2, "host-2", "bad key")
    stopped, first = repeats.occurred(3, "host-3", "bad key")
    assert (stopped.key, stopped.kind, stopped.count) == ("host-1", RepeatKind.STOPPED, 2)
    assert (first.key, first.kind) == ("host-3", RepeatKind.FIRST)
    assert repeats.repeating("host-1") == 0 and repeats.repeating("host-2") == 1
