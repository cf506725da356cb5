"""The repeat suppressor: the first failure logged, then counts, never one line per retry."""

from hypothesis import given
from hypothesis import strategies as st

from protocol.repeats import RepeatKind, RepeatSuppressor


def test_first_occurrence_is_reported_and_repeats_are_counted_silently():
    repeats = RepeatSuppressor(summary_interval=300)
    [first] = repeats.occurred("stream", "UNAUTHENTICATED: bad key", 0)
    assert (first.kind, first.count, first.text()) == (RepeatKind.FIRST, 1, "UNAUTHENTICATED: bad key")
    for second in range(1, 100):
        assert repeats.occurred("stream", "UNAUTHENTICATED: bad key", second) == []
    assert repeats.repeating("stream") == 100


def test_a_failure_that_goes_on_is_summarised_every_interval():
    repeats = RepeatSuppressor(summary_interval=300)
    repeats.occurred("k", "down", 0)
    lines = [r for t in range(10, 901, 10) for r in repeats.occurred("k", "down", t)]
    assert [(r.kind, r.count, r.seconds) for r in lines] == [
        (RepeatKind.ONGOING, 30, 300), (RepeatKind.ONGOING, 30, 300), (RepeatKind.ONGOING, 30, 300)]
    assert lines[0].text() == "down (repeated 30 more times in 300s)"


def test_success_after_repeats_reports_the_total_once():
    repeats = RepeatSuppressor()
    for t in range(5):
        repeats.occurred("k", "down", t)
    [stopped] = repeats.cleared("k", 7)
    assert (stopped.kind, stopped.count, stopped.seconds) == (RepeatKind.STOPPED, 5, 7)
    assert "5 times" in stopped.text()
    assert repeats.cleared("k", 8) == []
    assert repeats.occurred("k", "down", 9)[0].kind is RepeatKind.FIRST


def test_a_single_failure_then_success_needs_no_closing_line():
    repeats = RepeatSuppressor()
    repeats.occurred("k", "down", 0)
    assert repeats.cleared("k", 1) == []


def test_a_different_failure_closes_the_old_run_and_is_reported_at_once():
    repeats = RepeatSuppressor()
    repeats.occurred("k", "refused", 0)
    repeats.occurred("k", "refused", 1)
    stopped, first = repeats.occurred("k", "bad key", 2)
    assert (stopped.kind, stopped.message, stopped.count) == (RepeatKind.STOPPED, "refused", 2)
    assert (first.kind, first.message) == (RepeatKind.FIRST, "bad key")


def test_keys_are_independent():
    repeats = RepeatSuppressor()
    assert repeats.occurred("a", "down", 0)
    assert repeats.occurred("b", "down", 0)
    assert repeats.occurred("a", "down", 1) == []


@given(st.lists(st.tuples(st.integers(0, 50), st.sampled_from(["x", "y", "ok"])), max_size=200))
def test_lines_stay_few_and_every_occurrence_is_accounted_for(steps):
    """Whatever the sequence, each run is reported once at its start and closes with its full count."""
    repeats = RepeatSuppressor(summary_interval=1e9)
    now, counted, happened, firsts, runs = 0, 0, 0, 0, 0
    previous = None
    for gap, what in steps:
        now += gap
        if what == "ok":
            reports = repeats.cleared("k", now)
            previous = None
        else:
            happened += 1
            reports = repeats.occurred("k", what, now)
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
    repeats.occurred("host-1", "bad key", 0)
    repeats.occurred("host-1", "bad key", 1)
    repeats.occurred("host-2", "bad key", 2)
    stopped, first = repeats.occurred("host-3", "bad key", 3)
    assert (stopped.key, stopped.kind, stopped.count) == ("host-1", RepeatKind.STOPPED, 2)
    assert (first.key, first.kind) == ("host-3", RepeatKind.FIRST)
    assert repeats.repeating("host-1") == 0 and repeats.repeating("host-2") == 1
