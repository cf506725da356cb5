"""A real-runtime routing check (issue #17): llama.cpp servers behind engine agents and two gateways.

:func:`run_policy` starts, for one ``--routing-policy``, ``engines``
llama-cpp-python servers (``python -m llama_cpp.server --cache true``: its
RAM prompt cache on) serving a random-weight model
(:func:`harness.gguf_models.write_model`), one ``twistd infx-engine
--runtime openai`` beside each, attached to two ``twistd infx`` gateways in
turn, which are each other's ``--peers`` (each sees every engine).
``conversations`` clients talk at once, each with its own long system
prompt, for ``turns`` turns; turn ``k`` of conversation ``c`` goes to gateway
``(c + k) % 2``, so a conversation crosses gateways every turn, and every
turn carries the whole history.

The prefix-cache figures are the runtimes' own: llama-cpp-python has no
``/metrics`` and no ``/slots`` (so its agents report no ``runtime_load``),
but with ``verbose`` it prints, per completion, ``Llama.generate: N
prefix-match hit, remaining M prompt tokens to eval`` when it reused N
prompt tokens (from its context, or from a state its prompt cache loaded:
``Llama._create_completion: cache hit``) and llama.cpp's ``prompt eval time
= X ms / M tokens``. The hit rate is ΣN / Σ(N + M) and the prefill time ΣX.
Time to first token is measured at the client (the first streamed chunk
with content).
"""

from __future__ import annotations

import json
import re
import statistics
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness.llama_runtime import LlamaServer
from harness.twistd_processes import Engine, Gateway, wait_until

PREFIX_MATCH = re.compile(r"Llama\.generate: (\d+) prefix-match hit, remaining (\d+) prompt tokens to eval")
PROMPT_EVAL = re.compile(r"prompt eval time =\s*([\d.]+) ms /\s*(\d+) tokens")
KEYS = """
keys:
  - {key: sk-admin, tenant: default, admin: true}
engine_keys:
  - {key: ek-default, tenant: default}
"""


@dataclass
class RuntimeSignals:
    """What one runtime printed about its prompts."""

    requests: int = 0
    reused: int = 0
    evaluated: int = 0
    prefill_ms: float = 0.0

    @classmethod
    def from_log(cls, text: str) -> RuntimeSignals:
        """Each completion prints its prompt eval line, preceded by a prefix-match line when it
        reused any of the context (none is printed for a prompt that reused nothing)."""
        signals = cls()
        reused = 0
        for line in text.splitlines():
            if match := PREFIX_MATCH.search(line):
                reused = int(match.group(1))
            elif match := PROMPT_EVAL.search(line):
                signals.requests += 1
                signals.reused += reused
                signals.evaluated += int(match.group(2))
                signals.prefill_ms += float(match.group(1))
                reused = 0
        return signals


@dataclass
class PolicyResult:
    policy: str
    ttft: list[float] = field(default_factory=list)
    errors: int = 0
    runtimes: list[RuntimeSignals] = field(default_factory=list)
    seconds: float = 0.0

    def row(self) -> dict[str, Any]:
        reused = sum(r.reused for r in self.runtimes)
        total = reused + sum(r.evaluated for r in self.runtimes)
        loads = [r.requests for r in self.runtimes]
        ttft = sorted(self.ttft)
        return {
            "policy": self.policy,
            "requests": len(self.ttft),
            "errors": self.errors,
            "hit_rate": reused / total if total else 0.0,
            "prompt_tokens": total,
            "prefill_s": sum(r.prefill_ms for r in self.runtimes) / 1000,
            "ttft_mean_s": statistics.fmean(ttft) if ttft else None,
            "ttft_p90_s": ttft[int(0.9 * (len(ttft) - 1))] if ttft else None,
            "requests_per_engine": loads,
            "max_over_mean_load": max(loads) / statistics.fmean(loads) if loads and any(loads) else None,
            "wall_s": self.seconds,
        }


def system_prompt(conversation: int, size: int) -> str:
    """A long system prompt of its own for each conversation (bytes are tokens for this model)."""
    words = [f"rule{conversation}-{i}" for i in range(size // 8 + 1)]
    return " ".join(words)[:size]


def stream_turn(url: str, messages: list[dict[str, str]], max_tokens: int) -> tuple[float, str]:
    """One streamed chat turn: (seconds to the first content chunk, the whole reply)."""
    body = {"model": "tiny", "messages": messages, "max_tokens": max_tokens, "stream": True,
            "temperature": 0}
    request = urllib.request.Request(url + "/v1/chat/completions", data=json.dumps(body).encode(), headers={
        "Content-Type": "application/json", "Authorization": "Bearer sk-admin"})
    started = time.monotonic()
    first: float | None = None
    reply = []
    with urllib.request.urlopen(request, timeout=300) as response:
        for raw in response:
            line = raw.strip()
            if not line.startswith(b"data:") or line == b"data: [DONE]":
                continue
            delta = json.loads(line[5:])["choices"][0].get("delta", {}).get("content") or ""
            if delta and first is None:
                first = time.monotonic() - started
            reply.append(delta)
    return (first if first is not None else time.monotonic() - started), "".join(reply)


@dataclass(frozen=True)
class LlamaWorkload:
    """The cluster and the conversations of one run."""

    engines: int = 3
    conversations: int = 6
    turns: int = 4
    system_bytes: int = 600
    max_tokens: int = 8
    #: The servers' context window, tokens (the model's, or less): conversations outgrow the tiny model's.
    context: int = 2048


def run_policy(policy: str, args: LlamaWorkload, model: Path, logs: Path) -> PolicyResult:
    """Run ``args`` against a fresh cluster routing by ``policy``; logs go under ``logs``."""
    logs.mkdir(parents=True, exist_ok=True)
    keys = logs / "keys.yaml"
    keys.write_text(KEYS)
    children: list[Any] = []
    result = PolicyResult(policy)
    try:
        servers = [LlamaServer(model, logs, name=f"llama-{i}", embedding=False, context=args.context, extra=[
            "--cache", "true", "--verbose", "true"]) for i in range(args.engines)]
        children += servers
        # Each gateway sees the engines of those that dial it: the second dials the first, which
        # dials it back (protocol/exchange/dial_backs.py), each on the ports the kernel picked.
        first = Gateway(logs, api_keys=keys, admin_key="sk-admin", name="gateway-0",
                        extra=["--routing-policy", policy, "--status-interval", "1"])
        children.append(first)
        second = Gateway(logs, api_keys=keys, admin_key="sk-admin", name="gateway-1",
                         extra=["--routing-policy", policy, "--status-interval", "1",
                                "--peers", f"127.0.0.1:{first.internal_port}"])
        children.append(second)
        gateways = [first, second]
        for i, server in enumerate(servers):
            children.append(Engine(logs, gateways[i % 2], f"engine-{i}", [], runtime="openai",
                                   upstream=server.url, key="ek-default", extra=["--max-concurrency", "1"]))
        def all_ready(gateway: Gateway) -> bool:
            engines = gateway.engines().values()
            return len(engines) == args.engines and all(
                e["ready"] and e["models"] and all(m["ready"] for m in e["models"]) for e in engines)

        for gateway in gateways:  # a peer's engines turn ready there within --status-interval
            wait_until(lambda g=gateway: all_ready(g), "every engine ready at every gateway", timeout=30.0)
        lock = threading.Lock()

        def converse(c: int) -> None:
            messages = [{"role": "system", "content": system_prompt(c, args.system_bytes)}]
            for turn in range(args.turns):
                messages.append({"role": "user", "content": f"turn {turn} of chat {c}: go on"})
                try:
                    ttft, reply = stream_turn(gateways[(c + turn) % 2].url, messages, args.max_tokens)
                except Exception as e:  # a failed turn is counted, and the conversation goes on
                    print(f"conversation {c} turn {turn}: {e}", file=sys.stderr)
                    with lock:
                        result.errors += 1
                    continue
                messages.append({"role": "assistant", "content": reply})
                with lock:
                    result.ttft.append(ttft)

        started = time.monotonic()
        threads = [threading.Thread(target=converse, args=(c,)) for c in range(args.conversations)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        result.seconds = time.monotonic() - started
        result.runtimes = [RuntimeSignals.from_log(server.output()) for server in servers]
    finally:
        for child in reversed(children):
            child.stop()
    return result


