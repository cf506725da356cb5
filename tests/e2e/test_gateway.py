"""End to end: real ``twistd -n infx`` and ``twistd -n infx-engine`` processes, driven by the ``openai`` client.

One gateway with an API key file serves two engine processes: the built-in
``echo`` runtime, and the ``openai`` runtime pointed at
:class:`harness.fake_openai_server.FakeOpenAIServer`. The shutdown test runs
its own gateway, since it ends it with SIGTERM.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from harness.fake_openai_server import FakeOpenAIServer
from harness.llmariner_engine import LLMarinerEngine
from harness.twistd_processes import Engine, Gateway, wait_until

#: A gateway, its engines and a fake runtime start once per module (about 30 s on 2 busy cores).
pytestmark = pytest.mark.slow

KEYS = """
keys:
  - {key: sk-admin, tenant: default, admin: true}
  - {key: sk-limited, tenant: default, rate_limit: {rate: 0.01, burst: 1}}
engine_keys:
  - {key: ek-default, tenant: default}
"""


@pytest.fixture(scope="module")
def upstream() -> Iterator[FakeOpenAIServer]:
    server = FakeOpenAIServer()
    yield server
    server.close()


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory, upstream: FakeOpenAIServer) -> Iterator[Gateway]:
    logs = tmp_path_factory.mktemp("e2e")
    keys = logs / "keys.yaml"
    keys.write_text(KEYS)
    gateway = Gateway(logs, api_keys=keys, admin_key="sk-admin")
    children: list[Gateway | Engine] = [gateway]
    try:
        children.append(Engine(logs, gateway, "echo-engine", ["echo", "echo-2"], key="ek-default"))
        # A trailing /v1 on --upstream is accepted, as users copy it from their runtime's docs.
        children.append(Engine(logs, gateway, "upstream-engine", ["upstream-llm"], runtime="openai",
                               upstream=upstream.url + "/v1", key="ek-default"))
        yield gateway
    finally:
        for child in reversed(children):
            child.stop()


def client(gateway: Gateway, key: str = "sk-admin") -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway.base_url, api_key=key, max_retries=0, timeout=10)


# --- the echo runtime -------------------------------------------------------------


def test_models_list_shows_every_ready_model(gateway: Gateway) -> None:
    assert sorted(m.id for m in client(gateway).models.list()) == ["echo", "echo-2", "upstream-llm"]
    assert client(gateway).models.retrieve("echo-2").id == "echo-2"


def test_chat_completion_not_streamed(gateway: Gateway) -> None:
    reply = client(gateway).chat.completions.create(
        model="echo", messages=[{"role": "user", "content": "the quick brown fox"}])
    assert reply.choices[0].message.content == "the quick brown fox"
    assert reply.choices[0].finish_reason == "stop"
    assert reply.usage is not None and reply.usage.completion_tokens == 4


def test_chat_completion_streamed_with_usage(gateway: Gateway) -> None:
    chunks = list(client(gateway).chat.completions.create(
        model="echo", stream=True, stream_options={"include_usage": True},
        messages=[{"role": "user", "content": "jumps over the lazy dog"}]))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "jumps over the lazy dog"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 5


def test_completion_not_streamed(gateway: Gateway) -> None:
    reply = client(gateway).completions.create(model="echo", prompt="say this back")
    assert reply.object == "text_completion"
    assert reply.choices[0].text == "say this back"


def test_completion_streamed(gateway: Gateway) -> None:
    chunks = list(client(gateway).completions.create(model="echo-2", prompt="say this back", stream=True))
    assert all(c.object == "text_completion" for c in chunks)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == "say this back"


def test_embeddings_are_unit_vectors_one_per_input(gateway: Gateway) -> None:
    result = client(gateway).embeddings.create(model="echo", input=["a", "b"], dimensions=8)
    assert [d.index for d in result.data] == [0, 1]
    for item in result.data:
        assert len(item.embedding) == 8
        assert sum(x * x for x in item.embedding) == pytest.approx(1.0)


def test_invalid_request_is_a_bad_request_error_naming_the_parameter(gateway: Gateway) -> None:
    with pytest.raises(openai.BadRequestError) as raised:
        client(gateway).chat.completions.create(model="echo", messages=[])
    assert raised.value.param == "messages"


def test_an_engines_own_400_is_a_bad_request_error(gateway: Gateway) -> None:
    with pytest.raises(openai.BadRequestError, match="dimensions"):
        client(gateway).embeddings.create(model="echo", input="a", dimensions=10_000_000)


def test_unknown_model_is_a_not_found_error(gateway: Gateway) -> None:
    with pytest.raises(openai.NotFoundError) as raised:
        client(gateway).chat.completions.create(model="gpt-nope", messages=[{"role": "user", "content": "x"}])
    assert raised.value.code == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        client(gateway).models.retrieve("gpt-nope")


def test_unknown_api_key_is_an_authentication_error(gateway: Gateway) -> None:
    with pytest.raises(openai.AuthenticationError):
        client(gateway, "sk-wrong").chat.completions.create(model="echo", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.AuthenticationError):
        client(gateway, "sk-wrong").models.list()


def test_key_over_its_rate_limit_gets_a_rate_limit_error(gateway: Gateway) -> None:
    limited = client(gateway, "sk-limited")
    limited.chat.completions.create(model="echo", messages=[{"role": "user", "content": "first"}])
    with pytest.raises(openai.RateLimitError) as raised:
        limited.chat.completions.create(model="echo", messages=[{"role": "user", "content": "second"}])
    assert int(raised.value.response.headers["retry-after"]) >= 1


# --- the openai runtime -------------------------------------------------------------


def test_openai_runtime_relays_a_chat_answer_and_forwards_no_credentials(
    gateway: Gateway, upstream: FakeOpenAIServer,
) -> None:
    reply = client(gateway).chat.completions.create(
        model="upstream-llm", messages=[{"role": "user", "content": "hello runtime"}], extra_headers={"x-trace": "t1"})
    assert reply.choices[0].message.content == "upstream: hello runtime"
    request = upstream.requests[-1]
    assert request.path == "/v1/chat/completions"
    assert request.body["model"] == "upstream-llm" and not request.body.get("stream")
    assert request.body["messages"][-1]["role"] == "user"
    assert request.headers["x-trace"] == "t1"
    assert "authorization" not in request.headers


def test_openai_runtime_relays_a_streamed_answer_event_by_event(
    gateway: Gateway, upstream: FakeOpenAIServer,
) -> None:
    stream = client(gateway).chat.completions.create(
        model="upstream-llm", stream=True, messages=[{"role": "user", "content": "stream this please"}])
    assert [c.choices[0].delta.content for c in stream] == ["upstream:", " stream", " this", " please"]
    assert upstream.requests[-1].body["stream"] is True


def test_openai_runtime_relays_embeddings(gateway: Gateway, upstream: FakeOpenAIServer) -> None:
    result = client(gateway).embeddings.create(model="upstream-llm", input=["x", "y"])
    assert [d.embedding for d in result.data] == [[0.0, 0.5], [1.0, 0.5]]
    assert upstream.requests[-1].path == "/v1/embeddings"


def test_openai_runtime_relays_the_upstreams_error_as_the_matching_openai_error(gateway: Gateway) -> None:
    with pytest.raises(openai.BadRequestError, match="upstream refused the request"):
        client(gateway).chat.completions.create(
            model="upstream-llm", messages=[{"role": "user", "content": "fail with 400"}])
    gateway.wait_until_idle()


# --- graceful shutdown -----------------------------------------------------------


def test_sigterm_turns_unready_sends_go_away_and_lets_a_stream_finish_before_exit(tmp_path: Path) -> None:
    gateway = Gateway(tmp_path, extra=["--grace-period", "20"], name="draining-gateway")
    echo = observer = None
    try:
        echo = Engine(tmp_path, gateway, "slow-echo", ["echo"], token_delay=0.1)
        observer = LLMarinerEngine(gateway.worker_address, "observer", ["other"])
        gateway.wait_for_engine("observer")
        words = [f"w{i}" for i in range(25)]
        stream = iter(client(gateway).chat.completions.create(
            model="echo", stream=True, messages=[{"role": "user", "content": " ".join(words)}]))
        received = [next(stream).choices[0].delta.content or "" for _ in range(3)]

        gateway.child.signal(signal.SIGTERM)
        wait_until(lambda: gateway.readyz() == 503, "/readyz to turn 503", [gateway.child])
        go_away = observer.wait_for_task(lambda t: t.request.HasField("go_away"))
        assert go_away.engine_id == "observer"
        assert gateway.child.alive

        received += [c.choices[0].delta.content or "" for c in stream if c.choices]
        assert "".join(received) == " ".join(words)
        # The drain ends with the last request, before the 20 s grace period.
        code = gateway.child.wait(timeout=15)
        assert code in (0, -signal.SIGTERM), gateway.child.output()
        assert "Traceback" not in gateway.child.output()
    finally:
        if observer is not None:
            observer.close()
        if echo is not None:
            echo.stop()
        gateway.stop()


def test_sigterm_with_a_request_outlasting_the_grace_period_still_exits_and_cuts_that_request(
    tmp_path: Path,
) -> None:
    gateway = Gateway(tmp_path, extra=["--grace-period", "1"], name="impatient-gateway")
    echo = None
    try:
        echo = Engine(tmp_path, gateway, "slower-echo", ["echo"], token_delay=0.3)
        words = [f"w{i}" for i in range(30)]
        stream = iter(client(gateway).chat.completions.create(
            model="echo", stream=True, messages=[{"role": "user", "content": " ".join(words)}]))
        received = [next(stream).choices[0].delta.content or "" for _ in range(2)]
        gateway.child.signal(signal.SIGTERM)
        with pytest.raises(openai.APIError):
            received += [c.choices[0].delta.content or "" for c in stream if c.choices]
        assert len(received) < len(words)
        # The 9 s left of the stream do not hold the process past its 1 s grace period.
        assert gateway.child.wait(timeout=5) in (0, -signal.SIGTERM)
        assert "1 requests still running after the grace period" in gateway.child.output()
    finally:
        if echo is not None:
            echo.stop()
        gateway.stop()
