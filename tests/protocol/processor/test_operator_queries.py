"""The processor's read-only queries behind /admin/status: each engine as it reported and is held,
and the live tasks' criticality mix; both scoped by tenant, neither changing anything."""

from protocol.processor.fair_queue import Criticality
from tests.support.processor import REMOTE, engine_status, join, make, submit


def test_engine_reports_give_each_engines_last_report_tasks_load_and_state_by_tenant():
    p = make(max_in_flight_per_engine=1)
    join(p, "e1", "m")
    join(p, "e2", "m", tenant="other", locality=REMOTE, route="peer-b")
    submit(p, "t1")
    submit(p, "t2")  # waits: e1 is full
    (mine,) = p.engine_reports("t")
    assert (mine.key.engine_id, mine.locality.value, mine.routable, mine.draining, mine.busy_until) == \
        ("e1", "local", True, False, None)
    assert mine.tasks == ("t1",) and mine.waiting == () and mine.load == 1
    assert mine.status == engine_status("e1", "m") and mine.route == "route-e1"
    assert [(r.key.tenant_id, r.key.engine_id, r.route) for r in p.engine_reports()] == \
        [("other", "e2", "peer-b"), ("t", "e1", "route-e1")]


def test_criticality_counts_are_the_live_tasks_by_tenant_and_criticality():
    p = make()
    join(p, "e1", "m")
    submit(p, "a", criticality=Criticality.CRITICAL)
    submit(p, "b")
    submit(p, "c", criticality=Criticality.SHEDDABLE)
    submit(p, "d", tenant="nobody-serves")  # waits: still live
    assert p.criticality_counts() == {("t", "critical"): 1, ("t", "standard"): 1, ("t", "sheddable"): 1,
                                      ("nobody-serves", "standard"): 1}
