"""infx gateways and LLMariner gateways in one exchange, over real loopback sockets, with grpcio
playing LLMariner's side of ``ProcessTasksInternal``: a LLMariner accepted peer (which offers no status
deltas) gets only full snapshots from infx, and a LLMariner dialled peer's full snapshots (which
carry no sequence numbers) register and remove engines at an infx gateway that offers deltas."""

from __future__ import annotations

import queue
import threading
from concurrent import futures
from typing import Any

import grpc
import pytest_twisted
from twisted.internet import threads

from infx.exchange.exchanger import PROCESS_TASKS_INTERNAL
from infx.service import builtin_engine_id
from protocol.exchange.status_reports import STATUS_DELTA_HEADER
from protocol.pb import internal_pb2
from protocol.processor.keys import Locality
from tests.support.exchange import base_url, chat, engines, gateways, internal_address, until  # noqa: F401
from tests.support.processor import engine_status

SERVICE = "llmariner.inference.server.v1.InferenceInternalService"


class LlmarinerSender:
    """A grpcio server of ProcessTasksInternal that reads reports the way LLMariner's gateway
    does: its response headers say nothing of deltas, and it never sends a task."""

    def __init__(self) -> None:
        self.reports: list[internal_pb2.ServerStatus] = []
        self._lock = threading.Lock()
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        handler = grpc.method_handlers_generic_handler(SERVICE, {
            "ProcessTasksInternal": grpc.stream_stream_rpc_method_handler(
                self._serve,
                request_deserializer=internal_pb2.ProcessTasksInternalRequest.FromString,
                response_serializer=internal_pb2.ProcessTasksInternalResponse.SerializeToString),
        })
        self._server.add_generic_rpc_handlers((handler,))
        self.port = self._server.add_insecure_port("127.0.0.1:0")
        self._server.start()

    def _serve(self, requests: Any, context: grpc.ServicerContext) -> Any:
        context.send_initial_metadata(())  # accepted, with headers of LLMariner's kind: no offer
        for request in requests:
            if request.HasField("server_status"):
                with self._lock:
                    self.reports.append(request.server_status)
        return
        yield  # a response stream that carries nothing

    def received(self) -> list[internal_pb2.ServerStatus]:
        with self._lock:
            return list(self.reports)

    def stop(self) -> None:
        self._server.stop(0)


@pytest_twisted.inlineCallbacks
def test_a_llmariner_sender_gets_a_full_snapshot_every_time_even_for_a_count_change(gateways):  # noqa: F811
    """b's only change after connecting is the request count: an infx peer would get a delta
    with no engine in it; the LLMariner peer gets every engine again, unnumbered for it."""
    llmariner = LlmarinerSender()
    try:
        address = f"127.0.0.1:{llmariner.port}"
        b = yield gateways("b", echo_models="m", peers=address)
        yield until(lambda: any(r.engine_statuses for r in llmariner.received())
                    and b.exchanger.receivers[address].accepted)
        assert not b.exchanger.receivers[address].dialled.sends_deltas
        known = len(llmariner.received())
        for _ in range(2):
            yield threads.deferToThread(chat, base_url(b), model="m")
        yield until(lambda: llmariner.received()[-1].model_requests_started.get("m") == 2)
        reports = llmariner.received()
        assert len(reports) > known
        assert all(not report.delta and not report.removed_engines for report in reports)
        for report in reports[known - 1:]:  # from the first that carried the engine on
            assert [(e.tenant_id, e.engine_status.engine_id) for e in report.engine_statuses] == [
                ("default", builtin_engine_id(b.pod_name))]
        assert [r.sequence for r in reports] == list(range(1, len(reports) + 1))
    finally:
        llmariner.stop()


@pytest_twisted.inlineCallbacks
def test_an_infx_peer_is_offered_deltas_where_a_llmariner_one_is_not(gateways):  # noqa: F811
    a = yield gateways("a")
    b = yield gateways("b", echo_models="m", peers=internal_address(a))
    yield until(lambda: engines(a) == {("default", Locality.REMOTE): 1})
    # b's stream may be dialled anew meanwhile (a redial is connecting while a still lists b's engine):
    # the stream open at last is offered deltas, which a LLMariner peer's never is (below).
    yield until(lambda: (dialled := b.exchanger.receivers[internal_address(a)].dialled) is not None
                and dialled.sends_deltas)


def full_report(*engine_ids: str) -> internal_pb2.ProcessTasksInternalRequest:
    """A report as LLMariner's dialled peer sends it: every engine, no infx field."""
    status = internal_pb2.ServerStatus(pod_name="llmariner-0")
    for engine_id in engine_ids:
        status.engine_statuses.add(engine_status=engine_status(engine_id, "m"), tenant_id="default")
    return internal_pb2.ProcessTasksInternalRequest(server_status=status)


@pytest_twisted.inlineCallbacks
def test_a_llmariner_receivers_full_snapshots_register_and_remove_engines_here(gateways):  # noqa: F811
    a = yield gateways("a")
    channel = grpc.insecure_channel(internal_address(a))
    outbox: queue.Queue[internal_pb2.ProcessTasksInternalRequest | None] = queue.Queue()

    def requests() -> Any:
        while (message := outbox.get()) is not None:
            yield message

    call = channel.stream_stream(
        PROCESS_TASKS_INTERNAL,
        request_serializer=internal_pb2.ProcessTasksInternalRequest.SerializeToString,
        response_deserializer=internal_pb2.ProcessTasksInternalResponse.FromString)
    responses = call(requests())
    try:
        outbox.put(full_report("l1", "l2"))
        headers = yield threads.deferToThread(responses.initial_metadata)
        # infx offers deltas; a LLMariner dialled peer does not know the header and keeps sending snapshots.
        assert (STATUS_DELTA_HEADER, "1") in [(m.key, m.value) for m in headers]
        yield until(lambda: engines(a) == {("default", Locality.REMOTE): 2})
        outbox.put(full_report("l2"))
        yield until(lambda: engines(a) == {("default", Locality.REMOTE): 1})
        # A LLMariner peer's engines are named with its pod here, as an infx peer's are.
        assert a.processor.engine("default", "l1@llmariner-0") is None
        assert a.processor.engine("default", "l2@llmariner-0") is not None
    finally:
        outbox.put(None)
        responses.cancel()
        channel.close()
    yield until(lambda: engines(a) == {})
