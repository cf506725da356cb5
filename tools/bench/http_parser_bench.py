#!/usr/bin/env python
"""Which HTTP/1.1 response parser the runtime client stands on: httptools, h11, or Twisted's own.

The engine agent's (and the gateway's, for runtimes by URL) client to a
runtime reads two kinds of answer, and this benchmark feeds each parser
exactly those bytes, the way they arrive from the socket:

- ``json``: a non-streamed chat answer as uvicorn sends it (``content-length``,
  about 500 bytes of JSON), in one read;
- ``sse``: a streamed answer of 64 words (67 events) with chunked framing,
  one read per event as a runtime writes them (vLLM, SGLang, llama.cpp's
  server and Starlette flush one event at a time).

Each parser is driven to the same result: the status, the header list and
the body pieces handed over. ``httptools`` (llhttp in C, callbacks) and
``h11`` (pure Python, events) parse alone; ``twisted`` is
``twisted.web._newclient.HTTP11ClientProtocol`` on a ``StringTransport``
with a request written first, i.e. what ``Agent`` does per response once
its connection is pooled (its URI parsing and pool bookkeeping come on
top). Times are CPU microseconds per whole response (``time.process_time``),
medians of ``--repeats`` runs, the parsers alternating.

    .venv/bin/python tools/bench/http_parser_bench.py [--repeats 5] [--responses 2000] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any, Callable

import h11
import httptools
from twisted.internet.testing import StringTransport
from twisted.web._newclient import HTTP11ClientProtocol, Request
from twisted.web.client import ResponseDone
from twisted.web.http_headers import Headers
from twisted.internet.protocol import Protocol

WORDS = 64


def json_response() -> list[bytes]:
    body = json.dumps({"id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": "echo",
                       "choices": [{"index": 0, "message": {"role": "assistant", "content": "Hello"},
                                    "logprobs": None, "finish_reason": "stop"}],
                       "usage": {"prompt_tokens": 17, "completion_tokens": 1, "total_tokens": 18}},
                      separators=(",", ":")).encode() * 2
    head = (b"HTTP/1.1 200 OK\r\ndate: Wed, 02 Dec 2026 10:00:00 GMT\r\nserver: uvicorn\r\n"
            b"content-length: %d\r\ncontent-type: application/json\r\n\r\n" % len(body))
    return [head + body]


def sse_response() -> list[bytes]:
    def chunk(data: bytes) -> bytes:
        return b"%x\r\n%s\r\n" % (len(data), data)

    def event(delta: dict[str, Any], reason: str | None = None) -> bytes:
        payload = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "echo",
                   "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}]}
        return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"

    head = (b"HTTP/1.1 200 OK\r\ndate: Wed, 02 Dec 2026 10:00:00 GMT\r\nserver: uvicorn\r\n"
            b"content-type: text/event-stream; charset=utf-8\r\ntransfer-encoding: chunked\r\n\r\n")
    events = [event({"role": "assistant", "content": ""})]
    events += [event({"content": f"word{i} "}) for i in range(WORDS)]
    events += [event({}, "stop"), b"data: [DONE]\n\n"]
    reads = [head + chunk(events[0])] + [chunk(e) for e in events[1:]]
    reads[-1] += b"0\r\n\r\n"
    return reads


class _HttptoolsReader:
    """What the runtime client's connection does with httptools: status, headers, body pieces, end."""

    def __init__(self) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.headers: list[tuple[bytes, bytes]] = []
        self.pieces: list[bytes] = []
        self.done = False

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name, value))

    def on_body(self, body: bytes) -> None:
        self.pieces.append(body)

    def on_message_complete(self) -> None:
        self.done = True


def run_httptools(reads: list[bytes]) -> int:
    reader = _HttptoolsReader()
    for data in reads:
        reader.parser.feed_data(data)
    assert reader.done and reader.parser.get_status_code() == 200
    return len(reader.pieces)


def run_h11(reads: list[bytes]) -> int:
    connection = h11.Connection(h11.CLIENT)
    connection.send(h11.Request(method="POST", target="/v1/chat/completions",
                                headers=[("host", "runtime"), ("content-length", "2")]))
    connection.send(h11.Data(data=b"{}"))
    connection.send(h11.EndOfMessage())
    pieces = 0
    done = False
    for data in reads:
        connection.receive_data(data)
        while True:
            event = connection.next_event()
            if event is h11.NEED_DATA:
                break
            if isinstance(event, h11.Response):
                assert event.status_code == 200
            elif isinstance(event, h11.Data):
                pieces += 1
            elif isinstance(event, h11.EndOfMessage):
                done = True
                break
    assert done
    return pieces


class _TwistedBody(Protocol):
    def __init__(self) -> None:
        self.pieces = 0
        self.done = False

    def dataReceived(self, data: bytes) -> None:
        self.pieces += 1

    def connectionLost(self, reason: Any = None) -> None:
        self.done = reason is not None and reason.check(ResponseDone) is not None


def run_twisted(reads: list[bytes]) -> int:
    protocol = HTTP11ClientProtocol()
    protocol.makeConnection(StringTransport())
    request = Request(b"POST", b"/v1/chat/completions", Headers({b"host": [b"runtime"]}), None, persistent=True)
    body = _TwistedBody()
    protocol.request(request).addCallback(lambda response: response.deliverBody(body))
    for data in reads:
        protocol.dataReceived(data)
    assert body.done
    return body.pieces


PARSERS: dict[str, Callable[[list[bytes]], int]] = {"httptools": run_httptools, "h11": run_h11, "twisted": run_twisted}
RESPONSES = {"json": json_response(), "sse": sse_response()}


def measure(run: Callable[[list[bytes]], int], reads: list[bytes], count: int) -> float:
    """CPU microseconds per response over ``count`` responses."""
    started = time.process_time()
    for _ in range(count):
        run(reads)
    return (time.process_time() - started) * 1e6 / count


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--responses", type=int, default=2000, help="responses per run (sse: a tenth of it)")
    parser.add_argument("--json", action="store_true", help="one JSON object per response kind")
    options = parser.parse_args(argv)
    times: dict[tuple[str, str], list[float]] = {}
    for name, reads in RESPONSES.items():
        count = options.responses if name == "json" else max(1, options.responses // 10)
        for run in PARSERS.values():
            run(reads)  # warm up, and check each parser reads the answer whole
        for repeat in range(options.repeats):
            order = list(PARSERS)[repeat % len(PARSERS):] + list(PARSERS)[:repeat % len(PARSERS)]
            for parser_name in order:
                times.setdefault((name, parser_name), []).append(measure(PARSERS[parser_name], reads, count))
    rows = []
    for name in RESPONSES:
        row: dict[str, Any] = {"response": name, "reads": len(RESPONSES[name])}
        for parser_name in PARSERS:
            row[f"{parser_name}_us"] = statistics.median(times[(name, parser_name)])
        rows.append(row)
    if options.json:
        for row in rows:
            print(json.dumps(row))
        return 0
    print(f"CPU µs per response, medians of {options.repeats}; python {sys.version.split()[0]}, "
          f"httptools {httptools.__version__}, h11 {h11.__version__}")
    print(f"{'response':10} {'reads':>5} {'httptools':>10} {'h11':>10} {'twisted':>10} {'h11/httptools':>14} "
          f"{'twisted/httptools':>18}")
    for row in rows:
        print(f"{row['response']:10} {row['reads']:>5} {row['httptools_us']:>10.1f} {row['h11_us']:>10.1f} "
              f"{row['twisted_us']:>10.1f} {row['h11_us'] / row['httptools_us']:>13.1f}x "
              f"{row['twisted_us'] / row['httptools_us']:>17.1f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
