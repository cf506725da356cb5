"""tools/bench/http_bench.py: one JSON row per case from a real run, and the pieces it trusts.

The load generator's response reader decides what counts as a finished
request and a relayed event, its CPU reading what each target costs, and
the two runtimes are the baselines the gateways are compared with, so all
are pinned down here too. The peers (LiteLLM, sglang-router,
vllm-router) are never installed by the suite: only the command lines
``peers.py`` starts them with are checked.
"""

from __future__ import annotations

import http.client
import importlib.util
import json
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path
from types import ModuleType
from typing import IO, Iterator

import pytest
import yaml

import pytest

from protocol.agent.echo import EchoConfig, echo_task
from protocol.openai.requests import parse_chat_completion
from protocol.pb import worker_pb2

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "tools" / "bench"
TARGETS = ("direct-echo", "direct-starlette", "agent-echo", "agent-starlette", "url-echo", "url-starlette", "builtin")
NON_STREAM_CASES = {f"{target}_c{c}" for target in TARGETS for c in (1, 32)}
STREAM_CASES = {f"{target}_stream" for target in TARGETS}


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses resolve their module by name
    spec.loader.exec_module(module)
    return module


http_load = _load("http_load")
http_echo_server = _load("http_echo_server")
peers = _load("peers")


def _number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0


@pytest.mark.slow
@pytest.mark.e2e
def test_quick_json_run_reports_every_case_with_rates_latencies_and_ratios_to_direct() -> None:
    result = subprocess.run(
        [sys.executable, str(BENCH / "http_bench.py"), "--quick", "--json", "--duration", "0.25"],
        # Generous: on a loaded machine each case may wait for its first answer (http_bench.PATIENCE_S).
        cwd=ROOT, capture_output=True, text=True, timeout=150,
    )
    assert result.returncode == 0, result.stderr
    rows = [json.loads(line) for line in result.stdout.splitlines()]
    assert sorted(row["case"] for row in rows) == sorted(NON_STREAM_CASES | STREAM_CASES)
    for row in rows:
        assert row["runs"] == 1, row
        assert row["case"].startswith(row["target"] + "_"), row
        if row["case"] in STREAM_CASES:
            assert "rps" not in row and row["events_per_s"] > 0, row
            # A stream may outlast the short window, so its latency may be unknown.
            assert row["p50_ms"] is None or _number(row["p50_ms"]), row
        else:
            assert "events_per_s" not in row and row["rps"] > 0, row
            assert 0 < row["p50_ms"] <= row["p99_ms"], row
            assert row["concurrency"] == int(row["case"].rsplit("_c", 1)[1]), row
        # A target is its kind, or its kind before a runtime (kinds may hold a dash: url-workers).
        assert row["target"] in (row["kind"], f"{row['kind']}-{row.get('runtime')}"), row
        if row["kind"] != "direct" and row["case"] not in STREAM_CASES:
            assert row["rps_ratio"] > 0 and row["p50_ratio"] > 0, row
            assert isinstance(row["p50_overhead_ms"], float), row
        assert _number(row["client_cpu"]), row
        # CPU shares come from /proc; a process idle at 10 ms tick granularity reads as 0.
        assert row["server_cpu"] is None or _number(row["server_cpu"]), row
        assert row["per_server_cpu_s"] is None or row["per_server_cpu_s"] > 0, row


def _chunked(*chunks: bytes) -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(c), c) for c in chunks) + b"0\r\n\r\n"


def test_reader_counts_sse_events_of_a_chunked_stream_fed_one_byte_at_a_time() -> None:
    events = [b"data: {\"n\": %d}\n\n" % i for i in range(5)] + [b"data: [DONE]\n\n"]
    # Event boundaries fall inside chunks and across them.
    body = b"".join(events)
    response = (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
                + _chunked(body[:7], body[7:40], body[40:]))
    reader = http_load.ResponseReader()
    total, finished = 0, []
    for i in range(len(response)):
        done, status, count = reader.feed(response[i:i + 1])
        total += count
        finished.append(done)
    assert total == len(events)
    assert finished[-1] and not any(finished[:-1])
    assert status == 200


def test_reader_ends_a_content_length_response_and_keeps_the_next_ones_bytes() -> None:
    first = b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 5\r\n\r\nbusy!"
    second = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}"
    reader = http_load.ResponseReader()
    assert reader.feed(first + second[:10]) == (True, 503, 0)
    reader.reset()
    assert reader.feed(second[10:]) == (True, 200, 0)


def test_a_window_with_nothing_measured_stays_open_for_the_first_measurement_then_ends_there() -> None:
    stats = http_load.Stats(start=10.0, end=11.0, ceiling=20.0)
    assert not stats.measures(9.9)
    assert stats.measures(10.5) and stats.end == 11.0  # inside the window: it keeps its end
    assert stats.is_open(12.0)  # nothing counted yet: the clients keep sending
    assert stats.measures(13.0) and stats.end == 13.0 and stats.extended.is_set()
    stats.events += 1
    assert not stats.measures(13.1) and not stats.is_open(13.1)


def test_a_window_with_something_measured_or_past_its_ceiling_does_not_grow() -> None:
    busy = http_load.Stats(start=10.0, end=11.0, ceiling=20.0)
    busy.latencies.append(0.1)
    assert not busy.measures(12.0) and busy.end == 11.0 and not busy.is_open(12.0)
    empty = http_load.Stats(start=10.0, end=11.0, ceiling=20.0)
    assert not empty.measures(20.5) and empty.end == 11.0 and not empty.extended.is_set()
    assert not empty.is_open(20.5)


def test_percentile_is_nearest_rank() -> None:
    values = [float(i) for i in range(1, 101)]
    assert http_load.percentile(values, 0.5) == 50.0
    assert http_load.percentile(values, 0.99) == 99.0
    assert http_load.percentile([], 0.5) is None


def test_echo_server_answers_like_the_builtin_echo_engine() -> None:
    """The baseline's body has the built-in engine's shape and content, so both targets move the same bytes."""
    request = {"model": "echo", "messages": [{"role": "system", "content": "be brief"},
                                             {"role": "user", "content": "  hello there world"}]}
    content_type, body = http_echo_server.chat_answer(request, 1)
    ours = json.loads(body)
    task = worker_pb2.Task(id="t")
    task.request.chat_completion.CopyFrom(parse_chat_completion(json.dumps(request).encode()).request.chat_completion)
    builtin = json.loads(echo_task(task, EchoConfig(token_delay=0.0), 0.0)[0].result.http_response.body)
    assert content_type == b"application/json"
    for answer in (ours, builtin):
        answer.pop("id")
        answer.pop("created")
    assert ours == builtin


def test_echo_server_streams_one_event_per_word_then_done() -> None:
    content_type, body = http_echo_server.chat_answer(
        {"model": "echo", "stream": True, "messages": [{"role": "user", "content": "a b c"}]}, 1)
    events = body.split(b"\n\n")[:-1]
    assert content_type == b"text/event-stream"
    assert len(events) == 3 + 3 and events[-1] == b"data: [DONE]"
    words = [json.loads(e[len(b"data: "):])["choices"][0]["delta"].get("content") for e in events[1:-2]]
    assert words == ["a ", "b ", "c"]


def test_sglang_router_command_line_is_its_module_launcher_on_loopback_with_its_metrics_port_beside() -> None:
    argv = peers.sglang_router_argv(Path("/v/bin"), 3000, 3001, ["http://127.0.0.1:8000", "http://127.0.0.1:8001"],
                                    "cache_aware")
    assert argv == ["/v/bin/python", "-m", "sglang_router.launch_router",
                    "--host", "127.0.0.1", "--port", "3000",
                    "--worker-urls", "http://127.0.0.1:8000", "http://127.0.0.1:8001",
                    "--policy", "cache_aware",
                    "--prometheus-host", "127.0.0.1", "--prometheus-port", "3001",
                    "--worker-startup-check-interval", "1"]


def test_vllm_router_command_line_names_its_policy_workers_and_loopback_ports() -> None:
    argv = peers.vllm_router_argv(Path("/v/bin"), 3000, 3001, ["http://127.0.0.1:8000"], "consistent_hash")
    assert argv == ["/v/bin/vllm-router", "--host", "127.0.0.1", "--port", "3000",
                    "--worker-urls", "http://127.0.0.1:8000", "--policy", "consistent_hash",
                    "--prometheus-host", "127.0.0.1", "--prometheus-port", "3001",
                    "--worker-startup-check-interval", "1"]
    assert peers.SESSION_HEADER == "x-session-id"


@pytest.mark.parametrize("build, policy, urls, complaint", [
    (peers.sglang_router_argv, "consistent_hash", ["http://a:1"], "one of round_robin, cache_aware, power_of_two"),
    (peers.vllm_router_argv, "power_of_two", ["http://a:1"], "one of round_robin, cache_aware, consistent_hash"),
    (peers.sglang_router_argv, "power_of_two", ["http://a:1"], "fewer than 2 workers"),
    (peers.vllm_router_argv, "round_robin", [], "at least one runtime URL"),
    (peers.sglang_router_argv, "round_robin", ["127.0.0.1:8000"], "http:// or https://: 127.0.0.1:8000"),
])
def test_a_router_command_line_refuses_what_the_router_would_refuse_or_misread(build, policy, urls,
                                                                              complaint) -> None:
    with pytest.raises(ValueError, match=complaint):
        build(Path("/v/bin"), 3000, 3001, urls, policy)


def test_litellm_serves_the_model_from_every_runtime_under_one_name_without_telemetry() -> None:
    config = yaml.safe_load(peers.litellm_config("echo", ["http://127.0.0.1:8000/", "http://127.0.0.1:8001"]))
    assert config == {
        "model_list": [
            {"model_name": "echo", "litellm_params": {"model": "openai/echo", "api_key": "none",
                                                      "api_base": "http://127.0.0.1:8000/v1"}},
            {"model_name": "echo", "litellm_params": {"model": "openai/echo", "api_key": "none",
                                                      "api_base": "http://127.0.0.1:8001/v1"}},
        ],
        "litellm_settings": {"telemetry": False},
    }
    assert peers.litellm_argv(Path("/v/bin"), Path("/tmp/l.yaml"), 3000) == [
        "/v/bin/litellm", "--config", "/tmp/l.yaml", "--host", "127.0.0.1", "--port", "3000", "--num_workers", "1"]
    assert peers.LITELLM_ENV["LITELLM_LOCAL_MODEL_COST_MAP"] == "True"


def test_every_peer_is_pinned_to_one_release_in_a_venv_git_ignores() -> None:
    ignored = (ROOT / ".gitignore").read_text().splitlines()
    for package in (peers.LITELLM, peers.SGLANG_ROUTER, peers.VLLM_ROUTER):
        assert package.requirement.endswith(f"=={package.version}"), package
        # Without a trailing slash: a venv shared from another checkout by a symlink is ignored too.
        assert f"{package.venv.relative_to(ROOT)}" in ignored, package


def _port_reporting(*args: str) -> Iterator[int]:
    """A bench script that prints the port it serves on and ends when its stdin closes: the port,
    then its clean end."""
    process = subprocess.Popen([sys.executable, *args], cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    stdout: IO[bytes] = process.stdout  # type: ignore[assignment]
    try:
        yield int(stdout.readline())
    finally:
        stdin: IO[bytes] = process.stdin  # type: ignore[assignment]
        stdin.close()
        assert process.wait(timeout=30) == 0
        stdout.close()


@pytest.fixture
def starlette_runtime() -> Iterator[int]:
    yield from _port_reporting(str(BENCH / "starlette_runtime.py"))


def _exchange(port: int, request: bytes) -> bytes:
    """One request on a fresh connection that the server closes after answering; the raw answer."""
    with socket.create_connection(("127.0.0.1", port)) as connection:
        connection.sendall(request)
        answer = b""
        while chunk := connection.recv(65536):
            answer += chunk
    return answer


def _post(port: int, body: dict[str, object]) -> tuple[bytes, bytes]:
    data = json.dumps(body).encode()
    head, _, rest = _exchange(port, b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                              b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(data), data)
                              ).partition(b"\r\n\r\n")
    return head, rest


def _without_id(body: bytes) -> dict[str, object]:
    answer = json.loads(body)
    answer.pop("id")
    answer.pop("created")
    return answer


def test_starlette_runtime_answers_what_the_echo_server_answers(starlette_runtime: int) -> None:
    request = {"model": "echo", "messages": [{"role": "system", "content": "be brief"},
                                             {"role": "user", "content": "hello there"}]}
    head, body = _post(starlette_runtime, request)
    assert head.startswith(b"HTTP/1.1 200") and b"content-type: application/json" in head.lower()
    assert _without_id(body) == _without_id(http_echo_server.chat_answer(request, 1)[1])
    health = _exchange(starlette_runtime, b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    models = _exchange(starlette_runtime, b"GET /v1/models HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    assert health.startswith(b"HTTP/1.1 200")
    assert [m["id"] for m in json.loads(models.partition(b"\r\n\r\n")[2])["data"]] == ["echo"]
    bad = _exchange(starlette_runtime, b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                    b"Content-Length: 5\r\n\r\n{nope")
    assert bad.startswith(b"HTTP/1.1 400") and b"bad JSON" in bad


def test_starlette_runtime_streams_each_word_in_its_own_chunk_as_real_runtimes_do(starlette_runtime: int) -> None:
    request = {"model": "echo", "stream": True, "messages": [{"role": "user", "content": "a b c d"}]}
    head, body = _post(starlette_runtime, request)
    assert b"transfer-encoding: chunked" in head.lower() and b"text/event-stream" in head.lower()
    chunks = []
    while True:
        size_line, _, body = body.partition(b"\r\n")
        size = int(size_line, 16)
        if size == 0:
            break
        chunks.append(body[:size])
        body = body[size + 2:]
    expected = http_echo_server.chat_events(request, 1)
    assert len(chunks) == len(expected) == 4 + 3
    assert [_without_id(c[len(b"data: "):]) for c in chunks[:-1]] == [
        _without_id(e[len(b"data: "):]) for e in expected[:-1]]
    assert chunks[-1] == expected[-1] == b"data: [DONE]\n\n"


def test_echo_server_answers_health_checks_as_the_routers_need() -> None:
    protocol = http_echo_server.EchoProtocol()
    assert protocol._answer(b"GET", b"/health", b"", False).startswith(b"HTTP/1.1 200 OK\r\n")
    assert protocol._answer(b"GET", b"/other", b"", False).startswith(b"HTTP/1.1 404")


def test_cpu_reading_covers_every_thread_and_child_process_of_a_watched_process() -> None:
    """A router works on its worker threads: the main thread's schedstat alone would read it as idle."""
    stop = threading.Event()
    worker = threading.Thread(target=stop.wait)
    worker.start()
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        threads = http_load.process_sched(os.getpid())
        assert threads is not None
        assert {os.getpid(), worker.native_id, child.pid} <= set(threads)
        assert all(ran >= 0 and waited >= 0 for ran, waited in threads.values())
    finally:
        stop.set()
        worker.join()
        child.communicate(b"")
    assert http_load.process_sched(child.pid) is None  # gone: unreadable, not zero


def test_cpu_span_counts_threads_born_in_the_window_whole_and_ignores_those_that_ended() -> None:
    start = {1: (10.0, 1.0), 2: (5.0, 0.5)}
    end = {1: (12.5, 1.25), 3: (0.75, 0.25)}  # thread 2 ended, thread 3 began
    assert http_load.sched_span(start, end) == (3.25, 0.5)
    assert http_load.sched_span(None, end) is None and http_load.sched_span(start, None) is None


def _overview_row(target: str, kind: str, c32_cpu: float, c1_cpu: float, c1_added: float) -> dict[str, object]:
    return {"target": target, "kind": kind, "runtime": "echo", "c1_p50_added_ms": c1_added, "c32_rps": 1000.0,
            "events_per_s": 1000.0, "c32_cpu_ms_per_request": c32_cpu, "c1_cpu_ms_per_request": c1_cpu}


@pytest.fixture
def floor(starlette_runtime: int) -> Iterator[int]:
    yield from _port_reporting(str(BENCH / "proxy_floor.py"), "--upstream", f"http://127.0.0.1:{starlette_runtime}")


def test_the_floor_relays_the_runtimes_answers_and_streams_as_they_are_over_one_kept_connection(
        starlette_runtime: int, floor: int) -> None:
    request = {"model": "echo", "messages": [{"role": "user", "content": "hello there"}]}
    streamed = {"model": "echo", "stream": True, "messages": [{"role": "user", "content": "a b c d"}]}
    connection = http.client.HTTPConnection("127.0.0.1", floor, timeout=30)
    answers = []
    for body in (request, streamed, request):
        connection.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
        response = connection.getresponse()
        answers.append((response.status, response.getheader("content-type"), response.read()))
    connection.close()
    assert [(status, kind) for status, kind, _ in answers] == [
        (200, "application/json"), (200, "text/event-stream; charset=utf-8"), (200, "application/json")]
    assert _without_id(answers[0][2]) == _without_id(answers[2][2]) == _without_id(
        _post(starlette_runtime, request)[1])
    events = answers[1][2].split(b"\n\n")
    assert events[-2:] == [b"data: [DONE]", b""] and len(events) == 4 + 3 + 1
    bad = _exchange(floor, b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                    b"Content-Length: 5\r\n\r\n{nope")
    assert bad.startswith(b"HTTP/1.1 400") and b"bad JSON" in bad


@pytest.fixture
def floor_chores(starlette_runtime: int, tmp_path: Path) -> Iterator[tuple[int, Path]]:
    log = tmp_path / "requests.log"
    for port in _port_reporting(str(BENCH / "proxy_floor.py"), "--upstream", f"http://127.0.0.1:{starlette_runtime}",
                                "--chores", str(log)):
        yield port, log


def test_the_floor_with_chores_relays_the_same_answers_and_logs_and_counts_each_request(
        starlette_runtime: int, floor_chores: tuple[int, Path]) -> None:
    port, log = floor_chores
    request = {"model": "echo", "messages": [{"role": "user", "content": "hello there"}]}
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    answers = []
    for body in (json.dumps(request), json.dumps({**request, "stream": True}), "{nope"):
        connection.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
        response = connection.getresponse()
        answers.append((response.status, response.read()))
    connection.close()
    assert [status for status, _ in answers] == [200, 200, 400]
    assert _without_id(answers[0][1]) == _without_id(_post(starlette_runtime, request)[1])
    assert answers[1][1].endswith(b"data: [DONE]\n\n")
    lines = log.read_text().splitlines()
    assert [line.split("] ", 1)[1].rsplit(" latency=", 1)[0] for line in lines] == [
        "request model='echo' status=200", "request model='echo' status=200", "request model='-' status=400"]


def test_verdicts_compare_infx_by_url_with_the_best_router_and_the_dial_in_path_with_the_baseline_tree() -> None:
    http_bench = _load("http_bench")
    lines = http_bench.verdicts([
        _overview_row("agent-echo", "agent", 0.6, 1.0, 1.5), _overview_row("base-echo", "base", 1.2, 1.4, 1.9),
        _overview_row("url-echo", "url", 0.3, 0.5, 0.5), _overview_row("vllm-echo", "vllm", 0.1, 0.2, 0.2),
    ])
    assert "dial-in path CPU per request at c=32: 0.600 ms, the --baseline tree's 1.200 ms = 0.50x " \
           "(target <= 0.6x) -> met" in "\n".join(lines)
    assert "dial-in path CPU per request at c=1: 1.000 ms, the --baseline tree's 1.400 ms = 0.71x " \
           "(target <= 0.6x) -> MISSED" in "\n".join(lines)
    assert any("infx by URL 0.300 ms = 3.0x (target for infx by URL: <= 2x) -> MISSED" in line for line in lines)
    assert any("c=1 p50 added: best Rust router 0.200 ms (vllm-echo); infx by URL 0.500 ms" in line for line in lines)


def test_verdicts_hold_url_workers_to_the_best_routers_rates_and_show_the_floor_beside() -> None:
    http_bench = _load("http_bench")
    workers = {**_overview_row("url-workers-echo", "url-workers", 0.3, 0.5, 0.5), "c32_rps": 850.0,
               "events_per_s": 700.0}
    lines = "\n".join(http_bench.verdicts([workers, _overview_row("floor-echo", "floor", 0.05, 0.1, 0.1),
                                           _overview_row("floor-chores-echo", "floor-chores", 0.08, 0.1, 0.1),
                                           _overview_row("vllm-echo", "vllm", 0.1, 0.2, 0.2)]))
    assert "requests/s at c=32: best Rust router 1,000 (vllm-echo); infx by URL, --workers 2 850 = 0.85x " \
           "(target with --workers 2: >= 0.8x) -> met" in lines
    assert "relayed events/s: best Rust router 1,000 (vllm-echo); infx by URL, --workers 2 700 = 0.70x " \
           "(target with --workers 2: >= 0.8x) -> MISSED" in lines
    assert "CPU per request at c=32: best Rust router 0.100 ms (vllm-echo); the floor (proxy_floor.py) 0.050 ms" in lines
    assert "CPU per request at c=32: best Rust router 0.100 ms (vllm-echo); the floor with a gateway's chores " \
           "(proxy_floor.py --chores) 0.080 ms" in lines


def test_verdicts_set_the_by_url_path_beside_the_baseline_trees() -> None:
    http_bench = _load("http_bench")
    lines = "\n".join(http_bench.verdicts([_overview_row("url-echo", "url", 0.3, 0.45, 0.5),
                                           _overview_row("base-url-echo", "base-url", 0.4, 0.5, 0.6)]))
    assert "[echo] by-URL path CPU per request at c=32: 0.300 ms, the --baseline tree's 0.400 ms = 0.75x" in lines
    assert "[echo] by-URL path CPU per request at c=1: 0.450 ms, the --baseline tree's 0.500 ms = 0.90x" in lines
