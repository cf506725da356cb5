"""The engine agent's pure core, driven by hand with a stepped clock (no reactor)."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from protocol.agent.core import AgentState, EngineAgentCore, GatewayProtocolError, StreamState
from protocol.agent.effects import (
    AbortTask,
    AgentConfig,
    AgentUsageError,
    CloseStream,
    OpenStream,
    SendResult,
    SendStatus,
    StartTask,
    Stopped,
)
from protocol.pb import chat_pb2, embeddings_pb2, worker_pb2


def config(**overrides: object) -> AgentConfig:
    base: dict[str, object] = dict(
        engine_id="e1", models=("m1", "m2"), max_concurrency=2, status_interval=10.0,
        status_min_interval=0.5, reconnect_initial=1.0, reconnect_max=8.0, go_away_linger=2.0,
    )
    base.update(overrides)
    return AgentConfig(**base)  # type: ignore[arg-type]


def chat(task_id: str, model: str = "m1") -> worker_pb2.Task:
    req = chat_pb2.CreateChatCompletionRequest(model=model)
    return worker_pb2.Task(id=task_id, request=worker_pb2.TaskRequest(chat_completion=req))


def embed(task_id: str, model: str = "m2") -> worker_pb2.Task:
    req = embeddings_pb2.CreateEmbeddingRequest(model=model, input="x")
    return worker_pb2.Task(id=task_id, request=worker_pb2.TaskRequest(embedding=req))


def control(task_id: str, **request: object) -> worker_pb2.Task:
    return worker_pb2.Task(id=task_id, request=worker_pb2.TaskRequest(**request))  # type: ignore[arg-type]


def heartbeat(task_id: str) -> worker_pb2.Task:
    return control(task_id, heartbeat=worker_pb2.HeartbeatRequest())


def go_away(task_id: str) -> worker_pb2.Task:
    return control(task_id, go_away=worker_pb2.GoAwayRequest())


def cancel(task_id: str, target: str) -> worker_pb2.Task:
    return control(task_id, cancel_task=worker_pb2.CancelTaskRequest(task_id=target))


def answers(effects: list[object]) -> list[tuple[int, str, int]]:
    """(stream, task id, status) of every HttpResponse sent."""
    return [
        (e.stream_id, e.result.task_id, e.result.http_response.status_code)
        for e in effects
        if isinstance(e, SendResult) and e.result.WhichOneof("message") == "http_response"
    ]


def statuses(effects: list[object]) -> list[SendStatus]:
    return [e for e in effects if isinstance(e, SendStatus)]


def counts(status: SendStatus) -> dict[str, int]:
    return {m.id: m.in_progress_task_count for m in status.status.models}


def started(effects: list[object]) -> list[str]:
    return [e.task.id for e in effects if isinstance(e, StartTask)]


def sse(data: bytes, last: bool = False) -> worker_pb2.TaskResult:
    return worker_pb2.TaskResult(server_sent_event=worker_pb2.ServerSentEvent(data=data, is_last_event=last))


def running_agent(**overrides: object) -> EngineAgentCore:
    agent = EngineAgentCore(config(**overrides))
    agent.start(0.0)
    return agent


def test_start_opens_a_stream_and_reports_ready_status_at_once() -> None:
    agent = EngineAgentCore(config(cluster_id="c1"))
    effects = agent.start(0.0)
    assert effects[0] == OpenStream(1, False)
    [status] = statuses(effects)
    assert status.stream_id == 1
    assert status.status.engine_id == "e1" and status.status.ready and status.status.cluster_id == "c1"
    assert [(m.id, m.is_ready) for m in status.status.models] == [("m1", True), ("m2", True)]
    assert counts(status) == {"m1": 0, "m2": 0}


def test_status_is_repeated_every_status_interval_when_nothing_changes() -> None:
    agent = running_agent()
    assert agent.next_deadline() == 10.0
    assert agent.handle_timeout(9.9) == []
    [status] = statuses(agent.handle_timeout(10.0))
    assert status.stream_id == 1
    assert agent.next_deadline() == 20.0


def test_heartbeat_is_answered_200_on_its_own_stream_and_starts_nothing() -> None:
    agent = running_agent()
    effects = agent.task_received(1, heartbeat("hb-1"), 1.0)
    assert answers(effects) == [(1, "hb-1", 200)]
    assert agent.in_progress == 0


def test_tasks_beyond_max_concurrency_wait_and_start_as_slots_free() -> None:
    agent = running_agent()
    assert started(agent.task_received(1, chat("a"), 1.0)) == ["a"]
    assert started(agent.task_received(1, chat("b"), 1.0)) == ["b"]
    assert started(agent.task_received(1, embed("c"), 1.0)) == []
    assert (agent.running, agent.in_progress) == (2, 3)
    assert started(agent.finish_task("a", 2.0)) == ["c"]
    assert (agent.running, agent.in_progress) == (2, 2)


def test_tasks_past_the_queue_bound_are_answered_503_at_once_and_the_queue_takes_more_as_it_drains() -> None:
    agent = running_agent(max_concurrency=1, max_queued=2)
    assert started(agent.task_received(1, chat("a"), 1.0)) == ["a"]
    assert answers(agent.task_received(1, chat("b"), 1.0) + agent.task_received(1, embed("c"), 1.0)) == []
    refused = agent.task_received(1, chat("d"), 1.0)
    assert answers(refused) == [(1, "d", 503)] and started(refused) == []
    body = json.loads([e for e in refused if isinstance(e, SendResult)][0].result.http_response.body)
    assert "at capacity" in body["error"]["message"]
    assert (agent.running, agent.queued, agent.in_progress) == (1, 2, 3)
    assert agent.task_stream("d") is None
    assert started(agent.finish_task("a", 2.0)) == ["b"]
    assert answers(agent.task_received(1, chat("e"), 2.0)) == []  # room again
    assert (agent.running, agent.queued) == (1, 2)


def test_queue_bound_defaults_to_four_times_max_concurrency_and_zero_queues_nothing() -> None:
    assert config(max_concurrency=3).queue_limit == 12
    agent = running_agent(max_concurrency=1, max_queued=0)
    assert started(agent.task_received(1, chat("a"), 1.0)) == ["a"]
    assert answers(agent.task_received(1, chat("b"), 1.0)) == [(1, "b", 503)]
    # Control tasks are never refused for capacity.
    assert answers(agent.task_received(1, heartbeat("hb"), 1.0)) == [(1, "hb", 200)]


def test_in_progress_counts_per_model_are_reported_coalesced_within_min_interval() -> None:
    agent = running_agent()
    first = statuses(agent.task_received(1, chat("a"), 1.0))
    assert [counts(s) for s in first] == [{"m1": 1, "m2": 0}]
    assert statuses(agent.task_received(1, embed("b"), 1.1)) == []
    assert statuses(agent.task_received(1, embed("c"), 1.2)) == []
    assert agent.next_deadline() == 1.5
    [status] = statuses(agent.handle_timeout(1.5))
    assert counts(status) == {"m1": 1, "m2": 2}


def test_tasks_that_come_and_go_within_the_min_interval_build_no_status_until_a_report_is_due() -> None:
    """Issue #25's profile: a fifth of the agent's CPU went to rebuilding and comparing its status
    on every input. Counts that change between two reports cost two comparisons, no status."""
    agent = running_agent()
    built = 0
    engine_status = agent.engine_status

    def counting() -> object:
        nonlocal built
        built += 1
        return engine_status()

    agent.engine_status = counting  # type: ignore[method-assign]
    statuses(agent.task_received(1, chat("first"), 1.0))  # a report at once: the counts changed
    built = 0
    for i in range(100):
        now = 1.0 + i * 0.004
        assert statuses(agent.task_received(1, chat(f"t{i}"), now)) == []
        agent.send_result(f"t{i}", sse(b"", last=True))
        assert statuses(agent.finish_task(f"t{i}", now)) == []
        agent.next_deadline()
    assert built == 0
    assert agent.next_deadline() == 1.5
    # Due now, the counts are those last reported (one task in flight): nothing new is sent.
    assert statuses(agent.handle_timeout(1.5)) == [] and built == 1
    assert agent.next_deadline() == 11.0, "the periodic report is next"


def test_a_readiness_change_between_reports_is_reported_at_once() -> None:
    agent = running_agent(wait_for_runtime=True, models=())
    statuses(agent.task_received(1, heartbeat("h"), 1.0))
    [status] = statuses(agent.runtime_changed(True, ("m9",), 1.1))
    assert [(m.id, m.is_ready) for m in status.status.models] == [("m9", True)]
    [status] = statuses(agent.runtime_changed(False, ("m9",), 1.2))
    assert [(m.id, m.is_ready) for m in status.status.models] == [("m9", False)]
    assert statuses(agent.runtime_changed(False, ("m9",), 1.3)) == [], "no change, no report"


def test_results_go_to_the_tasks_stream_with_indexes_stamped_in_order() -> None:
    agent = running_agent()
    agent.task_received(1, chat("a"), 1.0)
    head = worker_pb2.TaskResult(http_response=worker_pb2.HttpResponse(status_code=200))
    sent = [agent.send_result("a", head), agent.send_result("a", sse(b"data: x\n\n")),
            agent.send_result("a", sse(b"", last=True))]
    assert [(e.stream_id, e.result.task_id, e.result.result_index) for e in sent] == [
        (1, "a", 0), (1, "a", 1), (1, "a", 2)
    ]


def test_result_before_start_is_misuse_and_result_of_unknown_task_is_dropped() -> None:
    agent = running_agent(max_concurrency=1)
    agent.task_received(1, chat("a"), 1.0)
    agent.task_received(1, chat("b"), 1.0)
    with pytest.raises(AgentUsageError):
        agent.send_result("b", sse(b"data: x\n\n"))
    assert agent.send_result("nope", sse(b"data: x\n\n")) is None


def test_cancel_of_running_task_aborts_it_answers_200_and_drops_later_results() -> None:
    agent = running_agent()
    agent.task_received(1, chat("a"), 1.0)
    effects = agent.task_received(1, cancel("c-1", "a"), 2.0)
    assert AbortTask("a") in effects
    assert answers(effects) == [(1, "c-1", 200)]
    assert agent.send_result("a", sse(b"data: late\n\n")) is None
    assert agent.finish_task("a", 3.0) == []
    assert agent.in_progress == 0


def test_a_task_past_its_timeout_is_answered_504_and_its_slot_goes_to_the_next() -> None:
    agent = running_agent(max_concurrency=1)
    slow = chat("a")
    slow.timeout_seconds = 5
    waiting = chat("b")
    waiting.timeout_seconds = 30
    agent.task_received(1, slow, 1.0)
    agent.task_received(1, waiting, 2.0)
    assert agent.next_deadline() == 6.0
    assert agent.handle_timeout(5.9) == []
    effects = agent.handle_timeout(6.0)
    assert AbortTask("a") in effects
    assert answers(effects) == [(1, "a", 504)]
    assert started(effects) == ["b"]
    assert agent.send_result("a", sse(b"data: late\n\n")) is None
    assert answers(agent.handle_timeout(31.9)) == []
    assert answers(agent.handle_timeout(32.0)) == [(1, "b", 504)]  # 30 s from its arrival


def test_a_streaming_task_past_its_timeout_is_aborted_without_a_second_response() -> None:
    """Its response has begun: only the runtime is stopped; the gateway's own
    deadline ends the client's stream."""
    agent = running_agent()
    task = chat("a")
    task.timeout_seconds = 5
    agent.task_received(1, task, 1.0)
    agent.send_result("a", sse(b"data: one\n\n"))
    effects = agent.handle_timeout(6.0)
    assert AbortTask("a") in effects
    assert answers(effects) == [] and not [e for e in effects if isinstance(e, SendResult)]
    assert agent.in_progress == 0


def test_a_waiting_task_past_its_timeout_never_starts() -> None:
    agent = running_agent(max_concurrency=1)
    agent.task_received(1, chat("a"), 1.0)
    queued = chat("b")
    queued.timeout_seconds = 2
    agent.task_received(1, queued, 1.0)
    effects = agent.handle_timeout(3.0)
    assert answers(effects) == [(1, "b", 504)]
    assert AbortTask("b") not in effects
    assert started(agent.finish_task("a", 4.0)) == []
    assert agent.in_progress == 0


def test_cancel_of_waiting_task_removes_it_without_abort() -> None:
    agent = running_agent(max_concurrency=1)
    agent.task_received(1, chat("a"), 1.0)
    agent.task_received(1, chat("b"), 1.0)
    effects = agent.task_received(1, cancel("c-1", "b"), 2.0)
    assert not any(isinstance(e, AbortTask) for e in effects)
    assert answers(effects) == [(1, "c-1", 200)]
    assert started(agent.finish_task("a", 3.0)) == []


def test_cancel_of_unknown_task_is_answered_404() -> None:
    agent = running_agent()
    assert answers(agent.task_received(1, cancel("c-1", "ghost"), 1.0)) == [(1, "c-1", 404)]


def test_empty_request_is_answered_501_like_llmariner() -> None:
    agent = running_agent()
    effects = agent.task_received(1, worker_pb2.Task(id="x"), 1.0)
    assert answers(effects) == [(1, "x", 501)]


def test_reused_id_of_a_task_in_flight_is_a_gateway_violation() -> None:
    agent = running_agent()
    agent.task_received(1, chat("a"), 1.0)
    with pytest.raises(GatewayProtocolError):
        agent.task_received(1, chat("a"), 1.0)
    assert agent.in_progress == 1


def test_go_away_answers_202_opens_a_new_connection_and_old_tasks_finish_on_old_stream() -> None:
    agent = running_agent()
    agent.task_received(1, chat("a"), 1.0)
    effects = agent.task_received(1, go_away("g-1"), 2.0)
    assert answers(effects) == [(1, "g-1", 202)]
    assert OpenStream(2, True) in effects
    assert [s.stream_id for s in statuses(effects)] == [2]
    assert agent.current_stream == 2
    assert agent.stream_state(1) is StreamState.RETIRING
    # New work arrives on the new stream; the old task's results still go to stream 1.
    agent.task_received(2, chat("b"), 2.5)
    result = agent.send_result("a", sse(b"data: x\n\n"))
    assert result.stream_id == 1
    # Old stream closes once idle and the linger is over, not before.
    assert not any(isinstance(e, CloseStream) for e in agent.finish_task("a", 3.0))
    assert agent.next_deadline() == 4.0
    assert CloseStream(1) in agent.handle_timeout(4.0)
    assert agent.stream_state(1) is StreamState.CLOSED
    assert agent.stream_state(2) is StreamState.OPEN


def test_task_arriving_on_a_retiring_stream_is_still_served_there() -> None:
    agent = running_agent()
    agent.task_received(1, go_away("g-1"), 1.0)
    assert started(agent.task_received(1, chat("late"), 1.5)) == ["late"]
    result = agent.send_result("late", sse(b"data: x\n\n"))
    assert result.stream_id == 1


def test_task_on_a_closed_stream_is_dropped() -> None:
    agent = running_agent()
    agent.stream_closed(1, 0.5, 1.0)
    assert agent.task_received(1, chat("a"), 1.5) == []
    assert agent.in_progress == 0


def test_closed_streams_are_forgotten_so_a_thousand_reconnects_leave_one_stream() -> None:
    """1,000 reconnects used to leave 1,001 streams, every one scanned by next_deadline()."""
    agent = running_agent()
    now = 0.0
    for stream_id in range(1, 1001):
        agent.task_received(stream_id, chat(f"t{stream_id}"), now)
        agent.stream_closed(stream_id, 0.5, now)
        now = agent.next_deadline()  # type: ignore[assignment]
        assert OpenStream(stream_id + 1, True) in agent.handle_timeout(now)
    assert agent.held_streams == (1001,) and agent.current_stream == 1001
    # A forgotten stream still reads as closed: late news of it changes nothing.
    assert agent.stream_state(1) is StreamState.CLOSED
    assert agent.stream_closed(1, 0.5, now) == []
    assert agent.task_received(500, chat("late"), now) == [] and agent.in_progress == 0
    agent.stream_confirmed(999)
    with pytest.raises(AgentUsageError):
        agent.stream_state(1002)  # never opened
    with pytest.raises(AgentUsageError):
        agent.stream_closed(0, 0.5, now)


def test_retired_and_drained_streams_are_forgotten_too() -> None:
    agent = running_agent()
    agent.task_received(1, go_away("g-1"), 1.0)
    assert agent.held_streams == (1, 2)
    assert CloseStream(1) in agent.handle_timeout(3.0)  # idle past its linger
    assert agent.held_streams == (2,) and agent.stream_state(1) is StreamState.CLOSED
    effects = agent.shutdown(5.0, 4.0)
    assert CloseStream(2) in effects and Stopped() in effects
    assert agent.held_streams == () and agent.next_deadline() is None


def test_lost_stream_aborts_its_tasks_and_reconnects_with_growing_backoff() -> None:
    agent = running_agent(max_concurrency=1)
    agent.task_received(1, chat("a"), 1.0)
    agent.task_received(1, chat("b"), 1.0)
    effects = agent.stream_closed(1, jitter=0.5, now=2.0)
    assert effects[0] == AbortTask("a")
    assert agent.in_progress == 0 and agent.current_stream is None
    assert agent.next_deadline() == 3.0
    assert agent.handle_timeout(2.9) == []
    effects = agent.handle_timeout(3.0)
    assert effects[0] == OpenStream(2, True)
    agent.stream_closed(2, jitter=0.5, now=3.5)
    assert agent.next_deadline() == 5.5  # doubled
    agent.handle_timeout(5.5)
    agent.stream_closed(3, jitter=0.0, now=6.0)
    assert agent.next_deadline() == pytest.approx(6.0 + 4.0 * 0.8)  # jitter lowers the delay by up to 20 %


def test_backoff_is_capped_and_starts_over_once_the_gateway_answers() -> None:
    agent = running_agent()
    now = 0.0
    for stream_id in range(1, 7):
        now += 0.1
        agent.stream_closed(stream_id, 0.5, now)
        now = agent.next_deadline()  # type: ignore[assignment]
        agent.handle_timeout(now)
    closed_at = now
    agent.stream_closed(7, 0.5, closed_at)
    assert agent.next_deadline() == closed_at + 8.0
    agent.handle_timeout(closed_at + 8.0)
    agent.task_received(8, heartbeat("hb"), closed_at + 9.0)
    agent.stream_closed(8, 0.5, closed_at + 10.0)
    assert agent.next_deadline() == closed_at + 11.0


def test_shutdown_reports_not_ready_refuses_new_work_with_503_and_stops_when_drained() -> None:
    agent = running_agent()
    agent.task_received(1, chat("a"), 1.0)
    effects = agent.shutdown(grace=30.0, now=2.0)
    [status] = statuses(effects)
    assert not status.status.ready and counts(status)["m1"] == 1
    assert agent.state is AgentState.DRAINING
    refused = agent.task_received(1, chat("b"), 2.5)
    assert answers(refused) == [(1, "b", 503)]
    body = json.loads(refused[0].result.http_response.body)  # type: ignore[union-attr]
    assert body["error"]["message"]
    assert answers(agent.task_received(1, heartbeat("hb"), 2.6)) == [(1, "hb", 200)]
    effects = agent.finish_task("a", 3.0)
    assert effects[-2:] == [CloseStream(1), Stopped()]
    assert agent.state is AgentState.STOPPED


def test_shutdown_grace_expiry_aborts_what_is_left() -> None:
    agent = running_agent()
    agent.task_received(1, chat("a"), 1.0)
    agent.shutdown(grace=5.0, now=2.0)
    assert agent.next_deadline() == 7.0
    effects = agent.handle_timeout(7.0)
    assert effects == [AbortTask("a"), CloseStream(1), Stopped()]


def test_shutdown_does_not_reconnect_a_lost_stream() -> None:
    agent = running_agent()
    agent.task_received(1, chat("a"), 1.0)
    agent.shutdown(grace=5.0, now=2.0)
    effects = agent.stream_closed(1, 0.5, 3.0)
    assert effects == [AbortTask("a"), Stopped()]
    assert agent.next_deadline() is None


def test_shutdown_before_start_stops_at_once() -> None:
    agent = EngineAgentCore(config())
    assert agent.shutdown(grace=1.0, now=0.0) == [Stopped()]


@pytest.mark.parametrize(
    "overrides",
    [dict(engine_id=""), dict(models=()), dict(models=("a", "a")), dict(max_concurrency=0),
     dict(status_interval=0.0), dict(reconnect_jitter=1.0), dict(go_away_linger=float("nan")),
     dict(max_queued=-1), dict(reconnect_multiplier=0.5), dict(reconnect_initial=10.0, reconnect_max=1.0)],
)
def test_config_rejects_unusable_settings(overrides: dict[str, object]) -> None:
    with pytest.raises(AgentUsageError):
        config(**overrides)


# -- an open-ended run: random inputs, invariants after each -------------------------------

ops = st.lists(
    st.tuples(
        st.sampled_from(["chat", "embed", "finish", "cancel", "heartbeat", "go_away", "lose", "tick", "shutdown"]),
        st.integers(0, 7),
        st.floats(0.0, 3.0),
    ),
    max_size=40,
)


@settings(max_examples=60, deadline=None)
@given(ops)
def test_random_runs_keep_the_agents_invariants(run: list[tuple[str, int, float]]) -> None:
    """Never more than max_concurrency run nor max_queued wait; each started task ends once
    (finished or aborted); results only go to streams that are not closed; Stopped comes once, last;
    the status (built once and kept while nothing changes) always counts the tasks held."""
    agent = running_agent(max_concurrency=3, max_queued=2)
    now = 0.0
    model_of: dict[str, str] = {}
    deadlines: dict[str, float | None] = {}
    live: set[str] = set()
    ended: set[str] = set()
    open_streams = {1}
    stopped = 0
    seq = 0

    def apply(effects: list[object]) -> None:
        nonlocal stopped
        for e in effects:
            assert stopped == 0
            if isinstance(e, StartTask):
                assert e.task.id not in live and e.task.id not in ended
                live.add(e.task.id)
            elif isinstance(e, AbortTask):
                live.remove(e.task_id)
                ended.add(e.task_id)
            elif isinstance(e, OpenStream):
                open_streams.add(e.stream_id)
            elif isinstance(e, CloseStream):
                open_streams.remove(e.stream_id)
            elif isinstance(e, (SendResult, SendStatus)):
                assert e.stream_id in open_streams
            elif isinstance(e, Stopped):
                stopped += 1
        assert agent.running == len(live) <= 3
        assert agent.queued <= 2

    for op, n, dt in run:
        now += dt
        seq += 1
        stream = agent.current_stream
        if op in ("chat", "embed", "heartbeat", "go_away", "cancel") and stream is not None:
            if op == "chat":
                model_of[f"t{seq}"] = "m1"
                timed = chat(f"t{seq}")
                timed.timeout_seconds = n % 4  # 0: none; else a deadline that next_deadline must keep
                deadlines[f"t{seq}"] = now + timed.timeout_seconds if timed.timeout_seconds else None
                apply(agent.task_received(stream, timed, now))
            elif op == "embed":
                model_of[f"t{seq}"] = "m2"
                apply(agent.task_received(stream, embed(f"t{seq}"), now))
            elif op == "heartbeat":
                apply(agent.task_received(stream, heartbeat(f"h{seq}"), now))
            elif op == "go_away":
                apply(agent.task_received(stream, go_away(f"g{seq}"), now))
            else:
                apply(agent.task_received(stream, cancel(f"c{seq}", f"t{seq - n}"), now))
        elif op == "finish" and live:
            task_id = sorted(live)[n % len(live)]
            sent = agent.send_result(task_id, sse(b"", last=True))
            apply([sent] if sent is not None else [])
            live.remove(task_id)
            ended.add(task_id)
            apply(agent.finish_task(task_id, now))
        elif op == "lose" and open_streams:
            apply(agent.stream_closed(sorted(open_streams)[n % len(open_streams)], jitter=dt / 3.0, now=now))
            open_streams.intersection_update(
                s for s in open_streams if agent.stream_state(s) is not StreamState.CLOSED
            )
        elif op == "shutdown" and agent.state is AgentState.RUNNING:
            apply(agent.shutdown(grace=n, now=now))
        deadline = agent.next_deadline()
        if op == "tick" and deadline is not None:
            now = max(now, deadline)
            apply(agent.handle_timeout(now))
        # The machine keeps exactly the streams that are not closed: closed ones are forgotten.
        assert set(agent.held_streams) == open_streams
        held = [model for task_id, model in model_of.items() if agent.task_stream(task_id) is not None]
        status = agent.engine_status()
        assert {m.id: m.in_progress_task_count for m in status.models} == {m: held.count(m) for m in ("m1", "m2")}
        assert status.ready == (agent.state is AgentState.RUNNING)
        held_deadlines = [d for t, d in deadlines.items() if d is not None and agent.task_stream(t) is not None]
        deadline = agent.next_deadline()
        assert not held_deadlines or (deadline is not None and deadline <= min(held_deadlines))
    if agent.state is AgentState.RUNNING:
        apply(agent.shutdown(grace=1.0, now=now))
    while agent.state is not AgentState.STOPPED:
        deadline = agent.next_deadline()
        assert deadline is not None
        now = max(now, deadline)
        apply(agent.handle_timeout(now))
    assert stopped == 1 and not live and not open_streams and agent.held_streams == ()


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["chat", "embed", "finish", "cancel", "tick", "lose"]),
                          st.integers(0, 5), st.sampled_from([0.0, 0.5, 1.0, 3.0])), max_size=60))
def test_load_counts_and_task_deadlines_kept_as_tasks_come_and_go_match_a_scan(run) -> None:
    """The per-model counts and the deadline heap are kept incrementally (a result must not cost a
    scan of every task in flight); after every step they agree with a scan of the tasks held,
    with ids reused (a task id may come back once its first task ended, with a new deadline)."""
    agent = EngineAgentCore(config(max_concurrency=2, max_queued=3))
    now = 0.0
    agent.start(now)
    stream = agent.current_stream
    for op, n, dt in run:
        now += dt
        task_id = f"t{n}"  # few ids: reuse is the point
        if stream is None or agent.stream_state(stream) is StreamState.CLOSED:
            deadline = agent.next_deadline()
            if deadline is not None:
                now = max(now, deadline)
                agent.handle_timeout(now)
            stream = agent.current_stream
        elif op in ("chat", "embed") and agent.task_stream(task_id) is None:
            task = chat(task_id) if op == "chat" else embed(task_id)
            task.timeout_seconds = 1 + n % 3
            agent.task_received(stream, task, now)
        elif op == "finish" and task_id in agent._tasks and agent._tasks[task_id].running:
            agent.finish_task(task_id, now)
        elif op == "cancel":
            agent.task_received(stream, cancel(f"c{n}-{now}", task_id), now)
        elif op == "lose":
            agent.stream_closed(stream, 0.5, now)
        elif op == "tick":
            agent.handle_timeout(now)
        held = agent._tasks.values()
        counts = {m.id: m.in_progress_task_count for m in agent.engine_status().models}
        assert counts == {m: sum(t.model == m for t in held) for m in agent.models}
        deadlines = [t.deadline for t in held if t.deadline is not None]
        assert agent._earliest_task_deadline() == (min(deadlines) if deadlines else None)
        assert all(t.deadline is None or t.deadline > now or op != "tick" for t in held)


def test_a_task_id_back_in_flight_is_timed_by_its_new_deadline_not_the_old_ones() -> None:
    agent = EngineAgentCore(config())
    agent.start(0.0)
    stream = agent.current_stream
    first = chat("t1")
    first.timeout_seconds = 5
    agent.task_received(stream, first, 0.0)
    agent.finish_task("t1", 1.0)
    again = chat("t1")
    again.timeout_seconds = 30
    agent.task_received(stream, again, 2.0)
    effects = agent.handle_timeout(6.0)  # the first task's deadline: nothing is due now
    assert agent.task_stream("t1") == stream and not any(isinstance(e, AbortTask) for e in effects)
    assert agent.next_deadline() == min(32.0, agent._status_due(agent._streams[stream]))
    effects = agent.handle_timeout(32.0)
    assert [e.task_id for e in effects if isinstance(e, AbortTask)] == ["t1"]
