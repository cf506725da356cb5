"""The scaler joined to the real processor and dispatcher (ProcessorLink), engines as fake routes.

1,000 chat tasks for a model whose deployment is at zero: one scale write,
one event, and every task is served once an engine for the model reports
ready; a crash loop fails the waiting tasks at once; cancelled tasks are
released from the scaler.
"""

from __future__ import annotations

from typing import Any

import pytest_twisted
from kubernetes import client
from prometheus_client import CollectorRegistry
from twisted.internet import defer, reactor, task

from harness.kubeapi import EVENTS, FakeKubeAPI
from harness.scaler_fakes import InMemoryServiceQuery
from infx.gateway.dispatcher import Dispatcher
from infx.gateway.metrics import GatewayMetrics
from infx.gateway.tasks import Availability
from infx.gateway.tasks import Submission
from infx.scaling.kube import KubernetesEvents, KubernetesServiceQuery
from infx.scaling.scaler import InferenceScaler, ProcessorLink
from protocol.processor.core import Processor
from protocol.processor.config import ProcessorConfig
from protocol.processor.keys import Locality
from protocol.scaling.scaler import MIN_SCALE_LABEL, MODELS_ANNOTATION, SCALABLE_LABEL, DeploymentKey
from tests.support.processor import chat, engine_status, http
from tests.support.scaler_processor import Route, Sink

KEY = DeploymentKey("default", "llama")
LABELS = {"app": "llama", SCALABLE_LABEL: "true", MIN_SCALE_LABEL: "0"}


@defer.inlineCallbacks
def until(condition: Any, limit: float = 10.0) -> Any:
    """Let the reactor run until ``condition()``; fail after ``limit`` seconds (a safety net)."""
    waited = 0.0
    while not condition():
        assert waited < limit, f"condition not met within {limit}s"
        yield task.deferLater(reactor, 0.01, lambda: None)
        waited += 0.01


def gateway(clock: Any, query: Any, events: Any) -> tuple[Dispatcher, InferenceScaler, ProcessorLink]:
    processor = Processor(ProcessorConfig(queue_timeout=600))
    dispatcher = Dispatcher(clock, processor, GatewayMetrics(CollectorRegistry()))
    scaler = InferenceScaler(clock, query, events=events)
    link = ProcessorLink(scaler, dispatcher)
    return dispatcher, scaler, link


def submit(dispatcher: Dispatcher, count: int) -> list[tuple[Sink, Any]]:
    out = []
    for _ in range(count):
        sink = Sink()
        handle = dispatcher.submit(Submission("t1", "llama-3", chat("llama-3"), streaming=False, timeout=600), sink)
        out.append((sink, handle))
    return out


def deployment() -> dict[str, Any]:
    return {"metadata": {"name": "llama", "namespace": "default", "labels": dict(LABELS),
                         "annotations": {MODELS_ANNOTATION: "llama-3"}},
            "spec": {"replicas": 0, "selector": {"matchLabels": {"app": "llama"}}}}


@pytest_twisted.inlineCallbacks
def test_thousand_chat_tasks_one_write_one_event_all_served_when_the_engine_connects() -> Any:
    api = FakeKubeAPI(reactor).start()
    try:
        api.add_deployment("llama", replicas=0, labels=LABELS, annotations={MODELS_ANNOTATION: "llama-3"})
        c = client.ApiClient(api.client_configuration())
        dispatcher, scaler, link = gateway(reactor, KubernetesServiceQuery(reactor, c),
                                           KubernetesEvents(reactor, c, reactor, "gw-1"))
        scaler.observe_deployment(api.deployment("llama"))
        assert dispatcher.availability("t1", "llama-3") is Availability.STARTABLE
        requests = submit(dispatcher, 1000)
        assert scaler.machine.held_count(KEY) == 1000
        yield until(lambda: not scaler.writes_in_flight)
        yield until(lambda: len(api.list(EVENTS)) == 1)
        assert api.deployment("llama")["metadata"]["generation"] == 2  # exactly one write
        assert [e["reason"] for e in api.list(EVENTS)] == ["ScaledFromZero"]
        # The engine comes up and reports the model ready: every task goes to it.
        route = Route()
        dispatcher.engine_status(route, "t1", engine_status("e1", "llama-3"), Locality.LOCAL)
        assert len(route.sent) == 1000
        assert scaler.machine.held_count(KEY) == 0
        for sent in route.sent:
            dispatcher.result_received(route, http(sent.id))
        assert all(sink.status == 200 and sink.failure is None for sink, _ in requests)
    finally:
        yield api.stop()


def test_crash_loop_fails_the_waiting_tasks_with_the_reason() -> None:
    clock = task.Clock()
    query = InMemoryServiceQuery()
    dispatcher, scaler, _ = gateway(clock, query, query)
    scaler.observe_deployment(query.add(deployment()))
    requests = submit(dispatcher, 10)
    scaler.observe_pod({"metadata": {"name": "llama-1", "namespace": "default", "labels": {"app": "llama"}},
                        "status": {"containerStatuses": [
                            {"name": "engine", "state": {"waiting": {"reason": "CrashLoopBackOff"}}}]}})
    assert all(sink.failure is not None and sink.failure[0] == 503 and "CrashLoopBackOff" in sink.failure[1]
               for sink, _ in requests)
    assert dispatcher.processor.waiting_counts() == {}


def test_a_cancelled_task_is_released_from_the_scaler_as_it_leaves_the_queue() -> None:
    clock = task.Clock()
    query = InMemoryServiceQuery()
    dispatcher, scaler, link = gateway(clock, query, query)
    scaler.observe_deployment(query.add(deployment()))
    requests = submit(dispatcher, 3)
    assert scaler.machine.held_count(KEY) == 3
    requests[0][1].cancel()
    assert scaler.machine.held_count(KEY) == 2  # at once: the core says so, nothing polls
    link.stop()


def test_an_engine_that_vanished_does_not_count_as_ready_for_the_next_task() -> None:
    clock = task.Clock()
    query = InMemoryServiceQuery()
    dispatcher, scaler, _ = gateway(clock, query, query)
    scaler.observe_deployment(query.add(deployment()))
    submit(dispatcher, 1)
    route = Route()
    dispatcher.engine_status(route, "t1", engine_status("e1", "llama-3"), Locality.LOCAL)
    dispatcher.route_closed(route, "engine gone")
    query.deployments[KEY]["spec"]["replicas"] = 0
    scaler.observe_deployment(query.deployments[KEY])
    [(sink, handle)] = submit(dispatcher, 1)
    assert handle.task_id in [t for t in dispatcher.processor.waiting_task_ids("t1", "llama-3")]
    assert scaler.machine.held_count(KEY) >= 1  # held, not taken for served by a stale "ready"
    assert query.writes[-1] == (KEY, 1)  # and it started the deployment again


def test_in_flight_tasks_are_reported_as_load() -> None:
    clock = task.Clock()
    query = InMemoryServiceQuery()
    dispatcher, scaler, link = gateway(clock, query, query)
    scaler.observe_deployment(query.add(deployment()))
    route = Route()
    dispatcher.engine_status(route, "t1", engine_status("e1", "llama-3"), Locality.LOCAL)
    submit(dispatcher, 4)
    clock.advance(1)  # the core's load report interval
    assert scaler.machine.in_progress("llama-3") == 4
    for sent in route.sent:
        dispatcher.result_received(route, http(sent.id))
    clock.advance(1)
    assert scaler.machine.in_progress("llama-3") == 0

