"""What every implementation's half of the gRPC benchmark agrees on: methods, payloads and the result record.

Raw bytes only (no protobuf), so the numbers measure the gRPC stacks. The
server implements two methods:

- ``/bench.Bench/Unary``: echoes its request (a 100 B payload in the unary test);
- ``/bench.Bench/Sink``: a client stream; counts the messages and replies with
  the count as 8 big-endian bytes once the client half-closes.

A client run sends for ``duration`` seconds and returns a ``Result`` as one
JSON line; the orchestrator in ``grpc_bench.py`` turns it into a rate.
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict, dataclass

UNARY = "/bench.Bench/Unary"
SINK = "/bench.Bench/Sink"
SERVICE = "bench.Bench"

UNARY_PAYLOAD = bytes(100)
KiB = 1 << 10
MiB = 1 << 20
WARMUP_CALLS = 20

# test name -> (message size, unit); "unary" round-trips UNARY_PAYLOAD.
TESTS: dict[str, tuple[int, str]] = {
    "unary": (len(UNARY_PAYLOAD), "round trips/s"),
    "stream_1k": (KiB, "messages/s"),
    "stream_1m": (MiB, "MB/s"),
}


@dataclass(frozen=True)
class Result:
    """What one client run did: ``count`` calls or messages of ``size`` bytes in ``seconds``."""

    count: int
    size: int
    seconds: float

    def rate(self, test: str) -> float:
        if TESTS[test][1] == "MB/s":
            return self.count * self.size / 1e6 / self.seconds
        return self.count / self.seconds

    def emit(self) -> None:
        print(json.dumps(asdict(self)), flush=True)


def encode_count(count: int) -> bytes:
    return count.to_bytes(8, "big")


def decode_count(data: bytes) -> int:
    return int.from_bytes(data, "big")


def check_sink_reply(sent: int, reply: bytes) -> None:
    """The server must have seen every message the client sent."""
    if decode_count(reply) != sent:
        sys.exit(f"sink counted {decode_count(reply)} messages, client sent {sent}")


def announce_port(port: int) -> None:
    """Tell the orchestrator (reading our stdout) where the server listens."""
    print(port, flush=True)
