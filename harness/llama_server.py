"""llama.cpp's own ``llama-server`` as the reference real runtime of tests and benchmarks.

:class:`LlamaCppServer` runs the binary :mod:`harness.llama_server_build`
built (tests only locate it: ``tools/test`` builds it before pytest) on a free
loopback port, ``-np SLOTS --metrics`` with one thread (``-t 1 -tb 1``) by
default, serving a model from :mod:`harness.gguf_models`; it waits for
``/health`` to answer 200 and stops the server with SIGTERM (SIGKILL only if
that does not end it). ``llama-cpp-python``'s server (``harness/llama_runtime.py``)
stays where a test needs what only it has.

:class:`LoadGate` holds a server in its loading state for as long as a test
needs (what waits on a loading runtime is then tested without a race): the
server is given a symlink to a FIFO, and its first open of the model (the
memory-fitting pass, ``common_fit_params``) blocks there with every path
answering 503. ``release()`` waits until the server is parked in that open
(its main thread's ``/proc/PID/wchan``), points the link at the real model
and opens the FIFO once: that pass reads nothing, logs ``failed to load
model`` and the server goes on without fitting (nothing to fit on a CPU),
and the load proper opens the real file.

What the vendored server (llama-cpp-python 0.3.36's ``vendor/llama.cpp``,
``tools/server``) actually exposes, checked against a live server by
``tests/test_llama_server.py``:

``GET /health``
    503 with ``{"error": {"message": "Loading model", "type":
    "unavailable_error", "code": 503}}`` from the moment it listens until the
    model is loaded; then 200 ``{"status": "ok"}``. While loading, *every*
    path answers that 503 (``/v1/models``, ``/props``, completions).
``GET /props``
    ``total_slots`` (= ``-np``), ``default_generation_settings.n_ctx`` (the
    context of one slot: ``-c`` / ``-np``, since an explicit ``-np`` turns the
    unified KV cache off), ``model_alias``, ``model_path``, ``chat_template``
    (the model's own), ``endpoint_slots`` / ``endpoint_metrics``, ``build_info``
    (``b0-unknown``: the sdist has no git metadata), ``is_sleeping``.
``GET /slots``
    On by default (``--no-slots`` turns it off; no flag needed). A list, one
    object per slot: ``id``, ``n_ctx``, ``speculative``, ``is_processing``;
    once a slot has run a task also ``id_task`` (its current task, else its
    last), ``n_prompt_tokens`` (tokens the slot's context holds now, prompt and
    generated: not the task's prompt), ``n_prompt_tokens_processed``,
    ``n_prompt_tokens_cache``, ``params``, ``next_token``, ``prompt``,
    ``generated``. A slot's statistics are zeroed when its task ends, so
    ``n_prompt_tokens_cache`` means something only while ``is_processing``.
``GET /metrics`` (``--metrics``; 501 without)
    Gauges ``llamacpp:requests_processing`` (slots busy),
    ``llamacpp:requests_deferred`` (requests waiting for a slot),
    ``llamacpp:prompt_tokens_seconds``, ``llamacpp:predicted_tokens_seconds``,
    ``llamacpp:n_busy_slots_per_decode``; counters
    ``llamacpp:prompt_tokens_total`` (prompt tokens computed, cached ones
    excluded), ``llamacpp:prompt_tokens_cached_total`` (prompt tokens served
    from the cache: the runtime's own prefix-cache counter),
    ``llamacpp:prompt_seconds_total``, ``llamacpp:tokens_predicted_total``,
    ``llamacpp:tokens_predicted_seconds_total``, ``llamacpp:n_decode_total``,
    ``llamacpp:n_tokens_max``, ``llamacpp:spec_decode_*``. No KV-cache usage
    metric (``llamacpp:kv_cache_usage_ratio`` is gone). ``/metrics`` and
    ``/slots`` are answered by the server's task loop between two decode
    steps, so they show the state as of the last step: a scrape during a
    6,000-token prefill of the bench model took 21 ms. Requests the loop has
    not taken from its queue yet count in neither gauge.
Completions (``/v1/chat/completions``, ``/v1/completions``, ``/completion``)
    Every answer carries ``timings`` (``cache_n``: prompt tokens reused,
    ``prompt_n``: prompt tokens computed, ``prompt_ms``, ``predicted_n``,
    ``predicted_ms``, ...) and ``usage.prompt_tokens_details.cached_tokens``
    (= ``cache_n``; ``usage.prompt_tokens`` = ``cache_n + prompt_n``). A stream
    sends ``timings`` in its last chunk (the one with ``finish_reason``), and
    ``usage`` in one more chunk (``choices: []``) only with
    ``stream_options.include_usage``.
Prompt cache
    ``cache_prompt`` (a request field, default true; ``--no-cache-prompt``)
    reuses the longest common prefix with what the chosen slot holds; a
    request is given the idle slot whose context shares the most with its
    prompt (``--slot-prompt-similarity``, 0.1), else the least recently used
    one. At least one prompt token is always computed, so an identical prompt
    reports ``cache_n = prompt tokens - 1``. ``--cache-ram N`` (MiB, default
    8192; 0 disables it) keeps slot contexts in host memory when a slot moves
    to another prompt and restores the best match for a later request on any
    slot: with it, a prompt served two prompts ago is found again; with 0, only
    what a slot still holds is.
Chat template
    The model's ``tokenizer.chat_template`` through llama.cpp's Jinja engine
    (``--jinja`` is the default): for :data:`harness.gguf_models.TINY`,
    ChatML, ``<|im_start|>{role}\\n{content}<|im_end|>\\n`` per message, then
    ``<|im_start|>assistant\\n`` (``POST /apply-template`` shows the text).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from harness.gguf_models import TINY
from harness.llama_server_build import locate
from harness.twistd_processes import ChildDied, free_port, http_get, wait_until

#: The body of every answer while the model loads.
LOADING = {"error": {"message": "Loading model", "type": "unavailable_error", "code": 503}}


class LoadGate:
    """``path`` keeps llama-server loading until :meth:`release` lets it load ``model``."""

    def __init__(self, model: Path, directory: Path) -> None:
        self.model = model.resolve()
        self.fifo = directory / f"{model.stem}.gate"
        self.path = directory / f"{model.stem}.gated.gguf"
        os.mkfifo(self.fifo)
        os.symlink(self.fifo, self.path)

    def release(self, server: LlamaCppServer, timeout: float = 30.0) -> None:
        """Let ``server`` load the model, once it waits in the FIFO's open (before that, moving the link
        would let it read the model at once, and opening the FIFO would meet no reader)."""
        wchan = Path(f"/proc/{server.process.pid}/wchan")  # its main thread, which loads the model

        # "wait_for_partner": where Linux parks an open of a FIFO until the other end opens.
        wait_until(lambda: wchan.read_text() == "wait_for_partner", f"{server.name} to wait in the gated model's open",
                   [server], timeout=timeout)
        swap = self.path.with_name(self.path.name + ".swap")
        os.symlink(self.model, swap)
        os.replace(swap, self.path)
        os.close(os.open(self.fifo, os.O_WRONLY | os.O_NONBLOCK))


class LlamaCppServer:
    """``llama-server`` serving ``model`` as ``alias`` on a free loopback port.

    ``slots``: ``-np``, each slot with ``context_per_slot`` tokens (``-c`` is
    their product). ``cache_ram``: ``--cache-ram`` in MiB (None: the server's
    default, 8192). ``threads``: ``-t`` and ``-tb``. ``port``: listen there (a
    runtime restarted in place). ``wait``: block until ``/health`` is 200.
    """

    def __init__(self, model: Path, log_dir: Path, *, alias: str = "tiny", slots: int = 2,
                 context_per_slot: int = TINY.context_length, threads: int = 1, cache_ram: int | None = None,
                 api_key: str | None = None, port: int | None = None, name: str = "llama-server",
                 extra: Sequence[str] = (), binary: Path | None = None, wait: bool = True) -> None:
        self.model = model
        self.name = name
        self.alias = alias
        self.slots = slots
        self.api_key = api_key
        self.port = port or free_port()
        self.log_path = log_dir / f"{name}.log"
        argv = [str(binary or locate()), "--model", str(model), "--alias", alias,
                "--host", "127.0.0.1", "--port", str(self.port), "--parallel", str(slots),
                "--ctx-size", str(slots * context_per_slot), "--threads", str(threads),
                "--threads-batch", str(threads), "--metrics", "--no-webui", *extra]
        if cache_ram is not None:
            argv += ["--cache-ram", str(cache_ram)]
        env = dict(os.environ)
        if api_key is not None:
            # In the environment, not on the command line where every process could read it.
            env["LLAMA_API_KEY"] = api_key
        # A port picked here may be taken by another process before the server binds it: then
        # wait_until_up starts it again on another (only a port it picked, never a given one).
        self._picked = port is None
        self._argv, self._env = argv, env
        self._spawn()
        if wait:
            self.wait_until_up()

    def _spawn(self) -> None:
        argv = list(self._argv)
        argv[argv.index("--port") + 1] = str(self.port)
        with self.log_path.open("ab") as log:
            self._log_start = log.tell()
            self.process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=self._env)

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
            raise ChildDied(f"{self.name} exited with {self.process.returncode}:\n{self.output()[-4000:]}")

    def get(self, path: str, timeout: float = 5.0) -> tuple[int, bytes]:
        """Status and body of a GET, with the API key when it has one."""
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        return http_get(self.url + path, headers, timeout=timeout)

    def health(self) -> int:
        return self.get("/health")[0]

    def wait_until_up(self, timeout: float = 60.0) -> None:
        """Until ``/health`` is 200 (it is 503 while the model loads); fails at once if the server dies,
        unless it died because another process took the port it was given here (then on a new one)."""
        for attempt in range(3):
            try:
                wait_until(lambda: self.health() == 200, f"{self.name} on port {self.port} to load its model",
                           [self], timeout=timeout)
                return
            except ChildDied:
                said = self.log_path.read_bytes()[self._log_start:]
                if not self._picked or attempt == 2 or b"couldn't bind HTTP server socket" not in said:
                    raise
                self.port = free_port()
                self._spawn()

    def json(self, path: str) -> Any:
        status, body = self.get(path)
        assert status == 200, f"GET {path}: {status} {body[:300]!r}"
        return json.loads(body)

    def metrics(self) -> str:
        status, body = self.get("/metrics")
        assert status == 200, f"GET /metrics: {status} {body[:300]!r}"
        return body.decode()

    def cpu_seconds(self) -> float:
        """CPU time the server has used (user + system): what a request cost it, whoever else shares the CPU."""
        fields = Path(f"/proc/{self.process.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def stop(self) -> None:
        """SIGTERM, as a supervisor stops it; SIGKILL if it has not exited within 10 s."""
        if self.alive:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
