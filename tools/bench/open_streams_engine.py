#!/usr/bin/env python
"""The open-streams benchmark's engine: a paced, stamping runtime behind a lean ``ProcessTasks`` client.

It dials the gateway's worker port with infx's gRPC client and announces
the ``http-request`` capability as infx's agent in front of an OpenAI
runtime does, so the gateway sends the client's request verbatim and
relays the answer verbatim (the vLLM deployment shape). By default the
engine side is :class:`LeanEngine`: status once a second, control tasks
answered, every task handed to :class:`PacedRuntime`, results sent as they
come, and nothing else, so that the engine costs little next to the
gateway it loads. ``--agent`` runs infx's own engine agent
(:class:`infx.agent.engine.EngineAgent`) instead, for what it costs itself: its
pure core scans every task in flight to compute its next deadline after
each result, which does not scale to thousands of streams per engine.
:class:`PacedRuntime` answers a streaming chat request itself:

- one token event per interval, each interval uniform in
  ``[--min-interval, --max-interval]`` seconds and drawn from a generator
  seeded by ``--seed`` and the stream's own id (in the user message), so a
  run is reproducible stream by stream;
- each token's content is ``t<index>@<send time>`` (``time.monotonic()``,
  which on Linux is one clock for every process of the machine), stamped
  just before the event is handed to the agent, so the client can tell how
  long the event took to reach it;
- tokens go out until the stream's ``until`` time (also in the message),
  then a finish chunk whose ``usage.completion_tokens`` says how many tokens
  were sent, then ``data: [DONE]``: the client's loss check compares.

Due tokens are sent from one timer every ``TICK`` seconds (a heap of
streams by due time) rather than one ``callLater`` per token, so that the
engine stays cheap next to the gateway it loads.

    python tools/bench/open_streams_engine.py --port N --engine-id e0 --max-concurrency 5000 --seed 1

It runs until SIGTERM (then drains like ``twistd infx-engine``) or until its
stdin closes.
"""

from __future__ import annotations

import argparse
import heapq
import json
import random
import re
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from infx.agent.runtimes import TaskSink  # noqa: E402
from protocol.openai.runtime import runtime_request  # noqa: E402
from protocol.openai.sse import DONE_EVENT  # noqa: E402
from protocol.pb import worker_pb2  # noqa: E402

MODEL = "bench"
#: Seconds between the runtime's looks at which tokens are due.
TICK = 0.005
#: What the client's user message says: ``stream <id> until <monotonic seconds>``.
STREAM_SPEC = re.compile(r"stream (\d+) until ([0-9.]+)")


def _chunk(stream_id: int, delta: dict[str, Any], reason: str | None = None,
           usage: dict[str, int] | None = None) -> bytes:
    chunk: dict[str, Any] = {"id": f"chatcmpl-bench{stream_id}", "object": "chat.completion.chunk", "created": 0,
                             "model": MODEL,
                             "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}]}
    if usage is not None:
        chunk["usage"] = usage
    return b"data: " + json.dumps(chunk, separators=(",", ":")).encode() + b"\n\n"


def _result(**fields: Any) -> worker_pb2.TaskResult:
    return worker_pb2.TaskResult(verbatim_answer=True, **fields)


def _event(data: bytes, last: bool = False) -> worker_pb2.TaskResult:
    return _result(server_sent_event=worker_pb2.ServerSentEvent(data=data, is_last_event=last))


def _error(status: int, message: str) -> worker_pb2.TaskResult:
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error"}}).encode()
    response = worker_pb2.HttpResponse(status_code=status, status=f"{status} Bad Request", body=body)
    response.header["Content-Type"].values.append("application/json")
    return _result(http_response=response)


class _PacedStream:
    """One running stream: its next token's index and due time, and where results go."""

    def __init__(self, stream_id: int, until: float, sink: TaskSink, rng: random.Random,
                 intervals: tuple[float, float]) -> None:
        self.stream_id = stream_id
        self.until = until
        self.sink = sink
        self.rng = rng
        self.intervals = intervals
        self.sent = 0
        self.aborted = False
        self.due = time.monotonic() + self._interval()

    def _interval(self) -> float:
        return self.rng.uniform(*self.intervals)

    def abort(self) -> None:
        self.aborted = True

    def fire(self, now: float) -> bool:
        """Send the due token (or the end); whether the stream goes on."""
        if self.due >= self.until:
            usage = {"prompt_tokens": 1, "completion_tokens": self.sent, "total_tokens": self.sent + 1}
            self.sink.send(_event(_chunk(self.stream_id, {}, "stop", usage)))
            self.sink.send(_event(DONE_EVENT))
            self.sink.send(_event(b"", last=True))
            self.sink.finish()
            return False
        content = f"t{self.sent}@{time.monotonic():.6f}"
        self.sink.send(_event(_chunk(self.stream_id, {"content": content})))
        self.sent += 1
        self.due = max(self.due + self._interval(), now)
        return True


class PacedRuntime:
    """Answers the benchmark's streaming chat requests with paced, stamped tokens (see the module docstring)."""

    def __init__(self, clock: Any, seed: int, intervals: tuple[float, float]) -> None:
        self.clock = clock
        self.seed = seed
        self.intervals = intervals
        self._heap: list[tuple[float, int, _PacedStream]] = []
        self._order = 0
        self._timer: Any = None

    def start(self, task: worker_pb2.Task, sink: TaskSink) -> _PacedStream | _Refused:
        try:
            body = (json.loads(bytes(task.request.http_request.body)) if task.request.HasField("http_request")
                    else runtime_request(task.request).json)
            text = str(body["messages"][-1]["content"])
            match = STREAM_SPEC.search(text)
            if not body.get("stream") or match is None:
                raise ValueError("not a benchmark stream")
        except (ValueError, KeyError, IndexError, TypeError) as e:
            sink.send(_error(400, f"the open-streams engine serves only its client's streams: {e}"))
            sink.finish()
            return _Refused()
        stream_id, until = int(match.group(1)), float(match.group(2))
        headers = {"Content-Type": ["text/event-stream"], "Cache-Control": ["no-cache"]}
        response = worker_pb2.HttpResponse(status_code=200, status="200 OK")
        for name, values in headers.items():
            response.header[name].values.extend(values)
        sink.send(_result(http_response=response))
        stream = _PacedStream(stream_id, until, sink, random.Random(f"{self.seed}:{stream_id}"), self.intervals)
        sink.send(_event(_chunk(stream_id, {"role": "assistant", "content": ""})))
        self._push(stream)
        return stream

    def _push(self, stream: _PacedStream) -> None:
        self._order += 1
        heapq.heappush(self._heap, (stream.due, self._order, stream))
        if self._timer is None:
            self._timer = self.clock.callLater(TICK, self._tick)

    def _tick(self) -> None:
        self._timer = None
        now = time.monotonic()
        heap = self._heap
        while heap and heap[0][0] <= now:
            _, _, stream = heapq.heappop(heap)
            if not stream.aborted and stream.fire(now):
                self._order += 1
                heapq.heappush(heap, (stream.due, self._order, stream))
        if heap:
            self._timer = self.clock.callLater(TICK, self._tick)


class _Refused:
    def abort(self) -> None:
        pass


class LeanEngine:
    """One ``ProcessTasks`` stream: reports one ready model, answers control tasks, runs the rest."""

    STATUS_INTERVAL = 1.0

    def __init__(self, reactor: Any, port: int, engine_id: str, runtime: PacedRuntime) -> None:
        from infx.agent.engine import PROCESS_TASKS
        from infx.transport import GrpcChannel, client_endpoint
        from protocol.grpc import GrpcConfig

        self.reactor = reactor
        self.engine_id = engine_id
        self.runtime = runtime
        self.running: dict[str, Any] = {}
        self.ready = True
        self.stopping = False

        def connect() -> tuple[Any, Any]:
            channel = GrpcChannel(reactor, client_endpoint(reactor, "127.0.0.1", port),
                                  GrpcConfig(client_side=True), authority=f"127.0.0.1:{port}", scheme="http")
            return channel, channel.stream(PROCESS_TASKS, worker_pb2.ProcessTasksRequest.SerializeToString,
                                           worker_pb2.ProcessTasksResponse.FromString)

        self._connect = connect
        self.channel: Any = None
        self.call: Any = None
        self._status_call: Any = None

    def start(self) -> None:
        """Open the stream (again, half a second after it failed: the gateway may not listen yet)."""
        self.channel, self.call = self._connect()
        if self._status_call is None:
            self._status()
        else:
            self._send_status()
        self._read(self.call)

    def _lost(self, call: Any) -> None:
        if call is self.call and not self.stopping:
            for handle in self.running.values():
                handle.abort()
            self.running.clear()
            self.channel.close()
            self.reactor.callLater(0.5, self.start)

    def stop(self) -> Any:
        """Report not ready, then close once the gateway had a moment to see it."""
        self.ready = False
        self.stopping = True
        self._send_status()
        from twisted.internet.task import deferLater

        return deferLater(self.reactor, 0.2, self._close)

    def _close(self) -> Any:
        if self._status_call is not None and self._status_call.active():
            self._status_call.cancel()
        self.call.end()
        return self.channel.close()

    def _status(self) -> None:
        self._send_status()
        self._status_call = self.reactor.callLater(self.STATUS_INTERVAL, self._status)

    def _send_status(self) -> None:
        from protocol.openai.task_forms import HTTP_REQUEST_CAPABILITY
        from protocol.pb import status_pb2

        model = status_pb2.EngineStatus.Model(id=MODEL, is_ready=self.ready, in_progress_task_count=len(self.running))
        status = status_pb2.EngineStatus(engine_id=self.engine_id, ready=self.ready, models=[model],
                                         infx_capabilities=[HTTP_REQUEST_CAPABILITY])
        self._write(worker_pb2.ProcessTasksRequest(engine_status=status))

    def _write(self, message: worker_pb2.ProcessTasksRequest) -> None:
        self.call.send(message).addErrback(lambda _: None)

    def _read(self, call: Any) -> None:
        call.recv().addCallbacks(lambda message: self._received(call, message), lambda failure: self._lost(call))

    def _received(self, call: Any, message: worker_pb2.ProcessTasksResponse | None) -> None:
        if message is None:
            self._lost(call)
            return
        if message.HasField("new_task"):
            self._task(message.new_task)
        self._read(call)

    def _task(self, task: worker_pb2.Task) -> None:
        from protocol.agent.core import control_response

        kind = task.request.WhichOneof("request")
        if kind in ("heartbeat", "go_away"):
            self._write(worker_pb2.ProcessTasksRequest(task_result=control_response(task.id, 202 if kind == "go_away"
                                                                                    else 200)))
        elif kind == "cancel_task":
            handle = self.running.pop(task.request.cancel_task.task_id, None)
            if handle is not None:
                handle.abort()
            self._write(worker_pb2.ProcessTasksRequest(
                task_result=control_response(task.id, 200 if handle is not None else 404)))
        else:
            sink = _LeanSink(self, task.id)
            self.running[task.id] = self.runtime.start(task, sink)
            if sink.finished:
                self.running.pop(task.id, None)


class _LeanSink:
    """Numbers one task's results and sends them on the engine's stream."""

    def __init__(self, engine: LeanEngine, task_id: str) -> None:
        self.engine = engine
        self.task_id = task_id
        self.index = 0
        self.finished = False

    def send(self, result: worker_pb2.TaskResult) -> None:
        result.task_id = self.task_id
        result.result_index = self.index
        self.index += 1
        self.engine._write(worker_pb2.ProcessTasksRequest(task_result=result))

    def finish(self) -> None:
        self.finished = True
        self.engine.running.pop(self.task_id, None)

    def when_writable(self) -> None:
        return None


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, required=True, help="the gateway's worker gRPC port on 127.0.0.1")
    parser.add_argument("--engine-id", required=True)
    parser.add_argument("--max-concurrency", type=int, required=True)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--min-interval", type=float, default=0.05, help="seconds (default 0.05)")
    parser.add_argument("--max-interval", type=float, default=0.2, help="seconds (default 0.2)")
    parser.add_argument("--agent", action="store_true", help="infx's engine agent instead of the lean engine")
    options = parser.parse_args(argv)

    from twisted.internet import reactor

    from infx.agent.engine import EngineAgent, GrpcLinks
    from infx.transport import GrpcChannel, client_endpoint
    from protocol.agent.core import EngineAgentCore
    from protocol.agent.effects import AgentConfig
    from protocol.grpc import GrpcConfig
    from protocol.openai.task_forms import HTTP_REQUEST_CAPABILITY

    config = AgentConfig(engine_id=options.engine_id, models=(MODEL,), max_concurrency=options.max_concurrency,
                         max_queued=options.max_concurrency, capabilities=(HTTP_REQUEST_CAPABILITY,))
    grpc_config = GrpcConfig(client_side=True)

    def connect() -> GrpcChannel:
        return GrpcChannel(reactor, client_endpoint(reactor, "127.0.0.1", options.port), grpc_config,
                           authority=f"127.0.0.1:{options.port}", scheme="http")

    runtime = PacedRuntime(reactor, options.seed, (options.min_interval, options.max_interval))
    if options.agent:
        agent = EngineAgent(reactor, EngineAgentCore(config), runtime, GrpcLinks(reactor, connect), grace=2.0)
        reactor.callWhenRunning(agent.startService)
        reactor.addSystemEventTrigger("before", "shutdown", agent.stopService)
    else:
        lean = LeanEngine(reactor, options.port, options.engine_id, runtime)
        reactor.callWhenRunning(lean.start)
        reactor.addSystemEventTrigger("before", "shutdown", lean.stop)

    def stdin_closed() -> None:
        sys.stdin.read()
        reactor.callFromThread(reactor.stop)

    reactor.callInThread(stdin_closed)
    reactor.run()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
