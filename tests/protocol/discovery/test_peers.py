"""protocol.discovery.peers: which pods are peers, and the peer set's changes as a pod informer feeds it."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from protocol.discovery.informer import MalformedWatchObject
from protocol.discovery.peers import (
    InvalidPeerAddress,
    PeerAdded,
    PeerAddress,
    PeerAddressChanged,
    PeerRemoved,
    PeerSet,
    PodState,
    desired_peer,
    parse_peer_address,
    pod_state,
)
from tests.support.peers import Discovery, NAMES, PORT, apply, desired, live, pod_json, pod_states


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
    assert Discovery("me").relist([live("me"), live("b", ip="10.0.0.2")]) == [
        PeerAdded("b", PeerAddress("10.0.0.2", PORT))
    ]


def test_relist_removes_pods_missing_from_the_snapshot() -> None:
    discovery = Discovery(None)
    discovery.relist([])
    discovery.updated(live("a"))
    discovery.updated(live("b", ip="10.0.0.2"))
    changes = discovery.relist([live("b", ip="10.0.0.3"), live("c", ip="10.0.0.4")])
    assert changes == [
        PeerRemoved("a", PeerAddress("10.0.0.1", PORT)),
        PeerAddressChanged("b", PeerAddress("10.0.0.2", PORT), PeerAddress("10.0.0.3", PORT)),
        PeerAdded("c", PeerAddress("10.0.0.4", PORT)),
    ]


operations = st.lists(
    st.one_of(
        st.tuples(st.just("update"), pod_states, st.booleans()),
        st.tuples(st.just("delete"), st.sampled_from(NAMES), st.booleans()),
        st.tuples(st.just("relist"), st.none(), st.just(True)),
    ),
    max_size=40,
)


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
    discovery = Discovery("me")
    view: dict[str, PeerAddress] = {}
    apply(view, discovery.relist([]))
    for kind, arg, delivered in ops:
        if kind == "update":
            cluster[arg.name] = arg
            if delivered:
                seen[arg.name] = arg
                apply(view, discovery.updated(arg))
        elif kind == "delete":
            cluster.pop(arg, None)
            if delivered:
                seen.pop(arg, None)
                apply(view, discovery.deleted(arg))
        else:
            seen = dict(cluster)
            apply(view, discovery.relist(list(cluster.values())))
        assert discovery.peers.peers == view == desired(seen)
    apply(view, discovery.relist(list(cluster.values())))
    assert discovery.peers.peers == view == desired(cluster)
