"""Hostile-peer drivers shared by the atheris targets and the Hypothesis suites.

A driver takes its choices from a :class:`Source` (atheris'
``FuzzedDataProvider``, Hypothesis' ``data.draw`` or a seeded ``Random``,
behind one small interface), plays a misbehaving peer against one of infx's
pure machines, acts as a well-behaved application on the other side, and
checks the machine's promises as it goes.  A broken promise raises
:class:`InvariantViolated` (or whatever the machine let escape); either is a
finding.

No I/O, no clock: time is a float the driver steps by hand, like the machines
themselves expect.

Promises checked for :class:`GrpcServerDriver` / :class:`GrpcClientDriver`:

- nothing escapes ``receive_data``, ``handle_timeout`` or ``connection_lost``;
- events only ever name calls the application knows, and a call ends at most
  once; after the application finished a call, the rest of the same batch may
  still mention it (the batch was produced first) and a server may still get
  ``CallEnded`` for a status that was queued but never written;
- commands the application issues in answer to events never raise (a
  client's ``start_call`` may raise ``CallLimitReached`` only);
- after ``handle_timeout(now)`` the machine never asks to be woken at or
  before ``now`` again (no busy loop, so no hang);
- after the connection is lost every call has ended and nothing more is due.

:func:`check_openai_body` and :func:`check_runtime_answer` state the OpenAI
converters' promises: a request or a 400, a conversion or a 502.
"""

from __future__ import annotations

import gzip
import json
import struct
from typing import Any, Protocol, Sequence, TypeVar

import hpack

from protocol.grpc import (
    CallEnded,
    CallLimitReached,
    CallStarted,
    ConnectionTerminated,
    GoAwayReceived,
    GrpcConfig,
    GrpcConnection,
    InputEnded,
    MessageReceived,
    PingAcknowledged,
    ResponseHeadersReceived,
    SendBufferDrained,
    StatusCode,
)
from protocol.openai.completions import text_completion_body, text_completion_event_data
from protocol.openai.errors import InvalidRequestError, UpstreamError
from protocol.openai.requests import (
    parse_chat_completion,
    parse_completion,
    parse_embedding,
    parse_model_response,
    parse_tokenize,
)
from protocol.openai.runtime import runtime_request
from protocol.openai.sse import EventReceived, SSEParser
from protocol.openai.verbatim import parse_json

T = TypeVar("T")

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"

# HTTP/2 frame types (RFC 9113 section 6) and the flags the drivers use.
DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH_PROMISE, PING, GOAWAY, WINDOW_UPDATE, CONTINUATION = range(10)
END_STREAM, ACK, END_HEADERS, PADDED, PRIORITY_FLAG = 0x1, 0x1, 0x4, 0x8, 0x20


class InvariantViolated(AssertionError):
    """A machine broke one of the promises listed in the module docstring."""


def check(condition: bool, message: str) -> None:
    if not condition:
        raise InvariantViolated(message)


class Source(Protocol):
    """Where a driver takes its choices from."""

    def integer(self, lo: int, hi: int) -> int: ...

    def blob(self, max_size: int) -> bytes: ...

    def flag(self) -> bool: ...

    def more(self) -> bool:
        """Whether the input has more to give (the driver's loop condition)."""


def pick(source: Source, items: Sequence[T]) -> T:
    return items[source.integer(0, len(items) - 1)]


class AtherisSource:
    """A :class:`Source` over atheris' FuzzedDataProvider."""

    def __init__(self, fdp: Any) -> None:
        self.fdp = fdp

    def integer(self, lo: int, hi: int) -> int:
        return int(self.fdp.ConsumeIntInRange(lo, hi))

    def blob(self, max_size: int) -> bytes:
        return bytes(self.fdp.ConsumeBytes(self.fdp.ConsumeIntInRange(0, max_size)))

    def flag(self) -> bool:
        return bool(self.fdp.ConsumeBool())

    def more(self) -> bool:
        return int(self.fdp.remaining_bytes()) > 0


class RandomSource:
    """A :class:`Source` over a seeded ``random.Random``, for choices made
    where Hypothesis cannot draw (inside Twisted callbacks)."""

    def __init__(self, seed: int, steps: int = 12) -> None:
        import random

        self.rng = random.Random(seed)
        self.steps = steps

    def integer(self, lo: int, hi: int) -> int:
        return self.rng.randint(lo, hi)

    def blob(self, max_size: int) -> bytes:
        return self.rng.randbytes(self.rng.randint(0, max_size))

    def flag(self) -> bool:
        return self.rng.random() < 0.5

    def more(self) -> bool:
        self.steps -= 1
        return self.steps >= 0


class HypothesisSource:
    """A :class:`Source` over Hypothesis' ``st.data()``; ``steps`` bounds the loop."""

    def __init__(self, data: Any, steps: int = 12) -> None:
        from hypothesis import strategies as st

        self._st = st
        self.data = data
        self.steps = steps

    def integer(self, lo: int, hi: int) -> int:
        return int(self.data.draw(self._st.integers(lo, hi)))

    def blob(self, max_size: int) -> bytes:
        return bytes(self.data.draw(self._st.binary(max_size=max_size)))

    def flag(self) -> bool:
        return bool(self.data.draw(self._st.booleans()))

    def more(self) -> bool:
        self.steps -= 1
        return self.steps >= 0 and bool(self.data.draw(self._st.booleans()))


# ---------------------------------------------------------------------------
# HTTP/2 frames a misbehaving peer might send


def frame(kind: int, flags: int, stream_id: int, payload: bytes) -> bytes:
    """One raw HTTP/2 frame; the length field is the payload's (the reserved bit may be set)."""
    return struct.pack(">I", len(payload))[1:] + bytes([kind, flags]) + struct.pack(">I", stream_id & 0xFFFFFFFF)


def raw_frame(kind: int, flags: int, stream_id: int, payload: bytes) -> bytes:
    return frame(kind, flags, stream_id, payload) + payload


def grpc_message(source: Source) -> bytes:
    """A length-prefixed gRPC message, honest or not (flag, length, gzip body)."""
    body = source.blob(64)
    shape = source.integer(0, 5)
    if shape == 0:
        return struct.pack(">BI", 0, len(body)) + body
    if shape == 1:
        packed = gzip.compress(body)
        return struct.pack(">BI", 1, len(packed)) + packed
    if shape == 2:
        return struct.pack(">BI", source.integer(0, 255), len(body)) + body
    if shape == 3:
        # A length that lies: shorter, longer, or past every limit.
        return struct.pack(">BI", source.integer(0, 1), source.integer(0, 2**32 - 1)) + body
    if shape == 4:
        return struct.pack(">BI", 1, len(body)) + body  # "compressed" but not gzip
    return body


_TIMEOUTS = [b"1S", b"0n", b"99999999H", b"10m", b"", b"1", b"S", b"123456789S", b"-1S", b"1.5S", b"1s"]
_ENCODINGS = [b"gzip", b"identity", b"br", b"", b"GZIP", b"deflate"]


def request_headers(source: Source, large: int) -> list[tuple[bytes, bytes]]:
    """gRPC request headers, each maybe dropped, replaced or joined by a hostile one."""
    headers = [
        (b":method", pick(source, [b"POST"] * 6 + [b"GET", b"PUT"])),
        (b":scheme", b"http"),
        (b":path", pick(source, [b"/s/Echo", b"/s/Stream", b"/s/Missing", b"", b"*", b"/s/Echo?x=1"])),
        (b":authority", b"x"),
        (b"te", pick(source, [b"trailers"] * 4 + [b"gzip"])),
        (b"content-type", pick(source, [b"application/grpc"] * 4 + [b"application/grpc+proto", b"text/html", b""])),
    ]
    return _mutate(source, headers, large)


def response_headers(source: Source, large: int) -> list[tuple[bytes, bytes]]:
    headers = [
        (b":status", pick(source, [b"200"] * 6 + [b"404", b"503", b"abc", b"100"])),
        (b"content-type", pick(source, [b"application/grpc"] * 4 + [b"text/plain", b""])),
    ]
    return _mutate(source, headers, large)


def trailer_headers(source: Source, large: int) -> list[tuple[bytes, bytes]]:
    headers = [
        (b"grpc-status", pick(source, [b"0"] * 4 + [b"13", b"99", b"-1", b"x", b""])),
        (b"grpc-message", pick(source, [b"", b"ok", b"%E2%98%BA", b"%zz%", b"\xff\xfe"])),
    ]
    return _mutate(source, headers, large)


_EXTRA_HEADERS: list[Any] = [
    lambda s: (b"grpc-timeout", pick(s, _TIMEOUTS)),
    lambda s: (b"grpc-encoding", pick(s, _ENCODINGS)),
    lambda s: (b"grpc-accept-encoding", pick(s, [b"gzip", b"identity,gzip", b"", b",,,"])),
    lambda s: (b"x-meta-bin", pick(s, [b"AAEC", b"AAE=", b"!!!", b"AA,BB", b"", b"====", b"A"])),
    lambda s: (b"x-meta", s.blob(16)),
    lambda s: (b"grpc-status", b"0"),
    lambda s: (b":path", b"/s/Echo"),
    lambda s: (b"connection", b"close"),
    lambda s: (b"Upper-Case", b"v"),
    lambda s: (s.blob(8), s.blob(8)),
]


def _mutate(source: Source, headers: list[tuple[bytes, bytes]], large: int) -> list[tuple[bytes, bytes]]:
    for _ in range(source.integer(0, 3)):
        action = source.integer(0, 4)
        if action == 0 and headers:
            del headers[source.integer(0, len(headers) - 1)]
        elif action == 1 and headers:
            index = source.integer(0, len(headers) - 1)
            headers[index] = (headers[index][0], source.blob(24))
        elif action == 2:
            headers.append(pick(source, _EXTRA_HEADERS)(source))
        else:
            headers.append((b"x-big", b"v" * source.integer(0, large)))
    if source.integer(0, 7) == 0 and len(headers) > 1:
        # Pseudo-headers after regular ones are malformed (RFC 9113 8.3).
        headers.reverse()
    return headers


class FrameWriter:
    """Turns choices into plausible-to-nasty HTTP/2 frames from one peer.

    It keeps its own HPACK encoder, so header blocks decode as long as every
    block it produced reaches the machine (frames cut short desynchronise the
    tables, which is one more hostile input).
    """

    def __init__(self, source: Source, *, client: bool, large: int = 20_000) -> None:
        self.source = source
        self.client = client
        self.large = large
        self.encoder = hpack.Encoder()
        self.next_stream = 1 if client else 2
        self.streams: list[int] = []

    def stream_id(self, new: bool = False) -> int:
        source = self.source
        choice = 0 if new else source.integer(0, 9)
        if choice <= 1 or not self.streams:
            if choice == 0 or not self.streams:
                stream_id = self.next_stream
                self.next_stream += 2
                self.streams.append(stream_id)
                return stream_id
        if choice <= 6 and self.streams:
            return pick(source, self.streams)
        return pick(source, [0, 2, 4, 0x7FFFFFFF, 0x80000001, source.integer(0, 2**31 - 1)])

    def header_block(self, headers: list[tuple[bytes, bytes]]) -> bytes:
        # Huffman-coding a big value costs milliseconds in pure Python: only small ones.
        huffman = sum(len(n) + len(v) for n, v in headers) < 2_048
        try:
            return bytes(self.encoder.encode(headers, huffman=huffman))
        except Exception:  # hpack refuses some names (not bytes-like); send nonsense instead
            return self.source.blob(32)

    def headers(self, stream_id: int, headers: list[tuple[bytes, bytes]], end_stream: bool) -> bytes:
        block = self.header_block(headers)
        flags = END_STREAM if end_stream else 0
        if self.source.integer(0, 5) == 0 and len(block) > 1:
            cut = self.source.integer(1, len(block) - 1)
            out = raw_frame(HEADERS, flags, stream_id, block[:cut])
            if self.source.integer(0, 3):
                out += raw_frame(CONTINUATION, END_HEADERS, stream_id, block[cut:])
            return out
        if self.source.integer(0, 9) == 0:
            flags |= self.source.integer(0, 255)
        return raw_frame(HEADERS, flags | END_HEADERS, stream_id, block)

    def data(self, stream_id: int) -> bytes:
        source = self.source
        payload = b"".join(grpc_message(source) for _ in range(source.integer(0, 3)))
        flags = END_STREAM if source.integer(0, 3) == 0 else 0
        if source.integer(0, 9) == 0:
            pad = source.integer(0, 255)
            return raw_frame(DATA, flags | PADDED, stream_id, bytes([pad]) + payload + bytes(min(pad, 40)))
        return raw_frame(DATA, flags, stream_id, payload)

    def control(self) -> bytes:
        source = self.source
        kind = source.integer(0, 7)
        if kind == 0:
            settings = b"".join(
                struct.pack(">HI", pick(source, [1, 2, 3, 4, 5, 6, 8, 9, source.integer(0, 0xFFFF)]),
                            pick(source, [0, 1, 100, 16_384, 65_535, 2**24, 2**31 - 1, 2**31, 2**32 - 1,
                                          source.integer(0, 2**32 - 1)]))
                for _ in range(source.integer(0, 3)))
            return raw_frame(SETTINGS, ACK if source.integer(0, 5) == 0 else 0, 0, settings)
        if kind == 1:
            return raw_frame(PING, ACK if source.flag() else 0, 0,
                             source.blob(8) if source.integer(0, 5) == 0 else bytes(8))
        if kind == 2:
            return raw_frame(WINDOW_UPDATE, 0, self.stream_id() if source.flag() else 0,
                             struct.pack(">I", pick(source, [0, 1, 65_535, 2**31 - 1, 2**31, source.integer(0, 2**31)])))
        if kind == 3:
            return raw_frame(RST_STREAM, 0, self.stream_id(),
                             struct.pack(">I", pick(source, [0, 1, 2, 7, 8, 11, 13, 99])))
        if kind == 4:
            return raw_frame(GOAWAY, 0, 0, struct.pack(">II", source.integer(0, 2**31 - 1),
                                                        pick(source, [0, 0, 1, 2, 11, 99])) + source.blob(8))
        if kind == 5:
            return raw_frame(PRIORITY, 0, self.stream_id(), struct.pack(">IB", source.integer(0, 2**32 - 1), 16))
        if kind == 6:
            return raw_frame(PUSH_PROMISE, END_HEADERS, self.stream_id(),
                             struct.pack(">I", self.next_stream + 1) + self.source.blob(8))
        return raw_frame(source.integer(10, 255), source.integer(0, 255), self.stream_id(), source.blob(16))

    def garbage(self) -> bytes:
        """Bytes that are not a frame at all, or a frame header that lies about its length."""
        source = self.source
        if source.flag():
            return source.blob(32)
        return frame(source.integer(0, 9), source.integer(0, 255), self.stream_id(), b"") + source.blob(8)


# ---------------------------------------------------------------------------
# The gRPC machine, server role, against a hostile client


def hostile_server_config(source: Source) -> GrpcConfig:
    """Small limits, so the fuzzer reaches them; keepalive sometimes on."""
    return GrpcConfig(
        client_side=False,
        max_receive_message_length=pick(source, [0, 16, 1_000, 4 * 1024 * 1024]),
        max_header_list_size=pick(source, [1_024, 4_096, 16_384]),
        max_concurrent_streams=pick(source, [1, 4, 100]),
        initial_window_size=pick(source, [65_535, 1 << 20]),
        keepalive_interval=pick(source, [None, None, 5.0]),
        keepalive_timeout=2.0,
        min_ping_interval=pick(source, [0.0, 300.0]),
    )


class _Driver:
    def __init__(self, source: Source, conn: GrpcConnection) -> None:
        self.source = source
        self.conn = conn
        self.now = 0.0
        self.terminated = False
        self.started: set[int] = set()
        self.live: set[int] = set()
        self.ended: set[int] = set()

    def feed(self, data: bytes) -> None:
        source = self.source
        while data:
            cut = len(data) if source.integer(0, 3) else source.integer(1, len(data))
            piece, data = data[:cut], data[cut:]
            self.handle(self.conn.receive_data(piece, self.now))
            self.drain()

    def drain(self) -> None:
        for _ in range(1000):
            events = self.conn.take_events()
            if not events:
                break
            self.handle(events)
        check(isinstance(self.conn.data_to_send(), bytes), "data_to_send returned a non-bytes value")

    def step_time(self) -> None:
        self.now += self.source.integer(0, 40) / 4
        deadline = self.conn.next_deadline()
        if deadline is not None and deadline <= self.now:
            self.handle(self.conn.handle_timeout(self.now))
            self.drain()
            after = self.conn.next_deadline()
            check(after is None or after > self.now,
                  f"machine asks to be woken at {after} right after handling {self.now}: busy loop")

    def finish(self) -> None:
        self.handle(self.conn.connection_lost("fuzz input ended"))
        self.drain()
        check(self.terminated, "no ConnectionTerminated after connection_lost")
        check(not self.live, f"calls {sorted(self.live)} never ended")
        check(self.conn.next_deadline() is None, "a lost connection still wants a timer")
        check(self.conn.active_calls == 0, "a lost connection still has calls")

    def handle(self, events: list[Any]) -> None:
        raise NotImplementedError

    def terminated_event(self, event: ConnectionTerminated) -> None:
        check(not self.terminated, "ConnectionTerminated twice")
        check(not self.live, f"connection terminated with calls {sorted(self.live)} not ended")
        self.terminated = True

    def end(self, stream_id: int) -> None:
        check(stream_id in self.started, f"CallEnded for unknown stream {stream_id}")
        check(stream_id not in self.ended, f"stream {stream_id} ended twice")
        self.ended.add(stream_id)
        self.live.discard(stream_id)


class GrpcServerDriver(_Driver):
    """A hostile client against a server-role GrpcConnection run by an echo application."""

    def __init__(self, source: Source, config: GrpcConfig | None = None) -> None:
        super().__init__(source, GrpcConnection(config or hostile_server_config(source)))
        self.peer = FrameWriter(source, client=True, large=self.conn.config.max_header_list_size * 2)
        self.finished: set[int] = set()  # the application sent a status
        self.done_in_batch: set[int] = set()

    def run(self) -> None:
        source = self.source
        self.conn.initiate(self.now)
        self.drain()
        opening = PREFACE if source.integer(0, 15) else source.blob(24)
        if source.integer(0, 7):
            opening += raw_frame(SETTINGS, 0, 0, b"")
        self.feed(opening)
        while source.more() and not self.terminated:
            self.feed(self.peer_bytes())
            self.step_time()
        self.finish()
        check(self.started <= self.ended | self.finished, "a call neither ended nor got a status")

    def peer_bytes(self) -> bytes:
        source, peer = self.source, self.peer
        kind = source.integer(0, 9)
        if kind <= 2:
            return peer.headers(peer.stream_id(new=kind == 0), request_headers(source, peer.large),
                                end_stream=source.integer(0, 4) == 0)
        if kind <= 5:
            return peer.data(peer.stream_id())
        if kind == 6:
            return peer.headers(peer.stream_id(), trailer_headers(source, peer.large), end_stream=True)
        if kind <= 8:
            return peer.control()
        return peer.garbage()

    def handle(self, events: list[Any]) -> None:
        conn, source = self.conn, self.source
        # A batch describes the input as it was before the application acted on
        # it: after the application finished a call, the rest of the batch may
        # still mention that call (as with h2), and the adapter must ignore it.
        self.done_in_batch = set()
        for event in events:
            if getattr(event, "stream_id", None) in self.done_in_batch:
                continue
            if isinstance(event, CallStarted):
                sid = event.stream_id
                check(sid not in self.started, f"stream {sid} started twice")
                self.started.add(sid)
                self.live.add(sid)
                action = source.integer(0, 5)
                if action == 0:
                    conn.send_initial_metadata(sid, (("x-reply", "1"), ("x-reply-bin", b"\x00")),
                                               encoding=pick(source, [None, "gzip"]))
                elif action == 1:
                    self.respond(sid, StatusCode.UNIMPLEMENTED, "no such method ☺")
                elif action == 2:
                    conn.cancel(sid)
                    self.live.discard(sid)
                    self.ended.add(sid)
                    self.done_in_batch.add(sid)
            elif isinstance(event, MessageReceived):
                sid = event.stream_id
                check(sid in self.live, f"message on a call that is not live ({sid})")
                conn.acknowledge(sid, event.flow_controlled_length)
                if source.integer(0, 2):
                    conn.send_message(sid, event.data[:1_000], compress=source.flag())
            elif isinstance(event, InputEnded):
                check(event.stream_id in self.live, f"half-close on a call that is not live ({event.stream_id})")
                self.respond(event.stream_id, StatusCode.OK, "")
            elif isinstance(event, CallEnded):
                # Also allowed after the application's status, if that status
                # was still queued behind flow control (it never reached the wire).
                self.end(event.stream_id)
            elif isinstance(event, SendBufferDrained):
                check(event.stream_id in self.started, f"drain event for unknown stream {event.stream_id}")
            elif isinstance(event, ConnectionTerminated):
                self.terminated_event(event)
            elif isinstance(event, (GoAwayReceived, PingAcknowledged)):
                pass
            else:
                raise InvariantViolated(f"a server got a client event: {event!r}")

    def respond(self, stream_id: int, code: StatusCode, message: str) -> None:
        self.conn.send_status(stream_id, code, message, (("x-trailer", "t"),))
        self.live.discard(stream_id)
        self.finished.add(stream_id)
        self.done_in_batch.add(stream_id)


# ---------------------------------------------------------------------------
# The gRPC machine, client role, against a hostile server


class GrpcClientDriver(_Driver):
    """A hostile server against a client-role GrpcConnection with a few calls open."""

    def __init__(self, source: Source) -> None:
        config = GrpcConfig(client_side=True,
                            max_receive_message_length=pick(source, [0, 16, 1_000, 4 * 1024 * 1024]),
                            max_header_list_size=pick(source, [1_024, 16_384]),
                            keepalive_interval=pick(source, [None, 5.0]), keepalive_timeout=2.0)
        super().__init__(source, GrpcConnection(config))
        self.peer = FrameWriter(source, client=False, large=config.max_header_list_size * 2)
        self.headers_seen: set[int] = set()
        self.half_closed: set[int] = set()

    def start_call(self) -> None:
        source = self.source
        if not self.conn.accepting_calls:
            return
        try:
            sid = self.conn.start_call(
                pick(source, ["/s/Echo", "/s/Stream"]), (("x-a", "1"), ("x-b-bin", b"\xff")),
                timeout=pick(source, [None, 1.0, 30.0]), now=self.now, encoding=pick(source, [None, "gzip"]))
        except CallLimitReached:
            return
        self.started.add(sid)
        self.live.add(sid)
        self.peer.streams.append(sid)
        for _ in range(source.integer(0, 2)):
            self.conn.send_message(sid, source.blob(40), compress=source.flag())
        if source.flag():
            self.conn.end_stream(sid)
            self.half_closed.add(sid)

    def run(self) -> None:
        source = self.source
        self.conn.initiate(self.now)
        for _ in range(source.integer(1, 3)):
            self.start_call()
        self.drain()
        if source.integer(0, 7):
            self.feed(raw_frame(SETTINGS, 0, 0, b""))
        while source.more() and not self.terminated:
            self.feed(self.peer_bytes())
            self.act()
            self.step_time()
        self.finish()

    def act(self) -> None:
        source = self.source
        action = source.integer(0, 9)
        live = sorted(self.live)
        if action == 0:
            self.start_call()
        elif action == 1 and live:
            sid = pick(source, live)
            self.conn.cancel(sid)
            self.live.discard(sid)
            self.ended.add(sid)
        elif action == 2 and live:
            sid = pick(source, live)
            if sid not in self.half_closed:
                self.conn.send_message(sid, source.blob(40))
        elif action == 3 and not self.terminated:
            self.conn.ping(self.now)
        elif action == 4:
            self.handle(self.conn.go_away(now=self.now))
        self.drain()

    def peer_bytes(self) -> bytes:
        source, peer = self.source, self.peer
        kind = source.integer(0, 9)
        if kind <= 1:
            return peer.headers(peer.stream_id(), response_headers(source, peer.large),
                                end_stream=source.integer(0, 3) == 0)
        if kind <= 4:
            return peer.data(peer.stream_id())
        if kind <= 6:
            return peer.headers(peer.stream_id(), trailer_headers(source, peer.large), end_stream=True)
        if kind <= 8:
            return peer.control()
        return peer.garbage()

    def handle(self, events: list[Any]) -> None:
        for event in events:
            if isinstance(event, ResponseHeadersReceived):
                sid = event.stream_id
                check(sid in self.live, f"response headers for a call that is not live ({sid})")
                check(sid not in self.headers_seen, f"response headers twice on stream {sid}")
                self.headers_seen.add(sid)
            elif isinstance(event, MessageReceived):
                check(event.stream_id in self.live, f"message on a call that is not live ({event.stream_id})")
                self.conn.acknowledge(event.stream_id, event.flow_controlled_length)
            elif isinstance(event, CallEnded):
                check(event.stream_id in self.live, f"CallEnded for a call that is not live ({event.stream_id})")
                check(isinstance(event.status, StatusCode), "CallEnded without a StatusCode")
                self.end(event.stream_id)
            elif isinstance(event, SendBufferDrained):
                check(event.stream_id in self.started, f"drain event for unknown stream {event.stream_id}")
            elif isinstance(event, ConnectionTerminated):
                self.terminated_event(event)
            elif isinstance(event, (GoAwayReceived, PingAcknowledged)):
                pass
            else:
                raise InvariantViolated(f"a client got a server event: {event!r}")


# ---------------------------------------------------------------------------
# The OpenAI JSON converter


def json_document(source: Source, depth: int = 0) -> Any:
    """A JSON value biased towards what the converters read: known keys, wrong types, big values."""
    kind = source.integer(0, 11 if depth < 6 else 6)
    if kind == 0:
        return None
    if kind == 1:
        return source.flag()
    if kind == 2:
        return pick(source, [0, 1, -1, 2**31, 2**63, -(2**70), 3.5, 1e308, -0.0, 2])
    if kind == 3:
        return source.blob(24).decode("utf-8", "replace")
    if kind == 4:
        return pick(source, _JSON_WORDS)
    if kind == 5:
        return "x" * source.integer(0, 70_000)
    if kind == 6:
        return pick(source, ["\ud800", "☺", "", " ", "\x00"])
    if kind <= 8:
        return [json_document(source, depth + 1) for _ in range(source.integer(0, 4))]
    return {pick(source, _JSON_KEYS): json_document(source, depth + 1) for _ in range(source.integer(0, 6))}


_JSON_KEYS = [
    "model", "messages", "role", "content", "type", "text", "image_url", "url", "tool_calls", "id", "function",
    "name", "arguments", "tools", "parameters", "tool_choice", "response_format", "json_schema", "schema",
    "stream", "stream_options", "include_usage", "temperature", "top_p", "n", "max_tokens", "stop", "seed",
    "logit_bias", "prompt", "input", "dimensions", "encoding_format", "instructions", "reasoning", "text",
    "choices", "delta", "message", "finish_reason", "usage", "object", "index", "logprobs", "x",
]
_JSON_WORDS = ["user", "system", "assistant", "tool", "function", "text", "image_url", "auto", "none",
               "required", "json_object", "json_schema", "m", "float", "base64", "[DONE]"]


def json_body(source: Source) -> bytes:
    """A request body: a generated document, deep nesting, or bytes that are not JSON."""
    shape = source.integer(0, 7)
    if shape == 0:
        depth = source.integer(1, 200_000)
        return b"[" * depth + b"]" * source.integer(0, depth)
    if shape == 1:
        depth = source.integer(1, 100_000)
        return b'{"model":"m","messages":' + b'[{"content":' * depth + b'"x"' + b"}]" * depth + b"}"
    if shape == 2:
        return source.blob(200)
    document = json_document(source)
    if shape == 3:
        document = {"model": "m", "messages": [{"role": "user", "content": document}]}
    elif shape == 4:
        document = {"model": "m", "input": document, "prompt": document}
    text = json.dumps(document, allow_nan=True, ensure_ascii=source.flag())
    return text.encode("utf-8", "surrogatepass")


def check_openai_body(body: bytes) -> None:
    """Every JSON parser ends in a request the engine side can use, or in a 400 with an OpenAI body."""
    for parser in (parse_chat_completion, parse_completion, parse_embedding, parse_model_response, parse_tokenize):
        try:
            parsed = parser(body)
        except InvalidRequestError as error:
            check(error.status == 400, f"{parser.__name__}: status {error.status}")
            check("message" in json.loads(error.to_json())["error"], "error body without a message")
            continue
        wire = parsed.request.SerializeToString()
        check(type(parsed.request).FromString(wire) == parsed.request, "request does not survive the wire")
        json.dumps(runtime_request(parsed.request).json)
    kinds = (("chat_completion", parse_chat_completion), ("chat_completion", parse_completion),
             ("embedding", parse_embedding), ("model_response", parse_model_response),
             ("tokenize_request", parse_tokenize))
    for kind, typed in kinds:
        try:
            verbatim = parse_json(kind, "/v1/x", body, typed)
        except InvalidRequestError as error:
            check(error.status == 400, f"verbatim {typed.__name__}: status {error.status}")
            continue
        check(verbatim.request.http_request.body == body, "the verbatim body changed")
        check(bool(verbatim.request.typed_request_incomplete) == (verbatim.typed_error is not None),
              "typed form missing without a reason")


def check_runtime_answer(body: bytes) -> None:
    """A runtime's answer, hostile or not, converts for /v1/completions or ends in a 502 with an OpenAI body."""
    for convert in (text_completion_body, text_completion_event_data):
        try:
            json.loads(convert(body))
        except UpstreamError as error:
            check(error.status == 502, f"{convert.__name__}: status {error.status}")
        except ValueError:
            check(convert is text_completion_event_data and body.strip() == b"[DONE]", "converter wrote bad JSON")
    parser = SSEParser(max_event_size=4096)
    try:
        for event in parser.receive_data(body):
            check(isinstance(event.data if isinstance(event, EventReceived) else "", str), "event data not text")
    except UpstreamError as error:
        check(error.status == 502, f"SSE parser: status {error.status}")
