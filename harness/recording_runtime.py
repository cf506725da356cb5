"""A recording OpenAI-compatible runtime: records every request as received, answers from a script.

It stands where vLLM, Ollama or llama.cpp's server would, as a real HTTP
server (twisted.web on loopback, an ephemeral port) in a child process of
its own, so that tests in any process can drive it:

- any method on any path but ``/_rec/...`` is recorded exactly as received
  (method, path with query string, headers in order, raw body) and answered
  with the next scripted answer: a status, reason phrase and headers, then
  either a whole body or a list of chunks written (and flushed) one by one,
  which is how a server streams SSE events, tool-call deltas and usage
  chunks; with no answer scripted it answers 599 so that a test sees it;
- ``POST /_rec/script`` appends answers (JSON list), ``GET /_rec/requests``
  returns the recorded requests, ``POST /_rec/reset`` forgets both.

Run ``python -m harness.recording_runtime PORT_FILE``; :class:`RecordingRuntime`
starts it, and the helpers below script it and read what it recorded.
"""

from __future__ import annotations

import base64
import json
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from protocol.agent.runtime_identity import IDENTITY_PATHS

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Answer:
    """What the runtime answers one request with: ``body`` whole, or ``chunks`` one write each;
    ``end`` says how the answer ends (see the module docstring): ``finish``, ``drop``, ``abort``
    or ``close``."""

    status: int = 200
    reason: str = "OK"
    headers: tuple[tuple[str, str], ...] = (("Content-Type", "application/json"),)
    body: bytes = b"{}"
    chunks: tuple[bytes, ...] | None = None
    end: str = "finish"

    def to_json(self) -> dict[str, Any]:
        return {
            "status": self.status, "reason": self.reason, "headers": [list(h) for h in self.headers],
            "body": base64.b64encode(self.body).decode(),
            "chunks": None if self.chunks is None else [base64.b64encode(c).decode() for c in self.chunks],
            "end": self.end,
        }

    @property
    def payload(self) -> bytes:
        """The bytes the client should read: the body, or the chunks joined."""
        return b"".join(self.chunks) if self.chunks is not None else self.body


@dataclass(frozen=True)
class Recorded:
    """One request exactly as the runtime received it."""

    method: str
    path: str
    headers: tuple[tuple[str, str], ...]
    body: bytes = field(repr=False)
    #: When it was read (``time.time()`` in the runtime's process: the same clock as the test's).
    at: float = 0.0

    def header(self, name: str) -> str | None:
        values = [v for n, v in self.headers if n.lower() == name.lower()]
        return values[0] if values else None


class RecordingRuntime:
    """The recording runtime as a child process; ``url`` is its root (give it to ``--upstream``)."""

    def __init__(self, log_dir: Path) -> None:
        port_file = log_dir / "recording-runtime.port"
        self._log = open(log_dir / "recording-runtime.log", "wb")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "harness.recording_runtime", str(port_file)],
            cwd=ROOT, stdout=self._log, stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 20
        while not (port_file.exists() and port_file.read_text().strip()):
            if self.process.poll() is not None or time.monotonic() > deadline:
                log = (log_dir / "recording-runtime.log").read_text()
                raise AssertionError(f"the recording runtime did not start: {log}")
            time.sleep(0.02)
        self.url = f"http://127.0.0.1:{int(port_file.read_text())}"

    def _call(self, method: str, path: str, payload: Any = None) -> Any:
        data = None if payload is None else json.dumps(payload).encode()
        request = urllib.request.Request(self.url + path, data=data, method=method)
        with urllib.request.urlopen(request, timeout=5) as response:
            return json.loads(response.read())

    def script(self, *answers: Answer) -> None:
        """Answer the next requests with ``answers``, in order."""
        self._call("POST", "/_rec/script", [a.to_json() for a in answers])

    def requests(self) -> list[Recorded]:
        return [
            Recorded(r["method"], r["path"], tuple((n, v) for n, v in r["headers"]), base64.b64decode(r["body"]),
                     r["at"])
            for r in self._call("GET", "/_rec/requests")
        ]

    def reset(self) -> None:
        self._call("POST", "/_rec/reset", [])

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(5)
        self._log.close()


# --- the server (runs in the child process) ---------------------------------------


def _serve(port_file: str) -> None:
    from twisted.internet import reactor
    from twisted.web import resource, server

    answers: list[dict[str, Any]] = []
    recorded: list[dict[str, Any]] = []

    class RecordingResource(resource.Resource):
        isLeaf = True

        def render(self, request: server.Request) -> bytes | int:
            uri = request.uri.decode("latin-1")
            body = request.content.read()
            if uri.startswith("/_rec/"):
                return self._control(uri, body, request)
            if uri == "/health":
                # The engine agent's readiness check: answered, never recorded or scripted.
                return b""
            if uri in ("/metrics", "/slots", *IDENTITY_PATHS):
                # The agent's load and identity probes: this runtime reports no load and no version, like most.
                request.setResponseCode(404)
                return b""
            recorded.append({
                "method": request.method.decode("latin-1"), "path": uri,
                "headers": [[n.decode("latin-1"), v.decode("latin-1")]
                            for n, vs in request.requestHeaders.getAllRawHeaders() for v in vs],
                "body": base64.b64encode(body).decode(),
                "at": time.time(),
            })
            request.defaultContentType = None
            if not answers:
                request.setResponseCode(599, b"No Scripted Answer")
                return b""
            answer = answers.pop(0)
            end = answer.get("end", "finish")
            if end == "drop":
                request.channel.transport.loseConnection()
                return server.NOT_DONE_YET
            if end == "close":
                self._write_unframed(request, answer)
                return server.NOT_DONE_YET
            request.setResponseCode(answer["status"], answer["reason"].encode("latin-1"))
            for name, value in answer["headers"]:
                request.responseHeaders.addRawHeader(name.encode("latin-1"), value.encode("latin-1"))
            if answer["chunks"] is None:
                return base64.b64decode(answer["body"])
            chunks = [base64.b64decode(c) for c in answer["chunks"]]
            self._write_chunks(request, chunks, end == "abort")
            return server.NOT_DONE_YET

        def _write_chunks(self, request: server.Request, chunks: list[bytes], abort: bool) -> None:
            if request._disconnected:
                return
            if not chunks:
                if abort:
                    request.channel.transport.abortConnection()
                else:
                    request.finish()
                return
            request.write(chunks.pop(0))
            reactor.callLater(0.002, self._write_chunks, request, chunks, abort)

        def _write_unframed(self, request: server.Request, answer: dict[str, Any]) -> None:
            """The answer as HTTP/1.0 sends a body of unknown length: no framing, then the close."""
            transport = request.channel.transport
            head = f"HTTP/1.1 {answer['status']} {answer['reason']}\r\n".encode("latin-1")
            for name, value in answer["headers"]:
                head += f"{name}: {value}\r\n".encode("latin-1")
            transport.write(head + b"Connection: close\r\n\r\n")
            chunks = [base64.b64decode(c) for c in answer["chunks"] or [answer["body"]]]

            def write_next() -> None:
                if chunks:
                    transport.write(chunks.pop(0))
                    reactor.callLater(0.002, write_next)
                else:
                    transport.loseConnection()

            write_next()

        def _control(self, uri: str, body: bytes, request: server.Request) -> bytes:
            request.setHeader(b"content-type", b"application/json")
            if uri == "/_rec/script":
                answers.extend(json.loads(body))
                return b"[]"
            if uri == "/_rec/requests":
                return json.dumps(recorded).encode()
            if uri == "/_rec/reset":
                answers.clear()
                recorded.clear()
                return b"[]"
            request.setResponseCode(404)
            return b"[]"

    port = reactor.listenTCP(0, server.Site(RecordingResource()), interface="127.0.0.1")
    Path(port_file).write_text(str(port.getHost().port))
    reactor.run()


if __name__ == "__main__":
    _serve(sys.argv[1])
