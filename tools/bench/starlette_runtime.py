#!/usr/bin/env python
"""An OpenAI-compatible runtime built the way users' runtimes are: a Starlette app on uvicorn.

vLLM, SGLang and llama-cpp-python serve their OpenAI API from
Starlette (FastAPI) on uvicorn, and stream a completion as one chunk per
token. This server does the same around the echo answers of
``http_echo_server.py`` (the same bytes, so the two runtimes differ only
in how they serve them): ``POST /v1/chat/completions`` answers with the
last user message echoed back, and with ``stream: true`` sends one
server-sent event per word, each its own HTTP chunk and ``send`` (no
delay between them); ``GET /health`` answers 200 and ``GET /v1/models``
lists ``--model``, which is what the engine agent and the routers of
``peers.py`` check. uvicorn runs as installed in ``.venv`` (by
``llama-cpp-python[server]``): its asyncio loop and its ``h11`` HTTP
parser, no access log.

    python tools/bench/starlette_runtime.py [--port N] [--model echo]

It prints the port it listens on (127.0.0.1) as its first stdout line and
exits when its stdin closes, as ``http_echo_server.py`` does.
"""

from __future__ import annotations

import argparse
import itertools
import json
import socket
import sys
import threading
from pathlib import Path
from typing import AsyncIterator

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

sys.path.insert(0, str(Path(__file__).resolve().parent))

from http_echo_server import chat_body, chat_events  # noqa: E402


def build_app(model: str) -> Starlette:
    """The runtime's routes; ``model`` is the one name ``/v1/models`` lists (requests may name any)."""
    counter = itertools.count(1)

    async def chat(request: Request) -> Response:
        try:
            body = json.loads(await request.body())
        except ValueError:
            return JSONResponse({"error": {"message": "bad JSON", "type": "invalid_request_error"}}, 400)
        if not isinstance(body, dict):
            return JSONResponse({"error": {"message": "not an object", "type": "invalid_request_error"}}, 400)
        if not body.get("stream"):
            return Response(chat_body(body, next(counter)), media_type="application/json")
        events = chat_events(body, next(counter))

        async def each() -> AsyncIterator[bytes]:
            for event in events:
                yield event

        return StreamingResponse(each(), media_type="text/event-stream")

    async def health(request: Request) -> Response:
        return JSONResponse({})

    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": model, "object": "model", "owned_by": "bench"}]})

    return Starlette(routes=[
        Route("/v1/chat/completions", chat, methods=["POST"]),
        Route("/health", health, methods=["GET"]),
        Route("/v1/models", models, methods=["GET"]),
    ])


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, default=0, help="port on 127.0.0.1 (default: any free one)")
    parser.add_argument("--model", default="echo", help="the model /v1/models lists (default: echo)")
    options = parser.parse_args(argv)
    # Bound and listening here rather than in uvicorn, so that the port is known (and printed) once it
    # accepts. IPPROTO_TCP, as asyncio's own listeners have: asyncio sets TCP_NODELAY on accepted
    # sockets only for that protocol number, and without it every answer (head and body written
    # apart) waits ~40 ms for the client's delayed ACK.
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", options.port))
    listener.listen(1024)
    server = uvicorn.Server(uvicorn.Config(build_app(options.model), access_log=False, log_level="warning",
                                           lifespan="off"))

    def exit_when_stdin_closes() -> None:
        sys.stdin.read()
        server.should_exit = True

    threading.Thread(target=exit_when_stdin_closes, daemon=True).start()
    print(listener.getsockname()[1], flush=True)
    server.run(sockets=[listener])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
