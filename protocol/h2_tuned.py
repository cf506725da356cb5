"""h2, narrowly adjusted for gRPC: correctness where h2's defaults differ
from what gRPC needs, and speed where h2 does work on every frame that a
gRPC connection does not need.

Everything here leans on h2 4.4 internals (``_receive_frame``, the frame
dispatch table, stream state machines), so each adjustment is small, says
what it replaces, and is held to h2's own behaviour by
``tests/test_grpc_bigframes.py`` and ``tests/test_h2_tuned.py``.
"""

from __future__ import annotations

import struct
from typing import TYPE_CHECKING

import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.exceptions
import h2.frame_buffer
import h2.stream
from hyperframe.frame import DataFrame, Frame, GoAwayFrame, HeadersFrame, RstStreamFrame

if TYPE_CHECKING:
    from h2._typing import Buffer

__all__ = ["DIRECT_DATA_MIN", "TunedFrameBuffer", "TunedH2Connection"]

#: DATA frames at least this large are queued by reference
#: (:meth:`TunedH2Connection.send_data_parts`) and received with one copy
#: (:class:`TunedFrameBuffer`); below it, copying is cheaper than the extra
#: buffers.
DIRECT_DATA_MIN = 64 * 1024
_ERR_REFUSED_STREAM = int(h2.errors.ErrorCodes.REFUSED_STREAM)
#: RFC 9113 4.1 frame header of a DATA frame: 24-bit length (as 16 + 8
#: bits), type 0, flags, stream id.
_DATA_HEADER = struct.Struct(">HBBBL")
_DATA_TYPE = 0x0
_PADDED = 0x8


class _QuietDataFrame(DataFrame):
    """A DATA frame whose repr does not hex-dump its payload.

    h2 4.x formats ``repr(frame)`` for a trace log line on *every* received
    frame, logging enabled or not, and hyperframe's DATA repr hex-encodes
    the whole payload first (~4.7 ms per MiB; PERF-NOTES.md).  Received
    DATA frames are re-classed to this subclass before h2 sees them; h2
    dispatches on the exact class, hence the extra dispatch-table entry.
    """

    def _body_repr(self) -> str:
        return f"<{len(self.data)} bytes>"


class TunedFrameBuffer(h2.frame_buffer.FrameBuffer):
    """h2's frame buffer, less most copies of a large DATA frame.

    h2 4.4 appends every read to one bytearray (a copy, and more when it
    grows), slices a frame's body out of it (another) and parses that into
    bytes (another).  The body of a large, unpadded DATA frame on a stream
    is instead collected as the reads themselves and joined once, when
    complete, into the frame's data.  Anything else, including anything
    malformed or out of place, takes h2's own path, so errors are h2's;
    the one difference is that an oversized large DATA frame is refused as
    soon as its header is in, where h2 would buffer all of it first.
    """

    def __init__(self, server: bool = False) -> None:
        super().__init__(server)
        # The large DATA frame being collected: its header, the pieces of
        # its body so far, and how many body bytes are still to come.
        self._header: bytes | None = None
        self._body: list[bytes | memoryview] = []
        self._body_left = 0

    def add_data(self, data: Buffer) -> None:
        if self._body_left:
            view = memoryview(data)
            take = min(self._body_left, len(view))
            self._body.append(view[:take])
            self._body_left -= take
            if take == len(view):
                return
            data = view[take:]
        super().add_data(data)

    def __next__(self) -> Frame:
        header = self._header
        if header is not None:
            if self._body_left:
                raise StopIteration
            body = b"".join(self._body)
            self._header = None
            self._body = []
            return self._data_frame(header, body)
        data = self._data
        if (len(data) >= 9 and data[3] == _DATA_TYPE
                and not data[4] & _PADDED and not self._headers_buffer
                and int.from_bytes(data[5:9], "big") & 0x7FFF_FFFF):
            length = int.from_bytes(data[:3], "big")
            if length >= DIRECT_DATA_MIN:
                self._validate_frame_length(length)
                header = bytes(data[:9])
                with memoryview(data) as view:
                    body = view[9:9 + length].tobytes()
                del data[:9 + length]
                if len(body) == length:
                    return self._data_frame(header, body)
                self._header = header
                self._body = [body]
                self._body_left = length - len(body)
                raise StopIteration
        return super().__next__()

    @staticmethod
    def _data_frame(header: bytes, body: bytes) -> Frame:
        frame, _ = Frame.parse_frame_header(memoryview(header))
        # What DataFrame.parse_body does for an unpadded frame, minus its
        # copy of the body.
        assert isinstance(frame, DataFrame)
        frame.data = body
        frame.body_len = len(body)
        return frame


class TunedH2Connection(h2.connection.H2Connection):
    """h2 with the adjustments gRPC needs and nothing else.

    1. The cheap DATA repr above.
    2. Graceful GOAWAY.  h2's connection state machine closes on any GOAWAY
       sent or received, which would forbid the drain gRPC requires (calls
       up to the last stream id must finish).  A GOAWAY with NO_ERROR is
       therefore sent and received here without touching h2's connection
       state; GOAWAYs carrying an error still go through h2 unchanged.
    3. A new stream past our SETTINGS_MAX_CONCURRENT_STREAMS is refused
       with RST_STREAM(REFUSED_STREAM), the stream error RFC 9113 5.1.2
       asks for, where h2 raises a connection error.  A client may exceed
       the limit innocently (calls started before our SETTINGS arrive), and
       a refused stream is safe for it to retry.
    4. Large DATA frames queued without copying (:meth:`send_data_parts`)
       and received with one copy instead of three (:class:`TunedFrameBuffer`).
    """

    def __init__(self, config: h2.config.H2Configuration) -> None:
        super().__init__(config)
        self.incoming_buffer = TunedFrameBuffer(server=not config.client_side)
        self._frame_dispatch_table[_QuietDataFrame] = self._receive_data_frame
        # Output queued ahead of _data_to_send: h2's bytes up to a gathered
        # DATA frame, then that frame's header and parts, in wire order.
        self._gathered: list[bytes | memoryview] = []

    def _receive_frame(self, frame: Frame) -> list[h2.events.Event]:
        if frame.__class__ is DataFrame:
            frame.__class__ = _QuietDataFrame
        return super()._receive_frame(frame)

    def _receive_headers_frame(
        self, frame: HeadersFrame,
    ) -> tuple[list[Frame], list[h2.events.Event]]:
        stream_id = frame.stream_id
        if (not self.config.client_side and stream_id not in self.streams
                and stream_id % 2 == 1 and stream_id > self.highest_inbound_stream_id
                and self.open_inbound_streams >= self.local_settings.max_concurrent_streams):
            # Decode anyway: the HPACK table must stay in step with the peer.
            h2.connection._decode_headers(self.decoder, frame.data)
            self.highest_inbound_stream_id = stream_id
            self._closed_streams[stream_id] = h2.stream.StreamClosedBy.SEND_RST_STREAM
            return [RstStreamFrame(stream_id, error_code=_ERR_REFUSED_STREAM)], []
        return super()._receive_headers_frame(frame)

    def _receive_goaway_frame(
        self, frame: GoAwayFrame,
    ) -> tuple[list[Frame], list[h2.events.Event]]:
        if frame.error_code != 0:
            return super()._receive_goaway_frame(frame)
        event = h2.events.ConnectionTerminated()
        event.error_code = h2.errors.ErrorCodes.NO_ERROR
        event.last_stream_id = frame.last_stream_id
        event.additional_data = frame.additional_data or None
        return [], [event]

    def send_graceful_goaway(self, last_stream_id: int, debug_data: bytes) -> None:
        """Queue GOAWAY(NO_ERROR) and keep the connection usable for drain."""
        frame = GoAwayFrame(stream_id=0, last_stream_id=last_stream_id, error_code=0,
                            additional_data=debug_data)
        self._prepare_for_sending([frame])

    def send_data_parts(self, stream_id: int, parts: list[bytes | memoryview],
                        size: int) -> None:
        """Queue one DATA frame (no flags, no padding) whose payload is
        ``parts`` (``size`` bytes in all), referencing them instead of
        copying them.

        ``send_data`` copies a payload three or four times on its way out
        (memoryview to bytes, frame serialisation, the output bytearray,
        ``data_to_send``): about half the cost of streaming 1 MiB messages
        (PERF-NOTES.md).  This does the bookkeeping ``send_data`` does, in
        the same order and with the same errors (h2 4.4), and hands the
        bytes over by reference; END_STREAM still goes through h2.
        """
        window = self.local_flow_control_window(stream_id)  # StreamClosedError
        if size > window:
            raise h2.exceptions.FlowControlError(
                f"Cannot send {size} bytes, flow control window is {window}")
        if size > self.max_outbound_frame_size:
            raise h2.exceptions.FrameTooLargeError(
                f"Cannot send frame size {size}, max frame size is "
                f"{self.max_outbound_frame_size}")
        self.state_machine.process_input(h2.connection.ConnectionInputs.SEND_DATA)
        stream = self.streams[stream_id]
        stream.state_machine.process_input(h2.stream.StreamInputs.SEND_DATA)
        stream.outbound_flow_control_window -= size
        self.outbound_flow_control_window -= size
        if self._data_to_send:
            self._gathered.append(bytes(self._data_to_send))
            self._data_to_send = bytearray()
        self._gathered.append(_DATA_HEADER.pack(size >> 8, size & 0xFF, 0, 0, stream_id))
        self._gathered.extend(parts)

    def buffers_to_send(self) -> list[bytes | memoryview]:
        """Everything queued, in order, as buffers (empties the queue)."""
        buffers = self._gathered
        self._gathered = []
        if self._data_to_send:
            buffers.append(bytes(self._data_to_send))
            self._data_to_send = bytearray()
        return buffers

    def data_to_send(self, amount: int | None = None) -> bytes:
        if self._gathered:
            self._data_to_send[:0] = b"".join(self._gathered)
            self._gathered = []
        return super().data_to_send(amount)

    def clear_outbound_data_buffer(self) -> None:
        self._gathered = []
        super().clear_outbound_data_buffer()
