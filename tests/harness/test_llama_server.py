"""llama.cpp's own server, as harness/llama_server.py documents it: endpoints, fields, prompt cache, loading.

Each test pins one fact the routing work reads from the runtime, against
the real binary of the pinned llama.cpp and the tiny model, so that a new
pin that changes one fails here first, with the fact's name.
"""

from __future__ import annotations

import json
import signal
from dataclasses import replace
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from harness.gguf_models import CHATML_TEMPLATE, CHATML_TOOLS_TEMPLATE, TINY, render_chat, tokenize, write_model
from harness.llama_server import LOADING, LlamaCppServer, LoadGate
from protocol.agent.runtime_metrics import parse_exposition, parse_slots, reading_from_metrics
from harness.twistd_processes import ChildDied, wait_until

#: Runs the real llama-server binary.
pytestmark = pytest.mark.e2e

SLOTS = 2
CONTEXT = 256


@pytest.fixture(scope="module")
def logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("llama-server")


@pytest.fixture(scope="module")
def model(logs: Path) -> Path:
    return write_model(logs / "tiny.gguf")


@pytest.fixture(scope="module")
def server(logs: Path, model: Path) -> Iterator[LlamaCppServer]:
    llama = LlamaCppServer(model, logs, slots=SLOTS, context_per_slot=CONTEXT)
    yield llama
    llama.stop()


def post(server: LlamaCppServer, path: str, body: dict[str, Any]) -> tuple[int, bytes]:
    request = urllib.request.Request(server.url + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def chat(server: LlamaCppServer, system: str, **extra: Any) -> dict[str, Any]:
    body = {"model": "tiny", "messages": [{"role": "system", "content": system}, {"role": "user", "content": "hi"}],
            "max_tokens": 4, "temperature": 0, **extra}
    status, answer = post(server, "/v1/chat/completions", body)
    assert status == 200, answer
    result: dict[str, Any] = json.loads(answer)
    return result


def counters(server: LlamaCppServer) -> tuple[float, float]:
    """(prompt tokens served from the cache, prompt tokens computed) so far."""
    samples = {s.name: s.value for s in parse_exposition(
        server.metrics(), ("llamacpp:prompt_tokens_cached_total", "llamacpp:prompt_tokens_total"))}
    return samples["llamacpp:prompt_tokens_cached_total"], samples["llamacpp:prompt_tokens_total"]


def test_props_give_the_slots_and_each_slots_context(server):
    props = server.json("/props")
    assert props["total_slots"] == SLOTS
    assert props["default_generation_settings"]["n_ctx"] == CONTEXT
    assert (props["model_alias"], props["endpoint_slots"], props["endpoint_metrics"]) == ("tiny", True, True)
    assert props["chat_template"] == CHATML_TEMPLATE


def test_slots_need_no_flag_and_list_each_slot_with_its_context(server):
    slots = server.json("/slots")
    assert [(s["id"], s["n_ctx"], s["is_processing"]) for s in slots] == [(i, CONTEXT, False) for i in range(SLOTS)]
    assert parse_slots(json.dumps(slots).encode())[0] == 0


def test_metrics_carry_the_names_the_agent_reads_and_no_kv_cache_usage(server):
    text = server.metrics()
    names = {line.split()[0] for line in text.splitlines() if line and not line.startswith("#")}
    assert {"llamacpp:requests_processing", "llamacpp:requests_deferred", "llamacpp:prompt_tokens_total",
            "llamacpp:prompt_tokens_cached_total"} <= names
    assert not any("kv_cache" in name for name in names)
    reading = reading_from_metrics(text)
    assert (reading.source, reading.running, reading.waiting, reading.kv_cache_usage) == ("llama.cpp", 0, 0, None)


def test_an_answer_says_what_the_cache_served_and_the_metrics_count_the_same(server):
    before = counters(server)
    first = chat(server, "A first prompt, nobody has seen it.")
    again = chat(server, "A first prompt, nobody has seen it.")
    for answer in (first, again):
        timings, usage = answer["timings"], answer["usage"]
        assert usage["prompt_tokens"] == timings["cache_n"] + timings["prompt_n"]
        assert usage["prompt_tokens_details"]["cached_tokens"] == timings["cache_n"]
    # All but one prompt token come from the cache: the last is always computed again.
    assert (again["timings"]["cache_n"], again["timings"]["prompt_n"]) == (again["usage"]["prompt_tokens"] - 1, 1)
    after = counters(server)
    assert after[0] - before[0] == first["timings"]["cache_n"] + again["timings"]["cache_n"]
    assert after[1] - before[1] == first["timings"]["prompt_n"] + again["timings"]["prompt_n"]


def test_cache_prompt_false_computes_the_whole_prompt(server):
    chat(server, "A prompt asked twice.")
    answer = chat(server, "A prompt asked twice.", cache_prompt=False)
    assert answer["timings"]["cache_n"] == 0 and answer["timings"]["prompt_n"] == answer["usage"]["prompt_tokens"]


def test_a_stream_ends_with_timings_and_carries_usage_only_when_asked(server):
    def stream(**extra: Any) -> list[dict[str, Any]]:
        body = {"model": "tiny", "messages": [{"role": "user", "content": "stream"}], "max_tokens": 3,
                "temperature": 0, "stream": True, **extra}
        status, raw = post(server, "/v1/chat/completions", body)
        assert status == 200
        data = [line[len(b"data: "):] for line in raw.split(b"\n") if line.startswith(b"data: ")]
        assert data[-1] == b"[DONE]"
        return [json.loads(d) for d in data[:-1]]

    plain = stream()
    assert plain[-1]["choices"][0]["finish_reason"] == "length" and "timings" in plain[-1]
    assert not any("usage" in chunk for chunk in plain)
    with_usage = stream(stream_options={"include_usage": True})
    assert with_usage[-1]["choices"] == [] and with_usage[-1]["usage"]["prompt_tokens"] > 0
    assert "timings" in with_usage[-1]


def test_the_chat_template_is_the_models_chatml(server):
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
    status, body = post(server, "/apply-template", {"messages": messages})
    assert status == 200
    assert json.loads(body)["prompt"] == "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n" \
                                         "<|im_start|>assistant\n"


# Four prompts over two slots: when the first comes back, both slots hold other prompts.
PROMPTS = [f"{word} " * 20 for word in ("alpha", "bravo", "charlie", "delta")]


def test_the_ram_prompt_cache_finds_a_prompt_both_slots_have_moved_on_from(server):
    for prompt in PROMPTS:
        chat(server, prompt)
    answer = chat(server, PROMPTS[0])
    assert answer["timings"]["cache_n"] == answer["usage"]["prompt_tokens"] - 1


def test_without_the_ram_cache_only_what_a_slot_still_holds_is_reused(logs, model):
    llama = LlamaCppServer(model, logs, slots=SLOTS, context_per_slot=CONTEXT, cache_ram=0, name="no-cache-ram")
    try:
        for prompt in PROMPTS:
            chat(llama, prompt)
        answer = chat(llama, PROMPTS[0])
        status, body = post(llama, "/tokenize", {"content": "<|im_start|>system\n"})
        assert status == 200
        # Only the template's opening, which every prompt shares.
        assert answer["timings"]["cache_n"] == len(json.loads(body)["tokens"])
    finally:
        llama.stop()


def test_while_it_loads_every_path_answers_503_loading_then_health_turns_200(logs, model):
    gate = LoadGate(model, logs)
    llama = LlamaCppServer(gate.path, logs, name="gated", wait=False)
    try:
        wait_until(lambda: llama.health() == 503, "llama-server to listen while loading", [llama])
        for path in ("/health", "/v1/models", "/props", "/slots", "/metrics"):
            status, body = llama.get(path)
            assert (status, json.loads(body)) == (503, LOADING), path
        status, body = post(llama, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]})
        assert (status, json.loads(body)) == (503, LOADING)
        gate.release(llama)
        llama.wait_until_up()
        assert llama.get("/health") == (200, b'{"status":"ok"}')
        assert chat(llama, "loaded")["choices"][0]["finish_reason"] == "length"
    finally:
        llama.stop()


def test_sigterm_stops_it_cleanly(logs, model):
    llama = LlamaCppServer(model, logs, name="stopped")
    llama.process.send_signal(signal.SIGTERM)
    assert llama.process.wait(timeout=30) == 0


@pytest.fixture(scope="module")
def tools_server(logs: Path) -> Iterator[LlamaCppServer]:
    template = logs / "chatml-tools.jinja"
    template.write_text(CHATML_TOOLS_TEMPLATE)
    model = write_model(logs / "tiny-2k.gguf", replace(TINY, context_length=2048))  # tool schemas are long
    llama = LlamaCppServer(model, logs, name="llama-tools", slots=1, context_per_slot=2048,
                           extra=["--chat-template-file", str(template)])
    yield llama
    llama.stop()


TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in the city, then its neighbours",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "Its name"}},
                   "required": ["city"]}}}]
CONVERSATIONS = [
    ([{"role": "system", "content": "You are kind."},
      {"role": "user", "content": "the then in inner an tan  the\n\tthe it's naïve x1 42 a-b TThe thethe"}], []),
    ([{"role": "system", "content": "sys"}, {"role": "user", "content": "hello there"},
      {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function", "function": {
          "name": "get_weather", "arguments": '{"city":"Oslo"}'}}]},
      {"role": "tool", "tool_call_id": "c1", "content": "sunny then rain"},
      {"role": "assistant", "content": "ok the"}, {"role": "user", "content": "more"}], TOOLS),
]


@pytest.mark.parametrize(("messages", "tools"), CONVERSATIONS, ids=["chat", "tools"])
def test_render_chat_and_tokenize_give_the_servers_prompt_token_for_token(tools_server, messages, tools):
    """What a simulation counts (harness.gguf_models) is what the server renders and computes."""
    body: dict[str, Any] = {"messages": messages}
    if tools:
        body["tools"] = tools
    status, rendered = post(tools_server, "/apply-template", body)
    assert status == 200
    prompt = json.loads(rendered)["prompt"]
    assert render_chat(messages, tools) == prompt
    status, answer = post(tools_server, "/tokenize", {"content": prompt, "add_special": False, "parse_special": True})
    assert status == 200 and tokenize(prompt) == json.loads(answer)["tokens"]
    status, answer = post(tools_server, "/v1/chat/completions", {**body, "model": "tiny", "max_tokens": 1})
    assert status == 200 and json.loads(answer)["usage"]["prompt_tokens"] == len(tokenize(prompt))


def test_a_server_whose_picked_port_was_taken_meanwhile_starts_again_on_another(
        logs: Path, model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Free ports are picked before the server binds one; another process may take it first
    (seen in CI: "couldn't bind HTTP server socket"). A port it was given is never replaced."""
    import socket

    import harness.llama_server as llama_server

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    picks = iter([taken.getsockname()[1]])
    real = llama_server.free_port
    monkeypatch.setattr(llama_server, "free_port", lambda: next(picks, None) or real())
    try:
        llama = LlamaCppServer(model, logs, name="llama-port-taken", slots=1, context_per_slot=CONTEXT)
        try:
            assert llama.port != taken.getsockname()[1] and llama.health() == 200
            assert "couldn't bind HTTP server socket" in llama.output()
        finally:
            llama.stop()
        with pytest.raises(ChildDied, match="exited"):
            LlamaCppServer(model, logs, name="llama-port-given", slots=1, context_per_slot=CONTEXT,
                           port=taken.getsockname()[1])
    finally:
        taken.close()
