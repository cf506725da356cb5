"""Workers as peers: the worker ports a dialler learns from headers, and a sibling's copies dropped."""

from __future__ import annotations

from protocol.discovery.peers import PeerAddress
from protocol.pb import internal_pb2, status_pb2
from protocol.supervisor.siblings import (
    IN_EVERY_WORKER, WORKERS_HEADER, SiblingCopies, WorkerPeers, without_engines, worker_ports, workers_header,
)

SIBLING = {"pod-w1": PeerAddress("127.0.0.1", 8084)}
B = PeerAddress("10.0.0.2", 8083)


def test_worker_ports_reads_the_header_and_refuses_a_malformed_list():
    assert worker_ports([workers_header([8084, 8083])]) == (8083, 8084)
    assert worker_ports([(WORKERS_HEADER, b"8083, 8085")]) == (8083, 8085)
    assert worker_ports([("x-infx-pod", "b")]) == ()
    for bad in ("", "8083,", "80a", "0", "70000"):
        assert worker_ports([(WORKERS_HEADER, bad)]) == ()


def test_a_peer_whose_headers_list_more_workers_is_dialled_at_each():
    peers = WorkerPeers(SIBLING)
    assert peers.peers == SIBLING
    assert peers.source_changed({"b": B})
    assert peers.peers == {**SIBLING, "b": B}
    assert peers.learned("b", [workers_header([8083, 8084, 8085])])
    assert peers.peers == {**SIBLING, "b": B, "10.0.0.2:8084": PeerAddress("10.0.0.2", 8084),
                           "10.0.0.2:8085": PeerAddress("10.0.0.2", 8085)}
    assert not peers.learned("b", [workers_header([8085, 8084, 8083])])  # nothing new


def test_only_the_sources_peers_are_expanded_and_only_by_a_list_that_holds_the_port_dialled():
    peers = WorkerPeers(SIBLING)
    peers.source_changed({"b": B})
    assert not peers.learned("pod-w1", [workers_header([8084, 9000])])  # a sibling
    assert not peers.learned("10.0.0.9:8083", [workers_header([8083, 8084])])  # dialled back, not the source's
    assert not peers.learned("b", [workers_header([9001, 9002])])  # not the worker we dialled
    assert not peers.learned("b", [])  # one worker, or a LLMariner gateway
    assert peers.peers == {**SIBLING, "b": B}


def test_what_was_learned_of_a_peer_goes_when_the_source_drops_or_moves_it():
    peers = WorkerPeers({})
    peers.source_changed({"b": B})
    peers.learned("b", [workers_header([8083, 8084])])
    assert peers.source_changed({"b": PeerAddress("10.0.0.3", 8083)})
    assert peers.peers == {"b": PeerAddress("10.0.0.3", 8083)}
    peers.learned("b", [workers_header([8083, 8084])])
    assert peers.source_changed({})
    assert peers.peers == {}


def _report(*engine_ids: str, removed: tuple[str, ...] = (), delta: bool = False,
            copies: tuple[str, ...] = ()) -> internal_pb2.ProcessTasksInternalRequest:
    message = internal_pb2.ProcessTasksInternalRequest()
    status = message.server_status
    status.pod_name = "pod-w1"
    status.delta = delta
    for engine_id in engine_ids:
        capabilities = [IN_EVERY_WORKER] if engine_id in copies else []
        status.engine_statuses.add(engine_status=status_pb2.EngineStatus(engine_id=engine_id,
                                                                          infx_capabilities=capabilities),
                                   tenant_id="default")
    for engine_id in removed:
        status.removed_engines.add(engine_id=engine_id, tenant_id="default")
    return message


def test_a_siblings_copies_are_dropped_from_its_reports_and_nothing_else():
    message = _report("builtin-echo-pod-w1", "gpu-0", removed=("builtin-echo-pod-w1", "gpu-1"))
    kept = without_engines(message, {"builtin-echo-pod-w1"})
    assert [e.engine_status.engine_id for e in kept.server_status.engine_statuses] == ["gpu-0"]
    assert [r.engine_id for r in kept.server_status.removed_engines] == ["gpu-1"]
    assert kept.server_status.pod_name == "pod-w1"
    assert len(message.server_status.engine_statuses) == 2  # the message received is not changed
    plain = _report("gpu-0")
    assert without_engines(plain, {"builtin-echo-pod-w1"}) is plain
    assert without_engines(plain, ()) is plain


def test_a_siblings_engines_that_every_worker_runs_are_dropped_with_their_removal_and_no_other():
    copies = SiblingCopies()
    first = copies.filter(_report("echo-w1", "gpu-0", copies=("echo-w1",)))
    assert [e.engine_status.engine_id for e in first.server_status.engine_statuses] == ["gpu-0"]
    # A delta that removes both: the copy's removal goes with it, the dial-in engine's stays.
    delta = copies.filter(_report(removed=("echo-w1", "gpu-0"), delta=True))
    assert [r.engine_id for r in delta.server_status.removed_engines] == ["gpu-0"]
    # Once removed, the id is no copy any more: an engine of that id without the capability counts.
    again = copies.filter(_report("echo-w1", delta=True))
    assert [e.engine_status.engine_id for e in again.server_status.engine_statuses] == ["echo-w1"]
    task = internal_pb2.ProcessTasksInternalRequest()
    task.task_result.task_id = "t1"
    assert copies.filter(task) is task
