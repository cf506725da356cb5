"""A hostile HTTP/2 client writing raw frames into a pure gRPC server machine, for budget and window tests."""

from __future__ import annotations

import struct

from hpack import Encoder

from protocol.grpc import ConnectionTerminated, GrpcConfig, GrpcConnection
from tools.fuzz.drivers import HEADERS, PREFACE, SETTINGS, raw_frame


END_STREAM, ACK, END_HEADERS = 0x1, 0x1, 0x4


REQUEST = [(b":method", b"POST"), (b":scheme", b"http"), (b":path", b"/s/M"),
           (b":authority", b"x"), (b"te", b"trailers"), (b"content-type", b"application/grpc")]


class Peer:
    """A hostile client: raw frames with a real HPACK encoder, fed to a server machine."""

    def __init__(self, **config: object) -> None:
        self.server = GrpcConnection(GrpcConfig(client_side=False, **config))  # type: ignore[arg-type]
        self.server.initiate(0)
        self.server.data_to_send()
        self.encoder = Encoder()
        self.events: list[object] = []
        self.next_sid = 1
        self.feed(PREFACE + raw_frame(SETTINGS, 0, 0, b""))

    def feed(self, data: bytes, now: float = 0, chunk: int | None = None) -> list[object]:
        """Give ``data`` to the server (``chunk`` bytes per call), and what it held back."""
        got: list[object] = []
        step = chunk or max(1, len(data))
        for i in range(0, len(data), step):
            got += self.server.receive_data(data[i:i + step], now)
            while self.server.has_pending_input:
                got += self.server.receive_pending(now)
        self.events += got
        return got

    def headers(self, sid: int | None = None, end_stream: bool = False,
                extra: list[tuple[bytes, bytes]] | None = None) -> tuple[int, bytes]:
        if sid is None:
            sid, self.next_sid = self.next_sid, self.next_sid + 2
        block = self.encoder.encode(REQUEST + (extra or []))
        flags = END_HEADERS | (END_STREAM if end_stream else 0)
        return sid, raw_frame(HEADERS, flags, sid, block)

    def terminated(self) -> list[ConnectionTerminated]:
        return [e for e in self.events if isinstance(e, ConnectionTerminated)]


def message(payload: bytes) -> bytes:
    return struct.pack(">BI", 0, len(payload)) + payload
