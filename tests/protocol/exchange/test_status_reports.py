"""Status reports between gateways, pure: full snapshots for LLMariner peers, deltas for infx
peers (numbered, a gap refused), load-only changes told apart, and a dialled peer that coalesces
load counts on a hand-stepped clock while readiness and model changes go at once."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from protocol.exchange.dialled_peer import DialledPeerConfig, DialledPeerState
from protocol.exchange.accepted_peer import AcceptedPeer
from protocol.exchange.status_reports import (
    STATUS_DELTA_METADATA,
    LocalStatuses,
    ReportReader,
    ReportWriter,
    offers_deltas,
    shape_of,
)
from protocol.pb import internal_pb2, status_pb2
from protocol.processor.core import Processor
from protocol.processor.config import ProcessorConfig
from protocol.processor.errors import PeerProtocolError
from protocol.processor.keys import EngineKey, Locality
from tests.support.processor import engine_status
from tests.support.dialled_peer import BufferedReceiver

T0 = 100.0


def statuses(*engines: tuple[str, bool, int]) -> list[tuple[str, status_pb2.EngineStatus]]:
    """(engine id, ready, in-progress count) of tenant t's engines serving model m."""
    out = []
    for engine_id, ready, in_progress in engines:
        status = engine_status(engine_id, "m", ready=ready)
        status.models[0].in_progress_task_count = in_progress
        out.append(("t", status))
    return out


class Writer(ReportWriter):
    """A writer over its own :class:`LocalStatuses`, refreshed with each list it reports."""

    def __init__(self, pod_name: str) -> None:
        super().__init__(pod_name)
        self.local = LocalStatuses()

    def report_of(self, current: list[tuple[str, status_pb2.EngineStatus]], counts: dict[str, int], draining: bool,
                  force: bool) -> internal_pb2.ServerStatus | None:
        return self.report(self.local.refresh(copies(current)), counts, draining, force)


def copies(current: list[tuple[str, status_pb2.EngineStatus]]) -> list[tuple[str, status_pb2.EngineStatus]]:
    """What ``Processor.local_engines`` hands over: copies the dialled peer side may keep."""
    out = []
    for tenant, status in current:
        copy = status_pb2.EngineStatus()
        copy.CopyFrom(status)
        out.append((tenant, copy))
    return out


def ids(report: internal_pb2.ServerStatus) -> list[str]:
    return [e.engine_status.engine_id for e in report.engine_statuses]


# --- negotiation and shapes -------------------------------------------------------------


def test_only_the_delta_header_with_value_1_offers_deltas():
    assert offers_deltas(STATUS_DELTA_METADATA)
    assert offers_deltas((("content-type", "application/grpc"), ("x-infx-status-delta", b"1")))
    assert not offers_deltas(())  # a LLMariner accepted peer
    assert not offers_deltas((("x-infx-status-delta", "0"),))


def test_the_shape_of_a_status_ignores_load_counts_but_not_readiness_or_models():
    [(_, a)], [(_, busy)] = statuses(("e1", True, 0)), statuses(("e1", True, 7))
    busy.models[0].runtime_load.running_requests = 3
    busy.models[0].runtime_load.kv_cache_usage = 0.5
    busy.infx_slot_keeping.restored = 2  # the slot keeper's counts too
    assert shape_of(a) == shape_of(busy) and a != busy
    answered = status_pb2.EngineStatus()
    answered.CopyFrom(a)
    answered.models[0].infx_prompt_cache.cached_tokens = 400  # sent at once, as the real runs measured
    assert shape_of(answered) != shape_of(a)
    [(_, not_ready)] = statuses(("e1", False, 0))
    assert shape_of(not_ready) != shape_of(a)
    more = status_pb2.EngineStatus()
    more.CopyFrom(a)
    more.models.add(id="n", is_ready=True)
    assert shape_of(more) != shape_of(a)


# --- the writer ----------------------------------------------------------------------------


def test_without_an_offer_every_report_is_a_full_snapshot_as_a_llmariner_peer_expects():
    writer = Writer("gw")
    first = writer.report_of(statuses(("e1", True, 0), ("e2", True, 0)), {}, False, force=True)
    assert first is not None and not first.delta and ids(first) == ["e1", "e2"] and first.sequence == 1
    changed = writer.report_of(statuses(("e1", True, 1), ("e2", True, 0)), {"m": 1}, False, force=False)
    assert changed is not None and not changed.delta and ids(changed) == ["e1", "e2"]
    assert dict(changed.model_requests_started) == {"m": 1}
    gone = writer.report_of(statuses(("e2", True, 0)), {"m": 1}, False, force=False)
    assert gone is not None and not gone.delta and ids(gone) == ["e2"] and not gone.removed_engines
    assert writer.report_of(statuses(("e2", True, 0)), {"m": 1}, False, force=False) is None


def test_with_an_offer_reports_carry_only_what_changed_after_the_first_full_snapshot():
    writer = Writer("gw")
    writer.deltas = True
    three = statuses(("e1", True, 0), ("e2", True, 0), ("e3", True, 0))
    first = writer.report_of(three, {"m": 2, "n": 1}, False, force=True)
    assert first is not None and not first.delta and ids(first) == ["e1", "e2", "e3"]
    one_busy = statuses(("e1", True, 0), ("e2", True, 4), ("e3", True, 0))
    delta = writer.report_of(one_busy, {"m": 3, "n": 1}, False, force=False)
    assert delta is not None and delta.delta and ids(delta) == ["e2"] and delta.sequence == 2
    assert dict(delta.model_requests_started) == {"m": 3}  # only the count that changed
    removed = writer.report_of(one_busy[:2], {"m": 3, "n": 1}, False, force=False)
    assert removed is not None and removed.delta and ids(removed) == []
    assert [(r.tenant_id, r.engine_id) for r in removed.removed_engines] == [("t", "e3")]
    counts_only = writer.report_of(one_busy[:2], {"m": 4, "n": 1}, False, force=False)
    assert counts_only is not None and counts_only.delta and ids(counts_only) == []
    # A delta no smaller than the snapshot is sent as the snapshot.
    all_changed = writer.report_of(statuses(("e1", False, 0), ("e2", False, 4)), {"m": 4, "n": 1}, True, force=False)
    assert all_changed is not None and not all_changed.delta and ids(all_changed) == ["e1", "e2"]
    assert all_changed.draining and dict(all_changed.model_requests_started) == {"m": 4, "n": 1}


# --- the reader ------------------------------------------------------------------------------


def test_the_reader_refuses_a_gap_and_a_delta_before_any_snapshot_and_skips_repeats():
    writer, reader = Writer("gw"), ReportReader()
    writer.deltas = True
    first = writer.report_of(statuses(("e1", True, 0), ("e2", True, 0)), {}, False, force=True)
    second = writer.report_of(statuses(("e1", True, 1), ("e2", True, 0)), {}, False, force=False)
    third = writer.report_of(statuses(("e1", True, 2), ("e2", True, 0)), {}, False, force=False)
    assert first and second and third and second.delta and third.delta
    with pytest.raises(PeerProtocolError, match="before any full"):
        ReportReader().read(second)
    assert reader.read(first) is not None
    assert reader.read(first) is None  # the same report twice: the repeat changes nothing
    with pytest.raises(PeerProtocolError, match="report 3 follows 1: a report was lost"):
        reader.read(third)
    read = reader.read(second)
    assert read is not None and read.upserted == (EngineKey("t", "e1"),) and not read.full
    assert reader.read(second) is None
    assert reader.read(third) is not None
    assert reader.engines[EngineKey("t", "e1")].models[0].in_progress_task_count == 2


def test_unnumbered_full_reports_of_a_llmariner_peer_each_replace_the_last():
    reader = ReportReader()
    full = internal_pb2.ServerStatus(pod_name="llm")
    full.engine_statuses.add(engine_status=engine_status("e1", "m"), tenant_id="t")
    full.engine_statuses.add(engine_status=engine_status("e2", "m"), tenant_id="t")
    assert reader.read(full) is not None and set(reader.engines) == {EngineKey("t", "e1"), EngineKey("t", "e2")}
    del full.engine_statuses[0]
    read = reader.read(full)
    assert read is not None and read.full and read.removed == (EngineKey("t", "e1"),)
    assert set(reader.engines) == {EngineKey("t", "e2")}


engine_sets = st.lists(
    st.dictionaries(st.sampled_from(["e1", "e2", "e3", "e4", "e5"]),
                    st.tuples(st.booleans(), st.integers(0, 3)), max_size=5),
    min_size=1, max_size=12)


@settings(max_examples=150, deadline=None)
@given(engine_sets, st.booleans())
def test_what_the_reader_holds_is_always_what_the_writer_reported_last(steps, deltas):
    """Whatever engines come, change and go, full snapshot or deltas, the reading side ends up
    with exactly the engines the writing side has, each with its latest status."""
    writer, reader = Writer("gw"), ReportReader()
    for index, engines in enumerate(steps):
        current = statuses(*[(engine_id, ready, load) for engine_id, (ready, load) in sorted(engines.items())])
        report = writer.report_of(current, {"m": index}, False, force=index == 0)
        if index == 0:
            writer.deltas = deltas
        if report is not None:
            assert report.delta is False or deltas
            reader.read(report)
        assert {key: status.SerializeToString(deterministic=True) for key, status in reader.engines.items()} == {
            EngineKey(tenant, status.engine_id): status.SerializeToString(deterministic=True)
            for tenant, status in current}
        assert reader.requests_started == {"m": index}


# --- the accepted peer over deltas ---------------------------------------------------------------------


def test_a_sender_registers_deltas_and_removes_what_a_delta_lists_as_gone():
    processor = Processor(ProcessorConfig())
    accepted_peer = AcceptedPeer(processor)
    writer = Writer("gw")
    writer.deltas = True

    def send(*engines: tuple[str, bool, int], force: bool = False) -> None:
        report = writer.report_of(statuses(*engines), {}, False, force)
        assert report is not None
        accepted_peer.message_received(internal_pb2.ProcessTasksInternalRequest(server_status=report), T0)

    send(("e1", True, 0), ("e2", True, 0), ("e3", True, 0), force=True)
    send(("e1", True, 0), ("e2", False, 0), ("e3", True, 0))
    view = processor.engine("t", "e2@gw")
    assert view is not None and not view.routable and view.locality is Locality.REMOTE
    send(("e1", True, 0), ("e2", False, 0))
    assert processor.engine("t", "e3@gw") is None
    assert accepted_peer.engines == {EngineKey("t", "e1@gw"), EngineKey("t", "e2@gw")}


# --- the dialled peer: coalesced load counts on a stepped clock ---------------------------------------


class Local:
    """A processor with local engines and one dialled peer (interval 8 s: load waits at most 2 s)."""

    def __init__(self) -> None:
        self.p = Processor(ProcessorConfig())
        self.r = BufferedReceiver(self.p, DialledPeerConfig("gw", status_interval=8))

    def engine(self, engine_id: str, now: float, ready: bool = True, in_progress: int = 0, *models: str) -> None:
        status = engine_status(engine_id, "m", *models, ready=ready)
        for model in status.models:
            model.in_progress_task_count = in_progress
        self.p.update_engine(f"engine:{engine_id}", "t", status, Locality.LOCAL, now)
        if self.r.state is not DialledPeerState.IDLE:
            self.r.local_engines_changed(now)

    def reports(self) -> list[internal_pb2.ServerStatus]:
        return [m.server_status for m in self.r.pop_messages()]


@pytest.fixture
def local() -> Local:
    h = Local()
    h.engine("e1", T0)
    h.engine("e2", T0)
    h.r.connected(T0)
    h.r.deltas_offered(T0)
    assert [ids(r) for r in h.reports()] == [["e1", "e2"]]
    return h


def test_a_load_count_change_rides_the_next_report_within_a_quarter_interval(local):
    for step in range(1, 6):  # a busy engine: one status per task, a report only every 2 s
        local.engine("e1", T0 + step * 0.3, in_progress=step)
    assert local.reports() == [] and local.r.next_deadline() == T0 + 0.3 + 2
    assert local.r.handle_timeout(T0 + 2.29) == [] and local.reports() == []
    local.r.handle_timeout(T0 + 2.3)
    [report] = local.reports()
    assert report.delta and ids(report) == ["e1"]
    assert report.engine_statuses[0].engine_status.models[0].in_progress_task_count == 5
    assert local.r.next_deadline() == T0 + 2.3 + 8  # back to the periodic check


def test_readiness_and_model_changes_go_at_once_and_carry_the_pending_load(local):
    local.engine("e1", T0 + 1, in_progress=3)
    assert local.reports() == []
    local.engine("e2", T0 + 1.5, ready=False)
    [report] = local.reports()
    assert ids(report) == ["e1", "e2"]  # both changed: the full snapshot is no bigger than a delta
    assert [e.engine_status.ready for e in report.engine_statuses] == [True, False]
    assert report.engine_statuses[0].engine_status.models[0].in_progress_task_count == 3
    assert local.r.next_deadline() == T0 + 1.5 + 8  # nothing coalesced is left
    local.engine("e1", T0 + 2, True, 3, "n")  # a model added
    assert [ids(r) for r in local.reports()] == [["e1"]]
    local.engine("e3", T0 + 3)  # an engine joined
    assert [ids(r) for r in local.reports()] == [["e3"]]


def test_a_load_change_that_reverts_before_it_is_due_sends_nothing(local):
    local.engine("e1", T0 + 1, in_progress=1)
    local.engine("e1", T0 + 1.5, in_progress=0)
    local.r.handle_timeout(T0 + 3)
    assert local.reports() == []


@settings(max_examples=100, deadline=None)
@given(engine_sets, st.lists(st.booleans(), min_size=12, max_size=12))
def test_a_sender_fed_deltas_registers_what_a_sender_fed_snapshots_does(steps, draining):
    """Two gateways hear the same changes of a peer's engines, one as deltas, one as full
    snapshots: after every report their processors hold the same remote engines, alike."""
    sides = []
    for deltas in (True, False):
        writer = Writer("gw")
        writer.deltas = deltas
        sides.append((writer, Processor(ProcessorConfig())))
    senders = [AcceptedPeer(processor) for _, processor in sides]
    for index, engines in enumerate(steps):
        current = statuses(*[(engine_id, ready, load) for engine_id, (ready, load) in sorted(engines.items())])
        for (writer, _), accepted_peer in zip(sides, senders):
            report = writer.report_of(current, {}, draining[index], force=index == 0)
            if report is not None:
                accepted_peer.message_received(internal_pb2.ProcessTasksInternalRequest(server_status=report), T0)
        views = [processor.status()["tenants"] for _, processor in sides]
        assert views[0] == views[1]
        assert sorted(views[0].get("t", {}).get("engines", {})) == sorted(f"{e}@gw" for e in engines)


def test_an_engine_without_an_id_in_a_peers_report_is_a_protocol_error() -> None:
    """Found by tests/hostile/test_pb.py: it reached the processor as a caller's misuse."""
    report = internal_pb2.ServerStatus(pod_name="peer")
    report.engine_statuses.add(engine_status=status_pb2.EngineStatus(ready=True), tenant_id="t")
    with pytest.raises(PeerProtocolError, match="without an engine_id"):
        ReportReader().read(report)


# --- the shared local engines against the writer that compared every engine -----------------------


class ScanningWriter:
    """The dialled peer's reports before :class:`LocalStatuses`: every local engine copied, put in
    model order, marked not ready when draining, serialized and compared, on every report."""

    def __init__(self) -> None:
        self.deltas = False
        self.sequence = 0
        self.engines: dict[tuple[str, str], tuple[bytes, bytes]] = {}
        self.counts: dict[str, int] = {}
        self.draining: bool | None = None

    @staticmethod
    def local(current: list[tuple[str, status_pb2.EngineStatus]],
              draining: bool) -> list[tuple[str, status_pb2.EngineStatus]]:
        out = sorted(copies(current), key=lambda item: (item[0], item[1].engine_id))
        for _, status in out:
            models = sorted(status.models, key=lambda m: m.id)
            ordered = [status_pb2.EngineStatus.Model() for _ in models]
            for copy, model in zip(ordered, models):
                copy.CopyFrom(model)
            del status.models[:]
            status.models.extend(ordered)
            if draining:
                status.ready = False
        return out

    def urgent(self, current: list[tuple[str, status_pb2.EngineStatus]], draining: bool) -> bool:
        if draining != self.draining:
            return True
        local = self.local(current, draining)
        for tenant, status in local:
            last = self.engines.get((tenant, status.engine_id))
            if last is None or last[1] != shape_of(status):
                return True
        return len(local) != len(self.engines)

    def report(self, current: list[tuple[str, status_pb2.EngineStatus]], counts: dict[str, int], draining: bool,
               force: bool) -> internal_pb2.ServerStatus | None:
        now = {(tenant, s.engine_id): s for tenant, s in self.local(current, draining)}
        wire = {key: s.SerializeToString(deterministic=True) for key, s in now.items()}
        changed = [key for key, data in wire.items() if key not in self.engines or self.engines[key][0] != data]
        removed = [key for key in self.engines if key not in now]
        new_counts = {model: count for model, count in counts.items() if self.counts.get(model) != count}
        if not (force or changed or removed or new_counts or draining != self.draining):
            return None
        self.sequence += 1
        report = internal_pb2.ServerStatus(pod_name="gw", draining=draining, sequence=self.sequence)
        if force or not self.deltas or self.draining is None or len(changed) + len(removed) >= len(now):
            report.model_requests_started.update(counts)
            for key in sorted(now):
                report.engine_statuses.add(engine_status=now[key], tenant_id=key[0])
        else:
            report.delta = True
            report.model_requests_started.update(new_counts)
            for key in sorted(changed):
                report.engine_statuses.add(engine_status=now[key], tenant_id=key[0])
            for tenant, engine_id in sorted(removed):
                report.removed_engines.add(engine_id=engine_id, tenant_id=tenant)
        for key in changed:
            self.engines[key] = (wire[key], shape_of(now[key]))
        for key in removed:
            del self.engines[key]
        self.counts = dict(counts)
        self.draining = draining
        return report


def local_engines(engines: dict[tuple[str, str], tuple[bool, int, tuple[str, ...]]]) -> list[
        tuple[str, status_pb2.EngineStatus]]:
    """What ``Processor.local_engines`` could hand over: models in any order, spilled tips on some."""
    out = []
    for (tenant, engine_id), (ready, load, models) in engines.items():
        status = status_pb2.EngineStatus(engine_id=engine_id, ready=ready, cluster_id="c1")
        for model in models:
            entry = status.models.add(id=model, is_ready=model != "n", in_progress_task_count=load)
            entry.infx_prefix_tips.extend([load, 7] if model == "m" and load else [])
        out.append((tenant, status))
    return out


shared_steps = st.lists(st.tuples(
    st.dictionaries(st.tuples(st.sampled_from(["t", "u"]), st.sampled_from([f"e{i}" for i in range(12)])),
                    st.tuples(st.booleans(), st.integers(0, 2), st.permutations(["m", "n"]).map(tuple)), max_size=4),
    st.lists(st.tuples(st.booleans(), st.booleans(), st.booleans()), min_size=3, max_size=3),
    st.integers(0, 2),
), min_size=1, max_size=40)


@settings(max_examples=200, deadline=None)
@given(shared_steps, st.lists(st.booleans(), min_size=3, max_size=3))
def test_writers_sharing_one_local_statuses_report_what_writers_scanning_every_engine_did(steps, deltas):
    """Three streams of one gateway report its local engines, each at its own times (so some lag
    many changes behind, past what a change log with no slack keeps), draining or not, forced or
    not: each report, and each answer to whether a change is urgent, is the scanning writer's, byte
    for byte."""
    local = LocalStatuses(slack=0)
    fast = [ReportWriter("gw") for _ in deltas]
    scanning = [ScanningWriter() for _ in deltas]
    for index, (engines, turns, count) in enumerate(steps):
        current = local_engines(engines)
        local.refresh(copies(current))
        for writer, reference, wants_deltas, (reports, draining, force) in zip(fast, scanning, deltas, turns):
            assert writer.urgent(local, draining) == reference.urgent(current, draining)
            if reports or index == 0:
                ours = writer.report(local, {"m": count}, draining, force or index == 0)
                theirs = reference.report(current, {"m": count}, draining, force or index == 0)
                assert (ours is None) == (theirs is None)
                if ours is not None and theirs is not None:
                    assert ours.SerializeToString(deterministic=True) == theirs.SerializeToString(deterministic=True)
            if index == 0:
                writer.deltas = reference.deltas = wants_deltas


def test_a_writer_behind_what_the_change_log_keeps_compares_every_engine():
    local = LocalStatuses()
    writer = ReportWriter("gw")
    writer.deltas = True
    steady = [("e3", True, 0), ("e4", True, 0)]
    first = writer.report(local.refresh(copies(statuses(("e1", True, 0), ("e2", True, 0), *steady))), {}, False,
                          force=True)
    assert first is not None and local.generation == 1
    for load in range(1, 30):  # one entry per engine: e1 changing often keeps the log short
        local.refresh(copies(statuses(("e1", True, load), ("e2", True, 0), *steady)))
    assert local.changed_since(1) == [("t", "e1")]
    for index in range(30):  # engines that come and go leave entries until the log is trimmed
        local.refresh(copies(statuses(("e1", True, 29), ("e2", True, 0), (f"x{index}", True, 0), *steady)))
    assert local.changed_since(1) is None
    assert sorted(local.changed_since(local.generation - 1) or []) == [("t", "x28"), ("t", "x29")]
    local.refresh(copies(statuses(("e1", True, 30), *steady)))  # and e2 goes
    delta = writer.report(local, {}, False, force=False)
    assert delta is not None and delta.delta and ids(delta) == ["e1"]
    assert [r.engine_id for r in delta.removed_engines] == ["e2"]
    assert writer.report(local, {}, False, force=False) is None
    unchanged = local.generation
    local.refresh(copies(statuses(("e1", True, 30), *steady)))
    assert local.generation == unchanged and local.changed_since(unchanged) == []
