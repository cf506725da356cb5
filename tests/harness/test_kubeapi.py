"""The fake Kubernetes API server, exercised with the official ``kubernetes`` client over real HTTP.

The client blocks, and the server runs on the test's reactor, so every client
call runs in a thread (``deferToThread``).
"""

from __future__ import annotations

from typing import Any, Callable

import pytest
import pytest_twisted
from kubernetes import client, config, watch
from kubernetes.client.rest import ApiException
from twisted.internet import defer, reactor, threads
from urllib3.exceptions import HTTPError

from harness.kubeapi import EVENTS, PODS, FakeKubeAPI, write_kubeconfig
from harness.kubeapi.store import ApiError, json_patch, label_selector, merge_patch

APP = {"app": "infx"}
WATCH_TIMEOUT = 5  # a safety net: every watch here ends well before it


@pytest.fixture
def api() -> Any:
    server = FakeKubeAPI(reactor).start()
    yield server
    pytest_twisted.blockon(server.stop())


def core(api: FakeKubeAPI) -> client.CoreV1Api:
    return client.CoreV1Api(client.ApiClient(api.client_configuration()))


def apps(api: FakeKubeAPI) -> client.AppsV1Api:
    return client.AppsV1Api(client.ApiClient(api.client_configuration()))


def in_thread(f: Callable[..., Any], *args: Any, **kwargs: Any) -> defer.Deferred[Any]:
    return threads.deferToThread(f, *args, **kwargs)


def collect(func: Callable[..., Any], count: int, *args: Any, **kwargs: Any) -> tuple[list[Any], Any]:
    """Watch until ``count`` events arrived; returns them and the Watch's resourceVersion."""
    w = watch.Watch()
    events = []
    kwargs.setdefault("timeout_seconds", WATCH_TIMEOUT)
    for event in w.stream(func, *args, **kwargs):
        events.append(event)
        if len(events) >= count:
            w.stop()
    return events, w.resource_version


@pytest_twisted.inlineCallbacks
def test_list_filters_by_label_selector_and_reports_the_resource_version(api: FakeKubeAPI) -> Any:
    api.add_live_pod("gw-1", "10.0.0.1", labels=APP)
    api.add_pod("other", labels={"app": "else"})
    api.add_pod("gw-2", labels=APP, namespace="elsewhere")
    pods = yield in_thread(core(api).list_namespaced_pod, "default", label_selector="app=infx")
    assert [p.metadata.name for p in pods.items] == ["gw-1"]
    assert pods.items[0].status.pod_ip == "10.0.0.1"
    assert pods.items[0].status.conditions[-1].status == "True"
    assert pods.metadata.resource_version == str(api.store.resource_version)
    everywhere = yield in_thread(core(api).list_pod_for_all_namespaces, label_selector="app in (infx)")
    assert sorted(p.metadata.name for p in everywhere.items) == ["gw-1", "gw-2"]
    not_infx = yield in_thread(core(api).list_namespaced_pod, "default", label_selector="app!=infx")
    assert [p.metadata.name for p in not_infx.items] == ["other"]


@pytest_twisted.inlineCallbacks
def test_watch_streams_changes_after_the_given_resource_version(api: FakeKubeAPI) -> Any:
    api.add_pod("gw-1", labels=APP)
    since = api.store.resource_version
    api.set_pod_ip("gw-1", "10.0.0.1")
    result = in_thread(collect, core(api).list_namespaced_pod, 4, "default",
                       label_selector="app=infx", resource_version=str(since))
    yield api.when_watching()
    api.set_ready("gw-1")
    api.add_pod("unrelated", labels={"app": "else"})
    api.delete_pod("gw-1")
    api.add_pod("gw-2", labels=APP)
    events, rv = yield result
    assert [(e["type"], e["object"].metadata.name) for e in events] == [
        ("MODIFIED", "gw-1"), ("MODIFIED", "gw-1"), ("DELETED", "gw-1"), ("ADDED", "gw-2"),
    ]
    assert events[1]["object"].status.phase == "Running"
    assert rv == str(api.store.resource_version)


@pytest_twisted.inlineCallbacks
def test_watch_without_resource_version_starts_with_the_current_objects(api: FakeKubeAPI) -> Any:
    api.add_pod("gw-1", labels=APP)
    events, _ = yield in_thread(collect, core(api).list_namespaced_pod, 1, "default")
    assert [(e["type"], e["object"].metadata.name) for e in events] == [("ADDED", "gw-1")]


@pytest_twisted.inlineCallbacks
def test_objects_leaving_or_entering_the_selector_are_deleted_or_added_for_the_watch(
    api: FakeKubeAPI,
) -> Any:
    api.add_pod("gw-1", labels=APP)
    api.add_pod("gw-2", labels={"app": "else"})
    result = in_thread(collect, core(api).list_namespaced_pod, 2, "default",
                       label_selector="app=infx", resource_version=str(api.store.resource_version))
    yield api.when_watching()
    api.update(PODS, "gw-1", lambda pod: pod["metadata"]["labels"].update(app="else"))
    api.update(PODS, "gw-2", lambda pod: pod["metadata"]["labels"].update(app="infx"))
    events, _ = yield result
    assert [(e["type"], e["object"].metadata.name) for e in events] == [
        ("DELETED", "gw-1"), ("ADDED", "gw-2"),
    ]


@pytest_twisted.inlineCallbacks
def test_bookmarks_carry_the_current_resource_version_to_watches_that_allow_them(
    api: FakeKubeAPI,
) -> Any:
    since = str(api.store.resource_version)
    result = in_thread(collect, core(api).list_namespaced_pod, 1, "default", label_selector="app=infx",
                       resource_version=since, allow_watch_bookmarks=True)
    plain = in_thread(collect, core(api).list_namespaced_pod, 1, "default", label_selector="app=infx",
                      resource_version=since)
    yield api.when_watching(2)
    api.add_pod("filtered-out")
    assert api.send_bookmarks() == 1
    events, rv = yield result
    assert events[0]["type"] == "BOOKMARK"
    assert rv == str(api.store.resource_version)
    api.add_pod("gw-1", labels=APP)
    events, _ = yield plain
    assert [e["type"] for e in events] == ["ADDED"]


@pytest_twisted.inlineCallbacks
def test_periodic_bookmarks() -> Any:
    api = FakeKubeAPI(reactor, bookmark_interval=0.05).start()
    try:
        events, _ = yield in_thread(collect, core(api).list_namespaced_pod, 2, "default",
                                    resource_version="1", allow_watch_bookmarks=True)
        assert [e["type"] for e in events] == ["BOOKMARK", "BOOKMARK"]
    finally:
        yield api.stop()


@pytest_twisted.inlineCallbacks
def test_watch_from_a_compacted_resource_version_gets_410_gone(api: FakeKubeAPI) -> Any:
    api.add_pod("gw-1", labels=APP)
    old = api.store.resource_version
    api.set_ready("gw-1")
    api.add_pod("gw-2", labels=APP)
    api.compact()
    with pytest.raises(ApiException) as raised:
        yield in_thread(collect, core(api).list_namespaced_pod, 1, "default",
                        resource_version=str(old))
    assert raised.value.status == 410
    # The raw stream carries the Status as an ERROR event, as the real server sends it.
    response = yield in_thread(core(api).list_namespaced_pod, "default", watch=True,
                               resource_version=str(old), _preload_content=False)
    assert response.status == 200
    body = response.data.decode()
    assert '"type": "ERROR"' in body and '"code": 410' in body and "too old resource version" in body


@pytest_twisted.inlineCallbacks
def test_exact_list_from_a_compacted_resource_version_gets_410(api: FakeKubeAPI) -> Any:
    api.add_pod("gw-1")
    api.compact()
    with pytest.raises(ApiException) as raised:
        yield in_thread(core(api).list_namespaced_pod, "default", resource_version="0",
                        resource_version_match="Exact")
    assert raised.value.status == 410
    pods = yield in_thread(core(api).list_namespaced_pod, "default", resource_version="0")
    assert [p.metadata.name for p in pods.items] == ["gw-1"]


@pytest_twisted.inlineCallbacks
def test_dropping_watches_breaks_the_clients_stream_mid_way(api: FakeKubeAPI) -> Any:
    result = in_thread(collect, core(api).list_namespaced_pod, 2, "default", resource_version="1")
    yield api.when_watching()
    api.add_pod("gw-1")
    assert api.drop_watches() == 1
    with pytest.raises(HTTPError):
        yield result
    assert api.open_watches == 0


@pytest_twisted.inlineCallbacks
def test_watch_ends_cleanly_after_timeout_seconds(api: FakeKubeAPI) -> Any:
    events, _ = yield in_thread(collect, core(api).list_namespaced_pod, 1, "default",
                                resource_version="1", timeout_seconds=1)
    assert events == []
    assert api.open_watches == 0


@pytest_twisted.inlineCallbacks
def test_injected_faults_answer_with_a_status(api: FakeKubeAPI) -> Any:
    api.fail_next(503, method="GET", resource="pods", watch=False)
    with pytest.raises(ApiException) as raised:
        yield in_thread(core(api).list_namespaced_pod, "default")
    assert raised.value.status == 503
    yield in_thread(core(api).list_namespaced_pod, "default")
    assert len(api.list_requests()) == 2


@pytest_twisted.inlineCallbacks
def test_pod_rest_verbs_create_replace_patch_and_delete(api: FakeKubeAPI) -> Any:
    v1 = core(api)
    pod = client.V1Pod(metadata=client.V1ObjectMeta(name="gw-1", labels=APP),
                       spec=client.V1PodSpec(containers=[client.V1Container(name="c", image="i")]))
    created = yield in_thread(v1.create_namespaced_pod, "default", pod)
    assert created.metadata.uid and created.metadata.resource_version
    with pytest.raises(ApiException) as raised:
        yield in_thread(v1.create_namespaced_pod, "default", pod)
    assert raised.value.status == 409
    created.metadata.labels["tier"] = "gw"
    replaced = yield in_thread(v1.replace_namespaced_pod, "gw-1", "default", created)
    assert replaced.metadata.labels == {"app": "infx", "tier": "gw"}
    with pytest.raises(ApiException) as raised:  # stale resourceVersion
        yield in_thread(v1.replace_namespaced_pod, "gw-1", "default", created)
    assert raised.value.status == 409
    patched = yield in_thread(v1.patch_namespaced_pod, "gw-1", "default",
                              {"metadata": {"labels": {"tier": None}}})
    assert patched.metadata.labels == {"app": "infx"}
    patched = yield in_thread(v1.patch_namespaced_pod, "gw-1", "default",
                              [{"op": "add", "path": "/metadata/labels/x", "value": "y"}])
    assert patched.metadata.labels == {"app": "infx", "x": "y"}
    status = yield in_thread(v1.patch_namespaced_pod_status, "gw-1", "default",
                             {"status": {"phase": "Running", "podIP": "10.0.0.9"}})
    assert (status.status.phase, status.status.pod_ip) == ("Running", "10.0.0.9")
    yield in_thread(v1.delete_namespaced_pod, "gw-1", "default")
    with pytest.raises(ApiException) as raised:
        yield in_thread(v1.read_namespaced_pod, "gw-1", "default")
    assert raised.value.status == 404


@pytest_twisted.inlineCallbacks
def test_kubeconfig_with_a_token_reaches_the_server_and_no_token_is_refused(tmp_path: Any) -> Any:
    api = FakeKubeAPI(reactor, token="s3cret").start()
    try:
        api.add_pod("gw-1")
        path = write_kubeconfig(tmp_path / "config", api.url, token="s3cret")
        configuration = client.Configuration()
        config.load_kube_config(config_file=str(path), client_configuration=configuration)
        v1 = client.CoreV1Api(client.ApiClient(configuration))
        pods = yield in_thread(v1.list_namespaced_pod, "default")
        assert [p.metadata.name for p in pods.items] == ["gw-1"]
        anonymous = client.Configuration()
        anonymous.host = api.url
        with pytest.raises(ApiException) as raised:
            yield in_thread(client.CoreV1Api(client.ApiClient(anonymous)).list_namespaced_pod, "default")
        assert raised.value.status == 401
    finally:
        yield api.stop()


# --- for the scaler: deployments, scale, events, leases --------------------------------


@pytest_twisted.inlineCallbacks
def test_deployment_scale_subresource_with_resource_version_compare_and_set(api: FakeKubeAPI) -> Any:
    api.add_deployment("engine", replicas=0)
    v1 = apps(api)
    scale = yield in_thread(v1.read_namespaced_deployment_scale, "engine", "default")
    assert scale.spec.replicas is None  # the real server omits 0 replicas
    assert scale.status.selector == "app=engine"
    scale.spec.replicas = 2
    updated = yield in_thread(v1.replace_namespaced_deployment_scale, "engine", "default", scale)
    assert updated.spec.replicas == 2
    assert api.deployment("engine")["spec"]["replicas"] == 2
    with pytest.raises(ApiException) as raised:  # scale still has the old resourceVersion
        yield in_thread(v1.replace_namespaced_deployment_scale, "engine", "default", scale)
    assert raised.value.status == 409
    patched = yield in_thread(v1.patch_namespaced_deployment_scale, "engine", "default",
                              {"spec": {"replicas": 0}})
    assert patched.spec.replicas is None
    assert api.deployment("engine")["metadata"]["generation"] == 3


@pytest_twisted.inlineCallbacks
def test_deployments_list_watch_and_patch(api: FakeKubeAPI) -> Any:
    api.add_deployment("engine-a", labels={"app": "engine", "model": "a"})
    api.add_deployment("other", labels={"app": "other"})
    v1 = apps(api)
    listed = yield in_thread(v1.list_namespaced_deployment, "default", label_selector="app=engine")
    assert [d.metadata.name for d in listed.items] == ["engine-a"]
    result = in_thread(collect, v1.list_namespaced_deployment, 1, "default",
                       label_selector="app=engine", resource_version=listed.metadata.resource_version)
    yield api.when_watching()
    api.set_deployment_status("engine-a", replicas=1, ready_replicas=1)
    events, _ = yield result
    assert events[0]["type"] == "MODIFIED"
    assert events[0]["object"].status.ready_replicas == 1
    patched = yield in_thread(v1.patch_namespaced_deployment, "engine-a", "default",
                              {"metadata": {"annotations": {"infx/last-used": "now"}}})
    assert patched.metadata.annotations == {"infx/last-used": "now"}
    assert patched.status.ready_replicas == 1  # the main resource does not change status


@pytest_twisted.inlineCallbacks
def test_leases_compare_and_set_on_resource_version(api: FakeKubeAPI) -> Any:
    v1 = client.CoordinationV1Api(client.ApiClient(api.client_configuration()))
    lease = client.V1Lease(metadata=client.V1ObjectMeta(name="scaler"),
                           spec=client.V1LeaseSpec(holder_identity="a", lease_duration_seconds=15))
    created = yield in_thread(v1.create_namespaced_lease, "default", lease)
    created.spec.holder_identity = "b"
    taken = yield in_thread(v1.replace_namespaced_lease, "scaler", "default", created)
    assert taken.spec.holder_identity == "b"
    created.spec.holder_identity = "c"
    with pytest.raises(ApiException) as raised:
        yield in_thread(v1.replace_namespaced_lease, "scaler", "default", created)
    assert raised.value.status == 409
    assert api.lease("scaler")["spec"]["holderIdentity"] == "b"


@pytest_twisted.inlineCallbacks
def test_events_can_be_posted_and_listed(api: FakeKubeAPI) -> Any:
    v1 = client.EventsV1Api(client.ApiClient(api.client_configuration()))
    event = client.EventsV1Event(
        metadata=client.V1ObjectMeta(generate_name="engine."),
        event_time="2026-01-01T00:00:00.000000Z", action="Scale", reason="ScaledFromZero",
        reporting_controller="infx", reporting_instance="gw-1", type="Normal", note="scaled to 1",
        regarding=client.V1ObjectReference(kind="Deployment", name="engine", namespace="default"),
    )
    created = yield in_thread(v1.create_namespaced_event, "default", event)
    assert created.metadata.name.startswith("engine.")
    listed = yield in_thread(v1.list_namespaced_event, "default")
    assert [e.reason for e in listed.items] == ["ScaledFromZero"]
    assert api.list(EVENTS)[0]["note"] == "scaled to 1"


# --- the store's pure parts ---------------------------------------------------------


@pytest.mark.parametrize("selector, labels, expected", [
    ("", {}, True),
    ("app=infx", {"app": "infx"}, True),
    ("app==infx,tier=gw", {"app": "infx"}, False),
    ("app!=infx", {}, True),
    ("app", {"app": ""}, True),
    ("!app", {"app": "x"}, False),
    ("app in (a, b),tier notin (x)", {"app": "b", "tier": "y"}, True),
    ("app in (a, b)", {"app": "c"}, False),
    ("example.com/role=gw", {"example.com/role": "gw"}, True),
])
def test_label_selectors_follow_kubernetes_semantics(selector: str, labels: dict[str, str],
                                                     expected: bool) -> None:
    assert label_selector(selector)(labels) is expected


def test_malformed_label_selectors_are_a_400() -> None:
    with pytest.raises(ApiError) as raised:
        label_selector("app=(x")
    assert raised.value.code == 400


def test_merge_patch_removes_nulls_and_replaces_lists() -> None:
    target = {"a": {"b": 1, "c": 2}, "l": [1, 2]}
    assert merge_patch(target, {"a": {"b": None, "d": 3}, "l": [3]}) == {"a": {"c": 2, "d": 3}, "l": [3]}
    assert target == {"a": {"b": 1, "c": 2}, "l": [1, 2]}


def test_json_patch_operations_and_failed_test_is_422() -> None:
    doc = {"spec": {"replicas": 1, "list": [1, 3]}, "metadata": {"labels": {"a/b": "x"}}}
    patched = json_patch(doc, [
        {"op": "test", "path": "/spec/replicas", "value": 1},
        {"op": "replace", "path": "/spec/replicas", "value": 2},
        {"op": "add", "path": "/spec/list/1", "value": 2},
        {"op": "add", "path": "/spec/list/-", "value": 4},
        {"op": "copy", "from": "/metadata/labels/a~1b", "path": "/metadata/labels/c"},
        {"op": "move", "from": "/metadata/labels/a~1b", "path": "/metadata/labels/d"},
        {"op": "remove", "path": "/metadata/labels/c"},
    ])
    assert patched == {"spec": {"replicas": 2, "list": [1, 2, 3, 4]}, "metadata": {"labels": {"d": "x"}}}
    with pytest.raises(ApiError) as raised:
        json_patch(doc, [{"op": "test", "path": "/spec/replicas", "value": 5}])
    assert raised.value.code == 422
    with pytest.raises(ApiError) as raised:
        json_patch(doc, [{"op": "remove", "path": "/nope/x"}])
    assert raised.value.code == 400
