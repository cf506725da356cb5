"""Eight real ``twistd infx`` gateways in a full mesh of static peers, sixteen ``infx-engine`` agents.

The cluster of issue #16's real-process check, shared by ``tests/e2e/test_eight_gateways.py`` and
``tools/bench/eight_gateways.py``. Each gateway listens on its own loopback address (127.0.0.2 to
127.0.0.9 where the machine routes them, else 127.0.0.1) on ports the kernel picked, dials the
seven others with the internal secret, and has two echo engines attached: four models, each
served by four engines on four different gateways, so that every gateway serves two models from
its own engines and two only through the exchange. Every process starts in parallel and is then
awaited, so that the start-up costs the machine's cores once, not once per process in a row.
"""

from __future__ import annotations

import json
import re
import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness.twistd_processes import TwistdChild, http_get, wait_until

GATEWAYS = 8
ENGINES_PER_GATEWAY = 2
MODELS = ("m0", "m1", "m2", "m3")
SECRET = "eight-gateways-internal-secret"


def _aliases_bindable() -> bool:
    try:
        with socket.socket() as s:
            s.bind((f"127.0.0.{GATEWAYS + 1}", 0))
        return True
    except OSError:
        return False


HOSTS: tuple[str, ...] = (tuple(f"127.0.0.{i + 2}" for i in range(GATEWAYS)) if _aliases_bindable()
                          else ("127.0.0.1",) * GATEWAYS)


def engine_model(gateway: int, slot: int) -> str:
    """The model of engine ``slot`` on ``gateway``: slot 0 serves ``g % 4``, slot 1 ``(g + 1) % 4``,
    so model m is on gateways m, m + 4, m - 1 and m + 3 (mod 8): four different ones."""
    return MODELS[(gateway + slot) % len(MODELS)]


def engine_id(gateway: int, slot: int) -> str:
    return f"e{gateway}{slot}"


ALL_ENGINES = tuple(engine_id(g, s) for g in range(GATEWAYS) for s in range(ENGINES_PER_GATEWAY))


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


@dataclass
class GatewayNode:
    """One gateway's address and ports (kept over a restart) and its current process."""

    index: int
    host: str
    http_port: int
    worker_port: int
    internal_port: int
    child: TwistdChild | None = None
    starts: int = 0
    killed: bool = False

    @property
    def name(self) -> str:
        return f"g{self.index}"

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.http_port}"

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    @property
    def internal_address(self) -> str:
        return f"{self.host}:{self.internal_port}"

    def local_models(self) -> set[str]:
        return {engine_model(self.index, s) for s in range(ENGINES_PER_GATEWAY)}

    def status(self) -> dict[str, Any]:
        code, body = http_get(self.url + "/admin/status", timeout=2)
        assert code == 200, body
        result: dict[str, Any] = json.loads(body)
        return result

    def ready_engines(self) -> set[str]:
        """Engines this gateway would route to now (local or a peer's), every model ready, by the
        ids they report."""
        engines = self.status()["tenants"].get("default", {}).get("engines", {})
        return {e["engine_id"] for e in engines.values()
                if e["ready"] and e["models"] and all(m["ready"] for m in e["models"])}

    def metrics(self) -> str:
        code, body = http_get(self.url + "/metrics", timeout=2)
        assert code == 200, body
        return body.decode()


@dataclass
class EightGateways:
    """Starts, kills, restarts and stops the cluster; every process logs into ``log_dir``."""

    log_dir: Path
    token_delay: float = 0.0
    status_interval: float = 1.0
    #: More ``twistd infx`` options for every gateway (e.g. ``--routing-policy``).
    gateway_options: tuple[str, ...] = ()
    gateways: list[GatewayNode] = field(default_factory=list)
    engines: dict[str, TwistdChild] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for index, host in enumerate(HOSTS):
            self.gateways.append(GatewayNode(index, host, _free_port(host), _free_port(host), _free_port(host)))

    @property
    def children(self) -> list[TwistdChild]:
        """Every process that should be running (not a gateway killed on purpose)."""
        live = [g.child for g in self.gateways if g.child is not None and not g.killed]
        return [*live, *self.engines.values()]

    def start(self) -> None:
        """Every gateway, then every engine, each batch in parallel; returns once converged."""
        for node in self.gateways:
            self._spawn_gateway(node)
        for node in self.gateways:
            self.wait_ready(node)
        for node in self.gateways:
            for slot in range(ENGINES_PER_GATEWAY):
                self._spawn_engine(node, slot)
        self.wait_converged(timeout=60)

    def _spawn_gateway(self, node: GatewayNode) -> None:
        node.starts += 1
        peers = ",".join(other.internal_address for other in self.gateways if other is not node)
        args = ["infx", "--http", f"tcp:{node.http_port}:interface={node.host}",
                "--worker-grpc", f"tcp:{node.worker_port}:interface={node.host}",
                "--internal-grpc", f"tcp:{node.internal_port}:interface={node.host}",
                "--peers", peers, "--internal-secret", SECRET,
                "--status-interval", str(self.status_interval), "--grace-period", "5", "--workers", "1",
                *self.gateway_options]
        suffix = "" if node.starts == 1 else f"-start{node.starts}"
        node.child = TwistdChild(node.name + suffix, args, self.log_dir)

    def _spawn_engine(self, node: GatewayNode, slot: int) -> None:
        name = engine_id(node.index, slot)
        args = ["infx-engine", "--server", f"{node.host}:{node.worker_port}", "--engine-id", name,
                "--runtime", "echo", "--models", engine_model(node.index, slot),
                "--token-delay", str(self.token_delay), "--status-interval", str(self.status_interval)]
        self.engines[name] = TwistdChild(f"engine-{name}", args, self.log_dir)

    def wait_ready(self, node: GatewayNode, timeout: float = 60) -> None:
        assert node.child is not None
        wait_until(lambda: http_get(node.url + "/readyz", timeout=2)[0] == 200, f"{node.name}'s /readyz",
                   [node.child], timeout=timeout)

    def missing(self, nodes: Sequence[GatewayNode] | None = None) -> dict[str, set[str]]:
        """For each gateway of ``nodes`` (default: all), the engines it does not route to yet."""
        out: dict[str, set[str]] = {}
        for node in nodes if nodes is not None else self.gateways:
            try:
                lacking = set(ALL_ENGINES) - node.ready_engines()
            except (OSError, AssertionError):
                lacking = set(ALL_ENGINES)
            if lacking:
                out[node.name] = lacking
        return out

    def wait_converged(self, timeout: float = 30) -> float:
        """Until every gateway routes to every engine; returns the seconds it took."""
        began = time.monotonic()
        wait_until(lambda: not self.missing(), "every gateway to see all 16 engines", self.children,
                   timeout=timeout)
        return time.monotonic() - began

    def kill(self, node: GatewayNode) -> None:
        """SIGKILL: no goodbye to its peers or engines."""
        assert node.child is not None
        node.killed = True
        node.child.kill()

    def restart(self, node: GatewayNode) -> None:
        """A new process on the same address and ports (its engines redial it by themselves)."""
        self._spawn_gateway(node)
        node.killed = False
        self.wait_ready(node)

    def stop(self) -> None:
        for child in self.children:
            child.stop()


# --- client traffic ------------------------------------------------------------------------


def prompt(tag: str, words: int = 8) -> str:
    """A prompt no other request sends (the echo engine answers with it), so a wrong answer shows."""
    return " ".join([tag, *(f"w{i}" for i in range(words))])


@dataclass(frozen=True)
class Outcome:
    """How one request ended, as its client saw it."""

    gateway: int
    model: str
    stream: bool
    started: float
    ended: float
    #: ``ok`` (the right answer, whole), ``wrong`` (an answer, not the right one), ``connection``
    #: (refused or cut: no HTTP answer), ``timeout``, ``http`` (an error status) or ``stream_error``
    #: (an error event after the stream started).
    kind: str
    detail: str = ""
    #: The ``x-request-id`` it was sent with (the gateway's request log names it).
    request_id: str = ""
    #: The OpenAI error code of an error status or a stream's error event.
    code: str = ""
    #: The text a stream carried before it ended.
    received: str = ""
    #: The prompt sent, which is the right answer (the echo engines').
    text: str = ""


def ask(client: Any, model: str, text: str, stream: bool, request_id: str = "",
        received: list[str] | None = None) -> str:
    """The answer's text, streaming or not, through the official openai client (``received``
    gets each piece of a stream as it comes)."""
    messages = [{"role": "user", "content": text}]
    headers = {"x-request-id": request_id} if request_id else None
    if not stream:
        return str(client.chat.completions.create(model=model, messages=messages,
                                                  extra_headers=headers).choices[0].message.content)
    pieces = received if received is not None else []
    for chunk in client.chat.completions.create(model=model, messages=messages, stream=True, extra_headers=headers):
        if chunk.choices and chunk.choices[0].delta.content:
            pieces.append(chunk.choices[0].delta.content)
    return "".join(pieces)


def classify(gateway: int, model: str, stream: bool, text: str, started: float, call: Any,
             request_id: str = "", received: list[str] | None = None) -> Outcome:
    """Run ``call()`` (which returns the answer) and say how the request ended (``received``:
    the list ``call`` gives :func:`ask`, for what a stream carried before an error)."""
    import httpx2 as httpx  # what the openai client is built on here
    import openai

    kind, detail, code = "ok", "", ""
    try:
        answer = call()
        if answer != text:
            kind, detail = "wrong", answer[:200]
    except openai.APITimeoutError as e:
        kind, detail = "timeout", str(e)
    except openai.APIConnectionError as e:
        kind, detail = "connection", repr(e.__cause__ or e)
    except openai.APIStatusError as e:
        kind, detail, code = "http", f"{e.status_code} {e.message}", e.code or ""
    except openai.APIError as e:  # an error event inside a started stream
        kind, detail, code = "stream_error", e.message, e.code or ""
    except httpx.TimeoutException as e:
        kind, detail = "timeout", repr(e)
    except httpx.TransportError as e:  # the connection cut while a stream was read
        kind, detail = "connection", repr(e)
    return Outcome(gateway, model, stream, started, time.monotonic(), kind, detail, request_id, code,
                   "".join(received or []), text)


def cut_on_a_lost_engine(outcome: Outcome, node: GatewayNode, killed_at: float, lost: set[str]) -> bool:
    """Whether ``outcome`` (a request to ``node``) is the one loss no gateway can avoid: a stream
    whose answer had started on one of the ``lost`` engines (by the ids they report) when their
    gateway was killed at ``killed_at``. Its client read a right start, then the gateway's error
    event for exactly that; the gateway's log says the same and names the engine. Such a stream
    cannot be sent again: its client has the first tokens, and another run would not continue them."""
    from protocol.processor.retries import ENGINE_LOST_MID_STREAM

    if not (outcome.kind == "stream_error" and outcome.stream and outcome.started < killed_at < outcome.ended):
        return False
    if (outcome.code, outcome.detail) != ("engine_lost", ENGINE_LOST_MID_STREAM) or not outcome.request_id:
        return False
    if not outcome.text.startswith(outcome.received):
        return False
    assert node.child is not None
    line = re.search(rf"request {re.escape(outcome.request_id)} chat/completions .* status=502 .* "
                     r"engine='([^'@]+)@[^']*' .* error=engine_lost", node.child.output())
    return line is not None and line.group(1) in lost


class Traffic:
    """Steady requests to every gateway: ``per_gateway`` client threads each, one request at a time,
    cycling through the models and alternating streaming and not, until :meth:`stop`."""

    def __init__(self, cluster: EightGateways, per_gateway: int = 1, pause: float = 0.02,
                 timeout: float = 30.0) -> None:
        import threading

        self.cluster = cluster
        self.pause = pause
        self.timeout = timeout
        self.outcomes: list[Outcome] = []
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(node, worker), daemon=True)
                         for node in cluster.gateways for worker in range(per_gateway)]

    def start(self) -> Traffic:
        for thread in self._threads:
            thread.start()
        return self

    def stop(self) -> list[Outcome]:
        self._stopping.set()
        for thread in self._threads:
            thread.join(self.timeout + 10)
        return list(self.outcomes)

    def answered(self, gateways: set[int], since: float) -> set[tuple[int, str]]:
        """(gateway, model) of the right answers to requests sent to ``gateways`` after ``since``."""
        with self._lock:
            return {(o.gateway, o.model) for o in self.outcomes
                    if o.kind == "ok" and o.gateway in gateways and o.started > since}

    def wait_answered(self, gateways: set[int], since: float, timeout: float = 60) -> None:
        """Until each of ``gateways`` answered every model after ``since``."""
        wanted = {(g, m) for g in gateways for m in MODELS}
        wait_until(lambda: wanted <= self.answered(gateways, since),
                   f"gateways {sorted(gateways)} to answer every model", self.cluster.children, timeout=timeout)

    def _run(self, node: GatewayNode, worker: int) -> None:
        import openai

        seq = 0
        while not self._stopping.is_set():
            # A fresh client each time: a request to a restarted gateway must not reuse a dead connection.
            with openai.OpenAI(base_url=node.base_url, api_key="x", max_retries=0, timeout=self.timeout) as client:
                model = MODELS[(seq + worker) % len(MODELS)]
                stream = seq % 2 == 1
                tag = f"g{node.index}t{worker}r{seq}"
                text, received = prompt(tag), list[str]()
                outcome = classify(node.index, model, stream, text, time.monotonic(),
                                   lambda: ask(client, model, text, stream, tag, received), tag, received)
            with self._lock:
                self.outcomes.append(outcome)
            seq += 1
            self._stopping.wait(self.pause)
