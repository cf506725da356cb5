"""The ring of recent requests: found by id within its bound, scoped by tenant, failures kept apart."""

import pytest

from protocol.gateway.recent import RATE_LIMITED, RecentConfig, RecentRequests, RequestRecord


def record(request_id, status=200, tenant="t", error="", ended_at=1.0, **fields):
    return RequestRecord(request_id=request_id, tenant=tenant, endpoint="chat/completions", model="m",
                         started_at=0.0, ended_at=ended_at, status=status, error=error, **fields)


def test_a_request_is_found_by_its_id_with_its_route():
    recent = RecentRequests()
    recent.add(record("r1", served_by="gw-b", engine_id="gpu-0@gw-b", retries=1, queued_seconds=0.2))
    found = recent.find("r1")
    assert (found.served_by, found.engine_id, found.retries, found.queued_seconds) == ("gw-b", "gpu-0@gw-b", 1, 0.2)
    assert recent.find("unknown") is None


def test_a_tenant_finds_only_its_own_requests():
    recent = RecentRequests()
    recent.add(record("r1", tenant="a"))
    assert recent.find("r1", tenant="a") is not None
    assert recent.find("r1", tenant="b") is None


def test_the_ring_forgets_the_oldest_beyond_its_bound_and_its_index_with_it():
    recent = RecentRequests(RecentConfig(requests=3, failures=2))
    for n in range(10):
        recent.add(record(f"r{n}"))
    assert len(recent) == 3
    assert [recent.find(f"r{n}") is not None for n in range(10)] == [False] * 7 + [True] * 3
    assert len(recent._by_id) == 3


def test_failures_outlive_the_successes_that_follow_them_and_come_newest_first():
    recent = RecentRequests(RecentConfig(requests=3, failures=2))
    recent.add(record("f1", status=502, error="engine_lost"))
    recent.add(record("f2", status=503, error="engine_unavailable", tenant="other"))
    for n in range(10):
        recent.add(record(f"ok{n}"))
    assert [r.request_id for r in recent.failures()] == ["f2", "f1"]
    assert [r.request_id for r in recent.failures(tenant="t")] == ["f1"]
    assert recent.find("f1") is not None  # still searchable while a ring holds it
    recent.add(record("f3", status=500))
    recent.add(record("f4", status=500))
    assert recent.find("f1") is None and recent.find("f2") is None
    assert sorted(recent._by_id) == ["f3", "f4", "ok9"]


def test_an_id_seen_twice_finds_the_newest_and_the_older_leaving_does_not_lose_it():
    recent = RecentRequests(RecentConfig(requests=2, failures=1))
    recent.add(record("same", status=200, ended_at=1.0))
    recent.add(record("same", status=404, ended_at=2.0))
    recent.add(record("other"))
    assert recent.find("same").ended_at == 2.0


def test_rate_limit_refusals_are_counted_per_tenant_whatever_the_rings_forget():
    recent = RecentRequests(RecentConfig(requests=1, failures=1))
    for tenant in ("a", "a", "b"):
        recent.add(record("r", status=429, error=RATE_LIMITED, tenant=tenant))
    recent.add(record("r", status=429, error="tenant_cap", tenant="a"))
    assert recent.rate_limited == {"a": 2, "b": 1}


def test_memory_stays_bounded_whatever_mix_of_ids_and_failures_comes():
    recent = RecentRequests(RecentConfig(requests=50, failures=7))
    for n in range(5000):
        recent.add(record(f"r{n % 300}", status=500 if n % 3 == 0 else 200))
        assert len(recent._by_id) <= 57
    newest = {f"r{n % 300}" for n in range(4950, 5000)}
    assert {i for i in newest if recent.find(i) is not None} == newest


def test_bounds_below_one_are_refused():
    with pytest.raises(ValueError):
        RecentConfig(requests=0)
