"""protocol.peers: which pods are peers, the peer set's changes, and the list-then-watch loop."""

from __future__ import annotations

import random
from typing import Any

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from protocol.peers import (
    Backoff,
    BookmarkReceived,
    InvalidPeerAddress,
    MalformedWatchObject,
    PeerAdded,
    PeerAddress,
    PeerAddressChanged,
    PeerRemoved,
    PeerSet,
    PodDeleted,
    PodState,
    PodUpdated,
    PodWatch,
    WatchErrorReceived,
    WatchMisuse,
    WatchState,
    desired_peer,
    parse_peer_address,
    parse_watch_event,
    pod_state,
)

PORT = 8083


def live(name: str, ip: str = "10.0.0.1", rv: str | None = None) -> PodState:
    return PodState(name=name, ip=ip, phase="Running", ready=True, resource_version=rv)


def pod_json(
    name: str,
    ip: str | None = "10.0.0.1",
    phase: str = "Running",
    ready: str = "True",
    rv: str = "7",
    deletion: str | None = None,
) -> dict[str, Any]:
    metadata: dict[str, Any] = {"name": name, "resourceVersion": rv, "labels": {"app": "infx"}}
    if deletion:
        metadata["deletionTimestamp"] = deletion
    status: dict[str, Any] = {"phase": phase, "conditions": [
        {"type": "PodScheduled", "status": "True"},
        {"type": "Ready", "status": ready},
    ]}
    if ip:
        status["podIP"] = ip
    return {"kind": "Pod", "apiVersion": "v1", "metadata": metadata, "status": status}


# --- pods and addresses -------------------------------------------------------------


def test_pod_state_reads_the_fields_that_decide_peering_from_api_json() -> None:
    pod = pod_state(pod_json("a", deletion="2026-01-01T00:00:00Z"))
    assert pod == PodState(
        name="a", ip="10.0.0.1", phase="Running", ready=True,
        deletion_timestamp="2026-01-01T00:00:00Z", labels={"app": "infx"}, resource_version="7",
    )


def test_pod_without_a_name_is_a_remote_violation() -> None:
    with pytest.raises(MalformedWatchObject):
        pod_state({"metadata": {}, "status": {}})


def test_only_running_ready_non_terminating_pods_with_an_ip_are_peers() -> None:
    assert desired_peer(live("a"), PORT) == PeerAddress("10.0.0.1", PORT)
    assert desired_peer(PodState("a", ip=None, phase="Running", ready=True), PORT) is None
    assert desired_peer(PodState("a", ip="10.0.0.1", phase="Pending", ready=True), PORT) is None
    assert desired_peer(PodState("a", ip="10.0.0.1", phase="Running", ready=False), PORT) is None
    terminating = PodState("a", ip="10.0.0.1", phase="Running", ready=True, deletion_timestamp="x")
    assert desired_peer(terminating, PORT) is None
    assert desired_peer(PodState("a", ip="not-an-ip", phase="Running", ready=True), PORT) is None


def test_ipv6_peer_addresses_are_bracketed_and_round_trip() -> None:
    address = desired_peer(live("a", ip="fd00::1"), PORT)
    assert str(address) == "[fd00::1]:8083"
    assert parse_peer_address(str(address)) == address
    assert parse_peer_address("gw-1.example:9000") == PeerAddress("gw-1.example", 9000)


@pytest.mark.parametrize("text", ["nohost", ":80", "h:", "h:0", "h:70000", "fd00::1:80", "h:x"])
def test_malformed_static_peer_addresses_are_rejected(text: str) -> None:
    with pytest.raises(InvalidPeerAddress):
        parse_peer_address(text)


# --- the peer set -------------------------------------------------------------------


def test_peer_set_reports_add_address_change_and_removal() -> None:
    peers = PeerSet("me", PORT)
    assert peers.pod_updated(PodState("a", ip="10.0.0.1", phase="Pending")) == []
    assert peers.pod_updated(live("a")) == [PeerAdded("a", PeerAddress("10.0.0.1", PORT))]
    assert peers.pod_updated(live("a")) == []
    assert peers.pod_updated(live("a", ip="10.0.0.2")) == [
        PeerAddressChanged("a", PeerAddress("10.0.0.1", PORT), PeerAddress("10.0.0.2", PORT))
    ]
    terminating = PodState("a", ip="10.0.0.2", phase="Running", ready=True, deletion_timestamp="t")
    assert peers.pod_updated(terminating) == [PeerRemoved("a", PeerAddress("10.0.0.2", PORT))]
    assert peers.pod_deleted("a") == []
    assert peers.peers == {}


def test_peer_set_skips_its_own_pod() -> None:
    peers = PeerSet("me", PORT)
    assert peers.pod_updated(live("me")) == []
    assert peers.relisted([live("me"), live("b", ip="10.0.0.2")]) == [
        PeerAdded("b", PeerAddress("10.0.0.2", PORT))
    ]


def test_relist_removes_pods_missing_from_the_snapshot() -> None:
    peers = PeerSet(None, PORT)
    peers.pod_updated(live("a"))
    peers.pod_updated(live("b", ip="10.0.0.2"))
    changes = peers.relisted([live("b", ip="10.0.0.3"), live("c", ip="10.0.0.4")])
    assert changes == [
        PeerRemoved("a", PeerAddress("10.0.0.1", PORT)),
        PeerAddressChanged("b", PeerAddress("10.0.0.2", PORT), PeerAddress("10.0.0.3", PORT)),
        PeerAdded("c", PeerAddress("10.0.0.4", PORT)),
    ]


NAMES = ["me", "a", "b", "c"]
pod_states = st.builds(
    PodState,
    name=st.sampled_from(NAMES),
    # Weighted towards live pods, so that peers come and go often.
    ip=st.sampled_from([None, "10.0.0.1", "10.0.0.2", "fd00::3"]),
    phase=st.sampled_from(["Running", "Running", "Running", "Pending", "Failed"]),
    ready=st.sampled_from([True, True, False]),
    deletion_timestamp=st.sampled_from([None, None, None, "2026-01-01T00:00:00Z"]),
)
operations = st.lists(
    st.one_of(
        st.tuples(st.just("update"), pod_states, st.booleans()),
        st.tuples(st.just("delete"), st.sampled_from(NAMES), st.booleans()),
        st.tuples(st.just("relist"), st.none(), st.just(True)),
    ),
    max_size=40,
)


def apply(view: dict[str, PeerAddress], changes: list[Any]) -> None:
    """Apply changes the way a consumer would, checking each is consistent with what it saw."""
    for change in changes:
        if isinstance(change, PeerAdded):
            assert change.name not in view
            view[change.name] = change.address
        elif isinstance(change, PeerAddressChanged):
            assert view[change.name] == change.previous != change.address
            view[change.name] = change.address
        else:
            assert view.pop(change.name) == change.address


def desired(cluster: dict[str, PodState]) -> dict[str, PeerAddress]:
    out = {}
    for name, pod in cluster.items():
        address = desired_peer(pod, PORT)
        if address is not None and name != "me":
            out[name] = address
    return out


@settings(max_examples=150, deadline=None)
@given(operations)
def test_peer_set_converges_to_the_desired_peers_of_the_cluster(ops: list[Any]) -> None:
    """Events may be lost (a dropped watch); a relist afterwards always converges.

    Between relists, every delivered event keeps the set equal to the desired
    peers of what was delivered; and the changes replayed by a consumer
    reproduce the set exactly.
    """
    cluster: dict[str, PodState] = {}
    seen: dict[str, PodState] = {}
    peers = PeerSet("me", PORT)
    view: dict[str, PeerAddress] = {}
    for kind, arg, delivered in ops:
        if kind == "update":
            cluster[arg.name] = arg
            if delivered:
                seen[arg.name] = arg
                apply(view, peers.pod_updated(arg))
        elif kind == "delete":
            cluster.pop(arg, None)
            if delivered:
                seen.pop(arg, None)
                apply(view, peers.pod_deleted(arg))
        else:
            seen = dict(cluster)
            apply(view, peers.relisted(list(cluster.values())))
        assert peers.peers == view == desired(seen)
    apply(view, peers.relisted(list(cluster.values())))
    assert peers.peers == view == desired(cluster)


# --- watch events -------------------------------------------------------------------


def test_watch_events_are_decoded_by_type() -> None:
    assert parse_watch_event({"type": "ADDED", "object": pod_json("a")}) == PodUpdated(
        pod_state(pod_json("a"))
    )
    assert isinstance(parse_watch_event({"type": "DELETED", "object": pod_json("a")}), PodDeleted)
    bookmark = {"type": "BOOKMARK", "object": {"kind": "Pod", "metadata": {"resourceVersion": "42"}}}
    assert parse_watch_event(bookmark) == BookmarkReceived("42")
    gone = {"type": "ERROR", "object": {"kind": "Status", "code": 410, "reason": "Expired",
                                        "message": "too old resource version: 1 (5)"}}
    assert parse_watch_event(gone) == WatchErrorReceived(410, "Expired", "too old resource version: 1 (5)")
    with pytest.raises(MalformedWatchObject):
        parse_watch_event({"type": "SURPRISE", "object": {}})
    with pytest.raises(MalformedWatchObject):
        parse_watch_event({"type": "BOOKMARK", "object": {"metadata": {}}})


# --- the list-then-watch loop -------------------------------------------------------

NO_JITTER = Backoff(initial=1.0, factor=2.0, cap=5.0, jitter=0.0)


def watching(rv: str = "10") -> PodWatch:
    watch = PodWatch("me", PORT, NO_JITTER, random.Random(0))
    watch.start()
    watch.listed([live("a")], rv)
    return watch


def test_list_then_watch_from_the_lists_resource_version() -> None:
    watch = PodWatch("me", PORT, NO_JITTER, random.Random(0))
    assert watch.state is WatchState.IDLE
    watch.start()
    assert watch.state is WatchState.LISTING
    changes = watch.listed([live("a"), live("me")], "10")
    assert changes == [PeerAdded("a", PeerAddress("10.0.0.1", PORT))]
    assert (watch.state, watch.resource_version) == (WatchState.WATCHING, "10")


def test_events_and_bookmarks_advance_the_resource_version() -> None:
    watch = watching()
    changes = watch.event_received(PodUpdated(live("b", ip="10.0.0.2", rv="11")))
    assert changes == [PeerAdded("b", PeerAddress("10.0.0.2", PORT))]
    assert watch.resource_version == "11"
    assert watch.event_received(BookmarkReceived("15")) == []
    assert watch.resource_version == "15"
    changes = watch.event_received(PodDeleted(live("a", rv="16")))
    assert changes == [PeerRemoved("a", PeerAddress("10.0.0.1", PORT))]
    assert watch.resource_version == "16"


def test_a_dropped_watch_backs_off_then_resumes_from_the_last_resource_version() -> None:
    watch = watching()
    watch.failed(now=100.0, http_status=None)
    assert watch.state is WatchState.BACKING_OFF
    assert watch.next_deadline() == 101.0
    watch.handle_timer(100.5)
    assert watch.state is WatchState.BACKING_OFF
    watch.handle_timer(101.0)
    assert (watch.state, watch.resource_version) == (WatchState.WATCHING, "10")
    assert watch.next_deadline() is None


def test_consecutive_failures_back_off_exponentially_up_to_the_cap() -> None:
    watch = watching()
    now = 0.0
    delays = []
    for _ in range(5):
        watch.failed(now, 500)
        deadline = watch.next_deadline()
        assert deadline is not None
        delays.append(deadline - now)
        now = deadline
        watch.handle_timer(now)
    assert delays == [1.0, 2.0, 4.0, 5.0, 5.0]


def test_progress_resets_the_backoff() -> None:
    watch = watching()
    watch.failed(0.0, 500)
    watch.handle_timer(1.0)
    watch.event_received(BookmarkReceived("11"))
    watch.failed(1.0, 500)
    assert watch.next_deadline() == 2.0
    watch.handle_timer(2.0)
    watch.watch_ended()
    assert watch.failures == 0


def test_gone_relists_at_once_but_a_second_gone_without_progress_backs_off() -> None:
    watch = watching()
    watch.failed(0.0, 410)
    assert (watch.state, watch.resource_version) == (WatchState.LISTING, None)
    assert watch.next_deadline() is None
    watch.listed([], "20")
    watch.failed(0.0, 410)
    assert watch.state is WatchState.BACKING_OFF
    watch.handle_timer(10.0)
    assert watch.state is WatchState.LISTING


def test_gone_after_another_failure_still_relists_at_once() -> None:
    watch = watching()
    watch.failed(0.0, None)
    watch.handle_timer(1.0)
    watch.failed(1.0, 410)
    assert watch.state is WatchState.LISTING


def test_a_failed_list_retries_the_list_after_backoff() -> None:
    watch = PodWatch("me", PORT, NO_JITTER, random.Random(0))
    watch.start()
    watch.failed(0.0, 503)
    watch.handle_timer(1.0)
    assert watch.state is WatchState.LISTING


def test_inputs_out_of_order_are_local_misuse() -> None:
    watch = PodWatch("me", PORT, NO_JITTER, random.Random(0))
    with pytest.raises(WatchMisuse):
        watch.listed([], "1")
    with pytest.raises(WatchMisuse):
        watch.event_received(BookmarkReceived("1"))
    watch.start()
    with pytest.raises(WatchMisuse):
        watch.watch_ended()
    watch.listed([], "1")
    with pytest.raises(WatchMisuse):
        watch.event_received(WatchErrorReceived(410, "Expired", ""))
    watch.stop()
    with pytest.raises(WatchMisuse):
        watch.failed(0.0, 500)
    assert watch.state is WatchState.STOPPED


@settings(max_examples=100, deadline=None)
@given(
    st.floats(0.01, 5), st.floats(1, 4), st.floats(0, 1), st.integers(1, 200), st.integers(0, 2**32)
)
def test_backoff_delay_stays_within_jitter_of_the_capped_exponential(
    initial: float, factor: float, jitter: float, failures: int, seed: int
) -> None:
    cap = initial * 10
    backoff = Backoff(initial=initial, factor=factor, cap=cap, jitter=jitter)
    base = min(cap, initial * factor ** (failures - 1))
    delay = backoff.delay(failures, random.Random(seed))
    assert base * (1 - jitter) - 1e-9 <= delay <= base + 1e-9


# --- the whole loop against a simulated API server ----------------------------------


class SimulatedApiServer:
    """resourceVersions, history and compaction as the API server keeps them, without HTTP."""

    def __init__(self) -> None:
        self.rv = 0
        self.pods: dict[str, PodState] = {}
        self.history: list[tuple[int, Any]] = []
        self.compacted = 0

    def write(self, pod: PodState) -> None:
        self.rv += 1
        stored = PodState(pod.name, pod.ip, pod.phase, pod.ready, pod.deletion_timestamp,
                          resource_version=str(self.rv))
        self.pods[pod.name] = stored
        self.history.append((self.rv, PodUpdated(stored)))

    def delete(self, name: str) -> None:
        if name in self.pods:
            self.rv += 1
            gone = self.pods.pop(name)
            self.history.append((self.rv, PodDeleted(PodState(name, resource_version=str(self.rv)))))
            del gone

    def next_event(self, after: int) -> tuple[int, Any] | None:
        return next(((rv, e) for rv, e in self.history if rv > after), None)


actions = st.lists(
    st.one_of(
        st.tuples(st.just("write"), pod_states),
        st.tuples(st.just("delete"), st.sampled_from(NAMES)),
        st.tuples(st.sampled_from(
            ["deliver", "deliver", "deliver", "bookmark", "drop", "timeout", "compact", "fail_list"]
        ), st.none()),
        st.tuples(st.just("tick"), st.floats(0, 3)),
    ),
    max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(actions, st.integers(0, 2**16))
@example(  # the watch breaks, a peer goes away unseen, and compaction forces a relist
    [("write", live("a")), ("deliver", None), ("drop", None), ("delete", "a"),
     ("compact", None), ("tick", 3.0)],
    0,
)
def test_list_then_watch_converges_through_drops_compaction_and_failures(
    script: list[Any], seed: int,
) -> None:
    """Whatever happens to the watch, once faults stop the peers equal the cluster's live pods."""
    server = SimulatedApiServer()
    watch = PodWatch("me", PORT, Backoff(initial=1.0, factor=2.0, cap=4.0), random.Random(seed))
    view: dict[str, PeerAddress] = {}
    now = 0.0
    delivered: int | None = None  # the open watch's position; None while no watch is open
    fail_list = False

    def drive() -> None:
        nonlocal delivered, fail_list
        if watch.state is WatchState.LISTING:
            if fail_list:
                fail_list = False
                watch.failed(now, 503)
            else:
                apply(view, watch.listed(list(server.pods.values()), str(server.rv)))
        if watch.state is WatchState.WATCHING and delivered is None:
            since = int(watch.resource_version or 0)
            if since < server.compacted:
                watch.failed(now, 410)
                drive()
            else:
                delivered = since

    watch.start()
    drive()
    for action, arg in script:
        if action == "write":
            server.write(arg)
        elif action == "delete":
            server.delete(arg)
        elif action == "compact":
            server.compacted = server.rv
        elif action == "fail_list":
            fail_list = True
        elif action == "tick":
            now += arg
            watch.handle_timer(now)
        elif delivered is not None:
            if action == "deliver":
                event = server.next_event(delivered)
                if event is not None:
                    delivered = event[0]
                    apply(view, watch.event_received(event[1]))
            elif action == "bookmark" and server.next_event(delivered) is None:
                delivered = server.rv
                watch.event_received(BookmarkReceived(str(server.rv)))
            elif action == "drop":
                delivered = None
                watch.failed(now, None)
            elif action == "timeout":
                delivered = None
                watch.watch_ended()
        drive()

    fail_list = False
    for _ in range(10):  # quiesce: no more faults
        deadline = watch.next_deadline()
        if deadline is not None:
            now = max(now, deadline)
            watch.handle_timer(now)
        drive()
        while delivered is not None and (event := server.next_event(delivered)) is not None:
            delivered = event[0]
            apply(view, watch.event_received(event[1]))
    assert watch.state is WatchState.WATCHING
    assert watch.peers.peers == view == desired(server.pods)
