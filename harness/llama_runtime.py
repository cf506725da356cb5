"""llama-cpp-python's server as a real OpenAI-compatible runtime for tests.

It serves the models of :mod:`harness.gguf_models` (the tiny one, unless a
test writes another). llama.cpp's own C++ server is
:mod:`harness.llama_server`'s; this one stays where a test needs what only it
has (embeddings beside completions in one process: ``llama-server
--embedding`` serves embeddings alone; its per-request log lines).

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

from harness.gguf_models import TINY
from harness.twistd_processes import ChildDied, free_port, http_get, wait_until


class LlamaServer:
    """``python -m llama_cpp.server`` serving ``model`` as ``alias`` on a free loopback port.

    ``context``: its context window in tokens (the model's, or less).
    ``api_key``: the server then wants ``Authorization: Bearer KEY`` on every
    request. ``port``: listen there (a restart on the same port, as a runtime
    restarted by its supervisor would be). ``wait``: block until it answers.
    """

    def __init__(self, model: Path, log_dir: Path, *, alias: str = "tiny", api_key: str | None = None,
                 port: int | None = None, embedding: bool = True, name: str = "llama",
                 context: int = TINY.context_length, extra: Sequence[str] = (), wait: bool = True) -> None:
        self.model = model
        self.alias = alias
        self.api_key = api_key
        self.port = port or free_port()
        self.log_path = log_dir / f"{name}.log"
        argv = [sys.executable, "-m", "llama_cpp.server", "--model", str(model), "--model_alias", alias,
                "--host", "127.0.0.1", "--port", str(self.port), "--n_ctx", str(context),
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
