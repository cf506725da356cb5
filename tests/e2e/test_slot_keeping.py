"""End to end: ``--runtime-slot-files`` keeps llama.cpp's slots for conversations (the agent's, and the gateway's
for runtimes by URL).

One slot, no host cache (``--cache-ram 0``): once another conversation has used the slot, the
server itself has nothing left of the first one, and its next turn is computed whole (the control,
asked of the server directly). Through infx with slots kept, the agent saved the first
conversation's slot to a file after its turn and restores it before the next one: the server then
finds the whole earlier turn in the slot (``timings.cache_n``), and the answer is the server's own.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from openai import OpenAI

from harness.gguf_models import write_model
from harness.llama_server import LlamaCppServer
from harness.twistd_processes import Engine, Gateway, wait_until

HARBOUR = "You answer in one short sentence about the weather in a small town by the sea."
HILLS = "Mountain guide: name one path up the hill and how long it takes, nothing more."
#: A first question long enough that its conversation is worth a file (a block of its own: 256 bytes).
HARBOUR_QUESTION = ("Hello from the harbour, where the boats come in at dawn and the gulls cry over the nets all "
                    "morning long, and the fishermen mend them by the quay.")


def chat(client: OpenAI, system: str, *turns: str) -> dict:
    """The conversation's answer to its last turn, the earlier turns answered as ``ok``."""
    messages = [{"role": "system", "content": system}]
    for i, turn in enumerate(turns):
        if i:
            messages.append({"role": "assistant", "content": "ok"})
        messages.append({"role": "user", "content": turn})
    return client.chat.completions.create(model="tiny", messages=messages, max_tokens=4, temperature=0).model_dump()


@pytest.mark.parametrize("served", ["dial-in", "by URL"])
def test_a_conversation_pushed_out_of_the_only_slot_is_restored_for_its_next_turn(tmp_path: Path, served: str):
    """The same through an engine agent (``twistd infx-engine --runtime-slot-files``) and through the
    gateway serving the runtime by URL (``twistd infx --runtime-url --runtime-slot-files --workers 1``)."""
    saves = tmp_path / "slots"
    saves.mkdir()
    llama = LlamaCppServer(write_model(tmp_path / "tiny.gguf"), tmp_path, slots=1, cache_ram=0, context_per_slot=512,
                           extra=["--slot-save-path", str(saves)])
    children: list = [llama]
    try:
        direct = OpenAI(base_url=llama.url + "/v1", api_key="unused", max_retries=0)
        first = chat(direct, HARBOUR, HARBOUR_QUESTION)
        chat(direct, HILLS, "Something else entirely, from the hills.")
        own = chat(direct, HARBOUR, HARBOUR_QUESTION, "And tomorrow?")
        held = own["timings"]["cache_n"]
        assert held < first["usage"]["prompt_tokens"] // 2  # the control: the slot lost the conversation

        if served == "dial-in":
            gateway = Gateway(tmp_path)
            children.append(gateway)
            children.append(Engine(tmp_path, gateway, "kept", [], runtime="openai", upstream=llama.url,
                                   extra=["--runtime-slot-files", "4"]))
            engine_id = "kept"
        else:
            gateway = Gateway(tmp_path, extra=["--runtime-url", llama.url, "--runtime-slot-files", "4"])
            children.append(gateway)
            engine_id = gateway.runtime_engine_id(llama.url.split("//", 1)[1])
        through = OpenAI(base_url=gateway.base_url, api_key="unused", max_retries=0)
        first = chat(through, HARBOUR, HARBOUR_QUESTION)
        chat(through, HILLS, "Something else entirely, from the hills.")
        answer = chat(through, HARBOUR, HARBOUR_QUESTION, "And tomorrow?")
        # Every token of the first turn's prompt came back from its file (the server computes at least one).
        assert answer["timings"]["cache_n"] >= first["usage"]["prompt_tokens"] - 1
        assert answer["choices"] == own["choices"]
        # The harbour conversation has its file; the hills one, a short question past its system prompt, none.
        assert sorted(p.name for p in saves.iterdir()) == [f"infx-{re.sub(r'[^A-Za-z0-9_.-]', '_', engine_id)}-0.bin"]
        # Operators see it on the gateway: two first turns, one restored, one conversation saved, and what the
        # runtime's answers said of their prompts. The keeper's counts and the third answer's may reach the
        # gateway in different statuses (load counts are coalesced): both are waited for.
        def reported() -> dict | None:
            engine = gateway.engines()[engine_id]
            models = engine.get("models") or [{}]
            done = (engine.get("slot_keeping") or {}).get("restored") \
                and (models[0].get("prompt_cache") or {}).get("answers") == 3
            return engine if done else None

        keeping = wait_until(reported, "the slot keeping's and the prompt cache's counts", [gateway.child])
        assert keeping["slot_keeping"] == {"held": 0, "restored": 1, "cold": 2, "failed": 0, "saved": 1, "off": False}
        [model] = keeping["models"]
        assert model["prompt_cache"]["answers"] == 3
        assert model["prompt_cache"]["cached_tokens"] >= answer["timings"]["cache_n"]
    finally:
        for child in reversed(children):
            child.stop()


def test_a_runtime_that_cannot_save_slots_turns_keeping_off_and_every_request_is_answered(tmp_path: Path):
    llama = LlamaCppServer(write_model(tmp_path / "tiny.gguf"), tmp_path, slots=1, cache_ram=0,
                           context_per_slot=512)  # no --slot-save-path
    children: list = [llama]
    try:
        gateway = Gateway(tmp_path)
        children.append(gateway)
        engine = Engine(tmp_path, gateway, "unkept", [], runtime="openai", upstream=llama.url,
                        extra=["--runtime-slot-files", "4"])
        children.append(engine)
        through = OpenAI(base_url=gateway.base_url, api_key="unused", max_retries=0)
        answers = [chat(through, system, HARBOUR_QUESTION) for system in (HARBOUR, HILLS, HARBOUR)]
        streamed = list(through.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "Hi."}], max_tokens=4, stream=True))
        assert all(a["choices"][0]["finish_reason"] for a in answers) and streamed
        log = engine.child.log_path.read_text()
        assert log.count("slots are no longer kept") == 1, log
        off = wait_until(lambda: (gateway.engines()["unkept"].get("slot_keeping") or {}).get("off")
                         and gateway.engines()["unkept"]["slot_keeping"], "keeping reported off", [gateway.child])
        assert off["restored"] == 0 and off["saved"] == 0
    finally:
        for child in reversed(children):
            child.stop()
