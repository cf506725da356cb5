"""The task receiver as pure code: status reports of local engines, forwarded tasks run
locally with results relayed in order, errors answered at once, shutdown draining."""

from __future__ import annotations

import json

import pytest

from protocol.exchange.receiver import ReceiverConfig, ReceiverState
from protocol.pb import internal_pb2, worker_pb2
from protocol.processor.core import Processor
from protocol.processor.types import (
    CancelTaskOnEngine,
    DeliverResult,
    FailRequest,
    Locality,
    ProcessorConfig,
    ProcessorUsageError,
    RemoteProtocolError,
    SendTask,
)
from tests.support.processor import chat, engine_status, http, one, only, sse
from tests.support.receiver import BufferedReceiver

T0 = 50.0


class Harness:
    """A processor with local engines on routes ``engine:<id>`` and one receiver whose own
    effects are delivered to it; everything for the engines is recorded. ``counts`` stands
    for the requests this gateway accepted from its clients."""

    def __init__(self) -> None:
        self.p = Processor(ProcessorConfig(retry_delay=0))
        self.counts: dict[str, int] = {}
        self.r = BufferedReceiver(self.p, ReceiverConfig("pod-b", status_interval=10), requests_started=lambda: self.counts)
        self.engine_tasks: list[SendTask | CancelTaskOnEngine] = []

    def run(self, effects: list[object]) -> None:
        for effect in effects:
            if isinstance(effect, (DeliverResult, FailRequest)):
                assert effect.origin is self.r
                self.r.deliver(effect)
            elif isinstance(effect, (SendTask, CancelTaskOnEngine)):
                self.engine_tasks.append(effect)

    def join(self, engine_id: str, *models: str, tenant: str = "t", ready: bool = True, now: float = T0,
             locality: Locality = Locality.LOCAL, in_progress: int = 0) -> None:
        status = engine_status(engine_id, *models, ready=ready)
        for model in status.models:
            model.in_progress_task_count = in_progress
        effects = self.p.update_engine(f"engine:{engine_id}", tenant, status, locality, now)
        self.run(effects)
        if self.r.state in (ReceiverState.OPEN, ReceiverState.DRAINING):
            self.r.local_engines_changed(now)

    def forward(self, task_id: str, engine_id: str = "e1", request: worker_pb2.TaskRequest | None = None,
                tenant: str = "t", timeout: int = 0, now: float = T0) -> None:
        task = worker_pb2.Task(id=task_id, engine_id=engine_id, request=request or chat(), timeout_seconds=timeout)
        task.header["X-Request-ID"].values.append("req-1")
        self.run(self.r.task_received(internal_pb2.ProcessTasksInternalResponse(new_task=task, tenant_id=tenant), now))

    def engine_says(self, engine_id: str, result: worker_pb2.TaskResult, now: float = T0) -> None:
        self.run(self.p.receive_result(f"engine:{engine_id}", result, now))

    def reports(self) -> list[internal_pb2.ServerStatus]:
        return [m.server_status for m in self.r.pop_messages() if m.WhichOneof("message") == "server_status"]

    def results(self) -> list[worker_pb2.TaskResult]:
        messages = self.r.pop_messages()
        assert all(m.WhichOneof("message") == "task_result" for m in messages)
        return [m.task_result for m in messages]


def engines_in(report: internal_pb2.ServerStatus) -> list[tuple[str, str, bool]]:
    return [(e.tenant_id, e.engine_status.engine_id, e.engine_status.ready) for e in report.engine_statuses]


@pytest.fixture
def h() -> Harness:
    harness = Harness()
    harness.join("e1", "m")
    harness.r.connected(T0)
    return harness


# --- status reports -----------------------------------------------------------


def test_on_connect_it_reports_local_engines_only_with_their_real_readiness():
    h = Harness()
    h.join("e1", "m")
    h.join("loading", "m", ready=False, tenant="u")
    h.join("remote", "m", locality=Locality.REMOTE)
    h.r.connected(T0)
    report = one(h.reports(), internal_pb2.ServerStatus)
    assert report.pod_name == "pod-b"
    assert engines_in(report) == [("t", "e1", True), ("u", "loading", False)]


def test_on_connect_it_reports_even_when_there_is_no_local_engine():
    h = Harness()
    h.r.connected(T0)
    assert engines_in(one(h.reports(), internal_pb2.ServerStatus)) == []


def test_it_reports_again_on_every_change_and_sends_nothing_when_nothing_changed(h):
    h.reports()
    h.join("e1", "m")  # the same status again
    assert h.reports() == []
    h.join("e1", "m", in_progress=2)  # a load count changed: it rides a report at most 10/4 s later
    assert h.reports() == [] and h.r.next_deadline() == T0 + 2.5
    h.r.handle_timeout(T0 + 2.5)
    assert one(h.reports(), internal_pb2.ServerStatus).engine_statuses[0].engine_status.models[0].in_progress_task_count == 2
    h.join("e1", "m", in_progress=2, ready=False)
    assert engines_in(one(h.reports(), internal_pb2.ServerStatus)) == [("t", "e1", False)]
    h.join("e2", "m")
    assert len(one(h.reports(), internal_pb2.ServerStatus).engine_statuses) == 2
    h.run(h.p.remove_engine("t", "e2", "gone", T0))
    h.r.local_engines_changed(T0)
    assert len(one(h.reports(), internal_pb2.ServerStatus).engine_statuses) == 1
    h.join("r1", "m", locality=Locality.REMOTE)
    assert h.reports() == []


def test_model_order_alone_is_not_a_change(h):
    h.reports()
    h.run(h.p.update_engine("engine:e1", "t", engine_status("e1", "m", "a"), Locality.LOCAL, T0))
    h.r.local_engines_changed(T0)
    assert [m.id for m in one(h.reports(), internal_pb2.ServerStatus).engine_statuses[0].engine_status.models] == ["a", "m"]
    h.run(h.p.update_engine("engine:e1", "t", engine_status("e1", "a", "m"), Locality.LOCAL, T0))
    h.r.local_engines_changed(T0)
    assert h.reports() == []


def test_the_periodic_check_reports_only_if_something_changed(h):
    h.reports()
    assert h.r.next_deadline() == T0 + 10
    h.r.handle_timeout(T0 + 10)
    assert h.reports() == [] and h.r.next_deadline() == T0 + 20
    # A change the receiver was not told about is caught by the periodic check.
    h.p.update_engine("engine:e1", "t", engine_status("e1", "m", "n"), Locality.LOCAL, T0 + 11)
    h.r.handle_timeout(T0 + 15)
    assert h.reports() == []
    h.r.handle_timeout(T0 + 20)
    assert len(h.reports()) == 1


def test_every_report_carries_the_requests_accepted_here_and_new_counts_go_out_at_the_next_check(h):
    assert dict(one(h.reports(), internal_pb2.ServerStatus).model_requests_started) == {}
    h.counts["m"] = 3
    h.r.handle_timeout(T0 + 5)  # not due yet
    assert h.reports() == []
    h.r.handle_timeout(T0 + 10)
    assert dict(one(h.reports(), internal_pb2.ServerStatus).model_requests_started) == {"m": 3}
    h.r.handle_timeout(T0 + 20)
    assert h.reports() == []
    # A report for an engine change carries the counts of the moment too.
    h.counts.update(m=4, n=1)
    h.join("e2", "m", now=T0 + 21)
    report = one(h.reports(), internal_pb2.ServerStatus)
    assert len(report.engine_statuses) == 2 and dict(report.model_requests_started) == {"m": 4, "n": 1}


# --- forwarded tasks -------------------------------------------------------------


def test_a_forwarded_task_runs_on_the_named_local_engine_with_its_id_tenant_and_deadline(h):
    h.reports()
    h.join("e2", "m")
    h.reports()
    h.forward("task-1", engine_id="e2", timeout=30)
    send = one(h.engine_tasks, SendTask)
    assert send.route == "engine:e2" and send.engine.tenant_id == "t"
    assert send.task.id == "task-1" and send.task.timeout_seconds == 30
    assert list(send.task.header["X-Request-ID"].values) == ["req-1"]
    assert h.p.next_deadline() == T0 + 30


def test_results_of_a_forwarded_task_go_back_in_order(h):
    h.reports()
    h.forward("task-1", request=chat(stream=True))
    for result in [http("task-1"), sse("task-1", 1), sse("task-1", 2, last=True)]:
        h.engine_says("e1", result)
    assert [(r.task_id, r.result_index) for r in h.results()] == [("task-1", 0), ("task-1", 1), ("task-1", 2)]
    assert h.r.tasks_in_flight == 0


@pytest.mark.parametrize(
    ("setup", "engine_id", "reason"),
    [
        (lambda h: None, "gone", "not attached"),
        (lambda h: h.join("r1", "m", locality=Locality.REMOTE), "r1", "not attached"),
        (lambda h: h.join("e1", "m", ready=False), "e1", "not ready"),
        (lambda h: h.forward("task-1"), "e1", "already running"),
        (lambda h: h.r.shutdown(T0), "e1", "shutting down"),
    ],
    ids=["engine-gone", "engine-remote", "engine-not-ready", "duplicate-id", "shutting-down"],
)
def test_a_task_that_cannot_run_here_is_answered_at_once_with_503_and_a_reason(h, setup, engine_id, reason):
    setup(h)
    h.r.pop_messages()
    h.forward("task-1", engine_id=engine_id)
    result = h.results()[-1]
    assert result.task_id == "task-1" and result.result_index == 0
    assert result.http_response.status_code == 503
    assert reason in json.loads(result.http_response.body)["error"]["message"]


def test_a_failure_after_results_were_relayed_ends_the_stream_with_an_error_event(h):
    h.reports()
    h.forward("task-1", request=chat(stream=True))
    h.engine_says("e1", http("task-1"))
    h.run(h.p.remove_engine("t", "e1", "crashed", T0))
    results = h.results()
    assert [r.result_index for r in results] == [0, 1]
    assert results[1].server_sent_event.is_last_event
    event = results[1].server_sent_event.data
    assert event.startswith(b"data: ") and event.endswith(b"\n\n")
    error = json.loads(event[len(b"data: "):])["error"]
    assert error["code"] == "engine_lost" and "crashed" not in error["message"]  # the cause is this gateway's log's


def test_a_cancel_request_from_the_peer_stops_the_local_engine_and_is_answered(h):
    h.reports()
    h.forward("task-1")
    cancel = worker_pb2.Task(id="cancel-9", engine_id="e1", request=worker_pb2.TaskRequest(
        cancel_task=worker_pb2.CancelTaskRequest(task_id="task-1")))
    h.run(h.r.task_received(internal_pb2.ProcessTasksInternalResponse(new_task=cancel, tenant_id="t"), T0))
    assert one(h.engine_tasks, CancelTaskOnEngine).cancelled_task_id == "task-1"
    assert not h.p.has_task("task-1")
    assert [(r.task_id, r.http_response.status_code) for r in h.results()] == [("cancel-9", 200)]
    h.run(h.r.task_received(internal_pb2.ProcessTasksInternalResponse(new_task=cancel, tenant_id="t"), T0))
    assert [(r.task_id, r.http_response.status_code) for r in h.results()] == [("cancel-9", 404)]


# --- shutdown and stream end ----------------------------------------------------------


def test_shutdown_reports_every_engine_not_ready_and_drains_in_flight_tasks(h):
    h.join("e2", "m")
    h.reports()
    h.forward("task-1")
    h.r.shutdown(T0)
    assert engines_in(one(h.reports(), internal_pb2.ServerStatus)) == [("t", "e1", False), ("t", "e2", False)]
    assert not h.r.drained
    h.join("e1", "m", in_progress=1)  # later reports stay not ready
    h.r.handle_timeout(T0 + 2.5)
    assert engines_in(one(h.reports(), internal_pb2.ServerStatus)) == [("t", "e1", False), ("t", "e2", False)]
    h.engine_says("e1", http("task-1"))
    assert [r.task_id for r in h.results()] == ["task-1"]
    assert h.r.drained


def test_when_the_stream_ends_its_tasks_are_cancelled_on_the_engines(h):
    h.forward("task-1")
    h.forward("task-2")
    h.run(h.r.closed(T0))
    assert sorted(e.cancelled_task_id for e in only(h.engine_tasks, CancelTaskOnEngine)) == ["task-1", "task-2"]
    assert not h.p.has_task("task-1") and h.r.next_deadline() is None


def test_misuse_and_remote_violations_raise_distinct_errors(h):
    with pytest.raises(RemoteProtocolError):
        h.r.task_received(internal_pb2.ProcessTasksInternalResponse(tenant_id="t"), T0)
    with pytest.raises(ProcessorUsageError):
        h.r.connected(T0)
    with pytest.raises(ProcessorUsageError):
        h.r.deliver(FailRequest(h.r, "never-received", 503, "x"))
    fresh = BufferedReceiver(h.p, ReceiverConfig("pod-c"))
    with pytest.raises(ProcessorUsageError):
        fresh.task_received(internal_pb2.ProcessTasksInternalResponse(), T0)
    with pytest.raises(ProcessorUsageError):
        ReceiverConfig("pod", status_interval=0)


def test_an_adapter_can_name_its_own_object_as_the_origin_of_forwarded_tasks():
    h = Harness()
    h.join("e1", "m")
    stream = object()
    h.r = BufferedReceiver(h.p, ReceiverConfig("pod-b"), origin=stream)
    h.r.connected(T0)
    h.r.pop_messages()
    task = worker_pb2.Task(id="task-1", engine_id="e1", request=chat())
    h.r.task_received(internal_pb2.ProcessTasksInternalResponse(new_task=task, tenant_id="t"), T0)
    delivered = one(h.p.receive_result("engine:e1", http("task-1"), T0), DeliverResult)
    assert delivered.origin is stream
    h.r.deliver(delivered)
    assert [r.task_id for r in h.results()] == ["task-1"]


def test_a_draining_report_says_so_even_with_no_engine_to_mark_not_ready():
    p = Processor()
    r = BufferedReceiver(p, ReceiverConfig("pod-b", status_interval=10))
    r.connected(T0)
    [first] = [m.server_status for m in r.pop_messages()]
    assert not first.draining
    r.shutdown(T0 + 1)
    [draining] = [m.server_status for m in r.pop_messages()]
    assert draining.draining and list(draining.engine_statuses) == []


# --- the caller of a forwarded task ---------------------------------------------


def test_a_forwarded_tasks_caller_is_counted_for_its_flow_and_never_reaches_the_engine(h):
    request = chat()
    request.infx_caller.CopyFrom(worker_pb2.Caller(flow="key-7", weight=3.0,
                                                   criticality=worker_pb2.Caller.CRITICALITY_CRITICAL))
    h.forward("task-1", request=request)
    assert h.p.slots_held("t", "m") == {"key-7": 1}
    sent_task = one(h.engine_tasks, SendTask).task
    assert sent_task.id == "task-1" and not sent_task.request.HasField("infx_caller")


def test_a_forwarded_task_with_a_malformed_caller_is_refused_with_400(h):
    h.reports()
    request = chat()
    request.infx_caller.CopyFrom(worker_pb2.Caller(flow="k", weight=-2.0))
    h.forward("task-1", request=request)
    [result] = h.results()
    assert result.task_id == "task-1" and result.http_response.status_code == 400
    assert "weight" in json.loads(result.http_response.body)["error"]["message"]
    assert not h.p.has_task("task-1") and not h.engine_tasks


@pytest.mark.parametrize("task_id, task_request, why", [
    ("task-1", worker_pb2.TaskRequest(), "empty request"),  # hypothesis found it (test_hostile_pb.py)
    ("infx-ctl-heartbeat-1", chat(), "prefix for its own tasks"),
])
def test_a_forwarded_task_that_is_no_task_is_refused_with_400_not_a_local_misuse_error(h, task_id, task_request, why):
    h.reports()
    task = worker_pb2.Task(id=task_id, engine_id="e1", request=task_request)
    h.run(h.r.task_received(internal_pb2.ProcessTasksInternalResponse(new_task=task, tenant_id="t"), T0))
    [result] = h.results()
    assert result.task_id == task_id and result.http_response.status_code == 400
    assert why in json.loads(result.http_response.body)["error"]["message"]
    assert not h.p.has_task(task_id) and not h.engine_tasks
    assert h.r.closed(T0 + 1) == []  # the stream holds nothing of it to cancel

