#!/usr/bin/env python
"""The HTTP benchmark's load generator: closed-loop keep-alive clients on raw asyncio.

``--concurrency`` connections each send one request, read its whole
response, and send the next at once, for ``--warmup`` seconds unmeasured
and then ``--duration`` seconds measured. The request is built once; the
response parser is a small hand-written HTTP/1.1 reader (``Content-Length``
or chunked bodies) that counts server-sent events by their blank-line
ends, so the per-request cost on this side stays far below a server's.
Latency is from the request's write to the response's last byte, taken
for requests sent and finished inside the measured window; events count
when they arrive inside it (a long stream contributes the events it
relayed there even if it ends later). A window in which nothing was
measured yet does not close empty: it stays open until the first request
finishes or event arrives (then ends there), for at most ``--patience``
seconds more, so that a loaded machine gives a slower figure rather than
none; ``seconds`` is the window's actual length.

    python tools/bench/http_load.py --port N --body-file F [--concurrency C] [--duration S] [--warmup S]
                                    [--patience S]

prints one JSON object: ``requests``, ``errors``, ``seconds``, ``rps``,
``events``, ``events_per_s``, ``p50_ms``, ``p99_ms``, ``cpu_s`` (this
process's CPU time in the window, to show whether the client was the limit)
and, for each ``--watch-pid`` process, ``watched_cpu_s`` and
``watched_wait_s``: the seconds it (every thread of it and of its child
processes) ran on a CPU and the seconds it was runnable but waited for
one, in the window (from ``/proc/PID/task/TID/schedstat``; null where
that is unavailable). They tell how busy the gateway's one core was, and
whether other work on the machine held it back.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
import time
from dataclasses import dataclass, field


@dataclass
class Stats:
    """What the connections report; the window is ``[start, end]`` in ``perf_counter`` seconds.

    An empty window may grow past ``end`` up to ``ceiling`` (see :meth:`measures`).
    """

    start: float
    end: float
    ceiling: float = math.inf
    latencies: list[float] = field(default_factory=list)
    events: int = 0
    errors: int = 0
    error_samples: list[str] = field(default_factory=list)
    #: Set when the first measurement after ``end`` closed an empty window.
    extended: asyncio.Event = field(default_factory=asyncio.Event)

    def is_open(self, now: float) -> bool:
        """Whether the window is open at ``now``, or may still be (nothing measured yet): clients keep sending."""
        return now <= self.end or (now <= self.ceiling and not self.events and not self.latencies)

    def measures(self, now: float) -> bool:
        """Whether something that happens at ``now`` is measured: inside ``[start, end]``,
        or after ``end`` (up to ``ceiling``) while nothing was measured, which ends the window at ``now``."""
        if now < self.start or not self.is_open(now):
            return False
        if now > self.end:
            self.end = now
            self.extended.set()
        return True

    def error(self, what: str) -> None:
        self.errors += 1
        if len(self.error_samples) < 3:
            self.error_samples.append(what)


class ResponseReader:
    """Incremental HTTP/1.1 response parser for one keep-alive connection.

    ``feed`` returns ``(done, status, events)``: whether the response is
    complete, its status code, and how many SSE events the fed bytes ended.
    Bytes past the end of a response are kept for the next one.
    """

    def __init__(self) -> None:
        self.buffer = bytearray()
        self.reset()

    def reset(self) -> None:
        self.status = 0
        self.in_head = True
        self.remaining = -1  # body bytes left (Content-Length), or chunk bytes left
        self.chunked = False
        self.in_trailer = False
        self.last = b""  # the previous body byte, to see "\n\n" across reads

    def _body(self, data: bytes | bytearray) -> int:
        if not data:
            return 0
        joined = self.last + data[:1]
        count = data.count(b"\n\n") + (joined == b"\n\n")
        self.last = bytes(data[-1:])
        return count

    def feed(self, data: bytes) -> tuple[bool, int, int]:
        buf = self.buffer
        buf += data
        events = 0
        if self.in_head:
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                return False, 0, 0
            head = bytes(buf[:end]).lower()
            del buf[:end + 4]
            self.in_head = False
            self.status = int(head[9:12])
            lines = head.split(b"\r\n")
            for line in lines[1:]:
                name, _, value = line.partition(b":")
                if name == b"content-length":
                    self.remaining = int(value)
                elif name == b"transfer-encoding" and b"chunked" in value:
                    self.chunked = True
                    self.remaining = 0
            if self.remaining < 0 and not self.chunked:
                raise ValueError("response without Content-Length or chunked body")
        if not self.chunked:
            take = min(self.remaining, len(buf))
            events += self._body(buf[:take])
            del buf[:take]
            self.remaining -= take
            return self.remaining == 0, self.status, events
        while True:
            if self.in_trailer:
                end = buf.find(b"\r\n")
                if end < 0:
                    return False, self.status, events
                del buf[:end + 2]
                if end == 0:
                    return True, self.status, events
                continue
            if self.remaining > 0:
                take = min(self.remaining, len(buf))
                events += self._body(buf[:take])
                del buf[:take]
                self.remaining -= take
                if self.remaining > 0:
                    return False, self.status, events
                self.remaining = -2  # the CRLF after the chunk's data
            if self.remaining == -2:
                if len(buf) < 2:
                    return False, self.status, events
                del buf[:2]
                self.remaining = 0
            end = buf.find(b"\r\n")
            if end < 0:
                return False, self.status, events
            size = int(bytes(buf[:end]).split(b";")[0], 16)
            del buf[:end + 2]
            if size == 0:
                self.in_trailer = True
            else:
                self.remaining = size


class LoadConnection(asyncio.Protocol):
    """One closed-loop client: a request, its whole response, the next request."""

    def __init__(self, request: bytes, stats: Stats, stopped: asyncio.Event) -> None:
        self.request = request
        self.stats = stats
        self.stopped = stopped
        self.reader = ResponseReader()
        self.sent_at = 0.0
        self.transport: asyncio.Transport | None = None
        self.closing = False
        self.lost: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self._send()

    def _send(self) -> None:
        assert self.transport is not None
        self.sent_at = time.perf_counter()
        self.transport.write(self.request)

    def data_received(self, data: bytes) -> None:
        now = time.perf_counter()
        stats = self.stats
        try:
            done, status, events = self.reader.feed(data)
        except ValueError as exc:
            stats.error(f"unparseable response: {exc}")
            self.close()
            return
        if events and stats.measures(now):
            stats.events += events
        if not done:
            return
        if status != 200:
            stats.error(f"HTTP {status}")
        elif stats.start <= self.sent_at and stats.measures(now):
            stats.latencies.append(now - self.sent_at)
        self.reader.reset()
        if self.stopped.is_set() or not stats.is_open(now):
            self.close()
        else:
            self._send()

    def close(self) -> None:
        self.closing = True
        if self.transport is not None:
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        if not self.closing:
            self.stats.error(f"connection lost: {exc}")
        if not self.lost.done():
            self.lost.set_result(None)


def percentile(sorted_values: list[float], fraction: float) -> float | None:
    """Nearest-rank percentile of already sorted values."""
    if not sorted_values:
        return None
    rank = max(0, min(len(sorted_values) - 1, int(fraction * len(sorted_values) + 0.5) - 1))
    return sorted_values[rank]


def process_sched(pid: int) -> dict[int, tuple[float, float]] | None:
    """Seconds each thread of ``pid`` and of its descendants has run on a CPU and waited for one so far,
    by thread id (Linux ``/proc/PID/task/TID/schedstat``), or None if ``pid`` cannot be read.

    Every thread counts: a Rust router does its work on worker threads, which
    ``/proc/PID/schedstat`` (the main thread alone) would miss.
    """
    threads: dict[int, tuple[float, float]] = {}
    pending = [pid]
    while pending:
        current = pending.pop()
        try:
            tids = [int(tid) for tid in os.listdir(f"/proc/{current}/task")]
        except (OSError, ValueError):
            if current == pid:
                return None
            continue  # a descendant that exited meanwhile
        for tid in tids:
            try:
                with open(f"/proc/{current}/task/{tid}/schedstat", "rb") as f:
                    ran, waited = f.read().split()[:2]
                with open(f"/proc/{current}/task/{tid}/children", "rb") as f:
                    pending += [int(child) for child in f.read().split()]
            except (OSError, ValueError):
                continue  # a thread that exited meanwhile
            threads[tid] = (int(ran) / 1e9, int(waited) / 1e9)
    return threads


def sched_span(start: dict[int, tuple[float, float]] | None,
               end: dict[int, tuple[float, float]] | None) -> tuple[float, float] | None:
    """CPU and wait seconds between two :func:`process_sched` readings; a thread born between them counts whole
    (a thread that ended between them is lost, so a watched process should keep its threads)."""
    if start is None or end is None:
        return None
    ran = sum(r - start.get(tid, (0.0, 0.0))[0] for tid, (r, _) in end.items())
    waited = sum(w - start.get(tid, (0.0, 0.0))[1] for tid, (_, w) in end.items())
    return ran, waited


def build_request(port: int, body: bytes, path: str = "/v1/chat/completions") -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode() + body


async def run(port: int, body: bytes, concurrency: int, duration: float, warmup: float,
              watch: list[int], patience: float = 0.0) -> dict[str, object]:
    loop = asyncio.get_running_loop()
    # The window opens once every connection is up (they already send meanwhile).
    stats = Stats(start=math.inf, end=math.inf)
    stopped = asyncio.Event()
    request = build_request(port, body)
    connections = []
    for _ in range(concurrency):
        _, protocol = await loop.create_connection(
            lambda: LoadConnection(request, stats, stopped), "127.0.0.1", port)
        connections.append(protocol)
    stats.start = time.perf_counter() + warmup
    stats.end = stats.start + duration
    stats.ceiling = stats.end + patience
    await asyncio.sleep(warmup)
    cpu_start = time.process_time()
    watched_start = [process_sched(pid) for pid in watch]
    await asyncio.sleep(max(0.0, stats.end - time.perf_counter()))
    if not stats.events and not stats.latencies and patience > 0:
        try:
            await asyncio.wait_for(stats.extended.wait(), max(0.0, stats.ceiling - time.perf_counter()))
        except asyncio.TimeoutError:
            pass
    cpu = time.process_time() - cpu_start
    watched_end = [process_sched(pid) for pid in watch]
    spans = [sched_span(a, b) for a, b in zip(watched_start, watched_end)]
    stopped.set()
    for connection in connections:
        connection.close()
    await asyncio.wait([c.lost for c in connections], timeout=5)
    latencies = sorted(stats.latencies)
    p50, p99 = percentile(latencies, 0.50), percentile(latencies, 0.99)
    seconds = stats.end - stats.start
    return {
        "requests": len(latencies), "errors": stats.errors, "error_samples": stats.error_samples,
        "seconds": seconds, "rps": len(latencies) / seconds,
        "events": stats.events, "events_per_s": stats.events / seconds,
        "p50_ms": None if p50 is None else p50 * 1000, "p99_ms": None if p99 is None else p99 * 1000,
        "cpu_s": cpu, "watched_cpu_s": [None if span is None else span[0] for span in spans],
        "watched_wait_s": [None if span is None else span[1] for span in spans],
    }


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, required=True, help="server port on 127.0.0.1")
    parser.add_argument("--body-file", required=True, help="JSON request body for POST /v1/chat/completions")
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--duration", type=float, default=3.0, help="measured seconds")
    parser.add_argument("--warmup", type=float, default=0.5, help="unmeasured seconds first, same connections")
    parser.add_argument("--patience", type=float, default=0.0,
                        help="seconds an empty window may stay open past --duration for its first measurement")
    parser.add_argument("--watch-pid", type=int, action="append", default=[],
                        help="report this process's CPU and CPU-wait seconds in the window (repeatable)")
    options = parser.parse_args(argv)
    with open(options.body_file, "rb") as f:
        body = f.read()
    result = asyncio.run(run(options.port, body, options.concurrency, options.duration, options.warmup,
                             options.watch_pid, options.patience))
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
