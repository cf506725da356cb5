"""The agent core reports its runtime's own load with every model's status (field 105), stamped with the
tasks it includes, the runtime's slots, and what the runtime's answers said about their prompts."""

from __future__ import annotations

import json

import pytest

from protocol.agent.core import EngineAgentCore
from protocol.agent.effects import AgentConfig, AgentUsageError, SendStatus
from protocol.agent.runtime_load import LoadSample, RuntimeLoad
from protocol.pb import chat_pb2, status_pb2, worker_pb2


def running_agent() -> EngineAgentCore:
    agent = EngineAgentCore(AgentConfig(engine_id="e1", models=("m1", "m2"), status_min_interval=0.5))
    agent.start(0.0)
    return agent


def statuses(effects: list[object]) -> list[status_pb2.EngineStatus]:
    return [e.status for e in effects if isinstance(e, SendStatus)]


def test_no_runtime_load_means_the_field_is_absent() -> None:
    status = running_agent().engine_status()
    assert all(not m.HasField("runtime_load") for m in status.models)


def test_a_load_goes_out_with_every_model_and_is_coalesced_like_other_changes() -> None:
    agent = running_agent()
    load = RuntimeLoad("vllm", 3, 1, kv_cache_usage=0.5, adapters=("sql-lora",))
    [status] = statuses(agent.runtime_load_changed(load, 1.0))
    assert [m.runtime_load for m in status.models] == [load.to_pb(), load.to_pb()]
    assert status.models[0].runtime_load.loaded_adapters == ["sql-lora"]
    other = RuntimeLoad("vllm", 4, 1)
    assert statuses(agent.runtime_load_changed(other, 1.2)) == []
    assert agent.next_deadline() == 1.5
    [status] = statuses(agent.handle_timeout(1.5))
    assert status.models[1].runtime_load == other.to_pb()
    assert not status.models[1].runtime_load.HasField("kv_cache_usage")


def test_a_withdrawn_load_leaves_the_field_out_again() -> None:
    agent = running_agent()
    agent.runtime_load_changed(RuntimeLoad("llama.cpp", 1, 0), 1.0)
    [status] = statuses(agent.runtime_load_changed(None, 2.0))
    assert all(not m.HasField("runtime_load") for m in status.models)


def test_load_reaches_the_wire_in_the_model_at_field_105() -> None:
    agent = running_agent()
    agent.runtime_load_changed(RuntimeLoad("sglang", 2, 0, prefix_cache_hit_rate=0.25), 1.0)
    wire = agent.engine_status().SerializeToString()
    model = status_pb2.EngineStatus.FromString(wire).models[0]
    assert model.runtime_load.prefix_cache_hit_rate == 0.25 and model.runtime_load.source == "sglang"
    # Field 105, wire type 2: tag bytes 0xca 0x06.
    assert b"\xca\x06" in model.SerializeToString()


def test_the_runtime_info_says_the_agents_runtime_then_the_runtimes_own_name_and_version() -> None:
    agent = EngineAgentCore(AgentConfig(engine_id="e1", models=("m1",), runtime_kind="openai", agent_version="9.9"))
    agent.start(0.0)
    info = agent.engine_status().infx_runtime
    assert (info.kind, info.version, info.agent_version) == ("openai", "", "9.9")
    agent.runtime_load_changed(RuntimeLoad("llama.cpp", 1, 0), 1.0)
    assert agent.engine_status().infx_runtime.kind == "llama.cpp"
    [status] = statuses(agent.runtime_identified("vllm", "0.11.0", 2.0))
    assert (status.infx_runtime.kind, status.infx_runtime.version) == ("vllm", "0.11.0")
    assert agent.runtime_identified("vllm", "0.11.0", 3.0) == []  # nothing new: nothing sent


def test_an_agent_configured_with_no_runtime_info_sends_none() -> None:
    assert not running_agent().engine_status().HasField("infx_runtime")
# --- which of the gateway's tasks a reading includes, the runtime's slots, its answers' prompts -------------


def chat(task_id: str, model: str = "m1") -> worker_pb2.Task:
    request = chat_pb2.CreateChatCompletionRequest(model=model)
    return worker_pb2.Task(id=task_id, request=worker_pb2.TaskRequest(chat_completion=request))


def test_the_sample_counts_the_runtime_tasks_the_current_stream_brought_and_those_that_ended() -> None:
    agent = EngineAgentCore(AgentConfig(engine_id="e1", models=("m1",), max_concurrency=1, max_queued=1))
    agent.start(0.0)
    assert agent.load_sample() == LoadSample(1, 0, 0)
    agent.task_received(1, chat("a"), 0.1)
    agent.task_received(1, chat("b"), 0.2)  # waits for the one slot
    agent.task_received(1, chat("c"), 0.3)  # past the queue bound: refused, so received and ended at once
    heartbeat = worker_pb2.Task(id="h", request=worker_pb2.TaskRequest(heartbeat=worker_pb2.HeartbeatRequest()))
    agent.task_received(1, heartbeat, 0.4)  # control tasks are not the gateway's routed load
    assert agent.load_sample() == LoadSample(1, 3, 1)
    agent.finish_task("a", 0.5)
    assert agent.load_sample() == LoadSample(1, 3, 2)


def test_a_stamp_goes_out_while_its_stream_is_the_one_reported_on() -> None:
    agent = running_agent()
    agent.task_received(1, chat("a"), 0.1)
    sample = agent.load_sample()
    [status] = statuses(agent.runtime_load_changed(RuntimeLoad("llama.cpp", 1, 0, sample=sample), 1.0))
    load = status.models[0].runtime_load
    assert (load.tasks_received, load.tasks_ended) == (1, 0)
    agent.stream_closed(1, 0.0, 2.0)  # reconnecting: the stamp counted another stream's tasks
    agent.handle_timeout(agent.next_deadline() or 3.0)
    assert agent.current_stream == 2
    load = agent.engine_status().models[0].runtime_load
    assert load.running_requests == 1
    assert not load.HasField("tasks_received") and not load.HasField("tasks_ended")


def test_the_runtimes_slots_go_out_as_learned_and_the_operators_count_wins() -> None:
    agent = running_agent()
    assert agent.engine_status().infx_runtime_slots == 0
    agent.runtime_load_changed(RuntimeLoad("llama.cpp", 0, 0, slots=2), 1.0)
    assert agent.engine_status().infx_runtime_slots == 2
    agent.runtime_load_changed(None, 2.0)  # a runtime out of reach still has the slots it had
    assert agent.engine_status().infx_runtime_slots == 2
    fixed = EngineAgentCore(AgentConfig(engine_id="e2", models=("m1",), runtime_slots=64))
    fixed.start(0.0)
    fixed.runtime_load_changed(RuntimeLoad("llama.cpp", 0, 0, slots=2), 1.0)
    assert fixed.engine_status().infx_runtime_slots == 64
    wire = fixed.engine_status().SerializeToString()
    assert status_pb2.EngineStatus.FromString(wire).infx_runtime_slots == 64
    with pytest.raises(AgentUsageError):
        AgentConfig(engine_id="e3", models=("m1",), runtime_slots=0)


def test_the_runtimes_slots_go_out_at_once_when_learned_or_changed_and_other_load_is_coalesced() -> None:
    """A fresh engine is reported ready before its first load reading: requests routed until its slots
    arrive are routed as if it had none, so they must not wait for the coalescing interval."""
    agent = running_agent()  # status_min_interval 0.5
    [ready] = statuses(agent.runtime_load_changed(RuntimeLoad("llama.cpp", 0, 0), 1.0))
    assert ready.infx_runtime_slots == 0
    [learned] = statuses(agent.runtime_load_changed(RuntimeLoad("llama.cpp", 1, 0, slots=2), 1.01))
    assert learned.infx_runtime_slots == 2
    assert statuses(agent.runtime_load_changed(RuntimeLoad("llama.cpp", 2, 0, slots=2), 1.02)) == []
    [changed] = statuses(agent.runtime_load_changed(RuntimeLoad("llama.cpp", 2, 0, slots=4), 1.03))
    assert changed.infx_runtime_slots == 4 and changed.models[0].runtime_load.running_requests == 2
    fixed = EngineAgentCore(AgentConfig(engine_id="e2", models=("m1",), runtime_slots=64, status_min_interval=0.5))
    fixed.start(0.0)
    fixed.runtime_load_changed(RuntimeLoad("llama.cpp", 0, 0), 1.0)
    assert statuses(fixed.runtime_load_changed(RuntimeLoad("llama.cpp", 0, 0, slots=2), 1.01)) == []


def event(payload: dict[str, object]) -> worker_pb2.TaskResult:
    data = b"data: " + json.dumps(payload).encode() + b"\n\n"
    return worker_pb2.TaskResult(server_sent_event=worker_pb2.ServerSentEvent(data=data))


def test_each_answers_prompt_is_counted_once_per_model_from_what_the_runtime_said() -> None:
    """llama.cpp's stream says it twice (timings in the last chunk, usage after it): one count."""
    agent = running_agent()
    for task_id, model, cached, computed in (("a", "m1", 0, 100), ("b", "m1", 99, 1), ("c", "m2", 40, 10)):
        agent.task_received(1, chat(task_id, model), 0.1)
        agent.send_result(task_id, worker_pb2.TaskResult(http_response=worker_pb2.HttpResponse(status_code=200)))
        agent.send_result(task_id, event({"choices": [{"delta": {"content": "x"}}]}))
        agent.send_result(task_id, event({"choices": [{"finish_reason": "length"}],
                                          "timings": {"cache_n": cached, "prompt_n": computed}}))
        agent.send_result(task_id, event({"choices": [], "usage": {
            "prompt_tokens": cached + computed, "prompt_tokens_details": {"cached_tokens": cached}}}))
        agent.finish_task(task_id, 0.2)
    status = agent.engine_status()
    caches = {m.id: (m.infx_prompt_cache.answers, m.infx_prompt_cache.prompt_tokens,
                     m.infx_prompt_cache.cached_tokens) for m in status.models}
    assert caches == {"m1": (2, 200, 99), "m2": (1, 50, 40)}


def test_a_model_no_answer_spoke_for_has_no_prompt_cache_counts() -> None:
    agent = running_agent()
    agent.task_received(1, chat("a"), 0.1)
    agent.send_result("a", worker_pb2.TaskResult(http_response=worker_pb2.HttpResponse(
        status_code=200, body=b'{"choices": [], "usage": {"prompt_tokens": 5}}')))
    agent.finish_task("a", 0.2)
    assert all(not m.HasField("infx_prompt_cache") for m in agent.engine_status().models)


def test_what_the_slot_keeper_did_goes_out_at_field_104_coalesced_like_other_counts() -> None:
    agent = running_agent()
    assert not agent.engine_status().HasField("infx_slot_keeping")  # an agent that keeps no slots
    counts = status_pb2.EngineStatus.SlotKeeping(held=1, cold=2, saved=2)
    [status] = statuses(agent.slot_keeping_changed(counts, 1.0))
    assert status.infx_slot_keeping == counts
    # Field 104, wire type 2: tag bytes 0xc2 0x06.
    assert b"\xc2\x06" in status.SerializeToString()
    later = status_pb2.EngineStatus.SlotKeeping(held=1, restored=1, cold=2, saved=2)
    assert statuses(agent.slot_keeping_changed(later, 1.2)) == []
    [status] = statuses(agent.handle_timeout(1.5))
    assert status.infx_slot_keeping.restored == 1
    assert statuses(agent.slot_keeping_changed(later, 2.5)) == []  # the same counts are no change
