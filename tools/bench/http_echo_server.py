#!/usr/bin/env python
"""A lean OpenAI-compatible echo server: the benchmark's runtime, and its no-gateway baseline.

It answers ``POST /v1/chat/completions`` the way infx's built-in echo
runtime does (the last user message's text, echoed back; usage counts
whitespace-separated words), with ``stream: true`` as server-sent events
sent at once (no token delay: the runtime should never be what a benchmark
waits for), and ``GET /health`` with 200, which the routers of
``peers.py`` check before they send a worker anything. HTTP/1.1
keep-alive on raw asyncio, one ``write`` per response, no framework: it
must stay much faster than what it is compared with. Only what the
benchmark sends is supported (``Content-Length`` bodies, no pipelining
guarantees beyond in-order answers). ``starlette_runtime.py`` serves the
same answers the way real runtimes do.

    python tools/bench/http_echo_server.py [--port N]

It prints the port it listens on (127.0.0.1) as its first stdout line and
exits when its stdin closes, so the orchestrator can never leak it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import sys
import time
from typing import Any

CHAT_PATH = b"/v1/chat/completions"
HEALTH_PATH = b"/health"
MAX_HEAD = 64 * 1024
_PIECE = re.compile(r"\S+\s*")


def _text(message: Any) -> str:
    content = message.get("content") if isinstance(message, dict) else None
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
    return ""


def chat_answer(request: Any, counter: int) -> tuple[bytes, bytes]:
    """The response's content type and body for one chat completion request."""
    if request.get("stream"):
        return b"text/event-stream", b"".join(chat_events(request, counter))
    return b"application/json", chat_body(request, counter)


def chat_body(request: Any, counter: int) -> bytes:
    """The JSON body of a non-streamed answer to ``request``."""
    common, pieces, usage = _echo(request, counter)
    body = {**common, "object": "chat.completion", "choices": [{
        "index": 0, "message": {"role": "assistant", "content": "".join(pieces)},
        "logprobs": None, "finish_reason": "stop"}], "usage": usage}
    return json.dumps(body, separators=(",", ":")).encode()


def chat_events(request: Any, counter: int) -> list[bytes]:
    """The server-sent events of a streamed answer to ``request``: the role, one per word, the stop, ``[DONE]``."""
    common, pieces, _ = _echo(request, counter)

    def event(delta: dict[str, Any], reason: str | None = None) -> bytes:
        chunk = {**common, "object": "chat.completion.chunk",
                 "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}]}
        return b"data: " + json.dumps(chunk, separators=(",", ":")).encode() + b"\n\n"

    events = [event({"role": "assistant", "content": ""})]
    events += [event({"content": piece}) for piece in pieces]
    events += [event({}, "stop"), b"data: [DONE]\n\n"]
    return events


def _echo(request: Any, counter: int) -> tuple[dict[str, Any], list[str], dict[str, int]]:
    """What both answer forms share: the common fields, the echoed pieces and the usage."""
    messages = request.get("messages") or []
    user = [_text(m) for m in messages if isinstance(m, dict) and m.get("role") == "user"]
    text = user[-1] if user else ""
    pieces = _PIECE.findall(text)
    if pieces:
        pieces[0] = text[: len(text) - len(text.lstrip())] + pieces[0]
    prompt_tokens = sum(len(_text(m).split()) for m in messages)
    usage = {"prompt_tokens": prompt_tokens, "completion_tokens": len(pieces),
             "total_tokens": prompt_tokens + len(pieces), "prompt_tokens_details": {"cached_tokens": 0}}
    model = str(request.get("model", ""))
    common = {"id": f"chatcmpl-echo{counter}", "created": int(time.time()), "model": model}
    return common, pieces, usage


def _response(status: bytes, content_type: bytes, body: bytes, close: bool) -> bytes:
    return b"".join([
        b"HTTP/1.1 ", status, b"\r\nContent-Type: ", content_type,
        b"\r\nContent-Length: ", str(len(body)).encode(),
        b"\r\nConnection: close\r\n\r\n" if close else b"\r\n\r\n", body,
    ])


class EchoProtocol(asyncio.Protocol):
    """One keep-alive connection: parse head and ``Content-Length`` body, answer, repeat."""

    counter = 0

    def __init__(self) -> None:
        self.buffer = bytearray()
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        while self.transport is not None:
            end = self.buffer.find(b"\r\n\r\n")
            if end < 0:
                if len(self.buffer) > MAX_HEAD:
                    self._fail(b"431 Request Header Fields Too Large")
                return
            head = bytes(self.buffer[:end]).split(b"\r\n")
            request_line = head[0].split(b" ")
            headers = {}
            for line in head[1:]:
                name, _, value = line.partition(b":")
                headers[name.strip().lower()] = value.strip()
            if b"chunked" in headers.get(b"transfer-encoding", b"").lower() or len(request_line) != 3:
                self._fail(b"400 Bad Request")
                return
            try:
                length = int(headers.get(b"content-length", b"0"))
            except ValueError:
                self._fail(b"400 Bad Request")
                return
            if len(self.buffer) < end + 4 + length:
                return
            body = bytes(self.buffer[end + 4:end + 4 + length])
            del self.buffer[:end + 4 + length]
            close = headers.get(b"connection", b"").lower() == b"close" or request_line[2] == b"HTTP/1.0"
            self.transport.write(self._answer(request_line[0], request_line[1], body, close))
            if close:
                self.transport.close()
                self.transport = None

    def _answer(self, method: bytes, path: bytes, body: bytes, close: bool) -> bytes:
        if method == b"GET" and path.split(b"?")[0] == HEALTH_PATH:
            return _response(b"200 OK", b"application/json", b"{}", close)
        if path.split(b"?")[0] != CHAT_PATH:
            return _response(b"404 Not Found", b"application/json", b'{"error":{"message":"not found"}}', close)
        if method != b"POST":
            return _response(b"405 Method Not Allowed", b"application/json",
                             b'{"error":{"message":"POST only"}}', close)
        try:
            request = json.loads(body)
            if not isinstance(request, dict):
                raise ValueError("not an object")
        except ValueError:
            return _response(b"400 Bad Request", b"application/json", b'{"error":{"message":"bad JSON"}}', close)
        EchoProtocol.counter += 1
        content_type, answer = chat_answer(request, EchoProtocol.counter)
        return _response(b"200 OK", content_type, answer, close)

    def _fail(self, status: bytes) -> None:
        assert self.transport is not None
        self.transport.write(_response(status, b"text/plain", status + b"\n", True))
        self.transport.close()
        self.transport = None

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None


async def serve(port: int) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(EchoProtocol, "127.0.0.1", port, backlog=1024)
    print(server.sockets[0].getsockname()[1], flush=True)
    # Exit when the parent closes our stdin (or dies).
    await loop.run_in_executor(None, sys.stdin.read)
    server.close()


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, default=0, help="port on 127.0.0.1 (default: any free one)")
    options = parser.parse_args(argv)
    asyncio.run(serve(options.port))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
