"""A misbehaving runtime behind real ``twistd infx-engine --runtime openai`` agents and a real
``twistd infx`` gateway (issue #22, items 1 and 3).

The runtime is :mod:`harness.recording_runtime`, a real HTTP server in a child process,
scripted to fail as runtimes do: it closes the connection once it read a request (a
crash on that body), dies mid-stream with chunked framing, dies mid-stream with no
framing at all (the body ends where the connection does), or answers 503. Two agents
serve model ``m`` from it, so a retry may land on the other engine. For each case:
how many requests the runtime received (never more than docs/operations.md's three sends),
how soon after the last one the client had its error, the error as the official
``openai`` client raises it, the gateway's request log line and ``/metrics``.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from harness.recording_runtime import Answer, RecordingRuntime
from harness.twistd_processes import Engine, Gateway, http_get, wait_until

SSE = (("Content-Type", "text/event-stream"),)
MESSAGES = [{"role": "user", "content": "hi"}]


def event(obj: dict[str, object]) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


CHUNKS = tuple(event({"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": w}}]})
               for w in ("one ", "two ", "three "))


class Cluster:
    def __init__(self, logs: Path) -> None:
        self.runtime = RecordingRuntime(logs)
        self.gateway = Gateway(logs)
        self.engines = [Engine(logs, self.gateway, engine_id, ["m"], runtime="openai", upstream=self.runtime.url)
                        for engine_id in ("e1", "e2")]
        self.client = openai.OpenAI(base_url=self.gateway.base_url, api_key="x", max_retries=0, timeout=30)

    def metric(self, name: str, **labels: str) -> float:
        """One sample of the gateway's /metrics (0 when absent)."""
        wanted = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
        for line in http_get(self.gateway.url + "/metrics")[1].decode().splitlines():
            if line.startswith(f"{name}{{{wanted}}} ") or (not labels and line.startswith(name + " ")):
                return float(line.rsplit(" ", 1)[1])
        return 0.0

    def requests_count(self, status: int) -> float:
        return self.metric("infx_http_requests_total", endpoint="chat/completions", model="m", status=str(status),
                           tenant="default")

    def log_line(self, request_id: str) -> str:
        """The gateway's request log line for ``request_id`` (waited for: it is written as the answer ends)."""
        def find() -> str | None:
            return next((line for line in self.gateway.child.output().splitlines()
                         if f"request {request_id} " in line), None)
        line: str = wait_until(find, f"the log line of {request_id}", [self.gateway.child])
        return line

    def stop(self) -> None:
        for engine in self.engines:
            engine.stop()
        self.gateway.stop()
        self.runtime.stop()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    cluster = Cluster(tmp_path_factory.mktemp("runtime-failures"))
    yield cluster
    cluster.stop()


@pytest.fixture(autouse=True)
def fresh_runtime(cluster: Cluster) -> None:
    cluster.runtime.reset()
    cluster.gateway.wait_until_idle()


def test_a_request_that_kills_its_runtime_is_sent_twice_at_most_and_the_client_gets_one_clear_502(cluster):
    """Issue #22: this request was sent 30 times over 29 s; the log said retries=30 and /metrics
    infx_request_retries_total 30 but infx_task_retries_total 0."""
    cluster.runtime.script(*[Answer(end="drop")] * 10)
    before = {reason: cluster.metric("infx_task_retries_total", reason=reason)
              for reason in ("runtime_dropped", "runtime_busy", "runtime_unreachable", "engine_lost")}
    failures_before = cluster.metric("infx_task_attempt_failures_total", reason="runtime_dropped")
    errors_before = cluster.requests_count(502)
    with pytest.raises(openai.APIStatusError) as raised:
        cluster.client.chat.completions.create(model="m", messages=MESSAGES, extra_headers={"X-Request-ID": "crash-1"})
    answered_at = time.time()
    received = cluster.runtime.requests()
    # The runtime read it, so it is sent once more (to the other engine) and no more: 2 <= 3.
    assert len(received) == 2 and all(r.path == "/v1/chat/completions" for r in received)
    assert answered_at - received[-1].at < 1.0
    error = raised.value
    assert (error.status_code, error.code, error.type) == (502, "runtime_dropped", "upstream_error")
    assert error.body["message"] == (  # type: ignore[index]
        "The runtime closed the connection before it answered; it may have failed on this request.")
    line = cluster.log_line("crash-1")
    assert re.search(r" status=502 .* retries=1 error=runtime_dropped$", line), line
    assert cluster.metric("infx_task_retries_total", reason="runtime_dropped") == before["runtime_dropped"] + 1
    assert all(cluster.metric("infx_task_retries_total", reason=reason) == count
               for reason, count in before.items() if reason != "runtime_dropped")
    assert cluster.metric("infx_task_attempt_failures_total", reason="runtime_dropped") == failures_before + 2
    assert cluster.requests_count(502) == errors_before + 1


def test_a_runtime_that_answers_503_every_time_gets_three_sends_then_the_client_has_its_answer(cluster):
    busy = Answer(status=503, reason="Service Unavailable", body=b'{"error":{"message":"overloaded","code":503}}')
    cluster.runtime.script(*[busy] * 10)
    busy_before = cluster.metric("infx_task_attempt_failures_total", reason="runtime_busy")
    retries_before = cluster.metric("infx_task_retries_total", reason="runtime_busy")
    with pytest.raises(openai.InternalServerError) as raised:
        cluster.client.chat.completions.create(model="m", messages=MESSAGES, extra_headers={"X-Request-ID": "busy-1"})
    answered_at = time.time()
    received = cluster.runtime.requests()
    assert len(received) == 3
    assert answered_at - received[-1].at < 1.0
    assert raised.value.status_code == 503 and raised.value.body["message"] == "overloaded"  # type: ignore[index]
    assert re.search(r" status=503 .* retries=2 error=", cluster.log_line("busy-1"))
    assert cluster.metric("infx_task_attempt_failures_total", reason="runtime_busy") == busy_before + 3
    assert cluster.metric("infx_task_retries_total", reason="runtime_busy") == retries_before + 2


@pytest.mark.parametrize("end", ["abort", "close"], ids=["chunked", "unframed"])  # how recording_runtime ends it
def test_a_stream_the_runtime_breaks_off_ends_with_an_error_event_the_client_sees(cluster, end):
    """Chunked framing cut short read '... Chunked decoder in 'CHUNK_LENGTH' state ...'; an unframed
    stream closed mid-way just stopped, with no error and no [DONE]. Both were logged status=200."""
    cluster.runtime.script(Answer(headers=SSE, chunks=CHUNKS, end=end))
    errors_before = cluster.requests_count(502)
    received: list[str] = []
    stream = cluster.client.chat.completions.create(model="m", messages=MESSAGES, stream=True,
                                                    extra_headers={"X-Request-ID": f"cut-{end}"})
    with pytest.raises(openai.APIError) as raised:
        for chunk in stream:
            received.append(chunk.choices[0].delta.content or "")
    assert received == ["one ", "two ", "three "]
    assert raised.value.code == "runtime_stream_broken"
    assert raised.value.message == "The runtime's stream broke off before its end; the response is incomplete."
    assert len(cluster.runtime.requests()) == 1  # part of the answer was out: never sent again
    line = cluster.log_line(f"cut-{end}")
    assert re.search(r" status=502 .* error=runtime_stream_broken$", line), line
    assert cluster.requests_count(502) == errors_before + 1


def test_the_whole_stream_of_an_unframed_answer_that_reached_done_is_a_success(cluster):
    cluster.runtime.script(Answer(headers=SSE, chunks=(*CHUNKS, b"data: [DONE]\n\n"), end="close"))
    ok_before = cluster.requests_count(200)
    stream = cluster.client.chat.completions.create(model="m", messages=MESSAGES, stream=True,
                                                    extra_headers={"X-Request-ID": "whole-1"})
    assert [chunk.choices[0].delta.content for chunk in stream] == ["one ", "two ", "three "]
    assert " status=200 " in cluster.log_line("whole-1")
    assert cluster.requests_count(200) == ok_before + 1


def test_the_runtimes_failures_are_in_the_agents_log_in_words(cluster):
    logs = "\n".join(engine.child.output() for engine in cluster.engines)
    assert "failed request crash-1 (runtime_dropped): ConnectionDone" in logs
    assert "broke off the stream of request cut-abort: ConnectionLost" in logs
    assert "broke off the stream of request cut-close: the connection closed an unframed stream" in logs
    assert "Traceback" not in logs and "Traceback" not in cluster.gateway.child.output()
