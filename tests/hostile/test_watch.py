"""Hostile Kubernetes watch events: what an API server (or something in between) may garble.

Pure: any JSON value, and valid pod events with any one value replaced,
decode to a watch event or raise :class:`MalformedWatchObject`; a decoded pod
is a peer only at a valid IP. Adapter: a garbled line on a live watch is
dropped with a log line, the watch resumes from the last good
resourceVersion (no relist), and later events still reach the peer set.
"""

from __future__ import annotations

import copy
import json
import random
from typing import Any

import pytest
import pytest_twisted
from hypothesis import HealthCheck, given, settings, strategies as st
from kubernetes import client
from twisted.internet import defer, reactor, task
from twisted.logger import globalLogPublisher

from harness.kubeapi import FakeKubeAPI
from infx.discovery.kube import PodWatcher, PodWatcherConfig
from protocol.backoff import Backoff
from protocol.discovery.informer import (
    BookmarkReceived,
    MalformedWatchObject,
    ObjectDeleted,
    ObjectUpdated,
    WatchErrorReceived,
    parse_watch_event,
)
from protocol.discovery.peers import PeerSet, desired_peer, pod_state

FEW = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

POD_EVENT = {
    "type": "MODIFIED",
    "object": {
        "kind": "Pod",
        "metadata": {"name": "gw-1", "labels": {"app": "infx"}, "resourceVersion": "12",
                     "deletionTimestamp": None},
        "status": {"phase": "Running", "podIP": "10.0.0.1",
                   "conditions": [{"type": "Ready", "status": "True"}]},
    },
}
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=12)
    | st.sampled_from(["ADDED", "DELETED", "BOOKMARK", "ERROR", "Running", "Ready", "True", "::1", "10.0.0.300"]),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
        st.sampled_from(["type", "object", "metadata", "status", "name", "podIP", "phase", "conditions",
                         "code", "resourceVersion", "labels"]) | st.text(max_size=4), inner, max_size=4),
    max_leaves=20,
)


def paths(value: Any, prefix: tuple = ()) -> list[tuple]:
    out = [prefix] if prefix else []
    if isinstance(value, dict):
        for key, item in value.items():
            out += paths(item, prefix + (key,))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            out += paths(item, prefix + (index,))
    return out


def decoded_or_malformed(raw: Any) -> Any:
    try:
        event = parse_watch_event(raw, pod_state)
    except MalformedWatchObject:
        return None
    assert isinstance(event, (ObjectUpdated, ObjectDeleted, BookmarkReceived, WatchErrorReceived))
    if isinstance(event, (ObjectUpdated, ObjectDeleted)):
        # A peer is only ever dialled at an address that parses.
        peer = desired_peer(event.obj, 8083)
        assert peer is None or isinstance(peer.host, str) and ":" in str(peer)
        peers = PeerSet("me", 8083)
        changes = (peers.pod_updated(event.obj) if isinstance(event, ObjectUpdated)
                   else peers.pod_deleted(event.obj.name))
        assert len(changes) <= 1
    return event


@FEW
@given(json_values)
def test_any_json_value_decodes_to_a_watch_event_or_is_malformed(value):
    decoded_or_malformed(value)


@FEW
@given(st.sampled_from(paths(POD_EVENT)), json_values)
def test_a_pod_event_with_any_one_value_replaced_decodes_or_is_malformed(path, replacement):
    event = copy.deepcopy(POD_EVENT)
    target = event
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = replacement
    decoded_or_malformed(json.loads(json.dumps(event)))


# -- the adapter: a garbled line on a live watch ----------------------------------------------


FAST = Backoff(initial=0.02, factor=2.0, cap=0.2, jitter=0.5)
GARBLED = {
    "not JSON": b"{\"type\": \"MODIFIED\", \"object\": {\"metad\n",
    "a JSON list": b"[1, 2, 3]\n",
    "an unknown event type": b'{"type": "EXPLODED", "object": {}}\n',
    "a pod without a name": b'{"type": "ADDED", "object": {"metadata": {}}}\n',
    "nesting too deep": b"[" * 100_000 + b"\n",
}


@pytest.fixture
def api() -> Any:
    server = FakeKubeAPI(reactor).start()
    yield server
    pytest_twisted.blockon(server.stop())


@pytest.mark.parametrize("name", sorted(GARBLED))
@pytest_twisted.inlineCallbacks
def test_a_garbled_watch_line_is_dropped_with_a_log_line_and_the_watch_resumes(api, name):
    warnings: list[dict] = []

    def observe(event: dict) -> None:
        if event.get("log_namespace") == "infx.kube" and event.get("log_level").name == "warn":
            warnings.append(event)

    api.add_live_pod("gw-1", "10.0.0.1", labels={"app": "infx"})
    view: dict[str, Any] = {}
    config = PodWatcherConfig(namespace="default", label_selector="app=infx", own_pod_name="me", peer_port=8083,
                              watch_timeout=30, request_timeout=5.0, backoff=FAST)
    watcher = PodWatcher(reactor, client.CoreV1Api(client.ApiClient(api.client_configuration())), config,
                         lambda change: view.__setitem__(change.name, getattr(change, "address", None)),
                         random.Random(1))
    globalLogPublisher.addObserver(observe)
    try:
        watcher.start()
        yield api.when_watching()
        yield eventually(lambda: "gw-1" in view, "the first peer")
        seen = watcher.resource_version
        for stream in list(api._watches):
            stream.request.write(GARBLED[name])
        yield eventually(lambda: warnings, "a warning about the garbled line")
        api.add_live_pod("gw-2", "10.0.0.2", labels={"app": "infx"})
        yield eventually(lambda: view.get("gw-2") is not None, "the next event after the garbled line")
    finally:
        globalLogPublisher.removeObserver(observe)
        yield watcher.stop()
    assert "watching" in warnings[0]["what"]
    watches = [r for r in api.requests if r.watch]
    assert watches[1].query["resourceVersion"] == seen  # resumed, not relisted
    assert len(api.list_requests()) == 1


@defer.inlineCallbacks
def eventually(predicate: Any, what: str, timeout: float = 10.0) -> Any:
    deadline = reactor.seconds() + timeout
    while not predicate():
        if reactor.seconds() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        yield task.deferLater(reactor, 0.01, lambda: None)


@pytest.mark.parametrize("value", [[1], "ADDED", 3, None, True])
def test_a_watch_line_that_is_not_an_object_is_malformed_not_an_attribute_error(value):
    """Regression: parse_watch_event assumed a mapping; a JSON list or scalar
    raised AttributeError instead of the documented MalformedWatchObject."""
    with pytest.raises(MalformedWatchObject):
        parse_watch_event(value, pod_state)
