"""One run of the real-runtime routing benchmark: fresh llama-servers, a router in front, the workload's clients.

:func:`run_once` starts ``engines`` llama.cpp servers (:class:`harness.llama_server.LlamaCppServer`:
``-np SLOTS --metrics``, one thread each, the workload's ``--cache-ram``),
each with an alias of its own (``e0``, ``e1``, ...) that it names as the
``model`` of every answer, whatever the request asked for (requests name
:data:`MODEL`): that is how a record knows its engine, with nothing between
the router and the runtime. Then it starts a router (a :class:`RouterUnderTest`) of
``replicas`` replicas in front of them, sends one request through each
replica (the whole path serves), reads each server's prompt counters, runs
the workload's clients, reads the counters again, and stops everything.

The counters are a check, not a source: the run's records must add up to
what the servers counted meanwhile (``llamacpp:prompt_tokens_total`` and
``llamacpp:prompt_tokens_cached_total``), or :class:`RunError` says so.

infx runs as real processes (:class:`InfxRouter`): ``twistd infx`` gateways and one
``twistd infx-engine --runtime openai`` agent per server. With one replica,
one gateway holds the three agents; with three, three gateways, each the
``--peers`` of the other two, hold one agent each (engine ``i`` on gateway
``i``), so that each gateway routes to one local engine and two of its peers'.
Clients send each request to a replica drawn from their own seeded
generator (the same draws for every router).
"""

from __future__ import annotations

import functools
import http.client
import json
import math
import os
import random
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urlsplit

from harness.gguf_models import CHATML_TOOLS_TEMPLATE, ModelShape, render_chat, tokenize
from harness.llama_server import LlamaCppServer
from harness.real_routing.bounds import reuse_bounds
from harness.real_routing.figures import Figures, Record, figures
from harness.real_routing.workloads import Client, Workload
from harness.twistd_processes import TWISTD, Engine, Gateway, free_port, wait_until

__all__ = ["MODEL", "InfxRouter", "RunError", "RunResult", "RouterUnderTest", "Runtimes", "run_once", "with_bounds"]

#: The model every request names (llama-server serves its one model whatever the name).
MODEL = "llm"
#: Slots of each runtime (``-np``).
SLOTS = 2
#: Seconds one request may take.
REQUEST_TIMEOUT = 300.0


class RunError(AssertionError):
    """A run could not be measured: a process failed, or the records disagree with the servers' counters."""


class RouterUnderTest(Protocol):
    """A router of some replicas in front of the runtimes."""

    name: str
    #: The runtimes save and restore slots (``--slot-save-path``), for an agent that keeps them.
    slot_saves: bool

    def start(self, urls: Sequence[str], replicas: int, logs: Path, groups: Sequence[str]) -> list[str]:
        """Start ``replicas`` replicas in front of ``urls``; their base URLs (``http://host:port``)."""

    def stop(self) -> None:
        """Stop every process started."""


@dataclass
class Runtimes:
    """``engines`` fresh llama-servers of one model, started in parallel."""

    model: Path
    logs: Path
    engines: int = 3
    slots: int = SLOTS
    context_per_slot: int = 4096
    cache_ram: int | None = None
    tools_template: bool = False
    #: Each server saves and restores slots in a directory of its own (``--slot-save-path``).
    slot_saves: bool = False
    servers: list[LlamaCppServer] = field(default_factory=list)

    def start(self) -> None:
        extra: list[str] = []
        if self.tools_template:
            template = self.logs / "chatml-tools.jinja"
            template.write_text(CHATML_TOOLS_TEMPLATE)
            extra = ["--chat-template-file", str(template)]

        def one(i: int) -> LlamaCppServer:
            saves: list[str] = []
            if self.slot_saves:
                directory = self.logs / f"slots-e{i}"
                directory.mkdir(exist_ok=True)
                saves = ["--slot-save-path", str(directory)]
            return LlamaCppServer(self.model, self.logs, alias=f"e{i}", name=f"llama-e{i}", slots=self.slots,
                                  context_per_slot=self.context_per_slot, cache_ram=self.cache_ram,
                                  extra=extra + saves, wait=False)

        self.servers = [one(i) for i in range(self.engines)]
        for server in self.servers:
            server.wait_until_up()

    @property
    def urls(self) -> list[str]:
        return [s.url for s in self.servers]

    @property
    def names(self) -> list[str]:
        return [s.alias for s in self.servers]

    def counters(self) -> dict[str, tuple[int, int]]:
        """Each server's (prompt tokens cached, prompt tokens computed) so far, from its ``/metrics``."""
        out = {}
        for server in self.servers:
            values = {}
            for line in server.metrics().splitlines():
                name, _, value = line.partition(" ")
                if name in ("llamacpp:prompt_tokens_cached_total", "llamacpp:prompt_tokens_total"):
                    values[name] = int(float(value))
            out[server.alias] = (values["llamacpp:prompt_tokens_cached_total"], values["llamacpp:prompt_tokens_total"])
        return out

    def stop(self) -> None:
        for server in self.servers:
            server.stop()


#: API keys of the infx gateways: one caller per group (tenant of the figures), all in one tenant.
def _keys(groups: Sequence[str]) -> str:
    lines = ["keys:"] + [f"  - {{key: sk-{g}, tenant: default, name: {g}}}" for g in groups]
    lines += ["  - {key: sk-admin, tenant: default, admin: true}", "engine_keys:",
              "  - {key: ek-bench, tenant: default}"]
    return "\n".join(lines) + "\n"


class InfxRouter:
    """infx: ``twistd infx`` gateway(s) and a ``twistd infx-engine`` per runtime (see the module docstring).

    ``policy`` is ``--routing-policy``; ``gateway_extra`` and ``agent_extra`` are more options of each;
    ``checkout``: run another checkout's infx (its ``.venv``'s twistd, its tree first on the path);
    ``by_url``: no agents, each runtime served by URL (``--runtime-url``) by the gateway its agent
    would have dialled; ``by_url_everywhere``: by every gateway, as replicas that find the runtime
    pods by label serve them.
    """

    def __init__(self, name: str, policy: str = "affinity", gateway_extra: Sequence[str] = (),
                 agent_extra: Sequence[str] = (), checkout: Path | None = None, slot_files: int = 0,
                 by_url: bool = False, by_url_everywhere: bool = False) -> None:
        self.name = name
        self.by_url = by_url or by_url_everywhere
        self.everywhere = by_url_everywhere
        self.slot_saves = slot_files > 0
        self.checkout = checkout
        self.env = {"PYTHONPATH": str(checkout)} if checkout is not None else None
        self.twistd = str(checkout / ".venv" / "bin" / "twistd") if checkout is not None else TWISTD
        self.policy = policy
        self.gateway_extra = list(gateway_extra)
        self.agent_extra = list(agent_extra) + (["--runtime-slot-files", str(slot_files)] if slot_files else [])
        self.gateways: list[Gateway] = []
        self.agents: list[Engine] = []

    def start(self, urls: Sequence[str], replicas: int, logs: Path, groups: Sequence[str]) -> list[str]:
        keys = logs / "api-keys.yaml"
        keys.write_text(_keys(groups))

        def gateway(i: int, peers: Sequence[str], ports: tuple[int, int, int] | None = None) -> Gateway:
            extra = ["--routing-policy", self.policy, *self.gateway_extra]
            if self.by_url:
                for url in (urls if self.everywhere else urls[i::replicas]):
                    extra += ["--runtime-url", f"{url}={MODEL}"]
            if peers:
                extra += ["--peers", ",".join(peers)]
            return Gateway(logs, api_keys=keys, admin_key="sk-admin", name=f"gateway-{i}", ports=ports,
                           extra=extra, env=self.env, twistd=self.twistd)

        with ThreadPoolExecutor(len(urls) + replicas) as pool:
            if self.checkout is None:
                # On the ports the kernel picks: each gateway dials those started before it, which dial
                # it back (protocol/exchange/dial_backs.py).
                for i in range(replicas):
                    self.gateways.append(gateway(i, [f"127.0.0.1:{g.internal_port}" for g in self.gateways]))
            else:
                # An older infx may not name itself by an internal port 0, nor dial back: every port is
                # picked beforehand and every gateway names every other.
                picked = [(free_port(), free_port(), free_port()) for _ in range(replicas)]
                self.gateways = list(pool.map(lambda i: gateway(
                    i, [f"127.0.0.1:{p[2]}" for j, p in enumerate(picked) if j != i], picked[i]), range(replicas)))

            def agent(i: int) -> Engine:
                home = self.gateways[i % replicas]
                return Engine(logs, home, f"e{i}", [MODEL], runtime="openai", upstream=urls[i], key="ek-bench",
                              extra=self.agent_extra, env=self.env, twistd=self.twistd)

            if not self.by_url:
                self.agents = list(pool.map(agent, range(len(urls))))

        def all_ready(g: Gateway) -> bool:
            engines = g.engines().values()
            return len(engines) == len(urls) * (replicas if self.everywhere else 1) and all(
                e["ready"] and e["models"] and all(m["ready"] for m in e["models"]) for e in engines)

        for each in self.gateways:  # a peer's engines turn ready there once their gateway reports them
            wait_until(functools.partial(all_ready, each), "every engine ready at every gateway",
                       [each.child, *(a.child for a in self.agents)], timeout=60.0)
        return [g.url for g in self.gateways]

    def stop(self) -> None:
        for agent in self.agents:
            agent.stop()
        for each in self.gateways:
            each.stop()
        self.agents, self.gateways = [], []


@dataclass
class RunResult:
    """A run's records and figures, and what the servers counted meanwhile."""

    router: str
    workload: str
    replicas: int
    seed: int
    records: list[Record]
    figures: Figures
    counted: dict[str, tuple[int, int]]
    #: The machine's 1-minute load average when the clients started and when they ended.
    load_average: tuple[float, float] = (0.0, 0.0)


def _stream(url: str, body: bytes, headers: dict[str, str]) -> tuple[int, float | None, str, int, int, str]:
    """POST a streamed chat completion: (status, first content time, engine, cache_n, prompt_n, error)."""
    parts = urlsplit(url)
    connection = http.client.HTTPConnection(parts.hostname or "127.0.0.1", parts.port, timeout=REQUEST_TIMEOUT)
    first: float | None = None
    engine, cache_n, prompt_n = "", -1, -1
    done = False
    try:
        connection.request("POST", "/v1/chat/completions", body, headers)
        response = connection.getresponse()
        if response.status != 200:
            return response.status, None, "", 0, 0, response.read()[:300].decode("utf-8", "replace")
        for raw in response:
            line = raw.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                done = True
                break
            chunk = json.loads(data)
            if "error" in chunk:
                return 200, first, engine, 0, 0, json.dumps(chunk["error"])[:300]
            engine = chunk.get("model", engine)
            choices = chunk.get("choices") or []
            if first is None and any((c.get("delta") or {}).get("content") for c in choices):
                first = time.monotonic()
            timings = chunk.get("timings")
            if timings is not None:
                cache_n, prompt_n = timings["cache_n"], timings["prompt_n"]
            usage = chunk.get("usage")
            if usage is not None and cache_n < 0:
                cache_n = usage["prompt_tokens_details"]["cached_tokens"]
                prompt_n = usage["prompt_tokens"] - cache_n
    except (OSError, http.client.HTTPException, ValueError, KeyError) as e:
        return 0, first, engine, 0, 0, f"{type(e).__name__}: {e}"
    finally:
        connection.close()
    if not done or cache_n < 0:
        return 200, first, engine, 0, 0, "the stream ended without [DONE] or without the runtime's timings"
    return 200, first, engine, cache_n, prompt_n, ""


def _client(client: Client, workload: Workload, urls: Sequence[str], seed: int, t0: float,
            out: list[Record], lock: threading.Lock) -> None:
    """One closed-loop client: its conversations' turns, at most ``client.open`` conversations open at once."""
    rng = random.Random(f"replica:{seed}:{client.name}")
    pending = list(client.conversations)
    active: list[tuple[Any, int]] = []  # (conversation, next turn)
    ready_at = t0 + client.start
    while pending or active:
        while pending and len(active) < client.open:
            active.append((pending.pop(0), 0))
        conversation, turn = active.pop(0)
        wait = ready_at + conversation.turns[turn].think - time.monotonic()
        if wait > 0:
            time.sleep(wait)
        replica = rng.randrange(len(urls))
        body = json.dumps(conversation.body(turn, MODEL, workload.max_tokens)).encode()
        headers = {"Content-Type": "application/json", "Authorization": f"Bearer sk-{client.group}",
                   "x-session-id": conversation.id}
        sent = time.monotonic()
        status, first, engine, cache_n, prompt_n, error = _stream(urls[replica], body, headers)
        ended = time.monotonic()
        ready_at = ended
        with lock:
            out.append(Record(client.name, client.group, conversation.id, turn, replica, sent - t0,
                              None if first is None else first - t0, ended - t0, status, error, engine,
                              cache_n, prompt_n))
        if turn + 1 < len(conversation.turns):
            active.append((conversation, turn + 1))


#: The messages of the warm-up request every replica answers before a run.
WARM_MESSAGES = ({"role": "user", "content": "ready?"},)


def _warm(urls: Sequence[str], group: str) -> None:
    """One short request through each replica, until each answers 200 (the whole path serves)."""
    body = json.dumps({"model": MODEL, "messages": list(WARM_MESSAGES), "max_tokens": 1,
                       "stream": True}).encode()
    for url in urls:
        def answered(url: str = url) -> bool:
            return _stream(url, body, {"Content-Type": "application/json", "Authorization": f"Bearer sk-{group}"})[0] == 200
        wait_until(answered, f"a chat completion through {url}", timeout=60.0)


def run_once(workload: Workload, router: RouterUnderTest, model: Path, shape: ModelShape, logs: Path, *, replicas: int = 1,
             seed: int = 1, engines: int = 3, slots: int = SLOTS, context_per_slot: int = 4096,
             progress: Callable[[str], None] = lambda _: None) -> RunResult:
    """Run ``workload`` through ``router`` on fresh runtimes serving ``model`` (of ``shape``); logs of every
    process go to ``logs``."""
    logs.mkdir(parents=True, exist_ok=True)
    runtimes = Runtimes(model, logs, engines=engines, slots=slots, context_per_slot=context_per_slot,
                        cache_ram=workload.cache_ram(shape.kv_bytes_per_token), tools_template=workload.tools_template,
                        slot_saves=router.slot_saves)
    try:
        runtimes.start()
        urls = router.start(runtimes.urls, replicas, logs, workload.groups)
        _warm(urls, workload.groups[0])
        before = runtimes.counters()
        progress(f"{router.name} x{replicas} {workload.name} seed {seed}: {workload.requests} requests")
        records: list[Record] = []
        lock = threading.Lock()
        load_before = os.getloadavg()[0]
        t0 = time.monotonic()
        threads = [threading.Thread(target=_client, args=(c, workload, urls, seed, t0, records, lock), daemon=True)
                   for c in workload.clients]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        wall = time.monotonic() - t0
        load_after = os.getloadavg()[0]
        after = runtimes.counters()
    finally:
        router.stop()
        runtimes.stop()
    counted = {name: (after[name][0] - before[name][0], after[name][1] - before[name][1]) for name in after}
    if all(r.ok for r in records):  # a request that failed may have been counted by its server, or not
        _check(records, counted)
    return RunResult(router.name, workload.name, replicas, seed, records,
                     with_bounds(figures(records, runtimes.names, slots, wall), records, workload, shape, engines, slots),
                     counted, (load_before, load_after))


def with_bounds(found: Figures, records: Sequence[Record], workload: Workload, shape: ModelShape, engines: int,
                slots: int) -> Figures:
    """``found`` with the run's upper bounds on its cached share (:mod:`harness.real_routing.bounds`; the
    capacity bound where the workload gives the runtimes a small host cache)."""
    conversations = {c.id: c for client in workload.clients for c in client.conversations}
    ram = workload.cache_ram(shape.kv_bytes_per_token)
    bounds = reuse_bounds(records, lambda conversation, turn: conversations[conversation].prompt_tokens(turn),
                          engines=engines, slots=slots,
                          host_tokens=None if ram is None else ram * 1024 * 1024 // shape.kv_bytes_per_token,
                          generated=workload.max_tokens, preloaded=[tokenize(render_chat(list(WARM_MESSAGES), ()))])
    return replace(found, bound_all=bounds.all,
                   bound_capacity=math.nan if bounds.capacity is None else bounds.capacity)


def _check(records: Sequence[Record], counted: dict[str, tuple[int, int]]) -> None:
    """The answers' own counters add up, per engine, to what each server counted during the run."""
    summed: dict[str, tuple[int, int]] = {name: (0, 0) for name in counted}
    for r in records:
        if r.ok:
            cached, computed = summed.get(r.engine, (0, 0))
            summed[r.engine] = (cached + r.cache_n, computed + r.prompt_n)
    if summed != counted:
        raise RunError(f"the answers' timings {summed} disagree with the servers' counters {counted}")
