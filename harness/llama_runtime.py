"""llama.cpp as a real OpenAI-compatible runtime for tests: a tiny model and a server process.

No model can be downloaded where the suite runs, so :func:`write_tiny_model`
makes one with the ``gguf`` package: the llama architecture with a byte-level
BPE (``gpt2``) vocabulary of the 256 byte tokens plus a few merges, end-of-
sequence and ChatML special tokens, a ChatML ``tokenizer.chat_template``, 2
layers of width 64 with random F32 weights, and mean pooling so that
``/v1/embeddings`` returns one vector per input. It loads in about half a
second and writes gibberish quickly; the same seed gives the same text.

:class:`LlamaServer` runs ``python -m llama_cpp.server`` (llama-cpp-python's
OpenAI-compatible server) on a free loopback port, with its output in a log
file. ``--interrupt_requests false``: by default the server ends a stream
early whenever another request waits for the model, which would cut
overlapping streams short. The server has no ``/health``; it is up once
``GET /v1/models`` answers.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from harness.twistd_processes import ChildDied, free_port, http_get, wait_until

#: The model's context window in tokens: small, so that a context-length error is cheap to provoke.
CONTEXT_LENGTH = 256
EMBEDDING_WIDTH = 64
LAYERS = 2
HEADS = 2
FEED_FORWARD = 128

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


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


def write_tiny_model(path: Path, seed: int = 0) -> Path:
    """Write the tiny random-weight llama GGUF to ``path``; the same seed writes the same model."""
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
    writer.add_name("infx-tiny-test")
    writer.add_context_length(CONTEXT_LENGTH)
    writer.add_embedding_length(EMBEDDING_WIDTH)
    writer.add_block_count(LAYERS)
    writer.add_feed_forward_length(FEED_FORWARD)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(HEADS)
    writer.add_rope_dimension_count(EMBEDDING_WIDTH // HEADS)
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

    def weights(*shape: int) -> np.ndarray:
        return rng.normal(0.0, 0.2, size=shape).astype(np.float32)

    vocab, width = len(tokens), EMBEDDING_WIDTH
    # numpy shapes are (rows, columns): GGUF's ne is the reverse.
    writer.add_tensor("token_embd.weight", weights(vocab, width))
    writer.add_tensor("output_norm.weight", np.ones(width, dtype=np.float32))
    writer.add_tensor("output.weight", weights(vocab, width))
    for layer in range(LAYERS):
        block = f"blk.{layer}"
        writer.add_tensor(f"{block}.attn_norm.weight", np.ones(width, dtype=np.float32))
        for name in ("attn_q", "attn_k", "attn_v", "attn_output"):
            writer.add_tensor(f"{block}.{name}.weight", weights(width, width))
        writer.add_tensor(f"{block}.ffn_norm.weight", np.ones(width, dtype=np.float32))
        writer.add_tensor(f"{block}.ffn_gate.weight", weights(FEED_FORWARD, width))
        writer.add_tensor(f"{block}.ffn_up.weight", weights(FEED_FORWARD, width))
        writer.add_tensor(f"{block}.ffn_down.weight", weights(width, FEED_FORWARD))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


class LlamaServer:
    """``python -m llama_cpp.server`` serving ``model`` as ``alias`` on a free loopback port.

    ``api_key``: the server then wants ``Authorization: Bearer KEY`` on every
    request. ``port``: listen there (a restart on the same port, as a runtime
    restarted by its supervisor would be). ``wait``: block until it answers.
    """

    def __init__(self, model: Path, log_dir: Path, *, alias: str = "tiny", api_key: str | None = None,
                 port: int | None = None, embedding: bool = True, name: str = "llama",
                 extra: Sequence[str] = (), wait: bool = True) -> None:
        self.model = model
        self.alias = alias
        self.api_key = api_key
        self.port = port or free_port()
        self.log_path = log_dir / f"{name}.log"
        argv = [sys.executable, "-m", "llama_cpp.server", "--model", str(model), "--model_alias", alias,
                "--host", "127.0.0.1", "--port", str(self.port), "--n_ctx", str(CONTEXT_LENGTH),
                "--n_threads", "1", "--n_threads_batch", "1", "--interrupt_requests", "false",
                "--embedding", "true" if embedding else "false", *extra]
        if api_key is not None:
            argv += ["--api_key", api_key]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env)
        if wait:
            self.wait_until_up()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def alive(self) -> bool:
        return self.process.poll() is None

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")

    def check_alive(self) -> None:
        if not self.alive:
            raise ChildDied(f"llama server exited with {self.process.returncode}:\n{self.output()[-4000:]}")

    def answers(self) -> bool:
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        return http_get(self.url + "/v1/models", headers, timeout=2.0)[0] == 200

    def wait_until_up(self, timeout: float = 60.0) -> None:
        def up() -> bool:
            self.check_alive()
            return self.answers()

        wait_until(up, f"the llama server on port {self.port}", timeout=timeout)

    def stop(self) -> None:
        if self.alive:
            self.process.send_signal(signal.SIGKILL)
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
