"""End to end against a real runtime: ``twistd infx`` and ``twistd infx-engine --runtime openai`` in front
of llama.cpp (llama-cpp-python's server, the tiny model of :mod:`harness.gguf_models`).

Request by request, the answer through infx must equal the runtime's own
answer to the same request with the same seed: status, JSON body (ids and
``created`` timestamps aside, which differ between any two runs), and for a
stream every event. The runtime wants an API key, which only the agent has
(``--upstream-api-key-file``), and the agent is given no ``--models``: it
serves what the runtime lists. Requests sent before the runtime is up, and
while it restarts, wait in the gateway's queue and then succeed.
"""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from harness.gguf_models import write_model
from harness.llama_runtime import LlamaServer
from harness.twistd_processes import Engine, Gateway, free_port, wait_until

#: A real llama.cpp server behind real twistd processes.
pytestmark = pytest.mark.slow

KEYS = """
keys:
  - {key: sk-admin, tenant: default, admin: true}
  - {key: sk-user, tenant: default}
engine_keys:
  - {key: ek-default, tenant: default}
"""
RUNTIME_KEY = "runtime-secret-1"
#: Fields that legitimately differ between two runs of the same request.
VOLATILE = ("id", "created")
#: Cases that need the lossless path between gateway and agent (#12 part A: verbatim bodies, so that
#: ``seed: 0`` and ``max_tokens`` arrive as sent, and legacy completions reach ``/v1/completions``).
#: Strict: once that path is in, they pass, and the marker must go.


def post(url: str, path: str, body: dict[str, Any], key: str | None, timeout: float = 60.0
         ) -> tuple[int, dict[str, str], bytes]:
    """Status, headers (lower-cased names) and body of a JSON POST; error statuses are returned."""
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    request = urllib.request.Request(url + path, data=json.dumps(body).encode(), headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, {k.lower(): v for k, v in response.headers.items()}, response.read()
    except urllib.error.HTTPError as e:
        return e.code, {k.lower(): v for k, v in e.headers.items()}, e.read()


def stable(document: Any) -> Any:
    """``document`` without the fields that differ between two runs."""
    if isinstance(document, dict):
        return {k: stable(v) for k, v in document.items() if k not in VOLATILE}
    if isinstance(document, list):
        return [stable(v) for v in document]
    return document


def events(raw: bytes) -> list[Any]:
    """The data of each server-sent event, parsed (``[DONE]`` stays a string), volatile fields dropped."""
    out: list[Any] = []
    for block in raw.replace(b"\r\n", b"\n").split(b"\n\n"):
        data = [line[len(b"data:"):].strip() for line in block.split(b"\n") if line.startswith(b"data:")]
        if data:
            text = b"\n".join(data)
            out.append(text.decode() if text == b"[DONE]" else stable(json.loads(text)))
    return out


@pytest.fixture(scope="module")
def logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("llama-e2e")


@pytest.fixture(scope="module")
def model(logs: Path) -> Path:
    return write_model(logs / "tiny.gguf")


@pytest.fixture(scope="module")
def stack(logs: Path, model: Path) -> Iterator[tuple[LlamaServer, Gateway]]:
    keys = logs / "keys.yaml"
    keys.write_text(KEYS)
    key_file = logs / "runtime-key"
    key_file.write_text(RUNTIME_KEY + "\n")
    llama = LlamaServer(model, logs, api_key=RUNTIME_KEY)
    children: list[Any] = [llama]
    try:
        gateway = Gateway(logs, api_keys=keys, admin_key="sk-admin")
        children.append(gateway)
        children.append(Engine(logs, gateway, "llama-engine", [], runtime="openai", upstream=llama.url,
                               key="ek-default", extra=["--upstream-api-key-file", str(key_file)]))
        yield llama, gateway
    finally:
        for child in reversed(children):
            child.stop()


def both(stack: tuple[LlamaServer, Gateway], path: str, body: dict[str, Any]
         ) -> tuple[tuple[int, dict[str, str], bytes], tuple[int, dict[str, str], bytes]]:
    """The runtime's own answer, then infx's, to the same request."""
    llama, gateway = stack
    return post(llama.url, path, body, RUNTIME_KEY), post(gateway.url, path, body, "sk-user")


def messages(text: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": "You are terse."}, {"role": "user", "content": text}]


def test_the_runtime_wants_its_key_and_the_agent_serves_the_models_it_lists(stack, logs):
    llama, gateway = stack
    assert post(llama.url, "/v1/chat/completions", {"model": "tiny", "messages": messages("hi")}, None)[0] == 401
    engine = gateway.engines()["llama-engine"]
    assert [(m["id"], m["ready"]) for m in engine["models"]] == [("tiny", True)]
    assert post(gateway.url, "/v1/chat/completions", {"model": "tiny", "messages": messages("hi"), "max_tokens": 4},
                "sk-user")[0] == 200
    for log in (logs / "engine-llama-engine.log", logs / "gateway.log"):
        assert RUNTIME_KEY not in log.read_text(errors="replace"), f"{log.name} shows the runtime's key"


CHATS = [
    pytest.param({"max_tokens": 24, "seed": 0}, id="max_tokens and seed 0"),
    pytest.param({"max_tokens": 40, "seed": 7, "stop": ["e", "a"]}, id="stop and a seed"),
    pytest.param({"max_tokens": 16, "seed": 3, "temperature": 0.3, "top_p": 0.9}, id="sampling knobs"),
]


@pytest.mark.parametrize("extra", CHATS)
def test_a_chat_answer_equals_the_runtimes_own(stack, extra):
    body = {"model": "tiny", "messages": messages("Say something."), **extra}
    (direct_status, _, direct), (status, headers, through) = both(stack, "/v1/chat/completions", body)
    assert (status, direct_status) == (200, 200)
    assert headers["content-type"].startswith("application/json")
    assert stable(json.loads(through)) == stable(json.loads(direct))


@pytest.mark.parametrize("extra", CHATS)
def test_a_streamed_chat_equals_the_runtimes_own_event_by_event(stack, extra):
    body = {"model": "tiny", "messages": messages("Stream something."), "stream": True, **extra}
    (direct_status, _, direct), (status, headers, through) = both(stack, "/v1/chat/completions", body)
    assert (status, direct_status) == (200, 200)
    assert headers["content-type"].startswith("text/event-stream")
    assert events(through) == events(direct)
    assert events(direct)[-1] == "[DONE]" and len(events(direct)) > 3


def test_overlapping_streams_through_infx_each_equal_the_runtimes_own(stack):
    """Several streams at once share one runtime (it runs them in turn); none is cut short."""
    llama, gateway = stack
    bodies = [{"model": "tiny", "messages": messages(f"Stream number {i}."), "stream": True, "max_tokens": 48,
               "seed": 10 + i} for i in range(3)]
    expected = [events(post(llama.url, "/v1/chat/completions", body, RUNTIME_KEY)[2]) for body in bodies]
    answers: list[Any] = [None] * len(bodies)

    def send(i: int) -> None:
        answers[i] = post(gateway.url, "/v1/chat/completions", bodies[i], "sk-user")

    threads = [threading.Thread(target=send, args=(i,)) for i in range(len(bodies))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert [a[0] for a in answers] == [200] * len(bodies)
    assert [events(a[2]) for a in answers] == expected


def test_a_legacy_completion_equals_the_runtimes_own(stack):
    body = {"model": "tiny", "prompt": "the cat", "max_tokens": 12, "seed": 0}
    (direct_status, _, direct), (status, _, through) = both(stack, "/v1/completions", body)
    assert (status, direct_status) == (200, 200)
    assert stable(json.loads(through)) == stable(json.loads(direct))
    assert json.loads(direct)["usage"]["prompt_tokens"] == json.loads(through)["usage"]["prompt_tokens"]


def test_embeddings_equal_the_runtimes_own_one_vector_per_input(stack):
    body = {"model": "tiny", "input": ["the cat", "sat on the mat"]}
    (direct_status, _, direct), (status, _, through) = both(stack, "/v1/embeddings", body)
    assert (status, direct_status) == (200, 200)
    assert stable(json.loads(through)) == stable(json.loads(direct))
    assert len(json.loads(through)["data"]) == 2


def test_a_context_length_error_is_the_runtimes_own_status_body_and_code(stack):
    body = {"model": "tiny", "messages": messages("x" * 600), "max_tokens": 20}
    (direct_status, _, direct), (status, _, through) = both(stack, "/v1/chat/completions", body)
    assert direct_status == 400 and json.loads(direct)["error"]["code"] == "context_length_exceeded"
    assert (status, json.loads(through)) == (direct_status, json.loads(direct))


# --- a runtime that is not up yet, and one that restarts ---------------------------------------


class Background:
    """A request sent on a thread: it waits in the gateway's queue while the test acts."""

    def __init__(self, url: str, body: dict[str, Any]) -> None:
        self.answer: tuple[int, dict[str, str], bytes] | None = None
        self._thread = threading.Thread(target=self._send, args=(url, body), daemon=True)
        self._thread.start()

    def _send(self, url: str, body: dict[str, Any]) -> None:
        self.answer = post(url, "/v1/chat/completions", body, "sk-user", timeout=90)

    def result(self, timeout: float = 60.0) -> tuple[int, dict[str, str], bytes]:
        self._thread.join(timeout)
        assert self.answer is not None, "the request did not end in time"
        return self.answer


def test_requests_sent_before_the_runtime_is_up_and_while_it_restarts_wait_then_succeed(logs, model):
    keys = logs / "keys-restart.yaml"
    keys.write_text(KEYS)
    port = free_port()
    body = {"model": "tiny", "messages": messages("hello"), "max_tokens": 8, "seed": 5}
    children: list[Any] = []
    try:
        gateway = Gateway(logs, api_keys=keys, admin_key="sk-admin", name="gateway-restart",
                          extra=["--queue-timeout", "60"])
        children.append(gateway)
        # The runtime is not there yet: the engine registers with its model not ready.
        engine = Engine(logs, gateway, "late-engine", ["tiny"], runtime="openai",
                        upstream=f"http://127.0.0.1:{port}", key="ek-default", models_ready=False)
        children.append(engine)
        models = gateway.engines()["late-engine"]["models"]
        assert [(m["id"], m["ready"]) for m in models] == [("tiny", False)]
        early = [Background(gateway.url, body) for _ in range(2)]
        wait_until(lambda: sum(len(v) for v in gateway.status()["waiting"].get("default", {}).values()) == 2,
                   "both requests to wait in the queue", [gateway.child, engine.child])

        llama = LlamaServer(model, logs, port=port, name="llama-late")
        children.append(llama)
        expected = post(llama.url, "/v1/chat/completions", body, None)
        assert expected[0] == 200
        for request in early:
            status, _, answer = request.result()
            assert status == 200 and stable(json.loads(answer)) == stable(json.loads(expected[2]))

        # The runtime dies; requests sent meanwhile wait until it is back on the same port.
        llama.stop()
        wait_until(lambda: not gateway.engines()["late-engine"]["models"][0]["ready"],
                   "the engine to report its model not ready", [gateway.child, engine.child])
        during = [Background(gateway.url, body) for _ in range(2)]
        wait_until(lambda: sum(len(v) for v in gateway.status()["waiting"].get("default", {}).values()) == 2,
                   "the requests to wait while the runtime is down", [gateway.child, engine.child])
        children.append(LlamaServer(model, logs, port=port, name="llama-restarted"))
        for request in during:
            status, _, answer = request.result()
            assert status == 200 and stable(json.loads(answer)) == stable(json.loads(expected[2]))
    finally:
        for child in reversed(children):
            child.stop()
