"""Engine processes killed (SIGKILL) under load: what the client sees, and that nothing is left in flight.

The gateway and the engines are real ``twistd`` processes; routing is
deterministic (equal load goes to the lowest engine id), so each test knows
which engine gets its task and kills that one. The gateway's
``/admin/status`` dump is the witness that no task stays behind.
"""

from __future__ import annotations

import signal
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import openai
import pytest

from harness.twistd_processes import Engine, Gateway, wait_until


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    # A short queue timeout, so that a task left without any engine fails fast.
    gateway = Gateway(tmp_path_factory.mktemp("faults"), extra=["--queue-timeout", "2"])
    yield gateway
    gateway.stop()


@pytest.fixture
def engines(gateway: Gateway, tmp_path: Path) -> Iterator[Callable[..., Engine]]:
    """Starts echo engines serving model ``m``; kills them afterwards and waits until the gateway dropped them."""
    started: dict[str, Engine] = {}

    def start(engine_id: str, token_delay: float) -> Engine:
        started[engine_id] = Engine(tmp_path, gateway, engine_id, ["m"], token_delay=token_delay)
        return started[engine_id]

    yield start
    for engine in started.values():
        engine.stop()
    wait_until(lambda: not set(started) & set(gateway.engines()), "killed engines to be dropped", [gateway.child])


def assert_nothing_in_flight(gateway: Gateway) -> dict[str, Any]:
    status = gateway.wait_until_idle()
    assert status["waiting"] == {} and status["retry_pending"] == []
    for engine_id, engine in status["tenants"].get("default", {}).get("engines", {}).items():
        assert engine["tasks"] == [], engine_id
    assert "Traceback" not in gateway.child.output()
    return status


def tasks_on(gateway: Gateway, engine_id: str) -> list[str]:
    tasks: list[str] = gateway.engines().get(engine_id, {}).get("tasks", [])
    return tasks


def test_engine_killed_before_its_first_result_the_task_is_retried_on_another_engine(
    gateway: Gateway, engines: Callable[..., Engine],
) -> None:
    # Non-streamed echo answers come whole after the last token: 4 words x 5 s.
    doomed = engines("a-doomed", token_delay=5.0)
    engines("b-survivor", token_delay=0.0)
    client = openai.OpenAI(base_url=gateway.base_url, api_key="x", max_retries=0, timeout=20)
    with ThreadPoolExecutor(1) as pool:
        answer = pool.submit(client.chat.completions.create, model="m",
                             messages=[{"role": "user", "content": "survive the crash please"}])
        wait_until(lambda: tasks_on(gateway, "a-doomed"), "the task to reach a-doomed", [gateway.child])
        doomed.child.kill()
        reply = answer.result(timeout=20)
    assert reply.choices[0].message.content == "survive the crash please"
    status = assert_nothing_in_flight(gateway)
    assert "a-doomed" not in status["tenants"]["default"]["engines"]


def test_engine_killed_mid_stream_ends_the_clients_stream_with_an_explicit_error(
    gateway: Gateway, engines: Callable[..., Engine],
) -> None:
    streamer = engines("a-streamer", token_delay=0.2)
    engines("b-standby", token_delay=0.0)
    # A 1 s read timeout: the error must arrive within a second of the kill, not as a stall.
    client = openai.OpenAI(base_url=gateway.base_url, api_key="x", max_retries=0,
                           timeout=openai.Timeout(10.0, read=1.0))
    words = [f"word{i}" for i in range(30)]
    stream = iter(client.chat.completions.create(
        model="m", stream=True, messages=[{"role": "user", "content": " ".join(words)}]))
    received = [next(stream).choices[0].delta.content for _ in range(3)]
    assert received[1:] == ["word0 ", "word1 "]
    assert tasks_on(gateway, "a-streamer")

    streamer.child.kill()
    with pytest.raises(openai.APIError) as raised:
        for chunk in stream:
            received.append(chunk.choices[0].delta.content)
    # Not a timeout or a dropped connection: the gateway's own error event, in words a client can
    # act on (issue #22: it said "UNAVAILABLE Connection was closed cleanly. after the response started").
    assert type(raised.value) is openai.APIError and raised.value.code == "engine_lost"
    assert "went away before the response was complete" in raised.value.message
    assert "send the request again" in raised.value.message and "Connection" not in raised.value.message
    # What broke is the log's: the request line names the engine and what its stream said.
    line = wait_until(lambda: next((l for l in gateway.child.output().splitlines()
                                    if "[infx.request_log#info]" in l and "error=engine_lost" in l), None),
                      "the request's log line", [gateway.child])
    assert " status=502 " in line and "detail=\"engine 'a-streamer' removed: engine stream ended: UNAVAILABLE" in line
    assert len(received) < len(words) + 1
    status = assert_nothing_in_flight(gateway)
    # Once output has started, the task is not retried on the standby engine.
    assert set(status["tenants"]["default"]["engines"]) == {"b-standby"}


def test_only_engine_killed_before_its_first_result_the_client_gets_503_after_the_queue_timeout(
    gateway: Gateway, engines: Callable[..., Engine],
) -> None:
    lonely = engines("lonely", token_delay=5.0)
    client = openai.OpenAI(base_url=gateway.base_url, api_key="x", max_retries=0, timeout=20)
    with ThreadPoolExecutor(1) as pool:
        answer = pool.submit(client.chat.completions.create, model="m",
                             messages=[{"role": "user", "content": "nobody left"}])
        wait_until(lambda: tasks_on(gateway, "lonely"), "the task to reach the engine", [gateway.child])
        lonely.child.kill()
        with pytest.raises(openai.InternalServerError) as raised:
            answer.result(timeout=20)
    assert raised.value.status_code == 503 and "no ready engine serves model 'm'" in raised.value.message
    assert int(raised.value.response.headers["retry-after"]) >= 1
    assert_nothing_in_flight(gateway)


def test_engine_stopped_with_sigterm_finishes_its_stream_while_new_tasks_go_elsewhere(
    gateway: Gateway, engines: Callable[..., Engine],
) -> None:
    leaving = engines("a-leaving", token_delay=0.1)
    engines("b-staying", token_delay=0.0)
    client = openai.OpenAI(base_url=gateway.base_url, api_key="x", max_retries=0, timeout=10)
    words = [f"w{i}" for i in range(15)]
    stream = iter(client.chat.completions.create(
        model="m", stream=True, messages=[{"role": "user", "content": " ".join(words)}]))
    received = [next(stream).choices[0].delta.content or ""]
    leaving.child.signal(signal.SIGTERM)
    wait_until(lambda: not gateway.engines().get("a-leaving", {}).get("ready", False),
               "a-leaving to report not ready", [gateway.child])
    reply = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "elsewhere"}])
    assert reply.choices[0].message.content == "elsewhere"
    received += [c.choices[0].delta.content or "" for c in stream if c.choices]
    assert "".join(received) == " ".join(words)
    assert leaving.child.wait(timeout=10) in (0, -signal.SIGTERM)
    assert_nothing_in_flight(gateway)


def test_engine_reconnects_and_serves_again_after_the_gateway_is_killed_and_restarted(tmp_path: Path) -> None:
    first = Gateway(tmp_path, name="crashed-gateway")
    second = engine = None
    try:
        engine = Engine(tmp_path, first, "steadfast", ["m"])
        first.child.kill()
        second = Gateway(tmp_path, name="restarted-gateway", same_ports_as=first)
        # The engine agent's backoff starts at half a second; registration follows on its own.
        second.wait_for_engine("steadfast", children=[engine.child])
        # The agent says when it is in, first and again after the loss, before any task comes.
        said = engine.child.output()
        assert "engine steadfast: connected to the gateway (stream 1)" in said
        wait_until(lambda: "engine steadfast: reconnected to the gateway" in engine.child.output(),
                   "the agent's reconnect line", [engine.child])
        client = openai.OpenAI(base_url=second.base_url, api_key="x", max_retries=0, timeout=10)
        reply = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "back again"}])
        assert reply.choices[0].message.content == "back again"
        assert_nothing_in_flight(second)
    finally:
        for child in (engine, second, first):
            if child is not None:
                child.stop()
