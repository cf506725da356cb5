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
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


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


def write_model(path: Path, shape: ModelShape = TINY, seed: int = 0) -> Path:
    """Write a random-weight llama GGUF of ``shape`` to ``path``; the same shape and seed write the same file."""
    import gguf

    byte_tokens = _byte_tokens()
    space = byte_tokens[ord(" ")]
    merges = [f"{space} t", "h e", f"{space}t he", "i n", "e r", "a n"]
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
