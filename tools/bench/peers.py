"""The gateways infx is measured beside: LiteLLM's proxy, SGLang's router and vLLM's router.

Each is a pinned PyPI release, installed on first use into its own venv
under ``tools/bench/`` (``.venv-litellm``, ``.venv-sglang-router``,
``.venv-vllm-router``; git ignores them, and nothing in the test suite
installs or starts them), started as a subprocess on a free loopback port
in front of a list of OpenAI-compatible runtimes given by URL, waited for
until it answers a chat completion, and stopped with SIGTERM (then
SIGKILL after 15 s; :class:`bench_processes.Child`). Idle, both routers
exit within a quarter second of SIGTERM with status 0. Every port they open is on
127.0.0.1: the routers' Prometheus listeners cannot be turned off (both
default to port 29000, sglang-router's on 0.0.0.0), so each gets a free
loopback port of its own.

What each needs from its runtimes, and what its policies key on, as read
from its ``--help`` and its public source and checked against
``starlette_runtime.py`` (probe: 3 runtimes, 6 chat prompts that differ
from their first word, 4 sequential requests each):

- sglang-router (SGLang Model Gateway; :func:`sglang_router_argv`). On
  start it registers each worker: a gRPC probe (an HTTP/2 preface, which
  uvicorn logs as "Invalid HTTP request received"), then ``GET /health``
  until it answers 200 (re-checked every 60 s), then ``/server_info``,
  ``/get_server_info``, ``/model_info``, ``/get_model_info`` (404 is
  fine: the model is then "unknown" and requests naming any model go to
  every worker). A worker not healthy at the first check is retried after
  ``--worker-startup-check-interval`` (30 s by default, 1 s here). It
  retries a failed request up to 5 times and has a circuit breaker
  (defaults kept). It logs two INFO lines per request (default level
  kept: what users run). ``power_of_two`` needs at least two workers (it
  refuses to start otherwise) and polls ``GET /get_load`` of each worker
  every second (SGLang's; 404 here, and it still spread the probe over the
  workers). ``cache_aware`` keeps one approximate radix tree of request
  text per model (a chat request's text is its messages' contents, tools
  left out), in this process only. A request whose text matches less than
  ``--cache-threshold`` (0.3) of a worker's goes to the worker with the
  fewest requests in flight *through this router*, the first one on a tie:
  requests sent one at a time (as in the probe: 3 runtimes, 6 chat prompts
  that differ from their first word, 4 sequential requests each) all land
  on the first worker, by design, not for want of configuration; under
  concurrent clients they spread (``tools/bench/real_routing.py``). A match
  above the threshold sticks to its worker until the loads differ by more
  than ``--balance-abs-threshold`` (64) and ``--balance-rel-threshold``
  (1.5x), which 2-slot runtimes never reach.
- vllm-router (:func:`vllm_router_argv`). It waits until every worker
  answers ``GET /health`` (re-checked every 60 s), with the same startup
  check interval (1 s here). ``consistent_hash`` hashes, in this order,
  the first non-empty header of ``x-session-id`` (:data:`SESSION_HEADER`,
  what clients should send), ``x-user-id``, ``x-tenant-id``,
  ``x-correlation-id``, ``x-request-id``, ``x-trace-id``; then the body's
  ``session_params.session_id``, ``user``, ``session_id``, ``user_id``;
  else the request's routing text, which was empty for chat completions
  in the probe (key ``request:``), so chat requests without a session key
  all go to one worker. It logs three INFO lines per request under that
  policy. ``cache_aware`` asks the worker for the rendered prompt first
  (``POST /v1/chat/completions/render``, then ``POST /tokenize``: vLLM's
  endpoints; 404 here, and llama-server's own ``/tokenize`` takes another
  body: logged at debug as "Prefix input preparation unavailable" with
  ``reason="render_unavailable"`` or ``"empty_input"``), and without a
  prompt to match it goes to the least loaded worker, the first one on a
  tie: sequential requests, again, all land on the first worker, and under
  concurrent clients it balances load rather than prompts (the benchmark's
  multi-turn chat: 31 of 54 later turns left their worker, against 0 with
  ``consistent_hash`` on the session header). With vLLM workers it would
  key on their rendered tokens; llama-server gives it nothing to key on.
- LiteLLM's proxy (:func:`litellm_argv`): one worker process, its model
  list in a YAML file with one entry per runtime URL under the same model
  name (LiteLLM shuffles among them), its cost map read from the package
  rather than fetched, telemetry off.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_processes import BenchError, Child, free_port, wait_until_answers  # noqa: E402

#: The header vllm-router's ``consistent_hash`` reads first; clients name their session in it.
SESSION_HEADER = "x-session-id"
SGLANG_ROUTER_POLICIES = ("round_robin", "cache_aware", "power_of_two")
VLLM_ROUTER_POLICIES = ("round_robin", "cache_aware", "consistent_hash")
#: Seconds between a router's checks of a worker that is not healthy yet (both default to 30).
STARTUP_CHECK_INTERVAL_S = 1
#: Seconds a peer may take to answer its first chat completion (LiteLLM imports for a while).
START_TIMEOUT_S = 180.0


@dataclass(frozen=True)
class Package:
    """A peer's PyPI release, pinned so that figures compare across runs, and the venv it is installed into."""

    distribution: str
    version: str
    venv: Path
    extras: str = ""

    @property
    def requirement(self) -> str:
        return f"{self.distribution}{self.extras}=={self.version}"

    @property
    def bin(self) -> Path:
        return self.venv / "bin"


LITELLM = Package("litellm", "1.81.13", HERE / ".venv-litellm", extras="[proxy]")
SGLANG_ROUTER = Package("sglang-router", "0.3.2", HERE / ".venv-sglang-router")
VLLM_ROUTER = Package("vllm-router", "0.1.17", HERE / ".venv-vllm-router")


def ensure_installed(package: Package) -> Path:
    """``package``'s venv ``bin`` directory, creating the venv and installing the pinned release if needed."""
    python = package.bin / "python"
    probe = [str(python), "-c", f"import importlib.metadata as m; print(m.version({package.distribution!r}))"]
    if python.exists() and subprocess.run(probe, capture_output=True, text=True).stdout.strip() == package.version:
        return package.bin
    print(f"installing {package.requirement} into {package.venv} (once)", file=sys.stderr)
    steps = [[sys.executable, "-m", "venv", str(package.venv)],
             [str(python), "-m", "pip", "install", "-q", package.requirement]]
    for step in steps:
        done = subprocess.run(step, capture_output=True, text=True)
        if done.returncode != 0:
            raise BenchError(f"could not install {package.requirement} ({' '.join(step[-2:])}): "
                             f"{done.stderr.strip()[-1500:]}")
    return package.bin


def sglang_router_argv(bin_dir: Path, port: int, metrics_port: int, worker_urls: list[str],
                       policy: str) -> list[str]:
    """The command line of sglang-router (its module form, as its ``--help`` shows) in front of ``worker_urls``."""
    if policy not in SGLANG_ROUTER_POLICIES:
        raise ValueError(f"sglang-router policy {policy!r}: one of {', '.join(SGLANG_ROUTER_POLICIES)}")
    if policy == "power_of_two" and len(worker_urls) < 2:
        raise ValueError("sglang-router refuses power_of_two with fewer than 2 workers")
    return [str(bin_dir / "python"), "-m", "sglang_router.launch_router",
            "--host", "127.0.0.1", "--port", str(port), "--worker-urls", *_urls(worker_urls),
            "--policy", policy,
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port),
            "--worker-startup-check-interval", str(STARTUP_CHECK_INTERVAL_S)]


def vllm_router_argv(bin_dir: Path, port: int, metrics_port: int, worker_urls: list[str],
                     policy: str) -> list[str]:
    """The command line of vllm-router in front of ``worker_urls``."""
    if policy not in VLLM_ROUTER_POLICIES:
        raise ValueError(f"vllm-router policy {policy!r}: one of {', '.join(VLLM_ROUTER_POLICIES)}")
    return [str(bin_dir / "vllm-router"),
            "--host", "127.0.0.1", "--port", str(port), "--worker-urls", *_urls(worker_urls),
            "--policy", policy,
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port),
            "--worker-startup-check-interval", str(STARTUP_CHECK_INTERVAL_S)]


def litellm_config(model: str, worker_urls: list[str]) -> str:
    """LiteLLM's YAML: ``model`` served by every runtime, each an OpenAI-compatible ``api_base``."""
    entries = "".join(
        f"  - model_name: {model}\n"
        "    litellm_params:\n"
        f"      model: openai/{model}\n"
        f"      api_base: {url.rstrip('/')}/v1\n"
        "      api_key: none\n" for url in _urls(worker_urls))
    return f"model_list:\n{entries}litellm_settings:\n  telemetry: false\n"


def litellm_argv(bin_dir: Path, config: Path, port: int) -> list[str]:
    """The command line of LiteLLM's proxy, one worker process, reading ``config``."""
    return [str(bin_dir / "litellm"), "--config", str(config), "--host", "127.0.0.1", "--port", str(port),
            "--num_workers", "1"]


#: LiteLLM's environment: the cost map from the package (no fetch: the bench stays on loopback), errors only.
LITELLM_ENV = {"LITELLM_LOCAL_MODEL_COST_MAP": "True", "LITELLM_LOG": "ERROR"}


@dataclass
class Peer:
    """A started peer: its process and the loopback port it serves the OpenAI API on."""

    child: Child
    port: int

    @property
    def pid(self) -> int:
        return self.child.process.pid

    def stop(self) -> None:
        self.child.stop()


def start_sglang_router(worker_urls: list[str], policy: str, model: str, logs: Path,
                        name: str = "sglang-router") -> Peer:
    """sglang-router with ``policy`` in front of ``worker_urls``, once it answers a chat completion for ``model``."""
    port = free_port()
    argv = sglang_router_argv(ensure_installed(SGLANG_ROUTER), port, free_port(), worker_urls, policy)
    return _started(Child(name, argv, logs, env=dict(os.environ)), port, model)


def start_vllm_router(worker_urls: list[str], policy: str, model: str, logs: Path,
                      name: str = "vllm-router") -> Peer:
    """vllm-router with ``policy`` in front of ``worker_urls``, once it answers a chat completion for ``model``."""
    port = free_port()
    argv = vllm_router_argv(ensure_installed(VLLM_ROUTER), port, free_port(), worker_urls, policy)
    return _started(Child(name, argv, logs, env=dict(os.environ)), port, model)


def start_litellm(worker_urls: list[str], model: str, logs: Path, name: str = "litellm") -> Peer:
    """LiteLLM's proxy serving ``model`` from ``worker_urls``, once it answers a chat completion for it."""
    bin_dir = ensure_installed(LITELLM)
    config = logs / f"{name}.yaml"
    config.write_text(litellm_config(model, worker_urls))
    port = free_port()
    child = Child(name, litellm_argv(bin_dir, config, port), logs, env={**os.environ, **LITELLM_ENV})
    return _started(child, port, model)


def _started(child: Child, port: int, model: str) -> Peer:
    try:
        wait_until_answers(port, model, [child], timeout=START_TIMEOUT_S)
    except BaseException:
        child.stop()
        raise
    return Peer(child, port)


def _urls(worker_urls: list[str]) -> list[str]:
    if not worker_urls:
        raise ValueError("a peer needs at least one runtime URL")
    bad = [url for url in worker_urls if not url.startswith(("http://", "https://"))]
    if bad:
        raise ValueError(f"runtime URLs must be http:// or https://: {', '.join(bad)}")
    return list(worker_urls)
