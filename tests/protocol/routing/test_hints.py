"""Routing hints: chained prefix blocks, home keys, sessions; bounded work; never raises."""

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from protocol.routing.hints import HintsConfig, hints_from_json

SYSTEM = {"role": "system", "content": "You are a careful assistant. " * 40}
SHORT_SYSTEM = {"role": "system", "content": "Be brief."}


def chat(messages, **extra):
    return json.dumps({"model": "llama", "messages": messages, **extra}).encode()


def test_the_next_turn_shares_every_full_block_of_the_turn_before():
    turn1 = [SHORT_SYSTEM, {"role": "user", "content": "Tell me about the sea. " * 30}]
    turn2 = turn1 + [{"role": "assistant", "content": "The sea is large. " * 30}, {"role": "user", "content": "More."}]
    first, second = hints_from_json("chat/completions", chat(turn1), {}), hints_from_json("chat/completions", chat(turn2), {})
    assert len(first.blocks) >= 2
    assert second.blocks[:len(first.blocks)] == first.blocks
    assert len(second.blocks) > len(first.blocks)
    assert first.home == second.home  # the opening (system + first user message) is the same


def test_field_order_and_sampling_parameters_do_not_change_the_hints():
    messages = [SYSTEM, {"role": "user", "content": "hi"}]
    a = hints_from_json("chat/completions", chat(messages, temperature=0.2), {})
    b = hints_from_json("chat/completions", json.dumps({"messages": messages, "stream": True, "model": "llama"}), {})
    assert a == b


def test_a_long_shared_system_prompt_is_the_home_key_of_every_user():
    a = hints_from_json("chat/completions", chat([SYSTEM, {"role": "user", "content": "question one " * 40}]), {})
    b = hints_from_json("chat/completions", chat([SYSTEM, {"role": "user", "content": "another thing " * 40}]), {})
    assert a.home == b.home
    assert a.blocks[:4] == b.blocks[:4] and a.blocks != b.blocks


def test_without_a_long_system_prompt_conversations_have_their_own_home():
    a = hints_from_json("chat/completions", chat([SHORT_SYSTEM, {"role": "user", "content": "question one"}]), {})
    b = hints_from_json("chat/completions", chat([SHORT_SYSTEM, {"role": "user", "content": "another thing"}]), {})
    assert a.home != b.home


def test_session_from_the_user_field_or_a_header_keys_the_home():
    body = chat([{"role": "user", "content": "hi"}], user="alice")
    other = chat([{"role": "user", "content": "something else entirely"}], user="alice")
    assert hints_from_json("chat/completions", body, {}).session == "alice"
    assert hints_from_json("chat/completions", body, {}).home == hints_from_json("chat/completions", other, {}).home
    by_header = hints_from_json("chat/completions", chat([{"role": "user", "content": "hi"}]), {"x-session-id": ["s-1"]})
    assert by_header.session == "s-1"


def test_the_model_seeds_the_chain_and_is_the_adapter():
    messages = [SYSTEM, {"role": "user", "content": "hi"}]
    base = hints_from_json("chat/completions", chat(messages), {})
    lora = hints_from_json("chat/completions", json.dumps({"model": "llama-lora-sql", "messages": messages}), {})
    assert lora.adapter == "llama-lora-sql"
    assert not set(base.blocks) & set(lora.blocks)


def test_legacy_prompt_and_responses_input_have_blocks():
    prompt = hints_from_json("completions", json.dumps({"model": "m", "prompt": "x" * 1000}), {})
    assert len(prompt.blocks) == 1000 // 256
    responses = hints_from_json("responses", json.dumps({"model": "m", "instructions": "i" * 600, "input": "q"}), {})
    assert len(responses.blocks) == 2


def test_blocks_are_capped_however_long_the_prompt():
    config = HintsConfig(block_bytes=64, max_blocks=8)
    hints = hints_from_json("chat/completions", chat([{"role": "user", "content": "y" * 1_000_000}]), {}, config)
    assert len(hints.blocks) == 8


def test_no_hints_for_other_endpoints_or_unreadable_bodies():
    assert hints_from_json("embeddings", json.dumps({"model": "m", "input": "x"}), {}) is None
    assert hints_from_json("chat/completions", b"not json", {}) is None
    assert hints_from_json("chat/completions", b"[1, 2]", {}) is None
    assert hints_from_json("chat/completions", json.dumps({"model": "m"}), {}) is None


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20,
)


@settings(max_examples=200, deadline=None)
@given(endpoint=st.sampled_from(["chat/completions", "completions", "responses"]),
       body=st.dictionaries(st.sampled_from(["model", "messages", "prompt", "input", "instructions", "user"]),
                            json_values, max_size=5))
def test_any_json_object_gives_hints_or_none_and_never_raises(endpoint, body):
    hints = hints_from_json(endpoint, json.dumps(body).encode(), {})
    if hints is not None:
        assert len(hints.blocks) <= HintsConfig().max_blocks
        assert 0 <= hints.home < 2**64


def test_the_canonical_text_is_json_dumps_with_sorted_keys_compact_and_unescaped():
    # Every gateway (of any version) must cut the same prompt into the same blocks.
    from protocol.routing.hints import _canonical

    for value in ({"role": "user", "content": "héllo \u2028 \"q\" \\ \x01", "name": None},
                  {"b": [1, 2.5, 1e-05, True], "a": {"z": "ü", "y": [{"t": "x"}]}}, "plain", 3, ["é", {}]):
        assert _canonical(value) == json.dumps(value, sort_keys=True, separators=(",", ":"),
                                               ensure_ascii=False).encode("utf-8", "replace")
def _agent(tools, task):
    return {"model": "m", "tools": tools, "messages": [{"role": "system", "content": "Use the tools."},
                                                       {"role": "user", "content": task}]}


TOOLSET = [{"type": "function", "function": {"name": f"tool_{i}", "description": "does things " * 20,
                                              "parameters": {"type": "object", "properties": {}}}}
           for i in range(4)]


def test_tool_definitions_come_first_as_a_template_renders_them_and_are_shared_blocks():
    """Agents of one toolset share the schemas' blocks (the bulk of their rendered prompt) whatever
    they ask, and the toolset with the system prompt is their home key."""
    a, b = (hints_from_json("chat/completions", _agent(TOOLSET, task), {}) for task in ("first task", "another"))
    assert a is not None and b is not None
    schema_blocks = len(json.dumps({"tools": TOOLSET}, separators=(",", ":"))) // 256
    assert schema_blocks >= 4 and a.blocks[:schema_blocks] == b.blocks[:schema_blocks]
    assert a.home == b.home and a.home_blocks == b.home_blocks >= schema_blocks
    other = hints_from_json("chat/completions", _agent(TOOLSET[::-1], "first task"), {})
    assert other is not None and other.home != a.home and other.blocks[:schema_blocks] != a.blocks[:schema_blocks]


def test_home_blocks_count_the_system_prompts_blocks_and_none_without_one():
    system = "x" * 1000
    shared = hints_from_json("chat/completions", {"model": "m", "messages": [
        {"role": "system", "content": system}, {"role": "user", "content": "y" * 600}]}, {})
    assert shared is not None and shared.home_blocks == len(json.dumps({"content": system, "role": "system"})) // 256
    alone = hints_from_json("chat/completions", {"model": "m", "messages": [{"role": "user", "content": "y" * 900}]}, {})
    assert alone is not None and alone.home_blocks == 0 and len(alone.blocks) == 3


def test_responses_tools_come_before_the_instructions():
    body = {"model": "m", "tools": TOOLSET, "instructions": "Be brief.", "input": "hello"}
    hints = hints_from_json("responses", body, {})
    plain = hints_from_json("responses", {**body, "tools": []}, {})
    assert hints is not None and plain is not None and hints.home_blocks >= 4 and plain.home_blocks == 0


def test_a_prompt_that_holds_an_earlier_answer_continues_a_conversation():
    """What lets a gateway that never saw a conversation tell its later turn from a first one."""
    first = [SHORT_SYSTEM, {"role": "user", "content": "hi"}]
    later = first + [{"role": "assistant", "content": "hello"}, {"role": "user", "content": "more"}]
    tool = first + [{"role": "assistant", "tool_calls": []}, {"role": "tool", "content": "42"}]
    assert not hints_from_json("chat/completions", chat(first), {}).continues
    assert hints_from_json("chat/completions", chat(later), {}).continues
    assert hints_from_json("chat/completions", chat(tool), {}).continues
    assert not hints_from_json("completions", json.dumps({"model": "m", "prompt": "hi"}), {}).continues
    responses = {"model": "m", "input": [{"role": "user", "content": "hi"}]}
    assert not hints_from_json("responses", json.dumps(responses), {}).continues
    responses["input"] += [{"type": "function_call_output", "call_id": "c", "output": "42"}]
    assert hints_from_json("responses", json.dumps(responses), {}).continues
    assert not hints_from_json("responses", json.dumps({"model": "m", "input": "hi"}), {}).continues
