"""The agent core reports its runtime's own load with every model's status (field 105)."""

from __future__ import annotations

from protocol.agent.core import AgentConfig, EngineAgentCore, SendStatus
from protocol.agent.runtime_load import RuntimeLoad
from protocol.pb import status_pb2


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
    load = RuntimeLoad("vllm", 3, 1, kv_cache_usage=0.5, adapters=("sql-lora",)).to_pb()
    [status] = statuses(agent.runtime_load_changed(load, 1.0))
    assert [m.runtime_load for m in status.models] == [load, load]
    assert status.models[0].runtime_load.loaded_adapters == ["sql-lora"]
    other = RuntimeLoad("vllm", 4, 1).to_pb()
    assert statuses(agent.runtime_load_changed(other, 1.2)) == []
    assert agent.next_deadline() == 1.5
    [status] = statuses(agent.handle_timeout(1.5))
    assert status.models[1].runtime_load == other
    assert not status.models[1].runtime_load.HasField("kv_cache_usage")


def test_a_withdrawn_load_leaves_the_field_out_again() -> None:
    agent = running_agent()
    agent.runtime_load_changed(RuntimeLoad("llama.cpp", 1, 0).to_pb(), 1.0)
    [status] = statuses(agent.runtime_load_changed(None, 2.0))
    assert all(not m.HasField("runtime_load") for m in status.models)


def test_load_reaches_the_wire_in_the_model_at_field_105() -> None:
    agent = running_agent()
    agent.runtime_load_changed(RuntimeLoad("sglang", 2, 0, prefix_cache_hit_rate=0.25).to_pb(), 1.0)
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
    agent.runtime_load_changed(RuntimeLoad("llama.cpp", 1, 0).to_pb(), 1.0)
    assert agent.engine_status().infx_runtime.kind == "llama.cpp"
    [status] = statuses(agent.runtime_identified("vllm", "0.11.0", 2.0))
    assert (status.infx_runtime.kind, status.infx_runtime.version) == ("vllm", "0.11.0")
    assert agent.runtime_identified("vllm", "0.11.0", 3.0) == []  # nothing new: nothing sent


def test_an_agent_configured_with_no_runtime_info_sends_none() -> None:
    assert not running_agent().engine_status().HasField("infx_runtime")
