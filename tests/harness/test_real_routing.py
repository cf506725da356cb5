"""The real-runtime routing benchmark's workloads and figures (harness/real_routing), without a process:
what the clients send, and what the figures make of records."""

from __future__ import annotations

import json
import math

import pytest

from harness.gguf_models import BENCH, TINY, render_chat, tokenize
from harness.real_routing.figures import Record, figures, percentile
from harness.real_routing.workloads import WORKLOADS, make


def record(conversation: str, turn: int, engine: str, sent: float, ended: float, cache_n: int, prompt_n: int,
           group: str = "chat", status: int = 200) -> Record:
    return Record("c", group, conversation, turn, 0, sent, sent + 0.1, ended, status, "", engine, cache_n, prompt_n)


def test_cached_share_and_computed_tokens_come_from_the_answers_of_requests_that_succeeded():
    records = [record("a", 0, "e0", 0, 1, 0, 100), record("a", 1, "e0", 1, 2, 100, 20),
               record("b", 0, "e1", 0, 1, 50, 50, status=503)]
    f = figures(records, ["e0", "e1", "e2"], slots=2, wall=2.0)
    assert (f.requests, f.errors) == (3, 1)
    assert f.cached_share == pytest.approx(100 / 220) and f.prompt_computed == 120
    assert f.per_engine == {"e0": 2, "e1": 0, "e2": 0} and f.max_over_mean == pytest.approx(3.0)


def test_a_later_turn_moved_off_a_free_home_is_a_move_that_reused_less_while_its_engine_had_a_slot():
    """Turn 1 of a went elsewhere with its home idle: counted. Turn 1 of b moved while its home ran two
    requests (both slots busy): a move, not counted. Turn 1 of c moved and still reused its whole previous
    prompt (another engine had it): a move, not counted."""
    records = [
        record("a", 0, "e0", 0.0, 1.0, 0, 100), record("a", 1, "e1", 2.0, 3.0, 10, 110),
        record("b", 0, "e2", 0.0, 1.0, 0, 100), record("b", 1, "e1", 5.0, 6.0, 0, 120),
        record("x", 0, "e2", 4.5, 6.0, 0, 50), record("y", 0, "e2", 4.8, 6.5, 0, 50),
        record("c", 0, "e0", 0.0, 1.0, 0, 100), record("c", 1, "e1", 7.0, 8.0, 100, 20),
    ]
    f = figures(records, ["e0", "e1", "e2"], slots=2, wall=8.0)
    assert (f.later_turns, f.moved, f.moved_off_free_home) == (3, 3, 1)


def test_percentiles_are_nearest_rank_and_each_group_has_its_own_p99():
    assert percentile([3.0, 1.0, 2.0, 4.0], 50) == 2.0 and percentile([3.0, 1.0, 2.0, 4.0], 99) == 4.0
    assert math.isnan(percentile([], 50))
    records = [record(f"s{i}", 0, "e0", 0, 1, 0, 1, group="steady") for i in range(3)]
    records.append(Record("c", "burst", "b", 0, 0, 0.0, 2.0, 3.0, 200, "", "e1", 0, 1))
    f = figures(records, ["e0", "e1"], slots=2, wall=3.0)
    assert f.group_p99 == {"burst": 2.0, "steady": pytest.approx(0.1)}


@pytest.mark.parametrize("name", WORKLOADS)
def test_a_workload_is_the_same_requests_for_the_same_seed_and_other_ones_for_another(name):
    def bodies(seed: int) -> list[str]:
        workload = make(name, seed, 0.2)
        return [json.dumps(c.body(t, "llm", workload.max_tokens)) for client in workload.clients
                for c in client.conversations for t in range(len(c.turns))]

    assert bodies(1) == bodies(1)
    assert bodies(1) != bodies(2)


@pytest.mark.parametrize("name", WORKLOADS)
def test_each_turn_repeats_the_turn_before_and_its_answer_so_its_prompt_extends_the_previous_one(name):
    workload = make(name, 1, 0.2)
    for client in workload.clients:
        for conversation in client.conversations:
            for turn in range(1, len(conversation.turns)):
                before, now = conversation.messages(turn - 1), conversation.messages(turn)
                assert now[:len(before)] == before and now[len(before)] == conversation.turns[turn - 1].answer
                rendered = render_chat(before, conversation.tools)[:-len("<|im_start|>assistant\n")]
                assert render_chat(now, conversation.tools).startswith(rendered)


def test_tool_agents_send_tool_results_answering_the_call_they_made():
    workload = make("tools", 1, 0.2)
    conversation = workload.clients[0].conversations[0]
    assert conversation.tools and workload.tools_template
    messages = conversation.messages(len(conversation.turns) - 1)
    calls = [m["tool_calls"][0]["id"] for m in messages if m.get("tool_calls")]
    results = [m["tool_call_id"] for m in messages if m["role"] == "tool"]
    assert calls == results and len(calls) == len(conversation.turns) - 1
    schema_tokens = len(tokenize(render_chat([{"role": "system", "content": "x"}], conversation.tools)))
    assert 1500 < schema_tokens < 2200


def test_the_workloads_are_what_the_docs_say_they_are():
    shared, pressure, bursty = make("shared", 1), make("pressure", 1), make("bursty", 1)
    assert (shared.requests, len(shared.clients)) == (96, 6)
    systems = {c.opening[0]["content"] for client in shared.clients for c in client.conversations}
    assert len(systems) == 4 and all(550 < len(tokenize(s)) < 700 for s in systems)
    assert (pressure.requests, {c.open for c in pressure.clients}) == (120, {3})
    assert pressure.cache_ram(BENCH.kv_bytes_per_token) == 24 and pressure.cache_ram(TINY.kv_bytes_per_token) == 1
    assert bursty.groups == ("steady", "burst")
    assert {(c.group, c.start) for c in bursty.clients} == {("steady", 0.0), ("burst", 2.0)}
    assert (bursty.requests, sum(c.group == "burst" for c in bursty.clients)) == (48 + 72, 6)
    with pytest.raises(ValueError):
        make("nope", 1)
