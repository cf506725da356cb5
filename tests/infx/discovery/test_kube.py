"""infx.discovery.kube: the pod watcher against the fake API server, with the official client over real HTTP.

Waits poll the watcher's state with a deadline (a failure guard, not a timing
assertion); nothing sleeps for a fixed time.
"""

from __future__ import annotations

import random
from typing import Any, Callable

import pytest
import pytest_twisted
from kubernetes import client
from twisted.internet import defer, reactor, task

from harness.kubeapi import PODS, FakeKubeAPI, write_kubeconfig
from infx.discovery.kube import PeerSourceService, PodWatcher, PodWatcherConfig, StaticPeers, kube_api_client
from protocol.backoff import Backoff
from protocol.discovery.informer import InformerState
from protocol.discovery.peers import (
    InvalidPeerAddress,
    PeerAdded,
    PeerAddress,
    PeerAddressChanged,
    PeerChange,
    PeerRemoved,
)

APP = {"app": "infx"}
PORT = 8083
FAST = Backoff(initial=0.02, factor=2.0, cap=0.2, jitter=0.5)


@pytest.fixture
def api() -> Any:
    server = FakeKubeAPI(reactor).start()
    yield server
    pytest_twisted.blockon(server.stop())


class Recorder:
    """An on_change callback that keeps every change and replays them into a view."""

    def __init__(self) -> None:
        self.changes: list[PeerChange] = []
        self.view: dict[str, PeerAddress] = {}

    def __call__(self, change: PeerChange) -> None:
        self.changes.append(change)
        if isinstance(change, PeerRemoved):
            del self.view[change.name]
        else:
            self.view[change.name] = change.address


@pytest.fixture
def watchers() -> Any:
    started: list[PodWatcher] = []
    yield started
    for watcher in started:
        pytest_twisted.blockon(watcher.stop())


def start_watcher(
    api: FakeKubeAPI,
    watchers: list[PodWatcher],
    recorder: Recorder,
    api_client: client.ApiClient | None = None,
    watch_timeout: int = 30,
) -> PodWatcher:
    config = PodWatcherConfig(
        namespace="default", label_selector="app=infx", own_pod_name="me", peer_port=PORT,
        watch_timeout=watch_timeout, request_timeout=5.0, backoff=FAST,
    )
    core = client.CoreV1Api(api_client or client.ApiClient(api.client_configuration()))
    watcher = PodWatcher(reactor, core, config, recorder, random.Random(1))
    watchers.append(watcher)
    watcher.start()
    return watcher


@defer.inlineCallbacks
def eventually(predicate: Callable[[], bool], what: str, timeout: float = 10.0) -> Any:
    deadline = reactor.seconds() + timeout
    while not predicate():
        if reactor.seconds() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        yield task.deferLater(reactor, 0.01, lambda: None)


def address(ip: str) -> PeerAddress:
    return PeerAddress(ip, PORT)


def live_peers(api: FakeKubeAPI) -> dict[str, PeerAddress]:
    """What the watcher should converge to, computed from the server's truth."""
    out = {}
    for pod in api.list(PODS):
        status, metadata = pod.get("status", {}), pod["metadata"]
        ready = any(c["type"] == "Ready" and c["status"] == "True" for c in status.get("conditions", []))
        if (metadata.get("labels", {}).get("app") == "infx" and metadata["name"] != "me"
                and status.get("podIP") and status.get("phase") == "Running" and ready
                and "deletionTimestamp" not in metadata):
            out[metadata["name"]] = address(status["podIP"])
    return out


@defer.inlineCallbacks
def converged(api: FakeKubeAPI, watcher: PodWatcher, recorder: Recorder) -> Any:
    yield eventually(lambda: watcher.peers == recorder.view == live_peers(api),
                     f"peers to converge to {live_peers(api)}")


@pytest_twisted.inlineCallbacks
def test_pods_become_peers_when_running_and_ready_and_leave_when_terminating_or_deleted(
    api: FakeKubeAPI, watchers: list[PodWatcher],
) -> Any:
    api.add_live_pod("gw-1", "10.0.0.1", labels=APP)
    api.add_live_pod("me", "10.0.0.9", labels=APP)
    api.add_live_pod("not-a-gateway", "10.0.0.8", labels={"app": "other"})
    api.add_pod("gw-2", labels=APP)
    recorder = Recorder()
    watcher = start_watcher(api, watchers, recorder)
    yield eventually(lambda: recorder.view == {"gw-1": address("10.0.0.1")}, "the first peer")
    yield api.when_watching()

    api.set_pod_ip("gw-2", "10.0.0.2")
    api.set_ready("gw-2")
    yield eventually(lambda: "gw-2" in recorder.view, "gw-2 to become ready")
    api.set_pod_ip("gw-1", "10.0.0.11")
    yield eventually(lambda: recorder.view.get("gw-1") == address("10.0.0.11"), "the IP change")
    api.mark_terminating("gw-2")
    yield eventually(lambda: "gw-2" not in recorder.view, "terminating gw-2 to be removed")
    api.delete_pod("gw-1")
    yield eventually(lambda: recorder.view == {}, "deleted gw-1 to be removed")

    assert recorder.changes == [
        PeerAdded("gw-1", address("10.0.0.1")),
        PeerAdded("gw-2", address("10.0.0.2")),
        PeerAddressChanged("gw-1", address("10.0.0.1"), address("10.0.0.11")),
        PeerRemoved("gw-2", address("10.0.0.2")),
        PeerRemoved("gw-1", address("10.0.0.11")),
    ]
    assert watcher.resource_version == str(api.store.resource_version)
    assert len(api.list_requests()) == 1


@pytest_twisted.inlineCallbacks
def test_a_dropped_watch_resumes_from_the_last_resource_version_without_relisting(
    api: FakeKubeAPI, watchers: list[PodWatcher],
) -> Any:
    api.add_live_pod("gw-1", "10.0.0.1", labels=APP)
    recorder = Recorder()
    watcher = start_watcher(api, watchers, recorder)
    yield api.when_watching()
    seen = watcher.resource_version
    assert api.drop_watches() == 1
    api.add_live_pod("gw-2", "10.0.0.2", labels=APP)
    api.delete_pod("gw-1")
    yield converged(api, watcher, recorder)
    watches = [r for r in api.requests if r.watch]
    assert [r.query["resourceVersion"] for r in watches[:2]] == [seen, seen]
    assert len(api.list_requests()) == 1


@pytest_twisted.inlineCallbacks
def test_a_watch_that_ends_on_its_timeout_is_reopened_from_the_last_resource_version(
    api: FakeKubeAPI, watchers: list[PodWatcher],
) -> Any:
    recorder = Recorder()
    watcher = start_watcher(api, watchers, recorder)
    yield api.when_watching()
    api.add_live_pod("gw-1", "10.0.0.1", labels=APP)
    yield converged(api, watcher, recorder)
    assert api.close_watches() == 1
    yield api.when_watching()
    assert [r for r in api.requests if r.watch][-1].query["resourceVersion"] == watcher.resource_version
    assert len(api.list_requests()) == 1


@pytest_twisted.inlineCallbacks
def test_a_compacted_resource_version_forces_a_relist_that_catches_up(
    api: FakeKubeAPI, watchers: list[PodWatcher],
) -> Any:
    api.add_live_pod("gw-1", "10.0.0.1", labels=APP)
    recorder = Recorder()
    watcher = start_watcher(api, watchers, recorder)
    yield api.when_watching()
    yield converged(api, watcher, recorder)
    api.drop_watches()
    # Changes the watcher does not see before its resourceVersion is compacted away.
    api.delete_pod("gw-1")
    api.add_live_pod("gw-2", "10.0.0.2", labels=APP)
    api.compact()
    yield converged(api, watcher, recorder)
    assert len(api.list_requests()) == 2
    assert PeerRemoved("gw-1", address("10.0.0.1")) in recorder.changes


@pytest_twisted.inlineCallbacks
def test_a_410_answer_to_the_watch_request_forces_a_relist(
    api: FakeKubeAPI, watchers: list[PodWatcher],
) -> Any:
    api.fail_next(410, method="GET", resource="pods", watch=True)
    api.add_live_pod("gw-1", "10.0.0.1", labels=APP)
    recorder = Recorder()
    watcher = start_watcher(api, watchers, recorder)
    yield api.when_watching()
    yield converged(api, watcher, recorder)
    assert len(api.list_requests()) == 2


@pytest_twisted.inlineCallbacks
def test_bookmarks_keep_the_resource_version_fresh_so_compaction_needs_no_relist(
    api: FakeKubeAPI, watchers: list[PodWatcher],
) -> Any:
    recorder = Recorder()
    watcher = start_watcher(api, watchers, recorder)
    yield api.when_watching()
    for i in range(3):
        api.add_pod(f"unwatched-{i}", labels={"app": "other"})
    assert api.send_bookmarks() == 1
    target = str(api.store.resource_version)
    yield eventually(lambda: watcher.resource_version == target, "the bookmark")
    api.compact()
    api.drop_watches()
    yield api.when_watching()
    api.add_live_pod("gw-1", "10.0.0.1", labels=APP)
    yield converged(api, watcher, recorder)
    assert len(api.list_requests()) == 1


@pytest_twisted.inlineCallbacks
def test_list_errors_back_off_and_retry_until_the_server_answers(
    api: FakeKubeAPI, watchers: list[PodWatcher],
) -> Any:
    api.fail_next(503, count=3, method="GET", resource="pods", watch=False)
    api.fail_next(500, count=2, method="GET", resource="pods", watch=True)
    api.add_live_pod("gw-1", "10.0.0.1", labels=APP)
    recorder = Recorder()
    watcher = start_watcher(api, watchers, recorder)
    yield api.when_watching()
    yield converged(api, watcher, recorder)
    assert len(api.list_requests()) == 4
    assert len([r for r in api.requests if r.watch]) == 3


@pytest_twisted.inlineCallbacks
def test_stop_ends_callbacks_and_the_open_watch_promptly(
    api: FakeKubeAPI, watchers: list[PodWatcher],
) -> Any:
    recorder = Recorder()
    watcher = start_watcher(api, watchers, recorder, watch_timeout=600)
    yield api.when_watching()
    stopped = watcher.stop()
    api.add_live_pod("gw-1", "10.0.0.1", labels=APP)
    # Far below the 600 s watch timeout: stop() unblocks the thread's read.
    yield stopped.addTimeout(10, reactor)
    yield eventually(lambda: api.open_watches == 0, "the server to see the watch closed")
    assert recorder.changes == []
    assert watcher.state is InformerState.STOPPED


class HandClock(task.Clock):
    """Timers stepped by hand; results from the watcher's thread still come back via the reactor."""

    def callFromThread(self, f: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        reactor.callFromThread(f, *args, **kwargs)


@pytest_twisted.inlineCallbacks
def test_retries_wait_for_the_backoff_deadline_on_the_injected_clock_and_stop_cancels_them(
    api: FakeKubeAPI, watchers: list[PodWatcher],
) -> Any:
    api.fail_next(503, count=100, method="GET", resource="pods", watch=False)
    clock = HandClock()
    config = PodWatcherConfig("default", "app=infx", "me", PORT, backoff=FAST)
    watcher = PodWatcher(clock, client.CoreV1Api(client.ApiClient(api.client_configuration())),
                         config, Recorder(), random.Random(1))
    watchers.append(watcher)
    watcher.start()
    yield eventually(lambda: watcher.state is InformerState.BACKING_OFF, "the first backoff")
    (retry,) = clock.getDelayedCalls()
    assert 0 < retry.getTime() <= FAST.initial
    assert len(api.list_requests()) == 1
    clock.advance(retry.getTime())
    yield eventually(lambda: len(api.list_requests()) == 2 and len(clock.getDelayedCalls()) == 1,
                     "the second attempt and its backoff")
    yield watcher.stop()
    assert clock.getDelayedCalls() == []


@pytest.mark.parametrize("seed", [1, 2, 3])
@pytest_twisted.inlineCallbacks
def test_the_peer_set_converges_to_the_live_ready_pods_through_random_churn_and_faults(
    api: FakeKubeAPI, watchers: list[PodWatcher], seed: int,
) -> Any:
    """Random pod changes interleaved with dropped watches, compactions and bookmarks."""
    rng = random.Random(seed)
    recorder = Recorder()
    watcher = start_watcher(api, watchers, recorder)
    names = ["me", "gw-1", "gw-2", "gw-3", "gw-4"]
    for step in range(60):
        name = rng.choice(names)
        exists = any(p["metadata"]["name"] == name for p in api.list(PODS))
        action = rng.random()
        if not exists:
            api.add_pod(name, labels=APP if rng.random() < 0.8 else {"app": "other"},
                        ip=rng.choice([None, f"10.0.0.{step}"]))
        elif action < 0.25:
            api.set_ready(name, rng.random() < 0.7)
        elif action < 0.45:
            api.set_pod_ip(name, f"10.1.0.{step}")
        elif action < 0.55:
            api.mark_terminating(name)
        elif action < 0.7:
            api.delete_pod(name)
        elif action < 0.8:
            api.drop_watches()
        elif action < 0.85:
            api.compact()
        elif action < 0.9:
            api.send_bookmarks()
        if rng.random() < 0.3:
            yield task.deferLater(reactor, rng.choice([0, 0.01, 0.05]), lambda: None)
    yield converged(api, watcher, recorder)


@pytest_twisted.inlineCallbacks
def test_kube_api_client_reads_kubeconfig_from_the_environment(
    api: FakeKubeAPI, watchers: list[PodWatcher], tmp_path: Any,
) -> Any:
    api.token = "t0ken"
    path = write_kubeconfig(tmp_path / "kubeconfig", api.url, token="t0ken")
    api_client = kube_api_client({"KUBECONFIG": str(path)})
    api.add_live_pod("gw-1", "10.0.0.1", labels=APP)
    recorder = Recorder()
    watcher = start_watcher(api, watchers, recorder, api_client=api_client)
    yield converged(api, watcher, recorder)


def test_watcher_config_reads_pod_name_and_namespace_from_the_environment() -> None:
    config = PodWatcherConfig.from_environment(
        "app=infx", PORT, {"POD_NAME": "gw-0", "NAMESPACE": "llm"}, watch_timeout=5)
    assert (config.namespace, config.own_pod_name, config.label_selector, config.watch_timeout) == (
        "llm", "gw-0", "app=infx", 5)
    with pytest.raises(ValueError):
        PodWatcherConfig("ns", "", None, PORT, watch_timeout=0)


def test_static_peers_are_all_added_at_start() -> None:
    recorder = Recorder()
    peers = StaticPeers(["10.0.0.1:8083", "[fd00::2]:9000", "gw.example:8083"], recorder)
    assert peers.peers == {}
    peers.start()
    assert recorder.changes == [
        PeerAdded("10.0.0.1:8083", PeerAddress("10.0.0.1", 8083)),
        PeerAdded("[fd00::2]:9000", PeerAddress("fd00::2", 9000)),
        PeerAdded("gw.example:8083", PeerAddress("gw.example", 8083)),
    ]
    assert peers.peers == recorder.view
    with pytest.raises(InvalidPeerAddress):
        StaticPeers(["10.0.0.1"], recorder)


@pytest_twisted.inlineCallbacks
def test_a_pod_watcher_runs_as_a_service_and_stopping_the_service_stops_it(api: FakeKubeAPI) -> Any:
    api.add_live_pod("gw-1", "10.0.0.1", labels=APP)
    recorder = Recorder()
    config = PodWatcherConfig("default", "app=infx", "me", PORT, backoff=FAST)
    watcher = PodWatcher(reactor, client.CoreV1Api(client.ApiClient(api.client_configuration())),
                         config, recorder, random.Random(1))
    service = PeerSourceService(watcher)
    service.startService()
    yield converged(api, watcher, recorder)
    yield api.when_watching()
    yield service.stopService()
    assert watcher.state is InformerState.STOPPED
    yield eventually(lambda: api.open_watches == 0, "the watch to close")


def test_kube_api_client_prefers_in_cluster_settings_inside_a_pod() -> None:
    """With KUBERNETES_SERVICE_HOST set it reads the service account, not KUBECONFIG; what is
    missing is one line naming where it looked (a usage error for twistd)."""
    from infx.config import ConfigError

    with pytest.raises(ConfigError, match=r"^--kube: no usable Kubernetes client config from in-cluster settings"):
        kube_api_client({"KUBERNETES_SERVICE_HOST": "10.96.0.1", "KUBERNETES_SERVICE_PORT": "443",
                         "KUBECONFIG": "/nonexistent"})
