"""protocol.discovery.runtimes: which pods' runtimes the gateway serves by URL, as a pod informer feeds it."""

from __future__ import annotations

import random
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from protocol.backoff import Backoff
from protocol.discovery.informer import Added, Deleted, Informer, Modified, ObjectDeleted, ObjectUpdated, Synced
from protocol.discovery.runtimes import (
    RuntimeAdded,
    RuntimePod,
    RuntimeRemoved,
    RuntimeSet,
    RuntimeTarget,
    runtime_pod,
    runtime_pod_key,
    runtime_pod_version,
)
from tests.support.peers import pod_json


def vllm_pod(name: str, models: str | None = None, **fields: Any) -> dict[str, Any]:
    obj = pod_json(name, **fields)
    if models is not None:
        obj["metadata"]["annotations"] = {"infx.io/models": models}
    return obj


def test_a_pod_reads_its_models_from_the_annotation_the_scaler_uses() -> None:
    assert runtime_pod(vllm_pod("v", models=" llama, llama ,lora,")).models == ("llama", "lora")
    assert runtime_pod(vllm_pod("v")).models == ()
    assert runtime_pod(vllm_pod("v")).state.name == "v"


def test_a_live_pod_is_served_at_its_ip_and_the_runtime_port() -> None:
    runtimes = RuntimeSet(8000)
    pod = runtime_pod(vllm_pod("v", models="llama", ip="10.1.2.3"))
    assert runtimes.cache_changed(Added("v", pod)) == [
        RuntimeAdded("v", RuntimeTarget("http://10.1.2.3:8000", ("llama",)))]
    assert runtimes.targets == {"v": RuntimeTarget("http://10.1.2.3:8000", ("llama",))}


def test_an_ipv6_pod_is_served_in_brackets() -> None:
    [added] = RuntimeSet(8000).cache_changed(Added("v", runtime_pod(vllm_pod("v", ip="fd00::7"))))
    assert isinstance(added, RuntimeAdded) and added.target.url == "http://[fd00::7]:8000"


@pytest.mark.parametrize("fields", [
    {"ready": "False"}, {"phase": "Pending"}, {"ip": None}, {"deletion": "2026-01-01T00:00:00Z"}, {"ip": "nonsense"},
])
def test_a_pod_that_cannot_answer_is_not_served(fields: dict[str, Any]) -> None:
    assert RuntimeSet(8000).cache_changed(Added("v", runtime_pod(vllm_pod("v", **fields)))) == []


def test_a_pod_that_stops_answering_or_goes_away_is_removed() -> None:
    runtimes = RuntimeSet(8000)
    live = runtime_pod(vllm_pod("v"))
    runtimes.cache_changed(Added("v", live))
    terminating = runtime_pod(vllm_pod("v", deletion="2026-01-01T00:00:00Z"))
    target = RuntimeTarget("http://10.0.0.1:8000")
    assert runtimes.cache_changed(Modified("v", live, terminating)) == [RuntimeRemoved("v", target)]
    assert runtimes.cache_changed(Deleted("v", terminating)) == []
    runtimes.cache_changed(Added("v", live))
    assert runtimes.cache_changed(Deleted("v", live)) == [RuntimeRemoved("v", target)]
    assert runtimes.targets == {}


def test_a_pod_whose_address_or_models_change_is_removed_and_added_again() -> None:
    runtimes = RuntimeSet(8000)
    first = runtime_pod(vllm_pod("v", ip="10.0.0.1"))
    runtimes.cache_changed(Added("v", first))
    moved = runtime_pod(vllm_pod("v", ip="10.0.0.2", models="m"))
    assert runtimes.cache_changed(Modified("v", first, moved)) == [
        RuntimeRemoved("v", RuntimeTarget("http://10.0.0.1:8000")),
        RuntimeAdded("v", RuntimeTarget("http://10.0.0.2:8000", ("m",)))]
    # A change that leaves the target as it was (a new resourceVersion, another label) changes nothing.
    relabelled = runtime_pod(vllm_pod("v", ip="10.0.0.2", models="m", rv="9"))
    assert runtimes.cache_changed(Modified("v", moved, relabelled)) == []
    assert runtimes.cache_changed(Synced(1)) == []


def test_the_port_must_be_a_port() -> None:
    for port in (0, 65536):
        with pytest.raises(ValueError):
            RuntimeSet(port)


_PODS = st.lists(st.tuples(st.sampled_from(["a", "b", "c"]), st.sampled_from(["10.0.0.1", "10.0.0.2", None]),
                           st.booleans(), st.sampled_from([None, "m", "m,n"]), st.booleans()), max_size=30)


@settings(max_examples=200, deadline=None)
@given(_PODS)
def test_whatever_the_order_of_events_the_runtimes_served_are_those_the_last_pods_want(events) -> None:
    informer: Informer[RuntimePod] = Informer(runtime_pod_key, runtime_pod_version,
                                              Backoff(initial=1.0, factor=2.0, cap=2.0, jitter=0.0), random.Random(0))
    informer.start()
    informer.listed([], "1")
    runtimes = RuntimeSet(8000)
    served: dict[str, RuntimeTarget] = {}
    last: dict[str, RuntimePod | None] = {}
    for rv, (name, ip, ready, models, deleted) in enumerate(events, start=2):
        pod = runtime_pod(vllm_pod(name, ip=ip, ready="True" if ready else "False", models=models, rv=str(rv)))
        event = ObjectDeleted(pod) if deleted else ObjectUpdated(pod)
        for change in informer.event_received(event):
            for applied in runtimes.cache_changed(change):  # type: ignore[arg-type]
                if isinstance(applied, RuntimeRemoved):
                    assert served.pop(applied.name) == applied.target
                else:
                    assert applied.name not in served
                    served[applied.name] = applied.target
        last[name] = None if deleted else pod
    want = {name: RuntimeTarget(f"http://{pod.state.ip}:8000", pod.models) for name, pod in last.items()
            if pod is not None and pod.state.ip is not None and pod.state.ready}
    assert served == want == runtimes.targets
