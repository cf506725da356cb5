"""The dispatcher on a ``task.Clock``: who served an HTTP request travels back with its results
(engine, gateway: this one for a local engine, the reporting peer's pod for a remote one, retries)
and the wait for a first dispatch is timed exactly."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry
from twisted.internet import task

from infx.gateway.dispatcher import Dispatcher
from infx.gateway.metrics import GatewayMetrics
from infx.gateway.tasks import Submission
from protocol.gateway.effects import CoreConfig
from protocol.processor.core import Processor
from protocol.processor.config import ProcessorConfig
from protocol.processor.keys import Locality
from tests.support.processor import chat, engine_status, http
from tests.support.scaler_processor import Route, Sink


class PeerRoute(Route):
    """A peer's stream: the pod that reported the engine."""

    pod_name = "gw-b"


def dispatcher(**config: Any) -> tuple[task.Clock, Dispatcher]:
    clock = task.Clock()
    clock.advance(100)
    d = Dispatcher(clock, Processor(ProcessorConfig(**config)), GatewayMetrics(CollectorRegistry()),
                   config=CoreConfig(pod_name="gw-a"))
    return clock, d


def submit(d: Dispatcher, sink: Sink) -> Any:
    return d.submit(Submission(tenant="default", model="m", request=chat(), streaming=False), sink)


def test_a_request_that_waited_3s_for_a_local_engine_says_so_and_names_this_gateway():
    clock, d = dispatcher()
    d.engine_status(Route(), "default", engine_status("other", "x"), Locality.LOCAL)
    sink = Sink()
    handle = submit(d, sink)
    clock.advance(3)
    local = Route()
    d.engine_status(local, "default", engine_status("e1", "m"), Locality.LOCAL)
    d.result_received(local, http(local.sent[0].id))
    assert sink.status == 200
    served = handle.served_by
    assert (served.engine_id, served.gateway, served.retries, served.queued_seconds) == ("e1", "gw-a", 0, 3.0)
    registry = d.metrics.registry
    assert registry.get_sample_value("infx_queue_wait_seconds_sum", {"tenant": "default", "model": "m"}) == 3.0


def test_a_request_a_peers_engine_served_after_a_retry_names_that_peer():
    clock, d = dispatcher(retry_delay=0)
    local, peer = Route(), PeerRoute()
    d.engine_status(local, "default", engine_status("e1", "m"), Locality.LOCAL)
    d.engine_status(peer, "default", engine_status("e2", "m"), Locality.REMOTE)
    sink = Sink()
    handle = submit(d, sink)
    d.result_received(local, http(local.sent[0].id, 503))  # e1 is busy: the task goes to e2
    d.result_received(peer, http(peer.sent[0].id))
    served = handle.served_by
    assert (served.engine_id, served.gateway, served.retries, served.queued_seconds) == ("e2", "gw-b", 1, 0.0)


def test_a_request_that_never_reached_an_engine_names_none():
    clock, d = dispatcher(queue_timeout=5)
    sink = Sink()
    d.engine_status(Route(), "default", engine_status("e1", "m", ready=False), Locality.LOCAL)
    handle = submit(d, sink)
    clock.advance(5)
    assert sink.failure is not None and sink.failure[0] == 503
    served = handle.served_by
    assert (served.engine_id, served.gateway, served.queued_seconds) == ("", "", None)


def test_two_gateways_never_hand_out_the_same_task_id():
    """Forwarded tasks keep their id at the peer, beside the peer's own: two dispatchers'
    ids must not collide (they once both counted t1, t2, ... and a peer's task clashed)."""
    (_, first), (_, second) = dispatcher(), dispatcher()
    ids = {submit(d, Sink()).task_id for d in (first, second) for _ in range(100)}
    assert len(ids) == 200
