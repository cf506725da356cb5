"""A small OpenAI-compatible HTTP server for the ``openai`` runtime's tests (http.server on a thread).

It stands where vLLM or Ollama would: ``POST /v1/chat/completions``
(JSON, or SSE when ``stream`` is true, sent with chunked transfer encoding
one event per chunk), ``POST /v1/embeddings`` and ``GET /health``. The answer is the last
user message prefixed with ``upstream:``; a user message of exactly
``fail with 400`` gets an OpenAI-style 400. Every request is recorded
(path, headers, JSON body) so a test can check what the engine forwarded.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


@dataclass(frozen=True)
class ReceivedRequest:
    path: str
    headers: dict[str, str]
    body: dict[str, Any]


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: FakeOpenAIServer

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_GET(self) -> None:
        # The engine agent's health check, answered as vLLM does; not recorded, since a test
        # checks what the engine forwarded, and checks come at any time.
        if self.path == "/health":
            self._json(200, {})
        else:
            self._json(404, {"error": {"message": f"no route {self.path}", "type": "invalid_request_error"}})

    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length", "0"))
        body = json.loads(self.rfile.read(length) or b"{}")
        self.server.record(ReceivedRequest(self.path, {k.lower(): v for k, v in self.headers.items()}, body))
        if self.path == "/v1/chat/completions":
            self._chat(body)
        elif self.path == "/v1/embeddings":
            data = [{"object": "embedding", "index": i, "embedding": [float(i), 0.5]}
                    for i, _ in enumerate(body["input"] if isinstance(body["input"], list) else [body["input"]])]
            self._json(200, {"object": "list", "model": body["model"], "data": data,
                             "usage": {"prompt_tokens": 1, "total_tokens": 1}})
        else:
            self._json(404, {"error": {"message": f"no route {self.path}", "type": "invalid_request_error"}})

    def _chat(self, body: dict[str, Any]) -> None:
        users = [m["content"] for m in body["messages"] if m["role"] == "user"]
        text = users[-1] if users else ""
        if text == "fail with 400":
            self._json(400, {"error": {"message": "upstream refused the request", "type": "invalid_request_error",
                                       "param": "messages", "code": None}})
            return
        words = ["upstream:", *text.split()]
        if not body.get("stream"):
            self._json(200, {"id": "chatcmpl-up", "object": "chat.completion", "created": 1, "model": body["model"],
                             "choices": [{"index": 0, "finish_reason": "stop",
                                          "message": {"role": "assistant", "content": " ".join(words)}}]})
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        for i, word in enumerate(words):
            chunk = {"id": "chatcmpl-up", "object": "chat.completion.chunk", "created": 1, "model": body["model"],
                     "choices": [{"index": 0, "delta": {"content": word if i == 0 else " " + word},
                                  "finish_reason": None}]}
            self._chunk(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        self._chunk(b"data: [DONE]\n\n")
        self._chunk(b"")

    def _chunk(self, data: bytes) -> None:
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.wfile.flush()

    def _json(self, status: int, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


class FakeOpenAIServer(ThreadingHTTPServer):
    """Serves on ``127.0.0.1`` (a free port) from a daemon thread until ``close()``."""

    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.requests: list[ReceivedRequest] = []
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self.serve_forever, name="fake-openai", daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def record(self, request: ReceivedRequest) -> None:
        with self._lock:
            self.requests.append(request)

    def close(self) -> None:
        self.shutdown()
        self.server_close()
        self._thread.join(timeout=5)
