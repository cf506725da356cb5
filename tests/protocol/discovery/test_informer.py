"""protocol.discovery.informer: the list-then-watch loop, its cache, and its effects, on a clock stepped by hand."""

from __future__ import annotations

import random
from collections.abc import Hashable, Mapping
from typing import Any

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from protocol.backoff import Backoff
from protocol.discovery.informer import (
    Added,
    BookmarkReceived,
    Deleted,
    Effect,
    Informer,
    InformerState,
    ListRequested,
    MalformedWatchObject,
    Modified,
    ObjectDeleted,
    ObjectUpdated,
    Synced,
    WatchErrorReceived,
    WatchMisuse,
    WatchRequested,
    parse_watch_event,
)
from protocol.discovery.peers import PeerAdded, PeerAddress, PeerRemoved, PodState, pod_key, pod_state, pod_version
from tests.support.peers import NAMES, PORT, Discovery, apply, desired, live, pod_json, pod_states

NO_JITTER = Backoff(initial=1.0, factor=2.0, cap=5.0, jitter=0.0)


def informer() -> Informer[PodState]:
    return Informer(pod_key, pod_version, NO_JITTER, random.Random(0))


def watching(rv: str = "10") -> Informer[PodState]:
    machine = informer()
    machine.start()
    machine.listed([live("a")], rv)
    return machine


# --- watch lines ----------------------------------------------------------------------


def test_watch_events_are_decoded_by_type() -> None:
    assert parse_watch_event({"type": "ADDED", "object": pod_json("a")}, pod_state) == ObjectUpdated(
        pod_state(pod_json("a"))
    )
    assert isinstance(parse_watch_event({"type": "DELETED", "object": pod_json("a")}, pod_state), ObjectDeleted)
    bookmark = {"type": "BOOKMARK", "object": {"kind": "Pod", "metadata": {"resourceVersion": "42"}}}
    assert parse_watch_event(bookmark, pod_state) == BookmarkReceived("42")
    gone = {"type": "ERROR", "object": {"kind": "Status", "code": 410, "reason": "Expired",
                                        "message": "too old resource version: 1 (5)"}}
    assert parse_watch_event(gone, pod_state) == WatchErrorReceived(410, "Expired", "too old resource version: 1 (5)")
    with pytest.raises(MalformedWatchObject):
        parse_watch_event({"type": "SURPRISE", "object": {}}, pod_state)
    with pytest.raises(MalformedWatchObject):
        parse_watch_event({"type": "BOOKMARK", "object": {"metadata": {}}}, pod_state)


# --- the loop: which request comes next ---------------------------------------------


def test_list_then_watch_from_the_lists_resource_version() -> None:
    machine = informer()
    assert machine.state is InformerState.IDLE
    assert machine.start() == [ListRequested()]
    assert machine.state is InformerState.LISTING
    effects = machine.listed([live("a"), live("me")], "10")
    assert effects == [Added("a", live("a")), Added("me", live("me")), Synced(2), WatchRequested("10")]
    assert (machine.state, machine.resource_version) == (InformerState.WATCHING, "10")


def test_events_and_bookmarks_advance_the_resource_version() -> None:
    machine = watching()
    b = live("b", ip="10.0.0.2", rv="11")
    assert machine.event_received(ObjectUpdated(b)) == [Added("b", b)]
    assert machine.resource_version == "11"
    assert machine.event_received(BookmarkReceived("15")) == []
    assert machine.resource_version == "15"
    gone = live("a", rv="16")
    assert machine.event_received(ObjectDeleted(gone)) == [Deleted("a", gone)]
    assert machine.resource_version == "16"


def test_a_watch_that_ends_is_reopened_from_the_last_resource_version() -> None:
    machine = watching()
    machine.event_received(BookmarkReceived("12"))
    assert machine.watch_ended() == [WatchRequested("12")]
    assert machine.state is InformerState.WATCHING


def test_a_dropped_watch_backs_off_then_resumes_from_the_last_resource_version() -> None:
    machine = watching()
    assert machine.failed(None, 100.0) == []
    assert machine.state is InformerState.BACKING_OFF
    assert machine.next_deadline() == 101.0
    assert machine.handle_timeout(100.5) == []
    assert machine.state is InformerState.BACKING_OFF
    assert machine.handle_timeout(101.0) == [WatchRequested("10")]
    assert (machine.state, machine.resource_version) == (InformerState.WATCHING, "10")
    assert machine.next_deadline() is None


def test_consecutive_failures_back_off_exponentially_up_to_the_cap() -> None:
    machine = watching()
    now = 0.0
    delays = []
    for _ in range(5):
        machine.failed(500, now)
        deadline = machine.next_deadline()
        assert deadline is not None
        delays.append(deadline - now)
        now = deadline
        machine.handle_timeout(now)
    assert delays == [1.0, 2.0, 4.0, 5.0, 5.0]


def test_progress_resets_the_backoff() -> None:
    machine = watching()
    machine.failed(500, 0.0)
    machine.handle_timeout(1.0)
    machine.event_received(BookmarkReceived("11"))
    machine.failed(500, 1.0)
    assert machine.next_deadline() == 2.0
    machine.handle_timeout(2.0)
    machine.watch_ended()
    assert machine.failures == 0


def test_gone_relists_at_once_but_a_second_gone_without_progress_backs_off() -> None:
    machine = watching()
    assert machine.failed(410, 0.0) == [ListRequested()]
    assert (machine.state, machine.resource_version) == (InformerState.LISTING, None)
    assert machine.next_deadline() is None
    machine.listed([], "20")
    assert machine.failed(410, 0.0) == []
    assert machine.state is InformerState.BACKING_OFF
    assert machine.handle_timeout(10.0) == [ListRequested()]
    assert machine.state is InformerState.LISTING


def test_gone_after_another_failure_still_relists_at_once() -> None:
    machine = watching()
    machine.failed(None, 0.0)
    machine.handle_timeout(1.0)
    assert machine.failed(410, 1.0) == [ListRequested()]
    assert machine.state is InformerState.LISTING


def test_a_failed_list_retries_the_list_after_backoff() -> None:
    machine = informer()
    machine.start()
    machine.failed(503, 0.0)
    assert machine.handle_timeout(1.0) == [ListRequested()]
    assert machine.state is InformerState.LISTING


def test_inputs_out_of_order_are_local_misuse() -> None:
    machine = informer()
    with pytest.raises(WatchMisuse):
        machine.listed([], "1")
    with pytest.raises(WatchMisuse):
        machine.event_received(BookmarkReceived("1"))
    machine.start()
    with pytest.raises(WatchMisuse):
        machine.start()
    with pytest.raises(WatchMisuse):
        machine.watch_ended()
    machine.listed([], "1")
    with pytest.raises(WatchMisuse):
        machine.event_received(WatchErrorReceived(410, "Expired", ""))
    machine.stop()
    with pytest.raises(WatchMisuse):
        machine.failed(500, 0.0)
    assert machine.state is InformerState.STOPPED
    assert machine.handle_timeout(100.0) == []


def test_a_list_without_a_resource_version_is_a_remote_violation() -> None:
    machine = informer()
    machine.start()
    with pytest.raises(MalformedWatchObject):
        machine.listed([], "")


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 12), st.integers(0, 2**32))
def test_the_informer_waits_the_one_backoff_rule_with_a_draw_from_its_rng(failures: int, seed: int) -> None:
    # The rule itself (cap, jitter band) is tested in tests/protocol/test_backoff.py.
    backoff = Backoff(initial=0.5, factor=2.0, cap=30.0, jitter=0.5)
    machine = Informer(pod_key, pod_version, backoff, random.Random(seed))
    draws = random.Random(seed)
    machine.start()
    now = 0.0
    for n in range(1, failures + 1):
        machine.failed(500, now)
        expected = now + backoff.delay(n, draws.random())
        assert machine.next_deadline() == expected
        now = expected
        machine.handle_timeout(now)


def test_the_backoff_jitter_comes_from_the_rng_it_is_given() -> None:
    jittered = Backoff(initial=1.0, cap=1.0, jitter=1.0)
    a, b = (Informer(pod_key, pod_version, jittered, random.Random(7)) for _ in range(2))
    for machine in (a, b):
        machine.start()
        machine.failed(500, 0.0)
    assert a.next_deadline() == b.next_deadline() == jittered.delay(1, random.Random(7).random())


# --- the cache ------------------------------------------------------------------------


def test_a_relist_is_diffed_into_the_cache_and_ends_synced() -> None:
    machine = watching()
    b = live("b", ip="10.0.0.2", rv="11")
    machine.event_received(ObjectUpdated(b))
    machine.failed(410, 0.0)
    a2 = live("a", ip="10.0.0.9", rv="30")
    c = live("c", rv="31")
    effects = machine.listed([a2, c], "31")
    assert effects == [Deleted("b", b), Modified("a", live("a"), a2), Added("c", c), Synced(2),
                       WatchRequested("31")]
    assert dict(machine.objects) == {"a": a2, "c": c}


def test_replayed_and_unknown_events_change_nothing() -> None:
    machine = watching()
    assert machine.event_received(ObjectUpdated(live("a"))) == []
    assert machine.event_received(ObjectDeleted(PodState("nobody"))) == []
    assert dict(machine.objects) == {"a": live("a")}


def test_the_cache_is_read_only_to_callers() -> None:
    machine = watching()
    with pytest.raises(TypeError):
        machine.objects["b"] = live("b")  # type: ignore[index]


def deployment_key(obj: Mapping[str, Any]) -> Hashable:
    metadata = obj["metadata"]
    return (metadata.get("namespace") or "default", metadata["name"])


def deployment_version(obj: Mapping[str, Any]) -> str | None:
    rv = obj["metadata"].get("resourceVersion")
    return rv if isinstance(rv, str) else None


def test_any_object_kind_is_cached_by_the_key_given_as_deployments_are_for_the_scaler() -> None:
    machine: Informer[Mapping[str, Any]] = Informer(deployment_key, deployment_version, NO_JITTER,
                                                    random.Random(0))
    machine.start()
    first = {"metadata": {"name": "llama", "namespace": "ml", "resourceVersion": "3"}, "spec": {"replicas": 0}}
    assert machine.listed([first], "3")[0] == Added(("ml", "llama"), first)
    scaled = {"metadata": {"name": "llama", "namespace": "ml", "resourceVersion": "4"}, "spec": {"replicas": 1}}
    assert machine.event_received(ObjectUpdated(scaled)) == [Modified(("ml", "llama"), first, scaled)]
    assert machine.resource_version == "4"


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
        self.history.append((self.rv, ObjectUpdated(stored)))

    def delete(self, name: str) -> None:
        if name in self.pods:
            self.rv += 1
            del self.pods[name]
            self.history.append((self.rv, ObjectDeleted(PodState(name, resource_version=str(self.rv)))))

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
    """Whatever happens to the watch, once faults stop the peers equal the cluster's live pods.

    The requests performed are exactly the ones the informer's effects ask for.
    """
    server = SimulatedApiServer()
    discovery = Discovery("me", Backoff(initial=1.0, factor=2.0, cap=4.0), seed)
    machine = discovery.informer
    view: dict[str, PeerAddress] = {}
    now = 0.0
    delivered: int | None = None  # the open watch's position; None while no watch is open
    fail_list = False

    def feed(effects: list[Effect[PodState]]) -> None:
        apply(view, discovery.feed(effects))

    def drive() -> None:
        nonlocal delivered, fail_list
        while discovery.requests:
            request = discovery.requests.pop(0)
            if isinstance(request, ListRequested):
                assert machine.state is InformerState.LISTING
                if fail_list:
                    fail_list = False
                    feed(machine.failed(503, now))
                else:
                    feed(machine.listed(list(server.pods.values()), str(server.rv)))
            else:
                assert isinstance(request, WatchRequested) and delivered is None
                assert request.resource_version == machine.resource_version
                since = int(request.resource_version)
                if since < server.compacted:
                    feed(machine.failed(410, now))
                else:
                    delivered = since

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
            feed(machine.handle_timeout(now))
        elif delivered is not None:
            if action == "deliver":
                event = server.next_event(delivered)
                if event is not None:
                    delivered = event[0]
                    feed(machine.event_received(event[1]))
            elif action == "bookmark" and server.next_event(delivered) is None:
                delivered = server.rv
                feed(machine.event_received(BookmarkReceived(str(server.rv))))
            elif action == "drop":
                delivered = None
                feed(machine.failed(None, now))
            elif action == "timeout":
                delivered = None
                feed(machine.watch_ended())
        drive()

    fail_list = False
    for _ in range(10):  # quiesce: no more faults
        deadline = machine.next_deadline()
        if deadline is not None:
            now = max(now, deadline)
            feed(machine.handle_timeout(now))
        drive()
        while delivered is not None and (event := server.next_event(delivered)) is not None:
            delivered = event[0]
            feed(machine.event_received(event[1]))
    assert machine.state is InformerState.WATCHING
    assert discovery.peers.peers == view == desired(server.pods)
    assert set(machine.objects) == set(server.pods)


def test_peer_changes_follow_the_informer_through_a_relist() -> None:
    discovery = Discovery("me")
    assert discovery.relist([live("a"), live("me")]) == [PeerAdded("a", PeerAddress("10.0.0.1", PORT))]
    assert discovery.relist([]) == [PeerRemoved("a", PeerAddress("10.0.0.1", PORT))]
