"""tools/bench/open_streams.py: a small real run loses nothing, and its client's checks can fail.

The end-to-end run starts the real gateway (``twistd infx``), the paced
engine and the client processes at 200 streams, so the tool cannot rot;
its timing figures are not asserted (speed belongs to the tool). The
client's stream checker is what the loss check rests on, so it is fed
answers byte by byte here, correct and broken.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "tools" / "bench"
sys.path.insert(0, str(BENCH))

import open_streams_clients as clients  # noqa: E402


@pytest.mark.slow
@pytest.mark.e2e
def test_a_small_run_through_a_real_gateway_relays_every_token_in_order() -> None:
    process = subprocess.run(
        [sys.executable, str(BENCH / "open_streams.py"), "--streams", "200", "--engines", "1", "--clients", "2",
         "--ramp", "0.5", "--hold", "1", "--token-interval", "20-60", "--seconds", "90", "--json"],
        capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert process.returncode == 0, process.stderr[-3000:] + process.stdout[-3000:]
    out = json.loads(process.stdout.strip().splitlines()[-1])
    assert out["failures"] == {} and out["completed"] == 200
    assert out["tokens"] > 0 and out["latency_samples"] > 0
    assert out["peak_open_streams"] > 0 and "kib_per_stream" in out and "gateway_cpu" in out


def _event(data: dict[str, object] | str) -> bytes:
    # Compact JSON, as the engine writes it (the client looks for its exact bytes).
    text = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return b"data: " + text.encode() + b"\n\n"


def _token(i: int) -> bytes:
    return _event({"choices": [{"delta": {"content": f"t{i}@1.000000"}}]})


def _answer(tokens: list[int], reported: int, done: bool = True) -> bytes:
    events = [_event({"choices": [{"delta": {"role": "assistant", "content": ""}}]})]
    events += [_token(i) for i in tokens]
    finish = {"choices": [{"delta": {}, "finish_reason": "stop"}], "usage": {"completion_tokens": reported}}
    events.append(_event(finish))
    if done:
        events.append(_event("[DONE]"))
    body = b"".join(b"%x\r\n%s\r\n" % (len(e), e) for e in events) + b"0\r\n\r\n"
    return b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nContent-Type: text/event-stream\r\n\r\n" + body


@pytest.fixture
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


def _feed(loop: asyncio.AbstractEventLoop, answer: bytes) -> clients.Results:
    results = clients.Results(window=(0.0, float("inf")))
    client = clients.StreamClient(7, True, 0.0, results, loop.create_future())
    for i in range(len(answer)):
        client.data_received(answer[i:i + 1])
    if not client.ended:
        client.connection_lost(None)
    return results


def test_a_whole_stream_fed_byte_by_byte_completes(loop: asyncio.AbstractEventLoop) -> None:
    results = _feed(loop, _answer([0, 1, 2], 3))
    assert results.completed == 1 and not results.failures
    assert results.tokens == 3 and sum(results.latency.values()) == 3


@pytest.mark.parametrize("answer, failure", [
    (_answer([0, 2], 3), "protocol"),  # a token missing in the middle: out of order
    (_answer([0, 1], 3), "lost tokens"),  # the engine says it sent one more than came
    (_answer([0, 1, 2], 3, done=False), "no [DONE]"),
    (_answer([0, 1, 2], 3)[:-40], "connection lost"),
])
def test_a_broken_stream_is_a_failure(loop: asyncio.AbstractEventLoop, answer: bytes, failure: str) -> None:
    results = _feed(loop, answer)
    assert results.completed == 0 and results.failures == {failure: 1}
