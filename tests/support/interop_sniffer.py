"""A loopback TCP proxy that reports which gRPC request messages arrived compressed.

grpcio's Python server decompresses requests before a handler sees them and
does not expose the per-message compressed flag, yet the interop server
feature CompressedRequest ("expect_compressed") needs exactly that flag. This
proxy sits between a client and a grpcio server, forwards every byte
unchanged, and on the client-to-server direction parses HTTP/2 frames (HPACK
with the real ``hpack`` decoder) and the gRPC length-prefixed messages inside
DATA frames, recording each message's compressed flag per stream, keyed by
``:path``. Bytes are recorded before they are forwarded, so a handler that
has received message *i* can always read its flag.

It answers "the flags of the latest call on this path", which is exact for
the interop clients: they run one call at a time.
"""

from __future__ import annotations

import socket
import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import hpack

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
FRAME_DATA = 0x0
FRAME_HEADERS = 0x1
FRAME_CONTINUATION = 0x9
FLAG_END_HEADERS = 0x4
FLAG_PADDED = 0x8
FLAG_PRIORITY = 0x20


@dataclass
class _Stream:
    """Reassembly state of one request stream's gRPC messages."""

    path: str = ""
    flags: list[bool] = field(default_factory=list)
    prefix: bytearray = field(default_factory=bytearray)
    remaining: int = 0


class _RequestParser:
    """Parses the client-to-server byte stream of one HTTP/2 connection."""

    def __init__(self, sniffer: CompressionSniffer) -> None:
        self._sniffer = sniffer
        self._buffer = bytearray()
        self._preface_seen = False
        self._decoder = hpack.Decoder()
        self._header_block = bytearray()
        self._header_stream = 0
        self._streams: dict[int, _Stream] = {}

    def feed(self, data: bytes) -> None:
        self._buffer += data
        if not self._preface_seen:
            if len(self._buffer) < len(PREFACE):
                return
            del self._buffer[: len(PREFACE)]
            self._preface_seen = True
        while len(self._buffer) >= 9:
            length = int.from_bytes(self._buffer[0:3], "big")
            if len(self._buffer) < 9 + length:
                return
            kind, flags = self._buffer[3], self._buffer[4]
            stream_id = struct.unpack(">I", self._buffer[5:9])[0] & 0x7FFFFFFF
            payload = bytes(self._buffer[9 : 9 + length])
            del self._buffer[: 9 + length]
            self._frame(kind, flags, stream_id, payload)

    def _frame(self, kind: int, flags: int, stream_id: int, payload: bytes) -> None:
        if kind == FRAME_HEADERS:
            payload = _unpad(flags, payload)
            if flags & FLAG_PRIORITY:
                payload = payload[5:]
            self._header_stream = stream_id
            self._header_block = bytearray(payload)
            if flags & FLAG_END_HEADERS:
                self._headers_done()
        elif kind == FRAME_CONTINUATION:
            self._header_block += payload
            if flags & FLAG_END_HEADERS:
                self._headers_done()
        elif kind == FRAME_DATA and stream_id in self._streams:
            self._data(self._streams[stream_id], _unpad(flags, payload))

    def _headers_done(self) -> None:
        # raw: grpc core may negotiate true-binary metadata, which is not UTF-8.
        headers = dict(self._decoder.decode(bytes(self._header_block), raw=True))
        path = headers.get(b":path")
        if path is not None and self._header_stream not in self._streams:
            stream = _Stream(path=path.decode("ascii"))
            self._streams[self._header_stream] = stream
            self._sniffer._opened(stream)

    def _data(self, stream: _Stream, data: bytes) -> None:
        view = memoryview(data)
        while view:
            if stream.remaining:
                step = min(stream.remaining, len(view))
                stream.remaining -= step
                view = view[step:]
                continue
            need = 5 - len(stream.prefix)
            stream.prefix += view[:need]
            view = view[need:]
            if len(stream.prefix) == 5:
                self._sniffer._message(stream, compressed=bool(stream.prefix[0] & 1))
                stream.remaining = int.from_bytes(stream.prefix[1:5], "big")
                stream.prefix.clear()


def _unpad(flags: int, payload: bytes) -> bytes:
    if flags & FLAG_PADDED:
        pad = payload[0]
        return payload[1 : len(payload) - pad]
    return payload


class CompressionSniffer:
    """Proxy from ``port`` to ``upstream_port`` on 127.0.0.1, recording request compression."""

    def __init__(self, upstream_port: int) -> None:
        self._upstream_port = upstream_port
        self._lock = threading.Lock()
        self._latest: dict[str, _Stream] = {}
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def request_compressed(self, path: str, index: int) -> bool:
        """Whether message ``index`` of the latest call on ``path`` arrived compressed."""
        with self._lock:
            return self._latest[path].flags[index]

    def close(self) -> None:
        self._closed = True
        self._listener.close()

    def _opened(self, stream: _Stream) -> None:
        with self._lock:
            self._latest[stream.path] = stream

    def _message(self, stream: _Stream, compressed: bool) -> None:
        with self._lock:
            stream.flags.append(compressed)

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self._upstream_port))
            for sock in (client, upstream):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            parser = _RequestParser(self)
            threading.Thread(target=_pump, args=(client, upstream, parser.feed), daemon=True).start()
            threading.Thread(target=_pump, args=(upstream, client, None), daemon=True).start()


def _pump(source: socket.socket, sink: socket.socket, observe: Callable[[bytes], None] | None) -> None:
    try:
        while data := source.recv(1 << 20):
            if observe is not None:
                observe(data)
            sink.sendall(data)
    except OSError:
        pass
    finally:
        for sock in (source, sink):
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
