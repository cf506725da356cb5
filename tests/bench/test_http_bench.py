"""tools/bench/http_bench.py: one JSON row per case from a real run, and the pieces it trusts.

The load generator's response reader decides what counts as a finished
request and a relayed event, and the echo server is the baseline the
gateway is compared with, so both are pinned down here too.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from protocol.agent.echo import EchoConfig, echo_task
from protocol.openai.requests import parse_chat_completion
from protocol.pb import worker_pb2

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "tools" / "bench"
NON_STREAM_CASES = {f"{target}_c{c}" for target in ("direct", "agent", "builtin") for c in (1, 32)}
STREAM_CASES = {"direct_stream", "agent_stream", "builtin_stream"}


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses resolve their module by name
    spec.loader.exec_module(module)
    return module


http_load = _load("http_load")
http_echo_server = _load("http_echo_server")


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
        if row["target"] != "direct" and row["case"] not in STREAM_CASES:
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
