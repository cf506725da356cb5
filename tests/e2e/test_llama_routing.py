"""Real runtimes (issue #17): the same conversations through two gateways to three llama.cpp servers,
routed by infx's affinity policy and by LLMariner's least-in-progress; the runtimes' own logs say how
much of each prompt their prefix cache served (see :mod:`harness.llama_routing`).

Needs the llama.cpp runtime helpers (``harness/llama_runtime.py``) and the
routing policies (``--routing-policy``); it is skipped where the first is
missing.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("harness.llama_runtime", reason="needs the llama.cpp runtime helpers (harness/llama_runtime.py)")

from dataclasses import replace  # noqa: E402

from harness.gguf_models import TINY, write_model  # noqa: E402
from harness.llama_routing import PolicyResult, LlamaWorkload, run_policy  # noqa: E402

#: Real llama.cpp servers, one run per routing policy.
pytestmark = pytest.mark.slow

WORKLOAD = LlamaWorkload(engines=3, conversations=4, turns=3, system_bytes=300, max_tokens=4, context=1024)


@pytest.fixture(scope="module")
def logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("llama-routing")


@pytest.fixture(scope="module")
def results(logs: Path) -> dict[str, PolicyResult]:
    # Conversations need a longer context than the tiny model's 256 tokens (bytes are tokens).
    with pytest.MonkeyPatch.context() as patch:
        # The servers' access log (stdout) must reach their log file before they are killed.
        patch.setenv("PYTHONUNBUFFERED", "1")
        model = write_model(logs / "tiny.gguf", replace(TINY, context_length=WORKLOAD.context))
        return {policy: run_policy(policy, WORKLOAD, model, logs / policy)
                for policy in ("affinity", "least_in_progress")}


def hit_rate(result: PolicyResult) -> float:
    reused = sum(r.reused for r in result.runtimes)
    return reused / (reused + sum(r.evaluated for r in result.runtimes))


def test_every_turn_is_answered_and_every_runtime_logged_its_prompts(results):
    for result in results.values():
        assert result.errors == 0
        assert len(result.ttft) == WORKLOAD.conversations * WORKLOAD.turns
        assert sum(r.requests for r in result.runtimes) == WORKLOAD.conversations * WORKLOAD.turns


def test_a_runtime_without_metrics_is_asked_and_no_load_is_reported(results, logs):
    """llama-cpp-python's server has no /metrics (nor /slots, which the agent asks with it): each
    agent's first read gets 404, and it reports no runtime_load."""
    for server in (logs / "affinity").glob("llama-*.log"):
        assert '"GET /metrics HTTP/1.1" 404' in server.read_text(errors="replace")
    for agent in (logs / "affinity").glob("engine-*.log"):
        assert "reports its load" not in agent.read_text(errors="replace")


def test_affinity_keeps_conversations_where_their_prefix_is_cached_across_both_gateways(results):
    """Every turn after a conversation's first reuses at least its system prompt from the
    runtime's cache under affinity; least-in-progress scatters turns and reuses less."""
    affinity, spread = hit_rate(results["affinity"]), hit_rate(results["least_in_progress"])
    assert affinity > spread + 0.1, (affinity, spread)
    first_turns = WORKLOAD.conversations * WORKLOAD.system_bytes
    assert sum(r.reused for r in results["affinity"].runtimes) >= (WORKLOAD.turns - 1) * first_turns
