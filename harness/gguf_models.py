"""Random-weight llama models written with ``gguf``: what tests and benchmarks serve, since none can be downloaded.

Every model has the llama architecture, a byte-level BPE (``gpt2``) vocabulary
of the 256 byte tokens plus a few merges, end-of-sequence and ChatML special
tokens, a ChatML ``tokenizer.chat_template``, F32 weights drawn from a seeded
generator (the same shape and seed write the same file) and mean pooling so
that ``/v1/embeddings`` returns one vector per input. Its text is gibberish;
what matters is that it is produced at a known cost. A :class:`ModelShape`
sets that cost:

- :data:`TINY` (2 layers of width 64, 256-token context) loads in about half
  a second and decodes at thousands of tokens a second: for tests.
- :data:`BENCH` (7 layers of width 384, feed-forward 1152, 8 heads; 13.4 M
  parameters, 16,384-token context): ``llama-server`` prefills 1,000 tokens
  on one thread in about 0.58 s (0.56 s of CPU) on the 2-core machines the
  suite runs on, measured by ``tools/bench/llama_prefill.py`` (median of 5,
  load average 1.7; with five other jobs on the machine the CPU time stayed
  0.57 s and the wall time grew to 0.85-1.5 s): a prompt the cache holds
  then shows in time to first token.

What a prompt costs in tokens is known without a server: :func:`render_chat`
writes messages (and tools) out as the model's templates do, and
:func:`tokenize` splits text as llama.cpp's tokenizer does for this
vocabulary (checked against a live ``llama-server`` by
``tests/harness/test_llama_server.py``), so that a simulation sees the same
tokens as the runtime.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
#: ChatML with the tools in the system turn, the way Qwen 2.5's template renders them: what a server started
#: with ``--chat-template-file`` holding it puts in front of a tool-using conversation. Without tools it
#: renders exactly as :data:`CHATML_TEMPLATE`.
CHATML_TOOLS_TEMPLATE = (
    "{%- if tools %}{{ '<|im_start|>system\n' }}"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] + '\n\n' }}{% endif %}"
    "{{ '# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>' }}"
    "{% for tool in tools %}{{ '\n' }}{{ tool | tojson }}{% endfor %}"
    "{{ '\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}\n</tool_call><|im_end|>\n' }}"
    "{%- elif messages[0]['role'] == 'system' %}"
    "{{ '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'system' and loop.first %}"
    "{%- elif message['role'] == 'assistant' and message.tool_calls %}{{ '<|im_start|>assistant' }}"
    "{% if message['content'] %}{{ '\n' + message['content'] }}{% endif %}"
    "{% for call in message.tool_calls %}{{ '\n<tool_call>\n{\"name\": \"' + call.function.name "
    "+ '\", \"arguments\": ' }}{{ call.function.arguments if call.function.arguments is string "
    "else (call.function.arguments | tojson) }}{{ '}\n</tool_call>' }}{% endfor %}"
    "{{ '<|im_end|>\n' }}"
    "{%- elif message['role'] == 'tool' %}"
    "{{ '<|im_start|>user\n<tool_response>\n' + message['content'] + '\n</tool_response><|im_end|>\n' }}"
    "{%- else %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{%- endif %}"
)
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
#: The vocabulary's merges, in rank order ("\u0120" is GPT-2's stand-in for a space).
MERGES = ("\u0120 t", "h e", "\u0120t he", "i n", "e r", "a n")


@dataclass(frozen=True)
class ModelShape:
    """A model's dimensions; its cost per token follows from them."""

    name: str
    #: Context window the model declares (``llama.context_length``), in tokens.
    context_length: int
    width: int
    layers: int
    heads: int
    feed_forward: int

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes a token's keys and values take in llama.cpp's cache (F16, one KV head per head)."""
        return self.layers * self.width * 2 * 2

    @property
    def parameters(self) -> int:
        """Weights in the transformer blocks (the tiny vocabulary's embeddings are negligible)."""
        return self.layers * (4 * self.width * self.width + 3 * self.width * self.feed_forward)


#: The context is small, so that a context-length error is cheap to provoke.
TINY = ModelShape("infx-tiny-test", context_length=256, width=64, layers=2, heads=2, feed_forward=128)
BENCH = ModelShape("infx-bench", context_length=16384, width=384, layers=7, heads=8, feed_forward=1152)


def _byte_tokens() -> list[str]:
    """GPT-2's printable stand-ins for the 256 bytes (its ``bytes_to_unicode`` table)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    chars, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            chars[byte] = chr(byte)
        else:
            chars[byte] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


_BYTE_CHARS = _byte_tokens()


def write_model(path: Path, shape: ModelShape = TINY, seed: int = 0) -> Path:
    """Write a random-weight llama GGUF of ``shape`` to ``path``; the same shape and seed write the same file."""
    import gguf

    byte_tokens = _byte_tokens()
    merges = list(MERGES)
    merged = [left + right for left, right in (m.split(" ") for m in merges)]
    tokens = byte_tokens + merged + list(SPECIAL_TOKENS)
    types = ([gguf.TokenType.NORMAL] * (len(byte_tokens) + len(merged))
             + [gguf.TokenType.CONTROL] * len(SPECIAL_TOKENS))
    eos = tokens.index("<|endoftext|>")

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name(shape.name)
    writer.add_context_length(shape.context_length)
    writer.add_embedding_length(shape.width)
    writer.add_block_count(shape.layers)
    writer.add_feed_forward_length(shape.feed_forward)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.heads)
    writer.add_rope_dimension_count(shape.width // shape.heads)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_pooling_type(gguf.PoolingType.MEAN)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(eos)
    writer.add_eos_token_id(eos)
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHATML_TEMPLATE)

    rng = np.random.default_rng(seed)

    def weights(*dims: int) -> np.ndarray:
        return rng.normal(0.0, 0.2, size=dims).astype(np.float32)

    vocab, width, ffn = len(tokens), shape.width, shape.feed_forward
    # numpy shapes are (rows, columns): GGUF's ne is the reverse.
    writer.add_tensor("token_embd.weight", weights(vocab, width))
    writer.add_tensor("output_norm.weight", np.ones(width, dtype=np.float32))
    writer.add_tensor("output.weight", weights(vocab, width))
    for layer in range(shape.layers):
        block = f"blk.{layer}"
        writer.add_tensor(f"{block}.attn_norm.weight", np.ones(width, dtype=np.float32))
        for name in ("attn_q", "attn_k", "attn_v", "attn_output"):
            writer.add_tensor(f"{block}.{name}.weight", weights(width, width))
        writer.add_tensor(f"{block}.ffn_norm.weight", np.ones(width, dtype=np.float32))
        writer.add_tensor(f"{block}.ffn_gate.weight", weights(ffn, width))
        writer.add_tensor(f"{block}.ffn_up.weight", weights(ffn, width))
        writer.add_tensor(f"{block}.ffn_down.weight", weights(width, ffn))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def render_chat(messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] = ()) -> str:
    """The prompt text :data:`CHATML_TOOLS_TEMPLATE` renders for ``messages`` (string contents; an assistant
    message's ``tool_calls`` with string ``arguments``) and ``tools``, with the generation prompt."""
    out = []
    first = 0
    if tools:
        out.append("<|im_start|>system\n")
        if messages and messages[0]["role"] == "system":
            out.append(messages[0]["content"] + "\n\n")
            first = 1
        out.append("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
                   "You are provided with function signatures within <tools></tools> XML tags:\n<tools>")
        # Jinja's tojson as llama.cpp's engine writes it: Python's default separators, keys in order.
        out.extend("\n" + json.dumps(tool) for tool in tools)
        out.append('\n</tools>\n\nFor each function call, return a json object with function name and arguments '
                   'within <tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": '
                   '<args-json-object>}\n</tool_call><|im_end|>\n')
    for message in messages[first:]:
        role = message["role"]
        if role == "assistant" and message.get("tool_calls"):
            out.append("<|im_start|>assistant")
            if message.get("content"):
                out.append("\n" + message["content"])
            for call in message["tool_calls"]:
                function = call["function"]
                # llama.cpp hands a template that takes them the arguments as an object, not as their JSON text.
                arguments = json.dumps(json.loads(function["arguments"]))
                out.append(f'\n<tool_call>\n{{"name": "{function["name"]}", "arguments": {arguments}}}\n</tool_call>')
            out.append("<|im_end|>\n")
        elif role == "tool":
            out.append(f"<|im_start|>user\n<tool_response>\n{message['content']}\n</tool_response><|im_end|>\n")
        else:
            out.append(f"<|im_start|>{role}\n{message['content']}<|im_end|>\n")
    out.append("<|im_start|>assistant\n")
    return "".join(out)


#: Pieces the tokenizer never merges across: special tokens, then letter runs with at most one leading space.
_SPECIAL = re.compile("|".join(re.escape(t) for t in SPECIAL_TOKENS))
_WORD = re.compile(r" ?[^\W\d_]+")


def tokenize(text: str) -> list[int]:
    """``text`` as llama.cpp tokenizes it for these models (special tokens parsed): a token per UTF-8 byte,
    but for :data:`MERGES`, which apply only within a run of letters and its leading space."""
    byte_ids = {ch: i for i, ch in enumerate(_byte_tokens())}
    ranks = {tuple(m.split(" ")): rank for rank, m in enumerate(MERGES)}
    merged_ids = {left + right: 256 + rank for (left, right), rank in ranks.items()}
    special_ids = {t: 256 + len(MERGES) + i for i, t in enumerate(SPECIAL_TOKENS)}
    ids: list[int] = []

    def plain(piece: str) -> None:
        symbols = [_BYTE_CHARS[b] for b in piece.encode("utf-8")]
        while len(symbols) > 1:
            best = min(range(len(symbols) - 1), key=lambda i: ranks.get((symbols[i], symbols[i + 1]), len(ranks)))
            pair = (symbols[best], symbols[best + 1])
            if pair not in ranks:
                break
            symbols[best:best + 2] = [pair[0] + pair[1]]
        ids.extend(byte_ids[s] if s in byte_ids else merged_ids[s] for s in symbols)

    def words(segment: str) -> None:
        at = 0
        for match in _WORD.finditer(segment):
            for byte in segment[at:match.start()].encode("utf-8"):
                ids.append(byte)
            plain(match.group())
            at = match.end()
        for byte in segment[at:].encode("utf-8"):
            ids.append(byte)

    at = 0
    for match in _SPECIAL.finditer(text):
        words(text[at:match.start()])
        ids.append(special_ids[match.group()])
        at = match.end()
    words(text[at:])
    return ids
