#!/usr/bin/env python
"""The open-streams benchmark's clients: one process holding many slow streaming chat requests.

Each stream is one HTTP/1.1 connection (asyncio, a receive buffer of
``--rcvbuf`` bytes set before connecting) carrying one streaming chat
request for ``stream <id> until <time>`` (see ``open_streams_engine.py``).
Streams open evenly over ``[--start-at, --start-at + --ramp]``. Most of them
read slowly: after every read the connection stops reading for
``--read-pause`` seconds, so events wait in the kernel's buffers and, when
those fill, in the gateway's. Every ``--probe-every``-th stream (a
*probe*) reads at once; latency is taken on probes only, because a slow
reader's latency is mostly its own pause.

What each event tells:

- a token ``t<i>@<stamp>``: it must be the stream's next index (loss and
  order check); on a probe, ``now - stamp`` is one latency sample;
  on every stream it counts into the bytes in flight at each grid instant
  ``k * GRID`` (monotonic seconds) between its stamp and its arrival;
- the finish chunk's ``usage.completion_tokens``: what the engine says it
  sent, which must equal the tokens received;
- ``data: [DONE]`` ends a correct stream (then the chunked body's end).

It prints one JSON object (see :func:`Results.report`) and exits once every
stream has ended or at ``--deadline``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import socket
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

#: Seconds between the instants at which in-flight bytes and open streams are counted;
#: the orchestrator samples the gateway's RSS at the same instants.
GRID = 0.25
#: Latency histogram bucket, in seconds.
BUCKET = 1e-5
_TOKEN = b'"content":"t'
_USAGE = b'"completion_tokens":'
_DONE = b"data: [DONE]"


def grid_index(t: float) -> int:
    return math.floor(t / GRID)


@dataclass
class Results:
    """What this process's streams saw."""

    window: tuple[float, float]
    streams: int = 0
    opened: int = 0
    completed: int = 0
    failures: Counter[str] = field(default_factory=Counter)
    failure_samples: list[str] = field(default_factory=list)
    events: int = 0
    events_in_window: int = 0
    tokens: int = 0
    latency: Counter[int] = field(default_factory=Counter)
    inflight: Counter[int] = field(default_factory=Counter)
    #: Per stream (request sent, response headers in or None, ended) monotonic times, for the
    #: streams held and answered at each grid instant.
    spans: list[tuple[float, float | None, float]] = field(default_factory=list)

    def fail(self, stream_id: int, kind: str, detail: str = "") -> None:
        self.failures[kind] += 1
        if len(self.failure_samples) < 5:
            self.failure_samples.append(f"stream {stream_id}: {kind} {detail}".strip())

    def report(self, cpu_s: float) -> dict[str, Any]:
        open_at: Counter[int] = Counter()
        sent_at: Counter[int] = Counter()
        for sent, answered, ended in self.spans:
            for k in range(math.ceil(sent / GRID), math.floor(ended / GRID) + 1):
                sent_at[k] += 1
            if answered is not None:
                for k in range(math.ceil(answered / GRID), math.floor(ended / GRID) + 1):
                    open_at[k] += 1
        return {"streams": self.streams, "opened": self.opened, "completed": self.completed,
                "failures": dict(self.failures), "failure_samples": self.failure_samples,
                "events": self.events, "events_in_window": self.events_in_window, "tokens": self.tokens,
                "latency_buckets": {str(k): v for k, v in self.latency.items()},
                "inflight_bytes": {str(k): v for k, v in self.inflight.items()},
                "open_streams": {str(k): v for k, v in open_at.items()},
                "sent_streams": {str(k): v for k, v in sent_at.items()}, "cpu_s": cpu_s}


class StreamClient(asyncio.Protocol):
    """One streaming request on its own connection: parses the chunked SSE answer and checks it."""

    def __init__(self, stream_id: int, probe: bool, read_pause: float, results: Results,
                 done: asyncio.Future[None]) -> None:
        self.stream_id = stream_id
        self.probe = probe
        self.read_pause = read_pause
        self.results = results
        self.done = done
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()
        self.in_head = True
        self.chunk_left = 0  # bytes of the current chunk still to come; -1: reading a size line
        self.events = bytearray()
        self.next_token = 0
        self.reported: int | None = None
        self.got_done = False
        self.opened_at: float | None = None
        self.answered_at: float | None = None
        self.ended = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        now = time.monotonic()
        self.buffer += data
        try:
            self._parse(now)
        except ValueError as e:
            self._end("protocol", str(e))
            return
        if not self.probe and self.transport is not None and not self.ended:
            self.transport.pause_reading()
            asyncio.get_running_loop().call_later(self.read_pause, self._resume)

    def _resume(self) -> None:
        if self.transport is not None and not self.ended:
            self.transport.resume_reading()

    def _parse(self, now: float) -> None:
        buffer = self.buffer
        if self.in_head:
            end = buffer.find(b"\r\n\r\n")
            if end < 0:
                return
            head = bytes(buffer[:end]).lower()
            del buffer[:end + 4]
            if not head.startswith(b"http/1.1 200"):
                raise ValueError(f"status {head.split(b' ', 2)[1:2]!r}")
            if b"transfer-encoding: chunked" not in head:
                raise ValueError("not a chunked stream")
            self.in_head = False
            self.chunk_left = -1
            self.results.opened += 1
            self.answered_at = now
        ended = self._dechunk()
        self._events(now)
        if ended:
            self._finished(now)

    def _dechunk(self) -> bool:
        """Moves whole chunks' bytes to ``events``; whether the body's last chunk came."""
        buffer = self.buffer
        while buffer:
            if self.chunk_left < 0:
                line_end = buffer.find(b"\r\n")
                if line_end < 0:
                    return False
                size = int(bytes(buffer[:line_end]).split(b";")[0], 16)
                if size == 0:
                    if len(buffer) < line_end + 4:
                        return False
                    del buffer[:line_end + 4]
                    return True
                del buffer[:line_end + 2]
                self.chunk_left = size
            if self.chunk_left > 0:
                take = min(self.chunk_left, len(buffer))
                self.events += buffer[:take]
                del buffer[:take]
                self.chunk_left -= take
                if self.chunk_left:
                    break
            if len(buffer) < 2:
                return False
            if buffer[:2] != b"\r\n":
                raise ValueError("chunk not followed by CRLF")
            del buffer[:2]
            self.chunk_left = -1
        return False

    def _events(self, now: float) -> None:
        events = self.events
        start = 0
        while True:
            end = events.find(b"\n\n", start)
            if end < 0:
                break
            self._event(bytes(events[start:end]), now)
            start = end + 2
        if start:
            del events[:start]

    def _event(self, event: bytes, now: float) -> None:
        results = self.results
        results.events += 1
        in_window = results.window[0] <= now < results.window[1]
        if in_window:
            results.events_in_window += 1
        if self.got_done:
            raise ValueError("event after [DONE]")
        at = event.find(_TOKEN)
        if at >= 0:
            index_end = event.index(b"@", at)
            index = int(event[at + len(_TOKEN):index_end])
            stamp = float(event[index_end + 1:event.index(b'"', index_end)])
            if index != self.next_token:
                raise ValueError(f"token {index} where {self.next_token} was due")
            self.next_token += 1
            results.tokens += 1
            if self.probe and in_window:
                results.latency[int((now - stamp) / BUCKET)] += 1
            size = len(event) + 2
            for k in range(math.ceil(stamp / GRID), math.floor(now / GRID) + 1):
                results.inflight[k] += size
            return
        at = event.find(_USAGE)
        if at >= 0:
            end = at + len(_USAGE)
            while end < len(event) and event[end:end + 1].isdigit():
                end += 1
            self.reported = int(event[at + len(_USAGE):end])
            return
        if event == _DONE:
            self.got_done = True

    def _finished(self, now: float) -> None:
        if not self.got_done:
            self._end("no [DONE]")
        elif self.reported != self.next_token:
            self._end("lost tokens", f"{self.next_token} received, {self.reported} sent")
        else:
            self.results.completed += 1
            self._end(None)

    def _end(self, failure: str | None, detail: str = "") -> None:
        if self.ended:
            return
        self.ended = True
        if failure is not None:
            self.results.fail(self.stream_id, failure, detail)
        if self.opened_at is not None:
            self.results.spans.append((self.opened_at, self.answered_at, time.monotonic()))
        if self.transport is not None:
            self.transport.close()
        if not self.done.done():
            self.done.set_result(None)

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        if not self.ended:
            self._end("connection lost", f"after {self.next_token} tokens")

    def give_up(self) -> None:
        self._end("unfinished at the deadline", f"after {self.next_token} tokens")


def request_bytes(port: int, stream_id: int, until: float) -> bytes:
    body = json.dumps({"model": "bench", "stream": True, "max_tokens": 100000,
                       "messages": [{"role": "user", "content": f"stream {stream_id} until {until:.6f}"}]}).encode()
    return (b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:%d\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % (port, len(body))) + body


async def run_stream(port: int, stream_id: int, probe: bool, options: argparse.Namespace, results: Results,
                     clients: list[StreamClient]) -> None:
    loop = asyncio.get_running_loop()
    done: asyncio.Future[None] = loop.create_future()
    client = StreamClient(stream_id, probe, options.read_pause, results, done)
    clients.append(client)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, options.rcvbuf)
    sock.setblocking(False)
    try:
        await loop.sock_connect(sock, ("127.0.0.1", port))
        transport, _ = await loop.create_connection(lambda: client, sock=sock)
    except OSError as e:
        sock.close()
        client._end("connect", str(e))
        return
    transport.write(request_bytes(port, stream_id, options.until))
    # From here until its end the gateway holds the stream, answered yet or not.
    client.opened_at = time.monotonic()
    await done


async def run(options: argparse.Namespace) -> dict[str, Any]:
    results = Results(window=(options.window_start, options.window_end))
    ids = list(range(options.first_id, options.first_id + options.step * options.streams, options.step))
    results.streams = len(ids)
    clients: list[StreamClient] = []
    tasks = []
    for n, stream_id in enumerate(ids):
        delay = options.start_at + options.ramp * n / max(1, len(ids)) - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.ensure_future(run_stream(options.port, stream_id, stream_id % options.probe_every == 0,
                                                      options, results, clients)))
    remaining = options.deadline - time.monotonic()
    if tasks:
        await asyncio.wait(tasks, timeout=max(0.0, remaining))
    for client in clients:
        client.give_up()
    for task in tasks:
        task.cancel()
    return results.report(time.process_time())


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, required=True, help="the gateway's HTTP port on 127.0.0.1")
    parser.add_argument("--streams", type=int, required=True, help="streams this process opens")
    parser.add_argument("--first-id", type=int, default=0)
    parser.add_argument("--step", type=int, default=1, help="stream ids are first-id + k * step")
    parser.add_argument("--probe-every", type=int, default=20)
    parser.add_argument("--start-at", type=float, required=True, help="monotonic time of the first connection")
    parser.add_argument("--ramp", type=float, default=0.0, help="seconds over which the streams open")
    parser.add_argument("--until", type=float, required=True, help="monotonic time the engine stops sending")
    parser.add_argument("--window-start", type=float, required=True, help="measured window (monotonic)")
    parser.add_argument("--window-end", type=float, required=True)
    parser.add_argument("--deadline", type=float, required=True, help="monotonic time to give up")
    parser.add_argument("--read-pause", type=float, default=0.1)
    parser.add_argument("--rcvbuf", type=int, default=4096)
    options = parser.parse_args(argv)
    report = asyncio.run(run(options))
    print(json.dumps(report), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
