"""The agent core reports its models ready only while its runtime answers (pure, stepped clock)."""

from __future__ import annotations

import pytest

from protocol.agent.core import EngineAgentCore
from protocol.agent.effects import AgentConfig, AgentUsageError, SendStatus


def config(**overrides: object) -> AgentConfig:
    base: dict[str, object] = dict(engine_id="e1", models=("m1",), status_interval=10.0, status_min_interval=0.5,
                                   wait_for_runtime=True)
    base.update(overrides)
    return AgentConfig(**base)  # type: ignore[arg-type]


def models(effects: list[object]) -> list[tuple[str, bool]]:
    statuses = [e for e in effects if isinstance(e, SendStatus)]
    assert len(statuses) == 1, effects
    return [(m.id, m.is_ready) for m in statuses[0].status.models]


def test_models_are_not_ready_until_the_runtime_answers_then_ready_at_once():
    core = EngineAgentCore(config())
    assert models(core.start(0.0)) == [("m1", False)]
    assert core.engine_status().ready  # the engine is up: the gateway keeps its tasks for it
    # Within status_min_interval of the last report, still reported at once: readiness is urgent.
    assert models(core.runtime_changed(True, (), 0.1)) == [("m1", True)]
    assert models(core.runtime_changed(False, (), 0.2)) == [("m1", False)]


def test_an_unchanged_readiness_is_not_reported_again_before_the_interval():
    core = EngineAgentCore(config())
    core.start(0.0)
    core.runtime_changed(True, (), 0.1)
    assert core.runtime_changed(True, (), 0.2) == []


def test_without_configured_models_the_runtimes_list_is_served_and_kept_while_it_is_down():
    core = EngineAgentCore(config(models=()))
    assert models(core.start(0.0)) == []
    assert models(core.runtime_changed(True, ("tiny", "big"), 1.0)) == [("tiny", True), ("big", True)]
    assert models(core.runtime_changed(False, ("tiny", "big"), 2.0)) == [("tiny", False), ("big", False)]


def test_the_echo_runtime_needs_no_check_and_models_are_required_then():
    assert EngineAgentCore(AgentConfig(engine_id="e1", models=("m",))).engine_status().models[0].is_ready
    with pytest.raises(AgentUsageError):
        AgentConfig(engine_id="e1", models=())
    with pytest.raises(AgentUsageError):
        EngineAgentCore(config()).runtime_changed(True, ("a", "a"), 0.0)
