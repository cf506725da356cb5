"""Pure Lease decisions for leader election: acquire, renew, respect, take over, times."""

import pytest
from hypothesis import given, settings, strategies as st

from protocol.scaling.lease import (
    RenewSchedule,
    RoundDue,
    decide_lease,
    micro_time,
    parse_micro_time,
    release_lease,
)

NOW = 1_700_000_000.0


def lease(holder, renewed, duration=15, transitions=2, version="7"):
    return {"metadata": {"name": "infx-scaler", "resourceVersion": version},
            "spec": {"holderIdentity": holder, "leaseDurationSeconds": duration,
                     "renewTime": micro_time(renewed), "acquireTime": micro_time(renewed - 100),
                     "leaseTransitions": transitions}}


def test_missing_lease_is_created_by_us():
    d = decide_lease(None, "gw-a", "infx-scaler", 15, NOW)
    assert (d.leader, d.create) == (True, True)
    assert d.body["spec"]["holderIdentity"] == "gw-a"
    assert d.body["metadata"]["name"] == "infx-scaler"


def test_someone_elses_fresh_lease_is_respected():
    d = decide_lease(lease("gw-b", NOW - 5), "gw-a", "infx-scaler", 15, NOW)
    assert (d.leader, d.body) == (False, None)


def test_an_expired_lease_is_taken_over_with_its_resource_version():
    d = decide_lease(lease("gw-b", NOW - 15), "gw-a", "infx-scaler", 15, NOW)
    assert d.leader and not d.create
    spec = d.body["spec"]
    assert (spec["holderIdentity"], spec["leaseTransitions"]) == ("gw-a", 3)
    assert parse_micro_time(spec["acquireTime"]) == NOW
    assert d.body["metadata"]["resourceVersion"] == "7"  # the compare-and-set precondition


def test_our_own_lease_is_renewed_without_a_transition():
    d = decide_lease(lease("gw-a", NOW - 5), "gw-a", "infx-scaler", 15, NOW)
    assert d.leader
    assert d.body["spec"]["leaseTransitions"] == 2
    assert parse_micro_time(d.body["spec"]["renewTime"]) == NOW
    assert parse_micro_time(d.body["spec"]["acquireTime"]) == NOW - 105  # unchanged


def test_a_released_lease_is_taken_without_counting_a_transition():
    d = decide_lease(lease("", NOW - 1), "gw-a", "infx-scaler", 15, NOW)
    assert d.leader and d.body["spec"]["leaseTransitions"] == 2


def test_our_lease_is_released_at_its_resource_version_and_taken_at_once():
    body = release_lease(lease("gw-a", NOW - 2), "gw-a", NOW)
    spec = body["spec"]
    assert (spec["holderIdentity"], spec["leaseDurationSeconds"], spec["leaseTransitions"]) == ("", 1, 2)
    assert parse_micro_time(spec["renewTime"]) == NOW
    assert body["metadata"]["resourceVersion"] == "7"
    taken = decide_lease(body, "gw-b", "infx-scaler", 15, NOW + 0.1)
    assert taken.leader and taken.body["spec"]["holderIdentity"] == "gw-b"


def test_only_our_own_lease_is_released():
    assert release_lease(lease("gw-b", NOW - 2), "gw-a", NOW) is None
    assert release_lease(lease("", NOW - 2), "gw-a", NOW) is None
    assert release_lease(None, "gw-a", NOW) is None


def test_unreadable_times_count_as_expired():
    broken = lease("gw-b", NOW)
    broken["spec"]["renewTime"] = broken["spec"]["acquireTime"] = "yesterday"
    assert decide_lease(broken, "gw-a", "infx-scaler", 15, NOW).leader


@settings(max_examples=50, deadline=None)
@given(st.floats(min_value=0, max_value=4e9, allow_nan=False))
def test_micro_time_round_trips_to_the_microsecond(seconds):
    assert abs(parse_micro_time(micro_time(seconds)) - seconds) < 1e-5


def test_rfc3339_seconds_are_read_too():
    assert parse_micro_time("2023-11-14T22:13:20Z") == 1_700_000_000.0
    assert parse_micro_time(None) is None


@pytest.mark.parametrize("text", [
    "2026-11-30T12:17:11.009835Z", "2026-11-30T12:17:11.009835+00:00", "2026-11-30T12:17:11Z",
])
def test_lease_times_parse_in_every_spelling_of_utc(text):
    """A renewTime the server echoes as +00:00 must not read as 'expired' (every gateway would lead)."""
    assert parse_micro_time(text) == pytest.approx(1796041031.009835, abs=1.0)


def test_renew_rounds_are_due_at_start_then_every_interval_and_never_overlap():
    schedule = RenewSchedule(5.0)
    assert schedule.next_deadline() is None
    assert schedule.start(100.0) == [RoundDue()]
    assert schedule.next_deadline() is None  # a round is out
    assert schedule.handle_timeout(105.0) == []
    schedule.round_done(100.2)
    assert schedule.next_deadline() == 105.0
    assert schedule.handle_timeout(104.9) == []
    assert schedule.handle_timeout(105.0) == [RoundDue()]
    schedule.round_done(117.0)  # a slow round: the missed beats are skipped
    assert schedule.next_deadline() == 120.0
    schedule.stop()
    assert schedule.next_deadline() is None
    assert schedule.handle_timeout(200.0) == []


def test_a_renew_interval_must_be_positive():
    with pytest.raises(ValueError):
        RenewSchedule(0)
